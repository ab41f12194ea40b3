//! The admission order: which of the requests waiting for a model's decode replicas may take
//! the next place. Without it every waiting request raced for each place that came free, first
//! come or not.
//!
//! The order is a [`FairQueue`]: classes in strict order, aged by the wait; within a class the
//! tenant served the fewest tokens per weight first (each tenant is charged the prompt tokens
//! of each request admitted and the tokens generated when it ends); then arrival. A failover
//! (an attempt after the first) is not ranked: its stream has begun, and it takes the next
//! place it finds.

use std::sync::{Arc, Mutex, MutexGuard};

use tandem_proto::policy::{Claim, Class, FairQueue};
use tokio::sync::Notify;
use tokio::time::Instant;

/// Who asks for a place.
#[derive(Clone, Debug)]
pub struct Asker {
    pub model: Arc<str>,
    pub class: Class,
    pub tenant: Arc<str>,
}

impl Asker {
    fn claim(&self) -> Claim {
        Claim {
            class: self.class,
            tenant: self.tenant.clone(),
            begun: false,
        }
    }
}

/// The admission order of the router's requests: the waiting ones, each with its model.
#[derive(Debug, Default)]
pub struct Order {
    queue: Mutex<FairQueue<Arc<str>>>,
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
        self.order.lock().remove(self.id);
        self.order.left.notify_waiters();
    }
}

impl Order {
    fn lock(&self) -> MutexGuard<'_, FairQueue<Arc<str>>> {
        // Single inserts, removes and passes; a poisoned lock is still consistent.
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Resolves when a waiting request leaves the order.
    pub fn left(&self) -> tokio::sync::futures::Notified<'_> {
        self.left.notified()
    }

    /// A place for `asker`, waiting from now.
    pub fn join(self: &Arc<Self>, asker: Asker) -> Ticket {
        let id = self.lock().push(asker.claim(), asker.model);
        Ticket {
            order: self.clone(),
            id,
        }
    }

    /// Whether `asker` (waiting under `ticket`, or a newcomer without one) goes before every
    /// other request waiting for its model.
    pub fn is_first(&self, asker: &Asker, ticket: Option<&Ticket>) -> bool {
        let q = self.lock();
        let now = Instant::now();
        let own = ticket.and_then(|t| q.get(t.id));
        let rank = match own {
            Some(entry) => q.rank(entry, now),
            None => q.newcomer(&asker.claim(), now),
        };
        let same_model = |e: &tandem_proto::policy::Entry<Arc<str>>| e.item == asker.model;
        !q.any_ahead(rank, own.map(|e| e.id()), now, same_model)
    }

    /// Charges `tenant` for `tokens` served, at its `weight`.
    pub fn charge(&self, tenant: &Arc<str>, weight: f64, tokens: u64) {
        self.lock().charge(tenant, weight, tokens);
    }
}

#[cfg(test)]
mod tests {
    use tandem_proto::policy::AGE_STEP;

    use super::*;

    fn asker(class: Class, tenant: &str) -> Asker {
        Asker {
            model: "m".into(),
            class,
            tenant: tenant.into(),
        }
    }

    // The ranking itself (classes, aging, tenants' shares) is the fair queue's, tested in
    // `tandem_proto::policy`; these test the order's tickets and its models apart.

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
}
