//! `tandem prefill | decode | router`: one server each. Every flag is also a `TANDEM_*` env var.
//! Each binds, prints `listening on ADDR` on stdout (which `tandem up` reads, so port 0 works),
//! and serves until Ctrl-C or SIGTERM, then drains.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use tandem_client::{KvDtype, ModelArgs};
use tandem_engine::{EngineConfig, Model};
use tandem_net::tls::{Role, Tls};
use tandem_worker::NodeConfig;
use tokio::net::TcpListener;

mod defaults;

pub(crate) use defaults::{PipelineArgs, SamplingDefaultsArgs};
use defaults::{ms, router_defaults};

/// On or off.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Switch {
    On,
    Off,
}

impl Switch {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Switch::On => "on",
            Switch::Off => "off",
        }
    }

    /// Speculative decoding, on or off (`--speculate`).
    pub(crate) fn speculate(self) -> tandem_engine::SpeculateConfig {
        match self {
            Switch::On => tandem_engine::SpeculateConfig::on(),
            Switch::Off => tandem_engine::SpeculateConfig::off(),
        }
    }
}

/// How the router chooses replicas.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Policy {
    /// One cost formula over cached prefixes, load and measured speeds (see the router's
    /// policy docs).
    Affinity,
    /// Replicas in turn, always with a remote prefill (the benchmark baseline).
    RoundRobin,
}

impl Policy {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Policy::Affinity => "affinity",
            Policy::RoundRobin => "round-robin",
        }
    }
}

/// The most MiB a worker's disk tier holds, unless configured.
pub(crate) const DEFAULT_KV_SPILL_MB: u64 = 4096;

/// Flags every worker shares.
#[derive(Args, Debug, Clone)]
pub(crate) struct WorkerArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Compute threads (0 = one per core).
    #[arg(long, env = "TANDEM_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// KV pool size in MiB [default: 512, or one sequence of the model's whole context where
    /// that is more]. A pool smaller than the context serves sequences (prompt + max_tokens) up
    /// to its size: a decode node cuts a longer request's max_tokens to it.
    #[arg(long, env = "TANDEM_KV_BUDGET_MB")]
    pub kv_budget_mb: Option<usize>,
    /// MiB of the KV pool's memory kept committed past what it has used so far, by a
    /// thread of its own, so that a KV pushed into blocks never used before does not stall
    /// the decode steps while the kernel commits its pages (0: each page on its first write).
    /// The pool's resident memory is what it has used plus this.
    #[arg(long, env = "TANDEM_KV_COMMIT_AHEAD_MB", default_value_t = 64)]
    pub kv_commit_ahead_mb: usize,
    /// How long in-flight requests may run after shutdown begins, in ms.
    #[arg(long, env = "TANDEM_GRACE_MS", default_value_t = tandem_worker::DEFAULT_GRACE.as_millis() as u64)]
    pub grace_ms: u64,
    /// The prefix cache (prefill) or session cache (decode): `off` makes every request compute
    /// its whole prompt.
    #[arg(long, env = "TANDEM_PREFIX_CACHE", value_enum, default_value_t = Switch::On)]
    pub prefix_cache: Switch,
    /// How the KV cache stores keys and values, and how the KV is sent between nodes. Every
    /// prefill and decode node of a cluster must use the same: a decode node rejects a push of
    /// another dtype.
    #[arg(long, env = "TANDEM_KV_DTYPE", value_enum, default_value_t = KvDtype::F16)]
    pub kv_dtype: KvDtype,
    /// The compute threads' OS priority as a nice value (0-19): above 0 they yield the CPU to
    /// the processes beside them. `tandem up` gives prefill nodes 10 (`--prefill-nice`), so
    /// that a decode node's steps go before prompt compute on the cores they share.
    #[arg(long, env = "TANDEM_COMPUTE_NICE", default_value_t = 0, value_parser = clap::value_parser!(i32).range(0..=19))]
    pub compute_nice: i32,
    /// A directory for the cache's disk tier: blocks evicted from the KV pool are written there
    /// and read back when a later prompt needs them, instead of being computed again. Nodes
    /// that share it (replicas on one volume) each take a slot of their own (`slot-0`, ...); a
    /// restarted node takes a free slot back with what it holds, checked against the model's
    /// fingerprint and a CRC on read. Made readable by its owner only. Off without it.
    #[arg(long, env = "TANDEM_KV_SPILL_DIR")]
    pub kv_spill_dir: Option<std::path::PathBuf>,
    /// Most MiB the disk tier holds; the least recently used blocks go beyond it.
    #[arg(
        long,
        env = "TANDEM_KV_SPILL_MB",
        default_value_t = 4096,
        requires = "kv_spill_dir"
    )]
    pub kv_spill_mb: u64,
    /// On SIGTERM, how long the drain waits, in ms, for what it hands off to be fetched
    /// before it closes the listener: a decode node's running streams, which move to peers
    /// with their KV (the router resumes them there), and the most recently used cached
    /// sequences (a decode node's sessions, a prefill node's prompts), which the router moves
    /// to peers of the node's role; 0 turns the hand-off off
    /// (docs/kv-cache.md#peer-fetch-and-the-drain-hand-off).
    #[arg(long, env = "TANDEM_DRAIN_HANDOFF_MS", default_value_t = tandem_worker::DEFAULT_DRAIN_HANDOFF.as_millis() as u64)]
    pub drain_handoff_ms: u64,
    /// The most KV, in MiB, the drain hands off: a decode node's running streams' first, then
    /// the most recently used cached sequences; what is past it is computed again where it
    /// goes next.
    #[arg(long, env = "TANDEM_DRAIN_HANDOFF_MB", default_value_t = tandem_worker::DEFAULT_DRAIN_HANDOFF_BYTES >> 20)]
    pub drain_handoff_mb: u64,
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Simulate the model instead of running it: no weight is read, and each forward pass
    /// takes the time a timing profile gives (the real scheduler, KV pool, caches, transfers
    /// and drains all run; replies are plain words, to max_tokens). `shipped` (the flag alone)
    /// uses the profile shipped for a catalog model; otherwise a profile file written by
    /// `tandem-bench profile` (docs/operations.md, "Sizing a fleet with the simulator").
    #[arg(long, env = "TANDEM_SIMULATE", num_args = 0..=1, default_missing_value = crate::simulate::SHIPPED_PROFILE)]
    pub simulate: Option<String>,
}

