//! An attempt's remote prefill: the call on its prefill node (after a pipeline's earlier
//! stages), and which replicas a failure of the call, or of the decode stream while the call
//! pushes the KV, implicates.

use std::pin::Pin;
use std::time::Duration;

use tandem_proto::v1 as pb;
use tokio::time::Instant as TokioInstant;
use tonic::Status;
use tracing::Instrument;

use crate::cluster::replica::{InflightGuard, Replica};
use crate::dispatch::prepare::Prepared;
use crate::dispatch::progress::{Failure, Progress};
use crate::error::Error;

/// A remote prefill: the claim on its node, the claims on a pipeline's earlier stages (held
/// for the call), and its request.
pub(crate) struct RemotePrefill {
    guard: InflightGuard,
    _stages: Vec<(InflightGuard, usize)>,
    request: pb::PrefillRequest,
}

impl RemotePrefill {
    /// `request` on the node of `guard`, after the pipeline's earlier `stages`, if any.
    pub(crate) fn new(
        guard: InflightGuard,
        stages: Vec<(InflightGuard, usize)>,
        request: pb::PrefillRequest,
    ) -> Self {
        let request = pb::PrefillRequest {
            upstream: upstream_of(&stages),
            ..request
        };
        Self {
            guard,
            _stages: stages,
            request,
        }
    }
}

/// A pipeline's earlier stages as the wire names them: each one's address and the end of its
/// part.
pub(crate) fn upstream_of(stages: &[(InflightGuard, usize)]) -> Vec<pb::PipelineStage> {
    (stages.iter())
        .map(|(g, end)| pb::PipelineStage {
            addr: g.replica().addr.clone(),
            end: *end as u32,
        })
        .collect()
}

/// The prefill call of an attempt, where it has one (`None`: the decode node prefills
/// locally, and this answers `None` at once). The claim on the prefill node ends with the call:
/// what decodes afterwards is no longer in its queue.
///
/// A pipelined prefill's earlier stages are claimed for the call too; when one of them failed,
/// the node called names it (`tandem-failed-stage`), and that stage is the suspect.
pub(crate) async fn prefill_call(
    request_id: &str,
    prefill: Option<RemotePrefill>,
    deadline: TokioInstant,
) -> Result<Option<pb::PrefillResponse>, Failure> {
    let Some(RemotePrefill { guard, request, .. }) = prefill else {
        return Ok(None);
    };
    let addr = guard.replica().addr.as_str();
    let stages: Vec<&str> = (request.upstream.iter()).map(|s| s.addr.as_str()).collect();
    let stages = stages.join(",");
    prefill_on(guard.replica(), request, deadline)
        .instrument(tracing::info_span!("prefill", request_id = %request_id, replica = addr, upstream = stages))
        .await
        .map(Some)
        .map_err(|s| {
            let failed = (s.metadata().get(tandem_proto::FAILED_STAGE_METADATA))
                .and_then(|v| v.to_str().ok())
                .filter(|a| stages.split(',').any(|stage| stage == *a));
            Failure {
                error: Error::downstream("prefill", &s),
                suspects: vec![failed.unwrap_or(addr).to_string()],
                handoff: None,
            }
        })
}

/// How long an attempt whose decode stream ended before a pipeline's KV arrived waits for the
/// called prefill node to name the stage that failed.
const STAGE_WORD: Duration = Duration::from_secs(1);

/// The failure of an attempt whose decode stream at `decode` ended with `status`. Before the KV
/// arrived (`prefill`: the call, still pending) the sender at `sender` is as likely at fault.
/// In a pipeline (earlier `stages`), a stage that failed ends the push too, so the decode
/// stream can end before the called node names that stage: its word, if it comes within
/// [`STAGE_WORD`], decides, and neither the decode node nor the node called is suspected for
/// what a stage did.
pub(crate) async fn decode_failure<F>(
    status: &Status,
    decode: &str,
    sender: Option<&str>,
    stages: &[pb::PipelineStage],
    prefill: Option<Pin<&mut F>>,
) -> Failure
where
    F: Future<Output = Result<Option<pb::PrefillResponse>, Failure>>,
{
    let mut failure = Failure::on_decode(decode, status);
    let Some(prefill) = prefill else {
        return failure;
    };
    if !stages.is_empty()
        && let Ok(Err(named)) = tokio::time::timeout(STAGE_WORD, prefill).await
        && (named.suspects.iter()).any(|s| stages.iter().any(|stage| stage.addr == *s))
    {
        return named;
    }
    failure.suspects.extend(sender.map(str::to_string));
    failure
}

