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
  - model.jnf's header is valid, manifest.toml is valid and its root digest matches its entries;
  - the header and the manifest list the same tensors and experts, with the same dtypes, shapes
    and lengths;
  - the SHA-256 and BLAKE3 of every tensor and expert extent (gate, up, down bytes) match the
    manifest, and every padding byte is zero;
  - every copied file (config.json, ...) has the recorded size and SHA-256, and no unlisted file
    is in the bundle.
With --source, also: every source shard's size and whole-file SHA-256 match the manifest, the
source holds exactly the bundle's tensors, and every tensor's bytes in the bundle equal the
source's bytes at the tensor's recorded (shard, offset).";

#[derive(Args)]
struct CheckArgs {
    /// The bundle directory.
    bundle: PathBuf,
    /// The source checkpoint directory the bundle was converted from.
    #[arg(long, value_name = "SRC_DIR")]
    source: Option<PathBuf>,
    /// Print {"ok": bool, "failures": [{"name", "kind", "detail"}], "checked_bytes": N}.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct DiffArgs {
    /// The old release: a bundle directory or a manifest.toml file.
    a: PathBuf,
    /// The new release: a bundle directory or a manifest.toml file.
    b: PathBuf,
    /// Print {"changed": [...], "added": [...], "removed": [...], "unchanged": N}.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Check(args) => run_check(args),
        Command::Diff(args) => run_diff(args),
    };
    let code = match result {
        Ok(code) => code,
        Err(e) => match e.downcast_ref::<io::Error>() {
            // A reader that went away (`| head`) is not our failure.
            Some(io_err) if io_err.kind() == io::ErrorKind::BrokenPipe => EXIT_OK,
            Some(io_err) => {
                let _ = writeln!(io::stderr(), "tarfa-verify: writing output: {io_err}");
                EXIT_RUNTIME
            }
            None => match e.downcast_ref::<VerifyError>() {
                Some(ve) => {
                    let _ = writeln!(io::stderr(), "tarfa-verify: {}", one_line(&ve.to_string()));
                    ve.exit_code()
                }
                None => {
                    let _ = writeln!(io::stderr(), "tarfa-verify: {e:#}");
                    EXIT_RUNTIME
                }
            },
        },
    };
    ExitCode::from(code as u8)
}

fn run_check(args: CheckArgs) -> anyhow::Result<i32> {
    let opts = CheckOptions {
        source: args.source,
        progress: io::stderr().is_terminal(),
    };
    let report = check_bundle(&args.bundle, &opts)?;
    let mut out = io::stdout().lock();
    if args.json {
        serde_json::to_writer(&mut out, &report)?;
        writeln!(out)?;
    } else {
        write_check_human(&mut out, &args.bundle, &report)?;
    }
    out.flush()?;
    Ok(if report.ok { EXIT_OK } else { EXIT_FAILED })
}

fn write_check_human(
    out: &mut impl Write,
    bundle: &std::path::Path,
    r: &CheckReport,
) -> io::Result<()> {
    for f in &r.failures {
        writeln!(out, "FAIL {f}")?;
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

fn run_diff(args: DiffArgs) -> anyhow::Result<i32> {
    let outcome = diff_manifests(&args.a, &args.b)?;
    for p in &outcome.root_mismatches {
        let _ = writeln!(
            io::stderr(),
            "tarfa-verify: warning: {}: root digest does not match the manifest's entries; diffing the entries",
            one_line(&p.display().to_string())
        );
    }
    let mut out = io::stdout().lock();
    if args.json {
        writeln!(out, "{}", tarfa_verify::diff::render_json(&outcome.diff))?;
    } else {
        out.write_all(tarfa_verify::diff::render_human(&outcome.diff).as_bytes())?;
    }
    out.flush()?;
    Ok(if outcome.diff.is_empty() {
        EXIT_OK
    } else {
        EXIT_FAILED
    })
}
