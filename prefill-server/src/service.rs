//! The prefill node's gRPC face: `Prefill` and `Worker`. Validates, converts, queues the job for
//! the compute thread, and finishes the push with the sampled first token.

use std::time::Instant;

use tandem_engine::{Model, SamplingParams};
use tandem_proto::v1 as pb;
use tandem_transfer::{Header, KvPush, WireLayout};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::compute::Job;
use crate::error::{Error, Result};
use crate::metrics::PrefillMetrics;

#[derive(Clone, Debug)]
pub struct PrefillService {
    pub(crate) model: std::sync::Arc<Model>,
    pub(crate) jobs: mpsc::Sender<Job>,
    pub(crate) metrics: PrefillMetrics,
    pub(crate) shutdown: CancellationToken,
    pub(crate) chunk_tokens: usize,
}

fn sampling_from_pb(s: Option<pb::SamplingParams>) -> SamplingParams {
    let s = s.unwrap_or_default();
    SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as usize,
        top_p: s.top_p.unwrap_or(1.0),
        seed: s.seed,
    }
}

impl PrefillService {
    fn layout(&self) -> WireLayout {
        let l = self.model.config.kv_layout();
        WireLayout {
            layers: l.n_layers as u32,
            kv_heads: l.n_kv_heads as u32,
            head_dim: l.head_dim as u32,
            block_tokens: tandem_engine::BLOCK_TOKENS as u32,
        }
    }

    fn validate(&self, r: &pb::PrefillRequest) -> Result<()> {
        let invalid = |field, reason: String| Err(Error::InvalidArgument { field, reason });
        let config = &self.model.config;
        if r.token_ids.is_empty() {
            return invalid("token_ids", "must not be empty".into());
        }
        if r.token_ids.len() > config.context_len {
            return invalid(
                "token_ids",
                format!(
                    "{} tokens exceed the context of {}",
                    r.token_ids.len(),
                    config.context_len
                ),
            );
        }
        if let Some(t) = r.token_ids.iter().find(|&&t| t as usize >= config.vocab) {
            return invalid(
                "token_ids",
                format!("token id {t} is outside the vocabulary"),
            );
        }
        if r.cached_tokens as usize >= r.token_ids.len() {
            return invalid(
                "cached_tokens",
                "must leave at least one token to compute".into(),
            );
        }
        if r.cached_tokens != 0 {
            return invalid(
                "cached_tokens",
                "prefix reuse is not supported yet; send 0".into(),
            );
        }
        if r.transfer_id.is_empty() || r.decode_addr.is_empty() {
            return invalid(
                "transfer_id",
                "transfer_id and decode_addr are required".into(),
            );
        }
        sampling_from_pb(r.sampling.clone()).validate()?;
        Ok(())
    }

    async fn prefill(&self, r: pb::PrefillRequest) -> Result<pb::PrefillResponse> {
        self.validate(&r)?;
        if self.shutdown.is_cancelled() {
            return Err(Error::ShuttingDown);
        }
        let n = r.token_ids.len();
        let compute = r.cached_tokens as usize..n;
        let layout = self.layout();
        let chunk_tokens = self.chunk_tokens;
        let header = Header {
            transfer_id: r.transfer_id.clone(),
            request_id: r.request_id.clone(),
            fingerprint: self.model.fingerprint.0,
            layout,
            tokens: compute.start as u32..compute.end as u32,
            token_ids: r.token_ids[compute.clone()].to_vec(),
            chunk_count: (compute.len().div_ceil(chunk_tokens) * layout.layers as usize * 2) as u32,
            total_bytes: layout.total_bytes(compute.len()),
        };
        let channel =
            tandem_proto::net::channel(&r.decode_addr).map_err(|e| Error::InvalidArgument {
                field: "decode_addr",
                reason: e.to_string(),
            })?;
        let push = KvPush::start(channel, &header);
        let cancel = CancellationToken::new();
        // Dropping this handler (the router gave up) stops the compute between chunks.
        let _stop = cancel.clone().drop_guard();
        let (reply, done) = oneshot::channel();
        let job = Job {
            tokens: r.token_ids,
            compute: compute.clone(),
            sampling: sampling_from_pb(r.sampling),
            push,
            cancel,
            reply,
        };
        self.jobs.try_send(job).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => Error::QueueFull {
                depth: self.metrics.queue_depth.get() as usize,
            },
            mpsc::error::TrySendError::Closed(_) => Error::ShuttingDown,
        })?;
        self.metrics.queue_depth.inc();
        let done = done.await.map_err(|_| Error::ShuttingDown)??;
        let first_sent = done.first_chunk_sent.unwrap_or_else(Instant::now);
        let ack = done
            .push
            .finish(done.first_token.unwrap_or_default())
            .await?;
        let first_token = done
            .first_token
            .ok_or(tandem_transfer::Error::ReceiverGone)?;
        Ok(pb::PrefillResponse {
            first_token,
            prefill_ms: done.compute_ms,
            transfer_ms: first_sent.elapsed().as_secs_f64() * 1e3,
            kv_bytes: ack.bytes_received,
            computed_tokens: compute.len() as u32,
        })
    }
}

#[tonic::async_trait]
impl pb::prefill_server::Prefill for PrefillService {
    #[tracing::instrument(skip_all, fields(request_id = %request.get_ref().request_id))]
    async fn prefill(
        &self,
        request: Request<pb::PrefillRequest>,
    ) -> Result<Response<pb::PrefillResponse>, Status> {
        Ok(Response::new(
            PrefillService::prefill(self, request.into_inner()).await?,
        ))
    }
}

/// `Worker.Info` and `Worker.Load` for a prefill node.
#[derive(Clone, Debug)]
pub struct WorkerService {
    pub(crate) info: pb::InfoResponse,
    pub(crate) metrics: PrefillMetrics,
    pub(crate) max_queue: usize,
}

#[tonic::async_trait]
impl pb::worker_server::Worker for WorkerService {
    async fn info(
        &self,
        _request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        Ok(Response::new(self.info.clone()))
    }

    async fn load(
        &self,
        _request: Request<pb::LoadRequest>,
    ) -> Result<Response<pb::LoadResponse>, Status> {
        let depth = self.metrics.queue_depth.get().max(0) as u32;
        Ok(Response::new(pb::LoadResponse {
            active: depth.min(1),
            queued: depth.saturating_sub(1),
            capacity: self.max_queue as u32,
            kv_blocks_free: 0,
            kv_blocks_total: 0,
        }))
    }
}
