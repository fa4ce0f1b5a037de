//! The manifest schema (`manifest.toml`), its validation, and the root digest.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use jnf_format::{align_up, Dtype, ExtentCodec, ExtentEncoding, JnfError, MatrixRole, ALIGN};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::hash::{is_digest_hex, sha256_hex};
use crate::layer_of;

/// File name of the manifest inside a bundle.
pub const MANIFEST_FILE: &str = "manifest.toml";
/// Schema version of a format-version-1 bundle's manifest, written for it exactly as before
/// format version 2 existed. Version 1's root covered only the SHA-256 lines (not BLAKE3,
/// dtypes, shapes, offsets or the header): it is refused, never upgraded.
pub const MANIFEST_VERSION: u32 = 2;
/// Schema version of a format-version-2 bundle's manifest: version 2's, with every expert's
/// `codec`, `stored_length` and `stored_blake3`. A new number, so that a reader of version 2
/// (released before format version 2) refuses it by its version rather than by a field name.
pub const MANIFEST_VERSION_CODECS: u32 = 3;

/// The manifest_version a bundle of format `major` has, if this build knows the major.
pub fn manifest_version_for(major: u16) -> Option<u32> {
    match major {
        1 => Some(MANIFEST_VERSION),
        2 => Some(MANIFEST_VERSION_CODECS),
        _ => None,
    }
}

/// `"MAJOR.MINOR"` as written in `format_version`, if it is that.
pub fn parse_format_version(s: &str) -> Option<(u16, u16)> {
    let (major, minor) = s.split_once('.')?;
    let digits = |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit());
    if !digits(major) || !digits(minor) {
        return None;
    }
    Some((major.parse().ok()?, minor.parse().ok()?))
}
/// The exactness contract's version (docs/EXACTNESS.md), recorded in every manifest this build
/// writes so that the root digest says which contract the bundle was converted under.
pub const CONTRACT_VERSION: u32 = 1;
/// What the first line of a manifest is, before the 64 hex digits and the closing quote.
const ROOT_LINE_PREFIX: &str = "root_digest = \"";

#[derive(Debug, Error, PartialEq, Eq, Clone)]
pub enum ManifestError {
    /// The text is not TOML of the manifest schema.
    #[error("manifest is not valid TOML of the manifest schema: {0}")]
    Toml(String),
    /// The manifest was written by a newer, incompatible schema.
    #[error("manifest_version {0} is not supported (this build reads 2 and 3)")]
    UnsupportedVersion(u32),
    /// The bundle's format version is newer than this reader's (or no JNF version): named
    /// before anything of its schema is judged, so that a user is told to upgrade.
    #[error("{0}")]
    FormatVersion(JnfError),
    /// `format_version` is not `MAJOR.MINOR`.
    #[error("format_version {0:?} is not MAJOR.MINOR")]
    BadFormatVersion(String),
    /// `manifest_version` is not the one of the bundle's format version.
    #[error(
        "manifest_version {manifest_version} does not go with format_version {format_version:?} \
         (format 1.x has manifest_version 2, format 2.x manifest_version 3)"
    )]
    VersionPair {
        manifest_version: u32,
        format_version: String,
    },
    /// An expert's storage fields (`codec`, `stored_length`, `stored_blake3`) are missing in a
    /// version-3 manifest, present in a version-2 one, or break a rule of format version 2.
    #[error("{name:?}: {why}")]
    BadStorage { name: String, why: String },
    /// A manifest of an older schema whose root digest binds too little to be trusted.
    #[error(
        "manifest_version {0} is refused: its root digest does not bind BLAKE3 digests, dtypes, \
         shapes, offsets or the container header; re-convert the checkpoint with this \
         tarfa-convert (manifest_version 2)"
    )]
    LegacyVersion(u32),
    /// The first line is not `root_digest = "<64 lowercase hex>"` followed by a newline.
    #[error("the first line is not root_digest = \"<64 lowercase hex>\" (manifest_version 2)")]
    BadRootLine,
    /// A digest field is not 64 lowercase hex characters.
    #[error("{name:?}: {field} is not 64 lowercase hex characters")]
    BadDigest { name: String, field: &'static str },
    /// Two entries share a name.
    #[error("duplicate entry {0:?}")]
    DuplicateName(String),
    /// A shard or file name could escape the bundle or source directory.
    #[error("file name {0:?} is not a plain name inside the directory")]
    UnsafeFileName(String),
    /// A tensor or expert name is empty or has control, bidi-override or other invisible
    /// formatting characters (which could make one name display as another).
    #[error("invalid entry name {0:?}: empty, or has control or bidi/format characters")]
    InvalidName(String),
    /// An offset is not a multiple of 4096, or an extent's padded_length is not its length
    /// rounded up to 4096.
    #[error("{name:?}: {why}")]
    BadPlacement { name: String, why: &'static str },
    /// A dtype is unknown or refused (quantized, non-float), or an expert matrix is not BF16.
    #[error("{name:?}: dtype {dtype:?} is not allowed here")]
    BadDtype { name: String, dtype: String },
    /// A length disagrees with shape x dtype size (with checked arithmetic).
    #[error("{name:?}: length does not equal shape x dtype size")]
    LengthMismatch { name: String },
    /// An expert's matrices are not gate, up, down packed back to back summing to its length.
    #[error("expert {name:?}: {why}")]
    BadMatrices { name: String, why: &'static str },
    /// An expert's name does not match its layer and expert numbers.
    #[error("expert {name:?} does not name layer {layer}, expert {expert}")]
    NameMismatch {
        name: String,
        layer: u32,
        expert: u32,
    },
    /// The recorded root digest is not the SHA-256 of the manifest's bytes after its first line.
    #[error("root digest mismatch: the first line records {recorded}, the SHA-256 of the lines after it is {computed}")]
    RootMismatch { recorded: String, computed: String },
    /// The manifest file could not be read.
    #[error("cannot read manifest: {0}")]
    Io(String),
}

/// A source checkpoint shard: its whole-file SHA-256 is the Hub's LFS sha256.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardRecord {
    pub name: String,
    pub size: u64,
    pub sha256: String,
}

/// A file copied into the bundle (config.json, generation_config.json, tokenizer files).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileRecord {
    pub name: String,
    pub size: u64,
    pub sha256: String,
}

