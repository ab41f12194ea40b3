//! The router's cache index stays true to the workers: a restarted worker (a new epoch, empty
//! caches) is never credited with KV it lost, and an event stream lost to a network cut is
//! noticed and rebuilt from a snapshot, including what changed while it was down.

use std::time::{Duration, Instant};

use tandem_engine::{Engine, EngineConfig, GenerateParams, GenerateRequest};
use tandem_integration_tests::{Cluster, ClusterConfig, collect, metrics, sample};
use tandem_proto::v1 as pb;

fn prompt(n: u32, salt: u32) -> Vec<u32> {
    (0..n).map(|i| 7 + (i * 13 + salt) % 240).collect()
}

fn request(tokens: Vec<u32>, session: &str) -> pb::GenerateRequest {
    pb::GenerateRequest {
        session_id: session.into(),
        token_ids: tokens,
        sampling: Some(pb::SamplingParams {
            max_tokens: 8,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The router's gauge `name` for the decode replica it knows as `replica`, with `more` labels.
async fn router_gauge(cluster: &Cluster, name: &str, replica: &str, more: &str) -> Option<f64> {
    let text = metrics(cluster.router.addr).await.ok()?;
    sample(
        &text,
        &format!("{name}{{replica=\"{replica}\",role=\"decode\"{more}}}"),
    )
}

/// Waits (at most 10 s) until `check` holds for the router's index of `replica`: (mode is
/// exact, blocks indexed).
async fn until_index(cluster: &Cluster, replica: &str, check: impl Fn(bool, f64) -> bool) {
    let started = Instant::now();
    loop {
        let exact = router_gauge(
            cluster,
            "tandem_router_index_mode",
            replica,
            ",mode=\"exact\"",
        )
        .await;
        let blocks = router_gauge(cluster, "tandem_router_index_blocks", replica, "").await;
        if let (Some(exact), Some(blocks)) = (exact, blocks)
            && check(exact == 1.0, blocks)
        {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the index of {replica} never got there (exact {exact:?}, blocks {blocks:?})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_worker_is_not_credited_with_kv_it_lost() {
    let model = tandem_engine::ModelSource::TINY.load().expect("tiny");
    let mut cluster = Cluster::start(ClusterConfig::new(model.clone()))
        .await
        .expect("cluster");
    let decode = cluster.decode[0].addr.to_string();
    let mut client = cluster.client();
    let turn1 = prompt(60, 1);
    let first = collect(&mut client, request(turn1.clone(), "a"))
        .await
        .expect("turn 1");
    until_index(&cluster, &decode, |exact, blocks| exact && blocks > 0.0).await;

    cluster.restart_decode(0).await.expect("restart");
    cluster
        .wait_ready(Duration::from_secs(10))
        .await
        .expect("ready");
    until_index(&cluster, &decode, |exact, blocks| exact && blocks == 0.0).await;

    let mut turn2 = turn1;
    turn2.extend(&first.token_ids);
    turn2.extend(prompt(20, 2));
    let second = collect(&mut client, request(turn2.clone(), "a"))
        .await
        .expect("turn 2");
    let route = second.last.route.expect("route");
    let usage = second.last.usage.expect("usage");
    assert_eq!(route.decode_overlap_tokens, 0, "{route:?}");
    assert_eq!(usage.decode_cached_tokens, 0, "{usage:?}");
    // And the answer is still exact.
    let mut engine = Engine::new(model, EngineConfig::default()).expect("engine");
    let local = engine
        .generate_batch(&[GenerateRequest {
            prompt: turn2,
            params: GenerateParams {
                max_tokens: 8,
                ..GenerateParams::default()
            },
        }])
        .expect("local");
    assert_eq!(second.token_ids, local[0].token_ids);
    cluster.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_event_stream_is_detected_and_resynced() {
    let model = tandem_engine::ModelSource::TINY.load().expect("tiny");
    let cluster = Cluster::start(ClusterConfig {
        relays: true,
        ..ClusterConfig::new(model)
    })
    .await
    .expect("cluster");
    // The router knows the decode node by its relay's address.
    let relay = &cluster.relays[1];
    let seen_as = relay.addr.to_string();
    let mut client = cluster.client();
    collect(&mut client, request(prompt(40, 3), "a"))
        .await
        .expect("turn 1");
    until_index(&cluster, &seen_as, |exact, blocks| exact && blocks > 0.0).await;

    // Cut the network between router and decode node; the router notices.
    relay.cut();
    until_index(&cluster, &seen_as, |exact, _| !exact).await;

    // While it is cut, the decode node caches a conversation the router never hears about.
    let hidden = prompt(50, 4);
    let mut direct = pb::decode_client::DecodeClient::new(cluster.decode[0].channel());
    let mut frames = direct
        .generate(pb::DecodeRequest {
            request_id: "hidden".into(),
            prompt_token_ids: hidden.clone(),
            sampling: Some(pb::SamplingParams {
                max_tokens: 4,
                ..Default::default()
            }),
            local_prefill: true,
            ..Default::default()
        })
        .await
        .expect("direct call")
        .into_inner();
    let mut reply = Vec::new();
    while let Some(m) = frames.message().await.expect("frame") {
        if let Some(pb::decode_response::Event::Tokens(t)) = m.event {
            reply.extend(t.token_ids);
        }
    }
    let cached = cluster.decode_load(0).await.expect("load").kv_blocks_cached;

    // Back on the network: the router resyncs from a snapshot, which has the hidden blocks.
    relay.restore();
    until_index(&cluster, &seen_as, |exact, blocks| {
        exact && blocks == cached as f64
    })
    .await;
    // The index can be whole again a moment before health marks the replica up.
    cluster
        .wait_ready(Duration::from_secs(10))
        .await
        .expect("the decode node is back up");
    let mut follow_up = hidden;
    follow_up.extend(&reply);
    follow_up.extend(prompt(10, 5));
    let got = collect(&mut client, request(follow_up, "b"))
        .await
        .expect("follow-up");
    let route = got.last.route.expect("route");
    assert!(route.decode_overlap_tokens >= 48, "{route:?}");
    cluster.stop().await.expect("stop");
}
