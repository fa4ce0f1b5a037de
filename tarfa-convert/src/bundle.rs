//! Writing a bundle atomically: temporary directory, parallel copy-and-hash, fsync, read-back
//! verification from the device, then one rename.
//!
//! With [`CodecChoice::ExponentPlaneZstd`] the expert extents are first encoded once to learn
//! their stored sizes (the layout's offsets depend on them), the layout is re-planned as format
//! version 2, and the write encodes each extent again (the encoder is deterministic: a different
//! size is a verification failure) and writes the stored bytes. Hashes are taken of the decoded
//! bytes (the checkpoint's, as in version 1) and of the stored bytes; the read-back checks the
//! stored bytes' BLAKE3, decodes them and checks the decoded bytes' BLAKE3.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, OnceLock};
use std::time::{Duration, Instant};

use jnf_format::{
    align_up, Dtype, ExpertExtent, ExtentCodec, ExtentEncoding, Header, LayoutPlan, TensorEntry,
    CONTAINER_FILE,
};
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use tarfa_manifest::hash::to_hex;
use tarfa_manifest::{
    manifest_version_for, ExpertRecord, FileRecord, HeaderRecord, Manifest, MatrixRecord,
    ShardRecord, TensorRecord, CONTRACT_VERSION, MANIFEST_FILE,
};

use crate::aligned::{open_uncached, AlignedBuf, ReadMode};
use crate::progress::bytes_bar;
use crate::target::{
    nearest_existing, not_a_bundle, rename_exchange, rename_noreplace, resolve, CreatedDirs,
    TargetLock,
};
use crate::{interrupted, ConvertError};

/// Produces the bytes of each region; implemented by the checkpoint converter and the
/// synthetic generator.
pub trait RegionSource: Sync {
    /// Fill `dst` (exactly `t.length` bytes) with the tensor's bytes.
    fn fill_tensor(&self, t: &TensorEntry, dst: &mut [u8]) -> Result<(), ConvertError>;
    /// Fill `dst` (exactly `e.length` bytes) with gate, up and down bytes back to back.
    fn fill_expert(&self, e: &ExpertExtent, dst: &mut [u8]) -> Result<(), ConvertError>;
    /// Source shards to hash for the manifest (the converter's; none for synthetic bundles).
    fn shard_count(&self) -> usize {
        0
    }
    /// Hash shard `i` (whole file SHA-256).
    fn hash_shard(&self, _i: usize) -> Result<ShardRecord, ConvertError> {
        unreachable!("shard_count is 0")
    }
    /// Bytes of shard `i`, for the progress bar.
    fn shard_size(&self, _i: usize) -> u64 {
        0
    }
    /// Called after every byte was copied and before publishing: fail if the source changed
    /// since it was opened (its hashes and the copied bytes could then disagree).
    fn check_unchanged(&self) -> Result<(), ConvertError> {
        Ok(())
    }
}

/// A small file copied into the bundle unchanged (config, tokenizer).
pub struct CopiedFile {
    pub name: String,
    pub bytes: Vec<u8>,
}

/// Where each fused expert's extent came from, by (layer, expert): the declared permutation
/// (`jnf_format::Relayout::name`, none for bytes as released) and the source ranges in extent
/// order. Experts with tensors of their own are absent.
pub type ExpertSources = BTreeMap<(u32, u32), (Option<String>, Vec<tarfa_manifest::SourceRange>)>;

/// How the converter stores expert extents (`tarfa-convert --codec`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CodecChoice {
    /// Every extent as it is: format version 1, byte for byte the bundle this converter wrote
    /// before format version 2 existed.
    #[default]
    Raw,
    /// Each BF16 extent encoded with `jnf-codec` where it pays ([`encoding_pays`]), the others
    /// raw: format version 2.
    ExponentPlaneZstd,
}

impl CodecChoice {
    pub fn name(self) -> &'static str {
        match self {
            CodecChoice::Raw => "raw",
            CodecChoice::ExponentPlaneZstd => "exp-zstd",
        }
    }
}

/// The adaptive rule: an extent is stored encoded only when its encoding is at most this share
/// (percent) of its bytes, else raw. Below a 5% saving the read it saves is within the disk's
/// own variation, while every cold read of it would still pay the stored-hash check and the
/// decode (about a second of one core per 2 GB decoded, PHASE_LOG K2); the format requires
/// only that an encoded extent be smaller than its bytes.
pub const ENCODED_AT_MOST_PERCENT: u64 = 95;

/// Whether an extent of `length` bytes whose encoding is `encoded` bytes is stored encoded.
pub fn encoding_pays(length: u64, encoded: u64) -> bool {
    encoded.saturating_mul(100) <= length.saturating_mul(ENCODED_AT_MOST_PERCENT)
}

/// Everything needed to write a bundle besides the region bytes.
pub struct BundleSpec {
    pub header: Header,
    pub files: Vec<CopiedFile>,
    pub source: BTreeMap<String, String>,
    pub converter: String,
    /// The manifest's record of fused experts' sources (empty for other checkpoints).
    pub expert_sources: ExpertSources,
    /// How expert extents are stored; the header above is always the raw (version-1) layout,
    /// re-planned by [`write_bundle`] when extents are encoded.
    pub codec: CodecChoice,
}

