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
            Error::Engine(_) => Status::internal("prefill failed"),
        };
        tandem_worker::logged(status, &e, "prefill")
    }
}
