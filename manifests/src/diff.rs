//! What differs between two releases, from their manifests alone.

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use crate::{layer_of, Manifest};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EntryKind {
    Tensor,
    Expert,
    File,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "change", rename_all = "lowercase")]
pub enum ChangeKind {
    /// Same dtype and shape, different bytes.
    Bytes,
    Shape {
        from: Vec<u64>,
        to: Vec<u64>,
    },
    Dtype {
        from: String,
        to: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Change {
    pub name: String,
    pub kind: EntryKind,
    #[serde(flatten)]
    pub change: ChangeKind,
}

/// Where an entry belongs in the per-layer summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum LayerKey {
    Layer(u32),
    /// Embeddings, final norm, lm_head, config and tokenizer files.
    Global,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct LayerSummary {
    pub changed: usize,
    pub added: usize,
    pub removed: usize,
    pub unchanged: usize,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ManifestDiff {
    pub changed: Vec<Change>,
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub unchanged: usize,
    #[serde(skip)]
    pub per_layer: BTreeMap<LayerKey, LayerSummary>,
}

impl ManifestDiff {
    pub fn is_empty(&self) -> bool {
        self.changed.is_empty() && self.added.is_empty() && self.removed.is_empty()
    }
}

/// A comparable view of one entry. An expert's shape is its three matrices' shapes, each
/// followed by a 0 separator, so that a change of width or hidden size is a shape change.
struct Entry<'a> {
    kind: EntryKind,
    dtype: &'a str,
    shape: Vec<u64>,
    sha256: &'a str,
}

fn entries(m: &Manifest) -> HashMap<&str, Entry<'_>> {
    let mut out = HashMap::new();
    for f in &m.files {
        out.insert(
            f.name.as_str(),
            Entry {
                kind: EntryKind::File,
                dtype: "",
                shape: Vec::new(),
                sha256: &f.sha256,
            },
        );
    }
    for t in &m.tensors {
        out.insert(
            t.name.as_str(),
            Entry {
                kind: EntryKind::Tensor,
                dtype: &t.dtype,
                shape: t.shape.clone(),
                sha256: &t.sha256,
            },
        );
    }
    for e in &m.experts {
        let shape = e
            .matrices
            .iter()
            .flat_map(|mm| mm.shape.iter().copied().chain([0]))
            .collect();
        out.insert(
            e.name.as_str(),
            Entry {
                kind: EntryKind::Expert,
                // An MXFP4 expert as released and its BF16 twin differ in dtype, so a diff
                // between the two says so rather than only "changed".
                dtype: if e.matrices.iter().any(|mm| mm.dtype == "U8") {
                    "MXFP4"
                } else {
                    "BF16"
                },
                shape,
                sha256: &e.sha256,
            },
        );
    }
    out
}

fn key(name: &str) -> LayerKey {
    layer_of(name).map_or(LayerKey::Global, LayerKey::Layer)
}

/// Compare two manifests entry by entry (tensors, experts, copied files). Source shards are not
/// compared: the same weights re-sharded are the same model.
pub fn diff(a: &Manifest, b: &Manifest) -> ManifestDiff {
    let ea = entries(a);
    let eb = entries(b);
    let mut d = ManifestDiff::default();
    let mut names: Vec<&str> = ea.keys().chain(eb.keys()).copied().collect();
    names.sort_unstable();
    names.dedup();
    for name in names {
        let slot = d.per_layer.entry(key(name)).or_default();
        match (ea.get(name), eb.get(name)) {
            (Some(x), Some(y)) => {
                let change = if x.dtype != y.dtype {
                    Some(ChangeKind::Dtype {
                        from: x.dtype.into(),
                        to: y.dtype.into(),
                    })
                } else if x.shape != y.shape {
                    Some(ChangeKind::Shape {
                        from: x.shape.clone(),
                        to: y.shape.clone(),
                    })
                } else if x.sha256 != y.sha256 {
                    Some(ChangeKind::Bytes)
                } else {
                    None
                };
                match change {
                    Some(change) => {
                        slot.changed += 1;
                        d.changed.push(Change {
                            name: name.into(),
                            kind: y.kind,
                            change,
                        });
                    }
                    None => {
                        slot.unchanged += 1;
                        d.unchanged += 1;
                    }
                }
            }
            (None, Some(_)) => {
                slot.added += 1;
                d.added.push(name.into());
            }
            (Some(_), None) => {
                slot.removed += 1;
                d.removed.push(name.into());
            }
            (None, None) => unreachable!("name came from one of the maps"),
        }
    }
    d
}
