//! A reply in the Responses API's shapes: its frames become output items (a thinking model's
//! `reasoning` with its `reasoning_text`, a `message` with `output_text`, `function_call`s) and
//! the stream's events (`response.output_item.added`, `response.reasoning_text.delta`/`.done`,
//! `response.content_part.added`, `response.output_text.delta`/`.done`,
//! `response.function_call_arguments.delta`/`.done`, `response.output_item.done`, and the
//! `response` events around them); the same items make the whole response of a request that
//! does not stream.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value, json};
use tandem_proto::v1 as pb;

use crate::api::http::Events;
use crate::api::http::error::{ApiError, Shape};
use crate::api::http::reply::{Part, Reply};
use crate::api::responses::tools::{Called, Tools};
use crate::dispatch::log::is_last;

/// A reply as its frames arrive: the output items so far, the message open, and the events'
/// sequence numbers.
pub(super) struct Transcript {
    id: String,
    created_at: u64,
    model: String,
    echo: Map<String, Value>,
    parallel_tool_calls: bool,
    reply: Reply,
    /// What the tools the model may call are, for its calls' items.
    tools: Tools,
    items: Vec<Value>,
    /// The message item open, at index `items.len()`: its id and text.
    text: Option<(String, String)>,
    /// The reasoning item open, at index `items.len()`: its id and text.
    reasoning: Option<(String, String)>,
    sequence: u64,
    /// The finished response's status, incomplete details and usage.
    end: Option<(&'static str, Value, Value)>,
}

impl Transcript {
    pub(super) fn new(
        request_id: &str,
        model: &str,
        echo: Map<String, Value>,
        parallel_tool_calls: bool,
        reply: Reply,
        tools: Tools,
    ) -> Self {
        Self {
            id: format!("resp_{request_id}"),
            created_at: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: model.to_string(),
            echo,
            parallel_tool_calls,
            reply,
            tools,
            items: Vec::new(),
            text: None,
            reasoning: None,
            sequence: 0,
            end: None,
        }
    }

    /// An event of type `kind` with `fields`, numbered in sequence.
    fn event(&mut self, kind: &str, fields: Value) -> Value {
        let mut event = json!({"type": kind, "sequence_number": self.sequence});
        self.sequence += 1;
        if let (Some(e), Value::Object(f)) = (event.as_object_mut(), fields) {
            e.extend(f);
        }
        event
    }

    /// The events that open a stream: `response.created` and `response.in_progress`.
    pub(super) fn start(&mut self) -> Vec<Value> {
        let response = self.response();
        vec![
            self.event("response.created", json!({"response": response})),
            self.event("response.in_progress", json!({"response": response})),
        ]
    }

    /// The events frame `f` makes; on the last frame, those that end the response.
    fn events(&mut self, f: &pb::GenerateResponse) -> Vec<Value> {
        let last = is_last(f);
        let mut events = Vec::new();
        for part in self.reply.frame(f) {
            self.part(part, &mut events);
        }
        if last {
            self.close_reasoning(&mut events);
            self.close_text(&mut events);
            let u = f.usage.unwrap_or_default();
            let usage = json!({
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.prompt_tokens + u.completion_tokens,
            });
            let end = match pb::FinishReason::try_from(f.finish_reason) {
                Ok(pb::FinishReason::Length) => {
                    ("incomplete", json!({"reason": "max_output_tokens"}), usage)
                }
                _ => ("completed", Value::Null, usage),
            };
            let kind = match end.0 {
                "completed" => "response.completed",
                _ => "response.incomplete",
            };
            self.end = Some(end);
            let response = self.response();
            events.push(self.event(kind, json!({"response": response})));
        }
        events
    }

