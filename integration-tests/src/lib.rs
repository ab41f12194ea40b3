//! The harness: a whole cluster (prefill nodes, decode nodes, a router) started in-process by
//! calling each server's `run` on a listener bound to 127.0.0.1:0. Real gRPC on real sockets;
//! no port probing and no sleeps: the harness waits on the router's health Watch.
//!
//! `stop()` shuts every server down in order (router first), joins its task and re-raises a
//! panic if one happened.
//!
//! With `relays`, the router reaches each worker through a [`Relay`] (a TCP forwarder on
//! loopback) that a test can cut, to break every connection to that worker as a network fault
//! would.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tandem_engine::{EngineConfig, Model};
use tandem_proto::v1 as pb;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

/// One running server.
#[derive(Debug)]
pub struct Node {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Node {
    async fn spawn<F, Fut>(run: F) -> anyhow::Result<Self>
    where
        F: FnOnce(TcpListener, oneshot::Receiver<()>) -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        Self::spawn_on("127.0.0.1:0".parse()?, run).await
    }

    async fn spawn_on<F, Fut>(addr: SocketAddr, run: F) -> anyhow::Result<Self>
    where
        F: FnOnce(TcpListener, oneshot::Receiver<()>) -> Fut,
        Fut: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(run(listener, stopped));
        Ok(Self {
            addr,
            stop: Some(stop),
            task,
        })
    }

    /// Begins a graceful shutdown (as SIGTERM does the binary's) without waiting for it;
    /// [`Node::stop`] then waits for the server to exit.
    pub fn signal_stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    /// Begins a graceful shutdown, waits for the server to exit, and re-raises its panic.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.signal_stop();
        match self.task.await {
            Ok(result) => result,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => Err(e.into()),
        }
    }

    pub fn channel(&self) -> Channel {
        tandem_net::channel(&self.addr.to_string(), None).expect("a socket address is a valid URI")
    }
}

async fn stopped(rx: oneshot::Receiver<()>) {
    let _ = rx.await;
}

/// What to start.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    pub model: Arc<Model>,
    /// More models, each on `prefill` and `decode` nodes of its own, started after `model`'s
    /// (so [`Cluster::prefill`] and [`Cluster::decode`] hold `model`'s nodes first).
    pub more_models: Vec<Arc<Model>>,
    /// Prefill and decode nodes per model.
    pub prefill: usize,
    pub decode: usize,
    pub engine: EngineConfig,
    /// Batch slots per decode node.
    pub decode_slots: usize,
    /// KV the decode nodes' paused streams may keep pinned; past it they park on disk.
    pub park_pinned_bytes: u64,
    pub kv_wait: Duration,
    /// The router's token gap: how long a decode stream may be silent before the router checks
    /// that its node still serves.
    pub token_gap: Duration,
    /// The decode nodes' ceiling on a caller's `kv_wait_ms`.
    pub max_kv_wait: Duration,
    /// How often the prefill nodes' pushes send keepalives while their KV does not flow.
    pub keepalive: Duration,
    pub grace: Duration,
    /// Requests the router holds at once, running or queued; more are refused at once.
    pub max_inflight: usize,
    /// The router's bound on a request whose client sets no deadline (`--timeout-ms`).
    pub timeout: Duration,
    /// The router's API keys and per-key limits.
    pub auth: tandem_router::AuthConfig,
    /// The router's hard limits on requests.
    pub limits: tandem_router::Limits,
    /// The prefill nodes' prefix caches and the decode nodes' session caches.
    pub prefix_cache: bool,
    pub policy: tandem_router::PolicyKind,
    /// When the router splits a long prompt over idle prefill nodes.
    pub pipeline: tandem_router::PipelineConfig,
    /// Mutual TLS between the nodes, with the certificates in this directory
    /// (`tandem_net::tls::write_dev_certs`).
    pub tls_dir: Option<std::path::PathBuf>,
    /// Put a [`Relay`] between the router and each worker.
    pub relays: bool,
    /// The prefill nodes' KV dtype where it differs from `engine.kv_dtype`: a misconfigured
    /// cluster.
    pub prefill_kv_dtype: Option<tandem_engine::KvDtype>,
    /// Whether the prefill nodes send their KV as headers only, where it differs from
    /// `engine.kv_header_only` (simulated models only).
    pub prefill_kv_header_only: Option<bool>,
    /// How long the router keeps agent sessions' KV in the pools, and how many a key holds.
    pub sessions: tandem_router::SessionConfig,
}

