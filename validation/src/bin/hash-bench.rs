//! This machine's hashing ceilings: SHA-256 and BLAKE3 throughput on one core and on all cores,
//! over in-memory buffers (no I/O). The conversion benchmark compares the converter against them.

use std::time::Instant;

use clap::Parser;
use rayon::prelude::*;
use sha2::{Digest, Sha256};

/// Measure SHA-256 and BLAKE3 throughput, single-core and all-core, and print one JSON line.
#[derive(Parser)]
struct Args {
    /// Bytes hashed per thread per repetition.
    #[arg(long, default_value_t = 256 << 20)]
    bytes: usize,
    /// Repetitions; the best is reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
}

fn best<F: Fn() -> f64>(reps: usize, f: F) -> f64 {
    (0..reps).map(|_| f()).fold(0.0, f64::max)
}

fn main() {
    let a = Args::parse();
    let threads = rayon::current_num_threads();
    // Non-trivial bytes, one buffer per thread so that the all-core run shares nothing.
    let bufs: Vec<Vec<u8>> = (0..threads)
        .map(|t| {
            (0..a.bytes)
                .map(|i| {
                    (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15 + t as u64) as u8
                        ^ (i >> 13) as u8
                })
                .collect()
        })
        .collect();
    let rate = |all: bool, f: fn(&[u8]) -> u8| {
        best(a.reps, || {
            let t = Instant::now();
            let n = if all {
                bufs.par_iter().map(|b| f(b) as usize).sum::<usize>();
                threads
            } else {
                std::hint::black_box(f(&bufs[0]));
                1
            };
            (n * a.bytes) as f64 / t.elapsed().as_secs_f64() / 1e9
        })
    };
    let sha = |b: &[u8]| Sha256::digest(b)[0];
    let b3 = |b: &[u8]| blake3::hash(b).as_bytes()[0];
    println!(
        "{{\"threads\": {threads}, \"sha256_1core_gbs\": {:.3}, \"sha256_allcore_gbs\": {:.3}, \"blake3_1core_gbs\": {:.3}, \"blake3_allcore_gbs\": {:.3}}}",
        rate(false, sha),
        rate(true, sha),
        rate(false, b3),
        rate(true, b3)
    );
}
