//! The CPU model's tests: against the independent f64 transcription on random tiles of every
//! mode, and hand-built cases whose outcome is worked out in the comments.

use tarfa_mma::cases::{self, Mode, MODES};
use tarfa_mma::model::{self, mma_elem, split3, Params, Round, NAN_BITS};
use tarfa_mma::reference::mma_elem_f64;

fn bf(x: f32) -> u16 {
    let b = x.to_bits();
    assert_eq!(b & 0xFFFF, 0, "{x} is not a BF16");
    (b >> 16) as u16
}

/// One case: a[0..n], b[0..n] (rest zero, `a` zero there) and c, under Hopper.
fn one(a: &[f32], b: &[f32], c: f32) -> f32 {
    let mut x = [0u16; 16];
    let mut y = [0u16; 16];
    for i in 0..a.len() {
        x[i] = bf(a[i]);
        y[i] = bf(b[i]);
    }
    f32::from_bits(mma_elem(&x, &y, c.to_bits(), &Params::HOPPER))
}

#[test]
fn integer_model_equals_f64_transcription_on_every_mode() {
    let mut n = 0;
    for index in 0..(MODES.len() as u64 * 40) {
        let (mode, t) = cases::tile(0x25, index);
        for i in 0..16 {
            for j in 0..8 {
                for (p, frac, group) in [(Params::HOPPER, 25, 16), (Params::AMPERE, 24, 8)] {
                    let got = mma_elem(&t.a[i], &t.b[j], t.c[i][j], &p);
                    let want =
                        mma_elem_f64(&t.a[i], &t.b[j], f32::from_bits(t.c[i][j]), frac, group);
                    assert_eq!(
                        got,
                        want.to_bits(),
                        "{} tile {index} ({i},{j}) {p:?}: a {:04x?} b {:04x?} c {:08x}",
                        mode.name(),
                        t.a[i],
                        t.b[j],
                        t.c[i][j]
                    );
                    n += 1;
                }
            }
        }
    }
    assert!(n > 100_000);
}

#[test]
fn exact_sums_are_exact() {
    // integers: every term is kept whole; 16 * (3 * 5) + 7 = 247
    assert_eq!(one(&[3.0; 16], &[5.0; 16], 7.0), 247.0);
    // c alone, products zero
    assert_eq!(one(&[0.0], &[0.0], 1.5), 1.5);
}

#[test]
fn final_rounding_is_toward_zero() {
    // 1 + 3 * 2^-24 = 1 + 1.5 ulp(1): all three products have exponent -24 >= 0 - 25, so they
    // are kept whole; the exact sum rounds toward zero to 1 + 2^-23 (RNE would give 1 + 2^-22).
    let t = 2f32.powi(-24);
    assert_eq!(one(&[1.0; 3], &[t; 3], 1.0), 1.0 + 2f32.powi(-23));
    // negative: -(1 + 2^-23), toward zero
    assert_eq!(one(&[-1.0; 3], &[t; 3], -1.0), -(1.0 + 2f32.powi(-23)));
    // the same under the RNE variant
    let rne = Params {
        round: Round::Rne,
        ..Params::HOPPER
    };
    let x = [bf(1.0); 16];
    let mut y = [0u16; 16];
    y[..3].fill(bf(t));
    assert_eq!(
        f32::from_bits(mma_elem(&x, &y, 1f32.to_bits(), &rne)),
        1.0 + 2f32.powi(-22)
    );
}

#[test]
fn each_term_is_truncated_to_25_fractional_bits() {
    // c = 1 sets the maximum exponent 0; 16 products 1.5 * 2^-25 = 1.5 units of 2^-25 each,
    // truncated to 1 unit: 1 + 16 * 2^-25 = 1 + 2^-21 (exactly representable). Exact
    // arithmetic would give 1 + 24 * 2^-25 = 1 + 3 * 2^-22.
    let p = 1.5 * 2f32.powi(-25);
    assert_eq!(
        one(&[1.5; 16], &[2f32.powi(-25); 16], 1.0),
        1.0 + 2f32.powi(-21)
    );
    let _ = p;
    // negative terms truncate toward zero too: 1 - 16 * 2^-25 = 1 - 2^-21
    assert_eq!(
        one(&[-1.5; 16], &[2f32.powi(-25); 16], 1.0),
        1.0 - 2f32.powi(-21)
    );
    // a term 2^-26 below the maximum vanishes entirely: 1 + 16 * 2^-26 stays 1
    assert_eq!(one(&[1.0; 16], &[2f32.powi(-26); 16], 1.0), 1.0);
    // and under Ampere's 24 bits a 2^-25 term vanishes: first group of 8 -> 1, second -> 1
    let x = [bf(1.0); 16];
    let y = [bf(2f32.powi(-25)); 16];
    assert_eq!(
        f32::from_bits(mma_elem(&x, &y, 1f32.to_bits(), &Params::AMPERE)),
        1.0
    );
    assert_eq!(
        f32::from_bits(mma_elem(&x, &y, 1f32.to_bits(), &Params::HOPPER)),
        1.0 + 2f32.powi(-21)
    );
}

