//! The TTFT estimate's measured error, which admission against a TTFT target adds to the
//! estimate. The policy's formula ([`crate::cluster::policy`]) counts the queues, the compute
//! and the hand-off it measured, and half a lower class's step in progress, but not what the
//! workers' CPU does besides (on a machine whose prefill and decode nodes share cores, a
//! flood's decode steps slow an interactive prompt's compute and hand-off), nor where within
//! the step the prompt arrives. So each request's actual time to first token, less its time before the choice
//! and the choice's estimate, is kept as a residual of its class, and a request's estimate is
//! raised by the 90th percentile of its class's recent residuals: the prediction that a
//! request meets its target is then right nine times in ten, which is what the target asks of
//! the requests admitted.
//!
//! A residual counts for [`Calibration::TTL`]: the load it measured passes, and a class whose
//! requests the correction refuses must get some through again to learn that it has. Until a
//! class has [`Calibration::MIN_SAMPLES`] recent residuals, its estimate stands uncorrected.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use tandem_proto::policy::Class;
use tokio::time::Instant;

/// Recent residuals of the TTFT estimate (actual − estimated, ms), by priority class.
#[derive(Debug, Default)]
pub struct Calibration(Mutex<[VecDeque<(Instant, f64)>; Class::COUNT]>);

impl Calibration {
    /// How long a residual counts.
    pub const TTL: Duration = Duration::from_secs(30);
    /// Residuals a class keeps at most (the newest).
    pub const KEPT: usize = 64;
    /// Fewest recent residuals a correction is made of.
    pub const MIN_SAMPLES: usize = 5;

    fn lock(&self) -> std::sync::MutexGuard<'_, [VecDeque<(Instant, f64)>; Class::COUNT]> {
        // Whole pushes and pops: a panic elsewhere cannot leave a queue half-written.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a request of `class` whose first token came `actual_ms` after its choice, which
    /// estimated `est_ms`.
    pub fn record(&self, class: Class, actual_ms: f64, est_ms: f64) {
        let mut all = self.lock();
        let kept = &mut all[class.slot()];
        if kept.len() == Self::KEPT {
            kept.pop_front();
        }
        kept.push_back((Instant::now(), actual_ms - est_ms));
    }

    /// What to add to an estimate for `class`, in ms (negative where estimates ran high): the
    /// 90th percentile of its residuals of the last [`Self::TTL`], by the nearest rank; 0 with
    /// fewer than [`Self::MIN_SAMPLES`] of them.
    pub fn correction_ms(&self, class: Class) -> f64 {
        let mut all = self.lock();
        let kept = &mut all[class.slot()];
        while kept.front().is_some_and(|(at, _)| at.elapsed() > Self::TTL) {
            kept.pop_front();
        }
        if kept.len() < Self::MIN_SAMPLES {
            return 0.0;
        }
        let mut residuals: Vec<f64> = kept.iter().map(|&(_, r)| r).collect();
        residuals.sort_by(f64::total_cmp);
        let rank = (0.9 * residuals.len() as f64).ceil() as usize;
        residuals[rank.clamp(1, residuals.len()) - 1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With time paused: no correction until a class has enough residuals; then their 90th
    /// percentile, for that class only; the oldest give way to the newest beyond the bound;
    /// and all of them expire, so a class whose requests stopped being admitted goes back to
    /// the bare estimate.
    #[tokio::test(start_paused = true)]
    async fn the_correction_is_the_recent_residuals_90th_percentile_by_class() {
        let c = Calibration::default();
        for _ in 0..Calibration::MIN_SAMPLES - 1 {
            c.record(Class::Standard, 500.0, 100.0);
        }
        assert_eq!(c.correction_ms(Class::Standard), 0.0, "too few residuals");
        // Residuals 30 20 10 6 5 4 3 2 1 0 ms: the 9th of 10, sorted, is 20.
        for actual in [
            130.0, 120.0, 110.0, 106.0, 105.0, 104.0, 103.0, 102.0, 101.0, 100.0,
        ] {
            c.record(Class::Interactive, actual, 100.0);
        }
        assert_eq!(c.correction_ms(Class::Interactive), 20.0);
        assert_eq!(c.correction_ms(Class::Batch), 0.0, "another class has none");
        // Estimates that ran high give a negative correction.
        for _ in 0..Calibration::MIN_SAMPLES {
            c.record(Class::Batch, 50.0, 80.0);
        }
        assert_eq!(c.correction_ms(Class::Batch), -30.0);
        // A full window keeps the newest: 64 residuals of 5 ms push the rest out.
        for _ in 0..Calibration::KEPT {
            c.record(Class::Interactive, 105.0, 100.0);
        }
        assert_eq!(c.correction_ms(Class::Interactive), 5.0);
        // Past the TTL, nothing is left: back to the bare estimate.
        tokio::time::advance(Calibration::TTL + Duration::from_millis(1)).await;
        assert_eq!(c.correction_ms(Class::Interactive), 0.0);
        c.record(Class::Interactive, 400.0, 100.0);
        assert_eq!(
            c.correction_ms(Class::Interactive),
            0.0,
            "one fresh residual is too few"
        );
    }
}
