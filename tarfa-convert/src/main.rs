//! The `tarfa-convert` command: a thin shell over the `tarfa_convert` library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use tarfa_convert::synth::{self, OutputFormat, SynthOptions};
use tarfa_convert::{convert, CodecChoice, ConvertError, ConvertOptions, WriteSummary};
use tarfa_core::exit;

const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  verification failure (bytes read back from disk differ from what was written, or a source
     shard changed during the conversion)
  2  bad input or usage (the checkpoint fails a check, the target exists without --force, the
     target is not a bundle, the target is the source or inside it or holds it)
  3  runtime or environment failure (I/O error, no disk space, interrupted, another
     tarfa-convert is writing the same target)

With --json, an error is one JSON object on stdout:
  {\"error\": {\"kind\": ..., \"message\": ..., \"path\": ...}, \"exit_code\": N}";

/// Convert a Hugging Face BF16 Mixture-of-Experts checkpoint into a verified JNF bundle.
///
/// gpt-oss's fused experts become one extent per expert (BF16 re-laid by a declared
/// permutation; MXFP4, `quant_method = "mxfp4"`, stored as released): the only quantized form
/// accepted, and only for gpt-oss's expert tensors.
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
    /// Replace an existing Tarfa bundle at OUT (a directory whose manifest.toml and model.jnf
    /// say so), atomically once the new one is verified. Anything else at OUT (a file, a
    /// directory of other files, a symlink) is refused, never deleted.
    #[arg(long)]
    force: bool,
    /// How expert extents are stored. `raw` (the default) writes format version 1, byte for
    /// byte the bundle this converter always wrote. `exp-zstd` writes format version 2: each
    /// BF16 extent's exponent plane zstd-compressed (sign and mantissa raw), kept raw where
    /// that does not save at least 5%; the manifest's hashes stay those of the decoded bytes.
    /// Encoding reads the source twice (a sizing pass, then the write).
    #[arg(long, value_enum, default_value_t = Codec::Raw)]
    codec: Codec,
    #[command(flatten)]
    common: Common,
}

#[derive(Clone, Copy, ValueEnum)]
enum Codec {
    Raw,
    ExpZstd,
}

#[derive(Args)]
struct Common {
    /// Worker threads for copying and hashing (default, and 0: one per core). At most 4 x the
    /// cores (at least 64): more only adds memory (a region buffer per thread) and start-up
    /// time, never speed.
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
    /// Architecture: qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b, deepseek-v3,
    /// deepseek-v2-lite, moonlight-16b-a3b, glm-4.5-air, gpt-oss-20b, gpt-oss-120b (BF16, or
    /// MXFP4 with --mxfp4),
    /// llama4-scout (text model), qwen3.5-35b-a3b (text model) (their released configs'
    /// dimensions), or tiny, tiny-deepseek-v3, tiny-deepseek-v2, tiny-glm4-moe, tiny-gpt-oss,
    /// tiny-llama4, tiny-qwen3.5-moe (small, for tests).
    #[arg(long)]
    shape: String,
    /// Number of layers (default: the shape's own). The DeepSeek and GLM-4.5 shapes keep
    /// first_k_dense_replace at min(its released value, LAYERS - 1), so that a cut model still
    /// has an MoE layer: deepseek-v3 --layers 4 is 3 dense layers and 1 MoE layer, --layers 2
    /// is 1 and 1, --layers 1 is one MoE layer. qwen3.5-35b-a3b keeps its pattern of three
    /// linear-attention layers then one full-attention layer: --layers 4 is one of each group.
    #[arg(long)]
    layers: Option<u32>,
    /// Routed experts per layer (default: the shape's own). A group-limited router needs
    /// n_group to divide them (deepseek-v3: 8 groups, and a sigmoid router needs at least 2
    /// experts per group, so 16, 24, 32, ...); another count is refused, naming this flag.
    #[arg(long)]
    experts: Option<u32>,
    /// Experts per token (default: the shape's own). With group-limited routing it must fit in
    /// the topk_group groups kept (deepseek-v3: 4 x EXPERTS / 8).
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
    /// gpt-oss shapes only: the experts in the released MXFP4 form (U8 blocks and scales under
    /// quantization_config.quant_method "mxfp4"), what users stream. Refused for other shapes.
    #[arg(long)]
    mxfp4: bool,
    /// Output directory.
    out: PathBuf,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        // --help and --version are "errors" printed to stdout, exit 0.
        Err(e) if !e.use_stderr() => {
            let _ = e.print();
            return ExitCode::from(exit::SUCCESS as u8);
        }
        // A usage error is reported like every other error, so that a --json caller always
        // gets one JSON object: clap could not parse the flags, so look for --json among the
        // arguments before a `--`.
        Err(e) if json_requested(std::env::args_os()) => {
            return report_error(&ConvertError::Usage(clap_message(&e)), true);
        }
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(exit::BAD_INPUT as u8);
        }
    };
    tarfa_convert::install_signal_handlers();
    let common = match &cli.command {
        Some(Command::Synth(_)) | None => &cli.convert.common,
    };
    let json = common.json;
    let result = set_threads(common.threads).and_then(|()| match cli.command {
        Some(Command::Synth(a)) => run_synth(a, json),
        None => run_convert(cli.convert, json),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => report_error(&e, json),
    }
}

