//! The router's Prometheus metrics.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

mod labels;

pub use labels::*;

pub const TTFT: &str = "tandem_ttft_seconds";
pub const INTER_TOKEN: &str = "tandem_inter_token_seconds";
pub const QUEUE: &str = "tandem_queue_seconds";
pub const PREPARE: &str = "tandem_router_prepare_seconds";
pub const ROUTE: &str = "tandem_router_route_seconds";
pub const REQUESTS: &str = "tandem_requests";
pub const DISAGG_DECISIONS: &str = "tandem_router_disagg_decisions";
pub const REPLICA_UP: &str = "tandem_router_replica_up";
pub const INDEX_EVENTS_BEHIND: &str = "tandem_router_index_events_behind";
pub const INDEX_SECONDS_SINCE_SYNC: &str = "tandem_router_index_seconds_since_sync";
pub const INDEX_MODE: &str = "tandem_router_index_mode";
pub const INDEX_BLOCKS: &str = "tandem_router_index_blocks";
pub const ATTEMPTS: &str = "tandem_router_dispatch_attempts";
pub const FAILOVERS: &str = "tandem_router_failovers";
pub const HANDOFFS: &str = "tandem_router_handoffs";
pub const LAST_RESORT: &str = "tandem_router_last_resort";
pub const DECODE_STALLS: &str = "tandem_router_decode_stalls";
pub const QUEUED: &str = "tandem_router_queued_requests";
pub const REFUSED: &str = "tandem_router_refused_requests";
pub const QUEUE_TIMEOUTS: &str = "tandem_router_queue_timeouts";
pub const TENANT_TOKENS: &str = "tandem_router_tenant_tokens";
pub const TTFT_FAIL_OPEN: &str = "tandem_router_ttft_fail_open";
pub const PROMPT_TOKENS: &str = "tandem_router_prompt_tokens";
pub const CACHED_PROMPT_TOKENS: &str = "tandem_router_cached_prompt_tokens";
pub const FETCHED_TOKENS: &str = "tandem_router_fetched_tokens";
pub const COMPUTED_TOKENS: &str = "tandem_router_computed_prompt_tokens";
pub const MOVED_SESSIONS: &str = "tandem_router_moved_sessions";
pub const MOVED_SESSION_TOKENS: &str = "tandem_router_moved_session_tokens";
pub const SESSIONS_OPEN: &str = "tandem_router_sessions_open";
pub const SESSION_RELEASES: &str = "tandem_router_session_releases";
pub const SESSION_TURN_TOKENS: &str = "tandem_router_session_turn_tokens";
pub const MODEL_REQUESTS: &str = "tandem_model_requests";
pub const MODEL_TTFT: &str = "tandem_model_ttft_seconds";
pub const MODEL_PROMPT_TOKENS: &str = "tandem_model_prompt_tokens";
pub const MODEL_CACHED_PROMPT_TOKENS: &str = "tandem_model_cached_prompt_tokens";
pub const MODEL_GENERATED_TOKENS: &str = "tandem_model_generated_tokens";
pub const MODEL_REPLICAS: &str = "tandem_router_model_replicas";
pub const DESIRED_REPLICAS: &str = "tandem_router_desired_replicas";
pub const PICKS: &str = "tandem_router_picks";
pub const PICKER_SHED: &str = "tandem_router_picker_shed";
pub const PEER_STALENESS: &str = "tandem_router_peer_staleness_seconds";
pub const PEER_ATTACHES: &str = "tandem_router_peer_attaches";

/// The codes a request can end with (pre-set to 0 so that rates exist from the start).
const CODES: [tonic::Code; 8] = [
    tonic::Code::Ok,
    tonic::Code::InvalidArgument,
    tonic::Code::NotFound,
    tonic::Code::ResourceExhausted,
    tonic::Code::Unavailable,
    tonic::Code::DeadlineExceeded,
    tonic::Code::Cancelled,
    tonic::Code::DataLoss,
];

/// A histogram of token counts per turn: 16 to about 1M.
fn turn_tokens() -> Histogram {
    Histogram::new(exponential_buckets(16.0, 2.0, 17))
}

fn ttft_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

