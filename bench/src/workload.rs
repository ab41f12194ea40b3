//! The benchmarks' synthetic text: deterministic, so that every system sees the same prompts.

const WORDS: &[&str] = &[
    "the",
    "river",
    "engine",
    "quietly",
    "measures",
    "a",
    "garden",
    "of",
    "numbers",
    "while",
    "every",
    "small",
    "cache",
    "remembers",
    "what",
    "came",
    "before",
    "and",
    "tomorrow",
    "we",
    "build",
    "bridges",
    "between",
    "distant",
    "servers",
    "that",
    "speak",
    "in",
    "streams",
    "light",
    "travels",
    "through",
    "glass",
    "fibers",
    "under",
    "oceans",
    "where",
    "whales",
    "sing",
    "old",
    "songs",
    "about",
    "weather",
    "maps",
    "trains",
    "leave",
    "stations",
    "on",
    "time",
    "because",
    "clocks",
    "agree",
    "history",
    "grows",
    "longer",
    "with",
    "each",
    "turn",
    "so",
    "reuse",
    "saves",
    "work",
    "please",
    "explain",
    "why",
    "this",
    "matters",
    "for",
    "latency",
    "and",
    "throughput",
];

/// Deterministic text of `n` words for (seed, session, turn).
pub(crate) fn words(n: usize, seed: u64, session: usize, turn: usize) -> String {
    let mut x = seed ^ (session as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (turn as u64) << 32;
    (0..n)
        .map(|_| {
            // xorshift64*: cheap, deterministic, good enough to vary text.
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            WORDS[(x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as usize % WORDS.len()]
        })
        .collect::<Vec<_>>()
        .join(" ")
}
