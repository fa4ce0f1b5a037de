//! The forward pass itself (docs/EXACTNESS.md section 6). Each function is one step of the
//! contract and states the shapes it works on. `T` is the number of tokens in the step, `H`
//! hidden, `D` head_dim, `Hq`/`Hkv` query/KV heads, `E` experts, `k` top-k, `I` expert width.
//!
//! Parallelism is only ever over independent outputs: matrix rows (in `run_jobs`), attention
//! (token, head) pairs. Per-token elementwise work runs on the calling thread.

use std::collections::{BTreeMap, BTreeSet};

use rayon::prelude::*;

use super::kv_cache::LinearState;
use super::resident::{
    Attention, AttentionWeights, DenseMlp, ExpertBias, LayerMlp, LinearIn, LinearWeights, Matrix,
    MlaQuery, MlaWeights, MoeResident,
};
use super::{
    BatchEntry, BatchError, CpuModel, FinalHidden, ForwardOutput, KvCache, LogitRows, RouterRecord,
    StepStats,
};
use tarfa_core::config::{LinearDims, MlaDims};
use tarfa_core::model::{ExpertActivation, QkNorm, RouterRule};
use tarfa_core::numerics::detmath::{exp, rsqrt, sigmoid, silu, softplus};
use tarfa_core::numerics::matvec::{transpose_rows, Activation};
use tarfa_core::numerics::reduce::{fma_dispatch, weighted_row_sum};
use tarfa_core::numerics::RopeTable;
use tarfa_core::numerics::{bf16_to_f32, f32_to_bf16_rne, run_jobs, Kernel, MatJob, MatrixRef};
use tarfa_core::weights::{Bf16View, ExpertData, ExpertHandle, WeightError};
use tarfa_core::RunError;

/// RMSNorm over `x` with weight `w` (step 2): `ss = dot(x, x)`, `m = ss / f32(n)`,
/// `r = rsqrt(m + eps)`, `y_i = w_i * (x_i * r)`.
pub(crate) fn rms_norm(kernel: Kernel, x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ss = kernel.dot_f32(x, x);
    let m = ss / x.len() as f32;
    let r = rsqrt(m + eps);
    x.iter().zip(w).map(|(&xi, &wi)| wi * (xi * r)).collect()
}

/// Llama 4's L2 norm (RMSNorm without a weight): `ss = dot(x, x)`, `m = ss / f32(n)`,
/// `r = rsqrt(m + eps)`, `y_i = x_i * r`, in place on each `width`-wide segment of `x`.
fn l2_norm_segments(kernel: Kernel, x: &mut [f32], eps: f32, width: usize) {
    for seg in x.chunks_exact_mut(width) {
        let ss = kernel.dot_f32(seg, seg);
        let r = rsqrt(ss / width as f32 + eps);
        for v in seg.iter_mut() {
            *v *= r;
        }
    }
}

/// Llama 4's attention temperature at position `pos` ([`AttnTemperature::scale_at`]).
///
/// [`AttnTemperature::scale_at`]: tarfa_core::config::AttnTemperature::scale_at
pub(crate) fn attn_temperature(t: &tarfa_core::config::AttnTemperature, pos: usize) -> f32 {
    t.scale_at(pos)
}

/// In-place RMSNorm of each `width`-wide segment of `x`.
fn rms_norm_segments(kernel: Kernel, x: &mut [f32], w: &[f32], eps: f32, width: usize) {
    for seg in x.chunks_exact_mut(width) {
        let y = rms_norm(kernel, seg, w, eps);
        seg.copy_from_slice(&y);
    }
}

/// Softmax over `l` (section 2 and step 3): `m = max`, `e_i = exp(l_i - m)`,
/// `S = canonical_sum(e)`, `p_i = e_i / S`.
pub(crate) fn softmax(kernel: Kernel, l: &[f32]) -> Vec<f32> {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = exp_shifted(kernel, l, m);
    let s = kernel.sum(&e);
    e.iter().map(|&x| x / s).collect()
}

fn add_bias(x: &mut [f32], b: &Option<Vec<f32>>) {
    if let Some(b) = b {
        for (xi, &bi) in x.iter_mut().zip(b) {
            *xi += bi;
        }
    }
}

/// Applies `w` to every activation; returns one output vector per activation.
fn apply(kernel: Kernel, w: &Matrix, xs: &[Activation]) -> Vec<Vec<f32>> {
    apply_many(kernel, &[w], xs).pop().unwrap_or_default()
}

/// Applies several matrices to the same activations in one parallel region; returns
/// `[matrix][token] -> vector`.
fn apply_many(kernel: Kernel, ws: &[&Matrix], xs: &[Activation]) -> Vec<Vec<Vec<f32>>> {
    let m = xs.len();
    let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0.0; w.rows * m]).collect();
    let jobs = ws
        .iter()
        .zip(outs.iter_mut())
        .map(|(w, out)| MatJob {
            w: w.as_ref(),
            xs: xs.iter().collect(),
            out,
        })
        .collect();
    run_jobs(kernel, jobs);
    ws.iter()
        .zip(&outs)
        .map(|(w, out)| transpose_rows(out, w.rows, m))
        .collect()
}

// These bodies are plain loops, not `map(..).collect()`: a collect runs in a generic
// `from_iter` compiled without the dispatched function's target features, where the contract's
// fmas (detmath) become calls to libm's `fmaf` (7% of a 2,048-token CPU prefill; the same bits
// either way, `mul_add` is one rounding in both).

fma_dispatch! {
/// `e_i = exp(l_i - m)`.
fn exp_shifted(l: &[f32], m: f32) -> Vec<f32> {
    let mut e = vec![0.0f32; l.len()];
    for (ei, &x) in e.iter_mut().zip(l) {
        *ei = exp(x - m);
    }
    e
}
}

fma_dispatch! {
/// `a_i = silu(g_i) * u_i` (step 4).
fn swiglu(g: &[f32], u: &[f32]) -> Vec<f32> {
    let mut a = vec![0.0f32; g.len().min(u.len())];
    for ((ai, &gi), &ui) in a.iter_mut().zip(g).zip(u) {
        *ai = silu(gi) * ui;
    }
    a
}
}

fma_dispatch! {
/// gpt-oss's clamped SwiGLU (docs/EXACTNESS.md, "gpt-oss"): `g' = min(g, limit)`,
/// `u' = max(min(u, limit), -limit)`, `a_i = (u' + 1) * (g' * sigmoid(g' * alpha))`.
fn clamped_swiglu(g: &[f32], u: &[f32], alpha: f32, limit: f32) -> Vec<f32> {
    let mut a = vec![0.0f32; g.len().min(u.len())];
    for ((ai, &gi), &ui) in a.iter_mut().zip(g).zip(u) {
        let gc = gi.min(limit);
        let uc = ui.min(limit).max(-limit);
        *ai = (uc + 1.0) * (gc * sigmoid(gc * alpha));
    }
    a
}
}

/// The expert activation of `act` on one token's gate and up vectors.
fn expert_activation(kernel: Kernel, act: ExpertActivation, g: &[f32], u: &[f32]) -> Vec<f32> {
    match act {
        ExpertActivation::SwiGlu => swiglu(kernel, g, u),
        ExpertActivation::ClampedSwiGlu { alpha, limit } => {
            clamped_swiglu(kernel, g, u, alpha, limit)
        }
    }
}

/// One sequence's part of a step, as the layers see it: its cache, its tokens, what it wants.
pub(crate) type Entry<'a> = BatchEntry<'a, KvCache>;

/// Where one of the step's tokens comes from: its sequence (index in the step) and position.
#[derive(Clone, Copy)]
struct Slot {
    seq: usize,
    pos: usize,
}

/// Refuses a sequence's input before anything is computed or cached: no tokens, a token
/// outside the vocabulary, a step past the context.
fn check_entry(cfg: &tarfa_core::config::MoeConfig, e: &mut Entry<'_>) -> Result<(), RunError> {
    if e.tokens.is_empty() {
        return Err(RunError::EmptyStep);
    }
    if let Some(&bad) = e.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
        return Err(RunError::TokenOutOfRange {
            token: bad,
            vocab: cfg.vocab_size,
        });
    }
    let end = e.cache.len() + e.tokens.len();
    if end > e.cache.max_len() {
        return Err(RunError::ContextFull {
            needed: end,
            max: e.cache.max_len(),
        });
    }
    e.cache.ensure_rope(end)?;
    Ok(())
}

