//! The continuous-batching scheduler: one thread owns the engine and runs one batched decode step
//! after another. New sequences join and finished or cancelled ones leave between steps; it never
//! waits on a remote prefill, because a sequence only joins once its KV has arrived and been
//! verified. A short uncached suffix may instead be prefilled here (conditional
//! disaggregation), which pauses the batch for that long.
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
//! and there are at most `max_slots` of those, each sending at most one `Open`, one `Start` and
//! one `Cancel`. Event channels hold a whole generation, so a slow client never blocks a step.

use std::collections::HashMap;
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Instant;

use tandem_engine::{Decoding, Emission, Engine, KvExport, SeqId, Stream};
use tandem_worker::{CacheHub, Throughput};
use tokio::sync::{mpsc as tmpsc, oneshot};

use crate::metrics::DecodeMetrics;

/// Identifies one admitted request to the scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ticket(pub u64);

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
    Kv { kv: KvExport, first_token: u32 },
    /// Computed here.
    Local,
}

#[derive(Debug)]
pub struct Start {
    pub ticket: Ticket,
    pub prompt: Vec<u32>,
    /// The request's cache partition: the finished sequence is kept under it.
    pub cache_salt: String,
    pub input: Input,
    /// The generation's state: fresh, or resumed after tokens an earlier attempt delivered.
    pub stream: Stream,
    pub events: tmpsc::Sender<Event>,
}

#[derive(Debug)]
enum Command {
    Open {
        ticket: Ticket,
        hashes: Vec<u64>,
        reply: oneshot::Sender<usize>,
    },
    Start(Box<Start>),
    Cancel(Ticket),
}

struct Active {
    decoding: Decoding,
    cache_salt: String,
    events: tmpsc::Sender<Event>,
}

/// The front of the scheduler thread; cloning shares the thread.
#[derive(Clone, Debug)]
pub struct SchedulerHandle {
    tx: mpsc::Sender<Command>,
}

/// What the scheduler shares with the rest of the node.
#[derive(Debug)]
pub struct Shared {
    pub metrics: DecodeMetrics,
    pub hub: Arc<CacheHub>,
    /// Local prefill speed.
    pub throughput: Throughput,
}

impl SchedulerHandle {
    /// Starts the thread. It ends when every handle is dropped.
    pub fn spawn(engine: Engine, shared: Arc<Shared>) -> std::io::Result<(Self, JoinHandle<()>)> {
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("tandem-decode-scheduler".into())
            .spawn(move || Scheduler::new(engine, shared).run(&rx))?;
        Ok((Self { tx }, thread))
    }

    /// Opens `ticket`'s sequence on the longest cached prefix of `hashes`; returns the tokens it
    /// holds, or `None` if the scheduler is gone.
    pub async fn open(&self, ticket: Ticket, hashes: Vec<u64>) -> Option<usize> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Command::Open {
                ticket,
                hashes,
                reply,
            })
            .ok()?;
        answer.await.ok()
    }

    /// Completes an opened sequence and adds it to the batch. `false` if the scheduler is gone.
    pub fn start(&self, start: Start) -> bool {
        self.tx.send(Command::Start(Box::new(start))).is_ok()
    }

    /// Removes a sequence, opened or running (a no-op if it already finished).
    pub fn cancel(&self, ticket: Ticket) {
        let _ = self.tx.send(Command::Cancel(ticket));
    }
}

struct Scheduler {
    engine: Engine,
    shared: Arc<Shared>,
    opened: HashMap<Ticket, SeqId>,
    active: HashMap<Ticket, Active>,
}

impl Scheduler {
    fn new(engine: Engine, shared: Arc<Shared>) -> Self {
        let mut s = Self {
            engine,
            shared,
            opened: HashMap::new(),
            active: HashMap::new(),
        };
        s.publish();
        s
    }

    fn run(mut self, rx: &mpsc::Receiver<Command>) {
        loop {
            if self.active.is_empty() {
                match rx.recv() {
                    Ok(c) => self.handle(c),
                    Err(_) => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(c) => self.handle(c),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => return,
                }
            }
            if !self.active.is_empty() {
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
                reply,
            } => {
                let (seq, cached) = self.engine.new_sequence_cached(&hashes);
                self.opened.insert(ticket, seq);
                if reply.send(cached).is_err() {
                    self.remove(ticket);
                }
            }
            Command::Start(start) => self.start(*start),
            Command::Cancel(ticket) => self.remove(ticket),
        }
    }

