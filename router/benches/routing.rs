//! How long one routing decision takes (reading the replicas' cache indexes and the cost formula
//! on a prompt's block hashes, as the router does once it has hashed the prompt), and what the
//! index holds in memory per cached block per replica.
//!
//! Two workloads, each checked to route right before it is timed:
//! - `chat, 10k sessions`: 2 prefill and 2 decode replicas, 10,000 conversations of ~1,500
//!   tokens in the index, each held by one replica of each role; a follow-up adds 60 tokens.
//! - `agents, N replicas`, for each N in `TANDEM_ROUTING_FLEET` (default `16,64,256,1024`): a
//!   quarter of them prefill, the rest decode, every one holding an agent's shared 11k-token
//!   system prompt (a fleet serving one agent), and N sessions of 2k tokens more, each held by
//!   one decode and one prefill replica; a follow-up adds 200 tokens.
//!
//! And how many cache events a replica's index absorbs per second (`events`).
//!
//! Criterion times each. Since a tail is the target, the p50 and p99 of single decisions are
//! printed too, with the index's live heap bytes (a counting global allocator) per block per
//! replica holding it.

use std::alloc::System;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use prost::Message;
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};
use tandem_proto::v1 as pb;
use tandem_router::simulation::Simulation;

#[global_allocator]
static ALLOC: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Pseudo-random token ids of `session`'s own part, `len` of them from position `from`.
fn own_tokens(session: usize, from: usize, len: usize) -> impl Iterator<Item = u32> {
    (from..from + len).map(move |i| ((session * 7919 + i * 104_729) % 49_000) as u32)
}

/// A workload: the replica set, what each replica holds, and follow-up prompts with the decode
/// replica each must go to.
struct Workload {
    name: String,
    sim: Simulation,
    /// Each follow-up's token count, block hashes, session id and expected decode replica.
    prompts: Vec<(usize, Vec<u64>, String, String)>,
    /// Live heap bytes the indexes took, and the (block, replica) entries they hold.
    index_bytes: i64,
    entries: usize,
}

/// 256 follow-ups spread over `sessions`: each session's `history` and `new` tokens more, and
/// the decode replica holding the session (`decode_of`).
fn follow_ups(
    sim: &Simulation,
    sessions: usize,
    new: u32,
    history: impl Fn(usize) -> Vec<u32>,
    decode_of: impl Fn(usize) -> usize,
) -> Vec<(usize, Vec<u64>, String, String)> {
    (0..256)
        .map(|k| {
            let s = (k * 37) % sessions;
            let mut p = history(s);
            p.extend(40_000..40_000 + new);
            let decode = Simulation::addr(decode_of(s));
            (
                p.len(),
                sim.prompt_hashes(&p),
                format!("session-{s}"),
                decode,
            )
        })
        .collect()
}

/// Fills the replicas' indexes: replica `i` holds `held(i)`. Returns the live heap bytes that
/// added (the hash lists are made and dropped inside, so only the indexes remain) and the entries.
fn fill(sim: &Simulation, replicas: usize, held: impl Fn(usize) -> Vec<u64>) -> (i64, usize) {
    let region = Region::new(ALLOC);
    let mut entries = 0;
    for i in 0..replicas {
        let h = held(i);
        entries += h.len();
        sim.hold(i, h);
    }
    let c = region.change();
    let live = c.bytes_allocated as i64 - c.bytes_deallocated as i64 + c.bytes_reallocated as i64;
    (live, entries)
}

/// 2P+2D, 10,000 conversations of ~1,500 tokens (a shared 200-token system prompt).
fn chat() -> Workload {
    const SESSIONS: usize = 10_000;
    let history = |s: usize| -> Vec<u32> { (0..200).chain(own_tokens(s, 200, 1300)).collect() };
    let sim = Simulation::new(2, 2).expect("replicas");
    // Replicas 0, 1 are prefill; 2, 3 decode. Session s lives on prefill s % 2, decode 2 + s % 2.
    let (index_bytes, entries) = fill(&sim, 4, |i| {
        (i % 2..SESSIONS)
            .step_by(2)
            .flat_map(|s| sim.hashes(&history(s)))
            .collect()
    });
    let prompts = follow_ups(&sim, SESSIONS, 60, history, |s| 2 + s % 2);
    Workload {
        name: "chat, 10k sessions, 4 replicas".into(),
        sim,
        prompts,
        index_bytes,
        entries,
    }
}

