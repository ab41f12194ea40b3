//! The engine: a loaded model, a KV pool and the sequences living in it.
//!
//! JetStream's shape: [`Engine::prefill`] extends a sequence by a prompt (its existing tokens are
//! the cached prefix) and returns the last logits; [`Engine::step`] advances every sequence of a
//! batch by one token; [`Engine::export_kv`] / [`Engine::import_kv`] move a sequence's KV as
//! bytes; [`Engine::free`] returns its blocks. Sequences can join and leave between steps, which
//! is continuous batching. All compute runs on the engine's own rayon pool.
//!
//! The prefix cache: [`Engine::cache_sequence`] keeps a sequence's full blocks under their
//! block hashes, and [`Engine::new_sequence_cached`] starts a sequence on the longest cached
//! prefix, sharing those blocks. Cached blocks nobody else holds are evicted (least recently
//! used first) whenever a sequence needs room, so the cache never turns a request away.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::kv::{BLOCK_TOKENS, KvDtype, KvLayout, KvPool};
use crate::loader::{LoadedModel, ModelFingerprint};
use crate::model::{self, Logits, ModelConfig, Row, Weights};
use crate::prefix_cache::{CacheEvent, PrefixCache};
use crate::simulate::{Simulated, TimingProfile};
use crate::speculate::{SpeculateConfig, StepCosts};
use crate::spill::{Spill, SpillConfig, SpillStats};
use tandem_tokenizer::Tokenizer;

mod cache;
mod kv_io;
mod layered;

pub use layered::Layered;

/// A loaded model, shareable between engines.
#[derive(Debug)]
pub struct Model {
    /// `tiny`, or the GGUF file's name without `.gguf` (the OpenAI API's model id).
    pub name: String,
    /// Other names it answers to ([`crate::ModelSource::aliases`]).
    pub aliases: Vec<String>,
    pub config: ModelConfig,
    pub compute: Compute,
    pub tokenizer: Tokenizer,
    pub fingerprint: ModelFingerprint,
    /// Compiles requests' grammars against the vocabulary.
    pub grammars: crate::grammar::Grammars,
}

impl Model {
    pub fn from_loaded(name: String, loaded: LoadedModel) -> Self {
        Self {
            name,
            aliases: Vec::new(),
            tokenizer: loaded.tokenizer,
            config: loaded.config,
            compute: Compute::Weights(loaded.weights),
            fingerprint: loaded.fingerprint,
            grammars: Default::default(),
        }
    }
}

/// What computes a model's forward pass.
#[derive(Debug)]
pub enum Compute {
    /// Its weights, read from the file.
    Weights(Weights),
    /// Nothing: the time the weights would take, and a certain token per row.
    Simulated(Simulated),
}

impl Model {
    /// A model with its compute replaced by `profile`'s timing: no weight is read.
    pub fn simulated(
        name: String,
        config: ModelConfig,
        tokenizer: Tokenizer,
        fingerprint: ModelFingerprint,
        profile: TimingProfile,
    ) -> Result<Self> {
        Ok(Self {
            name,
            aliases: Vec::new(),
            compute: Compute::Simulated(Simulated::new(profile, &tokenizer)?),
            config,
            tokenizer,
            fingerprint,
            grammars: Default::default(),
        })
    }

    /// Runs `rows` through the model ([`model::forward`], or the simulation's). Must be called
    /// on the engine's rayon pool.
    fn forward(&self, pool: &mut KvPool, rows: &[Row<'_>], buffer: Vec<f32>) -> Logits {
        match &self.compute {
            Compute::Weights(w) => model::forward(&self.config, w, pool, rows, buffer),
            Compute::Simulated(s) => s.forward(&self.config, rows, buffer),
        }
    }
}

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Compute threads (0 = one per core).
    pub threads: usize,
    /// Byte budget of the KV block pool.
    pub kv_budget_bytes: usize,
    /// Bytes of the KV pool's pages kept committed past the blocks used so far, by a thread of
    /// the pool's own: a sequence given blocks never used before (a pushed KV of tens of MB)
    /// writes to pages already there. 0 leaves each page to be committed by its first write.
    pub kv_commit_ahead_bytes: usize,
    /// Prompt tokens per prefill forward pass, which bounds activation memory.
    pub prefill_chunk_tokens: usize,
    /// Most bytes of KV the prefix cache keeps (rounded down to blocks, at most the pool);
    /// 0 turns it off.
    pub prefix_cache_bytes: usize,
    /// Prompt-lookup speculative decoding in [`Engine::decode_step`].
    pub speculate: SpeculateConfig,
    /// How the KV pool stores keys and values.
    pub kv_dtype: KvDtype,
    /// KV exports carry no bytes and imports take none ([`KvLayout::header_only`]): for a
    /// simulated model only.
    pub kv_header_only: bool,
    /// The compute threads' OS priority as a nice value (0 to 19; 0 leaves it): above 0 they
    /// yield the CPU to the threads of other processes on the machine (a decode node's steps
    /// beside a prefill node's prompts).
    pub compute_nice: i32,
    /// The prefix cache's disk tier: evicted blocks go there and come back on a later hit.
    /// `None` (the default) has none.
    pub spill: Option<SpillConfig>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            threads: 0,
            kv_budget_bytes: 256 << 20,
            kv_commit_ahead_bytes: 0,
            prefill_chunk_tokens: 256,
            prefix_cache_bytes: 0,
            speculate: SpeculateConfig::default(),
            kv_dtype: KvDtype::default(),
            kv_header_only: false,
            compute_nice: 0,
            spill: None,
        }
    }
}

