//! Tokenizer and chat template, built from a [`TokenizerSpec`] (the `tokenizer.ggml.*` metadata of
//! a GGUF file, which the engine reads). This crate links no tensor library, so the router can
//! tokenize and render chat templates without candle; workers hand it the spec over gRPC.
//!
//! Byte-level BPE encodes through the HF `tokenizers` crate (with the pure-Rust regex engine),
//! assembled from the vocabulary, the merges, and the token types, where control and
//! user-defined tokens become special tokens so `<|im_start|>` is one id. SentencePiece models
//! (a vocabulary with scores) encode through [`spm`], with the same special tokens split off
//! first. Decoding goes through
//! a precomputed token → bytes table, because streaming needs bytes: [`TokenDecoder`] emits text
//! only up to the last complete UTF-8 character.

use std::collections::HashMap;

use serde::Serialize;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

mod cache;
mod chat;
mod error;
mod pieces;
mod reasoning;
mod spm;
mod tools;

use pieces::Pieces;

pub use cache::EncodeCache;
pub use chat::{ChatMessage, FunctionCall, ToolCall};
pub use error::{Error, Result};
pub use reasoning::{ReasoningParser, Thought};
pub use tools::{
    Arguments, BareCalls, CallGrammar, Piece, ToolCallParser, ToolFormat, quoted_lark,
    regex_grammar,
};

/// GGUF token types (llama.cpp's `llama_token_type`).
pub const TOKEN_TYPE_CONTROL: i32 = 3;
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;
pub const TOKEN_TYPE_BYTE: i32 = 6;

/// Texts of control tokens that end a generation (llama.cpp's end-of-generation detection,
/// which includes the fill-in-the-middle repository/padding markers).
const EOG_TEXTS: &[&str] = &[
    "<|endoftext|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<end_of_turn>",
    "<|end|>",
    "<EOT>",
    "<|end_of_text|>",
    "<|fim_pad|>",
    "<fim-pad>",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
    "<|file_sep|>",
];

/// The pre-tokenizer split of Qwen2's tokenizer (its `tokenizer.json`, which llama.cpp's
/// `LLAMA_VOCAB_PRE_TYPE_QWEN2` mirrors).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer split of Llama 3's tokenizer (llama.cpp's `LLAMA_VOCAB_PRE_TYPE_LLAMA3`):
/// Qwen2's with numbers in runs of up to three digits.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// What the tokenizer is built from (read from GGUF metadata, or made by the tiny model). It is
/// plain data and serializes to JSON, which is how workers hand it to the router.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct TokenizerSpec {
    #[serde(default)]
    pub kind: TokenizerKind,
    pub pre: String,
    pub tokens: Vec<String>,
    /// Per token, its SentencePiece score (empty for byte-level BPE).
    #[serde(default)]
    pub scores: Vec<f32>,
    /// SentencePiece: whether a word boundary is put before the text.
    #[serde(default)]
    pub add_space_prefix: bool,
    pub token_types: Vec<i32>,
    pub merges: Vec<(String, String)>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub eot_id: Option<u32>,
    pub add_bos: bool,
    pub chat_template: Option<String>,
}

/// The tokenizer model a file names (`tokenizer.ggml.model`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub enum TokenizerKind {
    /// `gpt2`: byte-level BPE with merges.
    #[default]
    BytePairs,
    /// `llama`: SentencePiece, a vocabulary with scores and byte fallback.
    SentencePiece,
}

#[derive(Debug)]
enum Encoder {
    Bpe(Box<BpeEncoder>),
    Spm(Box<spm::Spm>),
}

#[derive(Debug)]
struct BpeEncoder {
    tokenizer: tokenizers::Tokenizer,
    /// Each token's text.
    texts: Pieces<String>,
    /// Each merge as its two tokens' ids, in order.
    merges: Vec<(u32, u32)>,
}

