//! `tandem up`: a whole cluster on loopback as child processes of one command. Workers start
//! on port 0 and report their port on stdout; the router starts once they are known. With
//! several `--model`s, each model gets its own prefill and decode nodes, and the router serves
//! them all (the first is its default model). `up` waits
//! until every worker and then the router report SERVING (the router once it knows the model
//! and sees a healthy decode replica), prints the endpoints, and on Ctrl-C or SIGTERM stops the router first, then the
//! workers, each with SIGTERM so it drains.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tandem_net::tls::{Role, Tls};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use tandem_client::KvDtype;

use crate::serve::{Policy, Switch, shutdown_signal};

#[derive(Args, Debug)]
pub(crate) struct UpArgs {
    /// The models to serve: each a catalog name (`default` is Qwen2.5-Coder-0.5B-Instruct;
    /// `tandem model list` lists the rest), `tiny` (`tiny-qwen2`, `tiny-gemma3`, `tiny-qwen3`,
    /// `tiny-qwen3moe`) or a GGUF path.
    /// Repeat the flag (or separate with commas) for several: each model gets `--prefill` and
    /// `--decode` nodes of its own, requests pick one by its id (`GET /v1/models`), and the
    /// first is the default for requests that name none.
    #[arg(
        long = "model",
        env = "TANDEM_MODEL",
        default_value = "default",
        value_delimiter = ','
    )]
    models: Vec<String>,
    /// Directory holding fetched models.
    #[arg(long, env = "TANDEM_MODEL_DIR")]
    model_dir: Option<PathBuf>,
    #[command(flatten)]
    sampling_defaults: crate::serve::SamplingDefaultsArgs,
    /// Prefill nodes to start per model.
    #[arg(long, default_value_t = 1)]
    prefill: usize,
    /// Decode nodes to start per model.
    #[arg(long, default_value_t = 1)]
    decode: usize,
    /// Routers to start, each over all the workers: the first on --port and --http-port, the
    /// others on free ports (each one's addresses are printed). Any of them serves any request:
    /// they are each other's peers (`tandem router --peers`), sharing sessions, load and
    /// running generations.
    #[arg(long, default_value_t = 1)]
    routers: usize,
    /// The router's port on 127.0.0.1 (0 picks a free one).
    #[arg(long, env = "TANDEM_PORT", default_value_t = 50051)]
    port: u16,
    /// The router's OpenAI-compatible HTTP port on 127.0.0.1 (0 picks a free one) [default: 8000
    /// with the default --port, else --port + 1, so that a second cluster started with another
    /// --port does not collide on HTTP].
    #[arg(long, env = "TANDEM_HTTP_PORT")]
    http_port: Option<u16>,
    /// Compute threads per worker (0 = the cores split evenly among the workers, at least one
    /// each, so that prefill and decode do not fight over the same cores).
    #[arg(long, env = "TANDEM_THREADS", default_value_t = 0)]
    threads: usize,
    /// The prefill nodes' compute priority as a nice value (0-19; `tandem prefill
    /// --compute-nice`): the nodes share this machine's cores, and a decode step (every
    /// stream's next token) should not wait behind a prompt's compute. 0 gives both the same.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(i32).range(0..=19))]
    prefill_nice: i32,
    /// How long to wait for the cluster to become healthy, in ms.
    #[arg(long, default_value_t = 60_000)]
    ready_timeout_ms: u64,
    /// Every worker's prefix or session cache (`off` is the baseline without reuse).
    #[arg(long, env = "TANDEM_PREFIX_CACHE", value_enum, default_value_t = Switch::On)]
    prefix_cache: Switch,
    /// The decode nodes' prompt-lookup speculative decoding.
    #[arg(long, env = "TANDEM_SPECULATE", value_enum, default_value_t = Switch::On)]
    speculate: Switch,
    /// How every node's KV cache stores keys and values, and how prefill sends them to decode.
    #[arg(long, env = "TANDEM_KV_DTYPE", value_enum, default_value_t = KvDtype::F16)]
    kv_dtype: KvDtype,
    /// Each prefill node's prefix cache in MiB.
    #[arg(long, env = "TANDEM_PREFIX_CACHE_MB", default_value_t = tandem_prefill_server::DEFAULT_PREFIX_CACHE_BYTES >> 20)]
    prefix_cache_mb: usize,
    /// Each worker's KV pool in MiB [default: 512, or one sequence of the model's whole
    /// context where that is more] (`tandem decode --kv-budget-mb`).
    #[arg(long, env = "TANDEM_KV_BUDGET_MB")]
    kv_budget_mb: Option<usize>,
    /// The caches' disk tier: each worker spills the blocks its pool evicts (and the KV of
    /// agent sessions gone idle) to a directory of its own under this one (`MODEL/prefill-0`,
    /// `MODEL/decode-0`, ..., MODEL the model's id) and reads them back on a later hit (`tandem
    /// prefill --kv-spill-dir`). It is kept: a cluster started again reads back what the last
    /// one spilled (blocks are checked against the model's fingerprint and a CRC on read), so
    /// an agent's long system prompt is computed once, not once per start. Two clusters of one
    /// model at once each take slots of their own. Unset, `~/.cache/tandem/kv`.
    #[arg(
        long,
        env = "TANDEM_KV_SPILL_DIR",
        conflicts_with = "kv_spill_temporary"
    )]
    kv_spill_dir: Option<PathBuf>,
    /// A disk tier in a temporary directory, removed when the cluster stops, instead of the
    /// kept one (benchmarks that must start cold use it).
    #[arg(long)]
    kv_spill_temporary: bool,
    /// Empty the models' kept disk tier (under --kv-spill-dir) before starting. Stop other
    /// clusters of the same models first: their spilled blocks go too.
    #[arg(long, conflicts_with = "kv_spill_temporary")]
    kv_spill_clear: bool,
    /// Most MiB each worker's disk tier holds; 0 turns the tier off.
    #[arg(long, env = "TANDEM_KV_SPILL_MB", default_value_t = crate::serve::DEFAULT_KV_SPILL_MB)]
    kv_spill_mb: u64,
    /// How the router chooses replicas.
    #[arg(long, env = "TANDEM_POLICY", value_enum, default_value_t = Policy::Affinity)]
    policy: Policy,
    #[command(flatten)]
    pipeline: crate::serve::PipelineArgs,
    /// The router's API key file (see `tandem router --api-keys`); without it, clients need no
    /// key.
    #[arg(long, env = "TANDEM_API_KEYS")]
    api_keys: Option<PathBuf>,
    /// Certificates for mutual TLS between the nodes (`tandem certs init`); unset, a fresh CA
    /// and certificates are made in a temporary directory, removed when the cluster stops.
    #[arg(long, env = "TANDEM_TLS_DIR", conflicts_with = "insecure")]
    tls_dir: Option<PathBuf>,
    /// Plaintext, unauthenticated traffic between the nodes (logs a warning).
    #[arg(long)]
    insecure: bool,
    /// Serve the client API (gRPC and HTTP) over TLS too, with the router's certificate from
    /// the nodes' CA (it names localhost and 127.0.0.1); clients verify it with that CA's
    /// `ca.pem` (`--ca-cert`).
    #[arg(long, conflicts_with = "insecure")]
    api_tls: bool,
    /// Every worker simulates its model (`tandem prefill --simulate`): `shipped` (the flag
    /// alone) for the profile shipped with a catalog model, or a profile file.
    #[arg(long, env = "TANDEM_SIMULATE", num_args = 0..=1, default_missing_value = crate::simulate::SHIPPED_PROFILE)]
    simulate: Option<String>,
}