#[test]
fn the_largest_exponent_is_nominal_and_zeros_count() {
    // 1.5 * 1.5 = 2.25 has nominal exponent 0 (significand 2.25 in [1, 4)), so c = 2^-25 * 1.5
    // is aligned to 2^0 with 25 bits: 1.5 units -> 1 unit. Result 2.25 + 2^-25 -> RZ in f32
    // (ulp 2^-22 at 2.25) -> 2.25.
    assert_eq!(one(&[1.5], &[1.5], 1.5 * 2f32.powi(-25)), 2.25);
    // A zero product 0 * 2^127 has nominal exponent -126 + 127 = 1, above c's -2: c =
    // 0.25 * (1 + 2^-23) = (2^23 + 1) * 2^-25 is aligned to 2^1 with 25 bits, i.e. in units of
    // 2^-24: (2^23 + 1) / 2 -> 2^22 units = 0.25 exactly. The last bit of c is lost.
    let c = f32::from_bits(0.25f32.to_bits() + 1);
    assert_eq!(one(&[0.0], &[2f32.powi(127)], c), 0.25);
    // The variant that ignores zero products keeps c.
    let nz = Params {
        zeros_in_max: false,
        ..Params::HOPPER
    };
    let mut x = [0u16; 16];
    let mut y = [0u16; 16];
    x[0] = 0;
    y[0] = bf(2f32.powi(127));
    assert_eq!(mma_elem(&x, &y, c.to_bits(), &nz), c.to_bits());
}

#[test]
fn specials() {
    let inf = f32::INFINITY;
    let nan = |v: f32| v.to_bits() == NAN_BITS;
    assert!(nan(one(&[f32::NAN], &[1.0], 0.0)));
    assert!(nan(one(&[1.0], &[1.0], f32::NAN)));
    assert!(nan(one(&[inf], &[0.0], 1.0)), "inf * 0");
    assert!(
        nan(one(&[inf, inf], &[1.0, -1.0], 0.0)),
        "inf - inf among products"
    );
    assert!(nan(one(&[inf], &[1.0], -inf)), "inf - inf with c");
    assert_eq!(one(&[inf], &[-2.0], 5.0), -inf);
    assert_eq!(one(&[1.0], &[1.0], inf), inf);
    assert_eq!(one(&[inf, inf], &[1.0, 3.0], inf), inf);
    // overflow of a finite sum: 2^127 * 2^127 is far beyond f32; the model says infinity
    assert_eq!(one(&[2f32.powi(127)], &[2f32.powi(127)], 0.0), inf);
    assert_eq!(one(&[-2f32.powi(127)], &[2f32.powi(127)], 0.0), -inf);
    // f32::MAX + MAX overflows too; MAX - MAX is +0
    assert_eq!(one(&[2f32.powi(127)], &[2.0], f32::MAX), inf);
    assert_eq!(one(&[2f32.powi(127)], &[-1.0], 2f32.powi(127)).to_bits(), 0);
}

#[test]
fn zeros_are_positive() {
    // -0 + (-0 * 1) -> +0 (the exact sum 0 has no sign in the model)
    assert_eq!(one(&[-0.0], &[1.0], -0.0).to_bits(), 0);
    // exact cancellation -> +0
    assert_eq!(one(&[3.0], &[-1.0], 3.0).to_bits(), 0);
    // a negative result below half the smallest subnormal truncates to +0
    let r = one(&[-(2f32.powi(-75))], &[2f32.powi(-75)], 0.0);
    assert_eq!(r.to_bits(), 0);
}

