//! The admission order: which of the requests waiting for a model's decode replicas may take
//! the next place. Without it every waiting request raced for each place that came free, first
//! come or not.
//!
//! ```text
//! rank = (class, less the classes it has aged; tokens its tenant was served ÷ its weight; arrival)
//! ```
//!
//! - **Classes in strict order**: `interactive`, then `standard`, then `batch`
//!   ([`crate::auth::Class`]). **Aging**: a request that has waited [`tandem_proto::PRIORITY_AGE_STEP`] (10 s) is ranked one
//!   class higher, and one more for each further step, so a class is never starved for good.
//! - **Within a class, fairness between keys by tokens served** (a virtual token counter, after
//!   Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024): each tenant is
//!   charged the prompt tokens of each request admitted and the tokens generated when it ends,
//!   divided by its key's weight, and the tenant charged least goes first. A tenant that starts
//!   waiting again is lifted to the least counter among those waiting, so that idling earns no
//!   credit: a key that floods gets its weighted share, not the whole cluster, and one that
//!   comes back is not starved by a history it did not use.
//! - Then arrival.
//!
//! A failover (an attempt after the first) is not ranked: its stream has begun, and it takes
//! the next place it finds.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::auth::Class;

/// Who asks for a place.
#[derive(Clone, Debug)]
pub struct Asker {
    pub model: Arc<str>,
    pub class: Class,
    pub tenant: Arc<str>,
}

#[derive(Debug)]
struct Waiter {
    asker: Asker,
    since: Instant,
}

#[derive(Debug, Default)]
struct State {
    next: u64,
    waiting: HashMap<u64, Waiter>,
    /// Tokens served per tenant, divided by its weight.
    served: HashMap<Arc<str>, f64>,
}

impl State {
    fn served(&self, tenant: &str) -> f64 {
        self.served.get(tenant).copied().unwrap_or(0.0)
    }

    /// `asker`'s counter as it starts waiting: idling earns no credit, so a tenant that had
    /// nothing waiting in the class starts at least at the least counter of those that have.
    fn joining(&self, asker: &Asker) -> f64 {
        let own = self.served(&asker.tenant);
        let in_class = |w: &&Waiter| w.asker.class == asker.class;
        if (self.waiting.values().filter(in_class)).any(|w| w.asker.tenant == asker.tenant) {
            return own;
        }
        let floor = (self.waiting.values().filter(in_class))
            .map(|w| self.served(&w.asker.tenant))
            .min_by(f64::total_cmp);
        floor.map_or(own, |floor| own.max(floor))
    }

    /// The rank of `asker`, of counter `served`, waiting since `since`: lower goes first.
    fn rank(
        asker: &Asker,
        served: f64,
        since: Instant,
        id: u64,
        now: Instant,
    ) -> (u8, f64, Instant, u64) {
        let class =
            tandem_proto::aged_class(asker.class as u8, now.saturating_duration_since(since));
        (class, served, since, id)
    }
}

/// The admission order of the router's requests.
#[derive(Debug, Default)]
pub struct Order {
    state: Mutex<State>,
    /// Woken when a waiting request leaves (admitted, refused or gone): the next may go.
    left: Notify,
}

/// A waiting request's place in the order, given up when dropped.
#[derive(Debug)]
pub struct Ticket {
    order: Arc<Order>,
    id: u64,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.order.lock().waiting.remove(&self.id);
        self.order.left.notify_waiters();
    }
}

