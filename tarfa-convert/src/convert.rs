//! A Hugging Face checkpoint, as `tarfa-checkpoint` validated it, into a bundle.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use jnf_format::{
    Dtype, ExpertExtent, LayoutPlan, MatrixSpec, Relayout, SourceRef, TensorEntry, TensorSpec,
};
use tarfa_checkpoint::{
    Checkpoint, ExpertMatrix, FusedForm, FusedLayer, GateUpColumns, GateUpStacking,
};
use tarfa_manifest::hash::to_hex;
use tarfa_manifest::{ShardRecord, SourceRange};

use crate::bundle::{
    write_bundle, BundleSpec, CodecChoice, CopiedFile, RegionSource, WriteSummary,
};
use crate::ConvertError;

#[derive(Debug, Clone, Default)]
pub struct ConvertOptions {
    /// Replace an existing bundle at the target.
    pub force: bool,
    /// How expert extents are stored (default raw: format version 1, as before version 2).
    pub codec: CodecChoice,
}

pub fn converter_id() -> String {
    format!("tarfa-convert {}", env!("CARGO_PKG_VERSION"))
}

fn jnf_dtype(d: tarfa_checkpoint::Dtype) -> Result<Dtype, ConvertError> {
    // The checkpoint crate already refused everything but these; map defensively anyway.
    use tarfa_checkpoint::Dtype as S;
    Ok(match d {
        S::BF16 => Dtype::BF16,
        S::F16 => Dtype::F16,
        S::F32 => Dtype::F32,
        S::F64 => Dtype::F64,
        other => {
            return Err(ConvertError::Usage(format!(
                "dtype {other:?} cannot be carried"
            )))
        }
    })
}

/// Open, validate, lay out and write. Returns the summary of the written bundle.
pub fn convert(
    src: &Path,
    out: &Path,
    opts: &ConvertOptions,
) -> Result<WriteSummary, ConvertError> {
    // Opening may read whole shards (a Hub blob is hashed against its name): a shard whose
    // status changed after this instant may have changed while it was read.
    let began = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let ckpt = tarfa_checkpoint::open(src)?;
    // What each shard is, to notice a change by the end.
    let mut opened = Vec::with_capacity(ckpt.shards.len());
    for shard in &ckpt.shards {
        let stat = ShardStat::of(&shard.path)?;
        if stat.ctime >= (began.as_secs() as i64, began.subsec_nanos() as i64) {
            return Err(ConvertError::SourceChanged {
                path: ckpt.root.join(&shard.name),
                what: "it changed while the checkpoint was being opened".into(),
            });
        }
        opened.push(stat);
    }
    crate::target::check_not_overlapping(src, out)?;
    // Before anything is written: a checkpoint the runtime would refuse is refused now.
    crate::family::check(&ckpt)?;
    let header = plan(&ckpt)?;
    let expert_sources = fused_sources(&ckpt);
    let mut files = Vec::new();
    let wrapped_config = ckpt.config.bundle_config_json();
    let mut source_config_sha = None;
    for f in &ckpt.extra_files {
        let mut bytes = std::fs::read(&f.path).map_err(ConvertError::io(&f.path, "read"))?;
        // A multimodal wrapper: the bundle carries its text model's config (what the runtime
        // runs); the source's own config.json is named by its SHA-256 in the manifest.
        if let (true, Some(text)) = (f.name == tarfa_checkpoint::CONFIG_FILE, &wrapped_config) {
            source_config_sha = Some(to_hex(&sha2_of(&bytes)));
            bytes = text.clone();
        }
        files.push(CopiedFile {
            name: f.name.clone(),
            bytes,
        });
    }
    let mut source = BTreeMap::new();
    source.insert("kind".to_string(), "hub".to_string());
    source.insert("weights".to_string(), ckpt.weights_file().to_string());
    source.insert(
        "model_type".to_string(),
        ckpt.config.family.model_type().to_string(),
    );
    // The manifest's source table says what was left out, as the report does.
    let note = skipped_note(&ckpt);
    if let Some(n) = &note {
        source.insert("skipped".to_string(), n.clone());
    }
    let wrapper_note = multimodal_note(&ckpt, source_config_sha.as_deref());
    if let Some(n) = &wrapper_note {
        source.insert("multimodal".to_string(), n.clone());
    }
    let mxfp4 = mxfp4_tensors(&ckpt);
    let mxfp4_note = (!mxfp4.is_empty()).then(|| {
        format!(
            "MXFP4 experts stored in the released form ({} tensors: {} ...): blocks and scales \
             as released, hashed as stored, widened exactly to BF16 when run",
            mxfp4.len(),
            mxfp4[0]
        )
    });
    if let Some(n) = &mxfp4_note {
        source.insert("mxfp4".to_string(), n.clone());
    }
    let spec = BundleSpec {
        header,
        files,
        source,
        converter: converter_id(),
        expert_sources,
        codec: opts.codec,
    };
    let src = CheckpointSource {
        ckpt: &ckpt,
        opened,
    };
    let mut summary = write_bundle(out, opts.force, spec, &src)?;
    summary.notes.extend(note);
    summary.notes.extend(wrapper_note);
    summary.notes.extend(mxfp4_note);
    summary.mxfp4_tensors = mxfp4;
    Ok(summary)
}

