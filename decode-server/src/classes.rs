//! Priority classes in the decode batch: which ready sequence takes a free batch slot, and which
//! running one a ready sequence of a higher class pauses (preemption).
//!
//! - A sequence's class is its request's (`DecodeRequest.priority`, [`Class::from_pb`]):
//!   interactive, standard (also when unset) or batch.
//! - **Slots**: a free slot goes to the ready sequence of the best rank, in the order of a
//!   [`FairQueue`] (the router's admission order's): its class, one class higher for each
//!   [`tandem_proto::policy::AGE_STEP`] it has waited for a slot, so no class waits for good: a
//!   free slot goes to a batch stream paused for 20 s before a fresh interactive one. At equal
//!   rank a paused stream goes first (its client has begun reading it), then the longest
//!   waiting. (Decode requests carry no tenant: the tenants' shares are kept where requests
//!   queue for a place, at the router and the prefill node.)
//! - **Preemption**: with every slot taken, a ready sequence whose class is higher than a running
//!   sequence's pauses the running one of the lowest class (of those, the latest to join), and
//!   takes its slot. Preemption goes by the classes themselves, not aged: aging orders the free
//!   slots, so that streams of one class never pause each other.
//! - **Batch yields beside interactive**: while an interactive stream runs or is ready, streams
//!   ranked batch hold at most a few slots (`--batch-slots-beside-interactive`): the latest to
//!   join of the others are paused, and no more take a slot, so that the batch's steps stay
//!   short for the interactive streams' tokens. A batch stream that has waited an age step ranks
//!   standard and is no longer held back.
//! - **Never twice in a row**: a stream that resumed after a pause is not paused again until it
//!   has generated [`SHIELD_TOKENS`] more tokens.
//!
//! The policy is kept apart from the engine so its rules can be tested on their own, on paused
//! time.

use tandem_proto::policy::{Claim, Class, FairQueue};
use tokio::time::Instant;

use crate::ticket::Ticket;

/// Tokens a resumed stream generates before it may be paused again.
pub const SHIELD_TOKENS: usize = 16;

/// Where a sequence stands in the batch's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Standing {
    pub class: Class,
    /// Tokens it generates before it may be paused again.
    pub shield: usize,
}

impl Standing {
    pub fn new(class: Class) -> Self {
        Self { class, shield: 0 }
    }

    /// Counts `tokens` generated against the shield.
    pub fn generated(&mut self, tokens: usize) {
        self.shield = self.shield.saturating_sub(tokens);
    }
}

/// A ready sequence without a slot.
#[derive(Debug)]
pub struct Ready<T> {
    pub ticket: Ticket,
    pub standing: Standing,
    /// Paused by a preemption (its stream has begun), not yet in the batch since.
    pub paused: bool,
    /// When it began waiting for a slot.
    pub since: Instant,
    pub item: T,
}

impl<T> Ready<T> {
    /// Its class, aged by its wait.
    pub fn class_now(&self, now: Instant) -> Class {
        (self.standing.class).aged(now.saturating_duration_since(self.since))
    }
}

/// The ready sequences without a slot: [`Queue::pop_best`] takes them in the fair queue's
/// order.
#[derive(Debug)]
pub struct Queue<T> {
    ready: FairQueue<Ready<T>>,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Self {
            ready: FairQueue::default(),
        }
    }
}

impl<T> Queue<T> {
    pub fn push(&mut self, ready: Ready<T>) {
        let claim = Claim {
            class: ready.standing.class,
            tenant: Default::default(),
            begun: ready.paused,
        };
        self.ready.push_since(claim, ready.since, ready);
    }

    pub fn len(&self) -> usize {
        self.ready.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ready.is_empty()
    }

    /// The ready sequences, in no order.
    pub fn iter(&self) -> impl Iterator<Item = &Ready<T>> {
        self.ready.iter().map(|e| &e.item)
    }

    pub fn get(&self, ticket: Ticket) -> Option<&Ready<T>> {
        self.iter().find(|r| r.ticket == ticket)
    }