/// What the codec did (`--codec exp-zstd`), for the report.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CodecSummary {
    pub extents: usize,
    /// Stored encoded.
    pub encoded: usize,
    /// BF16 extents whose encoding did not pay, stored raw.
    pub kept_raw: usize,
    /// MXFP4 extents (never encoded), stored raw.
    pub not_bf16: usize,
    /// The extents' bytes, decoded.
    pub extent_bytes: u64,
    /// What they occupy as stored, before padding.
    pub stored_bytes: u64,
    /// The first pass that encodes every extent to learn its size.
    pub sizing_time: Duration,
}

/// What a write did, for the command's report and the benchmark.
#[derive(Debug, Clone)]
pub struct WriteSummary {
    pub bundle: PathBuf,
    pub root_digest: String,
    pub data_bytes: u64,
    /// Bytes that went through SHA-256 (tensors, experts, shards, files).
    pub sha256_bytes: u64,
    pub write_time: Duration,
    pub sync_time: Duration,
    pub verify_time: Duration,
    pub read_mode: ReadMode,
    pub removed_stale: Vec<PathBuf>,
    /// Tensors and experts holding NaN or infinite elements, with their counts (header order).
    pub nonfinite: Vec<(String, u64)>,
    /// What the conversion left out of the source, and why (the MTP layers a DeepSeek or
    /// GLM-4.5 checkpoint carries), one line each.
    pub notes: Vec<String>,
    /// The source tensors stored as released MXFP4 (gpt-oss's expert blocks and scales).
    pub mxfp4_tensors: Vec<String>,
    /// With `--codec exp-zstd`: what was encoded and what it saved.
    pub codec: Option<CodecSummary>,
}

const TMP_MARK: &str = ".tarfa-tmp-";
/// Reads kept in flight while verifying the written bundle from the device.
const READ_BACK_DEPTH: usize = 8;
const OLD_MARK: &str = ".tarfa-old-";

/// Names of temporaries beside `target` whose writing process is gone.
fn stale_temporaries(parent: &Path, base: &str) -> Vec<PathBuf> {
    let Ok(rd) = fs::read_dir(parent) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in rd.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        for mark in [TMP_MARK, OLD_MARK] {
            let prefix = format!(".{base}{mark}");
            if let Some(pid) = name
                .strip_prefix(&prefix)
                .and_then(|p| p.parse::<u32>().ok())
            {
                if !Path::new(&format!("/proc/{pid}")).exists() || pid == std::process::id() {
                    out.push(entry.path());
                }
            }
        }
    }
    out
}

pub fn free_space(dir: &Path) -> std::io::Result<u64> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let c = CString::new(dir.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a valid NUL-terminated path; st is a valid out-pointer.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

fn fsync_dir(dir: &Path) -> Result<(), ConvertError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(ConvertError::io(dir, "fsync directory"))
}

/// Removes the temporary directory unless the write succeeded.
struct TempGuard(Option<PathBuf>);

impl Drop for TempGuard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = fs::remove_dir_all(p);
        }
    }
}

