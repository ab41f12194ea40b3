//! OpenAI's chat and completions APIs: `POST /v1/chat/completions` and `POST /v1/completions`,
//! both with `stream`.
//!
//! A request becomes a `tandem.v1` `GenerateRequest` and runs through the same
//! [`GenerationService::start`] as a gRPC call: the same validation, limits, admission,
//! request-id attachment (`x-request-id`), affinity (the session, [`crate::api::session`]) and
//! failover. Every parameter is either honoured or rejected by name with a 400; none is
//! ignored. Errors are OpenAI error objects with the status that matches the gRPC code. A
//! client that goes away drops the frame stream, which cancels the generation as a gRPC cancel
//! does.
//!
//! `request` parses a body, `response` shapes what goes back (a whole completion or SSE chunks).

mod chat;
mod request;
mod response;

use axum::Extension;
use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};

use crate::api::http::error::ApiError;
use crate::api::http::reply::{Reply, next_frame};
use crate::api::http::{Body, DEFAULT_MAX_TOKENS, asked_model, body_bytes, with_request_id};
use crate::auth::Principal;
use crate::dispatch::GenerationService;

pub(crate) use crate::api::openai::request::{Kind, parse};
use crate::api::openai::response::{Choice, Envelope, Logprobs, Replies, sse};

pub(crate) async fn chat(
    State(api): State<GenerationService>,
    Extension(principal): Extension<Principal>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    generate(api, Kind::Chat, &principal, headers, body).await
}

pub(crate) async fn completions(
    State(api): State<GenerationService>,
    Extension(principal): Extension<Principal>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    generate(api, Kind::Completion, &principal, headers, body).await
}

async fn generate(
    api: GenerationService,
    kind: Kind,
    principal: &Principal,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let body = match body_bytes(&api, body) {
        Ok(body) => body,
        Err(e) => return e.into_response(),
    };
    run(api, kind, principal, &headers, &body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn run(
    api: GenerationService,
    kind: Kind,
    principal: &Principal,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let front = api.frontend(&asked_model(body))?;
    let model = front.model_name.clone();
    let parsed = parse(kind, &model, headers, body, &api.sampling_defaults)?;
    let request = &parsed.call.request;
    let request_id = request.request_id.clone();
    let with_logprobs = request
        .sampling
        .as_ref()
        .is_some_and(|s| s.logprobs.is_some());
    let choices = (0..request.n.max(1))
        .map(|i| {
            let reply = Reply::new(&front.tokenizer, request, parsed.parallel_tool_calls, i);
            let logprobs = with_logprobs.then(|| Logprobs::new(front.clone(), kind));
            Choice::new(reply, logprobs)
        })
        .collect();
    let mut replies = Replies::new(choices);
    let envelope = Envelope::new(kind, &request_id, &model);
    let mut frames = parsed
        .call
        .start(&api, principal, DEFAULT_MAX_TOKENS)
        .await?
        .frames;
    // The first frame decides the status: an error before any token is an HTTP error.
    let first = next_frame(&mut frames).await?;
    let response = if parsed.stream {
        sse(envelope, replies, first, frames, parsed.stream_usage).into_response()
    } else {
        replies.gather(&first)?;
        while !replies.done() {
            replies.gather(&next_frame(&mut frames).await?)?;
        }
        Json(envelope.complete(replies)).into_response()
    };
    Ok(with_request_id(response, &request_id))
}
