//! Engine properties on the built-in tiny model: KV export/import, batching and chunking do not
//! change a single token, and bad input is refused with a precise error.

use std::sync::Arc;

use tandem_engine::{
    Engine, EngineConfig, Error, GenerateParams, GenerateRequest, KvDtype, Model, ModelSource,
    SamplingParams, SeqId,
};

mod tiny;
use tiny::{DTYPES, decode, engine_in, tinies};

fn tiny() -> Arc<Model> {
    ModelSource::TINY.load().expect("tiny model")
}

fn engine_with(model: &Arc<Model>, chunk: usize) -> Engine {
    engine_in(model, chunk, KvDtype::F16)
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 3 + (i * 31 + salt * 17) % 256)
        .collect()
}

#[test]
fn export_import_then_decode_equals_uninterrupted_run() {
    for model in tinies() {
        for dtype in DTYPES {
            export_import_then_decode(&model, dtype);
        }
    }
}

fn export_import_then_decode(model: &Arc<Model>, dtype: KvDtype) {
    let model = model.clone();
    let p = SamplingParams::default();
    let tokens = prompt(45, 1);
    let engine_with = |model: &Arc<Model>, chunk| engine_in(model, chunk, dtype);

    let mut a = engine_with(&model, 256);
    let seq = a.new_sequence();
    let logits = a.prefill(seq, &tokens).expect("prefill");
    let want = decode(&mut a, seq, logits.clone(), 20, &p);

    // Prefill on one engine, move the KV as bytes to another, decode there.
    let mut src = engine_with(&model, 256);
    let s = src.new_sequence();
    let l = src.prefill(s, &tokens).expect("prefill");
    assert_eq!(l, logits, "prefill logits are deterministic");
    let kv = src.export_kv(s, 0..tokens.len()).expect("export");
    let mut dst = engine_with(&model, 256);
    let d = dst.new_sequence();
    dst.import_kv(d, &kv).expect("import");
    assert_eq!(
        dst.export_kv(d, 0..tokens.len()).expect("re-export"),
        kv,
        "bit-exact round trip"
    );
    assert_eq!(decode(&mut dst, d, l, 20, &p), want);
}

#[test]
fn import_of_a_suffix_extends_a_cached_prefix() {
    let model = tiny();
    let tokens = prompt(40, 2);
    let mut src = engine_with(&model, 256);
    let s = src.new_sequence();
    let logits = src.prefill(s, &tokens).expect("prefill");
    let want = decode(&mut src, s, logits.clone(), 8, &SamplingParams::default());

    let mut dst = engine_with(&model, 256);
    let d = dst.new_sequence();
    dst.prefill(d, &tokens[..16]).expect("prefix");
    let suffix = src.export_kv(s, 16..40).expect("export");
    dst.import_kv(d, &suffix).expect("import suffix");
    assert_eq!(dst.seq_len(d).expect("len"), 40);
    assert_eq!(
        decode(&mut dst, d, logits, 8, &SamplingParams::default()),
        want
    );
}

#[test]
fn an_import_spread_over_calls_by_layers_equals_one_import() {
    let model = tiny();
    let tokens = prompt(40, 3);
    let mut src = engine_with(&model, 256);
    let s = src.new_sequence();
    let logits = src.prefill(s, &tokens).expect("prefill");
    let want = decode(&mut src, s, logits.clone(), 8, &SamplingParams::default());
    let suffix = src.export_kv(s, 16..40).expect("export");

    let mut dst = engine_with(&model, 256);
    let d = dst.new_sequence();
    dst.prefill(d, &tokens[..16]).expect("prefix");
    let n_layers = suffix.layout.n_layers;
    for l in 0..n_layers {
        assert_eq!(dst.seq_len(d).expect("len"), 16, "not yet part of it");
        dst.import_kv_layers(d, &suffix, l..l + 1)
            .expect("one layer");
    }
    assert_eq!(dst.seq_len(d).expect("len"), 40);
    assert_eq!(dst.export_kv(d, 16..40).expect("re-export"), suffix);
    assert_eq!(
        decode(&mut dst, d, logits, 8, &SamplingParams::default()),
        want
    );
    let e = dst.new_sequence();
    dst.prefill(e, &tokens[..16]).expect("prefix");
    assert!(
        dst.import_kv_layers(e, &suffix, 0..n_layers + 1).is_err(),
        "layers past the model's are refused"
    );
    assert_eq!(dst.seq_len(e).expect("len"), 16);
}

