//! Dispatch: how a request becomes a generation and runs through the cluster. Both API fronts
//! ([`crate::api`]) start their generations through [`GenerationService::start`]: admission,
//! request-id attachment (atomic: lookup and registration under one lock), and the hand-off
//! to a generation task, which the [`Dispatcher`] runs.
//!
//! ```text
//! start ─▶ prepare (ids, limits, tokens) ─▶ Dispatcher::run: per choice, attempts
//!            (run) ─▶ admit (queue, policy, decode admission) ─▶ relay (progress) ─▶ log
//! ```
//!
//! Imports run down this list: a module uses only those below it, the cluster view and the
//! shared modules.

pub mod admit;
pub mod calibration;
pub mod chat;
pub mod dispatcher;
pub mod log;
pub mod order;
pub mod prepare;
pub mod progress;
pub mod queue;
pub mod remote;
pub mod retry;
pub mod run;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::Stream;
use tandem_proto::v1 as pb;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::auth::{KeyStore, Principal};
use crate::cluster::frontend::{Frontend, pick};
use crate::cluster::peers::RunningKey;
use crate::config::Limits;
use crate::dispatch::dispatcher::{Dispatcher, Outcome};
use crate::dispatch::log::{Item, LogWriter};
use crate::dispatch::prepare::{check_ids, prepare, tokenize};
use crate::error::Error;
use crate::ids::fresh_id;

pub(crate) type GenerateStream = Pin<Box<dyn Stream<Item = Item> + Send + 'static>>;

/// A generation started: its frames, and its prompt's length in tokens (0 when the request
/// attached to a running generation, whose prompt this router did not tokenize for it).
pub(crate) struct Started {
    pub frames: GenerateStream,
    pub prompt_tokens: u32,
}

#[derive(Clone, Debug)]
pub struct GenerationService {
    pub(crate) dispatcher: Dispatcher,
    pub(crate) admission: Arc<Semaphore>,
    pub(crate) max_inflight: usize,
    pub(crate) default_timeout: std::time::Duration,
    pub(crate) limits: Arc<Limits>,
    /// The model of a request that names none ([`crate::Config::default_model`]).
    pub(crate) default_model: Option<Arc<str>>,
    /// What an HTTP request's unset sampling fields become.
    pub(crate) sampling_defaults: crate::config::SamplingDefaults,
    pub(crate) keys: Arc<KeyStore>,
    /// Generations running under a client-given request id, per tenant: a retry attaches only
    /// to its own tenant's generation.
    pub(crate) running: Arc<Mutex<Running>>,
    /// Cancelled as the router's drain begins: new requests are refused (retry attachments
    /// still attach), while the running generations go on.
    pub(crate) draining: CancellationToken,
    /// Cancelled when the drain's grace is over: the generations still running end with
    /// UNAVAILABLE.
    pub(crate) shutdown: CancellationToken,
    /// The generation tasks, which the drain waits for.
    pub(crate) generations: TaskTracker,
}

/// Running generations by (tenant, client-given request id).
pub(crate) type Running = HashMap<RunningKey, Arc<LogWriter>>;

impl GenerationService {
    fn running(&self) -> std::sync::MutexGuard<'_, Running> {
        // Single inserts and removes; a poisoned lock is still consistent.
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Who a request comes from, by its `authorization` value; a refusal is counted in the
    /// metrics. Both APIs call it before reading a request's body.
    pub(crate) fn authenticate(&self, authorization: Option<&[u8]>) -> Result<Principal, Error> {
        self.keys
            .authenticate(authorization)
            .inspect_err(|e| self.dispatcher.metrics.finished(e.code()))
    }

    /// The model a request naming `model` runs on ([`pick`]), once a worker has named it.
    pub(crate) fn frontend(&self, model: &str) -> Result<Arc<Frontend>, Error> {
        let served = self.dispatcher.replicas.models();
        pick(&served, model, self.default_model.as_deref())
    }

    /// An admission permit, or RESOURCE_EXHAUSTED (counted) when the router holds as many
    /// requests as it may.
    fn permit(&self) -> Result<tokio::sync::OwnedSemaphorePermit, Error> {
        self.admission.clone().try_acquire_owned().map_err(|_| {
            self.dispatcher.metrics.refused("queue_full");
            Error::Busy {
                inflight: self.max_inflight,
            }
        })
    }

