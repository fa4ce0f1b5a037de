//! Tarfa's validation: one runnable check per invariant of docs/EXACTNESS.md, and the paired
//! A/B harness that decides whether an optimisation ships (docs/PHASE_LOG.md records both).
//!
//! - [`checks`]: the four invariant checks (`validation/run-all`, the `tarfa-validate` binary).
//! - [`arms`]: the table of optional features the invariance check runs.
//! - [`ab`]: the A/B harness's schedule, statistics, verdict and table (`validation/ab`, the
//!   `tarfa-ab` binary).
//! - [`runner`]: `tarfa-run generate` as a child process, with its peak memory sampled.
//! - [`bundle`], [`logits`], [`trace`], [`report`]: the files the runtime reads and writes,
//!   parsed here independently of the runtime's crates.
//!
//! This crate judges the runtime from outside. It must never import a Tarfa crate (a shared
//! loader would hide the loader's bugs), and it must never weaken a comparison to make a run
//! pass: bytes are compared as bytes, and tolerances are the oracle's.

pub mod ab;
pub mod arms;
pub mod bundle;
pub mod checks;
pub mod logits;
pub mod prng;
pub mod report;
pub mod runner;
pub mod trace;
pub mod workload;

/// Where the oracle fixtures live in this repository (searched for the fixture a bundle was
/// converted from).
pub fn default_oracle_dir() -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/oracle");
    dir.canonicalize().unwrap_or(dir)
}
