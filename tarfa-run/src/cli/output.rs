//! The files a run writes for audits and the validation suite: the logits file, the router
//! trace, the verification report and the summary. Each is byte-for-byte reproducible: nothing
//! that varies between identical runs (times, paths) goes into the logits file.
//!
//! Every output is written THROUGH its path, never renamed over it: a new regular file, or an
//! existing regular file (a symbolic link to one is followed) opened `O_WRONLY|O_CREAT|O_TRUNC`,
//! mode 0644 before the umask. Anything else at the path (a device node, a FIFO, a directory, a
//! socket, a dangling link) is refused before it is opened for writing, and so is a path that
//! resolves inside a bundle the command reads: writing there would make the bundle
//! unverifiable. Every write is checked, the last flush, `sync_all` and `close` included; a run
//! whose output cannot be written fails (exit 3), and leaves no partial file behind: a file it
//! created is removed, an existing one it had truncated is left empty.

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::IntoRawFd;
use std::path::{Path, PathBuf};

use crate::cpu::RouterRecord;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;

use super::CliError;

/// What is at an output path that is not a regular file, in words.
fn kind_of(ft: std::fs::FileType) -> &'static str {
    if ft.is_dir() {
        "a directory"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_symlink() {
        "a symbolic link"
    } else {
        "not a regular file"
    }
}

/// The bundles a command reads, whose files no output may land in.
pub struct OutputRules {
    /// Canonical bundle directories.
    bundles: Vec<PathBuf>,
    /// (device, inode) of every file in them, so that a hard link to one is refused too.
    bundle_files: HashSet<(u64, u64)>,
    /// Outputs already claimed by this run (resolved paths): two flags naming one file would
    /// leave only the last written.
    claimed: std::cell::RefCell<Vec<(PathBuf, &'static str)>>,
}

impl OutputRules {
    /// Rules for a command that reads `bundles` (those that do not exist are skipped: opening
    /// them reports that).
    pub fn new(bundles: &[&Path]) -> OutputRules {
        let mut dirs = Vec::new();
        let mut files = HashSet::new();
        for b in bundles {
            if let Ok(c) = std::fs::canonicalize(b) {
                collect_inodes(&c, &mut files, 0);
                dirs.push(c);
            }
        }
        OutputRules {
            bundles: dirs,
            bundle_files: files,
            claimed: Default::default(),
        }
    }

    /// Checks that `path` (the argument of `flag`) may be written, without opening it: exit 2
    /// naming the path, the flag and what is wrong. Returns whether a file exists there now.
    pub fn check(&self, path: &Path, flag: &'static str) -> Result<bool, CliError> {
        let refuse = |why: String| {
            CliError::Usage(format!(
                "{}: {flag}: {why}; outputs are written only to new or existing regular files",
                path.display()
            ))
        };
        let existing = match std::fs::metadata(path) {
            Ok(m) if m.is_file() => Some(m),
            Ok(m) => return Err(refuse(format!("it is {}", kind_of(m.file_type())))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if std::fs::symlink_metadata(path).is_ok() {
                    return Err(refuse("it is a dangling symbolic link".into()));
                }
                None
            }
            Err(e) => {
                return Err(CliError::Io {
                    path: path.to_path_buf(),
                    op: flag,
                    source: e,
                })
            }
        };
        let resolved = match &existing {
            Some(_) => std::fs::canonicalize(path).map_err(CliError::io(path, flag))?,
            None => {
                let parent = match path.parent() {
                    Some(p) if !p.as_os_str().is_empty() => p,
                    _ => Path::new("."),
                };
                let name = path
                    .file_name()
                    .ok_or_else(|| refuse("it names no file".into()))?;
                match std::fs::canonicalize(parent) {
                    Ok(p) if p.is_dir() => p.join(name),
                    _ => {
                        return Err(refuse(format!(
                            "its directory {} does not exist",
                            parent.display()
                        )))
                    }
                }
            }
        };
        if let Some(b) = self.bundles.iter().find(|b| resolved.starts_with(b)) {
            return Err(CliError::Usage(format!(
                "{}: {flag}: it is inside the bundle {}; a run never writes a bundle's files",
                path.display(),
                b.display()
            )));
        }
        if let Some(m) = &existing {
            if self.bundle_files.contains(&(m.dev(), m.ino())) {
                return Err(CliError::Usage(format!(
                    "{}: {flag}: it is a hard link to a file of the bundle; a run never writes \
                     a bundle's files",
                    path.display()
                )));
            }
        }
        let mut claimed = self.claimed.borrow_mut();
        if let Some((_, other)) = claimed.iter().find(|(p, _)| *p == resolved) {
            return Err(CliError::Usage(format!(
                "{}: {flag}: the same file as {other}'s",
                path.display()
            )));
        }
        claimed.push((resolved, flag));
        Ok(existing.is_some())
    }

