//! Causal grouped-query attention for one query row against a sequence's paged KV.
//!
//! Keys and values are always read back from the f16 pool, even for the positions the current
//! forward pass just wrote, so the result for a position does not depend on how the prompt was
//! chunked or on which other sequences share the batch.

use half::slice::HalfFloatSliceExt;

use crate::kv::{BLOCK_TOKENS, KvKind, KvPool};

/// Inputs for the query heads that share one KV head.
#[derive(Debug)]
pub struct GroupQuery<'a> {
    pub layer: usize,
    pub kv_head: usize,
    /// The sequence's block table.
    pub blocks: &'a [u32],
    /// Keys `0..n_keys` are visible (the query's own position is `n_keys - 1`).
    pub n_keys: usize,
    /// `heads × head_dim` query values, already rotated.
    pub q: &'a [f32],
}

/// Writes `heads × head_dim` attention outputs for one group into `out`.
pub fn attend_group(pool: &KvPool, g: &GroupQuery<'_>, out: &mut [f32]) {
    let hd = pool.layout().head_dim;
    let heads = g.q.len() / hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut scores = vec![0f32; heads * g.n_keys];
    let mut buf = vec![0f32; BLOCK_TOKENS * hd];
    let n_blocks = g.n_keys.div_ceil(BLOCK_TOKENS);

    for (bi, &block) in g.blocks[..n_blocks].iter().enumerate() {
        let n = (g.n_keys - bi * BLOCK_TOKENS).min(BLOCK_TOKENS);
        pool.slab(block, g.layer, KvKind::Key, g.kv_head)[..n * hd]
            .convert_to_f32_slice(&mut buf[..n * hd]);
        for t in 0..n {
            let k = &buf[t * hd..(t + 1) * hd];
            for h in 0..heads {
                scores[h * g.n_keys + bi * BLOCK_TOKENS + t] =
                    dot(&g.q[h * hd..(h + 1) * hd], k) * scale;
            }
        }
    }
    for row in scores.chunks_exact_mut(g.n_keys) {
        softmax(row);
    }
    out.fill(0.0);
    for (bi, &block) in g.blocks[..n_blocks].iter().enumerate() {
        let n = (g.n_keys - bi * BLOCK_TOKENS).min(BLOCK_TOKENS);
        pool.slab(block, g.layer, KvKind::Value, g.kv_head)[..n * hd]
            .convert_to_f32_slice(&mut buf[..n * hd]);
        for t in 0..n {
            let v = &buf[t * hd..(t + 1) * hd];
            for h in 0..heads {
                let p = scores[h * g.n_keys + bi * BLOCK_TOKENS + t];
                for (o, x) in out[h * hd..(h + 1) * hd].iter_mut().zip(v) {
                    *o += p * x;
                }
            }
        }
    }
}

/// Dot product with 8 independent partial sums, which the compiler turns into SIMD.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvLayout;

    #[test]
    fn matches_naive_attention() {
        let layout = KvLayout {
            n_layers: 1,
            n_kv_heads: 1,
            head_dim: 8,
        };
        let mut pool = KvPool::new(layout, layout.block_bytes() * 3);
        let blocks = pool.alloc(3).expect("blocks");
        let n = 37;
        let val = |p: usize, d: usize, s: f32| (((p * 8 + d) as f32) * s).sin();
        for p in 0..n {
            let k: Vec<f32> = (0..8).map(|d| val(p, d, 0.3)).collect();
            let v: Vec<f32> = (0..8).map(|d| val(p, d, 0.7)).collect();
            pool.write(&blocks, p, 0, KvKind::Key, 0, &k);
            pool.write(&blocks, p, 0, KvKind::Value, 0, &v);
        }
        let q: Vec<f32> = (0..16).map(|i| (i as f32 * 0.11).cos()).collect();
        let mut out = vec![0f32; 16];
        attend_group(
            &pool,
            &GroupQuery {
                layer: 0,
                kv_head: 0,
                blocks: &blocks,
                n_keys: n,
                q: &q,
            },
            &mut out,
        );
        let f16r = |x: f32| half::f16::from_f32(x).to_f32();
        for h in 0..2 {
            let qh = &q[h * 8..(h + 1) * 8];
            let mut s: Vec<f32> = (0..n)
                .map(|p| (0..8).map(|d| qh[d] * f16r(val(p, d, 0.3))).sum::<f32>() / 8f32.sqrt())
                .collect();
            softmax(&mut s);
            for d in 0..8 {
                let want: f32 = (0..n).map(|p| s[p] * f16r(val(p, d, 0.7))).sum();
                assert!((want - out[h * 8 + d]).abs() < 1e-4);
            }
        }
    }
}
