//! Quantized matrix multiply: `out[n][rows] = acts[n] · W[rows]ᵀ`, int8 dot products.
//!
//! Written by hand because candle 0.11 has no SIMD kernels for these weight types on the CPU,
//! and because batched decode and prefill need a kernel that loads each weight block once for
//! several activation rows. Weights (`Q4_1`, `Q5_0`, `Q8_0`, `Q4_K`, `Q5_K`, `Q6_K`) are
//! repacked at load into groups of 16 interleaved rows (see `packed.rs`); the inner tile
//! multiplies one group's block with up to [`TILE`] activation rows, summing integer products
//! exactly and applying the scales once per block (or K-quant sub-block) for 16 rows. Every
//! (weight row, activation row) pair is accumulated by the same instruction sequence whatever the
//! tile or batch, so a sequence's logits are bit-identical alone or in a batch, and in a prefill
//! chunk of any size.
//!
//! The AVX2 path (`maddubs` on a broadcast 4-byte activation chunk, 8 rows per register) is
//! compiled when the build targets x86-64-v3 (see `.cargo/config.toml`), and an AVX-512 VNNI
//! path (`vpdpbusd` on 512-bit registers, all 16 rows at once) is chosen at run time where the
//! CPU has it; the two give bit-identical results. Where a 512-bit `vpdpbusd` issues as often as
//! a 256-bit one (Intel's server cores), the 512-bit path does twice the work per instruction;
//! where it runs as two 256-bit halves (AMD Zen 4), it saves instructions per multiply-add, not
//! cycles. Other targets run a scalar version.

use rayon::prelude::*;

use crate::memory::HugeBuf;
use crate::packed::{
    BlockQ4_1x16, BlockQ4Kx16, BlockQ5_0x16, BlockQ5Kx16, BlockQ6Kx16, BlockQ8_0x16, GROUP,
    NibblesK, SUBS, pack_q4_1, pack_q4_k, pack_q5_0, pack_q5_k, pack_q6_k, pack_q8_0,
};
use crate::quant::{BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5K, BlockQ6K, BlockQ8_0, BlockQ8_1, QK};

/// Activation rows multiplied per decoded weight block: enough independent accumulator chains
/// to keep two `vpdpbusd` a cycle in flight (latency 4), within the 32 vector registers of
/// AVX-512. The AVX2 path, with 16 registers, takes a tile in passes of [`AVX2_TILE`].
const TILE: usize = 8;
#[cfg_attr(not(x86_v3), allow(dead_code))]
const AVX2_TILE: usize = 4;

/// Weights as read from a file, one row after another.
#[derive(Debug)]
pub enum RawWeights {
    Q4_1(Vec<BlockQ4_1>),
    Q5_0(Vec<BlockQ5_0>),
    Q8_0(Vec<BlockQ8_0>),
    Q4K(Vec<BlockQ4K>),
    Q5K(Vec<BlockQ5K>),
    Q6K(Vec<BlockQ6K>),
}

/// A weight matrix as read from a file: `rows` output features of `cols / QK` blocks each.
#[derive(Debug)]
pub struct RawMatrix {
    pub rows: usize,
    pub cols: usize,
    pub data: RawWeights,
}

/// A weight matrix repacked for the kernels. It may be several matrices of one width stacked
/// (q|k|v, gate|up), each in its own block type, so a single pass computes all of them.
#[derive(Debug)]
pub struct QMatrix {
    pub rows: usize,
    pub cols: usize,
    parts: Vec<Part>,
}

/// Rows `first..first + rows` of a [`QMatrix`], in one block type.
#[derive(Debug)]
struct Part {
    first: usize,
    rows: usize,
    data: Packed,
}

#[derive(Debug)]
enum Packed {
    Q4_1(HugeBuf<BlockQ4_1x16>),
    Q5_0(HugeBuf<BlockQ5_0x16>),
    Q8_0(HugeBuf<BlockQ8_0x16>),
    Q4K(HugeBuf<BlockQ4Kx16>),
    Q5K(HugeBuf<BlockQ5Kx16>),
    Q6K(HugeBuf<BlockQ6Kx16>),
}

impl Packed {
    /// Packs `raw`, rows `done..` of a `rows`-row part (`done` a multiple of [`GROUP`]), into
    /// `packed`, made on the first chunk; returns the rows it held.
    fn pack_chunk(
        packed: &mut Option<Packed>,
        rows: usize,
        done: usize,
        nb: usize,
        raw: &RawWeights,
    ) -> usize {
        fn put<S, D>(
            out: &mut [D],
            done: usize,
            nb: usize,
            src: &[S],
            pack: fn(usize, usize, &[S], &mut [D]),
        ) -> usize {
            let n = src.len() / nb;
            let g0 = done / GROUP;
            pack(n, nb, src, &mut out[g0 * nb..(g0 + n.div_ceil(GROUP)) * nb]);
            n
        }
        let nbk = nb / SUBS;
        let groups = rows.div_ceil(GROUP);
        let (nb_g, nbk_g) = (groups * nb, groups * nbk);
        let p = packed.get_or_insert_with(|| match raw {
            RawWeights::Q4_1(_) => Packed::Q4_1(HugeBuf::zeroed(nb_g)),
            RawWeights::Q5_0(_) => Packed::Q5_0(HugeBuf::zeroed(nb_g)),
            RawWeights::Q8_0(_) => Packed::Q8_0(HugeBuf::zeroed(nb_g)),
            RawWeights::Q4K(_) => Packed::Q4K(HugeBuf::zeroed(nbk_g)),
            RawWeights::Q5K(_) => Packed::Q5K(HugeBuf::zeroed(nbk_g)),
            RawWeights::Q6K(_) => Packed::Q6K(HugeBuf::zeroed(nbk_g)),
        });
        match (p, raw) {
            (Packed::Q4_1(o), RawWeights::Q4_1(b)) => put(o, done, nb, b, pack_q4_1),
            (Packed::Q5_0(o), RawWeights::Q5_0(b)) => put(o, done, nb, b, pack_q5_0),
            (Packed::Q8_0(o), RawWeights::Q8_0(b)) => put(o, done, nb, b, pack_q8_0),
            (Packed::Q4K(o), RawWeights::Q4K(b)) => put(o, done, nbk, b, pack_q4_k),
            (Packed::Q5K(o), RawWeights::Q5K(b)) => put(o, done, nbk, b, pack_q5_k),
            (Packed::Q6K(o), RawWeights::Q6K(b)) => put(o, done, nbk, b, pack_q6_k),
            _ => unreachable!("a part's chunks are all read as its tensor's one type"),
        }
    }

