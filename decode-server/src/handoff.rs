//! KV that moves between decode nodes: peer fetches in both directions, and the drain that hands
//! running streams off.
//!
//! ```text
//! SIGTERM ─▶ NOT_SERVING, `draining`: new requests refused; each running stream stops between
//!            steps, its KV kept in the session cache, and ends UNAVAILABLE + tandem-kv-handoff
//!         ─▶ the router resumes it on a peer, which fetches that KV (`KvTransfer.Fetch`) here
//!         ─▶ once every stream has ended and every kept sequence was fetched (or the hand-off
//!            bound passed): the listener closes and the grace period begins
//! ```
//!
//! A peer's fetch reads this node's session cache through the scheduler (a lookup, an export
//! cell by cell); a fetch this node makes for a request is checked like a push and kept in its
//! own cache before the request's lookup. Either way a failure costs only time: the tokens are
//! then computed.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_engine::KvExport;
use tandem_proto::v1 as pb;
use tandem_transfer::{Cached, FetchWant, KvSource};
use tonic::Status;

use crate::request::{Plan, RequestContext};
use crate::scheduler::SchedulerHandle;

/// The longest a fetch may go without a frame before it is dropped (and its tokens computed).
pub const FETCH_IDLE: Duration = Duration::from_secs(2);

/// Sequences kept at drain for a peer to fetch, by the hash of their last kept block.
#[derive(Debug, Default)]
pub(crate) struct Handoffs(Mutex<HashSet<u64>>);

impl Handoffs {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashSet<u64>> {
        // Single inserts and removes: a poisoned set is still consistent.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn kept(&self, last_block: u64) {
        self.lock().insert(last_block);
    }

    /// A peer fetched the prefix whose last block is `last_block`.
    fn fetched(&self, last_block: u64) {
        self.lock().remove(&last_block);
    }

    fn pending(&self) -> usize {
        self.lock().len()
    }
}

/// The session cache, as peers' fetches see it.
#[derive(Debug)]
pub(crate) struct SessionCache {
    pub model: Arc<tandem_engine::Model>,
    pub scheduler: SchedulerHandle,
    pub handoffs: Arc<Handoffs>,
}

#[tonic::async_trait]
impl KvSource for SessionCache {
    async fn cached(&self, token_ids: &[u32], cache_salt: &str) -> Result<Cached, Status> {
        tandem_proto::check_ids(&[("cache_salt", cache_salt)])
            .map_err(|(field, reason)| Status::invalid_argument(format!("{field}: {reason}")))?;
        self.model
            .config
            .check_token_ids("token_ids", token_ids)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let hashes = tandem_worker::block_hashes(&self.model, cache_salt, token_ids);
        let cells = self.scheduler.export(hashes.clone()).await;
        let tokens = cells.last().map_or(0, |kv| kv.tokens.end);
        if let Some(last) = (tokens / tandem_engine::BLOCK_TOKENS).checked_sub(1) {
            self.handoffs.fetched(hashes[last]);
        }
        Ok(Cached {
            tokens: tokens as u32,
            chunks: cells
                .into_iter()
                .flat_map(tandem_worker::kv_chunks)
                .collect(),
        })
    }
}

impl RequestContext {
    /// Fetches the KV of the prompt's first `tokens` tokens from the peer at `addr`; `None`
    /// (counted as a failure when something went wrong) when there is none to use.
    pub(crate) async fn fetch(&self, addr: &str, plan: &Plan, tokens: usize) -> Option<KvExport> {
        if tokens == 0 {
            return None;
        }
        let channel = tandem_net::channel(
            addr,
            self.tls.as_ref().map(tandem_net::tls::Tls::client_config),
        );
        let want = FetchWant {
            fingerprint: self.model.fingerprint.0,
            layout: tandem_worker::wire_layout(self.kv_layout),
            idle: FETCH_IDLE,
        };
        let request = pb::FetchRequest {
            request_id: plan.request_id.clone(),
            model_fingerprint: self.model.fingerprint.0.to_vec().into(),
            token_ids: plan.prompt[..tokens].to_vec(),
            cache_salt: plan.cache_salt.clone(),
        };
        let fetched = match channel {
            Ok(channel) => tandem_transfer::fetch::fetch(channel, request, &want).await,
            Err(e) => Err(tandem_transfer::Error::Transport {
                code: tonic::Code::InvalidArgument,
                message: e.to_string(),
            }),
        };
        match fetched {
            Ok(kv) => kv.map(|kv| tandem_worker::kv_export(self.kv_layout, kv)),
            Err(e) => {
                self.shared.metrics.fetch_failures.inc();
                tracing::warn!(holder = addr, error = %e, "peer fetch failed; computing instead");
                None
            }
        }
    }

    /// The drain's hand-off: refuses new requests, hands the running streams off, and waits
    /// until they have ended and their kept KV was fetched, or `bound` passed.
    pub(crate) async fn hand_off(&self, bound: Duration) {
        let handoffs = &self.shared.handoffs;
        self.draining.cancel();
        let started = Instant::now();
        while started.elapsed() < bound && (!self.tracker.is_empty() || handoffs.pending() > 0) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let (streams, unfetched) = (self.tracker.len(), handoffs.pending());
        tracing::info!(
            ms = started.elapsed().as_millis() as u64,
            streams,
            unfetched,
            "hand-off over"
        );
    }
}
