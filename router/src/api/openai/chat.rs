//! A chat request's structured parts: messages with their content and tool calls, the tools
//! offered, the tool choice, and the response format (a grammar for constrained decoding).

use serde_json::{Map, Value, json};
use tandem_proto::v1 as pb;

use crate::api::http::error::ApiError;
use crate::api::http::fields::{flag, function_tool, json_grammar, tool_list};
use crate::api::http::only_keys;

/// A chat message's text: a string, or an array of text parts.
pub(super) fn content_text(i: usize, content: Option<&Value>) -> Result<String, ApiError> {
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

pub(super) fn messages(body: &Map<String, Value>) -> Result<Vec<pb::ChatMessage>, ApiError> {
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
pub(super) fn tool_calls(i: usize, calls: Option<&Value>) -> Result<Vec<pb::ToolCall>, ApiError> {
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
pub(super) fn tools(body: &Map<String, Value>, forced: bool) -> Result<Vec<pb::Tool>, ApiError> {
    tool_list(body, |param, t| {
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
        let param = format!("{param}.function");
        let known = ["name", "description", "parameters", "strict"];
        only_keys(f, &param, &known, "function definition")?;
        if flag(f, "strict")? && !forced {
            return Err(ApiError::unsupported(
                &format!("{param}.strict"),
                "arguments follow the schema only in a forced call (tool_choice \"required\" \
                 or a named function)",
            ));
        }
        function_tool(&param, f, "parameters", false).map(Some)
    })
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"` or `{"type": "function", "function":
/// {"name"}}`; with the function's name for the last.
pub(super) fn tool_choice(body: &Map<String, Value>) -> Result<(pb::ToolChoice, String), ApiError> {
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

/// `response_format`: `{"type": "text"}` (free text), `{"type": "json_object"}` or
/// `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`.
pub(super) fn response_format(body: &Map<String, Value>) -> Result<Option<pb::Grammar>, ApiError> {
    let Some(format) = body.get("response_format").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    json_grammar(
        "response_format",
        "response_format.json_schema.schema",
        format.get("type").and_then(Value::as_str),
        format.pointer("/json_schema/schema"),
    )
}
