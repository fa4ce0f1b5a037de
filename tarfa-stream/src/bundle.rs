//! A [`WeightSource`] over a JNF bundle: every byte handed to the forward was read from
//! `model.jnf` into the very buffer returned and checked against `manifest.toml` first.
//!
//! Opening a bundle checks, before any weight is read: `manifest.toml` and `model.jnf` are
//! regular files (a FIFO is refused, never read); the manifest parses and its root digest is
//! the SHA-256 of its lines after the first (and equals `--expect-root` when given); the
//! container header's JSON has the length and SHA-256 the manifest records, validates, and
//! describes exactly the manifest's tensors and experts (names, dtypes, shapes, offsets,
//! lengths, padded lengths); every copied file the manifest lists has its recorded size and
//! SHA-256, and none of the files the run reads (`config.json`, `generation_config.json`,
//! `tokenizer.json`) sits in the bundle unlisted. Then each non-expert tensor is BLAKE3-checked
//! when it is loaded, and each expert extent when it is first read; each copied file again when
//! it is read. An extent stored encoded (format version 2) is checked twice: its stored bytes
//! against the manifest's `stored_blake3` before they are decoded, then the decoded bytes
//! against `blake3` as a raw extent's are. A mismatch is a [`BundleError`] (exit code 1); there
//! is no override.
//!
//! What was verified is recorded, so that `--verify-report` can show an auditor (and the
//! validation suite) that every tensor the run used was checked before use.
//!
//! This module must never memory-map weights, hand out bytes it did not verify, or skip a check
//! for speed: the exactness contract (docs/EXACTNESS.md section 1) starts here.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use jnf_format::{Dtype, ExpertExtent, ExtentEncoding, JnfFile, CONTAINER_FILE};
use rayon::prelude::*;
use serde::Serialize;
use sha2::{Digest, Sha256};
use tarfa_core::exit;
use tarfa_manifest::hash::to_hex;
use tarfa_manifest::regular::{open_regular, OpenRegularError};
use tarfa_manifest::{HeaderRecord, Manifest, MANIFEST_FILE};

use crate::numerics::AlignedVec;
use crate::weights::{
    Bf16Matrix, ExpertWeights, HostTensor, TensorData, WeightError, WeightSource,
};

