//! Causal grouped-query attention for query rows against a sequence's paged KV.
//!
//! Keys and values are always read back from the pool, even for the positions the current
//! forward pass just wrote, so the result for a position does not depend on how the prompt was
//! chunked or on which other sequences share the batch.
//!
//! The pool's rows (f16, or int8 with a scale) are converted to f32 a block at a time (values a
//! few blocks at a time), into a per-thread buffer that stays in cache, once for all the rows of
//! a prompt taken together; nothing else of the cache is copied.
//!
//! A call's query heads (each row's heads that share a KV head) are laid side by side in lanes,
//! `row · heads per KV head + head`, so that a register of lanes takes one key value broadcast
//! for many heads: no key is transposed and no sum is reduced across lanes. One query head's
//! arithmetic, in f32, whatever else the call holds:
//! - a score is one chain of multiply-adds over the head's dimensions, times the scale; a key
//!   outside the query's range scores −∞;
//! - its weights are `e^(s − max)` ([`portable::exp`]: 0 at and below [`FLOOR`], so for −∞) over
//!   every key the call reads, their sum one chain of adds in key order;
//! - each output dimension is one chain of multiply-adds over the keys, of weight by value,
//!   times `1 / sum` at the end.
//!
//! A key outside the query's range adds exactly 0 to each chain (its weight is 0, and `x + 0`
//! is `x`), so the keys a call reads beyond those a query sees alone leave its bits as they
//! are: a prompt row in a tile and the same position's decode step agree. The kernels for
//! AVX-512F (16 lanes a register), AVX2 (8) and portable loops take the same steps, so every
//! machine gives the same bits.

use std::ops::Range;

use crate::kv::{BLOCK_TOKENS, KvKind, KvPool};
use crate::memory::prefetch;

/// The kernels per instruction set, each giving the same bits as [`portable`]'s: AVX-512F where
/// the CPU has it ([`crate::cpu`]), else AVX2 where the build targets x86-64-v3.
#[cfg(x86_v3)]
mod avx2;
#[cfg(x86_v3)]
mod avx512;
mod portable;

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

/// Per-thread buffers, so a decode step does not allocate for each (row, layer), for the KV
/// head in hand; `lane` is a query head of the call.
#[derive(Default)]
struct Scratch {
    /// A block's keys or a run of blocks' values as f32, `[token][dimension]`.
    buf: Vec<f32>,
    /// `[dimension][lane]`.
    q: Vec<f32>,
    /// Each lane's visible keys, `lo..hi` (padding lanes see every key, of zero queries).
    lo: Vec<i32>,
    hi: Vec<i32>,
    /// `[key][lane]`, the keys from the first block read.
    scores: Vec<f32>,
    /// `[lane]`: each lane's largest score.
    max: Vec<f32>,
    /// `[lane]`: the sum of each lane's weights.
    sum: Vec<f32>,
    /// A run of blocks' weights, `[key][lane]`.
    weights: Vec<f32>,
    /// `[lane][dimension]`: each lane's weighted sum of values so far (the real lanes).
    acc: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// Slabs (a block's keys or values of one KV head) requested this many reads ahead.
const PREFETCH_AHEAD: usize = 4;
/// Blocks whose values are converted and weighted together.
const VALUE_RUN: usize = 4;
/// Keys whose weights the vector kernels take at once for a decode step's heads (one register
/// of lanes), their `e^x` steps interleaved; a call's keys are whole blocks.
const EXP_KEYS: usize = 4;
const _: () = assert!(BLOCK_TOKENS.is_multiple_of(EXP_KEYS));
/// Queries per call at most ([`tile_rows`]).
const MAX_TILE: usize = 16;
/// The scores a call may hold for a KV head: 16 MB of f32 per thread, so that a long prompt's
/// rows still share their keys' and values' reads (the 0.5B Qwen's 7 heads per KV head: tiles
/// of 16 rows up to 37k keys).
const SCORES_BUDGET: usize = 1 << 22;
/// Weights of scores at or below `max − 87` are 0: `e^-87` is the last power of e that is a
/// normal f32, so no sum meets a subnormal.
const FLOOR: f32 = -87.0;

/// How many consecutive positions of one sequence [`attend`] should take at once, for queries
/// of `heads` heads per KV head that see up to `n_keys` keys: up to [`MAX_TILE`], within
/// [`SCORES_BUDGET`].
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

/// The instruction sets the kernels come in.
#[derive(Clone, Copy, Debug)]
enum Isa {
    Avx512,
    Avx2,
    Portable,
}

impl Isa {
    /// The widest this CPU runs.
    fn best() -> Self {
        if crate::cpu::has_avx512f() {
            Isa::Avx512
        } else if cfg!(x86_v3) {
            Isa::Avx2
        } else {
            Isa::Portable
        }
    }

