//! `tandem fault-proxy`: a TCP relay between two nodes that adds latency, jitter and a bandwidth
//! cap, can blackhole every connection or reset them all, and takes new settings while it runs
//! through a small HTTP admin endpoint. The fault suite puts it where the kernel has no `netem`
//! (the qdisc that would delay packets); packet loss and resets come from iptables, and a cap on
//! a whole interface from `tc tbf`.
//!
//! Written here rather than taken from a crate: what it needs is a delay queue on a tokio copy
//! loop, and the known fault proxies (toxiproxy, for one) are separate Go programs, which the
//! `FROM scratch` image could not carry beside `tandem`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context;
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use bytes::{Bytes, BytesMut};
use clap::Args;
use rand::Rng;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::time::Instant;

/// Bytes read at once.
const CHUNK: usize = 16 * 1024;
/// Chunks held per direction of a connection (with CHUNK, 4 MiB): a full queue stops reading,
/// so a slow side pushes back instead of growing memory.
const QUEUE: usize = 256;
/// Connections relayed at once; more wait to be accepted.
const MAX_CONNECTIONS: usize = 1024;
/// The largest latency or jitter accepted, in ms.
const MAX_DELAY_MS: u64 = 60_000;

#[derive(Args, Debug)]
pub(crate) struct FaultProxyArgs {
    /// Where to accept connections.
    #[arg(long, env = "TANDEM_LISTEN", default_value = "0.0.0.0:7000")]
    listen: SocketAddr,
    /// Where to relay each connection: `host:port`, resolved again for every new connection.
    #[arg(long, env = "TANDEM_UPSTREAM")]
    upstream: String,
    /// The admin HTTP endpoint: `GET /faults` shows the settings, `PUT /faults` with a JSON
    /// object sets them all (`{"latency_ms":100,"jitter_ms":30,"bandwidth_bps":0,
    /// "blackhole":false}`, a missing field meaning 0 or false), `POST /reset` resets every
    /// open connection.
    #[arg(long, env = "TANDEM_ADMIN", default_value = "127.0.0.1:7001")]
    admin: SocketAddr,
    #[command(flatten)]
    faults: Faults,
}

/// What the relay does to the bytes it carries, in each direction of every connection.
#[derive(Args, Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub(crate) struct Faults {
    /// Delay added to every chunk of bytes, in ms.
    #[arg(long, default_value_t = 0)]
    pub latency_ms: u64,
    /// Each chunk's delay varies uniformly by up to this much either way, in ms; bytes keep
    /// their order.
    #[arg(long, default_value_t = 0)]
    pub jitter_ms: u64,
    /// Bytes per second per direction of each connection; 0 for no cap.
    #[arg(long, default_value_t = 0)]
    pub bandwidth_bps: u64,
    /// Swallow every byte, keeping the connections open: a peer that went silent.
    #[arg(long)]
    pub blackhole: bool,
}

impl Faults {
    fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.latency_ms <= MAX_DELAY_MS && self.jitter_ms <= MAX_DELAY_MS,
            "latency_ms and jitter_ms must be at most {MAX_DELAY_MS}"
        );
        Ok(())
    }

    /// This chunk's delay.
    fn delay(&self) -> Duration {
        let jitter = self.jitter_ms as i64;
        let ms = self.latency_ms as i64
            + if jitter > 0 {
                rand::rng().random_range(-jitter..=jitter)
            } else {
                0
            };
        Duration::from_millis(ms.max(0) as u64)
    }
}

struct Shared {
    faults: watch::Sender<Faults>,
    /// Bumped by `POST /reset`; every connection open then is reset.
    resets: watch::Sender<u64>,
    open: AtomicUsize,
}

pub(crate) fn run(args: &FaultProxyArgs) -> anyhow::Result<()> {
    args.faults.validate()?;
    tandem_router::Target::parse(&args.upstream)?;
    let shared = Arc::new(Shared {
        faults: watch::Sender::new(args.faults),
        resets: watch::Sender::new(0),
        open: AtomicUsize::new(0),
    });
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(async {
            let listener = TcpListener::bind(args.listen)
                .await
                .with_context(|| format!("cannot listen on {}", args.listen))?;
            let admin = TcpListener::bind(args.admin)
                .await
                .with_context(|| format!("cannot listen on {} (admin)", args.admin))?;
            println!(
                "relaying {} -> {}; admin on http://{}",
                listener.local_addr()?,
                args.upstream,
                admin.local_addr()?
            );
            let app = axum::Router::new()
                .route("/faults", get(show).put(set))
                .route("/reset", post(reset))
                .with_state(shared.clone());
            tokio::spawn(async move {
                if let Err(e) = axum::serve(admin, app).await {
                    tracing::error!(error = %e, "admin endpoint failed");
                }
            });
            tokio::select! {
                r = accept(listener, args.upstream.clone(), shared) => r,
                () = crate::serve::shutdown_signal() => Ok(()),
            }
        })
}

