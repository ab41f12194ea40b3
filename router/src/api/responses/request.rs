//! A Responses body parsed into a `tandem.v1` `GenerateRequest`: `input` (a string or items),
//! `instructions`, function `tools`, `tool_choice`, `text.format`, sampling and the session.
//!
//! The API is served stateless, as vLLM and llama-server serve it: nothing is stored, so
//! `store: true`, `previous_response_id`, `conversation` and `item_reference` items are refused
//! by name (an agent sends its whole history in `input`, and the prefix cache and the
//! session's affinity make that cheap). `store` absent or false is served.
//!
//! `reasoning.effort` `none` switches a thinking model's reasoning off (any other effort leaves
//! its template's default); the reasoning comes back as `reasoning` items.
//!
//! Accepted and ignored, because ignoring them changes no output: `reasoning.summary` (the
//! reasoning is returned whole, as its `content`), `reasoning` items in the history (the
//! template leaves earlier turns' reasoning out), `include: ["reasoning.encrypted_content"]`,
//! `truncation: "disabled"`, `service_tier` (any tier: the cluster serves each request the one
//! way it has), `metadata` (checked), `client_metadata` (Codex's turn metadata),
//! `prompt_cache_retention` (the prefix cache keeps what it can hold, whatever is asked),
//! `safety_identifier`, and `stream_options.include_obfuscation`.
//!
//! Tools are function, custom and namespace tools; those only OpenAI's servers run are left
//! out (`tools` says how). A function tool's `strict` is accepted: a call that `tool_choice`
//! forces follows the tools' schemas by grammar; a call the model makes on its own (`auto`) is
//! read from its markup (its arguments a JSON object, not held to the schema), or from a reply
//! that is one bare call whose arguments pass the schema ([`crate::api::http::reply`]).

use axum::http::HeaderMap;
use serde_json::{Map, Value};
use tandem_proto::v1 as pb;

use crate::api::http::dropped::Dropped;
use crate::api::http::error::ApiError;
use crate::api::http::fields::{
    check_metadata, flag, json_grammar, parallel_tool_calls, thinking_of_effort, unsigned,
};
use crate::api::http::{Call, base_sampling, check_model, json_object, string, unknown_key};
use crate::api::responses::tools::{Tools, qualified};
use crate::api::session::{BodySession, session};
use crate::config::SamplingDefaults;

const KEYS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "stream_options",
    "user",
    "prompt_cache_key",
    "metadata",
    "store",
    "include",
    "reasoning",
    "truncation",
    "service_tier",
    "safety_identifier",
    "client_metadata",
    "prompt_cache_retention",
];

/// A Responses request, read and checked, with the request fields its answer echoes.
pub(crate) struct Parsed {
    pub(crate) call: Call,
    pub(super) stream: bool,
    pub(super) parallel_tool_calls: bool,
    /// What the tools offered to the model are (their calls' items).
    pub(super) tools: Tools,
    /// The server tools left out.
    pub(super) dropped: Dropped,
    /// `instructions`, `tools`, `tool_choice`, `temperature`, `top_p`, `max_output_tokens`,
    /// `text`, `user`, `metadata`: as given, or their defaults.
    pub(super) echo: Map<String, Value>,
}

