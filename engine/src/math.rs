//! `expf` four or eight lanes at a time, bit-identical to glibc's.
//!
//! libm's scalar `expf` took about 10% of a batch-16 decode step: SiLU needs one per FFN
//! feature per row per layer, and softmax one per key. A generic vector `exp` (the `wide`
//! crate's, or llama.cpp's `ggml_v_expf`) is within 1–2 ulp of libm. But those last-bit changes
//! in SiLU's output move the 8-bit activation quantizer. That was enough to shift
//! first-position logits by about 0.1 and flip near-ties against the llama.cpp fixtures.
//!
//! So this is glibc's own algorithm, the one in its FMA build (`__expf_fma`, from Arm's
//! optimized-routines), done in the same double-precision steps:
//! - `x·32/ln2 = k + r`;
//! - `2^(k/32)` from a 32-entry table;
//! - a cubic in `r`;
//! - one rounding to f32 at the end.
//!
//! The compiler fuses both uses of `x·32/ln2` into FMAs there, and so do we. Checked against
//! glibc 2.36 on every f32 input (`exp_matches_libm` samples them; the exhaustive run is in
//! issue 2's note). No crate provides this; written by hand for that reason.

/// Table bits: `2^(i/32)` per entry, as f64 bits minus `i << 47`, so adding `k << 47` to entry
/// `k mod 32` gives `2^(k/32)`.
const TABLE: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];
/// `32 / ln 2`.
const INV_LN2_N: f64 = f64::from_bits(0x3ff71547652b82fe) * 32.0;
/// `1.5·2^52`: adding it rounds to an integer held in the low mantissa bits.
const SHIFT: f64 = f64::from_bits(0x4338000000000000);
/// The cubic's coefficients, scaled for `r` in units of `ln2 / 32`.
const C0: f64 = f64::from_bits(0x3fac6af84b912394) / 32768.0;
const C1: f64 = f64::from_bits(0x3fcebfce50fac4f3) / 1024.0;
const C2: f64 = f64::from_bits(0x3fe62e42ff0c52d6) / 32.0;
/// Inputs at or beyond these take glibc's special cases (infinity, zero) rather than the table.
const OVERFLOW: f32 = 88.72283;
const UNDERFLOW: f32 = -103.97208;
/// Below this magnitude a vector of lanes takes the table path together (glibc's own fast-path
/// bound); one beyond it sends its vector through [`exp`] lane by lane.
#[cfg_attr(not(x86_v3), allow(dead_code))]
const FAST: f32 = 88.0;

/// `e^x`, rounded exactly as glibc's `expf` rounds it.
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x + x;
    }
    if x > OVERFLOW {
        return f32::INFINITY;
    }
    if x < UNDERFLOW {
        return 0.0;
    }
    let xd = f64::from(x);
    let kd = INV_LN2_N.mul_add(xd, SHIFT);
    let ki = kd.to_bits();
    let kd = kd - SHIFT;
    let r = INV_LN2_N.mul_add(xd, -kd);
    let s = f64::from_bits(TABLE[(ki % 32) as usize].wrapping_add(ki << 47));
    let z = C0.mul_add(r, C1);
    let y = C2.mul_add(r, 1.0);
    let y = z.mul_add(r * r, y);
    (y * s) as f32
}

/// `x = e^x` for every element.
pub fn exp_in_place(x: &mut [f32]) {
    #[cfg(x86_v3)]
    if crate::cpu::has_avx512f() {
        // SAFETY: AVX-512F was detected; AVX2 and FMA are compiled in.
        return unsafe { exp_in_place_512(x) };
    }
    exp_in_place_4(x);
}

/// [`exp_in_place`] four lanes at a time.
fn exp_in_place_4(x: &mut [f32]) {
    let mut chunks = x.chunks_exact_mut(4);
    for c in &mut chunks {
        let c: &mut [f32; 4] = c.try_into().expect("chunks of 4");
        *c = exp4(*c);
    }
    for v in chunks.into_remainder() {
        *v = exp(*v);
    }
}

/// Four lanes of [`exp`].
#[cfg(x86_v3)]
fn exp4(x: [f32; 4]) -> [f32; 4] {
    use std::arch::x86_64::*;
    if !x.iter().all(|v| v.abs() < FAST) {
        return x.map(exp);
    }
    // SAFETY: AVX2 and FMA are compiled in; the gather reads `TABLE` at indices masked to 0..32.
    unsafe {
        let xd = _mm256_cvtps_pd(_mm_loadu_ps(x.as_ptr()));
        let inv = _mm256_set1_pd(INV_LN2_N);
        let shift = _mm256_set1_pd(SHIFT);
        let kd = _mm256_fmadd_pd(inv, xd, shift);
        let ki = _mm256_castpd_si256(kd);
        let kd = _mm256_sub_pd(kd, shift);
        let r = _mm256_fmsub_pd(inv, xd, kd);
        let idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
        let t = _mm256_i64gather_epi64::<8>(TABLE.as_ptr().cast(), idx);
        let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki)));
        let z = _mm256_fmadd_pd(_mm256_set1_pd(C0), r, _mm256_set1_pd(C1));
        let y = _mm256_fmadd_pd(_mm256_set1_pd(C2), r, _mm256_set1_pd(1.0));
        let y = _mm256_fmadd_pd(z, _mm256_mul_pd(r, r), y);
        let mut out = [0f32; 4];
        _mm_storeu_ps(out.as_mut_ptr(), _mm256_cvtpd_ps(_mm256_mul_pd(y, s)));
        out
    }
}

