//! The CPU's batched BF16 product against this core's FMA ceiling, measured in the same run
//! (PHASE_LOG B6; issue 17's "CPU prefill against the machine's FMA ceiling"):
//!
//! ```text
//! [SIMD=avx2] [SHAPES=768x2048,...] cargo run --release -p tarfa-core --example batch_bench [-- ROUNDS]
//! ```
//!
//! 1. the ceiling: one thread, 16 independent chains of 512-bit (else 256-bit) FMAs;
//! 2. for the expert and projection shapes of Qwen3-30B-A3B (rows x columns) and batches of
//!    1 to 64 activations, one thread: `Kernel::dot_bf16_rows_batch` (the lane-sequential tile)
//!    and `dot_bf16_rows_batch_pairs` (the two-rows-per-pass batch it replaced), alternating,
//!    `ROUNDS` rounds (default 5), the median GFLOP/s of each and its share of the ceiling;
//!    every output of both checked against the scalar reference's bits first.
//!
//! One thread because the product's parallelism is over rows (matvec.rs), which splits the
//! same work over the cores: a single core's rate is the kernel's.

use std::time::Instant;

use tarfa_core::numerics::reduce::{dot_bf16_reference, Kernel, PreparedVec};
use tarfa_core::numerics::{f32_to_bf16_rne, SimdPath};

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// splitmix64 values in [-1, 1).
struct Rng(u64);
impl Rng {
    fn f32(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// FMAs per second of one core: 16 independent chains, `n` rounds.
#[cfg(target_arch = "x86_64")]
fn fma_ceiling(path: SimdPath) -> f64 {
    use std::arch::x86_64::*;
    let n = 20_000_000u64;
    let t = Instant::now();
    let (lanes, secs) = match path {
        SimdPath::Avx512 => {
            // SAFETY: the path was checked available by the caller.
            let s = unsafe { ceiling512(n) };
            std::hint::black_box(s);
            let secs = t.elapsed().as_secs_f64();
            let buf = vec![0.999_999f32; 4096];
            let t = Instant::now();
            // SAFETY: as above.
            let s = unsafe { ceiling512_loads(n / 4, &buf) };
            std::hint::black_box(s);
            println!(
                "FMA with a 64-byte L1 load each, one thread: {:.1} GFMA/s (the bound of a product whose every fma loads an activation)",
                (n / 4 * 16 * 16) as f64 / t.elapsed().as_secs_f64() / 1e9
            );
            (16.0, secs)
        }
        _ => {
            // SAFETY: as above.
            let s = unsafe { ceiling256(n) };
            std::hint::black_box(s);
            (8.0, t.elapsed().as_secs_f64())
        }
    };
    return (n * 16) as f64 * lanes / secs;

    #[target_feature(enable = "avx512f")]
    unsafe fn ceiling512(n: u64) -> f32 {
        let mut a = [_mm512_set1_ps(1.0); 16];
        let (b, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        for _ in 0..n {
            for r in a.iter_mut() {
                *r = _mm512_fmadd_ps(*r, b, c);
            }
        }
        let mut s = _mm512_setzero_ps();
        for r in a {
            s = _mm512_add_ps(s, r);
        }
        _mm512_reduce_add_ps(s)
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn ceiling512_loads(n: u64, buf: &[f32]) -> f32 {
        // 16 chains, each fma with its own 64-byte load from a 16 KiB (L1) buffer
        let mut a = [_mm512_set1_ps(1.0); 16];
        let c = _mm512_set1_ps(1e-7);
        let per = buf.len() / 256;
        let mut j = 0;
        for _ in 0..n {
            let base = buf.as_ptr().add(256 * j);
            for (i, r) in a.iter_mut().enumerate() {
                *r = _mm512_fmadd_ps(*r, _mm512_loadu_ps(base.add(16 * i)), c);
            }
            j += 1;
            if j == per {
                j = 0;
            }
        }
        let mut s = _mm512_setzero_ps();
        for r in a {
            s = _mm512_add_ps(s, r);
        }
        _mm512_reduce_add_ps(s)
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn ceiling256(n: u64) -> f32 {
        let mut a = [_mm256_set1_ps(1.0); 16];
        let (b, c) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        for _ in 0..n {
            for r in a.iter_mut() {
                *r = _mm256_fmadd_ps(*r, b, c);
            }
        }
        let mut s = _mm256_setzero_ps();
        for r in a {
            s = _mm256_add_ps(s, r);
        }
        let mut o = [0.0f32; 8];
        _mm256_storeu_ps(o.as_mut_ptr(), s);
        o.iter().sum()
    }
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(5, |v| v.parse().expect("ROUNDS"));
    // SIMD=avx2|avx512|scalar chooses the path (default: the best this processor has)
    let kernel = match std::env::var("SIMD") {
        Ok(v) => Kernel::new(SimdPath::parse(&v).expect("SIMD: scalar, avx2 or avx512"))
            .expect("SIMD path not available here"),
        Err(_) => Kernel::best(),
    };
    println!("SIMD path: {:?}", kernel.path());
    #[cfg(target_arch = "x86_64")]
    let peak = fma_ceiling(kernel.path());
    #[cfg(not(target_arch = "x86_64"))]
    let peak = f64::NAN;
    println!(
        "FMA ceiling, one thread: {:.1} GFMA/s ({:.1} GFLOP/s)",
        peak / 1e9,
        2.0 * peak / 1e9
    );
    let mut rng = Rng(7);
    println!("rows x cols   batch   tile GFLOP/s (share)   pairs GFLOP/s (share)   tile/pairs");
    // SHAPES=ROWSxCOLS,... replaces the default shapes
    let shapes: Vec<(usize, usize)> = std::env::var("SHAPES").map_or_else(
        |_| vec![(768, 2048), (2048, 768), (512, 2048), (4096, 2048)],
        |s| {
            s.split(',')
                .map(|p| {
                    let (a, b) = p.split_once('x').expect("SHAPES: ROWSxCOLS,...");
                    (a.parse().expect("rows"), b.parse().expect("columns"))
                })
                .collect()
        },
    );
    for (rows, cols) in shapes {
        let w: Vec<u16> = (0..rows * cols)
            .map(|_| f32_to_bf16_rne(0.05 * rng.f32()))
            .collect();
        for m in [1usize, 2, 5, 8, 16, 64] {
            let xs: Vec<Vec<f32>> = (0..m)
                .map(|_| (0..cols).map(|_| rng.f32()).collect())
                .collect();
            let preps: Vec<PreparedVec> = xs.iter().map(|x| kernel.prepare(x)).collect();
            let refs: Vec<&PreparedVec> = preps.iter().collect();
            let mut a = vec![0.0f32; rows * m];
            let mut b = vec![0.0f32; rows * m];
            kernel.dot_bf16_rows_batch(&w, cols, &refs, &mut a);
            kernel.dot_bf16_rows_batch_pairs(&w, cols, &refs, &mut b);
            for r in (0..rows).step_by(97) {
                for (mi, x) in xs.iter().enumerate() {
                    let want = dot_bf16_reference(&w[r * cols..(r + 1) * cols], x).to_bits();
                    assert_eq!(
                        a[r * m + mi].to_bits(),
                        want,
                        "tile: row {r}, activation {mi}"
                    );
                    assert_eq!(
                        b[r * m + mi].to_bits(),
                        want,
                        "pairs: row {r}, activation {mi}"
                    );
                }
            }
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
            // enough repetitions for ~30 ms a measurement
            let macs = (rows * cols * m) as f64;
            let reps = ((3e7 / macs).ceil() as usize).max(1);
            // in blocks of 8 rows, as matvec.rs's run_jobs calls it (the block's rows stay in
            // L1/L2 while every activation passes over them)
            let blocked = |pairs: bool, out: &mut [f32]| {
                for b0 in (0..rows).step_by(8) {
                    let nb = 8.min(rows - b0);
                    let (wb, ob) = (
                        &w[b0 * cols..(b0 + nb) * cols],
                        &mut out[b0 * m..(b0 + nb) * m],
                    );
                    if pairs {
                        kernel.dot_bf16_rows_batch_pairs(wb, cols, &refs, ob);
                    } else {
                        kernel.dot_bf16_rows_batch(wb, cols, &refs, ob);
                    }
                }
            };
            let (mut ta, mut tb) = (Vec::new(), Vec::new());
            for _ in 0..rounds {
                let t = Instant::now();
                for _ in 0..reps {
                    blocked(false, &mut a);
                }
                ta.push(t.elapsed().as_secs_f64() / reps as f64);
                let t = Instant::now();
                for _ in 0..reps {
                    blocked(true, &mut b);
                }
                tb.push(t.elapsed().as_secs_f64() / reps as f64);
            }
            std::hint::black_box((&a, &b));
            let (sa, sb) = (median(&mut ta), median(&mut tb));
            let (ga, gb) = (2.0 * macs / sa / 1e9, 2.0 * macs / sb / 1e9);
            println!(
                "{rows:>4} x {cols:<5} {m:>5}   {ga:>8.1} ({:>5.1}%)        {gb:>8.1} ({:>5.1}%)        {:.2}x",
                100.0 * ga / (2.0 * peak / 1e9),
                100.0 * gb / (2.0 * peak / 1e9),
                sb / sa
            );
        }
    }
}