thread_local! {
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Write a bundle at `target`. See the module doc for the sequence; on any error or interrupt
/// the temporary directory, the lock and any parent directories this call created are removed
/// and `target` is untouched. `force` replaces only what is verifiably a bundle
/// ([`crate::target::not_a_bundle`]).
pub fn write_bundle(
    target: &Path,
    force: bool,
    mut spec: BundleSpec,
    src: &dyn RegionSource,
) -> Result<WriteSummary, ConvertError> {
    let target = absolute(target)?;
    let base = target
        .file_name()
        .ok_or_else(|| ConvertError::Usage(format!("{}: not a directory name", target.display())))?
        .to_string_lossy()
        .into_owned();
    // Resolve the parent's symlinks and `..`, but not the target's own name: a symlink at the
    // target is judged (and refused by --force) as what it is.
    let parent = resolve(target.parent().unwrap_or(Path::new("/")))?;
    let target = parent.join(&base);

    let codec = match spec.codec {
        CodecChoice::Raw => None,
        CodecChoice::ExponentPlaneZstd => {
            // Refused now rather than after the encoding pass (checked again under the lock).
            check_replaceable(&target, force)?;
            let (header, summary) = plan_encoded(&spec.header, src)?;
            spec.header = header;
            Some(summary)
        }
    };
    let header = &spec.header;
    let data_bytes: u64 = header.tensors.iter().map(|t| t.length).sum::<u64>()
        + header.experts.iter().map(|e| e.length).sum::<u64>();
    check_padding(&target, header, data_bytes)?;
    let files_bytes: u64 = spec.files.iter().map(|f| f.bytes.len() as u64).sum();
    // The manifest is about 400 bytes an entry.
    let manifest_estimate = 4096 + 400 * (header.tensors.len() + header.experts.len()) as u64;
    let need = header.file_size + files_bytes + manifest_estimate;
    // Measured before anything is created, on the nearest directory that exists.
    let space_dir = nearest_existing(&parent).to_path_buf();
    let have = free_space(&space_dir).map_err(ConvertError::io(&space_dir, "statvfs"))?;
    if need > have {
        return Err(ConvertError::NoSpace {
            dir: space_dir,
            need,
            have,
        });
    }

    let mut created = CreatedDirs::create(&parent)?;
    let lock = TargetLock::acquire(&parent, &base, &target)?;
    check_replaceable(&target, force)?;
    let removed_stale = stale_temporaries(&parent, &base);
    for p in &removed_stale {
        fs::remove_dir_all(p).map_err(ConvertError::io(p, "remove stale temporary"))?;
    }

    let tmp = parent.join(format!(".{base}{TMP_MARK}{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(ConvertError::io(&tmp, "remove old temporary"))?;
    }
    fs::create_dir(&tmp).map_err(ConvertError::io(&tmp, "create temporary directory"))?;
    let mut guard = TempGuard(Some(tmp.clone()));

    // ---- copy and hash, with the read-back of each finished batch overlapped ----
    let t0 = Instant::now();
    let jnf_path = tmp.join(CONTAINER_FILE);
    let out = OpenOptions::new()
        .create_new(true)
        .write(true)
        .read(true)
        .open(&jnf_path)
        .map_err(ConvertError::io(&jnf_path, "create"))?;
    out.set_len(header.file_size)
        .map_err(ConvertError::io(&jnf_path, "set length"))?;
    let encoded_header = header.encode()?;
    out.write_all_at(&encoded_header, 0)
        .map_err(ConvertError::io(&jnf_path, "write header"))?;
    let header_record = HeaderRecord::of_container_prefix(&encoded_header)
        .expect("an encoded header holds its preamble and JSON");
    let (reader, read_mode) =
        open_uncached(&jnf_path).map_err(ConvertError::io(&jnf_path, "open for read-back"))?;

    let batches = plan_batches(header);
    let shard_total: u64 = (0..src.shard_count()).map(|i| src.shard_size(i)).sum();
    let bar = bytes_bar(data_bytes + shard_total, "convert");
    let hashed = AtomicU64::new(0);

    // One flat list in file order for the writers (no barrier between batches); a batch goes to
    // the read-back as soon as its last region is written, whichever worker wrote it.
    let jobs: Vec<(usize, Job)> = batches
        .iter()
        .enumerate()
        .flat_map(|(b, batch)| batch.iter().map(move |&j| (b, j)))
        .collect();
    let first_of_batch: Vec<usize> = batches
        .iter()
        .scan(0, |start, b| {
            let s = *start;
            *start += b.len();
            Some(s)
        })
        .collect();
    let remaining: Vec<AtomicUsize> = batches.iter().map(|b| AtomicUsize::new(b.len())).collect();
    let region_out: Vec<OnceLock<RegionOut>> = jobs.iter().map(|_| OnceLock::new()).collect();
    let read_back_entry = |job: Job, r: &RegionOut| match job {
        Job::Tensor(i) => {
            let t = &header.tensors[i];
            ReadBack {
                name: t.name.clone(),
                offset: t.offset,
                length: t.length,
                padded: align_up(t.length).expect("validated"),
                blake3: r.blake3,
                decoded: None,
            }
        }
        Job::Expert(i) => {
            let e = &header.experts[i];
            ReadBack {
                name: e.prefix.clone(),
                offset: e.offset,
                length: e.stored_length,
                padded: e.padded_length,
                blake3: r.stored_blake3.unwrap_or(r.blake3),
                decoded: r.stored_blake3.map(|_| (e.clone(), r.blake3)),
            }
        }
        Job::Shard(_) => unreachable!("shards are not regions"),
    };

    let mut shards = Vec::new();
    let (to_reader, batches_written) = mpsc::channel::<Vec<ReadBack>>();
    let (write_time, read_back) = std::thread::scope(|scope| {
        let read_back =
            scope.spawn(|| read_back_batches(&reader, &jnf_path, read_mode, batches_written));
        // Whole-shard hashes are independent tasks on the same pool: a worker that is free takes
        // one, so no region waits on a shard many times its size.
        let shard_records = std::sync::Mutex::new(Vec::new());
        let written = rayon::scope(|tasks| -> Result<(), ConvertError> {
            for i in 0..src.shard_count() {
                let (shard_records, hashed, bar, out, jnf_path) =
                    (&shard_records, &hashed, &bar, &out, &jnf_path);
                tasks.spawn(move |_| {
                    let r = run_job(&Job::Shard(i), header, src, out, jnf_path, hashed, bar);
                    shard_records
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(r);
                });
            }
            jobs.par_iter()
                .enumerate()
                .try_for_each(|(k, &(b, job))| -> Result<(), ConvertError> {
                    let JobOut::Region(r) =
                        run_job(&job, header, src, &out, &jnf_path, &hashed, &bar)?
                    else {
                        unreachable!("a region job gives a region")
                    };
                    let _ = region_out[k].set(r);
                    if remaining[b].fetch_sub(1, Ordering::AcqRel) == 1 {
                        let start = first_of_batch[b];
                        let check = (start..start + batches[b].len())
                            .map(|k| {
                                read_back_entry(jobs[k].1, region_out[k].get().expect("written"))
                            })
                            .collect();
                        // A reader that already failed has dropped its end; its error is
                        // reported below.
                        let _ = to_reader.send(check);
                    }
                    Ok(())
                })
        })
        .and_then(|()| {
            for r in shard_records
                .into_inner()
                .unwrap_or_else(|e| e.into_inner())
            {
                match r? {
                    JobOut::Shard(rec) => shards.push(rec),
                    JobOut::Region(_) => unreachable!("a shard job gives a shard record"),
                }
            }
            Ok(())
        });
        drop(to_reader);
        let write_time = t0.elapsed();
        let read_back = read_back.join().unwrap_or_else(|_| {
            Err(ConvertError::io(&jnf_path, "read back")(
                std::io::Error::other("read-back thread panicked"),
            ))
        });
        // A write error explains a read-back failure that follows it, not the other way round.
        (written.map(|()| write_time), read_back)
    });
    let write_time = write_time?;
    read_back?;
    bar.finish_and_clear();
    shards.sort_by(|a, b| a.name.cmp(&b.name));
    let mut tensor_out: Vec<Option<RegionOut>> = vec![None; header.tensors.len()];
    let mut expert_out: Vec<Option<RegionOut>> = vec![None; header.experts.len()];
    for ((_, job), r) in jobs.iter().zip(region_out) {
        match *job {
            Job::Tensor(i) => tensor_out[i] = r.into_inner(),
            Job::Expert(i) => expert_out[i] = r.into_inner(),
            Job::Shard(_) => unreachable!("shards are not regions"),
        }
    }
    let tensor_hashes: Vec<Hashes> = tensor_out
        .iter()
        .map(|r| r.as_ref().map(|r| (r.sha256, r.blake3)))
        .collect();
    let nonfinite = NonfiniteCounts {
        tensors: tensor_out
            .iter()
            .map(|r| r.as_ref().map_or(0, |r| r.nonfinite))
            .collect(),
        experts: expert_out
            .iter()
            .map(|r| r.as_ref().map_or(0, |r| r.nonfinite))
            .collect(),
    };

    // ---- durability ----
    let t1 = Instant::now();
    out.sync_all()
        .map_err(ConvertError::io(&jnf_path, "fsync"))?;
    close_checked(out, &jnf_path)?;
    let mut files = Vec::new();
    let mut sha256_bytes = hashed.load(Ordering::Relaxed);
    for f in &spec.files {
        let path = tmp.join(&f.name);
        write_synced(&path, &f.bytes)?;
        sha256_bytes += f.bytes.len() as u64;
        files.push(FileRecord {
            name: f.name.clone(),
            size: f.bytes.len() as u64,
            sha256: to_hex(&Sha256::digest(&f.bytes)),
        });
    }
    let manifest = build_manifest(
        &spec,
        header_record,
        shards,
        files,
        &tensor_hashes,
        &expert_out,
        &nonfinite,
    );
    let manifest_path = tmp.join(MANIFEST_FILE);
    write_synced(&manifest_path, manifest.to_toml().as_bytes())?;
    fsync_dir(&tmp)?;
    let sync_time = t1.elapsed();

    // ---- verify what the regions' read-back could not: header, manifest, copied files ----
    let t2 = Instant::now();
    verify_written(&tmp, &manifest)?;
    let verify_time = t2.elapsed();

    // ---- publish ----
    if interrupted() {
        return Err(ConvertError::Interrupted);
    }
    // Every byte was read from the source by now: if a shard changed since it was opened, its
    // hash and the copied bytes may disagree.
    src.check_unchanged()?;
    publish(&tmp, &target, &parent, &base, force, &mut guard)?;
    fsync_dir(&parent)?;
    // The old bundle (now under the temporary's name) goes before the lock is released.
    drop(guard);
    drop(lock);
    created.keep();

    let nonfinite_tensors = header
        .tensors
        .iter()
        .map(|t| t.name.as_str())
        .chain(header.experts.iter().map(|e| e.prefix.as_str()))
        .zip(nonfinite.tensors.iter().chain(&nonfinite.experts))
        .filter(|(_, &n)| n > 0)
        .map(|(name, &n)| (name.to_string(), n))
        .collect();
    Ok(WriteSummary {
        bundle: target,
        root_digest: manifest.root_digest.clone(),
        data_bytes,
        sha256_bytes,
        write_time,
        sync_time,
        verify_time,
        read_mode,
        removed_stale,
        nonfinite: nonfinite_tensors,
        notes: Vec::new(),
        mxfp4_tensors: Vec::new(),
        codec,
    })
}

/// Encodes every BF16 extent once (on the worker pool, a progress bar on a terminal) to learn
/// its stored size, and re-plans `header` (the raw layout) as format version 2: each extent
/// encoded where [`encoding_pays`], else raw; MXFP4 extents raw, unread. The bytes are not
/// kept (a model's extents need not fit in memory): the write encodes them again.
fn plan_encoded(
    header: &Header,
    src: &dyn RegionSource,
) -> Result<(Header, CodecSummary), ConvertError> {
    let t0 = Instant::now();
    let total: u64 = header.experts.iter().map(|e| e.length).sum();
    let bar = bytes_bar(total, "encode");
    let storage: Vec<(ExtentCodec, u64)> = header
        .experts
        .par_iter()
        .map(|e| {
            if interrupted() {
                return Err(ConvertError::Interrupted);
            }
            if e.encoding() != ExtentEncoding::Bf16 {
                bar.inc(e.length);
                return Ok((ExtentCodec::Raw, e.length));
            }
            // As in run_job: the buffer leaves the cell while filling may run nested work.
            let mut buf = SCRATCH.with(|cell| std::mem::take(&mut *cell.borrow_mut()));
            let result = (|| {
                buf.resize(e.length as usize, 0);
                src.fill_expert(e, &mut buf)?;
                let encoded = encode_extent(e, &buf)?.len() as u64;
                Ok(if encoding_pays(e.length, encoded) {
                    (ExtentCodec::ExponentPlaneZstd, encoded)
                } else {
                    (ExtentCodec::Raw, e.length)
                })
            })();
            SCRATCH.with(|cell| *cell.borrow_mut() = buf);
            bar.inc(e.length);
            result
        })
        .collect::<Result<_, ConvertError>>()?;
    bar.finish_and_clear();
    let mut plan = LayoutPlan::from_header(header);
    let mut summary = CodecSummary {
        extents: header.experts.len(),
        extent_bytes: total,
        ..CodecSummary::default()
    };
    for (e, &(codec, stored)) in header.experts.iter().zip(&storage) {
        plan.set_extent_storage(e.layer, e.expert, codec, stored);
        summary.stored_bytes += stored;
        match (codec, e.encoding()) {
            (ExtentCodec::ExponentPlaneZstd, _) => summary.encoded += 1,
            (ExtentCodec::Raw, ExtentEncoding::Bf16) => summary.kept_raw += 1,
            (ExtentCodec::Raw, ExtentEncoding::Mxfp4) => summary.not_bf16 += 1,
        }
    }
    summary.sizing_time = t0.elapsed();
    Ok((plan.finish()?, summary))
}

/// The extent's bytes encoded with the exponent-plane codec.
fn encode_extent(e: &ExpertExtent, bytes: &[u8]) -> Result<Vec<u8>, ConvertError> {
    jnf_codec::encode(bytes).map_err(|source| ConvertError::Encode {
        name: e.prefix.clone(),
        source,
    })
}

/// Per-region counts of NaN and infinite elements, in header order.
pub struct NonfiniteCounts {
    pub tensors: Vec<u64>,
    pub experts: Vec<u64>,
}

/// Refuse a layout whose 4 KiB padding would inflate the bundle far beyond its data (a small
/// hostile checkpoint of many tiny tensors: 18.7 MB became 516 MB).
fn check_padding(target: &Path, header: &Header, data: u64) -> Result<(), ConvertError> {
    let cap = data.saturating_mul(2).saturating_add(64 << 20);
    if header.file_size > cap {
        let tiny = header
            .tensors
            .iter()
            .filter(|t| t.length < jnf_format::ALIGN)
            .count();
        return Err(ConvertError::PaddingBlowup {
            file: target.to_path_buf(),
            tiny,
            data,
            padded: header.file_size,
        });
    }
    Ok(())
}

/// What may be at the target before the write starts: nothing, or (with --force) a bundle.
fn check_replaceable(target: &Path, force: bool) -> Result<(), ConvertError> {
    match fs::symlink_metadata(target) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(ConvertError::io(target, "stat")(e)),
        Ok(_) if !force => Err(ConvertError::TargetExists(target.to_path_buf())),
        Ok(_) => match not_a_bundle(target) {
            None => Ok(()),
            Some(why) => Err(ConvertError::NotABundle {
                target: target.to_path_buf(),
                why,
            }),
        },
    }
}

/// Rename the verified temporary into place. Without --force the target must still be absent
/// (RENAME_NOREPLACE); with it, the target is checked again to be a bundle and swapped
/// atomically (RENAME_EXCHANGE), the old bundle then removed with the temporary's name.
fn publish(
    tmp: &Path,
    target: &Path,
    parent: &Path,
    base: &str,
    force: bool,
    guard: &mut TempGuard,
) -> Result<(), ConvertError> {
    let exists = match fs::symlink_metadata(target) {
        Ok(_) => true,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => return Err(ConvertError::io(target, "stat")(e)),
    };
    if !exists {
        return match rename_noreplace(tmp, target) {
            Ok(()) => {
                guard.0 = None;
                Ok(())
            }
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                Err(ConvertError::TargetExists(target.to_path_buf()))
            }
            Err(e) => Err(ConvertError::io(target, "rename into place")(e)),
        };
    }
    check_replaceable(target, force)?;
    match rename_exchange(tmp, target) {
        // The temporary's name now holds the old bundle: the guard removes it.
        Ok(()) => Ok(()),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) => {
            let old = parent.join(format!(".{base}{OLD_MARK}{}", std::process::id()));
            fs::rename(target, &old).map_err(ConvertError::io(target, "move old bundle aside"))?;
            if let Err(e) = fs::rename(tmp, target) {
                let _ = fs::rename(&old, target);
                return Err(ConvertError::io(target, "rename into place")(e));
            }
            guard.0 = Some(old);
            Ok(())
        }
        Err(e) => Err(ConvertError::io(target, "swap into place")(e)),
    }
}

