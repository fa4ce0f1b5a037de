//! Bundle manifests: what every byte of a JNF bundle is, by SHA-256 (and BLAKE3 for fast checks
//! at run time), the root digest over all of it, and the difference between two releases.
//!
//! The manifest (`manifest.toml` in a bundle) is the bundle's provenance: per source shard its
//! size and SHA-256 (the Hub's LFS sha256), the SHA-256 of config and tokenizer files, per
//! non-expert tensor and per expert extent the hashes of its bytes. docs/FORMAT.md defines every
//! hash so that a third party can recompute it with `sha256sum`.
//!
//! This crate parses and validates manifests, computes digests and diffs. It never reads tensor
//! data itself: hashing bytes is the caller's job, and a diff of two manifests reads no data.

mod diff;
pub mod hash;
pub mod regular;
mod schema;

pub use diff::{diff, Change, ChangeKind, EntryKind, LayerKey, LayerSummary, ManifestDiff};
pub use schema::{
    is_unsafe_char, manifest_version_for, parse_format_version, ExpertRecord, FileRecord,
    HeaderRecord, Manifest, ManifestError, MatrixRecord, ShardRecord, SourceRange, TensorRecord,
    CONTRACT_VERSION, MANIFEST_FILE, MANIFEST_VERSION, MANIFEST_VERSION_CODECS,
};

/// The layer number in a name like `model.layers.12.mlp.experts.3`, if it has one.
pub fn layer_of(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("model.layers.")?;
    let digits = rest.split('.').next()?;
    digits.parse().ok()
}
