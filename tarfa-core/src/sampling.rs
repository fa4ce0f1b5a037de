//! Exact sampling: a token drawn from one row of f32 logits under temperature, top-k, top-p,
//! min-p and the repetition / frequency / presence penalties, with its randomness from a
//! counter-based generator, so that the token depends only on (logits, history, params, seed,
//! request, step): never on the batch, the thread count or the backend that computed the logits.
//! docs/EXACTNESS.md section 8 is the definition this module implements.
//!
//! The randomness is Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as
//! easy as 1, 2, 3", SC 2011), written here from its published definition and checked against
//! Random123's known-answer vectors. Neither crate that offers it (`philox` 0.0.0, `rand_philox`
//! 0.2) is an established one, and the function is twenty lines.
//!
//! This module must never draw from a generator with state (a draw is a pure function of its
//! counter), and must never compute a probability in another order than section 8's.

use crate::generate::argmax;
use crate::logprob::{by_logit, Normaliser};

/// Philox4x32's multipliers and Weyl key increments (Random123's PHILOX_M4x32_0/1, PHILOX_W32_0/1).
const PHILOX_M: [u32; 2] = [0xD251_1F53, 0xCD9E_8D57];
const PHILOX_W: [u32; 2] = [0x9E37_79B9, 0xBB67_AE85];

/// Philox4x32 with `rounds` rounds: the block of four words for counter `ctr` under `key`.
/// Each round multiplies words 0 and 2 (high and low halves of the 64-bit products), and the key
/// is bumped by the Weyl increments between rounds.
pub fn philox4x32(rounds: u32, mut ctr: [u32; 4], mut key: [u32; 2]) -> [u32; 4] {
    for r in 0..rounds {
        if r > 0 {
            key[0] = key[0].wrapping_add(PHILOX_W[0]);
            key[1] = key[1].wrapping_add(PHILOX_W[1]);
        }
        let p0 = u64::from(PHILOX_M[0]) * u64::from(ctr[0]);
        let p1 = u64::from(PHILOX_M[1]) * u64::from(ctr[2]);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        ctr = [hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0];
    }
    ctr
}

/// Philox4x32-10, the standard ten rounds.
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    philox4x32(10, ctr, key)
}

/// The uniform draw in [0, 1) of (seed, request, step): Philox4x32-10 with key (seed low word,
/// seed high word) at counter (request low, request high, step low, step high); the top 53 bits
/// of `(out[0] << 32) | out[1]`, times 2^-53 (exact).
pub fn uniform(seed: u64, request: u64, step: u64) -> f64 {
    let out = philox4x32_10(
        [
            request as u32,
            (request >> 32) as u32,
            step as u32,
            (step >> 32) as u32,
        ],
        [seed as u32, (seed >> 32) as u32],
    );
    let bits = ((u64::from(out[0]) << 32) | u64::from(out[1])) >> 11;
    bits as f64 * (1.0 / (1u64 << 53) as f64)
}

/// How to choose each token. The default is greedy: temperature 0, every filter and penalty off.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// Logits are divided by it (f32). 0 is greedy: the largest penalised logit.
    pub temperature: f32,
    /// Keep the k largest logits (and every logit equal to the k-th); 0 keeps all.
    pub top_k: usize,
    /// Keep the most probable tokens until their mass reaches it; 1 keeps all. In (0, 1].
    pub top_p: f64,
    /// Keep tokens whose probability is at least `min_p` times the largest; 0 keeps all.
    pub min_p: f64,
    /// transformers' repetition penalty on every token of the history: a logit x >= 0 becomes
    /// x / penalty, a negative one x * penalty. 1 is none.
    pub repetition_penalty: f32,
    /// Subtracted from a logit once per occurrence of its token in the history. 0 is none.
    pub frequency_penalty: f32,
    /// Subtracted from a logit whose token occurs in the history at all. 0 is none.
    pub presence_penalty: f32,
    /// The generator's key.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: 0,
        }
    }
}