/// Mutual TLS between nodes.
#[derive(Args, Debug, Clone)]
pub(crate) struct TlsArgs {
    /// The directory `tandem certs init` wrote: this node serves and calls other nodes over
    /// mutual TLS with its role's certificate, and lets each peer role call only what it needs.
    /// Without it the node's port is open to whoever reaches it (a warning says so).
    #[arg(long, env = "TANDEM_TLS_DIR")]
    pub tls_dir: Option<std::path::PathBuf>,
}

impl TlsArgs {
    /// The node's TLS material for `role`, or `None` (with a warning) without `--tls-dir`.
    pub(crate) fn load(&self, role: Role) -> anyhow::Result<Option<Tls>> {
        match &self.tls_dir {
            Some(dir) => Ok(Some(Tls::load(dir, role)?)),
            None => {
                tracing::warn!(
                    role = role.name(),
                    "no --tls-dir: node-to-node traffic is plaintext and unauthenticated"
                );
                Ok(None)
            }
        }
    }
}

impl WorkerArgs {
    /// The model: loaded, or simulated with `--simulate`.
    pub(crate) fn load_model(&self) -> anyhow::Result<Arc<Model>> {
        let source = self.model.source();
        match self.simulate.as_deref() {
            None => Ok(source.load()?),
            Some(profile) => {
                Ok(source.load_simulated(crate::simulate::profile(&source, profile)?)?)
            }
        }
    }

    /// The node's settings, as `role`, serving `model` on `engine`.
    pub(crate) fn node(
        &self,
        model: Arc<Model>,
        engine: EngineConfig,
        role: Role,
    ) -> anyhow::Result<NodeConfig> {
        Ok(NodeConfig {
            tls: self.tls.load(role)?,
            grace: Duration::from_millis(self.grace_ms),
            drain_handoff: Duration::from_millis(self.drain_handoff_ms),
            drain_handoff_bytes: self.drain_handoff_mb << 20,
            ..NodeConfig::new(model, engine)
        })
    }

