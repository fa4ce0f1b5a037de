//! `config.json`: the few fields that decide how the tensors must be named and shaped.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::CheckpointError;

/// The model families Tarfa runs. Each fixes the expert tensor naming.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModelFamily {
    /// `model_type: "qwen3_moe"`.
    Qwen3Moe,
    /// `model_type: "qwen2_moe"` (routed experts plus one shared expert, `mlp.shared_expert.*`).
    Qwen2Moe,
    /// `model_type: "mixtral"`.
    Mixtral,
    /// `model_type: "olmoe"`.
    Olmoe,
    /// `model_type: "glm4_moe"` (GLM-4.5): `n_routed_experts`, the first
    /// `first_k_dense_replace` layers dense, `mlp.shared_experts.*` and the router's
    /// `mlp.gate.e_score_correction_bias` non-expert tensors.
    Glm4Moe,
    /// `model_type: "deepseek_v3"`: the same layout as GLM-4.5 (routed experts under
    /// `n_routed_experts`, the first `first_k_dense_replace` layers dense, shared experts and the
    /// router's correction bias non-expert), with multi-head latent attention.
    DeepseekV3,
    /// `model_type: "deepseek_v2"`: as DeepSeek-V3, without the correction bias.
    DeepseekV2,
    /// `model_type: "gpt_oss"`: every layer MoE, the experts fused per layer
    /// ([`crate::GPT_OSS_FUSED`]), BF16 or MXFP4 as released (`quantization_config.quant_method
    /// = "mxfp4"`, the only quantization accepted, and only here).
    GptOss,
    /// `model_type: "llama4_text"`: the experts fused per layer ([`crate::LLAMA4_FUSED`], BF16),
    /// the MoE layers `moe_layers` or every `interleave_moe_layer_step`-th layer (as
    /// transformers' `Llama4TextConfig` resolves them), the rest dense.
    Llama4Text,
    /// `model_type: "qwen3_next"` (Qwen3-Next): gated-DeltaNet linear-attention and gated
    /// full-attention layers (`layer_types`; their tensors are the runtime's rules to judge),
    /// routed experts named as Qwen3-MoE's plus a sigmoid-gated shared expert, dense layers
    /// under `decoder_sparse_step` / `mlp_only_layers` as Qwen3-MoE reads them. Its
    /// multi-token-prediction module (`mtp.*`) is skipped.
    Qwen3Next,
    /// `model_type: "qwen3_5_moe_text"` (Qwen3.5 MoE's text model): the Qwen3-Next backbone with
    /// separate linear-attention input projections, every layer MoE, the experts per expert (as
    /// transformers saves them) or fused by rows per layer (as Qwen3.5 is released:
    /// [`crate::QWEN3_5_MOE_FUSED`]). The release wraps it (`qwen3_5_moe`, read through
    /// [`WrapperLayout`]); `mtp.*` is skipped.
    Qwen3_5Moe,
}

