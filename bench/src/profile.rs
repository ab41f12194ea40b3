//! `tandem-bench profile`: fits a simulated model's timing ([`TimingProfile`]) to the real
//! engine on this machine. It times, each the median of `--runs` runs: decode steps at batches
//! 1, 2, 4, 8 and 16 over short contexts; prefills of 32, 96 and 256 tokens from nothing (one
//! pass each: the engine's prefill chunk is 256 tokens); and decode steps of one sequence
//! `--depth` tokens deep. Attention per token of context is the deep step's time over the
//! shallow one's, per token; each pass's time, less its attention, is a point of the profile.
//! With `--check` it runs the same measurements on the model simulated with the fitted profile
//! and prints both.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::bail;
use clap::Args;
use tandem_client::ModelArgs;
use tandem_engine::{Engine, EngineConfig, Model, SpeculateConfig, TimingProfile};

use crate::stats::median;

#[derive(Args, Debug)]
pub(crate) struct ProfileArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Compute threads (0 = one per core): a simulated node takes the time the real one takes
    /// with this many.
    #[arg(long, env = "TANDEM_THREADS", default_value_t = 0)]
    threads: usize,
    /// Context tokens of the deep decode measurement.
    #[arg(long, default_value_t = 2048)]
    depth: usize,
    /// Decode steps timed per measurement.
    #[arg(long, default_value_t = 24)]
    steps: usize,
    /// Runs per measurement; the median is taken.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Write the profile here (JSON) instead of to stdout.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Measure the model simulated with the fitted profile too, and print both.
    #[arg(long)]
    check: bool,
}

/// Decode batches measured.
const BATCHES: [usize; 5] = [1, 2, 4, 8, 16];
/// Prompts measured, each one pass.
const PROMPTS: [usize; 3] = [32, 96, 256];
/// Context of each sequence in the batched decode measurements.
const SHORT_CONTEXT: usize = 16;

/// What one model's measurements gave, in seconds, and the threads its engine computed on.
#[derive(Debug)]
struct Measured {
    threads: usize,
    /// One decode step per batch of [`BATCHES`].
    step_s: Vec<f64>,
    /// One prefill per prompt of [`PROMPTS`].
    prefill_s: Vec<f64>,
    deep_step_s: f64,
}

pub(crate) fn profile(args: &ProfileArgs) -> anyhow::Result<()> {
    if args.depth <= SHORT_CONTEXT || args.steps == 0 || args.runs == 0 {
        bail!("--depth must be more than {SHORT_CONTEXT}, and --steps and --runs at least 1");
    }
    let source = args.model.source();
    let model = source.load()?;
    let real = measure(&model, args)?;
    let profile = fit(&real, args, model_name(&source), cpu_name());
    let json = serde_json::to_string_pretty(&profile)?;
    match &args.out {
        Some(path) => std::fs::write(path, format!("{json}\n"))?,
        None => println!("{json}"),
    }
    if args.check {
        let simulated = source.load_simulated(profile)?;
        let sim = measure(&simulated, args)?;
        eprintln!(
            "{:<22} {:>12} {:>12} {:>8}",
            "", "real s", "simulated s", "ratio"
        );
        let mut rows = Vec::new();
        for (i, b) in BATCHES.iter().enumerate() {
            rows.push((
                format!("decode step, batch {b}"),
                real.step_s[i],
                sim.step_s[i],
            ));
        }
        for (i, n) in PROMPTS.iter().enumerate() {
            rows.push((
                format!("prefill of {n}"),
                real.prefill_s[i],
                sim.prefill_s[i],
            ));
        }
        rows.push((
            format!("decode step at {}", args.depth),
            real.deep_step_s,
            sim.deep_step_s,
        ));
        for (what, r, s) in rows {
            eprintln!("{what:<22} {r:>12.5} {s:>12.5} {:>8.3}", s / r);
        }
    }
    Ok(())
}

/// The catalog name of the model, or its id.
fn model_name(source: &tandem_engine::ModelSource) -> String {
    match source {
        tandem_engine::ModelSource::File {
            known: Some(known), ..
        } => known.name.to_string(),
        other => other.name(),
    }
}

/// The CPU's model name, from `/proc/cpuinfo` where there is one.
fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, name)| name.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

