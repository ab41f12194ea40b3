//! The cache's disk tier through a cluster: a conversation pushed out of every KV pool by other
//! traffic, or held by a decode node that restarts, comes back from disk on its next turn, which
//! computes only what follows its history and says exactly what a cluster without caches says.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tandem_engine::{EngineConfig, KvDtype, SpillConfig};
use tandem_integration_tests::{
    Cluster, ClusterConfig, SpillDir, collect, greedy, metrics, sample,
};
use tandem_proto::v1 as pb;

/// A cluster whose decode pool holds 24 blocks (the prefill node's, 12), with the disk tier
/// under `spill` when given and caches off when not.
fn config(spill: Option<&Path>) -> ClusterConfig {
    let model = tandem_engine::ModelSource::TINY.load().expect("tiny");
    let block = model.config.kv_layout(KvDtype::F16).block_bytes();
    let base = ClusterConfig::new(model);
    ClusterConfig {
        engine: EngineConfig {
            kv_budget_bytes: 24 * block,
            spill: spill.map(|dir| SpillConfig {
                dir: dir.into(),
                max_bytes: 1 << 30,
            }),
            ..base.engine.clone()
        },
        prefix_cache: spill.is_some(),
        ..base
    }
}

fn turn(session: &str, tokens: Vec<u32>) -> pb::GenerateRequest {
    pb::GenerateRequest {
        session_id: session.into(),
        ..greedy(tokens, 8)
    }
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 3 + (i * 7 + salt * 31) % 200)
        .collect()
}

/// The sum of a counter over the cluster's workers.
async fn counter(cluster: &Cluster, suffix: &str) -> f64 {
    let mut total = 0.0;
    for (nodes, role) in [(&cluster.prefill, "prefill"), (&cluster.decode, "decode")] {
        for n in nodes.iter() {
            let text = metrics(n.addr).await.expect("metrics");
            total += sample(&text, &format!("tandem_{role}_kv_spill_{suffix}")).unwrap_or(0.0);
        }
    }
    total
}

/// The tokens a cluster without caches answers `request` with.
async fn cold(request: pb::GenerateRequest) -> Vec<u32> {
    let cold = Cluster::start(config(None)).await.expect("cold cluster");
    let expected = collect(&mut cold.client(), request)
        .await
        .expect("cold turn");
    assert_eq!(expected.last.usage.expect("usage").cached_tokens, 0);
    cold.stop().await.expect("stop");
    expected.token_ids
}

/// Turn 1's prompt, its reply, and 10 new tokens.
fn follow_up(first: &[u32], reply: &[u32]) -> Vec<u32> {
    let mut second = first.to_vec();
    second.extend(reply);
    second.extend(tokens(10, 9));
    second
}

/// Turn 1 of a conversation (64 prompt tokens and an 8-token reply), then six other
/// conversations of 96 tokens each, which need 36 blocks of a 24-block pool: the first one's
/// blocks are evicted, to disk. Returns turn 2's prompt once they are there.
async fn push_out(cluster: &Cluster) -> Vec<u32> {
    let mut client = cluster.client();
    let first = tokens(64, 1);
    let reply = collect(&mut client, turn("talk", first.clone()))
        .await
        .expect("turn 1");
    for salt in 2..8 {
        collect(
            &mut client,
            turn(&format!("other-{salt}"), tokens(96, salt)),
        )
        .await
        .expect("other conversation");
    }
    let start = Instant::now();
    while counter(cluster, "stored_blocks_total").await < 4.0 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "nothing was spilled"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    follow_up(&first, &reply.token_ids)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_pushed_out_of_the_pools_comes_back_from_disk_exactly() {
    let dir = SpillDir::new();
    let cluster = Cluster::start(config(Some(&dir.0))).await.expect("cluster");
    let mut client = cluster.client();
    let second = push_out(&cluster).await;

    // Turn 2 extends turn 1's history.
    let restored_before = counter(&cluster, "restored_blocks_total").await;
    let warm = collect(&mut client, turn("talk", second.clone()))
        .await
        .expect("turn 2");
    let restored = counter(&cluster, "restored_blocks_total").await - restored_before;
    let usage = warm.last.usage.expect("usage");
    assert!(restored >= 4.0, "{restored} blocks came back from disk");
    assert!(
        usage.cached_tokens >= 64,
        "turn 1's prompt is not computed again: {usage:?}"
    );
    // The cache events said where the blocks went: the router's index knew them on disk.
    let route = warm.last.route.expect("route");
    assert!(route.decode_overlap_tokens >= 64, "{route:?}");
    assert_eq!(counter(&cluster, "corrupt_blocks_total").await, 0.0);
    cluster.stop().await.expect("stop");
    assert_eq!(
        warm.token_ids,
        cold(turn("talk", second)).await,
        "restored KV gives the cold run's tokens"
    );
}

/// Every block file (`<hash>.kv`) the disk tiers under `dir` keep.
fn spill_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(spill_files(&path));
        } else if path.extension().is_some_and(|e| e == "kv") {
            out.push(path);
        }
    }
    out
}

