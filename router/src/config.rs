//! The router's configuration.

use std::time::Duration;

use crate::error::invalid;

pub use crate::auth::{AuthConfig, Class, KeyLimits};

/// Hard limits on what one client request may ask for, each enforced before the work or the
/// memory it would cost.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Longest prompt text (the prompt, or the messages' roles and contents together), in
    /// bytes; checked before tokenizing.
    pub prompt_bytes: usize,
    /// Most prompt tokens (the model's context bounds them too).
    pub prompt_tokens: usize,
    /// Largest `max_tokens` a request may ask for.
    pub max_tokens: u32,
    /// Largest `tandem.v1.Generation` request message, in bytes.
    pub grpc_message_bytes: usize,
    /// Largest HTTP request body, in bytes.
    pub http_body_bytes: usize,
    /// The time to first token each priority class is held to when a request names none
    /// (`--ttft-target`), by class (interactive, standard, batch); `None`: no target.
    pub ttft_targets: [Option<Duration>; Class::COUNT],
}

/// Parses `--ttft-target`: `CLASS=MS` pairs, comma-separated (`interactive=800,standard=5000`);
/// a class not named has no target.
pub fn parse_ttft_targets(
    s: &str,
) -> std::result::Result<[Option<Duration>; Class::COUNT], String> {
    let mut targets = [None; Class::COUNT];
    for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (class, ms) = pair
            .split_once('=')
            .ok_or_else(|| format!("{pair:?}: expected CLASS=MS"))?;
        let class = Class::parse(class.trim())
            .ok_or_else(|| format!("{class:?}: must be interactive, standard or batch"))?;
        let ms: u64 = (ms.trim().parse().ok())
            .filter(|&ms| ms > 0)
            .ok_or_else(|| format!("{ms:?}: expected a positive whole number of milliseconds"))?;
        targets[class.slot()] = Some(Duration::from_millis(ms));
    }
    Ok(targets)
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            prompt_bytes: 1 << 20,
            prompt_tokens: usize::MAX,
            max_tokens: u32::MAX,
            grpc_message_bytes: 4 << 20,
            http_body_bytes: 4 << 20,
            ttft_targets: [None; Class::COUNT],
        }
    }
}

/// How often each worker checks its load for a change to report to the router, unless told
/// (`--load-poll-ms`; see [`crate::cluster::replicas`]).
pub const DEFAULT_LOAD_POLL: Duration = Duration::from_millis(250);

#[derive(Debug, Clone)]
pub struct Config {
    /// Prefill replicas, `host:port`.
    pub prefill: Vec<String>,
    /// Decode replicas, `host:port`.
    pub decode: Vec<String>,
    /// Requests in flight at most; more get RESOURCE_EXHAUSTED with retry pushback.
    pub max_inflight: usize,
    /// The whole-request bound when the client sets no deadline.
    pub default_timeout: Duration,
    /// The longest a decode node waits without KV progress (before the push starts, or
    /// between its chunks) after admitting a request.
    pub kv_wait: Duration,
    /// How long a decode node's stream may be silent once it has its KV (after a local
    /// prefill, plus twice the prefill's estimated time) before the router looks at the node:
    /// one that still serves is busy, and the stream goes on waiting (up to the request's
    /// deadline); one that stopped serving counts as failed, and the generation resumes
    /// elsewhere.
    pub token_gap: Duration,
    /// How often replicas are asked for their load.
    pub load_poll: Duration,
    /// How long in-flight streams (gRPC and HTTP) may run after shutdown begins, while new
    /// requests are refused.
    pub grace: Duration,
    /// How replicas are chosen (see [`crate::cluster::policy`]).
    pub policy: PolicyKind,
    /// When a long prompt's prefill is split over several prefill nodes.
    pub pipeline: PipelineConfig,
    /// Most block hashes the cache index keeps per replica (10-21 bytes each).
    pub index_max_blocks: usize,
    /// API keys, and the limits per key.
    pub auth: AuthConfig,
    pub limits: Limits,
    /// Mutual TLS to the workers, with the router's certificate.
    pub tls: Option<tandem_net::tls::Tls>,
    /// TLS for clients on the gRPC and HTTP ports: a server certificate only (API keys
    /// identify clients), reloaded when its files change.
    pub api_tls: Option<std::sync::Arc<tandem_net::api_tls::ServerCert>>,
    /// Sampling for HTTP requests that leave these unset.
    pub sampling_defaults: SamplingDefaults,
    /// How long agent sessions' KV stays in the pools, and how many sessions a key may hold.
    pub sessions: SessionConfig,
    /// The model a request that names none runs on (gRPC's empty `model`, a `claude-*` name on
    /// the Messages API); without it, the only model served, and with several served such a
    /// request is refused.
    pub default_model: Option<String>,
    /// The endpoints (`host:port`: routers' HTTP addresses, names resolved every 2 s) the
    /// router picks among as a gateway's ext_proc endpoint picker; empty, it serves no picker.
    pub picker_endpoints: Vec<String>,
    /// The other routers' peer ports (`host:port`; names resolved every 2 s, this router's
    /// own address among them left out), whose state this router follows
    /// ([`crate::cluster::peers`]); empty, it routes on its own.
    pub peers: Vec<String>,
}