    /// Lanes a register holds: a call's lanes are padded to a multiple.
    fn width(self) -> usize {
        match self {
            Isa::Avx512 => 16,
            Isa::Avx2 | Isa::Portable => 8,
        }
    }

    fn scores(self, s: Scores<'_>) {
        s.check();
        assert!(
            s.max.len().is_multiple_of(self.width()),
            "lanes in whole registers"
        );
        match self {
            #[cfg(x86_v3)]
            Isa::Avx512 => avx512::scores(s),
            #[cfg(x86_v3)]
            Isa::Avx2 => avx2::scores(s),
            _ => portable::scores(s),
        }
    }

    /// The weights of a run of blocks' scores (`[key][lane]`): `e^(s − max)` into `out`
    /// (`[key][lane]`) and added to `sum` in key order.
    fn weights(self, scores: &[f32], max: &[f32], sum: &mut [f32], out: &mut [f32]) {
        let lanes = max.len();
        assert!(
            lanes.is_multiple_of(self.width())
                && sum.len() == lanes
                && scores.len().is_multiple_of(lanes * BLOCK_TOKENS)
                && out.len() == scores.len(),
            "attention weights: shapes"
        );
        match self {
            #[cfg(x86_v3)]
            Isa::Avx512 => avx512::weights(scores, max, sum, out),
            #[cfg(x86_v3)]
            Isa::Avx2 => avx2::weights(scores, max, sum, out),
            _ => portable::weights(scores, max, sum, out),
        }
    }

    /// `acc[lane] += Σ_t weights[t][lane] · values[t]` for each lane of `acc` (`[lane][hd]`,
    /// the real lanes only); `weights` is `[key][lanes]`, `values` `[key][hd]`.
    fn accumulate(self, weights: &[f32], lanes: usize, values: &[f32], acc: &mut [f32]) {
        let keys = weights.len() / lanes.max(1);
        if keys == 0 {
            return;
        }
        let hd = values.len() / keys;
        assert!(
            weights.len() == keys * lanes
                && values.len() == keys * hd
                && hd > 0
                && acc.len().is_multiple_of(hd)
                && acc.len() / hd <= lanes,
            "attention accumulate: shapes"
        );
        let a = Accumulate {
            weights,
            lanes,
            values,
            hd,
        };
        let done = match self {
            #[cfg(x86_v3)]
            Isa::Avx512 => avx512::accumulate(&a, acc),
            #[cfg(x86_v3)]
            Isa::Avx2 => avx2::accumulate(&a, acc),
            _ => 0,
        };
        portable::accumulate(&a, done..hd, acc);
    }
}

/// One KV head's scores for one block of keys, for every lane.
struct Scores<'a> {
    /// `[dimension][lane]`.
    q: &'a [f32],
    /// `[token][dimension]`, [`BLOCK_TOKENS`] tokens.
    keys: &'a [f32],
    scale: f32,
    /// `[token][lane]`.
    out: &'a mut [f32],
    /// `[lane]`, raised to the block's largest score of each lane.
    max: &'a mut [f32],
    /// The block's first key position.
    at: usize,
    /// Each lane's visible keys `lo[lane]..hi[lane]`, where some lane does not see every key of
    /// the block (`None`: all do).
    range: Option<(&'a [i32], &'a [i32])>,
}

