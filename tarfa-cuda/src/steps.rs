//! The layer body, written once: what one decoder layer is, in the order every step runs it
//! ([`LayerSteps`], walked by [`CudaModel::walk_layers`]). Two steps implement it: the
//! per-operation step of `forward` ([`OpSteps`], here: one kernel per operation, any number of
//! tokens) and the decode step's launch list (`decode_plan`'s `PlanSteps`: fused kernels, one
//! token). A third (a batched step) implements the same five methods; none walks the layers
//! itself.
//!
//! Nothing here may change an operation or its order relative to the CPU backend
//! (tarfa-cpu's forward): each method's body is the CPU's sequence for that part of the layer.

use super::*;
use tarfa_cpu::{Capture, StepHook};

/// One decoder layer's parts, called in this order by [`CudaModel::walk_layers`]: attention;
/// then a dense MLP, or a MoE layer's router, its shared expert (when it has one) and its routed
/// experts.
pub(super) trait LayerSteps {
    /// RMSNorm, q|k|v (+ biases), the q/k norms, RoPE, the KV-cache append, attention, and
    /// `h = h + W_o o (+ b_o)` for layer `l`.
    fn attention(&mut self, l: usize, layer: &DevLayer) -> Result<(), CudaError>;
    /// A dense MLP after the post-attention RMSNorm: gate/up with SwiGLU, down, residual.
    fn dense(&mut self, layer: &DevLayer, m: &DevDense) -> Result<(), CudaError>;
    /// A MoE layer's router after the post-attention RMSNorm: logits, softmax, top-k, records
    /// (MoE layer `moe_index`).
    fn router(
        &mut self,
        layer: &DevLayer,
        router: &DevMat,
        bias: Option<&DevBuf>,
        moe_index: usize,
    ) -> Result<(), CudaError>;
    /// The shared expert and its gate's logit, from the normalised input; returns where they
    /// are (y_sh, s_sh) for the experts' mix (s_sh = 0: ungated shared experts).
    fn shared_expert(&mut self, sh: &DevShared) -> Result<(u64, u64), CudaError>;
    /// The routed experts (`None`: in the hot tier), mixed in ascending expert id with the
    /// shared expert (`shared`: (0, 0) without), and the residual.
    fn experts(
        &mut self,
        l: usize,
        experts: Option<&DevExperts>,
        moe_index: usize,
        shared: (u64, u64),
    ) -> Result<(), CudaError>;
}

impl CudaModel {
    /// The one walk over the layers: every step's layer body is this order of `steps`' parts.
    pub(super) fn walk_layers(&self, steps: &mut impl LayerSteps) -> Result<(), CudaError> {
        for (l, layer) in self.layers.iter().enumerate() {
            steps.attention(l, layer)?;
            match &layer.mlp {
                DevMlp::Dense(m) => steps.dense(layer, m)?,
                DevMlp::Moe {
                    router,
                    experts,
                    shared,
                    correction_bias,
                    moe_index,
                    ..
                } => {
                    steps.router(layer, router, correction_bias.as_ref(), *moe_index)?;
                    let sh = match shared {
                        Some(sh) => steps.shared_expert(sh)?,
                        None => (0, 0),
                    };
                    steps.experts(l, experts.as_ref(), *moe_index, sh)?;
                }
            }
        }
        Ok(())
    }
}

/// Where a per-operation step's tokens keep their keys and values.
pub(super) enum StepKv<'a> {
    /// One sequence: its cache, the tokens at positions `shape.pos0..`.
    One(&'a CudaCache),
    /// Several sequences (`forward_seqs`): each token's cache and position from the step's
    /// tables; `n_stride` the scores' row stride (the longest sequence's positions).
    Seqs { tables: SeqTables, n_stride: usize },
}

/// The per-operation step (`forward`, `forward_seqs`): the kernels of
/// kernels/{matvec,tile,norm_rope,attention,moe}.cu launched one by one on `shape.tokens` tokens,
/// in the workspace `ws`. Steps of several tokens take the token-tiled kernels (tile.cu), which
/// compute every output as the one-token kernels do (the same bits).
pub(super) struct OpSteps<'a> {
    pub(super) model: &'a CudaModel,
    pub(super) ws: &'a Workspace,
    pub(super) kv: StepKv<'a>,
    /// The step's query tiles when its attention takes the prefill kernels (kernels/prefill.cu;
    /// a layer with a window or chunk still takes attention.cu's).
    pub(super) tiles: Option<ops::AttnTiles>,
    pub(super) shape: AttnShape,
    /// round_f32(1 / sqrt(D)) computed in f64, as the CPU does
    pub(super) scale: f32,
    /// Each sequence's tokens and gated DeltaNet states (empty for a model without them).
    pub(super) linear: Vec<LinearSegment>,
    /// A step's observer (`CudaModel::forward_seqs_observed`: captures only), shown copies of
    /// the device's values where the CPU backend's forward shows its own.
    pub(super) hook: Option<&'a mut dyn StepHook>,
    /// The layer being walked (set by `attention`, read by the MLP's captures).
    pub(super) layer: usize,
}

