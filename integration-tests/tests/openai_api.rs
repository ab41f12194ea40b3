//! The router's OpenAI-compatible HTTP API, driven by the official `openai` Python package
//! (`integration-tests/openai/client_check.py`), installed from PyPI into a virtual environment
//! under the target directory on first use. The script checks chat and completions, streamed and
//! not, usage, stop, penalties, a rejected parameter and the error statuses; this test then
//! checks that what it saw is exactly what the gRPC API answers, that the examples in
//! `docs/examples/` run, and that a client that disconnects mid-stream frees the decode node.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use tandem_integration_tests::{
    Cluster, ClusterConfig, collect, gemma_model, metrics, qwen_model, sample, smollm2_model,
};
use tandem_proto::v1 as pb;

/// The packages the checks are written against: the `openai` client, and LangChain's.
const PACKAGES: [&str; 2] = ["openai==3.54.0", "langchain-openai==1.7.4"];

/// A Python with [`PACKAGES`] installed: `TANDEM_OPENAI_PYTHON` if set, else a virtual environment
/// made (once) under the target directory. The tests of this file run in parallel and share the
/// environment, so the first caller makes it and the others wait for it.
fn python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON.get_or_init(make_python).clone()
}

fn make_python() -> PathBuf {
    if let Some(p) = std::env::var_os("TANDEM_OPENAI_PYTHON") {
        return p.into();
    }
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    tandem_integration_tests::python_env(&venv, &PACKAGES, "import openai, langchain_openai")
}

/// Runs `integration-tests/openai/SCRIPT` against `base` and returns what it saw.
async fn check_script(python: &Path, script: &str, base: &str) -> serde_json::Value {
    tandem_integration_tests::python_check(python, &format!("openai/{script}"), &[base]).await
}

async fn grpc_text(cluster: &Cluster, request: pb::GenerateRequest) -> String {
    collect(&mut cluster.client(), request)
        .await
        .expect("gRPC generation")
        .text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_client_gets_what_grpc_gets() {
    let python = tokio::task::spawn_blocking(python)
        .await
        .expect("python setup");
    let model = smollm2_model().expect("SmolLM2 (run `tandem model fetch smollm2`)");
    let cluster = Cluster::start(ClusterConfig::new(model))
        .await
        .expect("cluster");
    let base = format!("http://{}/v1", cluster.http);
    let seen = check_script(&python, "client_check.py", &base).await;

    // The same requests over gRPC give the same text.
    let chat = grpc_text(
        &cluster,
        pb::GenerateRequest {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: "What is the capital of France?".into(),
                ..Default::default()
            }],
            sampling: Some(pb::SamplingParams {
                max_tokens: 24,
                seed: 1,
                ..Default::default()
            }),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(seen["chat_text"], chat.as_str());
    let completion = grpc_text(
        &cluster,
        pb::GenerateRequest {
            prompt: Some("The list of the first ten prime numbers: 2, 3, 5,".into()),
            sampling: Some(pb::SamplingParams {
                max_tokens: 16,
                ..Default::default()
            }),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(seen["completion_text"], completion.as_str());
    // The streamed chat repeated the first one's prompt, which a cache then held.
    assert!(
        seen["stream_cached_tokens"].as_u64().unwrap_or(0) > 0,
        "{seen}"
    );

    // The examples in docs/ run as written.
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/examples");
    let out = tokio::process::Command::new(&python)
        .arg(examples.join("openai_chat.py"))
        .arg(&base)
        .output()
        .await
        .expect("run docs/examples/openai_chat.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("completion tokens]"), "{stdout}");
    let out = tokio::process::Command::new("bash")
        .arg(examples.join("curl.sh"))
        .arg(format!("http://{}", cluster.http))
        .output()
        .await
        .expect("run docs/examples/curl.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("data: [DONE]") && stdout.contains("best_of=2 -> HTTP 400"),
        "{stdout}"
    );

    // A client that disconnects mid-stream cancels the generation.
    let client = reqwest::Client::new();
    let mut response = client
        .post(format!("{base}/completions"))
        .json(&serde_json::json!({
            "model": seen["model"],
            "prompt": "Count to a thousand: 1, 2, 3,",
            "max_tokens": 1000,
            "temperature": 0,
            "stream": true,
        }))
        .send()
        .await
        .expect("send");
    assert_eq!(response.status(), 200);
    let first = response.chunk().await.expect("read").expect("a chunk");
    assert!(first.starts_with(b"data: {"), "{first:?}");
    drop(response);
    let idle = cluster.until_decode_idle(0).await.expect("decode idle");
    assert!(idle < Duration::from_secs(2), "freed after {idle:?}");

    cluster.stop().await.expect("stop");
}

/// Tool calling and structured outputs with the official client on the 0.5B Qwen, whose
/// template takes tools (`integration-tests/openai/qwen_check.py`: forced and named calls,
/// streamed and not, a follow-up turn with the call's result, `tool_choice: none`, a pydantic
/// model through `parse`, `n: 3`, `json_object`, and the refusals), and through LangChain's
/// `ChatOpenAI` (`langchain_check.py`: `with_structured_output`, `bind_tools` and a tool call
/// round trip); then the same forced call over gRPC, whose text is the call's markup after the
/// forced opening.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_client_calls_tools_and_gets_structured_outputs() {
    let python = tokio::task::spawn_blocking(python)
        .await
        .expect("python setup");
    let model = tandem_integration_tests::qwen_model()
        .expect("the 0.5B Qwen (run `tandem model fetch qwen2.5-coder-0.5b`)");
    let cluster = Cluster::start(ClusterConfig::new(model))
        .await
        .expect("cluster");
    let seen = check_script(
        &python,
        "qwen_check.py",
        &format!("http://{}/v1", cluster.http),
    )
    .await;
    eprintln!("qwen_check.py saw {seen}");
    let langchain = check_script(
        &python,
        "langchain_check.py",
        &format!("http://{}/v1", cluster.http),
    )
    .await;
    eprintln!("langchain_check.py saw {langchain}");

    let weather = pb::Tool {
        name: "get_weather".into(),
        description: "Get the current weather in a city.".into(),
        parameters: r#"{"type": "object", "properties": {"city": {"type": "string", "description": "The city's name."}}, "required": ["city"]}"#.into(),
        ..Default::default()
    };
    let clock = pb::Tool {
        name: "get_time".into(),
        description: "Get the current time in a time zone.".into(),
        parameters: r#"{"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}"#.into(),
        ..Default::default()
    };
    let text = grpc_text(
        &cluster,
        pb::GenerateRequest {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: "What is the weather like in Paris today?".into(),
                ..Default::default()
            }],
            tools: vec![weather, clock],
            tool_choice: pb::ToolChoice::Required as i32,
            sampling: Some(pb::SamplingParams {
                max_tokens: 64,
                ..Default::default()
            }),
            ..Default::default()
        },
    )
    .await;
    // The forced opening ends at the name's opening quote: the text goes on from there, to the
    // call's end (this model often ends its reply before the closing tag).
    let call = format!(
        "{{\"name\": \"{}",
        text.trim_end().trim_end_matches("</tool_call>")
    );
    let call: serde_json::Value = serde_json::from_str(&call).expect(&text);
    assert_eq!(call["name"], seen["required"]["name"], "{text:?}");
    assert_eq!(call["arguments"], seen["required"]["arguments"], "{text:?}");
    cluster.stop().await.expect("stop");
}

