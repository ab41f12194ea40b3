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
        let mut s = self.lock();
        s.active = Instant::now();
        std::mem::take(&mut s.offer)
    }

    /// A peer fetched the prefix whose last block is `last_block`.
    pub(super) fn fetched(&self, last_block: u64) {
        let mut s = self.lock();
        if s.sessions.remove(&last_block) {
            s.active = Instant::now();
        }
        s.streams.remove(&last_block);
    }

    /// A stream kept for a peer came back to this node: its blocks, by hash, are in use here.
    pub(super) fn taken_back(&self, hashes: &[u64]) {
        let mut s = self.lock();
        for h in hashes {
            s.streams.remove(h);
        }
    }

    /// Kept streams and offered sequences not fetched yet.
    pub(super) fn unfetched(&self) -> (usize, usize) {
        let s = self.lock();
        (s.streams.len(), s.sessions.len())
    }

    /// Whether the drain should wait on: a kept stream is not fetched, or an offered sequence
    /// is not and the offer saw activity within `idle`.
    pub(super) fn waiting(&self, idle: Duration) -> bool {
        let s = self.lock();
        !s.streams.is_empty() || (!s.sessions.is_empty() && s.active.elapsed() < idle)
    }
}
