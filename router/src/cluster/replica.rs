//! One replica of the set ([`crate::cluster::replicas`]): its channel, its cache index, and what the
//! router knows of it: health, load as reported and as this router counts it in flight, and
//! its measured speeds. [`InflightGuard`] counts a request against it while the request runs.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tandem_proto::policy::Class;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use crate::cluster::index::CacheIndex;

/// A reported speed (f64 bits), or `fallback` while it is 0 (not measured yet).
fn measured_or(bits: &AtomicU64, fallback: f64) -> f64 {
    match f64::from_bits(bits.load(Ordering::Relaxed)) {
        r if r > 0.0 => r,
        _ => fallback,
    }
}

/// The mean of the measured prompt throughputs of `replicas`; `None` while none is measured.
pub fn mean_prefill_rate<'a>(replicas: impl IntoIterator<Item = &'a Arc<Replica>>) -> Option<f64> {
    let (sum, n) = (replicas.into_iter())
        .map(|r| r.prefill_rate())
        .filter(|&r| r > 0.0)
        .fold((0.0, 0usize), |(sum, n), r| (sum + r, n + 1));
    (n > 0).then(|| sum / n as f64)
}

/// How long a replica may take to answer a health check before it counts as gone.
pub const LIVENESS_TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

#[derive(Debug)]
pub struct Replica {
    /// The address dialled: `ip:port` for a replica found by DNS.
    pub addr: String,
    /// What the configuration named (`host:port`); DNS discovery adds and removes the
    /// replicas of a target as the name's answers change.
    pub target: String,
    pub role: Role,
    pub channel: Channel,
    pub index: CacheIndex,
    pub(super) healthy: AtomicBool,
    /// It reported NOT_SERVING and still answers: draining, its cache still fetchable.
    pub(super) draining: AtomicBool,
    pub(super) compatible: AtomicBool,
    /// The model it serves (its `Worker.Info` name); empty until it has said, and in
    /// [`crate::simulation`], whose requests name no model either.
    pub(super) model: RwLock<Arc<str>>,
    /// Wire bytes of one token's KV, as `Worker.Info` says; 0 until known.
    pub(super) kv_bytes_per_token: AtomicU64,
    /// Requests active or queued there, as last reported, less this router's requests that
    /// finished since (the report counted them): a follow-up turn sent right after its previous
    /// turn ended must not find that turn's replica busy for up to a poll interval.
    pub(super) reported: AtomicU32,
    /// Load reports received so far.
    pub(super) reports: AtomicU64,
    pub(super) capacity: AtomicU32,
    /// Prompt tokens queued there (prefill), as last reported: in all, and by priority class.
    pub(super) queued_tokens: AtomicU64,
    pub(super) queued_class_tokens: [AtomicU64; Class::COUNT],
    /// When the last load report came; `None` before the first.
    pub(super) reported_at: Mutex<Option<tokio::time::Instant>>,
    /// Measured prompt throughput (f64 bits), as last reported; 0 until measured.
    pub(super) prefill_tokens_per_second: AtomicU64,
    /// Measured speed of its disk tier's reads (f64 bits, tokens per second); 0 until measured.
    pub(super) restore_tokens_per_second: AtomicU64,
    /// Requests and prompt tokens this router has sent there and not yet seen finish.
    pub(super) inflight: AtomicU32,
    pub(super) inflight_tokens: AtomicU64,
    /// Of those tokens, each priority class's.
    pub(super) inflight_class_tokens: [AtomicU64; Class::COUNT],
    /// Requests and prompt tokens the peer routers said they have there
    /// ([`crate::cluster::peers`]).
    pub(super) peer_inflight: AtomicU32,
    pub(super) peer_inflight_tokens: AtomicU64,
    /// Cancelled when the replica leaves the set; ends its monitor and index tasks.
    pub(super) stop: CancellationToken,
    /// The set's [`crate::cluster::replicas::Replicas::changed`], woken when this replica may
    /// have room again.
    pub(super) changed: Arc<tokio::sync::Notify>,
}

impl Replica {
    pub fn is_up(&self) -> bool {
        self.healthy.load(Ordering::Relaxed) && self.compatible.load(Ordering::Relaxed)
    }

