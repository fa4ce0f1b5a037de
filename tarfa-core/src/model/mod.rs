//! A family-agnostic description of MoE decoders: which norms, biases, router rule, shared
//! expert and tensor names a family uses. A family is one small file holding one [`Family`]
//! value; [`ArchSpec`] is that description resolved against a parsed config (which layers are
//! dense, whether top-k is renormalised, ...). The CPU forward (and later the GPU one) reads only
//! the `ArchSpec`, never a family name.
//!
//! This module must never hold weights or compute anything; it only describes. It must never
//! import [`crate::config`] either: the config parser reads the families from here, so the
//! arrow points from config to model only, and [`ArchSpec::new`] (which needs a parsed config)
//! is implemented in `config.rs`.

pub mod deepseek_v2;
pub mod deepseek_v3;
pub mod glm4_moe;
pub mod gpt_oss;
pub mod llama4;
pub mod mixtral;
pub mod olmoe;
pub mod qwen2_moe;
pub mod qwen3_5_moe;
pub mod qwen3_moe;
pub mod qwen3_next;

/// Every family this build knows, looked up by the config's `model_type`.
pub const FAMILIES: &[&Family] = &[
    &qwen3_moe::QWEN3_MOE,
    &qwen2_moe::QWEN2_MOE,
    &mixtral::MIXTRAL,
    &olmoe::OLMOE,
    &glm4_moe::GLM4_MOE,
    &deepseek_v3::DEEPSEEK_V3,
    &deepseek_v2::DEEPSEEK_V2,
    &gpt_oss::GPT_OSS,
    &llama4::LLAMA4_TEXT,
    &qwen3_next::QWEN3_NEXT,
    &qwen3_5_moe::QWEN3_5_MOE_TEXT,
];

/// The family whose `model_type` is `model_type`.
pub fn family_by_model_type(model_type: &str) -> Option<&'static Family> {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.model_type == model_type)
}

/// Where q/k RMSNorm is applied after the projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    /// No q/k norm (Mixtral, Qwen2-MoE).
    None,
    /// One RMSNorm of width head_dim applied to every head (Qwen3-MoE).
    PerHead,
    /// One RMSNorm over the whole projection, Hq*D for q and Hkv*D for k (OLMoE).
    WholeProjection,
    /// Llama 4: an L2 norm without weight (`x * rsqrt(mean(x^2) + eps)`) of every head of q and
    /// k, after the rotary embedding, on the layers that rotate only (NoPE layers have none).
    L2AfterRope,
}

/// A boolean that a family fixes or reads from its config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flag {
    /// Always this value.
    Fixed(bool),
    /// The config key, and the value when it is absent.
    Config(&'static str, bool),
}

/// Which layers use a dense MLP instead of the MoE block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DenseLayerRule {
    /// Every layer is MoE (Mixtral, OLMoE).
    None,
    /// transformers' Qwen rule: layer `l` is dense when `l` is in `mlp_only_layers` or
    /// `(l + 1) % decoder_sparse_step != 0` (or there are no experts).
    QwenSparseStep,
    /// DeepSeek's and GLM-4.5's rule: layers `0..first_k_dense_replace` are dense, the rest MoE.
    FirstKDense,
    /// Llama 4's rule: layer `l` is MoE when it is in `moe_layers` (absent: every
    /// `interleave_moe_layer_step`-th layer, `step - 1, 2 * step - 1, ...`), dense otherwise.
    MoeLayers,
}

/// How the router turns its logits into the chosen experts and their weights
/// (docs/EXACTNESS.md section 2 and "Sigmoid group-limited routing").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouterRule {
    /// Softmax over every expert, the top-k by probability (ties to the lower id), renormalised
    /// when the spec says so (Qwen, Mixtral, OLMoE).
    SoftmaxTopK,
    /// DeepSeek-V3 / GLM-4.5: sigmoid scores; `score + e_score_correction_bias` chooses (the
    /// best `topk_group` of `n_group` groups by the sum of each group's two best, then the top-k
    /// within them); the weights are the unbiased scores, renormalised when the spec says so,
    /// times `routed_scaling_factor`.
    SigmoidGroupLimited,
    /// DeepSeek-V2: softmax over every expert; `topk_method` `greedy` takes the top-k of the
    /// probabilities, `group_limited_greedy` first keeps the `topk_group` best of `n_group`
    /// groups (each scored by its largest probability) and masks the rest to 0.0; the weights
    /// are the chosen probabilities times `routed_scaling_factor`, never renormalised.
    SoftmaxGroupLimited,
    /// gpt-oss: the router's logits (`W x + b`) choose, the top-k by logit (descending, lower
    /// id first among equals); the weights are the softmax over the k chosen logits only, in
    /// selection order (transformers' `GptOssTopKRouter`).
    TopKThenSoftmax,
    /// Llama 4: the top-k by logit (descending, lower id first among equals); each chosen
    /// expert's score `sigmoid(logit)` multiplies that expert's INPUT (`x * s`), and the
    /// experts' outputs are summed unweighted (transformers' `Llama4Router` / `Llama4TextMoe`).
    SigmoidScalesInput,
}

