//! Slow is not dead: a decode node busy with long local prefills stays silent far longer than
//! the router's token gap, yet every stream on it completes on its first attempt with exactly
//! the tokens the engine gives each request alone, and requests that arrive while it is busy
//! are admitted there too, even though it is the only decode replica.

use std::time::Duration;

use tandem_engine::{Engine, EngineConfig, GenerateParams, GenerateRequest};
use tandem_integration_tests::{
    Cluster, ClusterConfig, collect, default_model, greedy, metrics, sample,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_decode_node_keeps_its_streams_and_admits_new_ones() {
    let model = default_model().expect("the default model (run `tandem model fetch`)");
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
    for seed in [1u32, 2] {
        let long = (0..1_200u32)
            .map(|i| 200 + (i * 7_919 + seed * 104_729) % 40_000)
            .collect();
        prompts.push((long, 8));
    }
    let expected: Vec<Vec<u32>> = prompts
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
        .collect();

    let cluster = Cluster::start(ClusterConfig {
        prefill: 0,
        token_gap: Duration::from_millis(50),
        ..ClusterConfig::new(model)
    })
    .await
    .expect("cluster");
    let streams = prompts.iter().map(|(prompt, max_tokens)| {
        let mut client = cluster.client();
        let request = greedy(prompt.clone(), *max_tokens);
        async move { collect(&mut client, request).await }
    });
    let outs = futures::future::join_all(streams).await;
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
