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
//! A step may hold several sequences ([`CpuEngine::forward_batch`]): the layers run once over
//! the union of their tokens, so every matrix and every expert is read once per step for all of
//! them, while each token's attention reads its own sequence's cache. [`CpuEngine::forward`] is
//! the one-sequence case of the same code, and a sequence's output is the same bits either way
//! (docs/EXACTNESS.md section 9).
//!
//! This crate must never reorder a reduction, mix in another order, or take a shortcut that
//! changes bits (a cheaper arm is a separately labelled option, never a default).

mod forward;
pub mod kv_cache;
mod lookahead;

pub use forward::{router_probs, Capture, StepHook};

use std::sync::Arc;

pub use kv_cache::KvCache;
pub use tarfa_core::resident::{self, ResidentWeights};
pub use tarfa_core::step::{
    FinalHidden, ForwardOptions, ForwardOutput, LogitRows, RouterRecord, StepStats,
};

pub use tarfa_core::batch::{BatchEntry, BatchError};
use tarfa_core::config::MoeConfig;
use tarfa_core::model::ArchSpec;
use tarfa_core::numerics::{Kernel, RopeTable};
use tarfa_core::weights::WeightSource;
use tarfa_core::Backend;
use tarfa_core::RunError;

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
        // The table's width is the rotary width (the whole head unless partial_rotary_factor;
        // multi-head latent attention's rope part), with YaRN when the config asks for it.
        let rope = cfg.rope_table()?;
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
        // Multi-head latent attention caches one latent row per position and layer.
        let (heads, width) = match &self.cfg.mla {
            Some(m) => (1, m.latent_width()),
            None => (self.cfg.num_kv_heads, self.cfg.head_dim),
        };
        let cache = KvCache::new(
            self.cfg.num_layers,
            heads,
            width,
            self.cfg.max_position_embeddings,
            // a windowed or chunked layer holds only the rows its queries read
            (0..self.cfg.num_layers)
                .map(|l| kv_cache::Span {
                    window: self.cfg.layer_windows.get(l).copied().flatten(),
                    chunk: self.cfg.layer_chunks.get(l).copied().flatten(),
                })
                .collect(),
            self.rope.clone(),
        );
        // a gated DeltaNet layer carries its state instead of rows
        match &self.cfg.linear {
            Some(d) => {
                cache.with_linear_layers(&self.cfg.layer_linear, d.conv_state_len(), d.state_len())
            }
            None => cache,
        }
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
    /// One thread per core and the fastest SIMD path.
    fn default() -> Self {
        EngineOptions {
            threads: 0,
            kernel: Kernel::best(),
        }
    }
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
    /// appends them to the cache. On error the cache is left as it was. This is
    /// [`CpuEngine::forward_batch`] with one sequence.
    pub fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        opts: &ForwardOptions,
    ) -> Result<ForwardOutput, RunError> {
        let mut one = [BatchEntry {
            cache,
            tokens,
            opts: *opts,
        }];
        let mut outs = self.forward_batch(&mut one).map_err(|e| e.error)?;
        Ok(outs.pop().unwrap_or_default())
    }

    /// One step over several sequences ([`Backend::forward_batch`]'s contract): every matrix
    /// is applied once to the union of their tokens and each expert once to all the tokens
    /// routed to it, attention runs per sequence over its own cache, and each sequence's output
    /// is bit-identical to [`CpuEngine::forward`] on it alone. On error no cache has advanced.
    pub fn forward_batch(
        &self,
        seqs: &mut [BatchEntry<'_, KvCache>],
    ) -> Result<Vec<ForwardOutput>, BatchError<RunError>> {
        self.forward_batch_observed(seqs, None)
    }

    /// [`CpuEngine::forward_batch`], with `hook` shown the step's residual stream and router
    /// logits ([`StepHook`]); the same bits unless it writes to them.
    pub fn forward_batch_observed(
        &self,
        seqs: &mut [BatchEntry<'_, KvCache>],
        hook: Option<&mut dyn StepHook>,
    ) -> Result<Vec<ForwardOutput>, BatchError<RunError>> {
        let result = self
            .pool
            .install(|| forward::forward_batch(&self.model, self.kernel, seqs, hook));
        if result.is_err() {
            for s in seqs.iter_mut() {
                s.cache.rollback();
            }
        }
        result
    }
}

impl Backend for CpuEngine {
    type Cache = KvCache;
    type Error = RunError;

    fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        opts: &ForwardOptions,
    ) -> Result<ForwardOutput, RunError> {
        CpuEngine::forward(self, cache, tokens, opts)
    }

    fn forward_batch(
        &self,
        seqs: &mut [BatchEntry<'_, KvCache>],
    ) -> Result<Vec<ForwardOutput>, BatchError<RunError>> {
        CpuEngine::forward_batch(self, seqs)
    }
}
