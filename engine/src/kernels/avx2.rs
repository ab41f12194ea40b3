//! The AVX2 kernels (x86-64-v3, which the build targets): `maddubs` on a broadcast 4-byte
//! activation chunk, 8 rows per 256-bit register, a 16-row group in two passes.

use std::arch::x86_64::*;

use super::TileOut;
use super::x86::{fifth_bits, has_fifth, prefetch_ahead, prefetch_sub, quad, two_bits_256};
use crate::packed::{
    BlockQ4_1x16, BlockQ5_0x16, BlockQ6Kx16, BlockQ8_0x16, CHUNK, GROUP, NibblesK, SUBS,
};
use crate::quant::{BlockQ8_1, QK};

/// Rows per AVX2 pass: a 256-bit register holds 4 bytes of each.
const HALF: usize = GROUP / 2;

/// One 16-row group against `T` activation rows, in AVX2, as two passes over 8-row halves
/// (a 256-bit register holds 4 bytes of 8 rows). Per block, the integer sums are exact
/// (≤ 8 · 2 · 15 · 128 = 30720 fits an i16 lane), then scaled once for the 8 rows. Low and
/// high nibbles accumulate in separate chains, so even one activation row keeps two
/// multiply-adds in flight.
///
/// # Safety
///
/// The CPU must have AVX2, FMA and F16C (the x86-64-v3 build guarantees them). `acts` holds
/// `T` activation rows of one block per weight block of `w` (per sub-block, for the K-quants)
/// back to back, and `out` at least `T` rows.
pub(super) unsafe fn tile_q4_1<const T: usize>(
    w: &[BlockQ4_1x16],
    acts: &[BlockQ8_1],
    out: &mut TileOut,
) {
    let nb = w.len();
    // SAFETY (whole body): the cfg guarantees AVX2, FMA and F16C; every load reads inside
    // a block.
    unsafe {
        let mask = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        for half in 0..2 {
            let mut acc = [_mm256_setzero_ps(); T];
            for (b, blk) in w.iter().enumerate() {
                // The second half finds the first half's prefetches in cache.
                if half == 0 {
                    prefetch_ahead(blk);
                }
                let mut isum_lo = [_mm256_setzero_si256(); T];
                let mut isum_hi = [_mm256_setzero_si256(); T];
                for j in 0..4 {
                    let at = CHUNK * j + 4 * HALF * half;
                    let raw = _mm256_loadu_si256(blk.qs.as_ptr().add(at).cast());
                    let lo = _mm256_and_si256(raw, mask);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask);
                    for k in 0..T {
                        let a = &acts[k * nb + b];
                        let (al, ah) = (quad(a, 4 * j), quad(a, 16 + 4 * j));
                        let pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(al));
                        let ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(ah));
                        isum_lo[k] = _mm256_add_epi16(isum_lo[k], pl);
                        isum_hi[k] = _mm256_add_epi16(isum_hi[k], ph);
                    }
                }
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.d.as_ptr().add(HALF * half).cast()));
                let mw = _mm256_cvtph_ps(_mm_loadu_si128(blk.m.as_ptr().add(HALF * half).cast()));
                for k in 0..T {
                    let a = &acts[k * nb + b];
                    let sum = _mm256_add_epi16(isum_lo[k], isum_hi[k]);
                    let f = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum, ones));
                    acc[k] = _mm256_fmadd_ps(f, _mm256_mul_ps(dw, _mm256_set1_ps(a.d)), acc[k]);
                    acc[k] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s), acc[k]);
                }
            }
            for k in 0..T {
                _mm256_storeu_ps(out[k].as_mut_ptr().add(HALF * half), acc[k]);
            }
        }
    }
}

