//! The kernels in 512-bit registers, 16 lanes each, where the CPU has AVX-512F (found at run
//! time): [`super::portable`]'s steps, so its bits.

use std::arch::x86_64::*;

use super::portable::{LN2_HIGH, LN2_LOW, P};
use super::{Accumulate, BLOCK_TOKENS, EXP_KEYS, FLOOR, Scores};

const LANES: usize = 16;

fn check() {
    assert!(
        crate::cpu::has_avx512f(),
        "512-bit attention without AVX-512F"
    );
}

/// Tokens a call of [`scores_of`] takes, by up to [`Z`] registers of lanes: 16 accumulators,
/// four registers of queries and a broadcast key value fit the 32.
const T: usize = 4;
const Z: usize = 4;

pub(super) fn scores(mut s: Scores<'_>) {
    check();
    // The caller checked the shapes (`Scores::check`) and that the lanes are whole registers.
    let regs = s.max.len() / LANES;
    // A single register of lanes (a decode step's heads) takes 16 tokens at once, so that
    // enough sums are in flight; more take four tokens by four registers.
    if regs == 1 {
        // SAFETY: AVX-512F was detected; the caller checked the shapes (`Scores::check`).
        unsafe { scores_of::<BLOCK_TOKENS, 1>(&mut s, 0, 0) };
        return;
    }
    for t in (0..BLOCK_TOKENS).step_by(T) {
        for z in (0..regs).step_by(Z) {
            // SAFETY: as above; `t + T <= 16` and `z + count <= regs`.
            unsafe {
                match (regs - z).min(Z) {
                    4 => scores_of::<T, 4>(&mut s, t, z),
                    3 => scores_of::<T, 3>(&mut s, t, z),
                    2 => scores_of::<T, 2>(&mut s, t, z),
                    _ => scores_of::<T, 1>(&mut s, t, z),
                }
            }
        }
    }
    const { assert!(Z == 4 && BLOCK_TOKENS.is_multiple_of(T)) };
}

/// Tokens `t0..t0 + N` by lane registers `z0..z0 + R`.
///
/// # Safety
///
/// The CPU must have AVX-512F; `s` passed [`Scores::check`], its lanes are whole registers,
/// `t0 + N <= 16` and `(z0 + R)·16 <= lanes`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn scores_of<const N: usize, const R: usize>(s: &mut Scores<'_>, t0: usize, z0: usize) {
    let (hd, lanes) = (s.hd(), s.max.len());
    // SAFETY: every read of `q` is at `d·lanes + (z0 + j)·16 + 16 <= hd·lanes`, of `keys` at
    // `(t0 + i)·hd + d < 16·hd`, every write at `(t0 + i)·lanes + (z0 + j)·16 + 16 <=
    // 16·lanes`, and of `lo`, `hi`, `max` at `(z0 + j)·16 + 16 <= lanes`.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); R]; N];
        for d in 0..hd {
            let q: [__m512; R] = std::array::from_fn(|j| {
                _mm512_loadu_ps(s.q.as_ptr().add(d * lanes + (z0 + j) * LANES))
            });
            for (i, a) in acc.iter_mut().enumerate() {
                let k = _mm512_set1_ps(*s.keys.get_unchecked((t0 + i) * hd + d));
                for (a, &q) in a.iter_mut().zip(&q) {
                    *a = _mm512_fmadd_ps(q, k, *a);
                }
            }
        }
        let scale = _mm512_set1_ps(s.scale);
        for j in 0..R {
            let lane = (z0 + j) * LANES;
            let max = s.max.as_mut_ptr().add(lane);
            let mut m = _mm512_loadu_ps(max);
            for (i, a) in acc.iter().enumerate() {
                let mut v = _mm512_mul_ps(a[j], scale);
                if let Some((lo, hi)) = s.range {
                    let at = _mm512_set1_epi32((s.at + t0 + i) as i32);
                    let lo = _mm512_loadu_si512(lo.as_ptr().add(lane).cast());
                    let hi = _mm512_loadu_si512(hi.as_ptr().add(lane).cast());
                    let seen = _mm512_cmple_epi32_mask(lo, at) & _mm512_cmpgt_epi32_mask(hi, at);
                    v = _mm512_mask_mov_ps(_mm512_set1_ps(f32::NEG_INFINITY), seen, v);
                }
                m = _mm512_max_ps(m, v);
                _mm512_storeu_ps(s.out.as_mut_ptr().add((t0 + i) * lanes + lane), v);
            }
            _mm512_storeu_ps(max, m);
        }
    }
}

