//! Tool calls in a model's own markup: which markup a chat template writes, the text that forces
//! a call and the grammar that holds the rest of it to the tools' schemas, and a streaming
//! parser that splits a reply into text and calls.
//!
//! Small models often write a call without its tags: the whole reply is
//! `{"name": "get_weather", "arguments": {"city": "Paris"}}`. With [`BareCalls`], such a reply
//! is a call too, when it is one JSON object and nothing else (or alone in one Markdown code
//! fence), names an offered tool, and its arguments pass the caller's check (the tool's schema). A reply that merely contains JSON, or
//! whose object names no offered tool, stays text: only the reply's start is held back while it
//! can still be such a call.
//!
//! Written by hand: the markup is a template's, not a grammar's, and the parser must work on
//! text that arrives a few bytes at a time (an SSE stream) while holding back nothing but a
//! possible tag's start.

use serde_json::Value;

mod grammar;
mod json_string;

pub use grammar::{Arguments, CallGrammar};
pub use json_string::{quoted_lark, regex_grammar};

/// How a model writes a tool call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// Hermes-style, as Qwen2.5's template asks: each call is
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
    Hermes,
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

impl ToolFormat {
    /// The markup a chat template teaches, if it takes tools at all.
    pub fn of_template(template: &str) -> Option<Self> {
        (template.contains("tools") && template.contains(OPEN)).then_some(Self::Hermes)
    }

    /// The start of the reply that forces a call: of any function (`None`), or of `function`.
    /// Appended to the rendered prompt; the reply's parser starts with it as already seen.
    pub fn forced_prefix(self, function: Option<&str>) -> String {
        match (self, function) {
            (Self::Hermes, None) => format!("{OPEN}\n{{\"name\": \""),
            (Self::Hermes, Some(name)) => {
                // The name is the client's, checked to a-z, A-Z, 0-9, _ and -, so it needs no
                // escaping; to_string quotes it all the same.
                format!("{OPEN}\n{{\"name\": {}, \"arguments\": ", Value::from(name))
            }
        }
    }
}

/// One piece of a parsed reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Reply text outside any call.
    Text(String),
    /// A complete call: the function's name and its arguments, a JSON object as compact text.
    Call { name: String, arguments: String },
}

/// The check of a call's arguments (a JSON object) against the named tool's schema.
type Accepts = Box<dyn Fn(&str, &Value) -> bool + Send + Sync>;

/// What a reply may call without the markup's tags: the offered tools' names, and the check of
/// its arguments.
pub struct BareCalls {
    names: Vec<String>,
    accepts: Accepts,
}

impl BareCalls {
    pub fn new(
        names: Vec<String>,
        accepts: impl Fn(&str, &Value) -> bool + Send + Sync + 'static,
    ) -> Self {
        Self {
            names,
            accepts: Box::new(accepts),
        }
    }

    /// Whether `reply` (trimmed at its start) may still become a bare call as more of it
    /// arrives, is one whole, or cannot be one.
    fn prefix(&self, reply: &str) -> Bare {
        let (reply, fenced) = match open_fence(reply) {
            Fence::Partial => return Bare::Maybe,
            Fence::Open(rest) => (rest.trim_start(), true),
            Fence::None => (reply, false),
        };
        // `{`, then `"name"`, `:` and the opening quote of an offered tool's name.
        let mut rest = reply;
        for token in ["{", "\"name\"", ":", "\""] {
            rest = rest.trim_start();
            match rest.strip_prefix(token) {
                Some(after) => rest = after,
                None if token.starts_with(rest) => return Bare::Maybe,
                None => return Bare::No,
            }
        }
        match rest.split_once('"') {
            Some((name, _)) if self.names.iter().any(|n| n == name) => {}
            Some(_) => return Bare::No,
            None if self.names.iter().any(|n| n.starts_with(rest)) => return Bare::Maybe,
            None => return Bare::No,
        }
        // The object, read to its end; after it only whitespace, and the fence's end if it
        // opened in one.
        let mut values = serde_json::Deserializer::from_str(reply).into_iter::<Value>();
        match values.next() {
            Some(Ok(_)) => {
                let tail = reply[values.byte_offset()..].trim();
                match tail.is_empty() || (fenced && FENCE.starts_with(tail)) {
                    true => Bare::Whole,
                    false => Bare::No,
                }
            }
            Some(Err(e)) if e.is_eof() => Bare::Maybe,
            _ => Bare::No,
        }
    }

