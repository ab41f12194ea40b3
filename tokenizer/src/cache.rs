//! Token ids of the text between special tokens, kept by content, so that a prompt which repeats
//! text seen before (a conversation's next turn, a system prompt many sessions share) encodes
//! only what is new. Every run is kept, short ones too: a lookup costs a hash and a probe, an
//! encoding a pass through the `tokenizers` pipeline, and a conversation is mostly short runs
//! (roles, a call) between long ones.
//!
//! Both encoders split special tokens off before anything else, and encode each run of text
//! between them on its own: the `tokenizers` crate's added vocabulary splits them out
//! leftmost-longest before its pre-tokenizer runs, and the SentencePiece path does the same with
//! the same matcher. So a text's ids are its runs' ids and its special tokens' ids in order, and a
//! run's ids depend only on its bytes, and, for SentencePiece's word boundary, on whether it
//! opens the text. [`crate::Tokenizer::encode_cached`] relies on exactly that, and the tests
//! that compare it with [`crate::Tokenizer::encode`] on the real models' tokenizers hold it to it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use moka::policy::EvictionPolicy;
use xxhash_rust::xxh3::xxh3_128_with_seed;

/// The ids of runs of text seen before, by a 128-bit hash of their bytes (and of whether the run
/// opens its text), least recently used dropped first past a bound on the ids held. Shared by the
/// threads that tokenize; one per tokenizer.
pub struct EncodeCache {
    /// `None` for a cache that holds nothing.
    runs: Option<moka::sync::Cache<u128, Arc<[u32]>>>,
    hit_tokens: AtomicU64,
    encoded_tokens: AtomicU64,
}

impl std::fmt::Debug for EncodeCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let runs = self.runs.as_ref();
        f.debug_struct("EncodeCache")
            .field("runs", &runs.map_or(0, |r| r.entry_count()))
            .field("held_tokens", &runs.map_or(0, |r| r.weighted_size()))
            .finish()
    }
}

/// What an entry costs the cache besides its ids, in ids (4 bytes each): its key, its `Arc` and
/// the cache's own bookkeeping.
const ENTRY_OVERHEAD_IDS: u32 = 24;

impl EncodeCache {
    /// A cache that holds at most about `max_tokens` ids (4 bytes each, plus a few dozen bytes
    /// per run); with 0, nothing.
    pub fn new(max_tokens: u64) -> Self {
        let runs = (max_tokens > 0).then(|| {
            moka::sync::Cache::builder()
                .max_capacity(max_tokens)
                .weigher(|_, ids: &Arc<[u32]>| {
                    u32::try_from(ids.len())
                        .unwrap_or(u32::MAX)
                        .saturating_add(ENTRY_OVERHEAD_IDS)
                })
                // A conversation's newest run is seen once before its next turn asks for it:
                // recency, not frequency, is what predicts the next hit.
                .eviction_policy(EvictionPolicy::lru())
                .build()
        });
        Self {
            runs,
            hit_tokens: AtomicU64::new(0),
            encoded_tokens: AtomicU64::new(0),
        }
    }

    /// Whether it was made to hold nothing.
    pub(crate) fn holds_nothing(&self) -> bool {
        self.runs.is_none()
    }

    pub(crate) fn get(&self, run: &str, opens: bool) -> Option<Arc<[u32]>> {
        let ids = self.runs.as_ref()?.get(&key(run, opens))?;
        self.hit_tokens
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        Some(ids)
    }

    pub(crate) fn insert(&self, run: &str, opens: bool, ids: &[u32]) {
        self.encoded_tokens
            .fetch_add(ids.len() as u64, Ordering::Relaxed);
        if let Some(runs) = &self.runs {
            runs.insert(key(run, opens), ids.into());
        }
    }

    /// Ids taken from the cache, and ids of cacheable runs encoded, since it was made.
    pub fn tokens(&self) -> (u64, u64) {
        (
            self.hit_tokens.load(Ordering::Relaxed),
            self.encoded_tokens.load(Ordering::Relaxed),
        )
    }
}

fn key(run: &str, opens: bool) -> u128 {
    xxh3_128_with_seed(run.as_bytes(), u64::from(opens))
}
