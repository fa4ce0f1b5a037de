//! Planning a JNF layout: the only way to build a [`Header`].
//!
//! Non-expert tensors come first (in the order added), then the expert extents sorted by
//! (layer, expert). Offsets are absolute, so the header's own length decides where data starts;
//! [`LayoutPlan::finish`] iterates until the two agree.
//!
//! A plan writes format version 1 unless an extent's storage was set
//! ([`LayoutPlan::set_extent_storage`]): then version 2, every extent recording its codec and
//! stored length, and each placed by its stored length (an encoded extent is packed as tightly
//! as its stored bytes allow, still 4096-aligned).

use std::collections::BTreeMap;

use crate::header::shape_bytes;
use crate::{
    align_up, Dtype, ExpertExtent, ExpertMatrix, ExtentCodec, Header, JnfError, MatrixRole,
    SourceRef, TensorEntry, FORMAT_MAJOR, FORMAT_MAJOR_RAW, FORMAT_MINOR, PREAMBLE_LEN,
};

/// A non-expert tensor to place.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub source: Option<SourceRef>,
}

/// One matrix of an expert to place.
#[derive(Debug, Clone)]
pub struct MatrixSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub source: Option<SourceRef>,
}

/// An expert's parts to place, each with its role, in extent order.
type ExpertParts = Vec<(MatrixRole, MatrixSpec)>;

#[derive(Debug, Default, Clone)]
pub struct LayoutPlan {
    tensors: Vec<TensorSpec>,
    experts: BTreeMap<(u32, u32), (String, ExpertParts)>,
    metadata: BTreeMap<String, String>,
    /// Version 2: how each extent is stored (codec, stored length); `None` writes version 1.
    storage: Option<BTreeMap<(u32, u32), (ExtentCodec, u64)>>,
}

impl LayoutPlan {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn add_tensor(&mut self, spec: TensorSpec) {
        self.tensors.push(spec);
    }

    /// Add an expert; `matrices` are gate, up, down in that order.
    pub fn add_expert(
        &mut self,
        layer: u32,
        expert: u32,
        prefix: String,
        matrices: [MatrixSpec; 3],
    ) {
        let parts = MatrixRole::ORDER.into_iter().zip(matrices).collect();
        self.experts.insert((layer, expert), (prefix, parts));
    }

    /// Add an MXFP4 expert as released; `parts` are gate_up blocks, gate_up scales, down
    /// blocks, down scales in that order ([`MatrixRole::MXFP4_ORDER`]).
    pub fn add_mxfp4_expert(
        &mut self,
        layer: u32,
        expert: u32,
        prefix: String,
        parts: [MatrixSpec; 4],
    ) {
        let parts = MatrixRole::MXFP4_ORDER.into_iter().zip(parts).collect();
        self.experts.insert((layer, expert), (prefix, parts));
    }

    pub fn set_metadata(&mut self, key: &str, value: &str) {
        self.metadata.insert(key.into(), value.into());
    }

    /// Store the extent of (`layer`, `expert`) with `codec` in `stored_length` bytes. Any call
    /// makes the plan write format version 2, where every extent records its codec: those never
    /// set are raw. The header validates the pair when the plan finishes (a raw extent's stored
    /// length is its length; an encoded one's must be possible for the codec).
    pub fn set_extent_storage(
        &mut self,
        layer: u32,
        expert: u32,
        codec: ExtentCodec,
        stored_length: u64,
    ) {
        self.storage
            .get_or_insert_with(BTreeMap::new)
            .insert((layer, expert), (codec, stored_length));
    }

