//! What the HTTP APIs share beneath their protocols: errors ([`error`]), the server tools a
//! request is served without ([`dropped`]), readers of a JSON
//! body's fields ([`fields`]), a reply split into text and tool calls ([`reply`]), the one way
//! a protocol adapter starts a generation ([`Call::start`]), and the named-event stream two of
//! them answer with ([`Events`]): each adapter (OpenAI's chat and
//! completions, Anthropic's Messages, OpenAI's Responses) turns its body into one `tandem.v1`
//! `GenerateRequest` and starts it here, so that limits, keys, idempotency, affinity, failover
//! and metrics are the same for all of them.

pub(crate) mod dropped;
pub(crate) mod error;
pub(crate) mod fields;
pub(crate) mod reply;

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::rejection::BytesRejection;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{Map, Value};
use tandem_proto::policy::{self, Bound};
use tandem_proto::v1 as pb;

use crate::api::http::error::ApiError;
use crate::api::http::fields::{header_str, in_bound, unsigned};
use crate::api::http::reply::next_frame;
use crate::auth::Principal;
use crate::config::SamplingDefaults;
use crate::dispatch::{GenerateStream, GenerationService, Started};
use crate::ids::fresh_id;

/// Most tokens a request may generate when it sets no `max_tokens` (less if the context ends
/// sooner). The decode node reserves KV for the worst case, so "the whole context" by default
/// would let a handful of requests hold the pool.
pub const DEFAULT_MAX_TOKENS: u32 = 1024;

/// The model a request body names: its `model` string, or `""` when it has none (a body that
/// is not a JSON object, or a `model` that is not a string, is refused by the adapter's parse,
/// with the protocol's own message). Read before the body is parsed, to find the model whose
/// tokenizer and limits the parse uses.
pub(crate) fn asked_model(body: &[u8]) -> String {
    #[derive(serde::Deserialize)]
    struct Asked {
        model: Option<Value>,
    }
    match serde_json::from_slice::<Asked>(body) {
        Ok(Asked {
            model: Some(Value::String(m)),
        }) => m,
        _ => String::new(),
    }
}

/// A reply shown as a stream of named events (Anthropic's Messages, OpenAI's Responses), each
/// event's data an object whose `type` is its name.
pub(crate) trait Events: Send + 'static {
    /// The events frame `f` makes.
    fn frame(&mut self, f: &pb::GenerateResponse) -> Vec<Value>;
    /// Whether the reply's last frame came.
    fn finished(&self) -> bool;
    /// The event a failure is, which ends the stream.
    fn error(&mut self, e: &ApiError) -> Value;
}

/// The SSE stream of a reply: `opening`, then `events` of each frame of `frames` until the
/// last, or a failure's event; quiet stretches filled by `keep_alive`.
pub(crate) fn event_stream(
    opening: Vec<Value>,
    frames: GenerateStream,
    events: impl Events,
    keep_alive: KeepAlive,
) -> Response {
    let sse = |v: Value| {
        let name = v["type"].as_str().unwrap_or("message").to_string();
        Ok::<_, Infallible>(Event::default().event(name).data(v.to_string()))
    };
    let body = frames
        .scan(Some(events), move |state, item| {
            let Some(events) = state else {
                return futures::future::ready(None);
            };
            let (out, ends) = match item {
                Ok(f) => (events.frame(&f), false),
                Err(s) => (vec![events.error(&ApiError::from_status(&s))], true),
            };
            if ends || events.finished() {
                *state = None;
            }
            futures::future::ready(Some(futures::stream::iter(out.into_iter().map(sse))))
        })
        .flatten();
    let opening = futures::stream::iter(opening.into_iter().map(sse));
    Sse::new(opening.chain(body))
        .keep_alive(keep_alive)
        .into_response()
}

/// Feeds `events` every frame of `frames` up to the reply's last: a request that does not
/// stream.
pub(crate) async fn gather(
    events: &mut impl Events,
    frames: &mut GenerateStream,
) -> Result<(), ApiError> {
    while !events.finished() {
        events.frame(&next_frame(frames).await?);
    }
    Ok(())
}

/// `response` with the request's id in `x-request-id`, as every HTTP API answers.
pub(crate) fn with_request_id(mut response: Response, request_id: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(request_id) {
        response.headers_mut().insert("x-request-id", v);
    }
    response
}

/// A request's body as axum hands it over: its bytes, or why they could not be read.
pub(crate) type Body = Result<axum::body::Bytes, BytesRejection>;

/// The body's bytes, or the error its rejection is (413 over the router's limit).
pub(crate) fn body_bytes(
    api: &GenerationService,
    body: Body,
) -> Result<axum::body::Bytes, ApiError> {
    body.map_err(|rejection| {
        ApiError::new(
            rejection.status(),
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                format!(
                    "the request body is over the limit of {} bytes",
                    api.limits.http_body_bytes
                )
            } else {
                rejection.body_text()
            },
            "invalid_request_error",
        )
    })
}

/// A body as a JSON object.
pub(crate) fn json_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            format!("the body is not a JSON object: {e}"),
            "invalid_request_error",
        )
    })
}

/// The first key of `body` that is present (not null) and not in `known`: what a protocol
/// adapter refuses by name.
pub(crate) fn unknown_key<'a>(body: &'a Map<String, Value>, known: &[&str]) -> Option<&'a str> {
    body.iter()
        .find(|(k, v)| !v.is_null() && !known.contains(&k.as_str()))
        .map(|(k, _)| k.as_str())
}

