//! Routing without a network, for the benchmarks in `benches/routing.rs`: a replica set whose
//! health and cache contents are set directly, and the policy's decision on it, exactly as a
//! request would meet them (block hashes of the prompt, then [`Policy::choose`]). And a router's
//! table of agent sessions, for the peer exchange's benchmark in `benches/peers.rs`
//! ([`SessionTable`]). And the index of one worker's cache ([`CacheIndex`]), which
//! `benches/events.rs` has follow real event streams.

use std::sync::Arc;

use prost::Message;
use tandem_proto::v1 as pb;
use tokio_util::sync::CancellationToken;

pub use crate::cluster::index::{CacheIndex, Freshness, Mode};
use crate::cluster::policy::{Ask, Policy};
use crate::cluster::replica::Role;
use crate::cluster::replicas::Replicas;
use crate::cluster::sessions::{Sessions, Turn};
use crate::config::{PolicyKind, SessionConfig};
use crate::metrics::RouterMetrics;

/// A replica set that is never connected to.
#[derive(Debug)]
pub struct Simulation {
    replicas: Arc<Replicas>,
    policy: Policy,
    fingerprint: Vec<u8>,
}

impl Simulation {
    /// `prefill` then `decode` replicas, all healthy, with empty caches. Call it inside a tokio
    /// runtime (the replicas' channels are created, lazily).
    pub fn new(prefill: usize, decode: usize) -> Result<Self, tonic::transport::Error> {
        let replicas = Arc::new(Replicas::new(usize::MAX, CancellationToken::new()));
        for i in 0..prefill + decode {
            let role = if i < prefill {
                Role::Prefill
            } else {
                Role::Decode
            };
            let addr = Self::addr(i);
            replicas.add(role, &addr, &addr)?;
        }
        for (i, r) in replicas.all().iter().enumerate() {
            r.set_healthy(true);
            r.index.apply_snapshot(pb::CacheSnapshotResponse {
                epoch: 1 + i as u64,
                seq: 0,
                ..Default::default()
            });
        }
        Ok(Self {
            replicas,
            policy: Policy::new(PolicyKind::Affinity, Default::default()),
            fingerprint: vec![7; 32],
        })
    }

    /// The block hashes of `tokens`, as the router computes them for a prompt.
    pub fn hashes(&self, tokens: &[u32]) -> Vec<u64> {
        tandem_proto::block_hash::block_hashes(&self.fingerprint, "", tokens)
            .into_iter()
            .map(|h| h.0)
            .collect()
    }

    /// The address of replica `i` (prefill replicas first).
    pub fn addr(i: usize) -> String {
        format!("127.0.0.1:{}", 1 + i)
    }

    /// Replica `i` (prefill replicas first) now holds exactly `hashes`.
    pub fn hold(&self, i: usize, hashes: Vec<u64>) {
        if let Some(r) = self.replicas.all().get(i) {
            r.index.apply_snapshot(pb::CacheSnapshotResponse {
                epoch: 1 + i as u64,
                seq: 0,
                hashes,
                ..Default::default()
            });
        }
    }

    /// Applies cache events to replica `i`'s index in order, as following its worker's stream
    /// does (replica `i`'s epoch is `1 + i`, and [`Simulation::hold`] leaves it at sequence 0),
    /// up to the first that breaks the sequence (a gap or another epoch: the index would
    /// resync). Returns how many applied.
    pub fn apply(&self, i: usize, events: impl IntoIterator<Item = pb::CacheEvent>) -> usize {
        let Some(r) = self.replicas.all().get(i).cloned() else {
            return 0;
        };
        let mut applied = 0;
        for e in events {
            if r.index.apply(e).is_err() {
                break;
            }
            applied += 1;
        }
        applied
    }

    /// The block hashes of a prompt's reusable blocks, as the router computes them before it
    /// routes.
    pub fn prompt_hashes(&self, tokens: &[u32]) -> Vec<u64> {
        tandem_proto::block_hash::prompt_hashes(&self.fingerprint, "", tokens)
    }

    /// Routes a prompt of `tokens` tokens whose reusable blocks hash to `hashes`
    /// ([`Simulation::prompt_hashes`]). Returns the decode replica's address and the tokens the
    /// index says it holds.
    pub fn route(&self, tokens: usize, hashes: &[u64], session: &str) -> Option<(String, usize)> {
        let choice = self
            .policy
            .choose(
                &self.replicas,
                &Ask {
                    model: "",
                    tokens,
                    hashes,
                    session_id: session,
                    exclude: &[],
                    holder: None,
                    class: crate::auth::Class::Standard,
                },
            )
            .ok()?;
        Some((choice.decode.replica().addr.clone(), choice.decode_overlap))
    }
}

/// A router's table of agent sessions: turns recorded as the dispatch records them, and the
/// sessions of a `Peer.State` answer as a peer asks for them and takes them in.
#[derive(Debug)]
pub struct SessionTable {
    sessions: Sessions,
}

impl SessionTable {
    /// An empty table whose tenants may each keep `per_key` sessions open.
    pub fn new(per_key: usize) -> Self {
        let mut registry = prometheus_client::registry::Registry::default();
        let config = SessionConfig {
            per_key,
            ..SessionConfig::default()
        };
        Self {
            sessions: Sessions::new(config, RouterMetrics::register(&mut registry)),
        }
    }

    /// Records a completed turn of `tenant`'s session `id`: its prompt and the reply.
    pub fn turn(&self, tenant: &Arc<str>, id: &str, prompt: &[u32], reply: &[u32]) {
        let _ended = self.sessions.turn(Turn {
            tenant,
            session_id: id,
            cache_salt: "",
            prompt,
            reply,
            cached: 0,
            restored: 0,
        });
    }

    /// What `Peer.State` answers a peer that is up to change `since` (0: the whole table), as
    /// wire bytes (its sessions and ended sessions; the load and running generations aside),
    /// and the change the peer is then up to.
    pub fn answer(&self, since: u64) -> (u64, Vec<u8>) {
        let c = self.sessions.changes(since);
        (c.seq, pb::StateResponse::from(c).encode_to_vec())
    }

    /// Takes in what `peer` answered ([`SessionTable::answer`]); false if the bytes are not an
    /// answer.
    pub fn learn(&self, peer: &Arc<str>, answer: &[u8]) -> bool {
        let Ok(r) = pb::StateResponse::decode(answer) else {
            return false;
        };
        self.sessions.learn(peer, r.into());
        true
    }

    /// Sessions open in the table, its own and its peers'.
    pub fn open_sessions(&self) -> usize {
        self.sessions.open_sessions()
    }
}
