//! KV that moves between decode nodes: peer fetches in both directions, and the drain that hands
//! running streams off.
//!
//! ```text
//! SIGTERM ─▶ NOT_SERVING, `draining`: new requests refused; each running stream stops between
//!            steps, its KV kept in the session cache, and ends UNAVAILABLE + tandem-kv-handoff
//!         ─▶ the router resumes it on a peer, which fetches that KV (`KvTransfer.Fetch`) here
//!         ─▶ the most recently used cached sessions are offered (`Decode.Sessions`); the router
//!            asks peers to take each (`Decode.Adopt`), and they fetch it here likewise
//!         ─▶ once every stream has ended and every kept sequence was fetched, and the offered
//!            sessions were fetched or nobody fetched any for OFFER_IDLE (or the hand-off bound
//!            passed): the listener closes and the grace period begins
//! ```
//!
//! A peer's fetch reads this node's session cache through the scheduler (a lookup, an export
//! cell by cell); a fetch this node makes for a request is checked like a push and kept in its
//! own cache before the request's lookup. Either way a failure costs only time: the tokens are
//! then computed.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_engine::{BLOCK_TOKENS, KvExport};
use tandem_proto::v1 as pb;
use tandem_transfer::{Cached, FetchWant, KvSource};
use tonic::Status;

use crate::error::{Error, Result};
use crate::request::RequestContext;
use crate::scheduler::SchedulerHandle;

/// The longest a fetch may go without a frame before it is dropped (and its tokens computed).
pub const FETCH_IDLE: Duration = Duration::from_secs(2);

/// How long a drain waits for its offered sessions while nobody takes the offer or fetches
/// any of them (no router asked, or no peer had room): the router asks within milliseconds
/// of the health watch's NOT_SERVING.
pub const OFFER_IDLE: Duration = Duration::from_millis(500);

/// The sessions recorded for a drain's offer at most; the least recently used go first.
const RECENT_SESSIONS: usize = 1024;

/// A sequence the session cache keeps: the whole blocks of a prompt and its reply.
#[derive(Clone, Debug)]
pub(crate) struct Session {
    pub cache_salt: String,
    pub tokens: Vec<u32>,
    /// The hash of its last block, which names the whole sequence.
    pub last: u64,
}

/// The sequences kept in the session cache, with when each was last kept, for a drain to offer
/// the most recently used. One entry per conversation: a sequence replaces the entries of its
/// own prefixes (the earlier turns).
#[derive(Debug, Default)]
pub(crate) struct Recent {
    by_last: HashMap<u64, (u64, Session)>,
    clock: u64,
}

impl Recent {
    /// Records that the first `hashes.len()` blocks of `tokens` were kept.
    pub(crate) fn kept(&mut self, cache_salt: &str, tokens: &[u32], hashes: &[u64]) {
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
    pub(crate) fn by_recency(&self) -> Vec<&Session> {
        let mut all: Vec<_> = self.by_last.values().collect();
        all.sort_by_key(|(used, _)| std::cmp::Reverse(*used));
        all.into_iter().map(|(_, s)| s).collect()
    }
}

/// What a drain keeps for peers to fetch, by the hash of each sequence's last kept block: the
/// running streams' KV, and the cached sessions it offers.
#[derive(Debug)]
struct State {
    streams: HashSet<u64>,
    sessions: HashSet<u64>,
    /// The offer, until a caller takes it.
    offer: Vec<Session>,
    /// When the offer was made or taken, or an offered session last fetched.
    active: Instant,
}

#[derive(Debug)]
pub(crate) struct Handoffs {
    state: Mutex<State>,
    /// Whether the drain has made its offer: the health watch says NOT_SERVING a moment before.
    offered: tokio::sync::watch::Sender<bool>,
}

impl Default for Handoffs {
    fn default() -> Self {
        Self {
            state: Mutex::new(State {
                streams: HashSet::new(),
                sessions: HashSet::new(),
                offer: Vec::new(),
                active: Instant::now(),
            }),
            offered: tokio::sync::watch::Sender::new(false),
        }
    }
}

impl Handoffs {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Single inserts and removes: a poisoned state is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A running stream's KV was kept for the peer that continues it.
    pub(crate) fn kept(&self, last_block: u64) {
        self.lock().streams.insert(last_block);
    }