    /// Starts (or attaches to) a generation for `principal` and returns its frames. `deadline`
    /// defaults to the router's timeout; `default_max_tokens` is [`prepare`]'s. A refusal is
    /// counted in the metrics here.
    pub(crate) async fn start(
        &self,
        r: pb::GenerateRequest,
        principal: &Principal,
        deadline: Option<tokio::time::Instant>,
        default_max_tokens: Option<u32>,
    ) -> Result<Started, Error> {
        self.try_start(r, principal, deadline, default_max_tokens)
            .await
            .inspect_err(|e| self.dispatcher.metrics.finished(e.code()))
    }

    async fn try_start(
        &self,
        mut r: pb::GenerateRequest,
        principal: &Principal,
        deadline: Option<tokio::time::Instant>,
        default_max_tokens: Option<u32>,
    ) -> Result<Started, Error> {
        check_ids(&r)?;
        let accepted = Instant::now();
        let deadline =
            deadline.unwrap_or_else(|| tokio::time::Instant::now() + self.default_timeout);
        // Only a client's own id attaches retries; without one, the router names the request
        // so that every log line about it, on every node, carries an id.
        let key = (principal.tenant.clone(), r.request_id.clone());
        if key.1.is_empty() {
            r.request_id = fresh_id();
        }
        // The request's span carries the GenAI semantic conventions' attributes.
        let span = tracing::info_span!(
            "request",
            request_id = %r.request_id,
            "gen_ai.operation.name" = if r.messages.is_empty() { "text_completion" } else { "chat" },
            "gen_ai.provider.name" = "tandem",
            "gen_ai.request.model" = tracing::field::Empty,
            "gen_ai.request.max_tokens" = tracing::field::Empty,
            "gen_ai.usage.input_tokens" = tracing::field::Empty,
            "gen_ai.usage.output_tokens" = tracing::field::Empty,
        );
        if let Some(attached) = attach(&self.running(), &key) {
            return Ok(Started {
                frames: attached,
                prompt_tokens: 0,
            });
        }
        if let Some(attached) = self.attach_on_peer(&key, deadline).await {
            return Ok(Started {
                frames: attached,
                prompt_tokens: 0,
            });
        }
        if self.draining.is_cancelled() {
            return Err(Error::Draining);
        }
        let front = self.frontend(&r.model)?;
        // The admission permit bounds the tokenizations running at once as well.
        let permit = self.permit()?;
        let (limits, who) = (self.limits.clone(), principal.clone());
        let seconds = self.dispatcher.metrics.prepare.clone();
        let prepared = tokio::task::spawn_blocking(move || {
            let started = std::time::Instant::now();
            let prepared = prepare(&front, r, &limits, default_max_tokens, &who);
            seconds.observe(started.elapsed().as_secs_f64());
            prepared
        })
        .instrument(span.clone())
        .await
        .map_err(|_| Error::ShuttingDown)??;
        // A key's token limits count every choice's reply.
        let replies = prepared
            .sampling
            .max_tokens
            .saturating_mul(prepared.choices);
        let grant = principal.admit(prepared.tokens.len(), replies)?;
        // Looking the id up and registering the new generation are one step under one lock, so
        // two requests with the same id can never both start.
        let log = {
            let mut running = self.running();
            if let Some(attached) = attach(&running, &key) {
                // The same id started meanwhile: this request was never admitted after all.
                grant.finish(0);
                return Ok(Started {
                    frames: attached,
                    prompt_tokens: 0,
                });
            }
            let log = LogWriter::new(prepared.choices);
            if !key.1.is_empty() {
                running.insert(key.clone(), log.clone());
            }
            log
        };
        let reader = log.subscribe();
        let prompt_tokens = u32::try_from(prepared.tokens.len()).unwrap_or(u32::MAX);
        span.record("gen_ai.request.model", prepared.model.as_str());
        span.record("gen_ai.request.max_tokens", prepared.sampling.max_tokens);
        span.record("gen_ai.usage.input_tokens", prompt_tokens);
        let (svc, shutdown) = (self.clone(), self.shutdown.clone());
        let model = prepared.model.clone();
        let (tenant, weight) = (prepared.tenant.clone(), prepared.weight);
        self.generations.spawn(
            async move {
                let _permit = permit;
                let outcome = tokio::select! {
                    outcome = svc.dispatcher.run(prepared, accepted, deadline, &log) => outcome,
                    () = shutdown.cancelled() => {
                        log.push(Err(Error::ShuttingDown.into()));
                        Outcome { code: tonic::Code::Unavailable, generated: 0 }
                    }
                };
                grant.finish(outcome.generated);
                // The admission order charges the prompt at admission, the reply here.
                (svc.dispatcher).charge(&tenant, weight, outcome.generated as u64);
                tracing::Span::current().record("gen_ai.usage.output_tokens", outcome.generated);
                svc.dispatcher.metrics.finished(outcome.code);
                (svc.dispatcher.metrics).model_finished(
                    &model,
                    outcome.code,
                    outcome.generated as u64,
                );
                if !key.1.is_empty() {
                    svc.running().remove(&key);
                }
            }
            .instrument(span),
        );
        Ok(Started {
            frames: Box::pin(reader.stream()),
            prompt_tokens,
        })
    }

