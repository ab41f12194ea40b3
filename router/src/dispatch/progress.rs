//! A choice's stream across its attempts: what has been delivered ([`Progress`]), how each
//! decode frame joins the stream ([`Progress::relay`]), the last frame's usage, timings and
//! route ([`Progress::finish`]), and whether a failed attempt is tried again
//! ([`Progress::retry`], [`Failure`]).

use std::time::{Duration, Instant};

use tandem_proto::v1 as pb;
use tonic::Status;

use crate::dispatch::retry::RetryBudget;
use crate::error::Error;

/// Most dispatch attempts per request that end in a fault: the first and two failovers.
pub const MAX_ATTEMPTS: u32 = 3;
/// Most hand-offs one choice follows (moves off draining decode nodes, which a rolling
/// restart makes one after another); they are counted apart from [`MAX_ATTEMPTS`].
pub const MAX_HANDOFFS: u32 = 4;

/// Milliseconds since `since`.
pub(crate) fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// What a choice's attempts have delivered so far: a later attempt resumes from here.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    /// Which of the request's choices this is.
    pub(crate) choice: u32,
    /// Tokens delivered to the client so far.
    pub(crate) generated: Vec<u32>,
    /// Frames delivered to the client so far (a frame may carry several tokens).
    pub(crate) frames: u32,
    pub(crate) attempts: u32,
    /// Of the attempts, those that a draining decode node handed off.
    pub(crate) handoffs: u32,
    /// Replicas that failed this request, which its later attempts avoid.
    pub(crate) exclude: Vec<String>,
    /// What failed, in order, for the route.
    pub(crate) failovers: Vec<String>,
    /// A decode node that handed the stream off (the last attempt's, or an earlier one's when
    /// the last kept nothing), with the KV it kept there.
    pub(crate) holder: Option<(String, usize)>,
    pub(crate) first_token_ms: Option<f64>,
    pub(crate) last_frame_at: Option<Instant>,
    /// The max_tokens a decode node admitted the choice with, where its KV pool held less
    /// than the request asked: later attempts ask for no more, so a failover ends where the
    /// first attempt would have.
    pub(crate) max_tokens: Option<u32>,
    /// From the choice's first wait in the router's queue to an attempt's admission (a failover
    /// of a request not yet admitted, e.g. after a decode call cut short by the deadline, still
    /// waits): since when it waits, and for what.
    pub(crate) queued: Option<(tokio::time::Instant, &'static str)>,
}

/// How a relayed frame arrived in its choice's stream, for the latency metrics.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Arrival {
    /// The choice's first frame, this long (ms) after the request was accepted.
    First(f64),
    /// A later frame, this long after the one before.
    After(Duration),
}

/// What an attempt learned beside its frames, for its last frame's usage, timings and route.
#[derive(Debug, Default)]
pub(crate) struct Ending {
    /// Prompt tokens the decode node held when it admitted the attempt.
    pub(crate) decode_cached: u32,
    /// The prefill node's answer; `None` when the decode node prefilled locally.
    pub(crate) prefill: Option<pb::PrefillResponse>,
    /// The local prefill's compute (ms), from the attempt's first frame.
    pub(crate) local_prefill_ms: f64,
    pub(crate) queue_ms: f64,
    pub(crate) total_ms: f64,
    /// The attempt's replicas and why; [`Progress::finish`] adds the attempts and failovers.
    pub(crate) route: pb::Route,
    /// The decode node's peer fetch, when it made one.
    pub(crate) fetch_ms: f64,
}

impl Progress {
    /// Takes an attempt's next decode frame into the choice's stream, as the stream's next
    /// frame. The frame must start where the stream stands: a resumed attempt's decode node
    /// counts the tokens delivered before as generated, so its first frame's `index` is their
    /// number. A frame out of place fails the attempt, since relaying it would repeat or skip
    /// tokens. The last frame carries the node's own counts (completion and draft tokens) for
    /// [`Progress::finish`] to complete.
    pub(crate) fn relay(
        &mut self,
        t: pb::DecodeTokens,
        prompt_tokens: usize,
        accepted: Instant,
    ) -> Result<(pb::GenerateResponse, Arrival), Status> {
        if t.index as usize != self.generated.len() {
            return Err(Status::unavailable(format!(
                "frame {} where {} was due",
                t.index,
                self.generated.len()
            )));
        }
        let now = Instant::now();
        let arrival = match self.last_frame_at.replace(now) {
            None => {
                let ttft_ms = ms(accepted);
                self.first_token_ms = Some(ttft_ms);
                Arrival::First(ttft_ms)
            }
            Some(at) => Arrival::After(now - at),
        };
        let last = t.finish_reason != pb::FinishReason::Unspecified as i32;
        self.generated.extend(&t.token_ids);
        let frame = pb::GenerateResponse {
            index: self.frames,
            choice: self.choice,
            prompt_tokens: if self.frames == 0 {
                prompt_tokens as u32
            } else {
                0
            },
            token_ids: t.token_ids,
            text: t.text,
            finish_reason: t.finish_reason,
            logprobs: t.logprobs,
            usage: last.then_some(pb::Usage {
                completion_tokens: t.completion_tokens,
                ..Default::default()
            }),
            timings: last.then_some(pb::Timings {
                draft_tokens: t.draft_tokens,
                accepted_draft_tokens: t.accepted_draft_tokens,
                ..Default::default()
            }),
            ..Default::default()
        };
        self.frames += 1;
        Ok((frame, arrival))
    }

