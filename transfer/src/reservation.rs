//! Transfer ids bound to reservations. A decode node reserves a transfer id for one request and
//! waits on the returned receiver; the push that claims the id delivers the verified KV (or the
//! reason it was rejected) through it.
//!
//! Invariants:
//! - a transfer id is single-use: a second reservation or a second push with it is rejected,
//!   and the last [`USED_IDS_REMEMBERED`] used ids are remembered to say so precisely;
//! - the lease is the [`ReservationGuard`]'s lifetime: the waiter holds it for its bounded wait,
//!   and dropping it (timeout, cancelled request) removes the reservation, so a late push finds
//!   nothing and a push in progress stops at its next frame;
//! - the guard also sees the push's progress (bytes accepted so far), so a waiter can bound the
//!   silence between chunks rather than the whole transfer, which a long prompt's prefill makes
//!   arbitrarily long.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{oneshot, watch};

use crate::error::{Error, Result};
use crate::format::{Expectation, ReceivedKv};

/// How many used transfer ids are remembered to reject reuse precisely.
pub const USED_IDS_REMEMBERED: usize = 4096;

pub(crate) struct Pending {
    pub(crate) want: Expectation,
    pub(crate) deliver: oneshot::Sender<Result<ReceivedKv>>,
    pub(crate) progress: watch::Sender<u64>,
}

#[derive(Default)]
struct Inner {
    pending: HashMap<String, Pending>,
    used: HashSet<String>,
    used_order: VecDeque<String>,
}

impl Inner {
    fn mark_used(&mut self, id: &str) {
        if self.used.insert(id.to_string()) {
            self.used_order.push_back(id.to_string());
            if self.used_order.len() > USED_IDS_REMEMBERED
                && let Some(old) = self.used_order.pop_front()
            {
                self.used.remove(&old);
            }
        }
    }
}

/// The table of open reservations; cheap to clone.
#[derive(Clone, Default)]
pub struct Reservations {
    inner: Arc<Mutex<Inner>>,
}

impl std::fmt::Debug for Reservations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reservations")
            .field("pending", &self.pending())
            .finish()
    }
}

/// Receives the outcome of the push bound to a reservation.
pub type Delivery = oneshot::Receiver<Result<ReceivedKv>>;

impl Reservations {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding this lock cannot leave the maps inconsistent (every update is
        // a single insert or remove), so a poisoned lock is still usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Binds `transfer_id` to `want`. The reservation lives as long as the guard.
    pub fn reserve(
        &self,
        transfer_id: &str,
        want: Expectation,
    ) -> Result<(ReservationGuard, Delivery)> {
        let mut inner = self.lock();
        if inner.used.contains(transfer_id) || inner.pending.contains_key(transfer_id) {
            return Err(Error::Reused {
                transfer_id: transfer_id.to_string(),
            });
        }
        let (deliver, delivery) = oneshot::channel();
        let (progress, watched) = watch::channel(0);
        inner.pending.insert(
            transfer_id.to_string(),
            Pending {
                want,
                deliver,
                progress,
            },
        );
        Ok((
            ReservationGuard {
                transfer_id: transfer_id.to_string(),
                reservations: self.clone(),
                progress: watched,
            },
            delivery,
        ))
    }

    /// Takes the reservation for a push; the id can never be claimed again.
    pub(crate) fn claim(&self, transfer_id: &str) -> Result<Pending> {
        let mut inner = self.lock();
        match inner.pending.remove(transfer_id) {
            Some(p) => {
                inner.mark_used(transfer_id);
                Ok(p)
            }
            None if inner.used.contains(transfer_id) => Err(Error::Reused {
                transfer_id: transfer_id.to_string(),
            }),
            None => Err(Error::UnknownTransfer {
                transfer_id: transfer_id.to_string(),
            }),
        }
    }

    /// Reservations waiting for their push.
    pub fn pending(&self) -> usize {
        self.lock().pending.len()
    }
}

/// Holds a reservation open; dropping it ends the lease.
#[derive(Debug)]
pub struct ReservationGuard {
    transfer_id: String,
    reservations: Reservations,
    progress: watch::Receiver<u64>,
}

impl ReservationGuard {
    /// Bytes the push has delivered so far; changes with every accepted chunk, and reports a
    /// closed channel once the push has ended.
    pub fn progress(&self) -> watch::Receiver<u64> {
        self.progress.clone()
    }
}

impl Drop for ReservationGuard {
    fn drop(&mut self) {
        let mut inner = self.reservations.lock();
        if inner.pending.remove(&self.transfer_id).is_some() {
            inner.mark_used(&self.transfer_id);
        }
    }
}
