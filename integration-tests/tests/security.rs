//! The client-facing controls: API keys (required, hashed, reloadable), per-key rate limits and
//! concurrent streams, tenant-partitioned prefix caches, and the request ids a retry attaches
//! by, which stay within a tenant. Real router, real workers, the tiny model.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tandem_integration_tests::{Cluster, ClusterConfig, collect, greedy, smollm2_model};
use tandem_proto::v1 as pb;
use tandem_router::auth::key_line;
use tandem_router::{AuthConfig, KeyLimits};
use tonic::Code;

/// A key file in a fresh directory under the target's tmp dir.
fn key_file(name: &str, lines: &[String]) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("security-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp dir");
    let path = dir.join("keys");
    std::fs::write(&path, lines.join("\n")).expect("key file");
    path
}

fn keyed(r: pb::GenerateRequest, key: &str) -> tonic::Request<pb::GenerateRequest> {
    let mut request = tonic::Request::new(r);
    request.metadata_mut().insert(
        "authorization",
        format!("Bearer {key}").parse().expect("ascii"),
    );
    request
}

/// A cluster on the tiny model, or on the real one where a generation must stay in flight
/// while the test looks (the tiny model finishes a thousand tokens in a blink).
async fn cluster_with(real_model: bool, auth: AuthConfig) -> Cluster {
    let model = if real_model {
        smollm2_model().expect("SmolLM2 (run `tandem model fetch smollm2`)")
    } else {
        tandem_engine::ModelSource::TINY.load().expect("tiny")
    };
    Cluster::start(ClusterConfig {
        auth,
        ..ClusterConfig::new(model)
    })
    .await
    .expect("cluster")
}

/// A generation that runs for seconds on the real model (no end-of-text token comes early).
fn long_request() -> pb::GenerateRequest {
    greedy((0..64).map(|i| 1000 + i * 13).collect(), 2000)
}

/// Retries `check` every 50 ms for at most 10 s (the key file is polled every second).
async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let started = Instant::now();
    while !check().await {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{what} within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_required_on_both_apis_and_reloaded_without_a_restart() {
    let none = KeyLimits::default();
    let path = key_file("keys", &[key_line("alice", "key-a", none)]);
    let cluster = cluster_with(
        false,
        AuthConfig {
            key_file: Some(path.clone()),
            ..AuthConfig::default()
        },
    )
    .await;
    let mut client = cluster.client();
    let ask = || greedy(vec![5, 6, 7], 3);

    // gRPC: no key, a wrong key, a malformed header: UNAUTHENTICATED, saying nothing of which.
    let missing = collect(&mut client, ask()).await.expect_err("no key");
    assert_eq!(missing.code(), Code::Unauthenticated, "{missing:?}");
    let wrong = collect(&mut client, keyed(ask(), "key-b"))
        .await
        .expect_err("wrong key");
    assert_eq!(wrong.code(), Code::Unauthenticated);
    assert_eq!(wrong.message(), missing.message());
    let mut basic = tonic::Request::new(ask());
    basic
        .metadata_mut()
        .insert("authorization", "Basic a2V5LWE=".parse().expect("ascii"));
    let basic = collect(&mut client, basic).await.expect_err("basic auth");
    assert_eq!(basic.code(), Code::Unauthenticated);
    let ok = collect(&mut client, keyed(ask(), "key-a")).await;
    assert!(ok.is_ok(), "{ok:?}");

    // HTTP: 401 with an OpenAI error object; the health check needs no key.
    let http = reqwest::Client::new();
    let url = format!("http://{}", cluster.http);
    let body = serde_json::json!({"model": "tiny", "prompt": "hello", "max_tokens": 2});
    let r = http
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await
        .expect("http");
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers()["www-authenticate"], "Bearer");
    let e: serde_json::Value = r.json().await.expect("json");
    assert_eq!(e["error"]["type"], "authentication_error", "{e}");
    let r = http
        .get(format!("{url}/v1/models"))
        .send()
        .await
        .expect("http");
    assert_eq!(r.status(), 401, "the model list needs a key too");
    let r = http
        .post(format!("{url}/v1/completions"))
        .bearer_auth("key-a")
        .json(&body)
        .send()
        .await
        .expect("http");
    assert_eq!(r.status(), 200);
    let r = http
        .get(format!("{url}/health"))
        .send()
        .await
        .expect("http");
    assert_eq!(r.status(), 200);
    // Anthropic's Messages API: the key in `x-api-key` as well, and its refusal in Anthropic's
    // error shape.
    let message = serde_json::json!({"model": "tiny", "max_tokens": 2,
                                     "messages": [{"role": "user", "content": "hello"}]});
    let messages = format!("{url}/v1/messages");
    let r = http
        .post(&messages)
        .json(&message)
        .send()
        .await
        .expect("http");
    assert_eq!(r.status(), 401);
    let e: serde_json::Value = r.json().await.expect("json");
    assert_eq!(e["type"], "error", "{e}");
    assert_eq!(e["error"]["type"], "authentication_error", "{e}");
    for (name, value) in [("x-api-key", "key-a"), ("authorization", "Bearer key-a")] {
        let r = http
            .post(&messages)
            .header(name, value)
            .header("anthropic-version", "2023-06-01")
            .json(&message)
            .send()
            .await
            .expect("http");
        assert_eq!(r.status(), 200, "{name}");
    }

    // A new key works, and a removed one stops working, without a restart.
    std::fs::write(&path, key_line("bob", "key-b", none)).expect("rewrite");
    eventually("bob's new key is accepted", async || {
        collect(&mut cluster.client(), keyed(ask(), "key-b"))
            .await
            .is_ok()
    })
    .await;
    let revoked = collect(&mut client, keyed(ask(), "key-a"))
        .await
        .expect_err("alice's key was removed");
    assert_eq!(revoked.code(), Code::Unauthenticated);

    // A file that no longer parses keeps the keys in force.
    std::fs::write(&path, "bob sha256:not-hex\n").expect("rewrite");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let kept = collect(&mut client, keyed(ask(), "key-b")).await;
    assert!(kept.is_ok(), "{kept:?}");
    cluster.stop().await.expect("stop");
}