/// Text ↔ token ids for one model.
#[derive(Debug)]
pub struct Tokenizer {
    inner: Encoder,
    /// The special tokens' texts (control and user-defined), matched leftmost-longest, as both
    /// encoders split them off.
    specials: aho_corasick::AhoCorasick,
    /// The ids of [`Tokenizer::specials`]' patterns, by pattern.
    special_ids: Vec<u32>,
    /// The chat template, compiled; or why there is none.
    template: std::result::Result<chat::Template, String>,
    /// The bytes each id decodes to; empty for control tokens, which are not rendered.
    token_bytes: Pieces<Vec<u8>>,
    eog_ids: Vec<u32>,
    /// The spec's fields but its tables (tokens, scores and merges), which the encoder holds in
    /// a compact form; [`Tokenizer::spec`] puts them back.
    header: TokenizerSpec,
}

impl Tokenizer {
    pub fn new(mut spec: TokenizerSpec) -> Result<Self> {
        if spec.token_types.len() != spec.tokens.len() {
            return Err(Error::Build {
                reason: format!(
                    "{} token types for {} tokens",
                    spec.token_types.len(),
                    spec.tokens.len()
                ),
            });
        }
        let unicode_to_byte = byte_level_decode_table();
        let token_bytes = spec
            .tokens
            .iter()
            .zip(&spec.token_types)
            .map(|(tok, &ty)| match (ty, spec.kind) {
                (TOKEN_TYPE_CONTROL, _) => Vec::new(),
                (TOKEN_TYPE_USER_DEFINED, _) => tok.as_bytes().to_vec(),
                (TOKEN_TYPE_BYTE, TokenizerKind::SentencePiece) => {
                    let hex = tok.trim_start_matches("<0x").trim_end_matches('>');
                    u8::from_str_radix(hex, 16)
                        .map_or_else(|_| tok.as_bytes().to_vec(), |b| vec![b])
                }
                (_, TokenizerKind::SentencePiece) => tok.replace(spm::SPACE, " ").into_bytes(),
                (_, TokenizerKind::BytePairs) => tok
                    .chars()
                    .map(|c| unicode_to_byte.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .unwrap_or_else(|| tok.as_bytes().to_vec()),
            })
            .collect();
        let mut eog_ids: Vec<u32> = spec
            .tokens
            .iter()
            .zip(&spec.token_types)
            .enumerate()
            .filter(|(_, (s, t))| **t == TOKEN_TYPE_CONTROL && EOG_TEXTS.contains(&s.as_str()))
            .map(|(i, _)| i as u32)
            .chain(spec.eos_id)
            .chain(spec.eot_id)
            .collect();
        eog_ids.sort_unstable();
        eog_ids.dedup();
        let (special_ids, special_texts): (Vec<u32>, Vec<&str>) = specials(&spec).unzip();
        let specials = aho_corasick::AhoCorasick::builder()
            .match_kind(aho_corasick::MatchKind::LeftmostLongest)
            .build(&special_texts)
            .map_err(|e| Error::Build {
                reason: format!("special tokens: {e}"),
            })?;
        let inner = match spec.kind {
            TokenizerKind::BytePairs => byte_pairs(&mut spec)?,
            TokenizerKind::SentencePiece => sentence_piece(&mut spec)?,
        };
        let template = match &spec.chat_template {
            Some(source) => chat::Template::new(source.clone()),
            None => Err("the model has no tokenizer.chat_template".into()),
        };
        Ok(Self {
            inner,
            specials,
            special_ids,
            template,
            token_bytes,
            eog_ids,
            header: spec,
        })
    }

    /// The spec this tokenizer was built from (workers hand it to the router).
    pub fn spec(&self) -> TokenizerSpec {
        let (scores, merges) = match &self.inner {
            Encoder::Bpe(b) => {
                let text = |id: u32| b.texts.get(id as usize).unwrap_or_default().to_string();
                let merges = b.merges.iter().map(|&(l, r)| (text(l), text(r))).collect();
                (Vec::new(), merges)
            }
            Encoder::Spm(e) => (e.scores.clone(), Vec::new()),
        };
        TokenizerSpec {
            tokens: self.texts().iter().map(String::from).collect(),
            scores,
            merges,
            ..self.header.clone()
        }
    }

    fn texts(&self) -> &Pieces<String> {
        match &self.inner {
            Encoder::Bpe(b) => &b.texts,
            Encoder::Spm(e) => &e.texts,
        }
    }

    /// A token's text as the vocabulary spells it (for control tokens, which decode to no
    /// bytes, their name); empty for an unknown id.
    pub fn token_text(&self, id: u32) -> &str {
        self.texts().get(id as usize).unwrap_or_default()
    }

    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// The ids that end a generation (never emitted as output).
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog_ids
    }

