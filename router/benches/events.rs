//! The cache events a router absorbs, end to end, before its index lags. `TANDEM_EVENT_WORKERS`
//! workers (default 16) each publish through a real event hub (`tandem_worker::CacheHub`), served
//! as `Worker.CacheEvents` and `Worker.CacheSnapshot` on a loopback socket of its own; the
//! router's real index follows each over gRPC ([`CacheIndex::follow`]), as a router does. Each
//! event stores 16 blocks, and each worker evicts its oldest 16 past `TANDEM_EVENT_BLOCKS` blocks
//! (default 65,536: a million blocks indexed over 16 workers), so the sets stay at their size.
//!
//! Offered rates rise from 25,000 events a second; each runs for 3 s. For each the bench prints
//! the rate published, the rate the indexes applied, the most events any index was behind its
//! hub (sampled every 50 ms; the router's `tandem_router_index_events_behind`), that as time at
//! the offered rate, whether any stream fell 4,096 events behind (the worker then drops it and the
//! index resyncs from a snapshot, as `seconds_since_sync` shows), and the router's CPU per event.
//!
//! The router's side runs on a runtime of one thread, the workers' on another, so on a 2-core
//! machine the router has one core and the publishers the other; where the published rate falls
//! short of the offered one, the publishers are the bound, not the router.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_engine::CacheEvent;
use tandem_proto::v1 as pb;
use tandem_router::simulation::{CacheIndex, Mode};
use tandem_worker::CacheHub;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

const BLOCKS_PER_EVENT: u64 = 16;
const RATES: &[u64] = &[25_000, 50_000, 100_000, 200_000, 400_000, 800_000];

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).map_or(default, |v| v.parse().expect("a count"))
}

/// A worker's `Worker` service with its cache events and snapshot only: what a router's index
/// calls. The rest is a worker's business the bench does not need.
struct Events {
    hub: Arc<CacheHub>,
    stop: CancellationToken,
}

fn unneeded<T>() -> Result<Response<T>, Status> {
    Err(Status::unimplemented(
        "the events bench serves cache events only",
    ))
}

#[tonic::async_trait]
impl pb::worker_server::Worker for Events {
    async fn info(
        &self,
        _: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        unneeded()
    }
    async fn load(
        &self,
        _: Request<pb::LoadRequest>,
    ) -> Result<Response<pb::LoadResponse>, Status> {
        unneeded()
    }
    type WatchLoadStream = futures::stream::Empty<Result<pb::LoadResponse, Status>>;
    async fn watch_load(
        &self,
        _: Request<pb::WatchLoadRequest>,
    ) -> Result<Response<Self::WatchLoadStream>, Status> {
        unneeded()
    }
    type CacheEventsStream = tandem_worker::EventStream;
    async fn cache_events(
        &self,
        _: Request<pb::CacheEventsRequest>,
    ) -> Result<Response<Self::CacheEventsStream>, Status> {
        Ok(Response::new(self.hub.events(self.stop.clone())))
    }
    async fn cache_snapshot(
        &self,
        _: Request<pb::CacheSnapshotRequest>,
    ) -> Result<Response<pb::CacheSnapshotResponse>, Status> {
        Ok(Response::new(self.hub.snapshot()))
    }
    async fn sessions(
        &self,
        _: Request<pb::SessionsRequest>,
    ) -> Result<Response<pb::SessionsResponse>, Status> {
        unneeded()
    }
    async fn adopt(
        &self,
        _: Request<pb::AdoptRequest>,
    ) -> Result<Response<pb::AdoptResponse>, Status> {
        unneeded()
    }
    async fn release(
        &self,
        _: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        unneeded()
    }
}

/// One worker's publishing side: its hub, and the batches it holds, oldest first.
struct Worker {
    hub: Arc<CacheHub>,
    held: std::collections::VecDeque<Vec<u64>>,
    next_hash: u64,
    max_batches: usize,
}

impl Worker {
    /// Stores 16 new blocks, evicting the oldest 16 past the bound: one or two events.
    fn churn(&mut self) -> u64 {
        let batch: Vec<u64> = (0..BLOCKS_PER_EVENT)
            .map(|_| {
                self.next_hash = self.next_hash.wrapping_mul(6_364_136_223_846_793_005) + 1;
                self.next_hash
            })
            .collect();
        self.held.push_back(batch.clone());
        let mut events = vec![CacheEvent::Stored(batch)];
        if self.held.len() > self.max_batches {
            events.extend(self.held.pop_front().map(CacheEvent::Evicted));
        }
        let n = events.len() as u64;
        self.hub.publish(events);
        n
    }
}

