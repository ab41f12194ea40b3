//! Admission: a request waits in the router's queue until a decode replica it may use has
//! room, then the policy chooses its replicas (or, for a handed-off stream no decode node
//! outside a drain can take, the last resort) and the decode node admits it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_proto::policy::Class;
use tandem_proto::v1 as pb;
use tokio::time::Instant as TokioInstant;
use tonic::Status;

use crate::cluster::policy::{Ask, Choice};
use crate::cluster::replica::{Replica, Role};
use crate::dispatch::dispatcher::Dispatcher;
use crate::dispatch::order::Asker;
use crate::dispatch::prepare::Prepared;
use crate::dispatch::progress::{Failure, Progress, ms};
use crate::dispatch::queue::Queued;
use crate::error::Error;
use crate::metrics::DecisionLabel;

/// A request a decode node admitted: the replicas chosen, the decode stream (its `admitted`
/// frame read), and what the admission said.
#[derive(Debug)]
pub(crate) struct Admission {
    pub choice: Choice,
    pub frames: tonic::Streaming<pb::DecodeResponse>,
    /// The decode node's admission: what it held, and what it fetched.
    pub admitted: pb::DecodeAdmitted,
    pub transfer_id: String,
    /// From the request's acceptance to its admission, in ms.
    pub queue_ms: f64,
    /// From the request's acceptance to the choice, in ms.
    pub chosen_ms: f64,
}

/// A request's time-to-first-token target, counted from its acceptance.
#[derive(Clone, Copy, Debug)]
struct Target {
    target: Duration,
    accepted: Instant,
}

impl Target {
    /// Refuses the request (RESOURCE_EXHAUSTED, counted as `ttft_target`) if `more` from now
    /// misses the target.
    fn check(self, d: &Dispatcher, more: Duration) -> Result<(), Failure> {
        let predicted = self.accepted.elapsed() + more;
        if predicted <= self.target {
            return Ok(());
        }
        d.metrics.refused("ttft_target");
        Err(Error::TtftTarget {
            predicted,
            target: self.target,
        }
        .into())
    }
}

impl Dispatcher {
    /// Puts the request in the router's queue, unless `queued` says it is there already. A
    /// request not yet started whose deadline the predicted wait would outlast is refused
    /// instead, at once (RESOURCE_EXHAUSTED, with that wait as its retry pushback), and so is
    /// one whose TTFT target ([`Target`]) the wait alone would miss; a failover is never
    /// refused, its stream has begun. `progress` says from then on since when the request
    /// waits and for what (`waiting_for`): a deadline that passes before its admission is the
    /// queue's ([`crate::dispatch::progress::deadline_error`]).
    fn enqueue(
        &self,
        queued: &mut Option<Queued>,
        progress: &mut Progress,
        deadline: TokioInstant,
        target: Option<Target>,
        asker: &Asker,
        waiting_for: &'static str,
    ) -> Result<(), Failure> {
        if let Some(q) = queued {
            progress.queued = Some((q.since, waiting_for));
            return Ok(());
        }
        let ahead = self.metrics.queued.get().max(0) as usize;
        let left = deadline.saturating_duration_since(TokioInstant::now());
        if progress.attempts == 1
            && let Some(wait) = self.pace.predict(ahead)
        {
            if wait > left {
                self.metrics.refused("deadline");
                return Err(Error::QueueTooLong { ahead, wait, left }.into());
            }
            if let Some(t) = target {
                t.check(self, wait)?;
            }
        }
        self.metrics.queued.inc();
        let since = TokioInstant::now();
        *queued = Some(Queued {
            gauge: self.metrics.queued.clone(),
            ahead,
            since,
            ticket: (progress.attempts == 1).then(|| self.order.join(asker.clone())),
        });
        progress.queued = Some((since, waiting_for));
        Ok(())
    }

