//! A request's first step: its ids, limits and sampling checked, its input tokenized (the chat
//! template rendered for messages), and its prompt's block hashes computed, as [`Prepared`].
//! Later attempts resume from [`Prepared::prompt_after`] what earlier ones delivered.

use tandem_proto::v1 as pb;

use crate::auth::{Class, Principal};
use crate::cluster::frontend::Frontend;
use crate::config::Limits;
use crate::error::{Error, Result, invalid};

/// A request after validation: prompt token ids, their block hashes, and sampling.
#[derive(Debug)]
pub struct Prepared {
    pub request_id: String,
    /// Who sent it ([`crate::auth::Principal`]'s tenant), and the session it names, if any.
    pub tenant: std::sync::Arc<str>,
    pub session_id: String,
    pub tokens: Vec<u32>,
    /// Block hashes of the prompt's full blocks that a cache may supply (all but the last
    /// token's block).
    pub hashes: Vec<u64>,
    pub sampling: pb::SamplingParams,
    /// The cache partition ([`crate::auth::cache_partition`]) that seeds the block hashes.
    pub cache_salt: String,
    /// The model it runs on ([`Frontend::model_name`]).
    pub model: String,
    /// The model's fingerprint, which seeds the block hashes too.
    pub fingerprint: Vec<u8>,
    /// How many replies to generate (`n`): 1 to [`tandem_proto::MAX_CHOICES`].
    pub choices: u32,
    /// Its priority class, and its key's weight within the class ([`crate::dispatch::order`]).
    pub class: Class,
    pub weight: u32,
    /// The time to first token it must get, if any: its own (`ttft_target_ms`), else its
    /// class's default ([`Limits::ttft_targets`]).
    pub ttft_target: Option<std::time::Duration>,
}

/// Checks the request's ids and salt ([`tandem_proto::check_ids`]); the first thing done with a
/// request.
pub fn check_ids(r: &pb::GenerateRequest) -> Result<()> {
    tandem_proto::check_ids(&[
        ("request_id", &r.request_id),
        ("session_id", &r.session_id),
        ("cache_salt", &r.cache_salt),
    ])
    .map_err(|(field, reason)| Error::InvalidArgument { field, reason })
}

/// The `x-slo-ttft-ms` header's (or metadata's) value as `GenerateRequest.ttft_target_ms`: a
/// positive whole number of milliseconds.
pub fn ttft_target_ms(value: &str) -> Result<u32> {
    (value.trim().parse().ok())
        .filter(|&ms| ms > 0)
        .ok_or_else(|| Error::InvalidArgument {
            field: "x-slo-ttft-ms",
            reason: format!("{value:?}: expected a positive whole number of milliseconds"),
        })
}