    /// The call a whole reply is, if it names an offered tool with arguments that pass.
    fn call(&self, reply: &str) -> Option<Piece> {
        let body = match open_fence(reply) {
            Fence::Open(rest) => rest.trim_end().strip_suffix(FENCE).unwrap_or(rest),
            Fence::Partial | Fence::None => reply,
        };
        let Some(Piece::Call { name, arguments }) = call(body) else {
            return None;
        };
        let args: Value = serde_json::from_str(&arguments).ok()?;
        (self.names.contains(&name) && (self.accepts)(&name, &args))
            .then_some(Piece::Call { name, arguments })
    }
}

/// A Markdown code fence, which small models often put around a bare call.
const FENCE: &str = "```";

/// How a reply's start stands to an opening code fence (```` ``` ```` or ```` ```json ````, then
/// a line break).
enum Fence<'a> {
    /// The start of one, not yet whole.
    Partial,
    /// One, and the text after it.
    Open(&'a str),
    None,
}

fn open_fence(reply: &str) -> Fence<'_> {
    for open in ["```json\n", "```\n"] {
        if open.starts_with(reply) {
            return Fence::Partial;
        }
        if let Some(rest) = reply.strip_prefix(open) {
            return Fence::Open(rest);
        }
    }
    Fence::None
}

impl std::fmt::Debug for BareCalls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BareCalls")
            .field("names", &self.names)
            .finish_non_exhaustive()
    }
}

/// What a reply's start is to [`BareCalls`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bare {
    /// It may still be a bare call: held back.
    Maybe,
    /// One whole object naming an offered tool: held back until the reply ends.
    Whole,
    /// It cannot be one: parsed as markup and text from here on.
    No,
}

/// Splits a reply, given in arbitrary slices, into [`Piece`]s. Text is passed on as soon as it
/// cannot be the start of a call's tag; a call is passed on when its closing tag arrives (or at
/// the end, if the reply stopped right after its JSON). Markup that does not hold a call
/// (malformed JSON, no `name`) is passed on as text, so nothing the model wrote is lost.
/// Whitespace between calls, and around them, is dropped.
#[derive(Debug)]
pub struct ToolCallParser {
    buf: String,
    inside: bool,
    /// A call has been seen: whitespace around later calls is markup, not text.
    after_call: bool,
    /// While the reply may be a bare call: what it may call ([`ToolCallParser::with_bare_calls`]).
    bare: Option<BareCalls>,
}

impl ToolCallParser {
    /// A parser for `format` whose reply began, in the prompt, with `forced` (a
    /// [`ToolFormat::forced_prefix`], or `""`).
    pub fn new(format: ToolFormat, forced: &str) -> Self {
        // One markup so far: its tags are the constants above.
        let ToolFormat::Hermes = format;
        let mut parser = Self {
            buf: String::new(),
            inside: false,
            after_call: false,
            bare: None,
        };
        // The forced prefix yields nothing on its own: it ends inside a call.
        let _ = parser.push(forced);
        parser
    }

    /// Also reads a reply that is one bare call, as [`BareCalls`] says (for a reply that starts
    /// free: with no forced prefix).
    pub fn with_bare_calls(mut self, bare: BareCalls) -> Self {
        if self.buf.is_empty() && !self.inside {
            self.bare = Some(bare);
        }
        self
    }

