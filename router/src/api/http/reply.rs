//! A reply as the HTTP APIs show it: its text split into [`Part`]s, as the frames arrive: the
//! reasoning a thinking model opens with, then text and the tool calls the model's template
//! markup holds (the reasoning never reaches the tool-call parser); and what every HTTP API asks
//! of the frames (the next one, the stop sequence that ended a reply).

use std::collections::HashMap;

use serde_json::Value;
use tandem_proto::v1 as pb;
use tandem_tokenizer::{BareCalls, Piece, ReasoningParser, Thought, Tokenizer, ToolCallParser};
use tonic::Code;

use crate::api::http::error::ApiError;
use crate::dispatch::GenerateStream;

/// One part of a reply: reasoning, text, or a tool call with its index among the reply's calls.
pub(crate) enum Part {
    Reasoning(String),
    Text(String),
    Call {
        index: usize,
        id: String,
        name: String,
        arguments: String,
    },
}

/// A reply split into [`Part`]s as its text arrives: all text, or, for a chat that offered
/// tools, text and the calls its template's markup holds.
pub(crate) struct Reply {
    /// For a chat whose template thinks: the reasoning split off first.
    reasoning: Option<ReasoningParser>,
    parser: Option<ToolCallParser>,
    /// False: calls after the first are dropped (`parallel_tool_calls: false`).
    parallel: bool,
    /// Call ids are this and the call's index: stable across a failover's replay.
    call_id_prefix: String,
    calls: usize,
}

impl Reply {
    /// The reply of choice `choice` to `r`, its calls parsed when `r` offers tools the model can
    /// take ([`tool_parser`]); the calls' ids are unique among the request's choices.
    /// `parallel: false` keeps the first call only.
    pub(crate) fn new(
        tokenizer: &Tokenizer,
        r: &pb::GenerateRequest,
        parallel: bool,
        choice: u32,
    ) -> Self {
        let request_id = &r.request_id;
        let call_id_prefix = match choice {
            0 => format!("call_{request_id}_"),
            c => format!("call_{request_id}_{c}_"),
        };
        let thinks =
            !r.messages.is_empty() && tokenizer.thinks() && r.enable_thinking != Some(false);
        Self {
            reasoning: thinks.then(|| ReasoningParser::new(false)),
            parser: tool_parser(tokenizer, r),
            parallel,
            call_id_prefix,
            calls: 0,
        }
    }

    /// The parts `text` completes.
    fn push(&mut self, text: &str) -> Vec<Part> {
        match &mut self.reasoning {
            None => self.answer(text),
            Some(r) => {
                let thoughts = r.push(text);
                self.thoughts(thoughts)
            }
        }
    }

    /// The parts of the reasoning and of the answer in `thoughts`.
    fn thoughts(&mut self, thoughts: Vec<Thought>) -> Vec<Part> {
        let mut out = Vec::new();
        for t in thoughts {
            match t {
                Thought::Reasoning(r) => out.push(Part::Reasoning(r)),
                Thought::Answer(a) => out.extend(self.answer(&a)),
            }
        }
        out
    }

    /// The parts `text`, of the answer, completes.
    fn answer(&mut self, text: &str) -> Vec<Part> {
        match &mut self.parser {
            None if text.is_empty() => Vec::new(),
            None => vec![Part::Text(text.to_string())],
            Some(p) => {
                let pieces = p.push(text);
                self.parts(pieces)
            }
        }
    }

    /// The parts frame `f` completes, with those still held when it is the reply's last.
    pub(crate) fn frame(&mut self, f: &pb::GenerateResponse) -> Vec<Part> {
        let mut parts = self.push(&f.text);
        if crate::dispatch::log::is_last(f) {
            parts.extend(self.finish());
        }
        parts
    }

    /// The parts still held when the reply ends.
    fn finish(&mut self) -> Vec<Part> {
        let mut out = match self.reasoning.take() {
            None => Vec::new(),
            Some(r) => self.thoughts(r.finish()),
        };
        if let Some(p) = self.parser.take() {
            out.extend(self.parts(p.finish()));
        }
        out
    }

    /// Whether the reply called a tool.
    pub(crate) fn called(&self) -> bool {
        self.calls > 0
    }

