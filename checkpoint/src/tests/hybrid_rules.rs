//! Qwen3-Next and Qwen3.5 MoE: the families, their `mtp.*` modules skipped, Qwen3.5's experts
//! fused by rows as released, its multimodal wrapper, and the multimodal RoPE keys.

use std::path::Path;

use serde_json::{json, Value};

use super::*;
use crate::CheckpointError as E;
use crate::{FusedForm, GateUpStacking, ModelFamily};

/// A multi-token-prediction module as the releases name it, experts included (they sit under
/// an `experts` module, so they must be skipped before the expert rules see them).
fn add_mtp(t: &mut Tiny) {
    t.add("mtp.fc.weight", "BF16", &[HIDDEN, 2 * HIDDEN]);
    t.add("mtp.norm.weight", "BF16", &[HIDDEN]);
    t.add(
        "mtp.layers.0.mlp.gate.weight",
        "BF16",
        &[EXPERTS as u64, HIDDEN],
    );
    t.add(
        "mtp.layers.0.mlp.experts.0.gate_proj.weight",
        "BF16",
        &[INTER, HIDDEN],
    );
}

/// Qwen3.5 MoE's experts of every layer fused as released, of width `inter`: `gate_up_proj`
/// `[E, 2I, H]`, `down_proj` `[E, H, I]`.
fn fuse_by_rows(t: &mut Tiny, inter: u64) {
    t.tensors.retain(|s| !s.name.contains(".mlp.experts."));
    for l in 0..LAYERS {
        let e = EXPERTS as u64;
        t.add(
            &format!("model.layers.{l}.mlp.experts.gate_up_proj"),
            "BF16",
            &[e, 2 * inter, HIDDEN],
        );
        t.add(
            &format!("model.layers.{l}.mlp.experts.down_proj"),
            "BF16",
            &[e, HIDDEN, inter],
        );
    }
}

#[test]
fn qwen3_next_reads_as_qwen3_with_its_mtp_module_skipped() {
    let mut t = Tiny::qwen3_next();
    add_mtp(&mut t);
    t.set("mtp_num_hidden_layers", json!(1))
        .set("mtp_use_dedicated_embeddings", json!(false));
    let c = opens(&t.write());
    assert_eq!(c.config.family, ModelFamily::Qwen3Next);
    assert_eq!(c.config.mtp_hidden_layers, Some(1));
    assert_eq!(c.experts.len(), (LAYERS * EXPERTS) as usize);
    let mtp = [
        "mtp.fc.weight",
        "mtp.layers.0.mlp.experts.0.gate_proj.weight",
        "mtp.layers.0.mlp.gate.weight",
        "mtp.norm.weight",
    ];
    assert_eq!(c.mtp, mtp);
    assert_eq!(c.skipped, mtp, "skipped is the MTP module, nothing else");
    assert!(c.left_out.is_empty());
    assert!(c.non_expert.iter().all(|n| !n.starts_with("mtp.")));
    assert_eq!(
        c.non_expert.len() + 3 * c.experts.len() + mtp.len(),
        c.tensors.len()
    );
    // Dense layers follow mlp_only_layers as Qwen3NextDecoderLayer reads it.
    t.tensors
        .retain(|s| !s.name.starts_with("model.layers.0.mlp.experts."));
    t.set("mlp_only_layers", json!([0]));
    assert_eq!(opens(&t.write()).config.moe_layers, vec![1]);
}

/// The `mtp.` prefix is these families' only: on Qwen3-MoE such tensors are not skipped, and
/// an expert under it is refused as an expert of no rule.
#[test]
fn mtp_tensors_are_skipped_only_where_the_family_has_them() {
    let mut t = Tiny::qwen3();
    add_mtp(&mut t);
    let e = fails(&t.write());
    assert_variant!(e, E::UnexpectedExpertTensor { ref tensor, .. }
        if tensor == "mtp.layers.0.mlp.experts.0.gate_proj.weight");
}

