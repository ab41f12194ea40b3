use super::*;
use crate::kv::{KvDtype, KvLayout};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// The instruction sets this machine runs, portable loops first.
fn isas() -> Vec<Isa> {
    let mut isas = vec![Isa::Portable];
    if cfg!(x86_v3) {
        isas.push(Isa::Avx2);
    }
    if crate::cpu::has_avx512f() {
        isas.push(Isa::Avx512);
    }
    isas
}

/// The weights' `exp` is within a few ulps of `f64::exp` above the floor and 0 at and below it
/// (and for −∞ and NaN), and every vector path gives its bits in every lane.
#[test]
fn exp_is_close_and_the_same_in_every_lane() {
    let mut worst = 0f64;
    for i in 0..400_000 {
        let x = -(i as f32) * 0.000_29;
        let y = portable::exp(x);
        if x > FLOOR {
            let want = f64::from(x).exp();
            worst = worst.max(((f64::from(y) - want) / want).abs());
        } else {
            assert_eq!(y, 0.0, "{x} is at or below the floor");
        }
    }
    assert!(
        worst < 4.0 * f64::from(f32::EPSILON),
        "relative error {worst}"
    );
    assert_eq!(portable::exp(0.0), 1.0);
    for x in [f32::NEG_INFINITY, FLOOR, f32::NAN] {
        assert_eq!(portable::exp(x), 0.0, "{x}");
    }
    let xs: Vec<f32> = (0..4096)
        .map(|i| match i % 97 {
            0 => f32::NEG_INFINITY,
            1 => FLOOR,
            2 => 0.0,
            _ => -(i as f32) * 0.0213,
        })
        .collect();
    let want: Vec<f32> = xs.iter().map(|&x| portable::exp(x)).collect();
    #[cfg(x86_v3)]
    for (x, want) in xs.chunks_exact(8).zip(want.chunks_exact(8)) {
        let got = avx2::exp_lanes(x.try_into().expect("8 lanes"));
        assert_eq!(bits(&got), bits(want), "AVX2 at {x:?}");
    }
    #[cfg(x86_v3)]
    if crate::cpu::has_avx512f() {
        for (x, want) in xs.chunks_exact(16).zip(want.chunks_exact(16)) {
            let got = avx512::exp_lanes(x.try_into().expect("16 lanes"));
            assert_eq!(bits(&got), bits(want), "AVX-512 at {x:?}");
        }
    }
}

/// Each kernel on each instruction set this machine runs gives the portable loops' bits: scores
/// with and without a range (a lane that sees none of the block, part of it, all of it), for
/// one and for many registers of lanes; weights, for a decode step's one register of lanes and
/// for a tile's many; values for head sizes of whole passes and with a rest (72, 8, 80, 136),
/// and for every count of heads in a kernel's last group (`real` lanes of `lanes`).
#[test]
fn every_instruction_set_gives_the_portable_bits() {
    let shapes = [
        (64, 8, 7),
        (64, 16, 13),
        (64, 48, 45),
        (72, 16, 13),
        (8, 64, 61),
        (256, 32, 29),
        (80, 16, 7),
        (80, 16, 2),
        (136, 16, 10),
        (64, 16, 14),
    ];
    for (hd, lanes, real) in shapes {
        let q: Vec<f32> = (0..hd * lanes)
            .map(|i| (i as f32 * 0.37).sin() * 2.0)
            .collect();
        let keys: Vec<f32> = (0..BLOCK_TOKENS * hd)
            .map(|i| (i as f32 * 0.011).cos() * 3.0)
            .collect();
        let lo: Vec<i32> = (0..lanes as i32).map(|l| 100 + l % 20).collect();
        let hi: Vec<i32> = (0..lanes as i32).map(|l| 104 + l % 13).collect();
        let run = |isa: Isa, range: bool| {
            let mut out = vec![0f32; BLOCK_TOKENS * lanes];
            let mut max = vec![-1.5f32; lanes];
            isa.scores(Scores {
                q: &q,
                keys: &keys,
                scale: 0.125,
                out: &mut out,
                max: &mut max,
                at: 96,
                range: range.then_some((&lo, &hi)),
            });
            let mut sum = vec![0.25f32; lanes];
            let mut weights = vec![0f32; out.len()];
            isa.weights(&out, &max, &mut sum, &mut weights);
            let values: Vec<f32> = (0..BLOCK_TOKENS * hd)
                .map(|i| (i as f32 * 0.029).sin())
                .collect();
            let mut acc: Vec<f32> = (0..real * hd).map(|i| (i as f32 * 0.07).cos()).collect();
            isa.accumulate(&weights, lanes, &values, &mut acc);
            [out, max, sum, weights, acc].map(|v| bits(&v))
        };
        for range in [false, true] {
            let want = run(Isa::Portable, range);
            for isa in isas()
                .into_iter()
                .filter(|i| lanes.is_multiple_of(i.width()))
            {
                let got = run(isa, range);
                for (i, what) in ["scores", "max", "sum", "weights", "outputs"]
                    .iter()
                    .enumerate()
                {
                    assert!(
                        got[i] == want[i],
                        "{isa:?} hd {hd}, {lanes} lanes, range {range}: {what}"
                    );
                }
            }
        }
    }
}

/// Two heads against one KV head, checked against a direct computation over the keys and
/// values as the pool stores them (rounded to f16, or quantized to int8): head sizes with and
/// without a rest past the vector passes (8, 12, 64, 72); key counts with and without a
/// partial block.
#[test]
fn matches_naive_attention() {
    for dtype in [KvDtype::F16, KvDtype::Q8] {
        for (hd, n) in [(8, 37), (12, 18), (64, 37), (64, 3), (72, 16), (64, 150)] {
            check_against_naive(dtype, hd, n, 0);
        }
    }
}

