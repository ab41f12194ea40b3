//! The replica set: each prefill and decode node's channel, health (from `grpc.health.v1`
//! Watch), load (polled `Worker.Load`, plus what this router has in flight there) and cache
//! index (see [`crate::cluster::index`]). Which replicas serve a request is [`crate::cluster::policy`]'s choice.
//!
//! ```text
//! per replica: monitor task ──Health.Watch──▶ healthy flag
//!                           └─Worker.WatchLoad──▶ reported load, index freshness
//!              index task ──CacheEvents / CacheSnapshot──▶ CacheIndex
//! ```
//!
//! Each worker serves one model, which it names in `Worker.Info`. The first worker to name a
//! model gives the router that model's tokenizer and KV dtype ([`Frontend`]); a later worker
//! naming the same model with other weights (fingerprint) or another KV dtype is never picked
//! (its KV could not move between prefill and decode). A request runs only on its model's
//! replicas ([`Replicas::up`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use tandem_proto::v1 as pb;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cluster::frontend::{Frontend, kv_dtype};
use crate::cluster::index::{CacheIndex, RECONNECT_MAX};
use crate::cluster::replica::{Replica, Role, mean_prefill_rate};
use crate::cluster::scaling::{RoleLoad, Smoothed, decode_need, prefill_need};
use crate::metrics::RouterMetrics;

mod watch;

/// How the set monitors the replicas it holds (absent in [`crate::simulation`]).
#[derive(Debug)]
struct Monitoring {
    tracker: TaskTracker,
    load_poll: Duration,
    metrics: RouterMetrics,
}

#[derive(Debug)]
pub struct Replicas {
    all: RwLock<Vec<Arc<Replica>>>,
    index_max_blocks: usize,
    /// The parent of every replica's stop token: cancelling it ends all their tasks.
    cancel: CancellationToken,
    monitoring: OnceLock<Monitoring>,
    /// Every model a worker has named, by name, as the first to name it described it.
    models: RwLock<BTreeMap<String, Arc<Frontend>>>,
    /// The smoothed need of each model's roles ([`crate::cluster::scaling`]).
    scaling: std::sync::Mutex<HashMap<(String, Role), Smoothed>>,
    /// Mutual TLS to the workers, as the router.
    tls: Option<tandem_net::tls::Tls>,
    /// Woken whenever a replica's health, compatibility or room, the set, or the frontend
    /// changes.
    changed: Arc<tokio::sync::Notify>,
}

impl Replicas {
    /// An empty set; [`Replicas::add`] fills it. Cancelling `cancel` stops every replica's
    /// tasks.
    pub fn new(index_max_blocks: usize, cancel: CancellationToken) -> Self {
        Self::with_tls(index_max_blocks, cancel, None)
    }

