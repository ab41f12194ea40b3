//! The decode node's gRPC face: `Decode.Generate` and `Worker`. Converts between protobuf and
//! domain types; the work happens in [`crate::request`] and the scheduler.

use std::pin::Pin;

use tandem_engine::{GenerateParams, SamplingParams};
use tandem_proto::v1 as pb;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::error::Error;
use crate::request::{Plan, RequestContext};

pub(crate) type DecodeStream =
    Pin<Box<dyn Stream<Item = Result<pb::DecodeResponse, Status>> + Send + 'static>>;

#[derive(Clone, Debug)]
pub struct DecodeService {
    pub(crate) ctx: RequestContext,
}

fn params_from_pb(s: Option<pb::SamplingParams>) -> GenerateParams {
    let s = s.unwrap_or_default();
    GenerateParams {
        sampling: SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k as usize,
            top_p: s.top_p.unwrap_or(1.0),
            seed: s.seed,
        },
        max_tokens: s.max_tokens as usize,
        stop: s.stop,
    }
}

#[tonic::async_trait]
impl pb::decode_server::Decode for DecodeService {
    type GenerateStream = DecodeStream;

    #[tracing::instrument(skip_all, fields(request_id = %request.get_ref().request_id))]
    async fn generate(
        &self,
        request: Request<pb::DecodeRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let deadline = tandem_proto::net::deadline(request.metadata());
        let r = request.into_inner();
        if r.transfer_id.is_empty() {
            return Err(Error::InvalidArgument {
                field: "transfer_id",
                reason: "must not be empty".into(),
            }
            .into());
        }
        let plan = Plan {
            request_id: r.request_id,
            transfer_id: r.transfer_id,
            prompt: r.prompt_token_ids,
            params: params_from_pb(r.sampling),
            kv_wait: (r.kv_wait_ms > 0)
                .then(|| std::time::Duration::from_millis(u64::from(r.kv_wait_ms))),
            deadline,
        };
        let stream = self.ctx.start(plan)?;
        Ok(Response::new(Box::pin(stream)))
    }
}

/// `Worker.Info` and `Worker.Load` for a decode node.
#[derive(Clone, Debug)]
pub struct WorkerService {
    pub(crate) ctx: RequestContext,
    pub(crate) info: pb::InfoResponse,
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
        let (slots, blocks) = self.ctx.admission.in_use();
        let total = self.ctx.total_blocks;
        Ok(Response::new(pb::LoadResponse {
            active: slots as u32,
            queued: 0,
            capacity: self.ctx.admission.max_slots() as u32,
            kv_blocks_free: (total - blocks) as u64,
            kv_blocks_total: total as u64,
        }))
    }
}
