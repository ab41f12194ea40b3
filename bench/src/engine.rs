//! `tandem-bench engine`: prefill throughput for one prompt, and aggregate decode throughput
//! for several batch sizes, each the median of `--runs` runs, for each KV dtype asked for (runs
//! alternate between them, in one pool size). Each engine first runs one untimed prefill of the
//! prompt, as `llama-bench` warms up before it measures, so the first timed run does not pay
//! for starting the thread pool and first touching the KV pool's pages. Progress goes to stderr.

use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use serde::Serialize;
use tandem_engine::{
    ChatMessage, Engine, EngineConfig, GenerateOutput, GenerateParams, GenerateRequest, KvExport,
    SeqId, SpeculateConfig, argmax,
};

use crate::stats::median;
use tandem_client::ModelArgs;

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
    /// Tokens of context each decoding sequence starts with (one prompt's KV, computed once, or
    /// taken from the last prefill run when as long as the prompt, and copied into every
    /// sequence, so each reads its own memory): decode at depth.
    #[arg(long, default_value_t = 1)]
    context_tokens: usize,
    /// Comma-separated KV dtypes (`f16`, `q8`): each is measured, in alternating runs, with the
    /// same pool size.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "f16")]
    kv_dtype: Vec<tandem_client::KvDtype>,
    /// Compute threads (0 = one per core).
    #[arg(long, env = "TANDEM_THREADS", default_value_t = 0)]
    threads: usize,
    /// Runs per measurement; the median is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// KV pool size in MiB (what a server would allocate), the same for every dtype.
    #[arg(long, default_value_t = 1536)]
    kv_budget_mb: usize,
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
    /// Also measure constrained decoding: `--grammar-batch` chat prompts asking for a long JSON
    /// list, generated greedily for `--grammar-tokens` tokens each with every sequence held to
    /// a JSON schema (an object with an array of strings), and without (the end-of-generation
    /// ids ignored), in alternating runs; reports each one's median inter-token latency.
    #[arg(long)]
    grammar: bool,
    /// The batch of the constrained-decoding measurement.
    #[arg(long, default_value_t = 16)]
    grammar_batch: usize,
    /// Tokens generated per sequence in the constrained-decoding measurement (a constrained one
    /// ends sooner if its JSON closes).
    #[arg(long, default_value_t = 64)]
    grammar_tokens: usize,
    /// Print `{"threads":N,"context_tokens":C,"kv":[{"kv_dtype":"f16","kv_bytes_per_token":B,
    /// "pool_sequences":S,"prefill_tok_s":F,"decode":[{"batch":B,"tok_s":F},...]},...],
    /// "peak_rss_mb":M}` (with `--speculate`, also `"speculation":{"prompts":[...],
    /// "batch":{...}}`; with `--grammar`, `"grammar":{"batch":B,"free_itl_ms":F,
    /// "constrained_itl_ms":C,"ratio":R,"full_length":N}`).
    #[arg(long)]
    json: bool,
}

/// The longest warm-up prompt: enough to read every weight once.
const WARM_UP_TOKENS: usize = 512;

#[derive(Serialize, Clone)]
struct DecodeResult {
    batch: usize,
    tok_s: f64,
}

/// One KV dtype's measurements.
#[derive(Serialize)]
struct KvResult {
    kv_dtype: &'static str,
    kv_bytes_per_token: usize,
    /// Sequences of `context_tokens + gen_tokens` that the pool holds at once.
    pool_sequences: usize,
    prefill_tok_s: f64,
    decode: Vec<DecodeResult>,
}

#[derive(Serialize)]
struct BenchResult {
    threads: usize,
    context_tokens: usize,
    kv: Vec<KvResult>,
    #[serde(skip_serializing_if = "Option::is_none")]
    speculation: Option<SpeculationResult>,
    #[serde(skip_serializing_if = "Option::is_none")]
    grammar: Option<GrammarResult>,
    /// The process's peak resident memory, MB (weights, KV pool pages touched, buffers).
    peak_rss_mb: f64,
}

