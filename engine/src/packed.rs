//! Weight layouts repacked at load for the matmul kernels: sixteen rows interleaved per block.
//!
//! In a packed block, 64-byte chunk `j` holds bytes `4j..4j+4` of each of the 16 rows' original
//! blocks, row after row. One 4-byte activation broadcast then meets 4 weights of every row in a
//! single 512-bit `vpdpbusd` (or two 256-bit `maddubs`, one per half of the rows), so the
//! per-block scale work is done once for 16 rows instead of once per row (the idea of
//! llama.cpp's `q4_0_8x8` repacking, at the width of an AVX-512 register). For `Q4_1`, chunk
//! `j`'s low nibbles are elements `4j..4j+4` of each row and its high nibbles elements
//! `16+4j..16+4j+4`. `Q5_0` keeps that nibble layout and adds each quant's fifth bit as a
//! bitmask beside it: bit `4·ri + t` of a chunk's mask is the fifth bit of the quant in byte
//! `4·ri + t` of the chunk (one mask for the low nibbles, one for the high), so a 512-bit kernel
//! turns a mask into bytes with one masked move and a 256-bit one each 32-bit half with a
//! shuffle and a compare.

use bytemuck::{Pod, Zeroable};
use half::f16;

use crate::quant::{
    BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5K, BlockQ6K, BlockQ8_0, QK, QK_K, ScaledK,
};

/// Rows per packed group.
pub const GROUP: usize = 16;
/// Bytes per chunk: 4 of every row.
pub const CHUNK: usize = 4 * GROUP;

/// 320 bytes, so cache-line alignment costs no padding and no 64-byte load splits a line.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_1x16 {
    pub d: [f16; GROUP],
    pub m: [f16; GROUP],
    pub qs: [u8; GROUP * QK / 2],
}

/// 352 bytes: a whole number of 32-byte halves, so every 256-bit load is aligned.
#[repr(C, align(32))]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5_0x16 {
    pub qs: [u8; GROUP * QK / 2],
    /// Per chunk `j`: `qh[2j]` the fifth bits of its low nibbles, `qh[2j + 1]` of its high ones.
    pub qh: [u64; 8],
    pub d: [f16; GROUP],
}

/// Sub-blocks of 32 values per K-quant super-block.
pub const SUBS: usize = QK_K / QK;

/// `Q4_K`, 16 rows of one super-block: each 32-value sub-block's quants in `Q4_1x16`'s nibble
/// layout (256 bytes), then per sub-block and row its 6-bit scale and minimum unpacked to bytes.
/// 2,368 bytes, 148 per row (the file's block is 144).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4Kx16 {
    pub qs: [u8; SUBS * GROUP * QK / 2],
    /// `scales[GROUP * j + ri]`: sub-block `j`, row `ri`.
    pub scales: [u8; SUBS * GROUP],
    pub mins: [u8; SUBS * GROUP],
    pub d: [f16; GROUP],
    pub dmin: [f16; GROUP],
}

/// `Q5_K`, 16 rows of one super-block: [`BlockQ4Kx16`] for the scales, minimums and low four
/// bits, and each quant's fifth bit in `Q5_0x16`'s masks: `qh[8·j + 2·c]` for the low nibbles of
/// sub-block `j`'s chunk `c`, `qh[8·j + 2·c + 1]` for its high ones. 2,880 bytes, 180 per row
/// (the file's block is 176).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5Kx16 {
    pub low: BlockQ4Kx16,
    pub qh: [u64; 8 * SUBS],
}

/// The packed super-blocks the `Q4_K` kernels take: `Q4_K`, and `Q5_K` with its fifth bits.
pub trait NibblesK: Sync {
    /// Whether the quants have a fifth bit (up to 31, not 15); the kernels branch on it.
    const FIFTH: bool;
    fn low(&self) -> &BlockQ4Kx16;
    /// The fifth bits of sub-block `j`'s chunk `c`, of its low (`h` = 0) or high nibbles.
    fn fifth(&self, j: usize, c: usize, h: usize) -> u64;