    fn offer(&self, sessions: Vec<Session>) {
        {
            let mut s = self.lock();
            s.sessions = sessions.iter().map(|x| x.last).collect();
            s.offer = sessions;
            s.active = Instant::now();
        }
        self.offered.send_replace(true);
    }

    /// The offer, to the first caller only, once the drain has made it (waiting at most
    /// `wait` for that); empty when there is none.
    async fn take_offer(&self, wait: Duration) -> Vec<Session> {
        let mut made = self.offered.subscribe();
        if tokio::time::timeout(wait, made.wait_for(|made| *made))
            .await
            .is_err()
        {
            return Vec::new();
        }
        let mut s = self.lock();
        s.active = Instant::now();
        std::mem::take(&mut s.offer)
    }

    /// A peer fetched the prefix whose last block is `last_block`.
    fn fetched(&self, last_block: u64) {
        let mut s = self.lock();
        if s.sessions.remove(&last_block) {
            s.active = Instant::now();
        }
        s.streams.remove(&last_block);
    }

    /// Kept streams and offered sessions not fetched yet.
    fn unfetched(&self) -> (usize, usize) {
        let s = self.lock();
        (s.streams.len(), s.sessions.len())
    }

    /// Whether the drain should wait on: a kept stream is not fetched, or an offered session
    /// is not and the offer saw activity within `idle`.
    fn waiting(&self, idle: Duration) -> bool {
        let s = self.lock();
        !s.streams.is_empty() || (!s.sessions.is_empty() && s.active.elapsed() < idle)
    }
}

/// The session cache, as peers' fetches see it.
#[derive(Debug)]
pub(crate) struct SessionCache {
    pub model: Arc<tandem_engine::Model>,
    pub scheduler: SchedulerHandle,
    pub handoffs: Arc<Handoffs>,
}

#[tonic::async_trait]
impl KvSource for SessionCache {
    async fn cached(&self, token_ids: &[u32], cache_salt: &str) -> Result<Cached, Status> {
        tandem_proto::check_ids(&[("cache_salt", cache_salt)])
            .map_err(|(field, reason)| Status::invalid_argument(format!("{field}: {reason}")))?;
        self.model
            .config
            .check_token_ids("token_ids", token_ids)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let hashes = tandem_worker::block_hashes(&self.model, cache_salt, token_ids);
        let cells = self.scheduler.export(hashes.clone()).await;
        let tokens = cells.last().map_or(0, |kv| kv.tokens.end);
        // The sequence asked for, and what of it was sent, are settled either way.
        if let Some(last) = (tokens / BLOCK_TOKENS).checked_sub(1) {
            self.handoffs.fetched(hashes[last]);
        }
        if let Some(&asked) = hashes.last() {
            self.handoffs.fetched(asked);
        }
        Ok(Cached {
            tokens: tokens as u32,
            chunks: cells
                .into_iter()
                .flat_map(tandem_worker::kv_chunks)
                .collect(),
        })
    }
}

impl RequestContext {
    /// Fetches the KV of `tokens` (from token 0) from the peer at `addr`; `None` (counted as a
    /// failure when something went wrong) when there is none to use.
    pub(crate) async fn fetch(
        &self,
        addr: &str,
        request_id: &str,
        cache_salt: &str,
        tokens: &[u32],
    ) -> Option<KvExport> {
        if tokens.is_empty() {
            return None;
        }
        let channel = tandem_net::channel(
            addr,
            self.tls.as_ref().map(tandem_net::tls::Tls::client_config),
        );
        let want = FetchWant {
            fingerprint: self.model.fingerprint.0,
            layout: tandem_worker::wire_layout(self.kv_layout),
            idle: FETCH_IDLE,
        };
        let request = pb::FetchRequest {
            request_id: request_id.to_string(),
            model_fingerprint: self.model.fingerprint.0.to_vec().into(),
            token_ids: tokens.to_vec(),
            cache_salt: cache_salt.to_string(),
        };
        let fetched = match channel {
            Ok(channel) => tandem_transfer::fetch::fetch(channel, request, &want).await,
            Err(e) => Err(tandem_transfer::Error::Transport {
                code: tonic::Code::InvalidArgument,
                message: e.to_string(),
            }),
        };
        match fetched {
            Ok(kv) => kv.map(|kv| tandem_worker::kv_export(self.kv_layout, kv)),
            Err(e) => {
                self.shared.metrics.fetch_failures.inc();
                tracing::warn!(holder = addr, error = %e, "peer fetch failed; computing instead");
                None
            }
        }
    }

