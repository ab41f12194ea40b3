//! Kernel tests: SIMD against the scalar references, and batch invariance.

use bytemuck::Zeroable;

use super::*;
use crate::quant::{
    QK_K, dequantize_row_k, dequantize_row_q6_k, dot_f32_ref, dot_q4_1_ref, dot_q5_0_ref,
    dot_q8_0_ref, quantize_row_q4_1, quantize_row_q5_0, quantize_row_q8_0, quantize_row_q8_1,
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

fn copy(raw: &RawMatrix) -> RawMatrix {
    RawMatrix {
        rows: raw.rows,
        cols: raw.cols,
        data: match &raw.data {
            RawWeights::Q4_1(b) => RawWeights::Q4_1(b.clone()),
            RawWeights::Q5_0(b) => RawWeights::Q5_0(b.clone()),
            RawWeights::Q8_0(b) => RawWeights::Q8_0(b.clone()),
            RawWeights::Q4K(b) => RawWeights::Q4K(b.clone()),
            RawWeights::Q5K(b) => RawWeights::Q5K(b.clone()),
            RawWeights::Q6K(b) => RawWeights::Q6K(b.clone()),
        },
    }
}

/// The reference dot product of row `r` of `raw` with one activation row.
fn reference(raw: &RawMatrix, r: usize, a: &[BlockQ8_1]) -> f32 {
    let nb = raw.cols / QK;
    let blocks = r * nb..(r + 1) * nb;
    match &raw.data {
        RawWeights::Q4_1(w) => dot_q4_1_ref(&w[blocks], a),
        RawWeights::Q5_0(w) => dot_q5_0_ref(&w[blocks], a),
        RawWeights::Q8_0(w) => dot_q8_0_ref(&w[blocks], a),
        RawWeights::Q4K(w) => {
            let nbk = raw.cols / QK_K;
            let mut x = vec![0f32; raw.cols];
            dequantize_row_k(&w[r * nbk..(r + 1) * nbk], &mut x);
            dot_f32_ref(&x, a)
        }
        RawWeights::Q5K(w) => {
            let nbk = raw.cols / QK_K;
            let mut x = vec![0f32; raw.cols];
            dequantize_row_k(&w[r * nbk..(r + 1) * nbk], &mut x);
            dot_f32_ref(&x, a)
        }
        RawWeights::Q6K(w) => {
            let nbk = raw.cols / QK_K;
            let mut x = vec![0f32; raw.cols];
            dequantize_row_q6_k(&w[r * nbk..(r + 1) * nbk], &mut x);
            dot_f32_ref(&x, a)
        }
    }
}

/// K-quant weights of pseudo-random bytes, with scales that keep the values moderate.
/// Random K-quant super-blocks of one type (`Q4_K`, `Q5_K` or `Q6_K`) with sane scales.
#[derive(Clone, Copy)]
enum KType {
    Q4K,
    Q5K,
    Q6K,
}

fn k_quant(rows: usize, cols: usize, ty: KType, seed: u32) -> RawMatrix {
    use crate::packed::tests::random_blocks;
    let n = rows * cols / QK_K;
    let d = |i: usize, step: f32, m: usize| half::f16::from_f32(step * (1 + i % m) as f32);
    let data = match ty {
        KType::Q6K => {
            let mut b: Vec<BlockQ6K> = random_blocks(n, seed);
            b.iter_mut()
                .enumerate()
                .for_each(|(i, b)| b.d = d(i, 0.001, 7));
            RawWeights::Q6K(b)
        }
        KType::Q4K => {
            let mut b: Vec<BlockQ4K> = random_blocks(n, seed);
            for (i, b) in b.iter_mut().enumerate() {
                (b.d, b.dmin) = (d(i, 0.002, 5), d(i, 0.003, 3));
            }
            RawWeights::Q4K(b)
        }
        KType::Q5K => {
            let mut b: Vec<BlockQ5K> = random_blocks(n, seed);
            for (i, b) in b.iter_mut().enumerate() {
                (b.d, b.dmin) = (d(i, 0.001, 5), d(i, 0.003, 3));
            }
            RawWeights::Q5K(b)
        }
    };
    RawMatrix { rows, cols, data }
}

#[test]
fn k_quants_match_reference_and_are_batch_invariant() {
    for ty in [KType::Q4K, KType::Q5K, KType::Q6K] {
        let m = k_quant(37, 512, ty, 3);
        for n in [1, 2, 5, 8, 11] {
            check(&m, n);
        }
        let mut row = vec![0f32; 512];
        let q = QMatrix::new(copy(&m));
        q.dequantize_row(19, &mut row);
        let mut want = vec![0f32; 512];
        match &m.data {
            RawWeights::Q4K(w) => dequantize_row_k(&w[19 * 2..20 * 2], &mut want),
            RawWeights::Q5K(w) => dequantize_row_k(&w[19 * 2..20 * 2], &mut want),
            RawWeights::Q6K(w) => dequantize_row_q6_k(&w[19 * 2..20 * 2], &mut want),
            _ => unreachable!(),
        }
        for (a, b) in row.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{a} vs {b}");
        }
    }
}