#[test]
fn qwen3_5_moe_reads_its_experts_per_expert_or_fused_by_rows() {
    let per_expert = opens(&Tiny::qwen3_5().write());
    assert_eq!(per_expert.config.family, ModelFamily::Qwen3_5Moe);
    assert_eq!(per_expert.experts.len(), (LAYERS * EXPERTS) as usize);
    assert!(per_expert.fused.is_empty());

    let mut t = Tiny::qwen3_5();
    fuse_by_rows(&mut t, INTER);
    // Every layer is MoE whatever these say: Qwen3_5MoeDecoderLayer never reads them.
    t.set("mlp_only_layers", json!([0]))
        .set("decoder_sparse_step", json!(2));
    add_mtp(&mut t);
    let c = opens(&t.write());
    assert_eq!(c.config.moe_layers, vec![0, 1]);
    assert!(c.experts.is_empty());
    assert_eq!(c.fused.len(), LAYERS as usize);
    let f = &c.fused[&1];
    assert_eq!(f.stacking, GateUpStacking::Rows);
    assert_eq!((f.intermediate, f.hidden), (INTER, HIDDEN));
    assert_eq!(
        f.form,
        FusedForm::Bf16 {
            gate_up: "model.layers.1.mlp.experts.gate_up_proj".into(),
            down: "model.layers.1.mlp.experts.down_proj".into(),
        }
    );
    assert_eq!(
        f.expert_prefix(&crate::QWEN3_5_MOE_FUSED, 3),
        crate::ExpertNaming::QwenStyle.expert_prefix(1, 3),
        "a fused expert's extent is named as the per-expert form's"
    );
    assert_eq!(
        c.expert_dims[&0], per_expert.expert_dims[&0],
        "the same expert shapes"
    );
    assert_eq!(c.mtp.len(), 4);
}

/// Fused tensors in gpt-oss's `[E, H, 2I]` orientation, a down_proj of the wrong shape, an
/// odd row count, and a layer that mixes the forms are each refused by name.
#[test]
fn qwen3_5_moe_fused_rows_are_checked() {
    let gate_up = "model.layers.1.mlp.experts.gate_up_proj";
    let down = "model.layers.1.mlp.experts.down_proj";
    let e = EXPERTS as u64;
    // Width 2, so that 2I differs from H and the orientations cannot be mistaken.
    let i = 2;
    for (name, shape) in [
        (gate_up, vec![e, HIDDEN, 2 * i]),
        (gate_up, vec![e, 2 * i + 1, HIDDEN]),
        (gate_up, vec![e + 1, 2 * i, HIDDEN]),
        (down, vec![e, i, HIDDEN]),
        (down, vec![e, HIDDEN, i + 1]),
    ] {
        let mut t = Tiny::qwen3_5();
        fuse_by_rows(&mut t, i);
        assert!(opens(&t.write()).fused[&1].intermediate == i);
        t.reshape(name, &shape);
        let err = fails(&t.write());
        assert_variant!(err, E::ExpertMatrixShape { ref tensor, .. } if tensor == name);
    }
    let mut t = Tiny::qwen3_5();
    fuse_by_rows(&mut t, INTER);
    t.retype(down, "F32");
    assert_variant!(fails(&t.write()), E::FusedTensorDtype { ref tensor, .. } if tensor == down);

    // Layer 0 fused, layer 1 per expert: layer 1's matrices are not of the fused form.
    let mut t = Tiny::qwen3_5();
    t.tensors
        .retain(|s| !s.name.starts_with("model.layers.0.mlp.experts."));
    t.add(
        "model.layers.0.mlp.experts.gate_up_proj",
        "BF16",
        &[e, 2 * INTER, HIDDEN],
    )
    .add(
        "model.layers.0.mlp.experts.down_proj",
        "BF16",
        &[e, HIDDEN, INTER],
    );
    let err = fails(&t.write());
    assert_variant!(err, E::UnexpectedExpertTensor { ref tensor, ref expected, .. }
        if tensor.starts_with("model.layers.1.mlp.experts.0.")
            && expected.contains("gate_up_proj"));
    // And a fused layer missing a tensor is named.
    let mut t = Tiny::qwen3_5();
    fuse_by_rows(&mut t, INTER);
    t.remove(down);
    assert_variant!(fails(&t.write()), E::FusedTensorMissing { layer: 1, ref tensor, .. }
        if tensor == down);
}

