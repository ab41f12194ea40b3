//! Paged KV cache: fixed 16-token blocks drawn from one preallocated pool with a byte budget.
//!
//! Each block holds every layer's keys and values for its 16 positions, in the layout
//! `[layer][k|v][kv_head][token][row]`, where a row is one position's `head_dim` values in the
//! pool's [`KvDtype`]: f16 (what llama.cpp keeps too), or int8 with one f16 scale per row. A
//! sequence owns a block table; appending a token never copies earlier KV. The pool is allocated
//! zeroed, so the operating system commits its pages only as blocks are first written.
//!
//! Rows leave and enter the pool ([`KvPool::export`], [`KvPool::import`]) byte for byte: the KV
//! wire format sends the same rows.
//!
//! Blocks are reference-counted: a full block may be shared by several sequences and the prefix
//! cache (it is never written again once full), and returns to the free list when its last
//! holder releases it.

use std::ops::Range;

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::error::{Error, Result};
use crate::memory::HugeBuf;

// Rows are kept in the machine's byte order and leave the pool as they are; the wire format's
// rows are little-endian.
const _: () = assert!(
    cfg!(target_endian = "little"),
    "the KV rows assume a little-endian CPU"
);

/// Tokens per KV block.
pub const BLOCK_TOKENS: usize = 16;

/// Keys or values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvKind {
    Key = 0,
    Value = 1,
}

/// How one row (one position's `head_dim` values of one layer, kind and KV head) is stored.
///
/// Q8 gives each row its own scale. A row is what a forward pass writes (one token's key or
/// value for one head) and it never changes afterwards, so its scale is final when it is
/// written; a scale shared by a block's 16 positions would have to be chosen before the later
/// positions exist, or the block requantized as they arrive. A row is also what attention
/// consumes: one key's dot product, or one value weighted by its probability. Finer groups
/// (llama.cpp's q8_0 scales every 32 values) cost 3% more bytes at head_dim 64 and, on the
/// fidelity fixtures, did not move the logits less (docs/kv-cache.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// `head_dim` f16 values, little-endian.
    #[default]
    F16,
    /// `head_dim` int8 values `q`, then their f16 scale `d`, little-endian; each value is
    /// `q · d`, with `d = max |x| / 127` rounded to f16 and `q = round(x / d)`.
    Q8,
}

impl KvDtype {
    /// Bytes of one row of `head_dim` values.
    pub fn row_bytes(self, head_dim: usize) -> usize {
        match self {
            KvDtype::F16 => head_dim * 2,
            KvDtype::Q8 => head_dim + 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::Q8 => "q8",
        }
    }

    /// Stores `values` as one row (`row_bytes(values.len())` bytes, 2-byte aligned).
    pub(crate) fn encode_row(self, values: &[f32], row: &mut [u8]) {
        match self {
            KvDtype::F16 => {
                bytemuck::cast_slice_mut::<u8, f16>(row).convert_from_f32_slice(values);
            }
            KvDtype::Q8 => {
                let max = values.iter().fold(0f32, |m, x| m.max(x.abs()));
                // Clamped, so a row beyond f16's range saturates rather than storing infinity.
                let d = f16::from_f32((max / 127.0).min(f16::MAX.to_f32()));
                let inv = if d.to_f32() > 0.0 {
                    1.0 / d.to_f32()
                } else {
                    0.0
                };
                let (q, scale) = row.split_at_mut(values.len());
                for (q, &x) in q.iter_mut().zip(values) {
                    // The cast saturates and sends NaN to 0.
                    *q = (x * inv).round().clamp(-127.0, 127.0) as i8 as u8;
                }
                scale.copy_from_slice(&d.to_bits().to_le_bytes());
            }
        }
    }

    /// Converts whole rows (2-byte aligned) of `head_dim` values to f32 in `out`, which holds
    /// `head_dim` values per row.
    pub(crate) fn decode_rows(self, head_dim: usize, rows: &[u8], out: &mut [f32]) {
        match self {
            KvDtype::F16 => {
                bytemuck::cast_slice::<u8, f16>(rows).convert_to_f32_slice(out);
            }
            KvDtype::Q8 => {
                let rows = rows.chunks_exact(head_dim + 2);
                for (row, out) in rows.zip(out.chunks_exact_mut(head_dim)) {
                    let (q, scale) = row.split_at(head_dim);
                    let d = f16::from_bits(u16::from_le_bytes([scale[0], scale[1]])).to_f32();
                    for (o, &q) in out.iter_mut().zip(q) {
                        *o = f32::from(q as i8) * d;
                    }
                }
            }
        }
    }
}

