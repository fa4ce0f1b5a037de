//! The JNF header: schema, full validation, and encoding.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::{align_up, JnfError, ALIGN, MAGIC, PREAMBLE_LEN};

/// The versions this build reads: each major version with the newest minor version of it this
/// build knows. A file of a newer major version, or of a newer minor version of one of these, is
/// refused by name ([`JnfError::NewerVersion`]), never misread.
pub const READS: &[(u16, u16)] = &[(1, 0), (2, 0)];

/// The version rule of docs/FORMAT.md, for a reader that reads the versions `reads` (each major
/// with its newest known minor, ascending): `Ok` if it reads `major.minor`. A version-1 reader
/// is `&[(1, 0)]`: given a version-2 file it says "format version 2.0 is newer than this reader
/// (1.0)", which is what the readers released before version 2 must be shown to say too.
pub fn check_version(major: u16, minor: u16, reads: &[(u16, u16)]) -> Result<(), JnfError> {
    if major == 0 {
        return Err(JnfError::UnknownVersion { major, minor });
    }
    let (reads_major, reads_minor) = *reads.last().expect("a reader reads some version");
    let newer = |reads_major, reads_minor| JnfError::NewerVersion {
        major,
        minor,
        reads_major,
        reads_minor,
    };
    match reads.iter().find(|(m, _)| *m == major) {
        Some(&(_, max_minor)) if minor <= max_minor => Ok(()),
        Some(&(m, max_minor)) => Err(newer(m, max_minor)),
        None if major > reads_major => Err(newer(reads_major, reads_minor)),
        None => Err(JnfError::UnknownVersion { major, minor }),
    }
}

/// Largest header JSON a reader accepts. A Qwen3-235B-A22B bundle (94 layers x 128 experts)
/// needs about 8 MB; the cap keeps a hostile length from allocating gigabytes.
pub const MAX_HEADER_LEN: u64 = 64 << 20;

/// Element types a JNF file may carry: floating-point types, and `U8` for the parts of an
/// MXFP4 expert extent only (the released blocks and scales, [`ExtentEncoding::Mxfp4`]); a `U8`
/// tensor or standard expert matrix is refused by name. Every other quantized and integer dtype
/// is refused by name ([`JnfError::RefusedDtype`]), never representable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    BF16,
    F16,
    F32,
    F64,
    U8,
}

impl Dtype {
    pub fn size(self) -> u64 {
        match self {
            Dtype::BF16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
            Dtype::F64 => 8,
            Dtype::U8 => 1,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::BF16 => "BF16",
            Dtype::F16 => "F16",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::U8 => "U8",
        }
    }

    /// Parse a safetensors-style dtype name. `Err(true)` means a known but refused dtype,
    /// `Err(false)` an unknown one.
    pub fn parse(s: &str) -> Result<Dtype, bool> {
        match s {
            "BF16" => Ok(Dtype::BF16),
            "F16" => Ok(Dtype::F16),
            "F32" => Ok(Dtype::F32),
            "F64" => Ok(Dtype::F64),
            "U8" => Ok(Dtype::U8),
            "F8_E4M3" | "F8_E5M2" | "F8_E8M0" | "F6_E2M3" | "F6_E3M2" | "F4" | "I4" | "U4"
            | "I8" | "I16" | "U16" | "I32" | "U32" | "I64" | "U64" | "BOOL" | "C64" => Err(true),
            _ => Err(false),
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a tensor's bytes came from: the source shard file and the absolute byte offset in it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceRef {
    pub shard: String,
    pub offset: u64,
}

/// A non-expert tensor: absolute `offset` in the file, 4096-aligned; `length` excludes padding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub offset: u64,
    pub length: u64,
    pub source: Option<SourceRef>,
}

/// What one part of an expert extent is. A standard extent is `gate, up, down` (BF16
/// `[out, in]` matrices); an MXFP4 extent is gpt-oss's released parts, `gate_up_blocks,
/// gate_up_scales, down_blocks, down_scales` (U8; docs/FORMAT.md, "MXFP4").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MatrixRole {
    Gate,
    Up,
    Down,
    /// `[2I, H/32, 16]`: two e2m1 codes a byte, low nibble first; rows `2j` gate, `2j+1` up.
    GateUpBlocks,
    /// `[2I, H/32]`: one e8m0 scale (bias 127) per block of 32 values.
    GateUpScales,
    /// `[H, I/32, 16]`.
    DownBlocks,
    /// `[H, I/32]`.
    DownScales,
}