/// One 16-row `Q8_0` group against `T` activation rows, in AVX2 halves as in `tile_q4_1`.
/// The weights' offset is flipped back off, and the unsigned operand is |w|, with w's sign
/// moved onto the activations. Each 4-byte step is widened to i32 at once, since two
/// `maddubs` results (up to 2 · 127 · 128 each) would overflow an i16 lane.
///
/// # Safety
///
/// The CPU must have AVX2, FMA and F16C (the x86-64-v3 build guarantees them). `acts` holds
/// `T` activation rows of one block per weight block of `w` (per sub-block, for the K-quants)
/// back to back, and `out` at least `T` rows.
pub(super) unsafe fn tile_q8_0<const T: usize>(
    w: &[BlockQ8_0x16],
    acts: &[BlockQ8_1],
    out: &mut TileOut,
) {
    let nb = w.len();
    // SAFETY (whole body): as in `tile_q4_1`.
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let flip = _mm256_set1_epi8(-128);
        for half in 0..2 {
            let mut acc = [_mm256_setzero_ps(); T];
            for (b, blk) in w.iter().enumerate() {
                // The second half finds the first half's prefetches in cache.
                if half == 0 {
                    prefetch_ahead(blk);
                }
                // Even and odd steps accumulate in separate chains (see `tile_q4_1`).
                let mut isum = [[_mm256_setzero_si256(); T]; 2];
                for j in 0..8 {
                    let at = CHUNK * j + 4 * HALF * half;
                    let wq = _mm256_load_si256(blk.qs.as_ptr().add(at).cast());
                    let wq = _mm256_xor_si256(wq, flip);
                    let u = _mm256_sign_epi8(wq, wq);
                    for k in 0..T {
                        let a = _mm256_set1_epi32(quad(&acts[k * nb + b], 4 * j));
                        let s = _mm256_sign_epi8(a, wq);
                        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones);
                        isum[j % 2][k] = _mm256_add_epi32(isum[j % 2][k], p);
                    }
                }
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.d.as_ptr().add(HALF * half).cast()));
                for k in 0..T {
                    let a = &acts[k * nb + b];
                    let f = _mm256_cvtepi32_ps(_mm256_add_epi32(isum[0][k], isum[1][k]));
                    acc[k] = _mm256_fmadd_ps(f, _mm256_mul_ps(dw, _mm256_set1_ps(a.d)), acc[k]);
                }
            }
            for k in 0..T {
                _mm256_storeu_ps(out[k].as_mut_ptr().add(HALF * half), acc[k]);
            }
        }
    }
}

/// A `Q5_0` block's quants as bytes, the fifth bits or-ed in: `[half][j]` holds chunk `j` of
/// the 8-row half `half`, its low nibbles' 32 bytes then its high nibbles', as [`tile_q5_0`]
/// multiplies them. Decoding them once per row group lets every pass of a prefill over that
/// group skip the bit spreading, a third of the kernel's instructions.
pub(super) type Q5_0Bytes = [[[__m256i; 2]; 4]; 2];

/// Chunk `j` of half `half` of `blk`: its low and its high nibbles with their fifth bits.
///
/// # Safety
///
/// The CPU must have AVX2 (the x86-64-v3 build guarantees it).
#[inline(always)]
unsafe fn q5_0_chunk(blk: &BlockQ5_0x16, half: usize, j: usize) -> (__m256i, __m256i) {
    // SAFETY: the cfg guarantees AVX2; the load reads 32 of the block's 256 quant bytes, at a
    // multiple of 32 from the block's start (its alignment).
    unsafe {
        let mask = _mm256_set1_epi8(0x0F);
        let at = CHUNK * j + 4 * HALF * half;
        let raw = _mm256_load_si256(blk.qs.as_ptr().add(at).cast());
        let bits = |m: u64| fifth_bits((m >> (32 * half)) as u32);
        let lo = _mm256_or_si256(_mm256_and_si256(raw, mask), bits(blk.qh[2 * j]));
        let hi = _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask),
            bits(blk.qh[2 * j + 1]),
        );
        (lo, hi)
    }
}

/// Decodes the `Q5_0` blocks `w` into `bytes`, one [`Q5_0Bytes`] each (its allocation kept
/// from call to call).
///
/// # Safety
///
/// The CPU must have AVX2 (the x86-64-v3 build guarantees it).
pub(super) unsafe fn decode_q5_0(w: &[BlockQ5_0x16], bytes: &mut Vec<Q5_0Bytes>) {
    bytes.clear();
    bytes.extend(w.iter().map(|blk| {
        std::array::from_fn(|half| {
            std::array::from_fn(|j| {
                // SAFETY: as this function's.
                let (lo, hi) = unsafe { q5_0_chunk(blk, half, j) };
                [lo, hi]
            })
        })
    }));
}

