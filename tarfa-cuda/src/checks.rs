//! Each kernel against the CPU's reference functions on random inputs (the llm.c habit: a kernel
//! is validated against the readable reference before the whole forward is). Comparisons are bit
//! for bit; the only latitude is a NaN's payload in the elementwise function probes (both sides
//! NaN counts as equal there: the contract does not fix NaN payloads).

use super::device::{DevBuf, Gpu};
use super::model::KV_BLOCK;
use super::ops::{self, AttnShape, DType, DevMat, RouteOut};
use super::{CudaError, CudaOptions, KernelCheck};
use tarfa_core::numerics::detmath::{exp, rsqrt, sigmoid, silu, softplus};
use tarfa_core::numerics::reduce::{
    dot_bf16_reference, dot_f32_reference, sum_reference, weighted_row_sum,
};
use tarfa_core::numerics::{bf16_to_f32, f32_to_bf16_rne, Kernel, RopeTable};

/// splitmix64, with values of mixed signs and magnitudes and some exact zeros of both signs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
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
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
    fn vec_bf16(&mut self, n: usize) -> Vec<u16> {
        (0..n).map(|_| self.bf16()).collect()
    }
}

struct Check {
    name: String,
    compared: u64,
    mismatches: u64,
    first: Option<String>,
}

impl Check {
    fn new(name: impl Into<String>) -> Check {
        Check {
            name: name.into(),
            compared: 0,
            mismatches: 0,
            first: None,
        }
    }

    fn eq(&mut self, what: impl FnOnce() -> String, want: f32, got: f32) {
        self.compared += 1;
        if want.to_bits() != got.to_bits() {
            self.mismatches += 1;
            if self.first.is_none() {
                self.first = Some(format!(
                    "{}: CPU {want:e} (0x{:08x}) GPU {got:e} (0x{:08x})",
                    what(),
                    want.to_bits(),
                    got.to_bits()
                ));
            }
        }
    }

    fn eq_u32(&mut self, what: impl FnOnce() -> String, want: u32, got: u32) {
        self.compared += 1;
        if want != got {
            self.mismatches += 1;
            if self.first.is_none() {
                self.first = Some(format!("{}: CPU {want} GPU {got}", what()));
            }
        }
    }

    fn done(self) -> KernelCheck {
        KernelCheck {
            name: self.name,
            compared: self.compared,
            mismatches: self.mismatches,
            first_mismatch: self.first,
        }
    }
}

fn read_f32(gpu: &Gpu, b: &DevBuf, n: usize) -> Result<Vec<f32>, CudaError> {
    gpu.read(b.ptr(), n, "a kernel check's output")
}

/// One layer's keys or values as the kernels read a cache (kernels/common.cuh `kv_row`): the
/// host's `[hkv][cap][w]` rows in blocks of [`KV_BLOCK`] positions (zeros past `cap`), the
/// blocks allocated last first so that only the table joins them, and the table.
struct PagedKv {
    table: DevBuf,
    blocks: Vec<DevBuf>,
    hkv: usize,
    cap: usize,
    w: usize,
}

impl PagedKv {
    fn upload(
        gpu: &Gpu,
        rows: &[f32],
        hkv: usize,
        cap: usize,
        w: usize,
    ) -> Result<PagedKv, CudaError> {
        assert_eq!(rows.len(), hkv * cap * w, "[hkv][cap][w] rows");
        let nb = cap.div_ceil(KV_BLOCK);
        let mut blocks = Vec::with_capacity(nb);
        for b in (0..nb).rev() {
            let mut data = vec![0.0f32; hkv * KV_BLOCK * w];
            for h in 0..hkv {
                for j in 0..KV_BLOCK.min(cap - b * KV_BLOCK) {
                    let from = (h * cap + b * KV_BLOCK + j) * w;
                    let to = (h * KV_BLOCK + j) * w;
                    data[to..to + w].copy_from_slice(&rows[from..from + w]);
                }
            }
            blocks.push(gpu.upload(&data, "a KV cache block")?);
        }
        blocks.reverse();
        let at: Vec<u64> = blocks.iter().map(DevBuf::ptr).collect();
        let table = gpu.upload(&at, "a KV block table")?;
        Ok(PagedKv {
            table,
            blocks,
            hkv,
            cap,
            w,
        })
    }

    /// The table's address: what a kernel takes for the cache.
    fn ptr(&self) -> u64 {
        self.table.ptr()
    }

    /// The rows back, `[hkv][cap][w]`.
    fn read(&self, gpu: &Gpu) -> Result<Vec<f32>, CudaError> {
        let (hkv, cap, w) = (self.hkv, self.cap, self.w);
        let mut rows = vec![0.0f32; hkv * cap * w];
        for (b, blk) in self.blocks.iter().enumerate() {
            let data = read_f32(gpu, blk, hkv * KV_BLOCK * w)?;
            for h in 0..hkv {
                for j in 0..KV_BLOCK.min(cap - b * KV_BLOCK) {
                    let to = (h * cap + b * KV_BLOCK + j) * w;
                    let from = (h * KV_BLOCK + j) * w;
                    rows[to..to + w].copy_from_slice(&data[from..from + w]);
                }
            }
        }
        Ok(rows)
    }
}

/// Runs every kernel check on the GPU; each result says how many values were compared and
/// whether all were bit-identical to the CPU reference.
pub fn kernel_checks(opts: &CudaOptions) -> Result<Vec<KernelCheck>, CudaError> {
    kernel_checks_on(&Gpu::open(opts)?)
}

pub(crate) fn kernel_checks_on(gpu: &Gpu) -> Result<Vec<KernelCheck>, CudaError> {
    let mut out = Vec::new();
    out.extend(check_functions(gpu)?);
    out.push(check_matvec(gpu, DType::Bf16)?);
    out.push(check_matvec(gpu, DType::F32)?);
    out.push(check_rmsnorm(gpu)?);
    out.push(check_rope(gpu)?);
    out.push(check_attention(gpu)?);
    out.push(check_router(gpu)?);
    out.push(check_grouped_router(gpu)?);
    out.push(check_router_by_logit(gpu)?);
    out.push(check_experts(gpu)?);
    out.push(check_many(gpu)?);
    out.push(check_prefill_attention(gpu)?);
    out.push(check_linear(gpu)?);
    out.push(check_gated_attention(gpu)?);
    gpu.sync("the kernel checks")?;
    Ok(out)
}

fn check_functions(gpu: &Gpu) -> Result<Vec<KernelCheck>, CudaError> {
    let mut x: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        88.9,
        89.0,
        -103.9,
        -104.0,
        -104.1,
        1e-45,
        -1e-45,
        1e-38,
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
        0.5,
        -0.5,
        87.33655,
        -87.33655,
        20.0,
        -20.0,
    ];
    // a dense sweep over the interesting range, then random bit patterns
    let sweep = 1 << 21;
    for i in 0..sweep {
        x.push(-110.0 + 205.0 * i as f32 / sweep as f32);
    }
    let mut rng = Rng(0x5EED);
    for _ in 0..(1 << 21) {
        x.push(f32::from_bits(rng.next() as u32));
    }
    let n = x.len();
    let xb = gpu.upload(&x, "probe inputs")?;
    let yb = gpu.alloc(n * 4, "probe outputs")?;
    let mut checks = Vec::new();
    type Reference = fn(f32) -> f32;
    let fns: [(&'static str, Reference); 5] = [
        ("probe_exp", exp),
        ("probe_silu", silu),
        ("probe_sigmoid", sigmoid),
        ("probe_rsqrt", rsqrt),
        ("probe_softplus", softplus),
    ];
    for (name, f) in fns {
        ops::probe(gpu, name, xb.ptr(), yb.ptr(), n)?;
        let y = read_f32(gpu, &yb, n)?;
        let mut c = Check::new(format!("{} (detmath)", &name[6..]));
        for (i, (&xi, &yi)) in x.iter().zip(&y).enumerate() {
            let want = f(xi);
            if want.is_nan() && yi.is_nan() {
                c.compared += 1;
                continue;
            }
            c.eq(
                || format!("x[{i}] = {xi:e} (0x{:08x})", xi.to_bits()),
                want,
                yi,
            );
        }
        checks.push(c.done());
    }
    Ok(checks)
}

fn lengths() -> Vec<usize> {
    vec![
        1, 2, 3, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 40, 63, 64, 65, 72, 127, 128, 129, 200, 255,
        256, 257, 300, 383, 511, 512, 513, 768, 1000, 2048, 2049, 4096, 4097,
    ]
}

fn upload_mat(
    gpu: &Gpu,
    rows: usize,
    cols: usize,
    dtype: DType,
    rng: &mut Rng,
) -> Result<(DevMat, Vec<f32>), CudaError> {
    Ok(match dtype {
        DType::Bf16 => {
            let w = rng.vec_bf16(rows * cols);
            let wide = w.iter().map(|&b| bf16_to_f32(b)).collect();
            (
                DevMat::own(gpu.upload(&w, "a check matrix")?, rows, cols, dtype),
                wide,
            )
        }
        DType::F32 => {
            let w = rng.vec(rows * cols);
            (
                DevMat::own(gpu.upload(&w, "a check matrix")?, rows, cols, dtype),
                w,
            )
        }
    })
}

