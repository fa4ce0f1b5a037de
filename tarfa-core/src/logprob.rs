//! The log-softmax of one row of f32 logits, on the host, in the one order docs/EXACTNESS.md
//! (section 7) states: the same f64 bits on every machine, whatever computed the logits.
//!
//! `exp` and `ln` are the pure-Rust `libm` crate's (musl's algorithms), never `f64::exp` /
//! `f64::ln`: those call the platform's libm, which differs between systems and versions.
//! This module must never reorder the sum or change its precision: scores, top-k alternatives
//! and sampling probabilities are all defined by it.

use std::cmp::Ordering;

/// What normalises one row: its largest logit and the log of the sum of `exp(x - max)`.
/// `logprob(x) = (x - max) - log_sum`. Computing it once serves every token of the row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Normaliser {
    /// The largest logit, widened to f64 (exact).
    pub max: f64,
    /// `ln(sum over the row, in increasing token id, of exp(f64(x) - max))`, in f64. NaN when
    /// the row has no distribution (a NaN or +inf logit, every logit -inf, or an empty row).
    pub log_sum: f64,
}

impl Normaliser {
    /// The row's normaliser (EXACTNESS.md section 7).
    pub fn of(logits: &[f32]) -> Normaliser {
        let mut max = f32::NEG_INFINITY;
        for &x in logits {
            if x.is_nan() || x == f32::INFINITY {
                return Normaliser::UNDEFINED;
            }
            if x > max {
                max = x;
            }
        }
        if max == f32::NEG_INFINITY {
            // Every logit -inf (or none at all): no token has any mass.
            return Normaliser::UNDEFINED;
        }
        let max = f64::from(max);
        let mut sum = 0.0f64;
        for &x in logits {
            sum += libm::exp(f64::from(x) - max);
        }
        Normaliser {
            max,
            log_sum: libm::log(sum),
        }
    }

    const UNDEFINED: Normaliser = Normaliser {
        max: f64::NAN,
        log_sum: f64::NAN,
    };

    /// The log-probability of a token whose logit is `x`.
    #[inline]
    pub fn logprob(&self, x: f32) -> f64 {
        (f64::from(x) - self.max) - self.log_sum
    }
}

/// The log-softmax of one row of f32 logits in the fixed order EXACTNESS.md states; f64
/// results. A row with a NaN or +inf logit, or with every logit -inf, has no distribution:
/// every result is NaN.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let n = Normaliser::of(logits);
    logits.iter().map(|&x| n.logprob(x)).collect()
}

/// `log_softmax(logits)[token]`, without the rest of the row.
///
/// # Panics
/// If `token` is not an index of `logits`: callers check ids against the vocabulary first.
pub fn token_logprob(logits: &[f32], token: u32) -> f64 {
    let x = logits[token as usize];
    Normaliser::of(logits).logprob(x)
}

/// The order of tokens by logit: larger first, NaN after every number, and the lower id first
/// among equals. The same order as greedy's [`argmax`](crate::generate::argmax): the first
/// token of it is the greedy one. Since `logprob` is non-decreasing in the logit, it lists the
/// log-probabilities in descending order.
pub fn by_logit(logits: &[f32], a: u32, b: u32) -> Ordering {
    let (x, y) = (logits[a as usize], logits[b as usize]);
    let by_value = match (x.is_nan(), y.is_nan()) {
        (false, false) => y.partial_cmp(&x).unwrap_or(Ordering::Equal),
        (true, false) => Ordering::Greater,
        (false, true) => Ordering::Less,
        (true, true) => Ordering::Equal,
    };
    // -0.0 and +0.0 compare equal, as argmax sees them.
    by_value.then(a.cmp(&b))
}

