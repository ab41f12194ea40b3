//! Speculative decoding is exact: a verified position's logits equal a plain step's bit for bit,
//! and generations with speculation on equal those with it off, token for token, on the tiny
//! model and on the real one (the fixtures' prompts, long generations, greedy and seeded
//! sampling, alone and batched). Needs SmolLM2 (`tandem model fetch smollm2`).

use std::sync::Arc;

use tandem_engine::{
    ChatMessage, Decoding, Engine, EngineConfig, GenerateOutput, GenerateParams, GenerateRequest,
    KvDtype, Model, ModelSource, PromptChunk, SamplingParams, SpeculateConfig, Stream,
};

fn real() -> Arc<Model> {
    ModelSource::parse("smollm2", &tandem_engine::model_dir_from_env())
        .load()
        .unwrap_or_else(|e| panic!("the speculation tests need the real model: {e}"))
}

fn engine(model: &Arc<Model>, speculate: SpeculateConfig) -> Engine {
    engine_in(model, speculate, KvDtype::F16)
}

fn engine_in(model: &Arc<Model>, speculate: SpeculateConfig, kv_dtype: KvDtype) -> Engine {
    Engine::new(
        model.clone(),
        EngineConfig {
            threads: 2,
            kv_budget_bytes: 4096 * model.config.kv_layout(kv_dtype).token_bytes(),
            speculate,
            kv_dtype,
            ..EngineConfig::default()
        },
    )
    .expect("engine")
}

fn chat(model: &Model, text: &str) -> Vec<u32> {
    let rendered = model
        .tokenizer
        .apply_chat_template(&[ChatMessage::new("user", text)], &[])
        .expect("template");
    model.tokenizer.encode(&rendered).expect("encode")
}

/// Extending two sequences by several tokens in one pass gives, row for row, the logits that
/// one step per token gives, bit for bit.
fn verified_rows_equal_steps(model: &Arc<Model>) {
    let a_prompt = chat(model, "List the planets of the solar system.");
    let b_prompt = chat(model, "Name three colours.");
    let a_more = [33, 100, 200, 15, 16, 17, 4];
    let b_more = [42, 43, 44];

    let mut one = engine(model, SpeculateConfig::off());
    let (a, b) = (one.new_sequence(), one.new_sequence());
    one.prefill(a, &a_prompt).expect("prefill");
    one.prefill(b, &b_prompt).expect("prefill");
    let together = one
        .extend(&[(a, &a_more[..]), (b, &b_more[..])])
        .expect("extend");
    assert_eq!(together.len(), a_more.len() + b_more.len());

    let mut steps = engine(model, SpeculateConfig::off());
    let (a2, b2) = (steps.new_sequence(), steps.new_sequence());
    steps.prefill(a2, &a_prompt).expect("prefill");
    steps.prefill(b2, &b_prompt).expect("prefill");
    let mut want = Vec::new();
    for (i, &t) in a_more.iter().enumerate() {
        // The other sequence steps alongside for the first few, so batch shapes differ too.
        let mut batch = vec![(a2, t)];
        if i < b_more.len() {
            batch.push((b2, b_more[i]));
        }
        let logits = steps.step(&batch).expect("step");
        want.push((0, i, logits.row(0).to_vec()));
        if i < b_more.len() {
            want.push((1, i, logits.row(1).to_vec()));
        }
    }
    for (seq, i, logits) in want {
        let row = if seq == 0 { i } else { a_more.len() + i };
        let got = together.row(row);
        assert!(
            got.iter()
                .zip(&logits)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "sequence {seq}, token {i}: a verified row differs from a step"
        );
    }
}

#[test]
fn a_verified_positions_logits_equal_a_plain_steps_bit_for_bit() {
    for &arch in tandem_engine::Arch::ALL {
        verified_rows_equal_steps(&ModelSource::Tiny(arch).load().expect("tiny"));
    }
    verified_rows_equal_steps(&real());
}