fn check_matvec(gpu: &Gpu, dtype: DType) -> Result<KernelCheck, CudaError> {
    let mut c = Check::new(match dtype {
        DType::Bf16 => "matvec_bf16 (+bias, residual)",
        DType::F32 => "matvec_f32 (+bias, residual)",
    });
    let mut rng = Rng(11 + dtype.size() as u64);
    for n in lengths() {
        let (rows, tokens) = (11usize, 3usize);
        let (w, wide) = upload_mat(gpu, rows, n, dtype, &mut rng)?;
        let x = rng.vec(tokens * n);
        let bias = rng.vec(rows);
        let out0 = rng.vec(tokens * rows);
        let xb = gpu.upload(&x, "a check activation")?;
        let bb = gpu.upload(&bias, "a check bias")?;
        for (mode, use_bias) in [(false, false), (true, true)] {
            let ob = gpu.upload(&out0, "a check output")?;
            ops::matvec(
                gpu,
                &w,
                xb.ptr(),
                n,
                if use_bias { bb.ptr() } else { 0 },
                ob.ptr(),
                rows,
                tokens,
                mode,
            )?;
            let got = read_f32(gpu, &ob, tokens * rows)?;
            for t in 0..tokens {
                for r in 0..rows {
                    let row = &wide[r * n..(r + 1) * n];
                    let xs = &x[t * n..(t + 1) * n];
                    let mut y = match dtype {
                        DType::Bf16 => {
                            // the exact widening's upper half is the BF16 itself
                            let bits: Vec<u16> =
                                row.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
                            dot_bf16_reference(&bits, xs)
                        }
                        DType::F32 => dot_f32_reference(row, xs),
                    };
                    if use_bias {
                        y += bias[r];
                    }
                    let want = if mode { out0[t * rows + r] + y } else { y };
                    c.eq(
                        || format!("n={n} token {t} row {r} residual={mode}"),
                        want,
                        got[t * rows + r],
                    );
                }
            }
        }
    }
    Ok(c.done())
}

fn rms_ref(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ss = dot_f32_reference(x, x);
    let m = ss / x.len() as f32;
    let r = rsqrt(m + eps);
    x.iter().zip(w).map(|(&xi, &wi)| wi * (xi * r)).collect()
}

fn check_rmsnorm(gpu: &Gpu) -> Result<KernelCheck, CudaError> {
    let mut c = Check::new("rmsnorm");
    let mut rng = Rng(21);
    let eps = 1e-6f32;
    for n in [8usize, 16, 24, 40, 72, 100, 128, 257, 2048, 4096] {
        let count = 9;
        let x = rng.vec(count * n);
        let w = rng.vec(n);
        let xb = gpu.upload(&x, "a check input")?;
        let wb = gpu.upload(&w, "a check weight")?;
        let yb = gpu.alloc(count * n * 4, "a check output")?;
        ops::rmsnorm(gpu, xb.ptr(), n, yb.ptr(), n, wb.ptr(), n, count, eps)?;
        let got = read_f32(gpu, &yb, count * n)?;
        // in place as well
        ops::rmsnorm(gpu, xb.ptr(), n, xb.ptr(), n, wb.ptr(), n, count, eps)?;
        let got_in_place = read_f32(gpu, &xb, count * n)?;
        for s in 0..count {
            let want = rms_ref(&x[s * n..(s + 1) * n], &w, eps);
            for i in 0..n {
                c.eq(
                    || format!("n={n} segment {s} element {i}"),
                    want[i],
                    got[s * n + i],
                );
                c.eq(
                    || format!("in place n={n} segment {s} element {i}"),
                    want[i],
                    got_in_place[s * n + i],
                );
            }
        }
    }
    Ok(c.done())
}

fn check_rope(gpu: &Gpu) -> Result<KernelCheck, CudaError> {
    let mut c = Check::new("rope_append_kv (+ Llama 4's pairs, L2 norm, NoPE temperature)");
    let mut rng = Rng(31);
    // rd < d: partial rotary (GLM-4.5's partial_rotary_factor 0.5), the rest passed through;
    // form 1: Llama 4's pairs then the L2 norm; form 2: a NoPE layer with per-token q scales
    for (hq, hkv, d, rd, pos0, t, form) in [
        (4usize, 2usize, 32usize, 32usize, 0usize, 5usize, 0u8),
        (3, 1, 24, 24, 7, 2, 0),
        (8, 4, 128, 128, 300, 3, 0),
        (4, 2, 32, 16, 3, 4, 0),
        (2, 1, 128, 64, 100, 2, 0),
        (4, 2, 32, 32, 5, 4, 1),
        (8, 2, 128, 128, 70, 3, 1),
        (4, 2, 64, 64, 9, 3, 2),
    ] {
        let cap = pos0 + t + 3;
        let mut rope = RopeTable::new(1_000_000.0, rd).map_err(tarfa_core::RunError::from)?;
        rope.ensure(cap).map_err(tarfa_core::RunError::from)?;
        let half = rd / 2;
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for p in 0..cap {
            let (cc, ss) = rope.row(p);
            cos.extend_from_slice(cc);
            sin.extend_from_slice(ss);
        }
        assert_eq!(cos.len(), cap * half);
        let q = rng.vec(t * hq * d);
        let k = rng.vec(t * hkv * d);
        let v = rng.vec(t * hkv * d);
        let qb = gpu.upload(&q, "q")?;
        let kb = gpu.upload(&k, "k")?;
        let vb = gpu.upload(&v, "v")?;
        let cb = gpu.upload(&cos, "cos")?;
        let sb = gpu.upload(&sin, "sin")?;
        let kc = PagedKv::upload(gpu, &vec![0.0; hkv * cap * d], hkv, cap, d)?;
        let vc = PagedKv::upload(gpu, &vec![0.0; hkv * cap * d], hkv, cap, d)?;
        let eps = 1e-5f32;
        let qs: Vec<f32> = (0..t).map(|_| 1.0 + rng.f32().abs()).collect();
        let qsb = gpu.upload(&qs, "q scales")?;
        let rope_form = ops::RopeForm {
            pairs: form == 1,
            none: form == 2,
            l2: (form == 1).then_some(eps),
            qscale: if form == 2 { qsb.ptr() } else { 0 },
        };
        // tarfa-cpu's gqa_block for this form: rotation, L2 norm, temperature
        let prepare = |pos: usize, x: &mut [f32], query: bool, ti: usize| match form {
            0 => rope.apply(pos, &mut x[..rd]),
            1 => {
                rope.apply_pairs(pos, &mut x[..rd]);
                let r = rsqrt(dot_f32_reference(x, x) / d as f32 + eps);
                x.iter_mut().for_each(|v| *v *= r);
            }
            _ => {
                if query {
                    x.iter_mut().for_each(|v| *v *= qs[ti]);
                }
            }
        };
        let shape = AttnShape {
            hq,
            hkv,
            d,
            rd,
            cap,
            pos0,
            tokens: t,
        };
        ops::rope_append_kv(
            gpu,
            shape,
            qb.ptr(),
            kb.ptr(),
            vb.ptr(),
            cb.ptr(),
            sb.ptr(),
            kc.ptr(),
            vc.ptr(),
            rope_form,
        )?;
        let gq = read_f32(gpu, &qb, t * hq * d)?;
        let gk = kc.read(gpu)?;
        let gv = vc.read(gpu)?;
        for ti in 0..t {
            let pos = pos0 + ti;
            for h in 0..hq {
                let mut want = q[(ti * hq + h) * d..(ti * hq + h + 1) * d].to_vec();
                prepare(pos, &mut want, true, ti);
                for i in 0..d {
                    c.eq(
                        || format!("q d={d} rd={rd} form {form} token {ti} head {h} [{i}]"),
                        want[i],
                        gq[(ti * hq + h) * d + i],
                    );
                }
            }
            for h in 0..hkv {
                let mut want = k[(ti * hkv + h) * d..(ti * hkv + h + 1) * d].to_vec();
                prepare(pos, &mut want, false, ti);
                for i in 0..d {
                    c.eq(
                        || format!("k d={d} rd={rd} form {form} token {ti} head {h} [{i}]"),
                        want[i],
                        gk[(h * cap + pos) * d + i],
                    );
                    c.eq(
                        || format!("v d={d} token {ti} head {h} [{i}]"),
                        v[(ti * hkv + h) * d + i],
                        gv[(h * cap + pos) * d + i],
                    );
                }
            }
        }
    }
    Ok(c.done())
}

fn softmax_ref(l: &[f32]) -> Vec<f32> {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = l.iter().map(|&x| exp(x - m)).collect();
    let s = sum_reference(&e);
    e.iter().map(|&x| x / s).collect()
}