/// [`exp_in_place`] eight lanes at a time in 512-bit registers, with the table in four of them
/// (two two-source permutes and a blend pick an entry) instead of `exp4`'s gather, which is slow
/// on AMD's cores. The steps are `exp4`'s, so the results are the same bits.
///
/// # Safety
///
/// The CPU must have AVX-512F ([`crate::cpu::has_avx512f`]).
#[cfg(x86_v3)]
#[target_feature(enable = "avx512f")]
unsafe fn exp_in_place_512(x: &mut [f32]) {
    use std::arch::x86_64::*;
    let mut chunks = x.chunks_exact_mut(8);
    // SAFETY (whole body): AVX-512F is enabled; loads and stores stay inside each 8-lane chunk.
    unsafe {
        let table = |i: usize| _mm512_loadu_si512(TABLE[8 * i..].as_ptr().cast());
        let (t0, t1, t2, t3) = (table(0), table(1), table(2), table(3));
        let inv = _mm512_set1_pd(INV_LN2_N);
        let shift = _mm512_set1_pd(SHIFT);
        let fast = _mm256_set1_ps(FAST);
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        for c in &mut chunks {
            let xs = _mm256_loadu_ps(c.as_ptr());
            let small = _mm256_cmp_ps::<_CMP_LT_OQ>(_mm256_and_ps(xs, abs), fast);
            if _mm256_movemask_ps(small) != 0xff {
                c.iter_mut().for_each(|v| *v = exp(*v));
                continue;
            }
            let xd = _mm512_cvtps_pd(xs);
            let kd = _mm512_fmadd_pd(inv, xd, shift);
            let ki = _mm512_castpd_si512(kd);
            let kd = _mm512_sub_pd(kd, shift);
            let r = _mm512_fmsub_pd(inv, xd, kd);
            // Entries 0..16 and 16..32 by the index's low four bits, then its fifth bit picks.
            let low = _mm512_permutex2var_epi64(t0, ki, t1);
            let high = _mm512_permutex2var_epi64(t2, ki, t3);
            let upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
            let t = _mm512_mask_blend_epi64(upper, low, high);
            let s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64::<47>(ki)));
            let z = _mm512_fmadd_pd(_mm512_set1_pd(C0), r, _mm512_set1_pd(C1));
            let y = _mm512_fmadd_pd(_mm512_set1_pd(C2), r, _mm512_set1_pd(1.0));
            let y = _mm512_fmadd_pd(z, _mm512_mul_pd(r, r), y);
            _mm256_storeu_ps(c.as_mut_ptr(), _mm512_cvtpd_ps(_mm512_mul_pd(y, s)));
        }
    }
    for v in chunks.into_remainder() {
        *v = exp(*v);
    }
}

#[cfg(not(x86_v3))]
fn exp4(x: [f32; 4]) -> [f32; 4] {
    x.map(exp)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bit-identical to the platform's `expf` (glibc on the machines we build for) on a sample
    /// of every bit pattern, through both the scalar and the four-lane path.
    #[test]
    fn exp_matches_libm() {
        let mut lanes = Vec::new();
        for bits in (0..=u32::MAX).step_by(997) {
            let x = f32::from_bits(bits);
            let want = x.exp();
            let got = exp(x);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "exp({x:e}) = {got:e}, libm {want:e}"
            );
            lanes.push(x);
        }
        // The four-lane path, and the one the CPU picks (eight lanes where it has AVX-512).
        for (path, f) in [
            ("four lanes", exp_in_place_4 as fn(&mut [f32])),
            ("picked", exp_in_place),
        ] {
            let mut v = lanes.clone();
            f(&mut v);
            for (x, got) in lanes.iter().zip(v) {
                let want = exp(*x);
                assert!(
                    got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                    "{path}: exp({x:e}) = {got:e}, scalar {want:e}"
                );
            }
        }
        for (x, want) in [
            (f32::NEG_INFINITY, 0.0),
            (f32::INFINITY, f32::INFINITY),
            (0.0, 1.0),
        ] {
            assert_eq!(exp(x), want);
        }
    }
}