async fn accept(
    listener: TcpListener,
    upstream: String,
    shared: Arc<Shared>,
) -> anyhow::Result<()> {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let slot = slots.clone().acquire_owned().await?;
        let (client, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors and the like: wait, never spin.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (upstream, shared) = (upstream.clone(), shared.clone());
        tokio::spawn(async move {
            shared.open.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = relay(client, &upstream, &shared).await {
                tracing::debug!(%peer, error = %e, "connection ended");
            }
            shared.open.fetch_sub(1, Ordering::Relaxed);
            drop(slot);
        });
    }
}

async fn relay(mut client: TcpStream, upstream: &str, shared: &Shared) -> anyhow::Result<()> {
    let addr = *tandem_router::resolve(upstream)
        .await?
        .first()
        .with_context(|| format!("{upstream} has no address"))?;
    let mut server = TcpStream::connect(addr)
        .await
        .with_context(|| format!("cannot connect to {addr}"))?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let mut resets = shared.resets.subscribe();
    let reset = {
        let (client_r, client_w) = client.split();
        let (server_r, server_w) = server.split();
        tokio::select! {
            r = async {
                tokio::try_join!(
                    pipe(client_r, server_w, shared.faults.subscribe()),
                    pipe(server_r, client_w, shared.faults.subscribe()),
                )
            } => {
                r?;
                false
            }
            _ = resets.changed() => true,
        }
    };
    if reset {
        // A zero linger makes the close send RST rather than FIN, on both sides.
        client.set_zero_linger()?;
        server.set_zero_linger()?;
    }
    Ok(())
}

/// Copies one direction, each chunk held until its delay has passed and then paced to the
/// bandwidth cap; ends after passing on the end of the stream.
async fn pipe(
    mut from: ReadHalf<'_>,
    mut to: WriteHalf<'_>,
    faults: watch::Receiver<Faults>,
) -> std::io::Result<()> {
    let (tx, mut rx) = mpsc::channel::<(Instant, Bytes)>(QUEUE);
    let read_faults = faults.clone();
    let read = async move {
        let mut last_due = Instant::now();
        loop {
            let mut buf = BytesMut::with_capacity(CHUNK);
            if from.read_buf(&mut buf).await? == 0 {
                return Ok::<_, std::io::Error>(());
            }
            let f = *read_faults.borrow();
            if f.blackhole {
                continue;
            }
            // Never before the chunk ahead of it, so that jitter cannot reorder bytes.
            let due = (Instant::now() + f.delay()).max(last_due);
            last_due = due;
            if tx.send((due, buf.freeze())).await.is_err() {
                return Ok(());
            }
        }
    };
    let write = async move {
        let mut free_at = Instant::now();
        while let Some((due, data)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            let f = *faults.borrow();
            if f.blackhole {
                continue;
            }
            if f.bandwidth_bps == 0 {
                to.write_all(&data).await?;
                continue;
            }
            // Pieces of 20 ms each, so that the pace is smooth.
            let piece = (f.bandwidth_bps / 50).max(1) as usize;
            for part in data.chunks(piece) {
                tokio::time::sleep_until(free_at).await;
                to.write_all(part).await?;
                free_at = free_at.max(Instant::now())
                    + Duration::from_secs_f64(part.len() as f64 / f.bandwidth_bps as f64);
            }
        }
        to.shutdown().await
    };
    tokio::try_join!(read, write).map(drop)
}

async fn show(State(shared): State<Arc<Shared>>) -> Json<Faults> {
    Json(*shared.faults.borrow())
}

async fn set(
    State(shared): State<Arc<Shared>>,
    Json(faults): Json<Faults>,
) -> Result<Json<Faults>, (StatusCode, String)> {
    faults
        .validate()
        .map_err(|e| (StatusCode::BAD_REQUEST, e.to_string()))?;
    shared.faults.send_replace(faults);
    tracing::info!(?faults, "faults set");
    Ok(Json(faults))
}

async fn reset(State(shared): State<Arc<Shared>>) -> String {
    let open = shared.open.load(Ordering::Relaxed);
    shared.resets.send_modify(|n| *n += 1);
    tracing::info!(open, "resetting every open connection");
    format!("reset {open} connections\n")
}
