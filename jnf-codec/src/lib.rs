//! The lossless codec of JNF format version 2's expert extents (docs/FORMAT.md, "Version 2"),
//! chosen by measurement (docs/PHASE_LOG.md K1): the **exponent plane, zstd; sign and mantissa
//! raw**.
//!
//! A BF16 value is sign (1 bit), exponent (8) and mantissa (7). In trained weights the exponent
//! carries about 2.5 bits of information in its 8 and the sign and mantissa are close to uniform,
//! so the exponents go to one plane, compressed as one zstd frame (level 1: zstd Huffman-codes
//! its literals, which is where the gain is), and sign and mantissa are packed into one byte per
//! value and stored as they are: compressing them would cost decode time for nothing.
//!
//! An encoded extent of `n` BF16 values (`2n` bytes decoded), integers little-endian:
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 8 | `n`, u64: the number of BF16 values |
//! | 8 | 8 | `z`, u64: the bytes of the exponent plane's zstd frame |
//! | 16 | `z` | one zstd frame whose content is the `n` exponents: byte `i` is `(v_i >> 7) & 0xFF` |
//! | 16 + `z` | `n` | the sign-mantissa plane: byte `i` is `(v_i >> 8) & 0x80 \| v_i & 0x7F` |
//!
//! where `v_i = u16::from_le_bytes([b[2i], b[2i + 1]])` of the decoded bytes `b`. So an encoded
//! extent is always longer than `16 + n` bytes ([`stored_len_is_possible`]): the decoded length
//! is bounded by twice the stored length, which lets a reader refuse a hostile header that claims
//! a huge extent from a few stored bytes before it allocates anything.
//!
//! This crate is bytes in, bytes out: it knows nothing of extents, headers or hashes (the format
//! crate says which extent uses which codec; the readers check the stored and decoded bytes'
//! hashes around [`decode_into`]). It must never panic on hostile bytes, never write outside the
//! buffer it is given, and never allocate beyond the decoded length the caller gives it.

use thiserror::Error;

/// Bytes before the exponent plane's frame: the value count and the frame's length.
pub const PREFIX_LEN: u64 = 16;

/// The zstd level the converter encodes with. Any level decodes the same way; level 1 is the
/// measured choice (PHASE_LOG K1: 1.47x on the synthetic Qwen3-30B-A3B extents against 1.52x
/// for level 19, at 100x the encode speed).
pub const ZSTD_LEVEL: i32 = 1;

/// Why bytes could not be encoded.
#[derive(Debug, Error, PartialEq, Eq, Clone)]
pub enum EncodeError {
    /// BF16 values come in pairs of bytes.
    #[error("{len} bytes are not whole BF16 values (an odd length)")]
    OddLength { len: usize },
    /// zstd refused to compress (it does not, in memory, short of allocation failure).
    #[error("zstd: {0}")]
    Zstd(String),
}

/// Why an encoded extent does not decode: one variant per check, each naming the numbers.
#[derive(Debug, Error, PartialEq, Eq, Clone)]
pub enum DecodeError {
    /// The output buffer is not whole BF16 values.
    #[error("the decoded length {len} is odd: not whole BF16 values")]
    OddLength { len: usize },
    /// Too short for the prefix and the raw sign-mantissa plane of the values asked for:
    /// refused before the decoded extent is allocated.
    #[error("{len} bytes cannot encode {values} BF16 values (16 + {values} bytes at least)")]
    TooShortFor { len: u64, values: u64 },
    /// Shorter than the 16-byte prefix.
    #[error("{len} bytes, shorter than the 16-byte prefix (value count, exponent frame length)")]
    Truncated { len: usize },
    /// The value count is not the extent's.
    #[error("the prefix claims {claimed} BF16 values; the extent has {expected}")]
    ValueCount { claimed: u64, expected: u64 },
    /// The exponent frame's length runs past the end.
    #[error("the exponent plane's frame claims {claimed} bytes; {available} follow the prefix")]
    FrameLength { claimed: u64, available: u64 },
    /// The sign-mantissa plane is not one byte per value.
    #[error("the sign-mantissa plane has {got} bytes; {expected} values need {expected}")]
    SignMantissaLength { got: u64, expected: u64 },
    /// zstd refused the exponent frame (corrupt, or decoding to more than `n` bytes).
    #[error("the exponent plane's zstd frame does not decode to {expected} bytes: {why}")]
    ExponentFrame { expected: u64, why: String },
    /// The frame decoded to fewer exponents than values.
    #[error("the exponent plane decoded to {got} bytes; {expected} values need {expected}")]
    ExponentCount { got: u64, expected: u64 },
}

/// Whether `stored` bytes can be an encoding of `decoded` bytes at all: whole BF16 values, and
/// longer than the prefix plus the raw sign-mantissa plane (a zstd frame is never empty). The
/// format refuses a header that breaks this before any byte of the extent is read, so that a
/// hostile header cannot make a reader allocate a decoded extent larger than twice what is
/// stored.
pub fn stored_len_is_possible(stored: u64, decoded: u64) -> bool {
    decoded.is_multiple_of(2) && stored > PREFIX_LEN + decoded / 2
}

/// `bf16` (little-endian BF16 values) encoded at [`ZSTD_LEVEL`].
pub fn encode(bf16: &[u8]) -> Result<Vec<u8>, EncodeError> {
    encode_level(bf16, ZSTD_LEVEL)
}

