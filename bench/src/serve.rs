//! `tandem-bench serve`: load against a running endpoint (a Tandem router over gRPC, or any
//! OpenAI-compatible server), at fixed concurrencies (closed loop: each client sends its next
//! request when the last one ends) or at request rates (open loop: Poisson arrivals, or burstier
//! ones with `--burstiness` below 1).
//!
//! Every request is a distinct raw-text prompt (no cache can serve it) of `--prompt-words`
//! words, or, with `--prompt-sigma`, of a heavy-tailed (log-normal) number of words around it,
//! asking for `--max-tokens` greedy tokens. Per level it reports TTFT, TPOT (time per output
//! token after the first), ITL (gaps between streamed tokens) and end-to-end latency as p50,
//! p90 and p99; request throughput and output tokens/s; goodput (requests per second that met
//! both `--slo-ttft-ms` and `--slo-tpot-ms`); and failures by status code. Against Tandem over
//! gRPC it adds the median queue, prefill and transfer times the router reports.
//!
//! Progress goes to stderr; a table to stdout, or with `--json` the results (the raw samples
//! included, for `tandem-bench plot`), also written to `--out`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use rand::SeedableRng;
use rand_distr::{Distribution, Gamma, LogNormal};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use crate::endpoint::{Ask, Endpoint, EndpointArgs, Failure, Input, Reply};
use crate::progress_bar;
use crate::stats::{Dist, median};
use crate::workload::words;

#[derive(Args, Debug)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    endpoint: EndpointArgs,
    /// Closed-loop clients, one level per value (comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,4,16",
        conflicts_with = "rate"
    )]
    concurrency: Vec<usize>,
    /// Open-loop arrivals instead, in requests per second, one level per value.
    #[arg(long, value_delimiter = ',')]
    rate: Vec<f64>,
    /// How the gaps between open-loop arrivals vary: Gamma-distributed with this shape (and the
    /// mean `1 / --rate`), as vLLM's `bench serve` does. 1 is Poisson; below 1, requests come in
    /// bursts with quiet spells between them (0.25: gaps with 2x the spread of Poisson's).
    #[arg(long, default_value_t = 1.0)]
    burstiness: f64,
    /// Most requests in flight at a request rate; an arrival past it waits for a slot.
    #[arg(long, default_value_t = 256)]
    max_inflight: usize,
    /// Requests per level.
    #[arg(long, default_value_t = 64)]
    requests: usize,
    /// Words per prompt (about one token each with SmolLM2); with `--prompt-sigma`,
    /// the median.
    #[arg(long, default_value_t = 100)]
    prompt_words: usize,
    /// Spread prompt lengths log-normally around `--prompt-words` with this sigma (at most 16
    /// times the median); 0 gives every prompt `--prompt-words` words. 1.0 is like chat traffic:
    /// a tenth of the median at p1, about 10 times it at p99.
    #[arg(long, default_value_t = 0.0)]
    prompt_sigma: f64,
    /// Tokens asked of each request (it may stop sooner at an end-of-text token).
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// Requests sent before the first level and not counted (connections, caches of the
    /// server's code paths).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// The TTFT a request must meet to count towards goodput, in ms.
    #[arg(long, default_value_t = 1000.0)]
    slo_ttft_ms: f64,
    /// The TPOT a request must meet to count towards goodput, in ms.
    #[arg(long, default_value_t = 100.0)]
    slo_tpot_ms: f64,
    /// Picks the prompts (and the arrival times); unset, a random seed, recorded in the
    /// results. A server that already answered a seed's prompts may serve them from its prefix
    /// cache, so give each run against a running server its own seed.
    #[arg(long)]
    seed: Option<u64>,
    /// A name for this system in the results and plots (e.g. `tandem`, `llama-server`).
    #[arg(long, default_value = "run")]
    label: String,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// Also write the JSON results to this file.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

/// Samples kept for plots, in ms.
#[derive(Serialize, Deserialize, Debug, Default, Clone)]
pub(crate) struct Samples {
    pub ttft_ms: Vec<f64>,
    pub tpot_ms: Vec<f64>,
    pub itl_ms: Vec<f64>,
}

/// What the Tandem router reported on its final frames (gRPC only): medians, in ms.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub(crate) struct TandemTimings {
    pub queue_ms: f64,
    pub prefill_ms: f64,
    /// From the first KV chunk sent to the push acknowledged (overlaps the prefill).
    pub transfer_ms: f64,
    /// TTFT not covered by the router's queue or prefill compute: waiting in the prefill
    /// node's queue, and the part of the transfer and hand-off that did not overlap compute.
    pub wait_and_transfer_ms: f64,
}

