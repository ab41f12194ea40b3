//! A request body parsed into a `tandem.v1` `GenerateRequest`: every key either honoured,
//! accepted at the value that asks nothing of the server, or refused by name.
//!
//! The body is parsed by hand from a JSON object, not derived, so that an unknown key can be
//! named in the error instead of failing the whole parse or being dropped.

use std::collections::HashMap;
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use serde_json::{Map, Value, json};
use tandem_proto::v1 as pb;

use crate::api::openai::error::ApiError;
use crate::config::SamplingDefaults;

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Chat,
    Completion,
}

impl Kind {
    pub(super) fn object(self, streaming: bool) -> &'static str {
        match (self, streaming) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    pub(super) fn id_prefix(self) -> &'static str {
        match self {
            Kind::Chat => "chatcmpl-",
            Kind::Completion => "cmpl-",
        }
    }
}

/// A request, read and checked.
#[derive(Debug)]
pub(crate) struct Parsed {
    pub(crate) request: pb::GenerateRequest,
    pub(super) stream: bool,
    /// Where a stream reports usage (`stream_options`).
    pub(super) stream_usage: StreamUsage,
    pub(super) timeout: Option<Duration>,
    /// `parallel_tool_calls`: false keeps a reply's first tool call only.
    pub(super) parallel_tool_calls: bool,
}

/// Where a stream reports usage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StreamUsage {
    /// Nowhere.
    None,
    /// In a chunk of its own after the last (`include_usage`); the others have `usage: null`.
    Last,
    /// That, and the usage so far on every other chunk as well (`continuous_usage_stats`).
    Continuous,
}

/// The keys each endpoint honours. Anything else that is present and not null is rejected.
const COMMON_KEYS: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "user",
    "cache_salt",
    "logprobs",
    "logit_bias",
    "min_p",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
];
const CHAT_KEYS: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "response_format",
    "store",
    "metadata",
    "parallel_tool_calls",
    "service_tier",
    "tools",
    "tool_choice",
];
const COMPLETION_KEYS: &[&str] = &["prompt", "echo", "best_of", "suffix"];

/// Most stop sequences, as in OpenAI's API.
const MAX_STOP: usize = 4;

/// OpenAI's bounds on `metadata`: pairs, and characters per key and per value.
const METADATA_PAIRS: usize = 16;
const METADATA_KEY_CHARS: usize = 64;
const METADATA_VALUE_CHARS: usize = 512;

/// Checks `metadata` (string pairs within OpenAI's bounds). It tags a stored completion, and
/// nothing is stored (`store` is refused), so it is checked and then ignored.
fn check_metadata(body: &Map<String, Value>) -> Result<(), ApiError> {
    let Some(m) = body.get("metadata").filter(|v| !v.is_null()) else {
        return Ok(());
    };
    let invalid = |why: String| Err(ApiError::invalid("metadata", why));
    let Some(pairs) = m.as_object() else {
        return invalid("'metadata' must be an object of strings".into());
    };
    if pairs.len() > METADATA_PAIRS {
        return invalid(format!("at most {METADATA_PAIRS} pairs"));
    }
    for (k, v) in pairs {
        let Some(v) = v.as_str() else {
            return invalid(format!("metadata['{k}'] must be a string"));
        };
        if k.chars().count() > METADATA_KEY_CHARS || v.chars().count() > METADATA_VALUE_CHARS {
            return invalid(format!(
                "keys of at most {METADATA_KEY_CHARS} characters, values of at most \
                 {METADATA_VALUE_CHARS}"
            ));
        }
    }
    Ok(())
}

fn number(body: &Map<String, Value>, key: &str) -> Result<Option<f64>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| ApiError::invalid(key, format!("'{key}' must be a number"))),
    }
}

fn in_range(
    body: &Map<String, Value>,
    key: &str,
    range: std::ops::RangeInclusive<f64>,
) -> Result<Option<f32>, ApiError> {
    match number(body, key)? {
        Some(v) if !range.contains(&v) => Err(ApiError::invalid(
            key,
            format!(
                "'{key}' must be between {} and {}, got {v}",
                range.start(),
                range.end()
            ),
        )),
        v => Ok(v.map(|v| v as f32)),
    }
}

fn unsigned(body: &Map<String, Value>, key: &str) -> Result<Option<u64>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            ApiError::invalid(key, format!("'{key}' must be a non-negative integer"))
        }),
    }
}

