//! The parser's tests: what each endpoint accepts, and every refusal by name.

use std::collections::HashMap;

use axum::http::StatusCode;
use serde_json::json;

use super::*;

fn parse_json(kind: Kind, body: Value) -> Result<Parsed, ApiError> {
    parse(
        kind,
        "m",
        &HeaderMap::new(),
        body.to_string().as_bytes(),
        &SamplingDefaults::default(),
    )
}

#[test]
fn tools_calls_and_results_become_the_requests_own() {
    let body = json!({
        "model": "m",
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1",
              "type": "function", "function": {"name": "get_weather",
              "arguments": "{\"city\": \"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "Rain"},
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather",
                   "description": "d", "parameters": {"type": "object"}}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": false,
    });
    let parsed = parse_json(Kind::Chat, body).expect("parsed");
    let r = &parsed.call.request;
    assert!(!parsed.parallel_tool_calls);
    assert_eq!(r.tool_choice, pb::ToolChoice::Function as i32);
    assert_eq!(r.tool_choice_function, "get_weather");
    assert_eq!(
        r.tools,
        vec![pb::Tool {
            name: "get_weather".into(),
            description: "d".into(),
            parameters: r#"{"type":"object"}"#.into(),
            ..Default::default()
        }]
    );
    assert_eq!(
        r.messages[1].tool_calls,
        vec![pb::ToolCall {
            id: "c1".into(),
            name: "get_weather".into(),
            arguments: r#"{"city": "Oslo"}"#.into(),
        }]
    );
    assert_eq!(r.messages[1].content, "");
    assert_eq!(r.messages[2].tool_call_id, "c1");

    let user = json!({"role": "user", "content": "x"});
    let tool = json!({"type": "function", "function": {"name": "f"}});
    for (body, param) in [
        (
            json!({"tools": [{"type": "web", "function": {"name": "f"}}]}),
            "tools[0].type",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "strict": true}}]}),
            "tools[0].function.strict",
        ),
        (
            json!({"tools": [tool], "tool_choice": "always"}),
            "tool_choice",
        ),
        (
            json!({"messages": [user, {"role": "tool", "content": "x"}]}),
            "messages[1].tool_call_id",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}),
            "messages[0].tool_calls",
        ),
        (
            json!({"messages": [user, {"role": "assistant", "tool_calls": [{"function": {}}]}]}),
            "messages[1].tool_calls[0]",
        ),
    ] {
        let mut body = body;
        body["model"] = json!("m");
        if body.get("messages").is_none() {
            body["messages"] = json!([user]);
        }
        let e = parse_json(Kind::Chat, body).expect_err("rejected");
        assert_eq!(e.param.as_deref(), Some(param), "{}", e.message);
    }
}

#[test]
fn unknown_and_unsupported_parameters_are_named() {
    for (body, param) in [
        (json!({"model": "m", "prompt": "x", "tools": []}), "tools"),
        (json!({"model": "m", "prompt": "x", "n": 0}), "n"),
        (
            json!({"model": "m", "prompt": "x", "best_of": 2}),
            "best_of",
        ),
        (
            json!({"model": "m", "prompt": "x", "logprobs": 21}),
            "logprobs",
        ),
        (json!({"model": "m", "prompt": "x", "echo": true}), "echo"),
        (
            json!({"model": "m", "prompt": "x", "frobnicate": 1}),
            "frobnicate",
        ),
        (
            json!({"model": "m", "prompt": "x", "messages": []}),
            "messages",
        ),
    ] {
        let e = parse_json(Kind::Completion, body).expect_err("rejected");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some(param), "{}", e.message);
        assert!(e.message.contains(param), "{}", e.message);
    }
    // Null, false and 1 are the values that mean "off", and pass.
    let ok = json!({"model": "m", "prompt": "x", "n": 1, "logprobs": false, "echo": false,
                    "tools": null, "logit_bias": {}});
    assert!(parse_json(Kind::Completion, ok).is_ok());
    let three = json!({"model": "m", "prompt": "x", "n": 3});
    let parsed = parse_json(Kind::Completion, three).expect("n = 3");
    assert_eq!(parsed.call.request.n, 3);
}

