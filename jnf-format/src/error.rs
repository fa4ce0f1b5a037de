//! One error variant per check a JNF file can fail.

use thiserror::Error;

#[derive(Debug, Error, PartialEq, Eq, Clone)]
pub enum JnfError {
    /// The file is shorter than the 24-byte preamble.
    #[error("file is {size} bytes, shorter than the 24-byte JNF preamble")]
    TooShort { size: u64 },
    /// The first eight bytes are not `TARFAJNF`.
    #[error("not a JNF file (bad magic bytes)")]
    BadMagic,
    /// The file's version is newer than this reader's: a newer major version, or a newer minor
    /// version of one it reads. Named, with the reader's own, so that the user knows to use a
    /// newer Tarfa; never misread.
    #[error(
        "format version {major}.{minor} is newer than this reader ({reads_major}.{reads_minor}); \
         read it with a newer Tarfa"
    )]
    NewerVersion {
        major: u16,
        minor: u16,
        reads_major: u16,
        reads_minor: u16,
    },
    /// A version no JNF writer writes (major 0).
    #[error("format version {major}.{minor} is not a JNF version (they start at 1.0)")]
    UnknownVersion { major: u16, minor: u16 },
    /// The reserved preamble word must be zero.
    #[error("reserved preamble field is {0:#x}, expected 0")]
    ReservedNonZero(u32),
    /// The declared header length exceeds the cap.
    #[error("header length {len} exceeds the cap of {cap} bytes")]
    HeaderTooLarge { len: u64, cap: u64 },
    /// The declared header runs past the end of the file.
    #[error("header length {len} runs past the end of the {file_size}-byte file")]
    HeaderBeyondFile { len: u64, file_size: u64 },
    /// The header bytes are not UTF-8.
    #[error("header is not valid UTF-8")]
    HeaderNotUtf8,
    /// The header is not valid JSON of the expected schema.
    #[error("header JSON is invalid: {0}")]
    HeaderJson(String),
    /// The header records a different file size than the file has (truncated or appended to).
    #[error("header says the file is {expected} bytes but it is {actual} (truncated or extended)")]
    FileSizeMismatch { expected: u64, actual: u64 },
    /// `data_start` is not the first aligned offset after the header.
    #[error("data_start is {actual}, expected {expected}")]
    DataStartMismatch { expected: u64, actual: u64 },
    /// The header declares an alignment other than 4096.
    #[error("alignment {0} is not supported (must be 4096)")]
    UnsupportedAlignment(u64),
    /// Two entries share a name.
    #[error("duplicate name {0:?}")]
    DuplicateName(String),
    /// A name is empty or contains control characters.
    #[error("invalid tensor name {0:?}")]
    InvalidName(String),
    /// The dtype string is not one JNF knows.
    #[error("tensor {name:?} has unknown dtype {dtype:?}")]
    UnknownDtype { name: String, dtype: String },
    /// The dtype is known but refused: JNF never carries quantized weights.
    #[error("tensor {name:?} has dtype {dtype}, which JNF refuses (quantized or non-float)")]
    RefusedDtype { name: String, dtype: String },
    /// An expert matrix is not BF16.
    #[error("expert matrix {name:?} is {dtype}; expert weights must be BF16")]
    ExpertNotBf16 { name: String, dtype: String },
    /// The element count of a shape overflows u64.
    #[error("tensor {name:?}: shape {shape:?} overflows")]
    ShapeOverflow { name: String, shape: Vec<u64> },
    /// The byte length does not equal shape x dtype size.
    #[error("tensor {name:?}: length {actual} != shape x dtype size {expected}")]
    LengthMismatch {
        name: String,
        expected: u64,
        actual: u64,
    },
    /// An offset that must be 4096-aligned is not.
    #[error("{name:?} starts at {offset}, not a multiple of 4096")]
    Misaligned { name: String, offset: u64 },
    /// A region starts before the data region.
    #[error("{name:?} starts at {offset}, inside the header (data starts at {data_start})")]
    InsideHeader {
        name: String,
        offset: u64,
        data_start: u64,
    },
    /// A region ends past the end of the file (or its end overflows).
    #[error("{name:?} spans {offset}+{length}, past the end of the {file_size}-byte file")]
    OutOfBounds {
        name: String,
        offset: u64,
        length: u64,
        file_size: u64,
    },
    /// Two regions overlap.
    #[error("{first:?} and {second:?} overlap")]
    Overlap { first: String, second: String },
    /// An expert's matrices are not gate, up, down in that order.
    #[error("expert {prefix:?}: matrices must be gate, up, down in that order (or the MXFP4 parts gate_up_blocks, gate_up_scales, down_blocks, down_scales)")]
    ExpertRoles { prefix: String },
    /// An MXFP4 extent's parts are not the released blocks and scales of `gate_up [2I, H]`
    /// and `down [H, I]` (U8, blocks `[rows, groups, 16]`, scales `[rows, groups]`).
    #[error("expert {prefix:?}: not an MXFP4 extent as released: {why}")]
    Mxfp4Layout { prefix: String, why: String },
    /// An expert's matrices are not packed back to back from the extent start.
    #[error(
        "expert {prefix:?}: matrix {name:?} at {offset} inside the extent, expected {expected}"
    )]
    ExpertNotPacked {
        prefix: String,
        name: String,
        offset: u64,
        expected: u64,
    },
    /// An extent's length is not the sum of its matrices, or its padding is wrong.
    #[error("expert {prefix:?}: length {length} / padded {padded} inconsistent with matrices ({sum} bytes)")]
    ExpertLength {
        prefix: String,
        length: u64,
        padded: u64,
        sum: u64,
    },
    /// Extents are not in (layer, expert) order in the file, or a (layer, expert) repeats.
    #[error("expert {prefix:?} is out of (layer, expert) order or repeated")]
    ExpertOrder { prefix: String },
    /// An expert's prefix does not name its layer and expert, or a matrix is not under it.
    #[error("expert {prefix:?} does not name layer {layer}, expert {expert} (or a matrix is not under it)")]
    ExpertName {
        prefix: String,
        layer: u32,
        expert: u32,
    },
    /// A version-2 extent names a codec this reader does not know.
    #[error(
        "expert {prefix:?}: unknown codec {codec:?} (this reader knows \"raw\" and \"exp-zstd\")"
    )]
    UnknownCodec { prefix: String, codec: String },
    /// An extent's storage fields break a rule of version 2: a version-2 extent without its
    /// `codec` or `stored_length`, a version-1 extent with one, a raw extent whose stored length
    /// is not its length, an encoded MXFP4 extent, or a stored length no encoding can have.
    #[error("expert {prefix:?}: {why}")]
    ExtentStorage { prefix: String, why: String },
    /// An encoded extent's stored bytes do not decode (a reader checks the stored bytes' hash
    /// first, so this is a hostile or corrupt extent that was not hash-checked).
    #[error("expert {prefix:?}: the stored extent does not decode: {source}")]
    Decode {
        prefix: String,
        source: jnf_codec::DecodeError,
    },
    /// Re-encoding a parsed header needs more room than it has before `data_start`.
    #[error("re-encoded header is {len} bytes, more than the {room} bytes before data_start")]
    EncodedHeaderTooLong { len: u64, room: u64 },
    /// An I/O error while reading.
    #[error("I/O error: {0}")]
    Io(String),
}

impl From<std::io::Error> for JnfError {
    fn from(e: std::io::Error) -> Self {
        JnfError::Io(e.to_string())
    }
}