    /// The engine for `model`, with a prefix cache of `cache_bytes` when the cache is on.
    pub(crate) fn engine(&self, model: &Model, cache_bytes: usize) -> EngineConfig {
        EngineConfig {
            threads: self.threads,
            kv_budget_bytes: tandem_worker::kv_budget_bytes(
                model,
                self.kv_dtype.dtype(),
                self.kv_budget_mb,
            ),
            kv_commit_ahead_bytes: self.kv_commit_ahead_mb << 20,
            kv_dtype: self.kv_dtype.dtype(),
            compute_nice: self.compute_nice,
            prefix_cache_bytes: match self.prefix_cache {
                Switch::On => cache_bytes,
                Switch::Off => 0,
            },
            spill: self
                .kv_spill_dir
                .as_ref()
                .map(|dir| tandem_engine::SpillConfig {
                    dir: dir.clone(),
                    max_bytes: self.kv_spill_mb << 20,
                }),
            ..EngineConfig::default()
        }
    }
}

#[derive(Args, Debug)]
pub(crate) struct PrefillArgs {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, env = "TANDEM_LISTEN", default_value = "127.0.0.1:50052")]
    listen: SocketAddr,
    #[command(flatten)]
    worker: WorkerArgs,
    /// Requests that may wait for the compute thread; more get RESOURCE_EXHAUSTED.
    #[arg(long, env = "TANDEM_MAX_QUEUE", default_value_t = tandem_prefill_server::DEFAULT_MAX_QUEUE)]
    max_queue: usize,
    /// Size of the prefix cache in MiB (least recently used prompts are evicted beyond it; it
    /// lives inside the KV pool of --kv-budget-mb).
    #[arg(long, env = "TANDEM_PREFIX_CACHE_MB", default_value_t = tandem_prefill_server::DEFAULT_PREFIX_CACHE_BYTES >> 20)]
    prefix_cache_mb: usize,
}

#[derive(Args, Debug)]
pub(crate) struct DecodeArgs {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, env = "TANDEM_LISTEN", default_value = "127.0.0.1:50053")]
    listen: SocketAddr,
    #[command(flatten)]
    worker: WorkerArgs,
    /// Sequences decoded together at most (batch slots).
    #[arg(long, env = "TANDEM_MAX_SLOTS", default_value_t = tandem_decode_server::DEFAULT_MAX_SLOTS)]
    max_slots: usize,
    /// Longest wait without KV progress for an admitted request, in ms, when the router sets
    /// no bound.
    #[arg(long, env = "TANDEM_KV_WAIT_MS", default_value_t = tandem_decode_server::DEFAULT_KV_WAIT.as_millis() as u64)]
    kv_wait_ms: u64,
    /// The longest wait without KV progress a caller may ask for, in ms; longer asks are cut to
    /// it, so idle reservations cannot hold KV blocks for long.
    #[arg(long, env = "TANDEM_MAX_KV_WAIT_MS", default_value_t = tandem_decode_server::DEFAULT_MAX_KV_WAIT.as_millis() as u64)]
    max_kv_wait_ms: u64,
    /// KV the streams paused for a higher priority class may keep pinned in the pool, in MiB;
    /// past it they park on the disk tier (`--kv-spill-dir`, with the session cache on), and
    /// without one they stay pinned (docs/api.md "Priority classes and fair shares").
    #[arg(long, env = "TANDEM_PARK_PINNED_MB", default_value_t = tandem_decode_server::DEFAULT_PARK_PINNED_BYTES >> 20)]
    park_pinned_mb: u64,
    /// The share, in percent, of the node's places (4 per slot) and KV blocks that requests of
    /// the batch priority class may hold; the rest is kept for the standard and interactive
    /// classes (1 to 100; 100 keeps nothing).
    #[arg(long, env = "TANDEM_BATCH_SHARE_PERCENT", default_value_t = tandem_decode_server::DEFAULT_BATCH_SHARE_PERCENT)]
    batch_share_percent: u8,
    /// Slots that streams of the batch priority class keep while an interactive stream runs or
    /// is ready; the others pause (their KV parked) so that the steps stay short for the
    /// interactive tokens, and resume once none is left, or after waiting 10 s.
    #[arg(long, env = "TANDEM_BATCH_SLOTS_BESIDE_INTERACTIVE", default_value_t = tandem_decode_server::DEFAULT_BATCH_SLOTS_BESIDE_INTERACTIVE)]
    batch_slots_beside_interactive: usize,
    /// Prompt-lookup speculative decoding: drafts copied from the sequence itself, verified
    /// several at a time, never changing a token (docs/speculative.md).
    #[arg(long, env = "TANDEM_SPECULATE", value_enum, default_value_t = Switch::On)]
    speculate: Switch,
}

