//! `tandem tokenize` and `tandem generate`, run in-process on the engine.

use std::io::Write;

use anyhow::Context;
use clap::Args;
use serde::Serialize;
use tandem_engine::{
    ChatMessage, Engine, EngineConfig, GenerateParams, GenerateRequest, Model, SamplingParams,
};

use crate::ModelArgs;

#[derive(Args, Debug)]
pub(crate) struct TokenizeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The text to tokenize (special tokens such as `<|im_start|>` are parsed).
    #[arg(long)]
    text: String,
    /// Print `{"token_ids":[...]}` instead of one id per line.
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub(crate) struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Generate through a running cluster's router (host:port) instead of in-process.
    #[arg(long, env = "TANDEM_SERVER")]
    server: Option<String>,
    /// Raw prompt text (special tokens parsed, no chat template).
    #[arg(
        long,
        conflicts_with = "messages",
        required_unless_present = "messages"
    )]
    pub(crate) prompt: Option<String>,
    /// A JSON array of {"role","content"} messages, rendered with the model's chat template.
    #[arg(long)]
    pub(crate) messages: Option<String>,
    /// The most tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub(crate) max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub(crate) temperature: f32,
    /// Keep only the K most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    pub(crate) top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches P (1 = all).
    #[arg(long, default_value_t = 1.0)]
    pub(crate) top_p: f32,
    /// Random seed; the same seed gives the same output.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Stop when this text appears (repeatable); it is not included in the output.
    #[arg(long)]
    pub(crate) stop: Vec<String>,
    /// Compute threads (0 = one per core).
    #[arg(long, env = "TANDEM_THREADS", default_value_t = 0)]
    threads: usize,
    /// Print one JSON object with ids, text, finish reason and timings.
    #[arg(long)]
    pub(crate) json: bool,
}

pub(crate) fn tokenize(args: &TokenizeArgs) -> anyhow::Result<()> {
    let model = args.model.source().load()?;
    let ids = model.tokenizer.encode(&args.text)?;
    if args.json {
        #[derive(Serialize)]
        struct Out {
            token_ids: Vec<u32>,
        }
        println!("{}", serde_json::to_string(&Out { token_ids: ids })?);
    } else {
        for id in ids {
            println!("{id}");
        }
    }
    Ok(())
}

/// The prompt's token ids from `--prompt` or `--messages`.
pub(crate) fn prompt_tokens(
    model: &Model,
    prompt: Option<&str>,
    messages: Option<&str>,
) -> anyhow::Result<Vec<u32>> {
    let text = match (prompt, messages) {
        (Some(p), _) => p.to_string(),
        (None, Some(m)) => {
            let messages: Vec<ChatMessage> = serde_json::from_str(m)
                .context("--messages must be a JSON array of {\"role\",\"content\"} objects")?;
            model.tokenizer.apply_chat_template(&messages)?
        }
        (None, None) => anyhow::bail!("give --prompt or --messages"),
    };
    if text.is_empty() {
        anyhow::bail!("the prompt is empty");
    }
    Ok(model.tokenizer.encode(&text)?)
}

pub(crate) fn generate(args: &GenerateArgs) -> anyhow::Result<()> {
    if let Some(server) = &args.server {
        return crate::client::generate(args, server);
    }
    let model = args.model.source().load()?;
    let prompt = prompt_tokens(&model, args.prompt.as_deref(), args.messages.as_deref())?;
    let mut engine = Engine::new(
        model.clone(),
        EngineConfig {
            threads: args.threads,
            // Room for this one request.
            kv_budget_bytes: (prompt.len() + args.max_tokens + tandem_engine::BLOCK_TOKENS)
                * model.config.kv_layout().token_bytes(),
            ..EngineConfig::default()
        },
    )?;
    let request = GenerateRequest {
        prompt,
        params: GenerateParams {
            sampling: SamplingParams {
                temperature: args.temperature,
                top_k: args.top_k,
                top_p: args.top_p,
                seed: args.seed,
            },
            max_tokens: args.max_tokens,
            stop: args.stop.clone(),
        },
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
