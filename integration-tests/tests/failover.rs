//! Failover: a decode node lost mid-stream (every connection to it cut, as when it dies or
//! its network goes) costs the client nothing. The router resumes the generation on another
//! decode node from the prompt plus the tokens already delivered, and the client sees one
//! stream with gap-free indices, equal token for token to the fault-free run of the same seed.
//! On the real models: the tiny one can finish 600 tokens before the test cuts into them. The
//! sampling uses every knob that reads the position or the tokens so far (min_tokens bans the
//! end-of-generation ids across the cut; min_p and logit biases shape each draw), and on Qwen
//! a run held to a grammar, with log-probabilities, which resume exactly too. A request's
//! choices (`n`) fail over each on its own, each exactly.

use std::time::{Duration, Instant};

use std::sync::Arc;

use tandem_engine::Model;
use tandem_integration_tests::{
    Cluster, ClusterConfig, Collected, collect, collect_choices, finish, open, qwen_model,
    smollm2_model,
};
use tandem_proto::v1 as pb;

/// 40 arbitrary tokens: SmolLM2 goes on and on after them.
fn arbitrary_prompt() -> Vec<u32> {
    (0..40).map(|i| 5 + (i * 29) % 250).collect()
}

fn seeded(prompt: Vec<u32>, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        token_ids: prompt,
        sampling: Some(pb::SamplingParams {
            max_tokens,
            temperature: 0.8,
            top_p: Some(0.95),
            seed: 42,
            min_p: Some(0.02),
            logit_bias: [(100, -5.0), (200, 1.5)].into(),
            min_tokens: 64,
            ..Default::default()
        }),
        ..Default::default()
    }
}

async fn cluster(model: Arc<Model>, prefill: usize, decode: usize) -> Cluster {
    let mut config = ClusterConfig::new(model);
    config.prefill = prefill;
    config.decode = decode;
    config.relays = true;
    Cluster::start(config).await.expect("cluster")
}

