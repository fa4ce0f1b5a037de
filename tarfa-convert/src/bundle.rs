//! Writing a bundle atomically: temporary directory, parallel copy-and-hash, fsync, read-back
//! verification from the device, then one rename.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use jnf_format::{align_up, ExpertExtent, Header, TensorEntry, CONTAINER_FILE};
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use tarfa_manifest::hash::to_hex;
use tarfa_manifest::{
    ExpertRecord, FileRecord, HeaderRecord, Manifest, MatrixRecord, ShardRecord, TensorRecord,
    CONTRACT_VERSION, MANIFEST_FILE, MANIFEST_VERSION,
};

use crate::aligned::{open_uncached, AlignedBuf, ReadMode};
use crate::progress::bytes_bar;
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
}

/// A small file copied into the bundle unchanged (config, tokenizer).
pub struct CopiedFile {
    pub name: String,
    pub bytes: Vec<u8>,
}

/// Everything needed to write a bundle besides the region bytes.
pub struct BundleSpec {
    pub header: Header,
    pub files: Vec<CopiedFile>,
    pub source: BTreeMap<String, String>,
    pub converter: String,
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

fn free_space(dir: &Path) -> std::io::Result<u64> {
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

enum Job {
    Tensor(usize),
    Expert(usize),
    Shard(usize),
}

enum JobOut {
    Region { sha256: [u8; 32], blake3: [u8; 32] },
    Shard(ShardRecord),
}

thread_local! {
    static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Write a bundle at `target`. See the module doc for the sequence; on any error or interrupt
/// the temporary directory is removed and `target` is untouched.
pub fn write_bundle(
    target: &Path,
    force: bool,
    spec: BundleSpec,
    src: &dyn RegionSource,
) -> Result<WriteSummary, ConvertError> {
    let target = absolute(target)?;
    let parent = target
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("/"));
    let base = target
        .file_name()
        .ok_or_else(|| ConvertError::Usage(format!("{}: not a directory name", target.display())))?
        .to_string_lossy()
        .into_owned();
    fs::create_dir_all(&parent).map_err(ConvertError::io(&parent, "create directory"))?;
    if target.exists() && !force {
        return Err(ConvertError::TargetExists(target));
    }
    let removed_stale = stale_temporaries(&parent, &base);
    for p in &removed_stale {
        fs::remove_dir_all(p).map_err(ConvertError::io(p, "remove stale temporary"))?;
    }

    let header = &spec.header;
    let files_bytes: u64 = spec.files.iter().map(|f| f.bytes.len() as u64).sum();
    // The manifest is about 400 bytes an entry.
    let manifest_estimate = 4096 + 400 * (header.tensors.len() + header.experts.len()) as u64;
    let need = header.file_size + files_bytes + manifest_estimate;
    let have = free_space(&parent).map_err(ConvertError::io(&parent, "statvfs"))?;
    if need > have {
        return Err(ConvertError::NoSpace {
            dir: parent,
            need,
            have,
        });
    }

    let tmp = parent.join(format!(".{base}{TMP_MARK}{}", std::process::id()));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(ConvertError::io(&tmp, "remove old temporary"))?;
    }
    fs::create_dir(&tmp).map_err(ConvertError::io(&tmp, "create temporary directory"))?;
    let mut guard = TempGuard(Some(tmp.clone()));

    // ---- copy and hash ----
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

    let mut jobs: Vec<Job> = (0..src.shard_count()).map(Job::Shard).collect();
    // Largest regions first so that the two cores finish together.
    let mut regions: Vec<(u64, Job)> = header
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.length, Job::Tensor(i)))
        .chain(
            header
                .experts
                .iter()
                .enumerate()
                .map(|(i, e)| (e.length, Job::Expert(i))),
        )
        .collect();
    regions.sort_by_key(|r| std::cmp::Reverse(r.0));
    jobs.extend(regions.into_iter().map(|(_, j)| j));

    let shard_total: u64 = (0..src.shard_count()).map(|i| src.shard_size(i)).sum();
    let data_bytes: u64 = header.tensors.iter().map(|t| t.length).sum::<u64>()
        + header.experts.iter().map(|e| e.length).sum::<u64>();
    let bar = bytes_bar(data_bytes + shard_total, "convert");
    let hashed = AtomicU64::new(0);

    let results: Vec<JobOut> = jobs
        .par_iter()
        .map(|job| -> Result<JobOut, ConvertError> {
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
            // Take the buffer out of the cell for the duration: filling may run nested parallel
            // work (the synthetic generator does), and rayon can then start another job on this
            // thread, which must find the cell free rather than borrowed.
            let mut buf = SCRATCH.with(|cell| std::mem::take(&mut *cell.borrow_mut()));
            let result = (|| {
                buf.resize(padded as usize, 0);
                buf[length as usize..].fill(0);
                let data = &mut buf[..length as usize];
                match *job {
                    Job::Tensor(i) => src.fill_tensor(&header.tensors[i], data)?,
                    Job::Expert(i) => src.fill_expert(&header.experts[i], data)?,
                    Job::Shard(_) => unreachable!(),
                }
                let sha256: [u8; 32] = Sha256::digest(&*data).into();
                let blake3: [u8; 32] = *blake3::hash(data).as_bytes();
                out.write_all_at(&buf, offset)
                    .map_err(ConvertError::io(&jnf_path, "write"))?;
                hashed.fetch_add(length, Ordering::Relaxed);
                bar.inc(length);
                Ok(JobOut::Region { sha256, blake3 })
            })();
            SCRATCH.with(|cell| *cell.borrow_mut() = buf);
            result
        })
        .collect::<Result<_, _>>()?;
    bar.finish_and_clear();
    let write_time = t0.elapsed();

    // Results come back in job order; map them to their entries.
    let mut tensor_hashes = vec![None; header.tensors.len()];
    let mut expert_hashes = vec![None; header.experts.len()];
    let mut shards = Vec::new();
    for (job, out) in jobs.iter().zip(results) {
        match (job, out) {
            (Job::Tensor(i), JobOut::Region { sha256, blake3 }) => {
                tensor_hashes[*i] = Some((sha256, blake3))
            }
            (Job::Expert(i), JobOut::Region { sha256, blake3 }) => {
                expert_hashes[*i] = Some((sha256, blake3))
            }
            (Job::Shard(_), JobOut::Shard(rec)) => shards.push(rec),
            _ => unreachable!("job kinds match their outputs"),
        }
    }
    shards.sort_by(|a, b| a.name.cmp(&b.name));

    // ---- durability ----
    let t1 = Instant::now();
    out.sync_all()
        .map_err(ConvertError::io(&jnf_path, "fsync"))?;
    drop(out);
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
        &expert_hashes,
    );
    let manifest_path = tmp.join(MANIFEST_FILE);
    write_synced(&manifest_path, manifest.to_toml().as_bytes())?;
    fsync_dir(&tmp)?;
    let sync_time = t1.elapsed();

    // ---- read back from the device and verify ----
    let t2 = Instant::now();
    let read_mode = verify_written(&tmp, &manifest)?;
    let verify_time = t2.elapsed();

    // ---- publish ----
    if interrupted() {
        return Err(ConvertError::Interrupted);
    }
    if target.exists() {
        // Only reachable with --force: move the old bundle aside, then swap.
        let old = parent.join(format!(".{base}{OLD_MARK}{}", std::process::id()));
        fs::rename(&target, &old).map_err(ConvertError::io(&target, "move old bundle aside"))?;
        fs::rename(&tmp, &target).map_err(ConvertError::io(&target, "rename into place"))?;
        let _ = fs::remove_dir_all(&old);
    } else {
        fs::rename(&tmp, &target).map_err(ConvertError::io(&target, "rename into place"))?;
    }
    guard.0 = None;
    fsync_dir(&parent)?;

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
    })
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
    f.sync_all().map_err(ConvertError::io(path, "fsync"))
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
    expert_hashes: &[Hashes],
) -> Manifest {
    let h = &spec.header;
    let tensors = h
        .tensors
        .iter()
        .zip(tensor_hashes)
        .map(|(t, hs)| {
            let (sha, b3) = hs.expect("every tensor was written");
            TensorRecord {
                name: t.name.clone(),
                dtype: t.dtype.to_string(),
                shape: t.shape.clone(),
                offset: t.offset,
                length: t.length,
                sha256: to_hex(&sha),
                blake3: to_hex(&b3),
                nonfinite: 0,
            }
        })
        .collect();
    let experts = h
        .experts
        .iter()
        .zip(expert_hashes)
        .map(|(e, hs)| {
            let (sha, b3) = hs.expect("every expert was written");
            ExpertRecord {
                name: e.prefix.clone(),
                layer: e.layer,
                expert: e.expert,
                offset: e.offset,
                length: e.length,
                padded_length: e.padded_length,
                sha256: to_hex(&sha),
                blake3: to_hex(&b3),
                nonfinite: 0,
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
        manifest_version: MANIFEST_VERSION,
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

/// Re-open what was written, bypassing the page cache, and check every region's BLAKE3 and zero
/// padding against the manifest, and every copied file's SHA-256.
fn verify_written(dir: &Path, manifest: &Manifest) -> Result<ReadMode, ConvertError> {
    let jnf_path = dir.join(CONTAINER_FILE);
    let jnf = jnf_format::JnfFile::open(&jnf_path).map_err(|e| ConvertError::Verify {
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
    let header = jnf.header();
    let (file, mode) =
        open_uncached(&jnf_path).map_err(ConvertError::io(&jnf_path, "open for read-back"))?;
    // (name, offset, length, padded, expected blake3 hex)
    let mut regions: Vec<(&str, u64, u64, u64, &str)> = Vec::new();
    for (t, rec) in header.tensors.iter().zip(&manifest.tensors) {
        regions.push((
            &t.name,
            t.offset,
            t.length,
            align_up(t.length).expect("validated"),
            &rec.blake3,
        ));
    }
    for (e, rec) in header.experts.iter().zip(&manifest.experts) {
        regions.push((&e.prefix, e.offset, e.length, e.padded_length, &rec.blake3));
    }
    let total: u64 = regions.iter().map(|r| r.3).sum();
    let bar = bytes_bar(total, "verify");
    // The read-back waits on the device far more than it hashes (BLAKE3 runs at several GB/s
    // per core): keep several reads in flight, whatever the core count.
    let readers = rayon::ThreadPoolBuilder::new()
        .num_threads(READ_BACK_DEPTH.max(rayon::current_num_threads()))
        .thread_name(|i| format!("tarfa-readback-{i}"))
        .build()
        .map_err(|e| {
            ConvertError::io(&jnf_path, "start read-back threads")(std::io::Error::other(e))
        })?;
    readers.install(|| {
        regions
            .par_iter()
            .try_for_each(|&(name, offset, length, padded, expected)| {
                if interrupted() {
                    return Err(ConvertError::Interrupted);
                }
                let mut buf = AlignedBuf::new(padded as usize);
                crate::aligned::read_at(&file, &mut buf, offset)
                    .map_err(ConvertError::io(&jnf_path, "read back"))?;
                let fail = |what| ConvertError::Verify {
                    path: jnf_path.clone(),
                    name: name.into(),
                    what,
                };
                if blake3::hash(&buf[..length as usize]).to_hex().as_str() != expected {
                    return Err(fail("BLAKE3 differs"));
                }
                if buf[length as usize..].iter().any(|&b| b != 0) {
                    return Err(fail("padding is not zero"));
                }
                bar.inc(padded);
                Ok(())
            })
    })?;
    bar.finish_and_clear();
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
    Ok(mode)
}
