//! Reads a GGUF file of a supported architecture ([`Arch`]) through candle's GGUF reader into
//! [`Weights`], [`ModelConfig`] and a [`TokenizerSpec`], validating everything before it is used.
//!
//! `Q4_1`, `Q5_0`, `Q8_0`, `Q4_K`, `Q5_K` and `Q6_K` tensors keep their bytes, and `Q4_0`
//! becomes `Q4_1` exactly (a minimum of `-8 * d`); any other type is dequantized by candle and
//! requantized to `Q8_0`, which has a fast kernel, with a log line saying what that costs.
//! The fingerprint is the SHA-256 of the file.

use std::io::Cursor;
use std::path::Path;

use candle_core::Device;
use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::{Content, TensorInfo};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::kernels::{QMatrix, RawWeights};
use crate::model::{
    Arch, Expert, Ffn, LayerWeights, ModelConfig, MoeWeights, PostNorms, QkNorm, Weights,
};
use crate::quant::{
    BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5K, BlockQ6K, BlockQ8_0, QK, quantize_row_q8_0,
};
use tandem_tokenizer::Tokenizer;

mod config;

use config::read_config;

/// The SHA-256 of a model's weights file: the KV wire format carries it, so KV computed by
/// one model is never used by another.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ModelFingerprint(pub [u8; 32]);

impl std::fmt::Display for ModelFingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// Everything read from one GGUF file.
#[derive(Debug)]
pub struct LoadedModel {
    pub config: ModelConfig,
    pub weights: Weights,
    pub tokenizer: Tokenizer,
    pub fingerprint: ModelFingerprint,
}

/// Loads a GGUF file from disk. Tensors are read one at a time and repacked, so the weights are
/// never in memory twice (as the file's bytes and as their repacked copy).
pub fn load_file(path: &Path) -> Result<LoadedModel> {
    let (file, fingerprint) = open_fingerprinted(path)?;
    load(Bytes::File(&file), fingerprint, path)
}

/// The error of reading the file at `path`: a missing one is named as such.
fn io_error(path: &Path, source: std::io::Error) -> Error {
    match source.kind() {
        std::io::ErrorKind::NotFound => Error::ModelNotFound {
            path: path.to_path_buf(),
            hint: String::new(),
        },
        _ => Error::Io {
            path: path.to_path_buf(),
            source,
        },
    }
}

/// The file at `path`, opened and rewound after its SHA-256 was taken.
fn open_fingerprinted(path: &Path) -> Result<(std::fs::File, ModelFingerprint)> {
    let io = |source| io_error(path, source);
    let file = std::fs::File::open(path).map_err(io)?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut std::io::BufReader::new(&file), &mut hasher).map_err(io)?;
    let fingerprint = ModelFingerprint(hasher.finalize().into());
    std::io::Seek::rewind(&mut &file).map_err(io)?;
    Ok((file, fingerprint))
}

/// Loads a GGUF image held in memory; `path` only names it in errors.
pub fn load_bytes(bytes: &[u8], path: &Path) -> Result<LoadedModel> {
    let fingerprint = ModelFingerprint(Sha256::digest(bytes).into());
    load(Bytes::Memory(bytes), fingerprint, path)
}

/// Where a GGUF image's bytes are read from.
#[derive(Clone, Copy)]
enum Bytes<'a> {
    Memory(&'a [u8]),
    File(&'a std::fs::File),
}

impl Bytes<'_> {
    fn len(&self) -> std::io::Result<u64> {
        match self {
            Bytes::Memory(b) => Ok(b.len() as u64),
            Bytes::File(f) => Ok(f.metadata()?.len()),
        }
    }

    /// Fills `dst` from byte `start` on (the caller checked the range lies in the image).
    fn read_at(&self, start: u64, dst: &mut [u8]) -> std::io::Result<()> {
        match self {
            Bytes::Memory(b) => {
                dst.copy_from_slice(&b[start as usize..start as usize + dst.len()]);
                Ok(())
            }
            Bytes::File(f) => std::os::unix::fs::FileExt::read_exact_at(*f, dst, start),
        }
    }

    fn header(&self) -> candle_core::Result<Content> {
        match self {
            Bytes::Memory(b) => Content::read(&mut Cursor::new(b)),
            Bytes::File(f) => Content::read(&mut std::io::BufReader::new(*f)),
        }
    }
}

