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
use tarfa_core::numerics::detmath::{exp, rsqrt, sigmoid, silu, softplus};
use tarfa_core::numerics::reduce::{
    dot_bf16_reference, dot_f32_reference, sum_reference, weighted_row_sum,
};
use tarfa_core::numerics::{bf16_to_f32, f32_to_bf16_rne, Kernel};

/// Guard bytes after every allocation (and before it): an overrun by a reference kernel lands in
/// no allocation and panics; one by an emulated CUDA kernel changes a guard, which the check
/// after every emulated launch reports.
const GUARD: usize = 4096;
const GUARD_BYTE: u8 = 0xC3;

/// One allocation: host memory whose address is the "device" address, so that the CUDA
/// emulator (validation/gpu/emu) can run the real kernels on it.
struct Block {
    /// GUARD bytes, the allocation (256-byte aligned), GUARD bytes.
    raw: Vec<u8>,
    start: usize,
    len: usize,
}

/// Allocations by base address.
#[derive(Default)]
pub(crate) struct Memory {
    blocks: BTreeMap<u64, Block>,
    /// launches per kernel name (tests ask which kernels a step took)
    pub(crate) launched: BTreeMap<&'static str, usize>,
    /// host-to-device copies per what they copied (tests ask which copies a step made)
    pub(crate) wrote: BTreeMap<String, usize>,
}

impl Memory {
    pub(crate) fn alloc(&mut self, bytes: usize) -> u64 {
        let mut raw = vec![GUARD_BYTE; bytes + 2 * GUARD + 256];
        let base = raw.as_mut_ptr() as usize + GUARD;
        let start = GUARD + (256 - base % 256) % 256;
        raw[start..start + bytes].fill(0);
        let addr = raw.as_ptr() as u64 + start as u64;
        self.blocks.insert(
            addr,
            Block {
                raw,
                start,
                len: bytes,
            },
        );
        addr
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
            off + len <= block.len,
            "access of {len} bytes at {addr:#x} overruns the allocation at {base:#x} of {} bytes",
            block.len
        );
        &mut block.raw[block.start + off..block.start + off + len]
    }

    /// Panics naming the first allocation whose guard bytes changed (after an emulated launch).
    fn check_guards(&self, kernel: &str) {
        for (&base, b) in &self.blocks {
            let before = &b.raw[..b.start];
            let after = &b.raw[b.start + b.len..];
            let bad_before = before[before.len() - GUARD.min(before.len())..]
                .iter()
                .any(|&x| x != GUARD_BYTE);
            if bad_before || after.iter().any(|&x| x != GUARD_BYTE) {
                panic!(
                    "{kernel}: a write outside the allocation at {base:#x} of {} bytes",
                    b.len
                );
            }
        }
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

/// `silu(dot(gate[row0 + i], x)) * dot(up[row0 + i], x)` for `i < rows`: one expert's SwiGLU
/// rows (the reference of every gate/up kernel).
#[allow(clippy::too_many_arguments)]
fn swiglu_rows(
    mem: &mut Memory,
    gate: u64,
    up: u64,
    bf16: bool,
    row0: usize,
    rows: usize,
    cols: usize,
    x: &[f32],
) -> Vec<f32> {
    act_rows(
        mem,
        (gate, up, bf16),
        row0,
        rows,
        cols,
        x,
        &ExpertMathRef::PLAIN,
        0,
    )
}

/// kernels/moe.cu's `ExpertMath` as a gate/up launch passes it: the experts' gate and up biases
/// (0: none), the clamped SwiGLU, Llama 4's per-slot inputs (the mixing kernels' down bias and
/// `unweighted` are read by their own arms).
struct ExpertMathRef {
    bg: u64,
    bu: u64,
    clamp: Option<(f32, f32)>,
    x_per_slot: bool,
}

impl ExpertMathRef {
    const PLAIN: ExpertMathRef = ExpertMathRef {
        bg: 0,
        bu: 0,
        clamp: None,
        x_per_slot: false,
    };

    /// The gate/up kernels' six trailing arguments from `at`.
    fn act(a: &Args<'_>, at: usize) -> ExpertMathRef {
        ExpertMathRef {
            bg: a.ptr(at),
            bu: a.ptr(at + 1),
            clamp: (a.int(at + 4) != 0).then(|| (a.float(at + 2), a.float(at + 3))),
            x_per_slot: a.int(at + 5) != 0,
        }
    }

    /// The input row of slot (t, j): xn[t], or xn[t*k + j] for per-slot inputs.
    fn x_row(&self, t: usize, k: usize, j: usize) -> usize {
        if self.x_per_slot {
            t * k + j
        } else {
            t
        }
    }
}

/// One expert's activation rows (tarfa-cpu's `expert_products`): g, u the dots of gate and up
/// rows `row0 + i` with x, plus expert `e`'s biases, then silu(g) * u or the clamped SwiGLU.
#[allow(clippy::too_many_arguments)]
fn act_rows(
    mem: &mut Memory,
    (gate, up, bf16): (u64, u64, bool),
    row0: usize,
    rows: usize,
    cols: usize,
    x: &[f32],
    m: &ExpertMathRef,
    e: usize,
) -> Vec<f32> {
    let (bg, bu) = if m.bg != 0 {
        (
            mem.f32s(m.bg + ((e * rows) * 4) as u64, rows),
            mem.f32s(m.bu + ((e * rows) * 4) as u64, rows),
        )
    } else {
        (Vec::new(), Vec::new())
    };
    (0..rows)
        .map(|i| {
            let mut g = dot(&rows_of(mem, gate, bf16, row0 + i, cols), x, bf16);
            let mut u = dot(&rows_of(mem, up, bf16, row0 + i, cols), x, bf16);
            if m.bg != 0 {
                g += bg[i];
                u += bu[i];
            }
            match m.clamp {
                None => silu(g) * u,
                Some((alpha, limit)) => {
                    let gc = g.min(limit);
                    let uc = u.min(limit).max(-limit);
                    (uc + 1.0) * (gc * sigmoid(gc * alpha))
                }
            }
        })
        .collect()
}

/// The mix of one output row (every down/mix kernel's epilogue): +0, then `w_j * y(j)` for the
/// slots in `order` (ascending expert id), then the shared expert's `sigmoid(s) * y_sh`.
fn mix_row(
    order: &[u32],
    w: &[f32],
    y: impl FnMut(usize) -> f32,
    shared: Option<(Option<f32>, f32)>,
) -> f32 {
    mix_row_as(order, w, y, shared, false)
}

/// [`mix_row`], adding `y(j)` unweighted when `unweighted` (Llama 4: the weight scaled the input).
fn mix_row_as(
    order: &[u32],
    w: &[f32],
    mut y: impl FnMut(usize) -> f32,
    shared: Option<(Option<f32>, f32)>,
    unweighted: bool,
) -> f32 {
    let mut acc = 0.0f32;
    for &j in order {
        let j = j as usize;
        if unweighted {
            acc += y(j);
        } else {
            acc += w[j] * y(j);
        }
    }
    // the shared expert: gated by sigmoid(s) (Qwen2-MoE), or ungated without a gate logit
    match shared {
        Some((Some(s), y_sh)) => acc += sigmoid(s) * y_sh,
        Some((None, y_sh)) => acc += y_sh,
        None => {}
    }
    acc
}

fn softmax(l: &[f32]) -> Vec<f32> {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = l.iter().map(|&x| exp(x - m)).collect();
    let s = sum_reference(&e);
    e.iter().map(|&x| x / s).collect()
}

/// A matrix-vector launch's arguments (matvec, mm_tile).
struct MatvecArgs {
    bf16: bool,
    w: u64,
    rows: usize,
    cols: usize,
    x: u64,
    xs: usize,
    bias: u64,
    out: u64,
    os: usize,
    mode: usize,
}

/// `out[t][r] = (out[t][r] +) dot(W[r], x[t]) (+ bias[r])` for `tokens` tokens.
fn matvec_reference(mem: &mut Memory, m: &MatvecArgs, tokens: usize) {
    for t in 0..tokens {
        let xv = mem.f32s(m.x + (t * m.xs * 4) as u64, m.cols);
        for r in 0..m.rows {
            let wr = rows_of(mem, m.w, m.bf16, r, m.cols);
            let mut y = dot(&wr, &xv, m.bf16);
            if m.bias != 0 {
                y += mem.f32s(m.bias + (r * 4) as u64, 1)[0];
            }
            let o = m.out + ((t * m.os + r) * 4) as u64;
            let v = if m.mode == 1 {
                mem.f32s(o, 1)[0] + y
            } else {
                y
            };
            mem.put_f32s(o, &[v]);
        }
    }
}

/// moe_group's lists: the pairs by expert (ascending id, ascending pair within), and the tiles
/// (expert, first, count <= 4) in that order.
fn group_reference(ids: &[u32], experts: usize, tile: usize) -> (Vec<u32>, Vec<u32>) {
    let mut order = Vec::with_capacity(ids.len());
    let mut tiles = Vec::new();
    for e in 0..experts as u32 {
        let first = order.len();
        order.extend((0..ids.len() as u32).filter(|&q| ids[q as usize] == e));
        for start in (first..order.len()).step_by(tile) {
            tiles.extend([e, start as u32, (order.len() - start).min(tile) as u32]);
        }
    }
    (order, tiles)
}

/// The (expert, pairs) of each of a tiled launch's `blocks` block rows (kernels/tile.cu
/// `tile_pairs`, prefill.cu `ls_tile_pairs`): moe_group's tiles, or the dense MLP's runs of
/// `tile` tokens of `pairs`.
fn tile_pairs_reference(
    mem: &mut Memory,
    order: u64,
    tiles: u64,
    n_tiles: u64,
    (pairs, tile): (usize, usize),
    blocks: usize,
) -> Vec<(usize, Vec<usize>)> {
    if order == 0 {
        assert_eq!(blocks, pairs.div_ceil(tile), "dense tiles");
        return (0..pairs)
            .step_by(tile)
            .map(|s| (0, (s..(s + tile).min(pairs)).collect()))
            .collect();
    }
    let n = mem.u32s(n_tiles, 1)[0] as usize;
    assert!(n <= blocks, "{n} tiles for {blocks} block rows");
    let t = mem.u32s(tiles, 3 * n);
    t.chunks_exact(3)
        .map(|c| {
            let q = mem.u32s(order + (c[1] as usize * 4) as u64, c[2] as usize);
            (c[0] as usize, q.into_iter().map(|x| x as usize).collect())
        })
        .collect()
}

/// The address of row `pos` of KV head `head` (`w` floats) in the paged cache whose block table
/// is at `tbl` (kernels/common.cuh `kv_row`).
fn kv_row(mem: &mut Memory, tbl: u64, head: usize, pos: usize, w: usize) -> u64 {
    use super::model::KV_BLOCK;
    let mut b = [0u8; 8];
    mem.read(tbl + (pos / KV_BLOCK * 8) as u64, &mut b);
    let block = u64::from_le_bytes(b);
    assert!(block != 0, "a KV cache row in no block: position {pos}");
    block + (((head * KV_BLOCK + pos % KV_BLOCK) * w) * 4) as u64
}

/// Rows `0..n` of KV head `head` (`w` floats each) of the paged cache `tbl`, one after another.
fn kv_rows(mem: &mut Memory, tbl: u64, head: usize, n: usize, w: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n * w);
    for j in 0..n {
        let at = kv_row(mem, tbl, head, j, w);
        out.extend(mem.f32s(at, w));
    }
    out
}

/// Token `t`'s entry of a multi-sequence step's tables: its RoPE rows, position, and this
/// layer's (keys, values tables, capacity).
fn seq_token(
    mem: &mut Memory,
    tok: u64,
    kv: u64,
    t: usize,
) -> ((u64, u64), usize, (u64, u64, usize)) {
    let mut b = [0u8; 32];
    mem.read(tok + (t * 32) as u64, &mut b);
    let w = |i: usize| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().expect("8 bytes"));
    let (cos, sin, pos, cap) = (w(0), w(1), w(2) as usize, w(3) as usize);
    let mut c = [0u8; 16];
    mem.read(kv + (t * 16) as u64, &mut c);
    let kc = u64::from_le_bytes(c[..8].try_into().expect("8 bytes"));
    let vc = u64::from_le_bytes(c[8..].try_into().expect("8 bytes"));
    ((cos, sin), pos, (kc, vc, cap))
}

/// RoPE of token `t` (table rows `rows` = (cos, sin) addresses) on its query heads in place and
/// key heads, its key and value written at `pos` of `cache` = (keys, values, capacity).
#[allow(clippy::too_many_arguments)]
fn rope_reference(
    mem: &mut Memory,
    [q, k, v]: [u64; 3],
    (hq, hkv, d, rd): (usize, usize, usize, usize),
    t: usize,
    (cos, sin): (u64, u64),
    pos: usize,
    (kc, vc, cap): (u64, u64, usize),
    form: &RopeFormRef,
) {
    assert!(
        pos < cap,
        "rope: position {pos} past the cache capacity {cap}"
    );
    // the leading rd values of each head rotate (pairs i, i + rd/2, or Llama 4's 2i, 2i+1);
    // the rest pass through; then Llama 4's L2 norm; a NoPE layer's queries times qscale[t]
    let half = rd / 2;
    let c = mem.f32s(cos, half);
    let s = mem.f32s(sin, half);
    let rot = |x: &mut [f32]| {
        match form.form {
            0 => {
                for i in 0..half {
                    let (p, r) = (x[i], x[i + half]);
                    x[i] = p * c[i] - r * s[i];
                    x[i + half] = r * c[i] + p * s[i];
                }
            }
            1 => {
                for i in 0..half {
                    let (a, b) = (x[2 * i], x[2 * i + 1]);
                    x[2 * i] = a * c[i] - b * s[i];
                    x[2 * i + 1] = a * s[i] + b * c[i];
                }
            }
            _ => {}
        }
        if let Some(eps) = form.l2 {
            let r = rsqrt(dot_f32_reference(x, x) / x.len() as f32 + eps);
            x.iter_mut().for_each(|v| *v *= r);
        }
    };
    let qs = (form.qscale != 0).then(|| mem.f32s(form.qscale + (t * 4) as u64, 1)[0]);
    for head in 0..hq {
        let addr = q + (((t * hq + head) * d) * 4) as u64;
        let mut x = mem.f32s(addr, d);
        rot(&mut x);
        if let Some(qs) = qs {
            x.iter_mut().for_each(|v| *v *= qs);
        }
        mem.put_f32s(addr, &x);
    }
    for kh in 0..hkv {
        let mut x = mem.f32s(k + (((t * hkv + kh) * d) * 4) as u64, d);
        rot(&mut x);
        let at = kv_row(mem, kc, kh, pos, d);
        mem.put_f32s(at, &x);
        let vv = mem.f32s(v + (((t * hkv + kh) * d) * 4) as u64, d);
        let at = kv_row(mem, vc, kh, pos, d);
        mem.put_f32s(at, &vv);
    }
}

/// norm_rope.cu's `RopeForm` as a launch passes it (its four trailing arguments).
struct RopeFormRef {
    form: usize,
    l2: Option<f32>,
    qscale: u64,
}

impl RopeFormRef {
    fn read(a: &Args<'_>, at: usize) -> RopeFormRef {
        RopeFormRef {
            form: a.int(at),
            l2: (a.int(at + 1) != 0).then(|| a.float(at + 2)),
            qscale: a.ptr(at + 3),
        }
    }
}

/// One token's attention: where its query, output and scores are, and its cache.
struct AttnAt {
    q: u64,
    o: u64,
    scratch: u64,
    ns: usize,
    scale: f32,
    t: usize,
    pos: usize,
    cache: (u64, u64, usize),
    /// (sinks [Hq] or 0, window, chunk): attention.cu's mask arguments
    mask: (u64, usize, usize),
}

fn attention_reference(mem: &mut Memory, (hq, hkv, d): (usize, usize, usize), at: &AttnAt) {
    let (kc, vc, cap) = at.cache;
    let (sinks, window, chunk) = at.mask;
    let (t, n) = (at.t, at.pos + 1);
    assert!(
        n + usize::from(sinks != 0) <= at.ns && n <= cap,
        "attention: {n} positions, stride {}, capacity {cap}",
        at.ns
    );
    // tarfa-cpu's gqa_block: a sliding layer's last `window` positions, a chunked layer's chunk
    let start = if window > 0 {
        n.saturating_sub(window)
    } else {
        0
    };
    let start = at
        .pos
        .checked_div(chunk)
        .map_or(start, |c| start.max(c * chunk));
    let mut tmp = Vec::new();
    for h in 0..hq {
        let kvh = h / (hq / hkv);
        let qv = mem.f32s(at.q + (((t * hq + h) * d) * 4) as u64, d);
        let keys = kv_rows(mem, kc, kvh, n, d);
        let vals = kv_rows(mem, vc, kvh, n, d);
        let mut s: Vec<f32> = (start..n)
            .map(|j| dot_f32_reference(&qv, &keys[j * d..(j + 1) * d]) * at.scale)
            .collect();
        // gpt-oss's sink: one more logit after the keys, its probability dropped
        if sinks != 0 {
            s.push(mem.f32s(sinks + (h * 4) as u64, 1)[0]);
        }
        mem.put_f32s(at.scratch + (((t * hq + h) * at.ns) * 4) as u64, &s);
        let mut p = softmax(&s);
        p.truncate(n - start);
        let mut out = vec![0.0f32; d];
        weighted_row_sum(Kernel::scalar(), &p, &vals[start * d..], &mut out, &mut tmp);
        mem.put_f32s(at.o + (((t * hq + h) * d) * 4) as u64, &out);
    }
}

/// MLA's widths as the kernels take them (mla.cu): (hq, dn, dr, dv, r) and the interleave flag.
#[derive(Clone, Copy)]
struct MlaDims {
    hq: usize,
    dn: usize,
    dr: usize,
    dv: usize,
    r: usize,
}

/// RoPE on one rope part (mla.cu `mla_rope_part`): de-interleaved first when `interleave`, then
/// the rotate-half rotation with the rows (cos, sin) of dr/2 values.
fn mla_rope_ref(mem: &mut Memory, x: &[f32], interleave: bool, (cos, sin): (u64, u64)) -> Vec<f32> {
    let half = x.len() / 2;
    let (c, s) = (mem.f32s(cos, half), mem.f32s(sin, half));
    let b: Vec<f32> = if interleave {
        (0..half)
            .map(|i| x[2 * i])
            .chain((0..half).map(|i| x[2 * i + 1]))
            .collect()
    } else {
        x.to_vec()
    };
    let mut out = b.clone();
    for i in 0..half {
        out[i] = b[i] * c[i] - b[half + i] * s[i];
        out[half + i] = b[half + i] * c[i] + b[i] * s[i];
    }
    out
}

/// One token of `mla_rope_append`: its queries' rope parts rotated in place, its latent row
/// `[kva[..r] | rope(kva[r..])]` written at `pos` of the paged `cache` (one head of r + dr).
fn mla_rope_append_ref(
    mem: &mut Memory,
    m: MlaDims,
    (q, kva, interleave): (u64, u64, bool),
    t: usize,
    rows: (u64, u64),
    pos: usize,
    cache: u64,
) {
    let (dq, w) = (m.dn + m.dr, m.r + m.dr);
    for head in 0..m.hq {
        let at = q + (((t * m.hq + head) * dq + m.dn) * 4) as u64;
        let x = mem.f32s(at, m.dr);
        let y = mla_rope_ref(mem, &x, interleave, rows);
        mem.put_f32s(at, &y);
    }
    let kv = mem.f32s(kva + ((t * w) * 4) as u64, w);
    let mut row = kv[..m.r].to_vec();
    row.extend(mla_rope_ref(mem, &kv[m.r..], interleave, rows));
    let at = kv_row(mem, cache, 0, pos, w);
    mem.put_f32s(at, &row);
}

/// One token of `mla_attention` (mla.cu `mla_attend_one`) for every head: the absorbed query,
/// the scores against the n = pos + 1 latent rows, the softmax, the attended latent and the
/// head's value rows.
#[allow(clippy::too_many_arguments)]
fn mla_attention_ref(
    mem: &mut Memory,
    m: MlaDims,
    (q, kv_b, bf16): (u64, u64, bool),
    t: usize,
    (cache, pos): (u64, usize),
    scale: f32,
    (scratch, ns): (u64, usize),
    o: u64,
) {
    let (dq, w, n) = (m.dn + m.dr, m.r + m.dr, pos + 1);
    assert!(n <= ns, "mla attention: {n} positions, stride {ns}");
    let lat = kv_rows(mem, cache, 0, n, w);
    let mut tmp = Vec::new();
    for head in 0..m.hq {
        let qh = mem.f32s(q + (((t * m.hq + head) * dq) * 4) as u64, dq);
        let row0 = head * (m.dn + m.dv);
        let kb: Vec<f32> = (0..m.dn)
            .flat_map(|i| rows_of(mem, kv_b, bf16, row0 + i, m.r))
            .collect();
        let mut qc = vec![0.0f32; w];
        weighted_row_sum(Kernel::scalar(), &qh[..m.dn], &kb, &mut qc[..m.r], &mut tmp);
        qc[m.r..].copy_from_slice(&qh[m.dn..]);
        let s: Vec<f32> = (0..n)
            .map(|j| dot_f32_reference(&qc, &lat[j * w..(j + 1) * w]) * scale)
            .collect();
        mem.put_f32s(scratch + (((t * m.hq + head) * ns) * 4) as u64, &s);
        let p = softmax(&s);
        let mut u = vec![0.0f32; w];
        weighted_row_sum(Kernel::scalar(), &p, &lat, &mut u, &mut tmp);
        let out: Vec<f32> = (0..m.dv)
            .map(|i| {
                dot(
                    &rows_of(mem, kv_b, bf16, row0 + m.dn + i, m.r),
                    &u[..m.r],
                    bf16,
                )
            })
            .collect();
        mem.put_f32s(o + (((t * m.hq + head) * m.dv) * 4) as u64, &out);
    }
}

type EmuLaunch = unsafe extern "C" fn(
    *const std::ffi::c_char,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    *const u64,
    i32,
) -> i32;

