//! Quantized matrix multiply: `out[n][rows] = acts[n] · W[rows]ᵀ`, int8 dot products.
//!
//! Written by hand because candle 0.11 has no SIMD kernel for `Q4_1` on the CPU, and because
//! batched decode needs a kernel that loads each weight block once for several sequences: the
//! inner tile decodes one weight row's block and multiplies it with up to [`TILE`] activation
//! rows. Every (weight row, activation row) pair is accumulated by the same instruction
//! sequence whatever the tile or batch, so a sequence's logits are bit-identical alone or in a
//! batch, and in a prefill chunk of any size.
//!
//! The AVX2 path (`maddubs` + `madd`, as in llama.cpp's `ggml_vec_dot_q4_1_q8_1`) is compiled
//! when the build targets x86-64-v3 (see `.cargo/config.toml`); otherwise the scalar reference
//! runs.

use rayon::prelude::*;

use crate::quant::{BlockQ4_1, BlockQ8_0, BlockQ8_1, QK};
#[cfg(any(
    test,
    not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))
))]
use crate::quant::{dot_q4_1_ref, dot_q8_0_ref};

/// Activation rows multiplied per decoded weight block.
const TILE: usize = 4;

/// A weight matrix of `rows` output features, each a row of `cols / QK` blocks.
#[derive(Debug)]
pub struct QMatrix {
    pub rows: usize,
    pub cols: usize,
    pub data: QData,
}

#[derive(Debug)]
pub enum QData {
    Q4_1(Vec<BlockQ4_1>),
    Q8_0(Vec<BlockQ8_0>),
}

impl QMatrix {
    pub fn blocks_per_row(&self) -> usize {
        self.cols / QK
    }

    /// Bytes of weight data, i.e. what one pass over the matrix streams from memory.
    pub fn size_bytes(&self) -> usize {
        match &self.data {
            QData::Q4_1(b) => std::mem::size_of_val(b.as_slice()),
            QData::Q8_0(b) => std::mem::size_of_val(b.as_slice()),
        }
    }

    /// Stacks matrices with the same `cols` and block type into one, so a single pass computes
    /// all of them (q|k|v, gate|up). Returns `None` if they do not share a type.
    pub fn concat(parts: Vec<QMatrix>) -> Option<QMatrix> {
        let cols = parts.first()?.cols;
        let rows = parts.iter().map(|p| p.rows).sum();
        let mut q4 = Vec::new();
        let mut q8 = Vec::new();
        for p in parts {
            if p.cols != cols {
                return None;
            }
            match p.data {
                QData::Q4_1(b) => q4.extend(b),
                QData::Q8_0(b) => q8.extend(b),
            }
        }
        let data = match (q4.is_empty(), q8.is_empty()) {
            (false, true) => QData::Q4_1(q4),
            (true, false) => QData::Q8_0(q8),
            _ => return None,
        };
        Some(QMatrix { rows, cols, data })
    }

