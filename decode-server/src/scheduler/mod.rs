//! The continuous-batching scheduler: one thread owns the engine and runs one batched decode step
//! after another. New sequences join and finished or cancelled ones leave between steps; it never
//! waits on a remote prefill, because a sequence only joins once its KV has arrived and been
//! verified, and been copied into the pool a few layers per round ([`import`]). An uncached
//! suffix may instead be prefilled here (conditional disaggregation): a chunk per step, computed
//! in the step's own forward pass (the weights are read once for both), each sized so that it
//! adds about 0.6 of a plain step's time, so running streams keep their pace (their gaps grow by
//! less than that share) while a prompt is computed. With nothing decoding, a prompt goes an
//! engine chunk at a time.
//!
//! At most `max_slots` sequences decode at once. A sequence takes its batch slot only once it
//! holds its whole prompt's KV (pushed or computed here): one that is ready while every slot is
//! taken emits its first token and waits for a sequence to leave, in the order of the requests'
//! priority classes, or pauses a running stream of a lower class and takes its slot; the paused
//! stream's KV is parked (pinned in the pool or on the disk tier, [`crate::park`]) and it resumes
//! where it stood once a slot is its ([`crate::classes`] has the rules). Requests still waiting
//! for their KV hold no slot, only their KV blocks (admission).
//!
//! ```text
//! request tasks ──Command::{Open, Start, Cancel}──▶ scheduler thread ──Event per step──▶ request task
//!                  (std mpsc; bounded by               engine.step(batch)                  (tokio mpsc sized
//!                   admission's slot count)                                                 max_tokens + 3)
//! ```
//!
//! A request first opens its sequence on the longest prefix the session cache holds (which pins
//! those blocks until it ends), then starts it with the rest of its KV. When a sequence finishes,
//! its full blocks (prompt and reply) stay in the session cache, and the cache's events go to
//! the [`CacheHub`].
//!
//! The command queue needs no bound of its own: every command belongs to an admitted request,
//! and admission has a bounded number of places (see [`crate::admission`]), each sending at most one `Open`, one `Start` and
//! one `Cancel`. Event channels hold a whole generation, so a slow client never blocks a step.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use tandem_engine::{
    Decoding, Emission, Engine, KvExport, PromptChunk, SeqId, Stream, TokenLogprobs,
};
use tandem_worker::moves::{self, CacheCommand, Handoffs, Recent};
use tandem_worker::{CacheHub, Throughput};
use tokio::sync::{mpsc as tmpsc, oneshot};

use crate::classes::{Queue, Ready, Standing};
use crate::metrics::DecodeMetrics;
use crate::ticket::Ticket;

mod handle;
mod handoff;
mod import;
mod local;
mod slots;

pub use handle::SchedulerHandle;

use import::Importing;
use local::{PLAIN_STEP_EVERY, Prefilling};
use slots::Slotless;

#[derive(Debug)]
pub enum Event {
    /// The uncached suffix was computed here, in this many milliseconds.
    Prefilled { ms: f64 },
    /// What one step emitted for the sequence (several tokens when drafts were accepted), and
    /// its speculation totals so far.
    Tokens {
        emissions: Vec<Emission>,
        drafted: u64,
        accepted: u64,
    },
    /// The engine failed; the sequence is gone.
    Failed(Arc<tandem_engine::Error>),
}

/// How the rest of a sequence's prompt arrives.
#[derive(Debug)]
pub enum Input {
    /// Pushed by a prefill node: the KV after the cached prefix, and the first token.
    Kv {
        kv: KvExport,
        first_token: u32,
        /// The first token's log-probabilities, sampled with it on the prefill node.
        first_logprobs: Option<TokenLogprobs>,
    },
    /// Computed here.
    Local,
}

#[derive(Debug)]
pub struct Start {
    pub input: Input,
    pub joining: Joining,
}

/// A started sequence, besides its KV: what it needs to join the batch.
#[derive(Debug)]
pub struct Joining {
    pub ticket: Ticket,
    pub prompt: Vec<u32>,
    /// The request's cache partition: the finished sequence is kept under it.
    pub cache_salt: String,
    pub class: tandem_proto::policy::Class,
    /// The generation's state: fresh, or resumed after tokens an earlier attempt delivered.
    pub stream: Stream,
    pub events: tmpsc::Sender<Event>,
}

