//! The engine's error type. Every failure names what it concerns (a file, a field, a
//! sequence) and the reason; nothing here panics on bad input.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("model file {path} not found{hint}")]
    ModelNotFound { path: PathBuf, hint: String },

    #[error("cannot read model file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("model file {path} is not a usable GGUF model: {reason}")]
    InvalidModel { path: PathBuf, reason: String },

    #[error("model file {path} has architecture {arch:?}; the supported ones are {supported}")]
    UnsupportedArchitecture {
        path: PathBuf,
        arch: String,
        supported: String,
    },

    #[error("timing profile {path}: {reason}")]
    Profile { path: PathBuf, reason: String },

    #[error("tokenizer: {reason}")]
    Tokenizer { reason: String },

    #[error(transparent)]
    Text(#[from] tandem_tokenizer::Error),

    #[error("invalid {field}: {reason}")]
    InvalidArgument { field: &'static str, reason: String },

    #[error("KV pool exhausted: {needed_blocks} blocks needed, {free_blocks} free")]
    KvExhausted {
        needed_blocks: usize,
        free_blocks: usize,
    },

    #[error("unknown sequence {0}")]
    UnknownSequence(u32),

    #[error("KV import rejected: {reason}")]
    KvImport { reason: String },
}

impl Error {
    pub(crate) fn invalid_model(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::InvalidModel {
            path: path.into(),
            reason: reason.into(),
        }
    }
}
