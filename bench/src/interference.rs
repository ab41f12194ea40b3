//! `tandem-bench interference`: what a long prompt prefilled on a decode node does to the streams
//! already decoding there. It starts a decode node and a router with no prefill node in this
//! process (so every prompt is prefilled on the decode node, as conditional disaggregation does
//! for short suffixes), opens `--streams` greedy streams, and records when each frame arrives.
//! Once every stream has decoded for `--alone-ms`, it sends one `--prompt-tokens` prompt and
//! takes the streams' gaps from its send to its first token. The baseline is the same streams
//! run again without it, over the same tokens: a stream's steps grow dearer as its context does,
//! so only the same positions compare. Each of `--runs` runs uses fresh prompts; the report
//! gives each run and the medians.
//!
//! Speculation is off on the node, so every frame is one token and a gap is one step.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Args;
use serde::Serialize;
use tandem_engine::EngineConfig;
use tandem_proto::v1 as pb;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::stats::{median, percentile};
use tandem_client::ModelArgs;
use tandem_client::{ApiKey, Client, ServerTlsArgs, client};

#[derive(Args, Debug)]
pub(crate) struct InterferenceArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Streams decoding while the long prompt is prefilled.
    #[arg(long, default_value_t = 8)]
    streams: usize,
    /// The long prompt's length in tokens.
    #[arg(long, default_value_t = 2000)]
    prompt_tokens: usize,
    /// How long the streams decode before the long prompt is sent, in ms.
    #[arg(long, default_value_t = 2000)]
    alone_ms: u64,
    /// The decode node's KV pool in MiB.
    #[arg(long, default_value_t = 1536)]
    kv_budget_mb: usize,
    /// Tokens each stream asks for: enough to outlast both windows.
    #[arg(long, default_value_t = 1024)]
    stream_tokens: u32,
    /// Compute threads of the decode node (0 = one per core).
    #[arg(long, env = "TANDEM_THREADS", default_value_t = 0)]
    threads: usize,
    /// Runs; medians are reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

