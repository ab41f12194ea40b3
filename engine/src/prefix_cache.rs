//! The prefix cache: full KV blocks kept after their sequence ends, named by chained block hashes
//! (the caller computes them; see `tandem_proto::block_hash`), so that a later sequence sharing
//! the prefix starts from them instead of computing it again.
//!
//! It is a radix tree over blocks: a chained hash names a block and its whole prefix, so each
//! node's key is its path and its parent is the hash before it. The cache holds one reference
//! to each block it keeps (see [`crate::kv::KvPool`]); sequences using a cached block hold
//! their own, which pins it.
//!
//! Invariants:
//! - a node's parent is in the cache (a prefix is matched from its first block, so a node
//!   without its parent could never be reached);
//! - eviction takes the least recently used leaf whose block nobody but the cache holds, so a
//!   pinned block, and with it every ancestor, is never evicted;
//! - every change is recorded as a [`CacheEvent`], in order, for the router's index.

use std::collections::{BTreeSet, HashMap};

/// A change to the set of cached block hashes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// Into the KV pool (computed, fetched, or read back from the disk tier).
    Stored(Vec<u64>),
    /// Out of the pool, onto the disk tier, from where a hit reads them back.
    Spilled(Vec<u64>),
    /// Gone from both.
    Evicted(Vec<u64>),
    Cleared,
}

#[derive(Debug)]
struct Node {
    block: u32,
    parent: Option<u64>,
    children: u32,
    last_used: u64,
}

#[derive(Debug)]
pub(crate) struct PrefixCache {
    nodes: HashMap<u64, Node>,
    /// `(last_used, hash)` of every node without children: the eviction candidates.
    leaves: BTreeSet<(u64, u64)>,
    clock: u64,
    /// Most blocks kept; 0 turns the cache off.
    max_blocks: usize,
    events: Vec<CacheEvent>,
}

