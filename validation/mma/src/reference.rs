//! An independent, slow transcription of the same definition in f64 arithmetic, written the
//! way MMA-Sim's Python states it (frexp-style significands, `trunc` of scaled values, an f64
//! sum, `as f32` at the end), for the tests to compare the integer model against. Every f64
//! operation here is exact for BF16 inputs: products have 16 significant bits, the aligned terms
//! are multiples of 2^-frac_bits below 4, and 17 of them sum to under 2^7.

/// `(significand, exponent)` with `1 <= |s| < 2` for normals, subnormals at exponent `emin`.
fn sig_exp(x: f64, emin: i32) -> (f64, i32) {
    if x == 0.0 {
        return (0.0, emin);
    }
    let mut e = x.abs().log2().floor() as i32;
    // log2 may be off by one at powers of two: fix it exactly.
    while x.abs() >= 2f64.powi(e + 1) {
        e += 1;
    }
    while x.abs() < 2f64.powi(e) {
        e -= 1;
    }
    let e = e.max(emin);
    (x / 2f64.powi(e), e)
}

fn bf16(b: u16) -> f64 {
    f32::from_bits((b as u32) << 16) as f64
}

/// One fused group (Hopper hypothesis with `frac_bits` fractional bits, RZ, zeros in the max).
pub fn fused_group_f64(a: &[u16], b: &[u16], c: f32, frac_bits: i32) -> f32 {
    let mut total = c as f64;
    for (&x, &y) in a.iter().zip(b) {
        total += bf16(x) * bf16(y);
    }
    if total.is_nan() {
        return f32::from_bits(0x7FFF_FFFF);
    }
    if total.is_infinite() {
        return total as f32;
    }
    let mut sigs = vec![];
    let mut exps = vec![];
    let (sc, ec) = sig_exp(c as f64, -126);
    sigs.push(sc);
    exps.push(ec);
    for (&x, &y) in a.iter().zip(b) {
        let (sa, ea) = sig_exp(bf16(x), -126);
        let (sb, eb) = sig_exp(bf16(y), -126);
        sigs.push(sa * sb);
        exps.push(ea + eb);
    }
    let emax = *exps.iter().max().unwrap();
    let mut s = 0.0f64;
    for (&sg, &e) in sigs.iter().zip(&exps) {
        s += (sg * 2f64.powi(frac_bits + e - emax)).trunc() * 2f64.powi(-frac_bits);
    }
    let v = s * 2f64.powi(emax);
    let (s2, e2) = sig_exp(v, -126);
    let s2 = (s2 * 2f64.powi(23)).trunc() * 2f64.powi(-23);
    let r = (s2 * 2f64.powi(e2)) as f32;
    if r == 0.0 {
        0.0
    } else {
        r
    }
}

/// `m16n8k16` element: groups of `group` in increasing k.
pub fn mma_elem_f64(a: &[u16; 16], b: &[u16; 16], c: f32, frac_bits: i32, group: usize) -> f32 {
    let mut acc = c;
    for g in (0..16).step_by(group) {
        acc = fused_group_f64(&a[g..g + group], &b[g..g + group], acc, frac_bits);
    }
    acc
}
