//! The routing policy: one formula that picks the decode replica, and either a prefill replica
//! (remote prefill, KV pushed to decode) or none (the decode node prefills the uncached suffix
//! itself: conditional disaggregation).
//!
//! For a prompt of `n` tokens, with `held(r)` the tokens of its leading full blocks that the
//! router's index says replica `r` holds (0 unless the index is exact), in its KV pool and then
//! on its disk tier, `disk(r)` those of them on disk only, `rate(r)` the replica's measured
//! prompt throughput (before any measurement, the mean of the others'; before any at all,
//! [`DEFAULT_RATE`]) and `restore(r)` its disk tier's measured read speed
//! ([`DEFAULT_RESTORE_RATE`] before it has one), the estimated time to first token of each
//! option is, in ms:
//!
//! ```text
//! remote(P, D) = ahead(P) / rate(P)                 // P's queue: its prompts of the request's class and above
//!              + step(P) / rate(P)                   // half a batch yield step (BATCH_YIELD_TOKENS) if a lower class is there
//!              + (n − held(P)) / rate(P)             // P computes what its prefix cache lacks
//!              + disk(P) / restore(P)                // and reads back what is on its disk
//!              + handoff_remote                      // measured: the push's exposed tail, the hops
//! local(D)     = (n − held(D)) / rate(D) × (1 + active(D))
//!              + disk(D) / restore(D)
//!              + handoff_local                       // measured: the hops, waiting for a step
//!                only where held(D) > 0, or when no prefill replica is up
//! ```
//!
//! A local prefill may also start from KV fetched from a worker H that the request cannot go to
//! in its role (it failed the request, is over the load cap, or drains) but that still serves
//! fetches: a decode node's session cache or a prefill node's prefix cache that holds
//! `held(H) > held(D)` tokens of the prompt, by the index or by the word of a decode node that
//! handed this request's stream off:
//!
//! ```text
//! fetch(D, H)  = (held(H) × kv_bytes_per_token / link + disk(H) / restore(H))
//!                × (1 + load(H))                     // H serves between steps; 0 while it drains
//!              + local(D) with held(H) for held(D)
//! ```
//!
//! where `link` is the moving average of measured fetches ([`DEFAULT_LINK_BYTES_PER_SECOND`]
//! before the first). The decode node then fetches before its lookup; a failed fetch only means
//! those tokens are computed.
//!
//! A local prefill pauses D's batch for its duration: the `1 + active(D)` charges it once for
//! this request and once for each stream D is running. Only a prompt that extends what D
//! already holds may be prefilled there: a cold prompt always goes to a prefill node (that is
//! what disaggregation is for), and a follow-up turn whose history D holds is prefilled on D
//! when its new suffix costs less there, stalls included, than on P (which lacks at least the
//! last reply). The handoffs are moving averages of what the router measured on earlier
//! requests of the same priority class (first token time minus the router's queue, the prefill
//! node's queue and yields, and the compute; before a class's first, the other classes'); the
//! link's throughput shows up in `handoff_remote`.
//!
//! The cheapest option wins. Candidates are only the healthy replicas that have not already
//! failed this request (failover, see [`crate::dispatch::progress`]) under a per-candidate load
//! cap (bounded-load consistent hashing, Mirrokni et al.): a replica is eligible while its
//! requests are fewer than `ceil(1.25 × (total + 1) / replicas)` of its role (for decode, at
//! least [`DECODE_LOAD_FLOOR`]), and below its reported capacity. A hot session therefore moves
//! once its replica is over the cap, and the formula, not a fallback, says where. The decode
//! floor keeps a large, lightly loaded fleet from moving sessions for nothing: 16 requests over
//! 192 decode nodes make the bare cap 1, so a follow-up whose node ran one other stream would
//! leave the KV of its history behind to spare that node a second row in its steps. Ties break
//! deterministically: for decode, more KV held, then rendezvous hashing on the session id (or,
//! without one, on the prompt's first block hash), then lower load, then address; for prefill,
//! rendezvous, load, address. So when the index knows nothing (a router restart), a session
//! still lands where its conversation was.