    pub fn remove(&mut self, ticket: Ticket) -> Option<Ready<T>> {
        let id = self.ready.iter().find(|e| e.item.ticket == ticket)?.id();
        self.ready.remove(id).map(|e| e.item)
    }

    /// The sequence of the highest class (not aged) of those `may_go` lets, the longest waiting
    /// of that class: the one a preemption is for.
    pub fn highest_class(&self, may_go: impl Fn(&Ready<T>) -> bool) -> Option<(Ticket, Class)> {
        (self.iter().filter(|r| may_go(r)))
            .min_by_key(|r| (r.standing.class, !r.paused, r.since, r.ticket.0))
            .map(|r| (r.ticket, r.standing.class))
    }

    /// Takes the sequence that goes next of those `may_go` lets.
    pub fn pop_best(
        &mut self,
        now: Instant,
        may_go: impl Fn(&Ready<T>) -> bool,
    ) -> Option<Ready<T>> {
        (self.ready.pop_first(now, |e| may_go(&e.item))).map(|e| e.item)
    }
}

/// The running sequence that a ready sequence of class `class` pauses: the lowest class below
/// it (of those, the latest to join, the highest ticket), not shielded; `None` if no running
/// sequence is below it.
pub fn victim(running: impl Iterator<Item = (Ticket, Standing)>, class: Class) -> Option<Ticket> {
    running
        .filter(|(_, s)| s.class > class && s.shield == 0)
        .max_by_key(|(t, s)| (s.class, t.0))
        .map(|(t, _)| t)
}

