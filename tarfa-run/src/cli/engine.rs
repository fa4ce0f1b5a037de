//! One compute engine for the commands, whichever backend runs it: the CPU reference or CUDA.
//! Both produce the same `ForwardOutput`, bit for bit (docs/EXACTNESS.md).

use std::sync::Arc;

use tarfa_run::config::MoeConfig;
use tarfa_run::cpu::{
    CpuEngine, CpuModel, EngineOptions, ForwardOptions, ForwardOutput, KvCache, LogitRows,
    StepStats,
};
use tarfa_run::cuda::{self, CudaCache, CudaError, CudaModel, CudaOptions, HotOptions, HotStats};
use tarfa_run::generate::argmax;
use tarfa_run::numerics::Kernel;
use tarfa_run::stream::format_bytes;
use tarfa_run::weights::WeightSource;

use super::generate::BackendArg;
use super::CliError;

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
    /// Load `cfg` from `source` on the chosen backend. `auto` takes CUDA when a GPU is usable
    /// and says which it took, and why, through `log`. `hot`: stream the experts through a GPU
    /// hot tier (CUDA only; the CPU computes from the RAM tier directly).
    pub fn load(
        backend: BackendArg,
        cfg: MoeConfig,
        source: Arc<dyn WeightSource>,
        threads: usize,
        kernel: Kernel,
        hot: Option<HotOptions>,
        log: &dyn Fn(String),
    ) -> Result<Engine, CliError> {
        let use_cuda = match backend {
            BackendArg::Cpu => false,
            BackendArg::Cuda => true,
            BackendArg::Auto => match cuda::probe(0) {
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
            let opts = CudaOptions {
                hot,
                ..CudaOptions::default()
            };
            let model = CudaModel::load(cfg, source, &opts)?;
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
            if hot.is_some() {
                log(
                    "note: --vram-budget applies to the CUDA backend; the CPU computes from the \
                     RAM tier"
                        .into(),
                );
            }
            let model = Arc::new(CpuModel::load(cfg, source)?);
            let cache = model.new_cache();
            let engine = CpuEngine::new(model, EngineOptions { threads, kernel })?;
            log(format!(
                "backend cpu ({}, {} threads)",
                engine.kernel().path().name(),
                engine.threads()
            ));
            Ok(Engine::Cpu { engine, cache })
        }
    }

    pub fn forward(
        &mut self,
        tokens: &[u32],
        opts: &ForwardOptions,
    ) -> Result<ForwardOutput, CliError> {
        match self {
            Engine::Cpu { engine, cache } => Ok(engine.forward(cache, tokens, opts)?),
            Engine::Cuda { model, cache } => Ok(model.forward(cache, tokens, opts)?),
        }
    }

    /// One greedy decode step after `token`: the next token (the argmax of the step's logits)
    /// and the step's statistics, for callers that keep neither the logits nor the router's
    /// records. CUDA chooses the token on the GPU and copies no logits back
    /// (`CudaModel::greedy_step`); the CPU runs its forward step.
    pub fn greedy_step(&mut self, token: u32) -> Result<(u32, StepStats), CliError> {
        match self {
            Engine::Cpu { engine, cache } => {
                let opts = ForwardOptions {
                    logits: LogitRows::Last,
                    ..ForwardOptions::default()
                };
                let out = engine.forward(cache, &[token], &opts)?;
                Ok((argmax(&out.logits[0]), out.stats))
            }
            Engine::Cuda { model, cache } => Ok(model.greedy_step(cache, token)?),
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

impl From<CudaError> for CliError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::Run(r) => CliError::Run(r),
            other => CliError::Environment(other.to_string()),
        }
    }
}