use std::cell::Cell;
use std::collections::HashSet;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tandem_proto::BATCH_YIELD_TOKENS;
use tandem_proto::block_hash::BLOCK_TOKENS;
use tandem_proto::policy::Class;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::cluster::handoffs::Handoffs;
use crate::cluster::replica::{InflightGuard, Replica, Role, mean_prefill_rate};
use crate::cluster::replicas::Replicas;
use crate::config::{PipelineConfig, PolicyKind};
use crate::error::{Error, Result};

/// Prompt tokens per second assumed before any replica has measured its own.
pub const DEFAULT_RATE: f64 = 500.0;
/// The load cap's factor: eligible while load < ceil(LOAD_CAP × (total + 1) / replicas).
pub const LOAD_CAP: f64 = 1.25;
/// The least load cap of a decode replica: a decode node batches its streams, and a few more
/// rows cost each step little beside computing a session's history again elsewhere.
pub const DECODE_LOAD_FLOOR: u32 = 4;
/// Bytes per second a peer fetch is assumed to move before one has been measured.
pub const DEFAULT_LINK_BYTES_PER_SECOND: f64 = 200e6;
/// Tokens per second a disk tier is assumed to read back before it has measured its own (a
/// block of 16 tokens from the page cache or an SSD takes well under a millisecond).
pub const DEFAULT_RESTORE_RATE: f64 = 50_000.0;

/// What one request brings to the policy.
#[derive(Debug)]
pub struct Ask<'a> {
    /// The model it runs on: only that model's replicas serve it.
    pub model: &'a str,
    pub tokens: usize,
    /// Block hashes of the prompt's reusable full blocks.
    pub hashes: &'a [u64],
    pub session_id: &'a str,
    /// Replicas (by address) that already failed this request.
    pub exclude: &'a [String],
    /// A replica that holds the prompt's first tokens whatever the index says (a draining node
    /// that handed this request's stream off): its address and the tokens.
    pub holder: Option<(&'a str, usize)>,
    /// Its priority class: a prefill node's prompts of lower classes yield to
    /// it, so only those of its class and above are ahead of it.
    pub class: Class,
}

/// The replicas chosen for one request, each counted as in flight while the guard lives.
#[derive(Debug)]
pub struct Choice {
    pub decode: InflightGuard,
    /// `None`: the decode node prefills locally.
    pub prefill: Option<InflightGuard>,
    /// Tokens the index said each chosen replica holds.
    pub decode_overlap: usize,
    pub prefill_overlap: usize,
    pub reason: String,
    /// Peer fetch: the decode node first fetches the prompt's first tokens' KV from this
    /// replica (its address and the tokens).
    pub fetch: Option<(String, usize)>,
    /// The option's estimated time to first token, in ms (the formula above); `None` where
    /// no formula chose (round robin, the last resort).
    pub est_ms: Option<f64>,
    /// Of that estimate, a hand-off borrowed from another class ([`Handoffs::of`]); 0 where the
    /// request's class measured its own.
    pub borrowed_ms: f64,
    /// A pipelined prefill's stages before `prefill`, each claimed, with the end of its part
    /// of the prompt ([`pipeline`]); empty when one node computes it.
    pub pipeline: Vec<(InflightGuard, usize)>,
}

impl Choice {
    /// Whether the chosen replicas' last load reports are at most `age` old (the figures its
    /// estimate is made of are fresh).
    pub fn reported_within(&self, age: Duration) -> bool {
        let fresh = |r: &Replica| r.report_age().is_some_and(|a| a <= age);
        fresh(self.decode.replica()) && (self.prefill.as_ref()).is_none_or(|p| fresh(p.replica()))
    }
}

#[derive(Debug, Default)]
pub struct Policy {
    kind: PolicyKind,
    pipeline: PipelineConfig,
    next: AtomicUsize,
    handoffs: Mutex<Handoffs>,
}

/// Rendezvous (highest random weight) score of the place named `name` for `key`: each key's
/// places ranked by it move only as places come and go.
pub(crate) fn rendezvous_score(key: &[u8], name: &[u8]) -> u64 {
    xxh3_64_with_seed(name, xxhash_rust::xxh3::xxh3_64(key))
}

/// Rendezvous score of `replica` for `key`.
fn rendezvous(key: &[u8], replica: &Replica) -> u64 {
    rendezvous_score(key, replica.addr.as_bytes())
}