#[derive(Args, Debug)]
pub(crate) struct RouterArgs {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, env = "TANDEM_LISTEN", default_value = "127.0.0.1:50051")]
    listen: SocketAddr,
    /// Address of the OpenAI-compatible HTTP API (`/v1/chat/completions`, `/v1/completions`,
    /// `/v1/models`, `/health`); `off` serves none.
    #[arg(long, env = "TANDEM_HTTP_LISTEN", default_value = "127.0.0.1:8000", value_parser = parse_listen)]
    http_listen: Listen,
    /// Prefill replicas, host:port (repeat or comma-separate). None: the decode nodes prefill
    /// every prompt themselves (`affinity` policy only).
    #[arg(long, env = "TANDEM_PREFILL", value_delimiter = ',')]
    prefill: Vec<String>,
    /// Decode replicas, host:port (repeat or comma-separate).
    #[arg(long, env = "TANDEM_DECODE", value_delimiter = ',', required = true)]
    decode: Vec<String>,
    /// Requests in flight at most; more get RESOURCE_EXHAUSTED.
    #[arg(long, env = "TANDEM_MAX_INFLIGHT", default_value_t = router_defaults().max_inflight)]
    max_inflight: usize,
    /// Whole-request bound in ms when the client sets no deadline.
    #[arg(long, env = "TANDEM_TIMEOUT_MS", default_value_t = ms(router_defaults().default_timeout))]
    timeout_ms: u64,
    /// Longest wait without KV progress (before the push, or between its frames) on the
    /// decode node, in ms. A prefill node's push sends keepalives while the prompt waits in its
    /// queue, so this finds a dead sender, not a long queue.
    #[arg(long, env = "TANDEM_KV_WAIT_MS", default_value_t = ms(router_defaults().kv_wait))]
    kv_wait_ms: u64,
    /// How long a decode node's token stream may be silent once it has its KV, in ms (after a
    /// local prefill, plus twice its estimated time), before the router checks the node. One
    /// that still answers its health checks is busy and the stream waits on (up to the
    /// request's deadline); one that does not counts as failed, and the generation resumes on
    /// another.
    #[arg(long, env = "TANDEM_TOKEN_GAP_MS", default_value_t = ms(router_defaults().token_gap))]
    token_gap_ms: u64,
    /// How often, in ms, each worker checks its load for a change to report to the router.
    #[arg(long, env = "TANDEM_LOAD_POLL_MS", default_value_t = ms(router_defaults().load_poll))]
    load_poll_ms: u64,
    /// How long in-flight streams (gRPC and HTTP) may run after shutdown (SIGTERM) begins, in
    /// ms. Meanwhile the router goes on accepting and refuses new requests at once
    /// (UNAVAILABLE; HTTP 503 with `Retry-After: 1`); streams still running at the end fail
    /// with UNAVAILABLE.
    #[arg(long, env = "TANDEM_GRACE_MS", default_value_t = ms(router_defaults().grace))]
    grace_ms: u64,
    /// How replicas are chosen.
    #[arg(long, env = "TANDEM_POLICY", value_enum, default_value_t = Policy::Affinity)]
    policy: Policy,
    #[command(flatten)]
    pipeline: PipelineArgs,
    /// Most block hashes the router's cache index keeps per replica (10-21 bytes each); a
    /// replica whose cache is larger is routed to as if it held nothing.
    #[arg(long, env = "TANDEM_INDEX_MAX_BLOCKS", default_value_t = router_defaults().index_max_blocks)]
    index_max_blocks: usize,
    /// API key file (`TENANT sha256:HEX [rpm=N] [tpm=N] [streams=N] [class=C] [weight=N]` per
    /// line, docs/api.md "Priority classes and fair shares" for the last two; `tandem keys new`
    /// writes them). With it, every gRPC and HTTP request needs `authorization: Bearer KEY`,
    /// each key's tenant gets its own prefix-cache partition, and the file is re-read when it
    /// changes. Without it, clients need no key and share one partition.
    #[arg(long, env = "TANDEM_API_KEYS")]
    api_keys: Option<std::path::PathBuf>,
    /// Requests per minute per key, where its line sets none (0 = unlimited).
    #[arg(long, env = "TANDEM_RATE_LIMIT_RPM", default_value_t = 0)]
    rate_limit_rpm: u32,
    /// Prompt plus max_tokens per minute per key (unused tokens are given back when a
    /// generation ends), where its line sets none (0 = unlimited).
    #[arg(long, env = "TANDEM_RATE_LIMIT_TPM", default_value_t = 0)]
    rate_limit_tpm: u32,
    /// Concurrent generations per key, where its line sets none (0 = unlimited).
    #[arg(long, env = "TANDEM_MAX_STREAMS_PER_KEY", default_value_t = 0)]
    max_streams_per_key: u32,
    /// Longest prompt text in bytes (the prompt, or all messages together), checked before
    /// tokenizing.
    #[arg(long, env = "TANDEM_MAX_PROMPT_BYTES", default_value_t = router_defaults().limits.prompt_bytes)]
    max_prompt_bytes: usize,
    /// Most prompt tokens (0 = the model's context).
    #[arg(long, env = "TANDEM_MAX_PROMPT_TOKENS", default_value_t = 0)]
    max_prompt_tokens: usize,
    /// Largest max_tokens a request may ask for (0 = the model's context).
    #[arg(long, env = "TANDEM_MAX_TOKENS_LIMIT", default_value_t = 0)]
    max_tokens_limit: u32,
    /// Largest gRPC request message to the router, in bytes.
    #[arg(long, env = "TANDEM_MAX_REQUEST_BYTES", default_value_t = router_defaults().limits.grpc_message_bytes)]
    max_request_bytes: usize,
    /// Largest HTTP request body, in bytes (larger bodies get 413).
    #[arg(long, env = "TANDEM_MAX_HTTP_BODY_BYTES", default_value_t = router_defaults().limits.http_body_bytes)]
    max_http_body_bytes: usize,
    /// The time to first token each priority class is held to when a request names none
    /// (`x-slo-ttft-ms`), as `CLASS=MS` pairs: `interactive=800,standard=5000`. A request whose
    /// predicted TTFT misses its target is refused at once (RESOURCE_EXHAUSTED; HTTP 429 with
    /// Retry-After) instead of served late. Empty: no class has a target.
    #[arg(long, env = "TANDEM_TTFT_TARGET", default_value = "", value_parser = tandem_router::parse_ttft_targets)]
    ttft_target: [Option<Duration>; 3],
    /// Seconds an agent session (docs/api.md, "Sessions") may sit idle before its KV moves from
    /// the workers' pools to their disk tier (`--kv-spill-dir`), where its next turn reads it
    /// back; workers without one keep it in the pool.
    #[arg(long, env = "TANDEM_SESSION_IDLE_SECS", default_value_t = router_defaults().sessions.idle.as_secs())]
    session_idle_secs: u64,
    /// Seconds an agent session may sit idle before it ends and its KV is released, as
    /// `DELETE /v1/sessions/{id}` does.
    #[arg(long, env = "TANDEM_SESSION_TTL_SECS", default_value_t = router_defaults().sessions.ttl.as_secs())]
    session_ttl_secs: u64,
    /// Open sessions per API key (per tenant; one for all without keys): one more ends the
    /// key's least recently used session and releases its KV.
    #[arg(long, env = "TANDEM_SESSIONS_PER_KEY", default_value_t = router_defaults().sessions.per_key)]
    sessions_per_key: usize,
    /// The model (its id, as `GET /v1/models` lists it) a request that names none runs on: a
    /// gRPC request with an empty `model`, a Messages request asking for a `claude-*` model.
    /// Unset, the only model the workers serve; with several, such a request is refused.
    #[arg(long, env = "TANDEM_DEFAULT_MODEL")]
    default_model: Option<String>,
    /// Serve the Gateway API Inference Extension's endpoint picker (Envoy's ext_proc service)
    /// on the gRPC port, picking among these routers' HTTP endpoints (`host:port`, names
    /// resolved every 2 s): each conversation's requests go to one of them (docs/gateway.md).
    #[arg(long, env = "TANDEM_PICKER_ENDPOINTS", value_delimiter = ',')]
    picker_endpoints: Vec<String>,
    /// Address of the peer port, where the other routers over the same workers ask this one
    /// for its state (agent sessions, load, running generations) and attach retries to its
    /// streams; with --tls-dir, mutual TLS that only router certificates pass. `off` serves
    /// none. Needed with --peers.
    #[arg(long, env = "TANDEM_PEER_LISTEN", default_value = "off", value_parser = parse_listen)]
    peer_listen: Listen,
    /// The other routers' peer ports, host:port (repeat or comma-separate; names resolved every
    /// 2 s, so one name for all routers will do: this router leaves its own address out). Each
    /// router then routes with what they all know (docs/operations.md, "Several routers").
    #[arg(
        long,
        env = "TANDEM_PEERS",
        value_delimiter = ',',
        requires = "peer_listen"
    )]
    peers: Vec<String>,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    sampling_defaults: SamplingDefaultsArgs,
    #[command(flatten)]
    api_tls: ApiTlsArgs,
}

