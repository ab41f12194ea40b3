//! The replica set: each prefill and decode node's channel, health (from `grpc.health.v1`
//! Watch), load (polled `Worker.Load`, plus what this router has in flight there) and cache
//! index (see [`crate::index`]). Which replicas serve a request is [`crate::policy`]'s choice.
//!
//! ```text
//! per replica: monitor task ──Health.Watch──▶ healthy flag
//!                           └─every load_poll: Worker.Load──▶ reported load, index freshness
//!              index task ──CacheEvents / CacheSnapshot──▶ CacheIndex
//! ```
//!
//! The first worker to answer `Worker.Info` gives the router its tokenizer ([`Frontend`]);
//! a worker whose model fingerprint differs is never picked.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tandem_proto::v1 as pb;
use tandem_tokenizer::{Tokenizer, TokenizerSpec};
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::index::CacheIndex;
use crate::metrics::RouterMetrics;

/// What the router knows of the model, from the first worker that answered.
#[derive(Debug)]
pub struct Frontend {
    pub tokenizer: Tokenizer,
    pub context_tokens: usize,
    pub fingerprint: Vec<u8>,
}

impl Frontend {
    fn from_info(info: &pb::InfoResponse) -> Option<Self> {
        let spec: TokenizerSpec = serde_json::from_str(&info.tokenizer_spec_json)
            .map_err(|e| tracing::error!(error = %e, "worker sent an unreadable tokenizer spec"))
            .ok()?;
        let tokenizer = Tokenizer::new(spec)
            .map_err(|e| tracing::error!(error = %e, "worker sent an unusable tokenizer spec"))
            .ok()?;
        Some(Self {
            tokenizer,
            context_tokens: info.context_tokens as usize,
            fingerprint: info.model_fingerprint.to_vec(),
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    pub addr: String,
    pub role: Role,
    pub channel: Channel,
    pub index: CacheIndex,
    healthy: AtomicBool,
    compatible: AtomicBool,
    /// Requests active or queued there, as last reported.
    reported: AtomicU32,
    capacity: AtomicU32,
    /// Prompt tokens queued there (prefill), as last reported.
    queued_tokens: AtomicU64,
    /// Measured prompt throughput (f64 bits), as last reported; 0 until measured.
    prefill_tokens_per_second: AtomicU64,
    /// Requests and prompt tokens this router has sent there and not yet seen finish.
    inflight: AtomicU32,
    inflight_tokens: AtomicU64,
}

impl Replica {
    pub fn is_up(&self) -> bool {
        self.healthy.load(Ordering::Relaxed) && self.compatible.load(Ordering::Relaxed)
    }

    /// Requests there: the larger of the last report (which counts other routers' requests
    /// too, but lags) and this router's own in flight (current, but only its own).
    pub fn load(&self) -> u32 {
        self.reported
            .load(Ordering::Relaxed)
            .max(self.inflight.load(Ordering::Relaxed))
    }

    pub fn capacity(&self) -> u32 {
        self.capacity.load(Ordering::Relaxed)
    }

    /// Prompt tokens waiting there: the larger of the last report and this router's own in
    /// flight, as for [`Replica::load`].
    pub fn queued_tokens(&self) -> u64 {
        self.queued_tokens
            .load(Ordering::Relaxed)
            .max(self.inflight_tokens.load(Ordering::Relaxed))
    }

    /// Measured prompt tokens per second; 0 until measured.
    pub fn prefill_rate(&self) -> f64 {
        f64::from_bits(self.prefill_tokens_per_second.load(Ordering::Relaxed))
    }

    /// Sets the health flag directly, for [`crate::simulation`] (the monitor follows Watch).
    pub(crate) fn set_healthy(&self, up: bool) {
        self.healthy.store(up, Ordering::Relaxed);
    }

    /// Counts a request of `tokens` prompt tokens against this replica while the guard lives.
    pub fn claim(self: &Arc<Self>, tokens: u64) -> InflightGuard {
        self.inflight.fetch_add(1, Ordering::Relaxed);
        self.inflight_tokens.fetch_add(tokens, Ordering::Relaxed);
        InflightGuard {
            replica: self.clone(),
            tokens,
        }
    }
}

/// Counts a request against a replica while it lives.
#[derive(Debug)]
pub struct InflightGuard {
    replica: Arc<Replica>,
    tokens: u64,
}

impl InflightGuard {
    pub fn replica(&self) -> &Arc<Replica> {
        &self.replica
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.replica.inflight.fetch_sub(1, Ordering::Relaxed);
        self.replica
            .inflight_tokens
            .fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

#[derive(Debug)]
pub struct Replicas {
    all: Vec<Arc<Replica>>,
    frontend: OnceLock<Arc<Frontend>>,
    /// Woken whenever a replica's health or compatibility or the frontend changes.
    changed: tokio::sync::Notify,
}

impl Replicas {
    pub fn new(
        prefill: &[String],
        decode: &[String],
        index_max_blocks: usize,
    ) -> Result<Self, tonic::transport::Error> {
        let mut all = Vec::new();
        for (role, addrs) in [(Role::Prefill, prefill), (Role::Decode, decode)] {
            for addr in addrs {
                all.push(Arc::new(Replica {
                    addr: addr.clone(),
                    role,
                    channel: tandem_proto::net::channel(addr)?,
                    index: CacheIndex::new(index_max_blocks),
                    healthy: AtomicBool::new(false),
                    compatible: AtomicBool::new(true),
                    reported: AtomicU32::new(0),
                    capacity: AtomicU32::new(0),
                    queued_tokens: AtomicU64::new(0),
                    prefill_tokens_per_second: AtomicU64::new(0),
                    inflight: AtomicU32::new(0),
                    inflight_tokens: AtomicU64::new(0),
                }));
            }
        }
        Ok(Self {
            all,
            frontend: OnceLock::new(),
            changed: tokio::sync::Notify::new(),
        })
    }

    pub fn frontend(&self) -> Option<&Arc<Frontend>> {
        self.frontend.get()
    }

    /// Resolves at the next change of [`Replicas::ready`]'s inputs. Create it before reading
    /// them, so that no change is missed.
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    /// Whether the router can serve: it knows the model and a decode replica is healthy (with
    /// no prefill replica up, decode nodes prefill locally).
    pub fn ready(&self) -> bool {
        self.frontend.get().is_some() && self.up(Role::Decode).next().is_some()
    }

    /// The replicas of `role` that can take requests now.
    pub fn up(&self, role: Role) -> impl Iterator<Item = &Arc<Replica>> {
        self.all.iter().filter(move |r| r.role == role && r.is_up())
    }

    pub fn all(&self) -> &[Arc<Replica>] {
        &self.all
    }

    /// Starts one monitor task and one cache-index task per replica.
    pub fn spawn_monitors(
        self: &Arc<Self>,
        tracker: &TaskTracker,
        cancel: &CancellationToken,
        load_poll: Duration,
        metrics: &RouterMetrics,
    ) {
        for replica in &self.all {
            let (set, r, cancel2) = (self.clone(), replica.clone(), cancel.clone());
            tracker.spawn(async move {
                tokio::select! {
                    () = set.monitor(&r, load_poll) => {}
                    () = cancel2.cancelled() => {}
                }
            });
            let (r, cancel) = (replica.clone(), cancel.clone());
            tracker.spawn(async move {
                tokio::select! {
                    () = r.index.follow(r.channel.clone()) => {}
                    () = cancel.cancelled() => {}
                }
            });
        }
        // The replica and index gauges, refreshed whether or not a replica answers.
        let (set, cancel, metrics) = (self.clone(), cancel.clone(), metrics.clone());
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(load_poll);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = cancel.cancelled() => return,
                }
                for r in &set.all {
                    metrics.replica(&r.addr, r.role.name(), r.is_up(), r.index.freshness());
                }
            }
        });
    }

    async fn monitor(&self, r: &Replica, load_poll: Duration) {
        let mut backoff = Duration::from_millis(50);
        loop {
            if self.check_info(r).await {
                self.watch(r, load_poll).await;
                backoff = Duration::from_millis(50);
            }
            if r.healthy.swap(false, Ordering::Relaxed) {
                self.changed.notify_waiters();
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    /// Asks the worker for its model; learns the tokenizer from the first one.
    async fn check_info(&self, r: &Replica) -> bool {
        let mut client =
            tandem_proto::limits!(pb::worker_client::WorkerClient::new(r.channel.clone()));
        let mut req = tonic::Request::new(pb::InfoRequest {});
        req.set_timeout(Duration::from_secs(5));
        let Ok(info) = client.info(req).await.map(tonic::Response::into_inner) else {
            return false;
        };
        if self.frontend.get().is_none()
            && let Some(f) = Frontend::from_info(&info)
        {
            let _ = self.frontend.set(Arc::new(f));
            self.changed.notify_waiters();
            tracing::info!(model = %info.model_name, from = %r.addr, "learned the model's tokenizer");
        }
        let same = self
            .frontend
            .get()
            .is_some_and(|f| f.fingerprint == info.model_fingerprint.as_ref());
        if !same {
            tracing::error!(replica = %r.addr, model = %info.model_name, "replica serves a different model; not using it");
        }
        if r.compatible.swap(same, Ordering::Relaxed) != same {
            self.changed.notify_waiters();
        }
        same
    }

    /// Follows the replica's health and load until the watch breaks.
    async fn watch(&self, r: &Replica, load_poll: Duration) {
        let mut health = HealthClient::new(r.channel.clone());
        let request = tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        };
        let Ok(stream) = health.watch(request).await else {
            return;
        };
        let mut stream = stream.into_inner();
        let mut worker = pb::worker_client::WorkerClient::new(r.channel.clone());
        let mut tick = tokio::time::interval(load_poll);
        loop {
            tokio::select! {
                msg = stream.next() => match msg {
                    Some(Ok(m)) => {
                        let up = m.status == ServingStatus::Serving as i32;
                        if up != r.healthy.swap(up, Ordering::Relaxed) {
                            tracing::info!(replica = %r.addr, role = r.role.name(), up, "replica health changed");
                            self.changed.notify_waiters();
                        }
                    }
                    _ => return,
                },
                _ = tick.tick() => {
                    let mut req = tonic::Request::new(pb::LoadRequest {});
                    req.set_timeout(load_poll.max(Duration::from_millis(500)));
                    match worker.load(req).await {
                        Ok(load) => {
                            let load = load.into_inner();
                            r.reported.store(load.active + load.queued, Ordering::Relaxed);
                            r.capacity.store(load.capacity, Ordering::Relaxed);
                            r.queued_tokens.store(load.queued_tokens, Ordering::Relaxed);
                            r.prefill_tokens_per_second
                                .store(load.prefill_tokens_per_second.to_bits(), Ordering::Relaxed);
                            r.index.observe_report(load.cache_epoch, load.cache_seq);
                        }
                        Err(_) => return,
                    }
                }
            }
        }
    }
}
