//! Anthropic's Messages API, as the `anthropic` package and Claude Code use it:
//! `POST /v1/messages` (with `stream`) and `POST /v1/messages/count_tokens`.
//!
//! A request becomes a `tandem.v1` `GenerateRequest` (`request` says what each key becomes and
//! which are accepted and ignored) and starts through [`crate::api::http::Call`], as the OpenAI
//! APIs' do. Errors are Anthropic's `{"type": "error", "error": {"type", "message"}}` with the
//! status the same failure has on the other APIs.
//!
//! A stream opens as soon as the request is admitted, with `message_start` (its usage holds
//! the prompt's length), then `ping` events every [`PING_EVERY`] while the prompt is computed
//! and whenever else the stream is quiet; the last event's usage (`message_delta`) splits the
//! input into tokens computed and tokens read from the prefix cache. A failure after the stream
//! opened is an `error` event, as on Anthropic's API.

mod messages;
pub(crate) mod request;
mod response;

pub(crate) use crate::api::anthropic::request::{Endpoint, parse};

use std::time::Duration;

use axum::Extension;
use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event, KeepAlive};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::api::anthropic::response::Message;
use crate::api::http::error::{ApiError, Shape};
use crate::api::http::reply::Reply;
use crate::api::http::{Body, asked_model, body_bytes, event_stream, gather, with_request_id};
use crate::auth::Principal;
use crate::dispatch::GenerationService;

/// How often a quiet stream sends `ping`.
pub const PING_EVERY: Duration = Duration::from_secs(5);

pub(crate) async fn messages(
    State(api): State<GenerationService>,
    Extension(principal): Extension<Principal>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let result = match body_bytes(&api, body) {
        Ok(body) => run(api, &principal, &headers, &body).await,
        Err(e) => Err(e),
    };
    result.unwrap_or_else(|e| e.respond(Shape::Anthropic))
}

async fn run(
    api: GenerationService,
    principal: &Principal,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let front = api.frontend(&asked(body))?;
    let parsed = parse(
        Endpoint::Messages,
        &front.model_name,
        headers,
        body,
        &api.sampling_defaults,
    )?;
    let request = &parsed.call.request;
    let request_id = request.request_id.clone();
    let reply = Reply::new(&front.tokenizer, request, parsed.parallel_tool_calls, 0);
    let stops = request
        .sampling
        .as_ref()
        .map(|s| s.stop.clone())
        .unwrap_or_default();
    let started = parsed
        .call
        .start(&api, principal, parsed.max_tokens)
        .await?;
    let mut message = Message::new(&request_id, front, reply, stops, started.prompt_tokens);
    let mut frames = started.frames;
    let mut response = if parsed.stream {
        let ping = Event::default()
            .event("ping")
            .data(json!({"type": "ping"}).to_string());
        let opening = vec![message.start()];
        let keep_alive = KeepAlive::new().interval(PING_EVERY).event(ping);
        event_stream(opening, frames, message, keep_alive)
    } else {
        gather(&mut message, &mut frames).await?;
        Json(message.whole()).into_response()
    };
    // Anthropic's API names its request ids `request-id`.
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert("request-id", v);
    }
    Ok(parsed.dropped.mark(with_request_id(response, &request_id)))
}

/// The model a Messages body asks for ([`request::requested`]).
fn asked(body: &[u8]) -> String {
    request::requested(&asked_model(body)).to_string()
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": N}`, the prompt's length as a
/// `/v1/messages` request with the same messages, system and tools would have it.
pub(crate) async fn count_tokens(
    State(api): State<GenerationService>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let count = async {
        let body = body_bytes(&api, body)?;
        let front = api.frontend(&asked(&body))?;
        let parsed = parse(
            Endpoint::CountTokens,
            &front.model_name,
            &headers,
            &body,
            &api.sampling_defaults,
        )?;
        Ok::<_, ApiError>(api.count_tokens(parsed.call.request).await?)
    };
    match count.await {
        Ok(n) => Json(json!({"input_tokens": n})).into_response(),
        Err(e) => e.respond(Shape::Anthropic),
    }
}