#[test]
fn subnormal_inputs_and_outputs() {
    // the smallest BF16 subnormal 2^-133 (bits 0x0001) times 2^100 = 2^-33, exactly
    let mut x = [0u16; 16];
    let mut y = [0u16; 16];
    x[0] = 0x0001;
    y[0] = bf(2f32.powi(100));
    assert_eq!(
        f32::from_bits(mma_elem(&x, &y, 0, &Params::HOPPER)),
        2f32.powi(-33)
    );
    // 2^-70 * 2^-70 = 2^-140, an f32 subnormal (bits 1 << 9)
    assert_eq!(
        one(&[2f32.powi(-70)], &[2f32.powi(-70)], 0.0).to_bits(),
        1 << 9
    );
    // 1.5 * 2^-149 truncates to 2^-149 (bits 1); negative to -2^-149
    assert_eq!(
        one(&[1.5 * 2f32.powi(-75)], &[2f32.powi(-74)], 0.0).to_bits(),
        1
    );
    assert_eq!(
        one(&[-1.5 * 2f32.powi(-75)], &[2f32.powi(-74)], 0.0).to_bits(),
        0x8000_0001
    );
    // a subnormal accumulator passes through
    assert_eq!(one(&[0.0], &[0.0], f32::from_bits(1)).to_bits(), 1);
    // subnormal c plus a subnormal product, same exponent -126: exact
    assert_eq!(
        one(&[2f32.powi(-70)], &[2f32.powi(-70)], f32::from_bits(3)).to_bits(),
        (1 << 9) + 3
    );
}

#[test]
fn split3_is_exact() {
    let mut r = cases::Rng::new(7, 7);
    for _ in 0..100_000 {
        let be = r.range(18, 254) as u32;
        let x = f32::from_bits(((r.next() as u32) & 0x807F_FFFF) | (be << 23));
        let [a, b, c] = split3(x);
        let v = |h: u16| f32::from_bits((h as u32) << 16) as f64;
        assert_eq!(v(a) + v(b) + v(c), x as f64, "{x:e}");
    }
    assert_eq!(split3(1.0), [bf(1.0), 0, 0]);
    assert_eq!(split3(f32::INFINITY), [0x7F80, 0, 0]);
    assert!(
        split3(f32::from_bits(0x7F80_0001))[0] & 0x7F != 0,
        "NaN stays NaN"
    );
}

