//! Peer fetch: a worker pulls cached KV from the worker that holds it.
//!
//! ```text
//! fetching decode node ──Fetch(token_ids, salt)──▶ holder's KvTransferService ──▶ KvSource (its cache)
//!        ▲                                                 │
//!        └──── Header, Chunk…, Trailer (the push format) ◀─┘
//! ```
//!
//! The holder answers with the longest prefix of the asked tokens it holds, in whole blocks from
//! token 0, in the push's own frames; the fetcher checks them as a push's receiver does (the
//! [`Assembler`]: fingerprint, layout, tokens, sizes, a CRC per chunk, the digest), and bounds
//! the silence between frames. Whatever goes wrong, the caller computes the tokens instead.

use std::sync::Arc;
use std::time::Duration;

use tandem_proto::v1 as pb;
use tandem_proto::v1::push_frame::Frame;
use tonic::transport::Channel;
use tonic::{Status, Streaming};

use crate::client::chunk_frames;
use crate::error::{Error, Result};
use crate::format::{Assembler, Chunk, Expectation, Header, ReceivedKv, WireLayout, next_frame};

/// What a holder's cache has of a fetch's tokens.
#[derive(Debug, Default)]
pub struct Cached {
    /// The tokens `0..tokens` are held (a multiple of the block size; 0 when none are).
    pub tokens: u32,
    /// Their KV, in sending order: for each (layer, kind) in token order.
    pub chunks: Vec<Chunk>,
}

/// A worker's cache, as peer fetches see it.
#[tonic::async_trait]
pub trait KvSource: Send + Sync + 'static {
    /// The longest prefix of `token_ids`, in whole blocks from token 0, that the cache holds
    /// under `cache_salt`, with its KV.
    async fn cached(&self, token_ids: &[u32], cache_salt: &str) -> Result<Cached, Status>;
}

/// The holder's side of a fetch: its model, its KV's shape and its cache.
#[derive(Clone)]
pub struct FetchSource {
    pub fingerprint: [u8; 32],
    pub layout: WireLayout,
    pub source: Arc<dyn KvSource>,
}

impl std::fmt::Debug for FetchSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FetchSource")
            .field("layout", &self.layout)
            .finish_non_exhaustive()
    }
}

impl FetchSource {
    /// The frames answering `request`: a header, the chunks, a trailer.
    pub(crate) async fn answer(
        &self,
        request: pb::FetchRequest,
    ) -> Result<Vec<pb::PushFrame>, Status> {
        tandem_proto::check_ids(&[("request_id", &request.request_id)])
            .map_err(|(field, reason)| Status::invalid_argument(format!("{field}: {reason}")))?;
        if request.model_fingerprint.as_ref() != self.fingerprint {
            return Err(Error::Fingerprint.into());
        }
        if request.token_ids.len() > crate::format::MAX_TOKENS {
            return Err(Status::invalid_argument(format!(
                "{} token ids (at most {})",
                request.token_ids.len(),
                crate::format::MAX_TOKENS
            )));
        }
        let cached = self
            .source
            .cached(&request.token_ids, &request.cache_salt)
            .await?;
        let end = cached.tokens.min(request.token_ids.len() as u32);
        let header = Header {
            transfer_id: String::new(),
            request_id: request.request_id,
            fingerprint: self.fingerprint,
            layout: self.layout,
            tokens: 0..end,
            token_ids: request.token_ids[..end as usize].to_vec(),
            chunk_count: cached.chunks.len() as u32,
            total_bytes: self.layout.total_bytes(end as usize),
        };
        let mut frames = vec![pb::PushFrame {
            frame: Some(Frame::Header(header.to_pb())),
        }];
        let (chunks, digest) = chunk_frames(&cached.chunks);
        frames.extend(chunks);
        frames.push(pb::PushFrame {
            frame: Some(Frame::Trailer(pb::KvTrailer {
                digest,
                first_token: 0,
                first_logprobs: None,
            })),
        });
        Ok(frames)
    }
}

/// What the fetcher expects of the holder's answer.
#[derive(Clone, Debug)]
pub struct FetchWant {
    pub fingerprint: [u8; 32],
    pub layout: WireLayout,
    /// The longest silence between two frames.
    pub idle: Duration,
}

/// Fetches the KV of the longest held prefix of `request.token_ids` over `channel`, checked as
/// a push is; `None` when the holder has none of it.
pub async fn fetch(
    channel: Channel,
    request: pb::FetchRequest,
    want: &FetchWant,
) -> Result<Option<ReceivedKv>> {
    let mut client = tandem_proto::limits!(pb::kv_transfer_client::KvTransferClient::new(channel));
    let asked = request.token_ids.clone();
    let mut frames = tokio::time::timeout(want.idle, client.fetch(request))
        .await
        .map_err(|_| stalled(want.idle))??
        .into_inner();
    let Frame::Header(header) = next(&mut frames, want.idle).await? else {
        return Err(Error::Malformed {
            detail: "the first frame must be a header".into(),
        });
    };
    let end = header.token_end as usize;
    let block = want.layout.block_tokens as usize;
    if header.token_start != 0 || end > asked.len() || !end.is_multiple_of(block) {
        return Err(Error::Tokens {
            detail: format!(
                "holds {}..{end} of {} asked tokens (whole blocks from 0 expected)",
                header.token_start,
                asked.len()
            ),
        });
    }
    if end == 0 {
        return Ok(None);
    }
    let expect = Expectation {
        fingerprint: want.fingerprint,
        layout: want.layout,
        tokens: 0..end as u32,
        token_ids: asked[..end].to_vec(),
        max_bytes: want.layout.total_bytes(end),
    };
    let mut asm = Assembler::new(&header, expect)?;
    loop {
        match next(&mut frames, want.idle).await? {
            Frame::Chunk(c) => asm.chunk(&c)?,
            Frame::Trailer(t) => return asm.finish(&t).map(Some),
            Frame::Keepalive(_) => {}
            Frame::Abort(a) => return Err(Error::Aborted { reason: a.reason }),
            Frame::Header(_) => {
                return Err(Error::Malformed {
                    detail: "a second header".into(),
                });
            }
        }
    }
}

pub(crate) fn stalled(idle: Duration) -> Error {
    Error::Stalled {
        waited_ms: idle.as_millis() as u64,
    }
}

/// The holder's next frame, read as a push receiver reads one, within `idle`.
pub(crate) async fn next(frames: &mut Streaming<pb::PushFrame>, idle: Duration) -> Result<Frame> {
    tokio::time::timeout(idle, next_frame(frames))
        .await
        .map_err(|_| stalled(idle))?
}
