//! `tandem-bench fetch`: what a peer fetch buys a session forced off its replica. Two decode
//! nodes run in this process: the holder serves a conversation's history (its session cache
//! keeps it), then the other node answers the next turn, once computing the whole prompt
//! (cold) and once fetching the history's KV from the holder and computing only the new turn.
//! Time to first token of each, medians of `--runs` (each run with fresh tokens, so nothing is
//! cached by accident). Progress goes to stderr; the report (or `--json`) to stdout.
//!
//! The cold prompt is prefilled on the decode node itself: the same compute as on a prefill
//! node, without the push, so the ratio is, if anything, in the cold prompt's favour.

use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use serde::Serialize;
use tandem_engine::EngineConfig;
use tandem_proto::v1 as pb;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::ordinary_tokens;
use crate::stats::median;
use tandem_client::ModelArgs;

#[derive(Args, Debug)]
pub(crate) struct FetchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The conversation's history, in tokens: what the holder keeps and the fetch brings.
    #[arg(long, default_value_t = 1024)]
    history_tokens: usize,
    /// The next turn's new tokens, computed in both cases.
    #[arg(long, default_value_t = 32)]
    turn_tokens: usize,
    /// Compute threads of each decode node (0 = one per core).
    #[arg(long, env = "TANDEM_THREADS", default_value_t = 0)]
    threads: usize,
    /// Runs; medians are reported.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize, Debug)]
struct Run {
    cold_ttft_ms: f64,
    fetch_ttft_ms: f64,
    fetch_ms: f64,
    fetched_tokens: u32,
    fetched_bytes: u64,
}

#[derive(Serialize, Debug)]
struct Report {
    model: String,
    prompt_tokens: usize,
    history_tokens: usize,
    runs: Vec<Run>,
    median_cold_ttft_ms: f64,
    median_fetch_ttft_ms: f64,
    median_fetch_ms: f64,
    /// Median fetch TTFT over median cold TTFT.
    ratio: f64,
}

/// Sends `request` to the decode node at `client` and waits for its first token: the time it
/// took, and what the node said when it admitted the request.
async fn first_token(
    client: &mut pb::decode_client::DecodeClient<tonic::transport::Channel>,
    request: pb::DecodeRequest,
) -> anyhow::Result<(f64, pb::DecodeAdmitted)> {
    let started = Instant::now();
    let mut frames = client.generate(request).await?.into_inner();
    let mut admitted = None;
    while let Some(f) = frames.message().await? {
        match f.event {
            Some(pb::decode_response::Event::Admitted(a)) => admitted = Some(a),
            Some(pb::decode_response::Event::Tokens(_)) => {
                let ms = started.elapsed().as_secs_f64() * 1e3;
                return Ok((ms, admitted.context("a token before the admission")?));
            }
            None => {}
        }
    }
    bail!("the stream ended without a token")
}

fn request(prompt: Vec<u32>, fetch: Option<(String, usize)>) -> pb::DecodeRequest {
    let (fetch_addr, fetch_tokens) = fetch.unwrap_or_default();
    pb::DecodeRequest {
        request_id: format!("bench-fetch-{:016x}", rand::random::<u64>()),
        prompt_token_ids: prompt,
        sampling: Some(pb::SamplingParams {
            max_tokens: 1,
            ..Default::default()
        }),
        local_prefill: true,
        fetch_addr,
        fetch_tokens: fetch_tokens as u32,
        ..Default::default()
    }
}

