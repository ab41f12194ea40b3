//! KV moving between workers of one role at a drain, through a whole cluster. A draining decode
//! node's cached sessions move to its peer: the router takes the node's offer
//! (`Worker.Sessions`) and asks the peer to take each (`Worker.Adopt`), which fetches the KV, so
//! the sessions' next turns are hits there (the tiny model). A draining prefill node's hottest
//! prompts move to its peer the same way. And under faults: the holder cut off while its sessions move
//! (the tiny model), a drain racing the clients' cancels, and a drain whose only peer is full
//! (SmolLM2, whose streams run long enough to be caught by a drain). In each, every stream that
//! completes says exactly what the fault-free run said, none hangs, and no node is left holding
//! a request's KV blocks. (A spill file damaged on disk is in `kv_spill.rs`.)

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_engine::Model;
use tandem_integration_tests::{
    Cluster, ClusterConfig, Collected, Node, collect, finish, greedy, metrics, open, sample,
    smollm2_model,
};
use tandem_proto::v1 as pb;

const MOVED_DECODE: &str = "tandem_router_moved_sessions_total{role=\"decode\"}";
const MOVED_DECODE_TOKENS: &str = "tandem_router_moved_session_tokens_total{role=\"decode\"}";
const MOVED_PREFILL: &str = "tandem_router_moved_sessions_total{role=\"prefill\"}";
const MOVED_PREFILL_TOKENS: &str = "tandem_router_moved_session_tokens_total{role=\"prefill\"}";

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

/// The value of a counter on the server at `addr` (0 when absent).
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

