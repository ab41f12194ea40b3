//! The `Worker` service every prefill and decode node serves: `Info`, `Load` and `WatchLoad`
//! (from the role's [`LoadSource`]), the cache events and snapshot from its [`CacheHub`], and the
//! moves of cached KV (`Sessions`, `Adopt`, `Release`) through its [`KvMoves`].

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_engine::SpillStats;
use tandem_proto::v1 as pb;
use tokio::time::MissedTickBehavior;
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::cache::CacheHub;
use crate::moves::KvMoves;

/// A role's answer to `Worker.Load`, without the cache's epoch and sequence (the service adds
/// them).
pub trait LoadSource: Send + Sync + 'static {
    fn load(&self) -> pb::LoadResponse;
}

type LoadStream = Pin<Box<dyn Stream<Item = Result<pb::LoadResponse, Status>> + Send + 'static>>;

#[derive(Clone)]
pub struct WorkerService {
    /// `Worker.Info`'s answer without the tokenizer, which is `tokenizer_spec_json`.
    info: pb::InfoResponse,
    tokenizer_spec_json: Arc<str>,
    load: Arc<dyn LoadSource>,
    hub: Arc<CacheHub>,
    /// Ends the event streams when the node begins to shut down, so they never hold up the
    /// drain.
    shutdown: CancellationToken,
    /// The disk tier's figures, for its measured restore speed.
    spill: Option<Arc<SpillStats>>,
    moves: KvMoves,
}

impl std::fmt::Debug for WorkerService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerService")
            .field("role", &self.info.role)
            .finish_non_exhaustive()
    }
}

impl WorkerService {
    /// The service of a worker whose disk tier, if it has one, reports `spill`.
    pub fn new(
        mut info: pb::InfoResponse,
        load: Arc<dyn LoadSource>,
        hub: Arc<CacheHub>,
        spill: Option<Arc<SpillStats>>,
        moves: KvMoves,
        shutdown: CancellationToken,
    ) -> Self {
        let tokenizer_spec_json = std::mem::take(&mut info.tokenizer_spec_json).into();
        Self {
            info,
            tokenizer_spec_json,
            load,
            hub,
            shutdown,
            spill,
            moves,
        }
    }

    /// `Worker.Load`'s answer now.
    fn report(&self) -> pb::LoadResponse {
        pb::LoadResponse {
            cache_epoch: self.hub.epoch(),
            cache_seq: self.hub.seq(),
            restore_tokens_per_second: self
                .spill
                .as_ref()
                .map_or(0.0, |s| s.restore_tokens_per_second()),
            ..self.load.load()
        }
    }

    /// The tonic server for this service, with Tandem's message limits.
    pub fn into_server(self) -> pb::worker_server::WorkerServer<Self> {
        tandem_proto::limits!(pb::worker_server::WorkerServer::new(self))
    }
}

#[tonic::async_trait]
impl pb::worker_server::Worker for WorkerService {
    async fn info(
        &self,
        request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        let mut info = self.info.clone();
        if !request.into_inner().omit_tokenizer {
            info.tokenizer_spec_json = self.tokenizer_spec_json.to_string();
        }
        Ok(Response::new(info))
    }

    async fn load(
        &self,
        _request: Request<pb::LoadRequest>,
    ) -> Result<Response<pb::LoadResponse>, Status> {
        Ok(Response::new(self.report()))
    }

    type WatchLoadStream = LoadStream;

    async fn watch_load(
        &self,
        request: Request<pb::WatchLoadRequest>,
    ) -> Result<Response<Self::WatchLoadStream>, Status> {
        let r = request.into_inner();
        let interval = match r.interval_ms {
            0 => Duration::from_millis(250),
            ms => Duration::from_millis(u64::from(ms.clamp(10, 10_000))),
        };
        let heartbeat = match r.heartbeat_ms {
            0 => Duration::from_secs(1),
            ms => Duration::from_millis(u64::from(ms.min(60_000))),
        }
        .max(interval);
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        // The service, the ticks, and the last report sent and when; the first tick fires at
        // once, and sends.
        let state = (self.clone(), tick, None::<(pb::LoadResponse, Instant)>);
        let stream = futures::stream::unfold(state, move |(me, mut tick, last)| async move {
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = me.shutdown.cancelled() => return None,
                }
                let now = me.report();
                let due = last
                    .as_ref()
                    .is_none_or(|(sent, at)| *sent != now || at.elapsed() >= heartbeat);
                if due {
                    return Some((Ok(now.clone()), (me, tick, Some((now, Instant::now())))));
                }
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }

    type CacheEventsStream = crate::cache::EventStream;

    async fn cache_events(
        &self,
        _request: Request<pb::CacheEventsRequest>,
    ) -> Result<Response<Self::CacheEventsStream>, Status> {
        Ok(Response::new(self.hub.events(self.shutdown.clone())))
    }

    async fn cache_snapshot(
        &self,
        _request: Request<pb::CacheSnapshotRequest>,
    ) -> Result<Response<pb::CacheSnapshotResponse>, Status> {
        Ok(Response::new(self.hub.snapshot()))
    }

    async fn sessions(
        &self,
        _request: Request<pb::SessionsRequest>,
    ) -> Result<Response<pb::SessionsResponse>, Status> {
        Ok(Response::new(pb::SessionsResponse {
            sessions: self.moves.sessions().await,
        }))
    }

    #[tracing::instrument(skip_all, fields(request_id = %tandem_proto::loggable_id(&request.get_ref().request_id)))]
    async fn adopt(
        &self,
        request: Request<pb::AdoptRequest>,
    ) -> Result<Response<pb::AdoptResponse>, Status> {
        Ok(Response::new(self.moves.adopt(request.into_inner()).await?))
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        Ok(Response::new(
            self.moves.release(request.into_inner()).await?,
        ))
    }
}
