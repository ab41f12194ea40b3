//! One generation through the cluster: its choices, each attempted until one attempt
//! finishes it, and an attempt itself: admitted on a decode node ([`crate::dispatch::admit`]),
//! prefilled remotely beside the decode stream or locally on the decode node, its decode frames
//! relayed into the choice's stream, the last completed with usage, timings and route.
//!
//! ```text
//! request ─▶ tokens, block hashes ─▶ policy: D (+ P) ─▶ D.Generate ──admitted{cached}──▶ P.Prefill(dest = D)
//!                                                          │ tokens ◀── (KV pushed P ─▶ D) ──┘
//!                                                          ▼  (local: D computes the suffix itself)
//!                                          LogWriter (frames, shared by attached client streams)
//! ```

use std::time::{Duration, Instant};

use tandem_proto::v1 as pb;
use tokio::time::Instant as TokioInstant;
use tonic::Status;
use tracing::Instrument;
use tracing::field::Empty;

use crate::cluster::policy::Choice;
use crate::cluster::replica::Replica;
use crate::cluster::sessions::Turn;
use crate::dispatch::admit::Admission;
use crate::dispatch::dispatcher::{Dispatcher, Outcome};
use crate::dispatch::log::LogWriter;
use crate::dispatch::prepare::Prepared;
use crate::dispatch::progress::{Arrival, Ending, Failure, Progress, deadline_error, ms};
use crate::dispatch::remote::{
    RemotePrefill, decode_failure, prefill_call, prefill_request, upstream_of,
};
use crate::error::{Error, Result};

impl Dispatcher {
    /// Runs the generation, appending frames to `log`, until it ends, `deadline` passes, or
    /// every client stream is gone. Returns how it ended, for the metrics and the key's limits.
    pub async fn run(
        &self,
        p: Prepared,
        accepted: Instant,
        deadline: TokioInstant,
        log: &LogWriter,
    ) -> Outcome {
        // Each choice is a stream that may fail over: each earns its share of the budget.
        let carried = self.replicas.all().iter().map(|r| r.inflight()).max();
        for _ in 0..p.choices {
            self.budget.deposit(carried.unwrap_or(0));
        }
        let mut progress: Vec<Progress> = (0..p.choices)
            .map(|choice| Progress {
                choice,
                ..Progress::default()
            })
            .collect();
        let dispatched = self.dispatch_choices(&p, &mut progress, accepted, deadline, log);
        let outcome = tokio::select! {
            r = tokio::time::timeout_at(deadline, dispatched) => {
                match r {
                    // A downstream call may lose the race against its own copy of the deadline
                    // (tonic reports that as CANCELLED): past the deadline, it is the deadline.
                    Ok(Err(_)) if TokioInstant::now() >= deadline => Err(Error::Deadline),
                    r => r.unwrap_or(Err(Error::Deadline)),
                }
            }
            () = log.abandoned() => Err(Error::Downstream {
                hop: "client",
                code: tonic::Code::Cancelled,
                message: "the client went away".into(),
            }),
        };
        // Where the request waited when its deadline passed is known once the dispatch is over.
        let outcome = match outcome {
            Err(Error::Deadline) => {
                let e = deadline_error(&progress);
                if let Error::QueueTimeout {
                    waited,
                    waiting_for,
                } = &e
                {
                    self.metrics.queue_timeouts.inc();
                    tracing::info!(
                        waited_ms = waited.as_millis() as u64,
                        waiting_for,
                        "deadline passed in the router's queue"
                    );
                }
                Err(e)
            }
            outcome => outcome,
        };
        let generated = progress.iter().map(|p| p.generated.len()).sum();
        let code = match outcome {
            Ok(()) => tonic::Code::Ok,
            Err(e) => {
                let code = e.code();
                if code == tonic::Code::Unavailable || code == tonic::Code::DataLoss {
                    // The cluster failed the request (the client's own errors are its to see).
                    tracing::warn!(
                        error = %e,
                        attempts = progress.iter().map(|p| p.attempts).sum::<u32>(),
                        delivered = generated,
                        "generation failed"
                    );
                }
                log.push(Err(Status::from(e)));
                code
            }
        };
        Outcome { code, generated }
    }

