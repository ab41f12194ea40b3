//! The prefill node: hosts `Prefill` (compute a prompt's KV, push it to the decode node chosen
//! by the router while computing, sample the first token) and `Worker`, with health, reflection
//! and `/metrics` on the same port. Compute runs on its own thread, one request at a time.

mod compute;
mod config;
mod error;
mod metrics;
mod service;

use std::future::Future;
use std::sync::Arc;

use prometheus_client::registry::Registry;
use tandem_engine::Engine;
use tandem_proto::v1 as pb;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;

pub use config::Config;
pub use error::{Error, Result};

use crate::metrics::PrefillMetrics;
use crate::service::{PrefillService, WorkerService};

/// Serves a prefill node on `listener` until `shutdown` completes, then drains.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    if config.max_queue == 0 {
        return Err(Error::InvalidArgument {
            field: "max_queue",
            reason: "must be at least 1".into(),
        });
    }
    let engine = Engine::new(config.model.clone(), config.engine.clone())?;
    let chunk_tokens = engine.prefill_chunk_tokens();
    let mut registry = Registry::default();
    let metrics = PrefillMetrics::register(&mut registry);
    let (jobs, queue) = mpsc::channel(config.max_queue);
    let thread = compute::spawn(engine, queue, metrics.clone()).map_err(|e| {
        Error::Engine(tandem_engine::Error::InvalidArgument {
            field: "threads",
            reason: format!("cannot start the compute thread: {e}"),
        })
    })?;
    let root = CancellationToken::new();
    let prefill = PrefillService {
        model: config.model.clone(),
        jobs,
        metrics: metrics.clone(),
        shutdown: root.child_token(),
        chunk_tokens,
    };
    let info = pb::InfoResponse {
        model_name: config.model.name.clone(),
        model_fingerprint: config.model.fingerprint.0.to_vec().into(),
        context_tokens: config.model.config.context_len as u32,
        block_tokens: tandem_engine::BLOCK_TOKENS as u32,
        tokenizer_spec_json: serde_json::to_string(&config.model.tokenizer_spec)
            .unwrap_or_default(),
        role: "prefill".into(),
    };
    let worker = WorkerService {
        info,
        metrics,
        max_queue: config.max_queue,
    };
    let (health, health_service) = tonic_health::server::health_reporter();
    let routes = Routes::new(health_service)
        .add_service(tandem_proto::limits!(
            pb::prefill_server::PrefillServer::new(prefill)
        ))
        .add_service(tandem_proto::limits!(pb::worker_server::WorkerServer::new(
            worker
        )));
    tracing::info!(addr = ?listener.local_addr().ok(), model = %config.model.name, "prefill node serving");
    let served = tandem_proto::net::serve(
        listener,
        routes,
        tandem_proto::net::ServeOptions {
            service_names: vec!["tandem.v1.Prefill", "tandem.v1.Worker"],
            health,
            metrics: Arc::new(registry),
            grace: config.grace,
        },
        shutdown,
    )
    .await;
    // The routes (and with them the job sender) are gone now, so the compute thread finishes
    // its queue and exits.
    root.cancel();
    let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    served?;
    Ok(())
}
