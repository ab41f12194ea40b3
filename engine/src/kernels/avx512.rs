//! The AVX-512 VNNI kernels, chosen at run time where the CPU has them ([`crate::cpu`]):
//! `vpdpbusd` on 512-bit registers, all 16 rows of a group at once. Their float steps are the
//! AVX2 kernels', lane by lane, so the results are bit-identical.

use std::arch::x86_64::*;

use super::TileOut;
use super::x86::{has_fifth, prefetch_ahead, prefetch_sub, quad};
use crate::packed::{
    BlockQ4_1x16, BlockQ5_0x16, BlockQ6Kx16, BlockQ8_0x16, CHUNK, GROUP, NibblesK, SUBS,
};
use crate::quant::{BlockQ8_1, QK};

/// One 16-row `Q5_0` group against `T` activation rows with 512-bit `vpdpbusd`, as
/// `tile_q4_1_vnni` with each chunk's fifth bits added by one masked move, the accumulators
/// starting at `-16·Σa`; the float steps are `tile_q5_0`'s, so the results are bit-identical.
///
/// # Safety
///
/// The CPU must have AVX-512 F, BW and VNNI ([`crate::cpu::has_avx512_vnni`]) beside the
/// build's AVX2, FMA and F16C. `acts` holds `T` activation rows of one block per weight block
/// of `w` (per sub-block, for the K-quants) back to back, and `out` at least `T` rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn tile_q5_0_vnni<const T: usize>(
    w: &[BlockQ5_0x16],
    acts: &[BlockQ8_1],
    out: &mut TileOut,
) {
    let nb = w.len();
    // SAFETY (whole body): the caller checked `has_avx512_vnni`; every load reads inside a block.
    unsafe {
        let mask = _mm512_set1_epi8(0x0F);
        let fifth = _mm512_set1_epi8(0x10);
        let mut acc = [_mm512_setzero_ps(); T];
        for (b, blk) in w.iter().enumerate() {
            prefetch_ahead(blk);
            let mut isum: [__m512i; T] =
                std::array::from_fn(|k| _mm512_set1_epi32(-16 * acts[k * nb + b].sum()));
            for j in 0..4 {
                let raw = _mm512_loadu_si512(blk.qs.as_ptr().add(CHUNK * j).cast());
                let lo = _mm512_or_si512(
                    _mm512_and_si512(raw, mask),
                    _mm512_maskz_mov_epi8(blk.qh[2 * j], fifth),
                );
                let hi = _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask),
                    _mm512_maskz_mov_epi8(blk.qh[2 * j + 1], fifth),
                );
                for k in 0..T {
                    let a = &acts[k * nb + b];
                    let (al, ah) = (quad(a, 4 * j), quad(a, 16 + 4 * j));
                    isum[k] = _mm512_dpbusd_epi32(isum[k], lo, _mm512_set1_epi32(al));
                    isum[k] = _mm512_dpbusd_epi32(isum[k], hi, _mm512_set1_epi32(ah));
                }
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.d.as_ptr().cast()));
            for k in 0..T {
                let f = _mm512_cvtepi32_ps(isum[k]);
                let ad = _mm512_set1_ps(acts[k * nb + b].d);
                acc[k] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, ad), acc[k]);
            }
        }
        for k in 0..T {
            _mm512_storeu_ps(out[k].as_mut_ptr(), acc[k]);
        }
    }
}

/// # Safety
///
/// The CPU must have AVX-512BW.
#[inline(always)]
unsafe fn two_bits_512(bits: __m512i, c: usize) -> __m512i {
    // SAFETY: the callers enable AVX-512BW; see `two_bits_256`.
    unsafe {
        match c {
            0 => _mm512_slli_epi16::<4>(bits),
            1 => _mm512_slli_epi16::<2>(bits),
            2 => bits,
            _ => _mm512_srli_epi16::<2>(bits),
        }
    }
}