fn flag(body: &Map<String, Value>, key: &str) -> Result<bool, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid(key, format!("'{key}' must be a boolean"))),
    }
}

fn present(body: &Map<String, Value>, key: &str) -> bool {
    body.get(key).is_some_and(|v| !v.is_null())
}

/// A chat message's text: a string, or an array of text parts.
fn content_text(i: usize, content: Option<&Value>) -> Result<String, ApiError> {
    let param = format!("messages[{i}].content");
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(
                |p| match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => Ok(t.as_str()),
                    (Some(other), _) if other != "text" => Err(ApiError::unsupported(
                        &param,
                        &format!("content parts of type '{other}' (only text)"),
                    )),
                    _ => Err(ApiError::invalid(
                        &param,
                        "a content part must be {\"type\": \"text\", \"text\": ...}",
                    )),
                },
            )
            .collect(),
        Some(Value::Null) | None => Err(ApiError::invalid(&param, "content is required")),
        Some(_) => Err(ApiError::invalid(
            &param,
            "content must be a string or an array of text parts",
        )),
    }
}

fn messages(body: &Map<String, Value>) -> Result<Vec<pb::ChatMessage>, ApiError> {
    let Some(Value::Array(list)) = body.get("messages") else {
        return Err(ApiError::invalid(
            "messages",
            "'messages' must be a non-empty array",
        ));
    };
    if list.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "'messages' must be a non-empty array",
        ));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let Value::Object(m) = m else {
                return Err(ApiError::invalid(
                    &format!("messages[{i}]"),
                    "a message must be an object with 'role' and 'content'",
                ));
            };
            let role = match m.get("role").and_then(Value::as_str) {
                Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
                // OpenAI's newer name for the system role.
                Some("developer") => "system",
                Some(other) => {
                    return Err(ApiError::invalid(
                        &format!("messages[{i}].role"),
                        format!(
                            "role '{other}' is not supported (system, developer, user, \
                             assistant, tool)"
                        ),
                    ));
                }
                None => {
                    return Err(ApiError::invalid(
                        &format!("messages[{i}].role"),
                        "role is required",
                    ));
                }
            };
            let own: &[&str] = match role {
                "assistant" => &["tool_calls"],
                "tool" => &["tool_call_id"],
                _ => &[],
            };
            if let Some(k) = m
                .iter()
                .find(|(k, v)| {
                    !matches!(k.as_str(), "role" | "content" | "name")
                        && !own.contains(&k.as_str())
                        && !v.is_null()
                })
                .map(|(k, _)| k)
            {
                return Err(ApiError::unsupported(
                    &format!("messages[{i}].{k}"),
                    "not taken on a message of this role",
                ));
            }
            let tool_calls = tool_calls(i, m.get("tool_calls"))?;
            // An assistant turn that only calls tools has no content.
            let content = match m.get("content") {
                None | Some(Value::Null) if !tool_calls.is_empty() => String::new(),
                c => content_text(i, c)?,
            };
            let tool_call_id = match m.get("tool_call_id") {
                Some(Value::String(id)) => id.clone(),
                None | Some(Value::Null) if role == "tool" => {
                    return Err(ApiError::invalid(
                        &format!("messages[{i}].tool_call_id"),
                        "a tool message needs the tool_call_id it answers",
                    ));
                }
                None | Some(Value::Null) => String::new(),
                Some(_) => {
                    return Err(ApiError::invalid(
                        &format!("messages[{i}].tool_call_id"),
                        "'tool_call_id' must be a string",
                    ));
                }
            };
            Ok(pb::ChatMessage {
                role: role.into(),
                content,
                tool_calls,
                tool_call_id,
            })
        })
        .collect()
}

/// An assistant message's `tool_calls`: `{"id", "type": "function", "function": {"name",
/// "arguments"}}`, the arguments a JSON string (checked to be an object where the chat is
/// rendered).
fn tool_calls(i: usize, calls: Option<&Value>) -> Result<Vec<pb::ToolCall>, ApiError> {
    let param = format!("messages[{i}].tool_calls");
    let calls = match calls {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(calls)) => calls,
        Some(_) => return Err(ApiError::invalid(&param, "'tool_calls' must be an array")),
    };
    calls
        .iter()
        .enumerate()
        .map(|(j, c)| {
            let param = format!("{param}[{j}]");
            let bad = || {
                ApiError::invalid(
                    &param,
                    "a tool call is {\"id\", \"type\": \"function\", \"function\": \
                     {\"name\", \"arguments\"}} with string values",
                )
            };
            if c.get("type").is_some_and(|t| t != "function") {
                return Err(bad());
            }
            let f = c.get("function").ok_or_else(bad)?;
            let text = |v: Option<&Value>| v.and_then(Value::as_str).map(str::to_string);
            Ok(pb::ToolCall {
                id: text(c.get("id")).unwrap_or_default(),
                name: text(f.get("name")).ok_or_else(bad)?,
                arguments: text(f.get("arguments")).ok_or_else(bad)?,
            })
        })
        .collect()
}

