//! The router: serves the client API (`tandem.v1.Generation`) and dispatches each request to a
//! decode and a prefill replica. It tokenizes and renders chat templates itself, with a
//! tokenizer learned from the workers, and never links candle. Health, reflection and
//! `/metrics` share its port. The HTTP APIs ([`api::routes`]: OpenAI's, Anthropic's) have a port of
//! its own.
//!
//! Its modules are laid out in layers, each using only those below it:
//!
//! ```text
//! api/       the fronts clients speak: gRPC; OpenAI's, Anthropic's and the Responses HTTP APIs
//! dispatch/  a request's way through the cluster: prepare, admit, attempts and failover, relay
//! cluster/   the view of the workers: replicas, cache index, policy, discovery, drain moves
//! auth, config, error, ids, metrics   shared by all
//! ```
//!
//! The workspace's layout test (`integration-tests/tests/layout.rs`) checks it: no module names
//! one of a layer above its own, no modules form a cycle, and no file is over 600 lines.

pub mod api;
pub mod auth;
mod cluster;
mod config;
mod dispatch;
mod error;
#[doc(hidden)]
pub mod fuzzing;
mod ids;
mod metrics;
#[doc(hidden)]
pub mod simulation;

use std::collections::HashMap;
use std::future::{Future, IntoFuture};
use std::sync::{Arc, Mutex};

use prometheus_client::registry::Registry;
use tandem_net::ServerTls;
use tandem_net::api_tls::TlsListener;
use tandem_proto::v1 as pb;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::service::Routes;
use tonic_health::ServingStatus;

pub use crate::cluster::discovery::{Target, resolve};
pub use crate::config::{
    AuthConfig, Class, Config, KeyLimits, Limits, PipelineConfig, PolicyKind, SamplingDefaults,
    SessionConfig, parse_ttft_targets,
};
pub use crate::error::{Error, Result};

use crate::cluster::peers::Peers;
use crate::cluster::policy::Policy;
use crate::cluster::replica::Role;
use crate::cluster::replicas::Replicas;
use crate::cluster::sessions::Sessions;
use crate::dispatch::GenerationService;
use crate::dispatch::dispatcher::Dispatcher;
use crate::metrics::RouterMetrics;

const SERVICE_NAME: &str = "tandem.v1.Generation";

/// Where the router serves.
#[derive(Debug)]
pub struct Listeners {
    /// gRPC (`tandem.v1.Generation`), health, reflection and `/metrics`.
    pub grpc: TcpListener,
    /// The OpenAI-compatible HTTP API, if any.
    pub http: Option<TcpListener>,
    /// `tandem.v1.Peer` for the other routers (mutual TLS with the cluster's certificates when
    /// [`Config::tls`] is set), if any.
    pub peer: Option<TcpListener>,
}