/// Asks `replica` to prefill `request` and push its KV, within `deadline`.
async fn prefill_on(
    replica: &Replica,
    request: pb::PrefillRequest,
    deadline: TokioInstant,
) -> Result<pb::PrefillResponse, Status> {
    let mut client = tandem_proto::limits!(pb::prefill_client::PrefillClient::new(
        replica.channel.clone()
    ));
    Ok(client
        .prefill(super::call(request, deadline))
        .await?
        .into_inner())
}

/// The prefill call of an attempt: the prompt `tokens` past what the decode node holds
/// (`decode_cached`), pushed to `decode_addr` under `transfer_id`.
pub(crate) fn prefill_request(
    p: &Prepared,
    progress: &Progress,
    tokens: &[u32],
    transfer_id: String,
    decode_cached: u32,
    decode_addr: &str,
) -> pb::PrefillRequest {
    pb::PrefillRequest {
        request_id: p.request_id.clone(),
        transfer_id,
        token_ids: tokens.to_vec(),
        cached_tokens: decode_cached,
        decode_addr: decode_addr.to_string(),
        sampling: Some(p.sampling_of(progress.choice, progress.max_tokens)),
        resumed_tokens: progress.generated.len() as u32,
        cache_salt: p.cache_salt.clone(),
        priority: p.class.to_pb() as i32,
        tenant: p.tenant.to_string(),
        weight: p.weight,
        upstream: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Call = Result<Option<pb::PrefillResponse>, Failure>;

    /// The prefill call's failure, naming `suspect`.
    fn failed(suspect: &str) -> Call {
        Err(Failure {
            error: Error::downstream("prefill", &Status::unavailable("pipeline stage failed")),
            suspects: vec![suspect.into()],
            handoff: None,
        })
    }

    /// The earlier stages: `p1:1` when `pipelined`, else none.
    fn stages(pipelined: bool) -> Vec<pb::PipelineStage> {
        let stage = pb::PipelineStage {
            addr: "p1:1".into(),
            end: 100,
        };
        if pipelined { vec![stage] } else { Vec::new() }
    }

    /// Whom a decode stream's end implicates while the call to `p2:1` is pending, after the
    /// stage `p1:1` when `pipelined`: the call then answers `call`, or never (`None`).
    async fn suspects(pipelined: bool, call: Option<Call>) -> Vec<String> {
        let status = Status::unavailable("the KV push ended");
        let stages = stages(pipelined);
        let call = async move {
            match call {
                Some(answer) => answer,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(call);
        let pending = Some(call.as_mut());
        (decode_failure(&status, "d:1", Some("p2:1"), &stages, pending).await).suspects
    }

    #[tokio::test]
    async fn a_stage_the_node_called_names_is_the_only_suspect() {
        assert_eq!(suspects(true, Some(failed("p1:1"))).await, ["p1:1"]);
    }

    #[tokio::test(start_paused = true)]
    async fn otherwise_the_decode_node_and_the_sender_are() {
        let both = ["d:1", "p2:1"];
        // Outside a pipeline no stage can be named, and the call is not waited for.
        assert_eq!(suspects(false, Some(failed("p1:1"))).await, both);
        // The node called failed itself, or its push ended well.
        assert_eq!(suspects(true, Some(failed("p2:1"))).await, both);
        assert_eq!(suspects(true, Some(Ok(None))).await, both);
        // It names nothing within STAGE_WORD.
        let started = tokio::time::Instant::now();
        assert_eq!(suspects(true, None).await, both);
        assert_eq!(started.elapsed(), STAGE_WORD);
    }

    #[tokio::test]
    async fn after_the_kv_arrived_only_the_decode_node_is() {
        let status = Status::unavailable("decode node gone");
        let none: Option<Pin<&mut std::future::Pending<Call>>> = None;
        let failure = decode_failure(&status, "d:1", Some("p2:1"), &stages(true), none).await;
        assert_eq!(failure.suspects, ["d:1"]);
    }
}
