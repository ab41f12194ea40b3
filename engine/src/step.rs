//! The decode step: every sequence of a batch advanced by one forward pass, fed its pending
//! token and (with speculation, [`crate::speculate`]) a draft, optionally with a chunk of
//! another sequence's prompt in the same pass.

use crate::engine::{Engine, SeqId, Want};
use crate::error::Result;
use crate::speculate::{Drafter, SpeculateConfig, lookup};
use crate::stream::{Emission, Stream};

/// A sequence being decoded.
#[derive(Debug)]
pub struct Decoding {
    pub seq: SeqId,
    pub stream: Stream,
    /// The tokens whose KV the sequence holds (prompt and generated tokens, `next` not yet).
    pub tokens: Vec<u32>,
    /// The last accepted token, fed at the next step.
    pub next: u32,
    pub drafter: Drafter,
    /// Whether the next steps may draft for it (with speculation on); a scheduler turns it off
    /// to keep a sequence to one row a step. Its tokens are the same either way.
    pub may_draft: bool,
}

impl Decoding {
    pub fn new(seq: SeqId, stream: Stream, tokens: Vec<u32>, next: u32) -> Self {
        Self {
            seq,
            stream,
            tokens,
            next,
            drafter: Drafter::default(),
            may_draft: true,
        }
    }
}

/// What one [`Engine::decode_step`] did.
#[derive(Debug)]
pub struct Step {
    /// Each sequence's emissions, in batch order: at least one, and the last finishes the
    /// generation if any does (the sequence should then leave).
    pub emissions: Vec<Vec<Emission>>,
    /// Tokens drafted in this step, and how many of them were accepted.
    pub drafted: usize,
    pub accepted: usize,
}

/// A run of another sequence's prompt, computed in the same forward pass as a decode step
/// ([`Engine::decode_step_with`]).
#[derive(Debug, Clone, Copy)]
pub struct PromptChunk<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    /// The chunk ends the prompt: its last position's logits are wanted.
    pub last: bool,
}

impl Engine {
    /// Advances every sequence of the batch: feeds its pending token (and, with speculation,
    /// a draft), samples and accepts.
    pub fn decode_step(&mut self, batch: &mut [&mut Decoding]) -> Result<Step> {
        self.decode_step_with(batch, None).map(|(step, _)| step)
    }

    /// [`Engine::decode_step`], with `chunk` appended to its sequence in the same forward pass:
    /// the weights are read once for both, so the chunk costs the step little more than its
    /// own arithmetic. Every position's result is what it would be in a pass of its own.
    /// Returns the chunk's last logits when it ends its prompt.
    pub fn decode_step_with(
        &mut self,
        batch: &mut [&mut Decoding],
        chunk: Option<PromptChunk<'_>>,
    ) -> Result<(Step, Option<Vec<f32>>)> {
        if let Some(c) = chunk {
            // The chunk's blocks first: drafts take only what is free after them.
            let len = self.seq_len(c.seq)?;
            self.reserve(c.seq, len + c.tokens.len())?;
        }
        let drafts = self.drafts(batch, &self.config().speculate);
        let inputs: Vec<Vec<u32>> = batch
            .iter()
            .zip(&drafts)
            .map(|(d, draft)| {
                std::iter::once(d.next)
                    .chain(draft.iter().copied())
                    .collect()
            })
            .collect();
        let mut rows: Vec<(SeqId, &[u32], Want)> = batch
            .iter()
            .zip(&inputs)
            .map(|(d, input)| (d.seq, &input[..], Want::All))
            .collect();
        if let Some(c) = chunk {
            rows.push((
                c.seq,
                c.tokens,
                if c.last { Want::Last } else { Want::None },
            ));
        }
        let started = std::time::Instant::now();
        let logits = self.append(&rows)?;
        let total_rows: usize = inputs.iter().map(Vec::len).sum();
        // The cost model prices decode rows; a prompt chunk's rows cost what their context does.
        if chunk.is_none() {
            self.step_costs
                .record(total_rows, started.elapsed().as_secs_f64());
        }
        let chunk_logits = chunk
            .filter(|c| c.last)
            .map(|_| logits.row(total_rows).to_vec());
        let model = self.model().clone();
        let tokenizer = &model.tokenizer;
        let mut step = Step {
            emissions: Vec::with_capacity(batch.len()),
            drafted: 0,
            accepted: 0,
        };
        let mut row = 0;
        for ((d, draft), input) in batch.iter_mut().zip(&drafts).zip(&inputs) {
            let mut emissions = Vec::new();
            let mut fed = 0;
            for j in 0..input.len() {
                fed = j + 1;
                let position = d.tokens.len() + j + 1;
                let token = d.stream.sample(tokenizer, logits.row(row + j), position);
                let emission = d.stream.accept(tokenizer, token);
                let finished = emission.finished.is_some();
                emissions.push(emission);
                d.next = token;
                if finished || draft.get(j) != Some(&token) {
                    break;
                }
            }
            row += input.len();
            d.drafter.record(draft.len(), fed - 1);
            step.drafted += draft.len();
            step.accepted += fed - 1;
            d.tokens.extend(&input[..fed]);
            self.truncate(d.seq, d.tokens.len())?;
            step.emissions.push(emissions);
        }
        self.recycle(logits);
        Ok((step, chunk_logits))
    }

