//! `tarfa-ab`: the paired A/B harness (`validation/ab` builds and runs it). Compares two runtime
//! builds or two option sets on one bundle, prints a markdown table and ACCEPT or REJECT against
//! the bar declared on the command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use tarfa_validate::ab::verdict::{Bar, Metric};
use tarfa_validate::ab::{conclude, run, AbConfig, ArmSpec, Workload};
use tarfa_validate::bundle::Bundle;
use tarfa_validate::runner::{sibling_binary, Runtime};

const AFTER: &str = "\
Examples:
  two builds:      tarfa-ab BUNDLE --a-bin old/tarfa-run --b-bin new/tarfa-run
  two option sets: tarfa-ab BUNDLE --a-args '--threads 1' --b-args '--threads 2'

Exit codes:
  0  ACCEPT
  1  REJECT
  2  bad usage (unknown flag, not a bundle, a workload longer than the model's context)
  3  environment failure (a runtime missing, or a run that did not exit 0)";

/// Paired A/B comparison of two tarfa-run builds or option sets.
#[derive(Parser)]
#[command(name = "tarfa-ab", version, after_help = AFTER)]
struct Cli {
    /// The bundle both arms run.
    bundle: PathBuf,
    /// Arm A's runtime (default: $TARFA_RUN, else tarfa-run next to this binary).
    #[arg(long)]
    a_bin: Option<PathBuf>,
    /// Arm B's runtime (default: A's).
    #[arg(long)]
    b_bin: Option<PathBuf>,
    /// Arm A's extra options, one string (e.g. '--threads 1').
    #[arg(long, allow_hyphen_values = true, default_value = "")]
    a_args: String,
    /// Arm B's extra options.
    #[arg(long, allow_hyphen_values = true, default_value = "")]
    b_args: String,
    /// Workloads, PROMPT_LEN:NEW_TOKENS (repeatable).
    #[arg(long = "workload", value_parser = Workload::parse,
          default_values = ["512:64", "1024:64", "2048:64"])]
    workloads: Vec<Workload>,
    /// Measured pairs per workload (after one warm-up per arm).
    #[arg(long, default_value_t = 10)]
    pairs: usize,
    /// Seed of the prompts and of the bootstrap.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Bootstrap resamples.
    #[arg(long, default_value_t = 20_000)]
    resamples: usize,
    /// Also write and compare prefill logits.
    #[arg(long)]
    prefill_logits: bool,
    /// Bar: the metric that must improve (request, prefill, decode, process).
    #[arg(long, value_parser = Metric::parse, default_value = "request")]
    metric: Metric,
    /// Bar: the smallest median improvement, percent.
    #[arg(long, default_value_t = 2.0)]
    min_improvement_pct: f64,
    /// Bar: metrics in which no workload may regress beyond parity (default: --metric).
    #[arg(long, value_parser = Metric::parse, value_delimiter = ',')]
    guard: Vec<Metric>,
    /// Bar: the largest allowed peak RSS/VRAM growth, percent.
    #[arg(long, default_value_t = 1.0)]
    max_mem_regression_pct: f64,
    /// Bar: B may change the logits (an inexact mode; say so in the phase log).
    #[arg(long)]
    allow_logit_change: bool,
    /// Kill a run after this many seconds (the experiment then stops, exit 3).
    #[arg(long, default_value_t = 3600)]
    run_timeout_s: u64,
    /// Also write the report to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// No progress lines on stderr.
    #[arg(long, short)]
    quiet: bool,
}

fn usage(msg: String) -> ExitCode {
    eprintln!("tarfa-ab: {msg}");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    if cli.pairs < 2 {
        return usage("--pairs must be at least 2".into());
    }
    if cli.resamples < 100 {
        return usage("--resamples must be at least 100".into());
    }
    let bundle = match Bundle::open(&cli.bundle) {
        Ok(b) => b,
        Err(e) => return usage(format!("{e:#}")),
    };
    if let Some(max) = bundle.config.max_position_embeddings {
        if let Some(w) = cli
            .workloads
            .iter()
            .find(|w| w.prompt_len + w.new_tokens > max)
        {
            return usage(format!(
                "workload {} needs {} positions; the model allows {max} (pass --workload)",
                w.name(),
                w.prompt_len + w.new_tokens
            ));
        }
    }
    let a_bin = match cli
        .a_bin
        .clone()
        .or_else(|| std::env::var_os("TARFA_RUN").map(PathBuf::from))
        .or_else(|| sibling_binary("tarfa-run"))
    {
        Some(p) => p,
        None => {
            eprintln!("tarfa-ab: no tarfa-run found; pass --a-bin");
            return ExitCode::from(3);
        }
    };
    let b_bin = cli.b_bin.clone().unwrap_or_else(|| a_bin.clone());
    for bin in [&a_bin, &b_bin] {
        if let Err(e) = Runtime::at(bin) {
            eprintln!("tarfa-ab: {e:#}");
            return ExitCode::from(3);
        }
    }
    let split = |s: &str| s.split_whitespace().map(str::to_string).collect::<Vec<_>>();
    let bar = Bar {
        metric: cli.metric,
        min_improvement: cli.min_improvement_pct / 100.0,
        guard: if cli.guard.is_empty() {
            vec![cli.metric]
        } else {
            cli.guard.clone()
        },
        max_memory_regression: cli.max_mem_regression_pct / 100.0,
        require_bit_identical: !cli.allow_logit_change,
    };
    let cfg = AbConfig {
        bundle: cli.bundle.clone(),
        a: ArmSpec {
            bin: a_bin,
            args: split(&cli.a_args),
        },
        b: ArmSpec {
            bin: b_bin,
            args: split(&cli.b_args),
        },
        workloads: cli.workloads.clone(),
        pairs: cli.pairs,
        seed: cli.seed,
        resamples: cli.resamples,
        vocab: bundle.config.vocab_size,
        prefill_logits: cli.prefill_logits,
        bar,
        run_timeout: std::time::Duration::from_secs(cli.run_timeout_s),
    };
    // The bar is printed before the first run: it is declared, not chosen after seeing results.
    eprintln!("tarfa-ab: bar: {}", cfg.bar);
    let quiet = cli.quiet;
    let results = match run(&cfg, |line| {
        if !quiet {
            eprintln!("tarfa-ab: {line}");
        }
    }) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tarfa-ab: {e:#}");
            return ExitCode::from(3);
        }
    };
    let (verdict, text) = conclude(&cfg, &results);
    // A closed pipe (`| head`) is not an error.
    let _ = std::io::Write::write_all(&mut std::io::stdout().lock(), text.as_bytes());
    if let Some(out) = &cli.out {
        if let Err(e) = std::fs::write(out, &text) {
            eprintln!("tarfa-ab: cannot write {}: {e}", out.display());
            return ExitCode::from(3);
        }
    }
    ExitCode::from(if verdict.accepted() { 0 } else { 1 })
}
