//! A prompt computed a layer at a time (the stages of a pipelined prefill) gives a prefill's
//! bits: on its own, and with its prefix's KV arriving layer by layer from the stage before.

use std::sync::Arc;

use tandem_engine::{KvDtype, Model, ModelSource, SamplingParams};

mod tiny;
use tiny::{DTYPES, decode, engine_in, tinies};

fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 3 + (i * 37 + 11) % 256).collect()
}

#[test]
fn a_prompt_computed_a_layer_at_a_time_equals_a_prefill() {
    // 100 tokens: past the tiny Gemma's 24-position window; chunks of 16 leave a partial one.
    let tokens = prompt(100);
    for model in tinies() {
        for dtype in DTYPES {
            let mut whole = engine_in(&model, 16, dtype);
            let s = whole.new_sequence();
            let want = whole.prefill(s, &tokens).expect("prefill");
            let want_kv = whole.export_kv(s, 0..100).expect("export");

            let mut e = engine_in(&model, 16, dtype);
            let l = e.new_sequence();
            let mut pass = e.begin_layers(l, 0, &tokens).expect("begin");
            for li in 0..model.config.n_layers {
                assert_eq!(e.next_layer(&mut pass, &|| {}).expect("layer"), li);
            }
            assert_eq!(
                e.finish_layers(pass).expect("finish"),
                want,
                "{}",
                model.name
            );
            assert_eq!(e.export_kv(l, 0..100).expect("export"), want_kv);
        }
    }
}

/// Three stages over `tokens`, cut at `cuts`: each computes its part a layer at a time on the
/// prefix's layers that the stage before exports after computing them. The last stage starts
/// holding `held` tokens of its own (a cached prefix), and imports only the rest.
fn three_stages(model: &Arc<Model>, dtype: KvDtype, tokens: &[u32], cuts: [usize; 2], held: usize) {
    let layers = model.config.n_layers;
    let [a, b] = cuts;
    let mut whole = engine_in(model, 16, dtype);
    let s = whole.new_sequence();
    let want = whole.prefill(s, tokens).expect("prefill");
    let want_kv = whole.export_kv(s, 0..tokens.len()).expect("export");
    let want_tokens = decode(&mut whole, s, want.clone(), 6, &SamplingParams::default());

    let (mut e1, mut e2, mut e3) = (
        engine_in(model, 16, dtype),
        engine_in(model, 16, dtype),
        engine_in(model, 16, dtype),
    );
    let (s1, s2, s3) = (e1.new_sequence(), e2.new_sequence(), e3.new_sequence());
    if held > 0 {
        e3.prefill(s3, &tokens[..held])
            .expect("the last stage's own prefix");
    }
    let mut p1 = e1.begin_layers(s1, 0, &tokens[..a]).expect("stage 1");
    let mut p2 = e2.begin_layers(s2, a, &tokens[a..b]).expect("stage 2");
    let mut p3 = e3.begin_layers(s3, b, &tokens[b..]).expect("stage 3");
    for li in 0..layers {
        e1.next_layer(&mut p1, &|| {}).expect("stage 1 layer");
        let [k, v] = e1.export_layer(&p1, li, 0..a).expect("stage 1 sends");
        e2.import_layer(&mut p2, &k, &v).expect("stage 2 takes");
        e2.next_layer(&mut p2, &|| {}).expect("stage 2 layer");
        let [k, v] = e2.export_layer(&p2, li, held..b).expect("stage 2 sends");
        e3.import_layer(&mut p3, &k, &v).expect("stage 3 takes");
        e3.next_layer(&mut p3, &|| {}).expect("stage 3 layer");
    }
    e1.finish_layers(p1).expect("stage 1 ends");
    e2.finish_layers(p2).expect("stage 2 ends");
    let got = e3.finish_layers(p3).expect("stage 3 ends");
    assert_eq!(got, want, "{}: cuts {cuts:?}, held {held}", model.name);
    assert_eq!(e3.seq_len(s3).expect("len"), tokens.len());
    assert_eq!(e3.export_kv(s3, 0..tokens.len()).expect("export"), want_kv);
    assert_eq!(
        decode(&mut e3, s3, got, 6, &SamplingParams::default()),
        want_tokens
    );
}

