//! Moving a draining worker's cached sequences to its peers of the same role (a decode node's
//! sessions, a prefill node's hottest prompts), so that their next uses are cache hits there
//! instead of cold prompts.
//!
//! ```text
//! Health.Watch says NOT_SERVING ─▶ Worker.Sessions: the node's offer, most recently used first
//!   ─▶ per sequence, Worker.Adopt on an up peer (spread by load; a full one is skipped), which
//!      fetches the KV from the draining node (KvTransfer.Fetch, checked as a push)
//!   ─▶ the peer's cache events tell every router's index where the sequence now is
//! ```
//!
//! A sequence no peer takes (no room, a failure) is left: its next use computes it, as it would
//! have without the move. Nothing here touches a running request; those move through the
//! hand-off in [`crate::dispatch::progress`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use tandem_proto::v1 as pb;

use crate::cluster::replica::Replica;
use crate::metrics::RouterMetrics;

/// Sequences being moved at once from one draining node.
const ADOPTS_IN_FLIGHT: usize = 2;
/// The longest one `Worker.Adopt` may take (a fetch that stalls is dropped sooner, by the peer).
const ADOPT_TIMEOUT: Duration = Duration::from_secs(10);

/// Moves what `from`, now draining, offers to `peers` (the up replicas of its role beside it).
pub(crate) async fn move_sessions(
    from: Arc<Replica>,
    peers: Vec<Arc<Replica>>,
    metrics: RouterMetrics,
) {
    if peers.is_empty() {
        return;
    }
    let mut client =
        tandem_proto::limits!(pb::worker_client::WorkerClient::new(from.channel.clone()));
    let mut ask = tonic::Request::new(pb::SessionsRequest {});
    ask.set_timeout(ADOPT_TIMEOUT);
    let sessions = match client.sessions(ask).await {
        Ok(r) => r.into_inner().sessions,
        Err(e) => {
            tracing::debug!(replica = %from.addr, error = %e, "no sessions offered");
            return;
        }
    };
    if sessions.is_empty() {
        tracing::debug!(replica = %from.addr, "the draining replica offered nothing");
        return;
    }
    let offered = sessions.len();
    // The least loaded peers take the first (most recently used) sessions.
    let mut peers: Vec<(Arc<Replica>, AtomicBool)> = peers
        .into_iter()
        .map(|p| (p, AtomicBool::new(false)))
        .collect();
    peers.sort_by_key(|(p, _)| p.load());
    let (peers, from_addr) = (&peers, from.addr.as_str());
    let moved: Vec<u32> = futures::stream::iter(sessions.into_iter().enumerate())
        .map(|(i, session)| async move {
            // Each peer in turn from the i-th, skipping those found full.
            for (peer, full) in peers.iter().cycle().skip(i).take(peers.len()) {
                if full.load(Ordering::Relaxed) || !peer.is_up() {
                    continue;
                }
                match adopt(peer, from_addr, session.clone()).await {
                    Ok(fetched) => return fetched,
                    Err(e) if e.code() == tonic::Code::ResourceExhausted => {
                        full.store(true, Ordering::Relaxed);
                    }
                    Err(e) => {
                        tracing::debug!(peer = %peer.addr, error = %e, "a peer did not take a sequence");
                    }
                }
            }
            0
        })
        .buffer_unordered(ADOPTS_IN_FLIGHT)
        .collect()
        .await;
    let tokens: u64 = moved.iter().map(|&t| u64::from(t)).sum();
    let taken = moved.iter().filter(|&&t| t > 0).count();
    let role = crate::metrics::RoleLabel {
        role: from.role.name(),
    };
    metrics
        .moved_sessions
        .get_or_create(&role)
        .inc_by(taken as u64);
    metrics
        .moved_session_tokens
        .get_or_create(&role)
        .inc_by(tokens);
    tracing::info!(
        replica = %from.addr,
        role = from.role.name(),
        offered,
        moved = taken,
        tokens,
        "moved a draining replica's cached sequences to its peers"
    );
}

/// Asks `peer` to take `session` from the node at `holder`; the tokens it fetched.
async fn adopt(
    peer: &Replica,
    holder: &str,
    session: pb::CachedSession,
) -> Result<u32, tonic::Status> {
    let mut client =
        tandem_proto::limits!(pb::worker_client::WorkerClient::new(peer.channel.clone()));
    let mut request = tonic::Request::new(pb::AdoptRequest {
        request_id: crate::ids::fresh_id(),
        holder_addr: holder.to_string(),
        session: Some(session),
    });
    request.set_timeout(ADOPT_TIMEOUT);
    Ok(client.adopt(request).await?.into_inner().fetched_tokens)
}
