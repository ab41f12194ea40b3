//! A Lark grammar's language as it is written inside a JSON string: a custom tool's input
//! travels as the string `input` of its call's arguments, so the grammar that holds the call
//! must take each character of the input in its JSON-escaped form.
//!
//! Every terminal of the grammar (string literals, ranges, regexes and the `common` terminals
//! it imports) is rewritten to the regex of its escaped text; the rules are left as they are.
//! Escaping is a character-by-character map, so the language of the rewritten grammar is the
//! escaped form of the original's. llguidance quotes single regexes for its own JSON schemas,
//! but offers no way to quote a whole Lark grammar; regex-syntax does the parsing and printing.
//! Each character takes one spelling: `\"`, `\\`, `\b`, `\f`, `\n`, `\r`, `\t`, other control
//! characters as `\u00XX`, everything else as itself.

use regex_syntax::hir::{Class, ClassUnicode, ClassUnicodeRange, Hir, HirKind, Repetition};

/// Rewrites `grammar` (llguidance's Lark dialect) to match the JSON-escaped form of its
/// language. The error says, in plain words, what in the grammar cannot be rewritten.
pub fn quoted_lark(grammar: &str) -> Result<String, String> {
    let mut out = String::with_capacity(grammar.len() * 2);
    let mut rest = grammar;
    while let Some(c) = rest.chars().next() {
        if c == '#' || rest.starts_with("//") {
            let end = rest.find('\n').unwrap_or(rest.len());
            out.push_str(&rest[..end]);
            rest = &rest[end..];
        } else if c == '"' {
            let (first, after) = string_token(rest)?;
            let spaced = after.trim_start_matches([' ', '\t']);
            let regex = match spaced.strip_prefix("..") {
                Some(range) => {
                    let (last, after) = string_token(range.trim_start_matches([' ', '\t']))?;
                    rest = after;
                    range_regex(&first, &last)?
                }
                None => {
                    rest = after;
                    first.regex()
                }
            };
            out.push_str(&lark_regex(&regex)?);
        } else if c == '/' {
            let (regex, after) = regex_token(rest)?;
            rest = after;
            out.push_str(&lark_regex(&regex)?);
        } else if let Some(after) = rest.strip_prefix("%import") {
            let end = after.find('\n').unwrap_or(after.len());
            out.push_str(&imported(&after[..end])?);
            rest = &after[end..];
        } else if let Some(directive) = ["%json", "%regex", "%lark", "%llguidance"]
            .into_iter()
            .find(|d| rest.starts_with(d))
        {
            return Err(format!(
                "{directive} is not served inside a custom tool's grammar"
            ));
        } else if c == '<' || c == '@' {
            return Err(
                "special tokens (<...>) and grammar references (@...) are not served inside a \
                 custom tool's grammar"
                    .into(),
            );
        } else {
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    Ok(out)
}

/// The Lark grammar of a regex the whole text matches (a custom tool's `regex` format).
pub fn regex_grammar(regex: &str) -> String {
    let mut lark = String::from("start: /");
    let mut escaped = false;
    for c in regex.chars() {
        if c == '/' && !escaped {
            lark.push('\\');
        }
        escaped = c == '\\' && !escaped;
        lark.push(c);
    }
    lark.push('/');
    lark
}

/// A string literal of the grammar: its text, and whether it matches case-insensitively.
struct Literal {
    text: String,
    insensitive: bool,
}

impl Literal {
    fn regex(&self) -> String {
        let flags = if self.insensitive { "(?i)" } else { "" };
        format!("{flags}{}", regex_syntax::escape(&self.text))
    }
}

/// Reads the string literal `rest` starts with (JSON's escapes, and `\xHH`, then an optional
/// `i`); returns it and what follows.
fn string_token(rest: &str) -> Result<(Literal, &str), String> {
    let body = rest
        .strip_prefix('"')
        .ok_or("a range must end with a string")?;
    let end = closing(body, '"').ok_or("a string literal is not closed")?;
    // `\xHH`, which Lark's strings allow, is JSON's `\u00HH`.
    let mut json = String::with_capacity(end + 8);
    let mut chars = body[..end].chars();
    while let Some(c) = chars.next() {
        json.push(c);
        if c == '\\' {
            match chars.next() {
                Some('x') => json.push_str("u00"),
                Some(next) => json.push(next),
                None => {}
            }
        }
    }
    let text: String = serde_json::from_str(&format!("\"{json}\""))
        .map_err(|e| format!("the string literal \"{}\" does not read: {e}", &body[..end]))?;
    let after = &body[end + 1..];
    Ok(match after.strip_prefix('i') {
        Some(after) => (
            Literal {
                text,
                insensitive: true,
            },
            after,
        ),
        None => (
            Literal {
                text,
                insensitive: false,
            },
            after,
        ),
    })
}

/// Where `body` (a literal's text after its opening delimiter) has its closing `delimiter`: the
/// first one no backslash escapes.
fn closing(body: &str, delimiter: char) -> Option<usize> {
    let mut escaped = false;
    body.char_indices()
        .find(|&(_, c)| {
            let closes = c == delimiter && !escaped;
            escaped = c == '\\' && !escaped;
            closes
        })
        .map(|(i, _)| i)
}

/// The regex of a range `"a".."z"`: one character from the first to the last.
fn range_regex(first: &Literal, last: &Literal) -> Result<String, String> {
    let one = |l: &Literal| {
        let mut chars = l.text.chars();
        match (chars.next(), chars.next(), l.insensitive) {
            (Some(c), None, false) => Ok(c),
            _ => Err("a range's ends are single characters".to_string()),
        }
    };
    let (a, b) = (one(first)?, one(last)?);
    if a > b {
        return Err(format!("the range {a:?}..{b:?} runs backwards"));
    }
    Ok(
        Hir::class(Class::Unicode(ClassUnicode::new([ClassUnicodeRange::new(
            a, b,
        )])))
        .to_string(),
    )
}

/// Reads the regex literal `rest` starts with (`/.../flags`); returns it with its flags inline,
/// and what follows.
fn regex_token(rest: &str) -> Result<(String, &str), String> {
    let body = &rest[1..];
    let end = closing(body, '/').ok_or("a regex is not closed")?;
    let after = &body[end + 1..];
    let flags_end = after
        .find(|c: char| !"imslux".contains(c))
        .unwrap_or(after.len());
    let flags = &after[..flags_end];
    if flags.contains('l') {
        return Err("the regex flag l is not served".into());
    }
    let regex = match flags {
        "" => body[..end].to_string(),
        flags => format!("(?{flags}){}", &body[..end]),
    };
    Ok((regex, &after[flags_end..]))
}

/// The terminals an `%import common...` line names, each defined by its escaped regex.
fn imported(spec: &str) -> Result<String, String> {
    let unserved = || format!("%import{spec}: only Lark's common terminals can be imported");
    let names = spec
        .trim()
        .strip_prefix("common")
        .ok_or_else(unserved)?
        .trim();
    // `common.NAME`, `common.NAME -> ALIAS`, or `common (NAME, NAME...)`.
    let pairs: Vec<(&str, &str)> = if let Some(one) = names.strip_prefix('.') {
        match one.split_once("->") {
            Some((name, alias)) => vec![(name.trim(), alias.trim())],
            None => vec![(one.trim(), one.trim())],
        }
    } else if let Some(list) = names.strip_prefix('(').and_then(|l| l.strip_suffix(')')) {
        list.split(',').map(|n| (n.trim(), n.trim())).collect()
    } else {
        return Err(unserved());
    };
    let mut out = String::new();
    for (name, alias) in pairs {
        let regex = COMMON
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, r)| *r)
            .ok_or_else(|| format!("common.{name} is not one of Lark's common terminals"))?;
        out.push_str(&format!("{alias}: {}\n", lark_regex(regex)?));
    }
    Ok(out)
}

