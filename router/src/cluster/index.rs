//! The router's index of what each worker's cache holds: per replica, the block hashes in its
//! KV pool and those on its disk tier only, kept current by the worker's `CacheEvents` stream, rebuilt from `CacheSnapshot` when the
//! stream breaks, skips a sequence number, or comes from a new epoch (a restarted worker).
//!
//! ```text
//! per replica: follow() ──CacheEvents──▶ apply(event) ──▶ hashes (exact)
//!                 │ gap / new epoch / stream lost ──▶ resyncing ──CacheSnapshot──▶ exact again
//! router policy ──overlap(prompt hashes)──▶ blocks the replica holds, in its pool and then on
//!                                           its disk (0 unless exact)
//! ```
//!
//! Only an exact index is trusted: while resyncing, or in fallback (the worker is unreachable or
//! its set outgrew the bound), a replica counts as holding nothing, so the router never routes
//! to KV that may be gone. (Routing on stale data would only cost speed, since workers report
//! what they actually hold, but a restarted worker's old set is worthless.)
//!
//! A lookup reads the pool's set by binary search over the prompt's blocks: a worker's pool holds
//! every cached block's parent with it (its prefix cache is a radix tree, evicting leaves only),
//! and a chained hash's parent is the hash before it, so of one prompt's blocks the pool holds a
//! prefix, and the events keep the index in that shape after each one. The disk tier keeps no
//! such order, so the blocks that follow on disk are counted one by one.
//!
//! Memory: a `HashSet<u64>` costs 9 bytes per slot (key and control byte) at a load factor of
//! 7/8 or less, so 10-21 bytes per cached block depending on where the set is between growths;
//! each replica's two sets are capped at [`Config::max_blocks`](crate::Config) entries together,
//! beyond which the replica falls back to holding nothing until its next snapshot fits.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tandem_proto::v1 as pb;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

use crate::metrics::{ReplicaLabel, ReplicaModeLabel, RouterMetrics};

/// The longest a gone replica waits to be asked again (health and cache index alike): a node
/// restarted in a rolling restart is back in the set within this of serving, before the next
/// node goes down.
pub(crate) const RECONNECT_MAX: Duration = Duration::from_millis(500);

/// How far the index can be trusted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Every event up to `seq` applied.
    Exact,
    /// Waiting for a snapshot after a gap, a new epoch or a lost stream.
    Resyncing,
    /// The worker cannot be followed (unreachable, or its set is over the bound).
    Fallback,
}

impl Mode {
    pub const ALL: [Mode; 3] = [Mode::Exact, Mode::Resyncing, Mode::Fallback];

    pub fn name(self) -> &'static str {
        match self {
            Mode::Exact => "exact",
            Mode::Resyncing => "resyncing",
            Mode::Fallback => "fallback",
        }
    }
}

/// A set of block hashes, with a fast hasher seeded per process.
type Set = foldhash::HashSet<u64>;

#[derive(Debug)]
struct State {
    /// In the KV pool.
    hashes: Set,
    /// On the disk tier only: a hit reads them back.
    spilled: Set,
    epoch: u64,
    seq: u64,
    mode: Mode,
    /// When the index was last known to be current.
    synced: Instant,
    /// The worker's latest sequence number, from its load reports.
    reported_seq: u64,
}

impl State {
    fn forget(&mut self) {
        self.hashes = Set::default();
        self.spilled = Set::default();
    }
}

/// One replica's cache index.
#[derive(Debug)]
pub struct CacheIndex {
    state: Mutex<State>,
    max_blocks: usize,
}

/// How much of a prompt's leading blocks a replica holds: those in its KV pool, then those
/// that follow on its disk tier (as the worker's lookup reads them back).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Overlap {
    pub pool: usize,
    pub disk: usize,
}

impl Overlap {
    pub fn blocks(self) -> usize {
        self.pool + self.disk
    }
}

/// What the freshness gauges show.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Freshness {
    pub mode: Mode,
    pub events_behind: u64,
    pub seconds_since_sync: f64,
    pub blocks: usize,
}