pub(crate) fn parse(
    model: &str,
    headers: &HeaderMap,
    body: &[u8],
    defaults: &SamplingDefaults,
) -> Result<Parsed, ApiError> {
    let body = json_object(body)?;
    if let Some(key) = unknown_key(&body, KEYS) {
        let why = match key {
            "previous_response_id" | "conversation" => {
                "responses are not stored (the API is served stateless): send the history in \
                 'input'"
            }
            _ => "Tandem does not implement it",
        };
        return Err(ApiError::unsupported(key, why));
    }
    check_model(&body)?;
    if flag(&body, "store")? {
        return Err(ApiError::unsupported(
            "store",
            "responses are not stored (the API is served stateless); store: false is served",
        ));
    }
    check_accepted(&body)?;
    check_metadata(&body)?;
    let stream = flag(&body, "stream")?;
    if let Some(o) = body.get("stream_options").filter(|v| !v.is_null()) {
        let o = o
            .as_object()
            .ok_or_else(|| ApiError::invalid("stream_options", "must be an object"))?;
        if let Some(k) = unknown_key(o, &["include_obfuscation"]) {
            return Err(ApiError::unsupported(
                &format!("stream_options.{k}"),
                "only include_obfuscation is taken",
            ));
        }
    }
    let mut messages = Vec::new();
    if let Some(i) = string(&body, "instructions")? {
        messages.push(pb::ChatMessage {
            role: "system".into(),
            content: i,
            ..Default::default()
        });
    }
    input(&body, &mut messages)?;
    let (offered, tools, dropped) = Tools::parse(&body)?;
    let (choice, function) = tool_choice(&body)?;
    let max_tokens = match unsigned(&body, "max_output_tokens")? {
        Some(0) => {
            return Err(ApiError::invalid(
                "max_output_tokens",
                "'max_output_tokens' must be at least 1",
            ));
        }
        m => m.map_or(0, |m| u32::try_from(m).unwrap_or(u32::MAX)),
    };
    let format = body.get("text").and_then(|t| t.get("format"));
    let grammar = match format.filter(|f| !f.is_null()) {
        None => None,
        Some(f) => json_grammar(
            "text.format",
            "text.format.schema",
            f.get("type").and_then(Value::as_str),
            f.get("schema"),
        )?,
    };
    let sampling = pb::SamplingParams {
        max_tokens,
        grammar,
        ..base_sampling(&body, defaults, tandem_proto::policy::OPENAI_TEMPERATURE)?
    };
    let request = pb::GenerateRequest {
        session_id: session(
            headers,
            BodySession {
                prompt_cache_key: string(&body, "prompt_cache_key")?,
                user: string(&body, "user")?,
                ..Default::default()
            },
        ),
        messages,
        tools: offered,
        tool_choice: choice as i32,
        tool_choice_function: function,
        sampling: Some(sampling),
        model: model.to_string(),
        enable_thinking: thinking_of_effort(
            (body.get("reasoning"))
                .and_then(|r| r.get("effort"))
                .and_then(Value::as_str),
        ),
        ..Default::default()
    };
    let parallel_tool_calls = parallel_tool_calls(&body)?;
    let echo = [
        "instructions",
        "tools",
        "tool_choice",
        "temperature",
        "top_p",
        "max_output_tokens",
        "text",
        "user",
        "metadata",
    ]
    .iter()
    .map(|k| (k.to_string(), body.get(*k).cloned().unwrap_or(Value::Null)))
    .collect();
    Ok(Parsed {
        call: Call::new(headers, request)?,
        stream,
        parallel_tool_calls,
        tools,
        dropped,
        echo,
    })
}

/// The keys accepted and ignored (see the module's doc), checked to hold what ignoring suits.
fn check_accepted(body: &Map<String, Value>) -> Result<(), ApiError> {
    if let Some(include) = body.get("include").filter(|v| !v.is_null()) {
        let items = include
            .as_array()
            .ok_or_else(|| ApiError::invalid("include", "'include' must be an array"))?;
        if let Some(other) = items
            .iter()
            .find(|i| i.as_str() != Some("reasoning.encrypted_content"))
        {
            return Err(ApiError::unsupported(
                "include",
                &format!("{other} is not served (reasoning.encrypted_content is accepted)"),
            ));
        }
    }
    if let Some(v) = string(body, "truncation")?
        && v != "disabled"
    {
        return Err(ApiError::unsupported(
            "truncation",
            "only \"disabled\" is served: a prompt over the context is refused, not cut",
        ));
    }
    for key in [
        "service_tier",
        "prompt_cache_retention",
        "safety_identifier",
    ] {
        string(body, key)?;
    }
    for key in ["client_metadata", "reasoning"] {
        if body
            .get(key)
            .is_some_and(|v| !v.is_null() && !v.is_object())
        {
            return Err(ApiError::invalid(key, format!("'{key}' must be an object")));
        }
    }
    Ok(())
}

