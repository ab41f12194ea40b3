//! Hard limits, each refused before the work or memory it would cost, with a short error that
//! does not echo the input: prompt text bytes, prompt tokens, max_tokens, the router's gRPC
//! message size, the HTTP body size, ids on every node, and the KV wait a caller may ask a
//! decode node for. Undecodable requests get INVALID_ARGUMENT, not tonic's OUT_OF_RANGE or
//! INTERNAL. (KV bytes per transfer: `bad_kv.rs`; concurrent streams per key: `security.rs`.)

use std::time::{Duration, Instant};

use tandem_integration_tests::{Cluster, ClusterConfig, collect, greedy, post_json, stray_push};
use tandem_proto::v1 as pb;
use tonic::Code;

fn limits() -> tandem_router::Limits {
    tandem_router::Limits {
        prompt_bytes: 1000,
        prompt_tokens: 50,
        max_tokens: 20,
        grpc_message_bytes: 64 << 10,
        http_body_bytes: 8 << 10,
        ttft_targets: [None; 3],
    }
}

async fn cluster() -> Cluster {
    let model = tandem_engine::ModelSource::TINY.load().expect("tiny");
    Cluster::start(ClusterConfig {
        limits: limits(),
        max_kv_wait: Duration::from_millis(300),
        ..ClusterConfig::new(model)
    })
    .await
    .expect("cluster")
}

fn refused(what: &str, r: Result<impl std::fmt::Debug, tonic::Status>, field: &str, limit: &str) {
    let e = r.expect_err(what);
    assert_eq!(e.code(), Code::InvalidArgument, "{what}: {e:?}");
    assert!(e.message().contains(field), "{what}: {e:?}");
    assert!(e.message().contains(limit), "{what} names the limit: {e:?}");
    assert!(e.message().len() < 300, "{what}: a short error");
}

