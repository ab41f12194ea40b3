//! One generation through the cluster: validate and tokenize, choose replicas (the policy),
//! admit on the decode node, prefill (which pushes the KV the decode node lacks) or let the
//! decode node prefill locally, then relay the decode node's token frames, adding usage, timings
//! and the route to the last one.
//!
//! ```text
//! request ─▶ tokens, block hashes ─▶ policy: D (+ P) ─▶ D.Generate ──admitted{cached}──▶ P.Prefill(dest = D)
//!                                                          │ tokens ◀── (KV pushed P ─▶ D) ──┘
//!                                                          ▼  (local: D computes the suffix itself)
//!                                          LogWriter (frames, shared by attached client streams)
//! ```

use std::sync::Arc;
use std::time::Instant;

use tandem_proto::v1 as pb;
use tandem_tokenizer::ChatMessage;
use tokio::time::Instant as TokioInstant;
use tonic::Status;

use crate::error::{Error, Result};
use crate::log::LogWriter;
use crate::metrics::{DecisionLabel, RouterMetrics};
use crate::policy::{Ask, Choice, Policy};
use crate::replicas::{Frontend, Replicas};

/// A request after validation: prompt token ids, their block hashes, and sampling.
#[derive(Debug)]
pub struct Prepared {
    pub request_id: String,
    pub session_id: String,
    pub tokens: Vec<u32>,
    /// Block hashes of the prompt's full blocks that a cache may supply (all but the last
    /// token's block).
    pub hashes: Vec<u64>,
    pub sampling: pb::SamplingParams,
}

/// Checks a client request and turns its input into token ids.
pub fn prepare(front: &Frontend, r: pb::GenerateRequest) -> Result<Prepared> {
    let invalid = |field, reason: &str| {
        Err(Error::InvalidArgument {
            field,
            reason: reason.to_string(),
        })
    };
    let given = usize::from(r.prompt.is_some())
        + usize::from(!r.messages.is_empty())
        + usize::from(!r.token_ids.is_empty());
    if given != 1 {
        return invalid(
            "input",
            "exactly one of prompt, messages and token_ids must be given",
        );
    }
    let Some(sampling) = r.sampling else {
        return invalid("sampling", "sampling with max_tokens is required");
    };
    if sampling.temperature.is_nan() || sampling.temperature < 0.0 {
        return invalid("sampling.temperature", "must be a number at least 0");
    }
    if let Some(p) = sampling.top_p
        && (p.is_nan() || p <= 0.0 || p > 1.0)
    {
        return invalid("sampling.top_p", "must be in (0, 1]");
    }
    if sampling.stop.iter().any(String::is_empty) {
        return invalid("sampling.stop", "stop strings must not be empty");
    }
    if sampling.max_tokens == 0 {
        return invalid("sampling.max_tokens", "must be at least 1");
    }
    let tokens = if let Some(prompt) = r.prompt {
        if prompt.is_empty() {
            return invalid("prompt", "must not be empty");
        }
        front.tokenizer.encode(&prompt)?
    } else if !r.messages.is_empty() {
        let messages: Vec<ChatMessage> = r
            .messages
            .into_iter()
            .map(|m| ChatMessage {
                role: m.role,
                content: m.content,
            })
            .collect();
        let text = front.tokenizer.apply_chat_template(&messages)?;
        front.tokenizer.encode(&text)?
    } else {
        let vocab = front.tokenizer.vocab_size();
        if let Some(t) = r.token_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::InvalidArgument {
                field: "token_ids",
                reason: format!("token id {t} is outside the vocabulary of {vocab}"),
            });
        }
        r.token_ids
    };
    if tokens.is_empty() {
        return invalid("prompt", "tokenizes to nothing");
    }
    if tokens.len() >= front.context_tokens {
        return Err(Error::InvalidArgument {
            field: "prompt",
            reason: format!(
                "{} tokens do not fit the context of {}",
                tokens.len(),
                front.context_tokens
            ),
        });
    }
    if tokens.len() + sampling.max_tokens as usize > front.context_tokens {
        return Err(Error::InvalidArgument {
            field: "sampling.max_tokens",
            reason: format!(
                "prompt of {} tokens plus max_tokens {} exceeds the context of {}",
                tokens.len(),
                sampling.max_tokens,
                front.context_tokens
            ),
        });
    }
    let hashes = tandem_proto::block_hash::prompt_hashes(&front.fingerprint, &tokens);
    Ok(Prepared {
        request_id: r.request_id,
        session_id: r.session_id,
        tokens,
        hashes,
        sampling,
    })
}