    /// Takes the next slice of the reply; returns what it completes.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        if let Some(bare) = &self.bare {
            match bare.prefix(self.buf.trim_start()) {
                Bare::Maybe | Bare::Whole => return Vec::new(),
                Bare::No => self.bare = None,
            }
        }
        let mut out = Vec::new();
        loop {
            if self.inside {
                let Some(end) = self.buf.find(CLOSE) else {
                    break;
                };
                let body: String = self.buf[..end].to_string();
                self.buf.drain(..end + CLOSE.len());
                self.inside = false;
                out.push(
                    call(&body).unwrap_or_else(|| Piece::Text(format!("{OPEN}{body}{CLOSE}"))),
                );
                self.after_call = true;
            } else if let Some(start) = self.buf.find(OPEN) {
                let before: String = self.buf[..start].to_string();
                self.buf.drain(..start + OPEN.len());
                self.inside = true;
                self.text(&before, true, &mut out);
            } else {
                // Hold back what could still begin a tag, and trailing whitespace (it is
                // dropped if a call follows).
                let keep = held_back(&self.buf);
                let ready: String = self.buf[..keep].to_string();
                self.buf.drain(..keep);
                self.text(&ready, false, &mut out);
                break;
            }
        }
        out
    }

    /// Ends the reply: what is still held back, and a call left open (parsed if its JSON is
    /// whole, else as text).
    pub fn finish(mut self) -> Vec<Piece> {
        if let Some(bare) = self.bare.take() {
            if let Some(call) = bare.call(self.buf.trim()) {
                return vec![call];
            }
            // Not a call after all: the held text, read as markup and text.
            let held = std::mem::take(&mut self.buf);
            let mut out = self.push(&held);
            out.extend(self.finish());
            return out;
        }
        let rest = std::mem::take(&mut self.buf);
        if self.inside {
            return vec![call(&rest).unwrap_or_else(|| Piece::Text(format!("{OPEN}{rest}")))];
        }
        let rest = if self.after_call {
            rest.trim_start()
        } else {
            &rest
        };
        if rest.is_empty() {
            Vec::new()
        } else {
            vec![Piece::Text(rest.to_string())]
        }
    }

    /// Passes on `text`: without the whitespace that borders a call.
    fn text(&mut self, text: &str, before_call: bool, out: &mut Vec<Piece>) {
        let mut t = text;
        if self.after_call {
            t = t.trim_start();
        }
        if before_call {
            t = t.trim_end();
        }
        if !t.is_empty() {
            // Text after a call ends the run of calls: its whitespace is the model's again.
            self.after_call = false;
            out.push(Piece::Text(t.to_string()));
        }
    }
}

/// How many leading bytes of `buf` can be passed on: all but a trailing run of whitespace and a
/// suffix that is a proper prefix of the opening tag.
fn held_back(buf: &str) -> usize {
    let tag_start = (1..OPEN.len())
        .rev()
        .find(|&n| buf.ends_with(&OPEN[..n]))
        .map_or(buf.len(), |n| buf.len() - n);
    buf[..tag_start].trim_end().len()
}

