//! `tandem bench serve`: what disaggregation costs and buys, measured in one run.
//!
//! 1. Latency through an in-process cluster (router, one prefill and one decode node, real gRPC
//!    on loopback sockets): TTFT and inter-token latency p50/p99 at each concurrency, next to
//!    the engine alone (same prompts: prefills one after another, then batched decode steps)
//!    and, with `--llama-server`, llama-server's streaming `/completion` endpoint.
//! 2. KV transfer throughput for one prompt's KV (`--transfer-tokens`, real KV from the model)
//!    through `KvTransfer` on loopback, against a plain TCP copy of the same bytes; medians.
//! 3. The share of TTFT spent on the transfer, for short and long prompts, from the timings the
//!    cluster reports on the final frame.
//!
//! Progress goes to stderr; the report (or `--json`) to stdout.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use serde::Serialize;
use tandem_engine::{Engine, EngineConfig, Model, SeqId, argmax};
use tandem_integration_tests::{Cluster, ClusterConfig};
use tandem_proto::v1 as pb;
use tandem_transfer::{Chunk, Expectation, Header, KvPush, Reservations, WireLayout};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::ModelArgs;

#[derive(Args, Debug)]
pub(crate) struct ServeBenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Comma-separated client concurrency levels.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    concurrency: Vec<usize>,
    /// Prompt length of the latency requests.
    #[arg(long, default_value_t = 100)]
    prompt_tokens: usize,
    /// Tokens generated per latency request.
    #[arg(long, default_value_t = 64)]
    gen_tokens: usize,
    /// Requests per concurrency level (at least the concurrency).
    #[arg(long, default_value_t = 32)]
    requests: usize,
    /// Prompt length for the transfer throughput measurement.
    #[arg(long, default_value_t = 2000)]
    transfer_tokens: usize,
    /// Comma-separated prompt lengths for the transfer's share of TTFT.
    #[arg(long, value_delimiter = ',', default_value = "100,2000")]
    share_tokens: Vec<usize>,
    /// Runs of each transfer and share measurement; medians are reported.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Compute threads per node (0 = one per core).
    #[arg(long, env = "TANDEM_THREADS", default_value_t = 0)]
    threads: usize,
    /// A running llama-server (host:port) serving the same GGUF, measured with the same load.
    #[arg(long)]
    llama_server: Option<String>,
    /// Print the results as one JSON object.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize, Debug)]
struct Latency {
    system: &'static str,
    concurrency: usize,
    ttft_p50_ms: f64,
    ttft_p99_ms: f64,
    itl_p50_ms: f64,
    itl_p99_ms: f64,
}

#[derive(Serialize, Debug)]
struct Transfer {
    tokens: usize,
    bytes: u64,
    grpc_mb_s: f64,
    tcp_mb_s: f64,
    ratio: f64,
}

#[derive(Serialize, Debug)]
struct Share {
    prompt_tokens: usize,
    ttft_ms: f64,
    prefill_ms: f64,
    transfer_ms: f64,
    /// TTFT not covered by queueing or prefill compute: the part of the transfer (and the
    /// hand-off to decode) that did not overlap compute.
    exposed_transfer_ms: f64,
    exposed_share: f64,
}

#[derive(Serialize, Debug)]
struct Report {
    latency: Vec<Latency>,
    transfer: Transfer,
    share: Vec<Share>,
    threads: usize,
}

pub(crate) fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i]
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    percentile(&mut v, 0.5)
}

/// A deterministic prompt of ordinary tokens; `salt` makes prompts differ.
fn prompt(model: &Model, n: usize, salt: u32) -> Vec<u32> {
    let vocab = model.config.vocab as u32;
    (0..n as u32)
        .map(|i| 100 + (i * 7919 + salt * 104_729) % (vocab - 100).max(1))
        .map(|t| t.min(vocab - 1))
        .collect()
}

