use super::*;
use crate::kv::{KvDtype, KvLayout};

/// A key's score is the same whether it is summed in a group of eight or of four.
#[test]
fn a_keys_score_does_not_depend_on_its_group() {
    let (hd, n) = (64, 19);
    let q: Vec<f32> = (0..hd).map(|i| (i as f32 * 0.3).sin()).collect();
    let keys: Vec<f32> = (0..n * hd).map(|i| (i as f32 * 0.011).cos()).collect();
    let mut all = vec![0f32; n];
    narrow::scores(&q, &keys, 0.125, &mut all);
    for (t0, chunk) in all.chunks(4).enumerate() {
        let mut four = vec![0f32; chunk.len()];
        narrow::scores(&q, &keys[4 * t0 * hd..], 0.125, &mut four);
        assert_eq!(chunk, &four[..], "keys from {}", 4 * t0);
    }
}

/// Heads taken together against one KV head's keys and values (passes of three, two and one)
/// get what each gets alone, bit for bit, for every count of keys up to two blocks.
#[test]
fn heads_together_equal_each_alone() {
    for hd in [64, 8, 72] {
        let heads = 6;
        let stride = 2 * BLOCK_TOKENS;
        let q: Vec<f32> = (0..heads * hd)
            .map(|i| (i as f32 * 0.31).sin() * 3.0)
            .collect();
        let rows: Vec<f32> = (0..stride * hd)
            .map(|i| (i as f32 * 0.013).cos() * 2.0)
            .collect();
        let start: Vec<f32> = (0..heads * hd).map(|i| (i as f32 * 0.05).sin()).collect();
        for n in 1..=stride {
            let rows = &rows[..n * hd];
            let mut together = vec![0f32; heads * stride];
            narrow::scores_heads(&q, rows, 0.125, &mut together, stride, n);
            let mut outs = start.clone();
            narrow::accumulate_heads(&together, stride, n, rows, &mut outs);
            for (h, qh) in q.chunks_exact(hd).enumerate() {
                let mut alone = vec![0f32; n];
                narrow::scores(qh, rows, 0.125, &mut alone);
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                let got = &together[h * stride..h * stride + n];
                assert_eq!(
                    bits(&alone),
                    bits(got),
                    "hd {hd}, {n} keys, head {h}: scores"
                );
                let mut out = start[h * hd..(h + 1) * hd].to_vec();
                narrow::accumulate(&alone, rows, &mut out);
                let got = &outs[h * hd..(h + 1) * hd];
                assert_eq!(
                    bits(&out),
                    bits(got),
                    "hd {hd}, {n} keys, head {h}: outputs"
                );
            }
        }
    }
}

/// Where the CPU takes the 512-bit accumulation, it gives each head what the per-head
/// accumulation gives, bit for bit: heads in a pass of eight and a remainder, two passes of
/// dimensions.
#[test]
fn the_wide_accumulation_equals_the_per_head_one() {
    let (hd, n, heads) = (64, 13, 11);
    if !avx512::accumulates(hd) {
        eprintln!("no AVX-512F here: the per-head accumulation serves alone");
        return;
    }
    let stride = 16;
    let scores: Vec<f32> = (0..heads * stride)
        .map(|i| (i as f32 * 0.17).sin())
        .collect();
    let values: Vec<f32> = (0..n * hd).map(|i| (i as f32 * 0.023).cos()).collect();
    let start: Vec<f32> = (0..heads * hd).map(|i| (i as f32 * 0.05).sin()).collect();
    let mut together = start.clone();
    avx512::accumulate_heads(&scores, stride, n, &values, &mut together);
    let mut alone = start;
    for (h, o) in alone.chunks_exact_mut(hd).enumerate() {
        narrow::accumulate(&scores[h * stride..h * stride + n], &values, o);
    }
    assert_eq!(together, alone);
}

