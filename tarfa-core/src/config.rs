//! Parsing a Hugging Face `config.json` of an MoE decoder into a validated [`MoeConfig`].
//!
//! The family (from `model_type`) says which keys hold what (see [`crate::model::Family`]); this
//! module reads them, applies transformers' defaults, and checks every value the forward relies
//! on. Each failed check is its own error variant naming the key. This module must never guess:
//! a feature the runtime does not implement (rope scaling, sliding windows, another activation)
//! is an error, not a silent approximation.

use serde_json::{Map, Value};

use crate::model::{
    family_by_model_type, ArchSpec, AttentionKind, DenseLayerRule, Family, Flag, MlpKind, QkNorm,
    RouterRule, SharedExpertRule, FAMILIES,
};
use crate::numerics::rope::{yarn_mscale, Llama3, RopeError, RopeTable, Yarn};

/// A config.json that cannot be run.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    /// The text is not JSON.
    #[error("config.json is not valid JSON: {0}")]
    Json(String),
    /// The JSON is not an object.
    #[error("config.json is not a JSON object")]
    NotAnObject,
    /// A required key is absent (or null).
    #[error("config key `{key}` is missing")]
    Missing { key: &'static str },
    /// A key holds the wrong JSON type.
    #[error("config key `{key}` must be {expected}, found {found}")]
    WrongType {
        key: &'static str,
        expected: &'static str,
        found: String,
    },
    /// A key holds a value outside what the model can be.
    #[error("config key `{key}` = {value} is out of range: {why}")]
    OutOfRange {
        key: &'static str,
        value: String,
        why: &'static str,
    },
    /// `model_type` names no family this build implements.
    #[error("model_type `{0}` is not a supported MoE family (supported: {1})")]
    UnsupportedFamily(String, String),
    /// A key asks for a feature the runtime does not implement.
    #[error("config key `{key}` = {value} is not supported: {why}")]
    Unsupported {
        key: &'static str,
        value: String,
        why: &'static str,
    },
    /// `num_attention_heads` is not a multiple of `num_key_value_heads`.
    #[error("num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")]
    HeadsNotMultipleOfKvHeads { heads: usize, kv_heads: usize },
    /// `num_experts_per_tok` exceeds the number of experts.
    #[error("num_experts_per_tok {top_k} exceeds the number of experts {experts}")]
    TopKExceedsExperts { top_k: usize, experts: usize },
    /// A layer listed in `mlp_only_layers` does not exist.
    #[error("mlp_only_layers names layer {layer}, but num_hidden_layers is {layers}")]
    MlpOnlyLayerOutOfRange { layer: usize, layers: usize },
    /// `n_group` does not divide the number of routed experts.
    #[error("n_group {groups} does not divide n_routed_experts {experts}")]
    GroupsDoNotDivideExperts { groups: usize, experts: usize },
    /// Group-limited routing scores a group by its two best experts: a group needs two.
    #[error("n_group {groups} leaves fewer than 2 experts per group (n_routed_experts {experts}); a group is scored by the sum of its two best")]
    GroupTooSmall { groups: usize, experts: usize },
    /// `topk_group` exceeds `n_group`.
    #[error("topk_group {topk_group} exceeds n_group {groups}")]
    TopKGroupExceedsGroups { topk_group: usize, groups: usize },
    /// The kept groups hold fewer experts than `num_experts_per_tok`.
    #[error(
        "num_experts_per_tok {top_k} exceeds the {kept} experts of the topk_group groups kept"
    )]
    TopKExceedsKeptGroups { top_k: usize, kept: usize },
}

/// The group-limited sigmoid router's keys (DeepSeek-V3, GLM-4.5).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupRouting {
    /// `n_group`: the experts split into this many equal groups, in id order.
    pub n_group: usize,
    /// `topk_group`: the groups kept.
    pub topk_group: usize,
    /// `routed_scaling_factor` as written; the forward multiplies by `f32(factor)`.
    pub routed_scaling_factor: f64,
}

/// Multi-head latent attention's dimensions (DeepSeek-V2/V3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaDims {
    /// `q_lora_rank`: the q LoRA's rank, or None for a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// `kv_lora_rank` (r): the latent's width.
    pub kv_lora_rank: usize,
    /// `qk_nope_head_dim`: the part of each query/key head without rotary embedding.
    pub qk_nope_head_dim: usize,
    /// `qk_rope_head_dim`: the rotated part, shared by all heads on the key side.
    pub qk_rope_head_dim: usize,
    /// `v_head_dim`.
    pub v_head_dim: usize,
    /// Whether the rope part is read as interleaved pairs `(x0, x1), (x2, x3), ...` and
    /// de-interleaved before the rotate-half rotation (V3's `rope_interleave`; V2's complex
    /// form always is).
    pub rope_interleave: bool,
}

impl MlaDims {
    /// `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// One cached position of one layer: the normed latent and the rotated rope key.
    pub fn latent_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }
}

/// A gated DeltaNet layer's dimensions (Qwen3-Next, Qwen3.5 MoE).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearDims {
    /// `linear_num_key_heads` (Hk): query and key heads.
    pub key_heads: usize,
    /// `linear_num_value_heads` (Hv): value heads, each with its own state; a multiple of Hk,
    /// key head `h / (Hv / Hk)` serving value head `h`.
    pub value_heads: usize,
    /// `linear_key_head_dim` (Dk).
    pub key_dim: usize,
    /// `linear_value_head_dim` (Dv).
    pub value_dim: usize,
    /// `linear_conv_kernel_dim` (K): the causal depthwise convolution's width.
    pub conv_kernel: usize,
}

impl LinearDims {
    /// `Hk * Dk`: the width of q, and of k.
    pub fn key_width(&self) -> usize {
        self.key_heads * self.key_dim
    }

    /// `Hv * Dv`: the width of v, of z and of the output.
    pub fn value_width(&self) -> usize {
        self.value_heads * self.value_dim
    }

    /// The convolution's channels, `q | k | v`: `2 Hk Dk + Hv Dv`.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_width() + self.value_width()
    }

    /// One layer's recurrent state in values: `Hv * Dv * Dk`.
    pub fn state_len(&self) -> usize {
        self.value_heads * self.value_dim * self.key_dim
    }

    /// One layer's convolution state in values: the last `K - 1` inputs of every channel.
    pub fn conv_state_len(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_channels()
    }
}

/// How a checkpoint stores its expert matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertDtype {
    /// BF16, widened exactly to f32.
    Bf16,
    /// MXFP4 as gpt-oss is released (`quantization_config.quant_method = "mxfp4"`): two e2m1
    /// values per byte, low nibble first, and one e8m0 scale (bias 127) per 32 values, widened
    /// exactly to BF16 (docs/EXACTNESS.md, "MXFP4").
    Mxfp4,
}

/// The validated, family-resolved configuration of an MoE decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// The family (from `model_type`).
    pub family: &'static Family,
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `hidden_size` (H).
    pub hidden_size: usize,
    /// `num_hidden_layers`.
    pub num_layers: usize,
    /// `num_attention_heads` (Hq).
    pub num_heads: usize,
    /// `num_key_value_heads` (Hkv; defaults to Hq).
    pub num_kv_heads: usize,
    /// `head_dim` (D; defaults to H / Hq).
    pub head_dim: usize,
    /// Number of routed experts (E).
    pub num_experts: usize,
    /// `num_experts_per_tok` (k).
    pub top_k: usize,
    /// Expert intermediate width (I).
    pub expert_width: usize,
    /// Dense-MLP width for dense layers (families that have them).
    pub dense_width: Option<usize>,
    /// Shared-expert width (Qwen2-MoE).
    pub shared_expert_width: Option<usize>,
    /// Whether the selected top-k probabilities are renormalised.
    pub renormalize_topk: bool,
    /// `decoder_sparse_step` (default 1).
    pub decoder_sparse_step: usize,
    /// `mlp_only_layers` (default empty).
    pub mlp_only_layers: Vec<usize>,
    /// `tie_word_embeddings` (default false).
    pub tie_word_embeddings: bool,
    /// `rms_norm_eps` as written (the forward uses `f32(eps)`).
    pub rms_norm_eps: f64,
    /// `max_position_embeddings`.
    pub max_position_embeddings: usize,
    /// `rope_parameters.rope_theta` or top-level `rope_theta`.
    pub rope_theta: f64,
    /// Biases on q, k, v.
    pub qkv_bias: bool,
    /// Bias on o.
    pub o_bias: bool,
    /// `eos_token_id` (int or list; empty when null). Ids outside the vocabulary are kept here
    /// and can never be generated.
    pub eos_token_ids: Vec<u64>,
    /// Rotary embedding width per head: `head_dim`, or `int(head_dim x partial_rotary_factor)`
    /// for a family that reads that key (the leading dimensions rotate, the rest pass through).
    pub rotary_dim: usize,
    /// Whether the family's q/k norm is present (`use_qk_norm` for GLM-4.5).
    pub qk_norm_on: bool,
    /// `first_k_dense_replace` (families with that rule; 0 otherwise).
    pub first_k_dense_replace: usize,
    /// The group-limited sigmoid router's keys (families with that rule).
    pub group_routing: Option<GroupRouting>,
    /// `num_nextn_predict_layers`: multi-token-prediction layers the checkpoint may carry past
    /// `num_hidden_layers`. They are never run (next-token logits do not use them).
    pub nextn_predict_layers: usize,
    /// Multi-head latent attention's dimensions (families with that attention).
    pub mla: Option<MlaDims>,
    /// YaRN rotary scaling, when the config asks for it.
    pub yarn: Option<Yarn>,
    /// Llama 3.1's rotary scaling (`rope_type: llama3`), read for Llama 4 only.
    pub llama3_rope: Option<Llama3>,
    /// Per layer, the sliding window: a token attends to the last `w` positions (itself
    /// included), or to every earlier position when None (gpt-oss's `layer_types`, Mixtral's
    /// `sliding_window`).
    pub layer_windows: Vec<Option<usize>>,
    /// How the expert matrices are stored.
    pub expert_dtype: ExpertDtype,
    /// OLMoE's `clip_qkv`: q, k and v clamped to `[-c, c]` after their projections.
    pub clip_qkv: Option<f64>,
    /// Llama 4's MoE layers, ascending: `moe_layers`, or every `interleave_moe_layer_step`-th
    /// layer (`step - 1, 2 step - 1, ...`) when it is absent. Empty for other families.
    pub moe_layers: Vec<usize>,
    /// Per layer, whether the rotary embedding is applied: false for Llama 4's NoPE layers
    /// (`no_rope_layers[l] == 0`), true everywhere else.
    pub layer_rope: Vec<bool>,
    /// Per layer, Llama 4's chunked attention: a token at `pos` attends to the positions
    /// `C * (pos / C) ..= pos` of its chunk (`layer_types` `chunked_attention`,
    /// `attention_chunk_size` C), or None.
    pub layer_chunks: Vec<Option<usize>>,
    /// Llama 4's attention temperature tuning of the NoPE layers' queries
    /// (`attn_temperature_tuning`), or None when off or for other families.
    pub attn_temperature: Option<AttnTemperature>,
    /// The hybrid families' gated DeltaNet dimensions, or None.
    pub linear: Option<LinearDims>,
    /// Per layer, whether it is a gated DeltaNet layer (`layer_types` `linear_attention`);
    /// false everywhere for other families.
    pub layer_linear: Vec<bool>,
}

/// Llama 4's attention temperature tuning: on a NoPE layer, the query at position `pos` is
/// multiplied by `log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1` (docs/EXACTNESS.md,
/// "Llama 4", gives the f32 operations).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnTemperature {
    /// `floor_scale` as written (the forward divides by `f32(floor_scale)`).
    pub floor_scale: f64,
    /// `attn_scale` as written (the forward multiplies by `f32(attn_scale)`).
    pub attn_scale: f64,
}

impl AttnTemperature {
    /// Llama 4's attention temperature at position `pos` (docs/EXACTNESS.md, "Llama 4"), in f32
    /// as transformers computes it: `f = floor((f32(pos) + 1) / f32(floor_scale))`,
    /// `l = f32(ln(1 + f))` (the logarithm in f64, rounded once), `s = l * f32(attn_scale) + 1`.
    /// One definition for every backend (the CUDA one uploads it per token: it needs a log).
    pub fn scale_at(&self, pos: usize) -> f32 {
        let f = ((pos as f32 + 1.0) / self.floor_scale as f32).floor();
        let l = crate::numerics::detmath::ln_f64(1.0 + f as f64) as f32;
        l * self.attn_scale as f32 + 1.0
    }
}

/// Typed access to one config object; every getter names its key in errors.
struct Reader<'a> {
    obj: &'a Map<String, Value>,
}

