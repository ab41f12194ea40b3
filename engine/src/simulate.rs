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
/// seconds = pass(rows) + attend_s · Σ context
/// ```
///
/// where `rows` are the tokens the pass appends, `pass` is interpolated between the times
/// measured for passes of so many rows over a short context (decode steps of a few rows, bound
/// by reading the weights once; prompt chunks of hundreds, bound by their arithmetic), and
/// `Σ context` sums, over the rows, the positions each one attends to.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TimingProfile {
    /// The model it was measured on (a catalog name), and where: the CPU and the threads.
    pub model: String,
    pub cpu: String,
    pub threads: usize,
    /// `(rows, seconds)` of passes measured over a short context, by rows ascending: linear
    /// between them, and past the last at its seconds per row.
    pub passes: Vec<(usize, f64)>,
    /// Seconds of attention per row and token of its context.
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

    /// A profile from its JSON, checked: passes of rising rows, every time finite, positive
    /// and rising, and attention finite and not negative.
    pub fn parse(json: &str) -> std::result::Result<Self, String> {
        let p: Self =
            serde_json::from_str(json).map_err(|e| format!("not a timing profile: {e}"))?;
        let rising = p
            .passes
            .windows(2)
            .all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1);
        let times_ok = p
            .passes
            .iter()
            .all(|&(n, s)| n > 0 && s.is_finite() && s > 0.0);
        if p.passes.is_empty() || !rising || !times_ok {
            return Err(format!(
                "a timing profile's passes must be (rows, seconds) pairs, rows and seconds \
                 rising, every time positive: {:?}",
                p.passes
            ));
        }
        if !p.attend_s.is_finite() || p.attend_s < 0.0 {
            return Err(format!(
                "attend_s must be finite and not negative, got {}",
                p.attend_s
            ));
        }
        Ok(p)
    }

    /// The time of a pass of `n` rows over a short context.
    fn pass(&self, n: usize) -> f64 {
        let n = n.max(1) as f64;
        let points = &self.passes;
        let (first, last) = (points[0], points[points.len() - 1]);
        if n <= first.0 as f64 {
            return first.1;
        }
        if n >= last.0 as f64 {
            return last.1 * n / last.0 as f64;
        }
        let i = points.partition_point(|&(rows, _)| (rows as f64) < n);
        let ((n0, t0), (n1, t1)) = (points[i - 1], points[i]);
        t0 + (t1 - t0) * (n - n0 as f64) / (n1 - n0) as f64
    }

    /// The time a forward pass over `rows` takes.
    pub(crate) fn forward_time(&self, rows: &[Row<'_>]) -> Duration {
        let context: f64 = rows.iter().map(|r| (r.pos + 1) as f64).sum();
        Duration::from_secs_f64(self.pass(rows.len()) + self.attend_s * context)
    }
}

/// A model's compute replaced by its timing.
#[derive(Debug)]
pub struct Simulated {
    pub profile: TimingProfile,
    /// The tokens a row's next token is drawn from: plain lowercase words with a leading space
    /// (any token of printable ASCII in a vocabulary without such words, as the tiny model's).
    words: Vec<u32>,
}

/// The logit of the one token a simulated row makes certain (the others are 0): with a
/// vocabulary of 262k, the rest share a probability of about 1e-12.
const CERTAIN: f32 = 40.0;

impl Simulated {
    pub fn new(profile: TimingProfile, tokenizer: &Tokenizer) -> Result<Self> {
        let word = |b: &[u8]| {
            b.len() >= 3 && b[0] == b' ' && b[1..].iter().all(|c| c.is_ascii_lowercase())
        };
        let printable =
            |b: &[u8]| !b.is_empty() && b.iter().all(|c| c.is_ascii_graphic() || *c == b' ');
        let ordinary = |id: &u32| !tokenizer.eog_ids().contains(id);
        let ids = |keep: &dyn Fn(&[u8]) -> bool| -> Vec<u32> {
            (0..tokenizer.vocab_size() as u32)
                .filter(|id| ordinary(id) && keep(tokenizer.token_bytes(*id)))
                .collect()
        };
        let mut words = ids(&word);
        if words.is_empty() {
            words = ids(&printable);
        }
        if words.is_empty() {
            return Err(Error::InvalidArgument {
                field: "simulate",
                reason: "the vocabulary has no printable token to simulate replies with".into(),
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
        let logits = self.logits(cfg, rows, buffer);
        if let Some(left) = self
            .profile
            .forward_time(rows)
            .checked_sub(started.elapsed())
        {
            std::thread::sleep(left);
        }
        logits
    }

    /// The rows' logits (for those that want them), at once.
    pub(crate) fn logits(&self, cfg: &ModelConfig, rows: &[Row<'_>], buffer: Vec<f32>) -> Logits {
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
        Logits::new(cfg.vocab, data)
    }
}

/// The profiles shipped for the catalog's models, by name, measured with `tandem-bench profile`
/// on the CPU each names.
pub const SHIPPED: &[(&str, &str)] = &[
    (
        "qwen2.5-coder-0.5b",
        include_str!("../profiles/qwen2.5-coder-0.5b.json"),
    ),
    ("smollm2", include_str!("../profiles/smollm2.json")),
    (
        "gemma-3-270m",
        include_str!("../profiles/gemma-3-270m.json"),
    ),
];

/// The profile shipped for the catalog model `name`, if any.
pub fn shipped(name: &str) -> Option<TimingProfile> {
    let (_, json) = SHIPPED.iter().find(|(n, _)| *n == name)?;
    TimingProfile::parse(json).ok()
}
