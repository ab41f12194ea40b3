//! A generation's frames, shared by every client stream attached to it. This is what makes
//! request ids idempotent: a retry with a running id attaches to the same log and replays it
//! from frame 0, instead of starting a second generation.
//!
//! The producer appends; each subscriber reads from its own cursor, until every choice's last
//! frame or a status. When the last subscriber goes, [`LogWriter::abandoned`] resolves and the
//! producer stops the downstream work.

use std::sync::{Arc, Mutex, MutexGuard};

use futures::Stream;
use tandem_proto::v1 as pb;
use tokio::sync::watch;
use tonic::Status;

pub type Item = Result<pb::GenerateResponse, Status>;

/// Whether `f` is its choice's last frame.
pub(crate) fn is_last(f: &pb::GenerateResponse) -> bool {
    f.finish_reason != pb::FinishReason::Unspecified as i32
}

#[derive(Debug)]
struct Shared {
    frames: Mutex<Vec<Item>>,
    /// The generation's choices: its stream ends after as many last frames.
    choices: u32,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Vec<Item>> {
        // Appends are single pushes; a poisoned lock is still consistent.
        self.frames.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The producer's end.
#[derive(Debug)]
pub struct LogWriter {
    shared: Arc<Shared>,
    len: watch::Sender<usize>,
}

/// One subscriber's end.
#[derive(Debug)]
pub struct LogReader {
    shared: Arc<Shared>,
    len: watch::Receiver<usize>,
}

impl LogWriter {
    /// The log of a generation of `choices` choices.
    pub fn new(choices: u32) -> Arc<Self> {
        let (len, _) = watch::channel(0);
        Arc::new(Self {
            shared: Arc::new(Shared {
                frames: Mutex::new(Vec::new()),
                choices: choices.max(1),
            }),
            len,
        })
    }

    /// A new subscriber, which will replay from frame 0.
    pub fn subscribe(&self) -> LogReader {
        LogReader {
            shared: self.shared.clone(),
            len: self.len.subscribe(),
        }
    }

    pub fn push(&self, item: Item) {
        let len = {
            let mut frames = self.shared.lock();
            frames.push(item);
            frames.len()
        };
        self.len.send_replace(len);
    }

    /// Resolves when no subscriber is left.
    pub async fn abandoned(&self) {
        self.len.closed().await;
    }

    /// Resolves once the log holds a frame or a status.
    pub async fn first_frame(&self) {
        // The sender lives in `self`, so the wait cannot fail.
        let _ = self.len.subscribe().wait_for(|&n| n > 0).await;
    }
}

impl LogReader {
    /// The frames from the first, following the producer until every choice's last frame, or
    /// a status.
    pub fn stream(self) -> impl Stream<Item = Item> + Send + 'static {
        let open = self.shared.choices;
        futures::stream::unfold((self, 0usize, open), |(mut r, i, open)| async move {
            if open == 0 {
                return None;
            }
            loop {
                // A status keeps its metadata (retry pushback) for every reader.
                let next = r.shared.lock().get(i).cloned();
                if let Some(item) = next {
                    let open = match &item {
                        Err(_) => 0,
                        Ok(f) if is_last(f) => open - 1,
                        Ok(_) => open,
                    };
                    return Some((item, (r, i + 1, open)));
                }
                if r.len.changed().await.is_err() {
                    // The producer is gone without a last frame: never a silent end.
                    let lost = Status::unavailable("the generation ended without a final frame");
                    return Some((Err(lost), (r, i, 0)));
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use super::*;

    fn frame(choice: u32, last: bool) -> Item {
        let finish = if last {
            pb::FinishReason::Stop
        } else {
            pb::FinishReason::Unspecified
        };
        Ok(pb::GenerateResponse {
            choice,
            finish_reason: finish as i32,
            ..Default::default()
        })
    }

    #[tokio::test]
    async fn a_reader_ends_after_every_choices_last_frame_or_a_status() {
        let log = LogWriter::new(2);
        let reader = log.subscribe();
        for (choice, last) in [(0, false), (1, false), (0, true), (1, false), (1, true)] {
            log.push(frame(choice, last));
        }
        log.push(frame(1, false));
        let read: Vec<Item> = reader.stream().collect().await;
        assert_eq!(
            read.len(),
            5,
            "the frame after both last frames is not read"
        );

        let log = LogWriter::new(2);
        let reader = log.subscribe();
        log.push(frame(0, true));
        log.push(Err(Status::unavailable("gone")));
        let read: Vec<Item> = reader.stream().collect().await;
        assert_eq!(read.len(), 2);
        assert!(read[1].is_err(), "a status ends the stream");
    }
}
