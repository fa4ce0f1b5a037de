//! A device made of host memory whose kernels are the CPU's reference functions (test only).
//!
//! It runs [`CudaModel`]'s orchestration — buffer sizes, strides, offsets, launch geometry, the
//! order of kernels, the KV cache and its growth — without a GPU: every access is bounds-checked
//! against its allocation, and every launch's geometry against what its kernel expects. The CUDA
//! kernels themselves are checked against the same reference functions on the device
//! (checks.rs); together the two cover the GPU path.

use std::collections::BTreeMap;

use super::device::Arg;
use super::CudaError;
use crate::numerics::detmath::{exp, rsqrt, sigmoid, silu};
use crate::numerics::reduce::{
    dot_bf16_reference, dot_f32_reference, sum_reference, weighted_row_sum,
};
use crate::numerics::{bf16_to_f32, f32_to_bf16_rne, Kernel};

/// Allocations by base address.
#[derive(Default)]
pub(crate) struct Memory {
    blocks: BTreeMap<u64, Vec<u8>>,
    next: u64,
}

impl Memory {
    pub(crate) fn alloc(&mut self, bytes: usize) -> u64 {
        if self.next == 0 {
            self.next = 0x7f00_0000_0000;
        }
        let base = self.next;
        // a gap after every allocation: an overrun lands in no allocation and panics
        self.next += (bytes as u64).div_ceil(256) * 256 + 4096;
        self.blocks.insert(base, vec![0; bytes]);
        base
    }

    pub(crate) fn free(&mut self, ptr: u64) {
        assert!(
            self.blocks.remove(&ptr).is_some(),
            "free of an unknown pointer {ptr:#x}"
        );
    }

    fn span(&mut self, addr: u64, len: usize) -> &mut [u8] {
        let (&base, block) = self
            .blocks
            .range_mut(..=addr)
            .next_back()
            .unwrap_or_else(|| panic!("access at {addr:#x}: no allocation"));
        let off = (addr - base) as usize;
        assert!(
            off + len <= block.len(),
            "access of {len} bytes at {addr:#x} overruns the allocation at {base:#x} of {} bytes",
            block.len()
        );
        &mut block[off..off + len]
    }

    pub(crate) fn read(&mut self, addr: u64, out: &mut [u8]) {
        let s = self.span(addr, out.len());
        out.copy_from_slice(s);
    }

    pub(crate) fn write(&mut self, addr: u64, src: &[u8]) {
        self.span(addr, src.len()).copy_from_slice(src);
    }

