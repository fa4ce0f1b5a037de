//! Mixtral, following transformers' `modeling_mixtral.py`
//! (<https://github.com/huggingface/transformers/blob/main/src/transformers/models/mixtral/modeling_mixtral.py>):
//! no biases, no q/k norm, every layer MoE, a softmax router whose top-k is always renormalised,
//! experts named `block_sparse_moe.experts.E.w1` (gate), `w3` (up), `w2` (down).
//!
//! This file only describes the family; it must never contain arithmetic.

use super::{
    AttentionKind, DenseLayerRule, Family, FamilyExtras, Flag, QkNorm, RouterRule, TensorNames,
};

/// The Mixtral family.
pub static MIXTRAL: Family = Family {
    model_type: "mixtral",
    architecture: "MixtralForCausalLM",
    reference: "https://github.com/huggingface/transformers/blob/main/src/transformers/models/mixtral/modeling_mixtral.py",
    expert_width_key: "intermediate_size",
    num_experts_keys: &["num_local_experts", "num_experts"],
    dense_width_key: None,
    dense_layers: DenseLayerRule::None,
    renormalize_topk: Flag::Fixed(true),
    qk_norm: QkNorm::None,
    qk_norm_on: Flag::Fixed(true),
    partial_rotary: false,
    router: RouterRule::SoftmaxTopK,
    attention: AttentionKind::Gqa,
    yarn_softmax_mscale: false,
    qkv_bias: Flag::Fixed(false),
    o_bias: Flag::Fixed(false),
    shared_expert: None,
    extras: FamilyExtras::NONE,
    names: TensorNames {
        router: "model.layers.{l}.block_sparse_moe.gate.weight",
        expert_gate: "model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight",
        expert_up: "model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight",
        expert_down: "model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight",
        ..TensorNames::HF_DEFAULT
    },
};
