//! The sampling flags every generating command shares (`generate`, `chat`), and their defaults.

use std::collections::BTreeMap;

use clap::Args;
use tandem_engine::SamplingParams;

/// Sampling flags; an unset flag takes the command's default (see [`SamplingArgs::resolve`]).
#[derive(Args, Debug, Clone)]
pub(crate) struct SamplingArgs {
    /// Sampling temperature; 0 is greedy [generate: 0; chat: 0.2].
    #[arg(long, allow_negative_numbers = true)]
    temperature: Option<f32>,
    /// Keep only the K most likely tokens; 0 keeps all [default: 0].
    #[arg(long)]
    top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches P; 1 keeps all [generate: 1;
    /// chat: 0.9].
    #[arg(long)]
    top_p: Option<f32>,
    /// Random seed; the same seed gives the same output [default: 0].
    #[arg(long)]
    seed: Option<u64>,
    /// OpenAI's frequency penalty, -2 to 2: a token's logit loses this much for each time it was
    /// generated so far [default: 0].
    #[arg(long, allow_negative_numbers = true)]
    frequency_penalty: Option<f32>,
    /// OpenAI's presence penalty, -2 to 2: every token generated so far loses this much once
    /// [default: 0].
    #[arg(long, allow_negative_numbers = true)]
    presence_penalty: Option<f32>,
    /// llama.cpp's repetition penalty over the last 64 tokens, prompt included; 1 is off
    /// [generate: 1; chat: 1.1].
    #[arg(long)]
    repetition_penalty: Option<f32>,
    /// Cut tokens whose probability (after the temperature) is under P times the most likely
    /// one's; 0 is off [default: 0].
    #[arg(long)]
    min_p: Option<f32>,
    /// Add BIAS (-100 to 100) to token ID's logit, as `ID=BIAS` (repeatable).
    #[arg(long, value_parser = parse_bias, allow_hyphen_values = true)]
    logit_bias: Vec<(u32, f32)>,
}

fn parse_bias(s: &str) -> Result<(u32, f32), String> {
    let (id, bias) = s.split_once('=').ok_or("expected ID=BIAS")?;
    let id = id
        .trim()
        .parse()
        .map_err(|_| format!("'{id}' is not a token id"))?;
    let bias = bias
        .trim()
        .parse()
        .map_err(|_| format!("'{bias}' is not a number"))?;
    Ok((id, bias))
}

/// `tandem generate`'s defaults: greedy, no penalty, so that output is the model's own.
pub(crate) const GENERATE_DEFAULTS: SamplingParams = SamplingParams::GREEDY;

/// `tandem chat`'s defaults: the model card's temperature and top-p, and a mild repetition
/// penalty, because greedy decoding makes this small model loop.
pub(crate) const CHAT_DEFAULTS: SamplingParams = SamplingParams {
    temperature: 0.2,
    top_k: 0,
    top_p: 0.9,
    seed: 0,
    frequency_penalty: 0.0,
    presence_penalty: 0.0,
    repetition_penalty: 1.1,
    min_p: 0.0,
    logit_bias: Vec::new(),
};

impl SamplingArgs {
    /// The flags over `defaults`.
    pub(crate) fn resolve(&self, defaults: &SamplingParams) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_k: self.top_k.unwrap_or(defaults.top_k),
            top_p: self.top_p.unwrap_or(defaults.top_p),
            seed: self.seed.unwrap_or(defaults.seed),
            frequency_penalty: self.frequency_penalty.unwrap_or(defaults.frequency_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(defaults.presence_penalty),
            repetition_penalty: self
                .repetition_penalty
                .unwrap_or(defaults.repetition_penalty),
            min_p: self.min_p.unwrap_or(defaults.min_p),
            logit_bias: if self.logit_bias.is_empty() {
                defaults.logit_bias.clone()
            } else {
                // One bias per id (the last given), sorted by id as the engine wants.
                let by_id: BTreeMap<u32, f32> = self.logit_bias.iter().copied().collect();
                by_id.into_iter().collect()
            },
        }
    }
}
