//! RoPE tables (docs/EXACTNESS.md section 5): per position `pos` and frequency `i < D/2`,
//! `cos_i` and `sin_i` as f32 data, computed on the host with the f64 routines of
//! [`super::detmath`]. A GPU backend uploads these rows; it must never evaluate its own
//! `cos`/`sin`.
//!
//! The table grows on demand (a session computes only the positions it reaches); a row depends
//! only on `(base, D, pos)`, never on when it was computed.

use super::detmath::{pow_f64, sin_cos_f64};

/// Largest position a table accepts: `f32(pos)` is exact below 2^24, as the contract assumes.
pub const MAX_POSITIONS: usize = 1 << 24;

/// Why a RoPE table cannot be built or extended.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RopeError {
    /// head_dim must be even and non-zero.
    #[error("head_dim {0} must be even and non-zero for rotary embeddings")]
    BadHeadDim(usize),
    /// rope_theta must be finite and greater than 1.
    #[error("rope_theta {0} must be finite and greater than 1")]
    BadBase(f64),
    /// The position is past what f32 positions represent exactly.
    #[error("position {0} exceeds the RoPE table limit of 2^24")]
    PositionTooLarge(usize),
}

/// `inv_freq` and the cos/sin rows computed so far.
#[derive(Clone, Debug)]
pub struct RopeTable {
    half: usize,
    inv_freq: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// `base` is the config's rope_theta (as an f64), `head_dim` is D.
    pub fn new(base: f64, head_dim: usize) -> Result<RopeTable, RopeError> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(RopeError::BadHeadDim(head_dim));
        }
        if !(base.is_finite() && base > 1.0) {
            return Err(RopeError::BadBase(base));
        }
        let half = head_dim / 2;
        let inv_freq = (0..half)
            .map(|i| {
                // e_i = f32(2i) / f32(D); b_i = round_f32(base^e_i); inv_freq_i = 1 / b_i
                let e = (2 * i) as f32 / head_dim as f32;
                let b = pow_f64(base, e as f64) as f32;
                1.0f32 / b
            })
            .collect();
        Ok(RopeTable {
            half,
            inv_freq,
            cos: Vec::new(),
            sin: Vec::new(),
        })
    }

    /// The inverse frequencies `inv_freq_i`.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Number of positions computed so far.
    pub fn positions(&self) -> usize {
        self.cos.len() / self.half
    }

    /// Computes rows up to (not including) position `n`.
    pub fn ensure(&mut self, n: usize) -> Result<(), RopeError> {
        if n > MAX_POSITIONS {
            return Err(RopeError::PositionTooLarge(n));
        }
        for pos in self.positions()..n {
            for i in 0..self.half {
                let theta = pos as f32 * self.inv_freq[i];
                let (s, c) = sin_cos_f64(theta as f64);
                self.cos.push(c as f32);
                self.sin.push(s as f32);
            }
        }
        Ok(())
    }

    /// `(cos, sin)` rows of length D/2 for a position below [`RopeTable::positions`].
    pub fn row(&self, pos: usize) -> (&[f32], &[f32]) {
        let r = pos * self.half..(pos + 1) * self.half;
        (&self.cos[r.clone()], &self.sin[r])
    }

    /// Rotates one head vector of length D in place (contract section 6, step 3): for
    /// `i < D/2`, `j = i + D/2`, `x'_i = x_i cos_i - x_j sin_i`, `x'_j = x_j cos_i + x_i sin_i`,
    /// each product rounded, then the sum (no fma).
    pub fn apply(&self, pos: usize, x: &mut [f32]) {
        let (cos, sin) = self.row(pos);
        let (lo, hi) = x.split_at_mut(self.half);
        for i in 0..self.half {
            let (a, b) = (lo[i], hi[i]);
            lo[i] = a * cos[i] - b * sin[i];
            hi[i] = b * cos[i] + a * sin[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f32, b: f32) -> u32 {
        if a == b {
            return 0;
        }
        let ka = a.to_bits() as i32;
        let kb = b.to_bits() as i32;
        let key = |k: i32| if k < 0 { i32::MIN.wrapping_sub(k) } else { k } as i64;
        (key(ka) - key(kb)).unsigned_abs() as u32
    }

    #[test]
    fn cos_sin_within_one_ulp_of_libm() {
        for (base, d) in [(1_000_000.0, 128usize), (10_000.0, 64), (1_000_000.0, 32)] {
            let mut t = RopeTable::new(base, d).unwrap();
            let n = 4096;
            t.ensure(n).unwrap();
            for pos in (0..n).chain([]) {
                let (c, s) = t.row(pos);
                for i in 0..d / 2 {
                    let theta = pos as f32 * t.inv_freq()[i];
                    assert!(
                        ulps(c[i], (theta as f64).cos() as f32) <= 1,
                        "cos {pos} {i}"
                    );
                    assert!(
                        ulps(s[i], (theta as f64).sin() as f32) <= 1,
                        "sin {pos} {i}"
                    );
                }
            }
            // inv_freq against libm's powf-based definition
            for i in 0..d / 2 {
                let e = (2 * i) as f32 / d as f32;
                let want = 1.0f32 / (base.powf(e as f64) as f32);
                assert!(ulps(t.inv_freq()[i], want) <= 1);
            }
        }
        // far positions too
        let mut t = RopeTable::new(1_000_000.0, 128).unwrap();
        t.ensure(300_000).unwrap();
        for pos in (0..300_000).step_by(997) {
            let (c, s) = t.row(pos);
            for i in 0..64 {
                let theta = pos as f32 * t.inv_freq()[i];
                assert!(ulps(c[i], (theta as f64).cos() as f32) <= 1);
                assert!(ulps(s[i], (theta as f64).sin() as f32) <= 1);
            }
        }
    }

    #[test]
    fn rejects_bad_parameters() {
        assert_eq!(
            RopeTable::new(1e6, 7).unwrap_err(),
            RopeError::BadHeadDim(7)
        );
        assert!(RopeTable::new(f64::NAN, 8)
            .unwrap_err()
            .to_string()
            .contains("rope_theta"));
        let mut t = RopeTable::new(1e4, 8).unwrap();
        assert_eq!(
            t.ensure(MAX_POSITIONS + 1),
            Err(RopeError::PositionTooLarge(MAX_POSITIONS + 1))
        );
    }

    #[test]
    fn position_zero_is_identity() {
        let mut t = RopeTable::new(1e6, 8).unwrap();
        t.ensure(1).unwrap();
        let mut x = [1.0, -2.0, 3.0, 4.5, 0.25, 7.0, -1.0, 2.0];
        let before = x;
        t.apply(0, &mut x);
        assert_eq!(x, before);
    }
}
