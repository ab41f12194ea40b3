//! What the tests on the built-in tiny models share: the models, an engine over one, and a
//! decode by hand.

use std::sync::Arc;

use tandem_engine::{Engine, EngineConfig, KvDtype, Model, ModelSource, SamplingParams, SeqId};

/// The tiny model of every architecture.
pub fn tinies() -> Vec<Arc<Model>> {
    tandem_engine::Arch::ALL
        .iter()
        .map(|&a| ModelSource::Tiny(a).load().expect("tiny model"))
        .collect()
}

/// An engine over `model`: two threads, a 4 MiB pool, prompts in chunks of `chunk` tokens.
pub fn engine_in(model: &Arc<Model>, chunk: usize, kv_dtype: KvDtype) -> Engine {
    Engine::new(
        model.clone(),
        EngineConfig {
            threads: 2,
            kv_budget_bytes: 4 << 20,
            prefill_chunk_tokens: chunk,
            kv_dtype,
            ..EngineConfig::default()
        },
    )
    .expect("engine")
}

/// Both KV dtypes: the properties hold for each.
pub const DTYPES: [KvDtype; 2] = [KvDtype::F16, KvDtype::Q8];

/// Greedy (or seeded) decode of `steps` tokens by hand, ignoring end-of-generation ids so every
/// step is compared.
pub fn decode(
    engine: &mut Engine,
    seq: SeqId,
    mut logits: Vec<f32>,
    steps: usize,
    p: &SamplingParams,
) -> Vec<u32> {
    let mut out = Vec::new();
    for _ in 0..steps {
        let pos = engine.seq_len(seq).expect("len");
        let tok = tandem_engine::sample(&logits, p, pos as u64, &Default::default(), &[]);
        out.push(tok);
        logits = engine.step(&[(seq, tok)]).expect("step").row(0).to_vec();
    }
    out
}
