//! One connection per peer ([`Channels`]): the calls a node makes to its peers (a prefill
//! node's KV push to a decode node, a peer's fetch of cached KV) share one HTTP/2 connection
//! per address, so only the first pays the TCP connect and, between nodes, the mutual-TLS
//! handshake.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::time::Instant;
use tonic::transport::{Channel, ClientTlsConfig};

use crate::tls::Tls;

/// Channels by peer address, each opened lazily ([`crate::channel`]) and kept for the next
/// call. A channel reconnects by itself after its connection fails, so a kept one stays good
/// across a peer's restart. At most [`Channels::MAX`] are kept; past it the least recently
/// used goes (its calls in flight finish on their own clones). Clones share the kept channels.
#[derive(Clone, Debug)]
pub struct Channels {
    tls: Option<ClientTlsConfig>,
    open: Arc<Mutex<HashMap<String, (Channel, Instant)>>>,
}

impl Channels {
    /// The most peers kept: far more than a node talks to, a bound on a caller naming many.
    pub const MAX: usize = 256;

    /// Channels over mutual TLS with `tls` (between nodes), or plaintext without.
    pub fn new(tls: Option<&Tls>) -> Self {
        Self {
            tls: tls.map(Tls::client_config),
            open: Arc::default(),
        }
    }

    /// The channel to `addr` (`host:port`, or a URI): the kept one, or a new one kept.
    pub fn get(&self, addr: &str) -> Result<Channel, tonic::transport::Error> {
        // Inserts, lookups and one eviction: a poisoned map is still consistent.
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if let Some((channel, used)) = open.get_mut(addr) {
            *used = now;
            return Ok(channel.clone());
        }
        let channel = crate::channel(addr, self.tls.clone())?;
        if open.len() >= Self::MAX {
            let oldest = (open.iter())
                .min_by_key(|(_, (_, used))| *used)
                .map(|(a, _)| a.clone());
            if let Some(oldest) = oldest {
                open.remove(&oldest);
            }
        }
        open.insert(addr.to_string(), (channel.clone(), now));
        Ok(channel)
    }

    /// How many channels are kept.
    pub fn len(&self) -> usize {
        self.open.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A second call to one address gets the kept channel; past the bound the least recently
    /// used goes.
    #[tokio::test(start_paused = true)]
    async fn channels_are_kept_per_address_within_the_bound() {
        let channels = Channels::new(None);
        channels.get("127.0.0.1:1").expect("valid");
        channels.get("127.0.0.1:1").expect("valid");
        assert_eq!(channels.len(), 1);
        for port in 2..=Channels::MAX as u16 {
            tokio::time::advance(std::time::Duration::from_millis(1)).await;
            channels.get(&format!("127.0.0.1:{port}")).expect("valid");
        }
        assert_eq!(channels.len(), Channels::MAX);
        tokio::time::advance(std::time::Duration::from_millis(1)).await;
        channels.get("127.0.0.1:1").expect("valid");
        channels.get("127.0.0.1:9999").expect("valid");
        assert_eq!(channels.len(), Channels::MAX);
        assert!(channels.get("not a uri\n").is_err());
        let open = channels.open.lock().expect("not poisoned");
        assert!(open.contains_key("127.0.0.1:1"), "used lately: kept");
        assert!(
            !open.contains_key("127.0.0.1:2"),
            "the least recently used went"
        );
    }
}
