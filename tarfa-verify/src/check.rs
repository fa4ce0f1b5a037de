//! `tarfa-verify check`: every byte of a bundle against its manifest, and optionally against the
//! source checkpoint it was converted from.
//!
//! The order of work: open the container (header fully validated) and the manifest; check the
//! root digest; match header and manifest entry for entry; then one parallel pass over the data
//! region in file order, each work item a tensor or an expert extent followed by its padding (so
//! that every byte from the end of the header JSON to the end of the file is either hashed or
//! checked to be zero); then the copied files and, with a source, every source shard's whole-file
//! SHA-256.
//!
//! An extent stored encoded (format version 2) is read whole, its stored bytes' BLAKE3 checked
//! against the manifest's `stored_blake3` (a mismatch names the expert and nothing is decoded),
//! then decoded, and the decoded bytes go through everything a raw extent's bytes go through:
//! SHA-256 and BLAKE3 against the manifest, and with `--source` the source's bytes.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File};
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use jnf_format::{
    Header, JnfFile, Relayout, SourceRef, CONTAINER_FILE, MAX_HEADER_LEN, PREAMBLE_LEN,
};
use rayon::prelude::*;
use serde::Serialize;
use sha2::{Digest, Sha256};
use tarfa_checkpoint::{Checkpoint, OpenOptions};
use tarfa_manifest::hash::to_hex;
use tarfa_manifest::regular::open_regular;
use tarfa_manifest::{HeaderRecord, Manifest, MANIFEST_FILE};

use crate::bundle::BundlePaths;
use crate::{Failure, FailureKind, VerifyError};

/// Bytes read per `pread`; also the size of each thread's two buffers.
const CHUNK: usize = 4 << 20;

#[derive(Debug, Clone, Default)]
pub struct CheckOptions {
    /// The source checkpoint directory, to prove bit identity against.
    pub source: Option<PathBuf>,
    /// Draw a progress bar on stderr (the caller decides: only when stderr is a terminal).
    pub progress: bool,
}

/// The verdict. `failures` is in a stable order: structure, then data in file order, then
/// copied files, then source shards.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CheckReport {
    pub ok: bool,
    pub failures: Vec<Failure>,
    /// What an auditor should know that is not a failure: tensors and experts the manifest
    /// records as holding NaN or infinite elements (carried bit for bit, as in the source).
    pub notes: Vec<Note>,
    /// Bytes read and checked: the container's data region (hashed or checked to be zero), the
    /// copied files and, with a source, the source tensors compared and the shards hashed.
    pub checked_bytes: u64,
    #[serde(skip)]
    pub counts: Counts,
}

/// A remark about an entry that verified: `name` as in a [`Failure`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Note {
    pub name: String,
    pub detail: String,
}

/// What was looked at, for the summary line.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counts {
    pub tensors: usize,
    pub experts: usize,
    pub files: usize,
    pub shards: usize,
}

/// Where a run of bundle bytes came from in the source: an index into the opened shards.
#[derive(Debug, Clone, Copy)]
struct SourceLoc {
    shard: usize,
    offset: u64,
}

/// One tensor, or one matrix of an extent: a run of bytes in the bundle.
struct Segment<'a> {
    name: &'a str,
    len: u64,
    source: Option<SourceLoc>,
}

/// A fused expert's source: its byte ranges of the fused tensors (shard index, offset,
/// length), in extent order, and the declared permutation that made the extent from them
/// concatenated, with `(H, I)` (none: the extent is those bytes as they are).
struct FusedSource {
    ranges: Vec<(usize, u64, u64)>,
    relayout: Option<(Relayout, usize, usize)>,
}

/// An extent stored encoded: checked as stored, then decoded.
struct Stored<'a> {
    extent: &'a jnf_format::ExpertExtent,
    /// The manifest's `stored_blake3`, when the manifest has the entry.
    blake3: Option<&'a str>,
}

/// A tensor or an extent, then its padding: `[offset, offset + length)` is hashed,
/// `[offset + length, tail_end)` must be zero (for an encoded extent, its stored bytes are
/// hashed and decoded, and its padding starts after them).
struct Item<'a> {
    /// An encoded extent's storage (`None`: the bytes in the file are the item's bytes).
    stored: Option<Stored<'a>>,
    /// A fused expert's source, compared after the permutation (with `--source`).
    fused: Option<FusedSource>,
    name: &'a str,
    offset: u64,
    segments: Vec<Segment<'a>>,
    tail_end: u64,
    /// The manifest's (SHA-256, BLAKE3), when the manifest has the entry.
    expected: Option<(&'a str, &'a str)>,
}

/// A source shard opened by us, at the path the checkpoint validated.
struct OpenShard {
    name: String,
    file: File,
    size: u64,
}

