//! Deterministic elementary functions: the contract's `exp`, `silu`, `sigmoid`, `rsqrt` in f32
//! (docs/EXACTNESS.md section 5), and the f64 `ln`, `exp`, `pow`, `sin`, `cos` that build the
//! RoPE tables.
//!
//! Every function here is a fixed sequence of IEEE-754 operations (`+ - * /`, `sqrt`, `mul_add`),
//! so it returns the same bits on every processor and every backend. It must never call the
//! platform's libm (`f32::exp`, `f64::sin`, `powf`, ...): those differ between platforms and
//! versions. A GPU kernel reproduces these functions by performing the same operations.
//!
//! The f64 routines follow fdlibm's algorithms and coefficients (Sun Microsystems, freely
//! redistributable), ported operation by operation; they are accurate to about 1 ulp, which is
//! far below the f32 rounding the RoPE tables apply to them.

// fdlibm's constants are written with the 20 digits it prints them with; each rounds to the f64
// whose bit pattern fdlibm documents (noted beside the ln 2 parts).
#![allow(clippy::excessive_precision)]

/// `exp(x)` in f32, exactly as the contract's section 5 spells it.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x >= 89.0 {
        return f32::INFINITY;
    }
    if x <= -104.0 {
        return 0.0;
    }
    let log2e = f32::from_bits(0x3FB8_AA3B);
    let round_magic = f32::from_bits(0x4B40_0000); // 1.5 * 2^23
    let t = x * log2e;
    let n = (t + round_magic) - round_magic;
    let r = n.mul_add(-f32::from_bits(0x3F31_8000), x);
    let r = n.mul_add(f32::from_bits(0x395E_8083), r);
    let mut p = f32::from_bits(0x3950_6967);
    p = p.mul_add(r, f32::from_bits(0x3AB7_43CE));
    p = p.mul_add(r, f32::from_bits(0x3C08_8908));
    p = p.mul_add(r, f32::from_bits(0x3D2A_A9C1));
    p = p.mul_add(r, f32::from_bits(0x3E2A_AAAA));
    p = p.mul_add(r, f32::from_bits(0x3F00_0000));
    let y = p.mul_add(r * r, r) + 1.0;
    // n is an integer in [-150, 128] here (|x| bounds above), so the conversion is exact.
    let n = n as i32;
    let n1 = n.div_euclid(2);
    let n2 = n - n1;
    // Both halves lie in [-75, 64]: 2^n1 and 2^n2 are normal f32 and `y * 2^n1` is exact, so the
    // only rounding is the second product (which may be subnormal or overflow, as it should).
    (y * pow2_f32(n1)) * pow2_f32(n2)
}

/// 2^n as an f32 for a normal exponent (-126 <= n <= 127).
#[inline(always)]
fn pow2_f32(n: i32) -> f32 {
    debug_assert!((-126..=127).contains(&n));
    f32::from_bits(((n + 127) as u32) << 23)
}

/// `silu(g) = g / (1 + exp(-g))`.
#[inline(always)]
pub fn silu(g: f32) -> f32 {
    g / (1.0 + exp(-g))
}

/// `sigmoid(z) = 1 / (1 + exp(-z))`.
#[inline(always)]
pub fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + exp(-z))
}

/// `softplus(x) = ln(1 + exp(x))` as torch's `F.softplus` defines it (beta 1, threshold 20:
/// `x` itself above 20), for the gated DeltaNet's decay (docs/EXACTNESS.md, "Gated DeltaNet").
/// `e = exp(x)` in f32; then in f64, where `1 + e` is exact for `e >= 2^-20` (e has 24
/// significant bits) and [`ln_f64`] is within an ulp, and below that the series
/// `e - e * e / 2` (the next term is `2^-40` of the result, below the f32 rounding); the result
/// rounded once to f32. A fixed sequence of IEEE operations, like every function here.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x.is_nan() || x > 20.0 {
        return x;
    }
    let e = exp(x) as f64;
    let tiny = f64::from_bits(0x3EB0_0000_0000_0000); // 2^-20
    let r = if e < tiny {
        e - e * e * 0.5
    } else {
        ln_f64(1.0 + e)
    };
    r as f32
}

