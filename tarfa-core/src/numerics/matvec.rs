//! Matrix-vector products over row-major weight matrices, for one activation (decode) or several
//! (prefill, expert-major batches), parallel over output rows.
//!
//! Every output `(row, activation)` is one canonical dot product computed by one thread, so the
//! result never depends on the thread count, on how rows are split into tasks, or on which other
//! activations share the batch. This module must never split a dot product across threads.
//!
//! Several products are submitted together as [`MatJob`]s (say, the gate and up projections of
//! all the experts a step needs) so that one parallel region covers them: in batch-1 decode the
//! per-region overhead is then paid a handful of times per layer, not per matrix.

use rayon::prelude::*;

use super::reduce::{Kernel, PreparedVec};

/// A borrowed row-major matrix of `rows x cols` weights.
#[derive(Clone, Copy, Debug)]
pub enum MatrixRef<'a> {
    /// BF16 weights as raw bits.
    Bf16 {
        rows: usize,
        cols: usize,
        data: &'a [u16],
    },
    /// F32 weights, used as they are.
    F32 {
        rows: usize,
        cols: usize,
        data: &'a [f32],
    },
}

impl<'a> MatrixRef<'a> {
    /// Number of output rows.
    pub fn rows(&self) -> usize {
        match *self {
            MatrixRef::Bf16 { rows, .. } | MatrixRef::F32 { rows, .. } => rows,
        }
    }

    /// Number of columns (the activation length).
    pub fn cols(&self) -> usize {
        match *self {
            MatrixRef::Bf16 { cols, .. } | MatrixRef::F32 { cols, .. } => cols,
        }
    }

    /// Bytes of weights the product reads.
    pub fn bytes(&self) -> u64 {
        match *self {
            MatrixRef::Bf16 { data, .. } => 2 * data.len() as u64,
            MatrixRef::F32 { data, .. } => 4 * data.len() as u64,
        }
    }

    /// `out[i] = dot(row r0 + i, x)` for consecutive rows, each the canonical dot product of
    /// the row's storage type (multi-head latent attention applies one head's rows of
    /// `kv_b_proj` to that head's own vector with it).
    pub fn rows_dot(&self, kernel: Kernel, r0: usize, x: &Activation, out: &mut [f32]) {
        match *self {
            MatrixRef::Bf16 { cols, data, .. } => {
                let rows = &data[r0 * cols..(r0 + out.len()) * cols];
                kernel.dot_bf16_rows(rows, cols, &x.prepared, out);
            }
            MatrixRef::F32 { cols, data, .. } => {
                for (i, o) in out.iter_mut().enumerate() {
                    let r = r0 + i;
                    *o = kernel.dot_f32(&data[r * cols..(r + 1) * cols], &x.raw);
                }
            }
        }
    }
}

/// An activation vector in both layouts: as it is (for F32 matrices) and prepared for the
/// kernel's BF16 dot product.
#[derive(Clone, Debug)]
pub struct Activation {
    raw: Vec<f32>,
    prepared: PreparedVec,
}

impl Activation {
    /// Prepares `x` for `kernel`.
    pub fn new(kernel: Kernel, x: Vec<f32>) -> Activation {
        let prepared = kernel.prepare(&x);
        Activation { raw: x, prepared }
    }

    /// The values.
    pub fn values(&self) -> &[f32] {
        &self.raw
    }

    /// Length of the vector.
    pub fn len(&self) -> usize {
        self.raw.len()
    }

    /// Whether the vector is empty.
    pub fn is_empty(&self) -> bool {
        self.raw.is_empty()
    }
}

/// One matrix applied to a batch of activations. `out` receives `rows x xs.len()` values laid out
/// by weight row: `out[r * xs.len() + m] = dot(row r, xs[m])` (for one activation, simply the
/// output vector).
pub struct MatJob<'a> {
    /// The weights.
    pub w: MatrixRef<'a>,
    /// The activations, each of length `w.cols()`.
    pub xs: Vec<&'a Activation>,
    /// The destination, `w.rows() * xs.len()` values.
    pub out: &'a mut [f32],
}

/// Rows one task takes at most from one job, and its rough size target in multiply-adds: big
/// enough that scheduling costs nothing, small enough that 2-16 threads stay busy.
const MIN_TASK_MACS: usize = 1 << 16;

/// Rows processed together when a job has several activations: their weights (at most 8 rows of
/// 4096 BF16 = 64 KiB) stay in L1/L2 while every activation passes over them.
const ROW_BLOCK: usize = 8;

