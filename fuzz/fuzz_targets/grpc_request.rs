//! The router's request checks on arbitrary protobuf: decode a `GenerateRequest`, then check
//! its ids, input and sampling and tokenize it (prompt or chat template) as `Generate` does.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use prost::Message;
use tandem_proto::v1 as pb;
use tandem_router::fuzzing::RequestChecks;

fn checks() -> &'static RequestChecks {
    static CHECKS: OnceLock<RequestChecks> = OnceLock::new();
    CHECKS.get_or_init(|| RequestChecks::new(&tandem_fuzz::worker_info()).expect("frontend"))
}

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = pb::GenerateRequest::decode(data) {
        checks().grpc(r);
    }
});
