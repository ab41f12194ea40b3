//! Sharing the cluster: the router's admission order serves priority classes in strict order
//! and, within a class, keys by the tokens they were served. On SmolLM2 with one decode slot,
//! so that requests wait in the router's queue while one runs: the order they are admitted in
//! is the order their first frames come.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_integration_tests::{Cluster, ClusterConfig, collect, metrics, sample, smollm2_model};
use tandem_proto::v1 as pb;
use tandem_router::auth::key_line;
use tandem_router::{AuthConfig, Class, KeyLimits};

fn request(id: &str, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        request_id: id.into(),
        token_ids: (0..48).map(|i| 900 + i * 7).collect(),
        sampling: Some(pb::SamplingParams {
            max_tokens,
            min_tokens: max_tokens,
            ..Default::default()
        }),
        ..Default::default()
    }
}

async fn cluster(auth: AuthConfig) -> Cluster {
    Cluster::start(ClusterConfig {
        decode_slots: 1,
        auth,
        ..ClusterConfig::new(smollm2_model().expect("SmolLM2"))
    })
    .await
    .expect("cluster")
}

type Arrivals = Arc<std::sync::Mutex<Vec<(String, Instant)>>>;
type Task = tokio::task::JoinHandle<()>;

/// Sends `id` with `x-priority: priority` (if any) under `key` (if any), and records when its
/// first frame came; the stream is read to its end.
fn send(
    cluster: &Cluster,
    id: &str,
    max_tokens: u32,
    priority: Option<&str>,
    key: Option<&str>,
    arrivals: &Arrivals,
) -> Task {
    let mut client = cluster.client();
    let mut r = tonic::Request::new(request(id, max_tokens));
    if let Some(p) = priority {
        r.metadata_mut()
            .insert("x-priority", p.parse().expect("ascii"));
    }
    if let Some(k) = key {
        let bearer = format!("Bearer {k}").parse().expect("ascii");
        r.metadata_mut().insert("authorization", bearer);
    }
    let (id, arrivals) = (id.to_string(), arrivals.clone());
    tokio::spawn(async move {
        let mut frames = client.generate(r).await.expect("accepted").into_inner();
        let first = frames
            .message()
            .await
            .expect("a frame")
            .expect("a first frame");
        arrivals.lock().expect("lock").push((id, Instant::now()));
        let mut last = first;
        while last.finish_reason == pb::FinishReason::Unspecified as i32 {
            last = frames
                .message()
                .await
                .expect("a frame")
                .expect("more frames");
        }
    })
}

