//! A Messages body parsed into a `tandem.v1` `GenerateRequest`: `system`, `messages` with
//! their content blocks, `tools`, `tool_choice`, sampling and the session; every key honoured,
//! accepted where ignoring it changes no output, or refused by name.
//!
//! Accepted and ignored, because ignoring them changes no output:
//! - `cache_control` on any block or tool: Tandem's prefix cache is automatic, and every
//!   prompt's blocks are kept and reused without breakpoints;
//! - `thinking` (`enabled` with a `budget_tokens`, `adaptive`, `disabled`): the budget is a
//!   ceiling, and the models Tandem serves answer without an extended-thinking phase, so the
//!   reply has no `thinking` blocks;
//! - `output_config.effort`, for the same reason: the reply is the model's one way of answering;
//!   so is a message's own `output_config` (`effort` only), which Claude Code sends on the
//!   system messages it adds mid-conversation;
//! - `thinking` and `redacted_thinking` blocks in earlier assistant turns: Anthropic's API
//!   leaves earlier turns' thinking out of the context as well;
//! - `context_management` edits of the `clear_thinking_*` types: no thinking is kept to clear
//!   (other edits, which would clear tool results from the context, are refused by name);
//! - `speed` (`standard` or `fast`: a cluster decodes as fast as it can either way) and
//!   `inference_geo` (the cluster runs where it was deployed);
//! - `tool_result.is_error`: the result's text is the model's to read either way;
//! - `anthropic-version` and `anthropic-beta` headers, and `service_tier`.
//!
//! `output_config.format` (`{"type": "json_schema", "schema"}`) holds the reply to its schema
//! by grammar, as the OpenAI APIs' structured outputs do.
//!
//! Refused by name: `max_tokens: 0` (a request that only fills the prompt cache: Tandem's cache
//! fills on the first real turn), `image` and `document` blocks (the models read text only), server tools
//! (a tool with a `type` other than `custom`), and any key not listed here.

use std::collections::HashSet;

use axum::http::{HeaderMap, StatusCode};
use serde_json::{Map, Value};
use tandem_proto::v1 as pb;

use crate::api::http::error::ApiError;
use crate::api::http::fields::{flag, json_grammar, unsigned};
use crate::api::http::{Call, base_sampling, json_object, string, unknown_key};
use crate::api::session::{BodySession, session};
use crate::config::SamplingDefaults;

/// The keys both endpoints take.
const COMMON_KEYS: &[&str] = &[
    "model",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
    "cache_control",
    "speed",
    "context_management",
];
/// The keys `/v1/messages` takes besides.
const MESSAGES_KEYS: &[&str] = &[
    "max_tokens",
    "stop_sequences",
    "temperature",
    "top_p",
    "top_k",
    "metadata",
    "stream",
    "service_tier",
    "inference_geo",
];

/// A Messages request, read and checked.
pub(crate) struct Parsed {
    pub(crate) call: Call,
    pub(super) stream: bool,
    /// `tool_choice.disable_parallel_tool_use`: false keeps a reply's first tool call only.
    pub(super) parallel_tool_calls: bool,
    /// `max_tokens`, the ceiling the reply's length is held to (see [`sampling`]); 0 for
    /// `count_tokens`.
    pub(crate) max_tokens: u32,
}

/// Which endpoint a body came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Messages,
    CountTokens,
}

/// Whether `name` asks for the model `model`: its own name, or a Claude model's, which Claude
/// Code asks for by default and the one model the cluster serves answers (as llama-server does).
fn serves(model: &str, name: &str) -> bool {
    name == model || name.starts_with("claude-")
}

