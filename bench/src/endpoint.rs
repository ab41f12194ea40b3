//! What a benchmark drives: a Tandem router over gRPC, or any OpenAI-compatible server over HTTP
//! (Tandem's own, llama-server, vLLM), always streaming. One request in; its text, token arrival
//! times, usage and (Tandem over gRPC) route and timings out.

use std::time::Instant;

use anyhow::Context;
use clap::Args;
use futures::StreamExt;
use serde_json::{Value, json};
use tandem_proto::v1 as pb;

use tandem_client::{ApiKey, Client, ServerTlsArgs, client};

/// `--server` or `--openai`, shared by the load benchmarks.
#[derive(Args, Debug, Clone)]
pub(crate) struct EndpointArgs {
    /// A Tandem router's gRPC address (host:port).
    #[arg(long, env = "TANDEM_SERVER", required_unless_present = "openai")]
    server: Option<String>,
    /// An OpenAI-compatible base URL instead (`http://host:port` or `http://host:port/v1`):
    /// Tandem's HTTP API, llama-server, vLLM. Streaming `/v1/completions` and
    /// `/v1/chat/completions`; the model is the first one `/v1/models` lists.
    #[arg(long, conflicts_with = "server")]
    openai: Option<String>,
    /// The API key, when the endpoint requires one (gRPC `authorization` metadata, HTTP
    /// `Authorization` header).
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The model to ask for, by its id as `/v1/models` lists it, on a cluster serving several
    /// [default: the router's default model over gRPC; the first model listed over HTTP].
    #[arg(long = "model")]
    model_id: Option<String>,
    /// The priority class every request asks for: `interactive`, `standard` or `batch`
    /// (gRPC `priority`, HTTP `x-priority`) [default: the key's class].
    #[arg(long)]
    priority: Option<String>,
    /// The time to first token every request asks for, in ms (gRPC `ttft_target_ms`, HTTP
    /// `x-slo-ttft-ms`): Tandem refuses at once what it predicts it would serve later
    /// [default: none, the class's default].
    #[arg(long)]
    ttft_target_ms: Option<u32>,
    /// TLS to the router (`--server`); the HTTP client here speaks plain HTTP only.
    #[command(flatten)]
    tls: ServerTlsArgs,
}

impl EndpointArgs {
    /// Whether these name a Tandem router over gRPC (`--server`).
    pub(crate) fn is_grpc(&self) -> bool {
        self.server.is_some()
    }
}

/// A running endpoint.
#[derive(Debug, Clone)]
pub(crate) enum Endpoint {
    Grpc {
        addr: String,
        /// Boxed: the HTTP variant is a fraction of its size.
        client: Box<Client>,
        /// The model asked for; empty: the router's default.
        model: String,
        /// The priority class asked for; empty: the key's.
        priority: String,
        /// The TTFT target asked for, in ms; 0: none.
        ttft_target_ms: u32,
    },
    OpenAi {
        /// The URL without a trailing `/v1`.
        root: String,
        http: reqwest::Client,
        model: String,
    },
}

/// A request's input.
#[derive(Debug, Clone)]
pub(crate) enum Input {
    /// Raw text (OpenAI: `/v1/completions`).
    Prompt(String),
    /// `(role, content)` messages, rendered with the model's chat template (OpenAI:
    /// `/v1/chat/completions`).
    Messages(Vec<(String, String)>),
}

/// One greedy request.
#[derive(Debug, Clone)]
pub(crate) struct Ask {
    pub input: Input,
    pub max_tokens: u32,
    /// The conversation, for affinity (gRPC `session_id`, HTTP `x-session-id`).
    pub session: String,
    /// The request's id (gRPC `request_id`, HTTP `x-request-id`), under which a retry attaches
    /// to the running generation; empty: none.
    pub request_id: String,
}

