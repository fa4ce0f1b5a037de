//! The shape rules: every tensor a validated config implies, with the shape it must have, and the
//! dtypes the runtime computes with. The runtime loads its resident weights through
//! [`ModelRules`]; the converter checks a checkpoint against the same rules before it writes a
//! byte, so the two can never disagree about what a model of this config looks like.
//!
//! Shapes are outermost first, as safetensors stores them: a projection `y = W x` is
//! `[out, in]`. H = hidden_size, V = vocab_size, Hq/Hkv = attention/KV heads, D = head_dim,
//! E = experts, I = expert width, F = dense width, S = shared-expert width.

use crate::config::{ExpertDtype, MoeConfig};
use crate::model::{
    expert_name, layer_name, ArchSpec, ExpertLayout, LinearProjections, MlpKind, QkNorm,
    RouterRule, SharedExpertRule,
};

/// Whether a tensor must be in the checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// The runtime reads it; a checkpoint without it cannot run.
    Required,
    /// The runtime never reads it (the lm_head when `tie_word_embeddings` is true: the embedding
    /// is used instead). It may be absent; when present it must still have its shape.
    Optional,
}

/// One non-expert tensor the config implies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorRule {
    /// The tensor's name in the checkpoint (and the bundle).
    pub name: String,
    /// The shape it must have, outermost first.
    pub shape: Vec<usize>,
    /// Whether it must be present.
    pub need: Need,
    /// Where the shape comes from, in config terms (for messages).
    pub why: &'static str,
}

impl TensorRule {
    fn new(name: String, shape: Vec<usize>, why: &'static str) -> TensorRule {
        TensorRule {
            name,
            shape,
            need: Need::Required,
            why,
        }
    }
}

/// A dense SwiGLU MLP's three matrices (dense layers, Qwen2-MoE's shared expert).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DenseMlpRules {
    pub gate: TensorRule,
    pub up: TensorRule,
    pub down: TensorRule,
}

/// The shapes every expert of an MoE layer has: gate and up `[I, H]`, down `[H, I]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertShapes {
    pub gate: [usize; 2],
    pub up: [usize; 2],
    pub down: [usize; 2],
}

/// One expert matrix of one layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertMatrixRule {
    pub layer: usize,
    pub name: String,
    pub shape: [usize; 2],
    pub why: &'static str,
}

/// The MLP of one layer.
#[derive(Clone, Debug, PartialEq, Eq)]
// Built once per layer when a model loads or a checkpoint is checked: the variants' sizes do not
// matter, and boxing would only add indirection to every reader.
#[allow(clippy::large_enum_variant)]
pub enum MlpRules {
    /// A dense MLP of width F.
    Dense(DenseMlpRules),
    /// The routed expert block.
    Moe {
        /// The router, `[E, H]`.
        router: TensorRule,
        /// Qwen2-MoE's shared expert and its sigmoid gate `[1, H]`.
        shared: Option<(DenseMlpRules, TensorRule)>,
        /// The router's `e_score_correction_bias` `[E]` (group-limited sigmoid routing).
        router_bias: Option<TensorRule>,
        /// DeepSeek's / GLM-4.5's ungated shared experts, one MLP of width S.
        shared_ungated: Option<DenseMlpRules>,
        /// gpt-oss: the router's bias `[E]`.
        router_linear_bias: Option<TensorRule>,
        /// gpt-oss: the experts' biases, `gate_up_proj_bias` `[E, 2I]` (interleaved like the
        /// columns: `2j` gate, `2j+1` up) and `down_proj_bias` `[E, H]`. Resident: they are
        /// small, and the forward adds the chosen experts' rows.
        expert_bias: Option<(TensorRule, TensorRule)>,
        /// Every routed expert's matrices.
        experts: ExpertShapes,
    },
}

/// Grouped-query attention's tensors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GqaRules {
    pub q_proj: TensorRule,
    pub k_proj: TensorRule,
    pub v_proj: TensorRule,
    pub o_proj: TensorRule,
    pub q_bias: Option<TensorRule>,
    pub k_bias: Option<TensorRule>,
    pub v_bias: Option<TensorRule>,
    pub o_bias: Option<TensorRule>,
    pub q_norm: Option<TensorRule>,
    pub k_norm: Option<TensorRule>,
    /// gpt-oss: one sink logit per query head `[Hq]`.
    pub sinks: Option<TensorRule>,
}

