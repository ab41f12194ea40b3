//! A prompt computed a layer at a time over all its rows, rather than a chunk at a time through
//! every layer: what a stage of a pipelined prefill does. It computes layer `l` of its part of
//! the prompt as soon as the stage before has sent layer `l` of the prefix's KV, and sends its
//! own layer `l` on before it computes the next.
//!
//! ```text
//! begin_layers(seq, at, tokens)       the sequence holds [0, held); [held, at) arrives by layer
//! for l in 0..layers:
//!     import_layer(&mut pass, k, v)   layer l of [held, at) (when held < at)
//!     next_layer(&mut pass, progress) layer l of [at, end), chunk by chunk
//!     export_layer(&pass, l, range)   any rows of layer l it holds, to send on
//! finish_layers(pass)                 the last row's logits; the sequence holds [0, end)
//! ```
//!
//! Each chunk of rows (cut as [`Engine::prefill`] cuts a prompt) runs through a layer as a
//! forward pass runs it, and a row's result does not depend on the rows computed beside it, so
//! the bits are a prefill's.

use std::ops::Range;

use super::{Compute, Engine, SeqId};
use crate::error::{Error, Result};
use crate::model::{self, Hidden, Row, Scratch, Shape};

/// A prompt being computed a layer at a time ([`Engine::begin_layers`]).
#[derive(Debug)]
pub struct Layered {
    seq: SeqId,
    /// The sequence's length when the pass began: the rows `[held, at)` arrive by import.
    held: usize,
    at: usize,
    tokens: Vec<u32>,
    chunk: usize,
    /// Per chunk of rows: its state between layers and its shape (empty when simulated).
    hidden: Vec<(Hidden, Shape)>,
    scratch: Scratch,
    /// Layers computed, and layers of `[held, at)` imported.
    done: usize,
    imported: usize,
}

impl Layered {
    /// The sequence's length once the pass is finished.
    pub fn end(&self) -> usize {
        self.at + self.tokens.len()
    }

    /// Layers computed so far.
    pub fn layers_done(&self) -> usize {
        self.done
    }

    /// The rows of chunk `ci` over `blocks`.
    fn rows<'a>(&self, blocks: &'a [u32], ci: usize, want_last: bool) -> Vec<Row<'a>> {
        let pos0 = self.at + ci * self.chunk;
        let chunk = self.tokens.chunks(self.chunk).nth(ci).unwrap_or_default();
        (chunk.iter().enumerate())
            .map(|(i, &token)| Row {
                blocks,
                pos: pos0 + i,
                token,
                want_logits: want_last && i + 1 == chunk.len(),
            })
            .collect()
    }

    fn chunks(&self) -> usize {
        self.tokens.len().div_ceil(self.chunk)
    }
}

impl Engine {
    /// Begins computing `tokens` onto `seq` a layer at a time, at positions from `at`. The
    /// sequence holds its first `held` tokens; when `held < at`, the rows `[held, at)` of each
    /// layer must be imported ([`Engine::import_layer`]) before that layer is computed.
    pub fn begin_layers(&mut self, seq: SeqId, at: usize, tokens: &[u32]) -> Result<Layered> {
        let invalid = |reason: String| Error::InvalidArgument {
            field: "tokens",
            reason,
        };
        if tokens.is_empty() {
            return Err(invalid("at least one token is required".into()));
        }
        self.model.config.check_token_ids("token_ids", tokens)?;
        let held = self.seq_len(seq)?;
        if at < held {
            return Err(invalid(format!(
                "position {at} is inside the sequence's {held} tokens"
            )));
        }
        self.reserve(seq, at + tokens.len())?;
        let mut pass = Layered {
            seq,
            held,
            at,
            tokens: tokens.to_vec(),
            chunk: self.config.prefill_chunk_tokens,
            hidden: Vec::new(),
            scratch: Scratch::new(&self.model.config, 0),
            done: 0,
            imported: 0,
        };
        if let Compute::Weights(w) = &self.model.compute {
            let (cfg, blocks) = (&self.model.config, &self.seq(seq)?.blocks);
            let mut scratch = Scratch::new(cfg, pass.chunk.min(tokens.len()));
            pass.hidden = self.threads.install(|| {
                (0..pass.chunks())
                    .map(|ci| {
                        let rows = pass.rows(blocks, ci, false);
                        let hidden = model::embed(cfg, w, &rows, &mut scratch);
                        (hidden, Shape::new(cfg, &rows))
                    })
                    .collect()
            });
            pass.scratch = scratch;
        }
        Ok(pass)
    }

