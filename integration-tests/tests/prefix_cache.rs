//! Multi-turn conversations through a cluster with prefix and session caches: several sessions
//! interleaved, sharing a system prompt, each turn appending the reply and a new message. Every
//! turn's greedy output equals a cold run on a cluster with every cache off, follow-ups reuse
//! their history (and say where), and a conversation stays on the decode node that holds it.

use std::sync::Arc;

use tandem_engine::Model;
use tandem_integration_tests::{
    Cluster, ClusterConfig, Collected, collect, qwen_model, smollm2_model,
};
use tandem_proto::v1 as pb;

const SESSIONS: usize = 3;
const TURNS: usize = 4;

/// A turn's request: the history so far plus a new message, for a session.
fn request(tokens: Vec<u32>, session: usize, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        session_id: format!("session-{session}"),
        token_ids: tokens,
        sampling: Some(pb::SamplingParams {
            max_tokens,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn message(session: usize, turn: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| 5 + ((session * 97 + turn * 31 + i * 7) % 200) as u32)
        .collect()
}

/// Runs the conversations on `cluster`, turns of different sessions interleaved; returns every
/// turn's result, `[turn][session]`.
async fn converse(cluster: &Cluster, system: &[u32], max_tokens: u32) -> Vec<Vec<Collected>> {
    let mut client = cluster.client();
    let mut history: Vec<Vec<u32>> = vec![system.to_vec(); SESSIONS];
    let mut out = Vec::new();
    for turn in 0..TURNS {
        let mut row = Vec::new();
        for (s, h) in history.iter_mut().enumerate() {
            h.extend(message(s, turn, 9 + 5 * s + 3 * turn));
            let got = collect(&mut client, request(h.clone(), s, max_tokens))
                .await
                .expect("turn");
            h.extend(&got.token_ids);
            row.push(got);
        }
        out.push(row);
    }
    out
}

async fn check(model: Arc<Model>, system_len: usize, max_tokens: u32) {
    let system: Vec<u32> = (0..system_len as u32).map(|i| 3 + (i * 11) % 250).collect();
    let cold = Cluster::start(ClusterConfig {
        prefix_cache: false,
        ..ClusterConfig::new(model.clone())
    })
    .await
    .expect("cold cluster");
    let expected = converse(&cold, &system, max_tokens).await;
    cold.stop().await.expect("stop");

    let warm = Cluster::start(ClusterConfig {
        prefill: 2,
        decode: 2,
        ..ClusterConfig::new(model)
    })
    .await
    .expect("warm cluster");
    let got = converse(&warm, &system, max_tokens).await;

    let mut indexed = 0;
    for (turn, want_row) in expected.iter().enumerate() {
        for (s, want) in want_row.iter().enumerate() {
            let this = &got[turn][s];
            assert_eq!(this.token_ids, want.token_ids, "turn {turn}, session {s}");
            let usage = this.last.usage.expect("usage");
            let route = this.last.route.clone().expect("route");
            assert_eq!(
                usage.cached_tokens,
                usage.decode_cached_tokens + usage.prefill_cached_tokens
            );
            if turn == 0 {
                continue;
            }
            // The decode node holds the previous turn's prompt and reply in full blocks: every
            // token fed to the model, so not the last one sampled (an end-of-generation id,
            // which is not output, or the last output token when max_tokens ended it).
            let prev = &got[turn - 1][s];
            let unfed = usize::from(prev.last.finish_reason == pb::FinishReason::Length as i32);
            let fed = prev.last.prompt_token_ids.len() + prev.token_ids.len() - unfed;
            let held = fed / 16 * 16;
            let prev_route = prev.last.route.as_ref().expect("route");
            assert_eq!(
                route.decode, prev_route.decode,
                "turn {turn}, session {s} left its decode node: {} (the turn before: {})",
                route.reason, prev_route.reason
            );
            assert_eq!(
                usage.decode_cached_tokens as usize, held,
                "turn {turn}, session {s}: {usage:?}"
            );
            if route.decode_overlap_tokens > 0 {
                indexed += 1;
            }
        }
    }
    let follow_ups = SESSIONS * (TURNS - 1);
    assert!(
        indexed * 10 >= follow_ups * 8,
        "the router's index knew the history of only {indexed} of {follow_ups} follow-ups"
    );
    warm.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_multi_turn_equals_cold_and_reuses_history() {
    let model = tandem_engine::ModelSource::TINY.load().expect("tiny");
    check(model, 40, 12).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_multi_turn_equals_cold_and_reuses_history() {
    let model = smollm2_model().expect("SmolLM2 (run `tandem model fetch smollm2`)");
    check(model, 48, 10).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen_multi_turn_equals_cold_and_reuses_history() {
    let model = qwen_model().expect("the 0.5B Qwen (tandem model fetch qwen2.5-coder-0.5b)");
    check(model, 48, 8).await;
}
