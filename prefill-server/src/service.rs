//! The prefill node's gRPC face: `Prefill`, and its answer to `Worker.Load`. Validates,
//! converts, queues the job for the compute thread, and finishes the push with the sampled first
//! token.

use std::sync::Arc;
use std::time::Instant;

use tandem_engine::{BLOCK_TOKENS, Model};
use tandem_proto::v1 as pb;
use tandem_transfer::{Header, KvPush};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::compute::{Done, Job, Share, Shared, Upstream, Work};
use crate::error::{Error, Result};

#[derive(Clone, Debug)]
pub struct PrefillService {
    pub(crate) model: Arc<Model>,
    /// The KV this node sends: the engine's layout and dtype.
    pub(crate) kv_layout: tandem_transfer::WireLayout,
    pub(crate) jobs: mpsc::Sender<Job>,
    /// Prompts waiting for the compute thread at most (besides the one it runs).
    pub(crate) max_queue: usize,
    pub(crate) shared: Arc<Shared>,
    pub(crate) shutdown: CancellationToken,
    pub(crate) chunk_tokens: usize,
    pub(crate) keepalive: std::time::Duration,
    pub(crate) prefix_cache: bool,
    /// The connections to the decode nodes and to a pipeline's other stages (over mutual TLS,
    /// as a prefill node, where set).
    pub(crate) nodes: tandem_net::Channels,
}

impl PrefillService {
    /// Checks a request; a relay (`Prefill.Relay`) has no decode node, transfer id or sampling.
    fn validate(&self, r: &pb::PrefillRequest, relay: bool) -> Result<()> {
        let invalid = |field, reason: String| Err(Error::InvalidArgument { field, reason });
        let config = &self.model.config;
        tandem_proto::check_ids(&[
            ("request_id", &r.request_id),
            ("transfer_id", &r.transfer_id),
            ("tenant", &r.tenant),
            ("cache_salt", &r.cache_salt),
        ])
        .or_else(|(field, reason)| invalid(field, reason))?;
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
        config.check_token_ids("token_ids", &r.token_ids)?;
        let cached = r.cached_tokens as usize;
        if cached > tandem_proto::block_hash::reusable_blocks(r.token_ids.len()) * BLOCK_TOKENS
            || !cached.is_multiple_of(BLOCK_TOKENS)
        {
            return invalid(
                "cached_tokens",
                format!(
                    "must be a multiple of {BLOCK_TOKENS} that leaves at least the last token to \
                     compute"
                ),
            );
        }
        validate_upstream(r)?;
        if !relay && (r.transfer_id.is_empty() || r.decode_addr.is_empty()) {
            return invalid(
                "transfer_id",
                "transfer_id and decode_addr are required".into(),
            );
        }
        if r.resumed_tokens as usize >= r.token_ids.len() {
            return invalid(
                "resumed_tokens",
                "must leave at least one token of the original prompt".into(),
            );
        }
        Ok(())
    }

    async fn prefill(&self, mut r: pb::PrefillRequest) -> Result<pb::PrefillResponse> {
        self.validate(&r, false)?;
        let params = tandem_worker::params_from_pb(r.sampling.take())?;
        params.validate()?;
        let class = self.class_now(&r)?;
        let n = r.token_ids.len();
        let push = r.cached_tokens as usize..n;
        let header = self.header(&r, push.clone());
        let channel = (self.nodes.get(&r.decode_addr)).map_err(|e| Error::InvalidArgument {
            field: "decode_addr",
            reason: e.to_string(),
        })?;
        let upstream = self.upstream(&r)?;
        let kv = KvPush::start(channel, &header);
        // While the prompt waits in the queue the decode node hears from this push all the same.
        let heartbeat = kv.heartbeat();
        let cancel = CancellationToken::new();
        // Dropping this handler (the router gave up) stops the compute between chunks.
        let _stop = cancel.clone().drop_guard();
        let resumed = r.resumed_tokens as usize;
        let work = self.work(r, class, push, kv, cancel, upstream);
        let work = Work {
            resumed,
            params,
            ..work
        };
        let submitted = Instant::now();
        let done = self.submit(work)?;
        let pulse = || self.shared.pulse.within(crate::compute::STALLED_AFTER);
        let done = tokio::select! {
            done = done => done,
            never = heartbeat.run(self.keepalive, pulse) => match never {},
        };
        let done = done.map_err(|_| Error::ShuttingDown)??;
        let waited_ms = (submitted.elapsed().as_secs_f64() * 1e3 - done.compute_ms).max(0.0);
        let first_sent = done.first_chunk_sent.unwrap_or_else(Instant::now);
        let (first_token, first_logprobs) = match &done.first_token {
            Some((token, logprobs)) => (Some(*token), logprobs.as_ref()),
            None => (None, None),
        };
        let ack = done
            .kv
            .finish(
                first_token.unwrap_or_default(),
                first_logprobs.map(tandem_worker::logprobs_to_pb),
            )
            .await?;
        let first_token = first_token.ok_or(tandem_transfer::Error::ReceiverGone)?;
        tracing::debug!(
            tokens = n,
            cached = done.cached_tokens,
            compute_ms = done.compute_ms,
            kv_bytes = ack.bytes_received,
            "prefilled and pushed"
        );
        Ok(pb::PrefillResponse {
            first_token,
            prefill_ms: done.compute_ms,
            transfer_ms: first_sent.elapsed().as_secs_f64() * 1e3,
            kv_bytes: ack.bytes_received,
            // The pipeline's earlier stages computed theirs for this request too.
            computed_tokens: (n - done.cached_tokens) as u32,
            prefix_cached_tokens: done.cached_tokens as u32,
            restored_tokens: done.restored_tokens as u32,
            waited_ms,
        })
    }
}

