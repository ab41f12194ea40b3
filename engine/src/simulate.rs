//! The simulated engine: a model whose forward pass reads no weights and computes nothing, but
//! takes the time the real one would (a [`TimingProfile`] fitted from `tandem-bench profile` on
//! the real model) and gives each row a logit row that makes one token certain: a function of
//! the row's token and position, drawn from the vocabulary's plain words. Everything around the
//! forward pass is the real engine's: the KV pool and its blocks, the prefix cache, sampling,
//! stops, grammars, export and import of KV. So a fleet of simulated nodes runs the real
//! scheduler, admission, transfers, cache events and drains, with the real tokenizer's ids and
//! block hashes, and a resumed generation continues exactly as the first attempt would have.
//!
//! A simulated reply never ends by itself: no end-of-generation id is ever likely, so it runs
//! to its `max_tokens` or a stop.

use std::path::Path;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::model::{Logits, ModelConfig, Row};
use tandem_tokenizer::Tokenizer;

/// How long a forward pass of the real model takes, as a function of its rows:
///
/// ```text
/// seconds = max(step_s + row_s · rows, prompt_row_s · rows) + attend_s · Σ context
/// ```
///
/// where `rows` are the tokens the pass appends, and `Σ context` sums, over them, the positions
/// each one attends to. A decode step of a few rows is bound by reading the weights once
/// (`step_s`, plus `row_s` per row); a prompt chunk of hundreds of rows by their arithmetic
/// (`prompt_row_s` per row); attention grows with the context.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TimingProfile {
    /// The model it was measured on (a catalog name), and where: the CPU and the threads.
    pub model: String,
    pub cpu: String,
    pub threads: usize,
    pub step_s: f64,
    pub row_s: f64,
    pub prompt_row_s: f64,
    pub attend_s: f64,
}

impl TimingProfile {
    /// Reads a profile written by `tandem-bench profile`.
    pub fn read(path: &Path) -> Result<Self> {
        let bad = |reason: String| Error::Profile {
            path: path.to_path_buf(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        Self::parse(&text).map_err(bad)
    }

    /// A profile from its JSON, checked: every figure finite and not negative, some positive.
    pub fn parse(json: &str) -> std::result::Result<Self, String> {
        let p: Self =
            serde_json::from_str(json).map_err(|e| format!("not a timing profile: {e}"))?;
        let figures = [p.step_s, p.row_s, p.prompt_row_s, p.attend_s];
        if figures.iter().any(|f| !f.is_finite() || *f < 0.0) || p.step_s + p.prompt_row_s <= 0.0
        {
            return Err(format!(
                "a timing profile's figures must be finite and not negative, with a step or a \
                 prompt row that takes time: {figures:?}"
            ));
        }
        Ok(p)
    }

    /// The time a forward pass over `rows` takes.
    pub fn forward_time(&self, rows: &[Row<'_>]) -> Duration {
        let n = rows.len() as f64;
        let context: f64 = rows.iter().map(|r| (r.pos + 1) as f64).sum();
        let seconds = (self.step_s + self.row_s * n).max(self.prompt_row_s * n)
            + self.attend_s * context;
        Duration::from_secs_f64(seconds)
    }
}

/// A model's compute replaced by its timing.
#[derive(Debug)]
pub struct Simulated {
    pub profile: TimingProfile,
    /// The tokens a row's next token is drawn from: plain lowercase words with a leading space.
    words: Vec<u32>,
}

/// The logit of the one token a simulated row makes certain (the others are 0): with a
/// vocabulary of 262k, the rest share a probability of about 1e-8.
const CERTAIN: f32 = 40.0;

impl Simulated {
    pub fn new(profile: TimingProfile, tokenizer: &Tokenizer) -> Result<Self> {
        let plain = |b: &[u8]| {
            b.len() >= 3 && b[0] == b' ' && b[1..].iter().all(|c| c.is_ascii_lowercase())
        };
        let words: Vec<u32> = (0..tokenizer.vocab_size() as u32)
            .filter(|&id| plain(tokenizer.token_bytes(id)))
            .collect();
        if words.is_empty() {
            return Err(Error::InvalidArgument {
                field: "simulate",
                reason: "the vocabulary has no plain words to simulate replies with".into(),
            });
        }
        Ok(Self { profile, words })
    }

    /// The token a row makes certain: the same for the same token at the same position,
    /// whichever node computes it.
    pub fn next_token(&self, token: u32, pos: usize) -> u32 {
        let x = (u64::from(token) << 32 | pos as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let x = (x ^ (x >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        self.words[((x ^ (x >> 32)) % self.words.len() as u64) as usize]
    }

    /// The forward pass: the rows' logits (for those that want them), at the time the real one
    /// would have them. Sleeps for what is left after writing the logits.
    pub(crate) fn forward(&self, cfg: &ModelConfig, rows: &[Row<'_>], buffer: Vec<f32>) -> Logits {
        let started = Instant::now();
        let wanted = rows.iter().filter(|r| r.want_logits).count();
        let mut data = buffer;
        data.clear();
        data.resize(wanted * cfg.vocab, 0.0);
        for (row, logits) in rows
            .iter()
            .filter(|r| r.want_logits)
            .zip(data.chunks_exact_mut(cfg.vocab))
        {
            logits[self.next_token(row.token, row.pos) as usize] = CERTAIN;
        }
        if let Some(left) = self.profile.forward_time(rows).checked_sub(started.elapsed()) {
            std::thread::sleep(left);
        }
        Logits::new(cfg.vocab, data)
    }
}

/// The profiles shipped for the catalog's models (and the tiny one), by name, measured with
/// `tandem-bench profile` on the CPU each names.
const SHIPPED: &[(&str, &str)] = &[];

/// The profile shipped for the catalog model `name`, if any.
pub fn shipped(name: &str) -> Option<TimingProfile> {
    let (_, json) = SHIPPED.iter().find(|(n, _)| *n == name)?;
    TimingProfile::parse(json).ok()
}
