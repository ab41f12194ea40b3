//! The sending side: [`KvPush`] streams one transfer to a decode node's `KvTransfer` service.
//!
//! Frames go through a bounded channel of [`PUSH_BUFFER_FRAMES`] into the gRPC stream, so a slow
//! receiver (HTTP/2 flow control) blocks the producer instead of growing its memory, for at most
//! [`PUSH_STALL`] at a time ([`KvPush::send_within`]): a receiver that takes nothing (a
//! handshake or connection that stalls without failing) fails the push instead of holding the
//! producer, a prefill node's one compute thread.

use std::time::Duration;

use tandem_proto::v1 as pb;
use tandem_proto::v1::push_frame::Frame;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use crate::error::{Error, Result};
use crate::format::{Chunk, Header, digest_append};

/// Frames buffered between the producer and the gRPC stream.
pub const PUSH_BUFFER_FRAMES: usize = 8;

/// How often a [`Heartbeat`] tells the receiver the push is still coming, by default. A
/// receiver's bound on silence must be longer.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);

/// The longest a push may take no frame before its sender gives it up ([`Error::Stalled`]).
/// A healthy receiver takes a frame within milliseconds; a dead one is found sooner by the
/// connection's keepalive; this bounds the rest (a stalled TLS handshake, a receiver that
/// answers pings but reads nothing).
pub const PUSH_STALL: Duration = Duration::from_secs(5);

/// `chunks` as wire frames, in order, and the digest that the trailer after them carries.
pub(crate) fn chunk_frames(chunks: &[Chunk]) -> (Vec<pb::PushFrame>, u32) {
    let mut digest = 0;
    let frames = chunks
        .iter()
        .map(|c| {
            let wire = c.to_pb();
            digest = digest_append(digest, wire.crc32c);
            pb::PushFrame {
                frame: Some(Frame::Chunk(wire)),
            }
        })
        .collect();
    (frames, digest)
}

/// One transfer in progress.
#[derive(Debug)]
pub struct KvPush {
    tx: mpsc::Sender<pb::PushFrame>,
    task: JoinHandle<Result<pb::PushAck>>,
    digest: u32,
    /// Test builds only: this push sends its first chunk with a flipped byte.
    #[cfg(feature = "failpoints")]
    corrupt: bool,
}

impl KvPush {
    /// Opens the push on `channel` and queues the header.
    pub fn start(channel: Channel, header: &Header) -> Self {
        let (tx, rx) = mpsc::channel(PUSH_BUFFER_FRAMES);
        let first = pb::PushFrame {
            frame: Some(Frame::Header(header.to_pb())),
        };
        // Capacity is at least one, so the header always fits.
        let _ = tx.try_send(first);
        // The push belongs to the caller's trace.
        let mut request = tonic::Request::new(ReceiverStream::new(rx));
        tandem_net::otel::inject(request.metadata_mut());
        let task = tokio::spawn(async move {
            let mut client =
                tandem_proto::limits!(pb::kv_transfer_client::KvTransferClient::new(channel));
            Ok(client
                .push(request)
                .await
                .map_err(Error::from)?
                .into_inner())
        });
        Self {
            tx,
            task,
            digest: 0,
            #[cfg(feature = "failpoints")]
            corrupt: failpoints::corrupt_kv(),
        }
    }

    /// A push answered as a server stream (`Prefill.Relay`, a pipelined prefill's hop to its
    /// next stage) rather than sent to a decode node: its frames, the header first, come out of
    /// the returned stream, which the caller reads and checks as a push's receiver does
    /// ([`crate::relay::RelayReceiver`]). Nothing acknowledges it: [`KvPush::finish`] answers an
    /// empty ack once the trailer is queued, and a caller gone shows as [`Error::ReceiverGone`]
    /// on the next send.
    pub fn relay(header: &Header) -> (Self, ReceiverStream<pb::PushFrame>) {
        let (tx, rx) = mpsc::channel(PUSH_BUFFER_FRAMES);
        let first = pb::PushFrame {
            frame: Some(Frame::Header(header.to_pb())),
        };
        let _ = tx.try_send(first);
        let task = tokio::spawn(async { Ok(pb::PushAck::default()) });
        let push = Self {
            tx,
            task,
            digest: 0,
            #[cfg(feature = "failpoints")]
            corrupt: false,
        };
        (push, ReceiverStream::new(rx))
    }

    fn frame(&mut self, chunk: &Chunk) -> pb::PushFrame {
        #[allow(unused_mut)]
        let mut wire = chunk.to_pb();
        self.digest = digest_append(self.digest, wire.crc32c);
        #[cfg(feature = "failpoints")]
        if std::mem::take(&mut self.corrupt) {
            wire.data = failpoints::flip_a_byte(&wire.data);
        }
        pb::PushFrame {
            frame: Some(Frame::Chunk(wire)),
        }
    }

