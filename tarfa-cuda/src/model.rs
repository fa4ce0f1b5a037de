//! The resident model on the GPU and its forward step (docs/EXACTNESS.md section 6), launched
//! kernel by kernel on one stream in the CPU backend's order of operations.
//!
//! Weights: every non-expert tensor and every expert of every MoE layer is uploaded once, at
//! load, from the buffers the [`WeightSource`] verified (contract section 1); norm weights and
//! biases as the CPU widens them (f32). Experts of one layer are stacked per matrix
//! (`gate`/`up` `[E][I][H]`, `down` `[E][H][I]`) so that a kernel finds expert `e` from the id the
//! router wrote in device memory.
//!
//! This module must never change an operation's order or precision relative to cpu/forward.rs.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

#[path = "decode.rs"]
pub(super) mod decode;
#[path = "hot.rs"]
pub(crate) mod hot;
#[path = "steps.rs"]
pub(super) mod steps;

use super::device::{open_context, DevBuf, Gpu};
use super::ops::{self, AttnShape, DType, DevMat, RouteOut, SlotTable};
use super::{gib, CudaError, CudaOptions, DecodeMode, DeviceInfo, HotOptions, HotStats};
use hot::HotTier;
use tarfa_core::batch::{BatchEntry, BatchError};
use tarfa_core::config::MoeConfig;
use tarfa_core::model::{ArchSpec, MlpKind, QkNorm, RouterRule};
use tarfa_core::numerics::{MatrixRef, RopeTable};
use tarfa_core::resident::{Attention, LayerMlp, LinearIn, Matrix, MlaQuery, ResidentWeights};
use tarfa_core::step::{
    FinalHidden, ForwardOptions, ForwardOutput, LogitRows, RouterRecord, StepStats,
};
use tarfa_core::weights::{ExpertWeights, WeightError, WeightSource};
use tarfa_core::RunError;

/// Is a usable CUDA GPU here? Loads the driver and NVRTC libraries (checking first that they
/// exist), opens device `ordinal` and describes it. `--backend auto` picks CUDA when this is Ok.
pub fn probe(ordinal: usize) -> Result<DeviceInfo, CudaError> {
    open_context(ordinal).map(|(_, info)| info)
}

struct DevAttention {
    q: DevMat,
    k: DevMat,
    v: DevMat,
    o: DevMat,
    q_bias: Option<DevBuf>,
    k_bias: Option<DevBuf>,
    v_bias: Option<DevBuf>,
    o_bias: Option<DevBuf>,
    q_norm: Option<DevBuf>,
    k_norm: Option<DevBuf>,
    /// gpt-oss's attention sinks, one logit per query head.
    sinks: Option<DevBuf>,
}

struct DevDense {
    gate: DevMat,
    up: DevMat,
    down: DevMat,
}

/// The experts of one MoE layer, stacked.
struct DevExperts {
    gate: DevBuf,
    up: DevBuf,
    down: DevBuf,
}

enum DevMlp {
    Dense(DevDense),
    Moe {
        router: DevMat,
        /// `None` when streaming: the experts are in the hot tier's slots.
        experts: Option<DevExperts>,
        shared: Option<Box<DevShared>>,
        /// The router's `e_score_correction_bias` (group-limited sigmoid routing).
        correction_bias: Option<DevBuf>,
        /// gpt-oss: the router's linear bias (its logits are `W x + b`).
        router_bias: Option<DevBuf>,
        /// gpt-oss: the experts' biases, stacked per expert (`ExpertBias`'s layout).
        expert_bias: Option<DevExpertBias>,
        /// Index among MoE layers (router records, per-step record slots).
        moe_index: usize,
    },
}

/// gpt-oss's expert biases on the device: `[E][I]` gate and up, `[E][H]` down.
struct DevExpertBias {
    gate: DevBuf,
    up: DevBuf,
    down: DevBuf,
}

/// A MoE layer's shared experts: Qwen2-MoE's, gated by sigmoid(W_g xn), or DeepSeek's and
/// GLM-4.5's, added without a gate.
enum DevShared {
    Gated(DevDense, DevMat),
    Ungated(DevDense),
}

impl DevShared {
    fn mlp(&self) -> &DevDense {
        match self {
            DevShared::Gated(m, _) | DevShared::Ungated(m) => m,
        }
    }

    fn gate(&self) -> Option<&DevMat> {
        match self {
            DevShared::Gated(_, g) => Some(g),
            DevShared::Ungated(_) => None,
        }
    }
}

/// Multi-head latent attention's weights on the device (kernels/mla.cu).
struct DevMla {
    q: DevMlaQuery,
    kv_a: DevMat,
    kv_a_norm: DevBuf,
    kv_b: DevMat,
    o: DevMat,
}

enum DevMlaQuery {
    Plain(DevMat),
    LoRa { a: DevMat, norm: DevBuf, b: DevMat },
}

/// `q_a_layernorm` and `kv_a_layernorm` use the class default eps 1e-6, not the config's
/// `rms_norm_eps` (tarfa-cpu's `MLA_NORM_EPS`, transformers' DeepseekV2/V3 attention).
const MLA_NORM_EPS: f32 = 1e-6;

/// A gated DeltaNet layer's weights on the device (kernels/linear_attn.cu): the input
/// projections, the convolution's taps `[C][K]`, `A_log` and `dt_bias` `[Hv]`, the gated norm's
/// weight `[Dv]`, `out_proj`.
struct DevLinear {
    input: DevLinearIn,
    conv: DevBuf,
    a_log: DevBuf,
    dt_bias: DevBuf,
    norm: DevBuf,
    out: DevMat,
}

/// How a gated DeltaNet layer's inputs are projected (tarfa-core's `LinearIn`).
enum DevLinearIn {
    /// Qwen3-Next: grouped by key head, permuted by `linear_unpack`.
    Fused { qkvz: DevMat, ba: DevMat },
    /// Qwen3.5: head-major already.
    Separate {
        qkv: DevMat,
        z: DevMat,
        b: DevMat,
        a: DevMat,
    },
}

/// A layer's attention: grouped-query, multi-head latent (DeepSeek-V2/V3), or a gated DeltaNet
/// layer (Qwen3-Next, Qwen3.5 MoE).
enum DevAttn {
    Gqa(DevAttention),
    Mla(DevMla),
    Linear(DevLinear),
}

impl DevAttn {
    /// Every matrix the attention reads, once (the step's weight bytes).
    fn bytes(&self) -> u64 {
        match self {
            DevAttn::Gqa(a) => a.q.bytes() + a.k.bytes() + a.v.bytes() + a.o.bytes(),
            DevAttn::Mla(m) => {
                let q = match &m.q {
                    DevMlaQuery::Plain(q) => q.bytes(),
                    DevMlaQuery::LoRa { a, b, .. } => a.bytes() + b.bytes(),
                };
                q + m.kv_a.bytes() + m.kv_b.bytes() + m.o.bytes()
            }
            DevAttn::Linear(a) => {
                let input = match &a.input {
                    DevLinearIn::Fused { qkvz, ba } => qkvz.bytes() + ba.bytes(),
                    DevLinearIn::Separate { qkv, z, b, a } => {
                        qkv.bytes() + z.bytes() + b.bytes() + a.bytes()
                    }
                };
                input + a.out.bytes()
            }
        }
    }
}

struct DevLayer {
    input_norm: DevBuf,
    post_norm: DevBuf,
    attn: DevAttn,
    mlp: DevMlp,
}

/// A model whose weights all live on one GPU.
pub struct CudaModel {
    // Field order is drop order: buffers go before the context that owns them.
    embed: DevMat,
    lm_head: Option<DevMat>,
    final_norm: DevBuf,
    layers: Vec<DevLayer>,
    cfg: MoeConfig,
    spec: ArchSpec,
    moe_layers: usize,
    resident_bytes: u64,
    /// Identifies the caches this model made.
    id: usize,
    /// How new caches run decode steps.
    decode_mode: DecodeMode,
    /// [`CudaTuning::wait_each_token`](crate::CudaTuning).
    pub(crate) wait_each_token: bool,
    /// Why the decode kernels cannot run this model (then decode steps use the legacy ones).
    decode_unsupported: Option<String>,
    /// Expert streaming: the hot tier, and the source its experts come from.
    hot: Option<Box<Mutex<HotTier>>>,
    stream_source: Option<Arc<dyn WeightSource>>,
    pub(crate) gpu: Gpu,
}

static NEXT_MODEL_ID: AtomicUsize = AtomicUsize::new(1);

fn host_f32_bytes(v: &[f32]) -> u64 {
    4 * v.len() as u64
}

fn matrix_bytes(m: &Matrix) -> u64 {
    m.as_ref().bytes()
}

/// Bytes the resident upload needs (weights as stored, norms and biases as f32); the routed
/// experts only when `experts`.
fn resident_need(cfg: &MoeConfig, spec: &ArchSpec, w: &ResidentWeights, experts: bool) -> u64 {
    let mut total = matrix_bytes(&w.embed) + host_f32_bytes(&w.final_norm);
    if !cfg.tie_word_embeddings {
        total += matrix_bytes(&w.lm_head);
    }
    let opt = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, |v| host_f32_bytes(v));
    for (l, layer) in w.layers.iter().enumerate() {
        total += host_f32_bytes(&layer.input_norm) + host_f32_bytes(&layer.post_attention_norm);
        match &layer.attention {
            Attention::Gqa(a) => {
                total += matrix_bytes(&a.q)
                    + matrix_bytes(&a.k)
                    + matrix_bytes(&a.v)
                    + matrix_bytes(&a.o);
                total += opt(&a.q_bias) + opt(&a.k_bias) + opt(&a.v_bias) + opt(&a.o_bias);
                total += opt(&a.q_norm) + opt(&a.k_norm);
            }
            Attention::Mla(m) => {
                total += match &m.q {
                    MlaQuery::Plain(q) => matrix_bytes(q),
                    MlaQuery::LoRa { a, norm, b } => {
                        matrix_bytes(a) + host_f32_bytes(norm) + matrix_bytes(b)
                    }
                };
                total += matrix_bytes(&m.kv_a)
                    + host_f32_bytes(&m.kv_a_norm)
                    + matrix_bytes(&m.kv_b)
                    + matrix_bytes(&m.o);
            }
            Attention::Linear(a) => {
                total += match &a.input {
                    LinearIn::FusedQkvzBa { qkvz, ba } => matrix_bytes(qkvz) + matrix_bytes(ba),
                    LinearIn::Separate { qkv, z, b, a } => {
                        matrix_bytes(qkv) + matrix_bytes(z) + matrix_bytes(b) + matrix_bytes(a)
                    }
                };
                total += host_f32_bytes(&a.conv)
                    + host_f32_bytes(&a.a_log)
                    + host_f32_bytes(&a.dt_bias)
                    + host_f32_bytes(&a.norm)
                    + matrix_bytes(&a.out);
            }
        }
        match &layer.mlp {
            LayerMlp::Dense(d) => {
                total += matrix_bytes(&d.gate) + matrix_bytes(&d.up) + matrix_bytes(&d.down)
            }
            LayerMlp::Moe(m) => {
                total += matrix_bytes(&m.router);
                if let Some((d, sg)) = &m.shared {
                    total += matrix_bytes(&d.gate)
                        + matrix_bytes(&d.up)
                        + matrix_bytes(&d.down)
                        + matrix_bytes(sg);
                }
                if let Some(d) = &m.shared_ungated {
                    total += matrix_bytes(&d.gate) + matrix_bytes(&d.up) + matrix_bytes(&d.down);
                }
                total += opt(&m.correction_bias) + opt(&m.router_linear_bias);
                if let Some(b) = &m.expert_bias {
                    total +=
                        host_f32_bytes(&b.gate) + host_f32_bytes(&b.up) + host_f32_bytes(&b.down);
                }
                if experts && spec.layers[l] == MlpKind::Moe {
                    total += 3 * 2 * (cfg.num_experts * cfg.expert_width * cfg.hidden_size) as u64;
                }
            }
        }
    }
    total
}

