//! `tandem-bench multiturn`: synthetic multi-turn chat against a running endpoint (a Tandem
//! router over gRPC, or any OpenAI-compatible server such as llama-server), to measure what
//! prefix caching and affinity routing buy.
//!
//! The workload: `sessions` conversations of `turns` turns. They share one system prompt; each
//! turn appends the previous reply and a new user message (deterministic text from `--seed`),
//! so histories grow. Turn `t` of every session is sent before turn `t + 1` of any, with
//! `concurrency` requests in flight, so sessions interleave. Greedy decoding makes runs
//! comparable: the same binary gives the same conversations whatever the routing or caching.
//!
//! It reports, per turn and overall: time to first token, prompt and cached tokens, and (for
//! Tandem) the replicas each turn went to, the share of follow-ups served where their history
//! already was, and each replica's share of the requests. With `--cold RESULTS.json` (a run of
//! the same workload with caches off) it adds the ratio of follow-up TTFTs, turn by turn.

use std::collections::BTreeMap;

use anyhow::{Context, bail};
use clap::Args;
use futures::StreamExt;
use serde::{Deserialize, Serialize};

use crate::endpoint::{Ask, Endpoint, EndpointArgs, Failure, Input, Reply};
use crate::progress_bar;
use crate::stats::{median, percentile};
use crate::workload::words;

#[derive(Args, Debug)]
pub(crate) struct MultiturnArgs {
    #[command(flatten)]
    endpoint: EndpointArgs,
    /// Conversations.
    #[arg(long, default_value_t = 8)]
    sessions: usize,
    /// Turns per conversation (9 brings the last turn's history past 1500 tokens).
    #[arg(long, default_value_t = 9)]
    turns: usize,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Words in the shared system prompt.
    #[arg(long, default_value_t = 120)]
    system_words: usize,
    /// Words in each user message.
    #[arg(long, default_value_t = 80)]
    message_words: usize,
    /// Most tokens per reply.
    #[arg(long, default_value_t = 96)]
    max_tokens: u32,
    /// Varies the text of the messages.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// A name for this run in the results (e.g. `tandem-affinity`).
    #[arg(long, default_value = "run")]
    label: String,
    /// Results of the same workload with caches off, to compare follow-up TTFTs with.
    #[arg(long)]
    cold: Option<std::path::PathBuf>,
    /// Print the results as JSON (per-turn records and the summary) instead of a table.
    #[arg(long)]
    json: bool,
    /// Send every request under a request id of its own, and send it again with the same id
    /// after a failure the server or the way to it caused (UNAVAILABLE, a cut stream, a refused
    /// connection), up to this many times, 100 ms apart: what a client of several routers does
    /// when its router goes away. 0: no ids, no retries.
    #[arg(long, default_value_t = 0)]
    retries: u32,
}

/// One turn as measured.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub(crate) struct Turn {
    session: usize,
    pub turn: usize,
    /// When it was sent, from the run's start (`Results::started_unix_ms`).
    #[serde(default)]
    sent_ms: f64,
    pub ttft_ms: f64,
    total_ms: f64,
    prompt_tokens: u32,
    pub completion_tokens: u32,
    cached_tokens: u32,
    /// Tandem only: where it went and what the router's index said.
    decode: String,
    prefill: String,
    disaggregation: String,
    decode_overlap_tokens: u32,
    prefill_overlap_tokens: u32,
    /// Tandem only: dispatch attempts (more than 1 after a failover or a drain's hand-off),
    /// and the prompt tokens whose KV the decode node fetched from a peer.
    #[serde(default)]
    attempts: u32,
    #[serde(default)]
    fetched_tokens: u32,
    /// Times it was sent again after a failure (`--retries`).
    #[serde(default)]
    retries: u32,
    /// The reply, to compare runs of the same workload with.
    #[serde(default)]
    text: String,
}

