//! The cache-event hub: the one place a worker's cache changes are numbered and fanned out to
//! subscribers (the routers' `CacheEvents` streams), with a mirror of the cached hashes (by
//! tier: the KV pool, or the disk tier only) for `CacheSnapshot`.
//!
//! ```text
//! engine owner thread ──publish(events)──▶ CacheHub ──broadcast (bounded)──▶ CacheEvents streams
//!                                             └── mirror: hashes, seq ──▶ CacheSnapshot
//! ```
//!
//! Numbering, mirroring and sending happen under one lock, so a subscriber that subscribes and
//! then takes a snapshot sees every event after the snapshot's `seq` exactly once. A subscriber
//! that falls more than [`EVENT_BUFFER`] events behind loses its stream and resyncs.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard};

use tandem_engine::CacheEvent;
use tandem_proto::v1 as pb;
use tokio::sync::broadcast;
use tokio::sync::broadcast::error::RecvError;
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;
use tonic::Status;

/// `Worker.CacheEvents`' answer: the events from its call on, until `cancel` or, for a
/// subscriber that fell [`EVENT_BUFFER`] events behind, ABORTED (it resyncs).
pub type EventStream = Pin<Box<dyn Stream<Item = Result<pb::CacheEvent, Status>> + Send + 'static>>;

/// Events buffered per subscriber before it is dropped as lagging.
pub const EVENT_BUFFER: usize = 4096;

#[derive(Debug, Default)]
struct Mirror {
    seq: u64,
    /// Each cached hash, and whether it is on the disk tier only.
    hashes: HashMap<u64, bool>,
}

#[derive(Debug)]
pub struct CacheHub {
    epoch: u64,
    mirror: Mutex<Mirror>,
    tx: broadcast::Sender<pb::CacheEvent>,
}

impl Default for CacheHub {
    fn default() -> Self {
        Self::new()
    }
}

impl CacheHub {
    /// A hub with a fresh epoch (random, so a restarted worker never repeats one).
    pub fn new() -> Self {
        Self {
            epoch: rand::random::<u64>() | 1,
            mirror: Mutex::default(),
            tx: broadcast::channel(EVENT_BUFFER).0,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Mirror> {
        // Each update is applied whole before the lock is released; a poisoned lock is still
        // consistent.
        self.mirror.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The last event's sequence number.
    pub fn seq(&self) -> u64 {
        self.lock().seq
    }

    /// Numbers, mirrors and sends `events`, in order.
    pub fn publish(&self, events: Vec<CacheEvent>) {
        if events.is_empty() {
            return;
        }
        let mut m = self.lock();
        for e in events {
            m.seq += 1;
            let kind = match e {
                CacheEvent::Stored(hashes) => {
                    m.hashes.extend(hashes.iter().map(|&h| (h, false)));
                    pb::cache_event::Kind::Stored(pb::BlocksStored { hashes })
                }
                CacheEvent::Spilled(hashes) => {
                    m.hashes.extend(hashes.iter().map(|&h| (h, true)));
                    pb::cache_event::Kind::Spilled(pb::BlocksSpilled { hashes })
                }
                CacheEvent::Evicted(hashes) => {
                    for h in &hashes {
                        m.hashes.remove(h);
                    }
                    pb::cache_event::Kind::Evicted(pb::BlocksEvicted { hashes })
                }
                CacheEvent::Cleared => {
                    m.hashes.clear();
                    pb::cache_event::Kind::Cleared(pb::CacheCleared {})
                }
            };
            // No subscriber is fine: the mirror has it.
            let _ = self.tx.send(pb::CacheEvent {
                epoch: self.epoch,
                seq: m.seq,
                kind: Some(kind),
            });
        }
    }

    /// Every event published from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<pb::CacheEvent> {
        // Under the lock, so that no event is half-published around the subscription.
        let _m = self.lock();
        self.tx.subscribe()
    }

    /// Every event published from now on as `Worker.CacheEvents` streams them: until `cancel`
    /// (the node shutting down, so the stream never holds up its drain), or ABORTED once the
    /// subscriber falls [`EVENT_BUFFER`] events behind.
    pub fn events(&self, cancel: CancellationToken) -> EventStream {
        let rx = self.subscribe();
        let stream =
            futures::stream::unfold((rx, cancel, false), |(mut rx, cancel, done)| async move {
                if done {
                    return None;
                }
                let item = tokio::select! {
                    r = rx.recv() => r,
                    () = cancel.cancelled() => return None,
                };
                match item {
                    Ok(event) => Some((Ok(event), (rx, cancel, false))),
                    Err(RecvError::Lagged(n)) => {
                        let status = Status::aborted(format!(
                            "the subscriber fell {n} cache events behind; resync from CacheSnapshot"
                        ));
                        Some((Err(status), (rx, cancel, true)))
                    }
                    Err(RecvError::Closed) => None,
                }
            });
        Box::pin(stream)
    }

    pub fn snapshot(&self) -> pb::CacheSnapshotResponse {
        let m = self.lock();
        let tier = |disk: bool| m.hashes.iter().filter(move |h| *h.1 == disk).map(|h| *h.0);
        pb::CacheSnapshotResponse {
            epoch: self.epoch,
            seq: m.seq,
            hashes: tier(false).collect(),
            spilled_hashes: tier(true).collect(),
        }
    }

    /// How many hashes are cached now, in either tier.
    pub fn len(&self) -> usize {
        self.lock().hashes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn events_are_numbered_mirrored_and_sent() {
        let hub = CacheHub::new();
        let mut rx = hub.subscribe();
        hub.publish(vec![CacheEvent::Stored(vec![1, 2, 3])]);
        hub.publish(vec![
            CacheEvent::Evicted(vec![3]),
            CacheEvent::Stored(vec![4]),
            CacheEvent::Spilled(vec![2]),
        ]);
        let snap = hub.snapshot();
        assert_eq!(snap.seq, 4);
        let mut hashes = snap.hashes.clone();
        hashes.sort_unstable();
        assert_eq!(hashes, vec![1, 4]);
        assert_eq!(snap.spilled_hashes, vec![2]);
        for want in 1..=4 {
            let e = rx.recv().await.expect("an event");
            assert_eq!((e.epoch, e.seq), (hub.epoch(), want));
        }
        hub.publish(vec![CacheEvent::Cleared]);
        assert!(hub.is_empty());
        assert_ne!(CacheHub::new().epoch(), hub.epoch());
    }
}