/// One 16-row `Q5_0` group against `T` activation rows, in AVX2 halves as in `tile_q4_1`,
/// with each quant's fifth bit or-ed in from the chunk's mask, or read already decoded from
/// `bytes` (the group's blocks by [`decode_q5_0`]). Each block's sums are `Σ (q − 16)·a`,
/// exact in i16 lanes: a lane starts at `−16·Σa` over the 16 activations it meets
/// ([`BlockQ8_1::q5_0_offsets`]) and adds their products `q·a` with the unsigned `q`, so every
/// partial sum is `(q − 16)·a` summed over the products added and `−16·a` over the rest, at
/// most 16 · 16 · 127 = 32512 in size. One widening a block, and each block is scaled once:
/// `d·d_a·Σ (q − 16)·a`.
///
/// # Safety
///
/// The CPU must have AVX2, FMA and F16C (the x86-64-v3 build guarantees them). `acts` holds
/// `T` activation rows of one block per weight block of `w` (per sub-block, for the K-quants)
/// back to back, `out` at least `T` rows, and `bytes`, if given, one entry per block of `w`.
pub(super) unsafe fn tile_q5_0<const T: usize>(
    w: &[BlockQ5_0x16],
    bytes: Option<&[Q5_0Bytes]>,
    acts: &[BlockQ8_1],
    out: &mut TileOut,
) {
    // SAFETY: as this function's.
    unsafe {
        match bytes {
            Some(bytes) => tile_q5_0_with::<T>(w, acts, out, |b, half, j| {
                let [lo, hi] = bytes[b][half][j];
                (lo, hi)
            }),
            None => tile_q5_0_with::<T>(w, acts, out, |b, half, j| q5_0_chunk(&w[b], half, j)),
        }
    }
}

/// [`tile_q5_0`]'s body, taking block `b`'s chunk `j` of half `half` from `chunk`.
///
/// # Safety
///
/// As [`tile_q5_0`]'s.
#[inline(always)]
unsafe fn tile_q5_0_with<const T: usize>(
    w: &[BlockQ5_0x16],
    acts: &[BlockQ8_1],
    out: &mut TileOut,
    chunk: impl Fn(usize, usize, usize) -> (__m256i, __m256i),
) {
    let nb = w.len();
    // SAFETY (whole body): as in `tile_q4_1`.
    unsafe {
        let ones = _mm256_set1_epi16(1);
        for half in 0..2 {
            let mut acc = [_mm256_setzero_ps(); T];
            for (b, blk) in w.iter().enumerate() {
                if half == 0 {
                    prefetch_ahead(blk);
                }
                let mut isum: [__m256i; T] = std::array::from_fn(|k| {
                    _mm256_set1_epi32(bytemuck::cast(acts[k * nb + b].q5_0_offsets))
                });
                for j in 0..4 {
                    let (lo, hi) = chunk(b, half, j);
                    for k in 0..T {
                        let a = &acts[k * nb + b];
                        let (al, ah) = (quad(a, 4 * j), quad(a, 16 + 4 * j));
                        let pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(al));
                        let ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(ah));
                        isum[k] = _mm256_add_epi16(isum[k], _mm256_add_epi16(pl, ph));
                    }
                }
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.d.as_ptr().add(HALF * half).cast()));
                for k in 0..T {
                    let f = _mm256_cvtepi32_ps(_mm256_madd_epi16(isum[k], ones));
                    let ad = _mm256_set1_ps(acts[k * nb + b].d);
                    acc[k] = _mm256_fmadd_ps(f, _mm256_mul_ps(dw, ad), acc[k]);
                }
            }
            for k in 0..T {
                _mm256_storeu_ps(out[k].as_mut_ptr().add(HALF * half), acc[k]);
            }
        }
    }
}

/// 16 bytes (one per row of a group) widened to f32 lanes, for the K-quants' per-row scales.
///
/// # Safety
///
/// The CPU must have AVX2; `bytes` holds at least 8 values.
#[inline(always)]
unsafe fn scales_u8_x8(bytes: &[u8]) -> __m256 {
    // SAFETY: the cfg guarantees AVX2; the caller passes at least 8 bytes.
    unsafe { _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(bytes.as_ptr().cast()))) }
}

/// # Safety
///
/// The CPU must have AVX2; `bytes` holds at least 8 values.
#[inline(always)]
unsafe fn scales_i8_x8(bytes: &[i8]) -> __m256 {
    // SAFETY: as in `scales_u8_x8`.
    unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(bytes.as_ptr().cast()))) }
}