/// How a family's checkpoints store their routed experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertStorage {
    /// One tensor per matrix per expert, named as [`crate::ExpertNaming`] says.
    PerExpert,
    /// Fused per layer, always (gpt-oss, Llama 4).
    Fused(&'static crate::FusedExpertTable),
    /// Either form, decided per checkpoint by which tensors it has: per expert (transformers'
    /// `save_pretrained`) or fused (the released Qwen3.5 MoE checkpoints). A checkpoint that
    /// mixes the two is refused by name.
    PerExpertOrFused(&'static crate::FusedExpertTable),
}

impl ModelFamily {
    /// The `model_type` string of this family.
    pub fn model_type(self) -> &'static str {
        match self {
            ModelFamily::Qwen3Moe => "qwen3_moe",
            ModelFamily::Qwen2Moe => "qwen2_moe",
            ModelFamily::Mixtral => "mixtral",
            ModelFamily::Olmoe => "olmoe",
            ModelFamily::Glm4Moe => "glm4_moe",
            ModelFamily::DeepseekV3 => "deepseek_v3",
            ModelFamily::DeepseekV2 => "deepseek_v2",
            ModelFamily::GptOss => "gpt_oss",
            ModelFamily::Llama4Text => "llama4_text",
            ModelFamily::Qwen3Next => "qwen3_next",
            ModelFamily::Qwen3_5Moe => "qwen3_5_moe_text",
        }
    }

    /// The family of a `model_type` string.
    pub fn from_model_type(s: &str) -> Option<ModelFamily> {
        [
            ModelFamily::Qwen3Moe,
            ModelFamily::Qwen2Moe,
            ModelFamily::Mixtral,
            ModelFamily::Olmoe,
            ModelFamily::Glm4Moe,
            ModelFamily::DeepseekV3,
            ModelFamily::DeepseekV2,
            ModelFamily::GptOss,
            ModelFamily::Llama4Text,
            ModelFamily::Qwen3Next,
            ModelFamily::Qwen3_5Moe,
        ]
        .into_iter()
        .find(|f| f.model_type() == s)
    }

    /// How this family names its expert matrices.
    pub fn naming(self) -> crate::ExpertNaming {
        match self {
            ModelFamily::Mixtral => crate::ExpertNaming::Mixtral,
            _ => crate::ExpertNaming::QwenStyle,
        }
    }

    /// How the family stores its experts.
    pub fn expert_storage(self) -> ExpertStorage {
        match self {
            ModelFamily::GptOss => ExpertStorage::Fused(&crate::GPT_OSS_FUSED),
            ModelFamily::Llama4Text => ExpertStorage::Fused(&crate::LLAMA4_FUSED),
            ModelFamily::Qwen3_5Moe => ExpertStorage::PerExpertOrFused(&crate::QWEN3_5_MOE_FUSED),
            ModelFamily::Qwen3Moe
            | ModelFamily::Qwen2Moe
            | ModelFamily::Mixtral
            | ModelFamily::Olmoe
            | ModelFamily::Glm4Moe
            | ModelFamily::DeepseekV3
            | ModelFamily::DeepseekV2
            | ModelFamily::Qwen3Next => ExpertStorage::PerExpert,
        }
    }

    /// The family's fused expert tensors, if it stores (or may store) its experts fused: what
    /// [`crate::Checkpoint::fused`]'s layers are, when it has any.
    pub fn fused_experts(self) -> Option<&'static crate::FusedExpertTable> {
        match self.expert_storage() {
            ExpertStorage::PerExpert => None,
            ExpertStorage::Fused(t) | ExpertStorage::PerExpertOrFused(t) => Some(t),
        }
    }

    /// The name prefix of the family's multi-token-prediction module, whose tensors are
    /// validated and skipped (transformers' Qwen3-Next and Qwen3.5 models ignore `^mtp.*` on
    /// load; next-token logits never read it).
    pub fn mtp_prefix(self) -> Option<&'static str> {
        match self {
            ModelFamily::Qwen3Next | ModelFamily::Qwen3_5Moe => Some("mtp."),
            _ => None,
        }
    }

    /// Whether the config's `decoder_sparse_step` and `mlp_only_layers` can make layers dense
    /// (as transformers' Qwen2-MoE, Qwen3-MoE and Qwen3-Next read them; Mixtral, OLMoE and
    /// Qwen3.5 MoE, every layer of which is MoE, have none).
    fn has_dense_layers(self) -> bool {
        matches!(
            self,
            ModelFamily::Qwen3Moe | ModelFamily::Qwen2Moe | ModelFamily::Qwen3Next
        )
    }

    /// Whether the family counts its experts under `n_routed_experts`, makes the first
    /// `first_k_dense_replace` layers dense, and may carry `num_nextn_predict_layers`
    /// multi-token-prediction layers after the last decoder layer (GLM-4.5, DeepSeek).
    fn first_k_dense(self) -> bool {
        matches!(
            self,
            ModelFamily::Glm4Moe | ModelFamily::DeepseekV3 | ModelFamily::DeepseekV2
        )
    }
}

