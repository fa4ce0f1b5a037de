//! Where a bundle may be written, and what `--force` may replace: the rules that keep a
//! conversion from ever destroying data that is not a Tarfa bundle.
//!
//! - OUT is never SRC, inside SRC, or an ancestor of SRC (symlinks and `..` resolved first).
//! - `--force` replaces only a directory that is verifiably a bundle: a `manifest.toml` whose
//!   `manifest_version` is 1, 2 or 3 and whose `format_version` is a string, beside a `model.jnf`
//!   that starts with the container's magic. Anything else is refused by name.
//! - One writer per OUT: an advisory lock (`flock`) on `.OUT.tarfa-lock` in OUT's parent, held
//!   from the first check to the publishing rename, removed when released.
//! - Parent directories the conversion created are removed again when it fails.

use std::fs::{self, File, OpenOptions};
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use jnf_format::{CONTAINER_FILE, MAGIC};
use tarfa_manifest::MANIFEST_FILE;

use crate::ConvertError;

/// How OUT and SRC overlap, when they do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overlap {
    Same,
    OutInsideSource,
    OutContainsSource,
}

impl Overlap {
    pub fn describe(self) -> &'static str {
        match self {
            Overlap::Same => "is the source checkpoint",
            Overlap::OutInsideSource => "is inside the source checkpoint",
            Overlap::OutContainsSource => "contains the source checkpoint",
        }
    }
}

/// `p` made absolute with symlinks and `..` resolved. `p` need not exist: its nearest existing
/// ancestor is canonicalised and the missing rest applied lexically (as `create_dir_all` will
/// create it). Fails only when no ancestor can be resolved.
pub fn resolve(p: &Path) -> Result<PathBuf, ConvertError> {
    let abs = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(ConvertError::io(p, "current directory"))?
            .join(p)
    };
    let mut existing = abs.as_path();
    let mut rest = Vec::new();
    loop {
        match fs::canonicalize(existing) {
            Ok(mut c) => {
                for comp in rest.iter().rev() {
                    match comp {
                        Component::ParentDir => {
                            c.pop();
                        }
                        Component::CurDir => {}
                        other => c.push(other.as_os_str()),
                    }
                }
                return Ok(c);
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let Some(parent) = existing.parent() else {
                    return Err(ConvertError::io(p, "resolve path")(e));
                };
                rest.push(
                    existing
                        .components()
                        .next_back()
                        .expect("a path with a parent has a last component"),
                );
                existing = parent;
            }
            Err(e) => return Err(ConvertError::io(existing, "resolve path")(e)),
        }
    }
}

/// Refuse an OUT that is SRC, inside SRC or an ancestor of SRC (exit 2).
pub fn check_not_overlapping(src: &Path, out: &Path) -> Result<(), ConvertError> {
    let s = resolve(src)?;
    let o = resolve(out)?;
    let overlap = if s == o {
        Some(Overlap::Same)
    } else if o.starts_with(&s) {
        Some(Overlap::OutInsideSource)
    } else if s.starts_with(&o) {
        Some(Overlap::OutContainsSource)
    } else {
        None
    };
    match overlap {
        None => Ok(()),
        Some(overlap) => Err(ConvertError::TargetOverlapsSource {
            out: out.to_path_buf(),
            src: src.to_path_buf(),
            overlap,
        }),
    }
}

/// Why an existing OUT is not something `--force` may replace.
pub fn not_a_bundle(dir: &Path) -> Option<&'static str> {
    let meta = match fs::symlink_metadata(dir) {
        Ok(m) => m,
        Err(_) => return Some("cannot be read"),
    };
    if meta.file_type().is_symlink() {
        return Some("is a symbolic link, not a bundle directory");
    }
    if !meta.is_dir() {
        return Some("is not a directory, so not a Tarfa bundle");
    }
    // A manifest is a few hundred bytes an entry; a 256 MiB one is not ours.
    let mut text = String::new();
    let read = File::open(dir.join(MANIFEST_FILE))
        .and_then(|f| f.take(256 << 20).read_to_string(&mut text));
    if read.is_err() {
        return Some("has no readable manifest.toml, so not a Tarfa bundle");
    }
    let Ok(table) = text.parse::<toml::Table>() else {
        return Some("has a manifest.toml that does not parse, so not a Tarfa bundle");
    };
    let version_ok = matches!(
        table.get("manifest_version"),
        Some(toml::Value::Integer(1..=3))
    );
    let format_ok = matches!(table.get("format_version"), Some(toml::Value::String(_)));
    if !version_ok || !format_ok {
        return Some("has a manifest.toml without manifest_version 1, 2 or 3 and a format_version");
    }
    let mut magic = [0u8; 8];
    let magic_ok = File::open(dir.join(CONTAINER_FILE))
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && magic == MAGIC;
    if !magic_ok {
        return Some("has no model.jnf starting with the TARFAJNF magic");
    }
    None
}