    /// Sub-block `j` of row `ri`, as 32 unsigned quants.
    fn quants(&self, ri: usize, j: usize) -> [u8; QK] {
        let low = q4_k_quants(self.low(), ri, j);
        if !Self::FIFTH {
            return low;
        }
        std::array::from_fn(|e| {
            let (c, t) = ((e % 16) / 4, e % 4);
            let bit = (self.fifth(j, c, e / 16) >> (4 * ri + t)) & 1;
            low[e] | ((bit as u8) << 4)
        })
    }
}

impl NibblesK for BlockQ4Kx16 {
    const FIFTH: bool = false;
    fn low(&self) -> &BlockQ4Kx16 {
        self
    }
    fn fifth(&self, _: usize, _: usize, _: usize) -> u64 {
        0
    }
}

impl NibblesK for BlockQ5Kx16 {
    const FIFTH: bool = true;
    fn low(&self) -> &BlockQ4Kx16 {
        &self.low
    }
    fn fifth(&self, j: usize, c: usize, h: usize) -> u64 {
        self.qh[8 * j + 2 * c + h]
    }
}

/// `Q6_K`, 16 rows of one super-block: each 32-value sub-block's low four bits in `Q4_1x16`'s
/// nibble layout (256 bytes), and its high two bits in 128 bytes: 64 for the values in low
/// nibbles, then 64 for those in high ones, byte `4·ri + t` holding chunk `c`'s two bits at bits
/// `2c..2c + 2`. The low nibbles of a sub-block are its first 16 values and the high nibbles its
/// last 16, so each nibble has one scale. 3,360 bytes, 210 per row (as in the file).
#[repr(C, align(32))]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ6Kx16 {
    pub ql: [u8; SUBS * GROUP * QK / 2],
    pub qh: [u8; SUBS * GROUP * QK / 4],
    /// `scales[GROUP * g + ri]`: 16-value group `g`, row `ri`.
    pub scales: [i8; 2 * SUBS * GROUP],
    pub d: [f16; GROUP],
}

/// `Q8_0`, 16 rows of one block: the quants offset to unsigned bytes (`w + 128`, the sign bit
/// flipped), so `vpdpbusd` takes them as its unsigned operand and the signed activations as the
/// other; the kernels take the offset back off with the activations' block sums
/// (`Σ (w + 128)·a = Σ w·a + 128·Σ a`). 544 bytes, 34 per row (as in the file), a whole number
/// of 32-byte halves.
#[repr(C, align(32))]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_0x16 {
    pub qs: [u8; GROUP * QK],
    pub d: [f16; GROUP],
}

#[cfg(test)]
/// Packs `rows` rows of blocks with `pack` into a fresh buffer of `ceil(rows / GROUP) × nb`
/// groups (padded with zero rows), advised for huge pages.
pub fn pack_all<S, D: Zeroable>(
    rows: usize,
    nb: usize,
    src: &[S],
    pack: fn(usize, usize, &[S], &mut [D]),
) -> crate::memory::HugeBuf<D> {
    let mut out = crate::memory::HugeBuf::zeroed(rows.div_ceil(GROUP) * nb);
    pack(rows, nb, src, &mut out);
    out
}

/// Calls `pack(dst, ri, s)` for every packed block `dst` of `out` (`ceil(rows / GROUP) × nb`
/// zeroed groups, the last padded with zero rows) and every row `ri` of it that `src` (`rows ×
/// nb` blocks) has, `s` being that row's source block.
fn each_row_block<S, D>(
    rows: usize,
    nb: usize,
    src: &[S],
    out: &mut [D],
    mut pack: impl FnMut(&mut D, usize, &S),
) {
    debug_assert_eq!(out.len(), rows.div_ceil(GROUP) * nb);
    for (i, dst) in out.iter_mut().enumerate() {
        let (g, b) = (i / nb, i % nb);
        for ri in 0..GROUP.min(rows - g * GROUP) {
            pack(dst, ri, &src[(g * GROUP + ri) * nb + b]);
        }
    }
}

