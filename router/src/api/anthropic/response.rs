//! A reply in Anthropic's shapes: its frames become content blocks (`thinking`, `text`,
//! `tool_use`) and the stream's events (`content_block_start`, `content_block_delta` with
//! `thinking_delta`, `text_delta` or `input_json_delta`, `content_block_stop`, then
//! `message_delta` and `message_stop`); the same blocks make the whole `message` of a request
//! that does not stream. A thinking block's `signature` is empty: Tandem signs nothing, and an
//! earlier turn's thinking is left out of the prompt whatever it carries.

use std::sync::Arc;

use serde_json::{Value, json};
use tandem_proto::v1 as pb;

use crate::api::http::Events;
use crate::api::http::error::{ApiError, Shape};
use crate::api::http::reply::{Part, Reply, stop_sequence};
use crate::cluster::frontend::Frontend;
use crate::dispatch::log::is_last;

/// A reply as its frames arrive: the blocks so far, the one open, and how it ended.
pub(super) struct Message {
    id: String,
    front: Arc<Frontend>,
    reply: Reply,
    stops: Vec<String>,
    /// Every token of the reply (to find the stop sequence that ended it).
    tokens: Vec<u32>,
    blocks: Vec<Value>,
    /// The text or thinking block open, at index `blocks.len()`, and its text.
    open: Option<(Streamed, String)>,
    /// The prompt's length in tokens, as known when the message starts.
    prompt_tokens: u32,
    /// The last frame's stop reason, stop sequence and usage, once it came.
    end: Option<(&'static str, Option<String>, Value)>,
}

impl Message {
    pub(super) fn new(
        request_id: &str,
        front: Arc<Frontend>,
        reply: Reply,
        stops: Vec<String>,
        prompt_tokens: u32,
    ) -> Self {
        Self {
            id: format!("msg_{request_id}"),
            front,
            reply,
            stops,
            tokens: Vec::new(),
            blocks: Vec::new(),
            open: None,
            prompt_tokens,
            end: None,
        }
    }

    /// The `message_start` event: the message with no content yet.
    pub(super) fn start(&self) -> Value {
        let usage = json!({
            "input_tokens": self.prompt_tokens,
            "output_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        });
        let message = self.message(json!([]), Value::Null, Value::Null, usage);
        json!({"type": "message_start", "message": message})
    }

    /// The events frame `f` makes; on the last frame, those that end the message.
    fn events(&mut self, f: &pb::GenerateResponse) -> Vec<Value> {
        self.tokens.extend(&f.token_ids);
        let last = is_last(f);
        let mut events = Vec::new();
        for part in self.reply.frame(f) {
            self.part(part, &mut events);
        }
        if last {
            self.close_open(&mut events);
            let (reason, sequence, usage) = self.ending(f);
            events.push(json!({
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage,
            }));
            events.push(json!({"type": "message_stop"}));
            self.end = Some((reason, sequence, usage));
        }
        events
    }

    fn part(&mut self, part: Part, events: &mut Vec<Value>) {
        match part {
            Part::Reasoning(t) => self.stream(Streamed::Thinking, t, events),
            Part::Text(t) => self.stream(Streamed::Text, t, events),
            Part::Call {
                id,
                name,
                arguments,
                ..
            } => {
                self.close_open(events);
                let index = self.blocks.len();
                events.push(json!({
                    "type": "content_block_start",
                    "index": index,
                    "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}},
                }));
                events.push(json!({
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": arguments},
                }));
                events.push(stop_block(index));
                // The parser's arguments are a JSON object's text.
                let input: Value = serde_json::from_str(&arguments).unwrap_or_else(|_| json!({}));
                self.blocks
                    .push(json!({"type": "tool_use", "id": id, "name": name, "input": input}));
            }
        }
    }

    /// `t` added to the open block of `kind`, opening one (and closing another kind's) first.
    fn stream(&mut self, kind: Streamed, t: String, events: &mut Vec<Value>) {
        if self.open.as_ref().is_some_and(|(k, _)| *k != kind) {
            self.close_open(events);
        }
        let index = self.blocks.len();
        let (_, text) = self.open.get_or_insert_with(|| {
            events.push(json!({
                "type": "content_block_start",
                "index": index,
                "content_block": kind.block(""),
            }));
            (kind, String::new())
        });
        text.push_str(&t);
        let delta = match kind {
            Streamed::Text => json!({"type": "text_delta", "text": t}),
            Streamed::Thinking => json!({"type": "thinking_delta", "thinking": t}),
        };
        events.push(json!({"type": "content_block_delta", "index": index, "delta": delta}));
    }

    fn close_open(&mut self, events: &mut Vec<Value>) {
        if let Some((kind, text)) = self.open.take() {
            events.push(stop_block(self.blocks.len()));
            self.blocks.push(kind.block(&text));
        }
    }

    /// How the reply ended, from its last frame: the stop reason, the stop sequence that ended
    /// it, and its usage (input tokens read from the cache apart from those computed).
    fn ending(&self, f: &pb::GenerateResponse) -> (&'static str, Option<String>, Value) {
        let u = f.usage.unwrap_or_default();
        let usage = json!({
            "input_tokens": u.prompt_tokens.saturating_sub(u.cached_tokens),
            "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u.cached_tokens,
        });
        let (reason, sequence) = match pb::FinishReason::try_from(f.finish_reason) {
            Ok(pb::FinishReason::Length) => ("max_tokens", None),
            _ if self.reply.called() => ("tool_use", None),
            _ => match stop_sequence(&self.front.tokenizer, &self.tokens, &self.stops) {
                Some(s) => ("stop_sequence", Some(s.to_string())),
                None => ("end_turn", None),
            },
        };
        (reason, sequence, usage)
    }

    fn message(&self, content: Value, reason: Value, sequence: Value, usage: Value) -> Value {
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.front.model_name,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage,
        })
    }

    /// The whole message, once its last frame came.
    pub(super) fn whole(mut self) -> Value {
        let (reason, sequence, usage) = self.end.take().unwrap_or(("end_turn", None, json!({})));
        let blocks = Value::Array(std::mem::take(&mut self.blocks));
        self.message(blocks, json!(reason), json!(sequence), usage)
    }
}

impl Events for Message {
    fn frame(&mut self, f: &pb::GenerateResponse) -> Vec<Value> {
        self.events(f)
    }

    fn finished(&self) -> bool {
        self.end.is_some()
    }

    fn error(&mut self, e: &ApiError) -> Value {
        e.body_in(Shape::Anthropic)
    }
}

/// The kinds of block whose text streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Streamed {
    Text,
    Thinking,
}

impl Streamed {
    fn block(self, text: &str) -> Value {
        match self {
            Streamed::Text => json!({"type": "text", "text": text}),
            Streamed::Thinking => json!({"type": "thinking", "thinking": text, "signature": ""}),
        }
    }
}

fn stop_block(index: usize) -> Value {
    json!({"type": "content_block_stop", "index": index})
}
