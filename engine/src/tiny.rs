//! The built-in tiny models, one per architecture: each family's code path end to end (a real
//! GGUF image, parsed by the same loader) with random weights from a fixed seed and a byte-level
//! vocabulary, so fast tests need no download. Their outputs mean nothing; their arithmetic is
//! the real models'. `tiny` is llama with `Q4_1` weights; `tiny-qwen2` and `tiny-gemma3` use the
//! types of the published K-quant files (`Q5_0`, `Q8_0`, `Q4_K`, `Q6_K`), and the Gemma one a
//! head size other than hidden / heads and a sliding window of 24 positions on every other layer,
//! so prompts of a few dozen tokens cross it.

use std::io::Cursor;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};
use crate::loader::{LoadedModel, load_bytes};
use crate::model::Arch;
use tandem_tokenizer::byte_level_chars;

const SEED: u64 = 0x7a11_0de1;
const LAYERS: u32 = 2;
const HIDDEN: usize = 64;
const HEADS: u32 = 4;
const KV_HEADS: u32 = 2;
const FFN: usize = 128;
const CONTEXT: u32 = 1024;

/// The same chat template as SmolLM2.
const CHAT_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// A random `rows × cols` matrix in `dtype`, scaled to keep activations moderate.
fn matrix(
    rng: &mut ChaCha8Rng,
    rows: usize,
    cols: usize,
    dtype: GgmlDType,
) -> candle_core::Result<QTensor> {
    tensor(rng, &[rows, cols], dtype)
}

/// A random tensor of `dims` (rows of the last one's width) in `dtype`, scaled like [`matrix`].
fn tensor(rng: &mut ChaCha8Rng, dims: &[usize], dtype: GgmlDType) -> candle_core::Result<QTensor> {
    let cols = dims.last().copied().unwrap_or(1);
    let scale = 1.0 / (cols as f32).sqrt();
    let data: Vec<f32> = (0..dims.iter().product())
        .map(|_| rng.random_range(-1.0f32..1.0) * scale * 2.0)
        .collect();
    QTensor::quantize(&Tensor::from_vec(data, dims, &Device::Cpu)?, dtype)
}

/// Norm weights: exactly 1 for llama (as its tiny model always had), near 1 for the others.
fn norm(rng: &mut ChaCha8Rng, arch: Arch, len: usize) -> candle_core::Result<QTensor> {
    let data: Vec<f32> = (0..len)
        .map(|_| match arch {
            Arch::Llama => 1.0,
            _ => 1.0 + rng.random_range(-0.2f32..0.2),
        })
        .collect();
    QTensor::quantize(&Tensor::from_vec(data, len, &Device::Cpu)?, GgmlDType::F32)
}

/// The shape and weight types of one family's tiny model.
struct Shape {
    hidden: usize,
    heads: u32,
    kv_heads: u32,
    head_dim: usize,
    ffn: usize,
    /// Types of q, k, v, output, gate, up, down.
    types: [GgmlDType; 7],
    /// A mixture's experts and how many a row uses.
    experts: Option<(u32, u32)>,
}

fn shape(arch: Arch) -> Shape {
    use GgmlDType::{Q4_1, Q4K, Q5_0, Q6K, Q8_0};
    match arch {
        Arch::Llama => Shape {
            hidden: HIDDEN,
            heads: HEADS,
            kv_heads: KV_HEADS,
            head_dim: HIDDEN / HEADS as usize,
            ffn: FFN,
            types: [Q4_1; 7],
            experts: None,
        },
        Arch::Qwen2 => Shape {
            hidden: 128,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            ffn: 256,
            types: [Q5_0, Q5_0, Q8_0, Q5_0, Q5_0, Q5_0, Q6K],
            experts: None,
        },
        Arch::Gemma3 => Shape {
            hidden: 128,
            heads: 4,
            kv_heads: 1,
            head_dim: 64,
            ffn: 256,
            types: [Q5_0, Q5_0, Q8_0, Q4K, Q5_0, Q5_0, Q6K],
            experts: None,
        },
        Arch::Qwen3 => Shape {
            hidden: 256,
            heads: 4,
            kv_heads: 2,
            head_dim: 128,
            ffn: 512,
            types: [Q8_0, Q8_0, Q8_0, Q4K, Q4K, Q4K, Q6K],
            experts: None,
        },
        // Eight experts of which three run: enough that rows of one prompt choose different
        // ones, so a prefill chunk's experts see different row sets.
        Arch::Qwen3Moe => Shape {
            hidden: 128,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            ffn: 64,
            types: [Q8_0, Q8_0, Q8_0, Q8_0, Q8_0, Q8_0, Q8_0],
            experts: Some((8, 3)),
        },
    }
}

