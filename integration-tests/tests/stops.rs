//! Stops and stalls that must lose no stream, through whole clusters (SmolLM2, whose streams
//! run long enough to be caught mid-way) and their OpenAI HTTP API, as an operator meets them:
//!
//! - a router stopped (SIGTERM) with HTTP streams in flight drains them: every stream
//!   completes exactly, and what arrives meanwhile is refused at once (HTTP 503 with
//!   `Retry-After`, gRPC UNAVAILABLE) rather than finding the port closed;
//! - every decode node stopped at once: each hands its streams off, no node outside a drain is
//!   left to take them, and the router sends each back to the node that holds its KV, which
//!   finishes it within its grace;
//! - a prefill node whose KV push meets a peer that accepts TCP and then says nothing (a
//!   stalled TLS handshake): the push fails within its bound, and the node's other work goes
//!   on.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tandem_integration_tests::{
    Cluster, ClusterConfig, SseStream, http_model, sample, smollm2_model,
};
use tandem_net::tls::{Role, Tls, write_dev_certs};
use tandem_proto::v1 as pb;
use tonic::Code;

const STREAMS: usize = 8;
const MAX_TOKENS: usize = 120;

/// Completion `i`: a story that runs to `MAX_TOKENS`, greedy.
fn completion(model: &str, i: usize, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": model,
        "prompt": format!("Story number {i}. Once upon a time, in a village by the sea,"),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": true,
        "stream": stream,
    })
}

/// Each completion's fault-free text, from the same cluster before the fault.
async fn answers(http: &reqwest::Client, base: &str, model: &str) -> Vec<String> {
    let mut out = Vec::new();
    for i in 0..STREAMS {
        let reply: serde_json::Value = http
            .post(format!("{base}/completions"))
            .json(&completion(model, i, false))
            .send()
            .await
            .expect("send")
            .json()
            .await
            .expect("JSON");
        out.push(
            reply["choices"][0]["text"]
                .as_str()
                .unwrap_or_else(|| panic!("a completion: {reply}"))
                .to_string(),
        );
    }
    out
}

/// `STREAMS` streamed completions, each read to its third chunk: all running at once.
async fn open_streams(http: &reqwest::Client, base: &str, model: &str) -> Vec<SseStream> {
    let url = format!("{base}/completions");
    let mut streams = Vec::new();
    for i in 0..STREAMS {
        let s = SseStream::start(http, &url, &completion(model, i, true))
            .await
            .expect("a stream starts");
        streams.push(s);
    }
    for s in &mut streams {
        s.read_until(3).await.expect("the first chunks");
        assert!(!s.ended(), "a stream ended after {} chunks", s.chunks);
    }
    streams
}

/// Reads every stream to its end: each must complete (`[DONE]`, no error) with the fault-free
/// text.
async fn all_exact(streams: Vec<SseStream>, want: &[String]) {
    for (i, mut s) in streams.into_iter().enumerate() {
        s.finish().await.expect("the stream ends properly");
        assert!(
            s.done && s.error.is_none(),
            "stream {i} failed: {:?}",
            s.error
        );
        assert_eq!(s.text, want[i], "stream {i}: the fault-free text");
    }
}

/// A cluster with [`STREAMS`] HTTP streams running, and each one's fault-free text.
struct Running {
    cluster: Cluster,
    http: reqwest::Client,
    base: String,
    model: String,
    want: Vec<String>,
    streams: Vec<SseStream>,
}

impl Running {
    async fn start() -> Self {
        let cluster = Cluster::start(config()).await.expect("cluster");
        let http = reqwest::Client::new();
        let base = format!("http://{}/v1", cluster.http);
        let model = http_model(&http, &base).await.expect("the model id");
        let want = answers(&http, &base, &model).await;
        let streams = open_streams(&http, &base, &model).await;
        Self {
            cluster,
            http,
            base,
            model,
            want,
            streams,
        }
    }
}

/// The nodes' grace period: long enough for a drained node to finish what it runs.
const GRACE: Duration = Duration::from_secs(20);