#[test]
fn truncating_drops_rejected_drafts_and_frees_their_blocks() {
    let model = ModelSource::TINY.load().expect("tiny");
    let mut e = engine(&model, SpeculateConfig::off());
    let free = e.kv_blocks_free();
    let s = e.new_sequence();
    let prompt: Vec<u32> = (3..17).collect();
    e.prefill(s, &prompt).expect("prefill");
    let continued = e.new_sequence();
    e.prefill(continued, &prompt).expect("prefill");
    // 14 tokens, then a 20-token draft: three blocks of 16.
    let draft: Vec<u32> = (40..60).collect();
    e.extend(&[(s, &draft)]).expect("extend");
    assert_eq!(e.kv_blocks_free(), free - 3 - 1);
    // Keep the first two drafted tokens: 16 tokens, one block.
    e.truncate(s, 16).expect("truncate");
    assert_eq!(e.seq_len(s).expect("len"), 16);
    assert_eq!(e.kv_blocks_free(), free - 1 - 1);
    assert!(e.truncate(s, 17).is_err(), "truncate cannot grow");
    // What follows equals a sequence that only ever held those 16 tokens.
    e.prefill(continued, &draft[..2]).expect("prefill");
    let after_truncate = e.step(&[(s, 7)]).expect("step").row(0).to_vec();
    let plain = e.step(&[(continued, 7)]).expect("step").row(0).to_vec();
    assert_eq!(after_truncate, plain);
    e.free(s).expect("free");
    e.free(continued).expect("free");
    assert_eq!(e.kv_blocks_free(), free);
}

/// Generates `reqs` alone and batched with speculation off and on, with the KV in `dtype`; all
/// four must agree, and speculation must have drafted and had drafts accepted (or the test
/// would prove nothing).
fn on_equals_off(model: &Arc<Model>, reqs: &[GenerateRequest], dtype: KvDtype) {
    let generate = |spec, reqs: &[GenerateRequest]| -> Vec<GenerateOutput> {
        engine_in(model, spec, dtype)
            .generate_batch(reqs)
            .expect("generate")
    };
    let off = generate(SpeculateConfig::off(), reqs);
    let on = generate(SpeculateConfig::on(), reqs);
    let (mut drafted, mut accepted) = (0, 0);
    for (i, req) in reqs.iter().enumerate() {
        let alone = generate(SpeculateConfig::on(), std::slice::from_ref(req));
        assert_eq!(alone[0].token_ids, off[i].token_ids, "request {i} alone");
        assert_eq!(alone[0].text, off[i].text, "request {i} alone");
        assert_eq!(on[i].token_ids, off[i].token_ids, "request {i} batched");
        assert_eq!(on[i].finish_reason, off[i].finish_reason, "request {i}");
        assert_eq!(off[i].draft_tokens, 0, "off drafts nothing");
        drafted += alone[0].draft_tokens + on[i].draft_tokens;
        accepted += alone[0].accepted_draft_tokens + on[i].accepted_draft_tokens;
    }
    eprintln!("drafted {drafted}, accepted {accepted}");
    assert!(
        drafted > 0 && accepted > 0,
        "drafted {drafted}, accepted {accepted}"
    );
}

fn requests(model: &Model, params: &GenerateParams) -> Vec<GenerateRequest> {
    let fixtures = std::env::var_os("TANDEM_FIXTURES_DIR").map_or_else(
        || std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures"),
        std::path::PathBuf::from,
    );
    let text = std::fs::read_to_string(fixtures.join("smollm2-greedy.jsonl")).expect("fixtures");
    let mut reqs: Vec<GenerateRequest> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json");
            let prompt = v["prompt_token_ids"]
                .as_array()
                .expect("ids")
                .iter()
                .map(|x| x.as_u64().expect("id") as u32)
                .collect();
            GenerateRequest {
                prompt,
                params: params.clone(),
            }
        })
        .collect();
    // Replies that copy from their prompt, where drafts are accepted.
    for text in [
        "Repeat this sentence exactly three times: the quick brown fox jumps over the lazy dog.",
        "Continue this list up to 10: 1. one apple 2. two apples 3. three apples 4. four apples",
    ] {
        reqs.push(GenerateRequest {
            prompt: chat(model, text),
            params: params.clone(),
        });
    }
    reqs
}

