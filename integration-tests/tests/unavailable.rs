//! A dead replica is a clean UNAVAILABLE for the client, never UNKNOWN or INTERNAL.

use std::time::Duration;

use tandem_integration_tests::{Cluster, ClusterConfig, collect, greedy};
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_fail_unavailable_when_a_role_has_no_live_replica() {
    let model = tandem_engine::ModelSource::Tiny.load().expect("tiny");
    let mut cluster = Cluster::start(ClusterConfig::new(model))
        .await
        .expect("cluster");
    let mut client = cluster.client();
    collect(&mut client, greedy(vec![5, 6, 7], 3))
        .await
        .expect("healthy cluster");

    for role in ["prefill", "decode"] {
        let node = if role == "prefill" {
            cluster.prefill.remove(0)
        } else {
            cluster.decode.remove(0)
        };
        node.stop().await.expect("stop");
        let status = tokio::time::timeout(
            Duration::from_secs(10),
            collect(&mut client, greedy(vec![5, 6, 7], 3)),
        )
        .await
        .expect("no hang")
        .expect_err("no live replica");
        assert_eq!(status.code(), Code::Unavailable, "{role}: {status:?}");
    }
    cluster.stop().await.expect("clean stop");
}