/// CPU seconds of this process's threads whose name starts with `prefix`.
fn thread_cpu(prefix: &str) -> f64 {
    let tick = 100.0; // USER_HZ on Linux
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    tasks
        .flatten()
        .filter_map(|t| {
            let stat = std::fs::read_to_string(t.path().join("stat")).ok()?;
            let (name, rest) = stat.split_once(" (")?.1.rsplit_once(") ")?;
            name.starts_with(prefix).then_some(())?;
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some((f[11].parse::<f64>().ok()? + f[12].parse::<f64>().ok()?) / tick)
        })
        .sum()
}

fn runtime(name: &str) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(name)
        .enable_all()
        .build()
        .expect("runtime")
}

fn main() {
    let workers = env("TANDEM_EVENT_WORKERS", 16) as usize;
    let blocks = env("TANDEM_EVENT_BLOCKS", 65_536);
    let seconds = env("TANDEM_EVENT_SECONDS", 3);
    let max_batches = (blocks / BLOCKS_PER_EVENT) as usize;
    let serving = runtime("events-worker");
    let routing = runtime("events-router");
    let stop = CancellationToken::new();

    // The workers, each filled to its bound before any router follows it.
    let mut publishers: Vec<Worker> = (0..workers)
        .map(|i| Worker {
            hub: Arc::new(CacheHub::new()),
            held: Default::default(),
            next_hash: i as u64 + 1,
            max_batches,
        })
        .collect();
    for w in &mut publishers {
        for _ in 0..max_batches {
            w.churn();
        }
    }
    let addrs: Vec<SocketAddr> = publishers
        .iter()
        .map(|w| {
            let hub = w.hub.clone();
            let stop = stop.clone();
            serving.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind");
                let addr = listener.local_addr().expect("addr");
                let service = pb::worker_server::WorkerServer::new(Events {
                    hub,
                    stop: stop.clone(),
                });
                tokio::spawn(
                    tonic::transport::Server::builder()
                        .add_service(service)
                        .serve_with_incoming_shutdown(
                            tokio_stream::wrappers::TcpListenerStream::new(listener),
                            stop.cancelled_owned(),
                        ),
                );
                addr
            })
        })
        .collect();

    // The router's indexes, following each worker.
    let indexes: Vec<Arc<CacheIndex>> = (0..workers)
        .map(|_| Arc::new(CacheIndex::new(usize::MAX)))
        .collect();
    let _routing = routing.enter();
    for (index, addr) in indexes.iter().zip(&addrs) {
        let index = index.clone();
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("endpoint")
            .connect_lazy();
        routing.spawn(async move { index.follow(channel).await });
    }
    let caught_up = |publishers: &[Worker]| {
        publishers.iter().zip(&indexes).all(|(w, index)| {
            index.observe_report(w.hub.epoch(), w.hub.seq());
            let f = index.freshness();
            f.mode == Mode::Exact && f.events_behind == 0
        })
    };
    let started = Instant::now();
    while !caught_up(&publishers) {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the indexes never synced"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    println!(
        "{workers} workers, {} blocks indexed in all, {BLOCKS_PER_EVENT} blocks per event",
        indexes.iter().map(|i| i.freshness().blocks).sum::<usize>()
    );
    println!("offered/s  published/s  applied/s  most behind  as time  resynced  router CPU/event");

    for &rate in RATES {
        let seq0: u64 = publishers.iter().map(|w| w.hub.seq()).sum();
        let cpu0 = thread_cpu("events-router");
        let mut resynced = false;
        let mut behind = 0u64;
        let window = Duration::from_secs(seconds);
        let started = Instant::now();
        let mut last_sample = started;
        let mut sent = 0u64;
        let mut next = 0usize;
        // Paced by the clock: publish what the rate owes so far, round robin over the workers.
        while started.elapsed() < window {
            let owed = (started.elapsed().as_secs_f64() * rate as f64) as u64;
            while sent < owed {
                sent += publishers[next].churn();
                next = (next + 1) % workers;
            }
            if last_sample.elapsed() >= Duration::from_millis(50) {
                last_sample = Instant::now();
                for (w, index) in publishers.iter().zip(&indexes) {
                    index.observe_report(w.hub.epoch(), w.hub.seq());
                    let f = index.freshness();
                    behind = behind.max(f.events_behind);
                    if f.mode != Mode::Exact {
                        resynced = true;
                    }
                }
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let published_for = started.elapsed();
        while !caught_up(&publishers) {
            if started.elapsed() > window * 10 {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let applied_for = started.elapsed();
        let events = publishers.iter().map(|w| w.hub.seq()).sum::<u64>() - seq0;
        let cpu = thread_cpu("events-router") - cpu0;
        println!(
            "{rate:>10}  {:>11.0}  {:>9.0}  {behind:>11}  {:>5.0} ms  {:>8}  {:>12.2} µs",
            events as f64 / published_for.as_secs_f64(),
            events as f64 / applied_for.as_secs_f64(),
            behind as f64 / rate as f64 * 1000.0,
            if resynced { "yes" } else { "no" },
            cpu / events as f64 * 1e6,
        );
    }
    stop.cancel();
}