/// One sequence's tokens in a step (`start..start + tokens` of the step's rows) and where each
/// of its gated DeltaNet layers reads and writes its state.
pub(super) struct LinearSegment {
    pub(super) start: usize,
    pub(super) tokens: usize,
    /// The linear layers' state pointers, in layer order.
    pub(super) layers: Vec<LinearIo>,
    /// Per layer, its place in `layers` (None: an attention layer).
    pub(super) index: Vec<Option<usize>>,
}

impl LinearSegment {
    /// `cache`'s segment, None for a model without linear layers.
    pub(super) fn of(
        cache: &CudaCache,
        start: usize,
        tokens: usize,
        num_layers: usize,
    ) -> Option<LinearSegment> {
        cache.linear.as_ref()?;
        let mut layers = Vec::new();
        let mut index = Vec::with_capacity(num_layers);
        for l in 0..num_layers {
            match cache.linear_io(l) {
                Some(io) => {
                    index.push(Some(layers.len()));
                    layers.push(io);
                }
                None => index.push(None),
            }
        }
        Some(LinearSegment {
            start,
            tokens,
            layers,
            index,
        })
    }

    fn io(&self, l: usize) -> Result<LinearIo, CudaError> {
        self.index
            .get(l)
            .copied()
            .flatten()
            .map(|i| self.layers[i])
            .ok_or_else(|| CudaError::Internal(format!("layer {l}: a linear layer without state")))
    }
}

/// Shows `rows` to `hook` as `what` of layer `l`; an observer that writes to them is refused
/// (the write would be lost: the device keeps its own values).
fn show(
    hook: &mut dyn StepHook,
    what: Capture,
    l: usize,
    rows: &mut [Vec<f32>],
) -> Result<(), CudaError> {
    let before: Vec<u32> = rows.iter().flatten().map(|x| x.to_bits()).collect();
    match what {
        Capture::Residual => hook.residual(l, rows),
        Capture::AttnOut => hook.attn_out(l, rows),
        Capture::MlpOut => hook.mlp_out(l, rows),
        Capture::RouterLogits => hook.router_logits(l, rows),
        Capture::RouterProbs | Capture::ExpertOut => {
            return Err(CudaError::Internal(format!(
                "{what:?} is not shown as rows"
            )))
        }
    }
    if rows.iter().flatten().map(|x| x.to_bits()).ne(before) {
        return Err(refused(&format!(
            "layer {l}: the step hook wrote to the {what:?} it was shown"
        )));
    }
    Ok(())
}

