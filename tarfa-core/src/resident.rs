//! The non-expert weights of a model, fetched once from a [`WeightSource`] and checked against
//! the shapes the config implies (`tarfa_core::shapes`, the rules the converter checks too).
//!
//! Norm weights and biases are widened to f32 here (exactly); matrices stay as the source gave
//! them (BF16 or F32). This module must never convert a matrix's precision.

use std::sync::Arc;

use crate::config::MoeConfig;
use crate::model::ArchSpec;
use crate::numerics::{bf16_to_f32, MatrixRef};
use crate::shapes::{
    AttentionRules, DenseMlpRules, LinearInRules, MlaQueryRules, MlpRules, ModelRules, Need,
    TensorRule,
};
use crate::weights::{HostTensor, TensorData, WeightError, WeightSource};

/// A resident weight matrix `[rows, cols]`.
#[derive(Clone, Debug)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    tensor: Arc<HostTensor>,
}

impl Matrix {
    /// Borrowed view for the kernels.
    pub fn as_ref(&self) -> MatrixRef<'_> {
        match &self.tensor.data {
            TensorData::Bf16(d) => MatrixRef::Bf16 {
                rows: self.rows,
                cols: self.cols,
                data: d,
            },
            TensorData::F32(d) => MatrixRef::F32 {
                rows: self.rows,
                cols: self.cols,
                data: d,
            },
        }
    }

    /// Row `r` widened to f32 (embedding lookup).
    pub fn row_f32(&self, r: usize) -> Vec<f32> {
        let span = r * self.cols..(r + 1) * self.cols;
        match &self.tensor.data {
            TensorData::Bf16(d) => d[span].iter().map(|&b| bf16_to_f32(b)).collect(),
            TensorData::F32(d) => d[span].to_vec(),
        }
    }
}

/// Attention weights of one layer.
#[derive(Clone, Debug)]
pub struct AttentionWeights {
    pub q: Matrix,
    pub k: Matrix,
    pub v: Matrix,
    pub o: Matrix,
    pub q_bias: Option<Vec<f32>>,
    pub k_bias: Option<Vec<f32>>,
    pub v_bias: Option<Vec<f32>>,
    pub o_bias: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// gpt-oss: one sink logit per query head, widened to f32.
    pub sinks: Option<Vec<f32>>,
}

/// Multi-head latent attention's query projection.
#[derive(Clone, Debug)]
pub enum MlaQuery {
    /// `q_proj`.
    Plain(Matrix),
    /// `q_a_proj`, `q_a_layernorm` (widened to f32), `q_b_proj`.
    LoRa {
        a: Matrix,
        norm: Vec<f32>,
        b: Matrix,
    },
}

/// Multi-head latent attention's weights of one layer.
#[derive(Clone, Debug)]
pub struct MlaWeights {
    pub q: MlaQuery,
    /// `kv_a_proj_with_mqa` `[r+dr, H]`.
    pub kv_a: Matrix,
    /// `kv_a_layernorm` `[r]`, widened to f32.
    pub kv_a_norm: Vec<f32>,
    /// `kv_b_proj` `[Hq*(dn+dv), r]`: per head, dn rows that absorb into the query and dv rows
    /// that expand the attended latent into the value.
    pub kv_b: Matrix,
    /// `o_proj` `[H, Hq*dv]`.
    pub o: Matrix,
}

/// A gated DeltaNet layer's input projections, as the checkpoint stores them.
#[derive(Clone, Debug)]
pub enum LinearIn {
    /// Qwen3-Next: `in_proj_qkvz` and `in_proj_ba`, grouped by key head.
    FusedQkvzBa { qkvz: Matrix, ba: Matrix },
    /// Qwen3.5: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
    Separate {
        qkv: Matrix,
        z: Matrix,
        b: Matrix,
        a: Matrix,
    },
}

/// A gated DeltaNet layer's weights.
#[derive(Clone, Debug)]
pub struct LinearWeights {
    pub input: LinearIn,
    /// `conv1d.weight` `[C, 1, K]` widened to f32: channel `c`'s taps at `c*K..(c+1)*K`, the
    /// oldest input's first.
    pub conv: Vec<f32>,
    /// `A_log` `[Hv]`, widened to f32.
    pub a_log: Vec<f32>,
    /// `dt_bias` `[Hv]`, widened to f32.
    pub dt_bias: Vec<f32>,
    /// The gated RMSNorm's weight `[Dv]`, widened to f32 (plain `w`).
    pub norm: Vec<f32>,
    /// `out_proj` `[H, Hv Dv]`.
    pub out: Matrix,
}