/// `rsqrt(v) = 1 / sqrt(v)`, both correctly rounded (never a hardware reciprocal estimate).
#[inline(always)]
pub fn rsqrt(v: f32) -> f32 {
    1.0 / v.sqrt()
}

// ---------------------------------------------------------------------------------------------
// f64 routines for the RoPE tables.

const LN2_HI: f64 = 6.931_471_803_691_238_164_90e-01; // 0x3FE62E42_FEE00000
const LN2_LO: f64 = 1.908_214_929_270_587_700_02e-10; // 0x3DEA39EF_35793C76

/// 2^k as an f64 for a normal exponent.
fn pow2_f64(k: i64) -> f64 {
    debug_assert!((-1022..=1023).contains(&k));
    f64::from_bits(((k + 1023) as u64) << 52)
}

/// Natural logarithm for finite `x > 0` (fdlibm `__ieee754_log`). Returns NaN for `x <= 0` or
/// non-finite `x`: callers (the RoPE table) validate their inputs first.
pub fn ln_f64(x: f64) -> f64 {
    const TWO54: f64 = 1.801_439_850_948_198_4e16;
    const LG1: f64 = 6.666_666_666_666_735_130e-01;
    const LG2: f64 = 3.999_999_999_940_941_908e-01;
    const LG3: f64 = 2.857_142_874_366_239_149e-01;
    const LG4: f64 = 2.222_219_843_214_978_396e-01;
    const LG5: f64 = 1.818_357_216_161_805_012e-01;
    const LG6: f64 = 1.531_383_769_920_937_332e-01;
    const LG7: f64 = 1.479_819_860_511_658_591e-01;

    if x.is_nan() || x <= 0.0 || x.is_infinite() {
        return f64::NAN;
    }
    let mut x = x;
    let mut k: i32 = 0;
    if x < f64::MIN_POSITIVE {
        // subnormal: scale into the normal range first
        k -= 54;
        x *= TWO54;
    }
    let bits = x.to_bits();
    let mut hx = (bits >> 32) as i32;
    let lx = bits as u32;
    k += (hx >> 20) - 1023;
    hx &= 0x000f_ffff;
    let i = (hx + 0x95f64) & 0x10_0000;
    // normalise x or x/2 into [sqrt(2)/2, sqrt(2))
    let hi = (hx | (i ^ 0x3ff0_0000)) as u32;
    x = f64::from_bits(((hi as u64) << 32) | lx as u64);
    k += i >> 20;
    let f = x - 1.0;
    let dk = k as f64;
    if (0x000f_ffff & (2 + hx)) < 3 {
        // |f| < 2^-20
        if f == 0.0 {
            return if k == 0 {
                0.0
            } else {
                dk * LN2_HI + dk * LN2_LO
            };
        }
        let r = f * f * (0.5 - 0.333_333_333_333_333_33 * f);
        return if k == 0 {
            f - r
        } else {
            dk * LN2_HI - ((r - dk * LN2_LO) - f)
        };
    }
    let s = f / (2.0 + f);
    let z = s * s;
    let mut i = hx - 0x6147a;
    let w = z * z;
    let j = 0x6b851 - hx;
    let t1 = w * (LG2 + w * (LG4 + w * LG6));
    let t2 = z * (LG1 + w * (LG3 + w * (LG5 + w * LG7)));
    i |= j;
    let r = t2 + t1;
    if i > 0 {
        let hfsq = 0.5 * f * f;
        if k == 0 {
            f - (hfsq - s * (hfsq + r))
        } else {
            dk * LN2_HI - ((hfsq - (s * (hfsq + r) + dk * LN2_LO)) - f)
        }
    } else if k == 0 {
        f - s * (f - r)
    } else {
        dk * LN2_HI - ((s * (f - r) - dk * LN2_LO) - f)
    }
}

