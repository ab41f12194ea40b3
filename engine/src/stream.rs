//! Turning sampled tokens into a finished generation: end-of-generation ids (and
//! `stop_token_ids`, banned from sampling before `min_tokens` or, with `ignore_eos`, always),
//! `max_tokens`, stop strings, and streaming-safe text. [`Stream`] is the per-request state any
//! loop (the local CLI, a decode server's scheduler, a prefill node's first token) feeds one
//! token at a time.

use serde::Serialize;

use crate::engine::Model;
use crate::error::{Error, Result};
use crate::grammar::{Constraint, Grammar};
use crate::sampling::{History, SamplingParams, TokenLogprobs, logprobs, sample};
use tandem_tokenizer::{TokenDecoder, Tokenizer};

#[derive(Clone, Debug, PartialEq, Default)]
pub struct GenerateParams {
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    /// Text that ends the generation; it is not included in the output text.
    pub stop: Vec<String>,
    /// More ids that end the generation, as the model's end-of-generation ids do (not output).
    pub stop_token_ids: Vec<u32>,
    /// No end-of-generation id is sampled: the generation runs to `max_tokens` or a stop.
    pub ignore_eos: bool,
    /// Neither an end-of-generation id nor a `stop_token_ids` id is sampled before this many
    /// tokens; at most `max_tokens`.
    pub min_tokens: usize,
    /// Each output token's log-probability, and this many most likely alternatives'; `None`:
    /// none. The cost is a pass over the logits per token, whatever the count.
    pub logprobs: Option<usize>,
    /// What the output must match; an end-of-generation id comes where the grammar may end,
    /// and must come once it has ended.
    pub grammar: Option<Grammar>,
}

