//! The CUDA backend: the forward pass of docs/EXACTNESS.md on an NVIDIA GPU, producing the same
//! bits as the CPU backend ([`tarfa_cpu`]), which is its specification.
//!
//! Layout:
//! - `kernels/*.cu` (repository root): the kernels, with the contract's functions and the
//!   canonical 256-lane warp reduction written once in `kernels/common.cuh`. They are embedded
//!   here and compiled at run time by NVRTC, once per process, for the device's architecture
//!   (`compute_90` on Hopper) with [`compile::compile_options`]: `--fmad=false --ftz=false
//!   --prec-div=true --prec-sqrt=true`, never fast math.
//! - [`compile`]: the sources, the options, the PTX checks (shared with the CI test).
//! - `device`: context, stream, plain `cuMemAlloc` buffers, launches, error mapping.
//! - [`CudaModel`] / [`CudaCache`]: resident weights (every tensor and every expert uploaded
//!   from the [`WeightSource`](tarfa_core::weights::WeightSource)'s verified buffers) and one
//!   sequence's KV cache; [`CudaModel::forward`] returns the CPU's [`ForwardOutput`] type.
//! - [`selftest`]: CPU and CUDA on the same model and prompts, compared byte for byte;
//!   [`kernel_checks`]: each kernel against the CPU reference functions (llm.c style).
//!
//! Structure, chosen to become fast later without changing bits: a warp per output row (thread
//! p owns lanes 8p..8p+7 of each 256-element block, 16-byte BF16 loads, tree = shfl_down 16, 8,
//! 4, 2, 1 then in-thread 4, 2, 1); no split-K, no atomics, no tensor cores; the router's softmax
//! and top-k run on the device and the expert kernels read the chosen ids from device memory, so
//! a resident step makes no host round trip between layers (the logits, and the router records
//! for statistics and tracing, come back once at the end of the step).
//!
//! Without the `cuda` cargo feature every entry point returns [`CudaError::NotCompiled`]. With
//! it, a machine without a driver gets [`CudaError::NoDriver`] (never a panic: the libraries'
//! presence is checked before any other call).
//!
//! This crate must never compute anything differently from the CPU backend: a kernel that
//! cannot reproduce the contract's order is a bug, never an option.

use std::fmt;

use tarfa_core::exit;
use tarfa_core::weights::WeightError;
use tarfa_core::RunError;

#[cfg(feature = "cuda")]
mod checks;
#[cfg(feature = "cuda")]
pub mod compile;
#[cfg(feature = "cuda")]
mod device;
#[cfg(all(any(test, feature = "mock-device"), feature = "cuda"))]
mod mock;
#[cfg(feature = "cuda")]
mod model;
#[cfg(feature = "cuda")]
mod ops;
#[cfg(feature = "cuda")]
mod selftest;
pub mod synthetic;

#[cfg(feature = "cuda")]
pub use checks::kernel_checks;
#[cfg(feature = "cuda")]
pub use model::{probe, CudaCache, CudaModel};
#[cfg(feature = "cuda")]
pub use selftest::{
    compare_with, locate_divergence, reference_run, selftest, selftest_models, selftest_streaming,
    ReferenceRun,
};

#[cfg(not(feature = "cuda"))]
mod stub;
#[cfg(not(feature = "cuda"))]
pub use stub::*;

pub use tarfa_core::generate::greedy;
pub use tarfa_core::step::ForwardOutput;

// The one decode loop (tarfa_core::generate::greedy) and the CLI run the GPU through this; the
// real backend and the stub have the same inherent methods, so one impl serves both builds.
impl tarfa_core::Backend for CudaModel {
    type Cache = CudaCache;
    type Error = CudaError;

    fn forward(
        &self,
        cache: &mut CudaCache,
        tokens: &[u32],
        opts: &tarfa_core::step::ForwardOptions,
    ) -> Result<ForwardOutput, CudaError> {
        CudaModel::forward(self, cache, tokens, opts)
    }