impl Config {
    /// What `run` needs of the configuration before it starts anything: a decode replica,
    /// a prefill replica for round-robin, non-zero bounds, a peer port of its own when it
    /// follows peers (`serves_peers`), and sampling defaults a request could set.
    pub fn validate(&self, serves_peers: bool) -> crate::error::Result<()> {
        // Without prefill replicas the decode nodes prefill every prompt themselves, which the
        // affinity policy does whenever no prefill replica is up; round-robin always wants one.
        if self.decode.is_empty() {
            return invalid("replicas", "at least one decode replica is required");
        }
        if self.prefill.is_empty() && self.policy == PolicyKind::RoundRobin {
            return invalid(
                "policy",
                "round-robin always prefills remotely: it needs a prefill replica",
            );
        }
        if self.token_gap.is_zero() {
            return invalid("token_gap", "must be more than 0");
        }
        if self.max_inflight == 0 {
            return invalid("max_inflight", "must be at least 1");
        }
        if !self.peers.is_empty() && !serves_peers {
            return invalid(
                "peers",
                "a router that asks peers for their state must serve its own: give it a peer port",
            );
        }
        self.sampling_defaults.validate()
    }
}

/// The sampling an OpenAI HTTP request gets for what it leaves unset, as llama-server's flags
/// and vLLM's generation config give it; `None` is OpenAI's own default (temperature 1, no
/// cut). gRPC requests state their sampling (proto3 cannot tell an unset temperature from 0,
/// which is greedy there).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
}

impl SamplingDefaults {
    /// Each default within what a request may set ([`tandem_proto::policy`]'s bounds; the
    /// temperature within OpenAI's range).
    pub fn validate(&self) -> crate::error::Result<()> {
        use tandem_proto::policy::{MIN_P, OPENAI_TEMPERATURE, TOP_P};
        for (field, value, bound) in [
            ("default_temperature", self.temperature, OPENAI_TEMPERATURE),
            ("default_top_p", self.top_p, TOP_P),
            ("default_min_p", self.min_p, MIN_P),
        ] {
            if let Some(v) = value.filter(|&v| !bound.contains(v)) {
                return Err(crate::error::Error::InvalidArgument {
                    field,
                    reason: bound.refusal(v),
                });
            }
        }
        Ok(())
    }
}

impl Default for Config {
    fn default() -> Self {
        Self {
            prefill: Vec::new(),
            decode: Vec::new(),
            max_inflight: 256,
            default_timeout: Duration::from_secs(300),
            kv_wait: Duration::from_secs(10),
            token_gap: Duration::from_secs(5),
            load_poll: DEFAULT_LOAD_POLL,
            grace: Duration::from_secs(10),
            policy: PolicyKind::Affinity,
            pipeline: Default::default(),
            index_max_blocks: 1 << 20,
            auth: AuthConfig::default(),
            limits: Limits::default(),
            tls: None,
            api_tls: None,
            sampling_defaults: SamplingDefaults::default(),
            sessions: Default::default(),
            default_model: None,
            picker_endpoints: Vec::new(),
            peers: Vec::new(),
        }
    }
}

/// How long sessions may sit, and how many one key may hold.
#[derive(Clone, Copy, Debug)]
pub struct SessionConfig {
    /// Idle this long, a session's KV moves from the pool to the disk tier (on workers that have
    /// one), where its next turn reads it back.
    pub idle: Duration,
    /// Idle this long, a session ends and its KV is released.
    pub ttl: Duration,
    /// Open sessions per tenant (API key); opening one more ends the tenant's least recently
    /// used.
    pub per_key: usize,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self {
            idle: Duration::from_secs(300),
            ttl: Duration::from_secs(3600),
            per_key: 256,
        }
    }
}

/// When a prompt's prefill is split over several prefill nodes, and over how many at most
/// ([`crate::cluster::policy`]'s pipeline).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PipelineConfig {
    /// Prompts of at least this many tokens (which the chosen prefill node holds none of) are
    /// split over idle prefill nodes; 0 never splits.
    pub min_tokens: usize,
    /// Most prefill nodes one prompt is split over.
    pub max_stages: usize,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        Self {
            min_tokens: DEFAULT_MIN_TOKENS,
            max_stages: 4,
        }
    }
}

/// The prompt length from which two stages beat one by more than a second (measured:
/// `docs/benchmarks.md`, "One prompt over several prefill nodes").
pub const DEFAULT_MIN_TOKENS: usize = 4096;

/// Which policy the router runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PolicyKind {
    /// The cost formula ([`crate::cluster::policy`]).
    #[default]
    Affinity,
    /// Replicas in turn, always with a remote prefill: the baseline for benchmarks.
    RoundRobin,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttft_targets_are_class_ms_pairs() {
        let ms = |ms| Some(Duration::from_millis(ms));
        assert_eq!(parse_ttft_targets(""), Ok([None; 3]));
        assert_eq!(
            parse_ttft_targets("interactive=800, batch=60000"),
            Ok([ms(800), None, ms(60_000)])
        );
        for bad in ["interactive", "urgent=5", "standard=0", "standard=soon"] {
            assert!(parse_ttft_targets(bad).is_err(), "{bad}");
        }
    }
}
