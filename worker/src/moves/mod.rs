//! KV that moves between workers of one role, the same on prefill and decode nodes: peer fetches
//! from a worker's cache (`KvTransfer.Fetch`), and the drain's offer of its most recently used
//! cached sequences, which the router moves to the node's peers (`Worker.Sessions`,
//! `Worker.Adopt`).
//!
//! ```text
//! SIGTERM ─▶ NOT_SERVING, `draining`: Adopt refused; the engine thread picks its offer: the
//!            most recently used cached sequences still in the pool, within the hand-off budget
//!         ─▶ the router takes the offer (Worker.Sessions) and asks peers to take each
//!            (Worker.Adopt); each fetches the KV here (KvTransfer.Fetch, checked as a push)
//!            and keeps it in its own cache, whose events tell every router's index
//!         ─▶ once the offered sequences were fetched, or nobody fetched any for OFFER_IDLE, or
//!            the hand-off bound passed (and the role's own work is done): the listener closes
//! ```
//!
//! A decode node also keeps its running streams' KV for the peers that continue them
//! ([`Handoffs::kept`]). Whatever fails costs only time: the tokens are computed where they are
//! needed next.
//!
//! The engine belongs to one thread per node (the decode scheduler, the prefill compute thread):
//! the moves reach its cache through an [`EngineCache`], whose [`CacheCommand`]s that thread
//! answers between its own work ([`CacheCommand::answer`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use tandem_engine::{BLOCK_TOKENS, KvExport, KvLayout, Model};
use tandem_proto::v1 as pb;
use tandem_transfer::{Cached, FetchSource, FetchWant, KvSource};
use tokio_util::sync::CancellationToken;
use tonic::Status;

mod engine_cache;
mod handoffs;

pub use engine_cache::{CacheCommand, EngineCache, Recent, Session, keep_fetched};
use handoffs::Pending;

/// What resolves once a draining role's own work may be done ([`KvMoves::hand_off`]).
pub type Busy<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'a>>;

use crate::error::Error;
pub use handoffs::Handoffs;

/// The longest a fetch may go without a frame before it is dropped (and its tokens computed).
pub const FETCH_IDLE: Duration = Duration::from_secs(2);

/// How long a drain waits for its offered sequences while nobody takes the offer or fetches
/// any of them (no router asked, or no peer had room): the router asks within milliseconds
/// of the health watch's NOT_SERVING.
pub const OFFER_IDLE: Duration = Duration::from_millis(500);

/// The moves' counters: `tandem_<role>_…`.
#[derive(Clone, Debug, Default)]
pub struct MoveMetrics {
    /// Peer fetches that failed or stalled (their tokens were computed instead).
    pub fetch_failures: Counter,
    /// Cached sequences offered to peers at drain.
    pub offered_sessions: Counter,
    /// Sequences moved here from a draining peer, and the tokens of KV fetched for them.
    pub adopted_sessions: Counter,
    pub adopted_tokens: Counter,
}

impl MoveMetrics {
    pub fn register(registry: &mut Registry, role: &str) -> Self {
        let m = Self::default();
        for (name, help, counter) in [
            (
                "fetch_failures",
                "Peer fetches that failed or stalled; their tokens were computed instead",
                &m.fetch_failures,
            ),
            (
                "offered_sessions",
                "Cached sequences offered at drain for peers to take",
                &m.offered_sessions,
            ),
            (
                "adopted_sessions",
                "Cached sequences moved into this node's cache from a draining peer",
                &m.adopted_sessions,
            ),
            (
                "adopted_tokens",
                "Tokens of KV fetched for sequences moved here from a draining peer",
                &m.adopted_tokens,
            ),
        ] {
            registry.register(format!("tandem_{role}_{name}"), help, counter.clone());
        }
        m
    }
}

/// How a drain's hand-off went.
#[derive(Debug)]
pub struct HandOff {
    pub ms: u64,
    /// Running streams' KV kept and not fetched.
    pub unfetched: usize,
    pub sessions_offered: usize,
    pub sessions_fetched: usize,
}