/// `model.jnf`'s header JSON (the `header_len` bytes after the 24-byte preamble): binds the
/// layout, the metadata and every tensor's source record into the root digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeaderRecord {
    pub length: u64,
    pub sha256: String,
}

impl HeaderRecord {
    /// The record of the header JSON in `container`, the bytes of a model.jnf from its start
    /// (at least the preamble and the JSON): `header_len` is the u64 at bytes 16..24. `None`
    /// if `container` is shorter than that.
    pub fn of_container_prefix(container: &[u8]) -> Option<HeaderRecord> {
        let len = u64::from_le_bytes(container.get(16..24)?.try_into().ok()?);
        let end = 24usize.checked_add(usize::try_from(len).ok()?)?;
        Some(HeaderRecord {
            length: len,
            sha256: sha256_hex(container.get(24..end)?),
        })
    }

    /// The record of the header JSON of an open model.jnf (read with `pread`, at most
    /// `max_len` bytes of JSON: a longer declared length is an `InvalidData` error).
    pub fn read_from(file: &std::fs::File, max_len: u64) -> std::io::Result<HeaderRecord> {
        use std::os::unix::fs::FileExt;
        let mut pre = [0u8; 24];
        file.read_exact_at(&mut pre, 0)?;
        let len = u64::from_le_bytes(pre[16..24].try_into().expect("8 bytes"));
        if len > max_len {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "header_len is larger than a header may be",
            ));
        }
        let mut json = vec![0u8; len as usize];
        file.read_exact_at(&mut json, 24)?;
        Ok(HeaderRecord {
            length: len,
            sha256: sha256_hex(&json),
        })
    }
}

/// A non-expert tensor: hashes over its bytes (never padding).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorRecord {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    /// Absolute offset in model.jnf (as in the header).
    pub offset: u64,
    pub length: u64,
    pub sha256: String,
    pub blake3: String,
    /// How many elements are NaN or infinite (carried exactly, but an auditor is told).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub nonfinite: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// One matrix inside an expert extent; `offset` is relative to the extent start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatrixRecord {
    pub role: MatrixRole,
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    pub offset: u64,
    pub length: u64,
}

/// One byte range of a source tensor that an expert's extent was made from (fused experts:
/// expert `e`'s slice of a tensor holding every expert of the layer).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceRange {
    /// The source tensor, e.g. `model.layers.0.mlp.experts.gate_up_proj`.
    pub tensor: String,
    /// The shard that holds it.
    pub shard: String,
    /// Absolute byte offset of the range in the shard.
    pub offset: u64,
    pub length: u64,
}