#[test]
fn batched_decode_equals_each_sequence_alone() {
    for model in tinies() {
        for dtype in DTYPES {
            batched_equals_alone(&model, dtype);
        }
    }
}

fn batched_equals_alone(model: &Arc<Model>, dtype: KvDtype) {
    let params: Vec<SamplingParams> = (0..5)
        .map(|i| SamplingParams {
            temperature: if i % 2 == 0 { 0.0 } else { 0.9 },
            top_k: 40,
            top_p: 0.95,
            seed: 7 + i,
            // Penalties read each sequence's own history, also in a batch.
            frequency_penalty: if i % 3 == 1 { 0.5 } else { 0.0 },
            presence_penalty: if i % 3 == 1 { 0.4 } else { 0.0 },
            repetition_penalty: if i % 3 == 2 { 1.3 } else { 1.0 },
            // The cuts and biases too.
            min_p: if i == 3 { 0.05 } else { 0.0 },
            logit_bias: if i == 1 {
                vec![(3, 2.5), (9, -100.0)]
            } else {
                Vec::new()
            },
        })
        .collect();
    let requests: Vec<GenerateRequest> = (0..5)
        .map(|i| GenerateRequest {
            prompt: prompt(5 + i * 9, i as u32),
            params: GenerateParams {
                sampling: params[i].clone(),
                max_tokens: 24,
                min_tokens: if i == 2 { 12 } else { 0 },
                ..Default::default()
            },
        })
        .collect();
    let mut engine = engine_in(model, 256, dtype);
    let batched = engine.generate_batch(&requests).expect("batch");
    for (req, got) in requests.iter().zip(&batched) {
        let alone = engine
            .generate_batch(std::slice::from_ref(req))
            .expect("alone");
        assert_eq!(alone[0].token_ids, got.token_ids);
        assert_eq!(alone[0].text, got.text);
        assert!(
            !got.token_ids.is_empty() || got.finish_reason == tandem_engine::FinishReason::Stop
        );
    }
    assert_eq!(
        engine.kv_blocks_free(),
        engine.kv_blocks_total(),
        "all KV returned"
    );
}

#[test]
fn chunked_prefill_equals_unchunked() {
    // 100 tokens: past the tiny Gemma's 24-position window.
    for model in tinies() {
        for dtype in DTYPES {
            chunked_equals_unchunked(&model, dtype);
        }
    }
}

fn chunked_equals_unchunked(model: &Arc<Model>, dtype: KvDtype) {
    let model = model.clone();
    let tokens = prompt(100, 3);
    let engine_with = |model: &Arc<Model>, chunk| engine_in(model, chunk, dtype);
    let mut whole = engine_with(&model, 1000);
    let s = whole.new_sequence();
    let want = whole.prefill(s, &tokens).expect("prefill");
    let want_kv = whole.export_kv(s, 0..100).expect("export");
    for chunk in [1, 7, 16, 33] {
        let mut e = engine_with(&model, chunk);
        let s = e.new_sequence();
        assert_eq!(
            e.prefill(s, &tokens).expect("prefill"),
            want,
            "{}: chunk {chunk}",
            model.name
        );
        assert_eq!(
            e.export_kv(s, 0..100).expect("export"),
            want_kv,
            "chunk {chunk}"
        );
    }
}

#[test]
fn bad_requests_get_precise_errors_and_change_nothing() {
    let model = tiny();
    let mut e = engine_with(&model, 64);
    let s = e.new_sequence();
    assert!(matches!(
        e.prefill(s, &[]),
        Err(Error::InvalidArgument {
            field: "tokens",
            ..
        })
    ));
    assert!(matches!(
        e.prefill(s, &[999_999]),
        Err(Error::InvalidArgument {
            field: "token_ids",
            ..
        })
    ));
    let too_long = prompt(model.config.context_len + 1, 0);
    assert!(matches!(
        e.prefill(s, &too_long),
        Err(Error::InvalidArgument {
            field: "tokens",
            ..
        })
    ));
    assert_eq!(e.seq_len(s).expect("len"), 0);
    assert!(matches!(
        e.step(&[(s, 5), (s, 6)]),
        Err(Error::InvalidArgument { field: "batch", .. })
    ));
    assert!(matches!(
        e.step(&[(SeqId(4242), 5)]),
        Err(Error::UnknownSequence(4242))
    ));
    let bad = GenerateRequest {
        prompt: prompt(4, 0),
        params: GenerateParams {
            max_tokens: 0,
            ..Default::default()
        },
    };
    assert!(matches!(
        e.generate_batch(&[bad]),
        Err(Error::InvalidArgument {
            field: "max_tokens",
            ..
        })
    ));
    e.free(s).expect("free");
    assert_eq!(e.kv_blocks_free(), e.kv_blocks_total());
}

