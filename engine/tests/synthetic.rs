//! Fidelity against llama.cpp on the architectures whose weights cannot be downloaded here
//! (Qwen3, Qwen3's mixture of experts, Llama 3), on the files `scripts/make_test_models.py`
//! makes from a fixed seed with the real vocabularies and chat templates, and llama.cpp's
//! tokenizer tests on those vocabularies.
//!
//! `scripts/test-models.sh` makes the files (it runs before the tests in `scripts/test.sh`) into
//! `$TANDEM_TEST_MODELS_DIR`, else `target/test-models`; a test fails, saying so, without them.
//! llama.cpp's outputs on them are in `tests/data/synthetic/` (`scripts/test-models.sh
//! --references` remakes them, with llama.cpp built by `../shared/tools/build-llamacpp.sh`), each
//! naming the SHA-256 of the file it was computed on. The Q8_0 files are made by the `gguf`
//! package's quantizer, bit for bit llama-quantize's; the Q4_K_M ones only by llama-quantize, so
//! their tests are ignored by default and run by `scripts/test-models.sh --references`.

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::Value;
use sha2::{Digest, Sha256};
use tandem_engine::{Engine, EngineConfig, Model, ModelSource, load_tokenizer};

// The fixtures' readers are the real models' tests', not these.
#[allow(dead_code)]
mod common;
use common::ids;

/// The widest gap allowed between llama.cpp's log-probability of one of its top 20 tokens and
/// ours, at any generated position (the bound of the first-position distances of the fidelity
/// tests on the real models). Both quantize activations to 8 bits before each matrix product,
/// in different blocks (llama.cpp's Q8_K of 256 for K-quants, Tandem's Q8_1 of 32) and orders,
/// and a mixture's router may then rank two near-equal experts the other way.
const MAX_LOGPROB_GAP: f64 = 0.5;

/// The widest margin, in llama.cpp's log-probabilities, by which its greedy token may lead ours
/// where the two differ: a divergence must be a near-tie.
const MAX_MARGIN: f64 = 0.25;

fn models_dir() -> PathBuf {
    std::env::var_os("TANDEM_TEST_MODELS_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/test-models"),
        PathBuf::from,
    )
}

fn reference(name: &str) -> Value {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/data/synthetic/{name}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).expect("reference is JSON")
}

/// The test model `name` (e.g. `qwen3.q8_0`), checked to be the file llama.cpp's reference was
/// computed on.
fn load(name: &str, reference: &Value) -> Arc<Model> {
    let path = models_dir().join(format!("{name}.gguf"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "this test needs {} (scripts/test-models.sh makes it): {e}",
            path.display()
        )
    });
    let sha: String = Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        sha,
        reference["sha256"].as_str().expect("sha256"),
        "{} is not the file llama.cpp's reference was computed on: remake the references \
         (scripts/test-models.sh --references)",
        path.display()
    );
    ModelSource::parse(path.to_str().expect("path"), &models_dir())
        .load()
        .expect("load")
}

/// Log-softmax of a row of logits, in f64.
fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    logits.iter().map(|&l| l as f64 - max - sum.ln()).collect()
}

/// For every prompt: the ids equal llama.cpp's, and along llama.cpp's own continuation
/// (teacher-forced), every position's top-20 log-probabilities are within [`MAX_LOGPROB_GAP`]
/// of ours, and our greedy token is llama.cpp's or within [`MAX_MARGIN`] of it.
fn agrees_with_llama_cpp(name: &str) {
    let r = reference(name);
    let model = load(name, &r);
    let mut engine = Engine::new(model.clone(), EngineConfig::default()).expect("engine");
    let (mut worst, mut positions, mut same_argmax, mut skipped) = (0f64, 0, 0, 0);
    let mut widest_margin = 0f64;
    for rec in r["records"].as_array().expect("records") {
        let text = rec["text"].as_str().expect("text");
        let prompt = ids(&rec["prompt_token_ids"]);
        assert_eq!(
            model.tokenizer.encode(text).expect("encode"),
            prompt,
            "{name}: tokenizing {text:?}"
        );
        let generated = ids(&rec["generated_token_ids"]);
        let seq = engine.new_sequence();
        let mut logits = engine.prefill(seq, &prompt).expect("prefill");
        for (i, top) in rec["top_logprobs"]
            .as_array()
            .expect("top")
            .iter()
            .enumerate()
        {
            // The logits of position i: after the prompt, or a step past llama.cpp's last token.
            if i > 0 {
                logits = engine
                    .step(&[(seq, generated[i - 1])])
                    .expect("step")
                    .row(0)
                    .to_vec();
            }
            let ours = log_softmax(&logits);
            // llama-server reports no probabilities for a token that ends inside a UTF-8
            // character: nothing to compare there, and its token is fed all the same.
            if top.is_null() {
                skipped += 1;
                continue;
            }
            let top: Vec<(usize, f64)> = top
                .as_array()
                .expect("pairs")
                .iter()
                .map(|p| {
                    (
                        p[0].as_u64().expect("id") as usize,
                        p[1].as_f64().expect("lp"),
                    )
                })
                .collect();
            let gap = top
                .iter()
                .map(|&(id, lp)| (ours[id] - lp).abs())
                .fold(0f64, f64::max);
            assert!(
                gap < MAX_LOGPROB_GAP,
                "{name}: {text:?} at generated position {i}: a top-20 log-probability differs \
                 from llama.cpp's by {gap:.3}"
            );
            worst = worst.max(gap);
            positions += 1;
            let argmax = (0..ours.len())
                .max_by(|&a, &b| ours[a].total_cmp(&ours[b]).then(b.cmp(&a)))
                .expect("logits");
            if argmax == top[0].0 {
                same_argmax += 1;
            } else {
                let theirs_of_ours = top
                    .iter()
                    .find(|p| p.0 == argmax)
                    .map_or(f64::NEG_INFINITY, |p| p.1);
                let margin = top[0].1 - theirs_of_ours;
                widest_margin = widest_margin.max(margin);
                assert!(
                    margin < MAX_MARGIN,
                    "{name}: {text:?} at {i}: llama.cpp picks {} by {margin:.3} over our {argmax}",
                    top[0].0
                );
            }
        }
        engine.free(seq).expect("free");
    }
    eprintln!(
        "{name}: {positions} positions, the widest top-20 log-probability gap {worst:.4}, \
         the same greedy token at {same_argmax} (elsewhere llama.cpp's lead at most \
         {widest_margin:.4}), {skipped} without llama.cpp's probabilities"
    );
    assert!(
        positions > 10 * skipped,
        "{positions} positions compared, {skipped} not"
    );
}

