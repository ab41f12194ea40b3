//! The llama forward pass over a batch of rows, each a (sequence, position, token).
//!
//! A prefill chunk is many rows of one sequence; a decode step is one row per sequence. Both
//! take this one path: the linear layers run once over all rows (so weights are streamed once
//! per step, whatever the batch), then each row attends over its own sequence's paged KV.
//!
//! ```text
//! tokens ─ embed ─┬─ [rmsnorm ─ qkv ─ rope ─ KV write ─ attention ─ o] ─ + ─┬─ [rmsnorm ─ gate|up ─ silu·up ─ down] ─ + ─► next layer
//!                 └──────────────────────── residual ───────────────────────┘                   residual
//! last rows ─ rmsnorm ─ lm head ─► logits
//! ```

use std::ops::Range;

use rayon::prelude::*;

use crate::attention::{Query, attend, tile_rows};
use crate::kernels::QMatrix;
use crate::kv::{KvKind, KvPool};
use crate::quant::{BlockQ8_1, QK, quantize_row_q8_1};

mod config;
mod moe;

pub use config::{Arch, ModelConfig, Moe, Rope, SlidingWindow};
pub use moe::{Expert, MoeWeights};

#[derive(Debug)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    /// q, k and v projections stacked: `q_dim + 2 * kv_dim` rows.
    pub wqkv: QMatrix,
    /// Their biases, stacked the same way, where the architecture has them.
    pub qkv_bias: Option<Vec<f32>>,
    /// Per-head norms of the queries and keys (see [`Arch::qk_norm`]).
    pub qk_norm: Option<QkNorm>,
    /// Gemma's norms of the attention and FFN outputs (see [`Arch::post_norms`]).
    pub post_norms: Option<PostNorms>,
    pub wo: QMatrix,
    pub ffn_norm: Vec<f32>,
    pub ffn: Ffn,
}

#[derive(Debug)]
pub struct QkNorm {
    /// Of each query and key head (`head_dim` weights).
    pub q: Vec<f32>,
    pub k: Vec<f32>,
}

#[derive(Debug)]
pub struct PostNorms {
    /// Of the attention and FFN outputs (`hidden` weights).
    pub attn: Vec<f32>,
    pub ffn: Vec<f32>,
}

/// A layer's feed-forward network.
#[derive(Debug)]
pub enum Ffn {
    Dense {
        /// gate and up projections stacked: `2 * ffn` rows.
        gate_up: QMatrix,
        down: QMatrix,
    },
    Moe(MoeWeights),
}

#[derive(Debug)]
pub struct Weights {
    pub embed: QMatrix,
    /// The LM head; `None` means it is tied to the embedding.
    pub output: Option<QMatrix>,
    pub output_norm: Vec<f32>,
    pub layers: Vec<LayerWeights>,
}

/// One row of a forward pass.
#[derive(Clone, Copy, Debug)]
pub struct Row<'a> {
    pub blocks: &'a [u32],
    pub pos: usize,
    pub token: u32,
    pub want_logits: bool,
}

/// The logits of several rows, back to back in one buffer (a decode step's rows would otherwise
/// cost an allocation and a copy of `vocab` floats each).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Logits {
    vocab: usize,
    data: Vec<f32>,
}

impl Logits {
    /// `data`'s rows of `vocab` logits each.
    pub(crate) fn new(vocab: usize, data: Vec<f32>) -> Self {
        Self { vocab, data }
    }

    /// Rows held.
    pub fn len(&self) -> usize {
        self.data.len().checked_div(self.vocab).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Row `i`'s logits. Panics if `i >= len()`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }

    pub fn iter(&self) -> std::slice::ChunksExact<'_, f32> {
        self.data.chunks_exact(self.vocab.max(1))
    }

    /// The buffer the rows are in, to be written over by a later pass.
    pub(crate) fn into_buffer(self) -> Vec<f32> {
        self.data
    }

    /// The last row, without a copy when it is the only one.
    pub fn into_last(mut self) -> Vec<f32> {
        let start = self.data.len().saturating_sub(self.vocab);
        self.data.drain(..start);
        self.data
    }
}

