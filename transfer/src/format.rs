//! KV wire format v1 as domain types, and the receiver's [`Assembler`], which validates a push
//! frame by frame before a single byte is used.
//!
//! Invariants the assembler enforces:
//! - the header matches the reservation ([`Expectation`]) exactly: version, fingerprint, layout,
//!   token range and ids, byte total; so nothing is allocated for a push nobody asked for;
//! - for each (layer, kind), chunks tile the token range in order, with exactly the bytes their
//!   range needs, each under [`MAX_CHUNK_BYTES`] and with a matching CRC32C;
//! - the trailer comes after exactly `chunk_count` chunks and carries the digest of the chunks'
//!   CRC32Cs in sending order ([`digest_append`]).

use std::ops::Range;

use bytes::Bytes;
use tandem_proto::v1 as pb;
use tandem_proto::v1::push_frame::Frame;
use tonic::{Code, Streaming};

use crate::error::{Error, Result};

/// The wire format this crate speaks.
pub const VERSION: u32 = 1;
/// The most data one chunk may carry; far below the gRPC message limit.
pub const MAX_CHUNK_BYTES: usize = 1 << 20;
/// The most tokens one header may describe.
pub const MAX_TOKENS: usize = 1 << 20;

/// How each row (one token's `head_dim` values of one layer, kind and KV head) is encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    /// `head_dim` f16 values, little-endian.
    F16,
    /// `head_dim` int8 values, then their f16 scale, little-endian.
    Q8,
    /// No bytes: simulated nodes' KV, whose rows nothing reads (`--kv-header-only`). Chunks
    /// still tile the range, empty.
    None,
}

impl KvDtype {
    /// Bytes of one row.
    pub fn row_bytes(self, head_dim: usize) -> usize {
        match self {
            KvDtype::F16 => head_dim * 2,
            KvDtype::Q8 => head_dim + 2,
            KvDtype::None => 0,
        }
    }

    fn to_pb(self) -> pb::KvDtype {
        match self {
            KvDtype::F16 => pb::KvDtype::F16,
            KvDtype::Q8 => pb::KvDtype::Q8,
            KvDtype::None => pb::KvDtype::None,
        }
    }

    fn from_pb(dtype: i32) -> Option<Self> {
        match pb::KvDtype::try_from(dtype) {
            Ok(pb::KvDtype::F16) => Some(KvDtype::F16),
            Ok(pb::KvDtype::Q8) => Some(KvDtype::Q8),
            Ok(pb::KvDtype::None) => Some(KvDtype::None),
            Ok(pb::KvDtype::Unspecified) | Err(_) => None,
        }
    }
}

/// The shape of the KV a model produces, and its encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireLayout {
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub block_tokens: u32,
    pub dtype: KvDtype,
}

impl WireLayout {
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.head_dim as usize)
    }

    /// Bytes of one layer's K (or V) per token.
    pub fn token_bytes_per_kind(&self) -> usize {
        self.kv_heads as usize * self.row_bytes()
    }

    /// Bytes of the whole KV (all layers, K and V) of `tokens` tokens.
    pub fn total_bytes(&self, tokens: usize) -> u64 {
        tokens as u64 * self.layers as u64 * 2 * self.token_bytes_per_kind() as u64
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvKind {
    K,
    V,
}

impl KvKind {
    pub fn index(self) -> usize {
        match self {
            KvKind::K => 0,
            KvKind::V => 1,
        }
    }

    fn name(self) -> &'static str {
        match self {
            KvKind::K => "K",
            KvKind::V => "V",
        }
    }

    fn to_pb(self) -> pb::KvKind {
        match self {
            KvKind::K => pb::KvKind::K,
            KvKind::V => pb::KvKind::V,
        }
    }
}

/// What a header announces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub transfer_id: String,
    pub request_id: String,
    pub fingerprint: [u8; 32],
    pub layout: WireLayout,
    pub tokens: Range<u32>,
    pub token_ids: Vec<u32>,
    pub chunk_count: u32,
    pub total_bytes: u64,
}

