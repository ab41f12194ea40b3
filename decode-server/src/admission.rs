//! Admission: a request gets a batch slot and its worst-case KV blocks (prompt + max_tokens)
//! up front, or RESOURCE_EXHAUSTED. Because every admitted sequence's blocks are reserved, the
//! scheduler's engine can never run out of KV mid-generation. [`Admitted`] returns both on drop.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Error, Result};

#[derive(Debug, Default)]
struct Used {
    slots: usize,
    blocks: usize,
}

#[derive(Clone, Debug)]
pub struct Admission {
    used: Arc<Mutex<Used>>,
    max_slots: usize,
    total_blocks: usize,
}

impl Admission {
    pub fn new(max_slots: usize, total_blocks: usize) -> Self {
        Self {
            used: Arc::default(),
            max_slots,
            total_blocks,
        }
    }

    fn lock(&self) -> MutexGuard<'_, Used> {
        // Updates are single additions or subtractions; a poisoned lock is still consistent.
        self.used.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn try_admit(&self, blocks: usize) -> Result<Admitted> {
        let mut used = self.lock();
        if used.slots >= self.max_slots {
            return Err(Error::Capacity {
                detail: format!("all {} batch slots are in use", self.max_slots),
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
        used.slots += 1;
        used.blocks += blocks;
        Ok(Admitted {
            blocks,
            admission: self.clone(),
        })
    }

    /// (slots, blocks) reserved now.
    pub fn in_use(&self) -> (usize, usize) {
        let used = self.lock();
        (used.slots, used.blocks)
    }

    pub fn max_slots(&self) -> usize {
        self.max_slots
    }
}

/// A slot and its KV blocks, held for one request's lifetime.
#[derive(Debug)]
pub struct Admitted {
    blocks: usize,
    admission: Admission,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut used = self.admission.lock();
        used.slots -= 1;
        used.blocks -= self.blocks;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_and_blocks_are_bounded_and_returned() {
        let a = Admission::new(2, 10);
        let first = a.try_admit(6).expect("fits");
        assert!(matches!(a.try_admit(5), Err(Error::Capacity { .. })));
        let second = a.try_admit(4).expect("fits");
        assert!(matches!(a.try_admit(0), Err(Error::Capacity { .. })));
        assert_eq!(a.in_use(), (2, 10));
        drop(first);
        drop(second);
        assert_eq!(a.in_use(), (0, 0));
    }
}