/// The `k` best (token, logprob) pairs, descending, lower id first on ties (of the logit: see
/// [`by_logit`]); fewer when the row is shorter than `k`.
pub fn top_logprobs(logits: &[f32], k: usize) -> Vec<(u32, f64)> {
    let k = k.min(logits.len());
    if k == 0 {
        return Vec::new();
    }
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let order = |a: &u32, b: &u32| by_logit(logits, *a, *b);
    // `by_logit` is a total order (ids break every tie), so the k smallest are one set.
    if k < ids.len() {
        ids.select_nth_unstable_by(k - 1, order);
        ids.truncate(k);
    }
    ids.sort_unstable_by(order);
    let n = Normaliser::of(logits);
    ids.into_iter()
        .map(|t| (t, n.logprob(logits[t as usize])))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::argmax;

    /// An independent reference: the platform's f64 `exp`/`ln`, with the max subtracted, summed
    /// in reverse order (so that it does not share this module's order either).
    fn reference(logits: &[f32]) -> Vec<f64> {
        let m = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let s: f64 = logits.iter().rev().map(|&x| (x as f64 - m).exp()).sum();
        logits.iter().map(|&x| x as f64 - m - s.ln()).collect()
    }

    /// A fixed pseudo-random row (xorshift), values in [-scale, scale).
    fn row(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    #[test]
    fn agrees_with_an_independent_f64_computation() {
        for (n, seed, scale) in [
            (1, 1, 1.0),
            (7, 2, 3.0),
            (4096, 3, 20.0),
            (151_936, 4, 40.0),
        ] {
            let r = row(n, seed, scale);
            let ours = log_softmax(&r);
            let theirs = reference(&r);
            for (a, b) in ours.iter().zip(&theirs) {
                assert!((a - b).abs() <= 1e-12 * b.abs().max(1.0), "{a} vs {b}");
            }
        }
    }

    #[test]
    fn a_row_of_equal_values_gives_exactly_minus_ln_n() {
        for (n, v) in [
            (1usize, 0.0f32),
            (2, 5.5),
            (3, -1.0),
            (4096, 1e30),
            (151_936, -7.25),
        ] {
            let lp = log_softmax(&vec![v; n]);
            // `0 - ln(n)`: -ln(n), and +0.0 (not -0.0) for one token.
            let want = 0.0 - libm::log(n as f64);
            assert!(lp.iter().all(|&x| x.to_bits() == want.to_bits()), "n={n}");
        }
        assert_eq!(log_softmax(&[3.0])[0].to_bits(), 0.0f64.to_bits());
        assert_eq!(log_softmax(&[1.0; 4])[0], -(4.0f64.ln()));
    }

    #[test]
    fn ties_get_equal_logprobs_and_probabilities_sum_to_one() {
        let r = [1.0f32, 2.0, 2.0, -3.0, 2.0];
        let lp = log_softmax(&r);
        assert_eq!(lp[1].to_bits(), lp[2].to_bits());
        assert_eq!(lp[1].to_bits(), lp[4].to_bits());
        assert!(lp[1] > lp[0] && lp[0] > lp[3]);
        let total: f64 = lp.iter().map(|&x| x.exp()).sum();
        assert!((total - 1.0).abs() < 1e-15);
    }

    #[test]
    fn huge_and_infinite_logits() {
        // The max is subtracted first, so f32::MAX neither overflows nor loses the others.
        let lp = log_softmax(&[f32::MAX, f32::MAX, 0.0]);
        assert_eq!(lp[0], -libm::log(2.0));
        assert_eq!(lp[2], -f64::from(f32::MAX) - libm::log(2.0));
        // -inf is a token with no mass, and costs the others nothing.
        let lp = log_softmax(&[f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY]);
        assert_eq!(lp, vec![f64::NEG_INFINITY, 0.0, f64::NEG_INFINITY]);
        // No distribution: NaN everywhere, never a number that looks like one.
        for bad in [
            vec![f32::NAN, 0.0],
            vec![f32::INFINITY, 0.0],
            vec![f32::NEG_INFINITY; 3],
        ] {
            assert!(log_softmax(&bad).iter().all(|x| x.is_nan()), "{bad:?}");
        }
        assert!(log_softmax(&[]).is_empty());
        assert!(top_logprobs(&[], 3).is_empty());
    }

    #[test]
    fn token_logprob_and_top_logprobs_are_the_same_bits_as_the_row() {
        let r = row(5000, 9, 12.0);
        let lp = log_softmax(&r);
        for t in [0u32, 1, 77, 4999] {
            assert_eq!(token_logprob(&r, t).to_bits(), lp[t as usize].to_bits());
        }
        let top = top_logprobs(&r, 10);
        assert_eq!(top.len(), 10);
        assert_eq!(top[0].0, argmax(&r));
        // Against a full sort of the independent reference.
        let mut ids: Vec<usize> = (0..r.len()).collect();
        ids.sort_by(|&a, &b| lp[b].partial_cmp(&lp[a]).unwrap().then(a.cmp(&b)));
        for (j, &(t, l)) in top.iter().enumerate() {
            assert_eq!(t as usize, ids[j]);
            assert_eq!(l.to_bits(), lp[ids[j]].to_bits());
        }
    }

    #[test]
    fn top_logprobs_breaks_ties_by_the_lower_id_and_ranks_nan_last() {
        let r = [0.5f32, 2.0, f32::NAN, 2.0, -0.0, 0.0, 2.0];
        let top: Vec<u32> = top_logprobs(&r, 7).into_iter().map(|p| p.0).collect();
        assert_eq!(top, vec![1, 3, 6, 0, 4, 5, 2]);
        assert_eq!(top[0], argmax(&r));
        let top2: Vec<u32> = top_logprobs(&r, 2).into_iter().map(|p| p.0).collect();
        assert_eq!(top2, vec![1, 3]);
        assert_eq!(top_logprobs(&r, 100).len(), 7);
        assert!(top_logprobs(&r, 0).is_empty());
    }
}