fn pushback_ms(s: &tonic::Status) -> u64 {
    s.metadata()
        .get("grpc-retry-pushback-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no pushback on {s:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_key_is_rate_limited_across_its_connections() {
    let path = key_file(
        "limits",
        &[
            key_line(
                "a",
                "two-per-minute",
                KeyLimits {
                    requests_per_minute: Some(2),
                    ..KeyLimits::default()
                },
            ),
            key_line(
                "b",
                "fifty-tokens",
                KeyLimits {
                    tokens_per_minute: Some(50),
                    ..KeyLimits::default()
                },
            ),
            key_line(
                "c",
                "one-stream",
                KeyLimits {
                    streams: Some(1),
                    ..KeyLimits::default()
                },
            ),
            key_line("d", "unlimited", KeyLimits::default()),
        ],
    );
    let cluster = cluster_with(
        true,
        AuthConfig {
            key_file: Some(path),
            ..AuthConfig::default()
        },
    )
    .await;
    let ask = || greedy(vec![5, 6, 7], 3);

    // Requests per minute, counted across two connections.
    for _ in 0..2 {
        let r = collect(&mut cluster.client(), keyed(ask(), "two-per-minute")).await;
        assert!(r.is_ok(), "{r:?}");
    }
    let limited = collect(&mut cluster.client(), keyed(ask(), "two-per-minute"))
        .await
        .expect_err("the third request in a minute");
    assert_eq!(limited.code(), Code::ResourceExhausted, "{limited:?}");
    assert!(limited.message().contains("requests per minute"));
    // One request a minute refills in 30 s.
    let wait = pushback_ms(&limited);
    assert!((20_000..=30_000).contains(&wait), "pushback {wait} ms");
    // Over HTTP too: 429 with Retry-After.
    let http = reqwest::Client::new();
    let models: serde_json::Value = http
        .get(format!("http://{}/v1/models", cluster.http))
        .bearer_auth("unlimited")
        .send()
        .await
        .expect("http")
        .json()
        .await
        .expect("json");
    let model = models["data"][0]["id"].clone();
    let r = http
        .post(format!("http://{}/v1/completions", cluster.http))
        .bearer_auth("two-per-minute")
        .json(&serde_json::json!({"model": model, "prompt": "hi", "max_tokens": 2}))
        .send()
        .await
        .expect("http");
    assert_eq!(r.status(), 429);
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .expect("ascii")
        .parse()
        .expect("seconds");
    assert!((20..=30).contains(&retry), "Retry-After {retry}");
    // Another key is not affected.
    assert!(
        collect(&mut cluster.client(), keyed(ask(), "unlimited"))
            .await
            .is_ok()
    );

    // Tokens per minute: prompt plus max_tokens are reserved, what was not generated returns.
    let big = greedy(vec![5; 10], 35);
    let r = collect(&mut cluster.client(), keyed(big.clone(), "fifty-tokens")).await;
    assert!(r.is_ok(), "{r:?}");
    let limited = collect(&mut cluster.client(), keyed(big, "fifty-tokens"))
        .await
        .expect_err("45 more tokens, when at most 39 of the 50 a minute are left");
    assert_eq!(limited.code(), Code::ResourceExhausted);
    assert!(
        limited.message().contains("tokens per minute"),
        "{limited:?}"
    );

    // Concurrent streams: a second generation waits for the first to end.
    let mut first = cluster
        .client()
        .generate(keyed(long_request(), "one-stream"))
        .await
        .expect("first stream")
        .into_inner();
    first.message().await.expect("a frame").expect("a frame");
    let second = collect(&mut cluster.client(), keyed(ask(), "one-stream"))
        .await
        .expect_err("a second stream");
    assert_eq!(second.code(), Code::ResourceExhausted);
    assert!(
        second.message().contains("concurrent streams"),
        "{second:?}"
    );
    drop(first);
    eventually("the stream is free once the first ends", async || {
        collect(&mut cluster.client(), keyed(ask(), "one-stream"))
            .await
            .is_ok()
    })
    .await;
    cluster.stop().await.expect("stop");
}

/// A prompt of several full blocks, as text.
const PROMPT: &str = "The quick brown fox jumps over the lazy dog while the cat watches from \
                      the warm windowsill and the rain keeps falling on the old tin roof of \
                      the barn behind the house at the end of the long and winding road.";

async fn cached(cluster: &Cluster, key: &str, salt: &str) -> u32 {
    let r = pb::GenerateRequest {
        prompt: Some(PROMPT.into()),
        cache_salt: salt.into(),
        sampling: Some(pb::SamplingParams {
            max_tokens: 2,
            ..Default::default()
        }),
        ..Default::default()
    };
    let out = collect(&mut cluster.client(), keyed(r, key))
        .await
        .expect("generation");
    out.last.usage.expect("usage").cached_tokens
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_cached_prompt_never_serves_another() {
    let none = KeyLimits::default();
    let path = key_file(
        "tenants",
        &[
            key_line("alice", "key-a", none),
            key_line("alice", "key-a2", none),
            key_line("bob", "key-b", none),
        ],
    );
    let cluster = cluster_with(
        true,
        AuthConfig {
            key_file: Some(path),
            ..AuthConfig::default()
        },
    )
    .await;
    assert_eq!(cached(&cluster, "key-a", "").await, 0, "a cold cache");
    let warm = cached(&cluster, "key-a", "").await;
    assert!(warm >= 32, "alice's repeat reuses her prompt: {warm}");
    for (key, salt, want, why) in [
        ("key-a2", "", warm, "a tenant's keys share its partition"),
        (
            "key-b",
            "",
            0,
            "bob's identical prompt finds nothing of alice's",
        ),
        ("key-b", "", warm, "bob's own repeat"),
        ("key-a", "project-x", 0, "a salt is a partition of its own"),
        ("key-a", "project-x", warm, "the salted repeat"),
    ] {
        assert_eq!(cached(&cluster, key, salt).await, want, "{why}");
    }

    // A request id is the tenant's own: bob's request with alice's running id starts his own
    // generation instead of reading hers.
    let mut hers = cluster
        .client()
        .generate(keyed(
            pb::GenerateRequest {
                request_id: "shared-id".into(),
                ..long_request()
            },
            "key-a",
        ))
        .await
        .expect("alice's stream")
        .into_inner();
    hers.message().await.expect("a frame").expect("a frame");
    let his = collect(
        &mut cluster.client(),
        keyed(
            pb::GenerateRequest {
                request_id: "shared-id".into(),
                ..greedy(vec![9, 10, 11, 12], 2)
            },
            "key-b",
        ),
    )
    .await
    .expect("bob's generation");
    assert_eq!(his.last.prompt_token_ids, vec![9, 10, 11, 12]);
    drop(hers);
    cluster.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_key_file_no_key_is_needed_and_salts_still_partition() {
    let cluster = cluster_with(false, AuthConfig::default()).await;
    assert_eq!(cached(&cluster, "anything", "").await, 0);
    let warm = cached(&cluster, "ignored", "").await;
    assert!(warm >= 32, "{warm}");
    assert_eq!(cached(&cluster, "ignored", "mine").await, 0);
    let long_salt = pb::GenerateRequest {
        cache_salt: "s".repeat(300),
        ..greedy(vec![5, 6, 7], 2)
    };
    let e = collect(&mut cluster.client(), long_salt)
        .await
        .expect_err("a salt over 256 bytes");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message().contains("cache_salt") && e.message().len() < 200,
        "{e:?}"
    );
    cluster.stop().await.expect("stop");
}
