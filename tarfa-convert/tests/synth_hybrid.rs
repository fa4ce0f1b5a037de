//! The Qwen3.5 MoE synthetic shapes: qwen3.5-35b-a3b's size worked out here by hand from the
//! published text config, its config as the runtime reads it, and the tiny twin written as a Hub
//! checkpoint, converted by the `tarfa-convert` binary, proven by `tarfa-verify check
//! --source`, written directly as a bundle with the same bytes, its gated DeltaNet parameters
//! in the ranges a stable forward needs, and run on the CPU runtime.

use std::path::Path;
use std::sync::Arc;

use tarfa_convert::synth::{self, SynthShape};
use tarfa_core::generate::greedy;
use tarfa_core::weights::WeightSource;
use tarfa_cpu::{CpuEngine, CpuModel, EngineOptions, ForwardOptions, LogitRows};
use tarfa_manifest::Manifest;
use tarfa_stream::bundle::BundleSource;
use tarfa_verify::{check_bundle, CheckOptions};

mod common;
use common::run;

fn shape(name: &str) -> SynthShape {
    synth::shapes()
        .into_iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("shape {name}"))
}

/// Qwen3.5-35B-A3B's text model, tensor by tensor (transformers' Qwen3_5MoeForCausalLM):
/// (tensors, parameters, parameters one token reads besides the embedding row).
fn qwen35_size(layers: u64) -> (u64, u64, u64) {
    let (h, v, e, i, s) = (2048u64, 248_320u64, 256u64, 512u64, 512u64);
    // gated DeltaNet: 16 key heads, 32 value heads, all 128 wide, kernel 4
    let (kw, vw, hv) = (16 * 128u64, 32 * 128u64, 32u64);
    let linear = (2 * kw + vw) * h // in_proj_qkv
        + vw * h // in_proj_z
        + 2 * hv * h // in_proj_b, in_proj_a
        + (2 * kw + vw) * 4 // conv1d [C, 1, 4]
        + 2 * hv // A_log, dt_bias
        + 128 // the gated norm [Dv]
        + h * vw; // out_proj
                  // gated attention: 16 query heads (q_proj doubled for the output gate), 2 KV heads of 256
    let (q, kv) = (16 * 256u64, 2 * 256u64);
    let full = 2 * q * h + 2 * kv * h + h * q + 2 * 256;
    let shared = 3 * s * h + h; // the shared expert and its sigmoid gate [1, H]
    let moe = e * h + e * 3 * i * h + shared;
    let full_layers = layers / 4; // layers 3, 7, ...
    let linear_layers = layers - full_layers;
    let per_layer_norms = 2 * h;
    let params = linear_layers * linear
        + full_layers * full
        + layers * (per_layer_norms + moe)
        + 2 * v * h // embed_tokens, lm_head (untied)
        + h; // the final norm
    let active = params - layers * (e - 8) * 3 * i * h - v * h;
    let tensors = linear_layers * 9 + full_layers * 6 + layers * (2 + 1 + 4 + 3 * e) + 3;
    (tensors, params, active)
}

#[test]
fn qwen3_5_35b_a3b_has_its_published_size() {
    let s = shape("qwen3.5-35b-a3b");
    let (tensors, params, active) = qwen35_size(40);
    assert_eq!(
        s.checked_size(),
        Some((tensors, 2 * params)),
        "checked_size"
    );
    assert_eq!(s.tensors().unwrap().len() as u64, tensors);
    assert_eq!(s.total_bytes().unwrap(), 2 * params);
    assert_eq!(tensors, 31_333);
    // 34.66 B parameters in the text model (the release adds its vision tower and MTP module),
    // and "A3B": 2.95 B read per token (the top-8 experts, the shared expert, attention, the
    // lm_head; the embedding is a row lookup).
    assert_eq!(params, 34_660_610_688);
    assert!((active as f64 - 3.0e9).abs() < 0.1e9, "{active} active");
    // Cut to 4 layers for a GPU run: three linear layers and one full.
    let mut four = s.clone();
    four.layers = 4;
    let (t4, p4, _) = qwen35_size(4);
    assert_eq!(four.checked_size(), Some((t4, 2 * p4)));
    let types = four.config_json()["layer_types"].clone();
    assert_eq!(
        types,
        serde_json::json!([
            "linear_attention",
            "linear_attention",
            "linear_attention",
            "full_attention"
        ])
    );
}