    /// Tokenizes `text`, parsing special tokens; adds BOS only if the model asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self.first_ids(text);
        self.encode_span(text, true, &mut ids)?;
        Ok(ids)
    }

    /// [`Tokenizer::encode`], with the ids of each run of text between special tokens taken
    /// from `cache` where it holds them, and kept there where it does not (see [`EncodeCache`]
    /// for why the result is the same). A cache made to hold nothing is [`Tokenizer::encode`].
    pub fn encode_cached(&self, text: &str, cache: &EncodeCache) -> Result<Vec<u32>> {
        if cache.holds_nothing() {
            return self.encode(text);
        }
        let mut ids = self.first_ids(text);
        let mut at = 0;
        for m in self.specials.find_iter(text) {
            self.encode_run_cached(&text[at..m.start()], at == 0, cache, &mut ids)?;
            ids.push(self.special_ids[m.pattern().as_usize()]);
            at = m.end();
        }
        self.encode_run_cached(&text[at..], at == 0, cache, &mut ids)?;
        Ok(ids)
    }

    /// Appends the ids of `run` (text without special tokens), from `cache` or encoded and
    /// kept there.
    fn encode_run_cached(
        &self,
        run: &str,
        opens: bool,
        cache: &EncodeCache,
        ids: &mut Vec<u32>,
    ) -> Result<()> {
        if run.is_empty() {
            return Ok(());
        }
        match cache.get(run, opens) {
            Some(cached) => ids.extend_from_slice(&cached),
            None => {
                let at = ids.len();
                self.encode_span(run, opens, ids)?;
                cache.insert(run, opens, &ids[at..]);
            }
        }
        Ok(())
    }

    /// BOS if the model asks for it, in a vector sized for `text`'s ids; not a second one where
    /// `text` opens with it (a chat template that writes `bos_token` itself, as Llama 3's does:
    /// llama.cpp drops the rendered one instead, to the same ids).
    fn first_ids(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 2);
        if self.header.add_bos
            && let Some(bos) = self.header.bos_id
            && let bos_text = self.token_text(bos)
            && (bos_text.is_empty() || !text.starts_with(bos_text))
        {
            ids.push(bos);
        }
        ids
    }

    /// Appends the ids of `text`, special tokens parsed; `opens`: whether it starts the whole
    /// text (SentencePiece puts its word boundary there).
    fn encode_span(&self, text: &str, opens: bool, ids: &mut Vec<u32>) -> Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        match &self.inner {
            Encoder::Bpe(b) => {
                let enc = b.tokenizer.encode(text, false).map_err(|e| Error::Encode {
                    reason: e.to_string(),
                })?;
                ids.extend_from_slice(enc.get_ids());
            }
            Encoder::Spm(spm) => {
                let mut at = 0;
                for m in self.specials.find_iter(text) {
                    spm.encode(&text[at..m.start()], opens && at == 0, ids);
                    ids.push(self.special_ids[m.pattern().as_usize()]);
                    at = m.end();
                }
                spm.encode(&text[at..], opens && at == 0, ids);
            }
        }
        Ok(())
    }

    /// The bytes of one token (empty for control tokens and unknown ids).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.token_bytes.get(id as usize).unwrap_or_default()
    }

    /// Decodes a whole sequence (invalid UTF-8 is replaced).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&i| self.token_bytes(i).iter().copied())
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// The `tokenizers` BPE of a byte-level model, its pre-tokenizer chosen by `spec.pre`. Takes the
/// vocabulary and the merges out of `spec`.
fn byte_pairs(spec: &mut TokenizerSpec) -> Result<Encoder> {
    let err = |reason: String| Error::Build { reason };
    let special: Vec<AddedToken> = specials(spec)
        .map(|(_, s)| AddedToken::from(s.to_string(), true))
        .collect();
    let texts: Pieces<String> = spec.tokens.iter().collect();
    let vocab: tokenizers::models::bpe::Vocab = std::mem::take(&mut spec.tokens)
        .into_iter()
        .zip(0..)
        .collect();
    let merges = std::mem::take(&mut spec.merges);
    let merge_ids = merges
        .iter()
        .map(|(l, r)| match (vocab.get(l), vocab.get(r)) {
            (Some(&l), Some(&r)) => Ok((l, r)),
            _ => Err(err(format!(
                "the merge {l:?} {r:?} is of tokens not in the vocabulary"
            ))),
        })
        .collect::<Result<Vec<_>>>()?;
    // Llama 3 looks a whole piece up before merging it (llama.cpp's `ignore_merges`, set for
    // its pre-tokenizer alone).
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(spec.pre == "llama-bpe")
        .build()
        .map_err(|e| err(format!("building BPE: {e}")))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let byte_level = ByteLevel::new(false, false, true);
    let pre: PreTokenizerWrapper = match spec.pre.as_str() {
        // llama.cpp's "smollm" pre-tokenizer splits every digit, then applies GPT-2's regex.
        "smollm" | "starcoder" | "refact" => {
            Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
        }
        "default" | "gpt2" | "gpt-2" => byte_level.into(),
        // llama.cpp's "qwen2" and "llama-bpe" splits (llama-vocab.cpp): GPT-4's regex with
        // one digit, or up to three, per piece, then the byte-level mapping alone.
        pre @ ("qwen2" | "llama-bpe") => {
            let pattern = match pre {
                "qwen2" => QWEN2_SPLIT,
                _ => LLAMA3_SPLIT,
            };
            let split = Split::new(
                SplitPattern::Regex(pattern.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| err(format!("the {pre} split pattern: {e}")))?;
            let bytes = ByteLevel::new(false, false, false);
            Sequence::new(vec![split.into(), bytes.into()]).into()
        }
        other => {
            return Err(err(format!("pre-tokenizer {other:?} is not supported")));
        }
    };
    inner.with_pre_tokenizer(Some(pre));
    inner
        .add_special_tokens(special)
        .map_err(|e| err(format!("adding special tokens: {e}")))?;
    Ok(Encoder::Bpe(Box::new(BpeEncoder {
        tokenizer: inner,
        texts,
        merges: merge_ids,
    })))
}

/// The SentencePiece encoder (the special tokens are split off before it). Takes the vocabulary
/// and the scores out of `spec`.
fn sentence_piece(spec: &mut TokenizerSpec) -> Result<Encoder> {
    if spec.scores.len() != spec.tokens.len() {
        return Err(Error::Build {
            reason: format!(
                "{} scores for {} tokens",
                spec.scores.len(),
                spec.tokens.len()
            ),
        });
    }
    let texts = std::mem::take(&mut spec.tokens).iter().collect();
    let spm = spm::Spm::new(
        texts,
        std::mem::take(&mut spec.scores),
        spec.add_space_prefix,
    );
    Ok(Encoder::Spm(Box::new(spm)))
}

/// The tokens a text spells as one id (control and user-defined ones), with their ids.
fn specials(spec: &TokenizerSpec) -> impl Iterator<Item = (u32, &str)> {
    spec.tokens
        .iter()
        .zip(&spec.token_types)
        .enumerate()
        .filter(|(_, (s, t))| {
            matches!(**t, TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED) && !s.is_empty()
        })
        .map(|(i, (s, _))| (i as u32, s.as_str()))
}

/// GPT-2's byte-level alphabet: the printable stand-in character of each byte, by byte.
/// (The `tokenizers` crate keeps its copy private, and this table is a few lines.)
pub fn byte_level_chars() -> Vec<char> {
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut next = 256;
    (0..256u32)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(c).unwrap_or(char::REPLACEMENT_CHARACTER)
        })
        .collect()
}