/// `bf16` encoded with the exponent plane compressed at zstd `level` (the research harness
/// compares levels; the format does not record the level, which decoding does not need).
pub fn encode_level(bf16: &[u8], level: i32) -> Result<Vec<u8>, EncodeError> {
    if !bf16.len().is_multiple_of(2) {
        return Err(EncodeError::OddLength { len: bf16.len() });
    }
    let n = bf16.len() / 2;
    let mut exp = Vec::with_capacity(n);
    let mut sm = Vec::with_capacity(n);
    for p in bf16.chunks_exact(2) {
        let v = u16::from_le_bytes([p[0], p[1]]);
        exp.push((v >> 7) as u8);
        sm.push(((v >> 8) as u8 & 0x80) | (v as u8 & 0x7F));
    }
    let frame = zstd::bulk::compress(&exp, level).map_err(|e| EncodeError::Zstd(e.to_string()))?;
    let mut out = Vec::with_capacity(PREFIX_LEN as usize + frame.len() + n);
    out.extend_from_slice(&(n as u64).to_le_bytes());
    out.extend_from_slice(&(frame.len() as u64).to_le_bytes());
    out.extend_from_slice(&frame);
    out.extend_from_slice(&sm);
    Ok(out)
}

/// Decodes `enc` into `out`, whose length is the extent's decoded length (from the header):
/// every byte of `out` is written on success; on error its contents are unspecified (and must
/// not be used). No allocation beyond zstd's own decoding context.
pub fn decode_into(enc: &[u8], out: &mut [u8]) -> Result<(), DecodeError> {
    if !out.len().is_multiple_of(2) {
        return Err(DecodeError::OddLength { len: out.len() });
    }
    let n = out.len() / 2;
    if (enc.len() as u64) < PREFIX_LEN {
        return Err(DecodeError::Truncated { len: enc.len() });
    }
    let word = |at: usize| u64::from_le_bytes(enc[at..at + 8].try_into().expect("8 bytes"));
    let (claimed, frame_len) = (word(0), word(8));
    if claimed != n as u64 {
        return Err(DecodeError::ValueCount {
            claimed,
            expected: n as u64,
        });
    }
    let rest = &enc[PREFIX_LEN as usize..];
    if frame_len > rest.len() as u64 {
        return Err(DecodeError::FrameLength {
            claimed: frame_len,
            available: rest.len() as u64,
        });
    }
    let (frame, sm) = rest.split_at(frame_len as usize);
    if sm.len() != n {
        return Err(DecodeError::SignMantissaLength {
            got: sm.len() as u64,
            expected: n as u64,
        });
    }
    // The exponents are decoded into the upper half of `out`, then interleaved downwards in
    // place: no second buffer of the extent's size (the streaming tier charges every buffer
    // alive to its RAM budget, and this one needs none).
    let got = zstd::bulk::decompress_to_buffer(frame, &mut out[n..]).map_err(|e| {
        DecodeError::ExponentFrame {
            expected: n as u64,
            why: e.to_string(),
        }
    })?;
    if got != n {
        return Err(DecodeError::ExponentCount {
            got: got as u64,
            expected: n as u64,
        });
    }
    interleave_in_place(out, sm);
    Ok(())
}

/// [`decode_into`] a fresh buffer of `decoded_len` bytes.
pub fn decode(enc: &[u8], decoded_len: usize) -> Result<Vec<u8>, DecodeError> {
    if !decoded_len.is_multiple_of(2) {
        return Err(DecodeError::OddLength { len: decoded_len });
    }
    // Checked before allocating: a hostile caller-supplied length must not allocate first.
    if (enc.len() as u64) < PREFIX_LEN + decoded_len as u64 / 2 {
        return Err(DecodeError::TooShortFor {
            len: enc.len() as u64,
            values: decoded_len as u64 / 2,
        });
    }
    let mut out = vec![0u8; decoded_len];
    decode_into(enc, &mut out)?;
    Ok(out)
}

/// `out` (2m bytes) holds m exponents in its upper half; writes the m BF16 values of the
/// exponents and `sm` (m bytes) over all of it. Each round takes the first half of what is
/// left: its values are written below the exponents still unread (writes `out[..2h]`, reads
/// `out[m..m + h]`, disjoint for `h <= m / 2`), and what remains has the same shape again, so
/// the loops borrow disjoint slices (and vectorise) and the whole costs O(m).
fn interleave_in_place(mut out: &mut [u8], mut sm: &[u8]) {
    debug_assert_eq!(out.len(), 2 * sm.len());
    while !sm.is_empty() {
        let m = sm.len();
        if m == 1 {
            // Read the last exponent before its byte is overwritten.
            let v = value(out[1], sm[0]);
            out.copy_from_slice(&v.to_le_bytes());
            return;
        }
        let h = m / 2;
        let (lo, hi) = out.split_at_mut(m);
        for ((o, &e), &s) in lo[..2 * h].chunks_exact_mut(2).zip(&hi[..h]).zip(&sm[..h]) {
            o.copy_from_slice(&value(e, s).to_le_bytes());
        }
        out = &mut std::mem::take(&mut out)[2 * h..];
        sm = &sm[h..];
    }
}

/// The BF16 bits of exponent byte `e` and sign-mantissa byte `s`.
#[inline(always)]
fn value(e: u8, s: u8) -> u16 {
    ((s as u16 & 0x80) << 8) | ((e as u16) << 7) | (s as u16 & 0x7F)
}
