//! RoPE tables (docs/EXACTNESS.md section 5): per position `pos` and frequency `i < D/2`,
//! `cos_i` and `sin_i` as f32 data, computed on the host with the f64 routines of
//! [`super::detmath`]. A GPU backend uploads these rows; it must never evaluate its own
//! `cos`/`sin`.
//!
//! The table grows on demand (a session computes only the positions it reaches); a row depends
//! only on `(base, D, pos)`, never on when it was computed.

use super::detmath::{ln_f64, pow_f64, sin_cos_f64};

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

/// YaRN rotary scaling (docs/EXACTNESS.md section 5, "YaRN"), the keys of a `rope_type: yarn`
/// block as transformers 5.17's `_compute_yarn_parameters` reads them, after its defaults:
/// `beta_fast` 32 and `beta_slow` 1 when absent (or 0), `truncate` true when absent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// `factor`.
    pub factor: f64,
    /// `original_max_position_embeddings`.
    pub original_max_position_embeddings: f64,
    /// `beta_fast`.
    pub beta_fast: f64,
    /// `beta_slow`.
    pub beta_slow: f64,
    /// `mscale` (absent: None).
    pub mscale: Option<f64>,
    /// `mscale_all_dim` (absent: None).
    pub mscale_all_dim: Option<f64>,
    /// `attention_factor` as written, when written.
    pub attention_factor: Option<f64>,
    /// `truncate`: round the correction range outward to whole dimensions.
    pub truncate: bool,
}

/// YaRN's `get_mscale(scale, m) = 0.1 * m * ln(scale) + 1` (1 when `scale <= 1`), in f64 with
/// Python's operation order.
pub fn yarn_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        return 1.0;
    }
    0.1 * m * ln_f64(scale) + 1.0
}

impl Yarn {
    /// The factor cos and sin are multiplied by: `attention_factor` when written; else
    /// `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both are non-zero; else
    /// `mscale(factor, 1)`.
    pub fn attention_factor(&self) -> f64 {
        if let Some(a) = self.attention_factor {
            return a;
        }
        match (self.mscale, self.mscale_all_dim) {
            (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                yarn_mscale(self.factor, m) / yarn_mscale(self.factor, a)
            }
            _ => yarn_mscale(self.factor, 1.0),
        }
    }

    /// `inv_freq` for rotary width `dim` and base `base`, operation for operation as
    /// transformers computes it (f32 tensors, f64 Python scalars):
    /// - `p_i = f32(base^(f32(2i) / f32(dim)))`; `ext_i = 1 / p_i`; `int_i = 1 / (f32(factor) * p_i)`;
    /// - `corr(r) = (dim * ln(orig / (r * 2 * pi))) / (2 * ln(base))` in f64; `low = corr(beta_fast)`,
    ///   `high = corr(beta_slow)`, floored and ceiled when `truncate`, then `low = max(low, 0)`,
    ///   `high = min(high, dim - 1)`, and `high += 0.001` when they are equal;
    /// - `ramp_i = clamp((f32(i) - f32(low)) / f32(high - low), 0, 1)`; `e_i = 1 - ramp_i`;
    /// - `inv_freq_i = int_i * (1 - e_i) + ext_i * e_i`, each operation rounded (no fma).
    pub fn inv_freq(&self, base: f64, dim: usize) -> Vec<f32> {
        let half = dim / 2;
        let pi = std::f64::consts::PI;
        let corr = |rot: f64| {
            (dim as f64 * ln_f64(self.original_max_position_embeddings / (rot * 2.0 * pi)))
                / (2.0 * ln_f64(base))
        };
        let (mut low, mut high) = (corr(self.beta_fast), corr(self.beta_slow));
        if self.truncate {
            low = low.floor();
            high = high.ceil();
        }
        let low = low.max(0.0);
        let mut high = high.min((dim - 1) as f64);
        if low == high {
            high += 0.001;
        }
        let (low32, span32) = (low as f32, (high - low) as f32);
        let factor = self.factor as f32;
        (0..half)
            .map(|i| {
                let e = (2 * i) as f32 / dim as f32;
                let p = pow_f64(base, e as f64) as f32;
                let ext = 1.0f32 / p;
                let int = 1.0f32 / (factor * p);
                let ramp = ((i as f32 - low32) / span32).clamp(0.0, 1.0);
                let ef = 1.0f32 - ramp;
                int * (1.0f32 - ef) + ext * ef
            })
            .collect()
    }
}

/// Llama 3.1's rotary scaling (`rope_type: llama3`; Llama 4 Scout and Maverick), the keys as
/// transformers 5.17's `_compute_llama3_parameters` reads them (all four required).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3 {
    /// `factor`.
    pub factor: f64,
    /// `low_freq_factor`.
    pub low_freq_factor: f64,
    /// `high_freq_factor`.
    pub high_freq_factor: f64,
    /// `original_max_position_embeddings`.
    pub original_max_position_embeddings: f64,
}

