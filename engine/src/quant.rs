//! Quantized block formats and their scalar reference arithmetic.
//!
//! Weights keep GGML's on-disk block layouts (`Q4_1`, `Q8_0`) so the file's bytes are used as
//! they are. Activations are quantized per 32-value block to [`BlockQ8_1`], like llama.cpp's
//! `q8_1`: one scale, the scaled sum of the quants (which folds `Q4_1`'s per-block minimum into
//! one multiply), and 32 signed bytes. The SIMD kernels in `kernels.rs` must agree with the
//! scalar functions here; `kernels/tests.rs` checks it.
//!
//! Every `quantize_row_*` / `dequantize_row_*` function also takes several rows back to back:
//! a row is a whole number of blocks, so a matrix is just a longer run of blocks.

use bytemuck::{Pod, Zeroable};
use half::f16;

/// Values per quantization block, for every format used here.
pub const QK: usize = 32;

/// GGML `Q4_1`: `x = d * q + m` with `q` in `0..16`. Byte `j` holds element `j` in its low
/// nibble and element `j + 16` in its high nibble.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK / 2],
}

/// GGML `Q4_0`: `x = d * (q - 8)` with `q` in `0..16`, nibbles as in [`BlockQ4_1`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; QK / 2],
}

impl BlockQ4_0 {
    /// The same values as a `Q4_1` block, `d * q + m` with `m = -8 * d`: exact, since `8 * d`
    /// is `d` with its exponent raised by three (`None` where that overflows f16, or `d` is not
    /// finite). So `Q4_0` weights run on `Q4_1`'s kernels, at 20 bytes a block for the file's 18.
    pub fn as_q4_1(&self) -> Option<BlockQ4_1> {
        let m = f16::from_f32(-8.0 * self.d.to_f32());
        (m.is_finite() && m.to_f32() == -8.0 * self.d.to_f32()).then_some(BlockQ4_1 {
            d: self.d,
            m,
            qs: self.qs,
        })
    }
}

/// GGML `Q5_0`: `x = d * (q - 16)` with `q` in `0..32`. Byte `j` of `qs` holds the low four
/// bits of element `j` in its low nibble and of element `j + 16` in its high nibble; bit `i` of
/// `qh` (read as a little-endian `u32`) is element `i`'s fifth bit.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5_0 {
    pub d: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

impl BlockQ5_0 {
    /// The 32 unsigned quants `q` (the values are `d * (q - 16)`).
    pub fn quants(&self) -> [u8; QK] {
        let qh = u32::from_le_bytes(self.qh);
        let mut q = [0u8; QK];
        for j in 0..QK / 2 {
            q[j] = (self.qs[j] & 0x0F) | (((qh >> j) & 1) << 4) as u8;
            q[j + 16] = (self.qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4) as u8;
        }
        q
    }

    /// The block of scale `d` and unsigned quants `q` (each below 32): [`Self::quants`]'s
    /// inverse.
    #[cfg(test)]
    pub fn from_quants(d: f16, q: &[u8; QK]) -> Self {
        let mut block = Self::zeroed();
        let mut qh = 0u32;
        for j in 0..QK / 2 {
            block.qs[j] = (q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4);
            qh |= u32::from(q[j] >> 4) << j | u32::from(q[j + 16] >> 4) << (j + 16);
        }
        block.qh = qh.to_le_bytes();
        block.d = d;
        block
    }
}

/// Values per K-quant super-block.
pub const QK_K: usize = 256;

/// GGML `Q4_K`: eight 32-value sub-blocks, `x = d·sc·q − dmin·m` with `q` in `0..16` and a 6-bit
/// scale `sc` and minimum `m` per sub-block, packed in `scales`. Sub-blocks `2p` and `2p + 1`
/// share bytes `32p..32p + 32` of `qs`, in their low and high nibbles.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qs: [u8; QK_K / 2],
}

