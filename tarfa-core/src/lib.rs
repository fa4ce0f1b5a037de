//! The core of Tarfa's runtime: what every backend shares, and nothing that belongs to one; and
//! the facts about Mixture-of-Experts families that the converter and the runtime share, so that a
//! checkpoint the runtime would refuse is refused before a conversion writes its first byte.
//!
//! - [`numerics`]: the exactness contract's functions (docs/EXACTNESS.md): canonical reductions
//!   (scalar reference + SIMD), row-parallel matrix products, RoPE tables.
//! - [`config`]: a Hugging Face `config.json` parsed and validated into [`config::MoeConfig`];
//!   every feature the runtime does not implement (YaRN, sliding windows, another activation) is
//!   an error naming its key.
//! - [`model`]: family descriptions ([`model::Family`], one small file each) resolved into an
//!   [`model::ArchSpec`] (which layers are dense, which biases and norms exist, tensor names).
//! - [`shapes`]: the shape rules: every tensor a config implies, with its expected shape and
//!   whether the runtime needs it, and every expert matrix's shape.
//! - [`tokenizer`]: whether a `tokenizer.json` loads and fits the model's vocabulary.
//! - [`weights`]: the weight seam — the [`weights::WeightSource`] trait (verified tensors by
//!   name, experts per layer), its error, and an in-memory source loaded from safetensors.
//! - [`resident`]: the non-expert weights as every backend loads them.
//! - [`step`]: what a forward step takes and returns, the same types for every backend.
//! - [`chat`]: the bundle's chat template rendered with minijinja as transformers renders it.
//! - [`logprob`]: the log-softmax of a row of logits in the contract's fixed order (f64), one
//!   token's log-probability, the top-k alternatives.
//! - [`sampling`]: exact sampling (temperature, top-k, top-p, min-p, penalties) from the f32
//!   logits, its randomness Philox4x32-10 keyed by the seed at counter (request, step).
//! - [`stop`]: stop strings over incrementally decoded text.
//! - [`Backend`] and [`generate`]: the one greedy decode loop, generic over the backend.
//! - [`speculate`]: exact speculative decoding: drafts (prompt lookup) verified in one step.
//! - [`batch`]: one step over several sequences ([`Backend::forward_batch`]), each sequence's
//!   output bit-identical to running it alone.
//! - [`exit`]: the documented exit codes, and [`RunError::exit_code`] mapping the runtime's
//!   errors onto them.
//!
//! This crate must never depend on a backend, a bundle reader or a CLI (they depend on it), do
//! I/O beyond parsing what it is handed (the safetensors loader reads the files it is pointed
//! at), and must never approximate silently: anything it cannot compute exactly is an error, and
//! the one deliberately inexact arm ([`step::FinalHidden::InvalidBf16BeforeLmHead`]) is labelled
//! and never a default.

pub mod batch;
pub mod chat;
pub mod config;
pub mod exit;
pub mod generate;
pub mod logprob;
pub mod model;
pub mod numerics;
pub mod resident;
pub mod sampling;
pub mod shapes;
pub mod speculate;
pub mod step;
pub mod stop;
pub mod tokenizer;
pub mod weights;

use batch::{BatchEntry, BatchError, Rewind};
use step::{ForwardOptions, ForwardOutput, LogitRows, StepStats};

/// A backend that runs forward steps on one sequence's cache: the CPU reference, the GPU.
pub trait Backend {
    /// One sequence's state (the KV cache).
    type Cache;
    /// The backend's error; every backend can report the runtime's own.
    type Error: From<RunError>;

    /// Runs `tokens` at positions `cache.len()..` (prefill when several, decode when one) and
    /// appends them to the cache. On error the cache is left as it was.
    fn forward(
        &self,
        cache: &mut Self::Cache,
        tokens: &[u32],
        opts: &ForwardOptions,
    ) -> Result<ForwardOutput, Self::Error>;

