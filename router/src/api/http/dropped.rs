//! Tools that only the API's owner runs, on its own servers (web search, file search, a code
//! interpreter, a remote MCP server): Tandem cannot run them, so a request that offers one is
//! served without it, as if the model had not chosen to call it. The response names the types
//! left out in its `x-tandem-tools-dropped` header, and the router logs a WARN the first time
//! it leaves out each type.

use std::collections::BTreeSet;
use std::sync::Mutex;

use axum::http::HeaderValue;
use axum::response::Response;

/// The header that names the tool types a request offered and the response left out.
pub(crate) const HEADER: &str = "x-tandem-tools-dropped";

/// OpenAI's hosted tools (Responses API), by `type`.
const OPENAI: &[&str] = &[
    "web_search",
    "web_search_2025_08_26",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "file_search",
    "code_interpreter",
    "image_generation",
    "computer",
    "computer_use_preview",
    "mcp",
    "tool_search",
    "programmatic_tool_calling",
];

/// Anthropic's server tools (Messages API), by the prefix of their dated `type`.
const ANTHROPIC: &[&str] = &[
    "web_search_",
    "web_fetch_",
    "code_execution_",
    "tool_search_tool_",
];

/// Most tool types the once-per-type WARN remembers (Anthropic's types carry a date, so a
/// client could name any number of them).
const WARNED_TYPES: usize = 64;

/// Whether a Responses tool of type `kind` is one only OpenAI's servers run.
pub(crate) fn openai_server_tool(kind: &str) -> bool {
    OPENAI.contains(&kind)
}

/// Whether a Messages tool of type `kind` is one only Anthropic's servers run.
pub(crate) fn anthropic_server_tool(kind: &str) -> bool {
    ANTHROPIC.iter().any(|p| kind.starts_with(p))
}

/// The server tools' types a request offered, in the order first offered.
#[derive(Debug, Default)]
pub(crate) struct Dropped(Vec<String>);

impl Dropped {
    /// Leaves a tool of type `kind` out.
    pub(crate) fn push(&mut self, kind: &str) {
        if self.0.iter().any(|k| k == kind) {
            return;
        }
        warn_once(kind);
        self.0.push(kind.to_string());
    }

    /// The types left out.
    #[cfg(test)]
    pub(crate) fn types(&self) -> &[String] {
        &self.0
    }

    /// `response` with the header that names the types left out, if any were.
    pub(crate) fn mark(&self, mut response: Response) -> Response {
        if !self.0.is_empty()
            && let Ok(v) = HeaderValue::from_str(&self.0.join(", "))
        {
            response.headers_mut().insert(HEADER, v);
        }
        response
    }
}

fn warn_once(kind: &str) {
    static WARNED: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    let mut warned = WARNED.lock().unwrap_or_else(|e| e.into_inner());
    if warned.len() < WARNED_TYPES && warned.insert(kind.to_string()) {
        tracing::warn!(
            tool_type = kind,
            "a request offered a tool only its API's own servers run; it is served without \
             that tool (named in the {HEADER} header)"
        );
    }
}

#[cfg(test)]
mod tests {
    use axum::response::IntoResponse;

    use super::*;

    #[test]
    fn server_tools_are_named_once_in_the_header() {
        assert!(openai_server_tool("web_search"));
        assert!(!openai_server_tool("function"));
        assert!(anthropic_server_tool("web_search_20250305"));
        assert!(!anthropic_server_tool("custom"));
        let mut dropped = Dropped::default();
        let plain = dropped.mark(().into_response());
        assert!(plain.headers().get(HEADER).is_none());
        for kind in ["web_search", "file_search", "web_search"] {
            dropped.push(kind);
        }
        let marked = dropped.mark(().into_response());
        assert_eq!(marked.headers()[HEADER], "web_search, file_search");
    }
}
