//! Conversion errors, each mapped to one of the documented exit codes.

use std::io;
use std::path::{Path, PathBuf};

use tarfa_checkpoint::CheckpointError;
use tarfa_core::exit;
use thiserror::Error;

use crate::target::Overlap;

#[derive(Debug, Error)]
pub enum ConvertError {
    /// The source checkpoint failed a check (or could not be read).
    #[error("{0}")]
    Checkpoint(#[from] CheckpointError),
    /// The config is one the runtime cannot run (tarfa-core's config rules).
    #[error("{}: {source}", .file.display())]
    Config {
        file: PathBuf,
        source: tarfa_core::config::ConfigError,
    },
    /// A tensor breaks the runtime's shape or dtype rules (tarfa-core's shape rules).
    #[error("{}: {source}", .file.display())]
    Shape {
        file: PathBuf,
        source: tarfa_core::shapes::ShapeError,
    },
    /// tokenizer.json does not load, or has ids outside the vocabulary.
    #[error("{}: {source}", .file.display())]
    Tokenizer {
        file: PathBuf,
        source: tarfa_core::tokenizer::TokenizerError,
    },
    /// The target exists and `--force` was not given.
    #[error("{0}: already exists; pass --force to replace it")]
    TargetExists(PathBuf),
    /// `--force` was given, but what is at the target is not a Tarfa bundle.
    #[error("{target}: {why}; --force replaces only a Tarfa bundle, so it was left as it is")]
    NotABundle { target: PathBuf, why: &'static str },
    /// The target is the source, inside it, or holds it (after resolving symlinks and `..`).
    #[error("{out}: the output {} ({}); choose an output outside it", .overlap.describe(), .src.display())]
    TargetOverlapsSource {
        out: PathBuf,
        src: PathBuf,
        overlap: Overlap,
    },
    /// Another process holds the target's lock: it is converting into the same directory.
    #[error("{target}: another tarfa-convert is writing this bundle (lock {lock} is held); try again when it is done")]
    TargetBusy { target: PathBuf, lock: PathBuf },
    /// The target's file system lacks room for the bundle.
    #[error("{dir}: not enough free space: the bundle needs {need} bytes, {have} are available")]
    NoSpace { dir: PathBuf, need: u64, have: u64 },
    /// Many tiny tensors, each padded to 4 KiB, would make the bundle far larger than its data.
    #[error("{file}: {tiny} tensors smaller than 4 KiB would pad {data} bytes of weights to {padded} bytes on disk (the cap is 2 x the data + 64 MiB)")]
    PaddingBlowup {
        file: PathBuf,
        tiny: usize,
        data: u64,
        padded: u64,
    },
    /// A layout that the format refuses (for example a shape whose size overflows).
    #[error("{0}")]
    Layout(#[from] jnf_format::JnfError),
    /// An I/O operation on the bundle or the source failed.
    #[error("{path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        source: io::Error,
    },
    /// Bytes read back from disk differ from what was written.
    #[error("{path}: {name}: read back from disk does not match what was written ({what})")]
    Verify {
        path: PathBuf,
        name: String,
        what: &'static str,
    },
    /// A source shard changed while it was being converted: its hashes and the copied bytes
    /// may disagree, so nothing was published.
    #[error(
        "{path}: the source shard changed during the conversion ({what}); no bundle was written"
    )]
    SourceChanged { path: PathBuf, what: String },
    /// Invalid arguments (synthetic shapes, sizes).
    #[error("{0}")]
    Usage(String),
    /// An expert extent could not be encoded (`--codec exp-zstd`): zstd failed in memory.
    #[error("{name}: cannot encode the extent: {source}")]
    Encode {
        name: String,
        source: jnf_codec::EncodeError,
    },
    /// SIGINT or SIGTERM arrived; the temporary directory was removed.
    #[error("interrupted; no bundle was written")]
    Interrupted,
}

impl ConvertError {
    pub fn io(
        path: impl Into<PathBuf>,
        op: &'static str,
    ) -> impl FnOnce(io::Error) -> ConvertError {
        let path = path.into();
        move |source| ConvertError::Io { path, op, source }
    }

    /// The exit code documented in the README: 1 verification, 2 bad input, 3 environment.
    pub fn exit_code(&self) -> i32 {
        match self {
            // A symlink loop, or a path through a file, is a property of the input, not of the
            // machine.
            ConvertError::Checkpoint(CheckpointError::Io { source, .. })
            | ConvertError::Io { source, .. }
                if matches!(source.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) =>
            {
                exit::BAD_INPUT
            }
            ConvertError::Checkpoint(CheckpointError::Io { .. }) => exit::ENVIRONMENT,
            ConvertError::Checkpoint(_) => exit::BAD_INPUT,
            ConvertError::TargetExists(_)
            | ConvertError::NotABundle { .. }
            | ConvertError::TargetOverlapsSource { .. }
            | ConvertError::PaddingBlowup { .. }
            | ConvertError::Usage(_)
            | ConvertError::Layout(_) => exit::BAD_INPUT,
            ConvertError::Config { .. }
            | ConvertError::Shape { .. }
            | ConvertError::Tokenizer { .. } => exit::BAD_INPUT,
            ConvertError::Verify { .. } | ConvertError::SourceChanged { .. } => {
                exit::VERIFICATION_FAILED
            }
            ConvertError::NoSpace { .. }
            | ConvertError::TargetBusy { .. }
            | ConvertError::Io { .. }
            | ConvertError::Encode { .. }
            | ConvertError::Interrupted => exit::ENVIRONMENT,
        }
    }

    /// A stable name for the failed check, for `--json` error objects.
    pub fn kind(&self) -> &'static str {
        match self {
            ConvertError::Checkpoint(_) => "checkpoint",
            ConvertError::Config { .. } => "config",
            ConvertError::Shape { .. } => "shape",
            ConvertError::Tokenizer { .. } => "tokenizer",
            ConvertError::TargetExists(_) => "target_exists",
            ConvertError::NotABundle { .. } => "not_a_bundle",
            ConvertError::TargetOverlapsSource { .. } => "target_overlaps_source",
            ConvertError::TargetBusy { .. } => "target_busy",
            ConvertError::NoSpace { .. } => "no_space",
            ConvertError::PaddingBlowup { .. } => "padding_blowup",
            ConvertError::Layout(_) => "layout",
            ConvertError::Io { .. } => "io",
            ConvertError::Verify { .. } => "verify",
            ConvertError::SourceChanged { .. } => "source_changed",
            ConvertError::Usage(_) => "usage",
            ConvertError::Encode { .. } => "encode",
            ConvertError::Interrupted => "interrupted",
        }
    }

    /// The file or directory the error is about, when there is one.
    pub fn path(&self) -> Option<&Path> {
        match self {
            ConvertError::Checkpoint(e) => Some(e.file()),
            ConvertError::TargetExists(p)
            | ConvertError::Config { file: p, .. }
            | ConvertError::Shape { file: p, .. }
            | ConvertError::Tokenizer { file: p, .. }
            | ConvertError::NotABundle { target: p, .. }
            | ConvertError::TargetOverlapsSource { out: p, .. }
            | ConvertError::TargetBusy { target: p, .. }
            | ConvertError::NoSpace { dir: p, .. }
            | ConvertError::PaddingBlowup { file: p, .. }
            | ConvertError::Io { path: p, .. }
            | ConvertError::Verify { path: p, .. }
            | ConvertError::SourceChanged { path: p, .. } => Some(p),
            ConvertError::Layout(_)
            | ConvertError::Usage(_)
            | ConvertError::Encode { .. }
            | ConvertError::Interrupted => None,
        }
    }
}