#[test]
fn kv_exhaustion_is_an_error_not_a_panic() {
    let model = tiny();
    let layout = model.config.kv_layout(tandem_engine::KvDtype::F16);
    let mut e = Engine::new(
        model.clone(),
        EngineConfig {
            threads: 1,
            kv_budget_bytes: layout.block_bytes() * 2,
            prefill_chunk_tokens: 64,
            ..EngineConfig::default()
        },
    )
    .expect("engine");
    let s = e.new_sequence();
    let err = e.prefill(s, &prompt(40, 0)).expect_err("needs 3 blocks");
    assert!(
        matches!(
            err,
            Error::KvExhausted {
                needed_blocks: 3,
                free_blocks: 2
            }
        ),
        "{err}"
    );
    assert_eq!(e.kv_blocks_free(), 2);
}

#[test]
fn import_rejects_mismatched_kv() {
    let model = tiny();
    let mut e = engine_with(&model, 64);
    let s = e.new_sequence();
    e.prefill(s, &prompt(20, 0)).expect("prefill");
    let kv = e.export_kv(s, 0..20).expect("export");
    let d = e.new_sequence();
    let mut wrong_range = kv.clone();
    wrong_range.tokens = 4..24;
    assert!(matches!(
        e.import_kv(d, &wrong_range),
        Err(Error::KvImport { .. })
    ));
    let mut short = kv.clone();
    short.layers[1][0].pop();
    assert!(matches!(
        e.import_kv(d, &short),
        Err(Error::KvImport { .. })
    ));
    assert_eq!(
        e.seq_len(d).expect("len"),
        0,
        "a rejected import changes nothing"
    );
    let free_before = e.kv_blocks_free();
    let mut other_layout = kv.clone();
    other_layout.layout.head_dim *= 2;
    assert!(matches!(
        e.import_kv(d, &other_layout),
        Err(Error::KvImport { .. })
    ));
    // q8 KV into an f16 engine: the dtype is part of the layout.
    let mut q8 = engine_in(&model, 64, KvDtype::Q8);
    let s = q8.new_sequence();
    q8.prefill(s, &prompt(20, 0)).expect("prefill");
    let other_dtype = q8.export_kv(s, 0..20).expect("export");
    assert!(matches!(
        e.import_kv(d, &other_dtype),
        Err(Error::KvImport { .. })
    ));
    assert_eq!(e.kv_blocks_free(), free_before);
}

/// A 30-token greedy generation on the tiny model: the request and its output.
fn greedy_30(e: &mut Engine) -> (GenerateRequest, tandem_engine::GenerateOutput) {
    let base = GenerateRequest {
        prompt: prompt(10, 5),
        params: GenerateParams {
            max_tokens: 30,
            ..Default::default()
        },
    };
    let full = e
        .generate_batch(std::slice::from_ref(&base))
        .expect("generate")
        .remove(0);
    (base, full)
}

#[test]
fn stop_strings_and_streaming_text() {
    let model = tiny();
    let mut e = engine_with(&model, 64);
    let (base, full) = greedy_30(&mut e);
    let mut pieces = Vec::new();
    let streamed = e
        .generate_streaming(&base, &mut |t| pieces.push(t.to_string()))
        .expect("stream");
    assert_eq!(pieces.concat(), streamed.text);
    assert_eq!(streamed.text, full.text);
    // Stop on a piece of the text the model produces: output ends right before it.
    let chars: Vec<char> = full.text.chars().collect();
    assert!(chars.len() >= 6, "the tiny model produced {:?}", full.text);
    let stop: String = chars[3..5].iter().collect();
    let mut req = base.clone();
    req.params.stop = vec![stop.clone()];
    let out = e.generate_batch(&[req]).expect("generate").remove(0);
    let cut = full.text.find(&stop).expect("stop occurs");
    assert_eq!(out.text, full.text[..cut]);
    assert_eq!(out.finish_reason, tandem_engine::FinishReason::Stop);
}

