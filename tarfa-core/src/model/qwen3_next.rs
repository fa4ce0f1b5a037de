//! Qwen3-Next (Qwen3-Next-80B-A3B), following transformers' `modeling_qwen3_next.py`
//! (<https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen3_next/modeling_qwen3_next.py>):
//! a hybrid decoder whose `layer_types` name `linear_attention` layers (a gated DeltaNet,
//! `Qwen3NextGatedDeltaNet`: `in_proj_qkvz` / `in_proj_ba` grouped by key head, the causal
//! depthwise `conv1d` and silu, the L2 norm of q and k, decay `g = -exp(A_log) *
//! softplus(a + dt_bias)`, `beta = sigmoid(b)`, the delta-rule state per value head, the gated
//! RMSNorm with `z`, `out_proj`) and `full_attention` layers (`Qwen3NextAttention`: `q_proj`
//! doubled for an output gate, a per-head q/k norm, partial rotary, `sigmoid(gate)` on the
//! attention output). Every norm of the decoder is zero-centred (`1 + w`). The MoE block is
//! Qwen2-MoE's: softmax top-k, renormalised when `norm_topk_prob`, plus a shared expert scaled
//! by `sigmoid(shared_expert_gate(x))`; the dense-layer rule is Qwen's. docs/EXACTNESS.md,
//! "Gated DeltaNet", gives the canonical arithmetic.
//!
//! This file only describes the family; it must never contain arithmetic.

use super::{
    AttentionKind, DenseLayerRule, Family, FamilyExtras, Flag, LinearProjections, QkNorm,
    RouterRule, SharedExpertRule, TensorNames,
};

/// The Qwen3-Next family.
pub static QWEN3_NEXT: Family = Family {
    model_type: "qwen3_next",
    architecture: "Qwen3NextForCausalLM",
    reference: "https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen3_next/modeling_qwen3_next.py",
    expert_width_key: "moe_intermediate_size",
    num_experts_keys: &["num_experts"],
    dense_width_key: Some("intermediate_size"),
    dense_layers: DenseLayerRule::QwenSparseStep,
    // Qwen3NextConfig's default is true
    renormalize_topk: Flag::Config("norm_topk_prob", true),
    qk_norm: QkNorm::PerHead,
    qk_norm_on: Flag::Fixed(true),
    partial_rotary: true,
    router: RouterRule::SoftmaxTopK,
    attention: AttentionKind::Gqa,
    yarn_softmax_mscale: false,
    // the one key biases all four projections
    qkv_bias: Flag::Config("attention_bias", false),
    o_bias: Flag::Config("attention_bias", false),
    shared_expert: Some(SharedExpertRule::SigmoidGated {
        width_key: "shared_expert_intermediate_size",
    }),
    extras: HYBRID_EXTRAS,
    names: TensorNames::HF_DEFAULT,
};

/// What both hybrid families add to the common decoder, Qwen3-Next's projections.
pub(super) const HYBRID_EXTRAS: FamilyExtras = FamilyExtras {
    linear_attention: Some(LinearProjections::FusedQkvzBa),
    zero_centered_norms: true,
    gated_attention: true,
    ..FamilyExtras::NONE
};
