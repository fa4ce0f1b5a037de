//! The decode step (one token) as a launch list of kernels/decode.cu, captured once into a CUDA
//! graph and replayed for every token (docs/PERFORMANCE.md, "CUDA decode").
//!
//! Per MoE layer (PHASE_LOG P16): `dmv` q|k|v (input RMSNorm fused), `attn_decode4`
//! (q/k norm, RoPE, KV append, attention), `dmv` o_proj (+ residual), `dmv` router logits
//! (post-attention RMSNorm fused), `gate_up_route` (the top-k in every block, then the k
//! experts' gate and up with SwiGLU), `moe_down` (the k experts' down projections, mixed in
//! ascending id, + residual): 6 launches, captured with programmatic dependent launch, each
//! kernel loading its first weights before it waits for the previous one. Then `lmhead` (final
//! RMSNorm fused, greedy token in its last block). The token and the position live in a
//! device-resident state, so the graph serves every position and a greedy loop needs no host
//! round trip between tokens. (Models the kernels cannot take, `decode_unsupported`, keep the
//! legacy per-operation kernels for their decode steps; so does the INVALID bf16 arm.)
//!
//! Nothing here changes an operation or its order relative to the legacy kernels (and so the
//! CPU): the selftest compares every logit and router record of decode steps bit for bit.

use super::steps::LayerSteps;
use super::*;
use crate::device::{Arg, GpuGraph, Launch};
use crate::{DecodeMode, KernelTime};

/// Greedy decode steps queued before the host waits for their tokens ([`CudaModel::run_ahead`]).
/// Waiting after every token leaves the GPU idle while the host reads the token and launches
/// the next step; 8 steps make that once per 8 tokens, and a stop wastes at most 7 steps.
pub const RUN_AHEAD: usize = 8;

/// The decode step's own buffers (one token), sized for `cap` positions.
pub(super) struct DecBufs {
    pub(super) cap: usize,
    /// [token u32, position i32, step i32, pad]
    pub(super) state: DevBuf,
    /// The greedy token of each step since the state's step was reset.
    pub(super) tok_log: DevBuf,
    counters: DevBuf,
    part_v: DevBuf,
    part_i: DevBuf,
    h: DevBuf,
    xn: DevBuf,
    qkv: DevBuf,
    o: DevBuf,
    router_logits: DevBuf,
    act: DevBuf,
    act_sh: DevBuf,
    y_sh: DevBuf,
    s_sh: DevBuf,
    pub(super) ids: DevBuf,
    pub(super) probs: DevBuf,
    pub(super) weights: DevBuf,
    by_id: DevBuf,
    pub(super) kth: DevBuf,
    pub(super) next: DevBuf,
    pub(super) logits: DevBuf,
    scores: DevBuf,
    lm_grid: u32,
}

/// A sequence's decode step: buffers, launch list and (when captured) its graph.
pub(super) struct DecodeCtx {
    pub(super) bufs: DecBufs,
    pub(super) launches: Vec<Launch>,
    pub(super) graph: Option<GpuGraph>,
    /// The mode asked for, and the one that runs (a failed capture falls back).
    pub(super) asked: DecodeMode,
    pub(super) running: DecodeMode,
    pub(super) note: String,
    /// The kernels of the launch list (a test may change attn_decode4's shared-memory limit;
    /// the list is rebuilt when it does).
    pub(super) kernels: DecodeKernels,
}

const F: usize = 4;

/// The most shared memory attn_decode4 takes for its scores and probabilities (larger contexts
/// use the global scratch rows).
const ATTN_SHARED_MAX: usize = 96 * 1024;

/// The decode step's kernels: one default per kernel family (PHASE_LOG P6-P17; the versions
/// they replaced and the rejected ones live in git history, indexed by
/// validation/kernels/README.md). Attention is attn_decode4; the router's logits come from a row
/// kernel and its top-k is folded into the experts' kernels; the row kernels are the second
/// versions, without per-chunk guards where a launch's shape allows. When the step runs with
/// programmatic launch (`early`), the row kernels load their first weights before the wait, and
/// the experts' down kernel its slots and residuals too; without the overlap those are slower
/// than the plain ones (P16), so a step without it uses the plain ones. Both compute the same
/// bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DecodeKernels {
    /// The row kernels that load their first weights before the programmatic-launch wait.
    pub(crate) early: bool,
    /// The most bytes of scores attn_decode4 keeps in shared memory (larger contexts use the
    /// global scratch rows).
    pub(crate) attn_shared_max: usize,
}

#[cfg(test)]
thread_local! {
    /// A test's limit on attn_decode4's shared scores, to run its scratch-row path on short
    /// contexts (tests run in parallel threads).
    pub(crate) static ATTN_SHARED_MAX_FOR_TEST: std::cell::Cell<Option<usize>> =
        const { std::cell::Cell::new(None) };
}

impl DecodeKernels {
    /// The kernels of a step whose launches run with (`early`) or without programmatic launch.
    pub(crate) fn for_launch(early: bool) -> Self {
        #[cfg(test)]
        if let Some(max) = ATTN_SHARED_MAX_FOR_TEST.with(|c| c.get()) {
            return DecodeKernels {
                early,
                attn_shared_max: max,
            };
        }
        DecodeKernels {
            early,
            attn_shared_max: ATTN_SHARED_MAX,
        }
    }
}

/// attn_decode4 for head dimension `d` (even, at most 256): one kernel per head-dimension cap
/// (32, 64, 128, 256), the smallest at least `d`.
pub(crate) fn attn_decode4_name(d: usize) -> &'static str {
    match d {
        0..=32 => "attn_decode4_d32",
        33..=64 => "attn_decode4_d64",
        65..=128 => "attn_decode4_d128",
        _ => "attn_decode4_d256",
    }
}

/// [`attn_decode4_name`]'s kernel for partial rotary (GLM-4.5: RoPE on the leading
/// `rotary_dim` values of each head).
pub(crate) fn attn_decode4p_name(d: usize) -> &'static str {
    match d {
        0..=32 => "attn_decode4p_d32",
        33..=64 => "attn_decode4p_d64",
        65..=128 => "attn_decode4p_d128",
        _ => "attn_decode4p_d256",
    }
}

/// Blocks (of 8 warps) of the stacked q|k|v launch over `rows` rows when the GPU holds
/// `resident` such blocks at once: two rows per warp (each warp issues its second row's loads
/// before its first row's tree), which measured faster than one pass of one row per warp
/// (PHASE_LOG P16; other block counts, P17, were no faster), never more than it holds.
fn qkv_grid(rows: usize, resident: u32) -> u32 {
    let one_per_warp = rows.div_ceil(8).max(1) as u32;
    let two_per_warp = (rows.div_ceil(16).max(1) as u32).min(resident.max(1));
    two_per_warp.min(one_per_warp)
}

fn p(b: &DevBuf) -> Arg {
    Arg::Ptr(b.ptr())
}

fn opt_ptr(b: &Option<DevBuf>) -> u64 {
    b.as_ref().map_or(0, |b| b.ptr())
}

fn i32a(n: usize) -> Arg {
    Arg::I32(n as i32)
}