    /// Completes the choice's last frame, relayed by [`Progress::relay`], with the request's
    /// prompt, the attempt's `ending` and the choice's attempts and failovers. Its cached
    /// prompt tokens are the decode node's, then the prefill node's prefix cache beyond them.
    pub(crate) fn finish(
        &mut self,
        frame: &mut pb::GenerateResponse,
        prompt: &[u32],
        ending: Ending,
    ) {
        let Ending {
            decode_cached,
            prefill,
            local_prefill_ms,
            queue_ms,
            total_ms,
            route,
            fetch_ms,
        } = ending;
        let prefill_cached = prefill
            .as_ref()
            .map_or(0, |r| r.prefix_cached_tokens.saturating_sub(decode_cached));
        let cached = (decode_cached + prefill_cached).min(prompt.len() as u32);
        frame.prompt_token_ids = prompt.to_vec();
        let usage = frame.usage.get_or_insert_default();
        usage.prompt_tokens = prompt.len() as u32;
        usage.cached_tokens = cached;
        usage.prefill_cached_tokens = prefill_cached;
        usage.decode_cached_tokens = decode_cached;
        let timings = frame.timings.get_or_insert_default();
        timings.queue_ms = queue_ms;
        timings.prefill_ms = prefill.as_ref().map_or(local_prefill_ms, |r| r.prefill_ms);
        timings.transfer_ms = prefill.as_ref().map_or(0.0, |r| r.transfer_ms);
        timings.prefill_wait_ms = prefill.as_ref().map_or(0.0, |r| r.waited_ms);
        timings.first_token_ms = self.first_token_ms.unwrap_or_default();
        timings.total_ms = total_ms;
        timings.fetch_ms = fetch_ms;
        frame.route = Some(pb::Route {
            attempts: self.attempts,
            failovers: std::mem::take(&mut self.failovers),
            ..route
        });
    }

    /// Takes a failed attempt and says whether the choice tries again. It does when another
    /// replica might succeed ([`retryable`]) and the failure names replicas to avoid, within
    /// [`MAX_ATTEMPTS`] and the retry `budget`; those replicas are then avoided from here on and
    /// the failure is noted for the route. A draining node's hand-off spends neither budget
    /// nor attempts (its own bound is [`MAX_HANDOFFS`]): the budget bounds what faults add to
    /// the replicas left, and a hand-off is a planned move (the next attempt fetches the KV kept
    /// for it, or starts what had not started). A hand-off that kept nothing leaves an earlier
    /// holder named: its KV is still a prefix of what the stream resumes from.
    pub(crate) fn retry(&mut self, failure: &Failure, budget: &RetryBudget) -> bool {
        let handoff = failure.handoff.is_some();
        let retry = retryable(&failure.error)
            && !failure.suspects.is_empty()
            && if handoff {
                self.handoffs < MAX_HANDOFFS
            } else {
                self.attempts - self.handoffs < MAX_ATTEMPTS && budget.try_spend()
            };
        if retry {
            self.failovers.push(format!(
                "{} ({})",
                failure.error,
                failure.suspects.join(", ")
            ));
            self.exclude.extend(failure.suspects.iter().cloned());
            let kept = failure.handoff.as_ref().is_some_and(|(_, t)| *t > 0);
            if !handoff || kept || self.holder.is_none() {
                self.holder.clone_from(&failure.handoff);
            }
            self.handoffs += u32::from(handoff);
        }
        retry
    }
}

/// An attempt's failure, and the replicas it implicates.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) error: Error,
    /// The replicas to avoid on the next attempt; empty when retrying cannot help.
    pub(crate) suspects: Vec<String>,
    /// A draining decode node handed the stream off: its address, and the tokens of KV it kept
    /// for the next attempt to fetch.
    pub(crate) handoff: Option<(String, usize)>,
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        Self {
            error,
            suspects: Vec::new(),
            handoff: None,
        }
    }
}