/// 16 bytes widened to f32 lanes (the K-quants' per-row scales), 512-bit.
///
/// # Safety
///
/// The CPU must have AVX-512F; `bytes` holds at least 16 values.
#[inline(always)]
unsafe fn scales_u8_x16(bytes: &[u8]) -> __m512 {
    // SAFETY: the callers enable AVX-512F; the caller passes at least 16 bytes.
    unsafe { _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(bytes.as_ptr().cast()))) }
}

/// # Safety
///
/// The CPU must have AVX-512F; `bytes` holds at least 16 values.
#[inline(always)]
unsafe fn scales_i8_x16(bytes: &[i8]) -> __m512 {
    // SAFETY: as in `scales_u8_x16`.
    unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes.as_ptr().cast()))) }
}

/// `tile_q4_k` with 512-bit `vpdpbusd`, all 16 rows at once (a `Q5_K` chunk's fifth bits
/// added by one masked move each, as in `tile_q5_0_vnni`); the float steps are the same, so
/// the results are bit-identical.
///
/// # Safety
///
/// The CPU must have AVX-512 F, BW and VNNI ([`crate::cpu::has_avx512_vnni`]) beside the
/// build's AVX2, FMA and F16C. `acts` holds `T` activation rows of one block per weight block
/// of `w` (per sub-block, for the K-quants) back to back, and `out` at least `T` rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn tile_q4_k_vnni<const T: usize>(
    w: &[impl NibblesK],
    acts: &[BlockQ8_1],
    out: &mut TileOut,
) {
    let nb = w.len() * SUBS;
    // SAFETY (whole body): the caller checked `has_avx512_vnni`; every load reads inside a block.
    unsafe {
        let mask = _mm512_set1_epi8(0x0F);
        let fifth = _mm512_set1_epi8(0x10);
        let mut acc = [_mm512_setzero_ps(); T];
        for (b, blk5) in w.iter().enumerate() {
            let blk = blk5.low();
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk.d.as_ptr().cast()));
            let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(blk.dmin.as_ptr().cast()));
            for j in 0..SUBS {
                prefetch_sub(blk5, j);
                let dw = _mm512_mul_ps(d, scales_u8_x16(&blk.scales[GROUP * j..]));
                let mw = _mm512_mul_ps(dmin, scales_u8_x16(&blk.mins[GROUP * j..]));
                let qs = blk.qs.as_ptr().add(j * GROUP * QK / 2);
                let mut isum = [_mm512_setzero_si512(); T];
                for c in 0..4 {
                    let raw = _mm512_load_si512(qs.add(CHUNK * c).cast());
                    let mut lo = _mm512_and_si512(raw, mask);
                    let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask);
                    if has_fifth(w) {
                        let bits = |h| _mm512_maskz_mov_epi8(blk5.fifth(j, c, h), fifth);
                        lo = _mm512_or_si512(lo, bits(0));
                        hi = _mm512_or_si512(hi, bits(1));
                    }
                    for k in 0..T {
                        let a = &acts[k * nb + b * SUBS + j];
                        let (al, ah) = (quad(a, 4 * c), quad(a, 16 + 4 * c));
                        isum[k] = _mm512_dpbusd_epi32(isum[k], lo, _mm512_set1_epi32(al));
                        isum[k] = _mm512_dpbusd_epi32(isum[k], hi, _mm512_set1_epi32(ah));
                    }
                }
                for k in 0..T {
                    let a = &acts[k * nb + b * SUBS + j];
                    let f = _mm512_cvtepi32_ps(isum[k]);
                    acc[k] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, _mm512_set1_ps(a.d)), acc[k]);
                    acc[k] = _mm512_fnmadd_ps(mw, _mm512_set1_ps(a.s), acc[k]);
                }
            }
        }
        for k in 0..T {
            _mm512_storeu_ps(out[k].as_mut_ptr(), acc[k]);
        }
    }
}

