use super::*;

/// The vector `exp` is the scalar one in every lane, within an ulp or two of `f64::exp`, and 0
/// at and below the floor and for −∞.
#[test]
fn exp_is_the_scalar_polynomial_in_every_lane() {
    if !crate::cpu::has_avx512_bf16() {
        eprintln!("no AVX-512 BF16 here: the bf16 path does not run");
        return;
    }
    let mut worst = 0f64;
    for i in 0..20_000 {
        let x: [f32; LANES] = std::array::from_fn(|l| -((i * LANES + l) as f32) * 0.000_29);
        let got = x86::exp_lanes(x);
        for (&x, &y) in x.iter().zip(&got) {
            assert_eq!(y.to_bits(), exp(x).to_bits(), "lane at {x}");
            if x > FLOOR {
                let want = f64::from(x).exp();
                worst = worst.max(((f64::from(y) - want) / want).abs());
            } else {
                assert_eq!(y, 0.0, "{x} is below the floor");
            }
        }
    }
    assert!(worst < 4.0 * f64::from(f32::EPSILON), "relative error {worst}");
    let edges = x86::exp_lanes(std::array::from_fn(|l| match l {
        0 => f32::NEG_INFINITY,
        1 => FLOOR,
        2 => 0.0,
        _ => -1.0,
    }));
    assert_eq!(edges[..3], [0.0, 0.0, 1.0]);
}