#[derive(Serialize, Deserialize, Debug, Default)]
pub(crate) struct Summary {
    turns: usize,
    follow_ups: usize,
    last_turn_prompt_tokens_mean: f64,
    first_turn_ttft_ms_median: f64,
    follow_up_ttft_ms_median: f64,
    follow_up_ttft_ms_p90: f64,
    /// Follow-ups whose reused tokens cover at least the previous turn's prompt (full blocks).
    follow_ups_on_their_prefix: f64,
    /// The share of the follow-ups' prompt tokens that came from a cache (the endpoint's
    /// `cached_tokens`).
    #[serde(default)]
    follow_up_cached_share: f64,
    /// Those cached tokens over what caches of unbounded size would serve: each follow-up's
    /// previous turn, prompt and reply but its last token (sampled, never run through the
    /// model, so no engine holds its KV), in full blocks (at most the follow-up's reusable
    /// blocks). A reply that tokenizes otherwise in the history makes the bound a little high.
    #[serde(default)]
    follow_up_cached_over_oracle: f64,
    /// Requests per decode replica, and the most loaded one's share over the mean.
    decode_requests: BTreeMap<String, usize>,
    decode_max_over_mean: f64,
    prefill_requests: BTreeMap<String, usize>,
    prefill_max_over_mean: f64,
    local_prefills: usize,
    /// Turns sent more than once (`--retries`), and the retries in all.
    #[serde(default)]
    retried_turns: usize,
    #[serde(default)]
    retries: u64,
    /// With `--cold`: median over follow-ups of this run's TTFT over the cold run's, turn by
    /// turn, and the ratio of the medians.
    follow_up_ttft_ratio_to_cold_median: Option<f64>,
    follow_up_ttft_median_over_cold_median: Option<f64>,
}

#[derive(Serialize, Deserialize, Debug)]
pub(crate) struct Results {
    pub label: String,
    endpoint: String,
    /// The run's start, in milliseconds since the Unix epoch.
    #[serde(default)]
    started_unix_ms: u64,
    summary: Summary,
    pub turns: Vec<Turn>,
}

impl Turn {
    pub(crate) fn new(session: usize, turn: usize, sent_ms: f64, r: &Reply) -> Self {
        let route = r.route.clone().unwrap_or_default();
        Self {
            session,
            turn,
            sent_ms,
            ttft_ms: r.ttft_ms().unwrap_or_default(),
            total_ms: r.e2e_ms().unwrap_or_default(),
            prompt_tokens: r.prompt_tokens,
            completion_tokens: r.completion_tokens,
            cached_tokens: r.cached_tokens,
            decode: route.decode,
            prefill: route.prefill,
            disaggregation: route.disaggregation,
            decode_overlap_tokens: route.decode_overlap_tokens,
            prefill_overlap_tokens: route.prefill_overlap_tokens,
            attempts: route.attempts,
            fetched_tokens: route.fetched_tokens,
            retries: r.retries,
            text: r.text.clone(),
        }
    }
}

fn max_over_mean(counts: &BTreeMap<String, usize>) -> f64 {
    if counts.is_empty() {
        return 0.0;
    }
    let max = counts.values().copied().max().unwrap_or(0) as f64;
    let mean = counts.values().sum::<usize>() as f64 / counts.len() as f64;
    max / mean
}

