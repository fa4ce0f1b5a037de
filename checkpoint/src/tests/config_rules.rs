//! config.json rules.

use std::path::Path;

use serde_json::{json, Value};

use super::*;
use crate::CheckpointError as E;

fn with_config(edit: impl FnOnce(&mut Tiny)) -> E {
    let mut t = Tiny::qwen3();
    edit(&mut t);
    let e = fails(&t.write());
    assert_eq!(e.file(), Path::new("config.json"), "{e}");
    e
}

fn with_config_text(text: &[u8]) -> E {
    let dir = Tiny::qwen3().write();
    std::fs::write(dir.join("config.json"), text).unwrap();
    let e = fails(&dir);
    assert_eq!(e.file(), Path::new("config.json"), "{e}");
    e
}

#[test]
fn config_missing() {
    let dir = Tiny::qwen3().write();
    std::fs::remove_file(dir.join("config.json")).unwrap();
    assert_variant!(fails(&dir), E::ConfigMissing { .. });
}

#[test]
fn config_not_json() {
    assert_variant!(
        with_config_text(b"model_type: qwen3_moe"),
        E::ConfigInvalidJson { .. }
    );
    assert_variant!(with_config_text(b""), E::ConfigInvalidJson { .. });
    assert_variant!(with_config_text(b"[1,2]"), E::ConfigInvalidJson { .. });
    assert_variant!(
        with_config_text(b"{\"model_type\": \"\xff\"}"),
        E::ConfigInvalidJson { .. }
    );
}

