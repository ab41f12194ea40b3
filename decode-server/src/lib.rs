//! The decode node: hosts `Decode` (admission, KV wait, token streaming), `KvTransfer` (the
//! receiving end of prefill pushes) and `Worker` (model info, load), with health, reflection and
//! `/metrics` on the same port. The continuous-batching scheduler runs on its own thread.

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
use crate::scheduler::SchedulerHandle;
use crate::service::{DecodeService, WorkerService};

/// What a worker says about its model (`Worker.Info`).
pub fn worker_info(model: &tandem_engine::Model, role: &str) -> pb::InfoResponse {
    pb::InfoResponse {
        model_name: model.name.clone(),
        model_fingerprint: model.fingerprint.0.to_vec().into(),
        context_tokens: model.config.context_len as u32,
        block_tokens: tandem_engine::BLOCK_TOKENS as u32,
        tokenizer_spec_json: serde_json::to_string(&model.tokenizer_spec).unwrap_or_default(),
        role: role.to_string(),
    }
}

/// Serves a decode node on `listener` until `shutdown` completes, then drains.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let engine = Engine::new(config.model.clone(), config.engine.clone())?;
    let total_blocks = engine.kv_blocks_total();
    let mut registry = Registry::default();
    let decode_metrics = DecodeMetrics::register(&mut registry);
    let transfer_metrics = TransferMetrics::register(&mut registry);
    let (scheduler, thread) = SchedulerHandle::spawn(engine, decode_metrics).map_err(|e| {
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
        admission: Admission::new(config.max_slots, total_blocks),
        total_blocks,
        reservations: reservations.clone(),
        scheduler,
        kv_wait: config.kv_wait,
        shutdown: root.child_token(),
        tracker: tracker.clone(),
        next_ticket: Arc::default(),
    };
    let (health, health_service) = tonic_health::server::health_reporter();
    let routes = Routes::new(health_service)
        .add_service(tandem_proto::limits!(pb::decode_server::DecodeServer::new(
            DecodeService { ctx: ctx.clone() }
        )))
        .add_service(tandem_proto::limits!(pb::worker_server::WorkerServer::new(
            WorkerService {
                ctx: ctx.clone(),
                info: worker_info(&config.model, "decode"),
            }
        )))
        .add_service(KvTransferService::new(reservations, transfer_metrics).into_server());
    tracing::info!(addr = ?listener.local_addr().ok(), model = %config.model.name, "decode node serving");
    let served = tandem_proto::net::serve(
        listener,
        routes,
        tandem_proto::net::ServeOptions {
            service_names: vec![
                "tandem.v1.Decode",
                "tandem.v1.KvTransfer",
                "tandem.v1.Worker",
            ],
            health,
            metrics: Arc::new(registry),
            grace: config.grace,
        },
        shutdown,
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