#[derive(Clone, Copy)]
enum Job {
    Tensor(usize),
    Expert(usize),
    Shard(usize),
}

#[derive(Clone)]
struct RegionOut {
    /// Of the region's bytes (an encoded extent's decoded bytes).
    sha256: [u8; 32],
    blake3: [u8; 32],
    /// An encoded extent's: the BLAKE3 of its stored bytes.
    stored_blake3: Option<[u8; 32]>,
    nonfinite: u64,
}

enum JobOut {
    Region(RegionOut),
    Shard(ShardRecord),
}

/// One written region to read back from the device.
struct ReadBack {
    name: String,
    offset: u64,
    /// The bytes written before the padding (an encoded extent's stored bytes).
    length: u64,
    padded: u64,
    /// Of those bytes.
    blake3: [u8; 32],
    /// An encoded extent, and the BLAKE3 of its decoded bytes: the read-back decodes what it
    /// read and checks that too.
    decoded: Option<(ExpertExtent, [u8; 32])>,
}

/// Bytes written before a batch is handed to the read-back: large enough that syncing it is
/// efficient, small enough that the last, unoverlapped read-back is short.
fn batch_bytes(total: u64) -> u64 {
    (total / 32).clamp(32 << 20, 512 << 20)
}

/// Regions in file order, cut into batches of about [`batch_bytes`].
fn plan_batches(header: &Header) -> Vec<Vec<Job>> {
    let mut regions: Vec<(u64, u64, Job)> = header
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.offset, t.length, Job::Tensor(i)))
        .chain(
            header
                .experts
                .iter()
                .enumerate()
                .map(|(i, e)| (e.offset, e.padded_length, Job::Expert(i))),
        )
        .collect();
    regions.sort_by_key(|r| r.0);
    let limit = batch_bytes(regions.iter().map(|r| r.1).sum());
    let mut batches: Vec<Vec<Job>> = vec![Vec::new()];
    let mut size = 0;
    for (_, len, job) in regions {
        if size >= limit {
            batches.push(Vec::new());
            size = 0;
        }
        size += len;
        batches.last_mut().expect("non-empty").push(job);
    }
    // Largest jobs first within a batch, so that the cores finish it together.
    for b in &mut batches {
        b.sort_by_key(|j| {
            std::cmp::Reverse(match *j {
                Job::Shard(_) => u64::MAX,
                Job::Tensor(i) => header.tensors[i].length,
                Job::Expert(i) => header.experts[i].length,
            })
        });
    }
    batches
}