/// The text model of a Qwen3.5 MoE release, laid out as the release lays it out.
fn wrapped(t: &Tiny) -> Tiny {
    let mut w = t.clone();
    for s in &mut w.tensors {
        if let Some(rest) = s.name.strip_prefix("model.") {
            s.name = format!("model.language_model.{rest}");
        }
    }
    w.add("model.visual.blocks.0.attn.qkv.weight", "BF16", &[12, 4]);
    w.add("model.visual.merger.linear_fc1.weight", "BF16", &[4, 4]);
    w.config = json!({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": t.config,
        "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 1},
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": false,
        "transformers_version": "4.57.0.dev0",
    });
    w
}

#[test]
fn the_qwen3_5_moe_release_reads_as_its_text_model() {
    let mut text = Tiny::qwen3_5();
    fuse_by_rows(&mut text, INTER);
    add_mtp(&mut text);
    let w = wrapped(&text);
    let c = opens(&w.write());
    let plain = opens(&text.write());
    assert_eq!(c.config.family, ModelFamily::Qwen3_5Moe);
    let m = c.config.multimodal.as_ref().unwrap();
    assert_eq!(m.model_type, "qwen3_5_moe");
    assert_eq!(m.architectures, ["Qwen3_5MoeForConditionalGeneration"]);
    assert_eq!(m.layout, &crate::QWEN3_5_MOE_WRAPPER);
    // The text model's tensors under the text model's names: the plain form's, exactly.
    assert_eq!(c.non_expert, plain.non_expert);
    assert_eq!(c.fused, plain.fused);
    assert_eq!(c.mtp, plain.mtp, "mtp.* is the text model's, skipped");
    assert_eq!(
        c.left_out,
        [
            "model.visual.blocks.0.attn.qkv.weight",
            "model.visual.merger.linear_fc1.weight"
        ]
    );
    assert_eq!(c.skipped.len(), c.mtp.len() + c.left_out.len());
    assert!(c.tensors.contains_key("model.norm.weight"));
    assert!(c
        .tensors
        .contains_key("model.visual.blocks.0.attn.qkv.weight"));
    assert!(!c.tensors.contains_key("model.language_model.norm.weight"));
    let bundle: Value = serde_json::from_slice(&c.config.bundle_config_json().unwrap()).unwrap();
    assert_eq!(bundle["model_type"], "qwen3_5_moe_text");
    assert!(bundle.get("vision_config").is_none());

    // A tensor in the text form's layout is neither the wrapper's text model nor its tower.
    let mut stray = w.clone();
    stray.add("model.layers.0.input_layernorm.weight", "BF16", &[HIDDEN]);
    let e = fails(&stray.write());
    assert_variant!(e, E::WrapperTensorUnexpected { ref tensor, wrapper: "qwen3_5_moe", ref expected, .. }
        if tensor == "model.layers.0.input_layernorm.weight"
            && expected.contains("model.language_model.")
            && expected.contains("model.visual."));
}

