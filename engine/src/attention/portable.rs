//! The kernels in plain loops: the arithmetic every other set reproduces bit for bit (each
//! multiply-add fused, as `mul_add` is and the vector FMAs are).

use std::ops::Range;

use super::{Accumulate, BLOCK_TOKENS, FLOOR, Scores};

/// ln 2 in two parts, the first exact in few bits, so that `x − n·ln2` is exact for `|n| <= 127`.
pub(super) const LN2_HIGH: f32 = 0.693_359_4;
pub(super) const LN2_LOW: f32 = -2.121_944_4e-4;
/// Cephes' `expf` polynomial for `(e^r − 1 − r) / r²`, highest degree first.
pub(super) const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^x` for the weights (`x <= 0`), to about an ulp: 0 at and below [`FLOOR`] (so for −∞).
/// Cephes' `expf`: `x = n·ln2 + r`, a degree-5 polynomial in `r`, scaled by `2^n` (exact: the
/// result is a normal f32 above the floor).
pub(super) fn exp(x: f32) -> f32 {
    if x.is_nan() || x <= FLOOR {
        return 0.0;
    }
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (-n).mul_add(LN2_LOW, (-n).mul_add(LN2_HIGH, x));
    let p = P[1..].iter().fold(P[0], |p, &c| p.mul_add(r, c));
    let y = p.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

pub(super) fn scores(s: Scores<'_>) {
    let (hd, lanes) = (s.hd(), s.max.len());
    for t in 0..BLOCK_TOKENS {
        let key = &s.keys[t * hd..][..hd];
        for lane in 0..lanes {
            let dot = key
                .iter()
                .enumerate()
                .fold(0f32, |acc, (d, &k)| s.q[d * lanes + lane].mul_add(k, acc));
            let v = if s.sees(lane, s.at + t) {
                dot * s.scale
            } else {
                f32::NEG_INFINITY
            };
            s.out[t * lanes + lane] = v;
            s.max[lane] = s.max[lane].max(v);
        }
    }
}

pub(super) fn weights(scores: &[f32], max: &[f32], sum: &mut [f32], out: &mut [f32]) {
    for (row, o) in scores
        .chunks_exact(max.len())
        .zip(out.chunks_exact_mut(max.len()))
    {
        for (((&s, &m), total), o) in row.iter().zip(max).zip(sum.iter_mut()).zip(o) {
            *o = exp(s - m);
            *total += *o;
        }
    }
}

/// [`super::Isa::accumulate`] for the output dimensions `dims`.
pub(super) fn accumulate(a: &Accumulate<'_>, dims: Range<usize>, acc: &mut [f32]) {
    if dims.is_empty() {
        return;
    }
    for (lane, acc) in acc.chunks_exact_mut(a.hd).enumerate() {
        for t in 0..a.keys() {
            let w = a.weights[t * a.lanes + lane];
            let v = &a.values[t * a.hd..][..a.hd];
            for c in dims.clone() {
                acc[c] = v[c].mul_add(w, acc[c]);
            }
        }
    }
}