impl OpSteps<'_> {
    /// Whether the hook wants `what` at layer `l` (no hook: nothing is captured).
    fn wants(&self, what: Capture, l: usize) -> bool {
        self.hook.as_ref().is_some_and(|k| k.wants(what, l))
    }

    /// The step's `[T][width]` f32 rows at `ptr`, copied back (waits for the stream).
    fn rows_at(&self, ptr: u64, width: usize, what: &str) -> Result<Vec<Vec<f32>>, CudaError> {
        let t = self.shape.tokens;
        let flat: Vec<f32> = self.model.gpu.read(ptr, t * width, what)?;
        Ok(flat.chunks_exact(width).map(<[f32]>::to_vec).collect())
    }

    /// Copies `[T][width]` rows at `ptr` back and shows them as `what` of layer `l`.
    fn show_at(
        &mut self,
        what: Capture,
        l: usize,
        ptr: u64,
        width: usize,
    ) -> Result<(), CudaError> {
        let mut rows = self.rows_at(ptr, width, "a capture")?;
        match self.hook.as_deref_mut() {
            Some(k) => show(k, what, l, &mut rows),
            None => Ok(()),
        }
    }

    /// The residual after the last layer, before the final norm (the CPU's
    /// `residual(num_layers)`); called once `walk_layers` has run.
    pub(super) fn after_layers(&mut self) -> Result<(), CudaError> {
        let n = self.model.cfg.num_layers;
        if self.wants(Capture::Residual, n) {
            self.show_at(
                Capture::Residual,
                n,
                self.ws.h.ptr(),
                self.model.cfg.hidden_size,
            )?;
        }
        Ok(())
    }

    /// `h = h + (W x (+ b))`: the attention block's last product (o_proj, or the gated
    /// DeltaNet's out_proj). When the hook wants layer `l`'s attention output, the same product
    /// is also launched without the residual into the capture buffer: the same kernel and
    /// reductions, so its rows are the `W x (+ b)` the residual launch adds.
    fn attn_out_proj(
        &mut self,
        l: usize,
        w: &DevMat,
        x: u64,
        x_stride: usize,
        bias: u64,
    ) -> Result<(), CudaError> {
        let (m, ws, t_count) = (self.model, self.ws, self.shape.tokens);
        let h = m.cfg.hidden_size;
        if self.wants(Capture::AttnOut, l) {
            let cap = ws.capture.ptr();
            ops::matmul(&m.gpu, w, x, x_stride, bias, cap, h, t_count, false)?;
            self.show_at(Capture::AttnOut, l, cap, h)?;
        }
        ops::matmul(&m.gpu, w, x, x_stride, bias, ws.h.ptr(), h, t_count, true)
    }

    /// The MoE layer's captures after its experts ran: each chosen expert's output before its
    /// weight (`y_experts`, `[T][k][H]`), and the block's output before the residual add.
    /// `y_ready`: whether the step's kernels wrote `y_experts` (the tiled and streamed paths);
    /// otherwise `down_mix` fused the products into the mix, and a capture-only `down_slots`
    /// over the resident experts writes them (the same warp dot and bias as `down_mix`'s). The
    /// block's output is a capture-only `moe_mix` of those products into zeroed rows: `0 + acc`
    /// is `acc` (an accumulator that starts at +0.0 is never -0.0), the sums `down_mix` makes
    /// in its order (EXPERTNESS of the streamed path: moe_mix is down_mix's epilogue).
    fn moe_captures(
        &mut self,
        l: usize,
        experts: Option<&DevExperts>,
        route: RouteOut,
        (y_sh, s_sh): (u64, u64),
        y_ready: bool,
    ) -> Result<(), CudaError> {
        let (want_y, want_mix) = (
            self.wants(Capture::ExpertOut, l),
            self.wants(Capture::MlpOut, l),
        );
        if !want_y && !want_mix {
            return Ok(());
        }
        let (m, ws, t_count) = (self.model, self.ws, self.shape.tokens);
        let (gpu, cfg) = (&m.gpu, &m.cfg);
        let (h, i, k) = (cfg.hidden_size, cfg.expert_width, cfg.top_k);
        let math = m.expert_math(l);
        if !y_ready {
            let experts = experts.ok_or_else(|| {
                CudaError::Internal(format!("layer {l}: streamed experts left no products"))
            })?;
            ops::down_slots(
                gpu,
                SlotTable::stacked_down(experts.down.ptr(), h, i),
                h,
                i,
                route.ids,
                k,
                ws.act.ptr(),
                ws.y_experts.ptr(),
                t_count,
                math,
            )?;
        }
        if want_y {
            let ids: Vec<u32> = gpu.read(route.ids, t_count * k, "the router's choices")?;
            let y: Vec<f32> =
                gpu.read(ws.y_experts.ptr(), t_count * k * h, "the experts' outputs")?;
            // the CPU's order: experts in ascending id, each one's tokens in step order
            let mut pairs: Vec<(u32, usize, usize)> =
                (0..t_count * k).map(|q| (ids[q], q / k, q)).collect();
            pairs.sort_unstable();
            if let Some(hook) = self.hook.as_deref_mut() {
                for (e, t, q) in pairs {
                    hook.expert_out(l, t, e as usize, &y[q * h..(q + 1) * h]);
                }
            }
        }
        if want_mix {
            let cap = ws.capture.ptr();
            gpu.write(cap, &vec![0.0f32; t_count * h], "the captures")?;
            ops::moe_mix(
                gpu,
                h,
                route,
                k,
                ws.y_experts.ptr(),
                y_sh,
                s_sh,
                cap,
                t_count,
                math,
            )?;
            self.show_at(Capture::MlpOut, l, cap, h)?;
        }
        Ok(())
    }
}

impl OpSteps<'_> {
    /// xn = RMSNorm(h) with the layer's post-attention norm (the MLP's input).
    fn post_norm(&self, layer: &DevLayer) -> Result<(), CudaError> {
        let (m, ws) = (self.model, self.ws);
        let h = m.cfg.hidden_size;
        ops::rmsnorm(
            &m.gpu,
            ws.h.ptr(),
            h,
            ws.xn.ptr(),
            h,
            layer.post_norm.ptr(),
            h,
            self.shape.tokens,
            m.cfg.eps_f32(),
        )
    }
}

impl OpSteps<'_> {
    /// A gated MLP (a dense layer's, or the shared expert) of xn: gate/up with SwiGLU into
    /// `act`, then the down projection into `out` (added to it with `residual`).
    fn gated_mlp(&self, d: &DevDense, act: u64, out: u64, residual: bool) -> Result<(), CudaError> {
        let (m, ws, t_count) = (self.model, self.ws, self.shape.tokens);
        let (h, f) = (m.cfg.hidden_size, d.gate.rows);
        let lanes = ops::lanes(&m.gpu, t_count >= ops::LS_AUTO_TOKENS);
        let tiled = t_count >= 2
            && ops::gate_up_tile(
                &m.gpu,
                d.gate.dtype,
                d.gate.ptr(),
                d.up.ptr(),
                f,
                h,
                None,
                t_count,
                1,
                ws.xn.ptr(),
                act,
                ops::dense_kernels(lanes),
            )?;
        if !tiled {
            ops::gate_up(
                &m.gpu,
                d.gate.dtype,
                d.gate.ptr(),
                d.up.ptr(),
                f,
                h,
                0,
                1,
                ws.xn.ptr(),
                act,
                t_count,
                ops::ExpertMath::default(),
            )?;
        }
        ops::matmul(&m.gpu, &d.down, act, f, 0, out, h, t_count, residual)
    }
}