impl GenerateParams {
    pub fn validate(&self) -> Result<()> {
        self.sampling.validate()?;
        if self.max_tokens == 0 {
            return Err(Error::InvalidArgument {
                field: "max_tokens",
                reason: "must be at least 1".into(),
            });
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(Error::InvalidArgument {
                field: "stop",
                reason: "stop strings must not be empty".into(),
            });
        }
        if self.min_tokens > self.max_tokens {
            return Err(Error::InvalidArgument {
                field: "min_tokens",
                reason: format!(
                    "min_tokens {} is more than max_tokens {}",
                    self.min_tokens, self.max_tokens
                ),
            });
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    Stop,
    Length,
}

/// What one accepted token produced.
#[derive(Debug, PartialEq)]
pub struct Emission {
    /// The token to output; `None` for an end-of-generation id, which is never output.
    pub token: Option<u32>,
    /// Text that is now safe to show.
    pub text: String,
    pub finished: Option<FinishReason>,
    /// The token's log-probabilities, when the request asks for them.
    pub logprobs: Option<TokenLogprobs>,
}

/// One request's generation state.
#[derive(Debug)]
pub struct Stream {
    params: GenerateParams,
    decoder: TokenDecoder,
    /// Decoded text not yet shown because it might begin a stop string.
    held: String,
    generated: usize,
    /// The tokens so far, for the penalties.
    history: History,
    /// The log-probabilities of the token sampled last, for its [`Emission`].
    sampled: Option<TokenLogprobs>,
    /// The request's grammar, where it stands.
    constraint: Option<Constraint>,
}

impl Stream {
    /// A generation that continues `prompt`; fails if its grammar does not compile.
    pub fn new(params: GenerateParams, model: &Model, prompt: &[u32]) -> Result<Self> {
        let constraint = params
            .grammar
            .as_ref()
            .map(|g| model.grammars.compile(g, &model.tokenizer))
            .transpose()?
            .flatten();
        Ok(Self {
            params,
            decoder: TokenDecoder::default(),
            held: String::new(),
            generated: 0,
            history: History::new(prompt, &[]),
            sampled: None,
            constraint,
        })
    }

    /// The state after `generated` tokens followed `prompt` and their emissions were already
    /// delivered (a generation resumed on another node): what follows equals an uninterrupted
    /// run, the grammar's state included. Fails if those tokens already end the generation.
    pub fn resume(
        params: GenerateParams,
        model: &Model,
        prompt: &[u32],
        generated: &[u32],
    ) -> Result<Self> {
        let mut stream = Self::new(params, model, prompt)?;
        for &token in generated {
            if stream.accept(&model.tokenizer, token).finished.is_some() {
                return Err(Error::InvalidArgument {
                    field: "resumed_tokens",
                    reason: "the resumed tokens already finish the generation".into(),
                });
            }
        }
        Ok(stream)
    }

    /// Tokens still allowed before `max_tokens`.
    pub fn remaining(&self) -> usize {
        self.params.max_tokens.saturating_sub(self.generated)
    }

    /// Samples the token at absolute `position` from `logits` (and keeps its log-probabilities
    /// for [`Stream::accept`] when the request asks for them).
    pub fn sample(&mut self, tokenizer: &Tokenizer, logits: &[f32], position: usize) -> u32 {
        let early = self.generated < self.params.min_tokens;
        // A grammar that has ended leaves only the end: it is not banned then.
        let ended = self.constraint.as_ref().is_some_and(Constraint::ended);
        let banned: Vec<u32> = match (self.params.ignore_eos || early, early) {
            (false, _) => Vec::new(),
            _ if ended => Vec::new(),
            (true, false) => tokenizer.eog_ids().to_vec(),
            (true, true) => [tokenizer.eog_ids(), &self.params.stop_token_ids].concat(),
        };
        let masked;
        let allowed = match &mut self.constraint {
            None => logits,
            Some(c) => {
                let mut l = logits.to_vec();
                c.mask(&mut l);
                masked = l;
                &masked[..]
            }
        };
        let token = sample(
            allowed,
            &self.params.sampling,
            position as u64,
            &self.history,
            &banned,
        );
        self.sampled = self.params.logprobs.map(|k| logprobs(logits, token, k));
        token
    }

    /// The log-probabilities of the token sampled last, taken (a prefill node sends them with
    /// the first token).
    pub fn take_logprobs(&mut self) -> Option<TokenLogprobs> {
        self.sampled.take()
    }

    /// The log-probabilities of the next token accepted, which was sampled elsewhere (a prefill
    /// node's first token).
    pub fn carry_logprobs(&mut self, logprobs: Option<TokenLogprobs>) {
        self.sampled = logprobs;
    }

    /// Accepts a sampled token.
    pub fn accept(&mut self, tokenizer: &Tokenizer, token: u32) -> Emission {
        let logprobs = self.sampled.take();
        if tokenizer.eog_ids().contains(&token) || self.params.stop_token_ids.contains(&token) {
            let text = self.flush();
            return Emission {
                token: None,
                text,
                finished: Some(FinishReason::Stop),
                logprobs: None,
            };
        }
        self.generated += 1;
        self.history.push(token);
        if let Some(c) = &mut self.constraint {
            c.accept(token);
        }
        self.held.push_str(&self.decoder.push(tokenizer, token));
        let mut text = self.release_text();
        let mut finished = text.1.then_some(FinishReason::Stop);
        if finished.is_none() && self.generated >= self.params.max_tokens {
            text.0.push_str(&self.flush());
            finished = Some(FinishReason::Length);
        }
        Emission {
            token: Some(token),
            text: text.0,
            finished,
            logprobs,
        }
    }

    /// Returns the text that can be shown and whether a stop string was hit.
    fn release_text(&mut self) -> (String, bool) {
        let hit = self
            .params
            .stop
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = hit {
            let text = self.held[..at].to_string();
            self.held.clear();
            return (text, true);
        }
        // Hold back the longest tail that could still grow into a stop string.
        let keep = self
            .params
            .stop
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&n| s.is_char_boundary(n) && self.held.ends_with(&s[..n]))
                    .max()
            })
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let rest = self.held.split_off(cut);
        (std::mem::replace(&mut self.held, rest), false)
    }

    fn flush(&mut self) -> String {
        let tail = self.decoder.finish();
        self.held.push_str(&tail);
        std::mem::take(&mut self.held)
    }
}