/// One streamed answer.
#[derive(Debug)]
pub(crate) struct Reply {
    pub text: String,
    pub sent: Instant,
    /// When each streamed piece that carried tokens or text arrived (one token per piece for
    /// Tandem and llama-server).
    pub arrivals: Vec<Instant>,
    pub prompt_tokens: u32,
    /// From the usage the server reported, else the pieces counted.
    pub completion_tokens: u32,
    pub cached_tokens: u32,
    /// Tandem over gRPC only.
    pub route: Option<pb::Route>,
    pub timings: Option<pb::Timings>,
    /// The times the request was sent again after a failure.
    pub retries: u32,
}

impl Reply {
    fn new(sent: Instant) -> Self {
        Self {
            text: String::new(),
            sent,
            arrivals: Vec::new(),
            prompt_tokens: 0,
            completion_tokens: 0,
            cached_tokens: 0,
            route: None,
            timings: None,
            retries: 0,
        }
    }

    pub(crate) fn ttft_ms(&self) -> Option<f64> {
        Some((*self.arrivals.first()? - self.sent).as_secs_f64() * 1e3)
    }

    pub(crate) fn e2e_ms(&self) -> Option<f64> {
        Some((*self.arrivals.last()? - self.sent).as_secs_f64() * 1e3)
    }

    /// Gaps between consecutive pieces, in ms.
    pub(crate) fn itl_ms(&self) -> impl Iterator<Item = f64> + '_ {
        (self.arrivals.windows(2)).map(|w| (w[1] - w[0]).as_secs_f64() * 1e3)
    }

    /// Time per output token after the first, in ms.
    pub(crate) fn tpot_ms(&self) -> Option<f64> {
        let after_first = self.completion_tokens.checked_sub(1).filter(|&n| n > 0)?;
        Some((self.e2e_ms()? - self.ttft_ms()?) / f64::from(after_first))
    }
}

/// Takes what an Anthropic `usage` holds (`message_start`'s, then `message_delta`'s cumulative
/// totals, each overwriting what the other said, as the `anthropic` package reads them): the
/// prompt's tokens, computed and read from a cache, and the reply's.
fn anthropic_usage(u: &Value, reply: &mut Reply) {
    let n = |x: &Value| x.as_u64().map(|n| n as u32);
    if let Some(input) = n(&u["input_tokens"]) {
        let cached = n(&u["cache_read_input_tokens"]).unwrap_or(0);
        reply.prompt_tokens = input + cached + n(&u["cache_creation_input_tokens"]).unwrap_or(0);
        reply.cached_tokens = cached;
    }
    if let Some(output) = n(&u["output_tokens"]) {
        reply.completion_tokens = output;
    }
}

/// The HTTP APIs agents speak.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum AgentApi {
    /// Anthropic's Messages API (`/v1/messages`), as Claude Code speaks it.
    Messages,
    /// OpenAI's Responses API (`/v1/responses`), as Codex and the OpenAI Agents SDK speak it.
    Responses,
}

/// The `data:` of each server-sent event of a response, as JSON (`event:` lines, comments
/// and keep-alives skipped; `[DONE]` ends the events, and says so in `done`).
struct SseEvents {
    bytes: std::pin::Pin<Box<dyn futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>,
    pending: Vec<u8>,
    done: bool,
}

impl SseEvents {
    /// Sends `request` with JSON `body` under `session` (`x-session-id`), and reads the
    /// events of a success; a refusal is its status and body.
    async fn post(
        request: reqwest::RequestBuilder,
        session: &str,
        body: &Value,
    ) -> Result<Self, Failure> {
        let response = request
            .header("x-session-id", session)
            .json(body)
            .send()
            .await
            .map_err(Failure::other)?;
        if !response.status().is_success() {
            let code = format!("HTTP {}", response.status().as_u16());
            let message = response.text().await.unwrap_or_default();
            return Err(Failure { code, message });
        }
        Ok(Self {
            bytes: Box::pin(response.bytes_stream()),
            pending: Vec::new(),
            done: false,
        })
    }

