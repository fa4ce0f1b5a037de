//! One Rust function per kernel: the launch geometry and the argument list, mirroring each
//! `extern "C"` declaration in kernels/*.cu. The forward pass and the kernel checks call these
//! and nothing else.

use super::device::{Arg, DevBuf, Gpu};
use super::CudaError;

/// Element type of a device matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DType {
    Bf16,
    F32,
}

impl DType {
    pub(crate) fn size(self) -> usize {
        match self {
            DType::Bf16 => 2,
            DType::F32 => 4,
        }
    }
}

/// A row-major matrix in device memory: its own allocation, or a part of one shared with other
/// matrices (the q, k and v projections of a layer, stacked for the decode kernels).
pub(crate) struct DevMat {
    pub(crate) buf: std::sync::Arc<DevBuf>,
    /// Byte offset of the first row in `buf`.
    pub(crate) off: u64,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) dtype: DType,
}

impl DevMat {
    /// A matrix owning `buf`.
    pub(crate) fn own(buf: DevBuf, rows: usize, cols: usize, dtype: DType) -> DevMat {
        DevMat {
            buf: std::sync::Arc::new(buf),
            off: 0,
            rows,
            cols,
            dtype,
        }
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.buf.ptr() + self.off
    }

    /// Bytes of weights (as the CPU's statistics count them).
    pub(crate) fn bytes(&self) -> u64 {
        (self.rows * self.cols * self.dtype.size()) as u64
    }
}

fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per) as u32
}

fn i32_of(n: usize, what: &str) -> Result<i32, CudaError> {
    i32::try_from(n).map_err(|_| CudaError::UnsupportedModel(format!("{what} = {n} exceeds 2^31")))
}

/// The experts' function beyond the SwiGLU (kernels/moe.cu `ExpertMath`): gpt-oss's biases and
/// clamped SwiGLU, Llama 4's input scaling. The default is the plain SwiGLU MoE of the other
/// families (every kernel then computes what it computed before these were added).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct ExpertMath {
    /// The experts' biases, `[E][width]` gate and up (after their dots) and `[E][hidden]` down
    /// (after its dot, before the routing weight); 0: none.
    pub(crate) bias_gate: u64,
    pub(crate) bias_up: u64,
    pub(crate) bias_down: u64,
    /// gpt-oss's clamped SwiGLU: (alpha, limit).
    pub(crate) clamp: Option<(f32, f32)>,
    /// Llama 4: slot (t, j) reads its own input row `t*k + j` (the input times its weight), and
    /// the mix adds the outputs unweighted.
    pub(crate) input_scaled: bool,
}

impl ExpertMath {
    /// The gate/up kernels' trailing arguments: bg, bu, alpha, limit, clamped, x_per_slot.
    fn act_args(&self) -> [Arg; 6] {
        let (alpha, limit) = self.clamp.unwrap_or((0.0, 0.0));
        [
            Arg::Ptr(self.bias_gate),
            Arg::Ptr(self.bias_up),
            Arg::F32(alpha),
            Arg::F32(limit),
            Arg::I32(i32::from(self.clamp.is_some())),
            Arg::I32(i32::from(self.input_scaled)),
        ]
    }

    /// Whether the token-tiled expert kernels (tile.cu), which compute the plain SwiGLU only,
    /// may run these experts.
    pub(crate) fn plain(&self) -> bool {
        *self == ExpertMath::default()
    }
}

/// How a layer's keys and queries are rotated and normalised before the cache append
/// (kernels/norm_rope.cu `RopeForm`). The default is the rotate-half rotation alone.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct RopeForm {
    /// Llama 4's complex form (pairs `(x_2i, x_2i+1)`).
    pub(crate) pairs: bool,
    /// A NoPE layer: no rotation.
    pub(crate) none: bool,
    /// Llama 4's weightless L2 norm of every query and key head after the rotation, its eps.
    pub(crate) l2: Option<f32>,
    /// The step's per-token query scales (the NoPE layers' attention temperature), 0: none.
    pub(crate) qscale: u64,
}

impl RopeForm {
    fn args(&self) -> [Arg; 4] {
        let form = if self.none { 2 } else { i32::from(self.pairs) };
        [
            Arg::I32(form),
            Arg::I32(i32::from(self.l2.is_some())),
            Arg::F32(self.l2.unwrap_or(0.0)),
            Arg::Ptr(self.qscale),
        ]
    }
}

/// OLMoE's clip_qkv: `x_i = max(min(x_i, c), -c)` on `n` values in place (kernels/norm_rope.cu
/// `clip_abs`).
pub(crate) fn clip_abs(gpu: &Gpu, x: u64, n: usize, c: f32) -> Result<(), CudaError> {
    if n == 0 {
        return Ok(());
    }
    gpu.launch(
        "clip_abs",
        (n.div_ceil(256) as u32, 1, 1),
        (256, 1, 1),
        0,
        &[Arg::Ptr(x), Arg::I64(n as i64), Arg::F32(c)],
    )
}

/// Llama 4's expert inputs `xs[t*k + j] = xn[t] * w[t*k + j]` (kernels/moe.cu `scale_slots`).
pub(crate) fn scale_slots(
    gpu: &Gpu,
    xn: u64,
    weights: u64,
    hidden: usize,
    k: usize,
    tokens: usize,
    xs: u64,
) -> Result<(), CudaError> {
    gpu.launch(
        "scale_slots",
        (k as u32, tokens as u32, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(xn),
            Arg::Ptr(weights),
            Arg::I32(i32_of(hidden, "hidden")?),
            Arg::I32(k as i32),
            Arg::Ptr(xs),
        ],
    )
}

/// What a layer's attention masks beyond causality (kernels/attention.cu): gpt-oss's sinks
/// (`[Hq]`, 0: none), a sliding window and a chunk (0: none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct AttnMask {
    pub(crate) sinks: u64,
    pub(crate) window: usize,
    pub(crate) chunk: usize,
}

impl AttnMask {
    fn args(&self) -> Result<[Arg; 3], CudaError> {
        Ok([
            Arg::Ptr(self.sinks),
            Arg::I32(i32_of(self.window, "sliding window")?),
            Arg::I32(i32_of(self.chunk, "attention chunk")?),
        ])
    }

    /// Score slots per (token, head) for `positions` keys: one more for the sink.
    pub(crate) fn stride(&self, positions: usize) -> usize {
        positions + usize::from(self.sinks != 0)
    }
}

/// `out[t][r] = (out[t][r] +) dot(W[r], x[t]) (+ bias[r])` for `tokens` activations.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matvec(
    gpu: &Gpu,
    w: &DevMat,
    x: u64,
    x_stride: usize,
    bias: u64,
    out: u64,
    out_stride: usize,
    tokens: usize,
    residual: bool,
) -> Result<(), CudaError> {
    let name = match w.dtype {
        DType::Bf16 => "matvec_bf16",
        DType::F32 => "matvec_f32",
    };
    gpu.launch(
        name,
        (blocks(w.rows, 8), tokens as u32, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(w.ptr()),
            Arg::I32(i32_of(w.rows, "rows")?),
            Arg::I32(i32_of(w.cols, "cols")?),
            Arg::Ptr(x),
            Arg::I64(x_stride as i64),
            Arg::Ptr(bias),
            Arg::Ptr(out),
            Arg::I64(out_stride as i64),
            Arg::I32(i32::from(residual)),
        ],
    )
}

