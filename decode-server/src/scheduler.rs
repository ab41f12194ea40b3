//! The continuous-batching scheduler: one thread owns the engine and runs one batched decode step
//! after another. New sequences join and finished or cancelled ones leave between steps; it never
//! waits on a prefill, because a sequence only reaches it once its KV has arrived and been
//! verified.
//!
//! ```text
//! request tasks ──Command::{Start, Cancel}──▶ scheduler thread ──Event per step──▶ request task
//!                  (std mpsc; bounded by           engine.step(batch)              (tokio mpsc sized
//!                   admission's slot count)                                        max_tokens + 2)
//! ```
//!
//! The command queue needs no bound of its own: every command belongs to an admitted request,
//! and there are at most `max_slots` of those, each sending at most one `Start` and one `Cancel`.
//! Event channels hold a whole generation, so a slow client never blocks a step.

use std::collections::HashMap;
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Instant;

use tandem_engine::{Emission, Engine, GenerateParams, KvExport, SeqId, Stream};
use tokio::sync::mpsc as tmpsc;

use crate::metrics::DecodeMetrics;

/// Identifies one admitted request to the scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ticket(pub u64);

#[derive(Debug)]
pub enum Event {
    Token(Emission),
    /// The engine failed; the sequence is gone.
    Failed(Arc<tandem_engine::Error>),
}

#[derive(Debug)]
pub struct Start {
    pub ticket: Ticket,
    pub kv: KvExport,
    pub first_token: u32,
    pub params: GenerateParams,
    pub events: tmpsc::Sender<Event>,
}

#[derive(Debug)]
enum Command {
    Start(Box<Start>),
    Cancel(Ticket),
}

struct Active {
    seq: SeqId,
    stream: Stream,
    /// The token to feed at the next step.
    next: u32,
    /// Tokens in the sequence once `next` is fed (the position `next`'s logits sample for).
    len: usize,
    events: tmpsc::Sender<Event>,
}

/// The front of the scheduler thread; cloning shares the thread.
#[derive(Clone, Debug)]
pub struct SchedulerHandle {
    tx: mpsc::Sender<Command>,
}

impl SchedulerHandle {
    /// Starts the thread. It ends when every handle is dropped.
    pub fn spawn(
        engine: Engine,
        metrics: DecodeMetrics,
    ) -> std::io::Result<(Self, JoinHandle<()>)> {
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("tandem-decode-scheduler".into())
            .spawn(move || Scheduler::new(engine, metrics).run(&rx))?;
        Ok((Self { tx }, thread))
    }

    /// Hands a sequence with its verified KV to the batch. `false` if the scheduler is gone.
    pub fn start(&self, start: Start) -> bool {
        self.tx.send(Command::Start(Box::new(start))).is_ok()
    }

    /// Removes a sequence (a no-op if it already finished).
    pub fn cancel(&self, ticket: Ticket) {
        let _ = self.tx.send(Command::Cancel(ticket));
    }
}

struct Scheduler {
    engine: Engine,
    metrics: DecodeMetrics,
    active: HashMap<Ticket, Active>,
}

impl Scheduler {
    fn new(engine: Engine, metrics: DecodeMetrics) -> Self {
        let s = Self {
            engine,
            metrics,
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

    fn publish(&self) {
        let total = self.engine.kv_blocks_total();
        let free = self.engine.kv_blocks_free();
        self.metrics.active_slots.set(self.active.len() as i64);
        self.metrics.kv_blocks_free.set(free as i64);
        self.metrics.kv_blocks_in_use.set((total - free) as i64);
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Start(start) => self.start(*start),
            Command::Cancel(ticket) => self.remove(ticket),
        }
    }

    fn remove(&mut self, ticket: Ticket) {
        if let Some(a) = self.active.remove(&ticket) {
            let _ = self.engine.free(a.seq);
        }
    }

    fn start(&mut self, s: Start) {
        let seq = self.engine.new_sequence();
        if let Err(e) = self.engine.import_kv(seq, &s.kv) {
            let _ = self.engine.free(seq);
            let _ = s.events.try_send(Event::Failed(Arc::new(e)));
            return;
        }
        let mut a = Active {
            seq,
            stream: Stream::new(s.params),
            next: s.first_token,
            len: s.kv.tokens.end,
            events: s.events,
        };
        if self.accept(&mut a) {
            self.active.insert(s.ticket, a);
        } else {
            let _ = self.engine.free(seq);
        }
    }

    /// Accepts `a.next` and tells the request; `false` when the sequence leaves the batch.
    fn accept(&self, a: &mut Active) -> bool {
        let tokenizer = &self.engine.model().tokenizer;
        let emission = a.stream.accept(tokenizer, a.next);
        let finished = emission.finished.is_some();
        if emission.token.is_some() {
            self.metrics.tokens.inc();
        }
        // A full channel cannot happen (it holds a whole generation); closed means the
        // request is gone. Either way the sequence leaves.
        a.events.try_send(Event::Token(emission)).is_ok() && !finished
    }

    fn step(&mut self) {
        let tickets: Vec<Ticket> = self.active.keys().copied().collect();
        let batch: Vec<(SeqId, u32)> = tickets
            .iter()
            .map(|t| (self.active[t].seq, self.active[t].next))
            .collect();
        let started = Instant::now();
        let result = self.engine.step(&batch);
        self.metrics.steps.inc();
        self.metrics
            .step_seconds
            .observe(started.elapsed().as_secs_f64());
        match result {
            Ok(logits) => {
                for (ticket, logits) in tickets.iter().zip(&logits) {
                    let Some(mut a) = self.active.remove(ticket) else {
                        continue;
                    };
                    a.len += 1;
                    a.next = a.stream.sample(logits, a.len);
                    if self.accept(&mut a) {
                        self.active.insert(*ticket, a);
                    } else {
                        let _ = self.engine.free(a.seq);
                    }
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "decode step failed; failing the batch");
                let e = Arc::new(e);
                for (_, a) in self.active.drain() {
                    let _ = self.engine.free(a.seq);
                    let _ = a.events.try_send(Event::Failed(e.clone()));
                }
            }
        }
    }
}
