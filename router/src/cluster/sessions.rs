//! Agent sessions: what the router knows of each open one (the request header or field that
//! names it is read in `crate::api::session`), so that the KV a session holds on the workers
//! follows its life instead of only the pools' LRU order.
//!
//! ```text
//! a turn completes ─▶ turn(): the session's tokens (prompt + reply) kept, its cache use measured
//!   idle past `idle`  ─▶ Worker.Release{to_disk}: its blocks leave the pool for the disk tier
//!   ended (DELETE /v1/sessions/{id}), idle past `ttl`, or its key over `per_key` sessions
//!                     ─▶ Worker.Release: its blocks leave the pool, and are dropped
//! ```
//!
//! A release goes to every replica the router knows: a session's blocks may be on a decode node,
//! on the prefill node that computed its prompt, or on a peer that adopted them at a drain, and
//! a replica that holds none of them does nothing. Only blocks no other cached sequence shares
//! and no running request holds are released (the workers' rule), so a system prompt that other
//! sessions share stays. A session is keyed by its tenant and id: one key cannot end another's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tandem_proto::v1 as pb;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cluster::replicas::Replicas;
use crate::config::SessionConfig;
use crate::metrics::{ReasonLabel, RouterMetrics};

/// The longest a release may take on one replica.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(10);

/// One completed turn of a session, as the dispatch saw it.
#[derive(Debug)]
pub struct Turn<'a> {
    pub tenant: &'a Arc<str>,
    pub session_id: &'a str,
    pub cache_salt: &'a str,
    /// The turn's prompt, and the reply the model generated after it.
    pub prompt: &'a [u32],
    pub reply: &'a [u32],
    /// Prompt tokens a cache supplied, and of those, read back from a disk tier.
    pub cached: usize,
    pub restored: usize,
}

#[derive(Debug)]
struct Entry {
    last_used: Instant,
    /// The session's sequence as its last turn left it (prompt and reply), as a release names it.
    sequence: pb::CachedSession,
    /// Moved to the disk tier since its last turn.
    on_disk: bool,
}

type Key = (Arc<str>, String);

/// Why a session's KV was released or moved, the label of
/// [`crate::metrics::SESSION_RELEASES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// Idle past `idle`: moved to the disk tier, still open.
    Idle,
    /// Idle past `ttl`: ended.
    Expired,
    /// Ended by its client.
    Ended,
    /// Ended because its key opened more than `per_key` sessions.
    KeyLimit,
}

impl Release {
    pub fn name(self) -> &'static str {
        match self {
            Release::Idle => "idle_to_disk",
            Release::Expired => "expired",
            Release::Ended => "ended",
            Release::KeyLimit => "key_limit",
        }
    }

    fn to_disk(self) -> bool {
        self == Release::Idle
    }
}

/// What to send the replicas: a session's sequence, and how to release it.
#[derive(Debug)]
pub struct Action {
    pub session: pb::CachedSession,
    pub why: Release,
}

/// The open sessions.
#[derive(Debug)]
pub struct Sessions {
    config: SessionConfig,
    open: Mutex<HashMap<Key, Entry>>,
    metrics: RouterMetrics,
}

