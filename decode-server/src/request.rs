//! One decode request's life, as a task: admission, the bounded wait for its KV, handing the
//! sequence to the scheduler, and forwarding its tokens, under the request's deadline.
//!
//! ```text
//! Generate ─▶ admit (slot + blocks) ─▶ reserve transfer id ─▶ [task] send `admitted`
//!               │ RESOURCE_EXHAUSTED                              wait KV (≤ kv_wait silent)
//!                                                                  scheduler.start ─▶ events ─▶ frames
//! ```
//!
//! Everything the request holds is RAII: dropping the task (client gone, deadline, shutdown)
//! releases the admission, the reservation and the scheduler's sequence.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tandem_engine::{FinishReason, GenerateParams, KvExport, Model};
use tandem_proto::v1 as pb;
use tandem_transfer::{Expectation, Reservations, WireLayout};
use tokio::sync::mpsc;
use tokio::time::Instant as TokioInstant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::Status;

use crate::admission::{Admission, Admitted};
use crate::error::{Error, Result};
use crate::scheduler::{Event, SchedulerHandle, Start, Ticket};

/// Frames buffered towards the client before the request task waits.
const FRAME_BUFFER: usize = 16;

/// A validated request, as the service layer hands it over.
#[derive(Debug)]
pub(crate) struct Plan {
    pub request_id: String,
    pub transfer_id: String,
    pub prompt: Vec<u32>,
    pub params: GenerateParams,
    pub kv_wait: Option<Duration>,
    pub deadline: Option<TokioInstant>,
}

/// What every request task shares.
#[derive(Clone, Debug)]
pub(crate) struct RequestContext {
    pub model: Arc<Model>,
    pub admission: Admission,
    pub total_blocks: usize,
    pub reservations: Reservations,
    pub scheduler: SchedulerHandle,
    pub kv_wait: Duration,
    pub shutdown: CancellationToken,
    pub tracker: TaskTracker,
    pub next_ticket: Arc<AtomicU64>,
}

pub(crate) fn wire_layout(model: &Model) -> WireLayout {
    let l = model.config.kv_layout();
    WireLayout {
        layers: l.n_layers as u32,
        kv_heads: l.n_kv_heads as u32,
        head_dim: l.head_dim as u32,
        block_tokens: tandem_engine::BLOCK_TOKENS as u32,
    }
}

fn finish_reason(r: FinishReason) -> pb::FinishReason {
    match r {
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Length => pb::FinishReason::Length,
    }
}

/// Cancels the scheduler's sequence unless the generation finished.
struct SequenceGuard {
    scheduler: SchedulerHandle,
    ticket: Ticket,
    finished: bool,
}

impl Drop for SequenceGuard {
    fn drop(&mut self) {
        if !self.finished {
            self.scheduler.cancel(self.ticket);
        }
    }
}

/// Waits for the verified KV, allowing at most `idle` without progress: before the push
/// starts, and between its chunks. (A bound on the whole transfer would fail long prompts,
/// whose prefill takes as long as it takes; silence is what signals a dead sender.)
async fn wait_kv(
    lease: &tandem_transfer::ReservationGuard,
    mut delivery: tandem_transfer::reservation::Delivery,
    idle: Duration,
) -> Result<tandem_transfer::ReceivedKv> {
    let mut progress = lease.progress();
    let timeout = || Error::KvTimeout {
        waited_ms: idle.as_millis() as u64,
    };
    loop {
        tokio::select! {
            r = &mut delivery => return r.map_err(|_| Error::ShuttingDown)?.map_err(Error::from),
            changed = progress.changed() => {
                if changed.is_err() {
                    // The push ended; its verdict is on its way.
                    return tokio::time::timeout(idle, delivery)
                        .await
                        .map_err(|_| timeout())?
                        .map_err(|_| Error::ShuttingDown)?
                        .map_err(Error::from);
                }
            }
            () = tokio::time::sleep(idle) => return Err(timeout()),
        }
    }
}