/// The `pack_*` functions pack `rows × (nb blocks)` into `out`, as [`each_row_block`] walks it.
pub fn pack_q4_1(rows: usize, nb: usize, src: &[BlockQ4_1], out: &mut [BlockQ4_1x16]) {
    each_row_block(rows, nb, src, out, |dst, ri, s| {
        dst.d[ri] = s.d;
        dst.m[ri] = s.m;
        for j in 0..4 {
            let at = CHUNK * j + ri * 4;
            dst.qs[at..at + 4].copy_from_slice(&s.qs[4 * j..4 * j + 4]);
        }
    });
}

pub fn pack_q5_0(rows: usize, nb: usize, src: &[BlockQ5_0], out: &mut [BlockQ5_0x16]) {
    each_row_block(rows, nb, src, out, |dst, ri, s| {
        let q = s.quants();
        dst.d[ri] = s.d;
        for j in 0..4 {
            for t in 0..4 {
                let (lo, hi) = (q[4 * j + t], q[16 + 4 * j + t]);
                dst.qs[CHUNK * j + ri * 4 + t] = (lo & 0x0F) | ((hi & 0x0F) << 4);
                let bit = 4 * ri + t;
                dst.qh[2 * j] |= u64::from(lo >> 4) << bit;
                dst.qh[2 * j + 1] |= u64::from(hi >> 4) << bit;
            }
        }
    });
}

/// The byte of a 32-value block's nibble layout that holds values `4c + t` (low nibble) and
/// `16 + 4c + t` (high nibble) of row `ri`.
fn nibble_at(c: usize, ri: usize, t: usize) -> usize {
    CHUNK * c + ri * 4 + t
}

pub fn pack_q4_k(rows: usize, nbk: usize, src: &[BlockQ4K], out: &mut [BlockQ4Kx16]) {
    each_row_block(rows, nbk, src, out, pack_q4_k_row);
}

/// Row `ri` of `dst`: `s`'s scales, minimums and (the low four bits of) its quants.
fn pack_q4_k_row(dst: &mut BlockQ4Kx16, ri: usize, s: &impl ScaledK) {
    let s = s.low();
    dst.d[ri] = s.d;
    dst.dmin[ri] = s.dmin;
    for j in 0..SUBS {
        (dst.scales[GROUP * j + ri], dst.mins[GROUP * j + ri]) = s.scale_min(j);
        let q = s.quants(j);
        let qs = &mut dst.qs[j * GROUP * QK / 2..];
        for c in 0..4 {
            for t in 0..4 {
                qs[nibble_at(c, ri, t)] = q[4 * c + t] | (q[16 + 4 * c + t] << 4);
            }
        }
    }
}

pub fn pack_q5_k(rows: usize, nbk: usize, src: &[BlockQ5K], out: &mut [BlockQ5Kx16]) {
    each_row_block(rows, nbk, src, out, |dst, ri, s| {
        pack_q4_k_row(&mut dst.low, ri, s);
        for j in 0..SUBS {
            for (e, &bit) in s.fifth(j).iter().enumerate() {
                let (c, t) = ((e % 16) / 4, e % 4);
                dst.qh[8 * j + 2 * c + e / 16] |= u64::from(bit) << (4 * ri + t);
            }
        }
    });
}

pub fn pack_q6_k(rows: usize, nbk: usize, src: &[BlockQ6K], out: &mut [BlockQ6Kx16]) {
    each_row_block(rows, nbk, src, out, |dst, ri, s| {
        dst.d[ri] = s.d;
        for (gi, &sc) in s.scales.iter().enumerate() {
            dst.scales[GROUP * gi + ri] = sc;
        }
        let q = s.quants();
        for j in 0..SUBS {
            let q = &q[QK * j..QK * (j + 1)];
            for c in 0..4 {
                for t in 0..4 {
                    let (lo, hi) = (q[4 * c + t], q[16 + 4 * c + t]);
                    dst.ql[j * GROUP * QK / 2 + nibble_at(c, ri, t)] =
                        (lo & 0x0F) | ((hi & 0x0F) << 4);
                    let at = j * GROUP * QK / 4 + 4 * ri + t;
                    dst.qh[at] |= (lo >> 4) << (2 * c);
                    dst.qh[at + CHUNK] |= (hi >> 4) << (2 * c);
                }
            }
        }
    });
}

