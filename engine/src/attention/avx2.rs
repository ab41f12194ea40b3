//! The inner loops in AVX2, for head sizes that are a multiple of 8 (others take the portable
//! loops). Written by hand because the compiler does not find either shape: four keys' dot
//! products reduced together (one horizontal reduction per four keys, not per key), and the
//! output held in registers across a block's values. The heads that share a KV head are taken
//! [`HEADS`] at a time, each key or value register loaded once for all of them; each head's
//! lanes take the same multiply-adds in the same order as alone.

use std::arch::x86_64::*;

use super::portable;

/// Output dimensions held in registers per pass.
const PASS: usize = 64;
/// Heads taken together: their 12 sums (4 keys, or 4 registers of output each), their 3 query
/// registers or weights and the shared key or value register fill the 16 registers.
const HEADS: usize = 3;
/// Output dimensions per pass of [`accumulate_heads`].
const HEADS_PASS: usize = 32;

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
            _mm_storeu_ps(out.as_mut_ptr(), reduce4(acc, scale));
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

/// [`scores`] for each head of `qs` (heads of `keys`' row size, back to back) against the `n`
/// rows of `keys`: head `h`'s scores at `out[h·stride..][..n]`, the same bits as
/// [`scores`] gives each head alone (keys in groups of four reduce alike; the keys past the
/// last group of four are taken by [`scores`] itself).
pub(super) fn scores_heads(
    qs: &[f32],
    keys: &[f32],
    scale: f32,
    out: &mut [f32],
    stride: usize,
    n: usize,
) {
    if n == 0 {
        return;
    }
    let hd = keys.len() / n;
    let heads = qs.len() / hd.max(1);
    if !hd.is_multiple_of(8) {
        return portable::scores_heads(qs, keys, scale, out, stride, n);
    }
    assert!(
        keys.len() == n * hd
            && qs.len() == heads * hd
            && out.len() >= heads.saturating_sub(1) * stride + n,
        "scores_heads: shapes"
    );
    let groups = n - n % 4;
    for first in (0..heads).step_by(HEADS) {
        let count = (heads - first).min(HEADS);
        let q = &qs[first * hd..(first + count) * hd];
        let o = &mut out[first * stride..];
        for t in (0..groups).step_by(4) {
            let k = &keys[t * hd..(t + 4) * hd];
            // SAFETY: AVX2 and FMA are compiled in; `q` holds `count` heads, `k` four keys and
            // `o` each head's four scores at `j·stride + t` (the shapes checked above).
            unsafe {
                match count {
                    3 => dots_heads::<3>(q, k, scale, &mut o[t..], stride),
                    2 => dots_heads::<2>(q, k, scale, &mut o[t..], stride),
                    _ => dots_heads::<1>(q, k, scale, &mut o[t..], stride),
                }
            }
        }
    }
    if groups < n {
        for (h, q) in qs.chunks_exact(hd).enumerate() {
            let at = h * stride;
            scores(
                q,
                &keys[groups * hd..],
                scale,
                &mut out[at + groups..at + n],
            );
        }
    }
}

/// Four keys' scores for `H` heads, each key's sum in its own chain as in [`dots`], reduced
/// by the same [`reduce4`].
///
/// # Safety
///
/// The CPU must have AVX2 and FMA; `qs` holds `H` heads of `hd` values, `keys` four keys of
/// `hd` and `out` at least `(H - 1)·stride + 4` values.
#[inline(always)]
unsafe fn dots_heads<const H: usize>(
    qs: &[f32],
    keys: &[f32],
    scale: f32,
    out: &mut [f32],
    stride: usize,
) {
    let hd = keys.len() / 4;
    debug_assert!(qs.len() == H * hd && out.len() >= (H - 1) * stride + 4);
    // SAFETY: the caller compiles in AVX2 and FMA and passes these shapes.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 4]; H];
        for c in (0..hd).step_by(8) {
            let q: [__m256; H] =
                std::array::from_fn(|j| _mm256_loadu_ps(qs.as_ptr().add(j * hd + c)));
            for i in 0..4 {
                let k = _mm256_loadu_ps(keys.as_ptr().add(i * hd + c));
                for (a, q) in acc.iter_mut().zip(&q) {
                    a[i] = _mm256_fmadd_ps(*q, k, a[i]);
                }
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            _mm_storeu_ps(out.as_mut_ptr().add(j * stride), reduce4(acc, scale));
        }
    }
}