    /// Runs every choice of the request, each with its own attempts. The first runs at once;
    /// the others start once its first frame is out, when its prompt's KV is on its decode node
    /// and in that node's cache (see the decode scheduler's `join`), so that they reuse it
    /// rather than compute the prompt again. A choice that fails for good fails the request.
    async fn dispatch_choices(
        &self,
        p: &Prepared,
        progress: &mut [Progress],
        accepted: Instant,
        deadline: TokioInstant,
        log: &LogWriter,
    ) -> Result<()> {
        let Some((first, others)) = progress.split_first_mut() else {
            return Ok(());
        };
        let first = self.dispatch(p, first, accepted, deadline, log);
        if others.is_empty() {
            return first.await;
        }
        let others = async {
            log.first_frame().await;
            let each = others
                .iter_mut()
                .map(|progress| self.dispatch(p, progress, accepted, deadline, log));
            futures::future::try_join_all(each).await
        };
        futures::future::try_join(first, others).await.map(drop)
    }

    /// Attempts the generation until one attempt finishes it. A replica that fails is avoided
    /// from then on, and the next attempt resumes after the tokens already delivered, on at
    /// most [`MAX_ATTEMPTS`] attempts and within the retry budget.
    async fn dispatch(
        &self,
        p: &Prepared,
        progress: &mut Progress,
        accepted: Instant,
        deadline: TokioInstant,
        log: &LogWriter,
    ) -> Result<()> {
        loop {
            progress.attempts += 1;
            self.metrics.attempts.inc();
            // One span an attempt (failovers and hand-offs are later attempts), with the
            // replicas chosen and, on the attempt that saw it, the time to the first token.
            // Each of the router's spans names the request, as log lines show their innermost.
            let span = tracing::info_span!(
                "attempt",
                request_id = %p.request_id,
                attempt = progress.attempts,
                choice = progress.choice,
                failover = progress.attempts > 1,
                decode = Empty,
                prefill = Empty,
                "gen_ai.server.time_to_first_token" = Empty,
            );
            let attempt = self.attempt(p, progress, accepted, deadline, log);
            let failure = match attempt.instrument(span).await {
                Ok(()) => return Ok(()),
                Err(f) => f,
            };
            if !progress.retry(&failure, &self.budget) {
                return Err(failure.error);
            }
            if failure.handoff.is_some() {
                self.metrics.handoffs.inc();
            } else {
                self.metrics.failover(match &failure.error {
                    Error::Downstream { hop, .. } => hop,
                    _ => "router",
                });
            }
            tracing::warn!(
                request_id = %p.request_id,
                choice = progress.choice,
                error = %failure.error,
                suspects = ?failure.suspects,
                delivered = progress.generated.len(),
                "attempt failed; resuming the generation elsewhere"
            );
        }
    }