/// The name `--model` takes for `arch`'s tiny model.
pub fn name(arch: Arch) -> String {
    match arch {
        Arch::Llama => "tiny".into(),
        other => format!("tiny-{}", other.gguf_name()),
    }
}

/// Builds `arch`'s tiny model's GGUF image in memory and loads it.
pub fn load(arch: Arch) -> Result<LoadedModel> {
    load_bytes(&gguf_image_of(arch)?, Path::new(&name(arch)))
}

/// The (llama) tiny model as a GGUF file image (tests write it to disk, whole or damaged).
pub fn gguf_image() -> Result<Vec<u8>> {
    gguf_image_of(Arch::Llama)
}

pub(crate) fn gguf_image_of(arch: Arch) -> Result<Vec<u8>> {
    build_image(arch).map_err(|e| Error::invalid_model(name(arch), e.to_string()))
}

fn build_image(arch: Arch) -> candle_core::Result<Vec<u8>> {
    let sh = shape(arch);
    let hidden = sh.hidden;
    let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
    let mut tokens: Vec<Value> = specials
        .iter()
        .map(|s| Value::String(s.to_string()))
        .collect();
    let mut types = vec![Value::I32(3); specials.len()];
    for c in byte_level_chars() {
        tokens.push(Value::String(c.to_string()));
        types.push(Value::I32(1));
    }
    let vocab = tokens.len();

    let mut rng = ChaCha8Rng::seed_from_u64(SEED);
    let (q, kv) = (
        sh.heads as usize * sh.head_dim,
        sh.kv_heads as usize * sh.head_dim,
    );
    let mut tensors = vec![(
        "token_embd.weight".to_string(),
        matrix(&mut rng, vocab, hidden, GgmlDType::Q8_0)?,
    )];
    // A mixture's expert tensors stack its experts' matrices: (experts, rows, cols).
    let ffn_names = match sh.experts {
        Some(_) => ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"],
        None => ["ffn_gate", "ffn_up", "ffn_down"],
    };
    for l in 0..LAYERS {
        let shapes = [
            ("attn_q", q, hidden),
            ("attn_k", kv, hidden),
            ("attn_v", kv, hidden),
            ("attn_output", hidden, q),
            (ffn_names[0], sh.ffn, hidden),
            (ffn_names[1], sh.ffn, hidden),
            (ffn_names[2], hidden, sh.ffn),
        ];
        for (i, ((name, rows, cols), dtype)) in shapes.into_iter().zip(sh.types).enumerate() {
            let m = match (i >= 4).then_some(sh.experts).flatten() {
                Some((n, _)) => tensor(&mut rng, &[n as usize, rows, cols], dtype)?,
                None => matrix(&mut rng, rows, cols, dtype)?,
            };
            tensors.push((format!("blk.{l}.{name}.weight"), m));
        }
        if let Some((n, _)) = sh.experts {
            // Router weights several times the others' scale, so the choice is clear-cut.
            let router = matrix(&mut rng, n as usize, hidden, GgmlDType::F32)?;
            let router = (router.dequantize(&Device::Cpu)? * 4.0)?;
            let router = QTensor::quantize(&router, GgmlDType::F32)?;
            tensors.push((format!("blk.{l}.ffn_gate_inp.weight"), router));
        }
        if arch.qkv_bias() {
            for (name, len) in [("attn_q", q), ("attn_k", kv), ("attn_v", kv)] {
                let bias = matrix(&mut rng, 1, len, GgmlDType::F32)?.dequantize(&Device::Cpu)?;
                tensors.push((
                    format!("blk.{l}.{name}.bias"),
                    QTensor::quantize(&bias.flatten_all()?, GgmlDType::F32)?,
                ));
            }
        }
        let mut norms = vec![("attn_norm", hidden), ("ffn_norm", hidden)];
        if arch.qk_norm() {
            norms.extend([("attn_q_norm", sh.head_dim), ("attn_k_norm", sh.head_dim)]);
        }
        if arch.post_norms() {
            norms.extend([("post_attention_norm", hidden), ("post_ffw_norm", hidden)]);
        }
        for (name, len) in norms {
            let w = norm(&mut rng, arch, len)?;
            tensors.push((format!("blk.{l}.{name}.weight"), w));
        }
    }
    let w = norm(&mut rng, arch, hidden)?;
    tensors.push(("output_norm.weight".into(), w));

    let a = arch.gguf_name();
    let metadata = arch_metadata(arch, &sh);
    let common: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String(a.into())),
        (
            "general.name",
            Value::String(format!("tandem-{}", name(arch))),
        ),
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("smollm".into())),
        ("tokenizer.ggml.tokens", Value::Array(tokens)),
        ("tokenizer.ggml.token_type", Value::Array(types)),
        ("tokenizer.ggml.merges", Value::Array(Vec::new())),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
        (
            "tokenizer.chat_template",
            Value::String(CHAT_TEMPLATE.into()),
        ),
    ];
    let md: Vec<(&str, &Value)> = common
        .iter()
        .map(|(k, v)| (*k, v))
        .chain(metadata.iter().map(|(k, v)| (k.as_str(), v)))
        .collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = Cursor::new(Vec::new());
    gguf_file::write(&mut out, &md, &ts)?;
    Ok(out.into_inner())
}