    /// Activation blocks per packed block: 1, or [`SUBS`] for a K-quant super-block.
    fn span(&self) -> usize {
        match self {
            Packed::Q4K(_) | Packed::Q5K(_) | Packed::Q6K(_) => SUBS,
            _ => 1,
        }
    }
}

impl QMatrix {
    pub fn new(raw: RawMatrix) -> Self {
        Self::stack(vec![raw]).expect("one matrix stacks")
    }

    /// Stacks matrices of the same width into one; `None` if the widths differ or there are none.
    pub fn stack(raws: Vec<RawMatrix>) -> Option<Self> {
        let cols = raws.first()?.cols;
        if raws.iter().any(|r| r.cols != cols) {
            return None;
        }
        let parts = raws
            .into_iter()
            .map(|r| (r.rows, std::iter::once(Ok::<_, ()>(r.data))));
        Self::build(cols, parts).ok()
    }

    /// Builds a stack of matrices `cols` wide from each part's row count and its rows, fed in
    /// chunks of whole [`GROUP`]s of rows (the last may be short), so a file's tensor is
    /// repacked without ever being held whole. Every chunk of a part has the part's type.
    pub fn build<E, C>(cols: usize, parts: impl IntoIterator<Item = (usize, C)>) -> Result<Self, E>
    where
        C: IntoIterator<Item = Result<RawWeights, E>>,
    {
        let nb = cols / QK;
        let mut built = Vec::new();
        let mut first = 0;
        for (rows, chunks) in parts {
            let mut data: Option<Packed> = None;
            let mut done = 0;
            for chunk in chunks {
                done += Packed::pack_chunk(&mut data, rows, done, nb, &chunk?);
            }
            let data = data.unwrap_or(Packed::Q8_0(HugeBuf::zeroed(0)));
            built.push(Part { first, rows, data });
            first += rows;
        }
        Ok(Self {
            rows: first,
            cols,
            parts: built,
        })
    }

    pub fn blocks_per_row(&self) -> usize {
        self.cols / QK
    }

    /// Row `r` as f32 values (the embedding lookup).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let nb = self.blocks_per_row();
        let part = self
            .parts
            .iter()
            .find(|p| r < p.first + p.rows)
            .expect("row within the matrix");
        let r = r - part.first;
        let (g, ri) = (r / GROUP, r % GROUP);
        for (b, chunk) in out.chunks_exact_mut(QK).enumerate() {
            let i = (g * nb + b) / part.data.span();
            let (d, m, q) = match &part.data {
                Packed::Q4_1(w) => {
                    let q = crate::packed::q4_1_quants(&w[i], ri).map(f32::from);
                    (w[i].d[ri].to_f32(), w[i].m[ri].to_f32(), q)
                }
                Packed::Q5_0(w) => {
                    let q = crate::packed::q5_0_quants(&w[i], ri).map(f32::from);
                    let d = w[i].d[ri].to_f32();
                    (d, -16.0 * d, q)
                }
                Packed::Q8_0(w) => {
                    let q = crate::packed::q8_0_quants(&w[i], ri).map(f32::from);
                    (w[i].d[ri].to_f32(), 0.0, q)
                }
                Packed::Q4K(w) => k4_row(&w[i], ri, b % SUBS),
                Packed::Q5K(w) => k4_row(&w[i], ri, b % SUBS),
                Packed::Q6K(w) => {
                    let j = b % SUBS;
                    let q = crate::packed::q6_k_quants(&w[i], ri, j);
                    let d = w[i].d[ri].to_f32();
                    for (e, (o, q)) in chunk.iter_mut().zip(q).enumerate() {
                        let sc = w[i].scales[GROUP * (2 * j + e / 16) + ri];
                        *o = d * f32::from(sc) * (f32::from(q) - 32.0);
                    }
                    continue;
                }
            };
            for (o, q) in chunk.iter_mut().zip(q) {
                *o = d * q + m;
            }
        }
    }

    /// `out[j * rows + r] = dot(W[r], acts[j])` for `n` activation rows of `cols / QK` blocks.
    /// Runs on the current rayon pool, split by groups of rows.
    pub fn matmul(&self, acts: &[BlockQ8_1], n: usize, out: &mut [f32]) {
        let nb = self.blocks_per_row();
        assert_eq!(acts.len(), n * nb, "activation shape");
        assert_eq!(out.len(), n * self.rows, "output shape");
        // Every (part, group of rows) is one unit of work.
        let units: Vec<(&Part, usize)> = self
            .parts
            .iter()
            .flat_map(|p| (0..p.rows.div_ceil(GROUP)).map(move |g| (p, g)))
            .collect();
        let threads = rayon::current_num_threads().max(1);
        // Enough chunks for work stealing to even out, few enough to keep hand-offs cheap.
        let chunk = units.len().div_ceil(threads * 4).max(2);
        let out_ptr = SendPtr(out.as_mut_ptr());
        let rows = self.rows;
        units.par_chunks(chunk).for_each(|units| {
            for &(part, g) in units {
                for j0 in (0..n).step_by(TILE) {
                    let t = (n - j0).min(TILE);
                    let a = &acts[j0 * nb..(j0 + t) * nb];
                    let mut res = [[0f32; GROUP]; TILE];
                    let per_row = nb / part.data.span();
                    let blocks = g * per_row..(g + 1) * per_row;
                    match &part.data {
                        Packed::Q4_1(w) => tile_q4_1(&w[blocks], a, t, &mut res),
                        Packed::Q5_0(w) => tile_q5_0(&w[blocks], a, t, &mut res),
                        Packed::Q8_0(w) => tile_q8_0(&w[blocks], a, t, &mut res),
                        Packed::Q4K(w) => tile_q4_k(&w[blocks], a, t, &mut res),
                        Packed::Q5K(w) => tile_q4_k(&w[blocks], a, t, &mut res),
                        Packed::Q6K(w) => tile_q6_k(&w[blocks], a, t, &mut res),
                    }
                    let live = GROUP.min(part.rows - g * GROUP);
                    for (k, r) in res[..t].iter().enumerate() {
                        let at = (j0 + k) * rows + part.first + g * GROUP;
                        // SAFETY: each (j, row) cell is written by exactly one task, since tasks
                        // own disjoint groups of rows; `at + live <= out.len()`. A whole group
                        // is copied at a constant size: a vector store, not a `memmove` call.
                        unsafe {
                            let dst = out_ptr.get().add(at);
                            if live == GROUP {
                                dst.cast::<[f32; GROUP]>().write_unaligned(*r);
                            } else {
                                std::ptr::copy_nonoverlapping(r.as_ptr(), dst, live);
                            }
                        }
                    }
                }
            }
        });
    }
}