    /// `Decode.Sessions`: the drain's offer, to the first caller. A caller that saw NOT_SERVING
    /// may come before the offer is made: it waits for it, at most [`OFFER_IDLE`].
    pub(crate) async fn sessions(&self) -> Vec<pb::CachedSession> {
        self.shared
            .handoffs
            .take_offer(OFFER_IDLE)
            .await
            .into_iter()
            .map(|s| pb::CachedSession {
                token_ids: s.tokens,
                cache_salt: s.cache_salt,
            })
            .collect()
    }

    /// `Decode.Adopt`: fetches what this node lacks of `session` from the draining peer at
    /// `holder` and keeps it in the session cache; the tokens held after, and those fetched.
    pub(crate) async fn adopt(
        &self,
        request_id: &str,
        holder: &str,
        session: pb::CachedSession,
    ) -> Result<(usize, usize)> {
        if self.draining.is_cancelled() {
            return Err(Error::ShuttingDown);
        }
        if !self.prefix_cache {
            return Err(Error::FailedPrecondition("the session cache is off"));
        }
        tandem_proto::check_ids(&[("cache_salt", &session.cache_salt), ("holder_addr", holder)])
            .map_err(|(field, reason)| Error::InvalidArgument { field, reason })?;
        self.model
            .config
            .check_token_ids("session.token_ids", &session.token_ids)?;
        let hashes =
            tandem_worker::block_hashes(&self.model, &session.cache_salt, &session.token_ids);
        let Some(&last) = hashes.last() else {
            return Ok((0, 0));
        };
        let whole = hashes.len() * BLOCK_TOKENS;
        let held = self.scheduler.held(hashes.clone()).await;
        if held >= whole {
            return Ok((held, 0));
        }
        let tokens = &session.token_ids[..whole];
        let kv = tokio::select! {
            kv = self.fetch(holder, request_id, &session.cache_salt, tokens) => kv,
            () = self.draining.cancelled() => return Err(Error::ShuttingDown),
        };
        let Some(kv) = kv else {
            return Ok((held, 0));
        };
        let fetched = kv.tokens.end;
        let session = Session {
            cache_salt: session.cache_salt,
            tokens: tokens.to_vec(),
            last,
        };
        let now = self
            .scheduler
            .adopt(session, hashes, kv)
            .await
            .ok_or(Error::ShuttingDown)?
            .map_err(|e| match e {
                tandem_engine::Error::KvExhausted { .. } => Error::Capacity {
                    detail: format!("no room for a session of {whole} tokens"),
                },
                e => Error::Engine(e),
            })?;
        let m = &self.shared.metrics;
        m.adopted_sessions.inc();
        m.adopted_tokens.inc_by(fetched.min(now) as u64);
        Ok((now, fetched.min(now)))
    }

    /// The drain's hand-off: refuses new requests, hands the running streams off, offers the
    /// most recently used cached sessions, and waits until the streams have ended, their kept
    /// KV was fetched, and the offered sessions were fetched (or nobody fetched any for
    /// [`OFFER_IDLE`]), or `bound` passed.
    pub(crate) async fn hand_off(&self, bound: Duration) {
        let handoffs = &self.shared.handoffs;
        self.draining.cancel();
        let started = Instant::now();
        let offer = self.scheduler.offer().await;
        let offered = offer.len();
        self.shared.metrics.offered_sessions.inc_by(offered as u64);
        handoffs.offer(offer);
        while started.elapsed() < bound
            && (!self.tracker.is_empty() || handoffs.waiting(OFFER_IDLE))
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (unfetched, sessions_left) = handoffs.unfetched();
        tracing::info!(
            ms = started.elapsed().as_millis() as u64,
            streams_running = self.tracker.len(),
            streams_handed_off = self.shared.metrics.handed_off_streams.get(),
            tokens_handed_off = self.shared.metrics.handed_off_tokens.get(),
            unfetched,
            sessions_offered = offered,
            sessions_fetched = offered - sessions_left,
            "hand-off over"
        );
    }
}
