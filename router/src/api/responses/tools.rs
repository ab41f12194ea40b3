//! The Responses API's tools, as the model is offered them and as its calls come back:
//! - `function` tools, as they are;
//! - `namespace` tools (Codex groups its sub-agent functions in one): each function inside is
//!   offered as `namespace.name`, and a call of it comes back as a `function_call` whose
//!   `name` and `namespace` are apart, the form Codex reads (and sends back in its history);
//! - `custom` tools (free-form input): offered as a function of one string, `input`, and a
//!   call comes back as a `custom_tool_call` with that input. A grammar (`lark`, or `regex`
//!   as a Lark grammar of one terminal the whole input matches) travels as
//!   `Tool.input_grammar`, is shown in the tool's description, and holds the input of every
//!   call of the tool, rewritten to its text's JSON-escaped form
//!   ([`tandem_tokenizer::ToolFormat::held_grammar`]);
//! - tools only OpenAI's servers run (`web_search`, `file_search`, ...): left out, and named in
//!   the response's header ([`crate::api::http::dropped`]).
//!
//! Any other type (`local_shell`, `shell`, `apply_patch`: hosted tools with call items of their
//! own) is refused by name.

use std::collections::HashMap;

use serde_json::{Map, Value, json};
use tandem_proto::v1 as pb;

use crate::api::http::dropped::{Dropped, openai_server_tool};
use crate::api::http::error::ApiError;
use crate::api::http::fields::{flag, function_tool, tool_list};
use crate::api::http::only_keys;

/// What a tool offered to the model is, by the name the model calls it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Function { namespace: Option<String> },
    Custom,
}

/// A call the model made, as the Responses API shows it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Called {
    Function {
        name: String,
        namespace: Option<String>,
        arguments: String,
    },
    Custom {
        name: String,
        input: String,
    },
}

/// What each tool offered to the model is, by the name the model calls it.
#[derive(Debug, Default)]
pub(crate) struct Tools {
    kinds: HashMap<String, Kind>,
}

/// A request's tools as they are read: those offered so far, what each is, and those left out.
#[derive(Default)]
struct Reading {
    offered: Vec<pb::Tool>,
    kinds: HashMap<String, Kind>,
    dropped: Dropped,
}

/// The name a namespace's function is offered under. Names are a-z, A-Z, 0-9, `_` and `-`, so
/// the dot cannot make one tool's name out of another's.
pub(crate) fn qualified(namespace: &str, name: &str) -> String {
    format!("{namespace}.{name}")
}

impl Tools {
    /// `tools`, read and checked: the tools offered to the model, what each is, and the server
    /// tools left out.
    pub(crate) fn parse(
        body: &Map<String, Value>,
    ) -> Result<(Vec<pb::Tool>, Self, Dropped), ApiError> {
        let mut tools = Reading::default();
        tool_list(body, |param, t| {
            match t.get("type").and_then(Value::as_str).unwrap_or("") {
                "function" => tools.function(param, t, None)?,
                "custom" => tools.custom(param, t, None)?,
                "namespace" => tools.namespace(param, t)?,
                k if openai_server_tool(k) => tools.dropped.push(k),
                "" => {
                    return Err(ApiError::invalid(
                        &format!("{param}.type"),
                        "a tool has a string 'type'",
                    ));
                }
                k => {
                    return Err(ApiError::unsupported(
                        &format!("{param}.type"),
                        &format!(
                            "'{k}' tools are not served; offer a function, custom or namespace \
                             tool"
                        ),
                    ));
                }
            }
            Ok(None)
        })?;
        let kinds = Self { kinds: tools.kinds };
        Ok((tools.offered, kinds, tools.dropped))
    }

