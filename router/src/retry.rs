//! The failover budget: how many extra dispatch attempts the router may spend, so that a fault
//! cannot multiply the load on the replicas that are left (Finagle's and gRPC's retry budgets).
//!
//! Every client request deposits [`RetryBudget::RATIO`] of an attempt, up to a reserve of
//! [`RetryBudget::RESERVE`]; each failover spends one. Over any stretch of traffic, attempts are
//! then at most `1 + RATIO` per request, plus the reserve, which lets a freshly started router
//! fail over the streams of one dead replica before it has seen much traffic.

use std::sync::Mutex;

#[derive(Debug)]
pub struct RetryBudget {
    balance: Mutex<f64>,
}

impl Default for RetryBudget {
    fn default() -> Self {
        Self {
            balance: Mutex::new(Self::RESERVE),
        }
    }
}

impl RetryBudget {
    /// Failovers earned per client request.
    pub const RATIO: f64 = 0.2;
    /// Most failovers that can be saved up: about the streams one replica carries at once in
    /// a small cluster. A larger reserve let a 2 s outage of the KV path take 1.31 attempts per
    /// request over 32 requests, past the 1.2 of the reliability contract (C7).
    pub const RESERVE: f64 = 5.0;

    fn balance(&self) -> std::sync::MutexGuard<'_, f64> {
        // A single float; a poisoned lock still holds a consistent value.
        self.balance.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a client request.
    pub fn deposit(&self) {
        let mut b = self.balance();
        *b = (*b + Self::RATIO).min(Self::RESERVE);
    }

    /// Takes one failover from the budget, if it holds one.
    pub fn try_spend(&self) -> bool {
        let mut b = self.balance();
        if *b >= 1.0 {
            *b -= 1.0;
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
}