#[test]
fn config_duplicate_key() {
    let e = with_config_text(
        br#"{"model_type":"qwen3_moe","num_hidden_layers":2,"num_hidden_layers":40}"#,
    );
    assert_variant!(e, E::DuplicateJsonKey { ref key_path, .. } if key_path == r#""num_hidden_layers""#);
    let e = with_config_text(br#"{"rope_parameters":{"rope_theta":1,"rope_theta":2}}"#);
    assert_variant!(e, E::DuplicateJsonKey { .. });
}

#[test]
fn config_missing_fields() {
    for field in [
        "model_type",
        "num_hidden_layers",
        "num_experts_per_tok",
        "hidden_size",
    ] {
        let e = with_config(|t| {
            t.unset(field);
        });
        assert_variant!(e, E::ConfigMissingField { field: f, .. } if f == field);
        // null counts as missing.
        let e = with_config(|t| {
            t.set(field, Value::Null);
        });
        assert_variant!(e, E::ConfigMissingField { field: f, .. } if f == field);
    }
}

#[test]
fn config_missing_expert_count() {
    let e = with_config(|t| {
        t.unset("num_local_experts");
    });
    assert_variant!(e, E::ConfigMissingExpertCount { .. });
}

#[test]
fn either_expert_count_key_is_accepted() {
    let mut t = Tiny::qwen3();
    t.unset("num_local_experts")
        .set("num_experts", json!(EXPERTS));
    assert_eq!(opens(&t.write()).config.num_experts, EXPERTS);
    t.set("num_local_experts", json!(EXPERTS));
    assert_eq!(opens(&t.write()).config.num_experts, EXPERTS);
    t.set("num_local_experts", Value::Null);
    assert_eq!(opens(&t.write()).config.num_experts, EXPERTS);
}

#[test]
fn config_conflicting_expert_count() {
    let e = with_config(|t| {
        t.set("num_experts", json!(8));
    });
    assert_variant!(
        e,
        E::ConfigConflictingExpertCount {
            num_experts: 8,
            num_local_experts: 4,
            ..
        }
    );
}

#[test]
fn config_wrong_types() {
    let cases: Vec<(&str, Value)> = vec![
        ("num_hidden_layers", json!("2")),
        ("num_hidden_layers", json!(2.0)),
        ("num_hidden_layers", json!(-2)),
        ("num_local_experts", json!([4])),
        ("num_experts_per_tok", json!(true)),
        ("hidden_size", json!({"v": 8})),
        ("model_type", json!(5)),
        ("architectures", json!("Qwen3MoeForCausalLM")),
        ("architectures", json!([1])),
        ("decoder_sparse_step", json!("1")),
        ("mlp_only_layers", json!("none")),
        ("mlp_only_layers", json!([-1])),
    ];
    for (field, value) in cases {
        let e = with_config(|t| {
            t.set(field, value.clone());
        });
        assert_variant!(e, E::ConfigWrongType { field: f, .. } if f == field);
    }
}

#[test]
fn config_values_out_of_range() {
    let cases: Vec<(&str, Value)> = vec![
        ("num_hidden_layers", json!(0)),
        ("num_hidden_layers", json!(4294967296u64)),
        ("num_local_experts", json!(0)),
        ("num_local_experts", json!(4294967296u64)),
        ("num_experts_per_tok", json!(0)),
        ("num_experts_per_tok", json!(EXPERTS + 1)),
        ("hidden_size", json!(0)),
        ("decoder_sparse_step", json!(0)),
        ("mlp_only_layers", json!([LAYERS])),
    ];
    for (field, value) in cases {
        let e = with_config(|t| {
            t.set(field, value.clone());
        });
        assert_variant!(e, E::ConfigValueOutOfRange { field: f, .. } if f == field);
    }
}

#[test]
fn unsupported_model_type() {
    let e = with_config(|t| {
        t.set("model_type", json!("jamba"));
    });
    assert_variant!(e, E::UnsupportedModelType { ref model_type, .. } if model_type == "jamba");
}

#[test]
fn quantized_config() {
    let e = with_config(|t| {
        t.set(
            "quantization_config",
            json!({"quant_method": "fp8", "weight_block_size": [128, 128]}),
        );
    });
    let e = assert_variant!(e, E::QuantizedConfig { ref method, .. } if method == "fp8");
    let m = e.to_string();
    assert!(m.contains("never re-quantises"), "{m}");
    // An FP8 release (DeepSeek-V3's own weights) is named as such: a BF16 conversion of it is
    // not the released weights, and what Tarfa accepts.
    assert!(m.contains("released form is FP8"), "{m}");
    assert!(
        m.contains("BF16 conversion of it is not the released weights"),
        "{m}"
    );
    assert!(m.contains("only accepts BF16 checkpoints"), "{m}");
    let e = with_config(|t| {
        t.set("compression_config", json!({}));
    });
    assert_variant!(
        e,
        E::QuantizedConfig {
            key: "compression_config",
            ..
        }
    );
}

#[test]
fn dense_layers_follow_mlp_only_layers_and_sparse_step() {
    // Layer 0 dense (mlp_only_layers), with a dense MLP and no experts.
    let mut t = Tiny::qwen3();
    t.tensors
        .retain(|s| !s.name.starts_with("model.layers.0.mlp.experts."));
    for m in ["gate_proj", "up_proj", "down_proj"] {
        t.add(
            &format!("model.layers.0.mlp.{m}.weight"),
            "BF16",
            &[HIDDEN, HIDDEN],
        );
    }
    t.set("mlp_only_layers", json!([0]));
    let c = opens(&t.write());
    assert_eq!(c.config.moe_layers, vec![1]);
    assert_eq!(c.experts.len(), EXPERTS as usize);
    assert!(c
        .non_expert
        .contains(&"model.layers.0.mlp.down_proj.weight".to_owned()));
    // decoder_sparse_step = 2: layer 1 is sparse ((1 + 1) % 2 == 0), layer 0 dense.
    t.unset("mlp_only_layers")
        .set("decoder_sparse_step", json!(2));
    assert_eq!(opens(&t.write()).config.moe_layers, vec![1]);
    // Mixtral ignores both keys: every layer is sparse.
    let mut m = Tiny::mixtral();
    m.set("mlp_only_layers", json!([0]))
        .set("decoder_sparse_step", json!(2));
    assert_eq!(opens(&m.write()).config.moe_layers, vec![0, 1]);
}

#[test]
fn config_is_kept_whole() {
    let c = opens(&Tiny::olmoe().write());
    assert_eq!(c.config.family, crate::ModelFamily::Olmoe);
    assert_eq!(c.config.model_type, "olmoe");
    assert_eq!(c.config.architectures, vec!["OlmoeForCausalLM".to_owned()]);
    assert_eq!(c.config.raw["vocab_size"], json!(16));
    assert_eq!(
        (c.config.num_experts_per_tok, c.config.hidden_size),
        (2, HIDDEN)
    );
}

#[test]
fn config_too_large() {
    let dir = Tiny::qwen3().write();
    let f = std::fs::File::create(dir.join("config.json")).unwrap();
    f.set_len(crate::MAX_JSON_LEN + 1).unwrap(); // sparse: no 100 MB written
    assert_variant!(fails(&dir), E::JsonTooLarge { .. });
}

/// Llama 4's MoE layers, as transformers' Llama4TextConfig resolves them: `moe_layers` when
/// written, else every `interleave_moe_layer_step`-th layer counted from step - 1; a listed
/// layer past the last is refused by name.
#[test]
fn llama4_moe_layers_follow_llama4_text_config() {
    use crate::config::ModelConfigSummary;
    let parse = |extra: Value| {
        let mut v = json!({
            "model_type": "llama4_text", "num_hidden_layers": 6, "num_local_experts": 4,
            "num_experts_per_tok": 1, "hidden_size": 64
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        ModelConfigSummary::parse(Path::new("config.json"), &v.to_string())
    };
    let layers = |extra| parse(extra).unwrap().moe_layers;
    assert_eq!(layers(json!({})), vec![0, 1, 2, 3, 4, 5]);
    // Scout writes step 1; Maverick step 2 (layers 1, 3, 5 MoE).
    assert_eq!(
        layers(json!({"interleave_moe_layer_step": 2})),
        vec![1, 3, 5]
    );
    assert_eq!(layers(json!({"interleave_moe_layer_step": 4})), vec![3]);
    // The explicit list wins over the step.
    assert_eq!(
        layers(json!({"interleave_moe_layer_step": 2, "moe_layers": [4, 0]})),
        vec![0, 4]
    );
    let s = parse(json!({})).unwrap();
    assert_eq!(s.family.fused_experts(), Some(&crate::LLAMA4_FUSED));
    let e = parse(json!({"moe_layers": [6]})).unwrap_err();
    assert_variant!(
        e,
        E::ConfigValueOutOfRange {
            field: "moe_layers",
            ..
        }
    );
    let e = parse(json!({"interleave_moe_layer_step": 0})).unwrap_err();
    assert_variant!(
        e,
        E::ConfigValueOutOfRange {
            field: "interleave_moe_layer_step",
            ..
        }
    );
}

/// The multimodal Llama 4 wrapper: text_config read as a llama4_text config; a key outside the
/// known list, a text model of another type, a disagreeing tie_word_embeddings refused by name;
/// tensor names mapped to the text model's, the vision tower's left out, anything else refused.
#[test]
fn llama4_multimodal_wrapper_config_and_names() {
    use crate::config::ModelConfigSummary;
    use crate::WrappedTensor::{LeftOut, Text};
    let text = json!({
        "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 1,
        "hidden_size": 64, "interleave_moe_layer_step": 2
    });
    let parse = |v: Value| ModelConfigSummary::parse(Path::new("config.json"), &v.to_string());
    let ok = parse(json!({
        "model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
        "text_config": text, "vision_config": {"hidden_size": 8}, "image_token_index": 5
    }))
    .unwrap();
    assert_eq!(ok.family, crate::ModelFamily::Llama4Text);
    assert_eq!(ok.moe_layers, vec![1]);
    assert_eq!(
        ok.raw["model_type"], "llama4_text",
        "taken to be llama4_text"
    );
    let w = ok.multimodal.as_ref().unwrap();
    assert_eq!(w.architectures, ["Llama4ForConditionalGeneration"]);
    let bundle: Value = serde_json::from_slice(&ok.bundle_config_json().unwrap()).unwrap();
    assert_eq!(bundle["hidden_size"], 64);
    assert!(bundle.get("vision_config").is_none());

    let e = parse(json!({"model_type": "llama4", "text_config": text, "rope_scaling": {}}))
        .unwrap_err();
    assert_variant!(e, E::WrapperKeyRefused { ref key, wrapper: "llama4", .. } if key == "rope_scaling");
    let mut other = text.clone();
    other["model_type"] = json!("qwen3_moe");
    let e = parse(json!({"model_type": "llama4", "text_config": other})).unwrap_err();
    assert_variant!(
        e,
        E::ConfigValueOutOfRange {
            field: "text_config.model_type",
            ..
        }
    );
    let e =
        parse(json!({"model_type": "llama4", "text_config": text, "tie_word_embeddings": true}))
            .unwrap_err();
    assert_variant!(
        e,
        E::ConfigValueOutOfRange {
            field: "tie_word_embeddings",
            ..
        }
    );
    let e = parse(json!({"model_type": "llama4"})).unwrap_err();
    assert_variant!(
        e,
        E::ConfigMissingField {
            field: "text_config",
            ..
        }
    );

    let w = &crate::LLAMA4_WRAPPER;
    assert_eq!(
        w.classify("language_model.model.layers.0.feed_forward.router.weight"),
        Some(Text("model.layers.0.feed_forward.router.weight".into()))
    );
    assert_eq!(
        w.classify("language_model.lm_head.weight"),
        Some(Text("lm_head.weight".into()))
    );
    assert_eq!(
        w.classify("vision_model.patch_embedding.weight"),
        Some(LeftOut)
    );
    assert_eq!(
        w.classify("multi_modal_projector.linear_1.weight"),
        Some(LeftOut)
    );
    assert_eq!(w.classify("model.layers.0.input_layernorm.weight"), None);
    assert_eq!(w.classify("language_model.extra.weight"), None);
}
