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
    for r in rows_taken {
        for g in 0..groups {
            let block = r * groups + g;
            let s = scales[block];
            for &byte in &blocks[block * 16..(block + 1) * 16] {
                for code in [byte & 0x0F, byte >> 4] {
                    let w = widen(code, s).ok_or(if s == 255 {
                        Mxfp4Error::NanScale { block }
                    } else {
                        Mxfp4Error::Overflow { block, scale: s }
                    })?;
                    out.push(w);
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
}
