//! The decode pool bounds a request, never its wait: a request whose prompt plus max_tokens is
//! more than a decode node's KV pool can ever hold (Claude Code asks for 32,000 tokens on every
//! turn) is served to the pool's end with finish reason `length`, as llama-server stops at its
//! context's end; a prompt that leaves the pool no room to generate is refused at once; and a
//! request queued behind a full pool ends at its deadline (the client's, else the router's)
//! with DEADLINE_EXCEEDED naming the router's queue. Through gRPC and the HTTP APIs, one
//! request and several at once.

use std::time::{Duration, Instant};

use tandem_integration_tests::{
    Cluster, ClusterConfig, collect, greedy, http_model, metrics, post_json, sample, smollm2_model,
};
use tandem_proto::v1 as pb;
use tonic::Code;

/// `prompt` token ids and `max_tokens`, greedy, with no end-of-generation: the reply runs to
/// its max_tokens or the pool's end.
fn unstoppable(prompt: usize, max_tokens: u32) -> pb::GenerateRequest {
    let mut r = greedy(ids(prompt), max_tokens);
    let sampling = r.sampling.as_mut().expect("sampling");
    sampling.ignore_eos = true;
    sampling.stop.clear();
    r
}

/// `n` token ids within every model's vocabulary (the tiny model's has 259).
fn ids(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 100 + i % 150).collect()
}

/// `r` with a deadline `t` away.
fn within(r: pb::GenerateRequest, t: Duration) -> tonic::Request<pb::GenerateRequest> {
    let mut r = tonic::Request::new(r);
    r.set_timeout(t);
    r
}

/// A cluster of `config` whose decode pool holds `pool_tokens` tokens.
async fn with_pool(config: ClusterConfig, pool_tokens: usize) -> Cluster {
    let layout = config.model.config.kv_layout(config.engine.kv_dtype);
    let cluster = Cluster::start(ClusterConfig {
        engine: tandem_engine::EngineConfig {
            kv_budget_bytes: pool_tokens * layout.token_bytes(),
            ..config.engine.clone()
        },
        ..config
    })
    .await
    .expect("cluster");
    let load = cluster.decode_load(0).await.expect("load");
    assert_eq!(
        load.kv_blocks_total as usize * tandem_engine::BLOCK_TOKENS,
        pool_tokens
    );
    cluster
}

async fn counter(addr: std::net::SocketAddr, name: &str) -> Option<f64> {
    sample(&metrics(addr).await.expect("metrics"), name)
}

