//! Readers of a JSON body's fields, shared by the OpenAI endpoints: each one reads a key as
//! the type it must be, and refuses anything else by the key's name.

use std::collections::HashMap;

use axum::http::HeaderMap;
use serde_json::{Map, Value};
use tandem_proto::policy::{Bound, LOGIT_BIAS};
use tandem_proto::v1 as pb;

use crate::api::http::error::ApiError;

/// Most stop sequences, as in OpenAI's API.
const MAX_STOP: usize = 4;

/// OpenAI's bounds on `metadata`: pairs, and characters per key and per value.
const METADATA_PAIRS: usize = 16;
const METADATA_KEY_CHARS: usize = 64;
const METADATA_VALUE_CHARS: usize = 512;

/// Checks `metadata` (string pairs within OpenAI's bounds). It tags a stored completion, and
/// nothing is stored (`store` is refused), so it is checked and then ignored.
pub(crate) fn check_metadata(body: &Map<String, Value>) -> Result<(), ApiError> {
    let Some(m) = body.get("metadata").filter(|v| !v.is_null()) else {
        return Ok(());
    };
    let invalid = |why: String| Err(ApiError::invalid("metadata", why));
    let Some(pairs) = m.as_object() else {
        return invalid("'metadata' must be an object of strings".into());
    };
    if pairs.len() > METADATA_PAIRS {
        return invalid(format!("at most {METADATA_PAIRS} pairs"));
    }
    for (k, v) in pairs {
        let Some(v) = v.as_str() else {
            return invalid(format!("metadata['{k}'] must be a string"));
        };
        if k.chars().count() > METADATA_KEY_CHARS || v.chars().count() > METADATA_VALUE_CHARS {
            return invalid(format!(
                "keys of at most {METADATA_KEY_CHARS} characters, values of at most \
                 {METADATA_VALUE_CHARS}"
            ));
        }
    }
    Ok(())
}

pub(crate) fn number(body: &Map<String, Value>, key: &str) -> Result<Option<f64>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| ApiError::invalid(key, format!("'{key}' must be a number"))),
    }
}

/// A number field within `bound` ([`tandem_proto::policy`]'s), if present and not null.
pub(crate) fn in_bound(
    body: &Map<String, Value>,
    key: &str,
    bound: Bound,
) -> Result<Option<f32>, ApiError> {
    match number(body, key)?.map(|v| v as f32) {
        Some(v) if !bound.contains(v) => Err(ApiError::invalid(
            key,
            format!("'{key}' {}", bound.refusal(v)),
        )),
        v => Ok(v),
    }
}

pub(crate) fn unsigned(body: &Map<String, Value>, key: &str) -> Result<Option<u64>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            ApiError::invalid(key, format!("'{key}' must be a non-negative integer"))
        }),
    }
}

pub(crate) fn flag(body: &Map<String, Value>, key: &str) -> Result<bool, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid(key, format!("'{key}' must be a boolean"))),
    }
}

/// OpenAI's `parallel_tool_calls`, true unless set false (false keeps a reply's first call).
pub(crate) fn parallel_tool_calls(body: &Map<String, Value>) -> Result<bool, ApiError> {
    match body.get("parallel_tool_calls") {
        None | Some(Value::Null) => Ok(true),
        _ => flag(body, "parallel_tool_calls"),
    }
}

pub(crate) fn present(body: &Map<String, Value>, key: &str) -> bool {
    body.get(key).is_some_and(|v| !v.is_null())
}

pub(crate) fn stop(body: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    let stops = match body.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| {
                s.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| ApiError::invalid("stop", "'stop' must hold strings"))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "'stop' must be a string or an array of strings",
            ));
        }
    };
    if stops.len() > MAX_STOP {
        return Err(ApiError::invalid(
            "stop",
            format!("at most {MAX_STOP} stop sequences"),
        ));
    }
    Ok(stops)
}

/// A header's value, if present and readable.
/// `logit_bias`: token ids (as JSON object keys) to biases in [-100, 100]; the bounds on how
/// many and which ids are the router's, for both APIs.
pub(crate) fn logit_bias(body: &Map<String, Value>) -> Result<HashMap<u32, f32>, ApiError> {
    let Some(v) = body.get("logit_bias").filter(|v| !v.is_null()) else {
        return Ok(HashMap::new());
    };
    let Some(o) = v.as_object() else {
        return Err(ApiError::invalid(
            "logit_bias",
            "'logit_bias' must be an object of token ids to numbers",
        ));
    };
    o.iter()
        .map(|(k, v)| {
            let id = k
                .parse::<u32>()
                .map_err(|_| ApiError::invalid("logit_bias", format!("'{k}' is not a token id")))?;
            match v.as_f64().map(|b| b as f32) {
                Some(b) if LOGIT_BIAS.contains(b) => Ok((id, b)),
                _ => Err(ApiError::invalid(
                    "logit_bias",
                    format!("logit_bias['{k}'] must be a number {LOGIT_BIAS}"),
                )),
            }
        })
        .collect()
}