impl Header {
    pub fn to_pb(&self) -> pb::KvHeader {
        pb::KvHeader {
            version: VERSION,
            transfer_id: self.transfer_id.clone(),
            request_id: self.request_id.clone(),
            model_fingerprint: Bytes::copy_from_slice(&self.fingerprint),
            dtype: self.layout.dtype.to_pb() as i32,
            layers: self.layout.layers,
            kv_heads: self.layout.kv_heads,
            head_dim: self.layout.head_dim,
            block_tokens: self.layout.block_tokens,
            token_start: self.tokens.start,
            token_end: self.tokens.end,
            token_ids: self.token_ids.clone(),
            chunk_count: self.chunk_count,
            total_bytes: self.total_bytes,
        }
    }
}

/// One layer's K or V for a token range: rows laid out `[kv_head][token]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub layer: u32,
    pub kind: KvKind,
    pub tokens: Range<u32>,
    pub data: Bytes,
}

impl Chunk {
    /// The wire frame, with the CRC32C of the data.
    pub fn to_pb(&self) -> pb::KvChunk {
        pb::KvChunk {
            layer: self.layer,
            kind: self.kind.to_pb() as i32,
            token_start: self.tokens.start,
            token_end: self.tokens.end,
            crc32c: crc32c::crc32c(&self.data),
            data: self.data.clone(),
        }
    }
}

/// Folds one chunk into the whole-transfer digest: a CRC32C over the chunks' CRC32Cs in sending
/// order. Each chunk's data is covered by its own CRC, so this covers all data and the order of
/// chunks without hashing every byte a second time.
pub fn digest_append(digest: u32, chunk_crc32c: u32) -> u32 {
    crc32c::crc32c_append(digest, &chunk_crc32c.to_le_bytes())
}

/// What the receiver expects, from the reservation the transfer id is bound to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Expectation {
    pub fingerprint: [u8; 32],
    pub layout: WireLayout,
    /// The tokens whose KV must arrive: the prompt minus what the receiver already holds.
    pub tokens: Range<u32>,
    pub token_ids: Vec<u32>,
    /// The byte budget granted to this transfer.
    pub max_bytes: u64,
}

/// A verified transfer: the KV of `tokens`, per layer `[K, V]`, each rows laid out
/// `[kv_head][token]` over the whole range, and the first sampled token (with its
/// log-probabilities when the request asks for them).
#[derive(Debug, PartialEq)]
pub struct ReceivedKv {
    pub request_id: String,
    pub tokens: Range<u32>,
    pub layers: Vec<[Vec<u8>; 2]>,
    pub first_token: u32,
    pub first_logprobs: Option<pb::TokenLogprobs>,
}