/// The tiny model (a context of 1,024) on a decode pool of 512 tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_longer_than_the_pool_is_served_to_the_pools_end() {
    const POOL: usize = 512;
    let model = tandem_engine::ModelSource::TINY.load().expect("tiny");
    let cluster = with_pool(ClusterConfig::new(model), POOL).await;
    let deadline = |r| within(r, Duration::from_secs(60));

    // 40 + 900 fits the context but not the pool: served to the pool's end, exactly the tokens
    // of the same request asking for what fits.
    let long = collect(&mut cluster.client(), deadline(unstoppable(40, 900)))
        .await
        .expect("served");
    assert_eq!(long.last.finish_reason, pb::FinishReason::Length as i32);
    assert_eq!(long.token_ids.len(), POOL - 40);
    let usage = long.last.usage.expect("usage");
    assert_eq!(usage.completion_tokens as usize, POOL - 40);
    let fits = collect(
        &mut cluster.client(),
        deadline(unstoppable(40, (POOL - 40) as u32)),
    )
    .await
    .expect("served");
    assert_eq!(long.token_ids, fits.token_ids);

    // Several at once: each takes the whole pool, so they run one after another; none waits
    // for what never comes.
    let several = (0..3).map(|_| {
        let mut client = cluster.client();
        tokio::spawn(async move { collect(&mut client, deadline(unstoppable(40, 900))).await })
    });
    for r in futures::future::join_all(several).await {
        let got = r.expect("task").expect("served");
        assert_eq!(got.token_ids, fits.token_ids);
    }

    // The HTTP APIs: OpenAI's completions with an explicit max_tokens past the pool, and
    // Anthropic's Messages with Claude Code's 32,000 (a ceiling, held to the context first).
    let http = reqwest::Client::new();
    let base = format!("http://{}/v1", cluster.http);
    let model = http_model(&http, &base).await.expect("model");
    let prompt = ids(40);
    let body = serde_json::json!({
        "model": model, "prompt": prompt, "max_tokens": 900, "temperature": 0, "ignore_eos": true,
    });
    let reply = post_json(&http, &format!("{base}/completions"), &body)
        .await
        .expect("http");
    assert_eq!(reply["choices"][0]["finish_reason"], "length", "{reply}");
    assert_eq!(reply["usage"]["completion_tokens"], POOL - 40, "{reply}");
    let r = http
        .post(format!("{base}/messages"))
        .json(&serde_json::json!({
            "model": model, "max_tokens": 32000, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hi."}],
        }))
        .send()
        .await
        .expect("http");
    assert_eq!(r.status(), 200);
    let reply: serde_json::Value = r.json().await.expect("json");
    let used = reply["usage"]["input_tokens"].as_u64().expect("input")
        + reply["usage"]["output_tokens"].as_u64().expect("output");
    match reply["stop_reason"].as_str() {
        Some("max_tokens") => assert_eq!(used as usize, POOL, "{reply}"),
        Some("end_turn") => assert!((used as usize) < POOL, "{reply}"),
        _ => panic!("{reply}"),
    }
    // Every one of those six was cut, and counted once, however often it was refused for want
    // of room while another held the pool.
    let cut = counter(cluster.decode[0].addr, "tandem_decode_max_tokens_cut_total").await;
    assert_eq!(cut, Some(6.0));

    // A prompt that leaves no room to generate is refused at once, naming the pool.
    for (what, r) in [
        ("a prompt as long as the pool", unstoppable(POOL, 8)),
        ("a batch prompt past the batch share (75%)", {
            let mut r = unstoppable(POOL * 3 / 4, 8);
            r.priority = "batch".into();
            r
        }),
    ] {
        let started = Instant::now();
        let e = collect(&mut cluster.client(), r).await.expect_err(what);
        assert_eq!(e.code(), Code::InvalidArgument, "{what}: {e:?}");
        assert!(e.message().contains("tokens of KV"), "{what}: {e:?}");
        assert!(started.elapsed() < Duration::from_secs(2), "{what}");
    }
    let r = http
        .post(format!("{base}/completions"))
        .json(&serde_json::json!({"model": model, "prompt": ids(POOL), "max_tokens": 8}))
        .send()
        .await
        .expect("http");
    assert_eq!(r.status(), 400);
    cluster.stop().await.expect("stop");
}

