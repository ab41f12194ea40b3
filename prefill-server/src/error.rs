//! The prefill node's request errors, and their one mapping to gRPC statuses (starting and
//! serving the node fail with [`tandem_worker::NodeError`]).

use tonic::Status;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid {field}: {reason}")]
    InvalidArgument { field: &'static str, reason: String },

    #[error("prefill queue full ({depth} requests waiting)")]
    QueueFull { depth: usize },

    #[error("KV transfer failed: {0}")]
    Transfer(#[from] tandem_transfer::Error),

    /// The stage before this one in a pipelined prefill failed to send its KV.
    #[error("pipeline stage {addr} failed: {source}")]
    Upstream {
        addr: String,
        source: tandem_transfer::Error,
    },

    #[error("engine: {0}")]
    Engine(#[from] tandem_engine::Error),

    #[error("the request was cancelled")]
    Cancelled,

    #[error("the prefill node is shutting down")]
    ShuttingDown,
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        let status = match &e {
            Error::InvalidArgument { .. } => Status::invalid_argument(e.to_string()),
            Error::QueueFull { .. } => Status::resource_exhausted(e.to_string()),
            // Corruption stays DATA_LOSS; every other transfer failure is retryable.
            Error::Transfer(t) => Status::new(t.request_code(), e.to_string()),
            Error::Engine(tandem_engine::Error::InvalidArgument { .. }) => {
                Status::invalid_argument(e.to_string())
            }
            Error::Cancelled => Status::cancelled(e.to_string()),
            Error::ShuttingDown => Status::unavailable(e.to_string()),
            Error::Upstream { addr, .. } => {
                let mut status = Status::unavailable(e.to_string());
                if let Ok(value) = addr.parse() {
                    (status.metadata_mut()).insert(tandem_proto::FAILED_STAGE_METADATA, value);
                }
                status
            }
            Error::Engine(_) => return tandem_worker::node_failure(&e, "prefill"),
        };
        tandem_worker::logged(status, &e, "prefill")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pipeline stage that failed is named, so the router suspects it and not the caller.
    #[test]
    fn an_upstream_failure_names_its_stage() {
        let e = Error::Upstream {
            addr: "10.0.0.7:50051".into(),
            source: tandem_transfer::Error::ReceiverGone,
        };
        let status = Status::from(e);
        assert_eq!(status.code(), tonic::Code::Unavailable);
        let named = status.metadata().get(tandem_proto::FAILED_STAGE_METADATA);
        assert_eq!(named.and_then(|v| v.to_str().ok()), Some("10.0.0.7:50051"));
    }

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
