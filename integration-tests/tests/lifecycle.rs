//! Cancellation, deadlines and capacity, checked against the decode node's own slot and block
//! counts. These use the real model, whose decode is slow enough (milliseconds per token) for a
//! generation to be caught mid-flight.

use std::time::{Duration, Instant};

use tandem_integration_tests::{
    Cluster, ClusterConfig, collect, default_model, greedy, metrics, sample,
};
use tandem_proto::v1 as pb;
use tonic::Code;

fn long_request() -> pb::GenerateRequest {
    let mut r = greedy((0..64).map(|i| 1000 + i * 13).collect(), 2000);
    r.sampling.as_mut().expect("sampling").stop.clear();
    r
}

async fn until_idle(cluster: &Cluster) -> Duration {
    cluster.until_decode_idle(0).await.expect("idle")
}

async fn cluster(slots: usize) -> Cluster {
    let model = default_model().expect("the default model (run `tandem model fetch`)");
    Cluster::start(ClusterConfig {
        decode_slots: slots,
        ..ClusterConfig::new(model)
    })
    .await
    .expect("cluster")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_stream_frees_the_slot_and_kv_within_200ms() {
    let cluster = cluster(4).await;
    let mut client = cluster.client();
    let mut frames = client
        .generate(long_request())
        .await
        .expect("call")
        .into_inner();
    for _ in 0..3 {
        frames
            .message()
            .await
            .expect("frame")
            .expect("not finished");
    }
    let load = cluster.decode_load(0).await.expect("load");
    assert_eq!(load.active, 1, "the generation holds a slot while it runs");
    assert!(load.kv_blocks_free < load.kv_blocks_total);
    drop(frames);
    let freed = until_idle(&cluster).await;
    assert!(freed < Duration::from_millis(200), "freed after {freed:?}");
    cluster.stop().await.expect("clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_ends_the_stream_and_frees_everything() {
    let cluster = cluster(4).await;
    let mut client = cluster.client();
    let mut request = tonic::Request::new(long_request());
    request.set_timeout(Duration::from_millis(400));
    let started = Instant::now();
    let status = collect(&mut client, request).await.expect_err("deadline");
    let took = started.elapsed();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(took < Duration::from_millis(1400), "ended after {took:?}");
    until_idle(&cluster).await;
    cluster.stop().await.expect("clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_decode_node_answers_resource_exhausted() {
    let cluster = cluster(1).await;
    let mut first_client = cluster.client();
    let mut first = first_client
        .generate(long_request())
        .await
        .expect("call")
        .into_inner();
    first.message().await.expect("frame").expect("running");

    let mut client = cluster.client();
    let status = collect(&mut client, greedy(vec![1000, 1001, 1002], 4))
        .await
        .expect_err("no slot");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("slots"), "{status:?}");
    // With retry pushback (gRPC A6), which the client must see on the stream's status.
    assert!(
        status.metadata().get("grpc-retry-pushback-ms").is_some(),
        "{status:?}"
    );

    drop(first);
    until_idle(&cluster).await;
    // With the slot back, the same request succeeds.
    let ok = collect(&mut client, greedy(vec![1000, 1001, 1002], 4))
        .await
        .expect("slot free again");
    assert_eq!(
        ok.last.usage.expect("usage").completion_tokens as usize,
        ok.token_ids.len()
    );
    until_idle(&cluster).await;
    cluster.stop().await.expect("clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_with_one_id_at_the_same_instant_start_one_generation() {
    const CLIENTS: usize = 8;
    let cluster = cluster(16).await;
    let mut request = greedy((0..32).map(|i| 2000 + i).collect(), 48);
    request.request_id = "same-id".into();
    // Every client is released at once by the barrier; none waits for another.
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(CLIENTS));
    let calls = (0..CLIENTS).map(|_| {
        let (mut client, request, barrier) = (cluster.client(), request.clone(), barrier.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            collect(&mut client, request).await
        })
    });
    let results = futures::future::join_all(calls).await;
    let first = results[0].as_ref().expect("task").clone().expect("stream");
    for r in &results {
        assert_eq!(r.as_ref().expect("task").as_ref().expect("stream"), &first);
    }
    // One generation ran: the decode node produced the tokens once, and the prefill node
    // computed the prompt once.
    let text = metrics(cluster.decode[0].addr).await.expect("metrics");
    let produced = sample(&text, "tandem_decode_tokens_total").expect("tokens metric");
    assert_eq!(produced as usize, first.token_ids.len());
    let text = metrics(cluster.prefill[0].addr).await.expect("metrics");
    let computed = sample(&text, "tandem_prefill_tokens_total").expect("tokens metric");
    assert_eq!(computed as usize, 32);
    cluster.stop().await.expect("clean stop");
}