/// Check the bundle in `dir`. `Err` only for "not a bundle", a refused source, and I/O errors.
pub fn check_bundle(dir: &Path, opts: &CheckOptions) -> Result<CheckReport, VerifyError> {
    let paths = BundlePaths::locate(dir)?;
    let mut failures = Vec::new();
    let container = paths.open_container()?.map_err(|f| failures.push(f)).ok();
    let manifest = paths.load_manifest()?.map_err(|f| failures.push(f)).ok();

    if let Some(m) = &manifest {
        if let Err(e) = m.check_root() {
            failures.push(Failure::new(
                MANIFEST_FILE,
                FailureKind::RootDigest,
                e.to_string(),
            ));
        }
    }
    if let (Some(c), Some(m)) = (&container, &manifest) {
        let on_disk = HeaderRecord::read_from(c.file(), MAX_HEADER_LEN)
            .map_err(|e| VerifyError::io(c.path(), "reading the header", e))?;
        if on_disk != m.header {
            failures.push(Failure::new(
                CONTAINER_FILE,
                FailureKind::HeaderDigestMismatch,
                format!(
                    "the manifest records header JSON of {} bytes with SHA-256 {}, model.jnf has {} bytes with SHA-256 {}",
                    m.header.length, m.header.sha256, on_disk.length, on_disk.sha256
                ),
            ));
        }
        compare_header_manifest(c.header(), m, &mut failures);
    }

    let source = match &opts.source {
        Some(src) => Some(open_source(src)?),
        None => None,
    };
    let shards = match &source {
        Some(ck) => open_shards(ck)?,
        None => Vec::new(),
    };
    if let (Some(ck), Some(c)) = (&source, &container) {
        compare_tensor_sets(ck, c.header(), manifest.as_ref(), &mut failures);
    }

    let checked = AtomicU64::new(0);
    let mut counts = Counts::default();
    if let Some(c) = &container {
        let h = c.header();
        counts.tensors = h.tensors.len();
        counts.experts = h.experts.len();
        let items = plan_items(
            h,
            manifest.as_ref(),
            source.as_ref(),
            &shards,
            &mut failures,
        );
        let header_tail = header_padding(c)?;
        let total: u64 = items
            .iter()
            .map(|it| {
                let src: u64 = it
                    .segments
                    .iter()
                    .filter(|s| s.source.is_some())
                    .map(|s| s.len)
                    .sum();
                it.tail_end.saturating_sub(it.offset) + src
            })
            .sum::<u64>()
            + shards.iter().map(|s| s.size).sum::<u64>();
        let bar = progress_bar(opts.progress, total);
        if let Some(f) = check_zero(c.file(), CONTAINER_FILE, header_tail.0, header_tail.1)? {
            failures.push(f);
        }
        checked.fetch_add(
            header_tail.1.saturating_sub(header_tail.0),
            Ordering::Relaxed,
        );
        let results: Vec<Result<Vec<Failure>, VerifyError>> = items
            .par_iter()
            .map_init(
                || (vec![0u8; CHUNK], vec![0u8; CHUNK]),
                |(buf, sbuf), item| check_item(c, &shards, item, buf, sbuf, &bar, &checked),
            )
            .collect();
        for r in results {
            failures.extend(r?);
        }
        if source.is_some() {
            failures.extend(check_shards(&shards, manifest.as_ref(), &bar, &checked)?);
        }
        bar.finish_and_clear();
    } else if source.is_some() {
        let bar = progress_bar(false, 0);
        failures.extend(check_shards(&shards, manifest.as_ref(), &bar, &checked)?);
    }
    if let Some(ck) = &source {
        counts.shards = ck.shards.len();
    }

    let mut notes = Vec::new();
    if let Some(m) = &manifest {
        counts.files = m.files.len();
        failures.extend(check_files(&paths, m, &checked)?);
        if let Some(ck) = &source {
            failures.extend(compare_copied_files(ck, m, &checked)?);
        }
        notes = nonfinite_notes(m);
        notes.extend(mxfp4_note(m));
        notes.extend(codec_note(m));
    }

    Ok(CheckReport {
        ok: failures.is_empty(),
        failures,
        notes,
        checked_bytes: checked.into_inner(),
        counts,
    })
}

fn progress_bar(enabled: bool, total: u64) -> ProgressBar {
    if !enabled {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
    )
    .expect("the template is valid");
    bar.set_style(style);
    bar
}

// ---- structure -------------------------------------------------------------------------------

/// The header and the manifest describe the same tensors and experts, the same format version,
/// and only source shards the manifest lists.
fn compare_header_manifest(h: &Header, m: &Manifest, out: &mut Vec<Failure>) {
    let mismatch = |name: &str, detail: String| {
        Failure::new(name, FailureKind::HeaderManifestMismatch, detail)
    };
    let version = format!("{}.{}", h.major, h.minor);
    if m.format_version != version {
        out.push(mismatch(
            MANIFEST_FILE,
            format!(
                "manifest says format_version {:?}, model.jnf is {version}",
                m.format_version
            ),
        ));
    }

    let m_tensors: HashMap<&str, _> = m.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let m_experts: HashMap<&str, _> = m.experts.iter().map(|e| (e.name.as_str(), e)).collect();
    let h_experts: HashSet<&str> = h.experts.iter().map(|e| e.prefix.as_str()).collect();
    // Source shards the header names but the manifest does not list: one failure per shard.
    let shards: HashSet<&str> = m.shards.iter().map(|s| s.name.as_str()).collect();
    let mut unlisted: BTreeMap<&str, (usize, &str)> = BTreeMap::new();
    let sources = h
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), &t.source))
        .chain(
            h.experts
                .iter()
                .flat_map(|e| e.matrices.iter().map(|m| (m.name.as_str(), &m.source))),
        );
    for (name, src) in sources {
        if let Some(s) = src.as_ref().filter(|s| !shards.contains(s.shard.as_str())) {
            unlisted.entry(s.shard.as_str()).or_insert((0, name)).0 += 1;
        }
    }
    for (shard, (n, first)) in unlisted {
        out.push(mismatch(
            shard,
            format!(
                "model.jnf names this source shard for {n} tensors (first {first}), \
                 but the manifest does not list it"
            ),
        ));
    }

    for t in &h.tensors {
        let Some(r) = m_tensors.get(t.name.as_str()) else {
            let detail = if m_experts.contains_key(t.name.as_str()) {
                "a tensor in model.jnf but an expert in the manifest"
            } else {
                "in model.jnf but not in the manifest"
            };
            out.push(Failure::new(
                &t.name,
                FailureKind::MissingInManifest,
                detail,
            ));
            continue;
        };
        if r.dtype != t.dtype.as_str()
            || r.shape != t.shape
            || r.length != t.length
            || r.offset != t.offset
        {
            out.push(mismatch(
                &t.name,
                format!(
                    "model.jnf has {} {:?} ({} bytes at offset {}), the manifest {} {:?} ({} bytes at offset {})",
                    t.dtype, t.shape, t.length, t.offset, r.dtype, r.shape, r.length, r.offset
                ),
            ));
        }
    }
    for e in &h.experts {
        let Some(r) = m_experts.get(e.prefix.as_str()) else {
            out.push(Failure::new(
                &e.prefix,
                FailureKind::MissingInManifest,
                "expert in model.jnf but not in the manifest",
            ));
            continue;
        };
        let mut why = Vec::new();
        if (r.layer, r.expert) != (e.layer, e.expert) {
            why.push(format!(
                "model.jnf says layer {} expert {}, the manifest layer {} expert {}",
                e.layer, e.expert, r.layer, r.expert
            ));
        }
        if r.length != e.length {
            why.push(format!(
                "model.jnf says {} bytes, the manifest {}",
                e.length, r.length
            ));
        }
        if (r.offset, r.padded_length) != (e.offset, e.padded_length) {
            why.push(format!(
                "model.jnf places it at offset {} ({} bytes padded), the manifest at {} ({})",
                e.offset, e.padded_length, r.offset, r.padded_length
            ));
        }
        // A version-2 manifest records how each extent is stored; version 1's are raw.
        let (codec, stored) = (
            r.codec.as_deref().unwrap_or("raw"),
            r.stored_length.unwrap_or(r.length),
        );
        if (codec, stored) != (e.codec.as_str(), e.stored_length) {
            why.push(format!(
                "model.jnf stores it {} in {} bytes, the manifest {codec} in {stored}",
                e.codec, e.stored_length
            ));
        }
        let same_matrices = r.matrices.len() == e.matrices.len()
            && r.matrices.iter().zip(&e.matrices).all(|(rm, hm)| {
                rm.role == hm.role
                    && rm.name == hm.name
                    && rm.dtype == hm.dtype.as_str()
                    && rm.shape == hm.shape
                    && rm.offset == hm.offset
                    && rm.length == hm.length
            });
        if !same_matrices {
            why.push(
                "its gate, up and down matrices differ (name, dtype, shape or placement)".into(),
            );
        }
        if !why.is_empty() {
            out.push(mismatch(&e.prefix, why.join("; ")));
        }
    }
    for r in &m.tensors {
        if h.tensor(&r.name).is_none() {
            let detail = if h_experts.contains(r.name.as_str()) {
                "a tensor in the manifest but an expert in model.jnf"
            } else {
                "in the manifest but not in model.jnf"
            };
            out.push(Failure::new(&r.name, FailureKind::MissingInBundle, detail));
        }
    }
    for r in &m.experts {
        if !h_experts.contains(r.name.as_str()) {
            out.push(Failure::new(
                &r.name,
                FailureKind::MissingInBundle,
                "expert in the manifest but not in model.jnf",
            ));
        }
    }
}