    fn f32s(&mut self, addr: u64, n: usize) -> Vec<f32> {
        self.span(addr, 4 * n)
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    fn u16s(&mut self, addr: u64, n: usize) -> Vec<u16> {
        self.span(addr, 2 * n)
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    fn u32s(&mut self, addr: u64, n: usize) -> Vec<u32> {
        self.span(addr, 4 * n)
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    fn put_f32s(&mut self, addr: u64, v: &[f32]) {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.write(addr, &bytes);
    }

    fn put_u32s(&mut self, addr: u64, v: &[u32]) {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.write(addr, &bytes);
    }
}

struct Args<'a>(&'a [Arg], &'static str);

impl Args<'_> {
    fn ptr(&self, i: usize) -> u64 {
        match self.0[i] {
            Arg::Ptr(p) => p,
            a => panic!("{}: argument {i} is {a:?}, not a pointer", self.1),
        }
    }
    fn int(&self, i: usize) -> usize {
        match self.0[i] {
            Arg::I32(v) => usize::try_from(v).expect("non-negative int"),
            a => panic!("{}: argument {i} is {a:?}, not an int", self.1),
        }
    }
    fn long(&self, i: usize) -> usize {
        match self.0[i] {
            Arg::I64(v) => usize::try_from(v).expect("non-negative long"),
            a => panic!("{}: argument {i} is {a:?}, not a long", self.1),
        }
    }
    fn float(&self, i: usize) -> f32 {
        match self.0[i] {
            Arg::F32(v) => v,
            a => panic!("{}: argument {i} is {a:?}, not a float", self.1),
        }
    }
    fn count(&self, n: usize) {
        assert_eq!(
            self.0.len(),
            n,
            "{}: {} arguments, the kernel takes {n}",
            self.1,
            self.0.len()
        );
    }
}

fn rows_of(mem: &mut Memory, w: u64, bf16: bool, r: usize, cols: usize) -> Vec<f32> {
    if bf16 {
        mem.u16s(w + (r * cols * 2) as u64, cols)
            .into_iter()
            .map(bf16_to_f32)
            .collect()
    } else {
        mem.f32s(w + (r * cols * 4) as u64, cols)
    }
}

fn dot(w: &[f32], x: &[f32], bf16: bool) -> f32 {
    if bf16 {
        let bits: Vec<u16> = w.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
        dot_bf16_reference(&bits, x)
    } else {
        dot_f32_reference(w, x)
    }
}

fn softmax(l: &[f32]) -> Vec<f32> {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = l.iter().map(|&x| exp(x - m)).collect();
    let s = sum_reference(&e);
    e.iter().map(|&x| x / s).collect()
}

/// Runs kernel `name` as the reference functions define it.
pub(crate) fn launch(
    mem: &mut Memory,
    name: &'static str,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared_bytes: u32,
    args: &[Arg],
) -> Result<(), CudaError> {
    let a = Args(args, name);
    let (gx, gy, gz) = (grid.0 as usize, grid.1 as usize, grid.2 as usize);
    match name {
        "matvec_bf16" | "matvec_f32" => {
            a.count(9);
            let bf16 = name == "matvec_bf16";
            let (w, rows, cols) = (a.ptr(0), a.int(1), a.int(2));
            let (x, xs, bias, out, os, mode) =
                (a.ptr(3), a.long(4), a.ptr(5), a.ptr(6), a.long(7), a.int(8));
            assert_eq!(
                (gx, gz, block.0),
                (rows.div_ceil(8), 1, 256),
                "{name} geometry"
            );
            for t in 0..gy {
                let xv = mem.f32s(x + (t * xs * 4) as u64, cols);
                for r in 0..rows {
                    let wr = rows_of(mem, w, bf16, r, cols);
                    let mut y = dot(&wr, &xv, bf16);
                    if bias != 0 {
                        y += mem.f32s(bias + (r * 4) as u64, 1)[0];
                    }
                    let o = out + ((t * os + r) * 4) as u64;
                    let v = if mode == 1 { mem.f32s(o, 1)[0] + y } else { y };
                    mem.put_f32s(o, &[v]);
                }
            }
        }
        "rmsnorm" => {
            a.count(8);
            let (x, xs, y, ys, w, n, count, eps) = (
                a.ptr(0),
                a.long(1),
                a.ptr(2),
                a.long(3),
                a.ptr(4),
                a.int(5),
                a.int(6),
                a.float(7),
            );
            assert_eq!(
                (gx, gy, block.0),
                (count.div_ceil(8), 1, 256),
                "{name} geometry"
            );
            let wv = mem.f32s(w, n);
            for s in 0..count {
                let xv = mem.f32s(x + (s * xs * 4) as u64, n);
                let ss = dot_f32_reference(&xv, &xv);
                let r = rsqrt(ss / n as f32 + eps);
                let out: Vec<f32> = xv.iter().zip(&wv).map(|(&xi, &wi)| wi * (xi * r)).collect();
                mem.put_f32s(y + (s * ys * 4) as u64, &out);
            }
        }
        "embed_bf16" | "embed_f32" => {
            a.count(4);
            let (table, tokens, hidden, h) = (a.ptr(0), a.ptr(1), a.int(2), a.ptr(3));
            let toks = mem.u32s(tokens, gx);
            for (t, &tok) in toks.iter().enumerate() {
                let row = rows_of(mem, table, name == "embed_bf16", tok as usize, hidden);
                mem.put_f32s(h + (t * hidden * 4) as u64, &row);
            }
        }
        "rope_append_kv" => {
            a.count(12);
            let (q, k, v) = (a.ptr(0), a.ptr(1), a.ptr(2));
            let (hq, hkv, d) = (a.int(3), a.int(4), a.int(5));
            let (cos, sin, pos0, kc, vc, cap) =
                (a.ptr(6), a.ptr(7), a.int(8), a.ptr(9), a.ptr(10), a.int(11));
            assert_eq!(gx, hq + hkv, "{name} geometry");
            let half = d / 2;
            let rot = |x: &mut [f32], c: &[f32], s: &[f32]| {
                for i in 0..half {
                    let (p, r) = (x[i], x[i + half]);
                    x[i] = p * c[i] - r * s[i];
                    x[i + half] = r * c[i] + p * s[i];
                }
            };
            for t in 0..gy {
                let pos = pos0 + t;
                assert!(
                    pos < cap,
                    "{name}: position {pos} past the cache capacity {cap}"
                );
                let c = mem.f32s(cos + (pos * half * 4) as u64, half);
                let s = mem.f32s(sin + (pos * half * 4) as u64, half);
                for head in 0..hq {
                    let addr = q + (((t * hq + head) * d) * 4) as u64;
                    let mut x = mem.f32s(addr, d);
                    rot(&mut x, &c, &s);
                    mem.put_f32s(addr, &x);
                }
                for kh in 0..hkv {
                    let mut x = mem.f32s(k + (((t * hkv + kh) * d) * 4) as u64, d);
                    rot(&mut x, &c, &s);
                    mem.put_f32s(kc + (((kh * cap + pos) * d) * 4) as u64, &x);
                    let vv = mem.f32s(v + (((t * hkv + kh) * d) * 4) as u64, d);
                    mem.put_f32s(vc + (((kh * cap + pos) * d) * 4) as u64, &vv);
                }
            }
        }
        "attention" => {
            a.count(12);
            let (q, hq, hkv, d) = (a.ptr(0), a.int(1), a.int(2), a.int(3));
            let (kc, vc, cap, pos0, scale) = (a.ptr(4), a.ptr(5), a.int(6), a.int(7), a.float(8));
            let (scratch, ns, o) = (a.ptr(9), a.int(10), a.ptr(11));
            assert_eq!((gx, block.0), (hq, 256), "{name} geometry");
            let mut tmp = Vec::new();
            for t in 0..gy {
                let n = pos0 + t + 1;
                assert!(
                    n <= ns && n <= cap,
                    "{name}: {n} positions, stride {ns}, capacity {cap}"
                );
                for h in 0..hq {
                    let kvh = h / (hq / hkv);
                    let qv = mem.f32s(q + (((t * hq + h) * d) * 4) as u64, d);
                    let keys = mem.f32s(kc + ((kvh * cap * d) * 4) as u64, n * d);
                    let vals = mem.f32s(vc + ((kvh * cap * d) * 4) as u64, n * d);
                    let s: Vec<f32> = (0..n)
                        .map(|j| dot_f32_reference(&qv, &keys[j * d..(j + 1) * d]) * scale)
                        .collect();
                    mem.put_f32s(scratch + (((t * hq + h) * ns) * 4) as u64, &s);
                    let p = softmax(&s);
                    let mut out = vec![0.0f32; d];
                    weighted_row_sum(Kernel::scalar(), &p, &vals, &mut out, &mut tmp);
                    mem.put_f32s(o + (((t * hq + h) * d) * 4) as u64, &out);
                }
            }
        }
        "route_topk" => {
            a.count(10);
            let (logits, e, k, renorm) = (a.ptr(0), a.int(1), a.int(2), a.int(3) == 1);
            let (ids, probs, weights, by_id, kth, next) =
                (a.ptr(4), a.ptr(5), a.ptr(6), a.ptr(7), a.ptr(8), a.ptr(9));
            assert!(
                shared_bytes as usize >= (e + k) * 4,
                "{name}: shared memory"
            );
            for t in 0..gx {
                let p = softmax(&mem.f32s(logits + ((t * e) * 4) as u64, e));
                let mut order: Vec<usize> = (0..e).collect();
                order.sort_by(|&x, &y| p[y].total_cmp(&p[x]).then(x.cmp(&y)));
                let sel = &order[..k];
                let sp: Vec<f32> = sel.iter().map(|&i| p[i]).collect();
                let w: Vec<f32> = if renorm {
                    let s = sum_reference(&sp);
                    sp.iter().map(|&x| x / s).collect()
                } else {
                    sp.clone()
                };
                let mut asc: Vec<u32> = (0..k as u32).collect();
                asc.sort_by_key(|&j| sel[j as usize]);
                let base = (t * k * 4) as u64;
                mem.put_u32s(
                    ids + base,
                    &sel.iter().map(|&i| i as u32).collect::<Vec<_>>(),
                );
                mem.put_f32s(probs + base, &sp);
                mem.put_f32s(weights + base, &w);
                mem.put_u32s(by_id + base, &asc);
                mem.put_f32s(kth + (t * 4) as u64, &[p[order[k - 1]]]);
                mem.put_f32s(
                    next + (t * 4) as u64,
                    &[order.get(k).map_or(f32::NAN, |&i| p[i])],
                );
            }
        }
        "gate_up_bf16" | "gate_up_f32" => {
            a.count(8);
            let bf16 = name == "gate_up_bf16";
            let (gate, up, rows, cols, ids, k, xn, act) = (
                a.ptr(0),
                a.ptr(1),
                a.int(2),
                a.int(3),
                a.ptr(4),
                a.int(5),
                a.ptr(6),
                a.ptr(7),
            );
            assert_eq!((gx, gy), (rows.div_ceil(8), k), "{name} geometry");
            for t in 0..gz {
                let x = mem.f32s(xn + ((t * cols) * 4) as u64, cols);
                for j in 0..k {
                    let e = if ids != 0 {
                        mem.u32s(ids + ((t * k + j) * 4) as u64, 1)[0] as usize
                    } else {
                        0
                    };
                    let out: Vec<f32> = (0..rows)
                        .map(|i| {
                            let g = dot(&rows_of(mem, gate, bf16, e * rows + i, cols), &x, bf16);
                            let u = dot(&rows_of(mem, up, bf16, e * rows + i, cols), &x, bf16);
                            silu(g) * u
                        })
                        .collect();
                    mem.put_f32s(act + (((t * k + j) * rows) * 4) as u64, &out);
                }
            }
        }
        "down_mix" => {
            a.count(11);
            let (down, hidden, width, ids, weights, by_id, k) = (
                a.ptr(0),
                a.int(1),
                a.int(2),
                a.ptr(3),
                a.ptr(4),
                a.ptr(5),
                a.int(6),
            );
            let (act, y_sh, s_sh, h) = (a.ptr(7), a.ptr(8), a.ptr(9), a.ptr(10));
            assert_eq!(gx, hidden.div_ceil(8), "{name} geometry");
            for t in 0..gy {
                let id = mem.u32s(ids + ((t * k) * 4) as u64, k);
                let w = mem.f32s(weights + ((t * k) * 4) as u64, k);
                let order = mem.u32s(by_id + ((t * k) * 4) as u64, k);
                let acts: Vec<Vec<f32>> = (0..k)
                    .map(|j| mem.f32s(act + (((t * k + j) * width) * 4) as u64, width))
                    .collect();
                let mut hv = mem.f32s(h + ((t * hidden) * 4) as u64, hidden);
                for (r, hr) in hv.iter_mut().enumerate() {
                    let mut acc = 0.0f32;
                    for &jj in &order {
                        let j = jj as usize;
                        let y = dot(
                            &rows_of(mem, down, true, id[j] as usize * hidden + r, width),
                            &acts[j],
                            true,
                        );
                        acc += w[j] * y;
                    }
                    if y_sh != 0 {
                        let s = mem.f32s(s_sh + (t * 4) as u64, 1)[0];
                        acc += sigmoid(s) * mem.f32s(y_sh + ((t * hidden + r) * 4) as u64, 1)[0];
                    }
                    *hr += acc;
                }
                mem.put_f32s(h + ((t * hidden) * 4) as u64, &hv);
            }
        }
        "probe_exp" | "probe_silu" | "probe_sigmoid" | "probe_rsqrt" => {
            a.count(3);
            let (x, y, n) = (a.ptr(0), a.ptr(1), a.long(2));
            let f: fn(f32) -> f32 = match name {
                "probe_exp" => exp,
                "probe_silu" => silu,
                "probe_sigmoid" => sigmoid,
                _ => rsqrt,
            };
            let v: Vec<f32> = mem.f32s(x, n).into_iter().map(f).collect();
            mem.put_f32s(y, &v);
        }
        "round_to_bf16" => {
            a.count(2);
            let (x, n) = (a.ptr(0), a.int(1));
            let v: Vec<f32> = mem
                .f32s(x, n)
                .into_iter()
                .map(|v| bf16_to_f32(f32_to_bf16_rne(v)))
                .collect();
            mem.put_f32s(x, &v);
        }
        other => {
            return Err(CudaError::Unsupported(format!(
                "the mock device has no kernel {other}"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::sync::Arc;

    use super::super::device::Gpu;
    use super::super::model::CudaModel;
    use super::super::selftest::selftest_models;
    use super::super::synthetic::{random_model, SyntheticShape};
    use super::super::SelftestOptions;
    use crate::config::MoeConfig;
    use crate::cpu::{CpuEngine, CpuModel, EngineOptions};
    use crate::model::ArchSpec;
    use crate::numerics::Kernel;
    use crate::weights::{load_safetensors_dir, WeightSource};

    fn compare(
        name: &str,
        cfg: MoeConfig,
        src: Arc<dyn WeightSource>,
        prompts: Vec<Vec<u32>>,
        decode: usize,
    ) {
        let cpu = Arc::new(CpuModel::load(cfg.clone(), src.clone()).unwrap());
        let engine = CpuEngine::new(
            cpu,
            EngineOptions {
                threads: 2,
                kernel: Kernel::best(),
            },
        )
        .unwrap();
        let gpu = CudaModel::load_on(Gpu::mock(), cfg, src).unwrap();
        let opts = SelftestOptions {
            prompts,
            decode_steps: decode,
            cpu_threads: 2,
        };
        let rep = selftest_models(&engine, &gpu, &opts).unwrap();
        eprintln!("{name}: {rep}");
        assert!(rep.passed(), "{name}: {rep}");
    }

    #[test]
    fn the_orchestration_reproduces_the_cpu_for_every_family() {
        for family in ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"] {
            let (cfg, src) = random_model(&SyntheticShape::small(family), 9);
            let v = cfg.vocab_size;
            let prompts = vec![vec![3], (0..17).map(|i| (i * 31 % v) as u32).collect()];
            compare(family, cfg, Arc::new(src), prompts, 3);
        }
    }

    #[test]
    fn the_kernel_checks_pass_on_the_mock_device() {
        // checks the checks: their expected values agree with the reference kernels
        let checks = super::super::checks::kernel_checks_on(&Gpu::mock()).unwrap();
        for c in &checks {
            eprintln!("{c}");
            assert!(c.compared > 0 && c.mismatches == 0, "{c}");
        }
        assert_eq!(checks.len(), 11);
    }

    #[test]
    fn weights_that_do_not_fit_are_a_clear_out_of_memory_error() {
        let (cfg, src) = random_model(&SyntheticShape::small("qwen3_moe"), 11);
        let err = match CudaModel::load_on(Gpu::mock_with_memory(100 << 20), cfg, Arc::new(src)) {
            Ok(_) => panic!("loaded into 100 MiB with 512 MiB of headroom"),
            Err(e) => e,
        };
        assert!(err.is_environment());
        assert!(
            matches!(err, super::super::CudaError::OutOfMemory { .. }),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("resident weights") && msg.contains("free"),
            "{msg}"
        );
    }

    #[test]
    fn the_kv_cache_grows_past_its_first_capacity() {
        // the cache starts with 256 positions: a 250-token prefill, then decode past 256
        let (cfg, src) = random_model(&SyntheticShape::small("qwen3_moe"), 10);
        let v = cfg.vocab_size;
        let prompts = vec![(0..250).map(|i| (i * 7 % v) as u32).collect()];
        compare("growth", cfg, Arc::new(src), prompts, 9);
    }

    #[test]
    fn the_orchestration_reproduces_the_cpu_on_the_oracle_fixtures() {
        let base = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/oracle");
        for name in [
            "qwen3moe-a",
            "qwen3moe-code",
            "qwen3moe-dense",
            "qwen3moe-odd",
        ] {
            let dir = base.join(name);
            if !dir.is_dir() {
                continue;
            }
            let cfg = MoeConfig::from_json_str(
                &std::fs::read_to_string(dir.join("config.json")).unwrap(),
            )
            .unwrap();
            let spec = ArchSpec::new(&cfg);
            let src = Arc::new(load_safetensors_dir(&dir, &cfg, &spec).unwrap());
            let prompts = vec![
                vec![1],
                (0..12).map(|i| (i * 13 % cfg.vocab_size) as u32).collect(),
            ];
            compare(name, cfg, src, prompts, 2);
        }
    }
}