/// Why a bundle cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    /// The path is not a bundle directory at all.
    #[error("{path}: not a Tarfa bundle ({why})")]
    NotABundle { path: PathBuf, why: String },
    /// The manifest does not parse or validate.
    #[error("{path}: {source}")]
    Manifest {
        path: PathBuf,
        source: tarfa_manifest::ManifestError,
    },
    /// The container header does not validate.
    #[error("{path}: {source}")]
    Header {
        path: PathBuf,
        source: jnf_format::JnfError,
    },
    /// A file of the bundle is a directory, FIFO, device or socket, or its path cannot be
    /// resolved (a symlink loop): refused before any read that could block.
    #[error("{path}: {why}")]
    NotARegularFile { path: PathBuf, why: String },
    /// A file the manifest lists is not in the bundle.
    #[error("{path}: listed in the manifest but missing from the bundle")]
    MissingFile { path: PathBuf },
    /// A copied file's size or SHA-256 is not the manifest's.
    #[error("{path}: {got_size} bytes with SHA-256 {got}; the manifest records {want_size} bytes with SHA-256 {want}")]
    FileMismatch {
        path: PathBuf,
        want_size: u64,
        want: String,
        got_size: u64,
        got: String,
    },
    /// The container's header JSON is not the one the manifest records (root-bound).
    #[error("{path}: header JSON is {got_len} bytes with SHA-256 {got}; the manifest records {want_len} bytes with SHA-256 {want}")]
    HeaderDigestMismatch {
        path: PathBuf,
        want_len: u64,
        want: String,
        got_len: u64,
        got: String,
    },
    /// The manifest's root digest is not the SHA-256 of its lines after the first.
    #[error(
        "{path}: root digest {recorded} is not the SHA-256 of the manifest's lines after the first ({computed})"
    )]
    RootMismatch {
        path: PathBuf,
        recorded: String,
        computed: String,
    },
    /// `--expect-root` named another bundle.
    #[error("{path}: root digest is {actual}, expected {expected}")]
    UnexpectedRoot {
        path: PathBuf,
        expected: String,
        actual: String,
    },
    /// The header and the manifest disagree about an entry.
    #[error("{path}: {name}: container and manifest disagree ({what})")]
    HeaderManifestMismatch {
        path: PathBuf,
        name: String,
        what: String,
    },
    /// A file the run reads is not listed in the manifest.
    #[error("{path}: {file} is not listed in the manifest")]
    FileUnlisted { path: PathBuf, file: String },
    /// Bytes read from the bundle do not match their manifest digest.
    #[error("{path}: {name}: {algorithm} of the bytes read does not match the manifest (the bundle changed or is corrupt)")]
    HashMismatch {
        path: PathBuf,
        name: String,
        algorithm: &'static str,
    },
    /// An encoded extent's stored bytes do not match the manifest's `stored_blake3`: named
    /// before anything is decoded from them.
    #[error("{path}: {name}: BLAKE3 of the stored (encoded) bytes read does not match the manifest's stored_blake3 (the bundle changed or is corrupt); nothing was decoded")]
    StoredHashMismatch { path: PathBuf, name: String },
    /// An encoded extent whose stored bytes verified does not decode.
    #[error("{path}: {name}: the stored extent verified but does not decode ({msg})")]
    Undecodable {
        path: PathBuf,
        name: String,
        msg: String,
    },
    /// An MXFP4 expert that verified against the manifest holds a block with no exact BF16
    /// widening (scale 255, or an overflow): refused, never rounded.
    #[error("{path}: {name}: {msg}; MXFP4 is widened exactly or refused")]
    Mxfp4 {
        path: PathBuf,
        name: String,
        msg: String,
    },
    /// An I/O failure.
    #[error("{path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        source: std::io::Error,
    },
}

impl BundleError {
    /// The documented exit code: 1 verification failure, 2 bad input, 3 environment.
    pub fn exit_code(&self) -> i32 {
        match self {
            BundleError::NotABundle { .. } | BundleError::NotARegularFile { .. } => exit::BAD_INPUT,
            BundleError::Io { .. } => exit::ENVIRONMENT,
            BundleError::Manifest { .. }
            | BundleError::Header { .. }
            | BundleError::MissingFile { .. }
            | BundleError::FileMismatch { .. }
            | BundleError::HeaderDigestMismatch { .. }
            | BundleError::RootMismatch { .. }
            | BundleError::UnexpectedRoot { .. }
            | BundleError::HeaderManifestMismatch { .. }
            | BundleError::FileUnlisted { .. }
            | BundleError::HashMismatch { .. }
            | BundleError::StoredHashMismatch { .. }
            | BundleError::Undecodable { .. }
            | BundleError::Mxfp4 { .. } => exit::VERIFICATION_FAILED,
        }
    }
}

/// One verified tensor or expert, as `--verify-report` lists it.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct VerifiedEntry {
    pub name: String,
    pub bytes: u64,
    pub algorithm: &'static str,
    pub digest: String,
    /// Times the bytes were read from the bundle (each read verified).
    pub reads: u64,
    pub verified_before_use: bool,
}

/// What a run verified: the `--verify-report` document.
#[derive(Clone, Debug, Serialize)]
pub struct VerifyReport {
    pub bundle: PathBuf,
    pub root_digest: String,
    pub root_recomputed: bool,
    pub files: Vec<VerifiedEntry>,
    pub tensors: Vec<VerifiedEntry>,
    pub experts: Vec<VerifiedEntry>,
    /// Always 0: the source has no path that hands out unverified bytes. Recorded so that a
    /// checker reading the report does not have to take that on trust from its absence.
    pub unverified_uses: u64,
}

