//! `tarfa-verify`: a thin command line over the `tarfa_verify` library. Parses flags, runs one
//! command, prints its report, and maps the outcome to the documented exit code.

use std::io::{self, IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use tarfa_verify::{
    check_bundle, diff_manifests, one_line, CheckOptions, CheckReport, VerifyError, EXIT_FAILED,
    EXIT_OK, EXIT_RUNTIME,
};

const EXIT_CODES: &str = "\
Exit codes:
  0  success: the bundle verified (check), or no differences (diff)
  1  verification failed (check), or differences found (diff)
  2  bad input or usage: a path that is not a bundle or manifest, a source that is not a
     checkpoint Tarfa reads, an unknown flag
  3  runtime failure: an I/O error while reading";

#[derive(Parser)]
#[command(
    name = "tarfa-verify",
    version,
    about = "Verify JNF bundles against their manifests and source checkpoints, and diff releases.",
    after_help = EXIT_CODES
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Re-hash every tensor, expert extent, padding byte and copied file of a bundle and compare
    /// with its manifest; with --source, also prove the bytes are the source checkpoint's.
    #[command(after_help = EXIT_CODES, long_about = CHECK_ABOUT)]
    Check(CheckArgs),
    /// Compare two releases entry by entry from their manifests (no tensor data is read): which
    /// tensors, experts and files changed, were added or were removed.
    #[command(after_help = EXIT_CODES)]
    Diff(DiffArgs),
}

const CHECK_ABOUT: &str = "\
Verify a bundle (a directory holding model.jnf, manifest.toml and the copied files).

Checks, each failure named by tensor, expert prefix (model.layers.L.mlp.experts.E) or file:
  - model.jnf's header is valid, manifest.toml is valid (manifest_version 2) and its root digest
    is the SHA-256 of its lines after the first;
  - the header JSON has the length and SHA-256 the manifest records, and the header and the
    manifest list the same tensors and experts, with the same dtypes, shapes, offsets, lengths
    and padded lengths;
  - the SHA-256 and BLAKE3 of every tensor and expert extent (gate, up, down bytes) match the
    manifest, and every padding byte is zero;
  - every copied file (config.json, ...) has the recorded size and SHA-256, and no unlisted file
    is in the bundle.
With --source, also: every source shard's size and whole-file SHA-256 match the manifest, the
source holds exactly the bundle's tensors, every tensor's bytes in the bundle equal the source's
bytes at the tensor's recorded (shard, offset), and every copied file is the source's file.
Tensors and experts the manifest records with NaN or Inf elements are noted, not failed.
A FIFO, device, directory or symlink loop where a file must be is exit 2, before any read.";

#[derive(Args)]
struct CheckArgs {
    /// The bundle directory.
    bundle: PathBuf,
    /// The source checkpoint directory the bundle was converted from.
    #[arg(long, value_name = "SRC_DIR")]
    source: Option<PathBuf>,
    /// Print {"ok": bool, "failures": [{"name", "kind", "detail"}], "notes": [{"name",
    /// "detail"}], "checked_bytes": N}; an error that stops the check is
    /// {"error": {"kind", "message", "path"}, "exit_code": N}.
    #[arg(long)]
    json: bool,
    /// List every failure (without it, the first 20 and a count of the rest).
    #[arg(long)]
    all: bool,
}

#[derive(Args)]
struct DiffArgs {
    /// The old release: a bundle directory or a manifest.toml file.
    a: PathBuf,
    /// The new release: a bundle directory or a manifest.toml file.
    b: PathBuf,
    /// Print {"changed": [...], "added": [...], "removed": [...], "unchanged": N}; an error is
    /// {"error": {"kind", "message", "path"}, "exit_code": N}.
    #[arg(long)]
    json: bool,
}

/// How many failures the human report lists without `--all`.
const FAILURES_SHOWN: usize = 20;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let json = match &cli.command {
        Command::Check(a) => a.json,
        Command::Diff(a) => a.json,
    };
    let result = match cli.command {
        Command::Check(args) => run_check(args),
        Command::Diff(args) => run_diff(args),
    };
    let code = match result {
        Ok(code) => code,
        Err(e) => report_error(&e, json),
    };
    ExitCode::from(code as u8)
}