fn request(tokens: Vec<u32>, gen_tokens: usize) -> pb::GenerateRequest {
    pb::GenerateRequest {
        token_ids: tokens,
        sampling: Some(pb::SamplingParams {
            max_tokens: gen_tokens as u32,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Per-request TTFT and inter-token gaps, in ms.
#[derive(Default)]
struct Samples {
    ttft: Vec<f64>,
    itl: Vec<f64>,
}

impl Samples {
    fn latency(mut self, system: &'static str, concurrency: usize) -> Latency {
        Latency {
            system,
            concurrency,
            ttft_p50_ms: percentile(&mut self.ttft, 0.5),
            ttft_p99_ms: percentile(&mut self.ttft, 0.99),
            itl_p50_ms: percentile(&mut self.itl, 0.5),
            itl_p99_ms: percentile(&mut self.itl, 0.99),
        }
    }

    /// Records one request: sent at `sent`, token frames arriving at `arrivals`.
    fn record(&mut self, sent: Instant, arrivals: &[Instant]) {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        if let Some(first) = arrivals.first() {
            self.ttft.push(ms(*first - sent));
        }
        self.itl
            .extend(arrivals.windows(2).map(|w| ms(w[1] - w[0])));
    }
}

/// Sends every prompt through `one` from `concurrency` closed-loop clients; `one` returns when
/// the request was sent and when each token arrived.
async fn drive<F, Fut>(prompts: &[Vec<u32>], concurrency: usize, one: F) -> anyhow::Result<Samples>
where
    F: Fn(Vec<u32>) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<(Instant, Vec<Instant>)>> + Send,
{
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (one, next, prompts) = (one.clone(), next.clone(), prompts.to_vec());
        tasks.push(tokio::spawn(async move {
            let mut s = Samples::default();
            while let Some(p) = prompts.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
            {
                let (sent, arrivals) = one(p.clone()).await?;
                s.record(sent, &arrivals);
            }
            Ok::<_, anyhow::Error>(s)
        }));
    }
    let mut all = Samples::default();
    for t in tasks {
        let s = t.await??;
        all.ttft.extend(s.ttft);
        all.itl.extend(s.itl);
    }
    Ok(all)
}

/// One request through the cluster's router.
async fn cluster_request(
    mut client: pb::generation_client::GenerationClient<tonic::transport::Channel>,
    prompt: Vec<u32>,
    gen_tokens: usize,
) -> anyhow::Result<(Instant, Vec<Instant>)> {
    let sent = Instant::now();
    let mut frames = client
        .generate(request(prompt, gen_tokens))
        .await?
        .into_inner();
    let mut arrivals = Vec::new();
    while let Some(f) = frames.message().await? {
        if !f.token_ids.is_empty() {
            arrivals.push(Instant::now());
        }
    }
    Ok((sent, arrivals))
}

/// One request to llama-server's streaming `/completion`; each server-sent event is a token.
async fn llama_request(
    addr: String,
    prompt: Vec<u32>,
    gen_tokens: usize,
) -> anyhow::Result<(Instant, Vec<Instant>)> {
    let body = serde_json::json!({
        "prompt": prompt, "n_predict": gen_tokens, "stream": true, "temperature": 0.0,
        "cache_prompt": false, "ignore_eos": true,
    })
    .to_string();
    let mut conn = TcpStream::connect(&addr).await?;
    conn.set_nodelay(true)?;
    let head = format!(
        "POST /completion HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let sent = Instant::now();
    conn.write_all(head.as_bytes()).await?;
    conn.write_all(body.as_bytes()).await?;
    let mut arrivals = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut pending = Vec::new();
    loop {
        let n = conn.read(&mut buf).await?;
        if n == 0 {
            return Ok((sent, arrivals));
        }
        pending.extend_from_slice(&buf[..n]);
        while let Some(at) = pending.windows(6).position(|w| w == b"data: ") {
            pending.drain(..at + 6);
            arrivals.push(Instant::now());
        }
    }
}

/// The engine alone serving the same load: `concurrency` prompts prefilled one after another
/// (so the k-th waits for the earlier ones), then decoded as one batch.
fn engine_latency(
    engine: &mut Engine,
    prompts: &[Vec<u32>],
    gen_tokens: usize,
    concurrency: usize,
) -> anyhow::Result<Samples> {
    let mut s = Samples::default();
    for wave in prompts.chunks(concurrency) {
        let start = Instant::now();
        let mut batch: Vec<(SeqId, u32)> = Vec::new();
        for p in wave {
            let seq = engine.new_sequence();
            let logits = engine.prefill(seq, p)?;
            s.ttft.push(start.elapsed().as_secs_f64() * 1e3);
            batch.push((seq, argmax(&logits)));
        }
        for _ in 1..gen_tokens {
            let t = Instant::now();
            let logits = engine.step(&batch)?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            s.itl.extend(std::iter::repeat_n(ms, batch.len()));
            for ((_, next), l) in batch.iter_mut().zip(&logits) {
                *next = argmax(l);
            }
        }
        for (seq, _) in batch {
            engine.free(seq)?;
        }
    }
    Ok(s)
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
    tokens: &[u32],
    chunks: &[Chunk],
    runs: usize,
) -> anyhow::Result<Transfer> {
    let l = model.config.kv_layout();
    let layout = WireLayout {
        layers: l.n_layers as u32,
        kv_heads: l.n_kv_heads as u32,
        head_dim: l.head_dim as u32,
        block_tokens: tandem_engine::BLOCK_TOKENS as u32,
    };
    let bytes: u64 = chunks.iter().map(|c| c.data.len() as u64).sum();
    // The receiving service on its own loopback server.
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let reservations = Reservations::default();
    let metrics = tandem_transfer::TransferMetrics::register(&mut Default::default());
    let svc = tandem_transfer::KvTransferService::new(reservations.clone(), metrics).into_server();
    let server = tokio::spawn(
        tandem_proto::net::server()
            .add_service(svc)
            .serve_with_incoming(tandem_proto::net::incoming(listener)),
    );
    let channel = tandem_proto::net::channel(&addr.to_string())?;
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
        push.finish(0).await?;
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
    let mb = bytes as f64 / 1e6;
    let grpc_mb_s = mb / median(grpc);
    let tcp_mb_s = mb / median(tcp);
    Ok(Transfer {
        tokens: tokens.len(),
        bytes,
        grpc_mb_s,
        tcp_mb_s,
        ratio: grpc_mb_s / tcp_mb_s,
    })
}

async fn share(cluster: &Cluster, model: &Model, n: usize, runs: usize) -> anyhow::Result<Share> {
    let mut client = cluster.client();
    let (mut ttft, mut prefill, mut transfer, mut exposed) = (vec![], vec![], vec![], vec![]);
    for run in 0..runs {
        let mut frames = client
            .generate(request(prompt(model, n, 1000 + run as u32), 1))
            .await?
            .into_inner();
        let mut timings = None;
        while let Some(f) = frames.message().await? {
            timings = f.timings.or(timings);
        }
        let t = timings.context("no final frame")?;
        ttft.push(t.first_token_ms);
        prefill.push(t.prefill_ms);
        transfer.push(t.transfer_ms);
        exposed.push((t.first_token_ms - t.queue_ms - t.prefill_ms).max(0.0));
    }
    let ttft_ms = median(ttft);
    let exposed_transfer_ms = median(exposed);
    Ok(Share {
        prompt_tokens: n,
        ttft_ms,
        prefill_ms: median(prefill),
        transfer_ms: median(transfer),
        exposed_transfer_ms,
        exposed_share: exposed_transfer_ms / ttft_ms,
    })
}

pub(crate) fn serve(args: &ServeBenchArgs) -> anyhow::Result<()> {
    if args.runs == 0 || args.prompt_tokens == 0 || args.gen_tokens < 2 {
        bail!("--runs and --prompt-tokens must be at least 1, --gen-tokens at least 2");
    }
    if args.concurrency.contains(&0) {
        bail!("--concurrency levels must be at least 1");
    }
    let model = args.model.source().load()?;
    let ctx = model.config.context_len;
    let longest = args
        .share_tokens
        .iter()
        .chain([&args.transfer_tokens, &args.prompt_tokens])
        .max()
        .copied()
        .unwrap_or(0);
    if longest + args.gen_tokens > ctx {
        bail!("prompts of {longest} tokens plus --gen-tokens must fit the context of {ctx}");
    }
    let engine_config = EngineConfig {
        threads: args.threads,
        kv_budget_bytes: 256 << 20,
        ..EngineConfig::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let report = rt.block_on(async {
        let cluster = Cluster::start(ClusterConfig {
            engine: engine_config.clone(),
            decode_slots: args.concurrency.iter().copied().max().unwrap_or(16).max(16),
            ..ClusterConfig::new(model.clone())
        })
        .await?;
        let mut latency = Vec::new();
        let mut engine = Engine::new(model.clone(), engine_config.clone())?;
        for &c in &args.concurrency {
            let prompts: Vec<Vec<u32>> = (0..args.requests.max(c))
                .map(|i| prompt(&model, args.prompt_tokens, i as u32))
                .collect();
            eprintln!("latency at concurrency {c}: {} requests", prompts.len());
            let gen_tokens = args.gen_tokens;
            let client = cluster.client();
            let one = move |p| cluster_request(client.clone(), p, gen_tokens);
            latency.push(drive(&prompts, c, one).await?.latency("tandem", c));
            latency.push(
                engine_latency(&mut engine, &prompts, args.gen_tokens, c)?.latency("engine", c),
            );
            if let Some(addr) = args.llama_server.clone() {
                let one = move |p| llama_request(addr.clone(), p, gen_tokens);
                latency.push(drive(&prompts, c, one).await?.latency("llama-server", c));
            }
        }
        eprintln!("transfer throughput: {} tokens", args.transfer_tokens);
        let tokens = prompt(&model, args.transfer_tokens, 7);
        let chunks = real_chunks(&mut engine, &tokens)?;
        drop(engine);
        let transfer = transfer_throughput(&model, &tokens, &chunks, args.runs).await?;
        let mut shares = Vec::new();
        for &n in &args.share_tokens {
            eprintln!("transfer share of TTFT: {n}-token prompts");
            shares.push(share(&cluster, &model, n, args.runs).await?);
        }
        cluster.stop().await?;
        Ok::<_, anyhow::Error>(Report {
            latency,
            transfer,
            share: shares,
            threads: args.threads,
        })
    })?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    println!(
        "{:<13} {:>4} {:>10} {:>10} {:>10} {:>10}",
        "system", "conc", "ttft p50", "ttft p99", "itl p50", "itl p99"
    );
    for l in &report.latency {
        println!(
            "{:<13} {:>4} {:>8.1}ms {:>8.1}ms {:>8.2}ms {:>8.2}ms",
            l.system, l.concurrency, l.ttft_p50_ms, l.ttft_p99_ms, l.itl_p50_ms, l.itl_p99_ms
        );
    }
    let t = &report.transfer;
    println!(
        "KV transfer, {} tokens ({:.1} MB): gRPC {:.0} MB/s, plain TCP {:.0} MB/s, ratio {:.2}",
        t.tokens,
        t.bytes as f64 / 1e6,
        t.grpc_mb_s,
        t.tcp_mb_s,
        t.ratio
    );
    for s in &report.share {
        println!(
            "{:>5}-token prompt: TTFT {:.1} ms, prefill {:.1} ms, transfer span {:.1} ms, exposed transfer {:.1} ms ({:.0}% of TTFT)",
            s.prompt_tokens,
            s.ttft_ms,
            s.prefill_ms,
            s.transfer_ms,
            s.exposed_transfer_ms,
            s.exposed_share * 100.0
        );
    }
    Ok(())
}