/// The CUDA emulator of validation/gpu/emu, when `TARFA_CUDA_EMU` names its library: the mock
/// device then runs the real kernels of kernels/*.cu (on CPU threads) instead of the reference
/// functions below.
fn emulator() -> Option<EmuLaunch> {
    static EMU: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let f = *EMU.get_or_init(|| {
        let path = std::env::var("TARFA_CUDA_EMU").ok()?;
        let c = std::ffi::CString::new(path.clone()).ok()?;
        // SAFETY: dlopen/dlsym of a library built by validation/gpu/emu/build.sh; the symbol
        // has the signature of EmuLaunch.
        unsafe {
            let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOW);
            assert!(!h.is_null(), "TARFA_CUDA_EMU={path}: cannot load it");
            let sym = libc::dlsym(h, c"emu_launch".as_ptr());
            assert!(!sym.is_null(), "TARFA_CUDA_EMU={path}: no emu_launch");
            Some(sym as usize)
        }
    });
    // SAFETY: the address of emu_launch (see above).
    f.map(|a| unsafe { std::mem::transmute::<usize, EmuLaunch>(a) })
}

/// Whether the mock device runs the emulated CUDA kernels.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) fn emulated() -> bool {
    emulator().is_some()
}

/// The router's choice for one token's logits `l` (route_topk): the chosen experts in rank
/// order, their probabilities, their mixing weights, the slots in ascending expert id, the
/// probability of rank k - 1 and of rank k (NaN when there is none).
struct RouteChoice {
    ids: Vec<u32>,
    probs: Vec<f32>,
    weights: Vec<f32>,
    by_id: Vec<u32>,
    kth: f32,
    next: f32,
}

fn route_choice(l: &[f32], k: usize, renorm: bool) -> RouteChoice {
    let e = l.len();
    let p = softmax(l);
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
    RouteChoice {
        ids: sel.iter().map(|&i| i as u32).collect(),
        probs: sp,
        weights: w,
        by_id: asc,
        kth: p[order[k - 1]],
        next: order.get(k).map_or(f32::NAN, |&i| p[i]),
    }
}

impl From<super::checks::GroupedChoice> for RouteChoice {
    fn from(r: super::checks::GroupedChoice) -> RouteChoice {
        RouteChoice {
            ids: r.ids,
            probs: r.probs,
            weights: r.weights,
            by_id: r.by_id,
            kth: r.kth,
            next: r.next,
        }
    }
}

/// A [`RouteChoice`] written at token `t`'s slots of `[ids, probs, weights, by_id, kth, next]`.
fn put_route(mem: &mut Memory, c: &RouteChoice, k: usize, t: usize, out: [u64; 6]) {
    let [ids, probs, weights, by_id, kth, next] = out;
    let base = (t * k * 4) as u64;
    mem.put_u32s(ids + base, &c.ids);
    mem.put_f32s(probs + base, &c.probs);
    mem.put_f32s(weights + base, &c.weights);
    mem.put_u32s(by_id + base, &c.by_id);
    mem.put_f32s(kth + (t * 4) as u64, &[c.kth]);
    mem.put_f32s(next + (t * 4) as u64, &[c.next]);
}

/// [`route_choice`] written at token `t`'s slots of `[ids, probs, weights, by_id, kth, next]`.
fn route_reference(mem: &mut Memory, l: &[f32], k: usize, renorm: bool, t: usize, out: [u64; 6]) {
    let c = route_choice(l, k, renorm);
    put_route(mem, &c, k, t, out);
}

/// kernels/prefill.cu's products' dynamic shared memory (`LS_SMEM_BYTES`).
const LS_SMEM_BYTES: u32 = 2 * (8 * 16 * 32 + 8 * 16 * 20) * 4;

/// The prefill attention's query tiles and key/value source, from a launch's arguments at
/// `at`: qtiles, tok, kv, kc, vc, cap, pos0 (kernels/prefill.cu `attn_tile`).
struct TileSrc {
    qtiles: u64,
    tok: u64,
    kv: u64,
    kc: u64,
    vc: u64,
    cap: usize,
    pos0: usize,
}

/// One query tile: its tokens (first, count) and the tokens' (position, cache).
struct QueryTile {
    hg: usize,
    rows: Vec<(usize, usize, (u64, u64, usize))>,
}

impl QueryTile {
    /// Row r's token, position and (keys, values, capacity); None past the tile's tokens.
    fn row(&self, r: usize) -> Option<(usize, usize, (u64, u64, usize))> {
        self.rows.get(r / self.hg).copied()
    }
}

impl TileSrc {
    fn of(a: &Args<'_>, at: usize) -> TileSrc {
        TileSrc {
            qtiles: a.ptr(at),
            tok: a.ptr(at + 1),
            kv: a.ptr(at + 2),
            kc: a.ptr(at + 3),
            vc: a.ptr(at + 4),
            cap: a.int(at + 5),
            pos0: a.int(at + 6),
        }
    }

    fn tile(&self, mem: &mut Memory, b: usize, hg: usize) -> QueryTile {
        let t = mem.u32s(self.qtiles + (b * 8) as u64, 2);
        let (first, count) = (t[0] as usize, t[1] as usize);
        assert!(
            count >= 1 && count * hg <= 64,
            "query tile {b}: {count} tokens"
        );
        let rows = (first..first + count)
            .map(|t| {
                if self.tok != 0 {
                    let (_, pos, cache) = seq_token(mem, self.tok, self.kv, t);
                    (t, pos, cache)
                } else {
                    (t, self.pos0 + t, (self.kc, self.vc, self.cap))
                }
            })
            .collect::<Vec<_>>();
        for w in rows.windows(2) {
            assert!(
                w[1].1 == w[0].1 + 1 && w[1].2 == w[0].2,
                "query tile {b}: tokens of one sequence at consecutive positions"
            );
        }
        QueryTile { hg, rows }
    }
}

/// Runs kernel `name` as the reference functions define it (or, with the emulator, as the CUDA
/// source does).
pub(crate) fn launch(
    mem: &mut Memory,
    name: &'static str,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    shared_bytes: u32,
    args: &[Arg],
) -> Result<(), CudaError> {
    *mem.launched.entry(name).or_default() += 1;
    if let Some(emu) = emulator() {
        let vals: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(p) => p,
                Arg::I32(v) => v as u32 as u64,
                Arg::I64(v) => v as u64,
                Arg::F32(v) => v.to_bits() as u64,
            })
            .collect();
        let cname = std::ffi::CString::new(name).expect("kernel name");
        // SAFETY: every pointer argument is an allocation of `mem` (host memory) sized by the
        // caller for this launch, as on the device; the guards catch overruns.
        let rc = unsafe {
            emu(
                cname.as_ptr(),
                grid.0,
                grid.1,
                grid.2,
                block.0,
                block.1,
                block.2,
                shared_bytes,
                vals.as_ptr(),
                vals.len() as i32,
            )
        };
        if rc != 0 {
            return Err(CudaError::Internal(format!(
                "the CUDA emulator cannot run kernel {name} (code {rc})"
            )));
        }
        mem.check_guards(name);
        return Ok(());
    }
    launch_reference(mem, name, grid, block, shared_bytes, args)
}