#[test]
fn values_are_checked() {
    let chat = |extra: Value| {
        let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().expect("object") {
            body[k] = v.clone();
        }
        parse_json(Kind::Chat, body)
    };
    for (extra, param) in [
        (json!({"temperature": 2.5}), "temperature"),
        (json!({"top_p": 0}), "top_p"),
        (json!({"presence_penalty": -3}), "presence_penalty"),
        (json!({"max_tokens": 0}), "max_tokens"),
        (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
        (
            json!({"stream_options": {"include_usage": true}}),
            "stream_options",
        ),
        (
            json!({"messages": [{"role": "function", "content": "x"}]}),
            "messages[0].role",
        ),
        (json!({"store": true}), "store"),
        (json!({"store": "no"}), "store"),
        (json!({"metadata": ["a"]}), "metadata"),
        (json!({"metadata": {"k": 1}}), "metadata"),
        (json!({"metadata": {"k": "v".repeat(513)}}), "metadata"),
        (json!({"min_p": 1.5}), "min_p"),
        (json!({"logit_bias": {"x": 1}}), "logit_bias"),
        (json!({"logit_bias": {"5": 101}}), "logit_bias"),
        (json!({"logit_bias": [1]}), "logit_bias"),
        (json!({"ignore_eos": 1}), "ignore_eos"),
        (json!({"min_tokens": -1}), "min_tokens"),
        (json!({"stop_token_ids": [1, "2"]}), "stop_token_ids"),
        (json!({"service_tier": "flex"}), "service_tier"),
        (json!({"parallel_tool_calls": "yes"}), "parallel_tool_calls"),
        (json!({"top_logprobs": 3}), "top_logprobs"),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            json!({"response_format": {"type": "yaml"}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            "messages[0].content",
        ),
    ] {
        let e = chat(extra.clone()).expect_err("rejected");
        assert_eq!(e.status, StatusCode::BAD_REQUEST, "{extra}");
        assert_eq!(e.param.as_deref(), Some(param), "{extra}: {}", e.message);
    }
    let p = chat(
        json!({"max_completion_tokens": 7, "max_tokens": 9, "seed": -1, "stop": "x",
                        "stream": true, "stream_options": {"include_usage": true},
                        "user": "u1", "temperature": 0, "repetition_penalty": 1.2,
                        "store": false, "metadata": {"team": "search"},
                        "service_tier": "auto", "parallel_tool_calls": true}),
    )
    .expect("valid");
    let s = p.call.request.sampling.expect("sampling");
    assert_eq!(
        (s.max_tokens, s.seed, s.stop),
        (7, u64::MAX, vec!["x".to_string()])
    );
    assert_eq!((s.temperature, s.repetition_penalty), (0.0, Some(1.2)));
    assert!(p.stream && p.stream_usage == StreamUsage::Last);
    let continuous = chat(json!({"stream": true, "stream_options":
                                 {"include_usage": true, "continuous_usage_stats": true}}))
    .expect("vLLM's stream options, as guidellm sends them");
    assert_eq!(continuous.stream_usage, StreamUsage::Continuous);
    assert_eq!(p.call.request.session_id, "u1");
    let knobs = chat(
        json!({"min_p": 0.05, "top_k": 40, "logit_bias": {"17": -100, "3": 2.5},
                            "ignore_eos": true, "min_tokens": 4, "stop_token_ids": [7, 8]}),
    )
    .expect("valid")
    .call
    .request
    .sampling
    .expect("sampling");
    assert_eq!((knobs.min_p, knobs.top_k), (Some(0.05), 40));
    assert_eq!(knobs.logit_bias, HashMap::from([(17, -100.0), (3, 2.5)]));
    assert_eq!(
        (knobs.ignore_eos, knobs.min_tokens, knobs.stop_token_ids),
        (true, 4, vec![7, 8])
    );
}

#[test]
fn unset_sampling_takes_the_servers_defaults() {
    let defaults = SamplingDefaults {
        temperature: Some(0.7),
        top_p: Some(0.8),
        top_k: Some(20),
        min_p: Some(0.05),
    };
    let sampling = |body: Value| {
        parse(
            Kind::Chat,
            "m",
            &HeaderMap::new(),
            body.to_string().as_bytes(),
            &defaults,
        )
        .expect("valid")
        .call
        .request
        .sampling
        .expect("sampling")
    };
    let messages = json!([{"role": "user", "content": "hi"}]);
    let s = sampling(json!({"model": "m", "messages": messages}));
    assert_eq!(
        (s.temperature, s.top_p, s.top_k, s.min_p),
        (0.7, Some(0.8), 20, Some(0.05))
    );
    let s = sampling(json!({"model": "m", "messages": messages, "temperature": 0,
                            "top_p": 1, "top_k": 0, "min_p": 0}));
    assert_eq!(
        (s.temperature, s.top_p, s.top_k, s.min_p),
        (0.0, Some(1.0), 0, Some(0.0)),
        "what a request sets wins"
    );
    assert!(
        SamplingDefaults {
            top_p: Some(0.0),
            ..SamplingDefaults::default()
        }
        .validate()
        .is_err()
    );
}

#[test]
fn the_session_comes_from_the_agents_headers_then_the_body() {
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
        "prompt_cache_key": "key", "user": "someone"});
    let parsed = parse_json(Kind::Chat, body.clone()).expect("parsed");
    assert_eq!(parsed.call.request.session_id, "key");
    let mut headers = HeaderMap::new();
    headers.insert(
        "x-claude-code-session-id",
        "5f3c".parse().expect("a header value"),
    );
    headers.insert("x-session-id", "later".parse().expect("a header value"));
    let parsed = parse(
        Kind::Chat,
        "m",
        &headers,
        body.to_string().as_bytes(),
        &SamplingDefaults::default(),
    )
    .expect("parsed");
    assert_eq!(parsed.call.request.session_id, "5f3c");
}
