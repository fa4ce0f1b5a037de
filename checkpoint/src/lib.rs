//! Reads a Hugging Face Mixture-of-Experts checkpoint directory (Qwen3-MoE, Qwen2-MoE, Mixtral,
//! OLMoE, GLM-4.5, DeepSeek, Qwen3-Next in BF16; gpt-oss's fused experts in BF16 or as released
//! in MXFP4; Llama 4's fused experts; Qwen3.5 MoE's per expert or fused by rows; the text
//! models of Llama 4's and Qwen3.5 MoE's multimodal releases) and refuses anything hostile or
//! unsupported with a typed error that names the file and the failed check.
//!
//! ```no_run
//! let ckpt = tarfa_checkpoint::open(std::path::Path::new("models/qwen3moe"))?;
//! for ((layer, expert), src) in &ckpt.experts {
//!     let gate: Vec<u8> = ckpt.read_tensor_bytes(src.tensor(tarfa_checkpoint::ExpertMatrix::Gate))?;
//!     # let _ = (layer, expert, gate);
//! }
//! # Ok::<(), tarfa_checkpoint::CheckpointError>(())
//! ```
//!
//! # What [`open`] checks
//!
//! - **Paths**: every file resolves inside the canonical source directory, except that a Hub
//!   cache snapshot (`models--o--n/snapshots/<rev>/`) may link into its repository's `blobs/`,
//!   whose blob names are then checked against the content (SHA-256 for 64 hex digits, git blob
//!   SHA-1 for 40; see [`OpenOptions`]). Index file names are plain relative paths. Only regular
//!   files are opened (non-blocking, so a FIFO never hangs the reader); a symlink loop is
//!   [`CheckpointError::SymlinkLoop`]. A Hub repository folder (`models--o--n/`) given instead
//!   of a snapshot is [`CheckpointError::HubRepository`], naming the snapshot `refs/main` points
//!   to.
//! - **config.json**: present, JSON without duplicate keys, a supported `model_type`, the layer,
//!   expert, top-k and hidden sizes in range, no `quantization_config` but gpt-oss's
//!   `quant_method = "mxfp4"`.
//! - **Weights**: exactly one of `model.safetensors` and `model.safetensors.index.json`; the
//!   index's `weight_map` and the shards' headers agree tensor for tensor.
//! - **Every safetensors header** ([`SafetensorsHeader`]): the `safetensors` crate's rules (size
//!   cap, UTF-8 JSON, known dtypes, checked shape arithmetic, length = shape x dtype size, data
//!   tiled exactly with no gap, overlap or trailing byte) plus duplicate tensor names and names
//!   with control or bidirectional-override characters.
//! - **Dtypes**: no quantized dtype or quantization companion tensor anywhere, but gpt-oss's
//!   MXFP4 blocks and scales (U8) of its MoE layers' fused experts under `quant_method =
//!   "mxfp4"`; non-expert tensors BF16, F16, F32 or F64; expert matrices BF16. Bytes are never
//!   re-quantised.
//! - **Fused experts** ([`FusedExpertTable`]: gpt-oss, Llama 4, Qwen3.5 MoE as released):
//!   every MoE layer has its fused tensors, E outermost, shapes consistent with `hidden_size`
//!   and each other; under the experts module nothing but them and the per-expert biases
//!   ([`Checkpoint::fused`]). A family that may store either form ([`ExpertStorage`]) is read
//!   in the form its tensors have; a checkpoint mixing the two is refused.
//! - **Multimodal releases** ([`WrapperLayout`]): the wrapper's top-level keys known to leave
//!   the text model unchanged, every tensor the text model's (read under the text model's
//!   names) or the vision tower's (validated, left out: [`Checkpoint::left_out`]).
//! - **Multi-token prediction**: layers past the last under `num_nextn_predict_layers`, or
//!   `mtp.*` (Qwen3-Next, Qwen3.5 MoE), validated and skipped ([`Checkpoint::mtp`]).
//! - **Experts**: every layer the config makes sparse has every expert, each with exactly its
//!   gate, up and down matrices, of shapes consistent with each other, `hidden_size`, and the
//!   layer's other experts; nothing else sits under an `experts` module.
//!
//! Each failed check is one [`CheckpointError`] variant with a one-line message.
//!
//! # What this crate must never do
//!
//! Convert, reorder or re-encode a value: it reads bytes and says where they are. Conversion is
//! `tarfa-convert`'s job. It never reads outside the files it validated, and never panics on
//! input bytes.
//!
//! Shards stay open from [`open`] on: later reads go to the very files that were validated, even
//! if a name is replaced on disk meanwhile; a size change is reported as
//! [`CheckpointError::ShardChanged`].

