//! Fused expert tensors: families that store each layer's experts as one tensor per matrix,
//! the expert index outermost (gpt-oss's `mlp.experts.gate_up_proj` `[E, H, 2I]` and
//! `down_proj` `[E, I, H]`; in its MXFP4 release the `_blocks` and `_scales` of each).
//!
//! Each family with fused experts is one [`FusedExpertTable`] entry: the module, the two fused
//! tensors' names, how gate and up share `gate_up` ([`GateUpStacking`]), and the per-expert
//! bias tensors. Expert `e`'s slice of each fused tensor is one contiguous byte range, so the
//! converter can make it that expert's extent. Llama 4's `feed_forward.experts.gate_up_proj` /
//! `down_proj` ([`LLAMA4_FUSED`]) differ from gpt-oss's only in the column rule
//! ([`GateUpColumns::Halves`]) and in having no biases. Both are `[in, out]` per expert and are
//! re-laid; Qwen3.5 MoE's released experts ([`QWEN3_5_MOE_FUSED`]) are `[out, in]` with gate
//! and up stacked by rows ([`GateUpStacking::Rows`]): an expert's slices are its extent as
//! they are.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::config::ModelConfigSummary;
use crate::error::CheckpointError;
use crate::{Dtype, SourceTensor};

/// How gate and up share the columns of `gate_up` (`[E, H, 2I]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateUpColumns {
    /// Column `2j` is gate row `j`, `2j + 1` up row `j` (gpt-oss). In the MXFP4 form, which is
    /// `[out, in]`, the same holds for rows.
    Interleaved,
    /// Columns `0..I` are gate, `I..2I` up: gate row `j` is column `j`, up row `j` column
    /// `I + j` (Llama 4: transformers' `Llama4TextExperts` does
    /// `gate, up = gate_up.chunk(2, dim=-1)`). BF16 only.
    Halves,
}

/// How a family's BF16 `gate_up` holds gate and up, and so how both fused tensors are shaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateUpStacking {
    /// `gate_up` `[E, H, 2I]` and `down` `[E, I, H]`: each expert's matrices `[in, out]`, gate
    /// and up sharing `gate_up`'s columns as [`GateUpColumns`] says (gpt-oss, Llama 4). The
    /// converter re-lays them into the extent's `[out, in]` by a declared permutation.
    Columns(GateUpColumns),
    /// `gate_up` `[E, 2I, H]` and `down` `[E, H, I]`: each expert's matrices `[out, in]`, gate
    /// the rows `0..I` of `gate_up[e]` and up the rows `I..2I` (Qwen3.5 MoE: transformers'
    /// `Qwen3_5MoeExperts` does `linear(x, gate_up_proj[e]).chunk(2, dim=-1)`). Expert e's
    /// slice of `gate_up` then its slice of `down` are its extent gate | up | down, byte for
    /// byte: no re-layout.
    Rows,
}

/// One family's fused expert tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FusedExpertTable {
    /// The module path between `model.layers.L.` and the tensor names.
    pub module: &'static str,
    /// `gate_up_proj`: `[E, H, 2I]` or `[E, 2I, H]` (BF16, as [`GateUpStacking`] says), or
    /// `_blocks` `[E, 2I, H/32, 16]` and `_scales` `[E, 2I, H/32]` (MXFP4).
    pub gate_up: &'static str,
    /// `down_proj`: `[E, I, H]` or `[E, H, I]` (BF16), or `_blocks` `[E, H, I/32, 16]` and
    /// `_scales` `[E, H, I/32]` (MXFP4).
    pub down: &'static str,
    pub stacking: GateUpStacking,
    /// Per-expert bias tensors under the module (`[E, 2I]`, `[E, H]`): small, carried as
    /// ordinary tensors.
    pub biases: &'static [&'static str],
}

/// gpt-oss (transformers' `GptOssExperts`).
pub static GPT_OSS_FUSED: FusedExpertTable = FusedExpertTable {
    module: "mlp.experts",
    gate_up: "gate_up_proj",
    down: "down_proj",
    stacking: GateUpStacking::Columns(GateUpColumns::Interleaved),
    biases: &["gate_up_proj_bias", "down_proj_bias"],
};

/// Llama 4 text (transformers' `Llama4TextExperts`): BF16, no biases.
pub static LLAMA4_FUSED: FusedExpertTable = FusedExpertTable {
    module: "feed_forward.experts",
    gate_up: "gate_up_proj",
    down: "down_proj",
    stacking: GateUpStacking::Columns(GateUpColumns::Halves),
    biases: &[],
};

/// Qwen3.5 MoE as released (transformers' `Qwen3_5MoeExperts`): BF16, gate and up stacked by
/// rows, no biases. (transformers' `save_pretrained` writes the per-expert form instead,
/// which [`crate::ExpertStorage::PerExpertOrFused`] also reads.)
pub static QWEN3_5_MOE_FUSED: FusedExpertTable = FusedExpertTable {
    module: "mlp.experts",
    gate_up: "gate_up_proj",
    down: "down_proj",
    stacking: GateUpStacking::Rows,
    biases: &[],
};

/// The source tensors of one layer's fused experts, in extent order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FusedForm {
    /// `[gate_up, down]`, BF16.
    Bf16 { gate_up: String, down: String },
    /// `[gate_up_blocks, gate_up_scales, down_blocks, down_scales]`, U8, as released.
    Mxfp4 { parts: [String; 4] },
}

/// One layer's fused experts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FusedLayer {
    pub layer: u32,
    pub form: FusedForm,
    pub stacking: GateUpStacking,
    pub hidden: u64,
    pub intermediate: u64,
}

