//! Deterministic synthetic checkpoints of real MoE shapes, for every benchmark in the project.
//!
//! Weights look like trained ones where it matters for a storage and streaming engine: roughly
//! normal values with a per-matrix scale (so BF16 exponents carry the entropy real weights show,
//! and zstd compresses them about as well), norm weights near one, never zeros or uniform bytes.
//! With `skew > 0`, routers favour some experts over others, as trained routers do: the
//! embeddings carry a few large constant "massive activation" dimensions (as trained LLMs' hidden
//! states do), and each router row gets a per-expert weight on those dimensions.
//!
//! Every tensor's bytes depend only on (seed, tensor name, shape): the Hub layout and a bundle
//! written directly hold identical bytes, so converting one gives the other's hashes.
//!
//! Which tensors exist, with which names and shapes, is never written here: a shape's
//! `config.json` is parsed by tarfa-core's config parser and its tensors are tarfa-core's shape
//! rules for that config, the same rules the runtime loads with and the converter checks with.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;

use half::bf16;
use jnf_format::{Dtype, ExpertExtent, LayoutPlan, MatrixSpec, Relayout, TensorEntry, TensorSpec};
use rayon::prelude::*;
use serde_json::json;

use tarfa_core::config::{ConfigError, MoeConfig};
use tarfa_core::shapes::{
    AttentionRules, DenseMlpRules, ExpertMatrixRule, FusedExpertRules, GqaRules, LayerRules,
    LinearInRules, LinearRules, MlaQueryRules, MlaRules, MlpRules, ModelRules, Need, TensorRule,
};

use crate::bundle::{write_bundle, BundleSpec, CopiedFile, RegionSource, WriteSummary};
use crate::ConvertError;

/// Architecture dimensions of a synthetic model. Its `config.json` ([`SynthShape::config_json`])
/// is parsed by the runtime's own parser, and every tensor comes from the runtime's own shape
/// rules for that config ([`SynthShape::tensors`]), so a synthetic checkpoint can never disagree
/// with what `tarfa-run` loads.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthShape {
    pub name: &'static str,
    pub family: Family,
    pub hidden: u64,
    pub layers: u32,
    /// Routed experts per MoE layer.
    pub experts: u32,
    pub top_k: u32,
    pub expert_width: u64,
    /// The dense MLP width (DeepSeek's and GLM-4.5's first layers; written as
    /// `intermediate_size`).
    pub dense_width: u64,
    pub heads: u64,
    pub kv_heads: u64,
    /// GQA's head width; multi-head latent attention's heads are in [`SynthShape::mla`] and this
    /// is not written for it.
    pub head_dim: u64,
    pub vocab: u64,
    pub rope_theta: f64,
    pub rms_eps: f64,
    pub max_positions: u64,
    pub tie_embeddings: bool,
    /// DeepSeek's and GLM-4.5's MoE block; None for Qwen3-MoE and Mixtral.
    pub routed: Option<RoutedMoe>,
    /// DeepSeek's multi-head latent attention; None for GQA.
    pub mla: Option<MlaShape>,
    /// YaRN rotary scaling, written as the released configs write it (`rope_scaling` with
    /// `"type": "yarn"`); None for plain rotary embedding.
    pub yarn: Option<YarnShape>,
    /// GLM-4.5's attention keys; None for the other families.
    pub glm: Option<GlmAttention>,
    /// gpt-oss's and Llama 4's keys (their experts are fused per layer); None for the others.
    pub fused: Option<FusedShape>,
    /// Qwen3.5 MoE's hybrid keys (gated DeltaNet layers, the shared expert, multimodal rotary
    /// sections); None for the others.
    pub hybrid: Option<HybridShape>,
}

/// Qwen3.5 MoE's keys, as the released text configs write them. Every
/// `full_attention_interval`-th layer is gated full attention and the rest gated DeltaNet
/// (linear) layers, written out as `layer_types` for the shape's layer count, so a model cut
/// with `--layers` keeps the pattern (`--layers 4`: three linear layers, then one full).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HybridShape {
    pub full_attention_interval: u32,
    /// `linear_num_key_heads`, `linear_num_value_heads` (a multiple of it),
    /// `linear_key_head_dim`, `linear_value_head_dim`, `linear_conv_kernel_dim`.
    pub linear_key_heads: u64,
    pub linear_value_heads: u64,
    pub linear_key_dim: u64,
    pub linear_value_dim: u64,
    pub conv_kernel: u64,
    /// `shared_expert_intermediate_size`: the sigmoid-gated shared expert's width.
    pub shared_expert_width: u64,
    /// `rope_parameters.partial_rotary_factor`: the leading fraction of each head that rotates.
    pub partial_rotary_factor: f64,
    /// `rope_parameters.mrope_section` (with `mrope_interleaved: true`): three sections adding
    /// up to half the rotary width, which text positions rotate as plain RoPE.
    pub mrope_section: [u64; 3],
}

impl HybridShape {
    /// Whether layer `l` is a gated DeltaNet layer (`Qwen3_5MoeTextConfig`'s default
    /// `layer_types`: full attention where `(l + 1) % interval == 0`).
    pub fn is_linear(&self, l: u32) -> bool {
        !(l + 1).is_multiple_of(self.full_attention_interval.max(1))
    }
}

/// The keys of the two fused-expert families. Their experts are one `gate_up_proj`
/// `[E, H, 2I]` and one `down_proj` `[E, I, H]` per layer, as released; written directly as a
/// bundle, each expert's slices are re-laid into gate | up | down by the family's declared
/// permutation, exactly as `tarfa-convert` does to the Hub form.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FusedShape {
    /// gpt-oss: `sliding_window` (layers alternate sliding and full, sliding first); Llama 4:
    /// `attention_chunk_size`.
    pub window: u64,
    /// Llama 4's `interleave_moe_layer_step` (every step-th layer MoE, the rest dense MLPs of
    /// `dense_width`, written `intermediate_size_mlp`); 1 for gpt-oss.
    pub moe_step: u32,
    /// The rotary scaling: gpt-oss's YaRN, Llama 4's llama3 `factor`.
    pub rope_factor: f64,
    pub original_max_positions: u64,
    /// gpt-oss only: the experts in the released MXFP4 form (`quantization_config.quant_method
    /// = "mxfp4"`, the fused tensors' `_blocks` and `_scales` as U8), which is what users
    /// stream; `synth --mxfp4`.
    pub mxfp4: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Qwen3Moe,
    Mixtral,
    /// `deepseek_v3`: DeepSeek-V3/V3.1/R1, Kimi K2, Moonlight.
    DeepseekV3,
    /// `deepseek_v2`: DeepSeek-V2, V2-Lite, V2.5.
    DeepseekV2,
    /// `glm4_moe`: GLM-4.5, GLM-4.5-Air.
    Glm4Moe,
    /// `gpt_oss`: gpt-oss-20b, gpt-oss-120b (their BF16 form; the MXFP4 release is not
    /// generated).
    GptOss,
    /// `llama4_text`: Llama 4 Scout's and Maverick's text model.
    Llama4,
    /// `qwen3_5_moe_text`: Qwen3.5 MoE's text model (Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B),
    /// in the per-expert form transformers saves (the releases fuse the experts by rows; the
    /// converter gives both the same extents).
    Qwen3_5Moe,
}

/// The MoE block of DeepSeek and GLM-4.5: dense first layers, shared experts, group-limited
/// routing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoutedMoe {
    /// `first_k_dense_replace` as released. The config gets `min(this, layers - 1)`, so that a
    /// model cut to a few layers with `--layers` keeps at least one MoE layer.
    pub first_k_dense_replace: u32,
    pub n_shared_experts: u32,
    /// `n_group`: the routed experts split into this many equal groups.
    pub n_group: u32,
    pub topk_group: u32,
    pub routed_scaling_factor: f64,
    pub norm_topk_prob: bool,
    /// `topk_method` and `scoring_func` as released (None: the release does not write the key).
    pub topk_method: Option<&'static str>,
    pub scoring_func: Option<&'static str>,
}

/// Multi-head latent attention's dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaShape {
    /// None: a plain `q_proj` (written as `"q_lora_rank": null`).
    pub q_lora_rank: Option<u64>,
    pub kv_lora_rank: u64,
    pub qk_nope_head_dim: u64,
    pub qk_rope_head_dim: u64,
    pub v_head_dim: u64,
    /// `rope_interleave` (None: the release does not write it; DeepSeek-V3's default is true).
    pub rope_interleave: Option<bool>,
}

/// A YaRN `rope_scaling` block.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct YarnShape {
    pub factor: f64,
    pub original_max_position_embeddings: u64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: f64,
    pub mscale_all_dim: f64,
}

/// GLM-4.5's GQA keys.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GlmAttention {
    /// The leading fraction of each head that rotates.
    pub partial_rotary_factor: f64,
    /// Biases on q, k and v.
    pub attention_bias: bool,
    /// A per-head q/k RMSNorm.
    pub use_qk_norm: bool,
}