impl CudaModel {
    /// Why the decode kernels cannot run this model, if they cannot (the legacy kernels then
    /// run its decode steps).
    pub(super) fn decode_unsupported(&self) -> Option<String> {
        let cfg = &self.cfg;
        let (h, hq, d) = (cfg.hidden_size, cfg.num_heads, cfg.head_dim);
        // the decode kernels attend to every cached position, route by softmax or groups, and
        // compute the plain SwiGLU experts: gpt-oss's decode steps run the per-operation kernels
        let x = &self.spec.extras;
        if x.attention_sinks
            || cfg.layer_windows.iter().any(Option::is_some)
            || cfg.layer_chunks.iter().any(Option::is_some)
        {
            return Some("sliding-window or chunked attention, or attention sinks".into());
        }
        if x.router_bias || self.spec.router == tarfa_core::model::RouterRule::TopKThenSoftmax {
            return Some("gpt-oss's biased top-k-then-softmax router".into());
        }
        if x.expert_bias || x.activation != tarfa_core::model::ExpertActivation::SwiGlu {
            return Some("expert biases and the clamped SwiGLU".into());
        }
        if cfg.clip_qkv.is_some() {
            return Some("OLMoE's clip_qkv".into());
        }
        if x.linear_attention.is_some() || x.gated_attention {
            return Some("gated DeltaNet (linear attention) layers and gated attention".into());
        }
        if x.llama4_attention
            || self.spec.qk_norm == tarfa_core::model::QkNorm::L2AfterRope
            || self.spec.router == tarfa_core::model::RouterRule::SigmoidScalesInput
        {
            return Some(
                "Llama 4's pairwise rotary embedding, NoPE layers, q/k L2 norm and input-scaling \
                 router"
                    .into(),
            );
        }
        if !h.is_multiple_of(8) {
            return Some(format!("hidden size {h} is not a multiple of 8"));
        }
        match &cfg.mla {
            // multi-head latent attention: mla.cu's kernels, the position from the state
            Some(m) => {
                let s = super::ops::MlaShape {
                    hq,
                    dn: m.qk_nope_head_dim,
                    dr: m.qk_rope_head_dim,
                    dv: m.v_head_dim,
                    r: m.kv_lora_rank,
                    interleave: m.rope_interleave,
                    pos0: 0,
                    tokens: 1,
                };
                if let Some(why) = s.unsupported() {
                    return Some(why);
                }
            }
            None => {
                if !(hq * d).is_multiple_of(8) {
                    return Some(format!("{hq} x {d} query values are not a multiple of 8"));
                }
                if d > 256 || !d.is_multiple_of(2) {
                    return Some(format!(
                        "head dimension {d} (the decode attention takes even D <= 256)"
                    ));
                }
            }
        }
        for layer in &self.layers {
            match &layer.mlp {
                DevMlp::Dense(m) => {
                    if !m.gate.rows.is_multiple_of(8) {
                        return Some(format!(
                            "dense width {} is not a multiple of 8",
                            m.gate.rows
                        ));
                    }
                }
                DevMlp::Moe { experts: None, .. } => {
                    return Some(
                        "expert streaming (the host reads each layer's routes to fetch its \
                         experts)"
                            .into(),
                    );
                }
                DevMlp::Moe { shared, .. } => {
                    if cfg.top_k > 8 {
                        return Some(format!(
                            "top-{} (the decode kernels mix at most 8)",
                            cfg.top_k
                        ));
                    }
                    if !cfg.expert_width.is_multiple_of(8) {
                        return Some(format!(
                            "expert width {} is not a multiple of 8",
                            cfg.expert_width
                        ));
                    }
                    if cfg.top_k * cfg.expert_width * F > 200 * 1024 {
                        return Some("the experts' activations exceed shared memory".into());
                    }
                    if (3 * cfg.num_experts)
                        .max(2 * cfg.num_experts + cfg.top_k)
                        .max(h)
                        * F
                        > 200 * 1024
                        || cfg.top_k > super::ops::MAX_TOP_K
                    {
                        return Some(format!("{} experts", cfg.num_experts));
                    }
                    if let Some(sh) = shared {
                        if !sh.mlp().gate.rows.is_multiple_of(8) {
                            return Some("shared expert width is not a multiple of 8".into());
                        }
                    }
                }
            }
        }
        None
    }

