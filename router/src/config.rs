//! The router's configuration.

use std::time::Duration;

pub use crate::policy::PolicyKind;

#[derive(Debug, Clone)]
pub struct Config {
    /// Prefill replicas, `host:port`.
    pub prefill: Vec<String>,
    /// Decode replicas, `host:port`.
    pub decode: Vec<String>,
    /// Requests in flight at most; more get RESOURCE_EXHAUSTED with retry pushback.
    pub max_inflight: usize,
    /// The whole-request bound when the client sets no deadline.
    pub default_timeout: Duration,
    /// The longest a decode node waits without KV progress (before the push starts, or
    /// between its chunks) after admitting a request.
    pub kv_wait: Duration,
    /// The longest wait for a decode node's next frame once it has its KV (after a local
    /// prefill, plus twice the prefill's estimated time); past it, the node counts as failed
    /// and the generation resumes elsewhere.
    pub token_gap: Duration,
    /// How often replicas are asked for their load.
    pub load_poll: Duration,
    /// How long in-flight streams may run after shutdown begins.
    pub grace: Duration,
    /// How replicas are chosen (see [`crate::policy`]).
    pub policy: PolicyKind,
    /// Most block hashes the cache index keeps per replica (10-21 bytes each).
    pub index_max_blocks: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            prefill: Vec::new(),
            decode: Vec::new(),
            max_inflight: 256,
            default_timeout: Duration::from_secs(300),
            kv_wait: Duration::from_secs(10),
            token_gap: Duration::from_secs(5),
            load_poll: Duration::from_millis(250),
            grace: Duration::from_secs(10),
            policy: PolicyKind::Affinity,
            index_max_blocks: 1 << 20,
        }
    }
}