/// The whole step over several sequences: embeddings, layers, final norm and lm_head, every
/// matrix applied once to the union of the sequences' tokens (in entry order, each sequence's
/// tokens in position order). Attention reads each token's own sequence's cache; every other
/// operation is per token, so no token's arithmetic depends on the others in the step
/// (docs/EXACTNESS.md, "Batching"). `forward` of one sequence is this with one entry.
///
/// On error, pushed keys and values are not committed; the caller rolls every cache back.
/// Shown a step's internals (the Python package's captures and its labelled interventions).
/// Each method's default does nothing. A hook that writes to what it is shown changes the
/// model's function: only a caller's labelled intervention may. The default path passes no
/// hook: one `Option` check per layer, no value or reduction changes.
pub trait StepHook: Send {
    /// The hidden state rows entering `layer` (the step's tokens in entry order); at
    /// `layer == num_layers`, the state after the last layer, before the final norm.
    fn residual(&mut self, _layer: usize, _h: &mut [Vec<f32>]) {}
    /// MoE layer `layer`'s router logits `[T][E]`, before the softmax and the top-k.
    fn router_logits(&mut self, _layer: usize, _logits: &mut [Vec<f32>]) {}
    /// Layer `layer`'s attention output `[T][H]` (`W_o o (+ b_o)`), before the residual add.
    fn attn_out(&mut self, _layer: usize, _y: &mut [Vec<f32>]) {}
    /// Layer `layer`'s MLP block output `[T][H]`, before the residual add: an MoE layer's
    /// routed mix with its shared experts, a dense layer's MLP.
    fn mlp_out(&mut self, _layer: usize, _y: &mut [Vec<f32>]) {}
    /// MoE layer `layer`'s router probabilities `[T][E]` as the rule computes them from the
    /// logits (softmax; sigmoid scores for sigmoid routing, before the correction bias). Shown
    /// only: the routes are computed from the logits, by the same functions.
    fn router_probs(&mut self, _layer: usize, _probs: &[Vec<f32>]) {}
    /// One selected expert's output `[H]` for the step's token `token`, before its weight.
    fn expert_out(&mut self, _layer: usize, _token: usize, _expert: usize, _y: &[f32]) {}
    /// The experts MoE layer `layer` must use for the step's token `token` instead of the
    /// router's top-k (an intervention), or `None` for the router's own choice. Exactly `top_k`
    /// distinct ids, else the step fails with [`RunError::Intervention`]. The forced set is
    /// ranked as the router ranks experts and weighted by the family's own rule over it (see
    /// [`select`]): forcing the router's own choice is the same bits as not forcing.
    fn forced_experts(&mut self, _layer: usize, _token: usize) -> Option<Vec<usize>> {
        None
    }
    /// Polled before each layer's attention and MLP blocks and before the final norm: `true`
    /// stops the step with [`RunError::Interrupted`], no cache committed (Ctrl-C from Python).
    fn interrupted(&mut self) -> bool {
        false
    }
    /// Whether the hook wants to be shown `what` at `layer`. The CPU shows everything whatever
    /// this says (its values are at hand); a backend that must copy a value back to show it
    /// (CUDA) copies only what is wanted. The default wants everything.
    fn wants(&self, _what: Capture, _layer: usize) -> bool {
        true
    }
    /// The intervention this hook makes, by name (`"residual_add(layer=1)"`), or `None` when it
    /// only observes: it changes nothing it is shown, forces no expert, and needs no interrupt
    /// inside a step. A backend that can only show values (CUDA: the hook is handed copies of
    /// device buffers) refuses a hook that answers `Some`, by this name, before any work. The
    /// default is `Some`: a hook that does not say it only observes is not taken to.
    fn intervention(&self) -> Option<String> {
        Some("a step hook that does not say it only observes (StepHook::intervention)".into())
    }
}

/// What a [`StepHook`] can be shown, by its method's name ([`StepHook::wants`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Capture {
    Residual,
    AttnOut,
    MlpOut,
    RouterLogits,
    RouterProbs,
    ExpertOut,
}