/// Every spilled block damaged on disk (a bit flipped in its KV bytes) while the cluster runs:
/// the conversation's next turn reads none of them back, computes its history again, and says
/// what a cluster without caches says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spill_files_damaged_on_disk_are_computed_again_not_served() {
    let dir = SpillDir::new();
    let cluster = Cluster::start(config(Some(&dir.0))).await.expect("cluster");
    let mut client = cluster.client();
    let second = push_out(&cluster).await;
    // The tiers write off their step loops: wait until they are done.
    let mut stored = counter(&cluster, "stored_blocks_total").await;
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = counter(&cluster, "stored_blocks_total").await;
        if now == stored {
            break;
        }
        stored = now;
    }
    let files = spill_files(&dir.0);
    assert!(files.len() >= 4, "{} files on disk", files.len());
    for f in &files {
        let mut bytes = std::fs::read(f).expect("read a spill file");
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x10;
        std::fs::write(f, bytes).expect("damage a spill file");
    }

    let got = collect(&mut client, turn("talk", second.clone()))
        .await
        .expect("turn 2");
    assert!(
        counter(&cluster, "corrupt_blocks_total").await >= 1.0,
        "the damage was caught"
    );
    assert_eq!(
        counter(&cluster, "restored_blocks_total").await,
        0.0,
        "no damaged block was served"
    );
    cluster.stop().await.expect("stop");
    assert_eq!(
        got.token_ids,
        cold(turn("talk", second)).await,
        "the cold run's tokens"
    );
}

/// A rolling restart of the decode node keeps its sessions: its cache goes to disk as it
/// stops, and the session's next turn on the new process comes back from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_decode_node_keeps_its_sessions_on_disk() {
    let dir = SpillDir::new();
    let mut cluster = Cluster::start(config(Some(&dir.0))).await.expect("cluster");
    let mut client = cluster.client();
    let first = tokens(64, 1);
    let reply = collect(&mut client, turn("talk", first.clone()))
        .await
        .expect("turn 1");
    cluster.restart_decode(0).await.expect("restart");
    cluster
        .wait_ready(Duration::from_secs(30))
        .await
        .expect("ready again");

    let second = follow_up(&first, &reply.token_ids);
    let warm = collect(&mut client, turn("talk", second.clone()))
        .await
        .expect("turn 2");
    let decode = metrics(cluster.decode[0].addr).await.expect("metrics");
    let restored = sample(&decode, "tandem_decode_kv_spill_restored_blocks_total").unwrap_or(0.0);
    let usage = warm.last.usage.expect("usage");
    assert!(restored >= 4.0, "{restored} blocks came back from disk");
    assert!(
        usage.decode_cached_tokens >= 64,
        "the new process holds turn 1's history: {usage:?}"
    );
    // The new process announced what it found on disk as it started.
    let route = warm.last.route.expect("route");
    assert!(route.decode_overlap_tokens >= 64, "{route:?}");
    cluster.stop().await.expect("stop");
    assert_eq!(warm.token_ids, cold(turn("talk", second)).await);
}
