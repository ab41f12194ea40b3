//! Chat messages, tool definitions and the rendering of a model's chat template.
//!
//! Templates are the file's own `tokenizer.chat_template`, written for Hugging Face's
//! `apply_chat_template`, so they render the way it does: Jinja with `trim_blocks` and
//! `lstrip_blocks`, `raise_exception`, and a `tojson` that is Python's `json.dumps` with
//! `ensure_ascii=False` (key order kept, `", "` and `": "` as separators, no HTML escaping).
//! minijinja's own `tojson` sorts keys, writes compact JSON and escapes `<`, `>`, `&` and `'`,
//! so a tool definition would not render as the model was trained on it.

use std::io;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind, context};
use serde::{Deserialize, Serialize};

use crate::{Error, Result, ToolFormat};

/// One chat message, as given to the chat template. An assistant message may carry the tool
/// calls it made; a `tool` message carries a call's result.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// The text; empty for an assistant message that only calls tools.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub content: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// On a `tool` message, the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message of plain text.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            ..Self::default()
        }
    }

    /// An assistant turn that calls function `name` with `arguments`, as call `id`.
    pub fn tool_call(
        id: impl Into<String>,
        name: impl Into<String>,
        arguments: serde_json::Value,
    ) -> Self {
        Self {
            role: "assistant".into(),
            tool_calls: vec![ToolCall {
                id: Some(id.into()),
                kind: function_type(),
                function: FunctionCall {
                    name: name.into(),
                    arguments,
                },
            }],
            ..Self::default()
        }
    }

    /// A tool's result, `content`, for call `id`.
    pub fn tool_result(id: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            tool_call_id: Some(id.into()),
            ..Self::new("tool", content)
        }
    }
}

/// A tool call made by the assistant, in OpenAI's shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: FunctionCall,
}

/// The function a [`ToolCall`] names, with its arguments as a JSON object (templates render
/// them with `tojson`; OpenAI's wire form, a JSON string, is parsed before it gets here).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: serde_json::Value,
}

fn function_type() -> String {
    "function".into()
}

fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

/// The roles chat templates are written for; any other would be rendered as whatever the
/// template makes of it.
const ROLES: &[&str] = &["system", "user", "assistant", "tool"];

/// A chat template, compiled once.
#[derive(Debug)]
pub(crate) struct Template {
    env: Environment<'static>,
}

const NAME: &str = "chat";

impl Template {
    /// The template compiled, or the compiler's complaint.
    pub(crate) fn new(source: String) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // Templates are written for Python's Jinja: `content.startswith(...)`,
        // `content.split(...)`, `text.strip()` and the like (Qwen3's, Llama 3.1's).
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, _> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source)
            .map_err(|e| e.to_string())?;
        Ok(Self { env })
    }

    /// Renders `messages` (and the `tools` offered, each an OpenAI tool definition) with a
    /// generation prompt.
    pub(crate) fn render(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        (bos_token, eos_token): (&str, &str),
        enable_thinking: Option<bool>,
    ) -> Result<String> {
        if messages.is_empty() {
            return Err(Error::InvalidArgument {
                field: "messages",
                reason: "at least one message is required".into(),
            });
        }
        if let Some((i, m)) = messages
            .iter()
            .enumerate()
            .find(|(_, m)| !ROLES.contains(&m.role.as_str()))
        {
            return Err(Error::InvalidArgument {
                field: "messages",
                reason: format!(
                    "message {i} has role {:?}; roles are system, user, assistant and tool",
                    m.role.chars().take(32).collect::<String>()
                ),
            });
        }
        // A template tests `tools` for truth: none offered is `None`, as Hugging Face passes it.
        let tools = (!tools.is_empty()).then_some(tools);
        self.env
            .get_template(NAME)
            .and_then(|t| {
                t.render(context! {
                    messages => messages,
                    tools => tools,
                    add_generation_prompt => true,
                    bos_token => bos_token,
                    eos_token => eos_token,
                    // Unset stays undefined: a template tests `enable_thinking is defined`.
                    enable_thinking => enable_thinking.map_or(Value::UNDEFINED, Value::from),
                })
            })
            .map_err(template_error)
    }
}

/// The chat template's side of the tokenizer.
impl crate::Tokenizer {
    /// How the chat template writes tool calls; `None` if it takes no tools (or there is no
    /// template).
    pub fn tool_format(&self) -> Option<ToolFormat> {
        self.header
            .chat_template
            .as_deref()
            .and_then(ToolFormat::of_template)
    }

