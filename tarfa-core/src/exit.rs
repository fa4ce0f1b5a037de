//! The exit codes the Tarfa tools document (README, "Exit codes"), named once for every binary
//! that links the runtime's core: `tarfa-run` and `tarfa-convert` (which checks checkpoints with
//! this crate's rules, so it already depends on it). `tarfa-verify` must not depend on a runtime
//! crate and keeps the same four numbers itself.
//!
//! Every error type's `exit_code()` is an exhaustive `match` onto these, without a catch-all
//! arm, so a new error variant is a decision about its code, never a default.

/// The command did what it was asked.
pub const SUCCESS: i32 = 0;
/// Bytes that must agree do not (a digest, a read-back, a bit-for-bit comparison).
pub const VERIFICATION_FAILED: i32 = 1;
/// The user's input or arguments are wrong (the same command fails the same way anywhere).
pub const BAD_INPUT: i32 = 2;
/// The machine or the run failed (I/O, memory, no GPU, interrupted) or a bug was detected.
pub const ENVIRONMENT: i32 = 3;
