//! KV wire format v1 and the `KvTransfer` service and client: how a prefill node streams a
//! sequence's KV cache to a decode node. No candle here: bytes in, bytes out.
//!
//! - [`format`]: the header, chunk and trailer as domain types, and the receiver's validation.
//! - [`reservation`]: transfer ids bound to a waiting request, single-use, with a lease.
//! - [`service`]: the receiving gRPC service; [`client`]: the sending side.
//! - [`fetch`]: peer fetch, a worker pulling cached KV from the one that holds it.
//! - [`relay`]: a pipelined prefill's hop, a stage reading the KV the stage before computes.

pub mod client;
mod error;
pub mod fetch;
pub mod format;
pub mod metrics;
pub mod relay;
pub mod reservation;
pub mod service;

pub use client::{Heartbeat, KvPush};
pub use error::{Error, Result};
pub use fetch::{Cached, FetchSource, FetchWant, KvSource};
pub use format::{Chunk, Expectation, Header, KvDtype, KvKind, ReceivedKv, WireLayout};
pub use metrics::TransferMetrics;
pub use relay::RelayReceiver;
pub use reservation::{ReservationGuard, Reservations};
pub use service::KvTransferService;