/// What Tarfa needs from `config.json`, checked; the whole document is kept in `raw`.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfigSummary {
    /// `model_type`, e.g. `"qwen3_moe"`.
    pub model_type: String,
    pub family: ModelFamily,
    /// `architectures`, e.g. `["Qwen3MoeForCausalLM"]` (empty when absent).
    pub architectures: Vec<String>,
    pub num_hidden_layers: u32,
    /// `num_experts` or `num_local_experts` (whichever is present; equal when both are).
    pub num_experts: u32,
    pub num_experts_per_tok: u32,
    pub hidden_size: u64,
    /// The layers that have experts, ascending. For Qwen2/Qwen3-MoE: layer `l` is sparse unless
    /// it is in `mlp_only_layers` or `(l + 1) % decoder_sparse_step != 0`, as in transformers;
    /// for Mixtral and OLMoE every layer.
    pub moe_layers: Vec<u32>,
    /// `num_nextn_predict_layers` (GLM-4.5, DeepSeek; 0 otherwise): the checkpoint's layers
    /// `num_hidden_layers..num_hidden_layers + n` are multi-token-prediction modules, which
    /// next-token logits never use. Their tensors are skipped (listed in
    /// [`crate::Checkpoint::skipped`]), never carried or run.
    pub nextn_predict_layers: u32,
    /// `mtp_num_hidden_layers` as written (Qwen3-Next, Qwen3.5 MoE): the layers of the
    /// multi-token-prediction module under [`ModelFamily::mtp_prefix`], whose tensors are
    /// skipped (listed in [`crate::Checkpoint::mtp`]), never carried or run. Only the note on
    /// them reads it.
    pub mtp_hidden_layers: Option<u32>,
    /// `quantization_config.quant_method = "mxfp4"` on a gpt-oss config: its fused experts are
    /// the released MXFP4 blocks and scales. (The block's other keys are the runtime's rules
    /// to judge: tarfa-core refuses an unknown one by name.)
    pub mxfp4: bool,
    /// The whole `config.json`; for a multimodal wrapper, its `text_config` (the model
    /// converted).
    pub raw: Value,
    /// A multimodal release (Llama 4's `llama4`, Qwen3.5 MoE's `qwen3_5_moe`): only its text
    /// model is read (`text_config`, the tensors [`WrapperLayout::text_prefixes`] name).
    pub multimodal: Option<MultimodalWrapper>,
}

/// What a multimodal wrapper config said around its text model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MultimodalWrapper {
    /// The wrapper's `model_type`, e.g. `"llama4"`.
    pub model_type: String,
    /// The wrapper's `architectures` (e.g. `["Llama4ForConditionalGeneration"]`).
    pub architectures: Vec<String>,
    /// How its tensors are laid out around the text model's.
    pub layout: &'static WrapperLayout,
}

/// A multimodal release's layout around its text model: which config keys and tensors are
/// the text model's, under which names, and which parts a text-only forward never reads.
#[derive(Debug, PartialEq, Eq)]
pub struct WrapperLayout {
    /// The wrapper's `model_type`.
    pub model_type: &'static str,
    /// The text model inside (`text_config.model_type`, taken to be this one's when absent).
    pub text: ModelFamily,
    /// The top-level keys the wrapper config may carry besides `text_config`: the vision
    /// tower's and the image and video tokens' (which a text-only forward never reads) and
    /// bookkeeping. Any other key is refused by name: it might change the text model.
    pub keys: &'static [&'static str],
    /// `(wrapper prefix, text prefix)`: a tensor named `wrapper prefix + rest` is the text
    /// model's `text prefix + rest`.
    pub text_prefixes: &'static [(&'static str, &'static str)],
    /// The prefixes of the parts left out (the vision tower and its projector): validated,
    /// recorded by name, never carried.
    pub left_out: &'static [&'static str],
}

/// What a wrapper makes of one tensor name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WrappedTensor {
    /// The text model's, under this name.
    Text(String),
    /// A part the text model never reads (the vision tower): left out.
    LeftOut,
}

impl WrapperLayout {
    /// A tensor of the wrapped checkpoint: the text model's (under the text model's name) or
    /// a left-out part's; `None` for a name the layout does not place, which is refused.
    pub fn classify(&self, name: &str) -> Option<WrappedTensor> {
        for (outer, inner) in self.text_prefixes {
            if let Some(rest) = name.strip_prefix(outer) {
                return Some(WrappedTensor::Text(format!("{inner}{rest}")));
            }
        }
        self.left_out
            .iter()
            .any(|p| name.starts_with(p))
            .then_some(WrappedTensor::LeftOut)
    }
}

