//! The Messages parser's tests: blocks into chat messages, the tool choice, and refusals by name.

use serde_json::json;

use super::*;

fn parse_json(endpoint: Endpoint, body: Value) -> Result<Parsed, ApiError> {
    parse(
        endpoint,
        "m",
        &HeaderMap::new(),
        body.to_string().as_bytes(),
        &SamplingDefaults::default(),
    )
}

fn messages(body: Value) -> Result<Parsed, ApiError> {
    parse_json(Endpoint::Messages, body)
}

#[test]
fn blocks_tool_uses_and_results_become_chat_messages() {
    let parsed = messages(json!({
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "x"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "and tomorrow?"},
            ]},
        ],
        "tools": [{"name": "weather", "description": "d", "input_schema": {"type": "object"},
                   "cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "tool", "name": "weather", "disable_parallel_tool_use": true},
        "metadata": {"user_id": "user_1_account_2_session_abc"},
        "stop_sequences": ["END"],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }))
    .expect("valid");
    assert_eq!(parsed.max_tokens, 32000);
    assert!(!parsed.parallel_tool_calls);
    let r = &parsed.call.request;
    let roles: Vec<&str> = r.messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
    assert_eq!(r.messages[0].content, "You are terse.");
    assert_eq!(r.messages[2].content, "Checking.");
    assert_eq!(r.messages[2].tool_calls[0].arguments, r#"{"city":"Paris"}"#);
    assert_eq!(r.messages[3].tool_call_id, "toolu_1");
    assert_eq!(r.messages[3].content, "sunny");
    assert_eq!(r.tool_choice, pb::ToolChoice::Function as i32);
    assert_eq!(r.tool_choice_function, "weather");
    assert_eq!(r.session_id, "abc");
    let s = r.sampling.as_ref().expect("sampling");
    assert_eq!((s.stop.clone(), s.max_tokens), (vec!["END".to_string()], 0));
}

#[test]
fn refusals_name_what_they_refuse() {
    let base =
        || json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
    let refused = |edit: &dyn Fn(&mut Value), param: &str| {
        let mut body = base();
        edit(&mut body);
        let e = messages(body).err().expect("refused");
        assert_eq!(e.param.as_deref(), Some(param), "{}", e.message);
    };
    refused(&|b| b["max_tokens"] = Value::Null, "max_tokens");
    refused(&|b| b["temperature"] = json!(1.5), "temperature");
    refused(&|b| b["container"] = json!("c"), "container");
    refused(
        &|b| b["messages"][0]["content"] = json!([{"type": "image", "source": {}}]),
        "messages[0].content[0]",
    );
    refused(
        &|b| b["tools"] = json!([{"type": "bash_20250124", "name": "bash"}]),
        "tools[0].type",
    );
    refused(
        &|b| b["tool_choice"] = json!({"type": "tool"}),
        "tool_choice",
    );
    refused(
        &|b| b["metadata"] = json!({"user_id": "u", "x": 1}),
        "metadata.x",
    );
}

#[test]
fn server_tools_are_left_out_and_named() {
    let body = json!({"model": "m", "max_tokens": 8,
                      "messages": [{"role": "user", "content": "hi"}],
                      "tools": [{"type": "web_search_20250305", "name": "web_search"},
                                {"name": "get", "input_schema": {"type": "object"}}]});
    let parsed = messages(body).expect("served");
    let names: Vec<&str> = parsed
        .call
        .request
        .tools
        .iter()
        .map(|t| t.name.as_str())
        .collect();
    assert_eq!(names, ["get"]);
    assert_eq!(parsed.dropped.types(), ["web_search_20250305"]);
}

#[test]
fn count_tokens_takes_no_sampling() {
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    let parsed = parse_json(Endpoint::CountTokens, body.clone()).expect("valid");
    assert!(parsed.call.request.sampling.is_none());
    let mut with = body;
    with["max_tokens"] = json!(5);
    assert!(parse_json(Endpoint::CountTokens, with).is_err());
}

#[test]
fn deferred_tools_join_the_prompt_once_a_tool_search_loads_them() {
    let tool = |name: &str, deferred: bool| json!({"name": name, "input_schema": {"type": "object"}, "defer_loading": deferred});
    let tools = json!([
        tool("ToolSearch", false),
        tool("Cron", true),
        tool("Monitor", true)
    ]);
    let first = messages(json!({
        "model": "m", "max_tokens": 8, "tools": tools,
        "messages": [
            {"role": "user", "content": "hi"},
            // Claude Code's mid-conversation system message, with its own effort.
            {"role": "system", "content": [{"type": "text", "text": "env"}],
             "output_config": {"effort": "medium"}},
        ],
    }))
    .expect("valid");
    let names = |p: &Parsed| -> Vec<String> {
        p.call
            .request
            .tools
            .iter()
            .map(|t| t.name.clone())
            .collect()
    };
    assert_eq!(names(&first), ["ToolSearch"]);
    assert_eq!(first.call.request.messages[1].role, "system");
    let searched = messages(json!({
        "model": "m", "max_tokens": 8, "tools": tools,
        "messages": [
            {"role": "user", "content": "schedule it"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {"query": "cron"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                "content": [{"type": "tool_reference", "tool_name": "Cron"}]}]},
        ],
    }))
    .expect("valid");
    assert_eq!(names(&searched), ["ToolSearch", "Cron"]);
    assert_eq!(searched.call.request.messages[2].content, "Cron");
}