impl CudaModel {
    /// Opens the GPU, compiles the kernels, and uploads every weight from `source` (non-expert
    /// tensors, then each MoE layer's experts, one layer at a time so that host memory holds at
    /// most one layer of experts beyond what the source keeps). Fails with
    /// [`CudaError::OutOfMemory`] before uploading anything when the weights cannot all fit.
    pub fn load(
        cfg: MoeConfig,
        source: Arc<dyn WeightSource>,
        opts: &CudaOptions,
    ) -> Result<CudaModel, CudaError> {
        let mut m = CudaModel::load_on(Gpu::open(opts)?, cfg, source, opts.hot.as_ref())?;
        m.decode_mode = opts.tuning.decode;
        m.wait_each_token = opts.tuning.wait_each_token;
        // Streamed experts are copied from page-locked buffers, asynchronously at the bus's
        // speed, unless asked otherwise (the A/B's other arm).
        if let Some(source) = &m.stream_source {
            if !opts.tuning.pageable_warm_tier {
                if let Some(pin) = m.gpu.host_pin() {
                    source.use_host_pin(pin);
                }
            }
        }
        Ok(m)
    }

    /// [`CudaModel::load`] on the mock device: host memory with every access bounds-checked,
    /// the kernels' reference functions (or, under `TARFA_CUDA_EMU`, the real kernels on the CPU
    /// emulator). For tests of the crates above: the same bits as a GPU, slowly. Without the
    /// `mock-device` feature, [`CudaError::NoMockDevice`].
    pub fn load_mock(
        cfg: MoeConfig,
        source: Arc<dyn WeightSource>,
        opts: &CudaOptions,
    ) -> Result<CudaModel, CudaError> {
        #[cfg(any(test, feature = "mock-device"))]
        {
            let mut m = CudaModel::load_on(Gpu::mock(), cfg, source, opts.hot.as_ref())?;
            m.decode_mode = opts.tuning.decode;
            m.wait_each_token = opts.tuning.wait_each_token;
            m.gpu.set_many(opts.tuning.many);
            Ok(m)
        }
        #[cfg(not(any(test, feature = "mock-device")))]
        {
            let _ = (cfg, source, opts);
            Err(CudaError::NoMockDevice)
        }
    }

    /// The router kernel's arguments when this family routes by groups (moe.cu
    /// `route_grouped`), `None` for softmax top-k (`route_topk`). `bias`: the layer's
    /// correction bias, which sigmoid scores need.
    pub(crate) fn grouped_route(
        &self,
        bias: Option<&DevBuf>,
    ) -> Result<Option<ops::GroupedRoute>, CudaError> {
        use tarfa_core::model::RouterRule;
        let sigmoid = match self.spec.router {
            RouterRule::SigmoidGroupLimited => true,
            RouterRule::SoftmaxGroupLimited => false,
            RouterRule::SoftmaxTopK => return Ok(None),
            // refused by unsupported_family before anything is uploaded
            RouterRule::TopKThenSoftmax | RouterRule::SigmoidScalesInput => {
                return Err(CudaError::UnsupportedModel(format!(
                    "the {:?} router on the CUDA kernels",
                    self.spec.router
                )))
            }
        };
        let g = self.cfg.group_routing.as_ref().ok_or_else(|| {
            CudaError::UnsupportedModel("group-limited routing without its groups".into())
        })?;
        let bias = match (sigmoid, bias) {
            (true, Some(b)) => Some(b.ptr()),
            (true, None) => {
                return Err(CudaError::UnsupportedModel(
                    "group-limited sigmoid routing without e_score_correction_bias".into(),
                ))
            }
            (false, _) => None,
        };
        Ok(Some(ops::GroupedRoute {
            bias,
            n_group: g.n_group,
            topk_group: g.topk_group,
            renorm: self.spec.renormalize_topk,
            scale: g.routed_scaling_factor as f32,
        }))
    }

    /// The decode mode new caches start with ([`CudaTuning::decode`](crate::CudaTuning)).
    /// Which kernels this model's steps of many tokens take from now on (changes speed, never
    /// a bit: every choice computes the same canonical reductions).
    pub fn set_many_kernels(&self, m: crate::ManyKernels) {
        self.gpu.set_many(m);
    }

    /// The kernels steps of many tokens take ([`CudaModel::set_many_kernels`]).
    pub fn many_kernels(&self) -> crate::ManyKernels {
        self.gpu.many()
    }

    pub fn default_decode_mode(&self) -> DecodeMode {
        self.decode_mode
    }

    /// Why the decode kernels (kernels/decode.cu) cannot run this model, if they cannot.
    pub fn decode_unsupported_reason(&self) -> Option<&str> {
        self.decode_unsupported.as_deref()
    }

