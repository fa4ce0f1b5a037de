//! Tarfa's runtime command, `tarfa-run`, over the crates that run Mixture-of-Experts decoders
//! exactly, as docs/EXACTNESS.md defines: BF16 weights as stored, the config's own router, f32
//! arithmetic in one canonical order, and the same bits for every logit whatever the thread
//! count, batch, SIMD path, backend or cache state.
//!
//! The library re-exports those crates under the paths the CLI, tests and examples use:
//! - [`numerics`], [`config`], [`model`], [`weights`], [`generate`], [`RunError`]: tarfa-core
//!   (the contract's numerics, config and families, the weight seam, the one greedy loop).
//! - [`cpu`]: tarfa-cpu, the CPU backend, the specification other backends reproduce.
//! - [`cuda`]: tarfa-cuda, the CUDA backend (cargo feature `cuda`, on by default; a stub
//!   without it), kernels from kernels/*.cu compiled at run time by NVRTC.
//! - [`stream`], [`bundle`]: tarfa-stream, the verified bundle reader and expert streaming.
//!
//! - [`cli`]: the `tarfa-run` command's subcommands and their exit codes (public so that
//!   tarfa-demo runs `generate` as the command does).
//!
//! This crate must never compute anything itself: numerics belong to the crates below, and
//! anything they cannot compute exactly is an error, never a silent approximation.

pub mod cli;

// The crates this one was split into, under their old paths (tarfa_run::cpu, ...), so that the
// CLI, the tests and the examples keep their imports while the split goes on.
pub use tarfa_core::{batch, config, generate, model, numerics, weights, Backend, RunError};
pub use tarfa_cpu as cpu;
pub use tarfa_cuda as cuda;
pub use tarfa_stream as stream;
pub use tarfa_stream::bundle;