    /// All the sequences' tokens in one pass of the token-tiled kernels.
    fn forward_batch(
        &self,
        seqs: &mut [tarfa_core::batch::BatchEntry<'_, CudaCache>],
    ) -> Result<Vec<ForwardOutput>, tarfa_core::batch::BatchError<CudaError>> {
        CudaModel::forward_seqs(self, seqs)
    }

    /// The token is chosen on the GPU, and no logits are copied back.
    fn greedy_step(
        &self,
        cache: &mut CudaCache,
        token: u32,
    ) -> Result<(u32, tarfa_core::step::StepStats), CudaError> {
        CudaModel::greedy_step(self, cache, token)
    }
}

// A caller that runs several steps as one (a draft's verification) rewinds a cache with this.
impl tarfa_core::batch::Rewind for CudaCache {
    fn cached_len(&self) -> usize {
        self.len()
    }

    fn rewind_to(&mut self, len: usize) -> usize {
        self.truncate(len)
    }
}

/// Why the CUDA backend cannot run (or stopped), each variant with its exit code
/// ([`CudaError::exit_code`]): the machine's or the backend's failures (3), what the user asked
/// for that the kernels cannot do (2), and [`CudaError::Run`], the runtime's own error.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// This build has no CUDA backend.
    #[error("this build of tarfa-run has no CUDA backend (built without the `cuda` feature)")]
    NotCompiled,
    /// [`CudaModel::load_mock`] in a build without the `mock-device` feature.
    #[error(
        "this build of tarfa-cuda has no mock device (built without the `mock-device` feature)"
    )]
    NoMockDevice,
    /// libcuda could not be loaded.
    #[error("no CUDA driver: libcuda.so could not be loaded (no NVIDIA driver on this machine?)")]
    NoDriver,
    /// libnvrtc could not be loaded.
    #[error(
        "no NVRTC: libnvrtc.so could not be loaded (install the CUDA toolkit, or the PyPI \
         package nvidia-cuda-nvrtc, and put its lib directory on LD_LIBRARY_PATH)"
    )]
    NoNvrtc,
    /// The driver loaded but reports no GPU.
    #[error("the CUDA driver found no GPU")]
    NoDevice,
    /// NVRTC rejected a kernel source (a bug in kernels/, or an unsupported architecture).
    #[error("NVRTC could not compile kernels/{file}: {log}")]
    Compile { file: String, log: String },
    /// A device allocation failed.
    #[error("out of GPU memory: {what} ({detail})")]
    OutOfMemory { what: String, detail: String },
    /// A kernel failed (illegal address, launch failure, ...).
    #[error("a GPU kernel failed: {what}: {detail}")]
    KernelFailed { what: String, detail: String },
    /// The device stopped working (uncorrectable ECC error, fell off the bus, ...).
    #[error("the GPU was lost: {what}: {detail}")]
    DeviceLost { what: String, detail: String },
    /// Another driver call failed.
    #[error("a CUDA call failed: {what}: {detail}")]
    Driver { what: String, detail: String },
    /// The model has a shape the CUDA kernels do not implement (an expert count or top-k the
    /// router kernel cannot hold, a dimension past the kernels' 32-bit indexing, mismatched
    /// gate and up dtypes, ...): bad input, exit 2. The CPU backend may still run it.
    #[error("not supported by the CUDA backend: {0}")]
    UnsupportedModel(String),
    /// One forward step was given more tokens than a kernel grid holds (exit 2).
    #[error("not supported by the CUDA backend: {tokens} tokens in one step (at most {max})")]
    TooManyTokens { tokens: usize, max: usize },
    /// The hot tier's budget (`--vram-budget`) holds no expert (exit 2).
    #[error(
        "a VRAM budget of {} is smaller than one expert: the minimum is {} ({minimum} bytes)",
        tarfa_stream::format_bytes(*budget),
        tarfa_stream::format_bytes(*minimum)
    )]
    VramBudgetTooSmall { budget: u64, minimum: u64 },
    /// The device ordinal asked for is not on this machine (exit 2).
    #[error("CUDA device {ordinal} requested, {count} present")]
    NoSuchDevice { ordinal: usize, count: usize },
    /// An invariant of the backend broke (a kernel that is not loaded, an empty graph capture,
    /// a hot tier without the slot its plan promised, a KV cache of another model): a bug in
    /// this crate or its caller, never the user's input (exit 3).
    #[error("internal error in the CUDA backend (a bug): {0}")]
    Internal(String),
    /// The runtime's own error (config, weights, tokens, context length).
    #[error(transparent)]
    Run(#[from] RunError),
}