/// Prints `e` (one JSON object on stdout under `--json`, one line on stderr otherwise) and
/// returns its exit code.
fn report_error(e: &ConvertError, json: bool) -> ExitCode {
    if json {
        let v = serde_json::json!({
            "error": {
                "kind": e.kind(),
                "message": e.to_string(),
                "path": e.path(),
            },
            "exit_code": e.exit_code(),
        });
        println!("{v}");
    } else {
        eprintln!("tarfa-convert: error: {e}");
    }
    ExitCode::from(e.exit_code() as u8)
}

/// Whether `--json` is among the arguments (before a `--`, after which everything is a path).
fn json_requested(args: impl Iterator<Item = std::ffi::OsString>) -> bool {
    args.skip(1)
        .take_while(|a| a != "--")
        .any(|a| a == "--json")
}

/// clap's message for a usage error on one line, without its `error: ` prefix and without the
/// usage and `--help` hint that follow it (they are for a terminal).
fn clap_message(e: &clap::Error) -> String {
    let text = e.render().to_string();
    let mut parts: Vec<&str> = Vec::new();
    for line in text.lines().map(str::trim) {
        if line.starts_with("Usage:") || line.starts_with("For more information") {
            break;
        }
        if !line.is_empty() {
            parts.push(line.strip_prefix("error: ").unwrap_or(line));
        }
    }
    parts.join(" ")
}

/// The most worker threads `--threads` accepts: 4 x the cores, and never fewer than 64 (so that
/// oversubscription stays testable on small machines). More only adds memory (a region buffer
/// per thread) and start-up time, never speed.
fn max_threads(cores: usize) -> usize {
    (4 * cores).max(64)
}

/// Size the global pool: `None` or 0 is one thread per core; more than [`max_threads`] is
/// refused.
fn set_threads(threads: Option<usize>) -> Result<(), ConvertError> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let cap = max_threads(cores);
    let n = match threads {
        None | Some(0) => cores,
        Some(n) if n > cap => {
            return Err(ConvertError::Usage(format!(
                "--threads {n}: at most {cap} (4 x the {cores} cores, at least 64); more threads only cost memory"
            )))
        }
        Some(n) => n,
    };
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build_global()
        .map_err(|e| ConvertError::Io {
            path: PathBuf::from("--threads"),
            op: "start worker threads",
            source: std::io::Error::other(e),
        })
}

fn run_convert(a: ConvertArgs, json: bool) -> Result<(), ConvertError> {
    let (Some(src), Some(out)) = (a.src, a.out) else {
        return Err(ConvertError::Usage(
            "usage: tarfa-convert <SRC_DIR> <OUT_BUNDLE_DIR> (see --help)".into(),
        ));
    };
    let codec = match a.codec {
        Codec::Raw => CodecChoice::Raw,
        Codec::ExpZstd => CodecChoice::ExponentPlaneZstd,
    };
    let s = convert(
        &src,
        &out,
        &ConvertOptions {
            force: a.force,
            codec,
        },
    )?;
    report(&s, json, Some(&src));
    Ok(())
}

