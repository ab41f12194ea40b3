//! Without a prefill replica the decode nodes prefill locally; without a decode replica a
//! request is a clean UNAVAILABLE for the client, never UNKNOWN or INTERNAL.

use std::time::Duration;

use tandem_integration_tests::{Cluster, ClusterConfig, collect, greedy};
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_fail_unavailable_when_a_role_has_no_live_replica() {
    let model = tandem_engine::ModelSource::TINY.load().expect("tiny");
    let mut cluster = Cluster::start(ClusterConfig::new(model))
        .await
        .expect("cluster");
    let mut client = cluster.client();
    collect(&mut client, greedy(vec![5, 6, 7], 3))
        .await
        .expect("healthy cluster");

    let healthy = collect(&mut client, greedy(vec![5, 6, 7, 8], 3))
        .await
        .expect("healthy cluster");
    let route = healthy.last.route.as_ref().expect("route");
    assert_eq!(route.disaggregation, "remote", "{route:?}");

    cluster.prefill.remove(0).stop().await.expect("stop");
    let degraded = tokio::time::timeout(
        Duration::from_secs(10),
        collect(&mut client, greedy(vec![5, 6, 7, 8], 3)),
    )
    .await
    .expect("no hang")
    .expect("served by the decode node alone");
    assert_eq!(degraded.token_ids, healthy.token_ids);
    let route = degraded.last.route.as_ref().expect("route");
    assert_eq!(
        (route.disaggregation.as_str(), route.prefill.as_str()),
        ("local", ""),
        "{route:?}"
    );

    cluster.decode.remove(0).stop().await.expect("stop");
    let status = tokio::time::timeout(
        Duration::from_secs(10),
        collect(&mut client, greedy(vec![5, 6, 7], 3)),
    )
    .await
    .expect("no hang")
    .expect_err("no live replica");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    cluster.stop().await.expect("clean stop");
}