/// The released text config's values, as the runtime reads them.
#[test]
fn qwen3_5_35b_a3b_config_parses_to_its_values() {
    let s = shape("qwen3.5-35b-a3b");
    let c = s.runtime_config().unwrap();
    assert_eq!(c.family.model_type, "qwen3_5_moe_text");
    assert_eq!(
        (c.hidden_size, c.num_layers, c.num_experts, c.top_k),
        (2048, 40, 256, 8)
    );
    assert_eq!((c.expert_width, c.shared_expert_width), (512, Some(512)));
    assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (16, 2, 256));
    assert_eq!(c.rotary_dim, 64, "a quarter of 256");
    assert_eq!(
        (c.vocab_size, c.max_position_embeddings),
        (248_320, 262_144)
    );
    assert_eq!((c.rope_theta, c.rms_norm_eps), (1e7, 1e-6));
    assert!(!c.tie_word_embeddings && c.renormalize_topk);
    let d = c.linear.unwrap();
    assert_eq!(
        (
            d.key_heads,
            d.value_heads,
            d.key_dim,
            d.value_dim,
            d.conv_kernel
        ),
        (16, 32, 128, 128, 4)
    );
    let linear: Vec<usize> = (0..40).filter(|&l| c.layer_linear[l]).collect();
    assert_eq!(linear.len(), 30);
    assert!((0..40).all(|l| c.layer_linear[l] == ((l + 1) % 4 != 0)));
    let cfg = s.config_json();
    assert_eq!(
        cfg["rope_parameters"]["mrope_section"],
        serde_json::json!([11, 11, 10])
    );
    assert_eq!(cfg["rope_parameters"]["mrope_interleaved"], true);
    for absent in ["intermediate_size", "rope_theta", "norm_topk_prob"] {
        assert!(
            cfg.get(absent).is_none(),
            "Qwen3_5MoeTextConfig has no {absent}"
        );
    }
}

/// (name, sha256) of every tensor and expert in a bundle's manifest.
fn hashes(dir: &Path) -> Vec<(String, String)> {
    let m = Manifest::load(&dir.join("manifest.toml")).unwrap();
    let mut v: Vec<(String, String)> = m
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.sha256.clone()))
        .chain(m.experts.iter().map(|e| (e.name.clone(), e.sha256.clone())))
        .collect();
    v.sort();
    v
}

/// A BF16 tensor of a Hub checkpoint's shards, as f32 values.
fn hub_tensor(dir: &Path, name: &str) -> Vec<f32> {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.path().extension().is_some_and(|x| x == "safetensors") {
            let b = std::fs::read(e.path()).unwrap();
            let st = safetensors::SafeTensors::deserialize(&b).unwrap();
            if let Ok(t) = st.tensor(name) {
                return t
                    .data()
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect();
            }
        }
    }
    panic!("no tensor {name}")
}