/// The shapes `--shape` accepts. The released shapes carry their released configs' values;
/// the multi-token-prediction layers that DeepSeek-V3 and GLM-4.5 ship
/// (`num_nextn_predict_layers`) are not generated, since the runtime never runs them.
pub fn shapes() -> Vec<SynthShape> {
    let qwen30 = SynthShape {
        name: "qwen3-30b-a3b",
        family: Family::Qwen3Moe,
        hidden: 2048,
        layers: 48,
        experts: 128,
        top_k: 8,
        expert_width: 768,
        dense_width: 6144,
        heads: 32,
        kv_heads: 4,
        head_dim: 128,
        vocab: 151_936,
        rope_theta: 1_000_000.0,
        rms_eps: 1e-6,
        max_positions: 40_960,
        tie_embeddings: false,
        routed: None,
        mla: None,
        yarn: None,
        glm: None,
        fused: None,
        hybrid: None,
    };
    let qwen235 = SynthShape {
        name: "qwen3-235b-a22b",
        hidden: 4096,
        layers: 94,
        expert_width: 1536,
        dense_width: 12_288,
        heads: 64,
        ..qwen30.clone()
    };
    let mixtral = SynthShape {
        name: "mixtral-8x7b",
        family: Family::Mixtral,
        hidden: 4096,
        layers: 32,
        experts: 8,
        top_k: 2,
        expert_width: 14_336,
        dense_width: 14_336,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        vocab: 32_000,
        rope_theta: 1_000_000.0,
        rms_eps: 1e-5,
        max_positions: 32_768,
        tie_embeddings: false,
        ..qwen30.clone()
    };
    // For tests: every dimension small, some deliberately not multiples of 32.
    let tiny = SynthShape {
        name: "tiny",
        hidden: 96,
        layers: 2,
        experts: 8,
        top_k: 2,
        expert_width: 40,
        dense_width: 80,
        heads: 4,
        kv_heads: 2,
        head_dim: 24,
        vocab: 300,
        max_positions: 512,
        ..qwen30.clone()
    };
    // deepseek-ai/DeepSeek-V3 (and V3.1, R1: the same shape).
    let deepseek_v3 = SynthShape {
        name: "deepseek-v3",
        family: Family::DeepseekV3,
        hidden: 7168,
        layers: 61,
        experts: 256,
        top_k: 8,
        expert_width: 2048,
        dense_width: 18_432,
        heads: 128,
        kv_heads: 128,
        head_dim: 64,
        vocab: 129_280,
        rope_theta: 10_000.0,
        rms_eps: 1e-6,
        max_positions: 163_840,
        tie_embeddings: false,
        routed: Some(RoutedMoe {
            first_k_dense_replace: 3,
            n_shared_experts: 1,
            n_group: 8,
            topk_group: 4,
            routed_scaling_factor: 2.5,
            norm_topk_prob: true,
            topk_method: Some("noaux_tc"),
            scoring_func: Some("sigmoid"),
        }),
        mla: Some(MlaShape {
            q_lora_rank: Some(1536),
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            rope_interleave: Some(true),
        }),
        yarn: Some(YarnShape {
            factor: 40.0,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 1.0,
        }),
        glm: None,
        fused: None,
        hybrid: None,
    };
    // deepseek-ai/DeepSeek-V2-Lite.
    let deepseek_v2_lite = SynthShape {
        name: "deepseek-v2-lite",
        family: Family::DeepseekV2,
        hidden: 2048,
        layers: 27,
        experts: 64,
        top_k: 6,
        expert_width: 1408,
        dense_width: 10_944,
        heads: 16,
        kv_heads: 16,
        head_dim: 64,
        vocab: 102_400,
        rope_theta: 10_000.0,
        rms_eps: 1e-6,
        max_positions: 163_840,
        tie_embeddings: false,
        routed: Some(RoutedMoe {
            first_k_dense_replace: 1,
            n_shared_experts: 2,
            n_group: 1,
            topk_group: 1,
            routed_scaling_factor: 1.0,
            norm_topk_prob: false,
            topk_method: Some("greedy"),
            scoring_func: Some("softmax"),
        }),
        mla: Some(MlaShape {
            q_lora_rank: None,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            rope_interleave: None,
        }),
        yarn: Some(YarnShape {
            factor: 40.0,
            original_max_position_embeddings: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 0.707,
            mscale_all_dim: 0.707,
        }),
        glm: None,
        fused: None,
        hybrid: None,
    };
    // moonshotai/Moonlight-16B-A3B: the DeepSeek-V3 architecture at V2-Lite's size.
    let moonlight = SynthShape {
        name: "moonlight-16b-a3b",
        family: Family::DeepseekV3,
        dense_width: 11_264,
        vocab: 163_840,
        rope_theta: 50_000.0,
        rms_eps: 1e-5,
        max_positions: 8192,
        routed: Some(RoutedMoe {
            first_k_dense_replace: 1,
            n_shared_experts: 2,
            n_group: 1,
            topk_group: 1,
            routed_scaling_factor: 2.446,
            norm_topk_prob: true,
            topk_method: Some("noaux_tc"),
            scoring_func: Some("sigmoid"),
        }),
        yarn: None,
        ..deepseek_v2_lite.clone()
    };
    // zai-org/GLM-4.5-Air.
    let glm_air = SynthShape {
        name: "glm-4.5-air",
        family: Family::Glm4Moe,
        hidden: 4096,
        layers: 46,
        experts: 128,
        top_k: 8,
        expert_width: 1408,
        dense_width: 10_944,
        heads: 96,
        kv_heads: 8,
        head_dim: 128,
        vocab: 151_552,
        rope_theta: 1_000_000.0,
        rms_eps: 1e-5,
        max_positions: 131_072,
        tie_embeddings: false,
        routed: Some(RoutedMoe {
            first_k_dense_replace: 1,
            n_shared_experts: 1,
            n_group: 1,
            topk_group: 1,
            routed_scaling_factor: 1.0,
            norm_topk_prob: true,
            topk_method: None,
            scoring_func: None,
        }),
        mla: None,
        yarn: None,
        glm: Some(GlmAttention {
            partial_rotary_factor: 0.5,
            attention_bias: true,
            use_qk_norm: false,
        }),
        fused: None,
        hybrid: None,
    };
    // For tests, each new family small like `tiny`: one dense layer then one MoE layer, widths
    // that differ wherever the family could confuse two of them (v_head_dim != qk_nope_head_dim).
    let tiny_deepseek_v3 = SynthShape {
        name: "tiny-deepseek-v3",
        hidden: 96,
        layers: 2,
        experts: 8,
        top_k: 2,
        expert_width: 40,
        dense_width: 80,
        heads: 4,
        kv_heads: 4,
        head_dim: 8,
        vocab: 300,
        max_positions: 512,
        routed: Some(RoutedMoe {
            first_k_dense_replace: 1,
            n_shared_experts: 1,
            n_group: 4,
            topk_group: 2,
            routed_scaling_factor: 2.5,
            norm_topk_prob: true,
            topk_method: Some("noaux_tc"),
            scoring_func: Some("sigmoid"),
        }),
        mla: Some(MlaShape {
            q_lora_rank: Some(24),
            kv_lora_rank: 32,
            qk_nope_head_dim: 16,
            qk_rope_head_dim: 8,
            v_head_dim: 12,
            rope_interleave: Some(true),
        }),
        yarn: Some(YarnShape {
            factor: 4.0,
            original_max_position_embeddings: 128,
            ..deepseek_v3.yarn.expect("deepseek-v3 has YaRN")
        }),
        ..deepseek_v3.clone()
    };
    let tiny_deepseek_v2 = SynthShape {
        name: "tiny-deepseek-v2",
        family: Family::DeepseekV2,
        routed: Some(RoutedMoe {
            n_shared_experts: 2,
            ..deepseek_v2_lite.routed.expect("deepseek-v2-lite routes")
        }),
        mla: Some(MlaShape {
            q_lora_rank: None,
            rope_interleave: None,
            ..tiny_deepseek_v3.mla.expect("tiny-deepseek-v3 has MLA")
        }),
        yarn: Some(YarnShape {
            factor: 4.0,
            original_max_position_embeddings: 128,
            ..deepseek_v2_lite.yarn.expect("deepseek-v2-lite has YaRN")
        }),
        ..tiny_deepseek_v3.clone()
    };
    let tiny_glm = SynthShape {
        name: "tiny-glm4-moe",
        hidden: 96,
        layers: 2,
        experts: 8,
        top_k: 2,
        expert_width: 40,
        dense_width: 80,
        heads: 4,
        kv_heads: 2,
        head_dim: 24,
        vocab: 300,
        max_positions: 512,
        ..glm_air.clone()
    };
    // openai/gpt-oss-20b as transformers' GptOssConfig reads its config.json: 24 layers
    // alternating sliding (128) and full attention, 64 query heads and 8 KV heads of 64, 32
    // experts top-4 of width 2880 with biases, attention sinks, YaRN factor 32 over 4096 positions.
    let gpt_oss_20b = SynthShape {
        name: "gpt-oss-20b",
        family: Family::GptOss,
        hidden: 2880,
        layers: 24,
        experts: 32,
        top_k: 4,
        expert_width: 2880,
        // no dense layers; intermediate_size is the expert width
        dense_width: 2880,
        heads: 64,
        kv_heads: 8,
        head_dim: 64,
        vocab: 201_088,
        rope_theta: 150_000.0,
        rms_eps: 1e-5,
        max_positions: 131_072,
        tie_embeddings: false,
        routed: None,
        mla: None,
        yarn: None,
        glm: None,
        fused: Some(FusedShape {
            window: 128,
            moe_step: 1,
            rope_factor: 32.0,
            original_max_positions: 4096,
            mxfp4: false,
        }),
        hybrid: None,
    };
    let gpt_oss_120b = SynthShape {
        name: "gpt-oss-120b",
        layers: 36,
        experts: 128,
        ..gpt_oss_20b.clone()
    };
    // meta-llama/Llama-4-Scout-17B-16E's text_config: 48 layers, every one MoE (step 1), 16
    // experts top-1 of width 8192 plus the shared expert, 40 query heads and 8 KV heads of 128,
    // chunked attention (8192) on the rotating layers, every 4th layer NoPE, llama3 rope
    // scaling factor 16 over 8192 positions.
    let scout = SynthShape {
        name: "llama4-scout",
        family: Family::Llama4,
        hidden: 5120,
        layers: 48,
        experts: 16,
        top_k: 1,
        expert_width: 8192,
        dense_width: 16_384,
        heads: 40,
        kv_heads: 8,
        head_dim: 128,
        vocab: 202_048,
        rope_theta: 500_000.0,
        rms_eps: 1e-5,
        max_positions: 10_485_760,
        tie_embeddings: false,
        routed: None,
        mla: None,
        yarn: None,
        glm: None,
        fused: Some(FusedShape {
            window: 8192,
            moe_step: 1,
            rope_factor: 16.0,
            original_max_positions: 8192,
            mxfp4: false,
        }),
        hybrid: None,
    };
    let tiny_gpt_oss = SynthShape {
        name: "tiny-gpt-oss",
        hidden: 96,
        layers: 2,
        experts: 8,
        top_k: 2,
        // a multiple of 32, as MXFP4's blocks need (--mxfp4)
        expert_width: 64,
        dense_width: 64,
        heads: 4,
        kv_heads: 2,
        head_dim: 24,
        vocab: 300,
        max_positions: 512,
        fused: Some(FusedShape {
            window: 4,
            moe_step: 1,
            rope_factor: 4.0,
            original_max_positions: 128,
            mxfp4: false,
        }),
        ..gpt_oss_20b.clone()
    };
    // Four layers, every second MoE (dense layers 0 and 2), layer 3 NoPE, chunks of 4.
    let tiny_llama4 = SynthShape {
        name: "tiny-llama4",
        hidden: 96,
        layers: 4,
        experts: 8,
        top_k: 1,
        expert_width: 40,
        dense_width: 80,
        heads: 4,
        kv_heads: 2,
        head_dim: 24,
        vocab: 300,
        max_positions: 512,
        fused: Some(FusedShape {
            window: 4,
            moe_step: 2,
            rope_factor: 4.0,
            original_max_positions: 128,
            mxfp4: false,
        }),
        ..scout.clone()
    };
    // Qwen/Qwen3.5-35B-A3B's text_config: 40 layers, three gated DeltaNet layers then one gated
    // full-attention layer; 256 experts top-8 of width 512 plus the sigmoid-gated shared expert
    // of 512; 16 query heads and 2 KV heads of 256, a quarter of each rotating (64 dims:
    // sections 11 + 11 + 10 of its 32 frequencies); linear layers of 16 key heads and 32 value
    // heads of 128, kernel 4.
    let qwen35 = SynthShape {
        name: "qwen3.5-35b-a3b",
        family: Family::Qwen3_5Moe,
        hidden: 2048,
        layers: 40,
        experts: 256,
        top_k: 8,
        expert_width: 512,
        // no dense layers; not written
        dense_width: 512,
        heads: 16,
        kv_heads: 2,
        head_dim: 256,
        vocab: 248_320,
        rope_theta: 10_000_000.0,
        rms_eps: 1e-6,
        max_positions: 262_144,
        tie_embeddings: false,
        routed: None,
        mla: None,
        yarn: None,
        glm: None,
        fused: None,
        hybrid: Some(QWEN3_5_DEFAULT),
    };
    // Four layers (three linear, one full), widths that differ wherever two could be confused:
    // Dk 16 != Dv 12, 2 key heads serving 4 value heads, a shared expert wider than the routed.
    // head_dim 24 x 0.25 = 6 rotary dims: sections 1 + 1 + 1.
    let tiny_qwen35 = SynthShape {
        name: "tiny-qwen3.5-moe",
        hidden: 96,
        layers: 4,
        experts: 8,
        top_k: 2,
        expert_width: 40,
        dense_width: 40,
        heads: 4,
        kv_heads: 2,
        head_dim: 24,
        vocab: 300,
        max_positions: 512,
        hybrid: Some(HybridShape {
            full_attention_interval: 4,
            linear_key_heads: 2,
            linear_value_heads: 4,
            linear_key_dim: 16,
            linear_value_dim: 12,
            conv_kernel: 4,
            shared_expert_width: 48,
            partial_rotary_factor: 0.25,
            mrope_section: [1, 1, 1],
        }),
        ..qwen35.clone()
    };
    vec![
        gpt_oss_20b,
        gpt_oss_120b,
        scout,
        tiny_gpt_oss,
        tiny_llama4,
        qwen30,
        qwen235,
        mixtral,
        tiny,
        deepseek_v3,
        deepseek_v2_lite,
        moonlight,
        glm_air,
        tiny_deepseek_v3,
        tiny_deepseek_v2,
        tiny_glm,
        qwen35,
        tiny_qwen35,
    ]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputFormat {
    /// A Hugging Face checkpoint: sharded safetensors, index, config.json.
    Hub,
    /// A JNF bundle, written directly (no source on disk).
    Bundle,
}

#[derive(Debug, Clone)]
pub struct SynthOptions {
    pub shape: SynthShape,
    pub seed: u64,
    /// 0 = routers independent of the input's massive dimensions; 1 = trained-like skew.
    pub skew: f32,
    pub format: OutputFormat,
    /// Largest shard of the Hub layout.
    pub shard_bytes: u64,
    pub force: bool,
}

/// One tensor of the synthetic model, in Hugging Face state-dict order.
#[derive(Debug, Clone)]
pub struct SynthTensor {
    pub name: String,
    pub shape: Vec<u64>,
    kind: Kind,
    /// (layer, expert) for a routed expert's matrix; its gate, up and down follow each other.
    expert: Option<(u32, u32)>,
    /// The layer of a fused expert tensor (gpt-oss's, Llama 4's `gate_up_proj`, `down_proj`).
    fused: Option<u32>,
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    /// An RMSNorm's weight (which scales by `w`): `1 + 0.1 N(0, 1)`.
    Norm,
    /// A zero-centred RMSNorm's weight (Qwen3-Next, Qwen3.5: the norm scales by `1 + w`):
    /// `0.1 N(0, 1)`, so that the scale `1 + w` is spread as [`Kind::Norm`]'s is.
    ZeroCentredNorm,
    /// A gated DeltaNet's `A_log` `[Hv]`: `ln A` for `A` uniform in [0.01, 16), as transformers
    /// initialises it (`A = uniform(0, 16)`, kept off zero so that the log is finite): the
    /// heads' decay `exp(-A softplus(a + dt_bias))` ranges from slow to fast, none unbounded.
    ALog,
    /// A gated DeltaNet's `dt_bias` `[Hv]`: `1 + 0.1 N(0, 1)`, near transformers' ones.
    DtBias,
    Matrix,
    /// A projection back into the residual stream (o_proj, down_proj), its scale multiplied by
    /// 1/sqrt(2 x layers) as in GPT-2's initialisation, so that the residual stays dominated by
    /// token-specific content and routing stays token-dependent at depth.
    OutProj {
        scale: f32,
    },
    Embedding,
    Router {
        layer: u32,
    },
    /// A bias vector (q/k/v biases, the router's `e_score_correction_bias`): small values
    /// centred on zero, as trained biases are next to their weights, so that they shift without
    /// dominating.
    Bias,
    /// MXFP4 blocks (U8): two random e2m1 codes a byte.
    Mxfp4Blocks,
    /// MXFP4 scales (U8, e8m0): `scale` or one above it, so that every block widens to finite
    /// values of about a BF16 matrix's magnitude (2^-7 x e2m1 values up to 6).
    Mxfp4Scales {
        scale: u8,
    },
}

/// The fused keys a shape of that family without its own [`FusedShape`] gets (the released
/// values).
const GPT_OSS_DEFAULT: FusedShape = FusedShape {
    window: 128,
    moe_step: 1,
    rope_factor: 32.0,
    original_max_positions: 4096,
    mxfp4: false,
};
const LLAMA4_DEFAULT: FusedShape = FusedShape {
    window: 8192,
    moe_step: 1,
    rope_factor: 16.0,
    original_max_positions: 8192,
    mxfp4: false,
};

/// The hybrid keys a Qwen3.5 MoE shape without its own [`HybridShape`] gets: Qwen3.5-35B-A3B's.
const QWEN3_5_DEFAULT: HybridShape = HybridShape {
    full_attention_interval: 4,
    linear_key_heads: 16,
    linear_value_heads: 32,
    linear_key_dim: 128,
    linear_value_dim: 128,
    conv_kernel: 4,
    shared_expert_width: 512,
    partial_rotary_factor: 0.25,
    mrope_section: [11, 11, 10],
};

/// How many leading hidden dimensions carry the massive activation. Its value is
/// `MASSIVE_PER_SKEW x skew`, and each router row weighs those dimensions by
/// `ROUTER_SKEW x skew x N(0, 1)` (that expert's popularity).
const MASSIVE_DIMS: u64 = 4;
const MASSIVE_PER_SKEW: f32 = 2.0;
const ROUTER_SKEW: f32 = 0.05;
/// Token embeddings: N(0, 1). Their scale relative to the residual updates (see
/// [`Kind::OutProj`]) is what keeps hidden states, and so routing, token-dependent at depth:
/// with trained-looking 0.02 embeddings and undamped updates, a random model routes every token
/// of a prompt to the same experts (measured: 1 distinct top-8 set over 128 tokens).
const EMBED_SIGMA: f32 = 1.0;

impl SynthShape {
    /// `first_k_dense_replace` as the config writes it: the released value, but at most
    /// `layers - 1`, so that at least one layer is MoE.
    pub fn first_dense_layers(&self) -> u32 {
        self.routed.map_or(0, |r| {
            r.first_k_dense_replace.min(self.layers.saturating_sub(1))
        })
    }

    /// Llama 4's `interleave_moe_layer_step` as the config writes it: the shape's, but at most
    /// `layers`, so that a model cut to fewer layers with `--layers` keeps one MoE layer (as
    /// [`SynthShape::first_dense_layers`] does for DeepSeek).
    fn llama4_moe_step(&self, f: FusedShape) -> u32 {
        f.moe_step.clamp(1, self.layers.max(1))
    }

    /// The expert groups of a group-limited router: (`n_group`, the fewest experts a group may
    /// hold). A sigmoid router scores a group by the sum of its two best, so it needs two.
    pub fn expert_groups(&self) -> Option<(u32, u32)> {
        let r = self.routed?;
        let per_group = match self.family {
            Family::DeepseekV3 | Family::Glm4Moe => 2,
            Family::DeepseekV2
            | Family::Qwen3Moe
            | Family::Mixtral
            | Family::GptOss
            | Family::Llama4
            | Family::Qwen3_5Moe => 1,
        };
        Some((r.n_group, per_group))
    }

    /// The config, parsed and validated by the runtime's own parser.
    pub fn runtime_config(&self) -> Result<MoeConfig, ConfigError> {
        match self.config_json() {
            serde_json::Value::Object(m) => MoeConfig::from_json_object(&m),
            _ => Err(ConfigError::NotAnObject),
        }
    }

    /// Every tensor, in state-dict order (so that a layer's experts spread over shards): the
    /// runtime's rules for [`SynthShape::runtime_config`], each tensor's [`Kind`] from its role.
    pub fn tensors(&self) -> Result<Vec<SynthTensor>, ConfigError> {
        let cfg = self.runtime_config()?;
        Ok(state_dict(
            &ModelRules::for_config(&cfg),
            cfg.family.extras.zero_centered_norms,
        ))
    }

    pub fn config_json(&self) -> serde_json::Value {
        let (arch, model_type) = match self.family {
            Family::Qwen3Moe => ("Qwen3MoeForCausalLM", "qwen3_moe"),
            Family::Mixtral => ("MixtralForCausalLM", "mixtral"),
            Family::DeepseekV3 => ("DeepseekV3ForCausalLM", "deepseek_v3"),
            Family::DeepseekV2 => ("DeepseekV2ForCausalLM", "deepseek_v2"),
            Family::Glm4Moe => ("Glm4MoeForCausalLM", "glm4_moe"),
            Family::GptOss => ("GptOssForCausalLM", "gpt_oss"),
            Family::Llama4 => ("Llama4ForCausalLM", "llama4_text"),
            Family::Qwen3_5Moe => ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
        };
        let mut m = serde_json::Map::new();
        let mut put = |k: &str, v: serde_json::Value| {
            m.insert(k.into(), v);
        };
        // The keys every family shares, in the order the first shapes wrote them (so that their
        // config.json bytes stay the same with or without serde_json's preserve_order).
        put("architectures", json!([arch]));
        put("model_type", json!(model_type));
        put("hidden_size", json!(self.hidden));
        // Qwen3_5MoeTextConfig has no dense MLP, and its rope_theta is in rope_parameters.
        let qwen3_5 = self.family == Family::Qwen3_5Moe;
        if !qwen3_5 {
            put("intermediate_size", json!(self.dense_width));
        }
        put("num_hidden_layers", json!(self.layers));
        put("num_attention_heads", json!(self.heads));
        put("num_key_value_heads", json!(self.kv_heads));
        if self.mla.is_none() {
            put("head_dim", json!(self.head_dim));
        }
        put("vocab_size", json!(self.vocab));
        put("num_experts_per_tok", json!(self.top_k));
        put("rms_norm_eps", json!(self.rms_eps));
        if !qwen3_5 {
            put("rope_theta", json!(self.rope_theta));
        }
        put("max_position_embeddings", json!(self.max_positions));
        put("tie_word_embeddings", json!(self.tie_embeddings));
        put("hidden_act", json!("silu"));
        put(
            "attention_bias",
            json!(self.glm.is_some_and(|g| g.attention_bias)),
        );
        put("torch_dtype", json!("bfloat16"));
        put("bos_token_id", json!(null));
        put("eos_token_id", json!(null));
        match self.family {
            Family::Qwen3Moe => {
                put("num_experts", json!(self.experts));
                put("moe_intermediate_size", json!(self.expert_width));
                put("norm_topk_prob", json!(true));
                put("decoder_sparse_step", json!(1));
                put("mlp_only_layers", json!([]));
            }
            Family::Mixtral => {
                put("num_local_experts", json!(self.experts));
                put("intermediate_size", json!(self.expert_width));
            }
            Family::DeepseekV3 | Family::DeepseekV2 | Family::Glm4Moe => {
                put("n_routed_experts", json!(self.experts));
                put("moe_intermediate_size", json!(self.expert_width));
            }
            Family::GptOss => {
                let f = self.fused.unwrap_or(GPT_OSS_DEFAULT);
                put("num_local_experts", json!(self.experts));
                put("intermediate_size", json!(self.expert_width));
                put("attention_bias", json!(true));
                put("sliding_window", json!(f.window));
                let types: Vec<&str> = (0..self.layers)
                    .map(|l| {
                        if l % 2 == 0 {
                            "sliding_attention"
                        } else {
                            "full_attention"
                        }
                    })
                    .collect();
                put("layer_types", json!(types));
                put("swiglu_limit", json!(7.0));
                if f.mxfp4 {
                    // As openai/gpt-oss-20b's config.json writes it.
                    put(
                        "quantization_config",
                        json!({
                            "quant_method": "mxfp4",
                            "modules_to_not_convert": [
                                "model.layers.*.self_attn",
                                "model.layers.*.mlp.router",
                                "model.embed_tokens",
                                "lm_head"
                            ],
                        }),
                    );
                }
                put(
                    "rope_scaling",
                    json!({
                        "rope_type": "yarn",
                        "factor": f.rope_factor,
                        "original_max_position_embeddings": f.original_max_positions,
                        "beta_fast": 32.0,
                        "beta_slow": 1.0,
                        "truncate": false,
                    }),
                );
            }
            Family::Llama4 => {
                let f = self.fused.unwrap_or(LLAMA4_DEFAULT);
                put("num_local_experts", json!(self.experts));
                put("intermediate_size", json!(self.expert_width));
                put("intermediate_size_mlp", json!(self.dense_width));
                put("interleave_moe_layer_step", json!(self.llama4_moe_step(f)));
                put("attention_chunk_size", json!(f.window));
                put("no_rope_layer_interval", json!(4));
                put("use_qk_norm", json!(true));
                put("attn_temperature_tuning", json!(true));
                put("floor_scale", json!(8192));
                put("attn_scale", json!(0.1));
                put(
                    "rope_scaling",
                    json!({
                        "rope_type": "llama3",
                        "factor": f.rope_factor,
                        "low_freq_factor": 1.0,
                        "high_freq_factor": 1.0,
                        "original_max_position_embeddings": f.original_max_positions,
                    }),
                );
            }
            Family::Qwen3_5Moe => {
                let x = self.hybrid.unwrap_or(QWEN3_5_DEFAULT);
                put("num_experts", json!(self.experts));
                put("moe_intermediate_size", json!(self.expert_width));
                put(
                    "shared_expert_intermediate_size",
                    json!(x.shared_expert_width),
                );
                let types: Vec<&str> = (0..self.layers)
                    .map(|l| {
                        if x.is_linear(l) {
                            "linear_attention"
                        } else {
                            "full_attention"
                        }
                    })
                    .collect();
                put("layer_types", json!(types));
                put("full_attention_interval", json!(x.full_attention_interval));
                put("linear_num_key_heads", json!(x.linear_key_heads));
                put("linear_num_value_heads", json!(x.linear_value_heads));
                put("linear_key_head_dim", json!(x.linear_key_dim));
                put("linear_value_head_dim", json!(x.linear_value_dim));
                put("linear_conv_kernel_dim", json!(x.conv_kernel));
                // As the released text configs write the rotary keys: in rope_parameters only. The
                // multi-token-prediction keys are not written: the module is not generated (the
                // converter would skip it, and the runtime never runs it).
                put(
                    "rope_parameters",
                    json!({
                        "rope_type": "default",
                        "rope_theta": self.rope_theta,
                        "partial_rotary_factor": x.partial_rotary_factor,
                        "mrope_section": x.mrope_section,
                        "mrope_interleaved": true,
                    }),
                );
            }
        }
        if let Some(r) = self.routed {
            put("first_k_dense_replace", json!(self.first_dense_layers()));
            put("n_shared_experts", json!(r.n_shared_experts));
            put("n_group", json!(r.n_group));
            put("topk_group", json!(r.topk_group));
            put("routed_scaling_factor", json!(r.routed_scaling_factor));
            put("norm_topk_prob", json!(r.norm_topk_prob));
            if let Some(t) = r.topk_method {
                put("topk_method", json!(t));
            }
            if let Some(s) = r.scoring_func {
                put("scoring_func", json!(s));
            }
        }
        if let Some(a) = self.mla {
            // DeepSeek's own code reads it; 1 (every layer past the dense ones) as released.
            put("moe_layer_freq", json!(1));
            put("q_lora_rank", json!(a.q_lora_rank));
            put("kv_lora_rank", json!(a.kv_lora_rank));
            put("qk_nope_head_dim", json!(a.qk_nope_head_dim));
            put("qk_rope_head_dim", json!(a.qk_rope_head_dim));
            put("v_head_dim", json!(a.v_head_dim));
            if let Some(i) = a.rope_interleave {
                put("rope_interleave", json!(i));
            }
        }
        if let Some(y) = self.yarn {
            put(
                "rope_scaling",
                json!({
                    "type": "yarn",
                    "factor": y.factor,
                    "original_max_position_embeddings": y.original_max_position_embeddings,
                    "beta_fast": y.beta_fast,
                    "beta_slow": y.beta_slow,
                    "mscale": y.mscale,
                    "mscale_all_dim": y.mscale_all_dim,
                }),
            );
        }
        if let Some(g) = self.glm {
            put("partial_rotary_factor", json!(g.partial_rotary_factor));
            put("use_qk_norm", json!(g.use_qk_norm));
        }
        serde_json::Value::Object(m)
    }

    /// (tensor count, total bytes), computed in closed form with checked arithmetic before any
    /// config is parsed or tensor list built (both are linear in the layer count); `None` when
    /// either overflows a u64, or for a DeepSeek shape without its MLA dimensions. A test holds
    /// it equal to the tensor list of every shape.
    pub fn checked_size(&self) -> Option<(u64, u64)> {
        let (h, e) = (self.hidden, u64::from(self.experts));
        let layers = u64::from(self.layers);
        let (q, kv) = (
            self.heads.checked_mul(self.head_dim)?,
            self.kv_heads.checked_mul(self.head_dim)?,
        );
        // Per layer, attention and the two norms: (tensors, elements).
        let mut att = (2u64, h.checked_mul(2)?);
        let add = |acc: &mut (u64, u64), n: u64, elems: Option<u64>| -> Option<()> {
            acc.0 = acc.0.checked_add(n)?;
            acc.1 = acc.1.checked_add(elems?)?;
            Some(())
        };
        let gqa = |acc: &mut (u64, u64)| -> Option<()> {
            // q, k, v, o
            add(
                acc,
                4,
                q.checked_mul(h)?
                    .checked_add(kv.checked_mul(h)?.checked_mul(2)?)?
                    .checked_add(h.checked_mul(q)?),
            )
        };
        match self.family {
            Family::Qwen3Moe => {
                gqa(&mut att)?;
                add(&mut att, 2, self.head_dim.checked_mul(2))?; // q/k norm, per head
            }
            Family::Mixtral | Family::Llama4 => gqa(&mut att)?,
            // The full-attention layers: gated q_proj [2 q, H] (query and output gate), k, v,
            // o, and the per-head q/k norms.
            Family::Qwen3_5Moe => add(
                &mut att,
                6,
                q.checked_mul(2)?
                    .checked_mul(h)?
                    .checked_add(kv.checked_mul(h)?.checked_mul(2)?)?
                    .checked_add(h.checked_mul(q)?)?
                    .checked_add(self.head_dim.checked_mul(2)?),
            )?,
            Family::GptOss => {
                gqa(&mut att)?;
                // q, k, v, o biases and the sinks (one logit per query head)
                add(
                    &mut att,
                    5,
                    q.checked_add(kv.checked_mul(2)?)?
                        .checked_add(h)?
                        .checked_add(self.heads),
                )?;
            }
            Family::Glm4Moe => {
                gqa(&mut att)?;
                let g = self.glm?;
                if g.attention_bias {
                    add(&mut att, 3, q.checked_add(kv.checked_mul(2)?))?;
                }
                if g.use_qk_norm {
                    add(&mut att, 2, self.head_dim.checked_mul(2))?;
                }
            }
            Family::DeepseekV3 | Family::DeepseekV2 => {
                let m = self.mla?;
                let qo = self
                    .heads
                    .checked_mul(m.qk_nope_head_dim.checked_add(m.qk_rope_head_dim)?)?;
                match m.q_lora_rank {
                    None => add(&mut att, 1, qo.checked_mul(h))?,
                    // q_a, q_a_layernorm, q_b
                    Some(rq) => add(
                        &mut att,
                        3,
                        rq.checked_mul(h)?
                            .checked_add(rq)?
                            .checked_add(qo.checked_mul(rq)?),
                    )?,
                }
                let r = m.kv_lora_rank;
                let kv_a = r.checked_add(m.qk_rope_head_dim)?.checked_mul(h)?;
                let kv_b = self
                    .heads
                    .checked_mul(m.qk_nope_head_dim.checked_add(m.v_head_dim)?)?
                    .checked_mul(r)?;
                let o = h.checked_mul(self.heads.checked_mul(m.v_head_dim)?)?;
                // kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj
                add(
                    &mut att,
                    4,
                    kv_a.checked_add(r)?.checked_add(kv_b)?.checked_add(o),
                )?;
            }
        }
        // An MoE layer's MLP: router, expert matrices, and DeepSeek's / GLM's router bias and
        // shared experts.
        let mut moe = (1u64, e.checked_mul(h)?);
        let expert_elems = e
            .checked_mul(3)?
            .checked_mul(self.expert_width)?
            .checked_mul(h);
        match self.family {
            // Two fused tensors per layer; gpt-oss adds the router's bias and the experts'
            // biases ([E, 2I], [E, H]), Llama 4 its ungated shared expert of the expert width.
            Family::GptOss => {
                // MXFP4: four U8 parts instead (counted in mx_bytes below).
                if self.fused.is_some_and(|f| f.mxfp4) {
                    moe.0 = moe.0.checked_add(4)?;
                } else {
                    add(&mut moe, 2, expert_elems)?;
                }
                let two_i = self.expert_width.checked_mul(2)?;
                add(
                    &mut moe,
                    3,
                    e.checked_add(e.checked_mul(two_i)?)?
                        .checked_add(e.checked_mul(h)?),
                )?;
            }
            Family::Llama4 => {
                add(&mut moe, 2, expert_elems)?;
                add(
                    &mut moe,
                    3,
                    self.expert_width.checked_mul(h)?.checked_mul(3),
                )?;
            }
            _ => add(&mut moe, e.checked_mul(3)?, expert_elems)?,
        }
        if let Some(r) = self.routed {
            if matches!(self.family, Family::DeepseekV3 | Family::Glm4Moe) {
                add(&mut moe, 1, Some(e))?; // e_score_correction_bias
            }
            let s = u64::from(r.n_shared_experts).checked_mul(self.expert_width)?;
            add(&mut moe, 3, s.checked_mul(h)?.checked_mul(3))?;
        }
        // Qwen3.5: the sigmoid-gated shared expert (gate, up, down of width S, the gate [1, H]).
        if let Some(x) = self.hybrid {
            let s = x.shared_expert_width;
            add(
                &mut moe,
                4,
                s.checked_mul(h)?.checked_mul(3)?.checked_add(h),
            )?;
        }
        // A gated DeltaNet layer in place of attention, with the same two norms: in_proj_qkv
        // [2 Kw + Vw, H], in_proj_z [Vw, H], in_proj_b and in_proj_a [Hv, H], conv1d
        // [2 Kw + Vw, 1, K], A_log and dt_bias [Hv], the gated norm [Dv], out_proj [H, Vw].
        let (linear_layers, linear) = match self.hybrid {
            None => (0, (0u64, 0u64)),
            Some(x) => {
                let n = (0..self.layers).filter(|&l| x.is_linear(l)).count() as u64;
                let kw = x.linear_key_heads.checked_mul(x.linear_key_dim)?;
                let vw = x.linear_value_heads.checked_mul(x.linear_value_dim)?;
                let hv = x.linear_value_heads;
                let conv = kw.checked_mul(2)?.checked_add(vw)?;
                let elems = conv
                    .checked_mul(h)?
                    .checked_add(vw.checked_mul(h)?)?
                    .checked_add(hv.checked_mul(h)?.checked_mul(2)?)?
                    .checked_add(conv.checked_mul(x.conv_kernel)?)?
                    .checked_add(hv.checked_mul(2)?)?
                    .checked_add(x.linear_value_dim)?
                    .checked_add(h.checked_mul(vw)?)?;
                (n, (11, elems.checked_add(h.checked_mul(2)?)?))
            }
        };
        let full_layers = layers.checked_sub(linear_layers)?;
        let dense = (3u64, self.dense_width.checked_mul(h)?.checked_mul(3)?);
        let dense_layers = match (self.family, self.fused) {
            // Llama 4: layers step - 1, 2 step - 1, ... are MoE (Llama4TextConfig's default
            // moe_layers), layers / step of them.
            (Family::Llama4, Some(f)) => {
                layers.checked_sub(layers / u64::from(self.llama4_moe_step(f)))?
            }
            _ => u64::from(self.first_dense_layers()),
        };
        let moe_layers = layers.checked_sub(dense_layers)?;
        let mut total = (0u64, 0u64);
        add(
            &mut total,
            att.0.checked_mul(full_layers)?,
            att.1.checked_mul(full_layers),
        )?;
        add(
            &mut total,
            linear.0.checked_mul(linear_layers)?,
            linear.1.checked_mul(linear_layers),
        )?;
        add(
            &mut total,
            moe.0.checked_mul(moe_layers)?,
            moe.1.checked_mul(moe_layers),
        )?;
        add(
            &mut total,
            dense.0.checked_mul(dense_layers)?,
            dense.1.checked_mul(dense_layers),
        )?;
        // embedding, final norm, lm_head unless tied
        let heads_out = if self.tie_embeddings { 1 } else { 2 };
        add(
            &mut total,
            heads_out + 1,
            self.vocab
                .checked_mul(h)?
                .checked_mul(heads_out)?
                .checked_add(h),
        )?;
        // gpt-oss's MXFP4 experts, per MoE layer: blocks [E, 2I, H/32, 16] and scales
        // [E, 2I, H/32] of gate_up, blocks [E, H, I/32, 16] and scales [E, H, I/32] of down.
        let mx_bytes = if self.family == Family::GptOss && self.fused.is_some_and(|f| f.mxfp4) {
            let (i, g) = (self.expert_width, 17u64); // 16 block bytes + 1 scale a group
            let gu = i.checked_mul(2)?.checked_mul(h / 32)?.checked_mul(g)?;
            let dn = h.checked_mul(i / 32)?.checked_mul(g)?;
            e.checked_mul(gu.checked_add(dn)?)?
                .checked_mul(moe_layers)?
        } else {
            0
        };
        Some((total.0, total.1.checked_mul(2)?.checked_add(mx_bytes)?))
    }

    /// Total bytes of all tensors.
    pub fn total_bytes(&self) -> Result<u64, ConfigError> {
        Ok(self.tensors()?.iter().map(SynthTensor::len_bytes).sum())
    }
}

/// The state dict of a model of these rules: the embedding; per layer its input norm, attention
/// (each bias after its weight), post-attention norm, then its MLP (the router, its bias and
/// the shared experts before the routed experts, so that a layer's experts lie together and
/// spread over shards); the final norm and the lm_head. Each tensor's [`Kind`] is the role its
/// rule plays. The rules are destructured field by field, so that a tensor a new tarfa-core adds
/// is a compile error here rather than a silently missing tensor. `zero_centred_norms`: the
/// decoder's norms scale by `1 + w` (Qwen3-Next, Qwen3.5), so their weights are drawn near zero.
fn state_dict(rules: &ModelRules, zero_centred_norms: bool) -> Vec<SynthTensor> {
    // The input, post-attention, final and q/k norms; not MLA's latent norms (no zero-centred
    // family has them) nor a gated DeltaNet's gated norm (a plain `w`).
    let decoder_norm = if zero_centred_norms {
        Kind::ZeroCentredNorm
    } else {
        Kind::Norm
    };
    let out_proj = Kind::OutProj {
        scale: 1.0 / (2.0 * rules.layers.len().max(1) as f32).sqrt(),
    };
    let t = |rule: &TensorRule, kind: Kind| SynthTensor {
        name: rule.name.clone(),
        shape: rule.shape.iter().map(|&d| d as u64).collect(),
        kind,
        expert: None,
        fused: None,
    };
    let dense = |d: &DenseMlpRules| {
        let DenseMlpRules { gate, up, down } = d;
        [
            t(gate, Kind::Matrix),
            t(up, Kind::Matrix),
            t(down, out_proj),
        ]
    };
    let experts: Vec<ExpertMatrixRule> = rules.expert_matrices().collect();
    // ModelRules::expert_matrices: gate, up, down per expert, experts ascending within a layer,
    // layers ascending.
    let mut triples = experts.chunks_exact(3).peekable();

    let mut out = vec![t(&rules.embed, Kind::Embedding)];
    for (l, layer) in rules.layers.iter().enumerate() {
        let LayerRules {
            input_norm,
            post_attention_norm,
            attention,
            mlp,
        } = layer;
        out.push(t(input_norm, decoder_norm));
        match attention {
            AttentionRules::Gqa(GqaRules {
                q_proj,
                k_proj,
                v_proj,
                o_proj,
                q_bias,
                k_bias,
                v_bias,
                o_bias,
                q_norm,
                k_norm,
                sinks,
            }) => {
                for (w, b) in [(q_proj, q_bias), (k_proj, k_bias), (v_proj, v_bias)] {
                    out.push(t(w, Kind::Matrix));
                    out.extend(b.iter().map(|b| t(b, Kind::Bias)));
                }
                out.push(t(o_proj, out_proj));
                out.extend(o_bias.iter().map(|b| t(b, Kind::Bias)));
                out.extend(sinks.iter().map(|b| t(b, Kind::Bias)));
                out.extend(
                    [q_norm, k_norm]
                        .into_iter()
                        .flatten()
                        .map(|n| t(n, decoder_norm)),
                );
            }
            AttentionRules::Mla(MlaRules {
                q,
                kv_a_proj,
                kv_a_norm,
                kv_b_proj,
                o_proj,
            }) => {
                match q {
                    MlaQueryRules::Plain(q) => out.push(t(q, Kind::Matrix)),
                    MlaQueryRules::LoRa { a, norm, b } => {
                        out.extend([t(a, Kind::Matrix), t(norm, Kind::Norm), t(b, Kind::Matrix)])
                    }
                }
                out.extend([
                    t(kv_a_proj, Kind::Matrix),
                    t(kv_a_norm, Kind::Norm),
                    t(kv_b_proj, Kind::Matrix),
                    t(o_proj, out_proj),
                ]);
            }
            AttentionRules::Linear(LinearRules {
                input,
                conv,
                a_log,
                dt_bias,
                norm,
                out_proj: o,
            }) => {
                match input {
                    LinearInRules::FusedQkvzBa { qkvz, ba } => {
                        out.extend([t(qkvz, Kind::Matrix), t(ba, Kind::Matrix)])
                    }
                    LinearInRules::Separate { qkv, z, b, a } => out.extend([
                        t(qkv, Kind::Matrix),
                        t(z, Kind::Matrix),
                        t(b, Kind::Matrix),
                        t(a, Kind::Matrix),
                    ]),
                }
                out.extend([
                    t(conv, Kind::Matrix),
                    t(a_log, Kind::ALog),
                    t(dt_bias, Kind::DtBias),
                    t(norm, Kind::Norm),
                    t(o, out_proj),
                ]);
            }
        }
        out.push(t(post_attention_norm, decoder_norm));
        match mlp {
            MlpRules::Dense(d) => out.extend(dense(d)),
            MlpRules::Moe {
                router,
                shared,
                router_bias,
                shared_ungated,
                router_linear_bias,
                expert_bias,
                experts: _,
            } => {
                let layer = l as u32;
                out.push(t(router, Kind::Router { layer }));
                out.extend(router_bias.iter().map(|b| t(b, Kind::Bias)));
                // gpt-oss: the router's linear bias and the fused experts' biases.
                out.extend(router_linear_bias.iter().map(|b| t(b, Kind::Bias)));
                if let Some((gu, d)) = expert_bias {
                    out.extend([t(gu, Kind::Bias), t(d, Kind::Bias)]);
                }
                if let Some((d, gate)) = shared {
                    out.extend(dense(d));
                    out.push(t(gate, Kind::Matrix));
                }
                if let Some(d) = shared_ungated {
                    out.extend(dense(d));
                }
                let mut e = 0u32;
                while let Some(triple) = triples.next_if(|m| m[0].layer == l) {
                    for (m, kind) in triple.iter().zip([Kind::Matrix, Kind::Matrix, out_proj]) {
                        out.push(SynthTensor {
                            name: m.name.clone(),
                            shape: m.shape.iter().map(|&d| d as u64).collect(),
                            kind,
                            expert: Some((layer, e)),
                            fused: None,
                        });
                    }
                    e += 1;
                }
                // Fused experts (gpt-oss, Llama 4): gate_up then down, as released (BF16).
                for f in rules.fused.iter().filter(|f| f.layer() == l) {
                    let mx = matches!(f, FusedExpertRules::Mxfp4 { .. });
                    for (k, rule) in f.tensors().into_iter().enumerate() {
                        let kind = match (mx, k) {
                            (false, 0) => Kind::Matrix,
                            (false, _) => out_proj,
                            (true, 0 | 2) => Kind::Mxfp4Blocks,
                            // down_proj's scale one lower: the residual update kept smaller, as
                            // Kind::OutProj does for BF16.
                            (true, 1) => Kind::Mxfp4Scales { scale: 120 },
                            (true, _) => Kind::Mxfp4Scales { scale: 119 },
                        };
                        out.push(SynthTensor {
                            name: rule.name.clone(),
                            shape: rule.shape.iter().map(|&d| d as u64).collect(),
                            kind,
                            expert: None,
                            fused: Some(layer),
                        });
                    }
                }
            }
        }
    }
    out.push(t(&rules.final_norm, decoder_norm));
    if rules.lm_head.need == Need::Required {
        out.push(t(&rules.lm_head, Kind::Matrix));
    }
    out
}
// ---- deterministic values ----

/// SplitMix64's finaliser: a good 64-bit mix, used as a counter-based generator so that any
/// chunk of any tensor can be generated independently (in parallel) with the same result.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn name_key(seed: u64, name: &str) -> u64 {
    // FNV-1a over the name, then mixed with the seed.
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    mix(h ^ mix(seed))
}