impl PrefillService {
    /// `Prefill.Relay`: computes the prompt as a stage of a pipelined prefill and answers the
    /// KV of `token_ids[cached_tokens..]` as a stream of push frames, a layer at a time.
    fn relay(&self, r: pb::PrefillRequest) -> Result<ReceiverStream<pb::PushFrame>> {
        self.validate(&r, true)?;
        let class = self.class_now(&r)?;
        let push = r.cached_tokens as usize..r.token_ids.len();
        let header = self.header(&r, push.clone());
        let upstream = self.upstream(&r)?;
        let (kv, frames) = KvPush::relay(&header);
        let heartbeat = kv.heartbeat();
        let cancel = CancellationToken::new();
        let stop = cancel.clone().drop_guard();
        let work = Work {
            relay: true,
            ..self.work(r, class, push, kv, cancel, upstream)
        };
        let done = self.submit(work)?;
        self.shared.metrics.relays.inc();
        let (shared, keepalive) = (self.shared.clone(), self.keepalive);
        tokio::spawn(
            async move {
                let _stop = stop;
                let pulse = || shared.pulse.within(crate::compute::STALLED_AFTER);
                let done = tokio::select! {
                    done = done => done,
                    never = heartbeat.run(keepalive, pulse) => match never {},
                };
                // A failed job has aborted the stream with its reason already.
                if let Ok(Ok(done)) = done {
                    let _ = done.kv.finish(0, None).await;
                }
            }
            .in_current_span(),
        );
        Ok(frames)
    }

    /// The request's priority class, while the node still takes work.
    fn class_now(&self, r: &pb::PrefillRequest) -> Result<tandem_proto::policy::Class> {
        let class =
            tandem_proto::policy::Class::from_pb(r.priority).ok_or(Error::InvalidArgument {
                field: "priority",
                reason: format!("{} names no priority class", r.priority),
            })?;
        if self.shutdown.is_cancelled() {
            return Err(Error::ShuttingDown);
        }
        Ok(class)
    }

    /// The header of a push of `push` of the request's tokens.
    fn header(&self, r: &pb::PrefillRequest, push: std::ops::Range<usize>) -> Header {
        let layout = self.kv_layout;
        Header {
            transfer_id: r.transfer_id.clone(),
            request_id: r.request_id.clone(),
            fingerprint: self.model.fingerprint.0,
            layout,
            tokens: push.start as u32..push.end as u32,
            token_ids: r.token_ids[push.clone()].to_vec(),
            chunk_count: tandem_worker::chunk_count(&layout, push.clone(), self.chunk_tokens),
            total_bytes: layout.total_bytes(push.len()),
        }
    }

    /// The stage before this one in the request's pipeline, if any, with its `Relay` call.
    fn upstream(&self, r: &pb::PrefillRequest) -> Result<Option<Upstream>> {
        let Some((last, before)) = r.upstream.split_last() else {
            return Ok(None);
        };
        let channel = self
            .nodes
            .get(&last.addr)
            .map_err(|e| Error::InvalidArgument {
                field: "upstream",
                reason: e.to_string(),
            })?;
        let end = last.end as usize;
        let request = pb::PrefillRequest {
            request_id: r.request_id.clone(),
            token_ids: r.token_ids[..end].to_vec(),
            cache_salt: r.cache_salt.clone(),
            priority: r.priority,
            tenant: r.tenant.clone(),
            weight: r.weight,
            upstream: before.to_vec(),
            ..Default::default()
        };
        Ok(Some(Upstream {
            addr: last.addr.clone(),
            channel,
            end,
            request,
        }))
    }