impl OpSteps<'_> {
    /// Grouped-query attention of the step (LayerSteps::attention's body for GQA layers).
    fn gqa(&mut self, l: usize, layer: &DevLayer, a: &DevAttention) -> Result<(), CudaError> {
        let (m, ws, shape) = (self.model, self.ws, self.shape);
        let (gpu, cfg) = (&m.gpu, &m.cfg);
        let (h, hq, hkv, d) = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        );
        let (t_count, eps) = (shape.tokens, cfg.eps_f32());
        ops::rmsnorm(
            gpu,
            ws.h.ptr(),
            h,
            ws.xn.ptr(),
            h,
            layer.input_norm.ptr(),
            h,
            t_count,
            eps,
        )?;
        let bias = |b: &Option<DevBuf>| b.as_ref().map_or(0, |b| b.ptr());
        // gated attention (Qwen3-Next, Qwen3.5): q_proj yields each head's query then its gate
        let gated = m.spec.extras.gated_attention;
        let (q_out, q_rows) = if gated {
            (ws.q_gate.ptr(), 2 * hq * d)
        } else {
            (ws.q.ptr(), hq * d)
        };
        for (w, b, out, rows) in [
            (&a.q, &a.q_bias, q_out, q_rows),
            (&a.k, &a.k_bias, ws.k.ptr(), hkv * d),
            (&a.v, &a.v_bias, ws.v.ptr(), hkv * d),
        ] {
            ops::matmul(gpu, w, ws.xn.ptr(), h, bias(b), out, rows, t_count, false)?;
        }
        if gated {
            ops::split_query_gate(gpu, ws.q_gate.ptr(), hq, d, t_count, ws.q.ptr())?;
        }
        // q/k norm: per head (rows of D), or over the whole projection (one row per token)
        let per_head = match (m.spec.qk_norm, &a.q_norm, &a.k_norm) {
            (QkNorm::PerHead, Some(qn), Some(kn)) => Some((qn, kn, true)),
            (QkNorm::WholeProjection, Some(qn), Some(kn)) => Some((qn, kn, false)),
            _ => None,
        };
        if let Some((qn, kn, per_head)) = per_head {
            for (x, w, heads) in [(ws.q.ptr(), qn, hq), (ws.k.ptr(), kn, hkv)] {
                let (n, rows) = if per_head {
                    (d, t_count * heads)
                } else {
                    (heads * d, t_count)
                };
                ops::rmsnorm(gpu, x, n, x, n, w.ptr(), n, rows, eps)?;
            }
        }
        // OLMoE's clip_qkv: q, k and v clamped after the q/k norm, before RoPE (the CPU's
        // gqa_block; transformers' OlmoeAttention)
        if let Some(c) = cfg.clip_qkv {
            let c = c as f32;
            for (x, rows) in [
                (ws.q.ptr(), hq * d),
                (ws.k.ptr(), hkv * d),
                (ws.v.ptr(), hkv * d),
            ] {
                ops::clip_abs(gpu, x, rows * t_count, c)?;
            }
        }
        let mask = m.attn_mask(l);
        let form = m.rope_form(l, ws);
        // the prefill attention over query tiles where the layer sees whole prefixes
        let tiles = self
            .tiles
            .filter(|_| ops::query_tile_tokens(&shape, &mask).is_some());
        match &self.kv {
            StepKv::One(cache) => {
                let (kc, vc) = (cache.k_table(l), cache.v_table(l));
                let (cos, sin) = cache.rope_ptrs();
                ops::rope_append_kv(
                    gpu,
                    shape,
                    ws.q.ptr(),
                    ws.k.ptr(),
                    ws.v.ptr(),
                    cos,
                    sin,
                    kc,
                    vc,
                    form,
                )?;
                if let Some(t) = tiles {
                    ops::attention_tiles(
                        gpu,
                        shape,
                        ws.q.ptr(),
                        ops::KvSrc::One { kc, vc },
                        t,
                        self.scale,
                        ws.scores.ptr(),
                        ws.o.ptr(),
                        mask.sinks,
                    )?;
                } else {
                    ops::attention(
                        gpu,
                        shape,
                        ws.q.ptr(),
                        kc,
                        vc,
                        self.scale,
                        ws.scores.ptr(),
                        mask.stride(shape.pos0 + t_count),
                        ws.o.ptr(),
                        mask,
                    )?;
                }
            }
            StepKv::Seqs { tables, n_stride } => {
                let t = tables.layer(l);
                ops::rope_append_kv_seqs(gpu, shape, ws.q.ptr(), ws.k.ptr(), ws.v.ptr(), t, form)?;
                if let Some(tt) = tiles {
                    ops::attention_tiles(
                        gpu,
                        shape,
                        ws.q.ptr(),
                        ops::KvSrc::Seqs(t),
                        tt,
                        self.scale,
                        ws.scores.ptr(),
                        ws.o.ptr(),
                        mask.sinks,
                    )?;
                } else {
                    ops::attention_seqs(
                        gpu,
                        shape,
                        ws.q.ptr(),
                        t,
                        self.scale,
                        ws.scores.ptr(),
                        mask.stride(*n_stride),
                        ws.o.ptr(),
                        mask,
                    )?;
                }
            }
        }
        // gated attention: o = o * sigmoid(gate), before o_proj
        if gated {
            ops::sigmoid_gate(gpu, ws.o.ptr(), ws.q_gate.ptr(), hq, d, t_count)?;
        }
        self.attn_out_proj(l, &a.o, ws.o.ptr(), hq * d, bias(&a.o_bias))
    }

    /// Multi-head latent attention of the step (cpu/forward.rs `mla_block`'s order): the input
    /// norm; q (q_proj, or q_a, its norm, q_b) and kva = W_kva xn; the latent's norm in place;
    /// RoPE and the latent rows appended (mla.cu); the absorbed attention; h = h + W_o o.
    fn mla(&mut self, l: usize, layer: &DevLayer, a: &DevMla) -> Result<(), CudaError> {
        let (m, ws, shape) = (self.model, self.ws, self.shape);
        let (gpu, cfg) = (&m.gpu, &m.cfg);
        let dims = cfg
            .mla
            .as_ref()
            .ok_or_else(|| CudaError::Internal("MLA weights without MLA dimensions".into()))?;
        let (h, hq, t_count) = (cfg.hidden_size, cfg.num_heads, shape.tokens);
        let (dn, dr, dv, r) = (
            dims.qk_nope_head_dim,
            dims.qk_rope_head_dim,
            dims.v_head_dim,
            dims.kv_lora_rank,
        );
        let (dq, w) = (dn + dr, r + dr);
        ops::rmsnorm(
            gpu,
            ws.h.ptr(),
            h,
            ws.xn.ptr(),
            h,
            layer.input_norm.ptr(),
            h,
            t_count,
            cfg.eps_f32(),
        )?;
        match &a.q {
            DevMlaQuery::Plain(q) => ops::matmul(
                gpu,
                q,
                ws.xn.ptr(),
                h,
                0,
                ws.q.ptr(),
                hq * dq,
                t_count,
                false,
            )?,
            DevMlaQuery::LoRa { a: qa, norm, b } => {
                let rank = qa.rows;
                ops::matmul(gpu, qa, ws.xn.ptr(), h, 0, ws.k.ptr(), rank, t_count, false)?;
                ops::rmsnorm(
                    gpu,
                    ws.k.ptr(),
                    rank,
                    ws.k.ptr(),
                    rank,
                    norm.ptr(),
                    rank,
                    t_count,
                    MLA_NORM_EPS,
                )?;
                ops::matmul(
                    gpu,
                    b,
                    ws.k.ptr(),
                    rank,
                    0,
                    ws.q.ptr(),
                    hq * dq,
                    t_count,
                    false,
                )?;
            }
        }
        ops::matmul(
            gpu,
            &a.kv_a,
            ws.xn.ptr(),
            h,
            0,
            ws.v.ptr(),
            w,
            t_count,
            false,
        )?;
        // the latent's norm over its first r values, in place (the rope key follows it)
        ops::rmsnorm(
            gpu,
            ws.v.ptr(),
            w,
            ws.v.ptr(),
            w,
            a.kv_a_norm.ptr(),
            r,
            t_count,
            MLA_NORM_EPS,
        )?;
        let s = ops::MlaShape {
            hq,
            dn,
            dr,
            dv,
            r,
            interleave: dims.rope_interleave,
            pos0: shape.pos0,
            tokens: t_count,
        };
        if let Some(why) = s.unsupported() {
            return Err(CudaError::UnsupportedModel(why));
        }
        let (kv, n_stride) = match &self.kv {
            StepKv::One(cache) => {
                let (cos, sin) = cache.rope_ptrs();
                let kv = ops::MlaKv::One {
                    cache: cache.k_table(l),
                    cos,
                    sin,
                };
                (kv, shape.pos0 + t_count)
            }
            StepKv::Seqs { tables, n_stride } => (ops::MlaKv::Seqs(tables.layer(l)), *n_stride),
        };
        ops::mla_rope_append(gpu, &s, ws.q.ptr(), ws.v.ptr(), kv)?;
        let scale = cfg
            .mla_softmax_scale()
            .ok_or_else(|| CudaError::Internal("an MLA config without its softmax scale".into()))?;
        ops::mla_attention(
            gpu,
            &s,
            ws.q.ptr(),
            &a.kv_b,
            kv,
            scale,
            ws.scores.ptr(),
            n_stride,
            ws.o.ptr(),
        )?;
        self.attn_out_proj(l, &a.o, ws.o.ptr(), hq * dv, 0)
    }
}