/// Lark's common terminals (its grammars/common.lark), as regexes.
const COMMON: &[(&str, &str)] = &[
    ("DIGIT", r"[0-9]"),
    ("HEXDIGIT", r"[a-fA-F0-9]"),
    ("INT", r"[0-9]+"),
    ("SIGNED_INT", r"[+-]?[0-9]+"),
    ("DECIMAL", r"[0-9]+\.[0-9]*|\.[0-9]+"),
    ("_EXP", r"[eE][+-]?[0-9]+"),
    (
        "FLOAT",
        r"[0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?",
    ),
    (
        "SIGNED_FLOAT",
        r"[+-]?([0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?)",
    ),
    (
        "NUMBER",
        r"[0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+",
    ),
    (
        "SIGNED_NUMBER",
        r"[+-]?([0-9]+[eE][+-]?[0-9]+|([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+)",
    ),
    ("ESCAPED_STRING", r#""([^"\\]|\\.)*""#),
    ("LCASE_LETTER", r"[a-z]"),
    ("UCASE_LETTER", r"[A-Z]"),
    ("LETTER", r"[A-Za-z]"),
    ("WORD", r"[A-Za-z]+"),
    ("CNAME", r"[_A-Za-z][_A-Za-z0-9]*"),
    ("WS_INLINE", r"[ \t]+"),
    ("WS", r"[ \t\f\r\n]+"),
    ("CR", r"\r"),
    ("LF", r"\n"),
    ("NEWLINE", r"(\r?\n)+"),
    ("SH_COMMENT", r"#[^\n]*"),
    ("CPP_COMMENT", r"//[^\n]*"),
    ("C_COMMENT", r"/\*[^*]*\*+([^/*][^*]*\*+)*/"),
    ("SQL_COMMENT", r"--[^\n]*"),
];

/// The Lark regex literal of `regex`'s escaped language.
fn lark_regex(regex: &str) -> Result<String, String> {
    let hir = regex_syntax::ParserBuilder::new()
        .build()
        .parse(regex)
        .map_err(|e| format!("the regex /{regex}/ does not parse: {e}"))?;
    let printed = escaped(&hir)?.to_string();
    // The printer writes `/` bare (it is not special to a regex); a Lark literal needs it
    // escaped, which regex-syntax reads back as `/`.
    Ok(format!("/{}/", printed.replace('/', "\\/")))
}

/// The regex of the escaped forms of what `hir` matches.
fn escaped(hir: &Hir) -> Result<Hir, String> {
    Ok(match hir.kind() {
        HirKind::Empty | HirKind::Look(_) => hir.clone(),
        HirKind::Literal(lit) => {
            let text = std::str::from_utf8(&lit.0)
                .map_err(|_| "a regex that matches bytes outside UTF-8 is not served")?;
            let mut bytes = Vec::with_capacity(text.len());
            for c in text.chars() {
                match escape(c) {
                    Some(e) => bytes.extend(e.as_bytes()),
                    None => bytes.extend(c.encode_utf8(&mut [0; 4]).as_bytes()),
                }
            }
            Hir::literal(bytes)
        }
        HirKind::Class(Class::Unicode(class)) => {
            let mut special = ClassUnicode::new([
                ClassUnicodeRange::new('\0', '\u{1f}'),
                ClassUnicodeRange::new('"', '"'),
                ClassUnicodeRange::new('\\', '\\'),
            ]);
            special.intersect(class);
            let mut plain = class.clone();
            plain.difference(&special);
            let mut alternatives = vec![Hir::class(Class::Unicode(plain))];
            for range in special.iter() {
                for c in range.start()..=range.end() {
                    let e = escape(c).expect("a special character has an escape");
                    alternatives.push(Hir::literal(e.into_bytes()));
                }
            }
            Hir::alternation(alternatives)
        }
        HirKind::Class(Class::Bytes(_)) => {
            return Err("a regex that matches bytes outside UTF-8 is not served".into());
        }
        HirKind::Repetition(r) => Hir::repetition(Repetition {
            sub: Box::new(escaped(&r.sub)?),
            ..r.clone()
        }),
        HirKind::Capture(c) => escaped(&c.sub)?,
        HirKind::Concat(subs) => Hir::concat(subs.iter().map(escaped).collect::<Result<_, _>>()?),
        HirKind::Alternation(subs) => {
            Hir::alternation(subs.iter().map(escaped).collect::<Result<_, _>>()?)
        }
    })
}

/// A character's escape inside a JSON string, if it needs one.
fn escape(c: char) -> Option<String> {
    Some(match c {
        '"' => "\\\"".into(),
        '\\' => "\\\\".into(),
        '\u{8}' => "\\b".into(),
        '\u{c}' => "\\f".into(),
        '\n' => "\\n".into(),
        '\r' => "\\r".into(),
        '\t' => "\\t".into(),
        c if c < ' ' => format!("\\u{:04x}", c as u32),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole-match regex of a rewritten Lark regex literal.
    fn compiled(lark: &str) -> regex::Regex {
        let inner = lark
            .strip_prefix('/')
            .and_then(|l| l.strip_suffix('/'))
            .expect("a regex literal")
            .replace("\\/", "/");
        regex::Regex::new(&format!("^(?:{inner})$")).expect("the rewrite compiles")
    }

    /// A text's body inside a JSON string, as serde_json writes it.
    fn json_body(text: &str) -> String {
        let quoted = serde_json::to_string(text).expect("a string");
        quoted[1..quoted.len() - 1].to_string()
    }

    #[test]
    fn a_rewritten_regex_matches_exactly_the_escaped_texts() {
        let cases: &[(&str, &[&str], &[&str])] = &[
            (
                r#"[^"]+"#,
                &["plain", "tab\there", "back\\slash", "line\nbreak", "\u{1}"],
                &["a\"b"],
            ),
            (r"(.+)", &["say \"hi\"", "a\\b", "\t"], &["two\nlines"]),
            (r"[a-z]+", &["abc"], &["ABC", "a\"b"]),
            (
                r#"\*\*\* Begin Patch\n"#,
                &["*** Begin Patch\n"],
                &["*** Begin Patch"],
            ),
            (r"(?s:.*)", &["anything\n\"at\\all\"\u{7}"], &[]),
        ];
        for (regex, matched, unmatched) in cases {
            let rewritten = compiled(&lark_regex(regex).expect("rewrites"));
            let original = regex::Regex::new(&format!("^(?:{regex})$")).expect("regex");
            for text in *matched {
                assert!(original.is_match(text), "{regex} on {text:?}");
                assert!(
                    rewritten.is_match(&json_body(text)),
                    "{regex}: {:?} from {rewritten}",
                    json_body(text)
                );
                // A bare quote or control character never passes unescaped.
                if text.contains(['"', '\t', '\n', '\u{1}']) {
                    assert!(!rewritten.is_match(text), "{regex} on raw {text:?}");
                }
            }
            for text in *unmatched {
                assert!(!original.is_match(text), "{regex} on {text:?}");
                assert!(!rewritten.is_match(&json_body(text)), "{regex} on {text:?}");
            }
        }
    }

    #[test]
    fn every_terminal_of_a_grammar_is_rewritten_and_its_rules_kept() {
        let grammar = r#"start: begin_patch hunk+ end_patch   // a comment with "quotes"
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: "*** Add File: " filename LF add_line+
filename: /(.+)/
add_line: "+" /(.+)/ LF -> line
QUOTE: "\""i
PRINTABLE: " ".."~"
%import common.LF
%import common (WS, INT)
%ignore WS
"#;
        let out = quoted_lark(grammar).expect("rewrites");
        assert!(out.contains("start: begin_patch hunk+ end_patch"), "{out}");
        assert!(out.contains("// a comment with \"quotes\""), "{out}");
        assert!(out.contains("add_line: /\\+/ /"), "{out}");
        assert!(out.contains("-> line"), "{out}");
        assert!(out.contains("%ignore WS"), "{out}");
        assert!(!out.contains("%import"), "{out}");
        let line = |name: &str| {
            let start = out.find(&format!("{name}: /")).expect(name) + name.len() + 2;
            let end = out[start..].find('\n').map_or(out.len(), |e| start + e);
            compiled(&out[start..end])
        };
        assert!(line("LF").is_match("\\n") && !line("LF").is_match("\n"));
        assert!(line("QUOTE").is_match("\\\""));
        assert!(line("PRINTABLE").is_match("\\\\") && line("PRINTABLE").is_match("a"));
        assert!(!line("PRINTABLE").is_match("\\t"));
        assert!(line("WS").is_match(" \\n\\t") && !line("WS").is_match("\n"));
        assert!(line("INT").is_match("42"));
    }

    #[test]
    fn hex_escapes_are_read_where_an_escape_starts() {
        let out = quoted_lark(r#"start: "\x41" "\\x41""#).expect("rewrites");
        // `A`, then a backslash (escaped in the JSON text, `\\`) and `x41`.
        assert_eq!(out, r"start: /A/ /(?:\\\\x41)/", "{out}");
    }

    #[test]
    fn a_regex_is_a_grammar_of_one_terminal() {
        assert_eq!(regex_grammar("[a-z]+"), "start: /[a-z]+/");
        assert_eq!(regex_grammar(r"a/b\/c"), r"start: /a\/b\/c/");
        let out = quoted_lark(&regex_grammar("a/b")).expect("rewrites");
        assert!(compiled(&out["start: ".len()..]).is_match("a/b"), "{out}");
    }

    #[test]
    fn what_cannot_be_rewritten_is_refused_in_words() {
        for (grammar, words) in [
            ("start: %json {\"type\": \"string\"}", "%json"),
            ("start: <|im_end|>", "special tokens"),
            ("start: @other", "grammar references"),
            ("start: \"open", "not closed"),
            ("start: /open", "not closed"),
            ("%import other.X", "only Lark's common terminals"),
            ("%import common.NOPE", "common.NOPE"),
            ("start: \"ab\"..\"c\"", "single characters"),
            ("start: \"z\"..\"a\"", "backwards"),
            ("start: /(/", "does not parse"),
        ] {
            let e = quoted_lark(grammar).expect_err(grammar);
            assert!(e.contains(words), "{grammar}: {e}");
        }
    }
}
