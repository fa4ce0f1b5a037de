//! Expert tensors: how each family names them, and the checks that every Mixture-of-Experts layer
//! has every expert, each with exactly a gate, an up and a down matrix of consistent shapes.
//! Also the dtype policy: bytes are never re-quantised, so quantized releases are refused.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::config::{ExpertStorage, ModelConfigSummary};
use crate::error::CheckpointError;
use crate::{Dtype, SourceTensor};

/// How a family names its expert matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExpertNaming {
    /// `model.layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight`
    /// (Qwen3-MoE, Qwen2-MoE, OLMoE).
    QwenStyle,
    /// `model.layers.L.block_sparse_moe.experts.E.{w1,w3,w2}.weight`
    /// (w1 = gate, w3 = up, w2 = down).
    Mixtral,
}

/// One of an expert's three matrices. `as usize` indexes [`ExpertSource::tensors`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ExpertMatrix {
    /// Shape `[intermediate, hidden]`; `silu(gate x)` gates the up projection.
    Gate = 0,
    /// Shape `[intermediate, hidden]`.
    Up = 1,
    /// Shape `[hidden, intermediate]`.
    Down = 2,
}

impl ExpertMatrix {
    /// Gate, up, down: the order experts are stored and listed in everywhere in Tarfa.
    pub const ALL: [ExpertMatrix; 3] = [ExpertMatrix::Gate, ExpertMatrix::Up, ExpertMatrix::Down];
}

impl ExpertNaming {
    /// The module path between `model.layers.L.` and `.E.`.
    pub fn experts_module(self) -> &'static str {
        match self {
            ExpertNaming::QwenStyle => "mlp.experts",
            ExpertNaming::Mixtral => "block_sparse_moe.experts",
        }
    }

    /// The matrix names in gate, up, down order.
    pub fn matrix_names(self) -> [&'static str; 3] {
        match self {
            ExpertNaming::QwenStyle => ["gate_proj", "up_proj", "down_proj"],
            ExpertNaming::Mixtral => ["w1", "w3", "w2"],
        }
    }

    /// `model.layers.L.<experts_module>.E`.
    pub fn expert_prefix(self, layer: u32, expert: u32) -> String {
        format!("model.layers.{layer}.{}.{expert}", self.experts_module())
    }

    /// The full tensor name of one matrix of one expert.
    pub fn tensor_name(self, layer: u32, expert: u32, matrix: ExpertMatrix) -> String {
        format!(
            "{}.{}.weight",
            self.expert_prefix(layer, expert),
            self.matrix_names()[matrix as usize]
        )
    }

    /// The expected form, for error messages.
    pub fn pattern(self) -> String {
        let [g, u, d] = self.matrix_names();
        format!(
            "model.layers.<L>.{}.<E>.{{{g},{u},{d}}}.weight",
            self.experts_module()
        )
    }

    /// Parses an expert matrix name into (layer, expert, matrix). Ids must be canonical decimal
    /// (no sign, no leading zero), so two spellings can never name the same matrix.
    pub fn parse(self, name: &str) -> Option<(u32, u32, ExpertMatrix)> {
        let rest = name.strip_prefix("model.layers.")?;
        let (layer, rest) = rest.split_once('.')?;
        let rest = rest
            .strip_prefix(self.experts_module())?
            .strip_prefix('.')?;
        let (expert, rest) = rest.split_once('.')?;
        let matrix = rest.strip_suffix(".weight")?;
        let m = self.matrix_names().iter().position(|&n| n == matrix)?;
        Some((
            canonical_u32(layer)?,
            canonical_u32(expert)?,
            ExpertMatrix::ALL[m],
        ))
    }
}

fn canonical_u32(s: &str) -> Option<u32> {
    let digits = !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits || (s.len() > 1 && s.starts_with('0')) {
        return None;
    }
    s.parse().ok()
}

/// Whether a tensor sits under an `experts` module, i.e. must be an expert matrix.
/// (Qwen2-MoE's `mlp.shared_expert.*` does not: it is a non-expert tensor.)
fn under_experts(name: &str) -> bool {
    name.split('.').any(|part| part == "experts")
}

