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
        let task = |q5: &mut Q5_0Scratch, units: &[(&Part, usize)]| {
            for &(part, g) in units {
                let per_row = nb / part.data.span();
                let group = g * per_row..(g + 1) * per_row;
                let decoded = match &part.data {
                    Packed::Q5_0(w) => q5.decode(&w[group.clone()], n),
                    _ => None,
                };
                for j0 in (0..n).step_by(TILE) {
                    let t = (n - j0).min(TILE);
                    let a = &acts[j0 * nb..(j0 + t) * nb];
                    let mut res = [[0f32; GROUP]; TILE];
                    let blocks = group.clone();
                    match &part.data {
                        Packed::Q4_1(w) => tile_q4_1(&w[blocks], a, t, &mut res),
                        Packed::Q5_0(w) => tile_q5_0(&w[blocks], decoded, a, t, &mut res),
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
        };
        units
            .par_chunks(chunk)
            .for_each_init(Q5_0Scratch::default, task);
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

// The kernels, a module per instruction set. The two x86 sets give bit-identical results: the
// per-block integer sums are exact either way, and the float steps after them are the same,
// lane by lane.
#[cfg(x86_v3)]
mod avx2;
#[cfg(x86_v3)]
mod avx512;
#[cfg(not(x86_v3))]
mod scalar;
#[cfg(x86_v3)]
mod x86;

/// Each weight type's tile, run in the VNNI or the AVX2 instruction set for a runtime tile size.
#[cfg(x86_v3)]
mod dispatch {
    use super::{AVX2_TILE, TILE, TileOut, avx2, avx512};
    use crate::packed::{BlockQ4_1x16, BlockQ5_0x16, BlockQ6Kx16, BlockQ8_0x16, NibblesK};
    use crate::quant::BlockQ8_1;

    macro_rules! dispatch_tile {
        ($avx2:ident, $vnni:ident, $w:expr, $acts:expr, $t:expr, $out:expr) => {
            dispatch_tile!($avx2, $vnni, $w, [], $acts, $t, $out)
        };
        // `$extra` are the AVX2 kernel's arguments after the weights.
        ($avx2:ident, $vnni:ident, $w:expr, [$($extra:expr),*], $acts:expr, $t:expr, $out:expr) => {
            // SAFETY: the cfg guarantees AVX2, FMA and F16C; AVX-512 VNNI is checked at run
            // time; the slices are sized by `QMatrix::matmul`.
            unsafe {
                let (w, acts, t, out) = ($w, $acts, $t, $out);
                if crate::cpu::has_avx512_vnni() {
                    match t {
                        1 => avx512::$vnni::<1>(w, acts, out),
                        2 => avx512::$vnni::<2>(w, acts, out),
                        3 => avx512::$vnni::<3>(w, acts, out),
                        4 => avx512::$vnni::<4>(w, acts, out),
                        5 => avx512::$vnni::<5>(w, acts, out),
                        6 => avx512::$vnni::<6>(w, acts, out),
                        7 => avx512::$vnni::<7>(w, acts, out),
                        _ => avx512::$vnni::<TILE>(w, acts, out),
                    }
                } else {
                    // Activation blocks per row.
                    let nb = acts.len() / t;
                    for (i, out) in out[..t].chunks_mut(AVX2_TILE).enumerate() {
                        let acts = &acts[i * AVX2_TILE * nb..];
                        match out.len() {
                            1 => avx2::$avx2::<1>(w, $($extra,)* acts, out),
                            2 => avx2::$avx2::<2>(w, $($extra,)* acts, out),
                            3 => avx2::$avx2::<3>(w, $($extra,)* acts, out),
                            _ => avx2::$avx2::<AVX2_TILE>(w, $($extra,)* acts, out),
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

    /// A row group's `Q5_0` quants decoded once for the AVX2 kernel's passes over it.
    #[derive(Default)]
    pub(super) struct Q5_0Scratch(Vec<avx2::Q5_0Bytes>);

    impl Q5_0Scratch {
        /// The group `w` decoded, if the AVX2 kernel is to pass over it more than once for `n`
        /// activation rows (the VNNI kernel spreads the fifth bits with a masked move each).
        pub(super) fn decode(
            &mut self,
            w: &[BlockQ5_0x16],
            n: usize,
        ) -> Option<&[avx2::Q5_0Bytes]> {
            if n <= AVX2_TILE || crate::cpu::has_avx512_vnni() {
                return None;
            }
            // SAFETY: the cfg guarantees AVX2.
            unsafe { avx2::decode_q5_0(w, &mut self.0) };
            Some(&self.0)
        }
    }

    /// `decoded`, if given, is `w` by [`Q5_0Scratch::decode`].
    pub(super) fn tile_q5_0(
        w: &[BlockQ5_0x16],
        decoded: Option<&[avx2::Q5_0Bytes]>,
        acts: &[BlockQ8_1],
        t: usize,
        out: &mut TileOut,
    ) {
        dispatch_tile!(tile_q5_0, tile_q5_0_vnni, w, [decoded], acts, t, out)
    }

    pub(super) fn tile_q4_k(w: &[impl NibblesK], acts: &[BlockQ8_1], t: usize, out: &mut TileOut) {
        dispatch_tile!(tile_q4_k, tile_q4_k_vnni, w, acts, t, out)
    }

    pub(super) fn tile_q6_k(w: &[BlockQ6Kx16], acts: &[BlockQ8_1], t: usize, out: &mut TileOut) {
        dispatch_tile!(tile_q6_k, tile_q6_k_vnni, w, acts, t, out)
    }
}

#[cfg(x86_v3)]
use dispatch::{Q5_0Scratch, tile_q4_1, tile_q4_k, tile_q5_0, tile_q6_k, tile_q8_0};

#[cfg(not(x86_v3))]
use scalar::{Q5_0Scratch, tile_q4_1, tile_q4_k, tile_q5_0, tile_q6_k, tile_q8_0};

#[cfg(test)]
mod tests;