    /// The model it serves; empty until it has said.
    pub fn model(&self) -> Arc<str> {
        // Whole-value stores only; a poisoned lock is still consistent.
        self.model.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether it serves `model`.
    pub fn serves(&self, model: &str) -> bool {
        **self.model.read().unwrap_or_else(|e| e.into_inner()) == *model
    }

    pub(super) fn set_model(&self, model: &str) {
        let mut m = self.model.write().unwrap_or_else(|e| e.into_inner());
        if **m != *model {
            *m = model.into();
        }
    }

    /// Requests there: the larger of the last report (which counts other routers' requests
    /// too, but lags) and the requests in flight there from this router (current) and its peers
    /// (as of their last answer).
    pub fn load(&self) -> u32 {
        let routers = (self.inflight.load(Ordering::Relaxed))
            .saturating_add(self.peer_inflight.load(Ordering::Relaxed));
        self.reported.load(Ordering::Relaxed).max(routers)
    }

    pub fn capacity(&self) -> u32 {
        self.capacity.load(Ordering::Relaxed)
    }

    /// This router's requests on the replica now.
    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::Relaxed) as usize
    }

    /// This router's prompt tokens in flight on the replica now.
    pub fn inflight_tokens(&self) -> u64 {
        self.inflight_tokens.load(Ordering::Relaxed)
    }

    /// Records what the peer routers have in flight there, summed over them.
    pub(crate) fn set_peer_inflight(&self, requests: u32, tokens: u64) {
        self.peer_inflight.store(requests, Ordering::Relaxed);
        self.peer_inflight_tokens.store(tokens, Ordering::Relaxed);
    }

    /// Whether this router may send the replica another request: fewer of its own requests
    /// there than the places the replica reports (any number before its first report). Other
    /// routers' requests show only in the replica's admission, which refuses what does not fit.
    pub fn has_room(&self) -> bool {
        self.holds(self.inflight.load(Ordering::Relaxed) + 1)
    }

    /// Whether `requests` of this router's fit in the places the replica reports (any number
    /// before its first report).
    fn holds(&self, requests: u32) -> bool {
        let capacity = self.capacity();
        capacity == 0 || requests <= capacity
    }

    /// Prompt tokens waiting there: the larger of the last report and the routers' in
    /// flight, as for [`Replica::load`].
    pub fn queued_tokens(&self) -> u64 {
        let routers = (self.inflight_tokens.load(Ordering::Relaxed))
            .saturating_add(self.peer_inflight_tokens.load(Ordering::Relaxed));
        self.queued_tokens.load(Ordering::Relaxed).max(routers)
    }

    /// Prompt tokens a prompt of `class` waits for there: those of its class and above (the
    /// lower classes yield to it between their chunks), the larger of the last report's and
    /// the routers' in flight, as for [`Replica::queued_tokens`]. The peers' tokens count
    /// whatever their class (their answers do not say), and so does the whole report of a
    /// worker that does not report by class.
    pub fn queued_tokens_ahead(&self, class: Class) -> u64 {
        let ahead = |t: &[AtomicU64; Class::COUNT]| -> u64 {
            (t.iter().take(class.slot() + 1))
                .map(|t| t.load(Ordering::Relaxed))
                .sum()
        };
        let by_class = (self.queued_class_tokens.iter()).any(|t| t.load(Ordering::Relaxed) > 0);
        let reported = if by_class {
            ahead(&self.queued_class_tokens)
        } else {
            self.queued_tokens.load(Ordering::Relaxed)
        };
        let routers = ahead(&self.inflight_class_tokens)
            .saturating_add(self.peer_inflight_tokens.load(Ordering::Relaxed));
        reported.max(routers)
    }

    /// Whether prompts of a class lower than `class` are queued or computing there, by the last
    /// report or the routers' in flight: one of them may be in the middle of a step that a
    /// prompt of `class` waits for.
    pub fn lower_class_busy(&self, class: Class) -> bool {
        let lower = |t: &[AtomicU64; Class::COUNT]| {
            (t.iter().skip(class.slot() + 1)).any(|t| t.load(Ordering::Relaxed) > 0)
        };
        lower(&self.queued_class_tokens) || lower(&self.inflight_class_tokens)
    }

    /// How old its last load report is; `None` before the first.
    pub fn report_age(&self) -> Option<Duration> {
        let at = *self.reported_at.lock().unwrap_or_else(|e| e.into_inner());
        at.map(|at| at.elapsed())
    }

    /// Measured prompt tokens per second; 0 until measured.
    pub fn prefill_rate(&self) -> f64 {
        f64::from_bits(self.prefill_tokens_per_second.load(Ordering::Relaxed))
    }

    /// Measured tokens per second its disk tier reads back, or `fallback` while nothing has
    /// been measured.
    pub fn restore_rate_or(&self, fallback: f64) -> f64 {
        measured_or(&self.restore_tokens_per_second, fallback)
    }

    /// [`Replica::prefill_rate`], or `fallback` while nothing has been measured.
    pub fn prefill_rate_or(&self, fallback: f64) -> f64 {
        measured_or(&self.prefill_tokens_per_second, fallback)
    }

    /// Whether peers may fetch KV from its cache: it is up, or draining (its cache is
    /// still served while it hands off).
    pub fn can_serve_fetch(&self) -> bool {
        (self.healthy.load(Ordering::Relaxed) || self.draining.load(Ordering::Relaxed))
            && self.compatible.load(Ordering::Relaxed)
    }

    /// Whether it reported NOT_SERVING and still answers.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// Wire bytes of one token's KV; 0 until known.
    pub fn kv_bytes_per_token(&self) -> u64 {
        self.kv_bytes_per_token.load(Ordering::Relaxed)
    }

    /// Sets the health flag directly, for [`crate::simulation`] (the monitor follows Watch).
    pub(crate) fn set_healthy(&self, up: bool) {
        self.healthy.store(up, Ordering::Relaxed);
    }

    /// Marks the replica draining (NOT_SERVING, still answering) with KV of
    /// `kv_bytes_per_token`, as its monitor would.
    #[cfg(test)]
    pub(crate) fn set_draining(&self, kv_bytes_per_token: u64) {
        self.healthy.store(false, Ordering::Relaxed);
        self.draining.store(true, Ordering::Relaxed);
        self.kv_bytes_per_token
            .store(kv_bytes_per_token, Ordering::Relaxed);
    }

    /// Counts a request of `tokens` prompt tokens of priority class `class` against this
    /// replica while the guard lives.
    pub fn claim(self: &Arc<Self>, tokens: u64, class: Class) -> InflightGuard {
        let class = class.slot();
        self.inflight.fetch_add(1, Ordering::Relaxed);
        self.inflight_tokens.fetch_add(tokens, Ordering::Relaxed);
        self.inflight_class_tokens[class].fetch_add(tokens, Ordering::Relaxed);
        InflightGuard {
            replica: self.clone(),
            tokens,
            class,
            reports_at_claim: self.reports.load(Ordering::Relaxed),
        }
    }

    /// Records a load report: requests active or queued, and the capacity. Returns whether
    /// either changed.
    pub(crate) fn record_load(&self, requests: u32, capacity: u32) -> bool {
        let was = (
            self.reported.swap(requests, Ordering::Relaxed),
            self.capacity.swap(capacity, Ordering::Relaxed),
        );
        self.reports.fetch_add(1, Ordering::Relaxed);
        *self.reported_at.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(tokio::time::Instant::now());
        was != (requests, capacity)
    }
}

/// Counts a request against a replica while it lives.
#[derive(Debug)]
pub struct InflightGuard {
    replica: Arc<Replica>,
    tokens: u64,
    class: usize,
    /// The replica's report count when the request was claimed: a report received since then
    /// counted the request.
    reports_at_claim: u64,
}

impl InflightGuard {
    pub fn replica(&self) -> &Arc<Replica> {
        &self.replica
    }

    /// Whether the replica had room for this request ([`Replica::has_room`] before it was
    /// counted).
    pub fn fits(&self) -> bool {
        self.replica
            .holds(self.replica.inflight.load(Ordering::Relaxed))
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.replica.inflight.fetch_sub(1, Ordering::Relaxed);
        self.replica
            .inflight_tokens
            .fetch_sub(self.tokens, Ordering::Relaxed);
        self.replica.inflight_class_tokens[self.class].fetch_sub(self.tokens, Ordering::Relaxed);
        if self.replica.reports.load(Ordering::Relaxed) != self.reports_at_claim {
            let _ = self
                .replica
                .reported
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| {
                    Some(r.saturating_sub(1))
                });
        }
        self.replica.changed.notify_waiters();
    }
}