    async fn next(&mut self) -> Result<Option<Value>, Failure> {
        loop {
            while let Some(end) = self.pending.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = self.pending.drain(..end + 2).collect();
                let event = String::from_utf8_lossy(&event);
                let Some(data) = event
                    .lines()
                    .find_map(|l| l.strip_prefix("data:"))
                    .map(str::trim)
                else {
                    continue;
                };
                if data == "[DONE]" {
                    self.done = true;
                    return Ok(None);
                }
                return serde_json::from_str(data).map(Some).map_err(Failure::other);
            }
            match self.bytes.next().await {
                Some(chunk) => self
                    .pending
                    .extend_from_slice(&chunk.map_err(Failure::other)?),
                None => return Ok(None),
            }
        }
    }
}

/// A failed request: the status code (gRPC code name, or `HTTP 429`) and the message.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub code: String,
    pub message: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl Failure {
    fn other(message: impl std::fmt::Display) -> Self {
        Self {
            code: "transport".into(),
            message: message.to_string(),
        }
    }

    /// Whether the request may succeed if sent again: the server or the way to it went away
    /// (a cut stream, a refused connection, a router draining), not a refusal of the request.
    pub(crate) fn retryable(&self) -> bool {
        matches!(
            self.code.as_str(),
            "Unavailable"
                | "Unknown"
                | "Cancelled"
                | "Internal"
                | "transport"
                | "HTTP 502"
                | "HTTP 503"
        )
    }
}

impl Endpoint {
    /// Connects to what `args` names (for OpenAI, asks `/v1/models` for the model).
    pub(crate) async fn connect(args: &EndpointArgs) -> anyhow::Result<Self> {
        let key = ApiKey::new(args.api_key.as_deref())?;
        if let Some(addr) = &args.server {
            return Ok(Endpoint::Grpc {
                addr: addr.clone(),
                client: Box::new(client(addr, &key, &args.tls)?),
                model: args.model_id.clone().unwrap_or_default(),
                priority: args.priority.clone().unwrap_or_default(),
                ttft_target_ms: args.ttft_target_ms.unwrap_or_default(),
            });
        }
        let base = args
            .openai
            .as_deref()
            .context("give --server or --openai")?;
        let root = base
            .trim_end_matches('/')
            .trim_end_matches("/v1")
            .to_string();
        // A connection per request: servers such as llama-server close idle keep-alive
        // connections, and a pooled one closed under the client fails its request.
        let mut headers = reqwest::header::HeaderMap::new();
        if let Some(value) = key.header() {
            let mut value = reqwest::header::HeaderValue::from_str(value)?;
            value.set_sensitive(true);
            headers.insert(reqwest::header::AUTHORIZATION, value);
        }
        if let Some(priority) = &args.priority {
            headers.insert(
                "x-priority",
                reqwest::header::HeaderValue::from_str(priority)?,
            );
        }
        if let Some(ms) = args.ttft_target_ms {
            headers.insert("x-slo-ttft-ms", reqwest::header::HeaderValue::from(ms));
        }
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .default_headers(headers)
            .build()?;
        let models: Value = http
            .get(format!("{root}/v1/models"))
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .with_context(|| format!("GET {root}/v1/models"))?
            .json()
            .await
            .context("the model list is not JSON")?;
        let model = match &args.model_id {
            Some(id) => id.clone(),
            None => models["data"][0]["id"]
                .as_str()
                .with_context(|| format!("{root}/v1/models lists no model"))?
                .to_string(),
        };
        Ok(Endpoint::OpenAi { root, http, model })
    }

    /// The model an HTTP endpoint serves (`--model`, else the first `/v1/models` lists).
    pub(crate) fn model(&self) -> Option<String> {
        match self {
            Endpoint::Grpc { .. } => None,
            Endpoint::OpenAi { model, .. } => Some(model.clone()),
        }
    }