/// What a GGUF image's header holds: its tensors' places (the metadata dropped), the model's
/// configuration and its tokenizer.
fn read_header(bytes: Bytes<'_>, path: &Path) -> Result<(Content, ModelConfig, Tokenizer)> {
    let bad = |reason: String| Error::invalid_model(path, reason);
    let mut content = bytes
        .header()
        .map_err(|e| bad(format!("cannot parse the GGUF header: {e}")))?;
    let md = &content.metadata;
    let arch = md
        .get("general.architecture")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .ok_or_else(|| bad("metadata general.architecture is missing".into()))?;
    let Some(arch) = Arch::from_gguf(&arch) else {
        let names: Vec<&str> = Arch::ALL.iter().map(|a| a.gguf_name()).collect();
        return Err(Error::UnsupportedArchitecture {
            path: path.to_path_buf(),
            arch,
            supported: names.join(", "),
        });
    };
    let config = read_config(arch, &content, path)?;
    let spec = crate::tokenizer_gguf::spec_from_gguf(md).map_err(|e| bad(e.to_string()))?;
    // The metadata holds the vocabulary and merges again (tens of MB for a 152k-262k
    // vocabulary), and so does the spec; the tokenizer is built and both are dropped before any
    // weight is read, so the peak of memory holds neither beside the weights.
    content.metadata = Default::default();
    let tokenizer = Tokenizer::new(spec).map_err(|e| bad(e.to_string()))?;
    if tokenizer.vocab_size() != config.vocab {
        return Err(bad(format!(
            "the tokenizer has {} tokens but the embedding has {} rows",
            tokenizer.vocab_size(),
            config.vocab
        )));
    }
    Ok((content, config, tokenizer))
}

/// The tokenizer of a GGUF file, read from its metadata alone (llama.cpp's vocabulary-only
/// files have no tensors).
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    let file = std::fs::File::open(path).map_err(|e| io_error(path, e))?;
    let content = Bytes::File(&file)
        .header()
        .map_err(|e| Error::invalid_model(path, format!("cannot parse the GGUF header: {e}")))?;
    let spec = crate::tokenizer_gguf::spec_from_gguf(&content.metadata)
        .map_err(|e| Error::invalid_model(path, e.to_string()))?;
    Tokenizer::new(spec).map_err(|e| Error::invalid_model(path, e.to_string()))
}

/// A GGUF file's configuration, tokenizer and fingerprint, without its weights (a simulated
/// model's).
pub fn load_header(path: &Path) -> Result<(ModelConfig, Tokenizer, ModelFingerprint)> {
    let (file, fingerprint) = open_fingerprinted(path)?;
    let (_, config, tokenizer) = read_header(Bytes::File(&file), path)?;
    Ok((config, tokenizer, fingerprint))
}

fn load(bytes: Bytes<'_>, fingerprint: ModelFingerprint, path: &Path) -> Result<LoadedModel> {
    let bad = |reason: String| Error::invalid_model(path, reason);
    let io = |source| Error::Io {
        path: path.to_path_buf(),
        source,
    };
    let (content, mut config, tokenizer) = read_header(bytes, path)?;
    let arch = config.arch;
    let reader = TensorReader {
        content: &content,
        bytes,
        path,
        read: Default::default(),
    };
    // Check that every tensor lies inside the file before reading any of them, so a
    // truncated file is reported as such.
    let len = bytes.len().map_err(io)?;
    for (name, info) in &content.tensor_infos {
        let end = reader.tensor_end(info);
        if end > len {
            return Err(bad(format!(
                "truncated: tensor {name} ends at byte {end}, the file has {len} bytes"
            )));
        }
    }
    let h = config.hidden;
    let layers = (0..config.n_layers)
        .map(|i| layer_weights(&reader, &config, i))
        .collect::<Result<Vec<_>>>()?;
    if arch == Arch::Llama && content.tensor_infos.contains_key("rope_freqs.weight") {
        config.rope_freq_factors = Some(reader.vector("rope_freqs.weight", config.head_dim / 2)?);
    }
    let embed = reader.matrix("token_embd.weight", config.vocab, h)?;
    let output = match content.tensor_infos.contains_key("output.weight") {
        true => Some(reader.matrix("output.weight", config.vocab, h)?),
        false => None,
    };
    let weights = Weights {
        embed,
        output,
        output_norm: reader.vector("output_norm.weight", h)?,
        layers,
    };
    reader.refuse_unread(arch)?;
    Ok(LoadedModel {
        config,
        weights,
        tokenizer,
        fingerprint,
    })
}

