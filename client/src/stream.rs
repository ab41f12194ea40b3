//! One streamed generation, read frame by frame.

use anyhow::Context;
use tandem_proto::v1 as pb;

use crate::connect::Client;

/// What one streamed generation produced.
#[derive(Debug, Default)]
pub struct Streamed {
    pub prompt_token_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: String,
    pub timings: pb::Timings,
    pub logprobs: Vec<pb::TokenLogprobs>,
}

fn finish_name(code: i32) -> String {
    match pb::FinishReason::try_from(code) {
        Ok(pb::FinishReason::Stop) => "stop",
        Ok(pb::FinishReason::Length) => "length",
        Ok(pb::FinishReason::Cancelled) => "cancelled",
        _ => "unspecified",
    }
    .into()
}

/// Sends `request` and streams the reply, handing each text delta to `on_text`.
pub async fn stream(
    client: &mut Client,
    request: pb::GenerateRequest,
    on_text: &mut dyn FnMut(&str),
) -> anyhow::Result<Streamed> {
    let mut frames = client
        .generate(request)
        .await
        .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
        .into_inner();
    let mut out = Streamed::default();
    let mut expected = 0;
    loop {
        let frame = frames
            .message()
            .await
            .map_err(|s| anyhow::anyhow!("{:?}: {}", s.code(), s.message()))?
            .context("the stream ended without a final frame")?;
        anyhow::ensure!(
            frame.index == expected,
            "frame {} arrived where {expected} was due",
            frame.index
        );
        expected += 1;
        out.token_ids.extend(&frame.token_ids);
        out.text.push_str(&frame.text);
        out.logprobs.extend(frame.logprobs);
        on_text(&frame.text);
        if frame.finish_reason != pb::FinishReason::Unspecified as i32 {
            out.finish_reason = finish_name(frame.finish_reason);
            out.prompt_token_ids = frame.prompt_token_ids;
            out.timings = frame.timings.unwrap_or_default();
            return Ok(out);
        }
    }
}