#[derive(Clone, Debug)]
pub struct RouterMetrics {
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub queue: Histogram,
    /// The router's own work on a request before it is routed: checks, chat template,
    /// tokenization, block hashes.
    pub prepare: Histogram,
    /// One routing decision: the cache index read for every replica and the cost formula.
    pub route: Histogram,
    /// Requests waiting in the router's queue for room on a decode replica.
    pub queued: Gauge,
    /// Requests refused at once for want of room, by reason.
    pub refused: Family<RefusalLabel, Counter>,
    /// Requests whose deadline passed while they waited in the router's queue.
    pub queue_timeouts: Counter,
    /// Tokens served per tenant: what the admission order's fair shares divide.
    pub tenant_tokens: Family<TenantLabel, Counter>,
    /// 1 while the TTFT targets go unchecked because the load figures they would be checked
    /// against are stale (the last check found them so and admitted), else 0.
    pub ttft_fail_open: Gauge,
    pub requests: Family<StatusLabel, Counter>,
    pub disagg_decisions: Family<DecisionLabel, Counter>,
    /// 1 while the replica is healthy and serves the router's model.
    pub replica_up: Family<ReplicaLabel, Gauge>,
    pub index_events_behind: Family<ReplicaLabel, Gauge>,
    pub index_seconds_since_sync: Family<ReplicaLabel, Gauge<f64, AtomicU64>>,
    /// 1 for the index's current mode, 0 for the others.
    pub index_mode: Family<ReplicaModeLabel, Gauge>,
    pub index_blocks: Family<ReplicaLabel, Gauge>,
    /// Dispatch attempts, first ones and failovers alike.
    pub attempts: Counter,
    pub failovers: Family<HopLabel, Counter>,
    /// Attempts that continued a stream a draining decode node handed off (or refused as it
    /// began to drain); failovers do not count them.
    pub handoffs: Counter,
    /// Handed-off streams sent back to a draining decode node, as no decode node outside a
    /// drain could take them.
    pub last_resort: Counter,
    /// Decode streams silent past the token gap on a node that still served (busy, not dead).
    pub decode_stalls: Counter,
    /// Prompt tokens of completed requests, and those of them a cache supplied: the
    /// cluster's prefix-cache hit rate is their ratio.
    pub prompt_tokens: Counter,
    pub cached_prompt_tokens: Counter,
    /// Prompt tokens whose KV a decode node fetched from a peer instead of computing it.
    pub fetched_tokens: Counter,
    /// Prompt tokens computed (neither cached nor fetched), over every attempt.
    pub computed_tokens: Counter,
    /// Cached sequences of draining workers that a peer took, and the tokens it fetched, by
    /// role.
    pub moved_sessions: Family<RoleLabel, Counter>,
    pub moved_session_tokens: Family<RoleLabel, Counter>,
    /// Agent sessions open ([`crate::cluster::sessions`]).
    pub sessions_open: Gauge,
    /// Sessions whose KV was moved to disk or released, by reason.
    pub session_releases: Family<ReasonLabel, Counter>,
    /// Per session turn, its prompt tokens by where they came from: a pool's cache, a disk
    /// tier, or computed again although the session's previous turn had them.
    pub session_turn_tokens: Family<SourceLabel, Histogram, fn() -> Histogram>,
    /// Per model: accepted requests by final status, time to first token, and tokens (the
    /// prompt's, those of it a cache supplied, and the generated ones).
    pub model_requests: Family<ModelStatusLabel, Counter>,
    pub model_ttft: Family<ModelLabel, Histogram, fn() -> Histogram>,
    pub model_prompt_tokens: Family<ModelLabel, Counter>,
    pub model_cached_prompt_tokens: Family<ModelLabel, Counter>,
    pub model_generated_tokens: Family<ModelLabel, Counter>,
    /// Replicas up per model and role.
    pub model_replicas: Family<ModelRoleLabel, Gauge>,
    /// The replicas each model's roles need ([`crate::cluster::scaling`]).
    pub desired_replicas: Family<ModelRoleLabel, Gauge>,
    /// The endpoint picker's decisions: requests sent to each endpoint, and those shed by
    /// HTTP status.
    pub picks: Family<DestinationLabel, Counter>,
    pub picker_shed: Family<HttpStatusLabel, Counter>,
    /// Per peer router: how old this router's view of its state is.
    pub peer_staleness: Family<PeerLabel, Gauge<f64, AtomicU64>>,
    /// Retries of a request id running on a peer router that attached to it there.
    pub peer_attaches: Counter,
}

