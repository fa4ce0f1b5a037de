//! Expert structure and the dtype policy.

use std::path::Path;

use super::*;
use crate::{CheckpointError as E, Dtype, ExpertMatrix::*};

fn fails_with(edit: impl FnOnce(&mut Tiny)) -> E {
    let mut t = Tiny::qwen3();
    edit(&mut t);
    fails(&t.write())
}

#[test]
fn no_expert_tensors() {
    let e = fails_with(|t| t.tensors.retain(|s| !s.name.contains(".experts.")));
    let e = assert_variant!(e, E::NoExpertTensors { .. });
    assert_eq!(e.file(), Path::new(crate::INDEX_FILE));
    // A Mixtral config over Qwen-named experts finds none of its own, and says which it saw.
    let mut t = Tiny::qwen3();
    t.set("model_type", serde_json::json!("mixtral"));
    assert_variant!(fails(&t.write()), E::UnexpectedExpertTensor { ref expected, .. } if expected.contains("block_sparse_moe"));
}

#[test]
fn unexpected_expert_tensors() {
    type Edit = Box<dyn Fn(&mut Tiny)>;
    let cases: Vec<Edit> = vec![
        // An extra tensor in an expert.
        Box::new(|t| {
            t.add("model.layers.0.mlp.experts.3.bias", "BF16", &[INTER]);
        }),
        Box::new(|t| {
            t.add(
                "model.layers.0.mlp.experts.3.gate_proj.bias",
                "BF16",
                &[INTER],
            );
        }),
        // transformers' fused 3-D expert tensors.
        Box::new(|t| {
            t.add(
                "model.layers.0.mlp.experts.gate_up_proj",
                "BF16",
                &[EXPERTS as u64, HIDDEN, 2 * INTER],
            );
        }),
        // A non-canonical id that would alias expert 3.
        Box::new(|t| {
            t.add(
                "model.layers.0.mlp.experts.03.gate_proj.weight",
                "BF16",
                &[INTER, HIDDEN],
            );
        }),
        // The other family's naming.
        Box::new(|t| {
            t.add(
                "model.layers.0.block_sparse_moe.experts.0.w1.weight",
                "BF16",
                &[INTER, HIDDEN],
            );
        }),
        // Experts outside `model.layers`.
        Box::new(|t| {
            t.add("experts.0.gate_proj.weight", "BF16", &[INTER, HIDDEN]);
        }),
    ];
    for edit in cases {
        assert_variant!(fails_with(edit), E::UnexpectedExpertTensor { .. });
    }
}

#[test]
fn expert_layer_out_of_range() {
    let e = fails_with(|t| t.add_expert(crate::ExpertNaming::QwenStyle, LAYERS, 0, INTER));
    assert_variant!(
        e,
        E::ExpertLayerOutOfRange {
            layer: LAYERS,
            num_layers: LAYERS,
            ..
        }
    );
}

#[test]
fn expert_id_out_of_range() {
    let e = fails_with(|t| t.add_expert(crate::ExpertNaming::QwenStyle, 1, EXPERTS, INTER));
    assert_variant!(
        e,
        E::ExpertIdOutOfRange {
            expert: EXPERTS,
            num_experts: EXPERTS,
            ..
        }
    );
}

#[test]
fn experts_in_a_dense_layer() {
    let e = fails_with(|t| {
        t.set("mlp_only_layers", serde_json::json!([1]));
    });
    assert_variant!(e, E::ExpertsInDenseLayer { layer: 1, .. });
}

#[test]
fn missing_expert() {
    let e = fails_with(|t| {
        for m in [Gate, Up, Down] {
            t.remove(&qwen_expert(1, 2, m));
        }
    });
    let e = assert_variant!(
        e,
        E::MissingExpert {
            layer: 1,
            expert: 2,
            ..
        }
    );
    assert_eq!(e.file(), Path::new(crate::INDEX_FILE));
    // A sparse layer with no experts at all.
    let e = fails_with(|t| {
        t.tensors
            .retain(|s| !s.name.starts_with("model.layers.0.mlp.experts."))
    });
    assert_variant!(
        e,
        E::MissingExpert {
            layer: 0,
            expert: 0,
            ..
        }
    );
}

#[test]
fn expert_missing_a_matrix() {
    for m in [Gate, Up, Down] {
        let e = fails_with(|t| {
            t.remove(&qwen_expert(0, 3, m));
        });
        assert_variant!(e, E::ExpertMissingMatrix { layer: 0, expert: 3, ref tensor, .. } if *tensor == qwen_expert(0, 3, m));
    }
    let mut t = Tiny::mixtral().single();
    t.remove("model.layers.1.block_sparse_moe.experts.0.w3.weight");
    let e = assert_variant!(fails(&t.write()), E::ExpertMissingMatrix { .. });
    assert!(e.to_string().contains("w3"), "{e}");
    assert_eq!(e.file(), Path::new("model.safetensors"));
}