/// `e^x` for `|x| <= 700` (fdlibm `__ieee754_exp`); NaN outside that domain, which the RoPE
/// table never reaches (its exponents are `e * ln(base)` with `0 <= e < 1`).
pub fn exp_f64(x: f64) -> f64 {
    const INV_LN2: f64 = std::f64::consts::LOG2_E; // 0x3FF71547_652B82FE, as fdlibm's invln2
    const P1: f64 = 1.666_666_666_666_660_190_37e-01;
    const P2: f64 = -2.777_777_777_701_559_338_42e-03;
    const P3: f64 = 6.613_756_321_437_934_361_17e-05;
    const P4: f64 = -1.653_390_220_546_525_153_90e-06;
    const P5: f64 = 4.138_136_797_057_238_460_39e-08;
    const ROUND_MAGIC: f64 = 6_755_399_441_055_744.0; // 1.5 * 2^52

    if x.is_nan() || x.abs() > 700.0 {
        return f64::NAN;
    }
    // x = k ln2 + r with |r| <= ln2/2; k*LN2_HI is exact (LN2_HI has 32 significant bits)
    let k = (x * INV_LN2 + ROUND_MAGIC) - ROUND_MAGIC;
    let hi = x - k * LN2_HI;
    let lo = k * LN2_LO;
    let r = hi - lo;
    let t = r * r;
    let c = r - t * (P1 + t * (P2 + t * (P3 + t * (P4 + t * P5))));
    let y = 1.0 - ((lo - (r * c) / (2.0 - c)) - hi);
    // |k| <= 1010: split the scaling so that each factor is a normal power of two
    let k = k as i64;
    let k1 = k / 2;
    (y * pow2_f64(k1)) * pow2_f64(k - k1)
}

/// `base^e` for `base > 0` and moderate `e * ln(base)`, as `exp(e * ln(base))`.
pub fn pow_f64(base: f64, e: f64) -> f64 {
    exp_f64(e * ln_f64(base))
}

/// Splits `x` into `k*pi/2 + (y0 + y1)` with `|y0 + y1| <= ~pi/4`, for `0 <= |x| < 2^40`;
/// returns `(k mod 4, y0, y1)`.
///
/// Three-part pi/2 (each part the f64 rounding of what the previous parts leave): `x - k*P1` is
/// exact in one fma (both are multiples of ulp(P1)'s grid and the difference is below 1), the
/// second part is subtracted with its error tracked exactly (two-sum, fma product error), and the
/// third, ~1e-33, only adjusts the tail.
fn reduce_pio2(x: f64) -> (u32, f64, f64) {
    const FRAC_2_PI: f64 = std::f64::consts::FRAC_2_PI; // 0x3FE45F306DC9C883
    const PIO2_1: f64 = f64::from_bits(0x3FF9_21FB_5444_2D18);
    const PIO2_2: f64 = f64::from_bits(0x3C91_A626_3314_5C07);
    const PIO2_3: f64 = f64::from_bits(0xB91F_1976_B7ED_8FBC);
    const ROUND_MAGIC: f64 = 6_755_399_441_055_744.0;

    let k = (x * FRAC_2_PI + ROUND_MAGIC) - ROUND_MAGIC;
    let r1 = (-k).mul_add(PIO2_1, x);
    let t = k * PIO2_2;
    let t_err = k.mul_add(PIO2_2, -t); // k*PIO2_2 = t + t_err exactly
    let (y0, e) = two_sum(r1, -t);
    let y1 = (e - t_err) - k * PIO2_3;
    let (y0, y1) = fast_two_sum(y0, y1);
    let quadrant = (k as i64).rem_euclid(4) as u32;
    (quadrant, y0, y1)
}

/// `s + err = a + b` exactly (Knuth's two-sum).
fn two_sum(a: f64, b: f64) -> (f64, f64) {
    let s = a + b;
    let bb = s - a;
    let err = (a - (s - bb)) + (b - bb);
    (s, err)
}