/// An expert extent: hashes over its gate, up and down bytes in that order (never padding),
/// decoded when the extent is stored encoded; and in a version-3 manifest how it is stored.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpertRecord {
    pub name: String,
    pub layer: u32,
    pub expert: u32,
    /// Absolute offset of the extent in model.jnf (as in the header).
    pub offset: u64,
    pub length: u64,
    /// The stored length rounded up to 4096 (`length`'s in version 2): what one O_DIRECT
    /// read of the extent fetches.
    pub padded_length: u64,
    /// Of the decoded bytes (the checkpoint's), whatever the codec.
    pub sha256: String,
    pub blake3: String,
    /// How many elements of its three matrices are NaN or infinite.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub nonfinite: u64,
    /// Version 3: how the extent is stored (`jnf_format::ExtentCodec::as_str`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub codec: Option<String>,
    /// Version 3: the stored bytes before padding (`length` when raw).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_length: Option<u64>,
    /// Version 3: the BLAKE3 of the stored bytes, checked before they are decoded (equal to
    /// `blake3` when raw), so that a corrupt extent is named before it reaches the decoder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_blake3: Option<String>,
    /// The declared permutation (`jnf_format::Relayout::name`) that made the extent from the
    /// [`sources`](Self::sources) concatenated; absent when the extent is those bytes as they
    /// are (MXFP4 as released) or the expert had tensors of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relayout: Option<String>,
    /// Where a fused expert's bytes came from, in extent order (empty for an expert with
    /// tensors of its own: the header's matrix sources say where those came from).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<SourceRange>,
    pub matrices: Vec<MatrixRecord>,
}

/// A manifest. On disk its first line is `root_digest = "<hex>"` and the root digest is the
/// SHA-256 of every byte after that line, so every field (present and future) is bound and
/// nothing is canonicalised: `tail -n +2 manifest.toml | sha256sum` recomputes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// The root digest the first line records (or, after [`Manifest::seal`], the one computed).
    #[serde(skip)]
    pub root_digest: String,
    /// The SHA-256 of the bytes after the first line: as read by [`Manifest::parse`], or as
    /// [`Manifest::seal`] serialises them. [`Manifest::check_root`] compares the two.
    #[serde(skip)]
    pub computed_root: String,
    pub manifest_version: u32,
    /// The JNF format version of the bundle's container, e.g. "1.0".
    pub format_version: String,
    /// The exactness contract's version (docs/EXACTNESS.md) the bundle was converted under.
    pub contract_version: u32,
    /// The tool and version that wrote the bundle, e.g. "tarfa-convert 0.1.0".
    pub converter: String,
    /// model.jnf's header JSON.
    pub header: HeaderRecord,
    /// Free-form provenance, e.g. `kind = "hub"` or the synthetic generator's parameters.
    #[serde(default)]
    pub source: BTreeMap<String, String>,
    #[serde(default)]
    pub shards: Vec<ShardRecord>,
    #[serde(default)]
    pub files: Vec<FileRecord>,
    #[serde(default)]
    pub tensors: Vec<TensorRecord>,
    #[serde(default)]
    pub experts: Vec<ExpertRecord>,
}

/// Control characters, and the invisible formatting characters that reorder or disguise text
/// on a terminal: bidi embeddings and overrides (U+202A-202E), isolates (U+2066-2069), the
/// left-to-right / right-to-left and Arabic letter marks (U+200E, U+200F, U+061C).
pub fn is_unsafe_char(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}' | '\u{200E}' | '\u{200F}' | '\u{061C}')
}

fn safe_file_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\', '\0'])
        && !name.chars().any(is_unsafe_char)
}

/// A shard name as an index spells it: relative, no `..`, no unsafe characters.
fn safe_file_name_path(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('/')
        && name.split('/').all(|part| part != ".." && !part.is_empty())
        && !name.chars().any(is_unsafe_char)
}

fn valid_entry_name(name: &str) -> bool {
    !name.is_empty() && !name.chars().any(is_unsafe_char)
}

/// The 64 hex digits of a manifest's first line, if it has exactly the v2 form.
fn root_line_digest(line: &str) -> Option<&str> {
    let hex = line.strip_prefix(ROOT_LINE_PREFIX)?.strip_suffix('"')?;
    is_digest_hex(hex).then_some(hex)
}

fn shape_bytes(shape: &[u64], dtype: Dtype) -> Option<u64> {
    shape
        .iter()
        .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
}