/// A node's KV moves: the fetches it makes and serves, its drain's offer, and the sequences it
/// takes from draining peers.
#[derive(Clone, Debug)]
pub struct KvMoves {
    model: Arc<Model>,
    kv_layout: KvLayout,
    /// The connections to the peers it fetches from (over mutual TLS where set).
    peers: tandem_net::Channels,
    cache: EngineCache,
    /// Whether the cache keeps sequences at all (the prefix or session cache is on).
    enabled: bool,
    handoffs: Arc<Handoffs>,
    /// Cancelled as the drain begins: no more adoptions (nor, on a decode node, requests).
    pub draining: CancellationToken,
    metrics: MoveMetrics,
}

impl KvMoves {
    /// The moves of a node whose engine thread offers `cache`; `enabled` when its cache keeps
    /// sequences at all ([`crate::Node::moves`]).
    pub(crate) fn new(
        model: Arc<Model>,
        kv_layout: KvLayout,
        tls: Option<tandem_net::tls::Tls>,
        cache: EngineCache,
        enabled: bool,
        handoffs: Arc<Handoffs>,
        metrics: MoveMetrics,
    ) -> Self {
        Self {
            model,
            kv_layout,
            peers: tandem_net::Channels::new(tls.as_ref()),
            cache,
            enabled,
            handoffs,
            draining: CancellationToken::new(),
            metrics,
        }
    }

    /// The node's cache as its `KvTransfer` service answers peer fetches from it.
    pub fn fetch_source(&self) -> FetchSource {
        FetchSource {
            fingerprint: self.model.fingerprint.0,
            layout: crate::wire_layout(self.kv_layout),
            source: Arc::new(self.clone()),
        }
    }

    /// Fetches the KV of `tokens` (from token 0) from the peer at `addr`; `None` (counted as a
    /// failure when something went wrong) when there is none to use.
    pub async fn fetch(
        &self,
        addr: &str,
        request_id: &str,
        cache_salt: &str,
        tokens: &[u32],
    ) -> Option<KvExport> {
        if tokens.is_empty() {
            return None;
        }
        let channel = self.peers.get(addr);
        let want = FetchWant {
            fingerprint: self.model.fingerprint.0,
            layout: crate::wire_layout(self.kv_layout),
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
            Ok(kv) => kv.map(|kv| crate::kv_export(self.kv_layout, kv)),
            Err(e) => {
                self.metrics.fetch_failures.inc();
                tracing::warn!(holder = addr, error = %e, "peer fetch failed; computing instead");
                None
            }
        }
    }

    /// A stream this node kept at drain came back to it (no peer outside a drain could take
    /// it): `hashes` are its prompt's blocks, and the drain stops waiting for their fetch.
    pub fn taken_back(&self, hashes: &[u64]) {
        self.handoffs.taken_back(hashes);
    }

    /// `Worker.Sessions`: the drain's offer, to the first caller. A caller that saw NOT_SERVING
    /// may come before the offer is made: it waits for it, at most [`OFFER_IDLE`].
    pub async fn sessions(&self) -> Vec<pb::CachedSession> {
        self.handoffs
            .take_offer(OFFER_IDLE)
            .await
            .into_iter()
            .map(|s| pb::CachedSession {
                token_ids: s.tokens,
                cache_salt: s.cache_salt,
            })
            .collect()
    }

