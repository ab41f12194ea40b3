//! The kernels in AVX2, 8 lanes a register (the x86-64-v3 build guarantees AVX2 and FMA):
//! [`super::portable`]'s steps, so its bits. Shaped for the 16 registers: four tokens by two
//! registers of lanes for the scores, six query heads by two registers of dimensions for the
//! values (a lone head by eight).

use std::arch::x86_64::*;
use std::ops::Range;

use super::portable::{LN2_HIGH, LN2_LOW, P};
use super::{Accumulate, BLOCK_TOKENS, EXP_KEYS, FLOOR, Scores};

const LANES: usize = 8;
/// Tokens a call of [`scores_of`] takes, by up to [`Z`] registers of lanes.
const T: usize = 4;
const Z: usize = 2;

pub(super) fn scores(mut s: Scores<'_>) {
    // The caller checked the shapes (`Scores::check`) and that the lanes are whole registers.
    let regs = s.max.len() / LANES;
    // A single register of lanes (a decode step's heads) takes eight tokens at once, so that
    // enough sums are in flight.
    if regs == 1 {
        for t in (0..BLOCK_TOKENS).step_by(8) {
            // SAFETY: AVX2 and FMA are compiled in; the caller checked the shapes
            // (`Scores::check`), and `t + 8 <= 16`.
            unsafe { scores_of::<8, 1>(&mut s, t, 0) };
        }
        return;
    }
    for t in (0..BLOCK_TOKENS).step_by(T) {
        for z in (0..regs).step_by(Z) {
            // SAFETY: as above; `t + T <= 16` and `z + count <= regs`.
            unsafe {
                match (regs - z).min(Z) {
                    2 => scores_of::<T, 2>(&mut s, t, z),
                    _ => scores_of::<T, 1>(&mut s, t, z),
                }
            }
        }
    }
    const { assert!(Z == 2 && BLOCK_TOKENS.is_multiple_of(T)) };
}

/// Tokens `t0..t0 + N` by lane registers `z0..z0 + R`.
///
/// # Safety
///
/// AVX2 and FMA must be compiled in; `s` passed [`Scores::check`], its lanes are whole
/// registers, `t0 + N <= 16` and `(z0 + R)·8 <= lanes`.
#[inline(always)]
unsafe fn scores_of<const N: usize, const R: usize>(s: &mut Scores<'_>, t0: usize, z0: usize) {
    let (hd, lanes) = (s.hd(), s.max.len());
    // SAFETY: every read of `q` is at `d·lanes + (z0 + j)·8 + 8 <= hd·lanes`, of `keys` at
    // `(t0 + i)·hd + d < 16·hd`, every write at `(t0 + i)·lanes + (z0 + j)·8 + 8 <= 16·lanes`,
    // and of `lo`, `hi`, `max` at `(z0 + j)·8 + 8 <= lanes`.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); R]; N];
        for d in 0..hd {
            let q: [__m256; R] = std::array::from_fn(|j| {
                _mm256_loadu_ps(s.q.as_ptr().add(d * lanes + (z0 + j) * LANES))
            });
            for (i, a) in acc.iter_mut().enumerate() {
                let k = _mm256_set1_ps(*s.keys.get_unchecked((t0 + i) * hd + d));
                for (a, &q) in a.iter_mut().zip(&q) {
                    *a = _mm256_fmadd_ps(q, k, *a);
                }
            }
        }
        let scale = _mm256_set1_ps(s.scale);
        for j in 0..R {
            let lane = (z0 + j) * LANES;
            let max = s.max.as_mut_ptr().add(lane);
            let mut m = _mm256_loadu_ps(max);
            for (i, a) in acc.iter().enumerate() {
                let mut v = _mm256_mul_ps(a[j], scale);
                if let Some((lo, hi)) = s.range {
                    let at = _mm256_set1_epi32((s.at + t0 + i) as i32);
                    let lo = _mm256_loadu_si256(lo.as_ptr().add(lane).cast());
                    let hi = _mm256_loadu_si256(hi.as_ptr().add(lane).cast());
                    // `lo <= at && at < hi`, as `!(lo > at) && hi > at`.
                    let seen =
                        _mm256_andnot_si256(_mm256_cmpgt_epi32(lo, at), _mm256_cmpgt_epi32(hi, at));
                    let neg = _mm256_set1_ps(f32::NEG_INFINITY);
                    v = _mm256_blendv_ps(neg, v, _mm256_castsi256_ps(seen));
                }
                m = _mm256_max_ps(m, v);
                _mm256_storeu_ps(s.out.as_mut_ptr().add((t0 + i) * lanes + lane), v);
            }
            _mm256_storeu_ps(max, m);
        }
    }
}

