//! OLMoE, following transformers' `modeling_olmoe.py`
//! (<https://github.com/huggingface/transformers/blob/main/src/transformers/models/olmoe/modeling_olmoe.py>):
//! q/k RMSNorm over the whole projection (width Hq*D and Hkv*D) before RoPE, biases only with
//! `attention_bias`, every layer MoE, top-k renormalised only when `norm_topk_prob`.
//! `clip_qkv` clamps q, k and v after the q/k norm (docs/EXACTNESS.md, "Other families' keys").
//!
//! This file only describes the family; it must never contain arithmetic.

use super::{
    AttentionKind, DenseLayerRule, Family, FamilyExtras, Flag, QkNorm, RouterRule, TensorNames,
};

/// The OLMoE family.
pub static OLMOE: Family = Family {
    model_type: "olmoe",
    architecture: "OlmoeForCausalLM",
    reference: "https://github.com/huggingface/transformers/blob/main/src/transformers/models/olmoe/modeling_olmoe.py",
    expert_width_key: "intermediate_size",
    num_experts_keys: &["num_experts", "num_local_experts"],
    dense_width_key: None,
    dense_layers: DenseLayerRule::None,
    renormalize_topk: Flag::Config("norm_topk_prob", false),
    qk_norm: QkNorm::WholeProjection,
    qk_norm_on: Flag::Fixed(true),
    partial_rotary: false,
    router: RouterRule::SoftmaxTopK,
    attention: AttentionKind::Gqa,
    yarn_softmax_mscale: false,
    qkv_bias: Flag::Config("attention_bias", false),
    o_bias: Flag::Config("attention_bias", false),
    shared_expert: None,
    extras: FamilyExtras::NONE,
    names: TensorNames::HF_DEFAULT,
};
