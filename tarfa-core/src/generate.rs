//! Greedy decoding on any [`Backend`]: prefill the prompt, then one token at a time, always the
//! largest logit (lowest index among equals). The one decode loop: the CPU and CUDA backends
//! both run through it.
//!
//! This module only sequences forward steps; it must never touch the arithmetic.

use crate::step::{ForwardOptions, ForwardOutput, LogitRows, RouterRecord};
use crate::Backend;

/// The index of the largest logit, the lowest among equals. NaN never wins (comparisons with NaN
/// are false); an all-NaN row gives 0.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate().skip(1) {
        if v > logits[best] || logits[best].is_nan() && !v.is_nan() {
            best = i;
        }
    }
    best as u32
}

/// What a greedy run produced.
#[derive(Clone, Debug, Default)]
pub struct Greedy {
    /// The prefill step's output (logits of every prompt position when asked for).
    pub prefill: ForwardOutput,
    /// The generated tokens.
    pub tokens: Vec<u32>,
    /// Row j: the logits that chose `tokens[j]`.
    pub step_logits: Vec<Vec<f32>>,
    /// Router records of the decode steps (when traced).
    pub decode_router: Vec<RouterRecord>,
}

/// Greedy decoding of `n_new` tokens after `prompt` (EOS is not treated specially: the caller
/// decides when to stop). `opts.logits` applies to the prefill step.
pub fn greedy<B: Backend>(
    engine: &B,
    cache: &mut B::Cache,
    prompt: &[u32],
    n_new: usize,
    opts: &ForwardOptions,
) -> Result<Greedy, B::Error> {
    let prefill = engine.forward(cache, prompt, opts)?;
    let mut out = Greedy::default();
    let mut last = prefill.logits.last().cloned().unwrap_or_default();
    out.prefill = prefill;
    let step_opts = ForwardOptions {
        logits: LogitRows::Last,
        ..*opts
    };
    for j in 0..n_new {
        let next = argmax(&last);
        out.tokens.push(next);
        out.step_logits.push(std::mem::take(&mut last));
        if j + 1 == n_new {
            break;
        }
        let step = engine.forward(cache, &[next], &step_opts)?;
        out.decode_router.extend(step.router);
        last = step.logits.into_iter().next().unwrap_or_default();
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::argmax;

    #[test]
    fn argmax_takes_the_lowest_index_among_equals() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0, 0.5]), 1);
        assert_eq!(argmax(&[0.0, -0.0]), 0);
        assert_eq!(argmax(&[-1.0]), 0);
    }
}
