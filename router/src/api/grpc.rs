//! The gRPC front: `tandem.v1.Generation`, whose calls are authenticated by [`interceptor`]
//! before their message is decoded and then started through [`GenerationService::start`].

use tandem_proto::v1 as pb;
use tonic::{Request, Response, Status};

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
        let stream = self.start(r, &principal, deadline, None).await?.frames;
        Ok(Response::new(stream))
    }
}