/// The source tensors stored as released MXFP4 (blocks and scales), sorted.
fn mxfp4_tensors(ckpt: &Checkpoint) -> Vec<String> {
    let mut v: Vec<String> = ckpt
        .fused
        .values()
        .filter(|f| matches!(f.form, FusedForm::Mxfp4 { .. }))
        .flat_map(|f| f.tensors().into_iter().map(str::to_owned))
        .collect();
    v.sort();
    v
}

/// The declared permutation a fused layer's BF16 slices are re-laid with.
/// Expert `e`'s extent from its slices of the fused tensors, in extent order: BF16 `[gate_up,
/// down]` re-laid by `relayout` into gate | up | down, or (no re-layout: MXFP4 as released) the
/// slices one after the other. The converter and the synth generator's direct bundles both
/// write fused experts with this, so a synthetic bundle is what converting its Hub form gives.
pub(crate) fn fused_extent(
    e: &ExpertExtent,
    relayout: Option<Relayout>,
    parts: &[Vec<u8>],
    h: usize,
    i: usize,
    dst: &mut [u8],
) -> Result<(), ConvertError> {
    let bytes: Vec<u8> = match (relayout, parts) {
        (None, _) => parts.concat(),
        (Some(relayout), [gu, d]) => {
            let pairs =
                |b: &[u8]| -> Vec<[u8; 2]> { b.chunks_exact(2).map(|c| [c[0], c[1]]).collect() };
            relayout
                .to_extent(&pairs(gu), &pairs(d), h, i)
                .into_iter()
                .flatten()
                .collect()
        }
        (Some(_), _) => {
            return Err(ConvertError::Usage(format!(
                "{}: a re-laid fused expert has {} source slices, not gate_up and down",
                e.prefix,
                parts.len()
            )))
        }
    };
    if bytes.len() != dst.len() {
        return Err(ConvertError::Usage(format!(
            "{}: the fused slices give {} bytes, the extent holds {}",
            e.prefix,
            bytes.len(),
            dst.len()
        )));
    }
    dst.copy_from_slice(&bytes);
    Ok(())
}

fn relayout_of(f: &FusedLayer) -> Option<Relayout> {
    match (&f.form, f.stacking) {
        (FusedForm::Bf16 { .. }, GateUpStacking::Columns(GateUpColumns::Interleaved)) => {
            Some(Relayout::GateUpInterleavedColumns)
        }
        // Llama 4: gate the first half of the columns, up the second; the same re-layout into
        // gate | up | down [out, in] as gpt-oss's BF16 form, so every family's BF16 extent has
        // one layout (docs/FORMAT.md, "Fused experts").
        (FusedForm::Bf16 { .. }, GateUpStacking::Columns(GateUpColumns::Halves)) => {
            Some(Relayout::GateUpConcatenatedColumns)
        }
        // Qwen3.5 MoE: gate_up[e] is gate's rows then up's, [out, in], and down[e] is [out, in]:
        // the slices are already that layout, so nothing is permuted (and none is recorded).
        (FusedForm::Bf16 { .. }, GateUpStacking::Rows) => None,
        (FusedForm::Mxfp4 { .. }, _) => None,
    }
}

