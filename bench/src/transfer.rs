//! `tandem-bench transfer`: KV transfer throughput for one prompt's real KV (computed by the
//! engine, chunked as a prefill node chunks it) through `KvTransfer` on loopback, against a
//! plain TCP copy of the same bytes; medians of `--runs`, for each KV dtype asked for. Progress
//! goes to stderr; the report (or `--json`) to stdout.

use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use serde::Serialize;
use tandem_engine::{Engine, EngineConfig, Model};
use tandem_transfer::{Chunk, Expectation, Header, KvPush, Reservations, WireLayout};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::stats::median;
use tandem_client::ModelArgs;

#[derive(Args, Debug)]
pub(crate) struct TransferArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt length whose KV is sent.
    #[arg(long, default_value_t = 2000)]
    tokens: usize,
    /// Runs; medians are reported.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Compute threads for the prefill that makes the KV (0 = one per core).
    #[arg(long, env = "TANDEM_THREADS", default_value_t = 0)]
    threads: usize,
    /// Comma-separated KV dtypes (`f16`, `q8`): the KV is computed and sent in each.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "f16")]
    kv_dtype: Vec<tandem_client::KvDtype>,
    /// Print one JSON object per dtype, one per line.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize, Debug)]
struct Transfer {
    kv_dtype: &'static str,
    tokens: usize,
    bytes: u64,
    /// The median gRPC push, header to acknowledged delivery, in ms.
    grpc_ms: f64,
    grpc_mb_s: f64,
    tcp_mb_s: f64,
    ratio: f64,
}

/// The KV chunks a prefill node would send for `tokens` (256-token chunks, per layer and kind).
fn real_chunks(engine: &mut Engine, tokens: &[u32]) -> anyhow::Result<Vec<Chunk>> {
    let seq = engine.new_sequence();
    let step = engine.prefill_chunk_tokens();
    let mut chunks = Vec::new();
    for start in (0..tokens.len()).step_by(step) {
        let range = start..(start + step).min(tokens.len());
        engine.prefill(seq, &tokens[range.clone()])?;
        chunks.extend(tandem_worker::kv_chunks(engine.export_kv(seq, range)?));
    }
    engine.free(seq)?;
    Ok(chunks)
}

async fn transfer_throughput(
    model: &Model,
    layout: WireLayout,
    tokens: &[u32],
    chunks: &[Chunk],
    runs: usize,
) -> anyhow::Result<(f64, f64)> {
    let bytes: u64 = chunks.iter().map(|c| c.data.len() as u64).sum();
    // The receiving service on its own loopback server.
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let reservations = Reservations::default();
    let metrics = tandem_transfer::TransferMetrics::register(&mut Default::default());
    let svc = tandem_transfer::KvTransferService::new(reservations.clone(), metrics).into_server();
    let server = tokio::spawn(
        tandem_net::server()
            .add_service(svc)
            .serve_with_incoming(tandem_net::incoming(listener)),
    );
    let channel = tandem_net::channel(&addr.to_string(), None)?;
    let mut grpc = Vec::new();
    let mut tcp = Vec::new();
    for run in 0..runs {
        let id = format!("bench-{run}");
        let want = Expectation {
            fingerprint: model.fingerprint.0,
            layout,
            tokens: 0..tokens.len() as u32,
            token_ids: tokens.to_vec(),
            max_bytes: bytes,
        };
        let (_lease, delivery) = reservations.reserve(&id, want)?;
        let header = Header {
            transfer_id: id,
            request_id: String::new(),
            fingerprint: model.fingerprint.0,
            layout,
            tokens: 0..tokens.len() as u32,
            token_ids: tokens.to_vec(),
            chunk_count: chunks.len() as u32,
            total_bytes: bytes,
        };
        let t = Instant::now();
        let mut push = KvPush::start(channel.clone(), &header);
        for c in chunks {
            push.send(c).await?;
        }
        push.finish(0, None).await?;
        delivery.await.context("delivery")??;
        grpc.push(t.elapsed().as_secs_f64());

        // The same bytes over a plain loopback TCP connection, read into memory.
        let sink = TcpListener::bind("127.0.0.1:0").await?;
        let sink_addr = sink.local_addr()?;
        let reader = tokio::spawn(async move {
            let (mut s, _) = sink.accept().await?;
            let mut received = Vec::with_capacity(bytes as usize);
            s.read_to_end(&mut received).await?;
            s.write_all(&[1]).await?;
            Ok::<_, std::io::Error>(received.len())
        });
        let t = Instant::now();
        let mut conn = TcpStream::connect(sink_addr).await?;
        conn.set_nodelay(true)?;
        for c in chunks {
            conn.write_all(&c.data).await?;
        }
        conn.shutdown().await?;
        let mut ack = [0u8; 1];
        conn.read_exact(&mut ack).await?;
        let received = reader.await??;
        tcp.push(t.elapsed().as_secs_f64());
        anyhow::ensure!(received as u64 == bytes, "the TCP copy lost bytes");
        eprintln!(
            "transfer run {}/{runs}: gRPC {:.1} ms, TCP {:.1} ms",
            run + 1,
            grpc[run] * 1e3,
            tcp[run] * 1e3
        );
    }
    server.abort();
    Ok((median(grpc), median(tcp)))
}

pub(crate) fn transfer(args: &TransferArgs) -> anyhow::Result<()> {
    if args.runs == 0 || args.tokens == 0 {
        bail!("--runs and --tokens must be at least 1");
    }
    let model = args.model.source().load()?;
    let ctx = model.config.context_len;
    if args.tokens >= ctx {
        bail!("--tokens must be less than the context of {ctx}");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let tokens = super::ordinary_tokens(&model, args.tokens, 0);
    for dtype in &args.kv_dtype {
        let mut engine = Engine::new(
            model.clone(),
            EngineConfig {
                threads: args.threads,
                kv_budget_bytes: (args.tokens + tandem_engine::BLOCK_TOKENS)
                    * model.config.kv_layout(dtype.dtype()).token_bytes(),
                kv_dtype: dtype.dtype(),
                ..EngineConfig::default()
            },
        )?;
        let name = dtype.dtype().name();
        eprintln!("computing the {name} KV of a {}-token prompt", args.tokens);
        let chunks = real_chunks(&mut engine, &tokens)?;
        let layout = tandem_worker::wire_layout(engine.kv_layout());
        drop(engine);
        let (grpc, tcp) = rt.block_on(transfer_throughput(
            &model, layout, &tokens, &chunks, args.runs,
        ))?;
        let bytes: u64 = chunks.iter().map(|c| c.data.len() as u64).sum();
        let mb = bytes as f64 / 1e6;
        let t = Transfer {
            kv_dtype: name,
            tokens: tokens.len(),
            bytes,
            grpc_ms: grpc * 1e3,
            grpc_mb_s: mb / grpc,
            tcp_mb_s: mb / tcp,
            ratio: tcp / grpc,
        };
        if args.json {
            println!("{}", serde_json::to_string(&t)?);
        } else {
            println!(
                "KV transfer, {} tokens of {name} ({:.1} MB): gRPC {:.1} ms, {:.0} MB/s; plain TCP {:.0} MB/s; ratio {:.2}",
                t.tokens, mb, t.grpc_ms, t.grpc_mb_s, t.tcp_mb_s, t.ratio
            );
        }
    }
    Ok(())
}
