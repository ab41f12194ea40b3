//! The router's errors, and their one mapping to the statuses clients may see: nothing internal
//! or transport-level ever reaches a client as UNKNOWN or INTERNAL.

use tonic::{Code, Status};

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid {field}: {reason}")]
    InvalidArgument { field: &'static str, reason: String },

    #[error("router busy: {inflight} requests in flight")]
    Busy { inflight: usize },

    #[error(
        "router busy: {ahead} requests queued ahead, about {} ms of waiting, past this request's deadline in {} ms",
        wait.as_millis(),
        left.as_millis()
    )]
    QueueTooLong {
        ahead: usize,
        wait: std::time::Duration,
        left: std::time::Duration,
    },

    #[error(
        "the predicted time to first token, about {} ms, misses this request's target of {} ms (x-slo-ttft-ms): the cluster cannot meet it now",
        predicted.as_millis(),
        target.as_millis()
    )]
    TtftTarget {
        predicted: std::time::Duration,
        target: std::time::Duration,
    },

    /// The message never says which of missing, malformed or unknown the key was.
    #[error("a valid API key is required (authorization: Bearer KEY)")]
    Unauthenticated,

    #[error("rate limit reached for this API key: {what}")]
    RateLimited {
        what: &'static str,
        retry_after: std::time::Duration,
    },

    #[error("no healthy {role} replica (replicas of another model or KV dtype are not used)")]
    NoReplica { role: &'static str },

    #[error("no model is known yet (no worker has answered)")]
    NotReady,

    #[error("the endpoint picker knows no endpoint: --picker-endpoints resolved to none")]
    NoEndpoint,

    #[error("the model '{asked}' does not exist; this cluster serves: {served}")]
    UnknownModel { asked: String, served: String },

    #[error("deadline exceeded")]
    Deadline,

    /// The deadline passed while the request waited in the router's queue.
    #[error(
        "deadline exceeded after {} ms in the router's queue, waiting for {waiting_for}",
        waited.as_millis()
    )]
    QueueTimeout {
        waited: std::time::Duration,
        waiting_for: &'static str,
    },

    #[error("the router is shutting down")]
    ShuttingDown,

    /// The router drains: it finishes the streams it runs and takes no new request.
    #[error(
        "the router is draining and takes no new requests: send them to another router of the \
         cluster, or again once this one is back"
    )]
    Draining,

    /// A downstream call failed; `code` is already one a client may see.
    #[error("{hop}: {message}")]
    Downstream {
        hop: &'static str,
        code: Code,
        message: String,
    },

    #[error("serving failed: {0}")]
    Serve(#[from] tonic::transport::Error),
}

/// `Err` of an [`Error::InvalidArgument`] naming `field`.
pub(crate) fn invalid<T>(field: &'static str, reason: impl Into<String>) -> Result<T> {
    Err(Error::InvalidArgument {
        field,
        reason: reason.into(),
    })
}

impl Error {
    /// Wraps a downstream status, turning anything a client must not see (UNKNOWN, INTERNAL,
    /// transport and precondition failures) into UNAVAILABLE, which is retryable. CANCELLED is
    /// one of them: the router cancels no call it still awaits (a client's cancel and the
    /// deadline are caught before a downstream status is read), so a downstream CANCELLED is
    /// tonic reporting a broken connection.
    pub fn downstream(hop: &'static str, s: &Status) -> Self {
        let code = match s.code() {
            c @ (Code::InvalidArgument
            | Code::ResourceExhausted
            | Code::DeadlineExceeded
            | Code::DataLoss
            | Code::Unavailable) => c,
            _ => Code::Unavailable,
        };
        Error::Downstream {
            hop,
            code,
            message: s.message().to_string(),
        }
    }

    pub fn code(&self) -> Code {
        match self {
            Error::InvalidArgument { .. } => Code::InvalidArgument,
            Error::Busy { .. }
            | Error::QueueTooLong { .. }
            | Error::TtftTarget { .. }
            | Error::RateLimited { .. } => Code::ResourceExhausted,
            Error::Unauthenticated => Code::Unauthenticated,
            Error::UnknownModel { .. } => Code::NotFound,
            Error::NoReplica { .. }
            | Error::NoEndpoint
            | Error::NotReady
            | Error::ShuttingDown
            | Error::Draining
            | Error::Serve(_) => Code::Unavailable,
            Error::Deadline | Error::QueueTimeout { .. } => Code::DeadlineExceeded,
            Error::Downstream { code, .. } => *code,
        }
    }

    /// How long a client should wait before retrying (gRPC A6's retry pushback, HTTP's
    /// Retry-After): RESOURCE_EXHAUSTED has one, and so has a draining router's refusal.
    pub fn retry_after(&self) -> Option<std::time::Duration> {
        match self {
            Error::Draining => Some(std::time::Duration::from_secs(1)),
            Error::RateLimited { retry_after, .. } => Some(*retry_after),
            // When the queue ahead should have drained.
            Error::QueueTooLong { wait, .. } => Some(*wait),
            // When the work ahead that the target misses by should be done, 200 ms at least.
            Error::TtftTarget { predicted, target } => Some(
                predicted
                    .saturating_sub(*target)
                    .max(std::time::Duration::from_millis(200)),
            ),
            _ if self.code() == Code::ResourceExhausted => {
                Some(std::time::Duration::from_millis(200))
            }
            _ => None,
        }
    }
}

impl From<tandem_tokenizer::Error> for Error {
    fn from(e: tandem_tokenizer::Error) -> Self {
        let field = match &e {
            tandem_tokenizer::Error::InvalidArgument { field, .. } => field,
            tandem_tokenizer::Error::Template { .. } => &"messages",
            _ => &"prompt",
        };
        Error::InvalidArgument {
            field,
            reason: e.to_string(),
        }
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        let code = e.code();
        tracing::debug!(error = %e, ?code, "request failed");
        let mut status = Status::new(code, e.to_string());
        if let Some(wait) = e.retry_after() {
            // Retry pushback (gRPC A6): the client may retry after this many milliseconds.
            status.metadata_mut().insert(
                "grpc-retry-pushback-ms",
                tonic::metadata::MetadataValue::from(wait.as_millis().max(1) as u64),
            );
        }
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downstream_failures_reach_clients_as_codes_they_may_see() {
        for (got, want) in [
            (Code::Cancelled, Code::Unavailable),
            (Code::Unknown, Code::Unavailable),
            (Code::Internal, Code::Unavailable),
            (Code::FailedPrecondition, Code::Unavailable),
            (Code::InvalidArgument, Code::InvalidArgument),
            (Code::ResourceExhausted, Code::ResourceExhausted),
            (Code::DataLoss, Code::DataLoss),
        ] {
            let e = Error::downstream("decode", &Status::new(got, "x"));
            assert_eq!(e.code(), want, "{got:?}");
        }
    }
}