    fn parts(&mut self, pieces: Vec<Piece>) -> Vec<Part> {
        let mut out = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Text(t) => out.push(Part::Text(t)),
                Piece::Call { .. } if self.calls > 0 && !self.parallel => {}
                Piece::Call { name, arguments } => {
                    out.push(Part::Call {
                        index: self.calls,
                        id: format!("{}{}", self.call_id_prefix, self.calls),
                        name,
                        arguments,
                    });
                    self.calls += 1;
                }
            }
        }
        out
    }
}

/// The parser of a chat reply's tool calls: for a request that offers tools without
/// `tool_choice: none`, in the template's markup, started on the call the choice forces; with
/// `auto`, a reply that is one bare call ([`bare_calls`]) is a call too. A request whose tools
/// the model cannot take is refused before its reply.
fn tool_parser(tokenizer: &Tokenizer, r: &pb::GenerateRequest) -> Option<ToolCallParser> {
    let format = tokenizer.tool_format().filter(|_| !r.tools.is_empty())?;
    let choice = pb::ToolChoice::try_from(r.tool_choice).ok()?;
    let forced = crate::dispatch::chat::reply_start(format, choice, &r.tool_choice_function)?;
    let parser = ToolCallParser::new(format, &forced);
    Some(match choice {
        pb::ToolChoice::Auto => parser.with_bare_calls(bare_calls(&r.tools)),
        _ => parser,
    })
}

/// The bare calls a reply may make: of `tools`, with arguments that pass the tool's JSON schema
/// (checked only when a reply is one, so a request pays nothing otherwise). A schema the
/// validator cannot read passes nothing: a call that cannot be checked stays text.
fn bare_calls(tools: &[pb::Tool]) -> BareCalls {
    let schemas: HashMap<String, String> = tools
        .iter()
        .map(|t| (t.name.clone(), t.parameters.clone()))
        .collect();
    let names = tools.iter().map(|t| t.name.clone()).collect();
    BareCalls::new(names, move |name, args| {
        match schemas.get(name).map(String::as_str) {
            None => false,
            Some("") => true,
            Some(schema) => serde_json::from_str::<Value>(schema)
                .ok()
                .and_then(|s| jsonschema::validator_for(&s).ok())
                .is_some_and(|v| v.is_valid(args)),
        }
    })
}

/// The next frame of a generation; a stream that ends before its final frame is UNAVAILABLE.
pub(crate) async fn next_frame(
    frames: &mut GenerateStream,
) -> Result<pb::GenerateResponse, ApiError> {
    use futures::StreamExt;
    match frames.next().await {
        Some(Ok(f)) => Ok(f),
        Some(Err(s)) => Err(ApiError::from_status(&s)),
        None => Err(ApiError::from_code(
            Code::Unavailable,
            "the generation ended without a final frame".into(),
            None,
        )),
    }
}

/// Which of `stops` ended a reply of `tokens` that finished with STOP, if a stop string did:
/// the decode node cuts a reply's text before the stop string it meets, but sends the tokens
/// that spelled it, so the stop string is the first one the tokens' whole text holds. A reply
/// that ended on an end-of-generation token holds none (it would have stopped there).
pub(crate) fn stop_sequence<'a>(
    tokenizer: &Tokenizer,
    tokens: &[u32],
    stops: &'a [String],
) -> Option<&'a str> {
    if stops.is_empty() {
        return None;
    }
    let text = tokenizer.decode(tokens);
    stops
        .iter()
        .filter_map(|s| text.find(s.as_str()).map(|at| (at, s.as_str())))
        .min()
        .map(|(_, s)| s)
}

#[cfg(test)]
mod tests {
    use tandem_tokenizer::{TokenizerSpec, ToolFormat, byte_level_chars};

    use super::*;

