//! The fast CPU emulator returns the model's bits (activations of every kind, specials included).

use tarfa_mma::cases::Rng;
use tarfa_mma::model::{dot_v2, Params};
use tarfa_mma::simd;

#[test]
fn emulator_equals_model() {
    let mut r = Rng::new(3, 4);
    for trial in 0..300 {
        let k = [16, 17, 100, 256, 768][trial % 5];
        let w: Vec<u16> = (0..k)
            .map(|_| match r.below(40) {
                0 => 0x7F80,
                1 => 0x0001,
                2 => 0x8000,
                3 => 0x7F00 | (r.next() as u16 & 0x7F),
                _ => (r.next() as u16 & 0x807F) | ((r.range(90, 150) as u16) << 7),
            })
            .collect();
        let x: Vec<f32> = (0..k)
            .map(|_| match r.below(60) {
                0 => f32::NAN,
                1 => 0.0,
                3 => 3.0e38,
                2 => f32::from_bits(r.next() as u32 & 0x807F_FFFF),
                _ => f32::from_bits(
                    (r.next() as u32 & 0x807F_FFFF) | ((r.range(60, 190) as u32) << 23),
                ),
            })
            .collect();
        let p = simd::Prepared::new(&x);
        let a = simd::dot_v2(&w, &p);
        let b = dot_v2(&w, &x, &Params::HOPPER);
        assert_eq!(a.to_bits(), b.to_bits(), "trial {trial}");
    }
}

#[test]
fn row_vectorised_emulator_equals_model() {
    let mut r = Rng::new(5, 6);
    for trial in 0..120 {
        let k = [16, 17, 100, 256, 768][trial % 5];
        let wide = trial % 3 == 0;
        let w: Vec<u16> = (0..16 * k)
            .map(|_| match r.below(if wide { 40 } else { 4000 }) {
                0 => 0x7F80,
                1 => 0x0001,
                2 => 0x8000,
                3 => 0x7F00 | (r.next() as u16 & 0x7F),
                _ => {
                    (r.next() as u16 & 0x807F)
                        | ((r.range(if wide { 1 } else { 110 }, if wide { 200 } else { 130 })
                            as u16)
                            << 7)
                }
            })
            .collect();
        let x: Vec<f32> = (0..k)
            .map(|_| match r.below(if wide { 60 } else { 6000 }) {
                0 => f32::NAN,
                1 => 0.0,
                2 => f32::from_bits(r.next() as u32 & 0x807F_FFFF),
                3 => 3.0e38,
                _ => f32::from_bits(
                    (r.next() as u32 & 0x807F_FFFF)
                        | ((r.range(if wide { 1 } else { 110 }, if wide { 200 } else { 135 })
                            as u32)
                            << 23),
                ),
            })
            .collect();
        let p = simd::Prepared::new(&x);
        // the AVX2 emulator, 8 rows at a time, on the same rows
        for half in 0..2 {
            let got8 = simd::dot_rows8(
                &simd::Rows8::new(&w[half * 8 * k..(half + 1) * 8 * k], k),
                &p,
            );
            for (row, g) in got8.iter().enumerate() {
                let r = half * 8 + row;
                let want = dot_v2(&w[r * k..(r + 1) * k], &x, &Params::HOPPER);
                assert_eq!(g.to_bits(), want.to_bits(), "avx2 trial {trial} row {r}");
            }
        }
        let got = simd::dot_rows16(&simd::Rows16::new(&w, k), &p);
        for row in 0..16 {
            let want = dot_v2(&w[row * k..(row + 1) * k], &x, &Params::HOPPER);
            assert_eq!(
                got[row].to_bits(),
                want.to_bits(),
                "trial {trial} row {row}: {} vs {}",
                got[row],
                want
            );
        }
    }
}