impl Llama3 {
    /// `inv_freq` for rotary width `dim`, operation for operation as transformers computes it
    /// on f32 tensors with f64 Python scalars (a scalar meets a tensor as `f32(scalar)`;
    /// `scalar / t` is torch's `t.reciprocal() * scalar`):
    /// - `f_i` the default frequencies; `w_i = (1 / f_i) * f32(2 pi)`;
    /// - `lo = f32(orig / low_freq_factor)`, `hi = f32(orig / high_freq_factor)` (f64 quotients);
    /// - `g_i = f_i / f32(factor)` when `w_i > lo`, else `f_i`;
    /// - when neither `w_i < hi` nor `w_i > lo` (the medium band):
    ///   `s = ((1 / w_i) * f32(orig) - f32(low)) / f32(high - low)`,
    ///   `g_i = ((1 - s) * g_i) / f32(factor) + s * g_i`, each operation rounded (no fma).
    pub fn inv_freq(&self, base: f64, dim: usize) -> Vec<f32> {
        let two_pi = (2.0 * std::f64::consts::PI) as f32;
        let orig = self.original_max_position_embeddings;
        let lo = (orig / self.low_freq_factor) as f32;
        let hi = (orig / self.high_freq_factor) as f32;
        let factor = self.factor as f32;
        let span = (self.high_freq_factor - self.low_freq_factor) as f32;
        default_inv_freq(base, dim)
            .into_iter()
            .map(|f| {
                let w = (1.0f32 / f) * two_pi;
                let g = if w > lo { f / factor } else { f };
                // transformers' `~(w < hi) * ~(w > lo)`, written as such (a NaN is medium)
                #[allow(clippy::neg_cmp_op_on_partial_ord)]
                let medium = !(w < hi) && !(w > lo);
                if medium {
                    let s = ((1.0f32 / w) * orig as f32 - self.low_freq_factor as f32) / span;
                    ((1.0f32 - s) * g) / factor + s * g
                } else {
                    g
                }
            })
            .collect()
    }
}

/// The default frequencies: `e_i = f32(2i) / f32(D)`, `b_i = round_f32(base^e_i)`,
/// `inv_freq_i = 1 / b_i`.
fn default_inv_freq(base: f64, dim: usize) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| {
            let e = (2 * i) as f32 / dim as f32;
            let b = pow_f64(base, e as f64) as f32;
            1.0f32 / b
        })
        .collect()
}

/// `inv_freq` and the cos/sin rows computed so far.
#[derive(Clone, Debug)]
pub struct RopeTable {
    half: usize,
    inv_freq: Vec<f32>,
    /// `f32(attention_factor)`: every cos and sin is multiplied by it (1 without YaRN).
    scale: f32,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// `base` is the config's rope_theta (as an f64), `head_dim` is D.
    pub fn new(base: f64, head_dim: usize) -> Result<RopeTable, RopeError> {
        RopeTable::with_scaling(base, head_dim, None)
    }