#[derive(Default)]
struct Ledger {
    files: BTreeMap<String, VerifiedEntry>,
    tensors: BTreeMap<String, VerifiedEntry>,
    experts: BTreeMap<String, VerifiedEntry>,
}

impl Ledger {
    fn note(
        map: &mut BTreeMap<String, VerifiedEntry>,
        name: &str,
        bytes: u64,
        algorithm: &'static str,
        digest: &str,
    ) {
        map.entry(name.to_string())
            .or_insert_with(|| VerifiedEntry {
                name: name.to_string(),
                bytes,
                algorithm,
                digest: digest.to_string(),
                reads: 0,
                verified_before_use: true,
            })
            .reads += 1;
    }
}

/// Expert digests by (layer, expert): BLAKE3 hex and the extent.
struct ExpertSlot {
    extent: ExpertExtent,
    /// Of the extent's (decoded) bytes.
    blake3: String,
    /// Of an encoded extent's stored bytes (the manifest's `stored_blake3`); `None` when raw.
    stored_blake3: Option<String>,
}

/// A verified bundle, serving weights to the forward.
pub struct BundleSource {
    dir: PathBuf,
    jnf_path: PathBuf,
    file: File,
    manifest: Manifest,
    /// Non-expert tensors: header entry and manifest BLAKE3.
    tensors: HashMap<String, (jnf_format::TensorEntry, String)>,
    experts: HashMap<(usize, usize), ExpertSlot>,
    /// Experts read and verified so far (resident mode keeps them).
    resident: Mutex<HashMap<(usize, usize), Arc<ExpertWeights>>>,
    ledger: Mutex<Ledger>,
}

