//! gpt-oss (gpt-oss-20b, gpt-oss-120b), following transformers' `modeling_gpt_oss.py`
//! (<https://github.com/huggingface/transformers/blob/main/src/transformers/models/gpt_oss/modeling_gpt_oss.py>):
//! GQA with q/k/v/o biases (`attention_bias`) and a learned sink logit per head in every
//! softmax's denominator; `layer_types` alternating sliding-window (`sliding_window`) and full
//! attention; YaRN; every layer MoE; the router is a linear layer with a bias whose top-k logits
//! are softmaxed among themselves; the experts are stored fused per layer (`gate_up_proj`
//! `[E, H, 2I]` interleaved by column, `down_proj` `[E, I, H]`, with biases), or as released in
//! MXFP4 (`*_blocks`, `*_scales`), and use the clamped SwiGLU (alpha 1.702, limit 7.0,
//! `(up + 1)`).
//!
//! This file only describes the family; it must never contain arithmetic.

use super::{
    AttentionKind, DenseLayerRule, ExpertActivation, ExpertLayout, Family, FamilyExtras, Flag,
    QkNorm, RouterRule, TensorNames,
};

/// The gpt-oss family.
pub static GPT_OSS: Family = Family {
    model_type: "gpt_oss",
    architecture: "GptOssForCausalLM",
    reference: "https://github.com/huggingface/transformers/blob/main/src/transformers/models/gpt_oss/modeling_gpt_oss.py",
    expert_width_key: "intermediate_size",
    num_experts_keys: &["num_local_experts"],
    dense_width_key: None,
    dense_layers: DenseLayerRule::None,
    // The softmax over the chosen k already sums to 1; there is nothing to renormalise.
    renormalize_topk: Flag::Fixed(false),
    qk_norm: QkNorm::None,
    qk_norm_on: Flag::Fixed(false),
    partial_rotary: false,
    router: RouterRule::TopKThenSoftmax,
    attention: AttentionKind::Gqa,
    yarn_softmax_mscale: false,
    // GptOssConfig's default is true; the one key biases all four projections.
    qkv_bias: Flag::Config("attention_bias", true),
    o_bias: Flag::Config("attention_bias", true),
    shared_expert: None,
    extras: FamilyExtras {
        attention_sinks: true,
        layer_types: true,
        router_bias: true,
        expert_bias: true,
        expert_layout: ExpertLayout::FusedInterleaved,
        // GptOssExperts' constants (alpha 1.702, limit 7.0; the config's swiglu_limit must agree).
        activation: ExpertActivation::ClampedSwiGlu {
            alpha: 1.702,
            limit: 7.0,
        },
        mxfp4_experts: true,
        llama4_attention: false,
        linear_attention: None,
        zero_centered_norms: false,
        gated_attention: false,
    },
    names: TensorNames {
        router: "model.layers.{l}.mlp.router.weight",
        ..TensorNames::HF_DEFAULT
    },
};