    /// Opens `path` for writing under the rules (checked again now, and the open file's type
    /// after opening, in case the path changed since [`OutputRules::check`]).
    pub fn create(&self, path: &Path, flag: &'static str) -> Result<OutputFile, CliError> {
        // The claim of a path checked earlier is this very write.
        self.claimed.borrow_mut().retain(|(_, f)| *f != flag);
        let existed = self.check(path, flag)?;
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o644)
            // never block on a FIFO swapped in since the check, nor take a terminal
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(path)
            .map_err(CliError::io(path, flag))?;
        let m = file.metadata().map_err(CliError::io(path, flag))?;
        if !m.is_file() {
            return Err(CliError::Usage(format!(
                "{}: {flag}: it is {}; outputs are written only to new or existing regular files",
                path.display(),
                kind_of(m.file_type())
            )));
        }
        Ok(OutputFile {
            path: path.to_path_buf(),
            flag,
            created: !existed,
            out: Some(BufWriter::new(file)),
        })
    }

    /// Writes `bytes` as the whole of `path`.
    pub fn write(&self, path: &Path, flag: &'static str, bytes: &[u8]) -> Result<(), CliError> {
        let mut f = self.create(path, flag)?;
        f.write_all(bytes)?;
        f.finish()
    }

    /// Writes a JSON document to `path`.
    pub fn write_json(
        &self,
        path: &Path,
        flag: &'static str,
        v: &impl serde::Serialize,
    ) -> Result<(), CliError> {
        let text = serde_json::to_string_pretty(v).map_err(|e| CliError::Io {
            path: path.to_path_buf(),
            op: flag,
            source: std::io::Error::other(e),
        })?;
        self.write(path, flag, (text + "\n").as_bytes())
    }
}

/// (device, inode) of the regular files under `dir` (a bundle is a few files, a folder or two).
fn collect_inodes(dir: &Path, out: &mut HashSet<(u64, u64)>, depth: usize) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let Ok(m) = e.metadata() else { continue };
        if m.is_file() {
            out.insert((m.dev(), m.ino()));
        } else if m.is_dir() && depth < 4 {
            collect_inodes(&e.path(), out, depth + 1);
        }
    }
}

/// An output being written. Dropped unfinished (a failed write, or the run failed), it removes
/// the file it created, or empties the existing one it truncated: no half-written output stays.
pub struct OutputFile {
    path: PathBuf,
    flag: &'static str,
    created: bool,
    out: Option<BufWriter<File>>,
}

impl OutputFile {
    fn fail(&self, source: std::io::Error) -> CliError {
        CliError::Io {
            path: self.path.clone(),
            op: self.flag,
            source,
        }
    }

    pub fn write_all(&mut self, bytes: &[u8]) -> Result<(), CliError> {
        let out = self.out.as_mut().expect("an unfinished output");
        out.write_all(bytes).map_err(|e| CliError::Io {
            path: self.path.clone(),
            op: self.flag,
            source: e,
        })
    }

    /// Flushes, syncs and closes the file, each checked.
    pub fn finish(mut self) -> Result<(), CliError> {
        let out = self.out.take().expect("an unfinished output");
        let file = match out.into_inner() {
            Ok(f) => f,
            Err(e) => {
                let (source, buffered) = e.into_parts();
                self.discard(Some(buffered.into_parts().0));
                return Err(self.fail(source));
            }
        };
        if let Err(e) = file.sync_all() {
            self.discard(Some(file));
            return Err(self.fail(e));
        }
        let fd = file.into_raw_fd();
        // SAFETY: fd is this file's descriptor, owned here and closed once.
        if unsafe { libc::close(fd) } != 0 {
            let e = std::io::Error::last_os_error();
            self.discard(None);
            return Err(self.fail(e));
        }
        Ok(())
    }

    /// Removes what this run wrote: the file it created, or the content of the existing one.
    fn discard(&self, file: Option<File>) {
        if self.created {
            drop(file);
            let _ = std::fs::remove_file(&self.path);
        } else if let Some(f) = file {
            let _ = f.set_len(0);
        } else if let Ok(f) = OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(&self.path)
        {
            if f.metadata().is_ok_and(|m| m.is_file()) {
                let _ = f.set_len(0);
            }
        }
    }
}

