//! `tandem bench engine`: prefill throughput for one prompt, and aggregate decode throughput
//! for several batch sizes, each the median of `--runs` runs. Progress goes to stderr.

use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use serde::Serialize;
use tandem_engine::{Engine, EngineConfig, SeqId, argmax};

use crate::ModelArgs;
use crate::bench::stats::median;

#[derive(Args, Debug)]
pub(crate) struct EngineBenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    prompt_tokens: usize,
    /// Tokens generated per sequence in each decode measurement.
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Comma-separated decode batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    batch: Vec<usize>,
    /// Compute threads (0 = one per core).
    #[arg(long, env = "TANDEM_THREADS", default_value_t = 0)]
    threads: usize,
    /// Runs per measurement; the median is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// KV pool capacity in tokens (the pool is what a server would allocate).
    #[arg(long, default_value_t = 65_536)]
    kv_tokens: usize,
    /// Print `{"prefill_tok_s":F,"decode":[{"batch":B,"tok_s":F},...],"threads":N}`.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct DecodeResult {
    batch: usize,
    tok_s: f64,
}

#[derive(Serialize)]
struct BenchResult {
    prefill_tok_s: f64,
    decode: Vec<DecodeResult>,
    threads: usize,
}

pub(crate) fn engine(args: &EngineBenchArgs) -> anyhow::Result<()> {
    if args.runs == 0 || args.prompt_tokens == 0 || args.gen_tokens == 0 {
        bail!("--runs, --prompt-tokens and --gen-tokens must be at least 1");
    }
    if let Some(b) = args.batch.iter().find(|&&b| b == 0) {
        bail!("--batch sizes must be at least 1, got {b}");
    }
    let model = args.model.source().load()?;
    let ctx = model.config.context_len;
    if args.prompt_tokens > ctx || args.gen_tokens + 1 > ctx {
        bail!("--prompt-tokens and --gen-tokens must fit the context of {ctx}");
    }
    let mut engine = Engine::new(
        model.clone(),
        EngineConfig {
            threads: args.threads,
            kv_budget_bytes: args.kv_tokens * model.config.kv_layout().token_bytes(),
            ..EngineConfig::default()
        },
    )?;
    // A deterministic prompt of ordinary text tokens.
    let vocab = model.config.vocab as u32;
    let prompt: Vec<u32> = (0..args.prompt_tokens as u32)
        .map(|i| 100 + (i * 7919) % (vocab - 100).max(1))
        .map(|t| t.min(vocab - 1))
        .collect();

    let mut prefill = Vec::new();
    for run in 0..args.runs {
        let seq = engine.new_sequence();
        let t0 = Instant::now();
        engine.prefill(seq, &prompt)?;
        let secs = t0.elapsed().as_secs_f64();
        engine.free(seq)?;
        prefill.push(args.prompt_tokens as f64 / secs);
        eprintln!(
            "prefill run {}/{}: {:.1} tok/s",
            run + 1,
            args.runs,
            prefill[run]
        );
    }

    let mut decode = Vec::new();
    for &batch in &args.batch {
        let mut rates = Vec::new();
        for run in 0..args.runs {
            let rate = decode_run(&mut engine, &prompt[..1], batch, args.gen_tokens)
                .with_context(|| format!("decode at batch {batch}"))?;
            eprintln!(
                "decode batch {batch} run {}/{}: {rate:.1} tok/s",
                run + 1,
                args.runs
            );
            rates.push(rate);
        }
        decode.push(DecodeResult {
            batch,
            tok_s: median(rates),
        });
    }
    let result = BenchResult {
        prefill_tok_s: median(prefill),
        decode,
        threads: engine.threads(),
    };
    let rss = peak_rss_mb();
    if args.json {
        println!("{}", serde_json::to_string(&result)?);
        eprintln!("peak resident memory: {rss:.0} MB");
    } else {
        println!("model {}  threads {}", model.name, result.threads);
        println!(
            "prefill {:>5} tokens  {:>9.1} tok/s",
            args.prompt_tokens, result.prefill_tok_s
        );
        for d in &result.decode {
            println!("decode  batch {:>5}  {:>9.1} tok/s", d.batch, d.tok_s);
        }
        println!("peak resident memory {rss:.0} MB");
    }
    Ok(())
}

/// Decodes `steps` tokens for `batch` sequences started from `start` and returns aggregate
/// tokens per second. Greedy, and end-of-generation ids do not stop it: every step is measured.
fn decode_run(
    engine: &mut Engine,
    start: &[u32],
    batch: usize,
    steps: usize,
) -> anyhow::Result<f64> {
    let mut seqs: Vec<(SeqId, u32)> = Vec::with_capacity(batch);
    for _ in 0..batch {
        let seq = engine.new_sequence();
        let logits = engine.prefill(seq, start)?;
        seqs.push((seq, argmax(&logits)));
    }
    let t0 = Instant::now();
    for _ in 0..steps {
        let logits = engine.step(&seqs)?;
        for (s, l) in seqs.iter_mut().zip(&logits) {
            s.1 = argmax(l);
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    for (seq, _) in seqs {
        engine.free(seq)?;
    }
    Ok((batch * steps) as f64 / secs)
}

/// Peak resident set size of this process (VmHWM), in MB; 0 where /proc is unavailable.
fn peak_rss_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}