impl From<WeightError> for CudaError {
    fn from(e: WeightError) -> Self {
        CudaError::Run(RunError::Weights(e))
    }
}

impl CudaError {
    /// The documented exit code ([`tarfa_core::exit`]): what the user asked for that the kernels
    /// cannot do is bad input (2); the machine, the GPU, the build or a bug is 3;
    /// [`CudaError::Run`] keeps the runtime's own code, as on the CPU backend.
    pub fn exit_code(&self) -> i32 {
        match self {
            CudaError::Run(e) => e.exit_code(),
            CudaError::UnsupportedModel(_)
            | CudaError::TooManyTokens { .. }
            | CudaError::VramBudgetTooSmall { .. }
            | CudaError::NoSuchDevice { .. } => exit::BAD_INPUT,
            CudaError::NotCompiled
            | CudaError::NoMockDevice
            | CudaError::NoDriver
            | CudaError::NoNvrtc
            | CudaError::NoDevice
            | CudaError::Compile { .. }
            | CudaError::OutOfMemory { .. }
            | CudaError::KernelFailed { .. }
            | CudaError::DeviceLost { .. }
            | CudaError::Driver { .. }
            | CudaError::Internal(_) => exit::ENVIRONMENT,
        }
    }

    /// Whether this is a failure of the machine, the GPU, the build or the backend itself (exit
    /// code 3) rather than of the model or the request.
    pub fn is_environment(&self) -> bool {
        self.exit_code() == exit::ENVIRONMENT
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn oom(what: impl Into<String>, bytes: usize, free: usize, total: usize) -> Self {
        CudaError::OutOfMemory {
            what: what.into(),
            detail: format!(
                "{} requested, {} of {} free",
                gib(bytes as u64),
                gib(free as u64),
                gib(total as u64)
            ),
        }
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// How the CUDA backend runs.
#[derive(Clone, Debug, Default)]
pub struct CudaOptions {
    /// Device ordinal.
    pub device: usize,
    /// How it runs, where that changes speed and never a bit.
    pub tuning: CudaTuning,
    /// Expert streaming: keep only the dense weights resident and hold experts in a hot tier of
    /// this much GPU memory, fetching the rest from the weight source (the warm tier and the
    /// bundle) as the router chooses them. `None`: every expert is uploaded at load.
    pub hot: Option<HotOptions>,
}

/// The CUDA backend's knobs that change how fast it runs, never what it computes: read once, when
/// the model is loaded (the library reads no environment variable). The CLI sets them from its
/// flags; the defaults are what PHASE_LOG measured fastest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaTuning {
    /// How one-token (decode) steps run (default [`DecodeMode::GraphPdl`]).
    pub decode: DecodeMode,
    /// Wait after every kernel so that a failure names it (slow: a debugging aid; the decode
    /// step then launches its kernels one by one).
    pub sync_each_kernel: bool,
    /// Copy streamed experts to the hot tier from pageable host memory instead of page-locked
    /// buffers (slower; the other arm of PHASE_LOG S2's A/B).
    pub pageable_warm_tier: bool,
    /// Wait for each greedy token before launching the next step, instead of running 8 steps
    /// ahead ([`CudaModel::run_ahead`]; slower; the other arm of PHASE_LOG B2's A/B).
    pub wait_each_token: bool,
    /// Which kernels run the products and the attention of a step of many tokens (default
    /// [`ManyKernels::Auto`], measured on the H200 in PHASE_LOG B8);
    /// [`CudaModel::set_many_kernels`] changes it on a loaded model.
    pub many: ManyKernels,
}

/// Which kernels run a step of many tokens (a prefill, a batch of sequences). Every choice
/// computes the same bits (docs/EXACTNESS.md section 9); they differ in speed only.
///
/// The default is `Auto` since the lane-sequential kernels were measured and sanitized on the
/// H200 (PHASE_LOG B8: bit-identical to the CPU there and on the kernel emulator, 1.4x to 6x
/// `Tiled`'s prefill from 256 tokens up, compute-sanitizer clean); a default is chosen by
/// measurement, never by expectation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ManyKernels {
    /// The lane-sequential kernels (kernels/prefill.cu) where a step has enough tokens per
    /// weight row, per expert or per query tile for them to pay; the token-tiled kernels
    /// (kernels/tile.cu, attention.cu) elsewhere, and for a layer's experts below 4 routed pairs
    /// per expert (batched decode, short steps) tile.cu's few-pair kernels. The default:
    /// measured on the H200 at 1.4x to 6x the tiled kernels' prefill from 256 tokens up
    /// (PHASE_LOG B8), and with the few-pair experts 1.11x at 8 sequences decoding together
    /// on an H100 (B12); the same bits.
    #[default]
    Auto,
    /// The token-tiled kernels of PHASE_LOG B3 only (the other arm of B5's and B8's A/B).
    Tiled,
    /// The lane-sequential kernels wherever they can run, however few the tokens (tests).
    Lanes,
    /// `Auto`, with the dense products of 2 to 8 tokens on kernels/tile.cu's `mm_few_bf16`
    /// instead of the token tiles: B9's arm, kept to measure that kernel, which took 12-21% more
    /// GPU time than `mm_tile_bf16` on an H100 (PHASE_LOG B11).
    Few,
}

impl ManyKernels {
    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            ManyKernels::Auto => "auto",
            ManyKernels::Tiled => "tiled",
            ManyKernels::Lanes => "lanes",
            ManyKernels::Few => "few",
        }
    }

    /// Parses a [`ManyKernels::name`], exactly: anything else is an error that lists the names.
    pub fn parse(s: &str) -> Result<ManyKernels, String> {
        ManyKernels::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = ManyKernels::ALL.iter().map(|m| m.name()).collect();
                format!(
                    "unknown many-token kernels {s:?} (one of {})",
                    names.join(", ")
                )
            })
    }

    /// Every choice.
    pub const ALL: [ManyKernels; 4] = [
        ManyKernels::Auto,
        ManyKernels::Tiled,
        ManyKernels::Lanes,
        ManyKernels::Few,
    ];

    pub(crate) fn code(self) -> u8 {
        match self {
            ManyKernels::Auto => 0,
            ManyKernels::Tiled => 1,
            ManyKernels::Lanes => 2,
            ManyKernels::Few => 3,
        }
    }

    pub(crate) fn of_code(c: u8) -> ManyKernels {
        match c {
            0 => ManyKernels::Auto,
            2 => ManyKernels::Lanes,
            3 => ManyKernels::Few,
            _ => ManyKernels::Tiled,
        }
    }
}