/// A sampling setting out of its range. Each names the setting (as the request field is
/// spelled; the CLI flag is the same with dashes) and the value refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// Negative, NaN or infinite.
    #[error("temperature must be a finite number >= 0 (0 is greedy), got {0}")]
    Temperature(f32),
    /// Outside (0, 1].
    #[error("top_p must be in (0, 1] (1 keeps every token), got {0}")]
    TopP(f64),
    /// Outside [0, 1].
    #[error("min_p must be in [0, 1] (0 keeps every token), got {0}")]
    MinP(f64),
    /// Not a finite number > 0.
    #[error("repetition_penalty must be a finite number > 0 (1 is none), got {0}")]
    RepetitionPenalty(f32),
    /// Outside [-2, 2], OpenAI's and vLLM's range.
    #[error("frequency_penalty must be in [-2, 2] (0 is none), got {0}")]
    FrequencyPenalty(f32),
    /// Outside [-2, 2].
    #[error("presence_penalty must be in [-2, 2] (0 is none), got {0}")]
    PresencePenalty(f32),
}

impl SamplingError {
    /// The setting's name, as a request field spells it (`top_p`).
    pub fn setting(&self) -> &'static str {
        match self {
            SamplingError::Temperature(_) => "temperature",
            SamplingError::TopP(_) => "top_p",
            SamplingError::MinP(_) => "min_p",
            SamplingError::RepetitionPenalty(_) => "repetition_penalty",
            SamplingError::FrequencyPenalty(_) => "frequency_penalty",
            SamplingError::PresencePenalty(_) => "presence_penalty",
        }
    }
}

impl SamplingParams {
    /// Whether every token is the largest raw logit (lowest id among equals): temperature 0
    /// and no penalty. Then no logits need to reach the host at all (the GPU's greedy step).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 && !self.has_penalties()
    }

    /// Whether any penalty changes the logits.
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
    }

    /// Refuses a value out of its range, naming the setting.
    pub fn validate(&self) -> Result<(), SamplingError> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(SamplingError::Temperature(t));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingError::MinP(self.min_p));
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0) {
            return Err(SamplingError::RepetitionPenalty(r));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err(SamplingError::FrequencyPenalty(self.frequency_penalty));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return Err(SamplingError::PresencePenalty(self.presence_penalty));
        }
        Ok(())
    }
}

/// Applies the penalties to `logits` in place, for each distinct token of `history` (ids
/// outside the row are ignored): the repetition penalty (transformers'
/// `RepetitionPenaltyLogitsProcessor`), then `x - f32(count) * frequency_penalty`, then
/// `x - presence_penalty` (vLLM's and OpenAI's), each operation rounded to f32.
pub fn apply_penalties(logits: &mut [f32], history: &[u32], p: &SamplingParams) {
    if !p.has_penalties() {
        return;
    }
    let mut counts = std::collections::BTreeMap::<u32, u32>::new();
    for &t in history {
        if (t as usize) < logits.len() {
            *counts.entry(t).or_default() += 1;
        }
    }
    for (t, count) in counts {
        let x = &mut logits[t as usize];
        if p.repetition_penalty != 1.0 {
            *x = if *x < 0.0 {
                *x * p.repetition_penalty
            } else {
                *x / p.repetition_penalty
            };
        }
        if p.frequency_penalty != 0.0 {
            *x -= count as f32 * p.frequency_penalty;
        }
        if p.presence_penalty != 0.0 {
            *x -= p.presence_penalty;
        }
    }
}