/// The shape of a model's KV cache, and how its rows are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub dtype: KvDtype,
    /// The KV moves between engines as its shape alone: an export carries no bytes and an
    /// import takes none. Only a simulated model's, whose rows nothing reads, so that a fleet
    /// of simulated nodes can leave the network unloaded (`--kv-header-only`).
    pub header_only: bool,
}

impl KvLayout {
    /// Bytes of one row: one position's values for one layer, kind and KV head.
    pub fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.head_dim)
    }

    /// Bytes of one block's `16 × head_dim` values for one layer, kind and KV head.
    fn slab_bytes(&self) -> usize {
        BLOCK_TOKENS * self.row_bytes()
    }

    pub fn block_bytes(&self) -> usize {
        self.n_layers * 2 * self.n_kv_heads * self.slab_bytes()
    }

    /// Bytes of KV per token, all layers, keys and values.
    pub fn token_bytes(&self) -> usize {
        self.block_bytes() / BLOCK_TOKENS
    }

    /// Byte offset of `(layer, kind, head)`'s slab within a block.
    fn slab(&self, layer: usize, kind: KvKind, head: usize) -> usize {
        ((layer * 2 + kind as usize) * self.n_kv_heads + head) * self.slab_bytes()
    }
}

/// The block pool.
#[derive(Debug)]
pub struct KvPool {
    layout: KvLayout,
    /// The blocks' bytes, zeroed in a page-aligned mapping of their own (pages committed on
    /// first write, or ahead of it): every row, whose size is even, starts 2-byte aligned for
    /// f16 access.
    data: HugeBuf<u8>,
    free: Vec<u32>,
    /// Holders of each block; 0 for a free block.
    refs: Vec<u32>,
    total: usize,
    /// Blocks `0..fresh` have been taken at least once: the free list hands out blocks never
    /// taken in order, after those given back.
    fresh: usize,
    /// Bytes of pages kept committed past the blocks taken so far ([`KvPool::commit_ahead`]).
    commit_ahead: usize,
}

impl KvPool {
    /// A pool of as many blocks as fit in `budget_bytes` (at least one).
    pub fn new(layout: KvLayout, budget_bytes: usize) -> Self {
        debug_assert!(layout.row_bytes().is_multiple_of(2), "rows of even size");
        let total = (budget_bytes / layout.block_bytes()).max(1);
        // Each layer's slab of each block is read every step, blocks hundreds of KB apart.
        let data = HugeBuf::zeroed(total * layout.block_bytes());
        Self {
            layout,
            data,
            free: (0..total as u32).rev().collect(),
            refs: vec![0; total],
            total,
            fresh: 0,
            commit_ahead: 0,
        }
    }

    /// Keeps the pages of `bytes` past the blocks taken so far committed, on a thread of the
    /// pool's own, so that a sequence given blocks never used before (a pushed KV of tens of
    /// MB imported between two steps) writes to pages already there ([`HugeBuf::commit_to`]).
    /// 0 (the default) leaves pages to be committed by their first write, as does a
    /// header-only layout, whose rows nothing writes.
    pub fn commit_ahead(&mut self, bytes: usize) {
        self.commit_ahead = if self.layout.header_only { 0 } else { bytes };
        self.commit_fresh();
    }