fn summarize(turns: &[Turn], cold: Option<&Results>) -> Summary {
    let prev: BTreeMap<(usize, usize), &Turn> =
        turns.iter().map(|t| ((t.session, t.turn), t)).collect();
    let follow: Vec<&Turn> = turns.iter().filter(|t| t.turn > 0).collect();
    let on_prefix = follow
        .iter()
        .filter(|t| t.cached_tokens >= prev[&(t.session, t.turn - 1)].prompt_tokens / 16 * 16)
        .count();
    let oracle: f64 = follow
        .iter()
        .map(|t| {
            let p = prev[&(t.session, t.turn - 1)];
            let computed = (p.prompt_tokens + p.completion_tokens).saturating_sub(1);
            let held = computed.min(t.prompt_tokens.max(1) - 1);
            f64::from(held / 16 * 16)
        })
        .sum();
    let cached: f64 = follow.iter().map(|t| f64::from(t.cached_tokens)).sum();
    let last = turns.iter().map(|t| t.turn).max().unwrap_or(0);
    let last_prompts: Vec<f64> = turns
        .iter()
        .filter(|t| t.turn == last)
        .map(|t| f64::from(t.prompt_tokens))
        .collect();
    let mut decode_requests = BTreeMap::new();
    let mut prefill_requests = BTreeMap::new();
    for t in turns.iter().filter(|t| !t.decode.is_empty()) {
        *decode_requests.entry(t.decode.clone()).or_insert(0) += 1;
        if !t.prefill.is_empty() {
            *prefill_requests.entry(t.prefill.clone()).or_insert(0) += 1;
        }
    }
    let follow_ttft: Vec<f64> = follow.iter().map(|t| t.ttft_ms).collect();
    let (ratio, median_ratio) = match cold {
        Some(c) => {
            let cold_ttft: BTreeMap<(usize, usize), f64> = c
                .turns
                .iter()
                .map(|t| ((t.session, t.turn), t.ttft_ms))
                .collect();
            let ratios: Vec<f64> = follow
                .iter()
                .filter_map(|t| Some(t.ttft_ms / cold_ttft.get(&(t.session, t.turn))?))
                .collect();
            let cold_follow: Vec<f64> = c
                .turns
                .iter()
                .filter(|t| t.turn > 0)
                .map(|t| t.ttft_ms)
                .collect();
            (
                Some(median(ratios)),
                Some(median(follow_ttft.clone()) / median(cold_follow)),
            )
        }
        None => (None, None),
    };
    Summary {
        turns: turns.len(),
        follow_ups: follow.len(),
        last_turn_prompt_tokens_mean: last_prompts.iter().sum::<f64>()
            / last_prompts.len().max(1) as f64,
        first_turn_ttft_ms_median: median(
            turns
                .iter()
                .filter(|t| t.turn == 0)
                .map(|t| t.ttft_ms)
                .collect(),
        ),
        follow_up_ttft_ms_median: median(follow_ttft.clone()),
        follow_up_ttft_ms_p90: percentile(&mut follow_ttft.clone(), 0.9),
        follow_ups_on_their_prefix: on_prefix as f64 / follow.len().max(1) as f64,
        follow_up_cached_share: cached
            / follow
                .iter()
                .map(|t| t.prompt_tokens as f64)
                .sum::<f64>()
                .max(1.0),
        follow_up_cached_over_oracle: cached / oracle.max(1.0),
        decode_max_over_mean: max_over_mean(&decode_requests),
        prefill_max_over_mean: max_over_mean(&prefill_requests),
        local_prefills: turns.iter().filter(|t| t.disaggregation == "local").count(),
        retried_turns: turns.iter().filter(|t| t.retries > 0).count(),
        retries: turns.iter().map(|t| u64::from(t.retries)).sum(),
        decode_requests,
        prefill_requests,
        follow_up_ttft_ratio_to_cold_median: ratio,
        follow_up_ttft_median_over_cold_median: median_ratio,
    }
}

pub(crate) fn multiturn(args: &MultiturnArgs) -> anyhow::Result<()> {
    if args.sessions == 0 || args.turns == 0 || args.concurrency == 0 || args.max_tokens == 0 {
        bail!("--sessions, --turns, --concurrency and --max-tokens must each be at least 1");
    }
    let cold: Option<Results> = match &args.cold {
        Some(path) => Some(
            serde_json::from_str(
                &std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read {}", path.display()))?,
            )
            .with_context(|| format!("{} is not a multiturn results file", path.display()))?,
        ),
        None => None,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let started_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let (endpoint, turns) = rt.block_on(run(args))?;
    let summary = summarize(&turns, cold.as_ref());
    let results = Results {
        label: args.label.clone(),
        endpoint,
        started_unix_ms,
        summary,
        turns,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&results)?);
    } else {
        results.print_table();
    }
    Ok(())
}

impl Results {
    /// The results of a run of `turns` (no cold run to compare with).
    pub(crate) fn new(
        label: &str,
        endpoint: String,
        started_unix_ms: u64,
        turns: Vec<Turn>,
    ) -> Self {
        Self {
            label: label.to_string(),
            endpoint,
            started_unix_ms,
            summary: summarize(&turns, None),
            turns,
        }
    }
}