/// `tools`: function definitions, `{"type": "function", "function": {"name", "description",
/// "parameters"}}`.
fn tools(body: &Map<String, Value>, forced: bool) -> Result<Vec<pb::Tool>, ApiError> {
    let list = match body.get("tools") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(ApiError::invalid("tools", "'tools' must be an array")),
    };
    list.iter()
        .enumerate()
        .map(|(i, t)| {
            let param = format!("tools[{i}]");
            if t.get("type") != Some(&json!("function")) {
                return Err(ApiError::unsupported(
                    &format!("{param}.type"),
                    "only function tools are served",
                ));
            }
            let Some(Value::Object(f)) = t.get("function") else {
                return Err(ApiError::invalid(
                    &format!("{param}.function"),
                    "a tool needs a 'function' object",
                ));
            };
            if let Some(k) = f
                .iter()
                .find(|(k, v)| {
                    !matches!(k.as_str(), "name" | "description" | "parameters" | "strict")
                        && !v.is_null()
                })
                .map(|(k, _)| k)
            {
                return Err(ApiError::unsupported(
                    &format!("{param}.function.{k}"),
                    "not a function definition's key",
                ));
            }
            if flag(f, "strict")? && !forced {
                return Err(ApiError::unsupported(
                    &format!("{param}.function.strict"),
                    "arguments follow the schema only in a forced call (tool_choice \"required\" \
                     or a named function)",
                ));
            }
            let name = match f.get("name") {
                Some(Value::String(n)) if crate::dispatch::chat::valid_function_name(n) => {
                    n.clone()
                }
                _ => {
                    return Err(ApiError::invalid(
                        &format!("{param}.function.name"),
                        "the name must be 1 to 64 of a-z, A-Z, 0-9, _ and -",
                    ));
                }
            };
            let description = match f.get("description") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(d)) => d.clone(),
                Some(_) => {
                    return Err(ApiError::invalid(
                        &format!("{param}.function.description"),
                        "'description' must be a string",
                    ));
                }
            };
            let parameters = match f.get("parameters") {
                None | Some(Value::Null) => String::new(),
                Some(p @ Value::Object(_)) => p.to_string(),
                Some(_) => {
                    return Err(ApiError::invalid(
                        &format!("{param}.function.parameters"),
                        "'parameters' must be a JSON schema object",
                    ));
                }
            };
            Ok(pb::Tool {
                name,
                description,
                parameters,
            })
        })
        .collect()
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"` or `{"type": "function", "function":
/// {"name"}}`; with the function's name for the last.
fn tool_choice(body: &Map<String, Value>) -> Result<(pb::ToolChoice, String), ApiError> {
    let bad = || {
        ApiError::invalid(
            "tool_choice",
            "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \
             \"function\", \"function\": {\"name\": ...}}",
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
        Some(c) if c.get("type") == Some(&json!("function")) => {
            let name = c
                .pointer("/function/name")
                .and_then(Value::as_str)
                .ok_or_else(bad)?;
            (pb::ToolChoice::Function, name.to_string())
        }
        Some(_) => return Err(bad()),
    })
}

fn stop(body: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    let stops = match body.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| {
                s.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| ApiError::invalid("stop", "'stop' must hold strings"))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "'stop' must be a string or an array of strings",
            ));
        }
    };
    if stops.len() > MAX_STOP {
        return Err(ApiError::invalid(
            "stop",
            format!("at most {MAX_STOP} stop sequences"),
        ));
    }
    Ok(stops)
}

