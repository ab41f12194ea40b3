//! One generation through the cluster: validate and tokenize, choose replicas (the policy),
//! admit on the decode node, prefill (which pushes the KV the decode node lacks) or let the
//! decode node prefill locally, then relay the decode node's token frames, adding usage, timings
//! and the route to the last one.
//!
//! ```text
//! request ─▶ tokens, block hashes ─▶ policy: D (+ P) ─▶ D.Generate ──admitted{cached}──▶ P.Prefill(dest = D)
//!                                                          │ tokens ◀── (KV pushed P ─▶ D) ──┘
//!                                                          ▼  (local: D computes the suffix itself)
//!                                          LogWriter (frames, shared by attached client streams)
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_proto::v1 as pb;
use tokio::time::Instant as TokioInstant;
use tonic::Status;

use crate::config::Limits;
use crate::error::{Error, Result};
use crate::log::LogWriter;
use crate::metrics::{DecisionLabel, RouterMetrics};
use crate::policy::{Ask, Choice, Policy};
use crate::replicas::{Frontend, Replica, Replicas, Role};
use crate::retry::RetryBudget;

/// A request after validation: prompt token ids, their block hashes, and sampling.
#[derive(Debug)]
pub struct Prepared {
    pub request_id: String,
    pub session_id: String,
    pub tokens: Vec<u32>,
    /// Block hashes of the prompt's full blocks that a cache may supply (all but the last
    /// token's block).
    pub hashes: Vec<u64>,
    pub sampling: pb::SamplingParams,
    /// The cache partition ([`crate::auth::cache_partition`]) that seeds the block hashes.
    pub cache_salt: String,
    /// The model's fingerprint, which seeds the block hashes too.
    pub fingerprint: Vec<u8>,
    /// How many replies to generate (`n`): 1 to [`tandem_proto::MAX_CHOICES`].
    pub choices: u32,
}

/// Checks the request's ids and salt ([`tandem_proto::check_ids`]); the first thing done with a
/// request.
pub fn check_ids(r: &pb::GenerateRequest) -> Result<()> {
    tandem_proto::check_ids(&[
        ("request_id", &r.request_id),
        ("session_id", &r.session_id),
        ("cache_salt", &r.cache_salt),
    ])
    .map_err(|(field, reason)| Error::InvalidArgument { field, reason })
}

