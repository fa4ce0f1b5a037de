//! A named verification failure: what failed (a tensor, an expert prefix, a file) and how.

use std::borrow::Cow;
use std::fmt;

use serde::Serialize;

/// How an entry failed. The kebab-case names are part of the JSON output and stable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FailureKind {
    /// `model.jnf`'s header breaks a rule of docs/FORMAT.md (nothing inside it is checked).
    InvalidHeader,
    /// `manifest.toml` is not a valid manifest (nothing it lists is checked).
    InvalidManifest,
    /// The manifest's `root_digest` is not the digest of its entries.
    RootDigest,
    /// The header and the manifest describe an entry differently (dtype, shape, length,
    /// matrices, layer or expert number), or disagree on the format version or source shards.
    HeaderManifestMismatch,
    /// In the bundle's container (or the source checkpoint) but not in the manifest.
    MissingInManifest,
    /// In the manifest (or the source checkpoint) but not in the bundle.
    MissingInBundle,
    /// In the bundle but not in the source checkpoint.
    MissingInSource,
    /// The SHA-256 of a tensor's or extent's bytes is not the manifest's.
    Sha256Mismatch,
    /// The BLAKE3 of a tensor's or extent's bytes is not the manifest's.
    Blake3Mismatch,
    /// A padding byte (after a tensor, an extent, or the header JSON) is not zero.
    PaddingNotZero,
    /// A copied file's size or SHA-256 is not the manifest's.
    FileSha256Mismatch,
    /// A file in the bundle directory that the manifest does not list.
    UnlistedFile,
    /// A listed file is a directory, FIFO, device or socket.
    NotARegularFile,
    /// A source shard's whole-file SHA-256 is not the manifest's.
    ShardSha256Mismatch,
    /// A source shard's size is not the manifest's.
    ShardSizeMismatch,
    /// The header's recorded source (shard, offset), dtype or shape for a tensor is not where
    /// or what the source checkpoint has.
    SourceLocationMismatch,
    /// A tensor's bytes in the bundle are not the source checkpoint's bytes.
    SourceBytesDiffer,
}

impl FailureKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::InvalidHeader => "invalid-header",
            FailureKind::InvalidManifest => "invalid-manifest",
            FailureKind::RootDigest => "root-digest",
            FailureKind::HeaderManifestMismatch => "header-manifest-mismatch",
            FailureKind::MissingInManifest => "missing-in-manifest",
            FailureKind::MissingInBundle => "missing-in-bundle",
            FailureKind::MissingInSource => "missing-in-source",
            FailureKind::Sha256Mismatch => "sha256-mismatch",
            FailureKind::Blake3Mismatch => "blake3-mismatch",
            FailureKind::PaddingNotZero => "padding-not-zero",
            FailureKind::FileSha256Mismatch => "file-sha256-mismatch",
            FailureKind::UnlistedFile => "unlisted-file",
            FailureKind::NotARegularFile => "not-a-regular-file",
            FailureKind::ShardSha256Mismatch => "shard-sha256-mismatch",
            FailureKind::ShardSizeMismatch => "shard-size-mismatch",
            FailureKind::SourceLocationMismatch => "source-location-mismatch",
            FailureKind::SourceBytesDiffer => "source-bytes-differ",
        }
    }
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One failed check. `name` is a tensor name, an expert prefix (`model.layers.L.mlp.experts.E`),
/// a file name (`model.jnf`, `manifest.toml`, `config.json`, a shard), never a path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Failure {
    pub name: String,
    pub kind: FailureKind,
    /// One human sentence: what was expected and what was found.
    pub detail: String,
}

impl Failure {
    pub fn new(name: impl Into<String>, kind: FailureKind, detail: impl Into<String>) -> Self {
        Failure {
            name: name.into(),
            kind,
            detail: detail.into(),
        }
    }
}

impl fmt::Display for Failure {
    /// `NAME: KIND: DETAIL` on one line; control characters in names are escaped so that a
    /// hostile file name cannot break the line or fake another failure.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {}: {}",
            one_line(&self.name),
            self.kind,
            one_line(&self.detail)
        )
    }
}

/// `s` unchanged, or with control characters escaped if it has any.
pub fn one_line(s: &str) -> Cow<'_, str> {
    if s.chars().any(char::is_control) {
        Cow::Owned(s.escape_debug().to_string())
    } else {
        Cow::Borrowed(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kind_names_match_serde() {
        for k in [
            FailureKind::InvalidHeader,
            FailureKind::RootDigest,
            FailureKind::HeaderManifestMismatch,
            FailureKind::Sha256Mismatch,
            FailureKind::Blake3Mismatch,
            FailureKind::PaddingNotZero,
            FailureKind::SourceBytesDiffer,
            FailureKind::ShardSha256Mismatch,
            FailureKind::FileSha256Mismatch,
            FailureKind::MissingInManifest,
            FailureKind::MissingInBundle,
        ] {
            assert_eq!(serde_json::to_value(k).unwrap(), k.as_str());
        }
    }

    #[test]
    fn display_escapes_newlines_in_names() {
        let f = Failure::new("evil\nok: fake", FailureKind::UnlistedFile, "x");
        let line = f.to_string();
        assert!(!line.contains('\n'), "{line}");
        assert!(line.starts_with("evil\\nok: fake: unlisted-file"), "{line}");
    }
}