/// llama.cpp's tokenizer tests for a vocabulary (`ggml-vocab-NAME.gguf` with its `.inp` texts
/// and `.out` ids, from its repository): every text tokenizes to the same ids.
fn vocabulary_matches_llama_cpp(vocab: &str) {
    let dir = models_dir().join("vocab");
    let file = dir.join(format!("ggml-vocab-{vocab}.gguf"));
    let tokenizer = load_tokenizer(&file).unwrap_or_else(|e| {
        panic!(
            "this test needs {} (scripts/test-models.sh): {e}",
            file.display()
        )
    });
    let read = |ext: &str| {
        std::fs::read_to_string(dir.join(format!("ggml-vocab-{vocab}.gguf.{ext}")))
            .expect("vocab test")
    };
    let (inp, out) = (read("inp"), read("out"));
    let texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    let want: Vec<&str> = out.lines().collect();
    assert!(texts.len() > 20, "{vocab}: {} texts", texts.len());
    // The last text ends the file with its own separator line.
    let texts = &texts[..want.len()];
    for (text, want) in texts.iter().zip(&want) {
        let want: Vec<u32> = want
            .split_whitespace()
            .map(|t| t.parse().expect("id"))
            .collect();
        assert_eq!(
            tokenizer.encode(text).expect("encode"),
            want,
            "{vocab}: {text:?}"
        );
    }
}

#[test]
fn qwen3_vocabulary_matches_llama_cpps_tokenizer_tests() {
    vocabulary_matches_llama_cpp("qwen2");
}

#[test]
fn llama3_vocabulary_matches_llama_cpps_tokenizer_tests() {
    vocabulary_matches_llama_cpp("llama-bpe");
}

#[test]
fn qwen3_q8_0_agrees_with_llama_cpp() {
    agrees_with_llama_cpp("qwen3.q8_0");
}

#[test]
fn qwen3moe_q8_0_agrees_with_llama_cpp() {
    agrees_with_llama_cpp("qwen3moe.q8_0");
}

#[test]
fn llama3_q8_0_agrees_with_llama_cpp() {
    agrees_with_llama_cpp("llama3.q8_0");
}

#[test]
#[ignore = "the Q4_K_M files need llama-quantize: scripts/test-models.sh --references"]
fn qwen3_q4_k_m_agrees_with_llama_cpp() {
    agrees_with_llama_cpp("qwen3.q4_k_m");
}

#[test]
#[ignore = "the Q4_K_M files need llama-quantize: scripts/test-models.sh --references"]
fn qwen3moe_q4_k_m_agrees_with_llama_cpp() {
    agrees_with_llama_cpp("qwen3moe.q4_k_m");
}

#[test]
#[ignore = "the Q4_K_M files need llama-quantize: scripts/test-models.sh --references"]
fn llama3_q4_k_m_agrees_with_llama_cpp() {
    agrees_with_llama_cpp("llama3.q4_k_m");
}

/// Qwen3's and Llama 3.1's chat templates, as their files ship them, render conversations
/// (a reasoning turn, a tool round trip) to the text Hugging Face's `apply_chat_template`
/// renders (`scripts/template_reference.py`, in `tests/data/synthetic/templates.json`).
#[test]
fn chat_templates_render_as_hugging_face_renders_them() {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/synthetic/templates.json");
    let all: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("templates")).expect("json");
    for (model, file) in [("qwen3", "qwen3.q8_0"), ("llama3", "llama3.q8_0")] {
        let tokenizer =
            load_tokenizer(&models_dir().join(format!("{file}.gguf"))).expect("tokenizer");
        let bos = tokenizer.encode("").expect("encode");
        for conv in all[model].as_array().expect("conversations") {
            let name = conv["name"].as_str().expect("name");
            let messages: Vec<tandem_engine::ChatMessage> =
                serde_json::from_value(conv["messages"].clone()).expect("messages");
            let tools = conv["tools"].as_array().expect("tools");
            let ours = tokenizer
                .apply_chat_template(&messages, tools)
                .expect("render");
            assert_eq!(
                ours,
                conv["rendered"].as_str().expect("rendered"),
                "{model}: {name}"
            );
            // Encoded, it opens with one BOS, not two.
            let ids = tokenizer.encode(&ours).expect("encode");
            assert_eq!(
                ids.iter().take_while(|&&t| Some(&t) == bos.first()).count(),
                bos.len(),
                "{model}: {name}"
            );
        }
    }
}
