//! The prefill node's configuration.

use std::sync::Arc;
use std::time::Duration;

use tandem_engine::{EngineConfig, Model};
use tandem_worker::{NodeConfig, NodeError};

/// The prefix cache's default size.
pub const DEFAULT_PREFIX_CACHE_BYTES: usize = 128 << 20;
/// How many requests may wait for the compute thread, unless configured.
pub const DEFAULT_MAX_QUEUE: usize = 64;

#[derive(Debug, Clone)]
pub struct Config {
    /// The model, engine, TLS and grace every node has; the engine's `prefix_cache_bytes`
    /// sizes the prefix cache (0 turns it off).
    pub node: NodeConfig,
    /// Requests that may wait for the compute thread; more get RESOURCE_EXHAUSTED.
    pub max_queue: usize,
    /// How often a push whose KV does not flow yet tells the decode node it lives
    /// ([`tandem_transfer::client::Heartbeat`]); the decode nodes' KV wait must be longer.
    pub keepalive: Duration,
}

impl Config {
    pub fn new(model: Arc<Model>) -> Self {
        Self {
            node: NodeConfig::new(
                model,
                EngineConfig {
                    prefix_cache_bytes: DEFAULT_PREFIX_CACHE_BYTES,
                    ..EngineConfig::default()
                },
            ),
            max_queue: DEFAULT_MAX_QUEUE,
            keepalive: tandem_transfer::client::KEEPALIVE_INTERVAL,
        }
    }

    /// Refuses settings the node cannot run with; [`crate::run`] checks them first.
    pub fn validate(&self) -> Result<(), NodeError> {
        if self.max_queue == 0 {
            return Err(NodeError::config("max_queue", "must be at least 1"));
        }
        if self.keepalive.is_zero() {
            return Err(NodeError::config("keepalive", "must be longer than 0"));
        }
        Ok(())
    }
}