/// The work list: every tensor and extent in file order, each with the padding after it.
fn plan_items<'a>(
    h: &'a Header,
    m: Option<&'a Manifest>,
    source: Option<&'a Checkpoint>,
    shards: &[OpenShard],
    failures: &mut Vec<Failure>,
) -> Vec<Item<'a>> {
    let m_tensors: HashMap<&str, _> = m
        .map(|m| m.tensors.iter().map(|t| (t.name.as_str(), t)).collect())
        .unwrap_or_default();
    let m_experts: HashMap<&str, _> = m
        .map(|m| m.experts.iter().map(|e| (e.name.as_str(), e)).collect())
        .unwrap_or_default();
    let shard_index: HashMap<&str, usize> = shards
        .iter()
        .enumerate()
        .map(|(i, s)| (s.name.as_str(), i))
        .collect();

    // Where the source checkpoint has a tensor; a disagreement with the header's record (or with
    // the tensor's dtype and shape) is a failure, and the bytes are then compared at the place
    // the checkpoint says, which is the truth about the source.
    let mut locate = |name: &'a str,
                      dtype: &str,
                      shape: &[u64],
                      len: u64,
                      recorded: &Option<SourceRef>|
     -> Option<SourceLoc> {
        let ck = source?;
        let t = ck.tensors.get(name)?; // absence is reported by compare_tensor_sets
        let shard_name = ck.shards.get(t.shard)?.name.as_str();
        let loc = SourceLoc {
            shard: *shard_index.get(shard_name)?,
            offset: t.offset,
        };
        let here = format!("{shard_name:?} at {}", t.offset);
        match recorded {
            None => failures.push(Failure::new(
                name,
                FailureKind::SourceLocationMismatch,
                format!("model.jnf records no source; the source has it in {here}"),
            )),
            Some(r) if r.shard != shard_name || r.offset != t.offset => {
                failures.push(Failure::new(
                    name,
                    FailureKind::SourceLocationMismatch,
                    format!(
                        "model.jnf records {:?} at {}; the source has it in {here}",
                        r.shard, r.offset
                    ),
                ))
            }
            Some(_) => {}
        }
        let src_dtype = t.dtype.to_string();
        if src_dtype != dtype || t.shape != shape || t.len != len {
            failures.push(Failure::new(
                name,
                FailureKind::SourceLocationMismatch,
                format!(
                    "model.jnf has {dtype} {shape:?} ({len} bytes), the source {src_dtype} {:?} ({} bytes)",
                    t.shape, t.len
                ),
            ));
            return None;
        }
        Some(loc)
    };

    let mut items = Vec::with_capacity(h.tensors.len() + h.experts.len());
    for t in &h.tensors {
        items.push(Item {
            name: &t.name,
            offset: t.offset,
            segments: vec![Segment {
                name: &t.name,
                len: t.length,
                source: locate(&t.name, t.dtype.as_str(), &t.shape, t.length, &t.source),
            }],
            tail_end: 0,
            fused: None,
            stored: None,
            expected: m_tensors
                .get(t.name.as_str())
                .map(|r| (r.sha256.as_str(), r.blake3.as_str())),
        });
    }
    let mut fused_failures = Vec::new();
    for e in &h.experts {
        let record = m_experts.get(e.prefix.as_str());
        let stored = || {
            e.is_encoded().then(|| Stored {
                extent: e,
                blake3: record.and_then(|r| r.stored_blake3.as_deref()),
            })
        };
        let fused_ranges = record.map(|r| r.sources.as_slice()).unwrap_or_default();
        if !fused_ranges.is_empty() {
            // A fused expert: its matrices have no tensors of their own in the source; the
            // manifest's ranges of the fused tensors, through the declared permutation, must
            // give the extent's bytes.
            let fused = source
                .and_then(|ck| fused_source(ck, e, record?, &shard_index, &mut fused_failures));
            items.push(Item {
                name: &e.prefix,
                offset: e.offset,
                segments: e
                    .matrices
                    .iter()
                    .map(|mat| Segment {
                        name: &mat.name,
                        len: mat.length,
                        source: None,
                    })
                    .collect(),
                tail_end: 0,
                fused,
                stored: stored(),
                expected: record.map(|r| (r.sha256.as_str(), r.blake3.as_str())),
            });
            continue;
        }
        items.push(Item {
            name: &e.prefix,
            offset: e.offset,
            segments: e
                .matrices
                .iter()
                .map(|mat| Segment {
                    name: &mat.name,
                    len: mat.length,
                    source: locate(
                        &mat.name,
                        mat.dtype.as_str(),
                        &mat.shape,
                        mat.length,
                        &mat.source,
                    ),
                })
                .collect(),
            tail_end: 0,
            fused: None,
            stored: stored(),
            expected: record.map(|r| (r.sha256.as_str(), r.blake3.as_str())),
        });
    }
    failures.extend(fused_failures);
    // Each item's padding runs to the next item's start (or the end of the file): the validated
    // header guarantees no overlap, so this covers every byte after the header exactly once.
    // Zero-length tensors may share an offset with the region that follows them: sorting them
    // first gives them an empty tail, and the region its whole padding.
    items.sort_by_key(|it| (it.offset, it.segments.iter().map(|s| s.len).sum::<u64>()));
    let starts: Vec<u64> = items.iter().map(|it| it.offset).collect();
    for (i, it) in items.iter_mut().enumerate() {
        it.tail_end = starts.get(i + 1).copied().unwrap_or(h.file_size);
    }
    items
}