pub(crate) fn forward_batch(
    model: &CpuModel,
    kernel: Kernel,
    entries: &mut [Entry<'_>],
    mut hook: Option<&mut dyn StepHook>,
) -> Result<Vec<ForwardOutput>, BatchError<RunError>> {
    let cfg = &model.cfg;
    if entries.is_empty() {
        return Ok(Vec::new());
    }
    for (i, e) in entries.iter_mut().enumerate() {
        check_entry(cfg, e).map_err(|error| BatchError {
            sequence: Some(i),
            error,
        })?;
    }
    let slots: Vec<Slot> = entries
        .iter()
        .enumerate()
        .flat_map(|(seq, e)| {
            let pos0 = e.cache.len();
            (0..e.tokens.len()).map(move |t| Slot { seq, pos: pos0 + t })
        })
        .collect();
    let n_seq = entries.len();
    let w = &model.weights;

    // Each sequence's counters as if it ran alone: what every sequence reads whatever its
    // tokens (each matrix once) is counted in `common`, what depends on its tokens (embedding
    // rows, the experts they chose) in `own`.
    let mut common = StepStats::default();
    let mut own = vec![StepStats::default(); n_seq];
    let mut router: Vec<Vec<RouterRecord>> = vec![Vec::new(); n_seq];
    let trace: Vec<bool> = entries.iter().map(|e| e.opts.trace_router).collect();

    // Step 1, embedding: h_t = widen(embed[token_t]), [T][H]
    let mut h: Vec<Vec<f32>> = entries
        .iter()
        .flat_map(|e| e.tokens.iter().map(|&t| w.embed.row_f32(t as usize)))
        .collect();
    for (s, e) in own.iter_mut().zip(entries.iter()) {
        s.weight_bytes += (e.tokens.len() * cfg.hidden_size) as u64 * element_bytes(&w.embed);
    }

    let counts: Vec<usize> = entries.iter().map(|e| e.tokens.len()).collect();
    let mut caches: Vec<&mut KvCache> = entries.iter_mut().map(|e| &mut *e.cache).collect();
    for (l, layer) in w.layers.iter().enumerate() {
        if let Some(k) = hook.as_mut() {
            if k.interrupted() {
                return Err(BatchError::whole(RunError::Interrupted));
            }
            k.residual(l, &mut h);
        }
        let mut y = attention_block(model, kernel, l, &h, &mut caches, &slots, &mut common);
        if let Some(k) = hook.as_mut() {
            k.attn_out(l, &mut y);
        }
        add_rows(&mut h, &y);
        if let Some(k) = hook.as_mut() {
            if k.interrupted() {
                return Err(BatchError::whole(RunError::Interrupted));
            }
        }
        match &layer.mlp {
            LayerMlp::Dense(mlp) => {
                let xs = normed_activations(kernel, &h, &layer.post_attention_norm, cfg.eps_f32());
                let mut y = dense_mlp(kernel, mlp, &xs, &mut common);
                if let Some(k) = hook.as_mut() {
                    k.mlp_out(l, &mut y);
                }
                add_rows(&mut h, &y);
            }
            LayerMlp::Moe(moe) => {
                let mut step = MoeStep {
                    slots: &slots,
                    trace: &trace,
                    router: &mut router,
                    own: &mut own,
                    common: &mut common,
                    hook: hook.as_deref_mut(),
                };
                moe_block(model, kernel, l, moe, &mut h, &mut step).map_err(BatchError::whole)?;
            }
        }
    }
    if let Some(k) = hook.as_mut() {
        if k.interrupted() {
            return Err(BatchError::whole(RunError::Interrupted));
        }
        k.residual(w.layers.len(), &mut h);
    }
    for (c, &n) in caches.iter_mut().zip(&counts) {
        c.commit(n);
    }

    // Step 5, final: hn = RMSNorm(h), logits = W_lm hn, for each sequence's requested rows,
    // the lm_head applied once to all of them.
    let mut rows: Vec<(usize, usize)> = Vec::new(); // (sequence, index into h)
    let mut first = 0;
    for (seq, (e, &n)) in entries.iter().zip(&counts).enumerate() {
        match e.opts.logits {
            LogitRows::Last => rows.push((seq, first + n - 1)),
            LogitRows::All => rows.extend((first..first + n).map(|t| (seq, t))),
        }
        first += n;
    }
    let hn: Vec<Activation> = rows
        .iter()
        .map(|&(seq, t)| {
            let mut y = rms_norm(kernel, &h[t], &w.final_norm, cfg.eps_f32());
            if entries[seq].opts.final_hidden == FinalHidden::InvalidBf16BeforeLmHead {
                for v in y.iter_mut() {
                    *v = bf16_to_f32(f32_to_bf16_rne(*v));
                }
            }
            Activation::new(kernel, y)
        })
        .collect();
    let logits = apply(kernel, &w.lm_head, &hn);
    common.weight_bytes += w.lm_head.as_ref().bytes();

    let mut outs: Vec<ForwardOutput> = own
        .into_iter()
        .zip(router)
        .map(|(s, router)| ForwardOutput {
            logits: Vec::new(),
            router,
            stats: StepStats {
                weight_bytes: common.weight_bytes + s.weight_bytes,
                experts_fetched: common.experts_fetched + s.experts_fetched,
            },
        })
        .collect();
    for (&(seq, _), row) in rows.iter().zip(logits) {
        outs[seq].logits.push(row);
    }
    Ok(outs)
}

fn element_bytes(m: &Matrix) -> u64 {
    match m.as_ref() {
        MatrixRef::Bf16 { .. } => 2,
        MatrixRef::F32 { .. } => 4,
    }
}

/// `RMSNorm(h_t)` of every token, prepared for the kernels.
fn normed_activations(kernel: Kernel, h: &[Vec<f32>], w: &[f32], eps: f32) -> Vec<Activation> {
    h.iter()
        .map(|ht| Activation::new(kernel, rms_norm(kernel, ht, w, eps)))
        .collect()
}

/// `h_t = h_t + y_t` elementwise.
fn add_rows(h: &mut [Vec<f32>], y: &[Vec<f32>]) {
    for (ht, yt) in h.iter_mut().zip(y) {
        for (a, &b) in ht.iter_mut().zip(yt) {
            *a += b;
        }
    }
}

/// Step 3, attention of layer `l` for the step's tokens (token `t` at `slots[t]`: its sequence
/// and position); appends their keys and values (or latents) to their sequences' caches and
/// returns the output projection `[T][H]`, which the caller adds to `h`. Each token attends to
/// positions `0..=pos` of its own sequence only.
fn attention_block(
    model: &CpuModel,
    kernel: Kernel,
    l: usize,
    h: &[Vec<f32>],
    caches: &mut [&mut KvCache],
    slots: &[Slot],
    stats: &mut StepStats,
) -> Vec<Vec<f32>> {
    match (&model.weights.layers[l].attention, &model.cfg.mla) {
        (Attention::Mla(mw), Some(dims)) => {
            mla_block(model, kernel, l, mw, dims, h, caches, slots, stats)
        }
        (Attention::Gqa(aw), _) => gqa_block(model, kernel, l, aw, h, caches, slots, stats),
        (Attention::Linear(lw), _) => match &model.cfg.linear {
            Some(dims) => linear_block(model, kernel, l, lw, dims, h, caches, slots, stats),
            // ResidentWeights::load builds linear weights exactly when the config has the dims.
            None => unreachable!("linear attention weights without their dimensions"),
        },
        // ResidentWeights::load builds MLA weights exactly when the config has MLA dims.
        (Attention::Mla(_), None) => unreachable!("MLA weights without MLA dimensions"),
    }
}

/// The fixed eps of the gated DeltaNet's q/k L2 norm (transformers' `l2norm(x, eps=1e-6)`,
/// whatever the config's `rms_norm_eps`).
const LINEAR_QK_EPS: f32 = 1e-6;

/// One token's gated DeltaNet inputs after the projections: `qkv` the convolution's channels
/// (`q | k | v`, each head-major), `z` `[Hv*Dv]`, `b` and `a` `[Hv]`.
struct LinearInputs {
    qkv: Vec<f32>,
    z: Vec<f32>,
    b: Vec<f32>,
    a: Vec<f32>,
}

/// The projections of every token into [`LinearInputs`]. Qwen3-Next's fused projections hold,
/// per key head `g`, `q_g | k_g | v_g | z_g` (`Dk, Dk, r*Dv, r*Dv`, `r = Hv / Hk`) and
/// `b_g | a_g` (`r, r`): moved into head-major `q`, `k`, `v`, `z`, `b`, `a` as transformers'
/// `fix_query_key_value_ordering` does (a permutation: no value changes).
fn linear_inputs(
    kernel: Kernel,
    lw: &LinearWeights,
    d: &LinearDims,
    xs: &[Activation],
    stats: &mut StepStats,
) -> Vec<LinearInputs> {
    let (kw, vw, hv) = (d.key_width(), d.value_width(), d.value_heads);
    match &lw.input {
        LinearIn::Separate { qkv, z, b, a } => {
            let mut outs = apply_many(kernel, &[qkv, z, b, a], xs);
            stats.weight_bytes += [qkv, z, b, a]
                .iter()
                .map(|m| m.as_ref().bytes())
                .sum::<u64>();
            let a = outs.pop().unwrap_or_default();
            let b = outs.pop().unwrap_or_default();
            let z = outs.pop().unwrap_or_default();
            let qkv = outs.pop().unwrap_or_default();
            qkv.into_iter()
                .zip(z)
                .zip(b.into_iter().zip(a))
                .map(|((qkv, z), (b, a))| LinearInputs { qkv, z, b, a })
                .collect()
        }
        LinearIn::FusedQkvzBa { qkvz, ba } => {
            let mut outs = apply_many(kernel, &[qkvz, ba], xs);
            stats.weight_bytes += qkvz.as_ref().bytes() + ba.as_ref().bytes();
            let ba = outs.pop().unwrap_or_default();
            let qkvz = outs.pop().unwrap_or_default();
            let (hk, dk) = (d.key_heads, d.key_dim);
            let r = hv / hk;
            let rv = r * d.value_dim;
            qkvz.into_iter()
                .zip(ba)
                .map(|(p, ba)| {
                    let mut qkv = vec![0.0f32; 2 * kw + vw];
                    let mut z = vec![0.0f32; vw];
                    let (mut b, mut a) = (vec![0.0f32; hv], vec![0.0f32; hv]);
                    let group = 2 * dk + 2 * rv;
                    for g in 0..hk {
                        let src = &p[g * group..(g + 1) * group];
                        qkv[g * dk..(g + 1) * dk].copy_from_slice(&src[..dk]);
                        qkv[kw + g * dk..kw + (g + 1) * dk].copy_from_slice(&src[dk..2 * dk]);
                        qkv[2 * kw + g * rv..2 * kw + (g + 1) * rv]
                            .copy_from_slice(&src[2 * dk..2 * dk + rv]);
                        z[g * rv..(g + 1) * rv].copy_from_slice(&src[2 * dk + rv..]);
                        b[g * r..(g + 1) * r].copy_from_slice(&ba[2 * g * r..(2 * g + 1) * r]);
                        a[g * r..(g + 1) * r]
                            .copy_from_slice(&ba[(2 * g + 1) * r..(2 * g + 2) * r]);
                    }
                    LinearInputs { qkv, z, b, a }
                })
                .collect()
        }
    }
}

/// A gated DeltaNet layer (docs/EXACTNESS.md, "Gated DeltaNet") for the step's tokens: the
/// projections as matrices over all tokens, then each sequence's tokens in position order
/// through its convolution and recurrence, from the state its cache holds. The state after the
/// step is staged in the cache (committed with the step). Returns `out_proj` of the gated norm's
/// output `[T][H]`.
///
/// One canonical form, the recurrent one, for prefill and decode alike: a token's state update
/// and outputs are the same operations whether it comes alone or in a prompt of many, so
/// prefill equals decode bit for bit. The parallelism is over value heads, never along a
/// reduction.
#[allow(clippy::too_many_arguments)]
fn linear_block(
    model: &CpuModel,
    kernel: Kernel,
    l: usize,
    lw: &LinearWeights,
    d: &LinearDims,
    h: &[Vec<f32>],
    caches: &mut [&mut KvCache],
    slots: &[Slot],
    stats: &mut StepStats,
) -> Vec<Vec<f32>> {
    let cfg = &model.cfg;
    let eps = cfg.eps_f32();
    let xs = normed_activations(kernel, h, &model.weights.layers[l].input_norm, eps);
    let inputs = linear_inputs(kernel, lw, d, &xs, stats);
    let (kw, dk, dv, hv) = (d.key_width(), d.key_dim, d.value_dim, d.value_heads);
    let (c, taps) = (d.conv_channels(), d.conv_kernel);
    let r = hv / d.key_heads;
    // scale = f32(1 / sqrt(Dk)), as torch multiplies an f32 tensor by the Python float
    let scale = (1.0f64 / (dk as f64).sqrt()) as f32;
    let mut o_all: Vec<Vec<f32>> = vec![Vec::new(); h.len()];

    let mut t = 0;
    while t < h.len() {
        let seq = slots[t].seq;
        let end = t + slots[t..].iter().take_while(|s| s.seq == seq).count();
        let cache = &mut *caches[seq];
        let mut st: LinearState = cache
            .linear_state(l)
            .cloned()
            .expect("a linear layer's cache carries its state");
        for (tok, inp) in (t..end).zip(&inputs[t..end]) {
            // the causal depthwise convolution over the last K inputs (oldest first), then
            // silu: y_c = silu(((w_c0 x_c0 + w_c1 x_c1) + ...) + w_c(K-1) x_c(K-1)), no fma
            let mut x = vec![0.0f32; c];
            for (ch, xc) in x.iter_mut().enumerate() {
                let w = &lw.conv[ch * taps..(ch + 1) * taps];
                let mut acc = w[0] * if taps == 1 { inp.qkv[ch] } else { st.conv[ch] };
                for (j, &wj) in w.iter().enumerate().skip(1) {
                    let xj = if j + 1 == taps {
                        inp.qkv[ch]
                    } else {
                        st.conv[j * c + ch]
                    };
                    acc += wj * xj;
                }
                *xc = silu(acc);
            }
            // the state keeps the last K - 1 inputs (before the convolution)
            if taps > 1 {
                st.conv.copy_within(c.., 0);
                let last = (taps - 2) * c;
                st.conv[last..].copy_from_slice(&inp.qkv);
            }
            // q, k: the L2 norm of each key head (x * rsqrt(dot(x, x) + 1e-6)), q then scaled
            let (q, rest) = x.split_at_mut(kw);
            let (k, v) = rest.split_at_mut(kw);
            for head in q.chunks_exact_mut(dk).chain(k.chunks_exact_mut(dk)) {
                let inv = rsqrt(kernel.dot_f32(head, head) + LINEAR_QK_EPS);
                for x in head.iter_mut() {
                    *x *= inv;
                }
            }
            for x in q.iter_mut() {
                *x *= scale;
            }
            let (q, k, v) = (&*q, &*k, &*v);
            // the recurrence per value head h (key head h / r): row j of the state is column j
            // of transformers' [Dk, Dv] state: S_j = S_j * decay; kv = dot(S_j, k);
            // delta = (v_j - kv) * beta; S_j = S_j + k * delta (mul, then add); o_j = dot(S_j, q)
            let mut o = vec![0.0f32; hv * dv];
            st.state
                .par_chunks_mut(dv * dk)
                .zip(o.par_chunks_mut(dv))
                .enumerate()
                .for_each(|(hh, (s, oh))| {
                    let kh = hh / r;
                    let (qh, khv) = (&q[kh * dk..(kh + 1) * dk], &k[kh * dk..(kh + 1) * dk]);
                    let beta = sigmoid(inp.b[hh]);
                    let g = -exp(lw.a_log[hh]) * softplus(inp.a[hh] + lw.dt_bias[hh]);
                    let decay = exp(g);
                    for (j, (row, oj)) in s.chunks_exact_mut(dk).zip(oh.iter_mut()).enumerate() {
                        for x in row.iter_mut() {
                            *x *= decay;
                        }
                        let kv = kernel.dot_f32(row, khv);
                        let delta = (v[hh * dv + j] - kv) * beta;
                        for (x, &ki) in row.iter_mut().zip(khv) {
                            *x += ki * delta;
                        }
                        *oj = kernel.dot_f32(row, qh);
                    }
                });
            // the gated RMSNorm of each value head: (w * (o * rsqrt(mean(o^2) + eps))) * silu(z)
            for (oh, zh) in o.chunks_exact_mut(dv).zip(inp.z.chunks_exact(dv)) {
                let y = rms_norm(kernel, oh, &lw.norm, eps);
                for ((x, yi), &zi) in oh.iter_mut().zip(y).zip(zh) {
                    *x = yi * silu(zi);
                }
            }
            o_all[tok] = o;
        }
        cache.stage_linear(l, st);
        t = end;
    }

    let os: Vec<Activation> = o_all
        .into_iter()
        .map(|o| Activation::new(kernel, o))
        .collect();
    stats.weight_bytes += lw.out.as_ref().bytes();
    apply(kernel, &lw.out, &os)
}

/// Grouped-query attention (section 6, step 3).
#[allow(clippy::too_many_arguments)]
fn gqa_block(
    model: &CpuModel,
    kernel: Kernel,
    l: usize,
    aw: &AttentionWeights,
    h: &[Vec<f32>],
    caches: &mut [&mut KvCache],
    slots: &[Slot],
    stats: &mut StepStats,
) -> Vec<Vec<f32>> {
    let cfg = &model.cfg;
    let eps = cfg.eps_f32();
    let (hq, hkv, d) = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);

    // xn_t = RMSNorm(h_t); q_t [Hq*D], k_t, v_t [Hkv*D] (each row a canonical dot, then + bias)
    let xs = normed_activations(kernel, h, &model.weights.layers[l].input_norm, eps);
    let pairs = model.spec.extras.llama4_attention;
    let mut qkv = apply_many(kernel, &[&aw.q, &aw.k, &aw.v], &xs);
    stats.weight_bytes += aw.q.as_ref().bytes() + aw.k.as_ref().bytes() + aw.v.as_ref().bytes();
    let mut v_all = qkv.pop().unwrap_or_default();
    let mut k_all = qkv.pop().unwrap_or_default();
    let mut q_all = qkv.pop().unwrap_or_default();
    // gated attention (Qwen3-Next, Qwen3.5): each head's 2 D outputs are its query, then its
    // output gate
    let gates: Option<Vec<Vec<f32>>> = model.spec.extras.gated_attention.then(|| {
        q_all
            .iter_mut()
            .map(|qg| {
                let (mut q, mut g) = (Vec::with_capacity(hq * d), Vec::with_capacity(hq * d));
                for head in qg.chunks_exact(2 * d) {
                    q.extend_from_slice(&head[..d]);
                    g.extend_from_slice(&head[d..]);
                }
                *qg = q;
                g
            })
            .collect()
    });

    for t in 0..h.len() {
        let (q, k, v) = (&mut q_all[t], &mut k_all[t], &mut v_all[t]);
        add_bias(q, &aw.q_bias);
        add_bias(k, &aw.k_bias);
        add_bias(v, &aw.v_bias);
        // q/k norm: per head over D (Qwen3) or over the whole projection (OLMoE)
        match (model.spec.qk_norm, &aw.q_norm, &aw.k_norm) {
            (QkNorm::PerHead, Some(qn), Some(kn)) => {
                rms_norm_segments(kernel, q, qn, eps, d);
                rms_norm_segments(kernel, k, kn, eps, d);
            }
            (QkNorm::WholeProjection, Some(qn), Some(kn)) => {
                rms_norm_segments(kernel, q, qn, eps, hq * d);
                rms_norm_segments(kernel, k, kn, eps, hkv * d);
            }
            _ => {}
        }
        // OLMoE's clip_qkv: each of q, k, v clamped to [-c, c] AFTER the q/k norm (transformers'
        // OlmoeAttention: q_norm(q_proj(x)) and k_norm(k_proj(x)), then clamp_ on all three;
        // fixtures/oracle/olmoe-clip-s fails with the clamp before the norm)
        if let Some(c) = cfg.clip_qkv {
            let c = c as f32;
            for x in q.iter_mut().chain(k.iter_mut()).chain(v.iter_mut()) {
                *x = x.min(c).max(-c);
            }
        }
        // RoPE at the token's position, on every head's leading rotary_dim values (all D
        // unless partial_rotary_factor; the rest pass through unchanged); Llama 4 rotates
        // pairs (its complex form), and not at all on its NoPE layers
        let Slot { seq, pos } = slots[t];
        let cache = &mut *caches[seq];
        let rd = cfg.rotary_dim;
        let rotates = cfg.layer_rope[l];
        if rotates {
            for head in q.chunks_exact_mut(d).chain(k.chunks_exact_mut(d)) {
                if pairs {
                    cache.rope.apply_pairs(pos, &mut head[..rd]);
                } else {
                    cache.rope.apply(pos, &mut head[..rd]);
                }
            }
        }
        // Llama 4: the weightless L2 norm of each head after the rotation, rotating layers
        // only; the NoPE layers' queries scaled by the attention temperature
        if rotates && model.spec.qk_norm == QkNorm::L2AfterRope {
            l2_norm_segments(kernel, q, eps, d);
            l2_norm_segments(kernel, k, eps, d);
        }
        if let (false, Some(temp)) = (rotates, &cfg.attn_temperature) {
            let s = attn_temperature(temp, pos);
            for x in q.iter_mut() {
                *x *= s;
            }
        }
        for kh in 0..hkv {
            cache.push(l, kh, &k[kh * d..(kh + 1) * d], &v[kh * d..(kh + 1) * d]);
        }
    }

    // scale = round_f32(1 / sqrt(D)) computed in f64
    let scale = (1.0f64 / (d as f64).sqrt()) as f32;
    let group = hq / hkv;
    let t_count = h.len();
    let mut o_all = vec![0.0f32; t_count * hq * d];
    let cache_refs: Vec<&KvCache> = caches.iter().map(|c| &**c).collect();
    let window = cfg.layer_windows.get(l).copied().flatten();
    let chunk = cfg.layer_chunks.get(l).copied().flatten();
    let sinks = aw.sinks.as_deref();
    // one task per (token, query head): independent outputs
    o_all
        .par_chunks_mut(d)
        .enumerate()
        .for_each_init(Vec::new, |scratch, (i, o)| {
            let (t, qh) = (i / hq, i % hq);
            let q = &q_all[t][qh * d..(qh + 1) * d];
            let Slot { seq, pos } = slots[t];
            let (keys, values, base) = cache_refs[seq].head(l, qh / group);
            // causal: positions 0..=pos of the token's own sequence; a sliding layer keeps
            // the last w of them (transformers' mask: key j is seen when pos - j < w); a
            // chunked layer (Llama 4) those of pos's chunk (j / C == pos / C). The cache holds
            // positions base.. of such a layer (kv_cache.rs: never one that is read)
            let n = pos + 1;
            let start = window.map_or(0, |w| n.saturating_sub(w));
            let start = chunk.map_or(start, |c| start.max(pos / c * c));
            assert!(
                start >= base,
                "layer {l}: position {start} was dropped from the cache"
            );
            let (keys, values) = (&keys[..(n - base) * d], &values[..(n - base) * d]);
            // s_j = dot(q, k_j) * scale, the query loaded once for all its keys
            let mut s = vec![0.0f32; n - start];
            kernel.dot_f32_rows(q, &keys[(start - base) * d..(n - base) * d], &mut s);
            for sj in s.iter_mut() {
                *sj *= scale;
            }
            // gpt-oss's sink: one more logit in the softmax, after the keys; its probability
            // is dropped (the weights then sum to less than 1)
            if let Some(sk) = sinks {
                s.push(sk[qh]);
            }
            let mut p = softmax(kernel, &s);
            p.truncate(n - start);
            weighted_row_sum(kernel, &p, &values[(start - base) * d..], o, scratch);
        });

    // gated attention: o = o * sigmoid(gate), elementwise
    if let Some(gates) = &gates {
        for (o, g) in o_all.chunks_exact_mut(hq * d).zip(gates) {
            for (x, &gi) in o.iter_mut().zip(g) {
                *x *= sigmoid(gi);
            }
        }
    }
    // h_t = h_t + (W_o o_t (+ b_o))
    let os: Vec<Activation> = o_all
        .chunks_exact(hq * d)
        .map(|o| Activation::new(kernel, o.to_vec()))
        .collect();
    let mut y = apply(kernel, &aw.o, &os);
    stats.weight_bytes += aw.o.as_ref().bytes();
    for yt in y.iter_mut() {
        add_bias(yt, &aw.o_bias);
    }
    y
}