/// Checks a client request against `limits` and turns its input into token ids; the text is
/// bounded before it is tokenized. With `default_max_tokens`, an unset `max_tokens` (0) means
/// that many, or the rest of the context if that is less. `principal`'s tenant partitions the
/// caches, with the request's own `cache_salt`, and its key bounds the priority class the
/// request may ask for. Tokenizing takes time in proportion to the text: call this off the async
/// runtime's threads.
pub fn prepare(
    front: &Frontend,
    mut r: pb::GenerateRequest,
    limits: &Limits,
    default_max_tokens: Option<u32>,
    principal: &Principal,
) -> Result<Prepared> {
    let tenant = &principal.tenant;
    let asked = match r.priority.as_str() {
        "" => None,
        asked => Some(Class::parse(asked).ok_or_else(|| Error::InvalidArgument {
            field: "priority",
            reason: format!("{asked:?}: must be interactive, standard or batch"),
        })?),
    };
    let (class, weight) = principal.standing(asked);
    let given = usize::from(r.prompt.is_some())
        + usize::from(!r.messages.is_empty())
        + usize::from(!r.token_ids.is_empty());
    if given != 1 {
        return invalid(
            "input",
            "exactly one of prompt, messages and token_ids must be given",
        );
    }
    if r.messages.is_empty() && !r.tools.is_empty() {
        return invalid("tools", "tools are offered to a chat: give messages");
    }
    let Some(mut sampling) = r.sampling.take() else {
        return invalid("sampling", "sampling with max_tokens is required");
    };
    check_sampling(&sampling, front.tokenizer.vocab_size())?;
    if r.n > tandem_proto::MAX_CHOICES {
        return Err(Error::InvalidArgument {
            field: "n",
            reason: format!(
                "{} choices, over the limit of {}",
                r.n,
                tandem_proto::MAX_CHOICES
            ),
        });
    }
    if sampling.max_tokens == 0 && default_max_tokens.is_none() {
        return invalid("sampling.max_tokens", "must be at least 1");
    }
    if sampling.max_tokens > limits.max_tokens {
        return Err(Error::InvalidArgument {
            field: "sampling.max_tokens",
            reason: format!(
                "{} is over the limit of {}",
                sampling.max_tokens, limits.max_tokens
            ),
        });
    }
    let (tokens, tool_grammar) = tokenize(front, &mut r, limits)?;
    if let Some(tools) = tool_grammar {
        let held = matches!(tools.kind, Some(pb::grammar::Kind::ToolCalls(_)));
        match (&sampling.grammar, held) {
            (None, _) => sampling.grammar = Some(tools),
            // A reply the model decides keeps the caller's own grammar, if any, over the hold.
            (Some(_), true) => {}
            (Some(_), false) => {
                return invalid(
                    "sampling.grammar",
                    "a forced tool call has the tools' grammar: give no other",
                );
            }
        }
    }
    if tokens.len() >= front.context_tokens {
        return Err(Error::InvalidArgument {
            field: "prompt",
            reason: format!(
                "{} tokens do not fit the context of {}",
                tokens.len(),
                front.context_tokens
            ),
        });
    }
    if sampling.max_tokens == 0 {
        let rest = (front.context_tokens - tokens.len()) as u32;
        sampling.max_tokens = default_max_tokens
            .unwrap_or(rest)
            .min(rest)
            .min(limits.max_tokens);
    }
    if sampling.min_tokens > sampling.max_tokens {
        return Err(Error::InvalidArgument {
            field: "sampling.min_tokens",
            reason: format!(
                "{} is more than max_tokens {}",
                sampling.min_tokens, sampling.max_tokens
            ),
        });
    }
    if tokens.len() + sampling.max_tokens as usize > front.context_tokens {
        return Err(Error::InvalidArgument {
            field: "sampling.max_tokens",
            reason: format!(
                "prompt of {} tokens plus max_tokens {} exceeds the context of {}",
                tokens.len(),
                sampling.max_tokens,
                front.context_tokens
            ),
        });
    }
    let cache_salt = crate::auth::cache_partition(tenant, &r.cache_salt);
    let hashes = tandem_proto::block_hash::prompt_hashes(&front.fingerprint, &cache_salt, &tokens);
    Ok(Prepared {
        request_id: r.request_id,
        tenant: tenant.clone(),
        session_id: r.session_id,
        tokens,
        hashes,
        sampling,
        cache_salt,
        model: front.model_name.clone(),
        fingerprint: front.fingerprint.clone(),
        choices: r.n.max(1),
        class,
        weight,
        ttft_target: match r.ttft_target_ms {
            0 => limits.ttft_targets[class.slot()],
            ms => Some(std::time::Duration::from_millis(u64::from(ms))),
        },
    })
}

/// A request's sampling within its bounds ([`tandem_proto::policy::check_sampling`]), and its
/// token ids within the vocabulary of `vocab`.
fn check_sampling(sampling: &pb::SamplingParams, vocab: usize) -> Result<()> {
    tandem_proto::policy::check_sampling(sampling)
        .map_err(|(field, reason)| Error::InvalidArgument { field, reason })?;
    check_token_ids(sampling, vocab)
}

