//! A GGUF file's hyperparameters ([`ModelConfig`]), and the refusal of metadata the engine does
//! not apply: a key that changes the model's arithmetic in a way the forward pass does not
//! compute (a rope scaling, a softcap, an expert gating function...) makes the file refused at
//! load, naming the key, so nothing is served wrong.

use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};

use crate::error::{Error, Result};
use crate::model::{Arch, ModelConfig, Moe, SlidingWindow};

pub(super) fn read_config(arch: Arch, content: &Content, path: &Path) -> Result<ModelConfig> {
    let md = &content.metadata;
    let bad = |reason: String| Error::invalid_model(path, reason);
    let key = |name: &str| format!("{}.{name}", arch.gguf_name());
    let get_u = |name: &str| -> Result<usize> {
        let key = key(name);
        md.get(&key)
            .ok_or_else(|| bad(format!("metadata {key} is missing")))?
            .to_u32()
            .map(|v| v as usize)
            .map_err(|e| bad(format!("metadata {key}: {e}")))
    };
    let get_f = |name: &str, default: f32| -> Result<f32> {
        let key = key(name);
        md.get(&key).map_or(Ok(default), |v| {
            v.to_f32().map_err(|e| bad(format!("metadata {key}: {e}")))
        })
    };
    refuse_unapplied(arch, content).map_err(bad)?;
    let hidden = get_u("embedding_length")?;
    let n_heads = get_u("attention.head_count")?;
    let n_kv_heads = get_u("attention.head_count_kv").unwrap_or(n_heads);
    let head_dim = match md.contains_key(&key("attention.key_length")) {
        true => get_u("attention.key_length")?,
        false => hidden.checked_div(n_heads).unwrap_or(0),
    };
    if md.contains_key(&key("attention.value_length"))
        && get_u("attention.value_length")? != head_dim
    {
        return Err(bad(
            "keys and values of different lengths are not supported".into(),
        ));
    }
    if md.contains_key(&key("rope.dimension_count")) && get_u("rope.dimension_count")? != head_dim {
        return Err(bad(format!(
            "metadata {} rotates part of a head of {head_dim}: partial rotary embedding is not \
             applied by this engine",
            key("rope.dimension_count")
        )));
    }
    // Gemma 3 states its window but not which layers use it, nor their rotary base: llama.cpp
    // takes five local layers in six and a base of 10,000 for them; a file that says otherwise
    // is read.
    let sliding_window = match (arch, md.contains_key(&key("attention.sliding_window"))) {
        (Arch::Gemma3, true) => Some(SlidingWindow {
            window: get_u("attention.sliding_window")?,
            pattern: match md.contains_key(&key("attention.sliding_window_pattern")) {
                true => get_u("attention.sliding_window_pattern")?,
                false => 6,
            },
            rope_theta: get_f("rope.freq_base_swa", 10_000.0)?,
        }),
        _ => None,
    };
    // A mixture's FFN width is an expert's; llama.cpp falls back on the dense width over the
    // experts used where a file does not state it.
    let (moe, ffn) = match arch.moe() {
        true => {
            let moe = Moe {
                experts: get_u("expert_count")?,
                used: get_u("expert_used_count")?,
            };
            let ffn = match md.contains_key(&key("expert_feed_forward_length")) {
                true => get_u("expert_feed_forward_length")?,
                false => get_u("feed_forward_length")? / moe.used.max(1),
            };
            (Some(moe), ffn)
        }
        false => (None, get_u("feed_forward_length")?),
    };
    let vocab = content
        .tensor_infos
        .get("token_embd.weight")
        .map(|t| t.shape.dims()[0])
        .ok_or_else(|| bad("tensor token_embd.weight is missing".into()))?;
    let config = ModelConfig {
        arch,
        n_layers: get_u("block_count")?,
        hidden,
        n_heads,
        n_kv_heads,
        head_dim,
        ffn,
        vocab,
        rope_theta: get_f("rope.freq_base", 10_000.0)?,
        rope_freq_factors: None,
        context_len: get_u("context_length")?,
        rms_eps: get_f("attention.layer_norm_rms_epsilon", 1e-5)?,
        embed_scale: (arch == Arch::Gemma3).then(|| (hidden as f32).sqrt()),
        sliding_window,
        moe,
    };
    config.validate().map_err(bad)?;
    Ok(config)
}