fn run_job(
    job: &Job,
    header: &Header,
    src: &dyn RegionSource,
    out: &File,
    jnf_path: &Path,
    hashed: &AtomicU64,
    bar: &indicatif::ProgressBar,
) -> Result<JobOut, ConvertError> {
    if interrupted() {
        return Err(ConvertError::Interrupted);
    }
    let (offset, length, padded) = match *job {
        Job::Shard(i) => {
            let rec = src.hash_shard(i)?;
            hashed.fetch_add(rec.size, Ordering::Relaxed);
            bar.inc(rec.size);
            return Ok(JobOut::Shard(rec));
        }
        Job::Tensor(i) => {
            let t = &header.tensors[i];
            (t.offset, t.length, align_up(t.length).expect("validated"))
        }
        Job::Expert(i) => {
            let e = &header.experts[i];
            (e.offset, e.length, e.padded_length)
        }
    };
    // Take the buffer out of the cell for the duration: filling may run nested parallel work
    // (the synthetic generator does), and rayon can then start another job on this thread,
    // which must find the cell free rather than borrowed.
    let mut buf = SCRATCH.with(|cell| std::mem::take(&mut *cell.borrow_mut()));
    let result = (|| {
        // An encoded extent is filled at its decoded length and written at its stored one.
        buf.resize(padded.max(length) as usize, 0);
        buf[length as usize..].fill(0);
        let data = &mut buf[..length as usize];
        let nonfinite = match *job {
            Job::Tensor(i) => {
                let t = &header.tensors[i];
                src.fill_tensor(t, data)?;
                count_nonfinite(t.dtype, data)
            }
            Job::Expert(i) => {
                let e = &header.experts[i];
                src.fill_expert(e, data)?;
                e.matrices
                    .iter()
                    .map(|m| {
                        count_nonfinite(
                            m.dtype,
                            &data[m.offset as usize..(m.offset + m.length) as usize],
                        )
                    })
                    .sum()
            }
            Job::Shard(_) => unreachable!("returned above"),
        };
        // Hash exactly the bytes that are written (or that the stored bytes decode to), from
        // the buffer they are written (or encoded) from.
        let sha256: [u8; 32] = Sha256::digest(&*data).into();
        let blake3: [u8; 32] = *blake3::hash(data).as_bytes();
        let stored_blake3 = match *job {
            Job::Expert(i) if header.experts[i].is_encoded() => {
                let e = &header.experts[i];
                let mut stored = encode_extent(e, data)?;
                if stored.len() as u64 != e.stored_length {
                    return Err(ConvertError::Verify {
                        path: jnf_path.to_path_buf(),
                        name: e.prefix.clone(),
                        what: "encoded again, the extent has another size than when it was planned (the source changed, or the encoder is not deterministic)",
                    });
                }
                let stored_blake3 = *blake3::hash(&stored).as_bytes();
                stored.resize(padded as usize, 0);
                out.write_all_at(&stored, offset)
                    .map_err(ConvertError::io(jnf_path, "write"))?;
                Some(stored_blake3)
            }
            _ => {
                out.write_all_at(&buf[..padded as usize], offset)
                    .map_err(ConvertError::io(jnf_path, "write"))?;
                None
            }
        };
        hashed.fetch_add(length, Ordering::Relaxed);
        bar.inc(length);
        Ok(JobOut::Region(RegionOut {
            sha256,
            blake3,
            stored_blake3,
            nonfinite,
        }))
    })();
    SCRATCH.with(|cell| *cell.borrow_mut() = buf);
    result
}