/// Which positions of a run appended in a forward pass give logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Want {
    All,
    Last,
    None,
}

/// A sequence's handle inside one engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u32);

#[derive(Debug, Default)]
struct Sequence {
    blocks: Vec<u32>,
    len: usize,
}

/// What a new sequence starts with from the cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reused {
    /// Tokens it holds already (whole blocks from its first).
    pub tokens: usize,
    /// Of those, read back from the disk tier.
    pub restored: usize,
}

/// One sequence's KV for a token range, per layer, as the pool's rows (see [`KvDtype`]) laid out
/// `[kv_head][token]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvExport {
    pub layout: KvLayout,
    pub tokens: Range<usize>,
    /// `[layer][k, v]`.
    pub layers: Vec<[Vec<u8>; 2]>,
}

#[derive(Debug)]
pub struct Engine {
    model: Arc<Model>,
    pool: KvPool,
    cache: PrefixCache,
    seqs: HashMap<SeqId, Sequence>,
    next_id: u32,
    threads: rayon::ThreadPool,
    config: EngineConfig,
    /// Measured step times, for speculation's choices.
    pub(crate) step_costs: StepCosts,
    /// The prefix cache's disk tier, when configured.
    spill: Option<Spill>,
    spill_stats: Arc<SpillStats>,
    /// A step's logits buffer given back by [`Engine::recycle`], for the next step to write
    /// over (16 MB at batch 16 over a 262k vocabulary).
    spare_logits: Vec<f32>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        let started = std::time::Instant::now();
        let written = self.persist_cache();
        if written > 0 {
            // The tier's writer finishes the queue as the tier is dropped, right after this.
            tracing::info!(
                blocks = written,
                queued_ms = started.elapsed().as_millis() as u64,
                "writing the cache's blocks to the disk tier before stopping"
            );
        }
    }
}

