//! The decode node's request errors, and their one mapping to gRPC statuses (starting and
//! serving the node fail with [`tandem_worker::NodeError`]).

use tonic::Status;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid {field}: {reason}")]
    InvalidArgument { field: &'static str, reason: String },

    #[error("decode node full: {detail}")]
    Capacity { detail: String },

    #[error("no KV arrived for {waited_ms} ms")]
    KvTimeout { waited_ms: u64 },

    #[error(transparent)]
    Transfer(#[from] tandem_transfer::Error),

    #[error("engine: {0}")]
    Engine(#[from] tandem_engine::Error),

    /// The scheduler's step or KV import failed; the sequence is gone.
    #[error("engine: {0}")]
    Step(std::sync::Arc<tandem_engine::Error>),

    #[error("deadline exceeded")]
    Deadline,

    #[error("the decode node is shutting down")]
    ShuttingDown,

    /// Draining: the stream stops here (or, not started, is refused), and the KV of its first
    /// `tokens` tokens (0: none) waits for the peer that continues it to fetch it.
    #[error("the decode node is draining; {tokens} tokens of KV are kept for a peer to fetch")]
    HandedOff { tokens: usize },
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        let status = match &e {
            Error::InvalidArgument { .. } => Status::invalid_argument(e.to_string()),
            Error::Capacity { .. } => Status::resource_exhausted(e.to_string()),
            Error::KvTimeout { .. } | Error::ShuttingDown => Status::unavailable(e.to_string()),
            Error::Transfer(t) => Status::new(t.request_code(), e.to_string()),
            Error::Deadline => Status::deadline_exceeded(e.to_string()),
            Error::Engine(tandem_engine::Error::InvalidArgument { .. }) => {
                Status::invalid_argument(e.to_string())
            }
            Error::Engine(_) | Error::Step(_) => return tandem_worker::node_failure(&e, "decode"),
            Error::HandedOff { tokens } => {
                let mut s = Status::unavailable(e.to_string());
                s.metadata_mut()
                    .insert(tandem_proto::HANDOFF_METADATA, (*tokens as u64).into());
                s
            }
        };
        tandem_worker::logged(status, &e, "decode")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The node's own failure is one another node may not have: UNAVAILABLE, which the router
    /// fails over, and never INTERNAL, which the gRPC layer would rewrite to INVALID_ARGUMENT.
    #[test]
    fn an_engine_failure_is_unavailable() {
        let e = Error::Engine(tandem_engine::Error::KvExhausted {
            needed_blocks: 16,
            free_blocks: 14,
        });
        assert_eq!(Status::from(e).code(), tonic::Code::Unavailable);
    }
}
