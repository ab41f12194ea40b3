//! Constrained decoding: a request's grammar (a JSON schema, any JSON object, a regex or a Lark
//! grammar) compiled by llguidance against the model's vocabulary, and the per-sequence state
//! that says, before each token, which tokens may come next.
//!
//! llguidance is the grammar engine vLLM, SGLang and llama.cpp use: it computes a token mask
//! from a trie of the vocabulary in tens to hundreds of microseconds, compiles JSON schemas
//! itself, and needs no Python. The vocabulary's trie and the factory are built once per model,
//! on the first constrained request.

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};

use crate::error::{Error, Result};
use tandem_tokenizer::Tokenizer;

/// What a request's output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// A JSON schema (the schema's JSON text).
    JsonSchema(String),
    /// Any JSON object.
    JsonObject,
    /// A regular expression the whole output matches.
    Regex(String),
    /// A Lark grammar (llguidance's dialect).
    Lark(String),
    /// The router's hold on a reply that may call tools: a Lark grammar that is free until a
    /// call starts. One that does not compile (a tool schema llguidance cannot hold) leaves
    /// the reply unconstrained rather than failing the request.
    ToolCalls(String),
}

/// The model's grammar compiler, built on first use.
#[derive(Default)]
pub struct Grammars {
    factory: OnceLock<std::result::Result<ParserFactory, String>>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("built", &self.factory.get().is_some())
            .finish()
    }
}

impl Grammars {
    /// Compiles `grammar` for a sequence of this model: `None` for a tool-call hold that does
    /// not compile.
    pub(crate) fn compile(
        &self,
        grammar: &Grammar,
        tokenizer: &Tokenizer,
    ) -> Result<Option<Constraint>> {
        match (self.compile_strict(grammar, tokenizer), grammar) {
            (Err(e), Grammar::ToolCalls(_)) => {
                tracing::warn!(error = %e, "the tool calls' hold does not compile; the reply runs free");
                Ok(None)
            }
            (result, _) => result.map(Some),
        }
    }

    fn compile_strict(&self, grammar: &Grammar, tokenizer: &Tokenizer) -> Result<Constraint> {
        let invalid = |reason: String| Error::InvalidArgument {
            field: "grammar",
            reason,
        };
        let factory = self
            .factory
            .get_or_init(|| factory(tokenizer))
            .as_ref()
            .map_err(|e| invalid(format!("the vocabulary's grammar engine failed: {e}")))?;
        let top = match grammar {
            Grammar::JsonSchema(text) => {
                let schema: serde_json::Value = serde_json::from_str(text)
                    .map_err(|e| invalid(format!("the JSON schema is not JSON: {e}")))?;
                TopLevelGrammar::from_json_schema(schema)
            }
            Grammar::JsonObject => {
                TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"}))
            }
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Grammar::Lark(lark) | Grammar::ToolCalls(lark) => {
                TopLevelGrammar::from_lark(lark.clone())
            }
        };
        let parser = factory
            .create_parser(top)
            .map_err(|e| invalid(format!("cannot compile: {e}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(invalid(format!("cannot compile: {e}")));
        }
        Ok(Constraint {
            matcher,
            eog: tokenizer.eog_ids().to_vec(),
        })
    }
}

/// The trie of the vocabulary: each token's bytes, and a control token's text after
/// llguidance's special-token marker (so a grammar never produces it as text).
fn factory(tokenizer: &Tokenizer) -> std::result::Result<ParserFactory, String> {
    let words: Vec<Vec<u8>> = (0..tokenizer.vocab_size() as u32)
        .map(|id| match tokenizer.token_bytes(id) {
            [] => {
                let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                w.extend(tokenizer.token_text(id).as_bytes());
                w
            }
            bytes => bytes.to_vec(),
        })
        .collect();
    let eos = tokenizer.eog_ids().first().copied().unwrap_or(0);
    let info = TokRxInfo::new(words.len() as u32, eos);
    let env = Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)));
    ParserFactory::new_simple(&(env as toktrie::TokEnv)).map_err(|e| e.to_string())
}

/// One sequence's position in its grammar.
pub struct Constraint {
    matcher: Matcher,
    /// Every end-of-generation id: allowed exactly when the grammar may end.
    eog: Vec<u32>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Constraint {
    /// Sets every logit the grammar forbids next to -inf. End-of-generation ids are allowed
    /// where the grammar may end, and are all that is left once it has ended (or failed).
    pub(crate) fn mask(&mut self, logits: &mut [f32]) {
        let mask = if self.matcher.is_stopped() {
            None
        } else {
            self.matcher.compute_mask().ok()
        };
        // The end-of-generation ids' logits, kept where the grammar may end.
        let ends: Vec<(usize, f32)> = match &mask {
            Some(m) if self.eog.iter().any(|&e| m.is_allowed(e)) => self.eog.iter(),
            Some(_) => [].iter(),
            None => self.eog.iter(),
        }
        .filter_map(|&e| logits.get(e as usize).map(|&l| (e as usize, l)))
        .collect();
        for (id, l) in logits.iter_mut().enumerate() {
            if !mask
                .as_ref()
                .is_some_and(|m| id < m.len() && m.is_allowed(id as u32))
            {
                *l = f32::NEG_INFINITY;
            }
        }
        for &(id, l) in &ends {
            logits[id] = l;
        }
    }

    /// Whether the grammar has ended: only an end-of-generation id may follow.
    pub(crate) fn ended(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// Advances past `token`. A token the grammar forbids (only a resumed one can be) leaves
    /// the grammar failed, which ends the generation at its next token.
    pub(crate) fn accept(&mut self, token: u32) {
        if let Err(e) = self.matcher.consume_token(token) {
            tracing::warn!(token, error = %e, "a token outside the grammar");
        }
    }
}
