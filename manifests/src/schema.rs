//! The manifest schema (`manifest.toml`), its validation, and the root digest.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use jnf_format::{Dtype, MatrixRole};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::hash::{is_digest_hex, to_hex};
use crate::layer_of;

/// File name of the manifest inside a bundle.
pub const MANIFEST_FILE: &str = "manifest.toml";
/// Schema version written by this crate.
pub const MANIFEST_VERSION: u32 = 1;

#[derive(Debug, Error, PartialEq, Eq, Clone)]
pub enum ManifestError {
    /// The text is not TOML of the manifest schema.
    #[error("manifest is not valid TOML of the manifest schema: {0}")]
    Toml(String),
    /// The manifest was written by a newer, incompatible schema.
    #[error("manifest_version {0} is not supported (this build reads 1)")]
    UnsupportedVersion(u32),
    /// A digest field is not 64 lowercase hex characters.
    #[error("{name:?}: {field} is not 64 lowercase hex characters")]
    BadDigest { name: String, field: &'static str },
    /// Two entries share a name.
    #[error("duplicate entry {0:?}")]
    DuplicateName(String),
    /// A shard or file name could escape the bundle or source directory.
    #[error("file name {0:?} is not a plain name inside the directory")]
    UnsafeFileName(String),
    /// A tensor or expert name is empty or has control characters.
    #[error("invalid entry name {0:?}")]
    InvalidName(String),
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
    /// The recorded root digest is not the digest of the entries.
    #[error("root digest mismatch: manifest records {recorded}, entries give {computed}")]
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

/// A non-expert tensor: hashes over its bytes (never padding).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorRecord {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
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

/// An expert extent: hashes over its gate, up and down bytes in that order (never padding).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpertRecord {
    pub name: String,
    pub layer: u32,
    pub expert: u32,
    pub length: u64,
    pub sha256: String,
    pub blake3: String,
    /// How many elements of its three matrices are NaN or infinite.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub nonfinite: u64,
    pub matrices: Vec<MatrixRecord>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub manifest_version: u32,
    /// The JNF format version of the bundle's container, e.g. "1.0".
    pub format_version: String,
    /// The tool and version that wrote the bundle, e.g. "tarfa-convert 0.1.0".
    pub converter: String,
    pub root_digest: String,
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

fn safe_file_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\', '\0'])
        && !name.chars().any(|c| c.is_control())
}

fn valid_entry_name(name: &str) -> bool {
    !name.is_empty() && !name.chars().any(|c| c.is_control())
}

fn shape_bytes(shape: &[u64], dtype: Dtype) -> Option<u64> {
    shape
        .iter()
        .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
}

impl Manifest {
    /// Parse and validate (schema, digests, names, lengths, expert packing). The root digest is
    /// checked separately by [`Manifest::check_root`], so that an audit can report it by name.
    pub fn parse(text: &str) -> Result<Manifest, ManifestError> {
        let m: Manifest = toml::from_str(text).map_err(|e| {
            // toml's messages span several lines with a source excerpt; keep the first line.
            ManifestError::Toml(e.message().lines().next().unwrap_or("").to_string())
        })?;
        m.validate()?;
        Ok(m)
    }

    pub fn load(path: &Path) -> Result<Manifest, ManifestError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ManifestError::Io(format!("{}: {e}", path.display())))?;
        Manifest::parse(&text)
    }

    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("manifest serialises")
    }

    pub fn validate(&self) -> Result<(), ManifestError> {
        if self.manifest_version != MANIFEST_VERSION {
            return Err(ManifestError::UnsupportedVersion(self.manifest_version));
        }
        if !is_digest_hex(&self.root_digest) {
            return Err(ManifestError::BadDigest {
                name: "manifest".into(),
                field: "root_digest",
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
            let dtype = Dtype::parse(&t.dtype).map_err(|_| ManifestError::BadDtype {
                name: t.name.clone(),
                dtype: t.dtype.clone(),
            })?;
            if shape_bytes(&t.shape, dtype) != Some(t.length) {
                return Err(ManifestError::LengthMismatch {
                    name: t.name.clone(),
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
            if e.matrices.len() != 3 {
                return Err(ManifestError::BadMatrices {
                    name: e.name.clone(),
                    why: "needs 3 matrices",
                });
            }
            let mut sum = 0u64;
            for (m, role) in e.matrices.iter().zip(MatrixRole::ORDER) {
                if m.role != role {
                    return Err(ManifestError::BadMatrices {
                        name: e.name.clone(),
                        why: "matrices must be gate, up, down in that order",
                    });
                }
                if !valid_entry_name(&m.name) {
                    return Err(ManifestError::InvalidName(m.name.clone()));
                }
                unique(&m.name)?;
                if m.dtype != "BF16" {
                    return Err(ManifestError::BadDtype {
                        name: m.name.clone(),
                        dtype: m.dtype.clone(),
                    });
                }
                if shape_bytes(&m.shape, Dtype::BF16) != Some(m.length) {
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
        }
        Ok(())
    }

    /// The lines the root digest covers: `<sha256 hex>  <name>` for every shard, copied file,
    /// tensor and expert, sorted bytewise (as `LC_ALL=C sort` would).
    pub fn digest_lines(&self) -> Vec<String> {
        let mut lines: Vec<String> = self
            .shards
            .iter()
            .map(|s| (&s.sha256, &s.name))
            .chain(self.files.iter().map(|f| (&f.sha256, &f.name)))
            .chain(self.tensors.iter().map(|t| (&t.sha256, &t.name)))
            .chain(self.experts.iter().map(|e| (&e.sha256, &e.name)))
            .map(|(h, n)| format!("{h}  {n}"))
            .collect();
        lines.sort_unstable();
        lines
    }

    /// SHA-256 of the sorted digest lines, each terminated by `\n`.
    pub fn compute_root_digest(&self) -> String {
        let mut h = Sha256::new();
        for l in self.digest_lines() {
            h.update(l.as_bytes());
            h.update(b"\n");
        }
        to_hex(&h.finalize())
    }

    pub fn check_root(&self) -> Result<(), ManifestError> {
        let computed = self.compute_root_digest();
        if computed != self.root_digest {
            return Err(ManifestError::RootMismatch {
                recorded: self.root_digest.clone(),
                computed,
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
