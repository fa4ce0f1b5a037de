//! The H200's own results, recorded: `data/h200-mismatches-nz-seed25-5e8.txt.zst` holds, for
//! the 5 * 10^8 cases of `mma-check verify --cases 500000000 --model no-zeros-in-max` (seed
//! 0x25, `validation/gpu/mma-spec-ab.sh`, PHASE_LOG T1), every case where the hardware differed
//! from that model: `case hardware` (hex). Every other case's hardware result is that model's.
//! So these tests check the models against the hardware itself, offline, from the seed.

use tarfa_mma::cases;
use tarfa_mma::model::{mma_elem, Params};

const NZ: Params = Params {
    zeros_in_max: false,
    zero_c_in_max: false,
    ..Params::HOPPER
};

fn recorded() -> Vec<(u64, u32)> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/data/h200-mismatches-nz-seed25-5e8.txt.zst"
    );
    let raw = std::fs::read(path).expect("the recorded H200 results");
    let text = String::from_utf8(zstd::decode_all(&raw[..]).expect("zstd")).expect("utf-8");
    text.lines()
        .map(|l| {
            let (i, h) = l.split_once(' ').expect("`case hardware`");
            (i.parse().unwrap(), u32::from_str_radix(h, 16).unwrap())
        })
        .collect()
}

fn case(index: u64) -> ([u16; 16], [u16; 16], u32) {
    let (_, t) = cases::tile(0x25, index / 128);
    let (r, c) = ((index % 128) / 8, index % 8);
    (
        t.a[r as usize],
        t.b[c as usize],
        t.c[r as usize][c as usize],
    )
}

#[test]
fn the_measured_model_gives_the_hardware_s_result_where_the_corrected_hypothesis_did_not() {
    let rec = recorded();
    assert_eq!(rec.len(), 20_388, "the run's mismatch count (PHASE_LOG T1)");
    let mut measured_bad = 0;
    for &(i, hw) in &rec {
        let (a, b, c) = case(i);
        // the file is the run's mismatches: the model it ran against must differ on each
        assert_ne!(
            mma_elem(&a, &b, c, &NZ),
            hw,
            "case {i} is not a mismatch of no-zeros-in-max"
        );
        if mma_elem(&a, &b, c, &Params::HOPPER_MEASURED) != hw {
            measured_bad += 1;
        }
    }
    assert_eq!(
        measured_bad, 0,
        "cases where HOPPER_MEASURED differs from the H200"
    );
}

#[test]
fn the_measured_model_keeps_the_hardware_s_result_everywhere_else_in_the_first_tiles() {
    // The first 2,048 tiles (262,144 cases, every mode): where the dump has no entry the
    // hardware gave no-zeros-in-max's result, and the measured model must give it too.
    let rec: std::collections::HashMap<u64, u32> = recorded().into_iter().collect();
    let mut checked = 0;
    for index in 0..2048 * 128u64 {
        let (a, b, c) = case(index);
        let hw = rec
            .get(&index)
            .copied()
            .unwrap_or_else(|| mma_elem(&a, &b, c, &NZ));
        assert_eq!(
            mma_elem(&a, &b, c, &Params::HOPPER_MEASURED),
            hw,
            "case {index}"
        );
        checked += 1;
    }
    assert_eq!(checked, 262_144);
}