impl Engine {
    pub fn new(model: Arc<Model>, config: EngineConfig) -> Result<Self> {
        if config.prefill_chunk_tokens == 0 {
            return Err(Error::InvalidArgument {
                field: "prefill_chunk_tokens",
                reason: "must be at least 1".into(),
            });
        }
        if !(0..=19).contains(&config.compute_nice) {
            return Err(Error::InvalidArgument {
                field: "compute_nice",
                reason: format!("{} is not a nice value from 0 to 19", config.compute_nice),
            });
        }
        if config.kv_header_only
            && (!matches!(model.compute, Compute::Simulated(_)) || config.spill.is_some())
        {
            return Err(Error::InvalidArgument {
                field: "kv_header_only",
                reason: "only a simulated model without a disk tier moves its KV as headers".into(),
            });
        }
        let nice = config.compute_nice;
        let threads = rayon::ThreadPoolBuilder::new()
            .num_threads(config.threads)
            .thread_name(|i| format!("tandem-engine-{i}"))
            .start_handler(move |_| {
                if nice > 0 {
                    crate::cpu::lower_thread_priority(nice);
                }
            })
            .build()
            .map_err(|e| Error::InvalidArgument {
                field: "threads",
                reason: e.to_string(),
            })?;
        let layout = KvLayout {
            header_only: config.kv_header_only,
            ..model.config.kv_layout(config.kv_dtype)
        };
        let mut pool = KvPool::new(layout, config.kv_budget_bytes);
        pool.commit_ahead(config.kv_commit_ahead_bytes);
        let cache_blocks =
            (config.prefix_cache_bytes / pool.layout().block_bytes()).min(pool.total_blocks());
        let spill_stats = Arc::new(SpillStats::default());
        let spill = match &config.spill {
            Some(spill) if cache_blocks > 0 => Some(Spill::open(
                spill,
                &model.fingerprint.0,
                pool.layout(),
                spill_stats.clone(),
            )?),
            _ => None,
        };
        let mut cache = PrefixCache::new(cache_blocks);
        // What an earlier run left on disk is there to be read back: the routers hear of it.
        if let Some(on_disk) = spill.as_ref().map(Spill::hashes).filter(|h| !h.is_empty()) {
            cache.record(CacheEvent::Spilled(on_disk));
        }
        Ok(Self {
            pool,
            cache,
            model,
            seqs: HashMap::new(),
            next_id: 0,
            threads,
            config,
            step_costs: StepCosts::default(),
            spill,
            spill_stats,
            spare_logits: Vec::new(),
        })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Turns speculative decoding on or off, or retunes it, from the next step on.
    pub fn set_speculate(&mut self, speculate: SpeculateConfig) {
        self.config.speculate = speculate;
    }

    pub fn threads(&self) -> usize {
        self.threads.current_num_threads()
    }

    /// Prompt tokens per forward pass in [`Engine::prefill`].
    pub fn prefill_chunk_tokens(&self) -> usize {
        self.config.prefill_chunk_tokens
    }

    /// The KV pool's shape and dtype.
    pub fn kv_layout(&self) -> KvLayout {
        self.pool.layout()
    }

    pub fn kv_blocks_total(&self) -> usize {
        self.pool.total_blocks()
    }

    /// Blocks a new sequence can have: free ones, and cached ones that only the cache holds.
    pub fn kv_blocks_free(&self) -> usize {
        let evictable = self
            .cache
            .blocks()
            .filter(|&b| self.pool.holders(b) == 1)
            .count();
        self.pool.free_blocks() + evictable
    }

    /// Blocks the prefix cache holds (some may be in use by sequences too).
    pub fn kv_blocks_cached(&self) -> usize {
        self.cache.len()
    }

    /// Starts an empty sequence.
    pub fn new_sequence(&mut self) -> SeqId {
        self.new_sequence_cached(&[]).0
    }

    /// Takes `n` blocks, evicting cached ones that nobody else holds if the pool is short.
    fn alloc(&mut self, n: usize) -> Result<Vec<u32>> {
        while self.pool.free_blocks() < n && self.evict_one() {}
        self.pool.alloc(n)
    }

    pub fn seq_len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.len)
    }

    /// Frees a sequence and its KV blocks.
    pub fn free(&mut self, seq: SeqId) -> Result<()> {
        let s = self
            .seqs
            .remove(&seq)
            .ok_or(Error::UnknownSequence(seq.0))?;
        self.pool.release(s.blocks);
        Ok(())
    }

    fn seq(&self, seq: SeqId) -> Result<&Sequence> {
        self.seqs.get(&seq).ok_or(Error::UnknownSequence(seq.0))
    }

    /// Grows `seq`'s block table to hold `len` tokens.
    pub(crate) fn reserve(&mut self, seq: SeqId, len: usize) -> Result<()> {
        if len > self.model.config.context_len {
            return Err(Error::InvalidArgument {
                field: "tokens",
                reason: format!(
                    "{len} tokens exceed the model's context of {}",
                    self.model.config.context_len
                ),
            });
        }
        let have = self.seq(seq)?.blocks.len();
        let need = len.div_ceil(BLOCK_TOKENS).saturating_sub(have);
        if need > 0 {
            let new = self.alloc(need)?;
            self.seqs
                .get_mut(&seq)
                .ok_or(Error::UnknownSequence(seq.0))?
                .blocks
                .extend(new);
        }
        Ok(())
    }

    /// Appends `tokens` to `seq` in chunks and returns the logits after the last one.
    pub fn prefill(&mut self, seq: SeqId, tokens: &[u32]) -> Result<Vec<f32>> {
        if tokens.is_empty() {
            return Err(Error::InvalidArgument {
                field: "tokens",
                reason: "at least one token is required".into(),
            });
        }
        self.model.config.check_token_ids("token_ids", tokens)?;
        let start = self.seq_len(seq)?;
        self.reserve(seq, start + tokens.len())?;
        let mut logits = Vec::new();
        for (ci, chunk) in tokens.chunks(self.config.prefill_chunk_tokens).enumerate() {
            let pos0 = start + ci * self.config.prefill_chunk_tokens;
            let last_chunk = pos0 + chunk.len() == start + tokens.len();
            let blocks = &self
                .seqs
                .get(&seq)
                .ok_or(Error::UnknownSequence(seq.0))?
                .blocks;
            let rows: Vec<Row<'_>> = chunk
                .iter()
                .enumerate()
                .map(|(i, &token)| Row {
                    blocks,
                    pos: pos0 + i,
                    token,
                    want_logits: last_chunk && i + 1 == chunk.len(),
                })
                .collect();
            let (model, pool) = (&self.model, &mut self.pool);
            let out = self
                .threads
                .install(|| model.forward(pool, &rows, Vec::new()));
            if let Some(seq) = self.seqs.get_mut(&seq) {
                seq.len = pos0 + chunk.len();
            }
            if last_chunk {
                logits = out.into_last();
            }
        }
        Ok(logits)
    }

    /// Advances each `(seq, token)` of the batch by one position, returning each row's logits.
    pub fn step(&mut self, batch: &[(SeqId, u32)]) -> Result<Logits> {
        let rows: Vec<(SeqId, &[u32])> = batch
            .iter()
            .map(|(seq, token)| (*seq, std::slice::from_ref(token)))
            .collect();
        self.extend(&rows)
    }

    /// Appends each `(seq, tokens)` of the batch in one forward pass, returning the logits of
    /// every appended position, in order. A position's logits are those a step would give.
    pub fn extend(&mut self, batch: &[(SeqId, &[u32])]) -> Result<Logits> {
        let runs: Vec<(SeqId, &[u32], Want)> = batch
            .iter()
            .map(|&(seq, tokens)| (seq, tokens, Want::All))
            .collect();
        self.append(&runs)
    }

    /// Appends each `(seq, tokens, want)` of the batch in one forward pass, returning the
    /// logits `want` asks for, in order.
    pub(crate) fn append(&mut self, batch: &[(SeqId, &[u32], Want)]) -> Result<Logits> {
        let mut seen = std::collections::HashSet::new();
        for (seq, tokens, _) in batch {
            if !seen.insert(*seq) {
                return Err(Error::InvalidArgument {
                    field: "batch",
                    reason: format!("sequence {} appears twice", seq.0),
                });
            }
            if tokens.is_empty() {
                return Err(Error::InvalidArgument {
                    field: "batch",
                    reason: format!("sequence {} has no tokens", seq.0),
                });
            }
            self.model.config.check_token_ids("token_ids", tokens)?;
            let len = self.seq_len(*seq)?;
            self.reserve(*seq, len + tokens.len())?;
        }
        let rows: Vec<Row<'_>> = batch
            .iter()
            .flat_map(|(seq, tokens, want)| {
                let s = &self.seqs[seq];
                let last = tokens.len() - 1;
                tokens.iter().enumerate().map(move |(i, &token)| Row {
                    blocks: &s.blocks,
                    pos: s.len + i,
                    token,
                    want_logits: match want {
                        Want::All => true,
                        Want::Last => i == last,
                        Want::None => false,
                    },
                })
            })
            .collect();
        let (model, pool) = (&self.model, &mut self.pool);
        let buffer = std::mem::take(&mut self.spare_logits);
        let out = self.threads.install(|| model.forward(pool, &rows, buffer));
        for (seq, tokens, _) in batch {
            if let Some(s) = self.seqs.get_mut(seq) {
                s.len += tokens.len();
            }
        }
        Ok(out)
    }

    /// Gives back a step's logits once read, so the next step writes over their buffer instead
    /// of a freshly mapped one.
    pub fn recycle(&mut self, logits: Logits) {
        self.spare_logits = logits.into_buffer();
    }

    /// Cuts `seq` back to its first `len` tokens, freeing the blocks past them (the KV of
    /// rejected drafts).
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let s = self
            .seqs
            .get_mut(&seq)
            .ok_or(Error::UnknownSequence(seq.0))?;
        if len > s.len {
            return Err(Error::InvalidArgument {
                field: "len",
                reason: format!("cannot grow a sequence of {} tokens to {len}", s.len),
            });
        }
        s.len = len;
        let keep = len.div_ceil(BLOCK_TOKENS);
        if s.blocks.len() > keep {
            let freed = s.blocks.split_off(keep);
            self.pool.release(freed);
        }
        Ok(())
    }

    /// Blocks `seq` would have to add to hold `len` tokens.
    pub(crate) fn blocks_to_hold(&self, seq: SeqId, len: usize) -> usize {
        let have = self.seqs.get(&seq).map_or(0, |s| s.blocks.len());
        len.div_ceil(BLOCK_TOKENS).saturating_sub(have)
    }

    /// Blocks the pool has free, not counting cached blocks it could evict.
    pub(crate) fn pool_free_blocks(&self) -> usize {
        self.pool.free_blocks()
    }
}
