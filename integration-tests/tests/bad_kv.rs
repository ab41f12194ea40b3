//! A decode node never produces tokens from bad KV: a corrupted chunk, a wrong fingerprint, a
//! reused transfer id or an oversized header is rejected with a precise status to the sender,
//! the waiting request fails cleanly, and the node's slots and blocks return to baseline.
//! A clean push of the same KV, for contrast, decodes exactly like local generation.

use bytes::Bytes;
use tandem_engine::{Engine, EngineConfig, GenerateParams, GenerateRequest, Model};
use tandem_integration_tests::{Cluster, ClusterConfig};
use tandem_proto::v1 as pb;
use tandem_transfer::{Chunk, Header, KvPush};
use tonic::Code;
use tonic::transport::Channel;

const PROMPT: [u32; 21] = [
    10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170, 180, 190, 200, 5,
];

struct Kv {
    chunks: Vec<Chunk>,
    first_token: u32,
}

/// The prompt's real KV and first token, computed locally, as a prefill node would send them.
fn real_kv(model: &std::sync::Arc<Model>) -> Kv {
    let mut engine = Engine::new(model.clone(), EngineConfig::default()).expect("engine");
    let seq = engine.new_sequence();
    let logits = engine.prefill(seq, &PROMPT).expect("prefill");
    let kv = engine.export_kv(seq, 0..PROMPT.len()).expect("export");
    Kv {
        chunks: tandem_worker::kv_chunks(kv).collect(),
        first_token: tandem_engine::argmax(&logits),
    }
}

fn header(model: &Model, transfer_id: &str, kv: &Kv) -> Header {
    let layout = tandem_worker::wire_layout(model.config.kv_layout(tandem_engine::KvDtype::F16));
    Header {
        transfer_id: transfer_id.into(),
        request_id: "bad-kv".into(),
        fingerprint: model.fingerprint.0,
        layout,
        tokens: 0..PROMPT.len() as u32,
        token_ids: PROMPT.to_vec(),
        chunk_count: kv.chunks.len() as u32,
        total_bytes: layout.total_bytes(PROMPT.len()),
    }
}

/// Opens a decode request for `transfer_id` and waits until it is admitted.
async fn admit(decode: Channel, transfer_id: &str) -> tonic::Streaming<pb::DecodeResponse> {
    let mut client = pb::decode_client::DecodeClient::new(decode);
    let mut stream = client
        .generate(pb::DecodeRequest {
            request_id: "bad-kv".into(),
            transfer_id: transfer_id.into(),
            prompt_token_ids: PROMPT.to_vec(),
            sampling: Some(pb::SamplingParams {
                max_tokens: 8,
                ..Default::default()
            }),
            kv_wait_ms: 5_000,
            ..Default::default()
        })
        .await
        .expect("decode call")
        .into_inner();
    let first = stream.message().await.expect("admission").expect("a frame");
    assert!(matches!(
        first.event,
        Some(pb::decode_response::Event::Admitted(_))
    ));
    stream
}

/// Reads the rest of a decode stream: the tokens, or the status it ended with.
async fn rest(mut stream: tonic::Streaming<pb::DecodeResponse>) -> Result<Vec<u32>, tonic::Status> {
    let mut tokens = Vec::new();
    while let Some(m) = stream.message().await? {
        if let Some(pb::decode_response::Event::Tokens(t)) = m.event {
            tokens.extend(t.token_ids);
            if t.finish_reason != pb::FinishReason::Unspecified as i32 {
                return Ok(tokens);
            }
        }
    }
    Err(tonic::Status::data_loss("ended without a final frame"))
}