/// Runs all jobs in the current rayon pool, parallel over row ranges.
///
/// # Panics
/// If a job's shapes are inconsistent (a caller bug: shapes are validated when weights load).
pub fn run_jobs(kernel: Kernel, jobs: Vec<MatJob<'_>>) {
    let threads = rayon::current_num_threads().max(1);
    let total_macs: usize = jobs
        .iter()
        .map(|j| j.w.rows() * j.w.cols() * j.xs.len())
        .sum();
    // Aim at ~4 tasks per thread so that uneven rows even out; never below MIN_TASK_MACS.
    let target = (total_macs / (4 * threads)).max(MIN_TASK_MACS);

    struct Task<'a> {
        w: MatrixRef<'a>,
        r0: usize,
        xs: &'a [&'a Activation],
        out: &'a mut [f32],
    }
    let mut tasks: Vec<Task<'_>> = Vec::new();
    for job in &jobs {
        let m = job.xs.len();
        assert_eq!(job.out.len(), job.w.rows() * m, "MatJob output length");
        for x in &job.xs {
            assert_eq!(x.len(), job.w.cols(), "MatJob activation length");
        }
    }
    // Split each job's output into row ranges; `jobs` owns the &mut outputs, so take them apart.
    let mut holders: Vec<(MatrixRef<'_>, Vec<&Activation>, &mut [f32])> =
        jobs.into_iter().map(|j| (j.w, j.xs, j.out)).collect();
    for (w, xs, out) in holders.iter_mut() {
        let m = xs.len();
        if m == 0 || w.rows() == 0 {
            continue;
        }
        let per_row = (w.cols() * m).max(1);
        let rows_per_task = (target / per_row).clamp(1, w.rows());
        let w = *w;
        let xs: &[&Activation] = xs;
        for (i, chunk) in out.chunks_mut(rows_per_task * m).enumerate() {
            tasks.push(Task {
                w,
                r0: i * rows_per_task,
                xs,
                out: chunk,
            });
        }
    }

    let run = |t: Task<'_>| {
        let m = t.xs.len();
        let rows = t.out.len() / m;
        if m == 1 {
            t.w.rows_dot(kernel, t.r0, t.xs[0], t.out);
            return;
        }
        match t.w {
            MatrixRef::Bf16 { cols, data, .. } => {
                let preps: Vec<&PreparedVec> = t.xs.iter().map(|a| &a.prepared).collect();
                for b0 in (0..rows).step_by(ROW_BLOCK) {
                    let nb = ROW_BLOCK.min(rows - b0);
                    let r = t.r0 + b0;
                    kernel.dot_bf16_rows_batch(
                        &data[r * cols..(r + nb) * cols],
                        cols,
                        &preps,
                        &mut t.out[b0 * m..(b0 + nb) * m],
                    );
                }
            }
            MatrixRef::F32 { .. } => {
                let mut tmp = [0.0f32; ROW_BLOCK];
                for b0 in (0..rows).step_by(ROW_BLOCK) {
                    let nb = ROW_BLOCK.min(rows - b0);
                    for (mi, x) in t.xs.iter().enumerate() {
                        t.w.rows_dot(kernel, t.r0 + b0, x, &mut tmp[..nb]);
                        for (i, &v) in tmp[..nb].iter().enumerate() {
                            t.out[(b0 + i) * m + mi] = v;
                        }
                    }
                }
            }
        }
    };
    if threads == 1 || tasks.len() == 1 {
        tasks.into_iter().for_each(run);
    } else {
        tasks.into_par_iter().for_each(run);
    }
}

/// Convenience: `y = W x` for one activation.
pub fn matvec(kernel: Kernel, w: MatrixRef<'_>, x: &Activation) -> Vec<f32> {
    let mut out = vec![0.0; w.rows()];
    run_jobs(
        kernel,
        vec![MatJob {
            w,
            xs: vec![x],
            out: &mut out,
        }],
    );
    out
}

/// Convenience: `Y[m] = W xs[m]` for a batch, returned per activation.
pub fn matmul_batch(kernel: Kernel, w: MatrixRef<'_>, xs: &[Activation]) -> Vec<Vec<f32>> {
    let m = xs.len();
    let mut out = vec![0.0; w.rows() * m];
    run_jobs(
        kernel,
        vec![MatJob {
            w,
            xs: xs.iter().collect(),
            out: &mut out,
        }],
    );
    transpose_rows(&out, w.rows(), m)
}

/// Turns a job output laid out by weight row (`rows x m`) into `m` vectors of length `rows`.
pub fn transpose_rows(out: &[f32], rows: usize, m: usize) -> Vec<Vec<f32>> {
    let mut res: Vec<Vec<f32>> = (0..m).map(|_| Vec::with_capacity(rows)).collect();
    // read `out` in order; each of the m outputs is written sequentially
    for row in out.chunks_exact(m.max(1)) {
        for (v, &x) in res.iter_mut().zip(row) {
            v.push(x);
        }
    }
    res
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::numerics::reduce::{dot_bf16_reference, f32_to_bf16_rne};

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let v = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed);
                ((v >> 8) % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn batched_and_parallel_products_equal_single_reference_dots() {
        let (rows, cols) = (203, 517);
        let w: Vec<u16> = data(rows * cols, 1)
            .into_iter()
            .map(f32_to_bf16_rne)
            .collect();
        let xs: Vec<Vec<f32>> = (0..5).map(|s| data(cols, 10 + s)).collect();
        let want: Vec<Vec<f32>> = xs
            .iter()
            .map(|x| {
                (0..rows)
                    .map(|r| dot_bf16_reference(&w[r * cols..(r + 1) * cols], x))
                    .collect()
            })
            .collect();
        let wref = MatrixRef::Bf16 {
            rows,
            cols,
            data: &w,
        };
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for kernel in Kernel::all_available() {
                let acts: Vec<Activation> = xs
                    .iter()
                    .map(|x| Activation::new(kernel, x.clone()))
                    .collect();
                let batch = pool.install(|| matmul_batch(kernel, wref, &acts));
                assert_eq!(batch, want, "batch {kernel:?} threads {threads}");
                for (a, wv) in acts.iter().zip(&want) {
                    let single = pool.install(|| matvec(kernel, wref, a));
                    assert_eq!(&single, wv);
                }
            }
        }
    }

    #[test]
    fn f32_matrices_use_the_f32_dot() {
        let (rows, cols) = (9, 300);
        let w = data(rows * cols, 3);
        let x = data(cols, 4);
        for kernel in Kernel::all_available() {
            let a = Activation::new(kernel, x.clone());
            let y = matvec(
                kernel,
                MatrixRef::F32 {
                    rows,
                    cols,
                    data: &w,
                },
                &a,
            );
            for r in 0..rows {
                let want =
                    crate::numerics::reduce::dot_f32_reference(&w[r * cols..(r + 1) * cols], &x);
                assert_eq!(y[r].to_bits(), want.to_bits());
            }
        }
    }
}