/// Llama 4's multimodal release (`Llama4ForConditionalGeneration`): the text model under
/// `language_model.`, the vision tower and its projector at the top level.
pub static LLAMA4_WRAPPER: WrapperLayout = WrapperLayout {
    model_type: "llama4",
    text: ModelFamily::Llama4Text,
    keys: &[
        "architectures",
        "model_type",
        "text_config",
        "vision_config",
        "boi_token_index",
        "eoi_token_index",
        "image_token_index",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "tie_word_embeddings",
    ],
    text_prefixes: &[
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    ],
    left_out: &["vision_model.", "multi_modal_projector."],
};

/// Qwen3.5 MoE's release (`Qwen3_5MoeForConditionalGeneration`, the keys of transformers'
/// `Qwen3_5MoeConfig`): the text model under `model.language_model.`, its `lm_head` and
/// multi-token-prediction module (`mtp.`, skipped as the text model's own) at the top level,
/// the vision tower under `model.visual.`.
pub static QWEN3_5_MOE_WRAPPER: WrapperLayout = WrapperLayout {
    model_type: "qwen3_5_moe",
    text: ModelFamily::Qwen3_5Moe,
    keys: &[
        "architectures",
        "model_type",
        "text_config",
        "vision_config",
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "tie_word_embeddings",
    ],
    text_prefixes: &[
        ("model.language_model.", "model."),
        ("lm_head.", "lm_head."),
        ("mtp.", "mtp."),
    ],
    left_out: &["model.visual."],
};

/// Every multimodal wrapper read, by its `model_type`.
const WRAPPERS: [&WrapperLayout; 2] = [&LLAMA4_WRAPPER, &QWEN3_5_MOE_WRAPPER];

impl ModelConfigSummary {
    /// Whether layer `layer` has experts.
    pub fn is_moe_layer(&self, layer: u32) -> bool {
        self.moe_layers.binary_search(&layer).is_ok()
    }

