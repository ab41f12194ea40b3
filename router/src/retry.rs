//! The failover budget: how many extra dispatch attempts the router may spend, so that a fault
//! cannot multiply the load on the replicas that are left (Finagle's and gRPC's retry budgets).
//!
//! Every client request deposits [`RetryBudget::RATIO`] of an attempt; each failover spends
//! one. What can be saved up is a fifth of the requests of about the last minute
//! ([`RetryBudget::WINDOW`]), and at least [`RetryBudget::RESERVE`]. Over any minute of
//! traffic, attempts are then at most `1 + RATIO` per request, plus the reserve, which lets a
//! freshly started router fail over the streams of one dead replica before it has seen much
//! traffic, and a busy one fail over all the streams a dead replica carried.

use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct RetryBudget {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    balance: f64,
    /// Client requests, each weighed down by `e^(-age / WINDOW)`.
    recent: f64,
    at: Instant,
}

impl Default for RetryBudget {
    fn default() -> Self {
        Self {
            state: Mutex::new(State {
                balance: Self::RESERVE,
                recent: 0.0,
                at: Instant::now(),
            }),
        }
    }
}

impl RetryBudget {
    /// Failovers earned per client request.
    pub const RATIO: f64 = 0.2;
    /// Failovers that can always be saved up: about the streams one replica carries at once in
    /// a small cluster. A larger fixed reserve let a 2 s outage of the KV path take 1.31
    /// attempts per request over 32 requests, past the 1.2 of the reliability contract (C7).
    pub const RESERVE: f64 = 5.0;
    /// The stretch of traffic whose requests bound the savings.
    pub const WINDOW: Duration = Duration::from_secs(60);

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // Plain numbers; a poisoned lock still holds consistent ones.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a client request.
    pub fn deposit(&self) {
        self.deposit_at(Instant::now());
    }

    fn deposit_at(&self, now: Instant) {
        let mut s = self.state();
        let age = now.saturating_duration_since(s.at).as_secs_f64();
        s.recent = s.recent * (-age / Self::WINDOW.as_secs_f64()).exp() + 1.0;
        s.at = now;
        let most = (Self::RATIO * s.recent).max(Self::RESERVE);
        s.balance = (s.balance + Self::RATIO).min(most);
    }

    /// Takes one failover from the budget, if it holds one.
    pub fn try_spend(&self) -> bool {
        let mut s = self.state();
        if s.balance >= 1.0 {
            s.balance -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spends_the_reserve_then_a_fifth_of_the_requests() {
        let budget = RetryBudget::default();
        let reserve = (0..100).take_while(|_| budget.try_spend()).count();
        assert_eq!(reserve, RetryBudget::RESERVE as usize);
        for _ in 0..20 {
            budget.deposit();
        }
        let earned = (0..100).take_while(|_| budget.try_spend()).count();
        assert!((3..=4).contains(&earned), "20 requests earned {earned}");
    }

    /// A busy router saves up a fifth of its last minute's requests: enough to fail over every
    /// stream of a dead replica. Quiet, its savings shrink back to the reserve.
    #[test]
    fn savings_follow_the_last_minute_of_traffic() {
        let busy = |budget: &RetryBudget, t0: Instant| {
            // 120 requests over 60 s: about 76 of them still count at the end.
            for i in 0..120 {
                budget.deposit_at(t0 + Duration::from_millis(500 * i));
            }
        };
        let t0 = Instant::now();
        let budget = RetryBudget::default();
        busy(&budget, t0);
        let saved = (0..100).take_while(|_| budget.try_spend()).count();
        assert!((14..=16).contains(&saved), "saved {saved}");

        let budget = RetryBudget::default();
        busy(&budget, t0);
        budget.deposit_at(t0 + Duration::from_secs(600));
        let later = (0..100).take_while(|_| budget.try_spend()).count();
        assert_eq!(later, RetryBudget::RESERVE as usize);
    }
}