/// A sliding window sees keys `first..n` only: a first key inside a block, at a block's
/// start, and in the last block.
#[test]
fn a_window_sees_only_its_keys() {
    for (hd, n, first) in [(64, 40, 7), (64, 40, 16), (8, 37, 33), (12, 18, 17)] {
        check_against_naive(KvDtype::F16, hd, n, first);
    }
}

/// Consecutive positions taken together give each position exactly what it gets alone, with
/// and without a window (whose first key moves with the position), on both dtypes, for one KV
/// head with two query heads and for the 0.5B Qwen's shape (two KV heads of seven).
#[test]
fn a_tile_of_queries_equals_each_alone() {
    // 150 keys: three runs of blocks for the values; windows inside one run and across two.
    let n = 150;
    for (hd, n_kv, per_kv) in [(64, 1, 2), (64, 2, 7), (72, 1, 3)] {
        let heads = n_kv * per_kv;
        for dtype in [KvDtype::F16, KvDtype::Q8] {
            for window in [None, Some(20), Some(70)] {
                let (pool, blocks) = filled_pool(dtype, hd, n_kv, n);
                let q: Vec<f32> = (0..n * heads * hd)
                    .map(|i| (i as f32 * 0.37).sin())
                    .collect();
                let query = |p: usize| Query {
                    layer: 0,
                    first_key: window.map_or(0, |w: usize| (p + 1).saturating_sub(w)),
                    kv_heads: 0..n_kv,
                    blocks: &blocks,
                    n_keys: p + 1,
                    q: &q[p * heads * hd..(p + 1) * heads * hd],
                };
                let tile: Vec<Query<'_>> = (3..n).map(query).collect();
                for rows in [1, 9, 16, tile.len()] {
                    for chunk in tile.chunks(rows) {
                        let mut together = vec![0f32; chunk.len() * heads * hd];
                        attend(&pool, chunk, &mut together);
                        for (q, got) in chunk.iter().zip(together.chunks_exact(heads * hd)) {
                            let p = q.n_keys - 1;
                            let mut alone = vec![0f32; heads * hd];
                            attend(&pool, &[query(p)], &mut alone);
                            assert_eq!(
                                bits(got),
                                bits(&alone),
                                "{dtype:?} hd {hd}, {heads} heads, window {window:?}, \
                                 tiles of {rows}, position {p}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Position `p`'s key (`s` = 0.3) or value (`s` = 0.7) in the test pools, for KV head `h`.
fn kv_row(hd: usize, h: usize, p: usize, s: f32) -> Vec<f32> {
    (0..hd)
        .map(|d| (((h * 1000 + p) * hd + d) as f32 * s).sin())
        .collect()
}

/// A pool of one layer and `n_kv` KV heads holding `n` positions of keys and values.
fn filled_pool(dtype: KvDtype, hd: usize, n_kv: usize, n: usize) -> (KvPool, Vec<u32>) {
    let layout = KvLayout {
        n_layers: 1,
        n_kv_heads: n_kv,
        head_dim: hd,
        dtype,
        header_only: false,
    };
    let mut pool = KvPool::new(layout, layout.block_bytes() * n.div_ceil(BLOCK_TOKENS));
    let blocks = pool.alloc(n.div_ceil(BLOCK_TOKENS)).expect("blocks");
    for p in 0..n {
        for h in 0..n_kv {
            pool.write(&blocks, p, 0, KvKind::Key, h, &kv_row(hd, h, p, 0.3));
            pool.write(&blocks, p, 0, KvKind::Value, h, &kv_row(hd, h, p, 0.7));
        }
    }
    (pool, blocks)
}

fn check_against_naive(dtype: KvDtype, hd: usize, n: usize, first: usize) {
    let (pool, blocks) = filled_pool(dtype, hd, 1, n);
    // Each row as the pool stores it, read back through the dtype's own round trip.
    let stored = |values: &[f32]| {
        let mut row = vec![0u16; dtype.row_bytes(hd) / 2];
        let row: &mut [u8] = bytemuck::cast_slice_mut(&mut row);
        dtype.encode_row(values, row);
        let mut back = vec![0f32; hd];
        dtype.decode_rows(hd, row, &mut back);
        back
    };
    let keys: Vec<Vec<f32>> = (0..n).map(|p| stored(&kv_row(hd, 0, p, 0.3))).collect();
    let values: Vec<Vec<f32>> = (0..n).map(|p| stored(&kv_row(hd, 0, p, 0.7))).collect();
    let q: Vec<f32> = (0..2 * hd).map(|i| (i as f32 * 0.11).cos()).collect();
    let mut out = vec![0f32; 2 * hd];
    attend(
        &pool,
        &[Query {
            layer: 0,
            first_key: first,
            kv_heads: 0..1,
            blocks: &blocks,
            n_keys: n,
            q: &q,
        }],
        &mut out,
    );
    for h in 0..2 {
        let qh = &q[h * hd..(h + 1) * hd];
        let s: Vec<f64> = keys[first..]
            .iter()
            .map(|k| (0..hd).map(|d| f64::from(qh[d] * k[d])).sum::<f64>() / (hd as f64).sqrt())
            .collect();
        let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        for d in 0..hd {
            let want: f64 = (first..n)
                .map(|p| e[p - first] / sum * f64::from(values[p][d]))
                .sum();
            let got = f64::from(out[h * hd + d]);
            assert!(
                (want - got).abs() < 1e-5,
                "{dtype:?} hd {hd} keys {first}..{n} head {h} dim {d}: {got} vs {want}"
            );
        }
    }
}
