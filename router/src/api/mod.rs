//! The API front: the protocols clients speak, each converting its requests into one
//! `tandem.v1` `GenerateRequest` started through [`crate::dispatch::GenerationService::start`],
//! and the frames back into its own answers. gRPC ([`grpc`]) and the OpenAI HTTP API
//! ([`openai`]); the HTTP APIs find a request's affinity session alike ([`session`]).

pub mod grpc;
pub mod openai;
pub mod session;