fn type_name(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("bool {b}"),
        Value::Number(n) => format!("number {n}"),
        Value::String(s) => format!("string {s:?}"),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

/// A config value as its JSON text (`4096`, `"yarn"`), or `null` when absent: messages show
/// what the file says, never a Rust rendering of it.
fn json_text(v: Option<&Value>) -> String {
    v.map_or_else(|| "null".to_string(), Value::to_string)
}

impl<'a> Reader<'a> {
    fn get(&self, key: &'static str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn usize_opt(&self, key: &'static str) -> Result<Option<usize>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| ConfigError::WrongType {
                    key,
                    expected: "a non-negative integer",
                    found: type_name(v),
                }),
        }
    }

    fn usize_req(&self, key: &'static str) -> Result<usize, ConfigError> {
        self.usize_opt(key)?.ok_or(ConfigError::Missing { key })
    }

    /// A required positive integer.
    fn positive(&self, key: &'static str) -> Result<usize, ConfigError> {
        let n = self.usize_req(key)?;
        if n == 0 {
            return Err(ConfigError::OutOfRange {
                key,
                value: "0".into(),
                why: "must be at least 1",
            });
        }
        Ok(n)
    }

    fn f64_opt(&self, key: &'static str) -> Result<Option<f64>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| ConfigError::WrongType {
                key,
                expected: "a number",
                found: type_name(v),
            }),
        }
    }

    fn bool_opt(&self, key: &'static str) -> Result<Option<bool>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| ConfigError::WrongType {
                key,
                expected: "true or false",
                found: type_name(v),
            }),
        }
    }

    fn str_opt(&self, key: &'static str) -> Result<Option<&'a str>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| ConfigError::WrongType {
                key,
                expected: "a string",
                found: type_name(v),
            }),
        }
    }

    fn flag(&self, flag: Flag) -> Result<bool, ConfigError> {
        match flag {
            Flag::Fixed(b) => Ok(b),
            Flag::Config(key, default) => Ok(self.bool_opt(key)?.unwrap_or(default)),
        }
    }
}

impl MoeConfig {
    /// Parses and validates the text of a `config.json`.
    pub fn from_json_str(text: &str) -> Result<MoeConfig, ConfigError> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| ConfigError::Json(e.to_string()))?;
        let obj = value.as_object().ok_or(ConfigError::NotAnObject)?;
        MoeConfig::from_json_object(obj)
    }

    /// Parses and validates a config already decoded as a JSON object.
    pub fn from_json_object(obj: &Map<String, Value>) -> Result<MoeConfig, ConfigError> {
        let r = Reader { obj };
        let model_type = r
            .str_opt("model_type")?
            .ok_or(ConfigError::Missing { key: "model_type" })?;
        let family = family_by_model_type(model_type).ok_or_else(|| {
            let known: Vec<&str> = FAMILIES.iter().map(|f| f.model_type).collect();
            ConfigError::UnsupportedFamily(model_type.to_string(), known.join(", "))
        })?;

        let vocab_size = r.positive("vocab_size")?;
        let hidden_size = r.positive("hidden_size")?;
        let num_layers = r.positive("num_hidden_layers")?;
        let num_heads = r.positive("num_attention_heads")?;
        let num_kv_heads = r.usize_opt("num_key_value_heads")?.unwrap_or(num_heads);
        if num_kv_heads == 0 {
            return Err(ConfigError::OutOfRange {
                key: "num_key_value_heads",
                value: "0".into(),
                why: "must be at least 1",
            });
        }
        if num_heads % num_kv_heads != 0 {
            return Err(ConfigError::HeadsNotMultipleOfKvHeads {
                heads: num_heads,
                kv_heads: num_kv_heads,
            });
        }
        let head_dim = match r.usize_opt("head_dim")? {
            Some(d) => d,
            None => {
                if hidden_size % num_heads != 0 {
                    return Err(ConfigError::OutOfRange {
                        key: "head_dim",
                        value: "absent".into(),
                        why: "hidden_size is not a multiple of num_attention_heads",
                    });
                }
                hidden_size / num_heads
            }
        };
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(ConfigError::OutOfRange {
                key: "head_dim",
                value: head_dim.to_string(),
                why: "must be even and at least 2 for rotary embeddings",
            });
        }

        let (head_dim, mla) = match family.attention {
            AttentionKind::Gqa => (head_dim, None),
            AttentionKind::Mla => {
                let m = mla_dims(&r, family)?;
                // transformers sets head_dim to qk_rope_head_dim (its rotary width); a config
                // that writes another is not the model transformers runs.
                if let Some(d) = r.usize_opt("head_dim")? {
                    if d != m.qk_rope_head_dim {
                        return Err(ConfigError::OutOfRange {
                            key: "head_dim",
                            value: d.to_string(),
                            why: "multi-head latent attention's head_dim is qk_rope_head_dim",
                        });
                    }
                }
                if num_kv_heads != num_heads {
                    return Err(ConfigError::OutOfRange {
                        key: "num_key_value_heads",
                        value: num_kv_heads.to_string(),
                        why: "multi-head latent attention has one key and value per query head",
                    });
                }
                (m.qk_rope_head_dim, Some(m))
            }
        };

        let mut num_experts = None;
        for &key in family.num_experts_keys {
            if let Some(n) = r.usize_opt(key)? {
                num_experts = Some((key, n));
                break;
            }
        }
        let (experts_key, num_experts) = num_experts.ok_or(ConfigError::Missing {
            key: family.num_experts_keys[0],
        })?;
        if num_experts == 0 {
            return Err(ConfigError::OutOfRange {
                key: experts_key,
                value: "0".into(),
                why: "an MoE model needs at least one expert",
            });
        }
        let top_k = r.positive("num_experts_per_tok")?;
        if top_k > num_experts {
            return Err(ConfigError::TopKExceedsExperts {
                top_k,
                experts: num_experts,
            });
        }
        let expert_width = r.positive(family.expert_width_key)?;
        let dense_width = match family.dense_width_key {
            Some(key) => r.usize_opt(key)?,
            None => None,
        };
        let shared_expert_width = match family.shared_expert {
            Some(SharedExpertRule::SigmoidGated { width_key }) => Some(r.positive(width_key)?),
            // n_shared_experts experts of the routed width, fused into one MLP as transformers
            // builds it.
            // Llama 4: one shared expert of the routed width
            Some(SharedExpertRule::UngatedExpertWidth) => Some(expert_width),
            Some(SharedExpertRule::Ungated { count_key }) => {
                let n = r.positive(count_key)?;
                Some(n.checked_mul(expert_width).ok_or(ConfigError::OutOfRange {
                    key: count_key,
                    value: n.to_string(),
                    why: "n_shared_experts x the expert width overflows",
                })?)
            }
            None => None,
        };
        let first_k_dense_replace = match family.dense_layers {
            DenseLayerRule::FirstKDense => {
                let k = r.usize_req("first_k_dense_replace")?;
                if k > num_layers {
                    return Err(ConfigError::OutOfRange {
                        key: "first_k_dense_replace",
                        value: k.to_string(),
                        why: "exceeds num_hidden_layers",
                    });
                }
                k
            }
            DenseLayerRule::None | DenseLayerRule::QwenSparseStep | DenseLayerRule::MoeLayers => 0,
        };
        let moe_layers = match family.dense_layers {
            DenseLayerRule::MoeLayers => moe_layers(&r, num_layers)?,
            DenseLayerRule::None | DenseLayerRule::QwenSparseStep | DenseLayerRule::FirstKDense => {
                Vec::new()
            }
        };
        let group_routing = match family.router {
            RouterRule::SoftmaxTopK
            | RouterRule::TopKThenSoftmax
            | RouterRule::SigmoidScalesInput => None,
            RouterRule::SigmoidGroupLimited => Some(group_routing(&r, num_experts, top_k)?),
            RouterRule::SoftmaxGroupLimited => Some(softmax_group_routing(&r, num_experts, top_k)?),
        };
        let nextn_predict_layers = r.usize_opt("num_nextn_predict_layers")?.unwrap_or(0);

        let decoder_sparse_step = r.usize_opt("decoder_sparse_step")?.unwrap_or(1);
        if decoder_sparse_step == 0 {
            return Err(ConfigError::OutOfRange {
                key: "decoder_sparse_step",
                value: "0".into(),
                why: "must be at least 1",
            });
        }
        let mlp_only_layers = match r.get("mlp_only_layers") {
            None => Vec::new(),
            Some(Value::Array(items)) => {
                let mut out = Vec::with_capacity(items.len());
                for v in items {
                    let l = v
                        .as_u64()
                        .and_then(|n| usize::try_from(n).ok())
                        .ok_or_else(|| ConfigError::WrongType {
                            key: "mlp_only_layers",
                            expected: "a list of layer indices",
                            found: type_name(v),
                        })?;
                    if l >= num_layers {
                        return Err(ConfigError::MlpOnlyLayerOutOfRange {
                            layer: l,
                            layers: num_layers,
                        });
                    }
                    out.push(l);
                }
                out
            }
            Some(v) => {
                return Err(ConfigError::WrongType {
                    key: "mlp_only_layers",
                    expected: "a list of layer indices",
                    found: type_name(v),
                })
            }
        };

        let tie_word_embeddings = r.bool_opt("tie_word_embeddings")?.unwrap_or(false);
        let rms_norm_eps = r.f64_opt("rms_norm_eps")?.ok_or(ConfigError::Missing {
            key: "rms_norm_eps",
        })?;
        // f32(eps) is what the forward adds: it must be a positive f32 too.
        if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0 && (rms_norm_eps as f32) > 0.0) {
            return Err(ConfigError::OutOfRange {
                key: "rms_norm_eps",
                value: json_text(r.get("rms_norm_eps")),
                why: "must be finite and positive (also as an f32)",
            });
        }
        let max_position_embeddings = r.positive("max_position_embeddings")?;

        // rope: transformers 5 nests it in rope_parameters; older configs have rope_theta and
        // rope_scaling at the top level.
        let (rope_theta, nested) = match r.get("rope_parameters") {
            Some(Value::Object(rp)) => {
                let rr = Reader { obj: rp };
                let theta = match rr.f64_opt("rope_theta")? {
                    Some(t) => t,
                    None => r.f64_opt("rope_theta")?.ok_or(ConfigError::Missing {
                        key: "rope_parameters.rope_theta",
                    })?,
                };
                (theta, Some(rp))
            }
            Some(v) => {
                return Err(ConfigError::WrongType {
                    key: "rope_parameters",
                    expected: "an object",
                    found: type_name(v),
                })
            }
            None => {
                let theta = r
                    .f64_opt("rope_theta")?
                    .ok_or(ConfigError::Missing { key: "rope_theta" })?;
                (theta, None)
            }
        };
        // The block that asks for scaling: rope_parameters when its rope_type is not the
        // default, or a top-level rope_scaling (transformers folds it in) that is not.
        let nested_scaling = match nested {
            Some(rp) => rope_block_type(rp, true)?.map(|t| (rp, t, true)),
            None => None,
        };
        let top_scaling = match r.get("rope_scaling") {
            None => None,
            Some(Value::Object(rs)) => rope_block_type(rs, false)?.map(|t| (rs, t, false)),
            Some(v) => {
                return Err(ConfigError::WrongType {
                    key: "rope_scaling",
                    expected: "an object or null",
                    found: type_name(v),
                })
            }
        };
        let mut llama3_rope = None;
        let yarn = match (nested_scaling, top_scaling) {
            (Some(_), Some((rs, _, _))) => return Err(ConfigError::Unsupported {
                key: "rope_scaling",
                value: Value::Object(rs.clone()).to_string(),
                why: "rope_parameters already asks for rotary scaling; two requests are ambiguous",
            }),
            (Some((block, t, nested)), None) | (None, Some((block, t, nested)))
                if t == "llama3" && family.extras.llama4_attention =>
            {
                llama3_rope = Some(llama3_block(block, nested)?);
                None
            }
            (Some((block, t, nested)), None) | (None, Some((block, t, nested))) => {
                if t != "yarn" {
                    return Err(ConfigError::Unsupported {
                        key: if nested {
                            "rope_parameters.rope_type"
                        } else {
                            "rope_scaling"
                        },
                        value: Value::String(t.to_string()).to_string(),
                        why: "the default rotary embedding and YaRN are implemented (and llama3 for Llama 4)",
                    });
                }
                Some(yarn_block(block, nested)?)
            }
            (None, None) => None,
        };
        if !(rope_theta.is_finite() && rope_theta > 1.0) {
            let written = match r.get("rope_parameters") {
                Some(Value::Object(rp)) if rp.contains_key("rope_theta") => rp.get("rope_theta"),
                _ => r.get("rope_theta"),
            };
            return Err(ConfigError::OutOfRange {
                key: "rope_theta",
                value: json_text(written),
                why: "must be finite and greater than 1",
            });
        }

        let rotary_dim = match mla {
            // the rope part of each head, whole
            Some(m) => m.qk_rope_head_dim,
            None => rotary_dim(&r, family, head_dim)?,
        };
        if let Some(m) = &mla {
            mla_refusals(&r, m)?;
        }

        if let Some(act) = r.str_opt("hidden_act")? {
            if act != "silu" {
                return Err(ConfigError::Unsupported {
                    key: "hidden_act",
                    value: Value::String(act.to_string()).to_string(),
                    why: "only silu (SwiGLU) experts are implemented",
                });
            }
        }
        let layer_windows = layer_windows(&r, family, num_layers)?;
        let (layer_rope, layer_chunks, attn_temperature) = if family.extras.llama4_attention {
            llama4_attention(&r, num_layers)?
        } else {
            (vec![true; num_layers], vec![None; num_layers], None)
        };
        let clip_qkv = match r.get("clip_qkv") {
            None => None,
            // OlmoeAttention clamps q, k and v; no other family reads the key.
            Some(v) if family.model_type == "olmoe" => {
                let c = r.f64_opt("clip_qkv")?.unwrap_or(0.0);
                if !(c.is_finite() && c > 0.0 && (c as f32).is_finite()) {
                    return Err(ConfigError::OutOfRange {
                        key: "clip_qkv",
                        value: v.to_string(),
                        why: "must be finite and positive (also as an f32)",
                    });
                }
                Some(c)
            }
            Some(v) => {
                return Err(ConfigError::Unsupported {
                    key: "clip_qkv",
                    value: v.to_string(),
                    why: "this family does not clip q/k/v",
                })
            }
        };
        let (linear, layer_linear) = match family.extras.linear_attention {
            Some(_) => {
                let (dims, layers) = linear_layers(&r, num_layers)?;
                (Some(dims), layers)
            }
            None => (None, vec![false; num_layers]),
        };
        mrope_sections(&r, family)?;
        let expert_dtype = expert_dtype(&r, family)?;
        if expert_dtype == ExpertDtype::Mxfp4 {
            // one e8m0 scale per 32 values along each matrix's input
            for (key, n) in [
                ("hidden_size", hidden_size),
                (family.expert_width_key, expert_width),
            ] {
                if !n.is_multiple_of(32) {
                    return Err(ConfigError::OutOfRange {
                        key,
                        value: n.to_string(),
                        why: "MXFP4 experts need a multiple of 32 (one scale per 32 values)",
                    });
                }
            }
        }
        if family.extras.activation != crate::model::ExpertActivation::SwiGlu {
            // GptOssExperts fixes its limit at 7.0; a config that writes another would not be
            // the model transformers runs.
            if let Some(lim) = r.f64_opt("swiglu_limit")? {
                if lim != 7.0 {
                    return Err(ConfigError::Unsupported {
                        key: "swiglu_limit",
                        value: json_text(r.get("swiglu_limit")),
                        why: "gpt-oss's experts clamp at 7.0",
                    });
                }
            }
        }

        let eos_token_ids = match r.get("eos_token_id") {
            None => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64().ok_or_else(|| ConfigError::WrongType {
                        key: "eos_token_id",
                        expected: "an integer or a list of integers",
                        found: type_name(v),
                    })
                })
                .collect::<Result<_, _>>()?,
            Some(v) => vec![v.as_u64().ok_or_else(|| ConfigError::WrongType {
                key: "eos_token_id",
                expected: "an integer or a list of integers",
                found: type_name(v),
            })?],
        };

        let cfg = MoeConfig {
            family,
            vocab_size,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            num_experts,
            top_k,
            expert_width,
            dense_width,
            shared_expert_width,
            renormalize_topk: r.flag(family.renormalize_topk)?,
            decoder_sparse_step,
            mlp_only_layers,
            tie_word_embeddings,
            rms_norm_eps,
            max_position_embeddings,
            rope_theta,
            qkv_bias: r.flag(family.qkv_bias)?,
            o_bias: r.flag(family.o_bias)?,
            eos_token_ids,
            rotary_dim,
            qk_norm_on: r.flag(family.qk_norm_on)?,
            first_k_dense_replace,
            group_routing,
            nextn_predict_layers,
            mla,
            yarn,
            llama3_rope,
            layer_windows,
            expert_dtype,
            clip_qkv,
            moe_layers,
            layer_rope,
            layer_chunks,
            attn_temperature,
            linear,
            layer_linear,
        };
        // A family with dense layers needs their width whenever one is dense.
        let spec = ArchSpec::new(&cfg);
        if spec.layers.contains(&MlpKind::Dense) && cfg.dense_width.is_none() {
            return Err(ConfigError::Missing {
                key: family.dense_width_key.unwrap_or("intermediate_size"),
            });
        }
        Ok(cfg)
    }

    /// `f32(rms_norm_eps)`, the value the forward adds.
    pub fn eps_f32(&self) -> f32 {
        self.rms_norm_eps as f32
    }

    /// A sequence's RoPE table: `rope_theta`, the rotary width, and YaRN when asked for.
    pub fn rope_table(&self) -> Result<RopeTable, RopeError> {
        match &self.llama3_rope {
            Some(l3) => RopeTable::with_llama3(self.rope_theta, self.rotary_dim, l3),
            None => RopeTable::with_scaling(self.rope_theta, self.rotary_dim, self.yarn.as_ref()),
        }
    }

    /// Multi-head latent attention's softmax scale, `f32(s)` of transformers' f64
    /// `s = qk_head_dim^-0.5`, times `m * m` for `m = mscale(factor, mscale_all_dim)` when YaRN
    /// writes a non-zero `mscale_all_dim` and the family applies it (`yarn_apply_mscale`).
    /// None for other attention.
    pub fn mla_softmax_scale(&self) -> Option<f32> {
        let m = self.mla?;
        let mut s = 1.0f64 / (m.qk_head_dim() as f64).sqrt();
        if let (true, Some(y)) = (self.family.yarn_softmax_mscale, &self.yarn) {
            if let Some(all) = y.mscale_all_dim.filter(|&a| a != 0.0) {
                let ms = yarn_mscale(y.factor, all);
                s = s * ms * ms;
            }
        }
        Some(s as f32)
    }

    /// EOS ids that are inside the vocabulary (olmoe-a names one outside it: such ids can never
    /// be produced and are ignored).
    pub fn eos_in_vocab(&self) -> Vec<u32> {
        self.eos_token_ids
            .iter()
            .filter(|&&id| id < self.vocab_size as u64)
            .map(|&id| id as u32)
            .collect()
    }
}