impl ClusterConfig {
    pub fn new(model: Arc<Model>) -> Self {
        Self {
            model,
            more_models: Vec::new(),
            prefill: 1,
            decode: 1,
            engine: EngineConfig {
                threads: 1,
                kv_budget_bytes: 64 << 20,
                ..EngineConfig::default()
            },
            decode_slots: 16,
            park_pinned_bytes: tandem_decode_server::DEFAULT_PARK_PINNED_BYTES,
            max_inflight: tandem_router::Config::default().max_inflight,
            timeout: tandem_router::Config::default().default_timeout,
            kv_wait: Duration::from_secs(10),
            token_gap: tandem_router::Config::default().token_gap,
            max_kv_wait: Duration::from_secs(60),
            keepalive: tandem_transfer::client::KEEPALIVE_INTERVAL,
            grace: Duration::from_secs(2),
            auth: tandem_router::AuthConfig::default(),
            limits: tandem_router::Limits::default(),
            prefix_cache: true,
            policy: tandem_router::PolicyKind::Affinity,
            pipeline: tandem_router::PipelineConfig::default(),
            relays: false,
            tls_dir: None,
            prefill_kv_dtype: None,
            prefill_kv_header_only: None,
            sessions: tandem_router::SessionConfig::default(),
        }
    }

    /// Each node's TLS material for `role`, when the cluster uses TLS.
    fn tls(&self, role: tandem_net::tls::Role) -> anyhow::Result<Option<tandem_net::tls::Tls>> {
        Ok(match &self.tls_dir {
            Some(dir) => Some(tandem_net::tls::Tls::load(dir, role)?),
            None => None,
        })
    }

    /// The model of worker `index` among the `per_model` workers of its role that each model
    /// has.
    fn model_of(&self, index: usize, per_model: usize) -> Arc<Model> {
        match index / per_model.max(1) {
            0 => self.model.clone(),
            m => self.more_models[m - 1].clone(),
        }
    }

    /// Every model the cluster serves.
    fn models(&self) -> usize {
        1 + self.more_models.len()
    }

    /// The settings of worker `index` in `role`, whose cache, when on, may hold `cache_bytes`.
    fn node(
        &self,
        cache_bytes: usize,
        role: tandem_net::tls::Role,
        index: usize,
    ) -> anyhow::Result<tandem_worker::NodeConfig> {
        let per_model = match role {
            tandem_net::tls::Role::Prefill => self.prefill,
            _ => self.decode,
        };
        let mut engine = self.engine(cache_bytes);
        // A disk tier serves one node: each gets a directory of its own under the cluster's,
        // which a restarted node finds again.
        if let Some(spill) = &mut engine.spill {
            spill.dir = spill.dir.join(format!("{}-{index}", role.name()));
        }
        Ok(tandem_worker::NodeConfig {
            tls: self.tls(role)?,
            grace: self.grace,
            ..tandem_worker::NodeConfig::new(self.model_of(index, per_model), engine)
        })
    }

    /// The engine of a worker whose cache, when on, may hold `cache_bytes`.
    fn engine(&self, cache_bytes: usize) -> EngineConfig {
        EngineConfig {
            prefix_cache_bytes: if self.prefix_cache { cache_bytes } else { 0 },
            ..self.engine.clone()
        }
    }
}

/// A router of [`Cluster::peer_routers`].
#[derive(Debug)]
pub struct PeerRouter {
    pub node: Node,
    /// Its HTTP API and its peer port.
    pub http: SocketAddr,
    pub peer: SocketAddr,
}