/// `s + err = a + b` exactly when `|a| >= |b|` or a is zero (Dekker).
fn fast_two_sum(a: f64, b: f64) -> (f64, f64) {
    let s = a + b;
    (s, b - (s - a))
}

/// sin of the reduced argument `x + y` (`|x| <= pi/4`, `|y| < ulp(x)`): fdlibm `__kernel_sin`.
fn kernel_sin(x: f64, y: f64) -> f64 {
    const S1: f64 = -1.666_666_666_666_663_243_48e-01;
    const S2: f64 = 8.333_333_333_322_489_461_24e-03;
    const S3: f64 = -1.984_126_982_985_794_931_34e-04;
    const S4: f64 = 2.755_731_370_707_006_767_89e-06;
    const S5: f64 = -2.505_076_025_340_686_341_95e-08;
    const S6: f64 = 1.589_690_995_211_550_102_21e-10;
    let z = x * x;
    let w = z * z;
    let r = S2 + z * (S3 + z * S4) + z * w * (S5 + z * S6);
    let v = z * x;
    x - ((z * (0.5 * y - v * r) - y) - v * S1)
}

/// cos of the reduced argument `x + y`: fdlibm `__kernel_cos` (musl's form).
fn kernel_cos(x: f64, y: f64) -> f64 {
    const C1: f64 = 4.166_666_666_666_660_190_37e-02;
    const C2: f64 = -1.388_888_888_887_410_957_49e-03;
    const C3: f64 = 2.480_158_728_947_672_941_78e-05;
    const C4: f64 = -2.755_731_435_139_066_330_35e-07;
    const C5: f64 = 2.087_572_321_298_174_827_90e-09;
    const C6: f64 = -1.135_964_755_778_819_482_65e-11;
    let z = x * x;
    let w = z * z;
    let r = z * (C1 + z * (C2 + z * C3)) + w * w * (C4 + z * (C5 + z * C6));
    let hz = 0.5 * z;
    let w = 1.0 - hz;
    w + (((1.0 - w) - hz) + (z * r - x * y))
}