fn prompt(text: String, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        prompt: Some(text),
        sampling: Some(pb::SamplingParams {
            max_tokens,
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routers_limits_refuse_before_the_work() {
    let cluster = cluster().await;
    let mut client = cluster.client();

    let r = collect(&mut client, prompt("a ".repeat(600), 4)).await;
    refused("prompt text over 1000 bytes", r, "prompt", "1000");
    let messages = pb::GenerateRequest {
        messages: (0..3)
            .map(|_| pb::ChatMessage {
                role: "user".into(),
                content: "b".repeat(400),
                ..Default::default()
            })
            .collect(),
        ..prompt(String::new(), 4)
    };
    let r = collect(
        &mut client,
        pb::GenerateRequest {
            prompt: None,
            ..messages
        },
    )
    .await;
    refused("messages over 1000 bytes together", r, "messages", "1000");
    let r = collect(&mut client, prompt("word ".repeat(120), 4)).await;
    refused("a prompt of over 50 tokens", r, "prompt", "50");
    let r = collect(&mut client, greedy(vec![5; 51], 4)).await;
    refused("51 token ids", r, "token_ids", "50");
    let r = collect(&mut client, greedy(vec![5; 8], 21)).await;
    refused("max_tokens 21", r, "max_tokens", "20");
    let ok = collect(&mut client, greedy(vec![5; 50], 20)).await;
    assert!(ok.is_ok(), "at the limits: {ok:?}");

    // A gRPC message over the router's 64 KiB: INVALID_ARGUMENT, not OUT_OF_RANGE.
    let r = collect(&mut client, prompt("c".repeat(100 << 10), 4)).await;
    refused("a 100 KiB message", r, "message", "65536");

    // HTTP: an unset max_tokens is capped by the limit, and a body over 8 KiB gets 413.
    let http = reqwest::Client::new();
    let url = format!("http://{}/v1/completions", cluster.http);
    let body = serde_json::json!({"model": "tiny", "prompt": [5, 6, 7]});
    let reply = post_json(&http, &url, &body).await.expect("http");
    let completion = reply["usage"]["completion_tokens"].as_u64().expect("usage");
    assert!((1..=20).contains(&completion), "{reply}");
    let r = http
        .post(&url)
        .json(&serde_json::json!({"model": "tiny", "prompt": "d".repeat(9000)}))
        .send()
        .await
        .expect("http");
    assert_eq!(r.status(), 413);
    let e: serde_json::Value = r.json().await.expect("an OpenAI error object");
    assert!(
        e["error"]["message"]
            .as_str()
            .expect("message")
            .contains("8192"),
        "{e}"
    );

    // The router still serves.
    assert!(collect(&mut client, greedy(vec![5, 6], 2)).await.is_ok());
    cluster.stop().await.expect("stop");
}

/// A message whose field 1 is a varint where `GenerateRequest` (and `DecodeRequest`) have a
/// string: bytes that are not the message the method takes.
#[derive(Clone, PartialEq, prost::Message)]
struct NotTheMessage {
    #[prost(uint64, tag = "1")]
    x: u64,
}

async fn send_garbage(channel: tonic::transport::Channel, path: &'static str) -> tonic::Status {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let codec = tonic_prost::ProstCodec::<NotTheMessage, NotTheMessage>::default();
    let r = grpc
        .server_streaming(
            tonic::Request::new(NotTheMessage { x: 7 }),
            path.parse().expect("path"),
            codec,
        )
        .await;
    match r {
        Err(s) => s,
        Ok(mut stream) => stream
            .get_mut()
            .message()
            .await
            .expect_err("no frame for garbage"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_that_are_not_the_message_get_invalid_argument_on_every_node() {
    let cluster = cluster().await;
    let router = send_garbage(cluster.router.channel(), "/tandem.v1.Generation/Generate").await;
    assert_eq!(router.code(), Code::InvalidArgument, "{router:?}");
    let decode = send_garbage(cluster.decode[0].channel(), "/tandem.v1.Decode/Generate").await;
    assert_eq!(decode.code(), Code::InvalidArgument, "{decode:?}");
    cluster.stop().await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_bound_ids_and_the_kv_wait() {
    let cluster = cluster().await;
    let long = "x".repeat(1 << 20);

    // Ids over 256 bytes, on the decode node, the prefill node and the KV receiver.
    let mut decode = pb::decode_client::DecodeClient::new(cluster.decode[0].channel());
    let r = decode
        .generate(pb::DecodeRequest {
            request_id: "r".into(),
            transfer_id: long.clone(),
            prompt_token_ids: vec![5, 6, 7],
            sampling: Some(pb::SamplingParams {
                max_tokens: 2,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .map(|_| ());
    refused("a 1 MB transfer id on decode", r, "transfer_id", "256");
    let mut prefill = pb::prefill_client::PrefillClient::new(cluster.prefill[0].channel());
    let r = prefill
        .prefill(pb::PrefillRequest {
            request_id: long.clone(),
            transfer_id: "t".into(),
            token_ids: vec![5, 6, 7],
            decode_addr: cluster.decode[0].addr.to_string(),
            ..Default::default()
        })
        .await
        .map(|_| ());
    refused("a 1 MB request id on prefill", r, "request_id", "256");
    let text = stray_push(cluster.decode[0].channel(), &"t".repeat(300))
        .await
        .to_string();
    assert!(
        text.contains("transfer_id") && text.contains("256"),
        "{text}"
    );
    assert!(text.len() < 300, "{text}");

    // A caller asking for a 49-day KV wait gets the node's ceiling (300 ms here): the
    // reservation, and the KV blocks it holds, are released instead of held.
    let baseline = cluster.decode_load(0).await.expect("load");
    let started = Instant::now();
    let mut stream = decode
        .generate(pb::DecodeRequest {
            request_id: "idle".into(),
            transfer_id: "never-pushed".into(),
            prompt_token_ids: (0..64).collect(),
            sampling: Some(pb::SamplingParams {
                max_tokens: 500,
                ..Default::default()
            }),
            kv_wait_ms: u32::MAX,
            ..Default::default()
        })
        .await
        .expect("admitted")
        .into_inner();
    let ended = loop {
        match tokio::time::timeout(Duration::from_secs(20), stream.message()).await {
            Ok(Ok(Some(_))) => continue,
            Ok(other) => break other,
            Err(_) => panic!("the reservation was held for 20 s"),
        }
    };
    assert!(ended.is_err(), "the wait ends with an error: {ended:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
    cluster.until_decode_idle(0).await.expect("idle");
    let after = cluster.decode_load(0).await.expect("load");
    assert_eq!(after.kv_blocks_free, baseline.kv_blocks_free);
    cluster.stop().await.expect("stop");
}
