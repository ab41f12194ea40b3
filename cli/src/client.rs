//! Clients of a running cluster: `tandem generate --server` (the same flags and JSON as the local
//! command) and `tandem chat --server` (interactive, multi-turn, with a session id).

use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use tandem_engine::GenerateParams;
use tandem_proto::v1 as pb;
use tonic::Status;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig};

use crate::generate::{GenerateArgs, parse_messages};
use crate::sampling::{CHAT_DEFAULTS, SamplingArgs};

/// What one streamed generation produced.
#[derive(Debug, Default)]
pub(crate) struct Streamed {
    pub prompt_token_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: String,
    pub timings: pb::Timings,
    pub logprobs: Vec<pb::TokenLogprobs>,
}

/// Sends `authorization: Bearer KEY` with every call, when there is a key.
#[derive(Clone, Debug, Default)]
pub(crate) struct ApiKey(Option<MetadataValue<Ascii>>);

impl ApiKey {
    pub(crate) fn new(key: Option<&str>) -> anyhow::Result<Self> {
        key.map(|k| {
            format!("Bearer {k}")
                .parse()
                .context("an API key must be printable ASCII")
        })
        .transpose()
        .map(Self)
    }

    /// The header value, for HTTP clients.
    pub(crate) fn header(&self) -> Option<&str> {
        self.0.as_ref().and_then(|v| v.to_str().ok())
    }
}

impl Interceptor for ApiKey {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        if let Some(v) = &self.0 {
            request.metadata_mut().insert("authorization", v.clone());
        }
        Ok(request)
    }
}

/// A `tandem.v1.Generation` client that sends its API key.
pub(crate) type Client =
    pb::generation_client::GenerationClient<InterceptedService<Channel, ApiKey>>;

/// How a client verifies a router that serves its API over TLS (`tandem router
/// --api-tls-cert`).
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct ServerTlsArgs {
    /// Verify the router's certificate against this CA certificate (PEM) instead of the
    /// system's trusted roots; implies TLS. (A server address starting `https://` also turns
    /// TLS on.)
    #[arg(long, env = "TANDEM_CA_CERT")]
    pub ca_cert: Option<PathBuf>,
    /// The name the router's certificate must carry, when it is not the server address's host
    /// (dialling an IP address, say); implies TLS.
    #[arg(long, env = "TANDEM_TLS_NAME")]
    pub tls_name: Option<String>,
}

impl ServerTlsArgs {
    /// The TLS settings for `server`, or `None` for plaintext.
    pub(crate) fn config(&self, server: &str) -> anyhow::Result<Option<ClientTlsConfig>> {
        if !server.starts_with("https://") && self.ca_cert.is_none() && self.tls_name.is_none() {
            return Ok(None);
        }
        let mut config = ClientTlsConfig::new();
        config = match &self.ca_cert {
            Some(path) => {
                let pem = std::fs::read(path).with_context(|| {
                    format!("cannot read the CA certificate {}", path.display())
                })?;
                config.ca_certificate(Certificate::from_pem(pem))
            }
            None => config.with_native_roots(),
        };
        if let Some(name) = &self.tls_name {
            config = config.domain_name(name);
        }
        Ok(Some(config))
    }
}

/// A client of the router at `server`.
pub(crate) fn client(server: &str, key: &ApiKey, tls: &ServerTlsArgs) -> anyhow::Result<Client> {
    let channel = tandem_net::channel(server, tls.config(server)?)
        .with_context(|| format!("bad server address {server:?}"))?;
    Ok(tandem_proto::limits!(
        pb::generation_client::GenerationClient::with_interceptor(channel, key.clone())
    ))
}

/// How long a failed plaintext client waits to learn whether the server wanted TLS.
const TLS_PROBE: std::time::Duration = std::time::Duration::from_secs(1);

/// `error`, or, when a plaintext client's call to `server` failed because the server speaks
/// TLS, that: the call's own error then reads as an HTTP/2 protocol error or a broken transport.
pub(crate) async fn explain(
    server: &str,
    tls: &ServerTlsArgs,
    error: anyhow::Error,
) -> anyhow::Error {
    let plaintext = matches!(tls.config(server), Ok(None));
    if plaintext && tandem_net::requires_tls(server, TLS_PROBE).await {
        return anyhow::anyhow!(
            "{server} serves TLS: give the address as https://{}, with --ca-cert when its \
             certificate is not from a public CA ({error:#})",
            tandem_net::authority(server)
        );
    }
    error
}

fn finish_name(code: i32) -> String {
    match pb::FinishReason::try_from(code) {
        Ok(pb::FinishReason::Stop) => "stop",
        Ok(pb::FinishReason::Length) => "length",
        Ok(pb::FinishReason::Cancelled) => "cancelled",
        _ => "unspecified",
    }
    .into()
}

/// Sends `request` and streams the reply, handing each text delta to `on_text`.
pub(crate) async fn stream(
    client: &mut Client,
    request: pb::GenerateRequest,
    on_text: &mut dyn FnMut(&str),
) -> anyhow::Result<Streamed> {
    let mut frames = client
        .generate(request)
        .await
        .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
        .into_inner();
    let mut out = Streamed::default();
    let mut expected = 0;
    loop {
        let frame = frames
            .message()
            .await
            .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
            .context("the stream ended without a final frame")?;
        anyhow::ensure!(
            frame.index == expected,
            "frame {} arrived where {expected} was due",
            frame.index
        );
        expected += 1;
        out.token_ids.extend(&frame.token_ids);
        out.text.push_str(&frame.text);
        out.logprobs.extend(frame.logprobs);
        on_text(&frame.text);
        if frame.finish_reason != pb::FinishReason::Unspecified as i32 {
            out.finish_reason = finish_name(frame.finish_reason);
            out.prompt_token_ids = frame.prompt_token_ids;
            out.timings = frame.timings.unwrap_or_default();
            return Ok(out);
        }
    }
}

