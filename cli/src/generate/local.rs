//! `tandem generate` in-process, on the engine.

use std::io::Write;

use anyhow::Context;
use tandem_engine::{Engine, EngineConfig, GenerateRequest, Model};

use super::{GenerateArgs, parse_messages};

/// The prompt's token ids from `--prompt` or `--messages`.
pub(crate) fn prompt_tokens(
    model: &Model,
    prompt: Option<&str>,
    messages: Option<&str>,
) -> anyhow::Result<Vec<u32>> {
    let text = match (prompt, messages) {
        (Some(p), _) => p.to_string(),
        (None, Some(m)) => model
            .tokenizer
            .apply_chat_template(&parse_messages(m)?, &[])?,
        (None, None) => anyhow::bail!("give --prompt or --messages"),
    };
    if text.is_empty() {
        anyhow::bail!("the prompt is empty");
    }
    Ok(model.tokenizer.encode(&text)?)
}

/// `tandem generate` in-process: one prompt, streamed.
pub(crate) fn generate(args: &GenerateArgs) -> anyhow::Result<()> {
    let model = args.model.source().load()?;
    let prompt = prompt_tokens(&model, args.prompt.as_deref(), args.messages.as_deref())?;
    let mut engine = Engine::new(
        model.clone(),
        EngineConfig {
            threads: args.threads,
            // Room for this one request.
            kv_budget_bytes: (prompt.len() + args.max_tokens + tandem_engine::BLOCK_TOKENS)
                * model.config.kv_layout(args.kv_dtype.dtype()).token_bytes(),
            speculate: args.speculate.speculate(),
            kv_dtype: args.kv_dtype.dtype(),
            ..EngineConfig::default()
        },
    )?;
    let request = GenerateRequest {
        prompt,
        params: args.params(None)?,
    };
    let mut stdout = std::io::stdout().lock();
    let mut print = |text: &str| {
        if !args.json {
            let _ = stdout.write_all(text.as_bytes());
            let _ = stdout.flush();
        }
    };
    let out = engine.generate_streaming(&request, &mut print)?;
    if args.json {
        println!("{}", serde_json::to_string(&out)?);
    } else {
        println!();
    }
    Ok(())
}

/// One line of a `--batch` file.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchLine {
    prompt: Option<String>,
    token_ids: Option<Vec<u32>>,
    seed: Option<u64>,
}

/// `tandem generate --batch FILE`: every line in one continuous batch.
pub(crate) fn generate_batch(args: &GenerateArgs, file: &std::path::Path) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
    let model = args.model.source().load()?;
    let mut requests = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let at = || format!("{} line {}", file.display(), n + 1);
        let line: BatchLine = serde_json::from_str(line).with_context(at)?;
        let prompt = match (line.prompt, line.token_ids) {
            (Some(p), None) => prompt_tokens(&model, Some(&p), None).with_context(at)?,
            (None, Some(ids)) if !ids.is_empty() => ids,
            _ => anyhow::bail!(
                "{}: give either \"prompt\" or non-empty \"token_ids\"",
                at()
            ),
        };
        let vocab = model.config.vocab;
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            anyhow::bail!(
                "{}: token id {bad} is outside the vocabulary of {vocab}",
                at()
            );
        }
        requests.push(GenerateRequest {
            prompt,
            params: args.params(line.seed)?,
        });
    }
    anyhow::ensure!(!requests.is_empty(), "{} holds no request", file.display());
    let tokens: usize = requests
        .iter()
        .map(|r| r.prompt.len() + r.params.max_tokens + tandem_engine::BLOCK_TOKENS)
        .sum();
    let mut engine = Engine::new(
        model.clone(),
        EngineConfig {
            threads: args.threads,
            // Room for every request at once.
            kv_budget_bytes: tokens * model.config.kv_layout(args.kv_dtype.dtype()).token_bytes(),
            speculate: args.speculate.speculate(),
            kv_dtype: args.kv_dtype.dtype(),
            ..EngineConfig::default()
        },
    )?;
    eprintln!("generating {} requests in one batch", requests.len());
    let mut stdout = std::io::stdout().lock();
    for out in engine.generate_batch(&requests)? {
        writeln!(stdout, "{}", serde_json::to_string(&out)?)?;
    }
    Ok(())
}