/// The healthy replicas of `role` serving the request's model that have not failed it.
pub(crate) fn candidates(replicas: &Replicas, role: Role, ask: &Ask<'_>) -> Vec<Arc<Replica>> {
    let mut up = replicas.up(role, ask.model);
    up.retain(|r| !ask.exclude.contains(&r.addr));
    up
}

/// Candidates of `role` under the load cap (all of them if none is under it).
fn eligible(replicas: &Replicas, role: Role, ask: &Ask<'_>) -> Vec<Arc<Replica>> {
    let up = candidates(replicas, role, ask);
    if up.is_empty() {
        return up;
    }
    let total: u32 = up.iter().map(|r| r.load()).sum();
    let floor = match role {
        Role::Decode => DECODE_LOAD_FLOOR,
        Role::Prefill => 1,
    };
    let cap = ((LOAD_CAP * f64::from(total + 1) / up.len() as f64).ceil() as u32).max(floor);
    let under: Vec<Arc<Replica>> = up
        .iter()
        .filter(|r| r.load() < cap && (r.capacity() == 0 || r.load() < r.capacity()))
        .cloned()
        .collect();
    if under.is_empty() { up } else { under }
}

impl Policy {
    pub fn new(kind: PolicyKind, pipeline: PipelineConfig) -> Self {
        Self {
            kind,
            pipeline,
            ..Self::default()
        }
    }

    fn handoffs(&self) -> std::sync::MutexGuard<'_, Handoffs> {
        // Single float updates; a poisoned lock is still consistent.
        self.handoffs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Folds in a measured handoff of a request of `class`: first-token time minus queue and
    /// compute, in ms.
    pub fn record_handoff(&self, local: bool, class: Class, ms: f64) {
        self.handoffs().record(local, class, ms);
    }

    /// Folds in a measured peer fetch: `bytes` in `ms`.
    pub fn record_fetch(&self, bytes: u64, ms: f64) {
        self.handoffs().record_fetch(bytes, ms);
    }

    pub fn choose(&self, replicas: &Replicas, ask: &Ask<'_>) -> Result<Choice> {
        match self.kind {
            PolicyKind::Affinity => self.affinity(replicas, ask),
            PolicyKind::RoundRobin => self.round_robin(replicas, ask),
        }
    }

    fn round_robin(&self, replicas: &Replicas, ask: &Ask<'_>) -> Result<Choice> {
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        let pick = |role: Role| {
            let up = candidates(replicas, role, ask);
            (!up.is_empty()).then(|| up[turn % up.len()].clone())
        };
        let decode = pick(Role::Decode).ok_or(Error::NoReplica { role: "decode" })?;
        let prefill = pick(Role::Prefill).ok_or(Error::NoReplica { role: "prefill" })?;
        Ok(Choice {
            decode: decode.claim(0, ask.class),
            prefill: Some(prefill.claim(ask.tokens as u64, ask.class)),
            decode_overlap: 0,
            prefill_overlap: 0,
            reason: "round-robin".into(),
            fetch: None,
            est_ms: None,
            borrowed_ms: 0.0,
            pipeline: Vec::new(),
        })
    }

