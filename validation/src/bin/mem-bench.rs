//! This machine's memory read bandwidth: every thread streams its share of a large buffer
//! (far larger than the caches), the best of several passes. The CPU decode benchmark divides
//! the weight bytes a token touches by this to get its roofline.

use std::time::Instant;

use clap::Parser;
use rayon::prelude::*;

/// Measure memory read bandwidth with all threads (or --threads) and print one JSON line.
#[derive(Parser)]
struct Args {
    /// Buffer size in MiB.
    #[arg(long, default_value_t = 2048)]
    mib: usize,
    #[arg(long, default_value_t = 5)]
    reps: usize,
    #[arg(long)]
    threads: Option<usize>,
}

fn main() {
    let a = Args::parse();
    if let Some(t) = a.threads {
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global();
    }
    let threads = rayon::current_num_threads();
    let words = a.mib << 17; // u64 words
    let mut buf = vec![0u64; words];
    buf.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| {
        for (j, w) in c.iter_mut().enumerate() {
            *w = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ j as u64;
        }
    });
    let chunk = words.div_ceil(threads);
    let mut best = 0f64;
    for _ in 0..a.reps {
        let t = Instant::now();
        // Eight independent xor chains per thread: the loads, not the arithmetic, are the limit.
        let x: u64 = buf
            .par_chunks(chunk)
            .map(|c| {
                let mut acc = [0u64; 8];
                for block in c.chunks_exact(8) {
                    for k in 0..8 {
                        acc[k] ^= block[k];
                    }
                }
                acc.iter().fold(0, |a, b| a ^ b)
            })
            .reduce(|| 0, |a, b| a ^ b);
        std::hint::black_box(x);
        best = best.max((words * 8) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    println!(
        "{{\"threads\": {threads}, \"buffer_mib\": {}, \"read_gbs\": {best:.2}}}",
        a.mib
    );
}
