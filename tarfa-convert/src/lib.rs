//! `tarfa-convert`: Hugging Face BF16 MoE checkpoint -> verified JNF bundle, atomically; and the
//! deterministic synthetic checkpoint generator that every benchmark in the project uses.
//!
//! A conversion reads a checkpoint that `tarfa-checkpoint` validated, lays it out with
//! `jnf-format` (experts contiguous and page-aligned), copies the bytes unchanged while hashing
//! them (SHA-256 and BLAKE3) in parallel, writes the manifest, fsyncs, re-reads every extent from
//! the disk (O_DIRECT, not the page cache) to verify it, and only then renames the temporary
//! directory into place. It must never leave a half-written bundle under the target name, never
//! change a byte of a weight, and never overwrite a bundle without `--force`.

pub mod aligned;
pub mod bundle;
pub mod convert;
mod error;
mod family;
pub mod progress;
pub mod synth;
pub mod target;

pub use bundle::{
    encoding_pays, write_bundle, BundleSpec, CodecChoice, CodecSummary, CopiedFile, RegionSource,
    WriteSummary, ENCODED_AT_MOST_PERCENT,
};
pub use convert::{convert, ConvertOptions};
pub use error::ConvertError;

use std::sync::atomic::{AtomicBool, Ordering};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// True once SIGINT or SIGTERM arrived: long loops stop and the temporary directory is removed.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// Turn SIGINT and SIGTERM into a flag the conversion checks, so that an interrupted run cleans
/// up after itself instead of dying with a temporary directory on disk.
pub fn install_signal_handlers() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
}