/// How a family stores each layer's experts in its checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertLayout {
    /// One `[I, H]` gate, `[I, H]` up and `[H, I]` down matrix per expert, each its own tensor
    /// (`expert_gate`, `expert_up`, `expert_down` with `{e}`).
    Separate,
    /// gpt-oss: one tensor per layer for all experts, `gate_up_proj` `[E, H, 2I]` (the input
    /// dimension first, gate and up interleaved by column: column `2j` is gate row `j`, `2j+1`
    /// up row `j`) and `down_proj` `[E, I, H]`, with `gate_up_proj_bias` `[E, 2I]` and
    /// `down_proj_bias` `[E, H]`; or, released in MXFP4, `*_blocks` `[E, rows, cols/32, 16]` and
    /// `*_scales` `[E, rows, cols/32]` in the `[out, in]` orientation (rows 2j / 2j+1 gate / up).
    FusedInterleaved,
    /// Llama 4: `feed_forward.experts.gate_up_proj` `[E, H, 2I]` with gate and up as the two
    /// halves of the columns (`gate_up.chunk(2, dim=-1)`: column `j` is gate row `j`, `I + j`
    /// up row `j`) and `down_proj` `[E, I, H]`; no biases, BF16 only.
    FusedConcatenated,
}

impl ExpertLayout {
    /// For a fused layout, the columns of `gate_up_proj` holding gate row `j` and up row `j`
    /// of an expert of width `i`; None for separate tensors.
    pub fn gate_up_columns(self, j: usize, i: usize) -> Option<(usize, usize)> {
        self.relayout().map(|r| r.gate_up_columns(j, i))
    }

    /// The bundle format's declared permutation of a fused layout's expert slices (one
    /// definition, in jnf-format, for the converter, the verifier and the runtime).
    pub fn relayout(self) -> Option<jnf_format::Relayout> {
        match self {
            ExpertLayout::Separate => None,
            ExpertLayout::FusedInterleaved => Some(jnf_format::Relayout::GateUpInterleavedColumns),
            ExpertLayout::FusedConcatenated => {
                Some(jnf_format::Relayout::GateUpConcatenatedColumns)
            }
        }
    }
}

/// The expert MLP's activation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExpertActivation {
    /// `silu(g) * u`.
    SwiGlu,
    /// gpt-oss: `g' = min(g, limit)`, `u' = clamp(u, -limit, limit)`,
    /// `a = (u' + 1) * (g' * sigmoid(g' * alpha))`.
    ClampedSwiGlu { alpha: f32, limit: f32 },
}

/// What some families add to the common decoder; [`FamilyExtras::NONE`] for the rest.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FamilyExtras {
    /// A learned logit per query head (`sinks`) in every attention softmax's denominator.
    pub attention_sinks: bool,
    /// The config's `layer_types` (`sliding_attention` / `full_attention`) with
    /// `sliding_window` chooses each layer's window.
    pub layer_types: bool,
    /// The router has a bias (`router_linear_bias`): its logits are `W x + b`.
    pub router_bias: bool,
    /// Each expert's gate/up and down projections have biases.
    pub expert_bias: bool,
    /// How the experts are stored.
    pub expert_layout: ExpertLayout,
    /// The expert activation.
    pub activation: ExpertActivation,
    /// Whether `quantization_config.quant_method = "mxfp4"` may hold the experts (released
    /// gpt-oss); every other family refuses a quantization_config.
    pub mxfp4_experts: bool,
    /// Llama 4's attention: the rotary embedding in its complex form (pairs `(x_2i, x_2i+1)`
    /// rotated together, not the two halves), `no_rope_layers` choosing the layers that rotate
    /// (the others are NoPE layers with attention temperature tuning), and `layer_types`
    /// `chunked_attention` layers attending within their `attention_chunk_size` chunk only.
    pub llama4_attention: bool,
    /// The hybrid decoders (Qwen3-Next, Qwen3.5 MoE): `layer_types` `linear_attention` layers
    /// are gated DeltaNet layers projected as this says, the `full_attention` ones gated
    /// attention (below). None for every other family.
    pub linear_attention: Option<LinearProjections>,
    /// Zero-centred RMSNorms: the decoder's norms (input, post-attention, final, q/k) scale by
    /// `1 + w` (transformers' `Qwen3NextRMSNorm`), the f32 sum formed once when the weights
    /// load. The linear layers' gated norm is not one of them.
    pub zero_centered_norms: bool,
    /// Gated attention: `q_proj` yields `2 D` per query head, the query then an output gate;
    /// the attention output is multiplied by `sigmoid(gate)` before `o_proj`.
    pub gated_attention: bool,
}

