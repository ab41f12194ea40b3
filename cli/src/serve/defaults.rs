//! The router's defaults: those its flags start from (`tandem_router::Config`'s), the sampling
//! it gives HTTP requests that leave theirs unset, and when it splits a prompt over prefill
//! nodes.

use std::time::Duration;

use clap::Args;

/// The router's own defaults, which its flags show and start from: written once, in
/// `tandem_router::Config`.
pub(super) fn router_defaults() -> tandem_router::Config {
    tandem_router::Config::default()
}

/// `d` in whole milliseconds, as the flags take durations.
pub(super) fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

/// The router's sampling for HTTP requests that leave it unset (`tandem up` passes them on).
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct SamplingDefaultsArgs {
    /// Temperature for an HTTP request that sets none [default: OpenAI's, 1].
    #[arg(long, env = "TANDEM_DEFAULT_TEMPERATURE")]
    default_temperature: Option<f32>,
    /// top_p for an HTTP request that sets none [default: 1, no cut].
    #[arg(long, env = "TANDEM_DEFAULT_TOP_P")]
    default_top_p: Option<f32>,
    /// top_k for an HTTP request that sets none [default: 0, no cut].
    #[arg(long, env = "TANDEM_DEFAULT_TOP_K")]
    default_top_k: Option<u32>,
    /// min_p for an HTTP request that sets none [default: 0, no cut].
    #[arg(long, env = "TANDEM_DEFAULT_MIN_P")]
    default_min_p: Option<f32>,
}

impl SamplingDefaultsArgs {
    pub(crate) fn resolve(&self) -> tandem_router::SamplingDefaults {
        tandem_router::SamplingDefaults {
            temperature: self.default_temperature,
            top_p: self.default_top_p,
            top_k: self.default_top_k,
            min_p: self.default_min_p,
        }
    }

    /// The flags again, for a router started as a child process.
    pub(crate) fn to_args(&self) -> Vec<String> {
        let flag = |name: &str, v: Option<String>| v.map(|v| [format!("--{name}"), v]);
        [
            flag(
                "default-temperature",
                self.default_temperature.map(|v| v.to_string()),
            ),
            flag("default-top-p", self.default_top_p.map(|v| v.to_string())),
            flag("default-top-k", self.default_top_k.map(|v| v.to_string())),
            flag("default-min-p", self.default_min_p.map(|v| v.to_string())),
        ]
        .into_iter()
        .flatten()
        .flatten()
        .collect()
    }
}

/// When the router splits a long prompt's prefill over several prefill nodes (`tandem up`
/// passes them on).
#[derive(Args, Debug, Clone)]
pub(crate) struct PipelineArgs {
    /// Prompts of at least this many tokens that no prefill node holds a prefix of are split
    /// over the idle prefill nodes, each computing its part a layer at a time on the KV the one
    /// before streams to it (docs/architecture.md, "One prompt over several prefill nodes");
    /// 0 never splits.
    #[arg(long, env = "TANDEM_PIPELINE_MIN_TOKENS", default_value_t = router_defaults().pipeline.min_tokens)]
    pipeline_min_tokens: usize,
    /// Most prefill nodes one prompt is split over.
    #[arg(long, env = "TANDEM_PIPELINE_STAGES", default_value_t = router_defaults().pipeline.max_stages)]
    pipeline_stages: usize,
}

impl PipelineArgs {
    pub(crate) fn resolve(&self) -> tandem_router::PipelineConfig {
        tandem_router::PipelineConfig {
            min_tokens: self.pipeline_min_tokens,
            max_stages: self.pipeline_stages,
        }
    }

    /// The flags again, for a router started as a child process.
    pub(crate) fn to_args(&self) -> Vec<String> {
        vec![
            "--pipeline-min-tokens".into(),
            self.pipeline_min_tokens.to_string(),
            "--pipeline-stages".into(),
            self.pipeline_stages.to_string(),
        ]
    }
}
