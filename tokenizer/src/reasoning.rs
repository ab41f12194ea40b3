//! The reasoning a reply opens with, split from its answer as the text arrives: Qwen3 thinks in a
//! `<think>…</think>` block before it answers (its template writes the block's tags; with
//! thinking switched off it writes an empty block into the prompt, and the reply is all answer).
//!
//! Only a block at the start of the reply is reasoning (leading whitespace aside), as vLLM's and
//! llama-server's Qwen3 parsers read it; the answer's leading newlines after `</think>` are the
//! block's formatting and are dropped. A reply that stops inside the block is all reasoning. So
//! the tool-call parser that reads the answer never sees the thinking.

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// A piece of a reply: reasoning, or the answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Thought {
    Reasoning(String),
    Answer(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet: the block may still open.
    Start,
    /// Just inside the block, where its leading newlines are dropped.
    Opened,
    Inside,
    /// After the block's close, where the answer's leading newlines are dropped.
    Closed,
    Answer,
}

/// Splits a reply into [`Thought`]s as its text arrives (see the module's doc).
#[derive(Debug)]
pub struct ReasoningParser {
    state: State,
    /// Text held back: leading whitespace, or what may be the start of a tag.
    held: String,
}

impl ReasoningParser {
    /// A parser for a reply whose prompt did (`inside`) or did not already open the block.
    pub fn new(inside: bool) -> Self {
        Self {
            state: if inside { State::Opened } else { State::Start },
            held: String::new(),
        }
    }

    /// The thoughts `text` completes.
    pub fn push(&mut self, text: &str) -> Vec<Thought> {
        let mut out = Vec::new();
        self.held.push_str(text);
        loop {
            match self.state {
                State::Start => {
                    let trimmed = self.held.trim_start();
                    if let Some(rest) = trimmed.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.state = State::Opened;
                    } else if OPEN.starts_with(trimmed) {
                        return out;
                    } else {
                        self.state = State::Answer;
                    }
                }
                State::Opened => match self.drop_newlines() {
                    true => self.state = State::Inside,
                    false => return out,
                },
                State::Inside => match self.held.find(CLOSE) {
                    Some(at) => {
                        let reasoning = self.held[..at].trim_end_matches('\n').to_string();
                        self.held.drain(..at + CLOSE.len());
                        if !reasoning.is_empty() {
                            out.push(Thought::Reasoning(reasoning));
                        }
                        self.state = State::Closed;
                    }
                    None => {
                        // Keep what may begin the closing tag, and trailing newlines (the
                        // block's own, if it closes next).
                        let keep = partial_tag(&self.held, CLOSE);
                        let keep = self.held[..self.held.len() - keep]
                            .trim_end_matches('\n')
                            .len();
                        if keep > 0 {
                            out.push(Thought::Reasoning(self.held[..keep].to_string()));
                            self.held.drain(..keep);
                        }
                        return out;
                    }
                },
                State::Closed => match self.drop_newlines() {
                    true => self.state = State::Answer,
                    false => return out,
                },
                State::Answer => {
                    if !self.held.is_empty() {
                        out.push(Thought::Answer(std::mem::take(&mut self.held)));
                    }
                    return out;
                }
            }
        }
    }

    /// Drops the held text's leading newlines; whether anything else is held.
    fn drop_newlines(&mut self) -> bool {
        let newlines = self.held.len() - self.held.trim_start_matches(['\n', '\r']).len();
        self.held.drain(..newlines);
        !self.held.is_empty()
    }

    /// The thoughts still held when the reply ends.
    pub fn finish(mut self) -> Vec<Thought> {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Opened | State::Inside => {
                let held = held.trim_end_matches('\n');
                (!held.is_empty())
                    .then(|| Thought::Reasoning(held.to_string()))
                    .into_iter()
                    .collect()
            }
            State::Start | State::Answer if !held.is_empty() => vec![Thought::Answer(held)],
            _ => Vec::new(),
        }
    }
}

/// The length of the longest suffix of `text` that begins `tag` (a tag that may be arriving).
fn partial_tag(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reply fed a character at a time, its thoughts merged by kind.
    fn split(inside: bool, reply: &str) -> Vec<Thought> {
        let mut p = ReasoningParser::new(inside);
        let mut out: Vec<Thought> = Vec::new();
        let mut push = |t: Thought| match (out.last_mut(), t) {
            (Some(Thought::Reasoning(a)), Thought::Reasoning(b)) => a.push_str(&b),
            (Some(Thought::Answer(a)), Thought::Answer(b)) => a.push_str(&b),
            (_, t) => out.push(t),
        };
        for c in reply.chars() {
            p.push(&c.to_string()).into_iter().for_each(&mut push);
        }
        p.finish().into_iter().for_each(&mut push);
        out
    }

    fn r(s: &str) -> Thought {
        Thought::Reasoning(s.into())
    }

    fn a(s: &str) -> Thought {
        Thought::Answer(s.into())
    }

    #[test]
    fn a_block_at_the_start_is_reasoning_and_the_rest_the_answer() {
        let reply = "<think>\nAdd them: 4.\n</think>\n\nIt is 4. </think> stays";
        assert_eq!(
            split(false, reply),
            [r("Add them: 4."), a("It is 4. </think> stays")]
        );
        // Whole, in one push, the same.
        let mut p = ReasoningParser::new(false);
        let mut all = p.push(reply);
        all.extend(p.finish());
        assert_eq!(all, [r("Add them: 4."), a("It is 4. </think> stays")]);
    }

    #[test]
    fn a_reply_without_a_block_is_all_answer() {
        assert_eq!(
            split(false, "Hello <think>x</think>"),
            [a("Hello <think>x</think>")]
        );
        assert_eq!(split(false, "<thi"), [a("<thi")]);
        assert_eq!(split(false, "  \nHi"), [a("  \nHi")]);
    }

    #[test]
    fn an_empty_block_yields_only_the_answer() {
        assert_eq!(split(false, "<think>\n\n</think>\n\nDone."), [a("Done.")]);
    }

    #[test]
    fn a_reply_that_stops_thinking_is_all_reasoning() {
        assert_eq!(
            split(false, "<think>\nStill going</thi"),
            [r("Still going</thi")]
        );
    }

    #[test]
    fn a_prompt_that_opened_the_block_starts_inside_it() {
        assert_eq!(
            split(true, "Plan.\n</think>\n\n<tool_call>"),
            [r("Plan."), a("<tool_call>")]
        );
    }
}
