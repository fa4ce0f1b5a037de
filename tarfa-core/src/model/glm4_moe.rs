//! GLM-4.5 MoE (GLM-4.5, GLM-4.5-Air), following transformers' `modeling_glm4_moe.py`
//! (<https://github.com/huggingface/transformers/blob/main/src/transformers/models/glm4_moe/modeling_glm4_moe.py>):
//! GQA with rotary embedding on the leading `partial_rotary_factor` of each head (rotate-half
//! form, the rest passed through), q/k/v biases under `attention_bias` and no o bias, a per-head
//! q/k RMSNorm when `use_qk_norm`; the first `first_k_dense_replace` layers dense; the router
//! scores with a sigmoid, chooses with `e_score_correction_bias` added, group-limited
//! (`n_group`, `topk_group`), weights the unbiased scores (renormalised when `norm_topk_prob`)
//! times `routed_scaling_factor`; `n_shared_experts` shared experts (one MLP of
//! `n_shared_experts x moe_intermediate_size`) added ungated after the routed mix.
//!
//! This file only describes the family; it must never contain arithmetic.

use super::{
    AttentionKind, DenseLayerRule, Family, FamilyExtras, Flag, QkNorm, RouterRule,
    SharedExpertRule, TensorNames,
};

/// The GLM-4.5 MoE family.
pub static GLM4_MOE: Family = Family {
    model_type: "glm4_moe",
    architecture: "Glm4MoeForCausalLM",
    reference: "https://github.com/huggingface/transformers/blob/main/src/transformers/models/glm4_moe/modeling_glm4_moe.py",
    expert_width_key: "moe_intermediate_size",
    num_experts_keys: &["n_routed_experts"],
    dense_width_key: Some("intermediate_size"),
    dense_layers: DenseLayerRule::FirstKDense,
    // Glm4MoeConfig's default is true.
    renormalize_topk: Flag::Config("norm_topk_prob", true),
    qk_norm: QkNorm::PerHead,
    qk_norm_on: Flag::Config("use_qk_norm", false),
    partial_rotary: true,
    router: RouterRule::SigmoidGroupLimited,
    attention: AttentionKind::Gqa,
    yarn_softmax_mscale: false,
    qkv_bias: Flag::Config("attention_bias", false),
    o_bias: Flag::Fixed(false),
    shared_expert: Some(SharedExpertRule::Ungated {
        count_key: "n_shared_experts",
    }),
    extras: FamilyExtras::NONE,
    names: TensorNames {
        shared_gate_proj: "model.layers.{l}.mlp.shared_experts.gate_proj.weight",
        shared_up_proj: "model.layers.{l}.mlp.shared_experts.up_proj.weight",
        shared_down_proj: "model.layers.{l}.mlp.shared_experts.down_proj.weight",
        ..TensorNames::HF_DEFAULT
    },
};