/// One routed expert's three matrices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertSource {
    pub layer: u32,
    pub expert: u32,
    /// `model.layers.L.mlp.experts.E` (or `...block_sparse_moe.experts.E`).
    pub prefix: String,
    /// Tensor names in gate, up, down order (index with `ExpertMatrix as usize`).
    pub tensors: [String; 3],
}

impl ExpertSource {
    /// The tensor name of one matrix.
    pub fn tensor(&self, matrix: ExpertMatrix) -> &str {
        &self.tensors[matrix as usize]
    }
}

/// The shapes shared by every expert of one layer: gate and up are `[intermediate, hidden]`,
/// down is `[hidden, intermediate]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertDims {
    pub intermediate: u64,
    pub hidden: u64,
}

impl ExpertDims {
    /// The expected shape of one matrix.
    pub fn shape(self, matrix: ExpertMatrix) -> [u64; 2] {
        match matrix {
            ExpertMatrix::Gate | ExpertMatrix::Up => [self.intermediate, self.hidden],
            ExpertMatrix::Down => [self.hidden, self.intermediate],
        }
    }
}

pub(crate) struct ExpertTable {
    pub experts: BTreeMap<(u32, u32), ExpertSource>,
    /// A fused-expert family's fused tensors by layer (empty otherwise).
    pub fused: BTreeMap<u32, crate::FusedLayer>,
    pub dims: BTreeMap<u32, ExpertDims>,
    pub non_expert: Vec<String>,
    /// Multi-token-prediction tensors (see [`is_mtp`]), sorted.
    pub skipped: Vec<String>,
}

/// Whether a tensor is part of a multi-token-prediction module, skipped: a layer
/// `num_hidden_layers..num_hidden_layers + num_nextn_predict_layers` (GLM-4.5, DeepSeek), or
/// a name under the family's `mtp.` prefix (Qwen3-Next, Qwen3.5 MoE).
fn is_mtp(config: &ModelConfigSummary, name: &str) -> bool {
    let extra_layers = config.num_hidden_layers
        ..config
            .num_hidden_layers
            .saturating_add(config.nextn_predict_layers);
    layer_of(name).is_some_and(|l| extra_layers.contains(&l))
        || config
            .family
            .mtp_prefix()
            .is_some_and(|p| name.starts_with(p))
}

/// The layer index of a `model.layers.L.` tensor name.
fn layer_of(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("model.layers.")?;
    let (idx, _) = rest.split_once('.')?;
    // canonical decimal only: "01" is not layer 1
    if idx.len() > 1 && idx.starts_with('0') {
        return None;
    }
    idx.parse().ok()
}

/// Segments that only quantization schemes put in tensor names (GPTQ/AWQ `qweight`, `qzeros`,
/// `scales`, `g_idx`; FP8 `weight_scale_inv`, `input_scale`; compressed-tensors `weight_packed`,
/// `weight_zero_point`; bitsandbytes `absmax`, `quant_map`, `quant_state`, `SCB`).
const QUANT_SEGMENTS: &[&str] = &[
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
    "weight_scale",
    "weight_scale_inv",
    "input_scale",
    "weight_zero_point",
    "weight_packed",
    "weight_global_scale",
    "input_global_scale",
    "weight_shape",
    "weight_g_idx",
    "absmax",
    "nested_absmax",
    "quant_map",
    "nested_quant_map",
    "quant_state",
    "SCB",
    "weight_format",
];

fn is_quant_companion(name: &str) -> bool {
    name.split('.').any(|part| {
        QUANT_SEGMENTS.contains(&part)
            || part.starts_with("quant_state")
            || part.ends_with("_scales")
            || part.ends_with("_blocks")
            || part.ends_with("_scale_inv")
    })
}

