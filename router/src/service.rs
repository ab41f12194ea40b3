//! The router's gRPC face: `Generation.Generate`. Admission, request-id attachment (atomic:
//! lookup and registration under one lock), and the hand-off to a generation task; the flow
//! itself is in [`crate::generation`]. The OpenAI HTTP API ([`crate::openai`]) starts its
//! generations through the same [`GenerationService::start`].

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::Stream;
use tandem_proto::v1 as pb;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::error::Error;
use crate::generation::{Dispatcher, check_ids, prepare};
use crate::log::{Item, LogWriter};

/// A request id for a request that came without one.
pub(crate) fn fresh_request_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

pub(crate) type GenerateStream = Pin<Box<dyn Stream<Item = Item> + Send + 'static>>;

#[derive(Clone, Debug)]
pub struct GenerationService {
    pub(crate) dispatcher: Dispatcher,
    pub(crate) admission: Arc<Semaphore>,
    pub(crate) max_inflight: usize,
    pub(crate) default_timeout: std::time::Duration,
    /// Generations running under a client-given request id.
    pub(crate) running: Arc<Mutex<HashMap<String, Arc<LogWriter>>>>,
    pub(crate) shutdown: CancellationToken,
    pub(crate) tracker: TaskTracker,
}

impl GenerationService {
    fn running(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<LogWriter>>> {
        // Single inserts and removes; a poisoned lock is still consistent.
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts (or attaches to) a generation and returns its frames. `deadline` defaults to the
    /// router's timeout; `default_max_tokens` is [`prepare`]'s. A refusal is counted in the
    /// metrics here.
    pub(crate) fn start(
        &self,
        r: pb::GenerateRequest,
        deadline: Option<tokio::time::Instant>,
        default_max_tokens: Option<u32>,
    ) -> Result<GenerateStream, Error> {
        self.try_start(r, deadline, default_max_tokens)
            .inspect_err(|e| self.dispatcher.metrics.finished(e.code()))
    }

    fn try_start(
        &self,
        mut r: pb::GenerateRequest,
        deadline: Option<tokio::time::Instant>,
        default_max_tokens: Option<u32>,
    ) -> Result<GenerateStream, Error> {
        check_ids(&r)?;
        let accepted = Instant::now();
        let deadline =
            deadline.unwrap_or_else(|| tokio::time::Instant::now() + self.default_timeout);
        // Only a client's own id attaches retries; without one, the router names the request
        // so that every log line about it, on every node, carries an id.
        let id = r.request_id.clone();
        if id.is_empty() {
            r.request_id = fresh_request_id();
        }
        let span = tracing::info_span!("request", request_id = %r.request_id);
        let entered = span.enter();
        if self.shutdown.is_cancelled() {
            return Err(Error::ShuttingDown);
        }
        let front = self
            .dispatcher
            .replicas
            .frontend()
            .cloned()
            .ok_or(Error::NotReady)?;
        let prepared = prepare(&front, r, default_max_tokens)?;
        // Looking the id up and registering the new generation are one step under one lock, so
        // two requests with the same id can never both start.
        let (log, permit) = {
            let mut running = self.running();
            if let Some(log) = running.get(&id).filter(|_| !id.is_empty()) {
                tracing::info!(request_id = %id, "attaching to the running generation");
                return Ok(Box::pin(log.subscribe().stream()));
            }
            let permit = self
                .admission
                .clone()
                .try_acquire_owned()
                .map_err(|_| Error::Busy {
                    inflight: self.max_inflight,
                })?;
            let log = LogWriter::new();
            if !id.is_empty() {
                running.insert(id.clone(), log.clone());
            }
            (log, permit)
        };
        let reader = log.subscribe();
        let (svc, shutdown) = (self.clone(), self.shutdown.clone());
        drop(entered);
        self.tracker.spawn(
            async move {
                let _permit = permit;
                let code = tokio::select! {
                    code = svc.dispatcher.run(prepared, accepted, deadline, &log) => code,
                    () = shutdown.cancelled() => {
                        log.push(Err(Error::ShuttingDown.into()));
                        tonic::Code::Unavailable
                    }
                };
                svc.dispatcher.metrics.finished(code);
                if !id.is_empty() {
                    svc.running().remove(&id);
                }
            }
            .instrument(span),
        );
        Ok(Box::pin(reader.stream()))
    }
}

#[tonic::async_trait]
impl pb::generation_server::Generation for GenerationService {
    type GenerateStream = GenerateStream;

    #[tracing::instrument(skip_all, fields(request_id = %request.get_ref().request_id))]
    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let deadline = tandem_proto::net::deadline(request.metadata());
        let stream = self.start(request.into_inner(), deadline, None)?;
        Ok(Response::new(stream))
    }
}
