//! Tarfa's runtime: runs Mixture-of-Experts decoders exactly, as docs/EXACTNESS.md defines —
//! BF16 weights as stored, the config's own router, f32 arithmetic in one canonical order, and
//! the same bits for every logit whatever the thread count, batch, SIMD path, backend or cache
//! state.
//!
//! Layout:
//! - [`numerics`]: the contract's functions, canonical reductions (scalar reference + SIMD),
//!   row-parallel matrix products, RoPE tables.
//! - [`config`] and [`model`] (re-exported from `tarfa-core`, which the converter shares): a
//!   Hugging Face `config.json` parsed and validated into [`config::MoeConfig`], and family
//!   descriptions ([`model::Family`]) resolved into an [`model::ArchSpec`].
//! - [`weights`]: the [`weights::WeightSource`] trait (verified tensors by name, experts per
//!   layer) and an in-memory source loaded from safetensors.
//! - [`cpu`]: the CPU backend — forward pass with a KV cache, the specification other backends
//!   reproduce.
//! - [`cuda`]: the CUDA backend (cargo feature `cuda`, on by default) — the same forward on an
//!   NVIDIA GPU, bit for bit, with kernels from kernels/*.cu compiled at run time by NVRTC.
//! - [`stream`]: expert streaming — experts read from the bundle on demand into a RAM tier under
//!   a byte budget, verified in the buffer they are computed from, with the same bits.
//! - [`generate`]: greedy decoding on top of a backend.
//!
//! The library must never approximate silently: anything it cannot compute exactly is an error,
//! and the one deliberately inexact arm ([`cpu::FinalHidden::InvalidBf16BeforeLmHead`]) is
//! labelled and never a default.

pub mod bundle;
pub mod cpu;
pub mod cuda;
pub mod generate;
pub mod numerics;
pub mod stream;
pub mod weights;

// The family facts live in tarfa-core, shared with the converter; re-exported so that
// `crate::config` and `crate::model` keep their paths here.
pub use tarfa_core::{config, model};

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
}
