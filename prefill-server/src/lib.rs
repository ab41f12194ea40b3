//! The prefill node: hosts `Prefill` (compute a prompt's KV, push it to the decode node chosen
//! by the router while computing, sample the first token) and `Worker` (info, load, cache
//! events), with health, reflection and `/metrics` on the same port. Compute runs on its own
//! thread, one request at a time, with a prefix cache of the prompts it has seen.

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

use crate::compute::Shared;
use crate::metrics::PrefillMetrics;
use crate::service::{PrefillLoad, PrefillService};

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
    let kv_layout = engine.kv_layout();
    let prefix_cache = engine.prefix_cache_enabled();
    let mut registry = Registry::default();
    let shared = Arc::new(Shared {
        metrics: PrefillMetrics::register(&mut registry),
        hub: Arc::default(),
        throughput: Default::default(),
    });
    let (jobs, queue) = mpsc::channel(config.max_queue);
    let thread = compute::spawn(engine, queue, shared.clone()).map_err(|e| {
        Error::Engine(tandem_engine::Error::InvalidArgument {
            field: "threads",
            reason: format!("cannot start the compute thread: {e}"),
        })
    })?;
    let root = CancellationToken::new();
    let prefill = PrefillService {
        model: config.model.clone(),
        kv_layout: tandem_worker::wire_layout(kv_layout),
        jobs,
        shared: shared.clone(),
        shutdown: root.child_token(),
        chunk_tokens,
        keepalive: config.keepalive,
        prefix_cache,
        tls: config.tls.clone(),
    };
    let worker = tandem_worker::WorkerService::new(
        tandem_worker::worker_info(&config.model, kv_layout, "prefill"),
        Arc::new(PrefillLoad {
            shared: shared.clone(),
            max_queue: config.max_queue,
        }),
        shared.hub.clone(),
        root.child_token(),
    );
    let (health, health_service) = tonic_health::server::health_reporter();
    let routes = Routes::new(health_service)
        .add_service(tandem_proto::limits!(
            pb::prefill_server::PrefillServer::new(prefill)
        ))
        .add_service(worker.into_server());
    tracing::info!(addr = ?listener.local_addr().ok(), model = %config.model.name, "prefill node serving");
    let served = tandem_net::serve(
        listener,
        routes,
        tandem_net::ServeOptions {
            service_names: vec!["tandem.v1.Prefill", "tandem.v1.Worker"],
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
    // The routes (and with them the job sender) are gone now, so the compute thread finishes
    // its queue and exits.
    root.cancel();
    let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    served?;
    Ok(())
}
