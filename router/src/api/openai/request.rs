//! A request body parsed into a `tandem.v1` `GenerateRequest`: every key either honoured,
//! accepted at the value that asks nothing of the server, or refused by name.
//!
//! The body is parsed by hand from a JSON object, not derived, so that an unknown key can be
//! named in the error instead of failing the whole parse or being dropped.

use axum::http::HeaderMap;
use serde_json::{Map, Value};
use tandem_proto::policy;
use tandem_proto::v1 as pb;

use crate::api::http::error::ApiError;
use crate::api::http::fields::{
    check_metadata, flag, in_bound, logit_bias, number, parallel_tool_calls, present, stop,
    thinking_of_effort, token_ids, unsigned,
};
use crate::api::http::{Call, base_sampling, check_model, json_object, string, unknown_key};
use crate::api::openai::chat::{messages, response_format, tool_choice, tools};
use crate::api::session::{BodySession, session};
use crate::config::SamplingDefaults;

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Chat,
    Completion,
}

impl Kind {
    pub(super) fn object(self, streaming: bool) -> &'static str {
        match (self, streaming) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }

    pub(super) fn id_prefix(self) -> &'static str {
        match self {
            Kind::Chat => "chatcmpl-",
            Kind::Completion => "cmpl-",
        }
    }
}

/// A request, read and checked.
#[derive(Debug)]
pub(crate) struct Parsed {
    pub(crate) call: Call,
    pub(super) stream: bool,
    /// Where a stream reports usage (`stream_options`).
    pub(super) stream_usage: StreamUsage,
    /// `parallel_tool_calls`: false keeps a reply's first tool call only.
    pub(super) parallel_tool_calls: bool,
}

/// Where a stream reports usage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StreamUsage {
    /// Nowhere.
    None,
    /// In a chunk of its own after the last (`include_usage`); the others have `usage: null`.
    Last,
    /// That, and the usage so far on every other chunk as well (`continuous_usage_stats`).
    Continuous,
}

/// The keys each endpoint honours. Anything else that is present and not null is rejected.
const COMMON_KEYS: &[&str] = &[
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "user",
    "prompt_cache_key",
    "cache_salt",
    "logprobs",
    "logit_bias",
    "min_p",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
];
const CHAT_KEYS: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "response_format",
    "store",
    "metadata",
    "parallel_tool_calls",
    "service_tier",
    "tools",
    "tool_choice",
    "reasoning_effort",
    "chat_template_kwargs",
];
const COMPLETION_KEYS: &[&str] = &["prompt", "echo", "best_of", "suffix"];

/// How many alternatives' log-probabilities a request asks for, if any: chat's `logprobs`
/// (a boolean) and `top_logprobs`; completions' `logprobs` (a count).
fn logprobs(kind: Kind, body: &Map<String, Value>) -> Result<Option<u32>, ApiError> {
    let most = u64::from(tandem_proto::MAX_TOP_LOGPROBS);
    let count = |key: &str| match unsigned(body, key)? {
        Some(n) if n > most => Err(ApiError::invalid(
            key,
            format!("'{key}' must be between 0 and {most}"),
        )),
        n => Ok(n.map(|n| n as u32)),
    };
    match kind {
        Kind::Chat => {
            let top = count("top_logprobs")?;
            match (flag(body, "logprobs")?, top) {
                (true, top) => Ok(Some(top.unwrap_or(0))),
                (false, None) => Ok(None),
                (false, Some(_)) => Err(ApiError::invalid(
                    "top_logprobs",
                    "'top_logprobs' needs 'logprobs': true",
                )),
            }
        }
        Kind::Completion => match body.get("logprobs") {
            None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(None),
            _ => count("logprobs"),
        },
    }
}