/// Where the CPU takes the 512-bit scores, a block's keys transposed give each key what
/// the AVX2 loop gives, bit for bit, however many keys the block shows (groups of four and
/// keys alone).
#[test]
fn the_wide_scores_equal_the_narrow_ones() {
    let hd = 64;
    if !avx512::scores_fit(hd) {
        eprintln!("no AVX-512F here: the narrow scores serve alone");
        return;
    }
    let q: Vec<f32> = (0..7 * hd).map(|i| (i as f32 * 0.31).sin() * 3.0).collect();
    let keys: Vec<f32> = (0..BLOCK_TOKENS * hd)
        .map(|i| (i as f32 * 0.013).cos() * 2.0)
        .collect();
    let mut transposed = vec![0f32; keys.len()];
    avx512::transpose(&keys, hd, &mut transposed);
    for n in 1..=BLOCK_TOKENS {
        // Seven heads: a pass of three heads, another, and one alone.
        let heads = 7;
        let mut wide = vec![0f32; heads * BLOCK_TOKENS];
        avx512::scores(&q, &transposed, 0.125, &mut wide, BLOCK_TOKENS, n);
        for (h, (qh, got)) in q
            .chunks_exact(hd)
            .zip(wide.chunks(BLOCK_TOKENS))
            .enumerate()
        {
            let mut narrow = vec![0f32; n];
            narrow::scores(qh, &keys[..n * hd], 0.125, &mut narrow);
            assert_eq!(
                narrow.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                got[..n].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{n} keys, head {h}"
            );
        }
    }
}

/// Two heads against one KV head, checked against a direct computation over the keys and
/// values as the pool stores them (rounded to f16, or quantized to int8): head sizes that
/// take the portable loops (12), one SIMD pass (8, 64) and two passes (72); key counts with
/// and without a partial block or a group of four.
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
/// and without a window (whose first key moves with the position), on both dtypes.
#[test]
fn a_tile_of_queries_equals_each_alone() {
    // 150 keys: three runs of blocks for the values; windows inside one run and across two.
    let (hd, n) = (64, 150);
    for dtype in [KvDtype::F16, KvDtype::Q8] {
        for window in [None, Some(20), Some(70)] {
            let (pool, blocks) = filled_pool(dtype, hd, n);
            let q: Vec<f32> = (0..n * 2 * hd).map(|i| (i as f32 * 0.37).sin()).collect();
            let query = |p: usize| Query {
                layer: 0,
                first_key: window.map_or(0, |w: usize| (p + 1).saturating_sub(w)),
                kv_heads: 0..1,
                blocks: &blocks,
                n_keys: p + 1,
                q: &q[p * 2 * hd..(p + 1) * 2 * hd],
            };
            let tile: Vec<Query<'_>> = (3..n).map(query).collect();
            let mut together = vec![0f32; tile.len() * 2 * hd];
            attend(&pool, &tile, &mut together);
            for (p, got) in (3..n).zip(together.chunks_exact(2 * hd)) {
                let mut alone = vec![0f32; 2 * hd];
                attend(&pool, &[query(p)], &mut alone);
                assert_eq!(got, &alone[..], "{dtype:?} window {window:?} position {p}");
            }
        }
    }
}

/// Position `p`'s key (`s` = 0.3) or value (`s` = 0.7) in the test pools.
fn kv_row(hd: usize, p: usize, s: f32) -> Vec<f32> {
    (0..hd).map(|d| ((p * hd + d) as f32 * s).sin()).collect()
}

/// A pool of one layer and KV head holding `n` positions of keys and values.
fn filled_pool(dtype: KvDtype, hd: usize, n: usize) -> (KvPool, Vec<u32>) {
    let layout = KvLayout {
        n_layers: 1,
        n_kv_heads: 1,
        head_dim: hd,
        dtype,
        header_only: false,
    };
    let mut pool = KvPool::new(layout, layout.block_bytes() * n.div_ceil(BLOCK_TOKENS));
    let blocks = pool.alloc(n.div_ceil(BLOCK_TOKENS)).expect("blocks");
    for p in 0..n {
        pool.write(&blocks, p, 0, KvKind::Key, 0, &kv_row(hd, p, 0.3));
        pool.write(&blocks, p, 0, KvKind::Value, 0, &kv_row(hd, p, 0.7));
    }
    (pool, blocks)
}