    /// The model's call of the tool offered as `name`, with `arguments` (a JSON object), as the
    /// API shows it.
    pub(crate) fn called(&self, name: &str, arguments: String) -> Called {
        match self.kinds.get(name) {
            Some(Kind::Custom) => {
                let input = serde_json::from_str::<Value>(&arguments)
                    .ok()
                    .and_then(|a| a.get("input").and_then(Value::as_str).map(str::to_string))
                    .unwrap_or(arguments);
                Called::Custom {
                    name: unqualified(name).to_string(),
                    input,
                }
            }
            Some(Kind::Function {
                namespace: Some(ns),
            }) => Called::Function {
                name: unqualified(name).to_string(),
                namespace: Some(ns.clone()),
                arguments,
            },
            _ => Called::Function {
                name: name.to_string(),
                namespace: None,
                arguments,
            },
        }
    }
}

impl Reading {
    /// A `function` tool (`param` names it), inside `namespace` if given.
    fn function(
        &mut self,
        param: &str,
        t: &Map<String, Value>,
        namespace: Option<&str>,
    ) -> Result<(), ApiError> {
        let known = ["type", "name", "description", "parameters", "strict"];
        only_keys(t, param, &known, "function tool")?;
        flag(t, "strict")?;
        let mut tool = function_tool(param, t, "parameters", false)?;
        if let Some(ns) = namespace {
            tool.name = qualified(ns, &tool.name);
        }
        let kind = Kind::Function {
            namespace: namespace.map(str::to_string),
        };
        self.add(param, tool, kind)
    }

    /// A `custom` tool, inside `namespace` if given: a function of one string, `input`.
    fn custom(
        &mut self,
        param: &str,
        t: &Map<String, Value>,
        namespace: Option<&str>,
    ) -> Result<(), ApiError> {
        let known = ["type", "name", "description", "format"];
        only_keys(t, param, &known, "custom tool")?;
        let mut tool = function_tool(param, t, "parameters", false)?;
        match t.get("format").filter(|f| !f.is_null()) {
            None => {}
            Some(f) => match (
                f.get("type").and_then(Value::as_str),
                f.get("syntax").and_then(Value::as_str),
                f.get("definition").and_then(Value::as_str),
            ) {
                (Some("text"), _, _) => {}
                (Some("grammar"), Some(syntax @ ("regex" | "lark")), Some(definition)) => {
                    let lark = match syntax {
                        "regex" => tandem_tokenizer::regex_grammar(definition),
                        _ => definition.to_string(),
                    };
                    tandem_tokenizer::quoted_lark(&lark)
                        .map_err(|e| ApiError::invalid(&format!("{param}.format.definition"), e))?;
                    tool.input_grammar = lark;
                    tool.description = format!(
                        "{}\n\nThe input follows this {syntax} grammar:\n{definition}",
                        tool.description
                    )
                    .trim_start()
                    .to_string();
                }
                _ => {
                    return Err(ApiError::invalid(
                        &format!("{param}.format"),
                        "a custom tool's format is {\"type\": \"text\"} or {\"type\": \
                         \"grammar\", \"syntax\": \"lark\" or \"regex\", \"definition\": ...}",
                    ));
                }
            },
        }
        tool.parameters = json!({
            "type": "object",
            "properties": {"input": {"type": "string"}},
            "required": ["input"],
            "additionalProperties": false,
        })
        .to_string();
        if let Some(ns) = namespace {
            tool.name = qualified(ns, &tool.name);
        }
        self.add(param, tool, Kind::Custom)
    }