    fn dec_bufs(&self, cap: usize, kernels: DecodeKernels) -> Result<DecBufs, CudaError> {
        let cfg = &self.cfg;
        let g = &self.gpu;
        let (h, hq, hkv, d) = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        );
        let k = cfg.top_k.max(1);
        let w = "the decode step's buffers";
        let moe = self.moe_layers.max(1);
        let act = (k * cfg.expert_width)
            .max(cfg.dense_width.unwrap_or(0))
            .max(1);
        let lm_grid = self.lm_grid(kernels.early);
        let slices = d.div_ceil(32);
        // MLA: q [Hq][dn+dr], the kv_a output and q_a's in the q|k|v buffer, o [Hq][dv]
        let (qkv_len, o_len) = match &cfg.mla {
            Some(m) => (
                hq * m.qk_head_dim() + m.latent_width() + m.q_lora_rank.unwrap_or(0),
                hq * m.v_head_dim,
            ),
            None => ((hq + 2 * hkv) * d, hq * d),
        };
        Ok(DecBufs {
            cap,
            state: g.alloc(16, w)?,
            tok_log: g.alloc(cap * 4, w)?,
            counters: g.alloc((self.layers.len() + 1) * 4, w)?,
            part_v: g.alloc(lm_grid as usize * 4, w)?,
            part_i: g.alloc(lm_grid as usize * 4, w)?,
            h: g.alloc(h * F, w)?,
            xn: g.alloc(h * F, w)?,
            qkv: g.alloc(qkv_len * F, w)?,
            o: g.alloc(o_len * F, w)?,
            router_logits: g.alloc(cfg.num_experts.max(1) * F, w)?,
            act: g.alloc(act * F, w)?,
            act_sh: g.alloc(cfg.shared_expert_width.unwrap_or(0).max(1) * F, w)?,
            y_sh: g.alloc(h * F, w)?,
            s_sh: g.alloc(F, w)?,
            ids: g.alloc(moe * k * 4, w)?,
            probs: g.alloc(moe * k * 4, w)?,
            weights: g.alloc(moe * k * 4, w)?,
            by_id: g.alloc(moe * k * 4, w)?,
            kth: g.alloc(moe * 4, w)?,
            next: g.alloc(moe * 4, w)?,
            logits: g.alloc(cfg.vocab_size * F, "the decode step's logits")?,
            // a pair of rows per (query head, slice): attn_decode4's scores and probabilities when
            // they do not fit in shared memory
            scores: g.alloc(
                hq * (slices * 2).max(1) * cap * F,
                "the decode attention's scores",
            )?,
            lm_grid,
        })
    }

    /// Blocks for a row kernel: one warp per row in one pass when the GPU holds that many
    /// blocks at once, else as many as it holds (each warp then takes several rows).
    fn row_grid(&self, name: &'static str, rows: usize, shared: u32) -> u32 {
        let need = rows.div_ceil(8).max(1) as u32;
        let resident = self.gpu.occupancy(name, 256, shared) * self.gpu.info.multiprocessors.max(1);
        need.min(resident.max(1))
    }

    /// The lm_head kernel: without per-chunk guards over rows of whole 8-chunk groups.
    fn lm_name(&self, early: bool) -> &'static str {
        let lm = self.lm_head.as_ref().unwrap_or(&self.embed);
        match lm.dtype {
            DType::Bf16 if lm.cols.is_multiple_of(2048) => {
                if early {
                    "lmhead2fe_bf16"
                } else {
                    "lmhead2f_bf16"
                }
            }
            DType::Bf16 => "lmhead2_bf16",
            DType::F32 => "lmhead2_f32",
        }
    }

    /// Dynamic shared memory of a row kernel over `cols` inputs: the RMSNorm weights are staged
    /// beside the input (kernels/decode.cu `stage_issue`).
    fn row_shared(cols: usize, norm: bool) -> u32 {
        let n = if norm { 2 * cols } else { cols };
        (n * F) as u32
    }

    fn lm_grid(&self, early: bool) -> u32 {
        let lm = self.lm_head.as_ref().unwrap_or(&self.embed);
        self.row_grid(
            self.lm_name(early),
            lm.rows,
            Self::row_shared(lm.cols, true),
        )
    }

    /// `out = W x` (x = RMSNorm(x) with `norm`), one dmv launch.
    #[allow(clippy::too_many_arguments)]
    fn dmv(
        &self,
        w: &DevMat,
        x: u64,
        norm: u64,
        biases: [u64; 3],
        splits: (usize, usize),
        out: u64,
        residual: bool,
        xn_out: u64,
        label: &'static str,
        early: bool,
    ) -> Launch {
        let name = match w.dtype {
            // rows of whole groups without the per-chunk guards
            DType::Bf16 if w.cols > 8 * 256 && w.cols.is_multiple_of(4096) => {
                if early {
                    "dmv2wfe_bf16"
                } else {
                    "dmv2wf_bf16"
                }
            }
            DType::Bf16 if w.cols.is_multiple_of(2048) => {
                if early {
                    "dmv2fe_bf16"
                } else {
                    "dmv2f_bf16"
                }
            }
            // rows of more than 8 chunks: the whole row in flight (kernels/decode.cu dmv2w)
            DType::Bf16 if w.cols > 8 * 256 => "dmv2w_bf16",
            DType::Bf16 => "dmv2_bf16",
            DType::F32 => "dmv2_f32",
        };
        let shared = Self::row_shared(w.cols, norm != 0);
        Launch {
            name,
            grid: (self.row_grid(name, w.rows, shared), 1, 1),
            block: (256, 1, 1),
            shared,
            args: vec![
                Arg::Ptr(w.ptr()),
                i32a(w.rows),
                i32a(w.cols),
                Arg::Ptr(x),
                Arg::Ptr(norm),
                Arg::F32(self.cfg.eps_f32()),
                Arg::Ptr(biases[0]),
                Arg::Ptr(biases[1]),
                Arg::Ptr(biases[2]),
                i32a(splits.0),
                i32a(splits.1),
                Arg::Ptr(out),
                Arg::I32(i32::from(residual)),
                Arg::Ptr(xn_out),
            ],
            pdl: true,
            label,
            bytes: w.bytes(),
        }
    }

    /// Blocks per slot of a gate/up kernel: one warp per row in one pass when the GPU holds
    /// that many blocks at once for all `slots`, else as many as it holds.
    fn gate_up_grid(&self, name: &'static str, rows: usize, slots: usize, shared: u32) -> u32 {
        let need = rows.div_ceil(8).max(1) as u32;
        let resident = self.gpu.occupancy(name, 256, shared) * self.gpu.info.multiprocessors.max(1);
        need.min((resident / slots.max(1) as u32).max(1))
    }

    /// The experts' gate/up kernel with the router's top-k folded in (kernels/decode.cu
    /// gate_up_route2; PHASE_LOG P16): every block selects the experts from the router's
    /// logits itself; the first block writes the router's `records`.
    #[allow(clippy::too_many_arguments)]
    fn gate_up_route(
        &self,
        gate: u64,
        up: u64,
        rows: usize,
        x: u64,
        act: u64,
        logits: u64,
        records: &[Arg; 6],
    ) -> Launch {
        let (cols, e_count, k) = (self.cfg.hidden_size, self.cfg.num_experts, self.cfg.top_k);
        let name = if cols.is_multiple_of(2048) {
            "gate_up_route2f_bf16"
        } else {
            "gate_up_route2_bf16"
        };
        let shared = ((cols + 3 * e_count) * F) as u32;
        let mut args = vec![
            Arg::Ptr(gate),
            Arg::Ptr(up),
            i32a(rows),
            i32a(cols),
            Arg::Ptr(x),
            Arg::Ptr(act),
            Arg::Ptr(logits),
            i32a(e_count),
            i32a(k),
            Arg::I32(i32::from(self.spec.renormalize_topk)),
        ];
        args.extend(records.iter().cloned());
        Launch {
            name,
            grid: (self.gate_up_grid(name, rows, k, shared), k as u32, 1),
            block: (256, 1, 1),
            shared,
            args,
            pdl: true,
            label: "experts gate+up (+top-k, k experts, SwiGLU)",
            bytes: (2 * k * rows * cols * 2) as u64,
        }
    }

    /// The gate/up kernel of a dense MLP or a shared expert (one slot, `ids` = 0: the kernel
    /// also takes experts chosen by `ids`, k slots).
    #[allow(clippy::too_many_arguments)]
    fn gate_up_dec(
        &self,
        dtype: DType,
        gate: u64,
        up: u64,
        rows: usize,
        ids: u64,
        slots: usize,
        x: u64,
        norm: u64,
        act: u64,
        label: &'static str,
    ) -> Launch {
        let name = match dtype {
            DType::Bf16 if self.cfg.hidden_size.is_multiple_of(2048) => "gate_up_dec2f_bf16",
            DType::Bf16 => "gate_up_dec2_bf16",
            DType::F32 => "gate_up_dec2_f32",
        };
        let cols = self.cfg.hidden_size;
        let shared = Self::row_shared(cols, norm != 0);
        Launch {
            name,
            grid: (
                self.gate_up_grid(name, rows, slots, shared),
                slots as u32,
                1,
            ),
            block: (256, 1, 1),
            shared,
            args: vec![
                Arg::Ptr(gate),
                Arg::Ptr(up),
                i32a(rows),
                i32a(cols),
                Arg::Ptr(ids),
                Arg::Ptr(x),
                Arg::Ptr(norm),
                Arg::F32(self.cfg.eps_f32()),
                Arg::Ptr(act),
            ],
            pdl: true,
            label,
            bytes: (2 * slots * rows * cols * dtype.size()) as u64,
        }
    }

    /// The decode step's launch list (see the module doc). `cache` provides the KV cache and
    /// the RoPE table (all `cap` rows uploaded), `b` the step's buffers.
    pub(super) fn decode_plan(
        &self,
        cache: &CudaCache,
        b: &DecBufs,
        kernels: DecodeKernels,
    ) -> Result<Vec<Launch>, CudaError> {
        let cfg = &self.cfg;
        let h = cfg.hidden_size;
        // Step 1: h = widen(embed[state.token])
        let embedding = Launch {
            name: match self.embed.dtype {
                DType::Bf16 => "embed_bf16",
                DType::F32 => "embed_f32",
            },
            grid: (1, 1, 1),
            block: (256, 1, 1),
            shared: 0,
            args: vec![Arg::Ptr(self.embed.ptr()), p(&b.state), i32a(h), p(&b.h)],
            pdl: false,
            label: "embedding",
            bytes: (h * self.embed.dtype.size()) as u64,
        };

        // Steps 2-4 of every layer: attention, then the MLP (steps.rs)
        let mut steps = PlanSteps {
            model: self,
            cache,
            b,
            kernels,
            v: vec![embedding],
        };
        self.walk_layers(&mut steps)?;
        let mut v = steps.v;

        // Step 5: logits = W_lm RMSNorm(h); the greedy token into the state
        let lm = self.lm_head.as_ref().unwrap_or(&self.embed);
        let name = self.lm_name(kernels.early);
        v.push(Launch {
            name,
            grid: (b.lm_grid, 1, 1),
            block: (256, 1, 1),
            shared: Self::row_shared(lm.cols, true),
            args: vec![
                Arg::Ptr(lm.ptr()),
                i32a(lm.rows),
                i32a(lm.cols),
                p(&b.h),
                Arg::Ptr(self.final_norm.ptr()),
                Arg::F32(cfg.eps_f32()),
                p(&b.logits),
                Arg::Ptr(b.counters.ptr() + (self.layers.len() * 4) as u64),
                p(&b.part_v),
                p(&b.part_i),
                p(&b.state),
                p(&b.tok_log),
            ],
            pdl: true,
            label: "lm_head (+final norm, argmax)",
            bytes: lm.bytes(),
        });
        // the limit is per kernel, not per launch: set each kernel's largest (a later, smaller
        // launch of the same kernel must not lower it; GLM-4.5-Air's o_proj needs 48 KiB where
        // the router logits after it, the same dmv2wf kernel, need 32 KiB)
        let mut most: std::collections::BTreeMap<&'static str, u32> = Default::default();
        for l in &v {
            let m = most.entry(l.name).or_insert(0);
            *m = (*m).max(l.shared);
        }
        for (name, bytes) in most {
            self.gpu.allow_shared(name, bytes)?;
        }
        Ok(v)
    }

    /// Makes `cache`'s decode step ready for its capacity and mode: buffers, launch list and,
    /// for the graph modes, the captured graph (a failed capture falls back to the next mode,
    /// and says so in [`CudaCache::decode_note`]).
    pub(super) fn ensure_decode(&self, cache: &mut CudaCache) -> Result<(), CudaError> {
        // the buffers are sized for the launches with programmatic launch (the lm_head's
        // partial results), which also serve the fallback's
        let kernels = DecodeKernels::for_launch(true);
        if let Some(dc) = &cache.dec {
            if dc.bufs.cap == cache.cap && dc.asked == cache.mode && dc.kernels == kernels {
                return Ok(());
            }
        }
        cache.dec = None;
        cache.upload_rope(&self.gpu)?;
        let bufs = self.dec_bufs(cache.cap, kernels)?;
        let asked = cache.mode;
        // the launches for programmatic launch when it is asked for (a failed capture rebuilds
        // them for the fallback below)
        let graph_asked = matches!(asked, DecodeMode::Graph | DecodeMode::GraphPdl)
            && !self.gpu.sync_each_kernel();
        let mut pdl_plan = graph_asked && asked == DecodeMode::GraphPdl;
        let mut launches = self.decode_plan(cache, &bufs, DecodeKernels::for_launch(pdl_plan))?;
        let mut note = String::new();
        let mut graph = None;
        let mut running = DecodeMode::Direct;
        if graph_asked {
            let tries: &[bool] = if asked == DecodeMode::GraphPdl {
                &[true, false]
            } else {
                &[false]
            };
            for &pdl in tries {
                if pdl_plan && !pdl {
                    launches = self.decode_plan(cache, &bufs, DecodeKernels::for_launch(false))?;
                    pdl_plan = false;
                }
                match self.gpu.capture(&launches, pdl) {
                    Ok(g) => {
                        graph = Some(g);
                        running = if pdl {
                            DecodeMode::GraphPdl
                        } else {
                            DecodeMode::Graph
                        };
                        break;
                    }
                    Err(e) => {
                        note.push_str(&format!(
                            "graph capture{} failed: {e}; ",
                            if pdl { " with programmatic launch" } else { "" }
                        ));
                        self.gpu.sync("a failed graph capture").ok();
                    }
                }
            }
        }
        cache.dec = Some(Box::new(DecodeCtx {
            kernels,
            bufs,
            launches,
            graph,
            asked,
            running,
            note,
        }));
        Ok(())
    }

    /// Runs the prepared decode step once (graph or launches), without waiting.
    pub(super) fn run_decode_step(&self, dc: &DecodeCtx) -> Result<(), CudaError> {
        match &dc.graph {
            Some(g) => self.gpu.launch_graph(g),
            None => {
                for l in &dc.launches {
                    self.gpu.launch_rec(l, false)?;
                }
                Ok(())
            }
        }
    }

    /// Makes room for `n` more positions in `cache` (it grows by doubling, up to its maximum),
    /// so that no step of the next `n` reallocates it.
    pub fn reserve(&self, cache: &mut CudaCache, n: usize) -> Result<(), CudaError> {
        let end = cache.len + n;
        if end > cache.max_len {
            return Err(RunError::ContextFull {
                needed: end,
                max: cache.max_len,
            }
            .into());
        }
        if end > cache.cap {
            let want = end.max(2 * cache.cap).min(cache.max_len);
            cache.grow(self, want)?;
        }
        Ok(())
    }

    /// One decode step through the decode kernels: returns what [`CudaModel::forward`] returns.
    pub(super) fn forward_decode(
        &self,
        cache: &mut CudaCache,
        token: u32,
        opts: &ForwardOptions,
    ) -> Result<ForwardOutput, CudaError> {
        let pos0 = self.launch_one_step(cache, token)?;
        let b = &cache.dec.as_ref().expect("prepared above").bufs;
        let vocab = self.cfg.vocab_size;
        let logits: Vec<f32> = self.gpu.read(b.logits.ptr(), vocab, "the logits")?;
        let ids = self.step_ids(b)?;
        let stats = self.step_stats(1, &ids);
        let router = if opts.trace_router {
            let rec = RecordPtrs {
                probs: b.probs.ptr(),
                weights: b.weights.ptr(),
                kth: b.kth.ptr(),
                next: b.next.ptr(),
            };
            self.router_records_at(rec, pos0, 1, &ids)?
        } else {
            Vec::new()
        };
        cache.len = pos0 + 1;
        Ok(ForwardOutput {
            logits: vec![logits],
            router,
            stats,
        })
    }

    /// `token` is in the vocabulary and `cache` was made by this model.
    fn check_step_input(&self, cache: &CudaCache, token: u32) -> Result<(), CudaError> {
        if token as usize >= self.cfg.vocab_size {
            return Err(RunError::TokenOutOfRange {
                token,
                vocab: self.cfg.vocab_size,
            }
            .into());
        }
        if cache.model_id != self.id {
            return Err(CudaError::Internal(
                "a KV cache made by another model".into(),
            ));
        }
        Ok(())
    }

    /// Prepares `n` decode steps from `token` at position `cache.len()`: room reserved, the step
    /// (buffers, launches, graph) ready, the state set to that token and position with the token
    /// log at step 0. Returns the position (`cache.len()` is not advanced).
    fn start_steps(&self, cache: &mut CudaCache, token: u32, n: usize) -> Result<usize, CudaError> {
        self.reserve(cache, n)?;
        self.ensure_decode(cache)?;
        let pos0 = cache.len;
        let dc = cache.dec.as_ref().expect("prepared above");
        self.gpu.write_async(
            dc.bufs.state.ptr(),
            &[token, pos0 as u32, 0, 0],
            "the decode state",
        )?;
        Ok(pos0)
    }

    /// Launches one decode step of `token` at position `cache.len()` (room reserved, the step
    /// prepared; the token log restarts at step 0), without waiting; returns that position
    /// (`cache.len()` is not advanced).
    fn launch_one_step(&self, cache: &mut CudaCache, token: u32) -> Result<usize, CudaError> {
        let pos0 = self.start_steps(cache, token, 1)?;
        self.run_decode_step(cache.dec.as_ref().expect("prepared"))?;
        Ok(pos0)
    }

    /// The router's choices of the step just run: every MoE layer's k experts (waits for it).
    fn step_ids(&self, b: &DecBufs) -> Result<Vec<u32>, CudaError> {
        self.gpu.read(
            b.ids.ptr(),
            self.moe_layers * self.cfg.top_k,
            "the router's choices",
        )
    }

    /// One greedy decode step: `token` at position `cache.len()`, then the next token -- the
    /// argmax of this step's logits chosen on the GPU (what [`tarfa_core::generate::argmax`] chooses
    /// from them) -- and the step's statistics, with no logits copied to the host (what
    /// `tarfa-run generate` needs when it writes no logits and no router trace). With
    /// [`DecodeMode::Legacy`], or a model the decode kernels cannot run, it runs
    /// [`CudaModel::forward`] and the host's argmax.
    pub fn greedy_step(
        &self,
        cache: &mut CudaCache,
        token: u32,
    ) -> Result<(u32, StepStats), CudaError> {
        if cache.mode == DecodeMode::Legacy || self.decode_unsupported().is_some() {
            let out = self.forward(cache, &[token], &ForwardOptions::default())?;
            return Ok((tarfa_core::generate::argmax(&out.logits[0]), out.stats));
        }
        self.check_step_input(cache, token)?;
        let pos0 = self.launch_one_step(cache, token)?;
        let b = &cache.dec.as_ref().expect("prepared above").bufs;
        // step 0 of the token log: the lm_head kernel wrote this step's choice there
        let next: Vec<u32> = self.gpu.read(b.tok_log.ptr(), 1, "the chosen token")?;
        let ids = self.step_ids(b)?;
        cache.len = pos0 + 1;
        Ok((next[0], self.step_stats(1, &ids)))
    }

    /// How many greedy steps [`CudaModel::greedy_steps`] queues before it waits: 1 where the
    /// decode kernels do not run (the legacy mode, a model they cannot take, streamed experts:
    /// each step then waits anyway).
    pub fn run_ahead(&self, cache: &CudaCache) -> usize {
        if self.wait_each_token
            || cache.mode == DecodeMode::Legacy
            || self.decode_unsupported().is_some()
        {
            1
        } else {
            RUN_AHEAD
        }
    }

    /// `n` greedy steps from `first`, queued on the device and waited for once
    /// ([`CudaModel::decode_greedy`]): the tokens [`CudaModel::greedy_step`] chooses one by one,
    /// bit for bit, each with its step's counters (those of a one-token step do not depend on
    /// the router's choice: its k experts per layer are distinct).
    pub fn greedy_steps(
        &self,
        cache: &mut CudaCache,
        first: u32,
        n: usize,
    ) -> Result<Vec<(u32, StepStats)>, CudaError> {
        let stats = self.one_token_stats();
        Ok(self
            .decode_greedy(cache, first, n)?
            .into_iter()
            .map(|t| (t, stats))
            .collect())
    }

    /// Greedy decoding of `n` tokens on the device after `first` (the token at position
    /// `cache.len()`, not yet in the cache): each step's token is the argmax of its logits,
    /// chosen on the GPU and fed to the next step there; the host waits once, at the end.
    /// Returns the `n` tokens chosen (what [`tarfa_core::generate::argmax`] would choose from each
    /// step's logits). With [`DecodeMode::Legacy`] it runs [`CudaModel::forward`] per token.
    pub fn decode_greedy(
        &self,
        cache: &mut CudaCache,
        first: u32,
        n: usize,
    ) -> Result<Vec<u32>, CudaError> {
        if n == 0 {
            return Ok(Vec::new());
        }
        self.check_step_input(cache, first)?;
        if cache.mode == DecodeMode::Legacy || self.decode_unsupported().is_some() {
            let mut out = Vec::with_capacity(n);
            let mut t = first;
            for _ in 0..n {
                let step = self.forward(cache, &[t], &ForwardOptions::default())?;
                t = tarfa_core::generate::argmax(&step.logits[0]);
                out.push(t);
            }
            return Ok(out);
        }
        let pos0 = self.start_steps(cache, first, n)?;
        let dc = cache.dec.as_ref().expect("prepared above");
        for _ in 0..n {
            self.run_decode_step(dc)?;
        }
        let toks: Vec<u32> = self
            .gpu
            .read(dc.bufs.tok_log.ptr(), n, "the generated tokens")?;
        cache.len = pos0 + n;
        Ok(toks)
    }

    /// Times every kernel of `steps` decode steps after `first` (launched one by one, each
    /// timed with events, no graph and no programmatic launch), grouped by what they compute.
    /// The steps are real: they append to the cache and advance it like [`decode_greedy`].
    ///
    /// [`decode_greedy`]: CudaModel::decode_greedy
    pub fn profile_decode(
        &self,
        cache: &mut CudaCache,
        first: u32,
        steps: usize,
    ) -> Result<Vec<KernelTime>, CudaError> {
        if let Some(why) = self.decode_unsupported() {
            return Err(CudaError::UnsupportedModel(format!(
                "decode kernels: {why}"
            )));
        }
        let steps = steps.max(1);
        let pos0 = self.start_steps(cache, first, steps)?;
        let dc = cache.dec.as_ref().expect("prepared above");
        let mut rows: Vec<KernelTime> = Vec::new();
        for s in 0..steps {
            let ms = self.gpu.time_launches(&dc.launches)?;
            for (l, t) in dc.launches.iter().zip(ms) {
                let i = match rows.iter().position(|r| r.label == l.label) {
                    Some(i) => i,
                    None => {
                        rows.push(KernelTime {
                            label: l.label.to_string(),
                            kernels: String::new(),
                            launches: 0,
                            us_per_token: 0.0,
                            weight_bytes: 0,
                            registers: self.gpu.registers(l.name),
                        });
                        rows.len() - 1
                    }
                };
                let r = &mut rows[i];
                if s == 0 {
                    r.launches += 1;
                    r.weight_bytes += l.bytes;
                    if !r.kernels.split(',').any(|k| k == l.name) {
                        if !r.kernels.is_empty() {
                            r.kernels.push(',');
                        }
                        r.kernels.push_str(l.name);
                    }
                }
                r.us_per_token += t * 1e3 / steps as f64;
            }
        }
        cache.len = pos0 + steps;
        Ok(rows)
    }
}

