//! `tandem sim`: many simulated workers in one process, each the real prefill or decode node
//! (its gRPC services, health, admission, scheduler, KV pool and caches, transfers, drains) on
//! a port of its own, with the model's compute replaced by a timing profile
//! (`tandem_engine::simulate`). They share one loaded model (its tokenizer and configuration;
//! no weight is read), so hundreds fit on a small machine. A router in front of them is started
//! apart (`tandem router --prefill ... --decode ...`, the addresses this prints).

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::bail;
use clap::Args;
use tandem_engine::EngineConfig;
use tandem_net::tls::Role;
use tokio_util::sync::CancellationToken;

use crate::serve::{WorkerArgs, shutdown_signal};
use crate::simulate::SHIPPED_PROFILE;

#[derive(Args, Debug)]
pub(crate) struct SimArgs {
    /// Every node's flags, as `tandem prefill` and `tandem decode` take them (`--simulate`
    /// defaults to `shipped` here, `--threads` is 1, `--kv-commit-ahead-mb` is 0: thousands of
    /// nodes in one process commit their pools' pages as they use them, and `--kv-spill-dir`
    /// is not taken).
    #[command(flatten)]
    worker: WorkerArgs,
    /// Simulated prefill nodes.
    #[arg(long, default_value_t = 0)]
    prefill: usize,
    /// Simulated decode nodes.
    #[arg(long, default_value_t = 1)]
    decode: usize,
    /// The address the nodes listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// The first node's port; the others take the ports after it, prefill nodes first. 0
    /// gives each a free port.
    #[arg(long, default_value_t = 0)]
    base_port: u16,
    /// Each decode node's batch slots (`tandem decode --max-slots`).
    #[arg(long, default_value_t = tandem_decode_server::DEFAULT_MAX_SLOTS)]
    max_slots: usize,
    /// Each prefill node's prefix cache in MiB (`tandem prefill --prefix-cache-mb`).
    #[arg(long, default_value_t = tandem_prefill_server::DEFAULT_PREFIX_CACHE_BYTES >> 20)]
    prefix_cache_mb: usize,
    /// Send KV between the nodes as headers and empty chunks (dtype `none`), not the bytes the
    /// model's KV would take: the transfers' protocol, timing and bookkeeping run, and the
    /// network carries no KV. Every node of the fleet must agree: a router pairs nodes of one
    /// dtype only, and a node rejects a push of another.
    #[arg(long)]
    kv_header_only: bool,
}

/// The most nodes one process hosts.
const MAX_NODES: usize = 4096;

pub(crate) fn sim(args: &SimArgs) -> anyhow::Result<()> {
    let nodes = args.prefill + args.decode;
    if nodes == 0 || nodes > MAX_NODES {
        bail!("--prefill plus --decode must be between 1 and {MAX_NODES}");
    }
    if args.worker.kv_spill_dir.is_some() {
        bail!("simulated nodes keep no disk tier: --kv-spill-dir is not taken");
    }
    if args.base_port != 0 && usize::from(args.base_port) + nodes > usize::from(u16::MAX) + 1 {
        bail!(
            "--base-port {} leaves no room for {nodes} nodes",
            args.base_port
        );
    }
    let worker = WorkerArgs {
        simulate: (args.worker.simulate.clone()).or_else(|| Some(SHIPPED_PROFILE.into())),
        kv_commit_ahead_mb: 0,
        ..args.worker.clone()
    };
    let model = worker.load_model()?;
    // A simulated pass sleeps through its compute: one thread per engine is all it needs.
    let prefill = tandem_prefill_server::Config {
        node: worker.node(
            model.clone(),
            EngineConfig {
                threads: 1,
                kv_header_only: args.kv_header_only,
                ..worker.engine(&model, args.prefix_cache_mb << 20)
            },
            Role::Prefill,
        )?,
        ..tandem_prefill_server::Config::new(model.clone())
    };
    // Speculation drafts from a sequence's own text, which a simulated reply does not repeat.
    let engine = EngineConfig {
        threads: 1,
        kv_header_only: args.kv_header_only,
        speculate: tandem_engine::SpeculateConfig::off(),
        ..worker.engine(&model, usize::MAX)
    };
    let decode = tandem_decode_server::Config {
        node: worker.node(model.clone(), engine, Role::Decode)?,
        max_slots: args.max_slots,
        ..tandem_decode_server::Config::new(model)
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let stop = CancellationToken::new();
        let mut tasks = tokio::task::JoinSet::new();
        let mut addrs = (Vec::new(), Vec::new());
        for i in 0..nodes {
            let port = match args.base_port {
                0 => 0,
                base => base + i as u16,
            };
            let listener = tokio::net::TcpListener::bind(SocketAddr::new(args.host, port))
                .await
                .map_err(|e| anyhow::anyhow!("cannot listen on {}:{port}: {e}", args.host))?;
            let addr = listener.local_addr()?.to_string();
            let shutdown = stop.clone().cancelled_owned();
            if i < args.prefill {
                addrs.0.push(addr);
                let config = prefill.clone();
                tasks.spawn(
                    async move { tandem_prefill_server::run(listener, config, shutdown).await },
                );
            } else {
                addrs.1.push(addr);
                let config = decode.clone();
                tasks.spawn(
                    async move { tandem_decode_server::run(listener, config, shutdown).await },
                );
            }
        }
        // What `tandem router --prefill` and `--decode` take, one line each.
        println!("prefill {}", addrs.0.join(","));
        println!("decode {}", addrs.1.join(","));
        tokio::select! {
            () = shutdown_signal() => {}
            Some(done) = tasks.join_next() => {
                stop.cancel();
                done??;
                bail!("a simulated node stopped by itself");
            }
        }
        stop.cancel();
        let drained = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(done) = tasks.join_next().await {
                done??;
            }
            anyhow::Ok(())
        });
        drained
            .await
            .unwrap_or_else(|_| bail!("the nodes did not stop within 60 s"))
    })
}
