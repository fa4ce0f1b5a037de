//! Which families the CUDA backend takes. Since issue 22 the kernels implement every family and
//! config feature the runtime reads (gpt-oss's sinks, windows, biased router and clamped SwiGLU;
//! Llama 4's input-scaling router, chunked and NoPE layers and L2 q/k norm; Mixtral's window;
//! OLMoE's clip_qkv), so `tarfa_cuda::unsupported_family` names nothing for any fixture's
//! config, and `--backend cuda` is never refused by family. (The refusal path, `--backend cuda`
//! exit 2 and `auto` taking the CPU, stays in `Model::load` for the next family the kernels lag
//! behind.) Issue 23's hybrids (Qwen3-Next, Qwen3.5 MoE, in the shared oracle) are taken too.
//! tarfa-cuda's mock tests compare each of these families with the CPU bit for bit.

use std::path::{Path, PathBuf};

use tarfa_core::config::MoeConfig;
use tarfa_core::model::ArchSpec;

fn configs_under(dir: &Path) -> Vec<(String, MoeConfig)> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries {
        let path = e.unwrap().path().join("config.json");
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        // the shared oracle holds families the runtime does not read yet (issue 23's)
        if let Ok(cfg) = MoeConfig::from_json_str(&text) {
            out.push((path.display().to_string(), cfg));
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[test]
fn cuda_takes_every_fixtures_family_and_config_feature() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut cfgs = configs_under(&root.join("fixtures/oracle"));
    cfgs.extend(configs_under(&root.join("../shared/oracle")));
    let names: Vec<&str> = cfgs.iter().map(|(p, _)| p.as_str()).collect();
    // the features that were refused before issue 22, each in a fixture of this repository
    for needed in ["olmoe-clip-s", "mixtral-window-s", "llama4-dense-s"] {
        assert!(
            names.iter().any(|n| n.contains(needed)),
            "{needed} missing: {names:?}"
        );
    }
    assert!(cfgs.iter().any(|(_, c)| c.clip_qkv.is_some()));
    for (path, cfg) in &cfgs {
        let spec = ArchSpec::new(cfg);
        assert_eq!(tarfa_cuda::unsupported_family(cfg, &spec), None, "{path}");
    }
}

/// gpt-oss's and Llama 4's configs as the released models write them (MXFP4, windows, chunks,
/// NoPE layers), checked here without the shared oracle.
#[test]
fn cuda_takes_gpt_oss_and_llama4() {
    for json in [
        r#"{"model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": 4,
            "num_experts_per_tok": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 64,
            "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4,
            "rope_parameters": {"rope_theta": 150000.0, "rope_type": "default"},
            "quantization_config": {"quant_method": "mxfp4"}}"#,
        r#"{"model_type": "llama4_text", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 16, "intermediate_size_mlp": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "num_local_experts": 4, "num_experts_per_tok": 1, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 64, "attention_chunk_size": 8,
            "no_rope_layers": [1, 0], "rope_parameters": {"rope_theta": 500000.0}}"#,
    ] {
        let cfg = MoeConfig::from_json_str(json).unwrap();
        let spec = ArchSpec::new(&cfg);
        assert_eq!(
            tarfa_cuda::unsupported_family(&cfg, &spec),
            None,
            "{}",
            cfg.family.model_type
        );
    }
}