/// `tile_q6_k` with 512-bit `vpdpbusd`, all 16 rows at once; bit-identical to it.
///
/// # Safety
///
/// The CPU must have AVX-512 F, BW and VNNI ([`crate::cpu::has_avx512_vnni`]) beside the
/// build's AVX2, FMA and F16C. `acts` holds `T` activation rows of one block per weight block
/// of `w` (per sub-block, for the K-quants) back to back, and `out` at least `T` rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn tile_q6_k_vnni<const T: usize>(
    w: &[BlockQ6Kx16],
    acts: &[BlockQ8_1],
    out: &mut TileOut,
) {
    let nb = w.len() * SUBS;
    // SAFETY (whole body): the caller checked `has_avx512_vnni`; every load reads inside a block.
    unsafe {
        let mask = _mm512_set1_epi8(0x0F);
        let high = _mm512_set1_epi8(0x30);
        let mut acc = [_mm512_setzero_ps(); T];
        for (b, blk) in w.iter().enumerate() {
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk.d.as_ptr().cast()));
            for j in 0..SUBS {
                prefetch_sub(blk, j);
                let dl = _mm512_mul_ps(d, scales_i8_x16(&blk.scales[GROUP * 2 * j..]));
                let dh = _mm512_mul_ps(d, scales_i8_x16(&blk.scales[GROUP * (2 * j + 1)..]));
                let ql = blk.ql.as_ptr().add(j * GROUP * QK / 2);
                let qh = blk.qh.as_ptr().add(j * GROUP * QK / 4);
                let (hl, hh) = (
                    _mm512_loadu_si512(qh.cast()),
                    _mm512_loadu_si512(qh.add(CHUNK).cast()),
                );
                let mut isum_lo: [__m512i; T] = std::array::from_fn(|k| {
                    _mm512_set1_epi32(-32 * i32::from(acts[k * nb + b * SUBS + j].sums[0]))
                });
                let mut isum_hi: [__m512i; T] = std::array::from_fn(|k| {
                    _mm512_set1_epi32(-32 * i32::from(acts[k * nb + b * SUBS + j].sums[1]))
                });
                for c in 0..4 {
                    let raw = _mm512_loadu_si512(ql.add(CHUNK * c).cast());
                    let lo = _mm512_or_si512(
                        _mm512_and_si512(raw, mask),
                        _mm512_and_si512(two_bits_512(hl, c), high),
                    );
                    let hi = _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask),
                        _mm512_and_si512(two_bits_512(hh, c), high),
                    );
                    for k in 0..T {
                        let a = &acts[k * nb + b * SUBS + j];
                        let (al, ah) = (quad(a, 4 * c), quad(a, 16 + 4 * c));
                        isum_lo[k] = _mm512_dpbusd_epi32(isum_lo[k], lo, _mm512_set1_epi32(al));
                        isum_hi[k] = _mm512_dpbusd_epi32(isum_hi[k], hi, _mm512_set1_epi32(ah));
                    }
                }
                for k in 0..T {
                    let ad = _mm512_set1_ps(acts[k * nb + b * SUBS + j].d);
                    let fl = _mm512_cvtepi32_ps(isum_lo[k]);
                    let fh = _mm512_cvtepi32_ps(isum_hi[k]);
                    acc[k] = _mm512_fmadd_ps(fl, _mm512_mul_ps(dl, ad), acc[k]);
                    acc[k] = _mm512_fmadd_ps(fh, _mm512_mul_ps(dh, ad), acc[k]);
                }
            }
        }
        for k in 0..T {
            _mm512_storeu_ps(out[k].as_mut_ptr(), acc[k]);
        }
    }
}