/// `stream_options` (only with `stream`): whether the usage comes on the last chunk, on every
/// chunk (vLLM's `continuous_usage_stats`), or not at all.
fn stream_usage(body: &Map<String, Value>, stream: bool) -> Result<StreamUsage, ApiError> {
    Ok(match body.get("stream_options") {
        None | Some(Value::Null) => StreamUsage::None,
        Some(Value::Object(o)) => {
            if let Some(k) = o
                .keys()
                .find(|k| *k != "include_usage" && *k != "continuous_usage_stats")
            {
                return Err(ApiError::unsupported(
                    &format!("stream_options.{k}"),
                    "only include_usage and continuous_usage_stats are served",
                ));
            }
            if !stream {
                return Err(ApiError::invalid(
                    "stream_options",
                    "stream_options is only allowed with stream: true",
                ));
            }
            // vLLM's extension: the usage so far on every chunk, with include_usage only.
            match (
                flag(o, "include_usage")?,
                flag(o, "continuous_usage_stats")?,
            ) {
                (false, _) => StreamUsage::None,
                (true, false) => StreamUsage::Last,
                (true, true) => StreamUsage::Continuous,
            }
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "stream_options",
                "'stream_options' must be an object",
            ));
        }
    })
}

/// Whether a thinking model reasons: `chat_template_kwargs.enable_thinking` (vLLM's and
/// llama-server's switch, the template's own variable), else `reasoning_effort` (`none` is off);
/// `None` leaves the template's default.
fn enable_thinking(body: &Map<String, Value>) -> Result<Option<bool>, ApiError> {
    let effort = string(body, "reasoning_effort")?;
    match body.get("chat_template_kwargs") {
        None | Some(Value::Null) => Ok(thinking_of_effort(effort.as_deref())),
        Some(Value::Object(o)) => {
            if let Some(k) = o.keys().find(|k| *k != "enable_thinking") {
                return Err(ApiError::unsupported(
                    &format!("chat_template_kwargs.{k}"),
                    "only enable_thinking is passed to the template",
                ));
            }
            match o.get("enable_thinking") {
                None | Some(Value::Null) => Ok(thinking_of_effort(effort.as_deref())),
                Some(Value::Bool(b)) => Ok(Some(*b)),
                Some(_) => Err(ApiError::invalid(
                    "chat_template_kwargs.enable_thinking",
                    "'enable_thinking' must be a boolean",
                )),
            }
        }
        Some(_) => Err(ApiError::invalid(
            "chat_template_kwargs",
            "'chat_template_kwargs' must be an object",
        )),
    }
}

/// `max_completion_tokens`, else `max_tokens`; 0 when neither is set (the router's default,
/// see DEFAULT_MAX_TOKENS).
fn max_tokens(body: &Map<String, Value>) -> Result<u32, ApiError> {
    Ok(
        match (
            unsigned(body, "max_completion_tokens")?,
            unsigned(body, "max_tokens")?,
        ) {
            (Some(m), _) | (None, Some(m)) => {
                if m == 0 {
                    return Err(ApiError::invalid(
                        "max_tokens",
                        "'max_tokens' must be at least 1",
                    ));
                }
                u32::try_from(m).unwrap_or(u32::MAX)
            }
            // 0: the router's default (see DEFAULT_MAX_TOKENS).
            (None, None) => 0,
        },
    )
}

/// A completion's `prompt`: a string, a one-string array, or token ids.
fn completion_prompt(
    body: &Map<String, Value>,
    request: &mut pb::GenerateRequest,
) -> Result<(), ApiError> {
    match body.get("prompt") {
        Some(Value::String(p)) => request.prompt = Some(p.clone()),
        Some(Value::Array(a)) if a.iter().all(Value::is_u64) && !a.is_empty() => {
            request.token_ids = a
                .iter()
                .filter_map(Value::as_u64)
                .map(|t| u32::try_from(t).unwrap_or(u32::MAX))
                .collect();
        }
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            request.prompt = a[0].as_str().map(str::to_string);
        }
        Some(Value::Array(_)) => {
            return Err(ApiError::unsupported(
                "prompt",
                "one prompt per request (a string, a one-string array, or token ids)",
            ));
        }
        _ => {
            return Err(ApiError::invalid(
                "prompt",
                "'prompt' must be a string or an array of token ids",
            ));
        }
    };
    Ok(())
}

