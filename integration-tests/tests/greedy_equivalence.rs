//! Greedy output through the cluster is token for token what the engine produces locally (the
//! code path of `tandem generate`), for one stream and for 8 concurrent ones, with the tiny
//! model and with the real ones (SmolLM2, and Qwen2.5 of another architecture and vocabulary).

use std::sync::Arc;

use tandem_engine::{Engine, EngineConfig, GenerateParams, GenerateRequest, Model};
use tandem_integration_tests::{
    Cluster, ClusterConfig, collect, greedy, qwen_model, smollm2_model,
};
use tandem_proto::v1 as pb;

fn local(model: &Arc<Model>, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let mut engine = Engine::new(model.clone(), EngineConfig::default()).expect("engine");
    let out = engine
        .generate_batch(&[GenerateRequest {
            prompt: prompt.to_vec(),
            params: GenerateParams {
                max_tokens,
                ..GenerateParams::default()
            },
        }])
        .expect("local generation");
    out[0].token_ids.clone()
}

async fn check(model: Arc<Model>, prompts: Vec<Vec<u32>>, max_tokens: u32) {
    let expected: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| local(&model, p, max_tokens as usize))
        .collect();
    let cluster = Cluster::start(ClusterConfig::new(model))
        .await
        .expect("cluster");

    // One stream.
    let mut client = cluster.client();
    let one = collect(&mut client, greedy(prompts[0].clone(), max_tokens))
        .await
        .expect("one stream");
    assert_eq!(one.token_ids, expected[0]);
    let usage = one.last.usage.expect("usage");
    assert_eq!(usage.prompt_tokens as usize, prompts[0].len());
    assert_eq!(usage.completion_tokens as usize, expected[0].len());
    assert_eq!(one.last.prompt_token_ids, prompts[0]);
    let route = one.last.route.expect("route");
    assert_eq!(route.prefill, cluster.prefill[0].addr.to_string());
    assert_eq!(route.decode, cluster.decode[0].addr.to_string());
    assert!(one.last.timings.expect("timings").total_ms > 0.0);

    // Eight at once, decoded in one continuous batch.
    let streams = prompts.iter().map(|p| {
        let mut client = cluster.client();
        let request = greedy(p.clone(), max_tokens);
        async move { collect(&mut client, request).await }
    });
    let outs = futures::future::join_all(streams).await;
    for (i, (out, want)) in outs.into_iter().zip(&expected).enumerate() {
        let out = out.unwrap_or_else(|s| panic!("stream {i}: {s:?}"));
        assert_eq!(&out.token_ids, want, "stream {i}");
        assert!(
            [
                pb::FinishReason::Stop as i32,
                pb::FinishReason::Length as i32
            ]
            .contains(&out.last.finish_reason)
        );
    }
    cluster
        .until_decode_idle(0)
        .await
        .expect("every slot and block returned");
    cluster.stop().await.expect("clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_model_cluster_equals_local_generation() {
    let model = tandem_engine::ModelSource::TINY.load().expect("tiny");
    let prompts = (0..8u32)
        .map(|i| {
            (0..(5 + 7 * i))
                .map(|t| 3 + (t * 31 + i * 17) % 250)
                .collect()
        })
        .collect();
    check(model, prompts, 40).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_model_cluster_equals_local_generation() {
    let model = smollm2_model().expect("SmolLM2 (run `tandem model fetch smollm2`)");
    let texts = [
        "The capital of France is",
        "Once upon a time,",
        "def fibonacci(n):",
        "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
        "1, 2, 3, 4,",
        "The quick brown fox",
        "Water boils at",
        "In 1969, astronauts",
    ];
    let prompts = texts
        .iter()
        .map(|t| model.tokenizer.encode(t).expect("encode"))
        .collect();
    check(model, prompts, 24).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen_cluster_equals_local_generation() {
    let model = qwen_model().expect("the 0.5B Qwen (tandem model fetch qwen2.5-coder-0.5b)");
    let questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Reverse a list in Python.",
        "Name three colors.",
    ];
    let mut prompts: Vec<Vec<u32>> = questions
        .iter()
        .map(|q| {
            let text = model
                .tokenizer
                .apply_chat_template(
                    &[tandem_engine::ChatMessage::new("user", q.to_string())],
                    &[],
                )
                .expect("template");
            model.tokenizer.encode(&text).expect("encode")
        })
        .collect();
    for t in [
        "def quicksort(arr):",
        "The three laws of",
        "1, 2, 3,",
        "Dear Sir,",
    ] {
        prompts.push(model.tokenizer.encode(t).expect("encode"));
    }
    check(model, prompts, 16).await;
}