    /// One attempt: choose replicas and admit on decode ([`Dispatcher::admit`]), prefill
    /// remotely beside the decode stream or let the decode node prefill locally, and relay the
    /// decode frames into the choice's stream ([`Progress::relay`]) until its last frame, which
    /// gets the attempt's usage, timings and route ([`Progress::finish`]).
    async fn attempt(
        &self,
        p: &Prepared,
        progress: &mut Progress,
        accepted: Instant,
        deadline: TokioInstant,
        log: &LogWriter,
    ) -> Result<(), Failure> {
        let (tokens, hashes) = p.prompt_after(&progress.generated);
        let Admission {
            choice,
            mut frames,
            admitted,
            transfer_id,
            queue_ms,
            chosen_ms,
        } = self
            .admit(p, &tokens, &hashes, progress, accepted, deadline)
            .instrument(tracing::info_span!("admission", request_id = %p.request_id))
            .await?;
        let Choice {
            decode,
            prefill,
            decode_overlap,
            prefill_overlap,
            reason,
            fetch,
            est_ms,
            borrowed_ms,
            pipeline,
        } = choice;
        let decode_cached = admitted.cached_tokens;
        // A node that does not say (0) admitted what was asked; `sampling_of` holds a later
        // attempt to the smaller of the two.
        if admitted.max_tokens > 0 {
            progress.max_tokens = Some(admitted.max_tokens);
        }
        let local = prefill.is_none();
        let d_addr = decode.replica().addr.clone();
        let on_decode = |s: &Status| Failure::on_decode(&d_addr, s);
        let p_addr = prefill.as_ref().map(|g| g.replica().addr.clone());
        record_replicas(&d_addr, p_addr.as_deref());
        let stages = upstream_of(&pipeline);
        let prefill = prefill.map(|guard| {
            let request =
                prefill_request(p, progress, &tokens, transfer_id, decode_cached, &d_addr);
            RemotePrefill::new(guard, pipeline, request)
        });
        let prefill_call = prefill_call(&p.request_id, prefill, deadline);
        // Remote: the prefill call runs beside the decode stream, and ends once the KV is
        // pushed. Local: it answers `None` at once.
        tokio::pin!(prefill_call);
        let uncached = tokens.len().saturating_sub(decode_cached as usize);
        let mut prefilled: Option<Option<pb::PrefillResponse>> = None;
        let mut frames_here = 0usize;
        let mut local_prefill_ms = 0.0;
        loop {
            let waiting_for_push = !local && prefilled.is_none();
            // The first frame of a local attempt follows a local prefill of the uncached suffix.
            let prefilling = (frames_here == 0 && local).then_some(uncached);
            let bound = self.frame_bound(waiting_for_push, prefilling, decode.replica());
            let next = async {
                match bound {
                    Some(b) => self.next_frame(&mut frames, b, decode.replica()).await,
                    None => frames.message().await,
                }
            };
            let msg = tokio::select! {
                r = &mut prefill_call, if prefilled.is_none() => {
                    prefilled = Some(r?);
                    continue;
                }
                m = next => m,
            };
            let msg = match msg {
                Ok(msg) => msg,
                Err(s) => {
                    let pending = waiting_for_push.then_some(prefill_call.as_mut());
                    let sender = p_addr.as_deref();
                    return Err(decode_failure(&s, &d_addr, sender, &stages, pending).await);
                }
            };
            let Some(pb::DecodeResponse {
                event: Some(pb::decode_response::Event::Tokens(t)),
            }) = msg
            else {
                return Err(on_decode(&Status::unavailable(
                    "the decode stream ended without a final frame",
                )));
            };
            if frames_here == 0 {
                local_prefill_ms = t.local_prefill_ms;
            }
            frames_here += 1;
            let (mut frame, arrival) = progress
                .relay(t, p.tokens.len(), accepted)
                .map_err(|s| on_decode(&s))?;
            self.record_arrival(p, progress.choice, arrival);
            if !crate::dispatch::log::is_last(&frame) {
                log.push(Ok(frame));
                continue;
            }
            // The KV arrived, so the prefill has answered or is about to.
            if prefilled.is_none() {
                prefilled = Some((&mut prefill_call).await?);
            }
            let prefill = prefilled.flatten();
            // What the attempt's prompt cost in compute: neither cached nor fetched.
            let computed = prefill
                .as_ref()
                .map_or(uncached, |r| r.computed_tokens as usize);
            self.metrics.computed_tokens.inc_by(computed as u64);
            let restored =
                admitted.restored_tokens + prefill.as_ref().map_or(0, |r| r.restored_tokens);
            progress.finish(
                &mut frame,
                &p.tokens,
                Ending {
                    decode_cached,
                    prefill,
                    local_prefill_ms,
                    queue_ms,
                    total_ms: ms(accepted),
                    route: pb::Route {
                        prefill: p_addr.clone().unwrap_or_default(),
                        decode: d_addr.clone(),
                        reason,
                        prefill_overlap_tokens: prefill_overlap as u32,
                        decode_overlap_tokens: decode_overlap as u32,
                        disaggregation: if local { "local" } else { "remote" }.into(),
                        fetched_from: fetch.map(|f| f.0).unwrap_or_default(),
                        fetched_tokens: admitted.fetched_tokens,
                        pipeline: stages,
                        ..Default::default()
                    },
                    fetch_ms: admitted.fetch_ms,
                },
            );
            let estimate = est_ms
                .filter(|_| borrowed_ms == 0.0)
                .map(|e| (e, chosen_ms));
            self.record_ending(p, progress, &frame, local, estimate, restored);
            log.push(Ok(frame));
            return Ok(());
        }
    }

