//! Decoding arbitrary bytes as push frames and feeding them to the receiver's validation never
//! panics: every outcome is a value or an error.

use proptest::prelude::*;
use prost::Message;
use tandem_proto::v1 as pb;
use tandem_proto::v1::push_frame::Frame;
use tandem_transfer::format::Assembler;
use tandem_transfer::{Expectation, WireLayout};

fn want() -> Expectation {
    let layout = WireLayout {
        layers: 2,
        kv_heads: 1,
        head_dim: 2,
        block_tokens: 16,
        dtype: tandem_transfer::KvDtype::F16,
    };
    Expectation {
        fingerprint: [1; 32],
        layout,
        tokens: 0..4,
        token_ids: vec![1, 2, 3, 4],
        max_bytes: layout.total_bytes(4),
    }
}

/// A valid header for `want()`, so that fuzzed chunks get past it.
fn valid_header() -> pb::KvHeader {
    let w = want();
    pb::KvHeader {
        version: 1,
        model_fingerprint: w.fingerprint.to_vec().into(),
        dtype: pb::KvDtype::F16 as i32,
        layers: 2,
        kv_heads: 1,
        head_dim: 2,
        block_tokens: 16,
        token_start: 0,
        token_end: 4,
        token_ids: w.token_ids.clone(),
        chunk_count: 4,
        total_bytes: w.layout.total_bytes(4),
        ..Default::default()
    }
}

fn feed(asm: &mut Option<Assembler>, frame: Frame) {
    match (frame, asm.as_mut()) {
        (Frame::Header(h), None) => *asm = Assembler::new(&h, want()).ok(),
        (Frame::Chunk(c), Some(a)) => {
            let _ = a.chunk(&c);
        }
        (Frame::Trailer(t), Some(_)) => {
            if let Some(a) = asm.take() {
                let _ = a.finish(&t);
            }
        }
        _ => {}
    }
}

proptest! {
    #[test]
    fn arbitrary_frames_never_panic(frames in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..200), 0..12)) {
        let mut asm = None;
        for bytes in frames {
            if let Ok(pb::PushFrame { frame: Some(f) }) = pb::PushFrame::decode(bytes.as_slice()) {
                feed(&mut asm, f);
            }
        }
    }

    #[test]
    fn arbitrary_chunks_after_a_valid_header_never_panic(
        chunks in proptest::collection::vec(
            (0u32..4, 0i32..3, 0u32..6, 0u32..6, proptest::collection::vec(any::<u8>(), 0..20), any::<u32>()),
            0..10,
        ),
        digest in any::<u32>(),
    ) {
        let mut asm = Assembler::new(&valid_header(), want()).ok();
        prop_assert!(asm.is_some());
        for (layer, kind, token_start, token_end, data, crc) in chunks {
            let crc = if crc % 2 == 0 { crc32c::crc32c(&data) } else { crc };
            feed(&mut asm, Frame::Chunk(pb::KvChunk { layer, kind, token_start, token_end, data: data.into(), crc32c: crc }));
        }
        feed(&mut asm, Frame::Trailer(pb::KvTrailer { digest, first_token: 0, first_logprobs: None }));
    }
}
