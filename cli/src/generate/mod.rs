//! `tandem generate`: its flags, and what the in-process ([`local`]) and the cluster
//! ([`remote`]) paths share: `--messages` parsing and the `--json` output (the engine's
//! [`tandem_engine::GenerateOutput`], whichever path produced it).

use anyhow::Context;
use clap::Args;
use tandem_engine::{ChatMessage, GenerateParams, Grammar};

use tandem_client::{KvDtype, ModelArgs, ServerTlsArgs};

use crate::sampling::{GENERATE_DEFAULTS, SamplingArgs};

mod local;
mod remote;

#[derive(Args, Debug)]
pub(crate) struct GenerateArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Generate through a running cluster's router (host:port) instead of in-process.
    #[arg(long, env = "TANDEM_SERVER")]
    pub(crate) server: Option<String>,
    /// The API key, when the router requires one (with --server).
    #[arg(
        long,
        env = "TANDEM_API_KEY",
        hide_env_values = true,
        requires = "server"
    )]
    pub(crate) api_key: Option<String>,
    #[command(flatten)]
    pub(crate) tls: ServerTlsArgs,
    /// Raw prompt text (special tokens parsed, no chat template).
    #[arg(
        long,
        conflicts_with_all = ["messages", "batch"],
        required_unless_present_any = ["messages", "batch"]
    )]
    pub(crate) prompt: Option<String>,
    /// A JSON array of {"role","content"} messages, rendered with the model's chat template.
    #[arg(long, conflicts_with = "batch")]
    pub(crate) messages: Option<String>,
    /// Offline batch generation, in-process only: a JSON-lines file, one request per line,
    /// `{"prompt": TEXT}` or `{"token_ids": [...]}`, with an optional `"seed"` (otherwise
    /// `--seed`); the other flags apply to every line. All are decoded in one continuous batch,
    /// and each result is printed as one `--json` line, in the file's order.
    #[arg(long, conflicts_with = "server")]
    pub(crate) batch: Option<std::path::PathBuf>,
    /// The most tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub(crate) max_tokens: usize,
    #[command(flatten)]
    pub(crate) sampling: SamplingArgs,
    /// Stop when this text appears (repeatable); it is not included in the output.
    #[arg(long)]
    pub(crate) stop: Vec<String>,
    /// Stop at this token id, as at an end-of-generation id (repeatable; not output).
    #[arg(long = "stop-token-id")]
    pub(crate) stop_token_ids: Vec<u32>,
    /// Never sample an end-of-generation id: generate `--max-tokens` tokens (or up to a stop).
    #[arg(long)]
    pub(crate) ignore_eos: bool,
    /// Sample no end-of-generation id (nor a `--stop-token-id`) before this many tokens.
    #[arg(long, default_value_t = 0)]
    pub(crate) min_tokens: usize,
    /// Report each output token's log-probability and this many most likely alternatives' (0
    /// to 20) in the `--json` output's `logprobs`, from the model's own distribution.
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u32).range(0..=tandem_proto::MAX_TOP_LOGPROBS as i64))]
    pub(crate) logprobs: Option<u32>,
    #[command(flatten)]
    pub(crate) grammar: GrammarArgs,
    /// Compute threads (0 = one per core).
    #[arg(long, env = "TANDEM_THREADS", default_value_t = 0)]
    pub(crate) threads: usize,
    /// Prompt-lookup speculative decoding, in-process (a cluster's decode nodes have their
    /// own setting); the tokens are the same either way.
    #[arg(long, env = "TANDEM_SPECULATE", value_enum, default_value_t = crate::serve::Switch::On)]
    pub(crate) speculate: crate::serve::Switch,
    /// How the KV cache stores keys and values, in-process (a cluster's nodes have their own
    /// setting).
    #[arg(long, env = "TANDEM_KV_DTYPE", value_enum, default_value_t = KvDtype::F16)]
    pub(crate) kv_dtype: KvDtype,
    /// Print one JSON object with ids, text, finish reason and timings.
    #[arg(long)]
    pub(crate) json: bool,
}

/// Constrained decoding: what the output must match, at most one of these. A grammar the
/// engine cannot compile is an error before any work.
#[derive(Args, Debug)]
#[group(multiple = false)]
pub(crate) struct GrammarArgs {
    /// The output is JSON that matches this JSON schema: its text, or @FILE.
    #[arg(long, value_name = "SCHEMA")]
    json_schema: Option<String>,
    /// The output is a JSON object.
    #[arg(long)]
    json_object: bool,
    /// The whole output matches this regular expression.
    #[arg(long, value_name = "REGEX")]
    regex: Option<String>,
    /// The output matches this Lark grammar (llguidance's dialect): its text, or @FILE.
    #[arg(long, value_name = "GRAMMAR")]
    lark: Option<String>,
}

impl GrammarArgs {
    /// The grammar asked for, if any.
    fn grammar(&self) -> anyhow::Result<Option<Grammar>> {
        let text = |arg: &str| -> anyhow::Result<String> {
            match arg.strip_prefix('@') {
                Some(path) => std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read the grammar file {path}")),
                None => Ok(arg.to_string()),
            }
        };
        Ok(if let Some(schema) = &self.json_schema {
            Some(Grammar::JsonSchema(text(schema)?))
        } else if self.json_object {
            Some(Grammar::JsonObject)
        } else if let Some(regex) = &self.regex {
            Some(Grammar::Regex(regex.clone()))
        } else if let Some(lark) = &self.lark {
            Some(Grammar::Lark(text(lark)?))
        } else {
            None
        })
    }
}

impl GenerateArgs {
    /// The generation the flags ask for, with `seed` (a `--batch` line's) over `--seed`.
    pub(crate) fn params(&self, seed: Option<u64>) -> anyhow::Result<GenerateParams> {
        let mut sampling = self.sampling.resolve(&GENERATE_DEFAULTS);
        sampling.seed = seed.unwrap_or(sampling.seed);
        Ok(GenerateParams {
            sampling,
            max_tokens: self.max_tokens,
            stop: self.stop.clone(),
            stop_token_ids: self.stop_token_ids.clone(),
            ignore_eos: self.ignore_eos,
            min_tokens: self.min_tokens,
            logprobs: self.logprobs.map(|k| k as usize),
            grammar: self.grammar.grammar()?,
        })
    }
}

/// `tandem generate`: through a cluster with `--server`, else in-process.
pub(crate) fn run(args: &GenerateArgs) -> anyhow::Result<()> {
    match (&args.server, &args.batch) {
        (Some(server), _) => remote::generate(args, server),
        (None, Some(file)) => local::generate_batch(args, file),
        (None, None) => local::generate(args),
    }
}

/// `--messages`: a JSON array of `{"role", "content"}` objects.
pub(crate) fn parse_messages(json: &str) -> anyhow::Result<Vec<ChatMessage>> {
    serde_json::from_str(json)
        .context("--messages must be a JSON array of {\"role\",\"content\"} objects")
}