/// Everything one dispatch needs.
#[derive(Debug, Clone)]
pub struct Dispatcher {
    pub replicas: Arc<Replicas>,
    pub policy: Arc<Policy>,
    pub metrics: RouterMetrics,
    pub kv_wait: std::time::Duration,
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

fn transfer_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

impl Dispatcher {
    /// Runs the generation, appending frames to `log`, until it ends, `deadline` passes, or
    /// every client stream is gone. Returns the final status code for the metrics.
    pub async fn run(
        &self,
        p: Prepared,
        accepted: Instant,
        deadline: TokioInstant,
        log: &LogWriter,
    ) -> tonic::Code {
        let outcome = tokio::select! {
            r = tokio::time::timeout_at(deadline, self.dispatch(p, accepted, deadline, log)) => {
                match r {
                    // A downstream call may lose the race against its own copy of the deadline
                    // (tonic reports that as CANCELLED): past the deadline, it is the deadline.
                    Ok(Err(_)) if TokioInstant::now() >= deadline => Err(Error::Deadline),
                    r => r.unwrap_or(Err(Error::Deadline)),
                }
            }
            () = log.abandoned() => Err(Error::Downstream {
                hop: "client",
                code: tonic::Code::Cancelled,
                message: "the client went away".into(),
            }),
        };
        match outcome {
            Ok(()) => tonic::Code::Ok,
            Err(e) => {
                let code = e.code();
                log.push(Err(Status::from(e)));
                code
            }
        }
    }