/// Constrained decoding against free decoding at one batch: median inter-token latencies.
#[derive(Serialize)]
struct GrammarResult {
    batch: usize,
    free_itl_ms: f64,
    constrained_itl_ms: f64,
    ratio: f64,
    /// Constrained sequences that ran every token of the last run (the rest closed their JSON
    /// early, and the batch shrank as they left).
    full_length: usize,
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
pub(crate) struct SpecPrompt {
    pub(crate) name: String,
    pub(crate) kind: String,
    pub(crate) text: String,
}

/// The speculation workloads (also the fidelity benchmark's longer prompts).
pub(crate) fn speculation_prompts() -> anyhow::Result<Vec<SpecPrompt>> {
    SPEC_PROMPTS
        .lines()
        .map(|line| Ok(serde_json::from_str(line)?))
        .collect()
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
    if args.prompt_tokens > ctx || args.context_tokens.max(1) + args.gen_tokens > ctx {
        bail!(
            "--prompt-tokens, and --context-tokens plus --gen-tokens, must fit the context of {ctx}"
        );
    }
    let config = EngineConfig {
        threads: args.threads,
        kv_budget_bytes: args.kv_budget_mb << 20,
        ..EngineConfig::default()
    };
    let mut engines = super::engine_per_dtype(&model, &args.kv_dtype, &config)?;
    let prompt_of = |n: usize| super::ordinary_tokens(&model, n, 0);
    let prompt = prompt_of(args.prompt_tokens);
    let name = |e: &Engine| e.kv_layout().dtype.name();

    // The warm-up reads every weight once; a long prompt's attention needs no warming.
    for engine in &mut engines {
        let seq = engine.new_sequence();
        let warm = &prompt[..prompt.len().min(WARM_UP_TOKENS)];
        engine.prefill(seq, warm).context("warm-up prefill")?;
        engine.free(seq)?;
    }
    let mut prefill = vec![Vec::new(); engines.len()];
    // With a context as long as the prompt, the last run's KV is the decode's context.
    let reuse = args.context_tokens == args.prompt_tokens;
    let mut last_runs = Vec::new();
    for run in 0..args.runs {
        for (engine, rates) in engines.iter_mut().zip(&mut prefill) {
            let seq = engine.new_sequence();
            let t0 = Instant::now();
            let logits = engine.prefill(seq, &prompt)?;
            let secs = t0.elapsed().as_secs_f64();
            if reuse && run + 1 == args.runs {
                last_runs.push((engine.export_kv(seq, 0..prompt.len())?, argmax(&logits)));
            }
            engine.free(seq)?;
            rates.push(args.prompt_tokens as f64 / secs);
            eprintln!(
                "prefill {} run {}/{}: {:.1} tok/s",
                name(engine),
                run + 1,
                args.runs,
                rates[run]
            );
        }
    }

    // Each engine's context KV, computed once.
    let context = prompt_of(args.context_tokens.max(1));
    let contexts = if reuse {
        last_runs
    } else {
        engines
            .iter_mut()
            .map(|e| {
                let seq = e.new_sequence();
                let logits = e.prefill(seq, &context)?;
                let kv = e.export_kv(seq, 0..context.len())?;
                e.free(seq)?;
                Ok((kv, argmax(&logits)))
            })
            .collect::<anyhow::Result<Vec<_>>>()?
    };
    let mut decode = vec![Vec::new(); engines.len()];
    for &batch in &args.batch {
        let mut rates = vec![Vec::new(); engines.len()];
        for run in 0..args.runs {
            for ((engine, (kv, first)), rates) in engines.iter_mut().zip(&contexts).zip(&mut rates)
            {
                let rate = decode_run(engine, kv, *first, batch, args.gen_tokens)
                    .with_context(|| format!("decode at batch {batch}, {}", name(engine)))?;
                eprintln!(
                    "decode {} batch {batch} run {}/{}: {rate:.1} tok/s",
                    name(engine),
                    run + 1,
                    args.runs
                );
                rates.push(rate);
            }
        }
        for (results, rates) in decode.iter_mut().zip(rates) {
            results.push(DecodeResult {
                batch,
                tok_s: median(rates),
            });
        }
    }
    let speculation = if args.speculate {
        Some(speculation(&mut engines[0], args)?)
    } else {
        None
    };
    let grammar = if args.grammar {
        Some(constrained(&mut engines[0], args)?)
    } else {
        None
    };
    let per_sequence = (context.len() + args.gen_tokens).div_ceil(tandem_engine::BLOCK_TOKENS);
    let result = BenchResult {
        threads: engines[0].threads(),
        context_tokens: context.len(),
        kv: engines
            .iter()
            .zip(prefill)
            .zip(decode)
            .map(|((e, prefill), decode)| KvResult {
                kv_dtype: name(e),
                kv_bytes_per_token: e.kv_layout().token_bytes(),
                pool_sequences: e.kv_blocks_total() / per_sequence,
                prefill_tok_s: median(prefill),
                decode,
            })
            .collect(),
        speculation,
        grammar,
        peak_rss_mb: peak_rss_mb(),
    };
    let rss = result.peak_rss_mb;
    if args.json {
        println!("{}", serde_json::to_string(&result)?);
        eprintln!("peak resident memory: {rss:.0} MB");
    } else {
        print_table(&result, &model.name, args);
    }
    Ok(())
}

/// The results as text, one line a measurement.
fn print_table(result: &BenchResult, model: &str, args: &EngineBenchArgs) {
    let rss = result.peak_rss_mb;
    println!(
        "model {}  threads {}  KV pool {} MiB",
        model, result.threads, args.kv_budget_mb
    );
    for kv in &result.kv {
        println!(
            "kv {}: {} bytes/token, the pool holds {} sequences of {} tokens",
            kv.kv_dtype,
            kv.kv_bytes_per_token,
            kv.pool_sequences,
            result.context_tokens + args.gen_tokens
        );
        println!(
            "  prefill {:>5} tokens  {:>9.1} tok/s",
            args.prompt_tokens, kv.prefill_tok_s
        );
        for d in &kv.decode {
            println!(
                "  decode  batch {:>5}  {:>9.1} tok/s  (context {})",
                d.batch, d.tok_s, result.context_tokens
            );
        }
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
    if let Some(g) = &result.grammar {
        println!(
            "constrained decoding, batch {}: inter-token {:.2} ms free, {:.2} ms constrained \
             ({:.3}x); {} of {} constrained sequences ran every token",
            g.batch, g.free_itl_ms, g.constrained_itl_ms, g.ratio, g.full_length, g.batch
        );
    }
    println!("peak resident memory {rss:.0} MB");
}

/// Decodes `steps` tokens for `batch` sequences, each starting from its own copy of the context
/// KV `start` and the token `first`, and returns aggregate tokens per second. Greedy, and
/// end-of-generation ids do not stop it: every step is measured.
fn decode_run(
    engine: &mut Engine,
    start: &KvExport,
    first: u32,
    batch: usize,
    steps: usize,
) -> anyhow::Result<f64> {
    let mut seqs: Vec<(SeqId, u32)> = Vec::with_capacity(batch);
    for _ in 0..batch {
        let seq = engine.new_sequence();
        engine.import_kv(seq, start)?;
        seqs.push((seq, first));
    }
    let t0 = Instant::now();
    for _ in 0..steps {
        let logits = engine.step(&seqs)?;
        for (s, l) in seqs.iter_mut().zip(&logits) {
            s.1 = argmax(l);
        }
        engine.recycle(logits);
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

/// The schema every sequence of the constrained-decoding measurement is held to.
const LIST_SCHEMA: &str = r#"{"type": "object", "properties": {"items": {"type": "array",
    "items": {"type": "string"}}}, "required": ["items"]}"#;

fn constrained(engine: &mut Engine, args: &EngineBenchArgs) -> anyhow::Result<GrammarResult> {
    let model = engine.model().clone();
    let topics = ["cities", "rivers", "fruits", "programming languages"];
    let requests = |grammar: bool| -> anyhow::Result<Vec<GenerateRequest>> {
        (0..args.grammar_batch)
            .map(|i| {
                let text = format!(
                    "Answer in JSON: an object whose \"items\" lists 100 {}.",
                    topics[i % topics.len()]
                );
                let rendered = model
                    .tokenizer
                    .apply_chat_template(&[ChatMessage::new("user", text)], &[])?;
                Ok(GenerateRequest {
                    prompt: model.tokenizer.encode(&rendered)?,
                    params: GenerateParams {
                        max_tokens: args.grammar_tokens,
                        ignore_eos: !grammar,
                        grammar: grammar
                            .then(|| tandem_engine::Grammar::JsonSchema(LIST_SCHEMA.into())),
                        ..GenerateParams::default()
                    },
                })
            })
            .collect()
    };
    let (free_requests, constrained_requests) = (requests(false)?, requests(true)?);
    // Each sequence's decode time over the tokens after its first.
    let itl = |outs: &[GenerateOutput]| {
        median(
            outs.iter()
                .filter(|o| o.token_ids.len() > 1)
                .map(|o| o.decode_ms / (o.token_ids.len() - 1) as f64)
                .collect(),
        )
    };
    let (mut free, mut held, mut full_length) = (Vec::new(), Vec::new(), 0);
    for run in 0..args.runs {
        for grammar in [run % 2 == 1, run % 2 == 0] {
            let reqs = if grammar {
                &constrained_requests
            } else {
                &free_requests
            };
            let outs = engine.generate_batch(reqs)?;
            let ms = itl(&outs);
            eprintln!(
                "constrained decoding run {}/{}, {}: {ms:.2} ms per token",
                run + 1,
                args.runs,
                if grammar { "constrained" } else { "free" }
            );
            if grammar {
                full_length = outs
                    .iter()
                    .filter(|o| o.token_ids.len() == args.grammar_tokens)
                    .count();
                held.push(ms);
            } else {
                free.push(ms);
            }
        }
    }
    let (free, held) = (median(free), median(held));
    Ok(GrammarResult {
        batch: args.grammar_batch,
        free_itl_ms: free,
        constrained_itl_ms: held,
        ratio: held / free,
        full_length,
    })
}

fn speculation(engine: &mut Engine, args: &EngineBenchArgs) -> anyhow::Result<SpeculationResult> {
    let model = engine.model().clone();
    let requests: Vec<(String, &'static str, GenerateRequest)> = speculation_prompts()?
        .into_iter()
        .map(|p| {
            let rendered = model
                .tokenizer
                .apply_chat_template(&[ChatMessage::new("user", p.text)], &[])?;
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
