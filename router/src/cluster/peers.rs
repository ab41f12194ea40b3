//! The other routers over the same workers, and what this router knows of each: N routers behind
//! any load balancer route alike because they share what one router alone would know.
//!
//! ```text
//! every `interval`, to each peer: Peer.State{since} ─▶ its sessions changed since (or all),
//!                                                      its requests on each worker,
//!                                                      its generations under a client's id
//!   sessions ─▶ Sessions::learn           load ─▶ Replica::set_peer_inflight (summed)
//!   running  ─▶ a retry of one of them attaches there (Peer.Attach)
//! ```
//!
//! Each router follows every worker's cache events itself, so the index needs no exchange.
//! Peers are found as workers are: `host:port` specs, names resolved every
//! [`RESOLVE_INTERVAL`] (a compose service, a Kubernetes headless Service); a router that finds
//! itself among them (its own instance id comes back) leaves that address out. A peer's state
//! is as old as its last answer: `tandem_router_peer_staleness_seconds{peer}`. One silent for
//! [`FORGET_AFTER`] (or restarted: a new instance id) is forgotten: its load and running
//! generations no longer count, and its sessions become this router's, whose clocks then run
//! here.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tandem_proto::v1 as pb;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::transport::{Channel, ClientTlsConfig};

use crate::cluster::discovery::{RESOLVE_INTERVAL, Specs};
use crate::cluster::replica::LIVENESS_TIMEOUT;
use crate::cluster::replicas::Replicas;
use crate::cluster::sessions::Sessions;
use crate::error::Result;
use crate::metrics::{PeerLabel, RouterMetrics};

/// How long a peer may be silent before its state is forgotten.
pub const FORGET_AFTER: Duration = Duration::from_secs(5);

/// A generation's key: the tenant and the client's request id.
pub type RunningKey = (Arc<str>, String);

#[derive(Debug)]
struct View {
    channel: Channel,
    /// Its instance id, once it has answered; 0 before.
    instance: u64,
    /// Its change sequence this view is up to.
    seq: u64,
    /// When it last answered, or when it was found.
    heard: Instant,
    /// Its requests and prompt tokens on each worker, by address.
    load: HashMap<String, (u32, u64)>,
    running: HashSet<RunningKey>,
    /// This router's own address.
    is_self: bool,
}

impl View {
    fn new(channel: Channel) -> Self {
        Self {
            channel,
            instance: 0,
            seq: 0,
            heard: Instant::now(),
            load: HashMap::new(),
            running: HashSet::new(),
            is_self: false,
        }
    }
}

/// This router's peers.
#[derive(Debug)]
pub struct Peers {
    /// This router's instance id, random at its start.
    pub instance: u64,
    specs: Option<Specs>,
    tls: Option<ClientTlsConfig>,
    views: Mutex<BTreeMap<SocketAddr, View>>,
    metrics: RouterMetrics,
}

