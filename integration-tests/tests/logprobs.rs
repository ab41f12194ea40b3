//! Log-probabilities through the cluster on the 0.5B Qwen: every output token's, from the
//! prefill node's first token (sent with the KV) to the decode node's last, agree with
//! llama.cpp's top-20 log-probabilities in `../shared/fixtures/` wherever the greedy
//! continuations agree; and the HTTP API shapes them as OpenAI's clients read them.

// The engine's fidelity tests' reader of the fixtures, not a copy of it.
#[path = "../../engine/tests/common/mod.rs"]
mod common;

use tandem_integration_tests::{Cluster, ClusterConfig, collect, greedy, qwen_model};
use tandem_router::PolicyKind;

/// Largest difference allowed between a log-probability here and llama.cpp's for the same
/// token, for tokens llama.cpp gives more than e^-3 (about 5%) and for the rest: its matrix
/// multiplies quantize activations to 8 bits (the fixtures' README). The kernels give the same
/// bits on every x86-64-v3 CPU; seen over the six records: at most 0.455 (chat-5 position 7, a
/// flat distribution whose top token llama.cpp gives −2.63) and 0.47.
const TOLERANCE: (f32, f32) = (0.5, 0.6);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_match_llama_cpp_and_reach_both_apis() {
    let model = qwen_model().expect("the 0.5B Qwen (run `tandem model fetch qwen2.5-coder-0.5b`)");
    // Round robin always prefills on the prefill node: the first token's log-probabilities
    // come with the KV, the rest from the decode node.
    let cluster = Cluster::start(ClusterConfig {
        policy: PolicyKind::RoundRobin,
        ..ClusterConfig::new(model)
    })
    .await
    .expect("cluster");
    let mut client = cluster.client();
    let mut compared = 0;
    for record in common::records("qwen2.5-coder-0.5b-greedy.jsonl")
        .iter()
        .take(6)
    {
        let name = record["name"].as_str().unwrap_or_default();
        let prompt = common::ids(&record["prompt_token_ids"]);
        let want = common::ids(&record["generated_token_ids"]);
        let mut request = greedy(prompt, 16);
        if let Some(s) = &mut request.sampling {
            s.logprobs = Some(20);
        }
        let out = collect(&mut client, request).await.expect("generation");
        assert_eq!(
            out.logprobs.len(),
            out.token_ids.len(),
            "{name}: one entry per output token"
        );
        let theirs = record["top_logprobs"].as_array().expect("top_logprobs");
        for (i, (&token, lp)) in out.token_ids.iter().zip(&out.logprobs).enumerate() {
            assert_eq!(lp.top_ids.len(), 20, "{name} position {i}");
            // Greedy picks the most likely token, and reports its log-probability.
            assert_eq!(lp.top_ids[0], token, "{name} position {i}");
            assert_eq!(lp.logprob, lp.top_logprobs[0], "{name} position {i}");
            assert!(
                lp.top_logprobs.windows(2).all(|w| w[0] >= w[1]),
                "{name} position {i}: {lp:?}"
            );
            if want.get(i) != Some(&token) {
                break;
            }
            let llama: Vec<(u32, f32)> = theirs[i]
                .as_array()
                .expect("pairs")
                .iter()
                .map(|p| {
                    (
                        p[0].as_u64().unwrap_or(0) as u32,
                        p[1].as_f64().unwrap_or(0.0) as f32,
                    )
                })
                .collect();
            let mut shared = 0;
            for (id, ours) in lp.top_ids.iter().zip(&lp.top_logprobs) {
                if let Some((_, l)) = llama.iter().find(|(t, _)| t == id) {
                    shared += 1;
                    let tolerance = if *l > -3.0 { TOLERANCE.0 } else { TOLERANCE.1 };
                    assert!(
                        (ours - l).abs() < tolerance,
                        "{name} position {i} token {id}: {ours} here, {l} in llama.cpp"
                    );
                }
            }
            assert!(shared >= 15, "{name} position {i}: {shared} of 20 shared");
            compared += 1;
        }
    }
    assert!(compared >= 30, "only {compared} positions compared");

    // HTTP: chat's `logprobs.content`, streamed and not, and completions' arrays.
    let http = reqwest::Client::new();
    let base = format!("http://{}/v1", cluster.http);
    let model_id = tandem_integration_tests::http_model(&http, &base)
        .await
        .expect("the model id");
    let chat = serde_json::json!({
        "model": model_id,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": true,
        "top_logprobs": 3,
    });
    let whole: serde_json::Value = http
        .post(format!("{base}/chat/completions"))
        .json(&chat)
        .send()
        .await
        .expect("chat")
        .json()
        .await
        .expect("json");
    let content = whole["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("logprobs.content")
        .clone();
    assert_eq!(
        content.len() as u64,
        whole["usage"]["completion_tokens"].as_u64().unwrap_or(0),
        "{whole}"
    );
    let joined: String = content
        .iter()
        .map(|e| e["token"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(joined, whole["choices"][0]["message"]["content"], "{whole}");
    for e in &content {
        assert_eq!(e["top_logprobs"].as_array().map(Vec::len), Some(3), "{e}");
        assert_eq!(e["top_logprobs"][0]["logprob"], e["logprob"], "{e}");
        assert!(e["bytes"].is_array(), "{e}");
    }
    let mut streamed = chat.clone();
    streamed["stream"] = true.into();
    let body = http
        .post(format!("{base}/chat/completions"))
        .json(&streamed)
        .send()
        .await
        .expect("stream")
        .text()
        .await
        .expect("body");
    let mut entries = Vec::new();
    for line in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if line == "[DONE]" {
            break;
        }
        let chunk: serde_json::Value = serde_json::from_str(line).expect("chunk");
        if let Some(c) = chunk["choices"][0]["logprobs"]["content"].as_array() {
            entries.extend(c.iter().cloned());
        }
    }
    assert_eq!(entries, content, "streamed and whole agree");

    let completion: serde_json::Value = http
        .post(format!("{base}/completions"))
        .json(&serde_json::json!({
            "model": model_id,
            "prompt": "def add(a, b):",
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": 2,
        }))
        .send()
        .await
        .expect("completion")
        .json()
        .await
        .expect("json");
    let choice = &completion["choices"][0];
    let lp = &choice["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_str().unwrap_or_default())
        .collect();
    assert_eq!(tokens.concat(), choice["text"], "{completion}");
    assert_eq!(
        lp["token_logprobs"].as_array().map(Vec::len),
        Some(tokens.len())
    );
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .expect("text_offset")
        .iter()
        .map(|o| o.as_u64().unwrap_or(0))
        .collect();
    assert_eq!(offsets.first(), Some(&0), "{completion}");
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{completion}");
    for top in lp["top_logprobs"].as_array().expect("top_logprobs") {
        assert_eq!(top.as_object().map(|o| o.len()), Some(2), "{top}");
    }

    // Out of bounds: named, before any work.
    let mut too_many = chat.clone();
    too_many["top_logprobs"] = 21.into();
    let refused = http
        .post(format!("{base}/chat/completions"))
        .json(&too_many)
        .send()
        .await
        .expect("refused");
    assert_eq!(refused.status(), 400);
    let mut over = greedy(vec![1, 2, 3], 2);
    if let Some(s) = &mut over.sampling {
        s.logprobs = Some(21);
    }
    let status = collect(&mut client, over).await.expect_err("refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().contains("sampling.logprobs"), "{status:?}");

    cluster.stop().await.expect("stop");
}