/// Multi-head latent attention's query projection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MlaQueryRules {
    /// `q_proj` `[Hq*(dn+dr), H]` (`q_lora_rank` null).
    Plain(TensorRule),
    /// `q_a_proj` `[rq, H]`, `q_a_layernorm` `[rq]`, `q_b_proj` `[Hq*(dn+dr), rq]`.
    LoRa {
        a: TensorRule,
        norm: TensorRule,
        b: TensorRule,
    },
}

/// Multi-head latent attention's tensors (r = kv_lora_rank, dn/dr/dv = the nope, rope and
/// value head widths).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MlaRules {
    pub q: MlaQueryRules,
    /// `kv_a_proj_with_mqa` `[r+dr, H]`.
    pub kv_a_proj: TensorRule,
    /// `kv_a_layernorm` `[r]`.
    pub kv_a_norm: TensorRule,
    /// `kv_b_proj` `[Hq*(dn+dv), r]`.
    pub kv_b_proj: TensorRule,
    /// `o_proj` `[H, Hq*dv]`.
    pub o_proj: TensorRule,
}

/// A gated DeltaNet layer's input projections ([`LinearProjections`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinearInRules {
    /// Qwen3-Next: `in_proj_qkvz` `[2 Hk Dk + 2 Hv Dv, H]`, `in_proj_ba` `[2 Hv, H]`.
    FusedQkvzBa { qkvz: TensorRule, ba: TensorRule },
    /// Qwen3.5: `in_proj_qkv` `[2 Hk Dk + Hv Dv, H]`, `in_proj_z` `[Hv Dv, H]`, `in_proj_b`
    /// and `in_proj_a` `[Hv, H]`.
    Separate {
        qkv: TensorRule,
        z: TensorRule,
        b: TensorRule,
        a: TensorRule,
    },
}

/// A gated DeltaNet layer's tensors (Hk/Hv = key/value heads, Dk/Dv their widths, C = the
/// convolution's channels `2 Hk Dk + Hv Dv`, K its kernel).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinearRules {
    pub input: LinearInRules,
    /// `conv1d.weight` `[C, 1, K]` (depthwise, no bias).
    pub conv: TensorRule,
    /// `A_log` `[Hv]`.
    pub a_log: TensorRule,
    /// `dt_bias` `[Hv]`.
    pub dt_bias: TensorRule,
    /// The gated RMSNorm's weight `[Dv]` (plain `w`, not zero-centred).
    pub norm: TensorRule,
    /// `out_proj` `[H, Hv Dv]`.
    pub out_proj: TensorRule,
}

/// A layer's attention tensors.
#[derive(Clone, Debug, PartialEq, Eq)]
// Built once per layer, like MlpRules: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum AttentionRules {
    Gqa(GqaRules),
    Mla(MlaRules),
    /// A hybrid family's gated DeltaNet layer.
    Linear(LinearRules),
}

/// One decoder layer's tensors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerRules {
    pub input_norm: TensorRule,
    pub post_attention_norm: TensorRule,
    pub attention: AttentionRules,
    pub mlp: MlpRules,
}

/// Every tensor of a model of one config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelRules {
    /// `[V, H]`.
    pub embed: TensorRule,
    /// `[H]`.
    pub final_norm: TensorRule,
    /// `[V, H]`; [`Need::Optional`] when the embeddings are tied.
    pub lm_head: TensorRule,
    pub layers: Vec<LayerRules>,
    /// The family's expert name patterns (`{l}`, `{e}`) in gate, up, down order.
    expert_names: [&'static str; 3],
    num_experts: usize,
    /// The fused expert tensors of every MoE layer ([`ExpertLayout::FusedInterleaved`]), empty
    /// for a family whose experts are separate tensors.
    pub fused: Vec<FusedExpertRules>,
}

/// One fused expert tensor of one layer (gpt-oss): all E experts' slices of one matrix, the
/// expert index outermost, so expert `e`'s slice is one contiguous byte range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusedTensorRule {
    pub name: String,
    /// The safetensors dtype it must have (`BF16`, or `U8` for MXFP4 blocks and scales).
    pub dtype: &'static str,
    /// Outermost first; `shape[0]` is E.
    pub shape: Vec<usize>,
    pub why: &'static str,
}

impl FusedTensorRule {
    /// Bytes of one expert's slice.
    pub fn expert_bytes(&self) -> usize {
        let elem = if self.dtype == "BF16" { 2 } else { 1 };
        self.shape[1..].iter().product::<usize>() * elem
    }
}

