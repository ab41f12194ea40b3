//! What prefill and decode nodes (and the CLI's client) share, in one place: conversions
//! between the engine's types and the wire's ([`wire_layout`], [`params_from_pb`],
//! [`params_to_pb`], [`kv_chunks`], [`kv_export`]), a model's block hashes, `Worker.Info`, the
//! cache-event hub ([`CacheHub`]) and the `Worker` service ([`WorkerService`]), the KV that moves
//! between workers of a role ([`moves`]: peer fetch, the drain's offer, adoption), and the
//! measured prefill throughput ([`Throughput`]); and the scaffold both nodes start and serve on
//! ([`Node`], [`NodeConfig`], [`NodeError`]).

mod cache;
mod error;
pub mod moves;
mod node;
mod service;

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use tandem_engine::{
    GenerateParams, Grammar, KvExport, KvLayout, Model, SamplingParams, TokenLogprobs,
};
use tandem_proto::v1 as pb;
use tandem_transfer::{Chunk, KvKind, ReceivedKv, WireLayout};

pub use cache::{CacheHub, EventStream};
pub use error::{Error, logged, node_failure};
pub use moves::KvMoves;
pub use node::{
    DEFAULT_DRAIN_HANDOFF, DEFAULT_DRAIN_HANDOFF_BYTES, DEFAULT_GRACE, Node, NodeConfig, NodeError,
    Serving, kv_budget_bytes,
};
pub use service::{LoadSource, WorkerService};
/// `tokens` cut at multiples of `grid`: the pieces in which a push sends them.
pub use tandem_engine::grid_cells;

/// The wire's description of an engine's KV (`Engine::kv_layout`).
pub fn wire_layout(l: KvLayout) -> WireLayout {
    WireLayout {
        layers: l.n_layers as u32,
        kv_heads: l.n_kv_heads as u32,
        head_dim: l.head_dim as u32,
        block_tokens: tandem_engine::BLOCK_TOKENS as u32,
        dtype: match l.dtype {
            _ if l.header_only => tandem_transfer::KvDtype::None,
            tandem_engine::KvDtype::F16 => tandem_transfer::KvDtype::F16,
            tandem_engine::KvDtype::Q8 => tandem_transfer::KvDtype::Q8,
        },
    }
}

/// The engine's sampling from the wire's. The logit biases come out sorted by id, as the
/// engine wants them.
fn sampling_from_pb(s: &pb::SamplingParams) -> SamplingParams {
    let mut logit_bias: Vec<(u32, f32)> = s.logit_bias.iter().map(|(&t, &b)| (t, b)).collect();
    logit_bias.sort_unstable_by_key(|&(t, _)| t);
    SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as usize,
        top_p: s.top_p.unwrap_or(1.0),
        seed: s.seed,
        frequency_penalty: s.frequency_penalty.unwrap_or(0.0),
        presence_penalty: s.presence_penalty.unwrap_or(0.0),
        repetition_penalty: s.repetition_penalty.unwrap_or(1.0),
        min_p: s.min_p.unwrap_or(0.0),
        logit_bias,
    }
}

/// The wire's sampling message for a generation.
pub fn params_to_pb(p: &GenerateParams) -> pb::SamplingParams {
    let s = &p.sampling;
    pb::SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as u32,
        top_p: Some(s.top_p),
        seed: s.seed,
        max_tokens: p.max_tokens as u32,
        stop: p.stop.clone(),
        frequency_penalty: Some(s.frequency_penalty),
        presence_penalty: Some(s.presence_penalty),
        repetition_penalty: Some(s.repetition_penalty),
        min_p: Some(s.min_p),
        logit_bias: s.logit_bias.iter().copied().collect(),
        ignore_eos: p.ignore_eos,
        min_tokens: p.min_tokens as u32,
        stop_token_ids: p.stop_token_ids.clone(),
        logprobs: p.logprobs.map(|k| k as u32),
        grammar: p.grammar.as_ref().map(grammar_to_pb),
    }
}

