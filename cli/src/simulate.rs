//! What `--simulate` names (`tandem prefill`, `decode`, `up` and `sim`): the timing profile a
//! simulated model runs on.

/// What `--simulate` names by default: the profile shipped for a catalog model.
pub(crate) const SHIPPED_PROFILE: &str = "shipped";

/// The timing profile `--simulate` names: `shipped`, the one shipped for the model, else a
/// file.
pub(crate) fn profile(
    source: &tandem_engine::ModelSource,
    profile: &str,
) -> anyhow::Result<tandem_engine::TimingProfile> {
    match profile {
        SHIPPED_PROFILE => source.shipped_profile().ok_or_else(|| {
            anyhow::anyhow!(
                "no timing profile is shipped for {}: measure one with `tandem-bench profile` \
                 and give its file to --simulate",
                source.name()
            )
        }),
        path => Ok(tandem_engine::TimingProfile::read(std::path::Path::new(
            path,
        ))?),
    }
}