/// `min_tokens`, `ignore_eos` and `stop_token_ids`, with a logit bias that makes an
/// end-of-generation id (or a stop id) the greedy choice at every position.
#[test]
fn end_of_generation_ids_wait_for_min_tokens_and_ignore_eos_ignores_them() {
    use tandem_engine::FinishReason::{Length, Stop};
    let model = tiny();
    let eog = model.tokenizer.eog_ids()[0];
    let mut e = engine_with(&model, 64);
    let mut run = |params: GenerateParams| {
        let out = e
            .generate_batch(&[GenerateRequest {
                prompt: prompt(10, 5),
                params,
            }])
            .expect("generate")
            .remove(0);
        (out.token_ids.len(), out.finish_reason)
    };
    let favour = |id: u32| GenerateParams {
        sampling: SamplingParams {
            logit_bias: vec![(id, 100.0)],
            ..Default::default()
        },
        max_tokens: 12,
        ..Default::default()
    };
    assert_eq!(run(favour(eog)), (0, Stop), "the biased id ends it at once");
    let min5 = GenerateParams {
        min_tokens: 5,
        ..favour(eog)
    };
    assert_eq!(run(min5), (5, Stop));
    let ignore = GenerateParams {
        ignore_eos: true,
        ..favour(eog)
    };
    assert_eq!(run(ignore), (12, Length));
    // A stop id ends the generation as an end-of-generation id does, and waits for min_tokens.
    let stop_id = 40;
    let stop = GenerateParams {
        stop_token_ids: vec![stop_id],
        ..favour(stop_id)
    };
    assert_eq!(run(stop.clone()), (0, Stop));
    let min3 = GenerateParams {
        min_tokens: 3,
        ..stop.clone()
    };
    assert_eq!(run(min3), (3, Stop));
    let without = GenerateParams {
        stop_token_ids: Vec::new(),
        ..stop
    };
    assert_eq!(
        run(without),
        (12, Length),
        "unlisted, the id is just a token"
    );
    let too_many = GenerateParams {
        min_tokens: 13,
        ..favour(eog)
    };
    assert!(matches!(
        e.generate_batch(&[GenerateRequest {
            prompt: prompt(4, 1),
            params: too_many,
        }]),
        Err(Error::InvalidArgument {
            field: "min_tokens",
            ..
        })
    ));
}

#[test]
fn damaged_model_files_fail_with_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("tandem-engine-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let image = tandem_engine::tiny_gguf_image().expect("image");
    let load = |name: &str, bytes: &[u8]| {
        let path = dir.join(name);
        std::fs::write(&path, bytes).expect("write");
        let err = ModelSource::parse(path.to_str().expect("utf8"), &dir)
            .load()
            .expect_err("must fail");
        let msg = err.to_string();
        assert!(msg.contains(name), "{msg} names the file");
        msg
    };
    assert!(load("truncated.gguf", &image[..image.len() - 1000]).contains("truncated"));
    assert!(load("header.gguf", &image[..100]).contains("not a usable GGUF"));
    assert!(load("garbage.gguf", b"this is not a model at all").contains("not a usable GGUF"));
    let mut other_arch = image.clone();
    let at = other_arch
        .windows(5)
        .position(|w| w == b"llama")
        .expect("architecture string");
    other_arch[at..at + 5].copy_from_slice(b"gemma");
    assert!(load("gemma.gguf", &other_arch).contains("architecture"));
    let missing = ModelSource::parse("default", &dir)
        .load()
        .expect_err("missing");
    assert!(
        missing.to_string().contains("tandem model fetch"),
        "{missing}"
    );
    std::fs::remove_dir_all(&dir).expect("cleanup");
}

#[test]
fn an_engine_moves_to_its_own_thread() {
    // A decode server runs its engine on a scheduler thread: `Engine` must be `Send`.
    let model = tiny();
    let mut engine = engine_with(&model, 64);
    let worker = std::thread::spawn(move || {
        let s = engine.new_sequence();
        engine.prefill(s, &prompt(5, 0)).map(|logits| logits.len())
    });
    let len = worker.join().expect("worker").expect("prefill");
    assert_eq!(len, model.config.vocab);
}