/// The gated DeltaNet's fixed q/k L2-norm eps (tarfa-cpu's `LINEAR_QK_EPS`, transformers'
/// `l2norm(x, eps=1e-6)`, whatever the config's `rms_norm_eps`).
const LINEAR_QK_EPS: f32 = 1e-6;

impl OpSteps<'_> {
    /// A gated DeltaNet layer of the step (cpu/forward.rs `linear_block`): the input norm, the
    /// projections over all tokens (Qwen3-Next's permuted into head-major q | k | v, z, b, a),
    /// each sequence's convolution from its state, the q/k L2 norms, each sequence's recurrence
    /// in position order, the gated RMSNorm of every value head, and h = h + out_proj(o).
    fn linear(&mut self, l: usize, layer: &DevLayer, a: &DevLinear) -> Result<(), CudaError> {
        let (m, ws, t_count) = (self.model, self.ws, self.shape.tokens);
        let (gpu, cfg) = (&m.gpu, &m.cfg);
        let dims = cfg.linear.as_ref().ok_or_else(|| {
            CudaError::Internal("gated DeltaNet weights without their dimensions".into())
        })?;
        let s = ops::LinearShape::of(dims);
        let (h, eps) = (cfg.hidden_size, cfg.eps_f32());
        let (c, vw, hv) = (s.channels(), s.value_width(), s.hv);
        ops::rmsnorm(
            gpu,
            ws.h.ptr(),
            h,
            ws.xn.ptr(),
            h,
            layer.input_norm.ptr(),
            h,
            t_count,
            eps,
        )?;
        let x = ws.xn.ptr();
        let (qkv, z, b, av) = (
            ws.lin_qkv.ptr(),
            ws.lin_z.ptr(),
            ws.lin_b.ptr(),
            ws.lin_a.ptr(),
        );
        match &a.input {
            DevLinearIn::Separate {
                qkv: wq,
                z: wz,
                b: wb,
                a: wa,
            } => {
                for (w, out, rows) in [(wq, qkv, c), (wz, z, vw), (wb, b, hv), (wa, av, hv)] {
                    ops::matmul(gpu, w, x, h, 0, out, rows, t_count, false)?;
                }
            }
            DevLinearIn::Fused { qkvz, ba } => {
                let (raw, raw_ba) = (ws.lin_qkvz.ptr(), ws.lin_ba.ptr());
                ops::matmul(gpu, qkvz, x, h, 0, raw, qkvz.rows, t_count, false)?;
                ops::matmul(gpu, ba, x, h, 0, raw_ba, ba.rows, t_count, false)?;
                ops::linear_unpack(gpu, s, raw, raw_ba, t_count, qkv, z, b, av)?;
            }
        }
        let f = 4u64;
        for seg in &self.linear {
            let io = seg.io(l)?;
            let at = qkv + seg.start as u64 * c as u64 * f;
            ops::linear_conv(
                gpu,
                s,
                at,
                c,
                seg.tokens,
                a.conv.ptr(),
                io.conv_src,
                io.conv_dst,
                at,
                c,
            )?;
        }
        // scale = f32(1 / sqrt(Dk)), as the CPU computes it
        let scale = (1.0f64 / (s.dk as f64).sqrt()) as f32;
        ops::linear_qk_norm(gpu, s, qkv, c, t_count, LINEAR_QK_EPS, scale)?;
        let o = ws.lin_o.ptr();
        for seg in &self.linear {
            let io = seg.io(l)?;
            let t0 = seg.start as u64;
            let rio = ops::RecurIo {
                qkv: qkv + t0 * c as u64 * f,
                stride: c,
                b: b + t0 * hv as u64 * f,
                a: av + t0 * hv as u64 * f,
                a_log: a.a_log.ptr(),
                dt_bias: a.dt_bias.ptr(),
                src: io.state_src,
                dst: io.state_dst,
                o: o + t0 * vw as u64 * f,
            };
            ops::linear_recur(gpu, s, rio, seg.tokens)?;
        }
        // the gated RMSNorm of every value head: (w * (o * r)) * silu(z)
        ops::rmsnorm(gpu, o, s.dv, o, s.dv, a.norm.ptr(), s.dv, t_count * hv, eps)?;
        ops::silu_gate(gpu, o, z, t_count * vw)?;
        self.attn_out_proj(l, &a.out, o, vw, 0)
    }
}

