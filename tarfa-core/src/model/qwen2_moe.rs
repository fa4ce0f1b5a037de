//! Qwen2-MoE, following transformers' `modeling_qwen2_moe.py`
//! (<https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen2_moe/modeling_qwen2_moe.py>):
//! q/k/v biases (`qkv_bias`, default on), no o bias, no q/k norm; a softmax router with top-k
//! renormalised only when `norm_topk_prob`; a shared expert scaled by
//! `sigmoid(shared_expert_gate(x))` and added to the routed mix; the same dense-layer rule as
//! Qwen3-MoE.
//!
//! This file only describes the family; it must never contain arithmetic.

use super::{
    AttentionKind, DenseLayerRule, Family, FamilyExtras, Flag, QkNorm, RouterRule,
    SharedExpertRule, TensorNames,
};

/// The Qwen2-MoE family.
pub static QWEN2_MOE: Family = Family {
    model_type: "qwen2_moe",
    architecture: "Qwen2MoeForCausalLM",
    reference: "https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen2_moe/modeling_qwen2_moe.py",
    expert_width_key: "moe_intermediate_size",
    num_experts_keys: &["num_experts", "num_local_experts"],
    dense_width_key: Some("intermediate_size"),
    dense_layers: DenseLayerRule::QwenSparseStep,
    renormalize_topk: Flag::Config("norm_topk_prob", false),
    qk_norm: QkNorm::None,
    qk_norm_on: Flag::Fixed(true),
    partial_rotary: false,
    router: RouterRule::SoftmaxTopK,
    attention: AttentionKind::Gqa,
    yarn_softmax_mscale: false,
    qkv_bias: Flag::Config("qkv_bias", true),
    o_bias: Flag::Fixed(false),
    shared_expert: Some(SharedExpertRule::SigmoidGated {
        width_key: "shared_expert_intermediate_size",
    }),
    extras: FamilyExtras::NONE,
    names: TensorNames::HF_DEFAULT,
};
