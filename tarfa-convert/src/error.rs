//! Conversion errors, each mapped to one of the documented exit codes.

use std::io;
use std::path::PathBuf;

use tarfa_checkpoint::CheckpointError;
use thiserror::Error;

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
    /// The target's file system lacks room for the bundle.
    #[error("{dir}: not enough free space: the bundle needs {need} bytes, {have} are available")]
    NoSpace { dir: PathBuf, need: u64, have: u64 },
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
    /// Invalid arguments (synthetic shapes, sizes).
    #[error("{0}")]
    Usage(String),
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
            ConvertError::Checkpoint(CheckpointError::Io { .. }) => 3,
            ConvertError::Checkpoint(_) => 2,
            ConvertError::TargetExists(_) | ConvertError::Usage(_) | ConvertError::Layout(_) => 2,
            ConvertError::Config { .. }
            | ConvertError::Shape { .. }
            | ConvertError::Tokenizer { .. } => 2,
            ConvertError::Verify { .. } => 1,
            ConvertError::NoSpace { .. } | ConvertError::Io { .. } | ConvertError::Interrupted => 3,
        }
    }
}
