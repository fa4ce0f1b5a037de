//! Errors that stop a command before it can give a verdict. A bundle that fails a check is not an
//! error: it is a [`Failure`](crate::Failure) in the report. These are the other outcomes: the
//! input is not something we can verify at all (exit 2), or the machine failed us (exit 3).

use std::io;
use std::path::PathBuf;

use tarfa_checkpoint::CheckpointError;
use tarfa_manifest::regular::OpenRegularError;
use tarfa_manifest::ManifestError;
use thiserror::Error;

/// Exit status for a command that ran and found nothing wrong.
pub const EXIT_OK: i32 = 0;
/// Exit status for a verification failure (`check`) or differences found (`diff`).
pub const EXIT_FAILED: i32 = 1;
/// Exit status for bad input or usage: not a bundle, not a manifest, not a checkpoint, bad flags.
pub const EXIT_BAD_INPUT: i32 = 2;
/// Exit status for a runtime or environment failure, such as an I/O error while reading.
pub const EXIT_RUNTIME: i32 = 3;

#[derive(Debug, Error)]
pub enum VerifyError {
    /// The path given as a bundle is missing, not a directory, or holds neither `model.jnf` nor
    /// `manifest.toml`.
    #[error("{}: not a bundle: {why}", .path.display())]
    NotABundle { path: PathBuf, why: &'static str },
    /// The path given to `diff` is neither a bundle directory nor a readable manifest file.
    #[error("{}: not a bundle or manifest: {why}", .path.display())]
    NotAManifest { path: PathBuf, why: String },
    /// A manifest given to `diff` does not parse or fails validation.
    #[error("{}: {source}", .path.display())]
    BadManifest {
        path: PathBuf,
        source: Box<ManifestError>,
    },
    /// The `--source` directory is not a checkpoint tarfa-checkpoint accepts.
    #[error("source {}: {source}", .path.display())]
    BadSource {
        path: PathBuf,
        source: Box<CheckpointError>,
    },
    /// The `--source` checkpoint could not be read (an I/O failure, not bad content).
    #[error("source {}: {source}", .path.display())]
    SourceIo {
        path: PathBuf,
        source: Box<CheckpointError>,
    },
    /// A path of the bundle (or a manifest given to `diff`) is a directory, FIFO, device or
    /// socket where a regular file must be: refused before any read that could block.
    #[error("{}: {what} (a regular file is required)", .path.display())]
    NotARegularFile { path: PathBuf, what: String },
    /// A path that cannot be resolved: a symlink loop, or a component that is not a directory.
    #[error("{}: cannot be resolved: {source}", .path.display())]
    Unresolvable { path: PathBuf, source: io::Error },
    /// An operating-system call failed on a file we had every reason to be able to read.
    #[error("{}: {op} failed: {source}", .path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        source: io::Error,
    },
}

impl VerifyError {
    /// The documented exit status for this error (see the crate docs and `--help`).
    pub fn exit_code(&self) -> i32 {
        match self {
            VerifyError::NotABundle { .. }
            | VerifyError::NotAManifest { .. }
            | VerifyError::BadManifest { .. }
            | VerifyError::BadSource { .. }
            | VerifyError::NotARegularFile { .. }
            | VerifyError::Unresolvable { .. } => EXIT_BAD_INPUT,
            VerifyError::SourceIo { .. } | VerifyError::Io { .. } => EXIT_RUNTIME,
        }
    }

    /// A stable kebab-case name for `--json`'s `error.kind`.
    pub fn kind(&self) -> &'static str {
        match self {
            VerifyError::NotABundle { .. } => "not-a-bundle",
            VerifyError::NotAManifest { .. } => "not-a-manifest",
            VerifyError::BadManifest { .. } => "bad-manifest",
            VerifyError::BadSource { .. } => "bad-source",
            VerifyError::SourceIo { .. } => "source-io",
            VerifyError::NotARegularFile { .. } => "not-a-regular-file",
            VerifyError::Unresolvable { .. } => "unresolvable-path",
            VerifyError::Io { .. } => "io",
        }
    }

    /// The path the error is about.
    pub fn path(&self) -> &std::path::Path {
        match self {
            VerifyError::NotABundle { path, .. }
            | VerifyError::NotAManifest { path, .. }
            | VerifyError::BadManifest { path, .. }
            | VerifyError::BadSource { path, .. }
            | VerifyError::SourceIo { path, .. }
            | VerifyError::NotARegularFile { path, .. }
            | VerifyError::Unresolvable { path, .. }
            | VerifyError::Io { path, .. } => path,
        }
    }

    /// Sort a failure to open a bundle's file as a regular file. `None` for "not found",
    /// which the caller reports as a failure of the bundle (a listed file is missing).
    pub(crate) fn from_open(path: &std::path::Path, e: OpenRegularError) -> Option<Self> {
        match e {
            OpenRegularError::NotFound => None,
            OpenRegularError::NotRegular(what) => Some(VerifyError::NotARegularFile {
                path: path.into(),
                what: format!("is a {what}"),
            }),
            OpenRegularError::Unresolvable(source) => Some(VerifyError::Unresolvable {
                path: path.into(),
                source,
            }),
            OpenRegularError::Io(source) => Some(VerifyError::io(path, "open", source)),
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, op: &'static str, source: io::Error) -> Self {
        VerifyError::Io {
            path: path.into(),
            op,
            source,
        }
    }

    /// Sort a checkpoint refusal into bad input (exit 2) or an I/O failure (exit 3).
    pub(crate) fn from_checkpoint(path: PathBuf, source: CheckpointError) -> Self {
        let io_kind = match &source {
            CheckpointError::Io { source, .. } => Some(source.kind()),
            CheckpointError::SourceDir { source, .. } => Some(source.kind()),
            _ => None,
        };
        match io_kind {
            // A directory that does not exist (or is not one) is a usage error, not the machine's.
            Some(io::ErrorKind::NotFound) | Some(io::ErrorKind::NotADirectory) | None => {
                VerifyError::BadSource {
                    path,
                    source: Box::new(source),
                }
            }
            Some(_) => VerifyError::SourceIo {
                path,
                source: Box::new(source),
            },
        }
    }
}