/// Chained block names for the tests: the engine treats hashes as opaque, so any function of the
/// whole prefix will do (the servers use `tandem_proto::block_hash`).
fn chain(tokens: &[u32]) -> Vec<u64> {
    use std::hash::{Hash, Hasher};
    (1..=tokens.len() / tandem_engine::BLOCK_TOKENS)
        .map(|b| {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            tokens[..b * tandem_engine::BLOCK_TOKENS].hash(&mut h);
            h.finish()
        })
        .collect()
}

/// A pool of `blocks` blocks, all of which the prefix cache may hold.
fn cached_config(model: &Arc<Model>, blocks: usize) -> EngineConfig {
    let block = model
        .config
        .kv_layout(tandem_engine::KvDtype::F16)
        .block_bytes();
    EngineConfig {
        threads: 2,
        kv_budget_bytes: block * blocks,
        prefill_chunk_tokens: 32,
        prefix_cache_bytes: usize::MAX,
        ..EngineConfig::default()
    }
}

fn cached_engine(model: &Arc<Model>, blocks: usize) -> Engine {
    Engine::new(model.clone(), cached_config(model, blocks)).expect("engine")
}

/// Runs `prompt` then `steps` greedy tokens; returns the sequence (still live), the tokens fed
/// (the prompt and every generated token) and the generated tokens.
fn run(engine: &mut Engine, prompt: &[u32], steps: usize) -> (SeqId, Vec<u32>, Vec<u32>) {
    let (seq, cached) = engine.new_sequence_cached(&chain(&prompt[..prompt.len() - 1]));
    let cached = cached.tokens;
    let logits = engine.prefill(seq, &prompt[cached..]).expect("prefill");
    let out = decode(engine, seq, logits, steps, &SamplingParams::default());
    let mut fed = prompt.to_vec();
    fed.extend(&out);
    (seq, fed, out)
}

#[test]
fn a_follow_up_on_cached_kv_equals_a_cold_run() {
    let model = tiny();
    let mut warm = cached_engine(&model, 64);
    // Turn 1, then its prompt and reply stay cached (decode-step KV included).
    let (seq, fed, _) = run(&mut warm, &prompt(40, 3), 12);
    assert_eq!(warm.seq_len(seq).expect("len"), fed.len());
    warm.cache_sequence(seq, &chain(&fed)).expect("cache");
    warm.free(seq).expect("free");
    assert_eq!(warm.kv_blocks_cached(), fed.len() / 16);
    // Turn 2 extends turn 1's history.
    let mut turn2 = fed.clone();
    turn2.extend(prompt(21, 9));
    let (seq, cached) = warm.new_sequence_cached(&chain(&turn2[..turn2.len() - 1]));
    let cached = cached.tokens;
    assert_eq!(
        cached,
        fed.len() / 16 * 16,
        "every full block of turn 1 is reused"
    );
    let warm_logits = warm.prefill(seq, &turn2[cached..]).expect("prefill");
    let warm_out = decode(
        &mut warm,
        seq,
        warm_logits.clone(),
        16,
        &SamplingParams::default(),
    );

    let mut cold = engine_with(&model, 32);
    let s = cold.new_sequence();
    let cold_logits = cold.prefill(s, &turn2).expect("prefill");
    let cold_out = decode(
        &mut cold,
        s,
        cold_logits.clone(),
        16,
        &SamplingParams::default(),
    );
    assert!(
        warm_logits
            .iter()
            .zip(&cold_logits)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "the first position's logits are bit-identical"
    );
    assert_eq!(warm_out, cold_out);
}

