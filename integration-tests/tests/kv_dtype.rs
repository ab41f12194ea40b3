//! The q8 KV cache through the cluster, on the real model: prefill sends q8 KV (half the bytes
//! of f16) and the decode node continues from it to exactly the tokens an in-process engine with
//! q8 KV generates; a router never pairs prefill and decode nodes of different dtypes.

use tandem_engine::{
    ChatMessage, Engine, EngineConfig, GenerateParams, GenerateRequest, KvDtype, Model,
};
use tandem_integration_tests::{Cluster, ClusterConfig, collect, metrics, sample, smollm2_model};
use tandem_proto::v1 as pb;

const QUESTION: &str = "Explain in three sentences why the sky is blue.";
const MAX_TOKENS: u32 = 40;

fn request() -> pb::GenerateRequest {
    pb::GenerateRequest {
        messages: vec![pb::ChatMessage {
            role: "user".into(),
            content: QUESTION.into(),
            ..Default::default()
        }],
        sampling: Some(pb::SamplingParams {
            max_tokens: MAX_TOKENS,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The config of a cluster that always prefills remotely, so the KV crosses the wire.
fn config(model: std::sync::Arc<Model>, prefill: KvDtype, decode: KvDtype) -> ClusterConfig {
    let base = ClusterConfig::new(model);
    ClusterConfig {
        engine: EngineConfig {
            kv_dtype: decode,
            ..base.engine.clone()
        },
        prefill_kv_dtype: Some(prefill),
        policy: tandem_router::PolicyKind::RoundRobin,
        ..base
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn q8_kv_crosses_the_wire_at_half_the_bytes_and_decodes_exactly() {
    let model = smollm2_model().expect("the real model (tandem model fetch)");
    let prompt = model
        .tokenizer
        .encode(
            &model
                .tokenizer
                .apply_chat_template(&[ChatMessage::new("user", QUESTION)], &[])
                .expect("template"),
        )
        .expect("encode");
    let local = Engine::new(
        model.clone(),
        EngineConfig {
            kv_dtype: KvDtype::Q8,
            ..EngineConfig::default()
        },
    )
    .expect("engine")
    .generate_batch(&[GenerateRequest {
        prompt: prompt.clone(),
        params: GenerateParams {
            max_tokens: MAX_TOKENS as usize,
            ..GenerateParams::default()
        },
    }])
    .expect("generate")
    .remove(0);

    let mut bytes = Vec::new();
    for dtype in [KvDtype::F16, KvDtype::Q8] {
        let cluster = Cluster::start(config(model.clone(), dtype, dtype))
            .await
            .expect("cluster");
        let out = collect(&mut cluster.client(), request())
            .await
            .expect("generation");
        if dtype == KvDtype::Q8 {
            assert_eq!(out.token_ids, local.token_ids, "{:?}", out.text);
        }
        let text = metrics(cluster.decode[0].addr).await.expect("metrics");
        let received = sample(&text, "tandem_kv_transfer_bytes_total").unwrap_or_default();
        assert_eq!(
            received as usize,
            prompt.len() * model.config.kv_layout(dtype).token_bytes(),
            "{dtype:?}: the whole prompt's KV was pushed"
        );
        bytes.push(received);
        cluster.stop().await.expect("stop");
    }
    let ratio = bytes[1] / bytes[0];
    assert!(
        (0.5..0.53).contains(&ratio),
        "q8 sends {ratio} of f16's bytes"
    );
}

/// The router learns each worker's dtype from `Worker.Info` and never pairs a prefill node
/// with a decode node of another dtype: with one of each, every request is refused up front
/// (nothing is pushed), and the status says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_and_decode_of_different_dtypes_are_never_paired() {
    let model = smollm2_model().expect("the real model (tandem model fetch)");
    let cluster = Cluster::launch(config(model, KvDtype::Q8, KvDtype::F16))
        .await
        .expect("cluster");
    // Until a worker has answered `Worker.Info` the router is not ready; then it refuses.
    let started = std::time::Instant::now();
    let mut refused = 0;
    while refused < 2 {
        let status = collect(&mut cluster.client(), request())
            .await
            .expect_err("a dtype mismatch cannot generate");
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        if status.message().contains("KV dtype") {
            refused += 1;
        } else {
            assert!(started.elapsed().as_secs() < 20, "{status:?}");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
    let text = metrics(cluster.decode[0].addr).await.expect("metrics");
    assert_eq!(
        sample(&text, "tandem_kv_transfer_bytes_total"),
        Some(0.0),
        "{text}"
    );
    cluster.stop().await.expect("stop");
}