/// A layer's fused expert tensors, in the order an expert's extent holds its slices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FusedExpertRules {
    /// `gate_up_proj` `[E, H, 2I]` and `down_proj` `[E, I, H]`, BF16.
    Bf16 {
        layer: usize,
        gate_up: FusedTensorRule,
        down: FusedTensorRule,
    },
    /// MXFP4 as released: `gate_up_proj_blocks` `[E, 2I, H/32, 16]`, `gate_up_proj_scales`
    /// `[E, 2I, H/32]`, `down_proj_blocks` `[E, H, I/32, 16]`, `down_proj_scales` `[E, H, I/32]`.
    Mxfp4 {
        layer: usize,
        gate_up_blocks: FusedTensorRule,
        gate_up_scales: FusedTensorRule,
        down_blocks: FusedTensorRule,
        down_scales: FusedTensorRule,
    },
}

impl FusedExpertRules {
    /// The layer.
    pub fn layer(&self) -> usize {
        match self {
            FusedExpertRules::Bf16 { layer, .. } | FusedExpertRules::Mxfp4 { layer, .. } => *layer,
        }
    }

    /// The tensors, in extent order.
    pub fn tensors(&self) -> Vec<&FusedTensorRule> {
        match self {
            FusedExpertRules::Bf16 { gate_up, down, .. } => vec![gate_up, down],
            FusedExpertRules::Mxfp4 {
                gate_up_blocks,
                gate_up_scales,
                down_blocks,
                down_scales,
                ..
            } => vec![gate_up_blocks, gate_up_scales, down_blocks, down_scales],
        }
    }
}

/// The element types the runtime computes with. Nothing else is ever widened or narrowed into
/// them: a tensor in another type cannot be run exactly as stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuntimeDtype {
    /// bfloat16 (every expert matrix; most non-expert tensors).
    Bf16,
    /// IEEE binary32 (allowed for non-expert tensors).
    F32,
}

impl RuntimeDtype {
    /// The runtime type of a safetensors dtype name (`"BF16"`, `"F32"`, ...), if it has one.
    pub fn from_safetensors_name(name: &str) -> Option<RuntimeDtype> {
        match name {
            "BF16" => Some(RuntimeDtype::Bf16),
            "F32" => Some(RuntimeDtype::F32),
            _ => None,
        }
    }
}

/// What a checkpoint holds under one name: its safetensors dtype name and its shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FoundTensor<'a> {
    pub dtype: &'a str,
    pub shape: &'a [u64],
}

/// A tensor that does not match the rules. Every message names the tensor and the check.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ShapeError {
    /// A tensor the runtime needs is absent.
    #[error("tensor {name:?} is missing; the config needs it ({why})")]
    Missing { name: String, why: &'static str },
    /// A tensor has another shape than the config implies.
    #[error("tensor {name:?} has shape {found:?}, but the config implies {expected:?} ({why})")]
    WrongShape {
        name: String,
        found: Vec<u64>,
        expected: Vec<usize>,
        why: &'static str,
    },
    /// A non-expert tensor is in a type the runtime does not compute with (F16, F64, ...).
    #[error("tensor {name:?} is {dtype}; the runtime computes non-expert tensors in BF16 or F32 only, and never converts them")]
    NonExpertDtype { name: String, dtype: String },
    /// An expert matrix is absent.
    #[error("expert matrix {name:?} is missing; the config gives layer {layer} {experts} experts")]
    MissingExpert {
        name: String,
        layer: usize,
        experts: usize,
    },
    /// An expert matrix is not BF16.
    #[error("expert matrix {name:?} is {dtype}; expert weights must be BF16")]
    ExpertDtype { name: String, dtype: String },
}

impl ShapeError {
    /// The tensor the failed check is about.
    pub fn tensor(&self) -> &str {
        match self {
            ShapeError::Missing { name, .. }
            | ShapeError::WrongShape { name, .. }
            | ShapeError::NonExpertDtype { name, .. }
            | ShapeError::MissingExpert { name, .. }
            | ShapeError::ExpertDtype { name, .. } => name,
        }
    }
}

