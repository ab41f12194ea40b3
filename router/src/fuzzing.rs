//! Entry points for the cargo-fuzz targets in `fuzz/` and for `tandem-bench router`: the
//! router's checks of client input (a gRPC `GenerateRequest`, an HTTP API's JSON body), run on
//! arbitrary input exactly as a request would be, through to its prompt's tokens and block
//! hashes. Not part of the router's API.

use axum::http::HeaderMap;
use tandem_proto::v1 as pb;

use crate::api::http::DEFAULT_MAX_TOKENS;
use crate::api::openai::Kind;
use crate::api::{anthropic, openai, responses};
use crate::cluster::frontend::Frontend;
use crate::config::Limits;
use crate::dispatch::prepare::{check_ids, prepare};

/// The router's request checks for one model.
#[derive(Debug)]
pub struct RequestChecks {
    front: Frontend,
    limits: Limits,
}

impl RequestChecks {
    /// Checks as a router serving the worker that answered `info` would, with default limits.
    pub fn new(info: &pb::InfoResponse) -> Option<Self> {
        Some(Self {
            front: Frontend::from_info(info)?,
            limits: Limits::default(),
        })
    }

    /// [`RequestChecks::new`], with a cache of token ids that holds nothing: every prompt is
    /// tokenized whole.
    pub fn uncached(info: &pb::InfoResponse) -> Option<Self> {
        let mut checks = Self::new(info)?;
        checks.front.encodes = tandem_tokenizer::EncodeCache::new(0);
        Some(checks)
    }

    /// Validates and tokenizes a gRPC request; its prompt's tokens, if it was accepted.
    pub fn grpc(&self, r: pb::GenerateRequest) -> Option<usize> {
        self.check(r, None)
    }

    /// Parses an HTTP body for `endpoint` (0: `/v1/completions`, 1: `/v1/chat/completions`,
    /// 2: `/v1/messages`, 3: `/v1/responses`; the rest wrap around), then validates and
    /// tokenizes it; its prompt's tokens, if it was accepted.
    pub fn http(&self, endpoint: u8, body: &[u8]) -> Option<usize> {
        // The model a body names is read before it is parsed, whatever the body is.
        let _ = crate::api::http::asked_model(body);
        let (model, headers) = (self.front.model_name.as_str(), HeaderMap::new());
        let defaults = crate::SamplingDefaults::default();
        let parsed = match endpoint % 4 {
            0 | 1 => {
                let kind = if endpoint % 4 == 1 {
                    Kind::Chat
                } else {
                    Kind::Completion
                };
                openai::parse(kind, model, &headers, body, &defaults)
                    .map(|p| (p.call.request, DEFAULT_MAX_TOKENS))
            }
            2 => anthropic::parse(
                anthropic::Endpoint::Messages,
                model,
                &headers,
                body,
                &defaults,
            )
            .map(|p| (p.call.request, p.max_tokens)),
            _ => responses::parse(model, &headers, body, &defaults)
                .map(|p| (p.call.request, DEFAULT_MAX_TOKENS)),
        };
        let (request, max_tokens) = parsed.ok()?;
        self.check(request, Some(max_tokens))
    }

    fn check(&self, r: pb::GenerateRequest, default_max_tokens: Option<u32>) -> Option<usize> {
        check_ids(&r)
            .and_then(|()| {
                prepare(
                    &self.front,
                    r,
                    &self.limits,
                    default_max_tokens,
                    &crate::auth::Principal::anonymous(),
                )
            })
            .ok()
            .map(|p| p.tokens.len())
    }
}