/// One 16-row group against `T` activation rows with 512-bit `vpdpbusd`: four u8 × i8
/// products summed straight into i32 lanes, for all 16 rows at once. Each activation row
/// has one integer accumulator per block (low and high nibbles alike), so `T` = 8 gives the
/// 8 independent chains that keep two `vpdpbusd` a cycle in flight (latency 4) with no
/// instruction spent joining chains; with the 8 float accumulators that is 16 of the 32
/// registers.
///
/// # Safety
///
/// The CPU must have AVX-512 F, BW and VNNI ([`crate::cpu::has_avx512_vnni`]) beside the
/// build's AVX2, FMA and F16C. `acts` holds `T` activation rows of one block per weight block
/// of `w` (per sub-block, for the K-quants) back to back, and `out` at least `T` rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn tile_q4_1_vnni<const T: usize>(
    w: &[BlockQ4_1x16],
    acts: &[BlockQ8_1],
    out: &mut TileOut,
) {
    let nb = w.len();
    // SAFETY (whole body): the caller checked `has_avx512_vnni`; every load reads inside a block.
    unsafe {
        let mask = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); T];
        for (b, blk) in w.iter().enumerate() {
            prefetch_ahead(blk);
            let mut isum = [_mm512_setzero_si512(); T];
            for j in 0..4 {
                let raw = _mm512_loadu_si512(blk.qs.as_ptr().add(CHUNK * j).cast());
                let lo = _mm512_and_si512(raw, mask);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask);
                for k in 0..T {
                    let a = &acts[k * nb + b];
                    let (al, ah) = (quad(a, 4 * j), quad(a, 16 + 4 * j));
                    isum[k] = _mm512_dpbusd_epi32(isum[k], lo, _mm512_set1_epi32(al));
                    isum[k] = _mm512_dpbusd_epi32(isum[k], hi, _mm512_set1_epi32(ah));
                }
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.d.as_ptr().cast()));
            let mw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.m.as_ptr().cast()));
            for k in 0..T {
                let a = &acts[k * nb + b];
                let f = _mm512_cvtepi32_ps(isum[k]);
                acc[k] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, _mm512_set1_ps(a.d)), acc[k]);
                acc[k] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s), acc[k]);
            }
        }
        for k in 0..T {
            _mm512_storeu_ps(out[k].as_mut_ptr(), acc[k]);
        }
    }
}

/// One 16-row `Q8_0` group against `T` activation rows: the weights, offset to unsigned
/// bytes, are `vpdpbusd`'s unsigned operand as they are, and each block's accumulators
/// start at `-128·Σa` to take the offset back off. The integer sums equal `tile_q8_0`'s
/// exactly, and the float steps are the same, so the results are bit-identical. One chain
/// per activation row, as in `tile_q4_1_vnni`.
///
/// # Safety
///
/// The CPU must have AVX-512 F, BW and VNNI ([`crate::cpu::has_avx512_vnni`]) beside the
/// build's AVX2, FMA and F16C. `acts` holds `T` activation rows of one block per weight block
/// of `w` (per sub-block, for the K-quants) back to back, and `out` at least `T` rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn tile_q8_0_vnni<const T: usize>(
    w: &[BlockQ8_0x16],
    acts: &[BlockQ8_1],
    out: &mut TileOut,
) {
    let nb = w.len();
    // SAFETY (whole body): the caller checked `has_avx512_vnni`; every load reads inside a block.
    unsafe {
        let mut acc = [_mm512_setzero_ps(); T];
        for (b, blk) in w.iter().enumerate() {
            prefetch_ahead(blk);
            let mut isum: [__m512i; T] =
                std::array::from_fn(|k| _mm512_set1_epi32(-128 * acts[k * nb + b].sum()));
            for j in 0..8 {
                let wq = _mm512_loadu_si512(blk.qs.as_ptr().add(CHUNK * j).cast());
                for k in 0..T {
                    let a = _mm512_set1_epi32(quad(&acts[k * nb + b], 4 * j));
                    isum[k] = _mm512_dpbusd_epi32(isum[k], wq, a);
                }
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.d.as_ptr().cast()));
            for k in 0..T {
                let f = _mm512_cvtepi32_ps(isum[k]);
                let ad = _mm512_set1_ps(acts[k * nb + b].d);
                acc[k] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, ad), acc[k]);
            }
        }
        for k in 0..T {
            _mm512_storeu_ps(out[k].as_mut_ptr(), acc[k]);
        }
    }
}
