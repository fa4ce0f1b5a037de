//! The CUDA backend from the outside. Without a GPU (CI): a missing driver is a clear error,
//! never a panic, and the random models the GPU comparisons use are valid for every family.
//! With a GPU (`cargo test -- --ignored`): every kernel and every fixture bit-identical to the
//! CPU backend.

use std::path::PathBuf;
use std::sync::Arc;

use tarfa_run::config::MoeConfig;
use tarfa_run::cpu::{CpuEngine, CpuModel, EngineOptions, ForwardOptions, LogitRows};
use tarfa_run::cuda::synthetic::{random_model, SyntheticShape};
use tarfa_run::cuda::{CudaError, CudaModel, CudaOptions, SelftestOptions};
use tarfa_run::model::ArchSpec;
use tarfa_run::numerics::Kernel;
use tarfa_run::weights::load_safetensors_dir;

const FAMILIES: &[&str] = &["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"];

fn gpu_present() -> bool {
    tarfa_run::cuda::probe(0).is_ok()
}

#[test]
fn without_a_gpu_the_backend_is_a_clear_environment_error() {
    if gpu_present() {
        eprintln!("a GPU is present: nothing to check here");
        return;
    }
    let err = tarfa_run::cuda::probe(0).unwrap_err();
    assert!(err.is_environment(), "{err}");
    assert!(
        matches!(
            err,
            CudaError::NoDriver | CudaError::NoNvrtc | CudaError::NoDevice | CudaError::NotCompiled
        ),
        "{err:?}"
    );
    let (cfg, src) = random_model(&SyntheticShape::small("qwen3_moe"), 1);
    let err = match CudaModel::load(cfg, Arc::new(src), &CudaOptions::default()) {
        Ok(_) => panic!("a CUDA model loaded without a GPU"),
        Err(e) => e,
    };
    assert!(err.is_environment(), "{err}");
    assert!(!err.to_string().is_empty());
}

#[test]
fn random_models_of_every_family_run_on_the_cpu() {
    for family in FAMILIES {
        let shape = SyntheticShape::small(family);
        let (cfg, src) = random_model(&shape, 3);
        let spec = ArchSpec::new(&cfg);
        assert_eq!(cfg.family.model_type, *family);
        let model = Arc::new(CpuModel::load(cfg.clone(), Arc::new(src)).unwrap());
        let engine = CpuEngine::new(
            model.clone(),
            EngineOptions {
                threads: 2,
                kernel: Kernel::best(),
            },
        )
        .unwrap();
        let mut cache = model.new_cache();
        let prompt: Vec<u32> = (0..9).map(|i| (i * 37 % cfg.vocab_size) as u32).collect();
        let out = engine
            .forward(
                &mut cache,
                &prompt,
                &ForwardOptions {
                    logits: LogitRows::All,
                    trace_router: true,
                    ..Default::default()
                },
            )
            .unwrap();
        assert_eq!(out.logits.len(), prompt.len());
        assert!(
            out.logits.iter().flatten().all(|v| v.is_finite()),
            "{family}"
        );
        // the logits must not be degenerate: the comparison needs varied values
        let row = &out.logits[8];
        let distinct: std::collections::BTreeSet<u32> = row.iter().map(|v| v.to_bits()).collect();
        assert!(
            distinct.len() > row.len() / 2,
            "{family}: degenerate logits"
        );
        let moe_layers = spec
            .layers
            .iter()
            .filter(|k| **k == tarfa_run::model::MlpKind::Moe)
            .count();
        assert_eq!(out.router.len(), moe_layers * prompt.len(), "{family}");
        assert!(moe_layers > 0, "{family}");
        if *family == "qwen3_moe" || *family == "qwen2_moe" {
            assert!(
                moe_layers < cfg.num_layers,
                "{family}: no dense layer exercised"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// With a GPU.

fn fixture_dir(name: &str) -> PathBuf {
    let base = std::env::var("TARFA_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/oracle"));
    base.join(name)
}

fn prompts_of(dir: &std::path::Path) -> Vec<Vec<u32>> {
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out = Vec::new();
    for i in 0.. {
        let Ok(v) = st.tensor(&format!("prompt.{i}")) else {
            break;
        };
        out.push(
            v.data()
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
                .collect(),
        );
    }
    out
}

fn fixture_selftest(name: &str) {
    let dir = fixture_dir(name);
    if !dir.is_dir() {
        eprintln!("fixture {name} absent: skipped");
        return;
    }
    let cfg = MoeConfig::from_json_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
        .unwrap();
    let spec = ArchSpec::new(&cfg);
    let src = Arc::new(load_safetensors_dir(&dir, &cfg, &spec).unwrap());
    let opts = SelftestOptions {
        prompts: prompts_of(&dir),
        decode_steps: 8,
        cpu_threads: 0,
    };
    let rep = tarfa_run::cuda::selftest(&cfg, src, &opts, &CudaOptions::default()).unwrap();
    eprintln!("{name}: {rep}");
    assert!(rep.passed(), "{name}: {rep}");
}

#[test]
#[ignore = "needs a GPU"]
fn every_kernel_matches_the_cpu_reference() {
    let checks = tarfa_run::cuda::kernel_checks(&CudaOptions::default()).unwrap();
    for c in &checks {
        eprintln!("{c}");
    }
    assert!(checks.iter().all(|c| c.mismatches == 0 && c.compared > 0));
}

#[test]
#[ignore = "needs a GPU"]
fn qwen3moe_a_is_bit_identical_on_the_gpu() {
    fixture_selftest("qwen3moe-a");
}

#[test]
#[ignore = "needs a GPU"]
fn qwen3moe_code_is_bit_identical_on_the_gpu() {
    fixture_selftest("qwen3moe-code");
}

#[test]
#[ignore = "needs a GPU"]
fn qwen3moe_dense_is_bit_identical_on_the_gpu() {
    fixture_selftest("qwen3moe-dense");
}

#[test]
#[ignore = "needs a GPU"]
fn qwen3moe_odd_is_bit_identical_on_the_gpu() {
    fixture_selftest("qwen3moe-odd");
}

#[test]
#[ignore = "needs a GPU"]
fn random_models_of_every_family_are_bit_identical_on_the_gpu() {
    for family in FAMILIES {
        let (cfg, src) = random_model(&SyntheticShape::small(family), 5);
        let opts = SelftestOptions {
            prompts: vec![
                vec![1],
                (0..40).map(|i| (i * 13 % cfg.vocab_size) as u32).collect(),
            ],
            decode_steps: 5,
            cpu_threads: 0,
        };
        let rep =
            tarfa_run::cuda::selftest(&cfg, Arc::new(src), &opts, &CudaOptions::default()).unwrap();
        eprintln!("{family}: {rep}");
        assert!(rep.passed(), "{family}: {rep}");
    }
}
