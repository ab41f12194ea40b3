//! Admission: a request gets a place and its worst-case KV blocks (prompt + max_tokens) up
//! front, or RESOURCE_EXHAUSTED. Because every admitted sequence's blocks are reserved, the
//! scheduler's engine can never run out of KV mid-generation. [`Admitted`] returns both on drop.
//! A request never asks for more than [`Admission::most_blocks`] of its class: the request
//! task cuts its max_tokens to that first, so RESOURCE_EXHAUSTED always means "not now" and
//! an empty node admits every request it was sent.
//!
//! Places are not batch slots: an admitted request may still be waiting for its KV (a prefill
//! node's queue) or for a slot (the scheduler's), so a node admits [`PLACES_PER_SLOT`] times
//! its batch slots. The KV blocks are the real bound.
//!
//! Requests of the batch class may hold at most a share of the places and of the KV blocks
//! (`--batch-share-percent`): the rest is kept for the standard and interactive classes, so a
//! flood of batch requests cannot fill the node and leave a higher class waiting for a batch
//! stream to end. (Batch slots need no such share: a higher class pauses a batch stream for
//! its slot, [`crate::classes`].)

use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Error, Result};
use tandem_proto::policy::Class;

/// Admitted requests per batch slot: the batch, and three more batches waiting for their KV or
/// for a slot.
pub const PLACES_PER_SLOT: usize = 4;

#[derive(Debug, Default)]
struct Used {
    places: usize,
    blocks: usize,
    /// Of those, held by batch requests.
    batch_places: usize,
    batch_blocks: usize,
}

#[derive(Clone, Debug)]
pub struct Admission {
    used: Arc<Mutex<Used>>,
    max_places: usize,
    total_blocks: usize,
    /// What batch requests may hold at most.
    batch_places: usize,
    batch_blocks: usize,
}

impl Admission {
    /// Admits up to [`PLACES_PER_SLOT`] requests per batch slot, within `total_blocks`; batch
    /// requests within `batch_percent` of both.
    pub fn new(max_slots: usize, total_blocks: usize, batch_percent: u8) -> Self {
        let max_places = max_slots * PLACES_PER_SLOT;
        let share = |n: usize| (n * usize::from(batch_percent.min(100)) / 100).max(1);
        Self {
            used: Arc::default(),
            max_places,
            total_blocks,
            batch_places: share(max_places),
            batch_blocks: share(total_blocks),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Used> {
        // Updates are single additions or subtractions; a poisoned lock is still consistent.
        self.used.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A place and `blocks` KV blocks for a request of `class`.
    pub fn try_admit(&self, blocks: usize, class: Class) -> Result<Admitted> {
        let mut used = self.lock();
        if used.places >= self.max_places {
            return Err(Error::Capacity {
                detail: format!(
                    "all {} places are taken (decoding, or waiting for KV or a batch slot)",
                    self.max_places
                ),
            });
        }
        if used.blocks + blocks > self.total_blocks {
            return Err(Error::Capacity {
                detail: format!(
                    "{blocks} KV blocks needed, {} of {} free",
                    self.total_blocks - used.blocks,
                    self.total_blocks
                ),
            });
        }
        let batch = class == Class::Batch;
        if batch && used.batch_places >= self.batch_places {
            return Err(Error::Capacity {
                detail: format!(
                    "the batch class's {} places are taken; the rest are kept for higher classes",
                    self.batch_places
                ),
            });
        }
        if batch && used.batch_blocks + blocks > self.batch_blocks {
            return Err(Error::Capacity {
                detail: format!(
                    "{blocks} KV blocks needed, {} of the batch class's {} free",
                    self.batch_blocks.saturating_sub(used.batch_blocks),
                    self.batch_blocks
                ),
            });
        }
        used.places += 1;
        used.blocks += blocks;
        if batch {
            used.batch_places += 1;
            used.batch_blocks += blocks;
        }
        Ok(Admitted {
            blocks,
            batch,
            admission: self.clone(),
        })
    }

    /// The most KV blocks one request of `class` may ever hold here: the whole pool, or the
    /// batch class's share of it.
    pub fn most_blocks(&self, class: Class) -> usize {
        if class == Class::Batch {
            self.batch_blocks
        } else {
            self.total_blocks
        }
    }

    /// (places, blocks) taken now.
    pub fn in_use(&self) -> (usize, usize) {
        let used = self.lock();
        (used.places, used.blocks)
    }

    pub fn max_places(&self) -> usize {
        self.max_places
    }
}

/// A place and its KV blocks, held for one request's lifetime.
#[derive(Debug)]
pub struct Admitted {
    blocks: usize,
    batch: bool,
    admission: Admission,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut used = self.admission.lock();
        used.places -= 1;
        used.blocks -= self.blocks;
        if self.batch {
            used.batch_places -= 1;
            used.batch_blocks -= self.blocks;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STANDARD: Class = Class::Standard;
    const BATCH: Class = Class::Batch;

    #[test]
    fn places_and_blocks_are_bounded_and_returned() {
        let a = Admission::new(1, 10, 100);
        let first = a.try_admit(6, STANDARD).expect("fits");
        assert!(matches!(
            a.try_admit(5, STANDARD),
            Err(Error::Capacity { .. })
        ));
        let second = a.try_admit(4, STANDARD).expect("fits");
        assert!(matches!(
            a.try_admit(1, STANDARD),
            Err(Error::Capacity { .. })
        ));
        let more: Vec<Admitted> = (2..PLACES_PER_SLOT)
            .map(|_| a.try_admit(0, STANDARD).expect("a place"))
            .collect();
        assert!(matches!(
            a.try_admit(0, STANDARD),
            Err(Error::Capacity { .. })
        ));
        assert_eq!(a.in_use(), (PLACES_PER_SLOT, 10));
        drop((first, second, more));
        assert_eq!(a.in_use(), (0, 0));
    }

    /// Batch requests hold at most their share of the places and of the blocks; the rest stays
    /// for the higher classes, and a batch request's share comes back when it ends.
    #[test]
    fn batch_requests_hold_at_most_their_share() {
        // Two slots: eight places, six of them (75%) for batch; 100 blocks, 75 for batch.
        let a = Admission::new(2, 100, 75);
        let batch: Vec<Admitted> = (0..6)
            .map(|_| a.try_admit(10, BATCH).expect("within the share"))
            .collect();
        let refused = a.try_admit(1, BATCH).expect_err("past the places' share");
        assert!(refused.to_string().contains("batch class"), "{refused}");
        let standard = a.try_admit(10, STANDARD).expect("kept for higher classes");
        let interactive = a
            .try_admit(10, Class::Interactive)
            .expect("kept for higher classes");
        drop(batch);
        let big = a.try_admit(70, BATCH).expect("70 of 75 blocks");
        let refused = a.try_admit(6, BATCH).expect_err("past the blocks' share");
        assert!(refused.to_string().contains("batch class"), "{refused}");
        drop((big, standard, interactive));
        assert_eq!(a.in_use(), (0, 0));
    }
}