#[test]
fn greedy_generations_are_identical_with_speculation_on_the_real_model() {
    let model = real();
    let params = GenerateParams {
        max_tokens: 200,
        ..GenerateParams::default()
    };
    // Exact whatever the KV dtype: a verified row reads the same KV a plain step would.
    for dtype in [KvDtype::F16, KvDtype::Q8] {
        on_equals_off(&model, &requests(&model, &params), dtype);
    }
}

#[test]
fn seeded_sampling_is_identical_with_speculation_on_the_real_model() {
    let model = real();
    let params = GenerateParams {
        max_tokens: 200,
        sampling: SamplingParams {
            temperature: 0.7,
            top_p: 0.95,
            top_k: 40,
            repetition_penalty: 1.05,
            seed: 7,
            ..SamplingParams::default()
        },
        ..GenerateParams::default()
    };
    on_equals_off(&model, &requests(&model, &params), KvDtype::F16);
}

#[test]
fn tiny_model_generations_are_identical_with_speculation_on() {
    let model = ModelSource::TINY.load().expect("tiny");
    // Prompts that repeat themselves, so the lookup finds drafts in them.
    let reqs: Vec<GenerateRequest> = (0..4u32)
        .map(|salt| GenerateRequest {
            prompt: (0..64).map(|i| 3 + (i % (5 + salt)) * 7).collect(),
            params: GenerateParams {
                max_tokens: 120,
                sampling: SamplingParams {
                    temperature: if salt % 2 == 0 { 0.0 } else { 0.9 },
                    seed: u64::from(salt),
                    ..SamplingParams::default()
                },
                ..GenerateParams::default()
            },
        })
        .collect();
    for dtype in [KvDtype::F16, KvDtype::Q8] {
        on_equals_off(&model, &reqs, dtype);
    }
}

/// Decodes `prompts` greedily on `engine`, a step per chunk of `long`, and prefills `long`
/// beside them: in chunks of `chunk` tokens inside the steps when `fused`, else by a prefill of
/// its own before the steps. Returns each sequence's tokens, and the long prompt's last logits.
fn decode_beside_a_prefill(
    engine: &mut Engine,
    prompts: &[Vec<u32>],
    long: &[u32],
    chunk: usize,
    fused: bool,
) -> (Vec<Vec<u32>>, Vec<f32>) {
    let params = GenerateParams {
        max_tokens: 64,
        ..GenerateParams::default()
    };
    let mut decodings: Vec<Decoding> = prompts
        .iter()
        .map(|p| {
            let seq = engine.new_sequence();
            let logits = engine.prefill(seq, p).expect("prefill");
            let mut stream = Stream::new(params.clone(), engine.model(), p).expect("stream");
            let next = stream.sample(&engine.model().tokenizer, &logits, p.len());
            Decoding::new(seq, stream, p.clone(), next)
        })
        .collect();
    let seq = engine.new_sequence();
    let mut long_logits = None;
    if !fused {
        long_logits = Some(engine.prefill(seq, long).expect("long prefill"));
    }
    let mut done = 0;
    let mut tokens = vec![Vec::new(); prompts.len()];
    for _ in 0..long.len().div_ceil(chunk) {
        let mut batch: Vec<&mut Decoding> = decodings.iter_mut().collect();
        let end = (done + chunk).min(long.len());
        let piggyback = fused.then(|| PromptChunk {
            seq,
            tokens: &long[done..end],
            last: end == long.len(),
        });
        let (step, logits) = engine
            .decode_step_with(&mut batch, piggyback)
            .expect("step");
        if fused {
            done = end;
            if let Some(l) = logits {
                long_logits = Some(l);
            }
        }
        for (out, emissions) in tokens.iter_mut().zip(&step.emissions) {
            out.extend(emissions.iter().filter_map(|e| e.token));
        }
    }
    (tokens, long_logits.expect("the long prompt's logits"))
}

