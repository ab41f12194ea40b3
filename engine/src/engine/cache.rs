//! The prefix cache's side of the engine: sequences kept under their block hashes, started on
//! the longest cached prefix, released, evicted for room, and kept on the disk tier.

use std::sync::Arc;

use super::{Engine, Reused, SeqId, Sequence};
use crate::error::{Error, Result};
use crate::kv::BLOCK_TOKENS;
use crate::prefix_cache::CacheEvent;
use crate::spill::SpillStats;

impl Engine {
    /// Whether the pool's prefix cache holds the block `hash` names, and so its whole prefix
    /// (the disk tier is not asked, and nothing is marked used).
    pub fn caches(&self, hash: u64) -> bool {
        self.cache.contains(hash)
    }

    /// How many of `hashes`, from the first, the prefix cache holds in the pool or on the disk
    /// tier: what [`Engine::new_sequence_cached`] would find of them now (less, if the pool
    /// lacks room to read them back).
    pub fn cached_prefix(&self, hashes: &[u64]) -> usize {
        let on_disk = |h: u64| self.spill.as_ref().is_some_and(|s| s.contains(h));
        hashes
            .iter()
            .take_while(|&&h| self.cache.contains(h) || on_disk(h))
            .count()
    }

    /// Whether the prefix cache is on.
    pub fn prefix_cache_enabled(&self) -> bool {
        self.cache.enabled()
    }

    /// Starts a sequence holding the longest cached prefix of `hashes` (the block hashes of the
    /// tokens it will hold, at most the blocks it may reuse); returns it with the number of
    /// tokens it already holds. Extending it computes only what follows. Where the pool's
    /// prefix ends, the disk tier's may go on: those blocks are read back into the pool (and
    /// the cache) as far as they are whole and the pool has room.
    pub fn new_sequence_cached(&mut self, hashes: &[u64]) -> (SeqId, Reused) {
        let mut blocks = self.cache.lookup(hashes);
        for &b in &blocks {
            self.pool.retain(b);
        }
        let in_pool = blocks.len();
        if blocks.len() < hashes.len() {
            self.restore(hashes, &mut blocks);
        }
        let id = SeqId(self.next_id);
        self.next_id = self.next_id.wrapping_add(1);
        let reused = Reused {
            tokens: blocks.len() * BLOCK_TOKENS,
            restored: (blocks.len() - in_pool) * BLOCK_TOKENS,
        };
        self.seqs.insert(
            id,
            Sequence {
                blocks,
                len: reused.tokens,
            },
        );
        (id, reused)
    }

    /// Keeps the first `hashes.len()` blocks of `seq` in the prefix cache under `hashes` (the
    /// block hashes of its first tokens), evicting the least recently used blocks beyond the
    /// cache's size. The sequence itself is unchanged.
    pub fn cache_sequence(&mut self, seq: SeqId, hashes: &[u64]) -> Result<()> {
        let s = self.seq(seq)?;
        if hashes.len() > s.len / BLOCK_TOKENS {
            return Err(Error::InvalidArgument {
                field: "hashes",
                reason: format!(
                    "{} block hashes for a sequence of {} tokens",
                    hashes.len(),
                    s.len
                ),
            });
        }
        let blocks = s.blocks[..hashes.len()].to_vec();
        for b in self.cache.insert(hashes, &blocks) {
            self.pool.retain(b);
        }
        while self.cache.len() > self.cache.max_blocks() && self.evict_one() {}
        Ok(())
    }