/// Checks a client request against `limits` and turns its input into token ids; the text is
/// bounded before it is tokenized. With `default_max_tokens`, an unset `max_tokens` (0) means
/// that many, or the rest of the context if that is less. `tenant` partitions the caches, with
/// the request's own `cache_salt`. Tokenizing takes time in proportion to the text: call this
/// off the async runtime's threads.
pub fn prepare(
    front: &Frontend,
    mut r: pb::GenerateRequest,
    limits: &Limits,
    default_max_tokens: Option<u32>,
    tenant: &str,
) -> Result<Prepared> {
    let invalid = |field, reason: &str| {
        Err(Error::InvalidArgument {
            field,
            reason: reason.to_string(),
        })
    };
    let given = usize::from(r.prompt.is_some())
        + usize::from(!r.messages.is_empty())
        + usize::from(!r.token_ids.is_empty());
    if given != 1 {
        return invalid(
            "input",
            "exactly one of prompt, messages and token_ids must be given",
        );
    }
    if r.messages.is_empty() && !r.tools.is_empty() {
        return invalid("tools", "tools are offered to a chat: give messages");
    }
    let Some(mut sampling) = r.sampling.take() else {
        return invalid("sampling", "sampling with max_tokens is required");
    };
    if !(sampling.temperature.is_finite() && sampling.temperature >= 0.0) {
        return invalid("sampling.temperature", "must be a finite number at least 0");
    }
    for (field, value) in [
        ("sampling.frequency_penalty", sampling.frequency_penalty),
        ("sampling.presence_penalty", sampling.presence_penalty),
    ] {
        if value.is_some_and(|v| !(-2.0..=2.0).contains(&v)) {
            return invalid(field, "must be in [-2, 2]");
        }
    }
    if sampling
        .repetition_penalty
        .is_some_and(|r| !(r > 0.0 && r <= 10.0))
    {
        return invalid("sampling.repetition_penalty", "must be in (0, 10]");
    }
    if let Some(p) = sampling.top_p
        && (p.is_nan() || p <= 0.0 || p > 1.0)
    {
        return invalid("sampling.top_p", "must be in (0, 1]");
    }
    if sampling.stop.iter().any(String::is_empty) {
        return invalid("sampling.stop", "stop strings must not be empty");
    }
    if let Some(p) = sampling.min_p
        && !(0.0..=1.0).contains(&p)
    {
        return invalid("sampling.min_p", "must be in [0, 1]");
    }
    if sampling
        .logprobs
        .is_some_and(|k| k > tandem_proto::MAX_TOP_LOGPROBS)
    {
        return Err(Error::InvalidArgument {
            field: "sampling.logprobs",
            reason: format!("at most {} alternatives", tandem_proto::MAX_TOP_LOGPROBS),
        });
    }
    check_token_ids(&sampling, front.tokenizer.vocab_size())?;
    if r.n > tandem_proto::MAX_CHOICES {
        return Err(Error::InvalidArgument {
            field: "n",
            reason: format!(
                "{} choices, over the limit of {}",
                r.n,
                tandem_proto::MAX_CHOICES
            ),
        });
    }
    if sampling.max_tokens == 0 && default_max_tokens.is_none() {
        return invalid("sampling.max_tokens", "must be at least 1");
    }
    if sampling.max_tokens > limits.max_tokens {
        return Err(Error::InvalidArgument {
            field: "sampling.max_tokens",
            reason: format!(
                "{} is over the limit of {}",
                sampling.max_tokens, limits.max_tokens
            ),
        });
    }
    let (field, text_bytes) = match &r.prompt {
        Some(p) => ("prompt", p.len()),
        None => ("messages", crate::chat::text_bytes(&r)),
    };
    if text_bytes > limits.prompt_bytes {
        return Err(Error::InvalidArgument {
            field,
            reason: format!(
                "{text_bytes} bytes of text, over the limit of {}",
                limits.prompt_bytes
            ),
        });
    }
    let tokens_field = if r.token_ids.is_empty() {
        "prompt"
    } else {
        "token_ids"
    };
    let tokens = if let Some(prompt) = r.prompt {
        if prompt.is_empty() {
            return invalid("prompt", "must not be empty");
        }
        front.tokenizer.encode(&prompt)?
    } else if !r.messages.is_empty() {
        let rendered = crate::chat::render(&front.tokenizer, &r)?;
        if let Some(call) = rendered.forced_call {
            if sampling.grammar.is_some() {
                return invalid(
                    "sampling.grammar",
                    "a forced tool call has the tools' grammar: give no other",
                );
            }
            sampling.grammar = Some(call);
        }
        front.tokenizer.encode(&rendered.text)?
    } else {
        let vocab = front.tokenizer.vocab_size();
        if let Some(t) = r.token_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::InvalidArgument {
                field: "token_ids",
                reason: format!("token id {t} is outside the vocabulary of {vocab}"),
            });
        }
        r.token_ids
    };
    if tokens.is_empty() {
        return invalid("prompt", "tokenizes to nothing");
    }
    if tokens.len() > limits.prompt_tokens {
        return Err(Error::InvalidArgument {
            field: tokens_field,
            reason: format!(
                "{} tokens, over the limit of {}",
                tokens.len(),
                limits.prompt_tokens
            ),
        });
    }
    if tokens.len() >= front.context_tokens {
        return Err(Error::InvalidArgument {
            field: "prompt",
            reason: format!(
                "{} tokens do not fit the context of {}",
                tokens.len(),
                front.context_tokens
            ),
        });
    }
    if sampling.max_tokens == 0 {
        let rest = (front.context_tokens - tokens.len()) as u32;
        sampling.max_tokens = default_max_tokens
            .unwrap_or(rest)
            .min(rest)
            .min(limits.max_tokens);
    }
    if sampling.min_tokens > sampling.max_tokens {
        return Err(Error::InvalidArgument {
            field: "sampling.min_tokens",
            reason: format!(
                "{} is more than max_tokens {}",
                sampling.min_tokens, sampling.max_tokens
            ),
        });
    }
    if tokens.len() + sampling.max_tokens as usize > front.context_tokens {
        return Err(Error::InvalidArgument {
            field: "sampling.max_tokens",
            reason: format!(
                "prompt of {} tokens plus max_tokens {} exceeds the context of {}",
                tokens.len(),
                sampling.max_tokens,
                front.context_tokens
            ),
        });
    }
    let cache_salt = crate::auth::cache_partition(tenant, &r.cache_salt);
    let hashes = tandem_proto::block_hash::prompt_hashes(&front.fingerprint, &cache_salt, &tokens);
    Ok(Prepared {
        request_id: r.request_id,
        session_id: r.session_id,
        tokens,
        hashes,
        sampling,
        cache_salt,
        fingerprint: front.fingerprint.clone(),
        choices: r.n.max(1),
    })
}

impl Prepared {
    /// The prompt an attempt sends, with its reusable blocks' hashes: the request's, followed
    /// by the tokens earlier attempts delivered (a failover resumes after them).
    fn prompt_after(&self, generated: &[u32]) -> (Vec<u32>, Vec<u64>) {
        if generated.is_empty() {
            return (self.tokens.clone(), self.hashes.clone());
        }
        let mut tokens = self.tokens.clone();
        tokens.extend(generated);
        let hashes =
            tandem_proto::block_hash::prompt_hashes(&self.fingerprint, &self.cache_salt, &tokens);
        (tokens, hashes)
    }

    /// The sampling of choice `choice`: the request's, with the choice's own seed.
    fn sampling_of(&self, choice: u32) -> pb::SamplingParams {
        pb::SamplingParams {
            seed: tandem_proto::choice_seed(self.sampling.seed, choice),
            ..self.sampling.clone()
        }
    }
}

/// Most logit biases a request may set (OpenAI allows 300).
pub const MAX_LOGIT_BIAS: usize = 1024;
/// Most `stop_token_ids` a request may set.
pub const MAX_STOP_TOKEN_IDS: usize = 64;