/// TLS on the router's client ports.
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct ApiTlsArgs {
    /// Serve the client API (gRPC and HTTP) over TLS with this certificate chain (PEM, leaf
    /// first), e.g. one a public CA issued for the router's name. Clients need no certificate.
    /// The files are re-read when they change, so a renewed certificate needs no restart.
    #[arg(long, env = "TANDEM_API_TLS_CERT", requires = "api_tls_key")]
    pub api_tls_cert: Option<std::path::PathBuf>,
    /// The private key (PEM) of --api-tls-cert.
    #[arg(long, env = "TANDEM_API_TLS_KEY", requires = "api_tls_cert")]
    pub api_tls_key: Option<std::path::PathBuf>,
}

impl ApiTlsArgs {
    fn load(&self) -> anyhow::Result<Option<Arc<tandem_net::api_tls::ServerCert>>> {
        match (&self.api_tls_cert, &self.api_tls_key) {
            (Some(cert), Some(key)) => Ok(Some(tandem_net::api_tls::ServerCert::load(cert, key)?)),
            _ => Ok(None),
        }
    }
}

/// Resolves on Ctrl-C or SIGTERM.
pub(crate) async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
}

/// Binds `addr` and prints `{prefix}listening on ADDR`, which `tandem up` reads to learn the
/// port (the router prints its HTTP line, prefix `http `, before its gRPC one).
async fn bind(addr: SocketAddr, prefix: &str) -> anyhow::Result<TcpListener> {
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))?;
    println!("{prefix}listening on {}", listener.local_addr()?);
    Ok(listener)
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

