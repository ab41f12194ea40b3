//! The decode node's Prometheus metrics.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

pub const ACTIVE_SLOTS: &str = "tandem_decode_active_slots";
pub const WAITING_SEQUENCES: &str = "tandem_decode_waiting_sequences";
pub const KV_BLOCKS_IN_USE: &str = "tandem_decode_kv_blocks_in_use";
pub const KV_BLOCKS_FREE: &str = "tandem_decode_kv_blocks_free";
pub const STEPS: &str = "tandem_decode_steps";
pub const STEP_SECONDS: &str = "tandem_decode_step_seconds";
pub const KV_IMPORT_SECONDS: &str = "tandem_decode_kv_import_seconds";
pub const TOKENS: &str = "tandem_decode_tokens";
pub const KV_BLOCKS_CACHED: &str = "tandem_decode_kv_blocks_cached";
pub const CACHED_TOKENS: &str = "tandem_decode_cached_tokens";
pub const LOCAL_PREFILL_TOKENS: &str = "tandem_decode_local_prefill_tokens";
pub const DRAFT_TOKENS: &str = "tandem_decode_draft_tokens";
pub const ACCEPTED_DRAFT_TOKENS: &str = "tandem_decode_accepted_draft_tokens";
pub const FETCHED_TOKENS: &str = "tandem_decode_fetched_tokens";
pub const HANDED_OFF_STREAMS: &str = "tandem_decode_handed_off_streams";
pub const HANDED_OFF_TOKENS: &str = "tandem_decode_handed_off_tokens";
pub const PREEMPTIONS: &str = "tandem_decode_preemptions";
pub const HELD_BACK_STEPS: &str = "tandem_decode_held_back_steps";
pub const HELD_BACK_ROWS: &str = "tandem_decode_held_back_rows";
pub const UNDRAFTED_ROWS: &str = "tandem_decode_undrafted_rows";
pub const PARKED_STREAMS: &str = "tandem_decode_parked_streams";
pub const PARKED_BYTES: &str = "tandem_decode_parked_bytes";
pub const PARKED_DISK_BYTES: &str = "tandem_decode_parked_disk_bytes";
pub const RESUME_SECONDS: &str = "tandem_decode_resume_seconds";
pub const PAUSED_SECONDS: &str = "tandem_decode_paused_seconds";
pub const RECOMPUTED_TOKENS: &str = "tandem_decode_recomputed_tokens";
pub const MAX_TOKENS_CUT: &str = "tandem_decode_max_tokens_cut";

#[derive(Clone, Debug)]
pub struct DecodeMetrics {
    pub active_slots: Gauge,
    /// Sequences that hold their KV and wait for a batch slot.
    pub waiting_sequences: Gauge,
    pub kv_blocks_in_use: Gauge,
    pub kv_blocks_free: Gauge,
    /// Batched decode steps; `rate()` of it is steps per second.
    pub steps: Counter,
    /// Steps taken beside an interactive stream while batch-class streams waited without a
    /// slot, and those streams summed over the steps.
    pub held_back_steps: Counter,
    pub held_back_rows: Counter,
    /// Rows of lower classes decoded without drafts beside an interactive stream.
    pub undrafted_rows: Counter,
    pub step_seconds: Histogram,
    /// The scheduler's time between two steps spent copying pushed KV into the pool (a round of
    /// imports).
    pub kv_import_seconds: Histogram,
    pub tokens: Counter,
    /// Blocks the session cache keeps (some may be in use by running sequences too).
    pub kv_blocks_cached: Gauge,
    /// Prompt tokens found in the session cache at admission.
    pub cached_tokens: Counter,
    /// Prompt tokens computed here (conditional disaggregation).
    pub local_prefill_tokens: Counter,
    /// Speculative decoding: tokens drafted, and those accepted.
    pub draft_tokens: Counter,
    pub accepted_draft_tokens: Counter,
    /// Prompt tokens whose KV was fetched from a peer's cache instead of computed.
    pub fetched_tokens: Counter,
    /// Running streams handed off at drain, and the tokens of KV kept for their peers to fetch.
    pub handed_off_streams: Counter,
    pub handed_off_tokens: Counter,
    /// Running streams paused for a waiting stream of a higher class, and those paused now.
    pub preemptions: Counter,
    pub parked_streams: Gauge,
    /// The paused streams' KV, and of it what went to the disk tier.
    pub parked_bytes: Counter,
    pub parked_disk_bytes: Counter,
    /// What bringing a paused stream's KV back took, and how long it was paused.
    pub resume_seconds: Histogram,
    pub paused_seconds: Histogram,
    /// Tokens of paused streams computed again because the disk tier no longer had them.
    pub recomputed_tokens: Counter,
    /// Requests admitted with their max_tokens cut to what the KV pool holds.
    pub max_tokens_cut: Counter,
}