/// A fused expert's source ranges, checked against the source checkpoint: each names a
/// tensor of the source, in the shard the source has it in, and is the expert's slice of it
/// (E outermost: the `expert`-th of E equal ranges). A disagreement is a failure naming the
/// expert, and its bytes are then not compared.
fn fused_source(
    ck: &Checkpoint,
    e: &jnf_format::ExpertExtent,
    r: &tarfa_manifest::ExpertRecord,
    shard_index: &HashMap<&str, usize>,
    failures: &mut Vec<Failure>,
) -> Option<FusedSource> {
    let experts = u64::from(ck.config.num_experts);
    let mut ranges = Vec::with_capacity(r.sources.len());
    for range in &r.sources {
        let found = ck.tensors.get(&range.tensor).and_then(|t| {
            let shard = ck.shards.get(t.shard)?.name.as_str();
            let per = t.len / experts.max(1);
            let offset = t.offset + u64::from(e.expert) * per;
            Some((shard, offset, per))
        });
        match found {
            Some((shard, offset, per))
                if shard == range.shard && offset == range.offset && per == range.length =>
            {
                ranges.push((*shard_index.get(shard)?, offset, per));
            }
            other => {
                let here = match other {
                    Some((shard, offset, per)) => {
                        format!("the source has that slice in {shard:?} at {offset} ({per} bytes)")
                    }
                    None => "the source has no such tensor".to_string(),
                };
                failures.push(Failure::new(
                    &e.prefix,
                    FailureKind::SourceLocationMismatch,
                    format!(
                        "the manifest records {:?} in {:?} at {} ({} bytes); {here}",
                        range.tensor, range.shard, range.offset, range.length
                    ),
                ));
                return None;
            }
        }
    }
    let relayout = match &r.relayout {
        None => None,
        // The manifest refuses an undeclared name when it is parsed.
        Some(name) => {
            let relayout = Relayout::from_name(name)?;
            let gate = e.matrices.first()?;
            match gate.shape.as_slice() {
                [i, h] => Some((relayout, *h as usize, *i as usize)),
                _ => return None,
            }
        }
    };
    Some(FusedSource { ranges, relayout })
}

/// The first byte at which a fused expert's extent differs from its source ranges put through
/// the declared permutation, as (byte of the extent, the source range it comes from); `None`
/// when they agree.
fn fused_first_diff(
    shards: &[OpenShard],
    f: &FusedSource,
    extent: &[u8],
) -> Result<Option<(u64, String)>, VerifyError> {
    let mut parts = Vec::with_capacity(f.ranges.len());
    for &(shard, offset, len) in &f.ranges {
        let s = &shards[shard];
        let mut buf = vec![0u8; len as usize];
        s.file
            .read_exact_at(&mut buf, offset)
            .map_err(|e| VerifyError::io(&s.name, "reading the source", e))?;
        parts.push(buf);
    }
    let from_source: Vec<u8> = match f.relayout {
        None => parts.concat(),
        Some((relayout, h, i)) => {
            let pairs =
                |b: &[u8]| -> Vec<[u8; 2]> { b.chunks_exact(2).map(|c| [c[0], c[1]]).collect() };
            if parts.len() != 2 || parts[0].len() != 4 * h * i || parts[1].len() != 2 * h * i {
                return Ok(Some((
                    0,
                    "the source ranges are not [H, 2I] and [I, H]".into(),
                )));
            }
            relayout
                .to_extent(&pairs(&parts[0]), &pairs(&parts[1]), h, i)
                .into_iter()
                .flatten()
                .collect()
        }
    };
    if from_source.len() != extent.len() {
        return Ok(Some((
            0,
            format!(
                "the source ranges give {} bytes, the extent holds {}",
                from_source.len(),
                extent.len()
            ),
        )));
    }
    Ok(extent
        .iter()
        .zip(&from_source)
        .position(|(a, b)| a != b)
        .map(|d| {
            let how = match f.relayout {
                Some((r, _, _)) => format!("after the declared permutation {}", r.name()),
                None => "byte for byte (stored as released)".to_string(),
            };
            (
                d as u64,
                format!(
                    "byte {d} of the extent differs from its fused source ({} source ranges, {how})",
                    f.ranges.len()
                ),
            )
        }))
}