    /// Parses and checks a `config.json` document. `file` names it in errors.
    pub fn parse(file: &Path, text: &str) -> Result<ModelConfigSummary, CheckpointError> {
        let f = || PathBuf::from(file);
        match crate::json::first_duplicate_key(text) {
            Err(e) => {
                return Err(CheckpointError::ConfigInvalidJson {
                    file: f(),
                    message: e.to_string(),
                })
            }
            Ok(Some(path)) => {
                return Err(CheckpointError::DuplicateJsonKey {
                    file: f(),
                    key_path: crate::json::render_path(&path),
                })
            }
            Ok(None) => {}
        }
        let raw: Value =
            serde_json::from_str(text).map_err(|e| CheckpointError::ConfigInvalidJson {
                file: f(),
                message: e.to_string(),
            })?;
        let Some(obj) = raw.as_object() else {
            return Err(CheckpointError::ConfigInvalidJson {
                file: f(),
                message: "the top level is not an object".into(),
            });
        };
        let c = Fields { file, obj };

        // gpt-oss's MXFP4 release is the one quantized form accepted: its experts widen exactly.
        let mut mxfp4 = false;
        for key in ["quantization_config", "compression_config"] {
            if let Some(q) = c.get(key) {
                let method = q
                    .get("quant_method")
                    .and_then(Value::as_str)
                    .unwrap_or("unknown method")
                    .to_owned();
                let gpt_oss = c.get("model_type").and_then(Value::as_str)
                    == Some(ModelFamily::GptOss.model_type());
                if key == "quantization_config" && method == "mxfp4" && gpt_oss {
                    mxfp4 = true;
                    continue;
                }
                return Err(CheckpointError::QuantizedConfig {
                    file: f(),
                    key,
                    method,
                });
            }
        }

        let model_type = c
            .string("model_type")?
            .ok_or_else(|| c.missing("model_type"))?;
        if let Some(layout) = WRAPPERS.iter().find(|w| w.model_type == model_type) {
            return Self::parse_wrapper(file, &c, layout);
        }
        let family = ModelFamily::from_model_type(&model_type).ok_or_else(|| {
            CheckpointError::UnsupportedModelType {
                file: f(),
                model_type: model_type.clone(),
            }
        })?;
        let architectures = c.architectures()?;

        let num_hidden_layers = c.required_u32("num_hidden_layers")?;
        c.positive("num_hidden_layers", num_hidden_layers.into())?;
        let (count_field, count) = match (c.uint("num_experts")?, c.uint("num_local_experts")?) {
            // GLM-4.5 (and DeepSeek) count their routed experts under n_routed_experts.
            (None, None) if family.first_k_dense() => match c.uint("n_routed_experts")? {
                Some(n) => ("n_routed_experts", n),
                None => return Err(CheckpointError::ConfigMissingExpertCount { file: f() }),
            },
            (None, None) => return Err(CheckpointError::ConfigMissingExpertCount { file: f() }),
            (Some(a), Some(b)) if a != b => {
                return Err(CheckpointError::ConfigConflictingExpertCount {
                    file: f(),
                    num_experts: a,
                    num_local_experts: b,
                })
            }
            (Some(n), _) => ("num_experts", n),
            (None, Some(n)) => ("num_local_experts", n),
        };
        let num_experts = c.fits_u32(count_field, count)?;
        c.positive(count_field, count)?;
        let num_experts_per_tok = c.required_u32("num_experts_per_tok")?;
        c.positive("num_experts_per_tok", num_experts_per_tok.into())?;
        if num_experts_per_tok > num_experts {
            return Err(c.out_of_range(
                "num_experts_per_tok",
                num_experts_per_tok.into(),
                "more than the number of experts",
            ));
        }
        let hidden_size = c
            .uint("hidden_size")?
            .ok_or_else(|| c.missing("hidden_size"))?;
        c.positive("hidden_size", hidden_size)?;

        let moe_layers = if family == ModelFamily::Llama4Text {
            llama4_moe_layers(&c, num_hidden_layers)?
        } else if family.first_k_dense() {
            // layers 0..first_k_dense_replace are dense, as transformers builds them
            let k = c
                .uint("first_k_dense_replace")?
                .ok_or_else(|| c.missing("first_k_dense_replace"))?;
            (0..num_hidden_layers)
                .filter(|&l| u64::from(l) >= k)
                .collect()
        } else if family.has_dense_layers() {
            let step = match c.uint("decoder_sparse_step")? {
                None => 1,
                Some(s) => c.fits_u32("decoder_sparse_step", s)?,
            };
            c.positive("decoder_sparse_step", step.into())?;
            let dense = match c.get("mlp_only_layers") {
                None => Vec::new(),
                Some(v) => v
                    .as_array()
                    .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
                    .ok_or_else(|| {
                        c.wrong_type("mlp_only_layers", "an array of unsigned integers")
                    })?,
            };
            if let Some(&bad) = dense.iter().find(|&&l| l >= u64::from(num_hidden_layers)) {
                return Err(c.out_of_range(
                    "mlp_only_layers",
                    bad,
                    "names a layer past num_hidden_layers",
                ));
            }
            (0..num_hidden_layers)
                .filter(|&l| {
                    !dense.contains(&u64::from(l))
                        && (u64::from(l) + 1).is_multiple_of(u64::from(step))
                })
                .collect()
        } else {
            (0..num_hidden_layers).collect()
        };

        let nextn_predict_layers = if family.first_k_dense() {
            match c.uint("num_nextn_predict_layers")? {
                None => 0,
                Some(n) => c.fits_u32("num_nextn_predict_layers", n)?,
            }
        } else {
            0
        };
        let mtp_hidden_layers = match (family.mtp_prefix(), c.uint("mtp_num_hidden_layers")?) {
            (Some(_), Some(n)) => Some(c.fits_u32("mtp_num_hidden_layers", n)?),
            _ => None,
        };
        if family == ModelFamily::Qwen3_5Moe {
            mrope_reduces_to_rope(&c)?;
        }

        Ok(ModelConfigSummary {
            model_type,
            family,
            architectures,
            num_hidden_layers,
            num_experts,
            num_experts_per_tok,
            hidden_size,
            moe_layers,
            nextn_predict_layers,
            mtp_hidden_layers,
            mxfp4,
            raw,
            multimodal: None,
        })
    }

