//! mma-oracle: EXPERIMENTAL, issue 25. Runs oracle fixtures (a checkpoint directory with
//! transformers' float32 reference.safetensors) on the CPU backend's scalar kernel with every
//! BF16 matrix-vector product replaced by the candidate contract-v2 dot (tarfa-mma's model:
//! Hopper MMA semantics, 3-way BF16 split of the f32 activation, 16-chunks in increasing k).
//! `--baseline` runs today's contract instead (nothing replaced), for comparison. Prints, per
//! fixture, whether the greedy tokens equal transformers' and the worst relative error
//! (max |logit - ref| / max |ref| per row, over every step and prefill row), as the oracle
//! tests (tarfa-run/tests/common) measure it. Still f32 FMA, as today: attention's dots, norms,
//! f32 weight matrices and MXFP4 experts.
//!
//!   mma-oracle [--baseline | --measured] [--threads N] DIR...
//! Exit: 0 all tokens equal and every error <= 1e-4; 1 otherwise; 2 usage; 3 a fixture failed
//! to load or run.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use clap::Parser;
use safetensors::{Dtype, SafeTensors};
use tarfa_core::config::MoeConfig;
use tarfa_core::generate::greedy;
use tarfa_core::model::ArchSpec;
use tarfa_core::numerics::reduce::experimental;
use tarfa_core::numerics::Kernel;
use tarfa_core::weights::load_safetensors_dir;
use tarfa_cpu::{CpuEngine, CpuModel, EngineOptions, ForwardOptions, LogitRows};
use tarfa_mma::model::{dot_v2, Params};

#[derive(Parser)]
#[command(
    name = "mma-oracle",
    about = "EXPERIMENTAL (issue 25): oracle fixtures with every BF16 matrix-vector product under the candidate contract v2 (tensor-core semantics); --baseline for today's contract"
)]
struct Cli {
    /// Today's contract (no replacement), for comparison.
    #[arg(long)]
    baseline: bool,
    /// The candidate under the model the H200 measured (Params::HOPPER_MEASURED) instead of
    /// MMA-Sim's hypothesis.
    #[arg(long, conflicts_with = "baseline")]
    measured: bool,
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Fixture directories.
    #[arg(required = true)]
    dirs: Vec<PathBuf>,
}

static CALLS: AtomicU64 = AtomicU64::new(0);

fn candidate(w: &[u16], x: &[f32]) -> f32 {
    CALLS.fetch_add(1, Ordering::Relaxed);
    dot_v2(w, x, &Params::HOPPER)
}

fn candidate_measured(w: &[u16], x: &[f32]) -> f32 {
    CALLS.fetch_add(1, Ordering::Relaxed);
    dot_v2(w, x, &Params::HOPPER_MEASURED)
}

fn tensor<'a>(st: &'a SafeTensors, name: &str) -> Option<safetensors::tensor::TensorView<'a>> {
    st.tensor(name).ok()
}

fn i64s(st: &SafeTensors, name: &str) -> Vec<u32> {
    let v = tensor(st, name).unwrap();
    assert_eq!(v.dtype(), Dtype::I64);
    v.data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect()
}

fn rows(st: &SafeTensors, name: &str) -> Vec<Vec<f32>> {
    let v = tensor(st, name).unwrap();
    let cols = v.shape()[1];
    let flat: Vec<f32> = v
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    flat.chunks_exact(cols).map(|r| r.to_vec()).collect()
}

fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    let scale = want.iter().fold(0f64, |m, &w| m.max((w as f64).abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0f64, |m, (&g, &w)| m.max((g as f64 - w as f64).abs()));
    err / scale
}

/// Tokens equal, prompts, worst rel err, first differing (prompt, step).
type Outcome = (bool, usize, f64, Option<(usize, usize)>);