/// The token ids a request names besides its prompt (`logit_bias`, `stop_token_ids`): within
/// the vocabulary and their bounds.
fn check_token_ids(s: &pb::SamplingParams, vocab: usize) -> Result<()> {
    let invalid = |field, reason: String| Err(Error::InvalidArgument { field, reason });
    if s.logit_bias.len() > MAX_LOGIT_BIAS {
        return invalid(
            "sampling.logit_bias",
            format!(
                "{} biases, over the limit of {MAX_LOGIT_BIAS}",
                s.logit_bias.len()
            ),
        );
    }
    if s.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
        return invalid(
            "sampling.stop_token_ids",
            format!(
                "{} ids, over the limit of {MAX_STOP_TOKEN_IDS}",
                s.stop_token_ids.len()
            ),
        );
    }
    if let Some((t, b)) = s
        .logit_bias
        .iter()
        .find(|&(_, b)| !(-100.0..=100.0).contains(b))
    {
        return invalid(
            "sampling.logit_bias",
            format!("token {t}: a bias must be in [-100, 100], got {b}"),
        );
    }
    for (field, ids) in [
        (
            "sampling.logit_bias",
            s.logit_bias.keys().collect::<Vec<_>>(),
        ),
        ("sampling.stop_token_ids", s.stop_token_ids.iter().collect()),
    ] {
        if let Some(t) = ids.into_iter().find(|&&t| t as usize >= vocab) {
            return invalid(
                field,
                format!("token id {t} is outside the vocabulary of {vocab}"),
            );
        }
    }
    Ok(())
}

/// How a generation ended: its status code and the tokens it delivered.
#[derive(Debug, Clone, Copy)]
pub struct Outcome {
    pub code: tonic::Code,
    pub generated: usize,
}

/// Most dispatch attempts per request that end in a fault: the first and two failovers.
pub const MAX_ATTEMPTS: u32 = 3;
/// Most hand-offs one choice follows (moves off draining decode nodes, which a rolling
/// restart makes one after another); they are counted apart from [`MAX_ATTEMPTS`].
pub const MAX_HANDOFFS: u32 = 4;

/// Everything one dispatch needs.
#[derive(Debug, Clone)]
pub struct Dispatcher {
    pub replicas: Arc<Replicas>,
    pub policy: Arc<Policy>,
    pub metrics: RouterMetrics,
    pub kv_wait: Duration,
    /// How long a decode node's stream may be silent once it has its KV (before the first
    /// frame of a local prefill, plus twice the prefill's estimated time) before the router
    /// checks that the node still serves; see [`Dispatcher::next_frame`].
    pub token_gap: Duration,
    pub budget: Arc<RetryBudget>,
    pub pace: Arc<QueuePace>,
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

fn transfer_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// What a choice's attempts have delivered so far: a later attempt resumes from here.
#[derive(Debug, Default)]
struct Progress {
    /// Which of the request's choices this is.
    choice: u32,
    /// Tokens delivered to the client so far.
    generated: Vec<u32>,
    /// Frames delivered to the client so far (a frame may carry several tokens).
    frames: u32,
    attempts: u32,
    /// Of the attempts, those that a draining decode node handed off.
    handoffs: u32,
    /// Replicas that failed this request, which its later attempts avoid.
    exclude: Vec<String>,
    /// What failed, in order, for the route.
    failovers: Vec<String>,
    /// A decode node that handed the stream off (the last attempt's, or an earlier one's when
    /// the last kept nothing), with the KV it kept there.
    holder: Option<(String, usize)>,
    first_token_ms: Option<f64>,
    last_frame_at: Option<Instant>,
}

/// How a relayed frame arrived in its choice's stream, for the latency metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Arrival {
    /// The choice's first frame, this long (ms) after the request was accepted.
    First(f64),
    /// A later frame, this long after the one before.
    After(Duration),
}

/// What an attempt learned beside its frames, for its last frame's usage, timings and route.
#[derive(Debug, Default)]
struct Ending {
    /// Prompt tokens the decode node held when it admitted the attempt.
    decode_cached: u32,
    /// The prefill node's answer; `None` when the decode node prefilled locally.
    prefill: Option<pb::PrefillResponse>,
    /// The local prefill's compute (ms), from the attempt's first frame.
    local_prefill_ms: f64,
    queue_ms: f64,
    total_ms: f64,
    /// The attempt's replicas and why; [`Progress::finish`] adds the attempts and failovers.
    route: pb::Route,
    /// The decode node's peer fetch, when it made one.
    fetch_ms: f64,
}

impl Progress {
    /// Takes an attempt's next decode frame into the choice's stream, as the stream's next
    /// frame. The frame must start where the stream stands: a resumed attempt's decode node
    /// counts the tokens delivered before as generated, so its first frame's `index` is their
    /// number. A frame out of place fails the attempt, since relaying it would repeat or skip
    /// tokens. The last frame carries the node's own counts (completion and draft tokens) for
    /// [`Progress::finish`] to complete.
    fn relay(
        &mut self,
        t: pb::DecodeTokens,
        prompt_tokens: usize,
        accepted: Instant,
    ) -> Result<(pb::GenerateResponse, Arrival), Status> {
        if t.index as usize != self.generated.len() {
            return Err(Status::unavailable(format!(
                "frame {} where {} was due",
                t.index,
                self.generated.len()
            )));
        }
        let now = Instant::now();
        let arrival = match self.last_frame_at.replace(now) {
            None => {
                let ttft_ms = ms(accepted);
                self.first_token_ms = Some(ttft_ms);
                Arrival::First(ttft_ms)
            }
            Some(at) => Arrival::After(now - at),
        };
        let last = t.finish_reason != pb::FinishReason::Unspecified as i32;
        self.generated.extend(&t.token_ids);
        let frame = pb::GenerateResponse {
            index: self.frames,
            choice: self.choice,
            prompt_tokens: if self.frames == 0 {
                prompt_tokens as u32
            } else {
                0
            },
            token_ids: t.token_ids,
            text: t.text,
            finish_reason: t.finish_reason,
            logprobs: t.logprobs,
            usage: last.then_some(pb::Usage {
                completion_tokens: t.completion_tokens,
                ..Default::default()
            }),
            timings: last.then_some(pb::Timings {
                draft_tokens: t.draft_tokens,
                accepted_draft_tokens: t.accepted_draft_tokens,
                ..Default::default()
            }),
            ..Default::default()
        };
        self.frames += 1;
        Ok((frame, arrival))
    }

