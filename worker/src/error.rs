//! The errors of the services every worker serves alike (`Worker.Adopt`, `Worker.Release`, a
//! peer's `KvTransfer.Fetch` of its cache), and their one mapping to gRPC statuses. Each role's
//! own requests (`Prefill`, `Decode`) have their role's error type; starting and serving a node
//! fail with [`crate::NodeError`].

use tonic::Status;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid {field}: {reason}")]
    InvalidArgument { field: &'static str, reason: String },

    #[error("the node is draining")]
    Draining,

    #[error("the node is shutting down")]
    ShuttingDown,

    #[error("the cache is off")]
    CacheOff,

    #[error("no room for a session of {tokens} tokens")]
    NoRoom { tokens: usize },

    #[error(transparent)]
    Engine(#[from] tandem_engine::Error),
}

impl Error {
    /// An id over its bound ([`tandem_proto::check_ids`]'s answer).
    pub fn id((field, reason): (&'static str, String)) -> Self {
        Self::InvalidArgument { field, reason }
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        let status = match &e {
            Error::InvalidArgument { .. }
            | Error::Engine(tandem_engine::Error::InvalidArgument { .. }) => {
                Status::invalid_argument(e.to_string())
            }
            Error::Draining | Error::ShuttingDown => Status::unavailable(e.to_string()),
            Error::CacheOff => Status::failed_precondition(e.to_string()),
            Error::NoRoom { .. } => Status::resource_exhausted(e.to_string()),
            Error::Engine(_) => return node_failure(&e, "worker"),
        };
        logged(status, &e, "worker")
    }
}

/// `status`, the answer to a `service` request (`prefill`, `decode`, `worker`) that failed
/// with `e` through the caller's input or the node's state (draining, full), logged at DEBUG:
/// it is the caller's to see. Every worker error type's mapping to a status ends here or in
/// [`node_failure`].
pub fn logged(status: Status, e: &dyn std::fmt::Display, service: &str) -> Status {
    tracing::debug!(error = %e, code = ?status.code(), service, "a request ended with an error");
    status
}

/// The answer to a `service` request that failed through the node's own fault (its engine),
/// logged at ERROR: UNAVAILABLE, since another node may well serve it (the router fails it
/// over). Never INTERNAL, which the nodes' gRPC layer reads, in a response's headers, as a
/// request its codec could not read (`tandem_net`'s documented codes).
pub fn node_failure(e: &dyn std::fmt::Display, service: &str) -> Status {
    tracing::error!(error = %e, service, "a request failed");
    Status::unavailable(format!("{service} failed on this node"))
}