const NORM: &str = "hidden_size";
const EMBED: &str = "vocab_size x hidden_size";
const Q: &str = "num_attention_heads x head_dim, hidden_size";
const KV: &str = "num_key_value_heads x head_dim, hidden_size";
const O: &str = "hidden_size, num_attention_heads x head_dim";
const Q_VEC: &str = "num_attention_heads x head_dim";
const KV_VEC: &str = "num_key_value_heads x head_dim";
const HEAD_DIM: &str = "head_dim";
const ROUTER: &str = "number of experts, hidden_size";
const DENSE_IN: &str = "intermediate_size, hidden_size";
const DENSE_OUT: &str = "hidden_size, intermediate_size";
const SHARED_IN: &str = "shared_expert_intermediate_size, hidden_size";
const SHARED_OUT: &str = "hidden_size, shared_expert_intermediate_size";
const SHARED_GATE: &str = "1, hidden_size";
const ROUTER_BIAS: &str = "number of experts";
const SHARED_UNGATED_IN: &str = "n_shared_experts x moe_intermediate_size, hidden_size";
const SHARED_UNGATED_OUT: &str = "hidden_size, n_shared_experts x moe_intermediate_size";
const MLA_Q: &str = "num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim), hidden_size";
const MLA_Q_A: &str = "q_lora_rank, hidden_size";
const MLA_Q_NORM: &str = "q_lora_rank";
const MLA_Q_B: &str = "num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim), q_lora_rank";
const MLA_KV_A: &str = "kv_lora_rank + qk_rope_head_dim, hidden_size";
const MLA_KV_NORM: &str = "kv_lora_rank";
const MLA_KV_B: &str = "num_attention_heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank";
const MLA_O: &str = "hidden_size, num_attention_heads x v_head_dim";
const SINKS: &str = "num_attention_heads";
const EXPERT_GATE_UP_BIAS: &str = "number of experts, 2 x expert width";
const EXPERT_DOWN_BIAS: &str = "number of experts, hidden_size";
const FUSED_GATE_UP: &str = "number of experts, hidden_size, 2 x expert width";
const FUSED_DOWN: &str = "number of experts, expert width, hidden_size";
const MX_GATE_UP_BLOCKS: &str = "number of experts, 2 x expert width, hidden_size / 32, 16";
const MX_GATE_UP_SCALES: &str = "number of experts, 2 x expert width, hidden_size / 32";
const MX_DOWN_BLOCKS: &str = "number of experts, hidden_size, expert width / 32, 16";
const MX_DOWN_SCALES: &str = "number of experts, hidden_size, expert width / 32";
const Q_GATED: &str = "num_attention_heads x 2 x head_dim (query and output gate), hidden_size";
const LIN_QKVZ: &str = "2 x linear_num_key_heads x linear_key_head_dim + 2 x linear_num_value_heads x linear_value_head_dim, hidden_size";
const LIN_BA: &str = "2 x linear_num_value_heads, hidden_size";
const LIN_QKV: &str = "2 x linear_num_key_heads x linear_key_head_dim + linear_num_value_heads x linear_value_head_dim, hidden_size";
const LIN_Z: &str = "linear_num_value_heads x linear_value_head_dim, hidden_size";
const LIN_HEADS_IN: &str = "linear_num_value_heads, hidden_size";
const LIN_CONV: &str = "convolution channels (2 Hk Dk + Hv Dv), 1, linear_conv_kernel_dim";
const LIN_HEADS: &str = "linear_num_value_heads";
const LIN_NORM: &str = "linear_value_head_dim";
const LIN_OUT: &str = "hidden_size, linear_num_value_heads x linear_value_head_dim";
const EXPERT_IN: &str = "expert width, hidden_size";
const EXPERT_OUT: &str = "hidden_size, expert width";

impl ModelRules {
    /// The rules of `cfg` (its family resolved with [`ArchSpec::new`]).
    pub fn for_config(cfg: &MoeConfig) -> ModelRules {
        ModelRules::new(cfg, &ArchSpec::new(cfg))
    }