fn check_attention(gpu: &Gpu) -> Result<KernelCheck, CudaError> {
    let mut c = Check::new("attention (windows, chunks, sinks)");
    let mut rng = Rng(41);
    // (.., window, chunk, sinks): gpt-oss's sliding layers with sinks, Llama 4's chunks
    for (hq, hkv, d, pos0, t, window, chunk, sinks) in [
        (
            4usize, 2usize, 32usize, 0usize, 6usize, 0usize, 0usize, false,
        ),
        (3, 1, 24, 5, 2, 0, 0, false),
        (8, 2, 128, 250, 9, 0, 0, false),
        (2, 2, 16, 600, 1, 0, 0, false),
        (4, 2, 64, 0, 12, 0, 0, true),
        (4, 2, 64, 3, 9, 5, 0, true),
        (8, 2, 64, 290, 7, 128, 0, true),
        (4, 1, 32, 14, 6, 0, 16, false),
        (4, 4, 32, 300, 3, 0, 256, false),
    ] {
        let cap = pos0 + t + 5;
        let n_max = pos0 + t;
        // small values keep the softmax away from one-hot, so that every term matters
        let q: Vec<f32> = rng.vec(t * hq * d).iter().map(|v| v * 0.05).collect();
        let kc: Vec<f32> = rng.vec(hkv * cap * d).iter().map(|v| v * 0.05).collect();
        let vc = rng.vec(hkv * cap * d);
        let qb = gpu.upload(&q, "q")?;
        let kb = PagedKv::upload(gpu, &kc, hkv, cap, d)?;
        let vb = PagedKv::upload(gpu, &vc, hkv, cap, d)?;
        let sink_logits: Vec<f32> = rng.vec(hq).iter().map(|v| v * 2.0).collect();
        let sink_b = gpu.upload(&sink_logits, "sinks")?;
        let mask = ops::AttnMask {
            sinks: if sinks { sink_b.ptr() } else { 0 },
            window,
            chunk,
        };
        let sc = gpu.alloc(t * hq * mask.stride(n_max) * 4, "scores")?;
        let ob = gpu.alloc(t * hq * d * 4, "o")?;
        let scale = (1.0f64 / (d as f64).sqrt()) as f32;
        let shape = AttnShape {
            hq,
            hkv,
            d,
            rd: d,
            cap,
            pos0,
            tokens: t,
        };
        ops::attention(
            gpu,
            shape,
            qb.ptr(),
            kb.ptr(),
            vb.ptr(),
            scale,
            sc.ptr(),
            mask.stride(n_max),
            ob.ptr(),
            mask,
        )?;
        let got = read_f32(gpu, &ob, t * hq * d)?;
        let group = hq / hkv;
        let mut scratch = Vec::new();
        for ti in 0..t {
            for h in 0..hq {
                let kvh = h / group;
                let pos = pos0 + ti;
                let n = pos + 1;
                // tarfa-cpu's gqa_block: the window's last w, the chunk of pos, then the sink
                let start = if window > 0 {
                    n.saturating_sub(window)
                } else {
                    0
                };
                let start = pos
                    .checked_div(chunk)
                    .map_or(start, |c| start.max(c * chunk));
                let qv = &q[(ti * hq + h) * d..(ti * hq + h + 1) * d];
                let keys = &kc[kvh * cap * d..];
                let vals = &vc[kvh * cap * d + start * d..kvh * cap * d + n * d];
                let mut s: Vec<f32> = (start..n)
                    .map(|j| dot_f32_reference(qv, &keys[j * d..(j + 1) * d]) * scale)
                    .collect();
                if sinks {
                    s.push(sink_logits[h]);
                }
                let mut p = softmax_ref(&s);
                p.truncate(n - start);
                let mut o = vec![0.0f32; d];
                weighted_row_sum(Kernel::scalar(), &p, vals, &mut o, &mut scratch);
                for i in 0..d {
                    c.eq(
                        || {
                            format!(
                                "d={d} pos0={pos0} window={window} chunk={chunk} sinks={sinks} \
                                 token {ti} head {h} [{i}]"
                            )
                        },
                        o[i],
                        got[(ti * hq + h) * d + i],
                    );
                }
            }
        }
    }
    Ok(c.done())
}

fn check_router(gpu: &Gpu) -> Result<KernelCheck, CudaError> {
    let mut c = Check::new("route_topk (softmax, top-k, ties)");
    let mut rng = Rng(51);
    for (e, k, renorm, ties) in [
        (8usize, 2usize, true, false),
        (12, 3, false, false),
        (32, 8, true, false),
        (32, 8, true, true),
        (128, 8, true, false),
        (128, 8, false, true),
        (60, 4, true, true),
        (8, 8, true, false),
        (300, 1, false, false),
    ] {
        let t = 7;
        let logits: Vec<f32> = (0..t * e)
            .map(|_| {
                let v = rng.f32();
                if ties {
                    (v * 0.25).round() // few distinct values: exact ties in p
                } else {
                    v
                }
            })
            .collect();
        let lb = gpu.upload(&logits, "router logits")?;
        let ids = gpu.alloc(t * k * 4, "ids")?;
        let probs = gpu.alloc(t * k * 4, "probs")?;
        let weights = gpu.alloc(t * k * 4, "weights")?;
        let by_id = gpu.alloc(t * k * 4, "by_id")?;
        let kth = gpu.alloc(t * 4, "kth")?;
        let next = gpu.alloc(t * 4, "next")?;
        let out = RouteOut {
            ids: ids.ptr(),
            probs: probs.ptr(),
            weights: weights.ptr(),
            by_id: by_id.ptr(),
            kth: kth.ptr(),
            next: next.ptr(),
        };
        ops::route_topk(gpu, lb.ptr(), e, k, renorm, t, out)?;
        let g_ids: Vec<u32> = gpu.read(ids.ptr(), t * k, "ids")?;
        let g_probs = read_f32(gpu, &probs, t * k)?;
        let g_w = read_f32(gpu, &weights, t * k)?;
        let g_by: Vec<u32> = gpu.read(by_id.ptr(), t * k, "by_id")?;
        let g_kth = read_f32(gpu, &kth, t)?;
        let g_next = read_f32(gpu, &next, t)?;
        for ti in 0..t {
            let p = softmax_ref(&logits[ti * e..(ti + 1) * e]);
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            let sel = &order[..k];
            let sp: Vec<f32> = sel.iter().map(|&i| p[i]).collect();
            let w: Vec<f32> = if renorm {
                let s = sum_reference(&sp);
                sp.iter().map(|&x| x / s).collect()
            } else {
                sp.clone()
            };
            let mut asc: Vec<usize> = (0..k).collect();
            asc.sort_by_key(|&j| sel[j]);
            let tag = |what: &str, j: usize| {
                format!("E={e} k={k} renorm={renorm} ties={ties} token {ti} {what} {j}")
            };
            for j in 0..k {
                c.eq_u32(|| tag("id", j), sel[j] as u32, g_ids[ti * k + j]);
                c.eq(|| tag("prob", j), sp[j], g_probs[ti * k + j]);
                c.eq(|| tag("weight", j), w[j], g_w[ti * k + j]);
                c.eq_u32(|| tag("by_id", j), asc[j] as u32, g_by[ti * k + j]);
            }
            c.eq(|| tag("kth", 0), p[order[k - 1]], g_kth[ti]);
            if e > k {
                c.eq(|| tag("next", 0), p[order[k]], g_next[ti]);
            }
        }
    }
    Ok(c.done())
}

/// One token's route by the group-limited rules (moe.cu `route_grouped`, cpu/forward.rs
/// `route_sigmoid_grouped` / `route_softmax_grouped`): sigmoid scores plus `bias` with groups
/// scored by their two largest choice values, or (no bias) softmax with groups scored by their
/// largest; the `topk_group` best groups kept, the rest competing with +0.0; weights
/// renormalised (sigmoid, `renorm`) over canonical_sum + 1e-20, times `scale`.
pub(crate) struct GroupedChoice {
    pub(crate) ids: Vec<u32>,
    pub(crate) probs: Vec<f32>,
    pub(crate) weights: Vec<f32>,
    pub(crate) by_id: Vec<u32>,
    pub(crate) kth: f32,
    pub(crate) next: f32,
}