#[derive(Debug)]
enum Command {
    Open {
        ticket: Ticket,
        hashes: Vec<u64>,
        /// KV fetched from a peer for the first tokens, kept in the cache before the lookup.
        fetched: Option<KvExport>,
        reply: oneshot::Sender<tandem_engine::Reused>,
    },
    Start(Box<Start>),
    Cancel(Ticket),
    /// Drain: stop a running sequence, keeping its KV in the cache (within the budget); the
    /// reply is the tokens kept, 0 when none were. Its event channel closes after the reply.
    HandOff {
        ticket: Ticket,
        reply: oneshot::Sender<usize>,
    },
    /// The KV moves' ([`tandem_worker::moves`]): peer fetches, adoptions, the drain's offer
    /// (within what the hand-off budget leaves once the running sequences' hand-offs are
    /// counted).
    Cache(CacheCommand),
}

struct Active {
    decoding: Decoding,
    cache_salt: String,
    standing: Standing,
    events: tmpsc::Sender<Event>,
}

/// The scheduler's bounds.
#[derive(Clone, Copy, Debug)]
pub struct Slots {
    /// Sequences decoded at once.
    pub max_slots: usize,
    /// Bytes of KV a drain may keep for hand-offs.
    pub handoff_bytes: u64,
    /// Bytes of KV paused streams may keep pinned in the pool; past it they park on disk.
    pub pinned_bytes: u64,
    /// Slots batch streams keep while an interactive stream runs or is ready.
    pub batch_beside: usize,
}

/// What the scheduler shares with the rest of the node.
#[derive(Debug)]
pub struct Shared {
    pub metrics: DecodeMetrics,
    pub hub: Arc<CacheHub>,
    /// Local prefill speed.
    pub throughput: Throughput,
    /// Sequences kept at drain for peers to fetch.
    pub handoffs: Arc<Handoffs>,
}

struct Scheduler {
    engine: Engine,
    shared: Arc<Shared>,
    opened: HashMap<Ticket, SeqId>,
    /// Pushed KV being copied into the pool, a few layers per round.
    importing: VecDeque<Importing>,
    /// First come, first computed: one chunk of the front one per round.
    prefilling: VecDeque<Prefilling>,
    active: HashMap<Ticket, Active>,
    /// Ready sequences waiting for a batch slot, and paused ones.
    ready: Queue<Slotless>,
    max_slots: usize,
    /// Bytes paused streams may keep pinned in the pool, and those they keep.
    pinned_room: u64,
    pinned: u64,
    /// Slots batch streams keep beside an interactive stream.
    batch_beside: usize,
    /// How long the last step without a prompt chunk took.
    plain_step_secs: f64,
    /// Steps with a chunk since the last one without.
    fused_steps: u32,
    /// Bytes of KV the drain may still keep for hand-offs.
    handoff_budget: u64,
    /// The sessions kept in the cache, for a drain to offer.
    recent: Recent,
}

impl Scheduler {
    fn new(engine: Engine, shared: Arc<Shared>, slots: Slots) -> Self {
        let mut s = Self {
            engine,
            shared,
            opened: HashMap::new(),
            importing: VecDeque::new(),
            prefilling: VecDeque::new(),
            active: HashMap::new(),
            ready: Queue::default(),
            max_slots: slots.max_slots,
            pinned_room: slots.pinned_bytes,
            pinned: 0,
            batch_beside: slots.batch_beside,
            plain_step_secs: 0.0,
            fused_steps: 0,
            handoff_budget: slots.handoff_bytes,
            recent: Recent::default(),
        };
        s.publish();
        s
    }