/// `tandem generate --server ADDR ...`.
pub(crate) fn generate(args: &GenerateArgs, server: &str) -> anyhow::Result<()> {
    let mut request = pb::GenerateRequest {
        sampling: Some(tandem_worker::params_to_pb(&args.params(None)?)),
        ..Default::default()
    };
    match (&args.prompt, &args.messages) {
        (Some(p), _) => request.prompt = Some(p.clone()),
        (None, Some(m)) => {
            request.messages = parse_messages(m)?
                .into_iter()
                .map(|m| pb::ChatMessage {
                    role: m.role,
                    content: m.content,
                    ..Default::default()
                })
                .collect();
        }
        (None, None) => anyhow::bail!("give --prompt or --messages"),
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let out = rt.block_on(async {
        let mut client = client(server, &ApiKey::new(args.api_key.as_deref())?, &args.tls)?;
        let mut stdout = std::io::stdout().lock();
        let out = stream(&mut client, request, &mut |text| {
            if !args.json {
                let _ = stdout.write_all(text.as_bytes());
                let _ = stdout.flush();
            }
        })
        .await;
        match out {
            Err(e) => Err(explain(server, &args.tls, e).await),
            ok => ok,
        }
    })?;
    if args.json {
        let finish_reason = match out.finish_reason.as_str() {
            "stop" => tandem_engine::FinishReason::Stop,
            "length" => tandem_engine::FinishReason::Length,
            other => anyhow::bail!("the server ended the generation with {other:?}"),
        };
        let t = &out.timings;
        let json = tandem_engine::GenerateOutput {
            prompt_token_ids: out.prompt_token_ids,
            token_ids: out.token_ids,
            text: out.text,
            finish_reason,
            prefill_ms: t.prefill_ms,
            decode_ms: (t.total_ms - t.first_token_ms).max(0.0),
            draft_tokens: t.draft_tokens.into(),
            accepted_draft_tokens: t.accepted_draft_tokens.into(),
            logprobs: out
                .logprobs
                .iter()
                .map(tandem_worker::logprobs_from_pb)
                .collect(),
        };
        println!("{}", serde_json::to_string(&json)?);
    } else {
        println!();
    }
    Ok(())
}

#[derive(Args, Debug)]
pub(crate) struct ChatArgs {
    /// The router's address, host:port.
    #[arg(long, env = "TANDEM_SERVER", default_value = "127.0.0.1:50051")]
    server: String,
    /// The API key, when the router requires one.
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    #[command(flatten)]
    tls: ServerTlsArgs,
    /// The model to talk to, by its id as `GET /v1/models` lists it (the GGUF file's name
    /// without `.gguf`); unset, the router's default model.
    #[arg(long)]
    model: Option<String>,
    /// A system prompt for the conversation.
    #[arg(long)]
    system: Option<String>,
    /// The most tokens per reply.
    #[arg(long, default_value_t = 256)]
    max_tokens: u32,
    #[command(flatten)]
    sampling: SamplingArgs,
}

/// `tandem chat --server ADDR`: one line per user turn; an empty line or EOF ends.
pub(crate) fn chat(args: &ChatArgs) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    // The channel's connection task needs a runtime to be spawned on.
    let _runtime = rt.enter();
    let mut client = client(
        &args.server,
        &ApiKey::new(args.api_key.as_deref())?,
        &args.tls,
    )?;
    let session_id = format!("{:016x}", rand::random::<u64>());
    let mut messages: Vec<pb::ChatMessage> = args
        .system
        .iter()
        .map(|s| pb::ChatMessage {
            role: "system".into(),
            content: s.clone(),
            ..Default::default()
        })
        .collect();
    let sampling = args.sampling.resolve(&CHAT_DEFAULTS);
    eprintln!(
        "chatting with {} (session {session_id}); an empty line ends",
        args.server
    );
    eprintln!(
        "sampling: temperature {}, top-p {}, top-k {}, repetition penalty {}, frequency penalty \
         {}, presence penalty {}, seed {}, up to {} tokens per reply (flags change them)",
        sampling.temperature,
        sampling.top_p,
        sampling.top_k,
        sampling.repetition_penalty,
        sampling.frequency_penalty,
        sampling.presence_penalty,
        sampling.seed,
        args.max_tokens
    );
    let stdin = std::io::stdin();
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 || line.trim().is_empty() {
            return Ok(());
        }
        messages.push(pb::ChatMessage {
            role: "user".into(),
            content: line.trim_end().to_string(),
            ..Default::default()
        });
        let request = pb::GenerateRequest {
            model: args.model.clone().unwrap_or_default(),
            session_id: session_id.clone(),
            messages: messages.clone(),
            sampling: Some(tandem_worker::params_to_pb(&GenerateParams {
                sampling: sampling.clone(),
                max_tokens: args.max_tokens as usize,
                ..GenerateParams::default()
            })),
            ..Default::default()
        };
        let mut stdout = std::io::stdout().lock();
        let reply = rt.block_on(stream(&mut client, request, &mut |text| {
            let _ = stdout.write_all(text.as_bytes());
            let _ = stdout.flush();
        }));
        println!();
        match reply {
            Ok(r) => messages.push(pb::ChatMessage {
                role: "assistant".into(),
                content: r.text,
                ..Default::default()
            }),
            Err(e) => {
                let e = rt.block_on(explain(&args.server, &args.tls, e));
                eprintln!("error: {e:#}");
                messages.pop();
            }
        }
    }
}
