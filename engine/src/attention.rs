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
    /// A block's keys transposed for [`wide::scores`]: `[kv head][dimension][token]`.
    transposed: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// Slabs (all of a block's `kv_heads`, keys or values) requested this many reads ahead.
const PREFETCH_AHEAD: usize = 4;

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

/// Two passes over the blocks, keys then values. Each block's slabs for `kv_heads` are one
/// contiguous run of memory, read in one go and asked for [`PREFETCH_AHEAD`] reads early: the
/// KV of a decode batch does not stay in cache between steps, so this loop waits on memory
/// unless the next reads are already under way. Each head's arithmetic is the same whatever
/// `kv_heads` and the other queries hold (its scores, softmax and weighted sum of values in
/// position order, a block's keys taken in the same runs).
fn attend_in(pool: &KvPool, qs: &[Query<'_>], out: &mut [f32], s: &mut Scratch) {
    let Some(g) = qs.first() else { return };
    let layout = pool.layout();
    let (hd, row_bytes) = (layout.head_dim, layout.row_bytes());
    let heads = g.q.len() / hd;
    let per_kv = heads / g.kv_heads.len();
    let slab = BLOCK_TOKENS * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    // Each query sees whole blocks from the one holding its first visible key: `span` scores
    // per head, the keys before `first_key` in that block masked out.
    let first_block = |q: &Query<'_>| q.first_key / BLOCK_TOKENS;
    let span = |q: &Query<'_>| q.n_keys - first_block(q) * BLOCK_TOKENS;
    // Its keys in (absolute) block `b`, if it sees any there.
    let visible = |q: &Query<'_>, b: usize| {
        (first_block(q) <= b && b * BLOCK_TOKENS < q.n_keys)
            .then(|| (q.n_keys - b * BLOCK_TOKENS).min(BLOCK_TOKENS))
    };
    let lo = qs.iter().map(first_block).min().unwrap_or(0);
    let n_keys = qs.iter().map(|q| q.n_keys).max().unwrap_or(0);
    let n_blocks = n_keys.div_ceil(BLOCK_TOKENS) - lo;
    s.offsets.clear();
    let mut total = 0;
    for q in qs {
        s.offsets.push(total);
        total += heads * span(q);
    }
    // Every score is written below (each query's visible blocks cover its span), so what the
    // buffer held before is not cleared.
    s.scores.resize(total, 0.0);
    s.buf.resize(g.kv_heads.len() * slab, 0.0);
    // Read `i` of the 2·n_blocks: keys of every block, then values of every block.
    let read = |i: usize| {
        let kind = if i < n_blocks {
            KvKind::Key
        } else {
            KvKind::Value
        };
        let block = g.blocks[lo + i % n_blocks];
        pool.slabs(block, g.layer, kind, g.kv_heads.clone())
    };
    // The rows of each KV head's slab that some query sees, converted to f32 in `buf`:
    // `[head][token][hd]`.
    let load = |i: usize, buf: &mut [f32]| {
        if i + PREFETCH_AHEAD < 2 * n_blocks {
            prefetch(read(i + PREFETCH_AHEAD));
        }
        let n = (n_keys - (lo + i % n_blocks) * BLOCK_TOKENS).min(BLOCK_TOKENS);
        let slab_bytes = BLOCK_TOKENS * row_bytes;
        for (src, dst) in read(i)
            .chunks_exact(slab_bytes)
            .zip(buf.chunks_exact_mut(slab))
        {
            layout
                .dtype
                .decode_rows(hd, &src[..n * row_bytes], &mut dst[..n * hd]);
        }
    };
    for i in 0..PREFETCH_AHEAD.min(2 * n_blocks) {
        prefetch(read(i));
    }
    // A tile of rows takes each block's keys transposed, for its many queries to share.
    let wide_scores = qs.len() >= wide::SCORES_ROWS && wide::scores_fit(hd);
    s.transposed.resize(g.kv_heads.len() * slab, 0.0);
    for bi in 0..n_blocks {
        load(bi, &mut s.buf);
        let b = lo + bi;
        if wide_scores {
            wide::transpose(&s.buf, hd, &mut s.transposed);
        }
        for (q, &off) in qs.iter().zip(&s.offsets) {
            let Some(n) = visible(q, b) else { continue };
            let at = off + (b - first_block(q)) * BLOCK_TOKENS;
            if wide_scores {
                // The heads that share a KV head together, each key row read once for several.
                for (g, qg) in q.q.chunks_exact(per_kv * hd).enumerate() {
                    let keys = &s.transposed[g * slab..][..slab];
                    let first = at + g * per_kv * span(q);
                    wide::scores(qg, keys, scale, &mut s.scores[first..], span(q), n);
                }
                continue;
            }
            for (h, qh) in q.q.chunks_exact(hd).enumerate() {
                let at = at + h * span(q);
                let keys = &s.buf[h / per_kv * slab..][..n * hd];
                simd::scores(qh, keys, scale, &mut s.scores[at..at + n]);
            }
        }
    }
    for (q, &off) in qs.iter().zip(&s.offsets) {
        let masked = q.first_key - first_block(q) * BLOCK_TOKENS;
        for row in s.scores[off..off + heads * span(q)].chunks_exact_mut(span(q)) {
            row[..masked].fill(f32::NEG_INFINITY);
            softmax(row);
        }
    }
    out.fill(0.0);
    let wide = wide::accumulates(hd);
    for bi in 0..n_blocks {
        load(n_blocks + bi, &mut s.buf);
        let b = lo + bi;
        for ((q, &off), o) in qs
            .iter()
            .zip(&s.offsets)
            .zip(out.chunks_exact_mut(heads * hd))
        {
            let Some(n) = visible(q, b) else { continue };
            let at = off + (b - first_block(q)) * BLOCK_TOKENS;
            if wide {
                // The heads of each KV head together, so that each value is read once for all.
                for (g, og) in o.chunks_exact_mut(per_kv * hd).enumerate() {
                    let values = &s.buf[g * slab..][..n * hd];
                    let first = at + g * per_kv * span(q);
                    wide::accumulate_heads(&s.scores[first..], span(q), n, values, og);
                }
                continue;
            }
            for (h, oh) in o.chunks_exact_mut(hd).enumerate() {
                let values = &s.buf[h / per_kv * slab..][..n * hd];
                let at = at + h * span(q);
                simd::accumulate(&s.scores[at..at + n], values, oh);
            }
        }
    }
}