impl MatrixRole {
    pub const ORDER: [MatrixRole; 3] = [MatrixRole::Gate, MatrixRole::Up, MatrixRole::Down];
    /// The parts of an MXFP4 extent, in extent order (the released tensors' order).
    pub const MXFP4_ORDER: [MatrixRole; 4] = [
        MatrixRole::GateUpBlocks,
        MatrixRole::GateUpScales,
        MatrixRole::DownBlocks,
        MatrixRole::DownScales,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            MatrixRole::Gate => "gate",
            MatrixRole::Up => "up",
            MatrixRole::Down => "down",
            MatrixRole::GateUpBlocks => "gate_up_blocks",
            MatrixRole::GateUpScales => "gate_up_scales",
            MatrixRole::DownBlocks => "down_blocks",
            MatrixRole::DownScales => "down_scales",
        }
    }
}

/// How an extent is stored in the file (format version 2; a version-1 extent is always raw).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExtentCodec {
    /// The extent's bytes as they are: `stored_length == length`.
    Raw,
    /// `jnf-codec`: the BF16 exponent plane as one zstd frame, sign and mantissa raw (BF16
    /// extents only).
    ExponentPlaneZstd,
}

impl ExtentCodec {
    pub fn as_str(self) -> &'static str {
        match self {
            ExtentCodec::Raw => "raw",
            ExtentCodec::ExponentPlaneZstd => "exp-zstd",
        }
    }

    /// The codec a header or manifest names, if this build knows it.
    pub fn from_name(s: &str) -> Option<ExtentCodec> {
        match s {
            "raw" => Some(ExtentCodec::Raw),
            "exp-zstd" => Some(ExtentCodec::ExponentPlaneZstd),
            _ => None,
        }
    }
}

impl fmt::Display for ExtentCodec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How an extent's bytes encode the expert, decided by its roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtentEncoding {
    /// `gate, up, down`, BF16 `[out, in]`.
    Bf16,
    /// gpt-oss's MXFP4 as released: blocks and scales of `gate_up` (`[2I, H]`, rows
    /// interleaved gate/up) and of `down` (`[H, I]`), widened exactly at run time.
    Mxfp4,
}

/// One matrix of an expert; `offset` is relative to the start of its extent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertMatrix {
    pub role: MatrixRole,
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub offset: u64,
    pub length: u64,
    pub source: Option<SourceRef>,
}

/// One expert: its parts (gate, up and down; or the four MXFP4 parts) packed back to back;
/// `length` is their total (the decoded extent). The extent is stored from a 4096-aligned
/// `offset` in `stored_length` bytes with `codec` (raw: the bytes themselves, `stored_length ==
/// length`), and `padded_length` is `stored_length` rounded up to 4096: what it occupies, and
/// what one O_DIRECT read of it fetches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertExtent {
    pub layer: u32,
    pub expert: u32,
    pub prefix: String,
    pub offset: u64,
    pub length: u64,
    pub padded_length: u64,
    /// How the extent is stored (always [`ExtentCodec::Raw`] in version 1).
    pub codec: ExtentCodec,
    /// Bytes the stored extent occupies before its padding (`length` when raw).
    pub stored_length: u64,
    /// `gate, up, down` ([`MatrixRole::ORDER`]) or the MXFP4 parts
    /// ([`MatrixRole::MXFP4_ORDER`]); a validated header holds nothing else.
    pub matrices: Vec<ExpertMatrix>,
}

impl ExpertExtent {
    /// The part of that role, if the extent has one.
    pub fn matrix(&self, role: MatrixRole) -> Option<&ExpertMatrix> {
        self.matrices.iter().find(|m| m.role == role)
    }

    /// The extent's encoding, from its roles (a validated header's extents are one or the
    /// other).
    pub fn encoding(&self) -> ExtentEncoding {
        if self.matrices.first().map(|m| m.role) == Some(MatrixRole::GateUpBlocks) {
            ExtentEncoding::Mxfp4
        } else {
            ExtentEncoding::Bf16
        }
    }

    /// Whether the stored bytes must be decoded to give the extent (not raw).
    pub fn is_encoded(&self) -> bool {
        self.codec != ExtentCodec::Raw
    }

