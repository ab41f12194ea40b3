//! The tokenizer's error type.

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("tokenizer: {reason}")]
    Build { reason: String },

    #[error("tokenizer: encoding failed: {reason}")]
    Encode { reason: String },

    #[error("chat template: {reason}")]
    Template { reason: String },

    #[error("invalid {field}: {reason}")]
    InvalidArgument { field: &'static str, reason: String },
}
