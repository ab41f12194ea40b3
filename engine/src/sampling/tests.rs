use super::*;

fn logits() -> Vec<f32> {
    (0..100).map(|i| ((i * 37 % 100) as f32) / 10.0).collect()
}

#[test]
fn logprobs_are_the_softmax_of_the_raw_logits() {
    let mut l = logits();
    l[3] = f32::NEG_INFINITY;
    let total: f64 = (0..l.len() as u32)
        .map(|t| f64::from(logprobs(&l, t, 0).logprob).exp())
        .sum();
    assert!((total - 1.0).abs() < 1e-5, "{total}");
    let lp = logprobs(&l, 7, 5);
    assert_eq!(lp.top.len(), 5);
    assert_eq!(lp.top[0].0, argmax(&l));
    assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1), "{lp:?}");
    // The chosen token's value is the same computation as an alternative's.
    let best = logprobs(&l, argmax(&l), 1);
    assert_eq!(best.logprob, best.top[0].1);
    assert_eq!(logprobs(&l, 3, 0).logprob, f32::NEG_INFINITY);
    assert_eq!(logprobs(&l, 1000, 3).logprob, f32::NEG_INFINITY);
    assert_eq!(
        logprobs(&[0.0, 0.0], 0, 20).top,
        vec![(0, -(2f32.ln())), (1, -(2f32.ln()))]
    );
}

#[test]
fn greedy_is_argmax() {
    let l = logits();
    assert_eq!(
        sample(&l, &SamplingParams::default(), 5, &History::default(), &[]),
        argmax(&l)
    );
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
    let a: Vec<u32> = (0..50)
        .map(|pos| sample(&l, &p, pos, &History::default(), &[]))
        .collect();
    let b: Vec<u32> = (0..50)
        .map(|pos| sample(&l, &p, pos, &History::default(), &[]))
        .collect();
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
        assert!(top3.contains(&sample(&l, &p, pos, &History::default(), &[])));
    }
    let p = SamplingParams {
        temperature: 0.01,
        top_p: 0.5,
        seed: 1,
        ..Default::default()
    };
    for pos in 0..50 {
        assert_eq!(sample(&l, &p, pos, &History::default(), &[]), argmax(&l));
    }
}

/// The distribution a draw follows, computed the plain way: every candidate sorted, then
/// top-k, top-p and the draw over the sorted list.
fn full_sort_probabilities(logits: &[f32], p: &SamplingParams) -> Vec<(u32, f64)> {
    let top = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut c: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, f64::from((l - top) / p.temperature).exp()))
        .collect();
    c.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if p.top_k > 0 {
        c.truncate(p.top_k);
    }
    let total: f64 = c.iter().map(|x| x.1).sum();
    let mut cum = 0.0;
    let keep = c
        .iter()
        .position(|x| {
            cum += x.1 / total;
            cum >= f64::from(p.top_p)
        })
        .map_or(c.len(), |i| i + 1);
    c.truncate(keep);
    let kept: f64 = c.iter().map(|x| x.1).sum();
    c.iter().map(|&(i, w)| (i, w / kept)).collect()
}

/// Over a 150k vocabulary, the partial ordering draws from the same distribution as a full
/// sort: every drawn token is one the full sort allows, and each token's share of 800 draws
/// is within a few standard deviations of its probability.
#[test]
fn a_large_vocabulary_is_sampled_as_a_full_sort_would() {
    let vocab = 150_000;
    let l: Vec<f32> = (0..vocab)
        .map(|i| ((i * 7919) % 10_007) as f32 / 700.0)
        .collect();
    for params in [
        (1.0, 0, 1.0),
        (0.7, 0, 0.9),
        (1.3, 40, 1.0),
        (1.0, 500, 0.95),
    ] {
        let p = SamplingParams {
            temperature: params.0,
            top_k: params.1,
            top_p: params.2,
            seed: 9,
            ..Default::default()
        };
        let probs: HashMap<u32, f64> = full_sort_probabilities(&l, &p).into_iter().collect();
        let draws = 800;
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for pos in 0..draws {
            let t = sample(&l, &p, pos, &History::default(), &[]);
            assert!(
                probs.contains_key(&t),
                "{t} is outside the allowed set for {p:?}"
            );
            *counts.entry(t).or_default() += 1;
        }
        for (t, &prob) in &probs {
            let want = prob * draws as f64;
            let got = f64::from(counts.get(t).copied().unwrap_or(0));
            let sd = (want * (1.0 - prob)).sqrt().max(1.0);
            assert!(
                (got - want).abs() <= 5.0 * sd,
                "{t}: {got} draws, {want:.1} expected, {p:?}"
            );
        }
    }
}

#[test]
fn a_tiny_temperature_is_greedy_in_the_limit() {
    let l = logits();
    for t in [1e-30, 1e-38, f32::MIN_POSITIVE / 4.0] {
        let p = SamplingParams {
            temperature: t,
            seed: 3,
            ..Default::default()
        };
        for pos in 0..20 {
            assert_eq!(
                sample(&l, &p, pos, &History::default(), &[]),
                argmax(&l),
                "{t}"
            );
        }
    }
}

