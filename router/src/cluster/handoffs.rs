//! The measured hand-offs the routing policy's estimate adds ([`crate::cluster::policy`]):
//! what the first token took beyond the queues and the compute, by priority class (a class's
//! prompts are alike, and a hand-off's exposed tail grows with the prompt: a short interactive
//! turn's is not a long batch prompt's), and the measured throughput of peer fetches.

use std::time::Duration;

use tandem_proto::policy::Class;
use tokio::time::Instant;

/// How long a measured hand-off describes the cluster: one sampled under a load that has
/// passed must not hold a class's estimate up for good once nothing of it is admitted to
/// measure again.
pub const HANDOFF_TTL: Duration = Duration::from_secs(30);

/// A moving average of measured hand-offs, in ms, and when it was last sampled.
#[derive(Clone, Copy, Debug)]
struct Handoff {
    ms: f64,
    at: Instant,
}

/// Measured hand-offs by class, remote (a prefill node's push) and local, and the moving
/// average of fetch throughput, in bytes per ms (0 before the first).
#[derive(Debug, Default)]
pub struct Handoffs {
    remote: [Option<Handoff>; Class::COUNT],
    local: [Option<Handoff>; Class::COUNT],
    pub link: f64,
}

impl Handoffs {
    /// Folds in a measured hand-off of a request of `class`, in ms.
    pub fn record(&mut self, local: bool, class: Class, ms: f64) {
        let ms = ms.max(0.0);
        let slot = if local {
            &mut self.local[class.slot()]
        } else {
            &mut self.remote[class.slot()]
        };
        // A stale average starts over: the load it measured has passed.
        let old = slot.filter(|h| h.at.elapsed() <= HANDOFF_TTL);
        *slot = Some(Handoff {
            ms: old.map_or(ms, |old| ewma(old.ms, ms)),
            at: Instant::now(),
        });
    }

    /// Folds in a measured peer fetch: `bytes` in `ms`.
    pub fn record_fetch(&mut self, bytes: u64, ms: f64) {
        if bytes > 0 && ms > 0.0 {
            self.link = ewma(self.link, bytes as f64 / ms);
        }
    }

    /// The hand-off a request of `class` is estimated with, in ms, and how much of it is
    /// borrowed from other classes (all of it, or none): its class's average sampled in the last [`HANDOFF_TTL`]; else the mean of the
    /// other classes' sampled in it (borrowed: good enough to choose replicas by, not to
    /// refuse a request by, since a flood's long prompts would hold a short turn's estimate up
    /// for as long as they last, and it would never be admitted to measure its own; see
    /// [`crate::cluster::policy::Choice::borrowed_ms`]); else 0 (the cluster has been idle,
    /// or nothing was measured yet: the next requests measure it).
    pub fn of(&self, local: bool, class: Class) -> (f64, f64) {
        let by_class = if local { &self.local } else { &self.remote };
        let fresh = |h: &&Handoff| h.at.elapsed() <= HANDOFF_TTL;
        if let Some(own) = by_class[class.slot()].as_ref().filter(fresh) {
            return (own.ms, 0.0);
        }
        let (sum, n) = (by_class.iter().flatten())
            .filter(fresh)
            .fold((0.0, 0), |(sum, n), h| (sum + h.ms, n + 1));
        if n == 0 {
            (0.0, 0.0)
        } else {
            let mean = sum / f64::from(n);
            (mean, mean)
        }
    }
}

fn ewma(old: f64, sample: f64) -> f64 {
    if old == 0.0 {
        sample
    } else {
        old * 0.8 + sample * 0.2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// With time paused: a class is estimated with its own hand-offs; before its first, with
    /// the mean of the other classes' (borrowed); a class's average counts for
    /// [`HANDOFF_TTL`] after its last sample and then starts over, and with nothing sampled in
    /// it the hand-off is 0.
    #[tokio::test(start_paused = true)]
    async fn a_class_is_estimated_with_its_own_recent_hand_offs() {
        let mut h = Handoffs::default();
        // (the hand-off, of it borrowed), within a rounding error.
        let is = |got: (f64, f64), want: (f64, f64)| {
            (got.0 - want.0).abs() < 1e-9 && (got.1 - want.1).abs() < 1e-9
        };
        assert!(
            is(h.of(false, Class::Interactive), (0.0, 0.0)),
            "nothing measured"
        );
        h.record(false, Class::Batch, 100.0);
        assert!(
            is(h.of(false, Class::Interactive), (100.0, 100.0)),
            "the batch class's, borrowed"
        );
        h.record(false, Class::Standard, 50.0);
        assert!(
            is(h.of(false, Class::Interactive), (75.0, 75.0)),
            "the classes measured"
        );
        h.record(false, Class::Interactive, 10.0);
        h.record(false, Class::Interactive, 20.0);
        assert!(
            is(h.of(false, Class::Interactive), (12.0, 0.0)),
            "its own: 10 + (20 - 10) / 5"
        );
        assert!(is(h.of(false, Class::Batch), (100.0, 0.0)));
        assert!(
            is(h.of(true, Class::Interactive), (0.0, 0.0)),
            "local apart"
        );
        // The interactive class goes on being measured; the others fall silent.
        tokio::time::advance(HANDOFF_TTL / 2).await;
        h.record(false, Class::Interactive, 12.0);
        tokio::time::advance(HANDOFF_TTL / 2 + Duration::from_millis(1)).await;
        assert!(
            is(h.of(false, Class::Batch), (12.0, 12.0)),
            "its own went stale: the class sampled lately"
        );
        assert!(is(h.of(false, Class::Interactive), (12.0, 0.0)));
        tokio::time::advance(HANDOFF_TTL).await;
        assert!(
            is(h.of(false, Class::Interactive), (0.0, 0.0)),
            "nothing sampled lately"
        );
        h.record(false, Class::Interactive, 30.0);
        assert!(
            is(h.of(false, Class::Interactive), (30.0, 0.0)),
            "a stale average starts over"
        );
    }
}