/// Tokens per block and rows per warp of kernels/tile.cu (its `TILE_TOKENS`, `TILE_ROWS`,
/// `GU_ROWS`).
pub(crate) const TILE_TOKENS: usize = 4;
const TILE_ROWS: usize = 4;
const GU_ROWS: usize = 2;
/// Down rows per warp of tile.cu's `down_few` (its `FEW_DOWN_ROWS`).
const FEW_DOWN_ROWS: usize = 4;
/// The most tokens tile.cu's `mm_few_bf16` takes (its widest column set, T = 8).
const MM_FEW_TOKENS: usize = 8;

/// kernels/prefill.cu's lane-sequential tiles: rows and tokens (pairs, query rows) per block,
/// threads per block, and the dynamic shared memory of its products (`LS_SMEM_BYTES`).
const LS_BR: usize = 32;
pub(crate) const LS_BT: usize = 16;
const LS_THREADS: u32 = 512;
const LS_SMEM: u32 = 2 * (8 * 16 * 32 + 8 * 16 * 20) * 4;
/// Query rows per tile of the prefill attention (`AT_ROWS`), and its scores kernel's dynamic
/// shared memory for head width `d`: Q transposed `[d][72]` and two stages of keys `[d][20]`.
pub(crate) const AT_ROWS: usize = 64;
fn at_scores_smem(d: usize) -> u32 {
    (d * (72 + 2 * 20) * 4) as u32
}
/// The head widths the prefill attention takes (its `attn_scores_dX`).
const AT_WIDTHS: [(usize, &str); 5] = [
    (8, "attn_scores_d8"),
    (16, "attn_scores_d16"),
    (32, "attn_scores_d32"),
    (64, "attn_scores_d64"),
    (128, "attn_scores_d128"),
];

/// Kernels whose dynamic shared memory can pass 48 KiB, with their largest (`Gpu::open` allows
/// it once per kernel).
pub(crate) fn big_shared_kernels() -> Vec<(&'static str, u32)> {
    let mut v: Vec<(&'static str, u32)> = [
        "ls_mm_bf16",
        "ls_mm_f32",
        "ls_gate_up_bf16",
        "ls_gate_up_f32",
        "ls_down_bf16",
        "attn_pv",
    ]
    .into_iter()
    .map(|n| (n, LS_SMEM))
    .collect();
    v.extend(AT_WIDTHS.iter().map(|&(d, n)| (n, at_scores_smem(d))));
    v
}

/// With [`crate::ManyKernels::Auto`], the lane-sequential products run from this many tokens
/// (a dense matrix's), or this many routed pairs per expert on average (the experts'): below,
/// a 16-token tile would be mostly the repeated last token, and the token-tiled kernels of
/// tile.cu read the weights as often for less work (PHASE_LOG B5). 16 pairs, not 8: at 8 (128
/// tokens of Qwen3-30B-A3B or Qwen3-235B-A22B) the lanes measured 0.92x-0.97x the tiles on the
/// H200, at 16 (256 tokens) 1.21x (PHASE_LOG B8).
pub(crate) const LS_AUTO_TOKENS: usize = 64;
pub(crate) const LS_AUTO_PAIRS_PER_EXPERT: usize = 16;

/// Whether a product of many tokens takes the lane-sequential kernels: `enough` is Auto's
/// verdict on the shape.
pub(crate) fn lanes(gpu: &Gpu, enough: bool) -> bool {
    match gpu.many() {
        crate::ManyKernels::Tiled => false,
        crate::ManyKernels::Lanes => true,
        crate::ManyKernels::Auto | crate::ManyKernels::Few => enough,
    }
}

/// Whether the tiled kernels can read a matrix of `cols` columns and activations `x_stride`
/// floats apart: whole 8-element groups, every row and vector 16-byte aligned.
fn tileable(cols: usize, x_stride: usize, ptrs: &[u64]) -> bool {
    cols.is_multiple_of(8)
        && x_stride.is_multiple_of(4)
        && ptrs.iter().all(|p| p.is_multiple_of(16))
}

/// [`matvec`]'s function for many tokens: the token-tiled kernel (kernels/tile.cu `mm_tile`),
/// each weight row loaded once per 4 tokens; the same bits (every output one canonical
/// reduction). One token, or shapes the tiled kernel cannot read, take `matvec`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    gpu: &Gpu,
    w: &DevMat,
    x: u64,
    x_stride: usize,
    bias: u64,
    out: u64,
    out_stride: usize,
    tokens: usize,
    residual: bool,
) -> Result<(), CudaError> {
    if tokens < 2 || !tileable(w.cols, x_stride, &[w.ptr(), x]) {
        return matvec(gpu, w, x, x_stride, bias, out, out_stride, tokens, residual);
    }
    let ls = lanes(gpu, tokens >= LS_AUTO_TOKENS);
    // --cuda-many few: a step of 2 to 8 tokens on a BF16 matrix takes tile.cu's mm_few_bf16
    let few =
        w.dtype == DType::Bf16 && tokens <= MM_FEW_TOKENS && gpu.many() == crate::ManyKernels::Few;
    let name = match (w.dtype, ls) {
        _ if few => "mm_few_bf16",
        (DType::Bf16, false) => "mm_tile_bf16",
        (DType::F32, false) => "mm_tile_f32",
        (DType::Bf16, true) => "ls_mm_bf16",
        (DType::F32, true) => "ls_mm_f32",
    };
    let (grid, block, smem) = if few {
        ((1, blocks(w.rows, 8), 1), (256, 1, 1), 0)
    } else if ls {
        (
            (blocks(tokens, LS_BT), blocks(w.rows, LS_BR), 1),
            (LS_THREADS, 1, 1),
            LS_SMEM,
        )
    } else {
        (
            (
                blocks(tokens, TILE_TOKENS),
                blocks(w.rows, 8 * TILE_ROWS),
                1,
            ),
            (256, 1, 1),
            0,
        )
    };
    gpu.launch(
        name,
        grid,
        block,
        smem,
        &[
            Arg::Ptr(w.ptr()),
            Arg::I32(i32_of(w.rows, "rows")?),
            Arg::I32(i32_of(w.cols, "cols")?),
            Arg::Ptr(x),
            Arg::I64(x_stride as i64),
            Arg::I32(i32_of(tokens, "tokens")?),
            Arg::Ptr(bias),
            Arg::Ptr(out),
            Arg::I64(out_stride as i64),
            Arg::I32(i32::from(residual)),
        ],
    )
}

/// Where [`moe_group`] writes a layer's pairs grouped by expert: `order` (`pairs` u32), `tiles`
/// (3 u32 per tile, room for [`max_tiles`]) and the tile count (1 u32).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Groups {
    pub(crate) order: u64,
    pub(crate) tiles: u64,
    pub(crate) n_tiles: u64,
}

/// The most tiles [`moe_group`] makes of `pairs` routed pairs over `experts` experts, in tiles
/// of `tile` pairs.
pub(crate) fn max_tiles(pairs: usize, experts: usize, tile: usize) -> usize {
    pairs.div_ceil(tile) + experts.min(pairs)
}

/// Which kernels compute a layer's grouped experts (a step of several tokens).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ExpertKernels {
    /// kernels/tile.cu `gate_up_few_bf16`/`down_few`: moe_group's tiles of [`TILE_TOKENS`],
    /// each block computing only its tile's own pairs, loads of several chunks in flight.
    Few,
    /// kernels/tile.cu `gate_up_tile_*`/`down_tile`: tiles of [`TILE_TOKENS`] (PHASE_LOG B3).
    Tiled,
    /// kernels/prefill.cu `ls_gate_up_*`/`ls_down_bf16`: tiles of [`LS_BT`].
    Lanes,
}