pub(crate) fn grouped_route_reference(
    l: &[f32],
    bias: Option<&[f32]>,
    k: usize,
    (n_group, topk_group): (usize, usize),
    renorm: bool,
    scale: f32,
) -> GroupedChoice {
    let e = l.len();
    let s: Vec<f32> = match bias {
        Some(_) => l.iter().map(|&x| sigmoid(x)).collect(),
        None => softmax_ref(l),
    };
    let mut c: Vec<f32> = match bias {
        Some(b) => s.iter().zip(b).map(|(&x, &y)| x + y).collect(),
        None => s.clone(),
    };
    let desc = |v: &[f32], x: usize, y: usize| v[y].total_cmp(&v[x]).then(x.cmp(&y));
    let size = e / n_group;
    let gs: Vec<f32> = c
        .chunks_exact(size)
        .map(|g| match bias {
            Some(_) => {
                let mut o: Vec<usize> = (0..size).collect();
                o.sort_by(|&x, &y| desc(g, x, y));
                g[o[0]] + g[o[1]]
            }
            None => g.iter().copied().fold(f32::NEG_INFINITY, f32::max),
        })
        .collect();
    let mut go: Vec<usize> = (0..n_group).collect();
    go.sort_by(|&x, &y| desc(&gs, x, y));
    for (i, ci) in c.iter_mut().enumerate() {
        if !go[..topk_group].contains(&(i / size)) {
            *ci = 0.0;
        }
    }
    let mut order: Vec<usize> = (0..e).collect();
    order.sort_by(|&x, &y| desc(&c, x, y));
    let sel = &order[..k];
    let sp: Vec<f32> = sel.iter().map(|&i| s[i]).collect();
    let weights: Vec<f32> = if bias.is_some() && renorm {
        let d = sum_reference(&sp) + 1e-20;
        sp.iter().map(|&x| (x / d) * scale).collect()
    } else {
        sp.iter().map(|&x| x * scale).collect()
    };
    let mut by_id: Vec<u32> = (0..k as u32).collect();
    by_id.sort_by_key(|&j| sel[j as usize]);
    GroupedChoice {
        ids: sel.iter().map(|&i| i as u32).collect(),
        probs: sp,
        weights,
        by_id,
        kth: c[order[k - 1]],
        next: order.get(k).map_or(f32::NAN, |&i| c[i]),
    }
}

fn check_grouped_router(gpu: &Gpu) -> Result<KernelCheck, CudaError> {
    let mut c = Check::new("route_grouped (sigmoid + bias / softmax, groups, ties)");
    let mut rng = Rng(57);
    // (E, k, n_group, topk_group, sigmoid, renorm, ties): DeepSeek-V3's 256/8/8/4, V2's
    // group-limited and greedy (one group) forms, GLM-4.5-Air's 128/8/1/1
    for (e, k, ng, kg, sig, renorm, ties) in [
        (256usize, 8usize, 8usize, 4usize, true, true, false),
        (256, 8, 8, 4, true, true, true),
        (64, 6, 8, 3, true, false, false),
        (128, 8, 1, 1, true, true, false),
        (16, 4, 4, 2, true, true, true),
        (160, 6, 8, 3, false, false, false),
        (64, 6, 1, 1, false, false, true),
        (32, 4, 4, 1, false, false, false),
    ] {
        let t = 5;
        let logits: Vec<f32> = (0..t * e)
            .map(|_| {
                let v = rng.f32();
                if ties {
                    (v * 0.25).round() // few distinct values: exact ties in the scores
                } else {
                    v
                }
            })
            .collect();
        // a correction bias of the size real checkpoints carry, with exact zeros
        let bias: Vec<f32> = (0..e).map(|_| rng.f32() * 0.01).collect();
        let lb = gpu.upload(&logits, "router logits")?;
        let bb = gpu.upload(&bias, "router bias")?;
        let bufs: Vec<DevBuf> = [t * k, t * k, t * k, t * k, t, t]
            .iter()
            .map(|&n| gpu.alloc(n * 4, "route output"))
            .collect::<Result<_, _>>()?;
        let out = RouteOut {
            ids: bufs[0].ptr(),
            probs: bufs[1].ptr(),
            weights: bufs[2].ptr(),
            by_id: bufs[3].ptr(),
            kth: bufs[4].ptr(),
            next: bufs[5].ptr(),
        };
        let scale = 2.5f32;
        let g = ops::GroupedRoute {
            bias: sig.then(|| bb.ptr()),
            n_group: ng,
            topk_group: kg,
            renorm,
            scale,
        };
        ops::route_grouped(gpu, lb.ptr(), e, k, &g, t, out)?;
        let g_ids: Vec<u32> = gpu.read(out.ids, t * k, "ids")?;
        let g_probs = read_f32(gpu, &bufs[1], t * k)?;
        let g_w = read_f32(gpu, &bufs[2], t * k)?;
        let g_by: Vec<u32> = gpu.read(out.by_id, t * k, "by_id")?;
        let g_kth = read_f32(gpu, &bufs[4], t)?;
        let g_next = read_f32(gpu, &bufs[5], t)?;
        for ti in 0..t {
            let r = grouped_route_reference(
                &logits[ti * e..(ti + 1) * e],
                sig.then_some(&bias[..]),
                k,
                (ng, kg),
                renorm,
                scale,
            );
            let tag = |what: &str, j: usize| {
                format!(
                    "E={e} k={k} groups {ng}/{kg} sigmoid={sig} ties={ties} token {ti} {what} {j}"
                )
            };
            for j in 0..k {
                c.eq_u32(|| tag("id", j), r.ids[j], g_ids[ti * k + j]);
                c.eq(|| tag("prob", j), r.probs[j], g_probs[ti * k + j]);
                c.eq(|| tag("weight", j), r.weights[j], g_w[ti * k + j]);
                c.eq_u32(|| tag("by_id", j), r.by_id[j], g_by[ti * k + j]);
            }
            c.eq(|| tag("kth", 0), r.kth, g_kth[ti]);
            if e > k {
                c.eq(|| tag("next", 0), r.next, g_next[ti]);
            }
        }
    }
    Ok(c.done())
}

/// The routers that choose by logit (tarfa-cpu's `route_topk_then_softmax`,
/// `route_sigmoid_scales_input`): the top-k of the logits (descending total order, lower id
/// first), weights the softmax over the chosen (gpt-oss) or each one's sigmoid (Llama 4).
pub(crate) fn by_logit_reference(l: &[f32], k: usize, by_sigmoid: bool) -> GroupedChoice {
    let mut order: Vec<usize> = (0..l.len()).collect();
    order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
    let sel = &order[..k];
    let chosen: Vec<f32> = sel.iter().map(|&i| l[i]).collect();
    let w = if by_sigmoid {
        chosen.iter().map(|&x| sigmoid(x)).collect()
    } else {
        softmax_ref(&chosen)
    };
    let mut by_id: Vec<u32> = (0..k as u32).collect();
    by_id.sort_by_key(|&j| sel[j as usize]);
    GroupedChoice {
        ids: sel.iter().map(|&i| i as u32).collect(),
        probs: w.clone(),
        weights: w,
        by_id,
        kth: chosen[k - 1],
        next: order.get(k).map_or(f32::NAN, |&i| l[i]),
    }
}

fn check_router_by_logit(gpu: &Gpu) -> Result<KernelCheck, CudaError> {
    let mut c = Check::new("route_topk_first (gpt-oss's softmax of the top-k, Llama 4's sigmoid)");
    let mut rng = Rng(59);
    // gpt-oss-20b's 32/4 and 120b's 128/4, Llama 4's 16/1 and 128/1, ties
    for (e, k, sig, ties) in [
        (32usize, 4usize, false, false),
        (128, 4, false, true),
        (8, 8, false, false),
        (16, 1, true, false),
        (128, 1, true, true),
        (24, 3, true, false),
    ] {
        let t = 5;
        let logits: Vec<f32> = (0..t * e)
            .map(|_| {
                let v = rng.f32() * 3.0;
                if ties {
                    v.round()
                } else {
                    v
                }
            })
            .collect();
        let lb = gpu.upload(&logits, "router logits")?;
        let bufs: Vec<DevBuf> = [t * k, t * k, t * k, t * k, t, t]
            .iter()
            .map(|&n| gpu.alloc(n * 4, "route outputs"))
            .collect::<Result<_, _>>()?;
        let out = RouteOut {
            ids: bufs[0].ptr(),
            probs: bufs[1].ptr(),
            weights: bufs[2].ptr(),
            by_id: bufs[3].ptr(),
            kth: bufs[4].ptr(),
            next: bufs[5].ptr(),
        };
        ops::route_topk_first(gpu, lb.ptr(), e, k, sig, t, out)?;
        let g_ids: Vec<u32> = gpu.read(out.ids, t * k, "ids")?;
        let g_probs = read_f32(gpu, &bufs[1], t * k)?;
        let g_w = read_f32(gpu, &bufs[2], t * k)?;
        let g_by: Vec<u32> = gpu.read(out.by_id, t * k, "by_id")?;
        let g_kth = read_f32(gpu, &bufs[4], t)?;
        let g_next = read_f32(gpu, &bufs[5], t)?;
        for ti in 0..t {
            let r = by_logit_reference(&logits[ti * e..(ti + 1) * e], k, sig);
            let tag = |what: &str, j: usize| {
                format!("E={e} k={k} sigmoid={sig} ties={ties} token {ti} {what} {j}")
            };
            for j in 0..k {
                c.eq_u32(|| tag("id", j), r.ids[j], g_ids[ti * k + j]);
                c.eq(|| tag("prob", j), r.probs[j], g_probs[ti * k + j]);
                c.eq(|| tag("weight", j), r.weights[j], g_w[ti * k + j]);
                c.eq_u32(|| tag("by_id", j), r.by_id[j], g_by[ti * k + j]);
            }
            c.eq(|| tag("kth", 0), r.kth, g_kth[ti]);
            if e > k {
                c.eq(|| tag("next", 0), r.next, g_next[ti]);
            }
        }
    }
    Ok(c.done())
}

