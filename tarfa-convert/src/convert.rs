//! A Hugging Face checkpoint, as `tarfa-checkpoint` validated it, into a bundle.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use jnf_format::{Dtype, ExpertExtent, LayoutPlan, MatrixSpec, SourceRef, TensorEntry, TensorSpec};
use tarfa_checkpoint::{Checkpoint, ExpertMatrix};
use tarfa_manifest::hash::to_hex;
use tarfa_manifest::ShardRecord;

use crate::bundle::{write_bundle, BundleSpec, CopiedFile, RegionSource, WriteSummary};
use crate::ConvertError;

#[derive(Debug, Clone, Default)]
pub struct ConvertOptions {
    /// Replace an existing bundle at the target.
    pub force: bool,
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
    let mut files = Vec::new();
    for f in &ckpt.extra_files {
        let bytes = std::fs::read(&f.path).map_err(ConvertError::io(&f.path, "read"))?;
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
    let spec = BundleSpec {
        header,
        files,
        source,
        converter: converter_id(),
    };
    let src = CheckpointSource {
        ckpt: &ckpt,
        opened,
    };
    let mut summary = write_bundle(out, opts.force, spec, &src)?;
    summary.notes.extend(note);
    Ok(summary)
}

/// The note on the multi-token-prediction tensors a checkpoint carries past its last decoder
/// layer: validated, never carried into the bundle (next-token logits never read them).
fn skipped_note(ckpt: &Checkpoint) -> Option<String> {
    if ckpt.skipped.is_empty() {
        return None;
    }
    let first = ckpt.config.num_hidden_layers;
    let n = ckpt.config.nextn_predict_layers;
    Some(format!(
        "skipped {} multi-token-prediction tensors of layers {first}..{} \
         (num_nextn_predict_layers {n}, e.g. {}): next-token logits never use them, so the \
         bundle does not carry them",
        ckpt.skipped.len(),
        first + n,
        ckpt.skipped[0]
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