    fn affinity(&self, replicas: &Replicas, ask: &Ask<'_>) -> Result<Choice> {
        let decodes = eligible(replicas, Role::Decode, ask);
        let decodes: Vec<&Arc<Replica>> = decodes.iter().collect();
        if decodes.is_empty() {
            return Err(Error::NoReplica { role: "decode" });
        }
        let prefills = eligible(replicas, Role::Prefill, ask);
        let prefills: Vec<&Arc<Replica>> = prefills.iter().collect();
        let all = replicas.all();
        let fallback_rate =
            mean_prefill_rate(all.iter().filter(|r| r.serves(ask.model))).unwrap_or(DEFAULT_RATE);
        let rate = |r: &Replica| r.prefill_rate_or(fallback_rate);
        let key: Vec<u8> = if ask.session_id.is_empty() {
            ask.hashes
                .first()
                .map_or_else(Vec::new, |h| h.to_le_bytes().to_vec())
        } else {
            ask.session_id.as_bytes().to_vec()
        };
        let ((h_remote, remote_borrowed_ms), (h_local, local_borrowed_ms), link) = {
            let h = self.handoffs();
            let link = if h.link > 0.0 {
                h.link
            } else {
                DEFAULT_LINK_BYTES_PER_SECOND / 1e3
            };
            (h.of(false, ask.class), h.of(true, ask.class), link)
        };
        let n = ask.tokens as f64;
        // The tokens a replica holds by the index, and what reading those on its disk tier
        // back costs (ms): one index lookup per replica, hinted with where the last one
        // holding any of it ended.
        let hint = Cell::new(0);
        let held = |r: &Replica| {
            let o = r.index.overlap(ask.hashes, hint.get());
            if o.pool > 0 {
                hint.set(o.pool);
            }
            let disk = (o.disk * BLOCK_TOKENS) as f64;
            let read_ms = disk / r.restore_rate_or(DEFAULT_RESTORE_RATE) * 1e3;
            (o.blocks() * BLOCK_TOKENS, read_ms)
        };
        let holders = fetch_holders(&all, [&decodes, &prefills], ask, held);
        // A draining holder's streams are leaving it: nothing holds up its fetches.
        let fetch_ms = |from: &Replica, tokens: usize, read_ms: f64| {
            let busy = if from.is_draining() { 0 } else { from.load() };
            (tokens as f64 * from.kv_bytes_per_token() as f64 / link + read_ms)
                * f64::from(1 + busy)
        };

        // Decode candidates, best first for a remote prefill: most KV held, rendezvous, load.
        let mut d_ranked: Vec<(&Arc<Replica>, usize, f64, u64)> = decodes
            .iter()
            .map(|&d| {
                let (h, read_ms) = held(d);
                (d, h, read_ms, rendezvous(&key, d))
            })
            .collect();
        d_ranked.sort_by(|(a, ha, _, ra), (b, hb, _, rb)| {
            hb.cmp(ha)
                .then_with(|| rb.cmp(ra))
                .then_with(|| a.load().cmp(&b.load()))
                .then_with(|| a.addr.cmp(&b.addr))
        });
        // The best local option: on what D holds, or on what it fetches from a holder first.
        let local_ms = |d: &Replica, h: usize| {
            (n - h as f64) / rate(d) * 1e3 * f64::from(1 + d.load()) + h_local
        };
        let local = d_ranked
            .iter()
            .flat_map(|&(d, h, read_ms, _)| {
                let own =
                    (h > 0 || prefills.is_empty()).then(|| (local_ms(d, h) + read_ms, d, h, None));
                let fetched = holders.iter().filter(move |&&(_, fh, _)| fh > h).map(
                    move |&(from, fh, from_read_ms)| {
                        let f_ms = fetch_ms(from, fh, from_read_ms);
                        (f_ms + local_ms(d, fh), d, fh, Some((from, fh, f_ms)))
                    },
                );
                own.into_iter().chain(fetched)
            })
            .min_by(|a, b| a.0.total_cmp(&b.0));
        // The best remote option, with the best-ranked decode replica.
        let remote = best_prefill(&prefills, ask, &key, h_remote, held, rate);

        let go_local = match (&local, &remote) {
            (Some(l), Some(r)) => l.0 < r.0,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if go_local && let Some((l_ms, d, dh, fetch)) = local {
            let fetched = fetch.map_or_else(String::new, |(from, t, f_ms)| {
                format!(" (fetching {t} from {}: est. {f_ms:.1} ms)", from.addr)
            });
            let reason = match remote {
                Some((r_ms, p, ph)) => format!(
                    "local prefill on {}: holds {dh} of {} tokens{fetched}, est. {l_ms:.1} ms \
                         ({:.0} tok/s, {} active) < remote {r_ms:.1} ms via {} (holds {ph})",
                    d.addr,
                    ask.tokens,
                    rate(d),
                    d.load(),
                    p.addr
                ),
                None => format!(
                    "local prefill on {}: holds {dh} of {} tokens{fetched}; no prefill replica",
                    d.addr, ask.tokens
                ),
            };
            return Ok(Choice {
                decode: d.claim(0, ask.class),
                prefill: None,
                decode_overlap: dh,
                prefill_overlap: 0,
                reason,
                fetch: fetch.map(|(from, t, _)| (from.addr.clone(), t)),
                est_ms: Some(l_ms),
                borrowed_ms: local_borrowed_ms,
                pipeline: Vec::new(),
            });
        }
        let Some((r_ms, p, ph)) = remote else {
            return Err(Error::NoReplica { role: "prefill" });
        };
        let (d, dh, _, _) = d_ranked[0];
        let l_ms = local.map_or(f64::INFINITY, |l| l.0);
        let mut reason = format!(
            "remote prefill on {} (holds {ph} of {} tokens, {:.0} tok/s, {} queued), \
                     est. {r_ms:.1} ms <= local {l_ms:.1} ms; decode {} holds {dh}, load {}",
            p.addr,
            ask.tokens,
            rate(p),
            p.queued_tokens(),
            d.addr,
            d.load()
        );
        let stages = pipeline::stages(replicas, ask, &key, (p, ph), self.pipeline, &mut reason);
        let from = stages.last().map_or(ph, |(_, end)| *end);
        Ok(Choice {
            decode: d.claim(0, ask.class),
            prefill: Some(p.claim(ask.tokens.saturating_sub(from) as u64, ask.class)),
            decode_overlap: dh,
            prefill_overlap: ph,
            reason,
            fetch: None,
            est_ms: Some(r_ms),
            borrowed_ms: remote_borrowed_ms,
            pipeline: stages,
        })
    }
}

/// Who could serve a fetch of the prompt's first tokens, with how many and what reading them
/// from its disk tier costs (ms): only replicas the request cannot go to in their role
/// (`[decodes, prefills]`; failed it, over the load cap, draining), so that a session stays
/// where its KV is while it may, and a prompt is computed where its prefix is while it may.
fn fetch_holders<'a>(
    all: &'a [Arc<Replica>],
    [decodes, prefills]: [&[&Arc<Replica>]; 2],
    ask: &Ask<'_>,
    held: impl Fn(&Replica) -> (usize, f64),
) -> Vec<(&'a Arc<Replica>, usize, f64)> {
    let reusable = ask.hashes.len() * BLOCK_TOKENS;
    let chosen: HashSet<*const Replica> = (decodes.iter().chain(prefills))
        .map(|r| Arc::as_ptr(r))
        .collect();
    all.iter()
        .filter(|r| {
            r.can_serve_fetch()
                && r.serves(ask.model)
                && r.kv_bytes_per_token() > 0
                && !chosen.contains(&Arc::as_ptr(r))
        })
        .map(|r| {
            let hinted = ask
                .holder
                .filter(|(a, _)| *a == r.addr)
                .map_or(0, |(_, t)| t);
            let (h, read_ms) = held(r);
            (r, h.max(hinted).min(reusable), read_ms)
        })
        .filter(|&(_, h, _)| h > 0)
        .collect()
}