pub(crate) fn parse(
    endpoint: Endpoint,
    model: &str,
    headers: &HeaderMap,
    body: &[u8],
    defaults: &SamplingDefaults,
) -> Result<Parsed, ApiError> {
    let body = json_object(body)?;
    let known = match endpoint {
        Endpoint::Messages => [COMMON_KEYS, MESSAGES_KEYS].concat(),
        Endpoint::CountTokens => COMMON_KEYS.to_vec(),
    };
    if let Some(key) = unknown_key(&body, &known) {
        return Err(ApiError::unsupported(key, "Tandem does not implement it"));
    }
    match body.get("model") {
        Some(Value::String(m)) if serves(model, m) => {}
        Some(Value::String(m)) => {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!("model: '{m}' does not exist; this server has '{model}'"),
                "not_found_error",
            ));
        }
        _ => return Err(ApiError::invalid("model", "'model' must be a string")),
    }
    check_thinking(&body)?;
    check_context_management(&body)?;
    let grammar = output_config(&body)?;
    if let Some(speed) = string(&body, "speed")?
        && speed != "standard"
        && speed != "fast"
    {
        return Err(ApiError::invalid(
            "speed",
            "'speed' must be \"standard\" or \"fast\"",
        ));
    }
    let (choice, function, parallel_tool_calls) = tool_choice(&body)?;
    let mut messages = system(&body)?;
    messages.extend(conversation(&body)?);
    let mut request = pb::GenerateRequest {
        messages,
        tools: tools(&body, &referenced_tools(&body))?,
        tool_choice: choice as i32,
        tool_choice_function: function,
        ..Default::default()
    };
    let (stream, max_tokens) = match endpoint {
        Endpoint::CountTokens => (false, 0),
        Endpoint::Messages => {
            let (mut sampling, max_tokens) = sampling(&body, defaults)?;
            sampling.grammar = grammar;
            string(&body, "inference_geo")?;
            request.sampling = Some(sampling);
            request.session_id = session(
                headers,
                BodySession {
                    metadata_user_id: metadata_user_id(&body)?,
                    ..Default::default()
                },
            );
            match body.get("service_tier") {
                None | Some(Value::Null) => {}
                Some(Value::String(t)) if t == "auto" || t == "standard_only" => {}
                Some(_) => {
                    return Err(ApiError::invalid(
                        "service_tier",
                        "'service_tier' must be \"auto\" or \"standard_only\"",
                    ));
                }
            }
            (flag(&body, "stream")?, max_tokens)
        }
    };
    Ok(Parsed {
        call: Call::new(headers, request)?,
        stream,
        parallel_tool_calls,
        max_tokens,
    })
}

/// `stop_sequences`, `temperature` (0 to 1), `top_p`, `top_k`; and `max_tokens` (required).
///
/// `max_tokens` is a ceiling, as Anthropic's API defines it: Claude Code asks for 32,000 on
/// every turn, so it is carried as the request's default max_tokens (see
/// [`crate::dispatch::prepare::prepare`]), which the rest of the context and the router's limit
/// lower, rather than refused when the prompt leaves less room.
fn sampling(
    body: &Map<String, Value>,
    defaults: &SamplingDefaults,
) -> Result<(pb::SamplingParams, u32), ApiError> {
    let max_tokens = match unsigned(body, "max_tokens")? {
        Some(0) => {
            return Err(ApiError::unsupported(
                "max_tokens",
                "0 (filling the prompt cache without a reply) is not served: the prefix cache \
                 fills on the first turn that asks for one",
            ));
        }
        Some(m) => u32::try_from(m).unwrap_or(u32::MAX),
        None => {
            return Err(ApiError::invalid(
                "max_tokens",
                "'max_tokens' is required: a number of tokens, at least 1",
            ));
        }
    };
    let stop = match body.get("stop_sequences") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| match s.as_str() {
                Some(s) if !s.is_empty() => Ok(s.to_string()),
                _ => Err(ApiError::invalid(
                    "stop_sequences",
                    "'stop_sequences' must hold non-empty strings",
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid(
                "stop_sequences",
                "'stop_sequences' must be an array of strings",
            ));
        }
    };
    let sampling = pb::SamplingParams {
        stop,
        ..base_sampling(body, defaults, 1.0)?
    };
    Ok((sampling, max_tokens))
}

