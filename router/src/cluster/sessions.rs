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
//!
//! With several routers ([`crate::cluster::peers`]), each one's table holds every router's
//! sessions: its own, and those whose last turn went through a peer, learned from the peer's
//! changes ([`Sessions::changes`], [`Sessions::learn`]). A session's clocks (idle, TTL) are run
//! by the router its last turn went through, so its KV is moved or released once; the others
//! keep it for its key's bound and for measuring its next turn. A peer's sessions become this
//! router's own when the peer is gone.

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
    /// The peer router its last turn went through (its peer address); `None`: this one.
    from: Option<Arc<str>>,
    /// This router's change sequence at its last change here (0 for a peer's).
    changed: u64,
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
    table: Mutex<Table>,
    metrics: RouterMetrics,
}

/// Most sessions' ends kept for peers to learn: a peer further behind gets the whole table.
const ENDED_KEPT: usize = 1 << 16;

#[derive(Debug, Default)]
struct Table {
    open: HashMap<Key, Entry>,
    /// The sequence of this router's changes: each turn, move to disk and end takes the next.
    seq: u64,
    /// This router's recent ends, by sequence.
    ended: std::collections::VecDeque<(u64, Key)>,
    /// Ends before this sequence are no longer in `ended`.
    forgot: u64,
}

impl Table {
    fn next(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    fn ended(&mut self, key: Key) {
        let seq = self.next();
        self.ended.push_back((seq, key));
        while self.ended.len() > ENDED_KEPT {
            if let Some((seq, _)) = self.ended.pop_front() {
                self.forgot = seq;
            }
        }
    }
}

/// What changed in this router's sessions since a peer last asked ([`Sessions::changes`]).
#[derive(Debug, Default)]
pub struct Changes {
    pub seq: u64,
    /// The whole table: the peer forgets what it learned from here before.
    pub full: bool,
    pub sessions: Vec<pb::PeerSession>,
    pub ended: Vec<pb::SessionKey>,
}

/// The sessions part of a `Peer.State` answer, as a peer sent it.
impl From<pb::StateResponse> for Changes {
    fn from(r: pb::StateResponse) -> Self {
        Self {
            seq: r.seq,
            full: r.full,
            sessions: r.sessions,
            ended: r.ended,
        }
    }
}

/// A `Peer.State` answer of these changes alone (its instance, load and running generations
/// left for the caller to set).
impl From<Changes> for pb::StateResponse {
    fn from(c: Changes) -> Self {
        Self {
            seq: c.seq,
            full: c.full,
            sessions: c.sessions,
            ended: c.ended,
            ..Self::default()
        }
    }
}

/// The most bytes of sessions one `Peer.State` answer carries: half a message, the rest left to
/// its load and running generations.
pub(crate) const ANSWER_BYTES: usize = tandem_proto::MAX_MESSAGE_BYTES / 2;

/// At most what a session takes in an answer (a token id is at most 5 bytes on the wire).
fn wire_bytes((tenant, id): &Key, e: &Entry) -> usize {
    e.sequence.token_ids.len() * 5 + e.sequence.cache_salt.len() + tenant.len() + id.len() + 32
}

fn wire_key((tenant, id): &Key) -> pb::SessionKey {
    pb::SessionKey {
        tenant: tenant.to_string(),
        session_id: id.clone(),
    }
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
            table: Mutex::default(),
            metrics,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Table> {
        // Single inserts, updates and removes; a poisoned lock is still consistent.
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sessions open: this router's and its peers'.
    pub fn open_sessions(&self) -> usize {
        self.lock().open.len()
    }

    fn gauge(&self, table: &Table) {
        self.metrics.sessions_open.set(table.open.len() as i64);
    }

    /// Records a completed turn: measures its cache use against the session's previous turn
    /// (the tokens read from a pool, read back from disk, and recomputed: those the previous
    /// turn left that this one shares but no cache supplied), and keeps its tokens. Returns the
    /// session its key had to end to stay within `per_key`, if any.
    pub fn turn(&self, t: Turn<'_>) -> Option<Action> {
        let key = (t.tenant.clone(), t.session_id.to_string());
        let mut table = self.lock();
        let changed = table.next();
        let open = &mut table.open;
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
            from: None,
            changed,
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
                if let Some((k, e)) = oldest.and_then(|k| open.remove_entry(&k)) {
                    table.ended(k);
                    ended = Some(Action {
                        session: e.sequence,
                        why: Release::KeyLimit,
                    });
                }
            }
        }
        self.gauge(&table);
        ended
    }

    /// Ends `tenant`'s session `id`: what to release, or `None` when no such session is open.
    pub fn end(&self, tenant: &Arc<str>, id: &str) -> Option<Action> {
        let mut table = self.lock();
        let (key, entry) = table.open.remove_entry(&(tenant.clone(), id.to_string()))?;
        table.ended(key);
        self.gauge(&table);
        Some(Action {
            session: entry.sequence,
            why: Release::Ended,
        })
    }