/// Serves the router until `shutdown` completes, then drains: new requests are refused at once
/// while the running streams finish, within the configured grace.
pub async fn run(
    listeners: Listeners,
    config: Config,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let Listeners {
        grpc: listener,
        http,
        peer: peer_listener,
    } = listeners;
    config.validate(peer_listener.is_some())?;
    let keys = auth::KeyStore::open(config.auth.clone())?;
    if keys.required() {
        tracing::info!(keys = keys.key_count(), "API keys required");
    } else {
        tracing::warn!("no API key file: every client is served without a key");
    }
    let mut registry = Registry::default();
    let metrics = RouterMetrics::register(&mut registry);
    let root = CancellationToken::new();
    let tracker = TaskTracker::new();
    let replicas = Arc::new(Replicas::with_tls(
        config.index_max_blocks,
        root.child_token(),
        config.tls.clone(),
    ));
    let targets: Vec<(Role, String)> = (config.prefill.iter().map(|t| (Role::Prefill, t)))
        .chain(config.decode.iter().map(|t| (Role::Decode, t)))
        .map(|(role, t)| (role, t.clone()))
        .collect();
    crate::cluster::discovery::start(&replicas, &targets, &tracker, &root.child_token())?;
    replicas.start_monitoring(&tracker, config.load_poll, &metrics);

    let (health, health_service) = tonic_health::server::health_reporter();
    let draining = CancellationToken::new();
    let generations = TaskTracker::new();
    let sessions = Arc::new(Sessions::new(config.sessions, metrics.clone()));
    sessions.start_sweeping(replicas.clone(), &tracker, root.child_token());
    let peer_tls = config.tls.as_ref().map(tandem_net::tls::Tls::client_config);
    let peers = Arc::new(Peers::new(&config.peers, peer_tls, metrics.clone())?);
    peers.start(
        sessions.clone(),
        replicas.clone(),
        config.load_poll,
        &tracker,
        root.child_token(),
    );
    let dispatcher = Dispatcher {
        replicas: replicas.clone(),
        policy: Arc::new(Policy::new(config.policy, config.pipeline)),
        sessions,
        peers,
        metrics,
        kv_wait: config.kv_wait,
        token_gap: config.token_gap,
        budget: Arc::default(),
        pace: Arc::default(),
        calibration: Arc::default(),
        order: Arc::default(),
    };
    let generation = GenerationService {
        dispatcher,
        admission: Arc::new(Semaphore::new(config.max_inflight)),
        max_inflight: config.max_inflight,
        limits: Arc::new(config.limits.clone()),
        sampling_defaults: config.sampling_defaults,
        default_model: config.default_model.as_deref().map(Arc::from),
        keys: keys.clone(),
        default_timeout: config.default_timeout,
        running: Arc::new(Mutex::new(HashMap::new())),
        draining: draining.clone(),
        shutdown: root.child_token(),
        generations: generations.clone(),
    };
    watch_health(&health, &replicas, &draining, &tracker, root.child_token());
    // Both APIs go on accepting through the drain, so that a request arriving meanwhile is
    // refused at once (UNAVAILABLE; HTTP 503 with Retry-After) instead of finding the port
    // closed. HTTP stops once the drain is over, gRPC as `serve` ends it.
    let http_stop = CancellationToken::new();
    let http_task = http.map(|l| serve_http(l, &generation, &config, &http_stop));
    tracker.spawn(keys.clone().watch(root.child_token()));
    if let Some(cert) = &config.api_tls {
        tracker.spawn(cert.clone().watch(root.child_token()));
    }
    let peer_task = peer_listener.map(|l| serve_peer_port(l, &generation, &config, &root));
    let picker = match config.picker_endpoints.as_slice() {
        [] => None,
        specs => {
            let picker = api::picker::Picker::start(
                generation.clone(),
                specs.to_vec(),
                config.limits.http_body_bytes,
                &tracker,
                root.child_token(),
            )
            .await?;
            tracing::info!(endpoints = ?specs, "serving the ext_proc endpoint picker");
            Some(picker)
        }
    };
    let cut = generation.shutdown.clone();
    let routes = grpc_routes(generation, health_service, picker, &config);
    let shutdown = async {
        shutdown.await;
        draining.cancel();
    };
    let drain = drain(&generations, &cut, config.grace);
    tracing::info!(addr = ?listener.local_addr().ok(), prefill = ?config.prefill, decode = ?config.decode, tls = config.api_tls.is_some(), "router serving");
    let served = tandem_net::serve(
        listener,
        routes,
        tandem_net::ServeOptions {
            service_names: Vec::new(),
            health,
            metrics: Arc::new(registry),
            grace: config.grace,
            tls: config.api_tls.clone().map(ServerTls::Server),
        },
        shutdown,
        drain,
    )
    .await;
    root.cancel();
    http_stop.cancel();
    if let Some(task) = peer_task {
        match task.await {
            Ok(Err(e)) => tracing::warn!(error = %e, "the peer server failed"),
            Err(e) => tracing::warn!(error = %e, "the peer server task failed"),
            Ok(Ok(())) => {}
        }
    }
    tracker.close();
    tracker.wait().await;
    if let Some(task) = http_task {
        // Every generation has ended, so every HTTP stream has too.
        match tokio::time::timeout(config.grace, task).await {
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "the HTTP server failed"),
            Ok(Err(e)) => tracing::warn!(error = %e, "the HTTP server task failed"),
            Ok(Ok(Ok(()))) => {}
            Err(_) => tracing::warn!("HTTP connections still open after the grace period"),
        }
    }
    served?;
    Ok(())
}

/// Serves the OpenAI-compatible HTTP API on `listener` (over TLS with the config's API
/// certificate) until `stop` is cancelled.
fn serve_http(
    listener: TcpListener,
    generation: &GenerationService,
    config: &Config,
    stop: &CancellationToken,
) -> tokio::task::JoinHandle<std::io::Result<()>> {
    tracing::info!(addr = ?listener.local_addr().ok(), tls = config.api_tls.is_some(), "OpenAI HTTP API serving");
    let app = api::routes(generation.clone());
    let stop = stop.clone().cancelled_owned();
    match &config.api_tls {
        Some(cert) => spawn_http(TlsListener::new(listener, cert.acceptor()), app, stop),
        None => spawn_http(listener, app, stop),
    }
}

