//! Seeds for fuzz/'s `extent_codec` target: each codec's encoding of a few small extents (with
//! the selector byte the target reads first), and raw extents for the round-trip mode.
//!   cargo run -p tarfa-codec-lab --example codec_fuzz_seeds -- fuzz/corpus/extent_codec
use tarfa_codec_lab::{encode, Codec};

fn main() {
    let Some(dir) = std::env::args().nth(1) else {
        eprintln!("usage: codec_fuzz_seeds DIR");
        std::process::exit(2);
    };
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("codec_fuzz_seeds: {dir}: {e}");
        std::process::exit(3);
    }
    let extents: Vec<Vec<u8>> = vec![
        vec![],
        [
            0x3c80u16, 0xbc80, 0x0001, 0x7f80, 0xffc1, 0x0000, 0x8000, 0x3f80,
        ]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect(),
        (0..512u32)
            .flat_map(|i| ((0x3c00 + (i * 37) % 700) as u16).to_le_bytes())
            .collect(),
    ];
    let mut n = 0;
    for (ci, c) in Codec::ALL.iter().enumerate() {
        for (xi, x) in extents.iter().enumerate() {
            let mut enc = vec![(ci as u8) << 1];
            enc.extend(encode(*c, x, 1));
            let mut raw = vec![((ci as u8) << 1) | 1];
            raw.extend(x);
            for (tag, bytes) in [("enc", enc), ("raw", raw)] {
                let p = format!("{dir}/{}-{tag}-{xi}", c.name());
                if let Err(e) = std::fs::write(&p, bytes) {
                    eprintln!("codec_fuzz_seeds: {p}: {e}");
                    std::process::exit(3);
                }
                n += 1;
            }
        }
    }
    println!("{n} seeds in {dir}");
}