/// One cluster serving the default model and Gemma 3 270M: the `openai` client lists both, each
/// completes a prompt under its own id as the gRPC API does for that model, from its own nodes (each
/// model's decode node decoded only its own model's requests), and an unknown model is a 404
/// naming both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_client_reaches_each_model_of_a_two_model_cluster() {
    let python = tokio::task::spawn_blocking(python)
        .await
        .expect("python setup");
    let qwen = qwen_model().expect("the default model (run `tandem model fetch`)");
    let gemma = gemma_model().expect("Gemma 3 270M (run `tandem model fetch gemma-3-270m`)");
    let config = ClusterConfig {
        more_models: vec![gemma.clone()],
        ..ClusterConfig::new(qwen.clone())
    };
    let cluster = Cluster::start(config).await.expect("cluster");
    let base = format!("http://{}/v1", cluster.http);
    let seen = check_script(&python, "two_models.py", &base).await;
    assert_eq!(seen["unknown_status"], 404, "{seen}");
    for (m, model) in [&qwen, &gemma].into_iter().enumerate() {
        let text = grpc_text(
            &cluster,
            pb::GenerateRequest {
                model: model.name.clone(),
                prompt: Some("The colours of the rainbow are red, orange,".into()),
                sampling: Some(pb::SamplingParams {
                    max_tokens: 12,
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
        .await;
        assert_eq!(seen["replies"][&model.name], text.as_str(), "{seen}");
        // Its decode node (nodes are in model order) decoded its three requests' tokens (at
        // most 12 each), and none of the other model's.
        let text = metrics(cluster.decode[m].addr).await.expect("metrics");
        let tokens = sample(&text, "tandem_decode_tokens_total").unwrap_or(0.0);
        assert!(
            tokens > 0.0 && tokens <= 36.0,
            "{}'s decode node decoded {tokens} tokens",
            model.name
        );
        // The router counts a request once its generation task ends, which may be just after
        // the client has read the last frame.
        let ok = format!(
            "tandem_model_requests_total{{model=\"{}\",code=\"Ok\"}}",
            model.name
        );
        let started = std::time::Instant::now();
        loop {
            let router = metrics(cluster.router.addr).await.expect("metrics");
            match sample(&router, &ok) {
                Some(3.0) => break,
                n if started.elapsed() > std::time::Duration::from_secs(10) => {
                    panic!("{ok}: {n:?}, not 3")
                }
                _ => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
            }
        }
    }
    cluster.stop().await.expect("stop");
}