/// `q_a_layernorm` and `kv_a_layernorm` are built as `RMSNorm(width)` with the class default
/// eps 1e-6, not the config's `rms_norm_eps` (transformers' DeepseekV2/V3 attention).
const MLA_NORM_EPS: f32 = 1e-6;

/// RoPE on a head's rope part `x` (length dr) at `pos`: de-interleaved first when the model
/// reads it as pairs (`x'_i = x_2i`, `x'_(dr/2+i) = x_(2i+1)`), then the rotate-half rotation.
/// The result stays de-interleaved, for queries and keys alike.
fn rope_part(rope: &RopeTable, pos: usize, x: &mut [f32], interleave: bool) {
    if interleave {
        let half = x.len() / 2;
        let pairs: Vec<f32> = x.to_vec();
        for i in 0..half {
            x[i] = pairs[2 * i];
            x[half + i] = pairs[2 * i + 1];
        }
    }
    rope.apply(pos, x);
}

/// `rows` of `m` from `r0` widened to f32, into `out` (exact: BF16 widens exactly).
fn widen_rows(m: MatrixRef<'_>, r0: usize, n: usize, out: &mut Vec<f32>) {
    out.clear();
    match m {
        MatrixRef::Bf16 { cols, data, .. } => out.extend(
            data[r0 * cols..(r0 + n) * cols]
                .iter()
                .map(|&b| bf16_to_f32(b)),
        ),
        MatrixRef::F32 { cols, data, .. } => {
            out.extend_from_slice(&data[r0 * cols..(r0 + n) * cols])
        }
    }
}