impl Manifest {
    /// Parse and validate (the first line's form, schema, digests, names, lengths, placement,
    /// expert packing), and compute the SHA-256 of the bytes after the first line. Whether that
    /// equals the recorded root is checked separately by [`Manifest::check_root`], so that an
    /// audit can report it by name and go on.
    pub fn parse(text: &str) -> Result<Manifest, ManifestError> {
        // A newer format is named before anything of its schema is judged: whatever else its
        // manifest has, this reader cannot read its container.
        if let Some(Err(e)) = declared_format_version(text).map(check_format_version) {
            if matches!(e, ManifestError::FormatVersion(_)) {
                return Err(e);
            }
        }
        let (first, body) = text.split_once('\n').unwrap_or((text, ""));
        let Some(recorded) = root_line_digest(first) else {
            // Not a v2 first line: name an older (or newer) schema if the text says which.
            return Err(match declared_version(text) {
                Some(v) if v < MANIFEST_VERSION => ManifestError::LegacyVersion(v),
                Some(v) if v > MANIFEST_VERSION_CODECS => ManifestError::UnsupportedVersion(v),
                _ => ManifestError::BadRootLine,
            });
        };
        let mut m: Manifest = toml::from_str(body).map_err(|e| {
            // Another schema's fields under a v2 root line: name its version, not a field.
            match declared_version(body) {
                Some(v) if v < MANIFEST_VERSION => ManifestError::LegacyVersion(v),
                Some(v) if v > MANIFEST_VERSION_CODECS => ManifestError::UnsupportedVersion(v),
                // toml's messages span several lines with a source excerpt; keep the first.
                _ => ManifestError::Toml(e.message().lines().next().unwrap_or("").to_string()),
            }
        })?;
        m.root_digest = recorded.to_string();
        m.computed_root = sha256_hex(body.as_bytes());
        m.validate()?;
        Ok(m)
    }