/// An approximately standard normal value from 64 random bits: the sum of four 16-bit uniforms
/// (Irwin-Hall), centred and scaled. Integer arithmetic, then one exact conversion: the same on
/// every machine.
fn normal(bits: u64) -> f32 {
    let s = (bits & 0xffff) + ((bits >> 16) & 0xffff) + ((bits >> 32) & 0xffff) + (bits >> 48);
    (s as f32 - 131_070.0) * (1.0 / 37_837.2)
}

fn uniform01(bits: u64) -> f32 {
    (bits >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
}

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

impl SynthTensor {
    pub fn len_bytes(&self) -> u64 {
        self.shape.iter().product::<u64>() * self.elem_bytes()
    }

    /// 1 for the MXFP4 blocks and scales (U8), 2 for every other tensor (BF16).
    fn elem_bytes(&self) -> u64 {
        if self.is_u8() {
            1
        } else {
            2
        }
    }

    fn is_u8(&self) -> bool {
        matches!(self.kind, Kind::Mxfp4Blocks | Kind::Mxfp4Scales { .. })
    }

    /// Fill `dst` with this tensor's BF16 bytes.
    pub fn fill(&self, seed: u64, skew: f32, dst: &mut [u8]) {
        self.fill_from(seed, skew, 0, dst)
    }

    /// Fill `dst` with this tensor's BF16 bytes from element `start` on (a fused tensor's
    /// expert slice): the same bytes as that range of [`SynthTensor::fill`].
    pub fn fill_from(&self, seed: u64, skew: f32, start: usize, dst: &mut [u8]) {
        let key = name_key(seed, &self.name);
        if let Kind::Mxfp4Blocks | Kind::Mxfp4Scales { .. } = self.kind {
            let kind = self.kind;
            dst.par_iter_mut().enumerate().for_each(|(j, b)| {
                let r = mix(key.wrapping_add(((start + j) as u64).wrapping_mul(GOLDEN)));
                *b = match kind {
                    Kind::Mxfp4Scales { scale } => scale + (r & 1) as u8,
                    _ => (r >> 24) as u8,
                };
            });
            return;
        }
        // A per-matrix scale, like a trained model's: 0.02 x [0.5, 1.5).
        let sigma = 0.02 * (0.5 + uniform01(mix(key ^ 1)));
        let cols = *self.shape.last().unwrap_or(&1) as usize;
        let kind = self.kind;
        let router_shift: Vec<f32> = match kind {
            Kind::Router { layer } => {
                let rows = self.shape[0] as usize;
                let lk = name_key(seed, &format!("router-popularity.{layer}"));
                (0..rows)
                    .map(|e| skew * ROUTER_SKEW * normal(mix(lk ^ (e as u64).wrapping_mul(GOLDEN))))
                    .collect()
            }
            _ => Vec::new(),
        };
        let massive = MASSIVE_PER_SKEW * skew;
        const CHUNK: usize = 1 << 16;
        dst.par_chunks_mut(CHUNK * 2)
            .enumerate()
            .for_each(|(c, out)| {
                let base = start + c * CHUNK;
                for (j, pair) in out.chunks_exact_mut(2).enumerate() {
                    let i = base + j;
                    let r = mix(key.wrapping_add((i as u64).wrapping_mul(GOLDEN)));
                    let v = match kind {
                        Kind::Norm | Kind::DtBias => 1.0 + 0.1 * normal(r),
                        Kind::ZeroCentredNorm => 0.1 * normal(r),
                        // libm's logf: the same bits on every platform.
                        Kind::ALog => libm::logf(0.01 + 15.99 * uniform01(r)),
                        Kind::Matrix | Kind::Bias => sigma * normal(r),
                        Kind::OutProj { scale } => sigma * scale * normal(r),
                        Kind::Embedding => {
                            if ((i % cols) as u64) < MASSIVE_DIMS {
                                massive
                            } else {
                                EMBED_SIGMA * normal(r)
                            }
                        }
                        Kind::Mxfp4Blocks | Kind::Mxfp4Scales { .. } => 0.0, // filled above
                        Kind::Router { .. } => {
                            let (row, col) = (i / cols, i % cols);
                            let shift = if (col as u64) < MASSIVE_DIMS {
                                router_shift[row]
                            } else {
                                0.0
                            };
                            sigma * normal(r) + shift
                        }
                    };
                    pair.copy_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes());
                }
            });
    }
}