fn check_experts(gpu: &Gpu) -> Result<KernelCheck, CudaError> {
    let mut c = Check::new("gate_up + down_mix (+shared, gpt-oss's biases and clamp)");
    let mut rng = Rng(61);
    // gpt_oss: expert biases and the clamped SwiGLU (alpha 1.702, limit 7; inputs large enough
    // that both clamps bind)
    for (e_count, i_w, h, k, t, shared, gpt_oss) in [
        (6usize, 40usize, 72usize, 3usize, 3usize, false, false),
        (8, 64, 128, 2, 2, true, false),
        (16, 768, 256, 8, 2, false, false),
        (8, 64, 128, 4, 3, false, true),
        (32, 96, 64, 4, 2, false, true),
    ] {
        let gate = rng.vec_bf16(e_count * i_w * h);
        let up = rng.vec_bf16(e_count * i_w * h);
        let down = rng.vec_bf16(e_count * h * i_w);
        // small activations keep silu and the products in a normal range
        let x_scale = if gpt_oss { 1.5 } else { 0.02 };
        let xn: Vec<f32> = rng.vec(t * h).iter().map(|v| v * x_scale).collect();
        let bias_g: Vec<f32> = rng.vec(e_count * i_w);
        let bias_u: Vec<f32> = rng.vec(e_count * i_w);
        let bias_d: Vec<f32> = rng.vec(e_count * h);
        let (bgb, bub, bdb) = (
            gpu.upload(&bias_g, "gate bias")?,
            gpu.upload(&bias_u, "up bias")?,
            gpu.upload(&bias_d, "down bias")?,
        );
        let (alpha, limit) = (1.702f32, 7.0f32);
        let math = if gpt_oss {
            ops::ExpertMath {
                bias_gate: bgb.ptr(),
                bias_up: bub.ptr(),
                bias_down: bdb.ptr(),
                clamp: Some((alpha, limit)),
                input_scaled: false,
            }
        } else {
            ops::ExpertMath::default()
        };
        let h0 = rng.vec(t * h);
        // distinct ids per token, not sorted; weights; by_id = slots in ascending id
        let mut ids = Vec::new();
        let mut by_id = Vec::new();
        for _ in 0..t {
            let mut pool: Vec<u32> = (0..e_count as u32).collect();
            let mut chosen = Vec::new();
            for _ in 0..k {
                let j = (rng.next() % pool.len() as u64) as usize;
                chosen.push(pool.remove(j));
            }
            let mut asc: Vec<u32> = (0..k as u32).collect();
            asc.sort_by_key(|&j| chosen[j as usize]);
            ids.extend(chosen);
            by_id.extend(asc);
        }
        let weights: Vec<f32> = (0..t * k).map(|_| rng.f32().abs() * 0.1).collect();
        let y_sh = rng.vec(t * h);
        let s_sh = rng.vec(t);
        let gb = gpu.upload(&gate, "gate")?;
        let ub = gpu.upload(&up, "up")?;
        let db = gpu.upload(&down, "down")?;
        let xb = gpu.upload(&xn, "xn")?;
        let hb = gpu.upload(&h0, "h")?;
        let ib = gpu.upload(&ids, "ids")?;
        let bb = gpu.upload(&by_id, "by_id")?;
        let wb = gpu.upload(&weights, "weights")?;
        let yb = gpu.upload(&y_sh, "y_sh")?;
        let sb = gpu.upload(&s_sh, "s_sh")?;
        let act = gpu.alloc(t * k * i_w * 4, "act")?;
        ops::gate_up(
            gpu,
            DType::Bf16,
            gb.ptr(),
            ub.ptr(),
            i_w,
            h,
            ib.ptr(),
            k,
            xb.ptr(),
            act.ptr(),
            t,
            math,
        )?;
        let route = RouteOut {
            ids: ib.ptr(),
            probs: 0,
            weights: wb.ptr(),
            by_id: bb.ptr(),
            kth: 0,
            next: 0,
        };
        let (ysp, ssp) = if shared { (yb.ptr(), sb.ptr()) } else { (0, 0) };
        ops::down_mix(
            gpu,
            db.ptr(),
            h,
            i_w,
            route,
            k,
            act.ptr(),
            ysp,
            ssp,
            hb.ptr(),
            t,
            math,
        )?;
        let g_act = read_f32(gpu, &act, t * k * i_w)?;
        let g_h = read_f32(gpu, &hb, t * h)?;
        for ti in 0..t {
            let x = &xn[ti * h..(ti + 1) * h];
            let mut acts = Vec::new();
            for j in 0..k {
                let e = ids[ti * k + j] as usize;
                let a: Vec<f32> = (0..i_w)
                    .map(|i| {
                        let r = (e * i_w + i) * h;
                        let g = dot_bf16_reference(&gate[r..r + h], x);
                        let u = dot_bf16_reference(&up[r..r + h], x);
                        if !gpt_oss {
                            return silu(g) * u;
                        }
                        // tarfa-cpu's expert_products + clamped_swiglu
                        let (g, u) = (g + bias_g[e * i_w + i], u + bias_u[e * i_w + i]);
                        let gc = g.min(limit);
                        let uc = u.min(limit).max(-limit);
                        (uc + 1.0) * (gc * sigmoid(gc * alpha))
                    })
                    .collect();
                for i in 0..i_w {
                    c.eq(
                        || format!("act E={e_count} I={i_w} token {ti} slot {j} row {i}"),
                        a[i],
                        g_act[(ti * k + j) * i_w + i],
                    );
                }
                acts.push(a);
            }
            for r in 0..h {
                let mut acc = 0.0f32;
                for &jj in &by_id[ti * k..(ti + 1) * k] {
                    let j = jj as usize;
                    let e = ids[ti * k + j] as usize;
                    let row = (e * h + r) * i_w;
                    let mut y = dot_bf16_reference(&down[row..row + i_w], &acts[j]);
                    if gpt_oss {
                        y += bias_d[e * h + r];
                    }
                    acc += weights[ti * k + j] * y;
                }
                if shared {
                    acc += sigmoid(s_sh[ti]) * y_sh[ti * h + r];
                }
                let want = h0[ti * h + r] + acc;
                c.eq(
                    || {
                        format!(
                            "h E={e_count} token {ti} row {r} shared={shared} gpt-oss={gpt_oss}"
                        )
                    },
                    want,
                    g_h[ti * h + r],
                );
            }
        }
    }
    Ok(c.done())
}