impl CudaModel {
    /// Where the graph's time goes (a diagnostic for the benchmark, never for output): for each
    /// kind of launch (its label), milliseconds per step of the decode graph with that kind's
    /// launches left out, and of a graph of that kind's launches alone; first row: the whole
    /// graph (`"all"`, both figures the same). `n` replays each, every replay from the same
    /// position (the state is reset before each timed run), so attention always sees the same
    /// context (`per_kind` false: the first row alone); graphs keep programmatic launch when the
    /// cache's steps run as graph-pdl. Left-out launches make the step's numbers meaningless: the cache's contents
    /// past its length are overwritten (its length is unchanged) and nothing here is read back.
    pub fn graph_costs(
        &self,
        cache: &mut CudaCache,
        first: u32,
        n: usize,
        per_kind: bool,
    ) -> Result<Vec<(String, f64, f64)>, CudaError> {
        if let Some(why) = self.decode_unsupported() {
            return Err(CudaError::UnsupportedModel(format!(
                "decode kernels: {why}"
            )));
        }
        let n = n.max(1);
        self.reserve(cache, n)?;
        self.ensure_decode(cache)?;
        let pos0 = cache.len;
        let dc = cache.dec.as_ref().expect("prepared above");
        let mut labels: Vec<&'static str> = Vec::new();
        for l in &dc.launches {
            if !labels.contains(&l.label) {
                labels.push(l.label);
            }
        }
        let time_with = |launches: &[Launch], pdl: bool| -> Result<f64, CudaError> {
            if launches.is_empty() {
                return Ok(0.0);
            }
            let g = self.gpu.capture(launches, pdl)?;
            let state = [first, pos0 as u32, 0, 0];
            // one untimed replay (first use of the graph), then n timed ones
            self.gpu
                .write_async(dc.bufs.state.ptr(), &state, "the decode state")?;
            self.gpu.launch_graph(&g)?;
            let mut total = 0.0;
            for _ in 0..n {
                self.gpu
                    .write_async(dc.bufs.state.ptr(), &state, "the decode state")?;
                total += self.gpu.time(|| self.gpu.launch_graph(&g))?;
            }
            Ok(total / n as f64)
        };
        // the mode that runs this cache's steps: graph-pdl's graphs keep programmatic launch
        let pdl = dc.running == DecodeMode::GraphPdl;
        let time = |launches: &[Launch]| time_with(launches, pdl);
        let all = time(&dc.launches)?;
        let mut rows = vec![("all".to_string(), all, all)];
        // what the boundaries alone cost: an empty kernel per launch, same geometry
        let nops: Vec<Launch> = dc
            .launches
            .iter()
            .map(|l| Launch {
                name: "probe_nop",
                shared: 0,
                args: vec![Arg::I32(0)],
                pdl: false,
                label: "empty kernels",
                bytes: 0,
                ..l.clone()
            })
            .collect();
        let nop = time(&nops)?;
        rows.push(("empty kernel per launch".to_string(), nop, nop));
        let nops_pdl: Vec<Launch> = nops
            .into_iter()
            .map(|l| Launch { pdl: true, ..l })
            .collect();
        let nop = time_with(&nops_pdl, true)?;
        rows.push((
            "empty kernel per launch, programmatic launch".to_string(),
            nop,
            nop,
        ));
        for label in labels.into_iter().filter(|_| per_kind) {
            let without: Vec<Launch> = dc
                .launches
                .iter()
                .filter(|l| l.label != label)
                .cloned()
                .collect();
            let only: Vec<Launch> = dc
                .launches
                .iter()
                .filter(|l| l.label == label)
                .cloned()
                .collect();
            rows.push((label.to_string(), time(&without)?, time(&only)?));
        }
        Ok(rows)
    }

