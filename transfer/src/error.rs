//! Why a transfer failed. Every receiver-side rejection has a stable `reason()` label (counted
//! in `tandem_kv_transfer_rejects_total`) and a gRPC code the sender sees.

use tonic::{Code, Status};

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[error("malformed push: {detail}")]
    Malformed { detail: String },

    #[error("unsupported KV wire format version {got} (this node speaks {supported})")]
    Version { got: u32, supported: u32 },

    #[error("model fingerprint does not match the decode node's model")]
    Fingerprint,

    #[error("KV layout mismatch: {detail}")]
    Layout { detail: String },

    #[error("tokens do not match the reservation: {detail}")]
    Tokens { detail: String },

    #[error("header too large: {detail}")]
    HeaderTooLarge { detail: String },

    #[error("no reservation for transfer {transfer_id} (unknown, or its lease expired)")]
    UnknownTransfer { transfer_id: String },

    #[error("transfer {transfer_id} was already used")]
    Reused { transfer_id: String },

    #[error("chunk rejected: {detail}")]
    Chunk { detail: String },

    #[error("CRC32C mismatch in layer {layer} {kind} tokens {token_start}..")]
    ChunkCrc {
        layer: u32,
        kind: &'static str,
        token_start: u32,
    },

    #[error("whole-transfer digest mismatch")]
    Digest,

    #[error("the sender aborted: {reason}")]
    Aborted { reason: String },

    #[error("the receiver gave up on the transfer (lease expired or request gone)")]
    ReceiverGone,

    #[error("no frame for {waited_ms} ms")]
    Stalled { waited_ms: u64 },

    /// The transport failed, or the receiver rejected the push; the status is the peer's.
    #[error("transfer failed: {code:?}: {message}")]
    Transport { code: Code, message: String },
}

impl Error {
    /// Every [`Error::reason`], so that the rejects metric can show each at 0 from the start.
    pub const REASONS: [&'static str; 15] = [
        "malformed",
        "version",
        "fingerprint",
        "layout",
        "tokens",
        "header_too_large",
        "unknown_transfer",
        "reused",
        "chunk",
        "crc",
        "digest",
        "aborted",
        "receiver_gone",
        "stalled",
        "transport",
    ];

    /// The label counted in the rejects metric.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::Malformed { .. } => "malformed",
            Error::Version { .. } => "version",
            Error::Fingerprint => "fingerprint",
            Error::Layout { .. } => "layout",
            Error::Tokens { .. } => "tokens",
            Error::HeaderTooLarge { .. } => "header_too_large",
            Error::UnknownTransfer { .. } => "unknown_transfer",
            Error::Reused { .. } => "reused",
            Error::Chunk { .. } => "chunk",
            Error::ChunkCrc { .. } => "crc",
            Error::Digest => "digest",
            Error::Aborted { .. } => "aborted",
            Error::ReceiverGone => "receiver_gone",
            Error::Stalled { .. } => "stalled",
            Error::Transport { .. } => "transport",
        }
    }

    pub fn code(&self) -> Code {
        match self {
            Error::Malformed { .. } | Error::Chunk { .. } => Code::InvalidArgument,
            Error::Version { .. }
            | Error::Fingerprint
            | Error::Layout { .. }
            | Error::Tokens { .. } => Code::FailedPrecondition,
            Error::HeaderTooLarge { .. } => Code::ResourceExhausted,
            Error::UnknownTransfer { .. } => Code::NotFound,
            Error::Reused { .. } => Code::AlreadyExists,
            Error::ChunkCrc { .. } | Error::Digest => Code::DataLoss,
            Error::Aborted { .. } | Error::ReceiverGone => Code::Aborted,
            Error::Stalled { .. } => Code::DeadlineExceeded,
            Error::Transport { code, .. } => *code,
        }
    }
}

impl Error {
    /// The code a request that needed this transfer ends with, the same whichever end saw the
    /// failure: DATA_LOSS for corrupted bytes, UNAVAILABLE (retryable) for everything else.
    pub fn request_code(&self) -> Code {
        match self.code() {
            Code::DataLoss => Code::DataLoss,
            _ => Code::Unavailable,
        }
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        Status::new(e.code(), e.to_string())
    }
}

impl From<Status> for Error {
    fn from(s: Status) -> Self {
        Error::Transport {
            code: s.code(),
            message: s.message().to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_is_listed_once() {
        let s = || String::new();
        let all = [
            Error::Malformed { detail: s() },
            Error::Version {
                got: 2,
                supported: 1,
            },
            Error::Fingerprint,
            Error::Layout { detail: s() },
            Error::Tokens { detail: s() },
            Error::HeaderTooLarge { detail: s() },
            Error::UnknownTransfer { transfer_id: s() },
            Error::Reused { transfer_id: s() },
            Error::Chunk { detail: s() },
            Error::ChunkCrc {
                layer: 0,
                kind: "k",
                token_start: 0,
            },
            Error::Digest,
            Error::Aborted { reason: s() },
            Error::ReceiverGone,
            Error::Stalled { waited_ms: 1 },
            Error::Transport {
                code: Code::Unknown,
                message: s(),
            },
        ];
        let reasons: Vec<&str> = all.iter().map(Error::reason).collect();
        assert_eq!(reasons, Error::REASONS);
    }
}
