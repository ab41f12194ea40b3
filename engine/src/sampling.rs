//! Token sampling as a pure function of `(seed, position, logits)`.
//!
//! The random draw for a position comes from a ChaCha8 stream keyed by the request's seed and
//! the token's absolute position, so a request gives the same tokens alone, in a batch, or
//! after its KV moved to another node.

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
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

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
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

/// Picks the token at absolute `position` of a sequence from its logits.
pub fn sample(logits: &[f32], params: &SamplingParams, position: u64) -> u32 {
    if params.is_greedy() {
        return argmax(logits);
    }
    let mut cands: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| l.is_finite())
        .map(|(i, &l)| (i as u32, l / params.temperature))
        .collect();
    if cands.is_empty() {
        return argmax(logits);
    }
    // Highest first; ties broken by id so the order is total and reproducible.
    cands.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if params.top_k > 0 {
        cands.truncate(params.top_k);
    }
    let max = cands[0].1;
    let mut probs: Vec<f32> = cands.iter().map(|c| (c.1 - max).exp()).collect();
    let total: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    if params.top_p < 1.0 {
        let mut cum = 0.0;
        let keep = probs
            .iter()
            .position(|p| {
                cum += p;
                cum >= params.top_p
            })
            .map_or(probs.len(), |i| i + 1);
        probs.truncate(keep);
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= total);
    }
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&params.seed.to_le_bytes());
    key[8..16].copy_from_slice(&position.to_le_bytes());
    let u: f32 = ChaCha8Rng::from_seed(key).random();
    let mut cum = 0.0;
    for (c, p) in cands.iter().zip(&probs) {
        cum += p;
        if u < cum {
            return c.0;
        }
    }
    cands[probs.len() - 1].0
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
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        (0..100).map(|i| ((i * 37 % 100) as f32) / 10.0).collect()
    }

    #[test]
    fn greedy_is_argmax() {
        let l = logits();
        assert_eq!(sample(&l, &SamplingParams::default(), 5), argmax(&l));
        assert_eq!(l[argmax(&l) as usize], 9.9);
    }

    #[test]
    fn same_seed_and_position_same_token() {
        let l = logits();
        let p = SamplingParams {
            temperature: 1.5,
            seed: 42,
            ..Default::default()
        };
        let a: Vec<u32> = (0..50).map(|pos| sample(&l, &p, pos)).collect();
        let b: Vec<u32> = (0..50).map(|pos| sample(&l, &p, pos)).collect();
        assert_eq!(a, b);
        // Different positions draw differently: 50 draws are not all the same token.
        assert!(a.iter().any(|&t| t != a[0]));
    }

    #[test]
    fn top_k_and_top_p_restrict_candidates() {
        let l = logits();
        let top3: Vec<u32> = {
            let mut idx: Vec<u32> = (0..100).collect();
            idx.sort_by(|&a, &b| l[b as usize].total_cmp(&l[a as usize]));
            idx[..3].to_vec()
        };
        let p = SamplingParams {
            temperature: 5.0,
            top_k: 3,
            seed: 1,
            ..Default::default()
        };
        for pos in 0..200 {
            assert!(top3.contains(&sample(&l, &p, pos)));
        }
        let p = SamplingParams {
            temperature: 0.01,
            top_p: 0.5,
            seed: 1,
            ..Default::default()
        };
        for pos in 0..50 {
            assert_eq!(sample(&l, &p, pos), argmax(&l));
        }
    }

    #[test]
    fn rejects_bad_params() {
        let bad = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        };
        assert!(matches!(
            bad.validate(),
            Err(Error::InvalidArgument {
                field: "temperature",
                ..
            })
        ));
    }
}