/// A prompt computed a chunk at a time inside decode steps (the decode node's local prefill)
/// gives the logits a prefill of its own gives, bit for bit, and the steps' tokens are those
/// they give without it; with speculation on, so drafts share the pass too (how many a step
/// accepts may differ, since free blocks and step costs do: each sequence's tokens so far are
/// a prefix of the other run's).
#[test]
fn a_prompt_chunked_into_decode_steps_equals_its_own_prefill() {
    let model = real();
    let prompts = [
        chat(&model, "Count from one to twenty: one, two, three,"),
        chat(
            &model,
            "Repeat after me: the cat sat on the mat, the cat sat on the mat,",
        ),
    ];
    let long: Vec<u32> = (0..300u32).map(|i| 200 + (i * 7_919) % 40_000).collect();
    let spec = SpeculateConfig::default();
    let (alone_steps, alone_logits) = decode_beside_a_prefill(
        &mut engine(&model, spec.clone()),
        &prompts,
        &long,
        37,
        false,
    );
    let (fused_steps, fused_logits) =
        decode_beside_a_prefill(&mut engine(&model, spec), &prompts, &long, 37, true);
    for (fused, alone) in fused_steps.iter().zip(&alone_steps) {
        let n = fused.len().min(alone.len());
        assert!(
            n >= long.len().div_ceil(37),
            "a step emitted nothing: {fused:?} {alone:?}"
        );
        assert_eq!(fused[..n], alone[..n]);
    }
    assert!(
        fused_logits
            .iter()
            .zip(&alone_logits)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "the chunked prompt's logits differ from its own prefill's"
    );
}

/// A sequence kept from drafting (`may_draft` off) decodes a token a step beside one that
/// drafts, and both give the tokens of a run without speculation.
#[test]
fn a_sequence_kept_from_drafting_steps_a_token_at_a_time_with_the_same_tokens() {
    let model = ModelSource::TINY.load().expect("tiny");
    // Prompts that repeat themselves, so the lookup finds drafts in them.
    let prompts: Vec<Vec<u32>> = (0..2u32)
        .map(|salt| (0..64).map(|i| 3 + (i % (5 + salt)) * 7).collect())
        .collect();
    let params = GenerateParams {
        max_tokens: 80,
        min_tokens: 80,
        ..GenerateParams::default()
    };
    let run = |speculate: SpeculateConfig, may_draft: [bool; 2]| {
        let mut engine = engine(&model, speculate);
        let mut decodings: Vec<Decoding> = (prompts.iter().zip(may_draft))
            .map(|(prompt, may_draft)| {
                let seq = engine.new_sequence();
                let logits = engine.prefill(seq, prompt).expect("prefill");
                let mut stream = Stream::new(params.clone(), &model, prompt).expect("stream");
                let first = stream.sample(&model.tokenizer, &logits, prompt.len());
                let mut d = Decoding::new(seq, stream, prompt.clone(), first);
                d.may_draft = may_draft;
                d
            })
            .collect();
        let mut tokens = vec![vec![]; 2];
        let mut most_a_step = [0; 2];
        let mut done = [false; 2];
        while done.contains(&false) {
            let (index, mut batch): (Vec<usize>, Vec<&mut Decoding>) = (decodings.iter_mut())
                .enumerate()
                .filter(|(i, _)| !done[*i])
                .unzip();
            let step = engine.decode_step(&mut batch).expect("step");
            for (&i, emissions) in index.iter().zip(&step.emissions) {
                most_a_step[i] = most_a_step[i].max(emissions.len());
                tokens[i].extend(emissions.iter().filter_map(|e| e.token));
                done[i] = emissions.iter().any(|e| e.finished.is_some());
            }
        }
        let drafted = decodings
            .iter()
            .map(|d| d.drafter.drafted)
            .collect::<Vec<_>>();
        (tokens, most_a_step, drafted)
    };
    let (off, _, _) = run(SpeculateConfig::off(), [true, true]);
    let (held, most_a_step, drafted) = run(SpeculateConfig::on(), [false, true]);
    assert_eq!(held, off);
    assert_eq!(most_a_step[0], 1, "the held sequence took a token a step");
    assert_eq!(drafted[0], 0);
    assert!(drafted[1] > 0, "the other one drafted");
}
