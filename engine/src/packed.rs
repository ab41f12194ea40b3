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

use crate::quant::{BlockQ4_1, BlockQ5_0, BlockQ8_0, QK};

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

#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_0x16 {
    pub d: [f16; GROUP],
    /// Each row's sum of quants, for kernels that shift the activations to unsigned bytes
    /// (`Σ (a + 128)·w = Σ a·w + 128·Σ w`).
    pub sum: [i32; GROUP],
    pub qs: [i8; GROUP * QK],
}

/// Packs `rows × (nb blocks)` into `ceil(rows / GROUP) × nb` groups, padding with zero rows.
pub fn pack_q4_1(rows: usize, nb: usize, src: &[BlockQ4_1]) -> Vec<BlockQ4_1x16> {
    let groups = rows.div_ceil(GROUP);
    let mut out: Vec<BlockQ4_1x16> = crate::memory::zeroed_vec(groups * nb);
    for (i, dst) in out.iter_mut().enumerate() {
        let (g, b) = (i / nb, i % nb);
        for ri in 0..GROUP.min(rows - g * GROUP) {
            let s = &src[(g * GROUP + ri) * nb + b];
            dst.d[ri] = s.d;
            dst.m[ri] = s.m;
            for j in 0..4 {
                let at = CHUNK * j + ri * 4;
                dst.qs[at..at + 4].copy_from_slice(&s.qs[4 * j..4 * j + 4]);
            }
        }
    }
    out
}

pub fn pack_q5_0(rows: usize, nb: usize, src: &[BlockQ5_0]) -> Vec<BlockQ5_0x16> {
    let groups = rows.div_ceil(GROUP);
    let mut out: Vec<BlockQ5_0x16> = crate::memory::zeroed_vec(groups * nb);
    for (i, dst) in out.iter_mut().enumerate() {
        let (g, b) = (i / nb, i % nb);
        for ri in 0..GROUP.min(rows - g * GROUP) {
            let s = &src[(g * GROUP + ri) * nb + b];
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
        }
    }
    out
}

pub fn pack_q8_0(rows: usize, nb: usize, src: &[BlockQ8_0]) -> Vec<BlockQ8_0x16> {
    let groups = rows.div_ceil(GROUP);
    let mut out: Vec<BlockQ8_0x16> = crate::memory::zeroed_vec(groups * nb);
    for (i, dst) in out.iter_mut().enumerate() {
        let (g, b) = (i / nb, i % nb);
        for ri in 0..GROUP.min(rows - g * GROUP) {
            let s = &src[(g * GROUP + ri) * nb + b];
            dst.d[ri] = s.d;
            dst.sum[ri] = s.qs.iter().map(|&q| i32::from(q)).sum();
            for j in 0..8 {
                let at = CHUNK * j + ri * 4;
                dst.qs[at..at + 4].copy_from_slice(&s.qs[4 * j..4 * j + 4]);
            }
        }
    }
    out
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

/// Row `ri` of a group's block, as 32 signed quants (`Q8_0`).
pub fn q8_0_quants(block: &BlockQ8_0x16, ri: usize) -> [i8; QK] {
    let mut q = [0i8; QK];
    for j in 0..8 {
        let at = CHUNK * j + ri * 4;
        q[4 * j..4 * j + 4].copy_from_slice(&block.qs[at..at + 4]);
    }
    q
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{quantize_row_q4_1, quantize_row_q5_0, quantize_row_q8_0};

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
        let p4 = pack_q4_1(rows, nb, &q4);
        let p5 = pack_q5_0(rows, nb, &q5);
        let p8 = pack_q8_0(rows, nb, &q8);
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
                let sum: i32 = s8.qs.iter().map(|&q| i32::from(q)).sum();
                assert_eq!(p8[g * nb + b].sum[ri], sum);
            }
        }
    }
}
