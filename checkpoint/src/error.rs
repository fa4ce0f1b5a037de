//! One error variant per check a checkpoint can fail.
//!
//! Every message is one line that starts with the file it is about (relative to the source
//! directory where the file is inside it), then says which check failed. Strings that come from
//! the checkpoint (tensor names, dtypes, keys) are printed with `{:?}`, so a hostile name cannot
//! break the line or fake a second message.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Why a file name taken from the index (or a shard name) is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NameProblem {
    /// The name is empty.
    Empty,
    /// The name starts with `/`: an absolute path.
    Absolute,
    /// A path component is `..`.
    ParentDir,
    /// A path component is `.` or empty (`a//b`, a trailing `/`).
    NotNormal,
    /// The name contains `\`, a Windows separator that a Unix reader would treat as a letter.
    Backslash,
    /// The name contains a NUL byte.
    Nul,
    /// The name contains another control character.
    ControlChar,
    /// A shard name does not end in `.safetensors`.
    NotSafetensors,
}

impl fmt::Display for NameProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NameProblem::Empty => "it is empty",
            NameProblem::Absolute => "it is an absolute path",
            NameProblem::ParentDir => "it has a `..` component",
            NameProblem::NotNormal => "it has a `.` or empty component",
            NameProblem::Backslash => "it contains a backslash",
            NameProblem::Nul => "it contains a NUL byte",
            NameProblem::ControlChar => "it contains a control character",
            NameProblem::NotSafetensors => "it does not end in .safetensors",
        })
    }
}