    fn remove(&mut self, ticket: Ticket) {
        if let Some(seq) = self.opened.remove(&ticket) {
            let _ = self.engine.free(seq);
        }
        if let Some(a) = self.active.remove(&ticket) {
            let _ = self.engine.free(a.decoding.seq);
        }
    }

    fn start(&mut self, s: Start) {
        let Some(seq) = self.opened.remove(&s.ticket) else {
            // Cancelled before it started.
            return;
        };
        let n = s.prompt.len();
        let first = match s.input {
            Input::Kv { kv, first_token } => self.engine.import_kv(seq, &kv).map(|()| first_token),
            Input::Local => self.prefill(seq, &s.prompt, &s.stream, &s.events),
        };
        let next = match first {
            Ok(t) => t,
            Err(e) => {
                let _ = self.engine.free(seq);
                let _ = s.events.try_send(Event::Failed(Arc::new(e)));
                return;
            }
        };
        debug_assert_eq!(self.engine.seq_len(seq).ok(), Some(n));
        let mut a = Active {
            decoding: Decoding::new(seq, s.stream, s.prompt, next),
            cache_salt: s.cache_salt,
            events: s.events,
        };
        let tokenizer = &self.engine.model().tokenizer;
        let first = a.decoding.stream.accept(tokenizer, next);
        if self.deliver(&mut a, vec![first]) {
            self.active.insert(s.ticket, a);
        } else {
            let _ = self.engine.free(a.decoding.seq);
        }
    }

    /// Computes the prompt's uncached rest on `seq` and samples the first token, exactly as a
    /// prefill node would.
    fn prefill(
        &mut self,
        seq: SeqId,
        prompt: &[u32],
        stream: &Stream,
        events: &tmpsc::Sender<Event>,
    ) -> tandem_engine::Result<u32> {
        let started = Instant::now();
        let cached = self.engine.seq_len(seq)?;
        let logits = self.engine.prefill(seq, &prompt[cached..])?;
        let secs = started.elapsed().as_secs_f64();
        let computed = prompt.len() - cached;
        self.shared.throughput.record(computed, secs);
        self.shared
            .metrics
            .local_prefill_tokens
            .inc_by(computed as u64);
        let _ = events.try_send(Event::Prefilled { ms: secs * 1e3 });
        Ok(stream.sample(&logits, prompt.len()))
    }

    /// Tells the request what a step emitted; `false` when the sequence leaves the batch. A
    /// finished sequence's KV is cached, and the cache events sent, before its last frame goes
    /// out, so a follow-up turn finds the router's index already current.
    fn deliver(&mut self, a: &mut Active, emissions: Vec<Emission>) -> bool {
        let finished = emissions.iter().any(|e| e.finished.is_some());
        let tokens = emissions.iter().filter(|e| e.token.is_some()).count();
        self.shared.metrics.tokens.inc_by(tokens as u64);
        if finished {
            self.keep(a);
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

    /// Keeps a sequence's full blocks (prompt and reply) in the session cache.
    fn keep(&mut self, a: &Active) {
        if !self.engine.prefix_cache_enabled() {
            return;
        }
        let hashes =
            tandem_worker::block_hashes(self.engine.model(), &a.cache_salt, &a.decoding.tokens);
        if let Err(e) = self.engine.cache_sequence(a.decoding.seq, &hashes) {
            tracing::warn!(error = %e, "could not keep a finished sequence's KV");
        }
        self.shared.hub.publish(self.engine.take_cache_events());
    }

    fn step(&mut self) {
        let mut active: Vec<(Ticket, Active)> = self.active.drain().collect();
        let mut batch: Vec<&mut Decoding> =
            active.iter_mut().map(|(_, a)| &mut a.decoding).collect();
        let started = Instant::now();
        let result = self.engine.decode_step(&mut batch);
        let m = &self.shared.metrics;
        m.steps.inc();
        m.step_seconds.observe(started.elapsed().as_secs_f64());
        match result {
            Ok(step) => {
                m.draft_tokens.inc_by(step.drafted as u64);
                m.accepted_draft_tokens.inc_by(step.accepted as u64);
                for ((ticket, mut a), emissions) in active.into_iter().zip(step.emissions) {
                    if self.deliver(&mut a, emissions) {
                        self.active.insert(ticket, a);
                    } else {
                        let _ = self.engine.free(a.decoding.seq);
                    }
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "decode step failed; failing the batch");
                let e = Arc::new(e);
                for (_, a) in active {
                    let _ = self.engine.free(a.decoding.seq);
                    let _ = a.events.try_send(Event::Failed(e.clone()));
                }
            }
        }
    }
}