    /// A multimodal wrapper config: its `text_config` parsed as a config of the wrapped text
    /// model (its `model_type` must be that, or absent and then taken to be), the wrapper's
    /// own keys checked against the layout's list.
    fn parse_wrapper(
        file: &Path,
        c: &Fields<'_>,
        layout: &'static WrapperLayout,
    ) -> Result<ModelConfigSummary, CheckpointError> {
        if let Some(key) = c.obj.keys().find(|k| !layout.keys.contains(&k.as_str())) {
            return Err(CheckpointError::WrapperKeyRefused {
                file: file.into(),
                wrapper: layout.model_type,
                key: key.clone(),
            });
        }
        let mut text = c
            .get("text_config")
            .ok_or_else(|| c.missing("text_config"))?
            .as_object()
            .ok_or_else(|| c.wrong_type("text_config", "an object"))?
            .clone();
        let text_type = layout.text.model_type();
        match text.get("model_type") {
            None => {
                text.insert("model_type".into(), Value::from(text_type));
            }
            Some(v) if v.as_str() == Some(text_type) => {}
            Some(v) => {
                return Err(CheckpointError::ConfigValueOutOfRange {
                    file: file.into(),
                    field: "text_config.model_type",
                    value: v.to_string(),
                    reason: "is not the text model this wrapper holds (llama4: llama4_text, \
                             qwen3_5_moe: qwen3_5_moe_text)",
                })
            }
        }
        // A top-level tie_word_embeddings that disagrees with the text model's is refused:
        // which one transformers honours depends on its version.
        if let Some(t) = c.get("tie_word_embeddings") {
            let inner = text
                .get("tie_word_embeddings")
                .unwrap_or(&Value::Bool(false));
            if t != inner {
                return Err(CheckpointError::ConfigValueOutOfRange {
                    file: file.into(),
                    field: "tie_word_embeddings",
                    value: t.to_string(),
                    reason: "disagrees with text_config.tie_word_embeddings",
                });
            }
        }
        let architectures = c.architectures()?;
        let text = Value::Object(text);
        let mut inner = ModelConfigSummary::parse(file, &text.to_string())?;
        inner.multimodal = Some(MultimodalWrapper {
            model_type: layout.model_type.into(),
            architectures,
            layout,
        });
        Ok(inner)
    }

    /// For a multimodal wrapper: the `config.json` the bundle carries, the text model's config
    /// (`raw`, pretty-printed), which is what the runtime runs. None otherwise (config.json is
    /// copied unchanged).
    pub fn bundle_config_json(&self) -> Option<Vec<u8>> {
        self.multimodal.as_ref()?;
        let mut v = serde_json::to_vec_pretty(&self.raw).ok()?;
        v.push(b'\n');
        Some(v)
    }
}

/// Qwen3.5's multimodal rotary embedding, on text: transformers' `Qwen3_5MoeTextRotaryEmbedding`
/// gives each of the rotary width's `rotary_dim / 2` frequencies the position of one of three
/// components (temporal, height, width), interleaved by `mrope_section`; a text token's three
/// components are its one position, so every frequency gets that position and the rotation is
/// plain RoPE, exactly, whether interleaved or not, and whatever widths the sections have. So
/// the sections are read for their form only: three unsigned widths (transformers indexes the
/// temporal, height and width sections); `mrope_interleaved` must be a boolean. Both are read in `rope_parameters` and, as older
/// releases wrote them, `rope_scaling`.
fn mrope_reduces_to_rope(c: &Fields<'_>) -> Result<(), CheckpointError> {
    const BLOCKS: [(&str, &str, &str); 2] = [
        (
            "rope_parameters",
            "rope_parameters.mrope_section",
            "rope_parameters.mrope_interleaved",
        ),
        (
            "rope_scaling",
            "rope_scaling.mrope_section",
            "rope_scaling.mrope_interleaved",
        ),
    ];
    for (block, section_key, interleaved_key) in BLOCKS {
        let Some(Value::Object(b)) = c.get(block) else {
            continue;
        };
        if let Some(v) = b.get("mrope_interleaved").filter(|v| !v.is_null()) {
            if !v.is_boolean() {
                return Err(c.wrong_type(interleaved_key, "a boolean"));
            }
        }
        let Some(v) = b.get("mrope_section").filter(|v| !v.is_null()) else {
            continue;
        };
        let sections = v
            .as_array()
            .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
            .ok_or_else(|| c.wrong_type(section_key, "an array of unsigned integers"))?;
        let refused = |reason| CheckpointError::ConfigValueOutOfRange {
            file: c.file.into(),
            field: section_key,
            value: v.to_string(),
            reason,
        };
        if sections.len() != 3 {
            return Err(refused(
                "multimodal RoPE has three sections (temporal, height, width)",
            ));
        }
        // Any sections: on text the temporal, height and width ids are the token's position,
        // so every frequency gets the same angle whichever id a section assigns it (qwen35moe-a
        // runs with the default [11, 11, 10] on a rotary width of 8: plain RoPE, as its oracle
        // shows). tarfa-core's config reader applies the same rule.
    }
    Ok(())
}

