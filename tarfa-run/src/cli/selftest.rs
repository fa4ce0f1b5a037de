//! `tarfa-run selftest --backend cuda <BUNDLE>...`: runs the CPU reference and the CUDA backend on
//! the same verified bundle and prompts and compares every logit (prefill and decode), router
//! record and statistic bit for bit. The GPU checks live in the binary itself because the GPU
//! machine has no Rust toolchain.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use crate::bundle::BundleSource;
use crate::config::MoeConfig;
use crate::cuda::{self, CudaOptions, SelftestOptions};
use crate::weights::WeightSource;
use clap::Args;
use serde_json::json;

use super::generate::BackendArg;
use super::output::OutputRules;
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
    /// CPU threads for the reference: 1 to 1024, or 0 for one per core (the default).
    #[arg(long, value_parser = super::threads_arg)]
    pub threads: Option<usize>,
    /// Write the results as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Also stream the experts: for each bundle, after the resident check, compare the CPU
    /// reference with CUDA models whose experts go through GPU and RAM tiers of every budget
    /// (everything, a quarter, one expert), with both I/O modes and every cache policy.
    #[arg(long)]
    pub stream_sweep: bool,
    /// Skip the resident check (with --stream-sweep: only the streamed cases).
    #[arg(long, requires = "stream_sweep")]
    pub no_resident: bool,
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
    let bundles: Vec<&std::path::Path> = a.bundles.iter().map(|b| b.as_path()).collect();
    let rules = OutputRules::new(&bundles);
    if let Some(p) = &a.json {
        rules.check(p, "--json")?;
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
        let cfg = MoeConfig::from_json_str(&cfg_text).map_err(crate::RunError::from)?;
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
        if !a.no_resident {
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
                "mode": "resident",
                "passed": passed,
                "bytes_compared": report.bytes_compared(),
                "report": report.to_string(),
            }));
        }
        if a.stream_sweep {
            let t = Instant::now();
            let spec = crate::model::ArchSpec::new(&cfg);
            let moe_layers = (0..cfg.num_layers)
                .filter(|&l| spec.moe_index(l).is_some())
                .count() as u64;
            // one expert of the RAM tier under either I/O mode (an MXFP4 expert is charged its
            // widened matrices too, so its extent's length would be too small a budget)
            let mut extent = 0;
            for io in [crate::stream::IoMode::Cached, crate::stream::IoMode::Direct] {
                extent = extent.max(crate::stream::ExpertStore::min_ram_budget(&source, io)?);
            }
            let cases = cuda::stream_sweep(
                moe_layers * cfg.num_experts as u64,
                cuda::min_vram_budget(&cfg),
                extent,
            );
            let got = cuda::selftest_streaming(
                &cfg,
                source.clone(),
                &opts,
                &CudaOptions::default(),
                &cases,
            )?;
            for (case, (report, hot, warm)) in cases.iter().zip(got) {
                let passed = report.passed();
                all_passed &= passed;
                println!(
                    "{} {} streamed ({case}): {report}; hot hits {}/{}, {} uploads, warm hits {}/{}, {} read",
                    if passed { "PASS" } else { "FAIL" },
                    b.display(),
                    hot.hits,
                    hot.requests,
                    hot.uploads,
                    warm.warm_hits,
                    warm.requests,
                    crate::stream::format_bytes(warm.bytes_read),
                );
                results.push(json!({
                    "bundle": b,
                    "root_digest": source.root_digest(),
                    "mode": "streamed",
                    "case": case.to_string(),
                    "passed": passed,
                    "bytes_compared": report.bytes_compared(),
                    "report": report.to_string(),
                    "hot": hot,
                    "warm": warm,
                }));
            }
            eprintln!(
                "{}: streamed sweep of {} cases in {:.1} s",
                b.display(),
                cases.len(),
                t.elapsed().as_secs_f64()
            );
        }
    }
    if let Some(p) = &a.json {
        rules.write_json(
            p,
            "--json",
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