/// Sub-block `j` of row `ri` of a `Q4_K` or `Q5_K` super-block as `(d·sc, −dmin·m, quants)`.
fn k4_row(blk: &impl NibblesK, ri: usize, j: usize) -> (f32, f32, [f32; QK]) {
    let low = blk.low();
    let sc = f32::from(low.scales[GROUP * j + ri]);
    let m = f32::from(low.mins[GROUP * j + ri]);
    let q = blk.quants(ri, j).map(f32::from);
    (low.d[ri].to_f32() * sc, -(low.dmin[ri].to_f32() * m), q)
}

/// A raw pointer that tasks writing disjoint cells may share.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: used only for writes to disjoint indices (see `QMatrix::matmul`).
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Per activation row of a tile, the outputs of one row group.
type TileOut = [[f32; GROUP]];

/// Each weight type's tile, run in the VNNI or the AVX2 instruction set for a runtime tile size.
#[cfg(x86_v3)]
mod dispatch {
    use super::{AVX2_TILE, TILE, TileOut, x86};
    use crate::packed::{BlockQ4_1x16, BlockQ5_0x16, BlockQ6Kx16, BlockQ8_0x16, NibblesK};
    use crate::quant::BlockQ8_1;

    macro_rules! dispatch_tile {
        ($avx2:ident, $vnni:ident, $w:expr, $acts:expr, $t:expr, $out:expr) => {
            // SAFETY: the cfg guarantees AVX2, FMA and F16C; VNNI is checked at run time; the
            // slices are sized by `QMatrix::matmul`.
            unsafe {
                let (w, acts, t, out) = ($w, $acts, $t, $out);
                if x86::has_vnni() {
                    match t {
                        1 => x86::$vnni::<1>(w, acts, out),
                        2 => x86::$vnni::<2>(w, acts, out),
                        3 => x86::$vnni::<3>(w, acts, out),
                        4 => x86::$vnni::<4>(w, acts, out),
                        5 => x86::$vnni::<5>(w, acts, out),
                        6 => x86::$vnni::<6>(w, acts, out),
                        7 => x86::$vnni::<7>(w, acts, out),
                        _ => x86::$vnni::<TILE>(w, acts, out),
                    }
                } else {
                    // Activation blocks per row.
                    let nb = acts.len() / t;
                    for (i, out) in out[..t].chunks_mut(AVX2_TILE).enumerate() {
                        let acts = &acts[i * AVX2_TILE * nb..];
                        match out.len() {
                            1 => x86::$avx2::<1>(w, acts, out),
                            2 => x86::$avx2::<2>(w, acts, out),
                            3 => x86::$avx2::<3>(w, acts, out),
                            _ => x86::$avx2::<AVX2_TILE>(w, acts, out),
                        }
                    }
                }
            }
        };
    }

    pub(super) fn tile_q4_1(w: &[BlockQ4_1x16], acts: &[BlockQ8_1], t: usize, out: &mut TileOut) {
        dispatch_tile!(tile_q4_1, tile_q4_1_vnni, w, acts, t, out)
    }

    pub(super) fn tile_q8_0(w: &[BlockQ8_0x16], acts: &[BlockQ8_1], t: usize, out: &mut TileOut) {
        dispatch_tile!(tile_q8_0, tile_q8_0_vnni, w, acts, t, out)
    }

    pub(super) fn tile_q5_0(w: &[BlockQ5_0x16], acts: &[BlockQ8_1], t: usize, out: &mut TileOut) {
        dispatch_tile!(tile_q5_0, tile_q5_0_vnni, w, acts, t, out)
    }

    pub(super) fn tile_q4_k(w: &[impl NibblesK], acts: &[BlockQ8_1], t: usize, out: &mut TileOut) {
        dispatch_tile!(tile_q4_k, tile_q4_k_vnni, w, acts, t, out)
    }

    pub(super) fn tile_q6_k(w: &[BlockQ6Kx16], acts: &[BlockQ8_1], t: usize, out: &mut TileOut) {
        dispatch_tile!(tile_q6_k, tile_q6_k_vnni, w, acts, t, out)
    }
}

#[cfg(x86_v3)]
use dispatch::{tile_q4_1, tile_q4_k, tile_q5_0, tile_q6_k, tile_q8_0};

#[cfg(not(x86_v3))]
use scalar::{tile_q4_1, tile_q4_k, tile_q5_0, tile_q6_k, tile_q8_0};

/// The portable fallback, for builds without x86-64-v3.
#[cfg(not(x86_v3))]
mod scalar {
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

    pub(super) fn tile_q5_0(w: &[BlockQ5_0x16], acts: &[BlockQ8_1], t: usize, out: &mut TileOut) {
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
}

/// The x86 kernels, in two instruction sets that give bit-identical results: the per-block
/// integer sums are exact either way, and the float steps after them are the same, lane by lane.
#[cfg(x86_v3)]
mod x86 {
    use std::arch::x86_64::*;

    use super::TileOut;
    use crate::packed::{
        BlockQ4_1x16, BlockQ5_0x16, BlockQ6Kx16, BlockQ8_0x16, CHUNK, GROUP, NibblesK, SUBS,
    };
    use crate::quant::{BlockQ8_1, QK};

    /// Rows per AVX2 pass: a 256-bit register holds 4 bytes of each.
    const HALF: usize = GROUP / 2;

    /// How far ahead of the block being multiplied the kernels ask for weights, in blocks:
    /// 2-3 KB of the 32-value types, since the hardware prefetcher alone leaves the batched
    /// matmuls waiting on memory. The K-quant kernels use [`prefetch_sub`] instead.
    const PREFETCH_BLOCKS: usize = 6;

    /// Asks the cache for the weight block [`PREFETCH_BLOCKS`] after `blk`. Past the end of a
    /// group that is the next group's (groups lie back to back), or past the matrix, nothing.
    #[inline(always)]
    fn prefetch_ahead<B>(blk: &B) {
        let ahead = std::ptr::from_ref(blk).wrapping_add(PREFETCH_BLOCKS);
        prefetch_lines(ahead.cast(), size_of::<B>());
    }

    /// Blocks ahead that the K-quant kernels ask for, an eighth of a block per sub-block (their
    /// 16-row blocks are 2-3 KB).
    const PREFETCH_K_BLOCKS: usize = 2;

    /// Asks the cache for the `j`-th eighth of the block [`PREFETCH_K_BLOCKS`] after `blk`, so
    /// the requests for a large block are spread over its sub-blocks rather than issued at once.
    #[inline(always)]
    fn prefetch_sub<B>(blk: &B, j: usize) {
        let part = size_of::<B>() / SUBS;
        let ahead = std::ptr::from_ref(blk).wrapping_add(PREFETCH_K_BLOCKS);
        prefetch_lines(ahead.cast::<i8>().wrapping_add(part * j), part);
    }

