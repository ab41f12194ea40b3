//! What operators see: Prometheus metrics on every node's port, server reflection on the router,
//! and a graceful shutdown that lets a running stream finish.

use tandem_integration_tests::{Cluster, ClusterConfig, collect, greedy, metrics, sample};
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_reflection_report_what_happened() {
    let model = tandem_engine::ModelSource::TINY.load().expect("tiny");
    let kv_bytes_per_token = model
        .config
        .kv_layout(tandem_engine::KvDtype::F16)
        .token_bytes();
    let cluster = Cluster::start(ClusterConfig::new(model))
        .await
        .expect("cluster");
    let prompt: Vec<u32> = (0..37).map(|i| 3 + i * 5).collect();
    let out = collect(&mut cluster.client(), greedy(prompt.clone(), 6))
        .await
        .expect("generate");

    let router = metrics(cluster.router.addr).await.expect("router metrics");
    assert_eq!(sample(&router, "tandem_ttft_seconds_count"), Some(1.0));
    assert_eq!(
        sample(&router, "tandem_inter_token_seconds_count"),
        Some(out.frames as f64 - 1.0)
    );
    assert_eq!(sample(&router, "tandem_queue_seconds_count"), Some(1.0));
    // The request is counted as its task ends, a moment after the client has the last frame.
    let counted = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        loop {
            let text = metrics(cluster.router.addr).await.expect("router metrics");
            if sample(&text, "tandem_requests_total{code=\"Ok\"}") == Some(1.0) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(counted.is_ok(), "the request was never counted as Ok");

    let prefill = metrics(cluster.prefill[0].addr)
        .await
        .expect("prefill metrics");
    assert_eq!(sample(&prefill, "tandem_prefill_tokens_total"), Some(37.0));
    assert_eq!(sample(&prefill, "tandem_prefill_queue_depth"), Some(0.0));
    assert_eq!(
        sample(&prefill, "tandem_prefill_tokens_per_second_count"),
        Some(1.0)
    );

    let decode = metrics(cluster.decode[0].addr)
        .await
        .expect("decode metrics");
    assert_eq!(
        sample(&decode, "tandem_kv_transfer_bytes_total"),
        Some((37 * kv_bytes_per_token) as f64)
    );
    assert_eq!(
        sample(&decode, "tandem_kv_transfer_duration_seconds_count"),
        Some(1.0)
    );
    // The scheduler publishes its gauges after the step that sent the final frame, so they
    // settle a moment after the client has its answer.
    let settled = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        loop {
            let text = metrics(cluster.decode[0].addr)
                .await
                .expect("decode metrics");
            if sample(&text, "tandem_decode_active_slots") == Some(0.0)
                && sample(&text, "tandem_decode_kv_blocks_in_use") == Some(0.0)
            {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(
        settled.is_ok(),
        "active slots and blocks in use never returned to 0"
    );
    assert!(sample(&decode, "tandem_decode_kv_blocks_free").is_some_and(|v| v > 0.0));
    assert!(sample(&decode, "tandem_decode_steps_total").is_some_and(|v| v >= 1.0));

    let mut reflection = ServerReflectionClient::new(cluster.router.channel());
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut replies = reflection
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .expect("reflection")
        .into_inner();
    let reply = replies.message().await.expect("reply").expect("one reply");
    let Some(MessageResponse::ListServicesResponse(list)) = reply.message_response else {
        panic!("unexpected reflection reply {reply:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for want in ["tandem.v1.Generation", "grpc.health.v1.Health"] {
        assert!(
            names.iter().any(|n| n == want),
            "{want} missing from {names:?}"
        );
    }
    cluster.stop().await.expect("clean stop");
}

/// Every series `deploy/grafana/tandem.json` queries is exported by some node of a cluster that
/// has served a request (and the cluster's prefix-cache counters add up).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_queries_only_exported_metrics() {
    let model = tandem_engine::ModelSource::TINY.load().expect("tiny");
    let cluster = Cluster::start(ClusterConfig::new(model))
        .await
        .expect("cluster");
    let prompt: Vec<u32> = (0..40).map(|i| 3 + i * 5).collect();
    for _ in 0..2 {
        collect(&mut cluster.client(), greedy(prompt.clone(), 4))
            .await
            .expect("generate");
    }
    let mut exported = std::collections::BTreeSet::new();
    for addr in [
        cluster.router.addr,
        cluster.prefill[0].addr,
        cluster.decode[0].addr,
    ] {
        let text = metrics(addr).await.expect("metrics");
        exported.extend(
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .filter_map(|l| l.split(['{', ' ']).next())
                .map(str::to_string),
        );
    }
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/grafana/tandem.json");
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("read the dashboard"))
            .expect("the dashboard is JSON");
    let mut queried = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("expr");
            let mut rest = expr;
            while let Some(at) = rest.find("tandem_") {
                let name: String = rest[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[at + name.len()..];
                queried.push((panel["title"].clone(), name));
            }
        }
    }
    assert!(queried.len() >= 20, "{queried:?}");
    for (panel, name) in &queried {
        assert!(
            exported.contains(name),
            "panel {panel} queries {name}, which no node exports"
        );
    }
    // The second request found the first one's prompt cached.
    let router = metrics(cluster.router.addr).await.expect("router metrics");
    let prompt_tokens = sample(&router, "tandem_router_prompt_tokens_total").expect("prompt");
    let cached = sample(&router, "tandem_router_cached_prompt_tokens_total").expect("cached");
    assert_eq!(prompt_tokens, 80.0);
    assert!((32.0..40.0).contains(&cached), "{cached}");
    cluster.stop().await.expect("clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_a_running_stream_to_its_final_frame() {
    let model = tandem_integration_tests::smollm2_model().expect("SmolLM2");
    let cluster = Cluster::start(ClusterConfig {
        grace: std::time::Duration::from_secs(30),
        ..ClusterConfig::new(model)
    })
    .await
    .expect("cluster");
    let mut client = cluster.client();
    let mut frames = client
        .generate(greedy((0..40).map(|i| 1000 + i).collect(), 100))
        .await
        .expect("call")
        .into_inner();
    frames.message().await.expect("frame").expect("running");
    // Shut down while the generation runs: it must still end with its final frame.
    let stopping = tokio::spawn(cluster.stop());
    let mut last = None;
    while let Some(f) = frames.message().await.expect("no error while draining") {
        last = Some(f);
    }
    let last = last.expect("frames after shutdown began");
    assert!(
        last.usage.is_some(),
        "the stream ended with its final frame"
    );
    stopping.await.expect("join").expect("clean stop");
}

/// Every worker exposes the Gateway API Inference Extension's model-server gauges under the
/// protocol's names, with what its `Worker.Load` says: requests waiting and running, the KV
/// pool's use as a fraction, and the block size and pool blocks as labels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_expose_the_model_server_protocols_gauges() {
    let model = tandem_engine::ModelSource::TINY.load().expect("tiny");
    let cluster = Cluster::start(ClusterConfig::new(model))
        .await
        .expect("cluster");
    let prompt: Vec<u32> = (0..70).map(|i| 3 + (i * 5) % 250).collect();
    collect(&mut cluster.client(), greedy(prompt, 6))
        .await
        .expect("generate");
    cluster.until_decode_idle(0).await.expect("idle");
    let load = cluster.decode_load(0).await.expect("load");
    let text = metrics(cluster.decode[0].addr).await.expect("metrics");
    assert_eq!(sample(&text, "vllm:num_requests_waiting"), Some(0.0));
    assert_eq!(sample(&text, "vllm:num_requests_running"), Some(0.0));
    let usage = sample(&text, "vllm:kv_cache_usage_perc").expect("usage");
    let used = (load.kv_blocks_total - load.kv_blocks_free) as f64;
    assert_eq!(usage, used / load.kv_blocks_total as f64, "{load:?}");
    let info = format!(
        "vllm:cache_config_info{{block_size=\"16\",num_gpu_blocks=\"{}\"}}",
        load.kv_blocks_total
    );
    assert_eq!(sample(&text, &info), Some(1.0), "{text}");
    // A prefill node has them too.
    let text = metrics(cluster.prefill[0].addr).await.expect("metrics");
    for name in ["vllm:num_requests_waiting", "vllm:num_requests_running"] {
        assert_eq!(sample(&text, name), Some(0.0), "{name}");
    }
    cluster.stop().await.expect("stop");
}
