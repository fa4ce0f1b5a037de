//! Tarfa's runtime: runs Mixture-of-Experts decoders exactly, as docs/EXACTNESS.md defines —
//! BF16 weights as stored, the config's own router, f32 arithmetic in one canonical order, and
//! the same bits for every logit whatever the thread count, batch, SIMD path, backend or cache
//! state.
//!
//! Layout:
//! - [`numerics`]: the contract's functions, canonical reductions (scalar reference + SIMD),
//!   row-parallel matrix products, RoPE tables.
//! - [`config`]: a Hugging Face `config.json` parsed and validated into [`config::MoeConfig`].
//! - [`model`]: family descriptions ([`model::Family`], one small file each) resolved into an
//!   [`model::ArchSpec`].
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

// The crates this one was split into, under their old paths (tarfa_run::cpu, ...), so that the
// CLI, the tests and the examples keep their imports while the split goes on.
pub use tarfa_core::{config, generate, model, numerics, weights, RunError};
pub use tarfa_cpu as cpu;
pub use tarfa_cuda as cuda;
pub use tarfa_stream as stream;
pub use tarfa_stream::bundle;
