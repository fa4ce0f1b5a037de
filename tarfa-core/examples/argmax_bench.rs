//! The host's greedy choice over a batch of logit rows: `tarfa_core::generate::argmax` (two
//! passes) against the one-pass loop it replaced, in one run, on the same rows.
//!
//! ```text
//! cargo run --release -p tarfa-core --example argmax_bench -- [ROWS] [VOCAB] [REPEATS]
//! ```
//! Defaults: 128 rows of 151,936 (a batched decode step of a Qwen3 MoE at B = 128), 5 repeats.
//! Prints the median time per step and per row of each, their ratio, and whether every choice
//! agreed (exit 1 if not).

use std::time::Instant;
use tarfa_core::generate::{argmax, argmax_one_pass as one_pass};

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .nth(i)
        .map(|a| {
            a.parse().unwrap_or_else(|_| {
                eprintln!("argmax_bench: argument {i} ({a:?}) is not a count");
                std::process::exit(2)
            })
        })
        .unwrap_or(default)
}

fn main() {
    let (rows, vocab, repeats) = (arg(1, 128), arg(2, 151_936), arg(3, 5).max(1));
    // logits-like rows: a spread of values with the maximum anywhere
    let mut s = 0x2545_f491_4f6c_dd1du64;
    let data: Vec<Vec<f32>> = (0..rows)
        .map(|_| {
            (0..vocab)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    ((s >> 40) as f32 / (1u64 << 24) as f32) * 40.0 - 20.0
                })
                .collect()
        })
        .collect();
    let time = |f: fn(&[f32]) -> u32| -> (f64, Vec<u32>) {
        let mut ts = Vec::new();
        let mut picks = Vec::new();
        for _ in 0..repeats {
            let t = Instant::now();
            picks = data.iter().map(|r| f(r)).collect();
            ts.push(t.elapsed().as_secs_f64());
        }
        ts.sort_by(f64::total_cmp);
        (ts[ts.len() / 2], picks)
    };
    let (old, a) = time(one_pass);
    let (new, b) = time(argmax);
    let per_row = |t: f64| 1e6 * t / rows.max(1) as f64;
    println!("{rows} rows of {vocab} logits, median of {repeats}:");
    println!(
        "  one-pass loop  {:8.2} ms a step, {:7.1} us a row",
        1e3 * old,
        per_row(old)
    );
    println!(
        "  argmax         {:8.2} ms a step, {:7.1} us a row ({:.2}x faster)",
        1e3 * new,
        per_row(new),
        old / new
    );
    if a != b {
        println!("  the choices DIFFER");
        std::process::exit(1);
    }
    println!("  every choice the same");
}