pub fn pack_q8_0(rows: usize, nb: usize, src: &[BlockQ8_0], out: &mut [BlockQ8_0x16]) {
    each_row_block(rows, nb, src, out, |dst, ri, s| {
        dst.d[ri] = s.d;
        for (e, &q) in s.qs.iter().enumerate() {
            dst.qs[CHUNK * (e / 4) + ri * 4 + e % 4] = q as u8 ^ 0x80;
        }
    });
}

/// Row `ri` of a group's block, as 32 unsigned quants (`Q4_1`).
pub fn q4_1_quants(block: &BlockQ4_1x16, ri: usize) -> [u8; QK] {
    let mut q = [0u8; QK];
    for j in 0..4 {
        for t in 0..4 {
            let byte = block.qs[CHUNK * j + ri * 4 + t];
            q[4 * j + t] = byte & 0x0F;
            q[16 + 4 * j + t] = byte >> 4;
        }
    }
    q
}

/// Row `ri` of a group's block, as 32 unsigned quants (`Q5_0`).
pub fn q5_0_quants(block: &BlockQ5_0x16, ri: usize) -> [u8; QK] {
    let mut q = [0u8; QK];
    for j in 0..4 {
        for t in 0..4 {
            let (byte, bit) = (block.qs[CHUNK * j + ri * 4 + t], 4 * ri + t);
            let fifth = |mask: u64| (((mask >> bit) & 1) as u8) << 4;
            q[4 * j + t] = (byte & 0x0F) | fifth(block.qh[2 * j]);
            q[16 + 4 * j + t] = (byte >> 4) | fifth(block.qh[2 * j + 1]);
        }
    }
    q
}

/// Sub-block `j` of row `ri` of a group's block, as 32 unsigned quants (`Q4_K`).
pub fn q4_k_quants(block: &BlockQ4Kx16, ri: usize, j: usize) -> [u8; QK] {
    let qs = &block.qs[j * GROUP * QK / 2..];
    std::array::from_fn(|e| {
        let (c, t) = ((e % 16) / 4, e % 4);
        let byte = qs[nibble_at(c, ri, t)];
        if e < 16 { byte & 0x0F } else { byte >> 4 }
    })
}

/// Sub-block `j` of row `ri` of a group's block, as 32 unsigned quants (`Q6_K`).
pub fn q6_k_quants(block: &BlockQ6Kx16, ri: usize, j: usize) -> [u8; QK] {
    let ql = &block.ql[j * GROUP * QK / 2..];
    let qh = &block.qh[j * GROUP * QK / 4..];
    std::array::from_fn(|e| {
        let (c, t) = ((e % 16) / 4, e % 4);
        let byte = ql[nibble_at(c, ri, t)];
        let high = qh[4 * ri + t + if e < 16 { 0 } else { CHUNK }] >> (2 * c) & 3;
        (if e < 16 { byte & 0x0F } else { byte >> 4 }) | (high << 4)
    })
}