/// Four keys' sums (one register of eight lanes each) as four scores: [a0 a1 a2 a3] to one lane
/// each by pairwise adds and then the two halves, times `scale`. Every score of a key in a group
/// of four comes from here, which is what makes it the same in [`dots`] and [`dots_heads`].
///
/// # Safety
///
/// The CPU must have AVX2 (the x86-64-v3 build guarantees it); `acc` holds four registers.
#[inline(always)]
unsafe fn reduce4(acc: &[__m256], scale: f32) -> __m128 {
    debug_assert_eq!(acc.len(), 4);
    // SAFETY: AVX2 is compiled in; the four registers are read by index within `acc`.
    unsafe {
        let h01 = _mm256_hadd_ps(acc[0], acc[1]);
        let h23 = _mm256_hadd_ps(acc[2], acc[3]);
        let h = _mm256_hadd_ps(h01, h23);
        let sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        _mm_mul_ps(sums, _mm_set1_ps(scale))
    }
}

/// [`accumulate`] for each head of `outs` (heads of `values`' row size, back to back), head
/// `h` weighting the `n` rows of `values` by `scores[h·stride..][..n]`: the same bits as each
/// head alone, each output lane taking the same multiply-adds in the same order.
pub(super) fn accumulate_heads(
    scores: &[f32],
    stride: usize,
    n: usize,
    values: &[f32],
    outs: &mut [f32],
) {
    if n == 0 {
        return;
    }
    let hd = values.len() / n;
    if !hd.is_multiple_of(8) {
        return portable::accumulate_heads(scores, stride, n, values, outs);
    }
    if !hd.is_multiple_of(HEADS_PASS) {
        for (h, o) in outs.chunks_exact_mut(hd).enumerate() {
            accumulate(&scores[h * stride..][..n], values, o);
        }
        return;
    }
    let heads = outs.len() / hd;
    assert!(
        values.len() == n * hd
            && outs.len() == heads * hd
            && scores.len() >= (heads - 1) * stride + n,
        "accumulate_heads: shapes"
    );
    for first in (0..heads).step_by(HEADS) {
        let count = (heads - first).min(HEADS);
        let p = &scores[first * stride..];
        let o = &mut outs[first * hd..(first + count) * hd];
        for c0 in (0..hd).step_by(HEADS_PASS) {
            // SAFETY: AVX2 and FMA are compiled in; the shapes were checked above.
            unsafe {
                match count {
                    3 => heads_pass::<3>(p, stride, n, values, c0, o),
                    2 => heads_pass::<2>(p, stride, n, values, c0, o),
                    _ => heads_pass::<1>(p, stride, n, values, c0, o),
                }
            }
        }
    }
}

/// `H` heads' outputs `c0..c0 + HEADS_PASS`, held in registers across the `n` rows.
///
/// # Safety
///
/// The CPU must have AVX2 and FMA; `p` holds each head's `n` weights `stride` apart, `values`
/// `n` rows of `hd = outs.len() / H` values, and `c0 + HEADS_PASS <= hd`.
#[inline(always)]
unsafe fn heads_pass<const H: usize>(
    p: &[f32],
    stride: usize,
    n: usize,
    values: &[f32],
    c0: usize,
    outs: &mut [f32],
) {
    const R: usize = HEADS_PASS / 8;
    let hd = outs.len() / H;
    debug_assert!(
        c0 + HEADS_PASS <= hd && values.len() >= n * hd && p.len() >= (H - 1) * stride + n
    );
    // SAFETY: the caller compiles in AVX2 and FMA and passes these shapes.
    unsafe {
        let out = |j: usize| outs.as_ptr().add(j * hd + c0);
        let mut acc: [[__m256; R]; H] =
            std::array::from_fn(|j| std::array::from_fn(|i| _mm256_loadu_ps(out(j).add(8 * i))));
        for t in 0..n {
            let w: [__m256; H] =
                std::array::from_fn(|j| _mm256_set1_ps(*p.get_unchecked(j * stride + t)));
            let v = values.as_ptr().add(t * hd + c0);
            for i in 0..R {
                let x = _mm256_loadu_ps(v.add(8 * i));
                for (a, w) in acc.iter_mut().zip(&w) {
                    a[i] = _mm256_fmadd_ps(*w, x, a[i]);
                }
            }
        }
        for (j, a) in acc.iter().enumerate() {
            let o = outs.as_mut_ptr().add(j * hd + c0);
            for (i, a) in a.iter().enumerate() {
                _mm256_storeu_ps(o.add(8 * i), *a);
            }
        }
    }
}