/// A layer's attention weights.
#[derive(Clone, Debug)]
// One per layer, built when a model loads, like LayerMlp.
#[allow(clippy::large_enum_variant)]
pub enum Attention {
    /// Grouped-query attention.
    Gqa(AttentionWeights),
    /// Multi-head latent attention.
    Mla(MlaWeights),
    /// A gated DeltaNet (linear attention) layer.
    Linear(LinearWeights),
}

impl Attention {
    /// The grouped-query weights, or None for multi-head latent attention and linear layers.
    pub fn gqa(&self) -> Option<&AttentionWeights> {
        match self {
            Attention::Gqa(a) => Some(a),
            Attention::Mla(_) | Attention::Linear(_) => None,
        }
    }
}

/// A dense SwiGLU MLP (dense layers, and Qwen2-MoE's shared expert).
#[derive(Clone, Debug)]
pub struct DenseMlp {
    pub gate: Matrix,
    pub up: Matrix,
    pub down: Matrix,
}

/// The resident part of an MoE block: router and optional shared expert.
#[derive(Clone, Debug)]
pub struct MoeResident {
    pub router: Matrix,
    /// Qwen2-MoE's shared expert and its sigmoid gate.
    pub shared: Option<(DenseMlp, Matrix)>,
    /// The router's `e_score_correction_bias` (group-limited sigmoid routing), widened to f32.
    pub correction_bias: Option<Vec<f32>>,
    /// DeepSeek's / GLM-4.5's shared experts, added without a gate.
    pub shared_ungated: Option<DenseMlp>,
    /// gpt-oss: the router's bias `[E]`, widened to f32.
    pub router_linear_bias: Option<Vec<f32>>,
    /// gpt-oss: the experts' biases, de-interleaved and widened to f32: per expert `e`,
    /// `gate[e*I..(e+1)*I]`, `up[e*I..(e+1)*I]` and `down[e*H..(e+1)*H]`.
    pub expert_bias: Option<ExpertBias>,
}

/// gpt-oss's expert biases (see [`MoeResident::expert_bias`]).
#[derive(Clone, Debug)]
pub struct ExpertBias {
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
}

/// The MLP of one layer.
#[derive(Clone, Debug)]
// One per layer, built when a model loads: the variants' sizes do not matter, and boxing would
// add an indirection to every step's read of the router.
#[allow(clippy::large_enum_variant)]
pub enum LayerMlp {
    Dense(DenseMlp),
    Moe(MoeResident),
}

/// One decoder layer's resident weights.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    pub post_attention_norm: Vec<f32>,
    pub attention: Attention,
    pub mlp: LayerMlp,
}

/// Everything but the experts.
#[derive(Clone, Debug)]
pub struct ResidentWeights {
    pub embed: Matrix,
    pub final_norm: Vec<f32>,
    /// The lm_head, or the embedding when tied.
    pub lm_head: Matrix,
    pub layers: Vec<LayerWeights>,
}

fn matrix(src: &dyn WeightSource, rule: &TensorRule) -> Result<Matrix, WeightError> {
    let t = src.tensor(&rule.name)?;
    // Matrix rules are [rows, cols] by construction; anything else is a mismatch all the same.
    let (&[rows, cols], true) = (rule.shape.as_slice(), t.shape == rule.shape) else {
        return Err(WeightError::ShapeMismatch {
            name: rule.name.clone(),
            expected: rule.shape.clone(),
            found: t.shape.clone(),
        });
    };
    Ok(Matrix {
        rows,
        cols,
        tensor: t,
    })
}

fn vector(src: &dyn WeightSource, rule: &TensorRule) -> Result<Vec<f32>, WeightError> {
    let t = src.tensor(&rule.name)?;
    if t.shape != rule.shape {
        return Err(WeightError::ShapeMismatch {
            name: rule.name.clone(),
            expected: rule.shape.clone(),
            found: t.shape.clone(),
        });
    }
    Ok(match &t.data {
        TensorData::Bf16(d) => d.iter().map(|&b| bf16_to_f32(b)).collect(),
        TensorData::F32(d) => d.to_vec(),
    })
}

fn dense(src: &dyn WeightSource, rules: &DenseMlpRules) -> Result<DenseMlp, WeightError> {
    Ok(DenseMlp {
        gate: matrix(src, &rules.gate)?,
        up: matrix(src, &rules.up)?,
        down: matrix(src, &rules.down)?,
    })
}