/// Row `ri` of a group's block, as 32 signed quants (`Q8_0`).
pub fn q8_0_quants(block: &BlockQ8_0x16, ri: usize) -> [i8; QK] {
    std::array::from_fn(|e| (block.qs[CHUNK * (e / 4) + ri * 4 + e % 4] ^ 0x80) as i8)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::quant::{quantize_row_q4_1, quantize_row_q5_0, quantize_row_q8_0};

    /// K-quant blocks of pseudo-random bytes: every bit pattern is a valid block.
    pub(crate) fn random_blocks<T: Pod>(n: usize, seed: u32) -> Vec<T> {
        let mut state = seed.wrapping_mul(2_654_435_761).max(1);
        let bytes: Vec<u8> = (0..n * size_of::<T>())
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                (state >> 8) as u8
            })
            .collect();
        bytemuck::pod_collect_to_vec(&bytes)
    }

    #[test]
    fn k_quant_packing_keeps_every_value_in_place() {
        let (rows, nbk) = (21, 2);
        let mut q4: Vec<BlockQ4K> = random_blocks(rows * nbk, 1);
        let mut q6: Vec<BlockQ6K> = random_blocks(rows * nbk, 2);
        let q5: Vec<BlockQ5K> = random_blocks(rows * nbk, 3);
        // Finite scales: random bytes may spell an f16 NaN, which packing must keep as it is
        // but `assert_eq` cannot compare.
        for b in &mut q4 {
            (b.d, b.dmin) = (f16::from_f32(0.5), f16::from_f32(0.25));
        }
        for b in &mut q6 {
            b.d = f16::from_f32(0.5);
        }
        let (p4, p5, p6) = (
            pack_all(rows, nbk, &q4, pack_q4_k),
            pack_all(rows, nbk, &q5, pack_q5_k),
            pack_all(rows, nbk, &q6, pack_q6_k),
        );
        for r in 0..rows {
            let (g, ri) = (r / GROUP, r % GROUP);
            for b in 0..nbk {
                let (s4, s6) = (&q4[r * nbk + b], &q6[r * nbk + b]);
                let (k4, k6) = (&p4[g * nbk + b], &p6[g * nbk + b]);
                let all6 = s6.quants();
                let (s5, k5) = (&q5[r * nbk + b], &p5[g * nbk + b]);
                for j in 0..SUBS {
                    assert_eq!(q4_k_quants(k4, ri, j), s4.quants(j));
                    assert_eq!(k5.quants(ri, j), ScaledK::quants(s5, j));
                    assert!(k5.quants(ri, j).iter().any(|&q| q > 15), "fifth bits set");
                    assert_eq!(
                        (k5.low.scales[GROUP * j + ri], k5.low.mins[GROUP * j + ri]),
                        s5.low().scale_min(j)
                    );
                    assert_eq!(
                        (k4.scales[GROUP * j + ri], k4.mins[GROUP * j + ri]),
                        s4.scale_min(j)
                    );
                    assert_eq!(q6_k_quants(k6, ri, j)[..], all6[QK * j..QK * (j + 1)]);
                }
                for gi in 0..16 {
                    assert_eq!(k6.scales[GROUP * gi + ri], s6.scales[gi]);
                }
                assert_eq!((k4.d[ri], k4.dmin[ri], k6.d[ri]), (s4.d, s4.dmin, s6.d));
            }
        }
    }

    #[test]
    fn packing_keeps_every_value_in_place() {
        let (rows, cols) = (19, 64);
        let nb = cols / QK;
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7) % 23) as f32 - 11.0)
            .collect();
        let mut q4 = vec![BlockQ4_1::zeroed(); rows * nb];
        let mut q5 = vec![BlockQ5_0::zeroed(); rows * nb];
        let mut q8 = vec![BlockQ8_0::zeroed(); rows * nb];
        quantize_row_q4_1(&x, &mut q4);
        quantize_row_q5_0(&x, &mut q5);
        quantize_row_q8_0(&x, &mut q8);
        let p4 = pack_all(rows, nb, &q4, pack_q4_1);
        let p5 = pack_all(rows, nb, &q5, pack_q5_0);
        let p8 = pack_all(rows, nb, &q8, pack_q8_0);
        assert_eq!(p4.len(), 2 * nb);
        for r in 0..rows {
            for b in 0..nb {
                let (g, ri) = (r / GROUP, r % GROUP);
                let (s4, s8) = (&q4[r * nb + b], &q8[r * nb + b]);
                let u = q4_1_quants(&p4[g * nb + b], ri);
                for i in 0..QK / 2 {
                    assert_eq!(u[i], s4.qs[i] & 0x0F);
                    assert_eq!(u[i + 16], s4.qs[i] >> 4);
                }
                assert_eq!(q8_0_quants(&p8[g * nb + b], ri), s8.qs);
                let s5 = &q5[r * nb + b];
                assert_eq!(q5_0_quants(&p5[g * nb + b], ri), s5.quants());
                assert_eq!(p5[g * nb + b].d[ri], s5.d);
                assert_eq!(p4[g * nb + b].d[ri], s4.d);
                assert_eq!(p8[g * nb + b].d[ri], s8.d);
            }
        }
    }
}
