//! The router's cached tokenization ([`Tokenizer::encode_cached`]) against tokenizing the whole
//! text ([`Tokenizer::encode`]) on the real models' tokenizers: byte-level BPE with Qwen2's and
//! SmolLM2's pre-tokenizers, and Gemma 3's SentencePiece. Two properties: random texts of
//! special tokens and text (spaces, newlines, digits, code, non-ASCII at the edges of runs)
//! through one cache shared by every case, and agent sessions rendered through the chat
//! template turn after turn, each turn's prompt extending the last.
//!
//! Needs the model files (`tandem model fetch NAME`); a test fails, saying so, without them.

use std::sync::{Arc, Mutex, OnceLock};

use proptest::prelude::*;
use tandem_engine::{ChatMessage, EncodeCache, Model, ModelSource, Tokenizer};

fn load(name: &str) -> Arc<Model> {
    ModelSource::parse(name, &tandem_engine::model_dir_from_env())
        .load()
        .unwrap_or_else(|e| panic!("this test needs {name} (tandem model fetch {name}): {e}"))
}

/// A model's tokenizer with one cache for all of a test's cases, so that later cases meet runs
/// that earlier ones left (and runs of the same bytes that opened, or did not open, a text).
struct Subject {
    model: Arc<Model>,
    cache: EncodeCache,
}

impl Subject {
    fn new(name: &'static str) -> Self {
        Self {
            model: model(name),
            cache: EncodeCache::new(1 << 20),
        }
    }

    fn tokenizer(&self) -> &Tokenizer {
        &self.model.tokenizer
    }

    /// The cache gave ids, and took some.
    fn was_used(&self) {
        let (hit, encoded) = self.cache.tokens();
        assert!(
            hit > 0 && encoded > 0,
            "the cache was used: {hit} {encoded}"
        );
    }

    /// The cached ids of `text` equal its whole encoding, and so do they on a second look
    /// (served from the cache).
    fn check(&self, text: &str) -> Result<(), TestCaseError> {
        let whole = self.tokenizer().encode(text).expect("encode");
        for _ in 0..2 {
            let cached = self
                .tokenizer()
                .encode_cached(text, &self.cache)
                .expect("encode");
            prop_assert_eq!(&cached, &whole, "text {:?}", text);
        }
        Ok(())
    }
}

/// The catalog model `name`, loaded once for all the tests that ask for it.
fn model(name: &'static str) -> Arc<Model> {
    type Loaded = Vec<(&'static str, Arc<Model>)>;
    static MODELS: OnceLock<Mutex<Loaded>> = OnceLock::new();
    let mut all = MODELS.get_or_init(Default::default).lock().expect("lock");
    if let Some((_, m)) = all.iter().find(|(n, _)| *n == name) {
        return m.clone();
    }
    let m = load(name);
    all.push((name, m.clone()));
    m
}

/// Pieces of text that stress a run's edges: whitespace the pre-tokenizers group with what
/// follows, digits split one by one, contractions, code and characters of several bytes.
const WORDS: &[&str] = &[
    " ",
    "  ",
    "\n",
    "\n\n",
    " \n ",
    "\t",
    "hello",
    " world",
    "Hello",
    "'s",
    "'re",
    "12345",
    " 42",
    "fn main() {",
    "    let x = vec![1, 2, 3];",
    "}",
    "{\"path\": \"src/lib.rs\"}",
    "é",
    "日本語",
    "🦀",
    "\u{2581}",
    "<",
    "|",
    ">",
    "im",
    "<tool_call>",
    "</tool_call>",
];

/// Text of up to `max` words, often longer than a cached run's minimum.
fn text(max: usize) -> impl Strategy<Value = String> {
    prop::collection::vec(prop::sample::select(WORDS), 0..max).prop_map(|w| w.concat())
}

/// Prose: words and single spaces only. Gemma 3's vocabulary makes newlines and runs of spaces
/// special tokens of their own, so its long runs between special tokens are lines of these.
fn prose(max: usize) -> impl Strategy<Value = String> {
    let words =
        prop::sample::select(&["the", "cache", "Tandem", "42", "é", "日本", "x,", "y."][..]);
    prop::collection::vec(words, 0..max).prop_map(|w| w.join(" "))
}

/// A text of runs and special tokens: runs short and long, specials adjacent, first and last.
fn mixed(specials: &'static [&'static str]) -> impl Strategy<Value = String> {
    let part = prop_oneof![
        3 => text(12),
        3 => text(120),
        2 => prose(120),
        2 => prop::sample::select(specials).prop_map(String::from),
    ];
    prop::collection::vec(part, 1..12).prop_map(|p| p.concat())
}

fn runs_and_specials_encode_alike(name: &'static str, specials: &'static [&'static str]) {
    let subject = Subject::new(name);
    let config = ProptestConfig {
        cases: 96,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    proptest!(config, |(t in mixed(specials))| subject.check(&t)?);
    subject.was_used();
}

/// An agent's session: a long system prompt, then turns of a user or tool message and the
/// assistant's reply, rendered with the model's template after each turn; every turn's prompt
/// is checked, so each meets the cache holding the turns before it.
fn sessions_encode_alike(name: &'static str) {
    let subject = Subject::new(name);
    let turn = (text(60), text(80), any::<bool>());
    let config = ProptestConfig {
        cases: 12,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    proptest!(config, |(system in text(400), turns in prop::collection::vec(turn, 1..8))| {
        let mut messages = vec![ChatMessage::new("system", system)];
        for (ask, reply, tool) in turns {
            messages.push(if tool {
                ChatMessage::tool_result("call_0", ask)
            } else {
                ChatMessage::new("user", ask)
            });
            let prompt = subject
                .tokenizer()
                .apply_chat_template(&messages, &[])
                .expect("render");
            subject.check(&prompt)?;
            messages.push(ChatMessage::new("assistant", reply));
        }
    });
    subject.was_used();
}

#[test]
fn qwen2_runs_and_specials_encode_alike() {
    runs_and_specials_encode_alike(
        "qwen2.5-coder-0.5b",
        &[
            "<|im_start|>",
            "<|im_end|>",
            "<|endoftext|>",
            "<|fim_prefix|>",
        ],
    );
}

#[test]
fn qwen2_sessions_encode_alike() {
    sessions_encode_alike("qwen2.5-coder-0.5b");
}

#[test]
fn smollm2_runs_and_specials_encode_alike() {
    runs_and_specials_encode_alike(
        "smollm2",
        &["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>"],
    );
}

#[test]
fn smollm2_sessions_encode_alike() {
    sessions_encode_alike("smollm2");
}

#[test]
fn gemma3_runs_and_specials_encode_alike() {
    runs_and_specials_encode_alike(
        "gemma-3-270m",
        &[
            "<start_of_turn>",
            "<end_of_turn>",
            "<bos>",
            "<eos>",
            "<pad>",
        ],
    );
}