impl Order {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Single inserts, removes and sums; a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Resolves when a waiting request leaves the order.
    pub fn left(&self) -> tokio::sync::futures::Notified<'_> {
        self.left.notified()
    }

    /// A place for `asker`, waiting from now.
    pub fn join(self: &Arc<Self>, asker: Asker) -> Ticket {
        let mut s = self.lock();
        let served = s.joining(&asker);
        s.served.insert(asker.tenant.clone(), served);
        let id = s.next;
        s.next += 1;
        let since = Instant::now();
        s.waiting.insert(id, Waiter { asker, since });
        Ticket {
            order: self.clone(),
            id,
        }
    }

    /// Whether `asker` (waiting under `ticket`, or a newcomer without one) goes before every
    /// other request waiting for its model.
    pub fn is_first(&self, asker: &Asker, ticket: Option<&Ticket>) -> bool {
        let s = self.lock();
        let now = Instant::now();
        let mine = match ticket.and_then(|t| Some((t.id, s.waiting.get(&t.id)?))) {
            Some((id, w)) => State::rank(asker, s.served(&asker.tenant), w.since, id, now),
            None => State::rank(asker, s.joining(asker), now, u64::MAX, now),
        };
        let ahead = (s.waiting.iter())
            .filter(|(id, w)| Some(**id) != ticket.map(|t| t.id) && w.asker.model == asker.model)
            .any(|(id, w)| {
                State::rank(&w.asker, s.served(&w.asker.tenant), w.since, *id, now) < mine
            });
        !ahead
    }

    /// Charges `tenant` for `tokens` served, at its `weight`.
    pub fn charge(&self, tenant: &Arc<str>, weight: f64, tokens: u64) {
        let mut s = self.lock();
        *s.served.entry(tenant.clone()).or_insert(0.0) += tokens as f64 / weight.max(1e-3);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tandem_proto::PRIORITY_AGE_STEP as AGE_STEP;

    use super::*;

    fn asker(class: Class, tenant: &str) -> Asker {
        Asker {
            model: "m".into(),
            class,
            tenant: tenant.into(),
        }
    }

    /// Classes go in strict order; a newcomer of a higher class goes before those waiting, one
    /// of the same class after them; another model's requests are not in the way.
    #[tokio::test(start_paused = true)]
    async fn classes_go_in_strict_order() {
        let order = Arc::new(Order::default());
        let batch = asker(Class::Batch, "a");
        let waiting = order.join(batch.clone());
        assert!(order.is_first(&batch, Some(&waiting)), "alone");
        let interactive = asker(Class::Interactive, "b");
        assert!(
            order.is_first(&interactive, None),
            "a higher class goes first"
        );
        assert!(
            !order.is_first(&batch, None),
            "a newcomer of the same class waits its turn"
        );
        let standing = order.join(interactive.clone());
        assert!(!order.is_first(&batch, Some(&waiting)));
        let other_model = Asker {
            model: "other".into(),
            ..asker(Class::Batch, "c")
        };
        assert!(order.is_first(&other_model, None), "only its model's queue");
        drop(standing);
        assert!(order.is_first(&batch, Some(&waiting)));
    }

    /// A waiting request rises a class per AGE_STEP: batch waiting two steps goes before a
    /// standard newcomer, then before an interactive one.
    #[tokio::test(start_paused = true)]
    async fn waiting_requests_age_into_higher_classes() {
        let order = Arc::new(Order::default());
        let batch = asker(Class::Batch, "a");
        let waiting = order.join(batch.clone());
        assert!(order.is_first(&asker(Class::Standard, "b"), None));
        tokio::time::advance(AGE_STEP).await;
        assert!(
            !order.is_first(&asker(Class::Standard, "b"), None),
            "aged to standard, and it came first"
        );
        assert!(order.is_first(&asker(Class::Interactive, "b"), None));
        tokio::time::advance(AGE_STEP).await;
        assert!(!order.is_first(&asker(Class::Interactive, "b"), None));
        assert!(order.is_first(&batch, Some(&waiting)));
    }

    /// Within a class the tenant served fewer tokens per weight goes first, whatever the
    /// arrival order; one that comes back after idling starts at the least counter waiting.
    #[tokio::test(start_paused = true)]
    async fn tenants_share_by_tokens_served_over_their_weight() {
        let order = Arc::new(Order::default());
        let (flood, light) = (
            asker(Class::Standard, "flood"),
            asker(Class::Standard, "light"),
        );
        let first = order.join(flood.clone());
        tokio::time::advance(Duration::from_millis(1)).await;
        let second = order.join(light.clone());
        order.charge(&flood.tenant, 1.0, 10_000);
        order.charge(&light.tenant, 1.0, 1_000);
        assert!(order.is_first(&light, Some(&second)), "served less: first");
        assert!(!order.is_first(&flood, Some(&first)));
        // Weighted: 20000 tokens at weight 20 count 1000, under flood's 10000.
        let heavy = asker(Class::Standard, "heavy");
        let third = order.join(heavy.clone());
        order.charge(&heavy.tenant, 20.0, 20_000);
        drop(second);
        assert!(order.is_first(&heavy, Some(&third)));
        // A tenant never served starts at the least counter waiting (heavy's: it joined at
        // light's 1000 and was charged 1000 more), not at 0: no first place for having been
        // away.
        let idle = asker(Class::Standard, "idle");
        assert!(
            !order.is_first(&idle, None),
            "ranked after heavy, who waited longer"
        );
        let _fourth = order.join(idle.clone());
        assert_eq!(order.lock().served("idle"), 2_000.0);
    }

    /// Simulated: two keys of equal weight keep requests waiting, one with ten times the
    /// other's tokens per request. Taking the first of the order for each free place, each is
    /// served about half the tokens.
    #[tokio::test(start_paused = true)]
    async fn a_key_that_floods_gets_its_share() {
        let order = Arc::new(Order::default());
        let (big, small) = (
            asker(Class::Standard, "big"),
            asker(Class::Standard, "small"),
        );
        let mut served: HashMap<&str, u64> = HashMap::new();
        let mut tickets: Vec<(Asker, u64, Ticket)> = Vec::new();
        for _ in 0..2000 {
            for (a, cost) in [(&big, 1000u64), (&small, 100)] {
                while tickets
                    .iter()
                    .filter(|(w, ..)| w.tenant == a.tenant)
                    .count()
                    < 4
                {
                    tickets.push((a.clone(), cost, order.join(a.clone())));
                }
            }
            let next = (0..tickets.len())
                .find(|&i| order.is_first(&tickets[i].0, Some(&tickets[i].2)))
                .expect("someone goes first");
            let (a, cost, ticket) = tickets.remove(next);
            order.charge(&a.tenant, 1.0, cost);
            *served
                .entry(if &*a.tenant == "big" { "big" } else { "small" })
                .or_default() += cost;
            drop(ticket);
        }
        let total = (served["big"] + served["small"]) as f64;
        let small_share = served["small"] as f64 / total;
        eprintln!("the small key's share of the tokens served: {small_share:.3}");
        assert!(
            small_share >= 0.4,
            "small got {small_share:.3} of the tokens"
        );
    }
}
