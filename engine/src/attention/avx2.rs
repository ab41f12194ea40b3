//! The inner loops in AVX2, for head sizes that are a multiple of 8 (others take the portable
//! loops). Written by hand because the compiler does not find either shape: four keys' dot
//! products reduced together (one horizontal reduction per four keys, not per key), and the
//! output held in registers across a block's values.

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
///
/// # Safety
///
/// The CPU must have AVX2 and FMA (the x86-64-v3 build guarantees them); `keys` holds `K`
/// keys of `q.len()` values and `out` `K` values.
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
