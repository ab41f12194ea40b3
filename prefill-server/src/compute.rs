//! The compute thread: one prefill at a time (prefill is compute-bound; batch 1 as soon as a
//! request arrives). It starts from the longest prefix its cache holds, computes the rest in
//! chunks, and pushes the KV the decode node lacks while the next chunk computes. The prompt's
//! full blocks then stay in the prefix cache.
//!
//! ```text
//! Prefill handler ──Job (bounded queue)──▶ compute thread: seq = cached prefix
//!        ▲                                     for each push cell of [decode_cached, len):
//!        │                                       compute up to its end, export ─▶ KvPush::blocking_send
//!        │                                     cache the prompt's blocks ─▶ CacheHub (events)
//!        └────────── reply (first token, KvPush) ◀─┘
//! ```
//!
//! Push cells and compute chunks are both cut at multiples of the chunk size, so every compute
//! chunk completes exactly one push cell, and the header's chunk count is known before the cache
//! is consulted.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use tandem_engine::{Engine, SamplingParams, SeqId};
use tandem_transfer::KvPush;
use tandem_worker::{CacheHub, Throughput};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::metrics::PrefillMetrics;

/// One prefill to run, and where its outcome goes.
#[derive(Debug)]
pub(crate) struct Job {
    pub work: Work,
    pub reply: oneshot::Sender<Result<Done>>,
}

#[derive(Debug)]
pub(crate) struct Work {
    pub tokens: Vec<u32>,
    /// Block hashes of the prompt's full blocks (empty with the cache off).
    pub hashes: Vec<u64>,
    /// The prompt tokens whose KV goes to the decode node (it holds the rest).
    pub push: Range<usize>,
    pub sampling: SamplingParams,
    pub kv: KvPush,
    pub cancel: CancellationToken,
}

/// A finished prefill: the push still needs its trailer (sent by the async side).
#[derive(Debug)]
pub(crate) struct Done {
    /// `None` when the receiver ended the push early; `KvPush::finish` says why.
    pub first_token: Option<u32>,
    pub kv: KvPush,
    pub compute_ms: f64,
    pub first_chunk_sent: Option<Instant>,
    /// Prompt tokens found in the prefix cache.
    pub cached_tokens: usize,
}

/// What the compute thread shares with the service.
#[derive(Debug)]
pub(crate) struct Shared {
    pub metrics: PrefillMetrics,
    pub hub: Arc<CacheHub>,
    pub throughput: Throughput,
}

pub(crate) fn spawn(
    mut engine: Engine,
    mut jobs: mpsc::Receiver<Job>,
    shared: Arc<Shared>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("tandem-prefill-compute".into())
        .spawn(move || {
            while let Some(Job { work, reply }) = jobs.blocking_recv() {
                let n = work.tokens.len();
                let started = Instant::now();
                let result = run(&mut engine, work);
                shared.hub.publish(engine.take_cache_events());
                let m = &shared.metrics;
                m.queue_depth.dec();
                m.queued_tokens.dec_by(n as i64);
                m.cache_blocks.set(engine.kv_blocks_cached() as i64);
                if let Ok(done) = &result {
                    let secs = started.elapsed().as_secs_f64();
                    let computed = n - done.cached_tokens;
                    m.tokens.inc_by(computed as u64);
                    m.cached_tokens.inc_by(done.cached_tokens as u64);
                    m.seconds.observe(secs);
                    m.tokens_per_second
                        .observe(computed as f64 / secs.max(1e-9));
                    shared.throughput.record(computed, secs);
                }
                let _ = reply.send(result);
            }
        })
}

fn run(engine: &mut Engine, work: Work) -> Result<Done> {
    let Work {
        tokens,
        hashes,
        push,
        sampling,
        mut kv,
        cancel,
    } = work;
    let started = Instant::now();
    let reusable = tandem_proto::block_hash::reusable_blocks(tokens.len()).min(hashes.len());
    let (seq, cached) = engine.new_sequence_cached(&hashes[..reusable]);
    let outcome = compute_and_push(engine, seq, cached, &tokens, push, &mut kv, &cancel);
    let outcome = outcome.and_then(|(logits, first_chunk_sent)| {
        let first = logits.map(|l| tandem_engine::sample(&l, &sampling, tokens.len() as u64));
        // A push the receiver ended early leaves the prompt partly computed: cache what is.
        let full_blocks = engine.seq_len(seq)? / tandem_engine::BLOCK_TOKENS;
        engine.cache_sequence(seq, &hashes[..hashes.len().min(full_blocks)])?;
        Ok((first, first_chunk_sent))
    });
    let _ = engine.free(seq);
    let (first_token, first_chunk_sent) = match outcome {
        Ok(o) => o,
        Err(e) => {
            // The decode node is waiting on this transfer: tell it why it will not complete.
            kv.blocking_abort(e.to_string());
            return Err(e);
        }
    };
    Ok(Done {
        first_token,
        kv,
        compute_ms: started.elapsed().as_secs_f64() * 1e3,
        first_chunk_sent,
        cached_tokens: cached,
    })
}

/// Computes `tokens[cached..]` onto `seq` and pushes the KV of `push`, cell by cell. Returns the
/// last position's logits, or `None` when the receiver ended the push early.
fn compute_and_push(
    engine: &mut Engine,
    seq: SeqId,
    cached: usize,
    tokens: &[u32],
    push: Range<usize>,
    kv: &mut KvPush,
    cancel: &CancellationToken,
) -> Result<(Option<Vec<f32>>, Option<Instant>)> {
    let grid = engine.prefill_chunk_tokens();
    let mut cells = tandem_worker::grid_cells(cached..tokens.len(), grid);
    let mut computed = cached;
    let mut logits = Vec::new();
    let mut first_chunk_sent = None;
    for cell in tandem_worker::grid_cells(push, grid) {
        while computed < cell.end {
            if cancel.is_cancelled() {
                return Err(Error::Cancelled);
            }
            let Some(c) = cells.next() else { break };
            logits = engine.prefill(seq, &tokens[c.clone()])?;
            computed = c.end;
        }
        for chunk in tandem_worker::kv_chunks(engine.export_kv(seq, cell)?) {
            first_chunk_sent.get_or_insert_with(Instant::now);
            // An error means the receiver ended the push; its verdict comes from `finish`,
            // so stop computing and hand the push back.
            if kv.blocking_send(&chunk).is_err() {
                return Ok((None, first_chunk_sent));
            }
        }
    }
    Ok((Some(logits), first_chunk_sent))
}