/// Auto (and Few) run a layer's experts on [`ExpertKernels::Few`] below this many routed pairs
/// per expert on average (then most tiles hold one or two pairs: batched decode, a draft's
/// verification; PHASE_LOG B11, B12), on the token-tiled kernels from there to
/// [`LS_AUTO_PAIRS_PER_EXPERT`], and on the lane-sequential ones above.
pub(crate) const FEW_PAIRS_PER_EXPERT: usize = 4;

/// The kernels of a layer's grouped experts: [`crate::ManyKernels::Tiled`] and `Lanes` force
/// theirs; Auto and Few choose by the routed pairs per expert (Few differs from Auto only in
/// its dense products).
pub(crate) fn experts_kernels(gpu: &Gpu, pairs: usize, experts: usize) -> ExpertKernels {
    use crate::ManyKernels as M;
    match gpu.many() {
        M::Tiled => ExpertKernels::Tiled,
        M::Lanes => ExpertKernels::Lanes,
        M::Auto | M::Few if pairs >= LS_AUTO_PAIRS_PER_EXPERT * experts => ExpertKernels::Lanes,
        M::Auto | M::Few if pairs < FEW_PAIRS_PER_EXPERT * experts => ExpertKernels::Few,
        M::Auto | M::Few => ExpertKernels::Tiled,
    }
}

/// The pairs per tile of the experts' kernels: LS_BT for the lane-sequential, TILE_TOKENS for
/// the others.
pub(crate) fn experts_tile(kind: ExpertKernels) -> usize {
    match kind {
        ExpertKernels::Lanes => LS_BT,
        ExpertKernels::Few | ExpertKernels::Tiled => TILE_TOKENS,
    }
}

/// The dense products' kernels for [`gate_up_tile`] (no `Few` form without groups).
pub(crate) fn dense_kernels(lanes: bool) -> ExpertKernels {
    if lanes {
        ExpertKernels::Lanes
    } else {
        ExpertKernels::Tiled
    }
}

/// The routed pairs `ids[0..pairs)` grouped by expert into tiles of `tile` pairs
/// (kernels/tile.cu `moe_group`).
pub(crate) fn moe_group(
    gpu: &Gpu,
    ids: u64,
    pairs: usize,
    experts: usize,
    tile: usize,
    g: Groups,
) -> Result<(), CudaError> {
    gpu.launch(
        "moe_group",
        (1, 1, 1),
        (256, 1, 1),
        (3 * experts * 4) as u32,
        &[
            Arg::Ptr(ids),
            Arg::I32(i32_of(pairs, "routed pairs")?),
            Arg::I32(i32_of(experts, "experts")?),
            Arg::I32(tile as i32),
            Arg::Ptr(g.order),
            Arg::Ptr(g.tiles),
            Arg::Ptr(g.n_tiles),
        ],
    )
}

/// [`gate_up`]'s function, token-tiled (kernels/tile.cu `gate_up_tile`, or prefill.cu's
/// `ls_gate_up` when `lanes`): grouped by expert (`groups`, the pairs of `pairs` = tokens * k,
/// grouped in tiles of [`experts_tile`]`(lanes)`), or a dense MLP over `pairs` tokens (`None`).
/// `false` when the shapes are not tileable (the caller then takes `gate_up`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gate_up_tile(
    gpu: &Gpu,
    dtype: DType,
    gate: u64,
    up: u64,
    rows: usize,
    cols: usize,
    groups: Option<(Groups, usize)>,
    pairs: usize,
    k: usize,
    xn: u64,
    act: u64,
    kind: ExpertKernels,
) -> Result<bool, CudaError> {
    if !tileable(cols, cols, &[gate, up, xn]) {
        return Ok(false);
    }
    // Few takes grouped BF16 experts only; anything else takes the token tiles
    let kind = match (kind, dtype, groups.is_some()) {
        (ExpertKernels::Few, DType::Bf16, true) => ExpertKernels::Few,
        (ExpertKernels::Few, _, _) => ExpertKernels::Tiled,
        (k, _, _) => k,
    };
    let name = match (dtype, kind) {
        (DType::Bf16, ExpertKernels::Few) => "gate_up_few_bf16",
        (DType::Bf16, ExpertKernels::Tiled) => "gate_up_tile_bf16",
        (DType::F32, ExpertKernels::Tiled | ExpertKernels::Few) => "gate_up_tile_f32",
        (DType::Bf16, ExpertKernels::Lanes) => "ls_gate_up_bf16",
        (DType::F32, ExpertKernels::Lanes) => "ls_gate_up_f32",
    };
    let tile = experts_tile(kind);
    let (g, tiles) = match groups {
        Some((g, experts)) => (g, max_tiles(pairs, experts, tile)),
        None => (
            Groups {
                order: 0,
                tiles: 0,
                n_tiles: 0,
            },
            pairs.div_ceil(tile),
        ),
    };
    let (grid_y, block, smem) = match kind {
        ExpertKernels::Lanes => (blocks(rows, LS_BR / 2), LS_THREADS, LS_SMEM),
        ExpertKernels::Tiled => (blocks(rows, 8 * GU_ROWS), 256, 0),
        ExpertKernels::Few => (blocks(rows, 8), 256, 0),
    };
    gpu.launch(
        name,
        (tiles as u32, grid_y, 1),
        (block, 1, 1),
        smem,
        &[
            Arg::Ptr(gate),
            Arg::Ptr(up),
            Arg::I32(i32_of(rows, "rows")?),
            Arg::I32(i32_of(cols, "cols")?),
            Arg::Ptr(g.order),
            Arg::Ptr(g.tiles),
            Arg::Ptr(g.n_tiles),
            Arg::I32(i32_of(pairs, "pairs")?),
            Arg::I32(k as i32),
            Arg::Ptr(xn),
            Arg::Ptr(act),
        ],
    )?;
    Ok(true)
}

/// The experts' down products `y[pair]` of a layer's grouped pairs, unmixed (kernels/tile.cu
/// `down_tile`, or prefill.cu's `ls_down_bf16` when `lanes`: the pairs grouped in tiles of
/// [`experts_tile`]`(lanes)`); [`moe_mix`] mixes them. `false` when the shapes are not tileable.
#[allow(clippy::too_many_arguments)]
pub(crate) fn down_tile(
    gpu: &Gpu,
    down: u64,
    hidden: usize,
    width: usize,
    g: Groups,
    pairs: usize,
    experts: usize,
    act: u64,
    y: u64,
    kind: ExpertKernels,
) -> Result<bool, CudaError> {
    if !tileable(width, width, &[down, act]) {
        return Ok(false);
    }
    let tiles = max_tiles(pairs, experts, experts_tile(kind)) as u32;
    let (name, grid_y, block, smem) = match kind {
        ExpertKernels::Lanes => ("ls_down_bf16", blocks(hidden, LS_BR), LS_THREADS, LS_SMEM),
        ExpertKernels::Tiled => ("down_tile", blocks(hidden, 8 * TILE_ROWS), 256, 0),
        ExpertKernels::Few => ("down_few", blocks(hidden, 8 * FEW_DOWN_ROWS), 256, 0),
    };
    gpu.launch(
        name,
        (tiles, grid_y, 1),
        (block, 1, 1),
        smem,
        &[
            Arg::Ptr(down),
            Arg::I32(i32_of(hidden, "hidden")?),
            Arg::I32(i32_of(width, "expert width")?),
            Arg::Ptr(g.order),
            Arg::Ptr(g.tiles),
            Arg::Ptr(g.n_tiles),
            Arg::Ptr(act),
            Arg::Ptr(y),
        ],
    )?;
    Ok(true)
}