#[derive(Debug)]
pub struct Cluster {
    pub router: Node,
    /// The router's OpenAI-compatible HTTP API.
    pub http: SocketAddr,
    pub prefill: Vec<Node>,
    pub decode: Vec<Node>,
    /// With `relays`: the prefill nodes' relays, then the decode nodes'.
    pub relays: Vec<Relay>,
    config: ClusterConfig,
    /// The router's configuration, which [`Cluster::another_router`] starts again.
    router_config: tandem_router::Config,
}

async fn start_decode(
    config: &ClusterConfig,
    addr: SocketAddr,
    index: usize,
) -> anyhow::Result<Node> {
    let c = tandem_decode_server::Config {
        node: config.node(usize::MAX, tandem_net::tls::Role::Decode, index)?,
        max_slots: config.decode_slots,
        kv_wait: config.kv_wait,
        max_kv_wait: config.max_kv_wait,
        park_pinned_bytes: config.park_pinned_bytes,
        batch_share_percent: tandem_decode_server::DEFAULT_BATCH_SHARE_PERCENT,
        batch_slots_beside_interactive:
            tandem_decode_server::DEFAULT_BATCH_SLOTS_BESIDE_INTERACTIVE,
    };
    Node::spawn_on(addr, |l, rx| async move {
        Ok(tandem_decode_server::run(l, c, stopped(rx)).await?)
    })
    .await
}

/// Starts a router of configuration `rc`, changed by `adjust` (given the address its HTTP API
/// will have), with its HTTP API on a free port and its peer port on `peer`: the router and its
/// HTTP address.
async fn spawn_router(
    mut rc: tandem_router::Config,
    peer: Option<TcpListener>,
    adjust: impl FnOnce(&mut tandem_router::Config, SocketAddr),
) -> anyhow::Result<(Node, SocketAddr)> {
    let http = TcpListener::bind("127.0.0.1:0").await?;
    let http_addr = http.local_addr()?;
    adjust(&mut rc, http_addr);
    let router = Node::spawn(|grpc, rx| async move {
        let listeners = tandem_router::Listeners {
            grpc,
            http: Some(http),
            peer,
        };
        Ok(tandem_router::run(listeners, rc, stopped(rx)).await?)
    })
    .await?;
    Ok((router, http_addr))
}

impl Cluster {
    /// Starts the cluster and waits until the router sees every replica up.
    pub async fn start(config: ClusterConfig) -> anyhow::Result<Self> {
        let cluster = Self::launch(config).await?;
        cluster.wait_ready(Duration::from_secs(30)).await?;
        Ok(cluster)
    }

    /// Starts the cluster without waiting for the router to take it in: for clusters it must
    /// refuse.
    pub async fn launch(config: ClusterConfig) -> anyhow::Result<Self> {
        let mut prefill = Vec::new();
        for i in 0..config.prefill * config.models() {
            let mut node = config.node(
                config.engine.kv_budget_bytes / 2,
                tandem_net::tls::Role::Prefill,
                i,
            )?;
            node.engine.kv_dtype = config.prefill_kv_dtype.unwrap_or(config.engine.kv_dtype);
            node.engine.kv_header_only =
                (config.prefill_kv_header_only).unwrap_or(config.engine.kv_header_only);
            let c = tandem_prefill_server::Config {
                node,
                keepalive: config.keepalive,
                ..tandem_prefill_server::Config::new(config.model_of(i, config.prefill))
            };
            prefill.push(
                Node::spawn(|l, rx| async move {
                    Ok(tandem_prefill_server::run(l, c, stopped(rx)).await?)
                })
                .await?,
            );
        }
        let mut decode = Vec::new();
        for i in 0..config.decode * config.models() {
            decode.push(start_decode(&config, "127.0.0.1:0".parse()?, i).await?);
        }
        let mut relays = Vec::new();
        if config.relays {
            for n in prefill.iter().chain(&decode) {
                relays.push(Relay::start(n.addr).await?);
            }
        }
        let seen = |nodes: &[Node], offset: usize| -> Vec<String> {
            nodes
                .iter()
                .enumerate()
                .map(|(i, n)| match relays.get(offset + i) {
                    Some(r) => r.addr.to_string(),
                    None => n.addr.to_string(),
                })
                .collect()
        };
        let rc = tandem_router::Config {
            prefill: seen(&prefill, 0),
            decode: seen(&decode, prefill.len()),
            kv_wait: config.kv_wait,
            token_gap: config.token_gap,
            max_inflight: config.max_inflight,
            default_timeout: config.timeout,
            grace: config.grace,
            load_poll: Duration::from_millis(50),
            policy: config.policy,
            pipeline: config.pipeline,
            auth: config.auth.clone(),
            limits: config.limits.clone(),
            tls: config.tls(tandem_net::tls::Role::Router)?,
            sessions: config.sessions,
            ..tandem_router::Config::default()
        };
        let (router, http_addr) = spawn_router(rc.clone(), None, |_, _| {}).await?;
        Ok(Self {
            router,
            http: http_addr,
            prefill,
            decode,
            relays,
            config,
            router_config: rc,
        })
    }

