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

use tandem_proto::v1 as pb;
use tandem_worker::{Node, NodeError};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

pub use config::{Config, DEFAULT_MAX_QUEUE, DEFAULT_PREFIX_CACHE_BYTES};
pub use error::{Error, Result};

use crate::compute::Shared;
use crate::metrics::PrefillMetrics;
use crate::service::{PrefillLoad, PrefillService};

/// Serves a prefill node on `listener` until `shutdown` completes, then drains.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<(), NodeError> {
    config.validate()?;
    let Config {
        node,
        max_queue,
        keepalive,
    } = config;
    let mut node = Node::new("prefill", node);
    let engine = node.engine()?;
    let chunk_tokens = engine.prefill_chunk_tokens();
    let kv_layout = engine.kv_layout();
    let prefix_cache = engine.prefix_cache_enabled();
    let shared = Arc::new(Shared {
        metrics: PrefillMetrics::register(&mut node.registry),
        hub: node.hub.clone(),
        throughput: Default::default(),
    });
    let (jobs, queue) = mpsc::channel(max_queue);
    let thread =
        compute::spawn(engine, queue, shared.clone()).map_err(NodeError::spawn("compute"))?;
    let prefill = PrefillService {
        model: node.config.model.clone(),
        kv_layout: tandem_worker::wire_layout(kv_layout),
        jobs,
        shared: shared.clone(),
        shutdown: node.root.child_token(),
        chunk_tokens,
        keepalive,
        prefix_cache,
        tls: node.config.tls.clone(),
    };
    let served = node
        .serve(
            listener,
            kv_layout,
            Arc::new(PrefillLoad { shared, max_queue }),
            |routes| {
                routes.add_service(tandem_proto::limits!(
                    pb::prefill_server::PrefillServer::new(prefill)
                ))
            },
            &["tandem.v1.Prefill"],
            shutdown,
            std::future::ready(()),
        )
        .await;
    // The routes (and with them the job sender) are gone now, so the compute thread finishes
    // its queue and exits.
    let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    served
}