/// An array of token ids.
pub(crate) fn token_ids(body: &Map<String, Value>, key: &str) -> Result<Vec<u32>, ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| {
                        ApiError::invalid(key, format!("'{key}' must be an array of token ids"))
                    })
            })
            .collect(),
        Some(_) => Err(ApiError::invalid(
            key,
            format!("'{key}' must be an array of token ids"),
        )),
    }
}

pub(crate) fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// The grammar of a structured-output format (`param`): `type` `text` (none), `json_object`, or
/// `json_schema` with its `schema` (`schema_param`). Chat's `response_format` and the
/// Responses API's `text.format` nest these differently.
pub(crate) fn json_grammar(
    param: &str,
    schema_param: &str,
    kind: Option<&str>,
    schema: Option<&Value>,
) -> Result<Option<pb::Grammar>, ApiError> {
    use pb::grammar::Kind;
    let kind = match kind {
        Some("text") => return Ok(None),
        Some("json_object") => Kind::JsonObject(true),
        Some("json_schema") => match schema {
            Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
                Kind::JsonSchema(schema.to_string())
            }
            _ => {
                return Err(ApiError::invalid(
                    schema_param,
                    "a json_schema format needs its 'schema' object",
                ));
            }
        },
        _ => {
            return Err(ApiError::invalid(
                param,
                format!(
                    "'{param}' must have the type \"text\", \"json_object\" or \"json_schema\""
                ),
            ));
        }
    };
    Ok(Some(pb::Grammar { kind: Some(kind) }))
}

/// `body`'s `tools` array, each entry (an object, `tools[i]`) made a tool by `each`, which may
/// leave one out (`None`).
pub(crate) fn tool_list(
    body: &Map<String, Value>,
    mut each: impl FnMut(&str, &Map<String, Value>) -> Result<Option<pb::Tool>, ApiError>,
) -> Result<Vec<pb::Tool>, ApiError> {
    let list = match body.get("tools") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(ApiError::invalid("tools", "'tools' must be an array")),
    };
    let mut tools = Vec::new();
    for (i, t) in list.iter().enumerate() {
        let param = format!("tools[{i}]");
        let Some(t) = t.as_object() else {
            return Err(ApiError::invalid(&param, "a tool is an object"));
        };
        tools.extend(each(&param, t)?);
    }
    Ok(tools)
}

/// A function's definition in `f` (`param` names it): its `name` (1 to 64 of a-z, A-Z, 0-9, `_`
/// and `-`), `description`, and the JSON schema of its arguments under `schema_key` (required
/// when `schema_required`).
pub(crate) fn function_tool(
    param: &str,
    f: &Map<String, Value>,
    schema_key: &str,
    schema_required: bool,
) -> Result<pb::Tool, ApiError> {
    let name = match f.get("name") {
        Some(Value::String(n)) if crate::dispatch::chat::valid_function_name(n) => n.clone(),
        _ => {
            return Err(ApiError::invalid(
                &format!("{param}.name"),
                "the name must be 1 to 64 of a-z, A-Z, 0-9, _ and -",
            ));
        }
    };
    let description = match f.get("description") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(d)) => d.clone(),
        Some(_) => {
            return Err(ApiError::invalid(
                &format!("{param}.description"),
                "'description' must be a string",
            ));
        }
    };
    let parameters = match f.get(schema_key) {
        None | Some(Value::Null) if !schema_required => String::new(),
        Some(p @ Value::Object(_)) => p.to_string(),
        _ => {
            return Err(ApiError::invalid(
                &format!("{param}.{schema_key}"),
                format!("'{schema_key}' must be a JSON schema object"),
            ));
        }
    };
    Ok(pb::Tool {
        name,
        description,
        parameters,
        input_grammar: String::new(),
    })
}

/// Whether a thinking model reasons, from a reasoning effort (OpenAI's `reasoning_effort`, the
/// Responses API's `reasoning.effort`): `none` switches it off; any other effort leaves the
/// chat template's default (a model thinks or not: its effort is not graded).
pub(crate) fn thinking_of_effort(effort: Option<&str>) -> Option<bool> {
    (effort == Some("none")).then_some(false)
}
