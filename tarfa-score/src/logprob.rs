// TEMPORARY: a verbatim copy of the `sampling` branch's tarfa_core::logprob (not yet committed
// there when this was written), so that this crate builds and its numbers are that module's.
// When `sampling` is merged, delete this file and make `crate::logprob` a re-export of
// `tarfa_core::logprob` (lib.rs).
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
/// among equals. The same order as greedy's [`argmax`](tarfa_core::generate::argmax): the first
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
