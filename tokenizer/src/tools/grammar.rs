//! The grammars (llguidance's Lark dialect) that hold a reply's tool calls to the tools offered:
//! the rest of a call that the tool choice forces, and, where the model decides, a reply that is
//! free until it starts a call and held to that call's grammar from then on.

use serde_json::{Value, json};

use super::json_string::quoted_lark;
use super::{CLOSE, OPEN, ToolFormat};

/// What a tool's call arguments are held to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arguments<'a> {
    /// A JSON schema, as text (`None`: any object).
    Schema(Option<&'a str>),
    /// One string, `input`, in this Lark grammar (a custom tool's free-form input).
    Input(&'a str),
}

/// A tool as its call's grammar sees it: its name (a-z, A-Z, 0-9, `_`, `-`, and `.` between a
/// namespace and a name) and what its arguments are held to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallGrammar<'a> {
    pub name: &'a str,
    pub arguments: Arguments<'a>,
}

/// Whitespace the markup's JSON may hold between its parts, as a regex.
const WS: &str = r"\s*";

impl ToolFormat {
    /// The rest of a forced call, after [`ToolFormat::forced_prefix`]: the name of one of
    /// `tools` (or `function`'s, already written), arguments held as the tool says, and the
    /// call's end. Fails, in words, where a custom tool's grammar cannot be held.
    pub fn call_grammar(
        self,
        tools: &[CallGrammar<'_>],
        function: Option<&str>,
    ) -> Result<String, String> {
        let Self::Hermes = self;
        let mut lark = format!("CALL_END: \"}}\\n{CLOSE}\"\n");
        match function {
            Some(name) => {
                let untyped = CallGrammar {
                    name,
                    arguments: Arguments::Schema(None),
                };
                let tool = tools.iter().find(|t| t.name == name).unwrap_or(&untyped);
                lark.push_str("start: args_0 CALL_END\n");
                lark.push_str(&arguments_rule(0, tool, false)?);
            }
            None => {
                lark.push_str(&format!("start: {}\n", alternatives("call", tools.len())));
                for (i, tool) in tools.iter().enumerate() {
                    lark.push_str(&format!(
                        "call_{i}: \"{}\\\", \\\"arguments\\\": \" args_{i} CALL_END\n",
                        tool.name
                    ));
                    lark.push_str(&arguments_rule(i, tool, false)?);
                }
            }
        }
        Ok(lark)
    }

    /// A whole reply where the model decides whether to call: free text, unless it starts a
    /// call in one of the forms the reply's parser reads (the markup's tags, or a bare
    /// `{"name": ...}` object, or one after a code fence's opening line, once it names an
    /// offered tool and its `arguments` key); from there on the call is held to that tool's
    /// arguments and the call's end. What follows a bare object is free again: only a reply
    /// that ends there is a call, and one that goes on (the same call written again, text)
    /// stays text, as the model wrote it. Text the parser would read as text is left as the
    /// model writes it.
    pub fn held_grammar(self, tools: &[CallGrammar<'_>]) -> Result<String, String> {
        let Self::Hermes = self;
        let names: Vec<String> = tools.iter().map(|t| regex_syntax::escape(t.name)).collect();
        let open = regex_syntax::escape(OPEN);
        let close = regex_syntax::escape(CLOSE).replace('/', "\\/");
        // A reply that starts a bare call: the object's start, bare or after a fence's opening
        // line, an offered tool's whole name, and the `arguments` key (an object that names a
        // tool and goes on otherwise is an answer about it, not a call).
        let key = format!(r#"{WS},{WS}"arguments"{WS}:"#);
        let bare = format!(
            r#"{WS}(```(json)?\n{WS})?\{{{WS}"name"{WS}:{WS}"({})"{key}(?s:.*)"#,
            names.join("|")
        );
        let mut lark = format!(
            "start: TEXT? | TO_TAG tagged | bare | fenced\n\
             TEXT: /(?s:.+)/ & ~/(?s:.*){open}(?s:.*)/ & ~/{bare}/\n\
             TO_TAG: TEXT? /{open}/\n\
             AFTER: /(?s:.+)/ & ~/(?s:.*){open}(?s:.*)/\n\
             NEXT_TAG: AFTER? /{open}/\n\
             tagged: tagged_call (NEXT_TAG tagged_call)* AFTER?\n\
             TAG_END: /{WS}\\}}{WS}{close}/\n\
             OBJECT_END: /{WS}\\}}/\n\
             after_object: AFTER | NEXT_TAG tagged\n"
        );
        for (i, (tool, name)) in tools.iter().zip(&names).enumerate() {
            let object = format!(r#"\{{{WS}"name"{WS}:{WS}"{name}"{key}{WS}"#);
            lark.push_str(&format!(
                "tagged_{i}: /{WS}{object}/ args_{i} TAG_END\n\
                 bare_{i}: /{WS}{object}/ args_{i} OBJECT_END after_object?\n\
                 fenced_{i}: /{WS}```(json)?\\n{WS}{object}/ args_{i} OBJECT_END after_object?\n"
            ));
            lark.push_str(&arguments_rule(i, tool, true)?);
        }
        lark.push_str(&format!(
            "tagged_call: {}\nbare: {}\nfenced: {}\n",
            alternatives("tagged", tools.len()),
            alternatives("bare", tools.len()),
            alternatives("fenced", tools.len())
        ));
        Ok(lark)
    }
}

/// The rules `{rule}_0` to `{rule}_{n-1}` as alternatives.
fn alternatives(rule: &str, n: usize) -> String {
    (0..n)
        .map(|i| format!("{rule}_{i}"))
        .collect::<Vec<_>>()
        .join(" | ")
}

/// The rule `args_{i}`: `tool`'s arguments, held as it says. A `lenient` schema's keywords that
/// llguidance does not implement are ignored rather than failing the grammar.
fn arguments_rule(i: usize, tool: &CallGrammar<'_>, lenient: bool) -> Result<String, String> {
    Ok(match tool.arguments {
        Arguments::Schema(schema) => {
            let schema = schema.unwrap_or("{\"type\": \"object\"}");
            let schema = match serde_json::from_str::<Value>(schema) {
                Ok(Value::Object(mut o)) if lenient => {
                    o.insert("x-guidance".into(), json!({"lenient": true}));
                    Value::Object(o).to_string()
                }
                _ => schema.to_string(),
            };
            format!("args_{i}: %json {schema}\n")
        }
        Arguments::Input(lark) => format!(
            "args_{i}: /\\{{{WS}\"input\"{WS}:{WS}\"/ input_{i} /\"{WS}\\}}/\n\
             input_{i}: %lark {{\n{}\n}}\n",
            quoted_lark(lark).map_err(|e| format!("tool {}: {e}", tool.name))?
        ),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use llguidance::api::TopLevelGrammar;
    use llguidance::{Matcher, ParserFactory};
    use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

    use super::*;

    /// Whether `text` is a whole reply `lark` allows: compiled by llguidance over a vocabulary
    /// of single bytes (255 is the end of generation), and fed byte by byte.
    fn allows(lark: &str, text: &str) -> bool {
        let mut words: Vec<Vec<u8>> = (0..255u8).map(|b| vec![b]).collect();
        words.push([&[TokTrie::SPECIAL_TOKEN_MARKER], &b"<eos>"[..]].concat());
        let info = TokRxInfo::new(words.len() as u32, 255);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
        let factory = ParserFactory::new_simple(&env).expect("factory");
        let parser = factory
            .create_parser(TopLevelGrammar::from_lark(lark.to_string()))
            .unwrap_or_else(|e| panic!("{e}\n{lark}"));
        let mut matcher = Matcher::new(Ok(parser));
        let bytes: Vec<u32> = text.bytes().map(u32::from).collect();
        matcher.validate_tokens(&bytes).expect("validates") == bytes.len()
            && matcher.consume_tokens(&bytes).is_ok()
            && matcher.is_accepting().expect("state")
    }

    const WEATHER: &str = r#"{"type": "object", "properties": {"city": {"type": "string"}},
        "required": ["city"], "additionalProperties": false}"#;

    fn tools() -> [CallGrammar<'static>; 3] {
        [
            CallGrammar {
                name: "get_weather",
                arguments: Arguments::Schema(Some(WEATHER)),
            },
            CallGrammar {
                name: "ns.shout",
                arguments: Arguments::Input(
                    r#"start: WORD (" " WORD)*
WORD: /[A-Z"\\]+/"#,
                ),
            },
            CallGrammar {
                name: "anything",
                arguments: Arguments::Schema(None),
            },
        ]
    }

    #[test]
    fn a_held_reply_is_free_until_it_starts_a_call() {
        let lark = ToolFormat::Hermes.held_grammar(&tools()).expect("grammar");
        let call = r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#;
        let shout = r#"{"name": "ns.shout", "arguments": {"input": "SAY \"HI\" \\ NOW"}}"#;
        for text in [
            String::new(),
            "Hello there.\nIt is sunny {\"a\": 1} today.".into(),
            format!("<tool_call>\n{call}\n</tool_call>"),
            format!(
                "Let me look.\n<tool_call>\n{call}\n</tool_call>\n<tool_call>\n{shout}\n</tool_call>"
            ),
            format!("<tool_call>\n{call}\n</tool_call>\nDone."),
            call.into(),
            format!("  {call}\n"),
            format!("```json\n{call}\n```"),
            format!("```\n{call}\n```\n"),
            shout.into(),
            r#"{"name":"anything","arguments":{"x":[1,2]}}"#.into(),
            // What follows a bare object is free: the reply is then text to the parser.
            format!("{call} Done."),
            format!("{call}\n{call}\n{call}\n"),
            format!("{call}\n<tool_call>\n{call}\n</tool_call>"),
            // Not a call's start, so text: a name no tool has, a tool's name without
            // arguments, or text before the object.
            r#"{"name": "Alice", "age": 3}"#.into(),
            r#"{"name": "get_weather", "result": "sunny"}"#.into(),
            format!("Call it like this: {call}"),
        ] {
            assert!(allows(&lark, &text), "refused {text:?}");
        }
    }

    #[test]
    fn a_started_call_is_held_to_its_tool() {
        let lark = ToolFormat::Hermes.held_grammar(&tools()).expect("grammar");
        for text in [
            // An argument the schema does not have, or lacks one it requires.
            r#"{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}"#,
            r#"<tool_call>
{"name": "get_weather", "arguments": {}}
</tool_call>"#,
            // A tagged call of a tool not offered.
            r#"<tool_call>
{"name": "get_time", "arguments": {}}
</tool_call>"#,
            // Input outside the custom tool's grammar, or raw where JSON escapes it.
            r#"{"name": "ns.shout", "arguments": {"input": "hello"}}"#,
            r#"{"name": "ns.shout", "arguments": {"input": "SAY "HI""}}"#,
            // A tagged call after a bare object is held as any other.
            r#"{"name": "get_weather", "arguments": {"city": "Paris"}}
<tool_call>
{"name": "get_time", "arguments": {}}
</tool_call>"#,
            // A call left open.
            r#"{"name": "get_weather", "arguments": {"city": "Par"#,
            "<tool_call>\n{\"name\": \"anything\", \"arguments\": {}}\n",
        ] {
            assert!(!allows(&lark, text), "allowed {text:?}");
        }
    }

    #[test]
    fn a_forced_call_is_held_from_its_prefix() {
        let tools = tools();
        let any = ToolFormat::Hermes
            .call_grammar(&tools, None)
            .expect("grammar");
        assert!(allows(
            &any,
            "ns.shout\", \"arguments\": {\"input\": \"OK\"}}\n</tool_call>"
        ));
        assert!(!allows(
            &any,
            "ns.shout\", \"arguments\": {\"input\": \"ok\"}}\n</tool_call>"
        ));
        let named = ToolFormat::Hermes
            .call_grammar(&tools, Some("get_weather"))
            .expect("grammar");
        assert!(allows(&named, "{\"city\": \"Oslo\"}}\n</tool_call>"));
        assert!(!allows(&named, "{\"town\": \"Oslo\"}}\n</tool_call>"));
    }

    #[test]
    fn a_grammar_that_cannot_be_held_names_its_tool() {
        let tools = [CallGrammar {
            name: "patch",
            arguments: Arguments::Input("start: %json {}"),
        }];
        let e = ToolFormat::Hermes
            .held_grammar(&tools)
            .expect_err("refused");
        assert!(e.starts_with("tool patch: %json"), "{e}");
    }
}
