//! Reading a [`TokenizerSpec`] from GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`).
//! The tokenizer itself lives in `tandem-tokenizer`, which links no tensor library.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;
use tandem_tokenizer::{TokenizerKind, TokenizerSpec};

use crate::error::{Error, Result};

/// Reads `tokenizer.ggml.*` and `tokenizer.chat_template` from GGUF metadata.
pub(crate) fn spec_from_gguf(md: &HashMap<String, Value>) -> Result<TokenizerSpec> {
    let err = |reason: String| Error::Tokenizer { reason };
    let model = md_string(md, "tokenizer.ggml.model").unwrap_or_default();
    let kind = match model.as_str() {
        "gpt2" => TokenizerKind::BytePairs,
        "llama" => TokenizerKind::SentencePiece,
        _ => {
            return Err(err(format!(
                "tokenizer.ggml.model is {model:?}; the supported ones are \"gpt2\" (byte-level BPE) and \"llama\" (SentencePiece)"
            )));
        }
    };
    let strings = |key: &str| -> Result<Vec<String>> {
        let v = md
            .get(key)
            .ok_or_else(|| err(format!("metadata {key} is missing")))?;
        let arr = v.to_vec().map_err(|e| err(format!("{key}: {e}")))?;
        arr.iter()
            .map(|s| {
                s.to_string()
                    .cloned()
                    .map_err(|e| err(format!("{key}: {e}")))
            })
            .collect()
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges = match kind {
        TokenizerKind::BytePairs => strings("tokenizer.ggml.merges")?,
        TokenizerKind::SentencePiece => Vec::new(),
    };
    let merges = merges
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| err(format!("merge {m:?} has no space")))
        })
        .collect::<Result<Vec<_>>>()?;
    let token_types = match md.get("tokenizer.ggml.token_type") {
        Some(v) => v
            .to_vec()
            .and_then(|a| a.iter().map(|t| t.to_i32()).collect())
            .map_err(|e| err(format!("tokenizer.ggml.token_type: {e}")))?,
        None => vec![1; tokens.len()],
    };
    let scores = match kind {
        TokenizerKind::SentencePiece => md
            .get("tokenizer.ggml.scores")
            .ok_or_else(|| err("metadata tokenizer.ggml.scores is missing".into()))?
            .to_vec()
            .and_then(|a| a.iter().map(|s| s.to_f32()).collect())
            .map_err(|e| err(format!("tokenizer.ggml.scores: {e}")))?,
        TokenizerKind::BytePairs => Vec::new(),
    };
    let flag = |key: &str| md.get(key).and_then(|v| v.to_bool().ok());
    let id = |key: &str| md.get(key).and_then(|v| v.to_u32().ok());
    Ok(TokenizerSpec {
        kind,
        pre: md_string(md, "tokenizer.ggml.pre").unwrap_or_else(|| "default".into()),
        tokens,
        scores,
        // llama.cpp's default for SentencePiece models that do not say.
        add_space_prefix: flag("tokenizer.ggml.add_space_prefix")
            .unwrap_or(kind == TokenizerKind::SentencePiece),
        token_types,
        merges,
        bos_id: id("tokenizer.ggml.bos_token_id"),
        eos_id: id("tokenizer.ggml.eos_token_id"),
        eot_id: id("tokenizer.ggml.eot_token_id"),
        add_bos: flag("tokenizer.ggml.add_bos_token").unwrap_or(false),
        chat_template: md_string(md, "tokenizer.chat_template"),
    })
}

fn md_string(md: &HashMap<String, Value>, key: &str) -> Option<String> {
    md.get(key).and_then(|v| v.to_string().ok()).cloned()
}

#[cfg(test)]
mod tests {
    use crate::{ChatMessage, ModelSource, TokenDecoder};
    use tandem_tokenizer::Error;

    #[test]
    fn a_character_split_across_tokens_is_emitted_whole() {
        let model = ModelSource::TINY.load().expect("tiny");
        let tok = &model.tokenizer;
        let ids = tok.encode("é!").expect("encode");
        assert_eq!(ids.len(), 3, "the tiny vocabulary is one token per byte");
        let mut dec = TokenDecoder::default();
        assert_eq!(dec.push(tok, ids[0]), "");
        assert_eq!(dec.push(tok, ids[1]), "é");
        assert_eq!(dec.push(tok, ids[2]), "!");
        assert_eq!(dec.finish(), "");
    }

    #[test]
    fn special_tokens_are_single_ids_and_not_rendered() {
        let model = ModelSource::TINY.load().expect("tiny");
        let tok = &model.tokenizer;
        let ids = tok.encode("<|im_start|>hi<|im_end|>").expect("encode");
        assert_eq!(ids.first(), Some(&1));
        assert_eq!(ids.last(), Some(&2));
        assert_eq!(tok.decode(&ids), "hi");
        assert!(tok.eog_ids().contains(&2));
    }

    #[test]
    fn chat_template_renders_roles_and_generation_prompt() {
        let model = ModelSource::TINY.load().expect("tiny");
        let text = model
            .tokenizer
            .apply_chat_template(&[ChatMessage::new("user", "Hi")], &[])
            .expect("render");
        assert!(text.starts_with("<|im_start|>system\n"));
        assert!(text.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"));
        assert!(matches!(
            model.tokenizer.apply_chat_template(&[], &[]),
            Err(Error::InvalidArgument {
                field: "messages",
                ..
            })
        ));
    }
}
