//! Invalid requests get INVALID_ARGUMENT naming the field, and the router stays healthy.

use tandem_integration_tests::{Cluster, ClusterConfig, collect, greedy};
use tandem_proto::v1 as pb;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_invalid_request_names_its_field() {
    let model = tandem_engine::ModelSource::TINY.load().expect("tiny");
    let context = model.config.context_len as u32;
    let cluster = Cluster::start(ClusterConfig::new(model))
        .await
        .expect("cluster");
    let mut client = cluster.client();
    let sampling = |max_tokens| {
        Some(pb::SamplingParams {
            max_tokens,
            ..Default::default()
        })
    };
    let cases: Vec<(&str, pb::GenerateRequest, &str)> = vec![
        (
            "no input",
            pb::GenerateRequest {
                sampling: sampling(4),
                ..Default::default()
            },
            "input",
        ),
        (
            "two inputs",
            pb::GenerateRequest {
                prompt: Some("hi".into()),
                token_ids: vec![5, 6],
                sampling: sampling(4),
                ..Default::default()
            },
            "input",
        ),
        (
            "empty prompt",
            pb::GenerateRequest {
                prompt: Some(String::new()),
                sampling: sampling(4),
                ..Default::default()
            },
            "prompt",
        ),
        ("max_tokens 0", greedy(vec![5, 6], 0), "sampling.max_tokens"),
        (
            "max_tokens beyond the context",
            greedy(vec![5, 6], context),
            "sampling.max_tokens",
        ),
        (
            "negative temperature",
            pb::GenerateRequest {
                token_ids: vec![5, 6],
                sampling: Some(pb::SamplingParams {
                    max_tokens: 4,
                    temperature: -0.5,
                    ..Default::default()
                }),
                ..Default::default()
            },
            "sampling.temperature",
        ),
        (
            "a request id of 1 MB",
            pb::GenerateRequest {
                request_id: "r".repeat(1 << 20),
                ..greedy(vec![5, 6], 4)
            },
            "request_id",
        ),
        (
            "a session id of 1 MB",
            pb::GenerateRequest {
                session_id: "s".repeat(1 << 20),
                ..greedy(vec![5, 6], 4)
            },
            "session_id",
        ),
        (
            "infinite temperature",
            pb::GenerateRequest {
                token_ids: vec![5, 6],
                sampling: Some(pb::SamplingParams {
                    max_tokens: 4,
                    temperature: f32::INFINITY,
                    ..Default::default()
                }),
                ..Default::default()
            },
            "sampling.temperature",
        ),
        (
            "penalty out of range",
            pb::GenerateRequest {
                token_ids: vec![5, 6],
                sampling: Some(pb::SamplingParams {
                    max_tokens: 4,
                    presence_penalty: Some(2.5),
                    ..Default::default()
                }),
                ..Default::default()
            },
            "sampling.presence_penalty",
        ),
        (
            "unknown chat role",
            pb::GenerateRequest {
                messages: vec![pb::ChatMessage {
                    role: "function".into(),
                    content: "hi".into(),
                    ..Default::default()
                }],
                sampling: sampling(4),
                ..Default::default()
            },
            "messages",
        ),
        (
            "tools without messages",
            pb::GenerateRequest {
                prompt: Some("hi".into()),
                tools: vec![pb::Tool {
                    name: "f".into(),
                    ..Default::default()
                }],
                sampling: sampling(4),
                ..Default::default()
            },
            "tools",
        ),
        (
            "tools for a chat template that takes none",
            pb::GenerateRequest {
                messages: vec![pb::ChatMessage {
                    role: "user".into(),
                    content: "hi".into(),
                    ..Default::default()
                }],
                tools: vec![pb::Tool {
                    name: "f".into(),
                    ..Default::default()
                }],
                sampling: sampling(4),
                ..Default::default()
            },
            "tools",
        ),
        (
            "a forced call without tools",
            pb::GenerateRequest {
                messages: vec![pb::ChatMessage {
                    role: "user".into(),
                    content: "hi".into(),
                    ..Default::default()
                }],
                tool_choice: pb::ToolChoice::Required as i32,
                sampling: sampling(4),
                ..Default::default()
            },
            "tool_choice",
        ),
        (
            "a grammar that does not compile",
            pb::GenerateRequest {
                token_ids: vec![5, 6],
                sampling: Some(pb::SamplingParams {
                    max_tokens: 4,
                    grammar: Some(pb::Grammar {
                        kind: Some(pb::grammar::Kind::Regex("(unclosed".into())),
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            },
            "grammar",
        ),
        (
            "empty chat role",
            pb::GenerateRequest {
                messages: vec![pb::ChatMessage {
                    role: String::new(),
                    content: "hi".into(),
                    ..Default::default()
                }],
                sampling: sampling(4),
                ..Default::default()
            },
            "messages",
        ),
        (
            "prompt longer than the context",
            greedy(vec![5; context as usize + 1], 1),
            "prompt",
        ),
        (
            "token id outside the vocabulary",
            greedy(vec![5, 1 << 30], 1),
            "token_ids",
        ),
        (
            "too many choices",
            pb::GenerateRequest {
                n: tandem_proto::MAX_CHOICES + 1,
                ..greedy(vec![5, 6], 1)
            },
            "n",
        ),
    ];
    for (name, request, field) in cases {
        let status = collect(&mut client, request).await.expect_err(name);
        assert_eq!(status.code(), Code::InvalidArgument, "{name}: {status:?}");
        assert!(
            status.message().contains(&format!("invalid {field}:")),
            "{name}: {:?} should name {field}",
            status.message()
        );
        assert!(
            status.message().len() < 400,
            "{name}: the error echoes its input"
        );
    }
    // A valid request still works afterwards.
    let ok = collect(&mut client, greedy(vec![5, 6, 7], 3))
        .await
        .expect("valid");
    assert_eq!(ok.token_ids.len(), 3);
    cluster.stop().await.expect("clean stop");
}