    /// Completes the choice's last frame, relayed by [`Progress::relay`], with the request's
    /// prompt, the attempt's `ending` and the choice's attempts and failovers. Its cached
    /// prompt tokens are the decode node's, then the prefill node's prefix cache beyond them.
    fn finish(&mut self, frame: &mut pb::GenerateResponse, prompt: &[u32], ending: Ending) {
        let Ending {
            decode_cached,
            prefill,
            local_prefill_ms,
            queue_ms,
            total_ms,
            route,
            fetch_ms,
        } = ending;
        let prefill_cached = prefill
            .as_ref()
            .map_or(0, |r| r.prefix_cached_tokens.saturating_sub(decode_cached));
        let cached = (decode_cached + prefill_cached).min(prompt.len() as u32);
        frame.prompt_token_ids = prompt.to_vec();
        let usage = frame.usage.get_or_insert_default();
        usage.prompt_tokens = prompt.len() as u32;
        usage.cached_tokens = cached;
        usage.prefill_cached_tokens = prefill_cached;
        usage.decode_cached_tokens = decode_cached;
        let timings = frame.timings.get_or_insert_default();
        timings.queue_ms = queue_ms;
        timings.prefill_ms = prefill.as_ref().map_or(local_prefill_ms, |r| r.prefill_ms);
        timings.transfer_ms = prefill.as_ref().map_or(0.0, |r| r.transfer_ms);
        timings.first_token_ms = self.first_token_ms.unwrap_or_default();
        timings.total_ms = total_ms;
        timings.fetch_ms = fetch_ms;
        frame.route = Some(pb::Route {
            attempts: self.attempts,
            failovers: std::mem::take(&mut self.failovers),
            ..route
        });
    }

    /// Takes a failed attempt and says whether the choice tries again. It does when another
    /// replica might succeed ([`retryable`]) and the failure names replicas to avoid, within
    /// [`MAX_ATTEMPTS`] and the retry `budget`; those replicas are then avoided from here on and
    /// the failure is noted for the route. A draining node's hand-off spends neither budget
    /// nor attempts (its own bound is [`MAX_HANDOFFS`]): the budget bounds what faults add to
    /// the replicas left, and a hand-off is a planned move (the next attempt fetches the KV kept
    /// for it, or starts what had not started). A hand-off that kept nothing leaves an earlier
    /// holder named: its KV is still a prefix of what the stream resumes from.
    fn retry(&mut self, failure: &Failure, budget: &RetryBudget) -> bool {
        let handoff = failure.handoff.is_some();
        let retry = retryable(&failure.error)
            && !failure.suspects.is_empty()
            && if handoff {
                self.handoffs < MAX_HANDOFFS
            } else {
                self.attempts - self.handoffs < MAX_ATTEMPTS && budget.try_spend()
            };
        if retry {
            self.failovers.push(format!(
                "{} ({})",
                failure.error,
                failure.suspects.join(", ")
            ));
            self.exclude.extend(failure.suspects.iter().cloned());
            let kept = failure.handoff.as_ref().is_some_and(|(_, t)| *t > 0);
            if !handoff || kept || self.holder.is_none() {
                self.holder.clone_from(&failure.handoff);
            }
            self.handoffs += u32::from(handoff);
        }
        retry
    }
}

/// A request a decode node admitted: the replicas chosen, the decode stream (its `admitted`
/// frame read), and what the admission said.
#[derive(Debug)]
struct Admission {
    choice: Choice,
    frames: tonic::Streaming<pb::DecodeResponse>,
    /// The decode node's admission: what it held, and what it fetched.
    admitted: pb::DecodeAdmitted,
    transfer_id: String,
    /// From the request's acceptance to its admission, in ms.
    queue_ms: f64,
}

/// A request's place in the router's queue: counted in the queue's gauge while it lives.
#[derive(Debug)]
struct Queued {
    gauge: prometheus_client::metrics::gauge::Gauge,
    /// Requests in the queue when this one joined.
    ahead: usize,
    since: Instant,
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// The pace of the router's queue: the wait per request ahead, a moving average over the
/// queued requests admitted lately. It predicts a newcomer's wait, so that one whose deadline
/// that wait would outlast is refused at once instead of timing out in the queue.
#[derive(Debug, Default)]
pub struct QueuePace(std::sync::Mutex<Option<f64>>);

impl QueuePace {
    /// Weight of the newest wait in the average.
    const WEIGHT: f64 = 0.2;

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<f64>> {
        // A plain number: a panic elsewhere cannot leave it half-written.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn record(&self, queued: &Queued) {
        let per = queued.since.elapsed().as_secs_f64() / (queued.ahead + 1) as f64;
        let mut pace = self.lock();
        *pace = Some(pace.map_or(per, |old| old + Self::WEIGHT * (per - old)));
    }

    /// The wait predicted behind `ahead` requests; `None` before any queued request was
    /// admitted.
    fn predict(&self, ahead: usize) -> Option<Duration> {
        self.lock()
            .map(|per| Duration::from_secs_f64(per * (ahead + 1) as f64))
    }
}

/// An attempt's failure, and the replicas it implicates.
#[derive(Debug)]
struct Failure {
    error: Error,
    /// The replicas to avoid on the next attempt; empty when retrying cannot help.
    suspects: Vec<String>,
    /// A draining decode node handed the stream off: its address, and the tokens of KV it kept
    /// for the next attempt to fetch.
    handoff: Option<(String, usize)>,
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        Self {
            error,
            suspects: Vec::new(),
            handoff: None,
        }
    }
}