/// The architecture's hyperparameters (`{arch}.*` keys) of its tiny model.
fn arch_metadata(arch: Arch, sh: &Shape) -> Vec<(String, Value)> {
    let hidden = sh.hidden;
    let a = arch.gguf_name();
    let mut metadata: Vec<(String, Value)> = vec![
        (format!("{a}.block_count"), Value::U32(LAYERS)),
        (format!("{a}.embedding_length"), Value::U32(hidden as u32)),
        (format!("{a}.attention.head_count"), Value::U32(sh.heads)),
        (
            format!("{a}.attention.head_count_kv"),
            Value::U32(sh.kv_heads),
        ),
        (
            format!("{a}.feed_forward_length"),
            Value::U32(sh.ffn as u32),
        ),
        (format!("{a}.context_length"), Value::U32(CONTEXT)),
        (format!("{a}.rope.freq_base"), Value::F32(10_000.0)),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-5),
        ),
    ];
    if sh.head_dim != hidden / sh.heads as usize {
        metadata.extend([
            (
                format!("{a}.attention.key_length"),
                Value::U32(sh.head_dim as u32),
            ),
            (
                format!("{a}.attention.value_length"),
                Value::U32(sh.head_dim as u32),
            ),
        ]);
    }
    if let Some((n, used)) = sh.experts {
        metadata.extend([
            (format!("{a}.expert_count"), Value::U32(n)),
            (format!("{a}.expert_used_count"), Value::U32(used)),
            (
                format!("{a}.expert_feed_forward_length"),
                Value::U32(sh.ffn as u32),
            ),
        ]);
    }
    if arch == Arch::Gemma3 {
        metadata.extend([
            (format!("{a}.attention.sliding_window"), Value::U32(24)),
            (
                format!("{a}.attention.sliding_window_pattern"),
                Value::U32(2),
            ),
        ]);
    }
    metadata
}
