//! The API front: the protocols clients speak, each converting its requests into one
//! `tandem.v1` `GenerateRequest` started through [`crate::dispatch::GenerationService::start`],
//! and the frames back into its own answers. gRPC ([`grpc`]); over HTTP, on a port of its own,
//! OpenAI's chat and completions ([`openai`]), Anthropic's Messages ([`anthropic`]) and OpenAI's
//! Responses ([`responses`]), protocol adapters over what the HTTP APIs share ([`http`]); the
//! HTTP APIs find a request's affinity session alike ([`session`]). Other routers call
//! [`peer`] on a port of its own.
//!
//! The HTTP routes ([`routes`]): `POST /v1/chat/completions`, `POST /v1/completions`,
//! `POST /v1/messages`, `POST /v1/messages/count_tokens`, `POST /v1/responses`,
//! `GET /v1/models`, `DELETE /v1/sessions/{id}` (a session's end), and `GET /health`. With a
//! key file, `/v1` routes authenticate before the body is read, by `Authorization: Bearer KEY`
//! or Anthropic's `x-api-key: KEY`; `/health` is open.

pub mod anthropic;
pub mod grpc;
pub mod http;
pub mod openai;
pub(crate) mod peer;
pub(crate) mod picker;
pub mod responses;
pub mod session;

use axum::Json;
use axum::extract::{DefaultBodyLimit, State};
use axum::extract::{Extension, Path};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use serde_json::{Value, json};

use crate::api::http::error::{ApiError, Shape};
use crate::auth::Principal;
use crate::dispatch::GenerationService;

/// The HTTP routes, served by [`crate::run`] on the HTTP listener.
pub(crate) fn routes(service: GenerationService) -> axum::Router {
    let body_limit = service.limits.http_body_bytes;
    axum::Router::new()
        .route("/v1/chat/completions", post(openai::chat))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/responses", post(responses::responses))
        .route("/v1/models", get(models))
        .route("/v1/sessions/{id}", delete(end_session))
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

/// Authenticates a `/v1` request before its body is read, by its `authorization` header, else
/// its `x-api-key` (Anthropic's), and hands the [`crate::auth::Principal`] to the handler. A
/// refusal has the shape of the API asked.
async fn authenticate(
    State(api): State<GenerationService>,
    mut request: axum::extract::Request,
    next: Next,
) -> Response {
    let headers = request.headers();
    let bearer;
    let authorization = match (headers.get(header::AUTHORIZATION), headers.get("x-api-key")) {
        (Some(a), _) => Some(a.as_bytes()),
        (None, Some(key)) => {
            bearer = [b"Bearer ", key.as_bytes()].concat();
            Some(bearer.as_slice())
        }
        (None, None) => None,
    };
    match api.authenticate(authorization) {
        Ok(principal) => {
            request.extensions_mut().insert(principal);
            // The request's trace starts here, or continues the client's `traceparent`.
            let span = tracing::info_span!("http", method = %request.method(), path = %request.uri().path());
            tandem_net::otel::follow_http(&span, request.headers());
            tracing::Instrument::instrument(next.run(request), span).await
        }
        Err(e) => ApiError::from(e).respond(Shape::of_path(request.uri().path())),
    }
}

/// `GET /v1/models`: every model a worker in the set serves, by name.
async fn models(State(api): State<GenerationService>) -> Json<Value> {
    let data: Vec<Value> = api
        .dispatcher
        .replicas
        .models()
        .iter()
        .map(|f| {
            json!({
                "id": f.model_name,
                "object": "model",
                "created": 0,
                "owned_by": "tandem",
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
}

/// `DELETE /v1/sessions/{id}`: ends the caller's session `id` (as its request headers or body
/// named it, see [`session`]) and releases its KV on every worker: 200 with
/// `{"id", "object": "session.deleted", "deleted": true, "released_tokens"}`, or 404 when the
/// key has no such session open (never seen, ended, or expired).
async fn end_session(
    State(api): State<GenerationService>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
) -> Response {
    let d = &api.dispatcher;
    let Some(action) = d.sessions.end(&principal.tenant, &id) else {
        return ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no open session {id:?}"),
            "not_found_error",
        )
        .respond(Shape::OpenAi);
    };
    let released = d.sessions.send(&d.replicas, action).await;
    Json(json!({
        "id": id,
        "object": "session.deleted",
        "deleted": true,
        "released_tokens": released,
    }))
    .into_response()
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
