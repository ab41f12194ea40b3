//! The router's queue, as the requests waiting in it see it: each one's place ([`Queued`],
//! counted in the queue's gauge while it lives) and the queue's pace ([`QueuePace`]), which
//! predicts a newcomer's wait.

use std::time::Duration;

use tokio::time::Instant;

/// A request's place in the router's queue: counted in the queue's gauge while it lives, and
/// ranked in the admission order (a first attempt's; a failover is not ranked).
#[derive(Debug)]
pub(crate) struct Queued {
    pub(crate) gauge: prometheus_client::metrics::gauge::Gauge,
    /// Requests in the queue when this one joined.
    pub(crate) ahead: usize,
    pub(crate) since: Instant,
    pub(crate) ticket: Option<crate::dispatch::order::Ticket>,
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

#[cfg(test)]
mod tests {
    use prometheus_client::metrics::gauge::Gauge;

    use super::*;

    fn join(gauge: &Gauge, ahead: usize) -> Queued {
        gauge.inc();
        Queued {
            gauge: gauge.clone(),
            ahead,
            since: Instant::now(),
            ticket: None,
        }
    }

    /// With time paused: the pace is the wait per request ahead, averaged over admissions, and
    /// a place leaves the gauge when it is dropped.
    #[tokio::test(start_paused = true)]
    async fn the_pace_predicts_the_wait_behind_the_requests_ahead() {
        let (pace, gauge) = (QueuePace::default(), Gauge::default());
        assert_eq!(pace.predict(5), None, "nothing admitted from the queue yet");
        // Three ahead, admitted after 400 ms: 100 ms a place.
        let first = join(&gauge, 3);
        assert_eq!(gauge.get(), 1);
        tokio::time::advance(Duration::from_millis(400)).await;
        pace.record(&first);
        drop(first);
        assert_eq!(gauge.get(), 0);
        assert_eq!(pace.predict(1), Some(Duration::from_millis(200)));
        // One admitted at once moves the average a fifth of the way: 80 ms a place.
        let second = join(&gauge, 0);
        pace.record(&second);
        let behind_four = pace.predict(4).expect("a pace");
        assert!(
            behind_four.abs_diff(Duration::from_millis(400)) < Duration::from_micros(1),
            "{behind_four:?}"
        );
    }
}
