//! The Gateway API Inference Extension's endpoint picker: Envoy's external processing service
//! (`envoy.service.ext_proc.v3.ExternalProcessor`), served on the router's gRPC port when
//! `--picker-endpoints` names the endpoints to pick among.
//!
//! An Envoy (or any gateway with an ext_proc filter) in front of the cluster sends each HTTP
//! request's headers and buffered body here (`request_body_mode: BUFFERED`). The picker answers
//! the body with the endpoint the request should go to, in the `x-gateway-destination-endpoint`
//! header and under `envoy.lb` in the dynamic metadata, as the extension's endpoint-picker
//! protocol says; the gateway's original-destination cluster sends the request there. It sheds
//! with an immediate response instead: 503 when no endpoint is known or the request's model has
//! no decode replica up, 429 (with `retry-after`) when this router already holds
//! `--max-inflight` requests.
//!
//! The endpoints are routers' HTTP addresses, not workers': a Tandem worker speaks only the
//! cluster's internal gRPC, and the router it reaches sends the request on to its model's
//! replicas by prefix and load. What the picker decides is which router: the one a rendezvous
//! hash of the request's conversation ranks first (its affinity session as
//! [`crate::api::session`] finds it, else the start of its prompt), so that every turn of a
//! conversation goes through the same router, whatever the gateway's own balancing.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, RwLock};

use axum::http::{HeaderMap, HeaderName, HeaderValue as HttpHeaderValue};
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3 as ext_proc;
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use ext_proc::external_processor_server::ExternalProcessor;
use ext_proc::processing_request::Request as Phase;
use ext_proc::processing_response::Response as Answer;
use futures::Stream;
use serde_json::Value as Json;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::{Request, Response, Status, Streaming};

use crate::api::anthropic::request::requested;
use crate::api::http::error::{ApiError, Shape};
use crate::api::session::{BodySession, session};
use crate::cluster::discovery::{RESOLVE_INTERVAL, Specs};
use crate::cluster::policy::rendezvous_score;
use crate::cluster::replica::Role;
use crate::dispatch::GenerationService;
use crate::error::Error;

/// The header, and the dynamic metadata key under [`NAMESPACE`], that name the endpoint.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The dynamic metadata namespace of the destination.
const NAMESPACE: &str = "envoy.lb";
/// How much of a prompt's start places a conversation without a session.
const PREFIX_BYTES: usize = 2048;

/// The endpoints to pick among: each configured `host:port`, its names resolved again every
/// [`RESOLVE_INTERVAL`].
#[derive(Debug, Default)]
struct Endpoints {
    addrs: RwLock<Vec<SocketAddr>>,
}