    /// Queues a chunk, waiting while the buffer is full. An error means the push already
    /// ended; [`KvPush::finish`] returns why.
    pub async fn send(&mut self, chunk: &Chunk) -> Result<()> {
        let frame = self.frame(chunk);
        self.tx.send(frame).await.map_err(|_| Error::ReceiverGone)
    }

    /// [`KvPush::send`], giving up with [`Error::Stalled`] when the push takes no frame for
    /// `stall`.
    pub async fn send_within(&mut self, chunk: &Chunk, stall: Duration) -> Result<()> {
        let frame = self.frame(chunk);
        match tokio::time::timeout(stall, self.tx.send(frame)).await {
            Ok(sent) => sent.map_err(|_| Error::ReceiverGone),
            Err(_) => Err(Error::Stalled {
                waited_ms: stall.as_millis() as u64,
            }),
        }
    }

    /// Sends the trailer, with the first token (and its log-probabilities), and waits for the
    /// receiver's verdict.
    pub async fn finish(
        self,
        first_token: u32,
        first_logprobs: Option<pb::TokenLogprobs>,
    ) -> Result<pb::PushAck> {
        let trailer = pb::PushFrame {
            frame: Some(Frame::Trailer(pb::KvTrailer {
                digest: self.digest,
                first_token,
                first_logprobs,
            })),
        };
        // If this fails the task has ended, and its result says why.
        let _ = self.tx.send(trailer).await;
        drop(self.tx);
        self.task.await.map_err(|e| Error::Transport {
            code: tonic::Code::Internal,
            message: format!("push task failed: {e}"),
        })?
    }

    /// A heartbeat for this push, for the time its KV is not flowing yet (the prompt waits in
    /// a queue) or between chunks.
    pub fn heartbeat(&self) -> Heartbeat {
        Heartbeat {
            tx: self.tx.clone(),
        }
    }

    /// Tells the receiver why the transfer stops, and ends it, without waiting: the push task
    /// finishes on its own once the receiver has answered. A push whose buffer is full (its
    /// receiver takes nothing) is dropped instead, which resets its stream.
    pub fn abort(self, reason: String) {
        let frame = pb::PushFrame {
            frame: Some(Frame::Abort(pb::KvAbort { reason })),
        };
        if self.tx.try_send(frame).is_err() {
            self.task.abort();
        }
    }
}

/// Sends a keepalive frame at a steady interval ([`KEEPALIVE_INTERVAL`] by default), so that
/// the receiver, which bounds the silence of a push to find a dead sender, waits on a live one
/// whose prompt is queued, as long as the sender says it makes progress. It holds the push
/// open: drop it before [`KvPush::finish`].
#[derive(Debug)]
pub struct Heartbeat {
    tx: mpsc::Sender<pb::PushFrame>,
}

impl Heartbeat {
    /// Beats every `every` while `progressing` says the sender's work moves, until dropped;
    /// never returns. A stuck sender falls silent, and the receiver's bound on silence then
    /// gives up on it. A push that ended makes it beat no more (the push's own result says why).
    pub async fn run(
        self,
        every: Duration,
        progressing: impl Fn() -> bool,
    ) -> std::convert::Infallible {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            if !progressing() {
                continue;
            }
            let frame = pb::PushFrame {
                frame: Some(Frame::Keepalive(pb::KvKeepalive {})),
            };
            if self.tx.send(frame).await.is_err() {
                return std::future::pending().await;
            }
        }
    }
}

/// Faults injected on purpose, compiled only with the `failpoints` feature (the chaos suite's
/// image): shipped builds cannot corrupt anything.
#[cfg(feature = "failpoints")]
mod failpoints {
    use std::sync::OnceLock;

    /// `TANDEM_FAILPOINT_CORRUPT_KV`: the share of pushes, from 0 to 1, whose first chunk goes
    /// out with one byte changed after its checksum was taken.
    pub fn corrupt_kv() -> bool {
        static SHARE: OnceLock<f64> = OnceLock::new();
        let share = *SHARE.get_or_init(|| {
            std::env::var("TANDEM_FAILPOINT_CORRUPT_KV")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0)
        });
        share > 0.0 && rand::random::<f64>() < share
    }

    pub fn flip_a_byte(data: &[u8]) -> bytes::Bytes {
        let mut data = data.to_vec();
        let middle = data.len() / 2;
        if let Some(b) = data.get_mut(middle) {
            *b ^= 0x5a;
        }
        tracing::warn!("failpoint: corrupted a KV chunk");
        data.into()
    }
}