fn byte_level_decode_table() -> HashMap<char, u8> {
    byte_level_chars()
        .into_iter()
        .enumerate()
        .map(|(b, c)| (c, b as u8))
        .collect()
}

/// Streaming detokenizer: feeds token bytes in and hands out only complete UTF-8 text, so a
/// character split across tokens is never emitted half-done.
#[derive(Debug, Default)]
pub struct TokenDecoder {
    pending: Vec<u8>,
}

impl TokenDecoder {
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> String {
        self.pending.extend_from_slice(tokenizer.token_bytes(id));
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            // A sequence that can never become valid is replaced rather than held forever.
            Err(e) if e.error_len().is_some() => {
                let text = String::from_utf8_lossy(&self.pending).into_owned();
                self.pending.clear();
                return text;
            }
            Err(e) => e.valid_up_to(),
        };
        let rest = self.pending.split_off(valid);
        String::from_utf8(std::mem::replace(&mut self.pending, rest))
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
    }

    /// Whatever is still held back at the end of the stream (replaced if incomplete).
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(kind: TokenizerKind) -> TokenizerSpec {
        let tokens = ["a", "b", "ab", "<|im_end|>", "<0x41>"]
            .map(String::from)
            .to_vec();
        TokenizerSpec {
            kind,
            pre: "default".into(),
            scores: match kind {
                TokenizerKind::SentencePiece => vec![-1.0, -2.0, -0.5, 0.0, 0.0],
                TokenizerKind::BytePairs => Vec::new(),
            },
            add_space_prefix: false,
            token_types: vec![1, 1, 1, TOKEN_TYPE_CONTROL, TOKEN_TYPE_BYTE],
            merges: match kind {
                TokenizerKind::BytePairs => vec![("a".into(), "b".into())],
                TokenizerKind::SentencePiece => Vec::new(),
            },
            tokens,
            bos_id: None,
            eos_id: Some(3),
            eot_id: None,
            add_bos: false,
            chat_template: Some("{{ messages[0].content }}".into()),
        }
    }

    #[test]
    fn the_spec_comes_back_whole() {
        for kind in [TokenizerKind::BytePairs, TokenizerKind::SentencePiece] {
            let tokenizer = Tokenizer::new(spec(kind)).expect("builds");
            assert_eq!(tokenizer.spec(), spec(kind), "{kind:?}");
            assert_eq!(tokenizer.encode("ab<|im_end|>").expect("encodes"), [2, 3]);
            assert_eq!(tokenizer.token_text(3), "<|im_end|>");
            assert_eq!(tokenizer.token_bytes(3), b"");
            assert_eq!(tokenizer.token_text(9), "");
        }
    }

    #[test]
    fn a_merge_of_unknown_tokens_is_refused() {
        let mut bad = spec(TokenizerKind::BytePairs);
        bad.merges.push(("a".into(), "c".into()));
        let err = Tokenizer::new(bad).expect_err("refused");
        assert!(err.to_string().contains("\"c\""), "{err}");
        let mut bad = spec(TokenizerKind::SentencePiece);
        bad.token_types.pop();
        assert!(Tokenizer::new(bad).is_err());
    }
}