impl LayerSteps for OpSteps<'_> {
    fn attention(&mut self, l: usize, layer: &DevLayer) -> Result<(), CudaError> {
        self.layer = l;
        if self.wants(Capture::Residual, l) {
            self.show_at(
                Capture::Residual,
                l,
                self.ws.h.ptr(),
                self.model.cfg.hidden_size,
            )?;
        }
        match &layer.attn {
            DevAttn::Gqa(a) => self.gqa(l, layer, a),
            DevAttn::Mla(a) => self.mla(l, layer, a),
            DevAttn::Linear(a) => self.linear(l, layer, a),
        }
    }

    fn dense(&mut self, layer: &DevLayer, d: &DevDense) -> Result<(), CudaError> {
        self.post_norm(layer)?;
        let (m, ws, l) = (self.model, self.ws, self.layer);
        self.gated_mlp(d, ws.act.ptr(), ws.h.ptr(), true)?;
        if self.wants(Capture::MlpOut, l) {
            // the down product again, without the residual: the rows the launch above added
            let (h, t_count, cap) = (m.cfg.hidden_size, self.shape.tokens, ws.capture.ptr());
            ops::matmul(
                &m.gpu,
                &d.down,
                ws.act.ptr(),
                d.gate.rows,
                0,
                cap,
                h,
                t_count,
                false,
            )?;
            self.show_at(Capture::MlpOut, l, cap, h)?;
        }
        Ok(())
    }

    fn router(
        &mut self,
        layer: &DevLayer,
        router: &DevMat,
        bias: Option<&DevBuf>,
        moe_index: usize,
    ) -> Result<(), CudaError> {
        self.post_norm(layer)?;
        let (m, ws, t_count) = (self.model, self.ws, self.shape.tokens);
        let cfg = &m.cfg;
        // gpt-oss's router is a linear layer with a bias: logits = W x + b
        let linear_bias = match &layer.mlp {
            DevMlp::Moe {
                router_bias: Some(b),
                ..
            } => b.ptr(),
            _ => 0,
        };
        ops::matmul(
            &m.gpu,
            router,
            ws.xn.ptr(),
            cfg.hidden_size,
            linear_bias,
            ws.router_logits.ptr(),
            cfg.num_experts,
            t_count,
            false,
        )?;
        self.router_captures()?;
        let out = ws.route_out(moe_index, t_count, cfg.top_k);
        let by_logit = match m.spec.router {
            RouterRule::TopKThenSoftmax => Some(false),
            RouterRule::SigmoidScalesInput => Some(true),
            _ => None,
        };
        if let Some(sigmoid) = by_logit {
            return ops::route_topk_first(
                &m.gpu,
                ws.router_logits.ptr(),
                cfg.num_experts,
                cfg.top_k,
                sigmoid,
                t_count,
                out,
            );
        }
        match m.grouped_route(bias)? {
            Some(g) => ops::route_grouped(
                &m.gpu,
                ws.router_logits.ptr(),
                cfg.num_experts,
                cfg.top_k,
                &g,
                t_count,
                out,
            ),
            None => ops::route_topk(
                &m.gpu,
                ws.router_logits.ptr(),
                cfg.num_experts,
                cfg.top_k,
                m.spec.renormalize_topk,
                t_count,
                out,
            ),
        }
    }

    fn shared_expert(&mut self, sh: &DevShared) -> Result<(u64, u64), CudaError> {
        let (m, ws, t_count) = (self.model, self.ws, self.shape.tokens);
        let h = m.cfg.hidden_size;
        self.gated_mlp(sh.mlp(), ws.act_shared.ptr(), ws.y_shared.ptr(), false)?;
        let Some(gate) = sh.gate() else {
            return Ok((ws.y_shared.ptr(), 0));
        };
        ops::matmul(
            &m.gpu,
            gate,
            ws.xn.ptr(),
            h,
            0,
            ws.s_shared.ptr(),
            1,
            t_count,
            false,
        )?;
        Ok((ws.y_shared.ptr(), ws.s_shared.ptr()))
    }

    fn experts(
        &mut self,
        l: usize,
        experts: Option<&DevExperts>,
        moe_index: usize,
        shared: (u64, u64),
    ) -> Result<(), CudaError> {
        let y_ready = self.experts_mixed(l, experts, moe_index, shared)?;
        if self.hook.is_some() {
            let route = self
                .ws
                .route_out(moe_index, self.shape.tokens, self.model.cfg.top_k);
            self.moe_captures(l, experts, route, shared, y_ready)?;
        }
        Ok(())
    }
}