    /// The extent's bytes (`length` of them, into `out`) from its stored bytes
    /// (`stored_length` of them). Hash-checking is the caller's: a verified reader checks the
    /// stored bytes against the manifest's `stored_blake3` before calling this, and the decoded
    /// bytes against `sha256`/`blake3` after. A hostile extent is an error, never a panic.
    pub fn decode_stored(&self, stored: &[u8], out: &mut [u8]) -> Result<(), JnfError> {
        let storage = |why: String| JnfError::ExtentStorage {
            prefix: self.prefix.clone(),
            why,
        };
        if stored.len() as u64 != self.stored_length || out.len() as u64 != self.length {
            return Err(storage(format!(
                "{} stored bytes into {} decoded: the header says {} into {}",
                stored.len(),
                out.len(),
                self.stored_length,
                self.length
            )));
        }
        match self.codec {
            ExtentCodec::Raw => {
                out.copy_from_slice(stored);
                Ok(())
            }
            ExtentCodec::ExponentPlaneZstd => {
                jnf_codec::decode_into(stored, out).map_err(|source| JnfError::Decode {
                    prefix: self.prefix.clone(),
                    source,
                })
            }
        }
    }
}

/// A validated header. Construct it with [`Header::parse`] or [`crate::LayoutPlan::finish`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub major: u16,
    pub minor: u16,
    pub file_size: u64,
    pub data_start: u64,
    pub tensors: Vec<TensorEntry>,
    pub experts: Vec<ExpertExtent>,
    pub metadata: BTreeMap<String, String>,
    tensor_index: HashMap<String, usize>,
    expert_index: HashMap<(u32, u32), usize>,
}