impl Scores<'_> {
    fn hd(&self) -> usize {
        self.keys.len() / BLOCK_TOKENS
    }

    /// The shapes every kernel relies on.
    fn check(&self) {
        let lanes = self.max.len();
        assert!(
            self.q.len() == self.hd() * lanes
                && self.keys.len() == BLOCK_TOKENS * self.hd()
                && self.out.len() == BLOCK_TOKENS * lanes
                && self
                    .range
                    .is_none_or(|(lo, hi)| lo.len() == lanes && hi.len() == lanes)
                && self.at + BLOCK_TOKENS <= i32::MAX as usize,
            "attention scores: shapes"
        );
    }

    /// Whether lane `lane` sees the key at `pos`.
    fn sees(&self, lane: usize, pos: usize) -> bool {
        self.range
            .is_none_or(|(lo, hi)| lo[lane] as usize <= pos && pos < hi[lane] as usize)
    }
}

/// The inputs of [`Isa::accumulate`], shapes checked.
struct Accumulate<'a> {
    weights: &'a [f32],
    lanes: usize,
    values: &'a [f32],
    hd: usize,
}

impl Accumulate<'_> {
    fn keys(&self) -> usize {
        self.weights.len() / self.lanes
    }
}

/// The blocks a call's queries see for one KV head, from the first block any of them sees
/// (`lo`) to the one holding the last key, read in two passes: keys of every block, then values
/// of every block. Each read is asked for [`PREFETCH_AHEAD`] reads early: the KV of a decode
/// batch does not stay in cache between steps, so a pass waits on memory unless the next reads
/// are already under way.
struct Blocks<'a> {
    pool: &'a KvPool,
    layer: usize,
    head: usize,
    /// The sequence's block table from block `lo` on.
    table: &'a [u32],
    lo: usize,
    n_blocks: usize,
    /// The last query's key count: keys `lo·16..n_keys` are read.
    n_keys: usize,
}

impl<'a> Blocks<'a> {
    fn new(pool: &'a KvPool, qs: &[Query<'a>], head: usize) -> Self {
        let g = &qs[0];
        let lo = qs
            .iter()
            .map(|q| q.first_key / BLOCK_TOKENS)
            .min()
            .unwrap_or(0);
        let n_keys = qs.iter().map(|q| q.n_keys).max().unwrap_or(0);
        let blocks = Self {
            pool,
            layer: g.layer,
            head,
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
            .slabs(block, self.layer, kind, self.head..self.head + 1)
    }

    /// Read `i`'s rows converted to f32 in `buf` (`[token][hd]`), the rows of a last block's
    /// missing keys zero.
    fn load(&self, i: usize, buf: &mut [f32]) {
        if i + PREFETCH_AHEAD < 2 * self.n_blocks {
            prefetch(self.read(i + PREFETCH_AHEAD));
        }
        let layout = self.pool.layout();
        let (hd, row_bytes) = (layout.head_dim, layout.row_bytes());
        let n = (self.n_keys - (self.lo + i % self.n_blocks) * BLOCK_TOKENS).min(BLOCK_TOKENS);
        let dst = &mut buf[..BLOCK_TOKENS * hd];
        layout
            .dtype
            .decode_rows(hd, &self.read(i)[..n * row_bytes], &mut dst[..n * hd]);
        dst[n * hd..].fill(0.0);
    }
}