    /// [`Replicas::new`], reaching the replicas over mutual TLS when `tls` is given.
    pub fn with_tls(
        index_max_blocks: usize,
        cancel: CancellationToken,
        tls: Option<tandem_net::tls::Tls>,
    ) -> Self {
        Self {
            all: RwLock::default(),
            index_max_blocks,
            cancel,
            monitoring: OnceLock::new(),
            models: RwLock::default(),
            scaling: std::sync::Mutex::default(),
            tls,
            changed: Arc::default(),
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Arc<Replica>>> {
        // Writers only push or remove whole entries; a poisoned lock is still consistent.
        self.all.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Vec<Arc<Replica>>> {
        self.all.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a replica at `addr` (found from `target`), unless one is there already, and
    /// starts monitoring it once [`Replicas::start_monitoring`] has been called.
    pub fn add(
        self: &Arc<Self>,
        role: Role,
        addr: &str,
        target: &str,
    ) -> Result<(), tonic::transport::Error> {
        let mut all = self.write();
        if all.iter().any(|r| r.addr == addr && r.role == role) {
            return Ok(());
        }
        let monitoring = self.monitoring.get();
        let replica = Arc::new(Replica {
            addr: addr.to_string(),
            target: target.to_string(),
            role,
            channel: tandem_net::channel(
                addr,
                self.tls.as_ref().map(tandem_net::tls::Tls::client_config),
            )?,
            index: CacheIndex::new(self.index_max_blocks),
            healthy: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            compatible: AtomicBool::new(true),
            model: RwLock::new(Arc::from("")),
            kv_bytes_per_token: AtomicU64::new(0),
            reported: AtomicU32::new(0),
            reports: AtomicU64::new(0),
            capacity: AtomicU32::new(0),
            queued_tokens: AtomicU64::new(0),
            queued_class_tokens: Default::default(),
            reported_at: std::sync::Mutex::new(None),
            prefill_tokens_per_second: AtomicU64::new(0),
            restore_tokens_per_second: AtomicU64::new(0),
            inflight: AtomicU32::new(0),
            inflight_tokens: AtomicU64::new(0),
            inflight_class_tokens: Default::default(),
            peer_inflight: AtomicU32::new(0),
            peer_inflight_tokens: AtomicU64::new(0),
            stop: self.cancel.child_token(),
            changed: self.changed.clone(),
        });
        all.push(replica.clone());
        drop(all);
        tracing::info!(replica = %addr, role = role.name(), target, "replica added");
        if let Some(m) = monitoring {
            self.spawn_tasks(m, &replica);
        }
        self.changed.notify_waiters();
        Ok(())
    }

    /// Removes the replica at `addr` and stops its tasks. Requests already sent there finish
    /// or fail over as usual.
    pub fn remove(&self, role: Role, addr: &str) {
        let mut all = self.write();
        let Some(i) = all.iter().position(|r| r.addr == addr && r.role == role) else {
            return;
        };
        let replica = all.remove(i);
        drop(all);
        replica.stop.cancel();
        if let Some(m) = self.monitoring.get() {
            crate::cluster::index::forget_gauges(&m.metrics, &replica.addr, role.name());
        }
        tracing::info!(replica = %addr, role = role.name(), "replica removed");
        self.changed.notify_waiters();
    }

    /// The models served now: each one a replica in the set serves (up or not), by name.
    pub fn models(&self) -> Vec<Arc<Frontend>> {
        let all = self.read();
        let known = self.models.read().unwrap_or_else(|e| e.into_inner());
        known
            .values()
            .filter(|f| all.iter().any(|r| r.serves(&f.model_name)))
            .cloned()
            .collect()
    }

    /// The model named `name`, if a worker described it.
    fn known(&self, name: &str) -> Option<Arc<Frontend>> {
        let models = self.models.read().unwrap_or_else(|e| e.into_inner());
        models.get(name).cloned()
    }

    /// The model named `name`, as the first worker to name it described it; a worker naming it
    /// for the first time describes it now.
    fn learn(&self, info: &pb::InfoResponse, from: &str) -> Option<Arc<Frontend>> {
        if let Some(f) = self.known(&info.model_name) {
            return Some(f);
        }
        let front = Arc::new(Frontend::from_info(info)?);
        let mut models = self.models.write().unwrap_or_else(|e| e.into_inner());
        let front = models
            .entry(info.model_name.clone())
            .or_insert_with(|| {
                tracing::info!(model = %info.model_name, kv_dtype = kv_dtype(info), from, "learned a model's tokenizer and KV dtype");
                front
            })
            .clone();
        Some(front)
    }

    /// Resolves at the next change of [`Replicas::ready`]'s inputs or of a replica's room
    /// ([`Replica::has_room`]). Create it before reading them, so that no change is missed.
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    /// Resolves at the next change ([`Replicas::changed`]), or after one load poll's interval
    /// at most: what a worker refused may have been freed before the wait began, its report's
    /// change then already past.
    pub async fn changed_or_polled(&self) {
        let _ = tokio::time::timeout(self.load_poll(), self.changed()).await;
    }

    /// How old a replica's load report may be before the figures it gave are stale: four
    /// polls missed, and two seconds at least.
    pub fn stale_after(&self) -> Duration {
        (self.load_poll() * 4).max(Duration::from_secs(2))
    }

    /// The load poll's interval (the default's in [`crate::simulation`], which polls nothing).
    fn load_poll(&self) -> Duration {
        self.monitoring
            .get()
            .map_or(crate::config::DEFAULT_LOAD_POLL, |m| m.load_poll)
    }

    /// Whether the router can serve: a decode replica is up (with no prefill replica up, decode
    /// nodes prefill locally). A replica is up only once it has named a model the router knows.
    pub fn ready(&self) -> bool {
        self.read()
            .iter()
            .any(|r| r.role == Role::Decode && r.is_up())
    }

    /// The replicas of `role` serving `model` that can take requests now.
    pub fn up(&self, role: Role, model: &str) -> Vec<Arc<Replica>> {
        self.read()
            .iter()
            .filter(|r| r.role == role && r.is_up() && r.serves(model))
            .cloned()
            .collect()
    }

    /// Every replica in the set, up or not.
    pub fn all(&self) -> Vec<Arc<Replica>> {
        self.read().clone()
    }

    /// Monitors every replica in the set, and each one added later: one task following its
    /// health and load, one following its cache events. Also keeps the replica gauges.
    pub fn start_monitoring(
        self: &Arc<Self>,
        tracker: &TaskTracker,
        load_poll: Duration,
        metrics: &RouterMetrics,
    ) {
        let m = Monitoring {
            tracker: tracker.clone(),
            load_poll,
            metrics: metrics.clone(),
        };
        if self.monitoring.set(m).is_err() {
            return;
        }
        let Some(m) = self.monitoring.get() else {
            return;
        };
        for replica in self.all() {
            self.spawn_tasks(m, &replica);
        }
        // The replica and index gauges, refreshed whether or not a replica answers.
        let (set, cancel, metrics) = (self.clone(), self.cancel.clone(), metrics.clone());
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(load_poll);
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = cancel.cancelled() => return,
                }
                for r in set.all() {
                    r.index
                        .freshness()
                        .report(&metrics, &r.addr, r.role.name(), r.is_up());
                }
                set.report_models(&metrics);
            }
        });
    }

