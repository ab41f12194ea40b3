//! Batch slots: the ready sequences take the free slots in the classes' order, and a ready
//! stream of a higher class pauses a running one of a lower class, whose KV is parked (pinned
//! in the pool or on the disk tier, [`crate::park`]) until it resumes where it stood.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_engine::Engine;
use tandem_proto::policy::Class;

use super::{Active, Event, Scheduler};
use crate::classes::{self, Ready, SHIELD_TOKENS};
use crate::park::{self, Parked};
use crate::ticket::Ticket;

/// How long a stream parked on disk waits for its blocks' writes before it may resume anyway,
/// computing again what is not written yet.
const SETTLE_WAIT: Duration = Duration::from_secs(1);

/// A ready sequence without a batch slot: fresh, or paused with its KV parked.
pub(super) struct Slotless {
    pub(super) active: Active,
    pub(super) paused: Option<Pause>,
}

pub(super) struct Pause {
    parked: Parked,
    /// Bytes it keeps pinned in the pool (0 when parked on disk).
    pinned: u64,
    at: Instant,
}

impl Scheduler {
    /// Gives the free batch slots to the ready sequences, in the classes' order, pausing a
    /// running stream of a lower class for each ready one of a higher class when no slot is
    /// free ([`crate::classes`]).
    pub(super) fn fill_slots(&mut self) {
        let now = tokio::time::Instant::now();
        loop {
            let interactive = (self.active.values().map(|a| a.standing.class))
                .chain(self.ready.iter().map(|r| r.standing.class))
                .any(|c| c == Class::Interactive);
            let running = self.active.iter().map(|(t, a)| (*t, a.standing));
            if let Some(excess) = classes::batch_excess(running, interactive, self.batch_beside) {
                self.pause(excess, now);
                continue;
            }
            let batch_running = (self.active.values())
                .filter(|a| a.standing.class == Class::Batch)
                .count();
            // Beside an interactive stream, no more batch-ranked streams than their slots.
            let full = interactive && batch_running >= self.batch_beside;
            let held_back = |r: &Ready<Slotless>| full && r.class_now(now) == Class::Batch;
            let may_go = |r: &Ready<Slotless>| r.item.may_go(&self.engine) && !held_back(r);
            if self.active.len() >= self.max_slots {
                // Preemption goes by the classes themselves: aging orders free slots only.
                let Some((waiter, class)) = self.ready.highest_class(may_go) else {
                    return;
                };
                let running = self.active.iter().map(|(t, a)| (*t, a.standing));
                let Some(victim) = classes::victim(running, class) else {
                    return;
                };
                self.pause(victim, now);
                if let Some(next) = self.ready.remove(waiter) {
                    self.take_slot(next);
                }
                continue;
            }
            let Some(next) = self.ready.pop_best(now, may_go) else {
                return;
            };
            self.take_slot(next);
        }
    }

    /// Beside an interactive stream, the streams of lower classes decode a token a step,
    /// without drafts: a step's drafted rows lengthen it for every stream in it, and the
    /// interactive one's gaps are the steps. Counts the rows kept from drafting, and a step
    /// taken while batch-ranked streams wait for a slot (held back, or finding none free).
    pub(super) fn hold_back(&mut self) {
        let interactive = (self.active.values()).any(|a| a.standing.class == Class::Interactive);
        for a in self.active.values_mut() {
            a.decoding.may_draft = !interactive || a.standing.class == Class::Interactive;
        }
        if !interactive {
            return;
        }
        let lower = (self.active.values())
            .filter(|a| a.standing.class != Class::Interactive)
            .count();
        self.shared.metrics.undrafted_rows.inc_by(lower as u64);
        let now = tokio::time::Instant::now();
        let held = (self.ready.iter())
            .filter(|r| r.class_now(now) == Class::Batch)
            .count();
        if held > 0 {
            let m = &self.shared.metrics;
            m.held_back_steps.inc();
            m.held_back_rows.inc_by(held as u64);
        }
    }

    /// Takes a running stream out of the batch, parking its KV, until a slot is its again.
    pub(super) fn pause(&mut self, ticket: Ticket, now: tokio::time::Instant) {
        let Some(active) = self.active.remove(&ticket) else {
            return;
        };
        let room = self.pinned_room.saturating_sub(self.pinned);
        let parking = park::park(&mut self.engine, &active.decoding, &active.cache_salt, room);
        self.shared.hub.publish(self.engine.take_cache_events());
        let pinned = match parking.parked {
            Parked::Pinned => parking.bytes,
            Parked::Disk { .. } => 0,
        };
        self.pinned += pinned;
        let m = &self.shared.metrics;
        m.preemptions.inc();
        m.parked_bytes.inc_by(parking.bytes);
        m.parked_disk_bytes.inc_by(parking.to_disk);
        tracing::debug!(
            ticket = ticket.0,
            class = %active.standing.class,
            bytes = parking.bytes,
            to_disk = parking.to_disk,
            "paused a stream for a higher class"
        );
        self.ready.push(Ready {
            ticket,
            standing: active.standing,
            paused: true,
            since: now,
            item: Slotless {
                active,
                paused: Some(Pause {
                    parked: parking.parked,
                    pinned,
                    at: Instant::now(),
                }),
            },
        });
    }

    /// Puts a ready sequence into the batch, bringing a paused one's KV back first.
    pub(super) fn take_slot(&mut self, ready: Ready<Slotless>) {
        let Slotless { mut active, paused } = ready.item;
        if let Some(pause) = paused {
            self.pinned -= pause.pinned;
            let started = Instant::now();
            let resumed = park::resume(&mut self.engine, &mut active.decoding, pause.parked);
            self.shared.hub.publish(self.engine.take_cache_events());
            let m = &self.shared.metrics;
            match resumed {
                Ok(r) => {
                    m.resume_seconds.observe(started.elapsed().as_secs_f64());
                    m.paused_seconds.observe(pause.at.elapsed().as_secs_f64());
                    m.recomputed_tokens.inc_by(r.recomputed as u64);
                    active.standing.shield = SHIELD_TOKENS;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot resume a paused stream");
                    let _ = active.events.try_send(Event::Failed(Arc::new(e)));
                    return;
                }
            }
        }
        self.active.insert(ready.ticket, active);
    }

    /// The ready sequences without a slot whose KV is in the pool.
    pub(super) fn slotless_in_pool(&self) -> impl Iterator<Item = &Active> {
        self.ready
            .iter()
            .filter(|r| r.item.in_pool())
            .map(|r| &r.item.active)
    }

    /// Ends a ready sequence that has no slot. A stream parked on disk holds no sequence: its
    /// blocks stay in the session cache, as a finished stream's do.
    pub(super) fn drop_slotless(&mut self, s: Slotless) {
        if let Some(p) = &s.paused {
            self.pinned -= p.pinned;
        }
        if s.in_pool() {
            let _ = self.engine.free(s.active.decoding.seq);
        }
    }
}

impl Slotless {
    /// Whether it may take a slot: fresh, pinned, or parked on disk with its blocks written (or
    /// waiting for them no longer, [`SETTLE_WAIT`]).
    pub(super) fn may_go(&self, engine: &Engine) -> bool {
        self.paused
            .as_ref()
            .is_none_or(|p| p.at.elapsed() >= SETTLE_WAIT || park::settled(engine, &p.parked))
    }

    /// Whether its sequence holds its KV in the pool (fresh, or paused and pinned).
    pub(super) fn in_pool(&self) -> bool {
        !matches!(
            self.paused,
            Some(Pause {
                parked: Parked::Disk { .. },
                ..
            })
        )
    }
}