    /// Whether the chat template writes a `<think>` block (Qwen3's): its replies open with their
    /// reasoning ([`ReasoningParser`]), and `enable_thinking` switches it.
    pub fn thinks(&self) -> bool {
        (self.header.chat_template.as_deref()).is_some_and(|t| t.contains("<think>"))
    }

    /// [`Tokenizer::apply_chat_template`] with the template's `enable_thinking` set (Qwen3's
    /// switch; `None` leaves the template's default), as Hugging Face's template kwargs set it.
    pub fn apply_chat_template_thinking(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        enable_thinking: Option<bool>,
    ) -> Result<String> {
        let template = self.template.as_ref().map_err(|reason| Error::Template {
            reason: reason.clone(),
        })?;
        let text = |id: Option<u32>| id.map_or("", |id| self.token_text(id));
        template.render(
            messages,
            tools,
            (text(self.header.bos_id), text(self.header.eos_id)),
            enable_thinking,
        )
    }

    /// Renders `messages`, and the `tools` offered (OpenAI tool definitions; none is `&[]`),
    /// with the model's chat template and a generation prompt.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
    ) -> Result<String> {
        self.apply_chat_template_thinking(messages, tools, None)
    }
}

fn template_error(e: minijinja::Error) -> Error {
    Error::Template {
        reason: e.to_string(),
    }
}

/// Jinja's `tojson` as Hugging Face defines it for chat templates: `json.dumps(value,
/// ensure_ascii=False, indent=indent)`.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let mut ser = serde_json::Serializer::with_formatter(
                &mut out,
                serde_json::ser::PrettyFormatter::with_indent(&pad),
            );
            value.serialize(&mut ser)
        }
        None => value.serialize(&mut serde_json::Serializer::with_formatter(
            &mut out,
            PythonCompact,
        )),
    };
    written.map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    // serde_json writes UTF-8 only.
    String::from_utf8(out)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))
}

/// `json.dumps`'s separators without an indent: `", "` between items, `": "` after a key.
struct PythonCompact;

impl serde_json::ser::Formatter for PythonCompact {
    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(
        template: &str,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String> {
        Template::new(template.into())
            .map_err(|reason| Error::Template { reason })?
            .render(messages, tools, (bos_token, eos_token), None)
    }

    fn render_json(template: &str, value: serde_json::Value) -> String {
        let mut env = Environment::new();
        env.add_filter("tojson", tojson);
        env.render_str(template, context! { v => value })
            .expect("render")
    }

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let v =
            serde_json::json!({"z": 1, "a": [1, 2.5, "x<y>&'é\n"], "m": {}, "n": null, "t": true});
        // Key order kept, spaced separators, no HTML escaping, non-ASCII kept.
        assert_eq!(
            render_json("{{ v | tojson }}", v.clone()),
            r#"{"z": 1, "a": [1, 2.5, "x<y>&'é\n"], "m": {}, "n": null, "t": true}"#
        );
        assert_eq!(
            render_json(
                "{{ v | tojson(indent=2) }}",
                serde_json::json!({"a": [1], "b": {}})
            ),
            "{\n  \"a\": [\n    1\n  ],\n  \"b\": {}\n}"
        );
    }

    #[test]
    fn tool_calls_and_results_reach_the_template() {
        let template = "{% for m in messages %}{{ m.role }}:{{ m.content }}\
            {% for c in m.tool_calls %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}\
            {% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %};{% endfor %}\
            {% if tools %}{{ tools | length }} tools{% endif %}";
        let call = ChatMessage::tool_call(
            "call_1",
            "get_weather",
            serde_json::json!({"city": "Paris"}),
        );
        let result = ChatMessage::tool_result("call_1", "18 C");
        let messages = [ChatMessage::new("user", "Weather?"), call, result];
        assert_eq!(
            render(template, &messages, &[], "", "").expect("render"),
            r#"user:Weather?;assistant:[get_weather {"city": "Paris"}];tool:18 C(call_1);"#
        );
        let tool = serde_json::json!({"type": "function", "function": {"name": "f"}});
        assert!(
            render(template, &messages, &[tool], "", "")
                .expect("render")
                .ends_with("1 tools")
        );
    }

    #[test]
    fn unknown_roles_and_empty_conversations_are_refused() {
        for messages in [vec![], vec![ChatMessage::new("robot", "x")]] {
            assert!(matches!(
                render("{{ messages }}", &messages, &[], "", ""),
                Err(Error::InvalidArgument {
                    field: "messages",
                    ..
                })
            ));
        }
    }

    #[test]
    fn a_null_content_reads_as_empty() {
        let m: ChatMessage =
            serde_json::from_value(serde_json::json!({"role": "assistant", "content": null}))
                .expect("parse");
        assert_eq!(m, ChatMessage::new("assistant", ""));
    }
}
