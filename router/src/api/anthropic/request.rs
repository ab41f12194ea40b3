//! A Messages body parsed into a `tandem.v1` `GenerateRequest`: `system`, `messages` with
//! their content blocks, `tools`, `tool_choice`, sampling and the session; every key honoured,
//! accepted where ignoring it changes no output, or refused by name.
//!
//! Accepted and ignored, because ignoring them changes no output:
//! - `cache_control` on any block or tool: Tandem's prefix cache is automatic, and every
//!   prompt's blocks are kept and reused without breakpoints;
//! - `thinking`'s `budget_tokens`: the budget is a ceiling, and `max_tokens` bounds the reply;
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
//! `thinking` (`enabled`, `adaptive`, `disabled`) switches a thinking model's reasoning on, to
//! its default, or off (the chat template's `enable_thinking`); the reasoning comes back as
//! `thinking` blocks. A model whose template does not think answers as it always does.
//!
//! Anthropic's server tools (`web_search_*`, `web_fetch_*`, `code_execution_*`,
//! `tool_search_tool_*`) are left out, and named in the response's header
//! ([`crate::api::http::dropped`]).
//!
//! Refused by name: `max_tokens: 0` (a request that only fills the prompt cache: Tandem's cache
//! fills on the first real turn), `image` and `document` blocks (the models read text only),
//! Anthropic's other typed tools (`bash_*`, `text_editor_*`, `computer_*`: define a custom tool
//! instead), and any key not listed here.

use std::collections::HashSet;

use axum::http::HeaderMap;
use serde_json::{Map, Value};
use tandem_proto::v1 as pb;

use crate::api::anthropic::messages::{block_type, check_effort, conversation, system};
use crate::api::http::dropped::{Dropped, anthropic_server_tool};
use crate::api::http::error::ApiError;
use crate::api::http::fields::{flag, function_tool, json_grammar, tool_list, unsigned};
use crate::api::http::{
    Call, base_sampling, check_model, json_object, only_keys, string, unknown_key,
};
use crate::api::session::{BodySession, session};
use crate::config::SamplingDefaults;

/// The Messages API's temperature: 0 to 1.
const TEMPERATURE: tandem_proto::policy::Bound = tandem_proto::policy::closed(0.0, 1.0);

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
    /// The server tools left out.
    pub(crate) dropped: Dropped,
}

/// Which endpoint a body came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Messages,
    CountTokens,
}

/// The model a Messages request's `model` asks for: a Claude model's name (Claude Code asks for
/// its own models by default) is the router's default model, `""`, which answers it (as
/// llama-server's one model does); any other name is itself.
pub(crate) fn requested(name: &str) -> &str {
    if name.starts_with("claude-") {
        ""
    } else {
        name
    }
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
    check_model(&body)?;
    let enable_thinking = thinking(&body)?;
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
    let mut dropped = Dropped::default();
    let mut request = pb::GenerateRequest {
        messages,
        tools: tools(&body, &referenced_tools(&body), &mut dropped)?,
        tool_choice: choice as i32,
        tool_choice_function: function,
        model: model.to_string(),
        enable_thinking,
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
        dropped,
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
        ..base_sampling(body, defaults, TEMPERATURE)?
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

/// `thinking`, one of Anthropic's shapes: whether a thinking model reasons (`adaptive`: its
/// template's default).
fn thinking(body: &Map<String, Value>) -> Result<Option<bool>, ApiError> {
    match body.get("thinking") {
        None | Some(Value::Null) => Ok(None),
        Some(t) => match t.get("type").and_then(Value::as_str) {
            Some("enabled") => Ok(Some(true)),
            Some("disabled") => Ok(Some(false)),
            Some("adaptive") => Ok(None),
            _ => Err(ApiError::invalid(
                "thinking",
                "'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N}, \
                 {\"type\": \"adaptive\"} or {\"type\": \"disabled\"}",
            )),
        },
    }
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
fn tools(
    body: &Map<String, Value>,
    loaded: &HashSet<String>,
    dropped: &mut Dropped,
) -> Result<Vec<pb::Tool>, ApiError> {
    tool_list(body, |param, t| {
        match t.get("type").and_then(Value::as_str) {
            None | Some("custom") => {}
            Some(kind) if anthropic_server_tool(kind) => {
                dropped.push(kind);
                return Ok(None);
            }
            Some(kind) => {
                return Err(ApiError::unsupported(
                    &format!("{param}.type"),
                    &format!("'{kind}' tools are not served; define a custom tool"),
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
        only_keys(t, param, &known, "tool definition")?;
        let tool = function_tool(param, t, "input_schema", true)?;
        let deferred = flag(t, "defer_loading")? && !loaded.contains(&tool.name);
        Ok((!deferred).then_some(tool))
    })
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