impl FusedLayer {
    /// The source tensors in extent order.
    pub fn tensors(&self) -> Vec<&str> {
        match &self.form {
            FusedForm::Bf16 { gate_up, down } => vec![gate_up, down],
            FusedForm::Mxfp4 { parts } => parts.iter().map(String::as_str).collect(),
        }
    }

    /// `model.layers.L.<module>.E`: the name the expert's extent gets.
    pub fn expert_prefix(&self, table: &FusedExpertTable, expert: u32) -> String {
        format!("model.layers.{}.{}.{expert}", self.layer, table.module)
    }
}

impl FusedExpertTable {
    fn layer_name(&self, layer: u32, tensor: &str, suffix: &str) -> String {
        format!("model.layers.{layer}.{}.{tensor}{suffix}", self.module)
    }

    /// The fused tensors of layer `layer`, in extent order.
    pub fn tensor_names(&self, layer: u32, mxfp4: bool) -> Vec<String> {
        if mxfp4 {
            [self.gate_up, self.down]
                .iter()
                .flat_map(|t| ["_blocks", "_scales"].map(|s| self.layer_name(layer, t, s)))
                .collect()
        } else {
            vec![
                self.layer_name(layer, self.gate_up, ""),
                self.layer_name(layer, self.down, ""),
            ]
        }
    }

    /// The per-expert bias tensors of layer `layer`.
    pub fn bias_names(&self, layer: u32) -> Vec<String> {
        self.biases
            .iter()
            .map(|b| self.layer_name(layer, b, ""))
            .collect()
    }

    /// The expected form, for error messages.
    pub fn pattern(&self, mxfp4: bool) -> String {
        let suffix = if mxfp4 { "{_blocks,_scales}" } else { "" };
        let biases = if self.biases.is_empty() {
            String::new()
        } else {
            format!(" (and {})", self.biases.join(", "))
        };
        format!(
            "model.layers.<L>.{}.{{{},{}}}{suffix}{biases}",
            self.module, self.gate_up, self.down,
        )
    }
}

/// Whether `name` is an MXFP4 part this config accepts as U8 (the released blocks and scales
/// of a MoE layer's fused experts; nothing else).
pub(crate) fn is_mxfp4_part(config: &ModelConfigSummary, name: &str) -> bool {
    let Some(table) = config.family.fused_experts() else {
        return false;
    };
    config.mxfp4
        && config
            .moe_layers
            .iter()
            .any(|&l| table.tensor_names(l, true).iter().any(|n| n == name))
}

/// Every MoE layer's fused tensors: present, with the dtype of the config's form, E outermost
/// and shapes that agree with `hidden_size` and each other.
pub(crate) fn classify_fused(
    config: &ModelConfigSummary,
    table: &FusedExpertTable,
    tensors: &BTreeMap<String, SourceTensor>,
    weights_file: &Path,
    shard_file: &dyn Fn(usize) -> PathBuf,
) -> Result<BTreeMap<u32, FusedLayer>, CheckpointError> {
    let (e, h) = (u64::from(config.num_experts), config.hidden_size);
    let mut out = BTreeMap::new();
    for &layer in &config.moe_layers {
        let names = table.tensor_names(layer, config.mxfp4);
        let mut found = Vec::with_capacity(names.len());
        for name in &names {
            let t = tensors
                .get(name)
                .ok_or_else(|| CheckpointError::FusedTensorMissing {
                    file: weights_file.into(),
                    layer,
                    tensor: name.clone(),
                })?;
            let want = if config.mxfp4 { Dtype::U8 } else { Dtype::BF16 };
            if t.dtype != want {
                return Err(CheckpointError::FusedTensorDtype {
                    file: shard_file(t.shard),
                    tensor: name.clone(),
                    dtype: t.dtype,
                    expected: want,
                });
            }
            found.push(t);
        }
        // I from gate_up: BF16 [E, H, 2I] (columns) or [E, 2I, H] (rows); MXFP4 blocks
        // [E, 2I, H/32, 16].
        let rows = config.mxfp4 || table.stacking == GateUpStacking::Rows;
        let two_i = found[0]
            .shape
            .get(if rows { 1 } else { 2 })
            .copied()
            .unwrap_or(0);
        let i = two_i / 2;
        let expected: Vec<Vec<u64>> = match (config.mxfp4, table.stacking) {
            (true, _) => vec![
                vec![e, 2 * i, h / 32, 16],
                vec![e, 2 * i, h / 32],
                vec![e, h, i / 32, 16],
                vec![e, h, i / 32],
            ],
            (false, GateUpStacking::Columns(_)) => vec![vec![e, h, 2 * i], vec![e, i, h]],
            (false, GateUpStacking::Rows) => vec![vec![e, 2 * i, h], vec![e, h, i]],
        };
        let bad_width = i == 0 || two_i % 2 != 0 || (config.mxfp4 && (h % 32 != 0 || i % 32 != 0));
        for ((name, t), want) in names.iter().zip(&found).zip(&expected) {
            if bad_width || &t.shape != want {
                return Err(CheckpointError::ExpertMatrixShape {
                    file: shard_file(t.shard),
                    tensor: name.clone(),
                    shape: t.shape.clone(),
                    expected: want.clone(),
                });
            }
        }
        let form = if config.mxfp4 {
            FusedForm::Mxfp4 {
                parts: names.clone().try_into().expect("four MXFP4 parts"),
            }
        } else {
            FusedForm::Bf16 {
                gate_up: names[0].clone(),
                down: names[1].clone(),
            }
        };
        out.insert(
            layer,
            FusedLayer {
                layer,
                form,
                stacking: table.stacking,
                hidden: h,
                intermediate: i,
            },
        );
    }
    Ok(out)
}