    /// The GPU's device-to-device copy rate in GB/s, counting bytes read plus bytes written
    /// (the median of `reps` copies of `bytes`, timed with events): the bandwidth ceiling the
    /// decode figures are compared with.
    pub fn copy_rate(&self, bytes: usize, reps: usize) -> Result<f64, CudaError> {
        self.gpu.copy_rate(bytes, reps)
    }

    /// Milliseconds of GPU time `n` decode steps take through the prepared launches or graph,
    /// timed with events around them (the host does not wait between steps): the device-side
    /// cost of decoding, with no host round trip. Advances the cache like
    /// [`CudaModel::decode_greedy`].
    pub fn time_decode(
        &self,
        cache: &mut CudaCache,
        first: u32,
        n: usize,
    ) -> Result<f64, CudaError> {
        if let Some(why) = self.decode_unsupported() {
            return Err(CudaError::UnsupportedModel(format!(
                "decode kernels: {why}"
            )));
        }
        let pos0 = self.start_steps(cache, first, n)?;
        let dc = cache.dec.as_ref().expect("prepared above");
        let ms = self.gpu.time(|| {
            for _ in 0..n {
                self.run_decode_step(dc)?;
            }
            Ok(())
        })?;
        cache.len = pos0 + n;
        Ok(ms)
    }
}