/// `metadata`: `{"user_id": ...}`, the one key Anthropic defines.
fn metadata_user_id(body: &Map<String, Value>) -> Result<Option<String>, ApiError> {
    let Some(m) = body.get("metadata").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let Some(m) = m.as_object() else {
        return Err(ApiError::invalid(
            "metadata",
            "'metadata' must be an object",
        ));
    };
    if let Some(k) = unknown_key(m, &["user_id"]) {
        return Err(ApiError::unsupported(
            &format!("metadata.{k}"),
            "metadata takes user_id only",
        ));
    }
    string(m, "user_id")
}

/// `output_config`: `effort` accepted (see the module's doc), and `format`'s grammar.
fn output_config(body: &Map<String, Value>) -> Result<Option<pb::Grammar>, ApiError> {
    let Some(config) = body.get("output_config").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    check_effort(body, "output_config", &["effort", "format"])?;
    let Some(format) = config.get("format").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("json_schema") => json_grammar(
            "output_config.format",
            "output_config.format.schema",
            Some("json_schema"),
            format.get("schema"),
        ),
        _ => Err(ApiError::invalid(
            "output_config.format",
            "'format' must be {\"type\": \"json_schema\", \"schema\": {...}}",
        )),
    }
}

/// An `output_config` (`param`) in `object`, if any, checked to hold only the `known` keys and
/// a valid `effort` (the top level's `format` is read by [`output_config`]).
fn check_effort(object: &Map<String, Value>, param: &str, known: &[&str]) -> Result<(), ApiError> {
    let Some(config) = object.get("output_config").filter(|v| !v.is_null()) else {
        return Ok(());
    };
    let Some(config) = config.as_object() else {
        return Err(ApiError::invalid(
            param,
            "'output_config' must be an object",
        ));
    };
    if let Some(k) = unknown_key(config, known) {
        return Err(ApiError::unsupported(
            &format!("{param}.{k}"),
            &format!("output_config takes {}", known.join(" and ")),
        ));
    }
    match string(config, "effort")?.as_deref() {
        None | Some("low" | "medium" | "high" | "xhigh" | "max") => Ok(()),
        Some(_) => Err(ApiError::invalid(
            &format!("{param}.effort"),
            "'effort' must be low, medium, high, xhigh or max",
        )),
    }
}

/// `context_management`: `{"edits": [...]}` of `clear_thinking_*` edits only (see the module's
/// doc).
fn check_context_management(body: &Map<String, Value>) -> Result<(), ApiError> {
    let Some(c) = body.get("context_management").filter(|v| !v.is_null()) else {
        return Ok(());
    };
    let edits = c
        .as_object()
        .filter(|o| unknown_key(o, &["edits"]).is_none())
        .and_then(|o| o.get("edits"))
        .and_then(Value::as_array)
        .ok_or_else(|| {
            ApiError::invalid(
                "context_management",
                "'context_management' must be {\"edits\": [...]}",
            )
        })?;
    for (i, edit) in edits.iter().enumerate() {
        let kind = edit.get("type").and_then(Value::as_str).unwrap_or_default();
        if !kind.starts_with("clear_thinking_") {
            return Err(ApiError::unsupported(
                &format!("context_management.edits[{i}]"),
                &format!(
                    "'{kind}' would change the context; only clear_thinking edits are taken (no \
                     thinking is kept to clear)"
                ),
            ));
        }
    }
    Ok(())
}

/// `thinking`: accepted (see the module's doc) when it is one of Anthropic's shapes.
fn check_thinking(body: &Map<String, Value>) -> Result<(), ApiError> {
    match body.get("thinking") {
        None | Some(Value::Null) => Ok(()),
        Some(t) => match t.get("type").and_then(Value::as_str) {
            Some("enabled" | "disabled" | "adaptive") => Ok(()),
            _ => Err(ApiError::invalid(
                "thinking",
                "'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N}, \
                 {\"type\": \"adaptive\"} or {\"type\": \"disabled\"}",
            )),
        },
    }
}