/// RMSNorm of `count` segments of `n` values (see kernels/norm_rope.cu).
#[allow(clippy::too_many_arguments)]
pub(crate) fn rmsnorm(
    gpu: &Gpu,
    x: u64,
    x_stride: usize,
    y: u64,
    y_stride: usize,
    w: u64,
    n: usize,
    count: usize,
    eps: f32,
) -> Result<(), CudaError> {
    gpu.launch(
        "rmsnorm",
        (blocks(count, 8), 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(x),
            Arg::I64(x_stride as i64),
            Arg::Ptr(y),
            Arg::I64(y_stride as i64),
            Arg::Ptr(w),
            Arg::I32(i32_of(n, "norm width")?),
            Arg::I32(i32_of(count, "norm count")?),
            Arg::F32(eps),
        ],
    )
}

/// `h[t] = widen(embed[tokens[t]])`.
pub(crate) fn embed(
    gpu: &Gpu,
    table: &DevMat,
    tokens: u64,
    count: usize,
    h: u64,
) -> Result<(), CudaError> {
    let name = match table.dtype {
        DType::Bf16 => "embed_bf16",
        DType::F32 => "embed_f32",
    };
    gpu.launch(
        name,
        (count as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(table.ptr()),
            Arg::Ptr(tokens),
            Arg::I32(i32_of(table.cols, "hidden")?),
            Arg::Ptr(h),
        ],
    )
}

/// Shapes of one attention call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttnShape {
    pub(crate) hq: usize,
    pub(crate) hkv: usize,
    pub(crate) d: usize,
    /// The rotated part of each head (`rotary_dim`: `d` unless partial_rotary_factor); the RoPE
    /// table rows hold `rd / 2` values.
    pub(crate) rd: usize,
    /// Positions allocated per (layer, KV head) in the cache.
    pub(crate) cap: usize,
    /// Position of the step's first token.
    pub(crate) pos0: usize,
    /// Tokens in the step.
    pub(crate) tokens: usize,
}

/// RoPE on q (in place) and k, then k and v appended to the layer's cache.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_append_kv(
    gpu: &Gpu,
    s: AttnShape,
    q: u64,
    k: u64,
    v: u64,
    cos: u64,
    sin: u64,
    k_cache: u64,
    v_cache: u64,
    form: RopeForm,
) -> Result<(), CudaError> {
    let [f0, f1, f2, f3] = form.args();
    gpu.launch(
        "rope_append_kv",
        ((s.hq + s.hkv) as u32, s.tokens as u32, 1),
        (64, 1, 1),
        0,
        &[
            Arg::Ptr(q),
            Arg::Ptr(k),
            Arg::Ptr(v),
            Arg::I32(s.hq as i32),
            Arg::I32(s.hkv as i32),
            Arg::I32(s.d as i32),
            Arg::I32(s.rd as i32),
            Arg::Ptr(cos),
            Arg::Ptr(sin),
            Arg::I32(i32_of(s.pos0, "position")?),
            Arg::Ptr(k_cache),
            Arg::Ptr(v_cache),
            Arg::I32(i32_of(s.cap, "cache capacity")?),
            f0,
            f1,
            f2,
            f3,
        ],
    )
}

/// Causal attention; `scratch` holds `tokens * hq * n_stride` floats.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    gpu: &Gpu,
    s: AttnShape,
    q: u64,
    k_cache: u64,
    v_cache: u64,
    scale: f32,
    scratch: u64,
    n_stride: usize,
    o: u64,
    mask: AttnMask,
) -> Result<(), CudaError> {
    let [m0, m1, m2] = mask.args()?;
    gpu.launch(
        "attention",
        (s.hq as u32, s.tokens as u32, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(q),
            Arg::I32(s.hq as i32),
            Arg::I32(s.hkv as i32),
            Arg::I32(s.d as i32),
            Arg::Ptr(k_cache),
            Arg::Ptr(v_cache),
            Arg::I32(i32_of(s.cap, "cache capacity")?),
            Arg::I32(i32_of(s.pos0, "position")?),
            Arg::F32(scale),
            Arg::Ptr(scratch),
            Arg::I32(i32_of(n_stride, "positions")?),
            Arg::Ptr(o),
            m0,
            m1,
            m2,
        ],
    )
}

/// A step over several sequences' tables on the device (model.rs `SeqTables`): per token
/// (RoPE cos row, sin row, position, capacity), and this layer's per-token (keys, values).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SeqKv {
    pub(crate) tok: u64,
    pub(crate) kv: u64,
}

/// [`rope_append_kv`] for a step over several sequences, each token into its own cache.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope_append_kv_seqs(
    gpu: &Gpu,
    s: AttnShape,
    q: u64,
    k: u64,
    v: u64,
    t: SeqKv,
    form: RopeForm,
) -> Result<(), CudaError> {
    let [f0, f1, f2, f3] = form.args();
    gpu.launch(
        "rope_append_kv_seqs",
        ((s.hq + s.hkv) as u32, s.tokens as u32, 1),
        (64, 1, 1),
        0,
        &[
            Arg::Ptr(q),
            Arg::Ptr(k),
            Arg::Ptr(v),
            Arg::I32(s.hq as i32),
            Arg::I32(s.hkv as i32),
            Arg::I32(s.d as i32),
            Arg::I32(s.rd as i32),
            Arg::Ptr(t.tok),
            Arg::Ptr(t.kv),
            f0,
            f1,
            f2,
            f3,
        ],
    )
}

/// [`attention`] for a step over several sequences, each token over its own cache.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_seqs(
    gpu: &Gpu,
    s: AttnShape,
    q: u64,
    t: SeqKv,
    scale: f32,
    scratch: u64,
    n_stride: usize,
    o: u64,
    mask: AttnMask,
) -> Result<(), CudaError> {
    let [m0, m1, m2] = mask.args()?;
    gpu.launch(
        "attention_seqs",
        (s.hq as u32, s.tokens as u32, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(q),
            Arg::I32(s.hq as i32),
            Arg::I32(s.hkv as i32),
            Arg::I32(s.d as i32),
            Arg::Ptr(t.tok),
            Arg::Ptr(t.kv),
            Arg::F32(scale),
            Arg::Ptr(scratch),
            Arg::I32(i32_of(n_stride, "positions")?),
            Arg::Ptr(o),
            m0,
            m1,
            m2,
        ],
    )
}

/// A step's query tiles for the prefill attention (kernels/prefill.cu): the tile list on the
/// device (`(first token, tokens)` u32 pairs), their number, each tile row's maximum score
/// (`n_tiles * Hkv * AT_ROWS` floats) and the scores' row stride (positions).
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttnTiles {
    pub(crate) qtiles: u64,
    pub(crate) n_tiles: usize,
    pub(crate) mbuf: u64,
    pub(crate) n_stride: usize,
}

/// The query tiles of a step whose sequences bring `seq_tokens` tokens each (in the step's
/// order), `qt` tokens per tile: runs of at most `qt` consecutive tokens of one sequence.
pub(crate) fn query_tiles(seq_tokens: &[usize], qt: usize) -> Vec<u32> {
    let mut v = Vec::new();
    let mut first = 0usize;
    for &n in seq_tokens {
        let mut at = 0;
        while at < n {
            let c = qt.min(n - at);
            v.extend([(first + at) as u32, c as u32]);
            at += c;
        }
        first += n;
    }
    v
}

