//! The decode node's configuration.

use std::sync::Arc;
use std::time::Duration;

use tandem_engine::{EngineConfig, Model};
use tandem_worker::{NodeConfig, NodeError};

/// Batch slots, unless configured.
pub const DEFAULT_MAX_SLOTS: usize = 16;
/// The KV wait when the caller sets none, unless configured.
pub const DEFAULT_KV_WAIT: Duration = Duration::from_secs(10);
/// The share of a node's places and KV blocks that batch requests may hold, unless configured.
pub const DEFAULT_BATCH_SHARE_PERCENT: u8 = 75;
/// Slots batch streams keep while an interactive stream runs, unless configured.
pub const DEFAULT_BATCH_SLOTS_BESIDE_INTERACTIVE: usize = 2;
/// Bytes of KV paused streams may keep pinned in the pool, unless configured.
pub const DEFAULT_PARK_PINNED_BYTES: u64 = 64 << 20;
/// The longest KV wait a caller may ask for, unless configured.
pub const DEFAULT_MAX_KV_WAIT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone)]
pub struct Config {
    /// The model, engine, TLS, grace and drain hand-off every node has; a non-zero `prefix_cache_bytes` turns
    /// the session cache on (it may then use the whole pool: cached blocks are evicted
    /// whenever a running sequence needs room).
    pub node: NodeConfig,
    /// Sequences decoded together at most (batch slots).
    pub max_slots: usize,
    /// The longest an admitted request waits without KV progress when the caller sets no bound.
    pub kv_wait: Duration,
    /// The longest KV wait a caller may ask for (`kv_wait_ms`); longer asks are cut to it.
    pub max_kv_wait: Duration,
    /// Bytes of KV the streams paused for a higher priority class may keep pinned in the pool;
    /// past it (with a disk tier and the session cache on) they park on disk.
    pub park_pinned_bytes: u64,
    /// The share, in percent, of the node's places and KV blocks that requests of the batch
    /// class may hold; the rest is kept for the higher classes.
    pub batch_share_percent: u8,
    /// Batch slots that streams of the batch class keep while an interactive stream runs or is
    /// ready; the others pause until no interactive stream is left (or they have waited an age
    /// step).
    pub batch_slots_beside_interactive: usize,
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
            park_pinned_bytes: DEFAULT_PARK_PINNED_BYTES,
            batch_share_percent: DEFAULT_BATCH_SHARE_PERCENT,
            batch_slots_beside_interactive: DEFAULT_BATCH_SLOTS_BESIDE_INTERACTIVE,
        }
    }

    /// Refuses settings the node cannot run with; [`crate::run`] checks them first.
    pub fn validate(&self) -> Result<(), NodeError> {
        if self.max_slots == 0 {
            return Err(NodeError::config("max_slots", "must be at least 1"));
        }
        if !(1..=100).contains(&self.batch_share_percent) {
            return Err(NodeError::config(
                "batch_share_percent",
                "must be from 1 to 100",
            ));
        }
        if self.kv_wait.is_zero() {
            return Err(NodeError::config("kv_wait", "must be longer than 0"));
        }
        Ok(())
    }
}
