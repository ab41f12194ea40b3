//! The decode node's configuration.

use std::sync::Arc;
use std::time::Duration;

use tandem_engine::{EngineConfig, Model};

#[derive(Debug, Clone)]
pub struct Config {
    pub model: Arc<Model>,
    /// The engine; a non-zero `prefix_cache_bytes` turns the session cache on (it may then use
    /// the whole pool: cached blocks are evicted whenever a running sequence needs room).
    pub engine: EngineConfig,
    /// Sequences decoded together at most (batch slots).
    pub max_slots: usize,
    /// The longest an admitted request waits without KV progress when the caller sets no bound.
    pub kv_wait: Duration,
    /// The longest KV wait a caller may ask for (`kv_wait_ms`); longer asks are cut to it.
    pub max_kv_wait: Duration,
    /// Mutual TLS: this node's certificate, and the only way to reach it and for it to reach
    /// others.
    pub tls: Option<tandem_net::tls::Tls>,
    /// How long in-flight streams may run after shutdown begins.
    pub grace: Duration,
}

impl Config {
    pub fn new(model: Arc<Model>) -> Self {
        Self {
            model,
            engine: EngineConfig {
                prefix_cache_bytes: usize::MAX,
                ..EngineConfig::default()
            },
            max_slots: 16,
            kv_wait: Duration::from_secs(10),
            max_kv_wait: Duration::from_secs(60),
            grace: Duration::from_secs(10),
            tls: None,
        }
    }
}
