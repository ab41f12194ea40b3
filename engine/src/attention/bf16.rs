//! Attention in BF16 dot products (`vdpbf16ps`: 32 multiply-adds an instruction, twice an f32
//! FMA's), where the CPU has AVX-512 BF16 ([`crate::cpu`]). Queries, keys, values and the
//! softmax's weights are rounded to bf16 (8 bits of mantissa, as the instruction takes them);
//! every sum is kept in f32.
//!
//! One query head's arithmetic, whatever else the call holds:
//! - a score is one chain of the instruction's steps over the head's dimension pairs, times the
//!   scale; a key outside the query's range scores −∞;
//! - its weights are `e^(s − max)` ([`exp`]: 0 for −∞, and below [`FLOOR`]) over every key the
//!   call reads, and their sum one chain of adds in key order;
//! - each output dimension is one chain of the instruction's steps over pairs of keys (at even
//!   positions) of `bf16(weight) · bf16(value)`, times `1 / sum` at the end.
//!
//! A key outside the query's range adds exactly 0 to each chain (its weight is 0, and `x + 0`
//! is `x`), so the keys a call reads beyond those a query sees alone leave its bits as they
//! are: a prompt row in a tile and the same position's decode step agree.
//!
//! Lanes hold query heads for the scores, 16 a register against each key's broadcast pair of
//! dimensions, so no key is transposed and the softmax runs down the lanes; lanes hold output
//! dimensions for the values, against each query head's broadcast pair of weights.

use super::{BLOCK_TOKENS, Blocks, Query, VALUE_RUN};

/// Lanes of a 512-bit register of f32 (or of bf16 pairs).
const LANES: usize = 16;
/// Weights of scores at or below `max − 87` are 0: `e^-87` is the last power of e that is a
/// normal f32, so no sum meets a subnormal.
const FLOOR: f32 = -87.0;

/// Whether [`attend`] runs for heads of `hd` values on this CPU.
pub(super) fn runs(hd: usize) -> bool {
    hd.is_multiple_of(64) && crate::cpu::has_avx512_bf16()
}

/// Per-thread buffers, `g` a KV head of the call, `lane` a query head of the call (`row ·
/// heads per KV head + head`, padded to whole registers), a pair two bf16 in one `u32`.
#[derive(Default)]
pub(super) struct Buffers {
    /// `[g][dimension pair][lane]`.
    q: Vec<u32>,
    /// Each lane's visible keys, `lo..hi` (padding lanes see every key, of zero queries).
    lo: Vec<i32>,
    hi: Vec<i32>,
    /// `[g][key][lane]`, the keys from the first block read.
    scores: Vec<f32>,
    /// `[g][lane]`: each lane's largest score.
    max: Vec<f32>,
    /// `[g][lane]`: the sum of each lane's weights.
    sum: Vec<f32>,
    /// One block's keys, `[g][token][dimension pair]`.
    keys: Vec<u32>,
    /// A run of blocks' values, `[g][key pair][dimension]`: keys `2j` and `2j + 1` in a pair.
    values: Vec<u32>,
    /// A run of blocks' weights for one KV head, `[key pair][lane]`.
    weights: Vec<u32>,
    /// `[g][lane][dimension]`: each lane's weighted sum of values so far.
    acc: Vec<f32>,
}