/// While an interactive stream runs or is ready (`interactive`), the batch stream to pause
/// because more than `beside` batch streams run: the latest to join, not shielded.
pub fn batch_excess(
    running: impl Iterator<Item = (Ticket, Standing)> + Clone,
    interactive: bool,
    beside: usize,
) -> Option<Ticket> {
    let batch = |(_, s): &(Ticket, Standing)| s.class == Class::Batch;
    if !interactive || running.clone().filter(batch).count() <= beside {
        return None;
    }
    running
        .filter(|r| batch(r) && r.1.shield == 0)
        .max_by_key(|(t, _)| t.0)
        .map(|(t, _)| t)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tandem_proto::policy::AGE_STEP;

    use super::*;

    const INTERACTIVE: Class = Class::Interactive;
    const STANDARD: Class = Class::Standard;
    const BATCH: Class = Class::Batch;

    fn ready(ticket: u64, class: Class, paused: bool) -> Ready<()> {
        Ready {
            ticket: Ticket(ticket),
            standing: Standing::new(class),
            paused,
            since: Instant::now(),
            item: (),
        }
    }

    fn order(q: &mut Queue<()>) -> Vec<u64> {
        let now = Instant::now();
        std::iter::from_fn(|| q.pop_best(now, |_| true).map(|r| r.ticket.0)).collect()
    }

    /// A free slot goes by class first, then to a paused stream before a fresh one, then to the
    /// longest waiting.
    #[tokio::test(start_paused = true)]
    async fn slots_go_by_class_then_paused_then_arrival() {
        let mut q = Queue::default();
        q.push(ready(1, BATCH, false));
        tokio::time::advance(Duration::from_millis(1)).await;
        q.push(ready(2, STANDARD, false));
        tokio::time::advance(Duration::from_millis(1)).await;
        q.push(ready(3, BATCH, true));
        tokio::time::advance(Duration::from_millis(1)).await;
        q.push(ready(4, INTERACTIVE, false));
        tokio::time::advance(Duration::from_millis(1)).await;
        q.push(ready(5, STANDARD, false));
        assert_eq!(order(&mut q), [4, 2, 5, 3, 1]);
    }

    /// A ready sequence rises one class per age step: a batch stream paused for one step goes
    /// before a standard one that just came, for two before an interactive one.
    #[tokio::test(start_paused = true)]
    async fn waiting_ages_a_class_per_step() {
        let mut q = Queue::default();
        q.push(ready(1, BATCH, true));
        tokio::time::advance(AGE_STEP - Duration::from_millis(1)).await;
        q.push(ready(2, STANDARD, false));
        assert_eq!(q.highest_class(|_| true), Some((Ticket(2), STANDARD)));
        assert_eq!(order(&mut q), [2, 1]);

        let mut q = Queue::default();
        q.push(ready(1, BATCH, true));
        tokio::time::advance(AGE_STEP).await;
        q.push(ready(2, STANDARD, false));
        assert_eq!(order(&mut q), [1, 2]);

        let mut q = Queue::default();
        q.push(ready(1, BATCH, true));
        tokio::time::advance(2 * AGE_STEP).await;
        q.push(ready(2, INTERACTIVE, false));
        // Aged, it takes the free slot first; a preemption is still for the interactive one.
        assert_eq!(q.highest_class(|_| true), Some((Ticket(2), INTERACTIVE)));
        assert_eq!(order(&mut q), [1, 2]);
    }

    /// A waiter pauses the lowest class below it, the latest to join of those; nothing at or
    /// above its rank.
    #[test]
    fn the_victim_is_the_lowest_class_latest_joined() {
        let running = [
            (Ticket(1), Standing::new(BATCH)),
            (Ticket(2), Standing::new(STANDARD)),
            (Ticket(3), Standing::new(BATCH)),
            (Ticket(4), Standing::new(INTERACTIVE)),
        ];
        assert_eq!(victim(running.into_iter(), INTERACTIVE), Some(Ticket(3)));
        assert_eq!(victim(running.into_iter(), STANDARD), Some(Ticket(3)));
        assert_eq!(victim(running.into_iter(), BATCH), None);
        let high = [(Ticket(1), Standing::new(INTERACTIVE))];
        assert_eq!(victim(high.into_iter(), INTERACTIVE), None);
    }

    /// A resumed stream is not paused again until it has generated its shield's tokens: the
    /// waiter pauses another one meanwhile, or none.
    #[test]
    fn a_resumed_stream_is_not_paused_twice_in_a_row() {
        let mut resumed = Standing {
            class: BATCH,
            shield: SHIELD_TOKENS,
        };
        let other = Standing::new(STANDARD);
        let running = |r: Standing| [(Ticket(9), r), (Ticket(1), other)].into_iter();
        assert_eq!(victim(running(resumed), INTERACTIVE), Some(Ticket(1)));
        assert_eq!(
            victim([(Ticket(9), resumed)].into_iter(), INTERACTIVE),
            None
        );
        resumed.generated(SHIELD_TOKENS - 1);
        assert_eq!(victim(running(resumed), INTERACTIVE), Some(Ticket(1)));
        resumed.generated(1);
        assert_eq!(victim(running(resumed), INTERACTIVE), Some(Ticket(9)));
    }

    /// Beside an interactive stream, batch streams keep `beside` slots: the latest unshielded
    /// one past them is paused; without an interactive stream, none is.
    #[test]
    fn batch_yields_beside_interactive() {
        let running = [
            (Ticket(1), Standing::new(BATCH)),
            (Ticket(2), Standing::new(INTERACTIVE)),
            (Ticket(3), Standing::new(BATCH)),
            (
                Ticket(4),
                Standing {
                    class: BATCH,
                    shield: 3,
                },
            ),
            (Ticket(5), Standing::new(STANDARD)),
        ];
        assert_eq!(batch_excess(running.into_iter(), true, 1), Some(Ticket(3)));
        assert_eq!(batch_excess(running.into_iter(), true, 2), Some(Ticket(3)));
        assert_eq!(batch_excess(running.into_iter(), true, 3), None);
        assert_eq!(batch_excess(running.into_iter(), false, 0), None);
        let shielded = [(Ticket(4), running[3].1), (Ticket(1), running[0].1)];
        assert_eq!(batch_excess(shielded.into_iter(), true, 1), Some(Ticket(1)));
    }
}