/// Inter-token gaps of the running streams, in ms.
#[derive(Serialize, Debug, Clone, Copy)]
struct Gaps {
    count: usize,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

impl Gaps {
    fn of(mut gaps: Vec<f64>) -> Self {
        Self {
            count: gaps.len(),
            p50_ms: percentile(&mut gaps, 0.5),
            p99_ms: percentile(&mut gaps, 0.99),
            max_ms: gaps.last().copied().unwrap_or(f64::NAN),
        }
    }
}

#[derive(Serialize, Debug)]
struct Run {
    /// The same streams without the long prompt, over the same frames.
    alone: Gaps,
    during_prefill: Gaps,
    /// During over alone, at p99.
    p99_ratio: f64,
    /// The long prompt's time to first token, in ms.
    long_ttft_ms: f64,
    /// Streams still decoding when the long prompt's first token came.
    streams_live: usize,
}

#[derive(Serialize, Debug)]
struct Report {
    streams: usize,
    prompt_tokens: usize,
    runs: Vec<Run>,
    median_alone_p99_ms: f64,
    median_during_p99_ms: f64,
    median_p99_ratio: f64,
    median_long_ttft_ms: f64,
}

/// Frame arrival times, one list per stream.
type Arrivals = Arc<Mutex<Vec<Vec<Instant>>>>;

fn lock(arrivals: &Arrivals) -> std::sync::MutexGuard<'_, Vec<Vec<Instant>>> {
    // Only pushes happen under the lock; a poisoned one is still consistent.
    arrivals.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn interference(args: &InterferenceArgs) -> anyhow::Result<()> {
    if args.streams == 0 || args.runs == 0 || args.prompt_tokens == 0 || args.stream_tokens < 16 {
        bail!(
            "--streams, --runs and --prompt-tokens must each be at least 1, --stream-tokens at least 16"
        );
    }
    let model = args.model.source().load().context("loading the model")?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let report = rt.block_on(async {
        let stop = CancellationToken::new();
        let decode = TcpListener::bind("127.0.0.1:0").await?;
        let decode_addr = decode.local_addr()?;
        let mut config = tandem_decode_server::Config::new(model.clone());
        config.node.engine = EngineConfig {
            threads: args.threads,
            kv_budget_bytes: args.kv_budget_mb << 20,
            speculate: tandem_engine::SpeculateConfig::off(),
            ..config.node.engine
        };
        config.max_slots = config.max_slots.max(args.streams + 1);
        let decode_task = tokio::spawn(tandem_decode_server::run(
            decode,
            config,
            stop.clone().cancelled_owned(),
        ));
        let router = TcpListener::bind("127.0.0.1:0").await?;
        let router_addr = router.local_addr()?.to_string();
        let router_config = tandem_router::Config {
            decode: vec![decode_addr.to_string()],
            ..tandem_router::Config::default()
        };
        let listeners = tandem_router::Listeners {
            grpc: router,
            http: None,
            peer: None,
        };
        let router_task = tokio::spawn(tandem_router::run(
            listeners,
            router_config,
            stop.clone().cancelled_owned(),
        ));
        tandem_net::wait_serving(
            tandem_net::channel(&router_addr, None)?,
            "tandem.v1.Generation",
            Duration::from_secs(60),
        )
        .await
        .context("the router did not start")?;
        let client = client(&router_addr, &ApiKey::default(), &ServerTlsArgs::default())?;
        let mut runs = Vec::new();
        for run in 0..args.runs {
            eprintln!("run {}/{}", run + 1, args.runs);
            runs.push(measure(&client, args, &model, run as u32).await?);
        }
        stop.cancel();
        let _ = router_task.await;
        let _ = decode_task.await;
        anyhow::Ok(runs)
    })?;
    let pick = |f: fn(&Run) -> f64| median(report.iter().map(f).collect());
    let out = Report {
        streams: args.streams,
        prompt_tokens: args.prompt_tokens,
        median_alone_p99_ms: pick(|r| r.alone.p99_ms),
        median_during_p99_ms: pick(|r| r.during_prefill.p99_ms),
        median_p99_ratio: pick(|r| r.p99_ratio),
        median_long_ttft_ms: pick(|r| r.long_ttft_ms),
        runs: report,
    };
    if args.json {
        println!("{}", serde_json::to_string(&out)?);
        return Ok(());
    }
    println!(
        "{} streams; a {}-token prompt prefilled on their decode node",
        out.streams, out.prompt_tokens
    );
    println!(
        "run | ITL alone p50 / p99 ms | during prefill p50 / p99 / max ms | p99 ratio | long prompt TTFT ms | streams live"
    );
    for (i, r) in out.runs.iter().enumerate() {
        println!(
            "{} | {:.1} / {:.1} | {:.1} / {:.1} / {:.1} | {:.2} | {:.0} | {}",
            i + 1,
            r.alone.p50_ms,
            r.alone.p99_ms,
            r.during_prefill.p50_ms,
            r.during_prefill.p99_ms,
            r.during_prefill.max_ms,
            r.p99_ratio,
            r.long_ttft_ms,
            r.streams_live
        );
    }
    println!(
        "median: ITL p99 alone {:.1} ms, during prefill {:.1} ms, ratio {:.2}; long prompt TTFT {:.0} ms",
        out.median_alone_p99_ms,
        out.median_during_p99_ms,
        out.median_p99_ratio,
        out.median_long_ttft_ms
    );
    Ok(())
}

/// The gaps before frames `from[s] + 1 ..= to[s]` of each stream `s`, in ms.
fn gaps_in(arrivals: &[Vec<Instant>], from: &[usize], to: &[usize]) -> Vec<f64> {
    arrivals
        .iter()
        .zip(from.iter().zip(to))
        .flat_map(|(a, (&from, &to))| {
            let to = to.min(a.len().saturating_sub(1));
            (from.max(1)..=to).map(move |j| (a[j] - a[j - 1]).as_secs_f64() * 1e3)
        })
        .collect()
}

/// Frames each stream had received by `at`.
fn frames_by(arrivals: &[Vec<Instant>], at: Instant) -> Vec<usize> {
    arrivals
        .iter()
        .map(|a| a.iter().take_while(|&&t| t <= at).count())
        .collect()
}

/// One run: the streams with the long prompt, then the same streams alone, compared over the
/// frames that came while the long prompt was prefilled.
async fn measure(
    client: &Client,
    args: &InterferenceArgs,
    model: &tandem_engine::Model,
    run: u32,
) -> anyhow::Result<Run> {
    let long = super::ordinary_tokens(model, args.prompt_tokens, run + 1);
    let (with, Some((sent, first))) = streams(client, args, model, run, Until::Long(long)).await?
    else {
        bail!("the long prompt was not sent");
    };
    let (from, to) = (frames_by(&with, sent), frames_by(&with, first));
    let (alone, _) = streams(client, args, model, run, Until::Frames(to.clone())).await?;
    let streams_live = with
        .iter()
        .filter(|a| {
            a.last()
                .is_some_and(|&t| t >= first - Duration::from_millis(500))
        })
        .count();
    let alone = Gaps::of(gaps_in(&alone, &from, &to));
    let during_prefill = Gaps::of(gaps_in(&with, &from, &to));
    Ok(Run {
        p99_ratio: during_prefill.p99_ms / alone.p99_ms,
        alone,
        during_prefill,
        long_ttft_ms: (first - sent).as_secs_f64() * 1e3,
        streams_live,
    })
}

/// When a session of streams ends.
enum Until {
    /// After `--alone-ms`, this prompt is sent; the session ends at its first token.
    Long(Vec<u32>),
    /// When each stream has this many frames (or ended).
    Frames(Vec<usize>),
}

/// Runs `--streams` streams of run `run` (the same prompts each time) until `until`; returns
/// their frames' arrival times and, for [`Until::Long`], when the long prompt was sent and
/// when its first token came.
async fn streams(
    client: &Client,
    args: &InterferenceArgs,
    model: &tandem_engine::Model,
    run: u32,
    until: Until,
) -> anyhow::Result<(Vec<Vec<Instant>>, Option<(Instant, Instant)>)> {
    let arrivals: Arrivals = Arc::new(Mutex::new(vec![Vec::new(); args.streams]));
    let done = CancellationToken::new();
    let mut tasks = Vec::new();
    for i in 0..args.streams {
        // Counting from a number of this run and stream: a long reply.
        let k = 1000 * (run as usize + 1) + 37 * i;
        let prompt = format!("{}, {}, {}, {}, {},", k, k + 1, k + 2, k + 3, k + 4);
        let request = pb::GenerateRequest {
            token_ids: model.tokenizer.encode(&prompt)?,
            sampling: Some(pb::SamplingParams {
                max_tokens: args.stream_tokens,
                ..Default::default()
            }),
            ..Default::default()
        };
        let (mut client, arrivals, done) = (client.clone(), arrivals.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let mut frames = client.generate(request).await?.into_inner();
            loop {
                tokio::select! {
                    frame = frames.message() => match frame? {
                        Some(f) if !f.token_ids.is_empty() => {
                            let now = Instant::now();
                            lock(&arrivals)[i].push(now);
                            if f.finish_reason != pb::FinishReason::Unspecified as i32 {
                                return anyhow::Ok(());
                            }
                        }
                        Some(_) => {}
                        None => return Ok(()),
                    },
                    () = done.cancelled() => return Ok(()),
                }
            }
        }));
    }
    // Every stream decoding (a few frames in).
    let warm = Instant::now();
    loop {
        let frames: Vec<usize> = lock(&arrivals).iter().map(Vec::len).collect();
        if frames.iter().all(|&n| n >= 8) {
            break;
        }
        if let Some(i) = tasks.iter().position(|t| t.is_finished()) {
            tasks.swap_remove(i).await??;
            bail!(
                "stream {i} ended after {} frames, before the measurement",
                frames[i]
            );
        }
        if warm.elapsed() > Duration::from_secs(120) {
            bail!("the streams did not all start within 120 s (frames so far: {frames:?})");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let long = match until {
        Until::Long(long) => {
            tokio::time::sleep(Duration::from_millis(args.alone_ms)).await;
            let sent = Instant::now();
            let request = pb::GenerateRequest {
                token_ids: long,
                sampling: Some(pb::SamplingParams {
                    max_tokens: 1,
                    ..Default::default()
                }),
                ..Default::default()
            };
            let mut long_client = client.clone();
            let mut frames = long_client.generate(request).await?.into_inner();
            let first = loop {
                match frames.message().await? {
                    Some(f) if !f.token_ids.is_empty() => break Instant::now(),
                    Some(_) => {}
                    None => bail!("the long prompt's stream ended without a token"),
                }
            };
            Some((sent, first))
        }
        Until::Frames(want) => {
            while tasks.iter().any(|t| !t.is_finished())
                && lock(&arrivals)
                    .iter()
                    .zip(&want)
                    .any(|(a, &n)| a.len() <= n)
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            None
        }
    };
    done.cancel();
    for t in tasks {
        t.await??;
    }
    let arrivals = lock(&arrivals).clone();
    Ok((arrivals, long))
}