/// Multi-head latent attention (docs/EXACTNESS.md, "Multi-head latent attention"), in the
/// absorbed form. r = kv_lora_rank, dn/dr/dv = the nope, rope and value head widths.
/// - q: `q_t = W_q xn_t`, or `W_qb RMSNorm(W_qa xn_t)`; per head `[q_nope (dn) | q_rope (dr)]`,
///   `q_rope` rotated at the token's position.
/// - The cache: per token `L_t = [RMSNorm(c_t) (r) | rope(k_rope_t) (dr)]` from
///   `W_kva xn_t = [c_t | k_rope_t]`, stored as it is: one row of r+dr per token and layer.
/// - Per head h: `q_abs = weighted_row_sum(q_nope, W_kb_h)` (the head's dn rows of `kv_b_proj`,
///   widened), `qc = [q_abs | q_rope]`; `s_j = dot(qc, L_j) * scale`; `p = softmax(s)`;
///   `u = weighted_row_sum(p, L)[..r]`; `o_h = W_vb_h u` (the head's dv rows, canonical dots).
/// - the output `W_o [o_1 .. o_Hq]`, which the caller adds to `h_t`.
#[allow(clippy::too_many_arguments)]
fn mla_block(
    model: &CpuModel,
    kernel: Kernel,
    l: usize,
    mw: &MlaWeights,
    m: &MlaDims,
    h: &[Vec<f32>],
    caches: &mut [&mut KvCache],
    slots: &[Slot],
    stats: &mut StepStats,
) -> Vec<Vec<f32>> {
    let cfg = &model.cfg;
    let hq = cfg.num_heads;
    let (dn, dr, dv, r) = (
        m.qk_nope_head_dim,
        m.qk_rope_head_dim,
        m.v_head_dim,
        m.kv_lora_rank,
    );
    let (dq, w) = (dn + dr, r + dr);
    let xs = normed_activations(
        kernel,
        h,
        &model.weights.layers[l].input_norm,
        cfg.eps_f32(),
    );
    // q [T][Hq*dq] and the kv_a output [T][r+dr]: the first projections share one region
    let (mut q_all, kva) = match &mw.q {
        MlaQuery::Plain(wq) => {
            let mut o = apply_many(kernel, &[wq, &mw.kv_a], &xs);
            stats.weight_bytes += wq.as_ref().bytes();
            let kva = o.pop().unwrap_or_default();
            (o.pop().unwrap_or_default(), kva)
        }
        MlaQuery::LoRa { a, norm, b } => {
            let mut o = apply_many(kernel, &[a, &mw.kv_a], &xs);
            let kva = o.pop().unwrap_or_default();
            let qa: Vec<Activation> = o
                .pop()
                .unwrap_or_default()
                .iter()
                .map(|x| Activation::new(kernel, rms_norm(kernel, x, norm, MLA_NORM_EPS)))
                .collect();
            stats.weight_bytes += a.as_ref().bytes() + b.as_ref().bytes();
            (apply(kernel, b, &qa), kva)
        }
    };
    stats.weight_bytes += mw.kv_a.as_ref().bytes();

    for (t, kv) in kva.iter().enumerate() {
        let Slot { seq, pos } = slots[t];
        let cache = &mut *caches[seq];
        let mut latent = rms_norm(kernel, &kv[..r], &mw.kv_a_norm, MLA_NORM_EPS);
        let mut k_rope = kv[r..].to_vec();
        rope_part(&cache.rope, pos, &mut k_rope, m.rope_interleave);
        latent.extend_from_slice(&k_rope);
        cache.push(l, 0, &latent, &[]);
        for head in q_all[t].chunks_exact_mut(dq) {
            rope_part(&cache.rope, pos, &mut head[dn..], m.rope_interleave);
        }
    }

    let scale = cfg
        .mla_softmax_scale()
        .expect("an MLA config has an MLA softmax scale");
    let kv_b = mw.kv_b.as_ref();
    stats.weight_bytes += kv_b.bytes();
    let t_count = h.len();
    let mut o_all = vec![0.0f32; t_count * hq * dv];
    let cache_refs: Vec<&KvCache> = caches.iter().map(|c| &**c).collect();
    // one task per (token, head): independent outputs
    o_all.par_chunks_mut(dv).enumerate().for_each_init(
        || (Vec::new(), Vec::new(), vec![0.0f32; w], vec![0.0f32; w]),
        |(scratch, rows, qc, u), (i, o)| {
            let (t, head) = (i / hq, i % hq);
            let q = &q_all[t][head * dq..(head + 1) * dq];
            let row0 = head * (dn + dv);
            widen_rows(kv_b, row0, dn, rows);
            weighted_row_sum(kernel, &q[..dn], rows, &mut qc[..r], scratch);
            qc[r..].copy_from_slice(&q[dn..]);
            let Slot { seq, pos } = slots[t];
            // no MLA family has windows or chunks: every position is held
            let (latents, _, _) = cache_refs[seq].head(l, 0);
            let n = pos + 1; // causal: positions 0..=pos of the token's own sequence
            let s: Vec<f32> = (0..n)
                .map(|j| kernel.dot_f32(qc, &latents[j * w..(j + 1) * w]) * scale)
                .collect();
            let p = softmax(kernel, &s);
            weighted_row_sum(kernel, &p, &latents[..n * w], u, scratch);
            let attended = Activation::new(kernel, u[..r].to_vec());
            kv_b.rows_dot(kernel, row0 + dn, &attended, o);
        },
    );

    let os: Vec<Activation> = o_all
        .chunks_exact(hq * dv)
        .map(|o| Activation::new(kernel, o.to_vec()))
        .collect();
    let y = apply(kernel, &mw.o, &os);
    stats.weight_bytes += mw.o.as_ref().bytes();
    y
}

/// Dense SwiGLU MLP: `W_down(silu(W_gate x) * W_up x)` for every activation.
fn dense_mlp(
    kernel: Kernel,
    mlp: &DenseMlp,
    xs: &[Activation],
    stats: &mut StepStats,
) -> Vec<Vec<f32>> {
    let mut gu = apply_many(kernel, &[&mlp.gate, &mlp.up], xs);
    let u = gu.pop().unwrap_or_default();
    let g = gu.pop().unwrap_or_default();
    let a: Vec<Activation> = g
        .iter()
        .zip(&u)
        .map(|(g, u)| Activation::new(kernel, swiglu(kernel, g, u)))
        .collect();
    stats.weight_bytes +=
        mlp.gate.as_ref().bytes() + mlp.up.as_ref().bytes() + mlp.down.as_ref().bytes();
    apply(kernel, &mlp.down, &a)
}

/// The router's choice for one token (section 2).
struct Route {
    /// (expert, probability, weight) in selection order.
    chosen: Vec<(usize, f32, f32)>,
    kth: f32,
    next: Option<f32>,
}

/// The experts a route takes, ranked by `rank` (descending, lower id first among equals, a
/// total order): the first `k`, or, when `forced` (an intervention), exactly the forced experts
/// in that same ranking, whatever order they were given in. Returns them in selection order
/// and the best-ranked expert left out (the route's `next`).
///
/// Because the forced set is put in the router's own order, and the weights are then computed
/// over it by the same expressions in the same order, forcing the router's own top-k is the
/// same bits as not forcing.
fn select(rank: &[f32], k: usize, forced: Option<&[usize]>) -> (Vec<usize>, Option<usize>) {
    let mut order: Vec<usize> = (0..rank.len()).collect();
    order.sort_by(|&a, &b| rank[b].total_cmp(&rank[a]).then(a.cmp(&b)));
    match forced {
        None => (order[..k].to_vec(), order.get(k).copied()),
        Some(f) => {
            let (selected, rest): (Vec<usize>, Vec<usize>) =
                order.iter().partition(|e| f.contains(e));
            (selected, rest.first().copied())
        }
    }
}

/// Softmax over all experts, top-k (ties to the lower id), optional renormalisation.
fn route(
    kernel: Kernel,
    logits: &[f32],
    k: usize,
    renormalize: bool,
    forced: Option<&[usize]>,
) -> Route {
    let p = softmax(kernel, logits);
    // descending probability, lower index first among equals (a stable, total order)
    let (selected, next) = select(&p, k, forced);
    let probs: Vec<f32> = selected.iter().map(|&e| p[e]).collect();
    let weights = if renormalize {
        let s = kernel.sum(&probs);
        probs.iter().map(|&x| x / s).collect()
    } else {
        probs.clone()
    };
    Route {
        chosen: selected
            .iter()
            .zip(probs.iter().zip(&weights))
            .map(|(&e, (&pr, &w))| (e, pr, w))
            .collect(),
        kth: p[selected[selected.len() - 1]],
        next: next.map(|e| p[e]),
    }
}