/// One 16-row `Q4_K` (or `Q5_K`) group against `T` activation rows, in AVX2 halves. Each
/// 32-value sub-block is `tile_q4_1`'s block (`tile_q5_0`'s for `Q5_K`, the fifth bits or-ed
/// in from their masks), with the row's scale `d·sc` and minimum `dmin·m` (both exact in f32:
/// an f16 times a 6-bit integer) in place of `Q4_1`'s. The low and high nibbles' i16 sums
/// are joined before widening for `Q4_K` (≤ 2 · 4 · 2 · 15 · 127 = 30480) and after it for
/// `Q5_K`, whose quants reach 31.
///
/// # Safety
///
/// The CPU must have AVX2, FMA and F16C (the x86-64-v3 build guarantees them). `acts` holds
/// `T` activation rows of one block per weight block of `w` (per sub-block, for the K-quants)
/// back to back, and `out` at least `T` rows.
pub(super) unsafe fn tile_q4_k<const T: usize>(
    w: &[impl NibblesK],
    acts: &[BlockQ8_1],
    out: &mut TileOut,
) {
    let nb = w.len() * SUBS;
    // SAFETY (whole body): as in `tile_q4_1`.
    unsafe {
        let mask = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        for half in 0..2 {
            let row0 = HALF * half;
            let mut acc = [_mm256_setzero_ps(); T];
            for (b, blk5) in w.iter().enumerate() {
                let blk = blk5.low();
                let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.d.as_ptr().add(row0).cast()));
                let dmin = _mm256_cvtph_ps(_mm_loadu_si128(blk.dmin.as_ptr().add(row0).cast()));
                for j in 0..SUBS {
                    // The second half finds the first half's prefetches in cache.
                    if half == 0 {
                        prefetch_sub(blk5, j);
                    }
                    let dw = _mm256_mul_ps(d, scales_u8_x8(&blk.scales[GROUP * j + row0..]));
                    let mw = _mm256_mul_ps(dmin, scales_u8_x8(&blk.mins[GROUP * j + row0..]));
                    let qs = blk.qs.as_ptr().add(j * GROUP * QK / 2);
                    let mut isum_lo = [_mm256_setzero_si256(); T];
                    let mut isum_hi = [_mm256_setzero_si256(); T];
                    for c in 0..4 {
                        let raw = _mm256_load_si256(qs.add(CHUNK * c + 4 * row0).cast());
                        let mut lo = _mm256_and_si256(raw, mask);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask);
                        if has_fifth(w) {
                            let bits = |h| fifth_bits((blk5.fifth(j, c, h) >> (32 * half)) as u32);
                            lo = _mm256_or_si256(lo, bits(0));
                            hi = _mm256_or_si256(hi, bits(1));
                        }
                        for k in 0..T {
                            let a = &acts[k * nb + b * SUBS + j];
                            let (al, ah) = (quad(a, 4 * c), quad(a, 16 + 4 * c));
                            let pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(al));
                            let ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(ah));
                            isum_lo[k] = _mm256_add_epi16(isum_lo[k], pl);
                            isum_hi[k] = _mm256_add_epi16(isum_hi[k], ph);
                        }
                    }
                    for k in 0..T {
                        let a = &acts[k * nb + b * SUBS + j];
                        let (lo, hi) = (isum_lo[k], isum_hi[k]);
                        let sum = match has_fifth(w) {
                            true => _mm256_add_epi32(
                                _mm256_madd_epi16(lo, ones),
                                _mm256_madd_epi16(hi, ones),
                            ),
                            false => _mm256_madd_epi16(_mm256_add_epi16(lo, hi), ones),
                        };
                        let f = _mm256_cvtepi32_ps(sum);
                        acc[k] = _mm256_fmadd_ps(f, _mm256_mul_ps(dw, _mm256_set1_ps(a.d)), acc[k]);
                        acc[k] = _mm256_fnmadd_ps(mw, _mm256_set1_ps(a.s), acc[k]);
                    }
                }
            }
            for k in 0..T {
                _mm256_storeu_ps(out[k].as_mut_ptr().add(row0), acc[k]);
            }
        }
    }
}