/// NaN and infinite elements of little-endian IEEE data: the exponent bits all ones.
pub fn count_nonfinite(dtype: Dtype, bytes: &[u8]) -> u64 {
    fn count<const N: usize>(bytes: &[u8], exp: u64) -> u64 {
        bytes
            .chunks_exact(N)
            .filter(|c| {
                let mut v = [0u8; 8];
                v[..N].copy_from_slice(c);
                u64::from_le_bytes(v) & exp == exp
            })
            .count() as u64
    }
    match dtype {
        Dtype::BF16 => count::<2>(bytes, 0x7f80),
        Dtype::F16 => count::<2>(bytes, 0x7c00),
        Dtype::F32 => count::<4>(bytes, 0x7f80_0000),
        Dtype::F64 => count::<8>(bytes, 0x7ff0_0000_0000_0000),
        // MXFP4 blocks and e8m0 scales: not IEEE elements (a NaN scale is refused when run).
        Dtype::U8 => 0,
    }
}

/// The read-back stage: for each batch the writers finished, push its range to the device
/// (sync_file_range), then read every region back bypassing the page cache and check its BLAKE3
/// and zero padding, several reads in flight, while the writers go on with the next batch.
fn read_back_batches(
    file: &File,
    jnf_path: &Path,
    mode: ReadMode,
    batches: mpsc::Receiver<Vec<ReadBack>>,
) -> Result<(), ConvertError> {
    // The read-back waits on the device far more than it hashes (BLAKE3 runs at several GB/s
    // per core): keep several reads in flight, whatever the core count.
    let readers = rayon::ThreadPoolBuilder::new()
        .num_threads(READ_BACK_DEPTH.max(rayon::current_num_threads()))
        .thread_name(|i| format!("tarfa-readback-{i}"))
        .build()
        .map_err(|e| {
            ConvertError::io(jnf_path, "start read-back threads")(std::io::Error::other(e))
        })?;
    for batch in batches {
        let (Some(start), Some(end)) = (
            batch.iter().map(|r| r.offset).min(),
            batch.iter().map(|r| r.offset + r.padded).max(),
        ) else {
            continue;
        };
        crate::aligned::sync_range(file, start, end - start, mode)
            .map_err(ConvertError::io(jnf_path, "sync to the device"))?;
        readers.install(|| {
            batch.par_iter().try_for_each(|r| {
                if interrupted() {
                    return Err(ConvertError::Interrupted);
                }
                let mut buf = AlignedBuf::new(r.padded as usize);
                crate::aligned::read_at(file, &mut buf, r.offset)
                    .map_err(ConvertError::io(jnf_path, "read back"))?;
                let fail = |what| ConvertError::Verify {
                    path: jnf_path.to_path_buf(),
                    name: r.name.clone(),
                    what,
                };
                if blake3::hash(&buf[..r.length as usize]).as_bytes() != &r.blake3 {
                    return Err(fail(if r.decoded.is_some() {
                        "BLAKE3 of the stored bytes differs"
                    } else {
                        "BLAKE3 differs"
                    }));
                }
                if buf[r.length as usize..].iter().any(|&b| b != 0) {
                    return Err(fail("padding is not zero"));
                }
                if let Some((e, decoded_blake3)) = &r.decoded {
                    let mut decoded = vec![0u8; e.length as usize];
                    e.decode_stored(&buf[..r.length as usize], &mut decoded)
                        .map_err(|_| fail("the stored bytes do not decode"))?;
                    if blake3::hash(&decoded).as_bytes() != decoded_blake3 {
                        return Err(fail("BLAKE3 of the decoded bytes differs"));
                    }
                }
                Ok(())
            })
        })?;
    }
    Ok(())
}