/// Group-limited sigmoid routing (docs/EXACTNESS.md, "Sigmoid group-limited routing"), as
/// transformers' DeepSeek-V3 / GLM-4.5 `route_tokens_to_experts`:
/// - `s_e = sigmoid(logit_e)`; `c_e = s_e + bias_e` (chooses only);
/// - group `g` (experts `g*G..(g+1)*G`, `G = E / n_group`) scores `a + b`, its two largest `c`
///   (`a >= b`);
/// - the `topk_group` best groups are kept (descending score, lower group first among equals);
/// - every expert outside them competes with `c = 0.0` (transformers' `masked_fill(.., 0.0)`,
///   kept as written: a kept expert with a negative `c` loses to a masked one);
/// - the top-k by `c` (descending, lower id first among equals);
/// - weights `w_e = s_e`, when renormalising `w_e = s_e / (canonical_sum(s) + 1e-20)` over the
///   selection in selection order, then `w_e = w_e * f32(routed_scaling_factor)`.
///
/// The record's `probs` are the unbiased `s_e`; `kth_prob` and `next_prob` are the choice
/// scores `c` of the k-th and (k+1)-th experts, the margin the choice was made by.
fn route_sigmoid_grouped(
    kernel: Kernel,
    logits: &[f32],
    bias: &[f32],
    g: &tarfa_core::config::GroupRouting,
    k: usize,
    renormalize: bool,
    forced: Option<&[usize]>,
) -> Route {
    let s: Vec<f32> = logits.iter().map(|&x| sigmoid(x)).collect();
    let c: Vec<f32> = s.iter().zip(bias).map(|(&x, &b)| x + b).collect();
    let size = c.len() / g.n_group;
    let desc = |v: &[f32], a: usize, b: usize| v[b].total_cmp(&v[a]).then(a.cmp(&b));
    let group_scores: Vec<f32> = c
        .chunks_exact(size)
        .map(|grp| {
            let mut idx: Vec<usize> = (0..grp.len()).collect();
            idx.sort_by(|&a, &b| desc(grp, a, b));
            grp[idx[0]] + grp[idx[1]]
        })
        .collect();
    let mut groups: Vec<usize> = (0..g.n_group).collect();
    groups.sort_by(|&a, &b| desc(&group_scores, a, b));
    let mut kept = vec![false; g.n_group];
    for &grp in &groups[..g.topk_group] {
        kept[grp] = true;
    }
    let choice: Vec<f32> = c
        .iter()
        .enumerate()
        .map(|(e, &x)| if kept[e / size] { x } else { 0.0 })
        .collect();
    let (selected, next) = select(&choice, k, forced);
    let probs: Vec<f32> = selected.iter().map(|&e| s[e]).collect();
    let scale = g.routed_scaling_factor as f32;
    let weights: Vec<f32> = if renormalize {
        let denom = kernel.sum(&probs) + 1e-20f32;
        probs.iter().map(|&x| (x / denom) * scale).collect()
    } else {
        probs.iter().map(|&x| x * scale).collect()
    };
    Route {
        chosen: selected
            .iter()
            .zip(probs.iter().zip(&weights))
            .map(|(&e, (&pr, &w))| (e, pr, w))
            .collect(),
        kth: choice[selected[selected.len() - 1]],
        next: next.map(|e| choice[e]),
    }
}

/// DeepSeek-V2's routing (docs/EXACTNESS.md, "Softmax group-limited routing"), as
/// transformers' `DeepseekV2Moe.route_tokens_to_experts`:
/// - `p = softmax(logits)`;
/// - group `g` (experts `g*G..(g+1)*G`, `G = E / n_group`) scores its largest `p`; the
///   `topk_group` best groups are kept (descending score, lower group first among equals);
///   `greedy` is one group holding every expert;
/// - every expert outside them competes with `0.0` (transformers' `masked_fill(.., 0.0)`);
/// - the top-k (descending, lower id first among equals);
/// - weights `w_e = p_e * f32(routed_scaling_factor)`, never renormalised.
fn route_softmax_grouped(
    kernel: Kernel,
    logits: &[f32],
    g: &tarfa_core::config::GroupRouting,
    k: usize,
    forced: Option<&[usize]>,
) -> Route {
    let p = softmax(kernel, logits);
    let size = p.len() / g.n_group;
    let desc = |v: &[f32], a: usize, b: usize| v[b].total_cmp(&v[a]).then(a.cmp(&b));
    let group_scores: Vec<f32> = p
        .chunks_exact(size)
        .map(|grp| grp.iter().copied().fold(f32::NEG_INFINITY, f32::max))
        .collect();
    let mut groups: Vec<usize> = (0..g.n_group).collect();
    groups.sort_by(|&a, &b| desc(&group_scores, a, b));
    let mut kept = vec![false; g.n_group];
    for &grp in &groups[..g.topk_group] {
        kept[grp] = true;
    }
    let choice: Vec<f32> = p
        .iter()
        .enumerate()
        .map(|(e, &x)| if kept[e / size] { x } else { 0.0 })
        .collect();
    let (selected, next) = select(&choice, k, forced);
    let scale = g.routed_scaling_factor as f32;
    Route {
        chosen: selected.iter().map(|&e| (e, p[e], p[e] * scale)).collect(),
        kth: choice[selected[selected.len() - 1]],
        next: next.map(|e| choice[e]),
    }
}

/// gpt-oss's routing (docs/EXACTNESS.md, "gpt-oss"), as transformers' `GptOssTopKRouter`:
/// the top-k of the logits (descending, lower id first among equals), then the softmax over
/// those k logits only, in selection order. The record's `probs` are those weights;
/// `kth_prob` and `next_prob` are the k-th and (k+1)-th logits, the margin of the choice.
fn route_topk_then_softmax(
    kernel: Kernel,
    logits: &[f32],
    k: usize,
    forced: Option<&[usize]>,
) -> Route {
    let (selected, next) = select(logits, k, forced);
    let chosen: Vec<f32> = selected.iter().map(|&e| logits[e]).collect();
    let w = softmax(kernel, &chosen);
    Route {
        chosen: selected.iter().zip(&w).map(|(&e, &w)| (e, w, w)).collect(),
        kth: logits[selected[selected.len() - 1]],
        next: next.map(|e| logits[e]),
    }
}

/// Llama 4's routing (docs/EXACTNESS.md, "Llama 4"), as transformers' `Llama4Router`: the
/// top-k of the logits (descending, lower id first among equals); each chosen expert's score
/// is `sigmoid(logit)`, which scales that expert's input (see [`expert_products`]), so it is
/// both the record's probability and weight; `kth_prob` and `next_prob` are the k-th and
/// (k+1)-th logits, the margin of the choice.
fn route_sigmoid_scales_input(logits: &[f32], k: usize, forced: Option<&[usize]>) -> Route {
    let (selected, next) = select(logits, k, forced);
    Route {
        chosen: selected
            .iter()
            .map(|&e| {
                let s = sigmoid(logits[e]);
                (e, s, s)
            })
            .collect(),
        kth: logits[selected[selected.len() - 1]],
        next: next.map(|e| logits[e]),
    }
}

/// A hook's forced experts for token `t` of layer `l`: exactly `k` distinct ids of the `n`
/// experts (a route of another size would change the family's weighting rule).
fn check_forced(f: &[usize], l: usize, t: usize, k: usize, n: usize) -> Result<(), RunError> {
    let mut distinct = f.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    let problem = if let Some(bad) = f.iter().find(|&&e| e >= n) {
        format!(
            "expert {bad} is not an expert of this model (0 to {})",
            n - 1
        )
    } else if distinct.len() != f.len() {
        format!("the forced experts {f:?} repeat an expert")
    } else if f.len() != k {
        format!("{} experts forced, the router selects {k}", f.len())
    } else {
        return Ok(());
    };
    Err(RunError::Intervention(format!(
        "layer {l}, token {t}: {problem}"
    )))
}

fn check_expert(
    e: &dyn ExpertData,
    layer: usize,
    expert: usize,
    h: usize,
    i: usize,
) -> Result<(), WeightError> {
    let [gate, up, down] = e.matrices();
    for (m, rows, cols, what) in [(gate, i, h, "gate"), (up, i, h, "up"), (down, h, i, "down")] {
        if m.rows != rows || m.cols != cols || m.data.len() != rows * cols {
            return Err(WeightError::ShapeMismatch {
                name: format!("layer {layer} expert {expert} {what}"),
                expected: vec![rows, cols],
                found: vec![m.rows, m.cols],
            });
        }
    }
    Ok(())
}

/// The source's grouping must be a partition of `ids`: a source that drops or repeats an expert
/// would silently change the mix, so that is an error, not a hint to follow.
fn check_batches(batches: &[Vec<usize>], ids: &[usize]) -> Result<(), RunError> {
    let mut seen: Vec<usize> = batches.iter().flatten().copied().collect();
    seen.sort_unstable();
    if seen != ids || batches.iter().any(|b| b.is_empty()) {
        return Err(RunError::SourceContract(format!(
            "expert_batches() grouped {:?} as {batches:?}",
            ids
        )));
    }
    Ok(())
}