/// Each layer's sliding window. gpt-oss reads `layer_types` (`sliding_attention` layers use
/// `sliding_window`; absent, GptOssConfig's default alternates, layer 0 sliding). Mixtral applies
/// `sliding_window` to every layer whenever it is set (transformers' MixtralModel). The Qwen
/// families' `use_sliding_window` (with `max_window_layers`) and any other family's window are
/// refused by name.
fn layer_windows(
    r: &Reader<'_>,
    family: &Family,
    num_layers: usize,
) -> Result<Vec<Option<usize>>, ConfigError> {
    let window = r.usize_opt("sliding_window")?;
    let positive = |w: Option<usize>| -> Result<usize, ConfigError> {
        match w {
            Some(w) if w > 0 => Ok(w),
            Some(_) => Err(ConfigError::OutOfRange {
                key: "sliding_window",
                value: "0".into(),
                why: "must be at least 1",
            }),
            None => Err(ConfigError::Missing {
                key: "sliding_window",
            }),
        }
    };
    if family.extras.llama4_attention {
        // Llama 4's layer_types name chunked layers (read by `llama4_attention`); a sliding
        // window is no key of Llama4TextConfig, yet transformers' cache would read one.
        if let Some(v) = r.get("sliding_window") {
            return Err(ConfigError::Unsupported {
                key: "sliding_window",
                value: v.to_string(),
                why: "Llama 4 attends in chunks (attention_chunk_size), not in a sliding window",
            });
        }
        return Ok(vec![None; num_layers]);
    }
    if family.extras.layer_types {
        let types = layer_types(
            r,
            num_layers,
            "sliding_attention",
            "only sliding_attention and full_attention layers are implemented",
        )?
        .unwrap_or_else(|| (0..num_layers).map(|l| l % 2 == 0).collect());
        let w = if types.contains(&true) {
            Some(positive(window)?)
        } else {
            None
        };
        return Ok(types
            .into_iter()
            .map(|s| if s { w } else { None })
            .collect());
    }
    if let (Some(v), None) = (r.get("layer_types"), family.extras.linear_attention) {
        // Every other family (but the hybrids, whose linear layers `linear_layers` reads) is
        // all full attention; a list that says otherwise asks for
        // something this family does not do.
        let all_full = v
            .as_array()
            .is_some_and(|a| a.iter().all(|t| t.as_str() == Some("full_attention")));
        if !all_full {
            return Err(ConfigError::Unsupported {
                key: "layer_types",
                value: v.to_string(),
                why: "this family's layers are all full attention",
            });
        }
    }
    if family.model_type == "mixtral" {
        if r.bool_opt("use_sliding_window")? == Some(true) && window.is_none() {
            return Err(ConfigError::Missing {
                key: "sliding_window",
            });
        }
        return Ok(match window {
            None => vec![None; num_layers],
            Some(_) => vec![Some(positive(window)?); num_layers],
        });
    }
    // Qwen configs gate the window with use_sliding_window (and max_window_layers).
    let window_flag = r.bool_opt("use_sliding_window")?;
    let window = window.filter(|&w| w != 0);
    if window_flag == Some(true) || (window_flag.is_none() && window.is_some()) {
        // The value as the config writes it (`4096`, or `null` when only the flag is on).
        return Err(ConfigError::Unsupported {
            key: "sliding_window",
            value: json_text(r.get("sliding_window")),
            why:
                "sliding-window attention is implemented for gpt-oss's layer_types and Mixtral only",
        });
    }
    Ok(vec![None; num_layers])
}

/// `layer_types`, one entry per layer: true for `other`, false for `full_attention`, any other
/// type refused with `why`; None when absent (each family has its own default).
fn layer_types(
    r: &Reader<'_>,
    num_layers: usize,
    other: &str,
    why: &'static str,
) -> Result<Option<Vec<bool>>, ConfigError> {
    let items = match r.get("layer_types") {
        None => return Ok(None),
        Some(Value::Array(items)) => items,
        Some(v) => {
            return Err(ConfigError::WrongType {
                key: "layer_types",
                expected: "a list of layer types",
                found: type_name(v),
            })
        }
    };
    if items.len() != num_layers {
        return Err(ConfigError::OutOfRange {
            key: "layer_types",
            value: format!("{} entries", items.len()),
            why: "must name one type per layer (num_hidden_layers)",
        });
    }
    items
        .iter()
        .map(|v| match v.as_str() {
            Some(t) if t == other => Ok(true),
            Some("full_attention") => Ok(false),
            _ => Err(ConfigError::Unsupported {
                key: "layer_types",
                value: v.to_string(),
                why,
            }),
        })
        .collect::<Result<_, _>>()
        .map(Some)
}

/// The hybrid families' gated DeltaNet dimensions and which layers are linear: `layer_types`
/// (`linear_attention` / `full_attention`, one per layer), or when it is absent transformers'
/// default, every `full_attention_interval`-th layer (4) full and the rest linear. The
/// dimensions default to Qwen3NextConfig's (16 key heads, 32 value heads, 128 wide, kernel 4).
fn linear_layers(
    r: &Reader<'_>,
    num_layers: usize,
) -> Result<(LinearDims, Vec<bool>), ConfigError> {
    let dim = |key: &'static str, default: usize| -> Result<usize, ConfigError> {
        match r.usize_opt(key)? {
            None => Ok(default),
            Some(0) => Err(ConfigError::OutOfRange {
                key,
                value: "0".into(),
                why: "must be at least 1",
            }),
            Some(n) => Ok(n),
        }
    };
    let dims = LinearDims {
        key_heads: dim("linear_num_key_heads", 16)?,
        value_heads: dim("linear_num_value_heads", 32)?,
        key_dim: dim("linear_key_head_dim", 128)?,
        value_dim: dim("linear_value_head_dim", 128)?,
        conv_kernel: dim("linear_conv_kernel_dim", 4)?,
    };
    if !dims.value_heads.is_multiple_of(dims.key_heads) {
        return Err(ConfigError::OutOfRange {
            key: "linear_num_value_heads",
            value: dims.value_heads.to_string(),
            why: "must be a multiple of linear_num_key_heads (each key head serves Hv / Hk value heads)",
        });
    }
    let layers = match layer_types(
        r,
        num_layers,
        "linear_attention",
        "a hybrid layer is linear_attention or full_attention",
    )? {
        Some(l) => l,
        None => {
            let interval = dim("full_attention_interval", 4)?;
            (0..num_layers)
                .map(|l| !(l + 1).is_multiple_of(interval))
                .collect()
        }
    };
    Ok((dims, layers))
}

/// Qwen3.5's interleaved mRoPE (`rope_parameters.mrope_section`, `mrope_interleaved`): each
/// rotary frequency takes its angle from the temporal, height or width position id, as the
/// sections assign it, and on text the three ids are the same position. Whatever the sections,
/// that is the plain rotary embedding exactly (transformers' `Qwen3_5MoeTextRotaryEmbedding`
/// computes every frequency's angle from an equal position), so the keys are read for their
/// types only. A family without mRoPE refuses them.
fn mrope_sections(r: &Reader<'_>, family: &Family) -> Result<(), ConfigError> {
    let Some(Value::Object(rp)) = r.get("rope_parameters") else {
        return Ok(());
    };
    let section = rp.get("mrope_section").filter(|v| !v.is_null());
    let interleaved = rp.get("mrope_interleaved").filter(|v| !v.is_null());
    if section.is_none() && interleaved.is_none() {
        return Ok(());
    }
    if family.extras.linear_attention.is_none() {
        return Err(ConfigError::Unsupported {
            key: "rope_parameters.mrope_section",
            value: json_text(section.or(interleaved)),
            why: "multimodal rotary sections are read for the Qwen3.5 text model only",
        });
    }
    if let Some(v) = interleaved.filter(|v| !v.is_boolean()) {
        return Err(ConfigError::WrongType {
            key: "rope_parameters.mrope_interleaved",
            expected: "a bool",
            found: type_name(v),
        });
    }
    // transformers indexes the temporal, height and width sections: three widths
    let widths = section.map(|v| {
        v.as_array()
            .is_some_and(|a| a.len() == 3 && a.iter().all(Value::is_u64))
    });
    if let (Some(v), Some(false)) = (section, widths) {
        return Err(ConfigError::WrongType {
            key: "rope_parameters.mrope_section",
            expected: "a list of three section widths",
            found: type_name(v),
        });
    }
    Ok(())
}