impl Failure {
    /// The decode node at `addr` ended the attempt with `status`; a hand-off says what it kept.
    fn on_decode(addr: &str, status: &Status) -> Self {
        let handoff = status
            .metadata()
            .get(tandem_proto::HANDOFF_METADATA)
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .map(|tokens| (addr.to_string(), tokens));
        Self {
            error: Error::downstream("decode", status),
            suspects: vec![addr.to_string()],
            handoff,
        }
    }
}

/// Whether another replica might succeed where this error happened: the replica or the path
/// to it failed (UNAVAILABLE), or the KV it was sent was damaged (DATA_LOSS). Invalid input,
/// capacity and the client's own deadline or cancel are answered as they are.
fn retryable(e: &Error) -> bool {
    matches!(
        e,
        Error::Downstream {
            code: tonic::Code::Unavailable | tonic::Code::DataLoss,
            ..
        }
    )
}

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
            let failure = match self.attempt(p, progress, accepted, deadline, log).await {
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

    /// Puts the request in the router's queue, unless `queued` says it is there already. A
    /// request not yet started whose deadline the predicted wait would outlast is refused
    /// instead, at once (RESOURCE_EXHAUSTED, with that wait as its retry pushback); a failover
    /// is never refused, its stream has begun.
    fn enqueue(
        &self,
        queued: &mut Option<Queued>,
        progress: &Progress,
        deadline: TokioInstant,
    ) -> Result<(), Failure> {
        if queued.is_some() {
            return Ok(());
        }
        let ahead = self.metrics.queued.get().max(0) as usize;
        let left = deadline.saturating_duration_since(TokioInstant::now());
        if progress.attempts == 1
            && let Some(wait) = self.pace.predict(ahead)
            && wait > left
        {
            self.metrics.refused("deadline");
            return Err(Error::QueueTooLong { ahead, wait, left }.into());
        }
        self.metrics.queued.inc();
        *queued = Some(Queued {
            gauge: self.metrics.queued.clone(),
            ahead,
            since: Instant::now(),
        });
        Ok(())
    }

    /// The decode stream's next message. Silence longer than `gap` fails the attempt only when
    /// the node has also stopped serving (its health watch ended or reports NOT_SERVING): a busy
    /// node is slow, not dead, and its streams wait for it up to the request's deadline. A node
    /// that dies breaks the connection, which ends the stream at once, and one that stops
    /// answering HTTP/2 pings loses it within the keepalive bound.
    async fn next_frame(
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
        tokens: usize,
    ) -> Option<Choice> {
        if !decodes.is_empty() {
            return None;
        }
        let (holder, kept) = progress.holder.as_ref()?;
        let all = self.replicas.all();
        let decode = |r: &&Arc<Replica>| r.role == Role::Decode;
        let (replica, held) = match all
            .iter()
            .filter(decode)
            .find(|r| &r.addr == holder && r.can_serve_fetch())
        {
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
            decode: replica.claim(tokens as u64),
            prefill: None,
            decode_overlap: held,
            prefill_overlap: 0,
            reason: "last resort: every decode node drains".into(),
            prefill_idle: false,
            fetch: None,
        })
    }

    /// Waits in the router's queue until a decode replica this request may use has room
    /// ([`crate::replicas::Replica::has_room`]), and the chosen prefill replica too when the
    /// prompt goes to one, then chooses replicas and has the decode node
    /// admit the request. A node that refuses for capacity after all (other routers' requests,
    /// its KV blocks) sends the request back to the queue until something changes, never to
    /// the client; the request's deadline bounds the wait, and a request whose deadline the
    /// queue's predicted wait would outlast is refused at once ([`Dispatcher::enqueue`]). The
    /// queue itself is bounded by the router's `max_inflight`, past which requests are refused
    /// at once.
    async fn admit(
        &self,
        p: &Prepared,
        tokens: &[u32],
        hashes: &[u64],
        progress: &Progress,
        accepted: Instant,
        deadline: TokioInstant,
    ) -> Result<Admission, Failure> {
        let mut queued = None;
        loop {
            let change = self.replicas.changed();
            tokio::pin!(change);
            change.as_mut().enable();
            let ask = Ask {
                tokens: tokens.len(),
                hashes,
                session_id: &p.session_id,
                exclude: &progress.exclude,
                holder: progress.holder.as_ref().map(|(a, t)| (a.as_str(), *t)),
            };
            let decodes = crate::policy::candidates(&self.replicas, Role::Decode, &ask);
            // With none up, the policy answers at once.
            if !decodes.is_empty() && !decodes.iter().any(|r| r.has_room()) {
                self.enqueue(&mut queued, progress, deadline)?;
                change.await;
                continue;
            }
            let last_resort = self.last_resort(&decodes, progress, tokens.len());
            let is_last_resort = last_resort.is_some();
            let choice = match last_resort {
                Some(choice) => choice,
                None => self.policy.choose(&self.replicas, &ask)?,
            };
            if choice.prefill.as_ref().is_some_and(|p| !p.fits()) {
                // The prefill node's queue is full: wait here rather than be refused there.
                drop(choice);
                self.enqueue(&mut queued, progress, deadline)?;
                change.await;
                continue;
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
            let transfer_id = if local { String::new() } else { transfer_id() };
            let mut d_client =
                tandem_proto::limits!(pb::decode_client::DecodeClient::new(decode.channel.clone()));
            let mut d_req = tonic::Request::new(pb::DecodeRequest {
                request_id: p.request_id.clone(),
                transfer_id: transfer_id.clone(),
                prompt_token_ids: tokens.to_vec(),
                sampling: Some(p.sampling_of(progress.choice)),
                // A prompt queued on the prefill node is not silence: its push sends keepalives.
                kv_wait_ms: u32::try_from(self.kv_wait.as_millis()).unwrap_or(u32::MAX),
                local_prefill: local,
                resumed_tokens: progress.generated.len() as u32,
                cache_salt: p.cache_salt.clone(),
                fetch_addr: choice
                    .fetch
                    .as_ref()
                    .map_or_else(String::new, |f| f.0.clone()),
                fetch_tokens: choice.fetch.as_ref().map_or(0, |f| f.1 as u32),
                last_resort: is_last_resort,
            });
            d_req.set_timeout(deadline.saturating_duration_since(TokioInstant::now()));
            let mut frames = match d_client.generate(d_req).await {
                Ok(frames) => frames.into_inner(),
                Err(s) if s.code() == tonic::Code::ResourceExhausted => {
                    tracing::debug!(decode = %decode.addr, status = %s.message(), "decode node full; back to the queue");
                    drop(choice);
                    self.enqueue(&mut queued, progress, deadline)?;
                    self.replicas.changed().await;
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
            if choice.fetch.is_some() {
                self.policy.record_fetch(a.fetched_bytes, a.fetch_ms);
                self.metrics
                    .fetched_tokens
                    .inc_by(u64::from(a.fetched_tokens));
            }
            self.metrics
                .disagg_decisions
                .get_or_create(&DecisionLabel {
                    decision: if local { "local" } else { "remote" },
                })
                .inc();
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
            });
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
        } = self
            .admit(p, &tokens, &hashes, progress, accepted, deadline)
            .await?;
        let Choice {
            decode,
            prefill,
            decode_overlap,
            prefill_overlap,
            reason,
            prefill_idle,
            fetch,
        } = choice;
        let decode_cached = admitted.cached_tokens;
        let local = prefill.is_none();
        let d_addr = decode.replica().addr.clone();
        let on_decode = |s: &Status| Failure::on_decode(&d_addr, s);
        let p_addr = prefill.as_ref().map(|g| g.replica().addr.clone());
        let prefill_call = {
            let request = prefill.as_ref().map(|_| pb::PrefillRequest {
                request_id: p.request_id.clone(),
                transfer_id,
                token_ids: tokens.clone(),
                cached_tokens: decode_cached,
                decode_addr: d_addr.clone(),
                sampling: Some(p.sampling_of(progress.choice)),
                resumed_tokens: progress.generated.len() as u32,
                cache_salt: p.cache_salt.clone(),
            });
            let prefill = &prefill;
            async move {
                let (Some(guard), Some(request)) = (prefill, request) else {
                    return Ok(None);
                };
                prefill_on(guard.replica(), request, deadline)
                    .await
                    .map(Some)
                    .map_err(|s| Failure {
                        error: Error::downstream("prefill", &s),
                        suspects: vec![guard.replica().addr.clone()],
                        handoff: None,
                    })
            }
        };
        // Remote: the prefill call runs beside the decode stream, and ends once the KV is
        // pushed. Local: it answers `None` at once.
        tokio::pin!(prefill_call);
        let mut prefilled: Option<Option<pb::PrefillResponse>> = None;
        let mut frames_here = 0usize;
        let mut local_prefill_ms = 0.0;
        loop {
            let waiting_for_push = !local && prefilled.is_none();
            let bound = if waiting_for_push {
                // The decode node bounds KV silence itself (kv_wait), and the prefill call
                // ends with the push.
                None
            } else if frames_here == 0 && local {
                // The first frame follows a local prefill of the uncached suffix.
                let uncached = tokens.len().saturating_sub(decode_cached as usize) as f64;
                let rate = decode
                    .replica()
                    .prefill_rate_or(crate::policy::DEFAULT_RATE);
                Some(self.token_gap + Duration::from_secs_f64(2.0 * uncached / rate))
            } else {
                Some(self.token_gap)
            };
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
            let msg = msg.map_err(|s| {
                let mut f = on_decode(&s);
                if waiting_for_push {
                    // Before the KV arrived, the sender is as likely at fault.
                    f.suspects.extend(p_addr.iter().cloned());
                }
                f
            })?;
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
            match arrival {
                // The request's time to first token is its first choice's.
                Arrival::First(ttft_ms) if progress.choice == 0 => {
                    self.metrics.ttft.observe(ttft_ms / 1e3);
                }
                Arrival::First(_) => {}
                Arrival::After(gap) => self.metrics.inter_token.observe(gap.as_secs_f64()),
            }
            if !crate::log::is_last(&frame) {
                log.push(Ok(frame));
                continue;
            }
            // The KV arrived, so the prefill has answered or is about to.
            if prefilled.is_none() {
                prefilled = Some((&mut prefill_call).await?);
            }
            // What the attempt's prompt cost in compute: neither cached nor fetched.
            let computed = match prefilled.as_ref().and_then(Option::as_ref) {
                Some(r) => r.computed_tokens as usize,
                None => tokens.len().saturating_sub(decode_cached as usize),
            };
            self.metrics.computed_tokens.inc_by(computed as u64);
            progress.finish(
                &mut frame,
                &p.tokens,
                Ending {
                    decode_cached,
                    prefill: prefilled.flatten(),
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
                        ..Default::default()
                    },
                    fetch_ms: admitted.fetch_ms,
                },
            );
            let t = frame.timings.unwrap_or_default();
            if progress.attempts == 1 && (local || prefill_idle) {
                self.policy
                    .record_handoff(local, t.first_token_ms - t.queue_ms - t.prefill_ms);
            }
            // The request's prompt counts once, as its first choice saw it.
            if progress.choice == 0 {
                let cached = frame.usage.map_or(0, |u| u.cached_tokens);
                self.metrics.prompt_tokens.inc_by(p.tokens.len() as u64);
                self.metrics.cached_prompt_tokens.inc_by(u64::from(cached));
            }
            log.push(Ok(frame));
            return Ok(());
        }
    }
}

