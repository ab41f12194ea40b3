//! The router's Prometheus metrics.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

pub const TTFT: &str = "tandem_ttft_seconds";
pub const INTER_TOKEN: &str = "tandem_inter_token_seconds";
pub const QUEUE: &str = "tandem_queue_seconds";
pub const REQUESTS: &str = "tandem_requests";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabel {
    /// The final gRPC code, e.g. `Ok`, `InvalidArgument`.
    pub code: String,
}

#[derive(Clone, Debug)]
pub struct RouterMetrics {
    pub ttft: Histogram,
    pub inter_token: Histogram,
    pub queue: Histogram,
    pub requests: Family<StatusLabel, Counter>,
}

impl RouterMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            ttft: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            inter_token: Histogram::new(exponential_buckets(0.0005, 2.0, 14)),
            queue: Histogram::new(exponential_buckets(0.0001, 2.0, 16)),
            requests: Family::default(),
        };
        registry.register(TTFT, "Time from request to first token", m.ttft.clone());
        registry.register(
            INTER_TOKEN,
            "Time between token frames",
            m.inter_token.clone(),
        );
        registry.register(QUEUE, "Time from request to dispatch", m.queue.clone());
        registry.register(REQUESTS, "Requests by final status", m.requests.clone());
        m
    }

    pub fn finished(&self, code: tonic::Code) {
        self.requests
            .get_or_create(&StatusLabel {
                code: format!("{code:?}"),
            })
            .inc();
    }
}