    fn part(&mut self, part: Part, events: &mut Vec<Value>) {
        if !matches!(part, Part::Reasoning(_)) {
            self.close_reasoning(events);
        }
        let index = self.items.len();
        match part {
            Part::Reasoning(t) => {
                self.close_text(events);
                let index = self.items.len();
                if self.reasoning.is_none() {
                    let id = format!("rs_{}_{index}", self.id);
                    let item = reasoning_item(&id, "in_progress", "");
                    let added = self.event(
                        "response.output_item.added",
                        json!({"output_index": index, "item": item}),
                    );
                    events.push(added);
                    self.reasoning = Some((id, String::new()));
                }
                let Some((id, text)) = &mut self.reasoning else {
                    return;
                };
                text.push_str(&t);
                let id = id.clone();
                let delta = self.event(
                    "response.reasoning_text.delta",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "delta": t}),
                );
                events.push(delta);
            }
            Part::Text(t) => {
                if self.text.is_none() {
                    let id = format!("msg_{}_{index}", self.id);
                    let item = message_item(&id, "in_progress", json!([]));
                    let added = self.event(
                        "response.output_item.added",
                        json!({"output_index": index, "item": item}),
                    );
                    let part_added = self.event(
                        "response.content_part.added",
                        json!({"item_id": id, "output_index": index, "content_index": 0,
                               "part": output_text("")}),
                    );
                    events.extend([added, part_added]);
                    self.text = Some((id, String::new()));
                }
                let Some((id, text)) = &mut self.text else {
                    return;
                };
                text.push_str(&t);
                let id = id.clone();
                let delta = self.event(
                    "response.output_text.delta",
                    json!({"item_id": id, "output_index": index, "content_index": 0,
                           "delta": t, "logprobs": []}),
                );
                events.push(delta);
            }
            Part::Call {
                id: call_id,
                name,
                arguments,
                ..
            } => {
                self.close_text(events);
                let called = self.tools.called(&name, arguments);
                self.call(&call_id, called, events);
            }
        }
    }

    /// The events of a call: its item opened, its arguments (or a custom tool's input) in one
    /// delta and then whole, and its item done.
    fn call(&mut self, call_id: &str, called: Called, events: &mut Vec<Value>) {
        let index = self.items.len();
        let (id, done, field, kind, whole) = match called {
            Called::Function {
                name,
                namespace,
                arguments,
            } => {
                let id = format!("fc_{call_id}");
                let mut done = json!({"type": "function_call", "id": id, "call_id": call_id,
                                      "name": name, "arguments": arguments,
                                      "status": "completed"});
                if let Some(ns) = namespace {
                    done["namespace"] = json!(ns);
                }
                let whole = json!({"item_id": id, "output_index": index, "name": name,
                                   "arguments": arguments});
                (
                    id,
                    done,
                    "arguments",
                    "response.function_call_arguments",
                    whole,
                )
            }
            Called::Custom { name, input } => {
                let id = format!("ctc_{call_id}");
                let done = json!({"type": "custom_tool_call", "id": id, "call_id": call_id,
                                  "name": name, "input": input, "status": "completed"});
                let whole = json!({"item_id": id, "output_index": index, "input": input});
                (id, done, "input", "response.custom_tool_call_input", whole)
            }
        };
        let mut open = done.clone();
        open[field] = json!("");
        open["status"] = json!("in_progress");
        let added = self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": open}),
        );
        let delta = self.event(
            &format!("{kind}.delta"),
            json!({"item_id": id, "output_index": index, "delta": done[field]}),
        );
        let whole = self.event(&format!("{kind}.done"), whole);
        let item_done = self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": done}),
        );
        events.extend([added, delta, whole, item_done]);
        self.items.push(done);
    }

    fn close_reasoning(&mut self, events: &mut Vec<Value>) {
        let Some((id, text)) = self.reasoning.take() else {
            return;
        };
        let index = self.items.len();
        let item = reasoning_item(&id, "completed", &text);
        let text_done = self.event(
            "response.reasoning_text.done",
            json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
        );
        let item_done = self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
        events.extend([text_done, item_done]);
        self.items.push(item);
    }

    fn close_text(&mut self, events: &mut Vec<Value>) {
        let Some((id, text)) = self.text.take() else {
            return;
        };
        let index = self.items.len();
        let item = message_item(&id, "completed", json!([output_text(&text)]));
        let text_done = self.event(
            "response.output_text.done",
            json!({"item_id": id, "output_index": index, "content_index": 0, "text": text,
                   "logprobs": []}),
        );
        let part_done = self.event(
            "response.content_part.done",
            json!({"item_id": id, "output_index": index, "content_index": 0,
                   "part": output_text(&text)}),
        );
        let item_done = self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
        events.extend([text_done, part_done, item_done]);
        self.items.push(item);
    }

    /// The response object as it stands: in progress until the last frame, then whole.
    pub(super) fn response(&self) -> Value {
        let (status, incomplete, usage) =
            self.end
                .clone()
                .unwrap_or(("in_progress", Value::Null, Value::Null));
        let or = |k: &str, default: Value| match &self.echo.get(k) {
            None | Some(Value::Null) => default,
            Some(v) => (*v).clone(),
        };
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": null,
            "incomplete_details": incomplete,
            "instructions": or("instructions", Value::Null),
            "max_output_tokens": or("max_output_tokens", Value::Null),
            "model": self.model,
            "output": self.items,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": null,
            "reasoning": {"effort": null, "summary": null},
            "store": false,
            "temperature": or("temperature", json!(1.0)),
            "text": or("text", json!({"format": {"type": "text"}})),
            "tool_choice": or("tool_choice", json!("auto")),
            "tools": or("tools", json!([])),
            "top_p": or("top_p", json!(1.0)),
            "truncation": "disabled",
            "usage": usage,
            "user": or("user", Value::Null),
            "metadata": or("metadata", json!({})),
        })
    }
}

impl Events for Transcript {
    fn frame(&mut self, f: &pb::GenerateResponse) -> Vec<Value> {
        self.events(f)
    }

    fn finished(&self) -> bool {
        self.end.is_some()
    }

    fn error(&mut self, e: &ApiError) -> Value {
        let e = &e.body_in(Shape::OpenAi)["error"];
        let fields = json!({"code": e["code"], "message": e["message"], "param": e["param"]});
        self.event("error", fields)
    }
}

fn message_item(id: &str, status: &str, content: Value) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": content})
}

/// A reasoning item: the reasoning whole as its `content` (no summary is made).
fn reasoning_item(id: &str, status: &str, text: &str) -> Value {
    let content = match text {
        "" => json!([]),
        t => json!([{"type": "reasoning_text", "text": t}]),
    };
    json!({"type": "reasoning", "id": id, "status": status, "summary": [], "content": content})
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}
