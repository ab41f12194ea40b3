//! Simulated nodes that send their KV as headers only (`tandem sim --kv-header-only`): a prompt
//! pushed from prefill to decode moves no KV bytes, yet the transfer runs its whole protocol and
//! the reply is the one the same simulated cluster gives with every byte sent; and a router
//! never pairs a header-only node with one that sends bytes.

use std::sync::Arc;

use tandem_engine::{EngineConfig, Model, ModelSource, TimingProfile};
use tandem_integration_tests::{Cluster, ClusterConfig, collect, metrics, sample};
use tandem_proto::v1 as pb;

const PROMPT: usize = 90;

fn model() -> Arc<Model> {
    // Quick passes: the test is about what moves, not when.
    let profile = TimingProfile {
        model: "tiny".into(),
        cpu: "test".into(),
        threads: 1,
        passes: vec![(1, 0.001), (64, 0.004)],
        attend_s: 0.0,
    };
    ModelSource::TINY
        .load_simulated(profile)
        .expect("simulated tiny model")
}

fn request() -> pb::GenerateRequest {
    pb::GenerateRequest {
        token_ids: (0..PROMPT as u32).map(|i| 3 + (i * 7) % 150).collect(),
        sampling: Some(pb::SamplingParams {
            max_tokens: 16,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A cluster that always prefills remotely, so the KV crosses the wire; the prefill node
/// header-only when `prefill`, the decode node when `decode`.
fn config(model: Arc<Model>, prefill: bool, decode: bool) -> ClusterConfig {
    let base = ClusterConfig::new(model);
    ClusterConfig {
        engine: EngineConfig {
            kv_header_only: decode,
            ..base.engine.clone()
        },
        prefill_kv_header_only: Some(prefill),
        policy: tandem_router::PolicyKind::RoundRobin,
        ..base
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_only_kv_moves_no_bytes_and_decodes_the_same_reply() {
    let mut replies = Vec::new();
    let model = model();
    let full = (PROMPT * model.config.kv_layout(Default::default()).token_bytes()) as f64;
    for header_only in [false, true] {
        let cluster = Cluster::start(config(model.clone(), header_only, header_only))
            .await
            .expect("cluster");
        let out = collect(&mut cluster.client(), request())
            .await
            .expect("generation");
        let route = out.last.route.as_ref().expect("route");
        assert_eq!(route.disaggregation, "remote", "{route:?}");
        let text = metrics(cluster.decode[0].addr).await.expect("metrics");
        let transfers = sample(&text, "tandem_kv_transfer_duration_seconds_count");
        assert_eq!(transfers, Some(1.0), "one push: {text}");
        let bytes = sample(&text, "tandem_kv_transfer_bytes_total").unwrap_or_default();
        assert_eq!(bytes, if header_only { 0.0 } else { full });
        replies.push(out.token_ids);
        cluster.stop().await.expect("stop");
    }
    assert_eq!(replies[0].len(), 16);
    assert_eq!(replies[0], replies[1]);
}

/// Workers say `kv_dtype: "none"` in `Worker.Info`, so a router refuses to pair a header-only
/// prefill node with a decode node that expects bytes, up front and saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_only_node_is_never_paired_with_one_that_sends_bytes() {
    let cluster = Cluster::launch(config(model(), true, false))
        .await
        .expect("cluster");
    let started = std::time::Instant::now();
    loop {
        let status = collect(&mut cluster.client(), request())
            .await
            .expect_err("a dtype mismatch cannot generate");
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        if status.message().contains("KV dtype") {
            break;
        }
        assert!(started.elapsed().as_secs() < 20, "{status:?}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let text = metrics(cluster.decode[0].addr).await.expect("metrics");
    assert_eq!(
        sample(&text, "tandem_kv_transfer_duration_seconds_count"),
        Some(0.0)
    );
    cluster.stop().await.expect("stop");
}