    /// Starts another router over the same workers, as the first one is configured and then
    /// changed by `adjust` (given the address its HTTP API will have): a second router of a
    /// fleet. Returns it and its HTTP address.
    pub async fn another_router(
        &self,
        adjust: impl FnOnce(&mut tandem_router::Config, SocketAddr),
    ) -> anyhow::Result<(Node, SocketAddr)> {
        spawn_router(self.router_config.clone(), None, adjust).await
    }

    /// Starts `n` more routers over the same workers, as the first one is configured and then
    /// changed by `adjust`, each with a peer port and all of them each other's peers (the
    /// first router is not among them).
    pub async fn peer_routers(
        &self,
        n: usize,
        adjust: impl Fn(&mut tandem_router::Config),
    ) -> anyhow::Result<Vec<PeerRouter>> {
        let mut listeners = Vec::new();
        for _ in 0..n {
            listeners.push(TcpListener::bind("127.0.0.1:0").await?);
        }
        let peers: Vec<SocketAddr> = (listeners.iter())
            .map(TcpListener::local_addr)
            .collect::<std::io::Result<_>>()?;
        let mut routers = Vec::new();
        for (listener, peer) in listeners.into_iter().zip(&peers) {
            let (node, http) = spawn_router(self.router_config.clone(), Some(listener), |c, _| {
                c.peers = peers.iter().map(SocketAddr::to_string).collect();
                adjust(c);
            })
            .await?;
            routers.push(PeerRouter {
                node,
                http,
                peer: *peer,
            });
        }
        Ok(routers)
    }

    /// Stops decode node `i` and starts a new one (empty caches, a new cache epoch) on the
    /// same address.
    pub async fn restart_decode(&mut self, i: usize) -> anyhow::Result<()> {
        let old = self.decode.remove(i);
        let addr = old.addr;
        old.stop().await?;
        let new = start_decode(&self.config, addr, i).await?;
        self.decode.insert(i, new);
        Ok(())
    }

