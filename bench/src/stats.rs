//! Order statistics of measurements.

use serde::{Deserialize, Serialize};

/// The `p`-quantile (0..=1) of `v`, nearest rank; NaN for no values. Sorts `v`.
pub(crate) fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i]
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    percentile(&mut v, 0.5)
}

/// A distribution's summary.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, Default)]
pub(crate) struct Dist {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
}

impl Dist {
    pub(crate) fn of(v: &[f64]) -> Self {
        let mut v = v.to_vec();
        Self {
            p50: percentile(&mut v, 0.5),
            p90: percentile(&mut v, 0.9),
            p99: percentile(&mut v, 0.99),
            mean: if v.is_empty() {
                f64::NAN
            } else {
                v.iter().sum::<f64>() / v.len() as f64
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let d = Dist::of(&v);
        assert_eq!((d.p50, d.p90, d.p99, d.mean), (51.0, 90.0, 99.0, 50.5));
        assert!(Dist::of(&[]).p50.is_nan());
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
    }
}
