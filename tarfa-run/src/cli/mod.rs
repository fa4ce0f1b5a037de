//! The `tarfa-run` command's subcommands: argument types, the commands, and the mapping of
//! every failure to a documented exit code.

pub mod engine;
pub mod generate;
pub mod io_bench;
pub mod output;
pub mod score;
pub mod selftest;
pub mod serve;
pub mod speculate;
pub mod stream;
pub mod tuning;

use std::path::{Path, PathBuf};

use crate::bundle::BundleError;
use crate::RunError;
use tarfa_core::exit;

/// A command's failure, with its exit code.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Bad arguments or input (exit 2).
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Bundle(#[from] BundleError),
    #[error(transparent)]
    Run(#[from] RunError),
    /// Writing an output file, or another environment failure (exit 3).
    #[error("{path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        source: std::io::Error,
    },
    /// Two computations that must agree bit for bit do not (exit 1).
    #[error("{0}")]
    Mismatch(String),
    /// The environment lacks something (no GPU, no driver) (exit 3).
    #[error("{0}")]
    Environment(String),
    /// Expert streaming cannot start or go on.
    #[error(transparent)]
    Stream(#[from] crate::stream::StreamError),
    /// A failure while running one request of a requests file (`score`), with its own code.
    #[error("line {line}: {source}")]
    AtLine { line: usize, source: Box<CliError> },
}

impl CliError {
    pub fn io(
        path: impl Into<PathBuf>,
        op: &'static str,
    ) -> impl FnOnce(std::io::Error) -> CliError {
        let path = path.into();
        move |source| CliError::Io { path, op, source }
    }

    /// 0 success; 1 verification failure; 2 bad input or usage; 3 runtime or environment.
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Usage(_) => exit::BAD_INPUT,
            CliError::Mismatch(_) => exit::VERIFICATION_FAILED,
            CliError::Bundle(e) => e.exit_code(),
            CliError::Run(e) => e.exit_code(),
            CliError::Io { .. } | CliError::Environment(_) => exit::ENVIRONMENT,
            CliError::Stream(e) => e.exit_code(),
            CliError::AtLine { source, .. } => source.exit_code(),
        }
    }
}

/// The most worker threads `--threads` accepts (more would only fail to start, or thrash).
pub const MAX_THREADS: usize = 1024;

/// `--threads N`: 0 (one per core) or 1 to [`MAX_THREADS`]; anything else is a usage error
/// (exit 2) naming the value and the cap.
pub fn threads_arg(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n <= MAX_THREADS => Ok(n),
        _ => Err(format!(
            "expected 0 (one per core) or a number of threads up to {MAX_THREADS}"
        )),
    }
}

/// Peak resident set size of this process (VmHWM), in bytes.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Where Tarfa caches what it derives (the heat ledger, the demo's bundle): `explicit`, else
/// $TARFA_CACHE_DIR, else $XDG_CACHE_HOME/tarfa, else ~/.cache/tarfa.
pub fn cache_root(explicit: Option<&Path>) -> PathBuf {
    if let Some(p) = explicit {
        return p.to_path_buf();
    }
    if let Some(p) = std::env::var_os("TARFA_CACHE_DIR") {
        return PathBuf::from(p);
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(p).join("tarfa");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    home.join(".cache").join("tarfa")
}

/// A file's bytes (a regular file or a pipe, read to its end: what `<(cmd)` gives; `-`: standard
/// input), at most `max` bytes. `what` names the flag in errors; a directory or a device is
/// refused, never waited on.
pub(crate) fn read_input(path: &Path, what: &str, max: u64) -> Result<Vec<u8>, CliError> {
    use std::io::Read;
    let mut bytes = Vec::new();
    let shown = if path == Path::new("-") {
        std::io::stdin()
            .lock()
            .take(max + 1)
            .read_to_end(&mut bytes)
            .map_err(CliError::io("<stdin>", "read"))?;
        "<stdin>".to_string()
    } else {
        let m = std::fs::metadata(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                CliError::Usage(format!("{}: {what}: no such file", path.display()))
            }
            _ => CliError::Io {
                path: path.to_path_buf(),
                op: "read",
                source: e,
            },
        })?;
        use std::os::unix::fs::FileTypeExt;
        if !(m.is_file() || m.file_type().is_fifo()) {
            return Err(CliError::Usage(format!(
                "{}: {what}: not a regular file or a pipe",
                path.display()
            )));
        }
        std::fs::File::open(path)
            .and_then(|f| f.take(max + 1).read_to_end(&mut bytes))
            .map_err(CliError::io(path, "read"))?;
        path.display().to_string()
    };
    if bytes.len() as u64 > max {
        return Err(CliError::Usage(format!(
            "{shown}: {what}: larger than {} MiB",
            max >> 20
        )));
    }
    Ok(bytes)
}

/// A verified bundle with what every command reads from it first.
pub struct OpenedBundle {
    pub source: std::sync::Arc<crate::bundle::BundleSource>,
    pub cfg: crate::config::MoeConfig,
    /// config.json's text (for keys a record repeats as the config wrote them).
    pub config_json: String,
    /// `tokenizer.json`, when the bundle has one.
    pub tokenizer: Option<tokenizers::Tokenizer>,
}

/// Opens and verifies the bundle at `path` (refused unless its root is `expect_root`, when
/// given), logs its root digest, and reads its config and tokenizer.
pub fn open_bundle(
    path: &Path,
    expect_root: Option<&str>,
    log: &dyn Fn(String),
) -> Result<OpenedBundle, CliError> {
    let source = std::sync::Arc::new(crate::bundle::BundleSource::open(path, expect_root)?);
    log(format!(
        "bundle {} root digest {}",
        path.display(),
        source.root_digest()
    ));
    let cfg_text = String::from_utf8(source.read_file("config.json")?)
        .map_err(|_| CliError::Usage(format!("{}: config.json is not UTF-8", path.display())))?;
    let cfg = crate::config::MoeConfig::from_json_str(&cfg_text).map_err(RunError::from)?;
    let tokenizer = if source.has_file("tokenizer.json") {
        let bytes = source.read_file("tokenizer.json")?;
        Some(
            tokenizers::Tokenizer::from_bytes(&bytes)
                .map_err(|e| CliError::Usage(format!("{}: tokenizer.json: {e}", path.display())))?,
        )
    } else {
        None
    };
    Ok(OpenedBundle {
        source,
        cfg,
        config_json: cfg_text,
        tokenizer,
    })
}