/// Checks a header frame against the expectation, before anything is allocated.
pub fn validate_header(h: &pb::KvHeader, want: &Expectation) -> Result<()> {
    if h.version != VERSION {
        return Err(Error::Version {
            got: h.version,
            supported: VERSION,
        });
    }
    if h.token_ids.len() > MAX_TOKENS {
        return Err(Error::HeaderTooLarge {
            detail: format!("{} token ids (at most {MAX_TOKENS})", h.token_ids.len()),
        });
    }
    if h.model_fingerprint.as_ref() != want.fingerprint {
        return Err(Error::Fingerprint);
    }
    let Some(dtype) = KvDtype::from_pb(h.dtype) else {
        return Err(Error::Layout {
            detail: format!("unknown dtype {}", h.dtype),
        });
    };
    let got = WireLayout {
        layers: h.layers,
        kv_heads: h.kv_heads,
        head_dim: h.head_dim,
        block_tokens: h.block_tokens,
        dtype,
    };
    if got != want.layout {
        return Err(Error::Layout {
            detail: format!("sent {got:?}, expected {:?}", want.layout),
        });
    }
    // After the layout, so that a sender of another dtype learns that rather than a size.
    if h.total_bytes > want.max_bytes {
        return Err(Error::HeaderTooLarge {
            detail: format!(
                "{} bytes announced, the reservation allows {}",
                h.total_bytes, want.max_bytes
            ),
        });
    }
    if (h.token_start..h.token_end) != want.tokens {
        return Err(Error::Tokens {
            detail: format!(
                "range {}..{}, expected {:?}",
                h.token_start, h.token_end, want.tokens
            ),
        });
    }
    if h.token_ids != want.token_ids {
        return Err(Error::Tokens {
            detail: "token ids differ".into(),
        });
    }
    let n = want.tokens.len();
    if h.total_bytes != want.layout.total_bytes(n) {
        return Err(Error::Malformed {
            detail: format!(
                "total_bytes {} for {n} tokens, expected {}",
                h.total_bytes,
                want.layout.total_bytes(n)
            ),
        });
    }
    let min_chunks = u64::from(want.layout.layers) * 2;
    if u64::from(h.chunk_count) < min_chunks || u64::from(h.chunk_count) > min_chunks * n as u64 {
        return Err(Error::Malformed {
            detail: format!("chunk_count {} for {n} tokens", h.chunk_count),
        });
    }
    Ok(())
}

/// Accepts the chunks of one validated transfer into per-(layer, kind) buffers.
#[derive(Debug)]
pub struct Assembler {
    want: Expectation,
    chunk_count: u32,
    received: u32,
    /// The next token each (layer, kind) expects.
    next: Vec<[u32; 2]>,
    layers: Vec<[Vec<u8>; 2]>,
    digest: u32,
    bytes: u64,
    request_id: String,
}

impl Assembler {
    /// Validates `header` against `want` and allocates the buffers for it.
    pub fn new(header: &pb::KvHeader, want: Expectation) -> Result<Self> {
        validate_header(header, &want)?;
        let size = want.tokens.len() * want.layout.token_bytes_per_kind();
        let layers = (0..want.layout.layers)
            .map(|_| [vec![0u8; size], vec![0u8; size]])
            .collect();
        Ok(Self {
            next: vec![[want.tokens.start; 2]; want.layout.layers as usize],
            chunk_count: header.chunk_count,
            received: 0,
            layers,
            digest: 0,
            bytes: 0,
            request_id: header.request_id.clone(),
            want,
        })
    }

    pub fn bytes_received(&self) -> u64 {
        self.bytes
    }

    /// Checks one chunk and copies it into place.
    pub fn chunk(&mut self, c: &pb::KvChunk) -> Result<()> {
        let bad = |detail: String| Err(Error::Chunk { detail });
        if self.received >= self.chunk_count {
            return bad(format!(
                "more than the {} chunks announced",
                self.chunk_count
            ));
        }
        let kind = match pb::KvKind::try_from(c.kind) {
            Ok(pb::KvKind::K) => KvKind::K,
            Ok(pb::KvKind::V) => KvKind::V,
            Err(_) => return bad(format!("unknown kind {}", c.kind)),
        };
        let Some(next) = self.next.get_mut(c.layer as usize) else {
            return bad(format!("layer {} of {}", c.layer, self.want.layout.layers));
        };
        let expected_start = next[kind.index()];
        if c.token_start != expected_start
            || c.token_end <= c.token_start
            || c.token_end > self.want.tokens.end
        {
            return bad(format!(
                "layer {} {} covers {}..{}, expected a range starting at {expected_start} within {:?}",
                c.layer,
                kind.name(),
                c.token_start,
                c.token_end,
                self.want.tokens
            ));
        }
        let len = (c.token_end - c.token_start) as usize;
        let row = self.want.layout.row_bytes();
        let heads = self.want.layout.kv_heads as usize;
        if c.data.len() != len * heads * row || c.data.len() > MAX_CHUNK_BYTES {
            return bad(format!(
                "{} bytes for {len} tokens (expected {}, at most {MAX_CHUNK_BYTES})",
                c.data.len(),
                len * heads * row
            ));
        }
        if crc32c::crc32c(&c.data) != c.crc32c {
            return Err(Error::ChunkCrc {
                layer: c.layer,
                kind: kind.name(),
                token_start: c.token_start,
            });
        }
        // Re-lay the chunk's [head][token][dim] into the whole range's [head][token][dim].
        let total = self.want.tokens.len();
        let offset = (c.token_start - self.want.tokens.start) as usize;
        let dst = &mut self.layers[c.layer as usize][kind.index()];
        // Rows of no bytes (dtype `none`) leave nothing to copy.
        if row > 0 {
            for (h, src) in c.data.chunks_exact(len * row).enumerate() {
                let at = (h * total + offset) * row;
                dst[at..at + src.len()].copy_from_slice(src);
            }
        }
        next[kind.index()] = c.token_end;
        self.digest = digest_append(self.digest, c.crc32c);
        self.bytes += c.data.len() as u64;
        self.received += 1;
        Ok(())
    }

