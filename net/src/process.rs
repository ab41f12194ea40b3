//! The process's own figures under the Prometheus client libraries' standard names, read at each
//! scrape: `process_cpu_seconds_total` (user and system CPU of every thread, from
//! `getrusage(RUSAGE_SELF)`) and, on Linux, `process_resident_memory_bytes` (`VmRSS` of
//! `/proc/self/status`). The `prometheus-client` crate ships no process collector, and these two
//! are a few lines.

use nix::sys::resource::{UsageWho, getrusage};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

#[derive(Debug)]
pub(crate) struct ProcessMetrics;

/// The CPU seconds this process has run, in user and system mode together.
fn cpu_seconds() -> Option<f64> {
    let usage = getrusage(UsageWho::RUSAGE_SELF).ok()?;
    let seconds = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1_000_000.0;
    Some(seconds(usage.user_time()) + seconds(usage.system_time()))
}

/// The resident set's bytes (Linux only).
fn resident_bytes() -> Option<i64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: i64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

impl Collector for ProcessMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        if let Some(seconds) = cpu_seconds() {
            let counter = ConstCounter::new(seconds);
            counter.encode(encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds",
                None,
                counter.metric_type(),
            )?)?;
        }
        if let Some(bytes) = resident_bytes() {
            let gauge = ConstGauge::new(bytes);
            gauge.encode(encoder.encode_descriptor(
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                None,
                gauge.metric_type(),
            )?)?;
        }
        Ok(())
    }
}