    /// A table with YaRN's frequencies and attention factor when `yarn` is given.
    pub fn with_scaling(
        base: f64,
        head_dim: usize,
        yarn: Option<&Yarn>,
    ) -> Result<RopeTable, RopeError> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(RopeError::BadHeadDim(head_dim));
        }
        if !(base.is_finite() && base > 1.0) {
            return Err(RopeError::BadBase(base));
        }
        let half = head_dim / 2;
        let (inv_freq, scale) = match yarn {
            Some(y) => (y.inv_freq(base, head_dim), y.attention_factor() as f32),
            None => (default_inv_freq(base, head_dim), 1.0),
        };
        Ok(RopeTable {
            half,
            inv_freq,
            scale,
            cos: Vec::new(),
            sin: Vec::new(),
        })
    }

    /// A table with Llama 3.1's scaled frequencies (no attention factor: transformers' is 1).
    pub fn with_llama3(
        base: f64,
        head_dim: usize,
        llama3: &Llama3,
    ) -> Result<RopeTable, RopeError> {
        let mut t = RopeTable::with_scaling(base, head_dim, None)?;
        t.inv_freq = llama3.inv_freq(base, head_dim);
        Ok(t)
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
                // transformers rounds cos and sin to f32, then multiplies by the factor
                self.cos.push(c as f32 * self.scale);
                self.sin.push(s as f32 * self.scale);
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

    /// Llama 4's complex form (`view_as_complex` of pairs times `cos + i sin`): for `i < D/2`,
    /// the pair `(a, b) = (x_2i, x_2i+1)` becomes `(a cos_i - b sin_i, a sin_i + b cos_i)`, each
    /// product rounded, then the sum (no fma); the pairs stay where they are.
    pub fn apply_pairs(&self, pos: usize, x: &mut [f32]) {
        let (cos, sin) = self.row(pos);
        for (i, pair) in x.chunks_exact_mut(2).enumerate().take(self.half) {
            let (a, b) = (pair[0], pair[1]);
            pair[0] = a * cos[i] - b * sin[i];
            pair[1] = a * sin[i] + b * cos[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama 3.1's bands: wavelengths below `orig / high_freq_factor` keep their frequency bit
    /// for bit, those above `orig / low_freq_factor` are divided by `factor` (one rounding), and
    /// the medium band lies between the two, close to the f64 interpolation.
    #[test]
    fn llama3_scaling_keeps_high_divides_low_and_interpolates_between() {
        let l3 = Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64.0,
        };
        let (base, d) = (500000.0, 32);
        let plain = RopeTable::new(base, d).unwrap();
        let t = RopeTable::with_llama3(base, d, &l3).unwrap();
        let (mut high, mut low, mut medium) = (0, 0, 0);
        for (i, (&f, &g)) in plain.inv_freq().iter().zip(t.inv_freq()).enumerate() {
            let w = 2.0 * std::f64::consts::PI / f as f64;
            if w < 16.0 {
                assert_eq!(g.to_bits(), f.to_bits(), "{i}: high frequency kept");
                high += 1;
            } else if w > 64.0 {
                assert_eq!(
                    g.to_bits(),
                    (f / 8.0f32).to_bits(),
                    "{i}: low frequency / 8"
                );
                low += 1;
            } else {
                let s = (64.0 / w - 1.0) / 3.0;
                let want = (1.0 - s) * f as f64 / 8.0 + s * f as f64;
                assert!(
                    ((g as f64 - want) / want).abs() < 1e-6,
                    "{i}: {g} vs {want}"
                );
                medium += 1;
            }
        }
        assert!(high > 0 && low > 0 && medium > 0, "{high} {low} {medium}");
    }

    /// The complex form is the rotate-half form on the de-interleaved vector, re-interleaved:
    /// the same products and sums, bit for bit.
    #[test]
    fn the_pair_form_is_rotate_half_on_deinterleaved_pairs() {
        let d = 16;
        let mut t = RopeTable::new(500000.0, d).unwrap();
        t.ensure(40).unwrap();
        let x: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37 - 2.0).sin()).collect();
        for pos in [0, 1, 17, 39] {
            let mut pairs = x.clone();
            t.apply_pairs(pos, &mut pairs);
            let mut halves: Vec<f32> = (0..d / 2).map(|i| x[2 * i]).collect();
            halves.extend((0..d / 2).map(|i| x[2 * i + 1]));
            t.apply(pos, &mut halves);
            for i in 0..d / 2 {
                assert_eq!(pairs[2 * i].to_bits(), halves[i].to_bits());
                assert_eq!(pairs[2 * i + 1].to_bits(), halves[d / 2 + i].to_bits());
            }
        }
    }

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

    fn yarn(factor: f64) -> Yarn {
        Yarn {
            factor,
            original_max_position_embeddings: 4096.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: None,
            mscale_all_dim: None,
            attention_factor: None,
            truncate: true,
        }
    }

    #[test]
    fn yarn_interpolates_only_the_low_frequencies() {
        // factor 1: interpolation is extrapolation, so the default table up to the rounding of
        // the blend `a * (1 - e) + a * e` inside the ramp (transformers rounds it the same way)
        let plain = RopeTable::new(1e4, 64).unwrap();
        let one = RopeTable::with_scaling(1e4, 64, Some(&yarn(1.0))).unwrap();
        for (a, b) in plain.inv_freq().iter().zip(one.inv_freq()) {
            assert!(((a - b) / a).abs() < 1e-6, "{a} {b}");
        }
        assert_eq!(plain.inv_freq()[0], one.inv_freq()[0]);
        // factor 40: the highest frequencies untouched, the lowest divided by 40, the ramp
        // between monotone
        let y = yarn(40.0);
        let t = RopeTable::with_scaling(1e4, 64, Some(&y)).unwrap();
        let (p, f) = (plain.inv_freq().to_vec(), t.inv_freq().to_vec());
        assert_eq!(f[0], p[0]);
        assert_eq!(f[31], 1.0f32 / (40.0f32 * (1.0 / p[31])));
        for i in 0..32 {
            assert!(f[i] <= p[i] && f[i] >= p[i] / 40.5, "{i}");
        }
        // no mscale keys: cos and sin scale by 0.1 ln(40) + 1
        assert_eq!(y.attention_factor(), 0.1 * ln_f64(40.0) + 1.0);
        let mut t = t;
        t.ensure(1).unwrap();
        let (c, s) = t.row(0);
        assert_eq!(c[0], y.attention_factor() as f32);
        assert_eq!(s[0], 0.0);
        // equal mscale and mscale_all_dim cancel; attention_factor as written wins
        let y = Yarn {
            mscale: Some(0.707),
            mscale_all_dim: Some(0.707),
            ..yarn(40.0)
        };
        assert_eq!(y.attention_factor(), 1.0);
        let y = Yarn {
            attention_factor: Some(0.5),
            ..y
        };
        assert_eq!(y.attention_factor(), 0.5);
        // truncate false keeps a fractional ramp: a different table
        let y = Yarn {
            truncate: false,
            ..yarn(40.0)
        };
        let u = RopeTable::with_scaling(1e4, 64, Some(&y)).unwrap();
        assert_ne!(u.inv_freq(), &f[..]);
    }
}