fn check_against_naive(dtype: KvDtype, hd: usize, n: usize, first: usize) {
    let (pool, blocks) = filled_pool(dtype, hd, n);
    // Each row as the pool stores it, read back through the dtype's own round trip.
    let stored = |values: &[f32]| {
        let mut row = vec![0u16; dtype.row_bytes(hd) / 2];
        let row: &mut [u8] = bytemuck::cast_slice_mut(&mut row);
        dtype.encode_row(values, row);
        let mut back = vec![0f32; hd];
        dtype.decode_rows(hd, row, &mut back);
        back
    };
    let keys: Vec<Vec<f32>> = (0..n).map(|p| stored(&kv_row(hd, p, 0.3))).collect();
    let values: Vec<Vec<f32>> = (0..n).map(|p| stored(&kv_row(hd, p, 0.7))).collect();
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
    // BF16 rounds queries, keys, values and weights to 8 bits of mantissa (2^-9 of each).
    let tolerance = if bf16::runs(hd) { 2e-3 } else { 1e-4 };
    for h in 0..2 {
        let qh = &q[h * hd..(h + 1) * hd];
        let mut s: Vec<f32> = keys[first..]
            .iter()
            .map(|k| (0..hd).map(|d| qh[d] * k[d]).sum::<f32>() / (hd as f32).sqrt())
            .collect();
        let len = s.len();
        softmax_rows(&mut s, len);
        for d in 0..hd {
            let want: f32 = (first..n).map(|p| s[p - first] * values[p][d]).sum();
            let got = out[h * hd + d];
            assert!(
                (want - got).abs() < tolerance,
                "{dtype:?} hd {hd} keys {first}..{n} head {h} dim {d}: {got} vs {want}"
            );
        }
    }
}

#[test]
fn rows_side_by_side_give_each_rows_own_softmax() {
    // Each row alone, the arithmetic spelled out: a max, `e^(x - max)`, one chain of adds.
    let alone = |x: &mut [f32]| {
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        x.iter_mut().for_each(|v| *v = crate::math::exp(*v - max));
        let sum: f32 = x.iter().sum();
        x.iter_mut().for_each(|v| *v *= 1.0 / sum);
    };
    for len in [1, 5, 16, 17, 100, 1000] {
        for rows in [1, 7, 8, 9, 14, 17] {
            let mut x: Vec<f32> = (0..rows * len)
                .map(|i| ((i * 7919 % 1013) as f32 * 0.37).sin() * 12.0)
                .collect();
            // A masked prefix, as a sliding window leaves it.
            x[..len / 3].fill(f32::NEG_INFINITY);
            let mut want = x.clone();
            want.chunks_exact_mut(len).for_each(alone);
            softmax_rows(&mut x, len);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&x), bits(&want), "{rows} rows of {len}");
        }
    }
}

/// Values accumulated over a run of blocks in one call equal the same blocks one call each, bit
/// for bit (the accumulators go through memory between calls, in the same order): on the
/// 512-bit path where the CPU has it and on the narrow one.
#[test]
fn a_run_of_blocks_accumulates_as_block_by_block() {
    let (hd, heads, n) = (64, 7, 3 * BLOCK_TOKENS + 5);
    let stride = n + 3;
    let scores: Vec<f32> = (0..heads * stride)
        .map(|i| (i as f32 * 0.13).sin())
        .collect();
    let values: Vec<f32> = (0..n * hd).map(|i| (i as f32 * 0.029).cos()).collect();
    let start: Vec<f32> = (0..heads * hd).map(|i| (i as f32 * 0.07).sin()).collect();
    type Kernel = fn(&[f32], usize, usize, &[f32], &mut [f32]);
    let mut kernels: Vec<(&str, Kernel)> = vec![("narrow", narrow::accumulate_heads)];
    if avx512::accumulates(hd) {
        kernels.push(("512-bit", avx512::accumulate_heads));
    }
    for (name, kernel) in kernels {
        let mut run = start.clone();
        kernel(&scores, stride, n, &values, &mut run);
        let mut blocks = start.clone();
        for t0 in (0..n).step_by(BLOCK_TOKENS) {
            let m = (n - t0).min(BLOCK_TOKENS);
            kernel(
                &scores[t0..],
                stride,
                m,
                &values[t0 * hd..][..m * hd],
                &mut blocks,
            );
        }
        assert_eq!(run, blocks, "{name}");
    }
}