    /// The decode stream's next message. Silence longer than `gap` fails the attempt only when
    /// the node has also stopped serving (its health watch ended or reports NOT_SERVING): a busy
    /// node is slow, not dead, and its streams wait for it up to the request's deadline. A node
    /// that dies breaks the connection, which ends the stream at once, and one that stops
    /// answering HTTP/2 pings loses it within the keepalive bound.
    pub(crate) async fn next_frame(
        &self,
        frames: &mut tonic::Streaming<pb::DecodeResponse>,
        gap: Duration,
        replica: &Replica,
    ) -> Result<Option<pb::DecodeResponse>, Status> {
        let mut quiet = Duration::ZERO;
        loop {
            match tokio::time::timeout(gap, frames.message()).await {
                Ok(message) => return message,
                Err(_) if replica.is_up() => {
                    if quiet.is_zero() {
                        self.metrics.decode_stalls.inc();
                        tracing::info!(
                            replica = %replica.addr,
                            gap_ms = gap.as_millis() as u64,
                            "decode node busy: no frame within the token gap, still waiting"
                        );
                    }
                    quiet += gap;
                }
                Err(_) => {
                    return Err(Status::unavailable(format!(
                        "no frame for {} ms and the node stopped serving",
                        (quiet + gap).as_millis()
                    )));
                }
            }
        }
    }

    /// Where a handed-off stream goes when no decode replica outside a drain may take it
    /// (`decodes` is empty): back to the draining node that holds its KV, or else to any
    /// draining decode node, which finishes it within its grace ([`pb::DecodeRequest`]'s
    /// `last_resort`) instead of failing it. `None` for a stream that was not handed off, or
    /// while a decode replica is up.
    fn last_resort(
        &self,
        decodes: &[Arc<Replica>],
        progress: &Progress,
        model: &str,
        tokens: usize,
        class: Class,
    ) -> Option<Choice> {
        if !decodes.is_empty() {
            return None;
        }
        let (holder, kept) = progress.holder.as_ref()?;
        let all = self.replicas.all();
        let decode = |r: &&Arc<Replica>| r.role == Role::Decode && r.serves(model);
        // The holder is tried whatever its health says: it told this stream it drains, and a
        // loaded node's health check may time out meanwhile. One that is gone fails the
        // attempt at once.
        let (replica, held) = match all.iter().filter(decode).find(|r| &r.addr == holder) {
            Some(r) => (r, *kept),
            None => (all.iter().filter(decode).find(|r| r.is_draining())?, 0),
        };
        tracing::info!(
            choice = progress.choice,
            decode = %replica.addr,
            held,
            "no decode node outside a drain: the stream goes back to a draining one"
        );
        self.metrics.last_resort.inc();
        Some(Choice {
            decode: replica.claim(tokens as u64, class),
            prefill: None,
            decode_overlap: held,
            prefill_overlap: 0,
            reason: "last resort: every decode node drains".into(),
            fetch: None,
            est_ms: None,
            borrowed_ms: 0.0,
            pipeline: Vec::new(),
        })
    }

    /// Refuses at once a request of `class` whose TTFT target the chosen option's estimate
    /// misses (the cheapest option the policy found, so no other meets it either), the
    /// estimate corrected by its measured error ([`crate::dispatch::calibration`]). An estimate
    /// whose hand-off is borrowed from another class is checked without it (and uncorrected):
    /// only a request that its queue and compute alone make miss is refused, and the rest get
    /// through to measure their class's own. Where the chosen workers' load reports are stale
    /// the estimate is not trusted: the request is admitted (fail open) and
    /// [`crate::metrics::TTFT_FAIL_OPEN`] says so.
    fn meets_target(&self, choice: &Choice, class: Class, target: Target) -> Result<(), Failure> {
        let Some(est_ms) = choice.est_ms else {
            return Ok(());
        };
        let stale = !choice.reported_within(self.replicas.stale_after());
        self.metrics.ttft_fail_open.set(i64::from(stale));
        if stale {
            tracing::warn!(
                decode = %choice.decode.replica().addr,
                "stale load reports: a TTFT target admitted unchecked (fail open)"
            );
            return Ok(());
        }
        let correction_ms = if choice.borrowed_ms > 0.0 {
            -choice.borrowed_ms
        } else {
            self.calibration.correction_ms(class)
        };
        let more_ms = (est_ms + correction_ms).max(0.0);
        let checked = target.check(self, Duration::from_secs_f64(more_ms / 1e3));
        if checked.is_err() {
            tracing::debug!(
                reason = %choice.reason,
                correction_ms,
                "a TTFT target the estimate misses"
            );
        }
        checked
    }

