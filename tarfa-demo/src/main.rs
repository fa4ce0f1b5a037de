//! The `tarfa-demo` command: converts the demo model with tarfa-convert, verifies the bundle and
//! generates from it with tarfa-run's `generate`. A binary of its own so that the runtime
//! (tarfa-run) never links the converter.
//!
//! It must never do anything the two tools cannot do on their own: it only chains them.

mod demo;

use std::process::ExitCode;

use clap::Parser;

const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  verification failure (the converted bundle does not read back as written, a byte of the
     bundle does not match its manifest)
  2  bad input or usage (no demo model found, a model the runtime cannot run)
  3  runtime or environment failure (I/O error, no space, no GPU, unavailable SIMD path)";

/// Convert, verify and run the small demo model that ships with Tarfa.
///
/// A Qwen3-MoE that transformers trained on Python source, with its tokenizer: converted into a
/// verified bundle in the cache (reused while the source's bytes stay the same), every byte
/// checked against the manifest, then greedy generation, exact f32, streamed as text.
#[derive(Parser)]
#[command(name = "tarfa-demo", version, after_help = EXIT_CODES)]
struct Cli {
    #[command(flatten)]
    demo: demo::DemoArgs,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    match demo::run(&cli.demo) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tarfa-demo: error: {e}");
            ExitCode::from(e.exit_code() as u8)
        }
    }
}