async fn push(
    channel: Channel,
    header: &Header,
    chunks: &[Chunk],
    first: u32,
) -> tandem_transfer::Result<u64> {
    let mut p = KvPush::start(channel, header);
    for c in chunks {
        if p.send(c).await.is_err() {
            break;
        }
    }
    p.finish(first, None).await.map(|a| a.bytes_received)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_kv_is_rejected_precisely_and_never_decoded() {
    let model = tandem_engine::ModelSource::TINY.load().expect("tiny");
    let kv = real_kv(&model);
    // Every push here carries the whole prompt: no session cache holds part of it.
    let cluster = Cluster::start(ClusterConfig {
        prefix_cache: false,
        ..ClusterConfig::new(model.clone())
    })
    .await
    .expect("cluster");
    let decode = cluster.decode[0].channel();
    let baseline = cluster.decode_load(0).await.expect("load");

    // A clean push decodes exactly like local generation.
    let stream = admit(decode.clone(), "clean").await;
    push(
        decode.clone(),
        &header(&model, "clean", &kv),
        &kv.chunks,
        kv.first_token,
    )
    .await
    .expect("clean push");
    let mut engine = Engine::new(model.clone(), EngineConfig::default()).expect("engine");
    let local = engine
        .generate_batch(&[GenerateRequest {
            prompt: PROMPT.to_vec(),
            params: GenerateParams {
                max_tokens: 8,
                ..GenerateParams::default()
            },
        }])
        .expect("local");
    assert_eq!(rest(stream).await.expect("tokens"), local[0].token_ids);

    // A corrupted chunk: DATA_LOSS to the sender and to the waiting request.
    let stream = admit(decode.clone(), "corrupt").await;
    let (tx, rx) = tokio::sync::mpsc::channel(256);
    let frame = |f| pb::PushFrame { frame: Some(f) };
    tx.send(frame(pb::push_frame::Frame::Header(
        header(&model, "corrupt", &kv).to_pb(),
    )))
    .await
    .expect("queue");
    for (i, c) in kv.chunks.iter().enumerate() {
        let mut wire = c.to_pb();
        if i == 3 {
            let mut d = wire.data.to_vec();
            d[10] ^= 1;
            wire.data = Bytes::from(d);
        }
        tx.send(frame(pb::push_frame::Frame::Chunk(wire)))
            .await
            .expect("queue");
    }
    drop(tx);
    let status = pb::kv_transfer_client::KvTransferClient::new(decode.clone())
        .push(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect_err("corrupt chunk");
    assert_eq!(status.code(), Code::DataLoss, "{status:?}");
    let status = rest(stream).await.expect_err("no tokens from bad KV");
    assert_eq!(status.code(), Code::DataLoss, "{status:?}");

    // A wrong fingerprint.
    let stream = admit(decode.clone(), "fingerprint").await;
    let mut h = header(&model, "fingerprint", &kv);
    h.fingerprint[0] ^= 0xff;
    let e = push(decode.clone(), &h, &kv.chunks, kv.first_token)
        .await
        .expect_err("fingerprint");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert!(e.to_string().contains("fingerprint"), "{e}");
    let status = rest(stream).await.expect_err("no tokens from bad KV");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");

    // A reused transfer id (the clean one above).
    let e = push(
        decode.clone(),
        &header(&model, "clean", &kv),
        &kv.chunks,
        kv.first_token,
    )
    .await
    .expect_err("reused");
    assert_eq!(e.code(), Code::AlreadyExists, "{e}");

    // An oversized header: more bytes than the reservation allows.
    let stream = admit(decode.clone(), "oversized").await;
    let mut h = header(&model, "oversized", &kv);
    h.total_bytes *= 100;
    let e = push(decode.clone(), &h, &kv.chunks, kv.first_token)
        .await
        .expect_err("oversized");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    rest(stream).await.expect_err("no tokens from bad KV");

    assert_eq!(
        (baseline.active, baseline.kv_blocks_free),
        (0, baseline.kv_blocks_total)
    );
    cluster
        .until_decode_idle(0)
        .await
        .expect("back to baseline");
    cluster.stop().await.expect("clean stop");
}