    /// A `namespace` tool: its functions and custom tools, each offered as `namespace.name`.
    fn namespace(&mut self, param: &str, t: &Map<String, Value>) -> Result<(), ApiError> {
        let known = ["type", "name", "description", "tools"];
        only_keys(t, param, &known, "namespace tool")?;
        let name = function_tool(param, t, "parameters", false)?.name;
        let Some(inner) = t.get("tools").and_then(Value::as_array) else {
            return Err(ApiError::invalid(
                &format!("{param}.tools"),
                "a namespace tool holds an array of 'tools'",
            ));
        };
        for (j, f) in inner.iter().enumerate() {
            let param = format!("{param}.tools[{j}]");
            let Some(f) = f.as_object() else {
                return Err(ApiError::invalid(&param, "a tool is an object"));
            };
            match f.get("type").and_then(Value::as_str) {
                Some("function") => self.function(&param, f, Some(&name))?,
                Some("custom") => self.custom(&param, f, Some(&name))?,
                _ => {
                    return Err(ApiError::unsupported(
                        &format!("{param}.type"),
                        "a namespace holds function and custom tools",
                    ));
                }
            }
        }
        Ok(())
    }

    /// Offers `tool`, which is a `kind`; two of one name are refused.
    fn add(&mut self, param: &str, tool: pb::Tool, kind: Kind) -> Result<(), ApiError> {
        if self.kinds.insert(tool.name.clone(), kind).is_some() {
            return Err(ApiError::invalid(
                &format!("{param}.name"),
                format!("two tools are named '{}'", tool.name),
            ));
        }
        self.offered.push(tool);
        Ok(())
    }
}

/// A tool's own name, without its namespace.
fn unqualified(name: &str) -> &str {
    name.split_once('.').map_or(name, |(_, n)| n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(tools: Value) -> Result<(Vec<pb::Tool>, Tools, Dropped), ApiError> {
        let body = json!({ "tools": tools });
        Tools::parse(body.as_object().expect("object"))
    }

    #[test]
    fn namespaces_custom_tools_and_server_tools() {
        let (offered, tools, dropped) = parse(json!([
            {"type": "function", "name": "exec", "parameters": {"type": "object"}},
            {"type": "namespace", "name": "agents", "description": "sub-agents",
             "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}}]},
            {"type": "custom", "name": "patch",
             "format": {"type": "grammar", "syntax": "regex", "definition": "[a-z]+"}},
            {"type": "web_search", "external_web_access": false},
            {"type": "file_search", "vector_store_ids": []},
            {"type": "custom", "name": "shout",
             "format": {"type": "grammar", "syntax": "lark", "definition": "start: /[A-Z]+/"}},
        ]))
        .expect("served");
        let names: Vec<&str> = offered.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["exec", "agents.spawn", "patch", "shout"]);
        assert_eq!(offered[3].input_grammar, "start: /[A-Z]+/");
        assert!(offered[3].description.contains("start: /[A-Z]+/"));
        assert_eq!(dropped.types(), ["web_search", "file_search"]);
        assert_eq!(offered[2].input_grammar, "start: /[a-z]+/");
        assert_eq!(
            tools.called("agents.spawn", "{}".into()),
            Called::Function {
                name: "spawn".into(),
                namespace: Some("agents".into()),
                arguments: "{}".into()
            }
        );
        assert_eq!(
            tools.called("patch", r#"{"input":"abc"}"#.into()),
            Called::Custom {
                name: "patch".into(),
                input: "abc".into()
            }
        );
    }

    #[test]
    fn what_is_not_served_is_refused_in_plain_words() {
        for (tools, param) in [
            (json!([{"type": "local_shell"}]), "tools[0].type"),
            (json!([{"name": "x"}]), "tools[0].type"),
            (
                json!([{"type": "custom", "name": "x", "format": {"type": "grammar"}}]),
                "tools[0].format",
            ),
            (
                json!([{"type": "function", "name": "x"}, {"type": "custom", "name": "x"}]),
                "tools[1].name",
            ),
            (
                json!([{"type": "custom", "name": "x", "format": {"type": "grammar",
                        "syntax": "lark", "definition": "start: %json {}"}}]),
                "tools[0].format.definition",
            ),
        ] {
            let e = parse(tools).expect_err("refused");
            assert_eq!(e.param.as_deref(), Some(param), "{}", e.message);
            assert!(!e.message.contains("Some("), "{}", e.message);
        }
    }
}