/// Everything [`open`](crate::open) and the readers of [`Checkpoint`](crate::Checkpoint) refuse.
///
/// `file` is the file the check is about, relative to the source directory (the directory itself
/// for the first few variants). [`CheckpointError::file`] returns it for every variant.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CheckpointError {
    // ---- The directory and its files -------------------------------------------------------
    /// The source directory cannot be resolved (missing, unreadable) or is not a directory.
    #[error("{}: cannot open the source directory: {source}", .file.display())]
    SourceDir { file: PathBuf, source: io::Error },
    /// An operating-system call on a file failed (open, read, metadata).
    #[error("{}: {op} failed: {source}", .file.display())]
    Io {
        file: PathBuf,
        op: &'static str,
        source: io::Error,
    },
    /// Neither `model.safetensors` nor `model.safetensors.index.json` exists.
    #[error("{}: neither model.safetensors nor model.safetensors.index.json exists", .file.display())]
    NoWeights { file: PathBuf },
    /// Both `model.safetensors` and `model.safetensors.index.json` exist; refusing to guess.
    #[error("{}: both model.safetensors and model.safetensors.index.json exist; refusing to guess which one is the checkpoint", .file.display())]
    AmbiguousWeights { file: PathBuf },
    /// A file name in the index is not a plain relative path inside the source directory.
    #[error("{}: shard name {name:?} is refused: {problem}", .file.display())]
    UnsafeName {
        file: PathBuf,
        name: String,
        problem: NameProblem,
    },
    /// A file's symbolic links form a loop.
    #[error("{}: its symbolic links form a loop", .file.display())]
    SymlinkLoop { file: PathBuf },
    /// The source directory is a Hugging Face cache repository (`models--org--name/`, with
    /// `snapshots/<rev>/`, `refs/main`, `blobs/`), not one of its snapshots.
    #[error("{}: is a Hugging Face cache repository, not a checkpoint; {}", .file.display(), hub_hint(.file, .main, .snapshots))]
    HubRepository {
        file: PathBuf,
        /// The snapshot `refs/main` points to, when it exists.
        main: Option<String>,
        /// Every snapshot, sorted.
        snapshots: Vec<String>,
    },
    /// A file resolves (through symbolic links) outside the source directory, and not into the
    /// `blobs/` folder of the Hugging Face cache repository the directory is a snapshot of.
    #[error("{}: resolves to {} outside the source directory", .file.display(), .target.display())]
    SymlinkEscape { file: PathBuf, target: PathBuf },
    /// A file resolves into the Hub cache's `blobs/` folder, but the blob's name is neither a
    /// SHA-256 (64 lowercase hex digits) nor a git blob SHA-1 (40 lowercase hex digits).
    #[error("{}: resolves to Hub blob {blob:?}, which is not named by a SHA-256 or git SHA-1", .file.display())]
    HubBlobBadName { file: PathBuf, blob: String },
    /// A Hub cache blob's content does not hash to the blob's name (corrupt or altered download).
    #[error("{}: Hub blob {blob} does not match its content ({algorithm} is {actual})", .file.display())]
    HubBlobMismatch {
        file: PathBuf,
        blob: String,
        algorithm: &'static str,
        actual: String,
    },
    /// A file that must be a regular file is a directory, FIFO, device or socket.
    #[error("{}: not a regular file", .file.display())]
    NotAFile { file: PathBuf },
    /// A JSON side file (config, index) is larger than [`MAX_JSON_LEN`](crate::MAX_JSON_LEN).
    #[error("{}: {size} bytes is over the {limit}-byte cap for a JSON file", .file.display())]
    JsonTooLarge {
        file: PathBuf,
        size: u64,
        limit: u64,
    },
    /// A JSON object (in the config, the index, or inside a safetensors header) repeats a key.
    #[error("{}: duplicate JSON key at {key_path}", .file.display())]
    DuplicateJsonKey { file: PathBuf, key_path: String },

    // ---- config.json ------------------------------------------------------------------------
    /// `config.json` is absent.
    #[error("{}: missing; a checkpoint needs its config.json", .file.display())]
    ConfigMissing { file: PathBuf },
    /// `config.json` is not UTF-8 JSON, or not a JSON object.
    #[error("{}: not a valid JSON object: {message}", .file.display())]
    ConfigInvalidJson { file: PathBuf, message: String },
    /// A required field is absent (or null).
    #[error("{}: required field {field:?} is missing", .file.display())]
    ConfigMissingField { file: PathBuf, field: &'static str },
    /// Neither `num_experts` nor `num_local_experts` is present: not a Mixture-of-Experts config.
    #[error("{}: neither num_experts nor num_local_experts is present (not a Mixture-of-Experts config)", .file.display())]
    ConfigMissingExpertCount { file: PathBuf },
    /// A field has the wrong JSON type.
    #[error("{}: field {field:?} must be {expected}", .file.display())]
    ConfigWrongType {
        file: PathBuf,
        field: &'static str,
        expected: &'static str,
    },
    /// `num_experts` and `num_local_experts` are both present and disagree.
    #[error("{}: num_experts = {num_experts} and num_local_experts = {num_local_experts} disagree", .file.display())]
    ConfigConflictingExpertCount {
        file: PathBuf,
        num_experts: u64,
        num_local_experts: u64,
    },
    /// A field has a value that no valid model has (zero layers, top-k above the expert count...).
    #[error("{}: field {field:?} = {value} is out of range: {reason}", .file.display())]
    ConfigValueOutOfRange {
        file: PathBuf,
        field: &'static str,
        value: String,
        reason: &'static str,
    },
    /// `model_type` names an architecture Tarfa does not run.
    #[error("{}: model_type {model_type:?} is not supported (Tarfa reads qwen3_moe, qwen2_moe, mixtral, olmoe, glm4_moe, deepseek_v3, deepseek_v2, gpt_oss, llama4_text, qwen3_next and qwen3_5_moe_text, and the multimodal llama4 and qwen3_5_moe releases' text models)", .file.display())]
    UnsupportedModelType { file: PathBuf, model_type: String },
    /// A multimodal wrapper config (`model_type: "llama4"`, `"qwen3_5_moe"`) carries a
    /// top-level key that is not known to leave its text model unchanged.
    #[error("{}: key {key:?} of the multimodal {wrapper} config is refused: only text_config, vision_config, the image and video token ids and bookkeeping keys are known to leave the text model unchanged", .file.display())]
    WrapperKeyRefused {
        file: PathBuf,
        wrapper: &'static str,
        key: String,
    },
    /// A tensor of a multimodal checkpoint is neither the text model's nor a part left out
    /// (the vision tower's), as the wrapper's [`WrapperLayout`](crate::WrapperLayout) places
    /// them.
    #[error("{}: tensor {tensor:?} of the multimodal {wrapper} checkpoint is neither the text model's nor the vision tower's (expected names under {expected})", .file.display())]
    WrapperTensorUnexpected {
        file: PathBuf,
        wrapper: &'static str,
        tensor: String,
        /// The layout's prefixes, for the message.
        expected: String,
    },
    /// The config declares a `quantization_config` (or `compression_config`): a quantized release.
    #[error("{}: declares a {key} ({method:?}); {}Tarfa only accepts BF16 checkpoints and never re-quantises", .file.display(), fp8_note(method))]
    QuantizedConfig {
        file: PathBuf,
        key: &'static str,
        method: String,
    },

    // ---- model.safetensors.index.json --------------------------------------------------------
    /// The index is not UTF-8 JSON of the form `{"metadata": {...}, "weight_map": {name: file}}`.
    #[error("{}: not a valid safetensors index: {message}", .file.display())]
    IndexInvalidJson { file: PathBuf, message: String },
    /// The index's `weight_map` lists one tensor name twice.
    #[error("{}: weight_map lists tensor {tensor:?} twice", .file.display())]
    IndexDuplicateTensor { file: PathBuf, tensor: String },
    /// The index names a shard file that does not exist.
    #[error("{}: weight_map names shard {shard:?}, which does not exist", .file.display())]
    IndexMissingShard { file: PathBuf, shard: String },
    /// The index lists a tensor that no shard contains.
    #[error("{}: weight_map puts tensor {tensor:?} in {shard:?}, but no shard contains it", .file.display())]
    IndexTensorAbsent {
        file: PathBuf,
        tensor: String,
        shard: String,
    },
    /// Two shards contain a tensor of the same name.
    #[error("{}: tensor {tensor:?} is also in {}", .file.display(), .other.display())]
    TensorInTwoShards {
        file: PathBuf,
        tensor: String,
        other: PathBuf,
    },
    /// A shard contains a tensor that the index assigns to another shard.
    #[error("{}: contains tensor {tensor:?}, which the index assigns to {listed:?}", .file.display())]
    TensorInWrongShard {
        file: PathBuf,
        tensor: String,
        listed: String,
    },
    /// A shard contains a tensor that the index does not list.
    #[error("{}: contains tensor {tensor:?}, which the index does not list", .file.display())]
    UnlistedTensor { file: PathBuf, tensor: String },

    // ---- safetensors files --------------------------------------------------------------------
    /// The file is shorter than the 8-byte header length.
    #[error("{}: {len} bytes is too short for a safetensors file (8-byte header length)", .file.display())]
    FileTooSmall { file: PathBuf, len: u64 },
    /// The header length is over [`MAX_HEADER_LEN`](crate::MAX_HEADER_LEN).
    #[error("{}: header length {header_len} is over the {}-byte cap", .file.display(), crate::MAX_HEADER_LEN)]
    HeaderTooLarge { file: PathBuf, header_len: u64 },
    /// The header runs past the end of the file (truncated file or garbage length).
    #[error("{}: header length {header_len} runs past the end of the {file_len}-byte file", .file.display())]
    HeaderPastEnd {
        file: PathBuf,
        header_len: u64,
        file_len: u64,
    },
    /// The header is not UTF-8.
    #[error("{}: header is not UTF-8 (invalid byte at {valid_up_to})", .file.display())]
    HeaderNotUtf8 { file: PathBuf, valid_up_to: usize },
    /// The header is not JSON, or not a JSON object.
    #[error("{}: header is not a JSON object: {message}", .file.display())]
    HeaderInvalidJson { file: PathBuf, message: String },
    /// The header names a tensor twice.
    #[error("{}: header names tensor {tensor:?} twice", .file.display())]
    DuplicateTensor { file: PathBuf, tensor: String },
    /// `__metadata__` is not an object of strings.
    #[error("{}: __metadata__ must map strings to strings: {message}", .file.display())]
    InvalidMetadata { file: PathBuf, message: String },
    /// A tensor name contains a control character or a bidirectional override, isolate or mark
    /// (U+202A-202E, U+2066-2069, U+200E, U+200F, U+061C): it could display as another name.
    #[error("{}: tensor {tensor:?} is refused: its name contains {what} (U+{code:04X})", .file.display())]
    TensorNameChar {
        file: PathBuf,
        tensor: String,
        code: u32,
        what: &'static str,
    },
    /// A tensor entry is not `{"dtype": str, "shape": [uint...], "data_offsets": [uint, uint]}`.
    #[error("{}: tensor {tensor:?} has an invalid entry: {message}", .file.display())]
    InvalidTensorEntry {
        file: PathBuf,
        tensor: String,
        message: String,
    },
    /// A tensor's dtype is not one safetensors defines.
    #[error("{}: tensor {tensor:?} has unknown dtype {dtype:?}", .file.display())]
    UnknownDtype {
        file: PathBuf,
        tensor: String,
        dtype: String,
    },
    /// A tensor's element count (or bit count) overflows 64 bits.
    #[error("{}: tensor {tensor:?} has shape {shape:?}, whose size overflows", .file.display())]
    ShapeOverflow {
        file: PathBuf,
        tensor: String,
        shape: Vec<u64>,
    },
    /// A sub-byte dtype's tensor does not fill a whole number of bytes.
    #[error("{}: tensor {tensor:?} does not fill a whole number of bytes", .file.display())]
    MisalignedSubByte { file: PathBuf, tensor: String },
    /// A tensor's `data_offsets` end before they begin.
    #[error("{}: tensor {tensor:?} has data_offsets [{begin}, {end}], which end before they begin", .file.display())]
    OffsetsReversed {
        file: PathBuf,
        tensor: String,
        begin: u64,
        end: u64,
    },
    /// A tensor's byte length is not its element count times its dtype size.
    #[error("{}: tensor {tensor:?} spans {actual} bytes but its shape and dtype need {expected}", .file.display())]
    LengthMismatch {
        file: PathBuf,
        tensor: String,
        expected: u64,
        actual: u64,
    },
    /// The data section has unclaimed bytes before a tensor (tensors must be contiguous from 0).
    #[error("{}: gap in the data before tensor {tensor:?} (starts at {begin}, previous data ends at {expected})", .file.display())]
    DataGap {
        file: PathBuf,
        tensor: String,
        expected: u64,
        begin: u64,
    },
    /// Two tensors' byte ranges overlap.
    #[error("{}: tensor {tensor:?} starts at {begin}, inside the previous tensor's bytes (which end at {expected})", .file.display())]
    DataOverlap {
        file: PathBuf,
        tensor: String,
        expected: u64,
        begin: u64,
    },
    /// A tensor's bytes run past the end of the file (truncated file).
    #[error("{}: tensor {tensor:?} ends at data byte {end}, past the {data_len}-byte data section (truncated?)", .file.display())]
    DataOutOfBounds {
        file: PathBuf,
        tensor: String,
        end: u64,
        data_len: u64,
    },
    /// Bytes follow the last tensor.
    #[error("{}: {extra} trailing bytes after the last tensor", .file.display())]
    TrailingBytes { file: PathBuf, extra: u64 },

    // ---- dtype policy ---------------------------------------------------------------------------
    /// A tensor's name marks it as part of a quantization scheme (`.qweight`, `.scales`,
    /// `.weight_scale_inv`, ...).
    #[error("{}: tensor {tensor:?} is a quantization companion; {}Tarfa only accepts BF16 checkpoints and never re-quantises", .file.display(), if tensor.ends_with(".weight_scale_inv") { fp8_note("fp8") } else { "" })]
    QuantizationCompanion { file: PathBuf, tensor: String },
    /// A tensor has a quantized dtype (F8_*, F6_*, F4, I8, U8).
    #[error("{}: tensor {tensor:?} is {dtype:?}, a quantized type; Tarfa only accepts BF16 checkpoints and never re-quantises", .file.display())]
    QuantizedTensor {
        file: PathBuf,
        tensor: String,
        dtype: crate::Dtype,
    },
    /// A tensor has a dtype that is neither float nor quantized (BOOL, integers, complex).
    #[error("{}: tensor {tensor:?} is {dtype:?}; weights must be BF16, F16, F32 or F64", .file.display())]
    UnsupportedDtype {
        file: PathBuf,
        tensor: String,
        dtype: crate::Dtype,
    },
    /// An expert matrix is a float type other than BF16.
    #[error("{}: expert weights are {dtype:?} (tensor {tensor:?}); Tarfa only accepts BF16 experts and never converts them", .file.display())]
    ExpertNotBf16 {
        file: PathBuf,
        tensor: String,
        dtype: crate::Dtype,
    },

    // ---- experts -----------------------------------------------------------------------------------
    /// No tensor is an expert matrix of the config's naming scheme.
    #[error("{}: no expert tensors (expected names like {example:?})", .file.display())]
    NoExpertTensors { file: PathBuf, example: String },
    /// A tensor sits under an `experts` module but is not one of the three expert matrices
    /// (an extra matrix, a bias, a fused `gate_up_proj`, non-canonical ids like `07`, or the
    /// other family's naming).
    #[error("{}: tensor {tensor:?} is not an expert matrix of the form {expected:?}", .file.display())]
    UnexpectedExpertTensor {
        file: PathBuf,
        tensor: String,
        expected: String,
    },
    /// An expert tensor's layer index is not below `num_hidden_layers`.
    #[error("{}: tensor {tensor:?} is in layer {layer}, but the config has {num_layers} layers", .file.display())]
    ExpertLayerOutOfRange {
        file: PathBuf,
        tensor: String,
        layer: u32,
        num_layers: u32,
    },
    /// An expert tensor's expert index is not below the config's expert count.
    #[error("{}: tensor {tensor:?} is expert {expert}, but the config has {num_experts} experts", .file.display())]
    ExpertIdOutOfRange {
        file: PathBuf,
        tensor: String,
        expert: u32,
        num_experts: u32,
    },
    /// An expert tensor is in a layer the config makes dense (`mlp_only_layers`,
    /// `decoder_sparse_step`).
    #[error("{}: tensor {tensor:?} is an expert in layer {layer}, which the config makes a dense layer", .file.display())]
    ExpertsInDenseLayer {
        file: PathBuf,
        tensor: String,
        layer: u32,
    },
    /// A Mixture-of-Experts layer lacks one of its experts entirely.
    #[error("{}: layer {layer} has no tensors for expert {expert}", .file.display())]
    MissingExpert {
        file: PathBuf,
        layer: u32,
        expert: u32,
    },
    /// An expert lacks one of its gate, up and down matrices.
    #[error("{}: expert {expert} of layer {layer} has no {tensor:?}", .file.display())]
    ExpertMissingMatrix {
        file: PathBuf,
        layer: u32,
        expert: u32,
        tensor: String,
    },
    /// An expert matrix's shape is not 2-D, disagrees with its sibling matrices (gate and up are
    /// `[intermediate, hidden]`, down is `[hidden, intermediate]`), or with `hidden_size`.
    #[error("{}: tensor {tensor:?} has shape {shape:?}, expected {expected:?}", .file.display())]
    ExpertMatrixShape {
        file: PathBuf,
        tensor: String,
        shape: Vec<u64>,
        expected: Vec<u64>,
    },
    /// An expert's matrices have other shapes than the layer's first expert's.
    #[error("{}: tensor {tensor:?} has shape {shape:?}, but {reference:?} of the same layer has {expected:?}", .file.display())]
    ExpertShapeMismatch {
        file: PathBuf,
        tensor: String,
        shape: Vec<u64>,
        expected: Vec<u64>,
        reference: String,
    },

    /// A Mixture-of-Experts layer of a fused-expert family (gpt-oss) lacks one of its fused
    /// expert tensors.
    #[error("{}: layer {layer} has no fused expert tensor {tensor:?}", .file.display())]
    FusedTensorMissing {
        file: PathBuf,
        layer: u32,
        tensor: String,
    },
    /// A fused expert tensor is not in the form's dtype (BF16; U8 for the MXFP4 blocks and
    /// scales under `quantization_config.quant_method = "mxfp4"`).
    #[error("{}: fused expert tensor {tensor:?} is {dtype:?}, expected {expected:?} (BF16 fused experts, or U8 MXFP4 blocks and scales under quant_method \"mxfp4\")", .file.display())]
    FusedTensorDtype {
        file: PathBuf,
        tensor: String,
        dtype: crate::Dtype,
        expected: crate::Dtype,
    },

    // ---- reading after open ---------------------------------------------------------------------
    /// No tensor of that name is in the checkpoint.
    #[error("{}: no tensor named {tensor:?}", .file.display())]
    UnknownTensor { file: PathBuf, tensor: String },
    /// No shard has that index.
    #[error("{}: no shard #{shard}", .file.display())]
    UnknownShard { file: PathBuf, shard: usize },
    /// A shard's size changed after it was opened and validated.
    #[error("{}: was {expected} bytes when opened, is {actual} now", .file.display())]
    ShardChanged {
        file: PathBuf,
        expected: u64,
        actual: u64,
    },
}