/// A block's `type`.
fn block_type(block: &Value) -> Option<&str> {
    block.get("type").and_then(Value::as_str)
}

/// The text of `text` blocks; any other block is refused as `param`.
fn text_blocks(param: &str, blocks: &[Value]) -> Result<String, ApiError> {
    blocks
        .iter()
        .enumerate()
        .map(|(j, b)| match (block_type(b), b.get("text")) {
            (Some("text"), Some(Value::String(t))) => Ok(t.as_str()),
            (Some(kind @ ("image" | "document")), _) => Err(refused_block(param, j, kind)),
            _ => Err(ApiError::invalid(
                &format!("{param}[{j}]"),
                "expected a block {\"type\": \"text\", \"text\": ...}",
            )),
        })
        .collect()
}

/// A `tool_result`'s blocks: text, and `tool_reference` blocks (a tool search's finds, shown as
/// the tool's name: the tool itself joins the prompt's tools).
fn result_blocks(param: &str, blocks: &[Value]) -> Result<String, ApiError> {
    let mut lines = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        match (block_type(b), b.get("tool_name")) {
            (Some("tool_reference"), Some(Value::String(name))) => lines.push(name.clone()),
            _ => lines.push(text_blocks(
                &format!("{param}[{j}]"),
                std::slice::from_ref(b),
            )?),
        }
    }
    Ok(lines.join("\n"))
}

fn refused_block(param: &str, j: usize, kind: &str) -> ApiError {
    ApiError::invalid(
        &format!("{param}[{j}]"),
        format!("{kind} blocks are not supported: the model served here reads text only"),
    )
}

/// `system`: a string or text blocks, as the conversation's system message.
fn system(body: &Map<String, Value>) -> Result<Vec<pb::ChatMessage>, ApiError> {
    let text = match body.get("system") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => text_blocks("system", blocks)?,
        Some(_) => {
            return Err(ApiError::invalid(
                "system",
                "'system' must be a string or an array of text blocks",
            ));
        }
    };
    Ok(vec![pb::ChatMessage {
        role: "system".into(),
        content: text,
        ..Default::default()
    }])
}

/// `messages`, alternating `user` and `assistant` turns (with `system` messages between them,
/// which Claude Code sends mid-conversation), as chat messages: an assistant's
/// `tool_use` blocks become its tool calls, and a user turn's `tool_result` blocks become `tool`
/// messages, ahead of the turn's text.
fn conversation(body: &Map<String, Value>) -> Result<Vec<pb::ChatMessage>, ApiError> {
    let list = match body.get("messages") {
        Some(Value::Array(list)) if !list.is_empty() => list,
        _ => {
            return Err(ApiError::invalid(
                "messages",
                "'messages' must be a non-empty array",
            ));
        }
    };
    let mut out = Vec::new();
    for (i, m) in list.iter().enumerate() {
        let param = format!("messages[{i}]");
        let Some(m) = m.as_object() else {
            return Err(ApiError::invalid(
                &param,
                "a message is {\"role\", \"content\"}",
            ));
        };
        if let Some(k) = unknown_key(m, &["role", "content", "output_config"]) {
            return Err(ApiError::unsupported(
                &format!("{param}.{k}"),
                "a message has role, content and output_config",
            ));
        }
        check_effort(m, &format!("{param}.output_config"), &["effort"])?;
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant" | "system")) => r,
            _ => {
                return Err(ApiError::invalid(
                    &format!("{param}.role"),
                    "role must be \"user\", \"assistant\" or \"system\"",
                ));
            }
        };
        let param = format!("{param}.content");
        let blocks = match m.get("content") {
            Some(Value::String(s)) => {
                out.push(message(role, s.clone()));
                continue;
            }
            Some(Value::Array(blocks)) => blocks,
            _ => {
                return Err(ApiError::invalid(
                    &param,
                    "content must be a string or an array of blocks",
                ));
            }
        };
        match role {
            "assistant" => out.push(assistant(&param, blocks)?),
            "system" => out.push(message(role, text_blocks(&param, blocks)?)),
            _ => user(&param, blocks, &mut out)?,
        }
    }
    Ok(out)
}