/// Expert `e`'s byte range of each of a fused layer's tensors, in extent order.
fn fused_ranges(ckpt: &Checkpoint, f: &FusedLayer, expert: u32) -> Vec<SourceRange> {
    f.tensors()
        .into_iter()
        .map(|name| {
            let t = &ckpt.tensors[name];
            // E is outermost: expert e's slice is the e-th of E equal, contiguous ranges.
            let per = t.len / u64::from(ckpt.config.num_experts);
            SourceRange {
                tensor: name.to_owned(),
                shard: ckpt.shards[t.shard].name.clone(),
                offset: t.offset + u64::from(expert) * per,
                length: per,
            }
        })
        .collect()
}

/// The manifest's source record of every fused expert: the permutation, and the ranges.
fn fused_sources(ckpt: &Checkpoint) -> crate::bundle::ExpertSources {
    let mut out = BTreeMap::new();
    for f in ckpt.fused.values() {
        for e in 0..ckpt.config.num_experts {
            out.insert(
                (f.layer, e),
                (
                    relayout_of(f).map(|r| r.name().to_owned()),
                    fused_ranges(ckpt, f, e),
                ),
            );
        }
    }
    out
}

/// The note on the multi-token-prediction tensors a checkpoint carries (past its last decoder
/// layer, or under `mtp.`): validated, never carried into the bundle (next-token logits never
/// use them).
fn skipped_note(ckpt: &Checkpoint) -> Option<String> {
    // The vision tower of a multimodal wrapper is skipped too: multimodal_note says so.
    let example = ckpt.mtp.first()?;
    let count = ckpt.mtp.len();
    let which = match ckpt.config.family.mtp_prefix() {
        Some(prefix) => {
            let layers = ckpt
                .config
                .mtp_hidden_layers
                .map(|n| format!("mtp_num_hidden_layers {n}, "))
                .unwrap_or_default();
            format!("under {prefix}* ({layers}e.g. {example})")
        }
        None => {
            let first = ckpt.config.num_hidden_layers;
            let n = ckpt.config.nextn_predict_layers;
            format!(
                "of layers {first}..{} (num_nextn_predict_layers {n}, e.g. {example})",
                first + n
            )
        }
    };
    Some(format!(
        "skipped {count} multi-token-prediction tensors {which}: next-token logits never use \
         them, so the bundle does not carry them"
    ))
}

