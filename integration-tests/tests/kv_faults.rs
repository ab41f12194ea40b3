//! KV moving between decode nodes under faults, through a whole cluster: the holder cut off
//! while its sessions move (the tiny model), a drain racing the clients' cancels, and a drain
//! whose only peer is full (SmolLM2, whose streams run long enough to be caught by a drain). In each, every stream that completes says exactly what the
//! fault-free run said, none hangs, and no node is left holding a request's KV blocks. (A spill
//! file damaged on disk is in `kv_spill.rs`.)

use std::time::{Duration, Instant};

use std::sync::Arc;

use tandem_engine::Model;
use tandem_integration_tests::{
    Cluster, ClusterConfig, Collected, Node, collect, greedy, metrics, sample, smollm2_model,
};
use tandem_proto::v1 as pb;

fn tiny() -> Arc<Model> {
    tandem_engine::ModelSource::TINY.load().expect("tiny")
}

fn config(model: Arc<Model>) -> ClusterConfig {
    ClusterConfig {
        decode: 2,
        ..ClusterConfig::new(model)
    }
}

fn turn(session: usize, tokens: Vec<u32>, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        session_id: format!("session-{session}"),
        ..greedy(tokens, max_tokens)
    }
}

/// A long generation: it runs until `max_tokens`, whatever it says.
fn long(session: usize, tokens: Vec<u32>, max_tokens: u32) -> pb::GenerateRequest {
    let mut r = turn(session, tokens, max_tokens);
    if let Some(s) = r.sampling.as_mut() {
        s.ignore_eos = true;
    }
    r
}

fn tokens(n: usize, salt: usize) -> Vec<u32> {
    (0..n)
        .map(|i| 3 + ((i * 7 + salt * 31) % 200) as u32)
        .collect()
}

async fn counter(addr: std::net::SocketAddr, name: &str) -> f64 {
    sample(&metrics(addr).await.expect("metrics"), name).unwrap_or(0.0)
}