/// zstd (level 3) compression ratio of `bytes`.
pub fn zstd_ratio(bytes: &[u8]) -> f64 {
    let c = zstd::bulk::compress(bytes, 3).expect("in-memory compression");
    bytes.len() as f64 / c.len() as f64
}

/// What `synth` wrote.
#[derive(Debug)]
pub struct SynthReport {
    pub bytes: u64,
    pub tensors: usize,
    /// zstd ratio over a sample of expert weights (real BF16 weights give about 1.2 to 1.35).
    pub zstd_ratio: f64,
    pub bundle: Option<WriteSummary>,
}

/// Generate the model described by `opts` into `out`.
pub fn synth(out: &Path, opts: &SynthOptions) -> Result<SynthReport, ConvertError> {
    let shape = &opts.shape;
    let tensors = shape.tensors().map_err(|source| ConvertError::Config {
        file: "config.json".into(),
        source,
    })?;
    let bytes: u64 = tensors.iter().map(SynthTensor::len_bytes).sum();
    // A sample of up to 16 MiB of expert bytes for the compressibility figure (every shape has
    // an MoE layer: the first dense layers stop one short of the last).
    let mut sample = Vec::new();
    if let Some(t) = tensors
        .iter()
        .find(|t| t.expert.is_some() || t.fused.is_some())
    {
        sample = vec![0u8; t.len_bytes().min(16 << 20) as usize];
        t.fill(opts.seed, opts.skew, &mut sample);
    }
    let ratio = zstd_ratio(&sample);

    let config = serde_json::to_vec_pretty(&shape.config_json()).expect("json");
    let generation = serde_json::to_vec_pretty(&json!({"_from_model_config": true})).expect("json");
    let bundle = match opts.format {
        OutputFormat::Hub => {
            write_hub(out, opts, &tensors, &config, &generation)?;
            None
        }
        OutputFormat::Bundle => Some(write_direct(out, opts, &tensors, config, generation)?),
    };
    Ok(SynthReport {
        bytes,
        tensors: tensors.len(),
        zstd_ratio: ratio,
        bundle,
    })
}

