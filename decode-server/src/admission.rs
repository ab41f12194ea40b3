//! Admission: a request gets a place and its worst-case KV blocks (prompt + max_tokens) up
//! front, or RESOURCE_EXHAUSTED. Because every admitted sequence's blocks are reserved, the
//! scheduler's engine can never run out of KV mid-generation. [`Admitted`] returns both on drop.
//!
//! Places are not batch slots: an admitted request may still be waiting for its KV (a prefill
//! node's queue) or for a slot (the scheduler's), so a node admits [`PLACES_PER_SLOT`] times
//! its batch slots. The KV blocks are the real bound.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Error, Result};

/// Admitted requests per batch slot: the batch, and three more batches waiting for their KV or
/// for a slot.
pub const PLACES_PER_SLOT: usize = 4;

#[derive(Debug, Default)]
struct Used {
    places: usize,
    blocks: usize,
}

#[derive(Clone, Debug)]
pub struct Admission {
    used: Arc<Mutex<Used>>,
    max_places: usize,
    total_blocks: usize,
}

impl Admission {
    /// Admits up to [`PLACES_PER_SLOT`] requests per batch slot, within `total_blocks`.
    pub fn new(max_slots: usize, total_blocks: usize) -> Self {
        Self {
            used: Arc::default(),
            max_places: max_slots * PLACES_PER_SLOT,
            total_blocks,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Used> {
        // Updates are single additions or subtractions; a poisoned lock is still consistent.
        self.used.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn try_admit(&self, blocks: usize) -> Result<Admitted> {
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
        used.places += 1;
        used.blocks += blocks;
        Ok(Admitted {
            blocks,
            admission: self.clone(),
        })
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
    admission: Admission,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut used = self.admission.lock();
        used.places -= 1;
        used.blocks -= self.blocks;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_and_blocks_are_bounded_and_returned() {
        let a = Admission::new(1, 10);
        let first = a.try_admit(6).expect("fits");
        assert!(matches!(a.try_admit(5), Err(Error::Capacity { .. })));
        let second = a.try_admit(4).expect("fits");
        assert!(matches!(a.try_admit(1), Err(Error::Capacity { .. })));
        let more: Vec<Admitted> = (2..PLACES_PER_SLOT)
            .map(|_| a.try_admit(0).expect("a place"))
            .collect();
        assert!(matches!(a.try_admit(0), Err(Error::Capacity { .. })));
        assert_eq!(a.in_use(), (PLACES_PER_SLOT, 10));
        drop((first, second, more));
        assert_eq!(a.in_use(), (0, 0));
    }
}
