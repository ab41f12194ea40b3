//! The decode node's configuration.

use std::sync::Arc;
use std::time::Duration;

use tandem_engine::{EngineConfig, Model};
use tandem_worker::{NodeConfig, NodeError};

/// Batch slots, unless configured.
pub const DEFAULT_MAX_SLOTS: usize = 16;
/// The KV wait when the caller sets none, unless configured.
pub const DEFAULT_KV_WAIT: Duration = Duration::from_secs(10);
/// The longest KV wait a caller may ask for, unless configured.
pub const DEFAULT_MAX_KV_WAIT: Duration = Duration::from_secs(60);
/// How long a drain waits for its hand-offs, unless configured.
pub const DEFAULT_DRAIN_HANDOFF: Duration = Duration::from_secs(5);
/// Bytes of KV a drain keeps for hand-offs at most, unless configured.
pub const DEFAULT_DRAIN_HANDOFF_BYTES: u64 = 1 << 30;

#[derive(Debug, Clone)]
pub struct Config {
    /// The model, engine, TLS and grace every node has; a non-zero `prefix_cache_bytes` turns
    /// the session cache on (it may then use the whole pool: cached blocks are evicted
    /// whenever a running sequence needs room).
    pub node: NodeConfig,
    /// Sequences decoded together at most (batch slots).
    pub max_slots: usize,
    /// The longest an admitted request waits without KV progress when the caller sets no bound.
    pub kv_wait: Duration,
    /// The longest KV wait a caller may ask for (`kv_wait_ms`); longer asks are cut to it.
    pub max_kv_wait: Duration,
    /// The drain's hand-off: how long it waits for running streams to move to peers, and for
    /// the peers to fetch their KV and the offered sessions', before the listener closes
    /// (zero: no hand-off).
    pub drain_handoff: Duration,
    /// The most KV (bytes) the drain hands off: running streams' first, then cached sessions.
    pub drain_handoff_bytes: u64,
}

impl Config {
    pub fn new(model: Arc<Model>) -> Self {
        Self {
            node: NodeConfig::new(
                model,
                EngineConfig {
                    prefix_cache_bytes: usize::MAX,
                    ..EngineConfig::default()
                },
            ),
            max_slots: DEFAULT_MAX_SLOTS,
            kv_wait: DEFAULT_KV_WAIT,
            max_kv_wait: DEFAULT_MAX_KV_WAIT,
            drain_handoff: DEFAULT_DRAIN_HANDOFF,
            drain_handoff_bytes: DEFAULT_DRAIN_HANDOFF_BYTES,
        }
    }

    /// Refuses settings the node cannot run with; [`crate::run`] checks them first.
    pub fn validate(&self) -> Result<(), NodeError> {
        if self.max_slots == 0 {
            return Err(NodeError::config("max_slots", "must be at least 1"));
        }
        if self.kv_wait.is_zero() {
            return Err(NodeError::config("kv_wait", "must be longer than 0"));
        }
        Ok(())
    }
}
