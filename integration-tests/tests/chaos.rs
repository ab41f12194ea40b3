//! The chaos suite: the compose cluster (deploy/docker-compose.yml plus chaos/compose.yml, real
//! containers from the FROM-scratch image built with the `failpoints` feature, the real model)
//! under faults, with streaming traffic running. Each scenario sends fresh prompts (so that no
//! prefix cache holds them and their KV crosses the network), 8 streaming at once, with the
//! fault in the first wave, and checks the reliability contract (DESIGN.md, C1-C7) request by
//! request against the fault-free answer: the engine's own generation of the same prompts and
//! seeds (`tandem generate --batch`).
//!
//! Run it with `scripts/chaos.sh [smoke|full]`, which builds the image first; these tests are
//! `#[ignore]`d so that `cargo test` alone never starts containers. Without Docker they say so
//! and pass nothing off as tested: they fail with the reason.
//!
//! Results go to `target/chaos/`: `results.md` and `results.json` (one row per scenario), and
//! `events-<scenario>.jsonl` (every client event: request, frame index, time, status).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use rand::{Rng, SeedableRng};
use tandem_integration_tests::{SseStream, http_model, metrics};
use tandem_proto::v1 as pb;
use tonic::transport::Channel;

const PROJECT: &str = "tandemchaos";
const IMAGE: &str = "tandem:chaos";
/// The model the compose cluster serves here: the smallest real one (`TANDEM_MODEL`).
const MODEL: &str = "smollm2";
const PORT: u16 = 50151;
/// The router's OpenAI HTTP API (`TANDEM_HTTP_PORT`).
const HTTP_PORT: u16 = 8151;
/// The second router's ports (`TANDEM_PORT_2`, `TANDEM_HTTP_PORT_2`); the scenarios drive the
/// first.
const PORT_2: u16 = 50161;
const HTTP_PORT_2: u16 = 8161;
const DECODE_PORT: u16 = 50053;
/// Requests per scenario, and how many stream at once: the fault hits the first wave, and the
/// later ones show that the cluster serves on (and bound the attempts per request, C7).
const REQUESTS: usize = 32;
const STREAMS: usize = 8;
const MAX_TOKENS: u32 = 64;
/// The replies of the OpenAI HTTP scenarios: long enough that every stream still runs when the
/// fault comes after its first chunks.
const HTTP_MAX_TOKENS: u32 = 160;
/// Words per prompt (about 1.2 tokens each): long enough that the router prefers a prefill
/// node over a busy decode node, so that KV crosses the network.
const PROMPT_WORDS: usize = 200;
/// The client's deadline for each request.
const DEADLINE: Duration = Duration::from_secs(60);
/// How long a healed cluster may take to have every replica back.
const RECOVERY: Duration = Duration::from_secs(90);

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn out_dir() -> PathBuf {
    let dir = repo().join("target/chaos");
    let _ = std::fs::create_dir_all(&dir);
    dir
}

/// The cluster's certificates (`tandem_net::tls`), made once per run.
fn certs_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = out_dir().join("certs");
        tandem_net::tls::write_dev_certs(&dir, &[], 2).expect("certificates");
        dir
    })
    .clone()
}

/// Runs a command, failing with its stderr.
fn run_env(program: &str, args: &[&str], env: &[(&str, &str)]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .current_dir(repo())
        .env("TANDEM_PORT", PORT.to_string())
        .env("TANDEM_HTTP_PORT", HTTP_PORT.to_string())
        .env("TANDEM_PORT_2", PORT_2.to_string())
        .env("TANDEM_HTTP_PORT_2", HTTP_PORT_2.to_string())
        .env("TANDEM_IMAGE", IMAGE)
        .env("TANDEM_CERTS", certs_dir())
        .envs(env.iter().copied())
        .output()
        .with_context(|| format!("cannot run {program}"))?;
    ensure!(
        out.status.success(),
        "{program} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn compose_env(args: &[&str], env: &[(&str, &str)]) -> Result<String> {
    let mut all = vec![
        "-f",
        "deploy/docker-compose.yml",
        "-f",
        "integration-tests/chaos/compose.yml",
        "-p",
        PROJECT,
    ];
    all.extend_from_slice(args);
    let env: Vec<(&str, &str)> = [("TANDEM_MODEL", MODEL)]
        .into_iter()
        .chain(env.iter().copied())
        .collect();
    run_env("docker-compose", &all, &env)
}

fn docker(args: &[&str]) -> Result<String> {
    run_env("docker", args, &[])
}

fn container(service: &str, n: usize) -> String {
    format!("{PROJECT}_{service}_{n}")
}

fn network() -> String {
    format!("{PROJECT}_default")
}

/// A container's address on the compose network.
fn ip(name: &str) -> Result<String> {
    let ip = docker(&[
        "inspect",
        "-f",
        "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
        name,
    ])?;
    Ok(ip.trim().to_string())
}

/// Runs a command in a container's network namespace (iptables, tc: the image has neither).
fn in_netns(name: &str, cmd: &[&str]) -> Result<String> {
    let pid = docker(&["inspect", "-f", "{{.State.Pid}}", name])?;
    let mut args = vec!["-t", pid.trim(), "-n"];
    args.extend_from_slice(cmd);
    run_env("nsenter", &args, &[])
}

fn router_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], PORT))
}

/// The router's OpenAI HTTP API.
fn http_base() -> String {
    format!("http://127.0.0.1:{HTTP_PORT}/v1")
}

/// Replicas the router reports up.
async fn replicas_up() -> usize {
    metrics(router_addr()).await.map_or(0, |text| {
        text.lines()
            .filter(|l| l.starts_with("tandem_router_replica_up{") && l.ends_with(" 1"))
            .count()
    })
}