impl RequestContext {
    /// Validates and admits `plan`, then starts its task; returns the response stream.
    pub(crate) fn start(
        &self,
        plan: Plan,
    ) -> Result<ReceiverStream<Result<pb::DecodeResponse, Status>>> {
        if self.shutdown.is_cancelled() {
            return Err(Error::ShuttingDown);
        }
        let config = &self.model.config;
        if plan.prompt.is_empty() {
            return Err(Error::InvalidArgument {
                field: "prompt_token_ids",
                reason: "must not be empty".into(),
            });
        }
        if let Some(t) = plan.prompt.iter().find(|&&t| t as usize >= config.vocab) {
            return Err(Error::InvalidArgument {
                field: "prompt_token_ids",
                reason: format!("token id {t} is outside the vocabulary of {}", config.vocab),
            });
        }
        plan.params.validate()?;
        let total = plan.prompt.len() + plan.params.max_tokens;
        if total > config.context_len {
            return Err(Error::InvalidArgument {
                field: "max_tokens",
                reason: format!(
                    "prompt of {} tokens plus max_tokens {} exceeds the context of {}",
                    plan.prompt.len(),
                    plan.params.max_tokens,
                    config.context_len
                ),
            });
        }
        let admitted = self
            .admission
            .try_admit(total.div_ceil(tandem_engine::BLOCK_TOKENS))?;
        let layout = wire_layout(&self.model);
        let want = Expectation {
            fingerprint: self.model.fingerprint.0,
            layout,
            tokens: 0..plan.prompt.len() as u32,
            token_ids: plan.prompt.clone(),
            max_bytes: layout.total_bytes(plan.prompt.len()),
        };
        let (lease, delivery) = self.reservations.reserve(&plan.transfer_id, want)?;
        let (tx, rx) = mpsc::channel(FRAME_BUFFER);
        let ctx = self.clone();
        self.tracker.spawn(async move {
            let outcome = ctx.run(plan, admitted, lease, delivery, &tx).await;
            if let Err(e) = outcome {
                let _ = tx.send(Err(e.into())).await;
            }
        });
        Ok(ReceiverStream::new(rx))
    }

    async fn run(
        &self,
        plan: Plan,
        _admitted: Admitted,
        lease: tandem_transfer::ReservationGuard,
        delivery: tandem_transfer::reservation::Delivery,
        tx: &mpsc::Sender<Result<pb::DecodeResponse, Status>>,
    ) -> Result<()> {
        let admitted_at = Instant::now();
        let deadline = plan.deadline;
        let until_deadline = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(until_deadline);
        let frame = pb::DecodeResponse {
            event: Some(pb::decode_response::Event::Admitted(pb::DecodeAdmitted {
                cached_tokens: 0,
            })),
        };
        if tx.send(Ok(frame)).await.is_err() {
            return Ok(());
        }

        let kv_wait = plan.kv_wait.unwrap_or(self.kv_wait);
        let received = tokio::select! {
            r = wait_kv(&lease, delivery, kv_wait) => r?,
            () = tx.closed() => return Ok(()),
            () = &mut until_deadline => return Err(Error::Deadline),
            () = self.shutdown.cancelled() => return Err(Error::ShuttingDown),
        };
        drop(lease);
        if received.first_token as usize >= self.model.config.vocab {
            return Err(Error::InvalidArgument {
                field: "first_token",
                reason: format!("{} is outside the vocabulary", received.first_token),
            });
        }
        let kv_wait_ms = admitted_at.elapsed().as_secs_f64() * 1e3;

        let ticket = Ticket(self.next_ticket.fetch_add(1, Ordering::Relaxed));
        let (events_tx, mut events) = mpsc::channel(plan.params.max_tokens + 2);
        let mut guard = SequenceGuard {
            scheduler: self.scheduler.clone(),
            ticket,
            finished: false,
        };
        let started = self.scheduler.start(Start {
            ticket,
            kv: KvExport {
                layout: self.model.config.kv_layout(),
                tokens: received.tokens.start as usize..received.tokens.end as usize,
                layers: received.layers,
            },
            first_token: received.first_token,
            params: plan.params,
            events: events_tx,
        });
        if !started {
            return Err(Error::ShuttingDown);
        }

        let mut index = 0u32;
        let mut completion_tokens = 0u32;
        loop {
            let event = tokio::select! {
                e = events.recv() => e,
                () = tx.closed() => return Ok(()),
                () = &mut until_deadline => return Err(Error::Deadline),
                () = self.shutdown.cancelled() => return Err(Error::ShuttingDown),
            };
            let emission = match event {
                Some(Event::Token(e)) => e,
                Some(Event::Failed(e)) => {
                    guard.finished = true;
                    return Err(Error::Step(e));
                }
                None => return Err(Error::ShuttingDown),
            };
            completion_tokens += u32::from(emission.token.is_some());
            let last = emission.finished;
            let frame = pb::DecodeTokens {
                index,
                token_ids: emission.token.into_iter().collect(),
                text: emission.text,
                finish_reason: last.map_or(pb::FinishReason::Unspecified, finish_reason) as i32,
                completion_tokens: if last.is_some() { completion_tokens } else { 0 },
                kv_wait_ms: if index == 0 { kv_wait_ms } else { 0.0 },
            };
            index += 1;
            let frame = pb::DecodeResponse {
                event: Some(pb::decode_response::Event::Tokens(frame)),
            };
            if tx.send(Ok(frame)).await.is_err() {
                return Ok(());
            }
            if last.is_some() {
                guard.finished = true;
                tracing::debug!(request_id = %plan.request_id, completion_tokens, "generation finished");
                return Ok(());
            }
        }
    }
}