/// The engine's generation parameters from the wire's sampling message (an absent message is
/// the default: greedy), within the bounds every Tandem process applies
/// ([`tandem_proto::policy::check_sampling`]).
pub fn params_from_pb(s: Option<pb::SamplingParams>) -> tandem_engine::Result<GenerateParams> {
    let s = s.unwrap_or_default();
    tandem_proto::policy::check_sampling(&s)
        .map_err(|(field, reason)| tandem_engine::Error::InvalidArgument { field, reason })?;
    let sampling = sampling_from_pb(&s);
    Ok(GenerateParams {
        sampling,
        max_tokens: s.max_tokens as usize,
        stop: s.stop,
        stop_token_ids: s.stop_token_ids,
        ignore_eos: s.ignore_eos,
        min_tokens: s.min_tokens as usize,
        logprobs: s.logprobs.map(|k| k as usize),
        grammar: s.grammar.and_then(|g| g.kind).map(grammar_from_pb),
    })
}

fn grammar_to_pb(g: &Grammar) -> pb::Grammar {
    use pb::grammar::Kind;
    pb::Grammar {
        kind: Some(match g {
            Grammar::JsonSchema(s) => Kind::JsonSchema(s.clone()),
            Grammar::JsonObject => Kind::JsonObject(true),
            Grammar::Regex(r) => Kind::Regex(r.clone()),
            Grammar::Lark(l) => Kind::Lark(l.clone()),
            Grammar::ToolCalls(l) => Kind::ToolCalls(l.clone()),
        }),
    }
}

fn grammar_from_pb(k: pb::grammar::Kind) -> Grammar {
    use pb::grammar::Kind;
    match k {
        Kind::JsonSchema(s) => Grammar::JsonSchema(s),
        Kind::JsonObject(_) => Grammar::JsonObject,
        Kind::Regex(r) => Grammar::Regex(r),
        Kind::Lark(l) => Grammar::Lark(l),
        Kind::ToolCalls(l) => Grammar::ToolCalls(l),
    }
}

/// A token's log-probabilities on the wire.
pub fn logprobs_to_pb(l: &TokenLogprobs) -> pb::TokenLogprobs {
    pb::TokenLogprobs {
        logprob: l.logprob,
        top_ids: l.top.iter().map(|t| t.0).collect(),
        top_logprobs: l.top.iter().map(|t| t.1).collect(),
    }
}

/// A token's log-probabilities from the wire (alternatives past the shorter list are dropped).
pub fn logprobs_from_pb(l: &pb::TokenLogprobs) -> TokenLogprobs {
    TokenLogprobs {
        logprob: l.logprob,
        top: l
            .top_ids
            .iter()
            .copied()
            .zip(l.top_logprobs.iter().copied())
            .collect(),
    }
}

/// What a worker says about its model and KV (`Worker.Info`).
pub fn worker_info(model: &Model, kv: KvLayout, role: &str) -> pb::InfoResponse {
    pb::InfoResponse {
        model_name: model.name.clone(),
        model_fingerprint: model.fingerprint.0.to_vec().into(),
        context_tokens: model.config.context_len as u32,
        block_tokens: tandem_engine::BLOCK_TOKENS as u32,
        tokenizer_spec_json: serde_json::to_string(&model.tokenizer.spec()).unwrap_or_default(),
        role: role.to_string(),
        kv_dtype: if kv.header_only {
            "none".into()
        } else {
            kv.dtype.name().into()
        },
        kv_bytes_per_token: wire_layout(kv).total_bytes(1),
        model_aliases: model.aliases.clone(),
    }
}

/// The block hashes (`tandem_proto::block_hash`) of `tokens`' full blocks under `model`, in the
/// cache partition `salt`.
pub fn block_hashes(model: &Model, salt: &str, tokens: &[u32]) -> Vec<u64> {
    tandem_proto::block_hash::block_hashes(&model.fingerprint.0, salt, tokens)
        .into_iter()
        .map(|h| h.0)
        .collect()
}

/// One exported token range as wire chunks: per layer, K then V.
pub fn kv_chunks(kv: KvExport) -> impl Iterator<Item = Chunk> {
    let tokens = kv.tokens;
    (kv.layers.into_iter().enumerate())
        .flat_map(move |(layer, kv)| layer_chunks(layer, tokens.clone(), kv))
}

/// One layer's K and V of a token range as wire chunks, K first.
pub fn layer_chunks(layer: usize, tokens: Range<usize>, [k, v]: [Vec<u8>; 2]) -> [Chunk; 2] {
    [(KvKind::K, k), (KvKind::V, v)].map(|(kind, data)| Chunk {
        layer: layer as u32,
        kind,
        tokens: tokens.start as u32..tokens.end as u32,
        data: Bytes::from(data),
    })
}

/// How many chunks [`kv_chunks`] makes for `tokens` cut at multiples of `grid` tokens.
pub fn chunk_count(layout: &WireLayout, tokens: Range<usize>, grid: usize) -> u32 {
    (grid_cells(tokens, grid).count() * layout.layers as usize * 2) as u32
}