/// One load level's results.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub(crate) struct Level {
    /// `concurrency` or `rate`.
    pub mode: String,
    /// Clients, or requests per second.
    pub value: f64,
    pub requests: usize,
    pub completed: usize,
    /// Completed requests that produced no token (the model ended at once): no TTFT.
    pub empty: usize,
    pub failed: BTreeMap<String, usize>,
    /// The first failure's message for each code.
    #[serde(default)]
    pub failed_example: BTreeMap<String, String>,
    pub duration_s: f64,
    pub request_throughput: f64,
    pub output_tok_s: f64,
    pub prompt_tokens_mean: f64,
    pub completion_tokens_mean: f64,
    pub ttft_ms: Dist,
    pub tpot_ms: Dist,
    pub itl_ms: Dist,
    pub e2e_ms: Dist,
    /// Completed requests per second that met both SLOs.
    pub goodput_req_s: f64,
    /// The share of requests sent that met both SLOs.
    pub goodput_share: f64,
    pub tandem: Option<TandemTimings>,
    /// How long the failed requests took to fail, in ms (none failed: `None`): a refusal for
    /// want of room should come at once.
    #[serde(default)]
    pub failed_ms: Option<Dist>,
    pub samples: Samples,
    /// Each request's completion text, in request order (`None`: it failed). Greedy decoding
    /// makes them comparable between runs of the same seed: an exact server answers the same.
    #[serde(default)]
    pub texts: Vec<Option<String>>,
}

/// A `bench serve` run.
#[derive(Serialize, Deserialize, Debug)]
pub(crate) struct Results {
    pub label: String,
    pub endpoint: String,
    pub seed: u64,
    pub prompt_words: usize,
    #[serde(default)]
    pub prompt_sigma: f64,
    #[serde(default = "poisson")]
    pub burstiness: f64,
    pub max_tokens: u32,
    pub slo_ttft_ms: f64,
    pub slo_tpot_ms: f64,
    pub levels: Vec<Level>,
}

fn poisson() -> f64 {
    1.0
}

/// How requests are released.
#[derive(Debug, Clone, Copy)]
enum Load {
    Concurrency(usize),
    Rate(f64),
}

pub(crate) fn serve(args: &ServeArgs) -> anyhow::Result<()> {
    if args.requests == 0 || args.prompt_words == 0 || args.max_tokens < 2 {
        bail!("--requests and --prompt-words must be at least 1, --max-tokens at least 2");
    }
    let loads: Vec<Load> = if args.rate.is_empty() {
        if args.concurrency.contains(&0) {
            bail!("--concurrency levels must be at least 1");
        }
        args.concurrency
            .iter()
            .map(|&c| Load::Concurrency(c))
            .collect()
    } else {
        if args.rate.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
            bail!("--rate levels must be positive numbers of requests per second");
        }
        if args.max_inflight == 0 {
            bail!("--max-inflight must be at least 1");
        }
        if !(args.burstiness.is_finite() && args.burstiness > 0.0) {
            bail!("--burstiness must be a positive number");
        }
        args.rate.iter().map(|&r| Load::Rate(r)).collect()
    };
    if !(args.prompt_sigma.is_finite() && args.prompt_sigma >= 0.0) {
        bail!("--prompt-sigma must be a number at least 0");
    }
    let seed = args.seed.unwrap_or_else(rand::random);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let results = rt.block_on(async {
        let endpoint = Endpoint::connect(&args.endpoint).await?;
        for i in 0..args.warmup {
            endpoint
                .generate(&ask(args, seed, usize::MAX, i))
                .await
                .map_err(|f| anyhow::anyhow!("warm-up request: {f}"))?;
        }
        let mut levels = Vec::new();
        for (n, &load) in loads.iter().enumerate() {
            levels.push(level(&endpoint, args, seed, n, load).await);
        }
        Ok::<_, anyhow::Error>(Results {
            label: args.label.clone(),
            endpoint: endpoint.describe(),
            seed,
            prompt_words: args.prompt_words,
            prompt_sigma: args.prompt_sigma,
            burstiness: args.burstiness,
            max_tokens: args.max_tokens,
            slo_ttft_ms: args.slo_ttft_ms,
            slo_tpot_ms: args.slo_tpot_ms,
            levels,
        })
    })?;
    let json = serde_json::to_string_pretty(&results)?;
    if let Some(path) = &args.out {
        std::fs::write(path, &json).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if args.json {
        println!("{json}");
    } else {
        print_table(&results);
    }
    Ok(())
}

