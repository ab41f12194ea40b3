//! A chat request's messages, tools and tool choice, checked and rendered into the prompt text
//! through the model's chat template.

use serde_json::{Value, json};
use tandem_proto::v1 as pb;
use tandem_proto::v1::grammar::Kind;
use tandem_tokenizer::{
    Arguments, CallGrammar, ChatMessage, FunctionCall, Tokenizer, ToolCall, ToolFormat,
};

use crate::error::{Error, Result, invalid};

/// Most tools a request may offer.
pub const MAX_TOOLS: usize = 128;

/// The bytes of a chat request's text: messages, their calls and the tools offered (bounded
/// by the router's prompt limit before anything is parsed or rendered).
pub fn text_bytes(r: &pb::GenerateRequest) -> usize {
    let calls = |m: &pb::ChatMessage| -> usize {
        m.tool_calls
            .iter()
            .map(|c| c.id.len() + c.name.len() + c.arguments.len())
            .sum()
    };
    let messages: usize = r
        .messages
        .iter()
        .map(|m| m.role.len() + m.content.len() + m.tool_call_id.len() + calls(m))
        .sum();
    let tools: usize = r
        .tools
        .iter()
        .map(|t| t.name.len() + t.description.len() + t.parameters.len())
        .sum();
    messages + tools
}

/// A function name as OpenAI allows it: 1 to 64 of a-z, A-Z, 0-9, `_` and `-`.
pub fn valid_function_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A tool's name on the wire: a function name, or one qualified by a namespace that is one too
/// (`namespace.name`: the Responses API's namespace tools, as the model is offered them).
pub fn valid_tool_name(name: &str) -> bool {
    match name.split_once('.') {
        Some((namespace, name)) => valid_function_name(namespace) && valid_function_name(name),
        None => valid_function_name(name),
    }
}

/// The rule [`valid_tool_name`] checks, in the words of an error.
const NAME_RULE: &str = "1 to 64 of a-z, A-Z, 0-9, _ and -, optionally after a namespace of the \
                         same and a dot";

/// A chat request rendered: the prompt text, and the grammar its tool choice holds the reply to:
/// a forced call's (Lark), or, where the model decides, the hold on a call it starts
/// (`ToolCalls`).
#[derive(Debug)]
pub struct Rendered {
    pub text: String,
    pub tool_grammar: Option<pb::Grammar>,
}

/// Renders the request's messages, and the tools its choice offers, with the model's template;
/// a call that the choice forces begins the reply, at the end of the text, and is held by a
/// grammar of the tools' names and arguments. Where the model decides, a call it starts is held
/// the same way.
pub fn render(tokenizer: &Tokenizer, r: &pb::GenerateRequest) -> Result<Rendered> {
    let messages = r
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| message(i, m))
        .collect::<Result<Vec<_>>>()?;
    let choice = pb::ToolChoice::try_from(r.tool_choice).or_else(|_| {
        invalid(
            "tool_choice",
            format!("{} is not a ToolChoice", r.tool_choice),
        )
    })?;
    let free = |messages: &[ChatMessage]| -> Result<Rendered> {
        Ok(Rendered {
            text: tokenizer.apply_chat_template_thinking(messages, &[], r.enable_thinking)?,
            tool_grammar: None,
        })
    };
    if r.tools.is_empty() {
        if !matches!(choice, pb::ToolChoice::Auto | pb::ToolChoice::None) {
            return invalid("tool_choice", "a call is forced, but no tools are given");
        }
        return free(&messages);
    }
    let Some(format) = tokenizer.tool_format() else {
        return invalid("tools", "the model's chat template takes no tools");
    };
    if r.tools.len() > MAX_TOOLS {
        return invalid("tools", format!("at most {MAX_TOOLS} tools"));
    }
    let tools = r.tools.iter().map(tool).collect::<Result<Vec<_>>>()?;
    let function = &r.tool_choice_function;
    if choice == pb::ToolChoice::Function && !r.tools.iter().any(|t| &t.name == function) {
        return invalid(
            "tool_choice_function",
            format!(
                "'{}' is not one of the tools given",
                function.chars().take(64).collect::<String>()
            ),
        );
    }
    let Some(forced) = reply_start(format, choice, function) else {
        return free(&messages);
    };
    let text =
        tokenizer.apply_chat_template_thinking(&messages, &tools, r.enable_thinking)? + &forced;
    let grammars: Vec<CallGrammar<'_>> = r
        .tools
        .iter()
        .map(|t| CallGrammar {
            name: &t.name,
            arguments: match (t.input_grammar.as_str(), t.parameters.as_str()) {
                ("", "") => Arguments::Schema(None),
                ("", schema) => Arguments::Schema(Some(schema)),
                (lark, _) => Arguments::Input(lark),
            },
        })
        .collect();
    let unheld = |e: String| Error::InvalidArgument {
        field: "tools",
        reason: format!("a custom tool's grammar cannot be held ({e})"),
    };
    let kind = match choice {
        pb::ToolChoice::Required => {
            Kind::Lark(format.call_grammar(&grammars, None).map_err(unheld)?)
        }
        pb::ToolChoice::Function => Kind::Lark(
            format
                .call_grammar(&grammars, Some(function))
                .map_err(unheld)?,
        ),
        pb::ToolChoice::Auto | pb::ToolChoice::None => {
            Kind::ToolCalls(format.held_grammar(&grammars).map_err(unheld)?)
        }
    };
    Ok(Rendered {
        text,
        tool_grammar: Some(pb::Grammar { kind: Some(kind) }),
    })
}