/// A list of layer indices under `key`, or None when absent (or null).
fn layer_list(
    r: &Reader<'_>,
    key: &'static str,
    num_layers: usize,
) -> Result<Option<Vec<usize>>, ConfigError> {
    let Some(v) = r.get(key) else {
        return Ok(None);
    };
    let wrong = |found: &Value| ConfigError::WrongType {
        key,
        expected: "a list of layer indices",
        found: type_name(found),
    };
    let items = v.as_array().ok_or_else(|| wrong(v))?;
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let l = item
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| wrong(item))?;
        if l >= num_layers {
            return Err(ConfigError::OutOfRange {
                key,
                value: l.to_string(),
                why: "names a layer past num_hidden_layers",
            });
        }
        out.push(l);
    }
    Ok(Some(out))
}

/// Llama 4's MoE layers (Llama4TextConfig): `moe_layers` as written, else
/// `range(interleave_moe_layer_step - 1, num_hidden_layers, interleave_moe_layer_step)`.
fn moe_layers(r: &Reader<'_>, num_layers: usize) -> Result<Vec<usize>, ConfigError> {
    let step = r.usize_opt("interleave_moe_layer_step")?.unwrap_or(1);
    if step == 0 {
        return Err(ConfigError::OutOfRange {
            key: "interleave_moe_layer_step",
            value: "0".into(),
            why: "must be at least 1",
        });
    }
    let mut layers = match layer_list(r, "moe_layers", num_layers)? {
        Some(l) => l,
        None => (step - 1..num_layers).step_by(step).collect(),
    };
    layers.sort_unstable();
    layers.dedup();
    Ok(layers)
}

/// The per-layer parts of Llama 4's attention, as Llama4TextConfig resolves them:
/// - `no_rope_layers` (1: the layer rotates, 0: a NoPE layer), at least one entry per layer;
///   absent or empty, `int((l + 1) % no_rope_layer_interval != 0)` (default interval 4);
/// - `layer_types` (`chunked_attention` / `full_attention`, one per layer); absent, a rotating
///   layer is chunked and a NoPE layer full;
/// - `attention_chunk_size` (default 8192) for the chunked layers; written null, refused when
///   a layer is chunked (transformers' chunked mask needs it);
/// - `attn_temperature_tuning` (default true), `floor_scale` (8192), `attn_scale` (0.1).
#[allow(clippy::type_complexity)]
fn llama4_attention(
    r: &Reader<'_>,
    num_layers: usize,
) -> Result<(Vec<bool>, Vec<Option<usize>>, Option<AttnTemperature>), ConfigError> {
    let rope: Vec<bool> = match r.get("no_rope_layers") {
        Some(Value::Array(items)) if !items.is_empty() => {
            if items.len() < num_layers {
                return Err(ConfigError::OutOfRange {
                    key: "no_rope_layers",
                    value: format!("{} entries", items.len()),
                    why: "must hold an entry for every layer (num_hidden_layers)",
                });
            }
            items[..num_layers]
                .iter()
                .map(|v| match v.as_u64() {
                    Some(1) => Ok(true),
                    Some(0) => Ok(false),
                    _ => Err(ConfigError::OutOfRange {
                        key: "no_rope_layers",
                        value: v.to_string(),
                        why: "each entry is 1 (the layer uses rope) or 0 (a NoPE layer)",
                    }),
                })
                .collect::<Result<_, _>>()?
        }
        Some(Value::Array(_)) | None => {
            let interval = r.usize_opt("no_rope_layer_interval")?.unwrap_or(4);
            if interval == 0 {
                return Err(ConfigError::OutOfRange {
                    key: "no_rope_layer_interval",
                    value: "0".into(),
                    why: "must be at least 1",
                });
            }
            (0..num_layers)
                .map(|l| !(l + 1).is_multiple_of(interval))
                .collect()
        }
        Some(v) => {
            return Err(ConfigError::WrongType {
                key: "no_rope_layers",
                expected: "a list of 0 and 1",
                found: type_name(v),
            })
        }
    };
    let chunked: Vec<bool> = match r.get("layer_types") {
        None => rope.clone(),
        Some(Value::Array(items)) => {
            if items.len() != num_layers {
                return Err(ConfigError::OutOfRange {
                    key: "layer_types",
                    value: format!("{} entries", items.len()),
                    why: "must name one type per layer (num_hidden_layers)",
                });
            }
            items
                .iter()
                .map(|v| match v.as_str() {
                    Some("chunked_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(ConfigError::Unsupported {
                        key: "layer_types",
                        value: v.to_string(),
                        why: "Llama 4's layers are chunked_attention or full_attention",
                    }),
                })
                .collect::<Result<_, _>>()?
        }
        Some(v) => {
            return Err(ConfigError::WrongType {
                key: "layer_types",
                expected: "a list of layer types",
                found: type_name(v),
            })
        }
    };
    let chunk = if chunked.contains(&true) {
        if r.obj.get("attention_chunk_size") == Some(&Value::Null) {
            return Err(ConfigError::Missing {
                key: "attention_chunk_size",
            });
        }
        let c = r.usize_opt("attention_chunk_size")?.unwrap_or(8192);
        if c == 0 {
            return Err(ConfigError::OutOfRange {
                key: "attention_chunk_size",
                value: "0".into(),
                why: "must be at least 1",
            });
        }
        Some(c)
    } else {
        None
    };
    let chunks = chunked
        .iter()
        .map(|&c| if c { chunk } else { None })
        .collect();
    // Llama4TextAttention tests the key for truth (`if self.attn_temperature_tuning and not
    // self.use_rope`), and the released Scout/Maverick configs write it as the integer 4
    // (Llama4TextConfig's first default): a number is on unless it is 0.
    let tuning = match r.get("attn_temperature_tuning") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) if n.as_f64().is_some_and(f64::is_finite) => n.as_f64() != Some(0.0),
        Some(v) => {
            return Err(ConfigError::WrongType {
                key: "attn_temperature_tuning",
                expected: "true, false or a number (its truth value, as transformers reads it)",
                found: type_name(v),
            })
        }
    };
    let temperature = if tuning {
        let floor_scale = r.f64_opt("floor_scale")?.unwrap_or(8192.0);
        if !(floor_scale.is_finite() && floor_scale > 0.0 && (floor_scale as f32) > 0.0) {
            return Err(ConfigError::OutOfRange {
                key: "floor_scale",
                value: json_text(r.get("floor_scale")),
                why: "must be finite and positive (also as an f32)",
            });
        }
        let attn_scale = r.f64_opt("attn_scale")?.unwrap_or(0.1);
        if !(attn_scale.is_finite() && (attn_scale as f32).is_finite()) {
            return Err(ConfigError::OutOfRange {
                key: "attn_scale",
                value: json_text(r.get("attn_scale")),
                why: "must be finite (also as an f32)",
            });
        }
        Some(AttnTemperature {
            floor_scale,
            attn_scale,
        })
    } else {
        None
    };
    Ok((rope, chunks, temperature))
}

/// The experts' storage: BF16, or MXFP4 under `quantization_config.quant_method = "mxfp4"` for
/// a family released that way. Every other quantization is refused by name.
fn expert_dtype(r: &Reader<'_>, family: &Family) -> Result<ExpertDtype, ConfigError> {
    let Some(q) = r.get("quantization_config") else {
        return Ok(ExpertDtype::Bf16);
    };
    let method = q.get("quant_method").and_then(Value::as_str);
    match method {
        Some("mxfp4") if family.extras.mxfp4_experts => {
            // transformers' Mxfp4Config(dequantize=True) is a loading choice, not the model's;
            // any other key in the block would be a quantization this build does not know.
            let known = ["quant_method", "modules_to_not_convert", "dequantize"];
            if let Some(k) = q
                .as_object()
                .and_then(|o| o.keys().find(|k| !known.contains(&k.as_str())))
            {
                return Err(ConfigError::Unsupported {
                    key: "quantization_config",
                    value: Value::String(k.clone()).to_string(),
                    why: "an MXFP4 key this build does not implement",
                });
            }
            Ok(ExpertDtype::Mxfp4)
        }
        Some("mxfp4") => Err(ConfigError::Unsupported {
            key: "quantization_config.quant_method",
            value: "\"mxfp4\"".into(),
            why: "MXFP4 experts are read for gpt-oss only, as it is released",
        }),
        _ => Err(ConfigError::Unsupported {
            key: "quantization_config.quant_method",
            value: json_text(q.get("quant_method")),
            why: "quantized weights other than gpt-oss's released MXFP4 experts are not run (they would not be the checkpoint's own values widened exactly)",
        }),
    }
}

/// The rotary width: `head_dim` unless the family reads `partial_rotary_factor`
/// (`rope_parameters.partial_rotary_factor` or the top level), where it is
/// `int(head_dim x factor)` as transformers computes it, and must be even and non-zero. A family
/// without partial rotary refuses a factor other than 1 by name.
fn rotary_dim(r: &Reader<'_>, family: &Family, head_dim: usize) -> Result<usize, ConfigError> {
    let nested = match r.get("rope_parameters") {
        Some(Value::Object(rp)) => (Reader { obj: rp }).f64_opt("partial_rotary_factor")?,
        _ => None,
    };
    let factor = match nested {
        Some(f) => Some(f),
        None => r.f64_opt("partial_rotary_factor")?,
    };
    let Some(factor) = factor else {
        return if family.partial_rotary {
            Err(ConfigError::Missing {
                key: "partial_rotary_factor",
            })
        } else {
            Ok(head_dim)
        };
    };
    if !family.partial_rotary {
        if factor == 1.0 {
            return Ok(head_dim);
        }
        return Err(ConfigError::Unsupported {
            key: "partial_rotary_factor",
            value: factor.to_string(),
            why: "this family rotates the whole head",
        });
    }
    // int(head_dim * factor) in Python: the f64 product truncated.
    let dim = (head_dim as f64 * factor).trunc();
    if !(factor > 0.0 && factor <= 1.0 && dim >= 2.0 && (dim as usize).is_multiple_of(2)) {
        return Err(ConfigError::OutOfRange {
            key: "partial_rotary_factor",
            value: factor.to_string(),
            why: "head_dim x factor must be an even width of at least 2 and at most head_dim",
        });
    }
    Ok(dim as usize)
}

/// The `rope_type` (or legacy `type`) of a rotary block, None when it is the default.
fn rope_block_type(
    block: &Map<String, Value>,
    nested: bool,
) -> Result<Option<String>, ConfigError> {
    let rr = Reader { obj: block };
    let t = match rr.str_opt("rope_type") {
        Ok(Some(t)) => Some(t),
        Ok(None) => rr.str_opt("type").ok().flatten(),
        Err(_) => {
            return Err(ConfigError::WrongType {
                key: if nested {
                    "rope_parameters.rope_type"
                } else {
                    "rope_scaling"
                },
                expected: "a string",
                found: json_text(block.get("rope_type")),
            })
        }
    };
    Ok(t.filter(|t| *t != "default").map(str::to_string))
}

/// The keys a YaRN block may hold; any other is refused by name (it would change the model's
/// function in a way this build does not implement, or it is a typo).
const YARN_KEYS: &[&str] = &[
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
    "partial_rotary_factor",
];