    /// `Worker.Adopt`: fetches what this node lacks of the session from the draining peer at
    /// `holder_addr` and keeps it in the cache.
    pub async fn adopt(&self, r: pb::AdoptRequest) -> Result<pb::AdoptResponse, Error> {
        let session = r.session.ok_or(Error::InvalidArgument {
            field: "session",
            reason: "missing".into(),
        })?;
        tandem_proto::check_ids(&[
            ("request_id", &r.request_id),
            ("cache_salt", &session.cache_salt),
            ("holder_addr", &r.holder_addr),
        ])
        .map_err(Error::id)?;
        if self.draining.is_cancelled() {
            return Err(Error::Draining);
        }
        if !self.enabled {
            return Err(Error::CacheOff);
        }
        let hashes = self.session_hashes(&session)?;
        let answer = |held: usize, fetched: usize| pb::AdoptResponse {
            cached_tokens: held as u32,
            fetched_tokens: fetched as u32,
        };
        let Some(&last) = hashes.last() else {
            return Ok(answer(0, 0));
        };
        let whole = hashes.len() * BLOCK_TOKENS;
        let held = self.cache.held(hashes.clone()).await;
        if held >= whole {
            return Ok(answer(held, 0));
        }
        let tokens = &session.token_ids[..whole];
        let kv = tokio::select! {
            kv = self.fetch(&r.holder_addr, &r.request_id, &session.cache_salt, tokens) => kv,
            () = self.draining.cancelled() => return Err(Error::Draining),
        };
        let Some(kv) = kv else {
            return Ok(answer(held, 0));
        };
        let fetched = kv.tokens.end;
        let session = Session {
            cache_salt: session.cache_salt,
            tokens: tokens.to_vec(),
            last,
        };
        let now = (self.cache.adopt(session, hashes, kv).await)
            .ok_or(Error::ShuttingDown)?
            .map_err(|e| match e {
                tandem_engine::Error::KvExhausted { .. } => Error::NoRoom { tokens: whole },
                e => Error::Engine(e),
            })?;
        self.metrics.adopted_sessions.inc();
        self.metrics.adopted_tokens.inc_by(fetched.min(now) as u64);
        Ok(answer(now, fetched.min(now)))
    }

    /// The block hashes of a session a caller named, once its token ids are checked.
    fn session_hashes(&self, session: &pb::CachedSession) -> Result<Vec<u64>, Error> {
        (self.model.config).check_token_ids("session.token_ids", &session.token_ids)?;
        Ok(crate::block_hashes(
            &self.model,
            &session.cache_salt,
            &session.token_ids,
        ))
    }

    /// `Worker.Release`: ends what the cache keeps of a session (see the proto).
    pub async fn release(&self, r: pb::ReleaseRequest) -> Result<pb::ReleaseResponse, Error> {
        let session = r.session.ok_or(Error::InvalidArgument {
            field: "session",
            reason: "missing".into(),
        })?;
        tandem_proto::check_ids(&[("cache_salt", &session.cache_salt)]).map_err(Error::id)?;
        let hashes = self.session_hashes(&session)?;
        let blocks = (self.cache.release(hashes, r.to_disk).await).ok_or(Error::ShuttingDown)?;
        Ok(pb::ReleaseResponse {
            released_tokens: (blocks * BLOCK_TOKENS) as u32,
        })
    }

    /// The drain's hand-off: stops adoptions, makes the offer, and waits until the offered
    /// sequences were fetched (or nobody fetched any for [`OFFER_IDLE`]), the kept streams'
    /// KV was fetched and the role's own running work is done, or `bound` passed. `busy` says
    /// whether that work goes on, with what resolves once it may be done (`None`: done). The
    /// wait wakes on those changes, not on a timer.
    pub async fn hand_off<'b>(
        &self,
        bound: Duration,
        busy: impl Fn() -> Option<Busy<'b>>,
    ) -> HandOff {
        self.draining.cancel();
        let started = Instant::now();
        let offer = self.cache.offer().await;
        let offered = offer.len();
        self.metrics.offered_sessions.inc_by(offered as u64);
        self.handoffs.offer(offer);
        let end = started + bound;
        loop {
            let changed = self.handoffs.changed();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let pending = self.handoffs.pending(OFFER_IDLE);
            let role = busy();
            if role.is_none() && pending == Pending::Nothing {
                break;
            }
            let recheck = match pending {
                Pending::Offer { idle_at } => idle_at.min(end),
                Pending::Nothing | Pending::Fetches => end,
            };
            let role = async {
                match role {
                    Some(done) => done.await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = changed => {}
                () = role => {}
                () = tokio::time::sleep_until(recheck) => {}
            }
            if Instant::now() >= end {
                break;
            }
        }
        let (unfetched, sessions_left) = self.handoffs.unfetched();
        HandOff {
            ms: started.elapsed().as_millis() as u64,
            unfetched,
            sessions_offered: offered,
            sessions_fetched: offered - sessions_left,
        }
    }
}