    /// The policy's choice for `ask`, its time observed.
    fn choose(&self, ask: &Ask<'_>) -> crate::error::Result<Choice> {
        let started = std::time::Instant::now();
        let choice = self.policy.choose(&self.replicas, ask);
        self.metrics.route.observe(started.elapsed().as_secs_f64());
        choice
    }

    /// The decode call of an attempt on `choice` (a `last_resort` one is finished there
    /// whatever its node's drain).
    fn decode_request(
        &self,
        p: &Prepared,
        progress: &Progress,
        tokens: &[u32],
        choice: &Choice,
        transfer_id: &str,
        last_resort: bool,
    ) -> pb::DecodeRequest {
        pb::DecodeRequest {
            request_id: p.request_id.clone(),
            transfer_id: transfer_id.to_string(),
            prompt_token_ids: tokens.to_vec(),
            sampling: Some(p.sampling_of(progress.choice, progress.max_tokens)),
            // A prompt queued on the prefill node is not silence: its push sends keepalives.
            kv_wait_ms: u32::try_from(self.kv_wait.as_millis()).unwrap_or(u32::MAX),
            local_prefill: choice.prefill.is_none(),
            resumed_tokens: progress.generated.len() as u32,
            cache_salt: p.cache_salt.clone(),
            fetch_addr: choice
                .fetch
                .as_ref()
                .map_or_else(String::new, |f| f.0.clone()),
            fetch_tokens: choice.fetch.as_ref().map_or(0, |f| f.1 as u32),
            last_resort,
            priority: p.class.to_pb() as i32,
        }
    }

    /// What a decode node's admission of `choice` costs and teaches: the tenant's share is
    /// charged the prompt, a peer fetch's speed is recorded, and the disaggregation decision
    /// counted.
    fn record_admitted(
        &self,
        p: &Prepared,
        prompt_tokens: usize,
        choice: &Choice,
        a: &pb::DecodeAdmitted,
    ) {
        self.charge(&p.tenant, p.weight, prompt_tokens as u64);
        if choice.fetch.is_some() {
            self.policy.record_fetch(a.fetched_bytes, a.fetch_ms);
            self.metrics
                .fetched_tokens
                .inc_by(u64::from(a.fetched_tokens));
        }
        let decision = if choice.prefill.is_none() {
            "local"
        } else {
            "remote"
        };
        self.metrics
            .disagg_decisions
            .get_or_create(&DecisionLabel { decision })
            .inc();
    }