impl Endpoints {
    fn now(&self) -> Vec<SocketAddr> {
        // Whole-value stores only; a poisoned lock is still consistent.
        self.addrs.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Resolves every spec again; a failed lookup keeps the endpoints as they are.
    async fn refresh(&self, specs: &Specs) {
        if let Some(addrs) = specs.addresses().await {
            *self.addrs.write().unwrap_or_else(|e| e.into_inner()) = addrs;
        }
    }
}

/// The endpoint picker's service.
#[derive(Clone, Debug)]
pub(crate) struct Picker {
    service: GenerationService,
    endpoints: Arc<Endpoints>,
    /// The largest body it buffers (the HTTP API's own bound).
    max_body: usize,
}

impl Picker {
    /// A picker among `specs` (`host:port`, names followed until `cancel`), deciding with the
    /// router's view of the cluster in `service`.
    pub(crate) async fn start(
        service: GenerationService,
        specs: Vec<String>,
        max_body: usize,
        tracker: &TaskTracker,
        cancel: CancellationToken,
    ) -> crate::error::Result<Self> {
        let specs = Specs::parse(&specs)?;
        let endpoints = Arc::new(Endpoints::default());
        endpoints.refresh(&specs).await;
        let following = endpoints.clone();
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(RESOLVE_INTERVAL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => following.refresh(&specs).await,
                    () = cancel.cancelled() => return,
                }
            }
        });
        Ok(Self {
            service,
            endpoints,
            max_body,
        })
    }

    /// Where one request goes, from its headers and (buffered) body.
    fn decide(&self, headers: &HeaderMap, path: &str, body: &[u8]) -> Decision {
        let body: serde_json::Map<String, Json> = serde_json::from_slice(body).unwrap_or_default();
        let endpoints = self.endpoints.now();
        let asked = match body.get("model").and_then(Json::as_str) {
            Some(m) if Shape::of_path(path) == Shape::Anthropic => requested(m),
            Some(m) => m,
            None => "",
        };
        let model_up = match self.service.frontend(asked) {
            Ok(front) => {
                let replicas = &self.service.dispatcher.replicas;
                Some(!replicas.up(Role::Decode, &front.model_name).is_empty())
            }
            // No model known at all: nothing can serve it.
            Err(Error::NotReady) => Some(false),
            // An unknown or missing model: the router it reaches refuses it in the API's words.
            Err(_) => None,
        };
        let full =
            (self.service.admission.available_permits() == 0).then_some(self.service.max_inflight);
        let decision = decide(&conversation(headers, &body), &endpoints, model_up, full);
        if let Decision::Shed(e) = &decision {
            tracing::info!(error = %e, "the picker shed a request");
        }
        decision
    }

    fn answer(&self, decision: Decision, path: &str) -> ext_proc::ProcessingResponse {
        match decision {
            Decision::To(addr) => {
                let addr = addr.to_string();
                self.service.dispatcher.metrics.picked(&addr);
                routed(&addr)
            }
            Decision::Shed(e) => {
                let api = ApiError::from(e);
                self.service
                    .dispatcher
                    .metrics
                    .picker_shed(api.status.as_u16());
                immediate(&api, Shape::of_path(path))
            }
        }
    }

    /// Follows one HTTP request's phases, answering each; the body's answer carries the
    /// decision.
    async fn follow(
        &self,
        mut inbound: Streaming<ext_proc::ProcessingRequest>,
        out: tokio::sync::mpsc::Sender<Result<ext_proc::ProcessingResponse, Status>>,
    ) {
        let (mut headers, mut path, mut body) = (HeaderMap::new(), String::new(), Vec::new());
        while let Ok(Some(message)) = inbound.message().await {
            let answer = match message.request {
                Some(Phase::RequestHeaders(h)) => {
                    (headers, path) = http_headers(h.headers.unwrap_or_default().headers);
                    if h.end_of_stream {
                        let decision = self.decide(&headers, &path, &[]);
                        with_headers(self.answer(decision, &path))
                    } else {
                        reply(Answer::RequestHeaders(ext_proc::HeadersResponse::default()))
                    }
                }
                Some(Phase::RequestBody(b)) => {
                    if body.len() + b.body.len() > self.max_body {
                        let e = ApiError::new(
                            axum::http::StatusCode::PAYLOAD_TOO_LARGE,
                            format!("the request body is over {} bytes", self.max_body),
                            "invalid_request_error",
                        );
                        immediate(&e, Shape::OpenAi)
                    } else {
                        body.extend_from_slice(&b.body);
                        if b.end_of_stream {
                            self.answer(self.decide(&headers, &path, &body), &path)
                        } else {
                            reply(Answer::RequestBody(ext_proc::BodyResponse::default()))
                        }
                    }
                }
                // Phases a gateway sends only when configured to: each passes unchanged.
                Some(Phase::ResponseHeaders(_)) => {
                    reply(Answer::ResponseHeaders(ext_proc::HeadersResponse::default()))
                }
                Some(Phase::ResponseBody(_)) => {
                    reply(Answer::ResponseBody(ext_proc::BodyResponse::default()))
                }
                Some(Phase::RequestTrailers(_)) => reply(Answer::RequestTrailers(
                    ext_proc::TrailersResponse::default(),
                )),
                Some(Phase::ResponseTrailers(_)) => reply(Answer::ResponseTrailers(
                    ext_proc::TrailersResponse::default(),
                )),
                None => continue,
            };
            if out.send(Ok(answer)).await.is_err() {
                return;
            }
        }
    }
}

type Answers = Pin<Box<dyn Stream<Item = Result<ext_proc::ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: Request<Streaming<ext_proc::ProcessingRequest>>,
    ) -> Result<Response<Answers>, Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let (picker, inbound) = (self.clone(), request.into_inner());
        tokio::spawn(async move { picker.follow(inbound, tx).await });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}