/// A header's value, if present and readable.
/// `logit_bias`: token ids (as JSON object keys) to biases in [-100, 100]; the bounds on how
/// many and which ids are the router's, for both APIs.
fn logit_bias(body: &Map<String, Value>) -> Result<HashMap<u32, f32>, ApiError> {
    let Some(v) = body.get("logit_bias").filter(|v| !v.is_null()) else {
        return Ok(HashMap::new());
    };
    let Some(o) = v.as_object() else {
        return Err(ApiError::invalid(
            "logit_bias",
            "'logit_bias' must be an object of token ids to numbers",
        ));
    };
    o.iter()
        .map(|(k, v)| {
            let id = k
                .parse::<u32>()
                .map_err(|_| ApiError::invalid("logit_bias", format!("'{k}' is not a token id")))?;
            match v.as_f64() {
                Some(b) if (-100.0..=100.0).contains(&b) => Ok((id, b as f32)),
                _ => Err(ApiError::invalid(
                    "logit_bias",
                    format!("logit_bias['{k}'] must be a number from -100 to 100"),
                )),
            }
        })
        .collect()
}

/// An array of token ids.
fn token_ids(body: &Map<String, Value>, key: &str) -> Result<Vec<u32>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| {
                        ApiError::invalid(key, format!("'{key}' must be an array of token ids"))
                    })
            })
            .collect(),
        Some(_) => Err(ApiError::invalid(
            key,
            format!("'{key}' must be an array of token ids"),
        )),
    }
}

/// `response_format`: `{"type": "text"}` (free text), `{"type": "json_object"}` or
/// `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`.
fn response_format(body: &Map<String, Value>) -> Result<Option<pb::Grammar>, ApiError> {
    use pb::grammar::Kind;
    let Some(format) = body.get("response_format").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let kind = match format.get("type").and_then(Value::as_str) {
        Some("text") => return Ok(None),
        Some("json_object") => Kind::JsonObject(true),
        Some("json_schema") => match format.pointer("/json_schema/schema") {
            Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
                Kind::JsonSchema(schema.to_string())
            }
            _ => {
                return Err(ApiError::invalid(
                    "response_format.json_schema.schema",
                    "a json_schema response format needs its 'schema' object",
                ));
            }
        },
        _ => {
            return Err(ApiError::invalid(
                "response_format",
                "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or \
                 {\"type\": \"json_schema\", \"json_schema\": {...}}",
            ));
        }
    };
    Ok(Some(pb::Grammar { kind: Some(kind) }))
}

