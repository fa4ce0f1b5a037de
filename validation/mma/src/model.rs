//! The integer model of one output element of a tensor-core MMA with BF16 inputs and f32
//! accumulation: `d = fused(a[0..k] * b[0..k] + c)`.
//!
//! The Hopper hypothesis (MMA-Sim, arXiv 2511.10909, its `nv_fused_dot_add` for
//! `mma.m16n8k16.f32.bf16.bf16.f32` on Hopper, one group of 16, 25 fractional bits), written
//! out as integer arithmetic:
//!
//! 1. Specials first: a NaN input, `inf * 0`, or infinities of both signs (among the products
//!    and `c`) give NaN, returned as `0x7FFF_FFFF`; otherwise an infinite input gives that
//!    infinity.
//! 2. Every product `a*b` is taken as significand `ma*mb` (the BF16 significands, hidden bit
//!    included, 1 <= s < 4) with the *nominal* exponent `ea + eb`; `c` as its f32 significand
//!    and exponent. Subnormals and zeros have exponent -126 (no flush). A zero product still
//!    has its nominal exponent, and it takes part in the maximum (MMA-Sim's code does so).
//! 3. `E = max` of all those exponents. Each term is aligned to `E`, truncated toward zero to
//!    `frac_bits` fractional bits (sign-magnitude), and the terms are summed exactly.
//! 4. The sum is normalised to f32 rounding toward zero (subnormal results truncated to a
//!    multiple of 2^-149); an exact zero, or a result that truncates to zero, is `+0.0`; a
//!    magnitude of 2^128 or more is an infinity.
//!
//! The H200 corrects the hypothesis in two places ([`Params::HOPPER_MEASURED`], PHASE_LOG T1).
//!
//! [`Params`] holds the knobs the hardware harness tests alternatives of (so that a
//! counterexample can name the corrected model): the fractional bits, the group size (Ampere
//! splits k16 into two fused groups of 8, the second taking the first's f32 result as `c`),
//! whether zero products count in the maximum, the final rounding and overflow.

/// How the exact sum is rounded to f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Round {
    /// Toward zero (the hypothesis).
    Rz,
    /// To nearest, ties to even.
    Rne,
}

/// One variant of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Fractional bits kept after alignment to the largest exponent (Hopper 25, Ampere 24).
    pub frac_bits: u32,
    /// Products fused in one step (16 on Hopper for k16; 8 on Ampere/Ada).
    pub group: usize,
    /// Whether a zero product's nominal exponent takes part in the maximum.
    pub zeros_in_max: bool,
    /// Whether a zero accumulator `c` (exponent -126 as a subnormal) takes part in the maximum.
    /// MMA-Sim's model and the hypothesis: yes. The first hardware counterexample (PHASE_LOG
    /// T1: `c = 0`, every product below 2^-126, the hardware's result truncated at 25 bits
    /// below the largest *product*) says no.
    pub zero_c_in_max: bool,
    /// Rounding of the final normalisation.
    pub round: Round,
    /// Overflow gives infinity (true) or the largest finite value (false).
    pub overflow_inf: bool,
    /// The exponent of the finest bit any aligned term keeps, whatever the maximum: terms are
    /// truncated at `max(E - frac_bits, min_lsb)`. `i32::MIN`: no floor (the hypothesis). The
    /// second hardware counterexample (PHASE_LOG T1: `c = 0`, every product below 2^-126) asks
    /// whether the datapath has a fixed finest bit for tiny sums.
    pub min_lsb: i32,
}

impl Params {
    /// The hypothesis for Hopper (sm_90) `mma.sync.m16n8k16.f32.bf16.bf16.f32`.
    pub const HOPPER: Params = Params {
        frac_bits: 25,
        group: 16,
        zeros_in_max: true,
        zero_c_in_max: true,
        round: Round::Rz,
        overflow_inf: true,
        min_lsb: i32::MIN,
    };
    /// The model the H200 measured (PHASE_LOG T1): the hypothesis with two corrections, each
    /// found by a hardware counterexample: (1) zero products and a zero `c` take no part in the
    /// maximum; (2) the finest bit kept is never below 2^-158 (equivalently: the alignment
    /// exponent never falls below -133, BF16's smallest subnormal; it binds only when `c` is zero
    /// and every product is below 2^-133).
    pub const HOPPER_MEASURED: Params = Params {
        frac_bits: 25,
        group: 16,
        zeros_in_max: false,
        zero_c_in_max: false,
        round: Round::Rz,
        overflow_inf: true,
        min_lsb: -158,
    };
    /// MMA-Sim's Ampere / Ada model of the same instruction: two fused groups of 8, 24 bits.
    pub const AMPERE: Params = Params {
        frac_bits: 24,
        group: 8,
        zeros_in_max: true,
        zero_c_in_max: true,
        round: Round::Rz,
        overflow_inf: true,
        min_lsb: i32::MIN,
    };
}

/// The NaN every NaN result is (MMA-Sim: the canonical `0x7FFF_FFFF`).
pub const NAN_BITS: u32 = 0x7FFF_FFFF;

