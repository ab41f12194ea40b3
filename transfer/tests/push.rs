//! The KvTransfer service on a real socket: a clean push, and each way a push is rejected.

use std::time::Duration;

use bytes::Bytes;
use tandem_proto::v1 as pb;
use tandem_transfer::{
    Chunk, Error, Expectation, Header, KvDtype, KvKind, KvPush, KvTransferService, Reservations,
    TransferMetrics, WireLayout,
};
use tokio::net::TcpListener;
use tonic::Code;
use tonic::transport::Channel;

const LAYOUT: WireLayout = WireLayout {
    layers: 2,
    kv_heads: 2,
    head_dim: 4,
    block_tokens: 16,
    dtype: KvDtype::F16,
};
const FINGERPRINT: [u8; 32] = [7; 32];

struct Node {
    reservations: Reservations,
    metrics: TransferMetrics,
    channel: Channel,
}

async fn node() -> Node {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let reservations = Reservations::default();
    let metrics = TransferMetrics::register(&mut Default::default());
    let svc = KvTransferService::new(reservations.clone(), metrics.clone()).into_server();
    tokio::spawn(
        tandem_net::server()
            .add_service(svc)
            .serve_with_incoming(tandem_net::incoming(listener)),
    );
    Node {
        reservations,
        metrics,
        channel: tandem_net::channel(&addr.to_string(), None).expect("channel"),
    }
}

fn expectation(tokens: std::ops::Range<u32>) -> Expectation {
    expectation_in(LAYOUT, tokens)
}

fn expectation_in(layout: WireLayout, tokens: std::ops::Range<u32>) -> Expectation {
    Expectation {
        fingerprint: FINGERPRINT,
        layout,
        token_ids: tokens.clone().map(|t| t * 3).collect(),
        max_bytes: layout.total_bytes(tokens.len()),
        tokens,
    }
}

fn header(id: &str, want: &Expectation, chunk_count: u32) -> Header {
    Header {
        transfer_id: id.into(),
        request_id: "r".into(),
        fingerprint: want.fingerprint,
        layout: want.layout,
        tokens: want.tokens.clone(),
        token_ids: want.token_ids.clone(),
        chunk_count,
        total_bytes: want.layout.total_bytes(want.tokens.len()),
    }
}

/// Byte `i` of the row (layer, kind, head, token): distinct enough to catch any misplacement.
fn byte(layer: u32, kind: KvKind, head: u32, token: u32, i: u32) -> u8 {
    (layer * 131 + kind.index() as u32 * 61 + head * 29 + token * 7 + i) as u8
}

/// The chunks for `want`, split at `split` (a token inside the range).
fn chunks(want: &Expectation, split: u32) -> Vec<Chunk> {
    let layout = want.layout;
    let row = layout.row_bytes() as u32;
    let mut out = Vec::new();
    for range in [want.tokens.start..split, split..want.tokens.end] {
        for layer in 0..layout.layers {
            for kind in [KvKind::K, KvKind::V] {
                let mut data = Vec::new();
                for head in 0..layout.kv_heads {
                    for t in range.clone() {
                        data.extend((0..row).map(|i| byte(layer, kind, head, t, i)));
                    }
                }
                out.push(Chunk {
                    layer,
                    kind,
                    tokens: range.clone(),
                    data: Bytes::from(data),
                });
            }
        }
    }
    out
}

async fn push(node: &Node, header: &Header, chunks: &[Chunk]) -> tandem_transfer::Result<u64> {
    let mut push = KvPush::start(node.channel.clone(), header);
    for c in chunks {
        if push.send(c).await.is_err() {
            break;
        }
    }
    push.finish(42, Some(first_logprobs()))
        .await
        .map(|ack| ack.bytes_received)
}

/// What every test push sends with its first token.
fn first_logprobs() -> pb::TokenLogprobs {
    pb::TokenLogprobs {
        logprob: -0.25,
        top_ids: vec![42, 7],
        top_logprobs: vec![-0.25, -2.0],
    }
}

fn rejects(node: &Node, reason: &'static str) -> u64 {
    node.metrics
        .rejects
        .get_or_create(&tandem_transfer::metrics::ReasonLabel { reason })
        .get()
}

#[tokio::test]
async fn a_clean_push_arrives_verified_and_relaid() {
    for dtype in [KvDtype::F16, KvDtype::Q8] {
        clean_push(WireLayout { dtype, ..LAYOUT }).await;
    }
}

