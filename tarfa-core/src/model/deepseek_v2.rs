//! DeepSeek-V2 (DeepSeek-V2, V2-Lite, V2.5), following transformers' `modeling_deepseek_v2.py`
//! (<https://github.com/huggingface/transformers/blob/main/src/transformers/models/deepseek_v2/modeling_deepseek_v2.py>):
//! the same multi-head latent attention as DeepSeek-V3 (its complex-number rotary embedding on
//! interleaved pairs is the de-interleaved rotate-half form, the pairs stored in another order),
//! with the same YaRN softmax correction (`yarn_apply_mscale`); the first
//! `first_k_dense_replace` layers dense; a softmax router whose `topk_method` is `greedy` or
//! `group_limited_greedy` (groups scored by their largest probability), the chosen
//! probabilities times `routed_scaling_factor` and never renormalised (transformers 5.17 reads
//! no `norm_topk_prob` here; the config parser refuses `true` by name); `n_shared_experts`
//! shared experts added ungated.
//!
//! This file only describes the family; it must never contain arithmetic.

use super::{
    AttentionKind, DenseLayerRule, Family, FamilyExtras, Flag, QkNorm, RouterRule,
    SharedExpertRule, TensorNames,
};

/// The DeepSeek-V2 family.
pub static DEEPSEEK_V2: Family = Family {
    model_type: "deepseek_v2",
    architecture: "DeepseekV2ForCausalLM",
    reference: "https://github.com/huggingface/transformers/blob/main/src/transformers/models/deepseek_v2/modeling_deepseek_v2.py",
    expert_width_key: "moe_intermediate_size",
    num_experts_keys: &["n_routed_experts"],
    dense_width_key: Some("intermediate_size"),
    dense_layers: DenseLayerRule::FirstKDense,
    renormalize_topk: Flag::Fixed(false),
    qk_norm: QkNorm::None,
    qk_norm_on: Flag::Fixed(false),
    partial_rotary: false,
    router: RouterRule::SoftmaxGroupLimited,
    attention: AttentionKind::Mla,
    yarn_softmax_mscale: true,
    qkv_bias: Flag::Fixed(false),
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