#[test]
fn pool_pressure_evicts_unpinned_cache_blocks_and_never_pinned_ones() {
    let model = tiny();
    let mut e = cached_engine(&model, 12);
    // Two finished sequences stay cached: A (4 blocks) and B (2 blocks).
    let a_prompt = prompt(65, 1);
    let (a, a_fed, _) = run(&mut e, &a_prompt, 2);
    e.cache_sequence(a, &chain(&a_fed[..64])).expect("cache");
    e.free(a).expect("free");
    let (b, b_fed, _) = run(&mut e, &prompt(33, 2), 2);
    e.cache_sequence(b, &chain(&b_fed[..32])).expect("cache");
    e.free(b).expect("free");
    assert_eq!(e.kv_blocks_cached(), 6);
    let _ = e.take_cache_events();

    // C runs on A's cached prefix (pinning its 4 blocks) and keeps decoding.
    let mut c_prompt = a_prompt[..64].to_vec();
    c_prompt.extend(prompt(8, 7));
    let (c, cached) = e.new_sequence_cached(&chain(&c_prompt[..c_prompt.len() - 1]));
    let cached = cached.tokens;
    assert_eq!(cached, 64);
    let c_logits = e.prefill(c, &c_prompt[64..]).expect("prefill");

    // D fills the pool: B's blocks (unpinned) are evicted for it, A's (pinned by C) are not.
    let d = e.new_sequence();
    e.prefill(d, &prompt(16 * 7, 4))
        .expect("fits after evicting B");
    let events = e.take_cache_events();
    assert!(
        matches!(events.as_slice(), [tandem_engine::CacheEvent::Evicted(h)] if h.len() == 2),
        "{events:?}"
    );
    assert_eq!(e.kv_blocks_cached(), 4);
    // Nothing unpinned is left to evict.
    let f = e.new_sequence();
    assert!(matches!(
        e.prefill(f, &prompt(16, 5)),
        Err(Error::KvExhausted { .. })
    ));
    // C, reading its pinned prefix, still decodes exactly as a cold run of its tokens.
    let p = SamplingParams::default();
    let c_out = decode(&mut e, c, c_logits, 5, &p);
    let mut cold = engine_with(&model, 32);
    let s = cold.new_sequence();
    let l = cold.prefill(s, &c_prompt).expect("prefill");
    assert_eq!(decode(&mut cold, s, l, 5, &p), c_out);
}

/// A directory for a test's disk tier, removed when dropped.
struct SpillDir(std::path::PathBuf);