fn sha2_of(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

/// The note on a multimodal release: its text model converted, how its tensor names were
/// read, the vision tower left out, by name and count.
fn multimodal_note(ckpt: &Checkpoint, source_config_sha: Option<&str>) -> Option<String> {
    let w = ckpt.config.multimodal.as_ref()?;
    let names: Vec<String> = w
        .layout
        .text_prefixes
        .iter()
        .map(|(outer, inner)| {
            if outer == inner {
                format!("{outer}* as named")
            } else {
                format!("{outer}* read as {inner}*")
            }
        })
        .collect();
    let parts: Vec<String> = w
        .layout
        .left_out
        .iter()
        .map(|p| {
            let n = ckpt.left_out.iter().filter(|n| n.starts_with(p)).count();
            format!("{p}*: {n}")
        })
        .collect();
    Some(format!(
        "multimodal {} ({}): the text model converted (text_config written as config.json; the \
         source config.json has SHA-256 {}; {}); the vision tower left out: {} tensors ({}{})",
        w.model_type,
        w.architectures.join(", "),
        source_config_sha.unwrap_or("unknown"),
        names.join(", "),
        ckpt.left_out.len(),
        parts.join(", "),
        ckpt.left_out
            .first()
            .map(|n| format!(", e.g. {n}"))
            .unwrap_or_default(),
    ))
}

/// The layout: non-expert tensors sorted by name, then experts by (layer, expert).
fn plan(ckpt: &Checkpoint) -> Result<jnf_format::Header, ConvertError> {
    let source_ref = |name: &str| {
        let t = &ckpt.tensors[name];
        SourceRef {
            shard: ckpt.shards[t.shard].name.clone(),
            offset: t.offset,
        }
    };
    let mut layout = LayoutPlan::new();
    for name in &ckpt.non_expert {
        let t = &ckpt.tensors[name];
        layout.add_tensor(TensorSpec {
            name: name.clone(),
            dtype: jnf_dtype(t.dtype)?,
            shape: t.shape.clone(),
            source: Some(source_ref(name)),
        });
    }
    for (&(layer, expert), e) in &ckpt.experts {
        let specs = ExpertMatrix::ALL.map(|m| {
            let name = e.tensor(m);
            let t = &ckpt.tensors[name];
            MatrixSpec {
                name: name.to_string(),
                dtype: Dtype::BF16,
                shape: t.shape.clone(),
                source: Some(source_ref(name)),
            }
        });
        layout.add_expert(layer, expert, e.prefix.clone(), specs);
    }
    let table = ckpt.config.family.fused_experts();
    for (f, table) in ckpt.fused.values().filter_map(|f| Some((f, table?))) {
        let (h, i) = (f.hidden, f.intermediate);
        for expert in 0..ckpt.config.num_experts {
            let prefix = f.expert_prefix(table, expert);
            let ranges = fused_ranges(ckpt, f, expert);
            match (&f.form, f.stacking) {
                // Stacked by rows: gate, up and down are each one contiguous range of the
                // expert's slices (gate_up[e]'s first I rows, its last I, down[e]), in the
                // order the extent holds them, so each matrix has its source range.
                (FusedForm::Bf16 { .. }, GateUpStacking::Rows) => {
                    let (gu, d) = (&ranges[0], &ranges[1]);
                    let half = gu.length / 2;
                    let m = |role: &str, shape: Vec<u64>, r: &SourceRange, skip: u64| MatrixSpec {
                        name: format!("{prefix}.{role}"),
                        dtype: Dtype::BF16,
                        shape,
                        source: Some(SourceRef {
                            shard: r.shard.clone(),
                            offset: r.offset + skip,
                        }),
                    };
                    layout.add_expert(
                        f.layer,
                        expert,
                        prefix.clone(),
                        [
                            m("gate_proj", vec![i, h], gu, 0),
                            m("up_proj", vec![i, h], gu, half),
                            m("down_proj", vec![h, i], d, 0),
                        ],
                    );
                }
                // Re-laid into gate | up | down [out, in] by the declared permutation: the
                // header's matrices have no single source range (the manifest records the
                // fused ranges and the permutation).
                (FusedForm::Bf16 { .. }, GateUpStacking::Columns(_)) => {
                    let m = |role: &str, shape: Vec<u64>| MatrixSpec {
                        name: format!("{prefix}.{role}"),
                        dtype: Dtype::BF16,
                        shape,
                        source: None,
                    };
                    layout.add_expert(
                        f.layer,
                        expert,
                        prefix.clone(),
                        [
                            m("gate_proj", vec![i, h]),
                            m("up_proj", vec![i, h]),
                            m("down_proj", vec![h, i]),
                        ],
                    );
                }
                // As released: each part is expert e's slice of its tensor, byte for byte.
                (FusedForm::Mxfp4 { parts }, _) => {
                    let specs: Vec<MatrixSpec> = parts
                        .iter()
                        .zip(&ranges)
                        .map(|(name, r)| {
                            let t = &ckpt.tensors[name];
                            let part = name.rsplit('.').next().unwrap_or(name);
                            MatrixSpec {
                                name: format!("{prefix}.{part}"),
                                dtype: Dtype::U8,
                                shape: t.shape[1..].to_vec(),
                                source: Some(SourceRef {
                                    shard: r.shard.clone(),
                                    offset: r.offset,
                                }),
                            }
                        })
                        .collect();
                    let specs: [MatrixSpec; 4] = specs.try_into().expect("four MXFP4 parts");
                    layout.add_mxfp4_expert(f.layer, expert, prefix.clone(), specs);
                }
            }
        }
    }
    layout.set_metadata("converter", &converter_id());
    Ok(layout.finish()?)
}

/// Reads go through the handles the checkpoint validated (pread, not mmap: a source truncated
/// underneath is an I/O error, not a SIGBUS). Every byte copied is hashed after the copy, and the
/// bundle is verified from disk, so a concurrent change cannot slip through unnoticed.
struct CheckpointSource<'a> {
    ckpt: &'a Checkpoint,
    /// Each shard's identity and times when the conversion began, same order as the shards.
    opened: Vec<ShardStat>,
}