/// The verdict's exit code, whatever became of the output: a reader that went away (`| head`)
/// is not our failure, and does not turn a failed verification into a success either.
fn finish(verdict: i32, written: io::Result<()>) -> Result<i32, Error> {
    match written {
        Ok(()) => Ok(verdict),
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(verdict),
        Err(e) => Err(Error::Output(e)),
    }
}

/// What stops a command before a verdict: the library's errors, or stdout failing.
enum Error {
    Verify(VerifyError),
    Output(io::Error),
}

impl From<VerifyError> for Error {
    fn from(e: VerifyError) -> Self {
        Error::Verify(e)
    }
}

/// One line on stderr, or (with `--json`) one JSON object on stdout; returns the exit code.
fn report_error(e: &Error, json: bool) -> i32 {
    let (kind, message, path, code) = match e {
        Error::Verify(ve) => (
            ve.kind(),
            one_line(&ve.to_string()).into_owned(),
            Some(ve.path().display().to_string()),
            ve.exit_code(),
        ),
        Error::Output(io_err) => (
            "output",
            format!("writing output: {io_err}"),
            None,
            EXIT_RUNTIME,
        ),
    };
    if json {
        let v = serde_json::json!({
            "error": {"kind": kind, "message": message, "path": path},
            "exit_code": code,
        });
        // If stdout is gone too, stderr still says what happened.
        if writeln!(io::stdout(), "{v}").is_err() {
            let _ = writeln!(io::stderr(), "tarfa-verify: {message}");
        }
    } else {
        let _ = writeln!(io::stderr(), "tarfa-verify: {message}");
    }
    code
}

fn run_check(args: CheckArgs) -> Result<i32, Error> {
    let opts = CheckOptions {
        source: args.source,
        progress: io::stderr().is_terminal(),
    };
    let report = check_bundle(&args.bundle, &opts)?;
    let verdict = if report.ok { EXIT_OK } else { EXIT_FAILED };
    let mut out = io::stdout().lock();
    let written = (|| {
        if args.json {
            serde_json::to_writer(&mut out, &report).map_err(io::Error::from)?;
            writeln!(out)?;
        } else {
            write_check_human(&mut out, &args.bundle, &report, args.all)?;
        }
        out.flush()
    })();
    finish(verdict, written)
}

fn write_check_human(
    out: &mut impl Write,
    bundle: &std::path::Path,
    r: &CheckReport,
    all: bool,
) -> io::Result<()> {
    let shown = if all {
        r.failures.len()
    } else {
        FAILURES_SHOWN
    };
    for f in r.failures.iter().take(shown) {
        writeln!(out, "FAIL {f}")?;
    }
    if r.failures.len() > shown {
        writeln!(
            out,
            "... and {} more failures (--all or --json lists every one)",
            r.failures.len() - shown
        )?;
    }
    for n in &r.notes {
        writeln!(out, "NOTE {}: {}", one_line(&n.name), one_line(&n.detail))?;
    }
    let c = r.counts;
    let what = format!(
        "{} tensors, {} experts, {} files{}, {} bytes checked",
        c.tensors,
        c.experts,
        c.files,
        if c.shards > 0 {
            format!(
                ", {} source shard{}",
                c.shards,
                if c.shards == 1 { "" } else { "s" }
            )
        } else {
            String::new()
        },
        r.checked_bytes
    );
    let dir = one_line(&bundle.display().to_string()).into_owned();
    if r.ok {
        writeln!(out, "ok: {dir}: {what}")
    } else {
        writeln!(out, "FAILED: {dir}: {} failures; {what}", r.failures.len())
    }
}

fn run_diff(args: DiffArgs) -> Result<i32, Error> {
    let outcome = diff_manifests(&args.a, &args.b)?;
    for p in &outcome.root_mismatches {
        let _ = writeln!(
            io::stderr(),
            "tarfa-verify: warning: {}: root digest is not the SHA-256 of the manifest's lines after the first; diffing the entries",
            one_line(&p.display().to_string())
        );
    }
    let verdict = if outcome.diff.is_empty() {
        EXIT_OK
    } else {
        EXIT_FAILED
    };
    let mut out = io::stdout().lock();
    let written = (|| {
        if args.json {
            writeln!(out, "{}", tarfa_verify::diff::render_json(&outcome.diff))?;
        } else {
            out.write_all(tarfa_verify::diff::render_human(&outcome.diff).as_bytes())?;
        }
        out.flush()
    })();
    finish(verdict, written)
}
