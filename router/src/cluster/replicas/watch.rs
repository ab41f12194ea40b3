//! Following one replica's health and load: the `grpc.health.v1` watch, and the worker's load
//! reports (`Worker.WatchLoad`), one each time the load changes and the same again after a
//! heartbeat ([`LOAD_HEARTBEAT`]) of silence. So an idle fleet costs the router one small message
//! per node per heartbeat, where polling cost two calls per node per poll.
//!
//! A node that reports nothing for a heartbeat, a check interval and [`LIVENESS_TIMEOUT`] more is
//! gone (paused, cut off; it sends its reports off its step loop, however busy it is): the watch
//! ends, which marks it down long before keepalive would. A worker without `WatchLoad` (an older
//! version, in a rolling upgrade) is polled instead: a health check with that deadline, then
//! `Worker.Load`, every `load_poll`.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tandem_proto::v1 as pb;
use tokio::time::Instant;
use tokio_stream::StreamExt;
use tonic::Streaming;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

use super::Replicas;
use crate::cluster::replica::{LIVENESS_TIMEOUT, Replica};

/// The longest a worker stays silent while its load does not change.
pub const LOAD_HEARTBEAT: Duration = Duration::from_secs(1);

fn millis(d: Duration) -> u32 {
    u32::try_from(d.as_millis()).unwrap_or(u32::MAX)
}

impl Replicas {
    /// Follows the replica's health and load until the watch breaks or the replica stops
    /// reporting.
    pub(super) async fn watch(&self, r: &Arc<Replica>, load_poll: Duration) {
        let mut health = HealthClient::new(r.channel.clone());
        let Ok(states) = health.watch(HealthCheckRequest::default()).await else {
            return;
        };
        let states = states.into_inner();
        let mut worker = pb::worker_client::WorkerClient::new(r.channel.clone());
        let heartbeat = LOAD_HEARTBEAT.max(load_poll);
        let ask = pb::WatchLoadRequest {
            interval_ms: millis(load_poll),
            heartbeat_ms: millis(heartbeat),
        };
        match worker.watch_load(ask).await {
            Ok(loads) => {
                let silence = heartbeat + load_poll + LIVENESS_TIMEOUT;
                self.follow(r, states, loads.into_inner(), silence).await;
            }
            Err(e) if e.code() == tonic::Code::Unimplemented => {
                self.poll(r, states, health, worker, load_poll).await;
            }
            Err(_) => {}
        }
    }

    /// Takes the load reports as they come; ends when either stream does, or after `silence`
    /// without a report.
    async fn follow(
        &self,
        r: &Arc<Replica>,
        mut states: Streaming<HealthCheckResponse>,
        mut loads: Streaming<pb::LoadResponse>,
        silence: Duration,
    ) {
        let mut deadline = Instant::now() + silence;
        loop {
            tokio::select! {
                msg = states.next() => match msg {
                    Some(Ok(m)) => self.health_changed(r, &m),
                    _ => return,
                },
                load = loads.next() => match load {
                    Some(Ok(load)) => {
                        self.record(r, &load);
                        deadline = Instant::now() + silence;
                    }
                    _ => return,
                },
                () = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(replica = %r.addr, role = r.role.name(), "replica stopped reporting its load");
                    return;
                }
            }
        }
    }

    /// Polls a worker that cannot stream its load: a health check with a [`LIVENESS_TIMEOUT`]
    /// deadline, then `Worker.Load`, every `load_poll`. The load may come late from a busy node;
    /// that ends nothing.
    async fn poll(
        &self,
        r: &Arc<Replica>,
        mut states: Streaming<HealthCheckResponse>,
        mut health: HealthClient<Channel>,
        mut worker: pb::worker_client::WorkerClient<Channel>,
        load_poll: Duration,
    ) {
        let mut tick = tokio::time::interval(load_poll);
        loop {
            tokio::select! {
                msg = states.next() => match msg {
                    Some(Ok(m)) => self.health_changed(r, &m),
                    _ => return,
                },
                _ = tick.tick() => {
                    let mut probe = tonic::Request::new(HealthCheckRequest::default());
                    probe.set_timeout(LIVENESS_TIMEOUT);
                    let answered = tokio::time::timeout(LIVENESS_TIMEOUT, health.check(probe)).await;
                    if !matches!(answered, Ok(Ok(_))) {
                        tracing::warn!(replica = %r.addr, role = r.role.name(), "replica stopped answering health checks");
                        return;
                    }
                    let mut req = tonic::Request::new(pb::LoadRequest {});
                    req.set_timeout(load_poll.max(Duration::from_millis(500)));
                    match worker.load(req).await {
                        Ok(load) => self.record(r, &load.into_inner()),
                        // A busy node answers late: that is no sign it is gone (the health
                        // watch and keepalive tell), so the next poll asks again.
                        Err(e) if matches!(e.code(), tonic::Code::DeadlineExceeded | tonic::Code::Cancelled) => {
                            tracing::debug!(replica = %r.addr, error = %e, "load poll answered late");
                        }
                        // Anything else (a closed connection, another node behind the address)
                        // ends the watch, and the monitor asks the node who it is again.
                        Err(_) => return,
                    }
                }
            }
        }
    }

    /// Takes a health watch's message: up, draining (NOT_SERVING: its cached sessions move
    /// to its peers), or down.
    fn health_changed(&self, r: &Arc<Replica>, m: &HealthCheckResponse) {
        let up = m.status == ServingStatus::Serving as i32;
        let draining = m.status == ServingStatus::NotServing as i32;
        let was = r.draining.swap(draining, Ordering::Relaxed);
        if draining && !was {
            self.move_sessions(r);
        }
        if up != r.healthy.swap(up, Ordering::Relaxed) {
            tracing::info!(replica = %r.addr, role = r.role.name(), up, "replica health changed");
            self.changed.notify_waiters();
        }
    }

    /// Takes a load report.
    fn record(&self, r: &Replica, load: &pb::LoadResponse) {
        if r.record_load(load.active + load.queued, load.capacity) {
            self.changed.notify_waiters();
        }
        r.queued_tokens.store(load.queued_tokens, Ordering::Relaxed);
        for (i, slot) in r.queued_class_tokens.iter().enumerate() {
            let t = load.queued_class_tokens.get(i).copied().unwrap_or(0);
            slot.store(t, Ordering::Relaxed);
        }
        r.prefill_tokens_per_second
            .store(load.prefill_tokens_per_second.to_bits(), Ordering::Relaxed);
        r.restore_tokens_per_second
            .store(load.restore_tokens_per_second.to_bits(), Ordering::Relaxed);
        r.index.observe_report(load.cache_epoch, load.cache_seq);
    }
}
