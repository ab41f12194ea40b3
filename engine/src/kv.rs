//! Paged KV cache: fixed 16-token blocks drawn from one preallocated pool with a byte budget.
//!
//! Each block holds every layer's keys and values for its 16 positions, in the layout
//! `[layer][k|v][kv_head][token][head_dim]`, as f16 (what llama.cpp keeps too). A sequence owns
//! a block table; appending a token never copies earlier KV. The pool is allocated zeroed, so
//! the operating system commits its pages only as blocks are first written.
//!
//! Blocks are reference-counted: a full block may be shared by several sequences and the prefix
//! cache (it is never written again once full), and returns to the free list when its last
//! holder releases it.

use std::ops::Range;

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::error::{Error, Result};

/// Tokens per KV block.
pub const BLOCK_TOKENS: usize = 16;

/// Keys or values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvKind {
    Key = 0,
    Value = 1,
}

/// The shape of a model's KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    /// f16 values in one block.
    pub fn block_elems(&self) -> usize {
        self.n_layers * 2 * self.n_kv_heads * BLOCK_TOKENS * self.head_dim
    }

    pub fn block_bytes(&self) -> usize {
        self.block_elems() * std::mem::size_of::<f16>()
    }

    /// Bytes of KV per token, all layers, keys and values.
    pub fn token_bytes(&self) -> usize {
        self.block_bytes() / BLOCK_TOKENS
    }

    /// Offset of `(layer, kind, head)`'s 16×head_dim slab within a block.
    fn slab(&self, layer: usize, kind: KvKind, head: usize) -> usize {
        ((layer * 2 + kind as usize) * self.n_kv_heads + head) * BLOCK_TOKENS * self.head_dim
    }
}

/// The block pool.
#[derive(Debug)]
pub struct KvPool {
    layout: KvLayout,
    /// f16 bit patterns, in a zeroed allocation (pages committed on first write).
    data: Vec<u16>,
    free: Vec<u32>,
    /// Holders of each block; 0 for a free block.
    refs: Vec<u32>,
    total: usize,
}