/// The client gRPC port's services: `tandem.v1.Generation` behind its interceptor (API keys,
/// the message limit), health, and the endpoint picker where it serves.
fn grpc_routes(
    generation: GenerationService,
    health_service: tonic_health::pb::health_server::HealthServer<
        impl tonic_health::pb::health_server::Health,
    >,
    picker: Option<api::picker::Picker>,
    config: &Config,
) -> Routes {
    let interceptor = crate::api::grpc::interceptor(&generation);
    let server = pb::generation_server::GenerationServer::new(generation)
        .max_decoding_message_size(config.limits.grpc_message_bytes)
        .max_encoding_message_size(tandem_proto::MAX_MESSAGE_BYTES);
    let mut routes = Routes::new(health_service).add_service(
        tonic::service::interceptor::InterceptedService::new(server, interceptor),
    );
    if let Some(picker) = picker {
        use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
        routes = routes.add_service(ExternalProcessorServer::new(picker));
    }
    routes
}

/// Keeps the router's own Generation service SERVING only while it can route (it knows the
/// model and a decode replica is healthy) and does not drain.
fn watch_health(
    health: &tonic_health::server::HealthReporter,
    replicas: &Arc<Replicas>,
    draining: &CancellationToken,
    tracker: &TaskTracker,
    cancel: CancellationToken,
) {
    let (health, replicas, draining) = (health.clone(), replicas.clone(), draining.clone());
    tracker.spawn(async move {
        let mut last = None;
        loop {
            let changed = replicas.changed();
            let ready = replicas.ready() && !draining.is_cancelled();
            if last != Some(ready) {
                let status = if ready {
                    ServingStatus::Serving
                } else {
                    ServingStatus::NotServing
                };
                health.set_service_status(SERVICE_NAME, status).await;
                last = Some(ready);
            }
            tokio::select! {
                () = changed => {}
                () = draining.cancelled(), if !draining.is_cancelled() => {}
                () = cancel.cancelled() => return,
            }
        }
    });
}

/// Serves `tandem.v1.Peer` for the other routers on `listener` until the router has drained
/// (`root` cancelled): a peer may attach to a stream still running.
fn serve_peer_port(
    listener: TcpListener,
    generation: &GenerationService,
    config: &Config,
    root: &CancellationToken,
) -> tokio::task::JoinHandle<std::result::Result<(), tonic::transport::Error>> {
    tracing::info!(addr = ?listener.local_addr().ok(), peers = ?config.peers, "peer port serving");
    let peer = api::peer::PeerService {
        service: generation.clone(),
    };
    let (health, health_service) = tonic_health::server::health_reporter();
    let routes = Routes::new(health_service).add_service(tandem_proto::limits!(
        pb::peer_server::PeerServer::new(peer)
    ));
    let options = tandem_net::ServeOptions {
        service_names: vec!["tandem.v1.Peer"],
        health,
        metrics: Arc::new(Registry::default()),
        grace: config.grace,
        tls: config.tls.clone().map(ServerTls::Mutual),
    };
    let stop = root.clone().cancelled_owned();
    tokio::spawn(tandem_net::serve(listener, routes, options, stop, async {}))
}

/// The router's drain, once new requests are refused: waits for the running generations (gRPC
/// and HTTP alike) to finish, for at most `grace`; those still running then are `cut`, and end
/// with UNAVAILABLE.
async fn drain(generations: &TaskTracker, cut: &CancellationToken, grace: std::time::Duration) {
    generations.close();
    let running = generations.len();
    tracing::info!(
        streams = running,
        grace_ms = grace.as_millis() as u64,
        "draining: new requests refused, running streams finishing"
    );
    let started = std::time::Instant::now();
    if tokio::time::timeout(grace, generations.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            streams = generations.len(),
            grace_ms = grace.as_millis() as u64,
            "the drain's grace period is over: ending the streams still running with UNAVAILABLE"
        );
        cut.cancel();
        generations.wait().await;
    }
    tracing::info!(
        streams = running,
        ms = started.elapsed().as_millis() as u64,
        "drained"
    );
}

/// Serves the HTTP API on `listener` (plain TCP, or [`TlsListener`]) until `stop`.
fn spawn_http<L>(
    listener: L,
    app: axum::Router,
    stop: tokio_util::sync::WaitForCancellationFutureOwned,
) -> tokio::task::JoinHandle<std::io::Result<()>>
where
    L: axum::serve::Listener,
    L::Addr: std::fmt::Debug,
{
    tokio::spawn(
        axum::serve(listener, app)
            .with_graceful_shutdown(stop)
            .into_future(),
    )
}