/// The bundle's MXFP4 experts, if it has any: stored in the form gpt-oss released them.
fn mxfp4_note(m: &Manifest) -> Option<Note> {
    let mx: Vec<&tarfa_manifest::ExpertRecord> = m
        .experts
        .iter()
        .filter(|e| e.matrices.iter().any(|mm| mm.dtype == "U8"))
        .collect();
    let first = mx.first()?;
    let tensors: std::collections::BTreeSet<&str> = mx
        .iter()
        .flat_map(|e| e.sources.iter().map(|s| s.tensor.as_str()))
        .collect();
    let example = tensors.iter().next().copied().unwrap_or("?");
    Some(Note {
        name: MANIFEST_FILE.to_string(),
        detail: format!(
            "{} experts (first {}) are MXFP4 in the released form, from {} released tensors \
             (e.g. {example}): gpt-oss's U8 blocks and e8m0 scales as released, hashed as \
             stored; the runtime widens them exactly to BF16",
            mx.len(),
            first.name,
            tensors.len()
        ),
    })
}

/// A version-2 bundle's encoded experts: how many, and what they occupy as stored.
fn codec_note(m: &Manifest) -> Option<Note> {
    let encoded: Vec<&tarfa_manifest::ExpertRecord> = m
        .experts
        .iter()
        .filter(|e| e.codec.as_deref().is_some_and(|c| c != "raw"))
        .collect();
    if m.manifest_version < tarfa_manifest::MANIFEST_VERSION_CODECS {
        return None;
    }
    let decoded: u64 = encoded.iter().map(|e| e.length).sum();
    let stored: u64 = encoded.iter().filter_map(|e| e.stored_length).sum();
    Some(Note {
        name: MANIFEST_FILE.to_string(),
        detail: format!(
            "format version {}: {} of {} experts stored encoded (exp-zstd, {stored} bytes for \
             {decoded}), the others raw; each encoded one's stored bytes were checked against \
             stored_blake3 before they were decoded, and the decoded bytes against sha256 and blake3",
            m.format_version,
            encoded.len(),
            m.experts.len(),
        ),
    })
}

/// `[end of header JSON, first data byte)`: the header's zero padding.
fn header_padding(c: &JnfFile) -> Result<(u64, u64), VerifyError> {
    let mut pre = [0u8; PREAMBLE_LEN as usize];
    c.file()
        .read_exact_at(&mut pre, 0)
        .map_err(|e| VerifyError::io(c.path(), "reading the preamble", e))?;
    let json_len = u64::from_le_bytes(pre[16..24].try_into().expect("8 bytes"));
    let h = c.header();
    let first = h
        .tensors
        .iter()
        .map(|t| t.offset)
        .chain(h.experts.iter().map(|e| e.offset))
        .min()
        .unwrap_or(h.file_size);
    // The validated header puts data_start after the JSON and every region after data_start.
    Ok((PREAMBLE_LEN + json_len, first))
}

// ---- data ------------------------------------------------------------------------------------

fn check_item(
    c: &JnfFile,
    shards: &[OpenShard],
    item: &Item<'_>,
    buf: &mut [u8],
    sbuf: &mut [u8],
    bar: &ProgressBar,
    checked: &AtomicU64,
) -> Result<Vec<Failure>, VerifyError> {
    let mut failures = Vec::new();
    // An encoded extent: its stored bytes checked, then decoded into memory; the segments
    // below are then read from the decoded bytes instead of the file.
    let decoded = match &item.stored {
        None => None,
        Some(st) => match read_stored(c, item, st, bar, checked, &mut failures)? {
            Some(bytes) => Some(bytes),
            // Named already; its padding is still checked.
            None => {
                check_padding(c, item, &mut failures, bar, checked)?;
                return Ok(failures);
            }
        },
    };
    let mut sha = Sha256::new();
    let mut b3 = blake3::Hasher::new();
    let mut pos = item.offset;
    let mut extent = Vec::new();
    let mut at = 0usize;
    for seg in &item.segments {
        let mut done = 0u64;
        let mut first_diff = None;
        while done < seg.len {
            let n = (seg.len - done).min(CHUNK as u64) as usize;
            let chunk: &[u8] = match &decoded {
                Some(d) => &d[at..at + n],
                None => {
                    c.file()
                        .read_exact_at(&mut buf[..n], pos + done)
                        .map_err(|e| VerifyError::io(c.path(), "reading", e))?;
                    &buf[..n]
                }
            };
            at += n;
            sha.update(chunk);
            b3.update(chunk);
            if item.fused.is_some() {
                extent.extend_from_slice(chunk);
            }
            // Decoded bytes were counted as the stored bytes they came from.
            let mut read = if decoded.is_some() { 0 } else { n as u64 };
            if let (Some(loc), None) = (seg.source, first_diff) {
                let shard = &shards[loc.shard];
                let src = &mut sbuf[..n];
                shard
                    .file
                    .read_exact_at(src, loc.offset + done)
                    .map_err(|e| VerifyError::io(&shard.name, "reading the source", e))?;
                if let Some(i) = chunk.iter().zip(src.iter()).position(|(a, b)| a != b) {
                    first_diff = Some(done + i as u64);
                }
                read += n as u64;
            }
            bar.inc(read);
            checked.fetch_add(read, Ordering::Relaxed);
            done += n as u64;
        }
        if let (Some(loc), Some(d)) = (seg.source, first_diff) {
            failures.push(Failure::new(
                seg.name,
                FailureKind::SourceBytesDiffer,
                format!(
                    "byte {d} of the tensor differs from source shard {:?} (offset {})",
                    shards[loc.shard].name,
                    loc.offset + d
                ),
            ));
        }
        pos += seg.len;
    }
    if let Some(f) = &item.fused {
        if let Some((_, detail)) = fused_first_diff(shards, f, &extent)? {
            failures.push(Failure::new(
                item.name,
                FailureKind::SourceBytesDiffer,
                detail,
            ));
        }
        let read: u64 = f.ranges.iter().map(|r| r.2).sum();
        bar.inc(read);
        checked.fetch_add(read, Ordering::Relaxed);
    }
    check_padding(c, item, &mut failures, bar, checked)?;
    if let Some((want_sha, want_b3)) = item.expected {
        let got_sha = to_hex(&sha.finalize());
        if got_sha != want_sha {
            failures.push(Failure::new(
                item.name,
                FailureKind::Sha256Mismatch,
                format!("manifest {want_sha}, model.jnf {got_sha}"),
            ));
        }
        let got_b3 = b3.finalize().to_hex().to_string();
        if got_b3 != want_b3 {
            failures.push(Failure::new(
                item.name,
                FailureKind::Blake3Mismatch,
                format!("manifest {want_b3}, model.jnf {got_b3}"),
            ));
        }
    }
    Ok(failures)
}