fn io(path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> BundleError {
    let path = path.to_path_buf();
    move |source| BundleError::Io { path, op, source }
}

/// The copied files the run itself reads: one of these in the bundle but not in the manifest
/// is refused at open, so that no unverified file can ever be mistaken for a verified one.
const FILES_THE_RUN_READS: [&str; 3] = ["config.json", "generation_config.json", "tokenizer.json"];

/// Sort a failure to open a bundle's file as a regular file into the documented exit codes.
fn open_error(path: &Path, e: OpenRegularError) -> BundleError {
    let path = path.to_path_buf();
    match e {
        OpenRegularError::NotFound => BundleError::MissingFile { path },
        OpenRegularError::NotRegular(what) => BundleError::NotARegularFile {
            path,
            why: format!("is a {what}, not a regular file"),
        },
        OpenRegularError::Unresolvable(source) => BundleError::NotARegularFile {
            path,
            why: format!("cannot be resolved: {source}"),
        },
        OpenRegularError::Io(source) => BundleError::Io {
            path,
            op: "open",
            source,
        },
    }
}

/// A structural file of the bundle (manifest.toml, model.jnf): missing means "not a bundle".
fn open_part(dir: &Path, path: &Path) -> Result<File, BundleError> {
    open_regular(path).map_err(|e| match e {
        OpenRegularError::NotFound => BundleError::NotABundle {
            path: dir.to_path_buf(),
            why: format!(
                "no {} (a bundle is a directory with manifest.toml and model.jnf)",
                path.file_name()
                    .map_or(String::new(), |n| n.to_string_lossy().into_owned())
            ),
        },
        other => open_error(path, other),
    })
}

/// A copied file's bytes, if they have the manifest's size and SHA-256 (returned as hex).
fn read_copied_file(
    dir: &Path,
    rec: &tarfa_manifest::FileRecord,
) -> Result<(Vec<u8>, String), BundleError> {
    let path = dir.join(&rec.name);
    let mut f = open_regular(&path).map_err(|e| open_error(&path, e))?;
    let mut bytes = Vec::new();
    f.read_to_end(&mut bytes).map_err(io(&path, "read"))?;
    let digest = to_hex(&Sha256::digest(&bytes));
    if digest != rec.sha256 || bytes.len() as u64 != rec.size {
        return Err(BundleError::FileMismatch {
            path,
            want_size: rec.size,
            want: rec.sha256.clone(),
            got_size: bytes.len() as u64,
            got: digest,
        });
    }
    Ok((bytes, digest))
}

impl BundleSource {
    /// Open and check a bundle (see the module doc); reads no weights yet.
    pub fn open(dir: &Path, expect_root: Option<&str>) -> Result<BundleSource, BundleError> {
        let meta = std::fs::metadata(dir).map_err(|e| BundleError::NotABundle {
            path: dir.to_path_buf(),
            why: e.to_string(),
        })?;
        if !meta.is_dir() {
            return Err(BundleError::NotABundle {
                path: dir.to_path_buf(),
                why: "expected a directory with manifest.toml and model.jnf".into(),
            });
        }
        let manifest_path = dir.join(MANIFEST_FILE);
        let jnf_path = dir.join(CONTAINER_FILE);
        let mut text = String::new();
        open_part(dir, &manifest_path)?
            .read_to_string(&mut text)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::InvalidData => BundleError::Manifest {
                    path: manifest_path.clone(),
                    source: tarfa_manifest::ManifestError::Toml("not UTF-8".into()),
                },
                _ => io(&manifest_path, "read")(e),
            })?;
        let manifest = Manifest::parse(&text).map_err(|source| BundleError::Manifest {
            path: manifest_path.clone(),
            source,
        })?;
        if manifest.check_root().is_err() {
            return Err(BundleError::RootMismatch {
                path: manifest_path,
                recorded: manifest.root_digest.clone(),
                computed: manifest.computed_root.clone(),
            });
        }
        if let Some(expected) = expect_root {
            if !expected.eq_ignore_ascii_case(&manifest.root_digest) {
                return Err(BundleError::UnexpectedRoot {
                    path: dir.to_path_buf(),
                    expected: expected.to_string(),
                    actual: manifest.root_digest.clone(),
                });
            }
        }
        // Refuse a FIFO or device before JnfFile::open reads it.
        drop(open_part(dir, &jnf_path)?);
        let jnf = JnfFile::open(&jnf_path).map_err(|source| BundleError::Header {
            path: jnf_path.clone(),
            source,
        })?;
        let header = HeaderRecord::read_from(jnf.file(), jnf_format::MAX_HEADER_LEN)
            .map_err(io(&jnf_path, "read header"))?;
        if header != manifest.header {
            return Err(BundleError::HeaderDigestMismatch {
                path: jnf_path,
                want_len: manifest.header.length,
                want: manifest.header.sha256.clone(),
                got_len: header.length,
                got: header.sha256,
            });
        }
        let (tensors, experts) = reconcile(&jnf_path, &jnf, &manifest)?;
        // Every copied file now, not only when the run reads it: a bundle is whole or refused.
        // (The ledger records the reads that hand bytes out; see read_file.)
        for rec in &manifest.files {
            read_copied_file(dir, rec)?;
        }
        for name in FILES_THE_RUN_READS {
            let listed = manifest.files.iter().any(|f| f.name == name);
            if !listed && std::fs::symlink_metadata(dir.join(name)).is_ok() {
                return Err(BundleError::FileUnlisted {
                    path: dir.to_path_buf(),
                    file: name.to_string(),
                });
            }
        }
        let file = jnf.file().try_clone().map_err(io(&jnf_path, "open"))?;
        Ok(BundleSource {
            dir: dir.to_path_buf(),
            jnf_path,
            file,
            manifest,
            tensors,
            experts,
            resident: Mutex::new(HashMap::new()),
            ledger: Mutex::new(Ledger::default()),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn root_digest(&self) -> &str {
        &self.manifest.root_digest
    }

    /// Whether the bundle carries a copied file (e.g. `tokenizer.json`).
    pub fn has_file(&self, name: &str) -> bool {
        self.manifest.files.iter().any(|f| f.name == name)
    }

    /// A copied file's bytes, checked against its manifest SHA-256.
    pub fn read_file(&self, name: &str) -> Result<Vec<u8>, BundleError> {
        let rec = self
            .manifest
            .files
            .iter()
            .find(|f| f.name == name)
            .ok_or_else(|| BundleError::FileUnlisted {
                path: self.dir.clone(),
                file: name.to_string(),
            })?;
        // Checked again in the buffer handed out: the file may have changed since open.
        let (bytes, digest) = read_copied_file(&self.dir, rec)?;
        let mut l = self.ledger.lock().expect("ledger lock");
        Ledger::note(&mut l.files, name, bytes.len() as u64, "sha256", &digest);
        Ok(bytes)
    }

    /// Total bytes of all expert extents (for budgets and reports).
    pub fn expert_bytes(&self) -> u64 {
        self.experts.values().map(|s| s.extent.length).sum()
    }

    /// The container file (`model.jnf`).
    pub fn jnf_path(&self) -> &Path {
        &self.jnf_path
    }

    /// Every expert extent with its manifest BLAKE3 (hex), in (layer, expert) order: what an
    /// expert-streaming store reads and checks, after [`BundleSource::open`] reconciled both.
    pub fn expert_extents(&self) -> Vec<(ExpertExtent, String)> {
        let mut v: Vec<(ExpertExtent, String)> = self
            .experts
            .values()
            .map(|s| (s.extent.clone(), s.blake3.clone()))
            .collect();
        v.sort_by_key(|(e, _)| (e.layer, e.expert));
        v
    }

    /// The manifest's BLAKE3 of an encoded extent's stored bytes (`None` for a raw extent, whose
    /// stored bytes are the extent): what an expert-streaming store checks before it decodes.
    pub fn stored_blake3(&self, layer: u32, expert: u32) -> Option<&str> {
        self.experts
            .get(&(layer as usize, expert as usize))
            .and_then(|s| s.stored_blake3.as_deref())
    }

    /// A duplicate handle on the open container file (reads through the page cache).
    pub(crate) fn file_handle(&self) -> Result<File, BundleError> {
        self.file.try_clone().map_err(io(&self.jnf_path, "open"))
    }

    /// Records, for `--verify-report`, that an expert extent was read and BLAKE3-checked by a
    /// reader other than this source (the streaming store) before its use.
    pub(crate) fn note_expert_verified(&self, name: &str, bytes: u64, blake3: &str) {
        let mut l = self.ledger.lock().expect("ledger lock");
        Ledger::note(&mut l.experts, name, bytes, "blake3", blake3);
    }

    /// Read every expert now (resident mode, benchmarks): later steps find them in memory.
    pub fn load_all_experts(&self) -> Result<(), BundleError> {
        let mut keys: Vec<(usize, usize)> = self.experts.keys().copied().collect();
        keys.sort_unstable();
        let loaded: Vec<_> = keys
            .par_iter()
            .map(|&k| self.read_expert(k).map(|w| (k, Arc::new(w))))
            .collect::<Result<_, _>>()?;
        self.resident.lock().expect("resident lock").extend(loaded);
        Ok(())
    }

    /// Read and verify every tensor and expert of the bundle (without keeping them): a full
    /// audit of the container against the manifest. Returns the bytes checked.
    pub fn verify_all(&self) -> Result<u64, BundleError> {
        let tensors: u64 = self
            .tensors
            .par_iter()
            .map(|(name, (t, blake3))| {
                self.read_verified(name, t.offset, t.length, blake3)?;
                let mut l = self.ledger.lock().expect("ledger lock");
                Ledger::note(&mut l.tensors, name, t.length, "blake3", blake3);
                Ok(t.length)
            })
            .sum::<Result<u64, BundleError>>()?;
        let experts: u64 = self
            .experts
            .par_iter()
            .map(|(_, slot)| {
                let e = &slot.extent;
                self.read_extent_verified(slot)?;
                let mut l = self.ledger.lock().expect("ledger lock");
                Ledger::note(&mut l.experts, &e.prefix, e.length, "blake3", &slot.blake3);
                Ok(e.length)
            })
            .sum::<Result<u64, BundleError>>()?;
        Ok(tensors + experts)
    }

    /// Number of non-expert tensors and of experts in the bundle.
    pub fn counts(&self) -> (usize, usize) {
        (self.tensors.len(), self.experts.len())
    }

    /// What was verified so far.
    pub fn report(&self) -> VerifyReport {
        let l = self.ledger.lock().expect("ledger lock");
        VerifyReport {
            bundle: self.dir.clone(),
            root_digest: self.manifest.root_digest.clone(),
            root_recomputed: true,
            files: l.files.values().cloned().collect(),
            tensors: l.tensors.values().cloned().collect(),
            experts: l.experts.values().cloned().collect(),
            unverified_uses: 0,
        }
    }

    fn read_verified(
        &self,
        name: &str,
        offset: u64,
        length: u64,
        blake3: &str,
    ) -> Result<Vec<u8>, BundleError> {
        let mut buf = vec![0u8; length as usize];
        self.file
            .read_exact_at(&mut buf, offset)
            .map_err(io(&self.jnf_path, "read"))?;
        if blake3::hash(&buf).to_hex().as_str() != blake3 {
            return Err(BundleError::HashMismatch {
                path: self.jnf_path.clone(),
                name: name.to_string(),
                algorithm: "BLAKE3",
            });
        }
        Ok(buf)
    }

    /// An expert extent's bytes, verified: a raw extent's as read; an encoded one's stored
    /// bytes checked against `stored_blake3`, decoded, and the decoded bytes checked.
    fn read_extent_verified(&self, slot: &ExpertSlot) -> Result<Vec<u8>, BundleError> {
        let e = &slot.extent;
        let Some(stored_blake3) = slot.stored_blake3.as_deref().filter(|_| e.is_encoded()) else {
            return self.read_verified(&e.prefix, e.offset, e.length, &slot.blake3);
        };
        let mut stored = vec![0u8; e.stored_length as usize];
        self.file
            .read_exact_at(&mut stored, e.offset)
            .map_err(io(&self.jnf_path, "read"))?;
        if blake3::hash(&stored).to_hex().as_str() != stored_blake3 {
            return Err(BundleError::StoredHashMismatch {
                path: self.jnf_path.clone(),
                name: e.prefix.clone(),
            });
        }
        let mut bytes = vec![0u8; e.length as usize];
        e.decode_stored(&stored, &mut bytes)
            .map_err(|err| BundleError::Undecodable {
                path: self.jnf_path.clone(),
                name: e.prefix.clone(),
                msg: err.to_string(),
            })?;
        if blake3::hash(&bytes).to_hex().as_str() != slot.blake3 {
            return Err(BundleError::HashMismatch {
                path: self.jnf_path.clone(),
                name: e.prefix.clone(),
                algorithm: "BLAKE3 of the decoded bytes",
            });
        }
        Ok(bytes)
    }

    /// Read one expert extent, verify it, and split it into its three matrices.
    fn read_expert(&self, key: (usize, usize)) -> Result<ExpertWeights, BundleError> {
        let slot = &self.experts[&key];
        let e = &slot.extent;
        let bytes = self.read_extent_verified(slot)?;
        {
            let mut l = self.ledger.lock().expect("ledger lock");
            Ledger::note(&mut l.experts, &e.prefix, e.length, "blake3", &slot.blake3);
        }
        if e.encoding() == ExtentEncoding::Mxfp4 {
            return widen_mxfp4_extent(&self.jnf_path, e, &bytes);
        }
        let m = |i: usize| {
            let mm = &e.matrices[i];
            let start = mm.offset as usize;
            let data = AlignedVec::<u16>::from_le_bytes(&bytes[start..start + mm.length as usize]);
            Bf16Matrix {
                rows: mm.shape[0] as usize,
                cols: mm.shape[1] as usize,
                data,
            }
        };
        Ok(ExpertWeights {
            gate: m(0),
            up: m(1),
            down: m(2),
        })
    }
}

/// An MXFP4 extent's verified bytes (gate_up blocks, gate_up scales, down blocks, down
/// scales, as released) widened exactly into the runtime's gate, up and down
/// (docs/EXACTNESS.md section 14, "MXFP4"). The header validated the parts' shapes.
pub fn widen_mxfp4_extent(
    jnf_path: &Path,
    e: &ExpertExtent,
    bytes: &[u8],
) -> Result<ExpertWeights, BundleError> {
    let part = |k: usize| {
        let m = &e.matrices[k];
        &bytes[m.offset as usize..(m.offset + m.length) as usize]
    };
    // down_blocks is [H, I/32, 16]: H its rows, I 32 times its groups.
    let (h, i) = match e.matrices[2].shape.as_slice() {
        [h, g, _] => (*h as usize, 32 * *g as usize),
        _ => unreachable!("a validated MXFP4 extent's blocks are 3-D"),
    };
    tarfa_core::weights::fused::expert_from_mxfp4(part(0), part(1), part(2), part(3), h, i).map_err(
        |(which, err)| BundleError::Mxfp4 {
            path: jnf_path.to_path_buf(),
            name: match which {
                tarfa_core::weights::fused::Mxfp4Part::GateUp => e.matrices[1].name.clone(),
                tarfa_core::weights::fused::Mxfp4Part::Down => e.matrices[3].name.clone(),
            },
            msg: err.to_string(),
        },
    )
}

type TensorIndex = HashMap<String, (jnf_format::TensorEntry, String)>;
type ExpertIndex = HashMap<(usize, usize), ExpertSlot>;

/// The header and the manifest must describe the same entries, exactly.
fn reconcile(
    path: &Path,
    jnf: &JnfFile,
    m: &Manifest,
) -> Result<(TensorIndex, ExpertIndex), BundleError> {
    let bad = |name: &str, what: String| BundleError::HeaderManifestMismatch {
        path: path.to_path_buf(),
        name: name.to_string(),
        what,
    };
    let h = jnf.header();
    let version = format!("{}.{}", h.major, h.minor);
    if m.format_version != version {
        return Err(bad(
            MANIFEST_FILE,
            format!(
                "format_version {:?} in the manifest, {version} in the container",
                m.format_version
            ),
        ));
    }
    let records: HashMap<&str, &tarfa_manifest::TensorRecord> =
        m.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    if records.len() != h.tensors.len() {
        return Err(bad(
            "tensors",
            format!(
                "{} in the container, {} in the manifest",
                h.tensors.len(),
                records.len()
            ),
        ));
    }
    let mut tensors = HashMap::new();
    for t in &h.tensors {
        let r = records
            .get(t.name.as_str())
            .ok_or_else(|| bad(&t.name, "not in the manifest".into()))?;
        if r.dtype != t.dtype.as_str() {
            return Err(bad(
                &t.name,
                format!(
                    "dtype {} in the container, {} in the manifest",
                    t.dtype, r.dtype
                ),
            ));
        }
        if r.shape != t.shape || r.length != t.length {
            return Err(bad(
                &t.name,
                format!(
                    "shape {:?} ({} bytes) in the container, {:?} ({} bytes) in the manifest",
                    t.shape, t.length, r.shape, r.length
                ),
            ));
        }
        if r.offset != t.offset {
            return Err(bad(
                &t.name,
                format!(
                    "offset {} in the container, {} in the manifest",
                    t.offset, r.offset
                ),
            ));
        }
        tensors.insert(t.name.clone(), (t.clone(), r.blake3.clone()));
    }
    let erecs = m.expert_index();
    if erecs.len() != h.experts.len() {
        return Err(bad(
            "experts",
            format!(
                "{} in the container, {} in the manifest",
                h.experts.len(),
                erecs.len()
            ),
        ));
    }
    let mut experts = HashMap::new();
    for e in &h.experts {
        let r = erecs
            .get(&(e.layer, e.expert))
            .ok_or_else(|| bad(&e.prefix, "not in the manifest".into()))?;
        if r.name != e.prefix
            || (r.offset, r.length, r.padded_length) != (e.offset, e.length, e.padded_length)
        {
            return Err(bad(
                &e.prefix,
                format!(
                    "extent {:?} at offset {} ({} bytes, {} padded) in the container, {:?} at {} ({}, {}) in the manifest",
                    e.prefix, e.offset, e.length, e.padded_length, r.name, r.offset, r.length, r.padded_length
                ),
            ));
        }
        // How the extent is stored: a version-1 manifest's extents are raw.
        let (codec, stored) = (
            r.codec.as_deref().unwrap_or("raw"),
            r.stored_length.unwrap_or(r.length),
        );
        if (codec, stored) != (e.codec.as_str(), e.stored_length) {
            return Err(bad(
                &e.prefix,
                format!(
                    "stored {} in {} bytes in the container, {codec} in {stored} in the manifest",
                    e.codec, e.stored_length
                ),
            ));
        }
        let same = r.matrices.len() == e.matrices.len()
            && r.matrices.iter().zip(&e.matrices).all(|(a, b)| {
                a.name == b.name
                    && a.dtype == b.dtype.as_str()
                    && a.shape == b.shape
                    && a.offset == b.offset
                    && a.length == b.length
                    && a.role == b.role
            });
        if !same {
            return Err(bad(
                &e.prefix,
                "its gate, up and down matrices differ (name, dtype, shape or placement)".into(),
            ));
        }
        experts.insert(
            (e.layer as usize, e.expert as usize),
            ExpertSlot {
                extent: e.clone(),
                blake3: r.blake3.clone(),
                stored_blake3: r.stored_blake3.clone().filter(|_| e.is_encoded()),
            },
        );
    }
    Ok((tensors, experts))
}

impl WeightSource for BundleSource {
    fn tensor(&self, name: &str) -> Result<Arc<HostTensor>, WeightError> {
        let (t, blake3) = self
            .tensors
            .get(name)
            .ok_or_else(|| WeightError::MissingTensor(name.to_string()))?;
        let bytes = self.read_verified(name, t.offset, t.length, blake3)?;
        {
            let mut l = self.ledger.lock().expect("ledger lock");
            Ledger::note(&mut l.tensors, name, t.length, "blake3", blake3);
        }
        let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
        let data = match t.dtype {
            Dtype::BF16 => TensorData::Bf16(AlignedVec::<u16>::from_le_bytes(&bytes)),
            Dtype::F32 => TensorData::F32(AlignedVec::<f32>::from_le_bytes(&bytes)),
            other => {
                return Err(WeightError::UnsupportedDtype {
                    name: name.to_string(),
                    dtype: other.to_string(),
                })
            }
        };
        Ok(Arc::new(HostTensor::new(name, shape, data)?))
    }

    fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn experts(&self, layer: usize, ids: &[usize]) -> Result<Vec<Arc<ExpertWeights>>, WeightError> {
        for &id in ids {
            if !self.experts.contains_key(&(layer, id)) {
                return Err(WeightError::MissingExpert {
                    layer,
                    expert: id,
                    name: format!("layer {layer} expert {id}"),
                });
            }
        }
        let missing: Vec<usize> = {
            let r = self.resident.lock().expect("resident lock");
            ids.iter()
                .copied()
                .filter(|&id| !r.contains_key(&(layer, id)))
                .collect()
        };
        let loaded: Vec<(usize, Arc<ExpertWeights>)> = missing
            .par_iter()
            .map(|&id| self.read_expert((layer, id)).map(|w| (id, Arc::new(w))))
            .collect::<Result<_, _>>()?;
        let mut r = self.resident.lock().expect("resident lock");
        for (id, w) in loaded {
            r.insert((layer, id), w);
        }
        Ok(ids.iter().map(|&id| r[&(layer, id)].clone()).collect())
    }
}