/// How a gated DeltaNet layer's input projections are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearProjections {
    /// Qwen3-Next: `in_proj_qkvz` `[2 Dk Hk + 2 Dv Hv, H]` grouped by key head (each group
    /// `q (Dk) | k (Dk) | v (Dv r) | z (Dv r)`, `r = Hv / Hk`) and `in_proj_ba` `[2 Hv, H]`
    /// grouped the same way (`b (r) | a (r)`), transformers' `fix_query_key_value_ordering`.
    FusedQkvzBa,
    /// Qwen3.5: `in_proj_qkv` `[2 Dk Hk + Dv Hv, H]` (`q | k | v`, each head-major),
    /// `in_proj_z` `[Dv Hv, H]`, `in_proj_b` and `in_proj_a` `[Hv, H]`.
    Separate,
}

impl FamilyExtras {
    /// None of the extras: the common decoder.
    pub const NONE: FamilyExtras = FamilyExtras {
        attention_sinks: false,
        layer_types: false,
        router_bias: false,
        expert_bias: false,
        expert_layout: ExpertLayout::Separate,
        activation: ExpertActivation::SwiGlu,
        mxfp4_experts: false,
        llama4_attention: false,
        linear_attention: None,
        zero_centered_norms: false,
        gated_attention: false,
    };
}

/// How a layer's attention projects and caches (docs/EXACTNESS.md section 6 and "Multi-head
/// latent attention").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKind {
    /// q/k/v projections, grouped-query attention over cached keys and values per KV head.
    Gqa,
    /// DeepSeek's multi-head latent attention: q through an optional LoRA, one latent
    /// (`kv_lora_rank`) and one shared rope key (`qk_rope_head_dim`) per token, cached as they
    /// are; the per-head keys and values are the latent through `kv_b_proj`, absorbed.
    Mla,
}

