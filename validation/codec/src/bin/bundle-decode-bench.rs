//! bundle-decode-bench (issue 24, PHASE_LOG K2): what format version 2 did to a converted
//! bundle, and how fast one CPU thread decodes it. Reads the bundle's header and manifest;
//! prints the extents stored encoded and raw, the stored bytes against the decoded ones, and
//! the decode throughput (GB/s of decoded output, one thread, `jnf_codec::decode_into` into a
//! reused buffer, best of `--repeat` passes over every encoded extent), after checking every
//! decoded extent's BLAKE3 against the manifest.
//!
//!   bundle-decode-bench BUNDLE [--repeat 3] [--json]
//!
//! Exit codes: 0 ok, 1 a decoded extent differs from the manifest, 2 bad usage, 3 unreadable.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use serde_json::json;

#[derive(Parser)]
#[command(
    name = "bundle-decode-bench",
    about = "Issue 24: a format-version-2 bundle's encoded extents: stored share, extents kept raw, CPU decode GB/s per thread"
)]
struct Cli {
    /// A bundle directory (model.jnf and manifest.toml).
    bundle: PathBuf,
    /// Timed passes over every encoded extent; the best is reported.
    #[arg(long, default_value_t = 3)]
    repeat: u32,
    /// Decode each extent into a freshly mapped buffer, as the streaming store does (first
    /// touch of every page counted), instead of one reused buffer.
    #[arg(long)]
    fresh_buffers: bool,
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    match run(&cli) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("bundle-decode-bench: error: {e}");
            ExitCode::from(3)
        }
    }
}

fn run(cli: &Cli) -> Result<bool, String> {
    let jnf_path = cli.bundle.join(jnf_format::CONTAINER_FILE);
    let jnf =
        jnf_format::JnfFile::open(&jnf_path).map_err(|e| format!("{}: {e}", jnf_path.display()))?;
    let manifest = tarfa_manifest::Manifest::load(&cli.bundle.join("manifest.toml"))
        .map_err(|e| format!("{}: {e}", cli.bundle.display()))?;
    let blake3 = manifest.expert_index();
    let h = jnf.header();
    let encoded: Vec<&jnf_format::ExpertExtent> =
        h.experts.iter().filter(|e| e.is_encoded()).collect();
    let decoded_all: u64 = h.experts.iter().map(|e| e.length).sum();
    let stored_all: u64 = h.experts.iter().map(|e| e.stored_length).sum();
    let padded_all: u64 = h.experts.iter().map(|e| e.padded_length).sum();
    // The stored extents, in memory: the timing is the decoder's, not the disk's.
    let mut stored = Vec::with_capacity(encoded.len());
    for e in &encoded {
        let mut buf = Vec::new();
        jnf.read_stored_into(e, &mut buf)
            .map_err(|err| format!("{}: {err}", e.prefix))?;
        stored.push(buf);
    }
    let largest = encoded.iter().map(|e| e.length).max().unwrap_or(0) as usize;
    let mut out = vec![0u8; largest];
    let mut ok = true;
    for (e, s) in encoded.iter().zip(&stored) {
        let out = &mut out[..e.length as usize];
        let good = e.decode_stored(s, out).is_ok()
            && blake3::hash(out).to_hex().as_str() == blake3[&(e.layer, e.expert)].blake3;
        if !good {
            eprintln!(
                "bundle-decode-bench: {}: does not decode to its manifest BLAKE3",
                e.prefix
            );
            ok = false;
        }
    }
    let decoded: u64 = encoded.iter().map(|e| e.length).sum();
    let mut best = f64::INFINITY;
    for _ in 0..cli.repeat.max(1) {
        let t = Instant::now();
        for (e, s) in encoded.iter().zip(&stored) {
            if cli.fresh_buffers {
                // vec![0; n] of this size is a fresh zero mapping (calloc): pages faulted in
                // by the decode's first writes, as in the store's buffers.
                let mut fresh = vec![0u8; e.length as usize];
                jnf_codec::decode_into(s, &mut fresh)
                    .map_err(|err| format!("{}: {err}", e.prefix))?;
                std::hint::black_box(&fresh);
                continue;
            }
            jnf_codec::decode_into(s, &mut out[..e.length as usize])
                .map_err(|err| format!("{}: {err}", e.prefix))?;
            std::hint::black_box(&out);
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    let gb_s = if best > 0.0 {
        decoded as f64 / best / 1e9
    } else {
        0.0
    };
    let bf16 = h
        .experts
        .iter()
        .filter(|e| e.encoding() == jnf_format::ExtentEncoding::Bf16)
        .count();
    let kept_raw = bf16 - encoded.len();
    let v = json!({
        "bundle": cli.bundle,
        "format_version": format!("{}.{}", h.major, h.minor),
        "extents": h.experts.len(),
        "encoded": encoded.len(),
        "kept_raw": kept_raw,
        "kept_raw_share": if bf16 > 0 { kept_raw as f64 / bf16 as f64 } else { 0.0 },
        "decoded_bytes": decoded_all,
        "stored_bytes": stored_all,
        "stored_share": stored_all as f64 / decoded_all.max(1) as f64,
        "padded_bytes": padded_all,
        "decode_gb_s_one_thread": gb_s,
        "fresh_buffers": cli.fresh_buffers,
        "decoded_per_pass": decoded,
        "best_pass_s": best,
    });
    if cli.json {
        println!("{v}");
    } else {
        println!(
            "{}: format {}; {} extents, {} encoded, {} BF16 kept raw ({:.2}%); stored {:.1} MB \
             for {:.1} MB ({:.2}%, {:.3}x; padded {:.1} MB); decode {:.2} GB/s on one thread \
             ({:.1} MB decoded per pass, best of {}{})",
            cli.bundle.display(),
            v["format_version"].as_str().unwrap_or(""),
            h.experts.len(),
            encoded.len(),
            kept_raw,
            100.0 * v["kept_raw_share"].as_f64().unwrap_or(0.0),
            stored_all as f64 / 1e6,
            decoded_all as f64 / 1e6,
            100.0 * stored_all as f64 / decoded_all.max(1) as f64,
            decoded_all as f64 / stored_all.max(1) as f64,
            padded_all as f64 / 1e6,
            gb_s,
            decoded as f64 / 1e6,
            cli.repeat.max(1),
            if cli.fresh_buffers {
                ", a fresh buffer each"
            } else {
                ""
            }
        );
    }
    Ok(ok)
}
