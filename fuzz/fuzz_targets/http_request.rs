//! The OpenAI HTTP API's body parser and the router's checks behind it, on arbitrary bytes:
//! the first byte picks the endpoint (odd: chat completions), the rest is the body.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use tandem_router::fuzzing::RequestChecks;

fn checks() -> &'static RequestChecks {
    static CHECKS: OnceLock<RequestChecks> = OnceLock::new();
    CHECKS.get_or_init(|| RequestChecks::new(&tandem_fuzz::worker_info()).expect("frontend"))
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, body)) = data.split_first() else {
        return;
    };
    checks().http(first % 2 == 1, body);
});