impl DecodeMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            active_slots: Gauge::default(),
            waiting_sequences: Gauge::default(),
            kv_blocks_in_use: Gauge::default(),
            kv_blocks_free: Gauge::default(),
            steps: Counter::default(),
            held_back_steps: Counter::default(),
            held_back_rows: Counter::default(),
            undrafted_rows: Counter::default(),
            step_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            kv_import_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 14)),
            tokens: Counter::default(),
            kv_blocks_cached: Gauge::default(),
            cached_tokens: Counter::default(),
            local_prefill_tokens: Counter::default(),
            draft_tokens: Counter::default(),
            accepted_draft_tokens: Counter::default(),
            fetched_tokens: Counter::default(),
            handed_off_streams: Counter::default(),
            handed_off_tokens: Counter::default(),
            preemptions: Counter::default(),
            parked_streams: Gauge::default(),
            parked_bytes: Counter::default(),
            parked_disk_bytes: Counter::default(),
            resume_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 16)),
            paused_seconds: Histogram::new(exponential_buckets(0.01, 2.0, 14)),
            recomputed_tokens: Counter::default(),
            max_tokens_cut: Counter::default(),
        };
        registry.register(
            ACTIVE_SLOTS,
            "Sequences in the decode batch",
            m.active_slots.clone(),
        );
        registry.register(
            WAITING_SEQUENCES,
            "Sequences that hold their KV and wait for a batch slot",
            m.waiting_sequences.clone(),
        );
        registry.register(
            KV_BLOCKS_IN_USE,
            "KV blocks holding sequences",
            m.kv_blocks_in_use.clone(),
        );
        registry.register(
            KV_BLOCKS_FREE,
            "KV blocks free in the pool",
            m.kv_blocks_free.clone(),
        );
        registry.register(
            STEPS,
            "Batched decode steps (rate() = steps per second)",
            m.steps.clone(),
        );
        registry.register(
            STEP_SECONDS,
            "Duration of one batched decode step",
            m.step_seconds.clone(),
        );
        registry.register(
            KV_IMPORT_SECONDS,
            "Time the scheduler spent between two steps copying pushed KV into the pool",
            m.kv_import_seconds.clone(),
        );
        registry.register(TOKENS, "Tokens generated", m.tokens.clone());
        registry.register(
            KV_BLOCKS_CACHED,
            "KV blocks kept by the session cache",
            m.kv_blocks_cached.clone(),
        );
        registry.register(
            CACHED_TOKENS,
            "Prompt tokens reused from the session cache",
            m.cached_tokens.clone(),
        );
        registry.register(
            LOCAL_PREFILL_TOKENS,
            "Prompt tokens prefilled on the decode node",
            m.local_prefill_tokens.clone(),
        );
        registry.register(
            DRAFT_TOKENS,
            "Tokens drafted by prompt-lookup speculative decoding",
            m.draft_tokens.clone(),
        );
        registry.register(
            ACCEPTED_DRAFT_TOKENS,
            "Drafted tokens that verification accepted",
            m.accepted_draft_tokens.clone(),
        );
        registry.register(
            FETCHED_TOKENS,
            "Prompt tokens whose KV was fetched from a peer instead of computed",
            m.fetched_tokens.clone(),
        );
        registry.register(
            HANDED_OFF_STREAMS,
            "Running streams handed off to a peer at drain, with their KV",
            m.handed_off_streams.clone(),
        );
        registry.register(
            HANDED_OFF_TOKENS,
            "Tokens of KV kept at drain for the peers that continue the streams",
            m.handed_off_tokens.clone(),
        );
        m.register_classes(registry);
        registry.register(
            MAX_TOKENS_CUT,
            "Requests whose prompt plus max_tokens the KV pool could never hold, admitted with \
             max_tokens cut to what it holds",
            m.max_tokens_cut.clone(),
        );
        m
    }

    /// What the priority classes do on the node: batch streams held back beside interactive
    /// ones, and streams paused for a higher class.
    fn register_classes(&self, registry: &mut Registry) {
        registry.register(
            HELD_BACK_STEPS,
            "Steps taken beside an interactive stream while batch-class streams waited for a slot",
            self.held_back_steps.clone(),
        );
        registry.register(
            HELD_BACK_ROWS,
            "Batch-class streams left out of the steps beside an interactive stream, summed over \
             the steps (over held_back_steps: streams held per step)",
            self.held_back_rows.clone(),
        );
        registry.register(
            UNDRAFTED_ROWS,
            "Rows of lower-class streams decoded without speculative drafts (a token a step) \
             beside an interactive stream, summed over the steps",
            self.undrafted_rows.clone(),
        );
        registry.register(
            PREEMPTIONS,
            "Running streams paused for a waiting stream of a higher priority class",
            self.preemptions.clone(),
        );
        registry.register(
            PARKED_STREAMS,
            "Streams paused now, their KV parked (pinned or on disk)",
            self.parked_streams.clone(),
        );
        registry.register(
            PARKED_BYTES,
            "KV bytes of the streams paused, pinned or on disk",
            self.parked_bytes.clone(),
        );
        registry.register(
            PARKED_DISK_BYTES,
            "KV bytes of paused streams written to the disk tier",
            self.parked_disk_bytes.clone(),
        );
        registry.register(
            RESUME_SECONDS,
            "Time to bring a paused stream's KV back into the batch",
            self.resume_seconds.clone(),
        );
        registry.register(
            PAUSED_SECONDS,
            "How long a stream was paused: the gap its client saw",
            self.paused_seconds.clone(),
        );
        registry.register(
            RECOMPUTED_TOKENS,
            "Tokens of paused streams computed again because the disk tier no longer held them",
            self.recomputed_tokens.clone(),
        );
    }
}