pub(super) fn weights(scores: &[f32], max: &[f32], sum: &mut [f32], out: &mut [f32]) {
    check();
    // SAFETY: AVX-512F was detected; the caller checked the shapes (`Isa::weights`), lanes
    // in whole registers.
    unsafe { weights_in(scores, max, sum, out) }
}

/// # Safety
///
/// The CPU must have AVX-512F; the shapes are those `Isa::weights` checks.
#[target_feature(enable = "avx512f")]
unsafe fn weights_in(scores: &[f32], max: &[f32], sum: &mut [f32], out: &mut [f32]) {
    let lanes = max.len();
    let keys = scores.len() / lanes;
    // SAFETY: keys come in whole blocks, so in whole `EXP_KEYS`: reads of `scores` and writes
    // of `out` at `t·lanes + z + 16 <= scores.len()`, of `max` and `sum` at `z + 16 <= lanes`.
    unsafe {
        if lanes == LANES {
            // A decode step's heads: each sum stays in a register across the keys.
            // Keys four at a time (a call's keys are whole blocks), their weights added in order.
            let m = _mm512_loadu_ps(max.as_ptr());
            let mut total = _mm512_loadu_ps(sum.as_ptr());
            for t in (0..keys).step_by(EXP_KEYS) {
                let x: [__m512; EXP_KEYS] = std::array::from_fn(|i| {
                    _mm512_sub_ps(_mm512_loadu_ps(scores.as_ptr().add((t + i) * lanes)), m)
                });
                for (i, e) in exp(x).into_iter().enumerate() {
                    total = _mm512_add_ps(total, e);
                    _mm512_storeu_ps(out.as_mut_ptr().add((t + i) * lanes), e);
                }
            }
            _mm512_storeu_ps(sum.as_mut_ptr(), total);
            return;
        }
        // A tile's: the scores in the order they lie (see the AVX2 kernel).
        for t in 0..keys {
            for z in (0..lanes).step_by(LANES) {
                let s = _mm512_loadu_ps(scores.as_ptr().add(t * lanes + z));
                let [e] = exp([_mm512_sub_ps(s, _mm512_loadu_ps(max.as_ptr().add(z)))]);
                let total = sum.as_mut_ptr().add(z);
                _mm512_storeu_ps(total, _mm512_add_ps(_mm512_loadu_ps(total), e));
                _mm512_storeu_ps(out.as_mut_ptr().add(t * lanes + z), e);
            }
        }
    }
}

/// [`super::portable::exp`] in 16 lanes, of `N` registers at once (see the AVX2 kernel's).
#[inline]
#[target_feature(enable = "avx512f")]
fn exp<const N: usize>(x: [__m512; N]) -> [__m512; N] {
    let live = x.map(|x| _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(FLOOR)));
    let n = x.map(|x| {
        _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            x,
            _mm512_set1_ps(std::f32::consts::LOG2_E),
        ))
    });
    let r: [__m512; N] =
        std::array::from_fn(|i| _mm512_fnmadd_ps(n[i], _mm512_set1_ps(LN2_HIGH), x[i]));
    let r: [__m512; N] =
        std::array::from_fn(|i| _mm512_fnmadd_ps(n[i], _mm512_set1_ps(LN2_LOW), r[i]));
    let mut p = [_mm512_set1_ps(P[0]); N];
    for &c in &P[1..] {
        p = std::array::from_fn(|i| _mm512_fmadd_ps(p[i], r[i], _mm512_set1_ps(c)));
    }
    std::array::from_fn(|i| {
        let y = _mm512_add_ps(
            _mm512_fmadd_ps(p[i], _mm512_mul_ps(r[i], r[i]), r[i]),
            _mm512_set1_ps(1.0),
        );
        _mm512_maskz_mov_ps(live[i], _mm512_scalef_ps(y, n[i]))
    })
}

