//! The router's queue, as the requests waiting in it see it: each one's place ([`Queued`],
//! counted in the queue's gauge while it lives) and the queue's pace ([`QueuePace`]), which
//! predicts a newcomer's wait.

use std::time::{Duration, Instant};

/// A request's place in the router's queue: counted in the queue's gauge while it lives.
#[derive(Debug)]
pub(crate) struct Queued {
    pub(crate) gauge: prometheus_client::metrics::gauge::Gauge,
    /// Requests in the queue when this one joined.
    pub(crate) ahead: usize,
    pub(crate) since: Instant,
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// The pace of the router's queue: the wait per request ahead, a moving average over the
/// queued requests admitted lately. It predicts a newcomer's wait, so that one whose deadline
/// that wait would outlast is refused at once instead of timing out in the queue.
#[derive(Debug, Default)]
pub struct QueuePace(std::sync::Mutex<Option<f64>>);

impl QueuePace {
    /// Weight of the newest wait in the average.
    const WEIGHT: f64 = 0.2;

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<f64>> {
        // A plain number: a panic elsewhere cannot leave it half-written.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn record(&self, queued: &Queued) {
        let per = queued.since.elapsed().as_secs_f64() / (queued.ahead + 1) as f64;
        let mut pace = self.lock();
        *pace = Some(pace.map_or(per, |old| old + Self::WEIGHT * (per - old)));
    }

    /// The wait predicted behind `ahead` requests; `None` before any queued request was
    /// admitted.
    pub(crate) fn predict(&self, ahead: usize) -> Option<Duration> {
        self.lock()
            .map(|per| Duration::from_secs_f64(per * (ahead + 1) as f64))
    }
}