/// The shared experts of a family that has them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharedExpertRule {
    /// Qwen2-MoE: one dense MLP of the width under `width_key`, scaled by
    /// `sigmoid(dot(w_shared_gate, xn))`.
    SigmoidGated { width_key: &'static str },
    /// DeepSeek / GLM-4.5: one dense MLP of width `count_key x` the expert width (the
    /// `n_shared_experts` experts fused), added without a gate after the routed mix.
    Ungated { count_key: &'static str },
    /// Llama 4: one dense MLP of the routed experts' width on the unscaled input, added
    /// without a gate (transformers adds the routed sum to it).
    UngatedExpertWidth,
}

/// Tensor names with `{l}` for the layer index and `{e}` for the expert index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorNames {
    pub embed: &'static str,
    pub final_norm: &'static str,
    /// Absent from the checkpoint when embeddings are tied.
    pub lm_head: &'static str,
    pub input_norm: &'static str,
    pub post_attention_norm: &'static str,
    pub q_proj: &'static str,
    pub k_proj: &'static str,
    pub v_proj: &'static str,
    pub o_proj: &'static str,
    pub q_bias: &'static str,
    pub k_bias: &'static str,
    pub v_bias: &'static str,
    pub o_bias: &'static str,
    pub q_norm: &'static str,
    pub k_norm: &'static str,
    pub router: &'static str,
    /// The router's `e_score_correction_bias` (sigmoid group-limited routing only).
    pub router_bias: &'static str,
    pub expert_gate: &'static str,
    pub expert_up: &'static str,
    pub expert_down: &'static str,
    pub shared_gate_proj: &'static str,
    pub shared_up_proj: &'static str,
    pub shared_down_proj: &'static str,
    pub shared_expert_gate: &'static str,
    pub dense_gate: &'static str,
    pub dense_up: &'static str,
    pub dense_down: &'static str,
    /// Multi-head latent attention (DeepSeek): the q LoRA, or `q_proj` when it has none.
    pub q_a_proj: &'static str,
    pub q_a_norm: &'static str,
    pub q_b_proj: &'static str,
    pub kv_a_proj: &'static str,
    pub kv_a_norm: &'static str,
    pub kv_b_proj: &'static str,
    /// gpt-oss: the router's bias, the attention sinks, and the fused expert tensors
    /// ([`ExpertLayout::FusedInterleaved`]; `{l}` only).
    pub router_linear_bias: &'static str,
    pub sinks: &'static str,
    pub fused_gate_up: &'static str,
    pub fused_gate_up_bias: &'static str,
    pub fused_down: &'static str,
    pub fused_down_bias: &'static str,
    /// Gated DeltaNet layers ([`LinearProjections`]): the input projections, the depthwise
    /// `conv1d` `[C, 1, K]`, `A_log` and `dt_bias` `[Hv]`, the gated norm `[Dv]`, `out_proj`.
    pub lin_qkvz: &'static str,
    pub lin_ba: &'static str,
    pub lin_qkv: &'static str,
    pub lin_z: &'static str,
    pub lin_b: &'static str,
    pub lin_a: &'static str,
    pub lin_conv: &'static str,
    pub lin_a_log: &'static str,
    pub lin_dt_bias: &'static str,
    pub lin_norm: &'static str,
    pub lin_out: &'static str,
}

impl TensorNames {
    /// The Hugging Face Llama-style layout most MoE families share; a family overrides the
    /// fields that differ.
    pub const HF_DEFAULT: TensorNames = TensorNames {
        embed: "model.embed_tokens.weight",
        final_norm: "model.norm.weight",
        lm_head: "lm_head.weight",
        input_norm: "model.layers.{l}.input_layernorm.weight",
        post_attention_norm: "model.layers.{l}.post_attention_layernorm.weight",
        q_proj: "model.layers.{l}.self_attn.q_proj.weight",
        k_proj: "model.layers.{l}.self_attn.k_proj.weight",
        v_proj: "model.layers.{l}.self_attn.v_proj.weight",
        o_proj: "model.layers.{l}.self_attn.o_proj.weight",
        q_bias: "model.layers.{l}.self_attn.q_proj.bias",
        k_bias: "model.layers.{l}.self_attn.k_proj.bias",
        v_bias: "model.layers.{l}.self_attn.v_proj.bias",
        o_bias: "model.layers.{l}.self_attn.o_proj.bias",
        q_norm: "model.layers.{l}.self_attn.q_norm.weight",
        k_norm: "model.layers.{l}.self_attn.k_norm.weight",
        router: "model.layers.{l}.mlp.gate.weight",
        router_bias: "model.layers.{l}.mlp.gate.e_score_correction_bias",
        expert_gate: "model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
        expert_up: "model.layers.{l}.mlp.experts.{e}.up_proj.weight",
        expert_down: "model.layers.{l}.mlp.experts.{e}.down_proj.weight",
        shared_gate_proj: "model.layers.{l}.mlp.shared_expert.gate_proj.weight",
        shared_up_proj: "model.layers.{l}.mlp.shared_expert.up_proj.weight",
        shared_down_proj: "model.layers.{l}.mlp.shared_expert.down_proj.weight",
        shared_expert_gate: "model.layers.{l}.mlp.shared_expert_gate.weight",
        dense_gate: "model.layers.{l}.mlp.gate_proj.weight",
        dense_up: "model.layers.{l}.mlp.up_proj.weight",
        dense_down: "model.layers.{l}.mlp.down_proj.weight",
        q_a_proj: "model.layers.{l}.self_attn.q_a_proj.weight",
        q_a_norm: "model.layers.{l}.self_attn.q_a_layernorm.weight",
        q_b_proj: "model.layers.{l}.self_attn.q_b_proj.weight",
        kv_a_proj: "model.layers.{l}.self_attn.kv_a_proj_with_mqa.weight",
        kv_a_norm: "model.layers.{l}.self_attn.kv_a_layernorm.weight",
        kv_b_proj: "model.layers.{l}.self_attn.kv_b_proj.weight",
        router_linear_bias: "model.layers.{l}.mlp.router.bias",
        sinks: "model.layers.{l}.self_attn.sinks",
        fused_gate_up: "model.layers.{l}.mlp.experts.gate_up_proj",
        fused_gate_up_bias: "model.layers.{l}.mlp.experts.gate_up_proj_bias",
        fused_down: "model.layers.{l}.mlp.experts.down_proj",
        fused_down_bias: "model.layers.{l}.mlp.experts.down_proj_bias",
        lin_qkvz: "model.layers.{l}.linear_attn.in_proj_qkvz.weight",
        lin_ba: "model.layers.{l}.linear_attn.in_proj_ba.weight",
        lin_qkv: "model.layers.{l}.linear_attn.in_proj_qkv.weight",
        lin_z: "model.layers.{l}.linear_attn.in_proj_z.weight",
        lin_b: "model.layers.{l}.linear_attn.in_proj_b.weight",
        lin_a: "model.layers.{l}.linear_attn.in_proj_a.weight",
        lin_conv: "model.layers.{l}.linear_attn.conv1d.weight",
        lin_a_log: "model.layers.{l}.linear_attn.A_log",
        lin_dt_bias: "model.layers.{l}.linear_attn.dt_bias",
        lin_norm: "model.layers.{l}.linear_attn.norm.weight",
        lin_out: "model.layers.{l}.linear_attn.out_proj.weight",
    };
}

