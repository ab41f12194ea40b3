use super::*;

#[test]
fn q4_0_as_q4_1_keeps_every_value() {
    for (i, d) in [0.013f32, -0.5, 6.1e-5, 3.0e-7, 1000.0]
        .into_iter()
        .enumerate()
    {
        let block = BlockQ4_0 {
            d: f16::from_f32(d),
            qs: std::array::from_fn(|j| (j * 37 + i * 11) as u8),
        };
        let mut got = [0.0; QK];
        dequantize_row_q4_1(&[block.as_q4_1().expect("exact")], &mut got);
        // GGML's dequantize_row_q4_0.
        let d = block.d.to_f32();
        for j in 0..QK / 2 {
            let (lo, hi) = (block.qs[j] & 0x0F, block.qs[j] >> 4);
            // Equal values (a zero's sign may differ: `8·d − 8·d` is +0 where `0·d` is −0).
            assert_eq!(got[j], (f32::from(lo) - 8.0) * d);
            assert_eq!(got[j + QK / 2], (f32::from(hi) - 8.0) * d);
        }
    }
    let huge = BlockQ4_0 {
        d: f16::from_f32(10_000.0),
        qs: [0; QK / 2],
    };
    assert!(huge.as_q4_1().is_none(), "-8 * d overflows f16");
}

#[test]
fn block_amax_finds_the_largest_magnitude_in_any_lane() {
    for at in 0..QK {
        for big in [-9.5f32, 9.5] {
            let mut x: Vec<f32> = (0..QK).map(|i| (i as f32 * 0.37).sin()).collect();
            x[at] = big;
            assert_eq!(block_amax(&x), 9.5, "position {at}");
        }
    }
    assert_eq!(block_amax(&[0.0; QK]), 0.0);
}

#[test]
fn q8_1_round_trip_is_close() {
    let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
    let mut q = vec![BlockQ8_1::zeroed(); 2];
    quantize_row_q8_1(&x, &mut q);
    for (b, chunk) in q.iter().zip(x.chunks(QK)) {
        for (v, &qq) in chunk.iter().zip(&b.qs) {
            assert!((v - b.d * f32::from(qq)).abs() <= b.d * 0.5 + 1e-6);
        }
        let sum: i32 = b.qs.iter().map(|&v| i32::from(v)).sum();
        assert_eq!(b.s, b.d * sum as f32);
    }
}

#[test]
fn q8_1_quantizer_rounds_half_away_from_zero() {
    let x: Vec<f32> = (0..QK)
        .map(|i| (i as f32 - 15.5) * 0.37 + if i % 3 == 0 { 0.123 } else { 0.0 })
        .collect();
    let mut q = [BlockQ8_1::zeroed()];
    quantize_row_q8_1(&x, &mut q);
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let id = 127.0 / amax;
    for (v, got) in x.iter().zip(q[0].qs) {
        assert_eq!(
            i32::from(got),
            (v * (1.0 / (amax / 127.0))).round() as i32,
            "{v} ({})",
            v * id
        );
    }
    let sum: i32 = q[0].qs.iter().map(|&v| i32::from(v)).sum();
    assert_eq!(q[0].s, q[0].d * sum as f32);
}

#[test]
fn q4_1_round_trip_is_close() {
    let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.91).cos()).collect();
    let mut q = vec![BlockQ4_1::zeroed(); 2];
    quantize_row_q4_1(&x, &mut q);
    let mut y = vec![0f32; 64];
    dequantize_row_q4_1(&q, &mut y);
    for (a, b) in x.iter().zip(&y) {
        assert!((a - b).abs() < 2.0 / 15.0 * 0.5 + 1e-2, "{a} vs {b}");
    }
}

#[test]
fn q5_0_quants_hold_every_fifth_bit() {
    let x: Vec<f32> = (0..QK).map(|i| i as f32 - 16.0).collect();
    let mut q = [BlockQ5_0::zeroed()];
    quantize_row_q5_0(&x, &mut q);
    // d = -16 / -16 = 1: every value is exact, so q = x + 16 covers 0..32 once each.
    let want: Vec<u8> = (0..QK as u8).collect();
    assert_eq!(q[0].quants().to_vec(), want);
}

/// ggml's layouts, read back: every sub-block's scale and minimum, and the quants of each
/// half of a `Q6_K` block from its own bytes.
#[test]
fn k_quant_fields_are_read_where_ggml_puts_them() {
    let mut b = BlockQ4K::zeroed();
    // Scales 1..8 and minimums 11..18, packed as ggml packs them.
    for j in 0..8u8 {
        let (sc, m) = (j + 1 + 40, j + 11);
        let j = j as usize;
        if j < 4 {
            b.scales[j] = sc;
            b.scales[j + 4] = m;
        } else {
            b.scales[j + 4] = (sc & 0x0F) | ((m & 0x0F) << 4);
            b.scales[j - 4] |= (sc >> 4) << 6;
            b.scales[j] |= (m >> 4) << 6;
        }
    }
    for j in 0..8u8 {
        assert_eq!(b.scale_min(j as usize), (j + 1 + 40, j + 11));
    }
    b.qs[32] = 0x5A;
    assert_eq!(b.quants(2)[0], 0x0A);
    assert_eq!(b.quants(3)[0], 0x05);

    let mut q6 = BlockQ6K::zeroed();
    q6.ql[64 + 32] = 0x73; // second half, l = 0: values 128 + 32 (low) and 128 + 96 (high)
    q6.qh[32] = 0b1110_0100; // second half, l = 0: high bits 0, 1, 2, 3 of values 0/32/64/96
    let q = q6.quants();
    assert_eq!(q[128], 0);
    assert_eq!(q[128 + 32], 0x03 | (1 << 4));
    assert_eq!(q[128 + 64], 2 << 4);
    assert_eq!(q[128 + 96], 0x07 | (3 << 4));
}

#[test]
fn q8_0_round_trip_is_close() {
    let x: Vec<f32> = (0..32).map(|i| i as f32 - 16.0).collect();
    let mut q = vec![BlockQ8_0::zeroed(); 1];
    quantize_row_q8_0(&x, &mut q);
    let mut y = vec![0f32; 32];
    dequantize_row_q8_0(&q, &mut y);
    for (a, b) in x.iter().zip(&y) {
        assert!((a - b).abs() < 0.1, "{a} vs {b}");
    }
}