/// The best remote option: the prefill replica with the least estimated time to the first
/// token (its queue ahead of the request's class, half a step of a lower class where one runs,
/// the tokens it lacks at its rate, a disk read, and the measured hand-off `h_remote`), ties
/// broken by rendezvous on `key`, load and address; with its estimate (ms) and what it holds.
fn best_prefill<'a>(
    prefills: &[&'a Arc<Replica>],
    ask: &Ask<'_>,
    key: &[u8],
    h_remote: f64,
    held: impl Fn(&Replica) -> (usize, f64),
    rate: impl Fn(&Replica) -> f64,
) -> Option<(f64, &'a Arc<Replica>, usize)> {
    let n = ask.tokens as f64;
    prefills
        .iter()
        .map(|&p| {
            let (h, read_ms) = held(p);
            let r = rate(p);
            let ahead = p.queued_tokens_ahead(ask.class) as f64;
            // Where it stands within the step is unknown: half of one, expected.
            let step = if p.lower_class_busy(ask.class) {
                BATCH_YIELD_TOKENS as f64 / 2.0
            } else {
                0.0
            };
            let ms = (ahead + step + n - h as f64) / r * 1e3 + read_ms + h_remote;
            (ms, p, h, rendezvous(key, p))
        })
        .min_by(|(ca, a, _, ra), (cb, b, _, rb)| {
            ca.total_cmp(cb)
                .then_with(|| rb.cmp(ra))
                .then_with(|| a.load().cmp(&b.load()))
                .then_with(|| a.addr.cmp(&b.addr))
        })
        .map(|(ms, p, h, _)| (ms, p, h))
}

mod pipeline;
#[cfg(test)]
mod tests;