    fn commit_fresh(&mut self) {
        if self.commit_ahead > 0 {
            let taken = self.fresh * self.layout.block_bytes();
            self.data.commit_to(taken.saturating_add(self.commit_ahead));
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
            self.fresh = self.fresh.max(b as usize + 1);
        }
        self.commit_fresh();
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

    /// A whole block's bytes, as the pool stores them.
    pub fn block(&self, block: u32) -> &[u8] {
        let bytes = self.layout.block_bytes();
        &self.data[block as usize * bytes..][..bytes]
    }

    /// A whole block's bytes, to be written.
    pub fn block_mut(&mut self, block: u32) -> &mut [u8] {
        let bytes = self.layout.block_bytes();
        &mut self.data[block as usize * bytes..][..bytes]
    }

    /// The 16-row slabs of one block for `(layer, kind)` and the KV heads `heads`, which lie
    /// back to back: `[head][token][row]`, to be read with [`KvDtype::decode_rows`].
    pub fn slabs(&self, block: u32, layer: usize, kind: KvKind, heads: Range<usize>) -> &[u8] {
        let start =
            block as usize * self.layout.block_bytes() + self.layout.slab(layer, kind, heads.start);
        &self.data[start..start + heads.len() * self.layout.slab_bytes()]
    }

    /// Where position `pos`'s row for `(layer, kind, head)` starts, in bytes.
    fn offset(&self, blocks: &[u32], pos: usize, layer: usize, kind: KvKind, head: usize) -> usize {
        blocks[pos / BLOCK_TOKENS] as usize * self.layout.block_bytes()
            + self.layout.slab(layer, kind, head)
            + (pos % BLOCK_TOKENS) * self.layout.row_bytes()
    }

    /// Stores one position's `head_dim` values for `(layer, kind, head)` in the pool's dtype.
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
        let (dtype, len) = (self.layout.dtype, self.layout.row_bytes());
        dtype.encode_row(values, &mut self.data[start..start + len]);
    }