impl KvPool {
    /// A pool of as many blocks as fit in `budget_bytes` (at least one).
    pub fn new(layout: KvLayout, budget_bytes: usize) -> Self {
        let total = (budget_bytes / layout.block_bytes()).max(1);
        // Each layer's slab of each block is read every step, blocks hundreds of KB apart.
        let data = crate::memory::zeroed_vec(total * layout.block_elems());
        Self {
            layout,
            data,
            free: (0..total as u32).rev().collect(),
            refs: vec![0; total],
            total,
        }
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    pub fn total_blocks(&self) -> usize {
        self.total
    }

    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Takes `n` blocks, each with one holder, or none if fewer than `n` are free.
    pub fn alloc(&mut self, n: usize) -> Result<Vec<u32>> {
        if n > self.free.len() {
            return Err(Error::KvExhausted {
                needed_blocks: n,
                free_blocks: self.free.len(),
            });
        }
        let blocks = self.free.split_off(self.free.len() - n);
        for &b in &blocks {
            self.refs[b as usize] = 1;
        }
        Ok(blocks)
    }

    /// Adds a holder to an allocated block.
    pub fn retain(&mut self, block: u32) {
        debug_assert!(self.refs[block as usize] > 0, "retain of a free block");
        self.refs[block as usize] += 1;
    }

    /// How many hold `block` (0 when it is free).
    pub fn holders(&self, block: u32) -> u32 {
        self.refs[block as usize]
    }

    /// Drops one holder of each block; a block without holders is free again.
    pub fn release(&mut self, blocks: impl IntoIterator<Item = u32>) {
        for b in blocks {
            let refs = &mut self.refs[b as usize];
            debug_assert!(*refs > 0, "release of a free block");
            *refs = refs.saturating_sub(1);
            if *refs == 0 {
                self.free.push(b);
            }
        }
    }

    /// The `16 × head_dim` slabs of one block for `(layer, kind)` and the KV heads `heads`,
    /// which lie back to back: `[head][token][head_dim]`.
    pub fn slabs(&self, block: u32, layer: usize, kind: KvKind, heads: Range<usize>) -> &[f16] {
        let start =
            block as usize * self.layout.block_elems() + self.layout.slab(layer, kind, heads.start);
        let len = heads.len() * BLOCK_TOKENS * self.layout.head_dim;
        bytemuck::cast_slice(&self.data[start..start + len])
    }

    /// Where position `pos`'s `head_dim` values for `(layer, kind, head)` start in `data`.
    fn offset(&self, blocks: &[u32], pos: usize, layer: usize, kind: KvKind, head: usize) -> usize {
        blocks[pos / BLOCK_TOKENS] as usize * self.layout.block_elems()
            + self.layout.slab(layer, kind, head)
            + (pos % BLOCK_TOKENS) * self.layout.head_dim
    }

    /// Stores one position's vector for `(layer, kind, head)`, rounding to f16.
    pub fn write(
        &mut self,
        blocks: &[u32],
        pos: usize,
        layer: usize,
        kind: KvKind,
        head: usize,
        values: &[f32],
    ) {
        let start = self.offset(blocks, pos, layer, kind, head);
        bytemuck::cast_slice_mut::<u16, f16>(&mut self.data[start..start + values.len()])
            .convert_from_f32_slice(values);
    }

    /// Copies positions `range` of `(layer, kind)` out as `[kv_head][token][head_dim]` f16
    /// little-endian bytes.
    pub fn export(
        &self,
        blocks: &[u32],
        range: std::ops::Range<usize>,
        layer: usize,
        kind: KvKind,
    ) -> Vec<u8> {
        let hd = self.layout.head_dim;
        let mut out = Vec::with_capacity(range.len() * self.layout.n_kv_heads * hd * 2);
        for head in 0..self.layout.n_kv_heads {
            for pos in range.clone() {
                let start = self.offset(blocks, pos, layer, kind, head);
                for bits in &self.data[start..start + hd] {
                    out.extend_from_slice(&bits.to_le_bytes());
                }
            }
        }
        out
    }

    /// The inverse of [`KvPool::export`]: writes `bytes` into positions `range`.
    pub fn import(
        &mut self,
        blocks: &[u32],
        range: std::ops::Range<usize>,
        layer: usize,
        kind: KvKind,
        bytes: &[u8],
    ) -> Result<()> {
        let hd = self.layout.head_dim;
        let want = range.len() * self.layout.n_kv_heads * hd * 2;
        if bytes.len() != want {
            return Err(Error::KvImport {
                reason: format!(
                    "layer {layer} {kind:?}: {} bytes, expected {want}",
                    bytes.len()
                ),
            });
        }
        let mut bits = bytes
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]));
        for head in 0..self.layout.n_kv_heads {
            for pos in range.clone() {
                let start = self.offset(blocks, pos, layer, kind, head);
                for (dst, src) in self.data[start..start + hd].iter_mut().zip(&mut bits) {
                    *dst = src;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_release_and_exhaustion() {
        let layout = KvLayout {
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 4,
        };
        let mut pool = KvPool::new(layout, layout.block_bytes() * 3);
        assert_eq!(pool.total_blocks(), 3);
        let a = pool.alloc(2).expect("two blocks");
        assert!(matches!(
            pool.alloc(2),
            Err(Error::KvExhausted {
                needed_blocks: 2,
                free_blocks: 1
            })
        ));
        pool.release(a);
        assert_eq!(pool.free_blocks(), 3);
    }

    #[test]
    fn a_shared_block_is_free_only_after_its_last_holder() {
        let layout = KvLayout {
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 4,
        };
        let mut pool = KvPool::new(layout, layout.block_bytes() * 2);
        let b = pool.alloc(1).expect("a block")[0];
        pool.retain(b);
        assert_eq!(pool.holders(b), 2);
        pool.release([b]);
        assert_eq!(pool.free_blocks(), 1);
        pool.release([b]);
        assert_eq!((pool.free_blocks(), pool.holders(b)), (2, 0));
    }

    #[test]
    fn export_import_round_trip() {
        let layout = KvLayout {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 4,
        };
        let mut pool = KvPool::new(layout, layout.block_bytes() * 4);
        let blocks = pool.alloc(2).expect("blocks");
        for pos in 0..20 {
            for head in 0..2 {
                let v: Vec<f32> = (0..4).map(|d| (pos * 8 + head * 4 + d) as f32).collect();
                pool.write(&blocks, pos, 1, KvKind::Value, head, &v);
            }
        }
        let bytes = pool.export(&blocks, 3..19, 1, KvKind::Value);
        let other = pool.alloc(2).expect("blocks");
        pool.import(&other, 3..19, 1, KvKind::Value, &bytes)
            .expect("import");
        assert_eq!(pool.export(&other, 3..19, 1, KvKind::Value), bytes);
        assert!(pool.import(&other, 0..2, 0, KvKind::Key, &bytes).is_err());
    }
}
