//! The canonical reduction (docs/EXACTNESS.md section 4): dot products and sums over 256 virtual
//! lanes and a fixed tree, with a scalar reference and SIMD paths that return the same bits.
//!
//! Lane `v` accumulates terms `n = v, v+256, ...` in increasing `n`, starting at +0.0; then
//! `a[v] += a[v+h]` for `h = 128, 64, ..., 1`; the result is `a[0]`. The SIMD paths hold the lanes
//! in registers (a permutation of them, see [`PreparedVec`]) and perform exactly the same
//! additions in the same order; the scalar reference is the contract written out literally.
//!
//! Tails: the SIMD paths load the last partial 256-chunk zero-padded, i.e. they perform
//! `fma(+0, +0, a[v]) = a[v] + 0` on lanes past the end. That equals skipping them, because a lane
//! accumulator is never -0.0: it starts at +0.0, `+0 + (+-0) = +0`, and an exact cancellation
//! rounds to +0. (For the same reason the canonical result is never -0.0.)
//!
//! This module must never reassociate, split one reduction across threads, or take a different
//! order for speed: every output is a pure function of its inputs.

use super::aligned::AlignedVec;

/// Defines `fn $name(kernel: Kernel, args...) -> R` that runs `$body` compiled with FMA and the
/// path's vector width enabled (a copy per path), so that the `mul_add` of an elementwise loop is
/// one instruction, possibly vectorised, instead of a call to the software `fmaf`. The bits are
/// the same on every copy: `mul_add` is one correctly rounded fma everywhere; only speed differs.
#[macro_export]
#[doc(hidden)]
macro_rules! fma_dispatch {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty $body:block) => {
        $(#[$meta])*
        $vis fn $name(kernel: $crate::numerics::Kernel, $($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn body($($arg: $ty),*) -> $ret $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2($($arg: $ty),*) -> $ret {
                body($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx2,fma")]
            unsafe fn avx512($($arg: $ty),*) -> $ret {
                body($($arg),*)
            }
            match kernel.path() {
                $crate::numerics::SimdPath::Scalar => body($($arg),*),
                #[cfg(target_arch = "x86_64")]
                // SAFETY: a Kernel with a SIMD path exists only where the processor has it.
                $crate::numerics::SimdPath::Avx2 => unsafe { avx2($($arg),*) },
                #[cfg(target_arch = "x86_64")]
                $crate::numerics::SimdPath::Avx512 => unsafe { avx512($($arg),*) },
                #[cfg(not(target_arch = "x86_64"))]
                _ => body($($arg),*),
            }
        }
    };
}
pub use crate::fma_dispatch;

/// Number of virtual lanes of the canonical reduction.
pub const LANES: usize = 256;

/// Widens a BF16 value (its raw bits) to f32 exactly.
#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Rounds an f32 to the nearest BF16 (ties to even), as its raw bits. NaN stays NaN. Used only by
/// the deliberately inexact validation arm and by tests; exact mode never re-quantises.
pub fn f32_to_bf16_rne(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) as u16) | 0x40;
    }
    let round = 0x7FFF + ((b >> 16) & 1);
    ((b + round) >> 16) as u16
}

/// The instruction-set path a [`Kernel`] computes with. All give identical bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SimdPath {
    /// Plain Rust, one lane at a time: the reference.
    Scalar,
    /// x86-64 AVX2 + FMA (256-bit registers).
    Avx2,
    /// x86-64 AVX-512F (512-bit registers).
    Avx512,
}

impl SimdPath {
    /// The name used by `TARFA_SIMD` and in reports.
    pub fn name(self) -> &'static str {
        match self {
            SimdPath::Scalar => "scalar",
            SimdPath::Avx2 => "avx2",
            SimdPath::Avx512 => "avx512",
        }
    }

    /// Parses a `TARFA_SIMD` value.
    pub fn parse(s: &str) -> Option<SimdPath> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" => Some(SimdPath::Scalar),
            "avx2" => Some(SimdPath::Avx2),
            "avx512" | "avx-512" => Some(SimdPath::Avx512),
            _ => None,
        }
    }

    /// Whether this processor can run the path.
    pub fn is_available(self) -> bool {
        match self {
            SimdPath::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }
}

/// Why a requested SIMD path cannot be used.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    /// The processor lacks the instructions the path needs.
    #[error("SIMD path {0} is not supported by this processor")]
    Unavailable(&'static str),
}

/// A handle to the reduction kernels of one SIMD path; it exists only for a path this processor
/// supports, which is what makes the `unsafe` SIMD calls below sound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernel {
    path: SimdPath,
}

impl Kernel {
    /// The scalar reference path (always available).
    pub fn scalar() -> Kernel {
        Kernel {
            path: SimdPath::Scalar,
        }
    }

    /// The given path, if this processor supports it.
    pub fn new(path: SimdPath) -> Result<Kernel, KernelError> {
        if path.is_available() {
            Ok(Kernel { path })
        } else {
            Err(KernelError::Unavailable(path.name()))
        }
    }

    /// The fastest path this processor supports. (The library reads no environment variable: a
    /// front end chooses the path, e.g. `tarfa-run --kernel`.)
    pub fn best() -> Kernel {
        for p in [SimdPath::Avx512, SimdPath::Avx2] {
            if let Ok(k) = Kernel::new(p) {
                return k;
            }
        }
        Kernel::scalar()
    }

    /// Every path this processor supports (for tests that compare them).
    pub fn all_available() -> Vec<Kernel> {
        [SimdPath::Scalar, SimdPath::Avx2, SimdPath::Avx512]
            .into_iter()
            .filter_map(|p| Kernel::new(p).ok())
            .collect()
    }

    /// The path this kernel runs.
    pub fn path(self) -> SimdPath {
        self.path
    }

    /// Canonical `dot(a, b)` of two f32 vectors.
    ///
    /// # Panics
    /// If the lengths differ (a bug in the caller, never a property of the input data).
    pub fn dot_f32(self, a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len(), "dot_f32 length mismatch");
        match self.path {
            SimdPath::Scalar => dot_f32_reference(a, b),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the path's features were detected when the Kernel was made.
            SimdPath::Avx2 => unsafe { x86::avx2::dot_f32(a, b) },
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx512 => unsafe { x86::avx512::dot_f32(a, b) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => dot_f32_reference(a, b),
        }
    }

    /// Canonical `dot(x, row i)` for consecutive rows of `x.len()` values each (attention's
    /// scores of one query against many keys): `out[i] = dot_f32(x, rows[i])`, the same bits,
    /// with the query loaded once and, at widths of 64 or 128, the tree's levels over the lanes
    /// that hold no term left out and `+0.0` added at the end (section 4's pruning rule).
    ///
    /// # Panics
    /// If `rows` is not `out.len()` rows of `x.len()` values (a caller bug).
    pub fn dot_f32_rows(self, x: &[f32], rows: &[f32], out: &mut [f32]) {
        assert_eq!(
            rows.len(),
            x.len() * out.len(),
            "dot_f32_rows shape mismatch"
        );
        // widths 64 and 128 (attention heads) have a pruned SIMD form; others are one
        // `dot_f32` per row
        match (self.path, x.len()) {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the path's features were detected when the Kernel was made; the width is
            // one the function takes.
            (SimdPath::Avx512, 64 | 128) => unsafe { x86::avx512::dot_f32_rows(x, rows, out) },
            #[cfg(target_arch = "x86_64")]
            (SimdPath::Avx2, 64 | 128) => unsafe { x86::avx2::dot_f32_rows(x, rows, out) },
            _ => {
                for (o, row) in out.iter_mut().zip(rows.chunks_exact(x.len().max(1))) {
                    *o = self.dot_f32(x, row);
                }
                if x.is_empty() {
                    out.fill(0.0);
                }
            }
        }
    }

