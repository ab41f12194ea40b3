//! A generation's frames, shared by every client stream attached to it. This is what makes
//! request ids idempotent: a retry with a running id attaches to the same log and replays it
//! from frame 0, instead of starting a second generation.
//!
//! The producer appends; each subscriber reads from its own cursor. When the last subscriber
//! goes, [`LogWriter::abandoned`] resolves and the producer stops the downstream work.

use std::sync::{Arc, Mutex, MutexGuard};

use futures::Stream;
use tandem_proto::v1 as pb;
use tokio::sync::watch;
use tonic::Status;

pub type Item = Result<pb::GenerateResponse, Status>;

fn is_last(item: &Item) -> bool {
    item.as_ref().map_or(true, |f| {
        f.finish_reason != pb::FinishReason::Unspecified as i32
    })
}

#[derive(Debug)]
struct Shared {
    frames: Mutex<Vec<Item>>,
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
    pub fn new() -> Arc<Self> {
        let (len, _) = watch::channel(0);
        Arc::new(Self {
            shared: Arc::new(Shared {
                frames: Mutex::new(Vec::new()),
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
}

impl LogReader {
    /// The frames from the first, following the producer until the last frame or status.
    pub fn stream(self) -> impl Stream<Item = Item> + Send + 'static {
        futures::stream::unfold((self, 0usize, false), |(mut r, i, done)| async move {
            if done {
                return None;
            }
            loop {
                // A status keeps its metadata (retry pushback) for every reader.
                let next = r.shared.lock().get(i).cloned();
                if let Some(item) = next {
                    let last = is_last(&item);
                    return Some((item, (r, i + 1, last)));
                }
                if r.len.changed().await.is_err() {
                    // The producer is gone without a last frame: never a silent end.
                    let lost = Status::unavailable("the generation ended without a final frame");
                    return Some((Err(lost), (r, i, true)));
                }
            }
        })
    }
}