async fn run(args: &MultiturnArgs) -> anyhow::Result<(String, Vec<Turn>)> {
    let endpoint = Endpoint::connect(&args.endpoint).await?;
    let system = format!(
        "You are a patient assistant who answers in plain words. {}",
        words(args.system_words, args.seed, usize::MAX, 0)
    );
    let mut histories: Vec<Vec<(String, String)>> =
        vec![vec![("system".to_string(), system)]; args.sessions];
    let mut out = Vec::new();
    let total = args.sessions * args.turns;
    let progress = progress_bar(total as u64, "multiturn");
    let started = std::time::Instant::now();
    // Request ids are the run's own: another run's retries never attach to this one's.
    let run_id = rand::random::<u64>();
    for turn in 0..args.turns {
        for (s, h) in histories.iter_mut().enumerate() {
            h.push((
                "user".into(),
                words(args.message_words, args.seed, s, turn + 1),
            ));
        }
        let asks: Vec<Ask> = histories
            .iter()
            .enumerate()
            .map(|(s, h)| Ask {
                input: Input::Messages(h.clone()),
                max_tokens: args.max_tokens,
                session: format!("bench-session-{s}"),
                request_id: match args.retries {
                    0 => String::new(),
                    _ => format!("bench-{run_id:016x}-{s}-{turn}"),
                },
            })
            .collect();
        let replies = send_turn(turn, asks, args.concurrency, &progress, started, |ask| {
            let endpoint = &endpoint;
            async move {
                let mut retries = 0;
                loop {
                    match endpoint.generate(&ask).await {
                        Ok(reply) => return Ok(Reply { retries, ..reply }),
                        Err(f) if f.retryable() && retries < args.retries => {
                            retries += 1;
                            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                        }
                        Err(f) => return Err(f),
                    }
                }
            }
        })
        .await?;
        for (s, (sent_ms, reply)) in replies.into_iter().enumerate() {
            out.push(Turn::new(s, turn, sent_ms, &reply));
            histories[s].push(("assistant".into(), reply.text));
        }
    }
    progress.finish_and_clear();
    Ok((endpoint.describe(), out))
}

impl Results {
    pub(crate) fn print_table(&self) {
        print_table(self);
    }
}

/// Sends turn `turn` of every session, with `concurrency` requests in flight: `send` makes
/// session `s`'s request of `requests[s]`. Each reply with when it was sent (ms after
/// `started`), in session order; the first failure fails the turn.
pub(crate) async fn send_turn<R, F, Fut>(
    turn: usize,
    requests: Vec<R>,
    concurrency: usize,
    progress: &indicatif::ProgressBar,
    started: std::time::Instant,
    send: F,
) -> anyhow::Result<Vec<(f64, Reply)>>
where
    F: Fn(R) -> Fut,
    Fut: std::future::Future<Output = Result<Reply, Failure>>,
{
    futures::stream::iter(requests.into_iter().enumerate().map(|(s, request)| {
        let reply = send(request);
        async move {
            let sent_ms = started.elapsed().as_secs_f64() * 1e3;
            let r = reply
                .await
                .map_err(|f| anyhow::anyhow!("session {s}, turn {turn}: {f}"));
            progress.inc(1);
            r.map(|r| (sent_ms, r))
        }
    }))
    .buffered(concurrency)
    .collect::<Vec<_>>()
    .await
    .into_iter()
    .collect()
}

fn print_table(r: &Results) {
    let s = &r.summary;
    println!(
        "{} ({}): {} turns, {} follow-ups",
        r.label, r.endpoint, s.turns, s.follow_ups
    );
    println!(
        "  last turn's prompt: {:.0} tokens on average",
        s.last_turn_prompt_tokens_mean
    );
    println!(
        "  TTFT: first turn median {:.1} ms; follow-ups median {:.1} ms, p90 {:.1} ms",
        s.first_turn_ttft_ms_median, s.follow_up_ttft_ms_median, s.follow_up_ttft_ms_p90
    );
    println!(
        "  follow-ups reusing at least their previous prompt: {:.1}%; follow-up prompt tokens \
         from a cache: {:.1}% ({:.1}% of what unbounded caches would serve)",
        s.follow_ups_on_their_prefix * 100.0,
        s.follow_up_cached_share * 100.0,
        s.follow_up_cached_over_oracle * 100.0
    );
    if !s.decode_requests.is_empty() {
        println!(
            "  decode requests {:?} (max/mean {:.2}); prefill requests {:?} (max/mean {:.2}); \
             local prefills {}",
            s.decode_requests,
            s.decode_max_over_mean,
            s.prefill_requests,
            s.prefill_max_over_mean,
            s.local_prefills
        );
    }
    if s.retries > 0 {
        println!(
            "  turns sent again after a failure: {} ({} retries)",
            s.retried_turns, s.retries
        );
    }
    if let (Some(ratio), Some(of_medians)) = (
        s.follow_up_ttft_ratio_to_cold_median,
        s.follow_up_ttft_median_over_cold_median,
    ) {
        println!(
            "  follow-up TTFT vs caches off: median per-turn ratio {ratio:.3}, ratio of medians \
             {of_medians:.3}"
        );
    }
}