struct LazyTensor<'a> {
    t: &'a SynthTensor,
    shape: Vec<usize>,
    seed: u64,
    skew: f32,
}

impl safetensors::View for LazyTensor<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        if self.t.is_u8() {
            safetensors::Dtype::U8
        } else {
            safetensors::Dtype::BF16
        }
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let mut v = vec![0u8; self.t.len_bytes() as usize];
        self.t.fill(self.seed, self.skew, &mut v);
        Cow::Owned(v)
    }
    fn data_len(&self) -> usize {
        self.t.len_bytes() as usize
    }
}

fn write_hub(
    out: &Path,
    opts: &SynthOptions,
    tensors: &[SynthTensor],
    config: &[u8],
    generation: &[u8],
) -> Result<(), ConvertError> {
    if out.exists() {
        if !opts.force {
            return Err(ConvertError::TargetExists(out.to_path_buf()));
        }
        if let Some(why) = not_a_hub_checkpoint(out) {
            return Err(ConvertError::NotABundle {
                target: out.to_path_buf(),
                why,
            });
        }
        std::fs::remove_dir_all(out).map_err(ConvertError::io(out, "remove"))?;
    }
    std::fs::create_dir_all(out).map_err(ConvertError::io(out, "create directory"))?;
    // Greedy shards in state-dict order.
    let mut shards: Vec<Vec<&SynthTensor>> = vec![Vec::new()];
    let mut size = 0u64;
    for t in tensors {
        if size > 0 && size + t.len_bytes() > opts.shard_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        size += t.len_bytes();
        shards.last_mut().expect("non-empty").push(t);
    }
    let n = shards.len();
    let mut weight_map = BTreeMap::new();
    let bar = crate::progress::bytes_bar(tensors.iter().map(SynthTensor::len_bytes).sum(), "synth");
    for (i, group) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
        let views = group.iter().map(|t| {
            (
                t.name.clone(),
                LazyTensor {
                    t,
                    shape: t.shape.iter().map(|&d| d as usize).collect(),
                    seed: opts.seed,
                    skew: opts.skew,
                },
            )
        });
        let meta = Some(
            [("format".to_string(), "pt".to_string())]
                .into_iter()
                .collect(),
        );
        let path = out.join(&file);
        safetensors::serialize_to_file(views, meta, &path).map_err(|e| ConvertError::Io {
            path: path.clone(),
            op: "write shard",
            source: std::io::Error::other(e),
        })?;
        for t in group {
            weight_map.insert(t.name.clone(), file.clone());
            bar.inc(t.len_bytes());
        }
        if crate::interrupted() {
            return Err(ConvertError::Interrupted);
        }
    }
    bar.finish_and_clear();
    let index = json!({"metadata": {"total_size": tensors.iter().map(SynthTensor::len_bytes).sum::<u64>()}, "weight_map": weight_map});
    let write = |name: &str, bytes: &[u8]| {
        let p = out.join(name);
        std::fs::write(&p, bytes).map_err(ConvertError::io(&p, "write"))
    };
    write(
        "model.safetensors.index.json",
        &serde_json::to_vec_pretty(&index).expect("json"),
    )?;
    write("config.json", config)?;
    write("generation_config.json", generation)
}