    /// How many tokens request `r`'s input is as a prompt (its chat rendered and tokenized), as
    /// [`GenerationService::start`] would count it: what Anthropic's `count_tokens` answers.
    pub(crate) async fn count_tokens(&self, mut r: pb::GenerateRequest) -> Result<usize, Error> {
        check_ids(&r)?;
        let front = self.frontend(&r.model)?;
        // Tokenizing is bounded as a generation's is: it takes an admission permit meanwhile.
        let _permit = self.permit()?;
        let limits = self.limits.clone();
        let (tokens, _) = tokio::task::spawn_blocking(move || tokenize(&front, &mut r, &limits))
            .await
            .map_err(|_| Error::ShuttingDown)??;
        Ok(tokens.len())
    }

    /// The keys of the generations running here under a client's request id.
    pub(crate) fn running_keys(&self) -> Vec<RunningKey> {
        self.running().keys().cloned().collect()
    }

    /// The frames of the generation running here under `key`, if any.
    pub(crate) fn attach_here(&self, key: &RunningKey) -> Option<GenerateStream> {
        attach(&self.running(), key)
    }

    /// The frames of the generation a peer router runs under `key`, as of the peer's last
    /// answer; `None` when none does, or the peer no longer has it or cannot be reached (the
    /// request then starts here: with the same sampling seed, the same tokens).
    async fn attach_on_peer(
        &self,
        key: &RunningKey,
        deadline: tokio::time::Instant,
    ) -> Option<GenerateStream> {
        if key.1.is_empty() {
            return None;
        }
        let channel = self.dispatcher.peers.running_on(key)?;
        let mut client = tandem_proto::limits!(pb::peer_client::PeerClient::new(channel));
        let mut ask = tonic::Request::new(pb::AttachRequest {
            tenant: key.0.to_string(),
            request_id: key.1.clone(),
        });
        ask.set_timeout(deadline.saturating_duration_since(tokio::time::Instant::now()));
        match client.attach(ask).await {
            Ok(frames) => {
                tracing::info!(request_id = %key.1, "attaching to the generation a peer router runs");
                self.dispatcher.metrics.peer_attaches.inc();
                Some(Box::pin(frames.into_inner()))
            }
            Err(e) => {
                tracing::info!(request_id = %key.1, error = %e, "cannot attach on the peer router; starting here");
                None
            }
        }
    }
}

/// The running generation with this tenant's request id, if any.
fn attach(running: &Running, key: &RunningKey) -> Option<GenerateStream> {
    if key.1.is_empty() {
        return None;
    }
    let log = running.get(key)?;
    tracing::info!(request_id = %key.1, "attaching to the running generation");
    Some(Box::pin(log.subscribe().stream()))
}

/// A call to a worker: bounded by the request's `deadline`, with the trace context.
fn call<T>(message: T, deadline: tokio::time::Instant) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(deadline.saturating_duration_since(tokio::time::Instant::now()));
    tandem_net::otel::inject(request.metadata_mut());
    request
}