impl BlockQ4K {
    /// Sub-block `j`'s 6-bit scale and minimum (ggml's `get_scale_min_k4`).
    pub fn scale_min(&self, j: usize) -> (u8, u8) {
        let q = &self.scales;
        if j < 4 {
            (q[j] & 63, q[j + 4] & 63)
        } else {
            (
                (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
                (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
            )
        }
    }

    /// Sub-block `j`'s 32 quants.
    pub fn quants(&self, j: usize) -> [u8; QK] {
        let bytes = &self.qs[32 * (j / 2)..32 * (j / 2) + 32];
        let shift = 4 * (j % 2);
        std::array::from_fn(|l| (bytes[l] >> shift) & 0x0F)
    }
}

/// GGML `Q5_K`: `Q4_K` with a fifth bit per quant (`q` in `0..32`): bit `j` of `qh[l]` is the
/// fifth bit of value `l` of sub-block `j`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; 12],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}

/// The super-blocks with `Q4_K`'s scales, minimums and nibbles: `Q4_K`, and `Q5_K`, which adds
/// a fifth bit to each quant.
pub trait ScaledK: Copy {
    /// The block without any fifth bits: its scales, minimums and low four bits.
    fn low(&self) -> BlockQ4K;
    /// Sub-block `j`'s 32 fifth bits, each as 0 or 1.
    fn fifth(&self, j: usize) -> [u8; QK];

    /// Sub-block `j`'s 32 quants.
    #[cfg(test)]
    fn quants(&self, j: usize) -> [u8; QK] {
        let (low, fifth) = (self.low().quants(j), self.fifth(j));
        std::array::from_fn(|l| low[l] | (fifth[l] << 4))
    }
}

impl ScaledK for BlockQ4K {
    fn low(&self) -> BlockQ4K {
        *self
    }

    fn fifth(&self, _: usize) -> [u8; QK] {
        [0; QK]
    }
}

impl ScaledK for BlockQ5K {
    fn low(&self) -> BlockQ4K {
        BlockQ4K {
            d: self.d,
            dmin: self.dmin,
            scales: self.scales,
            qs: self.qs,
        }
    }

    fn fifth(&self, j: usize) -> [u8; QK] {
        self.qh.map(|h| (h >> j) & 1)
    }
}

/// GGML `Q6_K`: sixteen 16-value groups, `x = d·sc·(q − 32)` with `q` in `0..64` and an 8-bit
/// signed scale per group. Each 128-value half keeps its low four bits in 64 bytes of `ql` and its
/// high two in 32 bytes of `qh` (ggml's `dequantize_row_q6_K` says which where).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}

impl BlockQ6K {
    /// All 256 unsigned quants `q` (the values are `d·sc·(q − 32)`).
    pub fn quants(&self) -> [u8; QK_K] {
        let mut q = [0u8; QK_K];
        for half in 0..2 {
            let (ql, qh) = (&self.ql[64 * half..], &self.qh[32 * half..]);
            let y = &mut q[128 * half..];
            for l in 0..32 {
                y[l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
                y[l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
                y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
            }
        }
        q
    }
}

/// GGML `Q8_0`: `x = d * q` with `q` in `-127..=127`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}

/// A quantized activation block: `x ≈ d * q` (|q| ≤ 127), `s = d * Σq`, and integer sums of its
/// quants for the weight types whose packed quants carry an offset that the kernels take back
/// off with them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_1 {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; QK],
    /// The sums of the first and of the last 16 quants: per 16 values for `Q6_K`'s scales,
    /// their total for `Q8_0` and `Q5_0`.
    pub sums: [i16; 2],
    /// `−16 ·` the sums of the quants at positions 0 and 1 (mod 4), and at 2 and 3: as one
    /// 32-bit broadcast, the starting i16 lanes of the AVX2 `Q5_0` kernel, whose `maddubs` adds
    /// each 4-quant chunk's products in those two pairs (each at most 16 · 16 · 127 = 32512).
    pub q5_0_offsets: [i16; 2],
}

impl BlockQ8_1 {
    /// The integer sum of all 32 quants.
    pub fn sum(&self) -> i32 {
        i32::from(self.sums[0]) + i32::from(self.sums[1])
    }
}

/// Quantizes one row (length a multiple of [`QK`]) into `out`: `q = round(x / d)` with
/// `d = amax / 127`, rounding half away from zero like llama.cpp's reference quantizer (which
/// agrees with the fixtures better than its ties-to-even SIMD variant did in our tests).
pub fn quantize_row_q8_1(x: &[f32], out: &mut [BlockQ8_1]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (chunk, block) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = block_amax(chunk);
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        quantize_block(chunk, id, &mut block.qs);
        (block.sums, block.q5_0_offsets) = block_sums(&block.qs);
        block.d = d;
        block.s = d * block.sum() as f32;
    }
}

/// The largest |x| of one block of [`QK`] values.
#[cfg(x86_v3)]
fn block_amax(x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    assert_eq!(x.len(), QK, "block length");
    // SAFETY: AVX2 is compiled in; `x` holds QK = 32 floats.
    unsafe {
        let sign = _mm256_set1_ps(-0.0);
        let abs = |i: usize| _mm256_andnot_ps(sign, _mm256_loadu_ps(x.as_ptr().add(8 * i)));
        let m = _mm256_max_ps(_mm256_max_ps(abs(0), abs(1)), _mm256_max_ps(abs(2), abs(3)));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_movehdup_ps(m));
        _mm_cvtss_f32(m)
    }
}

#[cfg(not(x86_v3))]
fn block_amax(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

/// [`BlockQ8_1::sums`] and [`BlockQ8_1::q5_0_offsets`] of the quants `q` (|q| ≤ 127).
fn block_sums(q: &[i8; QK]) -> ([i16; 2], [i16; 2]) {
    let (mut halves, mut pairs) = ([0i16; 2], [0i16; 2]);
    for (i, &v) in q.iter().enumerate() {
        halves[i / 16] += i16::from(v);
        pairs[i % 4 / 2] += i16::from(v);
    }
    (halves, pairs.map(|p| -16 * p))
}

/// `q = round_half_away(x · id)` for one block (|x · id| ≤ 127).
#[cfg(x86_v3)]
fn quantize_block(x: &[f32], id: f32, q: &mut [i8; QK]) {
    use std::arch::x86_64::*;
    // SAFETY: AVX2 is compiled in; `x` holds QK = 32 floats and `q` 32 bytes.
    unsafe {
        let scale = _mm256_set1_ps(id);
        let half = _mm256_set1_ps(0.5);
        let sign = _mm256_set1_ps(-0.0);
        let mut ints = [_mm256_setzero_si256(); 4];
        for (i, v) in ints.iter_mut().enumerate() {
            let r = _mm256_mul_ps(_mm256_loadu_ps(x.as_ptr().add(8 * i)), scale);
            // floor(|r| + 0.5) with r's sign: rounds half away from zero.
            let mag = _mm256_floor_ps(_mm256_add_ps(_mm256_andnot_ps(sign, r), half));
            *v = _mm256_cvtps_epi32(_mm256_or_ps(mag, _mm256_and_ps(sign, r)));
        }
        // Pack 32 i32 → 32 i8 (saturating, values are within ±127), then undo the lane
        // interleaving of the 256-bit packs.
        let p16a = _mm256_packs_epi32(ints[0], ints[1]);
        let p16b = _mm256_packs_epi32(ints[2], ints[3]);
        let p8 = _mm256_packs_epi16(p16a, p16b);
        let fixed = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q.as_mut_ptr().cast(), fixed);
    }
}

#[cfg(not(x86_v3))]
fn quantize_block(x: &[f32], id: f32, q: &mut [i8; QK]) {
    for (q, v) in q.iter_mut().zip(x) {
        *q = (v * id).round() as i8;
    }
}

/// Quantizes one row into GGML `Q8_0` blocks (used to bring other weight types to a format
/// with a fast kernel).
pub fn quantize_row_q8_0(x: &[f32], out: &mut [BlockQ8_0]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (chunk, block) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        for (q, v) in block.qs.iter_mut().zip(chunk) {
            *q = (v * id).round() as i8;
        }
        block.d = f16::from_f32(d);
    }
}