mod config;
mod error;
mod experts;
mod fused;
mod hash;
mod header;
mod json;
mod paths;

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::Deserialize;

pub use config::{
    ExpertStorage, ModelConfigSummary, ModelFamily, MultimodalWrapper, WrappedTensor,
    WrapperLayout, LLAMA4_WRAPPER, QWEN3_5_MOE_WRAPPER,
};
pub use error::{CheckpointError, NameProblem};
pub use experts::{ExpertDims, ExpertMatrix, ExpertNaming, ExpertSource};
pub use fused::{
    FusedExpertTable, FusedForm, FusedLayer, GateUpColumns, GateUpStacking, GPT_OSS_FUSED,
    LLAMA4_FUSED, QWEN3_5_MOE_FUSED,
};
pub use hash::{sha256_file, sha256_files_parallel, to_hex};
pub use header::{HeaderTensor, SafetensorsHeader};
pub use paths::HubBlob;
/// The safetensors element types, re-exported so users need no direct dependency.
pub use safetensors::Dtype;

/// Largest safetensors header accepted, in bytes (the `safetensors` crate's own cap).
pub const MAX_HEADER_LEN: u64 = 100_000_000;
/// Largest `config.json` or index accepted, in bytes.
pub const MAX_JSON_LEN: u64 = 100_000_000;
/// The model configuration file.
pub const CONFIG_FILE: &str = "config.json";
/// The weights of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Files recorded in [`Checkpoint::extra_files`] when present: what a bundle carries besides
/// the weights. (`tokenizer.model` is Mixtral's SentencePiece model.)
pub const EXTRA_FILES: [&str; 9] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "chat_template.jinja",
];

/// How [`open_with`] works.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenOptions {
    /// Hash every file that resolves into the Hub cache's `blobs/` and compare it with the blob's
    /// name (default `true`). Costs one read of each such shard (in parallel); the SHA-256s are
    /// kept in [`Shard::sha256`], so [`Checkpoint::shard_sha256s`] does not read them again.
    /// Blob *names* are checked either way.
    pub verify_hub_blobs: bool,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            verify_hub_blobs: true,
        }
    }
}

/// A file of the checkpoint other than a shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceFile {
    /// Name relative to the source directory, e.g. `tokenizer.json`.
    pub name: String,
    /// The canonical path it resolves to (possibly a Hub blob).
    pub path: PathBuf,
    pub size: u64,
    /// The Hub cache blob it resolves to, if any (its hash was verified unless
    /// [`OpenOptions::verify_hub_blobs`] was off).
    pub hub_blob: Option<HubBlob>,
}

/// One safetensors file of the checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// Name relative to the source directory, as the index spells it.
    pub name: String,
    /// The canonical path it resolves to (possibly a Hub blob).
    pub path: PathBuf,
    /// File size in bytes at open time.
    pub size: u64,
    pub hub_blob: Option<HubBlob>,
    /// The safetensors JSON header's length; data starts at `8 + header_len`.
    pub header_len: u64,
    /// The header's `__metadata__`, if any.
    pub metadata: Option<BTreeMap<String, String>>,
    /// The file's SHA-256, when [`open`] computed it (verified Hub blobs).
    pub sha256: Option<[u8; 32]>,
}