/// A BF16 value decoded: sign, significand (hidden bit included, value `m * 2^(e-7)`), exponent.
#[inline(always)]
fn dec_bf16(b: u16) -> (bool, u32, i32) {
    let e = ((b >> 7) & 0xFF) as i32;
    let m = (b & 0x7F) as u32;
    if e == 0 {
        (b & 0x8000 != 0, m, -126)
    } else {
        (b & 0x8000 != 0, m | 0x80, e - 127)
    }
}

/// An f32 decoded: sign, significand (value `m * 2^(e-23)`), exponent.
#[inline(always)]
fn dec_f32(x: u32) -> (bool, u32, i32) {
    let e = ((x >> 23) & 0xFF) as i32;
    let m = x & 0x7F_FFFF;
    if e == 0 {
        (x >> 31 != 0, m, -126)
    } else {
        (x >> 31 != 0, m | 0x80_0000, e - 127)
    }
}

#[inline(always)]
fn bf16_is_nan(b: u16) -> bool {
    b & 0x7FFF > 0x7F80
}
#[inline(always)]
fn bf16_is_inf(b: u16) -> bool {
    b & 0x7FFF == 0x7F80
}
#[inline(always)]
fn bf16_is_zero(b: u16) -> bool {
    b & 0x7FFF == 0
}

/// The special-value outcome of one fused group, if any: `Some(bits)` for NaN or an infinity.
#[inline]
fn specials(a: &[u16], b: &[u16], c: u32) -> Option<u32> {
    let ce = (c >> 23) & 0xFF;
    let mut nan = ce == 0xFF && c & 0x7F_FFFF != 0;
    let (mut pinf, mut ninf) = (c == 0x7F80_0000, c == 0xFF80_0000);
    for (&x, &y) in a.iter().zip(b) {
        if x & 0x7F80 != 0x7F80 && y & 0x7F80 != 0x7F80 {
            continue; // both finite: the common case
        }
        if bf16_is_nan(x)
            || bf16_is_nan(y)
            || (bf16_is_inf(x) && bf16_is_zero(y))
            || (bf16_is_inf(y) && bf16_is_zero(x))
        {
            nan = true;
        } else if bf16_is_inf(x) || bf16_is_inf(y) {
            if (x ^ y) & 0x8000 != 0 {
                ninf = true;
            } else {
                pinf = true;
            }
        }
    }
    if nan || (pinf && ninf) {
        Some(NAN_BITS)
    } else if pinf {
        Some(0x7F80_0000)
    } else if ninf {
        Some(0xFF80_0000)
    } else {
        None
    }
}

/// `|x| >> s` for any `s >= 0` (0 once every bit is shifted out).
#[inline(always)]
fn shr(x: u64, s: u32) -> u64 {
    if s >= 64 {
        0
    } else {
        x >> s
    }
}

/// The exact value `sum * 2^scale` rounded to f32 bits by `p`.
pub fn to_f32(sum: i64, scale: i32, p: &Params) -> u32 {
    if sum == 0 {
        return 0;
    }
    let sign = if sum < 0 { 0x8000_0000u32 } else { 0 };
    let mag = sum.unsigned_abs();
    let msb = 63 - mag.leading_zeros() as i32;
    let e = msb + scale; // value in [2^e, 2^(e+1))
                         // The position of the result's last kept bit, as a power of two.
    let ulp = if e >= -126 { e - 23 } else { -149 };
    let shift = ulp - scale; // bits of `mag` below the kept ones
    let (mut q, tie, above) = if shift <= 0 {
        (mag << (-shift) as u32, false, false)
    } else if shift >= 64 {
        (0, false, false) // mag < 2^63 <= half an ulp
    } else {
        let s = shift as u32;
        let rem = mag & ((1u64 << s) - 1);
        let half = 1u64 << (s - 1);
        (mag >> s, rem == half, rem > half)
    };
    if p.round == Round::Rne && (above || (tie && q & 1 == 1)) {
        q += 1;
    }
    // q holds the significand (with hidden bit for normals) in units of 2^ulp.
    let bits: u64 = if ulp == -149 {
        // subnormal (or rounded up to the smallest normal: the encoding carries over).
        q
    } else {
        // normal: q in [2^23, 2^24], maybe 2^24 after rounding up.
        let (q, ulp) = if q >= 1 << 24 {
            (q >> 1, ulp + 1)
        } else {
            (q, ulp)
        };
        let be = ulp + 23 + 127;
        if be >= 255 {
            return sign
                | if p.overflow_inf {
                    0x7F80_0000
                } else {
                    0x7F7F_FFFF
                };
        }
        ((be as u64) << 23) | (q & 0x7F_FFFF)
    };
    if bits == 0 {
        return 0; // truncated to zero: +0.0 (MMA-Sim's int trunc loses the sign)
    }
    sign | bits as u32
}