    /// Copies the rows of positions `range` of `(layer, kind)` out, laid out `[kv_head][token]`.
    pub fn export(
        &self,
        blocks: &[u32],
        range: std::ops::Range<usize>,
        layer: usize,
        kind: KvKind,
    ) -> Vec<u8> {
        let row = self.layout.row_bytes();
        let mut out = Vec::with_capacity(range.len() * self.layout.n_kv_heads * row);
        for head in 0..self.layout.n_kv_heads {
            for run in grid_cells(range.clone(), BLOCK_TOKENS) {
                let start = self.offset(blocks, run.start, layer, kind, head);
                out.extend_from_slice(&self.data[start..start + run.len() * row]);
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
        let row = self.layout.row_bytes();
        let want = range.len() * self.layout.n_kv_heads * row;
        if bytes.len() != want {
            return Err(Error::KvImport {
                reason: format!(
                    "layer {layer} {kind:?}: {} bytes, expected {want}",
                    bytes.len()
                ),
            });
        }
        let mut src = bytes;
        for head in 0..self.layout.n_kv_heads {
            for run in grid_cells(range.clone(), BLOCK_TOKENS) {
                let (from, rest) = src.split_at(run.len() * row);
                let start = self.offset(blocks, run.start, layer, kind, head);
                self.data[start..start + from.len()].copy_from_slice(from);
                src = rest;
            }
        }
        Ok(())
    }

    /// Both kinds' rows of `layer` for positions `range` ([`KvPool::export`]: keys, then
    /// values); none from a header-only pool, whose rows nothing reads.
    pub fn export_layer(&self, blocks: &[u32], range: Range<usize>, layer: usize) -> [Vec<u8>; 2] {
        [KvKind::Key, KvKind::Value].map(|kind| {
            if self.layout.header_only {
                Vec::new()
            } else {
                self.export(blocks, range.clone(), layer, kind)
            }
        })
    }

    /// The inverse of [`KvPool::export_layer`], both sizes checked before either is written; a
    /// header-only pool leaves its rows as they were.
    pub fn import_layer(
        &mut self,
        blocks: &[u32],
        range: Range<usize>,
        layer: usize,
        [k, v]: [&[u8]; 2],
    ) -> Result<()> {
        if self.layout.header_only {
            return Ok(());
        }
        let want = range.len() * self.layout.n_kv_heads * self.layout.row_bytes();
        if k.len() != want || v.len() != want {
            return Err(Error::KvImport {
                reason: format!(
                    "layer {layer}: {} and {} bytes, expected {want} each",
                    k.len(),
                    v.len()
                ),
            });
        }
        self.import(blocks, range.clone(), layer, KvKind::Key, k)?;
        self.import(blocks, range, layer, KvKind::Value, v)
    }
}

/// `tokens` cut at multiples of `grid`: with [`BLOCK_TOKENS`], the runs of positions whose rows
/// lie back to back in a block's slab (a KV export or import copies a run at once); with a
/// push's chunk size, the pieces a push sends.
pub fn grid_cells(tokens: Range<usize>, grid: usize) -> impl Iterator<Item = Range<usize>> {
    let mut start = tokens.start;
    std::iter::from_fn(move || {
        (start < tokens.end).then(|| {
            let end = ((start / grid + 1) * grid).min(tokens.end);
            let cell = start..end;
            start = end;
            cell
        })
    })
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
            dtype: KvDtype::F16,
            header_only: false,
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
            dtype: KvDtype::F16,
            header_only: false,
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
        for dtype in [KvDtype::F16, KvDtype::Q8] {
            round_trip(dtype);
        }
    }

    fn round_trip(dtype: KvDtype) {
        let layout = KvLayout {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 4,
            dtype,
            header_only: false,
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
        // Laid out [head][token]: head 0's positions 3..19 (across the block boundary), then
        // head 1's.
        let row = |i: usize| {
            let mut out = [0f32; 4];
            let r = layout.row_bytes();
            dtype.decode_rows(4, &bytes[i * r..(i + 1) * r], &mut out);
            out
        };
        let near = |got: [f32; 4], first: f32| {
            (got.iter().enumerate()).all(|(d, &x)| (x - (first + d as f32)).abs() <= first / 100.0)
        };
        assert!(near(row(0), 24.0), "{:?}", row(0));
        assert!(near(row(13), (16 * 8) as f32), "{:?}", row(13));
        assert!(near(row(16 + 15), (18 * 8 + 4) as f32), "{:?}", row(31));
        let other = pool.alloc(2).expect("blocks");
        pool.import(&other, 3..19, 1, KvKind::Value, &bytes)
            .expect("import");
        assert_eq!(pool.export(&other, 3..19, 1, KvKind::Value), bytes);
        assert!(pool.import(&other, 0..2, 0, KvKind::Key, &bytes).is_err());
    }

    #[test]
    fn q8_rows_are_half_the_size_and_within_half_a_step() {
        assert_eq!(KvDtype::Q8.row_bytes(64), 66);
        assert_eq!(KvDtype::F16.row_bytes(64), 128);
        let values: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.173)
            .collect();
        let mut row = vec![0u16; 33];
        let row: &mut [u8] = bytemuck::cast_slice_mut(&mut row);
        KvDtype::Q8.encode_row(&values, row);
        let mut back = vec![0f32; 64];
        KvDtype::Q8.decode_rows(64, row, &mut back);
        let max = values.iter().fold(0f32, |m, x| m.max(x.abs()));
        let step = max / 127.0;
        for (x, y) in values.iter().zip(&back) {
            // Half an int8 step, plus the f16 rounding of the scale (relative 2^-11 of max).
            assert!(
                (x - y).abs() <= step * 0.5 + max / 2048.0,
                "{x} came back as {y}"
            );
        }
        // The largest value is exact up to the scale's rounding.
        let i = values.iter().position(|x| x.abs() == max).unwrap_or(0);
        assert!((values[i] - back[i]).abs() <= max / 1024.0);
    }

    #[test]
    fn q8_handles_zero_huge_and_non_finite_rows() {
        let mut buf = vec![0u16; 3];
        let row: &mut [u8] = bytemuck::cast_slice_mut(&mut buf);
        let mut back = [0f32; 4];
        let mut round_trip = |values: [f32; 4]| {
            KvDtype::Q8.encode_row(&values, row);
            KvDtype::Q8.decode_rows(4, row, &mut back);
            back
        };
        assert_eq!(round_trip([0.0; 4]), [0.0; 4]);
        // NaN is stored as 0; the others keep their scale.
        let back = round_trip([f32::NAN, 1.0, -1.0, 0.5]);
        assert_eq!(back[0], 0.0);
        assert!(
            (back[1] - 1.0).abs() < 1e-3 && (back[2] + 1.0).abs() < 1e-3,
            "{back:?}"
        );
        // Beyond f16's range the scale saturates: finite values with their signs.
        let back = round_trip([1e30, -1e30, 0.0, 1.0]);
        assert!(back.iter().all(|x| x.is_finite()), "{back:?}");
        assert!(back[0] > 1e6 && back[1] < -1e6, "{back:?}");
    }
}
