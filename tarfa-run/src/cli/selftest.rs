//! `tarfa-run selftest --backend cuda <BUNDLE>...`: runs the CPU reference and the CUDA backend on
//! the same verified bundle and prompts and compares every logit (prefill and decode), router
//! record and statistic bit for bit. The GPU checks live in the binary itself because the GPU
//! machine has no Rust toolchain.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use clap::Args;
use serde_json::json;
use tarfa_run::bundle::BundleSource;
use tarfa_run::config::MoeConfig;
use tarfa_run::cuda::{self, CudaOptions, SelftestOptions};
use tarfa_run::weights::WeightSource;

use super::generate::BackendArg;
use super::output::write_json;
use super::CliError;

#[derive(Args, Debug, Clone)]
pub struct SelftestArgs {
    /// The backend to check against the CPU reference (only cuda).
    #[arg(long, value_enum, default_value_t = BackendArg::Cuda)]
    pub backend: BackendArg,
    /// Bundles to check.
    #[arg(required = true)]
    pub bundles: Vec<PathBuf>,
    /// Prompt lengths (seeded random token ids), each prefilled then decoded.
    #[arg(long, value_delimiter = ',', default_value = "1,7,33,100")]
    pub prompt_lengths: Vec<usize>,
    /// Greedy decode steps after each prefill.
    #[arg(long, default_value_t = 8)]
    pub decode_steps: usize,
    /// CPU threads for the reference (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Write the results as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Seeded token ids (SplitMix64), so that every run of the selftest checks the same prompts.
fn prompt(len: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut z = seed;
    (0..len)
        .map(|_| {
            z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((x ^ (x >> 31)) % vocab as u64) as u32
        })
        .collect()
}

pub fn run(a: &SelftestArgs) -> Result<(), CliError> {
    if a.backend != BackendArg::Cuda {
        return Err(CliError::Usage(
            "selftest compares a backend with the CPU reference: use --backend cuda".into(),
        ));
    }
    let info = cuda::probe(0)?;
    eprintln!("{info}");
    let mut results = Vec::new();
    let mut all_passed = true;
    for b in &a.bundles {
        let t = Instant::now();
        let source = Arc::new(BundleSource::open(b, None)?);
        let cfg_text = String::from_utf8(source.read_file("config.json")?)
            .map_err(|_| CliError::Usage(format!("{}: config.json is not UTF-8", b.display())))?;
        let cfg = MoeConfig::from_json_str(&cfg_text).map_err(tarfa_run::RunError::from)?;
        let max = cfg
            .max_position_embeddings
            .saturating_sub(a.decode_steps + 1)
            .max(1);
        let prompts: Vec<Vec<u32>> = a
            .prompt_lengths
            .iter()
            .enumerate()
            .map(|(i, &n)| prompt(n.clamp(1, max), cfg.vocab_size, 1000 + i as u64))
            .collect();
        let opts = SelftestOptions {
            prompts,
            decode_steps: a.decode_steps,
            cpu_threads: a.threads.unwrap_or(0),
        };
        let report = cuda::selftest(
            &cfg,
            source.clone() as Arc<dyn WeightSource>,
            &opts,
            &CudaOptions::default(),
        )?;
        let passed = report.passed();
        all_passed &= passed;
        println!(
            "{} {}: {} ({:.1} s)",
            if passed { "PASS" } else { "FAIL" },
            b.display(),
            report,
            t.elapsed().as_secs_f64()
        );
        results.push(json!({
            "bundle": b,
            "root_digest": source.root_digest(),
            "passed": passed,
            "bytes_compared": report.bytes_compared(),
            "report": report.to_string(),
        }));
    }
    if let Some(p) = &a.json {
        write_json(
            p,
            &json!({"device": info.to_string(), "results": results, "passed": all_passed}),
        )?;
    }
    if all_passed {
        Ok(())
    } else {
        Err(CliError::Mismatch(
            "the CUDA backend's bits differ from the CPU reference".into(),
        ))
    }
}