/// The decode node (by index) running a generation now.
async fn busy_decode(cluster: &Cluster) -> usize {
    let started = Instant::now();
    loop {
        for i in 0..cluster.decode.len() {
            if cluster.decode_load(i).await.expect("load").active > 0 {
                return i;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "no decode node is busy"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// A resumed stream says what the fault-free run said: the same tokens, text,
/// log-probabilities and finish reason.
fn assert_same_run(got: &Collected, want: &Collected) {
    assert_eq!(
        got.token_ids, want.token_ids,
        "the same tokens as the fault-free run"
    );
    assert_eq!(got.text, want.text, "the same text");
    assert_eq!(got.logprobs, want.logprobs, "the same log-probabilities");
    assert_eq!(got.last.finish_reason, want.last.finish_reason);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_node_lost_mid_stream_is_resumed_exactly_elsewhere() {
    let model = smollm2_model().expect("SmolLM2");
    lost_mid_stream_resumes_exactly(model, seeded(arbitrary_prompt(), 600)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qwen_stream_lost_mid_stream_is_resumed_exactly_elsewhere() {
    let model = qwen_model().expect("the 0.5B Qwen (tandem model fetch qwen2.5-coder-0.5b)");
    // An instruction model ends its reply soon after arbitrary tokens; a list it was asked for
    // runs past the cut.
    let text = model
        .tokenizer
        .apply_chat_template(
            &[tandem_engine::ChatMessage::new(
                "user",
                "Count from 1 to 100, one number per line.",
            )],
            &[],
        )
        .expect("template");
    let prompt = model.tokenizer.encode(&text).expect("encode");
    lost_mid_stream_resumes_exactly(model.clone(), seeded(prompt.clone(), 120)).await;

    // Held to a grammar, with log-probabilities: the resumed node replays the delivered tokens
    // into the grammar, and the frames carry the same log-probabilities.
    let mut constrained = seeded(prompt, 120);
    if let Some(s) = &mut constrained.sampling {
        s.grammar = Some(pb::Grammar {
            kind: Some(pb::grammar::Kind::Regex("([0-9]+\n)+".into())),
        });
        s.logprobs = Some(3);
    }
    lost_mid_stream_resumes_exactly(model, constrained).await;
}

async fn lost_mid_stream_resumes_exactly(model: Arc<Model>, request: pb::GenerateRequest) {
    let prompt = request.token_ids.clone();
    let cluster = cluster(model, 1, 2).await;
    let mut client = cluster.client();
    let want = collect(&mut client, request.clone())
        .await
        .expect("fault-free run");
    assert_eq!(want.last.route.as_ref().map(|r| r.attempts), Some(1));
    assert!(
        want.token_ids.len() >= 64,
        "min_tokens holds, and the run is long enough to cut into: {} tokens",
        want.token_ids.len()
    );

    let (frames, got) = open(&mut client, request, 8).await.expect("8 frames");
    let cut = busy_decode(&cluster).await;
    cluster.relays[cluster.prefill.len() + cut].cut();
    let got = finish(frames, got)
        .await
        .expect("no error reaches the client, and no gap");
    assert_same_run(&got, &want);
    let last = got.last;
    let usage = last.usage.expect("usage");
    assert_eq!(usage.completion_tokens as usize, want.token_ids.len());
    assert_eq!(usage.prompt_tokens as usize, prompt.len());
    let route = last.route.expect("route");
    assert_eq!(route.attempts, 2, "one failover: {route:?}");
    assert_eq!(route.failovers.len(), 1);
    let cut_addr = cluster.relays[cluster.prefill.len() + cut].addr.to_string();
    assert_ne!(
        route.decode, cut_addr,
        "the rest ran on the other decode node"
    );

    // The node that lost its client frees everything (C5), and once reachable again it takes
    // traffic again.
    cluster.until_decode_idle(cut).await.expect("no leak");
    cluster.relays[cluster.prefill.len() + cut].restore();
    cluster
        .wait_ready(Duration::from_secs(10))
        .await
        .expect("re-admitted");
    cluster.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_choice_of_a_request_is_resumed_exactly_on_its_own() {
    let cluster = cluster(smollm2_model().expect("SmolLM2"), 1, 2).await;
    let mut client = cluster.client();
    let request = pb::GenerateRequest {
        n: 2,
        ..seeded(arbitrary_prompt(), 300)
    };
    let want = collect_choices(&mut client, request.clone(), 2)
        .await
        .expect("fault-free run");
    assert_ne!(
        want[0].token_ids, want[1].token_ids,
        "two seeds, two replies"
    );

    let mut frames = client
        .generate(request)
        .await
        .expect("generate")
        .into_inner();
    let mut got = vec![Collected::default(); 2];
    let (mut open, mut cut) = (2, None);
    while let Some(f) = frames.message().await.expect("no error reaches the client") {
        let c = &mut got[f.choice as usize];
        assert_eq!(f.index as usize, c.frames, "choice {}: gap-free", f.choice);
        c.frames += 1;
        c.token_ids.extend(&f.token_ids);
        c.text.push_str(&f.text);
        // Both choices are under way: the second starts once the first's first frame is out.
        if cut.is_none() && got.iter().all(|c| c.frames >= 8) {
            let i = busy_decode(&cluster).await;
            cluster.relays[cluster.prefill.len() + i].cut();
            cut = Some(i);
        }
        if f.finish_reason != pb::FinishReason::Unspecified as i32 {
            let choice = f.choice as usize;
            got[choice].last = f;
            open -= 1;
            if open == 0 {
                break;
            }
        }
    }
    assert_eq!(open, 0, "every choice ends with its final frame");
    assert!(cut.is_some(), "the stream was cut");
    let mut failed_over = 0;
    for (i, (got, want)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            got.token_ids, want.token_ids,
            "choice {i}: the fault-free tokens"
        );
        assert_eq!(got.text, want.text, "choice {i}: the fault-free text");
        let route = got.last.route.as_ref().expect("route");
        failed_over += usize::from(route.attempts == 2);
    }
    assert!(failed_over >= 1, "a choice on the cut node failed over");
    cluster.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_decode_node_gone_the_request_fails_fast_with_unavailable() {
    let cluster = cluster(smollm2_model().expect("SmolLM2"), 1, 2).await;
    let mut client = cluster.client();
    let mut frames = client
        .generate(seeded(arbitrary_prompt(), 600))
        .await
        .expect("generate")
        .into_inner();
    let first = frames.message().await.expect("first frame");
    assert!(first.is_some());
    for i in 0..2 {
        cluster.relays[1 + i].cut();
    }
    let started = Instant::now();
    let outcome = loop {
        match frames.message().await {
            Ok(Some(f)) if f.finish_reason == pb::FinishReason::Unspecified as i32 => continue,
            other => break other,
        }
    };
    let status = outcome.expect_err("no decode node is left");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "failed in {:?}",
        started.elapsed()
    );
    let text = tandem_integration_tests::metrics(cluster.router.addr)
        .await
        .expect("metrics");
    let attempts = tandem_integration_tests::sample(&text, "tandem_router_dispatch_attempts_total")
        .expect("attempts counter");
    assert!(
        attempts <= 3.0,
        "attempts are bounded per request: {attempts}"
    );
    cluster.stop().await.expect("stop");
}

/// A rolling restart's drain: the decode node told to stop hands its running stream off (after
/// 40 frames). The
/// router resumes it on the other decode node, which fetches the KV of the prompt and of the
/// tokens generated so far from the draining node instead of computing it, and the client sees
/// one stream equal to the fault-free run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_decode_node_hands_its_stream_off_with_its_kv() {
    let model = smollm2_model().expect("SmolLM2");
    let mut config = ClusterConfig::new(model);
    config.decode = 2;
    let mut cluster = Cluster::start(config).await.expect("cluster");
    let mut client = cluster.client();
    let request = seeded(arbitrary_prompt(), 600);
    let want = collect(&mut client, request.clone())
        .await
        .expect("fault-free run");

    let (frames, got) = open(&mut client, request, 40).await.expect("40 frames");
    let node = cluster.decode.remove(busy_decode(&cluster).await);
    let drained = node.addr.to_string();
    let stopping = tokio::spawn(node.stop());
    let got = finish(frames, got)
        .await
        .expect("no error reaches the client, and no gap");
    assert_same_run(&got, &want);
    let last = got.last;
    let route = last.route.expect("route");
    assert_eq!(route.attempts, 2, "one hand-off: {route:?}");
    assert_ne!(route.decode, drained, "the rest ran on the other node");
    assert_eq!(route.fetched_from, drained, "{route:?}");
    // The drained node kept the whole blocks of what it held (the prompt's 40 tokens and at
    // least 39 of the 40 frames' tokens delivered: the last one's KV was not computed yet), and
    // all of that was fetched instead of computed. (Cut earlier, the prefill node's cached
    // prompt would make computing the few tokens past it as cheap as a fetch, and the formula
    // may rightly choose that.)
    assert!(
        route.fetched_tokens >= 64 && route.fetched_tokens % 16 == 0,
        "{route:?}"
    );
    let kept = format!("{} tokens of KV are kept", route.fetched_tokens);
    assert!(
        route.failovers[0].contains(&kept),
        "everything the drained node kept moved: {route:?}"
    );
    let text = tandem_integration_tests::metrics(cluster.decode[0].addr)
        .await
        .expect("metrics");
    let fetched = tandem_integration_tests::sample(&text, "tandem_decode_fetched_tokens_total");
    assert_eq!(fetched, Some(f64::from(route.fetched_tokens)));
    stopping
        .await
        .expect("the drained node's task")
        .expect("the drained node stops cleanly once its KV was fetched");
    cluster.stop().await.expect("stop");
}
