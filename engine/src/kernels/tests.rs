//! Kernel tests: SIMD against the scalar references, and batch invariance.

use bytemuck::Zeroable;

use super::*;
use crate::quant::{
    dot_q4_1_ref, dot_q8_0_ref, quantize_row_q4_1, quantize_row_q8_0, quantize_row_q8_1,
};

fn rows(n: usize, cols: usize, seed: f32) -> Vec<f32> {
    (0..n * cols)
        .map(|i| ((i as f32 + seed) * 0.7123).sin() * 2.0)
        .collect()
}

fn acts(n: usize, cols: usize) -> Vec<BlockQ8_1> {
    let x = rows(n, cols, 3.0);
    let mut a = vec![BlockQ8_1::zeroed(); n * cols / QK];
    quantize_row_q8_1(&x, &mut a);
    a
}

fn check(raw: &RawMatrix, n: usize) {
    let m = &QMatrix::new(RawMatrix {
        rows: raw.rows,
        cols: raw.cols,
        data: match &raw.data {
            RawWeights::Q4_1(b) => RawWeights::Q4_1(b.clone()),
            RawWeights::Q8_0(b) => RawWeights::Q8_0(b.clone()),
        },
    });
    let nb = m.blocks_per_row();
    let a = acts(n, m.cols);
    let mut out = vec![0f32; n * m.rows];
    m.matmul(&a, n, &mut out);
    for j in 0..n {
        for r in 0..m.rows {
            let aj = &a[j * nb..(j + 1) * nb];
            let want = match &raw.data {
                RawWeights::Q4_1(w) => dot_q4_1_ref(&w[r * nb..(r + 1) * nb], aj),
                RawWeights::Q8_0(w) => dot_q8_0_ref(&w[r * nb..(r + 1) * nb], aj),
            };
            let got = out[j * m.rows + r];
            assert!(
                (want - got).abs() <= 1e-3 * want.abs().max(1.0),
                "row {r} act {j}: {got} vs {want}"
            );
        }
    }
    // Batch invariance: each activation alone gives bit-identical results.
    for j in 0..n {
        let mut single = vec![0f32; m.rows];
        m.matmul(&a[j * nb..(j + 1) * nb], 1, &mut single);
        assert_eq!(single, out[j * m.rows..(j + 1) * m.rows]);
    }
}

#[test]
fn q4_1_matches_reference_and_is_batch_invariant() {
    let (r, c) = (37, 128);
    let x = rows(r, c, 0.0);
    let mut w = vec![BlockQ4_1::zeroed(); r * c / QK];
    quantize_row_q4_1(&x, &mut w);
    let m = RawMatrix {
        rows: r,
        cols: c,
        data: RawWeights::Q4_1(w),
    };
    for n in [1, 3, 4, 9] {
        check(&m, n);
    }
}

#[test]
fn q8_0_matches_reference_and_is_batch_invariant() {
    let (r, c) = (33, 96);
    let x = rows(r, c, 1.0);
    let mut w = vec![BlockQ8_0::zeroed(); r * c / QK];
    quantize_row_q8_0(&x, &mut w);
    let m = RawMatrix {
        rows: r,
        cols: c,
        data: RawWeights::Q8_0(w),
    };
    for n in [1, 5, 8] {
        check(&m, n);
    }
}

/// The AVX2 and VNNI paths must agree bit for bit, so a node's results do not depend on which
/// one its CPU runs.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    target_feature = "f16c"
))]
#[test]
fn avx2_and_vnni_kernels_are_bit_identical() {
    if !x86::has_vnni() {
        eprintln!("no AVX-512 VNNI on this CPU: only the AVX2 path exists here");
        return;
    }
    let (rows, cols) = (GROUP, 256);
    let nb = cols / QK;
    let x: Vec<f32> = (0..rows * cols)
        .map(|i| ((i as f32) * 0.377).sin() * 3.0)
        .collect();
    let mut q4 = vec![BlockQ4_1::zeroed(); rows * nb];
    let mut q8 = vec![BlockQ8_0::zeroed(); rows * nb];
    quantize_row_q4_1(&x, &mut q4);
    quantize_row_q8_0(&x, &mut q8);
    let p4 = crate::packed::pack_q4_1(rows, nb, &q4);
    let p8 = crate::packed::pack_q8_0(rows, nb, &q8);
    let xa: Vec<f32> = (0..TILE * cols)
        .map(|i| ((i as f32) * 0.91).cos() * 2.0)
        .collect();
    let mut acts = vec![BlockQ8_1::zeroed(); TILE * nb];
    quantize_row_q8_1(&xa, &mut acts);
    let (mut a, mut b) = ([[0f32; GROUP]; TILE], [[0f32; GROUP]; TILE]);
    // SAFETY: AVX2/FMA/F16C are compiled in and VNNI was detected above.
    unsafe {
        x86::tile_q4_1::<TILE>(&p4, &acts, &mut a);
        x86::tile_q4_1_vnni::<TILE>(&p4, &acts, &mut b);
    }
    assert_eq!(a, b);
    unsafe {
        x86::tile_q8_0::<TILE>(&p8, &acts, &mut a);
        x86::tile_q8_0_vnni::<TILE>(&p8, &shift_to_unsigned(&acts), &mut b);
    }
    assert_eq!(a, b);
}
