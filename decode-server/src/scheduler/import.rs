//! Pushed KV copied into the pool a few layers at a time between steps. A long prompt's KV is
//! tens of megabytes; copied at once, it would lengthen one inter-token gap of every running
//! stream by the whole copy. Spread over rounds, each gap grows by at most about
//! [`IMPORT_SHARE_OF_STEP`] of a plain step. With nothing decoding, an import goes at once.

use std::time::Instant;

use tandem_engine::{KvExport, SeqId};

use super::{Joining, Scheduler};
use crate::ticket::Ticket;

/// A sequence whose pushed KV is being copied into the pool.
pub(super) struct Importing {
    pub(super) seq: SeqId,
    kv: KvExport,
    first_token: u32,
    pub(super) joining: Joining,
    /// Layers copied so far.
    layers: usize,
}

/// Between two steps, copying pushed KV takes about this share of a plain step's time (at
/// least one layer).
const IMPORT_SHARE_OF_STEP: f64 = 0.1;

impl Importing {
    /// `joining`'s stream already carries the first token's log-probabilities.
    pub(super) fn new(seq: SeqId, kv: KvExport, first_token: u32, joining: Joining) -> Self {
        Self {
            seq,
            kv,
            first_token,
            joining,
            layers: 0,
        }
    }
}

impl Scheduler {
    /// Copies the next layers of the waiting imports, oldest first: within
    /// [`IMPORT_SHARE_OF_STEP`] of a plain step while sequences decode, all of them otherwise.
    /// A sequence whose import is done joins the batch.
    pub(super) fn import_some(&mut self) {
        if self.importing.is_empty() {
            return;
        }
        let budget = if self.active.is_empty() {
            f64::INFINITY
        } else {
            self.plain_step_secs * IMPORT_SHARE_OF_STEP
        };
        let started = Instant::now();
        while !self.importing.is_empty() && started.elapsed().as_secs_f64() <= budget {
            self.import_layer(0);
        }
        let secs = started.elapsed().as_secs_f64();
        self.shared.metrics.kv_import_seconds.observe(secs);
    }

    /// Copies the rest of `ticket`'s import now (a drain hands off only what the pool holds).
    pub(super) fn finish_import(&mut self, ticket: Ticket) {
        while let Some(i) = (self.importing.iter()).position(|i| i.joining.ticket == ticket) {
            self.import_layer(i);
        }
    }

    /// Copies the next layer of the `i`th import; the sequence joins the batch (or fails) when
    /// its import ends.
    fn import_layer(&mut self, i: usize) {
        let Some(im) = self.importing.get_mut(i) else {
            return;
        };
        let end = (im.layers + 1).min(im.kv.layout.n_layers);
        let copied = self.engine.import_kv_layers(im.seq, &im.kv, im.layers..end);
        im.layers = end;
        let done = copied.is_err() || end == im.kv.layout.n_layers;
        if !done {
            return;
        }
        let Some(im) = self.importing.remove(i) else {
            return;
        };
        match copied {
            Ok(()) => self.join(im.seq, im.joining, im.first_token),
            Err(e) => self.fail(im.seq, &im.joining.events, e),
        }
    }
}
