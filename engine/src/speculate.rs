//! Prompt-lookup speculative decoding: exact, and without a draft model.
//!
//! Batch-1 decode reads every weight once per token, so it runs at the memory bandwidth's pace
//! whatever the arithmetic costs. A forward pass over a few more rows reads the same weights, so
//! it verifies several tokens for little more than the price of one. The drafts come from the
//! sequence itself: the most recent earlier occurrence of its last n tokens (n from
//! [`SpeculateConfig::max_ngram`] down to [`SpeculateConfig::min_ngram`]) proposes the tokens
//! that followed it. Rewrites, summaries and lists copy long runs of their prompt, so those
//! drafts are often right.
//!
//! [`Engine::decode_step`](crate::Engine::decode_step) feeds each sequence's pending token and its draft in one batched
//! pass, samples each position with the request's own sampler (a pure function of seed,
//! position, logits and history), and accepts the longest prefix of the draft the sampler
//! agrees with, plus the sampler's own token at the first disagreement. A verified position's
//! logits equal those of a plain step bit for bit (every row's arithmetic is independent of the
//! batch around it), so the output is the output of plain decoding, token for token. The KV of
//! rejected drafts is dropped from the sequence.
//!
//! How much to draft: a step's cost depends on its rows, and how steeply depends on the CPU
//! (on a 2-core AVX2 machine a second row is almost free, a fourth costs 70% more than one), so
//! the engine measures it: [`StepCosts`] keeps the time of recent steps per row count. Each
//! sequence keeps an estimate `p` of the chance that its next drafted token is accepted
//! ([`Drafter`]); drafting its `j`-th token is worth `p^j` expected tokens. Each step takes the
//! drafts' tokens in order of that worth and cuts them where expected tokens per second of step
//! time peak, so a sequence whose drafts fail, or a batch large enough that every row costs
//! its full share of arithmetic, drafts little or nothing. A row count not yet measured is
//! assumed to cost what the measured ones below it suggest (each extra row what a row cost
//! between the two largest, and at least 2% of a step), so it is tried when that looks
//! worthwhile and then judged by its measurements; a measurement not repeated for a while
//! counts only half, so one spoiled by noise is retried eventually.

/// Settings for [`crate::Engine::decode_step`] ([`crate::EngineConfig::speculate`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SpeculateConfig {
    /// Whether to draft at all; off, each step feeds one token per sequence.
    pub enabled: bool,
    /// Most tokens drafted per sequence per step.
    pub max_draft: usize,
    /// Longest n-gram looked up (tried first).
    pub max_ngram: usize,
    /// Shortest n-gram looked up.
    pub min_ngram: usize,
    /// Most rows (pending tokens plus drafts) per step.
    pub max_rows: usize,
}

impl Default for SpeculateConfig {
    fn default() -> Self {
        Self::on()
    }
}

impl SpeculateConfig {
    /// Speculation with the defaults the measurements chose (docs/speculative.md).
    pub fn on() -> Self {
        Self {
            enabled: true,
            max_draft: 8,
            max_ngram: 3,
            min_ngram: 1,
            max_rows: 32,
        }
    }

    /// Plain decoding: one token per sequence per step.
    pub fn off() -> Self {
        Self {
            enabled: false,
            ..Self::on()
        }
    }
}

/// How much older observations count after each new one, in the acceptance estimate and the
/// step costs.
const DECAY: f64 = 0.9;
/// The least extra cost, as a share of a step, assumed per row past the measured row counts.
const UNMEASURED_ROW_COST: f64 = 0.02;

/// One sequence's drafting statistics.
#[derive(Clone, Debug, Default)]
pub struct Drafter {
    /// Decayed counts of drafted tokens accepted, and of drafts cut short by a rejection.
    hits: f64,
    misses: f64,
    /// Tokens drafted and accepted so far.
    pub drafted: u64,
    pub accepted: u64,
}

impl Drafter {
    /// The estimated chance that the next drafted token is accepted, given the ones before it
    /// were: hits over hits and misses, with one of each assumed at the start.
    pub fn acceptance(&self) -> f64 {
        (self.hits + 1.0) / (self.hits + self.misses + 2.0)
    }

    pub(crate) fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        self.hits = self.hits * DECAY + accepted as f64;
        self.misses = self.misses * DECAY + f64::from(u8::from(accepted < drafted));
    }
}

/// Steps after which a row count's measurement counts only half (see [`StepCosts::estimate`]),
/// so that one unlucky measurement (a noisy neighbour, a cold cache) does not rule a row count
/// out for good.
const STALE_STEPS: u64 = 64;

/// Recent step times by row count, measured.
#[derive(Clone, Debug, Default)]
pub struct StepCosts {
    /// Per row count (index + 1): seconds per step, and the step it was last measured at.
    secs: Vec<(f64, u64)>,
    steps: u64,
}

impl StepCosts {
    pub(crate) fn record(&mut self, rows: usize, secs: f64) {
        if rows == 0 {
            return;
        }
        self.steps += 1;
        if self.secs.len() < rows {
            self.secs.resize(rows, (0.0, 0));
        }
        let recent = match self.measured(rows) {
            Some((t, true)) => Some(t),
            _ => None,
        };
        let (t, at) = &mut self.secs[rows - 1];
        *t = match recent {
            Some(old) => DECAY * old + (1.0 - DECAY) * secs,
            None => secs,
        };
        *at = self.steps;
    }

