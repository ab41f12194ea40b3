//! The built-in `tiny` model: the llama code path end to end (a real GGUF image, parsed by the
//! same loader) with random weights from a fixed seed and a byte-level vocabulary, so fast tests
//! need no download. Its outputs mean nothing; its arithmetic is the real model's.

use std::io::Cursor;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};
use crate::loader::{LoadedModel, load_bytes};
use tandem_tokenizer::byte_level_chars;

const SEED: u64 = 0x7a11_0de1;
const LAYERS: u32 = 2;
const HIDDEN: usize = 64;
const HEADS: u32 = 4;
const KV_HEADS: u32 = 2;
const FFN: usize = 128;
const CONTEXT: u32 = 1024;

/// The same chat template as the default model.
const CHAT_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Builds the tiny model's GGUF image in memory and loads it.
pub fn load() -> Result<LoadedModel> {
    load_bytes(&gguf_image()?, Path::new("tiny"))
}

/// The tiny model as a GGUF file image (tests write it to disk, whole or damaged).
pub fn gguf_image() -> Result<Vec<u8>> {
    build_image().map_err(|e| Error::invalid_model("tiny", e.to_string()))
}

fn build_image() -> candle_core::Result<Vec<u8>> {
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
    let mut matrix = |rows: usize, cols: usize, dtype: GgmlDType| {
        let scale = 1.0 / (cols as f32).sqrt();
        let data: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1.0f32..1.0) * scale * 2.0)
            .collect();
        QTensor::quantize(&Tensor::from_vec(data, (rows, cols), &Device::Cpu)?, dtype)
    };
    let (q, kv) = (HIDDEN, HIDDEN / HEADS as usize * KV_HEADS as usize);
    let mut tensors = vec![(
        "token_embd.weight".to_string(),
        matrix(vocab, HIDDEN, GgmlDType::Q8_0)?,
    )];
    for l in 0..LAYERS {
        for (name, rows, cols) in [
            ("attn_q", q, HIDDEN),
            ("attn_k", kv, HIDDEN),
            ("attn_v", kv, HIDDEN),
            ("attn_output", HIDDEN, q),
            ("ffn_gate", FFN, HIDDEN),
            ("ffn_up", FFN, HIDDEN),
            ("ffn_down", HIDDEN, FFN),
        ] {
            tensors.push((
                format!("blk.{l}.{name}.weight"),
                matrix(rows, cols, GgmlDType::Q4_1)?,
            ));
        }
        for name in ["attn_norm", "ffn_norm"] {
            let ones = Tensor::ones(HIDDEN, candle_core::DType::F32, &Device::Cpu)?;
            tensors.push((
                format!("blk.{l}.{name}.weight"),
                QTensor::quantize(&ones, GgmlDType::F32)?,
            ));
        }
    }
    let ones = Tensor::ones(HIDDEN, candle_core::DType::F32, &Device::Cpu)?;
    tensors.push((
        "output_norm.weight".into(),
        QTensor::quantize(&ones, GgmlDType::F32)?,
    ));

    let metadata: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("general.name", Value::String("tandem-tiny".into())),
        ("llama.block_count", Value::U32(LAYERS)),
        ("llama.embedding_length", Value::U32(HIDDEN as u32)),
        ("llama.attention.head_count", Value::U32(HEADS)),
        ("llama.attention.head_count_kv", Value::U32(KV_HEADS)),
        ("llama.feed_forward_length", Value::U32(FFN as u32)),
        ("llama.context_length", Value::U32(CONTEXT)),
        ("llama.rope.freq_base", Value::F32(10_000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
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
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = Cursor::new(Vec::new());
    gguf_file::write(&mut out, &md, &ts)?;
    Ok(out.into_inner())
}