/// The hot tier of expert streaming: GPU memory for experts ([`CudaOptions::hot`]).
#[derive(Clone, Debug)]
pub struct HotOptions {
    /// Bytes of GPU memory for experts, staging included: the tier holds
    /// `budget / slot bytes` experts (a slot is one expert's three BF16 matrices, rounded up to
    /// 256 bytes). At least one slot.
    pub budget: u64,
    /// What the tier keeps once a layer is done with an expert (the warm tier's policies).
    pub policy: tarfa_stream::CachePolicy,
    /// Experts (layer, id) to pin once loaded, hottest first (the heat ledger's ranking): up to
    /// half the slots under `Ledger`, three quarters under `Static`, none otherwise.
    pub pins: Vec<(usize, usize)>,
}

/// Why the CUDA kernels cannot run this model's family, or `None` when they can. The kernels
/// implement softmax top-k, both group-limited routers (DeepSeek's and GLM-4.5's sigmoid
/// scores with the correction bias, DeepSeek-V2's softmax) and gpt-oss's biased top-k-then-
/// softmax router, gated and ungated shared experts, expert biases and the clamped SwiGLU, GQA
/// with rotary embedding on the whole head or its leading `rotary_dim` values, the host's
/// rotary tables (YaRN included), sliding windows and attention sinks, and DeepSeek's
/// multi-head latent attention with its latent cache. Fused and MXFP4 experts reach the GPU as
/// the weight source hands them out, per expert and widened exactly to BF16. Llama 4's
/// input-scaling router, pairwise rope, NoPE layers with their temperature, chunked layers and
/// L2 q/k norm, and OLMoE's clip_qkv, run on the per-operation kernels. Every family the runtime
/// reads is implemented today, so this returns `None` for all of them; a rule added to
/// tarfa-core must be implemented here or named (the match below is exhaustive so that it
/// cannot be forgotten). Checked before anything is uploaded; `--backend auto` then takes the
/// CPU, which runs every family.
pub fn unsupported_family(
    _cfg: &tarfa_core::config::MoeConfig,
    spec: &tarfa_core::model::ArchSpec,
) -> Option<String> {
    use tarfa_core::model::RouterRule;
    // exhaustive on purpose: a rule added to tarfa-core is implemented here or returns its
    // name ("the {model_type} family ({architecture}) needs X, which the CUDA kernels do not
    // implement yet; run it with --backend cpu")
    match spec.router {
        RouterRule::SoftmaxTopK
        | RouterRule::SigmoidGroupLimited
        | RouterRule::SoftmaxGroupLimited
        | RouterRule::TopKThenSoftmax
        | RouterRule::SigmoidScalesInput => None,
    }
}

