//! Slow is not dead. A decode node busy with long local prefills stays silent far longer than
//! the router's token gap, yet every stream on it completes on its first attempt with exactly
//! the tokens the engine gives each request alone, and requests that arrive while it is busy
//! are admitted there too, even though it is the only decode replica. And a prompt that waits in
//! a busy prefill node's queue far longer than the decode node's bound on KV silence is not
//! taken for a dead push.

use std::sync::Arc;
use std::time::Duration;

use tandem_engine::{Engine, EngineConfig, GenerateParams, GenerateRequest, Model};
use tandem_integration_tests::{
    Cluster, ClusterConfig, Collected, collect, greedy, metrics, sample, smollm2_model,
};

/// What the engine generates for each `(prompt, max_tokens)` greedily, alone.
fn alone(model: &Arc<Model>, prompts: &[(Vec<u32>, u32)]) -> Vec<Vec<u32>> {
    prompts
        .iter()
        .map(|(prompt, max_tokens)| {
            let mut engine = Engine::new(model.clone(), EngineConfig::default()).expect("engine");
            engine
                .generate_batch(&[GenerateRequest {
                    prompt: prompt.clone(),
                    params: GenerateParams {
                        max_tokens: *max_tokens as usize,
                        ..GenerateParams::default()
                    },
                }])
                .expect("alone")[0]
                .token_ids
                .clone()
        })
        .collect()
}

/// Sends every `(prompt, max_tokens)` greedily at once; their outcomes, in order.
async fn all_at_once(
    cluster: &Cluster,
    prompts: &[(Vec<u32>, u32)],
) -> Vec<Result<Collected, tonic::Status>> {
    let streams = prompts.iter().map(|(prompt, max_tokens)| {
        let mut client = cluster.client();
        let request = greedy(prompt.clone(), *max_tokens);
        async move { collect(&mut client, request).await }
    });
    futures::future::join_all(streams).await
}

/// `n` distinct prompts of `len` token ids, in the vocabulary's ordinary range.
fn long_prompts(n: u32, len: u32) -> Vec<Vec<u32>> {
    (1..=n)
        .map(|seed| {
            (0..len)
                .map(|i| 200 + (i * 7_919 + seed * 104_729) % 40_000)
                .collect()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_decode_node_keeps_its_streams_and_admits_new_ones() {
    let model = smollm2_model().expect("SmolLM2 (run `tandem model fetch smollm2`)");
    // Short chats, and two prompts of 1,200 tokens that the decode node prefills itself (there is
    // no prefill node): each holds its one engine thread for far longer than the 50 ms gap.
    let mut prompts: Vec<(Vec<u32>, u32)> = [
        "The capital of France is",
        "Once upon a time,",
        "def fibonacci(n):",
        "1, 2, 3, 4,",
    ]
    .iter()
    .map(|t| (model.tokenizer.encode(t).expect("encode"), 32))
    .collect();
    prompts.extend(long_prompts(2, 1_200).into_iter().map(|p| (p, 8)));
    let expected = alone(&model, &prompts);

    let cluster = Cluster::start(ClusterConfig {
        prefill: 0,
        token_gap: Duration::from_millis(50),
        ..ClusterConfig::new(model)
    })
    .await
    .expect("cluster");
    let outs = all_at_once(&cluster, &prompts).await;
    for (i, (out, want)) in outs.into_iter().zip(&expected).enumerate() {
        let out = out.unwrap_or_else(|s| panic!("stream {i} failed on a busy node: {s:?}"));
        assert_eq!(&out.token_ids, want, "stream {i}");
        let route = out.last.route.expect("route");
        assert_eq!(route.attempts, 1, "stream {i} was failed over: {route:?}");
    }
    // The node was silent past the gap (so the check above saw a busy node, not an idle one).
    let text = metrics(cluster.router.addr).await.expect("router metrics");
    let stalls = sample(&text, "tandem_router_decode_stalls_total").expect("stall counter");
    assert!(
        stalls >= 1.0,
        "no stream waited past the token gap:\n{text}"
    );
    assert_eq!(
        sample(&text, "tandem_router_failovers_total{hop=\"decode\"}"),
        Some(0.0)
    );

    // The node is still the cluster's decode replica: a new request is served there.
    let again = collect(&mut cluster.client(), greedy(prompts[0].0.clone(), 32))
        .await
        .expect("a request after the busy spell");
    assert_eq!(again.token_ids, expected[0]);
    cluster.until_decode_idle(0).await.expect("idle");
    cluster.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_queued_on_a_busy_prefill_node_outwaits_the_kv_silence_bound() {
    let model = smollm2_model().expect("SmolLM2 (run `tandem model fetch smollm2`)");
    // Every prompt is prefilled remotely, one at a time: the last of four waits behind three
    // prompts of 800 tokens, seconds on one thread, while the decode node tolerates 1 s of KV
    // silence. The pushes' keepalives come every 100 ms.
    let prompts: Vec<(Vec<u32>, u32)> = long_prompts(4, 800).into_iter().map(|p| (p, 4)).collect();
    let expected = alone(&model, &prompts);
    let kv_wait = Duration::from_secs(1);
    let base = ClusterConfig::new(model);
    let cluster = Cluster::start(ClusterConfig {
        policy: tandem_router::PolicyKind::RoundRobin,
        kv_wait,
        keepalive: Duration::from_millis(100),
        // Room for every prompt's KV on the decode node at once.
        engine: EngineConfig {
            kv_budget_bytes: 256 << 20,
            ..base.engine.clone()
        },
        ..base
    })
    .await
    .expect("cluster");
    let outs = all_at_once(&cluster, &prompts).await;
    let mut longest_wait = 0.0f64;
    for (i, (out, want)) in outs.into_iter().zip(&expected).enumerate() {
        let out = out.unwrap_or_else(|s| panic!("stream {i} failed behind the queue: {s:?}"));
        assert_eq!(&out.token_ids, want, "stream {i}");
        let route = out.last.route.expect("route");
        assert_eq!(route.attempts, 1, "stream {i} was failed over: {route:?}");
        assert_eq!(route.disaggregation, "remote", "stream {i}");
        // The first token's wait, less its own prompt's compute: the prefill queue's share.
        let t = out.last.timings.expect("timings");
        longest_wait = longest_wait.max(t.first_token_ms - t.prefill_ms);
    }
    // Some prompt did wait longer than the bound (else the check above proves nothing).
    assert!(
        longest_wait > kv_wait.as_secs_f64() * 1e3,
        "the longest wait was {longest_wait:.0} ms: no prompt outwaited the bound"
    );
    cluster.until_decode_idle(0).await.expect("idle");
    cluster.stop().await.expect("stop");
}