fn run(dir: &Path, threads: usize) -> Result<Outcome, String> {
    let cfg = MoeConfig::from_json_str(
        &std::fs::read_to_string(dir.join("config.json")).map_err(|e| e.to_string())?,
    )
    .map_err(|e| format!("{e}"))?;
    let spec = ArchSpec::new(&cfg);
    let source = Arc::new(load_safetensors_dir(dir, &cfg, &spec).map_err(|e| format!("{e}"))?);
    let model = Arc::new(CpuModel::load(cfg, source).map_err(|e| format!("{e}"))?);
    let eng = CpuEngine::new(
        model.clone(),
        EngineOptions {
            threads,
            kernel: Kernel::scalar(),
        },
    )
    .map_err(|e| format!("{e}"))?;
    let bytes = std::fs::read(dir.join("reference.safetensors")).map_err(|e| e.to_string())?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| e.to_string())?;
    let names: HashSet<String> = st.names().into_iter().map(|s| s.to_string()).collect();
    let (mut same, mut worst, mut first) = (true, 0f64, None);
    let mut n = 0;
    while names.contains(&format!("prompt.{n}")) {
        let prompt = i64s(&st, &format!("prompt.{n}"));
        let want = i64s(&st, &format!("greedy.{n}"));
        let mut cache = model.new_cache();
        let opts = ForwardOptions {
            logits: LogitRows::All,
            ..Default::default()
        };
        let g = greedy(&eng, &mut cache, &prompt, want.len(), &opts).map_err(|e| format!("{e}"))?;
        if g.tokens != want {
            same = false;
            let j = g
                .tokens
                .iter()
                .zip(&want)
                .position(|(a, b)| a != b)
                .unwrap_or(g.tokens.len().min(want.len()));
            first.get_or_insert((n, j));
        }
        // rows compared while the tokens agree (after a divergence the contexts differ)
        let agree = g
            .tokens
            .iter()
            .zip(&want)
            .take_while(|(a, b)| a == b)
            .count();
        for (got, w) in g
            .step_logits
            .iter()
            .zip(rows(&st, &format!("step_logits.{n}")))
            .take(agree + 1)
        {
            worst = worst.max(rel_err(got, &w));
        }
        let pre = rows(&st, &format!("prefill_logits.{n}"));
        let skip = g.prefill.logits.len() - pre.len();
        for (got, w) in g.prefill.logits[skip..].iter().zip(&pre) {
            worst = worst.max(rel_err(got, w));
        }
        n += 1;
    }
    Ok((same, n, worst, first))
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    if !cli.baseline {
        assert!(experimental::replace_scalar_bf16_dot_for_experiment(
            if cli.measured {
                candidate_measured
            } else {
                candidate
            }
        ));
    }
    let arm = if cli.baseline {
        "baseline (contract v1, scalar)"
    } else if cli.measured {
        "CANDIDATE contract v2 (the H200's measured model)"
    } else {
        "CANDIDATE contract v2 (tensor-core model)"
    };
    println!(
        "{:<28} {:<6} {:>7} {:>12}  {}",
        "fixture", "tokens", "prompts", "max rel err", arm
    );
    let mut ok = true;
    for d in &cli.dirs {
        let name = d
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let t = std::time::Instant::now();
        match std::panic::catch_unwind(|| run(d, cli.threads)) {
            Ok(Ok((same, n, worst, first))) => {
                ok &= same && worst <= 1e-4;
                let f = first
                    .map(|(p, j)| format!(" (first diff: prompt {p} token {j})"))
                    .unwrap_or_default();
                println!(
                    "{name:<28} {:<6} {n:>7} {worst:>12.3e}  {:.1} s{f}",
                    if same { "equal" } else { "DIFFER" },
                    t.elapsed().as_secs_f64()
                );
            }
            Ok(Err(e)) => {
                println!("{name:<28} ERROR  {e}");
                return ExitCode::from(3);
            }
            Err(_) => {
                println!("{name:<28} ERROR  panicked");
                return ExitCode::from(3);
            }
        }
    }
    println!("candidate dot calls: {}", CALLS.load(Ordering::Relaxed));
    ExitCode::from(if ok { 0 } else { 1 })
}