/// What a tool choice makes of the tools offered: `None` when they are not offered (`none`),
/// else the start of the reply that it forces (empty when the model decides). The prompt ends
/// with it, and the HTTP API's parser starts from it.
pub fn reply_start(format: ToolFormat, choice: pb::ToolChoice, function: &str) -> Option<String> {
    match choice {
        pb::ToolChoice::None => None,
        pb::ToolChoice::Auto => Some(String::new()),
        pb::ToolChoice::Required => Some(format.forced_prefix(None)),
        pb::ToolChoice::Function => Some(format.forced_prefix(Some(function))),
    }
}

/// A message as the template takes it: a tool call's arguments parsed to a JSON object. The
/// role is checked where the template is rendered.
fn message(i: usize, m: &pb::ChatMessage) -> Result<ChatMessage> {
    if !m.tool_calls.is_empty() && m.role != "assistant" {
        return invalid(
            "messages",
            format!("message {i}: only an assistant message makes tool calls"),
        );
    }
    if !m.tool_call_id.is_empty() && m.role != "tool" {
        return invalid(
            "messages",
            format!("message {i}: only a tool message answers a tool_call_id"),
        );
    }
    let tool_calls = m
        .tool_calls
        .iter()
        .enumerate()
        .map(|(j, c)| {
            if !valid_tool_name(&c.name) {
                return invalid(
                    "messages",
                    format!("message {i}, tool call {j}: the name must be {NAME_RULE}"),
                );
            }
            let arguments: Value = match serde_json::from_str(&c.arguments) {
                Ok(v @ Value::Object(_)) => v,
                _ => {
                    return invalid(
                        "messages",
                        format!("message {i}, tool call {j}: the arguments must be a JSON object"),
                    );
                }
            };
            Ok(ToolCall {
                id: (!c.id.is_empty()).then(|| c.id.clone()),
                kind: "function".into(),
                function: FunctionCall {
                    name: c.name.clone(),
                    arguments,
                },
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(ChatMessage {
        role: m.role.clone(),
        content: m.content.clone(),
        tool_calls,
        tool_call_id: (!m.tool_call_id.is_empty()).then(|| m.tool_call_id.clone()),
    })
}

/// A tool as OpenAI defines it and chat templates render it.
fn tool(t: &pb::Tool) -> Result<Value> {
    if !valid_tool_name(&t.name) {
        return invalid(
            "tools",
            format!(
                "tool name '{}' must be {NAME_RULE}",
                t.name.chars().take(64).collect::<String>()
            ),
        );
    }
    let mut function = json!({"name": t.name});
    if !t.description.is_empty() {
        function["description"] = json!(t.description);
    }
    if !t.parameters.is_empty() {
        match serde_json::from_str(&t.parameters) {
            Ok(p @ Value::Object(_)) => function["parameters"] = p,
            _ => {
                return invalid(
                    "tools",
                    format!("tool {}: parameters must be a JSON schema object", t.name),
                );
            }
        }
    }
    Ok(json!({"type": "function", "function": function}))
}