impl Shard {
    /// The expected SHA-256 (hex) when the shard is an LFS blob of the Hub cache.
    pub fn hub_blob_sha256(&self) -> Option<&str> {
        self.hub_blob.as_ref().and_then(HubBlob::sha256)
    }
}

/// Where one tensor's bytes are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceTensor {
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Index into [`Checkpoint::shards`].
    pub shard: usize,
    /// Absolute byte offset in the shard file.
    pub offset: u64,
    /// Byte length (= element count x dtype size).
    pub len: u64,
}

/// A validated checkpoint. Build it with [`open`]; the fields are public for reading, and a
/// reader method given fields it does not expect returns an error, never panics.
#[derive(Debug)]
pub struct Checkpoint {
    /// The canonical source directory.
    pub root: PathBuf,
    pub config: ModelConfigSummary,
    pub naming: ExpertNaming,
    /// `model.safetensors.index.json`, when the checkpoint is sharded.
    pub index: Option<SourceFile>,
    /// The index's `metadata` object (`null` when absent or unsharded).
    pub index_metadata: serde_json::Value,
    /// Sorted by name.
    pub shards: Vec<Shard>,
    /// Every tensor of every shard.
    pub tensors: BTreeMap<String, SourceTensor>,
    /// Every expert of every Mixture-of-Experts layer, keyed by (layer, expert) (empty for a
    /// family with fused experts: see [`Checkpoint::fused`]).
    pub experts: BTreeMap<(u32, u32), ExpertSource>,
    /// The fused expert tensors of every Mixture-of-Experts layer of a family that stores its
    /// experts fused (gpt-oss), keyed by layer; empty otherwise.
    pub fused: BTreeMap<u32, FusedLayer>,
    /// The expert shapes of each Mixture-of-Experts layer.
    pub expert_dims: BTreeMap<u32, ExpertDims>,
    /// Every other tensor, sorted: embeddings, norms, attention, routers, Qwen2-MoE's
    /// `mlp.shared_expert.*` and `mlp.shared_expert_gate`, dense layers' MLPs.
    pub non_expert: Vec<String>,
    /// Every tensor validated and never carried, sorted: [`mtp`](Self::mtp) and
    /// [`left_out`](Self::left_out) together.
    pub skipped: Vec<String>,
    /// Multi-token-prediction tensors, sorted: layers `num_hidden_layers..` under
    /// `num_nextn_predict_layers` (GLM-4.5, DeepSeek), or everything under
    /// [`ModelFamily::mtp_prefix`] (`mtp.*`: Qwen3-Next, Qwen3.5 MoE). Validated like every
    /// tensor, never carried: next-token logits never read them.
    pub mtp: Vec<String>,
    /// A multimodal release's vision tower (Llama 4's `vision_model.*` and
    /// `multi_modal_projector.*`, Qwen3.5 MoE's `model.visual.*`; sorted, under their names in
    /// the source): validated, never carried (the text model never reads it). Its text
    /// model's tensors are in `tensors` under the text model's names (`model.*`, `lm_head.*`).
    pub left_out: Vec<String>,
    /// Those of [`EXTRA_FILES`] that are present, in that order (always starts with config.json).
    pub extra_files: Vec<SourceFile>,
    /// One open handle per shard, same order: reads go to the files that were validated.
    handles: Vec<File>,
}

/// Opens and validates the checkpoint in `src_dir` with the default [`OpenOptions`].
pub fn open(src_dir: &Path) -> Result<Checkpoint, CheckpointError> {
    open_with(src_dir, &OpenOptions::default())
}