    /// How long the decode stream may be silent before its node is looked at: unbounded while
    /// the KV is pushed (the decode node bounds KV silence itself, kv_wait, and the prefill
    /// call ends with the push), the token gap plus twice the estimated time of a local prefill
    /// of `prefilling` tokens before the first frame, else the token gap.
    fn frame_bound(
        &self,
        waiting_for_push: bool,
        prefilling: Option<usize>,
        decode: &Replica,
    ) -> Option<Duration> {
        if waiting_for_push {
            return None;
        }
        Some(match prefilling {
            Some(uncached) => {
                let rate = decode.prefill_rate_or(crate::cluster::policy::DEFAULT_RATE);
                self.token_gap + Duration::from_secs_f64(2.0 * uncached as f64 / rate)
            }
            None => self.token_gap,
        })
    }

    /// A frame's arrival in the latency metrics: the request's time to first token is its
    /// first choice's.
    fn record_arrival(&self, p: &Prepared, choice: u32, arrival: Arrival) {
        match arrival {
            Arrival::First(ttft_ms) if choice == 0 => {
                self.metrics.ttft.observe(ttft_ms / 1e3);
                self.metrics.model_first_token(&p.model, ttft_ms / 1e3);
                tracing::Span::current().record("gen_ai.server.time_to_first_token", ttft_ms / 1e3);
            }
            Arrival::First(_) => {}
            Arrival::After(gap) => self.metrics.inter_token.observe(gap.as_secs_f64()),
        }
    }

    /// What a choice's last frame teaches: on a first attempt, the hand-off (what the first
    /// token took beyond the queues and the compute) and how far the choice's `estimate` (its
    /// estimate and when it was chosen, ms; none where it borrowed from another request's time)
    /// was off; on the first choice, the request's prompt
    /// tokens (counted once) and its session's turn.
    fn record_ending(
        &self,
        p: &Prepared,
        progress: &Progress,
        frame: &pb::GenerateResponse,
        local: bool,
        estimate: Option<(f64, f64)>,
        restored: u32,
    ) {
        let t = frame.timings.unwrap_or_default();
        tracing::debug!(
            class = ?p.class,
            attempts = progress.attempts,
            local,
            queue_ms = t.queue_ms,
            prefill_wait_ms = t.prefill_wait_ms,
            prefill_ms = t.prefill_ms,
            transfer_ms = t.transfer_ms,
            fetch_ms = t.fetch_ms,
            first_token_ms = t.first_token_ms,
            total_ms = t.total_ms,
            "request phases"
        );
        if progress.attempts == 1 {
            let waited = t.queue_ms + t.prefill_wait_ms + t.prefill_ms;
            (self.policy).record_handoff(local, p.class, t.first_token_ms - waited);
            if let Some((est_ms, chosen_ms)) = estimate {
                let actual_ms = t.first_token_ms - chosen_ms;
                tracing::debug!(est_ms, actual_ms, "time to first token from the choice");
                (self.calibration).record(p.class, actual_ms, est_ms);
            }
        }
        if progress.choice == 0 {
            let cached = frame.usage.map_or(0, |u| u.cached_tokens);
            self.metrics.prompt_tokens.inc_by(p.tokens.len() as u64);
            self.metrics.cached_prompt_tokens.inc_by(u64::from(cached));
            (self.metrics).model_prompt(&p.model, p.tokens.len() as u64, cached.into());
            self.end_turn(p, &progress.generated, cached, restored);
        }
    }

    /// Records a session's completed turn ([`crate::cluster::sessions`]); a session its key had
    /// to end for it is released.
    fn end_turn(&self, p: &Prepared, reply: &[u32], cached: u32, restored: u32) {
        if p.session_id.is_empty() {
            return;
        }
        let ended = self.sessions.turn(Turn {
            tenant: &p.tenant,
            session_id: &p.session_id,
            cache_salt: &p.cache_salt,
            prompt: &p.tokens,
            reply,
            cached: cached as usize,
            restored: restored.min(cached) as usize,
        });
        if let Some(action) = ended {
            let (sessions, replicas) = (self.sessions.clone(), self.replicas.clone());
            tokio::spawn(async move { sessions.send(&replicas, action).await });
        }
    }
}

/// Names the attempt's replicas on its span: the decode node's address, and the prefill
/// node's or `local`.
fn record_replicas(decode: &str, prefill: Option<&str>) {
    let span = tracing::Span::current();
    span.record("decode", decode);
    span.record("prefill", prefill.unwrap_or("local"));
}
