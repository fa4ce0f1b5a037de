//! The `tarfa-run` command: a thin shell over the `tarfa_run` library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use tarfa_run::cli;
use tarfa_run::cli::generate::GenerateArgs;

const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  verification failure (a byte of the bundle does not match its manifest, a wrong root digest)
  2  bad input or usage (missing bundle, token id outside the vocabulary, empty or too long prompt,
     an output path that is not a regular file or lies inside the bundle)
  3  runtime or environment failure (I/O error, a failed output write, no GPU, unavailable SIMD
     path, a thread that cannot start)";

/// Tarfa's runtime: exact inference for Mixture-of-Experts models from verified JNF bundles.
///
/// Every weight is hash-checked against the bundle's manifest before its first use; the router
/// uses the model's own top-k; all arithmetic is f32 in one canonical order (docs/EXACTNESS.md),
/// so every logit has the same bits whatever the thread count, SIMD path or backend.
#[derive(Parser)]
#[command(version, after_help = EXIT_CODES)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate from a bundle (greedily unless asked to sample), streaming the decoded text.
    ///
    /// Every weight is verified against the bundle's manifest before it is computed with, an
    /// expert when it is first read: a corrupted expert the prompt never routes to goes
    /// unnoticed. --preload reads and verifies every expert before the first step.
    #[command(after_help = EXIT_CODES)]
    // Boxed: its many flags make it much the largest variant.
    Generate(Box<GenerateArgs>),
    /// Score evaluation requests from JSON Lines (lm-eval's loglikelihood, loglikelihood_rolling
    /// and generate_until), one result line per request, in order.
    ///
    /// The results are byte-identical for any --max-batch, thread count, SIMD path and backend.
    /// A summary line ends the run (requests, tokens, requests/s, tokens/s; --json for scripts).
    #[command(after_help = EXIT_CODES)]
    Score(cli::score::ScoreArgs),
    /// The rolling log-likelihood of a text file: tokens, tok/s, the mean NLL and the perplexity.
    #[command(after_help = EXIT_CODES)]
    Perplexity(cli::score::PerplexityArgs),
    /// Serve the OpenAI API (completions, chat completions, models, health, metrics) on the
    /// bundle, with continuous batching: every answer is the same bits at any load, and equals
    /// what `score` prints for the same request. Binds 127.0.0.1 unless --host says otherwise;
    /// SIGTERM drains the requests in flight, then exits 0. A port in use is exit 3.
    #[command(after_help = EXIT_CODES)]
    Serve(Box<cli::serve::ServeArgs>),
    /// Check a GPU backend against the CPU reference, bit for bit, on bundles.
    #[command(after_help = EXIT_CODES)]
    Selftest(cli::selftest::SelftestArgs),
    /// Measure the disk's read bandwidth for whole expert extents at several queue depths.
    #[command(after_help = EXIT_CODES)]
    IoBench(cli::io_bench::IoBenchArgs),
    /// The demo is its own binary, `tarfa-demo`, so that the runtime does not link the converter;
    /// this runs the `tarfa-demo` that sits beside this binary, with the same arguments.
    #[command(hide = true, disable_help_flag = true)]
    Demo {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
}

/// Runs `tarfa-demo` from this binary's directory (where cargo and installs put both), or says
/// how to get it (exit 2): never a silent fallback to another model or path.
fn run_demo(args: &[std::ffi::OsString]) -> ExitCode {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join("tarfa-demo")));
    match beside {
        Some(demo) if demo.is_file() => match std::process::Command::new(&demo).args(args).status()
        {
            Ok(status) => ExitCode::from(status.code().unwrap_or(3).clamp(0, 255) as u8),
            Err(e) => {
                eprintln!(
                    "tarfa-run: error: {}: cannot run the demo: {e}",
                    demo.display()
                );
                ExitCode::from(3)
            }
        },
        _ => {
            eprintln!(
                "tarfa-run: error: the demo is its own binary, tarfa-demo, which is not beside this \
                 one; run `cargo run --release -p tarfa-demo` (or build the workspace)"
            );
            ExitCode::from(2)
        }
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    let result = match cli.command {
        Command::Generate(a) => cli::generate::run(&a),
        Command::Score(a) => cli::score::run(&a),
        Command::Perplexity(a) => cli::score::perplexity(&a),
        Command::Serve(a) => cli::serve::run(&a),
        Command::Selftest(a) => cli::selftest::run(&a),
        Command::IoBench(a) => cli::io_bench::run(&a),
        Command::Demo { args } => return run_demo(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tarfa-run: error: {e}");
            ExitCode::from(e.exit_code() as u8)
        }
    }
}
