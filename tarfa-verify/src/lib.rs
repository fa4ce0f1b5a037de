//! Independent verification of JNF bundles: `check` re-hashes every byte of a bundle against its
//! manifest (and, given the source checkpoint, proves the bytes are the source's, bit for bit);
//! `diff` says what changed between two releases from their manifests alone.
//!
//! A verifier is only worth something if it trusts nothing it can recompute: this crate re-hashes
//! from the file rather than reusing any digest the converter or the runtime computed, compares
//! the container's header and the manifest entry by entry instead of assuming they agree, and
//! reads the source through `tarfa-checkpoint`'s validation. Every failure names what failed (a
//! tensor, an expert prefix such as `model.layers.3.mlp.experts.17`, or a file) and how
//! ([`FailureKind`]).
//!
//! It must never modify a bundle or a source, and never stop at the first failure: one run reports
//! every failure it can find. Only a path that is not a bundle at all, a source that is not a
//! checkpoint, or an I/O error ends a run early ([`VerifyError`]).
//!
//! Exit codes of the binary: 0 verified (no differences), 1 verification failures (differences),
//! 2 bad input or usage, 3 runtime or I/O failure.

pub mod bundle;
pub mod check;
pub mod diff;
mod error;
mod failure;

pub use check::{check_bundle, CheckOptions, CheckReport, Note};
pub use diff::{diff_manifests, DiffOutcome};
pub use error::{VerifyError, EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, EXIT_RUNTIME};
pub use failure::{one_line, Failure, FailureKind};