    fn run(mut self, rx: &mpsc::Receiver<Command>) {
        loop {
            if self.active.is_empty() && self.prefilling.is_empty() && self.importing.is_empty() {
                // A stream parked on disk may wait a moment for its writes (`SETTLE_WAIT`).
                let command = if self.ready.is_empty() {
                    rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected)
                } else {
                    rx.recv_timeout(Duration::from_millis(5))
                };
                match command {
                    Ok(c) => self.handle(c),
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(c) => self.handle(c),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => return,
                }
            }
            self.import_some();
            self.fill_slots();
            if self.active.is_empty() {
                self.prefill_alone();
            } else {
                self.step();
            }
            self.publish();
        }
    }

    /// Reports the cache's changes (blocks kept, or evicted for room) and the gauges.
    fn publish(&mut self) {
        self.shared.hub.publish(self.engine.take_cache_events());
        let m = &self.shared.metrics;
        let total = self.engine.kv_blocks_total();
        let free = self.engine.kv_blocks_free();
        m.active_slots.set(self.active.len() as i64);
        let paused = self.ready.iter().filter(|r| r.paused).count();
        m.waiting_sequences.set((self.ready.len() - paused) as i64);
        m.parked_streams.set(paused as i64);
        m.kv_blocks_free.set(free as i64);
        m.kv_blocks_in_use.set((total - free) as i64);
        m.kv_blocks_cached
            .set(self.engine.kv_blocks_cached() as i64);
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Open {
                ticket,
                hashes,
                fetched,
                reply,
            } => {
                if let Some(kv) = fetched
                    && let Err(e) =
                        moves::keep_fetched(&mut self.engine, &self.shared.hub, &hashes, &kv)
                {
                    tracing::warn!(error = %e, "could not keep fetched KV");
                }
                let (seq, cached) = self.engine.new_sequence_cached(&hashes);
                self.opened.insert(ticket, seq);
                if reply.send(cached).is_err() {
                    self.remove(ticket);
                }
            }
            Command::Start(start) => self.start(*start),
            Command::Cancel(ticket) => self.remove(ticket),
            Command::HandOff { ticket, reply } => {
                self.finish_import(ticket);
                let kept = self.hand_off(ticket);
                // The reply goes before the sequence's event channel closes (`remove`), so the
                // request reads it once its last events are read.
                let _ = reply.send(kept);
                self.remove(ticket);
            }
            Command::Cache(command) => {
                let mut left = self.handoff_budget.saturating_sub(self.running_bytes());
                let before = left;
                command.answer(
                    &mut self.engine,
                    &self.shared.hub,
                    &mut self.recent,
                    &mut left,
                );
                self.handoff_budget -= before - left;
            }
        }
    }

    fn remove(&mut self, ticket: Ticket) {
        if let Some(seq) = self.opened.remove(&ticket) {
            let _ = self.engine.free(seq);
        }
        if let Some(a) = self.active.remove(&ticket) {
            let _ = self.engine.free(a.decoding.seq);
        }
        if let Some(i) = self
            .importing
            .iter()
            .position(|i| i.joining.ticket == ticket)
            && let Some(i) = self.importing.remove(i)
        {
            let _ = self.engine.free(i.seq);
        }
        if let Some(r) = self.ready.remove(ticket) {
            self.drop_slotless(r.item);
        }
        if let Some(i) = self
            .prefilling
            .iter()
            .position(|p| p.joining.ticket == ticket)
            && let Some(p) = self.prefilling.remove(i)
        {
            let _ = self.engine.free(p.seq);
        }
    }

    fn start(&mut self, s: Start) {
        let Start { input, joining } = s;
        let Some(seq) = self.opened.remove(&joining.ticket) else {
            // Cancelled before it started.
            return;
        };
        match input {
            Input::Kv {
                kv,
                first_token,
                first_logprobs,
            } => {
                let mut joining = joining;
                joining.stream.carry_logprobs(first_logprobs);
                let importing = Importing::new(seq, kv, first_token, joining);
                self.importing.push_back(importing);
            }
            Input::Local => match self.engine.seq_len(seq) {
                Ok(done) => (self.prefilling).push_back(Prefilling::new(seq, joining, done)),
                Err(e) => self.fail(seq, &joining.events, e),
            },
        }
    }

    /// Frees a sequence that could not start and tells its request why.
    fn fail(&mut self, seq: SeqId, events: &tmpsc::Sender<Event>, e: tandem_engine::Error) {
        let _ = self.engine.free(seq);
        let _ = events.try_send(Event::Failed(Arc::new(e)));
    }

    /// Emits the first token, `next`, of a sequence that holds its whole prompt, and adds it to
    /// the batch, or to the queue for a slot when the batch is full. The prompt's full blocks go
    /// into the session cache first, so that requests for the same prompt that arrive while
    /// this one runs (a request's other choices) share them instead of computing them again.
    fn join(&mut self, seq: SeqId, j: Joining, next: u32) {
        debug_assert_eq!(self.engine.seq_len(seq).ok(), Some(j.prompt.len()));
        self.keep(seq, &j.cache_salt, &j.prompt);
        let mut a = Active {
            decoding: Decoding::new(seq, j.stream, j.prompt, next),
            cache_salt: j.cache_salt,
            standing: Standing::new(j.class),
            events: j.events,
        };
        let tokenizer = &self.engine.model().tokenizer;
        let first = a.decoding.stream.accept(tokenizer, next);
        if !self.deliver(&mut a, vec![first]) {
            let _ = self.engine.free(a.decoding.seq);
        } else {
            self.ready.push(Ready {
                ticket: j.ticket,
                standing: a.standing,
                paused: false,
                since: tokio::time::Instant::now(),
                item: Slotless {
                    active: a,
                    paused: None,
                },
            });
        }
    }

    /// Tells the request what a step emitted; `false` when the sequence leaves the batch. A
    /// finished sequence's KV is cached, and the cache events sent, before its last frame goes
    /// out, so a follow-up turn finds the router's index already current.
    fn deliver(&mut self, a: &mut Active, emissions: Vec<Emission>) -> bool {
        let finished = emissions.iter().any(|e| e.finished.is_some());
        let tokens = emissions.iter().filter(|e| e.token.is_some()).count();
        self.shared.metrics.tokens.inc_by(tokens as u64);
        if finished {
            self.keep(a.decoding.seq, &a.cache_salt, &a.decoding.tokens);
        }
        let drafter = &a.decoding.drafter;
        let event = Event::Tokens {
            emissions,
            drafted: drafter.drafted,
            accepted: drafter.accepted,
        };
        // A full channel cannot happen (it holds a whole generation); closed means the
        // request is gone. Either way the sequence leaves.
        a.events.try_send(event).is_ok() && !finished
    }

    /// Keeps the full blocks of `tokens`, which `seq` holds (its prompt, or prompt and reply),
    /// in the session cache, and sends the cache events; the hash of the last block kept.
    fn keep(&mut self, seq: SeqId, cache_salt: &str, tokens: &[u32]) -> Option<u64> {
        if !self.engine.prefix_cache_enabled() {
            return None;
        }
        let hashes = tandem_worker::block_hashes(self.engine.model(), cache_salt, tokens);
        let kept = match self.engine.cache_sequence(seq, &hashes) {
            Ok(()) => {
                self.recent.kept(cache_salt, tokens, &hashes);
                hashes.last().copied()
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not keep a sequence's KV");
                None
            }
        };
        self.shared.hub.publish(self.engine.take_cache_events());
        kept
    }

    /// One batch step, with the next chunk of the oldest prompt being prefilled here in the
    /// same pass (but for one step in [`PLAIN_STEP_EVERY`], which measures a plain step).
    fn step(&mut self) {
        self.hold_back();
        let mut active: Vec<(Ticket, Active)> = self.active.drain().collect();
        let mut batch: Vec<&mut Decoding> =
            active.iter_mut().map(|(_, a)| &mut a.decoding).collect();
        let plain = self.fused_steps + 1 >= PLAIN_STEP_EVERY || self.plain_step_secs == 0.0;
        let front = self.prefilling.front().filter(|_| !plain);
        let chunk =
            front.map(|p| p.done..(p.done + self.chunk_tokens(p)).min(p.joining.prompt.len()));
        let piggyback = front.zip(chunk.clone()).map(|(p, c)| PromptChunk {
            seq: p.seq,
            last: c.end == p.joining.prompt.len(),
            tokens: &p.joining.prompt[c],
        });
        let started = Instant::now();
        let result = self.engine.decode_step_with(&mut batch, piggyback);
        let secs = started.elapsed().as_secs_f64();
        let m = &self.shared.metrics;
        m.steps.inc();
        m.step_seconds.observe(secs);
        match (&chunk, self.prefilling.front_mut()) {
            (Some(c), Some(p)) => {
                self.fused_steps += 1;
                let tokens = c.len();
                // What the chunk added to a plain step.
                p.secs_per_token = Some((secs - self.plain_step_secs).max(0.0) / tokens as f64);
                p.last_chunk = tokens;
                p.computed_to(c.end, secs);
            }
            _ => {
                self.fused_steps = 0;
                self.plain_step_secs = secs;
            }
        }
        match result {
            Ok((step, logits)) => {
                m.draft_tokens.inc_by(step.drafted as u64);
                m.accepted_draft_tokens.inc_by(step.accepted as u64);
                for ((ticket, mut a), emissions) in active.into_iter().zip(step.emissions) {
                    a.standing
                        .generated(emissions.iter().filter(|e| e.token.is_some()).count());
                    if self.deliver(&mut a, emissions) {
                        self.active.insert(ticket, a);
                    } else {
                        let _ = self.engine.free(a.decoding.seq);
                    }
                }
                if let Some(logits) = logits {
                    self.prefilled(logits);
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "decode step failed; failing the batch");
                let e = Arc::new(e);
                for (_, a) in active {
                    let _ = self.engine.free(a.decoding.seq);
                    let _ = a.events.try_send(Event::Failed(e.clone()));
                }
                // The prompt computed in the same pass fails with it.
                if chunk.is_some()
                    && let Some(p) = self.prefilling.pop_front()
                {
                    let _ = self.engine.free(p.seq);
                    let _ = p.joining.events.try_send(Event::Failed(e));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