    /// What the results call this endpoint.
    pub(crate) fn describe(&self) -> String {
        match self {
            Endpoint::Grpc { addr, model, .. } if model.is_empty() => format!("grpc://{addr}"),
            Endpoint::Grpc { addr, model, .. } => format!("grpc://{addr} ({model})"),
            Endpoint::OpenAi { root, model, .. } => format!("{root}/v1 ({model})"),
        }
    }

    /// Sends `body` (a whole request of `api`, which asks for a stream) to an HTTP endpoint
    /// under `session` and reads the stream.
    pub(crate) async fn agent_turn(
        &self,
        api: AgentApi,
        body: Value,
        session: &str,
    ) -> Result<Reply, Failure> {
        let Endpoint::OpenAi { root, http, .. } = self else {
            return Err(Failure::other("an agent's APIs are served over HTTP"));
        };
        let path = match api {
            AgentApi::Messages => "messages",
            AgentApi::Responses => "responses",
        };
        let mut reply = Reply::new(Instant::now());
        let request = http
            .post(format!("{root}/v1/{path}"))
            .header("anthropic-version", "2023-06-01");
        let mut events = SseEvents::post(request, session, &body).await?;
        while let Some(v) = events.next().await? {
            let n = |x: &Value| x.as_u64().unwrap_or(0) as u32;
            let (piece, done) = match (api, v["type"].as_str().unwrap_or_default()) {
                (_, "error") => {
                    let e = if v["error"].is_object() {
                        &v["error"]
                    } else {
                        &v
                    };
                    return Err(Failure {
                        code: e["type"].as_str().unwrap_or("stream error").to_string(),
                        message: e["message"].as_str().unwrap_or_default().to_string(),
                    });
                }
                (AgentApi::Messages, "content_block_delta") => (
                    v["delta"]["text"]
                        .as_str()
                        .or(v["delta"]["partial_json"].as_str()),
                    false,
                ),
                (AgentApi::Messages, "message_start") => {
                    anthropic_usage(&v["message"]["usage"], &mut reply);
                    (None, false)
                }
                (AgentApi::Messages, "message_delta") => {
                    anthropic_usage(&v["usage"], &mut reply);
                    (None, false)
                }
                (AgentApi::Messages, "message_stop") => (None, true),
                (
                    AgentApi::Responses,
                    "response.output_text.delta" | "response.function_call_arguments.delta",
                ) => (v["delta"].as_str(), false),
                (AgentApi::Responses, "response.completed" | "response.incomplete") => {
                    let u = &v["response"]["usage"];
                    reply.prompt_tokens = n(&u["input_tokens"]);
                    reply.cached_tokens = n(&u["input_tokens_details"]["cached_tokens"]);
                    reply.completion_tokens = n(&u["output_tokens"]);
                    (None, true)
                }
                _ => (None, false),
            };
            if let Some(piece) = piece.filter(|p| !p.is_empty()) {
                reply.arrivals.push(Instant::now());
                reply.text.push_str(piece);
            }
            if done {
                return Ok(reply);
            }
        }
        Err(Failure::other("the stream ended before its last event"))
    }

    /// Sends `ask` (greedy) and reads the whole stream.
    pub(crate) async fn generate(&self, ask: &Ask) -> Result<Reply, Failure> {
        match self {
            Endpoint::Grpc {
                client,
                model,
                priority,
                ttft_target_ms,
                ..
            } => {
                grpc(
                    client.as_ref().clone(),
                    model,
                    priority,
                    *ttft_target_ms,
                    ask,
                )
                .await
            }
            Endpoint::OpenAi { root, http, model } => openai(http, root, model, ask).await,
        }
    }
}