/// The token chosen at generation step `step` of request `request`: the penalties, then (unless
/// greedy) temperature, top-k, top-p and min-p in that order (transformers' order of its logits
/// processors), then the inverse of the remaining tokens' cumulative distribution at the
/// Philox draw of (seed, request, step). EXACTNESS.md section 8 spells every operation.
///
/// `history` is every token before this one (prompt and generated); `params` should have passed
/// [`SamplingParams::validate`]. A row with no distribution (a NaN or +inf logit after the
/// penalties and temperature) gives its [`argmax`], never a panic.
pub fn sample(
    logits: &[f32],
    history: &[u32],
    params: &SamplingParams,
    request: u64,
    step: u64,
) -> u32 {
    let mut x = logits.to_vec();
    apply_penalties(&mut x, history, params);
    if params.temperature == 0.0 || x.is_empty() {
        return argmax(&x);
    }
    if params.temperature != 1.0 {
        for v in &mut x {
            *v /= params.temperature;
        }
    }
    if x.iter().any(|v| v.is_nan() || *v == f32::INFINITY) {
        return argmax(&x);
    }
    // The tokens still in play, in increasing id; a filter turns the others' logits to -inf.
    let mut kept: Vec<u32> = (0..x.len() as u32)
        .filter(|&t| x[t as usize] != f32::NEG_INFINITY)
        .collect();
    if kept.is_empty() {
        return argmax(&x);
    }
    if params.top_k > 0 && params.top_k < kept.len() {
        let mut order = kept.clone();
        order.select_nth_unstable_by(params.top_k - 1, |&a, &b| by_logit(&x, a, b));
        let threshold = x[order[params.top_k - 1] as usize];
        // Every logit equal to the k-th stays, as transformers' `scores < topk(...)[-1]` keeps it.
        remove(&mut x, &mut kept, |v| v < threshold);
    }
    if params.top_p < 1.0 {
        let n = Normaliser::of(&x);
        let mut order = kept.clone();
        order.sort_unstable_by(|&a, &b| by_logit(&x, a, b));
        let mut mass_before = 0.0f64;
        let mut cut = order.len();
        for (j, &t) in order.iter().enumerate() {
            if mass_before >= params.top_p {
                cut = j;
                break;
            }
            mass_before += libm::exp(n.logprob(x[t as usize]));
        }
        for &t in &order[cut..] {
            x[t as usize] = f32::NEG_INFINITY;
        }
        kept.retain(|&t| x[t as usize] != f32::NEG_INFINITY);
    }
    if params.min_p > 0.0 {
        let n = Normaliser::of(&x);
        let best = kept
            .iter()
            .map(|&t| x[t as usize])
            .fold(f32::NEG_INFINITY, f32::max);
        let floor = params.min_p * libm::exp(n.logprob(best));
        let probs: Vec<(u32, f64)> = kept
            .iter()
            .map(|&t| (t, libm::exp(n.logprob(x[t as usize]))))
            .collect();
        for (t, p) in probs {
            if p < floor {
                x[t as usize] = f32::NEG_INFINITY;
            }
        }
        kept.retain(|&t| x[t as usize] != f32::NEG_INFINITY);
    }
    let n = Normaliser::of(&x);
    let probs: Vec<f64> = kept
        .iter()
        .map(|&t| libm::exp(n.logprob(x[t as usize])))
        .collect();
    let mut total = 0.0f64;
    for &p in &probs {
        total += p;
    }
    let target = uniform(params.seed, request, step) * total;
    let mut cumulative = 0.0f64;
    for (&t, &p) in kept.iter().zip(&probs) {
        cumulative += p;
        if target < cumulative {
            return t;
        }
    }
    // Only when `u * total` rounded up to `total`: the last token with any mass.
    kept.iter()
        .zip(&probs)
        .rev()
        .find(|(_, &p)| p > 0.0)
        .map_or(kept[0], |(&t, _)| t)
}