async fn clean_push(layout: WireLayout) {
    let node = node().await;
    let want = expectation_in(layout, 3..40);
    let (_guard, delivery) = node
        .reservations
        .reserve("t1", want.clone())
        .expect("reserve");
    let chunks = chunks(&want, 20);
    let bytes = push(&node, &header("t1", &want, chunks.len() as u32), &chunks)
        .await
        .expect("push");
    assert_eq!(bytes, layout.total_bytes(37));
    let kv = delivery.await.expect("delivered").expect("verified");
    assert_eq!(kv.first_token, 42);
    assert_eq!(kv.first_logprobs, Some(first_logprobs()));
    assert_eq!(kv.tokens, 3..40);
    let row = layout.row_bytes();
    for layer in 0..layout.layers {
        for kind in [KvKind::K, KvKind::V] {
            let data = &kv.layers[layer as usize][kind.index()];
            for head in 0..layout.kv_heads {
                for t in 3..40u32 {
                    let at = (head as usize * 37 + (t - 3) as usize) * row;
                    let want: Vec<u8> = (0..row as u32)
                        .map(|i| byte(layer, kind, head, t, i))
                        .collect();
                    assert_eq!(
                        &data[at..at + row],
                        &want[..],
                        "layer {layer} head {head} token {t}"
                    );
                }
            }
        }
    }
    assert_eq!(node.metrics.bytes.get(), layout.total_bytes(37));
    assert_eq!(node.reservations.pending(), 0);
}

/// Prefill and decode must agree on the dtype: a push in the other one is a layout mismatch,
/// in either direction (f16 is larger than a q8 reservation allows, but the dtype is named).
#[tokio::test]
async fn a_push_in_another_dtype_is_a_layout_mismatch() {
    let node = node().await;
    let q8 = WireLayout {
        dtype: KvDtype::Q8,
        ..LAYOUT
    };
    for (i, (sent, expected)) in [(q8, LAYOUT), (LAYOUT, q8)].into_iter().enumerate() {
        let id = format!("dtype-{i}");
        let (_guard, delivery) = node
            .reservations
            .reserve(&id, expectation_in(expected, 0..16))
            .expect("reserve");
        let sent = expectation_in(sent, 0..16);
        let chunks = chunks(&sent, 8);
        let e = push(&node, &header(&id, &sent, chunks.len() as u32), &chunks)
            .await
            .expect_err("another dtype");
        assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
        assert!(e.to_string().contains("dtype"), "{e}");
        let told = delivery.await.expect("told");
        assert!(matches!(told, Err(Error::Layout { .. })), "{told:?}");
    }
    assert_eq!(rejects(&node, "layout"), 2);
}

