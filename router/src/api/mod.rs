//! The API front: the protocols clients speak, each converting its requests into one
//! `tandem.v1` `GenerateRequest` started through [`crate::dispatch::GenerationService::start`],
//! and the frames back into its own answers. gRPC ([`grpc`]) and the OpenAI HTTP API
//! ([`openai`]).

pub mod grpc;
pub mod openai;
