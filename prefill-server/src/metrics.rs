//! The prefill node's Prometheus metrics.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

pub const QUEUE_DEPTH: &str = "tandem_prefill_queue_depth";
pub const TOKENS: &str = "tandem_prefill_tokens";
pub const TOKENS_PER_SECOND: &str = "tandem_prefill_tokens_per_second";
pub const SECONDS: &str = "tandem_prefill_seconds";
pub const QUEUED_TOKENS: &str = "tandem_prefill_queued_tokens";
pub const CACHED_TOKENS: &str = "tandem_prefill_cached_tokens";
pub const CACHE_BLOCKS: &str = "tandem_prefill_prefix_cache_blocks";
pub const YIELDS: &str = "tandem_prefill_yields";
pub const RELAYS: &str = "tandem_prefill_relays";
pub const PIPELINED: &str = "tandem_prefill_pipelined";

#[derive(Clone, Debug)]
pub struct PrefillMetrics {
    pub queue_depth: Gauge,
    /// Prompt tokens computed; `rate()` of it is the node's throughput.
    pub tokens: Counter,
    /// Throughput of each request's compute.
    pub tokens_per_second: Histogram,
    pub seconds: Histogram,
    /// Prompt tokens of the requests waiting or running.
    pub queued_tokens: Gauge,
    /// Prompt tokens taken from the prefix cache instead of computed.
    pub cached_tokens: Counter,
    pub cache_blocks: Gauge,
    /// Prompts of a higher class computed while a prompt of a lower class waited between its
    /// chunks.
    pub yields: Counter,
    /// Parts of pipelined prefills computed for the next stage (`Prefill.Relay`), and
    /// prefills whose first tokens earlier stages computed.
    pub relays: Counter,
    pub pipelined: Counter,
}

impl PrefillMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            queue_depth: Gauge::default(),
            tokens: Counter::default(),
            tokens_per_second: Histogram::new(exponential_buckets(16.0, 2.0, 12)),
            seconds: Histogram::new(exponential_buckets(0.001, 2.0, 14)),
            queued_tokens: Gauge::default(),
            cached_tokens: Counter::default(),
            cache_blocks: Gauge::default(),
            yields: Counter::default(),
            relays: Counter::default(),
            pipelined: Counter::default(),
        };
        registry.register(
            QUEUE_DEPTH,
            "Prefill requests waiting or running",
            m.queue_depth.clone(),
        );
        registry.register(TOKENS, "Prompt tokens computed", m.tokens.clone());
        registry.register(
            TOKENS_PER_SECOND,
            "Prompt tokens per second, per request",
            m.tokens_per_second.clone(),
        );
        registry.register(
            SECONDS,
            "Compute time per prefill request",
            m.seconds.clone(),
        );
        registry.register(
            QUEUED_TOKENS,
            "Prompt tokens of the prefill requests waiting or running",
            m.queued_tokens.clone(),
        );
        registry.register(
            CACHED_TOKENS,
            "Prompt tokens reused from the prefix cache",
            m.cached_tokens.clone(),
        );
        registry.register(
            YIELDS,
            "Prompts of a higher priority class computed while a lower class's prompt waited between its chunks",
            m.yields.clone(),
        );
        registry.register(
            RELAYS,
            "Parts of pipelined prefills computed for the next stage, which called Relay",
            m.relays.clone(),
        );
        registry.register(
            PIPELINED,
            "Pipelined prefills computed on the KV that earlier stages streamed here",
            m.pipelined.clone(),
        );
        registry.register(
            CACHE_BLOCKS,
            "KV blocks kept by the prefix cache",
            m.cache_blocks.clone(),
        );
        m
    }
}