/// The item's padding: from the end of its bytes in the file (an encoded extent's stored
/// bytes) to the next item, all zero.
fn check_padding(
    c: &JnfFile,
    item: &Item<'_>,
    failures: &mut Vec<Failure>,
    bar: &ProgressBar,
    checked: &AtomicU64,
) -> Result<(), VerifyError> {
    let end = item.offset
        + match &item.stored {
            Some(st) => st.extent.stored_length,
            None => item.segments.iter().map(|s| s.len).sum(),
        };
    if let Some(f) = check_zero(c.file(), item.name, end, item.tail_end)? {
        failures.push(f);
    }
    let padding = item.tail_end.saturating_sub(end);
    bar.inc(padding);
    checked.fetch_add(padding, Ordering::Relaxed);
    Ok(())
}

/// An encoded extent's stored bytes, checked against the manifest's `stored_blake3` and then
/// decoded. `None` (with a failure naming the expert) when they do not verify, or verify and
/// do not decode: a corrupt extent is named before any of it is decoded.
fn read_stored(
    c: &JnfFile,
    item: &Item<'_>,
    st: &Stored<'_>,
    bar: &ProgressBar,
    checked: &AtomicU64,
    failures: &mut Vec<Failure>,
) -> Result<Option<Vec<u8>>, VerifyError> {
    let mut stored = vec![0u8; st.extent.stored_length as usize];
    c.file()
        .read_exact_at(&mut stored, item.offset)
        .map_err(|e| VerifyError::io(c.path(), "reading", e))?;
    bar.inc(stored.len() as u64);
    checked.fetch_add(stored.len() as u64, Ordering::Relaxed);
    if let Some(want) = st.blake3 {
        let got = blake3::hash(&stored).to_hex();
        if got.as_str() != want {
            failures.push(Failure::new(
                item.name,
                FailureKind::StoredBlake3Mismatch,
                format!(
                    "BLAKE3 of the stored extent ({}, {} bytes): manifest {want}, model.jnf \
                     {got}; not decoded",
                    st.extent.codec,
                    stored.len()
                ),
            ));
            return Ok(None);
        }
    }
    let mut decoded = vec![0u8; st.extent.length as usize];
    match st.extent.decode_stored(&stored, &mut decoded) {
        Ok(()) => Ok(Some(decoded)),
        Err(e) => {
            failures.push(Failure::new(
                item.name,
                FailureKind::StoredNotDecodable,
                e.to_string(),
            ));
            Ok(None)
        }
    }
}

/// `None` if `[from, to)` of the container is all zero, else a failure naming the first byte.
fn check_zero(file: &File, name: &str, from: u64, to: u64) -> Result<Option<Failure>, VerifyError> {
    let mut buf = vec![0u8; (to.saturating_sub(from)).min(CHUNK as u64) as usize];
    let mut pos = from;
    while pos < to {
        let n = (to - pos).min(buf.len() as u64) as usize;
        file.read_exact_at(&mut buf[..n], pos)
            .map_err(|e| VerifyError::io(CONTAINER_FILE, "reading padding", e))?;
        if let Some(i) = buf[..n].iter().position(|&b| b != 0) {
            let at = pos + i as u64;
            return Ok(Some(Failure::new(
                name,
                FailureKind::PaddingNotZero,
                format!(
                    "padding byte at model.jnf offset {at} is {:#04x} (padding runs {from}..{to})",
                    buf[i]
                ),
            )));
        }
        pos += n as u64;
    }
    Ok(None)
}

// ---- copied files --------------------------------------------------------------------------

/// Every listed file has the recorded size and SHA-256; nothing unlisted sits in the bundle.
fn check_files(
    paths: &BundlePaths,
    m: &Manifest,
    checked: &AtomicU64,
) -> Result<Vec<Failure>, VerifyError> {
    let mut failures = Vec::new();
    for f in &m.files {
        let path = paths.dir.join(&f.name);
        let file = match open_regular(&path) {
            Ok(file) => file,
            Err(e) => match VerifyError::from_open(&path, e) {
                Some(err) => return Err(err),
                None => {
                    failures.push(Failure::new(
                        &f.name,
                        FailureKind::MissingInBundle,
                        "listed in the manifest but not in the bundle",
                    ));
                    continue;
                }
            },
        };
        let (size, sha) = sha256_stream(&file).map_err(|e| VerifyError::io(&path, "reading", e))?;
        checked.fetch_add(size, Ordering::Relaxed);
        let sha = to_hex(&sha);
        if size != f.size || sha != f.sha256 {
            failures.push(Failure::new(
                &f.name,
                FailureKind::FileSha256Mismatch,
                format!(
                    "manifest {} ({} bytes), bundle {sha} ({size} bytes)",
                    f.sha256, f.size
                ),
            ));
        }
    }
    let listed: HashSet<&str> = m
        .files
        .iter()
        .map(|f| f.name.as_str())
        .chain([CONTAINER_FILE, MANIFEST_FILE])
        .collect();
    let entries =
        fs::read_dir(&paths.dir).map_err(|e| VerifyError::io(&paths.dir, "listing", e))?;
    let mut unlisted = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| VerifyError::io(&paths.dir, "listing", e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !listed.contains(name.as_str()) {
            unlisted.push(name);
        }
    }
    unlisted.sort();
    failures.extend(unlisted.into_iter().map(|n| {
        Failure::new(
            n,
            FailureKind::UnlistedFile,
            "in the bundle directory but not listed in the manifest",
        )
    }));
    Ok(failures)
}

