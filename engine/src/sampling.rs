//! Token sampling as a pure function of `(seed, position, logits, the tokens so far)`.
//!
//! The order: logit biases, then penalties, then banned ids (to `-inf`); greedy takes the
//! argmax of that. A draw divides by the temperature, cuts by min-p, then top-k, then top-p (as
//! vLLM does), and picks among what is left.
//!
//! The random draw for a position comes from a ChaCha8 stream keyed by the request's seed and
//! the token's absolute position, so a request gives the same tokens alone, in a batch, or
//! after its KV moved to another node. Penalties read the tokens so far from a [`History`],
//! which any node rebuilds from the prompt and the tokens already generated.

use std::collections::{HashMap, VecDeque};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1 means no nucleus cut.
    pub top_p: f32,
    pub seed: u64,
    /// OpenAI's: subtracted from a token's logit once for each time it was generated so far
    /// (the prompt does not count). 0 means off; -2 to 2.
    pub frequency_penalty: f32,
    /// OpenAI's: subtracted once from the logit of every token generated so far. 0 means off;
    /// -2 to 2.
    pub presence_penalty: f32,
    /// llama.cpp's: the logit of every token among the sequence's last [`REPETITION_WINDOW`]
    /// tokens (prompt included) is divided by it when positive, multiplied when negative. 1
    /// means off; above 0, at most 10.
    pub repetition_penalty: f32,
    /// Tokens whose probability (after the temperature) is under `min_p` times the most likely
    /// one's are cut. 0 means off; at most 1.
    pub min_p: f32,
    /// Added to these tokens' logits before anything else, sorted by id; each in [-100, 100].
    pub logit_bias: Vec<(u32, f32)>,
}

impl SamplingParams {
    /// Greedy, with every cut and penalty off: the model's own most likely tokens.
    pub const GREEDY: Self = Self {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
        repetition_penalty: 1.0,
        min_p: 0.0,
        logit_bias: Vec::new(),
    };
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::GREEDY
    }
}

/// How many of a sequence's last tokens the repetition penalty looks at (llama.cpp's default
/// `penalty_last_n`).
pub const REPETITION_WINDOW: usize = 64;

impl SamplingParams {
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(Error::InvalidArgument {
                field: "temperature",
                reason: format!("must be a finite number >= 0, got {}", self.temperature),
            });
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(Error::InvalidArgument {
                field: "top_p",
                reason: format!("must be in (0, 1], got {}", self.top_p),
            });
        }
        for (field, value) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !(-2.0..=2.0).contains(&value) {
                return Err(Error::InvalidArgument {
                    field,
                    reason: format!("must be in [-2, 2], got {value}"),
                });
            }
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= 10.0) {
            return Err(Error::InvalidArgument {
                field: "repetition_penalty",
                reason: format!("must be in (0, 10], got {}", self.repetition_penalty),
            });
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(Error::InvalidArgument {
                field: "min_p",
                reason: format!("must be in [0, 1], got {}", self.min_p),
            });
        }
        if let Some((id, bias)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return Err(Error::InvalidArgument {
                field: "logit_bias",
                reason: format!("token {id}: a bias must be in [-100, 100], got {bias}"),
            });
        }
        if !self.logit_bias.is_sorted_by(|a, b| a.0 < b.0) {
            return Err(Error::InvalidArgument {
                field: "logit_bias",
                reason: "one bias per token id, sorted by id".into(),
            });
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    fn penalizes(&self) -> bool {
        self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
            || self.repetition_penalty != 1.0
    }

    /// Whether `sample` changes the logits before it reads them.
    fn adjusts(&self, banned: &[u32]) -> bool {
        self.penalizes() || !self.logit_bias.is_empty() || !banned.is_empty()
    }
}

/// The tokens so far, as the penalties see them.
#[derive(Clone, Debug, Default)]
pub struct History {
    /// How often each generated token occurred.
    generated: HashMap<u32, u32>,
    /// The sequence's last [`REPETITION_WINDOW`] tokens, prompt included.
    recent: VecDeque<u32>,
}

impl History {
    /// The history of a sequence whose `prompt` was followed by `generated`.
    pub fn new(prompt: &[u32], generated: &[u32]) -> Self {
        let mut h = Self::default();
        let skip = (prompt.len() + generated.len()).saturating_sub(REPETITION_WINDOW);
        h.recent.extend(prompt.iter().chain(generated).skip(skip));
        for &t in generated {
            *h.generated.entry(t).or_default() += 1;
        }
        h
    }

    /// Records a generated token.
    pub fn push(&mut self, token: u32) {
        *self.generated.entry(token).or_default() += 1;
        if self.recent.len() == REPETITION_WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(token);
    }

    /// Applies `params`' penalties to `logits`.
    fn penalize(&self, logits: &mut [f32], params: &SamplingParams) {
        if params.repetition_penalty != 1.0 {
            let mut seen: Vec<u32> = self.recent.iter().copied().collect();
            seen.sort_unstable();
            seen.dedup();
            for t in seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 {
                        *l / params.repetition_penalty
                    } else {
                        *l * params.repetition_penalty
                    };
                }
            }
        }
        if params.frequency_penalty != 0.0 || params.presence_penalty != 0.0 {
            for (&t, &n) in &self.generated {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= n as f32 * params.frequency_penalty + params.presence_penalty;
                }
            }
        }
    }
}