/// Waits until `n` requests wait in the router's queue.
async fn until_queued(cluster: &Cluster, n: usize) {
    let started = Instant::now();
    loop {
        let text = metrics(cluster.router.addr).await.expect("metrics");
        if sample(&text, "tandem_router_queued_requests") == Some(n as f64) {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{n} never queued:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Fills the decode node's four places (one slot, three queued) with requests of `key` that
/// run about a second each, and waits until it holds them.
async fn fill(cluster: &Cluster, key: Option<&str>, arrivals: &Arrivals) -> Vec<Task> {
    let mut tasks = Vec::new();
    for i in 0..4 {
        tasks.push(send(
            cluster,
            &format!("hold-{i}"),
            100,
            None,
            key,
            arrivals,
        ));
        let started = Instant::now();
        loop {
            let load = cluster.decode_load(0).await.expect("load");
            if load.active + load.queued > i {
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(20), "{load:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    tasks
}

fn order(arrivals: &Arrivals) -> Vec<String> {
    let mut a = arrivals.lock().expect("lock").clone();
    a.sort_by_key(|(_, at)| *at);
    a.into_iter().map(|(id, _)| id).collect()
}

/// Four requests hold the decode node's places; three batch requests queue, then an interactive one
/// comes: it is admitted first. A priority that is no class is refused, naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_higher_class_goes_before_those_waiting() {
    let cluster = cluster(AuthConfig::default()).await;
    let arrivals = Arrivals::default();
    let mut tasks = fill(&cluster, None, &arrivals).await;
    for i in 0..3 {
        tasks.push(send(
            &cluster,
            &format!("batch-{i}"),
            8,
            Some("batch"),
            None,
            &arrivals,
        ));
        until_queued(&cluster, i + 1).await;
    }
    tasks.push(send(
        &cluster,
        "interactive",
        8,
        Some("interactive"),
        None,
        &arrivals,
    ));
    for t in tasks {
        t.await.expect("a stream");
    }
    let order = order(&arrivals);
    assert!(
        order[..4].iter().all(|o| o.starts_with("hold")),
        "{order:?}"
    );
    assert_eq!(order[4], "interactive", "{order:?}");

    let mut client = cluster.client();
    let mut bad = tonic::Request::new(request("bad", 4));
    bad.metadata_mut()
        .insert("x-priority", "urgent".parse().expect("ascii"));
    let status = client.generate(bad).await.expect_err("refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().contains("priority"), "{status:?}");
}

fn key_file(lines: &[String]) -> PathBuf {
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("sharing-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let path = dir.join("keys");
    std::fs::write(&path, lines.join("\n")).expect("key file");
    path
}

/// Within a class, the key served fewer tokens goes first: a key that floods the queue with six
/// requests does not hold back another key's one, which comes second. A key whose class is
/// `batch` asking for `interactive` is lowered to batch: it comes after both.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keys_share_a_class_by_tokens_served_and_a_key_cannot_rise_above_its_class() {
    let standard = KeyLimits::default();
    let batch = KeyLimits {
        class: Some(Class::Batch),
        ..KeyLimits::default()
    };
    let path = key_file(&[
        key_line("flood", "key-flood", standard),
        key_line("light", "key-light", standard),
        key_line("bulk", "key-bulk", batch),
    ]);
    let cluster = cluster(AuthConfig {
        key_file: Some(path),
        ..AuthConfig::default()
    })
    .await;
    let arrivals = Arrivals::default();
    let mut tasks = fill(&cluster, Some("key-flood"), &arrivals).await;
    tasks.push(send(
        &cluster,
        "bulk",
        8,
        Some("interactive"),
        Some("key-bulk"),
        &arrivals,
    ));
    until_queued(&cluster, 1).await;
    for i in 0..6 {
        tasks.push(send(
            &cluster,
            &format!("flood-{i}"),
            8,
            None,
            Some("key-flood"),
            &arrivals,
        ));
        until_queued(&cluster, i + 2).await;
    }
    tasks.push(send(
        &cluster,
        "light",
        8,
        None,
        Some("key-light"),
        &arrivals,
    ));
    for t in tasks {
        t.await.expect("a stream");
    }
    let order = order(&arrivals);
    let place = |id: &str| order.iter().position(|o| o == id).expect("served");
    // Light starts level with flood (idling earns nothing), so the flood's first queued request
    // may go before it, then light: its counter is then the lower.
    assert!(
        place("light") <= 5,
        "after the four holding requests: {order:?}"
    );
    assert_eq!(place("bulk"), order.len() - 1, "{order:?}");
}

/// Admission against a TTFT target: a request whose target the router predicts the cluster
/// misses is refused at once (RESOURCE_EXHAUSTED with retry pushback; HTTP 429 with
/// Retry-After), one whose target it meets is served, a class's default target applies to the
/// requests that name none, and a target that is no number is a clear error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttft_target_the_cluster_cannot_meet_is_refused_at_once() {
    // The batch class is held to 1 ms, which no prompt meets; the others have no default.
    let config = ClusterConfig::new(smollm2_model().expect("SmolLM2"));
    let cluster = Cluster::start(ClusterConfig {
        limits: tandem_router::Limits {
            ttft_targets: [None, None, Some(Duration::from_millis(1))],
            ..config.limits.clone()
        },
        ..config
    })
    .await
    .expect("cluster");
    let with = |id: &str, target: Option<&str>, priority: Option<&str>| {
        let mut r = tonic::Request::new(request(id, 4));
        for (name, value) in [("x-slo-ttft-ms", target), ("x-priority", priority)] {
            if let Some(v) = value {
                r.metadata_mut().insert(name, v.parse().expect("ascii"));
            }
        }
        r
    };
    // Served without a target (this also gives the router the rates its estimates use) and
    // with one it meets; the quicker of the two is what serving a request takes.
    let mut served = Duration::MAX;
    for (id, target) in [("warm", None), ("roomy", Some("60000"))] {
        let started = Instant::now();
        let out = collect(&mut cluster.client(), with(id, target, None)).await;
        assert_eq!(out.expect(id).token_ids.len(), 4);
        served = served.min(started.elapsed());
    }

    // Refused at once: its own 1 ms target, and the batch class's default.
    for (id, target, priority) in [("hurried", Some("1"), None), ("batch", None, Some("batch"))] {
        let started = Instant::now();
        let status = collect(&mut cluster.client(), with(id, target, priority))
            .await
            .expect_err(id);
        let took = started.elapsed();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
        assert!(status.message().contains("x-slo-ttft-ms"), "{status:?}");
        assert!(
            status.metadata().get("grpc-retry-pushback-ms").is_some(),
            "{status:?}"
        );
        // At once: sooner than the cluster serves a request, on however loaded a machine.
        assert!(
            took < served,
            "{id}: refused after {took:?}, served in {served:?}"
        );
    }
    let status = collect(&mut cluster.client(), with("bad", Some("soon"), None))
        .await
        .expect_err("not a number");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("x-slo-ttft-ms"), "{status:?}");

    // Over HTTP: 429 with Retry-After.
    let http = reqwest::Client::new();
    let base = format!("http://{}/v1", cluster.http);
    let model = tandem_integration_tests::http_model(&http, &base)
        .await
        .expect("model");
    let refused = http
        .post(format!("{base}/chat/completions"))
        .header("x-slo-ttft-ms", "1")
        .json(&serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 4,
        }))
        .send()
        .await
        .expect("HTTP");
    assert_eq!(refused.status(), 429);
    assert!(refused.headers().contains_key("retry-after"));

    let text = metrics(cluster.router.addr).await.expect("metrics");
    let refusals = "tandem_router_refused_requests_total{reason=\"ttft_target\"}";
    assert_eq!(sample(&text, refusals), Some(3.0), "{text}");
    assert_eq!(
        sample(&text, "tandem_router_ttft_fail_open"),
        Some(0.0),
        "{text}"
    );
    cluster.stop().await.expect("clean stop");
}