fn absolute(p: &Path) -> Result<PathBuf, ConvertError> {
    if p.is_absolute() {
        Ok(p.to_path_buf())
    } else {
        let cwd = std::env::current_dir().map_err(ConvertError::io(p, "current directory"))?;
        Ok(cwd.join(p))
    }
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), ConvertError> {
    let mut f = File::create(path).map_err(ConvertError::io(path, "create"))?;
    f.write_all(bytes)
        .map_err(ConvertError::io(path, "write"))?;
    f.flush().map_err(ConvertError::io(path, "flush"))?;
    f.sync_all().map_err(ConvertError::io(path, "fsync"))?;
    close_checked(f, path)
}

/// Close `f` and report the error `close` returns (NFS and some FUSE file systems report
/// delayed write errors only there; `drop` would discard it).
fn close_checked(f: File, path: &Path) -> Result<(), ConvertError> {
    use std::os::fd::IntoRawFd;
    let fd = f.into_raw_fd();
    // SAFETY: fd was just released by its owner and is closed exactly once.
    if unsafe { libc::close(fd) } != 0 {
        return Err(ConvertError::io(path, "close")(
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

type Hashes = Option<([u8; 32], [u8; 32])>;

/// The manifest of the bundle being written: every field the runtime trusts (hashes, dtypes,
/// shapes, offsets, the header JSON's digest, the copied files, the versions) sits after the
/// root line, so the root digest binds it.
fn build_manifest(
    spec: &BundleSpec,
    header: HeaderRecord,
    shards: Vec<ShardRecord>,
    files: Vec<FileRecord>,
    tensor_hashes: &[Hashes],
    expert_out: &[Option<RegionOut>],
    nonfinite: &NonfiniteCounts,
) -> Manifest {
    let h = &spec.header;
    let tensors = h
        .tensors
        .iter()
        .zip(tensor_hashes)
        .zip(&nonfinite.tensors)
        .map(|((t, hs), &nonfinite)| {
            let (sha, b3) = hs.expect("every tensor was written");
            TensorRecord {
                name: t.name.clone(),
                dtype: t.dtype.to_string(),
                shape: t.shape.clone(),
                offset: t.offset,
                length: t.length,
                sha256: to_hex(&sha),
                blake3: to_hex(&b3),
                nonfinite,
            }
        })
        .collect();
    // Version 2 records every extent's storage; version 1's records are as they always were.
    let codecs = h.major >= 2;
    let experts = h
        .experts
        .iter()
        .zip(expert_out)
        .zip(&nonfinite.experts)
        .map(|((e, out), &nonfinite)| {
            let out = out.as_ref().expect("every expert was written");
            let (sha, b3, stored) = (out.sha256, out.blake3, out.stored_blake3);
            let (relayout, sources) = spec
                .expert_sources
                .get(&(e.layer, e.expert))
                .cloned()
                .unwrap_or_default();
            ExpertRecord {
                relayout,
                sources,
                name: e.prefix.clone(),
                layer: e.layer,
                expert: e.expert,
                offset: e.offset,
                length: e.length,
                padded_length: e.padded_length,
                sha256: to_hex(&sha),
                blake3: to_hex(&b3),
                nonfinite,
                codec: codecs.then(|| e.codec.as_str().to_string()),
                stored_length: codecs.then_some(e.stored_length),
                // Raw, the stored bytes are the extent: the same BLAKE3.
                stored_blake3: codecs.then(|| to_hex(&stored.unwrap_or(b3))),
                matrices: e
                    .matrices
                    .iter()
                    .map(|m| MatrixRecord {
                        role: m.role,
                        name: m.name.clone(),
                        dtype: m.dtype.to_string(),
                        shape: m.shape.clone(),
                        offset: m.offset,
                        length: m.length,
                    })
                    .collect(),
            }
        })
        .collect();
    let mut m = Manifest {
        root_digest: String::new(),
        computed_root: String::new(),
        manifest_version: manifest_version_for(h.major)
            .expect("this crate writes versions 1 and 2"),
        format_version: format!("{}.{}", h.major, h.minor),
        contract_version: CONTRACT_VERSION,
        converter: spec.converter.clone(),
        header,
        source: spec.source.clone(),
        shards,
        files,
        tensors,
        experts,
    };
    m.seal();
    m
}

/// Re-open what was written and check the parts the regions' read-back does not cover: the
/// header validates, the manifest re-reads equal to what was built (root digest included), and
/// every copied file's SHA-256.
fn verify_written(dir: &Path, manifest: &Manifest) -> Result<(), ConvertError> {
    let jnf_path = dir.join(CONTAINER_FILE);
    jnf_format::JnfFile::open(&jnf_path).map_err(|e| ConvertError::Verify {
        path: jnf_path.clone(),
        name: "header".into(),
        what: match e {
            jnf_format::JnfError::Io(_) => "unreadable",
            _ => "header does not validate",
        },
    })?;
    let reread = Manifest::load(&dir.join(MANIFEST_FILE)).map_err(|_| ConvertError::Verify {
        path: dir.join(MANIFEST_FILE),
        name: "manifest".into(),
        what: "manifest does not parse",
    })?;
    if reread != *manifest || reread.check_root().is_err() {
        return Err(ConvertError::Verify {
            path: dir.join(MANIFEST_FILE),
            name: "manifest".into(),
            what: "manifest changed",
        });
    }
    for f in &manifest.files {
        let path = dir.join(&f.name);
        let bytes = fs::read(&path).map_err(ConvertError::io(&path, "read back"))?;
        if to_hex(&Sha256::digest(&bytes)) != f.sha256 {
            return Err(ConvertError::Verify {
                path,
                name: f.name.clone(),
                what: "SHA-256 differs",
            });
        }
    }
    Ok(())
}
