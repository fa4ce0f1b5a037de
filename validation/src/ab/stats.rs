//! Paired statistics: per-pair relative changes, their median, and a percentile bootstrap
//! interval for that median.
//!
//! A pair is one run of each arm back to back (AB or BA), so slow drifts of the machine (thermal
//! state, page cache, a noisy neighbour) affect both halves alike; the relative change
//! `(b - a) / a` of a pair removes them, and the median of those changes resists the occasional
//! outlier run. The interval resamples pairs, never single runs, so it keeps the pairing.

use crate::prng::Rng;

/// The median of `xs` (the mean of the two middle values when the count is even). Reorders
/// `xs`. NaN sorts last (`total_cmp`); timings are never NaN.
pub fn median_in_place(xs: &mut [f64]) -> f64 {
    let n = xs.len();
    assert!(n > 0, "median of nothing");
    let (left, mid, _) = xs.select_nth_unstable_by(n / 2, f64::total_cmp);
    let upper = *mid;
    if n % 2 == 1 {
        upper
    } else {
        let lower = left.iter().copied().max_by(f64::total_cmp).unwrap();
        (lower + upper) / 2.0
    }
}

/// The median of `xs`.
pub fn median(xs: &[f64]) -> f64 {
    median_in_place(&mut xs.to_vec())
}

/// `(b_i - a_i) / a_i` for each pair: negative when B is faster.
pub fn relative_changes(a: &[f64], b: &[f64]) -> Vec<f64> {
    assert_eq!(a.len(), b.len(), "unpaired samples");
    a.iter().zip(b).map(|(&a, &b)| (b - a) / a).collect()
}

/// A median with its bootstrap confidence interval.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Interval {
    /// The sample median.
    pub median: f64,
    pub lo: f64,
    pub hi: f64,
    /// Observations (pairs).
    pub n: usize,
}

impl Interval {
    /// The whole interval is below zero (B faster, beyond noise).
    pub fn wholly_below_parity(&self) -> bool {
        self.hi < 0.0
    }

    /// The whole interval is above zero (B slower, beyond noise).
    pub fn wholly_above_parity(&self) -> bool {
        self.lo > 0.0
    }

    pub fn covers(&self, x: f64) -> bool {
        self.lo <= x && x <= self.hi
    }
}

/// Percentile bootstrap interval of the median of `xs` at `level` (e.g. 0.95): `resamples`
/// times draw `xs.len()` values with replacement and take their median; the interval runs from
/// the `(1-level)/2` to the `(1+level)/2` quantile of those medians.
pub fn bootstrap_median(xs: &[f64], resamples: usize, level: f64, rng: &mut Rng) -> Interval {
    let n = xs.len();
    assert!(n > 0 && resamples > 0 && level > 0.0 && level < 1.0);
    let mut medians = Vec::with_capacity(resamples);
    let mut sample = vec![0f64; n];
    for _ in 0..resamples {
        for s in sample.iter_mut() {
            *s = xs[rng.below(n as u64) as usize];
        }
        medians.push(median_in_place(&mut sample));
    }
    medians.sort_unstable_by(f64::total_cmp);
    let alpha = 1.0 - level;
    let lo_idx = ((alpha / 2.0) * resamples as f64).floor() as usize;
    let hi_idx = (((1.0 - alpha / 2.0) * resamples as f64).ceil() as usize).clamp(1, resamples) - 1;
    Interval {
        median: median(xs),
        lo: medians[lo_idx.min(resamples - 1)],
        hi: medians[hi_idx],
        n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[7.0]), 7.0);
        assert_eq!(median(&[-1.0, -1.0]), -1.0);
    }

    #[test]
    fn relative_changes_are_b_against_a() {
        assert_eq!(
            relative_changes(&[100.0, 50.0], &[90.0, 55.0]),
            vec![-0.1, 0.1]
        );
    }

    #[test]
    fn the_interval_is_reproducible_from_the_seed_and_brackets_the_median() {
        let xs: Vec<f64> = (0..15).map(|i| (i as f64 - 7.0) / 100.0).collect();
        let a = bootstrap_median(&xs, 20_000, 0.95, &mut Rng::new(9));
        let b = bootstrap_median(&xs, 20_000, 0.95, &mut Rng::new(9));
        assert_eq!(a, b);
        assert!(a.lo <= a.median && a.median <= a.hi);
        assert!(a.lo < 0.0 && a.hi > 0.0, "{a:?}");
        // A constant sample has a degenerate interval.
        let c = bootstrap_median(&[0.05; 8], 1000, 0.95, &mut Rng::new(1));
        assert_eq!((c.lo, c.median, c.hi), (0.05, 0.05, 0.05));
        assert!(c.wholly_above_parity() && !c.wholly_below_parity());
    }

    /// Synthetic paired timings with a known true effect: A is lognormal around 100 ms, and
    /// B = A * (1 + effect) * exp(sigma * z), so the true median of the relative change is
    /// `effect` exactly (exp(sigma * z) has median 1, and the map is monotone).
    fn dataset(rng: &mut Rng, n: usize, effect: f64, sigma: f64) -> (Vec<f64>, Vec<f64>) {
        let a: Vec<f64> = (0..n).map(|_| 100.0 * (0.2 * rng.normal()).exp()).collect();
        let b = a
            .iter()
            .map(|&x| x * (1.0 + effect) * (sigma * rng.normal()).exp())
            .collect();
        (a, b)
    }

    #[test]
    fn the_95_percent_interval_covers_the_true_effect_about_95_percent_of_the_time() {
        // 400 simulated experiments of 25 pairs each, with the harness's own 20,000 resamples.
        let mut rng = Rng::new(20_240_601);
        let effect = -0.03;
        let trials = 400;
        let mut covered = 0;
        let mut widths = 0.0;
        for _ in 0..trials {
            let (a, b) = dataset(&mut rng, 25, effect, 0.02);
            let r = relative_changes(&a, &b);
            let iv = bootstrap_median(&r, 20_000, 0.95, &mut rng);
            if iv.covers(effect) {
                covered += 1;
            }
            widths += iv.hi - iv.lo;
        }
        let coverage = covered as f64 / trials as f64;
        eprintln!(
            "coverage {coverage:.3}, mean width {:.4}",
            widths / trials as f64
        );
        // Binomial s.e. at 400 trials is 1.1 points; the percentile bootstrap of a median is
        // slightly conservative at this size.
        assert!((0.92..=0.985).contains(&coverage), "coverage {coverage}");
    }

    #[test]
    fn with_no_effect_the_interval_rarely_excludes_parity() {
        let mut rng = Rng::new(77);
        let trials = 300;
        let mut excluded = 0;
        for _ in 0..trials {
            let (a, b) = dataset(&mut rng, 20, 0.0, 0.03);
            let iv = bootstrap_median(&relative_changes(&a, &b), 4_000, 0.95, &mut rng);
            if iv.wholly_below_parity() || iv.wholly_above_parity() {
                excluded += 1;
            }
        }
        let rate = excluded as f64 / trials as f64;
        assert!(rate <= 0.09, "false positives {rate}");
    }

    #[test]
    fn a_real_improvement_is_found_with_enough_pairs() {
        let mut rng = Rng::new(5);
        let (a, b) = dataset(&mut rng, 30, -0.05, 0.01);
        let iv = bootstrap_median(&relative_changes(&a, &b), 20_000, 0.95, &mut rng);
        assert!(iv.wholly_below_parity(), "{iv:?}");
        assert!((iv.median + 0.05).abs() < 0.01, "{iv:?}");
    }
}