pub(crate) fn prefill(args: &PrefillArgs) -> anyhow::Result<()> {
    let model = args.worker.load_model()?;
    let config = tandem_prefill_server::Config {
        node: args.worker.node(
            model.clone(),
            args.worker.engine(&model, args.prefix_cache_mb << 20),
            Role::Prefill,
        )?,
        max_queue: args.max_queue,
        keepalive: tandem_transfer::client::KEEPALIVE_INTERVAL,
    };
    runtime()?.block_on(async {
        let listener = bind(args.listen, "").await?;
        tandem_prefill_server::run(listener, config, shutdown_signal()).await?;
        Ok(())
    })
}

pub(crate) fn decode(args: &DecodeArgs) -> anyhow::Result<()> {
    let model = args.worker.load_model()?;
    // The session cache may use the whole pool: running sequences evict it as they need.
    let engine = EngineConfig {
        speculate: args.speculate.speculate(),
        ..args.worker.engine(&model, usize::MAX)
    };
    let config = tandem_decode_server::Config {
        node: args.worker.node(model, engine, Role::Decode)?,
        max_slots: args.max_slots,
        kv_wait: Duration::from_millis(args.kv_wait_ms),
        max_kv_wait: Duration::from_millis(args.max_kv_wait_ms),
        park_pinned_bytes: args.park_pinned_mb << 20,
        batch_share_percent: args.batch_share_percent,
        batch_slots_beside_interactive: args.batch_slots_beside_interactive,
    };
    runtime()?.block_on(async {
        let listener = bind(args.listen, "").await?;
        tandem_decode_server::run(listener, config, shutdown_signal()).await?;
        Ok(())
    })
}