/// Runs kernel `name` as the reference functions define it (the CPU backend's operations), with
/// or without the emulator: what a test compares the emulated kernel with.
pub(crate) fn launch_reference(
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
            let (w, rows, cols) = (a.ptr(0), a.int(1), a.int(2));
            let (x, xs, bias, out, os, mode) =
                (a.ptr(3), a.long(4), a.ptr(5), a.ptr(6), a.long(7), a.int(8));
            assert_eq!(
                (gx, gz, block.0),
                (rows.div_ceil(8), 1, 256),
                "{name} geometry"
            );
            let m = MatvecArgs {
                bf16: name == "matvec_bf16",
                w,
                rows,
                cols,
                x,
                xs,
                bias,
                out,
                os,
                mode,
            };
            matvec_reference(mem, &m, gy);
        }
        "mm_tile_bf16" | "mm_tile_f32" | "mm_few_bf16" => {
            a.count(10);
            let (w, rows, cols) = (a.ptr(0), a.int(1), a.int(2));
            let (x, xs, tokens) = (a.ptr(3), a.long(4), a.int(5));
            let (bias, out, os, mode) = (a.ptr(6), a.ptr(7), a.long(8), a.int(9));
            let want = if name == "mm_few_bf16" {
                assert!((2..=8).contains(&tokens), "{name}: {tokens} tokens");
                (1, rows.div_ceil(8), 1, 256)
            } else {
                (tokens.div_ceil(4), rows.div_ceil(32), 1, 256)
            };
            assert_eq!((gx, gy, gz, block.0), want, "{name} geometry");
            assert!(
                cols % 8 == 0 && xs % 4 == 0 && w % 16 == 0 && x % 16 == 0,
                "{name}: alignment"
            );
            let m = MatvecArgs {
                bf16: name != "mm_tile_f32",
                w,
                rows,
                cols,
                x,
                xs,
                bias,
                out,
                os,
                mode,
            };
            matvec_reference(mem, &m, tokens);
        }
        "moe_group" => {
            a.count(7);
            let (ids, pairs, e_count, tile) = (a.ptr(0), a.int(1), a.int(2), a.int(3));
            let (order, tiles, n_tiles) = (a.ptr(4), a.ptr(5), a.ptr(6));
            assert_eq!((gx, gy, gz), (1, 1, 1), "{name} geometry");
            assert!(
                shared_bytes as usize >= 3 * e_count * 4,
                "{name}: shared memory"
            );
            assert!(tile == 4 || tile == 16, "{name}: tiles of {tile}");
            let id = mem.u32s(ids, pairs);
            let (o, t) = group_reference(&id, e_count, tile);
            mem.put_u32s(order, &o);
            mem.put_u32s(tiles, &t);
            mem.put_u32s(n_tiles, &[(t.len() / 3) as u32]);
        }
        "gate_up_tile_bf16" | "gate_up_tile_f32" | "gate_up_few_bf16" => {
            a.count(11);
            let bf16 = name != "gate_up_tile_f32";
            let (gate, up, rows, cols) = (a.ptr(0), a.ptr(1), a.int(2), a.int(3));
            let (order, tiles, n_tiles, pairs, k) =
                (a.ptr(4), a.ptr(5), a.ptr(6), a.int(7), a.int(8));
            let (xn, act) = (a.ptr(9), a.ptr(10));
            // gate_up_few: a warp per row; gate_up_tile: GU_ROWS (2) rows per warp
            let rows_per_block = if name == "gate_up_few_bf16" { 8 } else { 16 };
            assert_eq!(
                (gy, gz, block.0),
                (rows.div_ceil(rows_per_block), 1, 256),
                "{name} geometry"
            );
            assert!(
                name != "gate_up_few_bf16" || order != 0,
                "{name}: grouped pairs only"
            );
            for (e, qs) in tile_pairs_reference(mem, order, tiles, n_tiles, (pairs, 4), gx) {
                for q in qs {
                    let x = mem.f32s(xn + ((q / k * cols) * 4) as u64, cols);
                    let out = swiglu_rows(mem, gate, up, bf16, e * rows, rows, cols, &x);
                    mem.put_f32s(act + ((q * rows) * 4) as u64, &out);
                }
            }
        }
        "down_tile" | "down_few" => {
            a.count(8);
            let (down, hidden, width) = (a.ptr(0), a.int(1), a.int(2));
            let (order, tiles, n_tiles, act, y) =
                (a.ptr(3), a.ptr(4), a.ptr(5), a.ptr(6), a.ptr(7));
            // both: 8 warps of 4 rows (TILE_ROWS, FEW_DOWN_ROWS)
            assert_eq!(
                (gy, gz, block.0),
                (hidden.div_ceil(32), 1, 256),
                "{name} geometry"
            );
            assert!(order != 0, "{name}: grouped pairs only");
            for (e, qs) in tile_pairs_reference(mem, order, tiles, n_tiles, (0, 4), gx) {
                for q in qs {
                    let x = mem.f32s(act + ((q * width) * 4) as u64, width);
                    let out: Vec<f32> = (0..hidden)
                        .map(|r| dot(&rows_of(mem, down, true, e * hidden + r, width), &x, true))
                        .collect();
                    mem.put_f32s(y + ((q * hidden) * 4) as u64, &out);
                }
            }
        }
        "ls_mm_bf16" | "ls_mm_f32" => {
            a.count(10);
            let (w, rows, cols) = (a.ptr(0), a.int(1), a.int(2));
            let (x, xs, tokens) = (a.ptr(3), a.long(4), a.int(5));
            let (bias, out, os, mode) = (a.ptr(6), a.ptr(7), a.long(8), a.int(9));
            assert_eq!(
                (gx, gy, gz, block.0, shared_bytes),
                (
                    tokens.div_ceil(16),
                    rows.div_ceil(32),
                    1,
                    512,
                    LS_SMEM_BYTES
                ),
                "{name} geometry"
            );
            assert!(
                cols % 8 == 0 && xs % 4 == 0 && w % 16 == 0 && x % 16 == 0,
                "{name}: alignment"
            );
            let m = MatvecArgs {
                bf16: name == "ls_mm_bf16",
                w,
                rows,
                cols,
                x,
                xs,
                bias,
                out,
                os,
                mode,
            };
            matvec_reference(mem, &m, tokens);
        }
        "ls_gate_up_bf16" | "ls_gate_up_f32" => {
            a.count(11);
            let bf16 = name == "ls_gate_up_bf16";
            let (gate, up, rows, cols) = (a.ptr(0), a.ptr(1), a.int(2), a.int(3));
            let (order, tiles, n_tiles, pairs, k) =
                (a.ptr(4), a.ptr(5), a.ptr(6), a.int(7), a.int(8));
            let (xn, act) = (a.ptr(9), a.ptr(10));
            assert_eq!(
                (gy, gz, block.0, shared_bytes),
                (rows.div_ceil(16), 1, 512, LS_SMEM_BYTES),
                "{name} geometry"
            );
            for (e, qs) in tile_pairs_reference(mem, order, tiles, n_tiles, (pairs, 16), gx) {
                assert!(qs.len() <= 16, "{name}: a tile of {} pairs", qs.len());
                for q in qs {
                    let x = mem.f32s(xn + ((q / k * cols) * 4) as u64, cols);
                    let out = swiglu_rows(mem, gate, up, bf16, e * rows, rows, cols, &x);
                    mem.put_f32s(act + ((q * rows) * 4) as u64, &out);
                }
            }
        }
        "ls_down_bf16" => {
            a.count(8);
            let (down, hidden, width) = (a.ptr(0), a.int(1), a.int(2));
            let (order, tiles, n_tiles, act, y) =
                (a.ptr(3), a.ptr(4), a.ptr(5), a.ptr(6), a.ptr(7));
            assert_eq!(
                (gy, gz, block.0, shared_bytes),
                (hidden.div_ceil(32), 1, 512, LS_SMEM_BYTES),
                "{name} geometry"
            );
            assert!(order != 0, "{name}: grouped pairs only");
            for (e, qs) in tile_pairs_reference(mem, order, tiles, n_tiles, (0, 16), gx) {
                assert!(qs.len() <= 16, "{name}: a tile of {} pairs", qs.len());
                for q in qs {
                    let x = mem.f32s(act + ((q * width) * 4) as u64, width);
                    let out: Vec<f32> = (0..hidden)
                        .map(|r| dot(&rows_of(mem, down, true, e * hidden + r, width), &x, true))
                        .collect();
                    mem.put_f32s(y + ((q * hidden) * 4) as u64, &out);
                }
            }
        }
        "attn_scores_d8" | "attn_scores_d16" | "attn_scores_d32" | "attn_scores_d64"
        | "attn_scores_d128" => {
            a.count(14);
            let (q, hq, hkv) = (a.ptr(0), a.int(1), a.int(2));
            let src = TileSrc::of(&a, 3);
            let (scale, sc, ns, mbuf) = (a.float(10), a.ptr(11), a.int(12), a.ptr(13));
            let d: usize = name["attn_scores_d".len()..].parse().expect("width");
            assert_eq!(
                (gy, gz, block.0, shared_bytes as usize),
                (hkv, 1, 256, d * 112 * 4),
                "{name} geometry"
            );
            let hg = hq / hkv;
            for b in 0..gx {
                let tile = src.tile(mem, b, hg);
                for g in 0..hkv {
                    let base = (b * hkv + g) * ns * 64;
                    for r in 0..64 {
                        let mut m = f32::NEG_INFINITY;
                        if let Some((t, pos, (kc, _, cap))) = tile.row(r) {
                            assert!(pos < ns && pos < cap, "{name}: position {pos}");
                            let qv = mem.f32s(q + (((t * hq + g * hg + r % hg) * d) * 4) as u64, d);
                            let keys = kv_rows(mem, kc, g, pos + 1, d);
                            for j in 0..=pos {
                                let s = dot_f32_reference(&qv, &keys[j * d..(j + 1) * d]) * scale;
                                mem.put_f32s(sc + ((base + j * 64 + r) * 4) as u64, &[s]);
                                m = m.max(s);
                            }
                        }
                        mem.put_f32s(mbuf + (((b * hkv + g) * 64 + r) * 4) as u64, &[m]);
                    }
                }
            }
        }
        "attn_softmax" => {
            a.count(13);
            let (hq, hkv) = (a.int(0), a.int(1));
            let src = TileSrc::of(&a, 2);
            let (sc, ns, mbuf, sinks) = (a.ptr(9), a.int(10), a.ptr(11), a.ptr(12));
            assert_eq!((gy, gz, block.0), (hkv, 1, 64), "{name} geometry");
            let hg = hq / hkv;
            for b in 0..gx {
                let tile = src.tile(mem, b, hg);
                for g in 0..hkv {
                    let base = (b * hkv + g) * ns * 64;
                    for r in 0..64 {
                        let Some((_, pos, _)) = tile.row(r) else {
                            continue;
                        };
                        let n = pos + 1;
                        let mut m = mem.f32s(mbuf + (((b * hkv + g) * 64 + r) * 4) as u64, 1)[0];
                        let mut s: Vec<f32> = (0..n)
                            .map(|j| mem.f32s(sc + ((base + j * 64 + r) * 4) as u64, 1)[0])
                            .collect();
                        if sinks != 0 {
                            let sink = mem.f32s(sinks + ((g * hg + r % hg) * 4) as u64, 1)[0];
                            m = m.max(sink);
                            s.push(sink);
                        }
                        let e: Vec<f32> = s.iter().map(|&x| exp(x - m)).collect();
                        let total = sum_reference(&e);
                        for (j, &ej) in e.iter().take(n).enumerate() {
                            mem.put_f32s(sc + ((base + j * 64 + r) * 4) as u64, &[ej / total]);
                        }
                    }
                }
            }
        }
        "attn_pv" => {
            a.count(13);
            let (hq, hkv, d) = (a.int(0), a.int(1), a.int(2));
            let src = TileSrc::of(&a, 3);
            let (sc, ns, o) = (a.ptr(10), a.int(11), a.ptr(12));
            assert_eq!(
                (gy, gz, block.0, shared_bytes),
                (d.div_ceil(32), 4, 512, LS_SMEM_BYTES),
                "{name} geometry"
            );
            let hg = hq / hkv;
            let mut tmp = Vec::new();
            for bg in 0..gx {
                let (b, g) = (bg / hkv, bg % hkv);
                let tile = src.tile(mem, b, hg);
                let base = (b * hkv + g) * ns * 64;
                for r in 0..64 {
                    let Some((t, pos, (_, vc, cap))) = tile.row(r) else {
                        continue;
                    };
                    assert!(pos < cap, "{name}: position {pos}, capacity {cap}");
                    let n = pos + 1;
                    let p: Vec<f32> = (0..n)
                        .map(|j| mem.f32s(sc + ((base + j * 64 + r) * 4) as u64, 1)[0])
                        .collect();
                    let vals = kv_rows(mem, vc, g, n, d);
                    let mut out = vec![0.0f32; d];
                    weighted_row_sum(Kernel::scalar(), &p, &vals, &mut out, &mut tmp);
                    mem.put_f32s(o + (((t * hq + g * hg + r % hg) * d) * 4) as u64, &out);
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
            a.count(17);
            let form = RopeFormRef::read(&a, 13);
            let (q, k, v) = (a.ptr(0), a.ptr(1), a.ptr(2));
            let (hq, hkv, d, rd) = (a.int(3), a.int(4), a.int(5), a.int(6));
            let (cos, sin, pos0, kc, vc, cap) = (
                a.ptr(7),
                a.ptr(8),
                a.int(9),
                a.ptr(10),
                a.ptr(11),
                a.int(12),
            );
            assert_eq!(gx, hq + hkv, "{name} geometry");
            let half = rd / 2;
            for t in 0..gy {
                let pos = pos0 + t;
                let rows = (cos + (pos * half * 4) as u64, sin + (pos * half * 4) as u64);
                rope_reference(
                    mem,
                    [q, k, v],
                    (hq, hkv, d, rd),
                    t,
                    rows,
                    pos,
                    (kc, vc, cap),
                    &form,
                );
            }
        }
        "rope_append_kv_seqs" => {
            a.count(13);
            let form = RopeFormRef::read(&a, 9);
            let (q, k, v) = (a.ptr(0), a.ptr(1), a.ptr(2));
            let (hq, hkv, d, rd) = (a.int(3), a.int(4), a.int(5), a.int(6));
            let (tok, kv) = (a.ptr(7), a.ptr(8));
            assert_eq!(gx, hq + hkv, "{name} geometry");
            for t in 0..gy {
                let (rows, pos, cache) = seq_token(mem, tok, kv, t);
                rope_reference(mem, [q, k, v], (hq, hkv, d, rd), t, rows, pos, cache, &form);
            }
        }
        "attention" => {
            a.count(15);
            let mask = (a.ptr(12), a.int(13), a.int(14));
            let (q, hq, hkv, d) = (a.ptr(0), a.int(1), a.int(2), a.int(3));
            let (kc, vc, cap, pos0, scale) = (a.ptr(4), a.ptr(5), a.int(6), a.int(7), a.float(8));
            let (scratch, ns, o) = (a.ptr(9), a.int(10), a.ptr(11));
            assert_eq!((gx, block.0), (hq, 256), "{name} geometry");
            for t in 0..gy {
                let at = AttnAt {
                    q,
                    o,
                    scratch,
                    ns,
                    scale,
                    t,
                    pos: pos0 + t,
                    cache: (kc, vc, cap),
                    mask,
                };
                attention_reference(mem, (hq, hkv, d), &at);
            }
        }
        "attention_seqs" => {
            a.count(13);
            let mask = (a.ptr(10), a.int(11), a.int(12));
            let (q, hq, hkv, d) = (a.ptr(0), a.int(1), a.int(2), a.int(3));
            let (tok, kv, scale) = (a.ptr(4), a.ptr(5), a.float(6));
            let (scratch, ns, o) = (a.ptr(7), a.int(8), a.ptr(9));
            assert_eq!((gx, block.0), (hq, 256), "{name} geometry");
            for t in 0..gy {
                let (_, pos, cache) = seq_token(mem, tok, kv, t);
                let at = AttnAt {
                    q,
                    o,
                    scratch,
                    ns,
                    scale,
                    t,
                    pos,
                    cache,
                    mask,
                };
                attention_reference(mem, (hq, hkv, d), &at);
            }
        }
        "mla_rope_append" | "mla_rope_append_seqs" => {
            let seqs = name.ends_with("seqs");
            a.count(if seqs { 9 } else { 11 });
            let (q, kva) = (a.ptr(0), a.ptr(1));
            let m = MlaDims {
                hq: a.int(2),
                dn: a.int(3),
                dr: a.int(4),
                dv: 0,
                r: a.int(5),
            };
            let interleave = a.int(6) == 1;
            assert_eq!(gx, m.hq + 1, "{name} geometry");
            for t in 0..gy {
                let (rows, pos, cache) = if seqs {
                    let (rows, pos, (kc, _, _)) = seq_token(mem, a.ptr(7), a.ptr(8), t);
                    (rows, pos, kc)
                } else {
                    let (cos, sin, pos) = (a.ptr(7), a.ptr(8), a.int(9) + t);
                    let half = m.dr / 2;
                    let rows = (cos + (pos * half * 4) as u64, sin + (pos * half * 4) as u64);
                    (rows, pos, a.ptr(10))
                };
                mla_rope_append_ref(mem, m, (q, kva, interleave), t, rows, pos, cache);
            }
        }
        "mla_rope_append_dec" => {
            a.count(11);
            let m = MlaDims {
                hq: a.int(2),
                dn: a.int(3),
                dr: a.int(4),
                dv: 0,
                r: a.int(5),
            };
            assert_eq!((gx, gy), (m.hq + 1, 1), "{name} geometry");
            let pos = mem.u32s(a.ptr(9) + 4, 1)[0] as usize;
            let half = m.dr / 2;
            let rows = (
                a.ptr(7) + (pos * half * 4) as u64,
                a.ptr(8) + (pos * half * 4) as u64,
            );
            let io = (a.ptr(0), a.ptr(1), a.int(6) == 1);
            mla_rope_append_ref(mem, m, io, 0, rows, pos, a.ptr(10));
        }
        "mla_attention_dec_bf16" | "mla_attention_dec_f32" => {
            a.count(13);
            let m = MlaDims {
                hq: a.int(2),
                dn: a.int(3),
                dr: a.int(4),
                dv: a.int(5),
                r: a.int(6),
            };
            assert_eq!((gx, gy, block.0), (m.hq, 1, 256), "{name} geometry");
            let pos = mem.u32s(a.ptr(8) + 4, 1)[0] as usize;
            let io = (a.ptr(0), a.ptr(1), name.ends_with("bf16"));
            let (scale, scratch, ns, o) = (a.float(9), a.ptr(10), a.int(11), a.ptr(12));
            mla_attention_ref(mem, m, io, 0, (a.ptr(7), pos), scale, (scratch, ns), o);
        }
        "mla_attention_bf16"
        | "mla_attention_f32"
        | "mla_attention_seqs_bf16"
        | "mla_attention_seqs_f32" => {
            a.count(13);
            let seqs = name.contains("seqs");
            let bf16 = name.ends_with("bf16");
            let (q, kv_b) = (a.ptr(0), a.ptr(1));
            let m = MlaDims {
                hq: a.int(2),
                dn: a.int(3),
                dr: a.int(4),
                dv: a.int(5),
                r: a.int(6),
            };
            let (scale, scratch, ns, o) = (a.float(9), a.ptr(10), a.int(11), a.ptr(12));
            assert_eq!((gx, block.0), (m.hq, 256), "{name} geometry");
            for t in 0..gy {
                let at = if seqs {
                    let (_, pos, (kc, _, _)) = seq_token(mem, a.ptr(7), a.ptr(8), t);
                    (kc, pos)
                } else {
                    (a.ptr(7), a.int(8) + t)
                };
                mla_attention_ref(mem, m, (q, kv_b, bf16), t, at, scale, (scratch, ns), o);
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
                let l = mem.f32s(logits + ((t * e) * 4) as u64, e);
                route_reference(
                    mem,
                    &l,
                    k,
                    renorm,
                    t,
                    [ids, probs, weights, by_id, kth, next],
                );
            }
        }
        "scale_slots" => {
            a.count(5);
            let (xn, weights, hidden, k, xs) = (a.ptr(0), a.ptr(1), a.int(2), a.int(3), a.ptr(4));
            assert_eq!(gx, k, "{name} geometry");
            for t in 0..gy {
                let x = mem.f32s(xn + ((t * hidden) * 4) as u64, hidden);
                for j in 0..k {
                    let w = mem.f32s(weights + ((t * k + j) * 4) as u64, 1)[0];
                    let y: Vec<f32> = x.iter().map(|&v| v * w).collect();
                    mem.put_f32s(xs + (((t * k + j) * hidden) * 4) as u64, &y);
                }
            }
        }
        "route_topk_first" => {
            a.count(10);
            let (logits, e, k, sig) = (a.ptr(0), a.int(1), a.int(2), a.int(3) == 1);
            let out = [a.ptr(4), a.ptr(5), a.ptr(6), a.ptr(7), a.ptr(8), a.ptr(9)];
            assert!(
                shared_bytes as usize >= (e + 2 * k) * 4,
                "{name}: shared memory"
            );
            for t in 0..gx {
                let l = mem.f32s(logits + ((t * e) * 4) as u64, e);
                let c = RouteChoice::from(super::checks::by_logit_reference(&l, k, sig));
                put_route(mem, &c, k, t, out);
            }
        }
        "route_grouped" => {
            a.count(15);
            let (logits, bias, e, k) = (a.ptr(0), a.ptr(1), a.int(2), a.int(3));
            let (n_group, topk_group, sigmoid_scores, renorm, scale) =
                (a.int(4), a.int(5), a.int(6) == 1, a.int(7) == 1, a.float(8));
            assert!(
                shared_bytes as usize >= (2 * e + 2 * k + n_group) * 4,
                "{name}: shared memory"
            );
            assert_eq!(
                sigmoid_scores,
                bias != 0,
                "{name}: sigmoid scores take the bias"
            );
            let b = (bias != 0).then(|| mem.f32s(bias, e));
            for t in 0..gx {
                let l = mem.f32s(logits + ((t * e) * 4) as u64, e);
                let r = super::checks::grouped_route_reference(
                    &l,
                    b.as_deref(),
                    k,
                    (n_group, topk_group),
                    renorm,
                    scale,
                );
                let c = RouteChoice::from(r);
                let out = [
                    a.ptr(9),
                    a.ptr(10),
                    a.ptr(11),
                    a.ptr(12),
                    a.ptr(13),
                    a.ptr(14),
                ];
                put_route(mem, &c, k, t, out);
            }
        }
        "gate_up_bf16" | "gate_up_f32" => {
            a.count(14);
            let m = ExpertMathRef::act(&a, 8);
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
                for j in 0..k {
                    let x = mem.f32s(xn + ((m.x_row(t, k, j) * cols) * 4) as u64, cols);
                    let e = if ids != 0 {
                        mem.u32s(ids + ((t * k + j) * 4) as u64, 1)[0] as usize
                    } else {
                        0
                    };
                    let out = act_rows(mem, (gate, up, bf16), e * rows, rows, cols, &x, &m, e);
                    mem.put_f32s(act + (((t * k + j) * rows) * 4) as u64, &out);
                }
            }
        }
        "down_mix" => {
            a.count(13);
            let (bd, unweighted) = (a.ptr(11), a.int(12) != 0);
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
                    let shared = (y_sh != 0).then(|| {
                        let s = (s_sh != 0).then(|| mem.f32s(s_sh + (t * 4) as u64, 1)[0]);
                        (s, mem.f32s(y_sh + ((t * hidden + r) * 4) as u64, 1)[0])
                    });
                    let y = |j: usize| {
                        let e = id[j] as usize;
                        let row = rows_of(mem, down, true, e * hidden + r, width);
                        let y = dot(&row, &acts[j], true);
                        if bd != 0 {
                            y + mem.f32s(bd + ((e * hidden + r) * 4) as u64, 1)[0]
                        } else {
                            y
                        }
                    };
                    *hr += mix_row_as(&order, &w, y, shared, unweighted);
                }
                mem.put_f32s(h + ((t * hidden) * 4) as u64, &hv);
            }
        }
        "gate_up_slots" => {
            a.count(15);
            let m = ExpertMathRef::act(&a, 9);
            let (pool, slot_elems, slot_of) = (a.ptr(0), a.long(1), a.ptr(2));
            let (rows, cols, ids, k, xn, act) =
                (a.int(3), a.int(4), a.ptr(5), a.int(6), a.ptr(7), a.ptr(8));
            assert_eq!((gx, gy), (rows.div_ceil(8), k), "{name} geometry");
            for t in 0..gz {
                for j in 0..k {
                    let x = mem.f32s(xn + ((m.x_row(t, k, j) * cols) * 4) as u64, cols);
                    let e = mem.u32s(ids + ((t * k + j) * 4) as u64, 1)[0] as usize;
                    let s = mem.u32s(slot_of + (e * 4) as u64, 1)[0] as i32;
                    if s < 0 {
                        continue;
                    }
                    let gate = pool + (s as usize * slot_elems * 2) as u64;
                    let up = gate + (rows * cols * 2) as u64;
                    let out = act_rows(mem, (gate, up, true), 0, rows, cols, &x, &m, e);
                    mem.put_f32s(act + (((t * k + j) * rows) * 4) as u64, &out);
                }
            }
        }
        "down_slots" => {
            a.count(10);
            let bd = a.ptr(9);
            let (pool, slot_elems, slot_of) = (a.ptr(0), a.long(1), a.ptr(2));
            let (hidden, width, ids, k, act, y) =
                (a.int(3), a.int(4), a.ptr(5), a.int(6), a.ptr(7), a.ptr(8));
            assert_eq!((gx, gy), (hidden.div_ceil(8), k), "{name} geometry");
            for t in 0..gz {
                for j in 0..k {
                    let e = mem.u32s(ids + ((t * k + j) * 4) as u64, 1)[0] as usize;
                    // no slot table: the resident experts' down matrices, stacked by id
                    let down = if slot_of == 0 {
                        pool + ((e * slot_elems) * 2) as u64
                    } else {
                        let s = mem.u32s(slot_of + (e * 4) as u64, 1)[0] as i32;
                        if s < 0 {
                            continue;
                        }
                        pool + ((s as usize * slot_elems + 2 * width * hidden) * 2) as u64
                    };
                    let x = mem.f32s(act + (((t * k + j) * width) * 4) as u64, width);
                    let bias = if bd != 0 {
                        mem.f32s(bd + ((e * hidden) * 4) as u64, hidden)
                    } else {
                        vec![0.0; hidden]
                    };
                    // + bd[e][r] only with biases (adding +0.0 would turn -0.0 into +0.0)
                    let out: Vec<f32> = (0..hidden)
                        .map(|r| {
                            let y = dot(&rows_of(mem, down, true, r, width), &x, true);
                            if bd != 0 {
                                y + bias[r]
                            } else {
                                y
                            }
                        })
                        .collect();
                    mem.put_f32s(y + (((t * k + j) * hidden) * 4) as u64, &out);
                }
            }
        }
        "moe_mix" => {
            a.count(9);
            let unweighted = a.int(8) != 0;
            let (hidden, weights, by_id, k) = (a.int(0), a.ptr(1), a.ptr(2), a.int(3));
            let (y, y_sh, s_sh, h) = (a.ptr(4), a.ptr(5), a.ptr(6), a.ptr(7));
            assert_eq!(gx, hidden.div_ceil(256), "{name} geometry");
            for t in 0..gy {
                let w = mem.f32s(weights + ((t * k) * 4) as u64, k);
                let order = mem.u32s(by_id + ((t * k) * 4) as u64, k);
                let ys: Vec<Vec<f32>> = (0..k)
                    .map(|j| mem.f32s(y + (((t * k + j) * hidden) * 4) as u64, hidden))
                    .collect();
                let mut hv = mem.f32s(h + ((t * hidden) * 4) as u64, hidden);
                for (r, hr) in hv.iter_mut().enumerate() {
                    let shared = (y_sh != 0).then(|| {
                        let s = (s_sh != 0).then(|| mem.f32s(s_sh + (t * 4) as u64, 1)[0]);
                        (s, mem.f32s(y_sh + ((t * hidden + r) * 4) as u64, 1)[0])
                    });
                    *hr += mix_row_as(&order, &w, |j| ys[j][r], shared, unweighted);
                }
                mem.put_f32s(h + ((t * hidden) * 4) as u64, &hv);
            }
        }
        // ---- kernels/decode.cu (one token) ----
        "dmv2_bf16" | "dmv2_f32" | "dmv2w_bf16" | "lmhead2_bf16" | "lmhead2_f32" | "dmv2f_bf16"
        | "dmv2wf_bf16" | "lmhead2f_bf16" | "dmv2fe_bf16" | "dmv2wfe_bf16" | "lmhead2fe_bf16" => {
            let bf16 = name.ends_with("bf16");
            let lm_head = name.starts_with("lmhead");
            a.count(if lm_head { 12 } else { 14 });
            let (w, rows, cols, x, norm, eps) =
                (a.ptr(0), a.int(1), a.int(2), a.ptr(3), a.ptr(4), a.float(5));
            assert!(block.0 == 256 && gy == 1 && gz == 1, "{name} geometry");
            // the unguarded entry points take rows of whole groups only
            let group = if name.starts_with("dmv2wf") {
                4096
            } else {
                2048
            };
            assert!(
                !(name.contains("f_bf16") || name.contains("fe_bf16"))
                    || cols.is_multiple_of(group),
                "{name}: {cols} columns are not whole groups of {group}"
            );
            // the norm's weights are staged beside the input
            let need = if norm != 0 { 2 * cols } else { cols };
            assert!(
                shared_bytes as usize >= need * 4,
                "{name}: shared memory for the input"
            );
            let mut xv = mem.f32s(x, cols);
            if norm != 0 {
                let wv = mem.f32s(norm, cols);
                let ss = dot_f32_reference(&xv, &xv);
                let r = rsqrt(ss / cols as f32 + eps);
                xv = xv.iter().zip(&wv).map(|(&xi, &wi)| wi * (xi * r)).collect();
            }
            let ys: Vec<f32> = (0..rows)
                .map(|r| dot(&rows_of(mem, w, bf16, r, cols), &xv, bf16))
                .collect();
            if lm_head {
                let (logits, counter, pv, pi, st, log) =
                    (a.ptr(6), a.ptr(7), a.ptr(8), a.ptr(9), a.ptr(10), a.ptr(11));
                assert_eq!(mem.u32s(counter, 1)[0], 0, "{name}: counter not reset");
                mem.f32s(pv, gx);
                mem.f32s(pi, gx);
                mem.put_f32s(logits, &ys);
                let tok = tarfa_core::generate::argmax(&ys);
                let state = mem.u32s(st, 4);
                mem.put_u32s(log + (state[2] as u64) * 4, &[tok]);
                mem.put_u32s(st, &[tok, state[1] + 1, state[2] + 1, state[3]]);
            } else {
                let (b0, b1, b2, s1, s2, out, mode, xn_out) = (
                    a.ptr(6),
                    a.ptr(7),
                    a.ptr(8),
                    a.int(9),
                    a.int(10),
                    a.ptr(11),
                    a.int(12),
                    a.ptr(13),
                );
                for (r, &y0) in ys.iter().enumerate() {
                    let (b, i) = if r < s1 {
                        (b0, r)
                    } else if r < s2 {
                        (b1, r - s1)
                    } else {
                        (b2, r - s2)
                    };
                    let y = if b != 0 {
                        y0 + mem.f32s(b + (i * 4) as u64, 1)[0]
                    } else {
                        y0
                    };
                    let o = out + (r * 4) as u64;
                    let v = if mode == 1 { mem.f32s(o, 1)[0] + y } else { y };
                    mem.put_f32s(o, &[v]);
                }
                if xn_out != 0 && norm != 0 {
                    mem.put_f32s(xn_out, &xv);
                }
            }
        }
        "gate_up_dec2_bf16" | "gate_up_dec2_f32" | "gate_up_dec2f_bf16" => {
            a.count(9);
            let bf16 = name.ends_with("bf16");
            let (gate, up, rows, cols, ids, x, norm, eps, act) = (
                a.ptr(0),
                a.ptr(1),
                a.int(2),
                a.int(3),
                a.ptr(4),
                a.ptr(5),
                a.ptr(6),
                a.float(7),
                a.ptr(8),
            );
            assert!(block.0 == 256 && gz == 1, "{name} geometry");
            assert!(
                name != "gate_up_dec2f_bf16" || cols.is_multiple_of(2048),
                "{name}: {cols} columns are not whole groups"
            );
            assert!(
                shared_bytes as usize >= if norm != 0 { 2 } else { 1 } * cols * 4,
                "{name}: shared memory"
            );
            let mut xv = mem.f32s(x, cols);
            if norm != 0 {
                let wv = mem.f32s(norm, cols);
                let ss = dot_f32_reference(&xv, &xv);
                let r = rsqrt(ss / cols as f32 + eps);
                xv = xv.iter().zip(&wv).map(|(&xi, &wi)| wi * (xi * r)).collect();
            }
            for j in 0..gy {
                let e = if ids != 0 {
                    mem.u32s(ids + (j * 4) as u64, 1)[0] as usize
                } else {
                    0
                };
                let out = swiglu_rows(mem, gate, up, bf16, e * rows, rows, cols, &xv);
                mem.put_f32s(act + ((j * rows) * 4) as u64, &out);
            }
        }
        "gate_up_route2_bf16" | "gate_up_route2f_bf16" => {
            a.count(16);
            let (gate, up, rows, cols, x, act) =
                (a.ptr(0), a.ptr(1), a.int(2), a.int(3), a.ptr(4), a.ptr(5));
            let (logits, e_count, k, renorm) = (a.ptr(6), a.int(7), a.int(8), a.int(9) == 1);
            assert!(
                block.0 == 256 && gz == 1 && gy == k && k <= 8,
                "{name} geometry"
            );
            assert!(
                name != "gate_up_route2f_bf16" || cols.is_multiple_of(2048),
                "{name}: {cols} columns are not whole groups"
            );
            assert!(
                shared_bytes as usize >= (cols + 3 * e_count) * 4,
                "{name}: shared memory"
            );
            let l = mem.f32s(logits, e_count);
            let out = [
                a.ptr(10),
                a.ptr(11),
                a.ptr(12),
                a.ptr(13),
                a.ptr(14),
                a.ptr(15),
            ];
            route_reference(mem, &l, k, renorm, 0, out);
            let ids = mem.u32s(out[0], k);
            let xv = mem.f32s(x, cols);
            for (j, &e) in ids.iter().enumerate() {
                let y = swiglu_rows(mem, gate, up, true, e as usize * rows, rows, cols, &xv);
                mem.put_f32s(act + ((j * rows) * 4) as u64, &y);
            }
        }
        "moe_down_dec2" | "moe_down_dec2f8" | "moe_down_route2f8e" => {
            // moe_down_route2f8e: the router's choice recomputed from its logits (3 more
            // arguments), the records unused
            let route = name == "moe_down_route2f8e";
            a.count(if route { 14 } else { 11 });
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
            assert!(block.0 == 256 && gy == 1, "{name} geometry");
            assert!(
                !name.contains("2f8") || (k == 8 && width.is_multiple_of(256)),
                "{name}: k {k}, width {width}"
            );
            let e_count = if route { a.int(12) } else { 0 };
            assert!(
                k <= 8 && shared_bytes as usize >= (k * width + 3 * e_count) * 4,
                "{name}: shared"
            );
            let (id, w, order) = if route {
                let l = mem.f32s(a.ptr(11), e_count);
                let c = route_choice(&l, k, a.int(13) == 1);
                (c.ids, c.weights, c.by_id)
            } else {
                (mem.u32s(ids, k), mem.f32s(weights, k), mem.u32s(by_id, k))
            };
            let acts: Vec<Vec<f32>> = (0..k)
                .map(|j| mem.f32s(act + ((j * width) * 4) as u64, width))
                .collect();
            let mut hv = mem.f32s(h, hidden);
            for (r, hr) in hv.iter_mut().enumerate() {
                let shared = (y_sh != 0).then(|| {
                    let s = (s_sh != 0).then(|| mem.f32s(s_sh, 1)[0]);
                    (s, mem.f32s(y_sh + (r * 4) as u64, 1)[0])
                });
                let y = |j: usize| {
                    let row = rows_of(mem, down, true, id[j] as usize * hidden + r, width);
                    dot(&row, &acts[j], true)
                };
                *hr += mix_row(&order, &w, y, shared);
            }
            mem.put_f32s(h, &hv);
        }
        "attn_decode4_d32" | "attn_decode4_d64" | "attn_decode4_d128" | "attn_decode4_d256"
        | "attn_decode4p_d32" | "attn_decode4p_d64" | "attn_decode4p_d128"
        | "attn_decode4p_d256" => {
            // attn_decode4p: partial rotary, the rotated width as a 20th argument
            let partial = name.starts_with("attn_decode4p");
            a.count(if partial { 20 } else { 19 });
            let (qr, kr, vr, hq, hkv, d) =
                (a.ptr(0), a.ptr(1), a.ptr(2), a.int(3), a.int(4), a.int(5));
            let (qn, kn, eps, cos, sin, st) = (
                a.ptr(6),
                a.ptr(7),
                a.float(8),
                a.ptr(9),
                a.ptr(10),
                a.ptr(11),
            );
            let (kc, vc, cap, scale, scratch, ns, o) = (
                a.ptr(12),
                a.ptr(13),
                a.int(14),
                a.float(15),
                a.ptr(16),
                a.int(17),
                a.ptr(18),
            );
            // blocks of 512, D <= X (the smallest X that takes D)
            assert_eq!(
                (gx, gy, block.0),
                (hq, d.div_ceil(32), 512),
                "{name} geometry"
            );
            assert!(
                name == super::model::decode::attn_decode4_name(d)
                    || name == super::model::decode::attn_decode4p_name(d),
                "{name}: head dimension {d}"
            );
            let rd = if partial { a.int(19) } else { d };
            assert!(rd <= d && rd % 2 == 0, "{name}: rotary width {rd}");
            assert!(d <= 256 && d % 2 == 0, "{name}: head dimension {d}");
            // scores and probabilities (2 x ns floats) in shared memory unless a scratch row
            // pair is given
            assert!(
                scratch != 0 || shared_bytes as usize >= 2 * ns * 4,
                "{name}: shared memory for {ns} scores"
            );
            let pos = mem.u32s(st + 4, 1)[0] as usize;
            let n = pos + 1;
            assert!(
                n <= cap && n <= ns,
                "{name}: position {pos}, capacity {cap}"
            );
            assert_eq!((qn == 0), (kn == 0), "{name}: q and k norms come together");
            let half = rd / 2;
            let c = mem.f32s(cos + (pos * half * 4) as u64, half);
            let s = mem.f32s(sin + (pos * half * 4) as u64, half);
            let prep = |mem: &mut Memory, addr: u64, nw: u64| -> Vec<f32> {
                let mut x = mem.f32s(addr, d);
                if nw != 0 {
                    let wv = mem.f32s(nw, d);
                    let r = rsqrt(dot_f32_reference(&x, &x) / d as f32 + eps);
                    x = x.iter().zip(&wv).map(|(&xi, &wi)| wi * (xi * r)).collect();
                }
                for i in 0..half {
                    let (p0, r0) = (x[i], x[i + half]);
                    x[i] = p0 * c[i] - r0 * s[i];
                    x[i + half] = r0 * c[i] + p0 * s[i];
                }
                x
            };
            for kh in 0..hkv {
                let kx = prep(mem, kr + ((kh * d) * 4) as u64, kn);
                let at = kv_row(mem, kc, kh, pos, d);
                mem.put_f32s(at, &kx);
                let vv = mem.f32s(vr + ((kh * d) * 4) as u64, d);
                let at = kv_row(mem, vc, kh, pos, d);
                mem.put_f32s(at, &vv);
            }
            let mut tmp = Vec::new();
            for h in 0..hq {
                let kvh = h / (hq / hkv);
                let qv = prep(mem, qr + ((h * d) * 4) as u64, qn);
                let keys = kv_rows(mem, kc, kvh, n, d);
                let vals = kv_rows(mem, vc, kvh, n, d);
                let sc: Vec<f32> = (0..n)
                    .map(|j| dot_f32_reference(&qv, &keys[j * d..(j + 1) * d]) * scale)
                    .collect();
                let pr = softmax(&sc);
                if scratch != 0 {
                    // what attn_decode4 leaves in its row pair: e_j, then p_j
                    let m = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let e: Vec<f32> = sc.iter().map(|&x| exp(x - m)).collect();
                    for sl in 0..gy {
                        let row = scratch + (((h * gy + sl) * 2 * ns) * 4) as u64;
                        mem.put_f32s(row, &e);
                        mem.put_f32s(row + (ns * 4) as u64, &pr);
                    }
                }
                let mut out = vec![0.0f32; d];
                weighted_row_sum(Kernel::scalar(), &pr, &vals, &mut out, &mut tmp);
                mem.put_f32s(o + (((h * d) * 4) as u64), &out);
            }
        }
        "probe_nop" => a.count(1),
        "probe_exp" | "probe_silu" | "probe_sigmoid" | "probe_rsqrt" | "probe_softplus" => {
            a.count(3);
            let (x, y, n) = (a.ptr(0), a.ptr(1), a.long(2));
            let f: fn(f32) -> f32 = match name {
                "probe_exp" => exp,
                "probe_silu" => silu,
                "probe_sigmoid" => sigmoid,
                "probe_softplus" => softplus,
                _ => rsqrt,
            };
            let v: Vec<f32> = mem.f32s(x, n).into_iter().map(f).collect();
            mem.put_f32s(y, &v);
        }
        "linear_unpack" => {
            a.count(10);
            let (qkvz, ba) = (a.ptr(0), a.ptr(1));
            let (hk, dk, r, dv) = (a.int(2), a.int(3), a.int(4), a.int(5));
            let (qkv, z, b, av) = (a.ptr(6), a.ptr(7), a.ptr(8), a.ptr(9));
            assert_eq!(block.0, 256, "{name} geometry");
            let (kw, rv, hv) = (hk * dk, r * dv, hk * r);
            let group = 2 * dk + 2 * rv;
            let c = 2 * kw + hk * rv;
            for t in 0..gx {
                let p = mem.f32s(qkvz + (t * hk * group * 4) as u64, hk * group);
                let bat = mem.f32s(ba + (t * 2 * hv * 4) as u64, 2 * hv);
                let (mut q, mut zz) = (vec![0.0f32; c], vec![0.0f32; hk * rv]);
                let (mut bb, mut aa) = (vec![0.0f32; hv], vec![0.0f32; hv]);
                for g in 0..hk {
                    let src = &p[g * group..(g + 1) * group];
                    q[g * dk..(g + 1) * dk].copy_from_slice(&src[..dk]);
                    q[kw + g * dk..kw + (g + 1) * dk].copy_from_slice(&src[dk..2 * dk]);
                    q[2 * kw + g * rv..2 * kw + (g + 1) * rv]
                        .copy_from_slice(&src[2 * dk..2 * dk + rv]);
                    zz[g * rv..(g + 1) * rv].copy_from_slice(&src[2 * dk + rv..]);
                    bb[g * r..(g + 1) * r].copy_from_slice(&bat[2 * g * r..(2 * g + 1) * r]);
                    aa[g * r..(g + 1) * r].copy_from_slice(&bat[(2 * g + 1) * r..(2 * g + 2) * r]);
                }
                mem.put_f32s(qkv + (t * c * 4) as u64, &q);
                mem.put_f32s(z + (t * hk * rv * 4) as u64, &zz);
                mem.put_f32s(b + (t * hv * 4) as u64, &bb);
                mem.put_f32s(av + (t * hv * 4) as u64, &aa);
            }
        }
        "linear_conv" => {
            a.count(10);
            let (x, xs, tokens, c, taps) = (a.ptr(0), a.long(1), a.int(2), a.int(3), a.int(4));
            let (w, src, dst, y, ys) = (a.ptr(5), a.ptr(6), a.ptr(7), a.ptr(8), a.long(9));
            assert_eq!((gx, block.0), (c.div_ceil(256), 256), "{name} geometry");
            let s = super::ops::LinearShape {
                hk: 1,
                hv: 1,
                dk: 0,
                dv: c,
                taps,
            };
            let n = (taps - 1) * c;
            let mut state = if src == 0 {
                vec![0.0; n]
            } else {
                mem.f32s(src, n)
            };
            let xv: Vec<f32> = (0..tokens)
                .flat_map(|t| mem.f32s(x + (t * xs * 4) as u64, c))
                .collect();
            let wv = mem.f32s(w, c * taps);
            let yv = super::checks::conv_reference(s, &xv, &wv, &mut state);
            if n > 0 {
                mem.put_f32s(dst, &state);
            }
            for (t, row) in yv.chunks_exact(c).enumerate() {
                mem.put_f32s(y + (t * ys * 4) as u64, row);
            }
        }
        "linear_qk_norm" => {
            a.count(7);
            let (x, stride, tokens, hk, dk) = (a.ptr(0), a.long(1), a.int(2), a.int(3), a.int(4));
            let (eps, scale) = (a.float(5), a.float(6));
            assert_eq!(
                (gx, block.0),
                ((tokens * 2 * hk).div_ceil(8), 256),
                "{name} geometry"
            );
            let s = super::ops::LinearShape {
                hk,
                hv: hk,
                dk,
                dv: 0,
                taps: 1,
            };
            for t in 0..tokens {
                let at = x + (t * stride * 4) as u64;
                let mut row = mem.f32s(at, 2 * hk * dk);
                super::checks::qk_norm_reference(s, &mut row, eps, scale);
                mem.put_f32s(at, &row);
            }
        }
        "linear_recur" => {
            a.count(14);
            let (qkv, stride, b, av, a_log, dt_bias) =
                (a.ptr(0), a.long(1), a.ptr(2), a.ptr(3), a.ptr(4), a.ptr(5));
            let (tokens, hk, hv, dk, dv) = (a.int(6), a.int(7), a.int(8), a.int(9), a.int(10));
            let (src, dst, o) = (a.ptr(11), a.ptr(12), a.ptr(13));
            assert_eq!(
                (gx, block.0),
                ((hv * dv).div_ceil(8), 256),
                "{name} geometry"
            );
            let s = super::ops::LinearShape {
                hk,
                hv,
                dk,
                dv,
                taps: 1,
            };
            let n = s.state_len();
            let mut state = if src == 0 {
                vec![0.0; n]
            } else {
                mem.f32s(src, n)
            };
            let (al, dt) = (mem.f32s(a_log, hv), mem.f32s(dt_bias, hv));
            for t in 0..tokens {
                let row = mem.f32s(qkv + (t * stride * 4) as u64, s.channels());
                let bt = mem.f32s(b + (t * hv * 4) as u64, hv);
                let at = mem.f32s(av + (t * hv * 4) as u64, hv);
                let ot =
                    super::checks::recur_reference(s, &row, (&bt, &at), (&al, &dt), &mut state);
                mem.put_f32s(o + (t * hv * dv * 4) as u64, &ot);
            }
            mem.put_f32s(dst, &state);
        }
        "silu_gate" => {
            a.count(3);
            let (y, z, n) = (a.ptr(0), a.ptr(1), a.long(2));
            assert!(gx * 256 >= n, "{name} geometry");
            let zv = mem.f32s(z, n);
            let v: Vec<f32> = mem
                .f32s(y, n)
                .into_iter()
                .zip(zv)
                .map(|(yi, zi)| yi * silu(zi))
                .collect();
            mem.put_f32s(y, &v);
        }
        "split_query_gate" | "sigmoid_gate" => {
            a.count(4);
            // split_query_gate(qg, hq, d, q); sigmoid_gate(o, qg, hq, d)
            let (out, qg, hq, d) = if name == "split_query_gate" {
                (a.ptr(3), a.ptr(0), a.int(1), a.int(2))
            } else {
                (a.ptr(0), a.ptr(1), a.int(2), a.int(3))
            };
            assert_eq!(block.0, 256, "{name} geometry");
            for t in 0..gx {
                let g = mem.f32s(qg + (t * 2 * hq * d * 4) as u64, 2 * hq * d);
                let at = out + (t * hq * d * 4) as u64;
                let v: Vec<f32> = if name == "split_query_gate" {
                    g.chunks_exact(2 * d)
                        .flat_map(|h| h[..d].to_vec())
                        .collect()
                } else {
                    let o = mem.f32s(at, hq * d);
                    g.chunks_exact(2 * d)
                        .flat_map(|h| h[d..].iter().map(|&x| sigmoid(x)))
                        .zip(o)
                        .map(|(sg, x)| x * sg)
                        .collect()
                };
                mem.put_f32s(at, &v);
            }
        }
        "clip_abs" => {
            a.count(3);
            let (x, n, c) = (a.ptr(0), a.long(1), a.float(2));
            assert!(gx * 256 >= n, "{name} geometry");
            let v: Vec<f32> = mem
                .f32s(x, n)
                .into_iter()
                .map(|v| v.min(c).max(-c))
                .collect();
            mem.put_f32s(x, &v);
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
            return Err(CudaError::Internal(format!(
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
    use tarfa_core::config::MoeConfig;
    use tarfa_core::model::ArchSpec;
    use tarfa_core::numerics::Kernel;
    use tarfa_core::weights::{load_safetensors_dir, WeightSource};
    use tarfa_cpu::{CpuEngine, CpuModel, EngineOptions};

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
        let gpu = CudaModel::load_on(Gpu::mock(), cfg, src, None).unwrap();
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
    fn every_decode_mode_gives_the_cpus_bits_and_greedy_tokens() {
        for family in ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"] {
            decode_modes_match_the_cpu(family, SyntheticShape::small(family));
        }
    }

    #[test]
    fn greedy_steps_choose_the_cpus_tokens_without_copying_logits() {
        // CudaModel::greedy_step (tarfa-run generate's path when it writes no logits): in every
        // decode mode, each step's token is the CPU's greedy token and its statistics are those
        // forward() reports for the same step
        use crate::DecodeMode;
        use tarfa_core::step::{ForwardOptions, LogitRows};
        let last = ForwardOptions {
            logits: LogitRows::Last,
            ..Default::default()
        };
        for family in ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"] {
            let (cfg, src) = random_model(&SyntheticShape::small(family), 13);
            let src: Arc<dyn WeightSource> = Arc::new(src);
            let prompt: Vec<u32> = (0..7).map(|i| (i * 53 % cfg.vocab_size) as u32).collect();
            let (_, toks) = cpu_greedy(&cfg, &src, &prompt, 3);
            let gpu = CudaModel::load_on(Gpu::mock(), cfg.clone(), src.clone(), None).unwrap();
            for mode in DecodeMode::ALL {
                let (mut a, mut b) = (gpu.new_cache().unwrap(), gpu.new_cache().unwrap());
                a.set_decode_mode(mode);
                b.set_decode_mode(mode);
                gpu.forward(&mut a, &prompt, &last).unwrap();
                gpu.forward(&mut b, &prompt, &last).unwrap();
                for j in 0..3 {
                    let (t, stats) = gpu.greedy_step(&mut a, toks[j]).unwrap();
                    assert_eq!(t, toks[j + 1], "{family} {mode:?} step {j}");
                    let f = gpu.forward(&mut b, &[toks[j]], &last).unwrap();
                    assert_eq!(stats, f.stats, "{family} {mode:?} step {j}");
                    assert!(stats.weight_bytes > 0);
                }
                assert_eq!(a.len(), prompt.len() + 3);
            }
            let mut a = gpu.new_cache().unwrap();
            gpu.forward(&mut a, &prompt, &last).unwrap();
            assert!(gpu.greedy_step(&mut a, cfg.vocab_size as u32).is_err());
        }
    }

    #[test]
    fn the_decode_kernels_handle_wide_rows_and_partial_chunks() {
        // rows of several 8-chunk load groups with a partial last chunk (hidden 2304 = 9 x 256;
        // q values 12 x 200 = 2400 = 9 x 256 + 96), an expert width of 2 chunks + 8, a dense
        // width of 3 chunks + 8, and a head dimension of 200 (7 slices of 32, the last of 8)
        for family in ["qwen3_moe", "qwen2_moe"] {
            let shape = SyntheticShape {
                layers: 2,
                hidden: 2304,
                heads: 12,
                kv_heads: 4,
                head_dim: 200,
                experts: 10,
                top_k: 3,
                expert_width: 520,
                dense_width: 776,
                vocab: 600,
                decoder_sparse_step: 1,
                mlp_only_layers: if family == "qwen3_moe" {
                    vec![1]
                } else {
                    vec![]
                },
                ..SyntheticShape::small(family)
            };
            // on the emulator only the default mode's kernels (CI time: the wide shape's
            // legacy-mode decode steps run the prefill's kernels, which every prompt here already
            // runs; the fallback modes' kernels, loading after the wait, run on the emulator at
            // the small shapes of every_decode_mode_gives_the_cpus_bits_and_greedy_tokens, and at
            // this shape on the GPU machine's selftests)
            if super::emulated() {
                modes_match_the_cpu(family, shape, &[crate::DecodeMode::GraphPdl]);
            } else {
                decode_modes_match_the_cpu(family, shape);
            }
        }
    }

    #[test]
    fn attention_with_its_scores_in_global_memory_gives_the_cpus_bits() {
        // attn_decode4 keeps a context's scores in shared memory up to 96 KiB (12,288 positions)
        // and in the global scratch rows beyond: the scratch path on short contexts (the limit
        // set to 0), at D = X (the short shape's 32) and below it (the wide shape's 200 of 256)
        use super::super::model::decode::ATTN_SHARED_MAX_FOR_TEST;
        let wide = SyntheticShape {
            layers: 2,
            hidden: 2304,
            heads: 12,
            kv_heads: 4,
            head_dim: 200,
            experts: 10,
            top_k: 3,
            expert_width: 520,
            dense_width: 776,
            vocab: 600,
            decoder_sparse_step: 1,
            mlp_only_layers: vec![1],
            ..SyntheticShape::small("qwen3_moe")
        };
        // the modes that run the decode kernels (with and without programmatic launch)
        let modes = [crate::DecodeMode::Direct, crate::DecodeMode::GraphPdl];
        ATTN_SHARED_MAX_FOR_TEST.with(|c| c.set(Some(0)));
        modes_match_the_cpu("qwen3_moe", SyntheticShape::small("qwen3_moe"), &modes);
        // on the emulator the wide shape takes minutes (CI time); the kernel's scratch path
        // below X is checked there launch by launch (attn_decode4_writes_the_references_bits:
        // D 48 and 24 with scratch rows)
        if !super::emulated() {
            modes_match_the_cpu("qwen3_moe", wide, &modes);
        }
        ATTN_SHARED_MAX_FOR_TEST.with(|c| c.set(None));
    }

    /// `n` floats in [lo, hi) from a xorshift64 stream: test inputs that are the same on every
    /// run and machine.
    fn uniform_floats(mut seed: u64) -> impl FnMut(usize, f32, f32) -> Vec<f32> {
        move |n, lo, hi| {
            (0..n)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    lo + (hi - lo) * ((seed >> 40) as f32 / (1u64 << 24) as f32)
                })
                .collect()
        }
    }

    #[test]
    fn every_row_kernel_writes_the_references_bits() {
        // Each row kernel -- guarded, unguarded (`f`: rows of whole groups) and early (`e`:
        // first weights before the wait) -- one launch each on the same random inputs (warps
        // taking several rows, norms, residuals, a shared expert) against the reference
        // functions (the CPU's operations): every output bit equal. With the CUDA emulator these
        // are the real kernels; without it, the reference's geometry, bounds and whole-group
        // checks. (The whole-model tests cover the unguarded kernels only where a small shape
        // allows them; the H200 selftests cover them at the benchmark's shape.)
        use super::{launch, launch_reference, Arg, Memory};
        let mut rnd = uniform_floats(0x9e37_79b9_7f4a_7c15u64);
        let mut mem = Memory::default();
        let mut f32buf = |mem: &mut Memory, n: usize, lo: f32, hi: f32| {
            let a = mem.alloc(4 * n);
            mem.put_f32s(a, &rnd(n, lo, hi));
            a
        };
        let bf16buf = |mem: &mut Memory, v: Vec<f32>| {
            let bytes: Vec<u8> = v
                .iter()
                .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
                .collect();
            let a = mem.alloc(bytes.len());
            mem.write(a, &bytes);
            a
        };
        let f = |v: f32| Arg::F32(v);
        let i = |v: usize| Arg::I32(v as i32);
        // (pairs of kernels, grid, shared bytes, arguments, outputs: (address, words, initial))
        type Out = (u64, usize, Vec<u32>);
        type Case = ([&'static str; 2], (u32, u32), u32, Vec<Arg>, Vec<Out>);
        let mut cases: Vec<Case> = Vec::new();
        let snapshot = |mem: &mut Memory, a: u64, n: usize| -> Out { (a, n, mem.u32s(a, n)) };
        // dmv2 over 2,048 columns with a norm and a residual; dmv2w over 4,096 without a norm
        for (pair, rows, cols, norm) in [
            (["dmv2_bf16", "dmv2f_bf16"], 40, 2048, true),
            (["dmv2w_bf16", "dmv2wf_bf16"], 20, 4096, false),
        ] {
            let w = bf16buf(
                &mut mem,
                (0..rows * cols)
                    .map(|k| ((k * 7919) % 201) as f32 / 100.0 - 1.0)
                    .collect(),
            );
            let x = f32buf(&mut mem, cols, -2.0, 2.0);
            let nw = if norm {
                f32buf(&mut mem, cols, 0.5, 1.5)
            } else {
                0
            };
            let out = f32buf(&mut mem, rows, -1.0, 1.0);
            let xn = mem.alloc(4 * cols);
            let outs = vec![snapshot(&mut mem, out, rows), snapshot(&mut mem, xn, cols)];
            let args = vec![
                Arg::Ptr(w),
                i(rows),
                i(cols),
                Arg::Ptr(x),
                Arg::Ptr(nw),
                f(1e-6),
                Arg::Ptr(0),
                Arg::Ptr(0),
                Arg::Ptr(0),
                i(rows),
                i(rows),
                Arg::Ptr(out),
                i(1),
                Arg::Ptr(xn),
            ];
            let shared = (4 * cols * if norm { 2 } else { 1 }) as u32;
            cases.push((pair, (2, 1), shared, args, outs));
        }
        // the lm_head: logits and the greedy token in the state
        {
            let (rows, cols) = (100, 2048);
            let w = bf16buf(
                &mut mem,
                (0..rows * cols)
                    .map(|k| ((k * 104729) % 199) as f32 / 99.0 - 1.0)
                    .collect(),
            );
            let x = f32buf(&mut mem, cols, -2.0, 2.0);
            let nw = f32buf(&mut mem, cols, 0.5, 1.5);
            let logits = mem.alloc(4 * rows);
            let counter = mem.alloc(4);
            let (pv, pi) = (mem.alloc(4 * 3), mem.alloc(4 * 3));
            let st = mem.alloc(16);
            mem.put_u32s(st, &[5, 9, 2, 0]);
            let log = mem.alloc(4 * 8);
            let outs = vec![
                snapshot(&mut mem, logits, rows),
                snapshot(&mut mem, st, 4),
                snapshot(&mut mem, log, 8),
            ];
            let args = vec![
                Arg::Ptr(w),
                i(rows),
                i(cols),
                Arg::Ptr(x),
                Arg::Ptr(nw),
                f(1e-6),
                Arg::Ptr(logits),
                Arg::Ptr(counter),
                Arg::Ptr(pv),
                Arg::Ptr(pi),
                Arg::Ptr(st),
                Arg::Ptr(log),
            ];
            cases.push((
                ["lmhead2_bf16", "lmhead2f_bf16"],
                (3, 1),
                (8 * cols) as u32,
                args,
                outs,
            ));
        }
        // the experts' gate/up (k = 8 slots of 10 experts) and down (widths of 1 and 3 chunks,
        // with and without a shared expert)
        let (experts, k, hidden) = (10usize, 8usize, 2048usize);
        let ids = mem.alloc(4 * k);
        mem.put_u32s(ids, &[7, 2, 9, 0, 4, 8, 1, 5]);
        let by_id = mem.alloc(4 * k);
        mem.put_u32s(by_id, &[3, 6, 1, 4, 7, 2, 5, 0]); // slots in ascending expert id
        let weights = f32buf(&mut mem, k, 0.0, 0.3);
        {
            let rows = 24;
            let n = experts * rows * hidden;
            let gate = bf16buf(
                &mut mem,
                (0..n)
                    .map(|q| ((q * 31) % 97) as f32 / 48.0 - 1.0)
                    .collect(),
            );
            let up = bf16buf(
                &mut mem,
                (0..n)
                    .map(|q| ((q * 17) % 89) as f32 / 44.0 - 1.0)
                    .collect(),
            );
            let x = f32buf(&mut mem, hidden, -1.0, 1.0);
            let act = mem.alloc(4 * k * rows);
            let outs = vec![snapshot(&mut mem, act, k * rows)];
            let args = vec![
                Arg::Ptr(gate),
                Arg::Ptr(up),
                i(rows),
                i(hidden),
                Arg::Ptr(ids),
                Arg::Ptr(x),
                Arg::Ptr(0),
                f(1e-6),
                Arg::Ptr(act),
            ];
            cases.push((
                ["gate_up_dec2_bf16", "gate_up_dec2f_bf16"],
                (2, k as u32),
                (4 * hidden) as u32,
                args,
                outs,
            ));
        }
        for (width, shared_expert) in [(768usize, false), (256, true)] {
            let rows = 40;
            let down = bf16buf(
                &mut mem,
                (0..experts * rows * width)
                    .map(|q| ((q * 13) % 101) as f32 / 50.0 - 1.0)
                    .collect(),
            );
            let act = f32buf(&mut mem, k * width, -1.0, 1.0);
            let (y_sh, s_sh) = if shared_expert {
                (
                    f32buf(&mut mem, rows, -1.0, 1.0),
                    f32buf(&mut mem, 1, -1.0, 1.0),
                )
            } else {
                (0, 0)
            };
            let h = f32buf(&mut mem, rows, -1.0, 1.0);
            let outs = vec![snapshot(&mut mem, h, rows)];
            let args = vec![
                Arg::Ptr(down),
                i(rows),
                i(width),
                Arg::Ptr(ids),
                Arg::Ptr(weights),
                Arg::Ptr(by_id),
                i(k),
                Arg::Ptr(act),
                Arg::Ptr(y_sh),
                Arg::Ptr(s_sh),
                Arg::Ptr(h),
            ];
            cases.push((
                ["moe_down_dec2", "moe_down_dec2f8"],
                (2, 1),
                (4 * k * width) as u32,
                args,
                outs,
            ));
        }
        // the `e` entry points (first weights before the wait), on the inputs of the `f` ones
        let early: Vec<Case> = cases
            .iter()
            .filter_map(|c| {
                let e = match c.0[1] {
                    "dmv2f_bf16" => "dmv2fe_bf16",
                    "dmv2wf_bf16" => "dmv2wfe_bf16",
                    "lmhead2f_bf16" => "lmhead2fe_bf16",
                    _ => return None,
                };
                Some(([c.0[1], e], c.1, c.2, c.3.clone(), c.4.clone()))
            })
            .collect();
        assert_eq!(early.len(), 3);
        cases.extend(early);
        let mut checked = std::collections::BTreeSet::new();
        for (pair, grid, shared, args, outs) in &cases {
            for name in pair {
                let mut got: Vec<Vec<u32>> = Vec::new();
                for reference in [true, false] {
                    for (a, _, init) in outs {
                        mem.put_u32s(*a, init);
                    }
                    let geometry = ((grid.0, grid.1, 1), (256, 1, 1), *shared);
                    if reference {
                        launch_reference(&mut mem, name, geometry.0, geometry.1, geometry.2, args)
                    } else {
                        launch(&mut mem, name, geometry.0, geometry.1, geometry.2, args)
                    }
                    .unwrap();
                    got.push(outs.iter().flat_map(|(a, n, _)| mem.u32s(*a, *n)).collect());
                }
                assert_eq!(got[0], got[1], "{name} differs from the reference");
                let changed = outs
                    .iter()
                    .flat_map(|(_, _, init)| init.iter())
                    .zip(&got[0])
                    .filter(|(a, b)| a != b)
                    .count();
                assert!(changed > 0, "{name}: no output written");
                checked.insert(*name);
            }
        }
        // every row kernel of the launch list (the lm_head's F32 form and gate_up_dec2_f32 run
        // in the whole-model tests)
        for name in [
            "dmv2_bf16",
            "dmv2f_bf16",
            "dmv2fe_bf16",
            "dmv2w_bf16",
            "dmv2wf_bf16",
            "dmv2wfe_bf16",
            "lmhead2_bf16",
            "lmhead2f_bf16",
            "lmhead2fe_bf16",
            "gate_up_dec2_bf16",
            "gate_up_dec2f_bf16",
            "moe_down_dec2",
            "moe_down_dec2f8",
        ] {
            assert!(checked.contains(name), "{name} not checked");
        }
    }

    #[test]
    fn the_folded_top_k_writes_the_references_records_and_activations() {
        // gate_up_route2/2f (the router's top-k in the experts' gate+up kernel) against the
        // reference functions (the CPU router's choice, then the experts' SwiGLU rows) on the
        // same logits and weights: the six records and every activation bit equal. Shapes:
        // 128 experts top-8 (the benchmark's), 300 experts (keys read 4 at a time over more
        // than 256 experts), 10 experts top-3 with equal logits (ties broken by the lower id),
        // 6 experts top-6 (next is NaN). With the CUDA emulator these are the real kernels.
        use super::{launch, launch_reference, Arg, Memory};
        let mut rnd = uniform_floats(0x2545_f491_4f6c_dd1du64);
        let mut mem = Memory::default();
        let i = |v: usize| Arg::I32(v as i32);
        for (experts, k, rows, cols, ties) in [
            (128usize, 8usize, 24usize, 2048usize, false),
            (300, 8, 16, 2048, false),
            (10, 3, 20, 512 + 8, true),
            (6, 6, 8, 256, false),
        ] {
            let mut l = rnd(experts, -4.0, 4.0);
            if ties {
                for e in [3, 5, 8] {
                    l[e] = l[1];
                }
                l[1] = 5.0;
                l[3] = 5.0;
            }
            let logits = mem.alloc(4 * experts);
            mem.put_f32s(logits, &l);
            let bf16 = |v: Vec<f32>| -> Vec<u8> {
                v.iter()
                    .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
                    .collect()
            };
            let n = experts * rows * cols;
            let (gate, up) = (mem.alloc(2 * n), mem.alloc(2 * n));
            let g = bf16(rnd(n, -1.0, 1.0));
            mem.write(gate, &g);
            let u = bf16(rnd(n, -1.0, 1.0));
            mem.write(up, &u);
            let x = mem.alloc(4 * cols);
            mem.put_f32s(x, &rnd(cols, -2.0, 2.0));
            // records: ids, probs, weights, by_id (k each), kth, next; then the activations
            let sizes = [k, k, k, k, 1, 1, k * rows];
            let run = |mem: &mut Memory, reference: bool| -> Vec<Vec<u32>> {
                let outs: Vec<u64> = sizes
                    .iter()
                    .map(|&n| {
                        let a = mem.alloc(4 * n);
                        mem.put_u32s(a, &vec![0x7fbf_ffff; n]);
                        a
                    })
                    .collect();
                let recs: Vec<Arg> = outs[..6].iter().map(|&a| Arg::Ptr(a)).collect();
                let full = cols.is_multiple_of(2048);
                let gx = rows.div_ceil(8).min(2) as u32;
                let mut args = vec![
                    Arg::Ptr(gate),
                    Arg::Ptr(up),
                    i(rows),
                    i(cols),
                    Arg::Ptr(x),
                    Arg::Ptr(outs[6]),
                    Arg::Ptr(logits),
                    i(experts),
                    i(k),
                    i(1),
                ];
                args.extend(recs);
                let name = if full {
                    "gate_up_route2f_bf16"
                } else {
                    "gate_up_route2_bf16"
                };
                let shared = (4 * (cols + 3 * experts)) as u32;
                let geometry = ((gx, k as u32, 1), (256, 1, 1));
                if reference {
                    launch_reference(mem, name, geometry.0, geometry.1, shared, &args)
                } else {
                    launch(mem, name, geometry.0, geometry.1, shared, &args)
                }
                .unwrap();
                outs.iter()
                    .zip(sizes)
                    .map(|(&a, n)| mem.u32s(a, n))
                    .collect()
            };
            let want = run(&mut mem, true);
            let got = run(&mut mem, false);
            let names = ["ids", "probs", "weights", "by_id", "kth", "next", "act"];
            for ((w, g), name) in want.iter().zip(&got).zip(names) {
                assert_eq!(w, g, "{experts} experts top-{k}: {name} differs");
                assert!(
                    w.iter().any(|&b| b != 0x7fbf_ffff),
                    "{experts} experts top-{k}: {name} not written"
                );
            }
            if ties {
                assert_eq!(&want[0][..2], &[1, 3], "ties go to the lower id");
            }
            if experts == k {
                assert!(f32::from_bits(want[5][0]).is_nan(), "next with E = k");
            }
        }
    }

    #[test]
    fn the_top8_down_kernels_write_the_references_bits() {
        // The experts' down kernels for top-8 over whole chunks, moe_down_dec2f8 (the router's
        // records from the kernel before) and moe_down_route2f8e (with programmatic launch: the
        // choice recomputed from the logits, renormalised or not), each against the reference
        // functions on the same inputs (the records from the CPU router's choice): every bit of
        // h equal, and both the same. 128 and 300 experts, widths of 1 and 3 chunks, with and
        // without a shared expert. With the CUDA emulator these are the real kernels.
        use super::{launch, launch_reference, route_reference, Arg, Memory};
        let mut rnd = uniform_floats(0x7f4a_7c15_9e37_79b9u64);
        let mut mem = Memory::default();
        let i = |v: usize| Arg::I32(v as i32);
        let k = 8usize;
        for (experts, width, hidden, shared_expert, renorm) in [
            (128usize, 768usize, 40usize, false, true),
            (300, 256, 24, true, false),
        ] {
            let logits = mem.alloc(4 * experts);
            mem.put_f32s(logits, &rnd(experts, -4.0, 4.0));
            let recs: Vec<u64> = [k, k, k, k, 1, 1]
                .iter()
                .map(|&n| mem.alloc(4 * n))
                .collect();
            let l = mem.f32s(logits, experts);
            route_reference(
                &mut mem,
                &l,
                k,
                renorm,
                0,
                [recs[0], recs[1], recs[2], recs[3], recs[4], recs[5]],
            );
            let n = experts * hidden * width;
            let down = mem.alloc(2 * n);
            let bytes: Vec<u8> = rnd(n, -1.0, 1.0)
                .iter()
                .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
                .collect();
            mem.write(down, &bytes);
            let act = mem.alloc(4 * k * width);
            mem.put_f32s(act, &rnd(k * width, -1.0, 1.0));
            let (y_sh, s_sh) = if shared_expert {
                let (y, s) = (mem.alloc(4 * hidden), mem.alloc(4));
                mem.put_f32s(y, &rnd(hidden, -1.0, 1.0));
                mem.put_f32s(s, &rnd(1, -1.0, 1.0));
                (y, s)
            } else {
                (0, 0)
            };
            let h = mem.alloc(4 * hidden);
            let h0 = rnd(hidden, -1.0, 1.0);
            let mut got: Vec<Vec<u32>> = Vec::new();
            for (name, reference) in [
                ("moe_down_dec2f8", true),
                ("moe_down_dec2f8", false),
                ("moe_down_route2f8e", true),
                ("moe_down_route2f8e", false),
            ] {
                mem.put_f32s(h, &h0);
                let mut args = vec![
                    Arg::Ptr(down),
                    i(hidden),
                    i(width),
                    Arg::Ptr(recs[0]),
                    Arg::Ptr(recs[2]),
                    Arg::Ptr(recs[3]),
                    i(k),
                    Arg::Ptr(act),
                    Arg::Ptr(y_sh),
                    Arg::Ptr(s_sh),
                    Arg::Ptr(h),
                ];
                let mut shared = 4 * k * width;
                if name == "moe_down_route2f8e" {
                    args.extend([Arg::Ptr(logits), i(experts), i(usize::from(renorm))]);
                    shared += 12 * experts;
                }
                let geometry = ((2, 1, 1), (256, 1, 1), shared as u32);
                if reference {
                    launch_reference(&mut mem, name, geometry.0, geometry.1, geometry.2, &args)
                } else {
                    launch(&mut mem, name, geometry.0, geometry.1, geometry.2, &args)
                }
                .unwrap();
                got.push(mem.u32s(h, hidden));
            }
            let before: Vec<u32> = h0.iter().map(|x| x.to_bits()).collect();
            assert_ne!(got[0], before, "{experts} experts: h unchanged");
            assert_eq!(got[1], got[0], "{experts} experts: moe_down_dec2f8 differs");
            assert_eq!(
                got[3], got[2],
                "{experts} experts: moe_down_route2f8e differs"
            );
            assert_eq!(got[2], got[0], "{experts} experts: the two choices differ");
        }
    }

    #[test]
    fn attn_decode4_writes_the_references_bits() {
        // one launch of attn_decode4 and of the reference functions on the same inputs, for
        // every head-dimension kernel (exactly its
        // width and below it, rotation pairs across threads), with and without q/k norms,
        // contexts of one to several 256-lane chunks and of more positions than a block has
        // threads, scores in shared memory and in the scratch rows. With the CUDA emulator these
        // are the real kernels; without it, the reference's geometry and bounds checks.
        use super::super::model::decode::attn_decode4_name;
        use super::{launch, launch_reference, Arg, Memory};
        let mut rnd = uniform_floats(0x2545_f491_4f6c_dd1du64);
        let cases: &[(usize, usize, usize, bool, usize, bool, f32)] = &[
            // (head dim, query heads, KV heads, q/k norms, position, scores in shared memory,
            // |q| bound: 40 spreads the scores so that many e_j are +0.0 or subnormal)
            (128, 4, 1, true, 300, true, 2.0),
            (128, 4, 2, false, 0, false, 2.0),
            (128, 2, 1, true, 600, false, 2.0),
            (128, 2, 1, false, 900, true, 40.0),
            (256, 2, 1, true, 257, true, 2.0),
            (200, 3, 1, false, 40, true, 2.0),
            (64, 4, 2, true, 255, true, 2.0),
            (64, 2, 1, false, 1000, false, 2.0),
            (48, 2, 1, true, 520, false, 2.0),
            (32, 4, 2, false, 256, true, 2.0),
            (32, 2, 1, true, 1300, true, 2.0),
            (24, 4, 2, true, 33, false, 2.0),
            (16, 2, 2, true, 1, true, 2.0),
        ];
        for &(d, hq, hkv, norms, pos, shared, qmax) in cases {
            // the paged cache: whole blocks, allocated last first (the table, not adjacency,
            // joins them)
            use crate::model::KV_BLOCK;
            let cap = (pos + 3).div_ceil(KV_BLOCK) * KV_BLOCK;
            let (nb, blk) = (cap / KV_BLOCK, hkv * KV_BLOCK * d);
            let half = d / 2;
            let slices = d.div_ceil(32);
            let mut mem = Memory::default();
            let buf = |mem: &mut Memory, v: &[f32]| {
                let a = mem.alloc(v.len() * 4);
                mem.put_f32s(a, v);
                a
            };
            let qr = buf(&mut mem, &rnd(hq * d, -qmax, qmax));
            let kr = buf(&mut mem, &rnd(hkv * d, -2.0, 2.0));
            let vr = buf(&mut mem, &rnd(hkv * d, -1.0, 1.0));
            let (qn, kn) = if norms {
                (
                    buf(&mut mem, &rnd(d, 0.5, 1.5)),
                    buf(&mut mem, &rnd(d, 0.5, 1.5)),
                )
            } else {
                (0, 0)
            };
            let cos = buf(&mut mem, &rnd((pos + 1) * half, -1.0, 1.0));
            let sin = buf(&mut mem, &rnd((pos + 1) * half, -1.0, 1.0));
            let st = mem.alloc(16);
            mem.put_u32s(st, &[7, pos as u32, 0, 0]);
            let page = |mem: &mut Memory, data: &[f32]| -> (u64, Vec<u64>) {
                let mut at: Vec<u64> = (0..nb)
                    .rev()
                    .map(|b| buf(mem, &data[b * blk..(b + 1) * blk]))
                    .collect();
                at.reverse();
                let tbl = mem.alloc(nb * 8);
                let bytes: Vec<u8> = at.iter().flat_map(|a| a.to_le_bytes()).collect();
                mem.write(tbl, &bytes);
                (tbl, at)
            };
            let (kc, k_blocks) = page(&mut mem, &rnd(nb * blk, -2.0, 2.0));
            let (vc, v_blocks) = page(&mut mem, &rnd(nb * blk, -1.0, 1.0));
            let whole = |mem: &mut Memory, blocks: &[u64]| -> Vec<f32> {
                blocks.iter().flat_map(|&a| mem.f32s(a, blk)).collect()
            };
            let scratch = mem.alloc(hq * slices * 2 * cap * 4);
            let o = mem.alloc(hq * d * 4);
            let scale = (1.0f64 / (d as f64).sqrt()) as f32;
            let kv_before = (whole(&mut mem, &k_blocks), whole(&mut mem, &v_blocks));
            let run = |mem: &mut Memory, name: &'static str, reference: bool| {
                for (blocks, data) in [(&k_blocks, &kv_before.0), (&v_blocks, &kv_before.1)] {
                    for (b, &a) in blocks.iter().enumerate() {
                        mem.put_f32s(a, &data[b * blk..(b + 1) * blk]);
                    }
                }
                mem.put_f32s(o, &vec![f32::NAN; hq * d]);
                let args = [
                    Arg::Ptr(qr),
                    Arg::Ptr(kr),
                    Arg::Ptr(vr),
                    Arg::I32(hq as i32),
                    Arg::I32(hkv as i32),
                    Arg::I32(d as i32),
                    Arg::Ptr(qn),
                    Arg::Ptr(kn),
                    Arg::F32(1e-6),
                    Arg::Ptr(cos),
                    Arg::Ptr(sin),
                    Arg::Ptr(st),
                    Arg::Ptr(kc),
                    Arg::Ptr(vc),
                    Arg::I32(cap as i32),
                    Arg::F32(scale),
                    Arg::Ptr(if shared { 0 } else { scratch }),
                    Arg::I32(cap as i32),
                    Arg::Ptr(o),
                ];
                let sh = if shared { (2 * cap * 4) as u32 } else { 0 };
                let geometry = ((hq as u32, slices as u32, 1), (512, 1, 1));
                if reference {
                    launch_reference(mem, name, geometry.0, geometry.1, sh, &args)
                } else {
                    launch(mem, name, geometry.0, geometry.1, sh, &args)
                }
                .unwrap();
                let bits = |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                (
                    bits(mem.f32s(o, hq * d)),
                    bits(whole(mem, &k_blocks)),
                    bits(whole(mem, &v_blocks)),
                )
            };
            let name = attn_decode4_name(d);
            let want = run(&mut mem, name, true);
            {
                let got = run(&mut mem, name, false);
                let case = format!(
                "{name}: D {d}, {hq}/{hkv} heads, norms {norms}, position {pos}, |q| < {qmax}, \
                 shared {shared}"
            );
                assert!(
                    want.0.iter().all(|&b| !f32::from_bits(b).is_nan()),
                    "{case}"
                );
                for (what, g, w) in [
                    ("output", &got.0, &want.0),
                    ("key cache", &got.1, &want.1),
                    ("value cache", &got.2, &want.2),
                ] {
                    if let Some(i) = (0..w.len()).find(|&i| g[i] != w[i]) {
                        panic!(
                            "{case}: {what} [{i}] is {} ({:#010x}), the reference's {} ({:#010x})",
                            f32::from_bits(g[i]),
                            g[i],
                            f32::from_bits(w[i]),
                            w[i]
                        );
                    }
                }
                eprintln!("{case}: bit-identical");
            }
        }
    }

    #[test]
    fn the_unguarded_row_kernels_give_the_cpus_bits() {
        // The unguarded kernels (load_group's FULL, moe_down_dec2f8): launches over whole groups
        // take the unguarded entry points -- q|k|v, the router, gate/up and the lm_head over
        // hidden 2,048, o_proj over 4,096 (dmv2wf), the experts' down at top-8 over width 768
        // -- and the others (o_proj over 96 columns, F32 matrices, top-3) the second versions:
        // the launch list's choices, arguments and bounds against the reference. Not under the
        // CUDA emulator (this shape takes it tens of minutes): the kernels themselves are
        // compared with the reference by every_row_kernel_writes_the_references_bits, and with
        // the CPU by the H200 selftests (validation/gpu/bench.sh).
        if super::emulated() {
            eprintln!("skipped under the CUDA emulator (see the comment)");
            return;
        }
        let whole = SyntheticShape {
            layers: 2,
            hidden: 2048,
            heads: 32,
            kv_heads: 4,
            head_dim: 128,
            experts: 10,
            top_k: 8,
            expert_width: 768,
            dense_width: 256,
            mlp_only_layers: vec![1],
            vocab: 300,
            ..SyntheticShape::small("qwen3_moe")
        };
        for (family, shape) in [
            ("qwen3_moe", whole),
            ("qwen2_moe", SyntheticShape::small("qwen2_moe")),
            ("mixtral", SyntheticShape::small("mixtral")),
        ] {
            eprintln!("{family}: hidden {}", shape.hidden);
            decode_modes_match_the_cpu(family, shape);
        }
    }

    #[test]
    fn the_early_kernels_run_only_with_programmatic_launch() {
        // At hidden 2,048, top-8 over whole chunks (where the `f` and `e` entry points apply):
        // graph-pdl runs the `e` kernels and moe_down_route2f8e; the plain graph and the
        // one-by-one launches run the `f` kernels and moe_down_dec2f8 (the `e` ones are slower
        // without the overlap); all of them the folded top-k. Every arrangement gives the same
        // logits and tokens, bit for bit.
        use crate::DecodeMode;
        use tarfa_core::step::{ForwardOptions, LogitRows};
        let shape = SyntheticShape {
            layers: 1,
            hidden: 2048,
            heads: 16,
            kv_heads: 2,
            head_dim: 128,
            experts: 9,
            top_k: 8,
            expert_width: 256,
            vocab: 300,
            mlp_only_layers: vec![],
            ..SyntheticShape::small("qwen3_moe")
        };
        let (cfg, src) = random_model(&shape, 31);
        let gpu = CudaModel::load_on(Gpu::mock(), cfg, Arc::new(src), None).unwrap();
        let last = ForwardOptions {
            logits: LogitRows::Last,
            ..Default::default()
        };
        let mut reference: Option<(Vec<u32>, Vec<u32>)> = None;
        for mode in [DecodeMode::GraphPdl, DecodeMode::Graph, DecodeMode::Direct] {
            let mut gc = gpu.new_cache().unwrap();
            gc.set_decode_mode(mode);
            let out = gpu.forward(&mut gc, &[5, 77], &last).unwrap();
            let t = tarfa_core::generate::argmax(&out.logits[0]);
            let step = gpu.forward(&mut gc, &[t], &last).unwrap();
            let toks = gpu.decode_greedy(&mut gc, 9, 3).unwrap();
            let bits: Vec<u32> = step.logits[0].iter().map(|x| x.to_bits()).collect();
            match &reference {
                None => reference = Some((bits, toks)),
                Some(r) => assert!(r.0 == bits && r.1 == toks, "{mode:?} differs"),
            }
            assert_eq!(gc.decode_running().unwrap().0, mode, "{mode:?}");
            let kernels = gc.decode_kernels();
            let names: Vec<&str> = kernels.iter().map(|k| k.0).collect();
            let has = |n: &str| names.contains(&n);
            let early = mode == DecodeMode::GraphPdl;
            assert_eq!(has("dmv2fe_bf16"), early, "{mode:?}: {names:?}");
            assert_eq!(has("lmhead2fe_bf16"), early, "{names:?}");
            assert_eq!(has("dmv2f_bf16"), !early, "{names:?}");
            assert!(has("gate_up_route2f_bf16"), "{names:?}");
            assert_eq!(has("moe_down_route2f8e"), early, "{mode:?}: {names:?}");
            assert_eq!(has("moe_down_dec2f8"), !early, "{mode:?}: {names:?}");
            assert!(has("attn_decode4_d128"), "{names:?}");
            // q|k|v: (16 + 2 * 2) * 128 = 2,560 rows, two per warp (160 blocks), capped at the
            // 2 blocks the mock device holds (decode.rs qkv_grid has the H200's numbers)
            assert_eq!(kernels[1].1 .0, 2, "{names:?}");
        }
    }

    #[test]
    fn the_router_kernels_take_many_experts_and_top_k_of_all() {
        // more experts than one warp's registers hold (300 > 256: the keys read from shared
        // memory, two 256-chunks in the softmax sum), and k = E (next is NaN), through the
        // top-k folded into the experts' kernels
        for (experts, top_k) in [(300, 8), (4, 4)] {
            for family in ["qwen3_moe", "mixtral"] {
                let shape = SyntheticShape {
                    experts,
                    top_k,
                    ..SyntheticShape::small(family)
                };
                decode_modes_match_the_cpu(family, shape);
            }
        }
    }

    /// The CPU's greedy run after `prompt`: the last-row logits of the prefill and of `steps`
    /// decode steps, and the token each chose.
    fn cpu_greedy(
        cfg: &MoeConfig,
        src: &Arc<dyn WeightSource>,
        prompt: &[u32],
        steps: usize,
    ) -> (Vec<Vec<f32>>, Vec<u32>) {
        use tarfa_core::generate::greedy;
        use tarfa_core::step::{ForwardOptions, LogitRows};
        let cpu = Arc::new(CpuModel::load(cfg.clone(), src.clone()).unwrap());
        let engine = CpuEngine::new(
            cpu.clone(),
            EngineOptions {
                threads: 2,
                kernel: Kernel::best(),
            },
        )
        .unwrap();
        let last = ForwardOptions {
            logits: LogitRows::Last,
            ..Default::default()
        };
        let mut cc = cpu.new_cache();
        // steps + 1 tokens: the prefill chooses the first, each of `steps` forwards one more.
        let g = greedy(&engine, &mut cc, prompt, steps + 1, &last).unwrap();
        (g.step_logits, g.tokens)
    }

    /// The decode modes a whole-model test runs: all of them on the reference functions; on the
    /// CUDA emulator not `Graph`, whose mock graph replays the very launches `Direct` runs (the
    /// launch list without programmatic launch), so it would run the same kernels on the same
    /// inputs again (CI time). The reference runs cover its replay path.
    fn modes_to_check() -> Vec<crate::DecodeMode> {
        use crate::DecodeMode;
        DecodeMode::ALL
            .into_iter()
            .filter(|&m| !(super::emulated() && m == DecodeMode::Graph))
            .collect()
    }

    fn decode_modes_match_the_cpu(family: &str, shape: SyntheticShape) {
        modes_match_the_cpu(family, shape, &modes_to_check());
    }

    fn modes_match_the_cpu(family: &str, shape: SyntheticShape, modes: &[crate::DecodeMode]) {
        let (cfg, src) = random_model(&shape, 12);
        modes_match_the_cpu_on(family, cfg, Arc::new(src), modes);
    }

    /// Every decode mode of `modes` gives the CPU's logits and greedy tokens (prefill, steps,
    /// the device greedy loop, timed replays, the profile's launches).
    fn modes_match_the_cpu_on(
        family: &str,
        cfg: MoeConfig,
        src: Arc<dyn WeightSource>,
        modes: &[crate::DecodeMode],
    ) {
        use crate::DecodeMode;
        use tarfa_core::step::{ForwardOptions, LogitRows};
        eprintln!(
            "kernels: {}",
            if super::emulated() {
                "kernels/*.cu on the CUDA emulator"
            } else {
                "the reference functions"
            }
        );
        {
            let v = cfg.vocab_size;
            let prompt: Vec<u32> = (0..9).map(|i| (i * 37 % v) as u32).collect();
            let last = ForwardOptions {
                logits: LogitRows::Last,
                ..Default::default()
            };
            // the CPU's greedy run: the logits of the prefill and of 6 decode steps
            let (want, toks) = cpu_greedy(&cfg, &src, &prompt, 6);
            let gpu = CudaModel::load_on(Gpu::mock(), cfg.clone(), src.clone(), None).unwrap();
            assert_eq!(gpu.decode_unsupported_reason(), None, "{family}");
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            for &mode in modes {
                let mut gc = gpu.new_cache().unwrap();
                gc.set_decode_mode(mode);
                let out = gpu.forward(&mut gc, &prompt, &last).unwrap();
                assert_eq!(
                    bits(&out.logits[0]),
                    bits(&want[0]),
                    "{family} {mode:?} prefill"
                );
                for j in 0..2 {
                    let out = gpu.forward(&mut gc, &[toks[j]], &last).unwrap();
                    assert_eq!(
                        bits(&out.logits[0]),
                        bits(&want[j + 1]),
                        "{family} {mode:?} decode step {j}"
                    );
                }
                match (mode, gc.decode_running()) {
                    (DecodeMode::Legacy, None) => {}
                    (m, Some((r, note))) => assert_eq!(r, m, "{family}: {note}"),
                    (m, None) => panic!("{family} {m:?}: the decode kernels did not run"),
                }
                let got = gpu.decode_greedy(&mut gc, toks[2], 4).unwrap();
                assert_eq!(got, toks[3..7].to_vec(), "{family} {mode:?} device greedy");
                assert_eq!(gc.len(), prompt.len() + 6);
            }
            // timed replays produce the same tokens; the copy rate is a number
            let mut gc = gpu.new_cache().unwrap();
            gpu.forward(&mut gc, &prompt, &last).unwrap();
            gpu.reserve(&mut gc, 8).unwrap();
            let ms = gpu.time_decode(&mut gc, toks[0], 3).unwrap();
            assert!(ms >= 0.0 && gc.len() == prompt.len() + 3);
            let got = gpu.decode_greedy(&mut gc, toks[3], 3).unwrap();
            assert_eq!(
                got,
                toks[4..7].to_vec(),
                "{family}: greedy after timed steps"
            );
            assert!(gpu.copy_rate(1 << 16, 3).unwrap() > 0.0);
            // the profile runs the same launches, one by one
            let mut gc = gpu.new_cache().unwrap();
            gpu.forward(&mut gc, &prompt, &last).unwrap();
            let rows = gpu.profile_decode(&mut gc, toks[0], 2).unwrap();
            let launches: usize = rows.iter().map(|r| r.launches).sum();
            assert_eq!(launches, gc.decode_launches(), "{family}");
            let got = gpu.decode_greedy(&mut gc, toks[2], 4).unwrap();
            assert_eq!(
                got,
                toks[3..7].to_vec(),
                "{family}: greedy after the profile"
            );
            eprintln!("{family}: every decode mode bit-identical, {launches} launches per token");
        }
    }

    #[test]
    fn the_many_token_kernel_checks_pass_on_the_mock_device() {
        // the lane-sequential products and the prefill attention alone (with the emulator: the
        // real kernels/prefill.cu against the CPU's dots)
        let gpu = Gpu::mock();
        for c in [
            super::super::checks::check_many(&gpu).unwrap(),
            super::super::checks::check_prefill_attention(&gpu).unwrap(),
        ] {
            eprintln!("{c}");
            assert!(c.compared > 0 && c.mismatches == 0, "{c}");
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
        assert_eq!(checks.len(), 18);
    }

    #[test]
    fn weights_that_do_not_fit_are_a_clear_out_of_memory_error() {
        let (cfg, src) = random_model(&SyntheticShape::small("qwen3_moe"), 11);
        let err =
            match CudaModel::load_on(Gpu::mock_with_memory(100 << 20), cfg, Arc::new(src), None) {
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

    /// A CUDA model whose experts stream through a hot tier of `slots` experts.
    fn streamed(
        cfg: &MoeConfig,
        src: Arc<dyn WeightSource>,
        slots: u64,
        policy: tarfa_stream::CachePolicy,
        pins: Vec<(usize, usize)>,
    ) -> CudaModel {
        let hot = super::super::HotOptions {
            budget: slots * super::super::min_vram_budget(cfg) + 17,
            policy,
            pins,
        };
        CudaModel::load_on(Gpu::mock(), cfg.clone(), src, Some(&hot)).unwrap()
    }

    #[test]
    fn streamed_experts_give_the_resident_bits_for_every_budget_and_policy() {
        use tarfa_stream::CachePolicy;
        for family in ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"] {
            let (cfg, src) = random_model(&SyntheticShape::small(family), 21);
            let src: Arc<dyn WeightSource> = Arc::new(src);
            let v = cfg.vocab_size;
            let cpu = Arc::new(CpuModel::load(cfg.clone(), src.clone()).unwrap());
            let engine = CpuEngine::new(
                cpu,
                EngineOptions {
                    threads: 2,
                    kernel: Kernel::best(),
                },
            )
            .unwrap();
            let opts = SelftestOptions {
                prompts: vec![(0..13).map(|i| (i * 29 % v) as u32).collect(), vec![5]],
                decode_steps: 3,
                cpu_threads: 2,
            };
            let moe_layers = ArchSpec::new(&cfg)
                .layers
                .iter()
                .filter(|&&k| k == tarfa_core::model::MlpKind::Moe)
                .count();
            let all = (moe_layers * cfg.num_experts) as u64;
            let hot_pins: Vec<(usize, usize)> = (0..cfg.num_layers)
                .flat_map(|l| (0..cfg.num_experts).map(move |e| (l, e)))
                .rev()
                .collect();
            // the first MoE layer's experts in id order: a layer whose experts become pinned
            // while its later groups still need slots
            let first_moe = ArchSpec::new(&cfg)
                .layers
                .iter()
                .position(|&k| k == tarfa_core::model::MlpKind::Moe)
                .unwrap();
            let first_pins: Vec<(usize, usize)> =
                (0..cfg.num_experts).map(|e| (first_moe, e)).collect();
            let cases = [
                (all, CachePolicy::Lru, &hot_pins),
                (all / 2, CachePolicy::Lru, &hot_pins),
                (cfg.top_k as u64 + 1, CachePolicy::Ledger, &hot_pins),
                (4, CachePolicy::Static, &hot_pins),
                (4, CachePolicy::Static, &first_pins),
                (3, CachePolicy::Ledger, &first_pins),
                (3, CachePolicy::None, &hot_pins),
                (1, CachePolicy::Lru, &hot_pins),
            ];
            // The budgets and policies are the hot tier's logic, which the reference run checks;
            // on the emulator (the real kernels, slowly) one case per family runs them: one slot,
            // so every expert of every step is copied into it.
            let cases = if super::emulated() {
                &cases[cases.len() - 1..]
            } else {
                &cases[..]
            };
            for &(slots, policy, pins) in cases {
                let gpu = streamed(&cfg, src.clone(), slots, policy, pins.clone());
                assert!(gpu.decode_unsupported_reason().is_some());
                let rep = selftest_models(&engine, &gpu, &opts).unwrap();
                let st = gpu.hot_stats().unwrap();
                eprintln!("{family}, {slots} slots, {}: {rep}; {st:?}", policy.name());
                assert!(rep.passed(), "{family} {slots} {policy:?}: {rep}");
                assert_eq!(st.slots, slots.min(all), "{family}");
                assert!(st.requests > 0 && st.uploads > 0, "{st:?}");
                assert_eq!(st.requests, st.hits + st.uploads, "{st:?}");
                assert_eq!(
                    st.h2d_bytes,
                    st.uploads * 6 * (cfg.expert_width * cfg.hidden_size) as u64
                );
                if slots == all {
                    // everything fits: each expert is copied once, then always hit
                    assert!(st.uploads <= all && st.evictions == 0, "{st:?}");
                }
                if slots == 1 {
                    // every use of a different expert than the last one copies it again
                    assert!(st.evictions > 0 && st.hits < st.requests / 2, "{st:?}");
                }
            }
        }
    }

    #[test]
    fn a_hot_tier_smaller_than_one_expert_is_refused() {
        let (cfg, src) = random_model(&SyntheticShape::small("qwen3_moe"), 22);
        let hot = super::super::HotOptions {
            budget: super::super::min_vram_budget(&cfg) - 1,
            policy: tarfa_stream::CachePolicy::Lru,
            pins: Vec::new(),
        };
        let err = match CudaModel::load_on(Gpu::mock(), cfg.clone(), Arc::new(src), Some(&hot)) {
            Ok(_) => panic!("a hot tier without a slot"),
            Err(e) => e,
        };
        let msg = err.to_string();
        assert!(
            msg.contains("smaller than one expert")
                && msg.contains(&super::super::min_vram_budget(&cfg).to_string()),
            "{msg}"
        );
        assert!(
            matches!(err, super::super::CudaError::VramBudgetTooSmall { budget, minimum }
                if budget == hot.budget && minimum == super::super::min_vram_budget(&cfg)),
            "{err:?}"
        );
        assert_eq!(err.exit_code(), 2);
    }

    #[test]
    fn requests_the_kernels_cannot_take_are_bad_input_and_change_nothing() {
        use super::super::CudaError;
        use tarfa_core::step::ForwardOptions;
        // More tokens in one step than a grid dimension holds (the context allows them).
        let (mut cfg, src) = random_model(&SyntheticShape::small("qwen3_moe"), 23);
        cfg.max_position_embeddings = 70_000;
        let gpu = CudaModel::load_on(Gpu::mock(), cfg, Arc::new(src), None).unwrap();
        let mut cache = gpu.new_cache().unwrap();
        let err = match gpu.forward(&mut cache, &[1; 65_536], &ForwardOptions::default()) {
            Ok(_) => panic!("a step of 65,536 tokens ran"),
            Err(e) => e,
        };
        assert!(
            matches!(
                err,
                CudaError::TooManyTokens {
                    tokens: 65_536,
                    max: 65_535
                }
            ),
            "{err:?}"
        );
        assert_eq!(err.exit_code(), 2);
        assert_eq!(cache.len(), 0, "the cache is left as it was");
        // The refusal left the model and its cache usable.
        assert!(gpu
            .forward(&mut cache, &[1], &ForwardOptions::default())
            .is_ok());

        // A hidden size the decode kernels cannot take: profiling them names it.
        let mut shape = SyntheticShape::small("qwen3_moe");
        shape.hidden = 100;
        let (cfg, src) = random_model(&shape, 24);
        let gpu = CudaModel::load_on(Gpu::mock(), cfg, Arc::new(src), None).unwrap();
        let mut cache = gpu.new_cache().unwrap();
        let err = match gpu.profile_decode(&mut cache, 1, 1) {
            Ok(_) => panic!("profiled decode kernels that cannot run hidden size 100"),
            Err(e) => e,
        };
        assert!(
            matches!(&err, CudaError::UnsupportedModel(m) if m.contains("hidden size 100")),
            "{err:?}"
        );
        assert_eq!(err.exit_code(), 2);
        assert_eq!(cache.len(), 0);
    }

    #[test]
    fn streaming_from_a_bundle_through_both_tiers_gives_the_resident_bits() {
        use tarfa_stream::bundle::BundleSource;
        use tarfa_stream::{CachePolicy, IoMode, StreamOptions, StreamSource};
        // On the target directory's file system (O_DIRECT needs one that supports it).
        let exe = std::env::current_exe().unwrap();
        let work = exe.parent().unwrap().join("tarfa-hot-tier-test");
        let _ = std::fs::remove_dir_all(&work);
        let base = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/oracle");
        let dir = work.join("qwen3moe-a");
        tarfa_convert::convert(&base.join("qwen3moe-a"), &dir, &Default::default()).unwrap();
        let bundle = Arc::new(BundleSource::open(&dir, None).unwrap());
        let cfg = MoeConfig::from_json_str(
            &String::from_utf8(bundle.read_file("config.json").unwrap()).unwrap(),
        )
        .unwrap();
        let resident: Arc<dyn WeightSource> = bundle.clone();
        let cpu = Arc::new(CpuModel::load(cfg.clone(), resident).unwrap());
        let engine = CpuEngine::new(
            cpu,
            EngineOptions {
                threads: 2,
                kernel: Kernel::best(),
            },
        )
        .unwrap();
        let v = cfg.vocab_size;
        let opts = SelftestOptions {
            prompts: vec![(0..11).map(|i| (i * 17 % v) as u32).collect()],
            decode_steps: 3,
            cpu_threads: 2,
        };
        let one = bundle
            .expert_extents()
            .iter()
            .map(|(e, _)| e.padded_length)
            .max()
            .unwrap();
        // The tiers are host logic the reference run checks; on the emulator (the real kernels,
        // slowly: the same ones the test above runs on streamed experts) one combination runs.
        let combos: &[(IoMode, Option<u64>, u64)] = if super::emulated() {
            &[(IoMode::Cached, Some(one), 1)]
        } else {
            &[
                (IoMode::Direct, None, 1000),
                (IoMode::Direct, Some(one), 1),
                (IoMode::Direct, Some(3 * one), 2),
                (IoMode::Cached, None, 1000),
                (IoMode::Cached, Some(one), 1),
                (IoMode::Cached, Some(3 * one), 2),
            ]
        };
        for &(io, ram, slots) in combos {
            let so = StreamOptions {
                ram_budget: ram,
                io,
                policy: CachePolicy::Lru,
                io_threads: 4,
                ..Default::default()
            };
            let src = Arc::new(StreamSource::new(bundle.clone(), &so, None).unwrap());
            let gpu = streamed(&cfg, src.clone(), slots, CachePolicy::Lru, Vec::new());
            let rep = selftest_models(&engine, &gpu, &opts).unwrap();
            let st = gpu.hot_stats().unwrap();
            let warm = src.stats();
            eprintln!("{io:?} ram {ram:?} slots {slots}: {rep}; {st:?}; {warm:?}");
            assert!(rep.passed(), "{io:?} {ram:?} {slots}: {rep}");
            // every copy to the GPU was a verified expert handed out by the warm tier
            assert_eq!(warm.requests, st.uploads, "{io:?} {ram:?} {slots}");
            assert!(warm.verified_bytes > 0);
            if let Some(b) = ram {
                assert!(warm.peak_warm_bytes <= b, "{warm:?}");
            }
        }
        let _ = std::fs::remove_dir_all(&work);
    }

    #[test]
    fn a_step_over_several_sequences_gives_each_the_cpus_bits_alone() {
        // CudaModel::forward_seqs (Backend::forward_batch): sequences at different positions
        // (one past the cache's first capacity, so it grows inside the step), prefill chunks
        // and single tokens, Last and All rows, the router traced or not, the INVALID arm on
        // one: each output (logits, router records, counters) equals the CPU backend's forward
        // of that sequence alone, bit for bit; a bad entry is named and advances nothing.
        use tarfa_core::batch::BatchEntry;
        use tarfa_core::step::{FinalHidden, ForwardOptions, ForwardOutput, LogitRows};
        use tarfa_core::Backend;
        // on the emulator one family (CI time): mixtral's F32 tiles run in the prefills of
        // the_orchestration_reproduces_the_cpu_for_every_family
        // and DeepSeek-V3's multi-head latent attention (the fixture: each token's latent rows
        // into its own cache, the absorbed attention over them)
        let mut families: Vec<&str> = if super::emulated() {
            vec!["qwen2_moe", "deepseekv3-s"]
        } else {
            vec!["qwen2_moe", "mixtral", "deepseekv3-s"]
        };
        // gpt-oss: each token's window and sinks in its own sequence's cache
        if shared_oracle().is_some() {
            families.push("gptoss-a");
        }
        for family in families {
            let (cfg, src): (MoeConfig, Arc<dyn WeightSource>) = if family.contains('-') {
                fixture(family)
            } else {
                let (cfg, src) = random_model(&SyntheticShape::small(family), 21);
                (cfg, Arc::new(src))
            };
            let v = cfg.vocab_size;
            let cpu = Arc::new(CpuModel::load(cfg.clone(), src.clone()).unwrap());
            let engine = CpuEngine::new(
                cpu.clone(),
                EngineOptions {
                    threads: 2,
                    kernel: Kernel::best(),
                },
            )
            .unwrap();
            let gpu = CudaModel::load_on(Gpu::mock(), cfg.clone(), src.clone(), None).unwrap();
            let opts = |rows: LogitRows, trace: bool, invalid: bool| ForwardOptions {
                logits: rows,
                trace_router: trace,
                final_hidden: if invalid {
                    FinalHidden::InvalidBf16BeforeLmHead
                } else {
                    FinalHidden::default()
                },
            };
            let toks = |seed: usize, n: usize| -> Vec<u32> {
                (0..n)
                    .map(|i| ((seed * 97 + i * 41 + 3) % v) as u32)
                    .collect()
            };
            // (history already cached, this step's tokens, options)
            let plan = [
                (toks(1, 3), toks(2, 5), opts(LogitRows::All, true, false)),
                (Vec::new(), toks(3, 1), opts(LogitRows::Last, false, false)),
                (toks(4, 254), toks(5, 6), opts(LogitRows::All, true, false)),
                (toks(6, 9), toks(7, 1), opts(LogitRows::Last, true, true)),
                (Vec::new(), toks(8, 7), opts(LogitRows::Last, true, false)),
            ];
            let bits = |o: &ForwardOutput| {
                let l: Vec<Vec<u32>> = o
                    .logits
                    .iter()
                    .map(|r| r.iter().map(|x| x.to_bits()).collect())
                    .collect();
                (l, format!("{:?}", o.router), o.stats)
            };
            let mut want = Vec::new();
            for (hist, step, o) in &plan {
                let mut c = cpu.new_cache();
                if !hist.is_empty() {
                    engine
                        .forward(&mut c, hist, &ForwardOptions::default())
                        .unwrap();
                }
                want.push(bits(&engine.forward(&mut c, step, o).unwrap()));
            }
            let mut caches: Vec<_> = plan
                .iter()
                .map(|(hist, _, _)| {
                    let mut c = gpu.new_cache().unwrap();
                    if !hist.is_empty() {
                        gpu.forward(&mut c, hist, &ForwardOptions::default())
                            .unwrap();
                    }
                    c
                })
                .collect();
            // a bad entry: named, and no cache advanced
            {
                let bad = [1u32, v as u32];
                let mut entries: Vec<_> = caches
                    .iter_mut()
                    .zip(&plan)
                    .enumerate()
                    .map(|(i, (c, (_, step, o)))| BatchEntry {
                        cache: c,
                        tokens: if i == 2 { &bad[..] } else { &step[..] },
                        opts: *o,
                    })
                    .collect();
                let err = gpu.forward_batch(&mut entries).unwrap_err();
                assert_eq!(err.sequence, Some(2), "{family}: {err}");
            }
            let lens: Vec<usize> = caches.iter().map(|c| c.len()).collect();
            assert_eq!(lens, plan.iter().map(|p| p.0.len()).collect::<Vec<_>>());
            let mut entries: Vec<_> = caches
                .iter_mut()
                .zip(&plan)
                .map(|(c, (_, step, o))| BatchEntry {
                    cache: c,
                    tokens: &step[..],
                    opts: *o,
                })
                .collect();
            let outs = gpu.forward_batch(&mut entries).unwrap();
            for (i, (o, w)) in outs.iter().zip(&want).enumerate() {
                assert_eq!(&bits(o), w, "{family}: sequence {i}");
            }
            // the caches advanced by their own tokens and decode on with the CPU's bits
            for (i, c) in caches.iter_mut().enumerate() {
                assert_eq!(c.len(), plan[i].0.len() + plan[i].1.len());
            }
            let mut c = cpu.new_cache();
            let (hist, step, _) = &plan[2];
            let all: Vec<u32> = hist.iter().chain(step).copied().collect();
            engine
                .forward(&mut c, &all, &ForwardOptions::default())
                .unwrap();
            let next = opts(LogitRows::Last, true, false);
            let w = bits(&engine.forward(&mut c, &[9], &next).unwrap());
            assert_eq!(
                bits(&gpu.forward(&mut caches[2], &[9], &next).unwrap()),
                w,
                "{family}: decode after"
            );
        }
    }

    /// A family's model (a fixture when its name has a '-', else a random small model of that
    /// architecture from `seed`) on the CPU engine (2 threads) and on the mock device with
    /// `many`: the two sides of the many-token kernels' tests.
    fn cpu_and_mock(
        family: &str,
        seed: u64,
        many: crate::ManyKernels,
    ) -> (MoeConfig, Arc<CpuModel>, CpuEngine, CudaModel) {
        let (cfg, src): (MoeConfig, Arc<dyn WeightSource>) = if family.contains('-') {
            fixture(family)
        } else {
            let (cfg, src) = random_model(&SyntheticShape::small(family), seed);
            (cfg, Arc::new(src))
        };
        let cpu = Arc::new(CpuModel::load(cfg.clone(), src.clone()).unwrap());
        let engine = CpuEngine::new(
            cpu.clone(),
            EngineOptions {
                threads: 2,
                kernel: Kernel::best(),
            },
        )
        .unwrap();
        let gpu = CudaModel::load_on(Gpu::mock(), cfg.clone(), src, None).unwrap();
        gpu.set_many_kernels(many);
        (cfg, cpu, engine, gpu)
    }

    /// A step's logits as bits, its router records and its statistics: what the many-token
    /// kernels' tests compare.
    fn step_bits(
        o: &tarfa_core::step::ForwardOutput,
    ) -> (Vec<Vec<u32>>, String, tarfa_core::step::StepStats) {
        let l: Vec<Vec<u32>> = o
            .logits
            .iter()
            .map(|r| r.iter().map(|x| x.to_bits()).collect())
            .collect();
        (l, format!("{:?}", o.router), o.stats)
    }

    /// One step of every sequence together on the mock device (`next[i]` for sequence i):
    /// each sequence's logits, router records and statistics must be the CPU's step of that
    /// sequence alone.
    fn batched_step_is_each_alone(
        engine: &CpuEngine,
        gpu: &CudaModel,
        cpus: &mut [tarfa_cpu::KvCache],
        gpus: &mut [super::super::CudaCache],
        next: &[Vec<u32>],
        opts: tarfa_core::step::ForwardOptions,
        what: &str,
    ) {
        use tarfa_core::batch::BatchEntry;
        use tarfa_core::Backend;
        let want: Vec<_> = cpus
            .iter_mut()
            .zip(next)
            .map(|(c, t)| step_bits(&engine.forward(c, t, &opts).unwrap()))
            .collect();
        let mut entries: Vec<_> = gpus
            .iter_mut()
            .zip(next)
            .map(|(c, t)| BatchEntry {
                cache: c,
                tokens: &t[..],
                opts,
            })
            .collect();
        let outs = gpu.forward_batch(&mut entries).unwrap();
        for (i, (o, w)) in outs.iter().zip(&want).enumerate() {
            assert!(&step_bits(o) == w, "{what}: sequence {i}");
        }
    }

    #[test]
    fn the_lane_sequential_kernels_give_the_cpus_bits() {
        // every product and the attention of a step of many tokens on kernels/prefill.cu
        // (ManyKernels::Lanes: whatever the tokens), against the CPU backend: a prompt in one
        // step and in chunks (the later chunks' queries see the cached positions), decode after
        // it, and one step over three sequences (prefill chunks beside a one-token decode),
        // each equal to it alone. Families: GQA at head widths 8 to 32 with groups of 1 and 2
        // heads, F32 weights (mixtral-s), multi-head latent attention (the products only),
        // gpt-oss's sinks and windows (a windowed layer keeps attention.cu) and the hybrids
        // (gated attention) with the shared oracle.
        use tarfa_core::batch::BatchEntry;
        use tarfa_core::step::{ForwardOptions, LogitRows};
        use tarfa_core::Backend;
        let mut families = vec!["qwen3moe-a", "olmoe-s", "mixtral-s", "deepseekv3-s"];
        if !super::emulated() {
            families.extend(["qwen3_moe", "qwen2_moe"]);
        }
        if shared_oracle().is_some() {
            families.extend(["gptoss-a", "qwen35moe-a"]);
        }
        for family in families {
            let (cfg, cpu, engine, gpu) = cpu_and_mock(family, 23, crate::ManyKernels::Lanes);
            let v = cfg.vocab_size;
            let toks = |seed: usize, n: usize| -> Vec<u32> {
                (0..n)
                    .map(|i| ((seed * 89 + i * 37 + 5) % v) as u32)
                    .collect()
            };
            let all = ForwardOptions {
                logits: LogitRows::All,
                trace_router: true,
                ..Default::default()
            };
            let bits = step_bits;
            // one prompt: in one step, then in chunks of 11, 20 and 6, then decode
            let prompt = toks(1, 37);
            let mut c = cpu.new_cache();
            let want = bits(&engine.forward(&mut c, &prompt, &all).unwrap());
            let want_next = bits(&engine.forward(&mut c, &[7], &all).unwrap());
            let mut g = gpu.new_cache().unwrap();
            assert!(
                bits(&gpu.forward(&mut g, &prompt, &all).unwrap()) == want,
                "{family}: prompt"
            );
            assert!(
                bits(&gpu.forward(&mut g, &[7], &all).unwrap()) == want_next,
                "{family}: decode"
            );
            let mut c = cpu.new_cache();
            let mut g = gpu.new_cache().unwrap();
            for piece in [&prompt[..11], &prompt[11..31], &prompt[31..]] {
                assert!(
                    bits(&gpu.forward(&mut g, piece, &all).unwrap())
                        == bits(&engine.forward(&mut c, piece, &all).unwrap()),
                    "{family}: a chunk of {}",
                    piece.len()
                );
            }
            // three sequences in one step: (history, this step's tokens)
            let plan = [
                (toks(2, 5), toks(3, 21)),
                (toks(4, 9), toks(5, 1)),
                (Vec::new(), toks(6, 18)),
            ];
            let mut want = Vec::new();
            for (hist, step) in &plan {
                let mut c = cpu.new_cache();
                if !hist.is_empty() {
                    engine.forward(&mut c, hist, &all).unwrap();
                }
                want.push(bits(&engine.forward(&mut c, step, &all).unwrap()));
            }
            let mut caches: Vec<_> = plan
                .iter()
                .map(|(hist, _)| {
                    let mut c = gpu.new_cache().unwrap();
                    if !hist.is_empty() {
                        gpu.forward(&mut c, hist, &all).unwrap();
                    }
                    c
                })
                .collect();
            let mut entries: Vec<_> = caches
                .iter_mut()
                .zip(&plan)
                .map(|(c, (_, step))| BatchEntry {
                    cache: c,
                    tokens: &step[..],
                    opts: all,
                })
                .collect();
            let outs = gpu.forward_batch(&mut entries).unwrap();
            for (i, (o, w)) in outs.iter().zip(&want).enumerate() {
                assert!(&bits(o) == w, "{family}: sequence {i} of the step");
            }
            eprintln!("{family}: the lane-sequential kernels give the CPU's bits");
        }
    }

    #[test]
    fn the_few_pair_kernels_give_the_cpus_bits() {
        // ManyKernels::Few: the experts of steps with few routed pairs per expert on
        // kernels/tile.cu's gate_up_few_bf16 / down_few (tiles of 1, 2 or 4 pairs) and the dense
        // products of 2 to 8 tokens on mm_few_bf16, against the
        // CPU backend: a short prompt in one step and in chunks, then steps of five sequences
        // decoding together (each equal to it alone), and the kernels must have run.
        // ManyKernels::Auto (the default): the same experts' kernels, and never mm_few_bf16.
        use crate::ManyKernels::{Auto, Few};
        use tarfa_core::step::{ForwardOptions, LogitRows};
        let mut runs = vec![
            ("qwen3moe-a", Few),
            ("olmoe-s", Few),
            ("deepseekv3-s", Few),
            ("qwen3moe-odd", Few),
            ("qwen3moe-a", Auto),
        ];
        if !super::emulated() {
            runs.extend([("qwen3_moe", Few), ("qwen2_moe", Few), ("olmoe-s", Auto)]);
        }
        for (family, many) in runs {
            let (cfg, cpu, engine, gpu) = cpu_and_mock(family, 29, many);
            let v = cfg.vocab_size;
            let toks = |seed: usize, n: usize| -> Vec<u32> {
                (0..n)
                    .map(|i| ((seed * 71 + i * 29 + 3) % v) as u32)
                    .collect()
            };
            let all = ForwardOptions {
                logits: LogitRows::All,
                trace_router: true,
                ..Default::default()
            };
            let bits = step_bits;
            // a prompt short enough to stay below 4 pairs per expert, whole and in chunks
            let n = (4 * cfg.num_experts / cfg.top_k).clamp(2, 12) - 1;
            let prompt = toks(1, n);
            let mut c = cpu.new_cache();
            let want = bits(&engine.forward(&mut c, &prompt, &all).unwrap());
            let mut g = gpu.new_cache().unwrap();
            assert!(
                bits(&gpu.forward(&mut g, &prompt, &all).unwrap()) == want,
                "{family}: a prompt of {n}"
            );
            let mut c = cpu.new_cache();
            let mut g = gpu.new_cache().unwrap();
            for piece in prompt.chunks(n.div_ceil(2)) {
                assert!(
                    bits(&gpu.forward(&mut g, piece, &all).unwrap())
                        == bits(&engine.forward(&mut c, piece, &all).unwrap()),
                    "{family}: a chunk of {}",
                    piece.len()
                );
            }
            // five sequences with their own histories, three decode steps together
            let b = 5;
            let mut cpus: Vec<_> = (0..b)
                .map(|i| {
                    let mut c = cpu.new_cache();
                    engine.forward(&mut c, &toks(10 + i, 3 + i), &all).unwrap();
                    c
                })
                .collect();
            let mut gpus: Vec<_> = (0..b)
                .map(|i| {
                    let mut c = gpu.new_cache().unwrap();
                    gpu.forward(&mut c, &toks(10 + i, 3 + i), &all).unwrap();
                    c
                })
                .collect();
            for step in 0..3 {
                let next: Vec<Vec<u32>> = (0..b).map(|i| toks(20 + i + step, 1)).collect();
                batched_step_is_each_alone(
                    &engine,
                    &gpu,
                    &mut cpus,
                    &mut gpus,
                    &next,
                    all,
                    &format!("{family}: decode step {step}"),
                );
            }
            let ran = gpu.gpu.mock_launches();
            for k in ["gate_up_few_bf16", "down_few", "mm_few_bf16"] {
                let want = many == Few || k != "mm_few_bf16";
                assert_eq!(
                    ran.get(k).copied().unwrap_or(0) > 0,
                    want,
                    "{family} {many:?}: {k}: {ran:?}"
                );
            }
            // (gate_up_tile may still run a dense MLP or shared expert; down_tile is experts'
            // only)
            assert_eq!(ran.get("down_tile"), None, "{family}: {ran:?}");
            eprintln!("{family} {many:?}: the few-pair kernels give the CPU's bits");
        }
    }

    #[test]
    fn a_batched_step_uploads_rope_rows_only_when_a_cache_grows() {
        // three sequences decode together; one starts a position short of its cache's first
        // capacity (256), so it grows inside the second step. RoPE rows go to the device once
        // per capacity: a copy per sequence per step is a synchronous copy each (model.rs
        // `upload_rope`), and the rows after the growth must still be right (the CPU's bits).
        use tarfa_core::step::ForwardOptions;
        let (cfg, cpu, engine, gpu) = cpu_and_mock("qwen3_moe", 12, crate::ManyKernels::Auto);
        assert!(
            cfg.max_position_embeddings > 300,
            "the shape leaves room to grow"
        );
        let v = cfg.vocab_size;
        let toks = |seed: usize, n: usize| -> Vec<u32> {
            (0..n)
                .map(|i| ((seed * 53 + i * 17 + 1) % v) as u32)
                .collect()
        };
        let last = ForwardOptions::default();
        let lens = [255usize, 7, 30];
        let mut cpus: Vec<_> = Vec::new();
        let mut gpus: Vec<_> = Vec::new();
        for (i, &n) in lens.iter().enumerate() {
            let mut c = cpu.new_cache();
            engine.forward(&mut c, &toks(i, n), &last).unwrap();
            cpus.push(c);
            let mut g = gpu.new_cache().unwrap();
            gpu.forward(&mut g, &toks(i, n), &last).unwrap();
            gpus.push(g);
        }
        let cos_rows = |gpu: &CudaModel| {
            gpu.gpu
                .mock_writes()
                .get("the RoPE cos rows")
                .copied()
                .unwrap_or(0)
        };
        let mut before = cos_rows(&gpu);
        for step in 0..4 {
            let next: Vec<Vec<u32>> = (0..lens.len()).map(|i| toks(40 + i + step, 1)).collect();
            batched_step_is_each_alone(
                &engine,
                &gpu,
                &mut cpus,
                &mut gpus,
                &next,
                last,
                &format!("decode step {step}"),
            );
            let now = cos_rows(&gpu);
            // step 1 takes the first sequence from 256 to 257 positions: its cache grows
            let grows = usize::from(step == 1);
            assert_eq!(now - before, grows, "RoPE uploads in decode step {step}");
            before = now;
        }
    }

    /// Records every value a step shows it, as bits, in the order shown (a capture-only hook).
    #[derive(Default)]
    struct Recorder {
        /// Some(layers): only those layers are wanted
        layers: Option<Vec<usize>>,
        /// Some(name): says it intervenes
        intervenes: Option<String>,
        seen: Vec<(String, usize, Vec<u32>)>,
    }

    impl Recorder {
        fn note(&mut self, what: &str, l: usize, rows: &[Vec<f32>]) {
            if self.layers.as_ref().is_none_or(|w| w.contains(&l)) {
                let bits = rows.iter().flatten().map(|x| x.to_bits()).collect();
                self.seen.push((what.into(), l, bits));
            }
        }
    }

    impl tarfa_cpu::StepHook for Recorder {
        fn residual(&mut self, l: usize, h: &mut [Vec<f32>]) {
            self.note("residual", l, h);
        }
        fn router_logits(&mut self, l: usize, x: &mut [Vec<f32>]) {
            self.note("router_logits", l, x);
        }
        fn attn_out(&mut self, l: usize, y: &mut [Vec<f32>]) {
            self.note("attn_out", l, y);
        }
        fn mlp_out(&mut self, l: usize, y: &mut [Vec<f32>]) {
            self.note("mlp_out", l, y);
        }
        fn router_probs(&mut self, l: usize, p: &[Vec<f32>]) {
            self.note("router_probs", l, p);
        }
        fn expert_out(&mut self, l: usize, t: usize, e: usize, y: &[f32]) {
            self.note(&format!("expert_out t{t} e{e}"), l, &[y.to_vec()]);
        }
        fn wants(&self, _what: tarfa_cpu::Capture, l: usize) -> bool {
            self.layers.as_ref().is_none_or(|w| w.contains(&l))
        }
        fn intervention(&self) -> Option<String> {
            self.intervenes.clone()
        }
    }

    #[test]
    fn captures_on_cuda_are_the_cpus_bits_alone_and_in_a_batch() {
        // forward_seqs_observed against the CPU's forward_batch_observed: every capture (the
        // residual entering each layer and after the last, attn_out, mlp_out, router logits
        // and probabilities, each chosen expert's output) the same bits in the same order,
        // for one sequence of several tokens, one of a single token (which leaves the decode
        // graph for the per-operation kernels), and three sequences in one step; with a layer
        // selection only those layers; the outputs equal to a step without a hook; a hook that
        // says it intervenes refused by name, with no cache advanced.
        use tarfa_core::batch::BatchEntry;
        use tarfa_core::step::{ForwardOptions, ForwardOutput, LogitRows};
        use tarfa_core::Backend;
        // the emulator runs the real kernels: one fixture there (CI time)
        let mut families: Vec<&str> = if super::emulated() {
            vec!["qwen2moe-s"]
        } else {
            vec![
                "qwen3moe-a",
                "qwen2moe-s",
                "olmoe-s",
                "deepseekv3-s",
                "mixtral-s",
                "llama4-llama3-s",
            ]
        };
        if shared_oracle().is_some() && !super::emulated() {
            families.push("gptoss-a");
        }
        let opts = ForwardOptions {
            logits: LogitRows::All,
            trace_router: true,
            ..ForwardOptions::default()
        };
        let bits = |o: &ForwardOutput| {
            let l: Vec<Vec<u32>> = o
                .logits
                .iter()
                .map(|r| r.iter().map(|x| x.to_bits()).collect())
                .collect();
            (l, format!("{:?}", o.router), o.stats)
        };
        for family in families {
            let (cfg, src) = fixture(family);
            let v = cfg.vocab_size;
            let cpu = Arc::new(CpuModel::load(cfg.clone(), src.clone()).unwrap());
            let engine = CpuEngine::new(
                cpu.clone(),
                EngineOptions {
                    threads: 2,
                    kernel: Kernel::best(),
                },
            )
            .unwrap();
            let gpu = CudaModel::load_on(Gpu::mock(), cfg.clone(), src.clone(), None).unwrap();
            let toks = |seed: usize, n: usize| -> Vec<u32> {
                (0..n)
                    .map(|i| ((seed * 97 + i * 41 + 3) % v) as u32)
                    .collect()
            };
            let n_layers = cfg.num_layers;
            let selections = [None, Some(vec![1, n_layers])];
            let steps: Vec<Vec<Vec<u32>>> = vec![
                vec![toks(1, 6)],
                vec![toks(2, 1)],
                vec![toks(3, 5), toks(4, 1), toks(5, 3)],
            ];
            for sel in &selections {
                for step in &steps {
                    let what = format!("{family}, layers {sel:?}, {} sequences", step.len());
                    let mut cpu_caches: Vec<_> = step.iter().map(|_| cpu.new_cache()).collect();
                    let mut entries: Vec<_> = cpu_caches
                        .iter_mut()
                        .zip(step)
                        .map(|(c, t)| BatchEntry {
                            cache: c,
                            tokens: &t[..],
                            opts,
                        })
                        .collect();
                    let mut want = Recorder {
                        layers: sel.clone(),
                        ..Recorder::default()
                    };
                    let want_out = engine
                        .forward_batch_observed(&mut entries, Some(&mut want))
                        .unwrap();
                    let mut gpu_caches: Vec<_> =
                        step.iter().map(|_| gpu.new_cache().unwrap()).collect();
                    let mut entries: Vec<_> = gpu_caches
                        .iter_mut()
                        .zip(step)
                        .map(|(c, t)| BatchEntry {
                            cache: c,
                            tokens: &t[..],
                            opts,
                        })
                        .collect();
                    let mut got = Recorder {
                        layers: sel.clone(),
                        ..Recorder::default()
                    };
                    let got_out = gpu.forward_seqs_observed(&mut entries, &mut got).unwrap();
                    for kind in [
                        "residual",
                        "attn_out",
                        "mlp_out",
                        "router_logits",
                        "router_probs",
                        "expert_out",
                    ] {
                        assert!(
                            got.seen.iter().any(|(n, _, _)| n.starts_with(kind)),
                            "{what}: no {kind} captured"
                        );
                    }
                    if let Some(w) = sel {
                        assert!(got.seen.iter().all(|(_, l, _)| w.contains(l)), "{what}");
                    }
                    let names = |r: &Recorder| -> Vec<(String, usize)> {
                        r.seen.iter().map(|(n, l, _)| (n.clone(), *l)).collect()
                    };
                    assert_eq!(
                        names(&got),
                        names(&want),
                        "{what}: what was shown, in order"
                    );
                    for (g, w) in got.seen.iter().zip(&want.seen) {
                        assert!(
                            g == w,
                            "{what}: {} at layer {} differs from the CPU's",
                            w.0,
                            w.1
                        );
                    }
                    for (g, w) in got_out.iter().zip(&want_out) {
                        assert_eq!(bits(g), bits(w), "{what}: outputs");
                    }
                    // no hook: the same outputs
                    let mut plain: Vec<_> = step.iter().map(|_| gpu.new_cache().unwrap()).collect();
                    let mut entries: Vec<_> = plain
                        .iter_mut()
                        .zip(step)
                        .map(|(c, t)| BatchEntry {
                            cache: c,
                            tokens: &t[..],
                            opts,
                        })
                        .collect();
                    let outs = gpu.forward_batch(&mut entries).unwrap();
                    for (g, w) in outs.iter().zip(&got_out) {
                        assert_eq!(bits(g), bits(w), "{what}: with and without a hook");
                    }
                }
            }
            // an intervening hook: refused by its name, before any work
            let mut c = gpu.new_cache().unwrap();
            let t = toks(6, 2);
            let mut entries = vec![BatchEntry {
                cache: &mut c,
                tokens: &t[..],
                opts,
            }];
            let mut hook = Recorder {
                intervenes: Some("residual_add(layer=1)".into()),
                ..Recorder::default()
            };
            let err = gpu
                .forward_seqs_observed(&mut entries, &mut hook)
                .unwrap_err();
            let msg = err.error.to_string();
            assert!(
                msg.contains("residual_add(layer=1)") && msg.contains("captures only"),
                "{msg}"
            );
            assert!(
                hook.seen.is_empty(),
                "{family}: shown values before the refusal"
            );
            assert_eq!(c.len(), 0, "{family}: the cache advanced");
        }
    }

    #[test]
    fn a_hook_that_writes_or_forces_on_cuda_fails_the_step() {
        // a hook that says it only observes but writes to the residual, or forces experts:
        // the write would be lost on the device, so the step fails by name and commits nothing
        use tarfa_core::batch::BatchEntry;
        use tarfa_core::step::ForwardOptions;
        struct Liar(bool);
        impl tarfa_cpu::StepHook for Liar {
            fn residual(&mut self, _l: usize, h: &mut [Vec<f32>]) {
                if self.0 {
                    h[0][0] += 1.0;
                }
            }
            fn forced_experts(&mut self, _l: usize, _t: usize) -> Option<Vec<usize>> {
                (!self.0).then(|| vec![0, 1])
            }
            fn intervention(&self) -> Option<String> {
                None
            }
        }
        let (cfg, src) = random_model(&SyntheticShape::small("qwen3_moe"), 4);
        let gpu = CudaModel::load_on(Gpu::mock(), cfg, Arc::new(src), None).unwrap();
        for writes in [true, false] {
            let mut c = gpu.new_cache().unwrap();
            let t = [1u32, 2, 3];
            let mut entries = vec![BatchEntry {
                cache: &mut c,
                tokens: &t[..],
                opts: ForwardOptions::default(),
            }];
            let err = gpu
                .forward_seqs_observed(&mut entries, &mut Liar(writes))
                .unwrap_err();
            let msg = err.error.to_string();
            let named = if writes {
                "wrote to the Residual"
            } else {
                "forced the experts"
            };
            assert!(
                msg.contains(named) && msg.contains("captures only"),
                "{msg}"
            );
            assert_eq!(c.len(), 0, "the cache advanced");
        }
    }

    #[test]
    fn the_kv_cache_grows_past_its_first_capacity() {
        // the cache starts with 256 positions: a 250-token prefill, then decode past 256
        let (cfg, src) = random_model(&SyntheticShape::small("qwen3_moe"), 10);
        let v = cfg.vocab_size;
        let prompts = vec![(0..250).map(|i| (i * 7 % v) as u32).collect()];
        compare("growth", cfg, Arc::new(src), prompts, 9);
    }

    /// An oracle fixture of fixtures/oracle, or of the shared oracle (`shared_oracle`): its
    /// config and weights.
    fn fixture(name: &str) -> (MoeConfig, Arc<dyn WeightSource>) {
        let mut dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures/oracle")
            .join(name);
        if !dir.exists() {
            dir = shared_oracle()
                .unwrap_or_else(|| panic!("{name}: not in fixtures/oracle, and no shared oracle"))
                .join(name);
        }
        let cfg =
            MoeConfig::from_json_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        let spec = ArchSpec::new(&cfg);
        let src = Arc::new(load_safetensors_dir(&dir, &cfg, &spec).unwrap());
        (cfg, src)
    }

    /// The shared oracle (../shared/oracle beside the checkout, or TARFA_EXTRA_ORACLES), whose
    /// fixtures the repository does not copy (gpt-oss's). None where this machine has none;
    /// under CI (which has it) a missing one fails the test instead.
    fn shared_oracle() -> Option<PathBuf> {
        let dir = std::env::var_os("TARFA_EXTRA_ORACLES")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/oracle")
            });
        if dir.join("gptoss-a").exists() {
            return Some(dir);
        }
        assert!(
            std::env::var_os("CI").is_none(),
            "CI: the shared oracle is missing at {}",
            dir.display()
        );
        eprintln!("no shared oracle at {}: skipped", dir.display());
        None
    }

    /// The CPU-vs-CUDA selftest with the experts streamed through a hot tier of 3 slots (LRU).
    fn streamed_gives_the_cpus_bits(
        name: &str,
        cfg: &MoeConfig,
        src: Arc<dyn WeightSource>,
        prompts: Vec<Vec<u32>>,
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
        let gpu = streamed(cfg, src, 3, tarfa_stream::CachePolicy::Lru, Vec::new());
        let opts = SelftestOptions {
            prompts,
            decode_steps: 3,
            cpu_threads: 2,
        };
        let rep = selftest_models(&engine, &gpu, &opts).unwrap();
        assert!(rep.passed(), "{name} streamed: {rep}");
    }

    #[test]
    fn deepseek_runs_on_the_kernels_with_the_cpus_bits_resident_and_streamed() {
        // multi-head latent attention (q LoRA or plain q_proj, interleaved rope, YaRN's
        // softmax scale), the latent cache, group-limited sigmoid routing (V3) and V2's softmax
        // routing, ungated shared experts, a first dense layer; resident, and V3 streamed
        // through a hot tier of 3 slots
        for name in ["deepseekv3-s", "deepseekv3-plain-s", "deepseekv2-yarn-s"] {
            let (cfg, src) = fixture(name);
            assert!(cfg.mla.is_some(), "{name}");
            let spec = ArchSpec::new(&cfg);
            assert_eq!(
                super::super::unsupported_family(&cfg, &spec),
                None,
                "{name}"
            );
            let v = cfg.vocab_size;
            let prompts = vec![vec![1], (0..12).map(|i| (i * 13 % v) as u32).collect()];
            // the decode graph's kernels take MLA and both routers: every mode is the CPU's
            modes_match_the_cpu_on(name, cfg.clone(), src.clone(), &modes_to_check());
            compare(name, cfg.clone(), src.clone(), prompts.clone(), 3);
            if name == "deepseekv3-s" {
                streamed_gives_the_cpus_bits(name, &cfg, src.clone(), prompts);
            }
        }
    }

    #[test]
    fn mixtral_windows_and_olmoe_clip_qkv_run_on_the_kernels_with_the_cpus_bits() {
        // Mixtral's sliding_window on every layer (the long prompt and its decode steps pass
        // it) and OLMoE's clip_qkv after the q/k norm (clip_abs), the transformers fixtures of
        // both: resident (legacy decode: the decode graph refuses both by name) and streamed
        for (name, why) in [
            ("mixtral-window-s", "sliding-window"),
            ("olmoe-clip-s", "clip_qkv"),
        ] {
            let (cfg, src) = fixture(name);
            let spec = ArchSpec::new(&cfg);
            assert_eq!(
                super::super::unsupported_family(&cfg, &spec),
                None,
                "{name}"
            );
            let gpu = CudaModel::load_on(Gpu::mock(), cfg.clone(), src.clone(), None).unwrap();
            let reason = gpu
                .decode_unsupported_reason()
                .unwrap_or_default()
                .to_string();
            assert!(reason.contains(why), "{name}: {reason}");
            drop(gpu);
            let v = cfg.vocab_size;
            let window = cfg
                .layer_windows
                .iter()
                .flatten()
                .copied()
                .max()
                .unwrap_or(8);
            let long: Vec<u32> = (0..window + 7).map(|i| (i * 13 % v) as u32).collect();
            let prompts = vec![vec![1], long];
            compare(name, cfg.clone(), src.clone(), prompts.clone(), 4);
            streamed_gives_the_cpus_bits(name, &cfg, src.clone(), prompts);
        }
    }

    #[test]
    fn gpt_oss_runs_on_the_kernels_with_the_cpus_bits_resident_and_streamed() {
        // attention sinks, sliding windows of 16 on alternate layers (the long prompt and its
        // decode steps pass the window), q/k/v/o biases, YaRN, the biased router with the
        // softmax over its top-k, expert biases and the clamped SwiGLU; the released MXFP4
        // experts widened by the weight source; resident (legacy decode: the decode graph's
        // kernels refuse these by name), and streamed through a hot tier of 3 slots
        if shared_oracle().is_none() {
            return;
        }
        for name in ["gptoss-a", "gptoss-mxfp4-a"] {
            let (cfg, src) = fixture(name);
            let spec = ArchSpec::new(&cfg);
            assert_eq!(
                super::super::unsupported_family(&cfg, &spec),
                None,
                "{name}"
            );
            let gpu = CudaModel::load_on(Gpu::mock(), cfg.clone(), src.clone(), None).unwrap();
            let why = gpu
                .decode_unsupported_reason()
                .unwrap_or_default()
                .to_string();
            assert!(why.contains("sliding-window"), "{name}: {why}");
            drop(gpu);
            let v = cfg.vocab_size;
            let window = cfg.layer_windows.iter().flatten().copied().max().unwrap();
            let long: Vec<u32> = (0..window + 7).map(|i| (i * 13 % v) as u32).collect();
            let prompts = vec![vec![1], long];
            compare(name, cfg.clone(), src.clone(), prompts.clone(), 4);
            streamed_gives_the_cpus_bits(name, &cfg, src.clone(), prompts);
        }
    }

    #[test]
    fn llama4_runs_on_the_kernels_with_the_cpus_bits_resident_and_streamed() {
        // the top-k sigmoid router whose score scales each expert's input (scale_slots) and
        // the unweighted mix, the ungated shared expert, dense layers (llama4-dense-s, top-2),
        // the pairwise rotary embedding, NoPE layers with their attention temperature (active
        // in llama4-dense-s), chunked attention (prompts and decode past the chunk), the L2 q/k
        // norm after the rotation; resident (legacy decode) and streamed through 3 slots
        let mut names = vec!["llama4-dense-s"];
        if shared_oracle().is_some() {
            names.push("llama4-a");
        }
        for name in names {
            let (cfg, src) = fixture(name);
            let spec = ArchSpec::new(&cfg);
            assert_eq!(
                super::super::unsupported_family(&cfg, &spec),
                None,
                "{name}"
            );
            let gpu = CudaModel::load_on(Gpu::mock(), cfg.clone(), src.clone(), None).unwrap();
            assert!(gpu.decode_unsupported_reason().is_some(), "{name}");
            drop(gpu);
            let v = cfg.vocab_size;
            let chunk = cfg
                .layer_chunks
                .iter()
                .flatten()
                .copied()
                .max()
                .unwrap_or(8);
            let long: Vec<u32> = (0..chunk + 5).map(|i| (i * 13 % v) as u32).collect();
            let prompts = vec![vec![1], long];
            compare(name, cfg.clone(), src.clone(), prompts.clone(), 4);
            streamed_gives_the_cpus_bits(name, &cfg, src.clone(), prompts);
        }
    }

    #[test]
    fn glm4_moe_runs_on_the_kernels_with_the_cpus_bits_resident_and_streamed() {
        // GLM-4.5's partial rotary (half of each head), q/k/v biases, per-head q/k norm,
        // group-limited sigmoid routing with the correction bias, an ungated shared expert and
        // a first dense layer: the fixture as transformers made it (one group), the same
        // weights routed in 2 groups of 4 keeping 1 (what the fixture's one group cannot
        // test), and that model with its experts streamed through a hot tier of 3 slots
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/oracle/glm4moe-s");
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let mut grouped: serde_json::Value = serde_json::from_str(&text).unwrap();
        grouped["n_group"] = 2.into();
        grouped["topk_group"] = 1.into();
        for (name, json) in [
            ("glm4moe-s", text.clone()),
            ("glm4moe-s 2 groups", grouped.to_string()),
        ] {
            let cfg = MoeConfig::from_json_str(&json).unwrap();
            assert!(cfg.rotary_dim < cfg.head_dim, "{name}: partial rotary");
            let spec = ArchSpec::new(&cfg);
            assert_eq!(
                super::super::unsupported_family(&cfg, &spec),
                None,
                "{name}"
            );
            let src: Arc<dyn WeightSource> =
                Arc::new(load_safetensors_dir(&dir, &cfg, &spec).unwrap());
            let v = cfg.vocab_size;
            let prompts = vec![vec![1], (0..12).map(|i| (i * 13 % v) as u32).collect()];
            // the decode graph too (attn_decode4p: partial rotary), every mode the CPU's bits
            modes_match_the_cpu_on(name, cfg.clone(), src.clone(), &modes_to_check());
            compare(name, cfg.clone(), src.clone(), prompts.clone(), 3);
            if name.contains("groups") {
                streamed_gives_the_cpus_bits(name, &cfg, src.clone(), prompts);
            }
        }
    }

    /// A hybrid decoder's fixture (gated DeltaNet layers and gated attention) against the CPU:
    /// the selftest (prefill with every position's logits, greedy decode steps through the
    /// per-operation path: the decode graph refuses these layers), then the states' rules
    /// (tarfa-cpu's KvCache): a prompt fed in two steps equals it fed in one, a rewind to the
    /// last step's start is served from the kept state, one further back empties the cache,
    /// and a step over two sequences gives each the bits of its own run; every logit compared
    /// bit for bit.
    fn hybrid_gives_the_cpus_bits(name: &str) {
        use tarfa_core::batch::BatchEntry;
        use tarfa_core::step::{ForwardOptions, ForwardOutput, LogitRows};
        use tarfa_core::Backend;
        let (cfg, src) = fixture(name);
        let spec = ArchSpec::new(&cfg);
        assert!(
            spec.extras.linear_attention.is_some() && spec.extras.gated_attention,
            "{name}"
        );
        assert!(cfg.layer_linear.iter().any(|&l| l), "{name}");
        assert!(cfg.layer_linear.iter().any(|&l| !l), "{name}");
        assert_eq!(
            super::super::unsupported_family(&cfg, &spec),
            None,
            "{name}"
        );
        let v = cfg.vocab_size;
        let prompts = vec![vec![1], (0..12).map(|i| (i * 13 % v) as u32).collect()];
        compare(name, cfg.clone(), src.clone(), prompts, 4);

        let cpu = Arc::new(CpuModel::load(cfg.clone(), src.clone()).unwrap());
        let engine = CpuEngine::new(
            cpu.clone(),
            EngineOptions {
                threads: 2,
                kernel: Kernel::best(),
            },
        )
        .unwrap();
        let gpu = CudaModel::load_on(Gpu::mock(), cfg.clone(), src, None).unwrap();
        let why = gpu.decode_unsupported_reason().unwrap_or_default();
        assert!(why.contains("gated DeltaNet"), "{name}: {why}");
        let all = ForwardOptions {
            logits: LogitRows::All,
            ..Default::default()
        };
        let bits = |o: &ForwardOutput| -> Vec<u32> {
            o.logits.iter().flatten().map(|x| x.to_bits()).collect()
        };
        // the CPU's logits of the last of `steps`, fed one after another to a fresh cache
        let cpu_last = |steps: &[&[u32]]| -> Vec<u32> {
            let mut c = cpu.new_cache();
            let mut last = Vec::new();
            for s in steps {
                last = bits(&engine.forward(&mut c, s, &all).unwrap());
            }
            last
        };
        let prompt: Vec<u32> = (0..9).map(|i| ((i * 29 + 5) % v) as u32).collect();
        let mut c = gpu.new_cache().unwrap();
        assert_eq!(
            gpu.run_ahead(&c),
            1,
            "{name}: no run-ahead past unserved rewinds"
        );
        // the prompt in two steps: the state carried across them
        let first = bits(&gpu.forward(&mut c, &prompt[..5], &all).unwrap());
        assert_eq!(first, cpu_last(&[&prompt[..5]]), "{name}: prefill of 5");
        let second = bits(&gpu.forward(&mut c, &prompt[5..], &all).unwrap());
        assert_eq!(
            second,
            cpu_last(&[&prompt]).split_off(5 * v),
            "{name}: 5 + 4"
        );
        let step = bits(&gpu.forward(&mut c, &[7], &all).unwrap());
        assert_eq!(step, cpu_last(&[&prompt, &[7]]), "{name}: decode");
        // the last step's start is served from the kept state, once
        assert_eq!(c.truncate(9), 9, "{name}");
        let other = bits(&gpu.forward(&mut c, &[11], &all).unwrap());
        assert_eq!(other, cpu_last(&[&prompt, &[11]]), "{name}: after a rewind");
        assert_eq!(c.truncate(9), 9, "{name}");
        assert_eq!(c.truncate(8), 0, "{name}: the state at 8 was never kept");
        assert!(c.is_empty(), "{name}");
        let again = bits(&gpu.forward(&mut c, &prompt, &all).unwrap());
        assert_eq!(again, cpu_last(&[&prompt]), "{name}: re-fed after emptying");
        // a rewind further back than the last step's start empties the cache too
        gpu.forward(&mut c, &[7], &all).unwrap();
        assert_eq!(c.truncate(4), 0, "{name}");
        // a refused step changes no state
        let mut d = gpu.new_cache().unwrap();
        gpu.forward(&mut d, &prompt, &all).unwrap();
        assert!(gpu.forward(&mut d, &[v as u32], &all).is_err());
        let step = bits(&gpu.forward(&mut d, &[7], &all).unwrap());
        assert_eq!(
            step,
            cpu_last(&[&prompt, &[7]]),
            "{name}: after a refused step"
        );
        // two sequences in one step, each with its own states
        let mut a = gpu.new_cache().unwrap();
        gpu.forward(&mut a, &prompt[..4], &all).unwrap();
        let mut b = gpu.new_cache().unwrap();
        let other: Vec<u32> = vec![3, 4, 5];
        let outs = gpu
            .forward_batch(&mut [
                BatchEntry {
                    cache: &mut a,
                    tokens: &prompt[4..],
                    opts: all,
                },
                BatchEntry {
                    cache: &mut b,
                    tokens: &other,
                    opts: all,
                },
            ])
            .unwrap();
        assert_eq!(
            bits(&outs[0]),
            cpu_last(&[&prompt[..4], &prompt[4..]]),
            "{name}: sequence 0 of a batch"
        );
        assert_eq!(bits(&outs[1]), cpu_last(&[&other]), "{name}: sequence 1");
        // and each advanced its own state: a decode step on each after the batch
        let next_a = bits(&gpu.forward(&mut a, &[7], &all).unwrap());
        assert_eq!(
            next_a,
            cpu_last(&[&prompt, &[7]]),
            "{name}: after the batch"
        );
        assert_eq!(b.truncate(0), 0);
        let next_b = bits(&gpu.forward(&mut b, &other, &all).unwrap());
        assert_eq!(next_b, cpu_last(&[&other]), "{name}: rewound to 0");
    }

    #[test]
    fn qwen3_next_runs_on_the_kernels_with_the_cpus_bits() {
        // Qwen3-Next: in_proj_qkvz / in_proj_ba grouped by key head (linear_unpack), 3 gated
        // DeltaNet layers and one gated-attention layer with partial rotary, zero-centred norms,
        // a gated shared expert
        if shared_oracle().is_none() {
            return;
        }
        hybrid_gives_the_cpus_bits("qwen3next-a");
    }

    #[test]
    fn qwen3_5_moe_runs_on_the_kernels_with_the_cpus_bits() {
        // Qwen3.5 MoE: the separate in_proj_qkv, _z, _b, _a projections
        if shared_oracle().is_none() {
            return;
        }
        hybrid_gives_the_cpus_bits("qwen35moe-a");
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
