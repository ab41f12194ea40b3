//! The KV wire receiver on arbitrary bytes: a run of length-delimited `PushFrame`s through the
//! header check, the chunk assembler and the trailer check, as the decode node's KvTransfer
//! service runs them. Nothing may panic, and nothing is allocated before the header passes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use tandem_proto::v1 as pb;
use tandem_proto::v1::push_frame::Frame;
use tandem_transfer::format::Assembler;
use tandem_transfer::{Expectation, KvDtype, WireLayout};

/// A small reservation: 2 layers, 1 KV head of 4 dims, tokens 0..3 (the seeds in
/// `corpus/kv_wire` are valid transfers for it, see `make_seeds.py`).
fn expectation() -> Expectation {
    let layout = WireLayout {
        layers: 2,
        kv_heads: 1,
        head_dim: 4,
        block_tokens: 16,
        dtype: KvDtype::F16,
    };
    Expectation {
        fingerprint: [7; 32],
        layout,
        tokens: 0..3,
        token_ids: vec![1, 2, 3],
        max_bytes: layout.total_bytes(3),
    }
}

fuzz_target!(|data: &[u8]| {
    let mut buf = data;
    let mut frames = Vec::new();
    while !buf.is_empty() && frames.len() < 64 {
        match pb::PushFrame::decode_length_delimited(&mut buf) {
            Ok(pb::PushFrame { frame: Some(f) }) => frames.push(f),
            _ => break,
        }
    }
    let mut frames = frames.into_iter();
    let Some(Frame::Header(header)) = frames.next() else {
        return;
    };
    let Ok(mut assembler) = Assembler::new(&header, expectation()) else {
        return;
    };
    for frame in frames {
        match frame {
            Frame::Chunk(c) => {
                if assembler.chunk(&c).is_err() {
                    return;
                }
            }
            Frame::Trailer(t) => {
                if let Ok(kv) = assembler.finish(&t) {
                    assert_eq!(kv.tokens, 0..3);
                    assert!(kv.layers.iter().flatten().all(|b| b.len() == 3 * 4 * 2));
                }
                return;
            }
            _ => return,
        }
    }
});