async fn grpc(
    mut client: Client,
    model: &str,
    priority: &str,
    ttft_target_ms: u32,
    ask: &Ask,
) -> Result<Reply, Failure> {
    let mut request = pb::GenerateRequest {
        model: model.to_string(),
        priority: priority.to_string(),
        ttft_target_ms,
        session_id: ask.session.clone(),
        request_id: ask.request_id.clone(),
        sampling: Some(pb::SamplingParams {
            max_tokens: ask.max_tokens,
            ..Default::default()
        }),
        ..Default::default()
    };
    match &ask.input {
        Input::Prompt(p) => request.prompt = Some(p.clone()),
        Input::Messages(m) => {
            request.messages = m
                .iter()
                .map(|(role, content)| pb::ChatMessage {
                    role: role.clone(),
                    content: content.clone(),
                    ..Default::default()
                })
                .collect();
        }
    }
    let status = |s: tonic::Status| Failure {
        code: format!("{:?}", s.code()),
        message: s.message().to_string(),
    };
    let mut reply = Reply::new(Instant::now());
    let mut frames = client.generate(request).await.map_err(status)?.into_inner();
    while let Some(f) = frames.message().await.map_err(status)? {
        if !f.token_ids.is_empty() || !f.text.is_empty() {
            reply.arrivals.push(Instant::now());
        }
        reply.text.push_str(&f.text);
        if f.finish_reason != pb::FinishReason::Unspecified as i32 {
            let usage = f.usage.unwrap_or_default();
            reply.prompt_tokens = usage.prompt_tokens;
            reply.completion_tokens = usage.completion_tokens;
            reply.cached_tokens = usage.cached_tokens;
            reply.route = f.route;
            reply.timings = f.timings;
            return Ok(reply);
        }
    }
    Err(Failure::other("the stream ended without a final frame"))
}

async fn openai(
    http: &reqwest::Client,
    root: &str,
    model: &str,
    ask: &Ask,
) -> Result<Reply, Failure> {
    let mut body = json!({
        "model": model,
        "max_tokens": ask.max_tokens,
        "temperature": 0.0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let path = match &ask.input {
        Input::Prompt(p) => {
            body["prompt"] = json!(p);
            "completions"
        }
        Input::Messages(m) => {
            body["messages"] = m
                .iter()
                .map(|(role, content)| json!({"role": role, "content": content}))
                .collect();
            "chat/completions"
        }
    };
    let mut reply = Reply::new(Instant::now());
    let mut request = http.post(format!("{root}/v1/{path}"));
    if !ask.request_id.is_empty() {
        request = request.header("x-request-id", &ask.request_id);
    }
    let mut events = SseEvents::post(request, &ask.session, &body).await?;
    let mut pieces = 0u32;
    while let Some(v) = events.next().await? {
        if let Some(e) = v.get("error") {
            return Err(Failure {
                code: e["code"].as_str().unwrap_or("stream error").to_string(),
                message: e["message"].as_str().unwrap_or_default().to_string(),
            });
        }
        let choice = &v["choices"][0];
        let text = choice["delta"]["content"]
            .as_str()
            .or_else(|| choice["text"].as_str())
            .unwrap_or_default();
        if !text.is_empty() {
            reply.arrivals.push(Instant::now());
            reply.text.push_str(text);
            pieces += 1;
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            let n = |x: &Value| x.as_u64().unwrap_or(0) as u32;
            reply.prompt_tokens = n(&u["prompt_tokens"]);
            reply.completion_tokens = n(&u["completion_tokens"]);
            reply.cached_tokens = n(&u["prompt_tokens_details"]["cached_tokens"]);
        }
        // llama-server reports its prompt cache this way.
        if let Some(n) = v["timings"]["cache_n"].as_u64() {
            reply.cached_tokens = n as u32;
        }
    }
    if !events.done {
        return Err(Failure::other("the stream ended without [DONE]"));
    }
    if reply.completion_tokens == 0 {
        reply.completion_tokens = pieces;
    }
    Ok(reply)
}