    /// [`CudaModel::load`] on an opened device.
    pub(crate) fn load_on(
        gpu: Gpu,
        cfg: MoeConfig,
        source: Arc<dyn WeightSource>,
        hot: Option<&HotOptions>,
    ) -> Result<CudaModel, CudaError> {
        let spec = ArchSpec::new(&cfg);
        if let Some(why) = crate::unsupported_family(&cfg, &spec) {
            return Err(CudaError::UnsupportedModel(why));
        }
        let host = ResidentWeights::load(&cfg, &spec, source.as_ref())?;
        if cfg.hidden_size == 0 || cfg.head_dim == 0 || cfg.num_heads == 0 {
            return Err(CudaError::UnsupportedModel(
                "a model with an empty dimension".into(),
            ));
        }
        if cfg.num_kv_heads == 0 || !cfg.num_heads.is_multiple_of(cfg.num_kv_heads) {
            return Err(CudaError::UnsupportedModel(format!(
                "{} query heads over {} KV heads",
                cfg.num_heads, cfg.num_kv_heads
            )));
        }
        let need = resident_need(&cfg, &spec, &host, hot.is_none());
        let (free, total) = gpu.mem_info()?;
        // headroom for the KV cache, the step's workspace and the driver
        let headroom = 512u64 << 20;
        let hot_bytes = hot.map_or(0, |h| {
            let slot = super::min_vram_budget(&cfg);
            (h.budget / slot).min((cfg.num_layers * cfg.num_experts).max(1) as u64) * slot
        });
        if need + hot_bytes + headroom > free as u64 {
            let why = if hot.is_some() {
                format!(
                    "the resident part ({} of dense weights, plus {} of headroom) and the hot \
                     tier ({}); lower --vram-budget",
                    gib(need),
                    gib(headroom),
                    gib(hot_bytes)
                )
            } else {
                format!(
                    "the resident weights ({}, plus {} of headroom); stream the experts \
                     instead (--vram-budget)",
                    gib(need),
                    gib(headroom)
                )
            };
            return Err(CudaError::oom(
                why,
                (need + hot_bytes + headroom) as usize,
                free,
                total,
            ));
        }

        let up_mat = |m: &Matrix, what: &str| upload_matrix(&gpu, m, what);
        let up_vec = |v: &[f32], what: &str| gpu.upload(v, what);
        let up_opt = |v: &Option<Vec<f32>>, what: &str| -> Result<Option<DevBuf>, CudaError> {
            v.as_ref().map(|v| gpu.upload(v, what)).transpose()
        };
        let embed = up_mat(&host.embed, "embedding")?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(up_mat(&host.lm_head, "lm_head")?)
        };
        let final_norm = up_vec(&host.final_norm, "final norm")?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        let mut moe_layers = 0;
        for (l, lw) in host.layers.iter().enumerate() {
            let name = |s: &str| format!("layer {l} {s}");
            let attn = match &lw.attention {
                Attention::Gqa(a) => {
                    let [q, k, v] = upload_stacked(&gpu, [&a.q, &a.k, &a.v], &name("q|k|v_proj"))?;
                    DevAttn::Gqa(DevAttention {
                        q,
                        k,
                        v,
                        o: up_mat(&a.o, &name("o_proj"))?,
                        q_bias: up_opt(&a.q_bias, &name("q bias"))?,
                        k_bias: up_opt(&a.k_bias, &name("k bias"))?,
                        v_bias: up_opt(&a.v_bias, &name("v bias"))?,
                        o_bias: up_opt(&a.o_bias, &name("o bias"))?,
                        q_norm: up_opt(&a.q_norm, &name("q norm"))?,
                        k_norm: up_opt(&a.k_norm, &name("k norm"))?,
                        sinks: up_opt(&a.sinks, &name("attention sinks"))?,
                    })
                }
                Attention::Mla(m) => DevAttn::Mla(DevMla {
                    q: match &m.q {
                        MlaQuery::Plain(q) => DevMlaQuery::Plain(up_mat(q, &name("q_proj"))?),
                        MlaQuery::LoRa { a, norm, b } => DevMlaQuery::LoRa {
                            a: up_mat(a, &name("q_a_proj"))?,
                            norm: up_vec(norm, &name("q_a_layernorm"))?,
                            b: up_mat(b, &name("q_b_proj"))?,
                        },
                    },
                    kv_a: up_mat(&m.kv_a, &name("kv_a_proj_with_mqa"))?,
                    kv_a_norm: up_vec(&m.kv_a_norm, &name("kv_a_layernorm"))?,
                    kv_b: up_mat(&m.kv_b, &name("kv_b_proj"))?,
                    o: up_mat(&m.o, &name("o_proj"))?,
                }),
                Attention::Linear(a) => DevAttn::Linear(DevLinear {
                    input: match &a.input {
                        LinearIn::FusedQkvzBa { qkvz, ba } => DevLinearIn::Fused {
                            qkvz: up_mat(qkvz, &name("in_proj_qkvz"))?,
                            ba: up_mat(ba, &name("in_proj_ba"))?,
                        },
                        LinearIn::Separate { qkv, z, b, a } => DevLinearIn::Separate {
                            qkv: up_mat(qkv, &name("in_proj_qkv"))?,
                            z: up_mat(z, &name("in_proj_z"))?,
                            b: up_mat(b, &name("in_proj_b"))?,
                            a: up_mat(a, &name("in_proj_a"))?,
                        },
                    },
                    conv: up_vec(&a.conv, &name("conv1d"))?,
                    a_log: up_vec(&a.a_log, &name("A_log"))?,
                    dt_bias: up_vec(&a.dt_bias, &name("dt_bias"))?,
                    norm: up_vec(&a.norm, &name("linear attention norm"))?,
                    out: up_mat(&a.out, &name("out_proj"))?,
                }),
            };
            let dense =
                |d: &tarfa_core::resident::DenseMlp, what: &str| -> Result<DevDense, CudaError> {
                    let out = DevDense {
                        gate: up_mat(&d.gate, &format!("{what} gate"))?,
                        up: up_mat(&d.up, &format!("{what} up"))?,
                        down: up_mat(&d.down, &format!("{what} down"))?,
                    };
                    if out.gate.dtype != out.up.dtype {
                        return Err(CudaError::UnsupportedModel(format!(
                            "{what}: gate and up matrices of different dtypes"
                        )));
                    }
                    Ok(out)
                };
            let mlp = match &lw.mlp {
                LayerMlp::Dense(d) => DevMlp::Dense(dense(d, &name("mlp"))?),
                LayerMlp::Moe(m) => {
                    let shared = match (&m.shared, &m.shared_ungated) {
                        (Some(_), Some(_)) => {
                            return Err(CudaError::UnsupportedModel(name(
                                "both a gated and an ungated shared expert",
                            )))
                        }
                        (Some((d, sg)), None) => Some(Box::new(DevShared::Gated(
                            dense(d, &name("shared expert"))?,
                            up_mat(sg, &name("shared expert gate"))?,
                        ))),
                        (None, Some(d)) => Some(Box::new(DevShared::Ungated(dense(
                            d,
                            &name("shared experts"),
                        )?))),
                        (None, None) => None,
                    };
                    let correction_bias = up_opt(&m.correction_bias, &name("router bias"))?;
                    let router_bias = up_opt(&m.router_linear_bias, &name("router linear bias"))?;
                    let expert_bias = match &m.expert_bias {
                        Some(b) => Some(DevExpertBias {
                            gate: up_vec(&b.gate, &name("experts' gate biases"))?,
                            up: up_vec(&b.up, &name("experts' up biases"))?,
                            down: up_vec(&b.down, &name("experts' down biases"))?,
                        }),
                        None => None,
                    };
                    let experts = match hot {
                        None => Some(upload_experts(&gpu, &cfg, source.as_ref(), l)?),
                        Some(_) => None,
                    };
                    moe_layers += 1;
                    DevMlp::Moe {
                        router: up_mat(&m.router, &name("router"))?,
                        experts,
                        shared,
                        correction_bias,
                        router_bias,
                        expert_bias,
                        moe_index: moe_layers - 1,
                    }
                }
            };
            layers.push(DevLayer {
                input_norm: up_vec(&lw.input_norm, &name("input norm"))?,
                post_norm: up_vec(&lw.post_attention_norm, &name("post-attention norm"))?,
                attn,
                mlp,
            });
        }
        gpu.sync("the weight upload")?;
        let decode_mode = DecodeMode::default();
        let hot = match hot {
            Some(o) => Some(Box::new(Mutex::new(HotTier::new(
                &gpu, &cfg, moe_layers, o,
            )?))),
            None => None,
        };
        let stream_source = hot.as_ref().map(|_| source.clone());
        let mut m = CudaModel {
            embed,
            lm_head,
            final_norm,
            layers,
            cfg,
            spec,
            moe_layers,
            resident_bytes: need,
            id: NEXT_MODEL_ID.fetch_add(1, Ordering::Relaxed),
            decode_mode,
            wait_each_token: false,
            decode_unsupported: None,
            hot,
            stream_source,
            gpu,
        };
        m.decode_unsupported = m.decode_unsupported();
        Ok(m)
    }

    /// The config.
    pub fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    /// The resolved structure.
    pub fn spec(&self) -> &ArchSpec {
        &self.spec
    }

    /// The GPU.
    pub fn device(&self) -> &DeviceInfo {
        &self.gpu.info
    }

    /// Bytes of weights resident on the GPU.
    pub fn resident_bytes(&self) -> u64 {
        self.resident_bytes
    }

    /// An empty KV cache for one sequence, with room for `initial` positions (it grows on
    /// demand up to `max_position_embeddings`).
    pub fn new_cache(&self) -> Result<CudaCache, CudaError> {
        let rope = self.cfg.rope_table().map_err(RunError::from)?;
        let mut c = CudaCache {
            len: 0,
            max_len: self.cfg.max_position_embeddings,
            cap: 0,
            segments: Vec::new(),
            blocks: Vec::new(),
            tables: None,
            rope,
            rope_cos: None,
            rope_sin: None,
            rope_rows: 0,
            ws: Workspace::default(),
            model_id: self.id,
            mode: self.decode_mode,
            dec: None,
            linear: LinearCache::new(&self.gpu, &self.cfg)?,
        };
        c.grow(self, self.cfg.max_position_embeddings.min(256))?;
        Ok(c)
    }

    /// Runs `tokens` at positions `cache.len()..` (prefill when several, decode when one) and
    /// appends them to the cache; returns what the CPU backend returns, bit for bit. On error the
    /// cache is left as it was.
    pub fn forward(
        &self,
        cache: &mut CudaCache,
        tokens: &[u32],
        opts: &ForwardOptions,
    ) -> Result<ForwardOutput, CudaError> {
        self.forward_hooked(cache, tokens, opts, None)
    }

    /// [`CudaModel::forward`], with `hook` shown the step's values (captures only; see
    /// [`CudaModel::forward_seqs_observed`]). With a hook, one token takes the per-operation
    /// kernels, not the decode graph (whose fused kernels keep no intermediate).
    fn forward_hooked(
        &self,
        cache: &mut CudaCache,
        tokens: &[u32],
        opts: &ForwardOptions,
        mut hook: Option<&mut dyn tarfa_cpu::StepHook>,
    ) -> Result<ForwardOutput, CudaError> {
        let cfg = &self.cfg;
        self.check_step(cache, tokens)?;
        let pos0 = cache.len;
        let t_count = tokens.len();
        let end = pos0 + t_count;
        Self::check_step_size(t_count)?;
        if t_count == 1
            && hook.is_none()
            && cache.mode != DecodeMode::Legacy
            && self.decode_unsupported.is_none()
            && opts.final_hidden != FinalHidden::InvalidBf16BeforeLmHead
        {
            return self.forward_decode(cache, tokens[0], opts);
        }
        if end > cache.cap {
            let want = end.max(2 * cache.cap).min(cache.max_len);
            cache.grow(self, want)?;
        }
        cache.upload_rope(&self.gpu)?;
        let rows: Vec<usize> = match opts.logits {
            LogitRows::Last => vec![t_count - 1],
            LogitRows::All => (0..t_count).collect(),
        };
        cache
            .ws
            .ensure(&self.gpu, cfg, self.moe_layers, t_count, end, rows.len())?;
        if hook.is_some() {
            cache
                .ws
                .capture
                .ensure(&self.gpu, t_count * cfg.hidden_size * 4, "the captures")?;
        }
        let tiles = cache.ws.attn_tiles(&self.gpu, cfg, &[t_count], end)?;
        let ws = &cache.ws;
        let gpu = &self.gpu;
        let (h, hq, hkv, d) = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        );
        let eps = cfg.eps_f32();
        let k_top = cfg.top_k;

        gpu.write(ws.tokens.ptr(), tokens, "the step's tokens")?;
        self.write_qscale(ws, pos0..end)?;
        // Step 1: h_t = widen(embed[token_t])
        ops::embed(gpu, &self.embed, ws.tokens.ptr(), t_count, ws.h.ptr())?;

        let shape = AttnShape {
            hq,
            hkv,
            d,
            rd: cfg.rotary_dim,
            cap: cache.cap,
            pos0,
            tokens: t_count,
        };
        // Steps 3 and 4 of every layer: attention, then the MLP (steps.rs)
        let linear: Vec<_> = steps::LinearSegment::of(cache, 0, t_count, cfg.num_layers)
            .into_iter()
            .collect();
        let mut steps = steps::OpSteps {
            model: self,
            ws,
            kv: steps::StepKv::One(cache),
            tiles,
            shape,
            scale: (1.0f64 / (d as f64).sqrt()) as f32,
            linear,
            hook: hook
                .as_mut()
                .map(|k| &mut **k as &mut dyn tarfa_cpu::StepHook),
            layer: 0,
        };
        self.walk_layers(&mut steps)?;
        steps.after_layers()?;

        // Step 5: hn = RMSNorm(h) of the requested rows (contiguous: the last, or all), logits
        let first = rows[0];
        let n_rows = rows.len();
        ops::rmsnorm(
            gpu,
            ws.h.ptr() + (first * h * 4) as u64,
            h,
            ws.hn.ptr(),
            h,
            self.final_norm.ptr(),
            h,
            n_rows,
            eps,
        )?;
        if opts.final_hidden == FinalHidden::InvalidBf16BeforeLmHead {
            ops::round_to_bf16(gpu, ws.hn.ptr(), n_rows * h)?;
        }
        let lm = self.lm_head.as_ref().unwrap_or(&self.embed);
        let vocab = cfg.vocab_size;
        ops::matmul(
            gpu,
            lm,
            ws.hn.ptr(),
            h,
            0,
            ws.logits.ptr(),
            vocab,
            n_rows,
            false,
        )?;

        let logits: Vec<Vec<f32>> = gpu.read_rows(ws.logits.ptr(), n_rows, vocab, "the logits")?;
        let per_layer = t_count * k_top;
        let ids: Vec<u32> = gpu.read(
            ws.ids.ptr(),
            self.moe_layers * per_layer,
            "the router's choices",
        )?;
        let stats = self.step_stats(t_count, &ids);
        self.step_done()?;
        let router = if opts.trace_router {
            let rec = ws.records();
            self.router_records_at(rec, pos0, t_count, &ids)?
        } else {
            Vec::new()
        };
        cache.advance(end);
        Ok(ForwardOutput {
            logits,
            router,
            stats,
        })
    }

    /// What one sequence brings to a step: a cache of this model, tokens in the vocabulary, room
    /// in its context.
    fn check_step(&self, cache: &CudaCache, tokens: &[u32]) -> Result<(), CudaError> {
        let cfg = &self.cfg;
        if cache.model_id != self.id {
            return Err(CudaError::Internal(
                "a KV cache made by another model".into(),
            ));
        }
        if tokens.is_empty() {
            return Err(RunError::EmptyStep.into());
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(RunError::TokenOutOfRange {
                token: bad,
                vocab: cfg.vocab_size,
            }
            .into());
        }
        let end = cache.len + tokens.len();
        if end > cache.max_len {
            return Err(RunError::ContextFull {
                needed: end,
                max: cache.max_len,
            }
            .into());
        }
        Ok(())
    }

    /// The tokens of a step are a grid dimension of the kernels (at most 65,535 blocks).
    fn check_step_size(t_count: usize) -> Result<(), CudaError> {
        if t_count > 65535 {
            return Err(CudaError::TooManyTokens {
                tokens: t_count,
                max: 65535,
            });
        }
        Ok(())
    }

    /// One step over several sequences ([`tarfa_core::Backend::forward_batch`]): every entry's
    /// tokens at positions `cache.len()..` of its own cache, all of them in one pass of the
    /// token-tiled kernels, so each weight is read once per tile of the step's tokens (and each
    /// expert once per tile of the pairs that chose it). Each sequence's output is bit-identical
    /// to [`CudaModel::forward`] on it alone (docs/EXACTNESS.md section 9): every output of every
    /// kernel is one reduction over one token's own values, in the canonical order, and
    /// attention reads only the token's own cache. All or nothing: on an error no cache has
    /// advanced. One entry runs [`CudaModel::forward`] itself.
    pub fn forward_seqs(
        &self,
        seqs: &mut [BatchEntry<'_, CudaCache>],
    ) -> Result<Vec<ForwardOutput>, BatchError<CudaError>> {
        for (i, s) in seqs.iter().enumerate() {
            self.check_step(s.cache, s.tokens)
                .map_err(|error| BatchError {
                    sequence: Some(i),
                    error,
                })?;
        }
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        self.forward_seqs_hooked(seqs, None)
    }

    /// [`CudaModel::forward_seqs`] with `hook` shown the step's values at the points where the
    /// CPU backend shows them ([`tarfa_cpu::StepHook`]), the same shapes, the same token order
    /// and the same bits: the hidden rows entering each layer and after the last, each layer's
    /// attention and MLP outputs, a MoE layer's router logits and probabilities, and each chosen
    /// expert's output before its weight; only what [`StepHook::wants`] asks for is copied
    /// back. Captures only: a hook that intervenes ([`StepHook::intervention`] says so) is
    /// refused by that name before any work, and one that writes to a value it is shown, or
    /// forces an expert, anyway fails the step ([`RunError::Intervention`]; no cache advanced).
    /// The step's own values are computed by the same kernels as without a hook (the outputs
    /// are the same bits); the captures that no kernel of the step materialises are written by
    /// capture-only launches of existing kernels (see `OpSteps`). Never polls
    /// [`StepHook::interrupted`]: a step on CUDA is not interrupted inside.
    ///
    /// [`StepHook::wants`]: tarfa_cpu::StepHook::wants
    /// [`StepHook::intervention`]: tarfa_cpu::StepHook::intervention
    /// [`StepHook::interrupted`]: tarfa_cpu::StepHook::interrupted
    pub fn forward_seqs_observed(
        &self,
        seqs: &mut [BatchEntry<'_, CudaCache>],
        hook: &mut dyn tarfa_cpu::StepHook,
    ) -> Result<Vec<ForwardOutput>, BatchError<CudaError>> {
        if let Some(what) = hook.intervention() {
            return Err(BatchError::whole(refused(&what)));
        }
        self.forward_seqs_hooked(seqs, Some(hook))
    }

    fn forward_seqs_hooked(
        &self,
        seqs: &mut [BatchEntry<'_, CudaCache>],
        hook: Option<&mut dyn tarfa_cpu::StepHook>,
    ) -> Result<Vec<ForwardOutput>, BatchError<CudaError>> {
        for (i, s) in seqs.iter().enumerate() {
            self.check_step(s.cache, s.tokens)
                .map_err(|error| BatchError {
                    sequence: Some(i),
                    error,
                })?;
        }
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        if seqs.len() == 1 {
            let s = &mut seqs[0];
            return self
                .forward_hooked(s.cache, s.tokens, &s.opts, hook)
                .map(|o| vec![o])
                .map_err(BatchError::whole);
        }
        let t_total: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        Self::check_step_size(t_total).map_err(BatchError::whole)?;
        // the first cache's workspace serves the step; it goes back whatever happens
        let mut ws = std::mem::take(&mut seqs[0].cache.ws);
        let out = self.forward_seqs_in(&mut ws, seqs, t_total, hook);
        seqs[0].cache.ws = ws;
        out.map_err(BatchError::whole)
    }

    fn forward_seqs_in(
        &self,
        ws: &mut Workspace,
        seqs: &mut [BatchEntry<'_, CudaCache>],
        t_total: usize,
        mut hook: Option<&mut dyn tarfa_cpu::StepHook>,
    ) -> Result<Vec<ForwardOutput>, CudaError> {
        let cfg = &self.cfg;
        let gpu = &self.gpu;
        let (h, hq, hkv, d) = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        );
        // room in every cache first: nothing below can fail for want of it
        let mut longest = 0;
        for s in seqs.iter_mut() {
            let end = s.cache.len + s.tokens.len();
            if end > s.cache.cap {
                let want = end.max(2 * s.cache.cap).min(s.cache.max_len);
                s.cache.grow(self, want)?;
            }
            s.cache.upload_rope(gpu)?;
            longest = longest.max(end);
        }
        // the logit rows each entry asked for, contiguous per entry
        let rows_of = |s: &BatchEntry<'_, CudaCache>| match s.opts.logits {
            LogitRows::Last => 1,
            LogitRows::All => s.tokens.len(),
        };
        let n_rows: usize = seqs.iter().map(rows_of).sum();
        ws.ensure(gpu, cfg, self.moe_layers, t_total, longest, n_rows)?;
        if hook.is_some() {
            ws.capture.ensure(gpu, t_total * h * 4, "the captures")?;
        }
        let seq_tokens: Vec<usize> = seqs.iter().map(|s| s.tokens.len()).collect();
        let tiles = ws.attn_tiles(gpu, cfg, &seq_tokens, longest)?;
        // RoPE table rows hold rotary_dim / 2 values
        let half = cfg.rotary_dim / 2;
        let mut tokens = Vec::with_capacity(t_total);
        let mut tok = Vec::with_capacity(4 * t_total);
        let mut kv = vec![0u64; 2 * cfg.num_layers * t_total];
        let mut t = 0;
        for s in seqs.iter() {
            let c = &*s.cache;
            let (cos, sin) = c.rope_ptrs();
            for (i, &token) in s.tokens.iter().enumerate() {
                let pos = c.len + i;
                tokens.push(token);
                tok.extend([
                    cos + (pos * half * 4) as u64,
                    sin + (pos * half * 4) as u64,
                    pos as u64,
                    c.cap as u64,
                ]);
                for l in 0..cfg.num_layers {
                    let at = 2 * (l * t_total + t);
                    kv[at] = c.k_table(l);
                    kv[at + 1] = c.v_table(l);
                }
                t += 1;
            }
        }
        gpu.write(ws.tokens.ptr(), &tokens, "the step's tokens")?;
        self.write_qscale(ws, tok.chunks_exact(4).map(|r| r[2] as usize))?;
        gpu.write(ws.seq_tok.ptr(), &tok, "the step's token table")?;
        gpu.write(ws.seq_kv.ptr(), &kv, "the step's cache table")?;
        let tables = SeqTables {
            tok: ws.seq_tok.ptr(),
            kv: ws.seq_kv.ptr(),
            tokens: t_total,
        };
        ops::embed(gpu, &self.embed, ws.tokens.ptr(), t_total, ws.h.ptr())?;
        let shape = AttnShape {
            hq,
            hkv,
            d,
            rd: cfg.rotary_dim,
            cap: 0,
            pos0: 0,
            tokens: t_total,
        };
        let mut linear = Vec::new();
        let mut start = 0;
        for s in seqs.iter() {
            linear.extend(steps::LinearSegment::of(
                s.cache,
                start,
                s.tokens.len(),
                cfg.num_layers,
            ));
            start += s.tokens.len();
        }
        let mut steps = steps::OpSteps {
            model: self,
            ws,
            kv: steps::StepKv::Seqs {
                tables,
                n_stride: longest,
            },
            tiles,
            shape,
            scale: (1.0f64 / (d as f64).sqrt()) as f32,
            linear,
            hook: hook
                .as_mut()
                .map(|k| &mut **k as &mut dyn tarfa_cpu::StepHook),
            layer: 0,
        };
        self.walk_layers(&mut steps)?;
        steps.after_layers()?;

        // final norm of each entry's rows into hn, one after another; then one lm_head product
        let eps = cfg.eps_f32();
        let (mut first, mut row) = (0usize, 0usize);
        for s in seqs.iter() {
            let n = rows_of(s);
            let from = first + s.tokens.len() - n;
            ops::rmsnorm(
                gpu,
                ws.h.ptr() + (from * h * 4) as u64,
                h,
                ws.hn.ptr() + (row * h * 4) as u64,
                h,
                self.final_norm.ptr(),
                h,
                n,
                eps,
            )?;
            if s.opts.final_hidden == FinalHidden::InvalidBf16BeforeLmHead {
                ops::round_to_bf16(gpu, ws.hn.ptr() + (row * h * 4) as u64, n * h)?;
            }
            first += s.tokens.len();
            row += n;
        }
        let lm = self.lm_head.as_ref().unwrap_or(&self.embed);
        let vocab = cfg.vocab_size;
        ops::matmul(
            gpu,
            lm,
            ws.hn.ptr(),
            h,
            0,
            ws.logits.ptr(),
            vocab,
            n_rows,
            false,
        )?;
        let mut rows_left = gpu
            .read_rows::<f32>(ws.logits.ptr(), n_rows, vocab, "the logits")?
            .into_iter();
        let k_top = cfg.top_k;
        let ids: Vec<u32> = gpu.read(
            ws.ids.ptr(),
            self.moe_layers * t_total * k_top,
            "the router's choices",
        )?;
        let records = if seqs.iter().any(|s| s.opts.trace_router) {
            let rec = ws.records();
            Some(self.read_records(rec, t_total)?)
        } else {
            None
        };
        self.step_done()?;
        let mut outs = Vec::with_capacity(seqs.len());
        let mut first = 0usize;
        for s in seqs.iter_mut() {
            let (n_tok, n) = (s.tokens.len(), rows_of(s));
            // the rows were read in entry order, each entry's contiguous
            let logits = rows_left.by_ref().take(n).collect();
            // this sequence's choices, as a step of its tokens alone lays them out
            let own: Vec<u32> = (0..self.moe_layers)
                .flat_map(|ml| {
                    let at = (ml * t_total + first) * k_top;
                    ids[at..at + n_tok * k_top].iter().copied()
                })
                .collect();
            let stats = self.step_stats(n_tok, &own);
            let router = match (&records, s.opts.trace_router) {
                (Some(a), true) => {
                    self.records_of(a, t_total, &ids, first..first + n_tok, s.cache.len)
                }
                _ => Vec::new(),
            };
            s.cache.advance(s.cache.len + n_tok);
            outs.push(ForwardOutput {
                logits,
                router,
                stats,
            });
            first += n_tok;
        }
        Ok(outs)
    }

    /// The routed experts of MoE layer `l` from the hot tier (module `hot`): read the router's
    /// choices back, make them resident group by group (copying the missing ones from the
    /// weight source, whose reads for the whole layer start at once), compute each group's
    /// products from the slots, then mix them in ascending expert id as `down_mix` does.
    #[allow(clippy::too_many_arguments)]
    fn stream_moe(
        &self,
        l: usize,
        route: RouteOut,
        t_count: usize,
        ws: &Workspace,
        y_sh: u64,
        s_sh: u64,
        math: ops::ExpertMath,
    ) -> Result<(), CudaError> {
        let (cfg, gpu) = (&self.cfg, &self.gpu);
        let (h, i, k, e_count) = (
            cfg.hidden_size,
            cfg.expert_width,
            cfg.top_k,
            cfg.num_experts,
        );
        let (Some(hot), Some(source)) = (&self.hot, &self.stream_source) else {
            return Err(CudaError::Internal(format!(
                "layer {l} has neither resident experts nor a hot tier"
            )));
        };
        // Waits for the stream: every copy queued by the layer before has run.
        let ids: Vec<u32> = gpu.read(route.ids, t_count * k, "the router's choices")?;
        let mut hot = hot.lock().unwrap_or_else(|p| p.into_inner());
        hot.in_flight.clear();
        hot.map_row = 0;
        let mut need: Vec<usize> = ids.iter().map(|&e| e as usize).collect();
        need.sort_unstable();
        need.dedup();
        if let Some(&bad) = need.iter().find(|&&e| e >= e_count) {
            return Err(CudaError::Internal(format!(
                "layer {l}: the router chose expert {bad} of {e_count}"
            )));
        }
        let groups = hot.plan(l, &need);
        // What must be copied, in the warm tier's batches, announced for the whole layer at
        // once: its reads run while the groups before compute.
        let fetch: Vec<Vec<Vec<usize>>> = groups
            .iter()
            .map(|g| {
                let miss: Vec<usize> = g
                    .iter()
                    .copied()
                    .filter(|&x| hot.slot((l, x)).is_none())
                    .collect();
                if miss.is_empty() {
                    Vec::new()
                } else {
                    source.expert_batches(l, &miss)
                }
            })
            .collect();
        let all: Vec<Vec<usize>> = fetch.iter().flatten().cloned().collect();
        if !all.is_empty() {
            source.prefetch(l, &all);
        }
        let misses: usize = all.iter().map(Vec::len).sum();
        let hits: Vec<usize> = need
            .iter()
            .copied()
            .filter(|&x| hot.slot((l, x)).is_some())
            .collect();
        if hits.len() + misses != need.len() {
            return Err(CudaError::Internal(format!(
                "layer {l}: the warm tier's batches do not cover the missing experts"
            )));
        }
        source.record_uses(l, &hits);
        hot.stats.requests += need.len() as u64;
        hot.stats.hits += hits.len() as u64;
        let slot_bytes = hot.slot_bytes();
        let m_bytes = (2 * i * h) as u64;
        let mut map = vec![-1i32; e_count];
        for (g, batches) in groups.iter().zip(&fetch) {
            for &x in g {
                hot.touch((l, x));
            }
            for b in batches {
                if !hot.in_flight.is_empty() {
                    // The warm tier may need the room of the experts just copied before it can
                    // hand out the next ones: let their copies finish, then give them back.
                    let t = Instant::now();
                    gpu.sync("the copies of experts to the device")?;
                    hot.in_flight.clear();
                    hot.stats.h2d_ns += t.elapsed().as_nanos() as u64;
                }
                let t0 = Instant::now();
                let handles = source.expert_data(l, b)?;
                hot.stats.fetch_wait_ns += t0.elapsed().as_nanos() as u64;
                if handles.len() != b.len() {
                    return Err(CudaError::Internal(format!(
                        "layer {l}: asked for {} experts, got {}",
                        b.len(),
                        handles.len()
                    )));
                }
                let t1 = Instant::now();
                for (&x, hd) in b.iter().zip(&handles) {
                    let [gm, um, dm] = hd.matrices();
                    let shapes = [(gm.rows, gm.cols), (um.rows, um.cols), (dm.rows, dm.cols)];
                    if shapes != [(i, h), (i, h), (h, i)] {
                        return Err(WeightError::ShapeMismatch {
                            name: format!("layer {l} expert {x}"),
                            expected: vec![i, h, i, h, h, i],
                            found: shapes.iter().flat_map(|&(r, c)| [r, c]).collect(),
                        }
                        .into());
                    }
                    let slot = hot.place((l, x), g)?;
                    let base = hot.pool.ptr() + slot as u64 * slot_bytes;
                    // Queued behind the kernels of the groups before, which may still read
                    // the expert this slot held.
                    let copied = gpu
                        .write_async(base, gm.data, "an expert's gate matrix")
                        .and_then(|_| {
                            gpu.write_async(base + m_bytes, um.data, "an expert's up matrix")
                        })
                        .and_then(|_| {
                            gpu.write_async(base + 2 * m_bytes, dm.data, "an expert's down matrix")
                        });
                    if let Err(e) = copied {
                        // never let a later step take this slot for the expert
                        hot.forget((l, x));
                        return Err(e);
                    }
                    hot.stats.uploads += 1;
                    hot.stats.h2d_bytes += 3 * m_bytes;
                }
                hot.in_flight.extend(handles);
                hot.stats.h2d_ns += t1.elapsed().as_nanos() as u64;
            }
            map.fill(-1);
            for &x in g {
                let slot = hot.slot((l, x)).ok_or_else(|| {
                    CudaError::Internal(format!(
                        "layer {l}: expert {x} left the hot tier before its group ran"
                    ))
                })?;
                map[x] = slot as i32;
            }
            if hot.map_row > e_count {
                // more groups than rows (cannot happen: a group holds at least one expert)
                gpu.sync("the hot tier's slot maps")?;
                hot.map_row = 0;
            }
            let row = hot.map_row;
            hot.map_row += 1;
            let slot_of = hot.slot_of.ptr();
            let staged = hot.maps.slice_mut::<i32>(row * e_count * 4, e_count);
            staged.copy_from_slice(&map);
            let staged: &[i32] = staged;
            gpu.write_async(slot_of, staged, "the hot tier's slot map")?;
            let slots = SlotTable {
                pool: hot.pool.ptr(),
                slot_elems: hot.slot_elems,
                slot_of: hot.slot_of.ptr(),
            };
            // Llama 4: the inputs scale_slots wrote (OpSteps::experts)
            let xn = if math.input_scaled {
                ws.x_slots.ptr()
            } else {
                ws.xn.ptr()
            };
            ops::gate_up_slots(
                gpu,
                slots,
                i,
                h,
                route.ids,
                k,
                xn,
                ws.act.ptr(),
                t_count,
                math,
            )?;
            ops::down_slots(
                gpu,
                slots,
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
        hot.end_layer();
        ops::moe_mix(
            gpu,
            h,
            route,
            k,
            ws.y_experts.ptr(),
            y_sh,
            s_sh,
            ws.h.ptr(),
            t_count,
            math,
        )
    }

    /// The experts' function of layer `l` beyond the SwiGLU (its biases, gpt-oss's clamped
    /// SwiGLU; kernels/moe.cu `ExpertMath`).
    pub(super) fn expert_math(&self, l: usize) -> ops::ExpertMath {
        let mut m = ops::ExpertMath::default();
        if let DevMlp::Moe {
            expert_bias: Some(b),
            ..
        } = &self.layers[l].mlp
        {
            m.bias_gate = b.gate.ptr();
            m.bias_up = b.up.ptr();
            m.bias_down = b.down.ptr();
        }
        if let tarfa_core::model::ExpertActivation::ClampedSwiGlu { alpha, limit } =
            self.spec.extras.activation
        {
            m.clamp = Some((alpha, limit));
        }
        m.input_scaled = self.spec.router == RouterRule::SigmoidScalesInput;
        m
    }

    /// Llama 4: the step's per-token attention temperatures (positions in step order), for the
    /// NoPE layers' queries; nothing for the other families.
    fn write_qscale(
        &self,
        ws: &Workspace,
        positions: impl Iterator<Item = usize>,
    ) -> Result<(), CudaError> {
        let Some(t) = &self.cfg.attn_temperature else {
            return Ok(());
        };
        let s: Vec<f32> = positions.map(|p| t.scale_at(p)).collect();
        self.gpu
            .write(ws.qscale.ptr(), &s, "the step's attention temperatures")
    }

    /// Layer `l`'s rotation and norms before the cache append: Llama 4's pairs, NoPE layers and
    /// their temperature, the L2 norm after the rotation; the rotate-half rotation otherwise.
    fn rope_form(&self, l: usize, ws: &Workspace) -> ops::RopeForm {
        let rotates = self.cfg.layer_rope.get(l).copied().unwrap_or(true);
        ops::RopeForm {
            pairs: self.spec.extras.llama4_attention,
            none: !rotates,
            l2: (rotates && self.spec.qk_norm == QkNorm::L2AfterRope).then(|| self.cfg.eps_f32()),
            qscale: if !rotates && self.cfg.attn_temperature.is_some() {
                ws.qscale.ptr()
            } else {
                0
            },
        }
    }

    /// What layer `l`'s attention masks beyond causality: its sinks, window and chunk.
    pub(super) fn attn_mask(&self, l: usize) -> ops::AttnMask {
        let sinks = match &self.layers[l].attn {
            DevAttn::Gqa(a) => a.sinks.as_ref().map_or(0, |b| b.ptr()),
            DevAttn::Mla(_) | DevAttn::Linear(_) => 0,
        };
        ops::AttnMask {
            sinks,
            window: self
                .cfg
                .layer_windows
                .get(l)
                .copied()
                .flatten()
                .unwrap_or(0),
            chunk: self.cfg.layer_chunks.get(l).copied().flatten().unwrap_or(0),
        }
    }

    /// The hot tier's counters (`None` when every expert is resident).
    pub fn hot_stats(&self) -> Option<HotStats> {
        self.hot
            .as_ref()
            .map(|h| h.lock().unwrap_or_else(|p| p.into_inner()).stats)
    }

    /// Records the device memory in use now in the hot tier's peak.
    /// After a step's logits were read (which waited for the stream): the VRAM peak noted, and
    /// the hot tier's copies of the step known to have run.
    fn step_done(&self) -> Result<(), CudaError> {
        self.note_vram()?;
        if let Some(hot) = &self.hot {
            hot.lock()
                .unwrap_or_else(|p| p.into_inner())
                .in_flight
                .clear();
        }
        Ok(())
    }

    fn note_vram(&self) -> Result<(), CudaError> {
        if let Some(hot) = &self.hot {
            let (free, total) = self.gpu.mem_info()?;
            let used = total.saturating_sub(free) as u64;
            let mut hot = hot.lock().unwrap_or_else(|p| p.into_inner());
            hot.stats.peak_vram_bytes = hot.stats.peak_vram_bytes.max(used);
        }
        Ok(())
    }

    /// The CPU's statistics for this step: every matrix applied once, each distinct expert a
    /// layer's tokens chose, the embedding rows.
    /// The counters of a one-token step: its k experts per MoE layer are distinct, whichever
    /// they are.
    pub(crate) fn one_token_stats(&self) -> StepStats {
        let k = self.cfg.top_k as u32;
        let ids: Vec<u32> = (0..self.moe_layers).flat_map(|_| 0..k).collect();
        self.step_stats(1, &ids)
    }

    fn step_stats(&self, t_count: usize, ids: &[u32]) -> StepStats {
        let cfg = &self.cfg;
        let mut s = StepStats {
            weight_bytes: (t_count * cfg.hidden_size * self.embed.dtype.size()) as u64,
            experts_fetched: 0,
        };
        let per_layer = t_count * cfg.top_k;
        let expert_bytes = 3 * 2 * (cfg.expert_width * cfg.hidden_size) as u64;
        for layer in &self.layers {
            s.weight_bytes += layer.attn.bytes();
            match &layer.mlp {
                DevMlp::Dense(m) => {
                    s.weight_bytes += m.gate.bytes() + m.up.bytes() + m.down.bytes()
                }
                DevMlp::Moe {
                    router,
                    shared,
                    moe_index,
                    ..
                } => {
                    s.weight_bytes += router.bytes();
                    let chosen = &ids[moe_index * per_layer..(moe_index + 1) * per_layer];
                    let distinct: BTreeSet<u32> = chosen.iter().copied().collect();
                    s.weight_bytes += distinct.len() as u64 * expert_bytes;
                    s.experts_fetched += distinct.len() as u64;
                    if let Some(sh) = shared {
                        let m = sh.mlp();
                        s.weight_bytes += m.gate.bytes()
                            + m.up.bytes()
                            + sh.gate().map_or(0, DevMat::bytes)
                            + m.down.bytes();
                    }
                }
            }
        }
        s.weight_bytes += self.lm_head.as_ref().unwrap_or(&self.embed).bytes();
        s
    }

    fn router_records_at(
        &self,
        rec: RecordPtrs,
        pos0: usize,
        t_count: usize,
        ids: &[u32],
    ) -> Result<Vec<RouterRecord>, CudaError> {
        let arrays = self.read_records(rec, t_count)?;
        Ok(self.records_of(&arrays, t_count, ids, 0..t_count, pos0))
    }

    /// The router's records of a step of `t_count` tokens, copied back.
    fn read_records(&self, rec: RecordPtrs, t_count: usize) -> Result<RecordArrays, CudaError> {
        let n = self.moe_layers * t_count * self.cfg.top_k;
        let rows = self.moe_layers * t_count;
        Ok(RecordArrays {
            probs: self.gpu.read(rec.probs, n, "the router's probabilities")?,
            weights: self.gpu.read(rec.weights, n, "the router's weights")?,
            kth: self
                .gpu
                .read(rec.kth, rows, "the router's k-th probabilities")?,
            next: self
                .gpu
                .read(rec.next, rows, "the router's next probabilities")?,
        })
    }

    /// The records of the step's tokens `tokens` (of `t_count`), the first at position `pos0`.
    fn records_of(
        &self,
        a: &RecordArrays,
        t_count: usize,
        ids: &[u32],
        tokens: std::ops::Range<usize>,
        pos0: usize,
    ) -> Vec<RouterRecord> {
        let k = self.cfg.top_k;
        let mut out = Vec::new();
        for (l, layer) in self.layers.iter().enumerate() {
            let DevMlp::Moe { moe_index, .. } = &layer.mlp else {
                continue;
            };
            for t in tokens.clone() {
                let row = moe_index * t_count + t;
                let r = row * k..(row + 1) * k;
                out.push(RouterRecord {
                    layer: l,
                    moe_layer: *moe_index,
                    position: pos0 + (t - tokens.start),
                    experts: ids[r.clone()].to_vec(),
                    probs: a.probs[r.clone()].to_vec(),
                    weights: a.weights[r].to_vec(),
                    kth_prob: a.kth[row],
                    next_prob: (self.cfg.num_experts > k).then_some(a.next[row]),
                });
            }
        }
        out
    }
}

/// A step's router records on the host.
struct RecordArrays {
    probs: Vec<f32>,
    weights: Vec<f32>,
    kth: Vec<f32>,
    next: Vec<f32>,
}

/// A step over several sequences: where its tables are on the device (`Workspace::seq_tok`,
/// `seq_kv`), for `tokens` tokens. Per token (RoPE cos row, sin row, position, capacity) as four
/// u64; per (layer, token) the token's sequence's (keys, values) of that layer as two.
/// A hook's intervention, refused: this backend shows values, it does not take them back.
pub(super) fn refused(what: &str) -> CudaError {
    RunError::Intervention(format!(
        "{what}: the cuda backend runs captures only; interventions need the CPU backend"
    ))
    .into()
}

#[derive(Clone, Copy)]
pub(super) struct SeqTables {
    tok: u64,
    kv: u64,
    tokens: usize,
}

impl SeqTables {
    /// Layer `l`'s view.
    pub(super) fn layer(&self, l: usize) -> ops::SeqKv {
        ops::SeqKv {
            tok: self.tok,
            kv: self.kv + (l * self.tokens * 16) as u64,
        }
    }
}

/// Where a step's router records are on the device (ids are read separately).
#[derive(Clone, Copy)]
struct RecordPtrs {
    probs: u64,
    weights: u64,
    kth: u64,
    next: u64,
}

/// Uploads matrices of one dtype and width into one allocation, one after another (the decode
/// kernels then read q, k and v as one matrix); otherwise each into its own.
fn upload_stacked<const N: usize>(
    gpu: &Gpu,
    ms: [&Matrix; N],
    what: &str,
) -> Result<[DevMat; N], CudaError> {
    let refs: Vec<MatrixRef> = ms.iter().map(|m| m.as_ref()).collect();
    let same = refs.windows(2).all(|w| match (w[0], w[1]) {
        (MatrixRef::Bf16 { cols: a, .. }, MatrixRef::Bf16 { cols: b, .. }) => a == b,
        (MatrixRef::F32 { cols: a, .. }, MatrixRef::F32 { cols: b, .. }) => a == b,
        _ => false,
    });
    if !same {
        let mut v = Vec::with_capacity(N);
        for m in ms {
            v.push(upload_matrix(gpu, m, what)?);
        }
        return Ok(v.try_into().unwrap_or_else(|_| unreachable!("N matrices")));
    }
    let total: u64 = refs.iter().map(|r| r.bytes()).sum();
    let buf = std::sync::Arc::new(gpu.alloc(total as usize, what)?);
    let mut off = 0u64;
    let mut v = Vec::with_capacity(N);
    for r in refs {
        let (rows, cols, dtype) = match r {
            MatrixRef::Bf16 { rows, cols, data } => {
                gpu.write(buf.ptr() + off, data, what)?;
                (rows, cols, DType::Bf16)
            }
            MatrixRef::F32 { rows, cols, data } => {
                gpu.write(buf.ptr() + off, data, what)?;
                (rows, cols, DType::F32)
            }
        };
        v.push(DevMat {
            buf: buf.clone(),
            off,
            rows,
            cols,
            dtype,
        });
        off += r.bytes();
    }
    Ok(v.try_into().unwrap_or_else(|_| unreachable!("N matrices")))
}

fn upload_matrix(gpu: &Gpu, m: &Matrix, what: &str) -> Result<DevMat, CudaError> {
    Ok(match m.as_ref() {
        MatrixRef::Bf16 { rows, cols, data } => {
            DevMat::own(gpu.upload(data, what)?, rows, cols, DType::Bf16)
        }
        MatrixRef::F32 { rows, cols, data } => {
            DevMat::own(gpu.upload(data, what)?, rows, cols, DType::F32)
        }
    })
}

/// Uploads every expert of MoE layer `l`, stacked per matrix, checking shapes as the CPU does.
fn upload_experts(
    gpu: &Gpu,
    cfg: &MoeConfig,
    source: &dyn WeightSource,
    l: usize,
) -> Result<DevExperts, CudaError> {
    let (e_count, h, i) = (cfg.num_experts, cfg.hidden_size, cfg.expert_width);
    let per = i * h; // elements of one matrix
    let what = |m: &str| format!("layer {l} experts' {m} matrices");
    let gate = gpu.alloc(e_count * per * 2, &what("gate"))?;
    let up = gpu.alloc(e_count * per * 2, &what("up"))?;
    let down = gpu.alloc(e_count * per * 2, &what("down"))?;
    // a bounded batch of experts per call keeps host memory small for streaming sources
    let batch = 16usize;
    for start in (0..e_count).step_by(batch) {
        let ids: Vec<usize> = (start..(start + batch).min(e_count)).collect();
        let got: Vec<Arc<ExpertWeights>> = source.experts(l, &ids)?;
        if got.len() != ids.len() {
            return Err(RunError::SourceContract(format!(
                "experts() returned {} experts for {} ids",
                got.len(),
                ids.len()
            ))
            .into());
        }
        for (ew, &e) in got.iter().zip(&ids) {
            for (m, rows, cols, name) in [
                (&ew.gate, i, h, "gate"),
                (&ew.up, i, h, "up"),
                (&ew.down, h, i, "down"),
            ] {
                if m.rows != rows || m.cols != cols || m.data.len() != rows * cols {
                    return Err(WeightError::ShapeMismatch {
                        name: format!("layer {l} expert {e} {name}"),
                        expected: vec![rows, cols],
                        found: vec![m.rows, m.cols],
                    }
                    .into());
                }
            }
            let off = (e * per * 2) as u64;
            gpu.write(gate.ptr() + off, &ew.gate.data, &what("gate"))?;
            gpu.write(up.ptr() + off, &ew.up.data, &what("up"))?;
            gpu.write(down.ptr() + off, &ew.down.data, &what("down"))?;
        }
    }
    Ok(DevExperts { gate, up, down })
}

/// The cache's rows per (layer, position): (heads, key width, value width). Grouped-query
/// attention keeps each KV head's key and value; multi-head latent attention one latent row of
/// kv_lora_rank + rope dim and no value (tarfa-cpu's `new_cache`).
fn kv_rows(cfg: &MoeConfig) -> (usize, usize, usize) {
    match &cfg.mla {
        Some(m) => (1, m.latent_width(), 0),
        None => (cfg.num_kv_heads, cfg.head_dim, cfg.head_dim),
    }
}

/// Positions per block of the paged KV cache (kernels/common.cuh `TARFA_KV_BLOCK`).
pub(crate) const KV_BLOCK: usize = 64;

/// One sequence on the GPU: its KV cache, RoPE rows and the step workspace.
///
/// The KV cache is paged (kernels/common.cuh `kv_row`): blocks of [`KV_BLOCK`] positions, each
/// holding every attention layer's keys `[Hkv][KV_BLOCK][D]` (after norm and RoPE) and values,
/// reached through per-layer tables of block addresses. It grows by allocating a segment of new
/// blocks and rewriting the (small) tables: the cached rows never move, so growth copies nothing
/// and needs no second copy of the cache on the device while it happens.
pub struct CudaCache {
    len: usize,
    max_len: usize,
    /// Positions with blocks (a multiple of [`KV_BLOCK`]).
    cap: usize,
    /// The blocks' memory, in the order allocated; a segment holds blocks of consecutive
    /// positions, every attention layer's keys and values in each block.
    segments: Vec<DevBuf>,
    /// Block b's device address (positions `b * KV_BLOCK ..`).
    blocks: Vec<u64>,
    /// The block tables: `[layer][keys | values][cap / KV_BLOCK]` device addresses (0 for a
    /// layer without KV rows, and for MLA's values, which it does not cache).
    tables: Option<DevBuf>,
    rope: RopeTable,
    rope_cos: Option<DevBuf>,
    rope_sin: Option<DevBuf>,
    /// Rows of the RoPE table on the device.
    rope_rows: usize,
    ws: Workspace,
    model_id: usize,
    /// How decode steps run.
    mode: DecodeMode,
    /// The decode step's buffers, launches and graph (built on the first decode step).
    dec: Option<Box<decode::DecodeCtx>>,
    /// The gated DeltaNet layers' states, when the model has such layers.
    linear: Option<LinearCache>,
}

/// Where one gated DeltaNet layer's step reads its sequence's state and writes the advanced one
/// (`src` 0: zeros, the state at position 0).
#[derive(Clone, Copy, Debug)]
pub(super) struct LinearIo {
    pub(super) conv_src: u64,
    pub(super) conv_dst: u64,
    pub(super) state_src: u64,
    pub(super) state_dst: u64,
}

/// One sequence's gated DeltaNet states on the device, with tarfa-cpu's `KvCache` rules for
/// them: a step reads the committed state and writes the advanced one into a third buffer,
/// which [`CudaCache::advance`] makes the committed one, keeping the state the step started
/// from; a failed step changes nothing. A rewind to the length the last step started at is
/// served from the kept state; any other earlier length empties the cache (the states there
/// were never stored). Each buffer holds, per linear layer in order, its convolution state
/// `[K-1][C]` then its recurrent state `[Hv][Dv][Dk]`.
struct LinearCache {
    bufs: [DevBuf; 3],
    /// Per layer, the byte offset of its states in a buffer (None: an attention layer).
    offsets: Vec<Option<u64>>,
    /// Bytes of one layer's convolution state (its recurrent state follows).
    conv_bytes: u64,
    /// The buffer holding the state at the cache's length; None: zeros (length 0).
    committed: Option<usize>,
    /// The length the last committed step started at, and the buffer of the state there.
    kept: Option<(usize, Option<usize>)>,
}

impl LinearCache {
    /// Zero states for `cfg`'s linear layers; None for a model without them.
    fn new(gpu: &Gpu, cfg: &MoeConfig) -> Result<Option<LinearCache>, CudaError> {
        let Some(d) = &cfg.linear else {
            return Ok(None);
        };
        let per_layer = ((d.conv_state_len() + d.state_len()) * 4) as u64;
        let mut offsets = Vec::with_capacity(cfg.num_layers);
        let mut total = 0u64;
        for l in 0..cfg.num_layers {
            if cfg.layer_linear.get(l).copied().unwrap_or(false) {
                offsets.push(Some(total));
                total += per_layer;
            } else {
                offsets.push(None);
            }
        }
        let what = "the gated DeltaNet states";
        let bytes = total as usize;
        Ok(Some(LinearCache {
            bufs: [
                gpu.alloc(bytes, what)?,
                gpu.alloc(bytes, what)?,
                gpu.alloc(bytes, what)?,
            ],
            offsets,
            conv_bytes: (d.conv_state_len() * 4) as u64,
            committed: None,
            kept: None,
        }))
    }

    /// The buffer a step writes: neither the committed one nor the kept one.
    fn pending(&self) -> usize {
        let kept = self.kept.and_then(|(_, b)| b);
        (0..3)
            .find(|&i| Some(i) != self.committed && Some(i) != kept)
            .unwrap_or_else(|| unreachable!("three buffers, at most two in use"))
    }

    /// Layer `l`'s state pointers for the next step (None: an attention layer).
    fn io(&self, l: usize) -> Option<LinearIo> {
        let off = self.offsets.get(l).copied().flatten()?;
        let dst = self.bufs[self.pending()].ptr() + off;
        let src = self.committed.map_or(0, |b| self.bufs[b].ptr() + off);
        Some(LinearIo {
            conv_src: src,
            conv_dst: dst,
            state_src: if src == 0 { 0 } else { src + self.conv_bytes },
            state_dst: dst + self.conv_bytes,
        })
    }

    /// The step that started at length `start` committed: its written states become the
    /// cache's, the ones it read are kept.
    fn commit(&mut self, start: usize) {
        let next = self.pending();
        self.kept = Some((start, self.committed));
        self.committed = Some(next);
    }

    /// A rewind to `len` (below the cache's length): whether the state there is held (the kept
    /// one, or zeros at 0). When it is not, the states become zeros.
    fn rewind(&mut self, len: usize) -> bool {
        match self.kept.take() {
            Some((start, state)) if start == len => {
                self.committed = state;
                true
            }
            _ => {
                self.committed = None;
                len == 0
            }
        }
    }
}

impl CudaCache {
    /// Number of positions cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The most positions this cache accepts (`max_position_embeddings`).
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Forgets positions from `len` on; returns the positions kept. The KV rows of every
    /// position are held, so a model of attention layers only keeps `min(len, len())`; a gated
    /// DeltaNet state is held only at the cache's length and at the length the last step started
    /// at (tarfa-cpu's `KvCache::truncate`), so a rewind to any other earlier length empties the
    /// cache and returns 0.
    #[must_use = "a rewind may keep fewer positions than asked: re-feed from what it returns"]
    pub fn truncate(&mut self, len: usize) -> usize {
        if len >= self.len {
            return self.len;
        }
        if let Some(lc) = self.linear.as_mut() {
            if !lc.rewind(len) {
                self.len = 0;
                return 0;
            }
        }
        self.len = len;
        len
    }

    /// Commits the step that brought the cache to `end` positions.
    fn advance(&mut self, end: usize) {
        if let Some(lc) = self.linear.as_mut() {
            lc.commit(self.len);
        }
        self.len = end;
    }

    /// Gated DeltaNet layer `l`'s state pointers for the next step (None: an attention layer
    /// or a model without linear layers).
    pub(super) fn linear_io(&self, l: usize) -> Option<LinearIo> {
        self.linear.as_ref()?.io(l)
    }

    fn rope_ptrs(&self) -> (u64, u64) {
        (
            self.rope_cos.as_ref().map_or(0, |b| b.ptr()),
            self.rope_sin.as_ref().map_or(0, |b| b.ptr()),
        )
    }

    /// Layer `l`'s keys' block table (kernels take it where a cache's keys go).
    pub(super) fn k_table(&self, l: usize) -> u64 {
        self.table(2 * l)
    }

    /// Layer `l`'s values' block table (MLA's: all zeros, it caches no values).
    pub(super) fn v_table(&self, l: usize) -> u64 {
        self.table(2 * l + 1)
    }

    fn table(&self, i: usize) -> u64 {
        let blocks = self.cap / KV_BLOCK;
        self.tables
            .as_ref()
            .map_or(0, |t| t.ptr() + (i * blocks * 8) as u64)
    }

    /// Gives the KV cache room for `cap` positions (rounded up to whole blocks): new blocks in
    /// one new segment, then new tables that list the old blocks and the new. Nothing cached
    /// moves. On error the cache is as it was.
    fn grow(&mut self, model: &CudaModel, cap: usize) -> Result<(), CudaError> {
        let cfg = &model.cfg;
        let gpu = &model.gpu;
        let (hkv, d, dv) = kv_rows(cfg);
        let cap = cap.div_ceil(KV_BLOCK) * KV_BLOCK;
        if cap <= self.cap {
            return Ok(());
        }
        let blocks = cap / KV_BLOCK;
        // a block: each attention layer's keys then its values, layer after layer (a gated
        // DeltaNet layer caches no rows; MLA caches no values)
        let (k_bytes, v_bytes) = (hkv * KV_BLOCK * d * 4, hkv * KV_BLOCK * dv * 4);
        let mut offsets = vec![None; cfg.num_layers];
        let mut block_bytes = 0usize;
        for (l, off) in offsets.iter_mut().enumerate() {
            if !cfg.layer_linear.get(l).copied().unwrap_or(false) {
                *off = Some(block_bytes as u64);
                block_bytes += k_bytes + v_bytes;
            }
        }
        let fresh = blocks - self.blocks.len();
        let seg = gpu.alloc(
            (fresh * block_bytes).max(4),
            &format!("the KV cache (positions {} to {cap})", self.cap),
        )?;
        let mut all = self.blocks.clone();
        all.extend((0..fresh).map(|b| seg.ptr() + (b * block_bytes) as u64));
        // the tables, [layer][keys | values][blocks]
        let mut host = vec![0u64; 2 * cfg.num_layers * blocks];
        for (l, off) in offsets.iter().enumerate() {
            let Some(off) = off else { continue };
            for (b, &base) in all.iter().enumerate() {
                host[2 * l * blocks + b] = base + off;
                if v_bytes > 0 {
                    host[(2 * l + 1) * blocks + b] = base + off + k_bytes as u64;
                }
            }
        }
        let tables = gpu.alloc(host.len() * 8, "the KV block tables")?;
        gpu.write(tables.ptr(), &host, "the KV block tables")?;
        self.segments.push(seg);
        self.blocks = all;
        self.tables = Some(tables);
        self.cap = cap;
        // the RoPE rows (rotary_dim / 2 values each) move to a table of the new capacity
        let half = self.rope.inv_freq().len();
        self.rope_cos = Some(gpu.alloc(cap * half * 4, "the RoPE cos table")?);
        self.rope_sin = Some(gpu.alloc(cap * half * 4, "the RoPE sin table")?);
        self.rope_rows = 0;
        Ok(())
    }

    /// Makes sure the device holds the host-computed RoPE rows of every position the cache has
    /// room for, `0..cap`: uploaded once per capacity, not per step, because each upload is a
    /// synchronous copy and a batched step would otherwise make two per sequence.
    fn upload_rope(&mut self, gpu: &Gpu) -> Result<(), CudaError> {
        let end = self.cap;
        if end <= self.rope_rows {
            return Ok(());
        }
        self.rope.ensure(end).map_err(RunError::from)?;
        let half = self.rope.inv_freq().len();
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for pos in self.rope_rows..end {
            let (c, s) = self.rope.row(pos);
            cos.extend_from_slice(c);
            sin.extend_from_slice(s);
        }
        let off = (self.rope_rows * half * 4) as u64;
        let (cp, sp) = self.rope_ptrs();
        gpu.write(cp + off, &cos, "the RoPE cos rows")?;
        gpu.write(sp + off, &sin, "the RoPE sin rows")?;
        self.rope_rows = end;
        Ok(())
    }
}

/// Device buffers of one step, grown on demand.
#[derive(Default)]
struct Workspace {
    tokens_cap: usize,
    positions_cap: usize,
    rows_cap: usize,
    tokens: Slot,
    h: Slot,
    xn: Slot,
    q: Slot,
    k: Slot,
    v: Slot,
    o: Slot,
    scores: Slot,
    router_logits: Slot,
    act: Slot,
    /// Streaming: the experts' down products `[T][k][H]`, mixed by `moe_mix`.
    y_experts: Slot,
    act_shared: Slot,
    y_shared: Slot,
    s_shared: Slot,
    ids: Slot,
    probs: Slot,
    weights: Slot,
    by_id: Slot,
    kth: Slot,
    next: Slot,
    hn: Slot,
    logits: Slot,
    /// A MoE layer's routed pairs grouped by expert (`ops::moe_group`): order, tiles, count.
    group_order: Slot,
    group_tiles: Slot,
    group_count: Slot,
    /// Llama 4: each token's attention temperature (NoPE layers), and the experts' scaled
    /// inputs `[T][k][H]` (`ops::scale_slots`).
    qscale: Slot,
    x_slots: Slot,
    /// A step over several sequences: its per-token and per-(layer, token) tables.
    seq_tok: Slot,
    seq_kv: Slot,
    /// Gated DeltaNet layers: Qwen3-Next's fused projections `[T][2 Hk Dk + 2 Hv Dv]` and
    /// `[T][2 Hv]`, the convolution's channels `[T][C]` (q | k | v), z `[T][Hv Dv]`, b and a
    /// `[T][Hv]`, the recurrence's output `[T][Hv Dv]`.
    lin_qkvz: Slot,
    lin_ba: Slot,
    lin_qkv: Slot,
    lin_z: Slot,
    lin_b: Slot,
    lin_a: Slot,
    lin_o: Slot,
    /// Gated attention: q_proj's output `[T][Hq][2 D]` (each head's query, then its gate).
    q_gate: Slot,
    /// A step with a hook: `[T][H]` for the capture-only launches (an attention or MLP output
    /// before its residual add), allocated only by such a step.
    capture: Slot,
    /// The prefill attention's query tiles (`ops::AttnTiles`): the tile list and each tile
    /// row's maximum score (the scores themselves go to `scores`).
    qtiles: Slot,
    tile_max: Slot,
}

#[derive(Default)]
struct Slot(Option<DevBuf>);

impl Slot {
    fn ptr(&self) -> u64 {
        self.0.as_ref().map_or(0, |b| b.ptr())
    }

    fn ensure(&mut self, gpu: &Gpu, bytes: usize, what: &str) -> Result<(), CudaError> {
        if self.0.as_ref().is_none_or(|b| b.bytes() < bytes) {
            self.0 = None;
            self.0 = Some(gpu.alloc(bytes, what)?);
        }
        Ok(())
    }
}

impl Workspace {
    fn ensure(
        &mut self,
        gpu: &Gpu,
        cfg: &MoeConfig,
        moe_layers: usize,
        t: usize,
        positions: usize,
        rows: usize,
    ) -> Result<(), CudaError> {
        if t <= self.tokens_cap && positions <= self.positions_cap && rows <= self.rows_cap {
            return Ok(());
        }
        let t = t.max(self.tokens_cap);
        let positions = positions.max(self.positions_cap);
        let rows = rows.max(self.rows_cap);
        let (h, hq, hkv, d) = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        );
        let k = cfg.top_k;
        let f = 4usize;
        let act = (k * cfg.expert_width).max(cfg.dense_width.unwrap_or(0));
        let sh = cfg.shared_expert_width.unwrap_or(0);
        let w = "the step workspace";
        self.tokens.ensure(gpu, t * 4, w)?;
        self.h.ensure(gpu, t * h * f, w)?;
        self.xn.ensure(gpu, t * h * f, w)?;
        // MLA: q [Hq][dn+dr], k holds q_a's output, v the kv_a output, o [Hq][dv]
        let (qw, kw, vw, ow) = match &cfg.mla {
            Some(m) => (
                hq * m.qk_head_dim(),
                m.q_lora_rank.unwrap_or(0),
                m.latent_width(),
                hq * m.v_head_dim,
            ),
            None => (hq * d, hkv * d, hkv * d, hq * d),
        };
        self.q.ensure(gpu, t * qw * f, w)?;
        self.k.ensure(gpu, t * kw.max(1) * f, w)?;
        self.v.ensure(gpu, t * vw * f, w)?;
        self.o.ensure(gpu, t * ow * f, w)?;
        // one more score per (token, head) than positions: gpt-oss's sink (ops::AttnMask::stride)
        self.scores
            .ensure(gpu, t * hq * (positions + 1) * f, "the attention scores")?;
        self.router_logits
            .ensure(gpu, t * cfg.num_experts.max(1) * f, w)?;
        self.act.ensure(gpu, t * act * f, w)?;
        self.y_experts.ensure(gpu, t * k * h * f, w)?;
        self.act_shared.ensure(gpu, t * sh * f, w)?;
        self.y_shared.ensure(gpu, t * h * f, w)?;
        self.s_shared.ensure(gpu, t * f, w)?;
        let rec = moe_layers.max(1) * t * k.max(1) * 4;
        self.ids.ensure(gpu, rec, w)?;
        self.probs.ensure(gpu, rec, w)?;
        self.weights.ensure(gpu, rec, w)?;
        self.by_id.ensure(gpu, rec, w)?;
        self.kth.ensure(gpu, moe_layers.max(1) * t * 4, w)?;
        self.next.ensure(gpu, moe_layers.max(1) * t * 4, w)?;
        self.hn.ensure(gpu, rows * h * f, w)?;
        self.logits
            .ensure(gpu, rows * cfg.vocab_size * f, "the logits")?;
        let pairs = (t * k).max(1);
        self.group_order.ensure(gpu, pairs * 4, w)?;
        self.group_tiles.ensure(
            gpu,
            3 * ops::max_tiles(pairs, cfg.num_experts, ops::TILE_TOKENS) * 4,
            w,
        )?;
        self.group_count.ensure(gpu, 4, w)?;
        self.seq_tok.ensure(gpu, t * 32, w)?;
        if cfg.attn_temperature.is_some() {
            self.qscale.ensure(gpu, t * 4, w)?;
        }
        if ArchSpec::new(cfg).router == RouterRule::SigmoidScalesInput {
            self.x_slots.ensure(gpu, t * k * h * f, w)?;
        }
        self.seq_kv.ensure(gpu, cfg.num_layers * t * 16, w)?;
        if let Some(dims) = &cfg.linear {
            let s = ops::LinearShape::of(dims);
            let (vw, hv) = (s.value_width(), s.hv);
            self.lin_qkvz
                .ensure(gpu, t * (2 * s.key_width() + 2 * vw) * f, w)?;
            self.lin_ba.ensure(gpu, t * 2 * hv * f, w)?;
            self.lin_qkv.ensure(gpu, t * s.channels() * f, w)?;
            self.lin_z.ensure(gpu, t * vw * f, w)?;
            self.lin_b.ensure(gpu, t * hv * f, w)?;
            self.lin_a.ensure(gpu, t * hv * f, w)?;
            self.lin_o.ensure(gpu, t * vw * f, w)?;
        }
        if ArchSpec::new(cfg).extras.gated_attention {
            self.q_gate.ensure(gpu, t * 2 * hq * d * f, w)?;
        }
        self.tokens_cap = t;
        self.positions_cap = positions;
        self.rows_cap = rows;
        Ok(())
    }

    /// The step's query tiles for the prefill attention (kernels/prefill.cu), its buffers
    /// made room for and its tile list uploaded; `None` when the step's attention takes the
    /// per-(token, head) kernels: a shape the tiles cannot take, or with `ManyKernels::Auto`
    /// too few tokens, or tiles less than half full (a batch of one-token sequences).
    /// `seq_tokens`: each sequence's tokens in the step's order; `n_stride`: the most positions
    /// a token of the step sees.
    fn attn_tiles(
        &mut self,
        gpu: &Gpu,
        cfg: &MoeConfig,
        seq_tokens: &[usize],
        n_stride: usize,
    ) -> Result<Option<ops::AttnTiles>, CudaError> {
        if cfg.mla.is_some() {
            return Ok(None);
        }
        let shape = AttnShape {
            hq: cfg.num_heads,
            hkv: cfg.num_kv_heads,
            d: cfg.head_dim,
            rd: cfg.rotary_dim,
            cap: 0,
            pos0: 0,
            tokens: seq_tokens.iter().sum(),
        };
        let Some(qt) = ops::query_tile_tokens(&shape, &ops::AttnMask::default()) else {
            return Ok(None);
        };
        let list = ops::query_tiles(seq_tokens, qt);
        let n_tiles = list.len() / 2;
        let t = shape.tokens;
        if n_tiles == 0 || !ops::lanes(gpu, t >= 16 && n_tiles * qt <= 2 * t) {
            return Ok(None);
        }
        let rows = n_tiles * cfg.num_kv_heads * ops::AT_ROWS;
        let w = "the prefill attention's tiles";
        self.qtiles.ensure(gpu, list.len() * 4, w)?;
        self.tile_max.ensure(gpu, rows * 4, w)?;
        self.scores
            .ensure(gpu, rows * n_stride * 4, "the attention scores")?;
        gpu.write(self.qtiles.ptr(), &list, "the query tiles")?;
        Ok(Some(ops::AttnTiles {
            qtiles: self.qtiles.ptr(),
            n_tiles,
            mbuf: self.tile_max.ptr(),
            n_stride,
        }))
    }

    /// Where the step's router records are.
    fn records(&self) -> RecordPtrs {
        RecordPtrs {
            probs: self.probs.ptr(),
            weights: self.weights.ptr(),
            kth: self.kth.ptr(),
            next: self.next.ptr(),
        }
    }

    /// Where `ops::moe_group` writes.
    fn groups(&self) -> ops::Groups {
        ops::Groups {
            order: self.group_order.ptr(),
            tiles: self.group_tiles.ptr(),
            n_tiles: self.group_count.ptr(),
        }
    }

    /// Where MoE layer `moe_index`'s router writes, for a step of `t` tokens.
    fn route_out(&self, moe_index: usize, t: usize, k: usize) -> RouteOut {
        let rec = (moe_index * t * k * 4) as u64;
        let one = (moe_index * t * 4) as u64;
        RouteOut {
            ids: self.ids.ptr() + rec,
            probs: self.probs.ptr() + rec,
            weights: self.weights.ptr() + rec,
            by_id: self.by_id.ptr() + rec,
            kth: self.kth.ptr() + one,
            next: self.next.ptr() + one,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::sync::Arc;

    use super::*;
    use crate::synthetic::{random_model, SyntheticShape};

    fn mock_model(family: &str) -> CudaModel {
        let (cfg, src) = random_model(&SyntheticShape::small(family), 3);
        CudaModel::load_on(Gpu::mock(), cfg, Arc::new(src), None).unwrap()
    }

    #[test]
    fn a_steps_statistics_count_every_matrix_once_and_each_chosen_expert_once() {
        // computed here from the config and the step's own router records: every attention,
        // dense, router, shared-expert and lm_head matrix once per step whatever the token count, each
        // distinct expert a layer's tokens chose once, and one embedding row per token
        let m = mock_model("qwen2_moe");
        let cfg = m.cfg.clone();
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let bf16 = 2u64;
        let attn =
            bf16 * (h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h) as u64;
        let dense_w = cfg.dense_width.unwrap();
        let dense = bf16 * (3 * dense_w * h) as u64;
        let sw = cfg.shared_expert_width.unwrap();
        let shared = bf16 * (3 * sw * h + h) as u64;
        let router = bf16 * (cfg.num_experts * h) as u64;
        let expert = bf16 * (3 * cfg.expert_width * h) as u64;
        let lm_head = bf16 * (cfg.vocab_size * h) as u64;
        let opts = ForwardOptions {
            trace_router: true,
            ..Default::default()
        };
        let mut c = m.new_cache().unwrap();
        for tokens in [&[5u32, 9, 11, 200][..], &[7]] {
            let out = m.forward(&mut c, tokens, &opts).unwrap();
            let distinct: BTreeSet<u32> = out
                .router
                .iter()
                .flat_map(|r| r.experts.iter().copied())
                .collect();
            // one MoE layer (layer 1) among three
            assert!(out.router.iter().all(|r| r.layer == 1 && r.moe_layer == 0));
            assert_eq!(out.router.len(), tokens.len());
            let want = StepStats {
                weight_bytes: bf16 * (tokens.len() * h) as u64
                    + 3 * attn
                    + 2 * dense
                    + router
                    + shared
                    + distinct.len() as u64 * expert
                    + lm_head,
                experts_fetched: distinct.len() as u64,
            };
            assert_eq!(out.stats, want, "{} tokens", tokens.len());
        }
    }

    #[test]
    fn bad_steps_are_refused_by_name_and_leave_the_cache_as_it_was() {
        let m = mock_model("qwen3_moe");
        let vocab = m.cfg.vocab_size;
        let opts = ForwardOptions::default();
        let mut c = m.new_cache().unwrap();
        m.forward(&mut c, &[1, 2], &opts).unwrap();
        match m.forward(&mut c, &[], &opts) {
            Err(CudaError::Run(RunError::EmptyStep)) => {}
            other => panic!("empty step: {other:?}"),
        }
        match m.forward(&mut c, &[3, vocab as u32], &opts) {
            Err(CudaError::Run(RunError::TokenOutOfRange { token, vocab: v })) => {
                assert_eq!((token, v), (vocab as u32, vocab));
            }
            other => panic!("token out of range: {other:?}"),
        }
        let room = c.max_len() - c.len();
        match m.forward(&mut c, &vec![1; room + 1], &opts) {
            Err(CudaError::Run(RunError::ContextFull { needed, max })) => {
                assert_eq!((needed, max), (c.max_len() + 1, c.max_len()));
            }
            other => panic!("context full: {other:?}"),
        }
        // a cache of another model
        let other = mock_model("qwen3_moe");
        let mut oc = other.new_cache().unwrap();
        assert!(matches!(
            m.forward(&mut oc, &[1], &opts),
            Err(CudaError::Internal(_))
        ));
        assert_eq!(c.len(), 2, "a refused step appends nothing");
        m.forward(&mut c, &[4], &opts).unwrap();
        assert_eq!(c.len(), 3);
    }
}