// ---- wire schema (strings for dtypes so that unknown ones get their own error) ----

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHeader {
    alignment: u64,
    file_size: u64,
    data_start: u64,
    tensors: Vec<RawTensor>,
    experts: Vec<RawExpert>,
    #[serde(default)]
    metadata: BTreeMap<String, String>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTensor {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    offset: u64,
    length: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    source: Option<SourceRef>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMatrix {
    role: MatrixRole,
    name: String,
    dtype: String,
    shape: Vec<u64>,
    offset: u64,
    length: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    source: Option<SourceRef>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawExpert {
    layer: u32,
    expert: u32,
    prefix: String,
    offset: u64,
    length: u64,
    padded_length: u64,
    /// Version 2 only (absent in version 1, so its JSON is what it always was).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    codec: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    stored_length: Option<u64>,
    matrices: Vec<RawMatrix>,
}

fn dtype_of(name: &str, s: &str) -> Result<Dtype, JnfError> {
    Dtype::parse(s).map_err(|refused| {
        if refused {
            JnfError::RefusedDtype {
                name: name.into(),
                dtype: s.into(),
            }
        } else {
            JnfError::UnknownDtype {
                name: name.into(),
                dtype: s.into(),
            }
        }
    })
}

/// Byte length implied by shape and dtype, with checked arithmetic.
pub(crate) fn shape_bytes(name: &str, shape: &[u64], dtype: Dtype) -> Result<u64, JnfError> {
    shape
        .iter()
        .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| JnfError::ShapeOverflow {
            name: name.into(),
            shape: shape.to_vec(),
        })
}

/// The block layout of an MXFP4 extent: blocks `[rows, groups, 16]`, their scales `[rows,
/// groups]`, and the two matrices `gate_up [2I, H]` and `down [H, I]` agreeing on H and I.
fn check_mxfp4_shapes(e: &ExpertExtent) -> Result<(), JnfError> {
    let bad = |why: String| JnfError::Mxfp4Layout {
        prefix: e.prefix.clone(),
        why,
    };
    let pair = |b: &ExpertMatrix, s: &ExpertMatrix| -> Result<(u64, u64), JnfError> {
        match (b.shape.as_slice(), s.shape.as_slice()) {
            ([r, g, 16], [r2, g2]) if r == r2 && g == g2 && *r > 0 && *g > 0 => Ok((*r, *g)),
            _ => Err(bad(format!(
                "blocks {:?} {:?} and scales {:?} {:?} are not [rows, groups, 16] and [rows, groups]",
                b.name, b.shape, s.name, s.shape
            ))),
        }
    };
    let (gu_rows, gu_groups) = pair(&e.matrices[0], &e.matrices[1])?;
    let (d_rows, d_groups) = pair(&e.matrices[2], &e.matrices[3])?;
    // gate_up is [2I, H] and down [H, I]: H = 32 * gate_up's groups, I = 32 * down's groups.
    let h = gu_groups.checked_mul(32);
    let two_i = d_groups.checked_mul(64);
    if h != Some(d_rows) || two_i != Some(gu_rows) {
        return Err(bad(format!(
            "gate_up [{gu_rows}, {gu_groups} blocks] and down [{d_rows}, {d_groups} blocks] do not \
             describe [2I, H] and [H, I]"
        )));
    }
    Ok(())
}

/// The storage rules of version 2 (a version-1 extent is raw with `stored_length == length` by
/// construction), for the header and the manifest alike: raw stores the extent itself; only
/// BF16 extents are encoded; an encoded extent is smaller than its bytes (else it would be
/// stored raw) and longer than any encoding of them can be short
/// (`jnf_codec::stored_len_is_possible`), so that a hostile header cannot claim a decoded
/// extent of more than twice its stored bytes. `Err` says which rule, in a sentence.
pub fn check_extent_storage(
    codec: ExtentCodec,
    encoding: ExtentEncoding,
    stored_length: u64,
    length: u64,
) -> Result<(), String> {
    match codec {
        ExtentCodec::Raw if stored_length != length => Err(format!(
            "a raw extent's stored_length {stored_length} is not its length {length}"
        )),
        ExtentCodec::Raw => Ok(()),
        ExtentCodec::ExponentPlaneZstd if encoding != ExtentEncoding::Bf16 => Err(format!(
            "codec {codec} encodes BF16 extents; an MXFP4 extent is stored raw"
        )),
        ExtentCodec::ExponentPlaneZstd => {
            if stored_length >= length || !jnf_codec::stored_len_is_possible(stored_length, length)
            {
                return Err(format!(
                    "stored_length {stored_length} is not possible for a {codec} extent of \
                     {length} bytes (it must be less than the length and more than 16 + length / 2)"
                ));
            }
            Ok(())
        }
    }
}

fn check_storage(e: &ExpertExtent) -> Result<(), JnfError> {
    check_extent_storage(e.codec, e.encoding(), e.stored_length, e.length).map_err(|why| {
        JnfError::ExtentStorage {
            prefix: e.prefix.clone(),
            why,
        }
    })
}

fn check_name(name: &str) -> Result<(), JnfError> {
    if name.is_empty() || name.chars().any(|c| c.is_control()) {
        return Err(JnfError::InvalidName(name.into()));
    }
    Ok(())
}

/// Parsed preamble: (major, minor, header_len).
pub(crate) fn parse_preamble(p: &[u8], file_size: u64) -> Result<(u16, u16, u64), JnfError> {
    if (p.len() as u64) < PREAMBLE_LEN || file_size < PREAMBLE_LEN {
        return Err(JnfError::TooShort {
            size: file_size.min(p.len() as u64),
        });
    }
    if p[0..8] != MAGIC {
        return Err(JnfError::BadMagic);
    }
    let major = u16::from_le_bytes([p[8], p[9]]);
    let minor = u16::from_le_bytes([p[10], p[11]]);
    check_version(major, minor, READS)?;
    let reserved = u32::from_le_bytes([p[12], p[13], p[14], p[15]]);
    if reserved != 0 {
        return Err(JnfError::ReservedNonZero(reserved));
    }
    let len = u64::from_le_bytes(p[16..24].try_into().expect("8 bytes"));
    if len > MAX_HEADER_LEN {
        return Err(JnfError::HeaderTooLarge {
            len,
            cap: MAX_HEADER_LEN,
        });
    }
    if PREAMBLE_LEN + len > file_size {
        return Err(JnfError::HeaderBeyondFile { len, file_size });
    }
    Ok((major, minor, len))
}

impl Header {
    /// Parse and fully validate a header. `buf` holds the file's first bytes (at least the
    /// preamble and the header JSON); `file_size` is the real size of the file.
    pub fn parse(buf: &[u8], file_size: u64) -> Result<Header, JnfError> {
        let (major, minor, len) = parse_preamble(buf, file_size)?;
        let end = (PREAMBLE_LEN + len) as usize;
        if buf.len() < end {
            return Err(JnfError::HeaderBeyondFile {
                len,
                file_size: buf.len() as u64,
            });
        }
        let text = std::str::from_utf8(&buf[PREAMBLE_LEN as usize..end])
            .map_err(|_| JnfError::HeaderNotUtf8)?;
        let raw: RawHeader =
            serde_json::from_str(text).map_err(|e| JnfError::HeaderJson(e.to_string()))?;
        let header = Header::from_raw(raw, major, minor)?;
        let expected_start = align_up(PREAMBLE_LEN + len).ok_or(JnfError::HeaderTooLarge {
            len,
            cap: MAX_HEADER_LEN,
        })?;
        if header.data_start != expected_start {
            return Err(JnfError::DataStartMismatch {
                expected: expected_start,
                actual: header.data_start,
            });
        }
        header.validate(file_size)?;
        Ok(header)
    }

    fn from_raw(raw: RawHeader, major: u16, minor: u16) -> Result<Header, JnfError> {
        if raw.alignment != ALIGN {
            return Err(JnfError::UnsupportedAlignment(raw.alignment));
        }
        let mut tensors = Vec::with_capacity(raw.tensors.len());
        for t in raw.tensors {
            let dtype = dtype_of(&t.name, &t.dtype)?;
            tensors.push(TensorEntry {
                name: t.name,
                dtype,
                shape: t.shape,
                offset: t.offset,
                length: t.length,
                source: t.source,
            });
        }
        let mut experts = Vec::with_capacity(raw.experts.len());
        for e in raw.experts {
            if e.matrices.len() != 3 && e.matrices.len() != 4 {
                return Err(JnfError::ExpertRoles { prefix: e.prefix });
            }
            let mut ms = Vec::with_capacity(4);
            for m in e.matrices {
                let dtype = dtype_of(&m.name, &m.dtype)?;
                ms.push(ExpertMatrix {
                    role: m.role,
                    name: m.name,
                    dtype,
                    shape: m.shape,
                    offset: m.offset,
                    length: m.length,
                    source: m.source,
                });
            }
            let storage = |why: &str| JnfError::ExtentStorage {
                prefix: e.prefix.clone(),
                why: why.into(),
            };
            let (codec, stored_length) = match (major, e.codec, e.stored_length) {
                (1, None, None) => (ExtentCodec::Raw, e.length),
                (1, _, _) => {
                    return Err(storage(
                        "a version-1 extent has no codec or stored_length (version-2 fields)",
                    ))
                }
                (_, Some(name), Some(stored)) => match ExtentCodec::from_name(&name) {
                    Some(codec) => (codec, stored),
                    None => {
                        return Err(JnfError::UnknownCodec {
                            prefix: e.prefix,
                            codec: name,
                        })
                    }
                },
                _ => {
                    return Err(storage(
                        "a version-2 extent records its codec and stored_length",
                    ))
                }
            };
            experts.push(ExpertExtent {
                layer: e.layer,
                expert: e.expert,
                prefix: e.prefix,
                offset: e.offset,
                length: e.length,
                padded_length: e.padded_length,
                codec,
                stored_length,
                matrices: ms,
            });
        }
        Ok(Header::assemble(
            major,
            minor,
            raw.file_size,
            raw.data_start,
            tensors,
            experts,
            raw.metadata,
        ))
    }

    pub(crate) fn assemble(
        major: u16,
        minor: u16,
        file_size: u64,
        data_start: u64,
        tensors: Vec<TensorEntry>,
        experts: Vec<ExpertExtent>,
        metadata: BTreeMap<String, String>,
    ) -> Header {
        let tensor_index = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        let expert_index = experts
            .iter()
            .enumerate()
            .map(|(i, e)| ((e.layer, e.expert), i))
            .collect();
        Header {
            major,
            minor,
            file_size,
            data_start,
            tensors,
            experts,
            metadata,
            tensor_index,
            expert_index,
        }
    }

    /// Every structural rule of docs/FORMAT.md, against a file of `file_size` bytes.
    pub fn validate(&self, file_size: u64) -> Result<(), JnfError> {
        if self.file_size != file_size {
            return Err(JnfError::FileSizeMismatch {
                expected: self.file_size,
                actual: file_size,
            });
        }
        let mut names = HashSet::new();
        let mut seen = |n: &str| -> Result<(), JnfError> {
            check_name(n)?;
            if !names.insert(n.to_string()) {
                return Err(JnfError::DuplicateName(n.into()));
            }
            Ok(())
        };
        // (start, padded end, name) of every region, for the overlap sweep.
        let mut regions: Vec<(u64, u64, &str)> = Vec::new();
        let bounds = |name: &str, offset: u64, span: u64| -> Result<u64, JnfError> {
            if !offset.is_multiple_of(ALIGN) {
                return Err(JnfError::Misaligned {
                    name: name.into(),
                    offset,
                });
            }
            if offset < self.data_start {
                return Err(JnfError::InsideHeader {
                    name: name.into(),
                    offset,
                    data_start: self.data_start,
                });
            }
            let oob = || JnfError::OutOfBounds {
                name: name.into(),
                offset,
                length: span,
                file_size,
            };
            let end = offset.checked_add(span).ok_or_else(oob)?;
            if end > file_size {
                return Err(oob());
            }
            Ok(end)
        };

        for t in &self.tensors {
            seen(&t.name)?;
            if t.dtype == Dtype::U8 {
                // U8 is only the released form of MXFP4 expert parts, never a tensor.
                return Err(JnfError::RefusedDtype {
                    name: t.name.clone(),
                    dtype: t.dtype.to_string(),
                });
            }
            let expected = shape_bytes(&t.name, &t.shape, t.dtype)?;
            if expected != t.length {
                return Err(JnfError::LengthMismatch {
                    name: t.name.clone(),
                    expected,
                    actual: t.length,
                });
            }
            let padded = align_up(t.length).ok_or_else(|| JnfError::OutOfBounds {
                name: t.name.clone(),
                offset: t.offset,
                length: t.length,
                file_size,
            })?;
            let end = bounds(&t.name, t.offset, padded)?;
            regions.push((t.offset, end, &t.name));
        }

        let mut prev: Option<&ExpertExtent> = None;
        for e in &self.experts {
            seen(&e.prefix)?;
            let mut sum = 0u64;
            let roles: &[MatrixRole] = match e.encoding() {
                ExtentEncoding::Bf16 => &MatrixRole::ORDER,
                ExtentEncoding::Mxfp4 => &MatrixRole::MXFP4_ORDER,
            };
            if e.matrices.len() != roles.len() {
                return Err(JnfError::ExpertRoles {
                    prefix: e.prefix.clone(),
                });
            }
            for (m, &role) in e.matrices.iter().zip(roles) {
                seen(&m.name)?;
                if m.role != role {
                    return Err(JnfError::ExpertRoles {
                        prefix: e.prefix.clone(),
                    });
                }
                let want = match e.encoding() {
                    ExtentEncoding::Bf16 => Dtype::BF16,
                    ExtentEncoding::Mxfp4 => Dtype::U8,
                };
                if m.dtype != want && want == Dtype::BF16 {
                    return Err(JnfError::ExpertNotBf16 {
                        name: m.name.clone(),
                        dtype: m.dtype.to_string(),
                    });
                }
                if m.dtype != want {
                    return Err(JnfError::Mxfp4Layout {
                        prefix: e.prefix.clone(),
                        why: format!("part {:?} is {}, not U8", m.name, m.dtype),
                    });
                }
                let expected = shape_bytes(&m.name, &m.shape, m.dtype)?;
                if expected != m.length {
                    return Err(JnfError::LengthMismatch {
                        name: m.name.clone(),
                        expected,
                        actual: m.length,
                    });
                }
                if m.offset != sum {
                    return Err(JnfError::ExpertNotPacked {
                        prefix: e.prefix.clone(),
                        name: m.name.clone(),
                        offset: m.offset,
                        expected: sum,
                    });
                }
                sum = sum
                    .checked_add(m.length)
                    .ok_or_else(|| JnfError::ShapeOverflow {
                        name: m.name.clone(),
                        shape: m.shape.clone(),
                    })?;
            }
            if e.encoding() == ExtentEncoding::Mxfp4 {
                check_mxfp4_shapes(e)?;
            }
            let layer_part = format!("model.layers.{}.", e.layer);
            let expert_part = format!(".experts.{}", e.expert);
            let named = e.prefix.starts_with(&layer_part)
                && e.prefix.ends_with(&expert_part)
                && e.matrices.iter().all(|m| {
                    m.name.len() > e.prefix.len() + 1
                        && m.name.starts_with(&e.prefix)
                        && m.name.as_bytes()[e.prefix.len()] == b'.'
                });
            if !named {
                return Err(JnfError::ExpertName {
                    prefix: e.prefix.clone(),
                    layer: e.layer,
                    expert: e.expert,
                });
            }
            check_storage(e)?;
            // What the extent occupies is its stored bytes, padded (raw: the extent itself).
            let padded_ok = align_up(e.stored_length) == Some(e.padded_length);
            if e.length != sum || !padded_ok {
                return Err(JnfError::ExpertLength {
                    prefix: e.prefix.clone(),
                    length: e.length,
                    padded: e.padded_length,
                    sum,
                });
            }
            let end = bounds(&e.prefix, e.offset, e.padded_length)?;
            if let Some(p) = prev {
                let in_order = (p.layer, p.expert) < (e.layer, e.expert) && p.offset < e.offset;
                // The experts of one layer are physically adjacent, in id order.
                let adjacent = p.layer != e.layer || p.offset + p.padded_length == e.offset;
                if !in_order || !adjacent {
                    return Err(JnfError::ExpertOrder {
                        prefix: e.prefix.clone(),
                    });
                }
            }
            prev = Some(e);
            regions.push((e.offset, end, &e.prefix));
        }

        regions.sort_unstable();
        for w in regions.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(JnfError::Overlap {
                    first: w[0].2.into(),
                    second: w[1].2.into(),
                });
            }
        }
        // Nothing may follow the last region: the file ends exactly where the layout says.
        let last_end = regions.last().map_or(self.data_start, |r| r.1);
        if last_end != file_size {
            return Err(JnfError::FileSizeMismatch {
                expected: last_end,
                actual: file_size,
            });
        }
        Ok(())
    }

    /// The whole header as written to disk: preamble, JSON, zero padding up to `data_start`.
    ///
    /// A header from [`crate::LayoutPlan`] always fits. A parsed header re-serialises to JSON
    /// that can differ in length from the bytes it was parsed from (whitespace, key order, an
    /// omitted empty `metadata`); if it no longer fits before `data_start` this is an error,
    /// never a silently truncated header.
    pub fn encode(&self) -> Result<Vec<u8>, JnfError> {
        let json = self.to_json();
        let room = self.data_start.saturating_sub(PREAMBLE_LEN);
        if json.len() as u64 > room {
            return Err(JnfError::EncodedHeaderTooLong {
                len: json.len() as u64,
                room,
            });
        }
        let mut out = Vec::with_capacity(self.data_start as usize);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&self.major.to_le_bytes());
        out.extend_from_slice(&self.minor.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(json.as_bytes());
        out.resize(self.data_start as usize, 0);
        Ok(out)
    }

    pub(crate) fn to_json(&self) -> String {
        let raw = RawHeader {
            alignment: ALIGN,
            file_size: self.file_size,
            data_start: self.data_start,
            tensors: self
                .tensors
                .iter()
                .map(|t| RawTensor {
                    name: t.name.clone(),
                    dtype: t.dtype.to_string(),
                    shape: t.shape.clone(),
                    offset: t.offset,
                    length: t.length,
                    source: t.source.clone(),
                })
                .collect(),
            experts: self
                .experts
                .iter()
                .map(|e| RawExpert {
                    layer: e.layer,
                    expert: e.expert,
                    prefix: e.prefix.clone(),
                    offset: e.offset,
                    length: e.length,
                    padded_length: e.padded_length,
                    // Version 1's JSON never carries them (what it was before version 2).
                    codec: (self.major >= 2).then(|| e.codec.as_str().to_string()),
                    stored_length: (self.major >= 2).then_some(e.stored_length),
                    matrices: e
                        .matrices
                        .iter()
                        .map(|m| RawMatrix {
                            role: m.role,
                            name: m.name.clone(),
                            dtype: m.dtype.to_string(),
                            shape: m.shape.clone(),
                            offset: m.offset,
                            length: m.length,
                            source: m.source.clone(),
                        })
                        .collect(),
                })
                .collect(),
            metadata: self.metadata.clone(),
        };
        serde_json::to_string(&raw).expect("header serialises")
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    pub fn expert(&self, layer: u32, expert: u32) -> Option<&ExpertExtent> {
        self.expert_index
            .get(&(layer, expert))
            .map(|&i| &self.experts[i])
    }

    /// Number of experts per layer, by layer (layers without experts are absent).
    pub fn experts_per_layer(&self) -> BTreeMap<u32, u32> {
        let mut m = BTreeMap::new();
        for e in &self.experts {
            *m.entry(e.layer).or_insert(0) += 1;
        }
        m
    }
}