fn is_quantized(d: Dtype) -> bool {
    matches!(
        d,
        Dtype::F8_E4M3
            | Dtype::F8_E5M2
            | Dtype::F8_E8M0
            | Dtype::F8_E4M3FNUZ
            | Dtype::F8_E5M2FNUZ
            | Dtype::F6_E2M3
            | Dtype::F6_E3M2
            | Dtype::F4
            | Dtype::I8
            | Dtype::U8
    )
}

fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::BF16 | Dtype::F16 | Dtype::F32 | Dtype::F64)
}

/// The dtype policy over every tensor: no quantization companions, no quantized dtypes, nothing
/// but BF16/F16/F32/F64. `shard_file(i)` names shard `i` in errors.
pub(crate) fn check_dtypes(
    config: &ModelConfigSummary,
    tensors: &BTreeMap<String, SourceTensor>,
    shard_file: &dyn Fn(usize) -> PathBuf,
) -> Result<(), CheckpointError> {
    for (name, t) in tensors {
        let file = || shard_file(t.shard);
        // gpt-oss's released MXFP4 blocks and scales, and nothing else, may be U8.
        if t.dtype == Dtype::U8 && crate::fused::is_mxfp4_part(config, name) {
            continue;
        }
        if is_quant_companion(name) {
            return Err(CheckpointError::QuantizationCompanion {
                file: file(),
                tensor: name.clone(),
            });
        }
        if is_quantized(t.dtype) {
            return Err(CheckpointError::QuantizedTensor {
                file: file(),
                tensor: name.clone(),
                dtype: t.dtype,
            });
        }
        if !is_float(t.dtype) {
            return Err(CheckpointError::UnsupportedDtype {
                file: file(),
                tensor: name.clone(),
                dtype: t.dtype,
            });
        }
    }
    Ok(())
}