/// The two inner loops in 512-bit registers, where the CPU has AVX-512F (found at run time),
/// each giving the same bits as [`simd`]'s.
///
/// - Scores, for tiles of rows and head sizes that are a multiple of 8: a block's keys are
///   transposed once, `[dimension][token]`, so that a query's 16 scores are one register of
///   multiply-adds with no horizontal sums. Its eight registers hold what [`simd::scores`]'s
///   eight lanes hold (dimension `c + i` into sum `i`, in the same order), and they are added
///   in the order that path reduces a key in a group of four, or, for the keys past the last
///   group of four, alone.
/// - Value accumulation, for head sizes that are a multiple of 32: all the heads that share a
///   KV head at once, each value row read once for all of them; each output lane's
///   multiply-adds are [`simd::accumulate`]'s, in the same order.
mod wide {
    /// Rows a tile needs before its blocks' keys are transposed for [`scores`]: the transpose
    /// pays only when several queries share it, so a decode step's single row keeps the AVX2
    /// loop (with the same bits).
    pub(super) const SCORES_ROWS: usize = 4;
    /// Heads whose scores are summed together: eight sums each, and the key row they share.
    const SCORE_HEADS: usize = 3;
    /// Output dimensions per pass: two registers for each head.
    const PASS: usize = 32;
    /// Heads per pass: 16 accumulators and the two value registers.
    const HEADS: usize = 8;

    /// Whether [`accumulate_heads`] runs for heads of `hd` values on this CPU.
    pub(super) fn accumulates(hd: usize) -> bool {
        hd.is_multiple_of(PASS) && avx512()
    }

    fn avx512() -> bool {
        #[cfg(x86_v3)]
        {
            std::arch::is_x86_feature_detected!("avx512f")
        }
        #[cfg(not(x86_v3))]
        false
    }

    /// Whether [`scores`] runs for heads of `hd` values on this CPU.
    pub(super) fn scores_fit(hd: usize) -> bool {
        hd.is_multiple_of(8) && avx512()
    }