#[test]
fn stages_fed_layer_by_layer_equal_one_prefill() {
    let tokens = prompt(100);
    for model in tinies() {
        for dtype in DTYPES {
            three_stages(&model, dtype, &tokens, [32, 64], 0);
            // Cuts off the chunk grid, and a last stage that holds a prefix already.
            three_stages(&model, dtype, &tokens, [40, 75], 16);
        }
    }
}

#[test]
fn a_pass_out_of_order_is_refused_and_changes_nothing() {
    let model = ModelSource::TINY.load().expect("tiny model");
    let tokens = prompt(40);
    let mut e = engine_in(&model, 16, KvDtype::F16);
    let s = e.new_sequence();
    e.prefill(s, &tokens[..16]).expect("prefix");
    assert!(
        e.begin_layers(s, 8, &tokens[8..]).is_err(),
        "inside the sequence"
    );
    assert!(e.begin_layers(s, 16, &[]).is_err(), "no tokens");

    let mut pass = e.begin_layers(s, 24, &tokens[24..]).expect("begin");
    assert!(
        e.next_layer(&mut pass, &|| {}).is_err(),
        "layer 0 of 16..24 has not come"
    );
    assert!(
        e.export_layer(&pass, 0, 0..30).is_err(),
        "nothing computed yet"
    );
    let [k, v] = [vec![0u8; 3], vec![0u8; 3]];
    assert!(
        e.import_layer(&mut pass, &k, &v).is_err(),
        "bytes of the wrong size"
    );
    let mut plain = engine_in(&model, 16, KvDtype::F16);
    let p = plain.new_sequence();
    plain.prefill(p, &tokens[..24]).expect("prefill");
    let kv = plain.export_kv(p, 16..24).expect("export");
    let [k, v] = &kv.layers[0];
    e.import_layer(&mut pass, k, v).expect("layer 0");
    let per_token = e.export_kv(s, 0..16).expect("export").layers[0][0].len() / 16;
    let sent = e.export_layer(&pass, 0, 0..24).expect("held and imported");
    assert_eq!(sent[0].len(), 24 * per_token);
    e.next_layer(&mut pass, &|| {}).expect("layer 0");
    assert!(
        e.next_layer(&mut pass, &|| {}).is_err(),
        "layer 1 of 16..24 has not come"
    );
    assert_eq!(
        e.seq_len(s).expect("len"),
        16,
        "a pass in progress leaves the length"
    );
    assert_eq!(pass.layers_done(), 1);
    assert!(e.finish_layers(pass).is_err(), "one layer of several");

    let w = e.new_sequence();
    let mut whole = e.begin_layers(w, 0, &tokens).expect("begin");
    let layers = model.config.n_layers;
    for _ in 0..layers {
        e.next_layer(&mut whole, &|| {}).expect("layer");
    }
    assert!(
        e.next_layer(&mut whole, &|| {}).is_err(),
        "past the last layer"
    );
    let n = e.new_sequence();
    let mut nothing = e.begin_layers(n, 0, &tokens[..4]).expect("begin");
    assert!(
        e.import_layer(&mut nothing, k, v).is_err(),
        "nothing to import"
    );
}

/// A simulated model's pass (its compute replaced by a timing profile) gives the token its
/// prefill gives, and sends header-only KV as empty rows.
#[test]
fn a_simulated_pass_equals_a_simulated_prefill() {
    let profile = tandem_engine::TimingProfile {
        model: "tiny".into(),
        cpu: "test".into(),
        threads: 1,
        passes: vec![(1, 0.0001), (64, 0.0004)],
        attend_s: 0.0,
    };
    let model = ModelSource::TINY
        .load_simulated(profile)
        .expect("simulated tiny");
    let tokens = prompt(100);
    let mut e = engine_in(&model, 16, KvDtype::F16);
    let s = e.new_sequence();
    let want = e.prefill(s, &tokens).expect("prefill");
    let l = e.new_sequence();
    let mut pass = e.begin_layers(l, 0, &tokens).expect("begin");
    let chunks = std::sync::atomic::AtomicUsize::new(0);
    for _ in 0..model.config.n_layers {
        e.next_layer(&mut pass, &|| {
            chunks.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        })
        .expect("layer");
    }
    assert_eq!(
        chunks.into_inner(),
        7 * model.config.n_layers,
        "progress after each of the 7 chunks of every layer"
    );
    assert_eq!(e.finish_layers(pass).expect("finish"), want);
    assert_eq!(e.seq_len(l).expect("len"), 100);
}
