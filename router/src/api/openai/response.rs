//! Response bodies and the SSE stream: a whole completion, or its chunks, in OpenAI's shapes.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event, KeepAlive, Sse};
use futures::{Stream, StreamExt};
use serde_json::{Value, json};
use tandem_proto::v1 as pb;

use crate::api::http::error::ApiError;
use crate::api::http::reply::{Part, Reply};
use crate::api::openai::request::{Kind, StreamUsage};
use crate::cluster::frontend::Frontend;
use crate::dispatch::GenerateStream;
use crate::dispatch::log::is_last;

fn usage(u: &pb::Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// The finish reason; a reply that ended on its own after calling tools ends with
/// `tool_calls`.
fn finish_reason(code: i32, called: bool) -> Value {
    match pb::FinishReason::try_from(code) {
        Ok(pb::FinishReason::Stop) if called => json!("tool_calls"),
        Ok(pb::FinishReason::Stop) => json!("stop"),
        Ok(pb::FinishReason::Length) => json!("length"),
        Ok(pb::FinishReason::Cancelled) => json!("cancelled"),
        _ => Value::Null,
    }
}

/// A tool call in OpenAI's shape, with its index among the reply's calls (a chunk's form).
fn call_json(part: &Part) -> Option<Value> {
    match part {
        Part::Reasoning(_) | Part::Text(_) => None,
        Part::Call {
            index,
            id,
            name,
            arguments,
        } => Some(json!({
            "index": index,
            "id": id,
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        })),
    }
}

/// OpenAI's stand-in for a log-probability of -inf (JSON has no infinities).
const NEG_INF_LOGPROB: f32 = -9999.0;

/// The log-probabilities of a reply's tokens in the endpoint's shape: chat's `content` entries
/// (`token`, `logprob`, `bytes`, `top_logprobs`), completions' `tokens`, `token_logprobs`,
/// `top_logprobs` and `text_offset` (characters into the reply).
pub(super) struct Logprobs {
    front: Arc<Frontend>,
    kind: Kind,
    offset: usize,
}

impl Logprobs {
    pub(super) fn new(front: Arc<Frontend>, kind: Kind) -> Self {
        Self {
            front,
            kind,
            offset: 0,
        }
    }

    /// One frame's tokens.
    pub(super) fn frame(&mut self, f: &pb::GenerateResponse) -> Value {
        let tokenizer = &self.front.tokenizer;
        let text = |id: u32| String::from_utf8_lossy(tokenizer.token_bytes(id)).into_owned();
        let value = |lp: f32| if lp.is_finite() { lp } else { NEG_INF_LOGPROB };
        let pairs = f.token_ids.iter().zip(&f.logprobs);
        match self.kind {
            Kind::Chat => {
                let entry = |id: u32, lp: f32| {
                    json!({
                        "token": text(id),
                        "logprob": value(lp),
                        "bytes": tokenizer.token_bytes(id),
                    })
                };
                let content: Vec<Value> = pairs
                    .map(|(&id, l)| {
                        let mut e = entry(id, l.logprob);
                        e["top_logprobs"] = l
                            .top_ids
                            .iter()
                            .zip(&l.top_logprobs)
                            .map(|(&t, &lp)| entry(t, lp))
                            .collect();
                        e
                    })
                    .collect();
                json!({"content": content})
            }
            Kind::Completion => {
                let (mut tokens, mut logprobs, mut tops, mut offsets) =
                    (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                for (&id, l) in pairs {
                    let t = text(id);
                    offsets.push(self.offset);
                    self.offset += t.chars().count();
                    tokens.push(t);
                    logprobs.push(value(l.logprob));
                    let top: serde_json::Map<String, Value> = l
                        .top_ids
                        .iter()
                        .zip(&l.top_logprobs)
                        .map(|(&t, &lp)| (text(t), json!(value(lp))))
                        .collect();
                    tops.push(top);
                }
                json!({
                    "tokens": tokens,
                    "token_logprobs": logprobs,
                    "top_logprobs": tops,
                    "text_offset": offsets,
                })
            }
        }
    }
}

/// Appends `more`'s arrays to `all`'s (frames' log-probabilities into a whole reply's).
fn extend_arrays(all: &mut Value, more: Value) {
    let Value::Object(more) = more else { return };
    for (k, v) in more {
        match (all.get_mut(&k), v) {
            (Some(Value::Array(a)), Value::Array(b)) => a.extend(b),
            (_, v) => all[&k] = v,
        }
    }
}

/// One of a request's choices as its frames arrive: its reply's parts and log-probabilities,
/// and, for a whole completion, all of them so far.
pub(super) struct Choice {
    reply: Reply,
    logprobs: Option<Logprobs>,
    parts: Vec<Part>,
    all_logprobs: Option<Value>,
    finish: Option<i32>,
}

impl Choice {
    pub(super) fn new(reply: Reply, logprobs: Option<Logprobs>) -> Self {
        Self {
            reply,
            logprobs,
            parts: Vec::new(),
            all_logprobs: None,
            finish: None,
        }
    }

    /// What frame `f` completes: its parts (with those still held, on the last frame) and its
    /// log-probabilities.
    fn frame(&mut self, f: &pb::GenerateResponse) -> (Vec<Part>, Option<Value>) {
        let logprobs = self.logprobs.as_mut().map(|l| l.frame(f));
        let parts = self.reply.frame(f);
        if is_last(f) {
            self.finish = Some(f.finish_reason);
        }
        (parts, logprobs)
    }

    /// Keeps frame `f`'s parts and log-probabilities for the whole completion.
    fn gather(&mut self, f: &pb::GenerateResponse) {
        let (parts, logprobs) = self.frame(f);
        self.parts.extend(parts);
        if let Some(l) = logprobs {
            match &mut self.all_logprobs {
                None => self.all_logprobs = Some(l),
                Some(all) => extend_arrays(all, l),
            }
        }
    }
}

/// A request's choices, fed its frames in the order they come (the choices' interleave).
pub(super) struct Replies {
    choices: Vec<Choice>,
    /// Choices whose last frame has not come.
    open: usize,
    /// The prompt once, as the first choice saw it; every finished choice's completion tokens.
    usage: pb::Usage,
    /// The prompt's tokens and every choice's tokens so far.
    so_far: pb::Usage,
}

impl Replies {
    pub(super) fn new(choices: Vec<Choice>) -> Self {
        Self {
            open: choices.len(),
            choices,
            usage: pb::Usage::default(),
            so_far: pb::Usage::default(),
        }
    }

    /// Whether every choice has had its last frame.
    pub(super) fn done(&self) -> bool {
        self.open == 0
    }

    /// The choice frame `f` belongs to, counting its tokens, and its usage on its last frame.
    fn choice(&mut self, f: &pb::GenerateResponse) -> Result<&mut Choice, ApiError> {
        let choice = self.choices.get_mut(f.choice as usize).ok_or_else(|| {
            ApiError::from_code(
                tonic::Code::Internal,
                format!("a frame of choice {}, which was not asked for", f.choice),
                None,
            )
        })?;
        if f.prompt_tokens > 0 {
            self.so_far.prompt_tokens = f.prompt_tokens;
        }
        self.so_far.completion_tokens += f.token_ids.len() as u32;
        if is_last(f) {
            self.open = self.open.saturating_sub(1);
            let u = f.usage.unwrap_or_default();
            let completion = self.usage.completion_tokens + u.completion_tokens;
            if f.choice == 0 {
                self.usage = u;
            }
            self.usage.completion_tokens = completion;
        }
        Ok(choice)
    }

    /// Keeps frame `f` for the whole completion.
    pub(super) fn gather(&mut self, f: &pb::GenerateResponse) -> Result<(), ApiError> {
        self.choice(f)?.gather(f);
        Ok(())
    }
}

/// What every response and chunk of one request shares.
#[derive(Debug, Clone)]
pub(super) struct Envelope {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
}

impl Envelope {
    pub(super) fn new(kind: Kind, request_id: &str, model: &str) -> Self {
        Self {
            kind,
            id: format!("{}{request_id}", kind.id_prefix()),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: model.to_string(),
        }
    }

    fn wrap(&self, streaming: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.kind.object(streaming),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    /// A streamed chunk of choice `index`: `delta` (chat) or `text` (completions), the
    /// log-probabilities of the frame it starts, and the finish reason on the last one.
    fn chunk(
        &self,
        index: u32,
        part: Option<&Part>,
        logprobs: Option<Value>,
        finish: Value,
    ) -> Value {
        let mut choice = json!({"index": index, "logprobs": logprobs, "finish_reason": finish});
        match (self.kind, part) {
            (Kind::Chat, None) => choice["delta"] = json!({}),
            (Kind::Chat, Some(Part::Text(t))) => choice["delta"] = json!({"content": t}),
            // vLLM's and llama-server's field for a thinking model's reasoning.
            (Kind::Chat, Some(Part::Reasoning(t))) => {
                choice["delta"] = json!({"reasoning_content": t})
            }
            (Kind::Chat, Some(call)) => choice["delta"] = json!({"tool_calls": [call_json(call)]}),
            (Kind::Completion, Some(Part::Text(t))) => choice["text"] = json!(t),
            (Kind::Completion, _) => choice["text"] = json!(""),
        }
        self.wrap(true, json!([choice]))
    }

    /// A frame's chunks: one a part, the frame's log-probabilities on the first (on a chunk of
    /// their own if the frame completed no part), and the finish reason on a chunk of its own
    /// after the choice's last frame.
    fn frame_chunks(&self, choice: &mut Choice, f: &pb::GenerateResponse) -> Vec<Value> {
        let (parts, mut logprobs) = choice.frame(f);
        let mut out: Vec<Value> = parts
            .iter()
            .map(|p| self.chunk(f.choice, Some(p), logprobs.take(), Value::Null))
            .collect();
        if let Some(l) = logprobs {
            out.push(self.chunk(f.choice, None, Some(l), Value::Null));
        }
        if let Some(finish) = choice.finish {
            let finish = finish_reason(finish, choice.reply.called());
            out.push(self.chunk(f.choice, None, None, finish));
        }
        out
    }

    /// The whole answer of a request that did not stream, from its choices' gathered frames.
    pub(super) fn complete(&self, replies: Replies) -> Value {
        let choices: Vec<Value> = replies
            .choices
            .into_iter()
            .enumerate()
            .map(|(i, c)| self.whole_choice(i, c))
            .collect();
        let mut body = self.wrap(false, json!(choices));
        body["usage"] = usage(&replies.usage);
        body
    }

    fn whole_choice(&self, index: usize, c: Choice) -> Value {
        let Choice {
            reply,
            parts,
            all_logprobs,
            finish,
            ..
        } = c;
        let text: String = parts
            .iter()
            .filter_map(|p| match p {
                Part::Text(t) => Some(t.as_str()),
                Part::Reasoning(_) | Part::Call { .. } => None,
            })
            .collect();
        let reasoning: String = parts
            .iter()
            .filter_map(|p| match p {
                Part::Reasoning(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        let finish = finish_reason(finish.unwrap_or_default(), reply.called());
        let mut choice = json!({"index": index, "logprobs": all_logprobs, "finish_reason": finish});
        match self.kind {
            Kind::Chat => {
                let calls: Vec<Value> = parts.iter().filter_map(call_json).collect();
                let mut message = if calls.is_empty() {
                    json!({"role": "assistant", "content": text})
                } else {
                    let calls: Vec<Value> = calls
                        .into_iter()
                        .map(|mut c| {
                            c.as_object_mut().map(|o| o.remove("index"));
                            c
                        })
                        .collect();
                    json!({
                        "role": "assistant",
                        "content": (!text.is_empty()).then_some(text),
                        "tool_calls": calls,
                    })
                };
                if !reasoning.is_empty() {
                    message["reasoning_content"] = json!(reasoning);
                }
                choice["message"] = message;
            }
            Kind::Completion => choice["text"] = json!(text),
        }
        choice
    }
}

/// The SSE stream: a role chunk per choice (chat), a chunk per frame with text, a chunk with
/// each choice's finish reason after its last frame, the usage chunk if asked for, then
/// `[DONE]`. An error after the first frame is sent as an `{"error": ...}` event and ends the
/// stream without `[DONE]`.
pub(super) fn sse(
    envelope: Envelope,
    mut replies: Replies,
    first: pb::GenerateResponse,
    frames: GenerateStream,
    stream_usage: StreamUsage,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let event = |v: Value| Ok::<_, Infallible>(Event::default().data(v.to_string()));
    let stamp = move |mut v: Value, so_far: &pb::Usage| {
        match stream_usage {
            StreamUsage::None => {}
            StreamUsage::Last => v["usage"] = Value::Null,
            StreamUsage::Continuous => v["usage"] = usage(so_far),
        }
        v
    };
    replies.so_far.prompt_tokens = first.prompt_tokens;
    let opening: Vec<_> = match envelope.kind {
        Kind::Chat => (0..replies.choices.len())
            .map(|i| {
                let role = envelope.wrap(
                    true,
                    json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
                );
                event(stamp(role, &replies.so_far))
            })
            .collect(),
        Kind::Completion => Vec::new(),
    };
    let body = futures::stream::once(async move { Ok(first) })
        .chain(frames)
        .scan(Some(replies), move |state, item| {
            let Some(replies) = state else {
                return futures::future::ready(None);
            };
            let mut events = Vec::new();
            let chunks = item
                .map_err(|s| ApiError::from_status(&s))
                .and_then(|f| Ok(envelope.frame_chunks(replies.choice(&f)?, &f)));
            match chunks {
                Ok(chunks) => {
                    events.extend(chunks.into_iter().map(|c| event(stamp(c, &replies.so_far))));
                }
                Err(e) => {
                    *state = None;
                    events.push(event(e.body()));
                    return futures::future::ready(Some(futures::stream::iter(events)));
                }
            }
            if replies.done() {
                if stream_usage != StreamUsage::None {
                    let mut v = envelope.wrap(true, json!([]));
                    v["usage"] = usage(&replies.usage);
                    events.push(event(v));
                }
                events.push(Ok(Event::default().data("[DONE]")));
                *state = None;
            }
            futures::future::ready(Some(futures::stream::iter(events)))
        })
        .flatten();
    let stream = futures::stream::iter(opening).chain(body);
    Sse::new(stream).keep_alive(KeepAlive::default())
}