    /// A block's keys (`[kv head][token][hd]`, [`crate::kv::BLOCK_TOKENS`] tokens per head)
    /// into `out` as `[kv head][dimension][token]`.
    pub(super) fn transpose(keys: &[f32], hd: usize, out: &mut [f32]) {
        let slab = super::BLOCK_TOKENS * hd;
        for (src, dst) in keys.chunks_exact(slab).zip(out.chunks_exact_mut(slab)) {
            for (t, row) in src.chunks_exact(hd).enumerate() {
                for (d, &k) in row.iter().enumerate() {
                    dst[d * super::BLOCK_TOKENS + t] = k;
                }
            }
        }
    }

    /// For each head `i` of `qs` (heads of `hd` values, back to back):
    /// `scores[i·stride + t] = q_i · keys[t] · scale` for the first `n` keys of a block
    /// transposed by [`transpose`] (`keys`: one KV head's `[dimension][token]`). Only where
    /// [`scores_fit`] says so.
    pub(super) fn scores(
        qs: &[f32],
        keys: &[f32],
        scale: f32,
        scores: &mut [f32],
        stride: usize,
        n: usize,
    ) {
        #[cfg(x86_v3)]
        {
            let hd = keys.len() / super::BLOCK_TOKENS;
            let heads = qs.len() / hd.max(1);
            assert!(
                scores_fit(hd)
                    && keys.len() == hd * super::BLOCK_TOKENS
                    && qs.len() == heads * hd
                    && n <= super::BLOCK_TOKENS
                    && scores.len() >= (heads.max(1) - 1) * stride + n,
                "wide scores: shapes"
            );
            for first in (0..heads).step_by(SCORE_HEADS) {
                let count = (heads - first).min(SCORE_HEADS);
                let q = &qs[first * hd..(first + count) * hd];
                let out = &mut scores[first * stride..];
                // SAFETY: AVX-512F was detected (`scores_fit`); the shapes were checked.
                unsafe { x86::scores(q, keys, scale, out, stride, n) };
            }
        }
        #[cfg(not(x86_v3))]
        {
            let _ = (qs, keys, scale, scores, stride, n);
            unreachable!("wide scores without AVX-512")
        }
    }

    /// For each head `i` of `outs` (heads of `values`' row size, back to back):
    /// `outs[i] += Σ_t p_i[t] · values[t]` over the `n` rows of `values`, where `p_i` is
    /// `scores[i·stride..][..n]`. Only where [`accumulates`] says so.
    pub(super) fn accumulate_heads(
        scores: &[f32],
        stride: usize,
        n: usize,
        values: &[f32],
        outs: &mut [f32],
    ) {
        #[cfg(x86_v3)]
        {
            let hd = values.len() / n.max(1);
            let heads = outs.len() / hd;
            assert!(
                accumulates(hd)
                    && values.len() == n * hd
                    && outs.len() == heads * hd
                    && scores.len() >= (heads - 1) * stride + n,
                "accumulate_heads: shapes"
            );
            for first in (0..heads).step_by(HEADS) {
                let count = (heads - first).min(HEADS);
                // SAFETY: AVX-512F was detected (`accumulates`); the shapes were checked.
                unsafe { x86::heads(scores, stride, first, count, n, values, hd, outs) };
            }
        }
        #[cfg(not(x86_v3))]
        {
            let _ = (scores, stride, n, values, outs);
            unreachable!("accumulate_heads without AVX-512")
        }
    }

    #[cfg(x86_v3)]
    mod x86 {
        use std::arch::x86_64::*;

        use super::{HEADS, PASS, SCORE_HEADS};

        /// Up to [`SCORE_HEADS`] heads of [`super::scores`].
        #[target_feature(enable = "avx2,fma,avx512f")]
        pub(super) unsafe fn scores(
            qs: &[f32],
            keys: &[f32],
            scale: f32,
            out: &mut [f32],
            stride: usize,
            n: usize,
        ) {
            let hd = keys.len() / crate::kv::BLOCK_TOKENS;
            match qs.len() / hd {
                3 => scores_of::<3>(qs, keys, scale, out, stride, n),
                2 => scores_of::<2>(qs, keys, scale, out, stride, n),
                _ => scores_of::<1>(qs, keys, scale, out, stride, n),
            }
            const { assert!(SCORE_HEADS == 3) };
        }

