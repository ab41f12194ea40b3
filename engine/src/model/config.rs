//! What a model is, apart from its weights: its family ([`Arch`]) and its shape
//! ([`ModelConfig`]), with the checks every request's tokens and lengths pass.

use crate::kv::{KvDtype, KvLayout};
use crate::quant::QK;

/// The model families the engine runs. They share one forward pass; what differs is data here
/// and in [`ModelConfig`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Gemma3,
    Qwen3,
    /// Qwen3's mixture of experts: Qwen3's attention, a routed FFN ([`Moe`]).
    Qwen3Moe,
}

impl Arch {
    /// Every supported architecture.
    pub const ALL: &[Arch] = &[
        Arch::Llama,
        Arch::Qwen2,
        Arch::Gemma3,
        Arch::Qwen3,
        Arch::Qwen3Moe,
    ];

    pub fn from_gguf(name: &str) -> Option<Arch> {
        Arch::ALL.iter().copied().find(|a| a.gguf_name() == name)
    }

    /// The architecture's name in GGUF metadata, and the prefix of its hyperparameter keys.
    pub fn gguf_name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Gemma3 => "gemma3",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
        }
    }

    /// An RMS norm of each Q and K head before rotary embedding.
    pub fn qk_norm(self) -> bool {
        matches!(self, Arch::Gemma3 | Arch::Qwen3 | Arch::Qwen3Moe)
    }

    /// Gemma's norms of the attention and FFN outputs before they join the residual.
    pub fn post_norms(self) -> bool {
        matches!(self, Arch::Gemma3)
    }

    /// Whether the FFN is a mixture of experts.
    pub fn moe(self) -> bool {
        matches!(self, Arch::Qwen3Moe)
    }

    /// Whether Q, K and V carry biases.
    pub fn qkv_bias(self) -> bool {
        matches!(self, Arch::Qwen2)
    }

    /// How rotary embedding pairs the dimensions of a head: llama's GGUF weights are permuted
    /// for adjacent pairs `(2i, 2i+1)`; the others rotate `(i, i + d/2)` (llama.cpp's NEOX).
    pub fn rope(self) -> Rope {
        match self {
            Arch::Llama => Rope::Adjacent,
            Arch::Qwen2 | Arch::Gemma3 | Arch::Qwen3 | Arch::Qwen3Moe => Rope::Halves,
        }
    }

    /// The gated FFN's activation: GELU (tanh approximation) for Gemma, SiLU for the others.
    pub(super) fn gelu(self) -> bool {
        matches!(self, Arch::Gemma3)
    }
}

/// Sliding-window attention on some layers (Gemma 3's local layers).
#[derive(Clone, Debug, PartialEq)]
pub struct SlidingWindow {
    /// Positions a query sees, its own included.
    pub window: usize,
    /// Every `pattern`-th layer (the last of each run) attends to the whole context; the others
    /// to the window.
    pub pattern: usize,
    /// The rotary base of the windowed layers.
    pub rope_theta: f32,
}

/// A mixture of experts in place of the dense FFN (Qwen3's): a router scores every expert, the
/// `used` best by softmax run, and their outputs are summed with the softmax weights renormalized
/// over those chosen (llama.cpp's `build_moe_ffn` with `norm_w`, the softmax gating).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Moe {
    pub experts: usize,
    pub used: usize,
}

/// Which dimensions of a head rotary embedding rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rope {
    /// `(2i, 2i + 1)`.
    Adjacent,
    /// `(i, i + head_dim / 2)`.
    Halves,
}

/// Hyperparameters of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// The FFN's width (of one expert, in a mixture of experts).
    pub ffn: usize,
    pub vocab: usize,
    pub rope_theta: f32,
    /// Per rotated pair, the factor its angle is divided by (Llama 3's `rope_freqs.weight`).
    pub rope_freq_factors: Option<Vec<f32>>,
    pub context_len: usize,
    pub rms_eps: f32,
    /// Token embeddings are scaled by `sqrt(hidden)` (Gemma).
    pub embed_scale: Option<f32>,
    pub sliding_window: Option<SlidingWindow>,
    pub moe: Option<Moe>,
}

impl ModelConfig {
    /// Checks that `tokens`, the request's `field`, are within the vocabulary: the one check
    /// every node that takes token ids off the network makes.
    pub fn check_token_ids(&self, field: &'static str, tokens: &[u32]) -> crate::Result<()> {
        match tokens.iter().find(|&&t| t as usize >= self.vocab) {
            Some(t) => Err(crate::Error::InvalidArgument {
                field,
                reason: format!("token id {t} is outside the vocabulary of {}", self.vocab),
            }),
            None => Ok(()),
        }
    }

    /// Checks that a prompt of `prompt` tokens and a reply of up to `max_tokens` fit the
    /// context.
    pub fn check_fits(&self, prompt: usize, max_tokens: usize) -> crate::Result<()> {
        if prompt + max_tokens > self.context_len {
            return Err(crate::Error::InvalidArgument {
                field: "max_tokens",
                reason: format!(
                    "prompt of {prompt} tokens plus max_tokens {max_tokens} exceeds the context \
                     of {}",
                    self.context_len
                ),
            });
        }
        Ok(())
    }

    /// Checks the shape constraints the kernels rely on.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("block_count", self.n_layers),
            ("embedding_length", self.hidden),
            ("head_count", self.n_heads),
            ("head_count_kv", self.n_kv_heads),
            ("feed_forward_length", self.ffn),
            ("vocab", self.vocab),
            ("context_length", self.context_len),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{name} is 0"));
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(format!(
                "{} KV heads do not divide {} heads",
                self.n_kv_heads, self.n_heads
            ));
        }
        if !self.hidden.is_multiple_of(QK)
            || !self.ffn.is_multiple_of(QK)
            || !self.q_dim().is_multiple_of(QK)
            || !self.head_dim.is_multiple_of(2)
            || self.head_dim == 0
        {
            return Err(format!(
                "hidden {}, ffn {} and heads × head_dim {} must be multiples of {QK} (head_dim {} even)",
                self.hidden,
                self.ffn,
                self.q_dim(),
                self.head_dim
            ));
        }
        if self
            .sliding_window
            .as_ref()
            .is_some_and(|w| w.window == 0 || w.pattern == 0)
        {
            return Err("the sliding window and its layer pattern must be positive".into());
        }
        if let Some(m) = self.moe
            && (m.used == 0 || m.used > m.experts)
        {
            return Err(format!(
                "expert_used_count {} must be between 1 and expert_count {}",
                m.used, m.experts
            ));
        }
        Ok(())
    }

    /// The KV cache's shape, with rows stored as `dtype`.
    pub fn kv_layout(&self, dtype: KvDtype) -> KvLayout {
        KvLayout {
            n_layers: self.n_layers,
            n_kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
            dtype,
            header_only: false,
        }
    }

    /// The first key a query at `pos` sees in layer `layer`.
    pub(super) fn first_key(&self, layer: usize, pos: usize) -> usize {
        match &self.sliding_window {
            Some(w) if self.is_local(layer) => (pos + 1).saturating_sub(w.window),
            _ => 0,
        }
    }

    pub(super) fn is_local(&self, layer: usize) -> bool {
        self.sliding_window
            .as_ref()
            .is_some_and(|w| !(layer + 1).is_multiple_of(w.pattern))
    }

    pub(crate) fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub(crate) fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}
