//! Path safety: which names may be opened, and where their symbolic links may lead.
//!
//! A file of the checkpoint must resolve, after following every link, to a path inside the
//! canonical source directory. The one exception is the Hugging Face cache layout that
//! `huggingface-cli download` creates:
//!
//! ```text
//! models--org--name/
//!   blobs/<sha256 or git sha1>          the content
//!   snapshots/<revision>/config.json -> ../../blobs/<hash>
//! ```
//!
//! When the source directory's parent is named `snapshots`, a file may resolve to a direct child
//! of `../../blobs/`. Such a blob is named by its content hash (64 hex digits: SHA-256, used for
//! LFS files such as shards; 40 hex digits: the git blob SHA-1, used for small files), which
//! [`HubBlob::verify`] checks. Any other link out of the directory is refused.

use std::fs;
use std::io;
use std::path::{Component, Path, PathBuf};

use crate::error::{CheckpointError, NameProblem};
use crate::hash::{git_blob_sha1_bytes, git_blob_sha1_handle, sha256_bytes, sha256_handle, to_hex};

/// A Hub cache blob a file of the checkpoint resolves to; the name is its expected content hash
/// in lowercase hex.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HubBlob {
    /// 64 hex digits: the SHA-256 of the content (LFS files).
    Sha256(String),
    /// 40 hex digits: the git blob SHA-1, `sha1("blob <len>\0" + content)` (regular git files).
    GitSha1(String),
}

impl HubBlob {
    /// The blob's file name, i.e. the expected hash in hex.
    pub fn name(&self) -> &str {
        match self {
            HubBlob::Sha256(h) | HubBlob::GitSha1(h) => h,
        }
    }

    /// The expected SHA-256 in hex, for LFS blobs.
    pub fn sha256(&self) -> Option<&str> {
        match self {
            HubBlob::Sha256(h) => Some(h),
            HubBlob::GitSha1(_) => None,
        }
    }

    fn from_name(name: &str) -> Option<HubBlob> {
        let hex = name
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        match name.len() {
            64 if hex => Some(HubBlob::Sha256(name.to_owned())),
            40 if hex => Some(HubBlob::GitSha1(name.to_owned())),
            _ => None,
        }
    }

    /// Hashes the content behind `handle` and compares it with the blob's name. Returns the
    /// content's SHA-256 when that is what was computed. `file` names the file in errors.
    pub(crate) fn verify_handle(
        &self,
        file: &Path,
        handle: &fs::File,
    ) -> Result<Option<[u8; 32]>, CheckpointError> {
        let io_err = |source| CheckpointError::Io {
            file: file.into(),
            op: "hashing the Hub blob",
            source,
        };
        match self {
            HubBlob::Sha256(_) => {
                let h = sha256_handle(handle).map_err(io_err)?;
                self.compare(file, &h).map(|()| Some(h))
            }
            HubBlob::GitSha1(_) => self
                .compare(file, &git_blob_sha1_handle(handle).map_err(io_err)?)
                .map(|()| None),
        }
    }

    /// Like [`verify_handle`](Self::verify_handle), for content already in memory.
    pub(crate) fn verify_bytes(&self, file: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
        match self {
            HubBlob::Sha256(_) => self.compare(file, &sha256_bytes(bytes)),
            HubBlob::GitSha1(_) => self.compare(file, &git_blob_sha1_bytes(bytes)),
        }
    }

    fn compare(&self, file: &Path, actual: &[u8]) -> Result<(), CheckpointError> {
        let actual = to_hex(actual);
        if actual == self.name() {
            return Ok(());
        }
        let algorithm = match self {
            HubBlob::Sha256(_) => "SHA-256",
            HubBlob::GitSha1(_) => "git blob SHA-1",
        };
        Err(CheckpointError::HubBlobMismatch {
            file: file.into(),
            blob: self.name().to_owned(),
            algorithm,
            actual,
        })
    }
}

/// The canonical source directory and, when it is a Hub snapshot, its repository's blob folder.
#[derive(Debug, Clone)]
pub(crate) struct SourceRoot {
    pub root: PathBuf,
    pub hub_blobs: Option<PathBuf>,
}

/// A checkpoint file after name checks and link resolution.
#[derive(Debug, Clone)]
pub(crate) struct Resolved {
    pub path: PathBuf,
    pub hub_blob: Option<HubBlob>,
}

impl SourceRoot {
    pub fn new(src_dir: &Path) -> Result<SourceRoot, CheckpointError> {
        let err = |source| CheckpointError::SourceDir {
            file: src_dir.into(),
            source,
        };
        let root = fs::canonicalize(src_dir).map_err(err)?;
        if !fs::metadata(&root).map_err(err)?.is_dir() {
            return Err(err(io::Error::new(
                io::ErrorKind::NotADirectory,
                "not a directory",
            )));
        }
        let hub_blobs = root
            .parent()
            .filter(|snapshots| snapshots.file_name().is_some_and(|n| n == "snapshots"))
            .and_then(Path::parent)
            .and_then(|repo| fs::canonicalize(repo.join("blobs")).ok());
        Ok(SourceRoot { root, hub_blobs })
    }