    /// Sets the replicas-up and desired-replicas gauges of every model served and role; a model
    /// no longer served loses its series.
    fn report_models(&self, metrics: &RouterMetrics) {
        let mut scaling = self.scaling.lock().unwrap_or_else(|e| e.into_inner());
        let models = self.models();
        scaling.retain(|(model, role), _| {
            let served = models.iter().any(|f| f.model_name == *model);
            if !served {
                let label = crate::metrics::ModelRoleLabel {
                    model: model.clone(),
                    role: role.name(),
                };
                metrics.model_replicas.remove(&label);
                metrics.desired_replicas.remove(&label);
            }
            served
        });
        for front in models {
            for role in [Role::Prefill, Role::Decode] {
                let up = self.up(role, &front.model_name);
                let load = role_load(&up);
                let need = match role {
                    Role::Prefill => prefill_need(&load),
                    Role::Decode => decode_need(&load),
                };
                let key = (front.model_name.clone(), role);
                let desired = scaling.entry(key).or_default().desired(need, up.len());
                let label = crate::metrics::ModelRoleLabel {
                    model: front.model_name.clone(),
                    role: role.name(),
                };
                metrics
                    .model_replicas
                    .get_or_create(&label)
                    .set(up.len() as i64);
                metrics
                    .desired_replicas
                    .get_or_create(&label)
                    .set(desired as i64);
            }
        }
    }

    fn spawn_tasks(self: &Arc<Self>, m: &Monitoring, replica: &Arc<Replica>) {
        let (set, r, load_poll) = (self.clone(), replica.clone(), m.load_poll);
        m.tracker.spawn(async move {
            tokio::select! {
                () = set.monitor(&r, load_poll) => {}
                () = r.stop.cancelled() => {}
            }
        });
        let r = replica.clone();
        m.tracker.spawn(async move {
            tokio::select! {
                () = r.index.follow(r.channel.clone()) => {}
                () = r.stop.cancelled() => {}
            }
        });
    }