#[tokio::test]
async fn a_corrupted_chunk_is_data_loss_for_sender_and_waiter() {
    let node = node().await;
    let want = expectation(0..32);
    let (_guard, delivery) = node
        .reservations
        .reserve("t", want.clone())
        .expect("reserve");
    let chunks = chunks(&want, 16);
    // Frames by hand, so that one chunk's data changes after its CRC was computed.
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let first = header("t", &want, chunks.len() as u32).to_pb();
    tx.send(pb::PushFrame {
        frame: Some(pb::push_frame::Frame::Header(first)),
    })
    .await
    .expect("queue");
    for (i, c) in chunks.iter().enumerate() {
        let mut f = c.to_pb();
        if i == 5 {
            let mut d = f.data.to_vec();
            d[3] ^= 0x40;
            f.data = Bytes::from(d);
        }
        tx.send(pb::PushFrame {
            frame: Some(pb::push_frame::Frame::Chunk(f)),
        })
        .await
        .expect("queue");
    }
    drop(tx);
    let status = pb::kv_transfer_client::KvTransferClient::new(node.channel.clone())
        .push(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect_err("rejected");
    assert_eq!(status.code(), Code::DataLoss, "{status:?}");
    assert!(status.message().contains("CRC32C"), "{status:?}");
    assert!(matches!(
        delivery.await.expect("told"),
        Err(Error::ChunkCrc { layer: 0, .. })
    ));
    assert_eq!(rejects(&node, "crc"), 1);
}

#[tokio::test]
async fn wrong_fingerprint_reused_id_and_oversized_header_are_rejected_precisely() {
    let node = node().await;
    let want = expectation(0..16);
    let chunks = chunks(&want, 8);
    let n = chunks.len() as u32;

    let (_g1, delivery) = node
        .reservations
        .reserve("fp", want.clone())
        .expect("reserve");
    let mut h = header("fp", &want, n);
    h.fingerprint = [8; 32];
    let e = push(&node, &h, &chunks).await.expect_err("fingerprint");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(matches!(
        delivery.await.expect("told"),
        Err(Error::Fingerprint)
    ));

    let (_g2, _d2) = node
        .reservations
        .reserve("once", want.clone())
        .expect("reserve");
    push(&node, &header("once", &want, n), &chunks)
        .await
        .expect("first use");
    let e = push(&node, &header("once", &want, n), &chunks)
        .await
        .expect_err("reuse");
    assert_eq!(e.code(), Code::AlreadyExists, "{e}");
    assert!(matches!(
        node.reservations.reserve("once", want.clone()),
        Err(Error::Reused { .. })
    ));

    let (_g3, _d3) = node
        .reservations
        .reserve("big", want.clone())
        .expect("reserve");
    let mut h = header("big", &want, n);
    h.total_bytes = want.max_bytes * 1000;
    let e = push(&node, &h, &chunks).await.expect_err("oversized");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");

    let e = push(&node, &header("nobody", &want, n), &chunks)
        .await
        .expect_err("unknown");
    assert_eq!(e.code(), Code::NotFound, "{e}");
    assert_eq!(rejects(&node, "fingerprint"), 1);
    assert_eq!(rejects(&node, "reused"), 1);
    assert_eq!(rejects(&node, "header_too_large"), 1);
    assert_eq!(rejects(&node, "unknown_transfer"), 1);
}

#[tokio::test]
async fn an_expired_lease_frees_the_reservation_and_stops_a_push() {
    let node = node().await;
    let want = expectation(0..16);
    let chunks = chunks(&want, 8);
    let n = chunks.len() as u32;
    let (guard, delivery) = node
        .reservations
        .reserve("late", want.clone())
        .expect("reserve");
    let mut p = KvPush::start(node.channel.clone(), &header("late", &want, n));
    p.send(&chunks[0]).await.expect("first chunk");
    // Let the receiver claim the reservation, then let the lease lapse mid-push.
    tokio::time::timeout(Duration::from_secs(5), async {
        while node.reservations.pending() > 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .expect("claimed");
    drop(guard);
    drop(delivery);
    let e = p.finish(0, None).await.expect_err("receiver gone");
    assert_eq!(e.code(), Code::Aborted, "{e}");

    let (guard, _delivery) = node
        .reservations
        .reserve("lapsed", want.clone())
        .expect("reserve");
    drop(guard);
    assert_eq!(node.reservations.pending(), 0);
    let e = push(&node, &header("lapsed", &want, n), &chunks)
        .await
        .expect_err("lease over");
    assert_eq!(e.code(), Code::AlreadyExists, "{e}");
}

#[tokio::test]
async fn a_sender_abort_reaches_the_waiter_with_its_reason() {
    let node = node().await;
    let want = expectation(0..16);
    let chunks = chunks(&want, 8);
    let (_guard, delivery) = node
        .reservations
        .reserve("aborted", want.clone())
        .expect("reserve");
    let mut p = KvPush::start(
        node.channel.clone(),
        &header("aborted", &want, chunks.len() as u32),
    );
    p.send(&chunks[0]).await.expect("first chunk");
    p.abort("prefill cancelled".into());
    match delivery.await.expect("told") {
        Err(Error::Aborted { reason }) => assert_eq!(reason, "prefill cancelled"),
        other => panic!("expected an abort, got {other:?}"),
    }
    // The waiter hears first; the rejection is counted as the push call returns.
    tokio::time::timeout(Duration::from_secs(5), async {
        while rejects(&node, "aborted") == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .expect("counted");
}

/// A receiver that accepts the connection and then says nothing (as a stalled TLS handshake
/// or a dropped path does) holds the sender for [`tandem_transfer::client::PUSH_STALL`]-like
/// bounds only: once the buffer is full, the next chunk fails with `Stalled` within the bound
/// given, and the abort that follows returns at once.
#[tokio::test]
async fn a_receiver_that_says_nothing_stalls_the_push_within_its_bound() {
    let silent = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = silent.local_addr().expect("addr");
    let held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((conn, _)) = silent.accept().await {
            held.push(conn);
        }
    });
    let want = expectation(0..64);
    let chunks = chunks(&want, 16);
    let channel = tandem_net::channel(&addr.to_string(), None).expect("channel");
    let mut p = KvPush::start(channel, &header("silent", &want, chunks.len() as u32));
    let stall = Duration::from_millis(300);
    let started = std::time::Instant::now();
    let mut sent = 0;
    let err = loop {
        match p.send_within(&chunks[sent % chunks.len()], stall).await {
            Ok(()) => sent += 1,
            Err(e) => break e,
        }
        assert!(sent < 1000, "a silent receiver took {sent} chunks");
    };
    assert!(matches!(err, Error::Stalled { waited_ms: 300 }), "{err}");
    assert_eq!(err.request_code(), Code::Unavailable);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "stalled only after {:?}",
        started.elapsed()
    );
    let aborting = std::time::Instant::now();
    p.abort("stalled".into());
    assert!(aborting.elapsed() < Duration::from_millis(100));
    held.abort();
}
