//! `tandem-bench fidelity`: what a KV dtype costs in output fidelity, on the llama.cpp reference
//! fixtures (`smollm2-greedy.jsonl`) and on longer prompts, side by side for each dtype.
//!
//! For each fixture record and dtype: the largest first-position logit difference over
//! llama.cpp's top 20, whether the first greedy token is llama.cpp's, and how many greedy tokens
//! agree with llama.cpp's before the first difference. Every dtype after the first is also
//! compared with the first (normally f16): the largest first-position logit difference over the
//! whole vocabulary and the tokens shared. The longer prompts (the speculation benchmark's, up to
//! a few hundred tokens each) have no reference, so they are compared with the first dtype only:
//! the greedy tokens shared, and, fed the first dtype's greedy tokens (teacher forcing), how
//! often the best token is the same and how far the logits move at each position.

use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Args;
use serde::{Deserialize, Serialize};
use tandem_engine::{
    ChatMessage, Engine, EngineConfig, GenerateParams, GenerateRequest, Model, argmax,
};

use tandem_client::ModelArgs;

#[derive(Args, Debug)]
pub(crate) struct FidelityArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The directory holding `smollm2-greedy.jsonl` (llama.cpp's outputs on SmolLM2).
    #[arg(long, env = "TANDEM_FIXTURES_DIR")]
    fixtures: PathBuf,
    /// Comma-separated KV dtypes; the first is the one the others are compared with.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "f16,q8")]
    kv_dtype: Vec<tandem_client::KvDtype>,
    /// Greedy tokens generated for each of the longer prompts.
    #[arg(long, default_value_t = 128)]
    long_tokens: usize,
    /// Compute threads (0 = one per core).
    #[arg(long, env = "TANDEM_THREADS", default_value_t = 0)]
    threads: usize,
    /// Print one JSON object: `{"fixtures":[...],"long":[...]}`.
    #[arg(long)]
    json: bool,
}

/// One record of `smollm2-greedy.jsonl`, the fields used here.
#[derive(Deserialize)]
struct Fixture {
    prompt_text: String,
    prompt_token_ids: Vec<u32>,
    generated_token_ids: Vec<u32>,
    first_position_logits: FirstLogits,
}

#[derive(Deserialize)]
struct FirstLogits {
    /// `[id, logit]` pairs, best first.
    top20: Vec<(u32, f32)>,
}

/// One dtype on one fixture record.
#[derive(Serialize)]
struct FixtureRun {
    kv_dtype: &'static str,
    /// The largest |logit − llama.cpp's| over llama.cpp's top 20, at the first position.
    max_logit_diff: f32,
    first_token_agrees: bool,
    /// Greedy tokens equal to llama.cpp's before the first difference.
    shared_prefix: usize,
    /// Against the first dtype: the largest first-position logit difference over the whole
    /// vocabulary, and the greedy tokens equal before the first difference.
    vs_first: Option<VsFirst>,
}

#[derive(Serialize, Clone, Copy)]
struct VsFirst {
    max_logit_diff: f32,
    shared_prefix: usize,
    /// Tokens the first dtype generated.
    of: usize,
}

#[derive(Serialize)]
struct FixtureResult {
    prompt: String,
    prompt_tokens: usize,
    /// llama.cpp's margin between its two best first tokens: a small one is a near-tie.
    margin: f32,
    /// llama.cpp's tokens, end-of-generation ids left out (Tandem stops before them).
    reference_tokens: usize,
    runs: Vec<FixtureRun>,
}

#[derive(Serialize)]
struct LongResult {
    prompt: String,
    prompt_tokens: usize,
    /// One entry per dtype after the first.
    vs_first: Vec<LongVsFirst>,
}

#[derive(Serialize)]
struct LongVsFirst {
    kv_dtype: &'static str,
    /// Free-running greedy generation against the first dtype's.
    greedy: VsFirst,
    /// Positions, fed the first dtype's greedy tokens, where the best token is the same.
    top1_agreement: f64,
    /// The largest |Δlogit| over the vocabulary at each position: its mean and its maximum.
    mean_max_logit_diff: f32,
    max_logit_diff: f32,
}