    /// Layer `layer`'s K and V, once both have arrived whole, moved out (the [`ReceivedKv`] of
    /// [`Assembler::finish`] then holds them empty): a receiver that uses the KV a layer at a
    /// time as it comes (a pipelined prefill's stage). The trailer still checks every chunk.
    pub fn take_layer(&mut self, layer: usize) -> Option<[Vec<u8>; 2]> {
        let end = self.want.tokens.end;
        (self.next.get(layer)? == &[end; 2]).then(|| std::mem::take(&mut self.layers[layer]))
    }

    /// Checks the trailer and hands out the verified KV.
    pub fn finish(self, t: &pb::KvTrailer) -> Result<ReceivedKv> {
        let end = self.want.tokens.end;
        if self.received != self.chunk_count || self.next.iter().flatten().any(|&n| n != end) {
            return Err(Error::Chunk {
                detail: format!(
                    "trailer after {} of {} chunks, or a layer is incomplete",
                    self.received, self.chunk_count
                ),
            });
        }
        if t.digest != self.digest {
            return Err(Error::Digest);
        }
        Ok(ReceivedKv {
            request_id: self.request_id,
            tokens: self.want.tokens,
            layers: self.layers,
            first_token: t.first_token,
            first_logprobs: t.first_logprobs.clone(),
        })
    }
}

/// A sender's next frame (a push's, or a fetch holder's): an abort's reason cut to a bounded
/// prefix, and the codec's verdicts on the sender's bytes as the sender's fault.
pub(crate) async fn next_frame(frames: &mut Streaming<pb::PushFrame>) -> Result<Frame> {
    match frames.message().await {
        Ok(Some(pb::PushFrame {
            frame: Some(Frame::Abort(mut a)),
        })) => {
            // The sender's words go into logs and errors: a bounded prefix of them.
            let mut end = a.reason.len().min(tandem_proto::MAX_ID_BYTES);
            while !a.reason.is_char_boundary(end) {
                end -= 1;
            }
            a.reason.truncate(end);
            Ok(Frame::Abort(a))
        }
        Ok(Some(pb::PushFrame { frame: Some(f) })) => Ok(f),
        Ok(Some(pb::PushFrame { frame: None })) => Err(Error::Malformed {
            detail: "an empty frame".into(),
        }),
        Ok(None) => Err(Error::Malformed {
            detail: "the stream ended before the trailer".into(),
        }),
        // The codec's verdicts on the sender's bytes (too large, not a frame) are its fault.
        Err(status) if matches!(status.code(), Code::OutOfRange | Code::Internal) => {
            Err(Error::Malformed {
                detail: status.message().to_string(),
            })
        }
        Err(status) => Err(status.into()),
    }
}