impl OpSteps<'_> {
    /// A MoE layer's router captures, once its logits are in `router_logits`: the logits, the
    /// probabilities the CPU's rule computes from them (`tarfa_cpu::router_probs`, on the host
    /// from the copied logits: the device's routers keep the chosen experts' values only, and
    /// these logits are the CPU's bits), and no forced expert (an intervention).
    fn router_captures(&mut self) -> Result<(), CudaError> {
        let Some(hook) = self.hook.as_deref_mut() else {
            return Ok(());
        };
        let (m, l, t_count) = (self.model, self.layer, self.shape.tokens);
        let cfg = &m.cfg;
        for t in 0..t_count {
            if hook.forced_experts(l, t).is_some() {
                return Err(refused(&format!(
                    "layer {l}, token {t}: the step hook forced the experts"
                )));
            }
        }
        let (want_logits, want_probs) = (
            hook.wants(Capture::RouterLogits, l),
            hook.wants(Capture::RouterProbs, l),
        );
        if !want_logits && !want_probs {
            return Ok(());
        }
        let mut logits = self.rows_at(
            self.ws.router_logits.ptr(),
            cfg.num_experts,
            "the router logits",
        )?;
        let Some(hook) = self.hook.as_deref_mut() else {
            return Ok(());
        };
        if want_logits {
            show(hook, Capture::RouterLogits, l, &mut logits)?;
        }
        if want_probs {
            let probs = tarfa_cpu::router_probs(
                tarfa_core::numerics::Kernel::best(),
                m.spec.router,
                cfg.top_k,
                &logits,
            );
            hook.router_probs(l, &probs);
        }
        Ok(())
    }

    /// The routed experts mixed into the residual (`LayerSteps::experts`' kernels); whether
    /// they left each (token, slot)'s down product in `y_experts`.
    fn experts_mixed(
        &mut self,
        l: usize,
        experts: Option<&DevExperts>,
        moe_index: usize,
        (y_sh, s_sh): (u64, u64),
    ) -> Result<bool, CudaError> {
        let (m, ws, t_count) = (self.model, self.ws, self.shape.tokens);
        let cfg = &m.cfg;
        let (h, i, k) = (cfg.hidden_size, cfg.expert_width, cfg.top_k);
        let route = ws.route_out(moe_index, t_count, k);
        let math = m.expert_math(l);
        // Llama 4: each (token, slot) reads its input times its routing weight
        let xn = if math.input_scaled {
            ops::scale_slots(
                &m.gpu,
                ws.xn.ptr(),
                route.weights,
                h,
                k,
                t_count,
                ws.x_slots.ptr(),
            )?;
            ws.x_slots.ptr()
        } else {
            ws.xn.ptr()
        };
        let Some(experts) = experts else {
            m.stream_moe(l, route, t_count, ws, y_sh, s_sh, math)?;
            return Ok(true);
        };
        // the token-tiled kernels compute the plain SwiGLU experts only
        if t_count >= 2 && math.plain() {
            if let Some(y_ready) = self.experts_grouped(experts, route, (y_sh, s_sh))? {
                return Ok(y_ready);
            }
        }
        ops::gate_up(
            &m.gpu,
            DType::Bf16,
            experts.gate.ptr(),
            experts.up.ptr(),
            i,
            h,
            route.ids,
            k,
            xn,
            ws.act.ptr(),
            t_count,
            math,
        )?;
        ops::down_mix(
            &m.gpu,
            experts.down.ptr(),
            h,
            i,
            route,
            k,
            ws.act.ptr(),
            y_sh,
            s_sh,
            ws.h.ptr(),
            t_count,
            math,
        )?;
        Ok(false)
    }
}

