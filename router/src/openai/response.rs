//! Response bodies and the SSE stream: a whole completion, or its chunks, in OpenAI's shapes.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event, KeepAlive, Sse};
use futures::{Stream, StreamExt};
use serde_json::{Value, json};
use tandem_proto::v1 as pb;

use super::{ApiError, Kind};
use crate::service::GenerateStream;

fn usage(u: Option<&pb::Usage>) -> Value {
    let u = u.cloned().unwrap_or_default();
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

fn finish_reason(code: i32) -> Value {
    match pb::FinishReason::try_from(code) {
        Ok(pb::FinishReason::Stop) => json!("stop"),
        Ok(pb::FinishReason::Length) => json!("length"),
        Ok(pb::FinishReason::Cancelled) => json!("cancelled"),
        _ => Value::Null,
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

    /// The one choice of a chunk (`streaming`) or of a whole answer.
    fn choice(&self, text: &str, finish: Value, streaming: bool) -> Value {
        let mut choice = json!({"index": 0, "logprobs": null, "finish_reason": finish});
        match (self.kind, streaming) {
            (Kind::Chat, true) if text.is_empty() => choice["delta"] = json!({}),
            (Kind::Chat, true) => choice["delta"] = json!({"content": text}),
            (Kind::Chat, false) => {
                choice["message"] = json!({"role": "assistant", "content": text});
            }
            (Kind::Completion, _) => choice["text"] = json!(text),
        }
        choice
    }

    /// A streamed chunk carrying `text`, and the finish reason on the last one.
    fn chunk(&self, text: &str, finish: Value) -> Value {
        self.wrap(true, json!([self.choice(text, finish, true)]))
    }

    /// The whole answer of a request that did not stream.
    pub(super) fn complete(&self, text: &str, last: &pb::GenerateResponse) -> Value {
        let choice = self.choice(text, finish_reason(last.finish_reason), false);
        let mut body = self.wrap(false, json!([choice]));
        body["usage"] = usage(last.usage.as_ref());
        body
    }
}

/// The SSE stream: a role chunk (chat), a chunk per frame with text, a last chunk with the
/// finish reason, the usage chunk if asked for, then `[DONE]`. An error after the first frame
/// is sent as an `{"error": ...}` event and ends the stream without `[DONE]`.
pub(super) fn sse(
    envelope: Envelope,
    first: pb::GenerateResponse,
    frames: GenerateStream,
    include_usage: bool,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let event = |v: Value| Ok::<_, Infallible>(Event::default().data(v.to_string()));
    let with_usage = move |mut v: Value| {
        if include_usage {
            v["usage"] = Value::Null;
        }
        v
    };
    let opening = (envelope.kind == Kind::Chat).then(|| {
        event(with_usage(envelope.wrap(
            true,
            json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
        )))
    });
    let body = futures::stream::once(async move { Ok(first) })
        .chain(frames)
        .scan(false, move |done, item| {
            if *done {
                return futures::future::ready(None);
            }
            let events: Vec<Result<Event, Infallible>> = match item {
                Ok(f) if f.finish_reason == pb::FinishReason::Unspecified as i32 => {
                    if f.text.is_empty() {
                        Vec::new()
                    } else {
                        vec![event(with_usage(envelope.chunk(&f.text, Value::Null)))]
                    }
                }
                Ok(f) => {
                    *done = true;
                    let mut out = Vec::new();
                    if !f.text.is_empty() {
                        out.push(event(with_usage(envelope.chunk(&f.text, Value::Null))));
                    }
                    out.push(event(with_usage(
                        envelope.chunk("", finish_reason(f.finish_reason)),
                    )));
                    if include_usage {
                        let mut v = envelope.wrap(true, json!([]));
                        v["usage"] = usage(f.usage.as_ref());
                        out.push(event(v));
                    }
                    out.push(Ok(Event::default().data("[DONE]")));
                    out
                }
                Err(s) => {
                    *done = true;
                    vec![event(ApiError::from_status(&s).body())]
                }
            };
            futures::future::ready(Some(futures::stream::iter(events)))
        })
        .flatten();
    let stream = futures::stream::iter(opening).chain(body);
    Sse::new(stream).keep_alive(KeepAlive::default())
}
