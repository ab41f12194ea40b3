//! A stage of a pipelined prefill: the prompt computed a layer at a time
//! ([`tandem_engine::Layered`]), on the prefix's KV that the stage before streams here a layer at
//! a time, each layer's KV sent on (to the next stage, or to the decode node) as soon as it is
//! computed.
//!
//! ```text
//! stage before ──layer l of [cached, at)──▶ import ─▶ layer l of [at, len) ─▶ send layer l of push
//! ```
//!
//! So the stages overlap: stage k computes layer l while stage k−1 computes layer l+1. A stage
//! does not yield to higher classes between layers: the stages after it wait on each of its
//! layers, and a stage that stopped sending for long would fail them.

use std::ops::Range;
use std::time::{Duration, Instant};

use tandem_transfer::{Expectation, KvPush, RelayReceiver};
use tokio_util::sync::CancellationToken;

use super::{Compute, Prompt, STALLED_AFTER, Upstream};
use crate::error::{Error, Result};

/// The longest a stage waits for a frame of the stage before: longer than that stage's
/// heartbeats go on while it is stuck ([`STALLED_AFTER`]).
const RELAY_IDLE: Duration = STALLED_AFTER.saturating_add(Duration::from_secs(5));

impl Compute {
    /// Computes `tokens[cached..]` onto `seq` a layer at a time (the tokens before
    /// `upstream.end` coming from the stage before, which holds more than this node's cache) and sends
    /// the KV of `push`, layer by layer. Returns the last position's logits, or `None` when the
    /// receiver ended the push early.
    pub(super) fn compute_layered(
        &mut self,
        prompt: Prompt<'_>,
        upstream: Option<Upstream>,
        push: Range<usize>,
        kv: &mut KvPush,
        cancel: &CancellationToken,
    ) -> Result<(Option<Vec<f32>>, Option<Instant>)> {
        let Prompt {
            seq,
            cached,
            tokens,
            ..
        } = prompt;
        let at = upstream.as_ref().map_or(cached, |u| u.end);
        let mut relay = match upstream {
            Some(u) => {
                self.shared.metrics.pipelined.inc();
                Some(self.open_relay(u, cached, tokens, cancel)?)
            }
            None => None,
        };
        let grid = self.engine.prefill_chunk_tokens();
        let mut pass = self.engine.begin_layers(seq, at, &tokens[at..])?;
        let mut first_chunk_sent = None;
        let shared = self.shared.clone();
        let pulse = &shared.pulse;
        for layer in 0..self.engine.model().config.n_layers {
            if cancel.is_cancelled() {
                return Err(Error::Cancelled);
            }
            self.between_chunks();
            if let Some((addr, r)) = relay.as_mut() {
                let alive = || pulse.beat();
                let [k, v] = self
                    .wait(r.next_layer(&alive), cancel)?
                    .map_err(|source| upstream_failed(addr, source))?;
                self.engine.import_layer(&mut pass, &k, &v)?;
            }
            self.engine.next_layer(&mut pass, &|| pulse.beat())?;
            pulse.beat();
            for cell in tandem_worker::grid_cells(push.clone(), grid) {
                let kv_cell = self.engine.export_layer(&pass, layer, cell.clone())?;
                for chunk in tandem_worker::layer_chunks(layer, cell, kv_cell) {
                    first_chunk_sent.get_or_insert_with(Instant::now);
                    if !self.send(kv, &chunk, cancel)? {
                        return Ok((None, first_chunk_sent));
                    }
                }
            }
        }
        if let Some((addr, r)) = relay {
            (self.wait(r.finish(), cancel)?).map_err(|source| upstream_failed(&addr, source))?;
        }
        Ok((Some(self.engine.finish_layers(pass)?), first_chunk_sent))
    }

    /// Asks the stage before for the KV of `tokens[cached..upstream.end]`, checked as a push is.
    fn open_relay(
        &self,
        upstream: Upstream,
        cached: usize,
        tokens: &[u32],
        cancel: &CancellationToken,
    ) -> Result<(String, RelayReceiver)> {
        let Upstream {
            addr,
            channel,
            end,
            mut request,
        } = upstream;
        request.cached_tokens = cached as u32;
        let model = self.engine.model();
        let layout = tandem_worker::wire_layout(self.engine.kv_layout());
        let want = Expectation {
            fingerprint: model.fingerprint.0,
            layout,
            tokens: cached as u32..end as u32,
            token_ids: tokens[cached..end].to_vec(),
            max_bytes: layout.total_bytes(end - cached),
        };
        let open = RelayReceiver::open(channel, request, want, RELAY_IDLE);
        match self.wait(open, cancel)? {
            Ok(r) => Ok((addr, r)),
            Err(source) => Err(upstream_failed(&addr, source)),
        }
    }
}

fn upstream_failed(addr: &str, source: tandem_transfer::Error) -> Error {
    tracing::warn!(stage = addr, error = %source, "the pipeline's stage before failed");
    Error::Upstream {
        addr: addr.to_string(),
        source,
    }
}
