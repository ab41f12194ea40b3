//! A sequence's KV as bytes: copied out for a transfer, and copied into a sequence that
//! receives one.

use std::ops::Range;

use super::{Engine, KvExport, SeqId};
use crate::error::{Error, Result};

impl KvExport {
    /// The bytes it holds, keys and values of every layer.
    pub fn byte_len(&self) -> u64 {
        self.layers.iter().flatten().map(|b| b.len() as u64).sum()
    }
}

impl Engine {
    /// Copies out the KV of `tokens` (a range within the sequence).
    pub fn export_kv(&self, seq: SeqId, tokens: Range<usize>) -> Result<KvExport> {
        let s = self.seq(seq)?;
        if tokens.start > tokens.end || tokens.end > s.len {
            return Err(Error::InvalidArgument {
                field: "tokens",
                reason: format!(
                    "range {tokens:?} is outside the sequence of {} tokens",
                    s.len
                ),
            });
        }
        let layers = (0..self.model.config.n_layers)
            .map(|l| self.pool.export_layer(&s.blocks, tokens.clone(), l))
            .collect();
        Ok(KvExport {
            layout: self.pool.layout(),
            tokens,
            layers,
        })
    }

    /// Appends imported KV to `seq`, which must hold exactly the tokens before the export's
    /// range. Everything is checked before the sequence changes.
    pub fn import_kv(&mut self, seq: SeqId, kv: &KvExport) -> Result<()> {
        self.import_kv_layers(seq, kv, 0..kv.layout.n_layers)
    }

    /// Copies `layers` of an import into `seq`, so that a large import can be spread over
    /// several calls between other work. The sequence's length grows to the export's end with
    /// the call that copies the last layer; until then its new rows are reserved but not part of
    /// it. Each call checks the whole export first, as [`Engine::import_kv`] does.
    pub fn import_kv_layers(
        &mut self,
        seq: SeqId,
        kv: &KvExport,
        layers: Range<usize>,
    ) -> Result<()> {
        let reject = |reason: String| Err(Error::KvImport { reason });
        if kv.layout != self.pool.layout() {
            return reject(format!(
                "layout {:?} differs from this model's {:?}",
                kv.layout,
                self.pool.layout()
            ));
        }
        let len = self.seq_len(seq)?;
        if kv.tokens.start != len || kv.tokens.end < kv.tokens.start {
            return reject(format!(
                "range {:?} does not extend a sequence of {len} tokens",
                kv.tokens
            ));
        }
        let want = if kv.layout.header_only {
            0
        } else {
            kv.tokens.len() * kv.layout.n_kv_heads * kv.layout.row_bytes()
        };
        if kv.layers.len() != kv.layout.n_layers
            || kv.layers.iter().flatten().any(|b| b.len() != want)
        {
            return reject(format!(
                "expected {} layers of {want} bytes each for K and V",
                kv.layout.n_layers
            ));
        }
        if layers.start > layers.end || layers.end > kv.layout.n_layers {
            return reject(format!(
                "layers {layers:?} are outside the model's {}",
                kv.layout.n_layers
            ));
        }
        self.reserve(seq, kv.tokens.end)?;
        let blocks = self.seq(seq)?.blocks.clone();
        for l in layers.clone() {
            let [k, v] = &kv.layers[l];
            (self.pool).import_layer(&blocks, kv.tokens.clone(), l, [k, v])?;
        }
        if layers.end == kv.layout.n_layers
            && let Some(s) = self.seqs.get_mut(&seq)
        {
            s.len = kv.tokens.end;
        }
        Ok(())
    }
}
