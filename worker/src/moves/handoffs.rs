//! What a drain keeps for peers to fetch ([`Handoffs`]): a decode node's running streams' KV,
//! and the offer of its cached sequences, until they are fetched or the drain stops waiting.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::Session;

/// What a drain keeps for peers to fetch, by the hash of each sequence's last kept block: a
/// decode node's running streams' KV, and the cached sequences it offers.
#[derive(Debug)]
pub(super) struct State {
    pub(super) streams: HashSet<u64>,
    pub(super) sessions: HashSet<u64>,
    /// The offer, until a caller takes it.
    pub(super) offer: Vec<Session>,
    /// When the offer was made or taken, or an offered sequence last fetched.
    pub(super) active: Instant,
}

#[derive(Debug)]
pub struct Handoffs {
    state: Mutex<State>,
    /// Whether the drain has made its offer: the health watch says NOT_SERVING a moment before.
    offered: tokio::sync::watch::Sender<bool>,
    /// Woken when what the drain waits for changes: the offer taken, a sequence fetched or a
    /// stream taken back.
    changed: tokio::sync::Notify,
}

/// What a drain still waits for ([`Handoffs::pending`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Pending {
    /// Nothing: every kept stream was fetched, and the offer was fetched or idles.
    Nothing,
    /// A kept stream's fetch.
    Fetches,
    /// An offered sequence's fetch, until the offer idles at `idle_at`.
    Offer { idle_at: Instant },
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
            changed: tokio::sync::Notify::new(),
        }
    }
}

impl Handoffs {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Single inserts and removes: a poisoned state is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A running stream's KV was kept for the peer that continues it.
    pub fn kept(&self, last_block: u64) {
        self.lock().streams.insert(last_block);
    }

    pub(super) fn offer(&self, sessions: Vec<Session>) {
        {
            let mut s = self.lock();
            s.sessions = sessions.iter().map(|x| x.last).collect();
            s.offer = sessions;
            s.active = Instant::now();
        }
        self.offered.send_replace(true);
        self.changed.notify_waiters();
    }

    /// Resolves when what the drain waits for may have changed; enable it before reading
    /// [`Handoffs::pending`], so that no change between the two is missed.
    pub(super) fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    /// The offer, to the first caller only, once the drain has made it (waiting at most
    /// `wait` for that); empty when there is none.
    pub(super) async fn take_offer(&self, wait: Duration) -> Vec<Session> {
        let mut made = self.offered.subscribe();
        if tokio::time::timeout(wait, made.wait_for(|made| *made))
            .await
            .is_err()
        {
            return Vec::new();
        }
        let offer = {
            let mut s = self.lock();
            s.active = Instant::now();
            std::mem::take(&mut s.offer)
        };
        self.changed.notify_waiters();
        offer
    }

    /// A peer fetched the prefix whose last block is `last_block`.
    pub(super) fn fetched(&self, last_block: u64) {
        let mut s = self.lock();
        if s.sessions.remove(&last_block) {
            s.active = Instant::now();
        }
        s.streams.remove(&last_block);
        drop(s);
        self.changed.notify_waiters();
    }

    /// A stream kept for a peer came back to this node: its blocks, by hash, are in use here.
    pub(super) fn taken_back(&self, hashes: &[u64]) {
        let mut s = self.lock();
        for h in hashes {
            s.streams.remove(h);
        }
        drop(s);
        self.changed.notify_waiters();
    }

    /// Kept streams and offered sequences not fetched yet.
    pub(super) fn unfetched(&self) -> (usize, usize) {
        let s = self.lock();
        (s.streams.len(), s.sessions.len())
    }

    /// What the drain should wait on: a kept stream not fetched, or an offered sequence not
    /// fetched while the offer saw activity within `idle`.
    pub(super) fn pending(&self, idle: Duration) -> Pending {
        let s = self.lock();
        let idle_at = s.active + idle;
        if !s.streams.is_empty() {
            Pending::Fetches
        } else if !s.sessions.is_empty() && Instant::now() < idle_at {
            Pending::Offer { idle_at }
        } else {
            Pending::Nothing
        }
    }
}