    /// The plan that lays out `header`'s tensors and extents as it does: `from_header(h)
    /// .finish()` is `h` again, and a caller can then set the extents' storage (the converter
    /// encodes the extents of a planned version-1 layout, then re-plans it as version 2).
    pub fn from_header(header: &Header) -> LayoutPlan {
        let tensors = header
            .tensors
            .iter()
            .map(|t| TensorSpec {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                source: t.source.clone(),
            })
            .collect();
        let experts = header
            .experts
            .iter()
            .map(|e| {
                let parts = e
                    .matrices
                    .iter()
                    .map(|m| {
                        let spec = MatrixSpec {
                            name: m.name.clone(),
                            dtype: m.dtype,
                            shape: m.shape.clone(),
                            source: m.source.clone(),
                        };
                        (m.role, spec)
                    })
                    .collect();
                ((e.layer, e.expert), (e.prefix.clone(), parts))
            })
            .collect();
        let storage = (header.major >= 2).then(|| {
            header
                .experts
                .iter()
                .map(|e| ((e.layer, e.expert), (e.codec, e.stored_length)))
                .collect()
        });
        LayoutPlan {
            tensors,
            experts,
            metadata: header.metadata.clone(),
            storage,
        }
    }

    /// Assign offsets and return the validated header.
    pub fn finish(self) -> Result<Header, JnfError> {
        let mut data_start = crate::ALIGN;
        loop {
            let header = self.place(data_start)?;
            let json_len = header.to_json().len() as u64;
            let needed = align_up(PREAMBLE_LEN + json_len).ok_or(JnfError::HeaderTooLarge {
                len: json_len,
                cap: crate::MAX_HEADER_LEN,
            })?;
            if json_len > crate::MAX_HEADER_LEN {
                return Err(JnfError::HeaderTooLarge {
                    len: json_len,
                    cap: crate::MAX_HEADER_LEN,
                });
            }
            if needed == data_start {
                header.validate(header.file_size)?;
                return Ok(header);
            }
            // Offsets only grow with data_start, so the JSON only grows: this converges.
            data_start = needed.max(data_start);
        }
    }

    fn place(&self, data_start: u64) -> Result<Header, JnfError> {
        let overflow = |name: &str| JnfError::OutOfBounds {
            name: name.into(),
            offset: 0,
            length: 0,
            file_size: u64::MAX,
        };
        let mut cursor = data_start;
        let mut tensors = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            let length = shape_bytes(&t.name, &t.shape, t.dtype)?;
            tensors.push(TensorEntry {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                offset: cursor,
                length,
                source: t.source.clone(),
            });
            cursor = cursor
                .checked_add(length)
                .and_then(align_up)
                .ok_or_else(|| overflow(&t.name))?;
        }
        let mut experts = Vec::with_capacity(self.experts.len());
        for (&(layer, expert), (prefix, specs)) in &self.experts {
            let mut inner = 0u64;
            let mut ms = Vec::with_capacity(specs.len());
            for &(role, ref spec) in specs {
                let length = shape_bytes(&spec.name, &spec.shape, spec.dtype)?;
                ms.push(ExpertMatrix {
                    role,
                    name: spec.name.clone(),
                    dtype: spec.dtype,
                    shape: spec.shape.clone(),
                    offset: inner,
                    length,
                    source: spec.source.clone(),
                });
                inner = inner
                    .checked_add(length)
                    .ok_or_else(|| overflow(&spec.name))?;
            }
            let (codec, stored_length) = self
                .storage
                .as_ref()
                .and_then(|s| s.get(&(layer, expert)).copied())
                .unwrap_or((ExtentCodec::Raw, inner));
            let padded = align_up(stored_length).ok_or_else(|| overflow(prefix))?;
            experts.push(ExpertExtent {
                layer,
                expert,
                prefix: prefix.clone(),
                offset: cursor,
                length: inner,
                padded_length: padded,
                codec,
                stored_length,
                matrices: ms,
            });
            cursor = cursor.checked_add(padded).ok_or_else(|| overflow(prefix))?;
        }
        let major = if self.storage.is_some() {
            FORMAT_MAJOR
        } else {
            FORMAT_MAJOR_RAW
        };
        Ok(Header::assemble(
            major,
            FORMAT_MINOR,
            cursor,
            data_start,
            tensors,
            experts,
            self.metadata.clone(),
        ))
    }
}
