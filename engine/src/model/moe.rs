//! The mixture-of-experts FFN (Qwen3's): a router scores every expert for each row, the `used`
//! best run their gated FFN on it, and their outputs are summed with the routing weights.
//!
//! ```text
//! normed rows ─ router (f32) ─ softmax ─ top `used` ─ weights / their sum
//!      │                                     │
//!      └─ per chosen expert, its rows gathered: gate|up ─ silu·up ─ down ─┐
//!                                                                         └─ Σ by rank, × weight ─► proj
//! ```
//!
//! Each expert multiplies all the rows routed to it at once (a prefill chunk's rows share one
//! pass over each expert's weights), and a decode step reads only the experts its rows chose.
//! A row's output does not depend on the rows beside it: routing is per row, the kernels'
//! results are per row whatever the batch (`kernels`), and a row's experts are summed in rank
//! order. So batch-size and prompt-versus-step bit identity hold as for the dense FFN.

use rayon::prelude::*;

use super::{ModelConfig, ROWS_PER_TASK, gated_activation};
use crate::kernels::QMatrix;
use crate::quant::{BlockQ8_1, QK};

/// A layer's experts and their router.
#[derive(Debug)]
pub struct MoeWeights {
    /// `experts` rows of `hidden` f32 weights (`ffn_gate_inp`, which llama.cpp keeps in f32 and
    /// multiplies in f32: a quantized router would change which experts run).
    pub router: Vec<f32>,
    pub experts: Vec<Expert>,
}

/// One expert's gated FFN.
#[derive(Debug)]
pub struct Expert {
    /// gate and up projections stacked: `2 * ffn` rows.
    pub gate_up: QMatrix,
    pub down: QMatrix,
}

/// llama.cpp's floor on the sum of the chosen experts' probabilities (the smallest normal f16).
const MIN_WEIGHT_SUM: f32 = 6.103_515_6e-5;

/// A row's chosen experts, most probable first (the lower index on a tie), with their weights:
/// the softmax of the router's logits, renormalized over those chosen.
fn route(router: &[f32], used: usize, x: &[f32]) -> Vec<(usize, f32)> {
    let logits: Vec<f32> = router.chunks_exact(x.len()).map(|w| dot(w, x)).collect();
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= sum);
    let mut order: Vec<usize> = (0..probs.len()).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    order.truncate(used);
    let chosen: f32 = order.iter().map(|&e| probs[e]).sum::<f32>();
    let chosen = chosen.max(MIN_WEIGHT_SUM);
    order.into_iter().map(|e| (e, probs[e] / chosen)).collect()
}

/// An f32 dot product in 16 lanes (the compiler keeps them in vector registers).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = (ca.remainder().iter().zip(cb.remainder()))
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The mixture's output for `n` rows into `out` (`n × hidden`), from their normed inputs `xn`
/// (which the router reads) and the same quantized (`acts`, which the experts read).
pub(super) fn forward(
    cfg: &ModelConfig,
    w: &MoeWeights,
    (xn, acts): (&[f32], &[BlockQ8_1]),
    n: usize,
    out: &mut [f32],
) {
    let moe = cfg.moe.expect("a mixture of experts has its counts");
    let (h, nb) = (cfg.hidden, cfg.hidden / QK);
    let routes: Vec<Vec<(usize, f32)>> = xn[..n * h]
        .par_chunks(h)
        .with_min_len(ROWS_PER_TASK)
        .map(|x| route(&w.router, moe.used, x))
        .collect();
    // Per expert, the rows that chose it; per (row, rank), where its output will be.
    let mut rows_of: Vec<Vec<usize>> = vec![Vec::new(); moe.experts];
    let mut slot = vec![(0usize, 0usize); n * moe.used];
    for (r, route) in routes.iter().enumerate() {
        for (k, &(e, _)) in route.iter().enumerate() {
            slot[r * moe.used + k] = (e, rows_of[e].len());
            rows_of[e].push(r);
        }
    }
    let outputs: Vec<Vec<f32>> = rows_of
        .par_iter()
        .zip(&w.experts)
        .map(|(rows, expert)| match rows.is_empty() {
            true => Vec::new(),
            false => run_expert(cfg, expert, acts, nb, rows),
        })
        .collect();
    out[..n * h]
        .par_chunks_mut(h)
        .zip(slot.par_chunks(moe.used))
        .zip(&routes)
        .with_min_len(ROWS_PER_TASK)
        .for_each(|((o, slots), route)| {
            o.fill(0.0);
            for (&(e, i), &(_, weight)) in slots.iter().zip(route) {
                for (o, v) in o.iter_mut().zip(&outputs[e][i * h..(i + 1) * h]) {
                    *o += v * weight;
                }
            }
        });
}

/// One expert's FFN over the rows `rows` of `acts` (`nb` blocks a row), their outputs back to
/// back in the order of `rows`.
fn run_expert(
    cfg: &ModelConfig,
    expert: &Expert,
    acts: &[BlockQ8_1],
    nb: usize,
    rows: &[usize],
) -> Vec<f32> {
    let (m, f) = (rows.len(), cfg.ffn);
    let mut gathered = Vec::with_capacity(m * nb);
    for &r in rows {
        gathered.extend_from_slice(&acts[r * nb..(r + 1) * nb]);
    }
    let mut gate_up = vec![0f32; m * 2 * f];
    expert.gate_up.matmul(&gathered, m, &mut gate_up);
    let mut act = vec![0f32; m * f];
    let mut acts_f = vec![bytemuck::Zeroable::zeroed(); m * f / QK];
    gated_activation(cfg, &gate_up, &mut act, &mut acts_f);
    let mut down = vec![0f32; m * cfg.hidden];
    expert.down.matmul(&acts_f, m, &mut down);
    down
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_takes_the_most_probable_and_renormalizes() {
        // Three experts over a 1-wide input: logits 1, 3, 2.
        let router = [1.0, 3.0, 2.0];
        let r = route(&router, 2, &[1.0]);
        assert_eq!(r.iter().map(|&(e, _)| e).collect::<Vec<_>>(), [1, 2]);
        let (p1, p2) = (3f32.exp(), 2f32.exp());
        assert!((r[0].1 - p1 / (p1 + p2)).abs() < 1e-6, "{r:?}");
        assert!((r[0].1 + r[1].1 - 1.0).abs() < 1e-6, "{r:?}");
    }

    #[test]
    fn a_tie_goes_to_the_lower_index() {
        let r = route(&[2.0, 5.0, 5.0, 1.0], 1, &[1.0]);
        assert_eq!(r, [(1, 1.0)]);
    }

    #[test]
    fn the_dot_product_takes_every_element() {
        let a: Vec<f32> = (0..37).map(|i| i as f32).collect();
        let want: f32 = a.iter().map(|v| v * v).sum();
        assert_eq!(dot(&a, &a), want);
    }
}
