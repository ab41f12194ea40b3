//! The transfer service's Prometheus metrics.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

pub const BYTES: &str = "tandem_kv_transfer_bytes";
pub const DURATION: &str = "tandem_kv_transfer_duration_seconds";
pub const THROUGHPUT: &str = "tandem_kv_transfer_throughput_bytes_per_second";
pub const REJECTS: &str = "tandem_kv_transfer_rejects";
pub const FETCH_SERVED_BYTES: &str = "tandem_kv_fetch_served_bytes";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

/// Counters and histograms of received transfers.
#[derive(Clone, Debug)]
pub struct TransferMetrics {
    /// Bytes of KV accepted.
    pub bytes: Counter,
    pub duration: Histogram,
    pub throughput: Histogram,
    pub rejects: Family<ReasonLabel, Counter>,
    /// Bytes of KV sent to peers that fetched it.
    pub fetched_bytes: Counter,
}

impl TransferMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            bytes: Counter::default(),
            duration: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            throughput: Histogram::new(exponential_buckets(1e6, 2.0, 16)),
            rejects: Family::default(),
            fetched_bytes: Counter::default(),
        };
        registry.register(BYTES, "KV bytes received and accepted", m.bytes.clone());
        registry.register(
            DURATION,
            "Time from a push's header to its trailer",
            m.duration.clone(),
        );
        registry.register(
            THROUGHPUT,
            "Bytes per second of each accepted push",
            m.throughput.clone(),
        );
        registry.register(REJECTS, "Pushes rejected, by reason", m.rejects.clone());
        registry.register(
            FETCH_SERVED_BYTES,
            "KV bytes sent to peers that fetched them from this node's cache",
            m.fetched_bytes.clone(),
        );
        for reason in crate::Error::REASONS {
            let _ = m.rejects.get_or_create(&ReasonLabel { reason });
        }
        m
    }
}