/// Tokens per query tile for `hq` query heads over `hkv` KV heads (AT_ROWS rows: the group's
/// heads times the tokens), or `None` when the prefill attention cannot take the shape: a head
/// width without its `attn_scores_dX`, a group that does not divide AT_ROWS, a window or chunk.
pub(crate) fn query_tile_tokens(s: &AttnShape, mask: &AttnMask) -> Option<usize> {
    let g = s.hq.checked_div(s.hkv)?;
    let fits = s.hkv * g == s.hq
        && g > 0
        && AT_ROWS.is_multiple_of(g)
        && AT_WIDTHS.iter().any(|&(d, _)| d == s.d)
        && mask.window == 0
        && mask.chunk == 0;
    fits.then(|| AT_ROWS / g)
}

/// Where the step's keys and values are: one sequence's layer cache (`pos0` its first token's
/// position), or the per-token tables of a step over several sequences.
#[derive(Clone, Copy, Debug)]
pub(crate) enum KvSrc {
    One { kc: u64, vc: u64 },
    Seqs(SeqKv),
}

/// [`attention`]'s function over query tiles (kernels/prefill.cu `attn_scores_dX`,
/// `attn_softmax`, `attn_pv`): `scratch` holds `n_tiles * Hkv * AT_ROWS * n_stride` floats.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_tiles(
    gpu: &Gpu,
    s: AttnShape,
    q: u64,
    src: KvSrc,
    t: AttnTiles,
    scale: f32,
    scratch: u64,
    o: u64,
    sinks: u64,
) -> Result<(), CudaError> {
    let Some(&(_, scores)) = AT_WIDTHS.iter().find(|&&(d, _)| d == s.d) else {
        return Err(CudaError::Internal(format!(
            "the prefill attention has no kernel for head width {}",
            s.d
        )));
    };
    let (tok, kv, kc, vc) = match src {
        KvSrc::One { kc, vc } => (0, 0, kc, vc),
        KvSrc::Seqs(sk) => (sk.tok, sk.kv, 0, 0),
    };
    let src_args = [
        Arg::Ptr(t.qtiles),
        Arg::Ptr(tok),
        Arg::Ptr(kv),
        Arg::Ptr(kc),
        Arg::Ptr(vc),
        Arg::I32(i32_of(s.cap, "cache capacity")?),
        Arg::I32(i32_of(s.pos0, "position")?),
    ];
    let (hq, hkv) = (Arg::I32(s.hq as i32), Arg::I32(s.hkv as i32));
    let stride = Arg::I32(i32_of(t.n_stride, "positions")?);
    let n_tiles = i32_of(t.n_tiles, "query tiles")? as u32;
    let mut a = vec![Arg::Ptr(q), hq, hkv];
    a.extend(src_args);
    a.extend([Arg::F32(scale), Arg::Ptr(scratch), stride, Arg::Ptr(t.mbuf)]);
    gpu.launch(
        scores,
        (n_tiles, s.hkv as u32, 1),
        (256, 1, 1),
        at_scores_smem(s.d),
        &a,
    )?;
    let mut a = vec![hq, hkv];
    a.extend(src_args);
    a.extend([Arg::Ptr(scratch), stride, Arg::Ptr(t.mbuf), Arg::Ptr(sinks)]);
    gpu.launch(
        "attn_softmax",
        (n_tiles, s.hkv as u32, 1),
        (AT_ROWS as u32, 1, 1),
        0,
        &a,
    )?;
    let mut a = vec![hq, hkv, Arg::I32(s.d as i32)];
    a.extend(src_args);
    a.extend([Arg::Ptr(scratch), stride, Arg::Ptr(o)]);
    gpu.launch(
        "attn_pv",
        (
            n_tiles * s.hkv as u32,
            blocks(s.d, LS_BR),
            (AT_ROWS / LS_BT) as u32,
        ),
        (LS_THREADS, 1, 1),
        LS_SMEM,
        &a,
    )
}

/// Multi-head latent attention's widths (kernels/mla.cu): `r` the latent, `dn`/`dr`/`dv` the
/// nope, rope and value head widths; `interleave`: the rope part read as pairs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MlaShape {
    pub(crate) hq: usize,
    pub(crate) dn: usize,
    pub(crate) dr: usize,
    pub(crate) dv: usize,
    pub(crate) r: usize,
    pub(crate) interleave: bool,
    /// Position of the step's first token (one cache).
    pub(crate) pos0: usize,
    pub(crate) tokens: usize,
}

/// The largest latent row (r + dr) and rope part the MLA kernels hold in shared memory.
pub(crate) const MLA_MAX_W: usize = 1024;
pub(crate) const MLA_MAX_DR: usize = 512;

impl MlaShape {
    /// Why the MLA kernels cannot take these widths, if they cannot.
    pub(crate) fn unsupported(&self) -> Option<String> {
        let w = self.r + self.dr;
        (w > MLA_MAX_W || self.dr > MLA_MAX_DR || self.dn > 256 || !self.dr.is_multiple_of(2)).then(
            || {
                format!(
                    "latent width {} + rope {} and nope width {} (the MLA kernels take r + dr <= \
                     {MLA_MAX_W}, even dr <= {MLA_MAX_DR}, dn <= 256)",
                    self.r, self.dr, self.dn
                )
            },
        )
    }
}

/// Where a step's latent rows go: one cache (`cache`, positions `pos0..`), or each token's own
/// from the step's tables.
#[derive(Clone, Copy, Debug)]
pub(crate) enum MlaKv {
    One { cache: u64, cos: u64, sin: u64 },
    Seqs(SeqKv),
}

/// RoPE on the queries' rope parts (in place) and each token's latent row `[kva[..r] |
/// rope(kva[r..])]` written into its cache.
pub(crate) fn mla_rope_append(
    gpu: &Gpu,
    s: &MlaShape,
    q: u64,
    kva: u64,
    kv: MlaKv,
) -> Result<(), CudaError> {
    let mut args = vec![
        Arg::Ptr(q),
        Arg::Ptr(kva),
        Arg::I32(s.hq as i32),
        Arg::I32(s.dn as i32),
        Arg::I32(s.dr as i32),
        Arg::I32(s.r as i32),
        Arg::I32(i32::from(s.interleave)),
    ];
    let name = match kv {
        MlaKv::One { cache, cos, sin } => {
            args.extend([
                Arg::Ptr(cos),
                Arg::Ptr(sin),
                Arg::I32(i32_of(s.pos0, "position")?),
                Arg::Ptr(cache),
            ]);
            "mla_rope_append"
        }
        MlaKv::Seqs(t) => {
            args.extend([Arg::Ptr(t.tok), Arg::Ptr(t.kv)]);
            "mla_rope_append_seqs"
        }
    };
    gpu.launch(
        name,
        ((s.hq + 1) as u32, s.tokens as u32, 1),
        (64, 1, 1),
        0,
        &args,
    )
}

