//! The CPU backend: the forward pass of docs/EXACTNESS.md section 6, step by step, with a KV
//! cache. It is the specification the GPU backend must reproduce bit for bit, so it is written
//! to be read: one function per step, shapes in comments.
//!
//! Prefill of T tokens and one-token decode run the same per-token arithmetic: every product is
//! an independent canonical dot of one weight row and one token's activation, attention for the
//! token at position P reads exactly positions 0..=P, and expert outputs are mixed in ascending
//! expert id whatever order they were computed in. Hence prefill logits at position t equal the
//! logits decode computes at t, for any thread count or SIMD path.
//!
//! Experts are fetched from the [`WeightSource`] once per MoE layer per step, for the sorted set
//! the step's tokens chose, and each is applied to all its tokens at once (expert-major).
//!
//! This module must never reorder a reduction, mix in another order, or take a shortcut that
//! changes bits (a cheaper arm is a separately labelled option, never a default).

mod forward;
pub mod kv_cache;
pub mod resident;

use std::sync::Arc;

pub use kv_cache::KvCache;
pub use resident::ResidentWeights;

use crate::config::MoeConfig;
use crate::model::ArchSpec;
use crate::numerics::{Kernel, RopeTable};
use crate::weights::WeightSource;
use crate::RunError;

/// A loaded model: config, structure, resident weights, and the source experts come from.
pub struct CpuModel {
    pub(crate) cfg: MoeConfig,
    pub(crate) spec: ArchSpec,
    pub(crate) weights: ResidentWeights,
    pub(crate) source: Arc<dyn WeightSource>,
    rope: RopeTable,
}

impl CpuModel {
    /// Loads the non-expert weights from `source` and checks every shape against `cfg`.
    pub fn load(cfg: MoeConfig, source: Arc<dyn WeightSource>) -> Result<CpuModel, RunError> {
        let spec = ArchSpec::new(&cfg);
        let weights = ResidentWeights::load(&cfg, &spec, source.as_ref())?;
        let rope = RopeTable::new(cfg.rope_theta, cfg.head_dim)?;
        Ok(CpuModel {
            cfg,
            spec,
            weights,
            source,
            rope,
        })
    }

    /// The config.
    pub fn config(&self) -> &MoeConfig {
        &self.cfg
    }

    /// The resolved structure.
    pub fn spec(&self) -> &ArchSpec {
        &self.spec
    }

    /// An empty KV cache for one sequence.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(
            self.cfg.num_layers,
            self.cfg.num_kv_heads,
            self.cfg.head_dim,
            self.cfg.max_position_embeddings,
            self.rope.clone(),
        )
    }
}

/// How an engine computes.
#[derive(Clone, Copy, Debug)]
pub struct EngineOptions {
    /// Worker threads (0: one per available core).
    pub threads: usize,
    /// The SIMD path (all give the same bits).
    pub kernel: Kernel,
}

impl Default for EngineOptions {
    /// One thread per core and the fastest SIMD path (ignores `TARFA_SIMD`; see
    /// [`EngineOptions::from_env`]).
    fn default() -> Self {
        EngineOptions {
            threads: 0,
            kernel: Kernel::best(),
        }
    }
}

impl EngineOptions {
    /// One thread per core and the SIMD path `TARFA_SIMD` names (scalar, avx2, avx512), or the
    /// fastest one when it is unset. An unknown or unsupported value is an error, not ignored.
    pub fn from_env() -> Result<EngineOptions, RunError> {
        Ok(EngineOptions {
            threads: 0,
            kernel: Kernel::from_env()?,
        })
    }
}

/// Which positions get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LogitRows {
    /// Only the last position of the step (generation).
    #[default]
    Last,
    /// Every position of the step (scoring, tests).
    All,
}

/// What the final hidden state is before the lm_head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FinalHidden {
    /// The f32 state, as the contract says. The only exact choice.
    #[default]
    Exact,
    /// INVALID, for validation only: rounds the final normed hidden state to BF16 before the
    /// lm_head, as a BF16 runtime would. A validation check uses it to show that the oracle
    /// tests can tell this precision loss apart. Never a default, never exact.
    InvalidBf16BeforeLmHead,
}

/// Options of one forward step.
#[derive(Clone, Copy, Debug, Default)]
pub struct ForwardOptions {
    /// Which rows of logits to compute.
    pub logits: LogitRows,
    /// Record the router's choices for every MoE layer and token.
    pub trace_router: bool,
    /// The final-hidden arm (exact unless a validation check asks otherwise).
    pub final_hidden: FinalHidden,
}

/// The router's decision for one token in one MoE layer.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterRecord {
    /// Absolute layer index.
    pub layer: usize,
    /// Index among MoE layers (as transformers numbers router outputs).
    pub moe_layer: usize,
    /// Sequence position of the token.
    pub position: usize,
    /// Selected experts, in selection order (descending probability, lower id first on ties).
    pub experts: Vec<u32>,
    /// Their softmax probabilities, same order.
    pub probs: Vec<f32>,
    /// Their mixing weights (renormalised or not, per the family).
    pub weights: Vec<f32>,
    /// The k-th largest probability (the last selected one).
    pub kth_prob: f32,
    /// The (k+1)-th largest probability, when there are more than k experts.
    pub next_prob: Option<f32>,
}

/// Counters of one step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepStats {
    /// Bytes of weights read: every matrix applied (once, whatever the token count), the
    /// experts fetched, and the embedding rows.
    pub weight_bytes: u64,
    /// Experts fetched (summed over layers).
    pub experts_fetched: u64,
}

/// What a forward step returns.
#[derive(Clone, Debug, Default)]
pub struct ForwardOutput {
    /// Logit rows (one per requested position), each `vocab_size` f32.
    pub logits: Vec<Vec<f32>>,
    /// Router records, when asked for (ordered by layer, then position).
    pub router: Vec<RouterRecord>,
    /// Counters.
    pub stats: StepStats,
}

/// A model with a thread pool and a SIMD path: runs forward steps.
pub struct CpuEngine {
    model: Arc<CpuModel>,
    pool: rayon::ThreadPool,
    kernel: Kernel,
}

impl CpuEngine {
    /// Builds the engine's thread pool.
    pub fn new(model: Arc<CpuModel>, opts: EngineOptions) -> Result<CpuEngine, RunError> {
        let threads = if opts.threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            opts.threads
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("tarfa-cpu-{i}"))
            .build()
            .map_err(|e| RunError::ThreadPool(e.to_string()))?;
        Ok(CpuEngine {
            model,
            pool,
            kernel: opts.kernel,
        })
    }

    /// The model.
    pub fn model(&self) -> &Arc<CpuModel> {
        &self.model
    }

    /// The SIMD path in use.
    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// Number of worker threads.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// Runs `tokens` at positions `cache.len()..` (prefill when several, decode when one) and
    /// appends them to the cache. On error the cache is left as it was.
    pub fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        opts: &ForwardOptions,
    ) -> Result<ForwardOutput, RunError> {
        let result = self
            .pool
            .install(|| forward::forward(&self.model, self.kernel, cache, tokens, opts));
        if result.is_err() {
            cache.rollback();
        }
        result
    }
}