#[test]
fn tiny_qwen3_5_converts_verifies_and_runs_on_the_cpu() {
    let name = "tiny-qwen3.5-moe";
    let d = tempfile::tempdir().unwrap();
    let (hub, conv, direct) = (
        d.path().join("hub"),
        d.path().join("conv"),
        d.path().join("direct"),
    );
    let synth_args = ["synth", "--shape", name, "--seed", "3", "--skew", "1"];
    let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = synth_args.iter().map(|a| a as _).collect();
    args.push(&hub);
    let (code, _, err) = run(&args);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = run(&[&hub, &conv]);
    assert_eq!(code, 0, "the converter: {err}");
    let opts = CheckOptions {
        source: Some(hub.clone()),
        progress: false,
    };
    let report = check_bundle(&conv, &opts).unwrap();
    assert!(report.ok, "check --source: {:?}", report.failures);
    let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> = synth_args.iter().map(|a| a as _).collect();
    let more: [&dyn AsRef<std::ffi::OsStr>; 3] = [&"--format", &"bundle", &direct];
    args.extend(more);
    let (code, _, err) = run(&args);
    assert_eq!(code, 0, "{err}");
    let (a, b) = (hashes(&conv), hashes(&direct));
    assert_eq!(
        a, b,
        "the bundle written directly holds the converted one's bytes"
    );
    assert!(a
        .iter()
        .any(|(n, _)| n == "model.layers.0.linear_attn.A_log"));
    assert!(a.iter().any(|(n, _)| n == "model.layers.3.mlp.experts.7"));

    // The values a stable forward needs, as generated: A = exp(A_log) in [0.01, 16), dt_bias
    // near one, the gated norm near one, the zero-centred norms near zero (they scale by 1 + w).
    let range = |v: &[f32]| {
        v.iter()
            .fold((f32::MAX, f32::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)))
    };
    let a_log: Vec<f32> = (0..3)
        .flat_map(|l| hub_tensor(&hub, &format!("model.layers.{l}.linear_attn.A_log")))
        .collect();
    let (lo, hi) = range(&a_log);
    assert!(
        lo >= 0.01f32.ln() - 0.01 && hi < 16f32.ln() + 0.01,
        "A_log {lo}..{hi}"
    );
    assert!(
        hi - lo > 1.0,
        "A spread over slow and fast heads: {lo}..{hi}"
    );
    for (tensor, centre) in [
        ("model.layers.0.linear_attn.dt_bias", 1.0),
        ("model.layers.1.linear_attn.norm.weight", 1.0),
        ("model.layers.0.input_layernorm.weight", 0.0),
        ("model.layers.3.self_attn.q_norm.weight", 0.0),
        ("model.norm.weight", 0.0),
    ] {
        let (lo, hi) = range(&hub_tensor(&hub, tensor));
        assert!(
            lo > centre - 0.6 && hi < centre + 0.6,
            "{tensor}: {lo}..{hi} around {centre}"
        );
    }
    let conv_w = hub_tensor(&hub, "model.layers.2.linear_attn.conv1d.weight");
    let (lo, hi) = range(&conv_w);
    assert!(lo > -0.2 && hi < 0.2 && hi > lo, "conv1d {lo}..{hi}");

    // Both bundles run on the CPU runtime, to the same tokens and logits bit for bit.
    let s = shape(name);
    let mut runs = Vec::new();
    for dir in [&direct, &conv] {
        let src = Arc::new(BundleSource::open(dir, None).unwrap());
        let cfg = tarfa_core::config::MoeConfig::from_json_str(
            &String::from_utf8(src.read_file("config.json").unwrap()).unwrap(),
        )
        .unwrap();
        assert_eq!(cfg, s.runtime_config().unwrap());
        let model = Arc::new(CpuModel::load(cfg.clone(), src as Arc<dyn WeightSource>).unwrap());
        let engine = CpuEngine::new(model.clone(), EngineOptions::default()).unwrap();
        let mut cache = model.new_cache();
        let opts = ForwardOptions {
            logits: LogitRows::Last,
            ..Default::default()
        };
        let out = greedy(&engine, &mut cache, &[1, 2, 3, 40, 50], 6, &opts).unwrap();
        assert_eq!(out.tokens.len(), 6);
        for row in &out.step_logits {
            assert_eq!(row.len(), cfg.vocab_size);
            assert!(row.iter().all(|x| x.is_finite()), "finite logits");
        }
        let bits: Vec<Vec<u32>> = out
            .step_logits
            .iter()
            .map(|r| r.iter().map(|v| v.to_bits()).collect())
            .collect();
        runs.push((out.tokens, bits));
    }
    assert_eq!(runs[0], runs[1], "direct = converted");
}