impl ResidentWeights {
    /// Fetches every non-expert tensor the spec names, checked against the shape rules that the
    /// converter checks checkpoints against too ([`ModelRules`]).
    pub fn load(
        cfg: &MoeConfig,
        spec: &ArchSpec,
        src: &dyn WeightSource,
    ) -> Result<ResidentWeights, WeightError> {
        let rules = ModelRules::new(cfg, spec);
        // A zero-centred norm (Qwen3-Next, Qwen3.5) scales by `1 + w`: the f32 sum formed once
        // here is the value transformers forms on every call (`1.0 + weight.float()`).
        let zero_centered = spec.extras.zero_centered_norms;
        let norm = |rule: &TensorRule| -> Result<Vec<f32>, WeightError> {
            let mut w = vector(src, rule)?;
            if zero_centered {
                for x in w.iter_mut() {
                    *x += 1.0;
                }
            }
            Ok(w)
        };
        let embed = matrix(src, &rules.embed)?;
        let lm_head = match rules.lm_head.need {
            Need::Required => matrix(src, &rules.lm_head)?,
            // Tied: the embedding is the lm_head.
            Need::Optional => embed.clone(),
        };
        let final_norm = norm(&rules.final_norm)?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for layer in &rules.layers {
            let opt = |rule: &Option<TensorRule>| -> Result<Option<Vec<f32>>, WeightError> {
                rule.as_ref().map(|r| vector(src, r)).transpose()
            };
            let attention = match &layer.attention {
                AttentionRules::Gqa(a) => Attention::Gqa(AttentionWeights {
                    q: matrix(src, &a.q_proj)?,
                    k: matrix(src, &a.k_proj)?,
                    v: matrix(src, &a.v_proj)?,
                    o: matrix(src, &a.o_proj)?,
                    q_bias: opt(&a.q_bias)?,
                    k_bias: opt(&a.k_bias)?,
                    v_bias: opt(&a.v_bias)?,
                    o_bias: opt(&a.o_bias)?,
                    q_norm: a.q_norm.as_ref().map(norm).transpose()?,
                    k_norm: a.k_norm.as_ref().map(norm).transpose()?,
                    sinks: opt(&a.sinks)?,
                }),
                AttentionRules::Mla(a) => Attention::Mla(MlaWeights {
                    q: match &a.q {
                        MlaQueryRules::Plain(q) => MlaQuery::Plain(matrix(src, q)?),
                        MlaQueryRules::LoRa { a, norm, b } => MlaQuery::LoRa {
                            a: matrix(src, a)?,
                            norm: vector(src, norm)?,
                            b: matrix(src, b)?,
                        },
                    },
                    kv_a: matrix(src, &a.kv_a_proj)?,
                    kv_a_norm: vector(src, &a.kv_a_norm)?,
                    kv_b: matrix(src, &a.kv_b_proj)?,
                    o: matrix(src, &a.o_proj)?,
                }),
                AttentionRules::Linear(a) => Attention::Linear(LinearWeights {
                    input: match &a.input {
                        LinearInRules::FusedQkvzBa { qkvz, ba } => LinearIn::FusedQkvzBa {
                            qkvz: matrix(src, qkvz)?,
                            ba: matrix(src, ba)?,
                        },
                        LinearInRules::Separate { qkv, z, b, a } => LinearIn::Separate {
                            qkv: matrix(src, qkv)?,
                            z: matrix(src, z)?,
                            b: matrix(src, b)?,
                            a: matrix(src, a)?,
                        },
                    },
                    conv: vector(src, &a.conv)?,
                    a_log: vector(src, &a.a_log)?,
                    dt_bias: vector(src, &a.dt_bias)?,
                    norm: vector(src, &a.norm)?,
                    out: matrix(src, &a.out_proj)?,
                }),
            };
            let mlp = match &layer.mlp {
                MlpRules::Dense(d) => LayerMlp::Dense(dense(src, d)?),
                MlpRules::Moe {
                    router,
                    shared,
                    router_bias,
                    shared_ungated,
                    router_linear_bias,
                    expert_bias,
                    ..
                } => LayerMlp::Moe(MoeResident {
                    router_linear_bias: opt(router_linear_bias)?,
                    expert_bias: match expert_bias {
                        None => None,
                        Some((gu, d)) => {
                            // gate_up_proj_bias interleaves like its columns: 2j gate, 2j+1 up
                            let gu = vector(src, gu)?;
                            Some(ExpertBias {
                                gate: gu.iter().step_by(2).copied().collect(),
                                up: gu.iter().skip(1).step_by(2).copied().collect(),
                                down: vector(src, d)?,
                            })
                        }
                    },
                    router: matrix(src, router)?,
                    shared: match shared {
                        Some((d, gate)) => Some((dense(src, d)?, matrix(src, gate)?)),
                        None => None,
                    },
                    correction_bias: opt(router_bias)?,
                    shared_ungated: shared_ungated.as_ref().map(|d| dense(src, d)).transpose()?,
                }),
            };
            layers.push(LayerWeights {
                input_norm: norm(&layer.input_norm)?,
                post_attention_norm: norm(&layer.post_attention_norm)?,
                attention,
                mlp,
            });
        }
        Ok(ResidentWeights {
            embed,
            final_norm,
            lm_head,
            layers,
        })
    }
}