    /// Copies the next layer of the rows `[held, at)` (laid out as [`Engine::export_kv`] lays
    /// them out) into the pass's sequence.
    pub fn import_layer(&mut self, pass: &mut Layered, k: &[u8], v: &[u8]) -> Result<()> {
        let layer = pass.imported;
        if pass.held == pass.at || layer >= self.model.config.n_layers {
            return Err(Error::KvImport {
                reason: format!(
                    "layer {layer}: the pass imports {} layers of {:?}",
                    self.model.config.n_layers,
                    pass.held..pass.at
                ),
            });
        }
        let seq = self.seqs.get(&pass.seq);
        let blocks = &seq.ok_or(Error::UnknownSequence(pass.seq.0))?.blocks;
        (self.pool).import_layer(blocks, pass.held..pass.at, layer, [k, v])?;
        pass.imported += 1;
        Ok(())
    }

    /// Computes the next layer over all the pass's rows, calling `progress` after each chunk
    /// of them; returns its index.
    pub fn next_layer(
        &mut self,
        pass: &mut Layered,
        progress: &(dyn Fn() + Sync),
    ) -> Result<usize> {
        let (cfg, li) = (&self.model.config, pass.done);
        if li >= cfg.n_layers || (pass.held < pass.at && pass.imported <= li) {
            return Err(Error::InvalidArgument {
                field: "layer",
                reason: format!(
                    "layer {li} of {}: its prefix rows have not been imported",
                    cfg.n_layers
                ),
            });
        }
        let blocks = &self
            .seqs
            .get(&pass.seq)
            .ok_or(Error::UnknownSequence(pass.seq.0))?
            .blocks;
        let pool = &mut self.pool;
        match &self.model.compute {
            Compute::Weights(w) => {
                let rows: Vec<Vec<Row<'_>>> = (0..pass.chunks())
                    .map(|ci| pass.rows(blocks, ci, false))
                    .collect();
                let (hidden, scratch) = (&mut pass.hidden, &mut pass.scratch);
                self.threads.install(|| {
                    for ((h, shape), rows) in hidden.iter_mut().zip(&rows) {
                        model::layer(cfg, w, pool, (rows, shape), li, h, scratch);
                        progress();
                    }
                });
            }
            Compute::Simulated(s) => {
                for ci in 0..pass.chunks() {
                    let whole = s.profile.forward_time(&pass.rows(blocks, ci, false));
                    std::thread::sleep(whole / cfg.n_layers as u32);
                    progress();
                }
            }
        }
        pass.done += 1;
        Ok(li)
    }

    /// The KV of layer `layer` of the pass's sequence for `tokens`: rows it held, imported or
    /// computed, laid out as [`Engine::export_kv`] lays them out.
    pub fn export_layer(
        &self,
        pass: &Layered,
        layer: usize,
        tokens: Range<usize>,
    ) -> Result<[Vec<u8>; 2]> {
        let ready = |rows: Range<usize>, layers: usize| {
            rows.is_empty()
                || tokens.end <= rows.start
                || tokens.start >= rows.end
                || layer < layers
        };
        if tokens.start > tokens.end
            || tokens.end > pass.end()
            || !ready(pass.held..pass.at, pass.imported)
            || !ready(pass.at..pass.end(), pass.done)
        {
            return Err(Error::InvalidArgument {
                field: "tokens",
                reason: format!("layer {layer} of {tokens:?} is not ready"),
            });
        }
        let blocks = &self.seq(pass.seq)?.blocks;
        Ok(self.pool.export_layer(blocks, tokens, layer))
    }

    /// Ends a pass whose every layer is computed: the sequence holds its tokens, and the last
    /// row's logits are returned.
    pub fn finish_layers(&mut self, pass: Layered) -> Result<Vec<f32>> {
        let layers = self.model.config.n_layers;
        if pass.done < layers || (pass.held < pass.at && pass.imported < layers) {
            return Err(Error::InvalidArgument {
                field: "layer",
                reason: format!("{} of {layers} layers computed", pass.done),
            });
        }
        let blocks = &self.seq(pass.seq)?.blocks;
        let last = pass.chunks() - 1;
        let rows = pass.rows(blocks, last, true);
        let cfg = &self.model.config;
        let logits = match (&self.model.compute, pass.hidden.last()) {
            (Compute::Weights(w), Some((hidden, _))) => {
                (self.threads).install(|| model::logits(cfg, w, &rows, &hidden.x, Vec::new()))
            }
            (Compute::Simulated(s), _) => s.logits(cfg, &rows, Vec::new()),
            // `begin_layers` embeds at least one chunk.
            (Compute::Weights(_), None) => return Err(Error::UnknownSequence(pass.seq.0)),
        };
        let end = pass.end();
        if let Some(s) = self.seqs.get_mut(&pass.seq) {
            s.len = end;
        }
        Ok(logits.into_last())
    }
}