/// Llama 4's MoE layers as transformers' `Llama4TextConfig` resolves them: `moe_layers` when
/// given, else `list(range(step - 1, num_hidden_layers, step))` with `step =
/// interleave_moe_layer_step` (default 1). A listed layer past the last is refused, never
/// dropped: it would name a layer the checkpoint does not have.
fn llama4_moe_layers(c: &Fields<'_>, num_hidden_layers: u32) -> Result<Vec<u32>, CheckpointError> {
    let step = match c.uint("interleave_moe_layer_step")? {
        None => 1,
        Some(s) => c.fits_u32("interleave_moe_layer_step", s)?,
    };
    c.positive("interleave_moe_layer_step", step.into())?;
    let mut layers: Vec<u32> = match c.get("moe_layers") {
        None => (step - 1..num_hidden_layers)
            .step_by(step as usize)
            .collect(),
        Some(v) => {
            let list = v
                .as_array()
                .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
                .ok_or_else(|| c.wrong_type("moe_layers", "an array of unsigned integers"))?;
            if let Some(&bad) = list.iter().find(|&&l| l >= u64::from(num_hidden_layers)) {
                return Err(c.out_of_range(
                    "moe_layers",
                    bad,
                    "names a layer past num_hidden_layers",
                ));
            }
            list.into_iter().map(|l| l as u32).collect()
        }
    };
    layers.sort_unstable();
    layers.dedup();
    Ok(layers)
}

/// Typed access to the config object; `null` counts as absent, as transformers treats it.
struct Fields<'a> {
    file: &'a Path,
    obj: &'a Map<String, Value>,
}

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }
    fn missing(&self, field: &'static str) -> CheckpointError {
        CheckpointError::ConfigMissingField {
            file: self.file.into(),
            field,
        }
    }
    /// `architectures`: an array of strings (absent: none).
    fn architectures(&self) -> Result<Vec<String>, CheckpointError> {
        match self.get("architectures") {
            None => Ok(Vec::new()),
            Some(v) => v
                .as_array()
                .and_then(|a| {
                    a.iter()
                        .map(|s| s.as_str().map(str::to_owned))
                        .collect::<Option<Vec<_>>>()
                })
                .ok_or_else(|| self.wrong_type("architectures", "an array of strings")),
        }
    }
    fn wrong_type(&self, field: &'static str, expected: &'static str) -> CheckpointError {
        CheckpointError::ConfigWrongType {
            file: self.file.into(),
            field,
            expected,
        }
    }
    fn out_of_range(
        &self,
        field: &'static str,
        value: u64,
        reason: &'static str,
    ) -> CheckpointError {
        CheckpointError::ConfigValueOutOfRange {
            file: self.file.into(),
            field,
            value: value.to_string(),
            reason,
        }
    }
    fn string(&self, field: &'static str) -> Result<Option<String>, CheckpointError> {
        self.get(field)
            .map(|v| {
                v.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| self.wrong_type(field, "a string"))
            })
            .transpose()
    }
    fn uint(&self, field: &'static str) -> Result<Option<u64>, CheckpointError> {
        self.get(field)
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| self.wrong_type(field, "an unsigned integer"))
            })
            .transpose()
    }
    fn fits_u32(&self, field: &'static str, v: u64) -> Result<u32, CheckpointError> {
        u32::try_from(v).map_err(|_| self.out_of_range(field, v, "does not fit in 32 bits"))
    }
    fn required_u32(&self, field: &'static str) -> Result<u32, CheckpointError> {
        let v = self.uint(field)?.ok_or_else(|| self.missing(field))?;
        self.fits_u32(field, v)
    }
    fn positive(&self, field: &'static str, v: u64) -> Result<(), CheckpointError> {
        if v == 0 {
            return Err(self.out_of_range(field, 0, "must be at least 1"));
        }
        Ok(())
    }
}
