//! The `tarfa-convert` command: a thin shell over the `tarfa_convert` library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use tarfa_convert::synth::{self, OutputFormat, SynthOptions};
use tarfa_convert::{convert, ConvertError, ConvertOptions, WriteSummary};

const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  verification failure (bytes read back from disk differ from what was written)
  2  bad input or usage (the checkpoint fails a check, the target exists without --force)
  3  runtime or environment failure (I/O error, no disk space, interrupted)";

/// Convert a Hugging Face BF16 Mixture-of-Experts checkpoint into a verified JNF bundle.
///
/// Reads config.json and model.safetensors or model.safetensors.index.json with its shards
/// (Hub cache snapshots included), validates everything, lays experts out contiguously and
/// page-aligned, copies the bytes unchanged while hashing them, writes manifest.toml, fsyncs,
/// re-reads every extent from the disk to verify it, and only then renames the bundle into place.
/// An interrupted or failed conversion leaves no bundle.
#[derive(Parser)]
#[command(version, after_help = EXIT_CODES, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    convert: ConvertArgs,
}

#[derive(Args)]
struct ConvertArgs {
    /// The checkpoint directory (config.json plus safetensors weights).
    src: Option<PathBuf>,
    /// The bundle directory to create.
    out: Option<PathBuf>,
    /// Replace an existing bundle at OUT.
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    common: Common,
}