/// `(sin x, cos x)` for finite `|x| < 2^40` (NaN outside: the RoPE table validates its range).
pub fn sin_cos_f64(x: f64) -> (f64, f64) {
    if x.is_nan() || x.abs() >= 1_099_511_627_776.0 {
        return (f64::NAN, f64::NAN);
    }
    let (q, y0, y1) = reduce_pio2(x);
    let s = kernel_sin(y0, y1);
    let c = kernel_cos(y0, y1);
    match q {
        0 => (s, c),
        1 => (c, -s),
        2 => (-s, -c),
        _ => (-c, s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in f32 representable steps between `got` and the f32 rounding of `want`.
    fn ulp_dist_f32(got: f32, want: f64) -> u64 {
        let w = want as f32;
        let key = |v: f32| -> i64 {
            let b = v.to_bits() as i32 as i64;
            if b < 0 {
                i32::MIN as i64 - b
            } else {
                b
            }
        };
        (key(got) - key(w)).unsigned_abs()
    }

    #[test]
    fn exp_within_two_ulp_on_a_dense_sweep() {
        // every 97th f32 between -110 and 90: normal, subnormal and clamped results
        let mut worst = 0;
        let mut checked = 0u64;
        let mut bits_pos = 0u32; // positive half
        while bits_pos < 0x42B4_0000 {
            for x in [f32::from_bits(bits_pos), -f32::from_bits(bits_pos)] {
                if !(-110.0..=90.0).contains(&x) {
                    continue;
                }
                let got = exp(x);
                let want = (x as f64).exp();
                let d = ulp_dist_f32(got, want);
                assert!(d <= 2, "exp({x:e}) = {got:e}, want {want:e} ({d} ulp)");
                worst = worst.max(d);
                checked += 1;
            }
            bits_pos += 97;
        }
        assert!(checked > 10_000_000);
        assert!(worst <= 2);
    }

    #[test]
    fn exp_clamps_and_special_values() {
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(1000.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(-104.0).to_bits(), 0);
        assert_eq!(exp(f32::NEG_INFINITY).to_bits(), 0);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        // just below the upper clamp the result is finite and right
        let x = f32::from_bits(89.0f32.to_bits() - 1);
        assert!(ulp_dist_f32(exp(x), (x as f64).exp()) <= 2);
        // the smallest subnormal region
        let x = -103.5f32;
        assert!(exp(x) > 0.0 && exp(x) < f32::MIN_POSITIVE);
        assert!(ulp_dist_f32(exp(x), (x as f64).exp()) <= 2);
    }

    #[test]
    fn silu_sigmoid_rsqrt_basics() {
        assert_eq!(sigmoid(0.0), 0.5);
        assert_eq!(silu(0.0), 0.0);
        assert_eq!(silu(-200.0), -0.0);
        assert_eq!(silu(200.0), 200.0);
        assert_eq!(rsqrt(4.0), 0.5);
        for i in 0..1000 {
            let g = (i as f32 - 500.0) * 0.037;
            let want = g as f64 / (1.0 + (-(g as f64)).exp());
            assert!(((silu(g) as f64) - want).abs() <= 4.0 * f32::EPSILON as f64 * want.abs());
        }
    }

    #[test]
    fn f64_ln_exp_pow_match_libm_closely() {
        let mut x = 1e-300f64;
        while x < 1e300 {
            let (a, b) = (ln_f64(x), x.ln());
            assert!(
                (a - b).abs() <= 2.0 * f64::EPSILON * b.abs().max(1e-300),
                "ln {x}"
            );
            x *= 1.37;
        }
        let mut x = -700.0f64;
        while x < 700.0 {
            let (a, b) = (exp_f64(x), x.exp());
            assert!((a - b).abs() <= 2.0 * f64::EPSILON * b, "exp {x}");
            x += 0.0137;
        }
        for base in [10_000.0f64, 500_000.0, 1_000_000.0, 10_000_000.0] {
            for i in 0..128 {
                let e = (2 * i) as f32 / 256.0;
                let a = pow_f64(base, e as f64);
                let b = base.powf(e as f64);
                assert!((a - b).abs() <= 8.0 * f64::EPSILON * b, "pow {base} {e}");
            }
        }
    }

    #[test]
    fn f64_sin_cos_match_libm_closely() {
        let mut x = 0.0f64;
        while x < 3.0e6 {
            let (s, c) = sin_cos_f64(x);
            let (s2, c2) = (x.sin(), x.cos());
            // absolute accuracy near 1 ulp of 1; relative where the value is tiny
            assert!(
                (s - s2).abs() <= 2.0 * f64::EPSILON * s2.abs().max(0.5),
                "sin {x}"
            );
            assert!(
                (c - c2).abs() <= 2.0 * f64::EPSILON * c2.abs().max(0.5),
                "cos {x}"
            );
            x = x * 1.001 + 0.0137;
        }
    }

    #[test]
    fn softplus_is_torchs_within_an_ulp_on_both_sides_of_its_branches() {
        // torch: x above the threshold 20 is returned as is
        assert_eq!(softplus(20.5).to_bits(), 20.5f32.to_bits());
        assert_eq!(softplus(1e30).to_bits(), 1e30f32.to_bits());
        assert!(softplus(f32::NAN).is_nan());
        assert_eq!(softplus(-200.0), 0.0);
        let mut worst = 0;
        // across ln(2^-20) ~ -13.86, where the series takes over, and up to the threshold
        let mut x = -40.0f32;
        while x <= 20.0 {
            let want = (x as f64).exp().ln_1p();
            worst = worst.max(ulp_dist_f32(softplus(x), want));
            x += 0.0137;
        }
        assert!(worst <= 2, "softplus is {worst} ulps from ln(1 + e^x)");
        // the branch point itself: exp(x) just below and above 2^-20 agree in their ulps
        for x in [-13.8629f32, -13.8630, -13.8628] {
            assert!(ulp_dist_f32(softplus(x), (x as f64).exp().ln_1p()) <= 2);
        }
    }
}