async fn until(
    what: &str,
    timeout: Duration,
    mut check: impl AsyncFnMut() -> bool,
) -> Result<Duration> {
    let started = Instant::now();
    loop {
        if check().await {
            return Ok(started.elapsed());
        }
        ensure!(started.elapsed() < timeout, "{what} within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn all_up(timeout: Duration) -> Result<Duration> {
    until(
        "the router sees 2 prefill and 2 decode replicas",
        timeout,
        async || replicas_up().await == 4,
    )
    .await
}

/// Starts the cluster fresh and waits for every replica.
async fn cluster_up() -> Result<()> {
    if docker(&["version", "--format", "{{.Server.Version}}"]).is_err() {
        bail!(
            "Docker is not available here: the chaos suite needs Docker Engine and docker-compose"
        );
    }
    docker(&["image", "inspect", IMAGE]).with_context(|| {
        format!(
            "the image {IMAGE} is missing: run `deploy/build-image.sh {IMAGE} failpoints` \
             (scripts/chaos.sh does)"
        )
    })?;
    cluster_down();
    compose_env(&["up", "-d"], &[])?;
    all_up(Duration::from_secs(120)).await?;
    // Every container's own healthcheck passes, the router's (plaintext on its client port)
    // as much as the workers' (mutual TLS).
    for c in [
        container("router", 1),
        container("router-2", 1),
        container("prefill", 1),
        container("decode", 1),
    ] {
        until(
            &format!("{c} healthy by its compose healthcheck"),
            Duration::from_secs(60),
            async || {
                docker(&["inspect", "-f", "{{.State.Health.Status}}", &c])
                    .is_ok_and(|s| s.trim() == "healthy")
            },
        )
        .await?;
    }
    // The second router found the first by its service name and hears it over mutual TLS.
    let peer = format!(
        "tandem_router_peer_staleness_seconds{{peer=\"{}:50060\"}}",
        ip(&container("router", 1))?
    );
    until(
        "the second router hears the first",
        Duration::from_secs(30),
        async || {
            let addr = format!("127.0.0.1:{PORT_2}");
            let text = metrics(addr.parse().expect("addr"))
                .await
                .unwrap_or_default();
            tandem_integration_tests::sample(&text, &peer).is_some_and(|s| s < 2.0)
        },
    )
    .await?;
    Ok(())
}

fn cluster_down() {
    remove_proxies();
    let _ = compose_env(&["down", "-v", "--remove-orphans"], &[]);
}

/// Every sample of `name` (any labels) in a server's metrics, summed.
async fn metric_sum(addr: &str, name: &str) -> f64 {
    let Ok(text) = metrics(addr.parse().expect("socket address")).await else {
        return 0.0;
    };
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

async fn decode_metric(name: &str) -> Result<f64> {
    let mut sum = 0.0;
    for n in 1..=2 {
        sum += metric_sum(
            &format!("{}:{DECODE_PORT}", ip(&container("decode", n))?),
            name,
        )
        .await;
    }
    Ok(sum)
}

// ---------------------------------------------------------------------------------------------
// Workloads and their fault-free answers

/// One scenario's requests and the answer each must get, as token ids (gRPC) and as text
/// (the OpenAI HTTP API).
struct Case {
    requests: Vec<pb::GenerateRequest>,
    want: Vec<Vec<u32>>,
    want_text: Vec<String>,
}

const WORDS: [&str; 48] = [
    "river", "stone", "bread", "light", "market", "winter", "garden", "engine", "letter",
    "mountain", "silver", "harbor", "window", "forest", "candle", "music", "paper", "island",
    "thunder", "orchard", "bridge", "lantern", "meadow", "copper", "violin", "desert", "signal",
    "canyon", "feather", "anchor", "planet", "marble", "village", "ribbon", "glacier", "compass",
    "velvet", "pepper", "rocket", "saddle", "tunnel", "falcon", "pillow", "quarry", "timber",
    "beacon", "walnut", "crystal",
];

fn sampling(i: usize, max_tokens: u32) -> pb::SamplingParams {
    pb::SamplingParams {
        max_tokens,
        temperature: 0.7,
        top_p: Some(0.9),
        seed: 1000 + i as u64,
        ..Default::default()
    }
}

/// Computes fault-free answers with the engine alone: `tandem generate --batch` (the image's
/// release binary, target/image/tandem) on the same model file, prompts and seeds, so that a
/// cluster's completed stream must equal them token for token (C3).
struct Reference {
    binary: PathBuf,
}

/// What `tandem generate --batch` prints per request.
#[derive(serde::Deserialize)]
struct Generated {
    prompt_token_ids: Vec<u32>,
    token_ids: Vec<u32>,
    text: String,
}

impl Reference {
    fn new() -> Result<Self> {
        let binary = repo().join("target/image/tandem");
        ensure!(
            binary.exists(),
            "{} is missing: run deploy/build-image.sh (scripts/chaos.sh does)",
            binary.display()
        );
        Ok(Self { binary })
    }

    /// Each line is `{"prompt"}` or `{"token_ids"}` with a `"seed"`.
    fn generate(&self, lines: &[serde_json::Value], max_tokens: u32) -> Result<Vec<Generated>> {
        let file = out_dir().join("batch.jsonl");
        let text: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
        std::fs::write(&file, text.join("\n"))?;
        let s = sampling(0, max_tokens);
        let out = run_env(
            &self.binary.to_string_lossy(),
            &[
                "generate",
                "--model",
                MODEL,
                "--batch",
                &file.to_string_lossy(),
                "--max-tokens",
                &s.max_tokens.to_string(),
                "--temperature",
                &s.temperature.to_string(),
                "--top-p",
                &s.top_p.unwrap_or(1.0).to_string(),
            ],
            &[],
        )?;
        let answers: Vec<Generated> = out
            .lines()
            .map(serde_json::from_str)
            .collect::<Result<_, _>>()?;
        ensure!(answers.len() == lines.len(), "{} answers", answers.len());
        Ok(answers)
    }

    /// Fresh prompts: `salt` makes their text, and so their blocks, unlike any other case's.
    fn case(&self, salt: u64) -> Result<Case> {
        self.case_with(salt, MAX_TOKENS)
    }

    /// [`Reference::case`] with replies of up to `max_tokens`.
    fn case_with(&self, salt: u64, max_tokens: u32) -> Result<Case> {
        let lines: Vec<serde_json::Value> = (0..REQUESTS)
            .map(|i| {
                let mut rng = rand::rngs::StdRng::seed_from_u64(salt * 1000 + i as u64);
                let words: Vec<&str> = (0..PROMPT_WORDS)
                    .map(|_| WORDS[rng.random_range(0..WORDS.len())])
                    .collect();
                let notes = words
                    .chunks(12)
                    .map(|s| s.join(" "))
                    .collect::<Vec<_>>()
                    .join(". ");
                serde_json::json!({
                    "prompt": format!("Notes {salt}-{i}: {notes}.\nA few sentences on what these notes say:"),
                    "seed": sampling(i, max_tokens).seed,
                })
            })
            .collect();
        let answers = self.generate(&lines, max_tokens)?;
        let requests = answers
            .iter()
            .enumerate()
            .map(|(i, a)| pb::GenerateRequest {
                token_ids: a.prompt_token_ids.clone(),
                session_id: format!("chaos-{salt}-{i}"),
                sampling: Some(sampling(i, max_tokens)),
                ..Default::default()
            })
            .collect();
        Ok(Case {
            requests,
            want_text: answers.iter().map(|a| a.text.clone()).collect(),
            want: answers.into_iter().map(|a| a.token_ids).collect(),
        })
    }

    /// The second turn of each of `first`'s conversations: its prompt, its answer, and a new
    /// question; the same sessions.
    fn follow_up(&self, first: &Case) -> Result<Case> {
        let question = run_env(
            &self.binary.to_string_lossy(),
            &[
                "tokenize",
                "--model",
                MODEL,
                "--text",
                "\nAnd in one line:",
                "--json",
            ],
            &[],
        )?;
        let question: Vec<u32> = serde_json::from_str::<serde_json::Value>(&question)?["token_ids"]
            .as_array()
            .context("token_ids")?
            .iter()
            .filter_map(|v| Some(v.as_u64()? as u32))
            .collect();
        let requests: Vec<pb::GenerateRequest> = first
            .requests
            .iter()
            .zip(&first.want)
            .map(|(r, answer)| pb::GenerateRequest {
                token_ids: [r.token_ids.as_slice(), answer, &question].concat(),
                ..r.clone()
            })
            .collect();
        let lines: Vec<serde_json::Value> = requests
            .iter()
            .map(|r| serde_json::json!({"token_ids": r.token_ids, "seed": r.sampling.as_ref().map_or(0, |s| s.seed)}))
            .collect();
        let max_tokens = first.requests[0]
            .sampling
            .as_ref()
            .map_or(MAX_TOKENS, |s| s.max_tokens);
        let answers = self.generate(&lines, max_tokens)?;
        Ok(Case {
            requests,
            want_text: answers.iter().map(|a| a.text.clone()).collect(),
            want: answers.into_iter().map(|a| a.token_ids).collect(),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Clients

/// Requests sent to the router (a client's retry is one more), for the router-side
/// amplification: dispatch attempts over requests (C7).
static SENT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The router's dispatch attempts so far (`None` when it cannot be asked).
/// The router's dispatch attempts so far, but for those that continued a stream a draining
/// node handed off: a planned move, not what a fault added (C7).
async fn router_attempts() -> Option<f64> {
    let text = metrics(router_addr()).await.ok()?;
    let sample = |name| tandem_integration_tests::sample(&text, name);
    Some(sample("tandem_router_dispatch_attempts_total")? - sample("tandem_router_handoffs_total")?)
}

/// How one client behaves.
#[derive(Debug, Clone, Copy, Default)]
struct Opts {
    /// Drops the stream after this many frames.
    cancel_after: Option<usize>,
    /// A deadline other than [`DEADLINE`].
    deadline: Option<Duration>,
    /// Sends the request again (same seed) after UNAVAILABLE, keeping the frames it has and
    /// checking that the replay repeats them: what a client does while the router restarts.
    retry: bool,
}

impl Opts {
    const RETRY: Opts = Opts {
        cancel_after: None,
        deadline: None,
        retry: true,
    };
}

/// What one client saw.
#[derive(Debug, Default, Clone)]
struct Outcome {
    /// The tokens delivered, in order (a frame may carry several).
    tokens: Vec<u32>,
    /// Frames received, over every attempt.
    frames: usize,
    /// The final status: "Ok" or the gRPC code.
    status: String,
    message: String,
    /// Index gaps or repeats, a replay that differs, or OK without a final frame.
    broken: bool,
    hung: bool,
    /// The router's attempts for the final answer.
    attempts: u32,
    /// Times the client sent the request again.
    client_retries: u32,
    /// `grpc-retry-pushback-ms` on a RESOURCE_EXHAUSTED.
    pushback_ms: Option<u64>,
    /// From sending the request to its status.
    status_after: Duration,
    /// The decode replica of the final answer.
    decode: String,
    /// The text, for a client of the OpenAI HTTP API (which sees no token ids).
    text: Option<String>,
    events: Vec<serde_json::Value>,
}

/// True when the client should send the request again: the router was unreachable or went
/// away mid-stream.
fn client_retryable(s: &tonic::Status) -> bool {
    s.code() == tonic::Code::Unavailable
}

/// A stream that broke in this client's transport (the router's process died: a reset
/// connection, an h2 error) has no status from the server; tonic reports it as UNKNOWN,
/// INTERNAL or CANCELLED with the transport error as its source. gRPC's rule for a lost
/// connection is UNAVAILABLE, which is what a client should act on.
fn transport_lost(s: tonic::Status) -> tonic::Status {
    use std::error::Error as _;
    let local = s.source().is_some()
        && matches!(
            s.code(),
            tonic::Code::Unknown | tonic::Code::Internal | tonic::Code::Cancelled
        );
    if local {
        tonic::Status::unavailable(format!("connection lost: {}", s.message()))
    } else {
        s
    }
}

async fn attempt(
    client: &mut pb::generation_client::GenerationClient<Channel>,
    request: &pb::GenerateRequest,
    left: Duration,
    opts: Opts,
    out: &mut Outcome,
    event: &impl Fn(Option<u32>, &str) -> serde_json::Value,
) -> Result<bool, tonic::Status> {
    let mut req = tonic::Request::new(request.clone());
    req.set_timeout(left);
    SENT.fetch_add(1, Ordering::Relaxed);
    let mut frames = client.generate(req).await?.into_inner();
    // This attempt's frames and tokens so far. A replay after a retry must repeat the tokens
    // already delivered; its frames may group them differently (speculative decoding accepts a
    // timing-dependent number per step).
    let (mut index, mut offset) = (0, 0);
    while let Some(f) = frames.message().await? {
        out.events.push(event(Some(f.index), "frame"));
        out.broken |= f.index != index;
        index += 1;
        for &t in &f.token_ids {
            match out.tokens.get(offset) {
                Some(&delivered) => out.broken |= delivered != t,
                None => out.tokens.push(t),
            }
            offset += 1;
        }
        out.frames += 1;
        if f.finish_reason != pb::FinishReason::Unspecified as i32 {
            let route = f.route.unwrap_or_default();
            out.attempts = route.attempts.max(1);
            out.decode = route.decode;
            return Ok(true);
        }
        if opts.cancel_after.is_some_and(|n| out.frames >= n) {
            return Err(tonic::Status::cancelled("the client cancelled"));
        }
    }
    Ok(false)
}

async fn stream(
    channel: Channel,
    i: usize,
    request: pb::GenerateRequest,
    opts: Opts,
    t0: Instant,
) -> Outcome {
    let mut client = tandem_proto::limits!(pb::generation_client::GenerationClient::new(channel));
    let deadline = opts.deadline.unwrap_or(DEADLINE);
    let started = Instant::now();
    let mut out = Outcome::default();
    let event = |index: Option<u32>, status: &str| serde_json::json!({"request": i, "index": index, "t_ms": t0.elapsed().as_secs_f64() * 1e3, "status": status});
    let body = async {
        loop {
            let left = deadline.saturating_sub(started.elapsed());
            match attempt(&mut client, &request, left, opts, &mut out, &event)
                .await
                .map_err(transport_lost)
            {
                Err(s)
                    if opts.retry
                        && client_retryable(&s)
                        && started.elapsed() + Duration::from_millis(500) < deadline =>
                {
                    out.events
                        .push(event(None, &format!("retry after {:?}", s.code())));
                    out.client_retries += 1;
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                r => return r,
            }
        }
    };
    // C1: every stream ends by its deadline plus 1 s.
    match tokio::time::timeout(deadline + Duration::from_secs(1), body).await {
        Ok(Ok(finished)) => {
            out.broken |= !finished;
            out.status = "Ok".into();
        }
        Ok(Err(s)) => {
            out.status = format!("{:?}", s.code());
            out.message = s.message().to_string();
            out.pushback_ms = s
                .metadata()
                .get("grpc-retry-pushback-ms")
                .and_then(|v| v.to_str().ok()?.parse().ok());
        }
        Err(_) => {
            out.hung = true;
            out.status = "hung".into();
        }
    }
    out.status_after = started.elapsed();
    out.attempts = out.attempts.max(1);
    let status = out.status.clone();
    let mut last = event(None, &status);
    if !out.message.is_empty() {
        last["message"] = out.message.clone().into();
    }
    out.events.push(last);
    out
}

/// Runs `case`'s requests, `streams` at once: each once, or, with `until`, round and round
/// until it is set. Returns (request index, outcome) in the order they were started.
async fn traffic(
    case: &Case,
    streams: usize,
    opts: impl Fn(usize) -> Opts,
    until: Option<Arc<AtomicBool>>,
    t0: Instant,
) -> Result<Vec<(usize, Outcome)>> {
    let channel = tandem_net::channel(&router_addr().to_string(), None)?;
    let slots = Arc::new(tokio::sync::Semaphore::new(streams));
    let mut tasks = Vec::new();
    for n in 0.. {
        let i = n % REQUESTS;
        match &until {
            None if n == REQUESTS => break,
            Some(stop) if stop.load(Ordering::Relaxed) => break,
            _ => {}
        }
        let slot = slots.clone().acquire_owned().await?;
        if until
            .as_ref()
            .is_some_and(|stop| stop.load(Ordering::Relaxed))
        {
            break;
        }
        let (channel, request, o) = (channel.clone(), case.requests[i].clone(), opts(n));
        tasks.push((
            i,
            tokio::spawn(async move {
                let out = stream(channel, n, request, o, t0).await;
                drop(slot);
                out
            }),
        ));
    }
    let mut out = Vec::new();
    for (i, t) in tasks {
        out.push((i, t.await?));
    }
    Ok(out)
}

/// Decode nodes' slots and reservations back to idle (C5), read from each node directly.
async fn leaked_blocks() -> Result<u64> {
    let mut leaked = 0;
    for n in 1..=2 {
        let addr = format!("{}:{DECODE_PORT}", ip(&container("decode", n))?);
        // The router's certificate: Worker is the router's to call.
        let tls = tandem_net::tls::Tls::load(&certs_dir(), tandem_net::tls::Role::Router)?;
        let mut worker = pb::worker_client::WorkerClient::new(tandem_net::channel(
            &addr,
            Some(tls.client_config()),
        )?);
        let settled = until("decode node idle", Duration::from_secs(12), async || {
            worker.load(pb::LoadRequest {}).await.is_ok_and(|l| {
                let l = l.into_inner();
                l.active == 0 && l.kv_blocks_free == l.kv_blocks_total
            })
        })
        .await;
        if settled.is_err() {
            let l = worker.load(pb::LoadRequest {}).await?.into_inner();
            leaked += l.kv_blocks_total - l.kv_blocks_free;
        }
    }
    Ok(leaked)
}

// ---------------------------------------------------------------------------------------------
// Scoring

/// One scenario's row of the results table.
#[derive(Debug, Default, serde::Serialize)]
struct Row {
    fault: String,
    requests: usize,
    completed_exactly: usize,
    failed_by_code: BTreeMap<String, usize>,
    hung: usize,
    lost_or_duplicated: usize,
    different: usize,
    /// Attempts on the streams that completed, as their final frames report them.
    attempts_per_request: f64,
    /// The router's dispatch attempts over the requests sent to it, failed ones included and a
    /// drain's hand-offs not (`None` when the router restarted during the scenario).
    router_attempts_per_request: Option<f64>,
    client_retries: usize,
    detection_s: Option<f64>,
    recovery_s: Option<f64>,
    leaked_kv_blocks: u64,
    /// What this scenario checks beyond C1-C7, and found wrong.
    failures: Vec<String>,
    notes: Vec<String>,
    #[serde(skip)]
    expect_detection: bool,
    #[serde(skip)]
    allowed: &'static [&'static str],
}

/// Codes a fault may end a stream with (C4); each scenario allows those its fault explains.
const NODE_LOSS: &[&str] = &["Unavailable", "DataLoss"];

impl Row {
    /// The contract: no hang (C1), nothing lost or duplicated (C2), completed streams equal the
    /// fault-free answer (C3), only the codes the fault explains (C4), no leak (C5), detection
    /// within keepalive interval plus timeout (C6), bounded amplification (C7).
    fn check(&self) -> Result<()> {
        let f = &self.fault;
        ensure!(self.hung == 0, "{f}: {} streams hung", self.hung);
        ensure!(
            self.lost_or_duplicated == 0,
            "{f}: tokens lost or duplicated"
        );
        ensure!(
            self.different == 0,
            "{f}: {} completed streams differ",
            self.different
        );
        for code in self.failed_by_code.keys() {
            ensure!(
                self.allowed.contains(&code.as_str()),
                "{f}: status {code} reached a client"
            );
        }
        if self.expect_detection {
            // A node that went down must be taken back once healed.
            ensure!(self.recovery_s.is_some(), "{f}: the node never came back");
            let bound =
                (tandem_net::KEEPALIVE_INTERVAL + tandem_net::KEEPALIVE_TIMEOUT).as_secs_f64();
            ensure!(
                self.detection_s.is_some_and(|d| d <= bound),
                "{f}: detected after {:?} s (bound {bound} s)",
                self.detection_s
            );
        }
        ensure!(
            self.leaked_kv_blocks == 0,
            "{f}: {} KV blocks leaked",
            self.leaked_kv_blocks
        );
        let attempts = self
            .router_attempts_per_request
            .unwrap_or(self.attempts_per_request);
        ensure!(
            attempts <= 1.2 + 1e-9,
            "{f}: {attempts:.2} attempts per request"
        );
        ensure!(
            self.failures.is_empty(),
            "{f}: {}",
            self.failures.join("; ")
        );
        Ok(())
    }
}

fn score(fault: &str, case: &Case, got: &[(usize, Outcome)], allowed: &'static [&str]) -> Row {
    let mut row = Row {
        fault: fault.into(),
        requests: got.len(),
        attempts_per_request: got.iter().map(|(_, o)| f64::from(o.attempts)).sum::<f64>()
            / got.len().max(1) as f64,
        allowed,
        ..Row::default()
    };
    for (i, g) in got {
        row.hung += usize::from(g.hung);
        row.lost_or_duplicated += usize::from(g.broken);
        row.client_retries += g.client_retries as usize;
        if g.status == "Ok" {
            let exact = match &g.text {
                Some(text) => *text == case.want_text[*i],
                None => g.tokens == case.want[*i],
            };
            if exact {
                row.completed_exactly += 1;
            } else {
                row.different += 1;
            }
        } else if !g.hung {
            *row.failed_by_code.entry(g.status.clone()).or_default() += 1;
        }
    }
    row
}

/// The row's leak check, and the client events written out.
async fn finish(mut row: Row, got: &[(usize, Outcome)]) -> Result<Row> {
    row.leaked_kv_blocks = leaked_blocks().await?;
    row.notes.insert(
        0,
        format!(
            "median request {:.1} s",
            median(got.iter().map(|(_, o)| o.status_after.as_secs_f64()))
        ),
    );
    let events: Vec<String> = got
        .iter()
        .flat_map(|(_, o)| o.events.iter().map(|e| e.to_string()))
        .collect();
    let slug: String = row
        .fault
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join("-");
    std::fs::write(
        out_dir().join(format!("events-{slug}.jsonl")),
        events.join("\n") + "\n",
    )?;
    println!(
        "chaos: {}: {}/{} exact, {:?}",
        row.fault, row.completed_exactly, row.requests, row.failed_by_code
    );
    Ok(row)
}

/// Seconds from `healed` until every replica is back, if that happens within [`RECOVERY`].
async fn recovered_since(healed: Instant) -> Option<f64> {
    all_up(RECOVERY)
        .await
        .ok()
        .map(|_| healed.elapsed().as_secs_f64())
}

/// Waits until the router has seen `n` replicas go down, from `since`.
async fn detection(n: usize, since: Instant) -> Option<f64> {
    until("the router notices", Duration::from_secs(30), async || {
        replicas_up().await <= 4 - n
    })
    .await
    .ok()
    .map(|_| since.elapsed().as_secs_f64())
}

// ---------------------------------------------------------------------------------------------
// Faults on one node

/// A fault on one container: what to do once traffic is flowing, and how to undo it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NodeFault {
    KillDecode,
    PauseDecode,
    KillPrefill,
    DisconnectDecode,
}

impl NodeFault {
    fn name(self) -> &'static str {
        match self {
            NodeFault::KillDecode => "decode killed mid-stream",
            NodeFault::PauseDecode => "decode paused 8 s mid-stream",
            NodeFault::KillPrefill => "prefill killed during prefill",
            NodeFault::DisconnectDecode => "decode disconnected from the network 8 s",
        }
    }

    fn service(self) -> &'static str {
        match self {
            NodeFault::KillPrefill => "prefill",
            _ => "decode",
        }
    }

    fn inject(self, victim: &str) -> Result<()> {
        match self {
            NodeFault::KillDecode | NodeFault::KillPrefill => docker(&["kill", victim]).map(drop),
            NodeFault::PauseDecode => docker(&["pause", victim]).map(drop),
            NodeFault::DisconnectDecode => {
                docker(&["network", "disconnect", &network(), victim]).map(drop)
            }
        }
    }

    fn heal(self, victim: &str) -> Result<()> {
        match self {
            NodeFault::KillDecode | NodeFault::KillPrefill => docker(&["start", victim]).map(drop),
            NodeFault::PauseDecode => docker(&["unpause", victim]).map(drop),
            // Compose's service-name alias must be restored, or DNS would not find it again.
            NodeFault::DisconnectDecode => docker(&[
                "network",
                "connect",
                "--alias",
                self.service(),
                &network(),
                victim,
            ])
            .map(drop),
        }
    }
}

async fn node_fault(fault: NodeFault, case: &Case) -> Result<Row> {
    let victim = container(fault.service(), 1);
    let t0 = Instant::now();
    let run = traffic(case, STREAMS, |_| Opts::default(), None, t0);
    let inject = async {
        // Once streams are flowing (prefill: while the first prompts are computed).
        let delay = match fault {
            NodeFault::KillPrefill => Duration::from_millis(300),
            _ => Duration::from_millis(1500),
        };
        tokio::time::sleep(delay).await;
        fault.inject(&victim)?;
        let injected = Instant::now();
        let detection_s = detection(1, injected).await;
        if matches!(fault, NodeFault::PauseDecode | NodeFault::DisconnectDecode) {
            tokio::time::sleep(Duration::from_secs(8).saturating_sub(injected.elapsed())).await;
        }
        anyhow::Ok(detection_s)
    };
    let (got, detection_s) = tokio::join!(run, inject);
    let (got, detection_s) = (got?, detection_s?);
    fault.heal(&victim)?;
    let healed = Instant::now();
    let mut row = score(fault.name(), case, &got, NODE_LOSS);
    row.expect_detection = true;
    row.detection_s = detection_s;
    row.recovery_s = recovered_since(healed).await;
    finish(row, &got).await
}

// ---------------------------------------------------------------------------------------------
// Faults on the KV path (prefill -> decode), from iptables, tc and a failpoint

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KvFault {
    /// Every KV connection reset (iptables REJECT --reject-with tcp-reset, for 2 s).
    Resets,
    /// 5% of the packets prefill nodes send to decode nodes dropped (iptables statistic).
    Loss,
    /// Prefill nodes' egress capped at 40 Mbit/s (tc tbf).
    Cap,
    /// 10% of pushes with a corrupted chunk (the image's failpoint).
    Corrupt,
}

impl KvFault {
    fn name(self) -> &'static str {
        match self {
            KvFault::Resets => "KV connections reset for 2 s",
            KvFault::Loss => "KV path 5% packet loss",
            KvFault::Cap => "KV path capped at 40 Mbit/s",
            KvFault::Corrupt => "KV bytes corrupted (10% of pushes)",
        }
    }

    /// The iptables rule (after -I/-D INPUT) on each decode node for packets from prefill.
    fn rule(self, prefills: &str) -> Vec<String> {
        let mut r: Vec<String> = ["-p", "tcp", "--dport", "50053", "-s", prefills]
            .map(String::from)
            .to_vec();
        match self {
            KvFault::Resets => {
                r.extend(["-j", "REJECT", "--reject-with", "tcp-reset"].map(String::from))
            }
            _ => r.extend(
                [
                    "-m",
                    "statistic",
                    "--mode",
                    "random",
                    "--probability",
                    "0.05",
                    "-j",
                    "DROP",
                ]
                .map(String::from),
            ),
        }
        r
    }

    fn iptables(self, op: &str) -> Result<()> {
        let prefills = format!(
            "{},{}",
            ip(&container("prefill", 1))?,
            ip(&container("prefill", 2))?
        );
        for n in 1..=2 {
            let mut cmd = vec!["iptables".to_string(), op.to_string(), "INPUT".to_string()];
            cmd.extend(self.rule(&prefills));
            let cmd: Vec<&str> = cmd.iter().map(String::as_str).collect();
            in_netns(&container("decode", n), &cmd)?;
        }
        Ok(())
    }

    fn tbf(add: bool) -> Result<()> {
        for n in 1..=2 {
            let c = container("prefill", n);
            if add {
                in_netns(
                    &c,
                    &[
                        "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", "40mbit",
                        "burst", "64kb", "latency", "400ms",
                    ],
                )?;
            } else {
                in_netns(&c, &["tc", "qdisc", "del", "dev", "eth0", "root"])?;
            }
        }
        Ok(())
    }

    /// Recreates the prefill nodes with the corruption failpoint at `share`.
    async fn corruption(share: &str) -> Result<()> {
        compose_env(
            &["up", "-d", "--no-deps", "--force-recreate", "prefill"],
            &[("TANDEM_FAILPOINT_CORRUPT_KV", share)],
        )?;
        // The old addresses leave and the new ones join through DNS.
        tokio::time::sleep(Duration::from_secs(3)).await;
        all_up(RECOVERY).await.map(drop)
    }
}

async fn kv_fault(fault: KvFault, case: &Case) -> Result<Row> {
    match fault {
        KvFault::Loss => fault.iptables("-I")?,
        KvFault::Cap => KvFault::tbf(true)?,
        KvFault::Corrupt => KvFault::corruption("0.1").await?,
        KvFault::Resets => {}
    }
    let bytes_before = decode_metric("tandem_kv_transfer_bytes_total").await?;
    let crc_before = decode_metric("tandem_kv_transfer_rejects_total{reason=\"crc\"}").await?;
    let t0 = Instant::now();
    let resets = async {
        if fault == KvFault::Resets {
            // While the first wave's KV is crossing: every push sent in these 2 s is reset.
            tokio::time::sleep(Duration::from_millis(500)).await;
            fault.iptables("-I")?;
            tokio::time::sleep(Duration::from_secs(2)).await;
            fault.iptables("-D")?;
        }
        anyhow::Ok(())
    };
    let (got, injected) = tokio::join!(
        traffic(case, STREAMS, |_| Opts::default(), None, t0),
        resets
    );
    injected?;
    let got = got?;
    let bytes = decode_metric("tandem_kv_transfer_bytes_total").await? - bytes_before;
    let crc = decode_metric("tandem_kv_transfer_rejects_total{reason=\"crc\"}").await? - crc_before;
    match fault {
        KvFault::Loss => fault.iptables("-D")?,
        KvFault::Cap => KvFault::tbf(false)?,
        KvFault::Corrupt => KvFault::corruption("0").await?,
        KvFault::Resets => {}
    }
    let mut row = score(fault.name(), case, &got, NODE_LOSS);
    row.notes
        .push(format!("{:.1} MB of KV accepted", bytes / 1e6));
    if bytes == 0.0 {
        row.failures
            .push("no KV crossed the network: the fault touched nothing".into());
    }
    if fault == KvFault::Resets && row.attempts_per_request <= 1.0 {
        row.failures
            .push("the resets broke no push: nothing was retried".into());
    }
    if fault == KvFault::Corrupt {
        row.notes.push(format!("{crc} pushes rejected by CRC"));
        if crc == 0.0 {
            row.failures.push("no corrupted push was caught".into());
        }
    }
    finish(row, &got).await
}

// ---------------------------------------------------------------------------------------------
// Between router and decode: fault-proxies (latency, blackhole)

fn proxy(n: usize) -> String {
    container("lag", n)
}

fn remove_proxies() {
    for n in 1..=2 {
        let _ = docker(&["rm", "-f", &proxy(n)]);
    }
}

/// Puts a fault-proxy in front of each decode node, and the router behind them.
async fn proxies_in(latency_ms: u64, jitter_ms: u64) -> Result<()> {
    for n in 1..=2 {
        let upstream = format!("{}:{DECODE_PORT}", ip(&container("decode", n))?);
        docker(&[
            "run",
            "-d",
            "--name",
            &proxy(n),
            "--network",
            &network(),
            "--network-alias",
            "decodelag",
            IMAGE,
            "fault-proxy",
            "--listen",
            "0.0.0.0:7000",
            "--admin",
            "0.0.0.0:7001",
            "--upstream",
            &upstream,
            "--latency-ms",
            &latency_ms.to_string(),
            "--jitter-ms",
            &jitter_ms.to_string(),
        ])?;
    }
    compose_env(
        &["up", "-d", "--no-deps", "router"],
        &[("TANDEM_CHAOS_DECODE", "decodelag:7000")],
    )?;
    all_up(RECOVERY).await.map(drop)
}

async fn proxies_out() -> Result<()> {
    compose_env(&["up", "-d", "--no-deps", "router"], &[])?;
    remove_proxies();
    all_up(RECOVERY).await.map(drop)
}

/// `PUT /faults` on proxy `n`'s admin endpoint.
async fn set_faults(n: usize, json: &str) -> Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(format!("{}:7001", ip(&proxy(n))?)).await?;
    conn.write_all(
        format!(
            "PUT /faults HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{json}",
            json.len()
        )
        .as_bytes(),
    )
    .await?;
    let mut answer = String::new();
    conn.read_to_string(&mut answer).await?;
    ensure!(answer.starts_with("HTTP/1.1 200"), "PUT /faults: {answer}");
    Ok(())
}

async fn latency(case: &Case) -> Result<Row> {
    let got = traffic(case, STREAMS, |_| Opts::default(), None, Instant::now()).await?;
    let row = score("100 ± 30 ms between router and decode", case, &got, &[]);
    finish(row, &got).await
}

fn median(xs: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = xs.collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

async fn blackhole(case: &Case) -> Result<Row> {
    let t0 = Instant::now();
    let inject = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        set_faults(1, r#"{"blackhole":true}"#).await?;
        let at = Instant::now();
        let d = detection(1, at).await;
        tokio::time::sleep(Duration::from_secs(8).saturating_sub(at.elapsed())).await;
        anyhow::Ok(d)
    };
    let (got, d) = tokio::join!(
        traffic(case, STREAMS, |_| Opts::default(), None, t0),
        inject
    );
    let (got, d) = (got?, d?);
    set_faults(1, "{}").await?;
    let healed = Instant::now();
    let mut row = score("decode blackholed 8 s (fault-proxy)", case, &got, NODE_LOSS);
    row.expect_detection = true;
    row.detection_s = d;
    row.recovery_s = recovered_since(healed).await;
    finish(row, &got).await
}

// ---------------------------------------------------------------------------------------------
// Clients, the router, sessions, restarts, load

async fn client_cancel(case: &Case) -> Result<Row> {
    // Every fourth drops its stream after 4 frames; every fourth (offset) has a 1.5 s deadline.
    let opts = |n: usize| match n % 4 {
        1 => Opts {
            cancel_after: Some(4),
            ..Opts::default()
        },
        3 => Opts {
            deadline: Some(Duration::from_millis(1500)),
            ..Opts::default()
        },
        _ => Opts::default(),
    };
    let got = traffic(case, STREAMS, opts, None, Instant::now()).await?;
    let mut row = score(
        "client cancel and 1.5 s deadline",
        case,
        &got,
        &["Cancelled", "DeadlineExceeded"],
    );
    for (n, (_, o)) in got.iter().enumerate() {
        if n % 4 == 1 && o.status != "Cancelled" {
            row.failures
                .push(format!("request {n} was to be cancelled: {}", o.status));
        }
        if n % 4 == 3 && o.status_after > Duration::from_millis(2500) {
            row.failures.push(format!(
                "request {n} ended {:?} after its 1.5 s deadline",
                o.status_after
            ));
        }
    }
    let quiet = Instant::now();
    finish(row, &got).await.map(|mut row| {
        row.notes.push(format!(
            "decode nodes idle {:.2} s after the last stream",
            quiet.elapsed().as_secs_f64()
        ));
        row
    })
}

async fn router_restart(case: &Case) -> Result<Row> {
    let t0 = Instant::now();
    let router = container("router", 1);
    let fault = async {
        tokio::time::sleep(Duration::from_millis(2500)).await;
        docker(&["kill", &router])?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        docker(&["start", &router])?;
        let started = Instant::now();
        all_up(RECOVERY)
            .await
            .map(|_| started.elapsed().as_secs_f64())
    };
    let (got, recovery) = tokio::join!(traffic(case, STREAMS, |_| Opts::RETRY, None, t0), fault);
    let got = got?;
    let mut row = score("router killed and restarted", case, &got, NODE_LOSS);
    row.recovery_s = Some(recovery?);
    if row.client_retries == 0 {
        row.failures
            .push("no client noticed the router going".into());
    }
    finish(row, &got).await
}

async fn session_holder_killed(first: &Case, second: &Case) -> Result<Row> {
    let turn1 = traffic(first, STREAMS, |_| Opts::default(), None, Instant::now()).await?;
    let victim = container("decode", 1);
    let victim_ip = format!("{}:{DECODE_PORT}", ip(&victim)?);
    let held = turn1.iter().filter(|(_, o)| o.decode == victim_ip).count();
    docker(&["kill", &victim])?;
    let killed = Instant::now();
    let (got, d) = tokio::join!(
        traffic(second, STREAMS, |_| Opts::default(), None, Instant::now()),
        detection(1, killed)
    );
    let got = got?;
    docker(&["start", &victim])?;
    let healed = Instant::now();
    let mut row = score(
        "session holder killed between turns",
        second,
        &got,
        NODE_LOSS,
    );
    row.expect_detection = true;
    row.detection_s = d;
    row.notes.push(format!(
        "{held} of {REQUESTS} sessions were held by the killed node"
    ));
    if held == 0 {
        row.failures
            .push("no session was on the killed node".into());
    }
    row.recovery_s = recovered_since(healed).await;
    finish(row, &got).await
}

async fn rolling_restart(case: &Case) -> Result<Row> {
    let stop = Arc::new(AtomicBool::new(false));
    let restarts = async {
        let started = Instant::now();
        for c in [
            container("prefill", 1),
            container("prefill", 2),
            container("decode", 1),
            container("decode", 2),
            container("router", 1),
        ] {
            tokio::time::sleep(Duration::from_secs(2)).await;
            // SIGTERM: the node drains its streams, then exits; then it starts again.
            docker(&["restart", "-t", "15", &c])?;
            all_up(RECOVERY).await?;
        }
        stop.store(true, Ordering::Relaxed);
        anyhow::Ok(started.elapsed().as_secs_f64())
    };
    let (got, took) = tokio::join!(
        traffic(
            case,
            STREAMS,
            |_| Opts::RETRY,
            Some(stop.clone()),
            Instant::now()
        ),
        restarts
    );
    let got = got?;
    let mut row = score("rolling restart of every role", case, &got, NODE_LOSS);
    row.recovery_s = Some(took?);
    row.notes
        .push(format!("{} requests across 5 restarts", got.len()));
    finish(row, &got).await
}

// ---------------------------------------------------------------------------------------------
// Clients of the OpenAI HTTP API, through stops

/// A request of a case as a streamed OpenAI completion: its prompt's token ids, its sampling.
fn completion(model: &str, r: &pb::GenerateRequest) -> serde_json::Value {
    let s = r.sampling.clone().unwrap_or_default();
    serde_json::json!({
        "model": model,
        "prompt": r.token_ids,
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "seed": s.seed,
        "stream": true,
    })
}

/// The first wave of `case` ([`STREAMS`] requests) as OpenAI HTTP streams, each read to its
/// third chunk: all running at once, for the fault to hit.
async fn http_wave(
    http: &reqwest::Client,
    model: &str,
    case: &Case,
) -> Result<Vec<(SseStream, Instant)>> {
    let url = format!("{}/completions", http_base());
    let mut streams = Vec::new();
    for r in &case.requests[..STREAMS] {
        SENT.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        streams.push((
            SseStream::start(http, &url, &completion(model, r)).await?,
            started,
        ));
    }
    for (s, _) in &mut streams {
        s.read_until(3).await?;
    }
    Ok(streams)
}

/// Reads each stream to its end (C1: by its deadline plus 1 s), as an outcome: OK is `[DONE]`
/// with no error event; an error event's code is the status; a stream that closes with
/// neither is broken (C2).
async fn http_outcomes(streams: Vec<(SseStream, Instant)>, t0: Instant) -> Vec<(usize, Outcome)> {
    let tasks: Vec<_> = streams
        .into_iter()
        .map(|(mut s, started)| {
            tokio::spawn(async move {
                let mut out = Outcome::default();
                let left = (DEADLINE + Duration::from_secs(1)).saturating_sub(started.elapsed());
                match tokio::time::timeout(left, s.finish()).await {
                    Err(_) => {
                        out.hung = true;
                        out.status = "hung".into();
                    }
                    Ok(Err(e)) => {
                        out.broken = true;
                        out.status = "closed".into();
                        out.message = format!("{e:#}");
                    }
                    Ok(Ok(())) => match &s.error {
                        None => out.status = "Ok".into(),
                        Some(error) => {
                            out.status = error["code"].as_str().unwrap_or("error").to_string();
                            out.message = error["message"].as_str().unwrap_or_default().into();
                        }
                    },
                }
                out.status_after = started.elapsed();
                out.frames = s.chunks;
                out.attempts = 1;
                out.text = Some(s.text.clone());
                out.events.push(serde_json::json!({
                    "t_ms": t0.elapsed().as_secs_f64() * 1e3,
                    "chunks": s.chunks,
                    "status": out.status,
                    "message": out.message,
                }));
                out
            })
        })
        .collect();
    let mut got = Vec::new();
    for (i, t) in tasks.into_iter().enumerate() {
        got.push((
            i,
            t.await.unwrap_or_else(|e| Outcome {
                status: format!("client task failed: {e}"),
                ..Outcome::default()
            }),
        ));
    }
    got
}

/// SIGTERM to the router with OpenAI HTTP streams in flight: it drains them (each completes
/// exactly), refuses what arrives meanwhile at once (503 with Retry-After), exits, and starts
/// again.
async fn http_router_stop(case: &Case) -> Result<Row> {
    let http = reqwest::Client::new();
    let model = http_model(&http, &http_base()).await?;
    let t0 = Instant::now();
    let streams = http_wave(&http, &model, case).await?;
    let router = container("router", 1);
    docker(&["kill", "-s", "TERM", &router])?;
    let health = format!("http://127.0.0.1:{HTTP_PORT}/health");
    until(
        "the router says it drains",
        Duration::from_secs(5),
        async || {
            http.get(&health)
                .send()
                .await
                .is_ok_and(|r| r.status() == 503)
        },
    )
    .await?;
    let mut failures = Vec::new();
    let probe = http
        .post(format!("{}/completions", http_base()))
        .json(&completion(&model, &case.requests[STREAMS]))
        .send()
        .await;
    match probe {
        Ok(r) if r.status() == 503 && r.headers().contains_key("retry-after") => {}
        Ok(r) => failures.push(format!(
            "a request during the drain got HTTP {} (retry-after: {:?})",
            r.status(),
            r.headers().get("retry-after")
        )),
        Err(e) => failures.push(format!("a request during the drain: {e}")),
    }
    let got = http_outcomes(streams, t0).await;
    // Once drained, it exits; then it starts again.
    docker(&["wait", &router])?;
    docker(&["start", &router])?;
    let started = Instant::now();
    let recovery = all_up(RECOVERY).await?;
    let mut row = score("router SIGTERM, OpenAI HTTP streams", case, &got, &[]);
    row.recovery_s = Some(recovery.as_secs_f64());
    row.notes.push(format!(
        "back {:.1} s after its restart",
        started.elapsed().as_secs_f64()
    ));
    row.failures.extend(failures);
    finish(row, &got).await
}

/// SIGTERM to every decode node at once with OpenAI HTTP streams in flight: each node hands
/// its streams off, none is left outside a drain to take them, so the router sends each back
/// to the node holding its KV, which finishes it within its grace; then both start again.
async fn http_decode_stop(case: &Case) -> Result<Row> {
    let http = reqwest::Client::new();
    let model = http_model(&http, &http_base()).await?;
    let router = router_addr().to_string();
    let returned_before = metric_sum(&router, "tandem_router_last_resort_total").await;
    let t0 = Instant::now();
    let streams = http_wave(&http, &model, case).await?;
    let (d1, d2) = (container("decode", 1), container("decode", 2));
    docker(&["kill", "-s", "TERM", &d1, &d2])?;
    let stopped = Instant::now();
    let got = http_outcomes(streams, t0).await;
    let took = stopped.elapsed();
    let returned = metric_sum(&router, "tandem_router_last_resort_total").await - returned_before;
    docker(&["wait", &d1, &d2])?;
    docker(&["start", &d1, &d2])?;
    let started = Instant::now();
    all_up(RECOVERY).await?;
    let mut row = score(
        "every decode node SIGTERM at once, OpenAI HTTP streams",
        case,
        &got,
        &[],
    );
    row.recovery_s = Some(started.elapsed().as_secs_f64());
    row.notes.push(format!(
        "streams done {:.1} s after the SIGTERM; {returned:.0} sent back to a draining node",
        took.as_secs_f64()
    ));
    // The compose file's TANDEM_GRACE_MS.
    let grace = Duration::from_secs(10);
    if took > grace {
        row.failures.push(format!(
            "the streams took {took:?}, past the {grace:?} grace"
        ));
    }
    if returned == 0.0 {
        row.failures
            .push("no stream went back to a draining node: the fault touched nothing".into());
    }
    finish(row, &got).await
}

/// A fault on a decode node's drain (SIGTERM while streams run), which hands its running
/// streams off to the other decode node with their KV and offers it its cached sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DrainFault {
    /// The draining node killed (SIGKILL) 300 ms into its drain: the peer's fetches of what it
    /// kept fail mid-way, and the streams and sessions are computed again instead.
    Killed,
    /// Every other client drops its stream after 3 to 11 frames, racing the drain.
    Cancels,
    /// Every request at once (32): the peer's batch slots are full when the drained node's
    /// streams move to it, so they wait in the router's queue with their KV kept.
    PeerFull,
}

impl DrainFault {
    fn name(self) -> &'static str {
        match self {
            DrainFault::Killed => "decode killed 300 ms into its drain",
            DrainFault::Cancels => "clients cancelling through a decode drain",
            DrainFault::PeerFull => "peer full through a decode drain",
        }
    }
}

async fn drain_fault(fault: DrainFault, case: &Case) -> Result<Row> {
    let victim = container("decode", 1);
    let router = router_addr().to_string();
    let moved = async || {
        (
            metric_sum(&router, "tandem_router_handoffs_total").await,
            metric_sum(&router, "tandem_router_fetched_tokens_total").await,
            metric_sum(&router, "tandem_router_moved_sessions_total").await,
        )
    };
    let before = moved().await;
    let streams = match fault {
        DrainFault::PeerFull => REQUESTS,
        _ => STREAMS,
    };
    let opts = move |n: usize| match fault {
        DrainFault::Cancels if n % 2 == 1 => Opts {
            cancel_after: Some(3 + n % 9),
            ..Opts::default()
        },
        _ => Opts::default(),
    };
    let drain = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        if fault == DrainFault::Killed {
            docker(&["kill", "-s", "TERM", &victim])?;
            tokio::time::sleep(Duration::from_millis(300)).await;
            // It may have finished its drain and exited already.
            let _ = docker(&["kill", &victim]);
            docker(&["start", &victim])?;
        } else {
            // SIGTERM: the node drains, then exits; then it starts again.
            docker(&["restart", "-t", "15", &victim])?;
        }
        let started = Instant::now();
        all_up(RECOVERY)
            .await
            .map(|_| started.elapsed().as_secs_f64())
    };
    let (got, recovery) = tokio::join!(traffic(case, streams, opts, None, Instant::now()), drain);
    let got = got?;
    const CANCELS: &[&str] = &["Cancelled", "Unavailable", "DataLoss"];
    let allowed = match fault {
        DrainFault::Cancels => CANCELS,
        _ => NODE_LOSS,
    };
    let mut row = score(fault.name(), case, &got, allowed);
    row.recovery_s = Some(recovery?);
    if fault == DrainFault::Cancels {
        for (n, (_, o)) in got.iter().enumerate() {
            if n % 2 == 1 && o.status != "Cancelled" {
                row.failures
                    .push(format!("request {n} was to be cancelled: {}", o.status));
            }
        }
    }
    let after = moved().await;
    row.notes.push(format!(
        "the router: {:.0} streams handed off, {:.0} prompt tokens fetched, {:.0} cached \
         sessions moved",
        after.0 - before.0,
        after.1 - before.1,
        after.2 - before.2
    ));
    finish(row, &got).await
}

