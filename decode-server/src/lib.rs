//! The decode node: hosts `Decode` (admission, KV wait or local prefill, token streaming),
//! `KvTransfer` (the receiving end of prefill pushes) and `Worker` (model info, load, cache
//! events), with health, reflection and `/metrics` on the same port. The continuous-batching
//! scheduler runs on its own thread and keeps finished sequences' KV in a session cache.

mod admission;
mod config;
mod error;
mod metrics;
mod request;
mod scheduler;
mod service;

use std::future::Future;
use std::sync::Arc;

use prometheus_client::registry::Registry;
use tandem_engine::Engine;
use tandem_proto::v1 as pb;
use tandem_transfer::{KvTransferService, Reservations, TransferMetrics};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::service::Routes;

pub use config::Config;
pub use error::{Error, Result};

use crate::admission::Admission;
use crate::metrics::DecodeMetrics;
use crate::request::RequestContext;
use crate::scheduler::{SchedulerHandle, Shared};
use crate::service::{DecodeLoad, DecodeService};

/// Serves a decode node on `listener` until `shutdown` completes, then drains.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    if config.max_slots == 0 {
        return Err(Error::InvalidArgument {
            field: "max_slots",
            reason: "must be at least 1".into(),
        });
    }
    let engine = Engine::new(config.model.clone(), config.engine.clone())?;
    let total_blocks = engine.kv_blocks_total();
    let kv_layout = engine.kv_layout();
    let prefix_cache = engine.prefix_cache_enabled();
    let mut registry = Registry::default();
    let shared = Arc::new(Shared {
        metrics: DecodeMetrics::register(&mut registry),
        hub: Arc::default(),
        throughput: Default::default(),
    });
    let transfer_metrics = TransferMetrics::register(&mut registry);
    let (scheduler, thread) = SchedulerHandle::spawn(engine, shared.clone(), config.max_slots)
        .map_err(|e| {
            Error::Engine(tandem_engine::Error::InvalidArgument {
                field: "threads",
                reason: format!("cannot start the scheduler thread: {e}"),
            })
        })?;
    let reservations = Reservations::default();
    let root = CancellationToken::new();
    let tracker = TaskTracker::new();
    let ctx = RequestContext {
        model: config.model.clone(),
        kv_layout,
        admission: Admission::new(config.max_slots, total_blocks),
        total_blocks,
        reservations: reservations.clone(),
        scheduler,
        shared: shared.clone(),
        prefix_cache,
        kv_wait: config.kv_wait,
        max_kv_wait: config.max_kv_wait,
        shutdown: root.child_token(),
        tracker: tracker.clone(),
        next_ticket: Arc::default(),
    };
    let (health, health_service) = tonic_health::server::health_reporter();
    let routes = Routes::new(health_service)
        .add_service(tandem_proto::limits!(pb::decode_server::DecodeServer::new(
            DecodeService { ctx: ctx.clone() }
        )))
        .add_service(
            tandem_worker::WorkerService::new(
                tandem_worker::worker_info(&config.model, kv_layout, "decode"),
                Arc::new(DecodeLoad { ctx: ctx.clone() }),
                shared.hub.clone(),
                root.child_token(),
            )
            .into_server(),
        )
        .add_service(KvTransferService::new(reservations, transfer_metrics).into_server());
    tracing::info!(addr = ?listener.local_addr().ok(), model = %config.model.name, "decode node serving");
    let served = tandem_net::serve(
        listener,
        routes,
        tandem_net::ServeOptions {
            service_names: vec![
                "tandem.v1.Decode",
                "tandem.v1.KvTransfer",
                "tandem.v1.Worker",
            ],
            health,
            metrics: Arc::new(registry),
            grace: config.grace,
            tls: config.tls.clone().map(tandem_net::ServerTls::Mutual),
        },
        async {
            shutdown.await;
            // Begin ending streams (cache events) so that they do not hold up the drain.
            root.cancel();
        },
    )
    .await;
    // Streams still running after the grace period end with UNAVAILABLE; then the scheduler's
    // last handle goes and its thread exits.
    root.cancel();
    tracker.close();
    tracker.wait().await;
    drop(ctx);
    let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    served?;
    Ok(())
}