pub(crate) fn parse(
    kind: Kind,
    model: &str,
    headers: &HeaderMap,
    body: &[u8],
    defaults: &SamplingDefaults,
) -> Result<Parsed, ApiError> {
    let body = json_object(body)?;
    let own = match kind {
        Kind::Chat => CHAT_KEYS,
        Kind::Completion => COMPLETION_KEYS,
    };
    if let Some(key) = unknown_key(&body, &[COMMON_KEYS, own].concat()) {
        return Err(ApiError::unsupported(key, "Tandem does not implement it"));
    }
    // The upper bound is the router's (`prepare`), the same on both APIs.
    let n = match unsigned(&body, "n")? {
        None => 1,
        Some(0) => return Err(ApiError::invalid("n", "'n' must be at least 1")),
        Some(n) => u32::try_from(n).unwrap_or(u32::MAX),
    };
    // Parameters that are accepted only at the value that means "off".
    if unsigned(&body, "best_of")?.is_some_and(|n| n != 1) {
        return Err(ApiError::unsupported("best_of", "only best_of=1 is served"));
    }
    let logprobs = logprobs(kind, &body)?;
    if flag(&body, "store")? {
        return Err(ApiError::unsupported(
            "store",
            "completions are not stored (store: false is served)",
        ));
    }
    check_metadata(&body)?;
    let parallel_tool_calls = parallel_tool_calls(&body)?;
    match body.get("service_tier") {
        None | Some(Value::Null) => {}
        Some(Value::String(t)) if t == "auto" || t == "default" => {}
        Some(_) => {
            return Err(ApiError::unsupported(
                "service_tier",
                "one tier is served (\"auto\" or \"default\")",
            ));
        }
    }
    if flag(&body, "echo")? {
        return Err(ApiError::unsupported("echo", "the prompt is not echoed"));
    }
    if present(&body, "suffix") {
        return Err(ApiError::unsupported(
            "suffix",
            "there is no insertion mode",
        ));
    }
    let grammar = response_format(&body)?;
    check_model(&body)?;
    let stream = flag(&body, "stream")?;
    let stream_usage = stream_usage(&body, stream)?;
    let max_tokens = max_tokens(&body)?;
    let seed = match body.get("seed") {
        None | Some(Value::Null) => 0,
        // OpenAI's seed is any integer; a negative one keeps its bits.
        Some(v) => v
            .as_i64()
            .map(|s| s as u64)
            .or_else(|| v.as_u64())
            .ok_or_else(|| ApiError::invalid("seed", "'seed' must be an integer"))?,
    };
    let user = string(&body, "user")?;
    let cache_salt = string(&body, "cache_salt")?.unwrap_or_default();
    let sampling = pb::SamplingParams {
        seed,
        max_tokens,
        stop: stop(&body)?,
        frequency_penalty: in_bound(&body, "frequency_penalty", policy::PENALTY)?,
        presence_penalty: in_bound(&body, "presence_penalty", policy::PENALTY)?,
        repetition_penalty: number(&body, "repetition_penalty")?.map(|r| r as f32),
        min_p: in_bound(&body, "min_p", policy::MIN_P)?.or(defaults.min_p),
        logit_bias: logit_bias(&body)?,
        ignore_eos: flag(&body, "ignore_eos")?,
        min_tokens: unsigned(&body, "min_tokens")?
            .map_or(0, |m| u32::try_from(m).unwrap_or(u32::MAX)),
        stop_token_ids: token_ids(&body, "stop_token_ids")?,
        logprobs,
        grammar,
        ..base_sampling(&body, defaults, policy::OPENAI_TEMPERATURE)?
    };
    let mut request = pb::GenerateRequest {
        session_id: session(
            headers,
            BodySession {
                prompt_cache_key: string(&body, "prompt_cache_key")?,
                user,
                ..Default::default()
            },
        ),
        sampling: Some(sampling),
        cache_salt,
        n,
        model: model.to_string(),
        ..Default::default()
    };
    match kind {
        Kind::Chat => {
            request.messages = messages(&body)?;
            let (choice, function) = tool_choice(&body)?;
            let forced = matches!(choice, pb::ToolChoice::Required | pb::ToolChoice::Function);
            request.tools = tools(&body, forced)?;
            request.tool_choice = choice as i32;
            request.tool_choice_function = function;
            request.enable_thinking = enable_thinking(&body)?;
        }
        Kind::Completion => completion_prompt(&body, &mut request)?,
    }
    Ok(Parsed {
        call: Call::new(headers, request)?,
        stream,
        stream_usage,
        parallel_tool_calls,
    })
}

#[cfg(test)]
mod tests;