/// Opens and validates the checkpoint in `src_dir`.
pub fn open_with(src_dir: &Path, options: &OpenOptions) -> Result<Checkpoint, CheckpointError> {
    let root = paths::SourceRoot::new(src_dir)?;
    let verify = options.verify_hub_blobs;

    let (config_file, config_bytes) =
        read_json_file(&root, CONFIG_FILE, verify)?.ok_or_else(|| {
            // A Hub repository folder passed instead of one of its snapshots: say which to use.
            match paths::hub_repository(&root.root) {
                Some(repo) => CheckpointError::HubRepository {
                    file: src_dir.into(),
                    main: repo.main,
                    snapshots: repo.snapshots,
                },
                None => CheckpointError::ConfigMissing {
                    file: CONFIG_FILE.into(),
                },
            }
        })?;
    let config_text =
        std::str::from_utf8(&config_bytes).map_err(|e| CheckpointError::ConfigInvalidJson {
            file: CONFIG_FILE.into(),
            message: e.to_string(),
        })?;
    let config = ModelConfigSummary::parse(Path::new(CONFIG_FILE), config_text)?;
    let naming = config.family.naming();

    let single = root.resolve(SINGLE_FILE)?;
    let has_index = root.resolve(INDEX_FILE)?.is_some();
    let (index, index_metadata, weight_map, shard_names) = match (single, has_index) {
        (Some(_), true) => {
            return Err(CheckpointError::AmbiguousWeights {
                file: src_dir.into(),
            })
        }
        (None, false) => {
            return Err(CheckpointError::NoWeights {
                file: src_dir.into(),
            })
        }
        (Some(_), false) => (
            None,
            serde_json::Value::Null,
            None,
            vec![SINGLE_FILE.to_owned()],
        ),
        (None, true) => {
            let (file, bytes) = read_json_file(&root, INDEX_FILE, verify)?.ok_or_else(|| {
                CheckpointError::NoWeights {
                    file: src_dir.into(),
                }
            })?;
            let index = parse_index(&bytes)?;
            let names: BTreeSet<&String> = index.weight_map.values().collect();
            let names: Vec<String> = names.into_iter().cloned().collect();
            for name in &names {
                paths::check_name(name, true).map_err(|problem| CheckpointError::UnsafeName {
                    file: INDEX_FILE.into(),
                    name: name.clone(),
                    problem,
                })?;
            }
            (Some(file), index.metadata, Some(index.weight_map), names)
        }
    };

    // Open every shard once; everything later reads through these handles.
    let mut opened = Vec::with_capacity(shard_names.len());
    for name in &shard_names {
        let Some(resolved) = root.resolve(name)? else {
            return Err(match weight_map {
                Some(_) => CheckpointError::IndexMissingShard {
                    file: INDEX_FILE.into(),
                    shard: name.clone(),
                },
                // model.safetensors vanished since it was looked up a moment ago.
                None => CheckpointError::NoWeights {
                    file: src_dir.into(),
                },
            });
        };
        let (handle, size) = open_regular(name, &resolved.path)?;
        opened.push((name, resolved, handle, size));
    }
    let sha256s: Vec<Option<[u8; 32]>> = opened
        .par_iter()
        .map(
            |(name, resolved, handle, _)| match (&resolved.hub_blob, verify) {
                (Some(blob), true) => blob.verify_handle(Path::new(name.as_str()), handle),
                _ => Ok(None),
            },
        )
        .collect::<Result<_, _>>()?;

    let mut shards = Vec::with_capacity(opened.len());
    let mut handles = Vec::with_capacity(opened.len());
    let mut tensors: BTreeMap<String, SourceTensor> = BTreeMap::new();
    for (i, ((name, resolved, handle, size), sha256)) in opened.into_iter().zip(sha256s).enumerate()
    {
        let header = SafetensorsHeader::read(Path::new(name.as_str()), &handle, size)?;
        let data_start = header.data_start();
        for t in header.tensors {
            if let Some(prev) = tensors.get(&t.name) {
                return Err(CheckpointError::TensorInTwoShards {
                    file: shard_names[prev.shard].as_str().into(),
                    tensor: t.name,
                    other: name.as_str().into(),
                });
            }
            let entry = SourceTensor {
                dtype: t.dtype,
                shape: t.shape,
                shard: i,
                offset: data_start + t.begin,
                len: t.end - t.begin,
            };
            tensors.insert(t.name, entry);
        }
        shards.push(Shard {
            name: name.clone(),
            path: resolved.path,
            size,
            hub_blob: resolved.hub_blob,
            header_len: header.header_len,
            metadata: header.metadata,
            sha256,
        });
        handles.push(handle);
    }
    let shard_file = |i: usize| PathBuf::from(&shard_names[i]);

    if let Some(weight_map) = &weight_map {
        for (name, t) in &tensors {
            match weight_map.get(name) {
                None => {
                    return Err(CheckpointError::UnlistedTensor {
                        file: shard_file(t.shard),
                        tensor: name.clone(),
                    })
                }
                Some(listed) if *listed != shard_names[t.shard] => {
                    return Err(CheckpointError::TensorInWrongShard {
                        file: shard_file(t.shard),
                        tensor: name.clone(),
                        listed: listed.clone(),
                    })
                }
                Some(_) => {}
            }
        }
        for (name, shard) in weight_map {
            if !tensors.contains_key(name) {
                return Err(CheckpointError::IndexTensorAbsent {
                    file: INDEX_FILE.into(),
                    tensor: name.clone(),
                    shard: shard.clone(),
                });
            }
        }
    }

    let weights_file = Path::new(if index.is_some() {
        INDEX_FILE
    } else {
        SINGLE_FILE
    });
    // A multimodal release: the text model's tensors under the names the text model gives
    // them (classified alone), the vision tower's validated and left out (listed in `skipped`
    // and `left_out`, kept in `tensors` so that tarfa-verify sees every source tensor).
    let mut left_out = Vec::new();
    let mut vision = BTreeMap::new();
    if let Some(wrapper) = &config.multimodal {
        let layout = wrapper.layout;
        let mut text = BTreeMap::new();
        for (name, t) in std::mem::take(&mut tensors) {
            match layout.classify(&name) {
                Some(WrappedTensor::Text(n)) => {
                    text.insert(n, t);
                }
                Some(WrappedTensor::LeftOut) => {
                    left_out.push(name.clone());
                    vision.insert(name, t);
                }
                None => {
                    let prefixes: Vec<&str> = layout
                        .text_prefixes
                        .iter()
                        .map(|(outer, _)| *outer)
                        .chain(layout.left_out.iter().copied())
                        .collect();
                    return Err(CheckpointError::WrapperTensorUnexpected {
                        file: shard_file(t.shard),
                        wrapper: layout.model_type,
                        tensor: name,
                        expected: prefixes.join(", "),
                    });
                }
            }
        }
        tensors = text;
    }
    experts::check_dtypes(&config, &tensors, &shard_file)?;
    experts::check_dtypes(&config, &vision, &shard_file)?;
    let mut table = experts::classify(&config, naming, &tensors, weights_file, &shard_file)?;
    tensors.extend(vision);
    let mtp = table.skipped.clone();
    table.skipped.extend(left_out.iter().cloned());
    table.skipped.sort();

    let mut extra_files = vec![config_file];
    for name in &EXTRA_FILES[1..] {
        let Some(resolved) = root.resolve(name)? else {
            continue;
        };
        let (handle, size) = open_regular(name, &resolved.path)?;
        if let (Some(blob), true) = (&resolved.hub_blob, verify) {
            blob.verify_handle(Path::new(name), &handle)?;
        }
        extra_files.push(SourceFile {
            name: (*name).to_owned(),
            path: resolved.path,
            size,
            hub_blob: resolved.hub_blob,
        });
    }

    Ok(Checkpoint {
        root: root.root,
        config,
        naming,
        index,
        index_metadata,
        shards,
        tensors,
        experts: table.experts,
        fused: table.fused,
        expert_dims: table.dims,
        non_expert: table.non_expert,
        skipped: table.skipped,
        mtp,
        left_out,
        extra_files,
        handles,
    })
}