/// The router probabilities [`StepHook::router_probs`] shows, `[T][E]`, from a MoE layer's
/// router logits by its rule: the softmax (softmax routers), the sigmoid scores before the
/// correction bias (sigmoid routers), transformers' `router_scores` (gpt-oss: the chosen
/// experts' weights, Llama 4: the chosen logits' sigmoids, 0 elsewhere). Shown only: the
/// routes are computed from the logits by the route functions. Public so that a backend which
/// computes the routes on a device (tarfa-cuda) shows the same bits from the same logits.
pub fn router_probs(
    kernel: Kernel,
    rule: RouterRule,
    top_k: usize,
    logits: &[Vec<f32>],
) -> Vec<Vec<f32>> {
    logits
        .iter()
        .map(|lg| match rule {
            RouterRule::SigmoidGroupLimited => lg.iter().map(|&x| sigmoid(x)).collect(),
            RouterRule::SoftmaxTopK | RouterRule::SoftmaxGroupLimited => softmax(kernel, lg),
            // transformers' router_scores: the chosen experts' weights, 0 elsewhere
            RouterRule::TopKThenSoftmax => {
                let r = route_topk_then_softmax(kernel, lg, top_k, None);
                let mut p = vec![0.0f32; lg.len()];
                for &(e, _, w) in &r.chosen {
                    p[e] = w;
                }
                p
            }
            // Llama 4's router_scores: sigmoid of the chosen logits, 0 elsewhere
            RouterRule::SigmoidScalesInput => {
                let r = route_sigmoid_scales_input(lg, top_k, None);
                let mut p = vec![0.0f32; lg.len()];
                for &(e, s, _) in &r.chosen {
                    p[e] = s;
                }
                p
            }
        })
        .collect()
}

/// The step's side of a MoE layer: where each token comes from, which sequences want router
/// records (and theirs), and the counters (see [`forward_batch`]).
struct MoeStep<'s, 'h> {
    slots: &'s [Slot],
    trace: &'s [bool],
    router: &'s mut [Vec<RouterRecord>],
    own: &'s mut [StepStats],
    common: &'s mut StepStats,
    hook: Option<&'s mut (dyn StepHook + 'h)>,
}

/// Step 4, the MoE block of layer `l`: route every token, fetch the needed experts, apply each
/// expert to all its tokens, mix per token in ascending expert id, add to `h`.
///
/// Experts are fetched in the groups the source asks for ([`WeightSource::expert_batches`]:
/// one group when it can hold them all, smaller ones under a memory budget); each group's
/// weights are dropped once its outputs are computed, and only the outputs are kept. The mix
/// runs after the last group, in ascending expert id, so grouping cannot change a bit.
///
/// [`WeightSource::expert_batches`]: tarfa_core::weights::WeightSource::expert_batches
fn moe_block(
    model: &CpuModel,
    kernel: Kernel,
    l: usize,
    moe: &MoeResident,
    h: &mut [Vec<f32>],
    step: &mut MoeStep<'_, '_>,
) -> Result<(), RunError> {
    let cfg = &model.cfg;
    let layer = &model.weights.layers[l];
    let xs = normed_activations(kernel, h, &layer.post_attention_norm, cfg.eps_f32());

    // router logits [T][E], then per-token routes
    let mut logits = apply(kernel, &moe.router, &xs);
    // gpt-oss's router is a linear layer with a bias: logits = W x + b
    for lg in logits.iter_mut() {
        add_bias(lg, &moe.router_linear_bias);
    }
    if let Some(k) = step.hook.as_mut() {
        k.router_logits(l, &mut logits);
    }
    step.common.weight_bytes += moe.router.as_ref().bytes();
    // an intervention's forced experts per token (none on the default path: no hook)
    let forced: Vec<Option<Vec<usize>>> = match step.hook.as_mut() {
        Some(k) => (0..logits.len()).map(|t| k.forced_experts(l, t)).collect(),
        None => Vec::new(),
    };
    for (t, f) in forced.iter().enumerate() {
        if let Some(f) = f {
            check_forced(f, l, t, cfg.top_k, cfg.num_experts)?;
        }
    }
    let force = |t: usize| forced.get(t).and_then(Option::as_deref);
    let routes: Vec<Route> = match (model.spec.router, &cfg.group_routing) {
        (RouterRule::SigmoidGroupLimited, Some(g)) => {
            let bias = moe.correction_bias.as_deref().ok_or_else(|| {
                RunError::SourceContract(format!(
                    "layer {l}: group-limited routing without e_score_correction_bias"
                ))
            })?;
            logits
                .iter()
                .enumerate()
                .map(|(t, lg)| {
                    route_sigmoid_grouped(
                        kernel,
                        lg,
                        bias,
                        g,
                        cfg.top_k,
                        model.spec.renormalize_topk,
                        force(t),
                    )
                })
                .collect()
        }
        (RouterRule::SoftmaxGroupLimited, Some(g)) => logits
            .iter()
            .enumerate()
            .map(|(t, lg)| route_softmax_grouped(kernel, lg, g, cfg.top_k, force(t)))
            .collect(),
        (RouterRule::TopKThenSoftmax, _) => logits
            .iter()
            .enumerate()
            .map(|(t, lg)| route_topk_then_softmax(kernel, lg, cfg.top_k, force(t)))
            .collect(),
        (RouterRule::SigmoidScalesInput, _) => logits
            .iter()
            .enumerate()
            .map(|(t, lg)| route_sigmoid_scales_input(lg, cfg.top_k, force(t)))
            .collect(),
        _ => logits
            .iter()
            .enumerate()
            .map(|(t, lg)| route(kernel, lg, cfg.top_k, model.spec.renormalize_topk, force(t)))
            .collect(),
    };

    if let Some(k) = step.hook.as_mut() {
        let probs = router_probs(kernel, model.spec.router, cfg.top_k, &logits);
        k.router_probs(l, &probs);
    }

    // expert -> [(token, weight)], experts in ascending id (BTreeMap order)
    let mut assignment: BTreeMap<usize, Vec<(usize, f32)>> = BTreeMap::new();
    for (t, r) in routes.iter().enumerate() {
        for &(e, _, w) in &r.chosen {
            assignment.entry(e).or_default().push((t, w));
        }
    }
    let ids: Vec<usize> = assignment.keys().copied().collect();
    // The routes are known: a streaming source starts reading every needed expert now, while
    // the trace is written and the first group (often already held) is computed.
    let batches = model.source.expert_batches(l, &ids);
    check_batches(&batches, &ids)?;
    model.source.prefetch(l, &batches);
    // A source reading ahead (`--lookahead`) may start on the next MoE layer's likely experts
    // now; the guess never changes what is computed (lookahead.rs).
    super::lookahead::hint_next_layer(model, kernel, l, h, ids.len());

    let moe_layer = model.spec.moe_index(l).unwrap_or(0);
    // Llama 4: the routing weight scales each expert's input, and the outputs add unweighted
    let input_scaled = model.spec.router == RouterRule::SigmoidScalesInput;
    for (t, r) in routes.iter().enumerate() {
        let Slot { seq, pos } = step.slots[t];
        if step.trace[seq] {
            step.router[seq].push(RouterRecord {
                layer: l,
                moe_layer,
                position: pos,
                experts: r.chosen.iter().map(|c| c.0 as u32).collect(),
                probs: r.chosen.iter().map(|c| c.1).collect(),
                weights: r.chosen.iter().map(|c| c.2).collect(),
                kth_prob: r.kth,
                next_prob: r.next,
            });
        }
    }

    // y[e] for each needed expert, per token of its list ([j] -> [H]); the shared expert's
    // output and gate logit per token.
    let mut ys: BTreeMap<usize, Vec<Vec<f32>>> = BTreeMap::new();
    let mut shared_out: Option<(Vec<Vec<f32>>, Vec<f32>)> = None;
    // The ungated shared experts (DeepSeek, GLM-4.5) are a dense MLP over every token; they do
    // not depend on the routed experts, so they run before them in their own regions.
    let ungated_out = moe
        .shared_ungated
        .as_ref()
        .map(|mlp| dense_mlp(kernel, mlp, &xs, step.common));
    let mut expert_bytes: BTreeMap<usize, u64> = BTreeMap::new();
    for (b, batch) in batches.iter().enumerate() {
        let experts: Vec<ExpertHandle> = model.source.expert_data(l, batch)?;
        if experts.len() != batch.len() {
            return Err(RunError::SourceContract(format!(
                "expert_data() returned {} experts for {} ids",
                experts.len(),
                batch.len()
            )));
        }
        for (ew, &e) in experts.iter().zip(batch) {
            check_expert(ew.as_ref(), l, e, cfg.hidden_size, cfg.expert_width)?;
            expert_bytes.insert(e, ew.bytes());
        }
        let token_lists: Vec<&Vec<(usize, f32)>> = batch.iter().map(|e| &assignment[e]).collect();
        // The shared expert joins the first group's parallel regions (with one group, exactly
        // the regions of a resident run).
        let shared = if b == 0 { moe.shared.as_ref() } else { None };
        let (group_ys, sh) = expert_products(
            kernel,
            cfg,
            (model.spec.extras.activation, input_scaled),
            (batch, moe.expert_bias.as_ref()),
            &experts,
            &token_lists,
            &xs,
            shared,
            step.common,
        );
        // The weights go back to the source before the next group is asked for.
        drop(experts);
        for (&e, y) in batch.iter().zip(group_ys) {
            ys.insert(e, y);
        }
        if sh.is_some() {
            shared_out = sh;
        }
    }

    // Each sequence is counted the experts its own tokens chose, as if it ran alone.
    let mut chosen: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); step.own.len()];
    for (t, r) in routes.iter().enumerate() {
        chosen[step.slots[t].seq].extend(r.chosen.iter().map(|c| c.0));
    }
    for (s, set) in step.own.iter_mut().zip(&chosen) {
        s.experts_fetched += set.len() as u64;
        s.weight_bytes += set.iter().map(|e| expert_bytes[e]).sum::<u64>();
    }

    // Mix: acc = +0; for the token's experts in ascending id: acc = acc + (w_e * y_e) (Llama 4:
    // acc = acc + y_e, its weight already in the input); then the shared expert:
    // acc = acc + sigmoid(s) * y_shared; h = h + acc.
    let t_count = h.len();
    let mut acc = vec![vec![0.0f32; cfg.hidden_size]; t_count];
    for (e, y) in &ys {
        for (j, &(t, w)) in assignment[e].iter().enumerate() {
            if input_scaled {
                for (a, &v) in acc[t].iter_mut().zip(&y[j]) {
                    *a += v;
                }
            } else {
                for (a, &v) in acc[t].iter_mut().zip(&y[j]) {
                    *a += w * v;
                }
            }
        }
    }
    if let Some((shared_y, sh_s)) = &shared_out {
        for t in 0..t_count {
            let gate = sigmoid(sh_s[t]);
            for (a, &v) in acc[t].iter_mut().zip(&shared_y[t]) {
                *a += gate * v;
            }
        }
    }
    // ungated shared experts: acc = acc + y_shared
    if let Some(shared_y) = &ungated_out {
        add_rows(&mut acc, shared_y);
    }
    if let Some(k) = step.hook.as_mut() {
        for (&e, y) in &ys {
            for (j, &(t, _)) in assignment[&e].iter().enumerate() {
                k.expert_out(l, t, e, &y[j]);
            }
        }
        k.mlp_out(l, &mut acc);
    }
    add_rows(h, &acc);
    Ok(())
}

