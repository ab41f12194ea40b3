//! Causal grouped-query attention for query rows against a sequence's paged KV.
//!
//! Keys and values are always read back from the pool, even for the positions the current
//! forward pass just wrote, so the result for a position does not depend on how the prompt was
//! chunked or on which other sequences share the batch.
//!
//! The pool's rows (f16, or int8 with a scale) are converted to f32 one block at a time, into a
//! per-thread buffer of 16 rows per KV head that stays in L1, once for all the rows of a prompt
//! taken together; nothing else of the cache is copied.

use std::ops::Range;

use crate::kv::{BLOCK_TOKENS, KvKind, KvPool};
use crate::memory::prefetch;

#[cfg(x86_v3)]
mod avx2;
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
    /// One chunk's scores of each (query, head): [`CHUNK`] apart.
    scores: Vec<f32>,
    /// Each (query, head)'s running softmax: the largest score so far and the sum of
    /// `e^(score - max)` over the keys so far.
    max: Vec<f32>,
    sum: Vec<f32>,
    /// A chunk's keys and values in f32, `[kv head][token][hd]`.
    keys: Vec<f32>,
    values: Vec<f32>,
    /// The chunk's keys transposed for [`avx512::scores`]: `[kv head][block][dimension][token]`.
    transposed: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// Slabs (all of a block's `kv_heads`, keys or values) requested this many reads ahead.
const PREFETCH_AHEAD: usize = 4;

/// Blocks whose keys a query's softmax takes in one step: a chunk's keys and values of a KV
/// head stay in L1 (16 KB with 64-value heads) while every query of the tile uses them.
const CHUNK_BLOCKS: usize = 2;
/// Keys per chunk. Chunks start at multiples of it, whatever the tile, so a query's steps
/// are the same alone and in a tile.
const CHUNK: usize = CHUNK_BLOCKS * BLOCK_TOKENS;

/// Consecutive positions of one sequence that [`attend`] should take at once: each chunk's
/// keys and values are converted to f32 once for all of them.
pub const MAX_TILE: usize = 16;