/// Substitutes `{l}` (and `{e}`) in a name pattern.
pub fn layer_name(pattern: &str, layer: usize) -> String {
    pattern.replace("{l}", &layer.to_string())
}

/// Substitutes `{l}` and `{e}` in an expert tensor name pattern.
pub fn expert_name(pattern: &str, layer: usize, expert: usize) -> String {
    pattern
        .replace("{l}", &layer.to_string())
        .replace("{e}", &expert.to_string())
}

/// What distinguishes one MoE family from another. One `static` per family file.
#[derive(Debug, PartialEq)]
pub struct Family {
    /// The config's `model_type`.
    pub model_type: &'static str,
    /// The transformers class it follows (for messages).
    pub architecture: &'static str,
    /// The transformers source the family file follows.
    pub reference: &'static str,
    /// Config key holding the expert intermediate width.
    pub expert_width_key: &'static str,
    /// Config key holding the number of experts (first present wins).
    pub num_experts_keys: &'static [&'static str],
    /// Config key holding the dense MLP width for dense layers, when the family has them.
    pub dense_width_key: Option<&'static str>,
    /// Which layers are dense.
    pub dense_layers: DenseLayerRule,
    /// Whether the selected top-k probabilities are renormalised to sum to 1.
    pub renormalize_topk: Flag,
    /// q/k norm placement.
    pub qk_norm: QkNorm,
    /// Whether the q/k norm is present (GLM-4.5 reads `use_qk_norm`; the others fix it).
    pub qk_norm_on: Flag,
    /// Whether the config may ask for rotary embedding on a leading fraction of each head
    /// (`partial_rotary_factor`); a family without it refuses a factor other than 1.
    pub partial_rotary: bool,
    /// The router rule.
    pub router: RouterRule,
    /// The attention.
    pub attention: AttentionKind,
    /// Whether a YaRN `mscale_all_dim` also multiplies the softmax scale by
    /// `mscale(factor, mscale_all_dim)^2` (DeepSeek's MLA; transformers' `yarn_apply_mscale`).
    pub yarn_softmax_mscale: bool,
    /// Biases on the q, k, v projections.
    pub qkv_bias: Flag,
    /// Bias on the o projection.
    pub o_bias: Flag,
    /// The shared expert, if the family has one.
    pub shared_expert: Option<SharedExpertRule>,
    /// What the family adds to the common decoder (gpt-oss, Llama 4).
    pub extras: FamilyExtras,
    /// Tensor names.
    pub names: TensorNames,
}