/// Why `dir` is not something `synth --force` may delete: only a directory of a Hub
/// checkpoint's files (config.json, model.safetensors.index.json, other *.json and
/// *.safetensors, nothing else) is.
fn not_a_hub_checkpoint(dir: &Path) -> Option<&'static str> {
    let Ok(meta) = std::fs::symlink_metadata(dir) else {
        return Some("cannot be read");
    };
    if !meta.is_dir() {
        return Some("is not a directory, so not a synthetic checkpoint");
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Some("cannot be listed");
    };
    let mut has_config = false;
    for e in entries {
        let Ok(e) = e else {
            return Some("cannot be listed");
        };
        let name = e.file_name().to_string_lossy().into_owned();
        let is_file = e.file_type().is_ok_and(|t| t.is_file());
        has_config |= name == "config.json";
        if !is_file || !(name.ends_with(".json") || name.ends_with(".safetensors")) {
            return Some("holds files other than a checkpoint's .json and .safetensors");
        }
    }
    if !has_config {
        return Some("has no config.json, so not a checkpoint");
    }
    None
}

struct SynthSource<'a> {
    by_name: BTreeMap<&'a str, &'a SynthTensor>,
    /// Each fused layer's tensors in extent order, and (BF16) the permutation its slices are
    /// re-laid by; MXFP4 parts are concatenated as released.
    fused: BTreeMap<u32, (Vec<&'a SynthTensor>, Option<Relayout>)>,
    seed: u64,
    skew: f32,
}

