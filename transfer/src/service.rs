//! The receiving side: the `KvTransfer` gRPC service a decode node hosts.
//!
//! ```text
//! prefill ──Push(header, chunk…, trailer)──▶ KvTransferService ──claim(transfer_id)──▶ Reservations
//!                                               │ Assembler: validate, CRC, re-lay
//!                                               └──deliver(Ok(ReceivedKv) | Err(reason))──▶ waiting Decode request
//! ```
//!
//! A rejection is reported three ways: the push's status (so the sender knows why), the waiting
//! request (so it fails at once rather than at its lease), and the rejects metric.

use std::time::Instant;

use tandem_proto::v1 as pb;
use tandem_proto::v1::push_frame::Frame;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::error::{Error, Result};
use crate::fetch::FetchSource;
use crate::format::{Assembler, next_frame};
use crate::metrics::{ReasonLabel, TransferMetrics};
use crate::reservation::{Pending, Reservations};

#[derive(Clone, Debug)]
pub struct KvTransferService {
    reservations: Reservations,
    metrics: TransferMetrics,
    /// The cache that answers peer fetches; without one, `Fetch` is UNIMPLEMENTED.
    source: Option<FetchSource>,
}

impl KvTransferService {
    pub fn new(reservations: Reservations, metrics: TransferMetrics) -> Self {
        Self {
            reservations,
            metrics,
            source: None,
        }
    }

    /// Answers peer fetches from `source`.
    pub fn with_source(mut self, source: FetchSource) -> Self {
        self.source = Some(source);
        self
    }

    /// The tonic server for this service, with Tandem's message limits.
    pub fn into_server(self) -> pb::kv_transfer_server::KvTransferServer<Self> {
        tandem_proto::limits!(pb::kv_transfer_server::KvTransferServer::new(self))
    }

    async fn receive(&self, frames: &mut Streaming<pb::PushFrame>) -> Result<u64> {
        let header = match next_frame(frames).await? {
            Frame::Header(h) => h,
            Frame::Abort(a) => return Err(Error::Aborted { reason: a.reason }),
            _ => {
                return Err(Error::Malformed {
                    detail: "the first frame must be a header".into(),
                });
            }
        };
        tandem_proto::check_ids(&[
            ("transfer_id", &header.transfer_id),
            ("request_id", &header.request_id),
        ])
        .map_err(|(field, reason)| Error::HeaderTooLarge {
            detail: format!("{field}: {reason}"),
        })?;
        let span = tracing::Span::current();
        span.record("request_id", header.request_id.as_str());
        span.record("transfer_id", header.transfer_id.as_str());
        let Pending {
            want,
            mut deliver,
            progress,
        } = self.reservations.claim(&header.transfer_id)?;
        let assembled = async {
            let mut asm = Assembler::new(&header, want)?;
            loop {
                let frame = tokio::select! {
                    frame = next_frame(frames) => frame?,
                    () = deliver.closed() => return Err(Error::ReceiverGone),
                };
                match frame {
                    Frame::Chunk(c) => {
                        asm.chunk(&c)?;
                        progress.send_replace(asm.bytes_received());
                    }
                    // No bytes, but news: the waiter's silence bound starts again.
                    Frame::Keepalive(_) => {
                        progress.send_replace(asm.bytes_received());
                    }
                    Frame::Trailer(t) => {
                        let bytes = asm.bytes_received();
                        return asm.finish(&t).map(|kv| (kv, bytes));
                    }
                    Frame::Abort(a) => return Err(Error::Aborted { reason: a.reason }),
                    Frame::Header(_) => {
                        return Err(Error::Malformed {
                            detail: "a second header".into(),
                        });
                    }
                }
            }
        }
        .await;
        match assembled {
            Ok((kv, bytes)) => deliver
                .send(Ok(kv))
                .map(|()| bytes)
                .map_err(|_| Error::ReceiverGone),
            Err(e) => {
                // The waiter may be gone already; then only the sender needs to hear it.
                let _ = deliver.send(Err(e.clone()));
                Err(e)
            }
        }
    }
}

#[tonic::async_trait]
impl pb::kv_transfer_server::KvTransfer for KvTransferService {
    type FetchStream = tokio_stream::Iter<std::vec::IntoIter<Result<pb::PushFrame, Status>>>;

    #[tracing::instrument(skip_all, fields(request_id = %request.get_ref().request_id))]
    async fn fetch(
        &self,
        request: Request<pb::FetchRequest>,
    ) -> Result<Response<Self::FetchStream>, Status> {
        let Some(source) = &self.source else {
            return Err(Status::unimplemented("this node serves no peer fetches"));
        };
        let frames = source.answer(request.into_inner()).await?;
        let bytes: u64 = frames
            .iter()
            .map(|f| match &f.frame {
                Some(Frame::Chunk(c)) => c.data.len() as u64,
                _ => 0,
            })
            .sum();
        self.metrics.fetched_bytes.inc_by(bytes);
        Ok(Response::new(tokio_stream::iter(
            frames.into_iter().map(Ok).collect::<Vec<_>>(),
        )))
    }

    async fn push(
        &self,
        request: Request<Streaming<pb::PushFrame>>,
    ) -> Result<Response<pb::PushAck>, Status> {
        let span = tracing::info_span!(
            "push",
            request_id = tracing::field::Empty,
            transfer_id = tracing::field::Empty
        );
        // The sender's trace is the span's parent, set before the span is entered.
        tandem_net::otel::follow(&span, request.metadata());
        self.take(request).instrument(span).await
    }
}

impl KvTransferService {
    /// Receives one push ([`KvTransferService::receive`]) and counts it.
    async fn take(
        &self,
        request: Request<Streaming<pb::PushFrame>>,
    ) -> Result<Response<pb::PushAck>, Status> {
        let started = Instant::now();
        let mut frames = request.into_inner();
        match self.receive(&mut frames).await {
            Ok(bytes) => {
                let secs = started.elapsed().as_secs_f64();
                self.metrics.bytes.inc_by(bytes);
                self.metrics.duration.observe(secs);
                self.metrics
                    .throughput
                    .observe(bytes as f64 / secs.max(1e-9));
                Ok(Response::new(pb::PushAck {
                    bytes_received: bytes,
                }))
            }
            Err(e) => {
                self.metrics
                    .rejects
                    .get_or_create(&ReasonLabel { reason: e.reason() })
                    .inc();
                tracing::warn!(reason = e.reason(), error = %e, "KV push rejected");
                Err(e.into())
            }
        }
    }
}
