//! The decode node's gRPC face: `Decode.Generate`, and its answer to `Worker.Load`. Converts
//! between protobuf and domain types; the work happens in [`crate::request`] and the scheduler.

use std::pin::Pin;

use tandem_proto::v1 as pb;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::error::Error;
use crate::request::{Plan, RequestContext};

pub(crate) type DecodeStream =
    Pin<Box<dyn Stream<Item = Result<pb::DecodeResponse, Status>> + Send + 'static>>;

#[derive(Clone, Debug)]
pub struct DecodeService {
    pub(crate) ctx: RequestContext,
}

#[tonic::async_trait]
impl pb::decode_server::Decode for DecodeService {
    type GenerateStream = DecodeStream;

    async fn generate(
        &self,
        request: Request<pb::DecodeRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let id = tandem_proto::loggable_id(&request.get_ref().request_id);
        let span = tracing::info_span!("generate", request_id = %id);
        // The caller's trace is the span's parent, set before the span is entered.
        tandem_net::otel::follow(&span, request.metadata());
        self.open(request).instrument(span).await
    }
}

impl DecodeService {
    /// Checks and starts one decode stream.
    async fn open(
        &self,
        request: Request<pb::DecodeRequest>,
    ) -> Result<Response<DecodeStream>, Status> {
        let deadline = tandem_net::deadline(request.metadata());
        let r = request.into_inner();
        tandem_proto::check_ids(&[
            ("request_id", &r.request_id),
            ("transfer_id", &r.transfer_id),
            ("cache_salt", &r.cache_salt),
            ("fetch_addr", &r.fetch_addr),
        ])
        .map_err(|(field, reason)| Error::InvalidArgument { field, reason })?;
        if r.last_resort && !r.local_prefill {
            return Err(Error::InvalidArgument {
                field: "last_resort",
                reason: "a last-resort stream is prefilled locally".into(),
            }
            .into());
        }
        if r.transfer_id.is_empty() && !r.local_prefill {
            return Err(Error::InvalidArgument {
                field: "transfer_id",
                reason: "must not be empty".into(),
            }
            .into());
        }
        let class =
            tandem_proto::policy::Class::from_pb(r.priority).ok_or(Error::InvalidArgument {
                field: "priority",
                reason: format!("{} names no priority class", r.priority),
            })?;
        let hashes = if self.ctx.prefix_cache {
            let fingerprint = &self.ctx.model.fingerprint.0;
            tandem_proto::block_hash::prompt_hashes(fingerprint, &r.cache_salt, &r.prompt_token_ids)
        } else {
            Vec::new()
        };
        let plan = Plan {
            request_id: r.request_id,
            transfer_id: r.transfer_id,
            prompt: r.prompt_token_ids,
            cache_salt: r.cache_salt,
            hashes,
            local_prefill: r.local_prefill,
            last_resort: r.last_resort,
            resumed: r.resumed_tokens as usize,
            fetch: (!r.fetch_addr.is_empty() && r.fetch_tokens > 0)
                .then_some((r.fetch_addr, r.fetch_tokens as usize)),
            class,
            params: tandem_worker::params_from_pb(r.sampling).map_err(Error::from)?,
            // A caller may ask for less patience than the node's ceiling, never more: an idle
            // reservation holds KV blocks that other requests need.
            kv_wait: (r.kv_wait_ms > 0).then(|| {
                std::time::Duration::from_millis(u64::from(r.kv_wait_ms)).min(self.ctx.max_kv_wait)
            }),
            deadline,
        };
        let stream = self.ctx.start(plan)?;
        Ok(Response::new(Box::pin(stream)))
    }
}

/// A decode node's load: requests decoding and waiting (for KV or a batch slot), against the
/// places admission has; KV blocks reserved by admission, what the session cache keeps, and
/// the measured speed of local prefills.
#[derive(Debug)]
pub(crate) struct DecodeLoad {
    pub ctx: RequestContext,
}

impl tandem_worker::LoadSource for DecodeLoad {
    fn load(&self) -> pb::LoadResponse {
        let (places, blocks) = self.ctx.admission.in_use();
        let total = self.ctx.total_blocks;
        let shared = &self.ctx.shared;
        let decoding = (shared.metrics.active_slots.get().max(0) as usize).min(places);
        pb::LoadResponse {
            active: decoding as u32,
            queued: (places - decoding) as u32,
            capacity: self.ctx.admission.max_places() as u32,
            kv_blocks_free: (total - blocks) as u64,
            kv_blocks_total: total as u64,
            prefill_tokens_per_second: shared.throughput.get(),
            kv_blocks_cached: shared.metrics.kv_blocks_cached.get().max(0) as u64,
            ..Default::default()
        }
    }
}
