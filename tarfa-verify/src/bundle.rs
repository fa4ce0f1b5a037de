//! Finding a bundle's parts and reading its manifest, with every outcome sorted into "not a
//! bundle" (exit 2), "a bundle that fails" (a [`Failure`]) and "the machine failed" (exit 3).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use jnf_format::{JnfError, JnfFile, CONTAINER_FILE};
use tarfa_manifest::regular::{open_regular, read_regular};
use tarfa_manifest::{Manifest, MANIFEST_FILE};

use crate::{Failure, FailureKind, VerifyError};

/// The paths of a directory that is a bundle: it exists, is a directory, and holds at least one
/// of `model.jnf` and `manifest.toml` (a missing one is then a failure, not a usage error).
#[derive(Debug, Clone)]
pub struct BundlePaths {
    pub dir: PathBuf,
    pub container: PathBuf,
    pub manifest: PathBuf,
}

impl BundlePaths {
    pub fn locate(dir: &Path) -> Result<BundlePaths, VerifyError> {
        let meta = match fs::metadata(dir) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(VerifyError::NotABundle {
                    path: dir.into(),
                    why: "no such file or directory",
                })
            }
            Err(e) if e.kind() == io::ErrorKind::NotADirectory => {
                return Err(VerifyError::NotABundle {
                    path: dir.into(),
                    why: "a path component is not a directory",
                })
            }
            Err(e) if is_unresolvable(&e) => {
                return Err(VerifyError::Unresolvable {
                    path: dir.into(),
                    source: e,
                })
            }
            Err(e) => return Err(VerifyError::io(dir, "stat", e)),
        };
        if !meta.is_dir() {
            return Err(VerifyError::NotABundle {
                path: dir.into(),
                why:
                    "not a directory (a bundle is a directory holding model.jnf and manifest.toml)",
            });
        }
        let paths = BundlePaths {
            dir: dir.into(),
            container: dir.join(CONTAINER_FILE),
            manifest: dir.join(MANIFEST_FILE),
        };
        if !exists(&paths.container)? && !exists(&paths.manifest)? {
            return Err(VerifyError::NotABundle {
                path: dir.into(),
                why: "holds neither model.jnf nor manifest.toml",
            });
        }
        Ok(paths)
    }

    /// Opens `model.jnf` with its header fully validated. `Ok(Err(failure))` when the bundle's
    /// container is missing or invalid; a container that is not a regular file (a FIFO would
    /// block the read forever) is refused before it is read, exit 2.
    pub fn open_container(&self) -> Result<Result<JnfFile, Failure>, VerifyError> {
        match open_regular(&self.container) {
            Ok(_) => {}
            Err(e) => {
                return match VerifyError::from_open(&self.container, e) {
                    Some(err) => Err(err),
                    None => Ok(Err(Failure::new(
                        CONTAINER_FILE,
                        FailureKind::MissingInBundle,
                        "the bundle has no model.jnf",
                    ))),
                }
            }
        }
        match JnfFile::open(&self.container) {
            Ok(f) => Ok(Ok(f)),
            // JnfError::Io carries only the message: re-stat to tell a vanished file from a
            // failing disk. Every other variant is a layout rule the file breaks.
            Err(JnfError::Io(msg)) => Err(VerifyError::io(
                &self.container,
                "reading the header",
                io::Error::other(msg),
            )),
            Err(e) => Ok(Err(Failure::new(
                CONTAINER_FILE,
                FailureKind::InvalidHeader,
                e.to_string(),
            ))),
        }
    }

    /// Reads and validates `manifest.toml`. `Ok(Err(failure))` when it is missing or invalid;
    /// not a regular file is exit 2, as for the container.
    pub fn load_manifest(&self) -> Result<Result<Manifest, Failure>, VerifyError> {
        let invalid = |detail: String| {
            Ok(Err(Failure::new(
                MANIFEST_FILE,
                FailureKind::InvalidManifest,
                detail,
            )))
        };
        let bytes = match read_regular(&self.manifest) {
            Ok(b) => b,
            Err(e) => {
                return match VerifyError::from_open(&self.manifest, e) {
                    Some(err) => Err(err),
                    None => Ok(Err(Failure::new(
                        MANIFEST_FILE,
                        FailureKind::MissingInBundle,
                        "the bundle has no manifest.toml",
                    ))),
                }
            }
        };
        let Ok(text) = String::from_utf8(bytes) else {
            return invalid("not UTF-8".into());
        };
        match Manifest::parse(&text) {
            Ok(m) => Ok(Ok(m)),
            Err(e) => invalid(e.to_string()),
        }
    }
}

/// ELOOP (a symlink loop) and ENAMETOOLONG: the path is bad input, not a failing machine.
pub(crate) fn is_unresolvable(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::ELOOP) | Some(libc::ENAMETOOLONG)
    )
}

/// Whether something is at `p` (a symlink loop counts: opening it reports it by name).
fn exists(p: &Path) -> Result<bool, VerifyError> {
    match fs::symlink_metadata(p) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) if is_unresolvable(&e) => Err(VerifyError::Unresolvable {
            path: p.into(),
            source: e,
        }),
        Err(e) => Err(VerifyError::io(p, "stat", e)),
    }
}

/// A manifest named on the command line of `diff`: a bundle directory or a manifest file.
pub fn load_manifest_arg(path: &Path) -> Result<(PathBuf, Manifest), VerifyError> {
    let not = |why: String| VerifyError::NotAManifest {
        path: path.into(),
        why,
    };
    let meta = match fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(not("no such file or directory".into()))
        }
        Err(e) if is_unresolvable(&e) || e.kind() == io::ErrorKind::NotADirectory => {
            return Err(VerifyError::Unresolvable {
                path: path.into(),
                source: e,
            })
        }
        Err(e) => return Err(VerifyError::io(path, "stat", e)),
    };
    let file = if meta.is_dir() {
        let f = path.join(MANIFEST_FILE);
        if !exists(&f)? {
            return Err(not("a directory without manifest.toml".into()));
        }
        f
    } else {
        path.to_path_buf()
    };
    let bytes = read_regular(&file).map_err(|e| {
        VerifyError::from_open(&file, e).unwrap_or_else(|| not("no such file".into()))
    })?;
    let text = String::from_utf8(bytes).map_err(|_| VerifyError::NotAManifest {
        path: file.clone(),
        why: "not UTF-8 text".into(),
    })?;
    let manifest = Manifest::parse(&text).map_err(|source| VerifyError::BadManifest {
        path: file.clone(),
        source: Box::new(source),
    })?;
    Ok((file, manifest))
}
