//! The gRPC front: `tandem.v1.Generation`, whose calls are authenticated by [`interceptor`]
//! before their message is decoded and then started through [`GenerationService::start`].

use futures::StreamExt;
use tandem_proto::v1 as pb;
use tonic::{Request, Response, Status};

use crate::api::http::reply::{Part, Reply};
use crate::auth::Principal;
use crate::dispatch::{GenerateStream, GenerationService};
use crate::error::Error;

/// The gRPC side of [`GenerationService::authenticate`]: an interceptor, which runs before the
/// message is decoded, handing the [`Principal`] to the handler in the extensions.
pub(crate) fn interceptor(
    svc: &GenerationService,
) -> impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone + use<> {
    let svc = svc.clone();
    move |mut request: Request<()>| {
        let header = request
            .metadata()
            .get("authorization")
            .map(|v| v.as_bytes());
        let principal = svc.authenticate(header)?;
        request.extensions_mut().insert(principal);
        Ok(request)
    }
}

#[tonic::async_trait]
impl pb::generation_server::Generation for GenerationService {
    type GenerateStream = GenerateStream;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let id = tandem_proto::loggable_id(&request.get_ref().request_id);
        let span = tracing::info_span!("generate", request_id = %id);
        // A client's `traceparent` is the span's parent, set before the span is entered.
        tandem_net::otel::follow(&span, request.metadata());
        tracing::Instrument::instrument(self.generate_traced(request), span).await
    }
}

impl GenerationService {
    async fn generate_traced(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<GenerateStream>, Status> {
        let deadline = tandem_net::deadline(request.metadata());
        let asked = (request.metadata().get("x-priority"))
            .map(|v| v.to_str().unwrap_or("unreadable").to_string());
        // The [`interceptor`] put it there before the body was
        // read.
        let principal = request
            .extensions()
            .get::<Principal>()
            .cloned()
            .ok_or(Error::Unauthenticated)?;
        let target = (request.metadata().get("x-slo-ttft-ms"))
            .map(|v| crate::dispatch::prepare::ttft_target_ms(v.to_str().unwrap_or("unreadable")))
            .transpose()?;
        let mut r = request.into_inner();
        if let Some(asked) = asked.filter(|_| r.priority.is_empty()) {
            r.priority = asked;
        }
        if let Some(ms) = target.filter(|_| r.ttft_target_ms == 0) {
            r.ttft_target_ms = ms;
        }
        let replies = self.tool_replies(&r)?;
        let stream = self.start(r, &principal, deadline, None).await?.frames;
        Ok(Response::new(match replies {
            Some(replies) => with_tool_calls(stream, replies),
            None => stream,
        }))
    }

    /// For a chat that offers tools, a parser of each choice's reply into its calls.
    fn tool_replies(&self, r: &pb::GenerateRequest) -> Result<Option<Vec<Reply>>, Error> {
        if r.tools.is_empty() {
            return Ok(None);
        }
        let front = self.frontend(&r.model)?;
        // Call ids need a request id; a request without one is named only when it starts (only
        // a client's own id attaches retries), so the calls take one of their own.
        let named = pb::GenerateRequest {
            request_id: match r.request_id.as_str() {
                "" => crate::ids::fresh_id(),
                id => id.to_string(),
            },
            tools: r.tools.clone(),
            tool_choice: r.tool_choice,
            tool_choice_function: r.tool_choice_function.clone(),
            ..Default::default()
        };
        let replies = (0..r.n.max(1))
            .map(|choice| Reply::new(&front.tokenizer, &named, true, choice))
            .collect();
        Ok(Some(replies))
    }
}

/// `frames` with each frame's [`pb::GenerateResponse::tool_calls`]: the calls its choice's reply
/// completes there.
fn with_tool_calls(frames: GenerateStream, mut replies: Vec<Reply>) -> GenerateStream {
    Box::pin(frames.map(move |item| {
        item.map(|mut f| {
            if let Some(reply) = replies.get_mut(f.choice as usize) {
                for part in reply.frame(&f) {
                    if let Part::Call {
                        id,
                        name,
                        arguments,
                        ..
                    } = part
                    {
                        f.tool_calls.push(pb::ToolCall {
                            id,
                            name,
                            arguments,
                        });
                    }
                }
            }
            f
        })
    }))
}