/// The tokens at the start of `a` and `b` that are equal.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Sessions {
    pub fn new(config: SessionConfig, metrics: RouterMetrics) -> Self {
        // The series exist before their first event.
        for why in [
            Release::Idle,
            Release::Expired,
            Release::Ended,
            Release::KeyLimit,
        ] {
            let _ = metrics
                .session_releases
                .get_or_create(&ReasonLabel { reason: why.name() });
        }
        for source in ["pool", "disk", "recomputed"] {
            let _ = metrics.session_turn_tokens(source);
        }
        Self {
            config,
            open: Mutex::default(),
            metrics,
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Key, Entry>> {
        // Single inserts, updates and removes; a poisoned lock is still consistent.
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn gauge(&self, open: &HashMap<Key, Entry>) {
        self.metrics.sessions_open.set(open.len() as i64);
    }

    /// Records a completed turn: measures its cache use against the session's previous turn
    /// (the tokens read from a pool, read back from disk, and recomputed: those the previous
    /// turn left that this one shares but no cache supplied), and keeps its tokens. Returns the
    /// session its key had to end to stay within `per_key`, if any.
    pub fn turn(&self, t: Turn<'_>) -> Option<Action> {
        let key = (t.tenant.clone(), t.session_id.to_string());
        let mut open = self.lock();
        let shared = open.get(&key).map_or(0, |e| {
            let whole = common_prefix(&e.sequence.token_ids, t.prompt);
            whole - whole % tandem_proto::block_hash::BLOCK_TOKENS
        });
        let m = &self.metrics;
        m.session_turn_tokens("pool")
            .observe(t.cached.saturating_sub(t.restored) as f64);
        m.session_turn_tokens("disk").observe(t.restored as f64);
        m.session_turn_tokens("recomputed")
            .observe(shared.saturating_sub(t.cached) as f64);
        let mut tokens = Vec::with_capacity(t.prompt.len() + t.reply.len());
        tokens.extend_from_slice(t.prompt);
        tokens.extend_from_slice(t.reply);
        let entry = Entry {
            last_used: Instant::now(),
            sequence: pb::CachedSession {
                token_ids: tokens,
                cache_salt: t.cache_salt.to_string(),
            },
            on_disk: false,
        };
        let new = open.insert(key.clone(), entry).is_none();
        let mut ended = None;
        if new {
            let of_key = open.keys().filter(|k| k.0 == key.0).count();
            if of_key > self.config.per_key {
                let oldest = open
                    .iter()
                    .filter(|(k, _)| k.0 == key.0)
                    .min_by_key(|(_, e)| e.last_used)
                    .map(|(k, _)| k.clone());
                ended = oldest.and_then(|k| open.remove(&k)).map(|e| Action {
                    session: e.sequence,
                    why: Release::KeyLimit,
                });
            }
        }
        self.gauge(&open);
        ended
    }

    /// Ends `tenant`'s session `id`: what to release, or `None` when no such session is open.
    pub fn end(&self, tenant: &Arc<str>, id: &str) -> Option<Action> {
        let mut open = self.lock();
        let entry = open.remove(&(tenant.clone(), id.to_string()))?;
        self.gauge(&open);
        Some(Action {
            session: entry.sequence,
            why: Release::Ended,
        })
    }

    /// The sessions idle past `ttl` (ended) or `idle` (moved to disk), as of `now`.
    pub fn sweep(&self, now: Instant) -> Vec<Action> {
        let mut open = self.lock();
        let mut actions = Vec::new();
        open.retain(|_, e| {
            let idle = now.saturating_duration_since(e.last_used);
            if idle >= self.config.ttl {
                actions.push(Action {
                    session: std::mem::take(&mut e.sequence),
                    why: Release::Expired,
                });
                return false;
            }
            if idle >= self.config.idle && !e.on_disk {
                e.on_disk = true;
                actions.push(Action {
                    session: e.sequence.clone(),
                    why: Release::Idle,
                });
            }
            true
        });
        self.gauge(&open);
        actions
    }

    /// Sweeps every so often until `cancel`, sending what the sweeps find to the replicas.
    pub fn start_sweeping(
        self: &Arc<Self>,
        replicas: Arc<Replicas>,
        tracker: &TaskTracker,
        cancel: CancellationToken,
    ) {
        let every = (self.config.idle.min(self.config.ttl) / 4)
            .clamp(Duration::from_millis(100), Duration::from_secs(30));
        let sessions = self.clone();
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = cancel.cancelled() => return,
                }
                for a in sessions.sweep(Instant::now()) {
                    sessions.send(&replicas, a).await;
                }
            }
        });
    }

    /// Sends `action` to every replica; returns the tokens released, summed over them.
    pub async fn send(&self, replicas: &Replicas, action: Action) -> u64 {
        self.metrics.session_released(action.why.name());
        let to_disk = action.why.to_disk();
        let calls = replicas.all().into_iter().map(|r| {
            let session = action.session.clone();
            async move {
                let mut client =
                    tandem_proto::limits!(pb::worker_client::WorkerClient::new(r.channel.clone()));
                let mut ask = tonic::Request::new(pb::ReleaseRequest {
                    session: Some(session),
                    to_disk,
                });
                ask.set_timeout(RELEASE_TIMEOUT);
                match client.release(ask).await {
                    Ok(r) => u64::from(r.into_inner().released_tokens),
                    Err(e) => {
                        tracing::debug!(replica = %r.addr, error = %e, "session release failed");
                        0
                    }
                }
            }
        });
        futures::future::join_all(calls).await.into_iter().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sessions(config: SessionConfig) -> Sessions {
        let mut registry = prometheus_client::registry::Registry::default();
        Sessions::new(config, RouterMetrics::register(&mut registry))
    }

    fn turn<'a>(tenant: &'a Arc<str>, id: &'a str, prompt: &'a [u32]) -> Turn<'a> {
        Turn {
            tenant,
            session_id: id,
            cache_salt: "salt",
            prompt,
            reply: &[7, 8],
            cached: 0,
            restored: 0,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn idle_sessions_go_to_disk_then_end() {
        let s = sessions(SessionConfig {
            idle: Duration::from_secs(10),
            ttl: Duration::from_secs(60),
            per_key: 8,
        });
        let a: Arc<str> = "a".into();
        assert!(s.turn(turn(&a, "s1", &[1, 2, 3])).is_none());
        assert!(s.sweep(Instant::now()).is_empty(), "active");
        tokio::time::advance(Duration::from_secs(11)).await;
        let moved = s.sweep(Instant::now());
        assert_eq!(moved.len(), 1);
        assert_eq!(moved[0].why, Release::Idle);
        assert_eq!(
            moved[0].session.token_ids,
            [1, 2, 3, 7, 8],
            "prompt and reply"
        );
        assert!(s.sweep(Instant::now()).is_empty(), "moved once");
        tokio::time::advance(Duration::from_secs(50)).await;
        let ended = s.sweep(Instant::now());
        assert_eq!(ended.len(), 1);
        assert_eq!(ended[0].why, Release::Expired);
        assert!(s.end(&a, "s1").is_none(), "already ended");
        assert_eq!(s.metrics.sessions_open.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_key_over_its_bound_ends_its_least_recent_session() {
        let s = sessions(SessionConfig {
            per_key: 2,
            ..SessionConfig::default()
        });
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        assert!(s.turn(turn(&a, "s1", &[1])).is_none());
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(s.turn(turn(&a, "s2", &[2])).is_none());
        assert!(s.turn(turn(&b, "s1", &[3])).is_none(), "another key's");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(
            s.turn(turn(&a, "s1", &[1, 4])).is_none(),
            "a turn of an open one"
        );
        let ended = s.turn(turn(&a, "s3", &[5])).expect("over the bound");
        assert_eq!(ended.why, Release::KeyLimit);
        assert_eq!(
            ended.session.token_ids,
            [2, 7, 8],
            "s2 was the least recent"
        );
        assert_eq!(s.metrics.sessions_open.get(), 3);
        assert!(s.end(&b, "s2").is_none(), "a key ends only its own");
        assert!(s.end(&a, "s3").is_some());
    }

    #[test]
    fn recomputed_tokens_are_the_shared_whole_blocks_no_cache_supplied() {
        let s = sessions(SessionConfig::default());
        let a: Arc<str> = "a".into();
        let first: Vec<u32> = (0..40).collect();
        s.turn(turn(&a, "s", &first));
        // The next turn shares the first 40 tokens and the reply's 2: two whole blocks of 16.
        let mut next = first.clone();
        next.extend([7, 8, 99, 100]);
        s.turn(Turn {
            cached: 16,
            restored: 16,
            ..turn(&a, "s", &next)
        });
        let m = &s.metrics;
        assert_eq!(m.session_turn_tokens("recomputed").sum(), 16.0);
        assert_eq!(m.session_turn_tokens("disk").sum(), 16.0);
        assert_eq!(m.session_turn_tokens("pool").sum(), 0.0);
    }
}