/// The call in a tag's body: a JSON object with a string `name` and object `arguments`.
fn call(body: &str) -> Option<Piece> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments") {
        Some(a @ Value::Object(_)) => a.to_string(),
        None | Some(Value::Null) => "{}".to_string(),
        // Some models write the arguments as a JSON string of an object.
        Some(Value::String(s)) if s.trim_start().starts_with('{') => {
            serde_json::from_str::<Value>(s)
                .ok()
                .filter(Value::is_object)?
                .to_string()
        }
        Some(_) => return None,
    };
    Some(Piece::Call { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_in_slices(text: &str, forced: &str, step: usize) -> Vec<Piece> {
        sliced(ToolCallParser::new(ToolFormat::Hermes, forced), text, step)
    }

    /// What `p` makes of `text` given `step` characters at a time, adjacent text joined.
    fn sliced(mut p: ToolCallParser, text: &str, step: usize) -> Vec<Piece> {
        let mut out = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for chunk in chars.chunks(step) {
            out.extend(p.push(&chunk.iter().collect::<String>()));
        }
        out.extend(p.finish());
        merge_text(out)
    }

    /// Adjacent text pieces joined, so slicings can be compared.
    fn merge_text(pieces: Vec<Piece>) -> Vec<Piece> {
        let mut out: Vec<Piece> = Vec::new();
        for p in pieces {
            match (out.last_mut(), p) {
                (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
                (_, p) => out.push(p),
            }
        }
        out
    }

    fn call(name: &str, arguments: &str) -> Piece {
        Piece::Call {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    #[test]
    fn calls_and_text_split_the_same_at_any_slicing() {
        let reply = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
                     {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \
                     \"now\", \"arguments\": {}}\n</tool_call>";
        let want = vec![
            Piece::Text("Let me check.".into()),
            call("get_weather", r#"{"city":"Paris","days":2}"#),
            call("now", "{}"),
        ];
        for step in 1..=reply.len() {
            assert_eq!(parse_in_slices(reply, "", step), want, "slices of {step}");
        }
    }

    #[test]
    fn text_alone_passes_through_whole() {
        let reply = "a < b, and <tool is not a tag>  \n";
        for step in 1..=reply.len() {
            assert_eq!(
                parse_in_slices(reply, "", step),
                vec![Piece::Text(reply.into())],
                "slices of {step}"
            );
        }
    }

    #[test]
    fn text_is_released_as_soon_as_it_cannot_start_a_tag() {
        let mut p = ToolCallParser::new(ToolFormat::Hermes, "");
        assert_eq!(p.push("Hello <tool"), vec![Piece::Text("Hello".into())]);
        assert_eq!(p.push("s> "), vec![Piece::Text(" <tools>".into())]);
        assert_eq!(p.finish(), vec![Piece::Text(" ".into())]);
    }

    #[test]
    fn a_forced_prefix_counts_as_written() {
        let named = ToolFormat::Hermes.forced_prefix(Some("get_weather"));
        assert_eq!(
            parse_in_slices("{\"city\": \"Oslo\"}}\n</tool_call>", &named, 3),
            vec![call("get_weather", r#"{"city":"Oslo"}"#)]
        );
        let any = ToolFormat::Hermes.forced_prefix(None);
        assert_eq!(
            parse_in_slices("now\", \"arguments\": {}}", &any, 2),
            vec![call("now", "{}")],
            "a call whose reply stopped before its closing tag"
        );
    }

    #[test]
    fn markup_without_a_call_is_kept_as_text() {
        for body in ["{\"arguments\": {}}", "not json", "{\"name\": 3}"] {
            let reply = format!("<tool_call>{body}</tool_call>");
            assert_eq!(
                parse_in_slices(&reply, "", 4),
                vec![Piece::Text(reply.clone())]
            );
        }
        assert_eq!(
            parse_in_slices("<tool_call>\n{\"name\": \"f\", \"argu", "", 5),
            vec![Piece::Text("<tool_call>\n{\"name\": \"f\", \"argu".into())],
            "a reply cut inside a call"
        );
    }

    fn bare_parse(reply: &str, step: usize) -> Vec<Piece> {
        let bare = BareCalls::new(vec!["get_weather".into()], |_, args| {
            args.get("city").is_some_and(Value::is_string)
        });
        let p = ToolCallParser::new(ToolFormat::Hermes, "").with_bare_calls(bare);
        sliced(p, reply, step)
    }

    #[test]
    fn a_reply_that_is_one_bare_call_is_a_call() {
        let reply = " {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n";
        for step in 1..=reply.len() {
            assert_eq!(
                bare_parse(reply, step),
                vec![call("get_weather", r#"{"city":"Paris"}"#)],
                "slices of {step}"
            );
        }
        // Alone in a code fence, as small models often write it.
        let fenced =
            "```json\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n```";
        for step in 1..=fenced.len() {
            assert_eq!(
                bare_parse(fenced, step),
                vec![call("get_weather", r#"{"city":"Rome"}"#)],
                "slices of {step}"
            );
        }
        // Tagged calls are read as before.
        let tagged = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \
                      \"Oslo\"}}\n</tool_call>";
        assert_eq!(
            bare_parse(tagged, 3),
            vec![call("get_weather", r#"{"city":"Oslo"}"#)]
        );
    }

    #[test]
    fn json_that_is_not_one_whole_valid_call_stays_text() {
        for reply in [
            // Text around the object.
            "Here: {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
            "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}} done",
            "```json\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n``` done",
            "```python\nprint(1)\n```",
            // No offered tool named.
            "{\"name\": \"get_time\", \"arguments\": {}}",
            // Arguments that fail the schema.
            "{\"name\": \"get_weather\", \"arguments\": {\"town\": \"Paris\"}}",
            // Other JSON, and a reply cut inside the object.
            "{\"city\": \"Paris\"}",
            "{\"name\": \"get_weather\", \"arguments\": {\"ci",
        ] {
            for step in [1, 4, reply.len()] {
                assert_eq!(
                    bare_parse(reply, step),
                    vec![Piece::Text(reply.into())],
                    "{reply} in slices of {step}"
                );
            }
        }
    }

    #[test]
    fn text_that_cannot_be_a_bare_call_is_not_held() {
        let bare = BareCalls::new(vec!["get_weather".into()], |_, _| true);
        let mut p = ToolCallParser::new(ToolFormat::Hermes, "").with_bare_calls(bare);
        assert_eq!(p.push("{\"na"), Vec::new());
        assert_eq!(
            p.push("me\": \"other"),
            vec![Piece::Text("{\"name\": \"other".into())]
        );
    }

    #[test]
    fn templates_name_their_markup() {
        assert_eq!(
            ToolFormat::of_template("{% if tools %}<tool_call>{% endif %}"),
            Some(ToolFormat::Hermes)
        );
        assert_eq!(ToolFormat::of_template("{{ messages }}"), None);
    }
}
