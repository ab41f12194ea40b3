//! What the router knows of the model it serves, learned from the first worker that answers
//! `Worker.Info`: the tokenizer (so the router tokenizes and renders chat templates itself),
//! the context, the weights' fingerprint and the KV dtype.

use tandem_proto::v1 as pb;
use tandem_tokenizer::{Tokenizer, TokenizerSpec};

/// What the router knows of the model, from the first worker that answered.
#[derive(Debug)]
pub struct Frontend {
    /// The model's name, as its workers report it (the OpenAI API's model id).
    pub model_name: String,
    pub tokenizer: Tokenizer,
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
            tokenizer,
            context_tokens: info.context_tokens as usize,
            fingerprint: info.model_fingerprint.to_vec(),
            kv_dtype: kv_dtype(info).to_string(),
        })
    }
}

/// A worker's KV dtype; workers that do not say keep f16.
pub(super) fn kv_dtype(info: &pb::InfoResponse) -> &str {
    match info.kv_dtype.as_str() {
        "" => "f16",
        other => other,
    }
}
