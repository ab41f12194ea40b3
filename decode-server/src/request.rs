//! One decode request's life, as a task: admission, opening its sequence on the session cache,
//! the bounded wait for the rest of its KV (or a local prefill), handing the sequence to the
//! scheduler, and forwarding its tokens, under the request's deadline.
//!
//! ```text
//! Generate ─▶ admit (slot + blocks) ─▶ [task] open seq on the cached prefix ─▶ reserve transfer id
//!               │ RESOURCE_EXHAUSTED        ─▶ send `admitted{cached}` ─▶ wait KV (≤ kv_wait silent)
//!                                           ─▶ scheduler.start ─▶ events ─▶ frames
//! ```
//!
//! Admission reserves the worst case (prompt + max_tokens blocks, max_tokens cut to what the
//! pool can hold for one request) whatever the cache holds, so running sequences can never run
//! out of KV; cached blocks nobody uses are evicted as needed.
//! Everything the request holds is RAII: dropping the task (client gone, deadline, shutdown)
//! releases the admission, the reservation and the scheduler's sequence.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tandem_engine::{Emission, FinishReason, GenerateParams, Model, Stream};
use tandem_proto::v1 as pb;
use tandem_transfer::reservation::Delivery;
use tandem_transfer::{Expectation, ReceivedKv, ReservationGuard, Reservations};
use tandem_worker::KvMoves;
use tokio::sync::mpsc;
use tokio::time::Instant as TokioInstant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::Status;
use tracing::Instrument;

use crate::admission::{Admission, Admitted};
use crate::error::{Error, Result};
use crate::scheduler::{Event, Input, Joining, SchedulerHandle, Shared, Start};
use crate::ticket::Ticket;

/// Frames buffered towards the client before the request task waits.
const FRAME_BUFFER: usize = 16;

/// A validated request, as the service layer hands it over.
#[derive(Debug)]
pub(crate) struct Plan {
    pub request_id: String,
    pub transfer_id: String,
    pub prompt: Vec<u32>,
    pub cache_salt: String,
    /// Block hashes of the prompt's reusable blocks (empty with the cache off).
    pub hashes: Vec<u64>,
    /// Compute the uncached suffix here instead of waiting for a push.
    pub local_prefill: bool,
    /// A handed-off stream that no node outside a drain could take: accepted while this node
    /// drains, and finished here rather than handed off again.
    pub last_resort: bool,
    /// The prompt's last tokens that an earlier attempt generated and delivered (failover).
    pub resumed: usize,
    /// Peer fetch: the KV of the prompt's first tokens comes from this holder (its address and
    /// the tokens asked) before the cache lookup.
    pub fetch: Option<(String, usize)>,
    pub class: tandem_proto::policy::Class,
    pub params: GenerateParams,
    pub kv_wait: Option<Duration>,
    pub deadline: Option<TokioInstant>,
}