    /// Canonical `sum(t)`.
    pub fn sum(self, t: &[f32]) -> f32 {
        match self.path {
            SimdPath::Scalar => sum_reference(t),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            SimdPath::Avx2 => unsafe { x86::avx2::sum(t) },
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx512 => unsafe { x86::avx512::sum(t) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => sum_reference(t),
        }
    }

    /// Lays out an activation vector for [`Kernel::dot_bf16`]: zero-padded to a multiple of 256
    /// and permuted the way this path's registers hold the lanes.
    pub fn prepare(self, x: &[f32]) -> PreparedVec {
        let padded = x.len().div_ceil(LANES) * LANES;
        let mut data = AlignedVec::zeroed(padded);
        self.prepare_into(x, &mut data);
        PreparedVec {
            path: self.path,
            len: x.len(),
            data,
        }
    }

    fn prepare_into(self, x: &[f32], out: &mut [f32]) {
        // Within each group of G consecutive elements, the SIMD paths widen BF16 pairs with one
        // shift (even elements) and one mask (odd elements), so their registers hold the even
        // elements of a group, then the odd ones. The activation is permuted the same way, once.
        let group = match self.path {
            SimdPath::Scalar => {
                out[..x.len()].copy_from_slice(x);
                return;
            }
            SimdPath::Avx2 => 16,
            SimdPath::Avx512 => 32,
        };
        let half = group / 2;
        for (n, &v) in x.iter().enumerate() {
            let (g, i) = (n / group, n % group);
            let slot = if i % 2 == 0 { i / 2 } else { half + i / 2 };
            out[g * group + slot] = v;
        }
    }

    /// Canonical `dot(widen(w), x)` for a BF16 row `w` (raw bits) and a prepared activation.
    ///
    /// # Panics
    /// If `x` was prepared by another path or for another length (a caller bug).
    #[inline]
    pub fn dot_bf16(self, w: &[u16], x: &PreparedVec) -> f32 {
        assert!(
            x.path == self.path && x.len == w.len(),
            "dot_bf16: activation prepared for another path or length"
        );
        match self.path {
            SimdPath::Scalar => scalar_bf16_dot(w, &x.data[..x.len]),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above; x.data is padded to a multiple of 256 covering w.
            SimdPath::Avx2 => unsafe { x86::avx2::dot_bf16(w, &x.data) },
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx512 => unsafe { x86::avx512::dot_bf16(w, &x.data) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => dot_bf16_reference(w, &x.data[..x.len]),
        }
    }

    /// Canonical dots of consecutive rows of a row-major BF16 matrix with `k` columns against one
    /// prepared activation: `out[i] = dot(rows[i*k..(i+1)*k], x)`. The caller's loop over rows
    /// lives inside the SIMD function, so the per-row dispatch costs nothing.
    pub fn dot_bf16_rows(self, rows: &[u16], k: usize, x: &PreparedVec, out: &mut [f32]) {
        assert!(
            x.path == self.path && x.len == k && rows.len() == k * out.len(),
            "dot_bf16_rows: shape mismatch"
        );
        match self.path {
            SimdPath::Scalar => {
                for (o, row) in out.iter_mut().zip(rows.chunks_exact(k.max(1))) {
                    *o = scalar_bf16_dot(row, &x.data[..k]);
                }
                if k == 0 {
                    out.fill(0.0);
                }
            }
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            SimdPath::Avx2 => unsafe { x86::avx2::dot_bf16_rows(rows, k, &x.data, out) },
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx512 => unsafe { x86::avx512::dot_bf16_rows(rows, k, &x.data, out) },
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!(),
        }
    }

    /// Canonical dots of consecutive rows (`k` columns each) against several prepared
    /// activations: `out[i * xs.len() + m] = dot(row i, xs[m])`, the same bits as
    /// [`Kernel::dot_bf16_rows`] gives for each (row, activation). The AVX-512 path computes two
    /// rows per pass over an activation, halving the activation traffic of batched prefill.
    pub fn dot_bf16_rows_batch(self, rows: &[u16], k: usize, xs: &[&PreparedVec], out: &mut [f32]) {
        let m = xs.len();
        let n = out.len() / m.max(1);
        assert!(
            xs.iter().all(|x| x.path == self.path && x.len == k)
                && rows.len() == k * n
                && out.len() == n * m,
            "dot_bf16_rows_batch: shape mismatch"
        );
        match self.path {
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx512 if k > 0 => {
                let data: Vec<&[f32]> = xs.iter().map(|x| &x.data[..]).collect();
                // SAFETY: as above.
                unsafe { x86::avx512::dot_bf16_rows_batch(rows, k, &data, out) }
            }
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx2 if k > 0 => {
                let data: Vec<&[f32]> = xs.iter().map(|x| &x.data[..]).collect();
                // SAFETY: as above.
                unsafe { x86::avx2::dot_bf16_rows_batch(rows, k, &data, out) }
            }
            _ => {
                let mut one = [0.0f32];
                for i in 0..n {
                    for (mi, x) in xs.iter().enumerate() {
                        self.dot_bf16_rows(&rows[i * k..(i + 1) * k], k, x, &mut one);
                        out[i * m + mi] = one[0];
                    }
                }
            }
        }
    }
}

impl Kernel {
    /// [`Kernel::dot_bf16_rows_batch`] as it was before PHASE_LOG B6 (AVX-512: two rows per
    /// pass over each activation; the other paths: each row and activation alone): the same
    /// bits, kept as the other arm of B6's measurement (tarfa-core/examples/batch_bench.rs).
    pub fn dot_bf16_rows_batch_pairs(
        self,
        rows: &[u16],
        k: usize,
        xs: &[&PreparedVec],
        out: &mut [f32],
    ) {
        let m = xs.len();
        let n = out.len() / m.max(1);
        assert!(
            xs.iter().all(|x| x.path == self.path && x.len == k)
                && rows.len() == k * n
                && out.len() == n * m,
            "dot_bf16_rows_batch_pairs: shape mismatch"
        );
        match self.path {
            #[cfg(target_arch = "x86_64")]
            SimdPath::Avx512 if k > 0 => {
                let data: Vec<&[f32]> = xs.iter().map(|x| &x.data[..]).collect();
                // SAFETY: the path's features were detected when the Kernel was made.
                unsafe { x86::avx512::dot_bf16_rows_batch_pairs(rows, k, &data, out) }
            }
            _ => {
                // the other paths' batch before B6: each (row, activation) alone
                let mut one = [0.0f32];
                for i in 0..n {
                    for (mi, x) in xs.iter().enumerate() {
                        self.dot_bf16_rows(&rows[i * k..(i + 1) * k], k, x, &mut one);
                        out[i * m + mi] = one[0];
                    }
                }
            }
        }
    }
}

/// The scalar path's BF16 dot: the canonical reference, unless a validation experiment has
/// replaced it (see [`experimental`]); the SIMD paths never consult the replacement.
#[inline]
fn scalar_bf16_dot(w: &[u16], x: &[f32]) -> f32 {
    match experimental::bf16_dot_replacement() {
        None => dot_bf16_reference(w, x),
        Some(f) => f(w, x),
    }
}

/// EXPERIMENTAL, NOT THE CONTRACT (issue 25): a research binary (tarfa-mma's `mma-oracle`) may
/// replace the **scalar** path's BF16 dot product, for the whole process and irreversibly, by a
/// candidate arithmetic (the tensor-core contract-v2 model), to measure a forward pass under it.
/// Nothing in the product calls [`replace_scalar_bf16_dot_for_experiment`]; no option or
/// environment variable reaches it; the default kernel (SIMD) ignores it. Unset, the scalar path
/// is exactly [`dot_bf16_reference`].
pub mod experimental {
    use std::sync::OnceLock;

    /// A replacement BF16 dot: `(w, x)` with `x` unpermuted (the scalar layout).
    pub type Bf16Dot = fn(&[u16], &[f32]) -> f32;

    static REPLACEMENT: OnceLock<Bf16Dot> = OnceLock::new();

    /// Installs `f` as the scalar path's BF16 dot for the rest of the process. Returns false
    /// if one was already installed. For research binaries only (see the module note).
    pub fn replace_scalar_bf16_dot_for_experiment(f: Bf16Dot) -> bool {
        REPLACEMENT.set(f).is_ok()
    }

    #[inline]
    pub(super) fn bf16_dot_replacement() -> Option<Bf16Dot> {
        REPLACEMENT.get().copied()
    }
}

/// An activation vector laid out for one path's BF16 dot products (see [`Kernel::prepare`]).
#[derive(Clone, Debug)]
pub struct PreparedVec {
    path: SimdPath,
    len: usize,
    data: AlignedVec<f32>,
}

impl PreparedVec {
    /// The length of the original vector.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the original vector was empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// What the SIMD paths pad a row's partial last chunk with: BF16 -0.0 (and f32 -0.0 for f32
/// rows). Against the activation's +0.0 padding the product is -0.0, and `fma(-0, +0, a) = a` for
/// every accumulator `a`, -0.0 included (`-0 + +0 = +0`, `-0 + -0 = -0`), so a padded term is
/// exactly a skipped one, as the contract defines (section 4: lanes accumulate only the terms
/// n < N). A +0.0 pad would turn a lane that is -0.0 (an fma whose product underflowed to -0.0)
/// into +0.0: the sign of a zero result could then differ from the reference and the GPU's.
pub const NEG_ZERO_BF16: u16 = 0x8000;

/// The fixed tree over 256 lanes: `a[v] += a[v+h]` for `h = 128, ..., 1`; returns `a[0]`.
#[inline]
pub fn tree_reduce(a: &mut [f32; LANES]) -> f32 {
    let mut h = LANES / 2;
    while h >= 1 {
        for v in 0..h {
            a[v] += a[v + h];
        }
        h /= 2;
    }
    a[0]
}

/// The contract's dot product written out literally (the reference every path must equal).
pub fn dot_f32_reference(w: &[f32], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len());
    let mut a = [0.0f32; LANES];
    for (n, (&wn, &xn)) in w.iter().zip(x).enumerate() {
        a[n % LANES] = wn.mul_add(xn, a[n % LANES]);
    }
    tree_reduce(&mut a)
}

/// The contract's BF16-row dot product written out literally.
pub fn dot_bf16_reference(w: &[u16], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len());
    let mut a = [0.0f32; LANES];
    for (n, (&wn, &xn)) in w.iter().zip(x).enumerate() {
        a[n % LANES] = bf16_to_f32(wn).mul_add(xn, a[n % LANES]);
    }
    tree_reduce(&mut a)
}

/// The contract's sum written out literally.
pub fn sum_reference(t: &[f32]) -> f32 {
    let mut a = [0.0f32; LANES];
    for (n, &tn) in t.iter().enumerate() {
        a[n % LANES] += tn;
    }
    tree_reduce(&mut a)
}

/// The pruned form the contract allows when `N < 256`: lanes `v >= N` are never touched, each
/// used lane starts from its first product (no `+0.0` start), the tree skips pairs whose upper
/// lane is unused, and `+0.0` is added at the end. Kept to test that the pruning rule reproduces
/// the full tree.
pub fn dot_f32_pruned(w: &[f32], x: &[f32]) -> f32 {
    assert_eq!(w.len(), x.len());
    let n = w.len();
    if n >= LANES {
        return dot_f32_reference(w, x);
    }
    if n == 0 {
        return 0.0;
    }
    let mut a: Vec<f32> = w.iter().zip(x).map(|(&a, &b)| a * b).collect();
    let mut h = LANES / 2;
    while h >= 1 {
        for v in 0..h {
            if v + h < n {
                a[v] += a[v + h];
            }
        }
        h /= 2;
    }
    a[0] + 0.0
}

/// Canonical reductions with the lanes running over positions and the terms being whole vectors:
/// `out[d] = canonical dot over t of (p[t], rows[t][d])` for every `d`, computed for all `d` at
/// once. This is the attention output `o = sum_t p_t v_t` (contract section 6, step 3).
///
/// `rows` is `p.len()` rows of `out.len()` values, row-major. `scratch` is reused between calls.
pub fn weighted_row_sum(
    kernel: Kernel,
    p: &[f32],
    rows: &[f32],
    out: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    let d = out.len();
    let t = p.len();
    assert_eq!(rows.len(), t * d, "weighted_row_sum shape mismatch");
    let used = t.min(LANES);
    scratch.clear();
    scratch.resize(used * d, 0.0);
    weighted_row_sum_lanes(kernel, p, rows, d, used, &mut scratch[..]);
    if used == 0 {
        out.fill(0.0);
    } else if used < LANES {
        // the pruned tree's +0.0 (the full tree would have met a +0.0 lane)
        for (o, &a) in out.iter_mut().zip(&scratch[..d]) {
            *o = a + 0.0;
        }
    } else {
        // every lane used: the full tree, whose result may be -0.0 (no pruned lane to add)
        out.copy_from_slice(&scratch[..d]);
    }
}

/// One lane of [`weighted_row_sum`] for rows of `D` values: `lane = sum over t = v, v+256, ...
/// (increasing) of p[t] * rows[t]`, one fma per term from +0, with the lane's D accumulators in
/// a fixed-size array the compiler keeps in registers (one row load per D fmas, where the
/// position-major walk loaded and stored the lane from memory at every term).
#[inline(always)]
fn weighted_lane<const D: usize>(p: &[f32], rows: &[f32], v: usize, lane: &mut [f32]) {
    let mut acc = [0.0f32; D];
    let mut t = v;
    while t < p.len() {
        let pt = p[t];
        let row: &[f32; D] = rows[t * D..(t + 1) * D]
            .try_into()
            .expect("a row of D values");
        for (a, &x) in acc.iter_mut().zip(row) {
            *a = pt.mul_add(x, *a);
        }
        t += LANES;
    }
    lane.copy_from_slice(&acc);
}

fma_dispatch! {
/// The lanes and tree of [`weighted_row_sum`].
fn weighted_row_sum_lanes(p: &[f32], rows: &[f32], d: usize, used: usize, scratch: &mut [f32]) -> () {
    // lane v accumulates the rows t = v, v+256, ... in increasing t: lane by lane (each lane's
    // chain is the same sequence of fmas whichever lane runs first)
    for v in 0..used {
        let lane = &mut scratch[v * d..(v + 1) * d];
        match d {
            64 => weighted_lane::<64>(p, rows, v, lane),
            128 => weighted_lane::<128>(p, rows, v, lane),
            _ => {
                let mut t = v;
                while t < p.len() {
                    let pt = p[t];
                    for (a, &x) in lane.iter_mut().zip(&rows[t * d..(t + 1) * d]) {
                        *a = pt.mul_add(x, *a);
                    }
                    t += LANES;
                }
            }
        }
    }
    // the tree; lanes >= `used` hold +0.0 and are pruned (see the module doc)
    let mut h = LANES / 2;
    while h >= 1 {
        for v in 0..h {
            if v + h < used {
                let (lo, hi) = scratch.split_at_mut((v + h) * d);
                for (a, &b) in lo[v * d..(v + 1) * d].iter_mut().zip(&hi[..d]) {
                    *a += b;
                }
            }
        }
        h /= 2;
    }
}
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // register indices mirror the lane layout
mod x86 {
    //! The SIMD paths. Each keeps the 256 lanes in registers laid out so that every tree level
    //! is a whole-register add or the standard in-register halving, which is exactly the
    //! contract's pairing `a[v] + a[v+h]`.

    pub mod avx512 {
        //! 16 zmm accumulators = 256 lanes. For f32 inputs register j holds lanes 16j..16j+15.
        //! For BF16 rows, the 32 elements of group g (lanes 32g..32g+31) are widened as
        //! even elements (shift) into register 2g and odd elements (mask) into register 2g+1;
        //! the activation is prepared in that order.
        use super::super::{LANES, NEG_ZERO_BF16};
        use std::arch::x86_64::*;

        /// Tree levels h = 8, 4, 2, 1 inside one register whose slot i holds lane i.
        #[inline(always)]
        unsafe fn halve_in_register(r: __m512) -> __m256 {
            // h = 8: slots 0..7 += slots 8..15
            let lo = _mm512_castps512_ps256(r);
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r), 1));
            _mm256_add_ps(lo, hi)
        }

