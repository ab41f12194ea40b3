//! The prefill node's configuration.

use std::sync::Arc;
use std::time::Duration;

use tandem_engine::{EngineConfig, Model};

#[derive(Debug, Clone)]
pub struct Config {
    pub model: Arc<Model>,
    pub engine: EngineConfig,
    /// Requests that may wait for the compute thread; more get RESOURCE_EXHAUSTED.
    pub max_queue: usize,
    /// How long in-flight requests may run after shutdown begins.
    pub grace: Duration,
}

impl Config {
    pub fn new(model: Arc<Model>) -> Self {
        Self {
            model,
            engine: EngineConfig::default(),
            max_queue: 64,
            grace: Duration::from_secs(10),
        }
    }
}
