//! `tandem-bench router`: what the router's own work on one request costs, in this process, with
//! no network and no workers. Each HTTP body is parsed, checked, its messages rendered through the
//! model's chat template, tokenized and its blocks hashed, exactly as the router does before it
//! routes (`tandem_router::fuzzing::RequestChecks`).
//!
//! The workload is `bench agent`'s: sessions of one agent (a shared system prompt and tool
//! list) whose history grows by a tool call and its result each turn. Every turn's body goes
//! through two routers, one after the other: one that has seen the session's earlier turns (its
//! cache of token ids warm, as in a running router), and one with no cache, which tokenizes
//! every prompt whole. Plain chat requests (a short user message, no tools, each different) are
//! timed the same way. Times are of this one thread while it does nothing else (wall time, which
//! bounds its CPU time from above); nothing else should run on the machine.

use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use serde::Serialize;
use serde_json::json;
use tandem_client::ModelArgs;
use tandem_router::fuzzing::RequestChecks;

use crate::agent::{SessionShape, Workload};
use crate::endpoint::AgentApi;
use crate::stats::Dist;
use crate::workload::words;

#[derive(Args, Debug)]
pub(crate) struct RouterArgs {
    /// Whose tokenizer and chat template the router uses.
    #[command(flatten)]
    model: ModelArgs,
    /// Which API the agent speaks.
    #[arg(long, value_enum, default_value = "messages")]
    api: AgentApi,
    #[command(flatten)]
    shape: SessionShape,
    /// Turns per session.
    #[arg(long, default_value_t = 40)]
    turns: usize,
    /// Agent turns whose prompt has at least this many tokens make the summary's band.
    #[arg(long, default_value_t = 11_000)]
    band_from: usize,
    /// ... and at most this many.
    #[arg(long, default_value_t = 30_000)]
    band_to: usize,
    /// Plain chat requests timed.
    #[arg(long, default_value_t = 200)]
    chats: usize,
    /// Time only the router with the cache (the whole-prompt times are reported as 0): for a
    /// profiler's view of the cached path alone.
    #[arg(long)]
    cached_only: bool,
    /// Print the results as JSON (every turn and the summary) instead of a table.
    #[arg(long)]
    json: bool,
}

/// One agent turn: its prompt's size and what the router's work on it took.
#[derive(Serialize, Debug)]
struct TurnTime {
    session: usize,
    turn: usize,
    prompt_tokens: usize,
    body_bytes: usize,
    cached_us: f64,
    whole_us: f64,
}

#[derive(Serialize, Debug)]
struct Summary {
    model: String,
    api: &'static str,
    /// Agent turns in the band, and their times in µs: with the cache, without, and the ratio of
    /// the medians.
    band_turns: usize,
    band_tokens: (usize, usize),
    cached_us: Dist,
    whole_us: Dist,
    speedup: f64,
    /// Plain chat requests, in µs, and their median prompt tokens.
    chat_prompt_tokens: usize,
    chat_cached_us: Dist,
    chat_whole_us: Dist,
}

/// Runs `f` once and returns its result with the time it took, in µs.
fn timed<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let start = Instant::now();
    let out = f();
    (out, start.elapsed().as_secs_f64() * 1e6)
}

