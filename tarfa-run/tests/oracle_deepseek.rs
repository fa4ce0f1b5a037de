//! DeepSeek-V3 and DeepSeek-V2 (multi-head latent attention, YaRN, group-limited routing,
//! shared experts, dense first layers) through the real converter and the real `tarfa-run`
//! binary against transformers' float32 runs, the contract's invariances on them bit for bit
//! (common/family_cli.rs), the multi-token-prediction layers a release carries (skipped with a
//! note, never run), and the FP8 refusal.
//!
//! `deepseekv3-s` and `deepseekv2-yarn-s` ship in fixtures/oracle (validation/oracle/
//! make_oracle2.py); `deepseekv3-a` and `deepseekv2-a` live in the shared oracle and run when
//! TARFA_EXTRA_ORACLES names it (`.ci/run` sets it):
//! `TARFA_EXTRA_ORACLES=../shared/oracle cargo test -p tarfa-run --test oracle_deepseek -- --ignored`

mod common;

use std::path::{Path, PathBuf};

use common::family_cli::{cli_matches_oracle, invariances_are_bitwise, run};
use common::*;
use serde_json::Value;

fn shared_dir(name: &str) -> PathBuf {
    let root = std::env::var("TARFA_EXTRA_ORACLES")
        .expect("set TARFA_EXTRA_ORACLES to the directory holding the extra oracle fixtures");
    let dir = Path::new(&root).join(name);
    assert!(
        dir.join("reference.safetensors").is_file(),
        "{}: no reference.safetensors",
        dir.display()
    );
    dir
}

/// The manifest of a V3 bundle: the router with its correction bias, the shared experts and
/// the latent attention's projections are non-expert tensors.
const V3_NON_EXPERT: &[&str] = &[
    "model.layers.1.mlp.gate.weight",
    "model.layers.1.mlp.gate.e_score_correction_bias",
    "model.layers.1.mlp.shared_experts.gate_proj.weight",
    "model.layers.1.self_attn.q_a_proj.weight",
    "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
    "model.layers.1.self_attn.kv_b_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
];

const V2_NON_EXPERT: &[&str] = &[
    "model.layers.1.mlp.gate.weight",
    "model.layers.1.mlp.shared_experts.down_proj.weight",
    "model.layers.1.self_attn.kv_a_layernorm.weight",
    "model.layers.0.mlp.down_proj.weight",
];

const EXPERT: &str = "model.layers.1.mlp.experts.0";

#[test]
fn deepseek_v3_small_through_the_converter_and_the_cli_matches_transformers() {
    cli_matches_oracle(
        &fixture_dir("deepseekv3-s"),
        "deepseekv3-s",
        V3_NON_EXPERT,
        EXPERT,
    );
}

#[test]
fn deepseek_v2_small_through_the_converter_and_the_cli_matches_transformers() {
    let mut names = V2_NON_EXPERT.to_vec();
    names.push("model.layers.1.self_attn.q_a_proj.weight");
    cli_matches_oracle(
        &fixture_dir("deepseekv2-yarn-s"),
        "deepseekv2-yarn-s",
        &names,
        EXPERT,
    );
}