/// A directory `up` uses (the nodes' certificates, the disk tier), and whether `up` made it
/// (and so removes it).
struct Dir {
    dir: PathBuf,
    made: bool,
}

impl Dir {
    /// A directory the user gave, left in place.
    fn kept(dir: &std::path::Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            made: false,
        }
    }

    /// A directory of this process's under the system's temporary one.
    fn temporary(what: &str) -> Self {
        let name = format!("tandem-up-{}{what}", std::process::id());
        Self {
            dir: std::env::temp_dir().join(name),
            made: true,
        }
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        if self.made {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn certs(args: &UpArgs) -> anyhow::Result<Option<Dir>> {
    if args.insecure {
        tracing::warn!("--insecure: node-to-node traffic is plaintext and unauthenticated");
        return Ok(None);
    }
    if let Some(dir) = &args.tls_dir {
        return Ok(Some(Dir::kept(dir)));
    }
    let dir = Dir::temporary("");
    tandem_net::tls::write_dev_certs(&dir.dir, &[], 30)?;
    Ok(Some(dir))
}

/// The disk tier's directory, if the tier is on: the kept one (emptied first for the models'
/// ids with `--kv-spill-clear`), or a temporary one.
fn spill_dir(args: &UpArgs, model_ids: &[&str]) -> anyhow::Result<Option<Dir>> {
    if args.kv_spill_mb == 0 {
        return Ok(None);
    }
    if args.kv_spill_temporary {
        return Ok(Some(Dir::temporary("-kv")));
    }
    let dir = (args.kv_spill_dir.clone()).unwrap_or_else(tandem_engine::kv_dir_default);
    if args.kv_spill_clear {
        for id in model_ids {
            let models = dir.join(id);
            match std::fs::remove_dir_all(&models) {
                Ok(()) => eprintln!("cleared the disk tier {}", models.display()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => bail!("cannot clear {}: {e}", models.display()),
            }
        }
    }
    Ok(Some(Dir::kept(&dir)))
}

struct Node {
    name: String,
    addr: String,
    /// The HTTP address the node printed before its gRPC one (the router's OpenAI API).
    http: Option<String>,
    child: Child,
}

async fn start(name: String, args: &[String]) -> anyhow::Result<Node> {
    let exe = std::env::current_exe().context("cannot find the tandem binary")?;
    let mut child = Command::new(exe)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("cannot start {name}"))?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let mut http = None;
    let addr = loop {
        match lines.next_line().await? {
            Some(line) => {
                if let Some(addr) = line.strip_prefix("listening on ") {
                    break addr.to_string();
                }
                if let Some(addr) = line.strip_prefix("http listening on ") {
                    http = Some(addr.to_string());
                }
            }
            None => bail!("{name} exited before listening (see its log above)"),
        }
    };
    // Keep draining stdout so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(Node {
        name,
        addr,
        http,
        child,
    })
}

