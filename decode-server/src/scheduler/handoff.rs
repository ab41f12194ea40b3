//! Hand-offs at drain: a running (or waiting) sequence's KV kept in the cache for a peer to
//! fetch, within the bytes the drain may keep.

use super::Scheduler;
use super::slots::Slotless;
use crate::classes::Ready;
use crate::ticket::Ticket;

impl Scheduler {
    /// Keeps a running (or waiting) sequence's KV in the cache for a peer to fetch, within the
    /// hand-off budget; the tokens kept.
    pub(super) fn hand_off(&mut self, ticket: Ticket) -> usize {
        let in_pool = |r: &&Ready<Slotless>| r.item.in_pool();
        let slotless = self.ready.get(ticket).filter(in_pool);
        let Some(a) = self
            .active
            .get(&ticket)
            .or(slotless.map(|r| &r.item.active))
        else {
            return 0;
        };
        let (seq, tokens) = (a.decoding.seq, a.decoding.tokens.clone());
        let salt = a.cache_salt.clone();
        let held = self.engine.seq_len(seq).unwrap_or(0).min(tokens.len());
        let kept = held / tandem_engine::BLOCK_TOKENS * tandem_engine::BLOCK_TOKENS;
        let bytes = (kept * self.engine.kv_layout().token_bytes()) as u64;
        if bytes > self.handoff_budget {
            return 0;
        }
        // Nothing kept (the cache is off, or no whole block) is nothing handed off.
        let Some(last) = self.keep(seq, &salt, &tokens[..kept]) else {
            return 0;
        };
        self.handoff_budget -= bytes;
        self.shared.handoffs.kept(last);
        let m = &self.shared.metrics;
        m.handed_off_streams.inc();
        m.handed_off_tokens.inc_by(kept as u64);
        kept
    }

    /// The KV of the running and waiting sequences' whole blocks, in bytes: what their own
    /// hand-offs would keep.
    pub(super) fn running_bytes(&self) -> u64 {
        let token_bytes = self.engine.kv_layout().token_bytes() as u64;
        self.active
            .values()
            .chain(self.slotless_in_pool())
            .map(|a| {
                let held = self.engine.seq_len(a.decoding.seq).unwrap_or(0);
                (held / tandem_engine::BLOCK_TOKENS * tandem_engine::BLOCK_TOKENS) as u64
            })
            .sum::<u64>()
            * token_bytes
    }
}