/// SmolLM2 (slow enough to hold the pool for seconds) on a decode pool of 2,048 tokens, which
/// one long generation takes whole until its client goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_queued_behind_a_full_pool_end_at_their_deadline() {
    const POOL: usize = 2048;
    let model = smollm2_model().expect("SmolLM2 (run `tandem model fetch smollm2`)");
    let timeout = Duration::from_millis(1500);
    let config = ClusterConfig {
        timeout,
        ..ClusterConfig::new(model)
    };
    let cluster = with_pool(config, POOL).await;
    let mut client = cluster.client();
    let mut holder = client
        .generate(within(unstoppable(64, 4000), Duration::from_secs(120)))
        .await
        .expect("the holder starts")
        .into_inner();
    holder
        .message()
        .await
        .expect("frame")
        .expect("a first frame");

    // Behind it, requests that fit an empty pool wait in the router's queue, each until its own
    // deadline or the router's bound, and end there, naming the queue.
    let small = |k: u32| greedy(vec![2000 + k, 2001, 2002], 8);
    let started = Instant::now();
    let mut waiting: Vec<_> = (0..3)
        .map(|k| {
            let mut client = cluster.client();
            let r = within(small(k), Duration::from_secs(1));
            tokio::spawn(async move { (collect(&mut client, r).await, Duration::from_secs(1)) })
        })
        .collect();
    waiting.push({
        let mut client = cluster.client();
        tokio::spawn(async move { (collect(&mut client, small(3)).await, timeout) })
    });
    // One with time enough is served once the holder is done.
    let patient = {
        let mut client = cluster.client();
        let r = within(small(4), Duration::from_secs(120));
        tokio::spawn(async move { collect(&mut client, r).await })
    };
    let http = reqwest::Client::new();
    let base = format!("http://{}/v1", cluster.http);
    let model = http_model(&http, &base).await.expect("model");
    let r = http
        .post(format!("{base}/completions"))
        .header("x-timeout-ms", "1000")
        .json(&serde_json::json!({"model": model, "prompt": [2005, 2006], "max_tokens": 8}))
        .send()
        .await
        .expect("http");
    assert_eq!(r.status(), 504);
    let e: serde_json::Value = r.json().await.expect("an error object");
    let message = e["error"]["message"].as_str().expect("message");
    assert!(message.contains("router's queue"), "{e}");
    for w in waiting {
        let (r, bound) = w.await.expect("task");
        let e = r.expect_err("past the deadline in the queue");
        assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
        assert!(e.message().contains("router's queue"), "{e:?}");
        assert!(started.elapsed() < bound + Duration::from_secs(1));
    }
    assert_eq!(
        counter(cluster.router.addr, "tandem_router_queue_timeouts_total").await,
        Some(5.0)
    );

    // The holder's client goes: its KV is freed, and the patient request is served.
    drop(holder);
    patient
        .await
        .expect("task")
        .expect("served after the holder");
    cluster.stop().await.expect("stop");
}

/// A decode node whose pool a running stream has reserved refuses the next request for room
/// (RESOURCE_EXHAUSTED), and the router tries another decode node at once: not the same full
/// node again at each change (it holds the session's history, and its load is under the cap)
/// until the stream ends. The simulated tiny model takes 10 ms a step, so the stream runs for
/// seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_a_full_decode_node_refuses_goes_to_another_at_once() {
    const POOL: usize = 512;
    let profile = tandem_engine::TimingProfile {
        model: "tiny".into(),
        cpu: "test".into(),
        threads: 1,
        passes: vec![(1, 0.010), (64, 0.020)],
        attend_s: 0.0,
    };
    let model = tandem_engine::ModelSource::TINY
        .load_simulated(profile)
        .expect("simulated tiny model");
    let config = ClusterConfig {
        decode: 2,
        ..ClusterConfig::new(model)
    };
    let cluster = with_pool(config, POOL).await;
    let in_session = |tokens: Vec<u32>, max_tokens: u32| pb::GenerateRequest {
        session_id: "s".into(),
        ..greedy(tokens, max_tokens)
    };
    let history = ids(100);
    let first = collect(&mut cluster.client(), in_session(history.clone(), 4))
        .await
        .expect("first turn");
    let holder = first.last.route.expect("route").decode;

    // A stream on the history that reserves all but one block of the holder's pool.
    let mut client = cluster.client();
    let long = [history.clone(), (0..16).map(|i| 40 + i).collect()].concat();
    let stream = tokio::spawn(async move { collect(&mut client, in_session(long, 380)).await });
    let started = Instant::now();
    loop {
        let load = cluster.decode_load(0).await.expect("load");
        let other = cluster.decode_load(1).await.expect("load");
        if load.active + other.active > 0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the stream never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The next turn prefers the holder, which has no room for it.
    let next = [history, (0..200).map(|i| 60 + i % 100).collect()].concat();
    let turn = collect(&mut cluster.client(), in_session(next, 4))
        .await
        .expect("next turn");
    let route = turn.last.route.expect("route");
    assert!(!stream.is_finished(), "the stream still runs");
    assert_ne!(route.decode, holder, "{route:?}");
    let long = stream.await.expect("join").expect("the stream");
    assert_eq!(long.last.route.expect("route").decode, holder);
    cluster.stop().await.expect("stop");
}
