//! The contracts shared by every Tandem process: the `tandem.v1` protobuf messages and services
//! (client API, worker services, KV wire format v1), generated at build time from
//! `tandem/v1/*.proto`.
//!
//! Only generated code, constants, the block-hash spec ([`block_hash`]) and the shared transport
//! ([`net`]) live here; conversions to domain types belong to the crate that owns each domain
//! type.

pub mod block_hash;
pub mod net;

pub mod v1 {
    #![allow(missing_debug_implementations, clippy::all)]
    tonic::include_proto!("tandem.v1");
}

/// The encoded file descriptor set of every `tandem.v1` file, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("tandem_descriptor");

/// The largest gRPC message any Tandem process sends or accepts. Both ends set it explicitly;
/// KV chunks stay far below it (see `tandem-transfer`).
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;
