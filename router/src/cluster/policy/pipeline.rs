//! A pipelined prefill (chunked pipeline parallelism, as Mooncake does it): a long prompt that
//! no prefill node holds any of is cut into parts, one per idle prefill node, and each node
//! computes its part a layer at a time on the KV of the parts before, which the node before
//! streams to it layer by layer as it computes them (`Prefill.Relay`). The chosen prefill node
//! computes the last part and pushes the whole prompt's KV to the decode node, so a long
//! prompt's time to first token falls with the number of nodes instead of being one node's.
//!
//! The parts are cut so that each costs the same. A token at position `p` costs its node
//! `a + b·p` (the matrix products, then attention over the `p` keys before it), so a part
//! `[s, e)` costs `(e − s)·(c + (s + e)/2)` with `c = a/b`, [`ATTENTION_CROSSOVER`] tokens:
//! the first parts are longer than the last. A stage starts one layer after the stage before
//! it, so the time to first token is about one part's time plus a layer of each earlier part.

use std::sync::Arc;

use tandem_proto::block_hash::BLOCK_TOKENS;

use crate::cluster::replica::{InflightGuard, Replica, Role};
use crate::cluster::replicas::Replicas;

use super::{Ask, candidates, rendezvous};
use crate::config::PipelineConfig;

/// The context length at which a token's attention costs what its matrix products do (`c`
/// above), measured on the default model: a prompt token at 8k costs about 1.4 ms in the
/// matrix products and 3.0 ms in attention at a mean depth of 4k, so attention matches the
/// products at about 1.9k. The cut is not sensitive to it: at 32k tokens over two stages, `c`
/// of 0 or 4k moves the cut by about 2% of the prompt.
pub const ATTENTION_CROSSOVER: f64 = 2048.0;

/// The least a part may hold: a shorter one costs its stage a layer's hop for little work.
const MIN_PART_TOKENS: usize = 512;

/// The stages before `last` (the chosen prefill node, which holds `held` tokens of the prompt)
/// for a prompt of `ask.tokens`: idle prefill nodes that hold none of it, each claimed for its
/// part, with the end of its part, in order, named at the end of `reason`. Empty when the
/// prompt is not pipelined: a prefill node holds a prefix of it, it is too short, it is a retry
/// (one attempt failed already: the next computes on one node), or no peer is idle.
pub(crate) fn stages(
    replicas: &Replicas,
    ask: &Ask<'_>,
    key: &[u8],
    (last, held): (&Arc<Replica>, usize),
    config: PipelineConfig,
    reason: &mut String,
) -> Vec<(InflightGuard, usize)> {
    if held > 0
        || config.min_tokens == 0
        || config.max_stages < 2
        || ask.tokens < config.min_tokens
        || !ask.exclude.is_empty()
    {
        return Vec::new();
    }
    let mut idle: Vec<Arc<Replica>> = candidates(replicas, Role::Prefill, ask)
        .into_iter()
        .filter(|r| {
            !Arc::ptr_eq(r, last)
                && r.load() == 0
                && r.queued_tokens() == 0
                && r.index.overlap(ask.hashes, 0).blocks() == 0
        })
        .collect();
    idle.sort_by_key(|r| std::cmp::Reverse(rendezvous(key, r)));
    idle.truncate(config.max_stages - 1);
    let ends = cuts(ask.tokens, idle.len() + 1);
    let mut from = 0;
    let stages: Vec<(InflightGuard, usize)> = (idle.into_iter().zip(ends))
        .map(|(r, end)| {
            let part = (end - from) as u64;
            from = end;
            (r.claim(part, ask.class), end)
        })
        .collect();
    if !stages.is_empty() {
        let parts: Vec<String> = (stages.iter())
            .map(|(g, end)| format!("{} to {end}", g.replica().addr))
            .collect();
        reason.push_str(&format!(
            "; pipelined: {}, then {}",
            parts.join(", "),
            last.addr
        ));
    }
    stages
}

/// Where to cut a prompt of `n` tokens into at most `parts` parts of equal cost: the ends of all
/// but the last, on block boundaries, each part at least [`MIN_PART_TOKENS`].
pub(crate) fn cuts(n: usize, parts: usize) -> Vec<usize> {
    let parts = parts.min(n / MIN_PART_TOKENS).max(1);
    let c = ATTENTION_CROSSOVER;
    // The cost of [0, e): e·(c + e/2); each part gets an equal share of the whole.
    let cost = |e: f64| e * (c + e / 2.0);
    let share = cost(n as f64) / parts as f64;
    let mut ends = Vec::with_capacity(parts - 1);
    let mut from = 0;
    for k in 1..parts {
        // cost(e) = k·share, solved for e.
        let e = -c + (c * c + 2.0 * k as f64 * share).sqrt();
        let end = (e as usize / BLOCK_TOKENS) * BLOCK_TOKENS;
        if end >= from + MIN_PART_TOKENS && end + MIN_PART_TOKENS <= n {
            ends.push(end);
            from = end;
        }
    }
    ends
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cost_the_same_and_the_first_are_longest() {
        let n = 32_768;
        for parts in 2..=4 {
            let ends = cuts(n, parts);
            assert_eq!(ends.len(), parts - 1);
            let mut bounds = vec![0];
            bounds.extend(&ends);
            bounds.push(n);
            let c = ATTENTION_CROSSOVER;
            let costs: Vec<f64> = (bounds.windows(2))
                .map(|w| {
                    let (s, e) = (w[0] as f64, w[1] as f64);
                    (e - s) * (c + (s + e) / 2.0)
                })
                .collect();
            let lo = costs.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = costs.iter().copied().fold(0.0, f64::max);
            assert!(hi / lo < 1.01, "{parts} parts: costs {costs:?}");
            let lens: Vec<usize> = bounds.windows(2).map(|w| w[1] - w[0]).collect();
            assert!(lens.windows(2).all(|l| l[0] > l[1]), "{lens:?}");
            assert!(ends.iter().all(|e| e % BLOCK_TOKENS == 0));
        }
    }

    #[test]
    fn a_short_prompt_is_cut_into_fewer_parts() {
        assert_eq!(cuts(1_000, 4), Vec::<usize>::new(), "one part of 1,000");
        assert_eq!(cuts(1_200, 4).len(), 1, "two parts of at least 512");
        assert!(cuts(100, 2).is_empty());
        assert!(cuts(0, 3).is_empty());
    }
}