    /// The rules of `cfg` with its family already resolved into `spec`.
    pub fn new(cfg: &MoeConfig, spec: &ArchSpec) -> ModelRules {
        let n = &spec.names;
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let (q, kv) = (
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        );
        let mut lm_head = TensorRule::new(n.lm_head.to_string(), vec![v, h], EMBED);
        if cfg.tie_word_embeddings {
            lm_head.need = Need::Optional;
        }
        let layers = spec
            .layers
            .iter()
            .enumerate()
            .map(|(l, kind)| {
                let rule =
                    |p: &str, shape: Vec<usize>, why| TensorRule::new(layer_name(p, l), shape, why);
                let opt =
                    |on: bool, p: &str, shape: Vec<usize>, why| on.then(|| rule(p, shape, why));
                let (qn, kn) = match spec.qk_norm {
                    // Llama 4's L2 norm has no weight
                    QkNorm::None | QkNorm::L2AfterRope => (None, None),
                    QkNorm::PerHead => (
                        Some((cfg.head_dim, HEAD_DIM)),
                        Some((cfg.head_dim, HEAD_DIM)),
                    ),
                    QkNorm::WholeProjection => (Some((q, Q_VEC)), Some((kv, KV_VEC))),
                };
                let mlp = match kind {
                    MlpKind::Dense => {
                        // The config parser refuses a dense layer without its width.
                        let f = cfg.dense_width.unwrap_or(0);
                        MlpRules::Dense(DenseMlpRules {
                            gate: rule(n.dense_gate, vec![f, h], DENSE_IN),
                            up: rule(n.dense_up, vec![f, h], DENSE_IN),
                            down: rule(n.dense_down, vec![h, f], DENSE_OUT),
                        })
                    }
                    MlpKind::Moe => {
                        let shared = match cfg.shared_expert_width {
                            Some(s) if spec.shared_expert => Some((
                                DenseMlpRules {
                                    gate: rule(n.shared_gate_proj, vec![s, h], SHARED_IN),
                                    up: rule(n.shared_up_proj, vec![s, h], SHARED_IN),
                                    down: rule(n.shared_down_proj, vec![h, s], SHARED_OUT),
                                },
                                rule(n.shared_expert_gate, vec![1, h], SHARED_GATE),
                            )),
                            _ => None,
                        };
                        let (sh_in, sh_out) = match spec.family.shared_expert {
                            Some(SharedExpertRule::UngatedExpertWidth) => (EXPERT_IN, EXPERT_OUT),
                            _ => (SHARED_UNGATED_IN, SHARED_UNGATED_OUT),
                        };
                        let shared_ungated = match cfg.shared_expert_width {
                            Some(s) if spec.shared_experts_ungated => Some(DenseMlpRules {
                                gate: rule(n.shared_gate_proj, vec![s, h], sh_in),
                                up: rule(n.shared_up_proj, vec![s, h], sh_in),
                                down: rule(n.shared_down_proj, vec![h, s], sh_out),
                            }),
                            _ => None,
                        };
                        let router_bias = match spec.router {
                            RouterRule::SoftmaxTopK
                            | RouterRule::SoftmaxGroupLimited
                            | RouterRule::TopKThenSoftmax
                            | RouterRule::SigmoidScalesInput => None,
                            RouterRule::SigmoidGroupLimited => {
                                Some(rule(n.router_bias, vec![cfg.num_experts], ROUTER_BIAS))
                            }
                        };
                        let i = cfg.expert_width;
                        MlpRules::Moe {
                            router: rule(n.router, vec![cfg.num_experts, h], ROUTER),
                            shared,
                            router_bias,
                            shared_ungated,
                            router_linear_bias: opt(
                                spec.extras.router_bias,
                                n.router_linear_bias,
                                vec![cfg.num_experts],
                                ROUTER_BIAS,
                            ),
                            expert_bias: spec.extras.expert_bias.then(|| {
                                (
                                    rule(
                                        n.fused_gate_up_bias,
                                        vec![cfg.num_experts, 2 * i],
                                        EXPERT_GATE_UP_BIAS,
                                    ),
                                    rule(
                                        n.fused_down_bias,
                                        vec![cfg.num_experts, h],
                                        EXPERT_DOWN_BIAS,
                                    ),
                                )
                            }),
                            experts: ExpertShapes {
                                gate: [i, h],
                                up: [i, h],
                                down: [h, i],
                            },
                        }
                    }
                };
                let (q_rows, q_why) = if spec.extras.gated_attention {
                    (2 * q, Q_GATED)
                } else {
                    (q, Q)
                };
                let linear = match (spec.extras.linear_attention, &cfg.linear) {
                    (Some(form), Some(d)) if cfg.layer_linear[l] => Some((form, d)),
                    _ => None,
                };
                let attention = match (cfg.mla, linear) {
                    (_, Some((form, d))) => {
                        let (kw, vw, hv) = (d.key_width(), d.value_width(), d.value_heads);
                        AttentionRules::Linear(LinearRules {
                            input: match form {
                                LinearProjections::FusedQkvzBa => LinearInRules::FusedQkvzBa {
                                    qkvz: rule(n.lin_qkvz, vec![2 * kw + 2 * vw, h], LIN_QKVZ),
                                    ba: rule(n.lin_ba, vec![2 * hv, h], LIN_BA),
                                },
                                LinearProjections::Separate => LinearInRules::Separate {
                                    qkv: rule(n.lin_qkv, vec![2 * kw + vw, h], LIN_QKV),
                                    z: rule(n.lin_z, vec![vw, h], LIN_Z),
                                    b: rule(n.lin_b, vec![hv, h], LIN_HEADS_IN),
                                    a: rule(n.lin_a, vec![hv, h], LIN_HEADS_IN),
                                },
                            },
                            conv: rule(
                                n.lin_conv,
                                vec![d.conv_channels(), 1, d.conv_kernel],
                                LIN_CONV,
                            ),
                            a_log: rule(n.lin_a_log, vec![hv], LIN_HEADS),
                            dt_bias: rule(n.lin_dt_bias, vec![hv], LIN_HEADS),
                            norm: rule(n.lin_norm, vec![d.value_dim], LIN_NORM),
                            out_proj: rule(n.lin_out, vec![h, vw], LIN_OUT),
                        })
                    }
                    (None, None) => AttentionRules::Gqa(GqaRules {
                        q_proj: rule(n.q_proj, vec![q_rows, h], q_why),
                        k_proj: rule(n.k_proj, vec![kv, h], KV),
                        v_proj: rule(n.v_proj, vec![kv, h], KV),
                        o_proj: rule(n.o_proj, vec![h, q], O),
                        q_bias: opt(spec.qkv_bias, n.q_bias, vec![q], Q_VEC),
                        k_bias: opt(spec.qkv_bias, n.k_bias, vec![kv], KV_VEC),
                        v_bias: opt(spec.qkv_bias, n.v_bias, vec![kv], KV_VEC),
                        o_bias: opt(spec.o_bias, n.o_bias, vec![h], NORM),
                        q_norm: qn.map(|(len, why)| rule(n.q_norm, vec![len], why)),
                        k_norm: kn.map(|(len, why)| rule(n.k_norm, vec![len], why)),
                        sinks: opt(
                            spec.extras.attention_sinks,
                            n.sinks,
                            vec![cfg.num_heads],
                            SINKS,
                        ),
                    }),
                    (Some(m), None) => {
                        let hq = cfg.num_heads;
                        let qo = hq * m.qk_head_dim();
                        let r = m.kv_lora_rank;
                        AttentionRules::Mla(MlaRules {
                            q: match m.q_lora_rank {
                                None => MlaQueryRules::Plain(rule(n.q_proj, vec![qo, h], MLA_Q)),
                                Some(rq) => MlaQueryRules::LoRa {
                                    a: rule(n.q_a_proj, vec![rq, h], MLA_Q_A),
                                    norm: rule(n.q_a_norm, vec![rq], MLA_Q_NORM),
                                    b: rule(n.q_b_proj, vec![qo, rq], MLA_Q_B),
                                },
                            },
                            kv_a_proj: rule(n.kv_a_proj, vec![m.latent_width(), h], MLA_KV_A),
                            kv_a_norm: rule(n.kv_a_norm, vec![r], MLA_KV_NORM),
                            kv_b_proj: rule(
                                n.kv_b_proj,
                                vec![hq * (m.qk_nope_head_dim + m.v_head_dim), r],
                                MLA_KV_B,
                            ),
                            o_proj: rule(n.o_proj, vec![h, hq * m.v_head_dim], MLA_O),
                        })
                    }
                };
                LayerRules {
                    input_norm: rule(n.input_norm, vec![h], NORM),
                    post_attention_norm: rule(n.post_attention_norm, vec![h], NORM),
                    attention,
                    mlp,
                }
            })
            .collect();
        ModelRules {
            embed: TensorRule::new(n.embed.to_string(), vec![v, h], EMBED),
            final_norm: TensorRule::new(n.final_norm.to_string(), vec![h], NORM),
            lm_head,
            layers,
            expert_names: [n.expert_gate, n.expert_up, n.expert_down],
            num_experts: cfg.num_experts,
            fused: match spec.extras.expert_layout {
                ExpertLayout::Separate => Vec::new(),
                ExpertLayout::FusedInterleaved | ExpertLayout::FusedConcatenated => {
                    fused_rules(cfg, spec)
                }
            },
        }
    }