impl Family {
    /// What layer `layer` is under this family's [`DenseLayerRule`], given the config's
    /// `num_experts`, `decoder_sparse_step` and `mlp_only_layers` (transformers reads both keys;
    /// `decoder_sparse_step` alone is not enough), `first_k_dense_replace`, and Llama 4's
    /// resolved `moe_layers`.
    pub fn layer_kind(
        &self,
        layer: usize,
        num_experts: usize,
        decoder_sparse_step: usize,
        mlp_only_layers: &[usize],
        first_k_dense_replace: usize,
        moe_layers: &[usize],
    ) -> MlpKind {
        match self.dense_layers {
            DenseLayerRule::None => MlpKind::Moe,
            DenseLayerRule::MoeLayers => {
                if moe_layers.contains(&layer) {
                    MlpKind::Moe
                } else {
                    MlpKind::Dense
                }
            }
            DenseLayerRule::FirstKDense => {
                if layer < first_k_dense_replace {
                    MlpKind::Dense
                } else {
                    MlpKind::Moe
                }
            }
            DenseLayerRule::QwenSparseStep => {
                let sparse = !mlp_only_layers.contains(&layer)
                    && num_experts > 0
                    && (layer + 1).is_multiple_of(decoder_sparse_step);
                if sparse {
                    MlpKind::Moe
                } else {
                    MlpKind::Dense
                }
            }
        }
    }
}

/// What a layer's MLP is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpKind {
    /// A dense SwiGLU MLP of the config's dense width.
    Dense,
    /// The routed expert block.
    Moe,
}

/// A family resolved against one config: everything the forward needs to know about structure.
#[derive(Clone, Debug)]
pub struct ArchSpec {
    /// The family.
    pub family: &'static Family,
    /// Per layer: dense or MoE.
    pub layers: Vec<MlpKind>,
    /// Renormalise the top-k probabilities.
    pub renormalize_topk: bool,
    /// q/k/v biases present.
    pub qkv_bias: bool,
    /// o bias present.
    pub o_bias: bool,
    /// q/k norm placement.
    pub qk_norm: QkNorm,
    /// A shared expert with a sigmoid gate is present (Qwen2-MoE).
    pub shared_expert: bool,
    /// Ungated shared experts (DeepSeek, GLM-4.5), added after the routed mix.
    pub shared_experts_ungated: bool,
    /// The router rule.
    pub router: RouterRule,
    /// The attention.
    pub attention: AttentionKind,
    /// The family's extras (sinks, biases, fused experts, activation).
    pub extras: FamilyExtras,
    /// Tensor names.
    pub names: TensorNames,
}

impl ArchSpec {
    /// Index of layer `l` among MoE layers (dense layers are not counted), as transformers
    /// numbers its router outputs.
    pub fn moe_index(&self, layer: usize) -> Option<usize> {
        if self.layers.get(layer) != Some(&MlpKind::Moe) {
            return None;
        }
        Some(
            self.layers[..layer]
                .iter()
                .filter(|k| **k == MlpKind::Moe)
                .count(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dense_layer_rule_reads_both_keys() {
        let q = &qwen3_moe::QWEN3_MOE;
        assert_eq!(q.layer_kind(0, 8, 1, &[], 0, &[]), MlpKind::Moe);
        assert_eq!(
            q.layer_kind(0, 8, 1, &[0], 0, &[]),
            MlpKind::Dense,
            "mlp_only_layers"
        );
        assert_eq!(
            q.layer_kind(0, 8, 2, &[], 0, &[]),
            MlpKind::Dense,
            "(0 + 1) % 2 != 0"
        );
        assert_eq!(q.layer_kind(1, 8, 2, &[], 0, &[]), MlpKind::Moe);
        assert_eq!(
            q.layer_kind(1, 0, 1, &[], 0, &[]),
            MlpKind::Dense,
            "no experts"
        );
        // Mixtral has no dense layers, whatever the keys say.
        let m = &mixtral::MIXTRAL;
        assert_eq!(m.layer_kind(0, 8, 2, &[0], 3, &[]), MlpKind::Moe);
        // GLM-4.5: the first first_k_dense_replace layers are dense, whatever the Qwen keys say.
        let g = &glm4_moe::GLM4_MOE;
        assert_eq!(g.layer_kind(0, 8, 2, &[], 1, &[]), MlpKind::Dense);
        assert_eq!(g.layer_kind(1, 8, 2, &[1], 1, &[]), MlpKind::Moe);
        assert_eq!(g.layer_kind(1, 8, 1, &[], 2, &[]), MlpKind::Dense);
        // Llama 4: moe_layers alone decides
        let l4 = &llama4::LLAMA4_TEXT;
        assert_eq!(l4.layer_kind(0, 8, 2, &[0], 1, &[1, 3]), MlpKind::Dense);
        assert_eq!(l4.layer_kind(1, 8, 2, &[1], 2, &[1, 3]), MlpKind::Moe);
    }
}