/// Request `i` of level `level`: its own prompt, of its own length.
fn ask(args: &ServeArgs, seed: u64, level: usize, i: usize) -> Ask {
    let n = match LogNormal::new((args.prompt_words as f64).ln(), args.prompt_sigma) {
        Ok(d) if args.prompt_sigma > 0.0 => {
            let key = seed ^ (level as u64) << 40 ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let words = d.sample(&mut rand_chacha::ChaCha8Rng::seed_from_u64(key));
            (words.round() as usize).clamp(1, args.prompt_words * 16)
        }
        _ => args.prompt_words,
    };
    Ask {
        input: Input::Prompt(words(n, seed, level, i)),
        max_tokens: args.max_tokens,
        session: format!("bench-serve-{level}-{i}"),
        request_id: String::new(),
    }
}

async fn level(endpoint: &Endpoint, args: &ServeArgs, seed: u64, n: usize, load: Load) -> Level {
    let (mode, value) = match load {
        Load::Concurrency(c) => ("concurrency", c as f64),
        Load::Rate(r) => ("rate", r),
    };
    let progress = progress_bar(args.requests as u64, &format!("{mode} {value}"));
    let started = Instant::now();
    let mut outcomes: Vec<(usize, Outcome)> = match load {
        Load::Concurrency(c) => closed_loop(endpoint, args, seed, n, c, &progress).await,
        Load::Rate(r) => open_loop(endpoint, args, seed, n, r, &progress).await,
    };
    let duration_s = started.elapsed().as_secs_f64();
    progress.finish_and_clear();
    outcomes.sort_by_key(|(i, _)| *i);
    let outcomes: Vec<Outcome> = outcomes.into_iter().map(|(_, o)| o).collect();
    let level = summarize(args, mode, value, &outcomes, duration_s);
    eprintln!(
        "{mode} {value}: {} of {} completed in {duration_s:.1} s",
        level.completed, level.requests
    );
    level
}

/// A request's outcome: its reply, or how it failed and how long that took (ms).
type Outcome = Result<Reply, (Failure, f64)>;

/// Sends one request and ticks the progress bar.
async fn send(endpoint: &Endpoint, ask: &Ask, progress: &indicatif::ProgressBar) -> Outcome {
    let sent = Instant::now();
    let reply = endpoint
        .generate(ask)
        .await
        .map_err(|f| (f, sent.elapsed().as_secs_f64() * 1e3));
    progress.inc(1);
    reply
}

/// `clients` loops, each sending its next request when the last one ends.
async fn closed_loop(
    endpoint: &Endpoint,
    args: &ServeArgs,
    seed: u64,
    n: usize,
    clients: usize,
    progress: &indicatif::ProgressBar,
) -> Vec<(usize, Outcome)> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let client = || async {
        let mut out = Vec::new();
        loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if i >= args.requests {
                return out;
            }
            out.push((i, send(endpoint, &ask(args, seed, n, i), progress).await));
        }
    };
    futures::future::join_all((0..clients).map(|_| client()))
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// Requests released at seeded arrival times (`rate` per second, Gamma-distributed gaps of shape
/// `--burstiness`), at most `--max-inflight` at once.
async fn open_loop(
    endpoint: &Endpoint,
    args: &ServeArgs,
    seed: u64,
    n: usize,
    rate: f64,
    progress: &indicatif::ProgressBar,
) -> Vec<(usize, Outcome)> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ n as u64);
    let slots = &Semaphore::new(args.max_inflight);
    let start = tokio::time::Instant::now();
    let mut at = Duration::ZERO;
    let tasks = futures::stream::FuturesUnordered::new();
    // The arguments were checked: a positive shape and a positive rate.
    let gaps = Gamma::new(args.burstiness, 1.0 / (rate * args.burstiness)).ok();
    for i in 0..args.requests {
        let gap = gaps.as_ref().map_or(1.0 / rate, |g| g.sample(&mut rng));
        at += Duration::from_secs_f64(gap);
        let ask = ask(args, seed, n, i);
        tasks.push(async move {
            tokio::time::sleep_until(start + at).await;
            let _slot = slots.acquire().await;
            (i, send(endpoint, &ask, progress).await)
        });
    }
    futures::StreamExt::collect(tasks).await
}