    /// Every non-expert tensor, in the order the runtime loads them.
    pub fn non_expert(&self) -> Vec<&TensorRule> {
        let mut out = vec![&self.embed, &self.lm_head, &self.final_norm];
        for layer in &self.layers {
            out.extend([&layer.input_norm, &layer.post_attention_norm]);
            match &layer.attention {
                AttentionRules::Gqa(a) => {
                    out.extend([&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj]);
                    out.extend(
                        [
                            &a.q_bias, &a.k_bias, &a.v_bias, &a.o_bias, &a.q_norm, &a.k_norm,
                            &a.sinks,
                        ]
                        .into_iter()
                        .flatten(),
                    );
                }
                AttentionRules::Mla(a) => {
                    match &a.q {
                        MlaQueryRules::Plain(q) => out.push(q),
                        MlaQueryRules::LoRa { a, norm, b } => out.extend([a, norm, b]),
                    }
                    out.extend([&a.kv_a_proj, &a.kv_a_norm, &a.kv_b_proj, &a.o_proj]);
                }
                AttentionRules::Linear(a) => {
                    match &a.input {
                        LinearInRules::FusedQkvzBa { qkvz, ba } => out.extend([qkvz, ba]),
                        LinearInRules::Separate { qkv, z, b, a } => out.extend([qkv, z, b, a]),
                    }
                    out.extend([&a.conv, &a.a_log, &a.dt_bias, &a.norm, &a.out_proj]);
                }
            }
            match &layer.mlp {
                MlpRules::Dense(d) => out.extend([&d.gate, &d.up, &d.down]),
                MlpRules::Moe {
                    router,
                    shared,
                    router_bias,
                    shared_ungated,
                    router_linear_bias,
                    expert_bias,
                    ..
                } => {
                    out.push(router);
                    out.extend(router_bias);
                    out.extend(router_linear_bias);
                    if let Some((gu, d)) = expert_bias {
                        out.extend([gu, d]);
                    }
                    if let Some((d, gate)) = shared {
                        out.extend([&d.gate, &d.up, &d.down, gate]);
                    }
                    if let Some(d) = shared_ungated {
                        out.extend([&d.gate, &d.up, &d.down]);
                    }
                }
            }
        }
        out
    }