pub(crate) fn router(args: &RouterArgs) -> anyhow::Result<()> {
    if args.shape.sessions == 0 || args.turns == 0 {
        bail!("--sessions and --turns must each be at least 1");
    }
    let model = args.model.source().load()?;
    let info = tandem_worker::worker_info(
        &model,
        model.config.kv_layout(tandem_engine::KvDtype::F16),
        "decode",
    );
    let cached = RequestChecks::new(&info).context("the model's tokenizer")?;
    let whole = RequestChecks::uncached(&info).context("the model's tokenizer")?;
    let endpoint = match args.api {
        AgentApi::Messages => 2,
        AgentApi::Responses => 3,
    };
    let mut workload = Workload::new(&args.shape);
    let mut turns = Vec::new();
    let progress = crate::progress_bar((args.shape.sessions * args.turns) as u64, "agent turns");
    for turn in 0..args.turns {
        for s in 0..args.shape.sessions {
            let body = serde_json::to_vec(&workload.body(args.api, &model.name, 256, s))?;
            let (tokens, cached_us) = timed(|| cached.http(endpoint, &body));
            let tokens = tokens.context("the router refused an agent turn")?;
            let whole_us = if args.cached_only {
                0.0
            } else {
                let (again, us) = timed(|| whole.http(endpoint, &body));
                if again != Some(tokens) {
                    bail!("turn {turn}: {tokens} tokens with the cache, {again:?} without");
                }
                us
            };
            turns.push(TurnTime {
                session: s,
                turn,
                prompt_tokens: tokens,
                body_bytes: body.len(),
                cached_us,
                whole_us,
            });
            workload.step(s, turn);
            progress.inc(1);
        }
    }
    progress.finish_and_clear();
    let (mut chat_tokens, mut chat_cached, mut chat_whole) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..args.chats {
        let body = serde_json::to_vec(&json!({
            "model": model.name, "max_tokens": 256,
            "messages": [{"role": "user", "content": words(60, 7, i, 0)}],
        }))?;
        let (tokens, us) = timed(|| cached.http(1, &body));
        chat_cached.push(us);
        chat_whole.push(timed(|| whole.http(1, &body)).1);
        chat_tokens.push(tokens.context("the router refused a chat request")? as f64);
    }
    let band: Vec<&TurnTime> = turns
        .iter()
        .filter(|t| (args.band_from..=args.band_to).contains(&t.prompt_tokens))
        .collect();
    let of = |f: fn(&TurnTime) -> f64| Dist::of(&band.iter().map(|t| f(t)).collect::<Vec<_>>());
    let (cached_us, whole_us) = (of(|t| t.cached_us), of(|t| t.whole_us));
    let summary = Summary {
        model: model.name.clone(),
        api: match args.api {
            AgentApi::Messages => "messages",
            AgentApi::Responses => "responses",
        },
        band_turns: band.len(),
        band_tokens: (args.band_from, args.band_to),
        cached_us,
        whole_us,
        speedup: whole_us.p50 / cached_us.p50,
        chat_prompt_tokens: crate::stats::median(chat_tokens) as usize,
        chat_cached_us: Dist::of(&chat_cached),
        chat_whole_us: Dist::of(&chat_whole),
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({"summary": summary, "turns": turns}))?
        );
    } else {
        print_table(&summary, &turns);
    }
    Ok(())
}

fn print_table(s: &Summary, turns: &[TurnTime]) {
    println!("model {}  API {}", s.model, s.api);
    println!(
        "{:>6} {:>8} {:>10} {:>12} {:>12}",
        "turn", "session", "tokens", "cached µs", "whole µs"
    );
    for t in turns.iter().filter(|t| t.session == 0) {
        println!(
            "{:>6} {:>8} {:>10} {:>12.0} {:>12.0}",
            t.turn, t.session, t.prompt_tokens, t.cached_us, t.whole_us
        );
    }
    println!(
        "agent turns of {}-{} tokens ({}): cached p50 {:.0} µs p90 {:.0} µs; whole p50 {:.0} µs \
         p90 {:.0} µs; {:.1}x",
        s.band_tokens.0,
        s.band_tokens.1,
        s.band_turns,
        s.cached_us.p50,
        s.cached_us.p90,
        s.whole_us.p50,
        s.whole_us.p90,
        s.speedup
    );
    println!(
        "chat requests of {} tokens: cached p50 {:.0} µs p90 {:.0} µs; whole p50 {:.0} µs",
        s.chat_prompt_tokens, s.chat_cached_us.p50, s.chat_cached_us.p90, s.chat_whole_us.p50
    );
}
