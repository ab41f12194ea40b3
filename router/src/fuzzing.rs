//! Entry points for the cargo-fuzz targets in `fuzz/`: the router's checks of client input (a
//! gRPC `GenerateRequest`, an OpenAI JSON body), run on arbitrary input exactly as a request
//! would be. Not part of the router's API.

use axum::http::HeaderMap;
use tandem_proto::v1 as pb;

use crate::api::http::DEFAULT_MAX_TOKENS;
use crate::api::openai::{Kind, parse};
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

    /// Validates and tokenizes a gRPC request; whether it was accepted.
    pub fn grpc(&self, r: pb::GenerateRequest) -> bool {
        self.check(r, None)
    }

    /// Parses an HTTP body for `/v1/chat/completions` (`chat`) or `/v1/completions`, then
    /// validates and tokenizes it; whether it was accepted.
    pub fn http(&self, chat: bool, body: &[u8]) -> bool {
        let kind = if chat { Kind::Chat } else { Kind::Completion };
        match parse(
            kind,
            &self.front.model_name,
            &HeaderMap::new(),
            body,
            &crate::SamplingDefaults::default(),
        ) {
            Ok(parsed) => self.check(parsed.call.request, Some(DEFAULT_MAX_TOKENS)),
            Err(_) => false,
        }
    }

    fn check(&self, r: pb::GenerateRequest, default_max_tokens: Option<u32>) -> bool {
        check_ids(&r)
            .and_then(|()| prepare(&self.front, r, &self.limits, default_max_tokens, "fuzz"))
            .is_ok()
    }
}
