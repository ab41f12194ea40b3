//! The APIs coding agents speak, driven by their official clients against a cluster on the
//! default model (the 0.5B Qwen2.5-Coder): Anthropic's Messages API through the `anthropic`
//! package (plain, streamed, `count_tokens`, a forced `tool_use` and its `tool_result` round
//! trip, a streamed tool call, a stop sequence, refusals in Anthropic's error shape), OpenAI's
//! Responses API through the `openai` package (plain, streamed, a function-call round trip, the
//! stateless refusals), and an OpenAI Agents SDK agent with a function tool run to its final
//! answer (`integration-tests/agents/agents_check.py`). The packages are installed from PyPI into
//! a virtual environment under the target directory on first use. Then the replies are checked
//! against what the gRPC API answers for the same chat.

use std::path::{Path, PathBuf};

use tandem_integration_tests::{Cluster, ClusterConfig, collect};
use tandem_proto::v1 as pb;

/// The clients the checks are written against.
const PACKAGES: [&str; 3] = [
    "anthropic==2.14.0",
    "openai==3.54.0",
    "openai-agents==0.24.0",
];

/// A Python with [`PACKAGES`]: `TANDEM_AGENTS_PYTHON` if set, else a virtual environment under
/// the target directory.
fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("TANDEM_AGENTS_PYTHON") {
        return p.into();
    }
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("agents-venv");
    tandem_integration_tests::python_env(&venv, &PACKAGES, "import anthropic, openai, agents")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_and_openai_agent_clients_run_against_the_cluster() {
    let python = tokio::task::spawn_blocking(python)
        .await
        .expect("python setup");
    let model = tandem_integration_tests::qwen_model()
        .expect("the 0.5B Qwen (run `tandem model fetch qwen2.5-coder-0.5b`)");
    let cluster = Cluster::start(ClusterConfig::new(model))
        .await
        .expect("cluster");
    let name = tandem_integration_tests::http_model(
        &reqwest::Client::new(),
        &format!("http://{}/v1", cluster.http),
    )
    .await
    .expect("the model's id");
    let base = format!("http://{}", cluster.http);
    let seen =
        tandem_integration_tests::python_check(&python, "agents/agents_check.py", &[&base, &name])
            .await;
    eprintln!("agents_check.py saw {seen}");

    // The same question over gRPC, greedy, gives the same reply on both HTTP APIs.
    let grpc = collect(
        &mut cluster.client(),
        pb::GenerateRequest {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: "What is the capital of France?".into(),
                ..Default::default()
            }],
            sampling: Some(pb::SamplingParams {
                max_tokens: 24,
                temperature: 0.0,
                ..Default::default()
            }),
            ..Default::default()
        },
    )
    .await
    .expect("gRPC generation");
    assert_eq!(seen["anthropic_text"], grpc.text.as_str());
    assert_eq!(seen["responses_text"], grpc.text.as_str());
    assert_eq!(
        seen["anthropic_prompt_tokens"],
        grpc.last.usage.expect("usage").prompt_tokens
    );

    // Over gRPC, the frames carry the calls a reply makes: here the bare JSON call the model
    // writes with the tool offered and the choice left to it.
    let mut frames = cluster
        .client()
        .generate(pb::GenerateRequest {
            messages: vec![
                pb::ChatMessage {
                    role: "system".into(),
                    content: "You answer questions about the weather. Use the get_weather tool."
                        .into(),
                    ..Default::default()
                },
                pb::ChatMessage {
                    role: "user".into(),
                    content: "What is the weather like in Paris today?".into(),
                    ..Default::default()
                },
            ],
            tools: vec![pb::Tool {
                name: "get_weather".into(),
                description: "Get the current weather in a city.".into(),
                parameters: r#"{"type": "object", "properties": {"city": {"type": "string"}},
                                "required": ["city"], "additionalProperties": false}"#
                    .into(),
                ..Default::default()
            }],
            sampling: Some(pb::SamplingParams {
                max_tokens: 64,
                temperature: 0.0,
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .expect("gRPC generation")
        .into_inner();
    let (mut calls, mut text) = (Vec::new(), String::new());
    while let Some(f) = frames.message().await.expect("frame") {
        text.push_str(&f.text);
        calls.extend(f.tool_calls);
    }
    assert_eq!(calls.len(), 1, "{text}");
    assert_eq!(calls[0].name, "get_weather");
    let arguments: serde_json::Value = serde_json::from_str(&calls[0].arguments).expect("JSON");
    assert_eq!(arguments["city"], "Paris", "{text}");

    // The model answers to the names it was started with, as well as its id, and the reply
    // names the id; another name is 404.
    let http = reqwest::Client::new();
    for (asked, status) in [
        ("default", 200),
        ("qwen2.5-coder-0.5b", 200),
        ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 200),
        (name.as_str(), 200),
        ("qwen2.5-coder-1.5b", 404),
    ] {
        let reply = http
            .post(format!("{base}/v1/chat/completions"))
            .json(&serde_json::json!({"model": asked, "max_tokens": 1,
                                      "messages": [{"role": "user", "content": "Hi"}]}))
            .send()
            .await
            .expect("POST");
        assert_eq!(reply.status().as_u16(), status, "{asked}");
        if status == 200 {
            let body: serde_json::Value = reply.json().await.expect("JSON");
            assert_eq!(body["model"], name.as_str(), "{asked}");
        }
    }
    cluster.stop().await.expect("stop");
}