/// The smallest hot tier (`--vram-budget`) that holds one expert: a slot, the expert's three
/// BF16 matrices rounded up to 256 bytes.
pub fn min_vram_budget(cfg: &tarfa_core::config::MoeConfig) -> u64 {
    (2 * 3 * cfg.expert_width * cfg.hidden_size).div_ceil(256) as u64 * 256
}

/// Counters of the hot tier since the model was loaded (subtract two snapshots for one step).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct HotStats {
    /// Slots (experts the tier holds at once) and the bytes they occupy.
    pub slots: u64,
    pub pool_bytes: u64,
    /// Experts a layer needed (one per distinct expert per MoE layer per step).
    pub requests: u64,
    /// Of those, already in GPU memory.
    pub hits: u64,
    /// Copied from the host (the warm tier) to the GPU.
    pub uploads: u64,
    pub h2d_bytes: u64,
    /// Host time in host-to-device copies (ns).
    pub h2d_ns: u64,
    /// Host time waiting for the warm tier to hand out experts (reads, verification) (ns).
    pub fetch_wait_ns: u64,
    /// Experts evicted from a slot to make room.
    pub evictions: u64,
    /// Largest device memory in use (total minus free) seen after a step, bytes.
    pub peak_vram_bytes: u64,
}

impl HotStats {
    /// Counters accumulated between `earlier` and `self` (sizes and the peak stay as they are).
    pub fn since(&self, earlier: &HotStats) -> HotStats {
        HotStats {
            slots: self.slots,
            pool_bytes: self.pool_bytes,
            requests: self.requests - earlier.requests,
            hits: self.hits - earlier.hits,
            uploads: self.uploads - earlier.uploads,
            h2d_bytes: self.h2d_bytes - earlier.h2d_bytes,
            h2d_ns: self.h2d_ns - earlier.h2d_ns,
            fetch_wait_ns: self.fetch_wait_ns - earlier.fetch_wait_ns,
            evictions: self.evictions - earlier.evictions,
            peak_vram_bytes: self.peak_vram_bytes,
        }
    }