impl<'a> IntoIterator for &'a Logits {
    type Item = &'a [f32];
    type IntoIter = std::slice::ChunksExact<'a, f32>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// Runs the rows through the model, writing their KV into `pool` (their blocks must already
/// cover `pos`), and returns the logits of the rows that asked for them, in order, written over
/// `buffer` (a recycled one saves mapping and faulting in fresh pages every step). Must be
/// called on the engine's rayon pool.
pub fn forward(
    cfg: &ModelConfig,
    w: &Weights,
    pool: &mut KvPool,
    rows: &[Row<'_>],
    buffer: Vec<f32>,
) -> Logits {
    let mut scratch = Scratch::new(cfg, rows.len());
    let shape = Shape::new(cfg, rows);
    let mut hidden = embed(cfg, w, rows, &mut scratch);
    for li in 0..w.layers.len() {
        layer(cfg, w, pool, (rows, &shape), li, &mut hidden, &mut scratch);
    }
    logits(cfg, w, rows, &hidden.x, buffer)
}

/// Rows' state between layers: their residual stream `x`, and the next layer's normed input
/// quantized (`acts_h`).
#[derive(Debug)]
pub(crate) struct Hidden {
    pub x: Vec<f32>,
    acts_h: Vec<BlockQ8_1>,
}

/// A layer's working buffers for up to `rows` rows, reused from layer to layer (and by a
/// prompt computed a layer at a time, from piece to piece): fresh ones would be mapped and
/// faulted in each time, tens of MB for a prompt chunk.
#[derive(Debug)]
pub(crate) struct Scratch {
    rows: usize,
    xn: Vec<f32>,
    acts_f: Vec<BlockQ8_1>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    acts_q: Vec<BlockQ8_1>,
    proj: Vec<f32>,
    gate_up: Vec<f32>,
    ffn_act: Vec<f32>,
}

impl Scratch {
    pub(crate) fn new(cfg: &ModelConfig, rows: usize) -> Self {
        let n = rows;
        let (h, qd, kvd) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim());
        Self {
            rows,
            xn: vec![0f32; n * h],
            acts_f: vec![bytemuck::Zeroable::zeroed(); n * cfg.ffn / QK],
            qkv: vec![0f32; n * (qd + 2 * kvd)],
            attn: vec![0f32; n * qd],
            acts_q: vec![bytemuck::Zeroable::zeroed(); n * qd / QK],
            proj: vec![0f32; n * h],
            gate_up: vec![0f32; n * 2 * cfg.ffn],
            ffn_act: vec![0f32; n * cfg.ffn],
        }
    }
}

/// What a set of rows needs in every layer: their rotary tables, and how attention shares
/// them out (one task per tile of a prompt's consecutive rows, or per row and KV head when the
/// rows are too few to share out).
#[derive(Debug)]
pub(crate) struct Shape {
    rope_global: Vec<(Vec<f32>, Vec<f32>)>,
    rope_local: Option<Vec<(Vec<f32>, Vec<f32>)>>,
    parts: usize,
    tiles: Vec<Range<usize>>,
}

impl Shape {
    pub(crate) fn new(cfg: &ModelConfig, rows: &[Row<'_>]) -> Self {
        let n = rows.len();
        let parts = if n >= rayon::current_num_threads() {
            1
        } else {
            cfg.n_kv_heads
        };
        Self {
            rope_global: rope_tables(cfg.rope_theta, cfg, rows),
            rope_local: (cfg.sliding_window.as_ref())
                .map(|sw| rope_tables(sw.rope_theta, cfg, rows)),
            parts,
            tiles: match parts {
                1 => attention_tiles(rows, cfg.n_heads / cfg.n_kv_heads),
                _ => (0..n).map(|r| r..r + 1).collect(),
            },
        }
    }
}

/// The rows' embeddings, normed and quantized for the first layer.
pub(crate) fn embed(cfg: &ModelConfig, w: &Weights, rows: &[Row<'_>], s: &mut Scratch) -> Hidden {
    let (n, h) = (rows.len(), cfg.hidden);
    let mut x = vec![0f32; n * h];
    for (r, xr) in rows.iter().zip(x.chunks_exact_mut(h)) {
        w.embed.dequantize_row(r.token as usize, xr);
        if let Some(scale) = cfg.embed_scale {
            xr.iter_mut().for_each(|v| *v *= scale);
        }
    }
    let mut acts_h = vec![bytemuck::Zeroable::zeroed(); n * h / QK];
    if let Some(first) = w.layers.first() {
        let xn = &mut s.xn[..n * h];
        add_norm_quantize(&mut x, None, &first.attn_norm, cfg.rms_eps, xn, &mut acts_h);
    }
    Hidden { x, acts_h }
}

/// Layer `li` over the rows (`shape` is theirs): their KV written into `pool`, attention over
/// their sequences' KV of this layer, and `hidden` advanced past it (normed and quantized for
/// the next layer, if any).
pub(crate) fn layer(
    cfg: &ModelConfig,
    w: &Weights,
    pool: &mut KvPool,
    (rows, shape): (&[Row<'_>], &Shape),
    li: usize,
    hidden: &mut Hidden,
    s: &mut Scratch,
) {
    let n = rows.len();
    debug_assert!(n <= s.rows, "{n} rows in a scratch for {}", s.rows);
    let (h, qd, kvd, hd) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
    let qkv_w = qd + 2 * kvd;
    let (x, acts_h) = (&mut hidden.x, &mut hidden.acts_h);
    let xn = &mut s.xn[..n * h];
    let acts_f = &mut s.acts_f[..n * cfg.ffn / QK];
    let qkv = &mut s.qkv[..n * qkv_w];
    let attn = &mut s.attn[..n * qd];
    let acts_q = &mut s.acts_q[..n * qd / QK];
    let proj = &mut s.proj[..n * h];
    let gate_up = &mut s.gate_up[..n * 2 * cfg.ffn];
    let ffn_act = &mut s.ffn_act[..n * cfg.ffn];
    let lw = &w.layers[li];
    let (parts, tiles) = (shape.parts, &shape.tiles);
    let (kv_per_part, q_per_part) = (cfg.n_kv_heads / parts, qd / parts);

    lw.wqkv.matmul(acts_h, n, qkv);
    let rope = match &shape.rope_local {
        Some(local) if cfg.is_local(li) => local,
        _ => &shape.rope_global,
    };
    bias_norm_rope(cfg, lw, rope, qkv);
    for (r, row) in rows.iter().zip(qkv.chunks_exact(qkv_w)) {
        for g in 0..cfg.n_kv_heads {
            let k = &row[qd + g * hd..qd + (g + 1) * hd];
            pool.write(r.blocks, r.pos, li, KvKind::Key, g, k);
            let v = &row[qd + kvd + g * hd..qd + kvd + (g + 1) * hd];
            pool.write(r.blocks, r.pos, li, KvKind::Value, g, v);
        }
    }
    let pool_ref = &*pool;
    let qkv = &*qkv;
    let query = |ri: usize, p: usize| {
        let base = ri * qkv_w + p * q_per_part;
        Query {
            layer: li,
            first_key: cfg.first_key(li, rows[ri].pos),
            kv_heads: p * kv_per_part..(p + 1) * kv_per_part,
            blocks: rows[ri].blocks,
            n_keys: rows[ri].pos + 1,
            q: &qkv[base..base + q_per_part],
        }
    };
    // Each (tile, part)'s outputs: a tile's rows are back to back in `attn`, and a part is the
    // same share of every row.
    let mut outs: Vec<&mut [f32]> = Vec::with_capacity(tiles.len() * parts);
    let mut rest = &mut attn[..];
    for t in tiles {
        for _ in 0..parts {
            let (out, tail) = rest.split_at_mut(t.len() * q_per_part);
            outs.push(out);
            rest = tail;
        }
    }
    outs.into_par_iter().enumerate().for_each(|(i, out)| {
        let (t, p) = (&tiles[i / parts], i % parts);
        let qs: Vec<Query<'_>> = t.clone().map(|ri| query(ri, p)).collect();
        attend(pool_ref, &qs, out);
    });
    attn.par_chunks(qd)
        .zip(acts_q.par_chunks_mut(qd / QK))
        .with_min_len(ROWS_PER_TASK)
        .for_each(|(a, q)| quantize_row_q8_1(a, q));
    lw.wo.matmul(acts_q, n, proj);
    if let Some(g) = &lw.post_norms {
        norm_rows(proj, &g.attn, cfg.rms_eps);
    }
    add_norm_quantize(x, Some(proj), &lw.ffn_norm, cfg.rms_eps, xn, acts_h);

    match &lw.ffn {
        Ffn::Dense {
            gate_up: w_gate_up,
            down,
        } => {
            w_gate_up.matmul(acts_h, n, gate_up);
            gated_activation(cfg, gate_up, ffn_act, acts_f);
            down.matmul(acts_f, n, proj);
        }
        Ffn::Moe(m) => moe::forward(cfg, m, (xn, acts_h), n, proj),
    }
    if let Some(g) = &lw.post_norms {
        norm_rows(proj, &g.ffn, cfg.rms_eps);
    }
    match w.layers.get(li + 1) {
        Some(next) => add_norm_quantize(x, Some(proj), &next.attn_norm, cfg.rms_eps, xn, acts_h),
        None => add_in_place(x, proj),
    }
}

/// Per row of `qkv`, in parallel: the q, k and v biases added (where the architecture has
/// them), the per-head q and k norms (likewise), and the rotary embedding of the q and k heads.
fn bias_norm_rope(
    cfg: &ModelConfig,
    lw: &LayerWeights,
    rope: &[(Vec<f32>, Vec<f32>)],
    qkv: &mut [f32],
) {
    let (qd, kvd, hd) = (cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
    let style = cfg.arch.rope();
    qkv.par_chunks_mut(qd + 2 * kvd)
        .zip(rope)
        .with_min_len(ROWS_PER_TASK)
        .for_each(|(row, (cos, sin))| {
            if let Some(bias) = &lw.qkv_bias {
                add_in_place(row, bias);
            }
            if let Some(g) = &lw.qk_norm {
                let (q, k) = row[..qd + kvd].split_at_mut(qd);
                for head in q.chunks_exact_mut(hd) {
                    rms_norm_in_place(head, &g.q, cfg.rms_eps);
                }
                for head in k.chunks_exact_mut(hd) {
                    rms_norm_in_place(head, &g.k, cfg.rms_eps);
                }
            }
            for head in row[..qd + kvd].chunks_exact_mut(hd) {
                apply_rope(style, head, cos, sin);
            }
        });
}

/// Per row, in parallel: `act(gate) · up` from the stacked gate and up projections, into
/// `ffn_act`, and quantized into `acts_f`.
fn gated_activation(
    cfg: &ModelConfig,
    gate_up: &[f32],
    ffn_act: &mut [f32],
    acts_f: &mut [BlockQ8_1],
) {
    let gelu = cfg.arch.gelu();
    gate_up
        .par_chunks(2 * cfg.ffn)
        .zip(ffn_act.par_chunks_mut(cfg.ffn))
        .zip(acts_f.par_chunks_mut(cfg.ffn / QK))
        .with_min_len(ROWS_PER_TASK)
        .for_each(|((gu, out), q)| {
            let (gate, up) = gu.split_at(cfg.ffn);
            // silu(g) = g / (1 + e^-g); GELU's tanh form is the same sigmoid of another
            // argument: 0.5·g·(1 + tanh(u)) = g / (1 + e^(-2u)), u = √(2/π)·(g + 0.044715·g³).
            // The exponentials are computed four lanes at a time.
            for (o, &g) in out.iter_mut().zip(gate) {
                *o = if gelu {
                    -2.0 * SQRT_2_OVER_PI * g * (1.0 + 0.044_715 * g * g)
                } else {
                    -g
                };
            }
            crate::math::exp_in_place(out);
            for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
                *o = g / (1.0 + *o) * u;
            }
            quantize_row_q8_1(out, q);
        });
}

/// The logits of the rows that asked for them, from the last layer's hidden states `x`,
/// written over `buffer`.
pub(crate) fn logits(
    cfg: &ModelConfig,
    w: &Weights,
    rows: &[Row<'_>],
    x: &[f32],
    mut buffer: Vec<f32>,
) -> Logits {
    let (n, h) = (rows.len(), cfg.hidden);
    let wanted: Vec<usize> = (0..n).filter(|&i| rows[i].want_logits).collect();
    if wanted.is_empty() {
        // The buffer goes back empty rather than dropped, so a caller can still recycle it.
        buffer.clear();
        return Logits {
            vocab: cfg.vocab,
            data: buffer,
        };
    }
    let mut last = vec![0f32; wanted.len() * h];
    for (dst, &i) in last.chunks_exact_mut(h).zip(&wanted) {
        dst.copy_from_slice(&x[i * h..(i + 1) * h]);
    }
    let mut normed = vec![0f32; last.len()];
    rms_norm_rows(&last, &w.output_norm, cfg.rms_eps, &mut normed);
    let mut acts = vec![bytemuck::Zeroable::zeroed(); normed.len() / QK];
    quantize_row_q8_1(&normed, &mut acts);
    let head = w.output.as_ref().unwrap_or(&w.embed);
    // Shrinking or keeping the length writes nothing; the matmul writes every element.
    buffer.resize(wanted.len() * cfg.vocab, 0.0);
    head.matmul(&acts, wanted.len(), &mut buffer);
    Logits {
        vocab: cfg.vocab,
        data: buffer,
    }
}

/// Rows per task in the row-parallel elementwise steps: a small batch stays on one thread.
const ROWS_PER_TASK: usize = 4;

/// Per row, in parallel: `x += proj` (if given), `xn = rms_norm(x) · weight`, and `xn`
/// quantized into `acts`.
fn add_norm_quantize(
    x: &mut [f32],
    proj: Option<&[f32]>,
    weight: &[f32],
    eps: f32,
    xn: &mut [f32],
    acts: &mut [BlockQ8_1],
) {
    let h = weight.len();
    x.par_chunks_mut(h)
        .zip(xn.par_chunks_mut(h))
        .zip(acts.par_chunks_mut(h / QK))
        .enumerate()
        .with_min_len(ROWS_PER_TASK)
        .for_each(|(i, ((x, xn), q))| {
            if let Some(p) = proj {
                add_in_place(x, &p[i * h..(i + 1) * h]);
            }
            rms_norm_rows(x, weight, eps, xn);
            quantize_row_q8_1(xn, q);
        });
}

/// The rows in runs that [`attend`] takes at once: consecutive positions of one sequence (a
/// prompt's rows share its block table), as many as [`tile_rows`] allows for `heads` query heads
/// per KV head (a call holds one KV head's scores at a time).
fn attention_tiles(rows: &[Row<'_>], heads: usize) -> Vec<Range<usize>> {
    let mut tiles = Vec::new();
    let mut start = 0;
    for i in 1..=rows.len() {
        let joins = rows.get(i).is_some_and(|r| {
            let prev = &rows[i - 1];
            std::ptr::eq(r.blocks, prev.blocks)
                && r.pos == prev.pos + 1
                && i - start < tile_rows(heads, r.pos + 1)
        });
        if !joins {
            tiles.push(start..i);
            start = i;
        }
    }
    tiles
}

/// `1 / sqrt(mean(x²) + eps)`: what RMS norm multiplies a row by, before its weights.
fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    1.0 / (ms + eps).sqrt()
}

fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let h = weight.len();
    for (xr, or) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        let scale = rms_scale(xr, eps);
        for ((o, v), g) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * scale * g;
        }
    }
}

fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let scale = rms_scale(x, eps);
    for (v, g) in x.iter_mut().zip(weight) {
        *v = *v * scale * g;
    }
}

/// Each row of `x` (rows of `weight.len()`) RMS-normed in place, in parallel.
fn norm_rows(x: &mut [f32], weight: &[f32], eps: f32) {
    x.par_chunks_mut(weight.len())
        .with_min_len(ROWS_PER_TASK)
        .for_each(|row| rms_norm_in_place(row, weight, eps));
}

/// √(2/π), in GELU's tanh approximation (Gemma's `gelu_pytorch_tanh`, llama.cpp's `ggml_gelu`).
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Per row, the cos and sin of each rotated pair's angle, computed the way llama.cpp does
/// (`theta = pos · base^(-2i/d)`, advanced by repeated multiplication in f32, and divided by
/// the pair's frequency factor where the model has them).
fn rope_tables(base: f32, cfg: &ModelConfig, rows: &[Row<'_>]) -> Vec<(Vec<f32>, Vec<f32>)> {
    let half = cfg.head_dim / 2;
    let theta_scale = base.powf(-2.0 / cfg.head_dim as f32);
    let factors = cfg.rope_freq_factors.as_deref();
    rows.iter()
        .map(|r| {
            let mut theta = r.pos as f32;
            let mut cos = Vec::with_capacity(half);
            let mut sin = Vec::with_capacity(half);
            for i in 0..half {
                let angle = factors.map_or(theta, |f| theta / f[i]);
                cos.push(angle.cos());
                sin.push(angle.sin());
                theta *= theta_scale;
            }
            (cos, sin)
        })
        .collect()
}

/// Rotates each pair of a head's dimensions (paired as `style` says) by its angle.
fn apply_rope(style: Rope, head: &mut [f32], cos: &[f32], sin: &[f32]) {
    let rotate = |x0: &mut f32, x1: &mut f32, c: f32, s: f32| {
        let (a, b) = (*x0, *x1);
        *x0 = a * c - b * s;
        *x1 = a * s + b * c;
    };
    match style {
        Rope::Adjacent => {
            for (pair, (c, s)) in head.chunks_exact_mut(2).zip(cos.iter().zip(sin)) {
                let (x0, x1) = pair.split_at_mut(1);
                rotate(&mut x0[0], &mut x1[0], *c, *s);
            }
        }
        Rope::Halves => {
            let (lo, hi) = head.split_at_mut(head.len() / 2);
            for (((x0, x1), c), s) in lo.iter_mut().zip(hi).zip(cos).zip(sin) {
                rotate(x0, x1, *c, *s);
            }
        }
    }
}