/// What every request task shares.
#[derive(Clone, Debug)]
pub(crate) struct RequestContext {
    pub model: Arc<Model>,
    /// The engine's KV layout and dtype, which a push must match.
    pub kv_layout: tandem_engine::KvLayout,
    pub admission: Admission,
    pub total_blocks: usize,
    pub reservations: Reservations,
    pub scheduler: SchedulerHandle,
    pub shared: Arc<Shared>,
    /// Whether the session cache is on (requests then look their prompt up in it).
    pub prefix_cache: bool,
    pub kv_wait: Duration,
    pub max_kv_wait: Duration,
    /// Cancelled once the node's grace period is over: the streams still running end.
    pub shutdown: CancellationToken,
    /// Peer fetches, and the drain: its `draining` is cancelled as the drain begins, when new
    /// requests are refused and running streams hand off.
    pub moves: KvMoves,
    pub tracker: TaskTracker,
    pub next_ticket: Arc<AtomicU64>,
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
        mut plan: Plan,
    ) -> Result<ReceiverStream<Result<pb::DecodeResponse, Status>>> {
        if self.moves.draining.is_cancelled() && !plan.last_resort {
            return Err(Error::HandedOff { tokens: 0 });
        }
        let config = &self.model.config;
        if plan.prompt.is_empty() {
            return Err(Error::InvalidArgument {
                field: "prompt_token_ids",
                reason: "must not be empty".into(),
            });
        }
        config.check_token_ids("prompt_token_ids", &plan.prompt)?;
        plan.params.validate()?;
        // Resumed tokens that reach max_tokens are refused by `Stream::resume` below.
        if plan.resumed >= plan.prompt.len() {
            return Err(Error::InvalidArgument {
                field: "resumed_tokens",
                reason: format!(
                    "{} resumed tokens leave nothing of the {}-token prompt",
                    plan.resumed,
                    plan.prompt.len()
                ),
            });
        }
        // max_tokens counts the resumed tokens, which the prompt already holds.
        let original = plan.prompt.len() - plan.resumed;
        config.check_fits(original, plan.params.max_tokens)?;
        let asked = self.fit_pool(&mut plan, original)?;
        let total = original + plan.params.max_tokens;
        let generated = &plan.prompt[original..];
        let stream = Stream::resume(
            plan.params.clone(),
            &self.model,
            &plan.prompt[..original],
            generated,
        )?;
        let admitted = self
            .admission
            .try_admit(total.div_ceil(tandem_engine::BLOCK_TOKENS), plan.class)?;
        if let Some(asked) = asked {
            tracing::info!(
                asked,
                cut = plan.params.max_tokens,
                pool_tokens = total,
                class = %plan.class,
                "max_tokens cut to what the KV pool holds for one request"
            );
            self.shared.metrics.max_tokens_cut.inc();
        }
        let (tx, rx) = mpsc::channel(FRAME_BUFFER);
        let ctx = self.clone();
        // The generation logs under the request's span (its request_id).
        self.tracker.spawn(
            async move {
                let outcome = ctx.run(plan, stream, admitted, &tx).await;
                if let Err(e) = outcome {
                    let _ = tx.send(Err(e.into())).await;
                }
            }
            .instrument(tracing::Span::current()),
        );
        Ok(ReceiverStream::new(rx))
    }

    /// Holds `plan`'s reservation (its prompt of `original` tokens plus max_tokens) to what
    /// this node's pool can ever give one request of its class ([`Admission::most_blocks`]):
    /// max_tokens is cut to what fits, and the generation stops at the pool's end with finish
    /// reason `length`, as llama-server stops at its context's end, instead of waiting for
    /// room that never comes. The admitted frame tells the router the max_tokens admitted, so
    /// that a failover asks for no more. A prompt that leaves no room for one token is refused.
    /// Returns the max_tokens asked where it was cut.
    fn fit_pool(&self, plan: &mut Plan, original: usize) -> Result<Option<usize>> {
        let most = self.admission.most_blocks(plan.class) * tandem_engine::BLOCK_TOKENS;
        if original + plan.params.max_tokens <= most {
            return Ok(None);
        }
        let of_class = if plan.class == tandem_proto::policy::Class::Batch {
            " of the batch class"
        } else {
            ""
        };
        if plan.prompt.len() >= most {
            return Err(Error::InvalidArgument {
                field: "prompt_token_ids",
                reason: format!(
                    "a prompt of {} tokens leaves no room to generate in the {most} tokens of KV \
                     this decode node holds for one request{of_class}",
                    plan.prompt.len()
                ),
            });
        }
        // The prompt holds the resumed tokens, so the cut leaves room for one more.
        let cut = most - original;
        let asked = std::mem::replace(&mut plan.params.max_tokens, cut);
        plan.params.min_tokens = plan.params.min_tokens.min(cut);
        Ok(Some(asked))
    }

    /// A fresh ticket for the scheduler, whose sequence the guard cancels unless it finished.
    fn sequence(&self) -> SequenceGuard {
        SequenceGuard {
            scheduler: self.scheduler.clone(),
            ticket: Ticket(self.next_ticket.fetch_add(1, Ordering::Relaxed)),
            finished: false,
        }
    }

    /// The KV of the prompt's first tokens from the peer the router named
    /// (`DecodeRequest.fetch_addr`), where the cache is on; `None` when there is none to fetch
    /// or the fetch failed (its tokens are then computed).
    async fn fetch_history(&self, plan: &Plan) -> Option<tandem_engine::KvExport> {
        let (addr, tokens) = plan.fetch.as_ref().filter(|_| self.prefix_cache)?;
        let asked = (*tokens).min(plan.hashes.len() * tandem_engine::BLOCK_TOKENS);
        let prompt = &plan.prompt[..asked];
        (self.moves)
            .fetch(addr, &plan.request_id, &plan.cache_salt, prompt)
            .await
    }

    /// Reserves `transfer_id`'s push of the KV of `prompt[cached..]`: what a prefill node must
    /// bring.
    fn reserve_push(
        &self,
        transfer_id: &str,
        prompt: &[u32],
        cached: usize,
    ) -> Result<(ReservationGuard, Delivery)> {
        let n = prompt.len();
        let layout = tandem_worker::wire_layout(self.kv_layout);
        let want = Expectation {
            fingerprint: self.model.fingerprint.0,
            layout,
            tokens: cached as u32..n as u32,
            token_ids: prompt[cached..].to_vec(),
            max_bytes: layout.total_bytes(n - cached),
        };
        Ok(self.reservations.reserve(transfer_id, want)?)
    }

    /// The pushed KV as the scheduler's input, its first token checked.
    fn pushed_input(&self, received: ReceivedKv) -> Result<Input> {
        let first_token = received.first_token;
        self.model
            .config
            .check_token_ids("first_token", &[first_token])?;
        let first_logprobs = received
            .first_logprobs
            .as_ref()
            .map(tandem_worker::logprobs_from_pb);
        Ok(Input::Kv {
            kv: tandem_worker::kv_export(self.kv_layout, received),
            first_token,
            first_logprobs,
        })
    }

    async fn run(
        &self,
        plan: Plan,
        stream: Stream,
        _admitted: Admitted,
        tx: &mpsc::Sender<Result<pb::DecodeResponse, Status>>,
    ) -> Result<()> {
        let admitted_at = Instant::now();
        let deadline = plan.deadline;
        let until_deadline = until(deadline);
        tokio::pin!(until_deadline);
        // A last-resort stream is finished here whatever the drain; any other hands off.
        let draining = until_drain(plan.last_resort, self.moves.draining.clone());
        tokio::pin!(draining);
        let mut guard = self.sequence();
        let ticket = guard.ticket;
        let fetch_started = Instant::now();
        let fetched = tokio::select! {
            // A request that fetches nothing goes on at once.
            biased;
            kv = self.fetch_history(&plan) => kv,
            () = tx.closed() => return Ok(()),
            () = &mut until_deadline => return Err(Error::Deadline),
            () = &mut draining => return Err(Error::HandedOff { tokens: 0 }),
        };
        let fetch_ms = fetch_started.elapsed().as_secs_f64() * 1e3;
        let fetched_tokens = fetched.as_ref().map_or(0, |kv| kv.tokens.end);
        let fetched_bytes = fetched
            .as_ref()
            .map_or(0, tandem_engine::KvExport::byte_len);
        if plan.last_resort {
            // What this node kept of the stream when it handed it off is used here again: the
            // drain no longer waits for a peer to fetch it.
            self.moves.taken_back(&plan.hashes);
        }
        let reused = self
            .scheduler
            .open(ticket, plan.hashes, fetched)
            .await
            .ok_or(Error::ShuttingDown)?;
        let cached = reused.tokens;
        // What the lookup found of the fetched tokens counts as fetched, the rest as cached.
        let fetched_tokens = fetched_tokens.min(cached);
        let m = &self.shared.metrics;
        m.cached_tokens.inc_by((cached - fetched_tokens) as u64);
        m.fetched_tokens.inc_by(fetched_tokens as u64);
        // With a local prefill nothing is pushed; otherwise the push must bring [cached, n).
        let reservation = if plan.local_prefill {
            None
        } else {
            Some(self.reserve_push(&plan.transfer_id, &plan.prompt, cached)?)
        };
        let admitted = pb::DecodeAdmitted {
            cached_tokens: cached as u32,
            fetched_tokens: fetched_tokens as u32,
            fetch_ms: if plan.fetch.is_some() { fetch_ms } else { 0.0 },
            fetched_bytes,
            restored_tokens: reused.restored as u32,
            max_tokens: plan.params.max_tokens as u32,
        };
        let event = pb::decode_response::Event::Admitted(admitted);
        let frame = pb::DecodeResponse { event: Some(event) };
        if tx.send(Ok(frame)).await.is_err() {
            return Ok(());
        }

        let input = match reservation {
            None => Input::Local,
            Some((lease, delivery)) => {
                let kv_wait = plan.kv_wait.unwrap_or(self.kv_wait);
                let received = tokio::select! {
                    r = wait_kv(&lease, delivery, kv_wait) => r?,
                    () = tx.closed() => return Ok(()),
                    () = &mut until_deadline => return Err(Error::Deadline),
                    // Nothing generated yet: another node serves it from the start.
                    () = &mut draining => return Err(Error::HandedOff { tokens: 0 }),
                };
                drop(lease);
                self.pushed_input(received)?
            }
        };
        let kv_wait_ms = admitted_at.elapsed().as_secs_f64() * 1e3;
        // The channel holds a whole generation, so a slow client never blocks a step.
        let (events, mut events_rx) = mpsc::channel(plan.params.max_tokens + 3);
        let joining = Joining {
            ticket,
            prompt: plan.prompt,
            cache_salt: plan.cache_salt,
            class: plan.class,
            stream,
            events,
        };
        if !self.scheduler.start(Start { input, joining }) {
            return Err(Error::ShuttingDown);
        }

        let mut completion_tokens = plan.resumed as u32;
        let mut local_prefill_ms = 0.0;
        let mut first = true;
        // Once the drain begins: the scheduler's answer, the tokens of KV kept for a peer.
        let mut handoff = None;
        loop {
            let event = tokio::select! {
                e = events_rx.recv() => e,
                () = tx.closed() => return Ok(()),
                () = &mut until_deadline => return Err(Error::Deadline),
                () = self.shutdown.cancelled() => return Err(Error::ShuttingDown),
                // The scheduler stops the sequence between steps; the frames of the steps
                // before still come, then the event channel closes.
                () = &mut draining, if handoff.is_none() => {
                    handoff = Some(self.scheduler.hand_off(ticket));
                    continue;
                }
            };
            let (emissions, drafted, accepted) = match event {
                Some(Event::Prefilled { ms }) => {
                    local_prefill_ms = ms;
                    continue;
                }
                Some(Event::Tokens {
                    emissions,
                    drafted,
                    accepted,
                }) => (emissions, drafted, accepted),
                Some(Event::Failed(e)) => {
                    guard.finished = true;
                    return Err(Error::Step(e));
                }
                None => return Err(closed(handoff)),
            };
            let last = emissions.last().and_then(|e| e.finished);
            let timings = first.then_some((kv_wait_ms, local_prefill_ms));
            let frame = tokens_frame(
                emissions,
                &mut completion_tokens,
                timings,
                (drafted, accepted),
            );
            first = false;
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

/// One step's emissions as a `DecodeTokens` frame, at the index `completion_tokens` counts to
/// (which it then counts on): with the first frame's `timings` (KV wait, local prefill ms),
/// and, on the last, the speculation totals so far (drafted, accepted).
fn tokens_frame(
    emissions: Vec<Emission>,
    completion_tokens: &mut u32,
    timings: Option<(f64, f64)>,
    (drafted, accepted): (u64, u64),
) -> pb::DecodeResponse {
    let index = *completion_tokens;
    let last = emissions.last().and_then(|e| e.finished);
    let mut token_ids = Vec::with_capacity(emissions.len());
    let mut logprobs = Vec::new();
    let mut text = String::new();
    for e in emissions {
        token_ids.extend(e.token);
        if e.token.is_some() {
            logprobs.extend(e.logprobs.as_ref().map(tandem_worker::logprobs_to_pb));
        }
        text.push_str(&e.text);
    }
    *completion_tokens += token_ids.len() as u32;
    let (kv_wait_ms, local_prefill_ms) = timings.unwrap_or_default();
    let (drafted, accepted) = if last.is_some() {
        (drafted, accepted)
    } else {
        (0, 0)
    };
    let frame = pb::DecodeTokens {
        index,
        token_ids,
        text,
        finish_reason: last.map_or(pb::FinishReason::Unspecified, finish_reason) as i32,
        completion_tokens: if last.is_some() {
            *completion_tokens
        } else {
            0
        },
        kv_wait_ms,
        local_prefill_ms,
        draft_tokens: drafted as u32,
        accepted_draft_tokens: accepted as u32,
        logprobs,
    };
    pb::DecodeResponse {
        event: Some(pb::decode_response::Event::Tokens(frame)),
    }
}

/// Completes at `deadline`, or never without one.
async fn until(deadline: Option<TokioInstant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Completes when the node's drain begins (`draining`), or never for a `last_resort` stream,
/// which is finished here whatever the drain.
async fn until_drain(last_resort: bool, draining: CancellationToken) {
    if last_resort {
        std::future::pending().await
    } else {
        draining.cancelled().await
    }
}

/// Why a sequence's events ended before its last token: handed off, if the scheduler kept KV
/// for a peer when the drain asked (`handoff`; it answers before it closes the channel), else
/// shut down.
fn closed(handoff: Option<tokio::sync::oneshot::Receiver<usize>>) -> Error {
    let kept = handoff.and_then(|mut r| r.try_recv().ok()).unwrap_or(0);
    if kept > 0 {
        Error::HandedOff { tokens: kept }
    } else {
        Error::ShuttingDown
    }
}
