//! Cancellation, deadlines and capacity, checked against the decode node's own slot and block
//! counts. These use the real model, whose decode is slow enough (milliseconds per token) for a
//! generation to be caught mid-flight.

use std::time::{Duration, Instant};

use tandem_integration_tests::{
    Cluster, ClusterConfig, collect, greedy, metrics, sample, smollm2_model,
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
    let model = smollm2_model().expect("SmolLM2 (run `tandem model fetch smollm2`)");
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
async fn a_full_decode_node_queues_in_the_router_and_past_the_queue_refuses_at_once() {
    // One batch slot, so four places on the decode node, and KV for all four long requests
    // (64 MiB holds one); the router holds 6 requests in all.
    let model = smollm2_model().expect("SmolLM2 (run `tandem model fetch smollm2`)");
    let config = ClusterConfig::new(model);
    let cluster = Cluster::start(ClusterConfig {
        decode_slots: 1,
        max_inflight: 6,
        engine: tandem_engine::EngineConfig {
            kv_budget_bytes: 512 << 20,
            ..config.engine.clone()
        },
        ..config
    })
    .await
    .expect("cluster");
    let long = fill(&cluster).await;

    // Two more wait in the router's queue instead of being refused ...
    let short = |k: u32| greedy(vec![1000 + k, 1001, 1002], 4);
    let queued: Vec<_> = (0..2)
        .map(|k| {
            let mut client = cluster.client();
            tokio::spawn(async move { collect(&mut client, short(k)).await })
        })
        .collect();
    let router = cluster.router.addr;
    let started = Instant::now();
    let text = loop {
        let text = metrics(router).await.expect("metrics");
        if sample(&text, "tandem_router_queued_requests") == Some(2.0) {
            break text;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{text}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(
        sample(&text, "tandem_requests_total{code=\"ResourceExhausted\"}"),
        Some(0.0)
    );
    // ... and past the router's bound the answer is immediate, with retry pushback.
    let started = Instant::now();
    let status = collect(&mut cluster.client(), short(9))
        .await
        .expect_err("past the queue");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        started.elapsed() < Duration::from_millis(100),
        "{:?}",
        started.elapsed()
    );
    assert!(
        status.metadata().get("grpc-retry-pushback-ms").is_some(),
        "{status:?}"
    );

    // Places free up, after the queued requests waited half a second at least: they are
    // served, exactly as they would be alone.
    tokio::time::sleep(Duration::from_millis(500)).await;
    drop(long);
    for (k, q) in queued.into_iter().enumerate() {
        let out = q.await.expect("task").expect("served after queueing");
        let alone = collect(&mut cluster.client(), short(k as u32))
            .await
            .expect("alone");
        assert_eq!(out.token_ids, alone.token_ids);
    }

    // With the node full again, the queue predicts a wait of a quarter second at least (half a
    // second behind one request): a request with a deadline 100 ms away is refused at once,
    // not left to time out in the queue.
    until_idle(&cluster).await;
    let long = fill(&cluster).await;
    let mut hurried = tonic::Request::new(short(7));
    hurried.set_timeout(Duration::from_millis(100));
    let started = Instant::now();
    let status = collect(&mut cluster.client(), hurried)
        .await
        .expect_err("a deadline the queue cannot meet");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("deadline"), "{status:?}");
    assert!(
        started.elapsed() < Duration::from_millis(100),
        "{:?}",
        started.elapsed()
    );
    let text = metrics(router).await.expect("metrics");
    for (reason, count) in [("queue_full", 1.0), ("deadline", 1.0)] {
        assert_eq!(
            sample(
                &text,
                &format!("tandem_router_refused_requests_total{{reason=\"{reason}\"}}")
            ),
            Some(count),
            "{text}"
        );
    }
    drop(long);
    until_idle(&cluster).await;
    cluster.stop().await.expect("clean stop");
}

/// Four long generations take a one-slot decode node's places: one decodes, three wait for the
/// slot. Dropping the streams ends them.
async fn fill(cluster: &Cluster) -> Vec<tonic::Streaming<pb::GenerateResponse>> {
    let mut long = Vec::new();
    for _ in 0..4 {
        let mut frames = cluster
            .client()
            .generate(long_request())
            .await
            .expect("call")
            .into_inner();
        frames.message().await.expect("frame").expect("admitted");
        long.push(frames);
    }
    let started = Instant::now();
    loop {
        let load = cluster.decode_load(0).await.expect("load");
        if (load.active, load.queued, load.capacity) == (1, 3, 4) {
            return long;
        }
        assert!(started.elapsed() < Duration::from_secs(5), "{load:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
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