        /// `H` heads' scores: eight sums of 16 keys per head, sum `i` taking dimensions `c + i`.
        #[inline]
        #[target_feature(enable = "avx2,fma,avx512f")]
        fn scores_of<const H: usize>(
            qs: &[f32],
            keys: &[f32],
            scale: f32,
            out: &mut [f32],
            stride: usize,
            n: usize,
        ) {
            const T: usize = crate::kv::BLOCK_TOKENS;
            let hd = keys.len() / T;
            debug_assert!(qs.len() == H * hd && n <= T && hd.is_multiple_of(8));
            debug_assert!(out.len() >= (H - 1) * stride + n);
            // SAFETY: AVX-512F is enabled; every key load reads row `d < hd` of `keys`
            // (`hd × T` values), every query read is inside `qs` (`H × hd`), and each head's
            // store writes the first `n <= T` lanes at `j·stride`, inside `out` (all checked by
            // the caller).
            unsafe {
                let mut sum = [[_mm512_setzero_ps(); 8]; H];
                for c in (0..hd).step_by(8) {
                    for i in 0..8 {
                        let k = _mm512_loadu_ps(keys.as_ptr().add((c + i) * T));
                        for (j, s) in sum.iter_mut().enumerate() {
                            let q = _mm512_set1_ps(*qs.get_unchecked(j * hd + c + i));
                            s[i] = _mm512_fmadd_ps(q, k, s[i]);
                        }
                    }
                }
                let add = |a, b| _mm512_add_ps(a, b);
                let groups = n - n % 4;
                let alone: __mmask16 = ((1u32 << n) - (1u32 << groups)) as __mmask16;
                let stored: __mmask16 = ((1u32 << n) - 1) as __mmask16;
                for (j, s) in sum.iter().enumerate() {
                    // A key in a group of four: ((s0+s1)+(s2+s3)) + ((s4+s5)+(s6+s7)).
                    let grouped = add(
                        add(add(s[0], s[1]), add(s[2], s[3])),
                        add(add(s[4], s[5]), add(s[6], s[7])),
                    );
                    // A key alone: ((s0+s4)+(s1+s5)) + ((s2+s6)+(s3+s7)).
                    let single = add(
                        add(add(s[0], s[4]), add(s[1], s[5])),
                        add(add(s[2], s[6]), add(s[3], s[7])),
                    );
                    let dots = _mm512_mask_blend_ps(alone, grouped, single);
                    let scores = _mm512_mul_ps(dots, _mm512_set1_ps(scale));
                    _mm512_mask_storeu_ps(out.as_mut_ptr().add(j * stride), stored, scores);
                }
            }
        }

