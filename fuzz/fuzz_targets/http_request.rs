//! The HTTP APIs' body parsers and the router's checks behind them, on arbitrary bytes: the
//! first byte picks the endpoint (modulo 4: completions, chat completions, Anthropic's
//! messages, responses), the rest is the body.
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
    checks().http(first, body);
});