/// Waits for a drained node's stop: it ends within the hand-off bound, cleanly.
async fn drain_ends(stopping: tokio::task::JoinHandle<anyhow::Result<()>>) {
    tokio::time::timeout(Duration::from_secs(30), stopping)
        .await
        .expect("the drain ends within its bound")
        .expect("the drained node's task")
        .expect("the drained node stops cleanly");
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

/// Turn 2 of each session, in order.
async fn second_turns(cluster: &Cluster, prompts: &[Vec<u32>]) -> Vec<Collected> {
    let mut client = cluster.client();
    let mut out = Vec::new();
    for (s, p) in prompts.iter().enumerate() {
        out.push(
            collect(&mut client, turn(s, p.clone(), 16))
                .await
                .expect("turn 2 completes"),
        );
    }
    out
}

/// The tokens a cluster without caches answers to each turn-2 prompt.
async fn cold_answers(prompts: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let cold = Cluster::start(ClusterConfig {
        prefix_cache: false,
        ..config(tiny())
    })
    .await
    .expect("cold cluster");
    let answers = second_turns(&cold, prompts).await;
    cold.stop().await.expect("stop");
    answers.into_iter().map(|c| c.token_ids).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_decode_node_moves_its_cached_sessions_to_its_peer() {
    let mut cluster = Cluster::start(config(tiny())).await.expect("cluster");
    let (prompts, homes) = first_turns(&cluster, 6).await;
    let seen = |i: usize| cluster.decode[i].addr.to_string();
    let (drained, moving) = busiest(&homes, seen, 2);
    let drained_addr = seen(drained);
    let node = cluster.decode.remove(drained);
    node.stop()
        .await
        .expect("the drained node stops cleanly once its sessions were fetched");
    let (router, peer) = (cluster.router.addr, cluster.decode[0].addr);
    until(Duration::from_secs(20), "every session moved", || async {
        counter(router, MOVED_DECODE).await >= moving as f64
    })
    .await;
    let adopted = counter(peer, "tandem_decode_adopted_tokens_total").await;
    assert_eq!(
        adopted,
        counter(router, MOVED_DECODE_TOKENS).await,
        "what the router counts moved is what the peer fetched"
    );
    assert!(adopted >= (moving * 128) as f64, "{adopted} tokens moved");

    // Turn 2 of each session that lived on the drained node is a hit on the peer.
    let got = second_turns(&cluster, &prompts).await;
    for (s, p) in prompts.iter().enumerate() {
        let usage = got[s].last.usage.expect("usage");
        // Turn 1's prompt and reply, but for the new message and the reply's last token (whose
        // KV was never computed), in whole blocks.
        let held = (p.len() - 7 - 1) / 16 * 16;
        if homes[s] == drained_addr {
            assert!(
                usage.cached_tokens as usize >= held,
                "session {s} moved with its KV: {usage:?}, {held} tokens held"
            );
        }
    }
    cluster.stop().await.expect("stop");
    let answers: Vec<Vec<u32>> = got.into_iter().map(|c| c.token_ids).collect();
    assert_eq!(
        answers,
        cold_answers(&prompts).await,
        "the cold run's tokens"
    );
}

/// A draining prefill node's prompts move to its peer's prefix cache (the router's counter, the
/// peer's, the peer's cache snapshot), and a prompt computed there from the moved KV says
/// exactly what it said the first time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_prefill_node_moves_its_hottest_prompts_to_its_peer() {
    let model = tiny();
    let mut cluster = Cluster::start(ClusterConfig {
        prefill: 2,
        ..ClusterConfig::new(model.clone())
    })
    .await
    .expect("cluster");
    let mut client = cluster.client();
    let (mut prompts, mut firsts, mut homes) = (Vec::new(), Vec::new(), Vec::new());
    for s in 0..6 {
        let prompt = tokens(120 + 30 * s, s);
        let reply = collect(&mut client, turn(s, prompt.clone(), 16))
            .await
            .expect("a cold prompt");
        let route = reply.last.route.expect("route");
        assert_eq!(route.disaggregation, "remote", "{route:?}");
        homes.push(route.prefill);
        prompts.push(prompt);
        firsts.push(reply.token_ids);
    }
    let seen = |i: usize| cluster.prefill[i].addr.to_string();
    let (drained, moving) = busiest(&homes, seen, 2);
    let drained_addr = seen(drained);
    cluster
        .prefill
        .remove(drained)
        .stop()
        .await
        .expect("the drained node stops cleanly once its prompts were fetched");
    let (router, peer) = (cluster.router.addr, &cluster.prefill[0]);
    until(Duration::from_secs(20), "every prompt moved", || async {
        counter(router, MOVED_PREFILL).await >= moving as f64
    })
    .await;
    let adopted = counter(peer.addr, "tandem_prefill_adopted_tokens_total").await;
    assert_eq!(
        adopted,
        counter(router, MOVED_PREFILL_TOKENS).await,
        "what the router counts moved is what the peer fetched"
    );
    assert!(adopted >= (moving * 112) as f64, "{adopted} tokens moved");
    let mut worker = pb::worker_client::WorkerClient::new(peer.channel());
    let snapshot = worker
        .cache_snapshot(pb::CacheSnapshotRequest {})
        .await
        .expect("snapshot")
        .into_inner();
    let fingerprint = &model.fingerprint.0;
    for (s, p) in prompts.iter().enumerate() {
        if homes[s] == drained_addr {
            let hashes = tandem_proto::block_hash::prompt_hashes(fingerprint, "", p);
            assert!(
                hashes.iter().all(|h| snapshot.hashes.contains(h)),
                "prompt {s} moved into the peer's prefix cache"
            );
        }
    }

    // With the decode node's session cache gone, each moved prompt is computed on the peer
    // from the KV it adopted, and says what it said before.
    cluster.restart_decode(0).await.expect("restart");
    cluster
        .wait_ready(Duration::from_secs(20))
        .await
        .expect("ready");
    let mut client = cluster.client();
    for (s, p) in prompts.iter().enumerate() {
        if homes[s] != drained_addr {
            continue;
        }
        let again = collect(&mut client, turn(s, p.clone(), 16))
            .await
            .expect("the prompt again");
        let usage = again.last.usage.expect("usage");
        let whole = tandem_proto::block_hash::reusable_blocks(p.len()) * 16;
        assert_eq!(
            usage.prefill_cached_tokens as usize, whole,
            "prompt {s} found in the peer's cache: {usage:?}"
        );
        assert_eq!(
            again.token_ids, firsts[s],
            "prompt {s}: the first run's tokens"
        );
    }
    cluster.stop().await.expect("stop");
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
    drain_ends(stopping).await;

    let answers: Vec<Vec<u32>> = second_turns(&cluster, &prompts)
        .await
        .into_iter()
        .map(|c| c.token_ids)
        .collect();
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
        streams.push(open(&mut client, r.clone(), 5).await.expect("frames"));
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
    for (i, (frames, got)) in kept {
        let got = finish(frames, got)
            .await
            .expect("no error reaches the client");
        assert_eq!(
            got.token_ids, want[i].token_ids,
            "stream {i}: the fault-free tokens"
        );
    }
    drain_ends(stopping).await;
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
    let (frames, got) = open(&mut client, victim, 3).await.expect("frames");
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
    let got = finish(frames, got)
        .await
        .expect("no error reaches the client");
    let route = got.last.route.expect("route");
    assert_eq!(route.attempts, 2, "one hand-off: {route:?}");
    assert_eq!(got.token_ids, want.token_ids, "the fault-free tokens");
    for f in fillers {
        assert_eq!(f.await.expect("filler task").expect("filler stream"), 150);
    }
    drain_ends(stopping).await;
    cluster.until_decode_idle(0).await.expect("no KV left held");
    cluster.stop().await.expect("stop");
}