pub(super) fn weights(scores: &[f32], max: &[f32], sum: &mut [f32], out: &mut [f32]) {
    let lanes = max.len();
    let keys = scores.len() / lanes;
    // SAFETY: AVX2 and FMA are compiled in; the caller checked the shapes (`Isa::weights`,
    // lanes in whole registers, keys in whole blocks, so in whole `EXP_KEYS`): reads of
    // `scores` and writes of `out` at `t·lanes + z + 8 <= scores.len()`, of `max` and `sum` at
    // `z + 8 <= lanes`.
    unsafe {
        if lanes == LANES {
            // A decode step's heads: each sum stays in a register across the keys.
            // Keys four at a time (a call's keys are whole blocks), their weights added in order.
            let m = _mm256_loadu_ps(max.as_ptr());
            let mut total = _mm256_loadu_ps(sum.as_ptr());
            for t in (0..keys).step_by(EXP_KEYS) {
                let x: [__m256; EXP_KEYS] = std::array::from_fn(|i| {
                    _mm256_sub_ps(_mm256_loadu_ps(scores.as_ptr().add((t + i) * lanes)), m)
                });
                for (i, e) in exp(x).into_iter().enumerate() {
                    total = _mm256_add_ps(total, e);
                    _mm256_storeu_ps(out.as_mut_ptr().add((t + i) * lanes), e);
                }
            }
            _mm256_storeu_ps(sum.as_mut_ptr(), total);
            return;
        }
        // A tile's: the scores in the order they lie, a key's lanes after another's, so that
        // the reads run on through memory (a long prompt's scores are out of the nearer
        // caches); each lane's sum is still taken in key order.
        for t in 0..keys {
            for z in (0..lanes).step_by(LANES) {
                let s = _mm256_loadu_ps(scores.as_ptr().add(t * lanes + z));
                let [e] = exp([_mm256_sub_ps(s, _mm256_loadu_ps(max.as_ptr().add(z)))]);
                let total = sum.as_mut_ptr().add(z);
                _mm256_storeu_ps(total, _mm256_add_ps(_mm256_loadu_ps(total), e));
                _mm256_storeu_ps(out.as_mut_ptr().add(t * lanes + z), e);
            }
        }
    }
}

/// [`super::portable::exp`] in 8 lanes, of `N` registers at once: each step is taken for all
/// of them before the next, so that one register's long chain of dependent steps overlaps the
/// others' (out of order, the core finds too few of them in a loop of one register a pass).
#[inline(always)]
fn exp<const N: usize>(x: [__m256; N]) -> [__m256; N] {
    // SAFETY: AVX2 and FMA are compiled in; register arithmetic only.
    unsafe {
        let live = x.map(|x| _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(FLOOR)));
        let n = x.map(|x| {
            _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
                x,
                _mm256_set1_ps(std::f32::consts::LOG2_E),
            ))
        });
        let r: [__m256; N] =
            std::array::from_fn(|i| _mm256_fnmadd_ps(n[i], _mm256_set1_ps(LN2_HIGH), x[i]));
        let r: [__m256; N] =
            std::array::from_fn(|i| _mm256_fnmadd_ps(n[i], _mm256_set1_ps(LN2_LOW), r[i]));
        let mut p = [_mm256_set1_ps(P[0]); N];
        for &c in &P[1..] {
            p = std::array::from_fn(|i| _mm256_fmadd_ps(p[i], r[i], _mm256_set1_ps(c)));
        }
        std::array::from_fn(|i| {
            let y = _mm256_add_ps(
                _mm256_fmadd_ps(p[i], _mm256_mul_ps(r[i], r[i]), r[i]),
                _mm256_set1_ps(1.0),
            );
            // 2^n from its exponent bits (n >= -126 in every live lane).
            let biased = _mm256_add_epi32(_mm256_cvtps_epi32(n[i]), _mm256_set1_epi32(127));
            let scale = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(biased));
            _mm256_and_ps(live[i], _mm256_mul_ps(y, scale))
        })
    }
}