impl Checkpoint {
    /// The file that stands for the weights as a whole: the index, or `model.safetensors`.
    pub fn weights_file(&self) -> &'static str {
        if self.index.is_some() {
            INDEX_FILE
        } else {
            SINGLE_FILE
        }
    }

    /// A tensor's bytes, read (not mapped) from the shard validated at open time.
    pub fn read_tensor_bytes(&self, name: &str) -> Result<Vec<u8>, CheckpointError> {
        let mut buf = Vec::new();
        self.read_tensor_into(name, &mut buf)?;
        Ok(buf)
    }

    /// Like [`read_tensor_bytes`](Self::read_tensor_bytes), into a reusable buffer (resized to
    /// the tensor's length).
    pub fn read_tensor_into(&self, name: &str, buf: &mut Vec<u8>) -> Result<(), CheckpointError> {
        let (t, shard, handle) = self.locate(name)?;
        self.check_unchanged(shard, handle)?;
        let len = usize::try_from(t.len).map_err(|_| CheckpointError::Io {
            file: shard.name.as_str().into(),
            op: "reading a tensor",
            source: io::Error::new(
                io::ErrorKind::OutOfMemory,
                "tensor larger than the address space",
            ),
        })?;
        buf.clear();
        buf.resize(len, 0);
        read_exact_at(handle, buf, t.offset).map_err(|source| CheckpointError::Io {
            file: shard.name.as_str().into(),
            op: "reading a tensor",
            source,
        })
    }

    /// A tensor's bytes, read (not mapped) into `dst`, which must be exactly the tensor's length:
    /// for callers that assemble several tensors into one buffer (an expert extent).
    pub fn read_tensor_to(&self, name: &str, dst: &mut [u8]) -> Result<(), CheckpointError> {
        let (t, shard, handle) = self.locate(name)?;
        if dst.len() as u64 != t.len {
            return Err(CheckpointError::Io {
                file: shard.name.as_str().into(),
                op: "reading a tensor",
                source: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "destination length differs from the tensor's",
                ),
            });
        }
        self.check_unchanged(shard, handle)?;
        read_exact_at(handle, dst, t.offset).map_err(|source| CheckpointError::Io {
            file: shard.name.as_str().into(),
            op: "reading a tensor",
            source,
        })
    }

    /// `dst.len()` bytes of a tensor from byte `start` of its data (one expert's slice of a
    /// fused expert tensor), read (not mapped) from the shard validated at open time. A range
    /// past the tensor's end is an error, never a read of its neighbour.
    pub fn read_tensor_range_to(
        &self,
        name: &str,
        start: u64,
        dst: &mut [u8],
    ) -> Result<(), CheckpointError> {
        let (t, shard, handle) = self.locate(name)?;
        let inside = start
            .checked_add(dst.len() as u64)
            .is_some_and(|end| end <= t.len);
        if !inside {
            return Err(CheckpointError::Io {
                file: shard.name.as_str().into(),
                op: "reading a tensor",
                source: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "range past the end of the tensor",
                ),
            });
        }
        self.check_unchanged(shard, handle)?;
        read_exact_at(handle, dst, t.offset + start).map_err(|source| CheckpointError::Io {
            file: shard.name.as_str().into(),
            op: "reading a tensor",
            source,
        })
    }

    /// Memory-maps shard `shard` (an index into [`shards`](Self::shards)), read-only.
    ///
    /// A mapping is fast for bulk copies, but it is only as stable as the file: if another
    /// process truncates the file while it is mapped, touching the lost pages kills the process
    /// (SIGBUS). Use [`read_tensor_bytes`](Self::read_tensor_bytes) where that matters; never
    /// compute from a mapping whose bytes were not hashed after mapping.
    pub fn map_shard(&self, shard: usize) -> Result<ShardMap, CheckpointError> {
        let (info, handle) = self
            .shards
            .get(shard)
            .zip(self.handles.get(shard))
            .ok_or_else(|| CheckpointError::UnknownShard {
                file: self.weights_file().into(),
                shard,
            })?;
        self.check_unchanged(info, handle)?;
        // SAFETY: the map is read-only and its length was just checked against the validated
        // size; the remaining hazard (concurrent truncation) is documented above.
        let map = unsafe { memmap2::Mmap::map(handle) }.map_err(|source| CheckpointError::Io {
            file: info.name.as_str().into(),
            op: "memory-mapping",
            source,
        })?;
        if map.len() as u64 != info.size {
            return Err(CheckpointError::ShardChanged {
                file: info.name.as_str().into(),
                expected: info.size,
                actual: map.len() as u64,
            });
        }
        Ok(ShardMap { shard, map })
    }

    /// The SHA-256 of every shard, in [`shards`](Self::shards) order, hashed in parallel (rayon)
    /// from the handles validated at open time. Hashes [`open`] already computed are reused; an
    /// LFS Hub blob whose content does not match its name is an error.
    pub fn shard_sha256s(&self) -> Result<Vec<[u8; 32]>, CheckpointError> {
        (0..self.shards.len())
            .into_par_iter()
            .map(|i| self.shard_sha256(i))
            .collect()
    }

    /// The SHA-256 of shard `shard` (an index into [`shards`](Self::shards)), as
    /// [`shard_sha256s`](Self::shard_sha256s) computes it, for callers that schedule the hashing
    /// of each shard themselves.
    pub fn shard_sha256(&self, shard: usize) -> Result<[u8; 32], CheckpointError> {
        let unknown = || CheckpointError::UnknownShard {
            file: self.weights_file().into(),
            shard,
        };
        let (shard, handle) = self
            .shards
            .get(shard)
            .zip(self.handles.get(shard))
            .ok_or_else(unknown)?;
        if let Some(h) = shard.sha256 {
            return Ok(h);
        }
        self.check_unchanged(shard, handle)?;
        let h = hash::sha256_handle(handle).map_err(|source| CheckpointError::Io {
            file: shard.name.as_str().into(),
            op: "hashing",
            source,
        })?;
        if let Some(expected) = shard.hub_blob_sha256() {
            if to_hex(&h) != expected {
                return Err(CheckpointError::HubBlobMismatch {
                    file: shard.name.as_str().into(),
                    blob: expected.to_owned(),
                    algorithm: "SHA-256",
                    actual: to_hex(&h),
                });
            }
        }
        Ok(h)
    }

    fn locate(&self, name: &str) -> Result<(&SourceTensor, &Shard, &File), CheckpointError> {
        let unknown = || CheckpointError::UnknownTensor {
            file: self.weights_file().into(),
            tensor: name.to_owned(),
        };
        let t = self.tensors.get(name).ok_or_else(unknown)?;
        let shard = self.shards.get(t.shard).ok_or_else(unknown)?;
        let handle = self.handles.get(t.shard).ok_or_else(unknown)?;
        Ok((t, shard, handle))
    }

    fn check_unchanged(&self, shard: &Shard, handle: &File) -> Result<(), CheckpointError> {
        let actual = handle
            .metadata()
            .map_err(|source| CheckpointError::Io {
                file: shard.name.as_str().into(),
                op: "stat",
                source,
            })?
            .len();
        if actual != shard.size {
            return Err(CheckpointError::ShardChanged {
                file: shard.name.as_str().into(),
                expected: shard.size,
                actual,
            });
        }
        Ok(())
    }
}

