//! `tandem-bench`: the engine alone (`engine`), load against any running endpoint (`serve`,
//! `multiturn`, and coding-agent sessions over the Messages or Responses API: `agent`), the KV
//! transfer path (`transfer`), a peer fetch against a cold prompt
//! (`fetch`), the KV dtype's fidelity (`fidelity`), what a long local prefill does to a decode
//! node's streams (`interference`), and pictures of the results (`plot`).
//!
//! `serve` and `multiturn` drive a Tandem router over gRPC or any OpenAI-compatible server
//! ([`endpoint`]); they never start what they measure.

mod agent;
mod endpoint;
mod engine;
mod fetch;
mod fidelity;
mod interference;
mod multiturn;
mod plot;
mod profile;
mod router;
mod serve;
mod stats;
mod transfer;
mod workload;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "tandem-bench",
    version,
    about = "Benchmarks of Tandem: the engine, a running endpoint, the KV transfer path"
)]
struct Cli {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Prefill and batched decode throughput of the engine alone.
    Engine(engine::EngineBenchArgs),
    /// Load against a running endpoint (Tandem gRPC or OpenAI HTTP): TTFT, TPOT and ITL
    /// percentiles, throughput and goodput, at fixed concurrencies or Poisson request rates.
    Serve(serve::ServeArgs),
    /// Multi-turn chat against a running endpoint: what prefix caching and affinity buy.
    Multiturn(multiturn::MultiturnArgs),
    /// Coding-agent sessions (a long system prompt and tool list, a tool call and its result
    /// appended each turn) against an endpoint of Anthropic's Messages or OpenAI's Responses
    /// API: TTFT per turn, the share of prompt tokens from a cache, throughput.
    Agent(agent::AgentArgs),
    /// KV transfer throughput: a gRPC push of one prompt's KV against a plain TCP copy.
    Transfer(transfer::TransferArgs),
    /// A session forced off its replica: the next turn's TTFT through a peer fetch of its
    /// history against a cold prompt of the same length (two decode nodes in this process).
    Fetch(fetch::FetchArgs),
    /// What a KV dtype costs in fidelity: logits and greedy tokens against llama.cpp's fixtures
    /// and against f16.
    Fidelity(fidelity::FidelityArgs),
    /// Inter-token latency of streams on a decode node while it prefills a long prompt, against
    /// the same streams alone (a decode node and router started in this process).
    Interference(interference::InterferenceArgs),
    /// Fits a simulated model's timing profile (`tandem prefill --simulate FILE`) to the real
    /// engine on this machine: prefill, decode steps by batch and by depth.
    Profile(profile::ProfileArgs),
    /// The router's own work on a request (parse, checks, chat template, tokenization, block
    /// hashes) in this process: agent turns as their sessions grow, with its cache of token ids
    /// and without, and plain chat requests.
    Router(router::RouterArgs),
    /// Draw PNG and SVG plots from `serve`, `multiturn` and `agent` results.
    Plot(plot::PlotArgs),
}

fn main() -> anyhow::Result<()> {
    // Progress and results go to stdout; logs (of the nodes some benchmarks start in-process)
    // to stderr, filtered with RUST_LOG.
    tandem_engine::bound_freed_memory();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,h2=warn,tower=warn,hyper=warn".into()),
        )
        .init();
    match &Cli::parse().command {
        BenchCommand::Engine(args) => engine::engine(args),
        BenchCommand::Serve(args) => serve::serve(args),
        BenchCommand::Multiturn(args) => multiturn::multiturn(args),
        BenchCommand::Agent(args) => agent::agent(args),
        BenchCommand::Transfer(args) => transfer::transfer(args),
        BenchCommand::Fetch(args) => fetch::fetch(args),
        BenchCommand::Fidelity(args) => fidelity::fidelity(args),
        BenchCommand::Interference(args) => interference::interference(args),
        BenchCommand::Profile(args) => profile::profile(args),
        BenchCommand::Router(args) => router::router(args),
        BenchCommand::Plot(args) => plot::plot(args),
    }
}

/// One engine per dtype of `dtypes` (a `--kv-dtype` list), each configured as `config` otherwise.
pub(crate) fn engine_per_dtype(
    model: &std::sync::Arc<tandem_engine::Model>,
    dtypes: &[tandem_client::KvDtype],
    config: &tandem_engine::EngineConfig,
) -> anyhow::Result<Vec<tandem_engine::Engine>> {
    dtypes
        .iter()
        .map(|d| {
            let config = tandem_engine::EngineConfig {
                kv_dtype: d.dtype(),
                ..config.clone()
            };
            Ok(tandem_engine::Engine::new(model.clone(), config)?)
        })
        .collect()
}

/// `n` deterministic ordinary tokens of `model` (ids from 100 up, spread over the
/// vocabulary); `variant` picks another sequence of the same kind, so prompts need not share a
/// cached prefix.
pub(crate) fn ordinary_tokens(model: &tandem_engine::Model, n: usize, variant: u32) -> Vec<u32> {
    let vocab = model.config.vocab as u32;
    (0..n as u32)
        .map(|i| {
            100 + (i
                .wrapping_mul(7919)
                .wrapping_add(variant.wrapping_mul(104_729)))
                % (vocab - 100).max(1)
        })
        .map(|t| t.min(vocab - 1))
        .collect()
}

/// A progress bar on stderr (drawn only on a terminal) for `total` requests.
pub(crate) fn progress_bar(total: u64, what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total);
    let style = indicatif::ProgressStyle::with_template(
        "{prefix} [{bar:30}] {pos}/{len} requests, {elapsed} {msg}",
    )
    .map(|s| s.progress_chars("=> "))
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_prefix(what.to_string());
    bar
}
