//! `tandem generate --server`: the same flags and JSON as the in-process command, through a
//! running cluster's router.

use std::io::Write;

use tandem_client::{ApiKey, client, explain, stream};
use tandem_proto::v1 as pb;

use super::{GenerateArgs, parse_messages};

/// `tandem generate --server ADDR ...`.
pub(crate) fn generate(args: &GenerateArgs, server: &str) -> anyhow::Result<()> {
    let mut request = pb::GenerateRequest {
        sampling: Some(tandem_worker::params_to_pb(&args.params(None)?)),
        ..Default::default()
    };
    match (&args.prompt, &args.messages) {
        (Some(p), _) => request.prompt = Some(p.clone()),
        (None, Some(m)) => {
            request.messages = parse_messages(m)?
                .into_iter()
                .map(|m| pb::ChatMessage {
                    role: m.role,
                    content: m.content,
                    ..Default::default()
                })
                .collect();
        }
        (None, None) => anyhow::bail!("give --prompt or --messages"),
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let out = rt.block_on(async {
        let mut client = client(server, &ApiKey::new(args.api_key.as_deref())?, &args.tls)?;
        let mut stdout = std::io::stdout().lock();
        let out = stream(&mut client, request, &mut |text| {
            if !args.json {
                let _ = stdout.write_all(text.as_bytes());
                let _ = stdout.flush();
            }
        })
        .await;
        match out {
            Err(e) => Err(explain(server, &args.tls, e).await),
            ok => ok,
        }
    })?;
    if args.json {
        let finish_reason = match out.finish_reason.as_str() {
            "stop" => tandem_engine::FinishReason::Stop,
            "length" => tandem_engine::FinishReason::Length,
            other => anyhow::bail!("the server ended the generation with {other:?}"),
        };
        let t = &out.timings;
        let json = tandem_engine::GenerateOutput {
            prompt_token_ids: out.prompt_token_ids,
            token_ids: out.token_ids,
            text: out.text,
            finish_reason,
            prefill_ms: t.prefill_ms,
            decode_ms: (t.total_ms - t.first_token_ms).max(0.0),
            draft_tokens: t.draft_tokens.into(),
            accepted_draft_tokens: t.accepted_draft_tokens.into(),
            logprobs: out
                .logprobs
                .iter()
                .map(tandem_worker::logprobs_from_pb)
                .collect(),
        };
        println!("{}", serde_json::to_string(&json)?);
    } else {
        println!();
    }
    Ok(())
}