impl RegionSource for SynthSource<'_> {
    fn fill_tensor(&self, t: &TensorEntry, dst: &mut [u8]) -> Result<(), ConvertError> {
        self.by_name[t.name.as_str()].fill(self.seed, self.skew, dst);
        Ok(())
    }
    fn fill_expert(&self, e: &ExpertExtent, dst: &mut [u8]) -> Result<(), ConvertError> {
        if let Some((parts, relayout)) = self.fused.get(&e.layer) {
            // Expert e's slices of the fused tensors (E outermost), generated as the Hub form
            // holds them; BF16 then re-laid as the converter re-lays them, MXFP4 as released.
            let slice = |t: &SynthTensor| {
                let per = t.shape[1..].iter().product::<u64>() as usize;
                let mut b = vec![0u8; per * t.elem_bytes() as usize];
                t.fill_from(self.seed, self.skew, e.expert as usize * per, &mut b);
                b
            };
            let slices: Vec<Vec<u8>> = parts.iter().map(|t| slice(t)).collect();
            // [gate_up, down]'s shapes give H and I (a re-laid layer always has the two)
            let (h, i) = match parts.as_slice() {
                [_, d] => (d.shape[2] as usize, d.shape[1] as usize),
                _ => (0, 0),
            };
            return crate::convert::fused_extent(e, *relayout, &slices, h, i, dst);
        }
        for m in &e.matrices {
            let r = m.offset as usize..(m.offset + m.length) as usize;
            self.by_name[m.name.as_str()].fill(self.seed, self.skew, &mut dst[r]);
        }
        Ok(())
    }
}