    /// Hits over requests, when there were requests.
    pub fn hit_rate(&self) -> Option<f64> {
        (self.requests > 0).then(|| self.hits as f64 / self.requests as f64)
    }
}

/// How a decode step (one token) runs on the GPU. Every mode computes the same bits; they differ
/// in kernels and launches only (docs/PERFORMANCE.md, "CUDA decode"). The default is the fastest;
/// the others are its fallbacks (a model the decode kernels cannot take runs `Legacy`; a failed
/// graph capture falls back to `Graph`, then `Direct`) and what benchmarks compare it with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DecodeMode {
    /// The per-operation kernels of a prefill step with one token (~14 launches per layer).
    Legacy,
    /// kernels/decode.cu (~6 launches per layer), launched one by one.
    Direct,
    /// kernels/decode.cu captured once into a CUDA graph, replayed per token.
    Graph,
    /// As `Graph`, with programmatic dependent launch between the kernels (Hopper and later):
    /// the default. Each kernel's blocks start as the previous kernel drains and load their
    /// first weights before they wait for it (PHASE_LOG P16). Where the capture fails, the step
    /// falls back to `Graph` with kernels that load after the wait.
    #[default]
    GraphPdl,
}

impl DecodeMode {
    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            DecodeMode::Legacy => "legacy",
            DecodeMode::Direct => "direct",
            DecodeMode::Graph => "graph",
            DecodeMode::GraphPdl => "graph-pdl",
        }
    }

    /// Parses a mode's [`DecodeMode::name`], exactly: anything else is an error that lists the
    /// names.
    pub fn parse(s: &str) -> Result<DecodeMode, String> {
        DecodeMode::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = DecodeMode::ALL.iter().map(|m| m.name()).collect();
                format!("unknown decode mode {s:?} (one of {})", names.join(", "))
            })
    }

    /// Every mode, slowest first.
    pub const ALL: [DecodeMode; 4] = [
        DecodeMode::Legacy,
        DecodeMode::Direct,
        DecodeMode::Graph,
        DecodeMode::GraphPdl,
    ];
}

/// Time and bytes of one kind of kernel in a decode step ([`CudaModel::profile_decode`]).
#[derive(Clone, Debug)]
pub struct KernelTime {
    /// What the kernels compute (qkv, attention, o_proj, router, experts gate+up, ...).
    pub label: String,
    /// The kernels' names.
    pub kernels: String,
    /// Launches per token.
    pub launches: usize,
    /// Microseconds per token, summed over its launches.
    pub us_per_token: f64,
    /// Bytes of weights they read per token.
    pub weight_bytes: u64,
    /// Registers per thread of the (first) kernel, as the driver compiled it.
    pub registers: i32,
}

/// The GPU a backend runs on.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_memory: usize,
    pub free_memory: usize,
    pub multiprocessors: u32,
    /// As `cuDriverGetVersion` reports it (13000 = CUDA 13.0).
    pub driver_version: i32,
    /// The NVRTC virtual architecture kernels are compiled for.
    pub arch: &'static str,
}

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "GPU {}: {} (compute capability {}.{}, {} multiprocessors, {} total, {} free; driver \
             CUDA {}.{}; kernels for {})",
            self.ordinal,
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            self.multiprocessors,
            gib(self.total_memory as u64),
            gib(self.free_memory as u64),
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10,
            self.arch
        )
    }
}

/// What [`selftest`] runs on both backends.
#[derive(Clone, Debug)]
pub struct SelftestOptions {
    /// Prompts; each is prefilled (logits of every position), then decoded.
    pub prompts: Vec<Vec<u32>>,
    /// Greedy decode steps after each prefill (the CPU's choice feeds both backends).
    pub decode_steps: usize,
    /// CPU threads (0: all cores).
    pub cpu_threads: usize,
}

