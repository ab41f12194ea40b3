//! The scheduler's front: the thread's start, and the commands the request tasks send it.

use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use tandem_engine::{Engine, KvExport};
use tandem_worker::moves::EngineCache;
use tokio::sync::oneshot;

use super::{Command, Scheduler, Shared, Slots, Start};
use crate::ticket::Ticket;

/// The front of the scheduler thread; cloning shares the thread.
#[derive(Clone, Debug)]
pub struct SchedulerHandle {
    tx: mpsc::Sender<Command>,
}

impl SchedulerHandle {
    /// Starts the thread, with `handoff_bytes` of KV that a drain may keep for hand-offs. It
    /// ends when every handle is dropped.
    pub fn spawn(
        engine: Engine,
        shared: Arc<Shared>,
        slots: Slots,
    ) -> std::io::Result<(Self, JoinHandle<()>)> {
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("tandem-decode-scheduler".into())
            .spawn(move || Scheduler::new(engine, shared, slots).run(&rx))?;
        Ok((Self { tx }, thread))
    }

    /// Sends the command `command` makes of a reply channel and waits for the answer; `None`
    /// if the scheduler is gone.
    async fn ask<T>(&self, command: impl FnOnce(oneshot::Sender<T>) -> Command) -> Option<T> {
        let (reply, answer) = oneshot::channel();
        self.tx.send(command(reply)).ok()?;
        answer.await.ok()
    }

    /// Opens `ticket`'s sequence on the longest cached prefix of `hashes`, after keeping the
    /// `fetched` KV of its first tokens in the cache; returns what it holds, or `None` if the
    /// scheduler is gone.
    pub async fn open(
        &self,
        ticket: Ticket,
        hashes: Vec<u64>,
        fetched: Option<KvExport>,
    ) -> Option<tandem_engine::Reused> {
        self.ask(|reply| Command::Open {
            ticket,
            hashes,
            fetched,
            reply,
        })
        .await
    }

    /// Stops `ticket`'s sequence for a hand-off. The answer, the tokens of KV kept for a peer
    /// (0: none), comes before the sequence's event channel closes.
    pub fn hand_off(&self, ticket: Ticket) -> oneshot::Receiver<usize> {
        let (reply, answer) = oneshot::channel();
        let _ = self.tx.send(Command::HandOff { ticket, reply });
        answer
    }

    /// The scheduler's cache, as the KV moves reach it.
    pub fn cache(&self) -> EngineCache {
        let tx = self.tx.clone();
        EngineCache::new(move |c| tx.send(Command::Cache(c)).is_ok())
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