    pub fn load(path: &Path) -> Result<Manifest, ManifestError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ManifestError::Io(format!("{}: {e}", path.display())))?;
        Manifest::parse(&text)
    }

    /// The manifest's TOML after the root line: what the root digest is the SHA-256 of.
    pub fn body_toml(&self) -> String {
        toml::to_string(self).expect("manifest serialises")
    }

    /// The SHA-256 of [`Manifest::body_toml`]: the root digest of this manifest once written.
    pub fn compute_root_digest(&self) -> String {
        sha256_hex(self.body_toml().as_bytes())
    }

    /// Record the root digest of the manifest as it now is (after building or editing it).
    pub fn seal(&mut self) {
        self.root_digest = self.compute_root_digest();
        self.computed_root = self.root_digest.clone();
    }

    /// The whole `manifest.toml`: the root line, then [`Manifest::body_toml`]. Call
    /// [`Manifest::seal`] first; the root line carries `root_digest` as it is.
    pub fn to_toml(&self) -> String {
        format!(
            "{ROOT_LINE_PREFIX}{}\"\n{}",
            self.root_digest,
            self.body_toml()
        )
    }

    pub fn validate(&self) -> Result<(), ManifestError> {
        match self.manifest_version {
            v if v < MANIFEST_VERSION => return Err(ManifestError::LegacyVersion(v)),
            v if v > MANIFEST_VERSION_CODECS => return Err(ManifestError::UnsupportedVersion(v)),
            _ => {}
        }
        let (major, _) = check_format_version(&self.format_version)?;
        if manifest_version_for(major) != Some(self.manifest_version) {
            return Err(ManifestError::VersionPair {
                manifest_version: self.manifest_version,
                format_version: self.format_version.clone(),
            });
        }
        let codecs = self.manifest_version >= MANIFEST_VERSION_CODECS;
        if !is_digest_hex(&self.root_digest) {
            return Err(ManifestError::BadDigest {
                name: "manifest".into(),
                field: "root_digest",
            });
        }
        if !is_digest_hex(&self.header.sha256) {
            return Err(ManifestError::BadDigest {
                name: "header".into(),
                field: "sha256",
            });
        }
        let mut names = HashSet::new();
        let mut unique = |n: &str| {
            if names.insert(n.to_string()) {
                Ok(())
            } else {
                Err(ManifestError::DuplicateName(n.into()))
            }
        };
        let digest = |name: &str, field: &'static str, v: &str| {
            if is_digest_hex(v) {
                Ok(())
            } else {
                Err(ManifestError::BadDigest {
                    name: name.into(),
                    field,
                })
            }
        };
        for (name, sha) in self
            .shards
            .iter()
            .map(|s| (&s.name, &s.sha256))
            .chain(self.files.iter().map(|f| (&f.name, &f.sha256)))
        {
            if !safe_file_name(name) {
                return Err(ManifestError::UnsafeFileName(name.clone()));
            }
            unique(name)?;
            digest(name, "sha256", sha)?;
        }
        for t in &self.tensors {
            if !valid_entry_name(&t.name) {
                return Err(ManifestError::InvalidName(t.name.clone()));
            }
            unique(&t.name)?;
            digest(&t.name, "sha256", &t.sha256)?;
            digest(&t.name, "blake3", &t.blake3)?;
            let dtype = Dtype::parse(&t.dtype)
                .ok()
                // U8 is only ever an MXFP4 expert part, never a tensor.
                .filter(|d| *d != Dtype::U8)
                .ok_or_else(|| ManifestError::BadDtype {
                    name: t.name.clone(),
                    dtype: t.dtype.clone(),
                })?;
            if shape_bytes(&t.shape, dtype) != Some(t.length) {
                return Err(ManifestError::LengthMismatch {
                    name: t.name.clone(),
                });
            }
            if t.offset % ALIGN != 0 {
                return Err(ManifestError::BadPlacement {
                    name: t.name.clone(),
                    why: "offset is not a multiple of 4096",
                });
            }
        }
        for e in &self.experts {
            if !valid_entry_name(&e.name) {
                return Err(ManifestError::InvalidName(e.name.clone()));
            }
            unique(&e.name)?;
            digest(&e.name, "sha256", &e.sha256)?;
            digest(&e.name, "blake3", &e.blake3)?;
            let suffix = format!(".experts.{}", e.expert);
            if layer_of(&e.name) != Some(e.layer) || !e.name.ends_with(&suffix) {
                return Err(ManifestError::NameMismatch {
                    name: e.name.clone(),
                    layer: e.layer,
                    expert: e.expert,
                });
            }
            let mxfp4 = e.matrices.first().map(|m| m.role) == Some(MatrixRole::GateUpBlocks);
            let (roles, dtype): (&[MatrixRole], Dtype) = if mxfp4 {
                (&MatrixRole::MXFP4_ORDER, Dtype::U8)
            } else {
                (&MatrixRole::ORDER, Dtype::BF16)
            };
            if e.matrices.len() != roles.len() {
                return Err(ManifestError::BadMatrices {
                    name: e.name.clone(),
                    why: "needs 3 matrices (or the 4 MXFP4 parts)",
                });
            }
            if let Some(r) = &e.relayout {
                if jnf_format::Relayout::from_name(r).is_none() || mxfp4 || e.sources.is_empty() {
                    return Err(ManifestError::BadMatrices {
                        name: e.name.clone(),
                        why: "relayout is not a declared permutation of BF16 fused sources",
                    });
                }
            }
            let sourced: Option<u64> = e
                .sources
                .iter()
                .try_fold(0u64, |acc, r| acc.checked_add(r.length));
            if !e.sources.is_empty() && sourced != Some(e.length) {
                return Err(ManifestError::BadMatrices {
                    name: e.name.clone(),
                    why: "its source ranges do not add up to its length",
                });
            }
            for r in &e.sources {
                if !valid_entry_name(&r.tensor) || !safe_file_name_path(&r.shard) {
                    return Err(ManifestError::InvalidName(r.tensor.clone()));
                }
            }
            let mut sum = 0u64;
            for (m, &role) in e.matrices.iter().zip(roles) {
                if m.role != role {
                    return Err(ManifestError::BadMatrices {
                        name: e.name.clone(),
                        why: "matrices must be gate, up, down in that order (or the MXFP4 parts)",
                    });
                }
                if !valid_entry_name(&m.name) {
                    return Err(ManifestError::InvalidName(m.name.clone()));
                }
                unique(&m.name)?;
                if m.dtype != dtype.as_str() {
                    return Err(ManifestError::BadDtype {
                        name: m.name.clone(),
                        dtype: m.dtype.clone(),
                    });
                }
                if shape_bytes(&m.shape, dtype) != Some(m.length) {
                    return Err(ManifestError::LengthMismatch {
                        name: m.name.clone(),
                    });
                }
                if m.offset != sum {
                    return Err(ManifestError::BadMatrices {
                        name: e.name.clone(),
                        why: "matrices are not packed back to back from offset 0",
                    });
                }
                sum = sum
                    .checked_add(m.length)
                    .ok_or_else(|| ManifestError::LengthMismatch {
                        name: m.name.clone(),
                    })?;
            }
            if sum != e.length {
                return Err(ManifestError::BadMatrices {
                    name: e.name.clone(),
                    why: "length is not the sum of the matrices",
                });
            }
            if e.offset % ALIGN != 0 {
                return Err(ManifestError::BadPlacement {
                    name: e.name.clone(),
                    why: "offset is not a multiple of 4096",
                });
            }
            let stored_length = check_storage(e, codecs, mxfp4)?;
            if align_up(stored_length) != Some(e.padded_length) {
                return Err(ManifestError::BadPlacement {
                    name: e.name.clone(),
                    why: if codecs {
                        "padded_length is not stored_length rounded up to 4096"
                    } else {
                        "padded_length is not length rounded up to 4096"
                    },
                });
            }
        }
        Ok(())
    }

    /// The recorded root digest is the SHA-256 of the bytes after the first line, as they were
    /// read by [`Manifest::parse`] (an edit in memory is checked once written and read back).
    pub fn check_root(&self) -> Result<(), ManifestError> {
        if self.computed_root != self.root_digest {
            return Err(ManifestError::RootMismatch {
                recorded: self.root_digest.clone(),
                computed: self.computed_root.clone(),
            });
        }
        Ok(())
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorRecord> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Index of experts by (layer, expert).
    pub fn expert_index(&self) -> BTreeMap<(u32, u32), &ExpertRecord> {
        self.experts
            .iter()
            .map(|e| ((e.layer, e.expert), e))
            .collect()
    }
}