/// A request's input as prompt tokens, bounded by `limits` (its text before it is tokenized),
/// with the grammar its tool choice holds the reply to, if any
/// ([`crate::dispatch::chat::Rendered`]): a prompt tokenized, messages rendered through the chat
/// template and tokenized, or token ids checked (and taken). Takes time in proportion to the
/// text: call it off the async runtime's threads.
pub fn tokenize(
    front: &Frontend,
    r: &mut pb::GenerateRequest,
    limits: &Limits,
) -> Result<(Vec<u32>, Option<pb::Grammar>)> {
    let (field, text_bytes) = match &r.prompt {
        Some(p) => ("prompt", p.len()),
        None => ("messages", crate::dispatch::chat::text_bytes(r)),
    };
    if text_bytes > limits.prompt_bytes {
        return Err(Error::InvalidArgument {
            field,
            reason: format!(
                "{text_bytes} bytes of text, over the limit of {}",
                limits.prompt_bytes
            ),
        });
    }
    let tokens_field = if r.token_ids.is_empty() {
        "prompt"
    } else {
        "token_ids"
    };
    let mut tool_grammar = None;
    let tokens = if let Some(prompt) = &r.prompt {
        if prompt.is_empty() {
            return invalid("prompt", "must not be empty");
        }
        front.tokenizer.encode_cached(prompt, &front.encodes)?
    } else if !r.messages.is_empty() {
        let rendered = crate::dispatch::chat::render(&front.tokenizer, r)?;
        tool_grammar = rendered.tool_grammar;
        front
            .tokenizer
            .encode_cached(&rendered.text, &front.encodes)?
    } else {
        let vocab = front.tokenizer.vocab_size();
        if let Some(t) = r.token_ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::InvalidArgument {
                field: "token_ids",
                reason: format!("token id {t} is outside the vocabulary of {vocab}"),
            });
        }
        std::mem::take(&mut r.token_ids)
    };
    if tokens.is_empty() {
        return invalid("prompt", "tokenizes to nothing");
    }
    if tokens.len() > limits.prompt_tokens {
        return Err(Error::InvalidArgument {
            field: tokens_field,
            reason: format!(
                "{} tokens, over the limit of {}",
                tokens.len(),
                limits.prompt_tokens
            ),
        });
    }
    Ok((tokens, tool_grammar))
}

impl Prepared {
    /// The prompt an attempt sends, with its reusable blocks' hashes: the request's, followed
    /// by the tokens earlier attempts delivered (a failover resumes after them).
    pub(crate) fn prompt_after(&self, generated: &[u32]) -> (Vec<u32>, Vec<u64>) {
        if generated.is_empty() {
            return (self.tokens.clone(), self.hashes.clone());
        }
        let mut tokens = self.tokens.clone();
        tokens.extend(generated);
        let hashes =
            tandem_proto::block_hash::prompt_hashes(&self.fingerprint, &self.cache_salt, &tokens);
        (tokens, hashes)
    }

    /// The sampling of choice `choice`: the request's, with the choice's own seed, and its
    /// max_tokens held to `admitted`, what a decode node admitted the choice with where its KV
    /// pool holds less (min_tokens with it).
    pub(crate) fn sampling_of(&self, choice: u32, admitted: Option<u32>) -> pb::SamplingParams {
        let max_tokens = admitted.map_or(self.sampling.max_tokens, |m| {
            m.min(self.sampling.max_tokens)
        });
        pb::SamplingParams {
            seed: tandem_proto::choice_seed(self.sampling.seed, choice),
            max_tokens,
            min_tokens: self.sampling.min_tokens.min(max_tokens),
            ..self.sampling.clone()
        }
    }
}

/// Most logit biases a request may set (OpenAI allows 300).
pub const MAX_LOGIT_BIAS: usize = 1024;
/// Most `stop_token_ids` a request may set.
pub const MAX_STOP_TOKEN_IDS: usize = 64;

