//! The OpenAI-compatible HTTP API, on its own port beside gRPC: `POST /v1/chat/completions`,
//! `POST /v1/completions` (both with `stream`), `GET /v1/models` and `GET /health`.
//!
//! A request becomes a `tandem.v1` `GenerateRequest` and runs through the same
//! [`GenerationService::start`] as a gRPC call: the same validation, limits, admission,
//! request-id attachment (`x-request-id`), affinity (the session, [`crate::api::session`]) and
//! failover.
//! With a key file, `/v1` routes authenticate (`Authorization: Bearer KEY`) before the body is
//! read; `/health` is open. Every parameter is either honoured or rejected by name with a 400;
//! none is ignored. Errors are OpenAI error objects with the status that matches the gRPC code.
//! A client that goes away drops the frame stream, which cancels the generation as a gRPC
//! cancel does.
//!
//! `request` parses a body, `response` shapes what goes back (a whole completion or SSE chunks),
//! `error` makes OpenAI error objects.

mod chat;
mod error;
mod fields;
mod request;
mod response;

use axum::Extension;
use axum::Json;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use serde_json::{Value, json};
use tandem_proto::v1 as pb;
use tandem_tokenizer::{Tokenizer, ToolCallParser};
use tonic::Code;

use crate::auth::Principal;
use crate::dispatch::{GenerateStream, GenerationService};
use crate::error::Error;
use crate::ids::fresh_id;

pub(crate) use crate::api::openai::error::ApiError;
pub(crate) use crate::api::openai::request::{Kind, parse};
use crate::api::openai::response::{Choice, Envelope, Logprobs, Replies, Reply, sse};

/// Most tokens a request may generate when it sets no `max_tokens` (less if the context ends
/// sooner). The decode node reserves KV for the worst case, so "the whole context" by default
/// would let a handful of requests hold the pool.
pub const DEFAULT_MAX_TOKENS: u32 = 1024;

/// The HTTP routes, served by [`crate::run`] on the HTTP listener.
pub(crate) fn routes(service: GenerationService) -> axum::Router {
    let body_limit = service.limits.http_body_bytes;
    axum::Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route_layer(axum::middleware::from_fn_with_state(
            service.clone(),
            authenticate,
        ))
        .route("/health", get(health))
        .fallback(|| async {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "no such route",
                "invalid_request_error",
            )
        })
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(service)
}

/// Authenticates a `/v1` request from its `authorization` header before its body is read, and
/// hands the [`Principal`] to the handler.
async fn authenticate(
    State(api): State<GenerationService>,
    mut request: axum::extract::Request,
    next: Next,
) -> Response {
    let header = request
        .headers()
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes);
    match api.authenticate(header) {
        Ok(principal) => {
            request.extensions_mut().insert(principal);
            next.run(request).await
        }
        Err(e) => ApiError::from(e).into_response(),
    }
}

type Body = Result<axum::body::Bytes, BytesRejection>;

async fn chat(
    State(api): State<GenerationService>,
    Extension(principal): Extension<Principal>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    generate(api, Kind::Chat, &principal, headers, body).await
}

async fn completions(
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
    let result = match body {
        Ok(body) => run(api, kind, principal, &headers, &body).await,
        Err(rejection) => Err(ApiError::new(
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
        )),
    };
    match result {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(status = %e.status, message = %e.message, "HTTP request refused");
            e.into_response()
        }
    }
}

async fn run(
    api: GenerationService,
    kind: Kind,
    principal: &Principal,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let front = api.dispatcher.replicas.frontend().ok_or(Error::NotReady)?;
    let model = front.model_name.clone();
    let mut parsed = parse(kind, &model, headers, body, &api.sampling_defaults)?;
    if parsed.request.request_id.is_empty() {
        parsed.request.request_id = fresh_id();
    }
    let request_id = parsed.request.request_id.clone();
    let with_logprobs = parsed
        .request
        .sampling
        .as_ref()
        .is_some_and(|s| s.logprobs.is_some());
    let choices = (0..parsed.request.n.max(1))
        .map(|i| {
            let reply = Reply::new(
                tool_parser(&front.tokenizer, &parsed.request),
                parsed.parallel_tool_calls,
                &request_id,
                i,
            );
            let logprobs = with_logprobs.then(|| Logprobs::new(front.clone(), kind));
            Choice::new(reply, logprobs)
        })
        .collect();
    let mut replies = Replies::new(choices);
    let envelope = Envelope::new(kind, &request_id, &model);
    let deadline = parsed.timeout.map(|t| tokio::time::Instant::now() + t);
    let mut frames = api
        .start(
            parsed.request,
            principal,
            deadline,
            Some(DEFAULT_MAX_TOKENS),
        )
        .await?;
    // The first frame decides the status: an error before any token is an HTTP error.
    let first = next_frame(&mut frames).await?;
    let mut response = if parsed.stream {
        sse(envelope, replies, first, frames, parsed.stream_usage).into_response()
    } else {
        replies.gather(&first)?;
        while !replies.done() {
            replies.gather(&next_frame(&mut frames).await?)?;
        }
        Json(envelope.complete(replies)).into_response()
    };
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert("x-request-id", v);
    }
    Ok(response)
}

/// The parser of a chat reply's tool calls: for a request that offers tools without
/// `tool_choice: none`, in the template's markup, started on the call the choice forces.
/// A request whose tools the model cannot take is refused before its reply.
fn tool_parser(tokenizer: &Tokenizer, r: &pb::GenerateRequest) -> Option<ToolCallParser> {
    let format = tokenizer.tool_format().filter(|_| !r.tools.is_empty())?;
    let choice = pb::ToolChoice::try_from(r.tool_choice).ok()?;
    let forced = crate::dispatch::chat::reply_start(format, choice, &r.tool_choice_function)?;
    Some(ToolCallParser::new(format, &forced))
}

/// The next frame of a generation; a stream that ends before its final frame is UNAVAILABLE.
async fn next_frame(frames: &mut GenerateStream) -> Result<pb::GenerateResponse, ApiError> {
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

async fn models(State(api): State<GenerationService>) -> Json<Value> {
    let data: Vec<Value> = api
        .dispatcher
        .replicas
        .frontend()
        .map(|f| {
            json!({
                "id": f.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "tandem",
            })
        })
        .into_iter()
        .collect();
    Json(json!({"object": "list", "data": data}))
}

/// For load balancers: 200 while the router can route (it knows the model and a decode
/// replica is up) and is not draining, else 503.
async fn health(State(api): State<GenerationService>) -> Response {
    if api.dispatcher.replicas.ready() && !api.draining.is_cancelled() {
        (StatusCode::OK, Json(json!({"status": "ok"}))).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "unavailable"})),
        )
            .into_response()
    }
}
