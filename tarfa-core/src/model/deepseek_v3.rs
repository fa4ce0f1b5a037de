//! DeepSeek-V3 (DeepSeek-V3/V3.1/R1 as BF16 conversions, Kimi K2, Moonlight), following
//! transformers' `modeling_deepseek_v3.py`
//! (<https://github.com/huggingface/transformers/blob/main/src/transformers/models/deepseek_v3/modeling_deepseek_v3.py>):
//! multi-head latent attention (q through `q_a_proj`, `q_a_layernorm`, `q_b_proj`, or a plain
//! `q_proj` when `q_lora_rank` is null; `kv_a_proj_with_mqa` into a latent and one shared rope
//! key, `kv_a_layernorm`, `kv_b_proj` into per-head nope-keys and values), rotary embedding on
//! the `qk_rope_head_dim` part only (de-interleaved first when `rope_interleave`), the softmax
//! scale `qk_head_dim^-0.5` times YaRN's `mscale(factor, mscale_all_dim)^2`; the first
//! `first_k_dense_replace` layers dense; the sigmoid router with `e_score_correction_bias`,
//! group-limited (`n_group`, `topk_group`), weights renormalised when `norm_topk_prob`, times
//! `routed_scaling_factor`; `n_shared_experts` shared experts added ungated.
//!
//! This file only describes the family; it must never contain arithmetic.

use super::{
    AttentionKind, DenseLayerRule, Family, FamilyExtras, Flag, QkNorm, RouterRule,
    SharedExpertRule, TensorNames,
};

/// The DeepSeek-V3 family.
pub static DEEPSEEK_V3: Family = Family {
    model_type: "deepseek_v3",
    architecture: "DeepseekV3ForCausalLM",
    reference: "https://github.com/huggingface/transformers/blob/main/src/transformers/models/deepseek_v3/modeling_deepseek_v3.py",
    expert_width_key: "moe_intermediate_size",
    num_experts_keys: &["n_routed_experts"],
    dense_width_key: Some("intermediate_size"),
    dense_layers: DenseLayerRule::FirstKDense,
    // DeepseekV3Config's default is true.
    renormalize_topk: Flag::Config("norm_topk_prob", true),
    qk_norm: QkNorm::None,
    qk_norm_on: Flag::Fixed(false),
    partial_rotary: false,
    router: RouterRule::SigmoidGroupLimited,
    attention: AttentionKind::Mla,
    yarn_softmax_mscale: true,
    // MLA's projections carry a bias only under `attention_bias`, which the config parser
    // refuses by name for this attention (no release sets it).
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
