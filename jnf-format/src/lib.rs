//! The JNF container: one file (`model.jnf`) holding a model's tensors, laid out for streaming.
//!
//! Every expert's gate, up and down matrices form one contiguous *extent*; the experts of a layer
//! sit next to each other in id order; every extent starts at a 4096-byte-aligned offset and is
//! zero-padded to a multiple of 4096, so that one O_DIRECT read fetches exactly one expert.
//! Non-expert tensors live in their own region, each also 4096-aligned. The bytes are the source
//! checkpoint's bytes, unchanged: this crate has no notion of converting a value.
//!
//! Format version 2 adds one thing: an expert extent may be *stored* encoded with a lossless
//! codec ([`ExtentCodec`], bytes by `jnf-codec`), recorded per extent with its stored length;
//! the alignment rules then apply to the stored extent, so one O_DIRECT read still fetches one
//! expert, and [`ExpertExtent::decode_stored`] gives back the checkpoint's bytes exactly.
//!
//! docs/FORMAT.md specifies the layout byte by byte. This crate is the only place its rules live:
//! [`Header::parse`] validates a header completely (size cap, bounds, overlaps, alignment, checked
//! shape arithmetic, expert packing and order) and [`LayoutPlan`] is the only way to produce one.
//! It must never accept a header it could not have written, and never read tensor data it was not
//! asked for.

mod error;
mod header;
mod layout;
mod reader;
pub mod relayout;

pub use error::JnfError;
pub use header::{
    check_extent_storage, check_version, Dtype, ExpertExtent, ExpertMatrix, ExtentCodec,
    ExtentEncoding, Header, MatrixRole, SourceRef, TensorEntry, MAX_HEADER_LEN, READS,
};
pub use layout::{LayoutPlan, MatrixSpec, TensorSpec};
pub use reader::JnfFile;
pub use relayout::Relayout;

/// The eight bytes every JNF file starts with.
pub const MAGIC: [u8; 8] = *b"TARFAJNF";
/// The newest format version this crate reads and writes. It writes version 1 when every extent
/// is raw (a plan without [`LayoutPlan::set_extent_storage`]: byte for byte what it wrote before
/// version 2 existed) and version 2 when extents record their codec; it reads every version in
/// [`READS`] (minor versions only ever add optional header fields).
pub const FORMAT_MAJOR: u16 = 2;
pub const FORMAT_MINOR: u16 = 0;
/// The version of a bundle whose every extent is stored raw, as before codecs existed.
pub const FORMAT_MAJOR_RAW: u16 = 1;
/// Alignment (and padding unit) of every tensor and extent: one page, the O_DIRECT unit.
pub const ALIGN: u64 = 4096;
/// Bytes before the header JSON: magic, major, minor, reserved u32, header length u64.
pub const PREAMBLE_LEN: u64 = 24;
/// The file name of the container inside a bundle directory.
pub const CONTAINER_FILE: &str = "model.jnf";

/// Round `n` up to a multiple of [`ALIGN`], or `None` on overflow.
pub fn align_up(n: u64) -> Option<u64> {
    n.checked_add(ALIGN - 1).map(|v| v / ALIGN * ALIGN)
}