impl Freshness {
    /// Sets one replica's gauges: whether it is up, and its index's freshness.
    pub(crate) fn report(&self, m: &RouterMetrics, replica: &str, role: &'static str, up: bool) {
        let label = ReplicaLabel {
            replica: replica.to_string(),
            role,
        };
        m.replica_up.get_or_create(&label).set(i64::from(up));
        m.index_events_behind
            .get_or_create(&label)
            .set(self.events_behind as i64);
        m.index_seconds_since_sync
            .get_or_create(&label)
            .set(self.seconds_since_sync);
        m.index_blocks.get_or_create(&label).set(self.blocks as i64);
        for mode in Mode::ALL {
            let label = ReplicaModeLabel {
                replica: replica.to_string(),
                role,
                mode: mode.name(),
            };
            m.index_mode
                .get_or_create(&label)
                .set(i64::from(mode == self.mode));
        }
    }
}

/// Drops a replica's gauges ([`Freshness::report`]) once it has left the set.
pub(crate) fn forget_gauges(m: &RouterMetrics, replica: &str, role: &'static str) {
    let label = ReplicaLabel {
        replica: replica.to_string(),
        role,
    };
    m.replica_up.remove(&label);
    m.index_events_behind.remove(&label);
    m.index_seconds_since_sync.remove(&label);
    m.index_blocks.remove(&label);
    for mode in Mode::ALL {
        m.index_mode.remove(&ReplicaModeLabel {
            replica: replica.to_string(),
            role,
            mode: mode.name(),
        });
    }
}

/// Why following the stream stopped.
#[derive(Debug)]
pub(crate) enum Break {
    /// Resync at once (gap or new epoch).
    Resync,
    /// The stream or the snapshot failed; try again later.
    Lost,
}

