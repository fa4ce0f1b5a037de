//! Lossless codecs for BF16 expert extents, measured (issue 24, research; PHASE_LOG K1).
//!
//! A BF16 value is sign (1 bit), exponent (8) and mantissa (7). In trained weights the exponent
//! carries ~2.6 bits of information (DFloat11's finding) and the sign and mantissa are close to
//! uniform, so the candidates separate the two:
//! - [`Codec::Zstd`]: the extent's bytes as they are, zstd (the baseline; ~1.27x on real
//!   checkpoints per ZipNN's paper);
//! - [`Codec::BytePlanes`]: ZipNN-style byte grouping: the high bytes (sign + 7 exponent bits)
//!   and the low bytes (1 exponent bit + mantissa) as two planes, each zstd;
//! - [`Codec::ExponentPlane`]: the 8-bit exponents as one plane, zstd (whose literals are
//!   Huffman coded), and sign + mantissa packed in a byte, stored raw. K1 chose it for format
//!   version 2: it is now the production crate `jnf-codec`, which this harness calls.
//!
//! Every codec is a pure function of the bytes; [`decode`] returns the original bytes or an
//! error naming what is wrong (a hostile extent must never crash the reader).

use std::fmt;

/// The codecs compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    Zstd,
    BytePlanes,
    ExponentPlane,
}

impl Codec {
    pub const ALL: [Codec; 3] = [Codec::Zstd, Codec::BytePlanes, Codec::ExponentPlane];
    pub fn name(self) -> &'static str {
        match self {
            Codec::Zstd => "zstd",
            Codec::BytePlanes => "byte-planes+zstd",
            Codec::ExponentPlane => "exponent-plane+zstd",
        }
    }
}

/// A decode failure: the encoded extent is not what its codec writes.
#[derive(Debug, PartialEq, Eq)]
pub struct DecodeError(pub String);

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DecodeError {}

/// Encodes `bf16` (little-endian BF16 values; an odd length is refused by the caller's format,
/// here it panics) with `codec` at zstd `level`. Layout: `u64` element count, then for the
/// planar codecs `u64` length of the first compressed plane, then the planes.
pub fn encode(codec: Codec, bf16: &[u8], level: i32) -> Vec<u8> {
    assert!(bf16.len().is_multiple_of(2), "BF16 bytes come in pairs");
    let n = bf16.len() / 2;
    let mut out = (n as u64).to_le_bytes().to_vec();
    let z = |b: &[u8]| zstd::bulk::compress(b, level).expect("in-memory zstd");
    match codec {
        Codec::Zstd => out.extend(z(bf16)),
        Codec::BytePlanes => {
            let lo: Vec<u8> = bf16.iter().step_by(2).copied().collect();
            let hi: Vec<u8> = bf16.iter().skip(1).step_by(2).copied().collect();
            let (zh, zl) = (z(&hi), z(&lo));
            out.extend((zh.len() as u64).to_le_bytes());
            out.extend(zh);
            out.extend(zl);
        }
        // The production codec (format version 2's), whose layout is the same prefix, frame and
        // plane: the research harness measures exactly what the converter writes.
        Codec::ExponentPlane => {
            return jnf_codec::encode_level(bf16, level).expect("BF16 bytes come in pairs")
        }
    }
    out
}

fn take_u64(b: &[u8], at: usize, what: &str) -> Result<u64, DecodeError> {
    b.get(at..at + 8)
        .map(|s| u64::from_le_bytes(s.try_into().unwrap()))
        .ok_or_else(|| DecodeError(format!("truncated: no {what} at byte {at}")))
}

fn unzstd(b: &[u8], len: usize, what: &str) -> Result<Vec<u8>, DecodeError> {
    let v =
        zstd::bulk::decompress(b, len).map_err(|e| DecodeError(format!("{what}: zstd: {e}")))?;
    if v.len() != len {
        return Err(DecodeError(format!(
            "{what}: {} bytes decoded, {len} expected",
            v.len()
        )));
    }
    Ok(v)
}

/// Decodes what [`encode`] wrote; `max_elems` bounds the element count a hostile header may
/// claim (the extent's size from the manifest, in a reader).
pub fn decode(codec: Codec, enc: &[u8], max_elems: usize) -> Result<Vec<u8>, DecodeError> {
    let n = take_u64(enc, 0, "element count")?;
    if n > max_elems as u64 {
        return Err(DecodeError(format!(
            "claims {n} elements, more than the extent's {max_elems}"
        )));
    }
    let n = n as usize;
    match codec {
        Codec::Zstd => unzstd(&enc[8..], 2 * n, "extent"),
        Codec::ExponentPlane => {
            jnf_codec::decode(enc, 2 * n).map_err(|e| DecodeError(e.to_string()))
        }
        Codec::BytePlanes => {
            let first = take_u64(enc, 8, "first plane's length")?;
            let rest = enc.len() - 16;
            if first > rest as u64 {
                return Err(DecodeError(format!(
                    "first plane of {first} bytes in {rest} remaining"
                )));
            }
            let (a, b) = enc[16..].split_at(first as usize);
            let mut out = vec![0u8; 2 * n];
            let hi = unzstd(a, n, "high-byte plane")?;
            let lo = unzstd(b, n, "low-byte plane")?;
            for (i, o) in out.chunks_exact_mut(2).enumerate() {
                o[0] = lo[i];
                o[1] = hi[i];
            }
            Ok(out)
        }
    }
}

/// Shannon entropy, bits per symbol, of the BF16 exponents of `bf16`, and the size fraction an
/// ideal entropy coder of the exponents (sign and mantissa raw) would reach: `(8 + H) / 16`.
pub fn exponent_entropy(bf16: &[u8]) -> (f64, f64) {
    let mut hist = [0u64; 256];
    for p in bf16.chunks_exact(2) {
        hist[((u16::from_le_bytes([p[0], p[1]]) >> 7) & 0xFF) as usize] += 1;
    }
    let n = (bf16.len() / 2) as f64;
    let h: f64 = hist
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / n;
            -p * p.log2()
        })
        .sum();
    (h, (8.0 + h) / 16.0)
}