/// The outcome of [`selftest`]: how much was compared and the first difference, if any.
#[derive(Clone, Debug, Default)]
pub struct SelftestReport {
    /// Prompts run.
    pub prompts: usize,
    /// Forward steps compared (prefills + decode steps).
    pub steps: usize,
    /// Logit rows compared.
    pub logit_rows: usize,
    /// Bytes of logits compared (4 per f32).
    pub logit_bytes: u64,
    /// Router records compared (one per MoE layer per position).
    pub router_records: usize,
    /// Bytes of router records compared (ids, probabilities, weights, k-th and next probability).
    pub router_bytes: u64,
    /// Logit values whose bits differ.
    pub logit_mismatches: u64,
    /// Router records that differ in any field.
    pub router_mismatches: u64,
    /// Steps whose statistics (weight bytes, experts) differ.
    pub stats_mismatches: u64,
    /// The first difference found, described.
    pub first_mismatch: Option<String>,
    /// Generated tokens per prompt (the CPU's greedy choices).
    pub tokens: Vec<Vec<u32>>,
    /// Wall time of the CPU and GPU forward steps, seconds.
    pub cpu_seconds: f64,
    pub gpu_seconds: f64,
    /// The GPU used.
    pub device: Option<String>,
}

impl SelftestReport {
    /// Every compared byte equal.
    pub fn passed(&self) -> bool {
        self.logit_mismatches == 0
            && self.router_mismatches == 0
            && self.stats_mismatches == 0
            && self.logit_bytes > 0
    }

    /// Bytes compared in all.
    pub fn bytes_compared(&self) -> u64 {
        self.logit_bytes + self.router_bytes
    }
}

impl fmt::Display for SelftestReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} prompts, {} steps, {} logit rows ({} bytes) and {} router records ({} bytes) \
             compared; {} logit, {} router, {} stats mismatches",
            if self.passed() { "PASS" } else { "FAIL" },
            self.prompts,
            self.steps,
            self.logit_rows,
            self.logit_bytes,
            self.router_records,
            self.router_bytes,
            self.logit_mismatches,
            self.router_mismatches,
            self.stats_mismatches
        )?;
        if let Some(m) = &self.first_mismatch {
            write!(f, "; first: {m}")?;
        }
        Ok(())
    }
}

/// One configuration of the streamed selftest ([`selftest_streaming`]): the GPU hot tier and the
/// RAM tier's budget, I/O mode and policy.
#[derive(Clone, Debug)]
pub struct StreamCase {
    pub vram_budget: u64,
    pub ram_budget: Option<u64>,
    pub io: tarfa_stream::IoMode,
    pub policy: tarfa_stream::CachePolicy,
}

impl fmt::Display for StreamCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "VRAM {}, RAM {}, io {}, cache {}",
            tarfa_stream::format_bytes(self.vram_budget),
            self.ram_budget
                .map_or("unbounded".into(), tarfa_stream::format_bytes),
            self.io.name(),
            self.policy.name()
        )
    }
}

/// The budget sweep of the streamed selftest for a bundle whose experts occupy
/// `slots` hot-tier slots of `slot` bytes and `extent` bytes each in RAM: everything resident,
/// a quarter, and one expert, with both I/O modes and every policy.
pub fn stream_sweep(slots: u64, slot: u64, extent: u64) -> Vec<StreamCase> {
    use tarfa_stream::{CachePolicy as P, IoMode as Io};
    let quarter = (slots / 4).max(1);
    let case = |v: u64, r: Option<u64>, io, policy| StreamCase {
        vram_budget: v * slot,
        ram_budget: r.map(|r| r * extent),
        io,
        policy,
    };
    vec![
        case(slots, None, Io::Cached, P::Lru),
        case(quarter, Some(quarter), Io::Direct, P::Lru),
        case(quarter, Some(2 * quarter), Io::Cached, P::Ledger),
        case(quarter, Some(quarter), Io::Direct, P::Static),
        case(1, None, Io::Cached, P::None),
        case(1, Some(1), Io::Direct, P::Lru),
    ]
}