    /// The MoE layers and the shapes of their experts, ascending.
    pub fn expert_layers(&self) -> impl Iterator<Item = (usize, &ExpertShapes)> {
        self.layers
            .iter()
            .enumerate()
            .filter_map(|(l, layer)| match &layer.mlp {
                MlpRules::Moe { experts, .. } => Some((l, experts)),
                MlpRules::Dense(_) => None,
            })
    }

    /// Every expert matrix of every MoE layer, gate, up, down per expert, experts ascending
    /// (none for fused experts: see [`ModelRules::fused`]).
    pub fn expert_matrices(&self) -> impl Iterator<Item = ExpertMatrixRule> + '_ {
        let separate = self.fused.is_empty();
        self.expert_layers()
            .filter(move |_| separate)
            .flat_map(move |(layer, s)| {
                (0..self.num_experts).flat_map(move |e| {
                    [(s.gate, EXPERT_IN), (s.up, EXPERT_IN), (s.down, EXPERT_OUT)]
                        .into_iter()
                        .zip(self.expert_names)
                        .map(move |((shape, why), pattern)| ExpertMatrixRule {
                            layer,
                            name: expert_name(pattern, layer, e),
                            shape,
                            why,
                        })
                })
            })
    }

    /// Checks a checkpoint's tensor table against the rules: every needed tensor present with
    /// its shape, every non-expert tensor the rules name in a [`RuntimeDtype`], every expert
    /// matrix present, BF16, with its shape. `lookup` answers for one name. Tensors the rules do
    /// not name are not judged here (the caller decides what to carry).
    pub fn check<'a>(
        &self,
        lookup: impl Fn(&str) -> Option<FoundTensor<'a>>,
    ) -> Result<(), ShapeError> {
        for rule in self.non_expert() {
            let Some(found) = lookup(&rule.name) else {
                match rule.need {
                    Need::Required => {
                        return Err(ShapeError::Missing {
                            name: rule.name.clone(),
                            why: rule.why,
                        })
                    }
                    Need::Optional => continue,
                }
            };
            check_non_expert_dtype(&rule.name, found.dtype)?;
            check_shape(&rule.name, found.shape, &rule.shape, rule.why)?;
        }
        for ExpertMatrixRule {
            layer,
            name,
            shape,
            why,
        } in self.expert_matrices()
        {
            let Some(found) = lookup(&name) else {
                return Err(ShapeError::MissingExpert {
                    name,
                    layer,
                    experts: self.num_experts,
                });
            };
            if RuntimeDtype::from_safetensors_name(found.dtype) != Some(RuntimeDtype::Bf16) {
                return Err(ShapeError::ExpertDtype {
                    name,
                    dtype: found.dtype.to_string(),
                });
            }
            check_shape(&name, found.shape, &shape, why)?;
        }
        for rule in self.fused.iter().flat_map(|f| f.tensors()) {
            let Some(found) = lookup(&rule.name) else {
                return Err(ShapeError::Missing {
                    name: rule.name.clone(),
                    why: rule.why,
                });
            };
            if found.dtype != rule.dtype {
                return Err(ShapeError::ExpertDtype {
                    name: rule.name.clone(),
                    dtype: found.dtype.to_string(),
                });
            }
            check_shape(&rule.name, found.shape, &rule.shape, rule.why)?;
        }
        Ok(())
    }
}