    /// One prefetch per 64-byte line of the `bytes` from `start`, into the L2 cache
    /// (`_MM_HINT_T1`) rather than the L1. The L1 has few miss buffers, and a prefetch holds one
    /// for a whole trip to memory, so prefetches into it likely keep the kernel's own loads
    /// waiting; the L2 hint decodes faster (docs/models.md, "Speed against llama.cpp").
    #[inline(always)]
    fn prefetch_lines(start: *const i8, bytes: usize) {
        for line in (0..bytes).step_by(64) {
            // SAFETY: a prefetch never faults and has no effect on memory, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(start.wrapping_add(line)) };
        }
    }

    /// AVX-512 with VNNI (and BW, for byte shifts), detected once.
    pub(super) fn has_vnni() -> bool {
        static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *VNNI.get_or_init(|| {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
        })
    }

    /// Whether the quants of `w` have a fifth bit (`Q5_K`), known at compile time.
    #[inline(always)]
    fn has_fifth<B: NibblesK>(_: &[B]) -> bool {
        B::FIFTH
    }

    /// Four activation quants starting at `at`, as one 32-bit value for a broadcast.
    #[inline(always)]
    unsafe fn quad(a: &BlockQ8_1, at: usize) -> i32 {
        // SAFETY: `at + 4 <= 32`; the read is unaligned.
        unsafe { a.qs.as_ptr().add(at).cast::<i32>().read_unaligned() }
    }

