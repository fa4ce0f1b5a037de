//! Qwen3-MoE, following Hugging Face transformers' `modeling_qwen3_moe.py`
//! (<https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen3_moe/modeling_qwen3_moe.py>):
//! `Qwen3MoeAttention` with a per-head q/k RMSNorm before RoPE and no biases (unless
//! `attention_bias`), `Qwen3MoeSparseMoeBlock` with a softmax router over all experts, native
//! top-k and renormalisation when `norm_topk_prob`, and `Qwen3MoeDecoderLayer` choosing the dense
//! MLP when `layer_idx in mlp_only_layers` or `(layer_idx + 1) % decoder_sparse_step != 0`.
//!
//! This file only describes the family; it must never contain arithmetic.

use super::{
    AttentionKind, DenseLayerRule, Family, FamilyExtras, Flag, QkNorm, RouterRule, TensorNames,
};

/// The Qwen3-MoE family.
pub static QWEN3_MOE: Family = Family {
    model_type: "qwen3_moe",
    architecture: "Qwen3MoeForCausalLM",
    reference: "https://github.com/huggingface/transformers/blob/main/src/transformers/models/qwen3_moe/modeling_qwen3_moe.py",
    expert_width_key: "moe_intermediate_size",
    // transformers 5 writes num_local_experts; Qwen3 releases on the Hub write num_experts
    num_experts_keys: &["num_local_experts", "num_experts"],
    dense_width_key: Some("intermediate_size"),
    dense_layers: DenseLayerRule::QwenSparseStep,
    renormalize_topk: Flag::Config("norm_topk_prob", false),
    qk_norm: QkNorm::PerHead,
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