async fn overload(case: &Case) -> Result<Row> {
    // 3x the decode nodes' batch slots (2 x 16), all at once.
    let n = 3 * 2 * 16;
    let channel = tandem_net::channel(&router_addr().to_string(), None)?;
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..n)
        .map(|k| {
            let (channel, request) = (channel.clone(), case.requests[k % REQUESTS].clone());
            tokio::spawn(stream(channel, k, request, Opts::default(), t0))
        })
        .collect();
    let mut got = Vec::new();
    for (k, t) in tasks.into_iter().enumerate() {
        got.push((k % REQUESTS, t.await?));
    }
    let mut row = score(
        "overload: 3x capacity at once",
        case,
        &got,
        &["ResourceExhausted"],
    );
    for (k, (_, o)) in got.iter().enumerate() {
        if o.status == "ResourceExhausted" {
            if o.pushback_ms.is_none() {
                row.failures
                    .push(format!("request {k}: RESOURCE_EXHAUSTED without pushback"));
            }
            if o.status_after > Duration::from_secs(1) {
                row.failures.push(format!(
                    "request {k}: refused only after {:?}",
                    o.status_after
                ));
            }
        }
    }
    for c in ["prefill_1", "prefill_2", "decode_1", "decode_2", "router_1"] {
        let state = docker(&[
            "inspect",
            "-f",
            "{{.State.Running}} {{.State.OOMKilled}}",
            &format!("{PROJECT}_{c}"),
        ])?;
        if state.trim() != "true false" {
            row.failures
                .push(format!("{c}: running, OOM-killed = {}", state.trim()));
        }
    }
    finish(row, &got).await
}