/// A sampled token's log-probability and the `top` most likely tokens' (most likely first,
/// ties by id), from the model's own distribution: the softmax of the raw logits, before
/// biases, penalties, bans and the temperature.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// The log-probability of `token` and of the `top` most likely tokens under `logits`.
pub fn logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let max = logits
        .iter()
        .copied()
        .filter(|l| l.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    // Summed in f64: 152k-262k terms.
    let sum: f64 = logits
        .iter()
        .filter(|l| l.is_finite())
        .map(|&l| f64::from(l - max).exp())
        .sum();
    let log_z = max + sum.ln() as f32;
    let lp = |l: f32| {
        if l.is_finite() {
            l - log_z
        } else {
            f32::NEG_INFINITY
        }
    };
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let order = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    let top = top.min(ids.len());
    if top > 0 && top < ids.len() {
        ids.select_nth_unstable_by(top - 1, order);
    }
    ids.truncate(top);
    ids.sort_unstable_by(order);
    TokenLogprobs {
        logprob: logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&l| lp(l)),
        top: ids
            .into_iter()
            .map(|i| (i, lp(logits[i as usize])))
            .collect(),
    }
}

/// Picks the token at absolute `position` of a sequence from its logits and the tokens so far;
/// no id of `banned` is picked (unless every token is banned or -inf).
pub fn sample(
    logits: &[f32],
    params: &SamplingParams,
    position: u64,
    history: &History,
    banned: &[u32],
) -> u32 {
    let adjusted;
    let logits = if params.adjusts(banned) {
        let mut l = logits.to_vec();
        for &(t, bias) in &params.logit_bias {
            if let Some(x) = l.get_mut(t as usize) {
                *x += bias;
            }
        }
        history.penalize(&mut l, params);
        for &t in banned {
            if let Some(x) = l.get_mut(t as usize) {
                *x = f32::NEG_INFINITY;
            }
        }
        adjusted = l;
        &adjusted[..]
    } else {
        logits
    };
    if params.is_greedy() {
        return argmax(logits);
    }
    // The largest logit is subtracted before dividing by the temperature, so that a tiny
    // temperature sends the others to -inf (greedy in the limit) instead of overflowing them
    // all to +inf.
    let top = logits
        .iter()
        .copied()
        .filter(|l| l.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    if top == f32::NEG_INFINITY {
        return argmax(logits);
    }
    // min-p: `exp(c) >= min_p`, with the top candidate at `c = 0`.
    let floor = if params.min_p > 0.0 {
        params.min_p.ln()
    } else {
        f32::NEG_INFINITY
    };
    let cands: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| l.is_finite())
        .map(|(i, &l)| (i as u32, (l - top) / params.temperature))
        .filter(|c| c.1 >= floor)
        .collect();
    let mut ranked = Ranked { cands, sorted: 0 };
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&params.seed.to_le_bytes());
    key[8..16].copy_from_slice(&position.to_le_bytes());
    let u: f32 = ChaCha8Rng::from_seed(key).random();
    if params.top_k > 0 {
        ranked.sort_prefix(params.top_k);
        ranked.cands.truncate(params.top_k);
    }
    // The top candidate's scaled logit is 0 already (the shift above).
    let total: f32 = ranked.cands.iter().map(|c| c.1.exp()).sum();
    if params.top_p < 1.0 {
        let keep = ranked.reach(params.top_p, total);
        let kept = &ranked.cands[..keep];
        // Drawn among the kept candidates, renormalized.
        let mass: f32 = kept.iter().map(|c| c.1.exp()).sum();
        let mut cum = 0.0;
        for c in kept {
            cum += c.1.exp() / mass;
            if u < cum {
                return c.0;
            }
        }
        return kept[keep - 1].0;
    }
    // The first candidate whose cumulative probability passes `u`.
    let n = ranked.reach(u.next_up(), total);
    ranked.cands[n - 1].0
}

/// Candidates (id, scaled logit) put in descending order lazily. A draw walks them from the
/// most likely down, which is a few hundred of a 150k vocabulary: they are ordered in growing
/// prefixes (a partial selection, then a sort of the prefix), not sorted whole.
struct Ranked {
    cands: Vec<(u32, f32)>,
    /// `cands[..sorted]` is in order and holds the most likely `sorted` candidates.
    sorted: usize,
}

impl Ranked {
    fn sort_prefix(&mut self, n: usize) {
        let n = n.min(self.cands.len());
        if n <= self.sorted {
            return;
        }
        if n < self.cands.len() {
            self.cands[self.sorted..].select_nth_unstable_by(n - self.sorted - 1, by_logit);
        }
        self.cands[self.sorted..n].sort_unstable_by(by_logit);
        self.sorted = n;
    }

    /// How many of the most likely candidates it takes for their probabilities (`exp(logit) /
    /// total`) to reach `mass`; all of them if rounding keeps the sum short of it. At least 1.
    fn reach(&mut self, mass: f32, total: f32) -> usize {
        let (mut n, mut cum, mut want) = (0, 0.0, 64);
        loop {
            self.sort_prefix(want);
            for c in &self.cands[n..self.sorted] {
                cum += c.1.exp() / total;
                n += 1;
                if cum >= mass {
                    return n;
                }
            }
            if self.sorted == self.cands.len() {
                return n.max(1);
            }
            want *= 4;
        }
    }
}

/// Highest first; ties broken by id so the order is total and reproducible.
fn by_logit(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// The highest logit's id (the lowest id among equals).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests;
