//! Causal grouped-query attention for query rows against a sequence's paged KV.
//!
//! Keys and values are always read back from the pool, even for the positions the current
//! forward pass just wrote, so the result for a position does not depend on how the prompt was
//! chunked or on which other sequences share the batch.
//!
//! The pool's rows (f16, or int8 with a scale) are converted to f32 a block at a time (values a
//! few blocks at a time), into a per-thread buffer that stays in cache, once for all the rows of
//! a prompt taken together; nothing else of the cache is copied.

use std::ops::Range;

use crate::kv::{BLOCK_TOKENS, KvKind, KvPool};
use crate::memory::prefetch;

#[cfg(x86_v3)]
mod avx2;
mod bf16;
/// The inner loops per instruction set, each giving the same bits as the one it stands in for:
/// AVX-512F where the CPU has it ([`crate::cpu`]), else AVX2 where the build targets x86-64-v3,
/// else portable loops.
mod avx512;
mod portable;
#[cfg(x86_v3)]
use avx2 as narrow;
#[cfg(not(x86_v3))]
use portable as narrow;

/// Inputs for the query heads of one row that share the KV heads `kv_heads`.
#[derive(Debug)]
pub struct Query<'a> {
    pub layer: usize,
    pub kv_heads: Range<usize>,
    /// The sequence's block table.
    pub blocks: &'a [u32],
    /// Keys `first_key..n_keys` are visible (the query's own position is `n_keys - 1`):
    /// `first_key` is 0 but in a layer of sliding-window attention.
    pub first_key: usize,
    pub n_keys: usize,
    /// `heads × head_dim` query values, already rotated: the heads of `kv_heads`, in order.
    pub q: &'a [f32],
}

/// Per-thread buffers, so a decode step does not allocate for each (row, layer).
#[derive(Default)]
struct Scratch {
    scores: Vec<f32>,
    /// Where each query's scores start in `scores`.
    offsets: Vec<usize>,
    buf: Vec<f32>,
    /// A block's keys transposed for [`avx512::scores`]: `[kv head][dimension][token]`.
    transposed: Vec<f32>,
    bf16: bf16::Buffers,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// Slabs (all of a block's `kv_heads`, keys or values) requested this many reads ahead.
const PREFETCH_AHEAD: usize = 4;

/// Blocks whose values one call of the accumulation takes together: its accumulators stay in
/// registers over this many blocks' tokens.
const VALUE_RUN: usize = 4;
/// Queries per call at most ([`tile_rows`]).
const MAX_TILE: usize = 16;
/// The scores a call may hold: 16 MB of f32 per thread, so that a long prompt's rows still
/// share their keys' and values' reads (the 0.5B Qwen's 14 heads: tiles of 16 rows up to 18k
/// keys, 9 at 32k).
const SCORES_BUDGET: usize = 1 << 22;

/// How many consecutive positions of one sequence [`attend`] should take at once, for queries
/// of `heads` heads that see up to `n_keys` keys: up to [`MAX_TILE`], within [`SCORES_BUDGET`].
pub fn tile_rows(heads: usize, n_keys: usize) -> usize {
    (SCORES_BUDGET / (heads * n_keys).max(1)).clamp(1, MAX_TILE)
}

/// Writes each query's `heads × head_dim` attention outputs into `out`, one query after
/// another. The queries share a layer, KV heads and block table (positions of one sequence),
/// so each block's keys and values are converted to f32 once for all of them; each query's
/// arithmetic is what it would be alone.
pub fn attend(pool: &KvPool, qs: &[Query<'_>], out: &mut [f32]) {
    SCRATCH.with_borrow_mut(|s| attend_in(pool, qs, out, s));
}

/// The blocks a call's queries see, from the first block any of them sees (`lo`) to the one
/// holding the last key, read in two passes: keys of every block, then values of every block.
/// Each block's slabs for `kv_heads` are one contiguous run of memory, read in one go and asked
/// for [`PREFETCH_AHEAD`] reads early: the KV of a decode batch does not stay in cache between
/// steps, so a pass waits on memory unless the next reads are already under way.
struct Blocks<'a> {
    pool: &'a KvPool,
    layer: usize,
    kv_heads: Range<usize>,
    /// The sequence's block table from block `lo` on.
    table: &'a [u32],
    lo: usize,
    n_blocks: usize,
    /// The last query's key count: keys `lo·16..n_keys` are read.
    n_keys: usize,
}

impl<'a> Blocks<'a> {
    fn new(pool: &'a KvPool, qs: &[Query<'a>]) -> Self {
        let g = &qs[0];
        let lo = qs.iter().map(first_block).min().unwrap_or(0);
        let n_keys = qs.iter().map(|q| q.n_keys).max().unwrap_or(0);
        let blocks = Self {
            pool,
            layer: g.layer,
            kv_heads: g.kv_heads.clone(),
            table: &g.blocks[lo..],
            lo,
            n_blocks: n_keys.div_ceil(BLOCK_TOKENS) - lo,
            n_keys,
        };
        for i in 0..PREFETCH_AHEAD.min(2 * blocks.n_blocks) {
            prefetch(blocks.read(i));
        }
        blocks
    }