async fn soak(case: &Case, length: Duration) -> Result<Row> {
    let stop = Arc::new(AtomicBool::new(false));
    let faults = async {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let started = Instant::now();
        let mut log = Vec::new();
        while started.elapsed() < length {
            let fault = [
                NodeFault::KillDecode,
                NodeFault::PauseDecode,
                NodeFault::KillPrefill,
                NodeFault::DisconnectDecode,
            ][rng.random_range(0..4)];
            let victim = container(fault.service(), rng.random_range(1..=2));
            // A fault every 10-25 s, each lasting 2-8 s.
            tokio::time::sleep(Duration::from_millis(rng.random_range(4000..12000))).await;
            fault.inject(&victim)?;
            tokio::time::sleep(Duration::from_millis(rng.random_range(2000..8000))).await;
            fault.heal(&victim)?;
            all_up(RECOVERY).await?;
            log.push(format!("{} on {victim}", fault.name()));
        }
        stop.store(true, Ordering::Relaxed);
        anyhow::Ok(log)
    };
    let (got, log) = tokio::join!(
        traffic(
            case,
            STREAMS,
            |_| Opts::RETRY,
            Some(stop.clone()),
            Instant::now()
        ),
        faults
    );
    let (got, log) = (got?, log?);
    let mut row = score(
        &format!("random faults for {} s", length.as_secs()),
        case,
        &got,
        NODE_LOSS,
    );
    row.notes
        .push(format!("{} faults: {}", log.len(), log.join(", ")));
    finish(row, &got).await
}