/// One fused group: `a[i] * b[i]` for all `i`, plus `c`, as f32 bits.
pub fn fused_group(a: &[u16], b: &[u16], c: u32, p: &Params) -> u32 {
    debug_assert_eq!(a.len(), b.len());
    if let Some(s) = specials(a, b, c) {
        return s;
    }
    let (cs, cm, ce) = dec_f32(c);
    let mut terms = [(false, 0u32, 0i32); 32];
    let n = a.len();
    // a zero c left out of the maximum: the smallest exponent any term can have
    let mut emax = if cm != 0 || p.zero_c_in_max { ce } else { -300 };
    for i in 0..n {
        let (sa, ma, ea) = dec_bf16(a[i]);
        let (sb, mb, eb) = dec_bf16(b[i]);
        let m = ma * mb;
        let e = ea + eb;
        terms[i] = (sa ^ sb, m, e);
        if m != 0 || p.zeros_in_max {
            emax = emax.max(e);
        }
    }
    let f = p.frac_bits;
    // The finest bit kept: 2^lsb; `d` more bits dropped than 25 below the maximum.
    let lsb = (emax - f as i32).max(p.min_lsb);
    let d = (lsb - (emax - f as i32)) as u32;
    // Products are m * 2^(e-14), c is cm * 2^(ce-23); aligned: value * 2^(-lsb), truncated.
    let mut sum: i64 = 0;
    // (A term above the maximum is a zero left out of it: its shift is irrelevant, clamp it.)
    let shift = |e: i32| ((emax - e).max(0) as u32).saturating_add(d);
    for &(s, m, e) in &terms[..n] {
        let v = shr((m as u64) << (f - 14), shift(e)) as i64;
        sum += if s { -v } else { v };
    }
    let v = shr((cm as u64) << (f - 23), shift(ce)) as i64;
    sum += if cs { -v } else { v };
    to_f32(sum, lsb, p)
}

/// One output element of an `m16n8k16` MMA: `a` is the row of A, `b` the column of B (16 each),
/// `c` the accumulator's bits; the groups of `p.group` are fused in increasing k.
pub fn mma_elem(a: &[u16; 16], b: &[u16; 16], c: u32, p: &Params) -> u32 {
    let mut acc = c;
    for g in (0..16).step_by(p.group) {
        acc = fused_group(&a[g..g + p.group], &b[g..g + p.group], acc, p);
    }
    acc
}

/// The exact 3-way BF16 split of an f32: `x = x1 + x2 + x3` with each part a BF16 truncation
/// of what is left, exact whenever `|x| >= 2^-110` or `x == 0` (the last part then has at most 8
/// significant bits above 2^-133). A NaN or infinity is `(x as BF16, 0, 0)`.
#[inline]
pub fn split3(x: f32) -> [u16; 3] {
    if !x.is_finite() {
        let hi = (x.to_bits() >> 16) as u16;
        let hi = if x.is_nan() { hi | 0x0040 } else { hi };
        return [hi, 0, 0];
    }
    let h = x.to_bits() & 0xFFFF_0000;
    let r1 = x - f32::from_bits(h);
    let m = r1.to_bits() & 0xFFFF_0000;
    let r2 = r1 - f32::from_bits(m);
    [
        (h >> 16) as u16,
        (m >> 16) as u16,
        (r2.to_bits() >> 16) as u16,
    ]
}

/// The candidate contract-v2 dot product of a BF16 row `w` and an f32 activation `x`: the
/// accumulator starts at +0.0 and, for each chunk of 16 in increasing k (the last zero-padded),
/// takes three MMAs in the order x1, x2, x3 of [`split3`].
pub fn dot_v2(w: &[u16], x: &[f32], p: &Params) -> f32 {
    assert_eq!(w.len(), x.len());
    let mut acc = 0u32;
    for (wc, xc) in w.chunks(16).zip(x.chunks(16)) {
        let mut a = [0u16; 16];
        a[..wc.len()].copy_from_slice(wc);
        let mut parts = [[0u16; 16]; 3];
        for (i, &v) in xc.iter().enumerate() {
            let s = split3(v);
            for j in 0..3 {
                parts[j][i] = s[j];
            }
        }
        for part in &parts {
            acc = mma_elem(&a, part, acc, p);
        }
    }
    f32::from_bits(acc)
}

/// The CPU model of the prototype GEMM: `out[n * m + r] = dot_v2(w row r, x row n)` for
/// `w: m x k` BF16 (row-major) and `x: n x k` f32 (token-major).
pub fn gemm_v2(w: &[u16], x: &[f32], m: usize, n: usize, k: usize, p: &Params) -> Vec<f32> {
    use rayon::prelude::*;
    assert_eq!(w.len(), m * k);
    assert_eq!(x.len(), n * k);
    let mut out = vec![0.0f32; m * n];
    out.par_chunks_mut(m).enumerate().for_each(|(t, row)| {
        let xt = &x[t * k..(t + 1) * k];
        for (r, o) in row.iter_mut().enumerate() {
            *o = dot_v2(&w[r * k..(r + 1) * k], xt, p);
        }
    });
    out
}