    /// Read `i` of the `2·n_blocks`: the keys of block `lo + i`, or past `n_blocks` its values.
    fn read(&self, i: usize) -> &'a [u8] {
        let kind = if i < self.n_blocks {
            KvKind::Key
        } else {
            KvKind::Value
        };
        let block = self.table[i % self.n_blocks];
        self.pool
            .slabs(block, self.layer, kind, self.kv_heads.clone())
    }

    /// The keys read `i`'s block holds (16 but in the last).
    fn tokens(&self, i: usize) -> usize {
        (self.n_keys - (self.lo + i % self.n_blocks) * BLOCK_TOKENS).min(BLOCK_TOKENS)
    }

    /// Read `i`'s rows converted to f32 in `buf`: `[head][token][hd]`, each head's rows `stride`
    /// values after the last's; the rows past [`Self::tokens`] are left as they were.
    fn load(&self, i: usize, buf: &mut [f32], stride: usize) {
        if i + PREFETCH_AHEAD < 2 * self.n_blocks {
            prefetch(self.read(i + PREFETCH_AHEAD));
        }
        let layout = self.pool.layout();
        let (hd, row_bytes) = (layout.head_dim, layout.row_bytes());
        let n = self.tokens(i);
        for (h, src) in self.read(i).chunks_exact(BLOCK_TOKENS * row_bytes).enumerate() {
            let dst = &mut buf[h * stride..][..n * hd];
            layout.dtype.decode_rows(hd, &src[..n * row_bytes], dst);
        }
    }
}

/// The block holding a query's first visible key.
fn first_block(q: &Query<'_>) -> usize {
    q.first_key / BLOCK_TOKENS
}

/// Where the CPU has AVX-512 BF16 and the head size suits it, [`bf16`]'s arithmetic, for every
/// row alike; else f32 in two passes over the blocks, keys then values. Each head's f32
/// arithmetic is the same whatever `kv_heads` and the other queries hold (its scores, softmax
/// and weighted sum of values in position order, a block's keys taken in the same runs).
fn attend_in(pool: &KvPool, qs: &[Query<'_>], out: &mut [f32], s: &mut Scratch) {
    let Some(g) = qs.first() else { return };
    let hd = pool.layout().head_dim;
    let kv = Blocks::new(pool, qs);
    if bf16::runs(hd) {
        return bf16::attend(&kv, qs, out, &mut s.bf16, &mut s.buf);
    }
    let heads = g.q.len() / hd;
    let per_kv = heads / g.kv_heads.len();
    let slab = BLOCK_TOKENS * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    // Each query sees whole blocks from the one holding its first visible key: `span` scores
    // per head, the keys before `first_key` in that block masked out.
    let span = |q: &Query<'_>| q.n_keys - first_block(q) * BLOCK_TOKENS;
    // Its keys in (absolute) blocks `bs`, if it sees any there: from the start of the block
    // holding its first visible key on, up to its own position.
    let seen = |q: &Query<'_>, bs: Range<usize>| {
        let from = bs.start.max(first_block(q)) * BLOCK_TOKENS;
        let to = q.n_keys.min(bs.end * BLOCK_TOKENS);
        (from < to).then_some(from..to)
    };
    let (lo, n_blocks) = (kv.lo, kv.n_blocks);
    s.offsets.clear();
    let mut total = 0;
    for q in qs {
        s.offsets.push(total);
        total += heads * span(q);
    }
    // Every score is written below (each query's visible blocks cover its span), so what the
    // buffer held before is not cleared.
    s.scores.resize(total, 0.0);
    let run_slab = VALUE_RUN * slab;
    s.buf.resize(g.kv_heads.len() * run_slab, 0.0);
    // A tile of rows takes each block's keys transposed, for its many queries to share.
    let wide_scores = qs.len() >= avx512::SCORES_ROWS && avx512::scores_fit(hd);
    s.transposed.resize(g.kv_heads.len() * slab, 0.0);
    for bi in 0..n_blocks {
        kv.load(bi, &mut s.buf, slab);
        let b = lo + bi;
        if wide_scores {
            avx512::transpose(&s.buf, hd, &mut s.transposed);
        }
        for (q, &off) in qs.iter().zip(&s.offsets) {
            let Some(visible) = seen(q, b..b + 1) else {
                continue;
            };
            let (n, at) = (
                visible.len(),
                off + visible.start - first_block(q) * BLOCK_TOKENS,
            );
            // The heads that share a KV head together, each key row read once for several.
            for (g, qg) in q.q.chunks_exact(per_kv * hd).enumerate() {
                let scores = &mut s.scores[at + g * per_kv * span(q)..];
                if wide_scores {
                    let keys = &s.transposed[g * slab..][..slab];
                    avx512::scores(qg, keys, scale, scores, span(q), n);
                } else {
                    let keys = &s.buf[g * slab..][..n * hd];
                    narrow::scores_heads(qg, keys, scale, scores, span(q), n);
                }
            }
        }
    }
    for (q, &off) in qs.iter().zip(&s.offsets) {
        let masked = q.first_key - first_block(q) * BLOCK_TOKENS;
        let rows = &mut s.scores[off..off + heads * span(q)];
        for row in rows.chunks_exact_mut(span(q)) {
            row[..masked].fill(f32::NEG_INFINITY);
        }
        softmax_rows(rows, span(q));
    }
    out.fill(0.0);
    let wide = avx512::accumulates(hd);
    // The values [`VALUE_RUN`] blocks at a time, each head's in one run of `buf`.
    for r0 in (0..n_blocks).step_by(VALUE_RUN) {
        let r1 = (r0 + VALUE_RUN).min(n_blocks);
        for bi in r0..r1 {
            kv.load(n_blocks + bi, &mut s.buf[(bi - r0) * slab..], run_slab);
        }
        let first = (lo + r0) * BLOCK_TOKENS;
        for ((q, &off), o) in qs
            .iter()
            .zip(&s.offsets)
            .zip(out.chunks_exact_mut(heads * hd))
        {
            let Some(visible) = seen(q, lo + r0..lo + r1) else {
                continue;
            };
            let (n, at) = (
                visible.len(),
                off + visible.start - first_block(q) * BLOCK_TOKENS,
            );
            // The heads of each KV head together, so that each value is read once for all.
            for (g, og) in o.chunks_exact_mut(per_kv * hd).enumerate() {
                let values = &s.buf[g * run_slab + (visible.start - first) * hd..][..n * hd];
                let p = &s.scores[at + g * per_kv * span(q)..];
                if wide {
                    avx512::accumulate_heads(p, span(q), n, values, og);
                } else {
                    narrow::accumulate_heads(p, span(q), n, values, og);
                }
            }
        }
    }
}