/// Sorts tensors into experts and the rest, and checks the experts against the config.
/// `weights_file` names the checkpoint as a whole (index or single file) in errors about absent
/// tensors; `shard_file(i)` names shard `i`.
pub(crate) fn classify(
    config: &ModelConfigSummary,
    naming: ExpertNaming,
    tensors: &BTreeMap<String, SourceTensor>,
    weights_file: &Path,
    shard_file: &dyn Fn(usize) -> PathBuf,
) -> Result<ExpertTable, CheckpointError> {
    match config.family.expert_storage() {
        ExpertStorage::Fused(table) => {
            return classify_fused_family(config, table, tensors, weights_file, shard_file)
        }
        // Fused when any MoE layer has a fused tensor; a layer then without its own, or a
        // per-expert matrix beside them, is refused by name as in a fused-only family.
        ExpertStorage::PerExpertOrFused(table)
            if config.moe_layers.iter().any(|&l| {
                table
                    .tensor_names(l, config.mxfp4)
                    .iter()
                    .any(|n| tensors.contains_key(n.as_str()))
            }) =>
        {
            return classify_fused_family(config, table, tensors, weights_file, shard_file)
        }
        ExpertStorage::PerExpert | ExpertStorage::PerExpertOrFused(_) => {}
    }
    let mut slots: BTreeMap<(u32, u32), [Option<&str>; 3]> = BTreeMap::new();
    let mut non_expert = Vec::new();
    let mut skipped = Vec::new();
    for (name, t) in tensors {
        if is_mtp(config, name) {
            skipped.push(name.clone());
            continue;
        }
        if !under_experts(name) {
            non_expert.push(name.clone());
            continue;
        }
        let file = || shard_file(t.shard);
        let Some((layer, expert, matrix)) = naming.parse(name) else {
            return Err(CheckpointError::UnexpectedExpertTensor {
                file: file(),
                tensor: name.clone(),
                expected: naming.pattern(),
            });
        };
        if layer >= config.num_hidden_layers {
            return Err(CheckpointError::ExpertLayerOutOfRange {
                file: file(),
                tensor: name.clone(),
                layer,
                num_layers: config.num_hidden_layers,
            });
        }
        if expert >= config.num_experts {
            return Err(CheckpointError::ExpertIdOutOfRange {
                file: file(),
                tensor: name.clone(),
                expert,
                num_experts: config.num_experts,
            });
        }
        if !config.is_moe_layer(layer) {
            return Err(CheckpointError::ExpertsInDenseLayer {
                file: file(),
                tensor: name.clone(),
                layer,
            });
        }
        // Canonical ids make each (layer, expert, matrix) one name, so a slot is filled once.
        slots.entry((layer, expert)).or_default()[matrix as usize] = Some(name);
    }
    if slots.is_empty() {
        return Err(CheckpointError::NoExpertTensors {
            file: weights_file.into(),
            example: naming.tensor_name(0, 0, ExpertMatrix::Gate),
        });
    }

    let mut experts = BTreeMap::new();
    for &layer in &config.moe_layers {
        for expert in 0..config.num_experts {
            let Some(found) = slots.get(&(layer, expert)) else {
                return Err(CheckpointError::MissingExpert {
                    file: weights_file.into(),
                    layer,
                    expert,
                });
            };
            let mut names: [String; 3] = Default::default();
            for m in ExpertMatrix::ALL {
                names[m as usize] = match found[m as usize] {
                    Some(n) => n.to_owned(),
                    None => {
                        return Err(CheckpointError::ExpertMissingMatrix {
                            file: weights_file.into(),
                            layer,
                            expert,
                            tensor: naming.tensor_name(layer, expert, m),
                        })
                    }
                };
            }
            experts.insert(
                (layer, expert),
                ExpertSource {
                    layer,
                    expert,
                    prefix: naming.expert_prefix(layer, expert),
                    tensors: names,
                },
            );
        }
    }

    for e in experts.values() {
        for name in &e.tensors {
            let t = &tensors[name];
            if t.dtype != Dtype::BF16 {
                return Err(CheckpointError::ExpertNotBf16 {
                    file: shard_file(t.shard),
                    tensor: name.clone(),
                    dtype: t.dtype,
                });
            }
        }
    }

    let mut dims: BTreeMap<u32, (ExpertDims, &str)> = BTreeMap::new();
    for e in experts.values() {
        let gate = &tensors[e.tensor(ExpertMatrix::Gate)];
        let own = ExpertDims {
            intermediate: gate.shape.first().copied().unwrap_or(0),
            hidden: config.hidden_size,
        };
        // Each matrix against its siblings and hidden_size (gate's first dimension sets the width).
        for m in ExpertMatrix::ALL {
            let t = &tensors[e.tensor(m)];
            let expected = own.shape(m);
            if t.shape != expected || own.intermediate == 0 {
                return Err(CheckpointError::ExpertMatrixShape {
                    file: shard_file(t.shard),
                    tensor: e.tensor(m).to_owned(),
                    shape: t.shape.clone(),
                    expected: expected.to_vec(),
                });
            }
        }
        // Then the expert against the layer's first expert.
        let (layer_dims, reference) = *dims
            .entry(e.layer)
            .or_insert((own, e.tensor(ExpertMatrix::Gate)));
        if own != layer_dims {
            let t = &tensors[e.tensor(ExpertMatrix::Gate)];
            return Err(CheckpointError::ExpertShapeMismatch {
                file: shard_file(t.shard),
                tensor: e.tensor(ExpertMatrix::Gate).to_owned(),
                shape: t.shape.clone(),
                expected: layer_dims.shape(ExpertMatrix::Gate).to_vec(),
                reference: reference.to_owned(),
            });
        }
    }

    let dims = dims.into_iter().map(|(l, (d, _))| (l, d)).collect();
    Ok(ExpertTable {
        experts,
        fused: BTreeMap::new(),
        dims,
        non_expert,
        skipped,
    })
}