/// What a request whose deadline passed ends with: [`Error::QueueTimeout`] where one of its
/// choices was waiting in the router's queue then (`progress`), else [`Error::Deadline`].
pub(crate) fn deadline_error(progress: &[Progress]) -> Error {
    match progress.iter().find_map(|p| p.queued) {
        Some((since, waiting_for)) => Error::QueueTimeout {
            waited: since.elapsed(),
            waiting_for,
        },
        None => Error::Deadline,
    }
}

impl Failure {
    /// The decode node at `addr` ended the attempt with `status`; a hand-off says what it kept.
    pub(crate) fn on_decode(addr: &str, status: &Status) -> Self {
        let handoff = status
            .metadata()
            .get(tandem_proto::HANDOFF_METADATA)
            .and_then(|v| v.to_str().ok()?.parse().ok())
            .map(|tokens| (addr.to_string(), tokens));
        Self {
            error: Error::downstream("decode", status),
            suspects: vec![addr.to_string()],
            handoff,
        }
    }
}

/// Whether another replica might succeed where this error happened: the replica or the path
/// to it failed (UNAVAILABLE), or the KV it was sent was damaged (DATA_LOSS). Invalid input,
/// capacity and the client's own deadline or cancel are answered as they are.
pub(crate) fn retryable(e: &Error) -> bool {
    matches!(
        e,
        Error::Downstream {
            code: tonic::Code::Unavailable | tonic::Code::DataLoss,
            ..
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::prepare::Prepared;

    fn tokens(index: u32, token_ids: &[u32], finish: pb::FinishReason) -> pb::DecodeTokens {
        pb::DecodeTokens {
            index,
            token_ids: token_ids.to_vec(),
            text: format!("{token_ids:?}"),
            finish_reason: finish as i32,
            completion_tokens: if finish == pb::FinishReason::Unspecified {
                0
            } else {
                index + token_ids.len() as u32
            },
            ..Default::default()
        }
    }

    fn cut(decode: &str) -> Failure {
        Failure::on_decode(decode, &Status::unavailable("connection reset"))
    }

    /// A draining node's hand-off is a failover whose next attempt knows where the KV is, and
    /// it spends no failover budget: with the budget spent, a hand-off still moves and a
    /// failure does not.
    #[test]
    fn a_handed_off_stream_resumes_with_its_holder_named() {
        let budget = RetryBudget::default();
        while budget.try_spend() {}
        let mut progress = Progress {
            attempts: 1,
            ..Progress::default()
        };
        let mut status = Status::unavailable("draining");
        status
            .metadata_mut()
            .insert(tandem_proto::HANDOFF_METADATA, 48u64.into());
        assert!(progress.retry(&Failure::on_decode("d1:1", &status), &budget));
        assert_eq!(progress.holder, Some(("d1:1".to_string(), 48)));
        assert_eq!(progress.exclude, ["d1:1"]);
        progress.attempts = 2;
        assert!(
            !progress.retry(&cut("d2:1"), &budget),
            "the budget is spent"
        );
        // A plain failure names no holder, and forgets the last one.
        for _ in 0..6 {
            budget.deposit(0);
        }
        assert!(progress.retry(&cut("d2:1"), &budget));
        assert_eq!(progress.holder, None);
    }

    /// When both decode nodes drain, the second refuses the stream the first handed off (it
    /// kept nothing for it): the first stays the holder, whose KV the stream goes back to.
    /// Hand-offs spend no attempts; their own bound ends a stream moved about forever.
    #[test]
    fn a_refusal_by_a_draining_node_keeps_the_holder_and_spends_no_attempts() {
        let budget = RetryBudget::default();
        let handoff = |addr: &str, tokens: u64| {
            let mut status = Status::unavailable("draining");
            status
                .metadata_mut()
                .insert(tandem_proto::HANDOFF_METADATA, tokens.into());
            Failure::on_decode(addr, &status)
        };
        let mut progress = Progress {
            attempts: 1,
            ..Progress::default()
        };
        assert!(progress.retry(&handoff("d1:1", 64), &budget));
        progress.attempts += 1;
        assert!(progress.retry(&handoff("d2:1", 0), &budget));
        assert_eq!(progress.holder, Some(("d1:1".to_string(), 64)));
        assert_eq!(progress.exclude, ["d1:1", "d2:1"]);
        // Two failovers still fit after the two moves.
        progress.attempts += 1;
        assert!(progress.retry(&cut("d3:1"), &budget));
        progress.attempts += 1;
        assert!(progress.retry(&cut("d4:1"), &budget));
        progress.attempts += 1;
        assert!(!progress.retry(&cut("d5:1"), &budget), "out of attempts");
        while progress.handoffs < MAX_HANDOFFS {
            assert!(progress.retry(&handoff("d1:1", 16), &budget));
        }
        assert!(
            !progress.retry(&handoff("d1:1", 16), &budget),
            "out of moves"
        );
    }

    /// A choice's stream through a decode node cut after three frames: the second attempt
    /// avoids that node, sends the prompt with the delivered tokens, and its frames continue
    /// the stream with no gap or repeat, as one attempt's would.
    #[test]
    fn a_failover_resumes_the_stream_where_it_stood() {
        use pb::FinishReason::{Length, Unspecified};
        let p = Prepared::example();
        let budget = RetryBudget::default();
        let accepted = Instant::now();
        let mut progress = Progress {
            choice: 1,
            attempts: 1,
            ..Progress::default()
        };
        let mut stream = Vec::new();
        for t in [
            tokens(0, &[10], Unspecified),
            tokens(1, &[11, 12], Unspecified),
            tokens(3, &[13], Unspecified),
        ] {
            let (frame, arrival) = progress
                .relay(t, p.tokens.len(), accepted)
                .expect("in place");
            assert_eq!(
                matches!(arrival, Arrival::First(_)),
                stream.is_empty(),
                "only the first frame is the first token"
            );
            stream.push(frame);
        }
        assert!(progress.retry(&cut("d1:1"), &budget));
        assert_eq!(progress.exclude, ["d1:1"]);
        progress.attempts += 1;

        let (prompt, _) = p.prompt_after(&progress.generated);
        assert_eq!(prompt[p.tokens.len()..], [10, 11, 12, 13]);
        // A node that starts over, or skips a token, fails the attempt rather than the stream.
        for wrong in [0, 3, 5] {
            let err = progress
                .relay(tokens(wrong, &[99], Unspecified), 40, accepted)
                .expect_err("out of place");
            assert_eq!(err.code(), tonic::Code::Unavailable);
        }
        for t in [tokens(4, &[14], Unspecified), tokens(5, &[15, 16], Length)] {
            let (frame, arrival) = progress
                .relay(t, p.tokens.len(), accepted)
                .expect("in place");
            assert!(matches!(arrival, Arrival::After(_)));
            stream.push(frame);
        }
        let mut last = stream.pop().expect("frames");
        progress.finish(
            &mut last,
            &p.tokens,
            Ending {
                decode_cached: 32,
                route: pb::Route {
                    decode: "d2:1".into(),
                    ..Default::default()
                },
                ..Default::default()
            },
        );
        stream.push(last);

        let indices: Vec<u32> = stream.iter().map(|f| f.index).collect();
        assert_eq!(indices, [0, 1, 2, 3, 4]);
        let delivered: Vec<u32> = stream.iter().flat_map(|f| f.token_ids.clone()).collect();
        assert_eq!(delivered, (10..17).collect::<Vec<_>>());
        assert!(stream.iter().all(|f| f.choice == 1));
        assert_eq!(stream[0].prompt_tokens, 40);
        assert!(stream[1..].iter().all(|f| f.prompt_tokens == 0));
        assert!(
            stream[..4]
                .iter()
                .all(|f| !crate::dispatch::log::is_last(f))
        );

        let last = &stream[4];
        let usage = last.usage.as_ref().expect("usage");
        assert_eq!((usage.prompt_tokens, usage.completion_tokens), (40, 7));
        assert_eq!(usage.cached_tokens, 32);
        assert_eq!(last.prompt_token_ids, p.tokens);
        let route = last.route.as_ref().expect("route");
        assert_eq!((route.decode.as_str(), route.attempts), ("d2:1", 2));
        assert_eq!(route.failovers.len(), 1);
        assert!(route.failovers[0].contains("d1:1"), "{:?}", route.failovers);
    }

    #[test]
    fn only_a_replica_failure_within_the_attempts_and_budget_is_retried() {
        let budget = RetryBudget::default();
        let mut progress = Progress {
            attempts: 1,
            ..Progress::default()
        };
        let invalid = Failure::from(Error::InvalidArgument {
            field: "prompt",
            reason: "bad".into(),
        });
        assert!(!progress.retry(&invalid, &budget), "bad input fails again");
        let unsuspected = Failure {
            suspects: Vec::new(),
            ..cut("d1:1")
        };
        assert!(
            !progress.retry(&unsuspected, &budget),
            "no replica to avoid"
        );
        progress.attempts = MAX_ATTEMPTS;
        assert!(!progress.retry(&cut("d1:1"), &budget), "out of attempts");
        assert!(progress.exclude.is_empty() && progress.failovers.is_empty());

        progress.attempts = 1;
        let mut retried = 0;
        while progress.retry(&cut("d1:1"), &budget) {
            retried += 1;
        }
        assert_eq!(
            retried as f64,
            RetryBudget::RESERVE,
            "the budget bounds failovers"
        );
        assert_eq!(progress.failovers.len(), retried);
    }
}