/// [`exp`] on 8 values, for the tests.
#[cfg(test)]
pub(super) fn exp_lanes(x: [f32; LANES]) -> [f32; LANES] {
    // SAFETY: both arrays are 8 f32, as a register is.
    unsafe { std::mem::transmute(exp([std::mem::transmute::<[f32; LANES], __m256>(x)])) }
}

/// Query heads taken together in [`accumulate`]: 12 accumulators, the two value registers and
/// a broadcast weight.
const HEADS: usize = 6;
/// Output dimensions per pass: two registers.
const PASS: usize = 2 * LANES;
/// Registers of dimensions a pass takes for a lone head (a decode step's seventh), so that it
/// too keeps eight chains of multiply-adds in flight rather than two.
const WIDE: usize = 8;

/// The output dimensions up to the last whole [`PASS`]; returns where the rest starts.
pub(super) fn accumulate(a: &Accumulate<'_>, acc: &mut [f32]) -> usize {
    let n_lanes = acc.len() / a.hd;
    let done = a.hd - a.hd % PASS;
    let wide = a.hd - a.hd % (WIDE * LANES);
    for first in (0..n_lanes).step_by(HEADS) {
        // SAFETY: AVX2 and FMA are compiled in; the caller checked the shapes, `first + count
        // <= n_lanes`, and the ranges of dimensions are whole passes within `done`.
        unsafe {
            match (n_lanes - first).min(HEADS) {
                6 => heads::<6, 2>(a, first, acc, 0..done),
                5 => heads::<5, 2>(a, first, acc, 0..done),
                4 => heads::<4, 2>(a, first, acc, 0..done),
                3 => heads::<3, 2>(a, first, acc, 0..done),
                2 => heads::<2, 2>(a, first, acc, 0..done),
                _ => {
                    heads::<1, WIDE>(a, first, acc, 0..wide);
                    heads::<1, 2>(a, first, acc, wide..done);
                }
            }
        }
    }
    const { assert!(HEADS == 6 && (WIDE * LANES).is_multiple_of(PASS)) };
    done
}

/// Lanes `first..first + H`, `R` registers of dimensions at a time held across the keys, for
/// the dimensions `dims`.
///
/// # Safety
///
/// AVX2 and FMA must be compiled in; the shapes are those `Isa::accumulate` checks, `(first +
/// H)·hd <= acc.len()`, and `dims` is whole passes of `R` registers within `0..hd`.
#[inline(always)]
unsafe fn heads<const H: usize, const R: usize>(
    a: &Accumulate<'_>,
    first: usize,
    acc: &mut [f32],
    dims: Range<usize>,
) {
    let (hd, lanes) = (a.hd, a.lanes);
    // SAFETY: reads of `values` at `t·hd + c0 + 8k + 8 <= keys·hd`, of `weights` at `t·lanes
    // + first + h < keys·lanes`, and accesses of `acc` at `(first + h)·hd + c0 + 8k + 8 <=
    // acc.len()`.
    unsafe {
        for c0 in dims.step_by(R * LANES) {
            let at = |h: usize, k: usize| (first + h) * hd + c0 + k * LANES;
            let mut sums: [[__m256; R]; H] = std::array::from_fn(|h| {
                std::array::from_fn(|k| _mm256_loadu_ps(acc.as_ptr().add(at(h, k))))
            });
            for t in 0..a.keys() {
                let row = a.values.as_ptr().add(t * hd + c0);
                let v: [__m256; R] = std::array::from_fn(|k| _mm256_loadu_ps(row.add(k * LANES)));
                for (h, s) in sums.iter_mut().enumerate() {
                    let w = _mm256_set1_ps(*a.weights.get_unchecked(t * lanes + first + h));
                    for (s, &v) in s.iter_mut().zip(&v) {
                        *s = _mm256_fmadd_ps(v, w, *s);
                    }
                }
            }
            for (h, s) in sums.iter().enumerate() {
                for (k, &s) in s.iter().enumerate() {
                    _mm256_storeu_ps(acc.as_mut_ptr().add(at(h, k)), s);
                }
            }
        }
    }
}