#[tonic::async_trait]
impl KvSource for KvMoves {
    async fn cached(&self, token_ids: &[u32], cache_salt: &str) -> Result<Cached, Status> {
        tandem_proto::check_ids(&[("cache_salt", cache_salt)]).map_err(Error::id)?;
        (self.model.config)
            .check_token_ids("token_ids", token_ids)
            .map_err(Error::from)?;
        let hashes = crate::block_hashes(&self.model, cache_salt, token_ids);
        let cells = self.cache.export(hashes.clone()).await;
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
            chunks: cells.into_iter().flat_map(crate::kv_chunks).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(last: u64) -> Session {
        Session {
            cache_salt: String::new(),
            tokens: vec![1; BLOCK_TOKENS],
            last,
        }
    }

    /// With time paused: a kept stream holds the drain until a peer fetches it; an offer holds
    /// it while peers fetch from it, and lets it go once nobody has for [`OFFER_IDLE`]. Each
    /// fetch wakes the drain's wait.
    #[tokio::test(start_paused = true)]
    async fn the_drain_waits_for_its_kept_streams_and_a_live_offer() {
        let h = Handoffs::default();
        assert_eq!(
            h.pending(OFFER_IDLE),
            Pending::Nothing,
            "nothing kept or offered"
        );
        h.kept(7);
        tokio::time::advance(OFFER_IDLE * 10).await;
        assert_eq!(h.pending(OFFER_IDLE), Pending::Fetches, "however long");
        let changed = h.changed();
        tokio::pin!(changed);
        changed.as_mut().enable();
        h.fetched(7);
        changed.await;
        assert_eq!(h.pending(OFFER_IDLE), Pending::Nothing);

        h.offer(vec![session(1), session(2)]);
        tokio::time::advance(OFFER_IDLE - Duration::from_millis(1)).await;
        let fresh = Instant::now() + Duration::from_millis(1);
        assert_eq!(h.pending(OFFER_IDLE), Pending::Offer { idle_at: fresh });
        // A fetch is activity: the idle clock starts again.
        h.fetched(1);
        tokio::time::advance(OFFER_IDLE - Duration::from_millis(1)).await;
        assert!(matches!(h.pending(OFFER_IDLE), Pending::Offer { .. }));
        assert_eq!(h.unfetched(), (0, 1));
        tokio::time::advance(Duration::from_millis(2)).await;
        assert_eq!(
            h.pending(OFFER_IDLE),
            Pending::Nothing,
            "idle for OFFER_IDLE"
        );
    }

    /// The offer goes to the first caller once the drain has made it; a caller before that
    /// waits at most its bound and gets nothing.
    #[tokio::test(start_paused = true)]
    async fn the_offer_goes_once_to_the_first_caller() {
        let h = std::sync::Arc::new(Handoffs::default());
        let started = Instant::now();
        assert!(h.take_offer(OFFER_IDLE).await.is_empty());
        assert_eq!(
            started.elapsed(),
            OFFER_IDLE,
            "waited its bound for an offer"
        );
        let early = {
            let h = h.clone();
            tokio::spawn(async move { h.take_offer(OFFER_IDLE).await })
        };
        tokio::time::advance(Duration::from_millis(100)).await;
        h.offer(vec![session(3)]);
        let got = early.await.expect("the waiting caller");
        assert_eq!(got.iter().map(|s| s.last).collect::<Vec<_>>(), [3]);
        assert!(h.take_offer(OFFER_IDLE).await.is_empty(), "taken once");
    }
}
