//! MXFP4 as gpt-oss is released (docs/EXACTNESS.md, "MXFP4"): blocks of 32 values, each a
//! 4-bit e2m1 code (two per byte, low nibble first) times the block's e8m0 scale `2^(s - 127)`.
//!
//! Widening is exact: an e2m1 value has at most two significant bits (0, 0.5, 1, 1.5, 2, 3, 4,
//! 6 and their negatives, `-0` included), so its product with a power of two is a BF16 value
//! whenever it is finite; the smallest, `0.5 * 2^-127 = 2^-128`, is a BF16 subnormal (BF16
//! reaches `2^-133`). What cannot be widened is refused, never rounded: scale 255 (NaN in the
//! OCP MX format) and scale 254 with a magnitude of 2 or more (`2^128` overflows).

/// The e2m1 codes' values as BF16 bits: `+0, 0.5, 1, 1.5, 2, 3, 4, 6`, then the same negated
/// (code 8 is `-0`).
const E2M1_BF16: [u16; 16] = [
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0, 0x8000, 0xBF00, 0xBF80, 0xBFC0,
    0xC000, 0xC040, 0xC080, 0xC0C0,
];

/// A block that has no exact BF16 widening.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Mxfp4Error {
    /// Scale 255 is NaN in the OCP MX format.
    #[error("block {block} has e8m0 scale 255 (NaN)")]
    NanScale { block: usize },
    /// The value overflows (scale 254 times a magnitude of 2 or more).
    #[error("block {block} (e8m0 scale {scale}) holds a value that overflows BF16")]
    Overflow { block: usize, scale: u8 },
}

/// `code * 2^(scale - 127)` as BF16 bits, exactly, or None when it is not finite.
pub fn widen(code: u8, scale: u8) -> Option<u16> {
    let v = E2M1_BF16[(code & 0x0F) as usize];
    if scale == 255 {
        return None;
    }
    if v & 0x7FFF == 0 {
        return Some(v); // +0 and -0 stay as they are
    }
    // 2^(scale - 127) as f32: a normal power of two for scale >= 1, 2^-127 (subnormal) for 0.
    let pow = if scale == 0 {
        f32::from_bits(1 << 22)
    } else {
        f32::from_bits((scale as u32) << 23)
    };
    // exact: both factors have at most 2 significant bits and the product is >= 2^-128
    let x = f32::from_bits((v as u32) << 16) * pow;
    if !x.is_finite() {
        return None;
    }
    let bits = x.to_bits();
    debug_assert_eq!(
        bits & 0xFFFF,
        0,
        "an e2m1 value times a power of two is a BF16 value"
    );
    Some((bits >> 16) as u16)
}