/// One KV head at a time: scores for every block, then weights and values a run of blocks at a
/// time (see the module's documentation for the arithmetic).
fn attend_in(pool: &KvPool, qs: &[Query<'_>], out: &mut [f32], s: &mut Scratch) {
    let Some(g0) = qs.first() else { return };
    let isa = Isa::best();
    let hd = pool.layout().head_dim;
    let heads = g0.q.len() / hd;
    let per_kv = heads / g0.kv_heads.len();
    let slab = BLOCK_TOKENS * hd;
    let n_lanes = qs.len() * per_kv;
    let lanes = n_lanes.next_multiple_of(isa.width());
    let scale = 1.0 / (hd as f32).sqrt();

    s.lo.clear();
    s.lo.resize(lanes, 0);
    s.hi.clear();
    s.hi.resize(lanes, i32::MAX);
    for (r, q) in qs.iter().enumerate() {
        let lanes = &mut s.lo[r * per_kv..][..per_kv];
        lanes.fill(i32::try_from(q.first_key).expect("key position fits i32"));
        let lanes = &mut s.hi[r * per_kv..][..per_kv];
        lanes.fill(i32::try_from(q.n_keys).expect("key position fits i32"));
    }
    // The keys every query sees, from the last first key to the first query's own position.
    let max_lo = qs.iter().map(|q| q.first_key).max().unwrap_or(0);
    let min_hi = qs.iter().map(|q| q.n_keys).min().unwrap_or(0);

    for (g, head) in g0.kv_heads.clone().enumerate() {
        let kv = Blocks::new(pool, qs, head);
        let n_keys = kv.n_blocks * BLOCK_TOKENS;
        s.q.clear();
        s.q.resize(hd * lanes, 0.0);
        for (r, q) in qs.iter().enumerate() {
            let group = &q.q[g * per_kv * hd..][..per_kv * hd];
            for (h, head) in group.chunks_exact(hd).enumerate() {
                for (d, &v) in head.iter().enumerate() {
                    s.q[d * lanes + r * per_kv + h] = v;
                }
            }
        }

        s.scores.resize(n_keys * lanes, 0.0);
        s.max.clear();
        s.max.resize(lanes, f32::NEG_INFINITY);
        s.buf.resize(VALUE_RUN * slab, 0.0);
        for bi in 0..kv.n_blocks {
            kv.load(bi, &mut s.buf);
            let at = (kv.lo + bi) * BLOCK_TOKENS;
            let whole = at >= max_lo && at + BLOCK_TOKENS <= min_hi;
            isa.scores(Scores {
                q: &s.q,
                keys: &s.buf[..slab],
                scale,
                out: &mut s.scores[bi * BLOCK_TOKENS * lanes..][..BLOCK_TOKENS * lanes],
                max: &mut s.max,
                at,
                range: (!whole).then_some((&s.lo, &s.hi)),
            });
        }

        s.sum.clear();
        s.sum.resize(lanes, 0.0);
        s.acc.clear();
        s.acc.resize(n_lanes * hd, 0.0);
        s.weights.resize(VALUE_RUN * BLOCK_TOKENS * lanes, 0.0);
        for r0 in (0..kv.n_blocks).step_by(VALUE_RUN) {
            let r1 = (r0 + VALUE_RUN).min(kv.n_blocks);
            for bi in r0..r1 {
                kv.load(kv.n_blocks + bi, &mut s.buf[(bi - r0) * slab..]);
            }
            let (k0, keys) = (r0 * BLOCK_TOKENS, (r1 - r0) * BLOCK_TOKENS);
            let weights = &mut s.weights[..keys * lanes];
            isa.weights(
                &s.scores[k0 * lanes..][..keys * lanes],
                &s.max,
                &mut s.sum,
                weights,
            );
            isa.accumulate(weights, lanes, &s.buf[..keys * hd], &mut s.acc);
        }

        for (r, o) in out.chunks_exact_mut(heads * hd).enumerate() {
            let group = &mut o[g * per_kv * hd..][..per_kv * hd];
            for (h, o) in group.chunks_exact_mut(hd).enumerate() {
                let lane = r * per_kv + h;
                let inv = 1.0 / s.sum[lane];
                for (o, &a) in o.iter_mut().zip(&s.acc[lane * hd..][..hd]) {
                    *o = a * inv;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
