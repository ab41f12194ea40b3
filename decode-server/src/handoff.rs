//! The decode node's drain: its running streams move to peers with their KV, and its cached
//! sessions are offered to them ([`tandem_worker::moves`], which also serves and makes the peer
//! fetches).
//!
//! ```text
//! SIGTERM ─▶ NOT_SERVING, `draining`: new requests refused; each running stream stops between
//!            steps, its KV kept in the session cache, and ends UNAVAILABLE + tandem-kv-handoff
//!         ─▶ the router resumes it on a peer, which fetches that KV (`KvTransfer.Fetch`) here;
//!            when every decode node drains, it sends the stream back here instead
//!            (`last_resort`), and this node finishes it within its grace
//!         ─▶ the most recently used cached sessions are offered (`Worker.Sessions`); the router
//!            asks peers to take each (`Worker.Adopt`), and they fetch it here likewise
//!         ─▶ once every stream has ended (and, if any ran, RETURN_WINDOW has passed for those
//!            that may come back) and every kept sequence was fetched or taken back, and the
//!            offered sessions were fetched or nobody fetched any for OFFER_IDLE (or the
//!            hand-off bound passed): the listener closes and the grace period begins
//! ```

use std::time::Duration;

use tandem_worker::moves::Busy;
use tokio::time::Instant;

use crate::request::RequestContext;

/// How long a drain that handed streams off stays open for them to come back: the router
/// sends a stream back as a last resort when no decode node outside a drain can take it, a
/// few milliseconds after the hand-off.
const RETURN_WINDOW: Duration = Duration::from_secs(1);

impl RequestContext {
    /// The drain's hand-off: refuses new requests, hands the running streams off, offers the
    /// most recently used cached sessions, and waits until the streams have ended (those that
    /// came back as a last resort too, within [`RETURN_WINDOW`] of the drain's start), their
    /// kept KV was fetched or taken back, and the offered sessions were fetched (or nobody
    /// fetched any for [`tandem_worker::moves::OFFER_IDLE`]), or `bound` passed.
    pub(crate) async fn hand_off(&self, bound: Duration) {
        let (returns_until, had_streams) =
            (Instant::now() + RETURN_WINDOW, !self.tracker.is_empty());
        // Closed, the tracker's wait resolves once no stream runs (it still tracks those that
        // come back, and the node closes it at the end anyway).
        self.tracker.close();
        let busy = || -> Option<Busy<'_>> {
            if !self.tracker.is_empty() {
                Some(Box::pin(self.tracker.wait()))
            } else if had_streams && Instant::now() < returns_until {
                Some(Box::pin(tokio::time::sleep_until(returns_until)))
            } else {
                None
            }
        };
        let done = self.moves.hand_off(bound, busy).await;
        let m = &self.shared.metrics;
        tracing::info!(
            ms = done.ms,
            streams_running = self.tracker.len(),
            streams_handed_off = m.handed_off_streams.get(),
            tokens_handed_off = m.handed_off_tokens.get(),
            unfetched = done.unfetched,
            sessions_offered = done.sessions_offered,
            sessions_fetched = done.sessions_fetched,
            "hand-off over"
        );
    }
}
