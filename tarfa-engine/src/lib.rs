//! One compute session for every front end, whichever backend runs it: the CPU reference or
//! CUDA, chosen when the model is loaded ([`BackendChoice`]). An [`Engine`] is the model and one
//! sequence's cache; it is a [`Session`], so the one decode loop
//! ([`tarfa_core::generate::run`]) drives it, with the caller's
//! [`Observer`](tarfa_core::generate::Observer) streaming, tracing or collecting. The CLI drives
//! it today; a scoring command, a server and a Python package are meant to drive the same API.
//!
//! Both backends return the same [`ForwardOutput`], bit for bit (docs/EXACTNESS.md).
//!
//! This crate must never compute anything itself, nor choose a token any other way than the
//! backends do: it only loads, dispatches and reports. It must never depend on a front end (the
//! CLI, tarfa-convert): they depend on it.

use std::sync::Arc;

use tarfa_core::config::MoeConfig;
use tarfa_core::generate::Session;
use tarfa_core::numerics::Kernel;
use tarfa_core::step::{ForwardOptions, ForwardOutput, StepStats};
use tarfa_core::weights::WeightSource;
use tarfa_core::{Backend, RunError};
use tarfa_cpu::{CpuEngine, CpuModel, EngineOptions, KvCache};
use tarfa_cuda::{CudaCache, CudaError, CudaModel, CudaOptions, CudaTuning, HotOptions, HotStats};
use tarfa_stream::format_bytes;

/// Which backend to load a model on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    /// CUDA when a usable GPU is present, else the CPU.
    Auto,
    Cpu,
    Cuda,
}

/// How to load a model.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub backend: BackendChoice,
    /// CPU worker threads (0: one per core). Changes speed, never a bit.
    pub threads: usize,
    /// The CPU's SIMD path. Changes speed, never a bit.
    pub kernel: Kernel,
    /// Stream the experts through a GPU hot tier (CUDA only; the CPU computes from the RAM tier
    /// directly).
    pub hot: Option<HotOptions>,
    /// The CUDA backend's speed knobs (never a bit of the result).
    pub cuda: CudaTuning,
}

/// Why an engine could not load or step.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The runtime's own error (config, weights, tokens, context length), whichever backend.
    #[error(transparent)]
    Run(#[from] RunError),
    /// The CUDA backend cannot run (no driver, no GPU, out of memory, ...). Never
    /// [`CudaError::Run`]: that arrives as [`EngineError::Run`].
    #[error(transparent)]
    Cuda(CudaError),
}

impl From<CudaError> for EngineError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::Run(r) => EngineError::Run(r),
            other => EngineError::Cuda(other),
        }
    }
}

/// A model loaded on one backend, with one sequence's cache.
pub enum Engine {
    Cpu {
        engine: CpuEngine,
        cache: KvCache,
    },
    // boxed: the model and its cache are far larger than the CPU engine's handles
    Cuda {
        model: Box<CudaModel>,
        cache: Box<CudaCache>,
    },
}

impl Engine {
    /// Load `cfg` from `source` on the chosen backend. `Auto` takes CUDA when a GPU is usable
    /// and says which it took, and why, through `log`.
    pub fn load(
        cfg: MoeConfig,
        source: Arc<dyn WeightSource>,
        opts: &LoadOptions,
        log: &dyn Fn(String),
    ) -> Result<Engine, EngineError> {
        let use_cuda = match opts.backend {
            BackendChoice::Cpu => false,
            BackendChoice::Cuda => true,
            BackendChoice::Auto => match tarfa_cuda::probe(0) {
                Ok(info) => {
                    log(format!("backend auto: {info}; using CUDA"));
                    true
                }
                Err(e) => {
                    log(format!("backend auto: no usable GPU ({e}); using the CPU"));
                    false
                }
            },
        };
        if use_cuda {
            let cuda = CudaOptions {
                hot: opts.hot.clone(),
                tuning: opts.cuda,
                ..CudaOptions::default()
            };
            let model = CudaModel::load(cfg, source, &cuda)?;
            let cache = model.new_cache()?;
            log(format!("backend cuda: {}", model.device()));
            match model.hot_stats() {
                Some(h) => log(format!(
                    "cuda: {} of dense weights resident; experts stream through a hot tier of {} \
                     slots ({})",
                    format_bytes(model.resident_bytes()),
                    h.slots,
                    format_bytes(h.pool_bytes)
                )),
                None => log(format!(
                    "cuda: every weight resident ({})",
                    format_bytes(model.resident_bytes())
                )),
            }
            Ok(Engine::Cuda {
                model: Box::new(model),
                cache: Box::new(cache),
            })
        } else {
            if opts.hot.is_some() {
                log(
                    "note: --vram-budget applies to the CUDA backend; the CPU computes from the \
                     RAM tier"
                        .into(),
                );
            }
            let model = Arc::new(CpuModel::load(cfg, source)?);
            let cache = model.new_cache();
            let engine = CpuEngine::new(
                model,
                EngineOptions {
                    threads: opts.threads,
                    kernel: opts.kernel,
                },
            )?;
            log(format!(
                "backend cpu ({}, {} threads)",
                engine.kernel().path().name(),
                engine.threads()
            ));
            Ok(Engine::Cpu { engine, cache })
        }
    }

    /// The GPU hot tier's counters (CUDA streaming only).
    pub fn hot_stats(&self) -> Option<HotStats> {
        match self {
            Engine::Cpu { .. } => None,
            Engine::Cuda { model, .. } => model.hot_stats(),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Engine::Cpu { .. } => "cpu",
            Engine::Cuda { .. } => "cuda",
        }
    }

    /// Worker threads of the CPU engine (0 for CUDA).
    pub fn threads(&self) -> usize {
        match self {
            Engine::Cpu { engine, .. } => engine.threads(),
            Engine::Cuda { .. } => 0,
        }
    }
}

/// Each step goes to the backend's [`Backend`] impl on the engine's cache: the CPU's
/// `greedy_step` is the trait's default (a forward step, the argmax on the host), CUDA's chooses
/// the token on the GPU and copies no logits back.
impl Session for Engine {
    type Error = EngineError;

    fn forward(
        &mut self,
        tokens: &[u32],
        opts: &ForwardOptions,
    ) -> Result<ForwardOutput, EngineError> {
        match self {
            Engine::Cpu { engine, cache } => Ok(Backend::forward(engine, cache, tokens, opts)?),
            Engine::Cuda { model, cache } => {
                Ok(Backend::forward(model.as_ref(), cache, tokens, opts)?)
            }
        }
    }

    fn greedy_step(&mut self, token: u32) -> Result<(u32, StepStats), EngineError> {
        match self {
            Engine::Cpu { engine, cache } => Ok(Backend::greedy_step(engine, cache, token)?),
            Engine::Cuda { model, cache } => {
                Ok(Backend::greedy_step(model.as_ref(), cache, token)?)
            }
        }
    }
}