/// Quantizes one row into GGML `Q4_1` blocks (kernel tests build weights with it).
#[cfg(test)]
pub fn quantize_row_q4_1(x: &[f32], out: &mut [BlockQ4_1]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (chunk, block) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let min = chunk.iter().copied().fold(f32::INFINITY, f32::min);
        let max = chunk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let d = (max - min) / 15.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        block.d = f16::from_f32(d);
        block.m = f16::from_f32(min);
        for j in 0..QK / 2 {
            let lo = ((chunk[j] - min) * id + 0.5).min(15.0) as u8;
            let hi = ((chunk[j + QK / 2] - min) * id + 0.5).min(15.0) as u8;
            block.qs[j] = lo | (hi << 4);
        }
    }
}

/// Quantizes one row into GGML `Q5_0` blocks (kernel tests build weights with it).
#[cfg(test)]
pub fn quantize_row_q5_0(x: &[f32], out: &mut [BlockQ5_0]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    for (chunk, block) in x.chunks_exact(QK).zip(out.iter_mut()) {
        // As ggml's reference: the value of largest magnitude maps to -16.
        let max = chunk
            .iter()
            .copied()
            .fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m });
        let d = max / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let q = std::array::from_fn(|i| ((chunk[i] * id + 16.5) as i32).clamp(0, 31) as u8);
        *block = BlockQ5_0::from_quants(f16::from_f32(d), &q);
    }
}