fn engine_config(threads: usize) -> EngineConfig {
    EngineConfig {
        threads,
        kv_budget_bytes: 256 << 20,
        prefix_cache_bytes: 0,
        speculate: SpeculateConfig::off(),
        ..EngineConfig::default()
    }
}

/// The profile of the measurements (see [`TimingProfile`]): attention from the deep step, and
/// each pass less its attention.
fn fit(m: &Measured, args: &ProfileArgs, model: String, cpu: String) -> TimingProfile {
    // A row attending to `depth` tokens against one attending to a short context.
    let attend_s = ((m.deep_step_s - m.step_s[0]) / (args.depth - SHORT_CONTEXT) as f64).max(0.0);
    let decode = BATCHES
        .iter()
        .zip(&m.step_s)
        .map(|(&b, &s)| (b, s - attend_s * (b * (SHORT_CONTEXT + 1)) as f64));
    let prefill = PROMPTS
        .iter()
        .zip(&m.prefill_s)
        .map(|(&n, &s)| (n, s - attend_s * (n * (n + 1) / 2) as f64));
    // Rising in rows and in time: a pass of more rows never takes less.
    let mut passes: Vec<(usize, f64)> = Vec::new();
    for (n, s) in decode.chain(prefill) {
        let floor = passes.last().map_or(f64::MIN_POSITIVE, |&(_, t)| t);
        passes.push((n, s.max(floor)));
    }
    TimingProfile {
        model,
        cpu,
        threads: m.threads,
        passes,
        attend_s,
    }
}

fn measure(model: &Arc<Model>, args: &ProfileArgs) -> anyhow::Result<Measured> {
    let mut engine = Engine::new(model.clone(), engine_config(args.threads))?;
    let warm = engine.new_sequence();
    engine.prefill(warm, &crate::ordinary_tokens(model, 256, 0))?;
    engine.free(warm)?;
    let runs = |engine: &mut Engine, f: &dyn Fn(&mut Engine) -> anyhow::Result<f64>| {
        (0..args.runs)
            .map(|_| f(engine))
            .collect::<anyhow::Result<Vec<f64>>>()
            .map(median)
    };
    let mut prefill_s = Vec::new();
    for n in PROMPTS {
        let prompt = crate::ordinary_tokens(model, n, n as u32);
        prefill_s.push(runs(&mut engine, &|e| {
            let seq = e.new_sequence();
            let started = Instant::now();
            e.prefill(seq, &prompt)?;
            let s = started.elapsed().as_secs_f64();
            e.free(seq)?;
            Ok(s)
        })?);
    }
    let mut step_s = Vec::new();
    for (i, &b) in BATCHES.iter().enumerate() {
        let seqs = (0..b)
            .map(|j| {
                let seq = engine.new_sequence();
                let context = crate::ordinary_tokens(model, SHORT_CONTEXT, (i * 100 + j) as u32);
                engine.prefill(seq, &context).map(|_| seq)
            })
            .collect::<tandem_engine::Result<Vec<_>>>()?;
        step_s.push(runs(&mut engine, &|e| {
            steps(e, &seqs, args.steps, SHORT_CONTEXT)
        })?);
        for seq in seqs {
            engine.free(seq)?;
        }
    }
    let deep = engine.new_sequence();
    engine.prefill(deep, &crate::ordinary_tokens(model, args.depth, 7))?;
    let deep_step_s = runs(&mut engine, &|e| steps(e, &[deep], args.steps, args.depth))?;
    engine.free(deep)?;
    Ok(Measured {
        threads: engine.threads(),
        prefill_s,
        step_s,
        deep_step_s,
    })
}

/// The mean time of `n` decode steps of `seqs`, each `len` tokens long before and after.
fn steps(
    engine: &mut Engine,
    seqs: &[tandem_engine::SeqId],
    n: usize,
    len: usize,
) -> anyhow::Result<f64> {
    let batch: Vec<(tandem_engine::SeqId, u32)> = seqs.iter().map(|&s| (s, 100)).collect();
    let started = Instant::now();
    for _ in 0..n {
        let logits = engine.step(&batch)?;
        engine.recycle(logits);
    }
    let s = started.elapsed().as_secs_f64() / n as f64;
    for &seq in seqs {
        engine.truncate(seq, len)?;
    }
    Ok(s)
}