/// MLA attention of every (token, head) against its cache's latent rows, the output
/// `[T][Hq][dv]`; `scratch` holds `tokens * hq * n_stride` floats.
#[allow(clippy::too_many_arguments)]
pub(crate) fn mla_attention(
    gpu: &Gpu,
    s: &MlaShape,
    q: u64,
    kv_b: &DevMat,
    kv: MlaKv,
    scale: f32,
    scratch: u64,
    n_stride: usize,
    o: u64,
) -> Result<(), CudaError> {
    let mut args = vec![
        Arg::Ptr(q),
        Arg::Ptr(kv_b.ptr()),
        Arg::I32(s.hq as i32),
        Arg::I32(s.dn as i32),
        Arg::I32(s.dr as i32),
        Arg::I32(s.dv as i32),
        Arg::I32(s.r as i32),
    ];
    let seqs = matches!(kv, MlaKv::Seqs(_));
    match kv {
        MlaKv::One { cache, .. } => {
            args.extend([Arg::Ptr(cache), Arg::I32(i32_of(s.pos0, "position")?)])
        }
        MlaKv::Seqs(t) => args.extend([Arg::Ptr(t.tok), Arg::Ptr(t.kv)]),
    }
    args.extend([
        Arg::F32(scale),
        Arg::Ptr(scratch),
        Arg::I32(i32_of(n_stride, "positions")?),
        Arg::Ptr(o),
    ]);
    let name = match (kv_b.dtype, seqs) {
        (DType::Bf16, false) => "mla_attention_bf16",
        (DType::F32, false) => "mla_attention_f32",
        (DType::Bf16, true) => "mla_attention_seqs_bf16",
        (DType::F32, true) => "mla_attention_seqs_f32",
    };
    gpu.launch(
        name,
        (s.hq as u32, s.tokens as u32, 1),
        (256, 1, 1),
        0,
        &args,
    )
}

/// Where one MoE layer's router writes its choices ([tokens][k], and [tokens]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RouteOut {
    pub(crate) ids: u64,
    pub(crate) probs: u64,
    pub(crate) weights: u64,
    pub(crate) by_id: u64,
    pub(crate) kth: u64,
    pub(crate) next: u64,
}

/// Largest top-k the router kernel holds (its `sel` array).
pub(crate) const MAX_TOP_K: usize = 1024;

/// Softmax over `experts` logits per token, top-k, optional renormalisation.
pub(crate) fn route_topk(
    gpu: &Gpu,
    logits: u64,
    experts: usize,
    k: usize,
    renorm: bool,
    tokens: usize,
    out: RouteOut,
) -> Result<(), CudaError> {
    if k == 0 || k > experts || k > MAX_TOP_K {
        return Err(CudaError::UnsupportedModel(format!(
            "top-{k} of {experts} experts (the router kernel takes 1 <= k <= min(E, {MAX_TOP_K}))"
        )));
    }
    let shared = (experts + k) * 4;
    if shared > 40 * 1024 {
        return Err(CudaError::UnsupportedModel(format!(
            "{experts} experts (the router kernel holds at most about 10,000)"
        )));
    }
    gpu.launch(
        "route_topk",
        (tokens as u32, 1, 1),
        (256, 1, 1),
        shared as u32,
        &[
            Arg::Ptr(logits),
            Arg::I32(experts as i32),
            Arg::I32(k as i32),
            Arg::I32(i32::from(renorm)),
            Arg::Ptr(out.ids),
            Arg::Ptr(out.probs),
            Arg::Ptr(out.weights),
            Arg::Ptr(out.by_id),
            Arg::Ptr(out.kth),
            Arg::Ptr(out.next),
        ],
    )
}

/// The group-limited routers (moe.cu `route_grouped`): DeepSeek-V3's and GLM-4.5's sigmoid
/// scores with the correction bias `bias` (`Some`), or DeepSeek-V2's softmax (`None`).
pub(crate) struct GroupedRoute {
    pub(crate) bias: Option<u64>,
    pub(crate) n_group: usize,
    pub(crate) topk_group: usize,
    pub(crate) renorm: bool,
    /// `f32(routed_scaling_factor)`
    pub(crate) scale: f32,
}

/// The routers that choose by logit (kernels/moe.cu `route_topk_first`): gpt-oss's softmax over
/// the k chosen logits (`sigmoid` false), Llama 4's sigmoid of each chosen logit (`sigmoid`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn route_topk_first(
    gpu: &Gpu,
    logits: u64,
    experts: usize,
    k: usize,
    sigmoid: bool,
    tokens: usize,
    out: RouteOut,
) -> Result<(), CudaError> {
    if k == 0 || k > experts || k > MAX_TOP_K {
        return Err(CudaError::UnsupportedModel(format!(
            "top-{k} of {experts} experts (the router kernel takes 1 <= k <= min(E, {MAX_TOP_K}))"
        )));
    }
    let shared = (experts + 2 * k) * 4;
    if shared > 40 * 1024 {
        return Err(CudaError::UnsupportedModel(format!(
            "{experts} experts (the router kernel holds at most about 10,000)"
        )));
    }
    gpu.launch(
        "route_topk_first",
        (tokens as u32, 1, 1),
        (256, 1, 1),
        shared as u32,
        &[
            Arg::Ptr(logits),
            Arg::I32(experts as i32),
            Arg::I32(k as i32),
            Arg::I32(i32::from(sigmoid)),
            Arg::Ptr(out.ids),
            Arg::Ptr(out.probs),
            Arg::Ptr(out.weights),
            Arg::Ptr(out.by_id),
            Arg::Ptr(out.kth),
            Arg::Ptr(out.next),
        ],
    )
}

/// Group-limited routing over `experts` logits per token (the records as [`route_topk`]'s).
pub(crate) fn route_grouped(
    gpu: &Gpu,
    logits: u64,
    experts: usize,
    k: usize,
    g: &GroupedRoute,
    tokens: usize,
    out: RouteOut,
) -> Result<(), CudaError> {
    let groups_ok = g.n_group >= 1
        && experts.is_multiple_of(g.n_group)
        && (1..=g.n_group).contains(&g.topk_group)
        && (g.bias.is_none() || experts / g.n_group >= 2);
    if k == 0 || k > experts || k > MAX_TOP_K || !groups_ok {
        return Err(CudaError::UnsupportedModel(format!(
            "top-{k} of {experts} experts in {} groups keeping {} (the router kernel takes \
             1 <= k <= min(E, {MAX_TOP_K}) and equal groups, of two or more for sigmoid scores)",
            g.n_group, g.topk_group
        )));
    }
    let shared = (2 * experts + 2 * k + g.n_group) * 4;
    if shared > 40 * 1024 {
        return Err(CudaError::UnsupportedModel(format!(
            "{experts} experts (the grouped router kernel holds at most about 5,000)"
        )));
    }
    gpu.launch(
        "route_grouped",
        (tokens as u32, 1, 1),
        (256, 1, 1),
        shared as u32,
        &[
            Arg::Ptr(logits),
            Arg::Ptr(g.bias.unwrap_or(0)),
            Arg::I32(experts as i32),
            Arg::I32(k as i32),
            Arg::I32(g.n_group as i32),
            Arg::I32(g.topk_group as i32),
            Arg::I32(i32::from(g.bias.is_some())),
            Arg::I32(i32::from(g.renorm)),
            Arg::F32(g.scale),
            Arg::Ptr(out.ids),
            Arg::Ptr(out.probs),
            Arg::Ptr(out.weights),
            Arg::Ptr(out.by_id),
            Arg::Ptr(out.kth),
            Arg::Ptr(out.next),
        ],
    )
}

