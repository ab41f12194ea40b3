//! The decode node: hosts `Decode` (admission, KV wait or local prefill, token streaming),
//! `KvTransfer` (the receiving end of prefill pushes) and `Worker` (model info, load, cache
//! events), with health, reflection and `/metrics` on the same port. The continuous-batching
//! scheduler runs on its own thread and keeps finished sequences' KV in a session cache.

mod admission;
mod classes;
mod config;
mod error;
mod handoff;
mod metrics;
mod park;
mod request;
mod scheduler;
mod service;
mod ticket;

use std::future::Future;
use std::sync::Arc;

use tandem_proto::v1 as pb;
use tandem_transfer::{KvTransferService, Reservations, TransferMetrics};
use tandem_worker::moves::Handoffs;
use tandem_worker::{Node, NodeError, Serving};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use config::{
    Config, DEFAULT_BATCH_SHARE_PERCENT, DEFAULT_BATCH_SLOTS_BESIDE_INTERACTIVE, DEFAULT_KV_WAIT,
    DEFAULT_MAX_KV_WAIT, DEFAULT_MAX_SLOTS, DEFAULT_PARK_PINNED_BYTES,
};
pub use error::{Error, Result};

use crate::admission::Admission;
use crate::metrics::DecodeMetrics;
use crate::request::RequestContext;
use crate::scheduler::{SchedulerHandle, Shared, Slots};
use crate::service::{DecodeLoad, DecodeService};

/// Serves a decode node on `listener` until `shutdown` completes, then drains.
pub async fn run(
    listener: TcpListener,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<(), NodeError> {
    config.validate()?;
    let Config {
        node,
        max_slots,
        kv_wait,
        max_kv_wait,
        park_pinned_bytes,
        batch_share_percent,
        batch_slots_beside_interactive,
    } = config;
    let drain_handoff = node.drain_handoff;
    let mut node = Node::new("decode", node);
    let engine = node.engine()?;
    let total_blocks = engine.kv_blocks_total();
    let kv_layout = engine.kv_layout();
    let prefix_cache = engine.prefix_cache_enabled();
    let handoffs = Arc::new(Handoffs::default());
    let shared = Arc::new(Shared {
        metrics: DecodeMetrics::register(&mut node.registry),
        hub: node.hub.clone(),
        throughput: Default::default(),
        handoffs: handoffs.clone(),
    });
    let transfer_metrics = TransferMetrics::register(&mut node.registry);
    let slots = Slots {
        max_slots,
        handoff_bytes: node.config.handoff_budget(),
        pinned_bytes: park_pinned_bytes,
        batch_beside: batch_slots_beside_interactive,
    };
    let (scheduler, thread) = SchedulerHandle::spawn(engine, shared.clone(), slots)
        .map_err(NodeError::spawn("scheduler"))?;
    let moves = node.moves(kv_layout, prefix_cache, scheduler.cache(), handoffs);
    let reservations = Reservations::default();
    let tracker = TaskTracker::new();
    let streams_stop = CancellationToken::new();
    let ctx = RequestContext {
        model: node.config.model.clone(),
        kv_layout,
        admission: Admission::new(max_slots, total_blocks, batch_share_percent),
        total_blocks,
        reservations: reservations.clone(),
        scheduler,
        shared,
        prefix_cache,
        kv_wait,
        max_kv_wait,
        // Not the node's root, which the drain cancels as its hand-off ends: the streams still
        // running then (last-resort streams, those nobody could take) go on through the grace.
        shutdown: streams_stop.clone(),
        moves: moves.clone(),
        tracker: tracker.clone(),
        next_ticket: Arc::default(),
    };
    let serving = Serving {
        listener,
        kv_layout,
        load: Arc::new(DecodeLoad { ctx: ctx.clone() }),
        moves: moves.clone(),
        services: &["tandem.v1.Decode", "tandem.v1.KvTransfer"],
    };
    let served = node
        .serve(
            serving,
            |routes| {
                routes
                    .add_service(tandem_proto::limits!(pb::decode_server::DecodeServer::new(
                        DecodeService { ctx: ctx.clone() }
                    )))
                    .add_service(
                        KvTransferService::new(reservations, transfer_metrics)
                            .with_source(moves.fetch_source())
                            .into_server(),
                    )
            },
            shutdown,
            ctx.hand_off(drain_handoff),
        )
        .await;
    // Streams still running after the grace period end with UNAVAILABLE; then the scheduler's
    // last handles (the requests' and the moves') go and its thread exits.
    streams_stop.cancel();
    tracker.close();
    tracker.wait().await;
    drop((ctx, moves));
    let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    served
}