fn config() -> ClusterConfig {
    ClusterConfig {
        decode: 2,
        grace: GRACE,
        ..ClusterConfig::new(smollm2_model().expect("SmolLM2"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_router_drains_its_http_streams_and_refuses_newcomers() {
    let Running {
        mut cluster,
        http,
        base,
        model,
        want,
        streams,
    } = Running::start().await;

    cluster.router.signal_stop();
    // While it drains: a newcomer is refused at once, on either API, and /health says 503.
    let refused = http
        .post(format!("{base}/completions"))
        .json(&completion(&model, 0, true))
        .send()
        .await
        .expect("the HTTP port still answers");
    assert_eq!(refused.status(), 503);
    assert_eq!(
        refused
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()),
        Some("1")
    );
    let error: serde_json::Value = refused.json().await.expect("an error object");
    assert_eq!(error["error"]["code"], "service_unavailable", "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("draining")),
        "{error}"
    );
    let health = http
        .get(format!("http://{}/health", cluster.http))
        .send()
        .await
        .expect("health");
    assert_eq!(health.status(), 503);
    let grpc = cluster
        .client()
        .generate(tandem_integration_tests::greedy(vec![5, 6, 7], 4))
        .await
        .expect_err("a gRPC newcomer is refused");
    assert_eq!(grpc.code(), Code::Unavailable, "{grpc:?}");
    assert!(grpc.message().contains("draining"), "{grpc:?}");

    // Every stream in flight completes, exactly.
    all_exact(streams, &want).await;
    cluster.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_decode_node_stopped_at_once_finishes_its_http_streams() {
    let Running {
        mut cluster,
        want,
        streams,
        ..
    } = Running::start().await;
    for n in 0..2 {
        let active = cluster.decode_load(n).await.expect("load").active;
        assert!(active > 0, "decode node {n} runs no stream");
    }

    let stopped = Instant::now();
    let stopping: Vec<_> = std::mem::take(&mut cluster.decode)
        .into_iter()
        .map(|mut node| {
            node.signal_stop();
            tokio::spawn(node.stop())
        })
        .collect();
    all_exact(streams, &want).await;
    assert!(
        stopped.elapsed() < GRACE,
        "the streams finished only after {:?}",
        stopped.elapsed()
    );
    for s in stopping {
        s.await
            .expect("the node's task")
            .expect("a drained node stops cleanly");
    }
    let text = tandem_integration_tests::metrics(cluster.router.addr)
        .await
        .expect("metrics");
    let returned = sample(&text, "tandem_router_last_resort_total").unwrap_or(0.0);
    assert!(
        returned >= 1.0,
        "no stream went back to a draining node: {returned}"
    );
    cluster.stop().await.expect("stop");
}

/// A listener that accepts every connection and never says a word: a peer whose TLS
/// handshake stalls.
async fn silent_peer() -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            held.push(conn);
        }
    });
    (addr, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_whose_handshake_stalls_fails_in_bound_and_the_prefill_node_serves_on() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("stops-certs-{}", std::process::id()));
    write_dev_certs(&dir, &[], 1).expect("certificates");
    let cluster = Cluster::start(ClusterConfig {
        tls_dir: Some(dir.clone()),
        ..config()
    })
    .await
    .expect("cluster");
    let prompt = |salt: u32| (0..200).map(|i| 10 + (i * 7 + salt) % 300).collect();
    let mut client = cluster.client();

    // The router's certificate asks the prefill node for a push to the silent peer; with more
    // KV chunks than the push buffers, the compute thread meets the stall.
    let (peer, held) = silent_peer().await;
    let tls = Tls::load(&dir, Role::Router).expect("tls");
    let channel = tandem_net::channel(
        &cluster.prefill[0].addr.to_string(),
        Some(tls.client_config()),
    )
    .expect("channel");
    let mut prefill = pb::prefill_client::PrefillClient::new(channel.clone());
    let stalled = tokio::spawn(async move {
        let started = Instant::now();
        let outcome = prefill
            .prefill(pb::PrefillRequest {
                request_id: "stalled".into(),
                transfer_id: "stalled".into(),
                token_ids: prompt(2),
                decode_addr: peer.to_string(),
                sampling: Some(pb::SamplingParams {
                    max_tokens: 1,
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await;
        (outcome, started.elapsed())
    });
    // Once the stalled push holds the node's one compute thread, a request of the cluster's
    // own (a cold prompt, so it is prefilled there) queues behind it.
    let started = Instant::now();
    loop {
        let text = tandem_integration_tests::metrics_over(channel.clone())
            .await
            .expect("the prefill node's metrics");
        if sample(&text, "tandem_prefill_queue_depth").unwrap_or(0.0) >= 1.0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the stalled prefill never started"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut request = tonic::Request::new(tandem_integration_tests::greedy(prompt(1), 16));
    request.set_timeout(Duration::from_secs(30));
    let behind = tandem_integration_tests::collect(&mut client, request)
        .await
        .expect("a request behind the stalled push completes");
    let route = behind.last.route.clone().expect("route");
    assert_eq!(route.disaggregation, "remote", "{route:?}");
    // The same prompt again (the caches hold it now) says the same.
    let again = tandem_integration_tests::collect(
        &mut client,
        tandem_integration_tests::greedy(prompt(1), 16),
    )
    .await
    .expect("the prompt again");
    assert_eq!(behind.token_ids, again.token_ids);

    let (outcome, took) = stalled.await.expect("the stalled call's task");
    let status = outcome.expect_err("a push to a silent peer fails");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        took < Duration::from_secs(15),
        "the stalled push failed only after {took:?}"
    );
    held.abort();
    cluster.stop().await.expect("stop");
}