/// Waits until `cond` holds, at most `within`.
async fn until<F: std::future::Future<Output = bool>>(
    within: Duration,
    what: &str,
    mut cond: impl FnMut() -> F,
) {
    let start = Instant::now();
    while !cond().await {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The index of the decode node (in `cluster.decode`) that the most of `routes` went to, and
/// how many did; `seen` is how the router names decode node `i`.
fn busiest(routes: &[String], seen: impl Fn(usize) -> String, nodes: usize) -> (usize, usize) {
    (0..nodes)
        .map(|i| (i, routes.iter().filter(|r| **r == seen(i)).count()))
        .max_by_key(|&(_, n)| n)
        .expect("a decode node")
}

/// Turn 1 of `sessions` conversations (prompts of 120 to 330 tokens, 16-token replies):
/// returns each one's turn-2 prompt and the decode node turn 1 went to.
async fn first_turns(cluster: &Cluster, sessions: usize) -> (Vec<Vec<u32>>, Vec<String>) {
    let mut client = cluster.client();
    let (mut next, mut homes) = (Vec::new(), Vec::new());
    for s in 0..sessions {
        let first = tokens(120 + 30 * s, s);
        let reply = collect(&mut client, turn(s, first.clone(), 16))
            .await
            .expect("turn 1");
        homes.push(reply.last.route.expect("route").decode);
        let mut history = first;
        history.extend(&reply.token_ids);
        history.extend(tokens(7, 50 + s));
        next.push(history);
    }
    (next, homes)
}

/// What a cluster without caches answers to each turn-2 prompt.
async fn cold_answers(prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let cold = Cluster::start(ClusterConfig {
        prefix_cache: false,
        ..config(tiny())
    })
    .await
    .expect("cold cluster");
    let mut client = cold.client();
    let mut out = Vec::new();
    for (s, p) in prompts.iter().enumerate() {
        out.push(
            collect(&mut client, turn(s, p.clone(), 16))
                .await
                .expect("cold turn")
                .token_ids,
        );
    }
    cold.stop().await.expect("stop");
    out
}

/// The holder of the sessions being moved is cut off (every connection to it closed) once the
/// first has moved: the moves under way fail, and those sessions' next turns are computed on
/// the peer instead, exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_holder_cut_off_while_its_sessions_move_loses_nothing() {
    let mut cluster = Cluster::start(ClusterConfig {
        relays: true,
        ..config(tiny())
    })
    .await
    .expect("cluster");
    let (prompts, homes) = first_turns(&cluster, 8).await;
    // With relays the router (and so a peer fetching) reaches decode node i through relay
    // 1 + i (the prefill node's is 0).
    let seen = |i: usize| cluster.relays[1 + i].addr.to_string();
    let (drained, moving) = busiest(&homes, seen, 2);
    assert!(moving >= 2, "sessions on the drained node: {homes:?}");
    let relay = 1 + drained;
    let node = cluster.decode.remove(drained);
    let peer = cluster.decode[0].addr;
    let stopping = tokio::spawn(node.stop());
    until(Duration::from_secs(10), "a first session moved", || async {
        counter(peer, "tandem_decode_adopted_sessions_total").await >= 1.0
    })
    .await;
    cluster.relays[relay].cut();
    tokio::time::timeout(Duration::from_secs(30), stopping)
        .await
        .expect("the drain ends within its bound")
        .expect("the drained node's task")
        .expect("the drained node stops cleanly");

    let mut client = cluster.client();
    let mut answers = Vec::new();
    for (s, p) in prompts.iter().enumerate() {
        let got = collect(&mut client, turn(s, p.clone(), 16))
            .await
            .expect("turn 2 completes");
        answers.push(got.token_ids);
    }
    let adopted = counter(peer, "tandem_decode_adopted_sessions_total").await;
    assert!(
        (1.0..=moving as f64).contains(&adopted),
        "{adopted} of {moving} sessions moved"
    );
    cluster.until_decode_idle(0).await.expect("no KV left held");
    cluster.stop().await.expect("stop");
    assert_eq!(
        answers,
        cold_answers(&prompts).await,
        "the cold run's tokens"
    );
}

/// Streams running on a decode node when it drains, half of them cancelled by their clients at
/// that moment: the others hand off and finish exactly, the cancelled ones leave nothing held,
/// and the drain ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_racing_client_cancels_leaks_nothing() {
    let model = smollm2_model().expect("SmolLM2");
    let mut cluster = Cluster::start(config(model)).await.expect("cluster");
    let mut client = cluster.client();
    let requests: Vec<_> = (0..4).map(|s| long(s, tokens(60, s), 200)).collect();
    let want: Vec<Collected> = futures::future::join_all(requests.iter().map(|r| {
        let mut client = client.clone();
        async move {
            collect(&mut client, r.clone())
                .await
                .expect("fault-free run")
        }
    }))
    .await;

    // All four at once, each read to its 5th frame.
    let mut streams = Vec::new();
    for r in &requests {
        let mut frames = client
            .generate(r.clone())
            .await
            .expect("generate")
            .into_inner();
        let mut got = Collected::default();
        while got.frames < 5 {
            let f = frames.message().await.expect("frame").expect("a frame");
            got.frames += 1;
            got.token_ids.extend(&f.token_ids);
            got.last = f;
        }
        streams.push((frames, got));
    }
    // Frames carry no route before the last: the busier node is the one with more running.
    let loads = [
        cluster.decode_load(0).await.expect("load").active,
        cluster.decode_load(1).await.expect("load").active,
    ];
    let drained = usize::from(loads[1] > loads[0]);
    let node = cluster.decode.remove(drained);
    let stopping = tokio::spawn(node.stop());
    // The clients of the even streams go away as the drain begins.
    let kept: Vec<_> = streams
        .into_iter()
        .enumerate()
        .filter(|(i, _)| i % 2 == 1)
        .collect();
    for (i, (mut frames, mut got)) in kept {
        while let Some(f) = frames.message().await.expect("no error reaches the client") {
            assert_eq!(f.index as usize, got.frames, "gap-free, never repeated");
            got.frames += 1;
            got.token_ids.extend(&f.token_ids);
            if f.finish_reason != pb::FinishReason::Unspecified as i32 {
                break;
            }
        }
        assert_eq!(
            got.token_ids, want[i].token_ids,
            "stream {i}: the fault-free tokens"
        );
    }
    tokio::time::timeout(Duration::from_secs(30), stopping)
        .await
        .expect("the drain ends within its bound")
        .expect("the drained node's task")
        .expect("the drained node stops cleanly");
    cluster.until_decode_idle(0).await.expect("no KV left held");
    cluster.stop().await.expect("stop");
}