#[test]
fn expert_matrix_shapes_within_an_expert() {
    let cases: Vec<(ExpertMatrixArg, Vec<u64>)> = vec![
        (Gate, vec![INTER, HIDDEN, 1]),  // 3-D
        (Up, vec![INTER * HIDDEN]),      // 1-D
        (Up, vec![INTER + 1, HIDDEN]),   // up differs from gate
        (Down, vec![INTER, HIDDEN]),     // down not transposed
        (Down, vec![HIDDEN, INTER + 1]), // down's width differs
        (Gate, vec![0, HIDDEN]),         // zero width (then up and down disagree too)
    ];
    for (m, shape) in cases {
        let e = fails_with(|t| {
            t.reshape(&qwen_expert(1, 1, m), &shape);
        });
        assert_variant!(e, E::ExpertMatrixShape { .. });
    }
    // hidden_size disagrees with every expert.
    let e = fails_with(|t| {
        t.set("hidden_size", serde_json::json!(HIDDEN * 2));
    });
    assert_variant!(e, E::ExpertMatrixShape { ref expected, .. } if expected[1] == HIDDEN * 2);
}

type ExpertMatrixArg = crate::ExpertMatrix;

#[test]
fn expert_shapes_across_a_layer() {
    let e = fails_with(|t| {
        t.tensors
            .retain(|s| !s.name.starts_with("model.layers.1.mlp.experts.2."));
        t.add_expert(crate::ExpertNaming::QwenStyle, 1, 2, INTER * 2);
    });
    let e = assert_variant!(e, E::ExpertShapeMismatch { ref reference, .. } if *reference == qwen_expert(1, 0, Gate));
    assert!(e.to_string().contains("experts.2.gate_proj"), "{e}");
    // Different widths in different layers are fine.
    let mut t = Tiny::qwen3();
    t.tensors
        .retain(|s| !s.name.starts_with("model.layers.1.mlp.experts."));
    for e in 0..EXPERTS {
        t.add_expert(crate::ExpertNaming::QwenStyle, 1, e, INTER * 2);
    }
    let c = opens(&t.write());
    assert_eq!(c.expert_dims[&1].intermediate, INTER * 2);
}

// ---- dtype policy ---------------------------------------------------------------------------

#[test]
fn quantized_expert_weights_are_refused() {
    for dtype in ["F8_E4M3", "F8_E5M2", "I8", "U8", "F8_E8M0"] {
        let e = fails_with(|t| {
            t.retype(&qwen_expert(0, 1, Down), dtype);
        });
        let e =
            assert_variant!(e, E::QuantizedTensor { dtype: d, .. } if format!("{d:?}") == dtype);
        assert!(
            e.to_string()
                .contains("Tarfa only accepts BF16 checkpoints and never re-quantises"),
            "{e}"
        );
    }
    // F4 packs two values per byte.
    let e = fails_with(|t| {
        t.retype(&qwen_expert(0, 1, Down), "F4");
    });
    assert_variant!(
        e,
        E::QuantizedTensor {
            dtype: Dtype::F4,
            ..
        }
    );
}

#[test]
fn quantized_non_expert_tensors_are_refused() {
    let e = fails_with(|t| {
        t.retype("lm_head.weight", "F8_E4M3");
    });
    assert_variant!(e, E::QuantizedTensor { ref tensor, .. } if tensor == "lm_head.weight");
}

#[test]
fn quantization_companions_are_refused() {
    for name in [
        "model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv",
        "model.layers.0.self_attn.q_proj.scales",
        "model.layers.0.self_attn.q_proj.qzeros",
        "model.layers.0.self_attn.q_proj.weight.absmax",
    ] {
        let e = fails_with(|t| {
            t.add(name, "F32", &[1]);
        });
        let e = assert_variant!(e, E::QuantizationCompanion { ref tensor, .. } if tensor == name);
        // weight_scale_inv marks an FP8 release: the message says so.
        let fp8 = e.to_string().contains("released form is FP8");
        assert_eq!(fp8, name.ends_with(".weight_scale_inv"), "{e}");
    }
    // GPTQ packs int4 into I32 `qweight`: the name is refused before the dtype is looked at.
    let e = fails_with(|t| {
        t.add("model.layers.0.self_attn.q_proj.qweight", "I32", &[1, 8]);
    });
    assert_variant!(e, E::QuantizationCompanion { .. });
}

#[test]
fn unsupported_dtypes_are_refused() {
    for dtype in ["I64", "BOOL", "I32", "U16", "C64"] {
        let e = fails_with(|t| {
            t.add("model.rotary_emb.inv_freq", dtype, &[2]);
        });
        assert_variant!(e, E::UnsupportedDtype { .. });
    }
}

#[test]
fn float_expert_weights_other_than_bf16_are_refused() {
    for dtype in ["F16", "F32", "F64"] {
        let e = fails_with(|t| {
            t.retype(&qwen_expert(1, 3, Up), dtype);
        });
        let e = assert_variant!(e, E::ExpertNotBf16 { .. });
        assert_eq!(
            e.file(),
            Path::new(&Tiny::qwen3().file_of(&qwen_expert(1, 3, Up)))
        );
    }
}

#[test]
fn float_non_expert_tensors_are_accepted_as_they_are() {
    let mut t = Tiny::qwen3();
    t.retype("model.norm.weight", "F32")
        .retype("lm_head.weight", "F16")
        .retype("model.embed_tokens.weight", "F64");
    let c = opens(&t.write());
    assert_eq!(c.tensors["model.norm.weight"].dtype, Dtype::F32);
    assert_eq!(c.tensors["lm_head.weight"].dtype, Dtype::F16);
}