impl RouterMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::new();
        m.register_requests(registry);
        m.register_cluster(registry);
        m
    }

    /// Every metric at zero, and the series a dashboard queries made before their first event.
    fn new() -> Self {
        let m = Self {
            ttft: ttft_histogram(),
            inter_token: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            queue: Histogram::new(exponential_buckets(0.0001, 2.0, 18)),
            prepare: Histogram::new(exponential_buckets(0.000_01, 2.0, 18)),
            route: Histogram::new(exponential_buckets(0.000_001, 2.0, 18)),
            queued: Gauge::default(),
            refused: Family::default(),
            queue_timeouts: Counter::default(),
            tenant_tokens: Family::default(),
            ttft_fail_open: Gauge::default(),
            requests: Family::default(),
            disagg_decisions: Family::default(),
            replica_up: Family::default(),
            index_events_behind: Family::default(),
            index_seconds_since_sync: Family::default(),
            index_mode: Family::default(),
            index_blocks: Family::default(),
            attempts: Counter::default(),
            failovers: Family::default(),
            handoffs: Counter::default(),
            last_resort: Counter::default(),
            decode_stalls: Counter::default(),
            prompt_tokens: Counter::default(),
            cached_prompt_tokens: Counter::default(),
            fetched_tokens: Counter::default(),
            computed_tokens: Counter::default(),
            moved_sessions: Family::default(),
            moved_session_tokens: Family::default(),
            sessions_open: Gauge::default(),
            session_releases: Family::default(),
            session_turn_tokens: Family::new_with_constructor(turn_tokens),
            model_requests: Family::default(),
            model_ttft: Family::new_with_constructor(ttft_histogram),
            model_prompt_tokens: Family::default(),
            model_cached_prompt_tokens: Family::default(),
            model_generated_tokens: Family::default(),
            model_replicas: Family::default(),
            desired_replicas: Family::default(),
            picks: Family::default(),
            picker_shed: Family::default(),
            peer_staleness: Family::default(),
            peer_attaches: Counter::default(),
        };
        // Series a dashboard queries exist before their first event.
        for hop in ["decode", "prefill"] {
            let _ = m.failovers.get_or_create(&HopLabel { hop });
        }
        for reason in ["queue_full", "deadline"] {
            let _ = m.refused.get_or_create(&RefusalLabel { reason });
        }
        for code in CODES {
            let _ = m.requests.get_or_create(&StatusLabel {
                code: format!("{code:?}"),
            });
        }
        m
    }

    /// The requests' metrics: latencies, queue, outcomes, attempts and prompt tokens.
    fn register_requests(&self, registry: &mut Registry) {
        registry.register(TTFT, "Time from request to first token", self.ttft.clone());
        registry.register(
            INTER_TOKEN,
            "Time between token frames",
            self.inter_token.clone(),
        );
        registry.register(
            QUEUE,
            "Time from request to admission on a decode node (the router's queue included)",
            self.queue.clone(),
        );
        registry.register(
            PREPARE,
            "The router's work on a request before routing it: checks, chat template, tokenization (only text it has not seen before) and block hashes",
            self.prepare.clone(),
        );
        registry.register(
            ROUTE,
            "One routing decision: every replica's cache index read and the cost formula",
            self.route.clone(),
        );
        registry.register(
            QUEUED,
            "Requests waiting in the router's queue for room on a decode replica",
            self.queued.clone(),
        );
        registry.register(
            REFUSED,
            "Requests refused at once for want of room: the queue was full (queue_full), its wait would outlast the request's deadline (deadline), or the predicted time to first token misses the request's target (ttft_target)",
            self.refused.clone(),
        );
        registry.register(
            QUEUE_TIMEOUTS,
            "Requests whose deadline passed while they waited in the router's queue (DEADLINE_EXCEEDED naming the queue)",
            self.queue_timeouts.clone(),
        );
        registry.register(
            TTFT_FAIL_OPEN,
            "1 while requests with a TTFT target are admitted unchecked because the chosen workers' load reports are stale (fail open), else 0",
            self.ttft_fail_open.clone(),
        );
        registry.register(
            TENANT_TOKENS,
            "Tokens served per tenant (prompt tokens at admission, generated tokens at the end): what the fair shares within a priority class divide",
            self.tenant_tokens.clone(),
        );
        registry.register(REQUESTS, "Requests by final status", self.requests.clone());
        registry.register(
            DISAGG_DECISIONS,
            "Routing decisions: remote prefill with a KV transfer, or local prefill on decode",
            self.disagg_decisions.clone(),
        );
        registry.register(
            REPLICA_UP,
            "1 while the replica is healthy and serves the router's model",
            self.replica_up.clone(),
        );
        registry.register(
            INDEX_EVENTS_BEHIND,
            "Cache events a replica reported that the router's index has not applied",
            self.index_events_behind.clone(),
        );
        registry.register(
            INDEX_SECONDS_SINCE_SYNC,
            "Seconds since the router's index of a replica's cache was last known current",
            self.index_seconds_since_sync.clone(),
        );
        registry.register(
            INDEX_MODE,
            "The index's mode per replica (exact, resyncing, fallback): 1 for the current one",
            self.index_mode.clone(),
        );
        registry.register(
            INDEX_BLOCKS,
            "Block hashes the router's index holds per replica",
            self.index_blocks.clone(),
        );
        registry.register(
            ATTEMPTS,
            "Dispatch attempts (a request's first, and each failover)",
            self.attempts.clone(),
        );
        registry.register(
            FAILOVERS,
            "Generations resumed on other replicas after a replica failed, by failed hop",
            self.failovers.clone(),
        );
        registry.register(
            HANDOFFS,
            "Generations continued on another decode replica because theirs drained (it handed the stream off, or refused it as it began to drain)",
            self.handoffs.clone(),
        );
        registry.register(
            LAST_RESORT,
            "Handed-off streams sent back to a draining decode node to finish, as no decode node outside a drain could take them",
            self.last_resort.clone(),
        );
        registry.register(
            DECODE_STALLS,
            "Decode streams silent past the token gap on a node that still served: waited, not failed over",
            self.decode_stalls.clone(),
        );
    }

    /// The cluster's metrics: replicas, the cache index, sessions, models, the picker, peers.
    fn register_cluster(&self, registry: &mut Registry) {
        registry.register(
            PROMPT_TOKENS,
            "Prompt tokens of completed requests",
            self.prompt_tokens.clone(),
        );
        registry.register(
            CACHED_PROMPT_TOKENS,
            "Prompt tokens of completed requests that a prefix or session cache supplied",
            self.cached_prompt_tokens.clone(),
        );
        registry.register(
            FETCHED_TOKENS,
            "Prompt tokens whose KV a decode node fetched from a peer's cache instead of computing it",
            self.fetched_tokens.clone(),
        );
        registry.register(
            COMPUTED_TOKENS,
            "Prompt tokens computed (neither cached nor fetched), over every attempt",
            self.computed_tokens.clone(),
        );
        registry.register(
            MOVED_SESSIONS,
            "Cached sequences of draining workers (decode: sessions; prefill: prompts) moved to a peer of their role, with their KV",
            self.moved_sessions.clone(),
        );
        registry.register(
            MOVED_SESSION_TOKENS,
            "Tokens of KV fetched by peers for sequences moved off draining workers",
            self.moved_session_tokens.clone(),
        );
        registry.register(
            SESSIONS_OPEN,
            "Agent sessions open: seen within the session TTL and not ended",
            self.sessions_open.clone(),
        );
        registry.register(
            SESSION_RELEASES,
            "Sessions whose KV left the pools, by reason: idle_to_disk (moved to the disk tier, still open), expired, ended by the client, key_limit (the key opened more sessions than it may)",
            self.session_releases.clone(),
        );
        registry.register(
            SESSION_TURN_TOKENS,
            "Per session turn, prompt tokens by source: pool (a KV pool's cache), disk (read back from a disk tier), recomputed (the previous turn had them, no cache did)",
            self.session_turn_tokens.clone(),
        );
        registry.register(
            MODEL_REQUESTS,
            "Accepted requests by model and final status",
            self.model_requests.clone(),
        );
        registry.register(
            MODEL_TTFT,
            "Time from request to first token, by model",
            self.model_ttft.clone(),
        );
        registry.register(
            MODEL_PROMPT_TOKENS,
            "Prompt tokens of completed requests, by model",
            self.model_prompt_tokens.clone(),
        );
        registry.register(
            MODEL_CACHED_PROMPT_TOKENS,
            "Prompt tokens of completed requests that a cache supplied, by model",
            self.model_cached_prompt_tokens.clone(),
        );
        registry.register(
            MODEL_GENERATED_TOKENS,
            "Tokens generated, by model",
            self.model_generated_tokens.clone(),
        );
        registry.register(
            MODEL_REPLICAS,
            "Replicas up (healthy, serving the model) by model and role",
            self.model_replicas.clone(),
        );
        registry.register(
            DESIRED_REPLICAS,
            "Replicas each model's role needs, from its load and queue against its measured capacity (for KEDA or an HPA)",
            self.desired_replicas.clone(),
        );
        registry.register(
            PICKS,
            "Requests the endpoint picker sent to each endpoint",
            self.picks.clone(),
        );
        registry.register(
            PICKER_SHED,
            "Requests the endpoint picker shed, by HTTP status (429, 503)",
            self.picker_shed.clone(),
        );
        registry.register(
            PEER_STALENESS,
            "Seconds since this router last heard a peer router's state (sessions, load, running generations)",
            self.peer_staleness.clone(),
        );
        registry.register(
            PEER_ATTACHES,
            "Requests whose id was running on a peer router and that attached to it there",
            self.peer_attaches.clone(),
        );
    }

    /// The histogram of a session turn's tokens from `source`.
    pub fn session_turn_tokens(&self, source: &'static str) -> Histogram {
        self.session_turn_tokens
            .get_or_create(&SourceLabel { source })
            .clone()
    }

    pub fn session_released(&self, reason: &'static str) {
        self.session_releases
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    pub fn failover(&self, hop: &'static str) {
        self.failovers.get_or_create(&HopLabel { hop }).inc();
    }

    pub fn refused(&self, reason: &'static str) {
        self.refused.get_or_create(&RefusalLabel { reason }).inc();
    }

    /// An accepted request on `model` ended with `code`, having generated `generated` tokens.
    pub fn model_finished(&self, model: &str, code: tonic::Code, generated: u64) {
        self.model_requests
            .get_or_create(&ModelStatusLabel {
                model: model.to_string(),
                code: format!("{code:?}"),
            })
            .inc();
        self.model_generated_tokens
            .get_or_create(&ModelLabel {
                model: model.to_string(),
            })
            .inc_by(generated);
    }

    /// A request on `model` saw its first token after `seconds`.
    pub fn model_first_token(&self, model: &str, seconds: f64) {
        self.model_ttft
            .get_or_create(&ModelLabel {
                model: model.to_string(),
            })
            .observe(seconds);
    }

    /// A completed request on `model` had `prompt` prompt tokens, `cached` of them from a cache.
    pub fn model_prompt(&self, model: &str, prompt: u64, cached: u64) {
        let label = ModelLabel {
            model: model.to_string(),
        };
        self.model_prompt_tokens
            .get_or_create(&label)
            .inc_by(prompt);
        self.model_cached_prompt_tokens
            .get_or_create(&label)
            .inc_by(cached);
    }

    pub fn picked(&self, destination: &str) {
        self.picks
            .get_or_create(&DestinationLabel {
                destination: destination.to_string(),
            })
            .inc();
    }

    pub fn picker_shed(&self, status: u16) {
        self.picker_shed
            .get_or_create(&HttpStatusLabel { status })
            .inc();
    }

    pub fn tenant_served(&self, tenant: &str, tokens: u64) {
        self.tenant_tokens
            .get_or_create(&TenantLabel {
                tenant: tenant.to_string(),
            })
            .inc_by(tokens);
    }

    pub fn finished(&self, code: tonic::Code) {
        self.requests
            .get_or_create(&StatusLabel {
                code: format!("{code:?}"),
            })
            .inc();
    }
}