    /// Ends what the cache keeps of a sequence (`hashes`: its block hashes from its first):
    /// the blocks that no other cached sequence shares and no running one holds leave the pool.
    /// With `to_disk` they are written to the disk tier first (where there is one), for a later
    /// turn to read back; without, they are dropped, and the sequence's blocks already on disk
    /// become the first the tier lets go. Without a disk tier, `to_disk` keeps them in the
    /// pool, where the LRU order decides. Returns how many blocks left the pool.
    pub fn release_cached(&mut self, hashes: &[u64], to_disk: bool) -> usize {
        if to_disk && self.spill.is_none() {
            return 0;
        }
        let (pool, spill) = (&self.pool, &self.spill);
        let keep = |hash: u64, b: u32| {
            spill.as_ref().is_some_and(|s| {
                if to_disk {
                    s.contains(hash) || s.store(hash, pool.block(b))
                } else {
                    s.demote(hash)
                }
            })
        };
        let removed = self.cache.release(hashes, |b| pool.holders(b) > 1, keep);
        if !to_disk && let Some(spill) = &self.spill {
            for &hash in hashes {
                spill.demote(hash);
            }
        }
        let n = removed.len();
        self.pool.release(removed);
        n
    }

    /// Drops every cached block (blocks in use stay with their sequences).
    pub fn clear_cache(&mut self) {
        let blocks = self.cache.clear();
        self.pool.release(blocks);
    }

    /// The cache's changes since the last call, in order: the pool's, then the blocks that
    /// left the disk tier (those the pool holds again stay announced as stored).
    pub fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        if let Some(spill) = &self.spill {
            let gone: Vec<u64> = spill
                .take_gone()
                .into_iter()
                .filter(|&h| !self.cache.contains(h))
                .collect();
            if !gone.is_empty() {
                self.cache.record(CacheEvent::Evicted(gone));
            }
        }
        self.cache.take_events()
    }

    pub(super) fn evict_one(&mut self) -> bool {
        let (pool, spill) = (&self.pool, &self.spill);
        // A block restored from disk is still there; another is queued to be written.
        let to_disk = |hash: u64, b: u32| {
            spill
                .as_ref()
                .is_some_and(|s| s.contains(hash) || s.store(hash, pool.block(b)))
        };
        match self.cache.evict_one(|b| pool.holders(b) > 1, to_disk) {
            Some((_, b)) => {
                self.pool.release([b]);
                true
            }
            None => false,
        }
    }

    /// Reads the blocks of `hashes` that follow `blocks` (held by the sequence being started)
    /// back from the disk tier, in order, until one is not there, is damaged, or finds no room;
    /// they join `blocks` and the prefix cache.
    pub(super) fn restore(&mut self, hashes: &[u64], blocks: &mut Vec<u32>) {
        let Some(spill) = &self.spill else { return };
        let start = blocks.len();
        let on_disk = hashes[start..]
            .iter()
            .take_while(|&&h| spill.contains(h))
            .count();
        for &hash in &hashes[start..start + on_disk] {
            let Ok(mut b) = self.alloc(1) else { break };
            let b = b.remove(0);
            if let Some(spill) = &self.spill
                && spill.load(hash, self.pool.block_mut(b))
            {
                blocks.push(b);
            } else {
                self.pool.release([b]);
                break;
            }
        }
        if blocks.len() > start {
            for b in self.cache.insert(&hashes[..blocks.len()], blocks) {
                self.pool.retain(b);
            }
            while self.cache.len() > self.cache.max_blocks() && self.evict_one() {}
        }
    }

    /// Writes every cached block the disk tier lacks to it, least recently used first (so that
    /// the most recent stay if the tier's bound is reached), and returns how many: what an
    /// engine does as it is dropped, so that a node's cache outlives a restart.
    pub(super) fn persist_cache(&mut self) -> usize {
        let Some(spill) = &self.spill else { return 0 };
        let mut written = 0;
        for (hash, b) in self.cache.by_recency() {
            if !spill.contains(hash) {
                spill.store_waiting(hash, self.pool.block(b));
                written += 1;
            }
        }
        written
    }

    /// What the disk tier has done; all zero without one.
    pub fn spill_stats(&self) -> Arc<SpillStats> {
        self.spill_stats.clone()
    }
}
