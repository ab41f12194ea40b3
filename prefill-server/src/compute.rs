//! The compute thread: one prefill at a time (prefill is compute-bound; batch 1 as soon as a
//! request arrives), pushing each chunk's KV to the decode node while the next chunk computes.
//!
//! ```text
//! Prefill handler ──Job (bounded queue)──▶ compute thread: for each chunk of the prompt
//!        ▲                                     engine.prefill(chunk) ─▶ export ─▶ KvPush::blocking_send
//!        └────────── reply (first token, KvPush) ◀─┘                        │ (bounded: a slow
//!                                                                            ▼  receiver slows us)
//!                                                                  gRPC stream to decode's KvTransfer
//! ```

use std::ops::Range;
use std::time::Instant;

use bytes::Bytes;
use tandem_engine::{Engine, SamplingParams};
use tandem_transfer::{Chunk, KvKind, KvPush};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::metrics::PrefillMetrics;

/// One prefill to run.
#[derive(Debug)]
pub(crate) struct Job {
    pub tokens: Vec<u32>,
    /// The prompt tokens to compute (the rest the decode node already holds).
    pub compute: Range<usize>,
    pub sampling: SamplingParams,
    pub push: KvPush,
    pub cancel: CancellationToken,
    pub reply: oneshot::Sender<Result<Done>>,
}

/// A finished prefill: the push still needs its trailer (sent by the async side).
#[derive(Debug)]
pub(crate) struct Done {
    /// `None` when the receiver ended the push early; `KvPush::finish` says why.
    pub first_token: Option<u32>,
    pub push: KvPush,
    pub compute_ms: f64,
    pub first_chunk_sent: Option<Instant>,
}

pub(crate) fn spawn(
    mut engine: Engine,
    mut jobs: mpsc::Receiver<Job>,
    metrics: PrefillMetrics,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("tandem-prefill-compute".into())
        .spawn(move || {
            while let Some(job) = jobs.blocking_recv() {
                let Job {
                    tokens,
                    compute,
                    sampling,
                    push,
                    cancel,
                    reply,
                } = job;
                let started = Instant::now();
                let n = compute.len();
                let result = run(&mut engine, &tokens, compute, &sampling, push, &cancel);
                metrics.queue_depth.dec();
                if result.is_ok() {
                    let secs = started.elapsed().as_secs_f64();
                    metrics.tokens.inc_by(n as u64);
                    metrics.seconds.observe(secs);
                    metrics.tokens_per_second.observe(n as f64 / secs.max(1e-9));
                }
                let _ = reply.send(result);
            }
        })
}

fn run(
    engine: &mut Engine,
    tokens: &[u32],
    compute: Range<usize>,
    sampling: &SamplingParams,
    mut push: KvPush,
    cancel: &CancellationToken,
) -> Result<Done> {
    let started = Instant::now();
    let seq = engine.new_sequence();
    let chunk_tokens = engine.prefill_chunk_tokens();
    let outcome = (|| {
        let mut logits = Vec::new();
        let mut first_chunk_sent = None;
        for start in compute.clone().step_by(chunk_tokens) {
            if cancel.is_cancelled() {
                return Err(Error::Cancelled);
            }
            let range = start..(start + chunk_tokens).min(compute.end);
            logits = engine.prefill(seq, &tokens[range.clone()])?;
            let kv = engine.export_kv(seq, range.clone())?;
            let wire = range.start as u32..range.end as u32;
            for (layer, [k, v]) in kv.layers.into_iter().enumerate() {
                for (kind, data) in [(KvKind::K, k), (KvKind::V, v)] {
                    let chunk = Chunk {
                        layer: layer as u32,
                        kind,
                        tokens: wire.clone(),
                        data: Bytes::from(data),
                    };
                    first_chunk_sent.get_or_insert_with(Instant::now);
                    // An error means the receiver ended the push; its verdict comes from
                    // `finish`, so stop computing and hand the push back.
                    if push.blocking_send(&chunk).is_err() {
                        return Ok((None, first_chunk_sent));
                    }
                }
            }
        }
        let first = tandem_engine::sample(&logits, sampling, compute.end as u64);
        Ok((Some(first), first_chunk_sent))
    })();
    let _ = engine.free(seq);
    let (first_token, first_chunk_sent) = match outcome {
        Ok(o) => o,
        Err(e) => {
            // The decode node is waiting on this transfer: tell it why it will not complete.
            push.blocking_abort(e.to_string());
            return Err(e);
        }
    };
    Ok(Done {
        first_token,
        push,
        compute_ms: started.elapsed().as_secs_f64() * 1e3,
        first_chunk_sent,
    })
}
