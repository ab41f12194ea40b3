//! What the router knows of each model it serves, learned from the first worker that names it in
//! `Worker.Info`: the tokenizer (so the router tokenizes and renders chat templates itself),
//! the context, the weights' fingerprint and the KV dtype. [`pick`] finds a request's model.

use std::sync::Arc;

use tandem_proto::v1 as pb;
use tandem_tokenizer::{EncodeCache, Tokenizer, TokenizerSpec};

use crate::error::Error;

/// Most token ids a model's [`Frontend::encodes`] holds: 64 MiB of them, about 2,000 agent
/// sessions' 30k-token conversations, or many more that share a system prompt.
pub const ENCODE_CACHE_TOKENS: u64 = 16 << 20;

/// What the router knows of a model, from the first worker that named it.
#[derive(Debug)]
pub struct Frontend {
    /// The model's name, as its workers report it (the OpenAI API's model id).
    pub model_name: String,
    /// Other names the model answers to: its file's name, its catalog name, `default`.
    pub aliases: Vec<String>,
    pub tokenizer: Tokenizer,
    /// The ids of the text the router has tokenized, by content: a conversation's next turn
    /// encodes only its new messages, and a shared system prompt is encoded once.
    pub encodes: EncodeCache,
    pub context_tokens: usize,
    pub fingerprint: Vec<u8>,
    /// How the workers keep and send KV (`f16` or `q8`).
    pub kv_dtype: String,
}

impl Frontend {
    pub(crate) fn from_info(info: &pb::InfoResponse) -> Option<Self> {
        let spec: TokenizerSpec = serde_json::from_str(&info.tokenizer_spec_json)
            .map_err(|e| tracing::error!(error = %e, "worker sent an unreadable tokenizer spec"))
            .ok()?;
        let tokenizer = Tokenizer::new(spec)
            .map_err(|e| tracing::error!(error = %e, "worker sent an unusable tokenizer spec"))
            .ok()?;
        Some(Self {
            model_name: info.model_name.clone(),
            aliases: info.model_aliases.clone(),
            tokenizer,
            encodes: EncodeCache::new(ENCODE_CACHE_TOKENS),
            context_tokens: info.context_tokens as usize,
            fingerprint: info.model_fingerprint.to_vec(),
            kv_dtype: kv_dtype(info).to_string(),
        })
    }
}

/// The model a request naming `asked` runs on, among those `served`: the one of that name (its
/// id, else one of its aliases); for an empty name, `default` when given, else the only one
/// served. Several served and no default, an empty name is refused; an unknown name is
/// NOT_FOUND, naming those served.
pub fn pick(
    served: &[Arc<Frontend>],
    asked: &str,
    default: Option<&str>,
) -> Result<Arc<Frontend>, Error> {
    let names: Vec<&str> = served.iter().map(|f| f.model_name.as_str()).collect();
    let aliases: Vec<&[String]> = served.iter().map(|f| f.aliases.as_slice()).collect();
    choose(&names, &aliases, asked, default).map(|i| served[i].clone())
}

/// [`pick`] by the models' names and aliases: the index of the one chosen.
fn choose(
    names: &[&str],
    aliases: &[&[String]],
    asked: &str,
    default: Option<&str>,
) -> Result<usize, Error> {
    let name = match (asked, default, names.len()) {
        (_, _, 0) => return Err(Error::NotReady),
        ("", None, 1) => return Ok(0),
        ("", None, _) => {
            return Err(Error::InvalidArgument {
                field: "model",
                reason: format!(
                    "this cluster serves several models, name one: {}",
                    names.join(", ")
                ),
            });
        }
        ("", Some(default), _) => default,
        (asked, _, _) => asked,
    };
    names
        .iter()
        .position(|n| *n == name)
        .or_else(|| aliases.iter().position(|a| a.iter().any(|a| a == name)))
        .ok_or_else(|| Error::UnknownModel {
            asked: name.to_string(),
            served: names.join(", "),
        })
}

/// A worker's KV dtype; workers that do not say keep f16.
pub(super) fn kv_dtype(info: &pb::InfoResponse) -> &str {
    match info.kv_dtype.as_str() {
        "" => "f16",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_runs_on_the_model_it_names_else_the_default() {
        let two = ["gemma", "qwen"];
        let qwen_aliases = ["qwen.gguf".to_string(), "default".to_string()];
        let aliases: [&[String]; 2] = [&[], &qwen_aliases];
        let choose = |names: &[&str], asked: &str, default: Option<&str>| {
            choose(names, &aliases[..names.len()], asked, default)
        };
        assert_eq!(choose(&two, "qwen", None).ok(), Some(1));
        assert_eq!(choose(&two, "", Some("gemma")).ok(), Some(0));
        assert_eq!(choose(&["gemma"], "", None).ok(), Some(0));
        // A model answers to its aliases, and so does a default named by one.
        assert_eq!(choose(&two, "qwen.gguf", None).ok(), Some(1));
        assert_eq!(choose(&two, "", Some("default")).ok(), Some(1));
        // Several and no default: a request must name one.
        let unnamed = choose(&two, "", None).expect_err("unnamed");
        assert_eq!(unnamed.code(), tonic::Code::InvalidArgument);
        assert!(unnamed.to_string().contains("gemma, qwen"), "{unnamed}");
        // An unknown name, or a default no worker serves now, is NOT_FOUND naming those served.
        for (asked, default) in [("gpt-4o", None), ("", Some("llama"))] {
            let e = choose(&two, asked, default).expect_err("unknown");
            assert_eq!(e.code(), tonic::Code::NotFound);
            assert!(e.to_string().contains("gemma, qwen"), "{e}");
        }
        // Nothing learned yet: not ready (UNAVAILABLE), whatever is asked.
        assert_eq!(
            choose(&[], "qwen", None).expect_err("none").code(),
            tonic::Code::Unavailable
        );
    }
}