    /// One step over several sequences: runs each entry's tokens at positions `cache.len()..`
    /// of its own cache and appends them to it; returns the outputs in the entries' order.
    ///
    /// Each sequence's [`ForwardOutput`] is bit-identical to what [`Backend::forward`] on that
    /// sequence alone returns: its logits and router records, and its counters, which are the
    /// bytes and experts that sequence alone would have read (so no output depends on the
    /// batch; what the step as a whole read is at most their sum). All or nothing: on an error
    /// every cache is left as it was, and the error names the sequence whose input was refused.
    ///
    /// The default runs [`Backend::forward`] on one sequence after the other (rewinding those
    /// already run when one fails); a backend that reads each weight once for the whole step
    /// (the CPU's) overrides it.
    fn forward_batch(
        &self,
        seqs: &mut [BatchEntry<'_, Self::Cache>],
    ) -> Result<Vec<ForwardOutput>, BatchError<Self::Error>>
    where
        Self::Cache: Rewind,
    {
        let before: Vec<usize> = seqs.iter().map(|s| s.cache.cached_len()).collect();
        let mut outs = Vec::with_capacity(seqs.len());
        for index in 0..seqs.len() {
            let s = &mut seqs[index];
            match self.forward(s.cache, s.tokens, &s.opts) {
                Ok(out) => outs.push(out),
                Err(error) => {
                    for (done, &len) in seqs[..index].iter_mut().zip(&before) {
                        // back to the step's start: always served in full
                        let kept = done.cache.rewind_to(len);
                        assert_eq!(kept, len, "a failed step's undo keeps every position");
                    }
                    return Err(BatchError {
                        sequence: Some(index),
                        error,
                    });
                }
            }
        }
        Ok(outs)
    }

    /// One greedy decode step after `token`: the next token (the argmax of the step's logits)
    /// and the step's counters, for callers that keep neither the logits nor the router's
    /// records. The default runs [`Backend::forward`] and takes the argmax on the host; a
    /// backend that can choose the token where it computes it (the GPU) overrides this.
    fn greedy_step(
        &self,
        cache: &mut Self::Cache,
        token: u32,
    ) -> Result<(u32, StepStats), Self::Error> {
        let opts = ForwardOptions {
            logits: LogitRows::Last,
            ..ForwardOptions::default()
        };
        let out = self.forward(cache, &[token], &opts)?;
        Ok((generate::argmax(&out.logits[0]), out.stats))
    }

    /// One step over `tokens` and the greedy token after each: [`Backend::forward`] with the
    /// logits of every row, each reduced to its argmax (verifying drafts greedily,
    /// [`speculate`]). The default takes the argmaxes on the host; a backend that can choose
    /// them where it computes them (the GPU) may override this, with the same tokens.
    fn greedy_rows(
        &self,
        cache: &mut Self::Cache,
        tokens: &[u32],
    ) -> Result<(Vec<u32>, StepStats), Self::Error> {
        let opts = ForwardOptions {
            logits: LogitRows::All,
            ..ForwardOptions::default()
        };
        let out = self.forward(cache, tokens, &opts)?;
        Ok((
            out.logits.iter().map(|r| generate::argmax(r)).collect(),
            out.stats,
        ))
    }
}

/// An error from loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The config cannot be run.
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    /// A weight is missing, malformed or of the wrong shape.
    #[error(transparent)]
    Weights(#[from] weights::WeightError),
    /// The RoPE table cannot cover a position.
    #[error(transparent)]
    Rope(#[from] numerics::RopeError),
    /// The requested SIMD path is unavailable.
    #[error(transparent)]
    Kernel(#[from] numerics::KernelError),
    /// A forward step was given no tokens.
    #[error("a forward step needs at least one token")]
    EmptyStep,
    /// A token id is not in the vocabulary.
    #[error("token id {token} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { token: u32, vocab: usize },
    /// The sequence would exceed `max_position_embeddings`.
    #[error("the sequence would reach {needed} positions; the model allows {max}")]
    ContextFull { needed: usize, max: usize },
    /// The thread pool could not be built.
    #[error("cannot start the thread pool: {0}")]
    ThreadPool(String),
    /// A weight source broke its contract (a bug in the source).
    #[error("weight source error: {0}")]
    SourceContract(String),
    /// A step hook's intervention cannot be applied (the Python package's labelled
    /// interventions; never on the default path).
    #[error("intervention: {0}")]
    Intervention(String),
    /// A step hook stopped the step before it finished (Ctrl-C in the Python package); no
    /// cache was committed.
    #[error("the step was interrupted")]
    Interrupted,
}

impl RunError {
    /// The documented exit code ([`exit`]): a config, RoPE range, token or context the model
    /// cannot run is bad input; a weight error keeps [`WeightError::exit_code`]'s; a SIMD path
    /// the CPU lacks, a thread pool that cannot start or a weight source breaking its contract is
    /// a failure of the environment (or a bug).
    ///
    /// [`WeightError::exit_code`]: weights::WeightError::exit_code
    pub fn exit_code(&self) -> i32 {
        match self {
            RunError::Weights(w) => w.exit_code(),
            RunError::Config(_) | RunError::Rope(_) => exit::BAD_INPUT,
            RunError::TokenOutOfRange { .. }
            | RunError::EmptyStep
            | RunError::ContextFull { .. } => exit::BAD_INPUT,
            RunError::Kernel(_) | RunError::ThreadPool(_) => exit::ENVIRONMENT,
            RunError::SourceContract(_) => exit::ENVIRONMENT,
            RunError::Intervention(_) => exit::BAD_INPUT,
            RunError::Interrupted => exit::ENVIRONMENT,
        }
    }
}