/// What the picker does with a request.
#[derive(Debug)]
enum Decision {
    To(SocketAddr),
    Shed(Error),
}

/// The endpoint for a conversation `key` among `endpoints`: the one the rendezvous hash ranks
/// first. Shed with 503 when there is none or the request's model has no decode replica up
/// (`model_up`: `None` when the picker cannot tell, as for a model the cluster does not
/// serve), with 429 when the router is `full` (it holds that many requests, its most).
fn decide(
    key: &[u8],
    endpoints: &[SocketAddr],
    model_up: Option<bool>,
    full: Option<usize>,
) -> Decision {
    if model_up == Some(false) {
        return Decision::Shed(Error::NoReplica { role: "decode" });
    }
    if let Some(inflight) = full {
        return Decision::Shed(Error::Busy { inflight });
    }
    endpoints
        .iter()
        .max_by_key(|a| rendezvous_score(key, a.to_string().as_bytes()))
        .map_or(Decision::Shed(Error::NoEndpoint), |a| Decision::To(*a))
}

/// What places a request's conversation: its affinity session, else the start of its prompt
/// (the system prompt and first message, or the prompt), which every later turn repeats.
fn conversation(headers: &HeaderMap, body: &serde_json::Map<String, Json>) -> Vec<u8> {
    let text = |key: &str| body.get(key).and_then(Json::as_str).map(str::to_string);
    let user_id = body
        .get("metadata")
        .and_then(|m| m.get("user_id"))
        .and_then(Json::as_str)
        .map(str::to_string);
    let session = session(
        headers,
        BodySession {
            prompt_cache_key: text("prompt_cache_key"),
            metadata_user_id: user_id,
            user: text("user"),
        },
    );
    if !session.is_empty() {
        return [b"session:", session.as_bytes()].concat();
    }
    let first = |key: &str| match body.get(key) {
        Some(Json::Array(items)) => items.first().cloned(),
        other => other.cloned(),
    };
    let mut key = b"prompt:".to_vec();
    for part in [
        body.get("system").cloned(),
        body.get("instructions").cloned(),
        first("messages"),
        first("input"),
        first("prompt"),
    ]
    .into_iter()
    .flatten()
    {
        key.extend_from_slice(part.to_string().as_bytes());
    }
    key.truncate(PREFIX_BYTES);
    key
}

/// Envoy's header list as a header map (pseudo-headers left out), and the `:path`.
fn http_headers(list: Vec<HeaderValue>) -> (HeaderMap, String) {
    let mut headers = HeaderMap::new();
    let mut path = String::new();
    for h in list {
        let value = if h.raw_value.is_empty() {
            h.value.into_bytes()
        } else {
            h.raw_value
        };
        if h.key == ":path" {
            path = String::from_utf8_lossy(&value).into_owned();
            continue;
        }
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(h.key.as_bytes()),
            HttpHeaderValue::from_bytes(&value),
        ) {
            headers.append(name, value);
        }
    }
    (headers, path)
}

fn reply(answer: Answer) -> ext_proc::ProcessingResponse {
    ext_proc::ProcessingResponse {
        response: Some(answer),
        ..Default::default()
    }
}