pub(crate) fn router(args: &RouterArgs) -> anyhow::Result<()> {
    let config = tandem_router::Config {
        prefill: args.prefill.clone(),
        decode: args.decode.clone(),
        max_inflight: args.max_inflight,
        default_timeout: Duration::from_millis(args.timeout_ms),
        kv_wait: Duration::from_millis(args.kv_wait_ms),
        token_gap: Duration::from_millis(args.token_gap_ms),
        load_poll: Duration::from_millis(args.load_poll_ms),
        grace: Duration::from_millis(args.grace_ms),
        policy: match args.policy {
            Policy::Affinity => tandem_router::PolicyKind::Affinity,
            Policy::RoundRobin => tandem_router::PolicyKind::RoundRobin,
        },
        pipeline: args.pipeline.resolve(),
        index_max_blocks: args.index_max_blocks,
        auth: tandem_router::AuthConfig::with_defaults(
            args.api_keys.clone(),
            args.rate_limit_rpm,
            args.rate_limit_tpm,
            args.max_streams_per_key,
        ),
        limits: tandem_router::Limits {
            prompt_bytes: args.max_prompt_bytes,
            prompt_tokens: unlimited_if_zero(args.max_prompt_tokens, usize::MAX),
            max_tokens: unlimited_if_zero(args.max_tokens_limit, u32::MAX),
            grpc_message_bytes: args.max_request_bytes,
            http_body_bytes: args.max_http_body_bytes,
            ttft_targets: args.ttft_target,
        },
        tls: args.tls.load(Role::Router)?,
        api_tls: args.api_tls.load()?,
        sampling_defaults: args.sampling_defaults.resolve(),
        sessions: tandem_router::SessionConfig {
            idle: Duration::from_secs(args.session_idle_secs),
            ttl: Duration::from_secs(args.session_ttl_secs),
            per_key: args.sessions_per_key,
        },
        // Compose passes an unset default as an empty value.
        default_model: args.default_model.clone().filter(|m| !m.is_empty()),
        picker_endpoints: args.picker_endpoints.clone(),
        peers: args.peers.clone(),
    };
    runtime()?.block_on(async {
        let http = args.http_listen.bind("http ").await?;
        let peer = args.peer_listen.bind("peer ").await?;
        let grpc = bind(args.listen, "").await?;
        let listeners = tandem_router::Listeners { grpc, http, peer };
        tandem_router::run(listeners, config, shutdown_signal()).await?;
        Ok(())
    })
}

/// A limit flag's value, where 0 means none (`unlimited`).
fn unlimited_if_zero<T: Default + PartialEq>(n: T, unlimited: T) -> T {
    if n == T::default() { unlimited } else { n }
}

/// Where the router serves one of its optional ports, if at all.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Listen {
    Off,
    At(SocketAddr),
}

impl Listen {
    /// The listener, bound as [`bind`] does, unless `off`.
    async fn bind(self, prefix: &str) -> anyhow::Result<Option<TcpListener>> {
        match self {
            Listen::Off => Ok(None),
            Listen::At(addr) => Ok(Some(bind(addr, prefix).await?)),
        }
    }
}

fn parse_listen(s: &str) -> Result<Listen, String> {
    match s {
        "off" => Ok(Listen::Off),
        _ => s
            .parse()
            .map(Listen::At)
            .map_err(|e| format!("expected ip:port or off: {e}")),
    }
}
