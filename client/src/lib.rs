//! The client side of a Tandem cluster, shared by the `tandem` binary (`chat`, `generate
//! --server`) and `tandem-bench`: a connection to a router's gRPC API with its TLS and API key
//! ([`client`]), one streamed generation read frame by frame ([`stream()`]), and the model
//! arguments both binaries take ([`ModelArgs`], [`KvDtype`]).

mod args;
mod connect;
mod stream;

pub use args::{KvDtype, ModelArgs};
pub use connect::{ApiKey, Client, ServerTlsArgs, client, explain};
pub use stream::{Streamed, stream};