/// Layer `i`'s weights, as `config`'s architecture has them.
fn layer_weights(
    reader: &TensorReader<'_>,
    config: &ModelConfig,
    i: usize,
) -> Result<LayerWeights> {
    let arch = config.arch;
    let (h, q, kv) = (config.hidden, config.q_dim(), config.kv_dim());
    let t = |n: &str| format!("blk.{i}.{n}.weight");
    let b = |n: &str| format!("blk.{i}.{n}.bias");
    let qkv = [(t("attn_q"), q), (t("attn_k"), kv), (t("attn_v"), kv)];
    let qkv_bias = match arch.qkv_bias() {
        true => Some(
            [
                reader.vector(&b("attn_q"), q)?,
                reader.vector(&b("attn_k"), kv)?,
                reader.vector(&b("attn_v"), kv)?,
            ]
            .concat(),
        ),
        false => None,
    };
    let qk_norm = match arch.qk_norm() {
        true => Some(QkNorm {
            q: reader.vector(&t("attn_q_norm"), config.head_dim)?,
            k: reader.vector(&t("attn_k_norm"), config.head_dim)?,
        }),
        false => None,
    };
    let post_norms = match arch.post_norms() {
        true => Some(PostNorms {
            attn: reader.vector(&t("post_attention_norm"), h)?,
            ffn: reader.vector(&t("post_ffw_norm"), h)?,
        }),
        false => None,
    };
    let ffn = match config.moe {
        None => Ffn::Dense {
            gate_up: reader.stack(&[(t("ffn_gate"), config.ffn), (t("ffn_up"), config.ffn)], h)?,
            down: reader.matrix(&t("ffn_down"), h, config.ffn)?,
        },
        Some(moe) => {
            let (n, f) = (moe.experts, config.ffn);
            let experts = (0..n)
                .map(|e| {
                    let part = |name: &str, rows: usize, cols: usize| Slice {
                        name: t(name),
                        dims: vec![n, rows, cols],
                        rows: e * rows..(e + 1) * rows,
                    };
                    Ok(Expert {
                        gate_up: reader.stack_slices(
                            &[part("ffn_gate_exps", f, h), part("ffn_up_exps", f, h)],
                            h,
                        )?,
                        down: reader.stack_slices(&[part("ffn_down_exps", h, f)], f)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let name = t("ffn_gate_inp");
            let info = reader.info(&name, &[n, h])?;
            Ffn::Moe(MoeWeights {
                router: reader.f32_values(&name, info)?,
                experts,
            })
        }
    };
    Ok(LayerWeights {
        attn_norm: reader.vector(&t("attn_norm"), h)?,
        wqkv: reader.stack(&qkv, h)?,
        qkv_bias,
        qk_norm,
        post_norms,
        wo: reader.matrix(&t("attn_output"), h, q)?,
        ffn_norm: reader.vector(&t("ffn_norm"), h)?,
        ffn,
    })
}

/// Rows of a matrix read and repacked at a time: a multiple of the packed groups' 16 rows,
/// small enough that no tensor is ever held whole beside its repacked copy.
const CHUNK_ROWS: usize = 1024;

struct TensorReader<'a> {
    content: &'a Content,
    bytes: Bytes<'a>,
    path: &'a Path,
    /// The names of the tensors read so far.
    read: std::cell::RefCell<std::collections::HashSet<String>>,
}

/// Rows `rows` of tensor `name` (of shape `dims`), seen as a matrix of its last dimension's
/// width: one expert of a stacked expert tensor, or a whole 2-D tensor.
struct Slice {
    name: String,
    dims: Vec<usize>,
    rows: std::ops::Range<usize>,
}

impl TensorReader<'_> {
    fn bad(&self, reason: String) -> Error {
        Error::invalid_model(self.path, reason)
    }

    fn tensor_end(&self, info: &TensorInfo) -> u64 {
        let elems = info.shape.elem_count() as u64;
        let size = elems / info.ggml_dtype.block_size() as u64 * info.ggml_dtype.type_size() as u64;
        self.content
            .tensor_data_offset
            .saturating_add(info.offset)
            .saturating_add(size)
    }

    /// A file's tensor that no part of the model read changes its arithmetic in a way the
    /// engine does not apply: the file is refused, naming it, rather than served wrong.
    fn refuse_unread(&self, arch: Arch) -> Result<()> {
        let read = self.read.borrow();
        let mut unread: Vec<&String> = (self.content.tensor_infos.keys())
            .filter(|n| !read.contains(*n))
            .collect();
        unread.sort();
        match unread.first() {
            None => Ok(()),
            Some(first) => Err(self.bad(format!(
                "tensor {first} is not applied by this engine's {} architecture ({} such \
                 tensors); refusing the file rather than serving it wrong",
                arch.gguf_name(),
                unread.len()
            ))),
        }
    }

    fn info(&self, name: &str, dims: &[usize]) -> Result<&TensorInfo> {
        self.read.borrow_mut().insert(name.to_string());
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| self.bad(format!("tensor {name} is missing")))?;
        if info.shape.dims() != dims {
            return Err(self.bad(format!(
                "tensor {name} has shape {:?}, expected {dims:?}",
                info.shape.dims()
            )));
        }
        Ok(info)
    }

    /// `len` bytes from `start` on, as blocks of `T` (whose size must divide `len`).
    fn read_blocks<T: bytemuck::Pod>(&self, start: u64, len: usize) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); len / size_of::<T>()];
        self.bytes
            .read_at(start, bytemuck::cast_slice_mut(&mut out))
            .map_err(|source| Error::Io {
                path: self.path.to_path_buf(),
                source,
            })?;
        Ok(out)
    }

    /// A tensor's bytes as blocks of `T`.
    fn blocks<T: bytemuck::Pod>(&self, info: &TensorInfo) -> Result<Vec<T>> {
        let start = self.content.tensor_data_offset + info.offset;
        self.read_blocks(start, (self.tensor_end(info) - start) as usize)
    }

    /// Any tensor as f32 values, through candle's dequantization.
    fn f32_values(&self, name: &str, info: &TensorInfo) -> Result<Vec<f32>> {
        self.dequantize(
            name,
            info.ggml_dtype,
            info.shape.clone(),
            self.blocks(info)?,
        )
    }

    /// `raw`, the bytes of a tensor (or of some of its rows) of `dtype` and `shape`, as f32
    /// values, through candle's dequantization.
    fn dequantize(
        &self,
        name: &str,
        dtype: GgmlDType,
        shape: candle_core::Shape,
        raw: Vec<u8>,
    ) -> Result<Vec<f32>> {
        let alone = TensorInfo {
            ggml_dtype: dtype,
            shape,
            offset: 0,
        };
        alone
            .read(&mut Cursor::new(raw), 0, &Device::Cpu)
            .and_then(|q| q.dequantize(&Device::Cpu))
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| self.bad(format!("tensor {name}: {e}")))
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let info = self.info(name, &[len])?;
        self.f32_values(name, info)
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<QMatrix> {
        self.stack(&[(name.to_string(), rows)], cols)
    }

    /// Matrices of one width (name, rows) stacked into one, each keeping its block type.
    fn stack(&self, parts: &[(String, usize)], cols: usize) -> Result<QMatrix> {
        let slices: Vec<Slice> = (parts.iter())
            .map(|(name, rows)| Slice {
                name: name.clone(),
                dims: vec![*rows, cols],
                rows: 0..*rows,
            })
            .collect();
        self.stack_slices(&slices, cols)
    }

    /// Slices of one width stacked into one matrix, each keeping its block type, read and
    /// repacked [`CHUNK_ROWS`] rows at a time.
    fn stack_slices(&self, parts: &[Slice], cols: usize) -> Result<QMatrix> {
        let infos = parts
            .iter()
            .map(|s| {
                let info = self.info(&s.name, &s.dims)?;
                let block = info.ggml_dtype.block_size();
                if !cols.is_multiple_of(block) {
                    return Err(self.bad(format!(
                        "tensor {}: rows of {cols} values are not whole {:?} blocks of {block}",
                        s.name, info.ggml_dtype
                    )));
                }
                Ok((s, info))
            })
            .collect::<Result<Vec<_>>>()?;
        QMatrix::build(
            cols,
            infos.into_iter().map(|(s, info)| {
                let (first, end) = (s.rows.start, s.rows.end);
                let chunks = (first..end).step_by(CHUNK_ROWS);
                let read =
                    move |r0: usize| self.rows(&s.name, info, r0..(r0 + CHUNK_ROWS).min(end), cols);
                (s.rows.len(), chunks.map(read))
            }),
        )
    }

    /// Rows `rows` of a `cols`-wide matrix tensor, in its own block type where a kernel takes
    /// it, else requantized to `Q8_0`.
    fn rows(
        &self,
        name: &str,
        info: &TensorInfo,
        rows: std::ops::Range<usize>,
        cols: usize,
    ) -> Result<RawWeights> {
        let dtype = info.ggml_dtype;
        let row_bytes = cols / dtype.block_size() * dtype.type_size();
        let start = self.content.tensor_data_offset + info.offset + (rows.start * row_bytes) as u64;
        let len = rows.len() * row_bytes;
        Ok(match dtype {
            GgmlDType::Q4_1 => RawWeights::Q4_1(self.read_blocks::<BlockQ4_1>(start, len)?),
            GgmlDType::Q4_0 => {
                let blocks = self.read_blocks::<BlockQ4_0>(start, len)?;
                match blocks.iter().map(BlockQ4_0::as_q4_1).collect() {
                    Some(q4_1) => RawWeights::Q4_1(q4_1),
                    None => self.requantized(name, info, rows, cols, start, len)?,
                }
            }
            GgmlDType::Q5_0 => RawWeights::Q5_0(self.read_blocks::<BlockQ5_0>(start, len)?),
            GgmlDType::Q8_0 => RawWeights::Q8_0(self.read_blocks::<BlockQ8_0>(start, len)?),
            GgmlDType::Q4K => RawWeights::Q4K(self.read_blocks::<BlockQ4K>(start, len)?),
            GgmlDType::Q5K => RawWeights::Q5K(self.read_blocks::<BlockQ5K>(start, len)?),
            GgmlDType::Q6K => RawWeights::Q6K(self.read_blocks::<BlockQ6K>(start, len)?),
            _ => self.requantized(name, info, rows, cols, start, len)?,
        })
    }

    /// Rows of a type without a kernel, dequantized by candle and requantized to `Q8_0` (the
    /// first chunk logs what that costs).
    fn requantized(
        &self,
        name: &str,
        info: &TensorInfo,
        rows: std::ops::Range<usize>,
        cols: usize,
        start: u64,
        len: usize,
    ) -> Result<RawWeights> {
        let dtype = info.ggml_dtype;
        if rows.start == 0 {
            let from = self.tensor_end(info) - self.content.tensor_data_offset - info.offset;
            let to = info.shape.elem_count() / QK * size_of::<BlockQ8_0>();
            tracing::info!(
                tensor = name,
                "{dtype:?} has no kernel: requantized to Q8_0 ({from} -> {to} bytes)"
            );
        }
        let raw = self.read_blocks(start, len)?;
        let shape = candle_core::Shape::from((rows.len(), cols));
        let values = self.dequantize(name, dtype, shape, raw)?;
        let mut blocks = vec![bytemuck::Zeroable::zeroed(); values.len() / QK];
        quantize_row_q8_0(&values, &mut blocks);
        Ok(RawWeights::Q8_0(blocks))
    }
}

#[cfg(test)]
mod tests;
