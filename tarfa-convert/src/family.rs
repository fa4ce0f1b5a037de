//! The runtime's own family rules (`tarfa-core`) applied to a checkpoint before a byte is
//! written: the config must be one the runtime runs, every tensor must have the shape and dtype
//! the runtime will check at load, and a tokenizer.json must load and fit the vocabulary. A
//! checkpoint the runtime would refuse is refused here, not after a long conversion.

use std::collections::BTreeMap;
use std::path::PathBuf;

use tarfa_checkpoint::{
    Checkpoint, ExpertDims, ExpertMatrix, FusedForm, GateUpStacking, CONFIG_FILE,
};
use tarfa_core::config::{ConfigError, MoeConfig};
use tarfa_core::shapes::{check_non_expert_dtype, FoundTensor, ModelRules, ShapeError};
use tarfa_core::tokenizer::check_tokenizer;

use crate::ConvertError;

/// The tokenizer file the runtime loads for `--prompt`.
const TOKENIZER_FILE: &str = "tokenizer.json";

/// Checks `ckpt` against the runtime's rules; the first failure names its file and check.
pub(crate) fn check(ckpt: &Checkpoint) -> Result<(), ConvertError> {
    let config_error = |source| ConvertError::Config {
        file: CONFIG_FILE.into(),
        source,
    };
    let obj = ckpt
        .config
        .raw
        .as_object()
        .ok_or_else(|| config_error(ConfigError::NotAnObject))?;
    let cfg = MoeConfig::from_json_object(obj).map_err(config_error)?;

    // The shard a tensor lives in, or the weights file for a tensor that is absent.
    let file_of = |e: &ShapeError| -> PathBuf {
        let shard = ckpt.tensors.get(e.tensor()).map(|t| t.shard);
        match shard.and_then(|i| ckpt.shards.get(i)) {
            Some(s) => s.name.as_str().into(),
            None => ckpt.weights_file().into(),
        }
    };
    let shape_error = |source: ShapeError| ConvertError::Shape {
        file: file_of(&source),
        source,
    };
    // Every non-expert tensor is carried, so every one must be in a type the runtime reads.
    for name in &ckpt.non_expert {
        let dtype = ckpt.tensors[name].dtype.to_string();
        check_non_expert_dtype(name, &dtype).map_err(shape_error)?;
    }
    let dtypes: BTreeMap<&str, String> = ckpt
        .tensors
        .iter()
        .map(|(name, t)| (name.as_str(), t.dtype.to_string()))
        .collect();
    // Experts fused by rows (Qwen3.5 MoE as released) where the rules name each expert's
    // matrices: expert e's gate, up and down are byte ranges of its slices of the fused tensors,
    // exactly the per-expert form's matrices (the checkpoint reader checked the fused shapes),
    // so they answer for those names with the per-expert shapes.
    let row_fused: BTreeMap<u32, [Vec<u64>; 3]> = ckpt
        .fused
        .values()
        .filter(|f| {
            matches!(
                (&f.form, f.stacking),
                (FusedForm::Bf16 { .. }, GateUpStacking::Rows)
            )
        })
        .map(|f| {
            let dims = ExpertDims {
                intermediate: f.intermediate,
                hidden: f.hidden,
            };
            (f.layer, ExpertMatrix::ALL.map(|m| dims.shape(m).to_vec()))
        })
        .collect();
    let row_fused_matrix = |name: &str| {
        let (layer, expert, m) = ckpt.naming.parse(name)?;
        let shapes = row_fused.get(&layer)?;
        (expert < ckpt.config.num_experts).then(|| FoundTensor {
            dtype: "BF16",
            shape: &shapes[m as usize],
        })
    };
    ModelRules::for_config(&cfg)
        .check(|name| match ckpt.tensors.get(name) {
            Some(t) => Some(FoundTensor {
                dtype: dtypes.get(name)?,
                shape: &t.shape,
            }),
            None => row_fused_matrix(name),
        })
        .map_err(shape_error)?;

    if let Some(f) = ckpt.extra_files.iter().find(|f| f.name == TOKENIZER_FILE) {
        let bytes = std::fs::read(&f.path).map_err(ConvertError::io(TOKENIZER_FILE, "read"))?;
        check_tokenizer(&bytes, cfg.vocab_size).map_err(|source| ConvertError::Tokenizer {
            file: TOKENIZER_FILE.into(),
            source,
        })?;
    }
    Ok(())
}