/// `act[t][j][i] = silu(gate[e] row i . xn[t]) * (up[e] row i . xn[t])` with `e = ids[t][j]`
/// (`ids == 0`: a dense MLP, one matrix, `k = 1`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gate_up(
    gpu: &Gpu,
    dtype: DType,
    gate: u64,
    up: u64,
    rows: usize,
    cols: usize,
    ids: u64,
    k: usize,
    xn: u64,
    act: u64,
    tokens: usize,
    math: ExpertMath,
) -> Result<(), CudaError> {
    let name = match dtype {
        DType::Bf16 => "gate_up_bf16",
        DType::F32 => "gate_up_f32",
    };
    let [a0, a1, a2, a3, a4, a5] = math.act_args();
    gpu.launch(
        name,
        (blocks(rows, 8), k as u32, tokens as u32),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(gate),
            Arg::Ptr(up),
            Arg::I32(i32_of(rows, "rows")?),
            Arg::I32(i32_of(cols, "cols")?),
            Arg::Ptr(ids),
            Arg::I32(k as i32),
            Arg::Ptr(xn),
            Arg::Ptr(act),
            a0,
            a1,
            a2,
            a3,
            a4,
            a5,
        ],
    )
}

/// Down projections of the chosen experts, mixed in ascending expert id (then the shared
/// expert's `sigmoid(s_sh) * y_sh` when `y_sh != 0`), added to `h`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn down_mix(
    gpu: &Gpu,
    down: u64,
    hidden: usize,
    width: usize,
    route: RouteOut,
    k: usize,
    act: u64,
    y_sh: u64,
    s_sh: u64,
    h: u64,
    tokens: usize,
    math: ExpertMath,
) -> Result<(), CudaError> {
    gpu.launch(
        "down_mix",
        (blocks(hidden, 8), tokens as u32, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(down),
            Arg::I32(i32_of(hidden, "hidden")?),
            Arg::I32(i32_of(width, "expert width")?),
            Arg::Ptr(route.ids),
            Arg::Ptr(route.weights),
            Arg::Ptr(route.by_id),
            Arg::I32(k as i32),
            Arg::Ptr(act),
            Arg::Ptr(y_sh),
            Arg::Ptr(s_sh),
            Arg::Ptr(h),
            Arg::Ptr(math.bias_down),
            Arg::I32(i32::from(math.input_scaled)),
        ],
    )
}

/// Where a streamed layer's experts are for one launch: the hot tier's slot pool, the BF16
/// values from one slot to the next, and `slot_of` (`E` i32 on the device: expert -> slot, or
/// -1 when the expert is not in this launch's group). For [`down_slots`] only, `slot_of == 0`
/// means resident experts: `pool` the layer's stacked down matrices, `slot_elems` one expert's
/// ([`SlotTable::stacked_down`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SlotTable {
    pub pool: u64,
    pub slot_elems: usize,
    pub slot_of: u64,
}

impl SlotTable {
    /// A layer's resident down matrices `[E][hidden][width]` at `down`, for [`down_slots`]: every
    /// chosen expert's unmixed output (the captures of a step whose `down_mix` fused them).
    pub(crate) fn stacked_down(down: u64, hidden: usize, width: usize) -> SlotTable {
        SlotTable {
            pool: down,
            slot_elems: hidden * width,
            slot_of: 0,
        }
    }
}

/// Gate and up projections with the SwiGLU of the chosen experts that are in `slots`' group
/// (kernels/moe.cu `gate_up_slots`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gate_up_slots(
    gpu: &Gpu,
    slots: SlotTable,
    rows: usize,
    cols: usize,
    ids: u64,
    k: usize,
    xn: u64,
    act: u64,
    tokens: usize,
    math: ExpertMath,
) -> Result<(), CudaError> {
    let [a0, a1, a2, a3, a4, a5] = math.act_args();
    gpu.launch(
        "gate_up_slots",
        (blocks(rows, 8), k as u32, tokens as u32),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(slots.pool),
            Arg::I64(slots.slot_elems as i64),
            Arg::Ptr(slots.slot_of),
            Arg::I32(i32_of(rows, "rows")?),
            Arg::I32(i32_of(cols, "cols")?),
            Arg::Ptr(ids),
            Arg::I32(k as i32),
            Arg::Ptr(xn),
            Arg::Ptr(act),
            a0,
            a1,
            a2,
            a3,
            a4,
            a5,
        ],
    )
}

/// Down products `y[t][j]` of the chosen experts that are in `slots`' group, unmixed
/// (kernels/moe.cu `down_slots`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn down_slots(
    gpu: &Gpu,
    slots: SlotTable,
    hidden: usize,
    width: usize,
    ids: u64,
    k: usize,
    act: u64,
    y: u64,
    tokens: usize,
    math: ExpertMath,
) -> Result<(), CudaError> {
    gpu.launch(
        "down_slots",
        (blocks(hidden, 8), k as u32, tokens as u32),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(slots.pool),
            Arg::I64(slots.slot_elems as i64),
            Arg::Ptr(slots.slot_of),
            Arg::I32(i32_of(hidden, "hidden")?),
            Arg::I32(i32_of(width, "expert width")?),
            Arg::Ptr(ids),
            Arg::I32(k as i32),
            Arg::Ptr(act),
            Arg::Ptr(y),
            Arg::Ptr(math.bias_down),
        ],
    )
}

/// The mix of the down products `y` in ascending expert id (then the shared expert's), added to
/// `h` (kernels/moe.cu `moe_mix`): down_mix's epilogue.
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe_mix(
    gpu: &Gpu,
    hidden: usize,
    route: RouteOut,
    k: usize,
    y: u64,
    y_sh: u64,
    s_sh: u64,
    h: u64,
    tokens: usize,
    math: ExpertMath,
) -> Result<(), CudaError> {
    gpu.launch(
        "moe_mix",
        (blocks(hidden, 256), tokens as u32, 1),
        (256, 1, 1),
        0,
        &[
            Arg::I32(i32_of(hidden, "hidden")?),
            Arg::Ptr(route.weights),
            Arg::Ptr(route.by_id),
            Arg::I32(k as i32),
            Arg::Ptr(y),
            Arg::Ptr(y_sh),
            Arg::Ptr(s_sh),
            Arg::Ptr(h),
            Arg::I32(i32::from(math.input_scaled)),
        ],
    )
}

/// `x = widen(bf16(x))`: the INVALID validation arm.
pub(crate) fn round_to_bf16(gpu: &Gpu, x: u64, n: usize) -> Result<(), CudaError> {
    gpu.launch(
        "round_to_bf16",
        (blocks(n, 256), 1, 1),
        (256, 1, 1),
        0,
        &[Arg::Ptr(x), Arg::I32(i32_of(n, "length")?)],
    )
}

/// `y[i] = f(x[i])` for one of the probe kernels (probe_exp, probe_silu, ...).
pub(crate) fn probe(
    gpu: &Gpu,
    name: &'static str,
    x: u64,
    y: u64,
    n: usize,
) -> Result<(), CudaError> {
    gpu.launch(
        name,
        (blocks(n, 256), 1, 1),
        (256, 1, 1),
        0,
        &[Arg::Ptr(x), Arg::Ptr(y), Arg::I64(n as i64)],
    )
}

/// A gated DeltaNet layer's shape (config.rs `LinearDims`) for the kernels of
/// kernels/linear_attn.cu.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LinearShape {
    /// Hk, Hv, Dk, Dv.
    pub(crate) hk: usize,
    pub(crate) hv: usize,
    pub(crate) dk: usize,
    pub(crate) dv: usize,
    /// The convolution's taps (K).
    pub(crate) taps: usize,
}