impl Drop for OutputFile {
    fn drop(&mut self) {
        if let Some(out) = self.out.take() {
            // Unfinished: whatever is buffered is dropped with it, unwritten.
            let (file, _) = out.into_parts();
            self.discard(Some(file));
        }
    }
}

/// Rows of f32 as little-endian bytes.
fn f32_bytes(rows: &[Vec<f32>]) -> Vec<u8> {
    rows.iter()
        .flatten()
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

fn i64_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|&t| (t as i64).to_le_bytes()).collect()
}

/// `--logits-out`: `prompt_tokens` I64 [prompt_len] (the ids the run was given, after
/// tokenisation), `tokens` I64 [n], `logits` F32 [n, vocab] (row i chose tokens[i]), optionally
/// `prefill_logits` F32 [prompt_len, vocab]; metadata: the bundle's root digest only.
/// Serialised in memory and written through the path under `rules`.
#[allow(clippy::too_many_arguments)]
pub fn write_logits(
    rules: &OutputRules,
    path: &Path,
    root_digest: &str,
    vocab: usize,
    prompt: &[u32],
    tokens: &[u32],
    step_logits: &[Vec<f32>],
    prefill_logits: Option<&[Vec<f32>]>,
) -> Result<(), CliError> {
    const FLAG: &str = "--logits-out";
    let prompt_bytes = i64_bytes(prompt);
    let tok_bytes = i64_bytes(tokens);
    let logit_bytes = f32_bytes(step_logits);
    let prefill_bytes = prefill_logits.map(f32_bytes);
    fn view<'a>(
        path: &Path,
        dtype: Dtype,
        shape: Vec<usize>,
        name: &'static str,
        data: &'a [u8],
    ) -> Result<TensorView<'a>, CliError> {
        TensorView::new(dtype, shape, data).map_err(|e| CliError::Io {
            path: path.to_path_buf(),
            op: name,
            source: std::io::Error::other(e.to_string()),
        })
    }
    let mut tensors = vec![
        (
            "prompt_tokens",
            view(
                path,
                Dtype::I64,
                vec![prompt.len()],
                "build prompt_tokens",
                &prompt_bytes,
            )?,
        ),
        (
            "tokens",
            view(
                path,
                Dtype::I64,
                vec![tokens.len()],
                "build tokens",
                &tok_bytes,
            )?,
        ),
        (
            "logits",
            view(
                path,
                Dtype::F32,
                vec![step_logits.len(), vocab],
                "build logits",
                &logit_bytes,
            )?,
        ),
    ];
    if let (Some(rows), Some(bytes)) = (prefill_logits, prefill_bytes.as_ref()) {
        tensors.push((
            "prefill_logits",
            view(
                path,
                Dtype::F32,
                vec![rows.len(), vocab],
                "build prefill_logits",
                bytes,
            )?,
        ));
    }
    let meta: HashMap<String, String> =
        [("root_digest".to_string(), root_digest.to_string())].into();
    let bytes = safetensors::serialize(tensors, Some(meta)).map_err(|e| CliError::Io {
        path: path.to_path_buf(),
        op: FLAG,
        source: std::io::Error::other(e.to_string()),
    })?;
    rules.write(path, FLAG, &bytes)
}

/// `--router-trace`: JSON Lines, a header then one line per (layer, token).
pub struct RouterTrace {
    out: OutputFile,
}

impl RouterTrace {
    pub fn create(
        rules: &OutputRules,
        path: &Path,
        header: serde_json::Value,
    ) -> Result<RouterTrace, CliError> {
        let mut t = RouterTrace {
            out: rules.create(path, "--router-trace")?,
        };
        t.line(&header)?;
        Ok(t)
    }

    fn line(&mut self, v: &serde_json::Value) -> Result<(), CliError> {
        self.out.write_all(format!("{v}\n").as_bytes())
    }

    pub fn records(&mut self, rs: &[RouterRecord]) -> Result<(), CliError> {
        for r in rs {
            self.line(&json!({
                "kind": "route",
                "layer": r.layer,
                "moe_layer": r.moe_layer,
                "position": r.position,
                "experts": r.experts,
                "probs": r.probs,
                "weights": r.weights,
                "kth_prob": r.kth_prob,
                "next_prob": r.next_prob,
            }))?;
        }
        Ok(())
    }

    pub fn finish(self) -> Result<(), CliError> {
        self.out.finish()
    }
}