/// Asks `replica` to prefill `request` and push its KV, within `deadline`.
async fn prefill_on(
    replica: &Replica,
    request: pb::PrefillRequest,
    deadline: TokioInstant,
) -> Result<pb::PrefillResponse, Status> {
    let mut client = tandem_proto::limits!(pb::prefill_client::PrefillClient::new(
        replica.channel.clone()
    ));
    let mut request = tonic::Request::new(request);
    request.set_timeout(deadline.saturating_duration_since(TokioInstant::now()));
    Ok(client.prefill(request).await?.into_inner())
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use tandem_proto::block_hash::prompt_hashes;

    use super::*;

    fn prepared() -> Prepared {
        let tokens: Vec<u32> = (0..40).collect();
        let fingerprint = vec![7; 32];
        Prepared {
            request_id: "r".into(),
            session_id: String::new(),
            hashes: prompt_hashes(&fingerprint, "salt", &tokens),
            tokens,
            sampling: pb::SamplingParams {
                seed: 5,
                max_tokens: 8,
                ..Default::default()
            },
            cache_salt: "salt".into(),
            fingerprint,
            choices: 2,
        }
    }

    #[test]
    fn a_resumed_attempt_sends_the_prompt_and_what_was_delivered() {
        let p = prepared();
        assert_eq!(p.prompt_after(&[]), (p.tokens.clone(), p.hashes.clone()));
        let delivered: Vec<u32> = (100..110).collect();
        let (tokens, hashes) = p.prompt_after(&delivered);
        assert_eq!(tokens[..40], p.tokens[..]);
        assert_eq!(tokens[40..], delivered[..]);
        // 50 tokens hold 3 reusable blocks (all but the last token's), the first 2 the prompt's.
        assert_eq!(p.hashes.len(), 2);
        assert_eq!(hashes.len(), 3);
        assert_eq!(hashes[..2], p.hashes[..]);
    }

    fn tokens(index: u32, token_ids: &[u32], finish: pb::FinishReason) -> pb::DecodeTokens {
        pb::DecodeTokens {
            index,
            token_ids: token_ids.to_vec(),
            text: format!("{token_ids:?}"),
            finish_reason: finish as i32,
            completion_tokens: if finish == pb::FinishReason::Unspecified {
                0
            } else {
                index + token_ids.len() as u32
            },
            ..Default::default()
        }
    }

    fn cut(decode: &str) -> Failure {
        Failure::on_decode(decode, &Status::unavailable("connection reset"))
    }

    /// A draining node's hand-off is a failover whose next attempt knows where the KV is, and
    /// it spends no failover budget: with the budget spent, a hand-off still moves and a
    /// failure does not.
    #[test]
    fn a_handed_off_stream_resumes_with_its_holder_named() {
        let budget = RetryBudget::default();
        while budget.try_spend() {}
        let mut progress = Progress {
            attempts: 1,
            ..Progress::default()
        };
        let mut status = Status::unavailable("draining");
        status
            .metadata_mut()
            .insert(tandem_proto::HANDOFF_METADATA, 48u64.into());
        assert!(progress.retry(&Failure::on_decode("d1:1", &status), &budget));
        assert_eq!(progress.holder, Some(("d1:1".to_string(), 48)));
        assert_eq!(progress.exclude, ["d1:1"]);
        progress.attempts = 2;
        assert!(
            !progress.retry(&cut("d2:1"), &budget),
            "the budget is spent"
        );
        // A plain failure names no holder, and forgets the last one.
        for _ in 0..6 {
            budget.deposit(0);
        }
        assert!(progress.retry(&cut("d2:1"), &budget));
        assert_eq!(progress.holder, None);
    }

    /// When both decode nodes drain, the second refuses the stream the first handed off (it
    /// kept nothing for it): the first stays the holder, whose KV the stream goes back to.
    /// Hand-offs spend no attempts; their own bound ends a stream moved about forever.
    #[test]
    fn a_refusal_by_a_draining_node_keeps_the_holder_and_spends_no_attempts() {
        let budget = RetryBudget::default();
        let handoff = |addr: &str, tokens: u64| {
            let mut status = Status::unavailable("draining");
            status
                .metadata_mut()
                .insert(tandem_proto::HANDOFF_METADATA, tokens.into());
            Failure::on_decode(addr, &status)
        };
        let mut progress = Progress {
            attempts: 1,
            ..Progress::default()
        };
        assert!(progress.retry(&handoff("d1:1", 64), &budget));
        progress.attempts += 1;
        assert!(progress.retry(&handoff("d2:1", 0), &budget));
        assert_eq!(progress.holder, Some(("d1:1".to_string(), 64)));
        assert_eq!(progress.exclude, ["d1:1", "d2:1"]);
        // Two failovers still fit after the two moves.
        progress.attempts += 1;
        assert!(progress.retry(&cut("d3:1"), &budget));
        progress.attempts += 1;
        assert!(progress.retry(&cut("d4:1"), &budget));
        progress.attempts += 1;
        assert!(!progress.retry(&cut("d5:1"), &budget), "out of attempts");
        while progress.handoffs < MAX_HANDOFFS {
            assert!(progress.retry(&handoff("d1:1", 16), &budget));
        }
        assert!(
            !progress.retry(&handoff("d1:1", 16), &budget),
            "out of moves"
        );
    }

    /// A choice's stream through a decode node cut after three frames: the second attempt
    /// avoids that node, sends the prompt with the delivered tokens, and its frames continue
    /// the stream with no gap or repeat, as one attempt's would.
    #[test]
    fn a_failover_resumes_the_stream_where_it_stood() {
        use pb::FinishReason::{Length, Unspecified};
        let p = prepared();
        let budget = RetryBudget::default();
        let accepted = Instant::now();
        let mut progress = Progress {
            choice: 1,
            attempts: 1,
            ..Progress::default()
        };
        let mut stream = Vec::new();
        for t in [
            tokens(0, &[10], Unspecified),
            tokens(1, &[11, 12], Unspecified),
            tokens(3, &[13], Unspecified),
        ] {
            let (frame, arrival) = progress
                .relay(t, p.tokens.len(), accepted)
                .expect("in place");
            assert_eq!(
                matches!(arrival, Arrival::First(_)),
                stream.is_empty(),
                "only the first frame is the first token"
            );
            stream.push(frame);
        }
        assert!(progress.retry(&cut("d1:1"), &budget));
        assert_eq!(progress.exclude, ["d1:1"]);
        progress.attempts += 1;

        let (prompt, _) = p.prompt_after(&progress.generated);
        assert_eq!(prompt[p.tokens.len()..], [10, 11, 12, 13]);
        // A node that starts over, or skips a token, fails the attempt rather than the stream.
        for wrong in [0, 3, 5] {
            let err = progress
                .relay(tokens(wrong, &[99], Unspecified), 40, accepted)
                .expect_err("out of place");
            assert_eq!(err.code(), tonic::Code::Unavailable);
        }
        for t in [tokens(4, &[14], Unspecified), tokens(5, &[15, 16], Length)] {
            let (frame, arrival) = progress
                .relay(t, p.tokens.len(), accepted)
                .expect("in place");
            assert!(matches!(arrival, Arrival::After(_)));
            stream.push(frame);
        }
        let mut last = stream.pop().expect("frames");
        progress.finish(
            &mut last,
            &p.tokens,
            Ending {
                decode_cached: 32,
                route: pb::Route {
                    decode: "d2:1".into(),
                    ..Default::default()
                },
                ..Default::default()
            },
        );
        stream.push(last);

        let indices: Vec<u32> = stream.iter().map(|f| f.index).collect();
        assert_eq!(indices, [0, 1, 2, 3, 4]);
        let delivered: Vec<u32> = stream.iter().flat_map(|f| f.token_ids.clone()).collect();
        assert_eq!(delivered, (10..17).collect::<Vec<_>>());
        assert!(stream.iter().all(|f| f.choice == 1));
        assert_eq!(stream[0].prompt_tokens, 40);
        assert!(stream[1..].iter().all(|f| f.prompt_tokens == 0));
        assert!(stream[..4].iter().all(|f| !crate::log::is_last(f)));

        let last = &stream[4];
        let usage = last.usage.as_ref().expect("usage");
        assert_eq!((usage.prompt_tokens, usage.completion_tokens), (40, 7));
        assert_eq!(usage.cached_tokens, 32);
        assert_eq!(last.prompt_token_ids, p.tokens);
        let route = last.route.as_ref().expect("route");
        assert_eq!((route.decode.as_str(), route.attempts), ("d2:1", 2));
        assert_eq!(route.failovers.len(), 1);
        assert!(route.failovers[0].contains("d1:1"), "{:?}", route.failovers);
    }

    #[test]
    fn only_a_replica_failure_within_the_attempts_and_budget_is_retried() {
        let budget = RetryBudget::default();
        let mut progress = Progress {
            attempts: 1,
            ..Progress::default()
        };
        let invalid = Failure::from(Error::InvalidArgument {
            field: "prompt",
            reason: "bad".into(),
        });
        assert!(!progress.retry(&invalid, &budget), "bad input fails again");
        let unsuspected = Failure {
            suspects: Vec::new(),
            ..cut("d1:1")
        };
        assert!(
            !progress.retry(&unsuspected, &budget),
            "no replica to avoid"
        );
        progress.attempts = MAX_ATTEMPTS;
        assert!(!progress.retry(&cut("d1:1"), &budget), "out of attempts");
        assert!(progress.exclude.is_empty() && progress.failovers.is_empty());

        progress.attempts = 1;
        let mut retried = 0;
        while progress.retry(&cut("d1:1"), &budget) {
            retried += 1;
        }
        assert_eq!(
            retried as f64,
            RetryBudget::RESERVE,
            "the budget bounds failovers"
        );
        assert_eq!(progress.failovers.len(), retried);
    }

    #[test]
    fn each_choice_samples_with_its_own_seed() {
        let p = prepared();
        assert_eq!(p.sampling_of(0), p.sampling);
        let seeds: HashSet<u64> = (0..tandem_proto::MAX_CHOICES)
            .map(|i| p.sampling_of(i).seed)
            .collect();
        assert_eq!(seeds.len(), tandem_proto::MAX_CHOICES as usize);
        assert_eq!(p.sampling_of(3).max_tokens, 8);
    }
}
