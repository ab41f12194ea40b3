//! The affinity session of an HTTP request, from what the clients people use actually send:
//! coding agents name their session in headers of their own, OpenAI's API in
//! `prompt_cache_key`, older clients in `user`. The first of these that a request carries is its
//! session, in this order:
//!
//! 1. `x-claude-code-session-id` (Claude Code),
//! 2. `session-id`, then `session_id` (Codex),
//! 3. `x-session-affinity`, then `x-session-id`,
//! 4. the body's `prompt_cache_key` (OpenAI's cache-routing key),
//! 5. the session in Anthropic's `metadata.user_id`: Claude Code sends a JSON object's text
//!    with a `session_id` (older versions `user_<hash>_account_<uuid>_session_<uuid>`, whose
//!    part after `_session_` is the session): a user's other sessions are other conversations.
//!    Any other value is taken whole,
//! 6. the body's `user`.
//!
//! A request with none of them has no session: its prompt's first block places it.

use axum::http::HeaderMap;

/// The headers that name a session, in the order they are read.
pub(crate) const SESSION_HEADERS: [&str; 5] = [
    "x-claude-code-session-id",
    "session-id",
    "session_id",
    "x-session-affinity",
    "x-session-id",
];

/// What a request's body says of its session, in the order it is read after the headers.
#[derive(Debug, Default)]
pub(crate) struct BodySession {
    pub prompt_cache_key: Option<String>,
    /// Anthropic's `metadata.user_id`.
    pub metadata_user_id: Option<String>,
    pub user: Option<String>,
}

/// The session a `metadata.user_id` names (see the order above).
fn metadata_session(user_id: String) -> String {
    if let Ok(serde_json::Value::Object(o)) = serde_json::from_str(&user_id)
        && let Some(serde_json::Value::String(session)) = o.get("session_id")
        && !session.is_empty()
    {
        return session.clone();
    }
    match user_id.rsplit_once("_session_") {
        Some((_, session)) if !session.is_empty() => session.to_string(),
        _ => user_id,
    }
}

/// The request's session (empty: none), by the order above. Empty values count as absent, and
/// a header that is not visible ASCII is passed over.
pub(crate) fn session(headers: &HeaderMap, body: BodySession) -> String {
    let header = SESSION_HEADERS.iter().find_map(|name| {
        let value = headers.get(*name)?.to_str().ok()?.trim();
        (!value.is_empty()).then(|| value.to_string())
    });
    header
        .into_iter()
        .chain(body.prompt_cache_key)
        .chain(body.metadata_user_id.map(metadata_session))
        .chain(body.user)
        .find(|s| !s.is_empty())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn body(key: Option<&str>, user: Option<&str>) -> BodySession {
        BodySession {
            prompt_cache_key: key.map(str::to_string),
            metadata_user_id: None,
            user: user.map(str::to_string),
        }
    }

    #[test]
    fn claude_codes_user_id_names_its_session() {
        let headers = HeaderMap::new();
        let with = |id: &str| BodySession {
            metadata_user_id: Some(id.into()),
            ..body(None, Some("u"))
        };
        let claude = "user_ab12_account_5f0e_session_9c3d-77";
        assert_eq!(session(&headers, with(claude)), "9c3d-77");
        let json = r#"{"device_id":"7e9c","account_uuid":"","session_id":"ef0f-b85e"}"#;
        assert_eq!(session(&headers, with(json)), "ef0f-b85e");
        assert_eq!(session(&headers, with("alice")), "alice");
        assert_eq!(session(&headers, with("")), "u");
        let keyed = BodySession {
            prompt_cache_key: Some("k".into()),
            ..with(claude)
        };
        assert_eq!(session(&headers, keyed), "k");
    }

    #[test]
    fn the_first_of_the_headers_then_the_body_names_the_session() {
        let mut headers = HeaderMap::new();
        assert_eq!(session(&headers, body(None, None)), "");
        assert_eq!(session(&headers, body(None, Some("u"))), "u");
        assert_eq!(session(&headers, body(Some("k"), Some("u"))), "k");
        assert_eq!(session(&headers, body(Some(""), Some("u"))), "u");
        // Each header outranks the ones after it, and the body.
        for name in SESSION_HEADERS.iter().rev() {
            headers.insert(*name, HeaderValue::from_str(name).expect("ascii"));
            assert_eq!(session(&headers, body(Some("k"), Some("u"))), *name);
        }
        // An empty header is no session.
        headers.insert(SESSION_HEADERS[0], HeaderValue::from_static(""));
        assert_eq!(session(&headers, body(None, None)), SESSION_HEADERS[1]);
    }
}