/// An expert's storage fields against the manifest's version and format version 2's rules
/// (`jnf_format::check_extent_storage`, the header's own); the stored length (`length` in a
/// version-2 manifest).
fn check_storage(e: &ExpertRecord, codecs: bool, mxfp4: bool) -> Result<u64, ManifestError> {
    let bad = |why: String| ManifestError::BadStorage {
        name: e.name.clone(),
        why,
    };
    let (codec, stored_length, stored_blake3) =
        match (&e.codec, e.stored_length, &e.stored_blake3) {
            (None, None, None) if !codecs => return Ok(e.length),
            (Some(c), Some(n), Some(b)) if codecs => (c, n, b),
            _ if codecs => return Err(bad(
                "a manifest_version 3 expert records its codec, stored_length and stored_blake3"
                    .into(),
            )),
            _ => {
                return Err(bad(
                    "codec, stored_length and stored_blake3 are manifest_version 3 fields".into(),
                ))
            }
        };
    if !crate::hash::is_digest_hex(stored_blake3) {
        return Err(ManifestError::BadDigest {
            name: e.name.clone(),
            field: "stored_blake3",
        });
    }
    let codec = ExtentCodec::from_name(codec).ok_or_else(|| {
        bad(format!(
            "unknown codec {codec:?} (this build knows raw and exp-zstd)"
        ))
    })?;
    let encoding = if mxfp4 {
        ExtentEncoding::Mxfp4
    } else {
        ExtentEncoding::Bf16
    };
    jnf_format::check_extent_storage(codec, encoding, stored_length, e.length).map_err(bad)?;
    // Raw, the stored bytes are the extent: one BLAKE3, recorded twice, must agree.
    if codec == ExtentCodec::Raw && *stored_blake3 != e.blake3 {
        return Err(bad(
            "a raw extent's stored_blake3 is not its blake3 (the stored bytes are the extent)"
                .into(),
        ));
    }
    Ok(stored_length)
}

/// `format_version` parsed and checked against the versions this build reads.
fn check_format_version(s: &str) -> Result<(u16, u16), ManifestError> {
    let (major, minor) =
        parse_format_version(s).ok_or_else(|| ManifestError::BadFormatVersion(s.to_string()))?;
    jnf_format::check_version(major, minor, jnf_format::READS)
        .map_err(ManifestError::FormatVersion)?;
    Ok((major, minor))
}

/// The `format_version` a manifest's text declares near its top (where this crate writes it),
/// found without parsing the whole manifest: a cheap look before the schema is judged.
fn declared_format_version(text: &str) -> Option<&str> {
    text.lines()
        .take(16)
        .find_map(|l| l.strip_prefix("format_version = \""))
        .and_then(|rest| rest.strip_suffix('"'))
}

/// The integer `manifest_version` a TOML text declares at its top level, if it parses that far.
fn declared_version(text: &str) -> Option<u32> {
    let table: toml::Table = toml::from_str(text).ok()?;
    table
        .get("manifest_version")?
        .as_integer()
        .and_then(|v| u32::try_from(v).ok())
}