#[test]
fn dot_v2_and_gemm_v2_agree_and_are_close_to_f64() {
    let (m, n, k) = (8, 3, 200);
    let mut r = cases::Rng::new(1, 2);
    let w: Vec<u16> = (0..m * k)
        .map(|_| bf((r.range(-255, 255) as f32) / 256.0))
        .collect();
    let x: Vec<f32> = (0..n * k)
        .map(|_| (r.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
        .collect();
    let g = model::gemm_v2(&w, &x, m, n, k, &Params::HOPPER);
    for t in 0..n {
        for row in 0..m {
            let d = model::dot_v2(
                &w[row * k..(row + 1) * k],
                &x[t * k..(t + 1) * k],
                &Params::HOPPER,
            );
            assert_eq!(g[t * m + row].to_bits(), d.to_bits());
            let exact: f64 = (0..k)
                .map(|i| f32::from_bits((w[row * k + i] as u32) << 16) as f64 * x[t * k + i] as f64)
                .sum();
            let scale: f64 = (0..k)
                .map(|i| {
                    (f32::from_bits((w[row * k + i] as u32) << 16) as f64 * x[t * k + i] as f64)
                        .abs()
                })
                .sum();
            assert!(((d as f64) - exact).abs() <= scale * 1e-5, "{d} vs {exact}");
        }
    }
}

#[test]
fn smoke_tile_is_exact_integers() {
    let t = cases::smoke_tile();
    for i in 0..16 {
        for j in 0..8 {
            let exact: f64 = (0..16)
                .map(|k| {
                    f32::from_bits((t.a[i][k] as u32) << 16) as f64
                        * f32::from_bits((t.b[j][k] as u32) << 16) as f64
                })
                .sum::<f64>()
                + f32::from_bits(t.c[i][j]) as f64;
            for p in [Params::HOPPER, Params::AMPERE] {
                assert_eq!(
                    f32::from_bits(mma_elem(&t.a[i], &t.b[j], t.c[i][j], &p)) as f64,
                    exact
                );
            }
        }
    }
    let _ = Mode::Normal;
}

#[test]
fn the_first_hardware_counterexample_is_explained_by_leaving_a_zero_c_out_of_the_maximum() {
    // Case 908 of `mma-check verify` (seed 0x25, mode subnormal) on the H200 (PHASE_LOG T1):
    // c = 0, the largest product 0x9982 * 0x2278 has exponent -135, every other one is
    // smaller. The hardware aligns to -135 (25 bits: units of 2^-160) and gives 0x80007DEF;
    // the hypothesis aligns to c's nominal -126 (units of 2^-151, products truncated coarser)
    // and gives 0x80007DF0, one unit of 2^-149 further from zero.
    let hx = |s: &str| -> [u16; 16] {
        let v: Vec<u16> = s
            .split(' ')
            .map(|h| u16::from_str_radix(h, 16).unwrap())
            .collect();
        v.try_into().unwrap()
    };
    let a = hx("0674 9691 803f 0026 989c 9b33 8052 915b 8044 806b 0028 0204 8033 85d8 9982 803a");
    let b = hx("8b0a 0fcd 0820 9f61 0018 9545 8034 06a3 1c24 004b 8062 0050 047f 8046 2278 14cb");
    assert_eq!(mma_elem(&a, &b, 0, &Params::HOPPER), 0x8000_7DF0);
    let measured = Params {
        zeros_in_max: false,
        zero_c_in_max: false,
        ..Params::HOPPER
    };
    assert_eq!(mma_elem(&a, &b, 0, &measured), 0x8000_7DEF);
    // a nonzero c still counts: c = 2^-126 (the smallest normal) puts the alignment back at -126
    let c = 2f32.powi(-126).to_bits();
    assert_eq!(
        mma_elem(&a, &b, c, &measured),
        mma_elem(&a, &b, c, &Params::HOPPER)
    );
}

#[test]
fn a_floor_on_the_finest_bit_drops_terms_the_maximum_would_keep() {
    // Case 15297 (the second counterexample, under no-zeros-in-max): c = 0, the largest product
    // 0x1962 * 0x21f0 = 13560 * 2^-149 exactly (nominal exponent -137: units of 2^-162), a
    // negative product 0x8d20 * 0x2234 of about -7 units and a positive one of about 1.8. With
    // 25 bits below -137 both survive and the sum falls below 13560 units of 2^-149: RZ gives
    // 0x34F7; the hardware gives 0x34F8. A floor at 2^-158 (or -159) truncates both to zero:
    // exactly 13560 units, 0x34F8.
    let hx = |s: &str| -> [u16; 16] {
        let v: Vec<u16> = s
            .split(' ')
            .map(|h| u16::from_str_radix(h, 16).unwrap())
            .collect();
        v.try_into().unwrap()
    };
    let a = hx("001c 0037 1c25 1770 06bb 0c2e 0066 195a 8b33 0e5c 8d20 1962 9b19 85e7 1f56 800b");
    let b = hx("9432 8010 8013 16f1 9f1d 0093 0ef4 804a 8c46 0030 2234 21f0 8032 8049 001d 922c");
    let nz = Params {
        zeros_in_max: false,
        zero_c_in_max: false,
        ..Params::HOPPER
    };
    assert_eq!(mma_elem(&a, &b, 0, &nz), 0x34F7);
    assert_eq!(
        mma_elem(
            &a,
            &b,
            0,
            &Params {
                min_lsb: -159,
                ..nz
            }
        ),
        0x34F8
    );
    assert_eq!(
        mma_elem(
            &a,
            &b,
            0,
            &Params {
                min_lsb: -162,
                ..nz
            }
        ),
        0x34F7
    );
    // no floor where the maximum is large: 1 + 2^-24 keeps its last bit (units of 2^-25)
    let one_plus = |p: &Params| {
        let mut x = [0u16; 16];
        let mut y = [0u16; 16];
        x[0] = bf(1.0);
        y[0] = bf(1.0);
        mma_elem(&x, &y, f32::from_bits(1.0f32.to_bits() + 1).to_bits(), p)
    };
    assert_eq!(
        one_plus(&Params {
            min_lsb: -159,
            ..nz
        }),
        one_plus(&nz)
    );
}