/// How many alternatives' log-probabilities a request asks for, if any: chat's `logprobs`
/// (a boolean) and `top_logprobs`; completions' `logprobs` (a count).
fn logprobs(kind: Kind, body: &Map<String, Value>) -> Result<Option<u32>, ApiError> {
    let most = u64::from(tandem_proto::MAX_TOP_LOGPROBS);
    let count = |key: &str| match unsigned(body, key)? {
        Some(n) if n > most => Err(ApiError::invalid(
            key,
            format!("'{key}' must be between 0 and {most}"),
        )),
        n => Ok(n.map(|n| n as u32)),
    };
    match kind {
        Kind::Chat => {
            let top = count("top_logprobs")?;
            match (flag(body, "logprobs")?, top) {
                (true, top) => Ok(Some(top.unwrap_or(0))),
                (false, None) => Ok(None),
                (false, Some(_)) => Err(ApiError::invalid(
                    "top_logprobs",
                    "'top_logprobs' needs 'logprobs': true",
                )),
            }
        }
        Kind::Completion => match body.get("logprobs") {
            None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(None),
            _ => count("logprobs"),
        },
    }
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

pub(crate) fn parse(
    kind: Kind,
    model: &str,
    headers: &HeaderMap,
    body: &[u8],
    defaults: &SamplingDefaults,
) -> Result<Parsed, ApiError> {
    let body: Map<String, Value> = serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("the body is not a JSON object: {e}"),
            "invalid_request_error",
        )
    })?;
    let own = match kind {
        Kind::Chat => CHAT_KEYS,
        Kind::Completion => COMPLETION_KEYS,
    };
    if let Some(key) = body
        .iter()
        .find(|(k, v)| {
            !v.is_null() && !COMMON_KEYS.contains(&k.as_str()) && !own.contains(&k.as_str())
        })
        .map(|(k, _)| k)
    {
        return Err(ApiError::unsupported(key, "Tandem does not implement it"));
    }
    // The upper bound is the router's (`prepare`), the same on both APIs.
    let n = match unsigned(&body, "n")? {
        None => 1,
        Some(0) => return Err(ApiError::invalid("n", "'n' must be at least 1")),
        Some(n) => u32::try_from(n).unwrap_or(u32::MAX),
    };
    // Parameters that are accepted only at the value that means "off".
    if unsigned(&body, "best_of")?.is_some_and(|n| n != 1) {
        return Err(ApiError::unsupported("best_of", "only best_of=1 is served"));
    }
    let logprobs = logprobs(kind, &body)?;
    if flag(&body, "store")? {
        return Err(ApiError::unsupported(
            "store",
            "completions are not stored (store: false is served)",
        ));
    }
    check_metadata(&body)?;
    let parallel_tool_calls = match body.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        _ => flag(&body, "parallel_tool_calls")?,
    };
    match body.get("service_tier") {
        None | Some(Value::Null) => {}
        Some(Value::String(t)) if t == "auto" || t == "default" => {}
        Some(_) => {
            return Err(ApiError::unsupported(
                "service_tier",
                "one tier is served (\"auto\" or \"default\")",
            ));
        }
    }
    if flag(&body, "echo")? {
        return Err(ApiError::unsupported("echo", "the prompt is not echoed"));
    }
    if present(&body, "suffix") {
        return Err(ApiError::unsupported(
            "suffix",
            "there is no insertion mode",
        ));
    }
    let grammar = response_format(&body)?;
    match body.get("model") {
        Some(Value::String(m)) if m == model => {}
        Some(Value::String(m)) => {
            return Err(ApiError {
                code: Some("model_not_found"),
                param: Some("model".into()),
                ..ApiError::new(
                    StatusCode::NOT_FOUND,
                    format!("the model '{m}' does not exist; this server has '{model}'"),
                    "invalid_request_error",
                )
            });
        }
        _ => return Err(ApiError::invalid("model", "'model' must be a string")),
    }
    let stream = flag(&body, "stream")?;
    let stream_usage = match body.get("stream_options") {
        None | Some(Value::Null) => StreamUsage::None,
        Some(Value::Object(o)) => {
            if let Some(k) = o
                .keys()
                .find(|k| *k != "include_usage" && *k != "continuous_usage_stats")
            {
                return Err(ApiError::unsupported(
                    &format!("stream_options.{k}"),
                    "only include_usage and continuous_usage_stats are served",
                ));
            }
            if !stream {
                return Err(ApiError::invalid(
                    "stream_options",
                    "stream_options is only allowed with stream: true",
                ));
            }
            // vLLM's extension: the usage so far on every chunk, with include_usage only.
            match (
                flag(o, "include_usage")?,
                flag(o, "continuous_usage_stats")?,
            ) {
                (false, _) => StreamUsage::None,
                (true, false) => StreamUsage::Last,
                (true, true) => StreamUsage::Continuous,
            }
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "stream_options",
                "'stream_options' must be an object",
            ));
        }
    };
    let max_tokens = match (
        unsigned(&body, "max_completion_tokens")?,
        unsigned(&body, "max_tokens")?,
    ) {
        (Some(m), _) | (None, Some(m)) => {
            if m == 0 {
                return Err(ApiError::invalid(
                    "max_tokens",
                    "'max_tokens' must be at least 1",
                ));
            }
            u32::try_from(m).unwrap_or(u32::MAX)
        }
        // 0: the router's default (see DEFAULT_MAX_TOKENS).
        (None, None) => 0,
    };
    let seed = match body.get("seed") {
        None | Some(Value::Null) => 0,
        // OpenAI's seed is any integer; a negative one keeps its bits.
        Some(v) => v
            .as_i64()
            .map(|s| s as u64)
            .or_else(|| v.as_u64())
            .ok_or_else(|| ApiError::invalid("seed", "'seed' must be an integer"))?,
    };
    let string = |key: &str| match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(u)) => Ok(Some(u.clone())),
        Some(_) => Err(ApiError::invalid(key, format!("'{key}' must be a string"))),
    };
    let user = string("user")?;
    let cache_salt = string("cache_salt")?.unwrap_or_default();
    let sampling = pb::SamplingParams {
        // Unset: the server's default, else OpenAI's (temperature and top_p 1).
        temperature: in_range(&body, "temperature", 0.0..=2.0)?
            .or(defaults.temperature)
            .unwrap_or(1.0),
        top_k: unsigned(&body, "top_k")?
            .map(|k| u32::try_from(k).unwrap_or(u32::MAX))
            .or(defaults.top_k)
            .unwrap_or(0),
        top_p: match in_range(&body, "top_p", 0.0..=1.0)? {
            Some(0.0) => {
                return Err(ApiError::invalid("top_p", "'top_p' must be above 0"));
            }
            p => Some(p.or(defaults.top_p).unwrap_or(1.0)),
        },
        seed,
        max_tokens,
        stop: stop(&body)?,
        frequency_penalty: in_range(&body, "frequency_penalty", -2.0..=2.0)?,
        presence_penalty: in_range(&body, "presence_penalty", -2.0..=2.0)?,
        repetition_penalty: number(&body, "repetition_penalty")?.map(|r| r as f32),
        min_p: in_range(&body, "min_p", 0.0..=1.0)?.or(defaults.min_p),
        logit_bias: logit_bias(&body)?,
        ignore_eos: flag(&body, "ignore_eos")?,
        min_tokens: unsigned(&body, "min_tokens")?
            .map_or(0, |m| u32::try_from(m).unwrap_or(u32::MAX)),
        stop_token_ids: token_ids(&body, "stop_token_ids")?,
        logprobs,
        grammar,
    };
    let mut request = pb::GenerateRequest {
        request_id: header_str(headers, "x-request-id")
            .unwrap_or_default()
            .to_string(),
        session_id: header_str(headers, "x-session-id")
            .map(str::to_string)
            .or(user)
            .unwrap_or_default(),
        sampling: Some(sampling),
        cache_salt,
        n,
        ..Default::default()
    };
    match kind {
        Kind::Chat => {
            request.messages = messages(&body)?;
            let (choice, function) = tool_choice(&body)?;
            let forced = matches!(choice, pb::ToolChoice::Required | pb::ToolChoice::Function);
            request.tools = tools(&body, forced)?;
            request.tool_choice = choice as i32;
            request.tool_choice_function = function;
        }
        Kind::Completion => match body.get("prompt") {
            Some(Value::String(p)) => request.prompt = Some(p.clone()),
            Some(Value::Array(a)) if a.iter().all(Value::is_u64) && !a.is_empty() => {
                request.token_ids = a
                    .iter()
                    .filter_map(Value::as_u64)
                    .map(|t| u32::try_from(t).unwrap_or(u32::MAX))
                    .collect();
            }
            Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                request.prompt = a[0].as_str().map(str::to_string);
            }
            Some(Value::Array(_)) => {
                return Err(ApiError::unsupported(
                    "prompt",
                    "one prompt per request (a string, a one-string array, or token ids)",
                ));
            }
            _ => {
                return Err(ApiError::invalid(
                    "prompt",
                    "'prompt' must be a string or an array of token ids",
                ));
            }
        },
    }
    let timeout = match header_str(headers, "x-timeout-ms") {
        None => None,
        Some(ms) => Some(Duration::from_millis(ms.parse().map_err(|_| {
            ApiError::invalid("x-timeout-ms", "the x-timeout-ms header must be an integer")
        })?)),
    };
    Ok(Parsed {
        request,
        stream,
        stream_usage,
        timeout,
        parallel_tool_calls,
    })
}

