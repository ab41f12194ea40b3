//! Autoscaling signals: how many replicas of each role a model needs, from what its replicas
//! report, as `tandem_router_desired_replicas{model,role}` for KEDA or an HPA to follow
//! (docs/operations.md, "Autoscaling").
//!
//! - **Decode**: the requests its decode replicas hold (decoding and waiting for a place), over
//!   [`TARGET_UTILIZATION`] of the places one replica has: a full pool asks for a quarter more.
//! - **Prefill**: the larger of two needs. Busy: the replicas computing a prompt, over
//!   [`TARGET_UTILIZATION`]. Waiting: the prompt tokens queued, against the measured rate of one
//!   replica, so that the queue would clear within [`PREFILL_QUEUE_TARGET`].
//!
//! Each need is smoothed over the load polls ([`Smoothed`]), so that one poll's burst does not
//! move the signal; a role whose capacity is not measured yet keeps the replicas it has. At
//! least one replica is always wanted. Scaling down goes through a worker's drain: a replica
//! told to stop (SIGTERM, a pod's deletion) hands its streams and cached sessions to its peers
//! before it exits.

use std::time::Duration;

/// The share of a role's capacity the signal aims to use.
pub const TARGET_UTILIZATION: f64 = 0.8;
/// How long the prompt tokens waiting for prefill may take to clear.
pub const PREFILL_QUEUE_TARGET: Duration = Duration::from_secs(1);
/// The weight of a new poll in the smoothed need: about a 20-poll (5 s at 250 ms) memory.
const SMOOTHING: f64 = 0.05;

/// What one role of one model reports now.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RoleLoad {
    /// Replicas up.
    pub up: usize,
    /// Requests they hold: active plus queued.
    pub requests: u64,
    /// Places one replica has (the largest reported); 0 until reported.
    pub capacity: u64,
    /// Replicas computing a prompt now (prefill).
    pub busy: u64,
    /// Prompt tokens waiting (prefill).
    pub queued_tokens: u64,
    /// Measured prompt tokens per second of one replica (the mean); 0 until measured.
    pub rate: f64,
}

/// The decode replicas `load` needs now, unsmoothed (fractional).
pub fn decode_need(load: &RoleLoad) -> Option<f64> {
    (load.capacity > 0).then(|| load.requests as f64 / (TARGET_UTILIZATION * load.capacity as f64))
}

/// The prefill replicas `load` needs now, unsmoothed (fractional).
pub fn prefill_need(load: &RoleLoad) -> Option<f64> {
    (load.rate > 0.0).then(|| {
        let busy = load.busy as f64 / TARGET_UTILIZATION;
        let waiting = load.queued_tokens as f64 / (load.rate * PREFILL_QUEUE_TARGET.as_secs_f64());
        busy.max(waiting)
    })
}

/// A need smoothed over polls (an exponentially weighted mean), and the replicas it asks for.
#[derive(Clone, Copy, Debug, Default)]
pub struct Smoothed {
    need: Option<f64>,
}

impl Smoothed {
    /// Takes this poll's `need` (`None`: not measurable yet) and returns the replicas wanted:
    /// the smoothed need rounded up, at least 1; `up` while nothing is measured.
    pub fn desired(&mut self, need: Option<f64>, up: usize) -> usize {
        self.need = match (self.need, need) {
            (Some(old), Some(new)) => Some(old + SMOOTHING * (new - old)),
            (None, Some(new)) => Some(new),
            (old, None) => old,
        };
        match self.need {
            // A hair over a whole number is noise of the mean, not a replica.
            Some(n) => ((n - 1e-6).ceil() as usize).max(1),
            None => up.max(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_asks_for_the_places_its_requests_need() {
        let load = |requests, capacity| RoleLoad {
            up: 2,
            requests,
            capacity,
            ..RoleLoad::default()
        };
        // Two replicas of 8 places: 12 requests fit in 80% of two; 16 (both full) ask for 3.
        let desired = |l: RoleLoad| Smoothed::default().desired(decode_need(&l), l.up);
        assert_eq!(desired(load(12, 8)), 2);
        assert_eq!(desired(load(16, 8)), 3);
        assert_eq!(desired(load(0, 8)), 1, "idle: one");
        assert_eq!(
            desired(load(40, 0)),
            2,
            "capacity unknown: as many as there are"
        );
    }

    #[test]
    fn prefill_asks_for_its_busy_replicas_and_its_queue() {
        let load = |busy, queued_tokens, rate| RoleLoad {
            up: 1,
            busy,
            queued_tokens,
            rate,
            ..RoleLoad::default()
        };
        let desired = |l: RoleLoad| Smoothed::default().desired(prefill_need(&l), l.up);
        assert_eq!(
            desired(load(1, 0, 1000.0)),
            2,
            "one busy replica is over 80%"
        );
        assert_eq!(
            desired(load(0, 2500, 1000.0)),
            3,
            "2.5 s of prompts waiting"
        );
        assert_eq!(desired(load(0, 0, 1000.0)), 1);
        assert_eq!(
            desired(load(1, 90_000, 0.0)),
            1,
            "rate unknown: as many as there are"
        );
    }

    /// One poll's burst moves the smoothed need a twentieth of the way; a lasting load moves
    /// it all the way.
    #[test]
    fn a_burst_does_not_move_the_signal_a_lasting_load_does() {
        let mut s = Smoothed::default();
        assert_eq!(s.desired(Some(1.0), 1), 1);
        assert_eq!(s.desired(Some(8.0), 1), 2, "one poll of 8: 1.35");
        let mut last = 0;
        for _ in 0..100 {
            last = s.desired(Some(8.0), 1);
        }
        assert_eq!(last, 8);
        assert_eq!(s.desired(None, 5), 8, "an unmeasured poll keeps the need");
    }
}