    /// Each sequence's draft for this step: candidates from [`lookup`] (within the remaining
    /// `max_tokens` and the context), cut to the number of rows that maximises expected tokens
    /// per second; none if the batch leaves no room, or their KV would need more than the free
    /// blocks (drafts never evict cached blocks).
    fn drafts(&self, batch: &[&mut Decoding], spec: &SpeculateConfig) -> Vec<Vec<u32>> {
        let mut drafts = vec![Vec::new(); batch.len()];
        if !spec.enabled || batch.len() >= spec.max_rows {
            return drafts;
        }
        let context_len = self.model().config.context_len;
        let mut context = Vec::new();
        // Every candidate token's worth (p^j), with its sequence.
        let mut gains: Vec<(f64, usize)> = Vec::new();
        for (i, (d, draft)) in batch.iter().zip(&mut drafts).enumerate() {
            let room = (d.stream.remaining().saturating_sub(1))
                .min(context_len.saturating_sub(d.tokens.len() + 1))
                .min(spec.max_draft);
            if room == 0 || !d.may_draft {
                continue;
            }
            context.clear();
            context.extend(&d.tokens);
            context.push(d.next);
            draft.extend(lookup(&context, spec.min_ngram, spec.max_ngram, room));
            let p = d.drafter.acceptance();
            gains.extend((1..=draft.len()).map(|j| (p.powi(j as i32), i)));
        }
        gains.sort_by(|a, b| b.0.total_cmp(&a.0));
        gains.truncate(spec.max_rows - batch.len());
        // The number of draft tokens whose step yields the most expected tokens per second.
        let (mut best, mut best_rate) = (
            0,
            batch.len() as f64 / self.step_costs.estimate(batch.len()),
        );
        let mut expected = batch.len() as f64;
        for (n, (gain, _)) in gains.iter().enumerate() {
            expected += gain;
            let rate = expected / self.step_costs.estimate(batch.len() + n + 1);
            if rate > best_rate {
                (best, best_rate) = (n + 1, rate);
            }
        }
        let mut keep = vec![0; batch.len()];
        for &(_, i) in &gains[..best] {
            keep[i] += 1;
        }
        for (draft, keep) in drafts.iter_mut().zip(keep) {
            draft.truncate(keep);
        }
        let need: usize = batch
            .iter()
            .zip(&drafts)
            .map(|(d, draft)| self.blocks_to_hold(d.seq, d.tokens.len() + 1 + draft.len()))
            .sum();
        if need > self.pool_free_blocks() {
            drafts.iter_mut().for_each(Vec::clear);
        }
        drafts
    }
}
