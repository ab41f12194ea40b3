//! `tandem bench engine`: prefill throughput for one prompt, and aggregate decode throughput
//! for several batch sizes, each the median of `--runs` runs. Progress goes to stderr.

use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use serde::Serialize;
use tandem_engine::{
    ChatMessage, Engine, EngineConfig, GenerateParams, GenerateRequest, SeqId, SpeculateConfig,
    argmax,
};

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
    /// Also measure speculative decoding: built-in chat prompts whose replies copy from them
    /// (rewrite code, summarise a passage, continue a list) and prompts with nothing to copy,
    /// each generated greedily with speculation off and on, back to back; then all of them
    /// together at batch `--speculate-batch`.
    #[arg(long)]
    speculate: bool,
    /// Tokens generated per prompt in the speculation measurement (fewer if the reply ends).
    #[arg(long, default_value_t = 256)]
    speculate_tokens: usize,
    /// The batch of the speculation measurement's aggregate run (the prompts repeated).
    #[arg(long, default_value_t = 16)]
    speculate_batch: usize,
    /// Print `{"prefill_tok_s":F,"decode":[{"batch":B,"tok_s":F},...],"threads":N}` (with
    /// `--speculate`, also `"speculation":{"prompts":[...],"batch":{...}}`).
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
    #[serde(skip_serializing_if = "Option::is_none")]
    speculation: Option<SpeculationResult>,
}

/// One workload generated with speculation off and on: medians over the runs.
#[derive(Serialize)]
struct SpecRun {
    name: String,
    /// `copy` (the reply copies from the prompt) or `novel`.
    kind: &'static str,
    batch: usize,
    tokens: usize,
    off_tok_s: f64,
    on_tok_s: f64,
    speedup: f64,
    /// Drafted tokens accepted, over all drafted.
    acceptance: f64,
    /// Generated tokens per verifying forward pass of a sequence.
    tokens_per_step: f64,
}

#[derive(Serialize)]
struct SpeculationResult {
    prompts: Vec<SpecRun>,
    batch: SpecRun,
}

/// The speculation workloads, one JSON object per line: `name`, `kind` (`copy` or `novel`) and
/// the user message `text`. `scripts/bench-speculate.sh` sends the same prompts to a cluster.
const SPEC_PROMPTS: &str = include_str!("speculate-prompts.jsonl");

#[derive(serde::Deserialize)]
struct SpecPrompt {
    name: String,
    kind: String,
    text: String,
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
    let speculation = if args.speculate {
        Some(speculation(&mut engine, args)?)
    } else {
        None
    };
    let result = BenchResult {
        prefill_tok_s: median(prefill),
        decode,
        threads: engine.threads(),
        speculation,
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
        if let Some(s) = &result.speculation {
            println!(
                "speculation {:<18} {:>5} {:>6} {:>8} {:>8} {:>7} {:>6} {:>6}",
                "(greedy)", "batch", "tokens", "off", "on", "speedup", "accept", "tok/pass"
            );
            for r in s.prompts.iter().chain([&s.batch]) {
                println!(
                    "  {:<16} {:>6} {:>5} {:>6} {:>8.1} {:>8.1} {:>6.2}x {:>6.2} {:>6.2}",
                    r.name,
                    r.kind,
                    r.batch,
                    r.tokens,
                    r.off_tok_s,
                    r.on_tok_s,
                    r.speedup,
                    r.acceptance,
                    r.tokens_per_step
                );
            }
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

/// Generates `requests` with speculation off and on, alternating which goes first, `runs`
/// times; checks that both give the same tokens and reports the medians.
fn compare(
    engine: &mut Engine,
    name: &str,
    kind: &'static str,
    requests: &[GenerateRequest],
    runs: usize,
) -> anyhow::Result<SpecRun> {
    let (mut off, mut on) = (Vec::new(), Vec::new());
    let mut last = None;
    for run in 0..runs {
        for speculate in [run % 2 == 1, run % 2 == 0] {
            engine.set_speculate(SpeculateConfig {
                enabled: speculate,
                ..SpeculateConfig::on()
            });
            let outs = engine.generate_batch(requests)?;
            let tokens: usize = outs.iter().map(|o| o.token_ids.len()).sum();
            let secs = outs.iter().map(|o| o.decode_ms).fold(0.0, f64::max) / 1e3;
            let rate = tokens as f64 / secs.max(1e-9);
            let ids: Vec<Vec<u32>> = outs.iter().map(|o| o.token_ids.clone()).collect();
            if let Some(prev) = &last {
                anyhow::ensure!(prev == &ids, "{name}: speculation changed the tokens");
            }
            last = Some(ids);
            if speculate {
                let drafted: u64 = outs.iter().map(|o| o.draft_tokens).sum();
                let accepted: u64 = outs.iter().map(|o| o.accepted_draft_tokens).sum();
                on.push((rate, tokens, drafted, accepted));
            } else {
                off.push(rate);
            }
            eprintln!(
                "speculation {name} run {}/{runs}, {}: {rate:.1} tok/s",
                run + 1,
                if speculate { "on" } else { "off" }
            );
        }
    }
    let (_, tokens, drafted, accepted) = on[0];
    // Sequences' verifying passes: every generated token after the first came from one, and
    // each accepted draft token saved one.
    let passes = (tokens as u64).saturating_sub(requests.len() as u64 + accepted);
    let off = median(off);
    let on = median(on.iter().map(|r| r.0).collect());
    Ok(SpecRun {
        name: name.into(),
        kind,
        batch: requests.len(),
        tokens,
        off_tok_s: off,
        on_tok_s: on,
        speedup: on / off,
        acceptance: accepted as f64 / (drafted.max(1)) as f64,
        tokens_per_step: (tokens as f64 - requests.len() as f64) / passes.max(1) as f64,
    })
}

fn speculation(engine: &mut Engine, args: &EngineBenchArgs) -> anyhow::Result<SpeculationResult> {
    let model = engine.model().clone();
    let requests: Vec<(String, &'static str, GenerateRequest)> = SPEC_PROMPTS
        .lines()
        .map(|line| {
            let p: SpecPrompt = serde_json::from_str(line)?;
            let rendered = model.tokenizer.apply_chat_template(&[ChatMessage {
                role: "user".into(),
                content: p.text,
            }])?;
            let request = GenerateRequest {
                prompt: model.tokenizer.encode(&rendered)?,
                params: GenerateParams {
                    max_tokens: args.speculate_tokens,
                    ..GenerateParams::default()
                },
            };
            let kind = if p.kind == "copy" { "copy" } else { "novel" };
            Ok((p.name, kind, request))
        })
        .collect::<anyhow::Result<_>>()?;
    let mut prompts = Vec::new();
    for (name, kind, request) in &requests {
        prompts.push(compare(
            engine,
            name,
            kind,
            std::slice::from_ref(request),
            args.runs,
        )?);
    }
    let mixed: Vec<GenerateRequest> = (0..args.speculate_batch)
        .map(|i| requests[i % requests.len()].2.clone())
        .collect();
    let batch = compare(engine, "all, batched", "mixed", &mixed, args.runs)?;
    engine.set_speculate(SpeculateConfig::off());
    Ok(SpeculationResult { prompts, batch })
}
