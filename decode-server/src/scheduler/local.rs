//! Local prefill: a prompt computed on this node, a chunk per step beside the batch (sized to
//! add about [`CHUNK_SHARE_OF_STEP`] of a plain step's time), or an engine chunk at a time with
//! nothing decoding.

use std::time::Instant;

use tandem_engine::SeqId;

use super::{Event, Joining, Scheduler};

/// A sequence whose prompt is being computed here, a chunk per step.
pub(super) struct Prefilling {
    pub(super) seq: SeqId,
    pub(super) joining: Joining,
    /// Prompt tokens the sequence holds so far.
    pub(super) done: usize,
    /// Tokens computed here, and the time of the passes that computed them (with the steps
    /// they rode on): the node's local prefill speed, as a request sees it.
    computed: usize,
    compute_secs: f64,
    /// What a token of the last chunk added to its step: what the next one costs, at about this
    /// context (attention makes a token dearer the longer its prompt so far).
    pub(super) secs_per_token: Option<f64>,
    /// The last chunk's size: the next is at most twice it.
    pub(super) last_chunk: usize,
    started: Instant,
}

/// The fewest prompt tokens a step computes while sequences decode.
const MIN_CHUNK_TOKENS: usize = 1;
/// A step's prompt chunk adds about this share of a plain step's time, so that the batch's
/// inter-token gaps grow by less than that share while a prompt is prefilled here.
const CHUNK_SHARE_OF_STEP: f64 = 0.6;
/// One step in this many goes without a chunk, to measure what a plain step costs now (the
/// batch's contexts grow as it decodes).
pub(super) const PLAIN_STEP_EVERY: u32 = 8;

impl Prefilling {
    /// A sequence that holds the first `done` tokens of its prompt, the rest to compute here.
    pub(super) fn new(seq: SeqId, joining: Joining, done: usize) -> Self {
        Self {
            seq,
            joining,
            done,
            computed: 0,
            compute_secs: 0.0,
            secs_per_token: None,
            last_chunk: MIN_CHUNK_TOKENS,
            started: Instant::now(),
        }
    }

    /// The prompt is computed up to `end`, by a pass (alone, or with a batch step) of `secs`.
    pub(super) fn computed_to(&mut self, end: usize, secs: f64) {
        self.compute_secs += secs;
        self.computed += end - self.done;
        self.done = end;
    }
}

impl Scheduler {
    /// How many prompt tokens the next step computes of `p`: what adds
    /// [`CHUNK_SHARE_OF_STEP`] of a plain step at what a token of `p`'s last chunk added (before
    /// its first, [`MIN_CHUNK_TOKENS`]), at most twice the last chunk and an engine chunk.
    pub(super) fn chunk_tokens(&self, p: &Prefilling) -> usize {
        let most = self.engine.prefill_chunk_tokens();
        let Some(secs_per_token) = p.secs_per_token else {
            return MIN_CHUNK_TOKENS.min(most);
        };
        let budget = self.plain_step_secs * CHUNK_SHARE_OF_STEP;
        let fits = (budget / secs_per_token.max(1e-9)) as usize;
        fits.min(2 * p.last_chunk)
            .clamp(MIN_CHUNK_TOKENS.min(most), most)
    }

    /// With nothing decoding, computes the next engine chunk of the oldest prompt being
    /// prefilled here.
    pub(super) fn prefill_alone(&mut self) {
        let most = self.engine.prefill_chunk_tokens();
        let Some(p) = self.prefilling.front_mut() else {
            return;
        };
        let end = (p.done + most).min(p.joining.prompt.len());
        let started = Instant::now();
        let result = self.engine.prefill(p.seq, &p.joining.prompt[p.done..end]);
        p.computed_to(end, started.elapsed().as_secs_f64());
        match result {
            Ok(_) if end < p.joining.prompt.len() => {}
            Ok(logits) => self.prefilled(logits),
            Err(e) => {
                if let Some(p) = self.prefilling.pop_front() {
                    self.fail(p.seq, &p.joining.events, e);
                }
            }
        }
    }

    /// The front prompt is computed: the last chunk's logits give the first token, sampled
    /// exactly as a prefill node would, and the sequence joins the batch.
    pub(super) fn prefilled(&mut self, logits: Vec<f32>) {
        let Some(mut p) = self.prefilling.pop_front() else {
            return;
        };
        self.shared.throughput.record(p.computed, p.compute_secs);
        self.shared
            .metrics
            .local_prefill_tokens
            .inc_by(p.computed as u64);
        let ms = p.started.elapsed().as_secs_f64() * 1e3;
        let _ = p.joining.events.try_send(Event::Prefilled { ms });
        let first = p.joining.stream.sample(
            &self.engine.model().tokenizer,
            &logits,
            p.joining.prompt.len(),
        );
        self.join(p.seq, p.joining, first);
    }
}
