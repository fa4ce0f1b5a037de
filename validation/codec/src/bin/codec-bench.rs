//! codec-bench (issue 24, research): the lossless BF16 codecs of `tarfa_codec_lab` on expert
//! extents like the ones streamed, one extent (one expert matrix) per zstd frame as a format
//! would store them. Prints per source and codec: the ratio (raw / stored), the stored share,
//! encode MB/s and decode GB/s of decoded output on one thread, and the exponents' entropy with
//! the ideal exponent coder's share. Every extent is decoded and compared with its bytes first.
//!
//!   codec-bench [--shape qwen3-30b-a3b] [--experts 8] [--level 3] [--fixture DIR]... [--json]
//!
//! Exit codes: 0 ok, 1 a round trip differed, 2 bad usage, 3 a source could not be read.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use serde_json::json;
use tarfa_codec_lab::{decode, encode, exponent_entropy, Codec};

#[derive(Parser)]
#[command(
    name = "codec-bench",
    about = "Issue 24 (research): lossless BF16 codecs on expert extents: ratio, decode GB/s, round trip",
    long_about = "Issue 24 (research). Compares zstd on the raw bytes, ZipNN-style byte planes and an exponent plane (sign and mantissa raw) on expert extents: the synthetic checkpoints' (the weights every benchmark streams) and any fixture's BF16 expert tensors. One extent per zstd frame; one thread; each extent's round trip checked before any figure.\nExit codes: 0 ok, 1 a round trip differed, 2 bad usage, 3 a source could not be read."
)]
struct Cli {
    /// A synthetic shape (tarfa-convert synth --list-shapes); "" for none.
    #[arg(long, default_value = "qwen3-30b-a3b")]
    shape: String,
    /// Experts of the shape's first MoE layer to sample (each: gate, up and down).
    #[arg(long, default_value_t = 8)]
    experts: u32,
    /// zstd level.
    #[arg(long, default_value_t = 3)]
    level: i32,
    /// Checkpoint directories whose BF16 tensors named `*experts*` are sampled too.
    #[arg(long)]
    fixture: Vec<PathBuf>,
    #[arg(long)]
    json: bool,
}

/// (source name, extents)
type Source = (String, Vec<Vec<u8>>);

fn synth_source(shape: &str, experts: u32) -> Result<Source, String> {
    let s = tarfa_convert::synth::shapes()
        .into_iter()
        .find(|s| s.name == shape)
        .ok_or_else(|| format!("--shape {shape}: no such synthetic shape"))?;
    let tensors = s.tensors().map_err(|e| format!("--shape {shape}: {e}"))?;
    let mut ext = Vec::new();
    for t in &tensors {
        // the first MoE layer's routed experts 0..experts (names as transformers writes them)
        let Some(rest) = t.name.split(".mlp.experts.").nth(1) else {
            continue;
        };
        let Some(e) = rest.split('.').next().and_then(|e| e.parse::<u32>().ok()) else {
            continue;
        };
        if e >= experts
            || !t
                .name
                .contains(&format!("layers.{}.", s.first_dense_layers()))
        {
            continue;
        }
        let mut b = vec![0u8; t.len_bytes() as usize];
        t.fill(0, 1.0, &mut b);
        ext.push(b);
    }
    if ext.is_empty() {
        return Err(format!("--shape {shape}: no expert tensors found"));
    }
    Ok((format!("synth {shape} (seed 0, skew 1)"), ext))
}

