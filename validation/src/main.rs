//! `tarfa-validate`: runs the invariant checks on a bundle, prints one line per check with what
//! was compared, and exits 0 only if every check held. `validation/run-all` builds and runs it.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use tarfa_validate::arms::parse_extra_arm;
use tarfa_validate::bundle::Bundle;
use tarfa_validate::checks::{exit_code, Context, Status, CHECKS};
use tarfa_validate::runner::Runtime;
use tarfa_validate::workload::{find_oracle, Oracle};

const EXIT_CODES: &str = "\
Checks:
  weights     every tensor and expert the run used was verified against manifest.toml
              (the runtime's --verify-report, cross-checked; bundle re-hashed; tamper probes)
  router      top-k = num_experts_per_tok in every MoE layer at every position (--router-trace)
  f32-logits  the f32 path meets the oracle tolerance; the bf16-before-lm_head arm does not
  invariance  every optional feature (threads, kernels, budgets, I/O, backends) leaves every
              logit bit-identical to the baseline

Exit codes:
  0  every check held (a skipped check says why on its line)
  1  a check failed
  2  bad usage: unknown flag, not a bundle
  3  environment failure: tarfa-run missing or exited 3, scratch files not writable";

/// Run Tarfa's invariant checks on BUNDLE.
#[derive(Parser)]
#[command(name = "tarfa-validate", version, after_help = EXIT_CODES)]
struct Cli {
    /// The bundle directory (manifest.toml, model.jnf, config.json).
    bundle: PathBuf,
    /// The runtime to check (default: $TARFA_RUN, else tarfa-run next to this binary).
    #[arg(long)]
    tarfa_run: Option<PathBuf>,
    /// Run only these checks (comma-separated).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// The oracle's reference.safetensors for this bundle (default: found among the oracle
    /// fixtures by the manifest's source shard hashes).
    #[arg(long)]
    reference: Option<PathBuf>,
    /// Directories of oracle fixtures to search (default: the repository's fixtures/oracle).
    #[arg(long)]
    oracle_dir: Vec<PathBuf>,
    /// An extra invariance arm, NAME=OPTIONS (e.g. "t5=--threads 5"); repeatable.
    #[arg(long = "arm")]
    arms: Vec<String>,
    /// Run only the --arm arms, not the built-in table.
    #[arg(long)]
    no_table_arms: bool,
    /// Do not re-hash the reported regions of model.jnf (for very large bundles).
    #[arg(long)]
    no_rehash: bool,
    /// Skip the tamper probes when model.jnf is larger than this many bytes.
    #[arg(long, default_value_t = 512 << 20)]
    tamper_limit: u64,
    /// Kill a tarfa-run still running after this many seconds (the check then fails).
    #[arg(long, default_value_t = 900)]
    run_timeout_s: u64,
    /// Seed of the random prompts used where there is no oracle.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// A line on stdout; a closed pipe (`| head`) is not an error.
fn say(line: std::fmt::Arguments) {
    let _ = writeln!(std::io::stdout().lock(), "{line}");
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    for name in &cli.only {
        if !CHECKS.iter().any(|(n, _)| n == name) {
            eprintln!("tarfa-validate: unknown check `{name}`");
            return ExitCode::from(2);
        }
    }
    let extra_arms = match cli
        .arms
        .iter()
        .map(|a| parse_extra_arm(a))
        .collect::<Result<Vec<_>, _>>()
    {
        Ok(a) => a,
        Err(e) => {
            eprintln!("tarfa-validate: {e}");
            return ExitCode::from(2);
        }
    };
    let bundle = match Bundle::open(&cli.bundle) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("tarfa-validate: {e:#}");
            return ExitCode::from(2);
        }
    };
    let runtime = match Runtime::locate(cli.tarfa_run.as_deref()) {
        Ok(mut r) => {
            r.timeout = std::time::Duration::from_secs(cli.run_timeout_s);
            r
        }
        Err(e) => {
            eprintln!("tarfa-validate: tarfa-run is not usable: {e:#}");
            return ExitCode::from(3);
        }
    };
    let reference = cli.reference.clone().or_else(|| {
        let dirs = if cli.oracle_dir.is_empty() {
            vec![tarfa_validate::default_oracle_dir()]
        } else {
            cli.oracle_dir.clone()
        };
        find_oracle(&bundle, &dirs)
    });
    let oracle = match reference.as_deref().map(Oracle::load).transpose() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("tarfa-validate: {e:#}");
            return ExitCode::from(2);
        }
    };
    say(format_args!(
        "tarfa-validate: bundle {} ({}, root {}), runtime {}, oracle {}",
        bundle.dir.display(),
        bundle.config.model_type,
        bundle.manifest.root_digest,
        runtime.bin.display(),
        oracle
            .as_ref()
            .map(|o| o.path.display().to_string())
            .unwrap_or_else(|| "none".into())
    ));
    let mut ctx = match Context::new(runtime, bundle, oracle) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("tarfa-validate: cannot create a scratch directory: {e:#}");
            return ExitCode::from(3);
        }
    };
    ctx.rehash = !cli.no_rehash;
    ctx.tamper_limit = cli.tamper_limit;
    ctx.extra_arms = extra_arms;
    ctx.table_arms = !cli.no_table_arms;
    ctx.seed = cli.seed;

    let mut outcomes = Vec::new();
    for (name, check) in CHECKS {
        if !cli.only.is_empty() && !cli.only.iter().any(|n| n == name) {
            continue;
        }
        let o = check(&ctx);
        say(format_args!("{o}"));
        outcomes.push(o);
    }
    let count = |s: Status| outcomes.iter().filter(|o| o.status == s).count();
    let code = exit_code(&outcomes);
    say(format_args!(
        "{} checks: {} held, {} failed, {} skipped, {} environment errors -> exit {code}",
        outcomes.len(),
        count(Status::Held),
        count(Status::Failed),
        count(Status::Skipped),
        count(Status::Environment)
    ));
    ExitCode::from(code as u8)
}
