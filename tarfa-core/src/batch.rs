//! One forward step over several sequences ([`Backend::forward_batch`](crate::Backend)): what
//! each sequence brings to the step, the cache operations a failed step needs to undo itself, and
//! the step's error, which names the sequence at fault.
//!
//! The contract (docs/EXACTNESS.md, "Batching"): each sequence's [`ForwardOutput`] (logits,
//! router records, counters) is bit-identical to what [`Backend::forward`](crate::Backend) on
//! that sequence alone returns, whatever else shares the step. All or nothing: on an error no
//! cache has advanced.
//!
//! [`ForwardOutput`]: crate::step::ForwardOutput

use crate::step::ForwardOptions;

/// One sequence's part of a batched step: its cache, the tokens to run at positions
/// `cache.len()..`, and what it wants back.
pub struct BatchEntry<'a, C> {
    pub cache: &'a mut C,
    pub tokens: &'a [u32],
    pub opts: ForwardOptions,
}

/// What a batched step needs from a sequence's cache to undo itself.
pub trait Rewind {
    /// Positions cached.
    fn cached_len(&self) -> usize;
    /// Forgets positions from `len` on and returns the positions kept: `min(len, cached_len)`,
    /// or fewer when the cache no longer holds what a query at `len` would read: 0 for a sliding
    /// window's or a chunk's dropped rows, or for a gated DeltaNet state before the last step;
    /// that step's start for a state inside it (the state exists only there). The caller then
    /// re-feeds from what was kept. A rewind to the length a step started at is always served in
    /// full.
    #[must_use = "a rewind may keep fewer positions than asked: re-feed from what it returns"]
    fn rewind_to(&mut self, len: usize) -> usize;
}

/// A batched step's failure. No cache of the step has advanced.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct BatchError<E> {
    /// The index (in the step's entries) of the sequence whose input was refused (empty, a token
    /// outside the vocabulary, past its context); `None` when the step as a whole failed (a
    /// weight that did not verify, a device error), which no one sequence caused.
    pub sequence: Option<usize>,
    #[source]
    pub error: E,
}

impl<E> BatchError<E> {
    /// The error of the step as a whole.
    pub fn whole(error: E) -> Self {
        BatchError {
            sequence: None,
            error,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::step::{ForwardOutput, LogitRows, StepStats};
    use crate::{Backend, RunError};

    /// A cache that records its tokens; a backend whose logits are (position, token).
    #[derive(Default)]
    struct Toks(Vec<u32>);
    impl Rewind for Toks {
        fn cached_len(&self) -> usize {
            self.0.len()
        }
        fn rewind_to(&mut self, len: usize) -> usize {
            self.0.truncate(len);
            self.0.len()
        }
    }
    struct Echo;
    impl Backend for Echo {
        type Cache = Toks;
        type Error = RunError;
        fn forward(
            &self,
            c: &mut Toks,
            t: &[u32],
            _o: &ForwardOptions,
        ) -> Result<ForwardOutput, RunError> {
            if let Some(&bad) = t.iter().find(|&&x| x >= 100) {
                return Err(RunError::TokenOutOfRange {
                    token: bad,
                    vocab: 100,
                });
            }
            let logits = t
                .iter()
                .enumerate()
                .map(|(i, &x)| vec![(c.0.len() + i) as f32, x as f32])
                .collect();
            c.0.extend_from_slice(t);
            Ok(ForwardOutput {
                logits,
                router: Vec::new(),
                stats: StepStats {
                    weight_bytes: t.len() as u64,
                    experts_fetched: 0,
                },
            })
        }
    }

    fn opts() -> ForwardOptions {
        ForwardOptions {
            logits: LogitRows::All,
            ..Default::default()
        }
    }

    #[test]
    fn the_default_loop_returns_each_sequences_own_output_in_order() {
        let (mut a, mut b) = (Toks(vec![1]), Toks::default());
        let mut step = [
            BatchEntry {
                cache: &mut a,
                tokens: &[5],
                opts: opts(),
            },
            BatchEntry {
                cache: &mut b,
                tokens: &[7, 8],
                opts: opts(),
            },
        ];
        let outs = Echo.forward_batch(&mut step).unwrap();
        assert_eq!(outs[0].logits, vec![vec![1.0, 5.0]]);
        assert_eq!(outs[1].logits, vec![vec![0.0, 7.0], vec![1.0, 8.0]]);
        assert_eq!(outs[1].stats.weight_bytes, 2);
        assert_eq!((a.0, b.0), (vec![1, 5], vec![7, 8]));
    }

    #[test]
    fn the_default_loop_undoes_the_sequences_before_a_failing_one() {
        let (mut a, mut b, mut c) = (Toks(vec![1]), Toks(vec![2, 3]), Toks::default());
        let mut step = [
            BatchEntry {
                cache: &mut a,
                tokens: &[5, 6],
                opts: opts(),
            },
            BatchEntry {
                cache: &mut b,
                tokens: &[9, 100],
                opts: opts(),
            },
            BatchEntry {
                cache: &mut c,
                tokens: &[4],
                opts: opts(),
            },
        ];
        let err = Echo.forward_batch(&mut step).unwrap_err();
        assert_eq!(err.sequence, Some(1));
        assert!(matches!(
            err.error,
            RunError::TokenOutOfRange { token: 100, .. }
        ));
        assert_eq!((a.0, b.0, c.0), (vec![1], vec![2, 3], vec![]));
    }
}