    /// The measured time of `rows`, and whether it is recent.
    fn measured(&self, rows: usize) -> Option<(f64, bool)> {
        let &(t, at) = self.secs.get(rows.checked_sub(1)?)?;
        (t > 0.0).then_some((t, self.steps - at < STALE_STEPS))
    }

    /// The expected seconds of a step of `rows`: a recent measurement; else a guess, or for an
    /// old measurement halfway between it and the guess. The guess extends the largest recently
    /// measured count below by the cost per row between it and the next one measured below
    /// (at least [`UNMEASURED_ROW_COST`] of it per row; 1 s if nothing is measured).
    pub(crate) fn estimate(&self, rows: usize) -> f64 {
        let measured = self.measured(rows);
        if let Some((t, true)) = measured {
            return t;
        }
        let mut recent_below = (1..rows).rev().filter_map(|r| match self.measured(r) {
            Some((t, true)) => Some((r, t)),
            _ => None,
        });
        let guess = match (recent_below.next(), recent_below.next()) {
            (Some((r1, t1)), below) => {
                // The cost per row between the two largest counts measured, at least the floor.
                let floor = UNMEASURED_ROW_COST * t1;
                let slope =
                    below.map_or(floor, |(r0, t0)| ((t1 - t0) / (r1 - r0) as f64).max(floor));
                t1 + slope * (rows - r1) as f64
            }
            (None, _) => 1.0 + UNMEASURED_ROW_COST * (rows - 1) as f64,
        };
        match measured {
            Some((old, _)) => (old + guess) / 2.0,
            None => guess,
        }
    }
}

/// The tokens that followed the most recent earlier occurrence of `context`'s last n tokens,
/// for the longest n in `min_ngram..=max_ngram` that occurs, at most `max_len` of them.
pub(crate) fn lookup(
    context: &[u32],
    min_ngram: usize,
    max_ngram: usize,
    max_len: usize,
) -> &[u32] {
    if max_len == 0 {
        return &[];
    }
    let len = context.len();
    for n in (min_ngram.max(1)..=max_ngram).rev() {
        if len <= n {
            continue;
        }
        let tail = &context[len - n..];
        // Most recent first; the match must end before the tail does.
        if let Some(start) = (0..len - n).rev().find(|&i| &context[i..i + n] == tail) {
            let from = start + n;
            return &context[from..(from + max_len).min(len)];
        }
    }
    &[]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_prefers_the_longest_most_recent_match() {
        // ... 1 2 3 [7 8] ... 2 3 [9] ... 1 2 3: the 3-gram "1 2 3" matched first.
        let ctx = [1, 2, 3, 7, 8, 5, 2, 3, 9, 4, 1, 2, 3];
        assert_eq!(lookup(&ctx, 1, 3, 4), &[7, 8, 5, 2]);
        assert_eq!(lookup(&ctx, 1, 3, 1), &[7]);
        // Only the 2-gram "2 3" is allowed: its most recent earlier occurrence is followed by 9.
        assert_eq!(lookup(&ctx, 1, 2, 2), &[9, 4]);
        // A draft stops where the context does.
        assert_eq!(lookup(&[5, 6, 5], 1, 3, 8), &[6, 5]);
        assert!(lookup(&[1, 2, 3, 4], 1, 3, 4).is_empty(), "nothing repeats");
        assert!(lookup(&ctx, 1, 3, 0).is_empty());
        assert!(lookup(&[], 1, 3, 4).is_empty());
        assert!(lookup(&[7], 1, 3, 4).is_empty());
    }

    #[test]
    fn acceptance_follows_recent_drafts() {
        let mut d = Drafter::default();
        assert_eq!(d.acceptance(), 0.5);
        for _ in 0..10 {
            d.record(4, 4);
        }
        assert!(d.acceptance() > 0.9, "{}", d.acceptance());
        for _ in 0..30 {
            d.record(2, 0);
        }
        assert!(d.acceptance() < 0.2, "{}", d.acceptance());
        assert_eq!((d.drafted, d.accepted), (100, 40));
        d.record(0, 0);
        assert_eq!(d.drafted, 100, "a step without a draft changes nothing");
    }

    #[test]
    fn unmeasured_row_counts_look_cheap_until_measured() {
        let mut c = StepCosts::default();
        assert_eq!(c.estimate(1), 1.0);
        c.record(1, 0.010);
        assert_eq!(c.estimate(1), 0.010);
        assert!((c.estimate(3) - 0.0104).abs() < 1e-9);
        c.record(3, 0.030);
        assert_eq!(c.estimate(3), 0.030);
        assert!(
            (c.estimate(2) - 0.0102).abs() < 1e-9,
            "from the count below"
        );
        assert!(
            (c.estimate(5) - 0.050).abs() < 1e-9,
            "rows past 3 cost what rows 1 to 3 did each"
        );
        c.record(3, 0.010);
        assert!((c.estimate(3) - 0.028).abs() < 1e-9, "a moving average");
        for _ in 0..STALE_STEPS {
            c.record(1, 0.010);
        }
        assert!(
            (c.estimate(3) - (0.028 + 0.0104) / 2.0).abs() < 1e-9,
            "a measurement not repeated for {STALE_STEPS} steps counts half"
        );
        c.record(3, 0.020);
        assert_eq!(c.estimate(3), 0.020, "and is replaced by the next");
    }
}