/// Matrices of one width stacked, each in its own type: rows index into them in order.
fn check_stack(raws: &[RawMatrix], n: usize) {
    let m = &QMatrix::stack(raws.iter().map(copy).collect()).expect("stack");
    let nb = m.blocks_per_row();
    let a = acts(n, m.cols);
    let mut out = vec![0f32; n * m.rows];
    m.matmul(&a, n, &mut out);
    for j in 0..n {
        let aj = &a[j * nb..(j + 1) * nb];
        let mut r = 0;
        for raw in raws {
            for rr in 0..raw.rows {
                let (want, got) = (reference(raw, rr, aj), out[j * m.rows + r]);
                assert!(
                    (want - got).abs() <= 1e-3 * want.abs().max(1.0),
                    "row {r} act {j}: {got} vs {want}"
                );
                r += 1;
            }
        }
    }
}

fn check(raw: &RawMatrix, n: usize) {
    let m = &QMatrix::new(copy(raw));
    let nb = m.blocks_per_row();
    let a = acts(n, m.cols);
    let mut out = vec![0f32; n * m.rows];
    m.matmul(&a, n, &mut out);
    for j in 0..n {
        for r in 0..m.rows {
            let aj = &a[j * nb..(j + 1) * nb];
            let want = reference(raw, r, aj);
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

#[test]
fn q5_0_matches_reference_and_is_batch_invariant() {
    let (r, c) = (35, 160);
    let x = rows(r, c, 2.0);
    let mut w = vec![BlockQ5_0::zeroed(); r * c / QK];
    quantize_row_q5_0(&x, &mut w);
    let m = RawMatrix {
        rows: r,
        cols: c,
        data: RawWeights::Q5_0(w),
    };
    for n in [1, 2, 7, 8, 11] {
        check(&m, n);
    }
}

#[test]
fn a_stack_of_types_computes_each_part_with_its_own_kernel() {
    let c = 96;
    let raw = |r: usize, seed: f32, ty: u8| {
        let x = rows(r, c, seed);
        let nb = r * c / QK;
        let data = match ty {
            0 => {
                let mut w = vec![BlockQ5_0::zeroed(); nb];
                quantize_row_q5_0(&x, &mut w);
                RawWeights::Q5_0(w)
            }
            1 => {
                let mut w = vec![BlockQ8_0::zeroed(); nb];
                quantize_row_q8_0(&x, &mut w);
                RawWeights::Q8_0(w)
            }
            _ => {
                let mut w = vec![BlockQ4_1::zeroed(); nb];
                quantize_row_q4_1(&x, &mut w);
                RawWeights::Q4_1(w)
            }
        };
        RawMatrix {
            rows: r,
            cols: c,
            data,
        }
    };
    // Part sizes off the 16-row groups, so padding rows must not leak into the next part.
    let parts = [raw(20, 0.0, 0), raw(9, 1.0, 1), raw(17, 2.0, 2)];
    for n in [1, 3, 9] {
        check_stack(&parts, n);
    }
    let m = QMatrix::stack(parts.iter().map(copy).collect()).expect("stack");
    let mut row = vec![0f32; c];
    m.dequantize_row(20 + 9 + 3, &mut row);
    let RawWeights::Q4_1(w) = &parts[2].data else {
        unreachable!()
    };
    let mut want = vec![0f32; c];
    crate::quant::dequantize_row_q4_1(&w[3 * c / QK..4 * c / QK], &mut want);
    assert_eq!(row, want);
}

/// The AVX2 and VNNI paths must agree bit for bit, so a node's results do not depend on which
/// one its CPU runs.
#[cfg(x86_v3)]
#[test]
fn avx2_and_vnni_kernels_are_bit_identical() {
    if !crate::cpu::has_avx512_vnni() {
        eprintln!("no AVX-512 VNNI on this CPU: only the AVX2 path exists here");
        return;
    }
    let (rows, cols) = (GROUP, 256);
    let nb = cols / QK;
    let x: Vec<f32> = (0..rows * cols)
        .map(|i| ((i as f32) * 0.377).sin() * 3.0)
        .collect();
    let mut q4 = vec![BlockQ4_1::zeroed(); rows * nb];
    let mut q5 = vec![BlockQ5_0::zeroed(); rows * nb];
    let mut q8 = vec![BlockQ8_0::zeroed(); rows * nb];
    quantize_row_q4_1(&x, &mut q4);
    quantize_row_q5_0(&x, &mut q5);
    quantize_row_q8_0(&x, &mut q8);
    let p4 = crate::packed::pack_all(rows, nb, &q4, crate::packed::pack_q4_1);
    let p5 = crate::packed::pack_all(rows, nb, &q5, crate::packed::pack_q5_0);
    let p8 = crate::packed::pack_all(rows, nb, &q8, crate::packed::pack_q8_0);
    let xa: Vec<f32> = (0..TILE * cols)
        .map(|i| ((i as f32) * 0.91).cos() * 2.0)
        .collect();
    let mut acts = vec![BlockQ8_1::zeroed(); TILE * nb];
    quantize_row_q8_1(&xa, &mut acts);
    let (mut a, mut b) = ([[0f32; GROUP]; TILE], [[0f32; GROUP]; TILE]);
    // SAFETY: AVX2/FMA/F16C are compiled in and VNNI was detected above.
    unsafe {
        avx2::tile_q4_1::<TILE>(&p4, &acts, &mut a);
        avx512::tile_q4_1_vnni::<TILE>(&p4, &acts, &mut b);
    }
    assert_eq!(a, b);
    unsafe {
        avx2::tile_q5_0::<TILE>(&p5, None, &acts, &mut a);
        avx512::tile_q5_0_vnni::<TILE>(&p5, &acts, &mut b);
    }
    assert_eq!(a, b);
    // The same blocks decoded once to bytes, as a prefill's passes over a group read them.
    let mut bytes = Vec::new();
    unsafe {
        avx2::decode_q5_0(&p5, &mut bytes);
        avx2::tile_q5_0::<TILE>(&p5, Some(&bytes), &acts, &mut a);
    }
    assert_eq!(a, b);
    let RawWeights::Q4K(k4) = k_quant(GROUP, cols, KType::Q4K, 5).data else {
        unreachable!()
    };
    let RawWeights::Q5K(k5) = k_quant(GROUP, cols, KType::Q5K, 7).data else {
        unreachable!()
    };
    let RawWeights::Q6K(k6) = k_quant(GROUP, cols, KType::Q6K, 6).data else {
        unreachable!()
    };
    let (p4k, p5k, p6k) = (
        crate::packed::pack_all(GROUP, cols / QK_K, &k4, crate::packed::pack_q4_k),
        crate::packed::pack_all(GROUP, cols / QK_K, &k5, crate::packed::pack_q5_k),
        crate::packed::pack_all(GROUP, cols / QK_K, &k6, crate::packed::pack_q6_k),
    );
    unsafe {
        avx2::tile_q4_k::<TILE>(&p4k, &acts, &mut a);
        avx512::tile_q4_k_vnni::<TILE>(&p4k, &acts, &mut b);
    }
    assert_eq!(a, b);
    unsafe {
        avx2::tile_q4_k::<TILE>(&p5k, &acts, &mut a);
        avx512::tile_q4_k_vnni::<TILE>(&p5k, &acts, &mut b);
    }
    assert_eq!(a, b);
    unsafe {
        avx2::tile_q6_k::<TILE>(&p6k, &acts, &mut a);
        avx512::tile_q6_k_vnni::<TILE>(&p6k, &acts, &mut b);
    }
    assert_eq!(a, b);
    unsafe {
        avx2::tile_q8_0::<TILE>(&p8, &acts, &mut a);
        avx512::tile_q8_0_vnni::<TILE>(&p8, &acts, &mut b);
    }
    assert_eq!(a, b);
}

/// The AVX2 `Q5_0` kernel's i16 sums are exact at the extremes: quants 0 and 31 against
/// activations ±127, in the patterns that drive a sum furthest from zero either way, read
/// both from the packed block and decoded.
#[cfg(x86_v3)]
#[test]
fn avx2_q5_0_sums_are_exact_at_the_extremes() {
    let signs: [fn(usize) -> f32; 3] = [|_| 1.0, |_| -1.0, |i| if i % 3 == 0 { 1.0 } else { -1.0 }];
    for sign in signs {
        let x: Vec<f32> = (0..QK).map(|i| sign(i) * 2.0).collect();
        let mut acts = [BlockQ8_1::zeroed()];
        quantize_row_q8_1(&x, &mut acts);
        let a = acts[0];
        assert!(a.qs.iter().all(|q| q.abs() == 127));
        // Each row's quants: all 0, all 31, 31 where the activation is positive (else 0), or
        // the reverse.
        let quants = |r: usize| -> [u8; QK] {
            std::array::from_fn(|i| match (r % 4, a.qs[i] > 0) {
                (0, _) | (2, false) | (3, true) => 0,
                _ => 31,
            })
        };
        let w: Vec<BlockQ5_0> = (0..GROUP)
            .map(|r| BlockQ5_0::from_quants(half::f16::from_f32(0.5), &quants(r)))
            .collect();
        assert!((0..GROUP).all(|r| w[r].quants() == quants(r)));
        let packed = crate::packed::pack_all(GROUP, 1, &w, crate::packed::pack_q5_0);
        let mut bytes = Vec::new();
        // SAFETY: AVX2/FMA/F16C are compiled in; one activation row, one block, one group.
        unsafe { avx2::decode_q5_0(&packed, &mut bytes) };
        for decoded in [None, Some(&bytes[..])] {
            let mut out = [[0f32; GROUP]];
            // SAFETY: as above.
            unsafe { avx2::tile_q5_0::<1>(&packed, decoded, &acts, &mut out) };
            for (r, &got) in out[0].iter().enumerate() {
                let isum: i32 = (quants(r).iter().zip(a.qs))
                    .map(|(&q, a)| (i32::from(q) - 16) * i32::from(a))
                    .sum();
                assert_eq!(got, w[r].d.to_f32() * a.d * isum as f32, "row {r}");
            }
        }
    }
}

/// The AVX2 `Q6_K` kernel's i16 sums of two chunks' products are exact at the extremes: every
/// quant 63 against activations all 127 or all −127, each lane's pair of chunks at ±32004.
#[cfg(x86_v3)]
#[test]
fn avx2_q6_k_sums_are_exact_at_the_extremes() {
    let block = BlockQ6K {
        ql: [0xFF; QK_K / 2],
        qh: [0xFF; QK_K / 4],
        scales: [1; QK_K / 16],
        d: half::f16::from_f32(1.0),
    };
    assert!(block.quants().iter().all(|&q| q == 63));
    let packed = crate::packed::pack_all(GROUP, 1, &vec![block; GROUP], crate::packed::pack_q6_k);
    for sign in [1.0f32, -1.0] {
        let x = vec![2.0 * sign; QK_K];
        let mut acts = vec![BlockQ8_1::zeroed(); QK_K / QK];
        quantize_row_q8_1(&x, &mut acts);
        assert!(
            acts.iter()
                .all(|a| a.qs.iter().all(|&q| q == 127 * sign as i8))
        );
        let mut out = [[0f32; GROUP]];
        // SAFETY: AVX2/FMA/F16C are compiled in; one activation row, one block, one group.
        unsafe { avx2::tile_q6_k::<1>(&packed, &acts, &mut out) };
        // Each sub-block's two halves: 16 products (63 − 32)·(±127), scaled by `d·sc·d_a`.
        let half_sum = (31 * 127 * 16) as f32 * sign;
        let want = acts
            .iter()
            .flat_map(|a| [a.d; 2])
            .fold(0f32, |acc, ad| half_sum.mul_add(ad, acc));
        assert!(
            out[0].iter().all(|&got| got == want),
            "{sign}: {:?} vs {want}",
            out[0]
        );
    }
}

/// A matrix fed in chunks of rows (as the loader reads a file) equals the same matrix stacked
/// whole, for every part type and a short last chunk.
#[test]
fn a_matrix_built_chunk_by_chunk_equals_it_built_whole() {
    let (rows, cols) = (70, 256);
    let nb = cols / QK;
    let x = self::rows(rows, cols, 4.0);
    let mut q5 = vec![BlockQ5_0::zeroed(); rows * nb];
    quantize_row_q5_0(&x, &mut q5);
    let RawWeights::Q6K(k6) = k_quant(rows, cols, KType::Q6K, 9).data else {
        unreachable!()
    };
    let whole = QMatrix::stack(vec![
        RawMatrix {
            rows,
            cols,
            data: RawWeights::Q5_0(q5.clone()),
        },
        RawMatrix {
            rows,
            cols,
            data: RawWeights::Q6K(k6.clone()),
        },
    ])
    .expect("stack");
    let chunk = 32;
    let chunks_q5 = q5
        .chunks(chunk * nb)
        .map(|c| Ok::<_, ()>(RawWeights::Q5_0(c.to_vec())));
    let chunks_k6 = k6
        .chunks(chunk * cols / QK_K)
        .map(|c| Ok::<_, ()>(RawWeights::Q6K(c.to_vec())));
    let parts: Vec<(usize, Vec<Result<RawWeights, ()>>)> =
        vec![(rows, chunks_q5.collect()), (rows, chunks_k6.collect())];
    let built = QMatrix::build(cols, parts).expect("build");
    let a = acts(3, cols);
    let (mut o1, mut o2) = (vec![0f32; 3 * 2 * rows], vec![0f32; 3 * 2 * rows]);
    whole.matmul(&a, 3, &mut o1);
    built.matmul(&a, 3, &mut o2);
    assert_eq!(o1, o2);
}