fn fixture_source(dir: &std::path::Path) -> Result<Source, String> {
    let mut ext = Vec::new();
    let rd = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut files: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension().is_some_and(|x| x == "safetensors")
                && !p
                    .file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("reference")
        })
        .collect();
    files.sort();
    for f in files {
        let bytes = std::fs::read(&f).map_err(|e| format!("{}: {e}", f.display()))?;
        let st = safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| format!("{}: {e}", f.display()))?;
        for (name, view) in st.tensors() {
            if name.contains("experts") && view.dtype() == safetensors::Dtype::BF16 {
                ext.push(view.data().to_vec());
            }
        }
    }
    if ext.is_empty() {
        return Err(format!("{}: no BF16 expert tensors", dir.display()));
    }
    Ok((format!("fixture {}", dir.display()), ext))
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    let mut sources = Vec::new();
    if !cli.shape.is_empty() {
        match synth_source(&cli.shape, cli.experts) {
            Ok(s) => sources.push(s),
            Err(e) => {
                eprintln!("codec-bench: error: {e}");
                return ExitCode::from(2);
            }
        }
    }
    for d in &cli.fixture {
        match fixture_source(d) {
            Ok(s) => sources.push(s),
            Err(e) => {
                eprintln!("codec-bench: error: {e}");
                return ExitCode::from(3);
            }
        }
    }
    let mut rows = Vec::new();
    let mut ok = true;
    for (name, ext) in &sources {
        let raw: usize = ext.iter().map(|e| e.len()).sum();
        // per extent (each is coded alone), weighted by its size
        let (mut h, mut ideal) = (0.0, 0.0);
        for e in ext {
            let (he, ie) = exponent_entropy(e);
            h += he * e.len() as f64 / raw as f64;
            ideal += ie * e.len() as f64 / raw as f64;
        }
        for codec in Codec::ALL {
            let t = Instant::now();
            let enc: Vec<Vec<u8>> = ext.iter().map(|e| encode(codec, e, cli.level)).collect();
            let enc_s = t.elapsed().as_secs_f64();
            let stored: usize = enc.iter().map(|e| e.len()).sum();
            // the round trip first, then the timed decodes (best of 3)
            for (e, x) in enc.iter().zip(ext) {
                if decode(codec, e, x.len() / 2).as_deref() != Ok(&x[..]) {
                    eprintln!("codec-bench: ROUND TRIP DIFFERS: {name}, {}", codec.name());
                    ok = false;
                }
            }
            let mut best = f64::MAX;
            for _ in 0..3 {
                let t = Instant::now();
                for (e, x) in enc.iter().zip(ext) {
                    std::hint::black_box(decode(codec, e, x.len() / 2).ok());
                }
                best = best.min(t.elapsed().as_secs_f64());
            }
            rows.push(json!({"source": name, "extents": ext.len(), "raw_bytes": raw, "codec": codec.name(),
                "stored_bytes": stored, "ratio": raw as f64 / stored as f64, "stored_share": stored as f64 / raw as f64,
                "encode_mb_s": raw as f64 / enc_s / 1e6, "decode_gb_s": raw as f64 / best / 1e9,
                "exponent_entropy_bits": h, "ideal_exponent_coder_share": ideal}));
        }
    }
    if cli.json {
        println!(
            "{}",
            json!({"command": "codec-bench", "level": cli.level, "rows": rows, "round_trips_ok": ok})
        );
    } else {
        println!(
            "codec-bench: zstd level {}, one extent per frame, one thread",
            cli.level
        );
        println!(
            "{:<44} {:<22} {:>7} {:>7} {:>10} {:>10}",
            "source", "codec", "ratio", "stored", "enc MB/s", "dec GB/s"
        );
        let mut last = String::new();
        for r in &rows {
            let s = r["source"].as_str().unwrap().to_string();
            if s != last {
                println!(
                    "{s}: {} extents, {} bytes; exponent entropy per extent {:.3} bits -> an ideal exponent coder {:.1}% ({:.3}x)",
                    r["extents"], r["raw_bytes"], r["exponent_entropy_bits"].as_f64().unwrap(),
                    100.0 * r["ideal_exponent_coder_share"].as_f64().unwrap(),
                    1.0 / r["ideal_exponent_coder_share"].as_f64().unwrap()
                );
                last = s;
            }
            println!(
                "{:<44} {:<22} {:>6.3}x {:>6.1}% {:>10.0} {:>10.2}",
                "",
                r["codec"].as_str().unwrap(),
                r["ratio"].as_f64().unwrap(),
                100.0 * r["stored_share"].as_f64().unwrap(),
                r["encode_mb_s"].as_f64().unwrap(),
                r["decode_gb_s"].as_f64().unwrap()
            );
        }
        println!(
            "round trips: {}",
            if ok {
                "every extent identical"
            } else {
                "DIFFERENCES (above)"
            }
        );
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