/// The token ids a request names besides its prompt (`logit_bias`, `stop_token_ids`): within
/// the vocabulary and their bounds.
fn check_token_ids(s: &pb::SamplingParams, vocab: usize) -> Result<()> {
    if s.logit_bias.len() > MAX_LOGIT_BIAS {
        return invalid(
            "sampling.logit_bias",
            format!(
                "{} biases, over the limit of {MAX_LOGIT_BIAS}",
                s.logit_bias.len()
            ),
        );
    }
    if s.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
        return invalid(
            "sampling.stop_token_ids",
            format!(
                "{} ids, over the limit of {MAX_STOP_TOKEN_IDS}",
                s.stop_token_ids.len()
            ),
        );
    }
    if let Some((t, b)) = s
        .logit_bias
        .iter()
        .find(|&(_, b)| !(-100.0..=100.0).contains(b))
    {
        return invalid(
            "sampling.logit_bias",
            format!("token {t}: a bias must be in [-100, 100], got {b}"),
        );
    }
    for (field, ids) in [
        (
            "sampling.logit_bias",
            s.logit_bias.keys().collect::<Vec<_>>(),
        ),
        ("sampling.stop_token_ids", s.stop_token_ids.iter().collect()),
    ] {
        if let Some(t) = ids.into_iter().find(|&&t| t as usize >= vocab) {
            return invalid(
                field,
                format!("token id {t} is outside the vocabulary of {vocab}"),
            );
        }
    }
    Ok(())
}

#[cfg(test)]
impl Prepared {
    /// A prompt of 40 tokens with 2 choices, for the tests of later steps.
    pub(crate) fn example() -> Self {
        let tokens: Vec<u32> = (0..40).collect();
        let fingerprint = vec![7; 32];
        Prepared {
            request_id: "r".into(),
            tenant: "t".into(),
            session_id: String::new(),
            hashes: tandem_proto::block_hash::prompt_hashes(&fingerprint, "salt", &tokens),
            tokens,
            sampling: pb::SamplingParams {
                seed: 5,
                max_tokens: 8,
                ..Default::default()
            },
            cache_salt: "salt".into(),
            model: String::new(),
            fingerprint,
            choices: 2,
            class: Class::Standard,
            weight: 1,
            ttft_target: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn a_resumed_attempt_sends_the_prompt_and_what_was_delivered() {
        let p = Prepared::example();
        assert_eq!(p.prompt_after(&[]), (p.tokens.clone(), p.hashes.clone()));
        let delivered: Vec<u32> = (100..110).collect();
        let (tokens, hashes) = p.prompt_after(&delivered);
        assert_eq!(tokens[..40], p.tokens[..]);
        assert_eq!(tokens[40..], delivered[..]);
        // 50 tokens hold 3 reusable blocks (all but the last token's), the first 2 the prompt's.
        assert_eq!(p.hashes.len(), 2);
        assert_eq!(hashes.len(), 3);
        assert_eq!(hashes[..2], p.hashes[..]);
    }

    #[test]
    fn each_choice_samples_with_its_own_seed() {
        let p = Prepared::example();
        assert_eq!(p.sampling_of(0, None), p.sampling);
        let seeds: HashSet<u64> = (0..tandem_proto::MAX_CHOICES)
            .map(|i| p.sampling_of(i, None).seed)
            .collect();
        assert_eq!(seeds.len(), tandem_proto::MAX_CHOICES as usize);
        assert_eq!(p.sampling_of(3, None).max_tokens, 8);
    }

    /// A choice a decode node admitted with less max_tokens than asked (its KV pool's end)
    /// asks for no more on a later attempt, and never for more than the request asked.
    #[test]
    fn a_choice_asks_for_no_more_than_it_was_admitted_with() {
        let mut p = Prepared::example();
        p.sampling.min_tokens = 6;
        let cut = p.sampling_of(1, Some(5));
        assert_eq!((cut.max_tokens, cut.min_tokens), (5, 5));
        assert_eq!(cut.seed, p.sampling_of(1, None).seed);
        assert_eq!(p.sampling_of(1, Some(100)).max_tokens, 8);
    }
}
