//! What the peer routers' state exchange costs with many agent sessions open: each router asks
//! each peer for its sessions changed since the last answer every `--load-poll-ms` (250 ms), so
//! at R routers each answers and takes in R - 1 answers per poll.
//!
//! Router A's table holds `TANDEM_PEER_SESSIONS` sessions (default 100,000, tenants of 256
//! each) of `TANDEM_PEER_TOKENS` tokens (default 2,048); B takes in a full answer (timed: what a
//! restarted peer asks for), which carries as many of them as one message holds. Then, poll after poll, `TANDEM_PEER_TURNS` sessions
//! (default 25: 100 turns a second through A) take a turn of 200 tokens more on A, A answers
//! what changed since B's last answer and B takes it in. Printed: the medians of 21 polls (the
//! answer's bytes, A's time to answer, B's to take it in), and what a router spends on the
//! exchange per second at 2 and 4 routers, as a share of one core. Also what recording a turn of
//! a new session costs in a table that large. One thread, nothing else running.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_router::simulation::SessionTable;

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).map_or(default, |v| v.parse().expect("a count"))
}

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

fn main() {
    let sessions = env("TANDEM_PEER_SESSIONS", 100_000);
    let tokens = env("TANDEM_PEER_TOKENS", 2_048);
    let turns = env("TANDEM_PEER_TURNS", 25);
    let a = SessionTable::new(256);
    let b = SessionTable::new(256);
    let tenants: Vec<Arc<str>> = (0..sessions.div_ceil(256))
        .map(|t| Arc::from(format!("tenant-{t}")))
        .collect();
    let id = |s: usize| format!("session-{s}");
    let history = |s: usize, len: usize| -> Vec<u32> {
        (0..len)
            .map(|i| ((s * 7919 + i * 104_729) % 49_000) as u32)
            .collect()
    };
    let reply: Vec<u32> = (0..64).collect();

    // Fill A; the last thousand new sessions are timed.
    let mut new_turns = Vec::new();
    for s in 0..sessions {
        let prompt = history(s, tokens);
        let started = Instant::now();
        a.turn(&tenants[s / 256], &id(s), &prompt, &reply);
        if s + 1000 >= sessions {
            new_turns.push(started.elapsed());
        }
    }
    assert_eq!(a.open_sessions(), sessions);

    let peer_a: Arc<str> = Arc::from("router-a");
    let started = Instant::now();
    let (mut seq, full) = a.answer(0);
    let answered = started.elapsed();
    let started = Instant::now();
    assert!(b.learn(&peer_a, &full));
    let learned = started.elapsed();
    let learned_sessions = b.open_sessions();
    assert!(learned_sessions > 0, "B learned the most recent sessions");
    println!(
        "{sessions} sessions of {} tokens: a full answer carries the {learned_sessions} most \
         recently used, {:.1} MB, answered in {answered:?}, taken in in {learned:?}; a new \
         session's turn is recorded in {:?} (median of the last 1000)",
        tokens + reply.len(),
        full.len() as f64 / 1e6,
        median(new_turns),
    );
    drop(full);

    let (mut bytes, mut answer_t, mut learn_t) = (Vec::new(), Vec::new(), Vec::new());
    for poll in 0..21 {
        for k in 0..turns {
            let s = (poll * turns + k) * 7 % sessions;
            let mut prompt = history(s, tokens);
            prompt.extend(&reply);
            prompt.extend(40_000..40_200);
            a.turn(&tenants[s / 256], &id(s), &prompt, &reply);
        }
        let started = Instant::now();
        let (next, answer) = a.answer(seq);
        answer_t.push(started.elapsed());
        let started = Instant::now();
        assert!(b.learn(&peer_a, &answer));
        learn_t.push(started.elapsed());
        bytes.push(answer.len());
        seq = next;
    }
    bytes.sort_unstable();
    let (answer_t, learn_t) = (median(answer_t), median(learn_t));
    println!(
        "a poll with {turns} sessions changed: {:.0} kB, answered in {answer_t:?}, taken in in \
         {learn_t:?} (medians of 21)",
        bytes[bytes.len() / 2] as f64 / 1e3,
    );
    for routers in [2u32, 4] {
        // Each router answers and takes in (routers - 1) answers per 250 ms poll.
        let per_second = (answer_t + learn_t).as_secs_f64() * f64::from(routers - 1) * 4.0;
        println!(
            "{routers} routers: {:.1} ms of CPU a second per router on the exchange ({:.2}% of a \
             core), {:.0} kB a second each way per peer",
            per_second * 1e3,
            per_second * 100.0,
            bytes[bytes.len() / 2] as f64 * 4.0 / 1e3,
        );
    }
}
