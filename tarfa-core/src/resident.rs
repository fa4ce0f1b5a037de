//! The non-expert weights of a model, fetched once from a [`WeightSource`] and checked against
//! the shapes the config implies.
//!
//! Norm weights and biases are widened to f32 here (exactly); matrices stay as the source gave
//! them (BF16 or F32). This module must never convert a matrix's precision.

use std::sync::Arc;

use crate::config::MoeConfig;
use crate::model::{layer_name, ArchSpec, MlpKind, QkNorm};
use crate::numerics::{bf16_to_f32, MatrixRef};
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
    pub shared: Option<(DenseMlp, Matrix)>,
}

/// The MLP of one layer.
#[derive(Clone, Debug)]
pub enum LayerMlp {
    Dense(DenseMlp),
    Moe(MoeResident),
}

/// One decoder layer's resident weights.
#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    pub post_attention_norm: Vec<f32>,
    pub attention: AttentionWeights,
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

fn matrix(
    src: &dyn WeightSource,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<Matrix, WeightError> {
    let t = src.tensor(name)?;
    if t.shape != [rows, cols] {
        return Err(WeightError::ShapeMismatch {
            name: name.to_string(),
            expected: vec![rows, cols],
            found: t.shape.clone(),
        });
    }
    Ok(Matrix {
        rows,
        cols,
        tensor: t,
    })
}

fn vector(src: &dyn WeightSource, name: &str, len: usize) -> Result<Vec<f32>, WeightError> {
    let t = src.tensor(name)?;
    if t.shape != [len] {
        return Err(WeightError::ShapeMismatch {
            name: name.to_string(),
            expected: vec![len],
            found: t.shape.clone(),
        });
    }
    Ok(match &t.data {
        TensorData::Bf16(d) => d.iter().map(|&b| bf16_to_f32(b)).collect(),
        TensorData::F32(d) => d.to_vec(),
    })
}

impl ResidentWeights {
    /// Fetches and checks every non-expert tensor the spec names.
    pub fn load(
        cfg: &MoeConfig,
        spec: &ArchSpec,
        src: &dyn WeightSource,
    ) -> Result<ResidentWeights, WeightError> {
        let n = &spec.names;
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let (hq, hkv, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let embed = matrix(src, n.embed, v, h)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            matrix(src, n.lm_head, v, h)?
        };
        let final_norm = vector(src, n.final_norm, h)?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for (l, kind) in spec.layers.iter().enumerate() {
            let name = |p: &str| layer_name(p, l);
            let bias = |p: &str, len: usize, on: bool| -> Result<Option<Vec<f32>>, WeightError> {
                if on {
                    vector(src, &name(p), len).map(Some)
                } else {
                    Ok(None)
                }
            };
            let (qn_len, kn_len) = match spec.qk_norm {
                QkNorm::None => (0, 0),
                QkNorm::PerHead => (d, d),
                QkNorm::WholeProjection => (hq * d, hkv * d),
            };
            let has_qk_norm = spec.qk_norm != QkNorm::None;
            let attention = AttentionWeights {
                q: matrix(src, &name(n.q_proj), hq * d, h)?,
                k: matrix(src, &name(n.k_proj), hkv * d, h)?,
                v: matrix(src, &name(n.v_proj), hkv * d, h)?,
                o: matrix(src, &name(n.o_proj), h, hq * d)?,
                q_bias: bias(n.q_bias, hq * d, spec.qkv_bias)?,
                k_bias: bias(n.k_bias, hkv * d, spec.qkv_bias)?,
                v_bias: bias(n.v_bias, hkv * d, spec.qkv_bias)?,
                o_bias: bias(n.o_bias, h, spec.o_bias)?,
                q_norm: bias(n.q_norm, qn_len, has_qk_norm)?,
                k_norm: bias(n.k_norm, kn_len, has_qk_norm)?,
            };
            let mlp = match kind {
                MlpKind::Dense => {
                    // ArchSpec only marks a layer dense when the config has the dense width.
                    let f = cfg.dense_width.unwrap_or(0);
                    LayerMlp::Dense(DenseMlp {
                        gate: matrix(src, &name(n.dense_gate), f, h)?,
                        up: matrix(src, &name(n.dense_up), f, h)?,
                        down: matrix(src, &name(n.dense_down), h, f)?,
                    })
                }
                MlpKind::Moe => {
                    let shared = match cfg.shared_expert_width {
                        Some(s) if spec.shared_expert => Some((
                            DenseMlp {
                                gate: matrix(src, &name(n.shared_gate_proj), s, h)?,
                                up: matrix(src, &name(n.shared_up_proj), s, h)?,
                                down: matrix(src, &name(n.shared_down_proj), h, s)?,
                            },
                            matrix(src, &name(n.shared_expert_gate), 1, h)?,
                        )),
                        _ => None,
                    };
                    LayerMlp::Moe(MoeResident {
                        router: matrix(src, &name(n.router), cfg.num_experts, h)?,
                        shared,
                    })
                }
            };
            layers.push(LayerWeights {
                input_norm: vector(src, &name(n.input_norm), h)?,
                post_attention_norm: vector(src, &name(n.post_attention_norm), h)?,
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