    /// Waits in the router's queue until a decode replica this request may use has room
    /// ([`crate::cluster::replica::Replica::has_room`]), and the chosen prefill replica too when
    /// the prompt goes to one, then chooses replicas and has the decode node admit the request.
    /// A node that refuses for capacity after all (other routers' requests, its KV blocks)
    /// sends the request back to the queue, never to the client (an empty decode node admits
    /// any request: it cuts a max_tokens its pool could never hold): it tries the decode nodes
    /// that have not refused it at once, and once every one has, waits for something to
    /// change.
    /// The request's deadline bounds the wait (past it the request ends naming the queue:
    /// [`crate::dispatch::progress::deadline_error`]), and a request whose deadline the queue's
    /// predicted wait would outlast is refused at once ([`Dispatcher::enqueue`]). The queue
    /// itself is bounded by the router's `max_inflight`, past which requests are refused at
    /// once.
    pub(crate) async fn admit(
        &self,
        p: &Prepared,
        tokens: &[u32],
        hashes: &[u64],
        progress: &mut Progress,
        accepted: Instant,
        deadline: TokioInstant,
    ) -> Result<Admission, Failure> {
        let asker = Asker {
            model: p.model.as_str().into(),
            class: p.class,
            tenant: p.tenant.clone(),
        };
        let target = p.ttft_target.map(|target| Target { target, accepted });
        let mut queued: Option<Queued> = None;
        // Decode nodes that refused it for room since it last waited for a change.
        let mut refused: Vec<String> = Vec::new();
        loop {
            let exclude = [progress.exclude.as_slice(), refused.as_slice()].concat();
            let change = self.replicas.changed();
            tokio::pin!(change);
            change.as_mut().enable();
            let left = self.order.left();
            tokio::pin!(left);
            left.as_mut().enable();
            let ask = Ask {
                model: &p.model,
                tokens: tokens.len(),
                hashes,
                session_id: &p.session_id,
                exclude: &exclude,
                holder: progress.holder.as_ref().map(|(a, t)| (a.as_str(), *t)),
                class: p.class,
            };
            let decodes = crate::cluster::policy::candidates(&self.replicas, Role::Decode, &ask);
            if decodes.is_empty() && !refused.is_empty() {
                refused.clear();
                self.replicas.changed_or_polled().await;
                continue;
            }
            // A first attempt waits its turn in the admission order; a failover does not.
            let ticket = queued.as_ref().and_then(|q| q.ticket.as_ref());
            let turn = progress.attempts > 1 || self.order.is_first(&asker, ticket);
            // With none up, the policy answers at once.
            if !turn || (!decodes.is_empty() && !decodes.iter().any(|r| r.has_room())) {
                let waiting_for = if turn {
                    "a decode replica with room"
                } else {
                    "its turn in the admission order"
                };
                self.enqueue(&mut queued, progress, deadline, target, &asker, waiting_for)?;
                tokio::select! {
                    () = change => {}
                    () = left => {}
                }
                continue;
            }
            let last_resort = self.last_resort(&decodes, progress, &p.model, tokens.len(), p.class);
            let is_last_resort = last_resort.is_some();
            let choice = last_resort.map_or_else(|| self.choose(&ask), Ok)?;
            if choice.prefill.as_ref().is_some_and(|p| !p.fits()) {
                // The prefill node's queue is full: wait here rather than be refused there.
                drop(choice);
                let waiting_for = "room in a prefill replica's queue";
                self.enqueue(&mut queued, progress, deadline, target, &asker, waiting_for)?;
                self.replicas.changed_or_polled().await;
                continue;
            }
            let chosen_ms = ms(accepted);
            if queued.is_none()
                && progress.attempts == 1
                && let Some(target) = target
            {
                self.meets_target(&choice, p.class, target)?;
            }
            let local = choice.prefill.is_none();
            let decode = choice.decode.replica();
            tracing::debug!(
                attempt = progress.attempts,
                decode = %decode.addr,
                prefill = choice.prefill.as_ref().map_or("local", |g| g.replica().addr.as_str()),
                reason = %choice.reason,
                "dispatching"
            );
            let on_decode = |s: &Status| Failure::on_decode(&decode.addr, s);
            let transfer_id = if local {
                String::new()
            } else {
                crate::ids::fresh_id()
            };
            let mut d_client =
                tandem_proto::limits!(pb::decode_client::DecodeClient::new(decode.channel.clone()));
            let request =
                self.decode_request(p, progress, tokens, &choice, &transfer_id, is_last_resort);
            let mut frames = match d_client.generate(super::call(request, deadline)).await {
                Ok(frames) => frames.into_inner(),
                Err(s) if s.code() == tonic::Code::ResourceExhausted => {
                    tracing::debug!(decode = %decode.addr, status = %s.message(), "decode node full; back to the queue");
                    refused.push(decode.addr.clone());
                    drop(choice);
                    let waiting_for = "room on a decode node (its places or KV blocks)";
                    self.enqueue(&mut queued, progress, deadline, target, &asker, waiting_for)?;
                    continue;
                }
                Err(s) => return Err(on_decode(&s)),
            };
            let admitted = self
                .next_frame(&mut frames, self.token_gap, decode)
                .await
                .map_err(|s| on_decode(&s))?;
            let Some(pb::decode_response::Event::Admitted(a)) = admitted.and_then(|m| m.event)
            else {
                return Err(on_decode(&Status::unavailable(
                    "the decode node did not admit the request",
                )));
            };
            if let Some(queued) = queued {
                self.pace.record(&queued);
            }
            progress.queued = None;
            self.record_admitted(p, tokens.len(), &choice, &a);
            let queue_ms = ms(accepted);
            if progress.attempts == 1 {
                self.metrics.queue.observe(queue_ms / 1e3);
            }
            return Ok(Admission {
                choice,
                frames,
                admitted: a,
                transfer_id,
                queue_ms,
                chosen_ms,
            });
        }
    }
}
