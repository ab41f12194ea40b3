//! How long one routing decision takes (hashing the prompt's blocks, reading every replica's
//! cache index, the cost formula) with 10,000 conversations in the index: 2 prefill and 2
//! decode replicas, each conversation's ~1500-token history held by one of each. Criterion runs
//! it; the p50 and p99 of single decisions are printed at the end, since a tail is the target
//! (p99 under 200 µs).

use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use tandem_router::simulation::Simulation;

const SESSIONS: usize = 10_000;
const HISTORY_TOKENS: usize = 1500;

fn history(session: usize) -> Vec<u32> {
    // A shared 200-token system prompt, then the session's own turns.
    (0..HISTORY_TOKENS)
        .map(|i| {
            if i < 200 {
                i as u32
            } else {
                ((session * 7919 + i * 104_729) % 49_000) as u32
            }
        })
        .collect()
}

fn routing(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let _entered = rt.enter();
    let sim = Simulation::new(2, 2).expect("replicas");
    // Replicas 0, 1 are prefill; 2, 3 decode. Session s lives on prefill s % 2, decode 2 + s % 2.
    let mut held: Vec<Vec<u64>> = vec![Vec::new(); 4];
    for s in 0..SESSIONS {
        let h = sim.hashes(&history(s));
        held[s % 2].extend(&h);
        held[2 + s % 2].extend(&h);
    }
    for (i, h) in held.into_iter().enumerate() {
        sim.hold(i, h);
    }
    // Follow-ups: a session's history plus a 60-token message.
    let prompts: Vec<(Vec<u32>, String)> = (0..256)
        .map(|k| {
            let s = (k * 37) % SESSIONS;
            let mut p = history(s);
            p.extend((0..60).map(|i| 40_000 + i));
            (p, format!("session-{s}"))
        })
        .collect();
    // Check that the decision is the right one before timing it.
    let (decode, overlap) = sim.route(&prompts[0].0, &prompts[0].1).expect("a route");
    assert_eq!(decode, "127.0.0.1:3");
    assert!(overlap >= 1488, "overlap {overlap}");

    let mut samples: Vec<Duration> = Vec::new();
    let mut next = 0;
    c.bench_function("route a follow-up, 10k sessions indexed", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let (p, s) = &prompts[next % prompts.len()];
                next += 1;
                let started = Instant::now();
                let routed = sim.route(p, s);
                let took = started.elapsed();
                std::hint::black_box(routed);
                total += took;
                samples.push(took);
            }
            total
        })
    });
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    println!(
        "single decisions: {} samples, p50 {:?}, p99 {:?}, max {:?}",
        samples.len(),
        at(0.5),
        at(0.99),
        samples[samples.len() - 1]
    );
}

criterion_group!(benches, routing);
criterion_main!(benches);