#[test]
fn the_qwen3_5_moe_wrapper_keys_are_checked() {
    let text = Tiny::qwen3_5().config;
    let parse = |v: Value| {
        crate::config::ModelConfigSummary::parse(Path::new("config.json"), &v.to_string())
    };
    let wrap = |extra: Value| {
        let mut v = json!({"model_type": "qwen3_5_moe", "text_config": text});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    };
    assert!(parse(wrap(json!({"image_token_id": 1, "dtype": "bfloat16"}))).is_ok());
    let e = parse(wrap(json!({"rope_parameters": {"rope_theta": 1e6}}))).unwrap_err();
    let e = assert_variant!(e, E::WrapperKeyRefused { ref key, wrapper: "qwen3_5_moe", .. }
        if key == "rope_parameters");
    check_message(&e);
    // The text model is Qwen3.5 MoE's, or taken to be when unnamed.
    let mut other = text.clone();
    other["model_type"] = json!("qwen3_next");
    let e = parse(json!({"model_type": "qwen3_5_moe", "text_config": other})).unwrap_err();
    assert_variant!(
        e,
        E::ConfigValueOutOfRange {
            field: "text_config.model_type",
            ..
        }
    );
    let mut unnamed = text.clone();
    unnamed.as_object_mut().unwrap().remove("model_type");
    let c = parse(json!({"model_type": "qwen3_5_moe", "text_config": unnamed})).unwrap();
    assert_eq!(c.family, ModelFamily::Qwen3_5Moe);
}

/// `mrope_section` is read for its form (three unsigned widths; on text every assignment is plain
/// RoPE, whatever the widths), refused by name otherwise, in `rope_parameters` and in the older
/// `rope_scaling`; `mrope_interleaved` must be a boolean.
#[test]
fn multimodal_rope_keys_are_read_for_their_form() {
    let with = |rope: Value, top: Value| {
        let mut t = Tiny::qwen3_5();
        t.set("head_dim", json!(256))
            .set("num_attention_heads", json!(16));
        for (k, v) in top.as_object().unwrap() {
            t.set(k, v.clone());
        }
        t.set("rope_parameters", rope);
        crate::config::ModelConfigSummary::parse(Path::new("config.json"), &t.config.to_string())
    };
    let released = json!({
        "rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10], "mrope_interleaved": true
    });
    assert!(with(released.clone(), json!({})).is_ok());
    let mut not_interleaved = released.clone();
    not_interleaved["mrope_interleaved"] = json!(false);
    assert!(with(not_interleaved, json!({})).is_ok());
    // widths that do not tile the rotary half are still plain RoPE on text (transformers'
    // default [11, 11, 10] on qwen35moe-a's 8 rotary dims is what its oracle ran)
    let mut untiled = released.clone();
    untiled["mrope_section"] = json!([11, 11, 11]);
    assert!(with(untiled, json!({"partial_rotary_factor": 0.5})).is_ok());

    for (section, variant_is_range) in [
        (json!([16, 16]), true),
        (json!([8, 8, 8, 8]), true),
        (json!("11,11,10"), false),
        (json!([11, -1, 22]), false),
    ] {
        let mut rope = released.clone();
        rope["mrope_section"] = section.clone();
        let written = section.to_string();
        let e = with(rope, json!({})).unwrap_err();
        check_message(&e);
        assert!(e.to_string().contains("mrope_section"), "{e}");
        if variant_is_range {
            assert_variant!(e, E::ConfigValueOutOfRange { field: "rope_parameters.mrope_section", ref value, .. }
                if *value == written);
        } else {
            assert_variant!(
                e,
                E::ConfigWrongType {
                    field: "rope_parameters.mrope_section",
                    ..
                }
            );
        }
    }
    let mut rope = released.clone();
    rope["mrope_interleaved"] = json!("yes");
    assert_variant!(
        with(rope, json!({})).unwrap_err(),
        E::ConfigWrongType {
            field: "rope_parameters.mrope_interleaved",
            ..
        }
    );
    // The older spelling: rope_scaling.
    let e = with(
        json!({"rope_theta": 1e7, "partial_rotary_factor": 0.25}),
        json!({"rope_scaling": {"rope_type": "default", "mrope_section": [12, 11]}}),
    )
    .unwrap_err();
    assert_variant!(
        e,
        E::ConfigValueOutOfRange {
            field: "rope_scaling.mrope_section",
            ..
        }
    );
}