pub(crate) fn fetch(args: &FetchArgs) -> anyhow::Result<()> {
    if args.runs == 0 || args.history_tokens < tandem_engine::BLOCK_TOKENS || args.turn_tokens == 0
    {
        bail!(
            "--runs and --turn-tokens must be at least 1, --history-tokens at least a block ({})",
            tandem_engine::BLOCK_TOKENS
        );
    }
    let model = args.model.source().load().context("loading the model")?;
    let n = args.history_tokens + args.turn_tokens;
    model.config.check_fits(n, 1)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let report = rt.block_on(async {
        let stop = CancellationToken::new();
        let mut nodes = Vec::new();
        for _ in 0..2 {
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            let addr = listener.local_addr()?.to_string();
            let mut config = tandem_decode_server::Config::new(model.clone());
            config.node.engine = EngineConfig {
                threads: args.threads,
                ..config.node.engine
            };
            let task = tokio::spawn(tandem_decode_server::run(
                listener,
                config,
                stop.clone().cancelled_owned(),
            ));
            let channel = tandem_net::channel(&addr, None)?;
            tandem_net::wait_serving(
                channel.clone(),
                "tandem.v1.Decode",
                std::time::Duration::from_secs(60),
            )
            .await?;
            nodes.push((addr, pb::decode_client::DecodeClient::new(channel), task));
        }
        let holder = nodes[0].0.clone();
        let mut fetcher = nodes[1].1.clone();
        let mut holder_client = nodes[0].1.clone();
        let bar = crate::progress_bar(args.runs as u64, "fetch");
        let mut runs = Vec::new();
        for r in 0..args.runs as u32 {
            let history = ordinary_tokens(&model, args.history_tokens, 3 * r);
            let turn = ordinary_tokens(&model, args.turn_tokens, 3 * r + 1);
            // The holder computes the history and keeps it.
            first_token(&mut holder_client, request(history.clone(), None)).await?;
            // A cold prompt of the same length on the other node.
            let cold = ordinary_tokens(&model, n, 3 * r + 2);
            let (cold_ttft_ms, _) = first_token(&mut fetcher, request(cold, None)).await?;
            // The next turn there, fetching the history from the holder.
            let kept =
                args.history_tokens / tandem_engine::BLOCK_TOKENS * tandem_engine::BLOCK_TOKENS;
            let prompt = [history, turn].concat();
            let (fetch_ttft_ms, admitted) =
                first_token(&mut fetcher, request(prompt, Some((holder.clone(), kept)))).await?;
            runs.push(Run {
                cold_ttft_ms,
                fetch_ttft_ms,
                fetch_ms: admitted.fetch_ms,
                fetched_tokens: admitted.fetched_tokens,
                fetched_bytes: admitted.fetched_bytes,
            });
            bar.inc(1);
        }
        bar.finish_and_clear();
        stop.cancel();
        for (_, _, task) in nodes {
            task.await??;
        }
        let med = |f: fn(&Run) -> f64| median(runs.iter().map(f).collect());
        let (cold, fetched, fetch_ms) = (
            med(|r| r.cold_ttft_ms),
            med(|r| r.fetch_ttft_ms),
            med(|r| r.fetch_ms),
        );
        anyhow::Ok(Report {
            model: model.name.clone(),
            prompt_tokens: n,
            history_tokens: args.history_tokens,
            runs,
            median_cold_ttft_ms: cold,
            median_fetch_ttft_ms: fetched,
            median_fetch_ms: fetch_ms,
            ratio: fetched / cold,
        })
    })?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    println!(
        "{}: a {}-token turn after a {}-token history held by another decode node",
        report.model, report.prompt_tokens, report.history_tokens
    );
    println!("run | cold TTFT ms | fetch TTFT ms | of which fetch ms | fetched tokens | MB");
    for (i, r) in report.runs.iter().enumerate() {
        println!(
            "{} | {:.1} | {:.1} | {:.1} | {} | {:.1}",
            i + 1,
            r.cold_ttft_ms,
            r.fetch_ttft_ms,
            r.fetch_ms,
            r.fetched_tokens,
            r.fetched_bytes as f64 / 1e6
        );
    }
    println!(
        "median: cold {:.1} ms, through a fetch {:.1} ms (fetch {:.1} ms): {:.2}x",
        report.median_cold_ttft_ms,
        report.median_fetch_ttft_ms,
        report.median_fetch_ms,
        report.ratio
    );
    Ok(())
}
