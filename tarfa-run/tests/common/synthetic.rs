//! Small random models of any family, built in memory from a config: for tests of structure
//! (dense layers, biases, shared experts, tied embeddings) that the oracle fixtures do not cover,
//! and of error paths.

use serde_json::Value;
use tarfa_run::config::MoeConfig;
use tarfa_run::model::{expert_name, layer_name, ArchSpec, MlpKind, QkNorm};
use tarfa_run::numerics::{f32_to_bf16_rne, AlignedVec};
use tarfa_run::weights::{Bf16Matrix, ExpertWeights, HostTensor, InMemorySource, TensorData};

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32) / (1u64 << 23) as f32 - 1.0
    }
    pub fn bf16s(&mut self, n: usize, scale: f32, offset: f32) -> AlignedVec<u16> {
        let v: Vec<u16> = (0..n)
            .map(|_| f32_to_bf16_rne(offset + scale * self.unit()))
            .collect();
        v.into()
    }
}

/// A config in the style transformers writes, for `model_type`, with overrides.
pub fn config_json(model_type: &str, overrides: Value) -> Value {
    let mut v = serde_json::json!({
        "model_type": model_type,
        "vocab_size": 96, "hidden_size": 64, "intermediate_size": 80,
        "moe_intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 3,
        "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "tie_word_embeddings": false, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "shared_expert_intermediate_size": 56, "hidden_act": "silu"
    });
    if let (Some(o), Some(over)) = (v.as_object_mut(), overrides.as_object()) {
        for (k, x) in over {
            o.insert(k.clone(), x.clone());
        }
    }
    v
}

pub fn parse(v: &Value) -> MoeConfig {
    MoeConfig::from_json_object(v.as_object().unwrap()).unwrap()
}

/// Random weights for every tensor the family names under `cfg`.
pub fn random_source(cfg: &MoeConfig, seed: u64) -> InMemorySource {
    let spec = ArchSpec::new(cfg);
    let n = spec.names;
    let mut rng = Rng(seed);
    let mut src = InMemorySource::new();
    let (h, v, d) = (cfg.hidden_size, cfg.vocab_size, cfg.head_dim);
    let (hq, hkv) = (cfg.num_heads, cfg.num_kv_heads);
    let mat = |src: &mut InMemorySource, rng: &mut Rng, name: String, rows: usize, cols: usize| {
        let scale = 1.5 / (cols as f32).sqrt();
        let t = HostTensor::new(
            &name,
            vec![rows, cols],
            TensorData::Bf16(rng.bf16s(rows * cols, scale, 0.0)),
        )
        .unwrap();
        src.insert_tensor(name, t);
    };
    let vecf = |src: &mut InMemorySource, rng: &mut Rng, name: String, len: usize, offset: f32| {
        let t = HostTensor::new(
            &name,
            vec![len],
            TensorData::Bf16(rng.bf16s(len, 0.2, offset)),
        )
        .unwrap();
        src.insert_tensor(name, t);
    };
    mat(&mut src, &mut rng, n.embed.to_string(), v, h);
    if !cfg.tie_word_embeddings {
        mat(&mut src, &mut rng, n.lm_head.to_string(), v, h);
    }
    vecf(&mut src, &mut rng, n.final_norm.to_string(), h, 1.0);
    for (l, kind) in spec.layers.iter().enumerate() {
        let name = |p: &str| layer_name(p, l);
        vecf(&mut src, &mut rng, name(n.input_norm), h, 1.0);
        vecf(&mut src, &mut rng, name(n.post_attention_norm), h, 1.0);
        mat(&mut src, &mut rng, name(n.q_proj), hq * d, h);
        mat(&mut src, &mut rng, name(n.k_proj), hkv * d, h);
        mat(&mut src, &mut rng, name(n.v_proj), hkv * d, h);
        mat(&mut src, &mut rng, name(n.o_proj), h, hq * d);
        if spec.qkv_bias {
            vecf(&mut src, &mut rng, name(n.q_bias), hq * d, 0.0);
            vecf(&mut src, &mut rng, name(n.k_bias), hkv * d, 0.0);
            vecf(&mut src, &mut rng, name(n.v_bias), hkv * d, 0.0);
        }
        if spec.o_bias {
            vecf(&mut src, &mut rng, name(n.o_bias), h, 0.0);
        }
        match spec.qk_norm {
            QkNorm::None | QkNorm::L2AfterRope => {}
            QkNorm::PerHead => {
                vecf(&mut src, &mut rng, name(n.q_norm), d, 1.0);
                vecf(&mut src, &mut rng, name(n.k_norm), d, 1.0);
            }
            QkNorm::WholeProjection => {
                vecf(&mut src, &mut rng, name(n.q_norm), hq * d, 1.0);
                vecf(&mut src, &mut rng, name(n.k_norm), hkv * d, 1.0);
            }
        }
        match kind {
            MlpKind::Dense => {
                let f = cfg.dense_width.unwrap();
                mat(&mut src, &mut rng, name(n.dense_gate), f, h);
                mat(&mut src, &mut rng, name(n.dense_up), f, h);
                mat(&mut src, &mut rng, name(n.dense_down), h, f);
            }
            MlpKind::Moe => {
                mat(&mut src, &mut rng, name(n.router), cfg.num_experts, h);
                if let Some(s) = cfg.shared_expert_width.filter(|_| spec.shared_expert) {
                    mat(&mut src, &mut rng, name(n.shared_gate_proj), s, h);
                    mat(&mut src, &mut rng, name(n.shared_up_proj), s, h);
                    mat(&mut src, &mut rng, name(n.shared_down_proj), h, s);
                    mat(&mut src, &mut rng, name(n.shared_expert_gate), 1, h);
                }
                let i = cfg.expert_width;
                for e in 0..cfg.num_experts {
                    let _ = expert_name(n.expert_gate, l, e);
                    let mut m = |rows: usize, cols: usize| Bf16Matrix {
                        rows,
                        cols,
                        data: rng.bf16s(rows * cols, 1.5 / (cols as f32).sqrt(), 0.0),
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
    src
}