/// `n` replicas serving one agent: a shared 11k-token system prompt everywhere, `n` sessions of
/// 2k tokens more each on one prefill and one decode replica.
fn agents(n: usize) -> Workload {
    const SYSTEM: usize = 11_000;
    const OWN: usize = 2_000;
    let (prefill, decode) = ((n / 4).max(1), n - (n / 4).max(1));
    let history = |s: usize| -> Vec<u32> {
        (0..SYSTEM as u32)
            .map(|i| i % 49_000)
            .chain(own_tokens(s, SYSTEM, OWN))
            .collect()
    };
    let sim = Simulation::new(prefill, decode).expect("replicas");
    let system = sim.hashes(&history(0)[..SYSTEM]);
    let (index_bytes, entries) = fill(&sim, n, |i| {
        let mine = |s: &usize| {
            if i < prefill {
                s % prefill == i
            } else {
                prefill + s % decode == i
            }
        };
        let mut held = system.clone();
        for s in (0..n).filter(mine) {
            held.extend(&sim.hashes(&history(s))[system.len()..]);
        }
        held
    });
    let prompts = follow_ups(&sim, n, 200, history, |s| prefill + s % decode);
    Workload {
        name: format!("agents, {n} replicas"),
        sim,
        prompts,
        index_bytes,
        entries,
    }
}

fn run(c: &mut Criterion, w: &Workload) {
    // The decision must be the right one before it is timed: each follow-up to its session's
    // decode replica, which holds all of its history.
    for (tokens, hashes, session, decode) in &w.prompts {
        let (to, overlap) = w.sim.route(*tokens, hashes, session).expect("a route");
        assert_eq!(&to, decode, "{}: {session}", w.name);
        assert!(overlap + 300 >= *tokens, "{}: overlap {overlap}", w.name);
    }
    let mut samples: Vec<Duration> = Vec::new();
    let mut next = 0;
    let mut group = c.benchmark_group("route a follow-up");
    group
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    group.bench_function(&w.name, |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let (tokens, hashes, session, _) = &w.prompts[next % w.prompts.len()];
                next += 1;
                let started = Instant::now();
                let routed = w.sim.route(*tokens, hashes, session);
                let took = started.elapsed();
                std::hint::black_box(routed);
                total += took;
                samples.push(took);
            }
            total
        })
    });
    group.finish();
    if samples.is_empty() {
        // Filtered out on the command line.
        return;
    }
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    println!(
        "{}: single decisions: {} samples, p50 {:?}, p99 {:?}, max {:?}; index: {} entries, \
         {:.1} bytes each",
        w.name,
        samples.len(),
        at(0.5),
        at(0.99),
        samples[samples.len() - 1],
        w.entries,
        w.index_bytes as f64 / w.entries as f64,
    );
}

/// How many cache events the index absorbs per second of one core: each decoded from its wire
/// bytes and applied, as a replica's follow task does (the gRPC stream's framing aside). A
/// worker's events alternate between storing a turn's 16 new blocks and evicting 16 old ones,
/// over an index of 100k blocks.
fn events() {
    const BLOCKS: u64 = 100_000;
    const PER_EVENT: u64 = 16;
    const EVENTS: u64 = 20_000;
    // Even events store the next 16 new blocks, odd ones evict the 16 oldest.
    let wire: Vec<Vec<u8>> = (0..EVENTS)
        .map(|k| {
            let (from, stored) = if k % 2 == 0 {
                (BLOCKS + k / 2 * PER_EVENT, true)
            } else {
                (k / 2 * PER_EVENT, false)
            };
            let hashes = (from..from + PER_EVENT).collect();
            let kind = if stored {
                pb::cache_event::Kind::Stored(pb::BlocksStored { hashes })
            } else {
                pb::cache_event::Kind::Evicted(pb::BlocksEvicted { hashes })
            };
            pb::CacheEvent {
                epoch: 1,
                seq: 1 + k,
                kind: Some(kind),
            }
            .encode_to_vec()
        })
        .collect();
    // Five runs, each on a fresh index; the median.
    let mut runs: Vec<Duration> = (0..5)
        .map(|_| {
            let sim = Simulation::new(0, 1).expect("replicas");
            sim.hold(0, (0..BLOCKS).collect());
            let decoded = wire
                .iter()
                .map(|b| pb::CacheEvent::decode(b.as_slice()).expect("an event"));
            let started = Instant::now();
            let applied = sim.apply(0, decoded);
            let took = started.elapsed();
            assert_eq!(applied as u64, EVENTS, "every event applies in sequence");
            took
        })
        .collect();
    runs.sort();
    let took = runs[runs.len() / 2];
    println!(
        "cache events: {EVENTS} of {PER_EVENT} blocks decoded and applied in {took:?} (median of \
         5): {:.0} events/s ({:.0} blocks/s) on one core",
        EVENTS as f64 / took.as_secs_f64(),
        (EVENTS * PER_EVENT) as f64 / took.as_secs_f64(),
    );
}

fn routing(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let _entered = rt.enter();
    events();
    run(c, &chat());
    let sizes = std::env::var("TANDEM_ROUTING_FLEET").unwrap_or_else(|_| "16,64,256,1024".into());
    for n in sizes.split(',') {
        let n: usize = n
            .trim()
            .parse()
            .expect("TANDEM_ROUTING_FLEET: replica counts");
        run(c, &agents(n));
    }
}

criterion_group!(benches, routing);
criterion_main!(benches);