/// The advisory lock that serialises writers of one OUT; released (and its file removed) on
/// drop.
pub struct TargetLock {
    path: PathBuf,
    file: File,
}

impl TargetLock {
    /// Take the lock on `.{base}.tarfa-lock` in `parent`, or fail at once if another process
    /// holds it (exit 3: the target is busy, a transient condition of the environment; waiting
    /// instead could hang for the length of the other conversion).
    pub fn acquire(parent: &Path, base: &str, target: &Path) -> Result<TargetLock, ConvertError> {
        let path = parent.join(format!(".{base}.tarfa-lock"));
        loop {
            let file = OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .open(&path)
                .map_err(ConvertError::io(&path, "create lock file"))?;
            // SAFETY: plain syscall on an open descriptor.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                    return Err(ConvertError::TargetBusy {
                        target: target.to_path_buf(),
                        lock: path,
                    });
                }
                return Err(ConvertError::io(&path, "lock")(e));
            }
            // The holder before us may have removed the file after we opened it: then our lock
            // is on an orphan inode, and the lock that counts is on whatever the name holds now.
            let ours = file
                .metadata()
                .map_err(ConvertError::io(&path, "stat lock file"))?;
            match fs::metadata(&path) {
                Ok(now) if now.ino() == ours.ino() && now.dev() == ours.dev() => {
                    return Ok(TargetLock { path, file })
                }
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(ConvertError::io(&path, "stat lock file")(e)),
            }
        }
    }
}

impl Drop for TargetLock {
    fn drop(&mut self) {
        // Unlink while still holding the lock, so that a waiter that opened this inode sees the
        // name gone and retries on a fresh file (see `acquire`).
        let _ = fs::remove_file(&self.path);
        // SAFETY: plain syscall on an open descriptor.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// Directories created for the target's parent; removed again (deepest first, only if empty)
/// unless `keep` is called.
pub struct CreatedDirs(Vec<PathBuf>);

impl CreatedDirs {
    /// Create `dir` and its missing ancestors, remembering which ones were created.
    pub fn create(dir: &Path) -> Result<CreatedDirs, ConvertError> {
        let mut missing = Vec::new();
        let mut p = dir;
        while fs::symlink_metadata(p).is_err() {
            missing.push(p.to_path_buf());
            match p.parent() {
                Some(q) => p = q,
                None => break,
            }
        }
        let mut created = CreatedDirs(Vec::new());
        for d in missing.into_iter().rev() {
            match fs::create_dir(&d) {
                Ok(()) => created.0.push(d),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(ConvertError::io(&d, "create directory")(e)),
            }
        }
        Ok(created)
    }

    pub fn keep(&mut self) {
        self.0.clear();
    }
}

impl Drop for CreatedDirs {
    fn drop(&mut self) {
        for d in self.0.iter().rev() {
            let _ = fs::remove_dir(d);
        }
    }
}

/// The nearest existing ancestor of `p` (or `p`), for statvfs before anything is created.
pub fn nearest_existing(p: &Path) -> &Path {
    let mut q = p;
    while fs::symlink_metadata(q).is_err() {
        match q.parent() {
            Some(r) => q = r,
            None => break,
        }
    }
    q
}

/// Rename `from` to `to`, failing (instead of replacing) if `to` exists. Falls back to a check
/// and a plain rename where the file system lacks RENAME_NOREPLACE; the lock covers our own
/// writers either way.
pub fn rename_noreplace(from: &Path, to: &Path) -> std::io::Result<()> {
    match renameat2(from, to, libc::RENAME_NOREPLACE) {
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) => {
            if fs::symlink_metadata(to).is_ok() {
                return Err(std::io::Error::from_raw_os_error(libc::EEXIST));
            }
            fs::rename(from, to)
        }
        other => other,
    }
}

/// Swap `a` and `b` atomically (both must exist). `Err` with EINVAL/ENOSYS where unsupported.
pub fn rename_exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    renameat2(a, b, libc::RENAME_EXCHANGE)
}

fn renameat2(from: &Path, to: &Path, flags: libc::c_uint) -> std::io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let f = CString::new(from.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let t = CString::new(to.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: both are valid NUL-terminated paths.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            f.as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            flags,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
