//! The two inner loops in 512-bit registers, where the CPU has AVX-512F (found at run time),
//! each giving the same bits as the AVX2 loops' ([`super::narrow`]).
//!
//! - Scores, for tiles of rows and head sizes that are a multiple of 8: a block's keys are
//!   transposed once, `[dimension][token]`, so that a query's 16 scores are one register of
//!   multiply-adds with no horizontal sums. Its eight registers hold what [`super::narrow::scores`]'s
//!   eight lanes hold (dimension `c + i` into sum `i`, in the same order), and they are added
//!   in the order that path reduces a key in a group of four, or, for the keys past the last
//!   group of four, alone.
//! - Value accumulation, for head sizes that are a multiple of 32: all the heads that share a
//!   KV head at once, each value row read once for all of them; each output lane's
//!   multiply-adds are [`super::narrow::accumulate`]'s, in the same order.

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
    hd.is_multiple_of(PASS) && crate::cpu::has_avx512f()
}

/// Whether [`scores`] runs for heads of `hd` values on this CPU.
pub(super) fn scores_fit(hd: usize) -> bool {
    hd.is_multiple_of(8) && crate::cpu::has_avx512f()
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
    ///
    /// # Safety
    ///
    /// The CPU must have AVX-512F ([`crate::cpu::has_avx512f`]); the shapes are those
    /// [`super::scores`] checks before it calls this.
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
                // A key alone: ((s0+s4)+(s1+s5)) + ((s2+s6)+(s3+s7)), only in a block's
                // last keys.
                let dots = if alone == 0 {
                    grouped
                } else {
                    let single = add(
                        add(add(s[0], s[4]), add(s[1], s[5])),
                        add(add(s[2], s[6]), add(s[3], s[7])),
                    );
                    _mm512_mask_blend_ps(alone, grouped, single)
                };
                let scores = _mm512_mul_ps(dots, _mm512_set1_ps(scale));
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(j * stride), stored, scores);
            }
        }
    }

    /// Heads `first..first + count` (at most [`HEADS`]) of `accumulate_heads`.
    ///
    /// # Safety
    ///
    /// The CPU must have AVX-512F ([`crate::cpu::has_avx512f`]); the shapes are those
    /// [`super::accumulate_heads`] checks before it calls this.
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