fn report(s: &WriteSummary, json: bool, src: Option<&std::path::Path>) {
    for p in &s.removed_stale {
        eprintln!("tarfa-convert: removed stale temporary {}", p.display());
    }
    for n in &s.notes {
        eprintln!("tarfa-convert: note: {n}");
    }
    const SHOWN: usize = 20;
    for (name, n) in s.nonfinite.iter().take(SHOWN) {
        eprintln!(
            "tarfa-convert: warning: {name}: {n} NaN or infinite elements (carried unchanged)"
        );
    }
    if s.nonfinite.len() > SHOWN {
        eprintln!(
            "tarfa-convert: warning: {} more tensors or experts hold NaN or infinite elements (see manifest.toml, nonfinite)",
            s.nonfinite.len() - SHOWN
        );
    }
    let sizing = s.codec.as_ref().map(|c| c.sizing_time).unwrap_or_default();
    let total = sizing + s.write_time + s.sync_time + s.verify_time;
    if json {
        let mut v = serde_json::json!({
            "bundle": s.bundle,
            "root_digest": s.root_digest,
            "data_bytes": s.data_bytes,
            "sha256_bytes": s.sha256_bytes,
            "write_s": s.write_time.as_secs_f64(),
            "sync_s": s.sync_time.as_secs_f64(),
            "verify_s": s.verify_time.as_secs_f64(),
            "read_back": format!("{:?}", s.read_mode),
            "removed_stale": s.removed_stale,
            "notes": s.notes,
            "nonfinite": s.nonfinite.iter().map(|(name, n)| serde_json::json!({"name": name, "count": n})).collect::<Vec<_>>(),
            "nonfinite_total": s.nonfinite.iter().map(|(_, n)| n).sum::<u64>(),
            // The source tensors stored as gpt-oss released them (MXFP4 blocks and scales).
            "mxfp4": {"form": "released", "tensors": s.mxfp4_tensors},
        });
        // Only with --codec exp-zstd: the default's output is what it always was.
        if let Some(c) = &s.codec {
            v["codec"] = serde_json::json!({
                "name": "exp-zstd",
                "format_version": "2.0",
                "extents": c.extents,
                "encoded": c.encoded,
                "kept_raw": c.kept_raw,
                "not_bf16": c.not_bf16,
                "extent_bytes": c.extent_bytes,
                "stored_bytes": c.stored_bytes,
                "sizing_s": c.sizing_time.as_secs_f64(),
            });
        }
        println!("{v}");
    } else {
        if let Some(src) = src {
            println!("converted {} -> {}", src.display(), s.bundle.display());
        } else {
            println!("wrote {}", s.bundle.display());
        }
        println!("root digest {}", s.root_digest);
        println!(
            "{:.1} MB in {:.2} s (copy+hash with read-back overlapped {:.2} s, fsync {:.2} s, final checks {:.2} s, {})",
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
        if let Some(c) = &s.codec {
            println!(
                "format version 2, codec exp-zstd: {} of {} extents encoded ({} kept raw: \
                 encoding saved under {}%{}), {:.1} MB stored for {:.1} MB ({:.1}%, {:.3}x), \
                 sizing pass {:.2} s",
                c.encoded,
                c.extents,
                c.kept_raw,
                100 - tarfa_convert::ENCODED_AT_MOST_PERCENT,
                if c.not_bf16 > 0 {
                    format!("; {} MXFP4 extents raw", c.not_bf16)
                } else {
                    String::new()
                },
                c.stored_bytes as f64 / 1e6,
                c.extent_bytes as f64 / 1e6,
                100.0 * c.stored_bytes as f64 / c.extent_bytes.max(1) as f64,
                c.extent_bytes as f64 / c.stored_bytes.max(1) as f64,
                c.sizing_time.as_secs_f64()
            );
        }
    }
}

/// The most tensors a synthetic model may have: the tensor list is built in memory (a few
/// hundred bytes each) before anything is written. qwen3-235b-a22b has about 37 000.
const SYNTH_MAX_TENSORS: u64 = 1_000_000;

/// Refuse a synthetic shape whose size overflows, whose tensor list would not fit in memory, or
/// that the output's file system cannot hold, naming the flags that set it.
fn check_synth_size(shape: &synth::SynthShape, a: &SynthArgs) -> Result<(), ConvertError> {
    let by = flags_text(a);
    let Some((tensors, bytes)) = shape.checked_size() else {
        return Err(ConvertError::Usage(format!(
            "{by}: the model's size overflows 64 bits"
        )));
    };
    if tensors > SYNTH_MAX_TENSORS {
        return Err(ConvertError::Usage(format!(
            "{by}: {tensors} tensors, more than the {SYNTH_MAX_TENSORS} a synthetic model may have"
        )));
    }
    let dir = tarfa_convert::target::nearest_existing(&a.out);
    let dir = if dir.as_os_str().is_empty() {
        std::path::Path::new(".")
    } else {
        dir
    };
    let have = tarfa_convert::bundle::free_space(dir).map_err(ConvertError::io(dir, "statvfs"))?;
    if bytes > have {
        return Err(ConvertError::Usage(format!(
            "{by}: {bytes} bytes of weights, more than the {have} bytes free at {}",
            dir.display()
        )));
    }
    Ok(())
}

/// Refuse `--experts` that the shape's n_group does not divide into groups the router can
/// score, before anything else (the size of such a model is beside the point).
fn check_synth_groups(shape: &synth::SynthShape, a: &SynthArgs) -> Result<(), ConvertError> {
    if let (Some((groups, per_group)), Some(e)) = (shape.expert_groups(), a.experts) {
        if groups == 0 || e % groups != 0 || e / groups < per_group {
            let two = if per_group > 1 {
                " of at least 2 (its sigmoid router scores a group by its two best)"
            } else {
                ""
            };
            return Err(ConvertError::Usage(format!(
                "--experts {e}: {} splits its routed experts into n_group {groups} equal groups{two}; use a multiple of {groups}, at least {}",
                shape.name,
                groups * per_group
            )));
        }
    }
    Ok(())
}

/// Refuse a synthetic shape whose config the runtime would refuse (checked after its size, so
/// that the config's per-layer tables are never built for an absurd layer count), naming the
/// flags that made it so.
fn check_synth_config(shape: &synth::SynthShape, a: &SynthArgs) -> Result<(), ConvertError> {
    shape.runtime_config().map(|_| ()).map_err(|e| {
        ConvertError::Usage(format!(
            "{}: the runtime would refuse this model: {e}",
            flags_text(a)
        ))
    })
}

/// `--shape S with --layers L ...`: the flags that set the model, for messages.
fn flags_text(a: &SynthArgs) -> String {
    let mut flags: Vec<String> = Vec::new();
    if let Some(l) = a.layers {
        flags.push(format!("--layers {l}"));
    }
    if let Some(e) = a.experts {
        flags.push(format!("--experts {e}"));
    }
    if let Some(k) = a.top_k {
        flags.push(format!("--top-k {k}"));
    }
    if let Some(v) = a.vocab {
        flags.push(format!("--vocab {v}"));
    }
    if flags.is_empty() {
        format!("--shape {}", a.shape)
    } else {
        format!("--shape {} with {}", a.shape, flags.join(" "))
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
    if a.mxfp4 {
        // MXFP4 is gpt-oss's released form and nothing else's (the runtime refuses it
        // elsewhere); its blocks need H and the expert width to be multiples of 32.
        match shape.fused.as_mut() {
            Some(f) if shape.family == synth::Family::GptOss => f.mxfp4 = true,
            _ => {
                return Err(ConvertError::Usage(format!(
                    "--mxfp4: shape {} is not gpt-oss; MXFP4 is gpt-oss's released form only",
                    shape.name
                )))
            }
        }
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
    check_synth_groups(&shape, &a)?;
    check_synth_size(&shape, &a)?;
    check_synth_config(&shape, &a)?;
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