    async fn dispatch(
        &self,
        p: Prepared,
        accepted: Instant,
        deadline: TokioInstant,
        log: &LogWriter,
    ) -> Result<()> {
        let choice = self.policy.choose(
            &self.replicas,
            &Ask {
                tokens: p.tokens.len(),
                hashes: &p.hashes,
                session_id: &p.session_id,
            },
        )?;
        let Choice {
            decode,
            prefill,
            decode_overlap,
            prefill_overlap,
            reason,
            prefill_idle,
        } = choice;
        let local = prefill.is_none();
        self.metrics
            .disagg_decisions
            .get_or_create(&DecisionLabel {
                decision: if local { "local" } else { "remote" },
            })
            .inc();
        let queue_ms = ms(accepted);
        self.metrics.queue.observe(queue_ms / 1e3);
        let remaining = deadline.saturating_duration_since(TokioInstant::now());
        let transfer_id = if local { String::new() } else { transfer_id() };

        let mut d_client = tandem_proto::limits!(pb::decode_client::DecodeClient::new(
            decode.replica().channel.clone()
        ));
        let mut d_req = tonic::Request::new(pb::DecodeRequest {
            request_id: p.request_id.clone(),
            transfer_id: transfer_id.clone(),
            prompt_token_ids: p.tokens.clone(),
            sampling: Some(p.sampling.clone()),
            kv_wait_ms: self.kv_wait.as_millis() as u32,
            local_prefill: local,
        });
        d_req.set_timeout(remaining);
        let mut frames = d_client
            .generate(d_req)
            .await
            .map_err(|s| Error::downstream("decode", &s))?
            .into_inner();
        let admitted = frames
            .message()
            .await
            .map_err(|s| Error::downstream("decode", &s))?;
        let decode_cached = match admitted.and_then(|m| m.event) {
            Some(pb::decode_response::Event::Admitted(a)) => a.cached_tokens,
            _ => {
                return Err(Error::Downstream {
                    hop: "decode",
                    code: tonic::Code::Unavailable,
                    message: "the decode node did not admit the request".into(),
                });
            }
        };

        // Remote: the prefill call runs beside the decode stream (it ends once the KV is
        // pushed). Local: there is none.
        let prefill_call = prefill.as_ref().map(|guard| {
            let mut p_client = tandem_proto::limits!(pb::prefill_client::PrefillClient::new(
                guard.replica().channel.clone()
            ));
            let mut p_req = tonic::Request::new(pb::PrefillRequest {
                request_id: p.request_id.clone(),
                transfer_id,
                token_ids: p.tokens.clone(),
                cached_tokens: decode_cached,
                decode_addr: decode.replica().addr.clone(),
                sampling: Some(p.sampling.clone()),
            });
            p_req.set_timeout(remaining);
            async move { p_client.prefill(p_req).await }
        });
        let prefill_call = async move {
            match prefill_call {
                Some(call) => call
                    .await
                    .map(|r| Some(r.into_inner()))
                    .map_err(|s| Error::downstream("prefill", &s)),
                None => Ok(None),
            }
        };
        tokio::pin!(prefill_call);
        let mut prefilled: Option<Option<pb::PrefillResponse>> = None;
        let mut last_frame_at: Option<Instant> = None;
        let mut first_token_ms = 0.0;
        let mut local_prefill_ms = 0.0;
        loop {
            let msg = tokio::select! {
                r = &mut prefill_call, if prefilled.is_none() => {
                    prefilled = Some(r?);
                    continue;
                }
                m = frames.message() => m.map_err(|s| Error::downstream("decode", &s))?,
            };
            let Some(pb::DecodeResponse {
                event: Some(pb::decode_response::Event::Tokens(t)),
            }) = msg
            else {
                return Err(Error::Downstream {
                    hop: "decode",
                    code: tonic::Code::Unavailable,
                    message: "the decode stream ended without a final frame".into(),
                });
            };
            let last = t.finish_reason != pb::FinishReason::Unspecified as i32;
            match last_frame_at {
                None => {
                    first_token_ms = ms(accepted);
                    local_prefill_ms = t.local_prefill_ms;
                    self.metrics.ttft.observe(first_token_ms / 1e3);
                }
                Some(at) => self.metrics.inter_token.observe(at.elapsed().as_secs_f64()),
            }
            last_frame_at = Some(Instant::now());
            let mut frame = pb::GenerateResponse {
                index: t.index,
                token_ids: t.token_ids,
                text: t.text,
                finish_reason: t.finish_reason,
                ..Default::default()
            };
            if last {
                // The KV arrived, so the prefill has answered or is about to.
                if prefilled.is_none() {
                    prefilled = Some((&mut prefill_call).await?);
                }
                let pr = prefilled.flatten();
                let compute_ms = pr.as_ref().map_or(local_prefill_ms, |r| r.prefill_ms);
                if local || prefill_idle {
                    self.policy
                        .record_handoff(local, first_token_ms - queue_ms - compute_ms);
                }
                // Reuse beyond what decode held came from the prefill node's prefix cache.
                let prefill_cached = pr
                    .as_ref()
                    .map_or(0, |r| r.prefix_cached_tokens.saturating_sub(decode_cached));
                frame.prompt_token_ids = p.tokens.clone();
                frame.usage = Some(pb::Usage {
                    prompt_tokens: p.tokens.len() as u32,
                    completion_tokens: t.completion_tokens,
                    cached_tokens: decode_cached + prefill_cached,
                    prefill_cached_tokens: prefill_cached,
                    decode_cached_tokens: decode_cached,
                });
                frame.timings = Some(pb::Timings {
                    queue_ms,
                    prefill_ms: compute_ms,
                    transfer_ms: pr.as_ref().map_or(0.0, |r| r.transfer_ms),
                    first_token_ms,
                    total_ms: ms(accepted),
                });
                frame.route = Some(pb::Route {
                    prefill: prefill
                        .as_ref()
                        .map_or_else(String::new, |g| g.replica().addr.clone()),
                    decode: decode.replica().addr.clone(),
                    reason,
                    prefill_overlap_tokens: prefill_overlap as u32,
                    decode_overlap_tokens: decode_overlap as u32,
                    disaggregation: if local { "local" } else { "remote" }.into(),
                });
                log.push(Ok(frame));
                return Ok(());
            }
            log.push(Ok(frame));
        }
    }
}
