//! The numerics of the exactness contract (docs/EXACTNESS.md): elementary functions, the
//! canonical reduction and its SIMD paths, row-parallel matrix-vector products, and the RoPE
//! tables.
//!
//! Everything here is a pure function of its inputs: the same bits for any thread count, SIMD
//! path or batch composition. Nothing here may call libm, reassociate a reduction, or split one
//! reduction across threads.

pub mod aligned;
pub mod detmath;
pub mod matvec;
pub mod mxfp4;
pub mod reduce;
pub mod rope;

pub use aligned::AlignedVec;
pub use matvec::{run_jobs, Activation, MatJob, MatrixRef};
pub use reduce::{bf16_to_f32, f32_to_bf16_rne, Kernel, KernelError, PreparedVec, SimdPath};
pub use rope::{yarn_mscale, Llama3, RopeError, RopeTable, Yarn};

/// Contract version this code implements (docs/EXACTNESS.md); printed by the runtime.
pub const CONTRACT_VERSION: u32 = 1;