/// What the engine applies of a metadata key that changes the arithmetic: the values it
/// computes with (a key that is absent is applied too).
enum Applied {
    /// Never: any value is refused.
    Never,
    /// Only this number (as llama.cpp reads it, the neutral value).
    Number(f64),
    /// Numbers that change nothing (e.g. a scale of 0, meaning unset, or 1).
    Numbers(&'static [f64]),
    Strings(&'static [&'static str]),
    Bool(bool),
    /// Only on these architectures (where it is read); refused on any other.
    On(&'static [Arch]),
}

/// The keys (after the architecture's prefix) that change a model's arithmetic, and what the
/// engine applies of each. `attention.key_length`, `value_length`, the sliding window and the
/// expert counts are read by [`read_config`]; the rest are not read, so only their neutral
/// values are accepted.
const ARITHMETIC_KEYS: &[(&str, Applied)] = &[
    ("rope.scaling.type", Applied::Strings(&["none", "linear"])),
    ("rope.scaling.factor", Applied::Numbers(&[0.0, 1.0])),
    ("rope.scaling.attn_factor", Applied::Number(1.0)),
    ("rope.scaling.yarn_log_multiplier", Applied::Number(0.0)),
    ("rope.dimension_sections", Applied::Never),
    ("attention.logit_softcapping", Applied::Never),
    ("final_logit_softcapping", Applied::Never),
    ("attention.scale", Applied::Never),
    ("attention.clamp_kqv", Applied::Never),
    ("attention.max_alibi_bias", Applied::Number(0.0)),
    ("attention.causal", Applied::Bool(true)),
    ("attention.temperature_length", Applied::Never),
    ("embedding_scale", Applied::Numbers(&[0.0, 1.0])),
    ("residual_scale", Applied::Numbers(&[0.0, 1.0])),
    ("logit_scale", Applied::Numbers(&[0.0, 1.0])),
    ("attention.sliding_window", Applied::On(&[Arch::Gemma3])),
    (
        "attention.sliding_window_pattern",
        Applied::On(&[Arch::Gemma3]),
    ),
    ("rope.freq_base_swa", Applied::On(&[Arch::Gemma3])),
    ("expert_count", Applied::On(&[Arch::Qwen3Moe])),
    ("expert_used_count", Applied::On(&[Arch::Qwen3Moe])),
    ("expert_feed_forward_length", Applied::On(&[Arch::Qwen3Moe])),
    ("expert_shared_count", Applied::Number(0.0)),
    ("expert_shared_feed_forward_length", Applied::Number(0.0)),
    ("expert_group_count", Applied::Numbers(&[0.0, 1.0])),
    ("expert_group_used_count", Applied::Numbers(&[0.0, 1.0])),
    // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX.
    ("expert_gating_func", Applied::Number(1.0)),
    ("expert_weights_scale", Applied::Numbers(&[0.0, 1.0])),
    ("expert_weights_norm", Applied::Bool(true)),
    ("swiglu_clamp_exp", Applied::Never),
    ("swiglu_clamp_shexp", Applied::Never),
];

/// Refuses a file whose metadata asks for arithmetic the engine does not apply, naming the key.
fn refuse_unapplied(arch: Arch, content: &Content) -> Result<(), String> {
    for (name, applied) in ARITHMETIC_KEYS {
        let key = format!("{}.{name}", arch.gguf_name());
        let Some(value) = content.metadata.get(&key) else {
            continue;
        };
        let ok = match applied {
            Applied::Never => false,
            Applied::Number(n) => number(value) == Some(*n),
            Applied::Numbers(ns) => number(value).is_some_and(|v| ns.contains(&v)),
            Applied::Strings(ss) => value.to_string().is_ok_and(|v| ss.contains(&v.as_str())),
            Applied::Bool(b) => value.to_bool().ok() == Some(*b),
            Applied::On(archs) => archs.contains(&arch),
        };
        if !ok {
            return Err(format!(
                "metadata {key} = {} changes the model's arithmetic in a way this engine does \
                 not apply; refusing the file rather than serving it wrong",
                shown(value)
            ));
        }
    }
    Ok(())
}

/// A numeric metadata value as f64, whatever its GGUF type.
fn number(v: &Value) -> Option<f64> {
    match *v {
        Value::U8(x) => Some(x.into()),
        Value::I8(x) => Some(x.into()),
        Value::U16(x) => Some(x.into()),
        Value::I16(x) => Some(x.into()),
        Value::U32(x) => Some(x.into()),
        Value::I32(x) => Some(x.into()),
        Value::U64(x) => Some(x as f64),
        Value::I64(x) => Some(x as f64),
        Value::F32(x) => Some(x.into()),
        Value::F64(x) => Some(x),
        Value::Bool(_) | Value::String(_) | Value::Array(_) => None,
    }
}

/// A metadata value for an error message (an array by its length).
fn shown(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{s:?}"),
        Value::Bool(b) => b.to_string(),
        Value::Array(a) => format!("an array of {}", a.len()),
        other => number(other).map_or_else(String::new, |n| n.to_string()),
    }
}
