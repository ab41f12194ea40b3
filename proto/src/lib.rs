//! The contracts shared by every Tandem process: the `tandem.v1` protobuf messages and services
//! (client API, worker services, KV wire format v1), generated at build time from
//! `tandem/v1/*.proto`.
//!
//! Only generated code, constants, the block-hash spec ([`block_hash`]) and the request policy
//! every process applies alike ([`policy`]: priority classes, the fair queue, sampling bounds)
//! live here: the transport and TLS every process shares are `tandem-net`'s, and conversions to
//! domain types belong to the crate that owns each domain type.

pub mod block_hash;
pub mod policy;

pub mod v1 {
    #![allow(missing_debug_implementations, clippy::all)]
    tonic::include_proto!("tandem.v1");
}

/// The encoded file descriptor set of every `tandem.v1` file, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("tandem_descriptor");

/// The largest gRPC message any Tandem process sends or accepts. Both ends set it explicitly;
/// KV chunks stay far below it (see `tandem-transfer`).
pub const MAX_MESSAGE_BYTES: usize = 16 << 20;

/// Applies Tandem's message limits to a generated client or server.
#[macro_export]
macro_rules! limits {
    ($svc:expr) => {
        $svc.max_decoding_message_size($crate::MAX_MESSAGE_BYTES)
            .max_encoding_message_size($crate::MAX_MESSAGE_BYTES)
    };
}

/// Longest request, session, transfer id or cache salt, in bytes. Ids go into log lines, error
/// messages and downstream calls, so every service bounds them before anything else reads them.
pub const MAX_ID_BYTES: usize = 256;

/// Most alternatives a request may ask log-probabilities of (`SamplingParams.logprobs`;
/// OpenAI's bound on `top_logprobs`).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// The trailer metadata key with which a draining decode node ends a stream it hands off: the
/// tokens of KV it keeps for the peer that continues the stream to fetch (`Decode.Generate`).
pub const HANDOFF_METADATA: &str = "tandem-kv-handoff";

/// Trailer metadata of a pipelined prefill's failure (UNAVAILABLE): the address of the stage
/// whose KV could not be had, which the router counts as the one that failed, not the stage it
/// called.
pub const FAILED_STAGE_METADATA: &str = "tandem-failed-stage";

/// The most stages one pipelined prefill may have.
pub const MAX_PIPELINE_STAGES: usize = 16;

/// The most tokens a prefill node computes of a batch prompt between two chances to yield to
/// a higher class (other prompts yield between whole chunks): a quarter of the default chunk,
/// which costs it a few percent of its speed and keeps an interactive prompt's wait behind it
/// to a fraction of a second. The router's TTFT estimate charges half of it, the expected wait.
pub const BATCH_YIELD_TOKENS: usize = 64;

/// Most choices a request may ask for (`GenerateRequest.n`).
pub const MAX_CHOICES: u32 = 16;

/// The seed choice `choice` of a request seeded with `seed` samples with: the seed itself for
/// the first, then a splitmix64 step per choice, so that the choices' streams differ and each
/// one is a one-choice request with its own seed.
pub fn choice_seed(seed: u64, choice: u32) -> u64 {
    if choice == 0 {
        return seed;
    }
    let mut z = seed.wrapping_add(u64::from(choice).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Checks `(field, id)` pairs against [`MAX_ID_BYTES`]; the first one over it is returned with
/// the reason, which never echoes the id.
pub fn check_ids(ids: &[(&'static str, &str)]) -> Result<(), (&'static str, String)> {
    match ids.iter().find(|(_, id)| id.len() > MAX_ID_BYTES) {
        Some((field, id)) => Err((
            field,
            format!("{} bytes, over the limit of {MAX_ID_BYTES}", id.len()),
        )),
        None => Ok(()),
    }
}

/// `id` for a log line: itself when within [`MAX_ID_BYTES`], else a placeholder (the request
/// is refused as soon as it is checked, but a span may be opened before that).
pub fn loggable_id(id: &str) -> &str {
    if id.len() > MAX_ID_BYTES {
        "(over the id limit)"
    } else {
        id
    }
}
