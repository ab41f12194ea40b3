//! The portable kernels, for builds without x86-64-v3: the same sums, one weight row and one
//! activation row at a time.

use super::TileOut;
use crate::packed::{BlockQ4_1x16, BlockQ5_0x16, BlockQ6Kx16, BlockQ8_0x16};
use crate::packed::{GROUP, NibblesK, SUBS, q6_k_quants};
use crate::quant::{BlockQ8_1, QK};

pub(super) fn tile_q4_k(w: &[impl NibblesK], acts: &[BlockQ8_1], t: usize, out: &mut TileOut) {
    let nb = w.len() * SUBS;
    for (k, o) in out[..t].iter_mut().enumerate() {
        for (ri, o) in o.iter_mut().enumerate() {
            *o = 0.0;
            for (b, blk) in w.iter().enumerate() {
                for j in 0..SUBS {
                    let a = &acts[k * nb + b * SUBS + j];
                    let isum = int_dot(blk.quants(ri, j).map(i32::from), a);
                    let low = blk.low();
                    let d = low.d[ri].to_f32() * f32::from(low.scales[GROUP * j + ri]);
                    let m = low.dmin[ri].to_f32() * f32::from(low.mins[GROUP * j + ri]);
                    *o += d * a.d * isum as f32 - m * a.s;
                }
            }
        }
    }
}

pub(super) fn tile_q6_k(w: &[BlockQ6Kx16], acts: &[BlockQ8_1], t: usize, out: &mut TileOut) {
    let nb = w.len() * SUBS;
    for (k, o) in out[..t].iter_mut().enumerate() {
        for (ri, o) in o.iter_mut().enumerate() {
            *o = 0.0;
            for (b, blk) in w.iter().enumerate() {
                for j in 0..SUBS {
                    let a = &acts[k * nb + b * SUBS + j];
                    let q = q6_k_quants(blk, ri, j);
                    for half in 0..2 {
                        let isum: i32 = q[16 * half..16 * half + 16]
                            .iter()
                            .zip(&a.qs[16 * half..])
                            .map(|(&x, &y)| (i32::from(x) - 32) * i32::from(y))
                            .sum();
                        let sc = f32::from(blk.scales[GROUP * (2 * j + half) + ri]);
                        *o += blk.d[ri].to_f32() * sc * a.d * isum as f32;
                    }
                }
            }
        }
    }
}

pub(super) fn tile_q4_1(w: &[BlockQ4_1x16], acts: &[BlockQ8_1], t: usize, out: &mut TileOut) {
    scalar_tile(w, acts, t, out, |blk, ri, a| {
        let isum = int_dot(crate::packed::q4_1_quants(blk, ri).map(i32::from), a);
        blk.d[ri].to_f32() * a.d * isum as f32 + blk.m[ri].to_f32() * a.s
    });
}

/// Nothing: the portable `Q5_0` tile reads its quants from the blocks (the x86 kernels'
/// scratch keeps a group's decoded quants).
#[derive(Default)]
pub(super) struct Q5_0Scratch;

impl Q5_0Scratch {
    pub(super) fn decode(&mut self, _: &[BlockQ5_0x16], _: usize) -> Option<&[()]> {
        None
    }
}

pub(super) fn tile_q5_0(
    w: &[BlockQ5_0x16],
    _: Option<&[()]>,
    acts: &[BlockQ8_1],
    t: usize,
    out: &mut TileOut,
) {
    scalar_tile(w, acts, t, out, |blk, ri, a| {
        let isum = int_dot(crate::packed::q5_0_quants(blk, ri).map(i32::from), a);
        let isum = isum - 16 * a.sum();
        blk.d[ri].to_f32() * a.d * isum as f32
    });
}

pub(super) fn tile_q8_0(w: &[BlockQ8_0x16], acts: &[BlockQ8_1], t: usize, out: &mut TileOut) {
    scalar_tile(w, acts, t, out, |blk, ri, a| {
        let isum = int_dot(crate::packed::q8_0_quants(blk, ri).map(i32::from), a);
        blk.d[ri].to_f32() * a.d * isum as f32
    });
}

/// Each output is the sum over blocks of `block_dot(block, row, act)`.
fn scalar_tile<B, A>(
    w: &[B],
    acts: &[A],
    t: usize,
    out: &mut TileOut,
    block_dot: impl Fn(&B, usize, &A) -> f32,
) {
    let nb = w.len();
    for (k, o) in out[..t].iter_mut().enumerate() {
        for (ri, o) in o.iter_mut().enumerate() {
            *o = w
                .iter()
                .zip(&acts[k * nb..(k + 1) * nb])
                .map(|(blk, a)| block_dot(blk, ri, a))
                .sum();
        }
    }
}

fn int_dot(q: [i32; QK], a: &BlockQ8_1) -> i32 {
    q.iter().zip(a.qs).map(|(&x, y)| x * i32::from(y)).sum()
}
