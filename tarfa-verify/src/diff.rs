//! `tarfa-verify diff`: what changed between two releases, from their manifests alone (no tensor
//! data is read). The comparison itself is [`tarfa_manifest::diff`]; this module loads the two
//! manifests and renders the result.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use tarfa_manifest::{diff, Change, ChangeKind, EntryKind, LayerKey, Manifest, ManifestDiff};

use crate::bundle::load_manifest_arg;
use crate::failure::one_line;
use crate::VerifyError;

/// Both manifests, where they were read from, and their difference.
#[derive(Debug)]
pub struct DiffOutcome {
    pub a: PathBuf,
    pub b: PathBuf,
    pub diff: ManifestDiff,
    /// Manifests whose root digest is not the digest of their entries (the diff is still made
    /// from the entries; the caller warns).
    pub root_mismatches: Vec<PathBuf>,
}

/// Load `a` and `b` (bundle directories or manifest files) and compare them.
pub fn diff_manifests(a: &Path, b: &Path) -> Result<DiffOutcome, VerifyError> {
    let (pa, ma) = load_manifest_arg(a)?;
    let (pb, mb) = load_manifest_arg(b)?;
    let root_mismatches = [(&pa, &ma), (&pb, &mb)]
        .into_iter()
        .filter(|(_, m): &(&PathBuf, &Manifest)| m.check_root().is_err())
        .map(|(p, _)| p.clone())
        .collect();
    Ok(DiffOutcome {
        diff: diff(&ma, &mb),
        a: pa,
        b: pb,
        root_mismatches,
    })
}

/// One line per changed, added and removed entry, the per-layer table, and a summary line.
pub fn render_human(d: &ManifestDiff) -> String {
    let mut out = String::new();
    for c in &d.changed {
        let _ = writeln!(out, "changed  {}", describe_change(c));
    }
    for n in &d.added {
        let _ = writeln!(out, "added    {}", one_line(n));
    }
    for n in &d.removed {
        let _ = writeln!(out, "removed  {}", one_line(n));
    }
    if !d.is_empty() {
        out.push('\n');
    }
    let _ = writeln!(
        out,
        "{:<8} {:>8} {:>8} {:>8} {:>10}",
        "layer", "changed", "added", "removed", "unchanged"
    );
    for (key, s) in &d.per_layer {
        let layer = match key {
            LayerKey::Layer(l) => l.to_string(),
            LayerKey::Global => "global".to_string(),
        };
        let _ = writeln!(
            out,
            "{layer:<8} {:>8} {:>8} {:>8} {:>10}",
            s.changed, s.added, s.removed, s.unchanged
        );
    }
    let _ = writeln!(
        out,
        "\n{} changed, {} added, {} removed, {} unchanged",
        d.changed.len(),
        d.added.len(),
        d.removed.len(),
        d.unchanged
    );
    out
}

fn describe_change(c: &Change) -> String {
    let kind = match c.kind {
        EntryKind::Tensor => "tensor",
        EntryKind::Expert => "expert",
        EntryKind::File => "file",
    };
    let what = match &c.change {
        ChangeKind::Bytes => "bytes".to_string(),
        ChangeKind::Shape { from, to } if c.kind == EntryKind::Expert => {
            format!("shape {} -> {}", expert_shape(from), expert_shape(to))
        }
        ChangeKind::Shape { from, to } => format!("shape {from:?} -> {to:?}"),
        ChangeKind::Dtype { from, to } => format!("dtype {from} -> {to}"),
    };
    format!("{} ({kind}, {what})", one_line(&c.name))
}

/// An expert's comparable shape is its three matrices' shapes, each followed by a 0 (see
/// `tarfa_manifest::diff`): shown as `gate [i, h] up [i, h] down [h, i]`.
fn expert_shape(flat: &[u64]) -> String {
    let groups: Vec<&[u64]> = flat.split(|&d| d == 0).collect();
    match groups.as_slice() {
        [g, u, d, []] => format!("gate {g:?} up {u:?} down {d:?}"),
        _ => format!("{flat:?}"),
    }
}

/// `{"changed": [...], "added": [...], "removed": [...], "unchanged": N}`.
pub fn render_json(d: &ManifestDiff) -> String {
    serde_json::to_string(d).expect("a diff serialises")
}

#[cfg(test)]
mod tests {
    use super::expert_shape;

    #[test]
    fn expert_shapes_split_into_gate_up_down() {
        assert_eq!(
            expert_shape(&[64, 128, 0, 64, 128, 0, 128, 64, 0]),
            "gate [64, 128] up [64, 128] down [128, 64]"
        );
        // Not three groups (a zero dimension inside a shape): shown as it is.
        assert_eq!(
            expert_shape(&[0, 128, 0, 64, 128, 0, 128, 64, 0]),
            "[0, 128, 0, 64, 128, 0, 128, 64, 0]"
        );
    }
}
