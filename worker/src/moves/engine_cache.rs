//! The engine's side of the moves: the sequences its cache keeps ([`Recent`]), and the
//! [`CacheCommand`]s by which the moves reach the engine's own thread ([`EngineCache`]).

use std::collections::HashMap;
use std::sync::Arc;

use tandem_engine::{BLOCK_TOKENS, Engine, KvExport};
use tokio::sync::oneshot;

use crate::cache::CacheHub;

/// The sequences recorded for a drain's offer at most; the least recently used go first.
const RECENT_SESSIONS: usize = 1024;

/// A sequence a cache keeps: the whole blocks of a prompt (and, on a decode node, its reply).
#[derive(Clone, Debug)]
pub struct Session {
    pub cache_salt: String,
    pub tokens: Vec<u32>,
    /// The hash of its last block, which names the whole sequence.
    pub last: u64,
}

/// The sequences kept in a cache, with when each was last kept, for a drain to offer the most
/// recently used. One entry per conversation: a sequence replaces the entries of its own
/// prefixes (the earlier turns).
#[derive(Debug, Default)]
pub struct Recent {
    by_last: HashMap<u64, (u64, Session)>,
    clock: u64,
}

impl Recent {
    /// Records that the first `hashes.len()` blocks of `tokens` were kept.
    pub fn kept(&mut self, cache_salt: &str, tokens: &[u32], hashes: &[u64]) {
        let Some((&last, prefixes)) = hashes.split_last() else {
            return;
        };
        for h in prefixes {
            self.by_last.remove(h);
        }
        self.clock += 1;
        let session = Session {
            cache_salt: cache_salt.to_string(),
            tokens: tokens[..hashes.len() * BLOCK_TOKENS].to_vec(),
            last,
        };
        self.by_last.insert(last, (self.clock, session));
        if self.by_last.len() > RECENT_SESSIONS
            && let Some(oldest) = self
                .by_last
                .iter()
                .min_by_key(|(_, (used, _))| *used)
                .map(|(h, _)| *h)
        {
            self.by_last.remove(&oldest);
        }
    }

    /// Most recently kept first.
    pub fn by_recency(&self) -> Vec<&Session> {
        let mut all: Vec<_> = self.by_last.values().collect();
        all.sort_by_key(|(used, _)| std::cmp::Reverse(*used));
        all.into_iter().map(|(_, s)| s).collect()
    }
}

/// The KV of the longest cached prefix of `hashes`, in cells of at most a prefill chunk (the
/// engine thread's side of a peer fetch).
pub(super) fn export_cached(engine: &mut Engine, hub: &CacheHub, hashes: &[u64]) -> Vec<KvExport> {
    let (seq, cached) = engine.new_sequence_cached(hashes);
    let grid = engine.prefill_chunk_tokens();
    let cells = crate::grid_cells(0..cached.tokens, grid)
        .map(|cell| engine.export_kv(seq, cell))
        .collect::<Result<Vec<_>, _>>();
    let _ = engine.free(seq);
    // A restore from the disk tier changes the cache.
    hub.publish(engine.take_cache_events());
    cells.unwrap_or_else(|e| {
        tracing::warn!(error = %e, "could not export cached KV");
        Vec::new()
    })
}

/// The tokens of the longest cached prefix of `hashes` (the disk tier's included).
pub(super) fn held(engine: &mut Engine, hub: &CacheHub, hashes: &[u64]) -> usize {
    let (seq, cached) = engine.new_sequence_cached(hashes);
    let _ = engine.free(seq);
    // A restore from the disk tier changes the cache.
    hub.publish(engine.take_cache_events());
    cached.tokens
}

/// Keeps KV fetched from a peer (the first tokens of the sequence `hashes` describes) in the
/// cache. A failure only costs the fetch: a lookup then finds less.
pub fn keep_fetched(
    engine: &mut Engine,
    hub: &CacheHub,
    hashes: &[u64],
    kv: &KvExport,
) -> Result<(), tandem_engine::Error> {
    let blocks = (kv.tokens.end / BLOCK_TOKENS).min(hashes.len());
    let seq = engine.new_sequence();
    let kept = engine
        .import_kv(seq, kv)
        .and_then(|()| engine.cache_sequence(seq, &hashes[..blocks]));
    let _ = engine.free(seq);
    hub.publish(engine.take_cache_events());
    kept
}

/// A drain's offer: the most recently used of `recent` still in the pool, as many as fit in
/// `budget` bytes, which loses what is offered.
pub(super) fn offer_within(engine: &Engine, recent: &Recent, budget: &mut u64) -> Vec<Session> {
    let token_bytes = engine.kv_layout().token_bytes() as u64;
    let mut offer = Vec::new();
    for s in recent.by_recency() {
        let bytes = s.tokens.len() as u64 * token_bytes;
        if bytes <= *budget && engine.caches(s.last) {
            *budget -= bytes;
            offer.push(s.clone());
        }
    }
    offer
}

