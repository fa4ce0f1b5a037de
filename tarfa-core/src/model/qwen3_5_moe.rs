//! Qwen3.5 MoE text (Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B as `Qwen3_5MoeForCausalLM`),
//! following transformers' `modeling_qwen3_5_moe.py`
//! (<https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen3_5_moe/modeling_qwen3_5_moe.py>):
//! Qwen3-Next's hybrid backbone with the gated DeltaNet's projections separate
//! (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`); every layer MoE
//! (`Qwen3_5MoeDecoderLayer` has no dense rule: `decoder_sparse_step` and `mlp_only_layers` are
//! no keys of its config); the router always renormalises its top-k (`Qwen3_5MoeTopKRouter`;
//! `norm_topk_prob` is no key either). The text model's interleaved mRoPE (`mrope_section`) sees
//! three equal position components on text, which is the plain rotary embedding whatever the
//! sections (the config parser reads them for their form).
//!
//! This file only describes the family; it must never contain arithmetic.

use super::{
    qwen3_next::HYBRID_EXTRAS, AttentionKind, DenseLayerRule, Family, FamilyExtras, Flag,
    LinearProjections, QkNorm, RouterRule, SharedExpertRule, TensorNames,
};

/// The Qwen3.5 MoE text family (`model_type` `qwen3_5_moe_text`).
pub static QWEN3_5_MOE_TEXT: Family = Family {
    model_type: "qwen3_5_moe_text",
    architecture: "Qwen3_5MoeForCausalLM",
    reference: "https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen3_5_moe/modeling_qwen3_5_moe.py",
    expert_width_key: "moe_intermediate_size",
    num_experts_keys: &["num_experts"],
    dense_width_key: None,
    dense_layers: DenseLayerRule::None,
    renormalize_topk: Flag::Fixed(true),
    qk_norm: QkNorm::PerHead,
    qk_norm_on: Flag::Fixed(true),
    partial_rotary: true,
    router: RouterRule::SoftmaxTopK,
    attention: AttentionKind::Gqa,
    yarn_softmax_mscale: false,
    qkv_bias: Flag::Config("attention_bias", false),
    o_bias: Flag::Config("attention_bias", false),
    shared_expert: Some(SharedExpertRule::SigmoidGated {
        width_key: "shared_expert_intermediate_size",
    }),
    extras: FamilyExtras {
        linear_attention: Some(LinearProjections::Separate),
        ..HYBRID_EXTRAS
    },
    names: TensorNames::HF_DEFAULT,
};
