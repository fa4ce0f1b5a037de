//! Random models of every family, built in memory, for comparing backends on shapes and config
//! paths the oracle fixtures do not cover (shared experts, biases, whole-projection q/k norm,
//! dense layers, larger sizes). Weights are BF16 (F32 where `f32_matrices` asks, to exercise that
//! path), roughly uniform with a 1/sqrt(fan-in) scale; norms near 1; biases small.
//!
//! Test material only: an [`InMemorySource`] verifies nothing and must never serve a bundle.

use tarfa_core::config::MoeConfig;
use tarfa_core::model::{expert_name, layer_name, ArchSpec, MlpKind, QkNorm};
use tarfa_core::numerics::{f32_to_bf16_rne, AlignedVec};
use tarfa_core::weights::{Bf16Matrix, ExpertWeights, HostTensor, InMemorySource, TensorData};

/// Shape of a random model.
#[derive(Clone, Debug)]
pub struct SyntheticShape {
    /// `model_type`: qwen3_moe, qwen2_moe, mixtral or olmoe.
    pub family: String,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub experts: usize,
    pub top_k: usize,
    pub expert_width: usize,
    /// Dense MLP width (Qwen families' dense layers) and the shared expert's width (Qwen2-MoE).
    pub dense_width: usize,
    pub vocab: usize,
    /// Qwen families: every `decoder_sparse_step`-th layer is MoE; `mlp_only_layers` are dense.
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
    pub tie_embeddings: bool,
    pub norm_topk_prob: bool,
    /// Store the attention matrices and the lm_head as F32 instead of BF16.
    pub f32_matrices: bool,
}

impl SyntheticShape {
    /// A small model of `family` with every optional path of that family switched on.
    pub fn small(family: &str) -> SyntheticShape {
        SyntheticShape {
            family: family.to_string(),
            layers: 3,
            hidden: 96,
            heads: 4,
            kv_heads: 2,
            head_dim: 24,
            experts: 10,
            top_k: 3,
            expert_width: 40,
            dense_width: 80,
            vocab: 700,
            decoder_sparse_step: if family == "qwen2_moe" { 2 } else { 1 },
            mlp_only_layers: if family == "qwen3_moe" {
                vec![2]
            } else {
                vec![]
            },
            tie_embeddings: family == "olmoe",
            norm_topk_prob: family != "olmoe",
            f32_matrices: family == "mixtral",
        }
    }