/// Without an x86-64-v3 build no CPU is taken to have AVX-512 BF16 ([`crate::cpu`]), so
/// [`runs`] is false and this is never called.
#[cfg(not(x86_v3))]
pub(super) fn attend(
    _: &Blocks<'_>,
    _: &[Query<'_>],
    _: &mut [f32],
    _: &mut Buffers,
    _: &mut Vec<f32>,
) {
    unreachable!("bf16 attention without AVX-512 BF16")
}

/// [`super::attend`] in this module's arithmetic. `buf` is the f32 rows [`Blocks::load`] fills.
#[cfg(x86_v3)]
pub(super) fn attend(
    kv: &Blocks<'_>,
    qs: &[Query<'_>],
    out: &mut [f32],
    b: &mut Buffers,
    buf: &mut Vec<f32>,
) {
    let hd = kv.pool.layout().head_dim;
    let n_kv = kv.kv_heads.len();
    let heads = qs[0].q.len() / hd;
    let per_kv = heads / n_kv;
    let (pairs, slab) = (hd / 2, BLOCK_TOKENS * hd);
    let n_lanes = qs.len() * per_kv;
    let lanes = n_lanes.next_multiple_of(LANES);
    let n_keys = kv.n_blocks * BLOCK_TOKENS;
    let first = kv.lo * BLOCK_TOKENS;
    let scale = 1.0 / (hd as f32).sqrt();

    b.q.clear();
    b.q.resize(n_kv * pairs * lanes, 0);
    b.lo.clear();
    b.lo.resize(lanes, 0);
    b.hi.clear();
    b.hi.resize(lanes, i32::MAX);
    let mut row = vec![0u32; pairs];
    for (r, q) in qs.iter().enumerate() {
        for (h, head) in q.q.chunks_exact(hd).enumerate() {
            let (g, lane) = (h / per_kv, r * per_kv + h % per_kv);
            x86::to_pairs(head, &mut row);
            for (p, &v) in row.iter().enumerate() {
                b.q[(g * pairs + p) * lanes + lane] = v;
            }
            b.lo[lane] = i32::try_from(q.first_key).expect("key position fits i32");
            b.hi[lane] = i32::try_from(q.n_keys).expect("key position fits i32");
        }
    }
    let max_lo = b.lo[..n_lanes].iter().copied().max().unwrap_or(0) as usize;
    let min_hi = b.hi[..n_lanes].iter().copied().min().unwrap_or(0) as usize;

    // Scores, a block of keys at a time, and each lane's largest.
    b.scores.resize(n_kv * n_keys * lanes, 0.0);
    b.max.clear();
    b.max.resize(n_kv * lanes, f32::NEG_INFINITY);
    b.keys.resize(n_kv * BLOCK_TOKENS * pairs, 0);
    buf.resize(n_kv * VALUE_RUN * slab, 0.0);
    for bi in 0..kv.n_blocks {
        kv.load(bi, buf, slab);
        let n = kv.tokens(bi);
        for (g, keys) in b.keys.chunks_exact_mut(BLOCK_TOKENS * pairs).enumerate() {
            let rows = &mut buf[g * slab..][..slab];
            rows[n * hd..].fill(0.0);
            for (src, dst) in rows.chunks_exact(hd).zip(keys.chunks_exact_mut(pairs)) {
                x86::to_pairs(src, dst);
            }
        }
        let t0 = first + bi * BLOCK_TOKENS;
        let whole = t0 >= max_lo && t0 + BLOCK_TOKENS <= min_hi;
        for g in 0..n_kv {
            x86::scores(x86::Scores {
                q: &b.q[g * pairs * lanes..][..pairs * lanes],
                keys: &b.keys[g * BLOCK_TOKENS * pairs..][..BLOCK_TOKENS * pairs],
                scale,
                out: &mut b.scores[(g * n_keys + bi * BLOCK_TOKENS) * lanes..]
                    [..BLOCK_TOKENS * lanes],
                max: &mut b.max[g * lanes..][..lanes],
                at: t0,
                range: (!whole).then_some((&b.lo, &b.hi)),
            });
        }
    }

    // Weights and values, a run of blocks at a time.
    b.sum.clear();
    b.sum.resize(n_kv * lanes, 0.0);
    b.acc.clear();
    b.acc.resize(n_kv * lanes * hd, 0.0);
    let run_keys = VALUE_RUN * BLOCK_TOKENS;
    b.values.resize(n_kv * run_keys / 2 * hd, 0);
    b.weights.resize(run_keys / 2 * lanes, 0);
    for r0 in (0..kv.n_blocks).step_by(VALUE_RUN) {
        let r1 = (r0 + VALUE_RUN).min(kv.n_blocks);
        let run_slab = VALUE_RUN * slab;
        for bi in r0..r1 {
            let at = (bi - r0) * slab;
            kv.load(kv.n_blocks + bi, &mut buf[at..], run_slab);
            let n = kv.tokens(kv.n_blocks + bi);
            for g in 0..n_kv {
                buf[g * run_slab + at..][..slab][n * hd..].fill(0.0);
            }
        }
        let keys = (r1 - r0) * BLOCK_TOKENS;
        for g in 0..n_kv {
            let rows = &buf[g * run_slab..][..keys * hd];
            let values = &mut b.values[g * run_keys / 2 * hd..][..keys / 2 * hd];
            for (pair, dst) in rows.chunks_exact(2 * hd).zip(values.chunks_exact_mut(hd)) {
                let (even, odd) = pair.split_at(hd);
                x86::interleave(even, odd, dst);
            }
            let k0 = r0 * BLOCK_TOKENS;
            x86::weights(
                &b.scores[(g * n_keys + k0) * lanes..][..keys * lanes],
                &b.max[g * lanes..][..lanes],
                &mut b.sum[g * lanes..][..lanes],
                &mut b.weights[..keys / 2 * lanes],
            );
            x86::accumulate(
                &b.weights[..keys / 2 * lanes],
                lanes,
                values,
                &mut b.acc[g * lanes * hd..][..n_lanes * hd],
            );
        }
    }

    for (r, o) in out.chunks_exact_mut(heads * hd).enumerate() {
        for (h, o) in o.chunks_exact_mut(hd).enumerate() {
            let (g, lane) = (h / per_kv, r * per_kv + h % per_kv);
            let inv = 1.0 / b.sum[g * lanes + lane];
            let acc = &b.acc[(g * lanes + lane) * hd..][..hd];
            for (o, &a) in o.iter_mut().zip(acc) {
                *o = a * inv;
            }
        }
    }
}

/// `e^x` for `x <= 0`, to about an ulp, as the weights take it (rounded to bf16 after): 0 at and
/// below [`FLOOR`] (and for −∞). The same polynomial in every lane, so a lane's result does not
/// depend on the others'. Cephes' `expf`: `x = n·ln2 + r`, a degree-5 polynomial in `r`, scaled
/// by `2^n`.
#[cfg(test)]
fn exp(x: f32) -> f32 {
    if x <= FLOOR || x.is_nan() {
        return 0.0;
    }
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (-n).mul_add(LN2_LOW, (-n).mul_add(LN2_HIGH, x));
    let p = P.iter().skip(1).fold(P[0], |p, &c| p.mul_add(r, c));
    let y = p.mul_add(r * r, r) + 1.0;
    y * 2f32.powi(n as i32)
}

/// ln 2 in two parts, the first exact in few bits, so that `x − n·ln2` is exact for `|n| <= 127`.
const LN2_HIGH: f32 = 0.693_359_4;
const LN2_LOW: f32 = -2.121_944_4e-4;
/// Cephes' `expf` polynomial for `(e^r − 1 − r) / r²`, highest degree first.
const P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    5.000_000_1e-1,
];

#[cfg(x86_v3)]
mod x86 {
    //! The safe entry points check shapes and that the CPU has AVX-512 BF16 ([`super::runs`]
    //! asked first), then call the kernels.

    use std::arch::x86_64::*;

    use super::{BLOCK_TOKENS, FLOOR, LANES, LN2_HIGH, LN2_LOW, P};

    fn check() {
        assert!(crate::cpu::has_avx512_bf16(), "bf16 attention without AVX-512 BF16");
    }

    /// `dst[i] = bf16(src[2i]) | bf16(src[2i + 1]) << 16`, for `src` of a multiple of 32.
    pub(super) fn to_pairs(src: &[f32], dst: &mut [u32]) {
        check();
        assert!(src.len().is_multiple_of(2 * LANES) && dst.len() == src.len() / 2);
        // SAFETY: AVX-512 BF16 was detected.
        unsafe { to_pairs_in(src, dst) }
    }

    /// # Safety
    ///
    /// The CPU must have AVX-512 BF16; the shapes are those [`to_pairs`] checks.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn to_pairs_in(src: &[f32], dst: &mut [u32]) {
        // SAFETY: each step reads 32 values of `src` and writes 16 of `dst`, inside both.
        unsafe {
            for (s, d) in src.chunks_exact(2 * LANES).zip(dst.chunks_exact_mut(LANES)) {
                let lo = _mm512_loadu_ps(s.as_ptr());
                let hi = _mm512_loadu_ps(s.as_ptr().add(LANES));
                let v: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(hi, lo));
                _mm512_storeu_si512(d.as_mut_ptr().cast(), v);
            }
        }
    }

    /// `dst[i] = bf16(even[i]) | bf16(odd[i]) << 16`, for lengths of a multiple of 16.
    pub(super) fn interleave(even: &[f32], odd: &[f32], dst: &mut [u32]) {
        check();
        assert!(
            even.len().is_multiple_of(LANES) && odd.len() == even.len() && dst.len() == even.len()
        );
        // SAFETY: AVX-512 BF16 was detected.
        unsafe { interleave_in(even, odd, dst) }
    }

    /// # Safety
    ///
    /// The CPU must have AVX-512 BF16; the shapes are those [`interleave`] checks.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn interleave_in(even: &[f32], odd: &[f32], dst: &mut [u32]) {
        // SAFETY: each step reads 16 values of `even` and `odd` and writes 16 of `dst`.
        unsafe {
            let (chunks, n) = (dst.chunks_exact_mut(LANES), even.len() / LANES);
            for (i, d) in chunks.enumerate().take(n) {
                let e = _mm512_loadu_ps(even.as_ptr().add(i * LANES));
                let o = _mm512_loadu_ps(odd.as_ptr().add(i * LANES));
                _mm512_storeu_si512(d.as_mut_ptr().cast(), pack(e, o));
            }
        }
    }

    /// Lane `i`: `bf16(even[i]) | bf16(odd[i]) << 16`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    fn pack(even: __m512, odd: __m512) -> __m512i {
        // The conversion gives `even`'s 16 in the low half and `odd`'s in the high half; the
        // permute takes word `i` and word `16 + i` to lane `i`.
        const ORDER: [u16; 32] = {
            let mut o = [0u16; 32];
            let mut i = 0;
            while i < 16 {
                o[2 * i] = i as u16;
                o[2 * i + 1] = 16 + i as u16;
                i += 1;
            }
            o
        };
        // SAFETY: AVX-512 F, BW and BF16 are enabled; `ORDER` is 64 bytes.
        unsafe {
            let words: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(odd, even));
            let order = _mm512_loadu_si512(ORDER.as_ptr().cast());
            _mm512_permutexvar_epi16(order, words)
        }
    }

    /// One KV head's scores for one block of keys.
    pub(super) struct Scores<'a> {
        /// `[dimension pair][lane]`.
        pub q: &'a [u32],
        /// `[token][dimension pair]`, [`BLOCK_TOKENS`] tokens.
        pub keys: &'a [u32],
        pub scale: f32,
        /// `[token][lane]`.
        pub out: &'a mut [f32],
        /// `[lane]`, raised to the block's largest score of each lane.
        pub max: &'a mut [f32],
        /// The block's first key position.
        pub at: usize,
        /// Each lane's visible keys `lo[lane]..hi[lane]`, where some lane does not see every key
        /// of the block (`None`: all do).
        pub range: Option<(&'a [i32], &'a [i32])>,
    }

    /// Tokens whose scores a kernel call holds, with [`Z`] registers of lanes each: 16
    /// accumulators, four broadcast pairs and a register of queries fit the 32.
    const T: usize = 4;
    const Z: usize = 4;

    pub(super) fn scores(mut s: Scores<'_>) {
        check();
        let lanes = s.max.len();
        let pairs = s.keys.len() / BLOCK_TOKENS;
        assert!(
            lanes.is_multiple_of(LANES)
                && s.q.len() == pairs * lanes
                && s.keys.len() == BLOCK_TOKENS * pairs
                && s.out.len() == BLOCK_TOKENS * lanes
                && s.range.is_none_or(|(lo, hi)| lo.len() == lanes && hi.len() == lanes)
                && s.at + BLOCK_TOKENS <= i32::MAX as usize,
            "bf16 scores: shapes"
        );
        let regs = lanes / LANES;
        // A single register of lanes (a decode step's heads) takes 16 tokens at once, so that
        // enough sums are in flight; more take four tokens by four registers.
        if regs == 1 {
            // SAFETY: AVX-512 BF16 was detected; the shapes were checked.
            unsafe { scores_of::<BLOCK_TOKENS, 1>(&mut s, 0, 0, pairs, lanes) };
            return;
        }
        for t in (0..BLOCK_TOKENS).step_by(T) {
            for z in (0..regs).step_by(Z) {
                // SAFETY: as above; `t + T <= 16` and `z + count <= regs`.
                unsafe {
                    match (regs - z).min(Z) {
                        4 => scores_of::<T, 4>(&mut s, t, z, pairs, lanes),
                        3 => scores_of::<T, 3>(&mut s, t, z, pairs, lanes),
                        2 => scores_of::<T, 2>(&mut s, t, z, pairs, lanes),
                        _ => scores_of::<T, 1>(&mut s, t, z, pairs, lanes),
                    }
                }
            }
        }
        const { assert!(Z == 4 && BLOCK_TOKENS.is_multiple_of(T)) };
    }

    /// Tokens `t0..t0 + N` by lane registers `z0..z0 + R`: each sum a chain over the pairs.
    ///
    /// # Safety
    ///
    /// The CPU must have AVX-512 BF16; the shapes are those [`scores`] checks, `t0 + N <= 16`
    /// and `(z0 + R)·16 <= lanes`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn scores_of<const N: usize, const R: usize>(
        s: &mut Scores<'_>,
        t0: usize,
        z0: usize,
        pairs: usize,
        lanes: usize,
    ) {
        // SAFETY: every read of `q` is at `p·lanes + (z0 + j)·16 + 16 <= pairs·lanes`, of `keys`
        // at `(t0 + i)·pairs + p < 16·pairs`, every write at `(t0 + i)·lanes + (z0 + j)·16 + 16
        // <= 16·lanes`, and of `lo`, `hi`, `max` at `(z0 + j)·16 + 16 <= lanes`.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); R]; N];
            for p in 0..pairs {
                let k: [__m512bh; N] = std::array::from_fn(|i| {
                    let pair = *s.keys.get_unchecked((t0 + i) * pairs + p);
                    std::mem::transmute(_mm512_set1_epi32(pair as i32))
                });
                for j in 0..R {
                    let q = s.q.as_ptr().add(p * lanes + (z0 + j) * LANES);
                    let q: __m512bh = std::mem::transmute(_mm512_loadu_si512(q.cast()));
                    for i in 0..N {
                        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], q, k[i]);
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

    /// The weights of a run of keys' scores (`[key][lane]`, an even count of keys): `e^(s −
    /// max)` added to `sum` in key order, and stored as pairs of keys, `[key pair][lane]`.
    pub(super) fn weights(scores: &[f32], max: &[f32], sum: &mut [f32], out: &mut [u32]) {
        check();
        let lanes = max.len();
        assert!(
            lanes.is_multiple_of(LANES)
                && sum.len() == lanes
                && scores.len().is_multiple_of(2 * lanes)
                && out.len() == scores.len() / 2,
            "bf16 weights: shapes"
        );
        // SAFETY: AVX-512 BF16 was detected.
        unsafe { weights_in(scores, max, sum, out) }
    }

    /// # Safety
    ///
    /// The CPU must have AVX-512 BF16; the shapes are those [`weights`] checks.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn weights_in(scores: &[f32], max: &[f32], sum: &mut [f32], out: &mut [u32]) {
        let lanes = max.len();
        // SAFETY: reads of `scores` at `(2j + 1)·lanes + z + 16 <= scores.len()` and writes of
        // `out` at `j·lanes + z + 16 <= out.len()`, of `max` and `sum` at `z + 16 <= lanes`.
        unsafe {
            for z in (0..lanes).step_by(LANES) {
                let m = _mm512_loadu_ps(max.as_ptr().add(z));
                let mut total = _mm512_loadu_ps(sum.as_ptr().add(z));
                for j in 0..scores.len() / (2 * lanes) {
                    let s = scores.as_ptr().add(2 * j * lanes + z);
                    let e0 = exp(_mm512_sub_ps(_mm512_loadu_ps(s), m));
                    let e1 = exp(_mm512_sub_ps(_mm512_loadu_ps(s.add(lanes)), m));
                    total = _mm512_add_ps(_mm512_add_ps(total, e0), e1);
                    _mm512_storeu_si512(out.as_mut_ptr().add(j * lanes + z).cast(), pack(e0, e1));
                }
                _mm512_storeu_ps(sum.as_mut_ptr().add(z), total);
            }
        }
    }

    /// [`exp`] on 16 values, for the tests.
    #[cfg(test)]
    pub(super) fn exp_lanes(x: [f32; LANES]) -> [f32; LANES] {
        check();
        // SAFETY: AVX-512 BF16 was detected; both arrays are 16 f32.
        unsafe { std::mem::transmute(exp(std::mem::transmute::<[f32; LANES], __m512>(x))) }
    }

    /// [`super::exp`] in 16 lanes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    fn exp(x: __m512) -> __m512 {
        let live = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(FLOOR));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HIGH), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LOW), r);
        let mut p = _mm512_set1_ps(P[0]);
        for &c in &P[1..] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        let y = _mm512_add_ps(
            _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r),
            _mm512_set1_ps(1.0),
        );
        _mm512_maskz_mov_ps(live, _mm512_scalef_ps(y, n))
    }

    /// Query heads taken together in [`accumulate`]: 24 accumulators, the four value registers
    /// and a broadcast weight pair.
    const HEADS: usize = 6;
    /// Output dimensions per pass: four registers.
    const PASS: usize = 4 * LANES;

    /// `acc[lane] += Σ_j weights[j][lane] · values[j]` over the pairs of keys `j`, for each
    /// lane of `acc` (`[lane][dimension]`, the real lanes only); `weights` is `[pair][lanes]`,
    /// `values` `[pair][dimension]`.
    pub(super) fn accumulate(weights: &[u32], lanes: usize, values: &[u32], acc: &mut [f32]) {
        check();
        let n_pairs = weights.len() / lanes.max(1);
        if n_pairs == 0 {
            return;
        }
        let hd = values.len() / n_pairs;
        let n_lanes = acc.len() / hd.max(1);
        assert!(
            lanes.is_multiple_of(LANES)
                && weights.len() == n_pairs * lanes
                && values.len() == n_pairs * hd
                && hd.is_multiple_of(PASS)
                && acc.len() == n_lanes * hd
                && n_lanes <= lanes,
            "bf16 accumulate: shapes"
        );
        for first in (0..n_lanes).step_by(HEADS) {
            let a = Accumulate {
                weights,
                lanes,
                values,
                hd,
                first,
            };
            // SAFETY: AVX-512 BF16 was detected; the shapes were checked, and `first + count
            // <= n_lanes`.
            unsafe {
                match (n_lanes - first).min(HEADS) {
                    6 => a.heads::<6>(acc),
                    5 => a.heads::<5>(acc),
                    4 => a.heads::<4>(acc),
                    3 => a.heads::<3>(acc),
                    2 => a.heads::<2>(acc),
                    _ => a.heads::<1>(acc),
                }
            }
        }
        const { assert!(HEADS == 6) };
    }

    struct Accumulate<'a> {
        weights: &'a [u32],
        lanes: usize,
        values: &'a [u32],
        hd: usize,
        first: usize,
    }

    impl Accumulate<'_> {
        /// Lanes `first..first + H`, [`PASS`] dimensions at a time held in registers across the
        /// pairs of keys.
        ///
        /// # Safety
        ///
        /// The CPU must have AVX-512 BF16; the shapes are those [`accumulate`] checks and
        /// `(first + H)·hd <= acc.len()`.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
        unsafe fn heads<const H: usize>(&self, acc: &mut [f32]) {
            let (hd, lanes) = (self.hd, self.lanes);
            let n_pairs = self.weights.len() / lanes;
            // SAFETY: reads of `values` at `j·hd + c0 + 16k + 16 <= n_pairs·hd`, of `weights`
            // at `j·lanes + first + h < n_pairs·lanes`, and accesses of `acc` at `(first +
            // h)·hd + c0 + 16k + 16 <= acc.len()` (the caller's shapes).
            unsafe {
                for c0 in (0..hd).step_by(PASS) {
                    let at = |h: usize, k: usize| (self.first + h) * hd + c0 + k * LANES;
                    let mut a: [[__m512; 4]; H] = std::array::from_fn(|h| {
                        std::array::from_fn(|k| _mm512_loadu_ps(acc.as_ptr().add(at(h, k))))
                    });
                    for j in 0..n_pairs {
                        let row = self.values.as_ptr().add(j * hd + c0);
                        let v: [__m512bh; 4] = std::array::from_fn(|k| {
                            std::mem::transmute(_mm512_loadu_si512(row.add(k * LANES).cast()))
                        });
                        for (h, a) in a.iter_mut().enumerate() {
                            let w = *self.weights.get_unchecked(j * lanes + self.first + h);
                            let w: __m512bh = std::mem::transmute(_mm512_set1_epi32(w as i32));
                            for k in 0..4 {
                                a[k] = _mm512_dpbf16_ps(a[k], v[k], w);
                            }
                        }
                    }
                    for (h, a) in a.iter().enumerate() {
                        for (k, &a) in a.iter().enumerate() {
                            _mm512_storeu_ps(acc.as_mut_ptr().add(at(h, k)), a);
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