// ---------------------------------------------------------------------------------------------
// The suite

fn report(rows: &[Row]) -> Result<()> {
    let mut md = String::from(
        "| fault | requests | completed exactly | failed (by code) | hung | lost/duplicated | differing | attempts/request (completed; router) | client retries | detection s | recovery s | leaked KV blocks | notes |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let s = |x: Option<f64>| x.map_or_else(|| "-".into(), |v| format!("{v:.1}"));
    for r in rows {
        md.push_str(&format!(
            "| {} | {} | {} | {:?} | {} | {} | {} | {:.2}; {} | {} | {} | {} | {} | {} |\n",
            r.fault,
            r.requests,
            r.completed_exactly,
            r.failed_by_code,
            r.hung,
            r.lost_or_duplicated,
            r.different,
            r.attempts_per_request,
            r.router_attempts_per_request
                .map_or_else(|| "-".into(), |a| format!("{a:.2}")),
            r.client_retries,
            s(r.detection_s),
            s(r.recovery_s),
            r.leaked_kv_blocks,
            [r.notes.clone(), r.failures.clone()].concat().join("; ")
        ));
    }
    println!("{md}");
    std::fs::write(out_dir().join("results.md"), &md)?;
    std::fs::write(
        out_dir().join("results.json"),
        serde_json::to_string_pretty(rows)?,
    )?;
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Node(NodeFault),
    Kv(KvFault),
    Latency,
    Blackhole,
    ClientCancel,
    RouterRestart,
    SessionHolder,
    RollingRestart,
    Drain(DrainFault),
    /// SIGTERM to the router, with OpenAI HTTP streams.
    HttpRouterStop,
    /// SIGTERM to every decode node at once, with OpenAI HTTP streams.
    HttpDecodeStop,
    Overload,
    Soak,
}

/// Every scenario, in the order the full suite runs them: the blackhole one runs behind the
/// fault-proxies that the latency one puts in.
const ALL: [Scenario; 21] = [
    Scenario::Node(NodeFault::KillDecode),
    Scenario::Node(NodeFault::PauseDecode),
    Scenario::Node(NodeFault::KillPrefill),
    Scenario::Node(NodeFault::DisconnectDecode),
    Scenario::Kv(KvFault::Resets),
    Scenario::Kv(KvFault::Loss),
    Scenario::Kv(KvFault::Cap),
    Scenario::Kv(KvFault::Corrupt),
    Scenario::Latency,
    Scenario::Blackhole,
    Scenario::ClientCancel,
    Scenario::SessionHolder,
    Scenario::RouterRestart,
    Scenario::RollingRestart,
    Scenario::Drain(DrainFault::Killed),
    Scenario::Drain(DrainFault::Cancels),
    Scenario::Drain(DrainFault::PeerFull),
    Scenario::HttpRouterStop,
    Scenario::HttpDecodeStop,
    Scenario::Overload,
    Scenario::Soak,
];

async fn suite(scenarios: &[Scenario]) -> Result<()> {
    let reference = Reference::new()?;
    cluster_up().await?;
    let result = async {
        // The cluster, fault-free, gives the engine's answers.
        let case = reference.case(0)?;
        let got = traffic(&case, STREAMS, |_| Opts::default(), None, Instant::now()).await?;
        let base = score("no fault", &case, &got, &[]);
        ensure!(base.completed_exactly == REQUESTS, "fault-free: {base:?}");
        let mut rows = vec![finish(base, &got).await?];
        for (salt, &scenario) in (1..).zip(scenarios) {
            let started = Instant::now();
            let case = match scenario {
                Scenario::HttpRouterStop | Scenario::HttpDecodeStop => {
                    reference.case_with(salt, HTTP_MAX_TOKENS)?
                }
                _ => reference.case(salt)?,
            };
            let (attempts_before, sent_before) =
                (router_attempts().await, SENT.load(Ordering::Relaxed));
            println!(
                "chaos: {scenario:?} (answers computed in {:.1} s)",
                started.elapsed().as_secs_f64()
            );
            let row = match scenario {
                Scenario::Node(f) => node_fault(f, &case).await?,
                Scenario::Kv(f) => kv_fault(f, &case).await?,
                Scenario::Latency => {
                    proxies_in(100, 30).await?;
                    latency(&case).await?
                }
                Scenario::Blackhole => {
                    let row = blackhole(&case).await?;
                    proxies_out().await?;
                    row
                }
                Scenario::ClientCancel => client_cancel(&case).await?,
                Scenario::RouterRestart => router_restart(&case).await?,
                Scenario::SessionHolder => {
                    let second = reference.follow_up(&case)?;
                    session_holder_killed(&case, &second).await?
                }
                Scenario::RollingRestart => rolling_restart(&case).await?,
                Scenario::Drain(f) => drain_fault(f, &case).await?,
                Scenario::HttpRouterStop => http_router_stop(&case).await?,
                Scenario::HttpDecodeStop => http_decode_stop(&case).await?,
                Scenario::Overload => overload(&case).await?,
                Scenario::Soak => {
                    let secs = std::env::var("TANDEM_CHAOS_SOAK_S")
                        .ok()
                        .and_then(|s| s.parse().ok())
                        .unwrap_or(600);
                    soak(&case, Duration::from_secs(secs)).await?
                }
            };
            println!(
                "chaos: {scenario:?} took {:.1} s",
                started.elapsed().as_secs_f64()
            );
            let sent = SENT.load(Ordering::Relaxed) - sent_before;
            let mut row = row;
            row.router_attempts_per_request = match (attempts_before, router_attempts().await) {
                // A restarted router starts its counter again.
                (Some(before), Some(after)) if after >= before && sent > 0 => {
                    Some((after - before) / sent as f64)
                }
                _ => None,
            };
            rows.push(row);
            // Write what there is after every scenario: a long run can be read as it goes.
            report(&rows)?;
        }
        rows.iter().try_for_each(Row::check)
    }
    .await;
    if std::env::var_os("TANDEM_CHAOS_KEEP").is_none() {
        cluster_down();
    }
    result
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts containers: scripts/chaos.sh smoke"]
async fn chaos_smoke() -> Result<()> {
    suite(&[
        Scenario::Node(NodeFault::KillDecode),
        Scenario::Node(NodeFault::PauseDecode),
        Scenario::HttpRouterStop,
        Scenario::HttpDecodeStop,
    ])
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts containers: scripts/chaos.sh full"]
async fn chaos_full() -> Result<()> {
    suite(&ALL).await
}

/// One scenario at a time, for working on it: `TANDEM_CHAOS_ONLY=<name>` with a name from
/// [`Scenario`]'s debug form in lower case (e.g. `kv(loss)`), run by `scripts/chaos.sh one`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "starts containers: scripts/chaos.sh one NAME"]
async fn chaos_one() -> Result<()> {
    let want = std::env::var("TANDEM_CHAOS_ONLY").context("set TANDEM_CHAOS_ONLY")?;
    let chosen: Vec<Scenario> = ALL
        .into_iter()
        .filter(|s| format!("{s:?}").to_lowercase() == want.to_lowercase())
        .collect();
    ensure!(!chosen.is_empty(), "no scenario is called {want}");
    // The blackhole scenario runs behind the proxies that the latency one puts in.
    let chosen = if chosen == [Scenario::Blackhole] {
        vec![Scenario::Latency, Scenario::Blackhole]
    } else {
        chosen
    };
    suite(&chosen).await
}