impl CudaCache {
    /// The kernels of the prepared decode step, in launch order, with their grids (tests).
    #[cfg(test)]
    pub(crate) fn decode_kernels(&self) -> Vec<(&'static str, (u32, u32, u32))> {
        self.dec
            .as_ref()
            .map(|d| d.launches.iter().map(|l| (l.name, l.grid)).collect())
            .unwrap_or_default()
    }

    /// Chooses how this sequence's decode steps run (the next step rebuilds what it needs).
    pub fn set_decode_mode(&mut self, mode: DecodeMode) {
        self.mode = mode;
    }

    /// The decode mode asked for.
    pub fn decode_mode(&self) -> DecodeMode {
        self.mode
    }

    /// The decode mode that ran the last decode step (a failed graph capture falls back), and
    /// why it differs from the one asked for, if it does.
    pub fn decode_running(&self) -> Option<(DecodeMode, String)> {
        self.dec.as_ref().map(|d| (d.running, d.note.clone()))
    }

    /// Kernel launches of one decode step (0 before the first).
    pub fn decode_launches(&self) -> usize {
        self.dec.as_ref().map_or(0, |d| d.launches.len())
    }
}

/// The decode step's launch list, layer by layer (steps.rs [`LayerSteps`]): the fused kernels of
/// kernels/decode.cu for one token, pushed onto `v`.
struct PlanSteps<'a> {
    model: &'a CudaModel,
    cache: &'a CudaCache,
    b: &'a DecBufs,
    kernels: DecodeKernels,
    v: Vec<Launch>,
}

impl PlanSteps<'_> {
    /// A gated MLP (a dense layer's, or the shared expert): gate/up with SwiGLU of `x` (RMSNorm'd
    /// with `norm` when not 0) into `act`, then its down projection into `out` (added to it with
    /// `residual`).
    fn gated_mlp(
        &mut self,
        m: &DevDense,
        (x, norm): (u64, u64),
        act: u64,
        (out, residual): (u64, bool),
        labels: [&'static str; 2],
    ) {
        let (model, kernels) = (self.model, self.kernels);
        let h = model.cfg.hidden_size;
        self.v.push(model.gate_up_dec(
            m.gate.dtype,
            m.gate.ptr(),
            m.up.ptr(),
            m.gate.rows,
            0,
            1,
            x,
            norm,
            act,
            labels[0],
        ));
        self.v.push(model.dmv(
            &m.down,
            act,
            0,
            [0; 3],
            (h, h),
            out,
            residual,
            0,
            labels[1],
            kernels.early,
        ));
    }

    /// An RMSNorm of one segment of `n` values at `x` (row stride `stride`) in place, eps
    /// `eps` (norm_rope.cu `rmsnorm`, one warp).
    fn rmsnorm_in_place(
        &mut self,
        x: u64,
        stride: usize,
        w: u64,
        n: usize,
        eps: f32,
        label: &'static str,
    ) {
        self.v.push(Launch {
            name: "rmsnorm",
            grid: (1, 1, 1),
            block: (256, 1, 1),
            shared: 0,
            args: vec![
                Arg::Ptr(x),
                Arg::I64(stride as i64),
                Arg::Ptr(x),
                Arg::I64(stride as i64),
                Arg::Ptr(w),
                i32a(n),
                i32a(1),
                Arg::F32(eps),
            ],
            pdl: false,
            label,
            bytes: 0,
        });
    }

    /// Multi-head latent attention of the decode token (steps.rs `OpSteps::mla`'s operations):
    /// q (q_proj, or q_a + its norm + q_b) and kva = W_kva xn, each with the input norm in
    /// front; the latent's norm; mla.cu's RoPE + latent append and attention at the state's
    /// position; h = h + W_o o.
    fn mla(&mut self, l: usize, layer: &DevLayer, a: &DevMla) -> Result<(), CudaError> {
        let (model, b, cache, kernels) = (self.model, self.b, self.cache, self.kernels);
        let cfg = &model.cfg;
        let dims = cfg
            .mla
            .as_ref()
            .ok_or_else(|| CudaError::Internal("MLA weights without MLA dimensions".into()))?;
        let (h, hq) = (cfg.hidden_size, cfg.num_heads);
        let (dn, dr, dv, r) = (
            dims.qk_nope_head_dim,
            dims.qk_rope_head_dim,
            dims.v_head_dim,
            dims.kv_lora_rank,
        );
        let (dq, w) = (dn + dr, r + dr);
        let q = b.qkv.ptr();
        let kva = q + (hq * dq * F) as u64;
        let qa = kva + (w * F) as u64;
        let early = kernels.early;
        let label = "attention (MLA projections)";
        match &a.q {
            DevMlaQuery::Plain(wq) => {
                let rows = wq.rows;
                self.v.push(model.dmv(
                    wq,
                    b.h.ptr(),
                    layer.input_norm.ptr(),
                    [0; 3],
                    (rows, rows),
                    q,
                    false,
                    0,
                    label,
                    early,
                ));
            }
            DevMlaQuery::LoRa { a: wa, norm, b: wb } => {
                let rank = wa.rows;
                self.v.push(model.dmv(
                    wa,
                    b.h.ptr(),
                    layer.input_norm.ptr(),
                    [0; 3],
                    (rank, rank),
                    qa,
                    false,
                    0,
                    label,
                    early,
                ));
                self.rmsnorm_in_place(
                    qa,
                    rank,
                    norm.ptr(),
                    rank,
                    MLA_NORM_EPS,
                    "attention (MLA norms)",
                );
                let rows = wb.rows;
                self.v
                    .push(model.dmv(wb, qa, 0, [0; 3], (rows, rows), q, false, 0, label, early));
            }
        }
        self.v.push(model.dmv(
            &a.kv_a,
            b.h.ptr(),
            layer.input_norm.ptr(),
            [0; 3],
            (w, w),
            kva,
            false,
            0,
            label,
            early,
        ));
        self.rmsnorm_in_place(
            kva,
            w,
            a.kv_a_norm.ptr(),
            r,
            MLA_NORM_EPS,
            "attention (MLA norms)",
        );
        let (cos, sin) = cache.rope_ptrs();
        let latent = cache.k_table(l);
        self.v.push(Launch {
            name: "mla_rope_append_dec",
            grid: ((hq + 1) as u32, 1, 1),
            block: (64, 1, 1),
            shared: 0,
            args: vec![
                Arg::Ptr(q),
                Arg::Ptr(kva),
                i32a(hq),
                i32a(dn),
                i32a(dr),
                i32a(r),
                Arg::I32(i32::from(dims.rope_interleave)),
                Arg::Ptr(cos),
                Arg::Ptr(sin),
                p(&b.state),
                Arg::Ptr(latent),
            ],
            pdl: false,
            label: "attention (MLA RoPE, latent append, softmax)",
            bytes: 0,
        });
        let scale = cfg
            .mla_softmax_scale()
            .ok_or_else(|| CudaError::Internal("an MLA config without its softmax scale".into()))?;
        self.v.push(Launch {
            name: match a.kv_b.dtype {
                DType::Bf16 => "mla_attention_dec_bf16",
                DType::F32 => "mla_attention_dec_f32",
            },
            grid: (hq as u32, 1, 1),
            block: (256, 1, 1),
            shared: 0,
            args: vec![
                Arg::Ptr(q),
                Arg::Ptr(a.kv_b.ptr()),
                i32a(hq),
                i32a(dn),
                i32a(dr),
                i32a(dv),
                i32a(r),
                Arg::Ptr(latent),
                p(&b.state),
                Arg::F32(scale),
                p(&b.scores),
                i32a(cache.cap),
                p(&b.o),
            ],
            pdl: false,
            label: "attention (MLA RoPE, latent append, softmax)",
            bytes: a.kv_b.bytes(),
        });
        // h = h + W_o o
        self.v.push(model.dmv(
            &a.o,
            b.o.ptr(),
            0,
            [0; 3],
            (h, h),
            b.h.ptr(),
            true,
            0,
            "attention o_proj (+residual)",
            early,
        ));
        Ok(())
    }

    /// MoE layer `moe_index`'s router records (gate_up_route2's last six arguments): ids,
    /// probs, weights, by_id (k each), kth, next.
    fn records(&self, moe_index: usize) -> [Arg; 6] {
        let b = self.b;
        let rec = (moe_index * self.model.cfg.top_k * 4) as u64;
        let one = (moe_index * 4) as u64;
        [
            Arg::Ptr(b.ids.ptr() + rec),
            Arg::Ptr(b.probs.ptr() + rec),
            Arg::Ptr(b.weights.ptr() + rec),
            Arg::Ptr(b.by_id.ptr() + rec),
            Arg::Ptr(b.kth.ptr() + one),
            Arg::Ptr(b.next.ptr() + one),
        ]
    }
}