    /// Waits until the router reports SERVING for the Generation service and sees every
    /// replica up (it serves once a decode replica is up; tests want the whole cluster).
    pub async fn wait_ready(&self, timeout: Duration) -> anyhow::Result<()> {
        let started = std::time::Instant::now();
        tandem_net::wait_serving(self.router.channel(), "tandem.v1.Generation", timeout)
            .await
            .with_context(|| format!("the router did not become SERVING within {timeout:?}"))?;
        let replicas = self.prefill.len() + self.decode.len();
        loop {
            let text = metrics(self.router.addr).await?;
            let up = replicas_up(&text);
            if up == replicas {
                return Ok(());
            }
            anyhow::ensure!(
                started.elapsed() < timeout,
                "the router saw {up} of {replicas} replicas up within {timeout:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub fn client(&self) -> pb::generation_client::GenerationClient<Channel> {
        tandem_proto::limits!(pb::generation_client::GenerationClient::new(
            self.router.channel()
        ))
    }

    /// A decode node's load report (slots and KV blocks).
    pub async fn decode_load(&self, i: usize) -> anyhow::Result<pb::LoadResponse> {
        let node = self.decode.get(i).context("no such decode node")?;
        let mut worker = pb::worker_client::WorkerClient::new(node.channel());
        Ok(worker.load(pb::LoadRequest {}).await?.into_inner())
    }

    /// Waits (at most 5 s) until decode node `i` reports no request decoding or waiting and
    /// every KV block free, and returns how long that took. Resources are released as a request's task ends,
    /// which can be a moment after its client read the last frame.
    pub async fn until_decode_idle(&self, i: usize) -> anyhow::Result<Duration> {
        let started = std::time::Instant::now();
        loop {
            let load = self.decode_load(i).await?;
            if load.active == 0 && load.queued == 0 && load.kv_blocks_free == load.kv_blocks_total {
                return Ok(started.elapsed());
            }
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(5),
                "decode node {i} never went idle: {load:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Stops the router, then the workers.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.router.stop().await?;
        for n in self.prefill.into_iter().chain(self.decode) {
            n.stop().await?;
        }
        Ok(())
    }
}

/// A TCP forwarder on loopback to one server, which a test can cut: [`Relay::cut`] closes
/// every connection through it and refuses new ones until [`Relay::restore`].
#[derive(Debug)]
pub struct Relay {
    pub addr: SocketAddr,
    up: tokio::sync::watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Relay {
    pub async fn start(target: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (up, watch) = tokio::sync::watch::channel(true);
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if !*watch.borrow() {
                    continue; // refused: dropped at once
                }
                let mut cut = watch.clone();
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cut.wait_for(|up| !up) => {}
                    }
                });
            }
        });
        Ok(Self { addr, up, task })
    }

    /// Closes every connection through the relay and refuses new ones.
    pub fn cut(&self) {
        self.up.send_replace(false);
    }

    /// Accepts connections again.
    pub fn restore(&self) {
        self.up.send_replace(true);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Everything one streamed generation returned, with its frames checked for gap-free indices.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Collected {
    pub token_ids: Vec<u32>,
    pub text: String,
    /// The last frame read: the final one (finish reason, usage, route) once complete.
    pub last: pb::GenerateResponse,
    pub frames: usize,
    /// Every frame's `logprobs`, in order.
    pub logprobs: Vec<pb::TokenLogprobs>,
}

impl Collected {
    /// Takes the choice's next frame: `true` once it is the last. A frame after the last, or
    /// out of order, is an error.
    fn take(&mut self, f: pb::GenerateResponse) -> Result<bool, tonic::Status> {
        if self.last.finish_reason != pb::FinishReason::Unspecified as i32 {
            return Err(tonic::Status::data_loss(format!(
                "a frame of choice {} after its last",
                f.choice
            )));
        }
        if f.index as usize != self.frames {
            return Err(tonic::Status::data_loss(format!(
                "choice {}: frame {} where {} was due",
                f.choice, f.index, self.frames
            )));
        }
        self.frames += 1;
        self.token_ids.extend(&f.token_ids);
        self.logprobs.extend(f.logprobs.iter().cloned());
        self.text.push_str(&f.text);
        self.last = f;
        Ok(self.last.finish_reason != pb::FinishReason::Unspecified as i32)
    }
}

/// A one-choice stream begun with [`open`], to be read to its end with [`finish`].
pub type Frames = tonic::Streaming<pb::GenerateResponse>;

/// Sends `request` and reads its first `n` frames (fewer if it ends sooner), checked as
/// [`collect`] checks them: for a test that acts mid-stream, then reads the rest.
pub async fn open(
    client: &mut pb::generation_client::GenerationClient<Channel>,
    request: pb::GenerateRequest,
    n: usize,
) -> Result<(Frames, Collected), tonic::Status> {
    let mut frames = client.generate(request).await?.into_inner();
    let mut got = Collected::default();
    while got.frames < n {
        let Some(f) = frames.message().await? else {
            break;
        };
        if got.take(f)? {
            break;
        }
    }
    Ok((frames, got))
}

/// Reads the rest of a stream begun with [`open`]; errors as [`collect`]'s.
pub async fn finish(mut frames: Frames, mut got: Collected) -> Result<Collected, tonic::Status> {
    let ended = |got: &Collected| got.last.finish_reason != pb::FinishReason::Unspecified as i32;
    while !ended(&got) {
        let Some(f) = frames.message().await? else {
            return Err(tonic::Status::data_loss(
                "the stream ended before its final frame",
            ));
        };
        got.take(f)?;
    }
    Ok(got)
}

/// Sends `request` and reads the whole stream; a non-OK status is returned as the error, and a
/// stream that ends without a final frame, or with an index gap, is an error too.
pub async fn collect(
    client: &mut pb::generation_client::GenerationClient<Channel>,
    request: impl tonic::IntoRequest<pb::GenerateRequest>,
) -> Result<Collected, tonic::Status> {
    let mut choices = collect_choices(client, request, 1).await?;
    Ok(choices.remove(0))
}

/// Sends a request for `n` choices and reads the whole stream, each choice's frames checked
/// as [`collect`] checks one stream's: a non-OK status is the error, and so is a stream that
/// ends before every choice's final frame, a frame of a choice past `n` or after its final
/// frame, or an index gap within a choice.
pub async fn collect_choices(
    client: &mut pb::generation_client::GenerationClient<Channel>,
    request: impl tonic::IntoRequest<pb::GenerateRequest>,
    n: usize,
) -> Result<Vec<Collected>, tonic::Status> {
    let mut frames = client.generate(request).await?.into_inner();
    let mut out = vec![Collected::default(); n];
    let mut open = n;
    while let Some(f) = frames.message().await? {
        let Some(c) = out.get_mut(f.choice as usize) else {
            return Err(tonic::Status::data_loss(format!(
                "a frame of choice {} of {n}",
                f.choice
            )));
        };
        if c.take(f)? {
            open -= 1;
            if open == 0 {
                return Ok(out);
            }
        }
    }
    Err(tonic::Status::data_loss(
        "the stream ended before every choice's final frame",
    ))
}

/// A greedy request for `token_ids` with `max_tokens`.
pub fn greedy(token_ids: Vec<u32>, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        token_ids,
        sampling: Some(pb::SamplingParams {
            max_tokens,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// SmolLM2-135M, the smallest real model, if it has been fetched (`tandem model fetch
/// smollm2`); tests that need it fail with that hint otherwise.
pub fn smollm2_model() -> anyhow::Result<Arc<Model>> {
    named_model("smollm2")
}

/// The 0.5B Qwen2.5-Coder (Q4_K_M, a 152k vocabulary), the model of another architecture the
/// cluster tests run on; `tandem model fetch qwen2.5-coder-0.5b` fetches it.
pub fn qwen_model() -> anyhow::Result<Arc<Model>> {
    named_model("qwen2.5-coder-0.5b")
}

/// Gemma 3 270M (Q4_K_M), a third architecture; `tandem model fetch gemma-3-270m` fetches it.
pub fn gemma_model() -> anyhow::Result<Arc<Model>> {
    named_model("gemma-3-270m")
}

fn named_model(name: &str) -> anyhow::Result<Arc<Model>> {
    let source = tandem_engine::ModelSource::parse(name, &tandem_engine::model_dir_from_env());
    Ok(source.load()?)
}

/// A server's Prometheus text from `GET /metrics` (HTTP/1.1 on the gRPC port).
pub async fn metrics(addr: SocketAddr) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await?;
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: tandem\r\nConnection: close\r\n\r\n")
        .await?;
    let mut body = String::new();
    conn.read_to_string(&mut body).await?;
    anyhow::ensure!(body.starts_with("HTTP/1.1 200"), "GET /metrics: {body}");
    Ok(body)
}

/// A server's Prometheus text from `GET /metrics` over `channel`, as HTTP/2 (over TLS when the
/// channel is): how a scraper with a client certificate reads a mutual-TLS node.
pub async fn metrics_over(channel: Channel) -> anyhow::Result<String> {
    use tower::ServiceExt;
    let request = tonic::codegen::http::Request::get("/metrics").body(tonic::body::Body::empty())?;
    let response = channel.oneshot(request).await?;
    anyhow::ensure!(
        response.status().is_success(),
        "GET /metrics: {}",
        response.status()
    );
    let body = axum::body::to_bytes(axum::body::Body::new(response.into_body()), 16 << 20).await?;
    Ok(String::from_utf8(body.to_vec())?)
}

/// A directory for a cluster's disk tiers, removed when dropped.
#[derive(Debug)]
pub struct SpillDir(pub std::path::PathBuf);

impl SpillDir {
    /// A new directory's path under the system's temporary one, unique to this process and
    /// call (what an earlier process of the same id left there is removed).
    pub fn new() -> Self {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("tandem-kv-spill-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }
}

impl Default for SpillDir {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for SpillDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// How many replicas a router's metrics (Prometheus text) say are up.
pub fn replicas_up(text: &str) -> usize {
    text.lines()
        .filter(|l| l.starts_with("tandem_router_replica_up{") && l.ends_with(" 1"))
        .count()
}

/// The value of one sample line (`name{labels} value`) in Prometheus text.
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Pushes a one-token KV header under `transfer_id` that no reservation expects, and returns the
/// error the push ends with: for checks that must refuse a push before its contents matter.
pub async fn stray_push(channel: Channel, transfer_id: &str) -> tandem_transfer::Error {
    let header = tandem_transfer::Header {
        transfer_id: transfer_id.into(),
        request_id: "r".into(),
        fingerprint: [0; 32],
        layout: tandem_transfer::WireLayout {
            layers: 1,
            kv_heads: 1,
            head_dim: 1,
            block_tokens: 16,
            dtype: tandem_transfer::KvDtype::F16,
        },
        tokens: 0..1,
        token_ids: vec![5],
        chunk_count: 2,
        total_bytes: 4,
    };
    match tandem_transfer::KvPush::start(channel, &header)
        .finish(0, None)
        .await
    {
        Ok(_) => panic!("a stray push was accepted"),
        Err(e) => e,
    }
}

/// POSTs `body` as JSON to `url` and reads the answer as JSON, whatever its status.
pub async fn post_json(
    client: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
) -> anyhow::Result<serde_json::Value> {
    Ok(client.post(url).json(body).send().await?.json().await?)
}

/// The model id an OpenAI HTTP API at `base` (`http://HOST:PORT/v1`) serves.
pub async fn http_model(client: &reqwest::Client, base: &str) -> anyhow::Result<String> {
    let models: serde_json::Value = client
        .get(format!("{base}/models"))
        .send()
        .await?
        .json()
        .await?;
    Ok(models["data"][0]["id"]
        .as_str()
        .context("GET /v1/models names no model")?
        .to_string())
}

/// One streamed OpenAI completion or chat completion (`"stream": true`) read over HTTP as a
/// client reads it: server-sent events, each `data:` a chunk, an error object, or `[DONE]`.
#[derive(Debug)]
pub struct SseStream {
    response: reqwest::Response,
    buffer: String,
    /// The text so far: each chunk's `choices[0].text` (completions) or
    /// `choices[0].delta.content` (chat).
    pub text: String,
    /// Chunks with a choice read so far.
    pub chunks: usize,
    /// The error object the stream ended with, if it did.
    pub error: Option<serde_json::Value>,
    /// Whether `[DONE]` came.
    pub done: bool,
}

impl SseStream {
    /// Posts `body` to `url` and checks that the stream begins (200, `text/event-stream`).
    pub async fn start(
        client: &reqwest::Client,
        url: &str,
        body: &serde_json::Value,
    ) -> anyhow::Result<Self> {
        let response = client.post(url).json(body).send().await?;
        let status = response.status();
        anyhow::ensure!(
            status == reqwest::StatusCode::OK,
            "{url}: HTTP {status}: {}",
            response.text().await.unwrap_or_default()
        );
        Ok(Self {
            response,
            buffer: String::new(),
            text: String::new(),
            chunks: 0,
            error: None,
            done: false,
        })
    }

    /// Reads until `chunks` chunks in all have come, or the stream ended (`[DONE]`, an error
    /// event, or the connection closing, which is an error: a stream must end with `[DONE]`
    /// or an error event).
    pub async fn read_until(&mut self, chunks: usize) -> anyhow::Result<()> {
        while self.chunks < chunks && !self.ended() {
            let Some(bytes) = self.response.chunk().await? else {
                anyhow::bail!(
                    "the stream closed after {} chunks with neither [DONE] nor an error",
                    self.chunks
                );
            };
            self.buffer.push_str(&String::from_utf8_lossy(&bytes));
            while let Some(end) = self.buffer.find("\n\n") {
                let event: String = self.buffer.drain(..end + 2).collect();
                self.take(&event)?;
            }
        }
        Ok(())
    }

    /// Reads the stream to its end.
    pub async fn finish(&mut self) -> anyhow::Result<()> {
        self.read_until(usize::MAX).await
    }

    /// Whether `[DONE]` or an error event came.
    pub fn ended(&self) -> bool {
        self.done || self.error.is_some()
    }

    fn take(&mut self, event: &str) -> anyhow::Result<()> {
        for data in event.lines().filter_map(|l| l.strip_prefix("data: ")) {
            anyhow::ensure!(!self.ended(), "an event after the stream's end: {data}");
            if data == "[DONE]" {
                self.done = true;
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(data)?;
            if v.get("error").is_some() {
                self.error = Some(v["error"].clone());
                continue;
            }
            let Some(choice) = v["choices"].get(0) else {
                continue; // the usage chunk
            };
            let text = choice["text"]
                .as_str()
                .or_else(|| choice["delta"]["content"].as_str())
                .unwrap_or_default();
            self.text.push_str(text);
            self.chunks += 1;
        }
        Ok(())
    }
}

/// A Python with `packages` installed from PyPI (pinned `name==version` specs), in a virtual
/// environment `dir` made once under the test target directory (`CARGO_TARGET_TMPDIR`), or remade
/// when `import` (a Python import statement) fails in it: an interrupted install leaves one
/// without its packages. `TANDEM_PYTHON` names the Python that makes it (default `python3`).
/// Blocking: call it from `spawn_blocking`.
pub fn python_env(dir: &std::path::Path, packages: &[&str], import: &str) -> std::path::PathBuf {
    use std::process::{Command, Stdio};
    let python = dir.join("bin/python");
    let ready = Command::new(&python)
        .args(["-c", import])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ready {
        let base = std::env::var("TANDEM_PYTHON").unwrap_or_else(|_| "python3".into());
        let made = Command::new(&base)
            .args(["-m", "venv", "--clear"])
            .arg(dir)
            .status()
            .expect("run python3 -m venv");
        assert!(
            made.success(),
            "could not make a virtual environment with {base}"
        );
        let installed = Command::new(&python)
            .args(["-m", "pip", "install", "--quiet"])
            .args(packages)
            .status()
            .expect("run pip");
        assert!(
            installed.success(),
            "pip could not install {packages:?} from PyPI"
        );
    }
    python
}

/// Runs the Python check `script` (a path under `integration-tests/`) with `args` and returns
/// the JSON line it prints of what it saw; a failed check fails the test with its output.
pub async fn python_check(
    python: &std::path::Path,
    script: &str,
    args: &[&str],
) -> serde_json::Value {
    let out = tokio::process::Command::new(python)
        .arg(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(script))
        .args(args)
        .output()
        .await
        .expect("run a Python check");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{script} failed:\n{stderr}");
    serde_json::from_slice(&out.stdout).expect("the script's JSON line")
}
