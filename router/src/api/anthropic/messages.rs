//! A Messages request's conversation: `system`, and `messages` with their content blocks, as
//! `tandem.v1` chat messages (see [`crate::api::anthropic::request`] for what is accepted).

use serde_json::{Map, Value};
use tandem_proto::v1 as pb;

use crate::api::http::error::ApiError;
use crate::api::http::{string, unknown_key};

/// A block's `type`.
pub(super) fn block_type(block: &Value) -> Option<&str> {
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
pub(super) fn system(body: &Map<String, Value>) -> Result<Vec<pb::ChatMessage>, ApiError> {
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
pub(super) fn conversation(body: &Map<String, Value>) -> Result<Vec<pb::ChatMessage>, ApiError> {
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

/// An `output_config` (`param`) in `object`, if any, checked to hold only the `known` keys and
/// a valid `effort` (the top level's `format` is read by [`output_config`]).
pub(super) fn check_effort(
    object: &Map<String, Value>,
    param: &str,
    known: &[&str],
) -> Result<(), ApiError> {
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