#[cfg(test)]
pub fn dequantize_row_q4_1(blocks: &[BlockQ4_1], out: &mut [f32]) {
    for (block, chunk) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let (d, m) = (block.d.to_f32(), block.m.to_f32());
        for j in 0..QK / 2 {
            chunk[j] = d * f32::from(block.qs[j] & 0x0F) + m;
            chunk[j + QK / 2] = d * f32::from(block.qs[j] >> 4) + m;
        }
    }
}

#[cfg(test)]
pub fn dequantize_row_q8_0(blocks: &[BlockQ8_0], out: &mut [f32]) {
    for (block, chunk) in blocks.iter().zip(out.chunks_exact_mut(QK)) {
        let d = block.d.to_f32();
        for (o, q) in chunk.iter_mut().zip(block.qs) {
            *o = d * f32::from(q);
        }
    }
}

/// Scalar reference for one `Q4_1` row against one activation row.
#[cfg(test)]
pub fn dot_q4_1_ref(w: &[BlockQ4_1], a: &[BlockQ8_1]) -> f32 {
    w.iter()
        .zip(a)
        .map(|(w, a)| {
            let mut sum = 0i32;
            for j in 0..QK / 2 {
                sum += i32::from(w.qs[j] & 0x0F) * i32::from(a.qs[j]);
                sum += i32::from(w.qs[j] >> 4) * i32::from(a.qs[j + QK / 2]);
            }
            w.d.to_f32() * a.d * sum as f32 + w.m.to_f32() * a.s
        })
        .sum()
}

/// Scalar reference for one `Q5_0` row against one activation row, as ggml computes it.
#[cfg(test)]
pub fn dot_q5_0_ref(w: &[BlockQ5_0], a: &[BlockQ8_1]) -> f32 {
    w.iter()
        .zip(a)
        .map(|(w, a)| {
            let sum: i32 = w
                .quants()
                .iter()
                .zip(a.qs)
                .map(|(&q, y)| (i32::from(q) - 16) * i32::from(y))
                .sum();
            w.d.to_f32() * a.d * sum as f32
        })
        .sum()
}

/// One `Q4_K` or `Q5_K` row as f32 values (ggml's `dequantize_row_q4_K`, `_q5_K`).
#[cfg(test)]
pub fn dequantize_row_k<B: ScaledK>(blocks: &[B], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let low = b.low();
        let (d, dmin) = (low.d.to_f32(), low.dmin.to_f32());
        for (j, y) in y.chunks_exact_mut(QK).enumerate() {
            let (sc, m) = low.scale_min(j);
            let (d1, m1) = (d * f32::from(sc), dmin * f32::from(m));
            for (y, q) in y.iter_mut().zip(b.quants(j)) {
                *y = d1 * f32::from(q) - m1;
            }
        }
    }
}

/// One `Q6_K` row as f32 values (ggml's `dequantize_row_q6_K`).
#[cfg(test)]
pub fn dequantize_row_q6_k(blocks: &[BlockQ6K], out: &mut [f32]) {
    for (b, y) in blocks.iter().zip(out.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        for (i, (y, q)) in y.iter_mut().zip(b.quants()).enumerate() {
            *y = d * f32::from(b.scales[i / 16]) * (f32::from(q) - 32.0);
        }
    }
}

/// The dot product of f32 weights with quantized activations, in f64: the reference the
/// K-quant kernels are checked against.
#[cfg(test)]
pub fn dot_f32_ref(w: &[f32], a: &[BlockQ8_1]) -> f32 {
    w.chunks_exact(QK)
        .zip(a)
        .map(|(w, a)| {
            w.iter()
                .zip(a.qs)
                .map(|(&x, q)| f64::from(x) * f64::from(a.d) * f64::from(q))
                .sum::<f64>()
        })
        .sum::<f64>() as f32
}

/// Scalar reference for one `Q8_0` row against one activation row.
#[cfg(test)]
pub fn dot_q8_0_ref(w: &[BlockQ8_0], a: &[BlockQ8_1]) -> f32 {
    w.iter()
        .zip(a)
        .map(|(w, a)| {
            let sum: i32 =
                w.qs.iter()
                    .zip(a.qs)
                    .map(|(&x, y)| i32::from(x) * i32::from(y))
                    .sum();
            w.d.to_f32() * a.d * sum as f32
        })
        .sum()
}

#[cfg(test)]
mod tests;