    /// One 16-row group against `T` activation rows, in AVX2, as two passes over 8-row halves
    /// (a 256-bit register holds 4 bytes of 8 rows). Per block, the integer sums are exact
    /// (≤ 8 · 2 · 15 · 128 = 30720 fits an i16 lane), then scaled once for the 8 rows. Low and
    /// high nibbles accumulate in separate chains, so even one activation row keeps two
    /// multiply-adds in flight.
    pub(super) unsafe fn tile_q4_1<const T: usize>(
        w: &[BlockQ4_1x16],
        acts: &[BlockQ8_1],
        out: &mut TileOut,
    ) {
        let nb = w.len();
        // SAFETY (whole body): the cfg guarantees AVX2, FMA and F16C; every load reads inside
        // a block.
        unsafe {
            let mask = _mm256_set1_epi8(0x0F);
            let ones = _mm256_set1_epi16(1);
            for half in 0..2 {
                let mut acc = [_mm256_setzero_ps(); T];
                for (b, blk) in w.iter().enumerate() {
                    // The second half finds the first half's prefetches in cache.
                    if half == 0 {
                        prefetch_ahead(blk);
                    }
                    let mut isum_lo = [_mm256_setzero_si256(); T];
                    let mut isum_hi = [_mm256_setzero_si256(); T];
                    for j in 0..4 {
                        let at = CHUNK * j + 4 * HALF * half;
                        let raw = _mm256_loadu_si256(blk.qs.as_ptr().add(at).cast());
                        let lo = _mm256_and_si256(raw, mask);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask);
                        for k in 0..T {
                            let a = &acts[k * nb + b];
                            let (al, ah) = (quad(a, 4 * j), quad(a, 16 + 4 * j));
                            let pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(al));
                            let ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(ah));
                            isum_lo[k] = _mm256_add_epi16(isum_lo[k], pl);
                            isum_hi[k] = _mm256_add_epi16(isum_hi[k], ph);
                        }
                    }
                    let dw =
                        _mm256_cvtph_ps(_mm_loadu_si128(blk.d.as_ptr().add(HALF * half).cast()));
                    let mw =
                        _mm256_cvtph_ps(_mm_loadu_si128(blk.m.as_ptr().add(HALF * half).cast()));
                    for k in 0..T {
                        let a = &acts[k * nb + b];
                        let sum = _mm256_add_epi16(isum_lo[k], isum_hi[k]);
                        let f = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum, ones));
                        acc[k] = _mm256_fmadd_ps(f, _mm256_mul_ps(dw, _mm256_set1_ps(a.d)), acc[k]);
                        acc[k] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.s), acc[k]);
                    }
                }
                for k in 0..T {
                    _mm256_storeu_ps(out[k].as_mut_ptr().add(HALF * half), acc[k]);
                }
            }
        }
    }

    /// One 16-row `Q8_0` group against `T` activation rows, in AVX2 halves as in `tile_q4_1`.
    /// The weights' offset is flipped back off, and the unsigned operand is |w|, with w's sign
    /// moved onto the activations. Each 4-byte step is widened to i32 at once, since two
    /// `maddubs` results (up to 2 · 127 · 128 each) would overflow an i16 lane.
    pub(super) unsafe fn tile_q8_0<const T: usize>(
        w: &[BlockQ8_0x16],
        acts: &[BlockQ8_1],
        out: &mut TileOut,
    ) {
        let nb = w.len();
        // SAFETY (whole body): as in `tile_q4_1`.
        unsafe {
            let ones = _mm256_set1_epi16(1);
            let flip = _mm256_set1_epi8(-128);
            for half in 0..2 {
                let mut acc = [_mm256_setzero_ps(); T];
                for (b, blk) in w.iter().enumerate() {
                    // The second half finds the first half's prefetches in cache.
                    if half == 0 {
                        prefetch_ahead(blk);
                    }
                    // Even and odd steps accumulate in separate chains (see `tile_q4_1`).
                    let mut isum = [[_mm256_setzero_si256(); T]; 2];
                    for j in 0..8 {
                        let at = CHUNK * j + 4 * HALF * half;
                        let wq = _mm256_load_si256(blk.qs.as_ptr().add(at).cast());
                        let wq = _mm256_xor_si256(wq, flip);
                        let u = _mm256_sign_epi8(wq, wq);
                        for k in 0..T {
                            let a = _mm256_set1_epi32(quad(&acts[k * nb + b], 4 * j));
                            let s = _mm256_sign_epi8(a, wq);
                            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones);
                            isum[j % 2][k] = _mm256_add_epi32(isum[j % 2][k], p);
                        }
                    }
                    let dw =
                        _mm256_cvtph_ps(_mm_loadu_si128(blk.d.as_ptr().add(HALF * half).cast()));
                    for k in 0..T {
                        let a = &acts[k * nb + b];
                        let f = _mm256_cvtepi32_ps(_mm256_add_epi32(isum[0][k], isum[1][k]));
                        acc[k] = _mm256_fmadd_ps(f, _mm256_mul_ps(dw, _mm256_set1_ps(a.d)), acc[k]);
                    }
                }
                for k in 0..T {
                    _mm256_storeu_ps(out[k].as_mut_ptr().add(HALF * half), acc[k]);
                }
            }
        }
    }

    /// 32 bytes, byte `i` 0x10 where bit `i` of `bits` is set: the fifth bits of a `Q5_0` chunk's
    /// 8-row half.
    #[inline(always)]
    unsafe fn fifth_bits(bits: u32) -> __m256i {
        // SAFETY: the cfg guarantees AVX2.
        unsafe {
            // Byte i takes byte i / 8 of `bits`, then tests bit i % 8 of it.
            let spread = _mm256_shuffle_epi8(
                _mm256_set1_epi32(bits as i32),
                _mm256_set_epi64x(
                    0x0303_0303_0303_0303,
                    0x0202_0202_0202_0202,
                    0x0101_0101_0101_0101,
                    0,
                ),
            );
            let select = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
            _mm256_and_si256(set, _mm256_set1_epi8(0x10))
        }
    }

    /// One 16-row `Q5_0` group against `T` activation rows, in AVX2 halves as in `tile_q4_1`,
    /// with each quant's fifth bit or-ed in from the chunk's mask. The kernel sums `q · a` for the
    /// unsigned `q` (≤ 4 · 2 · 31 · 127 = 31496 per i16 lane for one nibble's four chunks), and
    /// takes the offset 16 back off in integers with the activation block's sum, so each block
    /// is scaled once: `d·d_a·(Σ q·a − 16·Σa)`.
    pub(super) unsafe fn tile_q5_0<const T: usize>(
        w: &[BlockQ5_0x16],
        acts: &[BlockQ8_1],
        out: &mut TileOut,
    ) {
        let nb = w.len();
        // SAFETY (whole body): as in `tile_q4_1`.
        unsafe {
            let mask = _mm256_set1_epi8(0x0F);
            let ones = _mm256_set1_epi16(1);
            for half in 0..2 {
                let mut acc = [_mm256_setzero_ps(); T];
                for (b, blk) in w.iter().enumerate() {
                    if half == 0 {
                        prefetch_ahead(blk);
                    }
                    let mut isum_lo = [_mm256_setzero_si256(); T];
                    let mut isum_hi = [_mm256_setzero_si256(); T];
                    for j in 0..4 {
                        let at = CHUNK * j + 4 * HALF * half;
                        let raw = _mm256_load_si256(blk.qs.as_ptr().add(at).cast());
                        let bits = |m: u64| fifth_bits((m >> (32 * half)) as u32);
                        let lo = _mm256_or_si256(_mm256_and_si256(raw, mask), bits(blk.qh[2 * j]));
                        let hi = _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask),
                            bits(blk.qh[2 * j + 1]),
                        );
                        for k in 0..T {
                            let a = &acts[k * nb + b];
                            let (al, ah) = (quad(a, 4 * j), quad(a, 16 + 4 * j));
                            let pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(al));
                            let ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(ah));
                            isum_lo[k] = _mm256_add_epi16(isum_lo[k], pl);
                            isum_hi[k] = _mm256_add_epi16(isum_hi[k], ph);
                        }
                    }
                    let dw =
                        _mm256_cvtph_ps(_mm_loadu_si128(blk.d.as_ptr().add(HALF * half).cast()));
                    for k in 0..T {
                        let a = &acts[k * nb + b];
                        let sum = _mm256_add_epi32(
                            _mm256_madd_epi16(isum_lo[k], ones),
                            _mm256_madd_epi16(isum_hi[k], ones),
                        );
                        let offset = _mm256_set1_epi32(-16 * a.sum());
                        let f = _mm256_cvtepi32_ps(_mm256_add_epi32(sum, offset));
                        acc[k] = _mm256_fmadd_ps(f, _mm256_mul_ps(dw, _mm256_set1_ps(a.d)), acc[k]);
                    }
                }
                for k in 0..T {
                    _mm256_storeu_ps(out[k].as_mut_ptr().add(HALF * half), acc[k]);
                }
            }
        }
    }

    /// One 16-row `Q5_0` group against `T` activation rows with 512-bit `vpdpbusd`, as
    /// `tile_q4_1_vnni` with each chunk's fifth bits added by one masked move, the accumulators
    /// starting at `-16·Σa`; the float steps are `tile_q5_0`'s, so the results are bit-identical.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn tile_q5_0_vnni<const T: usize>(
        w: &[BlockQ5_0x16],
        acts: &[BlockQ8_1],
        out: &mut TileOut,
    ) {
        let nb = w.len();
        // SAFETY (whole body): the caller checked `has_vnni`; every load reads inside a block.
        unsafe {
            let mask = _mm512_set1_epi8(0x0F);
            let fifth = _mm512_set1_epi8(0x10);
            let mut acc = [_mm512_setzero_ps(); T];
            for (b, blk) in w.iter().enumerate() {
                prefetch_ahead(blk);
                let mut isum: [__m512i; T] =
                    std::array::from_fn(|k| _mm512_set1_epi32(-16 * acts[k * nb + b].sum()));
                for j in 0..4 {
                    let raw = _mm512_loadu_si512(blk.qs.as_ptr().add(CHUNK * j).cast());
                    let lo = _mm512_or_si512(
                        _mm512_and_si512(raw, mask),
                        _mm512_maskz_mov_epi8(blk.qh[2 * j], fifth),
                    );
                    let hi = _mm512_or_si512(
                        _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask),
                        _mm512_maskz_mov_epi8(blk.qh[2 * j + 1], fifth),
                    );
                    for k in 0..T {
                        let a = &acts[k * nb + b];
                        let (al, ah) = (quad(a, 4 * j), quad(a, 16 + 4 * j));
                        isum[k] = _mm512_dpbusd_epi32(isum[k], lo, _mm512_set1_epi32(al));
                        isum[k] = _mm512_dpbusd_epi32(isum[k], hi, _mm512_set1_epi32(ah));
                    }
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.d.as_ptr().cast()));
                for k in 0..T {
                    let f = _mm512_cvtepi32_ps(isum[k]);
                    let ad = _mm512_set1_ps(acts[k * nb + b].d);
                    acc[k] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, ad), acc[k]);
                }
            }
            for k in 0..T {
                _mm512_storeu_ps(out[k].as_mut_ptr(), acc[k]);
            }
        }
    }

    /// 16 bytes (one per row of a group) widened to f32 lanes, for the K-quants' per-row scales.
    #[inline(always)]
    unsafe fn scales_u8_x8(bytes: &[u8]) -> __m256 {
        // SAFETY: the cfg guarantees AVX2; the caller passes at least 8 bytes.
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(bytes.as_ptr().cast()))) }
    }

    #[inline(always)]
    unsafe fn scales_i8_x8(bytes: &[i8]) -> __m256 {
        // SAFETY: as in `scales_u8_x8`.
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(bytes.as_ptr().cast()))) }
    }

    /// One 16-row `Q4_K` (or `Q5_K`) group against `T` activation rows, in AVX2 halves. Each
    /// 32-value sub-block is `tile_q4_1`'s block (`tile_q5_0`'s for `Q5_K`, the fifth bits or-ed
    /// in from their masks), with the row's scale `d·sc` and minimum `dmin·m` (both exact in f32:
    /// an f16 times a 6-bit integer) in place of `Q4_1`'s. The low and high nibbles' i16 sums
    /// are joined before widening for `Q4_K` (≤ 2 · 4 · 2 · 15 · 127 = 30480) and after it for
    /// `Q5_K`, whose quants reach 31.
    pub(super) unsafe fn tile_q4_k<const T: usize>(
        w: &[impl NibblesK],
        acts: &[BlockQ8_1],
        out: &mut TileOut,
    ) {
        let nb = w.len() * SUBS;
        // SAFETY (whole body): as in `tile_q4_1`.
        unsafe {
            let mask = _mm256_set1_epi8(0x0F);
            let ones = _mm256_set1_epi16(1);
            for half in 0..2 {
                let row0 = HALF * half;
                let mut acc = [_mm256_setzero_ps(); T];
                for (b, blk5) in w.iter().enumerate() {
                    let blk = blk5.low();
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.d.as_ptr().add(row0).cast()));
                    let dmin = _mm256_cvtph_ps(_mm_loadu_si128(blk.dmin.as_ptr().add(row0).cast()));
                    for j in 0..SUBS {
                        // The second half finds the first half's prefetches in cache.
                        if half == 0 {
                            prefetch_sub(blk5, j);
                        }
                        let dw = _mm256_mul_ps(d, scales_u8_x8(&blk.scales[GROUP * j + row0..]));
                        let mw = _mm256_mul_ps(dmin, scales_u8_x8(&blk.mins[GROUP * j + row0..]));
                        let qs = blk.qs.as_ptr().add(j * GROUP * QK / 2);
                        let mut isum_lo = [_mm256_setzero_si256(); T];
                        let mut isum_hi = [_mm256_setzero_si256(); T];
                        for c in 0..4 {
                            let raw = _mm256_load_si256(qs.add(CHUNK * c + 4 * row0).cast());
                            let mut lo = _mm256_and_si256(raw, mask);
                            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask);
                            if has_fifth(w) {
                                let bits =
                                    |h| fifth_bits((blk5.fifth(j, c, h) >> (32 * half)) as u32);
                                lo = _mm256_or_si256(lo, bits(0));
                                hi = _mm256_or_si256(hi, bits(1));
                            }
                            for k in 0..T {
                                let a = &acts[k * nb + b * SUBS + j];
                                let (al, ah) = (quad(a, 4 * c), quad(a, 16 + 4 * c));
                                let pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(al));
                                let ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(ah));
                                isum_lo[k] = _mm256_add_epi16(isum_lo[k], pl);
                                isum_hi[k] = _mm256_add_epi16(isum_hi[k], ph);
                            }
                        }
                        for k in 0..T {
                            let a = &acts[k * nb + b * SUBS + j];
                            let (lo, hi) = (isum_lo[k], isum_hi[k]);
                            let sum = match has_fifth(w) {
                                true => _mm256_add_epi32(
                                    _mm256_madd_epi16(lo, ones),
                                    _mm256_madd_epi16(hi, ones),
                                ),
                                false => _mm256_madd_epi16(_mm256_add_epi16(lo, hi), ones),
                            };
                            let f = _mm256_cvtepi32_ps(sum);
                            acc[k] =
                                _mm256_fmadd_ps(f, _mm256_mul_ps(dw, _mm256_set1_ps(a.d)), acc[k]);
                            acc[k] = _mm256_fnmadd_ps(mw, _mm256_set1_ps(a.s), acc[k]);
                        }
                    }
                }
                for k in 0..T {
                    _mm256_storeu_ps(out[k].as_mut_ptr().add(row0), acc[k]);
                }
            }
        }
    }

    /// One 16-row `Q6_K` group against `T` activation rows, in AVX2 halves. Per sub-block, the
    /// low nibbles (its first 16 values) and the high ones (its last 16) sum in separate i32
    /// chains, each started at `−32·Σa` of its half of the activations, which takes the offset
    /// 32 off exactly; each is then scaled by its own group's `d·sc` (exact in f32).
    pub(super) unsafe fn tile_q6_k<const T: usize>(
        w: &[BlockQ6Kx16],
        acts: &[BlockQ8_1],
        out: &mut TileOut,
    ) {
        let nb = w.len() * SUBS;
        // SAFETY (whole body): as in `tile_q4_1`.
        unsafe {
            let mask = _mm256_set1_epi8(0x0F);
            let high = _mm256_set1_epi8(0x30);
            let ones = _mm256_set1_epi16(1);
            for half in 0..2 {
                let row0 = HALF * half;
                let mut acc = [_mm256_setzero_ps(); T];
                for (b, blk) in w.iter().enumerate() {
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.d.as_ptr().add(row0).cast()));
                    for j in 0..SUBS {
                        // The second half finds the first half's prefetches in cache.
                        if half == 0 {
                            prefetch_sub(blk, j);
                        }
                        let dl =
                            _mm256_mul_ps(d, scales_i8_x8(&blk.scales[GROUP * 2 * j + row0..]));
                        let dh = _mm256_mul_ps(
                            d,
                            scales_i8_x8(&blk.scales[GROUP * (2 * j + 1) + row0..]),
                        );
                        let ql = blk.ql.as_ptr().add(j * GROUP * QK / 2);
                        let qh = blk.qh.as_ptr().add(j * GROUP * QK / 4 + 4 * row0);
                        let (hl, hh) = (
                            _mm256_load_si256(qh.cast()),
                            _mm256_load_si256(qh.add(CHUNK).cast()),
                        );
                        let mut isum_lo: [__m256i; T] = std::array::from_fn(|k| {
                            _mm256_set1_epi32(-32 * acts[k * nb + b * SUBS + j].sums[0])
                        });
                        let mut isum_hi: [__m256i; T] = std::array::from_fn(|k| {
                            _mm256_set1_epi32(-32 * acts[k * nb + b * SUBS + j].sums[1])
                        });
                        for c in 0..4 {
                            let raw = _mm256_load_si256(ql.add(CHUNK * c + 4 * row0).cast());
                            let lo = _mm256_or_si256(
                                _mm256_and_si256(raw, mask),
                                _mm256_and_si256(two_bits_256(hl, c), high),
                            );
                            let hi = _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask),
                                _mm256_and_si256(two_bits_256(hh, c), high),
                            );
                            for k in 0..T {
                                let a = &acts[k * nb + b * SUBS + j];
                                let (al, ah) = (quad(a, 4 * c), quad(a, 16 + 4 * c));
                                let pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(al));
                                let ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(ah));
                                isum_lo[k] =
                                    _mm256_add_epi32(isum_lo[k], _mm256_madd_epi16(pl, ones));
                                isum_hi[k] =
                                    _mm256_add_epi32(isum_hi[k], _mm256_madd_epi16(ph, ones));
                            }
                        }
                        for k in 0..T {
                            let ad = _mm256_set1_ps(acts[k * nb + b * SUBS + j].d);
                            let fl = _mm256_cvtepi32_ps(isum_lo[k]);
                            let fh = _mm256_cvtepi32_ps(isum_hi[k]);
                            acc[k] = _mm256_fmadd_ps(fl, _mm256_mul_ps(dl, ad), acc[k]);
                            acc[k] = _mm256_fmadd_ps(fh, _mm256_mul_ps(dh, ad), acc[k]);
                        }
                    }
                }
                for k in 0..T {
                    _mm256_storeu_ps(out[k].as_mut_ptr().add(row0), acc[k]);
                }
            }
        }
    }

    /// Chunk `c`'s two high bits of each byte of `bits`, moved to bits 4-5 (not yet masked).
    #[inline(always)]
    unsafe fn two_bits_256(bits: __m256i, c: usize) -> __m256i {
        // SAFETY: the cfg guarantees AVX2. A 16-bit shift by under 8 moves each byte's own bits
        // into bits 4-5, which the caller's mask keeps.
        unsafe {
            match c {
                0 => _mm256_slli_epi16::<4>(bits),
                1 => _mm256_slli_epi16::<2>(bits),
                2 => bits,
                _ => _mm256_srli_epi16::<2>(bits),
            }
        }
    }

    #[inline(always)]
    unsafe fn two_bits_512(bits: __m512i, c: usize) -> __m512i {
        // SAFETY: the callers enable AVX-512BW; see `two_bits_256`.
        unsafe {
            match c {
                0 => _mm512_slli_epi16::<4>(bits),
                1 => _mm512_slli_epi16::<2>(bits),
                2 => bits,
                _ => _mm512_srli_epi16::<2>(bits),
            }
        }
    }

    /// 16 bytes widened to f32 lanes (the K-quants' per-row scales), 512-bit.
    #[inline(always)]
    unsafe fn scales_u8_x16(bytes: &[u8]) -> __m512 {
        // SAFETY: the callers enable AVX-512F; the caller passes at least 16 bytes.
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(bytes.as_ptr().cast()))) }
    }

    #[inline(always)]
    unsafe fn scales_i8_x16(bytes: &[i8]) -> __m512 {
        // SAFETY: as in `scales_u8_x16`.
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(bytes.as_ptr().cast()))) }
    }

    /// `tile_q4_k` with 512-bit `vpdpbusd`, all 16 rows at once (a `Q5_K` chunk's fifth bits
    /// added by one masked move each, as in `tile_q5_0_vnni`); the float steps are the same, so
    /// the results are bit-identical.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn tile_q4_k_vnni<const T: usize>(
        w: &[impl NibblesK],
        acts: &[BlockQ8_1],
        out: &mut TileOut,
    ) {
        let nb = w.len() * SUBS;
        // SAFETY (whole body): the caller checked `has_vnni`; every load reads inside a block.
        unsafe {
            let mask = _mm512_set1_epi8(0x0F);
            let fifth = _mm512_set1_epi8(0x10);
            let mut acc = [_mm512_setzero_ps(); T];
            for (b, blk5) in w.iter().enumerate() {
                let blk = blk5.low();
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk.d.as_ptr().cast()));
                let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(blk.dmin.as_ptr().cast()));
                for j in 0..SUBS {
                    prefetch_sub(blk5, j);
                    let dw = _mm512_mul_ps(d, scales_u8_x16(&blk.scales[GROUP * j..]));
                    let mw = _mm512_mul_ps(dmin, scales_u8_x16(&blk.mins[GROUP * j..]));
                    let qs = blk.qs.as_ptr().add(j * GROUP * QK / 2);
                    let mut isum = [_mm512_setzero_si512(); T];
                    for c in 0..4 {
                        let raw = _mm512_load_si512(qs.add(CHUNK * c).cast());
                        let mut lo = _mm512_and_si512(raw, mask);
                        let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask);
                        if has_fifth(w) {
                            let bits = |h| _mm512_maskz_mov_epi8(blk5.fifth(j, c, h), fifth);
                            lo = _mm512_or_si512(lo, bits(0));
                            hi = _mm512_or_si512(hi, bits(1));
                        }
                        for k in 0..T {
                            let a = &acts[k * nb + b * SUBS + j];
                            let (al, ah) = (quad(a, 4 * c), quad(a, 16 + 4 * c));
                            isum[k] = _mm512_dpbusd_epi32(isum[k], lo, _mm512_set1_epi32(al));
                            isum[k] = _mm512_dpbusd_epi32(isum[k], hi, _mm512_set1_epi32(ah));
                        }
                    }
                    for k in 0..T {
                        let a = &acts[k * nb + b * SUBS + j];
                        let f = _mm512_cvtepi32_ps(isum[k]);
                        acc[k] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, _mm512_set1_ps(a.d)), acc[k]);
                        acc[k] = _mm512_fnmadd_ps(mw, _mm512_set1_ps(a.s), acc[k]);
                    }
                }
            }
            for k in 0..T {
                _mm512_storeu_ps(out[k].as_mut_ptr(), acc[k]);
            }
        }
    }

    /// `tile_q6_k` with 512-bit `vpdpbusd`, all 16 rows at once; bit-identical to it.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn tile_q6_k_vnni<const T: usize>(
        w: &[BlockQ6Kx16],
        acts: &[BlockQ8_1],
        out: &mut TileOut,
    ) {
        let nb = w.len() * SUBS;
        // SAFETY (whole body): the caller checked `has_vnni`; every load reads inside a block.
        unsafe {
            let mask = _mm512_set1_epi8(0x0F);
            let high = _mm512_set1_epi8(0x30);
            let mut acc = [_mm512_setzero_ps(); T];
            for (b, blk) in w.iter().enumerate() {
                let d = _mm512_cvtph_ps(_mm256_loadu_si256(blk.d.as_ptr().cast()));
                for j in 0..SUBS {
                    prefetch_sub(blk, j);
                    let dl = _mm512_mul_ps(d, scales_i8_x16(&blk.scales[GROUP * 2 * j..]));
                    let dh = _mm512_mul_ps(d, scales_i8_x16(&blk.scales[GROUP * (2 * j + 1)..]));
                    let ql = blk.ql.as_ptr().add(j * GROUP * QK / 2);
                    let qh = blk.qh.as_ptr().add(j * GROUP * QK / 4);
                    let (hl, hh) = (
                        _mm512_loadu_si512(qh.cast()),
                        _mm512_loadu_si512(qh.add(CHUNK).cast()),
                    );
                    let mut isum_lo: [__m512i; T] = std::array::from_fn(|k| {
                        _mm512_set1_epi32(-32 * acts[k * nb + b * SUBS + j].sums[0])
                    });
                    let mut isum_hi: [__m512i; T] = std::array::from_fn(|k| {
                        _mm512_set1_epi32(-32 * acts[k * nb + b * SUBS + j].sums[1])
                    });
                    for c in 0..4 {
                        let raw = _mm512_loadu_si512(ql.add(CHUNK * c).cast());
                        let lo = _mm512_or_si512(
                            _mm512_and_si512(raw, mask),
                            _mm512_and_si512(two_bits_512(hl, c), high),
                        );
                        let hi = _mm512_or_si512(
                            _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask),
                            _mm512_and_si512(two_bits_512(hh, c), high),
                        );
                        for k in 0..T {
                            let a = &acts[k * nb + b * SUBS + j];
                            let (al, ah) = (quad(a, 4 * c), quad(a, 16 + 4 * c));
                            isum_lo[k] = _mm512_dpbusd_epi32(isum_lo[k], lo, _mm512_set1_epi32(al));
                            isum_hi[k] = _mm512_dpbusd_epi32(isum_hi[k], hi, _mm512_set1_epi32(ah));
                        }
                    }
                    for k in 0..T {
                        let ad = _mm512_set1_ps(acts[k * nb + b * SUBS + j].d);
                        let fl = _mm512_cvtepi32_ps(isum_lo[k]);
                        let fh = _mm512_cvtepi32_ps(isum_hi[k]);
                        acc[k] = _mm512_fmadd_ps(fl, _mm512_mul_ps(dl, ad), acc[k]);
                        acc[k] = _mm512_fmadd_ps(fh, _mm512_mul_ps(dh, ad), acc[k]);
                    }
                }
            }
            for k in 0..T {
                _mm512_storeu_ps(out[k].as_mut_ptr(), acc[k]);
            }
        }
    }

    /// One 16-row group against `T` activation rows with 512-bit `vpdpbusd`: four u8 × i8
    /// products summed straight into i32 lanes, for all 16 rows at once. Each activation row
    /// has one integer accumulator per block (low and high nibbles alike), so `T` = 8 gives the
    /// 8 independent chains that keep two `vpdpbusd` a cycle in flight (latency 4) with no
    /// instruction spent joining chains; with the 8 float accumulators that is 16 of the 32
    /// registers.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn tile_q4_1_vnni<const T: usize>(
        w: &[BlockQ4_1x16],
        acts: &[BlockQ8_1],
        out: &mut TileOut,
    ) {
        let nb = w.len();
        // SAFETY (whole body): the caller checked `has_vnni`; every load reads inside a block.
        unsafe {
            let mask = _mm512_set1_epi8(0x0F);
            let mut acc = [_mm512_setzero_ps(); T];
            for (b, blk) in w.iter().enumerate() {
                prefetch_ahead(blk);
                let mut isum = [_mm512_setzero_si512(); T];
                for j in 0..4 {
                    let raw = _mm512_loadu_si512(blk.qs.as_ptr().add(CHUNK * j).cast());
                    let lo = _mm512_and_si512(raw, mask);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask);
                    for k in 0..T {
                        let a = &acts[k * nb + b];
                        let (al, ah) = (quad(a, 4 * j), quad(a, 16 + 4 * j));
                        isum[k] = _mm512_dpbusd_epi32(isum[k], lo, _mm512_set1_epi32(al));
                        isum[k] = _mm512_dpbusd_epi32(isum[k], hi, _mm512_set1_epi32(ah));
                    }
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.d.as_ptr().cast()));
                let mw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.m.as_ptr().cast()));
                for k in 0..T {
                    let a = &acts[k * nb + b];
                    let f = _mm512_cvtepi32_ps(isum[k]);
                    acc[k] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, _mm512_set1_ps(a.d)), acc[k]);
                    acc[k] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s), acc[k]);
                }
            }
            for k in 0..T {
                _mm512_storeu_ps(out[k].as_mut_ptr(), acc[k]);
            }
        }
    }

    /// One 16-row `Q8_0` group against `T` activation rows: the weights, offset to unsigned
    /// bytes, are `vpdpbusd`'s unsigned operand as they are, and each block's accumulators
    /// start at `-128·Σa` to take the offset back off. The integer sums equal `tile_q8_0`'s
    /// exactly, and the float steps are the same, so the results are bit-identical. One chain
    /// per activation row, as in `tile_q4_1_vnni`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn tile_q8_0_vnni<const T: usize>(
        w: &[BlockQ8_0x16],
        acts: &[BlockQ8_1],
        out: &mut TileOut,
    ) {
        let nb = w.len();
        // SAFETY (whole body): the caller checked `has_vnni`; every load reads inside a block.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); T];
            for (b, blk) in w.iter().enumerate() {
                prefetch_ahead(blk);
                let mut isum: [__m512i; T] =
                    std::array::from_fn(|k| _mm512_set1_epi32(-128 * acts[k * nb + b].sum()));
                for j in 0..8 {
                    let wq = _mm512_loadu_si512(blk.qs.as_ptr().add(CHUNK * j).cast());
                    for k in 0..T {
                        let a = _mm512_set1_epi32(quad(&acts[k * nb + b], 4 * j));
                        isum[k] = _mm512_dpbusd_epi32(isum[k], wq, a);
                    }
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.d.as_ptr().cast()));
                for k in 0..T {
                    let f = _mm512_cvtepi32_ps(isum[k]);
                    let ad = _mm512_set1_ps(acts[k * nb + b].d);
                    acc[k] = _mm512_fmadd_ps(f, _mm512_mul_ps(dw, ad), acc[k]);
                }
            }
            for k in 0..T {
                _mm512_storeu_ps(out[k].as_mut_ptr(), acc[k]);
            }
        }
    }
}

#[cfg(test)]
mod tests;
