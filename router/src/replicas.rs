//! The replica set: each prefill and decode node's channel, health (from `grpc.health.v1`
//! Watch) and load (polled `Worker.Load`, plus the requests this router has in flight there),
//! and the least-loaded pick.
//!
//! ```text
//! per replica: monitor task ──Health.Watch──▶ healthy flag
//!                           └─every load_poll: Worker.Load──▶ reported load
//! pick(role) = healthy replica with the least (reported + in flight here)
//! ```
//!
//! The first worker to answer `Worker.Info` gives the router its tokenizer ([`Frontend`]);
//! a worker whose model fingerprint differs is never picked.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
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
    healthy: AtomicBool,
    compatible: AtomicBool,
    reported: AtomicU32,
    capacity: AtomicU32,
    inflight: AtomicU32,
}

impl Replica {
    pub fn is_up(&self) -> bool {
        self.healthy.load(Ordering::Relaxed) && self.compatible.load(Ordering::Relaxed)
    }

    fn load(&self) -> u32 {
        self.reported.load(Ordering::Relaxed) + self.inflight.load(Ordering::Relaxed)
    }
}

/// Counts a request against a replica while it lives.
#[derive(Debug)]
pub struct InflightGuard(Arc<Replica>);

impl InflightGuard {
    pub fn replica(&self) -> &Arc<Replica> {
        &self.0
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::Relaxed);
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
    pub fn new(prefill: &[String], decode: &[String]) -> Result<Self, tonic::transport::Error> {
        let mut all = Vec::new();
        for (role, addrs) in [(Role::Prefill, prefill), (Role::Decode, decode)] {
            for addr in addrs {
                all.push(Arc::new(Replica {
                    addr: addr.clone(),
                    role,
                    channel: tandem_proto::net::channel(addr)?,
                    healthy: AtomicBool::new(false),
                    compatible: AtomicBool::new(true),
                    reported: AtomicU32::new(0),
                    capacity: AtomicU32::new(0),
                    inflight: AtomicU32::new(0),
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

    /// Whether the router can serve: it knows the model and each role has a healthy replica.
    pub fn ready(&self) -> bool {
        self.frontend.get().is_some()
            && [Role::Prefill, Role::Decode]
                .iter()
                .all(|&r| self.all.iter().any(|x| x.role == r && x.is_up()))
    }

    /// The healthy replica of `role` with the least load, counted as in flight until the guard
    /// drops; with the reason it was chosen.
    pub fn pick(&self, role: Role) -> Option<(InflightGuard, String)> {
        let best = self
            .all
            .iter()
            .filter(|r| r.role == role && r.is_up())
            .min_by_key(|r| r.load())?;
        let load = best.load();
        let capacity = best.capacity.load(Ordering::Relaxed);
        best.inflight.fetch_add(1, Ordering::Relaxed);
        Some((
            InflightGuard(best.clone()),
            format!("{} least loaded ({load} of {capacity})", role.name()),
        ))
    }

    /// Starts one monitor task per replica.
    pub fn spawn_monitors(
        self: &Arc<Self>,
        tracker: &TaskTracker,
        cancel: &CancellationToken,
        load_poll: Duration,
    ) {
        for replica in &self.all {
            let (set, replica, cancel) = (self.clone(), replica.clone(), cancel.clone());
            tracker.spawn(async move {
                tokio::select! {
                    () = set.monitor(&replica, load_poll) => {}
                    () = cancel.cancelled() => {}
                }
            });
        }
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
                        }
                        Err(_) => return,
                    }
                }
            }
        }
    }
}