/// The products of many tokens on every kernel family (kernels/tile.cu's token tiles and
/// few-token kernels, the lane-sequential kernels/prefill.cu): the dense product with bias and
/// residual (BF16 and F32 weights), and the experts grouped by expert (gate, up and SwiGLU, then
/// down), against the CPU's dots. The
/// shapes cover partial row and token tiles, reductions shorter than a chunk, chunks beyond one
/// stage (K > 2,048), and experts chosen by several tiles' worth of pairs.
pub(crate) fn check_many(gpu: &Gpu) -> Result<KernelCheck, CudaError> {
    let mut c = Check::new("products of many tokens (tile.cu, prefill.cu)");
    let mut rng = Rng(71);
    let before = gpu.many();
    // Few: its dense products of 2 to 8 tokens (tile.cu mm_few_bf16); its experts are in the
    // experts' loop below, beside Tiled's
    for many in [
        crate::ManyKernels::Tiled,
        crate::ManyKernels::Lanes,
        crate::ManyKernels::Few,
    ] {
        gpu.set_many(many);
        for (dtype, rows, cols, tokens) in [
            (DType::Bf16, 37usize, 72usize, 19usize),
            (DType::Bf16, 64, 256, 33),
            (DType::F32, 40, 264, 16),
            (DType::Bf16, 33, 768, 5),
            (DType::Bf16, 70, 4104, 18),
            (DType::F32, 9, 2056, 3),
            (DType::Bf16, 21, 4104, 8),
            (DType::Bf16, 12, 520, 2),
        ] {
            let (w, wide) = upload_mat(gpu, rows, cols, dtype, &mut rng)?;
            let x = rng.vec(tokens * cols);
            let bias = rng.vec(rows);
            let out0 = rng.vec(tokens * rows);
            let xb = gpu.upload(&x, "a check activation")?;
            let bb = gpu.upload(&bias, "a check bias")?;
            for residual in [false, true] {
                let ob = gpu.upload(&out0, "a check output")?;
                let b = if residual { bb.ptr() } else { 0 };
                ops::matmul(gpu, &w, xb.ptr(), cols, b, ob.ptr(), rows, tokens, residual)?;
                let got = read_f32(gpu, &ob, tokens * rows)?;
                for t in 0..tokens {
                    for r in 0..rows {
                        let row = &wide[r * cols..(r + 1) * cols];
                        let xs = &x[t * cols..(t + 1) * cols];
                        let mut y = match dtype {
                            DType::Bf16 => {
                                let bits: Vec<u16> =
                                    row.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
                                dot_bf16_reference(&bits, xs)
                            }
                            DType::F32 => dot_f32_reference(row, xs),
                        };
                        if residual {
                            y += bias[r];
                        }
                        let want = if residual { out0[t * rows + r] + y } else { y };
                        c.eq(
                            || {
                                format!(
                                    "{many:?} matmul {rows}x{cols} token {t} row {r} residual={residual}"
                                )
                            },
                            want,
                            got[t * rows + r],
                        );
                    }
                }
            }
        }
        // experts grouped by expert: some chosen by many pairs (several tiles), some by none;
        // with the token tiles, also on the few-pair kernels (tiles of 1 to 4 pairs), there
        // with one shape of several load groups per row (gate/up rows of 2,064 columns: 9
        // chunks, the last partial; down rows of 1,040: 5)
        let kinds: &[ops::ExpertKernels] = match many {
            crate::ManyKernels::Lanes => &[ops::ExpertKernels::Lanes],
            crate::ManyKernels::Few => &[],
            _ => &[ops::ExpertKernels::Tiled, ops::ExpertKernels::Few],
        };
        for (kind, (e_count, i_w, h, k, t)) in kinds.iter().flat_map(|&kind| {
            let mut shapes = vec![
                (6usize, 40usize, 72usize, 3usize, 23usize),
                (16, 96, 264, 4, 40),
                (16, 96, 264, 2, 5),
            ];
            if kind == ops::ExpertKernels::Few {
                shapes.push((4, 1040, 2064, 2, 4));
            }
            shapes.into_iter().map(move |s| (kind, s))
        }) {
            let gate = rng.vec_bf16(e_count * i_w * h);
            let up = rng.vec_bf16(e_count * i_w * h);
            let down = rng.vec_bf16(e_count * h * i_w);
            let xn: Vec<f32> = rng.vec(t * h).iter().map(|v| v * 0.02).collect();
            let mut ids = Vec::new();
            for _ in 0..t {
                // skewed: expert 0 or 1 first, then distinct others
                let mut pool: Vec<u32> = (0..e_count as u32).collect();
                for j in 0..k {
                    let at = if j == 0 {
                        (rng.next() % 2) as usize
                    } else {
                        (rng.next() % pool.len() as u64) as usize
                    };
                    ids.push(pool.remove(at.min(pool.len() - 1)));
                }
            }
            let pairs = t * k;
            let tile = ops::experts_tile(kind);
            let (gb, ub, db) = (
                gpu.upload(&gate, "gate")?,
                gpu.upload(&up, "up")?,
                gpu.upload(&down, "down")?,
            );
            let (xb, ib) = (gpu.upload(&xn, "xn")?, gpu.upload(&ids, "ids")?);
            let order = gpu.alloc(pairs * 4, "order")?;
            let tiles = gpu.alloc(
                3 * ops::max_tiles(pairs, e_count, ops::TILE_TOKENS) * 4,
                "tiles",
            )?;
            let count = gpu.alloc(4, "tile count")?;
            let g = ops::Groups {
                order: order.ptr(),
                tiles: tiles.ptr(),
                n_tiles: count.ptr(),
            };
            ops::moe_group(gpu, ib.ptr(), pairs, e_count, tile, g)?;
            let act = gpu.alloc(pairs * i_w * 4, "act")?;
            let y = gpu.alloc(pairs * h * 4, "y")?;
            let ran = ops::gate_up_tile(
                gpu,
                DType::Bf16,
                gb.ptr(),
                ub.ptr(),
                i_w,
                h,
                Some((g, e_count)),
                pairs,
                k,
                xb.ptr(),
                act.ptr(),
                kind,
            )? && ops::down_tile(
                gpu,
                db.ptr(),
                h,
                i_w,
                g,
                pairs,
                e_count,
                act.ptr(),
                y.ptr(),
                kind,
            )?;
            assert!(ran, "the check's shapes are tileable");
            let g_act = read_f32(gpu, &act, pairs * i_w)?;
            let g_y = read_f32(gpu, &y, pairs * h)?;
            for q in 0..pairs {
                let (e, x) = (ids[q] as usize, &xn[(q / k) * h..(q / k + 1) * h]);
                let a: Vec<f32> = (0..i_w)
                    .map(|i| {
                        let r = (e * i_w + i) * h;
                        silu(dot_bf16_reference(&gate[r..r + h], x))
                            * dot_bf16_reference(&up[r..r + h], x)
                    })
                    .collect();
                for i in 0..i_w {
                    c.eq(
                        || format!("{kind:?} act E={e_count} pair {q} row {i}"),
                        a[i],
                        g_act[q * i_w + i],
                    );
                }
                for r in 0..h {
                    let row = (e * h + r) * i_w;
                    c.eq(
                        || format!("{kind:?} down E={e_count} pair {q} row {r}"),
                        dot_bf16_reference(&down[row..row + i_w], &a),
                        g_y[q * h + r],
                    );
                }
            }
        }
    }
    gpu.set_many(before);
    Ok(c.done())
}