#[test]
fn deepseek_invariances_are_bitwise() {
    for name in ["deepseekv3-s", "deepseekv2-yarn-s", "deepseekv3-plain-s"] {
        invariances_are_bitwise(&load_fixture(name));
    }
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn deepseek_v3_through_the_converter_and_the_cli_matches_transformers() {
    cli_matches_oracle(
        &shared_dir("deepseekv3-a"),
        "deepseekv3-a",
        V3_NON_EXPERT,
        EXPERT,
    );
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn deepseek_v2_through_the_converter_and_the_cli_matches_transformers() {
    let mut names = V2_NON_EXPERT.to_vec();
    names.push("model.layers.1.self_attn.q_proj.weight");
    cli_matches_oracle(&shared_dir("deepseekv2-a"), "deepseekv2-a", &names, EXPERT);
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn deepseek_shared_invariances_are_bitwise() {
    for name in ["deepseekv3-a", "deepseekv2-a"] {
        invariances_are_bitwise(&load_fixture_from(&shared_dir(name), name));
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn edit_json(path: &Path, f: impl FnOnce(&mut Value)) {
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// deepseekv3-s with a multi-token-prediction module after its last layer (layer 3), in its
/// own shard: the MTP's projections and norms and one expert, as V3 releases carry them.
fn with_mtp_layer(dir: &Path, nextn: Option<u64>) {
    copy_dir(&fixture_dir("deepseekv3-s"), dir);
    let bf16 = |n: usize| vec![0x3f80u16; n]; // 1.0
    let tensors: Vec<(&str, Vec<usize>)> = vec![
        ("model.layers.3.eh_proj.weight", vec![64, 128]),
        ("model.layers.3.enorm.weight", vec![64]),
        ("model.layers.3.hnorm.weight", vec![64]),
        (
            "model.layers.3.mlp.experts.0.gate_proj.weight",
            vec![24, 64],
        ),
        ("model.layers.3.mlp.experts.0.up_proj.weight", vec![24, 64]),
        (
            "model.layers.3.mlp.experts.0.down_proj.weight",
            vec![64, 24],
        ),
    ];
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(n, shape)| {
            let count = shape.iter().product();
            let b = bf16(count).iter().flat_map(|v| v.to_le_bytes()).collect();
            (n.to_string(), b, shape.clone())
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(n, b, s)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    let shard = "model-mtp.safetensors";
    safetensors::serialize_to_file(views, None, &dir.join(shard)).unwrap();
    edit_json(&dir.join("model.safetensors.index.json"), |v| {
        let map = v["weight_map"].as_object_mut().unwrap();
        for (n, _) in &tensors {
            map.insert(n.to_string(), shard.into());
        }
    });
    edit_json(&dir.join("config.json"), |v| match nextn {
        Some(n) => v["num_nextn_predict_layers"] = n.into(),
        None => {
            v.as_object_mut()
                .unwrap()
                .remove("num_nextn_predict_layers");
        }
    });
}

#[test]
fn multi_token_prediction_layers_are_skipped_with_a_note_and_never_run() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    with_mtp_layer(&src, Some(1));
    let with_mtp = tmp.path().join("with-mtp");
    let summary = tarfa_convert::convert(&src, &with_mtp, &Default::default()).unwrap();
    assert_eq!(summary.notes.len(), 1, "{:?}", summary.notes);
    let note = &summary.notes[0];
    assert!(
        note.contains("6 multi-token-prediction tensors of layers 3..4")
            && note.contains("num_nextn_predict_layers 1"),
        "{note}"
    );
    let manifest = std::fs::read_to_string(with_mtp.join("manifest.toml")).unwrap();
    assert!(
        !manifest.contains("name = \"model.layers.3."),
        "an MTP tensor was carried"
    );
    assert!(
        manifest.contains("multi-token-prediction"),
        "the manifest keeps the note"
    );
    // The bundle runs exactly as the checkpoint without the module does.
    let plain = tmp.path().join("plain");
    tarfa_convert::convert(&fixture_dir("deepseekv3-s"), &plain, &Default::default()).unwrap();
    let mut outs = Vec::new();
    for b in [&with_mtp, &plain] {
        let file = tmp.path().join(format!(
            "{}.safetensors",
            b.file_name().unwrap().to_str().unwrap()
        ));
        let (code, stdout, err) = run(&[
            "generate",
            b.to_str().unwrap(),
            "--tokens",
            "5,17,200,3",
            "--max-new-tokens",
            "6",
            "--ignore-eos",
            "--backend",
            "cpu",
            "--logits-out",
            file.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{err}");
        // the logits themselves (the file's metadata names each bundle's digest)
        let bytes = std::fs::read(&file).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        outs.push((stdout, st.tensor("logits").unwrap().data().to_vec()));
    }
    assert!(outs[0] == outs[1], "the MTP module changed the output");

    // Without num_nextn_predict_layers the layer is not the model's: its experts are refused by
    // name, before anything is written.
    let src2 = tmp.path().join("src2");
    with_mtp_layer(&src2, None);
    let err = tarfa_convert::convert(&src2, &tmp.path().join("refused"), &Default::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.layers.3.mlp.experts.0"),
        "the refusal names the tensor: {err}"
    );
    assert!(!tmp.path().join("refused").exists());
}

#[test]
fn an_fp8_release_is_refused_with_what_tarfa_accepts() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    copy_dir(&fixture_dir("deepseekv3-s"), &src);
    edit_json(&src.join("config.json"), |v| {
        v["quantization_config"] = serde_json::json!({
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128]
        });
    });
    let err = tarfa_convert::convert(&src, &tmp.path().join("out"), &Default::default())
        .unwrap_err()
        .to_string();
    for want in ["config.json", "FP8", "not the released weights", "BF16"] {
        assert!(err.contains(want), "{want:?} missing from: {err}");
    }
    assert!(!tmp.path().join("out").exists());
}