/// Dot product with 8 independent partial sums, which the compiler turns into SIMD.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Rows whose sums run side by side in [`softmax_rows`]: a chain of adds waits a whole add's
/// latency for each term, and this many chains keep the adders busy instead.
const SUM_CHAINS: usize = 8;

/// The softmax of each `len`-long row of `rows`: `e^(x - max)` over the row's sum, the sum one
/// chain of adds in key order whatever the other rows are (so a prompt row and a decode step
/// agree), up to [`SUM_CHAINS`] rows' chains interleaved.
pub fn softmax_rows(rows: &mut [f32], len: usize) {
    if len == 0 || rows.is_empty() {
        return;
    }
    // Groups of as even a size as can be (14 rows: two of 7, not 8 and 6).
    let n_rows = rows.len() / len;
    let per_group = n_rows.div_ceil(n_rows.div_ceil(SUM_CHAINS));
    for group in rows.chunks_mut(per_group * len) {
        for row in group.chunks_exact_mut(len) {
            let max = max(row);
            for v in row.iter_mut() {
                *v -= max;
            }
            crate::math::exp_in_place(row);
        }
        let mut sums = [0f32; SUM_CHAINS];
        match group.len() / len {
            8 => chains::<8>(group, len, &mut sums),
            7 => chains::<7>(group, len, &mut sums),
            6 => chains::<6>(group, len, &mut sums),
            5 => chains::<5>(group, len, &mut sums),
            4 => chains::<4>(group, len, &mut sums),
            3 => chains::<3>(group, len, &mut sums),
            2 => chains::<2>(group, len, &mut sums),
            _ => chains::<1>(group, len, &mut sums),
        }
        const { assert!(SUM_CHAINS == 8) };
        for (row, sum) in group.chunks_exact_mut(len).zip(sums) {
            let inv = 1.0 / sum;
            for v in row.iter_mut() {
                *v *= inv;
            }
        }
    }
}

/// The largest of `x` (NaN aside), in 16 lanes: the largest does not depend on the order in
/// which it was found (but for the sign of a zero, which `x - max` does not see).
fn max(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let rest = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = m.max(v);
        }
    }
    lanes
        .iter()
        .chain(rest)
        .copied()
        .fold(f32::NEG_INFINITY, f32::max)
}

/// The sums of `R` rows of `len` into `sums[..R]`, each a chain of adds in order from zero (for
/// the non-negative terms here, the bits of `iter().sum()`), the `R` chains interleaved.
fn chains<const R: usize>(rows: &[f32], len: usize, sums: &mut [f32]) {
    let rows: [&[f32]; R] = std::array::from_fn(|r| &rows[r * len..][..len]);
    let sums: &mut [f32; R] = (&mut sums[..R]).try_into().expect("R sums");
    for j in 0..len {
        for (s, row) in sums.iter_mut().zip(&rows) {
            *s += row[j];
        }
    }
}

#[cfg(test)]
mod tests;