fn summarize(
    args: &ServeArgs,
    mode: &str,
    value: f64,
    outcomes: &[Outcome],
    duration_s: f64,
) -> Level {
    let mut failed = BTreeMap::new();
    let mut failed_example = BTreeMap::new();
    let mut failed_ms = Vec::new();
    let mut samples = Samples::default();
    let (mut e2e, mut prompt, mut completion) = (Vec::new(), Vec::new(), Vec::new());
    let (mut queue, mut prefill, mut transfer, mut waited) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut good = 0usize;
    let mut completed = 0usize;
    let mut empty = 0usize;
    for o in outcomes {
        let r = match o {
            Ok(r) => r,
            Err((f, ms)) => {
                *failed.entry(f.code.clone()).or_insert(0) += 1;
                failed_example
                    .entry(f.code.clone())
                    .or_insert_with(|| f.message.clone());
                failed_ms.push(*ms);
                continue;
            }
        };
        completed += 1;
        let Some(ttft) = r.ttft_ms() else {
            empty += 1;
            continue;
        };
        samples.ttft_ms.push(ttft);
        samples.itl_ms.extend(r.itl_ms());
        let tpot = r.tpot_ms();
        samples.tpot_ms.extend(tpot);
        e2e.extend(r.e2e_ms());
        prompt.push(f64::from(r.prompt_tokens));
        completion.push(f64::from(r.completion_tokens));
        if ttft <= args.slo_ttft_ms && tpot.is_none_or(|t| t <= args.slo_tpot_ms) {
            good += 1;
        }
        if let Some(t) = &r.timings {
            queue.push(t.queue_ms);
            prefill.push(t.prefill_ms);
            transfer.push(t.transfer_ms);
            waited.push((t.first_token_ms - t.queue_ms - t.prefill_ms).max(0.0));
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    Level {
        mode: mode.to_string(),
        value,
        requests: outcomes.len(),
        completed,
        empty,
        failed,
        failed_example,
        duration_s,
        request_throughput: completed as f64 / duration_s,
        output_tok_s: completion.iter().sum::<f64>() / duration_s,
        prompt_tokens_mean: mean(&prompt),
        completion_tokens_mean: mean(&completion),
        ttft_ms: Dist::of(&samples.ttft_ms),
        tpot_ms: Dist::of(&samples.tpot_ms),
        itl_ms: Dist::of(&samples.itl_ms),
        e2e_ms: Dist::of(&e2e),
        goodput_req_s: good as f64 / duration_s,
        goodput_share: good as f64 / outcomes.len().max(1) as f64,
        tandem: (!queue.is_empty()).then(|| TandemTimings {
            queue_ms: median(queue),
            prefill_ms: median(prefill),
            transfer_ms: median(transfer),
            wait_and_transfer_ms: median(waited),
        }),
        failed_ms: (!failed_ms.is_empty()).then(|| Dist::of(&failed_ms)),
        samples,
        texts: outcomes
            .iter()
            .map(|o| o.as_ref().ok().map(|r| r.text.clone()))
            .collect(),
    }
}

fn print_table(r: &Results) {
    let prompts = if r.prompt_sigma > 0.0 {
        format!(
            "log-normal prompts around {} words (sigma {})",
            r.prompt_words, r.prompt_sigma
        )
    } else {
        format!("{}-word prompts", r.prompt_words)
    };
    println!(
        "{} ({}): {prompts} (seed {}), up to {} tokens, burstiness {}, SLO TTFT {} ms and TPOT {} ms",
        r.label, r.endpoint, r.seed, r.max_tokens, r.burstiness, r.slo_ttft_ms, r.slo_tpot_ms
    );
    println!(
        "{:>12} {:>9} {:>8} {:>8} {:>19} {:>19} {:>19} {:>9} {:>10}  failed",
        "load",
        "done",
        "req/s",
        "tok/s",
        "TTFT p50/p90/p99",
        "TPOT p50/p90/p99",
        "ITL p50/p90/p99",
        "goodput",
        "good share"
    );
    for l in &r.levels {
        let d = |d: &Dist| format!("{:.0}/{:.0}/{:.0}", d.p50, d.p90, d.p99);
        let dd = |d: &Dist| format!("{:.1}/{:.1}/{:.1}", d.p50, d.p90, d.p99);
        println!(
            "{:>12} {:>9} {:>8.2} {:>8.1} {:>19} {:>19} {:>19} {:>9.2} {:>9.0}%  {:?}",
            format!(
                "{} {}",
                if l.mode == "rate" { "rate" } else { "conc" },
                l.value
            ),
            format!("{}/{}", l.completed, l.requests),
            l.request_throughput,
            l.output_tok_s,
            d(&l.ttft_ms),
            dd(&l.tpot_ms),
            dd(&l.itl_ms),
            l.goodput_req_s,
            l.goodput_share * 100.0,
            l.failed
        );
        if let Some(t) = &l.tandem {
            println!(
                "{:>12} router timings (medians): queue {:.1} ms, prefill {:.1} ms, transfer {:.1} ms, prefill wait and exposed transfer {:.1} ms",
                "", t.queue_ms, t.prefill_ms, t.transfer_ms, t.wait_and_transfer_ms
            );
        }
    }
}