/// Writes each query's `heads × head_dim` attention outputs into `out`, one query after
/// another. The queries share a layer, KV heads and block table (positions of one sequence),
/// so each block's keys and values are converted to f32 once for all of them; each query's
/// arithmetic is what it would be alone.
pub fn attend(pool: &KvPool, qs: &[Query<'_>], out: &mut [f32]) {
    SCRATCH.with_borrow_mut(|s| attend_in(pool, qs, out, s));
}

/// One pass over the keys in chunks of [`CHUNK`] (an online softmax, as flash attention
/// computes it): for each chunk, each query's scores, their largest and `e^(score - max)`,
/// the output so far scaled down where the largest grew, and the chunk's values added with
/// those weights; at the end each output is divided by its sum. Nothing of size
/// `n_keys` is held, so a long prompt's tile stays [`MAX_TILE`] rows.
///
/// Each chunk's slabs for `kv_heads` are contiguous runs of memory, read in one go and asked
/// for [`PREFETCH_AHEAD`] reads early: the KV of a decode batch does not stay in cache between
/// steps, so this loop waits on memory unless the next reads are already under way. Each
/// head's arithmetic is the same whatever `kv_heads` and the other queries hold.
fn attend_in(pool: &KvPool, qs: &[Query<'_>], out: &mut [f32], s: &mut Scratch) {
    let Some(g) = qs.first() else { return };
    let layout = pool.layout();
    let (hd, row_bytes) = (layout.head_dim, layout.row_bytes());
    let heads = g.q.len() / hd;
    let kv_heads = g.kv_heads.len();
    let per_kv = heads / kv_heads;
    let slab = BLOCK_TOKENS * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    // Each query's keys: from the start of the block holding its first visible key (the keys
    // before `first_key` there masked out) to `n_keys`.
    let first = |q: &Query<'_>| q.first_key / BLOCK_TOKENS * BLOCK_TOKENS;
    let lo = qs.iter().map(first).min().unwrap_or(0) / BLOCK_TOKENS;
    let n_keys = qs.iter().map(|q| q.n_keys).max().unwrap_or(0);
    let hi = n_keys.div_ceil(BLOCK_TOKENS);
    // The tile's reads, in order: for each chunk, its blocks' keys, then their values.
    let chunk_blocks = |c: usize| (c * CHUNK_BLOCKS).max(lo)..((c + 1) * CHUNK_BLOCKS).min(hi);
    let chunks = lo / CHUNK_BLOCKS..hi.div_ceil(CHUNK_BLOCKS);
    let reads = chunks.clone().map(|c| {
        [KvKind::Key, KvKind::Value].map(move |kind| chunk_blocks(c).map(move |b| (b, kind)))
    });
    let mut ahead = reads.clone().flatten().flatten();
    let slabs =
        |(b, kind): (usize, KvKind)| pool.slabs(g.blocks[b], g.layer, kind, g.kv_heads.clone());
    for read in ahead.by_ref().take(PREFETCH_AHEAD) {
        prefetch(slabs(read));
    }
    // Block `b`'s rows that some query sees, as f32 at its place in the chunk's buffer.
    let mut load = |(b, kind): (usize, KvKind), buf: &mut [f32]| {
        if let Some(next) = ahead.next() {
            prefetch(slabs(next));
        }
        let n = (n_keys - b * BLOCK_TOKENS).min(BLOCK_TOKENS);
        let at = b % CHUNK_BLOCKS * slab;
        let slab_bytes = BLOCK_TOKENS * row_bytes;
        for (src, dst) in slabs((b, kind))
            .chunks_exact(slab_bytes)
            .zip(buf.chunks_exact_mut(CHUNK * hd))
        {
            let dst = &mut dst[at..at + n * hd];
            layout.dtype.decode_rows(hd, &src[..n * row_bytes], dst);
        }
    };
    let states = qs.len() * heads;
    s.scores.resize(states * CHUNK, 0.0);
    s.max.clear();
    s.max.resize(states, f32::NEG_INFINITY);
    s.sum.clear();
    s.sum.resize(states, 0.0);
    s.keys.resize(kv_heads * CHUNK * hd, 0.0);
    s.values.resize(kv_heads * CHUNK * hd, 0.0);
    s.transposed.resize(kv_heads * CHUNK * hd, 0.0);
    // A tile of rows takes each block's keys transposed, for its many queries to share.
    let wide_scores = qs.len() >= avx512::SCORES_ROWS && avx512::scores_fit(hd);
    let wide = avx512::accumulates(hd);
    out.fill(0.0);
    for (c, [key_reads, value_reads]) in chunks.zip(reads) {
        key_reads.for_each(|r| load(r, &mut s.keys));
        value_reads.for_each(|r| load(r, &mut s.values));
        if wide_scores {
            avx512::transpose(&s.keys, hd, &mut s.transposed);
        }
        let base = c * CHUNK;
        for (qi, (q, o)) in qs.iter().zip(out.chunks_exact_mut(heads * hd)).enumerate() {
            // This chunk's keys `j0..j1` (from its start) that the query sees, from a block's
            // start; `masked` of them before its first key.
            let j0 = first(q).max(base) - base;
            let j1 = q.n_keys.min(base + CHUNK).saturating_sub(base);
            if j0 >= j1 {
                continue;
            }
            let masked = q.first_key.saturating_sub(base + j0);
            let scores = &mut s.scores[qi * heads * CHUNK..][..heads * CHUNK];
            if wide_scores {
                // The heads that share a KV head together, each key row read once for several.
                for (g, qg) in q.q.chunks_exact(per_kv * hd).enumerate() {
                    for j in (j0..j1).step_by(BLOCK_TOKENS) {
                        let keys = &s.transposed[(g * CHUNK + j) * hd..][..slab];
                        let at = g * per_kv * CHUNK + j;
                        let n = (j1 - j).min(BLOCK_TOKENS);
                        avx512::scores(qg, keys, scale, &mut scores[at..], CHUNK, n);
                    }
                }
            } else {
                for (g, qg) in q.q.chunks_exact(per_kv * hd).enumerate() {
                    let keys = &s.keys[(g * CHUNK + j0) * hd..][..(j1 - j0) * hd];
                    let at = g * per_kv * CHUNK + j0;
                    narrow::scores_heads(qg, keys, scale, &mut scores[at..], CHUNK, j1 - j0);
                }
            }
            let state = qi * heads..(qi + 1) * heads;
            let running = s.max[state.clone()].iter_mut().zip(&mut s.sum[state]);
            for ((row, (max, sum)), oh) in scores
                .chunks_exact_mut(CHUNK)
                .zip(running)
                .zip(o.chunks_exact_mut(hd))
            {
                let row = &mut row[j0..j1];
                row[..masked].fill(f32::NEG_INFINITY);
                let top = max_of(row, *max);
                for v in row.iter_mut() {
                    *v -= top;
                }
                crate::math::exp_in_place(row);
                if top > *max && *max > f32::NEG_INFINITY {
                    let shrink = crate::math::exp(*max - top);
                    *sum *= shrink;
                    oh.iter_mut().for_each(|x| *x *= shrink);
                }
                *max = top;
                *sum += sum_of(row);
            }
            // The heads of each KV head together, so that each value is read once for all.
            for (g, og) in o.chunks_exact_mut(per_kv * hd).enumerate() {
                let values = &s.values[(g * CHUNK + j0) * hd..][..(j1 - j0) * hd];
                let p = &scores[g * per_kv * CHUNK + j0..];
                if wide {
                    avx512::accumulate_heads(p, CHUNK, j1 - j0, values, og);
                } else {
                    narrow::accumulate_heads(p, CHUNK, j1 - j0, values, og);
                }
            }
        }
    }
    for (o, &sum) in out.chunks_exact_mut(hd).zip(&s.sum) {
        let inv = 1.0 / sum;
        o.iter_mut().for_each(|x| *x *= inv);
    }
}

/// The largest of `x` and `start`, eight lanes at a time (a maximum is exact in any order).
fn max_of(x: &[f32], start: f32) -> f32 {
    let mut lanes = [start; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder().iter().copied().fold(start, f32::max);
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = l.max(v);
        }
    }
    lanes.into_iter().fold(tail, f32::max)
}

/// `Σ x` in eight chains (chain `i` takes elements `i`, `i + 8`, …), added pairwise, then the
/// elements past the last eight in order: one fixed order for every caller.
fn sum_of(x: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l += v;
        }
    }
    let [a, b, c, d, e, f, g, h] = lanes;
    tail.iter()
        .fold(((a + b) + (c + d)) + ((e + f) + (g + h)), |s, &v| s + v)
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

#[cfg(test)]
mod tests;