/// The products of one group of experts over their tokens (and of the shared expert over all
/// tokens, when given): gate and up in one parallel region, `a = silu(g) * u`, down in a second.
/// When `input_scaled` (Llama 4), expert e's input for token t is `xn_t * w` elementwise, `w`
/// the token's weight for e (one rounding per element); the shared expert sees `xn_t`.
/// Returns each expert's outputs per token of its list, and the shared expert's outputs per
/// token with its gate logits.
#[allow(clippy::type_complexity)]
#[allow(clippy::too_many_arguments)]
fn expert_products(
    kernel: Kernel,
    cfg: &tarfa_core::config::MoeConfig,
    (activation, input_scaled): (ExpertActivation, bool),
    (ids, bias): (&[usize], Option<&ExpertBias>),
    experts: &[ExpertHandle],
    token_lists: &[&Vec<(usize, f32)>],
    xs: &[Activation],
    shared: Option<&(DenseMlp, Matrix)>,
    stats: &mut StepStats,
) -> (Vec<Vec<Vec<f32>>>, Option<(Vec<Vec<f32>>, Vec<f32>)>) {
    let mats: Vec<[Bf16View<'_>; 3]> = experts.iter().map(|e| e.matrices()).collect();
    // Stage 1: gate and up of every expert of the group over its tokens (and the shared
    // expert's gate, up and sigmoid gate over all tokens), one parallel region.
    let mut gate_out: Vec<Vec<f32>> = token_lists
        .iter()
        .map(|tl| vec![0.0; cfg.expert_width * tl.len()])
        .collect();
    let mut up_out: Vec<Vec<f32>> = gate_out.clone();
    let t_count = xs.len();
    let (mut sh_g, mut sh_u, mut sh_s) = match shared {
        Some((mlp, _)) => (
            vec![0.0; mlp.gate.rows * t_count],
            vec![0.0; mlp.up.rows * t_count],
            vec![0.0; t_count],
        ),
        None => (Vec::new(), Vec::new(), Vec::new()),
    };
    // Llama 4: each (expert, token) input scaled by the token's score for that expert
    let scaled: Vec<Vec<Activation>> = if input_scaled {
        token_lists
            .iter()
            .map(|tl| {
                tl.iter()
                    .map(|&(t, w)| {
                        let x = xs[t].values().iter().map(|&v| v * w).collect();
                        Activation::new(kernel, x)
                    })
                    .collect()
            })
            .collect()
    } else {
        Vec::new()
    };
    {
        let mut jobs = Vec::new();
        for (n, (((m, tl), g), u)) in mats
            .iter()
            .zip(token_lists)
            .zip(gate_out.iter_mut())
            .zip(up_out.iter_mut())
            .enumerate()
        {
            let tx: Vec<&Activation> = if input_scaled {
                scaled[n].iter().collect()
            } else {
                tl.iter().map(|&(t, _)| &xs[t]).collect()
            };
            jobs.push(MatJob {
                w: bf16_ref(m[0]),
                xs: tx.clone(),
                out: g,
            });
            jobs.push(MatJob {
                w: bf16_ref(m[1]),
                xs: tx,
                out: u,
            });
        }
        if let Some((mlp, sg)) = shared {
            let all: Vec<&Activation> = xs.iter().collect();
            jobs.push(MatJob {
                w: mlp.gate.as_ref(),
                xs: all.clone(),
                out: &mut sh_g,
            });
            jobs.push(MatJob {
                w: mlp.up.as_ref(),
                xs: all.clone(),
                out: &mut sh_u,
            });
            jobs.push(MatJob {
                w: sg.as_ref(),
                xs: all,
                out: &mut sh_s,
            });
            stats.weight_bytes +=
                mlp.gate.as_ref().bytes() + mlp.up.as_ref().bytes() + sg.as_ref().bytes();
        }
        run_jobs(kernel, jobs);
    }

    // a = silu(g) * u per (expert, token), or gpt-oss's clamped form on g + b_g, u + b_u
    let iw = cfg.expert_width;
    let acts: Vec<Vec<Activation>> = token_lists
        .iter()
        .zip(gate_out.iter().zip(&up_out))
        .zip(ids)
        .map(|((tl, (g, u)), &e)| {
            let (mut g, mut u) = (
                transpose_rows(g, iw, tl.len()),
                transpose_rows(u, iw, tl.len()),
            );
            if let Some(b) = bias {
                let (bg, bu) = (&b.gate[e * iw..(e + 1) * iw], &b.up[e * iw..(e + 1) * iw]);
                for (g, u) in g.iter_mut().zip(u.iter_mut()) {
                    g.iter_mut().zip(bg).for_each(|(x, &b)| *x += b);
                    u.iter_mut().zip(bu).for_each(|(x, &b)| *x += b);
                }
            }
            g.iter()
                .zip(&u)
                .map(|(g, u)| Activation::new(kernel, expert_activation(kernel, activation, g, u)))
                .collect()
        })
        .collect();
    let shared_acts: Vec<Activation> = match shared {
        Some((mlp, _)) => {
            let g = transpose_rows(&sh_g, mlp.gate.rows, t_count);
            let u = transpose_rows(&sh_u, mlp.up.rows, t_count);
            g.iter()
                .zip(&u)
                .map(|(g, u)| Activation::new(kernel, swiglu(kernel, g, u)))
                .collect()
        }
        None => Vec::new(),
    };

    // Stage 2: down projections, one parallel region.
    let mut down_out: Vec<Vec<f32>> = token_lists
        .iter()
        .map(|tl| vec![0.0; cfg.hidden_size * tl.len()])
        .collect();
    let mut sh_y = vec![
        0.0;
        if shared.is_some() {
            cfg.hidden_size * t_count
        } else {
            0
        }
    ];
    {
        let mut jobs = Vec::new();
        for ((m, a), y) in mats.iter().zip(&acts).zip(down_out.iter_mut()) {
            jobs.push(MatJob {
                w: bf16_ref(m[2]),
                xs: a.iter().collect(),
                out: y,
            });
        }
        if let Some((mlp, _)) = shared {
            jobs.push(MatJob {
                w: mlp.down.as_ref(),
                xs: shared_acts.iter().collect(),
                out: &mut sh_y,
            });
            stats.weight_bytes += mlp.down.as_ref().bytes();
        }
        run_jobs(kernel, jobs);
    }

    let hs = cfg.hidden_size;
    let ys = token_lists
        .iter()
        .zip(&down_out)
        .zip(ids)
        .map(|((tl, y), &e)| {
            let mut y = transpose_rows(y, hs, tl.len());
            // gpt-oss: y = W_down a + b_down, before the routing weight
            if let Some(b) = bias {
                let bd = &b.down[e * hs..(e + 1) * hs];
                for yt in y.iter_mut() {
                    yt.iter_mut().zip(bd).for_each(|(x, &b)| *x += b);
                }
            }
            y
        })
        .collect();
    let shared_out = shared.map(|_| (transpose_rows(&sh_y, cfg.hidden_size, t_count), sh_s));
    (ys, shared_out)
}

fn bf16_ref(m: Bf16View<'_>) -> MatrixRef<'_> {
    MatrixRef::Bf16 {
        rows: m.rows,
        cols: m.cols,
        data: m.data,
    }
}

#[cfg(test)]
mod tests {
    use super::attn_temperature;
    use tarfa_core::config::AttnTemperature;

    /// Llama 4's temperature by hand: exactly 1 while `(pos + 1) / floor_scale < 1`, then
    /// `f32(ln(1 + f)) * f32(attn_scale) + 1` with `f` the floor.
    #[test]
    fn attention_temperature_is_one_below_floor_scale_then_grows_by_log1p() {
        let t = AttnTemperature {
            floor_scale: 8192.0,
            attn_scale: 0.1,
        };
        assert_eq!(attn_temperature(&t, 0), 1.0);
        assert_eq!(attn_temperature(&t, 8190), 1.0);
        let ln2 = std::f64::consts::LN_2 as f32;
        assert_eq!(attn_temperature(&t, 8191), ln2 * 0.1f32 + 1.0);
        assert_eq!(attn_temperature(&t, 2 * 8192 - 2), ln2 * 0.1f32 + 1.0);
        let ln3 = 3f64.ln() as f32;
        assert_eq!(attn_temperature(&t, 2 * 8192 - 1), ln3 * 0.1f32 + 1.0);
    }
}