    /// Resolves `name` (already checked by [`check_name`]): `Ok(None)` when nothing is there
    /// (or a dangling link), an error when it leads outside the directory.
    pub fn resolve(&self, name: &str) -> Result<Option<Resolved>, CheckpointError> {
        let joined = self.root.join(name);
        let path = match fs::canonicalize(&joined) {
            Ok(p) => p,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            // A link cycle is the checkpoint's fault, not the machine's.
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return Err(CheckpointError::SymlinkLoop { file: name.into() })
            }
            Err(source) => {
                return Err(CheckpointError::Io {
                    file: name.into(),
                    op: "resolving the path",
                    source,
                })
            }
        };
        if path.starts_with(&self.root) {
            return Ok(Some(Resolved {
                path,
                hub_blob: None,
            }));
        }
        if let (Some(blobs), Some(parent)) = (&self.hub_blobs, path.parent()) {
            if parent == blobs {
                let blob = path
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let Some(hub_blob) = HubBlob::from_name(&blob) else {
                    return Err(CheckpointError::HubBlobBadName {
                        file: name.into(),
                        blob,
                    });
                };
                return Ok(Some(Resolved {
                    path,
                    hub_blob: Some(hub_blob),
                }));
            }
        }
        Err(CheckpointError::SymlinkEscape {
            file: name.into(),
            target: path,
        })
    }
}

/// What a Hugging Face cache repository folder (`models--org--name/`, holding `snapshots/<rev>/`,
/// `refs/main` and `blobs/`) offers in place of a checkpoint: its snapshots, and the one that
/// `refs/main` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HubRepository {
    /// The snapshot `refs/main` points to, when it names one that exists.
    pub main: Option<String>,
    /// Every snapshot folder, sorted.
    pub snapshots: Vec<String>,
}

/// Largest `refs/main` read: a revision is 40 hex digits.
const MAX_REF_LEN: u64 = 1024;

/// `dir` as a Hub cache repository, if it has a `snapshots/` folder. Never follows `snapshots`
/// itself through a link, never blocks on a special file.
pub(crate) fn hub_repository(dir: &Path) -> Option<HubRepository> {
    let snapshots_dir = dir.join("snapshots");
    if !fs::symlink_metadata(&snapshots_dir).ok()?.is_dir() {
        return None;
    }
    let mut snapshots: Vec<String> = fs::read_dir(&snapshots_dir)
        .ok()?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    snapshots.sort();
    let main = read_ref(&dir.join("refs").join("main")).filter(|r| snapshots.contains(r));
    Some(HubRepository { main, snapshots })
}

fn read_ref(path: &Path) -> Option<String> {
    let (handle, size) = crate::open_regular("refs/main", path).ok()?;
    if size > MAX_REF_LEN {
        return None;
    }
    let mut text = String::new();
    io::Read::read_to_string(&mut io::Read::take(&handle, MAX_REF_LEN), &mut text).ok()?;
    Some(text.trim().to_owned())
}

/// Checks that a file name taken from the index is a plain relative path: `/`-separated normal
/// components, no `..`, no backslash, NUL or control character; shard names end in `.safetensors`.
pub(crate) fn check_name(name: &str, shard: bool) -> Result<(), NameProblem> {
    if name.is_empty() {
        return Err(NameProblem::Empty);
    }
    if name.contains('\0') {
        return Err(NameProblem::Nul);
    }
    if name.contains('\\') {
        return Err(NameProblem::Backslash);
    }
    if name.chars().any(char::is_control) {
        return Err(NameProblem::ControlChar);
    }
    if name.starts_with('/') {
        return Err(NameProblem::Absolute);
    }
    for part in name.split('/') {
        match part {
            ".." => return Err(NameProblem::ParentDir),
            "" | "." => return Err(NameProblem::NotNormal),
            _ => {}
        }
    }
    // Belt and braces: the split above must agree with std's own view of the path.
    if !Path::new(name)
        .components()
        .all(|c| matches!(c, Component::Normal(_)))
    {
        return Err(NameProblem::NotNormal);
    }
    if shard && !name.ends_with(".safetensors") {
        return Err(NameProblem::NotSafetensors);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(check_name("model-00001-of-00002.safetensors", true), Ok(()));
        assert_eq!(check_name("sub/model.safetensors", true), Ok(()));
        assert_eq!(check_name("", true), Err(NameProblem::Empty));
        assert_eq!(
            check_name("/etc/passwd.safetensors", true),
            Err(NameProblem::Absolute)
        );
        assert_eq!(
            check_name("../x.safetensors", true),
            Err(NameProblem::ParentDir)
        );
        assert_eq!(
            check_name("a/../../x.safetensors", true),
            Err(NameProblem::ParentDir)
        );
        assert_eq!(
            check_name("./x.safetensors", true),
            Err(NameProblem::NotNormal)
        );
        assert_eq!(
            check_name("a//x.safetensors", true),
            Err(NameProblem::NotNormal)
        );
        assert_eq!(
            check_name("..\\x.safetensors", true),
            Err(NameProblem::Backslash)
        );
        assert_eq!(check_name("x\0.safetensors", true), Err(NameProblem::Nul));
        assert_eq!(
            check_name("x\n.safetensors", true),
            Err(NameProblem::ControlChar)
        );
        assert_eq!(
            check_name("config.json", true),
            Err(NameProblem::NotSafetensors)
        );
        assert_eq!(check_name("config.json", false), Ok(()));
    }

    #[test]
    fn blob_names() {
        assert_eq!(
            HubBlob::from_name(&"a".repeat(64)),
            Some(HubBlob::Sha256("a".repeat(64)))
        );
        assert_eq!(
            HubBlob::from_name(&"0".repeat(40)),
            Some(HubBlob::GitSha1("0".repeat(40)))
        );
        assert_eq!(HubBlob::from_name(&"A".repeat(64)), None);
        assert_eq!(HubBlob::from_name(&"g".repeat(40)), None);
        assert_eq!(HubBlob::from_name("passwd"), None);
    }
}