    /// `out[j * rows + r] = dot(W[r], acts[j])` for `n` activation rows of `cols / QK` blocks.
    /// Runs on the current rayon pool, split by weight rows.
    pub fn matmul(&self, acts: &[BlockQ8_1], n: usize, out: &mut [f32]) {
        let nb = self.blocks_per_row();
        assert_eq!(acts.len(), n * nb, "activation shape");
        assert_eq!(out.len(), n * self.rows, "output shape");
        let threads = rayon::current_num_threads().max(1);
        // Enough chunks for work stealing to even out, few enough to keep hand-offs cheap.
        let chunk_rows = self.rows.div_ceil(threads * 4).max(16);
        let out_ptr = SendPtr(out.as_mut_ptr());
        let rows = self.rows;
        (0..rows.div_ceil(chunk_rows))
            .into_par_iter()
            .for_each(|c| {
                let r0 = c * chunk_rows;
                let r1 = (r0 + chunk_rows).min(rows);
                for r in r0..r1 {
                    for j0 in (0..n).step_by(TILE) {
                        let t = (n - j0).min(TILE);
                        let mut res = [0f32; TILE];
                        let a = &acts[j0 * nb..(j0 + t) * nb];
                        match &self.data {
                            QData::Q4_1(w) => tile_q4_1(&w[r * nb..(r + 1) * nb], a, t, &mut res),
                            QData::Q8_0(w) => tile_q8_0(&w[r * nb..(r + 1) * nb], a, t, &mut res),
                        }
                        for (k, v) in res[..t].iter().enumerate() {
                            // SAFETY: each (j, r) cell is written by exactly one task, since
                            // tasks own disjoint row ranges; the index is within `out`.
                            unsafe { *out_ptr.get().add((j0 + k) * rows + r) = *v };
                        }
                    }
                }
            });
    }
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

fn tile_q4_1(w: &[BlockQ4_1], acts: &[BlockQ8_1], t: usize, out: &mut [f32; TILE]) {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        // SAFETY: the cfg guarantees AVX2 and FMA; slices are sized by the caller.
        unsafe { avx2::tile_q4_1(w, acts, t, out) }
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    {
        let nb = w.len();
        for (k, o) in out[..t].iter_mut().enumerate() {
            *o = dot_q4_1_ref(w, &acts[k * nb..(k + 1) * nb]);
        }
    }
}

fn tile_q8_0(w: &[BlockQ8_0], acts: &[BlockQ8_1], t: usize, out: &mut [f32; TILE]) {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    {
        // SAFETY: as above.
        unsafe { avx2::tile_q8_0(w, acts, t, out) }
    }
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    {
        let nb = w.len();
        for (k, o) in out[..t].iter_mut().enumerate() {
            *o = dot_q8_0_ref(w, &acts[k * nb..(k + 1) * nb]);
        }
    }
}

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod avx2 {
    use std::arch::x86_64::*;

    use super::TILE;
    use crate::quant::{BlockQ4_1, BlockQ8_0, BlockQ8_1};

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Σ pairs of u8 × i8 into 8 f32 lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn mul_sum_us8(ux: __m256i, sy: __m256i) -> __m256 {
        let dot16 = _mm256_maddubs_epi16(ux, sy);
        _mm256_cvtepi32_ps(_mm256_madd_epi16(dot16, _mm256_set1_epi16(1)))
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile_q4_1(
        w: &[BlockQ4_1],
        acts: &[BlockQ8_1],
        t: usize,
        out: &mut [f32; TILE],
    ) {
        let nb = w.len();
        let mask = _mm_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); TILE];
        let mut summ = [0f32; TILE];
        for (b, wb) in w.iter().enumerate() {
            let (wd, wm) = (wb.d.to_f32(), wb.m.to_f32());
            // SAFETY: `qs` is 16 bytes; unaligned loads.
            let raw = unsafe { _mm_loadu_si128(wb.qs.as_ptr().cast()) };
            let lo = _mm_and_si128(raw, mask);
            let hi = _mm_and_si128(_mm_srli_epi16::<4>(raw), mask);
            let wq = _mm256_set_m128i(hi, lo);
            for k in 0..t {
                let a = &acts[k * nb + b];
                // SAFETY: `qs` is 32 bytes.
                let aq = unsafe { _mm256_loadu_si256(a.qs.as_ptr().cast()) };
                let p = mul_sum_us8(wq, aq);
                acc[k] = _mm256_fmadd_ps(p, _mm256_set1_ps(wd * a.d), acc[k]);
                summ[k] += wm * a.s;
            }
        }
        for k in 0..t {
            out[k] = hsum(acc[k]) + summ[k];
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile_q8_0(
        w: &[BlockQ8_0],
        acts: &[BlockQ8_1],
        t: usize,
        out: &mut [f32; TILE],
    ) {
        let nb = w.len();
        let mut acc = [_mm256_setzero_ps(); TILE];
        for (b, wb) in w.iter().enumerate() {
            let wd = wb.d.to_f32();
            // SAFETY: `qs` is 32 bytes.
            let wq = unsafe { _mm256_loadu_si256(wb.qs.as_ptr().cast()) };
            // maddubs needs one unsigned operand: use |w| and move w's sign onto a.
            let wabs = _mm256_sign_epi8(wq, wq);
            for k in 0..t {
                let a = &acts[k * nb + b];
                let aq = unsafe { _mm256_loadu_si256(a.qs.as_ptr().cast()) };
                let p = mul_sum_us8(wabs, _mm256_sign_epi8(aq, wq));
                acc[k] = _mm256_fmadd_ps(p, _mm256_set1_ps(wd * a.d), acc[k]);
            }
        }
        for k in 0..t {
            out[k] = hsum(acc[k]);
        }
    }
}

#[cfg(test)]
mod tests {
    use bytemuck::Zeroable;

    use super::*;
    use crate::quant::{quantize_row_q4_1, quantize_row_q8_0, quantize_row_q8_1};

    fn rows(n: usize, cols: usize, seed: f32) -> Vec<f32> {
        (0..n * cols)
            .map(|i| ((i as f32 + seed) * 0.7123).sin() * 2.0)
            .collect()
    }

    fn acts(n: usize, cols: usize) -> Vec<BlockQ8_1> {
        let x = rows(n, cols, 3.0);
        let mut a = vec![BlockQ8_1::zeroed(); n * cols / QK];
        for (xr, ar) in x.chunks(cols).zip(a.chunks_mut(cols / QK)) {
            quantize_row_q8_1(xr, ar);
        }
        a
    }

    fn check(m: &QMatrix, n: usize) {
        let nb = m.blocks_per_row();
        let a = acts(n, m.cols);
        let mut out = vec![0f32; n * m.rows];
        m.matmul(&a, n, &mut out);
        for j in 0..n {
            for r in 0..m.rows {
                let aj = &a[j * nb..(j + 1) * nb];
                let want = match &m.data {
                    QData::Q4_1(w) => dot_q4_1_ref(&w[r * nb..(r + 1) * nb], aj),
                    QData::Q8_0(w) => dot_q8_0_ref(&w[r * nb..(r + 1) * nb], aj),
                };
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
        for (xr, wr) in x.chunks(c).zip(w.chunks_mut(c / QK)) {
            quantize_row_q4_1(xr, wr);
        }
        let m = QMatrix {
            rows: r,
            cols: c,
            data: QData::Q4_1(w),
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
        for (xr, wr) in x.chunks(c).zip(w.chunks_mut(c / QK)) {
            quantize_row_q8_0(xr, wr);
        }
        let m = QMatrix {
            rows: r,
            cols: c,
            data: QData::Q8_0(w),
        };
        for n in [1, 5, 8] {
            check(&m, n);
        }
    }
}
