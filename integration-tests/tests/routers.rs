//! Several routers over the same workers, each other's peers (`Config::peers`): each one
//! learns the others' agent sessions, their requests on each worker and the generations they
//! run under a client's request id, so that a conversation's turns may go through any of them,
//! and a retry that reaches another router attaches to the running stream instead of starting
//! a second one. On SmolLM2, whose 200 tokens take long enough to be caught running.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::json;
use tandem_integration_tests::{
    Cluster, ClusterConfig, PeerRouter, collect, finish, http_model, metrics, open, replicas_up,
    sample, smollm2_model,
};
use tandem_proto::v1 as pb;

/// Waits until `check` holds of router `addr`'s metrics, for at most 10 s.
async fn until_metrics(addr: SocketAddr, what: &str, check: impl Fn(&str) -> bool) -> String {
    let started = Instant::now();
    loop {
        let text = metrics(addr).await.expect("metrics");
        if check(&text) {
            return text;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{what}: never so at {addr}:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn staleness(text: &str, peer: SocketAddr) -> Option<f64> {
    sample(
        text,
        &format!("tandem_router_peer_staleness_seconds{{peer=\"{peer}\"}}"),
    )
}

/// A completion of `prompt` under `session` through the HTTP API at `http`.
async fn turn(client: &reqwest::Client, http: SocketAddr, session: &str, prompt: &str) {
    let model = http_model(client, &format!("http://{http}/v1"))
        .await
        .expect("the model's id");
    let r = client
        .post(format!("http://{http}/v1/completions"))
        .header("x-session-id", session)
        .json(&json!({"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}))
        .send()
        .await
        .expect("completion");
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
}

fn long_request(id: &str) -> pb::GenerateRequest {
    pb::GenerateRequest {
        request_id: id.into(),
        prompt: Some("The history of the river begins".into()),
        sampling: Some(pb::SamplingParams {
            max_tokens: 200,
            min_tokens: 200,
            temperature: 0.8,
            seed: 7,
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn peer_routers_share_sessions_load_and_running_generations() {
    let cluster = Cluster::start(ClusterConfig::new(smollm2_model().expect("SmolLM2")))
        .await
        .expect("cluster");
    let mut routers = cluster.peer_routers(2, |_| {}).await.expect("routers");
    let [a, b]: [&PeerRouter; 2] = [&routers[0], &routers[1]];
    for (r, other) in [(a, b), (b, a)] {
        // It serves once it has learned the model from the workers.
        let started = Instant::now();
        let http = reqwest::Client::new();
        while http_model(&http, &format!("http://{}/v1", r.http))
            .await
            .is_err()
        {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{} never served",
                r.http
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // And once its health checks have found the workers up (the model comes first).
        let workers = cluster.prefill.len() + cluster.decode.len();
        until_metrics(r.node.addr, "every worker up", |t| {
            replicas_up(t) == workers
        })
        .await;
        until_metrics(r.node.addr, "the peer answered", |t| {
            staleness(t, other.peer).is_some_and(|s| s < 1.0)
        })
        .await;
        // Its own address among its peers is left out.
        let text = metrics(r.node.addr).await.expect("metrics");
        assert!(staleness(&text, r.peer).is_none(), "{text}");
    }

    // A session's first turn through a, the next through b: both hold it; an end through a
    // reaches b.
    let http = reqwest::Client::new();
    turn(&http, a.http, "conversation", "Once upon a time").await;
    let open_one = |t: &str| sample(t, "tandem_router_sessions_open") == Some(1.0);
    until_metrics(b.node.addr, "b learned a's session", open_one).await;
    turn(
        &http,
        b.http,
        "conversation",
        "Once upon a time there was a castle",
    )
    .await;
    let ended = http
        .delete(format!("http://{}/v1/sessions/conversation", a.http))
        .send()
        .await
        .expect("end");
    assert_eq!(ended.status(), 200, "a ends the session b served last");
    let open_none = |t: &str| sample(t, "tandem_router_sessions_open") == Some(0.0);
    until_metrics(b.node.addr, "b learned the end", open_none).await;

    // A generation running on a under a client's id: a's peer port lists it and its request
    // on the decode node.
    let mut client_a = pb::generation_client::GenerationClient::new(a.node.channel());
    let (rest, first) = open(&mut client_a, long_request("retried"), 1)
        .await
        .expect("a starts the generation");
    assert_eq!(first.frames, 1);
    let mut peer = pb::peer_client::PeerClient::connect(format!("http://{}", a.peer))
        .await
        .expect("a's peer port");
    let state = peer
        .state(pb::StateRequest {
            asker: 1,
            ..Default::default()
        })
        .await
        .expect("a's state")
        .into_inner();
    assert!(
        state.running.iter().any(|k| k.request_id == "retried"),
        "{state:?}"
    );
    let decode = cluster.decode[0].addr.to_string();
    assert!(
        state
            .load
            .iter()
            .any(|l| l.addr == decode && l.requests == 1),
        "{state:?}"
    );
    // b hears of it within a few of its 50 ms polls; the same id sent to b then attaches there.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let attempts = "tandem_router_dispatch_attempts_total";
    let before = metrics(b.node.addr).await.expect("b's metrics");
    let mut client_b = pb::generation_client::GenerationClient::new(b.node.channel());
    let through_b = collect(&mut client_b, long_request("retried"))
        .await
        .expect("b attaches");
    let through_a = finish(rest, first).await.expect("a's stream");
    assert_eq!(through_b.token_ids.len(), 200);
    assert_eq!(through_b.token_ids, through_a.token_ids, "one generation");
    assert_eq!(through_b.text, through_a.text);
    let text = metrics(b.node.addr).await.expect("b's metrics");
    assert_eq!(
        sample(&text, "tandem_router_peer_attaches_total"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, attempts),
        sample(&before, attempts),
        "b dispatched nothing more: {text}"
    );

    // b stops: a's view of it grows old.
    let b = routers.pop().expect("b");
    let b_peer = b.peer;
    b.node.stop().await.expect("b stops");
    let a = &routers[0];
    until_metrics(a.node.addr, "a's view of b ages", |t| {
        staleness(t, b_peer).is_some_and(|s| s > 1.0)
    })
    .await;
}