/// One 16-row `Q6_K` group against `T` activation rows, in AVX2 halves. Per sub-block, the
/// low nibbles (its first 16 values) and the high ones (its last 16) sum in separate i32
/// chains, each started at `−32·Σa` of its half of the activations, which takes the offset
/// 32 off exactly; each is then scaled by its own group's `d·sc` (exact in f32).
///
/// # Safety
///
/// The CPU must have AVX2, FMA and F16C (the x86-64-v3 build guarantees them). `acts` holds
/// `T` activation rows of one block per weight block of `w` (per sub-block, for the K-quants)
/// back to back, and `out` at least `T` rows.
pub(super) unsafe fn tile_q6_k<const T: usize>(
    w: &[BlockQ6Kx16],
    acts: &[BlockQ8_1],
    out: &mut TileOut,
) {
    let nb = w.len() * SUBS;
    // SAFETY (whole body): as in `tile_q4_1`.
    unsafe {
        let mask = _mm256_set1_epi8(0x0F);
        let high = _mm256_set1_epi8(0x30);
        let ones = _mm256_set1_epi16(1);
        for half in 0..2 {
            let row0 = HALF * half;
            let mut acc = [_mm256_setzero_ps(); T];
            for (b, blk) in w.iter().enumerate() {
                let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.d.as_ptr().add(row0).cast()));
                for j in 0..SUBS {
                    // The second half finds the first half's prefetches in cache.
                    if half == 0 {
                        prefetch_sub(blk, j);
                    }
                    let dl = _mm256_mul_ps(d, scales_i8_x8(&blk.scales[GROUP * 2 * j + row0..]));
                    let dh =
                        _mm256_mul_ps(d, scales_i8_x8(&blk.scales[GROUP * (2 * j + 1) + row0..]));
                    let ql = blk.ql.as_ptr().add(j * GROUP * QK / 2);
                    let qh = blk.qh.as_ptr().add(j * GROUP * QK / 4 + 4 * row0);
                    let (hl, hh) = (
                        _mm256_load_si256(qh.cast()),
                        _mm256_load_si256(qh.add(CHUNK).cast()),
                    );
                    let mut isum_lo: [__m256i; T] = std::array::from_fn(|k| {
                        _mm256_set1_epi32(-32 * i32::from(acts[k * nb + b * SUBS + j].sums[0]))
                    });
                    let mut isum_hi: [__m256i; T] = std::array::from_fn(|k| {
                        _mm256_set1_epi32(-32 * i32::from(acts[k * nb + b * SUBS + j].sums[1]))
                    });
                    let chunk = |c: usize| {
                        let raw = _mm256_load_si256(ql.add(CHUNK * c + 4 * row0).cast());
                        let lo = _mm256_or_si256(
                            _mm256_and_si256(raw, mask),
                            _mm256_and_si256(two_bits_256(hl, c), high),
                        );
                        let hi = _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask),
                            _mm256_and_si256(two_bits_256(hh, c), high),
                        );
                        (lo, hi)
                    };
                    // Two chunks' products are added in i16 before widening: a lane of each is
                    // two products of a 6-bit quant by an activation, at most 2 · 63 · 128 =
                    // 16128 in size, so the pair's sum fits (and is exact).
                    for c in (0..4).step_by(2) {
                        let ((lo0, hi0), (lo1, hi1)) = (chunk(c), chunk(c + 1));
                        for k in 0..T {
                            let a = &acts[k * nb + b * SUBS + j];
                            let prod = |q: __m256i, at: usize| {
                                _mm256_maddubs_epi16(q, _mm256_set1_epi32(quad(a, at)))
                            };
                            let pl = _mm256_add_epi16(prod(lo0, 4 * c), prod(lo1, 4 * c + 4));
                            let ph = _mm256_add_epi16(prod(hi0, 16 + 4 * c), prod(hi1, 20 + 4 * c));
                            isum_lo[k] = _mm256_add_epi32(isum_lo[k], _mm256_madd_epi16(pl, ones));
                            isum_hi[k] = _mm256_add_epi32(isum_hi[k], _mm256_madd_epi16(ph, ones));
                        }
                    }
                    for k in 0..T {
                        let ad = _mm256_set1_ps(acts[k * nb + b * SUBS + j].d);
                        let fl = _mm256_cvtepi32_ps(isum_lo[k]);
                        let fh = _mm256_cvtepi32_ps(isum_hi[k]);
                        acc[k] = _mm256_fmadd_ps(fl, _mm256_mul_ps(dl, ad), acc[k]);
                        acc[k] = _mm256_fmadd_ps(fh, _mm256_mul_ps(dh, ad), acc[k]);
                    }
                }
            }
            for k in 0..T {
                _mm256_storeu_ps(out[k].as_mut_ptr().add(row0), acc[k]);
            }
        }
    }
}