    /// The config.json this shape stands for.
    pub fn config_json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "model_type": self.family,
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "num_experts_per_tok": self.top_k,
            "norm_topk_prob": self.norm_topk_prob,
            "tie_word_embeddings": self.tie_embeddings,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096,
            "rope_theta": 1_000_000.0,
            "hidden_act": "silu",
        });
        let o = v.as_object_mut().expect("object");
        match self.family.as_str() {
            "mixtral" => {
                o.insert("num_local_experts".into(), self.experts.into());
                o.insert("intermediate_size".into(), self.expert_width.into());
            }
            "olmoe" => {
                o.insert("num_experts".into(), self.experts.into());
                o.insert("intermediate_size".into(), self.expert_width.into());
            }
            _ => {
                o.insert("num_experts".into(), self.experts.into());
                o.insert("moe_intermediate_size".into(), self.expert_width.into());
                o.insert("intermediate_size".into(), self.dense_width.into());
                o.insert(
                    "decoder_sparse_step".into(),
                    self.decoder_sparse_step.into(),
                );
                o.insert(
                    "mlp_only_layers".into(),
                    self.mlp_only_layers.clone().into(),
                );
                if self.family == "qwen2_moe" {
                    o.insert(
                        "shared_expert_intermediate_size".into(),
                        self.dense_width.into(),
                    );
                }
            }
        }
        v
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// A random model of `shape`: its config and a source holding every tensor and expert.
pub fn random_model(shape: &SyntheticShape, seed: u64) -> (MoeConfig, InMemorySource) {
    let cfg = MoeConfig::from_json_object(shape.config_json().as_object().expect("object"))
        .expect("a synthetic shape makes a valid config");
    let spec = ArchSpec::new(&cfg);
    let n = spec.names;
    let mut rng = Rng(seed);
    let mut src = InMemorySource::new();
    let bf16 = |rng: &mut Rng, len: usize, scale: f32| -> AlignedVec<u16> {
        let v: Vec<u16> = (0..len)
            .map(|_| f32_to_bf16_rne(rng.unit() * scale))
            .collect();
        AlignedVec::from_slice(&v)
    };
    let mat = |rng: &mut Rng, rows: usize, cols: usize, f32_data: bool| -> HostTensor {
        let scale = 1.7 / (cols as f32).sqrt();
        let data = if f32_data {
            let v: Vec<f32> = (0..rows * cols).map(|_| rng.unit() * scale).collect();
            TensorData::F32(AlignedVec::from_slice(&v))
        } else {
            TensorData::Bf16(bf16(rng, rows * cols, scale))
        };
        HostTensor::new("m", vec![rows, cols], data).expect("shape")
    };
    let vector = |rng: &mut Rng, len: usize, center: f32, spread: f32| -> HostTensor {
        let v: Vec<u16> = (0..len)
            .map(|_| f32_to_bf16_rne(center + spread * rng.unit()))
            .collect();
        HostTensor::new("v", vec![len], TensorData::Bf16(AlignedVec::from_slice(&v)))
            .expect("shape")
    };
    let (h, d, hq, hkv) = (shape.hidden, shape.head_dim, shape.heads, shape.kv_heads);
    let f32m = shape.f32_matrices;
    src.insert_tensor(n.embed, mat(&mut rng, shape.vocab, h, false));
    if !cfg.tie_word_embeddings {
        src.insert_tensor(n.lm_head, mat(&mut rng, shape.vocab, h, f32m));
    }
    src.insert_tensor(n.final_norm, vector(&mut rng, h, 1.0, 0.2));
    for l in 0..cfg.num_layers {
        let name = |p: &str| layer_name(p, l);
        src.insert_tensor(name(n.input_norm), vector(&mut rng, h, 1.0, 0.2));
        src.insert_tensor(name(n.post_attention_norm), vector(&mut rng, h, 1.0, 0.2));
        src.insert_tensor(name(n.q_proj), mat(&mut rng, hq * d, h, f32m));
        src.insert_tensor(name(n.k_proj), mat(&mut rng, hkv * d, h, f32m));
        src.insert_tensor(name(n.v_proj), mat(&mut rng, hkv * d, h, f32m));
        src.insert_tensor(name(n.o_proj), mat(&mut rng, h, hq * d, f32m));
        if spec.qkv_bias {
            src.insert_tensor(name(n.q_bias), vector(&mut rng, hq * d, 0.0, 0.1));
            src.insert_tensor(name(n.k_bias), vector(&mut rng, hkv * d, 0.0, 0.1));
            src.insert_tensor(name(n.v_bias), vector(&mut rng, hkv * d, 0.0, 0.1));
        }
        if spec.o_bias {
            src.insert_tensor(name(n.o_bias), vector(&mut rng, h, 0.0, 0.1));
        }
        match spec.qk_norm {
            QkNorm::PerHead => {
                src.insert_tensor(name(n.q_norm), vector(&mut rng, d, 1.0, 0.2));
                src.insert_tensor(name(n.k_norm), vector(&mut rng, d, 1.0, 0.2));
            }
            QkNorm::WholeProjection => {
                src.insert_tensor(name(n.q_norm), vector(&mut rng, hq * d, 1.0, 0.2));
                src.insert_tensor(name(n.k_norm), vector(&mut rng, hkv * d, 1.0, 0.2));
            }
            QkNorm::None | QkNorm::L2AfterRope => {}
        }
        match spec.layers[l] {
            MlpKind::Dense => {
                let f = cfg.dense_width.unwrap_or(0);
                src.insert_tensor(name(n.dense_gate), mat(&mut rng, f, h, false));
                src.insert_tensor(name(n.dense_up), mat(&mut rng, f, h, false));
                src.insert_tensor(name(n.dense_down), mat(&mut rng, h, f, false));
            }
            MlpKind::Moe => {
                src.insert_tensor(name(n.router), mat(&mut rng, cfg.num_experts, h, false));
                if let (true, Some(s)) = (spec.shared_expert, cfg.shared_expert_width) {
                    src.insert_tensor(name(n.shared_gate_proj), mat(&mut rng, s, h, false));
                    src.insert_tensor(name(n.shared_up_proj), mat(&mut rng, s, h, false));
                    src.insert_tensor(name(n.shared_down_proj), mat(&mut rng, h, s, false));
                    src.insert_tensor(name(n.shared_expert_gate), mat(&mut rng, 1, h, false));
                }
                let i = cfg.expert_width;
                for e in 0..cfg.num_experts {
                    let _ = expert_name(n.expert_gate, l, e);
                    let mut m = |rows: usize, cols: usize| Bf16Matrix {
                        rows,
                        cols,
                        data: bf16(&mut rng, rows * cols, 1.7 / (cols as f32).sqrt()),
                    };
                    let w = ExpertWeights {
                        gate: m(i, h),
                        up: m(i, h),
                        down: m(h, i),
                    };
                    src.insert_expert(l, e, w);
                }
            }
        }
    }
    (cfg, src)
}
