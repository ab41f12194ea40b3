//! What the AVX2 and the AVX-512 kernels share: software prefetch of the weights ahead, the
//! activation quads they broadcast, and the bit spreads of the 5- and 6-bit quants.

use std::arch::x86_64::*;

use crate::packed::{NibblesK, SUBS};
use crate::quant::BlockQ8_1;

/// How far ahead of the block being multiplied the kernels ask for weights, in blocks:
/// 2-3 KB of the 32-value types, since the hardware prefetcher alone leaves the batched
/// matmuls waiting on memory. The K-quant kernels use [`prefetch_sub`] instead.
pub(super) const PREFETCH_BLOCKS: usize = 6;

/// Asks the cache for the weight block [`PREFETCH_BLOCKS`] after `blk`. Past the end of a
/// group that is the next group's (groups lie back to back), or past the matrix, nothing.
#[inline(always)]
pub(super) fn prefetch_ahead<B>(blk: &B) {
    let ahead = std::ptr::from_ref(blk).wrapping_add(PREFETCH_BLOCKS);
    prefetch_lines(ahead.cast(), size_of::<B>());
}

/// Blocks ahead that the K-quant kernels ask for, an eighth of a block per sub-block (their
/// 16-row blocks are 2-3 KB).
pub(super) const PREFETCH_K_BLOCKS: usize = 2;

/// Asks the cache for the `j`-th eighth of the block [`PREFETCH_K_BLOCKS`] after `blk`, so
/// the requests for a large block are spread over its sub-blocks rather than issued at once.
#[inline(always)]
pub(super) fn prefetch_sub<B>(blk: &B, j: usize) {
    let part = size_of::<B>() / SUBS;
    let ahead = std::ptr::from_ref(blk).wrapping_add(PREFETCH_K_BLOCKS);
    prefetch_lines(ahead.cast::<i8>().wrapping_add(part * j), part);
}

/// One prefetch per 64-byte line of the `bytes` from `start`, into the L2 cache
/// (`_MM_HINT_T1`) rather than the L1. The L1 has few miss buffers, and a prefetch holds one
/// for a whole trip to memory, so prefetches into it likely keep the kernel's own loads
/// waiting; the L2 hint decodes faster (docs/models.md, "Speed against llama.cpp").
#[inline(always)]
pub(super) fn prefetch_lines(start: *const i8, bytes: usize) {
    for line in (0..bytes).step_by(64) {
        // SAFETY: a prefetch never faults and has no effect on memory, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(start.wrapping_add(line)) };
    }
}

/// Whether the quants of `w` have a fifth bit (`Q5_K`), known at compile time.
#[inline(always)]
pub(super) fn has_fifth<B: NibblesK>(_: &[B]) -> bool {
    B::FIFTH
}

/// Four activation quants starting at `at`, as one 32-bit value for a broadcast.
///
/// # Safety
///
/// `at + 4` must be at most the block's 32 quants.
#[inline(always)]
pub(super) unsafe fn quad(a: &BlockQ8_1, at: usize) -> i32 {
    // SAFETY: `at + 4 <= 32`; the read is unaligned.
    unsafe { a.qs.as_ptr().add(at).cast::<i32>().read_unaligned() }
}

/// 32 bytes, byte `i` 0x10 where bit `i` of `bits` is set: the fifth bits of a `Q5_0` chunk's
/// 8-row half.
///
/// # Safety
///
/// The CPU must have AVX2 (the x86-64-v3 build guarantees it).
#[inline(always)]
pub(super) unsafe fn fifth_bits(bits: u32) -> __m256i {
    // SAFETY: the cfg guarantees AVX2.
    unsafe {
        // Byte i takes byte i / 8 of `bits`, then tests bit i % 8 of it.
        let spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(bits as i32),
            _mm256_set_epi64x(
                0x0303_0303_0303_0303,
                0x0202_0202_0202_0202,
                0x0101_0101_0101_0101,
                0,
            ),
        );
        let select = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    }
}

/// Chunk `c`'s two high bits of each byte of `bits`, moved to bits 4-5 (not yet masked).
///
/// # Safety
///
/// The CPU must have AVX2 (the x86-64-v3 build guarantees it).
#[inline(always)]
pub(super) unsafe fn two_bits_256(bits: __m256i, c: usize) -> __m256i {
    // SAFETY: the cfg guarantees AVX2. A 16-bit shift by under 8 moves each byte's own bits
    // into bits 4-5, which the caller's mask keeps.
    unsafe {
        match c {
            0 => _mm256_slli_epi16::<4>(bits),
            1 => _mm256_slli_epi16::<2>(bits),
            2 => bits,
            _ => _mm256_srli_epi16::<2>(bits),
        }
    }
}