impl LinearShape {
    pub(crate) fn of(d: &tarfa_core::config::LinearDims) -> LinearShape {
        LinearShape {
            hk: d.key_heads,
            hv: d.value_heads,
            dk: d.key_dim,
            dv: d.value_dim,
            taps: d.conv_kernel,
        }
    }

    /// `Hk Dk`: the width of q and of k.
    pub(crate) fn key_width(&self) -> usize {
        self.hk * self.dk
    }

    /// `Hv Dv`: the width of v, z and the output.
    pub(crate) fn value_width(&self) -> usize {
        self.hv * self.dv
    }

    /// The convolution's channels, `q | k | v`.
    pub(crate) fn channels(&self) -> usize {
        2 * self.key_width() + self.value_width()
    }

    /// Floats of the convolution's state, `[K-1][C]`.
    pub(crate) fn conv_len(&self) -> usize {
        (self.taps - 1) * self.channels()
    }

    /// Floats of the recurrent state, `[Hv][Dv][Dk]`.
    pub(crate) fn state_len(&self) -> usize {
        self.hv * self.dv * self.dk
    }
}

/// Qwen3-Next's fused `in_proj_qkvz` `[T][..]` and `in_proj_ba` outputs into head-major
/// `qkv` `[T][C]`, `z` `[T][Hv Dv]`, `b` and `a` `[T][Hv]` (a permutation).
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear_unpack(
    gpu: &Gpu,
    s: LinearShape,
    qkvz: u64,
    ba: u64,
    tokens: usize,
    qkv: u64,
    z: u64,
    b: u64,
    a: u64,
) -> Result<(), CudaError> {
    gpu.launch(
        "linear_unpack",
        (i32_of(tokens, "tokens")? as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(qkvz),
            Arg::Ptr(ba),
            Arg::I32(i32_of(s.hk, "key heads")?),
            Arg::I32(i32_of(s.dk, "key dim")?),
            Arg::I32(i32_of(s.hv / s.hk, "value heads per key head")?),
            Arg::I32(i32_of(s.dv, "value dim")?),
            Arg::Ptr(qkv),
            Arg::Ptr(z),
            Arg::Ptr(b),
            Arg::Ptr(a),
        ],
    )
}

/// One sequence's causal convolution over `tokens` rows of `x` (stride `x_stride`) into `y`
/// (silu applied; may be `x`), from the state `src` (0: zeros) to `dst` (may be `src`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear_conv(
    gpu: &Gpu,
    s: LinearShape,
    x: u64,
    x_stride: usize,
    tokens: usize,
    w: u64,
    src: u64,
    dst: u64,
    y: u64,
    y_stride: usize,
) -> Result<(), CudaError> {
    let c = s.channels();
    gpu.launch(
        "linear_conv",
        (blocks(c, 256), 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(x),
            Arg::I64(x_stride as i64),
            Arg::I32(i32_of(tokens, "tokens")?),
            Arg::I32(i32_of(c, "conv channels")?),
            Arg::I32(i32_of(s.taps, "conv taps")?),
            Arg::Ptr(w),
            Arg::Ptr(src),
            Arg::Ptr(dst),
            Arg::Ptr(y),
            Arg::I64(y_stride as i64),
        ],
    )
}

/// The L2 norm of every q and k head of `tokens` rows of `x` (stride `stride`), in place, the
/// queries then times `scale`.
pub(crate) fn linear_qk_norm(
    gpu: &Gpu,
    s: LinearShape,
    x: u64,
    stride: usize,
    tokens: usize,
    eps: f32,
    scale: f32,
) -> Result<(), CudaError> {
    gpu.launch(
        "linear_qk_norm",
        (blocks(tokens * 2 * s.hk, 8), 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(x),
            Arg::I64(stride as i64),
            Arg::I32(i32_of(tokens, "tokens")?),
            Arg::I32(i32_of(s.hk, "key heads")?),
            Arg::I32(i32_of(s.dk, "key dim")?),
            Arg::F32(eps),
            Arg::F32(scale),
        ],
    )
}

/// Where one sequence's gated delta rule reads and writes (kernels/linear_attn.cu
/// `linear_recur`): the normed `q | k | v` rows, `b` and `a` `[T][Hv]`, the layer's `A_log` and
/// `dt_bias`, the state before (`src`, 0: zeros) and after (`dst`), the output `[T][Hv Dv]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RecurIo {
    pub(crate) qkv: u64,
    pub(crate) stride: usize,
    pub(crate) b: u64,
    pub(crate) a: u64,
    pub(crate) a_log: u64,
    pub(crate) dt_bias: u64,
    pub(crate) src: u64,
    pub(crate) dst: u64,
    pub(crate) o: u64,
}

/// One sequence's gated delta rule over its `tokens`, in position order.
pub(crate) fn linear_recur(
    gpu: &Gpu,
    s: LinearShape,
    io: RecurIo,
    tokens: usize,
) -> Result<(), CudaError> {
    gpu.launch(
        "linear_recur",
        (blocks(s.hv * s.dv, 8), 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(io.qkv),
            Arg::I64(io.stride as i64),
            Arg::Ptr(io.b),
            Arg::Ptr(io.a),
            Arg::Ptr(io.a_log),
            Arg::Ptr(io.dt_bias),
            Arg::I32(i32_of(tokens, "tokens")?),
            Arg::I32(i32_of(s.hk, "key heads")?),
            Arg::I32(i32_of(s.hv, "value heads")?),
            Arg::I32(i32_of(s.dk, "key dim")?),
            Arg::I32(i32_of(s.dv, "value dim")?),
            Arg::Ptr(io.src),
            Arg::Ptr(io.dst),
            Arg::Ptr(io.o),
        ],
    )
}

/// `y[i] = y[i] * silu(z[i])` over `n` values.
pub(crate) fn silu_gate(gpu: &Gpu, y: u64, z: u64, n: usize) -> Result<(), CudaError> {
    gpu.launch(
        "silu_gate",
        (blocks(n, 256), 1, 1),
        (256, 1, 1),
        0,
        &[Arg::Ptr(y), Arg::Ptr(z), Arg::I64(n as i64)],
    )
}

/// Gated attention: the queries of q_proj's `[T][Hq][2D]` output `qg` into `q` `[T][Hq][D]`.
pub(crate) fn split_query_gate(
    gpu: &Gpu,
    qg: u64,
    hq: usize,
    d: usize,
    tokens: usize,
    q: u64,
) -> Result<(), CudaError> {
    gpu.launch(
        "split_query_gate",
        (i32_of(tokens, "tokens")? as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(qg),
            Arg::I32(i32_of(hq, "query heads")?),
            Arg::I32(i32_of(d, "head dim")?),
            Arg::Ptr(q),
        ],
    )
}

/// Gated attention: `o` `[T][Hq][D]` times sigmoid of the gates in `qg`, in place.
pub(crate) fn sigmoid_gate(
    gpu: &Gpu,
    o: u64,
    qg: u64,
    hq: usize,
    d: usize,
    tokens: usize,
) -> Result<(), CudaError> {
    gpu.launch(
        "sigmoid_gate",
        (i32_of(tokens, "tokens")? as u32, 1, 1),
        (256, 1, 1),
        0,
        &[
            Arg::Ptr(o),
            Arg::Ptr(qg),
            Arg::I32(i32_of(hq, "query heads")?),
            Arg::I32(i32_of(d, "head dim")?),
        ],
    )
}