/// A fused-expert checkpoint (gpt-oss, Llama 4, Qwen3.5 MoE as released): under each MoE
/// layer's experts module only the fused tensors (checked in [`crate::fused::classify_fused`])
/// and the per-expert biases (carried as non-expert tensors) may appear.
fn classify_fused_family(
    config: &ModelConfigSummary,
    table: &crate::FusedExpertTable,
    tensors: &BTreeMap<String, SourceTensor>,
    weights_file: &Path,
    shard_file: &dyn Fn(usize) -> PathBuf,
) -> Result<ExpertTable, CheckpointError> {
    let mut allowed_fused = std::collections::BTreeSet::new();
    let mut allowed_bias = std::collections::BTreeSet::new();
    for &l in &config.moe_layers {
        allowed_fused.extend(table.tensor_names(l, config.mxfp4));
        allowed_bias.extend(table.bias_names(l));
    }
    let mut non_expert = Vec::new();
    let mut skipped = Vec::new();
    for (name, t) in tensors {
        if allowed_fused.contains(name) {
            continue;
        }
        if is_mtp(config, name) {
            skipped.push(name.clone());
            continue;
        }
        if under_experts(name) && !allowed_bias.contains(name) {
            return Err(CheckpointError::UnexpectedExpertTensor {
                file: shard_file(t.shard),
                tensor: name.clone(),
                expected: table.pattern(config.mxfp4),
            });
        }
        non_expert.push(name.clone());
    }
    let fused = crate::fused::classify_fused(config, table, tensors, weights_file, shard_file)?;
    let dims = fused
        .iter()
        .map(|(&l, f)| {
            (
                l,
                ExpertDims {
                    intermediate: f.intermediate,
                    hidden: f.hidden,
                },
            )
        })
        .collect();
    Ok(ExpertTable {
        experts: BTreeMap::new(),
        fused,
        dims,
        non_expert,
        skipped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_names() {
        let q = ExpertNaming::QwenStyle;
        assert_eq!(
            q.parse("model.layers.3.mlp.experts.17.up_proj.weight"),
            Some((3, 17, ExpertMatrix::Up))
        );
        assert_eq!(
            q.parse("model.layers.03.mlp.experts.17.up_proj.weight"),
            None
        );
        assert_eq!(
            q.parse("model.layers.3.mlp.experts.+7.up_proj.weight"),
            None
        );
        assert_eq!(
            q.parse("model.layers.3.mlp.experts.4294967296.up_proj.weight"),
            None
        );
        assert_eq!(q.parse("model.layers.3.mlp.experts.gate_up_proj"), None);
        assert_eq!(q.parse("model.layers.3.mlp.experts.1.up_proj.bias"), None);
        assert_eq!(
            q.parse("model.layers.3.block_sparse_moe.experts.1.w1.weight"),
            None
        );
        let m = ExpertNaming::Mixtral;
        assert_eq!(
            m.parse("model.layers.0.block_sparse_moe.experts.7.w3.weight"),
            Some((0, 7, ExpertMatrix::Up))
        );
        assert_eq!(
            m.parse("model.layers.0.block_sparse_moe.experts.7.w2.weight"),
            Some((0, 7, ExpertMatrix::Down))
        );
        assert_eq!(
            m.tensor_name(1, 2, ExpertMatrix::Gate),
            "model.layers.1.block_sparse_moe.experts.2.w1.weight"
        );
        for l in [0u32, 9, 10, 4_000_000_000] {
            for mat in ExpertMatrix::ALL {
                assert_eq!(q.parse(&q.tensor_name(l, 5, mat)), Some((l, 5, mat)));
            }
        }
    }

    #[test]
    fn companions() {
        assert!(is_quant_companion(
            "model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv"
        ));
        assert!(is_quant_companion(
            "model.layers.0.mlp.experts.0.gate_proj.qweight"
        ));
        assert!(is_quant_companion(
            "model.layers.0.mlp.experts.0.gate_proj.weight.quant_state.bitsandbytes__nf4"
        ));
        assert!(is_quant_companion(
            "model.layers.0.mlp.experts.gate_up_proj_blocks"
        ));
        assert!(!is_quant_companion(
            "model.layers.0.mlp.shared_expert_gate.weight"
        ));
        assert!(!is_quant_companion(
            "model.layers.0.self_attn.q_norm.weight"
        ));
    }
}
