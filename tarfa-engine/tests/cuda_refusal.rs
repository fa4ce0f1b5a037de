//! A config the CUDA kernels do not implement (OLMoE's clip_qkv) is never computed on CUDA: `--backend cuda` is refused by name before any
//! weight is read (exit 2), and `--backend auto` says why and takes the CPU. Weightless: the
//! choice is made from the config alone, so an empty source shows which backend was taken
//! (the CPU's loader then names the first missing tensor).

use std::sync::{Arc, Mutex};

use tarfa_core::config::MoeConfig;
use tarfa_core::numerics::Kernel;
use tarfa_core::weights::InMemorySource;
use tarfa_engine::{BackendChoice, Engine, EngineError, LoadOptions};

fn clipped_config() -> MoeConfig {
    MoeConfig::from_json_str(
        r#"{"model_type": "olmoe", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 4, "num_experts": 4,
            "num_experts_per_tok": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 64,
            "rope_theta": 10000.0, "clip_qkv": 8.0}"#,
    )
    .unwrap()
}

fn load(backend: BackendChoice, log: &dyn Fn(String)) -> Result<Engine, EngineError> {
    let opts = LoadOptions {
        backend,
        threads: 1,
        kernel: Kernel::best(),
        hot: None,
        cuda: Default::default(),
    };
    Engine::load(
        clipped_config(),
        Arc::new(InMemorySource::new()),
        &opts,
        log,
    )
}

#[test]
fn cuda_refuses_a_family_its_kernels_do_not_implement_by_name() {
    let err = load(BackendChoice::Cuda, &|_| {}).err().expect("refused");
    let msg = err.to_string();
    assert!(
        msg.contains("olmoe") && msg.contains("--backend cpu"),
        "{msg}"
    );
    assert!(msg.contains("clip_qkv"), "{msg}");
    let EngineError::Cuda(cuda) = &err else {
        panic!("not a CUDA refusal: {err}")
    };
    assert_eq!(cuda.exit_code(), tarfa_core::exit::BAD_INPUT);
}

#[test]
fn auto_takes_the_cpu_for_such_a_family_and_says_why() {
    let lines = Mutex::new(Vec::new());
    let err = load(BackendChoice::Auto, &|l| lines.lock().unwrap().push(l))
        .err()
        .expect("the empty source has no weights");
    let lines = lines.into_inner().unwrap();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("olmoe") && l.contains("using the CPU")),
        "{lines:?}"
    );
    // The CPU's loader, not CUDA, failed: it names the first tensor it needed.
    assert!(matches!(err, EngineError::Run(_)), "{err}");
    assert!(err.to_string().contains("embed_tokens"), "{err}");
}

/// gpt-oss (issue 22) is no longer refused: the CUDA kernels implement its sinks, windows,
/// biased router, expert biases and clamped SwiGLU, and its fused / MXFP4 experts reach the GPU
/// widened per expert (tarfa-cuda's mock tests compare it with the CPU bit for bit).
#[test]
fn cuda_takes_gpt_oss() {
    let cfg = MoeConfig::from_json_str(
        r#"{"model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": 4,
            "num_experts_per_tok": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 64,
            "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4,
            "rope_parameters": {"rope_theta": 150000.0, "rope_type": "default"},
            "quantization_config": {"quant_method": "mxfp4"}}"#,
    )
    .unwrap();
    let spec = tarfa_core::model::ArchSpec::new(&cfg);
    assert_eq!(tarfa_cuda::unsupported_family(&cfg, &spec), None);
}

/// Llama 4 (issue 22): every feature the CUDA kernels lack is named, and `auto` takes the CPU.
#[test]
fn cuda_refuses_llama4_naming_each_missing_feature_and_auto_takes_the_cpu() {
    let cfg = MoeConfig::from_json_str(
        r#"{"model_type": "llama4_text", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 16, "intermediate_size_mlp": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "num_local_experts": 4, "num_experts_per_tok": 1, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 64, "attention_chunk_size": 8,
            "no_rope_layers": [1, 0], "rope_parameters": {"rope_theta": 500000.0}}"#,
    )
    .unwrap();
    let opts = |backend| LoadOptions {
        backend,
        threads: 1,
        kernel: Kernel::best(),
        hot: None,
        cuda: Default::default(),
    };
    let err = Engine::load(
        cfg.clone(),
        Arc::new(InMemorySource::new()),
        &opts(BackendChoice::Cuda),
        &|_| {},
    )
    .err()
    .expect("refused");
    let msg = err.to_string();
    for what in [
        "llama4_text",
        "scales the experts' input",
        "chunked attention",
        "NoPE layers",
        "q/k L2 norm",
        "--backend cpu",
    ] {
        assert!(msg.contains(what), "{what}: {msg}");
    }
    let lines = Mutex::new(Vec::new());
    let err = Engine::load(
        cfg,
        Arc::new(InMemorySource::new()),
        &opts(BackendChoice::Auto),
        &|l| lines.lock().unwrap().push(l),
    )
    .err()
    .expect("the empty source has no weights");
    assert!(
        matches!(err, EngineError::Run(_)),
        "the CPU's loader: {err}"
    );
    assert!(lines
        .into_inner()
        .unwrap()
        .iter()
        .any(|l| l.contains("llama4_text") && l.contains("using the CPU")));
}