/// Waits until every worker reports SERVING, then the router's Generation service (which it
/// reports once it knows the model and sees a healthy decode replica). `tls` reaches the workers;
/// `api_tls`, if the router's client port serves TLS, reaches the router.
async fn wait_ready(
    nodes: &[Node],
    tls: Option<&Tls>,
    api_tls: Option<&Tls>,
    timeout: Duration,
) -> anyhow::Result<()> {
    let ready = async {
        let (routers, workers): (Vec<&Node>, Vec<&Node>) =
            nodes.iter().partition(|n| n.name.starts_with("router"));
        for n in workers.into_iter().chain(routers) {
            let (service, tls) = if n.name.starts_with("router") {
                ("tandem.v1.Generation", api_tls.map(Tls::api_client_config))
            } else {
                ("", tls.map(Tls::client_config))
            };
            let channel = tandem_net::channel(&n.addr, tls)?;
            tandem_net::wait_serving(channel, service, timeout).await?;
        }
        Ok::<_, anyhow::Error>(())
    };
    tokio::time::timeout(timeout, ready)
        .await
        .map_err(|_| anyhow::anyhow!("the cluster did not become healthy within {timeout:?}"))?
}

async fn stop(nodes: &mut [Node]) {
    for node in nodes.iter_mut() {
        if let Some(pid) = node.child.id() {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
        }
        match tokio::time::timeout(Duration::from_secs(15), node.child.wait()).await {
            Ok(_) => eprintln!("stopped {}", node.name),
            Err(_) => {
                let _ = node.child.kill().await;
                eprintln!("killed {} (it did not stop within 15 s)", node.name);
            }
        }
    }
}

/// The flags every worker of `models` models gets, `tls_args` among them.
fn worker_flags(args: &UpArgs, models: usize, tls_args: &[String]) -> Vec<String> {
    let mut common = Vec::new();
    if let Some(dir) = &args.model_dir {
        common.extend(["--model-dir".into(), dir.display().to_string()]);
    }
    common.extend(tls_args.iter().cloned());
    let threads = match args.threads {
        0 => {
            let cores = std::thread::available_parallelism().map_or(1, usize::from);
            (cores / ((args.prefill + args.decode) * models)).max(1)
        }
        n => n,
    };
    common.extend(["--threads".into(), threads.to_string()]);
    common.extend(["--prefix-cache".into(), args.prefix_cache.name().into()]);
    common.extend(["--kv-dtype".into(), args.kv_dtype.dtype().name().into()]);
    if let Some(mb) = args.kv_budget_mb {
        common.extend(["--kv-budget-mb".into(), mb.to_string()]);
    }
    if let Some(profile) = &args.simulate {
        common.extend(["--simulate".into(), profile.clone()]);
    }
    common
}