fn string(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

/// The answer that sends a request to `addr`: the destination header set on the request (in
/// the body's answer), and the same under `envoy.lb` in the dynamic metadata.
fn routed(addr: &str) -> ext_proc::ProcessingResponse {
    let mutation = ext_proc::HeaderMutation {
        set_headers: vec![HeaderValueOption {
            header: Some(HeaderValue {
                key: DESTINATION.into(),
                raw_value: addr.as_bytes().to_vec(),
                ..Default::default()
            }),
            append_action: envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
            ..Default::default()
        }],
        ..Default::default()
    };
    let common = ext_proc::CommonResponse {
        header_mutation: Some(mutation),
        ..Default::default()
    };
    let inner = Struct {
        fields: HashMap::from([(DESTINATION.to_string(), string(addr))]),
    };
    ext_proc::ProcessingResponse {
        response: Some(Answer::RequestBody(ext_proc::BodyResponse {
            response: Some(common),
        })),
        dynamic_metadata: Some(Struct {
            fields: HashMap::from([(
                NAMESPACE.to_string(),
                Value {
                    kind: Some(Kind::StructValue(inner)),
                },
            )]),
        }),
        ..Default::default()
    }
}

/// A decision made on the headers alone (a request without a body) answers the headers.
fn with_headers(mut answer: ext_proc::ProcessingResponse) -> ext_proc::ProcessingResponse {
    if let Some(Answer::RequestBody(b)) = answer.response.take() {
        answer.response = Some(Answer::RequestHeaders(ext_proc::HeadersResponse {
            response: b.response,
        }));
    }
    answer
}

/// The gateway answers the client at once with `e`, in `shape`.
fn immediate(e: &ApiError, shape: Shape) -> ext_proc::ProcessingResponse {
    let mut set = vec![("content-type", "application/json".to_string())];
    if let Some(s) = e.retry_after_s {
        set.push(("retry-after", s.to_string()));
    }
    let headers = ext_proc::HeaderMutation {
        set_headers: set
            .into_iter()
            .map(|(key, value)| HeaderValueOption {
                header: Some(HeaderValue {
                    key: key.into(),
                    raw_value: value.into_bytes(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    reply(Answer::ImmediateResponse(ext_proc::ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(e.status.as_u16()),
        }),
        headers: Some(headers),
        body: e.body_in(shape).to_string().into_bytes(),
        details: e.message.clone(),
        ..Default::default()
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs(ports: &[u16]) -> Vec<SocketAddr> {
        ports
            .iter()
            .map(|p| SocketAddr::from(([10, 0, 0, 1], *p)))
            .collect()
    }

    #[test]
    fn a_conversation_keeps_its_endpoint_and_sheds_by_the_protocol() {
        let three = addrs(&[8000, 8001, 8002]);
        let to =
            |key: &[u8], endpoints: &[SocketAddr]| match decide(key, endpoints, Some(true), None) {
                Decision::To(a) => a,
                Decision::Shed(e) => panic!("shed: {e}"),
            };
        // The same key, the same endpoint; another endpoint leaving moves only its own keys.
        let keys: Vec<Vec<u8>> = (0..64)
            .map(|i| format!("session:{i}").into_bytes())
            .collect();
        let before: Vec<SocketAddr> = keys.iter().map(|k| to(k, &three)).collect();
        assert!(
            three.iter().all(|a| before.contains(a)),
            "every endpoint gets some"
        );
        let two = &three[..2];
        for (k, was) in keys.iter().zip(&before) {
            let now = to(k, two);
            if *was != three[2] {
                assert_eq!(now, *was, "a key whose endpoint stayed keeps it");
            }
        }
        // 503: no endpoint, or the model's decode replicas are all down; 429: no room.
        let status = |d: Decision| match d {
            Decision::Shed(e) => ApiError::from(e).status.as_u16(),
            Decision::To(a) => panic!("sent to {a}"),
        };
        assert_eq!(status(decide(b"k", &[], Some(true), None)), 503);
        assert_eq!(status(decide(b"k", &three, Some(false), None)), 503);
        assert_eq!(status(decide(b"k", &three, Some(true), Some(256))), 429);
        // A model the picker cannot judge still goes to a router, which answers for it.
        assert!(matches!(decide(b"k", &three, None, None), Decision::To(_)));
    }

    #[test]
    fn a_conversation_is_its_session_else_its_prompts_start() {
        let body = |v: Json| v.as_object().cloned().unwrap_or_default();
        let mut headers = HeaderMap::new();
        let turn1 = body(serde_json::json!({"messages": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}));
        let turn2 = body(serde_json::json!({"messages": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]}));
        assert_eq!(
            conversation(&headers, &turn1),
            conversation(&headers, &turn2)
        );
        let other = body(serde_json::json!({"messages": [{"role": "system", "content": "other"}]}));
        assert_ne!(
            conversation(&headers, &turn1),
            conversation(&headers, &other)
        );
        headers.insert("x-session-id", HttpHeaderValue::from_static("s1"));
        assert_eq!(conversation(&headers, &other), b"session:s1");
        let huge = body(serde_json::json!({"prompt": "x".repeat(10_000)}));
        assert_eq!(conversation(&HeaderMap::new(), &huge).len(), PREFIX_BYTES);
    }
}