#[cfg(test)]
mod tests {
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
        let r = &parsed.request;
        assert!(!parsed.parallel_tool_calls);
        assert_eq!(r.tool_choice, pb::ToolChoice::Function as i32);
        assert_eq!(r.tool_choice_function, "get_weather");
        assert_eq!(
            r.tools,
            vec![pb::Tool {
                name: "get_weather".into(),
                description: "d".into(),
                parameters: r#"{"type":"object"}"#.into(),
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
        assert_eq!(parsed.request.n, 3);
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
        let e = parse_json(Kind::Chat, json!({"model": "other", "messages": []})).expect_err("404");
        assert_eq!(e.status, StatusCode::NOT_FOUND);
        let p = chat(
            json!({"max_completion_tokens": 7, "max_tokens": 9, "seed": -1, "stop": "x",
                            "stream": true, "stream_options": {"include_usage": true},
                            "user": "u1", "temperature": 0, "repetition_penalty": 1.2,
                            "store": false, "metadata": {"team": "search"},
                            "service_tier": "auto", "parallel_tool_calls": true}),
        )
        .expect("valid");
        let s = p.request.sampling.expect("sampling");
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
        assert_eq!(p.request.session_id, "u1");
        let knobs = chat(
            json!({"min_p": 0.05, "top_k": 40, "logit_bias": {"17": -100, "3": 2.5},
                                "ignore_eos": true, "min_tokens": 4, "stop_token_ids": [7, 8]}),
        )
        .expect("valid")
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
}