    /// A byte-level tokenizer whose template thinks (a `<think>` block) and takes tools in
    /// Hermes markup, as Qwen3's does.
    fn thinking_tokenizer() -> Tokenizer {
        let tokens: Vec<String> = byte_level_chars().iter().map(char::to_string).collect();
        Tokenizer::new(TokenizerSpec {
            kind: Default::default(),
            pre: "default".into(),
            token_types: vec![1; tokens.len()],
            tokens,
            scores: Vec::new(),
            add_space_prefix: false,
            merges: Vec::new(),
            bos_id: None,
            eos_id: None,
            eot_id: None,
            add_bos: false,
            chat_template: Some(
                "{% if tools %}<tools>{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}\
                 {% if enable_thinking is defined and enable_thinking is false %}<think>\n\n\
                 </think>\n\n{% endif %}<tool_call>"
                    .into(),
            ),
        })
        .expect("tokenizer")
    }

    /// What the reply `text` (fed in pieces of 3 bytes where they fall on characters) becomes.
    fn parts_of(tokenizer: &Tokenizer, r: &pb::GenerateRequest, text: &str) -> Vec<String> {
        let mut reply = Reply::new(tokenizer, r, true, 0);
        let mut parts = Vec::new();
        let mut at = 0;
        while at < text.len() {
            let mut end = (at + 3).min(text.len());
            while !text.is_char_boundary(end) {
                end += 1;
            }
            parts.extend(reply.push(&text[at..end]));
            at = end;
        }
        parts.extend(reply.finish());
        let mut shown: Vec<String> = Vec::new();
        for p in parts {
            let (kind, body) = match p {
                Part::Reasoning(t) => ("reasoning", t),
                Part::Text(t) => ("text", t),
                Part::Call {
                    name, arguments, ..
                } => ("call", format!("{name} {arguments}")),
            };
            match shown.last_mut() {
                Some(last) if last.starts_with(kind) && kind != "call" => last.push_str(&body),
                _ => shown.push(format!("{kind}: {body}")),
            }
        }
        shown
    }

    #[test]
    fn a_thinking_models_reasoning_is_split_off_before_its_tool_calls_are_read() {
        let tokenizer = thinking_tokenizer();
        let mut r = pb::GenerateRequest {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: "Weather?".into(),
                ..Default::default()
            }],
            tools: vec![pb::Tool {
                name: "get_weather".into(),
                ..Default::default()
            }],
            tool_choice: pb::ToolChoice::Auto as i32,
            ..Default::default()
        };
        let reply = "<think>\nCall it: <tool_call>{\"name\": \"x\"}</tool_call> is the form. é\n\
                     </think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
                     {\"city\": \"Paris\"}}\n</tool_call>";
        assert_eq!(
            parts_of(&tokenizer, &r, reply),
            [
                "reasoning: Call it: <tool_call>{\"name\": \"x\"}</tool_call> is the form. é",
                "call: get_weather {\"city\":\"Paris\"}",
            ]
        );
        // Thinking switched off: the template closed the block in the prompt, and a reply is
        // read as it comes.
        r.enable_thinking = Some(false);
        r.tools.clear();
        assert_eq!(
            parts_of(&tokenizer, &r, "<think>x</think>y"),
            ["text: <think>x</think>y"]
        );
        let prompt = crate::dispatch::chat::render(&tokenizer, &r)
            .expect("render")
            .text;
        assert!(
            prompt.ends_with("<think>\n\n</think>\n\n<tool_call>"),
            "{prompt:?}"
        );
        r.enable_thinking = None;
        let prompt = crate::dispatch::chat::render(&tokenizer, &r)
            .expect("render")
            .text;
        assert!(!prompt.contains("<think>"), "{prompt:?}");
    }

    #[test]
    fn a_bare_call_must_pass_its_tools_schema() {
        let tools = [pb::Tool {
            name: "get_weather".into(),
            parameters: r#"{"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}"#
                .into(),
            ..Default::default()
        }];
        let parse = |reply: &str| {
            let mut p =
                ToolCallParser::new(ToolFormat::Hermes, "").with_bare_calls(bare_calls(&tools));
            let mut pieces = p.push(reply);
            pieces.extend(p.finish());
            pieces
        };
        let call = r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#;
        assert_eq!(
            parse(call),
            vec![Piece::Call {
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris"}"#.into()
            }]
        );
        for text in [
            r#"{"name": "get_weather", "arguments": {"city": 7}}"#,
            r#"{"name": "get_weather", "arguments": {}}"#,
        ] {
            assert_eq!(parse(text), vec![Piece::Text(text.into())], "{text}");
        }
    }
}