impl LayerSteps for PlanSteps<'_> {
    fn attention(&mut self, l: usize, layer: &DevLayer) -> Result<(), CudaError> {
        let (model, b, cache, kernels) = (self.model, self.b, self.cache, self.kernels);
        let cfg = &model.cfg;
        let (h, hq, hkv, d) = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        );
        let v = &mut self.v;
        let (cos, sin) = cache.rope_ptrs();
        let scale = (1.0f64 / (d as f64).sqrt()) as f32;
        let slices = d.div_ceil(32);
        let qkv_rows = (hq + 2 * hkv) * d;
        let a =
            match &layer.attn {
                DevAttn::Gqa(a) => a,
                DevAttn::Mla(m) => return self.mla(l, layer, m),
                DevAttn::Linear(_) => return Err(CudaError::Internal(
                    "a gated DeltaNet layer in the decode graph (decode_unsupported refuses it)"
                        .into(),
                )),
            };
        let qkv = b.qkv.ptr();
        let k_raw = qkv + (hq * d * F) as u64;
        let v_raw = qkv + ((hq + hkv) * d * F) as u64;
        // q | k | v = W_qkv RMSNorm(h) (+ biases)
        let biases = [opt_ptr(&a.q_bias), opt_ptr(&a.k_bias), opt_ptr(&a.v_bias)];
        let stacked = std::sync::Arc::ptr_eq(&a.q.buf, &a.k.buf)
            && std::sync::Arc::ptr_eq(&a.q.buf, &a.v.buf)
            && a.k.off == a.q.off + a.q.bytes()
            && a.v.off == a.k.off + a.k.bytes();
        if stacked {
            let all = DevMat {
                buf: a.q.buf.clone(),
                off: a.q.off,
                rows: qkv_rows,
                cols: h,
                dtype: a.q.dtype,
            };
            let mut launch = model.dmv(
                &all,
                b.h.ptr(),
                layer.input_norm.ptr(),
                biases,
                (hq * d, (hq + hkv) * d),
                qkv,
                false,
                0,
                "attention q|k|v (+input norm)",
                kernels.early,
            );
            let resident = model.gpu.occupancy(launch.name, 256, launch.shared)
                * model.gpu.info.multiprocessors.max(1);
            launch.grid.0 = qkv_grid(qkv_rows, resident);
            v.push(launch);
        } else {
            for (m, bias, out) in [
                (&a.q, biases[0], qkv),
                (&a.k, biases[1], k_raw),
                (&a.v, biases[2], v_raw),
            ] {
                v.push(model.dmv(
                    m,
                    b.h.ptr(),
                    layer.input_norm.ptr(),
                    [bias, 0, 0],
                    (m.rows, m.rows),
                    out,
                    false,
                    0,
                    "attention q|k|v (+input norm)",
                    kernels.early,
                ));
            }
        }
        // q/k norm: per head inside the attention kernel, over the whole projection here
        let (qn, kn) = match (model.spec.qk_norm, &a.q_norm, &a.k_norm) {
            (QkNorm::PerHead, Some(qn), Some(kn)) => (qn.ptr(), kn.ptr()),
            (QkNorm::WholeProjection, Some(qn), Some(kn)) => {
                for (x, w, n) in [(qkv, qn, hq * d), (k_raw, kn, hkv * d)] {
                    v.push(Launch {
                        name: "rmsnorm",
                        grid: (1, 1, 1),
                        block: (256, 1, 1),
                        shared: 0,
                        args: vec![
                            Arg::Ptr(x),
                            Arg::I64(n as i64),
                            Arg::Ptr(x),
                            Arg::I64(n as i64),
                            Arg::Ptr(w.ptr()),
                            i32a(n),
                            i32a(1),
                            Arg::F32(cfg.eps_f32()),
                        ],
                        pdl: false,
                        label: "q/k norm (whole projection)",
                        bytes: 0,
                    });
                }
                (0, 0)
            }
            _ => (0, 0),
        };
        // the scores and probabilities (2 x cap floats) in shared memory when they fit,
        // else in the global scratch rows
        // partial rotary (GLM-4.5): the kernel that rotates the leading rotary_dim values
        let partial = cfg.rotary_dim != d;
        let att_name = if partial {
            attn_decode4p_name(d)
        } else {
            attn_decode4_name(d)
        };
        let (att_shared, att_scratch) = if 2 * cache.cap * F <= kernels.attn_shared_max {
            ((2 * cache.cap * F) as u32, 0)
        } else {
            (0, b.scores.ptr())
        };
        v.push(Launch {
            name: att_name,
            grid: (hq as u32, slices as u32, 1),
            block: (512, 1, 1),
            shared: att_shared,
            args: vec![
                Arg::Ptr(qkv),
                Arg::Ptr(k_raw),
                Arg::Ptr(v_raw),
                i32a(hq),
                i32a(hkv),
                i32a(d),
                Arg::Ptr(qn),
                Arg::Ptr(kn),
                Arg::F32(cfg.eps_f32()),
                Arg::Ptr(cos),
                Arg::Ptr(sin),
                p(&b.state),
                Arg::Ptr(cache.k_table(l)),
                Arg::Ptr(cache.v_table(l)),
                i32a(cache.cap),
                Arg::F32(scale),
                Arg::Ptr(att_scratch),
                i32a(cache.cap),
                p(&b.o),
            ]
            .into_iter()
            .chain(partial.then(|| i32a(cfg.rotary_dim)))
            .collect(),
            pdl: true,
            label: "attention (norm, RoPE, KV append, softmax)",
            bytes: 0,
        });
        // h = h + W_o o (+ b_o)
        v.push(model.dmv(
            &a.o,
            b.o.ptr(),
            0,
            [opt_ptr(&a.o_bias), 0, 0],
            (h, h),
            b.h.ptr(),
            true,
            0,
            "attention o_proj (+residual)",
            kernels.early,
        ));
        Ok(())
    }

    fn dense(&mut self, layer: &DevLayer, m: &DevDense) -> Result<(), CudaError> {
        let b = self.b;
        // the post-attention norm in the gate/up kernel; down into h (+residual)
        self.gated_mlp(
            m,
            (b.h.ptr(), layer.post_norm.ptr()),
            b.act.ptr(),
            (b.h.ptr(), true),
            [
                "dense MLP gate+up (+post norm)",
                "dense MLP down (+residual)",
            ],
        );
        Ok(())
    }

    fn router(
        &mut self,
        layer: &DevLayer,
        router: &DevMat,
        bias: Option<&DevBuf>,
        moe_index: usize,
    ) -> Result<(), CudaError> {
        let (model, b, kernels) = (self.model, self.b, self.kernels);
        let e_count = model.cfg.num_experts;
        let grouped = model.grouped_route(bias)?;
        let records = self.records(moe_index);
        let v = &mut self.v;
        // the logits by a row kernel; the top-k in the experts' kernels (softmax top-k), or
        // route_grouped's own launch writing the records the experts' kernels read
        v.push(model.dmv(
            router,
            b.h.ptr(),
            layer.post_norm.ptr(),
            [0; 3],
            (e_count, e_count),
            b.router_logits.ptr(),
            false,
            b.xn.ptr(),
            "router (+post norm, top-k)",
            kernels.early,
        ));
        if let Some(g) = grouped {
            let k = model.cfg.top_k;
            let mut args = vec![
                p(&b.router_logits),
                Arg::Ptr(g.bias.unwrap_or(0)),
                i32a(e_count),
                i32a(k),
                i32a(g.n_group),
                i32a(g.topk_group),
                Arg::I32(i32::from(g.bias.is_some())),
                Arg::I32(i32::from(g.renorm)),
                Arg::F32(g.scale),
            ];
            args.extend(records.iter().cloned());
            v.push(Launch {
                name: "route_grouped",
                grid: (1, 1, 1),
                block: (256, 1, 1),
                shared: ((2 * e_count + 2 * k + g.n_group) * F) as u32,
                args,
                pdl: false,
                label: "router (+post norm, top-k)",
                bytes: 0,
            });
        }
        Ok(())
    }

    fn shared_expert(&mut self, sh: &DevShared) -> Result<(u64, u64), CudaError> {
        let (model, b, kernels) = (self.model, self.b, self.kernels);
        let m = sh.mlp();
        // from the router kernel's normalised vector; down into y_sh
        self.gated_mlp(
            m,
            (b.xn.ptr(), 0),
            b.act_sh.ptr(),
            (b.y_sh.ptr(), false),
            ["shared expert", "shared expert"],
        );
        // ungated shared experts: no gate logit (the mix adds y_sh as it is)
        let Some(sg) = sh.gate() else {
            return Ok((b.y_sh.ptr(), 0));
        };
        let v = &mut self.v;
        v.push(model.dmv(
            sg,
            b.xn.ptr(),
            0,
            [0; 3],
            (1, 1),
            b.s_sh.ptr(),
            false,
            0,
            "shared expert",
            kernels.early,
        ));
        Ok((b.y_sh.ptr(), b.s_sh.ptr()))
    }

    fn experts(
        &mut self,
        _l: usize,
        experts: Option<&DevExperts>,
        moe_index: usize,
        (y_sh, s_sh): (u64, u64),
    ) -> Result<(), CudaError> {
        let records = self.records(moe_index);
        let (model, b, kernels) = (self.model, self.b, self.kernels);
        let cfg = &model.cfg;
        let h = cfg.hidden_size;
        let v = &mut self.v;
        let Some(experts) = experts else {
            return Err(CudaError::Internal(
                "the decode kernels with streamed experts".into(),
            ));
        };
        let (e_count, k_top) = (cfg.num_experts, cfg.top_k);
        let rec = (moe_index * k_top * 4) as u64;
        let i = cfg.expert_width;
        // group-limited routers wrote the records in their own launch (router above): the
        // experts' kernels read the ids from them instead of selecting from the logits
        let grouped = model.spec.router != tarfa_core::model::RouterRule::SoftmaxTopK;
        if grouped {
            v.push(model.gate_up_dec(
                DType::Bf16,
                experts.gate.ptr(),
                experts.up.ptr(),
                i,
                b.ids.ptr() + rec,
                k_top,
                b.xn.ptr(),
                0,
                b.act.ptr(),
                "experts gate+up (+top-k, k experts, SwiGLU)",
            ));
        } else {
            v.push(model.gate_up_route(
                experts.gate.ptr(),
                experts.up.ptr(),
                i,
                b.xn.ptr(),
                b.act.ptr(),
                b.router_logits.ptr(),
                &records,
            ));
        }
        // top-8 over whole chunks: without guards, and with programmatic launch its
        // slots, residuals and first weights loaded before the wait (the router's
        // choice recomputed from its logits, as the kernel just before writes it)
        let name = if k_top == 8 && i.is_multiple_of(256) {
            if kernels.early && !grouped {
                "moe_down_route2f8e"
            } else {
                "moe_down_dec2f8"
            }
        } else {
            "moe_down_dec2"
        };
        let route_args = name == "moe_down_route2f8e";
        let shared_mem = ((k_top * i + if route_args { 3 * e_count } else { 0 }) * F) as u32;
        model.gpu.allow_shared(name, shared_mem)?;
        let grid = model.row_grid(name, h, shared_mem);
        let mut args = vec![
            Arg::Ptr(experts.down.ptr()),
            i32a(h),
            i32a(i),
            Arg::Ptr(b.ids.ptr() + rec),
            Arg::Ptr(b.weights.ptr() + rec),
            Arg::Ptr(b.by_id.ptr() + rec),
            i32a(k_top),
            p(&b.act),
            Arg::Ptr(y_sh),
            Arg::Ptr(s_sh),
            p(&b.h),
        ];
        if route_args {
            args.extend([
                p(&b.router_logits),
                i32a(e_count),
                Arg::I32(i32::from(model.spec.renormalize_topk)),
            ]);
        }
        v.push(Launch {
            name,
            grid: (grid, 1, 1),
            block: (256, 1, 1),
            shared: shared_mem,
            args,
            pdl: true,
            label: "experts down (k experts, mix, +residual)",
            bytes: (k_top * h * i * 2) as u64,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{attn_decode4_name, qkv_grid, DecodeKernels, ATTN_SHARED_MAX};
    use crate::device::Gpu;
    use crate::model::CudaModel;
    use crate::synthetic::{random_model, SyntheticShape};
    use crate::DecodeMode;
    use tarfa_core::step::ForwardOptions;

    #[test]
    fn attention_takes_the_smallest_head_dimension_cap_that_holds_d() {
        for (d, name) in [
            (2, "attn_decode4_d32"),
            (32, "attn_decode4_d32"),
            (34, "attn_decode4_d64"),
            (64, "attn_decode4_d64"),
            (66, "attn_decode4_d128"),
            (128, "attn_decode4_d128"),
            (200, "attn_decode4_d256"),
            (256, "attn_decode4_d256"),
        ] {
            assert_eq!(attn_decode4_name(d), name, "D {d}");
        }
        // early (programmatic launch) or not, the same attention limit
        assert_eq!(
            DecodeKernels::for_launch(true).attn_shared_max,
            ATTN_SHARED_MAX
        );
        assert!(DecodeKernels::for_launch(true).early);
        assert!(!DecodeKernels::for_launch(false).early);
    }

    /// The decode step's kernels for `mode`, after a 3-token prompt and one decode step.
    fn plan(shape: &SyntheticShape, mode: DecodeMode) -> Vec<&'static str> {
        let (cfg, src) = random_model(shape, 5);
        let gpu = CudaModel::load_on(Gpu::mock(), cfg, Arc::new(src), None).unwrap();
        let mut c = gpu.new_cache().unwrap();
        c.set_decode_mode(mode);
        let opts = ForwardOptions::default();
        gpu.forward(&mut c, &[1, 2, 3], &opts).unwrap();
        gpu.forward(&mut c, &[4], &opts).unwrap();
        c.decode_kernels().into_iter().map(|k| k.0).collect()
    }

    #[test]
    fn the_launch_list_follows_the_layer_order() {
        // Qwen2-MoE's small shape: layers 0 and 2 dense, layer 1 MoE with a shared expert
        // (hidden 96: the guarded row kernels; D 24: attn_decode4_d32; BF16 matrices)
        let shape = SyntheticShape::small("qwen2_moe");
        let attention = ["dmv2_bf16", "attn_decode4_d32", "dmv2_bf16"];
        let dense = ["gate_up_dec2_bf16", "dmv2_bf16"];
        let moe = [
            "dmv2_bf16",           // router logits (+ post norm)
            "gate_up_dec2_bf16",   // shared expert gate+up
            "dmv2_bf16",           // shared expert down
            "dmv2_bf16",           // shared expert gate
            "gate_up_route2_bf16", // the top-k and the experts' gate+up
            "moe_down_dec2",       // top-3: the guarded down kernel
        ];
        let mut want = vec!["embed_bf16"];
        for mlp in [&dense[..], &moe[..], &dense[..]] {
            want.extend(attention);
            want.extend(mlp);
        }
        want.push("lmhead2_bf16");
        for mode in [DecodeMode::Direct, DecodeMode::Graph, DecodeMode::GraphPdl] {
            assert_eq!(plan(&shape, mode), want, "{mode:?}");
        }
        // the legacy mode has no launch list
        assert!(plan(&shape, DecodeMode::Legacy).is_empty());
    }

    #[test]
    fn the_qkv_launch_takes_two_rows_per_warp_within_what_the_gpu_holds() {
        // Qwen3-30B-A3B's 5,120 q|k|v rows on the H200 (528 resident blocks): 320 blocks
        assert_eq!(qkv_grid(5120, 528), 320);
        // a GPU that holds fewer: all it holds (each warp then takes more rows)
        assert_eq!(qkv_grid(5120, 132), 132);
        // a partial last block and a tiny model
        assert_eq!(qkv_grid(5121, 528), 321);
        assert_eq!(qkv_grid(3, 528), 1);
        // never more blocks than one row per warp needs
        assert_eq!(qkv_grid(9, 528), 1);
        assert_eq!(qkv_grid(17, 528), 2);
    }
}