/// The prefill attention over query tiles (kernels/prefill.cu: scores, softmax, P·V) against
/// the CPU's: every head width it takes, GQA groups of 1 to 8 heads, a step continuing a cache
/// (its queries see the earlier positions), gpt-oss's sinks, and a step over two sequences
/// (the per-token tables) whose tiles end where a sequence does.
pub(crate) fn check_prefill_attention(gpu: &Gpu) -> Result<KernelCheck, CudaError> {
    let mut c = Check::new("prefill attention (prefill.cu: scores, softmax, p.v)");
    let mut rng = Rng(81);
    // (d, hq, hkv, tokens per sequence, cached positions before the step, sinks)
    type Case = (usize, usize, usize, &'static [usize], usize, bool);
    let cases: [Case; 6] = [
        (8, 4, 4, &[21], 0, false),
        (16, 4, 2, &[40], 7, true),
        (32, 8, 2, &[13, 30], 0, false),
        (64, 2, 1, &[70], 260, false),
        (128, 16, 2, &[9], 3, true),
        (32, 4, 1, &[17, 3], 5, false),
    ];
    for (d, hq, hkv, seqs, before, sinks) in cases {
        let hg = hq / hkv;
        let t_total: usize = seqs.iter().sum();
        let cap = before + seqs.iter().max().copied().unwrap_or(0) + 3;
        let scale = (1.0f64 / (d as f64).sqrt()) as f32;
        // per sequence: keys and values [hkv][cap][d] (positions past the end left random)
        let caches: Vec<(Vec<f32>, Vec<f32>)> = seqs
            .iter()
            .map(|_| {
                let k: Vec<f32> = rng.vec(hkv * cap * d).iter().map(|v| v * 0.3).collect();
                (k, rng.vec(hkv * cap * d))
            })
            .collect();
        let q: Vec<f32> = rng.vec(t_total * hq * d).iter().map(|v| v * 0.3).collect();
        let sink_vals = rng.vec(hq);
        let kbufs: Vec<(PagedKv, PagedKv)> = caches
            .iter()
            .map(|(k, v)| {
                Ok((
                    PagedKv::upload(gpu, k, hkv, cap, d)?,
                    PagedKv::upload(gpu, v, hkv, cap, d)?,
                ))
            })
            .collect::<Result<_, CudaError>>()?;
        let qb = gpu.upload(&q, "queries")?;
        let sb = gpu.upload(&sink_vals, "sinks")?;
        let shape = AttnShape {
            hq,
            hkv,
            d,
            rd: d,
            cap,
            pos0: before,
            tokens: t_total,
        };
        let qt = ops::query_tile_tokens(&shape, &ops::AttnMask::default()).expect("a tile shape");
        let list = ops::query_tiles(seqs, qt);
        let n_tiles = list.len() / 2;
        let n_stride = before + seqs.iter().max().copied().unwrap_or(0);
        let qtb = gpu.upload(&list, "query tiles")?;
        let mb = gpu.alloc(n_tiles * hkv * ops::AT_ROWS * 4, "tile maxima")?;
        let scb = gpu.alloc(n_tiles * hkv * ops::AT_ROWS * n_stride * 4, "scores")?;
        let ob = gpu.upload(&rng.vec(t_total * hq * d), "o")?;
        // token t's sequence and position; the per-token tables when there are two sequences
        let mut who = Vec::new();
        for (si, &n) in seqs.iter().enumerate() {
            who.extend((0..n).map(|i| (si, before + i)));
        }
        let (_tb, _kvb, src) = if seqs.len() > 1 {
            let tok: Vec<u64> = who
                .iter()
                .flat_map(|&(_, pos)| [0u64, 0, pos as u64, cap as u64])
                .collect();
            let kv: Vec<u64> = who
                .iter()
                .flat_map(|&(si, _)| [kbufs[si].0.ptr(), kbufs[si].1.ptr()])
                .collect();
            let (tb, kvb) = (
                gpu.upload(&tok, "token table")?,
                gpu.upload(&kv, "cache table")?,
            );
            let src = ops::KvSrc::Seqs(ops::SeqKv {
                tok: tb.ptr(),
                kv: kvb.ptr(),
            });
            (Some(tb), Some(kvb), src)
        } else {
            (
                None,
                None,
                ops::KvSrc::One {
                    kc: kbufs[0].0.ptr(),
                    vc: kbufs[0].1.ptr(),
                },
            )
        };
        let tiles = ops::AttnTiles {
            qtiles: qtb.ptr(),
            n_tiles,
            mbuf: mb.ptr(),
            n_stride,
        };
        ops::attention_tiles(
            gpu,
            shape,
            qb.ptr(),
            src,
            tiles,
            scale,
            scb.ptr(),
            ob.ptr(),
            if sinks { sb.ptr() } else { 0 },
        )?;
        let got = read_f32(gpu, &ob, t_total * hq * d)?;
        for (t, &(si, pos)) in who.iter().enumerate() {
            let (kc, vc) = &caches[si];
            for h in 0..hq {
                let g = h / hg;
                let qv = &q[(t * hq + h) * d..(t * hq + h + 1) * d];
                let n = pos + 1;
                let mut s: Vec<f32> = (0..n)
                    .map(|j| {
                        let kr = &kc[(g * cap + j) * d..(g * cap + j + 1) * d];
                        dot_f32_reference(qv, kr) * scale
                    })
                    .collect();
                if sinks {
                    s.push(sink_vals[h]);
                }
                let mut p = softmax_ref(&s);
                p.truncate(n);
                let mut want = vec![0.0f32; d];
                let mut tmp = Vec::new();
                weighted_row_sum(
                    Kernel::scalar(),
                    &p,
                    &vc[g * cap * d..(g * cap + n) * d],
                    &mut want,
                    &mut tmp,
                );
                for dd in 0..d {
                    c.eq(
                        || {
                            format!(
                                "d={d} hq={hq} hkv={hkv} seqs={seqs:?} token {t} head {h} dim {dd}"
                            )
                        },
                        want[dd],
                        got[(t * hq + h) * d + dd],
                    );
                }
            }
        }
    }
    Ok(c.done())
}

// ---------------------------------------------------------------------------------------------
// The gated DeltaNet layer's steps as tarfa-cpu's `linear_block` computes them (the mock device's
// reference kernels and the checks below share them).

/// The causal convolution of `tokens` rows of `x` (`[T][C]`) from `state` (`[K-1][C]`, advanced
/// in place): `silu(((w_0 x_0 + w_1 x_1) + ...) + w_(K-1) x_(K-1))` per channel, no fma.
pub(crate) fn conv_reference(
    s: ops::LinearShape,
    x: &[f32],
    w: &[f32],
    state: &mut [f32],
) -> Vec<f32> {
    let (c, taps) = (s.channels(), s.taps);
    let mut y = vec![0.0f32; x.len()];
    for (xt, yt) in x.chunks_exact(c).zip(y.chunks_exact_mut(c)) {
        for ch in 0..c {
            let wc = &w[ch * taps..(ch + 1) * taps];
            let mut acc = wc[0] * if taps == 1 { xt[ch] } else { state[ch] };
            for (j, &wj) in wc.iter().enumerate().skip(1) {
                let xj = if j + 1 == taps {
                    xt[ch]
                } else {
                    state[j * c + ch]
                };
                acc += wj * xj;
            }
            yt[ch] = silu(acc);
        }
        if taps > 1 {
            state.copy_within(c.., 0);
            let last = (taps - 2) * c;
            state[last..].copy_from_slice(xt);
        }
    }
    y
}

/// The L2 norm of each q and k head of one token's `q | k | v` row, the queries then scaled.
pub(crate) fn qk_norm_reference(s: ops::LinearShape, row: &mut [f32], eps: f32, scale: f32) {
    let kw = s.key_width();
    for (i, head) in row[..2 * kw].chunks_exact_mut(s.dk).enumerate() {
        let inv = rsqrt(dot_f32_reference(head, head) + eps);
        for x in head.iter_mut() {
            *x *= inv;
        }
        if i < s.hk {
            for x in head.iter_mut() {
                *x *= scale;
            }
        }
    }
}

/// The gated delta rule of one token (`qkv` its normed `q | k | v`, `b`, `a` `[Hv]`) on `state`
/// (`[Hv][Dv][Dk]`, advanced in place); returns the output `[Hv Dv]`.
pub(crate) fn recur_reference(
    s: ops::LinearShape,
    qkv: &[f32],
    (b, a): (&[f32], &[f32]),
    (a_log, dt_bias): (&[f32], &[f32]),
    state: &mut [f32],
) -> Vec<f32> {
    let (kw, dk, dv, r) = (s.key_width(), s.dk, s.dv, s.hv / s.hk);
    let (q, k, v) = (&qkv[..kw], &qkv[kw..2 * kw], &qkv[2 * kw..]);
    let mut o = vec![0.0f32; s.value_width()];
    for (hh, (st, oh)) in state
        .chunks_exact_mut(dv * dk)
        .zip(o.chunks_exact_mut(dv))
        .enumerate()
    {
        let kh = hh / r;
        let (qh, khv) = (&q[kh * dk..(kh + 1) * dk], &k[kh * dk..(kh + 1) * dk]);
        let beta = sigmoid(b[hh]);
        let g = -exp(a_log[hh]) * softplus(a[hh] + dt_bias[hh]);
        let decay = exp(g);
        for (j, (row, oj)) in st.chunks_exact_mut(dk).zip(oh.iter_mut()).enumerate() {
            for x in row.iter_mut() {
                *x *= decay;
            }
            let kv = dot_f32_reference(row, khv);
            let delta = (v[hh * dv + j] - kv) * beta;
            for (x, &ki) in row.iter_mut().zip(khv) {
                *x += ki * delta;
            }
            *oj = dot_f32_reference(row, qh);
        }
    }
    o
}

/// Random values in `[lo, hi)`, as the layer's inputs are (gates and logs of moderate size).
fn uniform(rng: &mut Rng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n)
        .map(|_| lo + (hi - lo) * ((rng.next() >> 40) as f32 / (1u64 << 24) as f32))
        .collect()
}

