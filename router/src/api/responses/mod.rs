//! OpenAI's Responses API, as the `openai` package, the OpenAI Agents SDK and Codex use it:
//! `POST /v1/responses`, with `stream`, served stateless (`request` says what each key becomes,
//! and what is refused or accepted and ignored).
//!
//! A request becomes a `tandem.v1` `GenerateRequest` and starts through
//! [`crate::api::http::Call`], as the other HTTP APIs' do; errors are OpenAI error objects. A
//! stream opens as soon as the request is admitted (`response.created`,
//! `response.in_progress`); a failure after that is an `error` event.

mod request;
mod response;
mod tools;

pub(crate) use crate::api::responses::request::parse;

use axum::Extension;
use axum::Json;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::KeepAlive;
use axum::response::{IntoResponse, Response};

use crate::api::http::error::ApiError;
use crate::api::http::reply::Reply;
use crate::api::http::{
    Body, DEFAULT_MAX_TOKENS, asked_model, body_bytes, event_stream, gather, with_request_id,
};
use crate::api::responses::response::Transcript;
use crate::auth::Principal;
use crate::dispatch::GenerationService;

pub(crate) async fn responses(
    State(api): State<GenerationService>,
    Extension(principal): Extension<Principal>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let result = match body_bytes(&api, body) {
        Ok(body) => run(api, &principal, &headers, &body).await,
        Err(e) => Err(e),
    };
    result.unwrap_or_else(IntoResponse::into_response)
}

async fn run(
    api: GenerationService,
    principal: &Principal,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let front = api.frontend(&asked_model(body))?;
    let parsed = parse(&front.model_name, headers, body, &api.sampling_defaults)?;
    let request = &parsed.call.request;
    let request_id = request.request_id.clone();
    let reply = Reply::new(&front.tokenizer, request, parsed.parallel_tool_calls, 0);
    let mut transcript = Transcript::new(
        &request_id,
        &front.model_name,
        parsed.echo,
        parsed.parallel_tool_calls,
        reply,
        parsed.tools,
    );
    let mut frames = parsed
        .call
        .start(&api, principal, DEFAULT_MAX_TOKENS)
        .await?
        .frames;
    let response = if parsed.stream {
        let opening = transcript.start();
        event_stream(opening, frames, transcript, KeepAlive::default())
    } else {
        gather(&mut transcript, &mut frames).await?;
        Json(transcript.response()).into_response()
    };
    Ok(parsed.dropped.mark(with_request_id(response, &request_id)))
}
