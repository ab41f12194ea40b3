//! The arguments every command that loads a model takes, in `tandem` and `tandem-bench` alike.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

/// Where the model comes from; shared by every command that loads one.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// A model of the catalog by name (`default` is Qwen2.5-Coder-0.5B-Instruct; `tandem model
    /// list` lists the rest), `tiny` (built-in random weights; `tiny-qwen2` and `tiny-gemma3`
    /// for those architectures) or a GGUF path.
    #[arg(long, env = "TANDEM_MODEL", default_value = "default")]
    pub model: String,
    /// Directory holding fetched models.
    #[arg(long, env = "TANDEM_MODEL_DIR")]
    pub model_dir: Option<PathBuf>,
}

impl ModelArgs {
    pub fn source(&self) -> tandem_engine::ModelSource {
        let dir = self
            .model_dir
            .clone()
            .unwrap_or_else(tandem_engine::model_dir_from_env);
        tandem_engine::ModelSource::parse(&self.model, &dir)
    }
}

/// How the KV cache stores keys and values (`--kv-dtype`).
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    /// f16, as llama.cpp keeps it.
    F16,
    /// int8 with one f16 scale per token and KV head: 52% of f16's bytes (docs/kv-cache.md).
    Q8,
}

impl KvDtype {
    pub fn dtype(self) -> tandem_engine::KvDtype {
        match self {
            KvDtype::F16 => tandem_engine::KvDtype::F16,
            KvDtype::Q8 => tandem_engine::KvDtype::Q8,
        }
    }
}