/// The result of one kernel check ([`kernel_checks`]).
#[derive(Clone, Debug)]
pub struct KernelCheck {
    /// What was checked.
    pub name: String,
    /// Values compared.
    pub compared: u64,
    /// Values whose bits differ from the CPU reference.
    pub mismatches: u64,
    /// The first difference.
    pub first_mismatch: Option<String>,
}

impl fmt::Display for KernelCheck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<34} {:>12} values  {}",
            self.name,
            self.compared,
            if self.mismatches == 0 {
                "bit-identical".to_string()
            } else {
                format!(
                    "{} DIFFER, first: {}",
                    self.mismatches,
                    self.first_mismatch.as_deref().unwrap_or("?")
                )
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Built with and without the `cuda` feature: the stub's errors map like the real backend's.
    #[test]
    fn each_error_has_its_documented_exit_code() {
        let s = || String::from("x");
        let user = [
            CudaError::UnsupportedModel(s()),
            CudaError::TooManyTokens {
                tokens: 65_536,
                max: 65_535,
            },
            CudaError::VramBudgetTooSmall {
                budget: 100,
                minimum: 256,
            },
            CudaError::NoSuchDevice {
                ordinal: 3,
                count: 1,
            },
            CudaError::Run(RunError::EmptyStep),
        ];
        for e in &user {
            assert_eq!(e.exit_code(), exit::BAD_INPUT, "{e:?}");
            assert!(!e.is_environment(), "{e:?}");
        }
        let machine = [
            CudaError::NotCompiled,
            CudaError::NoMockDevice,
            CudaError::NoDriver,
            CudaError::NoNvrtc,
            CudaError::NoDevice,
            CudaError::Compile {
                file: s(),
                log: s(),
            },
            CudaError::OutOfMemory {
                what: s(),
                detail: s(),
            },
            CudaError::KernelFailed {
                what: s(),
                detail: s(),
            },
            CudaError::DeviceLost {
                what: s(),
                detail: s(),
            },
            CudaError::Driver {
                what: s(),
                detail: s(),
            },
            CudaError::Internal(s()),
            CudaError::Run(RunError::ThreadPool(s())),
        ];
        for e in &machine {
            assert_eq!(e.exit_code(), exit::ENVIRONMENT, "{e:?}");
            assert!(e.is_environment(), "{e:?}");
        }
        // a weight error inside keeps the weight error's code (a broken bundle: 1)
        let broken = CudaError::from(WeightError::MissingTensor(s()));
        assert_eq!(broken.exit_code(), exit::VERIFICATION_FAILED);
    }

    #[test]
    fn user_errors_name_what_to_change() {
        let e = CudaError::VramBudgetTooSmall {
            budget: 100,
            minimum: 1 << 20,
        };
        let m = e.to_string();
        assert!(
            m.contains("smaller than one expert") && m.contains("1048576 bytes"),
            "{m}"
        );
        let e = CudaError::NoSuchDevice {
            ordinal: 3,
            count: 1,
        };
        assert_eq!(e.to_string(), "CUDA device 3 requested, 1 present");
        let e = CudaError::Internal("the graph capture was empty".into());
        assert!(e.to_string().contains("a bug"), "{e}");
    }

    // What a build without the `cuda` feature gets (CI runs it: .ci/run).
    #[cfg(not(feature = "cuda"))]
    #[test]
    fn the_stub_refuses_every_entry_point_as_not_compiled() {
        use std::sync::Arc;
        assert!(matches!(probe(0), Err(CudaError::NotCompiled)));
        let (cfg, src) = synthetic::random_model(&synthetic::SyntheticShape::small("qwen3_moe"), 1);
        let opts = CudaOptions::default();
        assert!(matches!(
            CudaModel::load(cfg, Arc::new(src), &opts),
            Err(CudaError::NotCompiled)
        ));
        assert!(matches!(kernel_checks(&opts), Err(CudaError::NotCompiled)));
        assert_eq!(CudaError::NotCompiled.exit_code(), exit::ENVIRONMENT);
    }
}