    /// Follows the replica for as long as it lives in the set, asking a gone one again at
    /// growing intervals up to [`RECONNECT_MAX`].
    async fn monitor(&self, r: &Arc<Replica>, load_poll: Duration) {
        let mut backoff = Duration::from_millis(50);
        loop {
            if self.check_info(r).await {
                self.watch(r, load_poll).await;
                backoff = Duration::from_millis(50);
            }
            r.draining.store(false, Ordering::Relaxed);
            if r.healthy.swap(false, Ordering::Relaxed) {
                self.changed.notify_waiters();
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(RECONNECT_MAX);
        }
    }

    /// A replica began to drain: its cached sequences go to the up replicas of its role.
    fn move_sessions(&self, r: &Arc<Replica>) {
        let Some(m) = self.monitoring.get() else {
            return;
        };
        let peers = self.up(r.role, &r.model());
        let task = crate::cluster::migrate::move_sessions(r.clone(), peers, m.metrics.clone());
        let stop = r.stop.clone();
        m.tracker.spawn(async move {
            tokio::select! {
                () = task => {}
                () = stop.cancelled() => {}
            }
        });
    }

    /// Asks the worker for its model; learns the model's tokenizer from the first worker that
    /// names it (the others are asked to leave it out: it is megabytes).
    async fn check_info(&self, r: &Replica) -> bool {
        let mut client =
            tandem_proto::limits!(pb::worker_client::WorkerClient::new(r.channel.clone()));
        let ask = |omit_tokenizer: bool| {
            let mut req = tonic::Request::new(pb::InfoRequest { omit_tokenizer });
            req.set_timeout(Duration::from_secs(5));
            req
        };
        let Ok(mut info) = client
            .info(ask(true))
            .await
            .map(tonic::Response::into_inner)
        else {
            return false;
        };
        if self.known(&info.model_name).is_none() {
            let Ok(whole) = client
                .info(ask(false))
                .await
                .map(tonic::Response::into_inner)
            else {
                return false;
            };
            info = whole;
        }
        let Some(front) = self.learn(&info, &r.addr) else {
            return false;
        };
        let same_model = front.fingerprint == info.model_fingerprint.as_ref();
        let same_kv = front.kv_dtype == kv_dtype(&info);
        if !same_model {
            tracing::error!(replica = %r.addr, model = %info.model_name, "replica serves other weights under a model's name; not using it");
        } else if !same_kv {
            tracing::error!(
                replica = %r.addr,
                kv_dtype = kv_dtype(&info),
                cluster = %front.kv_dtype,
                "replica keeps its KV in another dtype (--kv-dtype); not using it"
            );
        }
        let same = same_model && same_kv;
        r.kv_bytes_per_token
            .store(info.kv_bytes_per_token, Ordering::Relaxed);
        let model = if same { info.model_name.as_str() } else { "" };
        let was = r.model();
        r.set_model(model);
        if r.compatible.swap(same, Ordering::Relaxed) != same || *was != *model {
            self.changed.notify_waiters();
        }
        same
    }
}

/// What the replicas `up` (one model's, one role's) report now.
fn role_load(up: &[Arc<Replica>]) -> RoleLoad {
    RoleLoad {
        up: up.len(),
        requests: up.iter().map(|r| u64::from(r.load())).sum(),
        capacity: up
            .iter()
            .map(|r| u64::from(r.capacity()))
            .max()
            .unwrap_or(0),
        busy: up.iter().filter(|r| r.load() > 0).count() as u64,
        queued_tokens: up.iter().map(|r| r.queued_tokens()).sum(),
        rate: mean_prefill_rate(up).unwrap_or(0.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_finished_request_leaves_the_report_that_counted_it() {
        let replicas = Arc::new(Replicas::new(16, CancellationToken::new()));
        replicas
            .add(Role::Decode, "127.0.0.1:1", "127.0.0.1:1")
            .expect("add");
        let r = replicas.all().remove(0);
        let counted = r.claim(10, tandem_proto::policy::Class::Standard);
        // A report taken while the request ran counts it (and one of another router's).
        assert!(r.record_load(2, 8));
        let uncounted = r.claim(10, tandem_proto::policy::Class::Standard);
        assert_eq!(r.load(), 2);
        drop(counted);
        assert_eq!(
            r.load(),
            1,
            "the finished request is no longer in the report"
        );
        drop(uncounted);
        assert_eq!(
            r.load(),
            1,
            "a request claimed after the report was never in it"
        );
        assert!(!r.record_load(1, 8), "the next report agrees");
    }
}