fn message(role: &str, content: String) -> pb::ChatMessage {
    pb::ChatMessage {
        role: role.into(),
        content,
        ..Default::default()
    }
}

/// An assistant turn: its text, and its `tool_use` blocks as calls.
fn assistant(param: &str, blocks: &[Value]) -> Result<pb::ChatMessage, ApiError> {
    let mut turn = message("assistant", String::new());
    for (j, b) in blocks.iter().enumerate() {
        match block_type(b) {
            Some("text") => turn.content += &text_blocks(param, std::slice::from_ref(b))?,
            Some("tool_use") => {
                let bad = || {
                    ApiError::invalid(
                        &format!("{param}[{j}]"),
                        "a tool_use block is {\"id\", \"name\", \"input\": {...}}",
                    )
                };
                let text = |k: &str| b.get(k).and_then(Value::as_str).map(str::to_string);
                let input = b.get("input").filter(|i| i.is_object()).ok_or_else(bad)?;
                turn.tool_calls.push(pb::ToolCall {
                    id: text("id").ok_or_else(bad)?,
                    name: text("name").ok_or_else(bad)?,
                    arguments: input.to_string(),
                });
            }
            Some("thinking" | "redacted_thinking") => {}
            Some(kind) => {
                return Err(ApiError::invalid(
                    &format!("{param}[{j}]"),
                    format!("an assistant turn holds text and tool_use blocks, not {kind}"),
                ));
            }
            None => {
                return Err(ApiError::invalid(
                    &format!("{param}[{j}]"),
                    "a block has a type",
                ));
            }
        }
    }
    Ok(turn)
}

/// A user turn: a `tool` message per `tool_result` block, then a user message with its text.
fn user(param: &str, blocks: &[Value], out: &mut Vec<pb::ChatMessage>) -> Result<(), ApiError> {
    let mut text = String::new();
    for (j, b) in blocks.iter().enumerate() {
        match block_type(b) {
            Some("text") => text += &text_blocks(param, std::slice::from_ref(b))?,
            Some("tool_result") => {
                let param = format!("{param}[{j}]");
                let Some(Value::String(id)) = b.get("tool_use_id") else {
                    return Err(ApiError::invalid(
                        &param,
                        "a tool_result names the tool_use_id it answers",
                    ));
                };
                let content = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => result_blocks(&format!("{param}.content"), parts)?,
                    Some(_) => {
                        return Err(ApiError::invalid(
                            &format!("{param}.content"),
                            "a tool_result's content is a string or text blocks",
                        ));
                    }
                };
                out.push(pb::ChatMessage {
                    role: "tool".into(),
                    content,
                    tool_call_id: id.clone(),
                    ..Default::default()
                });
            }
            Some(kind @ ("image" | "document")) => return Err(refused_block(param, j, kind)),
            Some(kind) => {
                return Err(ApiError::invalid(
                    &format!("{param}[{j}]"),
                    format!("a user turn holds text and tool_result blocks, not {kind}"),
                ));
            }
            None => {
                return Err(ApiError::invalid(
                    &format!("{param}[{j}]"),
                    "a block has a type",
                ));
            }
        }
    }
    if !text.is_empty() || out.last().is_none_or(|m| m.role != "tool") {
        out.push(message("user", text));
    }
    Ok(())
}

/// The tools the conversation has loaded: those a `tool_reference` block names (a tool search's
/// result) and those an assistant turn called.
fn referenced_tools(body: &Map<String, Value>) -> HashSet<String> {
    let mut names = HashSet::new();
    let mut stack: Vec<&Value> = body.get("messages").into_iter().collect();
    while let Some(v) = stack.pop() {
        match v {
            Value::Array(a) => stack.extend(a),
            Value::Object(o) => {
                let name = match block_type(v) {
                    Some("tool_reference") => o.get("tool_name"),
                    Some("tool_use") => o.get("name"),
                    _ => None,
                };
                if let Some(Value::String(n)) = name {
                    names.insert(n.clone());
                }
                stack.extend(o.get("content"));
            }
            _ => {}
        }
    }
    names
}