/// A read-only memory map of one shard; see [`Checkpoint::map_shard`] for the hazard.
#[derive(Debug)]
pub struct ShardMap {
    shard: usize,
    map: memmap2::Mmap,
}

impl ShardMap {
    /// Which shard this maps.
    pub fn shard(&self) -> usize {
        self.shard
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// A tensor's bytes, or `None` if the tensor lives in another shard (or lies outside this
    /// file, which a validated [`SourceTensor`] never does).
    pub fn tensor(&self, t: &SourceTensor) -> Option<&[u8]> {
        if t.shard != self.shard {
            return None;
        }
        let start = usize::try_from(t.offset).ok()?;
        let end = start.checked_add(usize::try_from(t.len).ok()?)?;
        self.map.get(start..end)
    }
}

// ---- helpers -------------------------------------------------------------------------------------

#[derive(Deserialize)]
struct RawIndex {
    #[serde(default)]
    metadata: serde_json::Value,
    weight_map: BTreeMap<String, String>,
}

fn parse_index(bytes: &[u8]) -> Result<RawIndex, CheckpointError> {
    let invalid = |message: String| CheckpointError::IndexInvalidJson {
        file: INDEX_FILE.into(),
        message,
    };
    let text = std::str::from_utf8(bytes).map_err(|e| invalid(e.to_string()))?;
    match json::first_duplicate_key(text) {
        Err(e) => return Err(invalid(e.to_string())),
        Ok(Some(path)) if path.len() == 2 && path[0] == "weight_map" => {
            return Err(CheckpointError::IndexDuplicateTensor {
                file: INDEX_FILE.into(),
                tensor: path[1].clone(),
            })
        }
        Ok(Some(path)) => {
            return Err(CheckpointError::DuplicateJsonKey {
                file: INDEX_FILE.into(),
                key_path: json::render_path(&path),
            })
        }
        Ok(None) => {}
    }
    serde_json::from_str(text).map_err(|e| invalid(e.to_string()))
}

/// Resolves, opens and reads a small JSON file (capped at [`MAX_JSON_LEN`]), verifying a Hub
/// blob against the very bytes that are returned. `Ok(None)` when the file is absent.
fn read_json_file(
    root: &paths::SourceRoot,
    name: &str,
    verify: bool,
) -> Result<Option<(SourceFile, Vec<u8>)>, CheckpointError> {
    let Some(resolved) = root.resolve(name)? else {
        return Ok(None);
    };
    let (handle, size) = open_regular(name, &resolved.path)?;
    if size > MAX_JSON_LEN {
        return Err(CheckpointError::JsonTooLarge {
            file: name.into(),
            size,
            limit: MAX_JSON_LEN,
        });
    }
    let mut bytes = Vec::with_capacity(size as usize);
    (&handle)
        .take(MAX_JSON_LEN + 1)
        .read_to_end(&mut bytes)
        .map_err(|source| CheckpointError::Io {
            file: name.into(),
            op: "reading",
            source,
        })?;
    if bytes.len() as u64 > MAX_JSON_LEN {
        return Err(CheckpointError::JsonTooLarge {
            file: name.into(),
            size: bytes.len() as u64,
            limit: MAX_JSON_LEN,
        });
    }
    if let (Some(blob), true) = (&resolved.hub_blob, verify) {
        blob.verify_bytes(Path::new(name), &bytes)?;
    }
    let file = SourceFile {
        name: name.to_owned(),
        path: resolved.path,
        size: bytes.len() as u64,
        hub_blob: resolved.hub_blob,
    };
    Ok(Some((file, bytes)))
}

/// Opens a resolved path, refusing anything but a regular file. The open is non-blocking, so a
/// FIFO swapped in after the check cannot block it; the handle's own `fstat` then decides (and
/// `O_NONBLOCK` has no effect on reads of a regular file).
pub(crate) fn open_regular(name: &str, path: &Path) -> Result<(File, u64), CheckpointError> {
    let io_err = |op, source| CheckpointError::Io {
        file: name.into(),
        op,
        source,
    };
    if !fs::metadata(path).map_err(|e| io_err("stat", e))?.is_file() {
        return Err(CheckpointError::NotAFile { file: name.into() });
    }
    let mut options = fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NONBLOCK);
    let handle = options.open(path).map_err(|e| io_err("open", e))?;
    let meta = handle.metadata().map_err(|e| io_err("stat", e))?;
    if !meta.is_file() {
        return Err(CheckpointError::NotAFile { file: name.into() });
    }
    Ok((handle, meta.len()))
}

/// One positioned read (the handle's cursor is neither used nor moved).
pub(crate) fn read_at(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::read_at(file, buf, offset)
    }
    #[cfg(windows)]
    {
        std::os::windows::fs::FileExt::seek_read(file, buf, offset)
    }
}

/// Fills `buf` from `offset`; a short file is `UnexpectedEof`.
pub(crate) fn read_exact_at(file: &File, mut buf: &mut [u8], mut offset: u64) -> io::Result<()> {
    while !buf.is_empty() {
        match read_at(file, buf, offset) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "file ended early",
                ))
            }
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