fn write_direct(
    out: &Path,
    opts: &SynthOptions,
    tensors: &[SynthTensor],
    config: Vec<u8>,
    generation: Vec<u8>,
) -> Result<WriteSummary, ConvertError> {
    let shape = &opts.shape;
    let mut layout = LayoutPlan::new();
    let mut non_expert: Vec<&SynthTensor> = tensors
        .iter()
        .filter(|t| t.expert.is_none() && t.fused.is_none())
        .collect();
    // The same order as a conversion: non-expert tensors sorted by name.
    non_expert.sort_by(|a, b| a.name.cmp(&b.name));
    for t in non_expert {
        layout.add_tensor(TensorSpec {
            name: t.name.clone(),
            dtype: Dtype::BF16,
            shape: t.shape.clone(),
            source: None,
        });
    }
    // Then experts by (layer, expert): the state dict holds each one's gate, up and down in a
    // row, layers and experts ascending.
    let experts: Vec<&SynthTensor> = tensors.iter().filter(|t| t.expert.is_some()).collect();
    for triple in experts.chunks_exact(3) {
        if let [g, u, d] = triple {
            let Some((l, e)) = g.expert else { continue };
            // The expert's source prefix, `model.layers.L.mlp.experts.E`, as a conversion
            // names it: the gate's name without `.gate_proj.weight`.
            let prefix = g.name.rsplitn(3, '.').nth(2).unwrap_or(&g.name).to_string();
            let spec = |t: &SynthTensor| MatrixSpec {
                name: t.name.clone(),
                dtype: Dtype::BF16,
                shape: t.shape.clone(),
                source: None,
            };
            layout.add_expert(l, e, prefix, [spec(g), spec(u), spec(d)]);
        }
    }
    // Fused experts: one extent per (layer, expert), gate | up | down [out, in] named as a
    // conversion names them (`<module>.E.{gate_proj,up_proj,down_proj}`).
    let relayout = shape.runtime_config().ok().and_then(|c| {
        tarfa_core::model::ArchSpec::new(&c)
            .extras
            .expert_layout
            .relayout()
    });
    let mut fused = BTreeMap::new();
    let mut by_layer: BTreeMap<u32, Vec<&SynthTensor>> = BTreeMap::new();
    for t in tensors {
        if let Some(l) = t.fused {
            by_layer.entry(l).or_default().push(t);
        }
    }
    for (l, parts) in by_layer {
        if parts.len() == 4 {
            // MXFP4 as released: each part is expert e's slice of its tensor, named
            // `<module>.E.<tensor>` as a conversion names it.
            let module = parts[0]
                .name
                .strip_suffix(".gate_up_proj_blocks")
                .unwrap_or(&parts[0].name)
                .to_string();
            for e in 0..parts[0].shape[0] as u32 {
                let prefix = format!("{module}.{e}");
                let specs: Vec<MatrixSpec> = parts
                    .iter()
                    .map(|t| MatrixSpec {
                        name: format!("{prefix}.{}", t.name.rsplit('.').next().unwrap_or("")),
                        dtype: Dtype::U8,
                        shape: t.shape[1..].to_vec(),
                        source: None,
                    })
                    .collect();
                let specs: [MatrixSpec; 4] = specs.try_into().expect("four MXFP4 parts");
                layout.add_mxfp4_expert(l, e, prefix, specs);
            }
            fused.insert(l, (parts, None));
            continue;
        }
        // The runtime's rules give a BF16 fused layer exactly gate_up and down, and a fused
        // family a declared permutation; anything else would drop experts, so it is an error.
        let ([gu, d], Some(relayout)) = (parts.as_slice(), relayout) else {
            return Err(ConvertError::Usage(format!(
                "{}: layer {l}'s fused experts are {} tensors without a declared re-layout",
                shape.name,
                parts.len()
            )));
        };
        let (gu, d) = (*gu, *d);
        let (e_count, i, h) = (d.shape[0], d.shape[1], d.shape[2]);
        let module = gu.name.strip_suffix(".gate_up_proj").unwrap_or(&gu.name);
        for e in 0..e_count as u32 {
            let prefix = format!("{module}.{e}");
            let m = |role: &str, shape: Vec<u64>| MatrixSpec {
                name: format!("{prefix}.{role}"),
                dtype: Dtype::BF16,
                shape,
                source: None,
            };
            layout.add_expert(
                l,
                e,
                prefix.clone(),
                [
                    m("gate_proj", vec![i, h]),
                    m("up_proj", vec![i, h]),
                    m("down_proj", vec![h, i]),
                ],
            );
        }
        fused.insert(l, (vec![gu, d], Some(relayout)));
    }
    let converter = format!("tarfa-convert synth {}", env!("CARGO_PKG_VERSION"));
    layout.set_metadata("converter", &converter);
    let header = layout.finish()?;
    let mut source = BTreeMap::new();
    source.insert("kind".into(), "synthetic".into());
    source.insert("shape".into(), shape.name.into());
    source.insert("layers".into(), shape.layers.to_string());
    source.insert("experts".into(), shape.experts.to_string());
    source.insert("seed".into(), opts.seed.to_string());
    source.insert("skew".into(), opts.skew.to_string());
    let spec = BundleSpec {
        header,
        files: vec![
            CopiedFile {
                name: "config.json".into(),
                bytes: config,
            },
            CopiedFile {
                name: "generation_config.json".into(),
                bytes: generation,
            },
        ],
        source,
        expert_sources: Default::default(),
        converter,
        codec: Default::default(),
    };
    let src = SynthSource {
        by_name: tensors.iter().map(|t| (t.name.as_str(), t)).collect(),
        fused,
        seed: opts.seed,
        skew: opts.skew,
    };
    write_bundle(out, opts.force, spec, &src)
}
