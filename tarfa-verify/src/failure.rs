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
    /// The manifest's `root_digest` is not the SHA-256 of its lines after the first.
    RootDigest,
    /// model.jnf's header JSON (length or SHA-256) is not the one the manifest records.
    HeaderDigestMismatch,
    /// The header and the manifest describe an entry differently (dtype, shape, length,
    /// matrices, layer or expert number), or disagree on the format version or source shards.
    HeaderManifestMismatch,
    /// In the bundle's container (or the source checkpoint) but not in the manifest.
    MissingInManifest,
    /// In the manifest (or the source checkpoint) but not in the bundle.
    MissingInBundle,
    /// In the bundle but not in the source checkpoint.
    MissingInSource,
    /// The SHA-256 of a tensor's or extent's bytes (an encoded extent's decoded bytes) is not
    /// the manifest's.
    Sha256Mismatch,
    /// The BLAKE3 of a tensor's or extent's bytes is not the manifest's.
    Blake3Mismatch,
    /// The BLAKE3 of an encoded extent's stored bytes is not the manifest's `stored_blake3`:
    /// named before anything is decoded (and nothing is).
    StoredBlake3Mismatch,
    /// An encoded extent whose stored bytes verified does not decode (a bundle written
    /// wrong, or a decoder that disagrees with the encoder).
    StoredNotDecodable,
    /// A padding byte (after a tensor, an extent, or the header JSON) is not zero.
    PaddingNotZero,
    /// A copied file's size or SHA-256 is not the manifest's.
    FileSha256Mismatch,
    /// A file in the bundle directory that the manifest does not list.
    UnlistedFile,
    /// A source shard's whole-file SHA-256 is not the manifest's.
    ShardSha256Mismatch,
    /// A source shard's size is not the manifest's.
    ShardSizeMismatch,
    /// The header's recorded source (shard, offset), dtype or shape for a tensor is not where
    /// or what the source checkpoint has.
    SourceLocationMismatch,
    /// A tensor's bytes in the bundle are not the source checkpoint's bytes.
    SourceBytesDiffer,
    /// A copied file (config.json, tokenizer.json, ...) is not the source's file, byte for byte.
    SourceFileDiffers,
}

impl FailureKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::InvalidHeader => "invalid-header",
            FailureKind::InvalidManifest => "invalid-manifest",
            FailureKind::RootDigest => "root-digest",
            FailureKind::HeaderDigestMismatch => "header-digest-mismatch",
            FailureKind::HeaderManifestMismatch => "header-manifest-mismatch",
            FailureKind::MissingInManifest => "missing-in-manifest",
            FailureKind::MissingInBundle => "missing-in-bundle",
            FailureKind::MissingInSource => "missing-in-source",
            FailureKind::Sha256Mismatch => "sha256-mismatch",
            FailureKind::Blake3Mismatch => "blake3-mismatch",
            FailureKind::StoredBlake3Mismatch => "stored-blake3-mismatch",
            FailureKind::StoredNotDecodable => "stored-not-decodable",
            FailureKind::PaddingNotZero => "padding-not-zero",
            FailureKind::FileSha256Mismatch => "file-sha256-mismatch",
            FailureKind::UnlistedFile => "unlisted-file",
            FailureKind::ShardSha256Mismatch => "shard-sha256-mismatch",
            FailureKind::ShardSizeMismatch => "shard-size-mismatch",
            FailureKind::SourceLocationMismatch => "source-location-mismatch",
            FailureKind::SourceBytesDiffer => "source-bytes-differ",
            FailureKind::SourceFileDiffers => "source-file-differs",
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

/// `s` unchanged, or with anything unusual escaped if it has any: control characters, the
/// bidi and invisible formatting characters of [`tarfa_manifest::is_unsafe_char`] (which can
/// make a terminal show one name as another), the other zero-width characters, and private-use
/// code points, each as `\u{hex}` (`\n`, `\r`, `\t` for those three).
pub fn one_line(s: &str) -> Cow<'_, str> {
    if !s.chars().any(needs_escape) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if needs_escape(c) {
            match c {
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                c => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            }
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

fn needs_escape(c: char) -> bool {
    tarfa_manifest::is_unsafe_char(c)
        // Other invisible or zero-width format characters (U+200B-200D, U+2060-2064, U+FEFF,
        // U+00AD) and private or unassigned-looking code points are shown by number.
        || matches!(c, '\u{00AD}' | '\u{200B}'..='\u{200D}' | '\u{2028}'..='\u{2029}' | '\u{2060}'..='\u{2064}' | '\u{FEFF}' | '\u{E000}'..='\u{F8FF}')
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
            FailureKind::StoredBlake3Mismatch,
            FailureKind::StoredNotDecodable,
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
    fn one_line_escapes_bidi_and_controls() {
        assert_eq!(one_line("model.norm.weight"), "model.norm.weight");
        assert_eq!(one_line("a\u{202E}b"), "a\\u{202e}b");
        assert_eq!(one_line("a\u{1b}[31m"), "a\\u{1b}[31m");
        assert_eq!(one_line("x\ny"), "x\\ny");
        assert_eq!(one_line("a\u{200B}b\u{2067}"), "a\\u{200b}b\\u{2067}");
        // Ordinary non-ASCII text stays readable.
        assert_eq!(one_line("modèle"), "modèle");
    }

    #[test]
    fn display_escapes_newlines_in_names() {
        let f = Failure::new("evil\nok: fake", FailureKind::UnlistedFile, "x");
        let line = f.to_string();
        assert!(!line.contains('\n'), "{line}");
        assert!(line.starts_with("evil\\nok: fake: unlisted-file"), "{line}");
    }
}