/// The fused expert tensors of every MoE layer of a gpt-oss config (BF16 or MXFP4) or a
/// Llama 4 config (BF16; the config parser allows MXFP4 for gpt-oss only).
fn fused_rules(cfg: &MoeConfig, spec: &ArchSpec) -> Vec<FusedExpertRules> {
    let n = &spec.names;
    let (e, h, i) = (cfg.num_experts, cfg.hidden_size, cfg.expert_width);
    let t =
        |pattern: &str, l: usize, suffix: &str, dtype, shape: Vec<usize>, why| FusedTensorRule {
            name: format!("{}{suffix}", layer_name(pattern, l)),
            dtype,
            shape,
            why,
        };
    spec.layers
        .iter()
        .enumerate()
        .filter(|(_, k)| **k == MlpKind::Moe)
        .map(|(l, _)| match cfg.expert_dtype {
            ExpertDtype::Bf16 => FusedExpertRules::Bf16 {
                layer: l,
                gate_up: t(
                    n.fused_gate_up,
                    l,
                    "",
                    "BF16",
                    vec![e, h, 2 * i],
                    FUSED_GATE_UP,
                ),
                down: t(n.fused_down, l, "", "BF16", vec![e, i, h], FUSED_DOWN),
            },
            // The config parser checks H and I are multiples of 32.
            ExpertDtype::Mxfp4 => FusedExpertRules::Mxfp4 {
                layer: l,
                gate_up_blocks: t(
                    n.fused_gate_up,
                    l,
                    "_blocks",
                    "U8",
                    vec![e, 2 * i, h / 32, 16],
                    MX_GATE_UP_BLOCKS,
                ),
                gate_up_scales: t(
                    n.fused_gate_up,
                    l,
                    "_scales",
                    "U8",
                    vec![e, 2 * i, h / 32],
                    MX_GATE_UP_SCALES,
                ),
                down_blocks: t(
                    n.fused_down,
                    l,
                    "_blocks",
                    "U8",
                    vec![e, h, i / 32, 16],
                    MX_DOWN_BLOCKS,
                ),
                down_scales: t(
                    n.fused_down,
                    l,
                    "_scales",
                    "U8",
                    vec![e, h, i / 32],
                    MX_DOWN_SCALES,
                ),
            },
        })
        .collect()
}

/// The dtype policy for non-expert tensors: BF16 or F32, carried as stored. F16 and F64 are
/// refused: the runtime computes with neither, and converting them would change the bytes that
/// the manifest vouches for.
pub fn check_non_expert_dtype(name: &str, dtype: &str) -> Result<RuntimeDtype, ShapeError> {
    RuntimeDtype::from_safetensors_name(dtype).ok_or_else(|| ShapeError::NonExpertDtype {
        name: name.to_string(),
        dtype: dtype.to_string(),
    })
}

fn check_shape(
    name: &str,
    found: &[u64],
    expected: &[usize],
    why: &'static str,
) -> Result<(), ShapeError> {
    let same = found.len() == expected.len()
        && found
            .iter()
            .zip(expected)
            .all(|(&f, &e)| u64::try_from(e).is_ok_and(|e| e == f));
    if same {
        Ok(())
    } else {
        Err(ShapeError::WrongShape {
            name: name.to_string(),
            found: found.to_vec(),
            expected: expected.to_vec(),
            why,
        })
    }
}

#[cfg(test)]
mod tests;