/// (size, SHA-256) of everything `file` yields from its current position.
fn sha256_stream(mut file: &File) -> io::Result<(u64, [u8; 32])> {
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                h.update(&buf[..n]);
                size += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok((size, h.finalize().into()))
}

/// Every copied file of the bundle (as the manifest lists it; `check_files` ties the bundle's
/// bytes to that) is the source's file, byte for byte, and the source has no copied file the
/// bundle lacks.
fn compare_copied_files(
    ck: &Checkpoint,
    m: &Manifest,
    checked: &AtomicU64,
) -> Result<Vec<Failure>, VerifyError> {
    let mut failures = Vec::new();
    let source: HashMap<&str, &tarfa_checkpoint::SourceFile> = ck
        .extra_files
        .iter()
        .map(|f| (f.name.as_str(), f))
        .collect();
    for f in &m.files {
        let Some(sf) = source.get(f.name.as_str()) else {
            failures.push(Failure::new(
                &f.name,
                FailureKind::MissingInSource,
                "copied into the bundle, but the source checkpoint has no such file",
            ));
            continue;
        };
        // A multimodal Llama 4 source: the bundle carries its text model's config, derived
        // from the source's config.json by the checkpoint reader (the text_config, as the
        // converter writes it), so that is what the bundle's copy must be.
        if let (true, Some(text)) = (
            f.name == tarfa_checkpoint::CONFIG_FILE,
            ck.config.bundle_config_json(),
        ) {
            checked.fetch_add(text.len() as u64, Ordering::Relaxed);
            let sha = to_hex(&{
                use sha2::Digest;
                let d: [u8; 32] = sha2::Sha256::digest(&text).into();
                d
            });
            if text.len() as u64 != f.size || sha != f.sha256 {
                failures.push(Failure::new(
                    &f.name,
                    FailureKind::SourceFileDiffers,
                    format!(
                        "the bundle's file ({} bytes, SHA-256 {}) is not the source's text_config ({} bytes, SHA-256 {sha})",
                        f.size,
                        f.sha256,
                        text.len()
                    ),
                ));
            }
            continue;
        }
        let file = open_regular(&sf.path).map_err(|e| {
            VerifyError::from_open(&sf.path, e).unwrap_or_else(|| {
                VerifyError::io(&sf.path, "open", io::ErrorKind::NotFound.into())
            })
        })?;
        let (size, sha) =
            sha256_stream(&file).map_err(|e| VerifyError::io(&sf.path, "reading", e))?;
        checked.fetch_add(size, Ordering::Relaxed);
        let sha = to_hex(&sha);
        if size != f.size || sha != f.sha256 {
            failures.push(Failure::new(
                &f.name,
                FailureKind::SourceFileDiffers,
                format!(
                    "the bundle's file ({} bytes, SHA-256 {}) is not the source's ({size} bytes, SHA-256 {sha})",
                    f.size, f.sha256
                ),
            ));
        }
    }
    let listed: HashSet<&str> = m.files.iter().map(|f| f.name.as_str()).collect();
    for sf in &ck.extra_files {
        if !listed.contains(sf.name.as_str()) {
            failures.push(Failure::new(
                &sf.name,
                FailureKind::MissingInBundle,
                "in the source checkpoint, but not copied into the bundle",
            ));
        }
    }
    Ok(failures)
}

/// One note per tensor or expert the manifest records with NaN or infinite elements.
fn nonfinite_notes(m: &Manifest) -> Vec<Note> {
    let tensors = m.tensors.iter().map(|t| (&t.name, t.nonfinite));
    let experts = m.experts.iter().map(|e| (&e.name, e.nonfinite));
    tensors
        .chain(experts)
        .filter(|(_, n)| *n > 0)
        .map(|(name, n)| Note {
            name: name.clone(),
            detail: format!(
                "{n} NaN or infinite element{} (carried bit for bit from the source)",
                if n == 1 { "" } else { "s" }
            ),
        })
        .collect()
}

// ---- the source checkpoint ----------------------------------------------------------------

fn open_source(src: &Path) -> Result<Checkpoint, VerifyError> {
    // Hub blobs are not hashed at open: every shard is hashed below and compared with the
    // manifest, which reports a corrupt shard by name instead of refusing the source.
    let opts = OpenOptions {
        verify_hub_blobs: false,
    };
    tarfa_checkpoint::open_with(src, &opts).map_err(|e| VerifyError::from_checkpoint(src.into(), e))
}

/// Opens every shard at the path the checkpoint resolved and validated: the whole-file hash and
/// the tensor comparisons then read the same open file.
fn open_shards(ck: &Checkpoint) -> Result<Vec<OpenShard>, VerifyError> {
    ck.shards
        .iter()
        .map(|s| {
            let file = File::open(&s.path).map_err(|e| VerifyError::io(&s.path, "open", e))?;
            let size = file
                .metadata()
                .map_err(|e| VerifyError::io(&s.path, "stat", e))?
                .len();
            Ok(OpenShard {
                name: s.name.clone(),
                file,
                size,
            })
        })
        .collect()
}