#[test]
fn penalties_follow_their_definitions() {
    // Token 1 leads; 2 is close behind; 3 is far behind.
    let l = vec![0.0, 3.0, 2.5, -1.0];
    let greedy = SamplingParams::default();
    let h = History::new(&[3], &[1, 1]);
    assert_eq!(sample(&l, &greedy, 3, &h, &[]), 1);
    // Frequency: 2 x 0.3 = 0.6 off token 1, which now trails token 2.
    let freq = SamplingParams {
        frequency_penalty: 0.3,
        ..Default::default()
    };
    assert_eq!(sample(&l, &freq, 3, &h, &[]), 2);
    // Presence counts once: 0.3 is not enough, 0.6 is.
    let pres = |p| SamplingParams {
        presence_penalty: p,
        ..Default::default()
    };
    assert_eq!(sample(&l, &pres(0.3), 3, &h, &[]), 1);
    assert_eq!(sample(&l, &pres(0.6), 3, &h, &[]), 2);
    // Prompt tokens count for the repetition penalty only: token 3 in the prompt, token 1
    // generated; 3.0 / 1.3 < 2.5.
    let rep = SamplingParams {
        repetition_penalty: 1.3,
        ..Default::default()
    };
    assert_eq!(sample(&l, &rep, 3, &h, &[]), 2);
    let mut pl = l.clone();
    History::new(&[3], &[]).penalize(&mut pl, &freq);
    assert_eq!(pl, l, "OpenAI's penalties ignore the prompt");
    History::new(&[3], &[]).penalize(&mut pl, &rep);
    assert_eq!(pl[3], -1.3, "a negative logit is multiplied");
}

#[test]
fn history_is_the_same_built_at_once_or_token_by_token() {
    let prompt: Vec<u32> = (0..100).collect();
    let generated = [7u32, 8, 7, 200];
    let mut h = History::new(&prompt, &[]);
    for &t in &generated {
        h.push(t);
    }
    let at_once = History::new(&prompt, &generated);
    assert_eq!(h.recent, at_once.recent);
    assert_eq!(h.generated, at_once.generated);
    assert_eq!(h.recent.len(), REPETITION_WINDOW);
    assert_eq!(h.recent.back(), Some(&200));
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
    for bad in [
        SamplingParams {
            presence_penalty: 2.5,
            ..Default::default()
        },
        SamplingParams {
            frequency_penalty: f32::NAN,
            ..Default::default()
        },
        SamplingParams {
            repetition_penalty: 0.0,
            ..Default::default()
        },
    ] {
        assert!(bad.validate().is_err(), "{bad:?}");
    }
}

#[test]
fn min_p_cuts_tokens_far_below_the_top() {
    let l = logits();
    let best = l[argmax(&l) as usize];
    // At temperature 1, min_p 0.5 keeps the tokens within ln 2 of the top logit.
    let p = SamplingParams {
        temperature: 1.0,
        min_p: 0.5,
        seed: 3,
        ..Default::default()
    };
    let mut seen = std::collections::HashSet::new();
    for pos in 0..400 {
        let t = sample(&l, &p, pos, &History::default(), &[]);
        assert!(
            l[t as usize] >= best + 0.5f32.ln(),
            "{t}: {}",
            l[t as usize]
        );
        seen.insert(t);
    }
    assert!(seen.len() > 1, "more than the top token is drawn");
    assert!(
        SamplingParams {
            min_p: 1.5,
            ..Default::default()
        }
        .validate()
        .is_err()
    );
}

#[test]
fn logit_bias_and_banned_ids_move_the_greedy_choice() {
    let l = logits();
    let best = argmax(&l);
    let low = 0; // logit 0.0, the lowest
    let biased = SamplingParams {
        logit_bias: vec![(low, 100.0)],
        ..Default::default()
    };
    assert_eq!(sample(&l, &biased, 0, &History::default(), &[]), low);
    let second = {
        let mut l2 = l.clone();
        l2[best as usize] = f32::NEG_INFINITY;
        argmax(&l2)
    };
    let greedy = SamplingParams::default();
    assert_eq!(sample(&l, &greedy, 0, &History::default(), &[best]), second);
    // A draw never picks a banned id either.
    let hot = SamplingParams {
        temperature: 1.0,
        seed: 9,
        ..Default::default()
    };
    for pos in 0..200 {
        assert_ne!(sample(&l, &hot, pos, &History::default(), &[best]), best);
    }
    for bad in [vec![(1, 101.0)], vec![(2, 1.0), (1, 1.0)]] {
        let p = SamplingParams {
            logit_bias: bad,
            ..Default::default()
        };
        assert!(p.validate().is_err(), "{p:?}");
    }
}