/// Which snapshot of a Hub cache repository to pass instead of the repository.
fn hub_hint(repo: &Path, main: &Option<String>, snapshots: &[String]) -> String {
    let others: Vec<&String> = snapshots
        .iter()
        .filter(|s| Some(*s) != main.as_ref())
        .collect();
    let mut hint = match main {
        Some(m) => format!(
            "use {}/snapshots/{} (the snapshot refs/main points to)",
            repo.display(),
            m.escape_debug()
        ),
        None if snapshots.is_empty() => "it holds no snapshot".to_owned(),
        None => format!(
            "use one of {}/snapshots/ (refs/main names none)",
            repo.display()
        ),
    };
    if !others.is_empty() {
        let label = if main.is_some() {
            "other snapshots"
        } else {
            "snapshots"
        };
        hint.push_str(&format!("; {label}: {others:?}"));
    }
    hint
}

impl CheckpointError {
    /// The file (or directory) the failed check is about, relative to the source directory when
    /// it is inside it.
    pub fn file(&self) -> &Path {
        use CheckpointError::*;
        match self {
            SourceDir { file, .. }
            | Io { file, .. }
            | NoWeights { file }
            | AmbiguousWeights { file }
            | UnsafeName { file, .. }
            | SymlinkLoop { file }
            | HubRepository { file, .. }
            | SymlinkEscape { file, .. }
            | HubBlobBadName { file, .. }
            | HubBlobMismatch { file, .. }
            | NotAFile { file }
            | JsonTooLarge { file, .. }
            | DuplicateJsonKey { file, .. }
            | ConfigMissing { file }
            | ConfigInvalidJson { file, .. }
            | ConfigMissingField { file, .. }
            | ConfigMissingExpertCount { file }
            | ConfigWrongType { file, .. }
            | ConfigConflictingExpertCount { file, .. }
            | ConfigValueOutOfRange { file, .. }
            | UnsupportedModelType { file, .. }
            | QuantizedConfig { file, .. }
            | WrapperKeyRefused { file, .. }
            | WrapperTensorUnexpected { file, .. }
            | IndexInvalidJson { file, .. }
            | IndexDuplicateTensor { file, .. }
            | IndexMissingShard { file, .. }
            | IndexTensorAbsent { file, .. }
            | TensorInTwoShards { file, .. }
            | TensorInWrongShard { file, .. }
            | UnlistedTensor { file, .. }
            | FileTooSmall { file, .. }
            | HeaderTooLarge { file, .. }
            | HeaderPastEnd { file, .. }
            | HeaderNotUtf8 { file, .. }
            | HeaderInvalidJson { file, .. }
            | DuplicateTensor { file, .. }
            | InvalidMetadata { file, .. }
            | TensorNameChar { file, .. }
            | InvalidTensorEntry { file, .. }
            | UnknownDtype { file, .. }
            | ShapeOverflow { file, .. }
            | MisalignedSubByte { file, .. }
            | OffsetsReversed { file, .. }
            | LengthMismatch { file, .. }
            | DataGap { file, .. }
            | DataOverlap { file, .. }
            | DataOutOfBounds { file, .. }
            | TrailingBytes { file, .. }
            | QuantizationCompanion { file, .. }
            | QuantizedTensor { file, .. }
            | UnsupportedDtype { file, .. }
            | ExpertNotBf16 { file, .. }
            | NoExpertTensors { file, .. }
            | UnexpectedExpertTensor { file, .. }
            | ExpertLayerOutOfRange { file, .. }
            | ExpertIdOutOfRange { file, .. }
            | ExpertsInDenseLayer { file, .. }
            | MissingExpert { file, .. }
            | ExpertMissingMatrix { file, .. }
            | ExpertMatrixShape { file, .. }
            | ExpertShapeMismatch { file, .. }
            | FusedTensorMissing { file, .. }
            | FusedTensorDtype { file, .. }
            | UnknownTensor { file, .. }
            | UnknownShard { file, .. }
            | ShardChanged { file, .. } => file,
        }
    }
}

/// What an FP8 release (DeepSeek-V3/R1's own weights: block-scaled FP8 with `weight_scale_inv`)
/// needs said: its released form is FP8, so a BF16 conversion of it is another model's weights
/// as far as exactness goes.
fn fp8_note(method: &str) -> &'static str {
    if method.eq_ignore_ascii_case("mxfp4") {
        "MXFP4 is accepted for gpt-oss's expert tensors only (gpt_oss's released form, widened \
         exactly); "
    } else if method.eq_ignore_ascii_case("fp8") {
        "this model's released form is FP8 (block-scaled, with weight_scale_inv tensors); a BF16 \
         conversion of it is not the released weights, and exact FP8 is not implemented. "
    } else {
        ""
    }
}