#[derive(Serialize)]
struct Report {
    fixtures: Vec<FixtureResult>,
    long: Vec<LongResult>,
}

/// First-position logits and the greedy continuation of `prompt`.
fn run(
    engine: &mut Engine,
    prompt: &[u32],
    max_tokens: usize,
) -> anyhow::Result<(Vec<f32>, Vec<u32>)> {
    let seq = engine.new_sequence();
    let logits = engine.prefill(seq, prompt)?;
    engine.free(seq)?;
    let out = engine
        .generate_batch(&[GenerateRequest {
            prompt: prompt.to_vec(),
            params: GenerateParams {
                max_tokens,
                ..GenerateParams::default()
            },
        }])?
        .remove(0);
    Ok((logits, out.token_ids))
}

fn shared_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn vs_first(first: &(Vec<f32>, Vec<u32>), this: &(Vec<f32>, Vec<u32>)) -> VsFirst {
    VsFirst {
        max_logit_diff: max_diff(&first.0, &this.0),
        shared_prefix: shared_prefix(&first.1, &this.1),
        of: first.1.len(),
    }
}

/// The logits at every position of `tokens` after `prompt`'s last: fed, not sampled.
fn forced_logits(
    engine: &mut Engine,
    prompt: &[u32],
    tokens: &[u32],
) -> anyhow::Result<Vec<Vec<f32>>> {
    let seq = engine.new_sequence();
    let mut all = vec![engine.prefill(seq, prompt)?];
    for &t in tokens.iter().take(tokens.len().saturating_sub(1)) {
        all.push(engine.step(&[(seq, t)])?.row(0).to_vec());
    }
    engine.free(seq)?;
    Ok(all)
}

fn fixtures(path: &std::path::Path, model: &Model) -> anyhow::Result<Vec<Fixture>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the fixtures {}", path.display()))?;
    let records: Vec<Fixture> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| format!("{} line {}", path.display(), i + 1))
        })
        .collect::<anyhow::Result<_>>()?;
    let vocab = model.config.vocab as u32;
    for r in &records {
        let ids = r.prompt_token_ids.iter().chain(&r.generated_token_ids);
        let ids = ids.chain(r.first_position_logits.top20.iter().map(|p| &p.0));
        if let Some(id) = ids.copied().find(|&id| id >= vocab) {
            bail!(
                "the fixtures hold token id {id}, outside this model's vocabulary: they belong to another model"
            );
        }
    }
    Ok(records)
}