    /// The job of a request (sampling as by default, nothing resumed).
    fn work(
        &self,
        r: pb::PrefillRequest,
        class: tandem_proto::policy::Class,
        push: std::ops::Range<usize>,
        kv: KvPush,
        cancel: CancellationToken,
        upstream: Option<Upstream>,
    ) -> Work {
        let hashes = if self.prefix_cache {
            tandem_worker::block_hashes(&self.model, &r.cache_salt, &r.token_ids)
        } else {
            Vec::new()
        };
        Work {
            tokens: r.token_ids,
            cache_salt: r.cache_salt,
            share: Share {
                class,
                tenant: r.tenant.into(),
                weight: r.weight,
            },
            hashes,
            push,
            resumed: 0,
            params: Default::default(),
            kv,
            cancel,
            upstream,
            relay: false,
        }
    }

    /// Queues `work` for the compute thread; its outcome comes on the receiver.
    fn submit(&self, work: Work) -> Result<oneshot::Receiver<Result<Done>>> {
        let (class, n) = (work.share.class, work.tokens.len());
        let (reply, done) = oneshot::channel();
        // The compute thread takes jobs off the channel to rank them, so the queue's bound is
        // its depth (the job it runs and those waiting), counted here.
        let metrics = &self.shared.metrics;
        let depth = metrics.queue_depth.inc().max(0) as usize;
        if depth > self.max_queue {
            metrics.queue_depth.dec();
            return Err(Error::QueueFull { depth });
        }
        if self.jobs.try_send(Job { work, reply }).is_err() {
            metrics.queue_depth.dec();
            return Err(Error::ShuttingDown);
        }
        self.shared.queued(class, n, true);
        Ok(done)
    }
}

/// A pipeline's stages: at most [`tandem_proto::MAX_PIPELINE_STAGES`], each with an address,
/// their ends rising from above 0 to below the prompt's length.
fn validate_upstream(r: &pb::PrefillRequest) -> Result<()> {
    let invalid = |reason: String| {
        Err(Error::InvalidArgument {
            field: "upstream",
            reason,
        })
    };
    if r.upstream.len() >= tandem_proto::MAX_PIPELINE_STAGES {
        return invalid(format!(
            "{} stages before this one (at most {})",
            r.upstream.len(),
            tandem_proto::MAX_PIPELINE_STAGES - 1
        ));
    }
    let mut from = 0;
    for stage in &r.upstream {
        tandem_proto::check_ids(&[("upstream.addr", &stage.addr)])
            .or_else(|(_, reason)| invalid(reason))?;
        let end = stage.end as usize;
        if stage.addr.is_empty() || end <= from || end >= r.token_ids.len() {
            return invalid(format!(
                "a stage ends at {end}: ends must rise from above 0 to below the prompt's {} \
                 tokens, each stage with an address",
                r.token_ids.len()
            ));
        }
        from = end;
    }
    Ok(())
}

#[tonic::async_trait]
impl pb::prefill_server::Prefill for PrefillService {
    async fn prefill(
        &self,
        request: Request<pb::PrefillRequest>,
    ) -> Result<Response<pb::PrefillResponse>, Status> {
        let id = tandem_proto::loggable_id(&request.get_ref().request_id);
        let span = tracing::info_span!("prefill", request_id = %id);
        // The caller's trace is the span's parent, set before the span is entered.
        tandem_net::otel::follow(&span, request.metadata());
        let prefilled = PrefillService::prefill(self, request.into_inner())
            .instrument(span)
            .await?;
        Ok(Response::new(prefilled))
    }

    type RelayStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<pb::PushFrame, Status>> + Send + 'static>,
    >;

    async fn relay(
        &self,
        request: Request<pb::PrefillRequest>,
    ) -> Result<Response<Self::RelayStream>, Status> {
        let id = tandem_proto::loggable_id(&request.get_ref().request_id);
        let span = tracing::info_span!("relay", request_id = %id);
        tandem_net::otel::follow(&span, request.metadata());
        let frames = span.in_scope(|| PrefillService::relay(self, request.into_inner()))?;
        Ok(Response::new(Box::pin(tokio_stream::StreamExt::map(
            frames, Ok,
        ))))
    }
}

/// A prefill node's load: its queue, in requests and prompt tokens, and its measured speed.
#[derive(Debug)]
pub(crate) struct PrefillLoad {
    pub shared: Arc<Shared>,
    pub max_queue: usize,
}

impl tandem_worker::LoadSource for PrefillLoad {
    fn load(&self) -> pb::LoadResponse {
        let m = &self.shared.metrics;
        let depth = m.queue_depth.get().max(0) as u32;
        pb::LoadResponse {
            active: depth.min(1),
            queued: depth.saturating_sub(1),
            capacity: self.max_queue as u32,
            queued_tokens: m.queued_tokens.get().max(0) as u64,
            queued_class_tokens: (self.shared.class_tokens.iter())
                .map(|t| t.load(std::sync::atomic::Ordering::Relaxed).max(0) as u64)
                .collect(),
            prefill_tokens_per_second: self.shared.throughput.get(),
            kv_blocks_cached: m.cache_blocks.get().max(0) as u64,
            ..Default::default()
        }
    }
}