impl Peers {
    /// The peers `specs` name (none: a router on its own), dialled with `tls`.
    pub fn new(
        specs: &[String],
        tls: Option<ClientTlsConfig>,
        metrics: RouterMetrics,
    ) -> Result<Self> {
        Ok(Self {
            instance: rand::random::<u64>().max(1),
            specs: (!specs.is_empty())
                .then(|| Specs::parse(specs))
                .transpose()?,
            tls,
            views: Mutex::default(),
            metrics,
        })
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<SocketAddr, View>> {
        // Whole-view updates only; a poisoned lock is still consistent.
        self.views.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The peer running `key`'s generation, as of its last answer.
    pub fn running_on(&self, key: &RunningKey) -> Option<Channel> {
        let views = self.lock();
        let view = views.values().find(|v| v.running.contains(key))?;
        Some(view.channel.clone())
    }

    /// Asks every peer for its state every `interval` until `cancel`.
    pub fn start(
        self: &Arc<Self>,
        sessions: Arc<Sessions>,
        replicas: Arc<Replicas>,
        interval: Duration,
        tracker: &TaskTracker,
        cancel: CancellationToken,
    ) {
        if self.specs.is_none() {
            return;
        }
        tracing::info!(instance = self.instance, "sharing state with peer routers");
        let peers = self.clone();
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut resolved: Option<Instant> = None;
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = cancel.cancelled() => return,
                }
                if resolved.is_none_or(|at| at.elapsed() >= RESOLVE_INTERVAL) {
                    peers.follow(&sessions).await;
                    resolved = Some(Instant::now());
                }
                peers.ask_all(&sessions).await;
                peers.apply_load(&replicas);
            }
        });
    }

    /// Makes the views exactly the specs' addresses now.
    async fn follow(&self, sessions: &Sessions) {
        let Some(specs) = &self.specs else {
            return;
        };
        // A failed lookup keeps the peers as they are.
        let Some(addrs) = specs.addresses().await else {
            return;
        };
        let mut views = self.lock();
        let gone: Vec<SocketAddr> = (views.keys())
            .filter(|a| !addrs.contains(a))
            .copied()
            .collect();
        for addr in gone {
            views.remove(&addr);
            self.forget(&addr, sessions);
        }
        for addr in addrs {
            if views.contains_key(&addr) {
                continue;
            }
            let tls = self.tls.clone();
            match tandem_net::channel(&addr.to_string(), tls) {
                Ok(channel) => {
                    views.insert(addr, View::new(channel));
                }
                Err(e) => tracing::warn!(peer = %addr, error = %e, "cannot dial a peer router"),
            }
        }
    }

    /// Drops what `addr`'s router said, and adopts its sessions.
    fn forget(&self, addr: &SocketAddr, sessions: &Sessions) {
        let name = addr.to_string();
        sessions.adopt(&name);
        let _ = self
            .metrics
            .peer_staleness
            .remove(&PeerLabel { peer: name });
    }

    async fn ask_all(&self, sessions: &Sessions) {
        let asks: Vec<(SocketAddr, Channel, u64, u64)> = (self.lock().iter())
            .filter(|(_, v)| !v.is_self)
            .map(|(a, v)| (*a, v.channel.clone(), v.instance, v.seq))
            .collect();
        let answers = futures::future::join_all(asks.into_iter().map(
            |(addr, channel, instance, since)| async move {
                let mut client = tandem_proto::limits!(pb::peer_client::PeerClient::new(channel));
                let mut ask = tonic::Request::new(pb::StateRequest {
                    asker: self.instance,
                    instance,
                    since,
                });
                ask.set_timeout(LIVENESS_TIMEOUT);
                (
                    addr,
                    client.state(ask).await.map(tonic::Response::into_inner),
                )
            },
        ))
        .await;
        let now = Instant::now();
        let mut views = self.lock();
        for (addr, answer) in answers {
            let Some(view) = views.get_mut(&addr) else {
                continue;
            };
            let name: Arc<str> = addr.to_string().into();
            match answer {
                Ok(mut state) => {
                    if view.instance != 0 && view.instance != state.instance {
                        tracing::info!(peer = %addr, "a peer router restarted");
                        sessions.adopt(&name);
                    }
                    view.instance = state.instance;
                    view.seq = state.seq;
                    view.heard = now;
                    view.load = (std::mem::take(&mut state.load).into_iter())
                        .map(|l| (l.addr, (l.requests, l.prompt_tokens)))
                        .collect();
                    view.running = (std::mem::take(&mut state.running).into_iter())
                        .map(|k| (Arc::from(k.tenant), k.request_id))
                        .collect();
                    sessions.learn(&name, state.into());
                }
                Err(e) if e.code() == tonic::Code::FailedPrecondition => {
                    tracing::info!(peer = %addr, "this router's own address: not a peer");
                    view.is_self = true;
                    continue;
                }
                Err(e) => {
                    tracing::debug!(peer = %addr, error = %e, "a peer router did not answer");
                    let silent = now.saturating_duration_since(view.heard);
                    if silent >= FORGET_AFTER && view.instance != 0 {
                        tracing::warn!(peer = %addr, silent_ms = silent.as_millis() as u64, "forgetting a silent peer router's state");
                        view.instance = 0;
                        view.seq = 0;
                        view.load.clear();
                        view.running.clear();
                        sessions.adopt(&name);
                    }
                }
            }
            let staleness = now.saturating_duration_since(view.heard).as_secs_f64();
            (self.metrics.peer_staleness)
                .get_or_create(&PeerLabel {
                    peer: name.to_string(),
                })
                .set(staleness);
        }
    }

    /// Sets every replica's peer load to the sum of what the peers said.
    fn apply_load(&self, replicas: &Replicas) {
        let mut sums: HashMap<&str, (u32, u64)> = HashMap::new();
        let views = self.lock();
        for (addr, (requests, tokens)) in views.values().flat_map(|v| &v.load) {
            let sum = sums.entry(addr.as_str()).or_default();
            *sum = (
                sum.0.saturating_add(*requests),
                sum.1.saturating_add(*tokens),
            );
        }
        for r in replicas.all() {
            let (requests, tokens) = sums.get(r.addr.as_str()).copied().unwrap_or_default();
            r.set_peer_inflight(requests, tokens);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::replica::Role;
    use crate::cluster::sessions::Changes;

    /// A peer that stops answering keeps its word for [`FORGET_AFTER`], its staleness growing;
    /// then its load and running generations no longer count and its sessions are adopted.
    #[tokio::test(start_paused = true)]
    async fn a_silent_peer_is_forgotten_and_its_sessions_adopted() {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = RouterMetrics::register(&mut registry);
        let sessions = Sessions::new(crate::config::SessionConfig::default(), metrics.clone());
        let peers = Peers::new(&[], None, metrics.clone()).expect("peers");
        // Nothing listens there: every ask fails.
        let gone = "127.0.0.1:1";
        let key: RunningKey = ("t".into(), "r".into());
        let mut view = View::new(tandem_net::channel(gone, None).expect("channel"));
        view.instance = 7;
        view.load = [("10.0.0.9:1".to_string(), (3, 30))].into();
        view.running = [key.clone()].into();
        peers.lock().insert(gone.parse().expect("addr"), view);
        let theirs = Changes {
            seq: 1,
            full: true,
            sessions: vec![pb::PeerSession {
                key: Some(pb::SessionKey {
                    tenant: "t".into(),
                    session_id: "s".into(),
                }),
                idle_ms: 0,
                sequence: Some(pb::CachedSession::default()),
                on_disk: false,
            }],
            ended: Vec::new(),
        };
        sessions.learn(&Arc::from(gone), theirs);
        let since = sessions.changes(0).seq;
        let staleness = || {
            (metrics.peer_staleness)
                .get_or_create(&PeerLabel { peer: gone.into() })
                .get()
        };

        tokio::time::advance(FORGET_AFTER / 2).await;
        peers.ask_all(&sessions).await;
        assert!(peers.running_on(&key).is_some(), "its word still holds");
        assert!(staleness() >= (FORGET_AFTER / 2).as_secs_f64());
        assert!(
            sessions.changes(since).sessions.is_empty(),
            "still its sessions"
        );

        tokio::time::advance(FORGET_AFTER / 2).await;
        peers.ask_all(&sessions).await;
        assert!(peers.running_on(&key).is_none(), "forgotten");
        assert!(peers.lock().values().all(|v| v.load.is_empty()));
        assert!(staleness() >= FORGET_AFTER.as_secs_f64());
        let adopted = sessions.changes(since);
        assert_eq!(
            adopted.sessions.len(),
            1,
            "its session is this router's now"
        );
    }

    /// What the peers have in flight on a worker adds to this router's own, for the policy's
    /// load and queued prompt tokens; a worker no peer names gets 0.
    #[tokio::test]
    async fn the_peers_loads_add_to_this_routers() {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = RouterMetrics::register(&mut registry);
        let replicas = Arc::new(Replicas::new(16, CancellationToken::new()));
        for addr in ["10.0.0.9:1", "10.0.0.8:1"] {
            replicas.add(Role::Decode, addr, addr).expect("add");
        }
        let peers = Peers::new(&[], None, metrics).expect("peers");
        for (peer, requests) in [("10.0.0.1:7", 2), ("10.0.0.2:7", 3)] {
            let mut view = View::new(tandem_net::channel(peer, None).expect("channel"));
            view.load = [("10.0.0.9:1".to_string(), (requests, 100))].into();
            peers.lock().insert(peer.parse().expect("addr"), view);
        }
        peers.apply_load(&replicas);
        let all = replicas.all();
        let busy = all.iter().find(|r| r.addr == "10.0.0.9:1").expect("busy");
        let _own = busy.claim(10, tandem_proto::policy::Class::Standard);
        assert_eq!(
            busy.load(),
            6,
            "one of this router's and five of its peers'"
        );
        assert_eq!(busy.queued_tokens(), 210);
        assert_eq!(busy.inflight(), 1, "this router's own stay its own");
        let idle = all.iter().find(|r| r.addr == "10.0.0.8:1").expect("idle");
        assert_eq!(idle.load(), 0);
    }
}