/// The source's tensors are exactly the bundle's tensors and expert matrices, but for the
/// multi-token-prediction tensors the converter skips by rule (`Checkpoint::skipped`): they must
/// be absent from the bundle.
fn compare_tensor_sets(ck: &Checkpoint, h: &Header, m: Option<&Manifest>, out: &mut Vec<Failure>) {
    // A fused expert's matrices are named after its extent, not after a source tensor: the
    // source tensors it covers are its manifest's source ranges.
    let fused: HashMap<&str, &tarfa_manifest::ExpertRecord> = m
        .map(|m| {
            m.experts
                .iter()
                .filter(|e| !e.sources.is_empty())
                .map(|e| (e.name.as_str(), e))
                .collect()
        })
        .unwrap_or_default();
    let bundle: HashSet<&str> = h
        .tensors
        .iter()
        .map(|t| t.name.as_str())
        .chain(
            h.experts
                .iter()
                .filter(|e| !fused.contains_key(e.prefix.as_str()))
                .flat_map(|e| e.matrices.iter().map(|m| m.name.as_str())),
        )
        .chain(
            fused
                .values()
                .flat_map(|e| e.sources.iter().map(|r| r.tensor.as_str())),
        )
        .collect();
    let skipped: HashSet<&str> = ck.skipped.iter().map(String::as_str).collect();
    for name in ck.tensors.keys() {
        if !bundle.contains(name.as_str()) && !skipped.contains(name.as_str()) {
            out.push(Failure::new(
                name,
                FailureKind::MissingInBundle,
                "in the source checkpoint but not in model.jnf",
            ));
        }
    }
    let mut extra: Vec<&str> = bundle
        .into_iter()
        .filter(|n| !ck.tensors.contains_key(*n) || skipped.contains(*n))
        .collect();
    extra.sort_unstable();
    out.extend(extra.into_iter().map(|n| {
        Failure::new(
            n,
            FailureKind::MissingInSource,
            "in model.jnf but not in the source checkpoint",
        )
    }));

    // The same tensors must also be the same experts: an expert of the source stored as plain
    // tensors (or the reverse, or matrices regrouped) would still match name for name above.
    for ((layer, expert), src) in &ck.experts {
        let same = h.expert(*layer, *expert).is_some_and(|e| {
            e.prefix == src.prefix
                && e.matrices
                    .iter()
                    .zip(&src.tensors)
                    .all(|(m, name)| &m.name == name)
        });
        if !same {
            out.push(Failure::new(
                &src.prefix,
                FailureKind::MissingInBundle,
                format!(
                    "the source's expert (layer {layer}, expert {expert}: {}) is not an extent \
                     of model.jnf with those gate, up and down matrices",
                    src.tensors.join(", ")
                ),
            ));
        }
    }
    // Every expert of a fused layer is an extent of the bundle made from that layer's tensors.
    for f in ck.fused.values() {
        let tensors = f.tensors();
        for expert in 0..ck.config.num_experts {
            let prefix = ck
                .config
                .family
                .fused_experts()
                .map(|t| f.expert_prefix(t, expert))
                .unwrap_or_default();
            let same = fused.get(prefix.as_str()).is_some_and(|r| {
                h.expert(f.layer, expert)
                    .is_some_and(|e| e.prefix == prefix)
                    && r.sources
                        .iter()
                        .map(|s| s.tensor.as_str())
                        .eq(tensors.iter().copied())
            });
            if !same {
                out.push(Failure::new(
                    &prefix,
                    FailureKind::MissingInBundle,
                    format!(
                        "the source's fused expert (layer {}, expert {expert}: its slices of {}) \
                         is not an extent of model.jnf made from them",
                        f.layer,
                        tensors.join(", ")
                    ),
                ));
            }
        }
    }
    for e in &h.experts {
        let fused_here = ck
            .fused
            .get(&e.layer)
            .is_some_and(|_| e.expert < ck.config.num_experts);
        if !ck.experts.contains_key(&(e.layer, e.expert)) && !fused_here {
            out.push(Failure::new(
                &e.prefix,
                FailureKind::MissingInSource,
                "an expert extent of model.jnf that is not an expert of the source checkpoint",
            ));
        }
    }
}

/// Every source shard's size and whole-file SHA-256 against the manifest's shard records.
fn check_shards(
    shards: &[OpenShard],
    m: Option<&Manifest>,
    bar: &ProgressBar,
    checked: &AtomicU64,
) -> Result<Vec<Failure>, VerifyError> {
    let records: BTreeMap<&str, _> = m
        .map(|m| m.shards.iter().map(|s| (s.name.as_str(), s)).collect())
        .unwrap_or_default();
    let hashed: Vec<Result<(u64, [u8; 32]), VerifyError>> = shards
        .par_iter()
        .map(|s| {
            let mut h = Sha256::new();
            let mut buf = vec![0u8; CHUNK];
            let mut pos = 0u64;
            loop {
                let n = s
                    .file
                    .read_at(&mut buf, pos)
                    .map_err(|e| VerifyError::io(&s.name, "hashing the source shard", e))?;
                if n == 0 {
                    break;
                }
                h.update(&buf[..n]);
                pos += n as u64;
                bar.inc(n as u64);
                checked.fetch_add(n as u64, Ordering::Relaxed);
            }
            Ok((pos, h.finalize().into()))
        })
        .collect();
    let mut failures = Vec::new();
    let Some(m) = m else {
        return Ok(failures);
    };
    for (s, r) in shards.iter().zip(hashed) {
        let (size, sha) = r?;
        let Some(rec) = records.get(s.name.as_str()) else {
            failures.push(Failure::new(
                &s.name,
                FailureKind::MissingInManifest,
                "source shard not listed in the manifest",
            ));
            continue;
        };
        if size != rec.size {
            failures.push(Failure::new(
                &s.name,
                FailureKind::ShardSizeMismatch,
                format!("manifest {} bytes, source {size} bytes", rec.size),
            ));
        }
        let sha = to_hex(&sha);
        if sha != rec.sha256 {
            failures.push(Failure::new(
                &s.name,
                FailureKind::ShardSha256Mismatch,
                format!("manifest {}, source {sha}", rec.sha256),
            ));
        }
    }
    let present: HashSet<&str> = shards.iter().map(|s| s.name.as_str()).collect();
    for rec in &m.shards {
        if !present.contains(rec.name.as_str()) {
            failures.push(Failure::new(
                &rec.name,
                FailureKind::MissingInSource,
                "shard listed in the manifest but not in the source checkpoint",
            ));
        }
    }
    Ok(failures)
}