/// A drain whose only peer has no room: its slots are taken by long streams of its own. The
/// drained node's running stream hands off and waits in the router's queue until the peer has
/// room, then finishes exactly; the drain ends within its bound whether or not its KV was
/// fetched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_whose_peer_is_full_loses_nothing() {
    let model = smollm2_model().expect("SmolLM2");
    let mut cluster = Cluster::start(ClusterConfig {
        decode_slots: 2,
        ..config(model)
    })
    .await
    .expect("cluster");
    let mut client = cluster.client();
    // The stream that will be handed off, and its fault-free answer.
    let victim = long(0, tokens(100, 1), 300);
    let want = collect(&mut client, victim.clone())
        .await
        .expect("fault-free run");
    let mut frames = client
        .generate(victim)
        .await
        .expect("generate")
        .into_inner();
    let mut got = Collected::default();
    while got.frames < 3 {
        let f = frames.message().await.expect("frame").expect("a frame");
        got.frames += 1;
        got.token_ids.extend(&f.token_ids);
    }
    let loads = [
        cluster.decode_load(0).await.expect("load").active,
        cluster.decode_load(1).await.expect("load").active,
    ];
    let drained = usize::from(loads[1] > loads[0]);
    let peer = 1 - drained;
    // Fill the peer's two slots with streams sent to it directly.
    let fillers: Vec<_> = (0..2)
        .map(|k| {
            let node: &Node = &cluster.decode[peer];
            let mut c = pb::decode_client::DecodeClient::new(node.channel());
            let request = pb::DecodeRequest {
                request_id: format!("filler-{k}"),
                prompt_token_ids: tokens(40, 10 + k),
                sampling: Some(pb::SamplingParams {
                    max_tokens: 150,
                    ignore_eos: true,
                    ..Default::default()
                }),
                local_prefill: true,
                ..Default::default()
            };
            tokio::spawn(async move {
                let mut frames = c.generate(request).await?.into_inner();
                let mut n = 0;
                while let Some(f) = frames.message().await? {
                    if let Some(pb::decode_response::Event::Tokens(t)) = f.event {
                        n += t.token_ids.len();
                    }
                }
                Ok::<_, tonic::Status>(n)
            })
        })
        .collect();
    until(Duration::from_secs(10), "the peer is full", || async {
        cluster.decode_load(peer).await.expect("load").active == 2
    })
    .await;
    let node = cluster.decode.remove(drained);
    let stopping = tokio::spawn(node.stop());
    while let Some(f) = frames.message().await.expect("no error reaches the client") {
        assert_eq!(f.index as usize, got.frames, "gap-free, never repeated");
        got.frames += 1;
        got.token_ids.extend(&f.token_ids);
        if f.finish_reason != pb::FinishReason::Unspecified as i32 {
            let route = f.route.expect("route");
            assert_eq!(route.attempts, 2, "one hand-off: {route:?}");
            break;
        }
    }
    assert_eq!(got.token_ids, want.token_ids, "the fault-free tokens");
    for f in fillers {
        assert_eq!(f.await.expect("filler task").expect("filler stream"), 150);
    }
    tokio::time::timeout(Duration::from_secs(30), stopping)
        .await
        .expect("the drain ends within its bound")
        .expect("the drained node's task")
        .expect("the drained node stops cleanly");
    cluster.until_decode_idle(0).await.expect("no KV left held");
    cluster.stop().await.expect("stop");
}
