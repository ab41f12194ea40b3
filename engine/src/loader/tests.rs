//! The refusals: a tiny model's file with one thing added that the engine does not apply is
//! refused at load, with a message that names it; a neutral value of such a key is accepted.

use std::io::Cursor;
use std::path::Path;

use candle_core::Device;
use candle_core::Tensor;
use candle_core::quantized::gguf_file::{self, Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};

use super::load_bytes;
use crate::error::{Error, Result};
use crate::model::Arch;

/// `arch`'s tiny model with `metadata` keys (after the architecture's prefix) and `tensors`
/// (names and lengths, F32) added, loaded.
fn tiny_with(arch: Arch, metadata: &[(&str, Value)], tensors: &[(&str, usize)]) -> Result<()> {
    let image = crate::tiny::gguf_image_of(arch)?;
    let mut cursor = Cursor::new(&image);
    let content = Content::read(&mut cursor).expect("the tiny image parses");
    let mut all: Vec<(String, QTensor)> = content
        .tensor_infos
        .keys()
        .map(|n| {
            (
                n.clone(),
                content
                    .tensor(&mut cursor, n, &Device::Cpu)
                    .expect("tensor"),
            )
        })
        .collect();
    for &(name, len) in tensors {
        let t = Tensor::ones(len, candle_core::DType::F32, &Device::Cpu).expect("tensor");
        all.push((
            name.into(),
            QTensor::quantize(&t, GgmlDType::F32).expect("f32"),
        ));
    }
    let mut md: Vec<(String, Value)> = content.metadata.into_iter().collect();
    md.extend(
        metadata
            .iter()
            .map(|(k, v)| (format!("{}.{k}", arch.gguf_name()), v.clone())),
    );
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = all.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = Cursor::new(Vec::new());
    gguf_file::write(&mut out, &md_refs, &t_refs).expect("write");
    load_bytes(&out.into_inner(), Path::new("test.gguf")).map(|_| ())
}

/// The load fails as an invalid model whose reason contains each of `words`.
fn refused(result: Result<()>, words: &[&str]) {
    match result {
        Err(Error::InvalidModel { reason, .. }) => {
            for w in words {
                assert!(reason.contains(w), "{reason:?} does not name {w:?}");
            }
        }
        other => panic!("expected a refusal naming {words:?}, got {other:?}"),
    }
}

#[test]
fn the_tiny_models_load_as_they_are() {
    for &arch in Arch::ALL {
        tiny_with(arch, &[], &[]).unwrap_or_else(|e| panic!("{arch:?}: {e}"));
    }
}

#[test]
fn a_tensor_no_part_of_the_model_reads_is_refused() {
    refused(
        tiny_with(Arch::Llama, &[], &[("blk.0.attn_q.bias", 64)]),
        &["blk.0.attn_q.bias", "not applied", "llama"],
    );
    // Llama's rope frequency factors are applied; Qwen3 has none.
    refused(
        tiny_with(Arch::Qwen3, &[], &[("rope_freqs.weight", 64)]),
        &["rope_freqs.weight", "qwen3"],
    );
}

#[test]
fn a_rope_scaling_not_applied_is_refused() {
    refused(
        tiny_with(
            Arch::Qwen3,
            &[("rope.scaling.type", Value::String("yarn".into()))],
            &[],
        ),
        &["qwen3.rope.scaling.type", "\"yarn\""],
    );
    refused(
        tiny_with(
            Arch::Llama,
            &[("rope.scaling.factor", Value::F32(4.0))],
            &[],
        ),
        &["llama.rope.scaling.factor", "4"],
    );
    refused(
        tiny_with(
            Arch::Qwen2,
            &[("rope.dimension_count", Value::U32(16))],
            &[],
        ),
        &["qwen2.rope.dimension_count", "partial rotary"],
    );
    // No scaling, said explicitly, is what the engine computes.
    tiny_with(
        Arch::Llama,
        &[
            ("rope.scaling.type", Value::String("linear".into())),
            ("rope.scaling.factor", Value::F32(1.0)),
            ("rope.dimension_count", Value::U32(16)),
        ],
        &[],
    )
    .expect("neutral rope keys load");
}

#[test]
fn an_expert_gating_not_applied_is_refused() {
    // llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID.
    refused(
        tiny_with(
            Arch::Qwen3Moe,
            &[("expert_gating_func", Value::U32(2))],
            &[],
        ),
        &["qwen3moe.expert_gating_func", "2"],
    );
    refused(
        tiny_with(
            Arch::Qwen3Moe,
            &[("expert_shared_count", Value::U32(1))],
            &[],
        ),
        &["qwen3moe.expert_shared_count"],
    );
    refused(
        tiny_with(
            Arch::Qwen3Moe,
            &[("expert_weights_norm", Value::Bool(false))],
            &[],
        ),
        &["qwen3moe.expert_weights_norm", "false"],
    );
    tiny_with(
        Arch::Qwen3Moe,
        &[("expert_gating_func", Value::U32(1))],
        &[],
    )
    .expect("softmax gating loads");
    // Experts on a dense architecture.
    refused(
        tiny_with(Arch::Qwen3, &[("expert_count", Value::U32(8))], &[]),
        &["qwen3.expert_count"],
    );
}

#[test]
fn a_sliding_window_on_an_architecture_without_one_is_refused() {
    refused(
        tiny_with(
            Arch::Qwen3,
            &[("attention.sliding_window", Value::U32(4096))],
            &[],
        ),
        &["qwen3.attention.sliding_window", "4096"],
    );
}

#[test]
fn a_softcap_or_a_scale_not_applied_is_refused() {
    refused(
        tiny_with(
            Arch::Gemma3,
            &[("final_logit_softcapping", Value::F32(30.0))],
            &[],
        ),
        &["gemma3.final_logit_softcapping", "30"],
    );
    refused(
        tiny_with(Arch::Llama, &[("attention.scale", Value::F32(0.1))], &[]),
        &["llama.attention.scale"],
    );
}
