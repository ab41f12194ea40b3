//! The scaffold both worker nodes stand on: the settings they share, each default written once;
//! the errors of starting and serving a node, apart from a request's; and the serve loop
//! around a node's own services, which adds the `Worker` service, health, reflection,
//! `/metrics`, mutual TLS and the drain.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tandem_engine::{BLOCK_TOKENS, Engine, EngineConfig, KvDtype, KvLayout, Model, SpillStats};
use tandem_net::tls::Tls;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;

use crate::moves::{EngineCache, Handoffs, MoveMetrics};
use crate::{CacheHub, KvMoves, LoadSource, WorkerService};

/// How long in-flight requests may run after shutdown begins, unless configured.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(10);
/// How long a drain waits for its hand-offs, unless configured.
pub const DEFAULT_DRAIN_HANDOFF: Duration = Duration::from_secs(5);
/// Bytes of KV a drain keeps for hand-offs at most, unless configured.
pub const DEFAULT_DRAIN_HANDOFF_BYTES: u64 = 1 << 30;

/// A worker's KV pool in MiB, unless configured or the model's context needs more
/// ([`kv_budget_bytes`]).
pub const DEFAULT_KV_BUDGET_MB: usize = 512;

/// A worker's KV pool in bytes: `configured_mb` MiB, or else [`DEFAULT_KV_BUDGET_MB`] or one
/// sequence of `model`'s whole context in `dtype`, whichever is more, so that a node serves
/// every request the context allows.
pub fn kv_budget_bytes(model: &Model, dtype: KvDtype, configured_mb: Option<usize>) -> usize {
    configured_mb.map_or_else(
        || {
            let block_bytes = model.config.kv_layout(dtype).block_bytes();
            let context_blocks = model.config.context_len.div_ceil(BLOCK_TOKENS);
            (context_blocks * block_bytes).max(DEFAULT_KV_BUDGET_MB << 20)
        },
        |mb| mb << 20,
    )
}

/// What every worker node is configured with.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub model: Arc<Model>,
    /// The engine; what its `prefix_cache_bytes` holds is the node's (a prefill node's prefix
    /// cache, a decode node's session cache).
    pub engine: EngineConfig,
    /// Mutual TLS: this node's certificate, and the only way to reach it and for it to reach
    /// others.
    pub tls: Option<Tls>,
    /// How long in-flight requests may run after shutdown begins.
    pub grace: Duration,
    /// The drain's hand-off ([`crate::moves`]): how long it waits for peers to fetch what it
    /// hands off (a decode node's running streams, the cached sequences it offers) before the
    /// listener closes (zero: no hand-off).
    pub drain_handoff: Duration,
    /// The most KV (bytes) the drain hands off: a decode node's running streams' first, then
    /// the most recently used cached sequences.
    pub drain_handoff_bytes: u64,
}

impl NodeConfig {
    pub fn new(model: Arc<Model>, engine: EngineConfig) -> Self {
        Self {
            model,
            engine,
            tls: None,
            grace: DEFAULT_GRACE,
            drain_handoff: DEFAULT_DRAIN_HANDOFF,
            drain_handoff_bytes: DEFAULT_DRAIN_HANDOFF_BYTES,
        }
    }

    /// The KV a drain may keep for peers to fetch: none without a hand-off window, since
    /// nobody could fetch it.
    pub fn handoff_budget(&self) -> u64 {
        if self.drain_handoff.is_zero() {
            0
        } else {
            self.drain_handoff_bytes
        }
    }
}