/// What the moves ask of the engine thread's cache.
#[derive(Debug)]
pub enum CacheCommand {
    /// [`export_cached`].
    Export {
        hashes: Vec<u64>,
        reply: oneshot::Sender<Vec<KvExport>>,
    },
    /// [`held`].
    Held {
        hashes: Vec<u64>,
        reply: oneshot::Sender<usize>,
    },
    /// [`keep_fetched`], recording `session` as kept; the session's tokens held after.
    Adopt {
        session: Session,
        hashes: Vec<u64>,
        kv: KvExport,
        reply: oneshot::Sender<Result<usize, tandem_engine::Error>>,
    },
    /// [`Engine::release_cached`], its cache events published; the blocks that left the pool.
    Release {
        hashes: Vec<u64>,
        to_disk: bool,
        reply: oneshot::Sender<usize>,
    },
    /// The drain's offer ([`offer_within`] the budget).
    Offer {
        reply: oneshot::Sender<Vec<Session>>,
    },
}

impl CacheCommand {
    /// Answers the command on the engine's thread, with the sequences its cache keeps
    /// (`recent`) and `offer_budget`, the bytes of KV a drain may still offer (less what is).
    pub fn answer(
        self,
        engine: &mut Engine,
        hub: &CacheHub,
        recent: &mut Recent,
        offer_budget: &mut u64,
    ) {
        match self {
            CacheCommand::Export { hashes, reply } => {
                let _ = reply.send(export_cached(engine, hub, &hashes));
            }
            CacheCommand::Held { hashes, reply } => {
                let _ = reply.send(held(engine, hub, &hashes));
            }
            CacheCommand::Adopt {
                session,
                hashes,
                kv,
                reply,
            } => {
                let adopted = keep_fetched(engine, hub, &hashes, &kv).map(|()| {
                    recent.kept(&session.cache_salt, &session.tokens, &hashes);
                    held(engine, hub, &hashes)
                });
                let _ = reply.send(adopted);
            }
            CacheCommand::Release {
                hashes,
                to_disk,
                reply,
            } => {
                let released = engine.release_cached(&hashes, to_disk);
                hub.publish(engine.take_cache_events());
                let _ = reply.send(released);
            }
            CacheCommand::Offer { reply } => {
                let _ = reply.send(offer_within(engine, recent, offer_budget));
            }
        }
    }
}

/// The engine thread's cache, as the moves reach it: each call is a [`CacheCommand`] sent to
/// that thread, answered there.
#[derive(Clone)]
pub struct EngineCache {
    send: Arc<dyn Fn(CacheCommand) -> bool + Send + Sync>,
}

impl std::fmt::Debug for EngineCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineCache").finish_non_exhaustive()
    }
}

impl EngineCache {
    /// A cache whose commands go to the engine thread through `send` (`false`: the thread is
    /// gone).
    pub fn new(send: impl Fn(CacheCommand) -> bool + Send + Sync + 'static) -> Self {
        Self {
            send: Arc::new(send),
        }
    }

    async fn ask<T>(&self, command: impl FnOnce(oneshot::Sender<T>) -> CacheCommand) -> Option<T> {
        let (reply, answer) = oneshot::channel();
        if !(self.send)(command(reply)) {
            return None;
        }
        answer.await.ok()
    }

    /// The KV of the longest cached prefix of `hashes`, cell by cell; empty when the thread
    /// is gone.
    pub async fn export(&self, hashes: Vec<u64>) -> Vec<KvExport> {
        self.ask(|reply| CacheCommand::Export { hashes, reply })
            .await
            .unwrap_or_default()
    }

    /// The tokens of the longest cached prefix of `hashes`; 0 when the thread is gone.
    pub async fn held(&self, hashes: Vec<u64>) -> usize {
        self.ask(|reply| CacheCommand::Held { hashes, reply })
            .await
            .unwrap_or(0)
    }

    /// Keeps `session`'s fetched KV: the session's tokens held after, or `None` when the
    /// thread is gone.
    pub async fn adopt(
        &self,
        session: Session,
        hashes: Vec<u64>,
        kv: KvExport,
    ) -> Option<Result<usize, tandem_engine::Error>> {
        self.ask(|reply| CacheCommand::Adopt {
            session,
            hashes,
            kv,
            reply,
        })
        .await
    }

    /// Releases what the cache keeps of the sequence `hashes` names
    /// ([`Engine::release_cached`]): the blocks that left the pool, `None` when the thread is
    /// gone.
    pub async fn release(&self, hashes: Vec<u64>, to_disk: bool) -> Option<usize> {
        self.ask(|reply| CacheCommand::Release {
            hashes,
            to_disk,
            reply,
        })
        .await
    }

    /// The drain's offer, most recently used first.
    pub async fn offer(&self) -> Vec<Session> {
        self.ask(|reply| CacheCommand::Offer { reply })
            .await
            .unwrap_or_default()
    }
}