#[derive(Args)]
struct Common {
    /// Worker threads for copying and hashing (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    /// Print the result as one JSON object.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a deterministic synthetic checkpoint of a real MoE shape.
    ///
    /// Weights are roughly normal with per-matrix scales (compressible like real BF16), and
    /// --skew makes expert popularity uneven as in trained routers. --format bundle writes a JNF
    /// bundle directly, without a source on disk.
    Synth(SynthArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum Format {
    Hub,
    Bundle,
}

#[derive(Args)]
#[command(after_help = EXIT_CODES)]
struct SynthArgs {
    /// Architecture: qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b, or tiny (tests).
    #[arg(long)]
    shape: String,
    /// Number of layers (default: the shape's own).
    #[arg(long)]
    layers: Option<u32>,
    /// Number of experts per layer (default: the shape's own).
    #[arg(long)]
    experts: Option<u32>,
    /// Experts per token (default: the shape's own).
    #[arg(long)]
    top_k: Option<u32>,
    /// Vocabulary size (default: the shape's own).
    #[arg(long)]
    vocab: Option<u64>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Router skew: 0 for independent routers, 1 for trained-like uneven popularity.
    #[arg(long, default_value_t = 0.0)]
    skew: f32,
    #[arg(long, value_enum, default_value_t = Format::Hub)]
    format: Format,
    /// Largest shard of the Hub layout, in bytes.
    #[arg(long, default_value_t = 1 << 30)]
    shard_size: u64,
    /// Replace an existing output.
    #[arg(long)]
    force: bool,
    /// Output directory.
    out: PathBuf,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    tarfa_convert::install_signal_handlers();
    let common = match &cli.command {
        Some(Command::Synth(_)) | None => &cli.convert.common,
    };
    if let Some(n) = common.threads {
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build_global();
    }
    let json = common.json;
    let result = match cli.command {
        Some(Command::Synth(a)) => run_synth(a, json),
        None => run_convert(cli.convert, json),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tarfa-convert: error: {e}");
            ExitCode::from(e.exit_code() as u8)
        }
    }
}

fn run_convert(a: ConvertArgs, json: bool) -> Result<(), ConvertError> {
    let (Some(src), Some(out)) = (a.src, a.out) else {
        return Err(ConvertError::Usage(
            "usage: tarfa-convert <SRC_DIR> <OUT_BUNDLE_DIR> (see --help)".into(),
        ));
    };
    let s = convert(&src, &out, &ConvertOptions { force: a.force })?;
    report(&s, json, Some(&src));
    Ok(())
}

fn report(s: &WriteSummary, json: bool, src: Option<&std::path::Path>) {
    for p in &s.removed_stale {
        eprintln!("tarfa-convert: removed stale temporary {}", p.display());
    }
    let total = s.write_time + s.sync_time + s.verify_time;
    if json {
        let v = serde_json::json!({
            "bundle": s.bundle,
            "root_digest": s.root_digest,
            "data_bytes": s.data_bytes,
            "sha256_bytes": s.sha256_bytes,
            "write_s": s.write_time.as_secs_f64(),
            "sync_s": s.sync_time.as_secs_f64(),
            "verify_s": s.verify_time.as_secs_f64(),
            "read_back": format!("{:?}", s.read_mode),
            "removed_stale": s.removed_stale,
        });
        println!("{v}");
    } else {
        if let Some(src) = src {
            println!("converted {} -> {}", src.display(), s.bundle.display());
        } else {
            println!("wrote {}", s.bundle.display());
        }
        println!("root digest {}", s.root_digest);
        println!(
            "{:.1} MB in {:.2} s (copy+hash {:.2} s, fsync {:.2} s, read-back {:.2} s, {})",
            s.data_bytes as f64 / 1e6,
            total.as_secs_f64(),
            s.write_time.as_secs_f64(),
            s.sync_time.as_secs_f64(),
            s.verify_time.as_secs_f64(),
            match s.read_mode {
                tarfa_convert::aligned::ReadMode::Direct => "O_DIRECT",
                tarfa_convert::aligned::ReadMode::DroppedCache => "page cache dropped",
            }
        );
    }
}

fn run_synth(a: SynthArgs, json: bool) -> Result<(), ConvertError> {
    let mut shape = synth::shapes()
        .into_iter()
        .find(|s| s.name == a.shape)
        .ok_or_else(|| {
            let names: Vec<_> = synth::shapes().iter().map(|s| s.name).collect();
            ConvertError::Usage(format!(
                "unknown shape {:?}; one of {}",
                a.shape,
                names.join(", ")
            ))
        })?;
    if let Some(l) = a.layers {
        shape.layers = l;
    }
    if let Some(e) = a.experts {
        shape.experts = e;
    }
    if let Some(k) = a.top_k {
        shape.top_k = k;
    }
    if let Some(v) = a.vocab {
        shape.vocab = v;
    }
    if shape.layers == 0
        || shape.experts == 0
        || shape.vocab == 0
        || shape.top_k == 0
        || shape.top_k > shape.experts
    {
        return Err(ConvertError::Usage(
            "layers, experts, vocab and top-k must be positive, top-k <= experts".into(),
        ));
    }
    if !(0.0..=100.0).contains(&a.skew) {
        return Err(ConvertError::Usage(
            "--skew must be between 0 and 100".into(),
        ));
    }
    let opts = SynthOptions {
        shape,
        seed: a.seed,
        skew: a.skew,
        format: match a.format {
            Format::Hub => OutputFormat::Hub,
            Format::Bundle => OutputFormat::Bundle,
        },
        shard_bytes: a.shard_size.max(1),
        force: a.force,
    };
    let r = synth::synth(&a.out, &opts)?;
    if json {
        let v = serde_json::json!({
            "out": a.out,
            "bytes": r.bytes,
            "tensors": r.tensors,
            "zstd_ratio": r.zstd_ratio,
            "root_digest": r.bundle.as_ref().map(|b| b.root_digest.clone()),
        });
        println!("{v}");
    } else {
        println!(
            "synthesised {} ({} tensors, {:.1} MB) into {}",
            opts.shape.name,
            r.tensors,
            r.bytes as f64 / 1e6,
            a.out.display()
        );
        println!(
            "zstd ratio of the generated BF16 experts: {:.3} (real BF16 weights: about 1.27)",
            r.zstd_ratio
        );
        if let Some(b) = &r.bundle {
            report(b, false, None);
        }
    }
    Ok(())
}
