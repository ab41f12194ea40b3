//! A decode node's drain moves its cached sessions to its peer: the router takes the draining
//! node's offer (`Decode.Sessions`) and asks the peer to take each (`Decode.Adopt`), which
//! fetches the KV. The sessions' next turns are then cache hits on the peer, and say exactly
//! what a cluster without caches says.

use std::time::{Duration, Instant};

use tandem_integration_tests::{Cluster, ClusterConfig, collect, greedy, metrics, sample};
use tandem_proto::v1 as pb;

const SESSIONS: usize = 6;

fn config(prefix_cache: bool) -> ClusterConfig {
    let model = tandem_engine::ModelSource::TINY.load().expect("tiny");
    ClusterConfig {
        decode: 2,
        prefix_cache,
        ..ClusterConfig::new(model)
    }
}

fn turn(session: usize, tokens: Vec<u32>) -> pb::GenerateRequest {
    pb::GenerateRequest {
        session_id: format!("session-{session}"),
        ..greedy(tokens, 12)
    }
}

fn tokens(n: usize, salt: usize) -> Vec<u32> {
    (0..n)
        .map(|i| 3 + ((i * 7 + salt * 31) % 200) as u32)
        .collect()
}

/// The value of a counter on the server at `addr` (0 when absent).
async fn counter(addr: std::net::SocketAddr, name: &str) -> f64 {
    sample(&metrics(addr).await.expect("metrics"), name).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_decode_node_moves_its_cached_sessions_to_its_peer() {
    let mut cluster = Cluster::start(config(true)).await.expect("cluster");
    let mut client = cluster.client();
    // Turn 1 of each session: 40 to 90 prompt tokens and a 12-token reply.
    let mut histories = Vec::new();
    let mut homes = Vec::new();
    for s in 0..SESSIONS {
        let first = tokens(40 + 10 * s, s);
        let reply = collect(&mut client, turn(s, first.clone()))
            .await
            .expect("turn 1");
        homes.push(reply.last.route.expect("route").decode);
        let mut history = first;
        history.extend(&reply.token_ids);
        history.extend(tokens(9, 100 + s));
        histories.push(history);
    }
    // Drain the node that holds more of them.
    let addr = |i: usize| cluster.decode[i].addr.to_string();
    let on = |i: usize| homes.iter().filter(|h| **h == addr(i)).count();
    let drained = usize::from(on(1) > on(0));
    let moving = on(drained);
    assert!(moving > 0, "sessions went to both nodes or one: {homes:?}");
    let node = cluster.decode.remove(drained);
    let drained_addr = node.addr.to_string();
    node.stop()
        .await
        .expect("the drained node stops cleanly once its sessions were fetched");
    let (router, peer) = (cluster.router.addr, cluster.decode[0].addr);
    let start = Instant::now();
    while counter(router, "tandem_router_moved_sessions_total").await < moving as f64 {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the router moved {} of {moving} sessions",
            counter(router, "tandem_router_moved_sessions_total").await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let adopted = counter(peer, "tandem_decode_adopted_tokens_total").await;
    assert_eq!(
        adopted,
        counter(router, "tandem_router_moved_session_tokens_total").await,
        "what the router counts moved is what the peer fetched"
    );

    // Turn 2 of each session that lived on the drained node: a hit on the peer.
    let mut answers = Vec::new();
    for (s, history) in histories.iter().enumerate() {
        let got = collect(&mut client, turn(s, history.clone()))
            .await
            .expect("turn 2");
        let usage = got.last.usage.expect("usage");
        if homes[s] == drained_addr {
            // Turn 1's prompt and reply: the whole blocks of what the node held (the reply's
            // last token's KV was never computed).
            let held = (history.len() - 9 - 1) / 16 * 16;
            assert!(
                usage.cached_tokens as usize >= held,
                "session {s} moved with its KV: {usage:?}, {held} tokens held"
            );
        }
        answers.push(got.token_ids);
    }
    assert!(adopted >= (moving * 48) as f64, "{adopted} tokens moved");
    cluster.stop().await.expect("stop");

    let cold = Cluster::start(config(false)).await.expect("cold cluster");
    let mut cold_client = cold.client();
    for (s, history) in histories.into_iter().enumerate() {
        let want = collect(&mut cold_client, turn(s, history))
            .await
            .expect("cold turn 2");
        assert_eq!(
            answers[s], want.token_ids,
            "session {s}: the cold run's tokens"
        );
    }
    cold.stop().await.expect("stop");
}
