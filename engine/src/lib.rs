//! Tandem's model engine: GGUF models of the llama, qwen2 and gemma3 architectures on the CPU,
//! with a paged KV cache that can be exported and imported as bytes, batched decode steps, and
//! sampling.
//!
//! No networking lives here; the servers drive an [`Engine`] from their own threads.

// The one crate with unsafe code (the workspace denies it elsewhere): the SIMD kernels
// (`kernels`, `attention`, `math`, `quant`; each instruction set in a module of its own, chosen
// by `cpu`), the huge-page mappings and prefetches (`memory`), and the allocator's threshold.
// Every `unsafe fn` has a `# Safety` section and every `unsafe` block a `SAFETY` comment.
#![allow(unsafe_code)]

mod attention;
pub mod catalog;
mod cpu;
mod engine;
mod error;
mod generate;
mod grammar;
mod kernels;
mod kv;
mod loader;
mod math;
mod memory;
mod model;
mod packed;
mod prefix_cache;
mod quant;
mod sampling;
pub mod simulate;
mod speculate;
mod spill;
mod step;
mod stream;
mod tiny;
mod tokenizer_gguf;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use engine::{Compute, Engine, EngineConfig, KvExport, Layered, Model, Reused, SeqId};
pub use error::{Error, Result};
pub use generate::{GenerateOutput, GenerateRequest};
pub use grammar::Grammar;
pub use kv::{BLOCK_TOKENS, KvDtype, KvKind, KvLayout, grid_cells};
pub use loader::{ModelFingerprint, load_tokenizer};
pub use memory::bound_freed_memory;
pub use model::{Arch, Logits, ModelConfig};
pub use prefix_cache::CacheEvent;
pub use sampling::{
    History, REPETITION_WINDOW, SamplingParams, TokenLogprobs, argmax, logprobs, sample,
};
pub use simulate::TimingProfile;
pub use speculate::{Drafter, SpeculateConfig};
pub use spill::{SpillConfig, SpillStats};
pub use step::{Decoding, PromptChunk, Step};
pub use stream::{Emission, FinishReason, GenerateParams, Stream};
pub use tandem_tokenizer::{ChatMessage, EncodeCache, TokenDecoder, Tokenizer, TokenizerSpec};

/// Where a model comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// The built-in random-weight model of an architecture.
    Tiny(Arch),
    /// A GGUF file; `known` when it was named from the [`catalog`] (and lives in the model
    /// directory, where `tandem model fetch NAME` puts it).
    File {
        path: PathBuf,
        known: Option<catalog::KnownModel>,
    },
}

impl ModelSource {
    /// The built-in tiny llama model, what the fast tests run.
    pub const TINY: ModelSource = ModelSource::Tiny(Arch::Llama);

    /// Parses a `--model` value: `tiny` (or `tiny-qwen2`, `tiny-gemma3`, `tiny-qwen3`,
    /// `tiny-qwen3moe`), a name from the [`catalog`] (`default` among them), or a path.
    pub fn parse(spec: &str, model_dir: &Path) -> Self {
        if let Some(&arch) = Arch::ALL.iter().find(|&&a| tiny::name(a) == spec) {
            return ModelSource::Tiny(arch);
        }
        match catalog::find(spec) {
            Some(known) => ModelSource::File {
                path: model_dir.join(known.file_name),
                known: Some(known),
            },
            None => ModelSource::File {
                path: PathBuf::from(spec),
                known: None,
            },
        }
    }

    /// The model's id, what its workers name it and the APIs list: `tiny` (or another tiny
    /// model's name), or the file's name without `.gguf`, the same wherever it is mounted.
    pub fn name(&self) -> String {
        match self {
            ModelSource::Tiny(arch) => tiny::name(*arch).to_string(),
            ModelSource::File { path, .. } => path.file_stem().map_or_else(
                || path.display().to_string(),
                |s| s.to_string_lossy().into_owned(),
            ),
        }
    }

    /// The names the model answers to besides its id ([`ModelSource::name`]): a file's name,
    /// and the catalog's names of it ([`catalog::names_of_file`]). A tiny model has none.
    pub fn aliases(&self) -> Vec<String> {
        let ModelSource::File { path, .. } = self else {
            return Vec::new();
        };
        let Some(file_name) = path.file_name().map(|f| f.to_string_lossy().into_owned()) else {
            return Vec::new();
        };
        let mut names: Vec<String> = catalog::names_of_file(&file_name)
            .into_iter()
            .map(str::to_string)
            .collect();
        names.insert(0, file_name);
        names
    }

    /// `e`, with a hint on how to fetch a catalog model if it is missing.
    fn with_fetch_hint(&self, e: Error, known: Option<catalog::KnownModel>) -> Error {
        match (e, known) {
            (Error::ModelNotFound { path, .. }, Some(k)) => Error::ModelNotFound {
                path,
                hint: format!("; fetch it with `tandem model fetch {}`", k.name),
            },
            (e, _) => e,
        }
    }

    /// Loads the model, with a hint on how to fetch the default one if it is missing.
    pub fn load(&self) -> Result<Arc<Model>> {
        let loaded = match self {
            ModelSource::Tiny(arch) => tiny::load(*arch)?,
            ModelSource::File { path, known } => {
                loader::load_file(path).map_err(|e| self.with_fetch_hint(e, *known))?
            }
        };
        let mut model = Model::from_loaded(self.name(), loaded);
        model.aliases = self.aliases();
        Ok(Arc::new(model))
    }

    /// The model with its compute simulated by `profile` ([`simulate`]): its configuration,
    /// tokenizer and fingerprint read from the file's header, and no weight.
    pub fn load_simulated(&self, profile: TimingProfile) -> Result<Arc<Model>> {
        let (config, tokenizer, fingerprint) = match self {
            ModelSource::Tiny(arch) => {
                let loaded = tiny::load(*arch)?;
                (loaded.config, loaded.tokenizer, loaded.fingerprint)
            }
            ModelSource::File { path, known } => {
                loader::load_header(path).map_err(|e| self.with_fetch_hint(e, *known))?
            }
        };
        let mut model = Model::simulated(self.name(), config, tokenizer, fingerprint, profile)?;
        model.aliases = self.aliases();
        Ok(Arc::new(model))
    }

    /// The timing profile shipped for this model ([`simulate::shipped`]), if any (a catalog
    /// model's).
    pub fn shipped_profile(&self) -> Option<TimingProfile> {
        match self {
            ModelSource::Tiny(_) => None,
            ModelSource::File { known, .. } => known.and_then(|k| simulate::shipped(k.name)),
        }
    }
}

pub use tiny::gguf_image as tiny_gguf_image;

/// Tandem's directory under the user's cache: `~/.cache/tandem`.
fn cache_dir() -> PathBuf {
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("."), PathBuf::from);
    home.join(".cache/tandem")
}

/// Where `tandem up` keeps its workers' disk tiers across restarts: `~/.cache/tandem/kv`.
pub fn kv_dir_default() -> PathBuf {
    cache_dir().join("kv")
}

/// The model directory: `$TANDEM_MODEL_DIR`, else `~/.cache/tandem/models`.
pub fn model_dir_from_env() -> PathBuf {
    match std::env::var_os("TANDEM_MODEL_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => cache_dir().join("models"),
    }
}