/// Why a node could not start or stopped serving; a request's failures are the node's own
/// error type.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("invalid setting {field}: {reason}")]
    Config { field: &'static str, reason: String },

    #[error("cannot start the {thread} thread: {source}")]
    Spawn {
        thread: &'static str,
        #[source]
        source: std::io::Error,
    },

    #[error("cannot start the engine: {0}")]
    Engine(#[from] tandem_engine::Error),

    #[error("serving failed: {0}")]
    Serve(#[from] tonic::transport::Error),
}

impl NodeError {
    /// A setting no node can start with.
    pub fn config(field: &'static str, reason: impl Into<String>) -> Self {
        Self::Config {
            field,
            reason: reason.into(),
        }
    }

    /// A node thread's spawn failure.
    pub fn spawn(thread: &'static str) -> impl FnOnce(std::io::Error) -> Self {
        move |source| Self::Spawn { thread, source }
    }
}

/// A node being started: its settings, its metrics, its cache events, and the token that ends
/// its long streams (cache events, held requests) as the drain begins.
#[derive(Debug)]
pub struct Node {
    pub config: NodeConfig,
    pub registry: Registry,
    pub hub: Arc<CacheHub>,
    pub root: CancellationToken,
    /// `"prefill"` or `"decode"`: the role `Worker.Info` reports and the logs name.
    role: &'static str,
    /// The engine's disk tier's figures, once it has one.
    spill: Option<Arc<SpillStats>>,
}

impl Node {
    pub fn new(role: &'static str, config: NodeConfig) -> Self {
        Self {
            config,
            registry: Registry::default(),
            hub: Arc::default(),
            root: CancellationToken::new(),
            role,
            spill: None,
        }
    }

    /// The node's engine, as configured; its disk tier's figures join the node's metrics.
    pub fn engine(&mut self) -> Result<Engine, NodeError> {
        let engine = Engine::new(self.config.model.clone(), self.config.engine.clone())?;
        let pool_tokens = engine.kv_blocks_total() * BLOCK_TOKENS;
        let context_tokens = self.config.model.config.context_len;
        if pool_tokens >= context_tokens {
            tracing::info!(
                role = self.role,
                pool_tokens,
                context_tokens,
                "the KV pool holds a sequence of the model's whole context"
            );
        } else {
            tracing::warn!(
                role = self.role,
                pool_tokens,
                context_tokens,
                "the KV pool holds less than the model's context: the longest sequence served \
                 (prompt + max_tokens) is pool_tokens; --kv-budget-mb sets the pool"
            );
        }
        if self.config.engine.spill.is_some() {
            self.registry.register_collector(Box::new(SpillMetrics {
                role: self.role,
                stats: engine.spill_stats(),
            }));
            self.spill = Some(engine.spill_stats());
        }
        Ok(engine)
    }

    /// The node's KV moves ([`crate::moves`]), through the `cache` its engine thread answers:
    /// a KV of `kv_layout`, a cache that keeps sequences when `enabled`, and the drain's kept
    /// sequences in `handoffs`. Their counters join the node's metrics.
    pub fn moves(
        &mut self,
        kv_layout: KvLayout,
        enabled: bool,
        cache: EngineCache,
        handoffs: Arc<Handoffs>,
    ) -> KvMoves {
        KvMoves::new(
            self.config.model.clone(),
            kv_layout,
            self.config.tls.clone(),
            cache,
            enabled,
            handoffs,
            MoveMetrics::register(&mut self.registry, self.role),
        )
    }

    /// Serves `routes` (the node's own services, named in [`Serving::services`]) with the
    /// `Worker` service (answering from `serving`), health, reflection and `/metrics`, on
    /// `serving`'s listener until `shutdown` completes. Then the node reports NOT_SERVING and runs `handoff` (still
    /// accepting calls, so that peers can fetch what it hands off); then the root token is
    /// cancelled, so that long streams do not hold up the drain, the listener closes and
    /// in-flight calls get the grace period. The node's own threads are its to stop once this
    /// returns.
    pub async fn serve(
        self,
        serving: Serving,
        routes: impl FnOnce(Routes) -> Routes,
        shutdown: impl Future<Output = ()>,
        handoff: impl Future<Output = ()>,
    ) -> Result<(), NodeError> {
        let Serving {
            listener,
            kv_layout,
            load,
            moves,
            services,
        } = serving;
        let Self {
            config,
            mut registry,
            hub,
            root,
            role,
            spill,
        } = self;
        registry.register_collector(Box::new(ModelServerMetrics { load: load.clone() }));
        let worker = WorkerService::new(
            crate::worker_info(&config.model, kv_layout, role),
            load,
            hub,
            spill,
            moves,
            root.child_token(),
        );
        let (health, health_service) = tonic_health::server::health_reporter();
        let routes = routes(Routes::new(health_service).add_service(worker.into_server()));
        let mut service_names = services.to_vec();
        service_names.push("tandem.v1.Worker");
        tracing::info!(addr = ?listener.local_addr().ok(), model = %config.model.name, "{role} node serving");
        let served = tandem_net::serve(
            listener,
            routes,
            tandem_net::ServeOptions {
                service_names,
                health,
                metrics: Arc::new(registry),
                grace: config.grace,
                tls: config.tls.map(tandem_net::ServerTls::Mutual),
            },
            shutdown,
            async {
                handoff.await;
                root.cancel();
            },
        )
        .await;
        root.cancel();
        Ok(served?)
    }
}

/// What a node serves on besides the scaffold's own: its listener, what the `Worker` service
/// answers from, and its own services' names.
pub struct Serving {
    pub listener: TcpListener,
    /// The KV layout `Worker.Info` reports.
    pub kv_layout: KvLayout,
    /// What `Worker.Load` (and the model-server metrics) answer.
    pub load: Arc<dyn LoadSource>,
    /// The KV moves `Worker.Sessions`, `Adopt` and `Release` make.
    pub moves: KvMoves,
    /// The node's own services, by their gRPC names (health and reflection list them).
    pub services: &'static [&'static str],
}

impl std::fmt::Debug for Serving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Serving")
            .field("listener", &self.listener)
            .field("services", &self.services)
            .finish_non_exhaustive()
    }
}