    /// This router's sessions idle past `ttl` (ended) or `idle` (moved to disk), as of `now`.
    /// A peer's session idle past twice `ttl` is dropped without a release: its router should
    /// have ended it, and said so.
    pub fn sweep(&self, now: Instant) -> Vec<Action> {
        let mut table = self.lock();
        let (mut actions, mut ended) = (Vec::new(), Vec::new());
        let Table { open, seq, .. } = &mut *table;
        open.retain(|k, e| {
            let idle = now.saturating_duration_since(e.last_used);
            if e.from.is_some() {
                return idle < 2 * self.config.ttl;
            }
            if idle >= self.config.ttl {
                actions.push(Action {
                    session: std::mem::take(&mut e.sequence),
                    why: Release::Expired,
                });
                ended.push(k.clone());
                return false;
            }
            if idle >= self.config.idle && !e.on_disk {
                e.on_disk = true;
                actions.push(Action {
                    session: e.sequence.clone(),
                    why: Release::Idle,
                });
                *seq += 1;
                e.changed = *seq;
            }
            true
        });
        for k in ended {
            table.ended(k);
        }
        self.gauge(&table);
        actions
    }

    /// This router's sessions changed since its change `since` (0: all of them), and the ends
    /// since; the whole table when `since` is older than the ends kept.
    pub fn changes(&self, since: u64) -> Changes {
        let table = self.lock();
        let mut full = since == 0 || since < table.forgot || since > table.seq;
        let now = Instant::now();
        let mine = |e: &Entry| e.from.is_none();
        let mut picked: Vec<(&Key, &Entry)> = (table.open.iter())
            .filter(|(_, e)| mine(e) && (full || e.changed > since))
            .collect();
        // One answer is one message: past its budget, the whole table's most recently used
        // sessions that fit in it, the others left for the peer to meet when they next come.
        if picked.iter().map(|(k, e)| wire_bytes(k, e)).sum::<usize>() > ANSWER_BYTES {
            picked = table.open.iter().filter(|(_, e)| mine(e)).collect();
            picked.sort_by_key(|(_, e)| std::cmp::Reverse(e.last_used));
            let mut used = 0;
            picked.retain(|(k, e)| {
                let bytes = wire_bytes(k, e);
                let fits = used + bytes <= ANSWER_BYTES;
                used += if fits { bytes } else { 0 };
                fits
            });
            full = true;
        }
        let sessions = (picked.into_iter())
            .map(|(k, e)| pb::PeerSession {
                key: Some(wire_key(k)),
                idle_ms: now.saturating_duration_since(e.last_used).as_millis() as u64,
                sequence: Some(e.sequence.clone()),
                on_disk: e.on_disk,
            })
            .collect();
        let ended = if full {
            Vec::new()
        } else {
            (table.ended.iter())
                .filter(|(seq, _)| *seq > since)
                .map(|(_, k)| wire_key(k))
                .collect()
        };
        Changes {
            seq: table.seq,
            full,
            sessions,
            ended,
        }
    }

    /// Takes in what peer `peer` said changed ([`Sessions::changes`]). A session this router
    /// served a later turn of stays this router's.
    pub fn learn(&self, peer: &Arc<str>, changes: Changes) {
        let mut table = self.lock();
        if changes.full {
            table.open.retain(|_, e| e.from.as_ref() != Some(peer));
        }
        let now = Instant::now();
        for s in changes.sessions {
            let (Some(k), Some(sequence)) = (s.key, s.sequence) else {
                continue;
            };
            let key = (Arc::from(k.tenant), k.session_id);
            let last_used = now
                .checked_sub(Duration::from_millis(s.idle_ms))
                .unwrap_or(now);
            if (table.open.get(&key)).is_some_and(|e| e.from.is_none() && e.last_used > last_used) {
                continue;
            }
            let entry = Entry {
                last_used,
                from: Some(peer.clone()),
                changed: 0,
                sequence,
                on_disk: s.on_disk,
            };
            table.open.insert(key, entry);
        }
        for k in changes.ended {
            table.open.remove(&(Arc::from(k.tenant), k.session_id));
        }
        self.gauge(&table);
    }

    /// Makes the sessions learned from `peer` this router's own (the peer is gone): their
    /// clocks run here from now on, and this router's peers learn them.
    pub fn adopt(&self, peer: &str) {
        let mut table = self.lock();
        let Table { open, seq, .. } = &mut *table;
        for e in open
            .values_mut()
            .filter(|e| e.from.as_deref() == Some(peer))
        {
            *seq += 1;
            e.from = None;
            e.changed = *seq;
        }
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
mod tests;