/// [`exp`] on 16 values, for the tests.
#[cfg(test)]
pub(super) fn exp_lanes(x: [f32; LANES]) -> [f32; LANES] {
    check();
    // SAFETY: AVX-512F was detected; both arrays are 16 f32, as a register is.
    unsafe { std::mem::transmute(exp([std::mem::transmute::<[f32; LANES], __m512>(x)])) }
}

/// Query heads taken together in [`accumulate`]: 24 accumulators, the four value registers and
/// a broadcast weight.
const HEADS: usize = 6;
/// Output dimensions per pass: four registers.
const PASS: usize = 4 * LANES;

/// The output dimensions up to the last whole [`PASS`]; returns where the rest starts.
pub(super) fn accumulate(a: &Accumulate<'_>, acc: &mut [f32]) -> usize {
    check();
    let n_lanes = acc.len() / a.hd;
    for first in (0..n_lanes).step_by(HEADS) {
        // SAFETY: AVX-512F was detected; the caller checked the shapes, and `first + count
        // <= n_lanes`.
        unsafe {
            match (n_lanes - first).min(HEADS) {
                6 => heads::<6>(a, first, acc),
                5 => heads::<5>(a, first, acc),
                4 => heads::<4>(a, first, acc),
                3 => heads::<3>(a, first, acc),
                2 => heads::<2>(a, first, acc),
                _ => heads::<1>(a, first, acc),
            }
        }
    }
    const { assert!(HEADS == 6) };
    a.hd - a.hd % PASS
}

/// Lanes `first..first + H`, [`PASS`] dimensions at a time held in registers across the keys.
///
/// # Safety
///
/// The CPU must have AVX-512F; the shapes are those `Isa::accumulate` checks and `(first +
/// H)·hd <= acc.len()`.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn heads<const H: usize>(a: &Accumulate<'_>, first: usize, acc: &mut [f32]) {
    let (hd, lanes) = (a.hd, a.lanes);
    // SAFETY: reads of `values` at `t·hd + c0 + 16k + 16 <= keys·hd`, of `weights` at
    // `t·lanes + first + h < keys·lanes`, and accesses of `acc` at `(first + h)·hd + c0 + 16k
    // + 16 <= acc.len()`.
    unsafe {
        for c0 in (0..hd - hd % PASS).step_by(PASS) {
            let at = |h: usize, k: usize| (first + h) * hd + c0 + k * LANES;
            let mut sums: [[__m512; 4]; H] = std::array::from_fn(|h| {
                std::array::from_fn(|k| _mm512_loadu_ps(acc.as_ptr().add(at(h, k))))
            });
            for t in 0..a.keys() {
                let row = a.values.as_ptr().add(t * hd + c0);
                let v: [__m512; 4] = std::array::from_fn(|k| _mm512_loadu_ps(row.add(k * LANES)));
                for (h, s) in sums.iter_mut().enumerate() {
                    let w = _mm512_set1_ps(*a.weights.get_unchecked(t * lanes + first + h));
                    for k in 0..4 {
                        s[k] = _mm512_fmadd_ps(v[k], w, s[k]);
                    }
                }
            }
            for (h, s) in sums.iter().enumerate() {
                for (k, &s) in s.iter().enumerate() {
                    _mm512_storeu_ps(acc.as_mut_ptr().add(at(h, k)), s);
                }
            }
        }
    }
}