impl OpSteps<'_> {
    /// The routed experts expert-major: the step's (token, slot) pairs grouped by expert on the
    /// device, each expert's gate, up and down rows read once per tile of its pairs, then the
    /// down products mixed per token in ascending expert id (moe_mix: down_mix's sums, in its
    /// order). `None` (nothing launched) when the shapes are not tileable, else whether the
    /// down products are in `y_experts` (`down_tile` ran, not `down_mix`).
    fn experts_grouped(
        &self,
        experts: &DevExperts,
        route: RouteOut,
        (y_sh, s_sh): (u64, u64),
    ) -> Result<Option<bool>, CudaError> {
        let (m, ws, t_count) = (self.model, self.ws, self.shape.tokens);
        let cfg = &m.cfg;
        let (h, i, k, e) = (
            cfg.hidden_size,
            cfg.expert_width,
            cfg.top_k,
            cfg.num_experts,
        );
        let pairs = t_count * k;
        let g = ws.groups();
        let kind = ops::experts_kernels(&m.gpu, pairs, e);
        ops::moe_group(&m.gpu, route.ids, pairs, e, ops::experts_tile(kind), g)?;
        let gu = ops::gate_up_tile(
            &m.gpu,
            DType::Bf16,
            experts.gate.ptr(),
            experts.up.ptr(),
            i,
            h,
            Some((g, e)),
            pairs,
            k,
            ws.xn.ptr(),
            ws.act.ptr(),
            kind,
        )?;
        if !gu {
            return Ok(None);
        }
        let dn = ops::down_tile(
            &m.gpu,
            experts.down.ptr(),
            h,
            i,
            g,
            pairs,
            e,
            ws.act.ptr(),
            ws.y_experts.ptr(),
            kind,
        )?;
        if !dn {
            // gate_up_tile wrote the same activations gate_up would: finish with down_mix
            ops::down_mix(
                &m.gpu,
                experts.down.ptr(),
                h,
                i,
                route,
                k,
                ws.act.ptr(),
                y_sh,
                s_sh,
                ws.h.ptr(),
                t_count,
                ops::ExpertMath::default(),
            )?;
            return Ok(Some(false));
        }
        ops::moe_mix(
            &m.gpu,
            h,
            route,
            k,
            ws.y_experts.ptr(),
            y_sh,
            s_sh,
            ws.h.ptr(),
            t_count,
            ops::ExpertMath::default(),
        )?;
        Ok(Some(true))
    }
}