/// Sets the logits of the kept tokens that `drop` selects to -inf and forgets them.
fn remove(x: &mut [f32], kept: &mut Vec<u32>, drop: impl Fn(f32) -> bool) {
    kept.retain(|&t| {
        let gone = drop(x[t as usize]);
        if gone {
            x[t as usize] = f32::NEG_INFINITY;
        }
        !gone
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's tests/kat_vectors, the philox4x32 lines (counter, key, expected), from
    /// github.com/DEShawResearch/random123 at commit 9545ff6413f258be2f04c1d319d99aaef7521150.
    /// (rounds, counter, key, expected block).
    type KnownAnswer = (u32, [u32; 4], [u32; 2], [u32; 4]);

    const KAT: [KnownAnswer; 6] = [
        (
            7,
            [0, 0, 0, 0],
            [0, 0],
            [0x5f6fb709, 0x0d893f64, 0x4f121f81, 0x4f730a48],
        ),
        (
            7,
            [0xffffffff; 4],
            [0xffffffff; 2],
            [0x5207ddc2, 0x45165e59, 0x4d8ee751, 0x8c52f662],
        ),
        (
            7,
            [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
            [0xa4093822, 0x299f31d0],
            [0x4dfccaba, 0x190a87f0, 0xc47362ba, 0xb6b5242a],
        ),
        (
            10,
            [0, 0, 0, 0],
            [0, 0],
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8],
        ),
        (
            10,
            [0xffffffff; 4],
            [0xffffffff; 2],
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd],
        ),
        (
            10,
            [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
            [0xa4093822, 0x299f31d0],
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
        ),
    ];

    #[test]
    fn philox_matches_random123s_known_answers() {
        for (rounds, ctr, key, want) in KAT {
            assert_eq!(
                philox4x32(rounds, ctr, key),
                want,
                "{rounds} rounds, {ctr:x?}"
            );
        }
        assert_eq!(philox4x32_10(KAT[5].1, KAT[5].2), KAT[5].3);
    }

    #[test]
    fn uniform_is_in_the_unit_interval_and_a_function_of_its_counter() {
        let mut sum = 0.0;
        for step in 0..10_000u64 {
            let u = uniform(42, 3, step);
            assert!((0.0..1.0).contains(&u));
            assert_eq!(u.to_bits(), uniform(42, 3, step).to_bits());
            sum += u;
        }
        assert!(
            (sum / 10_000.0 - 0.5).abs() < 0.01,
            "mean {}",
            sum / 10_000.0
        );
        assert_ne!(uniform(42, 3, 0), uniform(43, 3, 0));
        assert_ne!(uniform(42, 3, 0), uniform(42, 4, 0));
        assert_ne!(
            uniform(42, 1 << 32, 0),
            uniform(42, 0, 0),
            "the high word counts"
        );
        assert_ne!(uniform(1 << 32, 0, 0), uniform(0, 0, 0));
    }

    /// A fixed pseudo-random row (xorshift) in [-scale, scale).
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

    fn params(temperature: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            seed,
            ..SamplingParams::default()
        }
    }

    fn draws(logits: &[f32], p: &SamplingParams, n: u64) -> Vec<u32> {
        (0..n).map(|s| sample(logits, &[], p, 0, s)).collect()
    }

    #[test]
    fn the_default_is_greedy_and_valid() {
        let p = SamplingParams::default();
        assert!(p.is_greedy());
        assert_eq!(p.validate(), Ok(()));
        assert!(!params(0.7, 1).is_greedy());
        let penalised = SamplingParams {
            repetition_penalty: 1.1,
            ..p
        };
        assert!(!penalised.is_greedy());
    }

    #[test]
    fn temperature_zero_and_top_k_one_are_greedy() {
        for seed in 0..20u64 {
            let r = row(1000, seed + 1, 8.0);
            let want = argmax(&r);
            for step in 0..5 {
                assert_eq!(sample(&r, &[], &params(0.0, seed), 7, step), want);
                let k1 = SamplingParams {
                    top_k: 1,
                    ..params(1.3, seed)
                };
                assert_eq!(sample(&r, &[], &k1, 7, step), want);
                // A tiny top_p keeps only the most probable token too.
                let p0 = SamplingParams {
                    top_p: 1e-9,
                    ..params(1.0, seed)
                };
                assert_eq!(sample(&r, &[], &p0, 7, step), want);
            }
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_tokens_and_another_seed_others() {
        let r = row(200, 5, 2.0);
        let a = draws(&r, &params(1.0, 11), 64);
        assert_eq!(a, draws(&r, &params(1.0, 11), 64));
        assert_ne!(a, draws(&r, &params(1.0, 12), 64));
        // The request is part of the counter: the same seed on another request differs.
        let other: Vec<u32> = (0..64)
            .map(|s| sample(&r, &[], &params(1.0, 11), 1, s))
            .collect();
        assert_ne!(a, other);
    }

    /// Pearson's chi-square of `counts` against `probs` over `n` draws.
    fn chi_square(counts: &[u64], probs: &[f64], n: u64) -> f64 {
        counts
            .iter()
            .zip(probs)
            .map(|(&c, &p)| {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    #[test]
    fn draws_follow_the_softmax_distribution() {
        // ln of the probabilities 0.4, 0.3, 0.2, 0.1, at temperature 0.5 from doubled logits.
        let probs = [0.4f64, 0.3, 0.2, 0.1];
        let logits: Vec<f32> = probs.iter().map(|p| (2.0 * p.ln()) as f32).collect();
        let n = 20_000u64;
        let mut counts = [0u64; 4];
        for t in draws(&logits, &params(2.0, 2026), n) {
            counts[t as usize] += 1;
        }
        let chi = chi_square(&counts, &probs, n);
        // 3 degrees of freedom: P(chi2 > 16.27) = 0.001. The draws are fixed by the seed, so
        // this either always passes or always fails; a wrong distribution (probabilities off
        // by 0.02) gives a chi-square in the hundreds.
        assert!(chi < 16.27, "chi-square {chi}, counts {counts:?}");
    }

    #[test]
    fn top_p_and_min_p_keep_the_stated_sets() {
        let probs = [0.05f64, 0.5, 0.15, 0.3];
        let logits: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();
        let n = 6000;
        // top_p 0.75: token 1 (mass before it 0) and token 3 (0.5 < 0.75); token 2 has 0.8
        // before it. The kept pair is renormalised: 0.5 : 0.3.
        let top_p = SamplingParams {
            top_p: 0.75,
            ..params(1.0, 9)
        };
        let mut counts = [0u64; 4];
        for t in draws(&logits, &top_p, n) {
            counts[t as usize] += 1;
        }
        assert_eq!((counts[0], counts[2]), (0, 0), "{counts:?}");
        let chi = chi_square(&[counts[1], counts[3]], &[0.625, 0.375], n);
        assert!(chi < 10.83, "chi-square {chi}, {counts:?}");
        // min_p 0.35: the floor is 0.175, so tokens 1 and 3 again.
        let min_p = SamplingParams {
            min_p: 0.35,
            ..params(1.0, 9)
        };
        let kept: std::collections::BTreeSet<u32> =
            draws(&logits, &min_p, 2000).into_iter().collect();
        assert_eq!(kept.into_iter().collect::<Vec<_>>(), vec![1, 3]);
        // top_k 2 keeps the same two; top_k 3 lets token 2 in.
        let k2 = SamplingParams {
            top_k: 2,
            ..params(1.0, 9)
        };
        let kept: std::collections::BTreeSet<u32> = draws(&logits, &k2, 2000).into_iter().collect();
        assert_eq!(kept.into_iter().collect::<Vec<_>>(), vec![1, 3]);
        let k3 = SamplingParams { top_k: 3, ..k2 };
        let kept: std::collections::BTreeSet<u32> = draws(&logits, &k3, 2000).into_iter().collect();
        assert_eq!(kept.into_iter().collect::<Vec<_>>(), vec![1, 2, 3]);
    }

    #[test]
    fn top_k_keeps_every_logit_equal_to_the_kth() {
        let logits = [1.0f32, 3.0, 2.0, 2.0, 0.0];
        let k2 = SamplingParams {
            top_k: 2,
            ..params(1.0, 3)
        };
        let kept: std::collections::BTreeSet<u32> = draws(&logits, &k2, 3000).into_iter().collect();
        assert_eq!(kept.into_iter().collect::<Vec<_>>(), vec![1, 2, 3]);
    }

    #[test]
    fn penalties_are_applied_as_transformers_and_vllm_do() {
        // Hand-computed: repetition 2 divides the positive logits of seen tokens and multiplies
        // the negative ones; then frequency 0.5 per occurrence and presence 0.25 once.
        let mut x = [2.0f32, -1.0, 1.6, 3.0, -4.0];
        let history = [0, 1, 1, 3, 99];
        let p = SamplingParams {
            repetition_penalty: 2.0,
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..SamplingParams::default()
        };
        apply_penalties(&mut x, &history, &p);
        // 2/2 - 0.5 - 0.25; -1*2 - 2*0.5 - 0.25; unseen; 3/2 - 0.5 - 0.25; unseen.
        assert_eq!(x, [0.25, -3.25, 1.6, 0.75, -4.0]);
        // Greedy under penalties: token 2 now leads, where the raw argmax is 3.
        let raw = [2.0f32, -1.0, 1.6, 3.0, -4.0];
        assert_eq!(argmax(&raw), 3);
        assert_eq!(sample(&raw, &history, &p, 0, 0), 2);
        // A repeated token is penalised by the repetition penalty once, not per occurrence.
        let mut y = [4.0f32];
        apply_penalties(
            &mut y,
            &[0, 0, 0],
            &SamplingParams {
                repetition_penalty: 2.0,
                ..SamplingParams::default()
            },
        );
        assert_eq!(y, [2.0]);
    }

    #[test]
    fn validate_names_the_setting_refused() {
        let d = SamplingParams::default();
        let cases = [
            (
                SamplingParams {
                    temperature: -0.1,
                    ..d
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..d
                },
                "temperature",
            ),
            (
                SamplingParams {
                    temperature: f32::INFINITY,
                    ..d
                },
                "temperature",
            ),
            (SamplingParams { top_p: 0.0, ..d }, "top_p"),
            (SamplingParams { top_p: 1.5, ..d }, "top_p"),
            (
                SamplingParams {
                    top_p: f64::NAN,
                    ..d
                },
                "top_p",
            ),
            (SamplingParams { min_p: -0.5, ..d }, "min_p"),
            (SamplingParams { min_p: 2.0, ..d }, "min_p"),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..d
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    repetition_penalty: f32::INFINITY,
                    ..d
                },
                "repetition_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: 2.5,
                    ..d
                },
                "frequency_penalty",
            ),
            (
                SamplingParams {
                    presence_penalty: -3.0,
                    ..d
                },
                "presence_penalty",
            ),
        ];
        for (p, name) in cases {
            let e = p.validate().unwrap_err();
            assert_eq!(e.setting(), name);
            assert!(e.to_string().starts_with(name), "{e}");
        }
        let fine = SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 1.0,
            min_p: 1.0,
            repetition_penalty: 0.5,
            frequency_penalty: -2.0,
            presence_penalty: 2.0,
            seed: u64::MAX,
        };
        assert_eq!(fine.validate(), Ok(()));
    }

    #[test]
    fn rows_without_a_distribution_give_the_argmax() {
        let p = params(1.0, 1);
        assert_eq!(sample(&[0.0, f32::INFINITY, 1.0], &[], &p, 0, 0), 1);
        assert_eq!(sample(&[f32::NEG_INFINITY; 3], &[], &p, 0, 0), 0);
        assert_eq!(sample(&[0.5, f32::NAN], &[], &p, 0, 0), 0);
        assert_eq!(sample(&[], &[], &p, 0, 0), 0);
        // -inf tokens are never drawn.
        let r = [f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY, 0.0];
        assert!(draws(&r, &p, 500).iter().all(|&t| t == 1 || t == 3));
    }
}
