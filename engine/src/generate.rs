//! [`Engine::generate_batch`]: the simple blocking generation loop used by the CLI, the
//! benchmarks and the tests, over [`Engine::decode_step`].

use std::time::Instant;

use serde::Serialize;

use crate::engine::Engine;
use crate::error::Result;
use crate::sampling::TokenLogprobs;
use crate::step::Decoding;
use crate::stream::{Emission, FinishReason, GenerateParams, Stream};

/// The result of a blocking generation (the JSON `tandem generate --json` prints).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GenerateOutput {
    pub prompt_token_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    /// Speculative decoding: tokens drafted, and how many of them were accepted.
    pub draft_tokens: u64,
    pub accepted_draft_tokens: u64,
    /// With [`GenerateParams::logprobs`]: one per `token_ids` entry.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<TokenLogprobs>,
}

/// One prompt and its parameters.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub params: GenerateParams,
}

struct Active {
    decoding: Decoding,
    out: GenerateOutput,
}

impl Active {
    /// Records what the generation emitted; `true` once it has finished.
    fn record(&mut self, e: Emission, i: usize, on_text: &mut dyn FnMut(usize, &str)) -> bool {
        if e.token.is_some() {
            self.out.logprobs.extend(e.logprobs);
        }
        self.out.token_ids.extend(e.token);
        self.out.text.push_str(&e.text);
        if !e.text.is_empty() {
            on_text(i, &e.text);
        }
        if let Some(reason) = e.finished {
            self.out.finish_reason = reason;
        }
        e.finished.is_some()
    }
}

impl Engine {
    /// Generates for every request: each is prefilled alone, then all decode in one continuous
    /// batch until each finishes. Sequences are freed at the end, also on error.
    pub fn generate_batch(&mut self, requests: &[GenerateRequest]) -> Result<Vec<GenerateOutput>> {
        self.generate_with(requests, &mut |_, _| {})
    }

    /// Generates for one request, handing each piece of text to `on_text` as it is produced.
    pub fn generate_streaming(
        &mut self,
        request: &GenerateRequest,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<GenerateOutput> {
        let mut out = self.generate_with(std::slice::from_ref(request), &mut |_, t| on_text(t))?;
        Ok(out.remove(0))
    }

    fn generate_with(
        &mut self,
        requests: &[GenerateRequest],
        on_text: &mut dyn FnMut(usize, &str),
    ) -> Result<Vec<GenerateOutput>> {
        let mut active = Vec::with_capacity(requests.len());
        let result = self.run_batch(requests, &mut active, on_text);
        for a in &active {
            let _ = self.free(a.decoding.seq);
        }
        result?;
        Ok(active
            .into_iter()
            .map(|a| GenerateOutput {
                draft_tokens: a.decoding.drafter.drafted,
                accepted_draft_tokens: a.decoding.drafter.accepted,
                ..a.out
            })
            .collect())
    }

    fn run_batch(
        &mut self,
        requests: &[GenerateRequest],
        active: &mut Vec<Active>,
        on_text: &mut dyn FnMut(usize, &str),
    ) -> Result<()> {
        let model = self.model().clone();
        for req in requests {
            req.params.validate()?;
            model
                .config
                .check_fits(req.prompt.len(), req.params.max_tokens)?;
            let seq = self.new_sequence();
            let t0 = Instant::now();
            let stream = Stream::new(req.params.clone(), &model, &req.prompt)?;
            active.push(Active {
                decoding: Decoding::new(seq, stream, req.prompt.clone(), 0),
                out: GenerateOutput {
                    prompt_token_ids: req.prompt.clone(),
                    token_ids: Vec::new(),
                    text: String::new(),
                    finish_reason: FinishReason::Length,
                    prefill_ms: 0.0,
                    decode_ms: 0.0,
                    draft_tokens: 0,
                    accepted_draft_tokens: 0,
                    logprobs: Vec::new(),
                },
            });
            let logits = self.prefill(seq, &req.prompt)?;
            let a = active.last_mut().expect("just pushed");
            a.decoding.next = a
                .decoding
                .stream
                .sample(&model.tokenizer, &logits, req.prompt.len());
            a.out.prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
        }
        let t0 = Instant::now();
        // Each sequence's first token; those it finishes never join the batch.
        let mut running: Vec<usize> = Vec::new();
        for (i, a) in active.iter_mut().enumerate() {
            let e = a.decoding.stream.accept(&model.tokenizer, a.decoding.next);
            if a.record(e, i, on_text) {
                a.out.decode_ms = t0.elapsed().as_secs_f64() * 1e3;
            } else {
                running.push(i);
            }
        }
        while !running.is_empty() {
            let mut batch: Vec<&mut Decoding> = active
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| running.contains(i))
                .map(|(_, a)| &mut a.decoding)
                .collect();
            let step = self.decode_step(&mut batch)?;
            let mut still = Vec::with_capacity(running.len());
            for (i, emissions) in running.into_iter().zip(step.emissions) {
                let a = &mut active[i];
                let mut finished = false;
                for e in emissions {
                    finished |= a.record(e, i, on_text);
                }
                if finished {
                    a.out.decode_ms = t0.elapsed().as_secs_f64() * 1e3;
                } else {
                    still.push(i);
                }
            }
            running = still;
        }
        Ok(())
    }
}