        /// h = 4, 2, 1 on the 8 slots of a ymm (slot i = lane i); returns lane 0.
        #[inline(always)]
        unsafe fn finish_ymm(r: __m256) -> f32 {
            let x = _mm_add_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1));
            let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
            let x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 0b01));
            _mm_cvtss_f32(x)
        }

        /// The tree over 16 registers in the contiguous layout (register j = lanes 16j..).
        #[inline(always)]
        unsafe fn tree_contiguous(mut a: [__m512; 16]) -> f32 {
            for h in [8usize, 4, 2, 1] {
                for j in 0..h {
                    a[j] = _mm512_add_ps(a[j], a[j + h]);
                }
            }
            finish_ymm(halve_in_register(a[0]))
        }

        /// The tree over 16 registers in the BF16 layout (register 2g+p = parity p of group g).
        #[inline(always)]
        unsafe fn tree_bf16(mut a: [__m512; 16]) -> f32 {
            // h = 128, 64, 32: group g += group g + h/32 (both parities)
            for hg in [4usize, 2, 1] {
                for g in 0..hg {
                    a[2 * g] = _mm512_add_ps(a[2 * g], a[2 * (g + hg)]);
                    a[2 * g + 1] = _mm512_add_ps(a[2 * g + 1], a[2 * (g + hg) + 1]);
                }
            }
            // lanes 0..31: even register slot i = lane 2i, odd register slot i = lane 2i+1.
            // h = 16, 8, 4, 2 pair slot i with slot i+8, i+4, i+2, i+1 within each register.
            let ev = halve_in_register(a[0]);
            let od = halve_in_register(a[1]);
            let ev = _mm_add_ps(_mm256_castps256_ps128(ev), _mm256_extractf128_ps(ev, 1));
            let od = _mm_add_ps(_mm256_castps256_ps128(od), _mm256_extractf128_ps(od, 1));
            let ev = _mm_add_ps(ev, _mm_movehl_ps(ev, ev));
            let od = _mm_add_ps(od, _mm_movehl_ps(od, od));
            let ev = _mm_add_ss(ev, _mm_shuffle_ps(ev, ev, 0b01));
            let od = _mm_add_ss(od, _mm_shuffle_ps(od, od, 0b01));
            // h = 1: lane 0 + lane 1
            _mm_cvtss_f32(_mm_add_ss(ev, od))
        }

        #[inline(always)]
        unsafe fn bf16_chunk(acc: &mut [__m512; 16], w: *const u16, x: *const f32) {
            let mask = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
            for g in 0..8 {
                let raw = _mm512_loadu_si512(w.add(32 * g) as *const _);
                let ev = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
                let od = _mm512_castsi512_ps(_mm512_and_si512(raw, mask));
                let xe = _mm512_loadu_ps(x.add(32 * g));
                let xo = _mm512_loadu_ps(x.add(32 * g + 16));
                acc[2 * g] = _mm512_fmadd_ps(ev, xe, acc[2 * g]);
                acc[2 * g + 1] = _mm512_fmadd_ps(od, xo, acc[2 * g + 1]);
            }
        }

        /// One row; `x` is prepared (permuted, padded to a multiple of 256 covering the row).
        #[inline(always)]
        unsafe fn dot_bf16_row(w: &[u16], x: &[f32]) -> f32 {
            let mut acc = [_mm512_setzero_ps(); 16];
            let full = w.len() / LANES;
            for c in 0..full {
                bf16_chunk(
                    &mut acc,
                    w.as_ptr().add(c * LANES),
                    x.as_ptr().add(c * LANES),
                );
            }
            let rest = w.len() - full * LANES;
            if rest > 0 {
                let mut buf = [NEG_ZERO_BF16; LANES];
                buf[..rest].copy_from_slice(&w[full * LANES..]);
                bf16_chunk(&mut acc, buf.as_ptr(), x.as_ptr().add(full * LANES));
            }
            tree_bf16(acc)
        }

        #[target_feature(enable = "avx512f")]
        pub unsafe fn dot_bf16(w: &[u16], x: &[f32]) -> f32 {
            debug_assert!(x.len() >= w.len().div_ceil(LANES) * LANES);
            dot_bf16_row(w, x)
        }

        /// Two rows against one activation in two passes over half the lanes each (groups 0-3,
        /// then 4-7: 16 accumulators), so every activation load serves both rows. Each lane
        /// accumulates exactly what [`dot_bf16_row`] accumulates, in the same order, and the
        /// tree is the same: the bits are identical.
        #[inline(always)]
        unsafe fn dot_bf16_row_pair(w0: &[u16], w1: &[u16], x: &[f32]) -> (f32, f32) {
            let k = w0.len();
            let full = k / LANES;
            let rest = k - full * LANES;
            let mut buf0 = [NEG_ZERO_BF16; LANES];
            let mut buf1 = [NEG_ZERO_BF16; LANES];
            buf0[..rest].copy_from_slice(&w0[full * LANES..]);
            buf1[..rest].copy_from_slice(&w1[full * LANES..]);
            let n_chunks = full + usize::from(rest > 0);
            let mask = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
            let mut r0 = [_mm512_setzero_ps(); 16];
            let mut r1 = [_mm512_setzero_ps(); 16];
            for half in 0..2 {
                let mut a0 = [_mm512_setzero_ps(); 8];
                let mut a1 = [_mm512_setzero_ps(); 8];
                for c in 0..n_chunks {
                    let (p0, p1) = if c < full {
                        (w0.as_ptr().add(c * LANES), w1.as_ptr().add(c * LANES))
                    } else {
                        (buf0.as_ptr(), buf1.as_ptr())
                    };
                    let xp = x.as_ptr().add(c * LANES);
                    for g in 0..4 {
                        let off = 32 * (4 * half + g);
                        let xe = _mm512_loadu_ps(xp.add(off));
                        let xo = _mm512_loadu_ps(xp.add(off + 16));
                        let raw0 = _mm512_loadu_si512(p0.add(off) as *const _);
                        let raw1 = _mm512_loadu_si512(p1.add(off) as *const _);
                        let ev0 = _mm512_castsi512_ps(_mm512_slli_epi32(raw0, 16));
                        let od0 = _mm512_castsi512_ps(_mm512_and_si512(raw0, mask));
                        let ev1 = _mm512_castsi512_ps(_mm512_slli_epi32(raw1, 16));
                        let od1 = _mm512_castsi512_ps(_mm512_and_si512(raw1, mask));
                        a0[2 * g] = _mm512_fmadd_ps(ev0, xe, a0[2 * g]);
                        a0[2 * g + 1] = _mm512_fmadd_ps(od0, xo, a0[2 * g + 1]);
                        a1[2 * g] = _mm512_fmadd_ps(ev1, xe, a1[2 * g]);
                        a1[2 * g + 1] = _mm512_fmadd_ps(od1, xo, a1[2 * g + 1]);
                    }
                }
                r0[8 * half..8 * half + 8].copy_from_slice(&a0);
                r1[8 * half..8 * half + 8].copy_from_slice(&a1);
            }
            (tree_bf16(r0), tree_bf16(r1))
        }

        /// The chains of groups `g` and `g + 4` (both parities: four registers of 16 lanes) of
        /// one row for `T` activations, every chunk in increasing order, one fma per term, from
        /// +0; returned as the tree's level 128 (`a[v] + a[v+128]`: group g plus group g + 4) for
        /// the even and the odd parity. The 4 x T chains run side by side: each row load serves
        /// T activations, and 4 x T independent fmas are in flight.
        #[inline(always)]
        unsafe fn group_pair<const T: usize>(
            w: *const u16,
            tail: *const u16,
            full: usize,
            chunks: usize,
            xs: &[*const f32; T],
            g: usize,
        ) -> ([__m512; T], [__m512; T]) {
            let mask = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
            let mut e0 = [_mm512_setzero_ps(); T];
            let mut o0 = [_mm512_setzero_ps(); T];
            let mut e4 = [_mm512_setzero_ps(); T];
            let mut o4 = [_mm512_setzero_ps(); T];
            for c in 0..chunks {
                let wp = if c < full { w.add(c * LANES) } else { tail };
                let r0 = _mm512_loadu_si512(wp.add(32 * g) as *const _);
                let r4 = _mm512_loadu_si512(wp.add(32 * (g + 4)) as *const _);
                let (we0, wo0) = (
                    _mm512_castsi512_ps(_mm512_slli_epi32(r0, 16)),
                    _mm512_castsi512_ps(_mm512_and_si512(r0, mask)),
                );
                let (we4, wo4) = (
                    _mm512_castsi512_ps(_mm512_slli_epi32(r4, 16)),
                    _mm512_castsi512_ps(_mm512_and_si512(r4, mask)),
                );
                let off = c * LANES + 32 * g;
                for t in 0..T {
                    let x = xs[t].add(off);
                    e0[t] = _mm512_fmadd_ps(we0, _mm512_loadu_ps(x), e0[t]);
                    o0[t] = _mm512_fmadd_ps(wo0, _mm512_loadu_ps(x.add(16)), o0[t]);
                    e4[t] = _mm512_fmadd_ps(we4, _mm512_loadu_ps(x.add(128)), e4[t]);
                    o4[t] = _mm512_fmadd_ps(wo4, _mm512_loadu_ps(x.add(144)), o4[t]);
                }
            }
            for t in 0..T {
                e0[t] = _mm512_add_ps(e0[t], e4[t]);
                o0[t] = _mm512_add_ps(o0[t], o4[t]);
            }
            (e0, o0)
        }

        /// tree_bf16's last levels from the two parities' sums over the groups: h = 16, 8, 4, 2
        /// inside each parity, h = 1 across them.
        #[inline(always)]
        unsafe fn finish_parities(ev: __m512, od: __m512) -> f32 {
            let e = halve_in_register(ev);
            let o = halve_in_register(od);
            let e = _mm_add_ps(_mm256_castps256_ps128(e), _mm256_extractf128_ps(e, 1));
            let o = _mm_add_ps(_mm256_castps256_ps128(o), _mm256_extractf128_ps(o, 1));
            let e = _mm_add_ps(e, _mm_movehl_ps(e, e));
            let o = _mm_add_ps(o, _mm_movehl_ps(o, o));
            let e = _mm_add_ss(e, _mm_shuffle_ps(e, e, 0b01));
            let o = _mm_add_ss(o, _mm_shuffle_ps(o, o, 0b01));
            _mm_cvtss_f32(_mm_add_ss(e, o))
        }

        /// Activations per pass in [`dot_bf16_rows_batch`]: 4 x 6 chains, the four widened row
        /// registers and the mask fit the 32 zmm registers.
        const TILE: usize = 6;
        /// Registers of partial trees per (row, activation).
        const STATE: usize = 4;
        const ZERO: __m512 = unsafe { std::mem::transmute([0.0f32; 16]) };
        /// Rows whose partial trees stay in one stack buffer (L1) while a tile of activations
        /// passes over them.
        const BLOCK: usize = 8;

        /// `T` activations against up to BLOCK rows, lane-sequentially (PHASE_LOG B6): the
        /// level-128 pairs of groups (0|4, 2|6, 1|5, 3|7) outermost, then the rows, so that the
        /// activations' slice of one pair (T x chunks x 256 bytes) stays in L1 across the rows;
        /// each row's partial trees wait in `state` (L1) between pairs. Every lane's chain and
        /// every tree pair are [`dot_bf16_row`]'s: level 64 adds pair 0|4 to 2|6 and 1|5 to 3|7,
        /// level 32 the two sums, then [`finish_parities`].
        /// `tails`: the block's rows' padded last chunks (filled by the caller when the rows
        /// have one); `state`: per (row, activation) the level-64 sums (even, odd) of 0|4 and
        /// 2|6, of 1|5 and 3|7 (each written before it is read).
        #[allow(clippy::too_many_arguments)]
        #[inline(always)]
        unsafe fn block_tokens<const T: usize>(
            rows: &[u16],
            k: usize,
            n: usize,
            xs: &[*const f32; T],
            out: &mut [f32],
            m: usize,
            tails: &[[u16; LANES]; BLOCK],
            state: &mut [[__m512; 4]; BLOCK * TILE],
        ) {
            let full = k / LANES;
            let rest = k - full * LANES;
            let chunks = full + usize::from(rest > 0);
            for (step, g) in [0usize, 2, 1, 3].into_iter().enumerate() {
                for r in 0..n {
                    let (ev, od) = group_pair::<T>(
                        rows.as_ptr().add(r * k),
                        tails[r].as_ptr(),
                        full,
                        chunks,
                        xs,
                        g,
                    );
                    for t in 0..T {
                        let s = &mut state[r * TILE + t];
                        match step {
                            0 => {
                                s[0] = ev[t];
                                s[1] = od[t];
                            }
                            1 => {
                                s[0] = _mm512_add_ps(s[0], ev[t]);
                                s[1] = _mm512_add_ps(s[1], od[t]);
                            }
                            2 => {
                                s[2] = ev[t];
                                s[3] = od[t];
                            }
                            _ => {
                                let e = _mm512_add_ps(s[0], _mm512_add_ps(s[2], ev[t]));
                                let o = _mm512_add_ps(s[1], _mm512_add_ps(s[3], od[t]));
                                out[r * m + t] = finish_parities(e, o);
                            }
                        }
                    }
                }
            }
        }

        /// `out[i * m + t] = dot(row i, xs[t])` (PHASE_LOG B6): tiles of up to 6 activations
        /// over blocks of 8 rows, each by [`block_tokens`]; one or two activations take the row
        /// pairs, which keep more fmas in flight for so few.
        #[target_feature(enable = "avx512f")]
        pub unsafe fn dot_bf16_rows_batch(rows: &[u16], k: usize, xs: &[&[f32]], out: &mut [f32]) {
            let m = xs.len();
            if m < 3 {
                return dot_bf16_rows_batch_pairs(rows, k, xs, out);
            }
            let n = rows.len() / k;
            let (full, rest) = (k / LANES, k % LANES);
            // made once per call: a block's padded last chunks, the partial trees
            let mut tails = [[NEG_ZERO_BF16; LANES]; BLOCK];
            let mut state = [[ZERO; STATE]; BLOCK * TILE];
            for b0 in (0..n).step_by(BLOCK) {
                let nb = BLOCK.min(n - b0);
                let block = &rows[b0 * k..(b0 + nb) * k];
                if rest > 0 {
                    for r in 0..nb {
                        let row = &block[r * k..(r + 1) * k];
                        tails[r][..rest].copy_from_slice(&row[full * LANES..]);
                    }
                }
                let mut t0 = 0;
                while t0 < m {
                    let tn = TILE.min(m - t0);
                    let o = &mut out[b0 * m + t0..];
                    let x = |j: usize| xs[t0 + j].as_ptr();
                    match tn {
                        6 => block_tokens::<6>(
                            block,
                            k,
                            nb,
                            &[x(0), x(1), x(2), x(3), x(4), x(5)],
                            o,
                            m,
                            &tails,
                            &mut state,
                        ),
                        5 => block_tokens::<5>(
                            block,
                            k,
                            nb,
                            &[x(0), x(1), x(2), x(3), x(4)],
                            o,
                            m,
                            &tails,
                            &mut state,
                        ),
                        4 => block_tokens::<4>(
                            block,
                            k,
                            nb,
                            &[x(0), x(1), x(2), x(3)],
                            o,
                            m,
                            &tails,
                            &mut state,
                        ),
                        3 => block_tokens::<3>(
                            block,
                            k,
                            nb,
                            &[x(0), x(1), x(2)],
                            o,
                            m,
                            &tails,
                            &mut state,
                        ),
                        2 => {
                            block_tokens::<2>(block, k, nb, &[x(0), x(1)], o, m, &tails, &mut state)
                        }
                        _ => block_tokens::<1>(block, k, nb, &[x(0)], o, m, &tails, &mut state),
                    }
                    t0 += tn;
                }
            }
        }

        /// B3's two-rows-per-pass batch (the other arm of PHASE_LOG B6's A/B): every activation
        /// against two rows at a time.
        #[target_feature(enable = "avx512f")]
        pub unsafe fn dot_bf16_rows_batch_pairs(
            rows: &[u16],
            k: usize,
            xs: &[&[f32]],
            out: &mut [f32],
        ) {
            let m = xs.len();
            let n = rows.len() / k;
            let mut i = 0;
            while i + 1 < n {
                let (w0, w1) = (&rows[i * k..(i + 1) * k], &rows[(i + 1) * k..(i + 2) * k]);
                for (mi, x) in xs.iter().enumerate() {
                    let (d0, d1) = dot_bf16_row_pair(w0, w1, x);
                    out[i * m + mi] = d0;
                    out[(i + 1) * m + mi] = d1;
                }
                i += 2;
            }
            if i < n {
                for (mi, x) in xs.iter().enumerate() {
                    out[i * m + mi] = dot_bf16_row(&rows[i * k..(i + 1) * k], x);
                }
            }
        }

        #[target_feature(enable = "avx512f")]
        pub unsafe fn dot_bf16_rows(rows: &[u16], k: usize, x: &[f32], out: &mut [f32]) {
            debug_assert!(x.len() >= k.div_ceil(LANES) * LANES);
            for (i, o) in out.iter_mut().enumerate() {
                *o = dot_bf16_row(&rows[i * k..(i + 1) * k], x);
            }
        }

        #[inline(always)]
        unsafe fn f32_chunk(acc: &mut [__m512; 16], a: *const f32, b: *const f32) {
            for j in 0..16 {
                let va = _mm512_loadu_ps(a.add(16 * j));
                let vb = _mm512_loadu_ps(b.add(16 * j));
                acc[j] = _mm512_fmadd_ps(va, vb, acc[j]);
            }
        }

        #[target_feature(enable = "avx512f")]
        pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
            let mut acc = [_mm512_setzero_ps(); 16];
            let full = a.len() / LANES;
            for c in 0..full {
                f32_chunk(
                    &mut acc,
                    a.as_ptr().add(c * LANES),
                    b.as_ptr().add(c * LANES),
                );
            }
            let rest = a.len() - full * LANES;
            if rest > 0 {
                // masked loads read nothing past the end; the masked fma leaves the lanes past
                // the end as they are (skipped terms: an fma with +0.0 there would turn a -0.0
                // lane into +0.0, see NEG_ZERO_BF16)
                let (pa, pb) = (a.as_ptr().add(full * LANES), b.as_ptr().add(full * LANES));
                for j in 0..rest.div_ceil(16) {
                    let m = tail_mask(j, rest);
                    let va = _mm512_maskz_loadu_ps(m, pa.add(16 * j));
                    let vb = _mm512_maskz_loadu_ps(m, pb.add(16 * j));
                    acc[j] = _mm512_mask3_fmadd_ps(va, vb, acc[j], m);
                }
            }
            tree_contiguous(acc)
        }

        /// [`dot_f32`] of `x` with each row of `rows` at widths 64 and 128 only (the caller,
        /// `Kernel::dot_f32_rows`, takes every other width row by row).
        /// Widths 64 and 128 fill registers 0..W/16 and leave the others +0.0: their tree
        /// skips the levels that pair a register with a +0.0 one (h = 128, and 64 for width
        /// 64) and adds +0.0 to the result, which is the full tree's value (section 4's pruning
        /// rule: the skipped adds only turn a -0.0 into +0.0, and so does the final one).
        #[target_feature(enable = "avx512f")]
        pub unsafe fn dot_f32_rows(x: &[f32], rows: &[f32], out: &mut [f32]) {
            match x.len() {
                128 => pruned_rows::<8>(x, rows, out),
                64 => pruned_rows::<4>(x, rows, out),
                d => panic!("dot_f32_rows: width {d} has no pruned form (64 or 128 only)"),
            }
        }

        /// `R` registers of terms (width 16 R, R a power of two below 16).
        #[inline(always)]
        unsafe fn pruned_rows<const R: usize>(x: &[f32], rows: &[f32], out: &mut [f32]) {
            let mut q = [_mm512_setzero_ps(); R];
            for j in 0..R {
                q[j] = _mm512_loadu_ps(x.as_ptr().add(16 * j));
            }
            for (i, o) in out.iter_mut().enumerate() {
                let k = rows.as_ptr().add(i * 16 * R);
                let mut a = [_mm512_setzero_ps(); R];
                for j in 0..R {
                    a[j] =
                        _mm512_fmadd_ps(q[j], _mm512_loadu_ps(k.add(16 * j)), _mm512_setzero_ps());
                }
                // the full tree's levels over registers j and j + h, for the h below R
                let mut h = R / 2;
                while h >= 1 {
                    for j in 0..h {
                        a[j] = _mm512_add_ps(a[j], a[j + h]);
                    }
                    h /= 2;
                }
                *o = finish_ymm(halve_in_register(a[0])) + 0.0;
            }
        }

        /// Mask of the elements of register j (elements 16j..16j+16) below `rest`.
        #[inline(always)]
        fn tail_mask(j: usize, rest: usize) -> __mmask16 {
            let n = rest.saturating_sub(16 * j).min(16);
            ((1u32 << n) - 1) as __mmask16
        }

        #[inline(always)]
        unsafe fn sum_chunk(acc: &mut [__m512; 16], t: *const f32) {
            for j in 0..16 {
                acc[j] = _mm512_add_ps(acc[j], _mm512_loadu_ps(t.add(16 * j)));
            }
        }

        #[target_feature(enable = "avx512f")]
        pub unsafe fn sum(t: &[f32]) -> f32 {
            let mut acc = [_mm512_setzero_ps(); 16];
            let full = t.len() / LANES;
            for c in 0..full {
                sum_chunk(&mut acc, t.as_ptr().add(c * LANES));
            }
            let rest = t.len() - full * LANES;
            if rest > 0 {
                let mut bt = [0f32; LANES];
                bt[..rest].copy_from_slice(&t[full * LANES..]);
                sum_chunk(&mut acc, bt.as_ptr());
            }
            tree_contiguous(acc)
        }
    }

    pub mod avx2 {
        //! 256 lanes are 32 ymm accumulators, more than AVX2's 16 registers: the compiler keeps
        //! what fits in registers and the rest in L1, which costs far less than the memory the
        //! loop waits for (an earlier version walked each row in four lane passes to stay in
        //! registers, and streamed memory markedly worse). For f32 inputs accumulator j holds
        //! lanes 8j..8j+7; for BF16 rows the 16 elements of group g are widened into an even
        //! (2g) and an odd (2g+1) accumulator, and the activation is prepared in that order.
        use super::super::{LANES, NEG_ZERO_BF16};
        use std::arch::x86_64::*;

        /// h = 4, 2, 1 within one register whose slot i holds lane i (of the remaining lanes).
        #[inline(always)]
        unsafe fn halve3(r: __m256) -> __m128 {
            let x = _mm_add_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1));
            let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
            _mm_add_ss(x, _mm_shuffle_ps(x, x, 0b01))
        }

        /// The tree in the contiguous layout: h = 128 .. 8 pair accumulator j with j + h/8.
        #[inline(always)]
        unsafe fn tree_contiguous(mut a: [__m256; 32]) -> f32 {
            for h in [16usize, 8, 4, 2, 1] {
                for j in 0..h {
                    a[j] = _mm256_add_ps(a[j], a[j + h]);
                }
            }
            _mm_cvtss_f32(halve3(a[0]))
        }

        /// The tree in the BF16 layout: h = 128 .. 16 pair group g with g + h/16 (both
        /// parities); then even slot i = lane 2i and odd slot i = lane 2i+1, so h = 8, 4, 2 are
        /// in-register halvings and h = 1 adds the two slot 0s.
        #[inline(always)]
        unsafe fn tree_bf16(mut a: [__m256; 32]) -> f32 {
            for hg in [8usize, 4, 2, 1] {
                for g in 0..hg {
                    a[2 * g] = _mm256_add_ps(a[2 * g], a[2 * (g + hg)]);
                    a[2 * g + 1] = _mm256_add_ps(a[2 * g + 1], a[2 * (g + hg) + 1]);
                }
            }
            _mm_cvtss_f32(_mm_add_ss(halve3(a[0]), halve3(a[1])))
        }

        #[inline(always)]
        unsafe fn bf16_chunk(acc: &mut [__m256; 32], w: *const u16, x: *const f32) {
            let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
            for g in 0..16 {
                let raw = _mm256_loadu_si256(w.add(16 * g) as *const __m256i);
                let ev = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
                let od = _mm256_castsi256_ps(_mm256_and_si256(raw, mask));
                acc[2 * g] = _mm256_fmadd_ps(ev, _mm256_loadu_ps(x.add(16 * g)), acc[2 * g]);
                acc[2 * g + 1] =
                    _mm256_fmadd_ps(od, _mm256_loadu_ps(x.add(16 * g + 8)), acc[2 * g + 1]);
            }
        }

        /// One row; `x` is prepared (permuted, padded to a multiple of 256 covering the row).
        #[inline(always)]
        unsafe fn dot_bf16_row(w: &[u16], x: &[f32]) -> f32 {
            let mut acc = [_mm256_setzero_ps(); 32];
            let full = w.len() / LANES;
            for c in 0..full {
                bf16_chunk(
                    &mut acc,
                    w.as_ptr().add(c * LANES),
                    x.as_ptr().add(c * LANES),
                );
            }
            let rest = w.len() - full * LANES;
            if rest > 0 {
                let mut buf = [NEG_ZERO_BF16; LANES];
                buf[..rest].copy_from_slice(&w[full * LANES..]);
                bf16_chunk(&mut acc, buf.as_ptr(), x.as_ptr().add(full * LANES));
            }
            tree_bf16(acc)
        }

        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn dot_bf16(w: &[u16], x: &[f32]) -> f32 {
            debug_assert!(x.len() >= w.len().div_ceil(LANES) * LANES);
            dot_bf16_row(w, x)
        }

        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn dot_bf16_rows(rows: &[u16], k: usize, x: &[f32], out: &mut [f32]) {
            debug_assert!(x.len() >= k.div_ceil(LANES) * LANES);
            for (i, o) in out.iter_mut().enumerate() {
                *o = dot_bf16_row(&rows[i * k..(i + 1) * k], x);
            }
        }

        /// The chains of groups `g` and `g + 8` (both parities: four registers of 8 lanes) of one
        /// row for `T` activations, every chunk in increasing order, one fma per term, from +0;
        /// returned as the tree's level 128 (group g plus group g + 8) for the even and the odd
        /// parity (PHASE_LOG B6, the AVX2 form of avx512's `group_pair`).
        #[inline(always)]
        unsafe fn group_pair<const T: usize>(
            w: *const u16,
            tail: *const u16,
            full: usize,
            chunks: usize,
            xs: &[*const f32; T],
            g: usize,
        ) -> ([__m256; T], [__m256; T]) {
            let mask = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
            let mut e0 = [_mm256_setzero_ps(); T];
            let mut o0 = [_mm256_setzero_ps(); T];
            let mut e8 = [_mm256_setzero_ps(); T];
            let mut o8 = [_mm256_setzero_ps(); T];
            for c in 0..chunks {
                let wp = if c < full { w.add(c * LANES) } else { tail };
                let r0 = _mm256_loadu_si256(wp.add(16 * g) as *const __m256i);
                let r8 = _mm256_loadu_si256(wp.add(16 * (g + 8)) as *const __m256i);
                let we0 = _mm256_castsi256_ps(_mm256_slli_epi32(r0, 16));
                let wo0 = _mm256_castsi256_ps(_mm256_and_si256(r0, mask));
                let we8 = _mm256_castsi256_ps(_mm256_slli_epi32(r8, 16));
                let wo8 = _mm256_castsi256_ps(_mm256_and_si256(r8, mask));
                let off = c * LANES + 16 * g;
                for t in 0..T {
                    let x = xs[t].add(off);
                    e0[t] = _mm256_fmadd_ps(we0, _mm256_loadu_ps(x), e0[t]);
                    o0[t] = _mm256_fmadd_ps(wo0, _mm256_loadu_ps(x.add(8)), o0[t]);
                    e8[t] = _mm256_fmadd_ps(we8, _mm256_loadu_ps(x.add(128)), e8[t]);
                    o8[t] = _mm256_fmadd_ps(wo8, _mm256_loadu_ps(x.add(136)), o8[t]);
                }
            }
            for t in 0..T {
                e0[t] = _mm256_add_ps(e0[t], e8[t]);
                o0[t] = _mm256_add_ps(o0[t], o8[t]);
            }
            (e0, o0)
        }

        /// Activations per pass: 4 x 3 chains and the four widened row registers fill AVX2's 16.
        const TILE: usize = 3;
        /// Registers of partial trees per (row, activation).
        const STATE: usize = 6;
        const ZERO: __m256 = unsafe { std::mem::transmute([0.0f32; 8]) };
        /// Rows whose partial trees wait in one stack buffer (L1) between passes.
        const BLOCK: usize = 8;

        /// `T` activations against up to BLOCK rows, lane-sequentially: the level-128 pairs of
        /// groups (g|g+8) in bit-reversed order of g (0, 4, 2, 6, 1, 5, 3, 7) outermost, then
        /// the rows; each row's partial trees (levels 64, 32, 16: pair g with g + 4, g + 2,
        /// g + 1, as a binary counter over the passes) wait in `state`; then tree_bf16's
        /// in-register levels. The chains and pairs of [`dot_bf16_row`]: the same bits.
        /// `tails`: as avx512's; `state`: per (row, activation) the pending subtrees of 1, 2
        /// and 4 pairs, (even, odd) (each written before it is read).
        #[allow(clippy::too_many_arguments)]
        #[inline(always)]
        unsafe fn block_tokens<const T: usize>(
            rows: &[u16],
            k: usize,
            n: usize,
            xs: &[*const f32; T],
            out: &mut [f32],
            m: usize,
            tails: &[[u16; LANES]; BLOCK],
            state: &mut [[__m256; 6]; BLOCK * TILE],
        ) {
            let full = k / LANES;
            let rest = k - full * LANES;
            let chunks = full + usize::from(rest > 0);
            for (s, g) in [0usize, 4, 2, 6, 1, 5, 3, 7].into_iter().enumerate() {
                for r in 0..n {
                    let (ev, od) = group_pair::<T>(
                        rows.as_ptr().add(r * k),
                        tails[r].as_ptr(),
                        full,
                        chunks,
                        xs,
                        g,
                    );
                    for t in 0..T {
                        let st = &mut state[r * TILE + t];
                        let (mut e, mut o) = (ev[t], od[t]);
                        let mut done = false;
                        for lvl in 0..3 {
                            if s & (1 << lvl) == 0 {
                                st[2 * lvl] = e;
                                st[2 * lvl + 1] = o;
                                break;
                            }
                            e = _mm256_add_ps(st[2 * lvl], e);
                            o = _mm256_add_ps(st[2 * lvl + 1], o);
                            done = lvl == 2;
                        }
                        if done {
                            out[r * m + t] = _mm_cvtss_f32(_mm_add_ss(halve3(e), halve3(o)));
                        }
                    }
                }
            }
        }

        /// `out[i * m + t] = dot(row i, xs[t])` (PHASE_LOG B6): blocks of 8 rows x tiles of 3
        /// activations by [`block_tokens`]; one or two activations take each (row, activation)
        /// alone (measured faster for so few).
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn dot_bf16_rows_batch(rows: &[u16], k: usize, xs: &[&[f32]], out: &mut [f32]) {
            let m = xs.len();
            let n = rows.len() / k;
            if m < 3 {
                for i in 0..n {
                    for (mi, x) in xs.iter().enumerate() {
                        out[i * m + mi] = dot_bf16_row(&rows[i * k..(i + 1) * k], x);
                    }
                }
                return;
            }
            let (full, rest) = (k / LANES, k % LANES);
            // made once per call: a block's padded last chunks, the partial trees
            let mut tails = [[NEG_ZERO_BF16; LANES]; BLOCK];
            let mut state = [[ZERO; STATE]; BLOCK * TILE];
            for b0 in (0..n).step_by(BLOCK) {
                let nb = BLOCK.min(n - b0);
                let block = &rows[b0 * k..(b0 + nb) * k];
                if rest > 0 {
                    for r in 0..nb {
                        let row = &block[r * k..(r + 1) * k];
                        tails[r][..rest].copy_from_slice(&row[full * LANES..]);
                    }
                }
                let mut t0 = 0;
                while t0 < m {
                    let tn = TILE.min(m - t0);
                    let o = &mut out[b0 * m + t0..];
                    let x = |j: usize| xs[t0 + j].as_ptr();
                    match tn {
                        3 => block_tokens::<3>(
                            block,
                            k,
                            nb,
                            &[x(0), x(1), x(2)],
                            o,
                            m,
                            &tails,
                            &mut state,
                        ),
                        2 => {
                            block_tokens::<2>(block, k, nb, &[x(0), x(1)], o, m, &tails, &mut state)
                        }
                        _ => block_tokens::<1>(block, k, nb, &[x(0)], o, m, &tails, &mut state),
                    }
                    t0 += tn;
                }
            }
        }

        #[inline(always)]
        unsafe fn f32_chunk(acc: &mut [__m256; 32], a: *const f32, b: *const f32) {
            for j in 0..32 {
                let va = _mm256_loadu_ps(a.add(8 * j));
                let vb = _mm256_loadu_ps(b.add(8 * j));
                acc[j] = _mm256_fmadd_ps(va, vb, acc[j]);
            }
        }

        /// avx512's `dot_f32_rows` with 8-lane registers: widths 64 and 128 fill registers
        /// 0..W/8 and the tree skips the levels that pair them with +0.0 registers, adding +0.0
        /// at the end.
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn dot_f32_rows(x: &[f32], rows: &[f32], out: &mut [f32]) {
            match x.len() {
                128 => pruned_rows::<16>(x, rows, out),
                64 => pruned_rows::<8>(x, rows, out),
                d => panic!("dot_f32_rows: width {d} has no pruned form (64 or 128 only)"),
            }
        }

        #[inline(always)]
        unsafe fn pruned_rows<const R: usize>(x: &[f32], rows: &[f32], out: &mut [f32]) {
            for (i, o) in out.iter_mut().enumerate() {
                let k = rows.as_ptr().add(i * 8 * R);
                let mut a = [_mm256_setzero_ps(); R];
                for j in 0..R {
                    a[j] = _mm256_fmadd_ps(
                        _mm256_loadu_ps(x.as_ptr().add(8 * j)),
                        _mm256_loadu_ps(k.add(8 * j)),
                        _mm256_setzero_ps(),
                    );
                }
                let mut h = R / 2;
                while h >= 1 {
                    for j in 0..h {
                        a[j] = _mm256_add_ps(a[j], a[j + h]);
                    }
                    h /= 2;
                }
                *o = _mm_cvtss_f32(halve3(a[0])) + 0.0;
            }
        }

        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
            let mut acc = [_mm256_setzero_ps(); 32];
            let full = a.len() / LANES;
            for c in 0..full {
                f32_chunk(
                    &mut acc,
                    a.as_ptr().add(c * LANES),
                    b.as_ptr().add(c * LANES),
                );
            }
            let rest = a.len() - full * LANES;
            if rest > 0 {
                let mut ba = [-0.0f32; LANES];
                let mut bb = [0f32; LANES];
                ba[..rest].copy_from_slice(&a[full * LANES..]);
                bb[..rest].copy_from_slice(&b[full * LANES..]);
                f32_chunk(&mut acc, ba.as_ptr(), bb.as_ptr());
            }
            tree_contiguous(acc)
        }

        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn sum(t: &[f32]) -> f32 {
            let mut acc = [_mm256_setzero_ps(); 32];
            let full = t.len() / LANES;
            for c in 0..full {
                let p = t.as_ptr().add(c * LANES);
                for j in 0..32 {
                    acc[j] = _mm256_add_ps(acc[j], _mm256_loadu_ps(p.add(8 * j)));
                }
            }
            let rest = t.len() - full * LANES;
            if rest > 0 {
                let mut bt = [0f32; LANES];
                bt[..rest].copy_from_slice(&t[full * LANES..]);
                for j in 0..32 {
                    acc[j] = _mm256_add_ps(acc[j], _mm256_loadu_ps(bt.as_ptr().add(8 * j)));
                }
            }
            tree_contiguous(acc)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            // splitmix64
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        /// Values of mixed signs and magnitudes, with some exact zeros of both signs.
        fn f32(&mut self) -> f32 {
            let r = self.next();
            match r % 16 {
                0 => 0.0,
                1 => -0.0,
                _ => {
                    let m = ((r >> 8) % 20_000) as f32 / 1000.0 - 10.0;
                    let e = ((r >> 40) % 12) as i32 - 6;
                    m * 2f32.powi(e)
                }
            }
        }
        fn bf16(&mut self) -> u16 {
            f32_to_bf16_rne(self.f32())
        }
    }

    fn lengths() -> Vec<usize> {
        let mut v: Vec<usize> = (0..=300).collect();
        v.extend([383, 511, 512, 513, 768, 1000, 2048, 2049, 4097]);
        v
    }

    #[test]
    fn every_path_matches_the_reference_bitwise() {
        let mut rng = Rng(7);
        let kernels = Kernel::all_available();
        assert!(kernels.contains(&Kernel::scalar()));
        for n in lengths() {
            for _rep in 0..3 {
                let a: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
                let b: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
                let w: Vec<u16> = (0..n).map(|_| rng.bf16()).collect();
                let d_ref = dot_f32_reference(&a, &b);
                let s_ref = sum_reference(&a);
                let bf_ref = dot_bf16_reference(&w, &b);
                for &k in &kernels {
                    assert_eq!(
                        k.dot_f32(&a, &b).to_bits(),
                        d_ref.to_bits(),
                        "dot_f32 {k:?} n={n}"
                    );
                    assert_eq!(k.sum(&a).to_bits(), s_ref.to_bits(), "sum {k:?} n={n}");
                    let xp = k.prepare(&b);
                    assert_eq!(
                        k.dot_bf16(&w, &xp).to_bits(),
                        bf_ref.to_bits(),
                        "bf16 {k:?} n={n}"
                    );
                }
            }
        }
    }

    #[test]
    fn rows_entry_point_matches_single_rows() {
        let mut rng = Rng(11);
        for k_len in [1usize, 64, 255, 256, 257, 768] {
            let rows = 5;
            let w: Vec<u16> = (0..rows * k_len).map(|_| rng.bf16()).collect();
            let x: Vec<f32> = (0..k_len).map(|_| rng.f32()).collect();
            for k in Kernel::all_available() {
                let xp = k.prepare(&x);
                let mut out = vec![0.0; rows];
                k.dot_bf16_rows(&w, k_len, &xp, &mut out);
                for r in 0..rows {
                    let want = dot_bf16_reference(&w[r * k_len..(r + 1) * k_len], &x);
                    assert_eq!(out[r].to_bits(), want.to_bits());
                }
            }
        }
    }

    #[test]
    fn products_that_underflow_to_negative_zero_keep_the_references_sign_on_every_path() {
        // Every product below half the smallest subnormal rounds to 0.0 with the product's
        // sign, so a lane can be -0.0 (an fma of a tiny negative product into +0.0). The
        // reference skips the terms past the end; a SIMD path that padded with +0.0 (fma(+0,
        // +0, -0) = +0) gave +0.0 where the reference (and the GPU kernels) give -0.0. Lengths
        // around the chunk boundaries, signs mixed so that results are -0.0, +0.0 and tiny
        // nonzero values; every path, every entry point.
        let mut rng = Rng(29);
        let tiny = |rng: &mut Rng, neg_bias: bool| -> f32 {
            let r = rng.next();
            let v = 2f32.powi(-100 - (r % 20) as i32);
            // every product negative (a -0.0 result: each lane -0.0), or mixed signs
            let neg = neg_bias || r.is_multiple_of(2);
            if neg {
                -v
            } else {
                v
            }
        };
        for n in [
            1usize, 7, 16, 31, 44, 128, 255, 256, 257, 300, 511, 512, 600,
        ] {
            for trial in 0..6 {
                let bias = trial % 2 == 0;
                let w: Vec<u16> = (0..3 * n)
                    .map(|_| f32_to_bf16_rne(tiny(&mut rng, bias)))
                    .collect();
                let x: Vec<f32> = (0..n).map(|_| tiny(&mut rng, false).abs()).collect();
                let xs: Vec<Vec<f32>> = (0..4)
                    .map(|_| x.iter().map(|v| v * 1.5).collect())
                    .collect();
                let wf: Vec<f32> = w[..n].iter().map(|&b| bf16_to_f32(b)).collect();
                for k in Kernel::all_available() {
                    let what = format!("{k:?} n={n} trial {trial}");
                    let p = k.prepare(&x);
                    for r in 0..3 {
                        let row = &w[r * n..(r + 1) * n];
                        let want = dot_bf16_reference(row, &x).to_bits();
                        assert_eq!(k.dot_bf16(row, &p).to_bits(), want, "dot_bf16 {what}");
                        let mut one = [1.0f32];
                        k.dot_bf16_rows(row, n, &p, &mut one);
                        assert_eq!(one[0].to_bits(), want, "dot_bf16_rows {what}");
                    }
                    let preps: Vec<PreparedVec> = xs.iter().map(|v| k.prepare(v)).collect();
                    let refs: Vec<&PreparedVec> = preps.iter().collect();
                    for m in [1usize, 2, 3, 4] {
                        let mut out = vec![1.0f32; 3 * m];
                        let mut pairs = vec![1.0f32; 3 * m];
                        k.dot_bf16_rows_batch(&w, n, &refs[..m], &mut out);
                        k.dot_bf16_rows_batch_pairs(&w, n, &refs[..m], &mut pairs);
                        for r in 0..3 {
                            for (mi, xv) in xs[..m].iter().enumerate() {
                                let want = dot_bf16_reference(&w[r * n..(r + 1) * n], xv).to_bits();
                                assert_eq!(out[r * m + mi].to_bits(), want, "batch {what} m={m}");
                                assert_eq!(pairs[r * m + mi].to_bits(), want, "pairs {what} m={m}");
                            }
                        }
                    }
                    let want = dot_f32_reference(&wf, &x).to_bits();
                    assert_eq!(k.dot_f32(&wf, &x).to_bits(), want, "dot_f32 {what}");
                    // attention's p.v: n positions of rows of 3 values
                    let rows: Vec<f32> = (0..3 * n).map(|i| bf16_to_f32(w[i])).collect();
                    let mut out = vec![1.0f32; 3];
                    let mut scratch = Vec::new();
                    weighted_row_sum(k, &x, &rows, &mut out, &mut scratch);
                    for d in 0..3 {
                        let col: Vec<f32> = (0..n).map(|t| rows[t * 3 + d]).collect();
                        let want = dot_f32_reference(&x, &col).to_bits();
                        assert_eq!(out[d].to_bits(), want, "weighted_row_sum {what} d={d}");
                    }
                }
            }
        }
    }

    #[test]
    fn batch_entry_point_matches_single_rows() {
        // every tile width of the lane-sequential batch (1 to 5 activations per pass, and the
        // tails of 6 to 13), rows of every chunk shape (shorter than a chunk, whole chunks, a
        // partial last chunk), and the pairs arm it replaced: the reference's bits each time
        let mut rng = Rng(13);
        for k_len in [1usize, 40, 256, 300, 768, 2049] {
            for rows in [1usize, 2, 5] {
                for m in [1usize, 2, 3, 4, 5, 6, 7, 11, 13] {
                    let w: Vec<u16> = (0..rows * k_len).map(|_| rng.bf16()).collect();
                    let xs: Vec<Vec<f32>> = (0..m)
                        .map(|_| (0..k_len).map(|_| rng.f32()).collect())
                        .collect();
                    for k in Kernel::all_available() {
                        let preps: Vec<PreparedVec> = xs.iter().map(|x| k.prepare(x)).collect();
                        let refs: Vec<&PreparedVec> = preps.iter().collect();
                        let mut out = vec![0.0; rows * m];
                        let mut pairs = vec![0.0; rows * m];
                        k.dot_bf16_rows_batch(&w, k_len, &refs, &mut out);
                        k.dot_bf16_rows_batch_pairs(&w, k_len, &refs, &mut pairs);
                        for r in 0..rows {
                            for (mi, x) in xs.iter().enumerate() {
                                let want = dot_bf16_reference(&w[r * k_len..(r + 1) * k_len], x);
                                let what = format!("{k:?} k={k_len} rows={rows} m={m} ({r}, {mi})");
                                assert_eq!(out[r * m + mi].to_bits(), want.to_bits(), "{what}");
                                assert_eq!(pairs[r * m + mi].to_bits(), want.to_bits(), "{what}");
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn pruning_rule_reproduces_the_full_tree() {
        let mut rng = Rng(3);
        for n in 0..256 {
            for _ in 0..20 {
                let a: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
                let b: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
                assert_eq!(
                    dot_f32_pruned(&a, &b).to_bits(),
                    dot_f32_reference(&a, &b).to_bits()
                );
            }
            // all terms -0.0: the pruned tree would give -0.0 without its final +0.0
            let a = vec![-0.0f32; n];
            let b = vec![1.0f32; n];
            assert_eq!(dot_f32_pruned(&a, &b).to_bits(), 0.0f32.to_bits());
            assert_eq!(dot_f32_reference(&a, &b).to_bits(), 0.0f32.to_bits());
        }
    }

    #[test]
    fn negative_zero_inputs_give_positive_zero_on_every_path() {
        for n in [1usize, 7, 255, 256, 257, 600] {
            let neg = vec![-0.0f32; n];
            let one = vec![1.0f32; n];
            let wneg = vec![0x8000u16; n];
            for k in Kernel::all_available() {
                assert_eq!(k.dot_f32(&neg, &one).to_bits(), 0, "{k:?} {n}");
                assert_eq!(k.sum(&neg).to_bits(), 0, "{k:?} {n}");
                assert_eq!(
                    k.dot_bf16(&wneg, &k.prepare(&one)).to_bits(),
                    0,
                    "{k:?} {n}"
                );
            }
        }
    }

    #[test]
    fn order_is_the_canonical_one_not_sequential() {
        // 1e8 + 1 - 1e8 with terms in lanes that the tree combines late: a check that the
        // implementation is not a plain sequential sum (which would give a different answer).
        let mut t = vec![0.0f32; 300];
        t[0] = 1.0e8;
        t[1] = 1.0;
        t[256] = -1.0e8;
        // lanes: a[0] = 1e8 + -1e8 = 0, a[1] = 1 -> result 1; sequential gives 0
        for k in Kernel::all_available() {
            assert_eq!(k.sum(&t), 1.0);
        }
        let seq: f32 = t.iter().sum();
        assert_eq!(seq, 0.0);
    }

    #[test]
    fn dot_f32_rows_equals_one_dot_per_row() {
        // the widths with a pruned tree (64, 128), others, and underflowing products whose
        // lanes are -0.0 (the pruned tree's +0.0 must match the full tree's)
        let mut rng = Rng(31);
        for d in [1usize, 24, 63, 64, 65, 128, 200, 256, 300] {
            for underflow in [false, true] {
                let x: Vec<f32> = (0..d)
                    .map(|_| if underflow { 2f32.powi(-90) } else { rng.f32() })
                    .collect();
                let rows: Vec<f32> = (0..9 * d)
                    .map(|_| {
                        if underflow {
                            -(2f32.powi(-90))
                        } else {
                            rng.f32()
                        }
                    })
                    .collect();
                for k in Kernel::all_available() {
                    let mut out = vec![1.0f32; 9];
                    k.dot_f32_rows(&x, &rows, &mut out);
                    for i in 0..9 {
                        let want = dot_f32_reference(&x, &rows[i * d..(i + 1) * d]);
                        assert_eq!(out[i].to_bits(), want.to_bits(), "{k:?} d={d} row {i}");
                    }
                }
            }
        }
    }

    #[test]
    fn weighted_row_sum_is_a_canonical_dot_per_column() {
        let mut rng = Rng(5);
        // d = 24: the general path; 64 and 128: the register-sized lanes
        for (t, d) in [1usize, 3, 100, 255, 256, 257, 600]
            .into_iter()
            .flat_map(|t| [(t, 24usize), (t, 64), (t, 128)])
        {
            let p: Vec<f32> = (0..t).map(|_| rng.f32()).collect();
            let rows: Vec<f32> = (0..t * d).map(|_| rng.f32()).collect();
            for k in Kernel::all_available() {
                let mut out = vec![0.0; d];
                let mut scratch = Vec::new();
                weighted_row_sum(k, &p, &rows, &mut out, &mut scratch);
                for c in 0..d {
                    let col: Vec<f32> = (0..t).map(|i| rows[i * d + c]).collect();
                    assert_eq!(out[c].to_bits(), dot_f32_reference(&p, &col).to_bits());
                }
            }
        }
    }

    #[test]
    fn simd_paths_parse_and_report_availability() {
        for p in [SimdPath::Scalar, SimdPath::Avx2, SimdPath::Avx512] {
            assert_eq!(SimdPath::parse(p.name()), Some(p));
            match Kernel::new(p) {
                Ok(k) => assert_eq!(k.path(), p),
                Err(e) => assert_eq!(e, KernelError::Unavailable(p.name())),
            }
        }
        assert_eq!(SimdPath::parse(" AVX-512 "), Some(SimdPath::Avx512));
        assert_eq!(SimdPath::parse("neon"), None);
        assert!(Kernel::all_available().contains(&Kernel::best()));
    }

    #[test]
    fn bf16_rounding_is_to_nearest_even() {
        assert_eq!(f32_to_bf16_rne(1.0), 0x3F80);
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0x3F80_8000)), 0x3F80); // tie -> even
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0x3F81_8000)), 0x3F82); // tie -> even
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0x3F80_8001)), 0x3F81);
        assert_eq!(bf16_to_f32(0x3F80), 1.0);
    }
}