/// Refuses the first key of a definition `t` (`param` names it) that is not in `known`, naming
/// `what` it is not: the tool definitions' shared check.
pub(crate) fn only_keys(
    t: &Map<String, Value>,
    param: &str,
    known: &[&str],
    what: &str,
) -> Result<(), ApiError> {
    match unknown_key(t, known) {
        Some(k) => Err(ApiError::unsupported(
            &format!("{param}.{k}"),
            &format!("not a {what}'s key"),
        )),
        None => Ok(()),
    }
}

/// Checks that `body` names its model with a string. The name was resolved before the body was
/// parsed ([`asked_model`], [`GenerationService::frontend`]: one the cluster does not serve is
/// 404 `model_not_found` there), so any name that reaches here is one the model answers to.
pub(crate) fn check_model(body: &Map<String, Value>) -> Result<(), ApiError> {
    match body.get("model") {
        Some(Value::String(_)) => Ok(()),
        _ => Err(ApiError::invalid("model", "'model' must be a string")),
    }
}

/// The sampling fields the HTTP APIs share (`temperature` within the API's `temperature`
/// bound, `top_p`, `top_k`), each unset one the server's default, else the APIs' own
/// (temperature and top_p 1, no top-k).
pub(crate) fn base_sampling(
    body: &Map<String, Value>,
    defaults: &SamplingDefaults,
    temperature: Bound,
) -> Result<pb::SamplingParams, ApiError> {
    Ok(pb::SamplingParams {
        temperature: in_bound(body, "temperature", temperature)?
            .or(defaults.temperature)
            .unwrap_or(1.0),
        top_k: unsigned(body, "top_k")?
            .map(|k| u32::try_from(k).unwrap_or(u32::MAX))
            .or(defaults.top_k)
            .unwrap_or(0),
        top_p: Some(
            (in_bound(body, "top_p", policy::TOP_P)?)
                .or(defaults.top_p)
                .unwrap_or(1.0),
        ),
        min_p: defaults.min_p,
        ..Default::default()
    })
}

/// A string field, if present and not null.
pub(crate) fn string(body: &Map<String, Value>, key: &str) -> Result<Option<String>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(u)) => Ok(Some(u.clone())),
        Some(_) => Err(ApiError::invalid(key, format!("'{key}' must be a string"))),
    }
}

/// A request as a protocol adapter made it, with what the HTTP layer adds: its id (the
/// client's `x-request-id`, else a fresh one), its priority class (`x-priority`), its TTFT
/// target (`x-slo-ttft-ms`) and its deadline: `x-timeout-ms`, else
/// `x-stainless-timeout` (seconds: how long the official OpenAI and Anthropic clients wait,
/// which they send on every request; Claude Code's is 600 s), else the router's timeout.
#[derive(Debug)]
pub(crate) struct Call {
    pub request: pb::GenerateRequest,
    pub deadline: Option<tokio::time::Instant>,
}

impl Call {
    pub(crate) fn new(
        headers: &HeaderMap,
        mut request: pb::GenerateRequest,
    ) -> Result<Self, ApiError> {
        request.request_id = header_str(headers, "x-request-id")
            .map(str::to_string)
            .unwrap_or_else(fresh_id);
        if let Some(priority) = header_str(headers, "x-priority") {
            request.priority = priority.to_string();
        }
        if let Some(ms) = headers.get("x-slo-ttft-ms") {
            let ms = ms.to_str().unwrap_or("unreadable");
            request.ttft_target_ms = crate::dispatch::prepare::ttft_target_ms(ms)?;
        }
        let timeout = match header_str(headers, "x-timeout-ms") {
            Some(ms) => Some(Duration::from_millis(ms.parse().map_err(|_| {
                ApiError::invalid("x-timeout-ms", "the x-timeout-ms header must be an integer")
            })?)),
            // The clients' own bound: a value that does not parse is theirs to get wrong, and
            // the router's timeout holds then.
            None => header_str(headers, "x-stainless-timeout")
                .and_then(|s| s.trim().parse::<f64>().ok())
                .filter(|s| s.is_finite() && *s > 0.0 && *s < 86_400.0)
                .map(Duration::from_secs_f64),
        };
        Ok(Self {
            request,
            deadline: timeout.map(|t| tokio::time::Instant::now() + t),
        })
    }

    /// Starts the generation; `default_max_tokens` is what an unset `max_tokens` (0) becomes,
    /// less where the context ends sooner.
    pub(crate) async fn start(
        self,
        api: &GenerationService,
        principal: &Principal,
        default_max_tokens: u32,
    ) -> Result<Started, ApiError> {
        Ok(api
            .start(
                self.request,
                principal,
                self.deadline,
                Some(default_max_tokens),
            )
            .await?)
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    #[test]
    fn the_deadline_is_the_clients_own_timeout() {
        let within = |headers: &HeaderMap| {
            let call = Call::new(headers, pb::GenerateRequest::default()).expect("valid");
            call.deadline
                .map(|d| (d - tokio::time::Instant::now()).as_secs_f64().round())
        };
        let mut headers = HeaderMap::new();
        assert_eq!(within(&headers), None);
        headers.insert("x-stainless-timeout", HeaderValue::from_static("600"));
        assert_eq!(within(&headers), Some(600.0));
        headers.insert("x-timeout-ms", HeaderValue::from_static("2000"));
        assert_eq!(within(&headers), Some(2.0));
        let mut odd = HeaderMap::new();
        odd.insert("x-stainless-timeout", HeaderValue::from_static("never"));
        assert_eq!(within(&odd), None);
    }
}