pub(crate) fn fidelity(args: &FidelityArgs) -> anyhow::Result<()> {
    let model = args.model.source().load()?;
    let records = fixtures(&args.fixtures.join("smollm2-greedy.jsonl"), &model)?;
    let config = EngineConfig {
        threads: args.threads,
        ..EngineConfig::default()
    };
    let mut engines = super::engine_per_dtype(&model, &args.kv_dtype, &config)?;
    let eog = model.tokenizer.eog_ids();
    let mut report = Report {
        fixtures: Vec::new(),
        long: Vec::new(),
    };
    for (i, r) in records.iter().enumerate() {
        eprintln!("fixture {}/{}", i + 1, records.len());
        let reference: Vec<u32> = (r.generated_token_ids.iter().copied())
            .filter(|t| !eog.contains(t))
            .collect();
        let outs = engines
            .iter_mut()
            .map(|e| run(e, &r.prompt_token_ids, r.generated_token_ids.len()))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let top20 = &r.first_position_logits.top20;
        let runs = engines
            .iter()
            .zip(&outs)
            .enumerate()
            .map(|(j, (e, out))| FixtureRun {
                kv_dtype: e.kv_layout().dtype.name(),
                max_logit_diff: top20
                    .iter()
                    .map(|&(id, want)| (out.0[id as usize] - want).abs())
                    .fold(0.0, f32::max),
                first_token_agrees: top20.first().map(|p| p.0) == Some(argmax(&out.0)),
                shared_prefix: shared_prefix(&out.1, &reference),
                vs_first: (j > 0).then(|| vs_first(&outs[0], out)),
            })
            .collect();
        report.fixtures.push(FixtureResult {
            prompt: r.prompt_text.clone(),
            prompt_tokens: r.prompt_token_ids.len(),
            margin: match top20.as_slice() {
                [a, b, ..] => a.1 - b.1,
                _ => f32::NAN,
            },
            reference_tokens: reference.len(),
            runs,
        });
    }
    let long = super::engine::speculation_prompts()?;
    for (i, p) in long.iter().enumerate() {
        eprintln!("long prompt {}/{}", i + 1, long.len());
        let rendered = model
            .tokenizer
            .apply_chat_template(&[ChatMessage::new("user", p.text.clone())], &[])?;
        let prompt = model.tokenizer.encode(&rendered)?;
        let outs = engines
            .iter_mut()
            .map(|e| run(e, &prompt, args.long_tokens))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let forced = engines
            .iter_mut()
            .map(|e| forced_logits(e, &prompt, &outs[0].1))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let mut vs = Vec::new();
        for ((e, out), logits) in engines.iter().zip(&outs).zip(&forced).skip(1) {
            let diffs: Vec<f32> = logits
                .iter()
                .zip(&forced[0])
                .map(|(a, b)| max_diff(a, b))
                .collect();
            let same = logits
                .iter()
                .zip(&forced[0])
                .filter(|(a, b)| argmax(a) == argmax(b))
                .count();
            vs.push(LongVsFirst {
                kv_dtype: e.kv_layout().dtype.name(),
                greedy: vs_first(&outs[0], out),
                top1_agreement: same as f64 / logits.len().max(1) as f64,
                mean_max_logit_diff: diffs.iter().sum::<f32>() / diffs.len().max(1) as f32,
                max_logit_diff: diffs.iter().copied().fold(0.0, f32::max),
            });
        }
        report.long.push(LongResult {
            prompt: p.name.clone(),
            prompt_tokens: prompt.len(),
            vs_first: vs,
        });
    }
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_report(&report);
    }
    Ok(())
}

fn print_report(report: &Report) {
    println!(
        "against llama.cpp (smollm2-greedy.jsonl): max |Δlogit| over its top 20 at the first position; first token equal; greedy tokens equal before the first difference"
    );
    for f in &report.fixtures {
        let prompt: String = f
            .prompt
            .chars()
            .rev()
            .take(40)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        println!(
            "  {:?} ({} prompt tokens, llama.cpp margin {:.2})",
            prompt.replace('\n', " "),
            f.prompt_tokens,
            f.margin
        );
        for r in &f.runs {
            print!(
                "    {:>4}: Δ {:.3}  first {}  shared {:>2}/{}",
                r.kv_dtype,
                r.max_logit_diff,
                if r.first_token_agrees { "yes" } else { "no " },
                r.shared_prefix,
                f.reference_tokens
            );
            if let Some(v) = r.vs_first {
                print!(
                    "   vs {}: Δ {:.3} over the vocabulary, shared {}/{}",
                    f.runs[0].kv_dtype, v.max_logit_diff, v.shared_prefix, v.of
                );
            }
            println!();
        }
    }
    if report.long.iter().any(|l| !l.vs_first.is_empty()) {
        println!(
            "longer prompts, against the first dtype: greedy tokens equal before the first difference; fed the first dtype's tokens, positions with the same best token, and the largest |Δlogit| per position (mean, max)"
        );
        for l in &report.long {
            for v in &l.vs_first {
                println!(
                    "  {:<18} {:>4} prompt tokens  {}: shared {:>3}/{:<3}  same best {:>5.1}%  Δ mean {:.3} max {:.3}",
                    l.prompt,
                    l.prompt_tokens,
                    v.kv_dtype,
                    v.greedy.shared_prefix,
                    v.greedy.of,
                    v.top1_agreement * 100.0,
                    v.mean_max_logit_diff,
                    v.max_logit_diff
                );
            }
        }
    }
}