impl CacheIndex {
    pub fn new(max_blocks: usize) -> Self {
        Self {
            state: Mutex::new(State {
                hashes: Set::default(),
                spilled: Set::default(),
                epoch: 0,
                seq: 0,
                mode: Mode::Fallback,
                synced: Instant::now(),
                reported_seq: 0,
            }),
            max_blocks,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update leaves the state whole; a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How many leading blocks of `hashes` the replica holds (none unless the index is exact).
    /// `hint` is where another replica's pool prefix ended: replicas sharing a prompt's prefix
    /// (a system prompt the whole fleet holds) mostly end at the same block, which two lookups
    /// confirm before a binary search is needed.
    pub fn overlap(&self, hashes: &[u64], hint: usize) -> Overlap {
        let s = self.lock();
        if s.mode != Mode::Exact {
            return Overlap::default();
        }
        // The pool holds a prefix of the prompt's blocks (see the module's doc).
        let holds = |i: usize| s.hashes.contains(&hashes[i]);
        let pool = if hashes.is_empty() || !holds(0) {
            0
        } else if (1..=hashes.len()).contains(&hint)
            && holds(hint - 1)
            && (hint == hashes.len() || !holds(hint))
        {
            hint
        } else {
            hashes.partition_point(|h| s.hashes.contains(h))
        };
        let disk = hashes[pool..]
            .iter()
            .take_while(|h| s.spilled.contains(h))
            .count();
        Overlap { pool, disk }
    }

    pub fn freshness(&self) -> Freshness {
        let s = self.lock();
        Freshness {
            mode: s.mode,
            events_behind: s.reported_seq.saturating_sub(s.seq),
            seconds_since_sync: s.synced.elapsed().as_secs_f64(),
            blocks: s.hashes.len() + s.spilled.len(),
        }
    }

    fn set_mode(&self, mode: Mode) {
        let mut s = self.lock();
        if mode != Mode::Exact {
            s.forget();
        }
        s.mode = mode;
    }

    /// Takes a load report's view of the worker's cache: a new epoch means the index is stale;
    /// a sequence number the index has reached means it is current.
    pub fn observe_report(&self, epoch: u64, seq: u64) {
        let mut s = self.lock();
        s.reported_seq = seq;
        if s.mode == Mode::Exact && epoch != s.epoch {
            s.mode = Mode::Resyncing;
            s.forget();
        } else if s.mode == Mode::Exact && seq <= s.seq {
            s.synced = Instant::now();
        }
    }

    pub(crate) fn apply_snapshot(&self, snap: pb::CacheSnapshotResponse) {
        let mut s = self.lock();
        let blocks = snap.hashes.len() + snap.spilled_hashes.len();
        if blocks > self.max_blocks {
            tracing::warn!(
                blocks,
                max = self.max_blocks,
                "a worker's cache is over the index bound; treating it as empty"
            );
            s.mode = Mode::Fallback;
            s.forget();
            return;
        }
        s.hashes = snap.hashes.into_iter().collect();
        s.spilled = snap.spilled_hashes.into_iter().collect();
        s.epoch = snap.epoch;
        s.seq = snap.seq;
        s.mode = Mode::Exact;
        s.synced = Instant::now();
    }

    pub(crate) fn apply(&self, e: pb::CacheEvent) -> Result<(), Break> {
        let mut s = self.lock();
        if e.epoch != s.epoch {
            return Err(Break::Resync);
        }
        if e.seq <= s.seq {
            // Already in the snapshot.
            return Ok(());
        }
        if e.seq != s.seq + 1 {
            tracing::info!(have = s.seq, got = e.seq, "cache event gap; resyncing");
            return Err(Break::Resync);
        }
        let State {
            hashes, spilled, ..
        } = &mut *s;
        match e.kind {
            Some(pb::cache_event::Kind::Stored(b)) => {
                for h in b.hashes {
                    spilled.remove(&h);
                    hashes.insert(h);
                }
            }
            Some(pb::cache_event::Kind::Spilled(b)) => {
                for h in b.hashes {
                    hashes.remove(&h);
                    spilled.insert(h);
                }
            }
            Some(pb::cache_event::Kind::Evicted(b)) => {
                for h in b.hashes {
                    hashes.remove(&h);
                    spilled.remove(&h);
                }
            }
            Some(pb::cache_event::Kind::Cleared(_)) => {
                hashes.clear();
                spilled.clear();
            }
            None => {}
        }
        s.seq = e.seq;
        s.synced = Instant::now();
        if s.hashes.len() + s.spilled.len() > self.max_blocks {
            s.mode = Mode::Fallback;
            s.forget();
            return Err(Break::Lost);
        }
        Ok(())
    }

    /// Follows the worker's cache for as long as the caller lets it: subscribe, snapshot, apply
    /// events; on any break, resync.
    pub async fn follow(&self, channel: Channel) {
        let mut backoff = Duration::from_millis(50);
        loop {
            match self.follow_once(channel.clone()).await {
                Break::Resync => {
                    self.set_mode(Mode::Resyncing);
                    backoff = Duration::from_millis(50);
                }
                Break::Lost => {
                    if self.lock().mode != Mode::Fallback {
                        self.set_mode(Mode::Resyncing);
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(RECONNECT_MAX);
                }
            }
        }
    }

    async fn follow_once(&self, channel: Channel) -> Break {
        let mut worker = tandem_proto::limits!(pb::worker_client::WorkerClient::new(channel));
        // Subscribe first, then snapshot: events after the snapshot's seq are all in the stream.
        let Ok(stream) = worker.cache_events(pb::CacheEventsRequest {}).await else {
            self.set_mode(Mode::Fallback);
            return Break::Lost;
        };
        let mut stream = stream.into_inner();
        let Ok(snapshot) = worker.cache_snapshot(pb::CacheSnapshotRequest {}).await else {
            return Break::Lost;
        };
        self.apply_snapshot(snapshot.into_inner());
        if self.lock().mode != Mode::Exact {
            return Break::Lost;
        }
        loop {
            match stream.next().await {
                Some(Ok(event)) => {
                    if let Err(b) = self.apply(event) {
                        return b;
                    }
                }
                // Lagged (the worker dropped us) or the connection broke.
                Some(Err(_)) | None => return Break::Resync,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(epoch: u64, seq: u64, stored: &[u64]) -> pb::CacheEvent {
        pb::CacheEvent {
            epoch,
            seq,
            kind: Some(pb::cache_event::Kind::Stored(pb::BlocksStored {
                hashes: stored.to_vec(),
            })),
        }
    }

    fn blocks(pool: usize, disk: usize) -> Overlap {
        Overlap { pool, disk }
    }

    #[test]
    fn events_apply_in_order_and_gaps_or_epochs_break() {
        let idx = CacheIndex::new(100);
        assert_eq!(
            idx.overlap(&[1], 0),
            blocks(0, 0),
            "not exact before a snapshot"
        );
        idx.apply_snapshot(pb::CacheSnapshotResponse {
            epoch: 7,
            seq: 2,
            hashes: vec![1, 2],
            spilled_hashes: vec![3],
        });
        assert_eq!(idx.overlap(&[1, 2, 3, 4], 0), blocks(2, 1));
        assert!(
            idx.apply(event(7, 2, &[9])).is_ok(),
            "already in the snapshot"
        );
        assert!(idx.apply(event(7, 3, &[3])).is_ok());
        assert_eq!(
            idx.overlap(&[1, 2, 3], 0),
            blocks(3, 0),
            "read back into the pool"
        );
        let spilled = pb::CacheEvent {
            kind: Some(pb::cache_event::Kind::Spilled(pb::BlocksSpilled {
                hashes: vec![2, 3],
            })),
            ..event(7, 4, &[])
        };
        assert!(idx.apply(spilled).is_ok());
        assert_eq!(idx.overlap(&[1, 2, 3], 0), blocks(1, 2));
        let evicted = pb::CacheEvent {
            kind: Some(pb::cache_event::Kind::Evicted(pb::BlocksEvicted {
                hashes: vec![3],
            })),
            ..event(7, 5, &[])
        };
        assert!(idx.apply(evicted).is_ok());
        assert_eq!(
            idx.overlap(&[1, 2, 3], 0),
            blocks(1, 1),
            "gone from the disk too"
        );
        assert!(matches!(idx.apply(event(7, 7, &[4])), Err(Break::Resync)));
        assert!(matches!(idx.apply(event(8, 6, &[4])), Err(Break::Resync)));
        // A load report from a new epoch invalidates the index at once.
        idx.observe_report(8, 1);
        assert_eq!(idx.overlap(&[1], 0), blocks(0, 0));
        assert_eq!(idx.freshness().mode, Mode::Resyncing);
    }

    /// Whatever the hint, the pool's part is the prefix of the prompt's blocks the replica holds
    /// (beside another prompt's blocks).
    #[test]
    fn the_pool_prefix_is_found_from_any_hint() {
        let chain: Vec<u64> = (100..120).collect();
        for held in 0..=chain.len() {
            let idx = CacheIndex::new(100);
            idx.apply_snapshot(pb::CacheSnapshotResponse {
                epoch: 1,
                seq: 0,
                hashes: chain[..held].iter().copied().chain(500..520).collect(),
                spilled_hashes: vec![],
            });
            for hint in 0..=chain.len() + 1 {
                assert_eq!(
                    idx.overlap(&chain, hint).pool,
                    held,
                    "held {held}, hint {hint}"
                );
            }
        }
    }

    #[test]
    fn a_set_over_the_bound_falls_back() {
        let idx = CacheIndex::new(2);
        idx.apply_snapshot(pb::CacheSnapshotResponse {
            epoch: 1,
            seq: 0,
            hashes: vec![1, 2],
            spilled_hashes: vec![3],
        });
        assert_eq!(idx.freshness().mode, Mode::Fallback);
        assert_eq!(idx.overlap(&[1], 0), blocks(0, 0));
    }
}