impl SpillDir {
    fn new() -> Self {
        Self(std::env::temp_dir().join(format!(
            "tandem-spill-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        )))
    }

    /// An engine of `blocks` blocks whose prefix cache spills here.
    fn engine(&self, model: &Arc<Model>, blocks: usize) -> Engine {
        let config = EngineConfig {
            spill: Some(tandem_engine::SpillConfig {
                dir: self.0.clone(),
                max_bytes: 1 << 30,
            }),
            ..cached_config(model, blocks)
        };
        Engine::new(model.clone(), config).expect("engine")
    }

    /// The spilled blocks' files: the tier's in the directory's first slot, where one engine's go.
    fn files(&self) -> Vec<std::path::PathBuf> {
        let mut files: Vec<_> = std::fs::read_dir(self.0.join("slot-0"))
            .expect("spill dir")
            .flatten()
            .filter(|e| e.path().is_dir())
            .flat_map(|d| std::fs::read_dir(d.path()).expect("model dir").flatten())
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "kv"))
            .collect();
        files.sort();
        files
    }
}

impl Drop for SpillDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Waits for the disk tier's writer to have stored `n` blocks.
fn spilled(e: &Engine, n: u64) {
    let stats = e.spill_stats();
    let start = std::time::Instant::now();
    while stats.stored.load(std::sync::atomic::Ordering::Relaxed) < n {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(30),
            "the writer stored {:?} of {n} blocks",
            stats.stored
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// A prefix pushed out of a small pool comes back from disk: the follow-up computes only what
/// follows it and equals a cold run; a damaged file is never served, and costs only recompute.
#[test]
fn a_prefix_evicted_to_disk_comes_back_exactly_and_a_damaged_one_is_recomputed() {
    use std::sync::atomic::Ordering::Relaxed;
    let model = tiny();
    let dir = SpillDir::new();
    let mut e = dir.engine(&model, 8);
    // A's 4 full blocks are cached, then B's 8 blocks push them out of the pool, to disk.
    let a_prompt = prompt(65, 1);
    let (a, a_fed, _) = run(&mut e, &a_prompt, 2);
    e.cache_sequence(a, &chain(&a_fed[..64])).expect("cache");
    e.free(a).expect("free");
    let b = e.new_sequence();
    e.prefill(b, &prompt(16 * 8, 4))
        .expect("fits by evicting A");
    e.free(b).expect("free");
    spilled(&e, 4);
    assert_eq!(dir.files().len(), 4);

    let mut c_prompt = a_prompt[..64].to_vec();
    c_prompt.extend(prompt(8, 7));
    let p = SamplingParams::default();
    let cold_out = {
        let mut cold = engine_with(&model, 32);
        let s = cold.new_sequence();
        let l = cold.prefill(s, &c_prompt).expect("prefill");
        decode(&mut cold, s, l, 6, &p)
    };
    let (c, cached) = e.new_sequence_cached(&chain(&c_prompt[..c_prompt.len() - 1]));
    let cached = cached.tokens;
    assert_eq!(cached, 64, "A's blocks are read back");
    assert_eq!(e.spill_stats().restored.load(Relaxed), 4);
    let l = e.prefill(c, &c_prompt[cached..]).expect("prefill");
    assert_eq!(decode(&mut e, c, l, 6, &p), cold_out);
    e.free(c).expect("free");
    drop(e);

    // A restarted engine keeps the files; one damaged in the middle of A's chain is caught,
    // so only the blocks before it are served.
    let files = dir.files();
    let mut e = dir.engine(&model, 8);
    let victims: Vec<_> = files
        .iter()
        .filter(|f| {
            let name = f.file_stem().and_then(|n| n.to_str()).unwrap_or_default();
            name == format!("{:016x}", chain(&c_prompt)[2])
        })
        .collect();
    assert_eq!(victims.len(), 1, "A's third block is on disk");
    let mut bytes = std::fs::read(victims[0]).expect("read");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(victims[0], bytes).expect("write");
    let (c, cached) = e.new_sequence_cached(&chain(&c_prompt[..c_prompt.len() - 1]));
    let cached = cached.tokens;
    assert_eq!(cached, 32, "the blocks before the damaged one");
    assert_eq!(e.spill_stats().corrupt.load(Relaxed), 1);
    assert!(!victims[0].exists(), "the damaged file is deleted");
    let l = e.prefill(c, &c_prompt[cached..]).expect("prefill");
    assert_eq!(decode(&mut e, c, l, 6, &p), cold_out);
}

/// An engine that stops writes its cache to the disk tier, and the next one on the directory
/// starts with it.
#[test]
fn an_engine_writes_its_cache_to_disk_as_it_stops() {
    let model = tiny();
    let dir = SpillDir::new();
    let mut e = dir.engine(&model, 64);
    let a_prompt = prompt(65, 1);
    let (a, a_fed, _) = run(&mut e, &a_prompt, 2);
    e.cache_sequence(a, &chain(&a_fed[..64])).expect("cache");
    e.free(a).expect("free");
    assert!(
        dir.files().is_empty(),
        "nothing was evicted, so nothing was spilled"
    );
    drop(e);
    assert_eq!(dir.files().len(), 4);
    let mut e = dir.engine(&model, 64);
    let (_, cached) = e.new_sequence_cached(&chain(&a_prompt[..64]));
    let cached = cached.tokens;
    assert_eq!(cached, 64);
}

/// Failover's premise: a generation resumed elsewhere, by prefilling its prompt plus the tokens
/// already delivered, continues exactly as the uninterrupted run (the logits of a prefilled
/// position equal those of a decode step bit for bit, and sampling depends only on seed,
/// position and logits).
#[test]
fn a_generation_resumed_from_its_delivered_tokens_equals_the_uninterrupted_one() {
    let model = tiny();
    let p = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: 11,
        ..SamplingParams::default()
    };
    let tokens = prompt(37, 4);
    let mut e = engine_with(&model, 64);
    let s = e.new_sequence();
    let mut logits = e.prefill(s, &tokens).expect("prefill");
    let (mut out, mut step_logits) = (Vec::new(), Vec::new());
    for _ in 0..24 {
        let pos = e.seq_len(s).expect("len");
        let tok = tandem_engine::sample(&logits, &p, pos as u64, &Default::default(), &[]);
        out.push(tok);
        step_logits.push(logits.clone());
        logits = e.step(&[(s, tok)]).expect("step").row(0).to_vec();
    }
    for k in [1, 5, 15, 16, 17, 23] {
        let mut fresh = engine_with(&model, 16);
        let s = fresh.new_sequence();
        let mut resumed = tokens.clone();
        resumed.extend(&out[..k]);
        let logits = fresh.prefill(s, &resumed).expect("prefill");
        assert!(
            logits
                .iter()
                .zip(&step_logits[k])
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "resumed at {k}: the prefilled position's logits equal the step's"
        );
        let rest = decode(&mut fresh, s, logits, 24 - k, &p);
        assert_eq!(rest, out[k..], "resumed at {k}");
    }
}

/// The text side of resuming: a stream restored from the delivered tokens emits exactly what
/// the uninterrupted stream emits from there on, stop-string hold-back included.
#[test]
fn a_resumed_stream_emits_the_rest_of_the_text() {
    let model = tiny();
    let tokenizer = &model.tokenizer;
    let mut e = engine_with(&model, 64);
    let (base, full) = greedy_30(&mut e);
    let chars: Vec<char> = full.text.chars().collect();
    assert!(chars.len() >= 8, "the tiny model produced {:?}", full.text);
    // A stop string that occurs late, so that text is held back along the way.
    let params = GenerateParams {
        stop: vec![chars[chars.len() - 3..].iter().collect()],
        ..base.params.clone()
    };
    let mut whole =
        tandem_engine::Stream::new(params.clone(), &model, &base.prompt).expect("stream");
    let emissions: Vec<_> = full
        .token_ids
        .iter()
        .map(|&t| whole.accept(tokenizer, t))
        .collect();
    let ended = emissions
        .iter()
        .position(|m| m.finished.is_some())
        .expect("the generation ends");
    for k in 1..=ended {
        let mut resumed = tandem_engine::Stream::resume(
            params.clone(),
            &model,
            &base.prompt,
            &full.token_ids[..k],
        )
        .expect("resume");
        for (i, &t) in full.token_ids[k..=ended].iter().enumerate() {
            assert_eq!(
                resumed.accept(tokenizer, t),
                emissions[k + i],
                "resumed at {k}"
            );
        }
    }
    // Tokens that already finished the generation cannot be resumed.
    assert!(matches!(
        tandem_engine::Stream::resume(params, &model, &base.prompt, &full.token_ids[..=ended]),
        Err(Error::InvalidArgument { .. })
    ));
}

/// A released sequence leaves the pool: to the disk tier with `to_disk` where there is one (its
/// next use reads it back, counted as restored), kept in the pool with `to_disk` where there is
/// none, and dropped without `to_disk`.
#[test]
fn a_released_sequence_leaves_the_pool_as_asked() {
    let model = tiny();
    let tokens = prompt(64, 5);
    let hashes = chain(&tokens);
    let fill = |engine: &mut Engine| {
        let (seq, _) = engine.new_sequence_cached(&[]);
        engine.prefill(seq, &tokens).expect("prefill");
        engine.cache_sequence(seq, &hashes).expect("cache");
        engine.free(seq).expect("free");
    };
    let mut plain = cached_engine(&model, 16);
    fill(&mut plain);
    assert_eq!(plain.release_cached(&hashes, true), 0, "no disk tier: kept");
    assert_eq!(plain.kv_blocks_cached(), 4);
    assert_eq!(plain.release_cached(&hashes, false), 4, "dropped");
    assert_eq!(plain.kv_blocks_cached(), 0);

    let dir = std::env::temp_dir().join(format!("tandem-release-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = EngineConfig {
        spill: Some(tandem_engine::SpillConfig {
            dir: dir.clone(),
            max_bytes: 1 << 30,
        }),
        ..cached_config(&model, 16)
    };
    {
        let mut spilling = Engine::new(model.clone(), config).expect("engine");
        fill(&mut spilling);
        assert_eq!(spilling.release_cached(&hashes, true), 4, "to disk");
        assert_eq!(spilling.kv_blocks_cached(), 0);
        let stats = spilling.spill_stats();
        let start = std::time::Instant::now();
        while stats.stored.load(std::sync::atomic::Ordering::Relaxed) < 4 {
            assert!(start.elapsed().as_secs() < 30, "the writer stored nothing");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let (seq, reused) = spilling.new_sequence_cached(&hashes);
        assert_eq!(
            (reused.tokens, reused.restored),
            (64, 64),
            "read back from disk"
        );
        spilling.free(seq).expect("free");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
