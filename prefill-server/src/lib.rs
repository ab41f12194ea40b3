//! The prefill node: hosts `Prefill` (compute a prompt's KV, push it to the decode node chosen
//! by the router while computing, sample the first token), `KvTransfer` (fetches only: peers
//! pull cached prompts' KV from its prefix cache) and `Worker` (info, load, cache events, the
//! drain's moves), with health, reflection and `/metrics` on the same port. Compute runs on its
//! own thread, one request at a time, with a prefix cache of the prompts it has seen. A drain
//! offers its hottest prompts to its peers (`tandem_worker::moves`).

mod compute;
mod config;
mod error;
mod metrics;
mod service;

use std::future::Future;
use std::sync::Arc;

use tandem_proto::v1 as pb;
use tandem_transfer::{KvTransferService, Reservations, TransferMetrics};
use tandem_worker::{KvMoves, Node, NodeError, Serving};
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
    let drain_handoff = node.drain_handoff;
    let mut node = Node::new("prefill", node);
    let engine = node.engine()?;
    let chunk_tokens = engine.prefill_chunk_tokens();
    let kv_layout = engine.kv_layout();
    let prefix_cache = engine.prefix_cache_enabled();
    let shared = Arc::new(Shared {
        metrics: PrefillMetrics::register(&mut node.registry),
        hub: node.hub.clone(),
        throughput: Default::default(),
        pulse: Default::default(),
        class_tokens: Default::default(),
    });
    let (jobs, queue) = mpsc::channel(max_queue);
    let (cache, thread) =
        compute::spawn(engine, queue, shared.clone(), node.config.handoff_budget())
            .map_err(NodeError::spawn("compute"))?;
    let moves = node.moves(kv_layout, prefix_cache, cache, Arc::default());
    // A push to a prefill node finds no reservation: its KvTransfer serves fetches only.
    let fetches = KvTransferService::new(
        Reservations::default(),
        TransferMetrics::register(&mut node.registry),
    )
    .with_source(moves.fetch_source());
    let prefill = PrefillService {
        model: node.config.model.clone(),
        kv_layout: tandem_worker::wire_layout(kv_layout),
        jobs,
        max_queue,
        shared: shared.clone(),
        shutdown: node.root.child_token(),
        chunk_tokens,
        keepalive,
        prefix_cache,
        nodes: tandem_net::Channels::new(node.config.tls.as_ref()),
    };
    let serving = Serving {
        listener,
        kv_layout,
        load: Arc::new(PrefillLoad { shared, max_queue }),
        moves: moves.clone(),
        services: &["tandem.v1.Prefill", "tandem.v1.KvTransfer"],
    };
    let served = node
        .serve(
            serving,
            |routes| {
                routes
                    .add_service(tandem_proto::limits!(
                        pb::prefill_server::PrefillServer::new(prefill)
                    ))
                    .add_service(fetches.into_server())
            },
            shutdown,
            hand_off(&moves, drain_handoff),
        )
        .await;
    // The routes (and with them the job sender) are gone now, so the compute thread finishes
    // its queue and exits.
    let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    served
}

/// The drain's hand-off: offers the hottest prompts of the prefix cache to the peers and waits
/// until they were fetched, or nobody fetched any for a moment, or `bound` passed. The prompts
/// being computed finish as they would (the grace period covers them).
async fn hand_off(moves: &KvMoves, bound: std::time::Duration) {
    let done = moves.hand_off(bound, || None).await;
    tracing::info!(
        ms = done.ms,
        prompts_offered = done.sessions_offered,
        prompts_fetched = done.sessions_fetched,
        "hand-off over"
    );
}