/// A YaRN block (rope_parameters when `nested`, else a top-level rope_scaling), as
/// transformers 5.17's `_compute_yarn_parameters` reads it.
fn yarn_block(block: &Map<String, Value>, nested: bool) -> Result<Yarn, ConfigError> {
    let at = if nested {
        "rope_parameters"
    } else {
        "rope_scaling"
    };
    if let Some(k) = block.keys().find(|k| !YARN_KEYS.contains(&k.as_str())) {
        return Err(ConfigError::Unsupported {
            key: at,
            value: Value::String(k.clone()).to_string(),
            why: "a YaRN key this build does not implement",
        });
    }
    let rr = Reader { obj: block };
    // Each key's name in messages, in the block it is read from.
    let name = |k: &'static str| -> &'static str {
        match (nested, k) {
            (true, "factor") => "rope_parameters.factor",
            (true, "original_max_position_embeddings") => {
                "rope_parameters.original_max_position_embeddings"
            }
            (true, "beta_fast") => "rope_parameters.beta_fast",
            (true, "beta_slow") => "rope_parameters.beta_slow",
            (true, "mscale") => "rope_parameters.mscale",
            (true, "mscale_all_dim") => "rope_parameters.mscale_all_dim",
            (true, "attention_factor") => "rope_parameters.attention_factor",
            (true, _) => "rope_parameters.truncate",
            (false, "factor") => "rope_scaling.factor",
            (false, "original_max_position_embeddings") => {
                "rope_scaling.original_max_position_embeddings"
            }
            (false, "beta_fast") => "rope_scaling.beta_fast",
            (false, "beta_slow") => "rope_scaling.beta_slow",
            (false, "mscale") => "rope_scaling.mscale",
            (false, "mscale_all_dim") => "rope_scaling.mscale_all_dim",
            (false, "attention_factor") => "rope_scaling.attention_factor",
            (false, _) => "rope_scaling.truncate",
        }
    };
    let rename = |k: &'static str, e: ConfigError| match e {
        ConfigError::WrongType {
            expected, found, ..
        } => ConfigError::WrongType {
            key: name(k),
            expected,
            found,
        },
        other => other,
    };
    let num = |k: &'static str| -> Result<Option<f64>, ConfigError> {
        let v = rr.f64_opt(k).map_err(|e| rename(k, e))?;
        match v {
            Some(x) if !(x.is_finite() && (x as f32).is_finite()) => Err(ConfigError::OutOfRange {
                key: name(k),
                value: json_text(block.get(k)),
                why: "must be finite (also as an f32)",
            }),
            v => Ok(v),
        }
    };
    let positive = |k: &'static str| -> Result<Option<f64>, ConfigError> {
        match num(k)? {
            Some(x) if x <= 0.0 => Err(ConfigError::OutOfRange {
                key: name(k),
                value: json_text(block.get(k)),
                why: "must be positive",
            }),
            v => Ok(v),
        }
    };
    // transformers indexes factor and original_max_position_embeddings: both are required.
    let factor = positive("factor")?.ok_or(ConfigError::Missing {
        key: name("factor"),
    })?;
    let original = positive("original_max_position_embeddings")?.ok_or(ConfigError::Missing {
        key: name("original_max_position_embeddings"),
    })?;
    // `get("beta_fast") or 32`: absent, null or 0 all mean the default.
    let beta = |k: &'static str, default: f64| -> Result<f64, ConfigError> {
        Ok(match num(k)? {
            None => default,
            Some(0.0) => default,
            Some(x) if x < 0.0 => {
                return Err(ConfigError::OutOfRange {
                    key: name(k),
                    value: json_text(block.get(k)),
                    why: "must be positive",
                })
            }
            Some(x) => x,
        })
    };
    let truncate = rr
        .bool_opt("truncate")
        .map_err(|e| rename("truncate", e))?
        .unwrap_or(true);
    Ok(Yarn {
        factor,
        original_max_position_embeddings: original,
        beta_fast: beta("beta_fast", 32.0)?,
        beta_slow: beta("beta_slow", 1.0)?,
        mscale: num("mscale")?,
        mscale_all_dim: num("mscale_all_dim")?,
        attention_factor: positive("attention_factor")?,
        truncate,
    })
}

/// A `rope_type: llama3` block (rope_parameters when `nested`, else a top-level rope_scaling),
/// as transformers 5.17's `_compute_llama3_parameters` reads it: `factor`, `low_freq_factor`,
/// `high_freq_factor` and `original_max_position_embeddings` required and positive; any other
/// key refused by name.
fn llama3_block(block: &Map<String, Value>, nested: bool) -> Result<Llama3, ConfigError> {
    const KEYS: &[&str] = &[
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ];
    let at = if nested {
        "rope_parameters"
    } else {
        "rope_scaling"
    };
    if let Some(k) = block.keys().find(|k| !KEYS.contains(&k.as_str())) {
        return Err(ConfigError::Unsupported {
            key: at,
            value: Value::String(k.clone()).to_string(),
            why: "a llama3 rope key this build does not implement",
        });
    }
    let name = |k: &'static str| -> &'static str {
        match (nested, k) {
            (true, "factor") => "rope_parameters.factor",
            (true, "low_freq_factor") => "rope_parameters.low_freq_factor",
            (true, "high_freq_factor") => "rope_parameters.high_freq_factor",
            (true, _) => "rope_parameters.original_max_position_embeddings",
            (false, "factor") => "rope_scaling.factor",
            (false, "low_freq_factor") => "rope_scaling.low_freq_factor",
            (false, "high_freq_factor") => "rope_scaling.high_freq_factor",
            (false, _) => "rope_scaling.original_max_position_embeddings",
        }
    };
    let rr = Reader { obj: block };
    let positive = |k: &'static str| -> Result<f64, ConfigError> {
        let x = rr
            .f64_opt(k)
            .map_err(|_| ConfigError::WrongType {
                key: name(k),
                expected: "a number",
                found: json_text(block.get(k)),
            })?
            .ok_or(ConfigError::Missing { key: name(k) })?;
        if !(x.is_finite() && x > 0.0 && (x as f32).is_finite() && (x as f32) > 0.0) {
            return Err(ConfigError::OutOfRange {
                key: name(k),
                value: json_text(block.get(k)),
                why: "must be finite and positive (also as an f32)",
            });
        }
        Ok(x)
    };
    Ok(Llama3 {
        factor: positive("factor")?,
        low_freq_factor: positive("low_freq_factor")?,
        high_freq_factor: positive("high_freq_factor")?,
        original_max_position_embeddings: positive("original_max_position_embeddings")?,
    })
}

/// Multi-head latent attention's dimensions, each checked.
fn mla_dims(r: &Reader<'_>, family: &Family) -> Result<MlaDims, ConfigError> {
    let q_lora_rank = match r.usize_opt("q_lora_rank")? {
        Some(0) => {
            return Err(ConfigError::OutOfRange {
                key: "q_lora_rank",
                value: "0".into(),
                why: "must be at least 1, or null for a plain q_proj",
            })
        }
        q => q,
    };
    let qk_rope_head_dim = r.positive("qk_rope_head_dim")?;
    if !qk_rope_head_dim.is_multiple_of(2) {
        return Err(ConfigError::OutOfRange {
            key: "qk_rope_head_dim",
            value: qk_rope_head_dim.to_string(),
            why: "must be even for rotary embeddings",
        });
    }
    // V3 reads rope_interleave (default true); V2's complex rotary is always interleaved.
    let rope_interleave = if family.model_type == "deepseek_v3" {
        r.bool_opt("rope_interleave")?.unwrap_or(true)
    } else {
        true
    };
    Ok(MlaDims {
        q_lora_rank,
        kv_lora_rank: r.positive("kv_lora_rank")?,
        qk_nope_head_dim: r.positive("qk_nope_head_dim")?,
        qk_rope_head_dim,
        v_head_dim: r.positive("v_head_dim")?,
        rope_interleave,
    })
}

/// The keys a DeepSeek config may set that change the function in a way this build does not
/// implement: each is refused by name when it asks for that.
fn mla_refusals(r: &Reader<'_>, m: &MlaDims) -> Result<(), ConfigError> {
    let _ = m;
    if r.bool_opt("attention_bias")? == Some(true) {
        return Err(ConfigError::Unsupported {
            key: "attention_bias",
            value: "true".into(),
            why: "biases on multi-head latent attention's projections are not implemented (no release sets it)",
        });
    }
    if r.bool_opt("mlp_bias")? == Some(true) {
        return Err(ConfigError::Unsupported {
            key: "mlp_bias",
            value: "true".into(),
            why: "biases on the MLPs are not implemented (no release sets it)",
        });
    }
    // DeepSeek's own code makes layer l MoE only when l % moe_layer_freq == 0; transformers
    // reads no such key. 1 is the only value both agree on.
    if let Some(f) = r.usize_opt("moe_layer_freq")? {
        if f != 1 {
            return Err(ConfigError::Unsupported {
                key: "moe_layer_freq",
                value: f.to_string(),
                why: "only every layer past first_k_dense_replace being MoE (1) is implemented",
            });
        }
    }
    Ok(())
}

/// DeepSeek-V2's router keys: `topk_method` `greedy` (one group holding every expert) or
/// `group_limited_greedy` (`n_group`, `topk_group` required), softmax scoring,
/// `routed_scaling_factor`, and no renormalisation.
fn softmax_group_routing(
    r: &Reader<'_>,
    experts: usize,
    top_k: usize,
) -> Result<GroupRouting, ConfigError> {
    if let Some(func) = r.str_opt("scoring_func")? {
        if func != "softmax" {
            return Err(ConfigError::Unsupported {
                key: "scoring_func",
                value: Value::String(func.to_string()).to_string(),
                why: "DeepSeek-V2's router scores with a softmax",
            });
        }
    }
    // transformers 5.17's DeepseekV2Moe never renormalises; DeepSeek's own code does under
    // norm_topk_prob. Only false means the same thing to both.
    if r.bool_opt("norm_topk_prob")? == Some(true) {
        return Err(ConfigError::Unsupported {
            key: "norm_topk_prob",
            value: "true".into(),
            why: "transformers' DeepSeek-V2 does not renormalise the top-k and DeepSeek's own code does; the two disagree",
        });
    }
    let method = r.str_opt("topk_method")?.unwrap_or("greedy");
    let (n_group, topk_group) = match method {
        "greedy" => (1, 1),
        "group_limited_greedy" => {
            let n_group = r.positive("n_group")?;
            let topk_group = r.positive("topk_group")?;
            if !experts.is_multiple_of(n_group) {
                return Err(ConfigError::GroupsDoNotDivideExperts {
                    groups: n_group,
                    experts,
                });
            }
            if topk_group > n_group {
                return Err(ConfigError::TopKGroupExceedsGroups {
                    topk_group,
                    groups: n_group,
                });
            }
            let kept = topk_group * (experts / n_group);
            if top_k > kept {
                return Err(ConfigError::TopKExceedsKeptGroups { top_k, kept });
            }
            (n_group, topk_group)
        }
        other => {
            return Err(ConfigError::Unsupported {
                key: "topk_method",
                value: Value::String(other.to_string()).to_string(),
                why: "DeepSeek-V2's topk_method is greedy or group_limited_greedy",
            })
        }
    };
    Ok(GroupRouting {
        n_group,
        topk_group,
        routed_scaling_factor: scaling_factor(r)?,
    })
}

/// `routed_scaling_factor`, required (a default would be a guess about the model's function).
fn scaling_factor(r: &Reader<'_>) -> Result<f64, ConfigError> {
    let factor = r
        .f64_opt("routed_scaling_factor")?
        .ok_or(ConfigError::Missing {
            key: "routed_scaling_factor",
        })?;
    if !(factor.is_finite() && factor > 0.0 && (factor as f32).is_finite()) {
        return Err(ConfigError::OutOfRange {
            key: "routed_scaling_factor",
            value: json_text(r.get("routed_scaling_factor")),
            why: "must be finite and positive (also as an f32)",
        });
    }
    Ok(factor)
}

/// The group-limited router's keys, each required (a default would be a guess about the
/// model's function) and checked against the expert count.
fn group_routing(
    r: &Reader<'_>,
    experts: usize,
    top_k: usize,
) -> Result<GroupRouting, ConfigError> {
    let n_group = r.positive("n_group")?;
    let topk_group = r.positive("topk_group")?;
    if !experts.is_multiple_of(n_group) {
        return Err(ConfigError::GroupsDoNotDivideExperts {
            groups: n_group,
            experts,
        });
    }
    if experts / n_group < 2 {
        return Err(ConfigError::GroupTooSmall {
            groups: n_group,
            experts,
        });
    }
    if topk_group > n_group {
        return Err(ConfigError::TopKGroupExceedsGroups {
            topk_group,
            groups: n_group,
        });
    }
    let kept = topk_group * (experts / n_group);
    if top_k > kept {
        return Err(ConfigError::TopKExceedsKeptGroups { top_k, kept });
    }
    let factor = scaling_factor(r)?;
    // DeepSeek-V3 names its selection rule; only the group-limited one is this router.
    if let Some(method) = r.str_opt("topk_method")? {
        if method != "noaux_tc" {
            return Err(ConfigError::Unsupported {
                key: "topk_method",
                value: Value::String(method.to_string()).to_string(),
                why: "sigmoid routing with e_score_correction_bias is topk_method noaux_tc",
            });
        }
    }
    if let Some(func) = r.str_opt("scoring_func")? {
        if func != "sigmoid" {
            return Err(ConfigError::Unsupported {
                key: "scoring_func",
                value: Value::String(func.to_string()).to_string(),
                why: "this family's router scores with a sigmoid",
            });
        }
    }
    Ok(GroupRouting {
        n_group,
        topk_group,
        routed_scaling_factor: factor,
    })
}