/// The text of a message's content: a string, or parts of type `input_text`, `output_text`
/// or `refusal`.
fn content(param: &str, content: Option<&Value>) -> Result<String, ApiError> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => parts
            .iter()
            .enumerate()
            .map(|(j, p)| {
                let kind = p.get("type").and_then(Value::as_str);
                let text = match kind {
                    Some("refusal") => p.get("refusal"),
                    _ => p.get("text"),
                };
                match (kind, text) {
                    (Some("input_text" | "output_text" | "refusal"), Some(Value::String(t))) => {
                        Ok(t.as_str())
                    }
                    (Some(k @ ("input_image" | "input_file" | "input_audio")), _) => {
                        Err(ApiError::unsupported(
                            &format!("{param}[{j}]"),
                            &format!("{k} parts (the model served here reads text only)"),
                        ))
                    }
                    _ => Err(ApiError::invalid(
                        &format!("{param}[{j}]"),
                        "a content part is {\"type\": \"input_text\", \"text\": ...}",
                    )),
                }
            })
            .collect(),
        _ => Err(ApiError::invalid(
            param,
            "content must be a string or an array of parts",
        )),
    }
}

/// `input`: a string (one user message) or items. Consecutive `function_call` items are one
/// assistant turn's calls; a `function_call_output` is a `tool` message.
fn input(body: &Map<String, Value>, out: &mut Vec<pb::ChatMessage>) -> Result<(), ApiError> {
    let items = match body.get("input") {
        Some(Value::String(s)) => {
            out.push(pb::ChatMessage {
                role: "user".into(),
                content: s.clone(),
                ..Default::default()
            });
            return Ok(());
        }
        Some(Value::Array(items)) if !items.is_empty() => items,
        _ => {
            return Err(ApiError::invalid(
                "input",
                "'input' must be a string or a non-empty array of items",
            ));
        }
    };
    for (i, item) in items.iter().enumerate() {
        let param = format!("input[{i}]");
        let text = |k: &str| item.get(k).and_then(Value::as_str).map(str::to_string);
        let kind = text("type").unwrap_or_else(|| "message".into());
        match kind.as_str() {
            "message" => {
                let role = match text("role").as_deref() {
                    Some(r @ ("user" | "assistant" | "system")) => r.to_string(),
                    Some("developer") => "system".into(),
                    _ => {
                        return Err(ApiError::invalid(
                            &format!("{param}.role"),
                            "role must be user, assistant, system or developer",
                        ));
                    }
                };
                out.push(pb::ChatMessage {
                    role,
                    content: content(&format!("{param}.content"), item.get("content"))?,
                    ..Default::default()
                });
            }
            "function_call" | "custom_tool_call" => {
                let custom = kind == "custom_tool_call";
                let bad = || {
                    ApiError::invalid(
                        &param,
                        format!(
                            "a {kind} item has string 'call_id', 'name' and '{}'",
                            if custom { "input" } else { "arguments" }
                        ),
                    )
                };
                let name = text("name").ok_or_else(bad)?;
                let name = match text("namespace") {
                    Some(ns) => qualified(&ns, &name),
                    None => name,
                };
                let arguments = match custom {
                    true => {
                        serde_json::json!({ "input": text("input").ok_or_else(bad)? }).to_string()
                    }
                    false => text("arguments").ok_or_else(bad)?,
                };
                let call = pb::ToolCall {
                    id: text("call_id").ok_or_else(bad)?,
                    name,
                    arguments,
                };
                match out.last_mut() {
                    Some(m) if m.role == "assistant" => m.tool_calls.push(call),
                    _ => out.push(pb::ChatMessage {
                        role: "assistant".into(),
                        tool_calls: vec![call],
                        ..Default::default()
                    }),
                }
            }
            "function_call_output" | "custom_tool_call_output" => {
                let Some(id) = text("call_id") else {
                    return Err(ApiError::invalid(
                        &format!("{param}.call_id"),
                        format!("a {kind} names the call_id it answers"),
                    ));
                };
                out.push(pb::ChatMessage {
                    role: "tool".into(),
                    content: content(&format!("{param}.output"), item.get("output"))?,
                    tool_call_id: id,
                    ..Default::default()
                });
            }
            "reasoning" => {}
            other => {
                return Err(ApiError::unsupported(
                    &format!("{param}.type"),
                    &format!("'{other}' items are not served"),
                ));
            }
        }
    }
    Ok(())
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"`, `{"type": "function", "name"}` (with the
/// `namespace` of a namespace's function) or `{"type": "custom", "name"}`.
fn tool_choice(body: &Map<String, Value>) -> Result<(pb::ToolChoice, String), ApiError> {
    let bad = || {
        ApiError::invalid(
            "tool_choice",
            "'tool_choice' must be \"none\", \"auto\", \"required\", {\"type\": \"function\", \
             \"name\": ...} or {\"type\": \"custom\", \"name\": ...}",
        )
    };
    Ok(match body.get("tool_choice") {
        None | Some(Value::Null) => (pb::ToolChoice::Auto, String::new()),
        Some(Value::String(c)) => match c.as_str() {
            "auto" => (pb::ToolChoice::Auto, String::new()),
            "none" => (pb::ToolChoice::None, String::new()),
            "required" => (pb::ToolChoice::Required, String::new()),
            _ => return Err(bad()),
        },
        Some(c) => match c.get("type").and_then(Value::as_str) {
            Some("function" | "custom") => {
                let name = c.get("name").and_then(Value::as_str).ok_or_else(bad)?;
                let name = match c.get("namespace").and_then(Value::as_str) {
                    Some(ns) => qualified(ns, name),
                    None => name.to_string(),
                };
                (pb::ToolChoice::Function, name)
            }
            Some(k @ ("allowed_tools" | "mcp" | "file_search" | "web_search_preview")) => {
                return Err(ApiError::unsupported(
                    "tool_choice",
                    &format!("a tool choice of type '{k}' is not served"),
                ));
            }
            _ => return Err(bad()),
        },
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn parse_json(body: Value) -> Result<Parsed, ApiError> {
        parse(
            "m",
            &HeaderMap::new(),
            body.to_string().as_bytes(),
            &SamplingDefaults::default(),
        )
    }

    #[test]
    fn items_become_chat_messages() {
        let parsed = parse_json(json!({
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "weather?"},
                {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": "and?"}]},
            ],
            "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"},
                       "strict": true}],
            "tool_choice": {"type": "function", "name": "weather"},
            "text": {"format": {"type": "json_object"}},
            "max_output_tokens": 64,
            "prompt_cache_key": "s1",
            "store": false,
            "reasoning": {"effort": "low"},
            "include": ["reasoning.encrypted_content"],
        }))
        .expect("valid");
        let r = &parsed.call.request;
        let roles: Vec<&str> = r.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        assert_eq!(r.messages[2].tool_calls.len(), 2);
        assert_eq!(r.messages[3].tool_call_id, "c1");
        assert_eq!(r.tool_choice_function, "weather");
        assert_eq!(r.session_id, "s1");
        let s = r.sampling.as_ref().expect("sampling");
        assert_eq!(s.max_tokens, 64);
        assert!(s.grammar.is_some());
        assert_eq!(parsed.echo["max_output_tokens"], json!(64));
    }

    #[test]
    fn state_and_what_is_not_served_are_refused_by_name() {
        for (key, value, param) in [
            ("store", json!(true), "store"),
            (
                "previous_response_id",
                json!("resp_1"),
                "previous_response_id",
            ),
            (
                "input",
                json!([{"type": "item_reference", "id": "x"}]),
                "input[0].type",
            ),
            (
                "input",
                json!([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]),
                "input[0].content[0]",
            ),
            ("tools", json!([{"type": "local_shell"}]), "tools[0].type"),
            (
                "include",
                json!(["message.output_text.logprobs"]),
                "include",
            ),
            ("truncation", json!("auto"), "truncation"),
        ] {
            let mut body = json!({"model": "m", "input": "hi"});
            body[key] = value;
            let e = parse_json(body).err().expect("refused");
            assert_eq!(e.param.as_deref(), Some(param), "{}", e.message);
        }
    }
}
