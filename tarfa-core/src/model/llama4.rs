//! Llama 4 text (Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E as `Llama4ForCausalLM`),
//! following transformers' `modeling_llama4.py`
//! (<https://github.com/huggingface/transformers/blob/main/src/transformers/models/llama4/modeling_llama4.py>):
//! GQA with the rotary embedding in its complex form (pairs `(x_2i, x_2i+1)`), applied on the
//! layers `no_rope_layers` marks 1; the others are NoPE layers whose queries are scaled by the
//! attention temperature `log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1`
//! (`attn_temperature_tuning`); `use_qk_norm` is a weightless L2 norm of each q and k head after
//! the rotation, on rotating layers only; `layer_types` `chunked_attention` layers attend within
//! their `attention_chunk_size` chunk (`j // C == pos // C`); `moe_layers` (or every
//! `interleave_moe_layer_step`-th layer) are MoE, the rest dense MLPs of `intermediate_size_mlp`;
//! the router takes the top-k logits and each chosen expert's `sigmoid(logit)` scales that
//! expert's input; one ungated shared expert of the expert width is added; the experts are fused
//! per layer (`gate_up_proj` `[E, H, 2I]`, gate and up the two halves of the columns,
//! `down_proj` `[E, I, H]`).
//!
//! This file only describes the family; it must never contain arithmetic.

use super::{
    AttentionKind, DenseLayerRule, ExpertActivation, ExpertLayout, Family, FamilyExtras, Flag,
    QkNorm, RouterRule, SharedExpertRule, TensorNames,
};

/// The Llama 4 text family (`model_type` `llama4_text`).
pub static LLAMA4_TEXT: Family = Family {
    model_type: "llama4_text",
    architecture: "Llama4ForCausalLM",
    reference: "https://github.com/huggingface/transformers/blob/main/src/transformers/models/llama4/modeling_llama4.py",
    expert_width_key: "intermediate_size",
    num_experts_keys: &["num_local_experts"],
    dense_width_key: Some("intermediate_size_mlp"),
    dense_layers: DenseLayerRule::MoeLayers,
    // The sigmoid scores are not normalised; there is nothing to renormalise.
    renormalize_topk: Flag::Fixed(false),
    qk_norm: QkNorm::L2AfterRope,
    // Llama4TextConfig's default is true (Scout); Maverick writes false.
    qk_norm_on: Flag::Config("use_qk_norm", true),
    partial_rotary: false,
    router: RouterRule::SigmoidScalesInput,
    attention: AttentionKind::Gqa,
    yarn_softmax_mscale: false,
    // Llama4TextConfig's default is false; the one key biases all four projections.
    qkv_bias: Flag::Config("attention_bias", false),
    o_bias: Flag::Config("attention_bias", false),
    shared_expert: Some(SharedExpertRule::UngatedExpertWidth),
    extras: FamilyExtras {
        attention_sinks: false,
        layer_types: false,
        router_bias: false,
        expert_bias: false,
        expert_layout: ExpertLayout::FusedConcatenated,
        activation: ExpertActivation::SwiGlu,
        mxfp4_experts: false,
        llama4_attention: true,
        linear_attention: None,
        zero_centered_norms: false,
        gated_attention: false,
    },
    names: TensorNames {
        router: "model.layers.{l}.feed_forward.router.weight",
        shared_gate_proj: "model.layers.{l}.feed_forward.shared_expert.gate_proj.weight",
        shared_up_proj: "model.layers.{l}.feed_forward.shared_expert.up_proj.weight",
        shared_down_proj: "model.layers.{l}.feed_forward.shared_expert.down_proj.weight",
        dense_gate: "model.layers.{l}.feed_forward.gate_proj.weight",
        dense_up: "model.layers.{l}.feed_forward.up_proj.weight",
        dense_down: "model.layers.{l}.feed_forward.down_proj.weight",
        fused_gate_up: "model.layers.{l}.feed_forward.experts.gate_up_proj",
        fused_down: "model.layers.{l}.feed_forward.experts.down_proj",
        ..TensorNames::HF_DEFAULT
    },
};
