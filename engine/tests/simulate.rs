//! The simulated engine on the tiny model: replies are plain words, the same for the same
//! prompt and the same when a generation resumes from its prompt and what it delivered (as a
//! failover does), a forward pass takes at least its profile's time, and bad profiles are
//! refused with a reason. Every shipped profile parses.

use std::time::Instant;

use tandem_engine::{
    Compute, Engine, EngineConfig, GenerateParams, GenerateRequest, ModelSource, TimingProfile,
};

fn profile() -> TimingProfile {
    TimingProfile {
        model: "tiny".into(),
        cpu: "test".into(),
        threads: 1,
        passes: vec![(1, 0.002), (4, 0.0025), (64, 0.012)],
        attend_s: 0.000_001,
    }
}

fn engine() -> Engine {
    let model = ModelSource::TINY
        .load_simulated(profile())
        .expect("simulated tiny model");
    assert!(matches!(model.compute, Compute::Simulated(_)));
    Engine::new(
        model,
        EngineConfig {
            threads: 1,
            kv_budget_bytes: 4 << 20,
            ..EngineConfig::default()
        },
    )
    .expect("engine")
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt,
        params: GenerateParams {
            max_tokens,
            ..Default::default()
        },
    }
}

#[test]
fn a_resumed_generation_continues_exactly() {
    let mut e = engine();
    let prompt: Vec<u32> = (10..40).collect();
    let full = e
        .generate_batch(&[request(prompt.clone(), 24)])
        .expect("generate")
        .remove(0);
    // A simulated reply never ends by itself: it runs to max_tokens, in printable text.
    assert_eq!(full.token_ids.len(), 24);
    assert!(!full.text.trim().is_empty(), "{:?}", full.text);
    assert!(
        full.text.chars().all(|c| c == ' ' || c.is_ascii_graphic()),
        "{:?}",
        full.text
    );
    let again = e
        .generate_batch(&[request(prompt.clone(), 24)])
        .expect("generate")
        .remove(0);
    assert_eq!(again.token_ids, full.token_ids);
    // Resumed after 10 delivered tokens, on a fresh engine (another node).
    let mut resumed_prompt = prompt;
    resumed_prompt.extend(&full.token_ids[..10]);
    let rest = engine()
        .generate_batch(&[request(resumed_prompt, 14)])
        .expect("generate")
        .remove(0);
    assert_eq!(rest.token_ids, full.token_ids[10..]);
}

#[test]
fn a_forward_pass_takes_its_profiles_time() {
    let mut e = engine();
    let p = profile();
    let seq = e.new_sequence();
    let prompt: Vec<u32> = (10..110).collect();
    let started = Instant::now();
    e.prefill(seq, &prompt).expect("prefill");
    // 100 prompt rows, past the last pass measured: its time per row, and their attention.
    let attention = p.attend_s * (100.0 * 101.0 / 2.0);
    assert!(started.elapsed().as_secs_f64() >= 0.012 * 100.0 / 64.0 + attention);
    let started = Instant::now();
    let logits = e.step(&[(seq, 5)]).expect("step");
    assert_eq!(logits.len(), 1);
    assert!(started.elapsed().as_secs_f64() >= 0.002 + p.attend_s * 101.0);
}

#[test]
fn bad_profiles_are_refused_with_a_reason() {
    let good = serde_json::to_value(profile()).expect("json");
    assert_eq!(
        TimingProfile::parse(&good.to_string()).expect("parses"),
        profile()
    );
    for (field, value) in [
        ("attend_s", serde_json::json!(-1.0)),
        ("attend_s", serde_json::json!("fast")),
        ("passes", serde_json::json!([])),
        ("passes", serde_json::json!([[4, 0.01], [1, 0.02]])),
        ("passes", serde_json::json!([[1, 0.02], [4, 0.01]])),
        ("passes", serde_json::json!([[1, 0.0]])),
    ] {
        let mut bad = good.clone();
        bad[field] = value;
        let err = TimingProfile::parse(&bad.to_string()).expect_err("refused");
        assert!(!err.is_empty());
    }
}

#[test]
fn every_shipped_profile_parses() {
    for (name, _) in tandem_engine::simulate::SHIPPED {
        let p = tandem_engine::simulate::shipped(name)
            .unwrap_or_else(|| panic!("the profile of {name} does not parse"));
        assert!(p.passes.len() > 1, "{name}: {p:?}");
    }
}