/// What changes when a file is written or replaced: the inode, the size, and the times (ctime
/// cannot be set back by the writer, so a change that restores mtime is still seen).
#[derive(Debug, Clone, PartialEq, Eq)]
struct ShardStat {
    path: PathBuf,
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl ShardStat {
    fn of(path: &Path) -> Result<ShardStat, ConvertError> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path).map_err(ConvertError::io(path, "stat source shard"))?;
        Ok(ShardStat {
            path: path.to_path_buf(),
            dev: m.dev(),
            ino: m.ino(),
            size: m.len(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        })
    }

    /// How `now` differs from `self`, if it does.
    fn change(&self, now: &ShardStat) -> Option<String> {
        if (self.dev, self.ino) != (now.dev, now.ino) {
            Some("the file was replaced".into())
        } else if self.size != now.size {
            Some(format!("size {} is now {}", self.size, now.size))
        } else if self.mtime != now.mtime {
            Some("its modification time changed".into())
        } else if self.ctime != now.ctime {
            Some("its status-change time changed".into())
        } else {
            None
        }
    }
}

impl CheckpointSource<'_> {
    fn copy(&self, name: &str, dst: &mut [u8]) -> Result<(), ConvertError> {
        Ok(self.ckpt.read_tensor_to(name, dst)?)
    }
}

impl RegionSource for CheckpointSource<'_> {
    fn fill_tensor(&self, t: &TensorEntry, dst: &mut [u8]) -> Result<(), ConvertError> {
        self.copy(&t.name, dst)
    }

    fn fill_expert(&self, e: &ExpertExtent, dst: &mut [u8]) -> Result<(), ConvertError> {
        if let Some(f) = self.ckpt.fused.get(&e.layer) {
            let ranges = fused_ranges(self.ckpt, f, e.expert);
            let mut parts = Vec::with_capacity(ranges.len());
            for r in &ranges {
                let mut part = vec![0u8; r.length as usize];
                let t = &self.ckpt.tensors[&r.tensor];
                self.ckpt
                    .read_tensor_range_to(&r.tensor, r.offset - t.offset, &mut part)?;
                parts.push(part);
            }
            let (h, i) = (f.hidden as usize, f.intermediate as usize);
            return fused_extent(e, relayout_of(f), &parts, h, i, dst);
        }
        for m in &e.matrices {
            let range = m.offset as usize..(m.offset + m.length) as usize;
            self.copy(&m.name, &mut dst[range])?;
        }
        Ok(())
    }

    fn shard_count(&self) -> usize {
        self.ckpt.shards.len()
    }

    fn shard_size(&self, i: usize) -> u64 {
        self.ckpt.shards[i].size
    }

    fn check_unchanged(&self) -> Result<(), ConvertError> {
        for (shard, before) in self.ckpt.shards.iter().zip(&self.opened) {
            let now = ShardStat::of(&before.path)?;
            if let Some(what) = before.change(&now) {
                return Err(ConvertError::SourceChanged {
                    path: self.ckpt.root.join(&shard.name),
                    what,
                });
            }
        }
        Ok(())
    }

    fn hash_shard(&self, i: usize) -> Result<ShardRecord, ConvertError> {
        // Checks a Hub blob's content against its name, too.
        let sha = self.ckpt.shard_sha256(i)?;
        let shard = &self.ckpt.shards[i];
        Ok(ShardRecord {
            name: shard.name.clone(),
            size: shard.size,
            sha256: to_hex(&sha),
        })
    }
}