/// A verified transfer as the receiving engine, whose KV is `layout`, imports it.
pub fn kv_export(layout: KvLayout, received: ReceivedKv) -> KvExport {
    KvExport {
        layout,
        tokens: received.tokens.start as usize..received.tokens.end as usize,
        layers: received.layers,
    }
}

/// A worker's measured prompt throughput (tokens per second of compute), smoothed; read by
/// `Worker.Load`, which the router's policy uses.
#[derive(Debug, Default)]
pub struct Throughput(AtomicU64);

impl Throughput {
    /// Folds in one measurement (weight 1/4, so a few prompts settle it).
    pub fn record(&self, tokens: usize, seconds: f64) {
        if tokens == 0 || seconds <= 0.0 {
            return;
        }
        let sample = tokens as f64 / seconds;
        let old = self.get();
        let new = if old == 0.0 {
            sample
        } else {
            old * 0.75 + sample * 0.25
        };
        self.0.store(new.to_bits(), Ordering::Relaxed);
    }

    /// Tokens per second; 0 until measured.
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engine's own validation refuses exactly what the wire's bounds do: for values at
    /// and just past each bound, both accept or both refuse.
    #[test]
    fn the_engines_sampling_validation_is_the_wires() {
        type Edit = fn(&mut pb::SamplingParams, f32);
        let fields: [(Edit, &[f32]); 7] = [
            (
                |s, v| s.temperature = v,
                &[-0.01, 0.0, 2.5, f32::MAX, f32::INFINITY, f32::NAN],
            ),
            (
                |s, v| s.top_p = Some(v),
                &[-0.1, 0.0, 1e-6, 1.0, 1.001, f32::NAN],
            ),
            (|s, v| s.min_p = Some(v), &[-0.01, 0.0, 1.0, 1.01, f32::NAN]),
            (
                |s, v| s.frequency_penalty = Some(v),
                &[-2.01, -2.0, 2.0, 2.01],
            ),
            (
                |s, v| s.presence_penalty = Some(v),
                &[-2.01, -2.0, 2.0, 2.01, f32::NAN],
            ),
            (
                |s, v| s.repetition_penalty = Some(v),
                &[0.0, 0.01, 10.0, 10.01, f32::NAN],
            ),
            (
                |s, v| s.logit_bias = [(3, v)].into(),
                &[-100.01, -100.0, 100.0, 100.01],
            ),
        ];
        for (i, (edit, values)) in fields.iter().enumerate() {
            for &v in *values {
                let mut s = pb::SamplingParams::default();
                edit(&mut s, v);
                let wire = tandem_proto::policy::check_sampling(&s).is_ok();
                let engine = sampling_from_pb(&s).validate().is_ok();
                assert_eq!(wire, engine, "field {i}, value {v}");
            }
        }
    }

    #[test]
    fn grid_cells_cut_at_multiples() {
        let cells: Vec<_> = grid_cells(16..600, 256).collect();
        assert_eq!(cells, vec![16..256, 256..512, 512..600]);
        assert_eq!(grid_cells(5..5, 256).count(), 0);
        assert_eq!(grid_cells(0..256, 256).collect::<Vec<_>>(), vec![0..256]);
    }

    /// The wire's sizes are the engine's: an export of each dtype is exactly the bytes the
    /// wire layout announces for it.
    #[test]
    fn wire_sizes_match_the_engines_export() {
        let model = tandem_engine::ModelSource::TINY.load().expect("tiny model");
        for dtype in [tandem_engine::KvDtype::F16, tandem_engine::KvDtype::Q8] {
            let config = tandem_engine::EngineConfig {
                kv_dtype: dtype,
                ..Default::default()
            };
            let mut engine = tandem_engine::Engine::new(model.clone(), config).expect("engine");
            let seq = engine.new_sequence();
            engine.prefill(seq, &[5, 6, 7, 8, 9]).expect("prefill");
            let layout = wire_layout(engine.kv_layout());
            let sent: usize = kv_chunks(engine.export_kv(seq, 1..5).expect("export"))
                .map(|c| c.data.len())
                .sum();
            assert_eq!(sent as u64, layout.total_bytes(4), "{dtype:?}");
            assert_eq!(
                layout.total_bytes(1),
                engine.kv_layout().token_bytes() as u64,
                "{dtype:?}"
            );
        }
    }
}