fn check_linear(gpu: &Gpu) -> Result<KernelCheck, CudaError> {
    let mut c = Check::new("linear_conv, linear_qk_norm, linear_recur (gated DeltaNet)");
    let mut rng = Rng(51);
    let eps = 1e-6f32;
    // key dims below a chunk, with partial chunks, and past one 256-chunk; 1 and 4 taps
    for (hk, hv, dk, dv, taps) in [
        (2usize, 4usize, 32usize, 32usize, 4usize),
        (1, 3, 20, 7, 1),
        (2, 2, 300, 5, 3),
        (1, 2, 128, 16, 4),
    ] {
        let s = ops::LinearShape {
            hk,
            hv,
            dk,
            dv,
            taps,
        };
        let (ch, tokens) = (s.channels(), 5usize);
        let scale = (1.0f64 / (dk as f64).sqrt()) as f32;
        let x = uniform(&mut rng, tokens * ch, -2.0, 2.0);
        let w = uniform(&mut rng, ch * taps, -1.0, 1.0);
        let conv0 = uniform(&mut rng, s.conv_len(), -2.0, 2.0);
        let state0 = uniform(&mut rng, s.state_len(), -1.0, 1.0);
        let b = uniform(&mut rng, tokens * hv, -4.0, 4.0);
        // a + dt_bias spans softplus's three branches (tiny, ln, past the threshold)
        let a = uniform(&mut rng, tokens * hv, -30.0, 30.0);
        let a_log = uniform(&mut rng, hv, -3.0, 2.0);
        let dt_bias = uniform(&mut rng, hv, -1.0, 1.0);

        // the reference: the CPU's order, token by token
        let mut conv_want = conv0.clone();
        let mut y_want = conv_reference(s, &x, &w, &mut conv_want);
        let mut state_want = state0.clone();
        let mut o_want = Vec::new();
        for (t, row) in y_want.chunks_exact_mut(ch).enumerate() {
            qk_norm_reference(s, row, eps, scale);
            let ba = (&b[t * hv..(t + 1) * hv], &a[t * hv..(t + 1) * hv]);
            o_want.extend(recur_reference(
                s,
                row,
                ba,
                (&a_log, &dt_bias),
                &mut state_want,
            ));
        }

        let xb = gpu.upload(&x, "a check input")?;
        let wb = gpu.upload(&w, "a check conv weight")?;
        let conv_src = gpu.upload(&conv0, "a check conv state")?;
        let conv_dst = gpu.alloc(s.conv_len() * 4, "a check conv state")?;
        let st_src = gpu.upload(&state0, "a check state")?;
        let st_dst = gpu.alloc(s.state_len() * 4, "a check state")?;
        let yb = gpu.alloc(tokens * ch * 4, "a check output")?;
        let bb = gpu.upload(&b, "a check b")?;
        let ab = gpu.upload(&a, "a check a")?;
        let alb = gpu.upload(&a_log, "a check A_log")?;
        let dtb = gpu.upload(&dt_bias, "a check dt_bias")?;
        let ob = gpu.alloc(tokens * s.value_width() * 4, "a check output")?;
        let what = format!("Hk={hk} Hv={hv} Dk={dk} Dv={dv} K={taps}");
        // from one buffer into another, then in place (src == dst, y == x) from the same state
        for in_place in [false, true] {
            let (csrc, cdst, ssrc, sdst, y) = if in_place {
                gpu.write(conv_dst.ptr(), &conv0, "a check conv state")?;
                gpu.write(st_dst.ptr(), &state0, "a check state")?;
                (
                    conv_dst.ptr(),
                    conv_dst.ptr(),
                    st_dst.ptr(),
                    st_dst.ptr(),
                    xb.ptr(),
                )
            } else {
                (
                    conv_src.ptr(),
                    conv_dst.ptr(),
                    st_src.ptr(),
                    st_dst.ptr(),
                    yb.ptr(),
                )
            };
            ops::linear_conv(gpu, s, xb.ptr(), ch, tokens, wb.ptr(), csrc, cdst, y, ch)?;
            ops::linear_qk_norm(gpu, s, y, ch, tokens, eps, scale)?;
            let io = ops::RecurIo {
                qkv: y,
                stride: ch,
                b: bb.ptr(),
                a: ab.ptr(),
                a_log: alb.ptr(),
                dt_bias: dtb.ptr(),
                src: ssrc,
                dst: sdst,
                o: ob.ptr(),
            };
            ops::linear_recur(gpu, s, io, tokens)?;
            let arm = if in_place { "in place" } else { "src -> dst" };
            for (name, want, got) in [
                (
                    "q|k|v",
                    &y_want,
                    gpu.read::<f32>(y, tokens * ch, "a check output")?,
                ),
                (
                    "conv state",
                    &conv_want,
                    read_f32(gpu, &conv_dst, s.conv_len())?,
                ),
                ("state", &state_want, read_f32(gpu, &st_dst, s.state_len())?),
                ("output", &o_want, read_f32(gpu, &ob, o_want.len())?),
            ] {
                for (i, (&w, &g)) in want.iter().zip(&got).enumerate() {
                    c.eq(|| format!("{what} {arm}: {name}[{i}]"), w, g);
                }
            }
        }
        // from zeros (src null): the state at position 0 (x again: the in-place arm wrote it)
        gpu.write(xb.ptr(), &x, "a check input")?;
        let mut conv_zero = vec![0.0f32; s.conv_len()];
        let y0 = conv_reference(s, &x, &w, &mut conv_zero);
        ops::linear_conv(
            gpu,
            s,
            xb.ptr(),
            ch,
            tokens,
            wb.ptr(),
            0,
            conv_dst.ptr(),
            yb.ptr(),
            ch,
        )?;
        let got = read_f32(gpu, &yb, tokens * ch)?;
        for (i, (&w, &g)) in y0.iter().zip(&got).enumerate() {
            c.eq(|| format!("{what} from zeros: conv y[{i}]"), w, g);
        }
        let got = read_f32(gpu, &conv_dst, s.conv_len())?;
        for (i, (&w, &g)) in conv_zero.iter().zip(&got).enumerate() {
            c.eq(|| format!("{what} from zeros: conv state[{i}]"), w, g);
        }
    }
    Ok(c.done())
}

fn check_gated_attention(gpu: &Gpu) -> Result<KernelCheck, CudaError> {
    let mut c = Check::new("split_query_gate, sigmoid_gate, silu_gate, linear_unpack");
    let mut rng = Rng(53);
    let (hq, d, tokens) = (3usize, 40usize, 4usize);
    let qg = rng.vec(tokens * 2 * hq * d);
    let o = rng.vec(tokens * hq * d);
    let qgb = gpu.upload(&qg, "a check input")?;
    let ob = gpu.upload(&o, "a check input")?;
    let qb = gpu.alloc(tokens * hq * d * 4, "a check output")?;
    ops::split_query_gate(gpu, qgb.ptr(), hq, d, tokens, qb.ptr())?;
    ops::sigmoid_gate(gpu, ob.ptr(), qgb.ptr(), hq, d, tokens)?;
    let (q_got, o_got) = (
        read_f32(gpu, &qb, tokens * hq * d)?,
        read_f32(gpu, &ob, tokens * hq * d)?,
    );
    for (t, head) in qg.chunks_exact(2 * d).enumerate() {
        for i in 0..d {
            let at = t * d + i;
            c.eq(|| format!("query {at}"), head[i], q_got[at]);
            c.eq(
                || format!("gated o {at}"),
                o[at] * sigmoid(head[d + i]),
                o_got[at],
            );
        }
    }
    let z = rng.vec(o.len());
    let zb = gpu.upload(&z, "a check input")?;
    ops::silu_gate(gpu, ob.ptr(), zb.ptr(), o.len())?;
    let got = read_f32(gpu, &ob, o.len())?;
    for i in 0..o.len() {
        c.eq(|| format!("silu gate {i}"), o_got[i] * silu(z[i]), got[i]);
    }
    // Qwen3-Next's grouped projections: values that say where they came from
    let s = ops::LinearShape {
        hk: 2,
        hv: 6,
        dk: 5,
        dv: 3,
        taps: 4,
    };
    let (r, rv) = (s.hv / s.hk, s.hv / s.hk * s.dv);
    let group = 2 * s.dk + 2 * rv;
    let qkvz: Vec<f32> = (0..tokens * s.hk * group).map(|i| i as f32).collect();
    let ba: Vec<f32> = (0..tokens * 2 * s.hv).map(|i| -(i as f32)).collect();
    let (ch, vw, hv) = (s.channels(), s.value_width(), s.hv);
    let (qkvzb, bab) = (
        gpu.upload(&qkvz, "a check input")?,
        gpu.upload(&ba, "a check input")?,
    );
    let out = gpu.alloc(tokens * (ch + vw + 2 * hv) * 4, "a check output")?;
    let (qkv_p, z_p) = (out.ptr(), out.ptr() + (tokens * ch * 4) as u64);
    let b_p = z_p + (tokens * vw * 4) as u64;
    let a_p = b_p + (tokens * hv * 4) as u64;
    ops::linear_unpack(gpu, s, qkvzb.ptr(), bab.ptr(), tokens, qkv_p, z_p, b_p, a_p)?;
    let got = read_f32(gpu, &out, tokens * (ch + vw + 2 * hv))?;
    let (kw, dk) = (s.key_width(), s.dk);
    for t in 0..tokens {
        // tarfa-cpu's linear_inputs, slice by slice
        let p = &qkvz[t * s.hk * group..(t + 1) * s.hk * group];
        let bat = &ba[t * 2 * hv..(t + 1) * 2 * hv];
        let mut want = vec![0.0f32; ch + vw + 2 * hv];
        for g in 0..s.hk {
            let src = &p[g * group..(g + 1) * group];
            want[g * dk..(g + 1) * dk].copy_from_slice(&src[..dk]);
            want[kw + g * dk..kw + (g + 1) * dk].copy_from_slice(&src[dk..2 * dk]);
            want[2 * kw + g * rv..2 * kw + (g + 1) * rv].copy_from_slice(&src[2 * dk..2 * dk + rv]);
            want[ch + g * rv..ch + (g + 1) * rv].copy_from_slice(&src[2 * dk + rv..]);
            want[ch + vw + g * r..ch + vw + (g + 1) * r]
                .copy_from_slice(&bat[2 * g * r..(2 * g + 1) * r]);
            want[ch + vw + hv + g * r..ch + vw + hv + (g + 1) * r]
                .copy_from_slice(&bat[(2 * g + 1) * r..(2 * g + 2) * r]);
        }
        let gathered = [
            &got[t * ch..(t + 1) * ch],
            &got[tokens * ch + t * vw..tokens * ch + (t + 1) * vw],
            &got[tokens * (ch + vw) + t * hv..tokens * (ch + vw) + (t + 1) * hv],
            &got[tokens * (ch + vw + hv) + t * hv..tokens * (ch + vw + hv) + (t + 1) * hv],
        ]
        .concat();
        for (i, (&w, &g)) in want.iter().zip(&gathered).enumerate() {
            c.eq(|| format!("unpack token {t} value {i}"), w, g);
        }
    }
    Ok(c.done())
}