pub(crate) fn up(args: &UpArgs) -> anyhow::Result<()> {
    if args.prefill == 0 || args.decode == 0 || args.routers == 0 {
        bail!("--prefill, --decode and --routers must each be at least 1");
    }
    let dir = (args.model_dir.clone()).unwrap_or_else(tandem_engine::model_dir_from_env);
    let models: Vec<(String, String)> = args
        .models
        .iter()
        .map(|m| (m.clone(), tandem_engine::ModelSource::parse(m, &dir).name()))
        .collect();
    for (i, (spec, id)) in models.iter().enumerate() {
        if let Some((other, _)) = models[..i].iter().find(|(_, o)| o == id) {
            bail!("--model {spec} and --model {other} are the same model ({id})");
        }
    }
    let Some((_, default_model)) = models.first() else {
        bail!("--model names no model");
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let certs = certs(args)?;
    let ids: Vec<&str> = models.iter().map(|(_, id)| id.as_str()).collect();
    let spill = spill_dir(args, &ids)?;
    let client_tls = certs
        .as_ref()
        .map(|c| Tls::load(&c.dir, Role::Client))
        .transpose()?;
    rt.block_on(async {
        let tls_args: Vec<String> = certs
            .as_ref()
            .map(|c| vec!["--tls-dir".into(), c.dir.display().to_string()])
            .unwrap_or_default();
        let common = worker_flags(args, models.len(), &tls_args);
        let mut workers = Vec::new();
        for (m, (spec, id)) in models.iter().enumerate() {
            for (role, n) in [("prefill", args.prefill), ("decode", args.decode)] {
                for i in 0..n {
                    // One model keeps the names it always had; with several, each node's name
                    // says its model's place in --model.
                    let name = match models.len() {
                        1 => format!("{role}-{i}"),
                        _ => format!("{role}-m{m}-{i}"),
                    };
                    let mut a = vec![role.to_string(), "--listen".into(), "127.0.0.1:0".into()];
                    a.extend(["--model".into(), spec.clone()]);
                    a.extend(common.iter().cloned());
                    if let Some(spill) = &spill {
                        let dir = spill.dir.join(id).join(format!("{role}-{i}"));
                        a.extend(["--kv-spill-dir".into(), dir.display().to_string()]);
                        a.extend(["--kv-spill-mb".into(), args.kv_spill_mb.to_string()]);
                    }
                    if role == "prefill" {
                        a.extend(["--prefix-cache-mb".into(), args.prefix_cache_mb.to_string()]);
                        a.extend(["--compute-nice".into(), args.prefill_nice.to_string()]);
                    } else {
                        a.extend(["--speculate".into(), args.speculate.name().into()]);
                    }
                    workers.push(start(name, &a).await?);
                }
            }
        }
        let list = |role: &str| {
            workers
                .iter()
                .filter(|n| n.name.starts_with(role))
                .map(|n| n.addr.clone())
                .collect::<Vec<_>>()
                .join(",")
        };
        let workers_args = [list("prefill"), list("decode")];
        let mut router_args =
            router_args(args, certs.as_ref(), &tls_args, workers_args, default_model);
        // Several routers are each other's peers: their peer ports are picked before they
        // start, so that each can be told all of them.
        let mut peer_ports = Vec::new();
        if args.routers > 1 {
            for _ in 0..args.routers {
                let free = std::net::TcpListener::bind("127.0.0.1:0")?;
                peer_ports.push(free.local_addr()?.port());
            }
            let peers: Vec<String> = (peer_ports.iter())
                .map(|p| format!("127.0.0.1:{p}"))
                .collect();
            router_args.extend(["--peers".into(), peers.join(",")]);
        }
        let mut nodes = Vec::new();
        for i in 0..args.routers {
            let (port, http) = match i {
                0 => (args.port, http_port(args.port, args.http_port)),
                _ => (0, 0),
            };
            let mut a = router_args.clone();
            if let Some(p) = peer_ports.get(i) {
                a.extend(["--peer-listen".into(), format!("127.0.0.1:{p}")]);
            }
            a.extend(["--listen".into(), format!("127.0.0.1:{port}")]);
            a.extend(["--http-listen".into(), format!("127.0.0.1:{http}")]);
            let name = match i {
                0 => "router".to_string(),
                i => format!("router-{i}"),
            };
            nodes.push(start(name, &a).await?);
        }
        nodes.extend(workers);
        let ready_timeout = Duration::from_millis(args.ready_timeout_ms);
        let api_tls = client_tls.as_ref().filter(|_| args.api_tls);
        if let Err(e) = wait_ready(&nodes, client_tls.as_ref(), api_tls, ready_timeout).await {
            stop(&mut nodes).await;
            return Err(e);
        }
        print_addresses(&nodes, &models, api_tls.is_some(), certs.as_ref());

        let result = {
            let names: Vec<String> = nodes.iter().map(|n| n.name.clone()).collect();
            let exits =
                futures::future::select_all(nodes.iter_mut().map(|n| Box::pin(n.child.wait())));
            tokio::select! {
                () = shutdown_signal() => Ok(()),
                (status, i, _) = exits => Err(anyhow::anyhow!(
                    "{} exited unexpectedly ({})",
                    names[i],
                    status.map_or_else(|e| e.to_string(), |s| s.to_string())
                )),
            }
        };
        eprintln!(
            "stopping the cluster: the router drains (new requests refused, streams finishing), \
             then the workers"
        );
        stop(&mut nodes).await;
        result
    })
}

/// The flags every router of the cluster takes: the workers (`[prefill, decode]`, each a
/// comma-separated list of addresses), the policy, keys, sampling defaults and TLS.
fn router_args(
    args: &UpArgs,
    certs: Option<&Dir>,
    tls_args: &[String],
    [prefill, decode]: [String; 2],
    default_model: &str,
) -> Vec<String> {
    let mut router_args = vec![
        "router".to_string(),
        "--prefill".into(),
        prefill,
        "--decode".into(),
        decode,
        "--policy".into(),
        args.policy.name().into(),
        "--default-model".into(),
        default_model.to_string(),
    ];
    if let Some(keys) = &args.api_keys {
        router_args.extend(["--api-keys".into(), keys.display().to_string()]);
    }
    router_args.extend(args.sampling_defaults.to_args());
    router_args.extend(args.pipeline.to_args());
    router_args.extend(tls_args.iter().cloned());
    if let (Some(c), true) = (certs, args.api_tls) {
        let [cert, key] = Role::Router.files();
        router_args.extend([
            "--api-tls-cert".into(),
            c.dir.join(cert).display().to_string(),
            "--api-tls-key".into(),
            c.dir.join(key).display().to_string(),
        ]);
    }
    router_args
}

/// What `up` prints once the cluster serves: the models, every node, each router's two APIs
/// (over TLS with `api_tls`), and how to talk to it.
fn print_addresses(
    nodes: &[Node],
    models: &[(String, String)],
    api_tls: bool,
    certs: Option<&Dir>,
) {
    let router_addr = &nodes[0].addr;
    let ids: Vec<&str> = models.iter().map(|(_, id)| id.as_str()).collect();
    println!("tandem cluster is up, serving {}", ids.join(", "));
    for n in nodes {
        println!("  {:<14} {}", n.name, n.addr);
    }
    // Plaintext addresses print bare (host:port), as every client takes them.
    let (scheme, ca_flag) = match (api_tls, certs) {
        (true, Some(c)) => (
            "https",
            format!(" --ca-cert {}", c.dir.join("ca.pem").display()),
        ),
        _ => ("http", String::new()),
    };
    let grpc_of = |addr: &str| match scheme {
        "https" => format!("https://{addr}"),
        _ => addr.to_string(),
    };
    for n in nodes.iter().filter(|n| n.name.starts_with("router")) {
        let http = n.http.as_deref().unwrap_or_default();
        println!(
            "{} (gRPC tandem.v1.Generation): {}",
            n.name,
            grpc_of(&n.addr)
        );
        println!("{} (OpenAI HTTP): {scheme}://{http}/v1", n.name);
    }
    println!(
        "try: tandem chat --server {}{ca_flag}",
        grpc_of(router_addr)
    );
    println!("metrics: {scheme}://{router_addr}/metrics; Ctrl-C stops the cluster");
    println!(
        "stopping drains the router first: streams in flight finish (up to 10 s), and \
         requests sent meanwhile are refused at once (UNAVAILABLE; HTTP 503 with Retry-After)"
    );
}

/// The HTTP port: the one given, else 8000 beside the default gRPC port 50051, else the gRPC
/// port's next (a free one beside a free one, port 0).
fn http_port(grpc: u16, http: Option<u16>) -> u16 {
    http.unwrap_or(match grpc {
        50051 => 8000,
        0 => 0,
        p => p.checked_add(1).unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_http_port_follows_the_grpc_port_unless_given() {
        use super::http_port;
        assert_eq!(http_port(50051, None), 8000);
        assert_eq!(http_port(50061, None), 50062);
        assert_eq!(http_port(0, None), 0);
        assert_eq!(http_port(65535, None), 0);
        assert_eq!(http_port(50061, Some(9000)), 9000);
    }
}