/// The Gateway API Inference Extension's model-server metrics, under the names its protocol
/// documents (vLLM's, which its endpoint picker reads by default), from the node's
/// `Worker.Load` answer at each scrape: requests queued and running, the KV pool's use (a
/// fraction: 1 is full) and, as labels of an info gauge, the block size and the pool's blocks.
struct ModelServerMetrics {
    load: Arc<dyn LoadSource>,
}

impl std::fmt::Debug for ModelServerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelServerMetrics").finish_non_exhaustive()
    }
}

impl Collector for ModelServerMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let load = self.load.load();
        for (name, help, value) in [
            (
                "vllm:num_requests_waiting",
                "Requests waiting for a place (TotalQueuedRequests)",
                load.queued,
            ),
            (
                "vllm:num_requests_running",
                "Requests being served (TotalRunningRequests)",
                load.active,
            ),
        ] {
            let gauge = ConstGauge::new(i64::from(value));
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        let used = load.kv_blocks_total.saturating_sub(load.kv_blocks_free);
        let usage = match load.kv_blocks_total {
            0 => 0.0,
            total => used as f64 / total as f64,
        };
        let gauge = ConstGauge::new(usage);
        gauge.encode(encoder.encode_descriptor(
            "vllm:kv_cache_usage_perc",
            "KV pool use, 1 is full (KVCacheUtilization)",
            None,
            gauge.metric_type(),
        )?)?;
        let info = ConstGauge::new(1i64);
        let labels = [
            ("block_size", tandem_engine::BLOCK_TOKENS.to_string()),
            ("num_gpu_blocks", load.kv_blocks_total.to_string()),
        ];
        let mut family = encoder.encode_descriptor(
            "vllm:cache_config_info",
            "The KV pool's block size in tokens and its blocks (BlockSize, NumGPUBlocks)",
            None,
            info.metric_type(),
        )?;
        info.encode(family.encode_family(&labels)?)?;
        Ok(())
    }
}

/// The disk tier's figures, read at each scrape: `tandem_<role>_kv_spill_*`.
#[derive(Debug)]
struct SpillMetrics {
    role: &'static str,
    stats: Arc<SpillStats>,
}

impl Collector for SpillMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use std::sync::atomic::Ordering::Relaxed;
        let s = &self.stats;
        for (name, help, value) in [
            (
                "stored_blocks",
                "KV blocks written to the disk tier",
                &s.stored,
            ),
            (
                "restored_blocks",
                "KV blocks read back from the disk tier instead of computed",
                &s.restored,
            ),
            (
                "corrupt_blocks",
                "spilled KV blocks found damaged when read, deleted and computed again",
                &s.corrupt,
            ),
            (
                "dropped_blocks",
                "evicted KV blocks not spilled because the writer was behind",
                &s.dropped,
            ),
        ] {
            let counter = ConstCounter::new(value.load(Relaxed));
            let name = format!("tandem_{}_kv_spill_{name}", self.role);
            counter.encode(encoder.encode_descriptor(
                &name,
                help,
                None,
                counter.metric_type(),
            )?)?;
        }
        let bytes = ConstGauge::new(i64::try_from(s.bytes.load(Relaxed)).unwrap_or(i64::MAX));
        let name = format!("tandem_{}_kv_spill_bytes", self.role);
        bytes.encode(encoder.encode_descriptor(
            &name,
            "bytes of KV on the disk tier",
            None,
            bytes.metric_type(),
        )?)?;
        Ok(())
    }
}