/// Widens a row-major matrix of `rows x cols` values held as `blocks` (`rows x cols/32 x 16`
/// bytes) and `scales` (`rows x cols/32`) into BF16 bits: value `(r, 32g + 2b)` is the low
/// nibble of byte `b` of block `(r, g)`, `(r, 32g + 2b + 1)` its high nibble. The rows listed
/// in `rows_taken` are widened, in that order (gpt-oss de-interleaves gate and up this way).
pub fn widen_rows(
    blocks: &[u8],
    scales: &[u8],
    cols: usize,
    rows_taken: impl Iterator<Item = usize>,
    out: &mut Vec<u16>,
) -> Result<(), Mxfp4Error> {
    let groups = cols / 32;
    // Each block's 16 possible values, widened once per scale ([`widen`] for every code) and
    // looked up per nibble: the same values, without a multiply per value (the streamed
    // experts are widened on every fetch). A code whose value is not finite is refused when it
    // occurs, as before; its table entry is never pushed.
    const BAD: u32 = u32::MAX;
    let mut table = [0u32; 16];
    let mut table_scale: Option<u8> = None;
    out.reserve(rows_taken.size_hint().0 * cols);
    for r in rows_taken {
        for g in 0..groups {
            let block = r * groups + g;
            let s = scales[block];
            if table_scale != Some(s) {
                for (code, t) in table.iter_mut().enumerate() {
                    *t = widen(code as u8, s).map_or(BAD, u32::from);
                }
                table_scale = Some(s);
            }
            for &byte in &blocks[block * 16..(block + 1) * 16] {
                for code in [byte & 0x0F, byte >> 4] {
                    let w = table[code as usize];
                    if w == BAD {
                        return Err(if s == 255 {
                            Mxfp4Error::NanScale { block }
                        } else {
                            Mxfp4Error::Overflow { block, scale: s }
                        });
                    }
                    out.push(w as u16);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(bits: u16) -> f32 {
        f32::from_bits((bits as u32) << 16)
    }

    /// Every code at every finite scale is the exact product, computed in f64 (which holds
    /// every such product exactly).
    #[test]
    fn widening_is_the_exact_product_at_every_scale() {
        let values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        for scale in 0u8..=254 {
            for code in 0u8..16 {
                let mag = values[(code & 7) as usize];
                let v = if code & 8 != 0 { -mag } else { mag };
                let want = v * 2f64.powi(scale as i32 - 127);
                match widen(code, scale) {
                    Some(b) => {
                        assert_eq!(f(b) as f64, want, "code {code} scale {scale}");
                        assert_eq!(f(b).is_sign_negative(), code & 8 != 0, "sign of {code}");
                    }
                    None => assert!(
                        want.abs() > f32::MAX as f64,
                        "code {code} scale {scale} refused but finite"
                    ),
                }
            }
        }
    }

    #[test]
    fn the_edge_cases_are_exact_or_refused() {
        assert_eq!(widen(8, 127), Some(0x8000), "-0 stays -0");
        assert_eq!(widen(0, 255), None, "scale 255 is NaN even for a zero code");
        assert_eq!(f(widen(1, 0).unwrap()), 2f32.powi(-128), "a BF16 subnormal");
        assert_eq!(f(widen(7, 254).unwrap_or(0)), 0.0, "6 * 2^127 overflows");
        assert_eq!(widen(7, 254), None);
        assert_eq!(f(widen(3, 254).unwrap()), 1.5 * 2f32.powi(127));
        let mut out = Vec::new();
        let blocks = [0x21u8; 16];
        assert_eq!(
            widen_rows(&blocks, &[255], 32, 0..1, &mut out),
            Err(Mxfp4Error::NanScale { block: 0 })
        );
        out.clear();
        widen_rows(&blocks, &[128], 32, 0..1, &mut out).unwrap();
        // low nibble 1 (0.5) first, then high nibble 2 (1.0), times 2
        assert_eq!((f(out[0]), f(out[1]), out.len()), (1.0, 2.0, 32));
    }

    /// widen_rows (its per-scale table) gives exactly [`widen`] of every nibble, low first, for
    /// rows taken in any order, with scales changing from block to block; a block whose code
    /// overflows is refused only where such a code occurs.
    #[test]
    fn widen_rows_is_widen_of_every_nibble() {
        let (rows, cols) = (6usize, 96usize);
        let groups = cols / 32;
        let mut z = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            z ^= z << 13;
            z ^= z >> 7;
            z ^= z << 17;
            z
        };
        let blocks: Vec<u8> = (0..rows * groups * 16).map(|_| next() as u8).collect();
        // scales 0..=253 (every code finite), repeated runs included
        let scales: Vec<u8> = (0..rows * groups)
            .map(|b| {
                if b % 3 == 1 {
                    127
                } else {
                    (next() % 254) as u8
                }
            })
            .collect();
        let taken = [4usize, 0, 5, 1];
        let mut out = Vec::new();
        widen_rows(&blocks, &scales, cols, taken.iter().copied(), &mut out).unwrap();
        let mut want = Vec::new();
        for &r in &taken {
            for g in 0..groups {
                let b = r * groups + g;
                for &byte in &blocks[b * 16..(b + 1) * 16] {
                    want.push(widen(byte & 0x0F, scales[b]).unwrap());
                    want.push(widen(byte >> 4, scales[b]).unwrap());
                }
            }
        }
        assert_eq!(out, want);
        // scale 254: codes 4..7 and 12..15 (magnitude >= 2) overflow; 0..3 are fine
        out.clear();
        widen_rows(&[0x31u8; 16], &[254], 32, 0..1, &mut out).unwrap();
        assert_eq!(f(out[1]), 1.5 * 2f32.powi(127));
        out.clear();
        let mut b = [0x31u8; 32];
        b[16 + 5] = 0x71;
        assert_eq!(
            widen_rows(&b, &[254, 254], 32, 0..2, &mut out),
            Err(Mxfp4Error::Overflow {
                block: 1,
                scale: 254
            })
        );
    }
}
