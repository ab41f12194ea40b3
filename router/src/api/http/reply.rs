//! A reply as the HTTP APIs show it: its text split into [`Part`]s, text and the tool calls
//! the model's template markup holds, as the frames arrive; and what every HTTP API asks of the
//! frames (the next one, the stop sequence that ended a reply).

use std::collections::HashMap;

use serde_json::Value;
use tandem_proto::v1 as pb;
use tandem_tokenizer::{BareCalls, Piece, Tokenizer, ToolCallParser};
use tonic::Code;

use crate::api::http::error::ApiError;
use crate::dispatch::GenerateStream;

/// One part of a reply: text, or a tool call with its index among the reply's calls.
pub(crate) enum Part {
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
        Self {
            parser: tool_parser(tokenizer, r),
            parallel,
            call_id_prefix,
            calls: 0,
        }
    }

    /// The parts `text` completes.
    fn push(&mut self, text: &str) -> Vec<Part> {
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
        match self.parser.take() {
            None => Vec::new(),
            Some(p) => self.parts(p.finish()),
        }
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
    use tandem_tokenizer::ToolFormat;

    use super::*;

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
