//! A pipelined prefill's hop: the next stage calls `Prefill.Relay` on the stage before, which
//! answers with a push's frames ([`crate::KvPush::relay`]) as it computes each layer, and reads
//! them a layer at a time.
//!
//! ```text
//! stage k+1 ──Relay(tokens[..end_k], upstream)──▶ stage k: computes a layer at a time
//!     ▲                                                │
//!     └── Header, layer 0's chunks, layer 1's, …, Trailer ◀─┘
//! ```
//!
//! Everything is checked as a push's receiver checks it (the [`Assembler`]: the header against
//! what was asked, each chunk's place and CRC, the trailer's digest), and the silence between
//! frames is bounded; keepalives fill it while the stage before waits or computes.

use std::time::Duration;

use tandem_proto::v1 as pb;
use tandem_proto::v1::push_frame::Frame;
use tonic::Streaming;
use tonic::transport::Channel;

use crate::error::{Error, Result};
use crate::fetch::{next, stalled};
use crate::format::{Assembler, Expectation};

/// The KV a stage of a pipelined prefill receives from the stage before, a layer at a time.
#[derive(Debug)]
pub struct RelayReceiver {
    frames: Streaming<pb::PushFrame>,
    assembler: Assembler,
    /// The next layer to hand out.
    layer: usize,
    layers: usize,
    idle: Duration,
}

impl RelayReceiver {
    /// Calls `Relay` with `request` on `channel` and checks the header against `want`; the
    /// silence between two frames is bounded by `idle`.
    pub async fn open(
        channel: Channel,
        request: pb::PrefillRequest,
        want: Expectation,
        idle: Duration,
    ) -> Result<Self> {
        let mut client = tandem_proto::limits!(pb::prefill_client::PrefillClient::new(channel));
        let mut request = tonic::Request::new(request);
        tandem_net::otel::inject(request.metadata_mut());
        let mut frames = tokio::time::timeout(idle, client.relay(request))
            .await
            .map_err(|_| stalled(idle))??
            .into_inner();
        let header = loop {
            match next(&mut frames, idle).await? {
                Frame::Header(h) => break h,
                Frame::Keepalive(_) => {}
                Frame::Abort(a) => return Err(Error::Aborted { reason: a.reason }),
                _ => {
                    return Err(Error::Malformed {
                        detail: "the first frame must be a header".into(),
                    });
                }
            }
        };
        let layers = want.layout.layers as usize;
        Ok(Self {
            frames,
            assembler: Assembler::new(&header, want)?,
            layer: 0,
            layers,
            idle,
        })
    }

    /// The next layer's K and V, laid out `[kv_head][token]` over the range, reading frames
    /// until both have arrived whole; `alive` is called at each frame (the stage before is
    /// alive and working).
    pub async fn next_layer(&mut self, alive: &dyn Fn()) -> Result<[Vec<u8>; 2]> {
        if self.layer >= self.layers {
            return Err(Error::Malformed {
                detail: format!("layer {} of {}", self.layer, self.layers),
            });
        }
        loop {
            if let Some(kv) = self.assembler.take_layer(self.layer) {
                self.layer += 1;
                return Ok(kv);
            }
            match next(&mut self.frames, self.idle).await? {
                Frame::Chunk(c) => self.assembler.chunk(&c)?,
                Frame::Keepalive(_) => {}
                Frame::Abort(a) => return Err(Error::Aborted { reason: a.reason }),
                Frame::Header(_) | Frame::Trailer(_) => {
                    return Err(Error::Malformed {
                        detail: format!(
                            "a header or trailer before layer {} was whole",
                            self.layer
                        ),
                    });
                }
            }
            alive();
        }
    }

    /// Reads the trailer and checks the digest of every chunk received.
    pub async fn finish(mut self) -> Result<()> {
        loop {
            match next(&mut self.frames, self.idle).await? {
                Frame::Trailer(t) => return self.assembler.finish(&t).map(drop),
                Frame::Keepalive(_) => {}
                Frame::Abort(a) => return Err(Error::Aborted { reason: a.reason }),
                _ => {
                    return Err(Error::Malformed {
                        detail: "a frame after the last layer".into(),
                    });
                }
            }
        }
    }
}
