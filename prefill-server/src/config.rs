//! The prefill node's configuration.

use std::sync::Arc;
use std::time::Duration;

use tandem_engine::{EngineConfig, Model};

/// The prefix cache's default size.
pub const DEFAULT_PREFIX_CACHE_BYTES: usize = 128 << 20;

#[derive(Debug, Clone)]
pub struct Config {
    pub model: Arc<Model>,
    /// The engine; `prefix_cache_bytes` sizes the prefix cache (0 turns it off).
    pub engine: EngineConfig,
    /// Requests that may wait for the compute thread; more get RESOURCE_EXHAUSTED.
    pub max_queue: usize,
    /// Mutual TLS: this node's certificate, and the only way to reach it and for it to reach
    /// others.
    pub tls: Option<tandem_net::tls::Tls>,
    /// How long in-flight requests may run after shutdown begins.
    pub grace: Duration,
    /// How often a push whose KV does not flow yet tells the decode node it lives
    /// ([`tandem_transfer::client::Heartbeat`]); the decode nodes' KV wait must be longer.
    pub keepalive: Duration,
}

impl Config {
    pub fn new(model: Arc<Model>) -> Self {
        Self {
            model,
            engine: EngineConfig {
                prefix_cache_bytes: DEFAULT_PREFIX_CACHE_BYTES,
                ..EngineConfig::default()
            },
            max_queue: 64,
            grace: Duration::from_secs(10),
            keepalive: tandem_transfer::client::KEEPALIVE_INTERVAL,
            tls: None,
        }
    }
}