/// `tools`: `{"name", "description", "input_schema"}` (a custom tool; `cache_control`
/// ignored). A tool with `defer_loading: true` is left out of the prompt, as Anthropic's tool
/// search leaves it, until the conversation has `loaded` it.
fn tools(body: &Map<String, Value>, loaded: &HashSet<String>) -> Result<Vec<pb::Tool>, ApiError> {
    let list = match body.get("tools") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(ApiError::invalid("tools", "'tools' must be an array")),
    };
    list.iter()
        .enumerate()
        .map(|(i, t)| {
            let param = format!("tools[{i}]");
            let Some(t) = t.as_object() else {
                return Err(ApiError::invalid(&param, "a tool is an object"));
            };
            match t.get("type").and_then(Value::as_str) {
                None | Some("custom") => {}
                Some(kind) => {
                    return Err(ApiError::unsupported(
                        &format!("{param}.type"),
                        &format!("server tools ('{kind}') are not served; define a custom tool"),
                    ));
                }
            }
            let known = [
                "type",
                "name",
                "description",
                "input_schema",
                "cache_control",
                "defer_loading",
            ];
            if let Some(k) = unknown_key(t, &known) {
                return Err(ApiError::unsupported(
                    &format!("{param}.{k}"),
                    "not a tool definition's key",
                ));
            }
            let name = match t.get("name") {
                Some(Value::String(n)) if crate::dispatch::chat::valid_function_name(n) => {
                    n.clone()
                }
                _ => {
                    return Err(ApiError::invalid(
                        &format!("{param}.name"),
                        "the name must be 1 to 64 of a-z, A-Z, 0-9, _ and -",
                    ));
                }
            };
            let parameters = match t.get("input_schema") {
                Some(s @ Value::Object(_)) => s.to_string(),
                _ => {
                    return Err(ApiError::invalid(
                        &format!("{param}.input_schema"),
                        "a tool needs its 'input_schema' object",
                    ));
                }
            };
            let description = string(t, "description")?.unwrap_or_default();
            let deferred = flag(t, "defer_loading")? && !loaded.contains(&name);
            Ok((!deferred).then_some(pb::Tool {
                name,
                description,
                parameters,
            }))
        })
        .filter_map(Result::transpose)
        .collect()
}

/// `tool_choice`: `{"type": "auto" | "any" | "tool" (with "name") | "none",
/// "disable_parallel_tool_use"}`; with whether a reply may make several calls.
fn tool_choice(body: &Map<String, Value>) -> Result<(pb::ToolChoice, String, bool), ApiError> {
    let Some(c) = body.get("tool_choice").filter(|v| !v.is_null()) else {
        return Ok((pb::ToolChoice::Auto, String::new(), true));
    };
    let bad = || {
        ApiError::invalid(
            "tool_choice",
            "'tool_choice' must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \
             \"tool\", \"name\": ...} or {\"type\": \"none\"}",
        )
    };
    let c = c.as_object().ok_or_else(bad)?;
    let parallel = !flag(c, "disable_parallel_tool_use")?;
    let (choice, name) = match c.get("type").and_then(Value::as_str) {
        Some("auto") => (pb::ToolChoice::Auto, String::new()),
        Some("any") => (pb::ToolChoice::Required, String::new()),
        Some("none") => (pb::ToolChoice::None, String::new()),
        Some("tool") => (
            pb::ToolChoice::Function,
            string(c, "name")?.ok_or_else(bad)?,
        ),
        _ => return Err(bad()),
    };
    Ok((choice, name, parallel))
}

#[cfg(test)]
mod tests;