// ArchSpec is declared in `model` (with the families it resolves), but its constructor needs a
// parsed config, so it lives here: `config` imports `model`, and `model` imports nothing of
// `config`, which keeps the arrow between the two modules pointing one way.
impl ArchSpec {
    /// Resolves `cfg.family` against `cfg`.
    pub fn new(cfg: &MoeConfig) -> ArchSpec {
        let family = cfg.family;
        let layers = (0..cfg.num_layers)
            .map(|l| {
                family.layer_kind(
                    l,
                    cfg.num_experts,
                    cfg.decoder_sparse_step,
                    &cfg.mlp_only_layers,
                    cfg.first_k_dense_replace,
                    &cfg.moe_layers,
                )
            })
            .collect();
        ArchSpec {
            family,
            layers,
            renormalize_topk: cfg.renormalize_topk,
            qkv_bias: cfg.qkv_bias,
            o_bias: cfg.o_bias,
            qk_norm: if cfg.qk_norm_on {
                family.qk_norm
            } else {
                QkNorm::None
            },
            shared_expert: matches!(
                family.shared_expert,
                Some(SharedExpertRule::SigmoidGated { .. })
            ),
            shared_experts_ungated: matches!(
                family.shared_expert,
                Some(SharedExpertRule::Ungated { .. } | SharedExpertRule::UngatedExpertWidth)
            ),
            router: family.router,
            attention: family.attention,
            extras: family.extras,
            names: family.names,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Value {
        serde_json::json!({
            "model_type": "qwen3_moe",
            "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
            "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "num_local_experts": 32,
            "num_experts_per_tok": 8, "norm_topk_prob": true, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "tie_word_embeddings": false, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096,
            "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
            "eos_token_id": null, "hidden_act": "silu"
        })
    }

    fn parse(v: &Value) -> Result<MoeConfig, ConfigError> {
        MoeConfig::from_json_object(v.as_object().unwrap())
    }

    fn with(mut v: Value, key: &str, x: Value) -> Value {
        v.as_object_mut().unwrap().insert(key.into(), x);
        v
    }

    fn without(mut v: Value, key: &str) -> Value {
        v.as_object_mut().unwrap().remove(key);
        v
    }

    #[test]
    fn parses_the_fixture_style_config() {
        let c = parse(&base()).unwrap();
        assert_eq!(c.family.model_type, "qwen3_moe");
        assert_eq!((c.num_experts, c.top_k, c.expert_width), (32, 8, 64));
        assert_eq!(c.head_dim, 32);
        assert!(c.renormalize_topk);
        assert_eq!(c.rope_theta, 1e6);
        assert!(c.eos_token_ids.is_empty());
        assert!(!c.qkv_bias);
    }

    #[test]
    fn accepts_the_alternative_spellings() {
        let v = without(base(), "num_local_experts");
        let v = with(v, "num_experts", 16.into());
        let v = without(v, "rope_parameters");
        let v = with(v, "rope_theta", 10000.0.into());
        let v = without(v, "head_dim");
        let v = with(v, "eos_token_id", serde_json::json!([5, 7]));
        let c = parse(&v).unwrap();
        assert_eq!(c.num_experts, 16);
        assert_eq!(c.rope_theta, 1e4);
        assert_eq!(c.head_dim, 32);
        assert_eq!(c.eos_token_ids, vec![5, 7]);
        let c = parse(&with(base(), "eos_token_id", 3.into())).unwrap();
        assert_eq!(c.eos_token_ids, vec![3]);
    }

    #[test]
    fn each_failed_check_names_its_key() {
        assert_eq!(
            parse(&without(base(), "hidden_size")),
            Err(ConfigError::Missing { key: "hidden_size" })
        );
        assert!(matches!(
            parse(&with(base(), "vocab_size", "x".into())),
            Err(ConfigError::WrongType {
                key: "vocab_size",
                ..
            })
        ));
        assert!(matches!(
            parse(&with(base(), "num_hidden_layers", 0.into())),
            Err(ConfigError::OutOfRange {
                key: "num_hidden_layers",
                ..
            })
        ));
        assert!(matches!(
            parse(&with(base(), "model_type", "llama".into())),
            Err(ConfigError::UnsupportedFamily(..))
        ));
        assert_eq!(
            parse(&with(base(), "num_key_value_heads", 3.into())),
            Err(ConfigError::HeadsNotMultipleOfKvHeads {
                heads: 4,
                kv_heads: 3
            })
        );
        assert_eq!(
            parse(&with(base(), "num_experts_per_tok", 33.into())),
            Err(ConfigError::TopKExceedsExperts {
                top_k: 33,
                experts: 32
            })
        );
        assert_eq!(
            parse(&with(base(), "mlp_only_layers", serde_json::json!([4]))),
            Err(ConfigError::MlpOnlyLayerOutOfRange {
                layer: 4,
                layers: 4
            })
        );
        assert!(matches!(
            parse(&with(
                base(),
                "rope_parameters",
                serde_json::json!({"rope_theta": 1e6, "rope_type": "dynamic", "factor": 2.0})
            )),
            Err(ConfigError::Unsupported {
                key: "rope_parameters.rope_type",
                ..
            })
        ));
        // YaRN without the keys transformers indexes
        assert_eq!(
            parse(&with(
                base(),
                "rope_parameters",
                serde_json::json!({"rope_theta": 1e6, "rope_type": "yarn"})
            )),
            Err(ConfigError::Missing {
                key: "rope_parameters.factor"
            })
        );
        assert!(matches!(
            parse(&with(base(), "hidden_act", "gelu".into())),
            Err(ConfigError::Unsupported {
                key: "hidden_act",
                ..
            })
        ));
        assert!(matches!(
            parse(&with(base(), "use_sliding_window", true.into())),
            Err(ConfigError::Unsupported {
                key: "sliding_window",
                ..
            })
        ));
        assert!(matches!(
            parse(&with(base(), "head_dim", 31.into())),
            Err(ConfigError::OutOfRange {
                key: "head_dim",
                ..
            })
        ));
        assert!(matches!(
            parse(&with(base(), "eos_token_id", "x".into())),
            Err(ConfigError::WrongType {
                key: "eos_token_id",
                ..
            })
        ));
        assert_eq!(
            parse(&without(base(), "num_local_experts")),
            Err(ConfigError::Missing {
                key: "num_local_experts"
            })
        );
        assert!(matches!(
            MoeConfig::from_json_str("{"),
            Err(ConfigError::Json(_))
        ));
        assert_eq!(
            MoeConfig::from_json_str("[]"),
            Err(ConfigError::NotAnObject)
        );
    }

    #[test]
    fn refusals_show_the_value_as_the_config_writes_it() {
        let msg = |v: Value| parse(&v).unwrap_err().to_string();
        let m = msg(with(base(), "sliding_window", 4096.into()));
        assert!(m.contains("`sliding_window` = 4096 "), "{m}");
        let m = msg(with(
            with(base(), "sliding_window", 4096.into()),
            "use_sliding_window",
            true.into(),
        ));
        assert!(m.contains("= 4096 ") && !m.contains("Some"), "{m}");
        let m = msg(with(base(), "hidden_act", "gelu".into()));
        assert!(m.contains(r#"`hidden_act` = "gelu""#), "{m}");
        let m = msg(with(base(), "rms_norm_eps", 0.into()));
        assert!(m.contains("`rms_norm_eps` = 0 "), "{m}");
    }

    #[test]
    fn rope_scaling_eps_and_theta_are_refused_when_the_forward_cannot_honour_them() {
        let linear = serde_json::json!({"rope_type": "linear", "factor": 4.0});
        // Next to rope_parameters (transformers folds rope_scaling in) and on its own.
        for v in [
            with(base(), "rope_scaling", linear.clone()),
            with(
                with(without(base(), "rope_parameters"), "rope_theta", 1e6.into()),
                "rope_scaling",
                serde_json::json!({"type": "linear", "factor": 4.0}),
            ),
        ] {
            assert!(matches!(
                parse(&v),
                Err(ConfigError::Unsupported {
                    key: "rope_scaling",
                    ..
                })
            ));
        }
        // A default rope_scaling changes nothing.
        let v = with(
            base(),
            "rope_scaling",
            serde_json::json!({"rope_type": "default"}),
        );
        assert_eq!(parse(&v).unwrap().rope_theta, 1e6);
        for eps in [
            serde_json::json!(0),
            serde_json::json!(-1e-6),
            serde_json::json!(1e-50),
        ] {
            assert!(matches!(
                parse(&with(base(), "rms_norm_eps", eps)),
                Err(ConfigError::OutOfRange {
                    key: "rms_norm_eps",
                    ..
                })
            ));
        }
        for theta in [
            serde_json::json!(0.0),
            serde_json::json!(-5),
            serde_json::json!(1.0),
        ] {
            let v = with(
                base(),
                "rope_parameters",
                serde_json::json!({"rope_theta": theta, "rope_type": "default"}),
            );
            assert!(
                matches!(
                    parse(&v),
                    Err(ConfigError::OutOfRange {
                        key: "rope_theta",
                        ..
                    })
                ),
                "{theta}"
            );
        }
        assert!(matches!(
            parse(&with(base(), "num_key_value_heads", 0.into())),
            Err(ConfigError::OutOfRange {
                key: "num_key_value_heads",
                ..
            })
        ));
    }

    #[test]
    fn dense_layer_rule_follows_transformers() {
        let v = with(base(), "mlp_only_layers", serde_json::json!([0]));
        let v = with(v, "decoder_sparse_step", 2.into());
        let c = parse(&v).unwrap();
        let spec = ArchSpec::new(&c);
        use MlpKind::{Dense, Moe};
        // layer 0: mlp_only; 1: (1+1)%2==0 -> MoE; 2: 3%2 != 0 -> dense; 3: MoE
        assert_eq!(spec.layers, vec![Dense, Moe, Dense, Moe]);
        assert_eq!(spec.moe_index(3), Some(1));
        assert_eq!(spec.moe_index(2), None);
    }

    fn glm() -> Value {
        serde_json::json!({
            "model_type": "glm4_moe", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
            "n_shared_experts": 2, "routed_scaling_factor": 1.8, "first_k_dense_replace": 1,
            "norm_topk_prob": true, "use_qk_norm": true, "attention_bias": true,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 64, "num_nextn_predict_layers": 1,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default",
                                "partial_rotary_factor": 0.5}
        })
    }

    #[test]
    fn glm4_moe_resolves_its_keys() {
        let c = parse(&glm()).unwrap();
        assert_eq!(c.rotary_dim, 4, "int(8 x 0.5)");
        assert_eq!(c.shared_expert_width, Some(32), "2 shared experts x 16");
        assert_eq!(c.first_k_dense_replace, 1);
        assert_eq!(c.nextn_predict_layers, 1);
        let g = c.group_routing.unwrap();
        assert_eq!((g.n_group, g.topk_group), (2, 1));
        assert_eq!(g.routed_scaling_factor, 1.8);
        let spec = ArchSpec::new(&c);
        assert_eq!(
            spec.layers,
            vec![MlpKind::Dense, MlpKind::Moe, MlpKind::Moe]
        );
        assert_eq!(spec.router, RouterRule::SigmoidGroupLimited);
        assert!(spec.shared_experts_ungated && !spec.shared_expert);
        assert_eq!(spec.qk_norm, QkNorm::PerHead);
        assert!(spec.qkv_bias && !spec.o_bias);
        // use_qk_norm off: no q/k norm
        let c = parse(&with(glm(), "use_qk_norm", false.into())).unwrap();
        assert_eq!(ArchSpec::new(&c).qk_norm, QkNorm::None);
        // the top-level spelling of the factor
        let mut v = glm();
        v["rope_parameters"]
            .as_object_mut()
            .unwrap()
            .remove("partial_rotary_factor");
        let v = with(v, "partial_rotary_factor", 0.75.into());
        assert_eq!(parse(&v).unwrap().rotary_dim, 6);
    }

    #[test]
    fn glm4_moe_refuses_what_it_cannot_run_by_name() {
        let mut no_factor = glm();
        no_factor["rope_parameters"]
            .as_object_mut()
            .unwrap()
            .remove("partial_rotary_factor");
        for (v, key) in [
            (without(glm(), "n_group"), "n_group"),
            (without(glm(), "topk_group"), "topk_group"),
            (
                without(glm(), "routed_scaling_factor"),
                "routed_scaling_factor",
            ),
            (
                without(glm(), "first_k_dense_replace"),
                "first_k_dense_replace",
            ),
            (without(glm(), "n_shared_experts"), "n_shared_experts"),
            (no_factor, "partial_rotary_factor"),
        ] {
            assert_eq!(parse(&v), Err(ConfigError::Missing { key }));
        }
        assert_eq!(
            parse(&with(glm(), "n_group", 3.into())),
            Err(ConfigError::GroupsDoNotDivideExperts {
                groups: 3,
                experts: 8
            })
        );
        assert_eq!(
            parse(&with(glm(), "n_group", 8.into())),
            Err(ConfigError::GroupTooSmall {
                groups: 8,
                experts: 8
            })
        );
        assert_eq!(
            parse(&with(glm(), "topk_group", 3.into())),
            Err(ConfigError::TopKGroupExceedsGroups {
                topk_group: 3,
                groups: 2
            })
        );
        assert_eq!(
            parse(&with(glm(), "num_experts_per_tok", 5.into())),
            Err(ConfigError::TopKExceedsKeptGroups { top_k: 5, kept: 4 })
        );
        for (key, value) in [
            ("topk_method", serde_json::json!("greedy")),
            ("scoring_func", serde_json::json!("softmax")),
        ] {
            let e = parse(&with(glm(), key, value)).unwrap_err();
            assert!(
                matches!(e, ConfigError::Unsupported { key: k, .. } if k == key),
                "{e}"
            );
        }
        assert!(matches!(
            parse(&with(glm(), "first_k_dense_replace", 4.into())),
            Err(ConfigError::OutOfRange {
                key: "first_k_dense_replace",
                ..
            })
        ));
        assert!(matches!(
            parse(&with(glm(), "routed_scaling_factor", 0.into())),
            Err(ConfigError::OutOfRange {
                key: "routed_scaling_factor",
                ..
            })
        ));
        let mut tiny = glm();
        tiny["rope_parameters"]["partial_rotary_factor"] = 0.1.into();
        assert!(matches!(
            parse(&tiny),
            Err(ConfigError::OutOfRange {
                key: "partial_rotary_factor",
                ..
            })
        ));
        // A family that rotates the whole head refuses another factor by name; 1 is accepted.
        assert!(matches!(
            parse(&with(base(), "partial_rotary_factor", 0.5.into())),
            Err(ConfigError::Unsupported {
                key: "partial_rotary_factor",
                ..
            })
        ));
        assert_eq!(
            parse(&with(base(), "partial_rotary_factor", 1.0.into()))
                .unwrap()
                .rotary_dim,
            32
        );
    }

    #[test]
    fn every_fixture_config_parses() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/oracle");
        for name in ["qwen3moe-a", "qwen3moe-code"] {
            let text = std::fs::read_to_string(format!("{root}/{name}/config.json")).unwrap();
            let c = MoeConfig::from_json_str(&text).unwrap();
            assert_eq!(c.family.model_type, "qwen3_moe");
        }
    }

    fn deepseek_v3() -> Value {
        serde_json::json!({
            "model_type": "deepseek_v3", "vocab_size": 512, "hidden_size": 128,
            "intermediate_size": 256, "moe_intermediate_size": 48, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
            "n_routed_experts": 16, "routed_scaling_factor": 2.5, "kv_lora_rank": 32,
            "q_lora_rank": 64, "qk_rope_head_dim": 16, "v_head_dim": 32, "qk_nope_head_dim": 32,
            "head_dim": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4,
            "first_k_dense_replace": 1, "norm_topk_prob": true, "rope_interleave": true,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "yarn", "factor": 8.0,
                "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
        })
    }

    #[test]
    fn deepseek_configs_parse_with_their_latent_dimensions_and_yarn() {
        let c = parse(&deepseek_v3()).unwrap();
        let m = c.mla.unwrap();
        assert_eq!(
            (m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim()),
            (Some(64), 32, 48)
        );
        assert_eq!((m.latent_width(), c.head_dim, c.rotary_dim), (48, 16, 16));
        assert!(m.rope_interleave);
        let y = c.yarn.unwrap();
        assert_eq!((y.factor, y.original_max_position_embeddings), (8.0, 64.0));
        assert!(y.truncate);
        // mscale == mscale_all_dim: cos and sin unscaled; the softmax scale gets mscale^2
        assert_eq!(y.attention_factor(), 1.0);
        let ms = 0.1 * crate::numerics::detmath::ln_f64(8.0) + 1.0;
        assert_eq!(
            c.mla_softmax_scale(),
            Some(((1.0 / 48f64.sqrt()) * ms * ms) as f32)
        );
        // the legacy spelling: top-level rope_theta and rope_scaling with "type"
        let legacy = with(
            with(
                without(deepseek_v3(), "rope_parameters"),
                "rope_theta",
                1e4.into(),
            ),
            "rope_scaling",
            serde_json::json!({"type": "yarn", "factor": 8.0,
                "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0}),
        );
        assert_eq!(parse(&legacy).unwrap().yarn, c.yarn);
        // null q_lora_rank: a plain q_proj
        let plain = parse(&with(deepseek_v3(), "q_lora_rank", Value::Null)).unwrap();
        assert_eq!(plain.mla.unwrap().q_lora_rank, None);
        // V2: softmax routing, greedy is one group of every expert
        let v2 = with(
            with(deepseek_v3(), "model_type", "deepseek_v2".into()),
            "norm_topk_prob",
            false.into(),
        );
        let c2 = parse(&with(v2.clone(), "topk_method", "greedy".into())).unwrap();
        let g = c2.group_routing.unwrap();
        assert_eq!((g.n_group, g.topk_group), (1, 1));
        let c2 = parse(&with(v2, "topk_method", "group_limited_greedy".into())).unwrap();
        let g = c2.group_routing.unwrap();
        assert_eq!((g.n_group, g.topk_group), (4, 2));
    }

    #[test]
    fn deepseek_keys_this_build_cannot_honour_are_refused_by_name() {
        let unsupported = |v: Value| match parse(&v) {
            Err(ConfigError::Unsupported { key, .. }) => key,
            other => panic!("expected a refusal, got {other:?}"),
        };
        assert_eq!(
            unsupported(with(deepseek_v3(), "attention_bias", true.into())),
            "attention_bias"
        );
        assert_eq!(
            unsupported(with(deepseek_v3(), "mlp_bias", true.into())),
            "mlp_bias"
        );
        assert_eq!(
            unsupported(with(deepseek_v3(), "moe_layer_freq", 2.into())),
            "moe_layer_freq"
        );
        assert_eq!(
            unsupported(with(deepseek_v3(), "topk_method", "greedy".into())),
            "topk_method"
        );
        let v2 = with(deepseek_v3(), "model_type", "deepseek_v2".into());
        // transformers' V2 never renormalises; DeepSeek's own code does: refused
        assert_eq!(unsupported(v2.clone()), "norm_topk_prob");
        let v2 = with(v2, "norm_topk_prob", false.into());
        assert_eq!(
            unsupported(with(v2.clone(), "topk_method", "noaux_tc".into())),
            "topk_method"
        );
        assert_eq!(
            unsupported(with(v2, "scoring_func", "sigmoid".into())),
            "scoring_func"
        );
        // a YaRN key this build does not read
        let mut v = deepseek_v3();
        v["rope_parameters"]["extrapolation_factor"] = 1.0.into();
        assert_eq!(unsupported(v), "rope_parameters");
        // head_dim must be the rope width; one key and value per query head
        assert!(matches!(
            parse(&with(deepseek_v3(), "head_dim", 48.into())),
            Err(ConfigError::OutOfRange {
                key: "head_dim",
                ..
            })
        ));
        assert!(matches!(
            parse(&with(deepseek_v3(), "num_key_value_heads", 2.into())),
            Err(ConfigError::OutOfRange {
                key: "num_key_value_heads",
                ..
            })
        ));
        assert!(matches!(
            parse(&with(deepseek_v3(), "qk_rope_head_dim", 15.into())),
            Err(ConfigError::OutOfRange {
                key: "qk_rope_head_dim",
                ..
            })
        ));
        let mut v = deepseek_v3();
        v["rope_parameters"]
            .as_object_mut()
            .unwrap()
            .remove("original_max_position_embeddings");
        assert_eq!(
            parse(&v),
            Err(ConfigError::Missing {
                key: "rope_parameters.original_max_position_embeddings"
            })
        );
    }

    fn gpt_oss() -> Value {
        // the shared oracle's gptoss-mxfp4-a config
        serde_json::from_str(
            r#"{"model_type": "gpt_oss", "attention_bias": true, "head_dim": 32,
                "hidden_act": "silu", "hidden_size": 128, "intermediate_size": 64,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                "full_attention"], "max_position_embeddings": 512, "num_attention_heads": 4,
                "num_experts_per_tok": 2, "num_hidden_layers": 4, "num_key_value_heads": 2,
                "num_local_experts": 8, "rms_norm_eps": 1e-06, "rope_parameters": {"beta_fast":
                32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 64,
                "rope_theta": 150000.0, "rope_type": "yarn", "truncate": false},
                "sliding_window": 16, "tie_word_embeddings": false, "vocab_size": 512,
                "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert":
                ["model.layers.*.self_attn"]}}"#,
        )
        .unwrap()
    }

    #[test]
    fn gpt_oss_reads_its_windows_biases_and_mxfp4() {
        let c = parse(&gpt_oss()).unwrap();
        assert_eq!(c.layer_windows, vec![Some(16), None, Some(16), None]);
        assert_eq!(c.expert_dtype, ExpertDtype::Mxfp4);
        assert!(c.qkv_bias && c.o_bias);
        assert!(c.yarn.is_some());
        let spec = ArchSpec::new(&c);
        assert!(spec.extras.attention_sinks && spec.extras.expert_bias);
        // absent layer_types: GptOssConfig's default alternates, layer 0 sliding
        let c = parse(&without(gpt_oss(), "layer_types")).unwrap();
        assert_eq!(c.layer_windows, vec![Some(16), None, Some(16), None]);
        let c = parse(&without(gpt_oss(), "quantization_config")).unwrap();
        assert_eq!(c.expert_dtype, ExpertDtype::Bf16);
    }

    #[test]
    fn gpt_oss_refuses_what_it_cannot_run_by_name() {
        let key = |v: Value| match parse(&v) {
            Err(ConfigError::Unsupported { key, .. })
            | Err(ConfigError::OutOfRange { key, .. })
            | Err(ConfigError::Missing { key }) => key,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            key(with(gpt_oss(), "swiglu_limit", 10.0.into())),
            "swiglu_limit"
        );
        assert!(parse(&with(gpt_oss(), "swiglu_limit", 7.0.into())).is_ok());
        assert_eq!(
            key(with(
                gpt_oss(),
                "layer_types",
                serde_json::json!(vec!["chunked_attention"; 4])
            )),
            "layer_types"
        );
        assert_eq!(
            key(with(
                gpt_oss(),
                "layer_types",
                serde_json::json!(vec!["full_attention"; 3])
            )),
            "layer_types"
        );
        assert_eq!(key(without(gpt_oss(), "sliding_window")), "sliding_window");
        assert_eq!(
            key(with(
                gpt_oss(),
                "quantization_config",
                serde_json::json!({"quant_method": "fp8"})
            )),
            "quantization_config.quant_method"
        );
        assert_eq!(
            key(with(
                gpt_oss(),
                "quantization_config",
                serde_json::json!({"quant_method": "mxfp4", "group_size": 64})
            )),
            "quantization_config"
        );
        assert_eq!(
            key(with(gpt_oss(), "intermediate_size", 48.into())),
            "intermediate_size"
        );
        // MXFP4 is gpt-oss's released form only
        assert_eq!(
            key(with(
                base(),
                "quantization_config",
                serde_json::json!({"quant_method": "mxfp4"})
            )),
            "quantization_config.quant_method"
        );
    }

    fn llama4() -> Value {
        // the shared oracle's llama4-a config
        serde_json::from_str(
            r#"{"architectures": ["Llama4ForCausalLM"], "attention_bias": false,
                "attention_chunk_size": 16, "attention_dropout": 0.0, "attn_scale": 0.1,
                "attn_temperature_tuning": true, "bos_token_id": 1, "dtype": "bfloat16",
                "eos_token_id": 2, "floor_scale": 8192, "head_dim": 32, "hidden_act": "silu",
                "hidden_size": 128, "initializer_range": 0.06, "interleave_moe_layer_step": 1,
                "intermediate_size": 64, "intermediate_size_mlp": 256,
                "layer_types": ["chunked_attention", "chunked_attention", "chunked_attention",
                "full_attention"], "max_position_embeddings": 512, "model_type": "llama4_text",
                "moe_layers": [0, 1, 2, 3], "no_rope_layer_interval": 4,
                "no_rope_layers": [1, 1, 1, 0], "num_attention_heads": 4,
                "num_experts_per_tok": 1, "num_hidden_layers": 4, "num_key_value_heads": 2,
                "num_local_experts": 8, "output_router_logits": false, "pad_token_id": null,
                "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 500000.0,
                "rope_type": "default"}, "router_aux_loss_coef": 0.001,
                "router_jitter_noise": 0.0, "tie_word_embeddings": false, "use_cache": true,
                "use_qk_norm": true, "vocab_size": 512}"#,
        )
        .unwrap()
    }

    #[test]
    fn llama4_resolves_its_layers_as_llama4_text_config_does() {
        let c = parse(&llama4()).unwrap();
        assert_eq!(c.layer_rope, vec![true, true, true, false]);
        assert_eq!(c.layer_chunks, vec![Some(16), Some(16), Some(16), None]);
        assert_eq!(
            c.attn_temperature,
            Some(AttnTemperature {
                floor_scale: 8192.0,
                attn_scale: 0.1
            })
        );
        assert_eq!(c.shared_expert_width, Some(64));
        let spec = ArchSpec::new(&c);
        assert_eq!(spec.layers, vec![MlpKind::Moe; 4]);
        assert_eq!(spec.qk_norm, QkNorm::L2AfterRope);
        assert!(spec.shared_experts_ungated && !spec.shared_expert);
        assert_eq!(spec.router, RouterRule::SigmoidScalesInput);
        // the defaults: no_rope_layers every 4th layer NoPE, layer_types from it, chunk 8192
        let mut v = llama4();
        for k in [
            "no_rope_layers",
            "layer_types",
            "attention_chunk_size",
            "moe_layers",
        ] {
            v = without(v, k);
        }
        let d = parse(&with(v.clone(), "num_hidden_layers", 8.into())).unwrap();
        assert_eq!(
            d.layer_rope,
            vec![true, true, true, false, true, true, true, false]
        );
        assert_eq!(d.layer_chunks[0], Some(8192));
        assert_eq!(d.layer_chunks[3], None);
        // interleave_moe_layer_step 2 without moe_layers: layers 1, 3 MoE, 0, 2 dense MLPs of
        // intermediate_size_mlp; written moe_layers win
        let s2 = parse(&with(v.clone(), "interleave_moe_layer_step", 2.into())).unwrap();
        assert_eq!(s2.moe_layers, vec![1, 3]);
        use MlpKind::{Dense, Moe};
        assert_eq!(ArchSpec::new(&s2).layers, vec![Dense, Moe, Dense, Moe]);
        assert_eq!(s2.dense_width, Some(256));
        let rules = crate::shapes::ModelRules::for_config(&s2);
        let crate::shapes::MlpRules::Dense(d0) = &rules.layers[0].mlp else {
            panic!("layer 0 dense")
        };
        assert_eq!(d0.gate.name, "model.layers.0.feed_forward.gate_proj.weight");
        assert_eq!(d0.gate.shape, vec![256, 128]);
        let m = parse(&with(
            with(v.clone(), "interleave_moe_layer_step", 2.into()),
            "moe_layers",
            serde_json::json!([0]),
        ))
        .unwrap();
        assert_eq!(ArchSpec::new(&m).layers, vec![Moe, Dense, Dense, Dense]);
        assert_eq!(
            parse(&without(
                with(v, "interleave_moe_layer_step", 2.into()),
                "intermediate_size_mlp"
            )),
            Err(ConfigError::Missing {
                key: "intermediate_size_mlp"
            })
        );
        // tuning off, use_qk_norm false
        let off = parse(&with(llama4(), "attn_temperature_tuning", false.into())).unwrap();
        assert_eq!(off.attn_temperature, None);
        // the released configs' integer 4 is on, 0 off (transformers tests its truth); a string
        // is refused by name
        let four = parse(&with(llama4(), "attn_temperature_tuning", 4.into())).unwrap();
        assert_eq!(four.attn_temperature, c.attn_temperature);
        assert!(four.attn_temperature.is_some());
        let zero = parse(&with(llama4(), "attn_temperature_tuning", 0.into())).unwrap();
        assert_eq!(zero.attn_temperature, None);
        assert!(matches!(
            parse(&with(llama4(), "attn_temperature_tuning", "yes".into())),
            Err(ConfigError::WrongType {
                key: "attn_temperature_tuning",
                ..
            })
        ));
        let no_norm = parse(&with(llama4(), "use_qk_norm", false.into())).unwrap();
        assert_eq!(ArchSpec::new(&no_norm).qk_norm, QkNorm::None);
        // the fused experts: gate the first half of gate_up_proj's columns
        let rules = crate::shapes::ModelRules::for_config(&c);
        let crate::shapes::FusedExpertRules::Bf16 { gate_up, down, .. } = &rules.fused[0] else {
            panic!("BF16 fused experts")
        };
        assert_eq!(
            (gate_up.name.as_str(), gate_up.shape.as_slice()),
            (
                "model.layers.0.feed_forward.experts.gate_up_proj",
                &[8, 128, 128][..]
            )
        );
        assert_eq!(down.shape, vec![8, 64, 128]);
    }

    #[test]
    fn llama4_refuses_what_it_does_not_implement_by_name() {
        let key = |v: Value| match parse(&v) {
            Err(ConfigError::Unsupported { key, .. })
            | Err(ConfigError::OutOfRange { key, .. })
            | Err(ConfigError::WrongType { key, .. })
            | Err(ConfigError::Missing { key }) => key,
            other => panic!("{other:?}"),
        };
        // Scout's rope scaling (llama3) is read, for Llama 4 only; its four keys are required
        let mut scout = llama4();
        scout["rope_parameters"] = serde_json::json!({"rope_theta": 500000.0,
            "rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
            "high_freq_factor": 1.0, "original_max_position_embeddings": 8192});
        let l3 = parse(&scout).unwrap().llama3_rope.unwrap();
        assert_eq!(
            (l3.factor, l3.original_max_position_embeddings),
            (16.0, 8192.0)
        );
        let mut extra = scout.clone();
        extra["rope_parameters"]["beta_fast"] = 32.into();
        assert_eq!(key(extra), "rope_parameters");
        let legacy = with(
            llama4(),
            "rope_scaling",
            serde_json::json!({"rope_type": "llama3", "factor": 8.0}),
        );
        assert_eq!(key(legacy), "rope_scaling.low_freq_factor");
        let mut qwen = base();
        qwen["rope_parameters"] = scout["rope_parameters"].clone();
        assert_eq!(key(qwen), "rope_parameters.rope_type");
        assert_eq!(
            key(with(llama4(), "sliding_window", 8.into())),
            "sliding_window"
        );
        assert_eq!(
            key(with(
                llama4(),
                "layer_types",
                serde_json::json!(vec!["sliding_attention"; 4])
            )),
            "layer_types"
        );
        assert_eq!(
            key(with(
                llama4(),
                "layer_types",
                serde_json::json!(vec!["full_attention"; 3])
            )),
            "layer_types"
        );
        assert_eq!(
            key(with(
                llama4(),
                "no_rope_layers",
                serde_json::json!([1, 2, 1, 0])
            )),
            "no_rope_layers"
        );
        assert_eq!(
            key(with(
                llama4(),
                "no_rope_layers",
                serde_json::json!([1, 1, 0])
            )),
            "no_rope_layers"
        );
        assert_eq!(
            key(with(llama4(), "attention_chunk_size", Value::Null)),
            "attention_chunk_size"
        );
        assert_eq!(
            key(with(llama4(), "attention_chunk_size", 0.into())),
            "attention_chunk_size"
        );
        assert_eq!(
            key(with(llama4(), "moe_layers", serde_json::json!([4]))),
            "moe_layers"
        );
        assert_eq!(
            key(with(llama4(), "interleave_moe_layer_step", 0.into())),
            "interleave_moe_layer_step"
        );
        assert_eq!(key(with(llama4(), "floor_scale", 0.into())), "floor_scale");
        assert_eq!(
            key(with(llama4(), "hidden_act", "gelu".into())),
            "hidden_act"
        );
        assert_eq!(
            key(with(
                llama4(),
                "quantization_config",
                serde_json::json!({"quant_method": "fbgemm_fp8"})
            )),
            "quantization_config.quant_method"
        );
        assert_eq!(
            key(with(
                llama4(),
                "quantization_config",
                serde_json::json!({"quant_method": "mxfp4"})
            )),
            "quantization_config.quant_method"
        );
        // the multimodal wrapper (text_config inside) is another model_type
        assert!(matches!(
            parse(&with(llama4(), "model_type", "llama4".into())),
            Err(ConfigError::UnsupportedFamily(..))
        ));
        // a chunk size without a chunked layer is not read
        let full = with(
            with(
                llama4(),
                "layer_types",
                serde_json::json!(vec!["full_attention"; 4]),
            ),
            "attention_chunk_size",
            Value::Null,
        );
        assert_eq!(parse(&full).unwrap().layer_chunks, vec![None; 4]);
    }

    #[test]
    fn windows_and_clip_qkv_where_transformers_reads_them() {
        let mixtral = serde_json::json!({
            "model_type": "mixtral", "vocab_size": 512, "hidden_size": 128,
            "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "rope_theta": 1e6,
            "sliding_window": null
        });
        assert_eq!(parse(&mixtral).unwrap().layer_windows, vec![None; 3]);
        let c = parse(&with(mixtral.clone(), "sliding_window", 4096.into())).unwrap();
        assert_eq!(c.layer_windows, vec![Some(4096); 3]);
        assert!(matches!(
            parse(&with(mixtral, "clip_qkv", 8.0.into())),
            Err(ConfigError::Unsupported {
                key: "clip_qkv",
                ..
            })
        ));
        // the Qwen families' use_sliding_window stays refused
        assert!(matches!(
            parse(&with(base(), "use_sliding_window", true.into())),
            Err(ConfigError::Unsupported {
                key: "sliding_window",
                ..
            })
        ));
        let olmoe = with(
            with(
                without(base(), "moe_intermediate_size"),
                "model_type",
                "olmoe".into(),
            ),
            "intermediate_size",
            64.into(),
        );
        let olmoe = without(olmoe, "mlp_only_layers");
        assert_eq!(
            parse(&with(olmoe.clone(), "clip_qkv", 8.into()))
                .unwrap()
                .clip_qkv,
            Some(8.0)
        );
        assert!(matches!(
            parse(&with(olmoe, "clip_qkv", (-1.0).into())),
            Err(ConfigError::OutOfRange {
                key: "clip_qkv",
                ..
            })
        ));
    }

    /// qwen35moe-a's config as transformers wrote it (tarfa-run's oracle tests run the model).
    fn qwen35() -> Value {
        serde_json::json!({
            "model_type": "qwen3_5_moe_text", "vocab_size": 512, "hidden_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "num_experts": 16, "num_experts_per_tok": 4,
            "moe_intermediate_size": 48, "shared_expert_intermediate_size": 64,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_value_head_dim": 32,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                "full_attention"],
            "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "hidden_act": "silu",
            "partial_rotary_factor": 0.25, "attention_bias": false,
            "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 10000.0,
                "rope_type": "default"},
            "tie_word_embeddings": false
        })
    }

    #[test]
    fn the_hybrid_families_resolve_their_layers_as_transformers_does() {
        let c = parse(&qwen35()).unwrap();
        assert_eq!(c.layer_linear, [true, true, true, false]);
        let d = c.linear.unwrap();
        assert_eq!(
            (d.key_width(), d.value_width(), d.conv_channels()),
            (64, 128, 256)
        );
        assert_eq!((d.state_len(), d.conv_state_len()), (4 * 32 * 32, 3 * 256));
        assert_eq!(c.rotary_dim, 8);
        assert!(c.renormalize_topk, "Qwen3.5's router always renormalises");
        let spec = ArchSpec::new(&c);
        assert!(spec.layers.iter().all(|k| *k == MlpKind::Moe));
        assert!(spec.shared_expert && spec.extras.gated_attention);
        // Qwen3.5's config has no norm_topk_prob, decoder_sparse_step or mlp_only_layers:
        // transformers ignores them if written, and so does the family
        let mut ignored = qwen35();
        ignored["norm_topk_prob"] = false.into();
        ignored["mlp_only_layers"] = serde_json::json!([0]);
        let i = parse(&ignored).unwrap();
        assert!(i.renormalize_topk);
        assert!(ArchSpec::new(&i).layers.iter().all(|k| *k == MlpKind::Moe));
        // layer_types absent: every full_attention_interval-th layer is full (default 4)
        let mut next = without(qwen35(), "layer_types");
        next["model_type"] = "qwen3_next".into();
        next["num_hidden_layers"] = 8.into();
        assert_eq!(
            parse(&next).unwrap().layer_linear,
            [true, true, true, false, true, true, true, false]
        );
        next["full_attention_interval"] = 2.into();
        assert_eq!(
            parse(&next).unwrap().layer_linear,
            [true, false, true, false, true, false, true, false]
        );
        // Qwen3-Next reads norm_topk_prob and Qwen's dense-layer rule
        next["norm_topk_prob"] = false.into();
        next["mlp_only_layers"] = serde_json::json!([1]);
        next["intermediate_size"] = 256.into();
        let n = parse(&next).unwrap();
        assert!(!n.renormalize_topk);
        assert_eq!(ArchSpec::new(&n).layers[1], MlpKind::Dense);
        // text's interleaved mRoPE is the plain rotary embedding: its keys are read for types
        let mut mrope = qwen35();
        mrope["rope_parameters"]["mrope_section"] = serde_json::json!([11, 11, 10]);
        mrope["rope_parameters"]["mrope_interleaved"] = true.into();
        assert_eq!(parse(&mrope).unwrap().rotary_dim, 8);
    }

    #[test]
    fn the_hybrid_families_refuse_what_they_cannot_run_by_name() {
        let key = |v: Value| match parse(&v) {
            Err(ConfigError::Unsupported { key, .. })
            | Err(ConfigError::OutOfRange { key, .. })
            | Err(ConfigError::WrongType { key, .. })
            | Err(ConfigError::Missing { key }) => key,
            other => panic!("{other:?}"),
        };
        let mut odd = qwen35();
        odd["layer_types"][1] = "sliding_attention".into();
        assert_eq!(key(odd), "layer_types");
        let mut short = qwen35();
        short["layer_types"] = serde_json::json!(["linear_attention"]);
        assert_eq!(key(short), "layer_types");
        assert_eq!(
            key(with(qwen35(), "linear_num_value_heads", 3.into())),
            "linear_num_value_heads"
        );
        assert_eq!(
            key(with(qwen35(), "linear_conv_kernel_dim", 0.into())),
            "linear_conv_kernel_dim"
        );
        let mut bad_section = qwen35();
        bad_section["rope_parameters"]["mrope_section"] = "11,11,10".into();
        assert_eq!(key(bad_section), "rope_parameters.mrope_section");
        let mut two = qwen35();
        two["rope_parameters"]["mrope_section"] = serde_json::json!([2, 2]);
        assert_eq!(key(two), "rope_parameters.mrope_section");
        let mut bad_flag = qwen35();
        bad_flag["rope_parameters"]["mrope_interleaved"] = 1.into();
        assert_eq!(key(bad_flag), "rope_parameters.mrope_interleaved");
        // another family has no mRoPE, and no linear layers
        let mut qwen3 = base();
        qwen3["rope_parameters"] = serde_json::json!({"rope_theta": 10000.0,
            "mrope_section": [16, 24, 24]});
        assert_eq!(key(qwen3), "rope_parameters.mrope_section");
        let mut linear = base();
        linear["layer_types"] = serde_json::json!(["linear_attention", "linear_attention"]);
        assert_eq!(key(linear), "layer_types");
        assert_eq!(
            key(with(qwen35(), "use_sliding_window", true.into())),
            "sliding_window"
        );
        assert_eq!(
            key(with(qwen35(), "hidden_act", "gelu".into())),
            "hidden_act"
        );
    }
}