        /// Heads `first..first + count` (at most [`HEADS`]) of `accumulate_heads`.
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = "avx2,fma,avx512f")]
        pub(super) unsafe fn heads(
            scores: &[f32],
            stride: usize,
            first: usize,
            count: usize,
            n: usize,
            values: &[f32],
            hd: usize,
            outs: &mut [f32],
        ) {
            match count {
                8 => pass::<8>(scores, stride, first, n, values, hd, outs),
                7 => pass::<7>(scores, stride, first, n, values, hd, outs),
                6 => pass::<6>(scores, stride, first, n, values, hd, outs),
                5 => pass::<5>(scores, stride, first, n, values, hd, outs),
                4 => pass::<4>(scores, stride, first, n, values, hd, outs),
                3 => pass::<3>(scores, stride, first, n, values, hd, outs),
                2 => pass::<2>(scores, stride, first, n, values, hd, outs),
                _ => pass::<1>(scores, stride, first, n, values, hd, outs),
            }
            const { assert!(HEADS == 8) };
        }

        /// `H` heads' outputs, [`PASS`] dimensions at a time, held in registers across the rows.
        #[inline]
        #[target_feature(enable = "avx2,fma,avx512f")]
        fn pass<const H: usize>(
            scores: &[f32],
            stride: usize,
            first: usize,
            n: usize,
            values: &[f32],
            hd: usize,
            outs: &mut [f32],
        ) {
            debug_assert!((first + H - 1) * stride + n <= scores.len());
            debug_assert!(values.len() == n * hd && (first + H) * hd <= outs.len());
            // SAFETY: AVX-512F is enabled; `accumulate_heads` checked that every score read
            // (`(first + H - 1)·stride + n` at most) lies in `scores`, every value read in
            // `values[..n·hd]`, and every output in `outs[..(first + H)·hd]`.
            unsafe {
                for c0 in (0..hd).step_by(PASS) {
                    let out = |j: usize| outs.as_ptr().add((first + j) * hd + c0);
                    let mut acc = [[_mm512_setzero_ps(); 2]; H];
                    for (j, a) in acc.iter_mut().enumerate() {
                        *a = [_mm512_loadu_ps(out(j)), _mm512_loadu_ps(out(j).add(16))];
                    }
                    for t in 0..n {
                        let v = values.as_ptr().add(t * hd + c0);
                        let (v0, v1) = (_mm512_loadu_ps(v), _mm512_loadu_ps(v.add(16)));
                        for (j, a) in acc.iter_mut().enumerate() {
                            let p = _mm512_set1_ps(*scores.get_unchecked((first + j) * stride + t));
                            a[0] = _mm512_fmadd_ps(p, v0, a[0]);
                            a[1] = _mm512_fmadd_ps(p, v1, a[1]);
                        }
                    }
                    for (j, a) in acc.iter().enumerate() {
                        let o = outs.as_mut_ptr().add((first + j) * hd + c0);
                        _mm512_storeu_ps(o, a[0]);
                        _mm512_storeu_ps(o.add(16), a[1]);
                    }
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

/// Portable versions of the two inner loops.
mod portable {
    /// `out[t] = q · keys[t] · scale` for the keys (rows of `q.len()`) in `keys`.
    pub(super) fn scores(q: &[f32], keys: &[f32], scale: f32, out: &mut [f32]) {
        for (o, k) in out.iter_mut().zip(keys.chunks_exact(q.len())) {
            *o = super::dot(q, k) * scale;
        }
    }

    /// `out += Σ_t p[t] · values[t]`.
    pub(super) fn accumulate(p: &[f32], values: &[f32], out: &mut [f32]) {
        for (&p, v) in p.iter().zip(values.chunks_exact(out.len())) {
            for (o, x) in out.iter_mut().zip(v) {
                *o += p * x;
            }
        }
    }
}

#[cfg(not(x86_v3))]
use portable as simd;

/// The inner loops in AVX2, for head sizes that are a multiple of 8 (others take the portable
/// loops). Written by hand because the compiler does not find either shape: four keys' dot
/// products reduced together (one horizontal reduction per four keys, not per key), and the
/// output held in registers across a block's values.
#[cfg(x86_v3)]
mod simd {
    use std::arch::x86_64::*;

    use super::portable;

    /// Output dimensions held in registers per pass.
    const PASS: usize = 64;

    pub(super) fn scores(q: &[f32], keys: &[f32], scale: f32, out: &mut [f32]) {
        let hd = q.len();
        if !hd.is_multiple_of(8) {
            return portable::scores(q, keys, scale, out);
        }
        let n = out.len();
        assert!(keys.len() >= n * hd, "key shape");
        // SAFETY: AVX2 and FMA are compiled in; every load reads inside `q` or `keys[..n·hd]`
        // (checked above) and every store inside `out`.
        unsafe {
            let dot_step = |acc: __m256, t: usize, c: usize| {
                let k = _mm256_loadu_ps(keys.as_ptr().add(t * hd + c));
                _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(c)), k, acc)
            };
            let mut t = 0;
            while t + 8 <= n {
                dots::<8>(q, &keys[t * hd..], scale, &mut out[t..t + 8]);
                t += 8;
            }
            if t + 4 <= n {
                dots::<4>(q, &keys[t * hd..], scale, &mut out[t..t + 4]);
                t += 4;
            }
            for (t, o) in out.iter_mut().enumerate().skip(t) {
                let mut acc = _mm256_setzero_ps();
                for c in (0..hd).step_by(8) {
                    acc = dot_step(acc, t, c);
                }
                let h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
                let h = _mm_hadd_ps(h, h);
                let h = _mm_hadd_ps(h, h);
                *o = _mm_cvtss_f32(h) * scale;
            }
        }
    }

    /// `out[i] = q · keys[i] · scale` for `K` (4 or 8) keys: each summed in its own chain over
    /// the head's chunks, then reduced four at a time, [a0 a1 a2 a3] to one lane each by pairwise
    /// adds and then the two halves. Eight chains keep two FMAs a cycle in flight (latency 4);
    /// a key's sum is the same whichever group it falls in.
    #[inline(always)]
    unsafe fn dots<const K: usize>(q: &[f32], keys: &[f32], scale: f32, out: &mut [f32]) {
        let hd = q.len();
        debug_assert!(keys.len() >= K * hd && out.len() == K && K.is_multiple_of(4));
        // SAFETY: the caller compiles in AVX2 and FMA and passes `K` keys of `hd` values.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); K];
            for c in (0..hd).step_by(8) {
                let qc = _mm256_loadu_ps(q.as_ptr().add(c));
                for (i, a) in acc.iter_mut().enumerate() {
                    let k = _mm256_loadu_ps(keys.as_ptr().add(i * hd + c));
                    *a = _mm256_fmadd_ps(qc, k, *a);
                }
            }
            for (acc, out) in acc.chunks_exact(4).zip(out.chunks_exact_mut(4)) {
                let h01 = _mm256_hadd_ps(acc[0], acc[1]);
                let h23 = _mm256_hadd_ps(acc[2], acc[3]);
                let h = _mm256_hadd_ps(h01, h23);
                let sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
                _mm_storeu_ps(out.as_mut_ptr(), _mm_mul_ps(sums, _mm_set1_ps(scale)));
            }
        }
    }

    pub(super) fn accumulate(p: &[f32], values: &[f32], out: &mut [f32]) {
        let hd = out.len();
        if !hd.is_multiple_of(8) {
            return portable::accumulate(p, values, out);
        }
        let wide = hd - hd % PASS;
        for c0 in (0..wide).step_by(PASS) {
            accumulate_pass::<{ PASS / 8 }>(p, values, hd, c0, out);
        }
        for c0 in (wide..hd).step_by(8) {
            accumulate_pass::<1>(p, values, hd, c0, out);
        }
    }

    /// `out[c0..c0 + 8·R] += Σ_t p[t] · values[t][c0..c0 + 8·R]`, the output held in `R`
    /// registers (a fixed count, so the compiler keeps them out of memory).
    #[inline(always)]
    fn accumulate_pass<const R: usize>(
        p: &[f32],
        values: &[f32],
        hd: usize,
        c0: usize,
        out: &mut [f32],
    ) {
        assert!(c0 + 8 * R <= hd && values.len() >= p.len() * hd);
        // SAFETY: AVX2 and FMA are compiled in; loads read inside `values[..p.len()·hd]` and
        // loads and stores of `out` stay within `c0..c0 + 8·R <= hd = out.len()` (checked).
        unsafe {
            let mut acc = [_mm256_setzero_ps(); R];
            for (i, a) in acc.iter_mut().enumerate() {
                *a = _mm256_loadu_ps(out.as_ptr().add(c0 + 8 * i));
            }
            for (t, &pt) in p.iter().enumerate() {
                let pv = _mm256_set1_ps(pt);
                let v = values.as_ptr().add(t * hd + c0);
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v.add(8 * i)), *a);
                }
            }
            for (i, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.as_mut_ptr().add(c0 + 8 * i), *a);
            }
        }
    }
}

pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for v in x.iter_mut() {
        *v -= max;
    }
    crate::math::exp_in_place(x);
    let sum: f32 = x.iter().sum();
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KvDtype, KvLayout};

    /// A key's score is the same whether it is summed in a group of eight or of four.
    #[test]
    fn a_keys_score_does_not_depend_on_its_group() {
        let (hd, n) = (64, 19);
        let q: Vec<f32> = (0..hd).map(|i| (i as f32 * 0.3).sin()).collect();
        let keys: Vec<f32> = (0..n * hd).map(|i| (i as f32 * 0.011).cos()).collect();
        let mut all = vec![0f32; n];
        simd::scores(&q, &keys, 0.125, &mut all);
        for (t0, chunk) in all.chunks(4).enumerate() {
            let mut four = vec![0f32; chunk.len()];
            simd::scores(&q, &keys[4 * t0 * hd..], 0.125, &mut four);
            assert_eq!(chunk, &four[..], "keys from {}", 4 * t0);
        }
    }

    /// Where the CPU takes the 512-bit accumulation, it gives each head what the per-head
    /// accumulation gives, bit for bit: heads in a pass of eight and a remainder, two passes of
    /// dimensions.
    #[test]
    fn the_wide_accumulation_equals_the_per_head_one() {
        let (hd, n, heads) = (64, 13, 11);
        if !wide::accumulates(hd) {
            eprintln!("no AVX-512F here: the per-head accumulation serves alone");
            return;
        }
        let stride = 16;
        let scores: Vec<f32> = (0..heads * stride)
            .map(|i| (i as f32 * 0.17).sin())
            .collect();
        let values: Vec<f32> = (0..n * hd).map(|i| (i as f32 * 0.023).cos()).collect();
        let start: Vec<f32> = (0..heads * hd).map(|i| (i as f32 * 0.05).sin()).collect();
        let mut together = start.clone();
        wide::accumulate_heads(&scores, stride, n, &values, &mut together);
        let mut alone = start;
        for (h, o) in alone.chunks_exact_mut(hd).enumerate() {
            simd::accumulate(&scores[h * stride..h * stride + n], &values, o);
        }
        assert_eq!(together, alone);
    }

    /// Where the CPU takes the 512-bit scores, a block's keys transposed give each key what
    /// the AVX2 loop gives, bit for bit, however many keys the block shows (groups of four and
    /// keys alone).
    #[test]
    fn the_wide_scores_equal_the_narrow_ones() {
        let hd = 64;
        if !wide::scores_fit(hd) {
            eprintln!("no AVX-512F here: the narrow scores serve alone");
            return;
        }
        let q: Vec<f32> = (0..7 * hd).map(|i| (i as f32 * 0.31).sin() * 3.0).collect();
        let keys: Vec<f32> = (0..BLOCK_TOKENS * hd)
            .map(|i| (i as f32 * 0.013).cos() * 2.0)
            .collect();
        let mut transposed = vec![0f32; keys.len()];
        wide::transpose(&keys, hd, &mut transposed);
        for n in 1..=BLOCK_TOKENS {
            // Seven heads: a pass of three heads, another, and one alone.
            let heads = 7;
            let mut wide = vec![0f32; heads * BLOCK_TOKENS];
            wide::scores(&q, &transposed, 0.125, &mut wide, BLOCK_TOKENS, n);
            for (h, (qh, got)) in q
                .chunks_exact(hd)
                .zip(wide.chunks(BLOCK_TOKENS))
                .enumerate()
            {
                let mut narrow = vec![0f32; n];
                simd::scores(qh, &keys[..n * hd], 0.125, &mut narrow);
                assert_eq!(
                    narrow.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    got[..n].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "{n} keys, head {h}"
                );
            }
        }
    }

    /// Two heads against one KV head, checked against a direct computation over the keys and
    /// values as the pool stores them (rounded to f16, or quantized to int8): head sizes that
    /// take the portable loops (12), one SIMD pass (8, 64) and two passes (72); key counts with
    /// and without a partial block or a group of four.
    #[test]
    fn matches_naive_attention() {
        for dtype in [KvDtype::F16, KvDtype::Q8] {
            for (hd, n) in [(8, 37), (12, 18), (64, 37), (64, 3), (72, 16)] {
                check_against_naive(dtype, hd, n, 0);
            }
        }
    }

    /// A sliding window sees keys `first..n` only: a first key inside a block, at a block's
    /// start, and in the last block.
    #[test]
    fn a_window_sees_only_its_keys() {
        for (hd, n, first) in [(64, 40, 7), (64, 40, 16), (8, 37, 33), (12, 18, 17)] {
            check_against_naive(KvDtype::F16, hd, n, first);
        }
    }

    /// Consecutive positions taken together give each position exactly what it gets alone, with
    /// and without a window (whose first key moves with the position), on both dtypes.
    #[test]
    fn a_tile_of_queries_equals_each_alone() {
        let (hd, n) = (64, 45);
        for dtype in [KvDtype::F16, KvDtype::Q8] {
            for window in [None, Some(20)] {
                let (pool, blocks) = filled_pool(dtype, hd, n);
                let q: Vec<f32> = (0..n * 2 * hd).map(|i| (i as f32 * 0.37).sin()).collect();
                let query = |p: usize| Query {
                    layer: 0,
                    first_key: window.map_or(0, |w: usize| (p + 1).saturating_sub(w)),
                    kv_heads: 0..1,
                    blocks: &blocks,
                    n_keys: p + 1,
                    q: &q[p * 2 * hd..(p + 1) * 2 * hd],
                };
                let tile: Vec<Query<'_>> = (3..n).map(query).collect();
                let mut together = vec![0f32; tile.len() * 2 * hd];
                attend(&pool, &tile, &mut together);
                for (p, got) in (3..n).zip(together.chunks_exact(2 * hd)) {
                    let mut alone = vec![0f32; 2 * hd];
                    attend(&pool, &[query(p)], &mut alone);
                    assert_eq!(got, &alone[..], "{dtype:?} window {window:?} position {p}");
                }
            }
        }
    }

    /// Position `p`'s key (`s` = 0.3) or value (`s` = 0.7) in the test pools.
    fn kv_row(hd: usize, p: usize, s: f32) -> Vec<f32> {
        (0..hd).map(|d| ((p * hd + d) as f32 * s).sin()).collect()
    }

    /// A pool of one layer and KV head holding `n` positions of keys and values.
    fn filled_pool(dtype: KvDtype, hd: usize, n: usize) -> (KvPool, Vec<u32>) {
        let layout = KvLayout {
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: hd,
            dtype,
        };
        let mut pool = KvPool::new(layout, layout.block_bytes() * n.div_ceil(BLOCK_TOKENS));
        let blocks = pool.alloc(n.div_ceil(BLOCK_TOKENS)).expect("blocks");
        for p in 0..n {
            pool.write(&blocks, p, 0, KvKind::Key, 0, &kv_row(hd, p, 0.3));
            pool.write(&blocks, p, 0, KvKind::Value, 0, &kv_row(hd, p, 0.7));
        }
        (pool, blocks)
    }

    fn check_against_naive(dtype: KvDtype, hd: usize, n: usize, first: usize) {
        let (pool, blocks) = filled_pool(dtype, hd, n);
        // Each row as the pool stores it, read back through the dtype's own round trip.
        let stored = |values: &[f32]| {
            let mut row = vec![0u16; dtype.row_bytes(hd) / 2];
            let row: &mut [u8] = bytemuck::cast_slice_mut(&mut row);
            dtype.encode_row(values, row);
            let mut back = vec![0f32; hd];
            dtype.decode_rows(hd, row, &mut back);
            back
        };
        let keys: Vec<Vec<f32>> = (0..n).map(|p| stored(&kv_row(hd, p, 0.3))).collect();
        let values: Vec<Vec<f32>> = (0..n).map(|p| stored(&kv_row(hd, p, 0.7))).collect();
        let q: Vec<f32> = (0..2 * hd).map(|i| (i as f32 * 0.11).cos()).collect();
        let mut out = vec![0f32; 2 * hd];
        attend(
            &pool,
            &[Query {
                layer: 0,
                first_key: first,
                kv_heads: 0..1,
                blocks: &blocks,
                n_keys: n,
                q: &q,
            }],
            &mut out,
        );
        for h in 0..2 {
            let qh = &q[h * hd..(h + 1) * hd];
            let mut s: Vec<f32> = keys[first..]
                .iter()
                .map(|k| (0..hd).map(|d| qh[d] * k[d]).sum::<f32>() / (hd as f32).sqrt())
                .collect();
            softmax(&mut s);
            for d in 0..hd {
                let want: f32 = (first..n).map(|p| s[p - first] * values[p][d]).sum();
                let got = out[h * hd + d];
                assert!(
                    (want - got).abs() < 1e-4,
                    "{dtype:?} hd {hd} keys {first}..{n} head {h} dim {d}: {got} vs {want}"
                );
            }
        }
    }
}