impl PrefixCache {
    pub fn new(max_blocks: usize) -> Self {
        Self {
            nodes: HashMap::new(),
            leaves: BTreeSet::new(),
            clock: 0,
            max_blocks,
            events: Vec::new(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.max_blocks > 0
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    /// The blocks held for every cached block.
    pub fn blocks(&self) -> impl Iterator<Item = u32> + '_ {
        self.nodes.values().map(|n| n.block)
    }

    fn touch(&mut self, hash: u64) {
        self.clock += 1;
        let clock = self.clock;
        if let Some(n) = self.nodes.get_mut(&hash) {
            if n.children == 0 {
                self.leaves.remove(&(n.last_used, hash));
                self.leaves.insert((clock, hash));
            }
            n.last_used = clock;
        }
    }

    /// Whether the block `hash` names (and with it its whole prefix) is cached; its recency
    /// is left alone.
    pub fn contains(&self, hash: u64) -> bool {
        self.nodes.contains_key(&hash)
    }

    /// The blocks of the longest cached prefix of `hashes`, marked as just used.
    pub fn lookup(&mut self, hashes: &[u64]) -> Vec<u32> {
        let mut blocks = Vec::new();
        for &h in hashes {
            let Some(n) = self.nodes.get(&h) else { break };
            blocks.push(n.block);
            self.touch(h);
        }
        blocks
    }

    /// Caches `blocks[i]` under `hashes[i]`, in order. A hash already cached keeps its block.
    /// Returns the blocks the cache now holds in addition (the caller adds the cache's
    /// reference to each).
    pub fn insert(&mut self, hashes: &[u64], blocks: &[u32]) -> Vec<u32> {
        if !self.enabled() {
            return Vec::new();
        }
        let mut parent = None;
        let mut taken = Vec::new();
        let mut stored = Vec::new();
        for (&h, &block) in hashes.iter().zip(blocks) {
            if !self.nodes.contains_key(&h) {
                if let Some(p) = parent
                    && let Some(pn) = self.nodes.get_mut(&p)
                {
                    if pn.children == 0 {
                        self.leaves.remove(&(pn.last_used, p));
                    }
                    pn.children += 1;
                }
                self.nodes.insert(
                    h,
                    Node {
                        block,
                        parent,
                        children: 0,
                        last_used: 0,
                    },
                );
                self.leaves.insert((0, h));
                taken.push(block);
                stored.push(h);
            }
            self.touch(h);
            parent = Some(h);
        }
        if !stored.is_empty() {
            self.events.push(CacheEvent::Stored(stored));
        }
        taken
    }

    /// Removes the least recently used leaf for which `pinned` is false; returns its hash and
    /// block, whose cache reference the caller drops. `spill(hash, block)` says whether the
    /// block goes on to the disk tier (the event says `Spilled` then, else `Evicted`).
    pub fn evict_one(
        &mut self,
        pinned: impl Fn(u32) -> bool,
        spill: impl FnOnce(u64, u32) -> bool,
    ) -> Option<(u64, u32)> {
        let &(_, hash) = self
            .leaves
            .iter()
            .find(|(_, h)| self.nodes.get(h).is_some_and(|n| !pinned(n.block)))?;
        self.remove_leaf(hash, spill).map(|block| (hash, block))
    }

    /// Removes the cached tail of `chain` (a sequence's block hashes, from its first) that no
    /// other cached sequence shares: from its deepest cached block up, each block that is a
    /// leaf and not `pinned`, stopping at the first that another sequence extends or holds.
    /// `spill` is as in [`PrefixCache::evict_one`]. Returns the removed blocks, whose cache
    /// references the caller drops.
    pub fn release(
        &mut self,
        chain: &[u64],
        pinned: impl Fn(u32) -> bool,
        mut spill: impl FnMut(u64, u32) -> bool,
    ) -> Vec<u32> {
        let cached = chain.iter().take_while(|h| self.contains(**h)).count();
        let mut removed = Vec::new();
        for &hash in chain[..cached].iter().rev() {
            let Some(n) = self.nodes.get(&hash) else {
                break;
            };
            if n.children > 0 || pinned(n.block) {
                break;
            }
            let Some(block) = self.remove_leaf(hash, &mut spill) else {
                break;
            };
            removed.push(block);
        }
        removed
    }

    /// Takes the leaf `hash` out of the tree and records its event; returns its block.
    fn remove_leaf(&mut self, hash: u64, spill: impl FnOnce(u64, u32) -> bool) -> Option<u32> {
        let node = self.nodes.remove(&hash)?;
        self.leaves.remove(&(node.last_used, hash));
        if let Some(p) = node.parent
            && let Some(pn) = self.nodes.get_mut(&p)
        {
            pn.children -= 1;
            if pn.children == 0 {
                self.leaves.insert((pn.last_used, p));
            }
        }
        match (spill(hash, node.block), self.events.last_mut()) {
            (true, Some(CacheEvent::Spilled(hashes)))
            | (false, Some(CacheEvent::Evicted(hashes))) => hashes.push(hash),
            (true, _) => self.events.push(CacheEvent::Spilled(vec![hash])),
            (false, _) => self.events.push(CacheEvent::Evicted(vec![hash])),
        }
        Some(node.block)
    }

    /// Forgets every block; returns them so the caller drops the cache's references.
    pub fn clear(&mut self) -> Vec<u32> {
        self.leaves.clear();
        let blocks = self.nodes.drain().map(|(_, n)| n.block).collect();
        self.events.push(CacheEvent::Cleared);
        blocks
    }

    /// Every cached block with its hash, least recently used first.
    pub fn by_recency(&self) -> Vec<(u64, u32)> {
        let mut nodes: Vec<(u64, u64, u32)> = self
            .nodes
            .iter()
            .map(|(&h, n)| (n.last_used, h, n.block))
            .collect();
        nodes.sort_unstable();
        nodes.into_iter().map(|(_, h, b)| (h, b)).collect()
    }

    /// Records an event that happened beside the pool (the disk tier's).
    pub fn record(&mut self, event: CacheEvent) {
        self.events.push(event);
    }

    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_matches_the_longest_cached_prefix() {
        let mut c = PrefixCache::new(10);
        assert_eq!(c.insert(&[1, 2, 3], &[10, 20, 30]), vec![10, 20, 30]);
        assert_eq!(c.lookup(&[1, 2, 9]), vec![10, 20]);
        assert_eq!(
            c.lookup(&[5, 1]),
            Vec::<u32>::new(),
            "matching stops at the first miss"
        );
        // A hash already cached keeps its block; only the new one is taken.
        assert_eq!(c.insert(&[1, 2, 4], &[11, 21, 40]), vec![40]);
        assert_eq!(c.lookup(&[1, 2, 4]), vec![10, 20, 40]);
        assert_eq!(
            c.take_events(),
            vec![
                CacheEvent::Stored(vec![1, 2, 3]),
                CacheEvent::Stored(vec![4])
            ]
        );
    }

    #[test]
    fn eviction_takes_unpinned_leaves_least_recent_first() {
        let mut c = PrefixCache::new(10);
        c.insert(&[1, 2, 3], &[10, 20, 30]);
        c.insert(&[1, 2, 4], &[10, 20, 40]);
        c.lookup(&[1, 2, 3]); // 3 is now more recent than 4
        let gone = |_: u64, _: u32| false;
        assert_eq!(c.evict_one(|_| false, gone), Some((4, 40)));
        // 30 is pinned: the next candidates are its ancestors, which are not leaves.
        assert_eq!(c.evict_one(|b| b == 30, gone), None);
        assert_eq!(c.evict_one(|_| false, gone), Some((3, 30)));
        // 2 goes to the disk tier, 1 is gone.
        assert_eq!(c.evict_one(|_| false, |h, _| h == 2), Some((2, 20)));
        assert_eq!(c.evict_one(|_| false, gone), Some((1, 10)));
        assert_eq!(c.evict_one(|_| false, gone), None);
        assert_eq!(c.len(), 0);
        let events = c.take_events();
        assert_eq!(
            events[events.len() - 3..],
            [
                CacheEvent::Evicted(vec![4, 3]),
                CacheEvent::Spilled(vec![2]),
                CacheEvent::Evicted(vec![1])
            ]
        );
    }

    #[test]
    fn release_takes_only_what_no_other_sequence_shares() {
        let mut c = PrefixCache::new(10);
        // Two sessions share blocks 1 and 2; the first goes on with 3 and 4, the second with 5.
        c.insert(&[1, 2, 3, 4], &[10, 20, 30, 40]);
        c.insert(&[1, 2, 5], &[10, 20, 50]);
        c.take_events();
        let gone = |_: u64, _: u32| false;
        // A chain longer than what is cached is released from its deepest cached block.
        assert_eq!(c.release(&[1, 2, 3, 4, 9], |_| false, gone), vec![40, 30]);
        assert_eq!(
            c.lookup(&[1, 2, 5]),
            vec![10, 20, 50],
            "the shared prefix stays"
        );
        // A block a running sequence holds stops the release there.
        assert_eq!(c.release(&[1, 2, 5], |b| b == 50, gone), Vec::<u32>::new());
        // The last sequence goes whole; 2 stays on the disk tier.
        assert_eq!(
            c.release(&[1, 2, 5], |_| false, |h, _| h == 2),
            vec![50, 20, 10]
        );
        assert_eq!(c.len(), 0);
        assert_eq!(
            c.take_events(),
            [
                CacheEvent::Evicted(vec![4, 3, 5]),
                CacheEvent::Spilled(vec![2]),
                CacheEvent::Evicted(vec![1])
            ]
        );
        assert!(
            c.release(&[7], |_| false, gone).is_empty(),
            "nothing cached"
        );
    }

    #[test]
    fn off_keeps_nothing() {
        let mut c = PrefixCache::new(0);
        assert!(c.insert(&[1], &[10]).is_empty());
        assert!(c.lookup(&[1]).is_empty());
        assert!(c.take_events().is_empty());
    }
}
