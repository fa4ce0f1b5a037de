//! One compute engine for the commands, whichever backend runs it: the CPU reference or CUDA.
//! Both produce the same `ForwardOutput`, bit for bit (docs/EXACTNESS.md).

use std::sync::Arc;

use tarfa_run::config::MoeConfig;
use tarfa_run::cpu::{CpuEngine, CpuModel, EngineOptions, ForwardOptions, ForwardOutput, KvCache};
use tarfa_run::cuda::{self, CudaCache, CudaError, CudaModel, CudaOptions};
use tarfa_run::numerics::Kernel;
use tarfa_run::weights::WeightSource;

use super::generate::BackendArg;
use super::CliError;

// One engine per process: the size difference of the variants costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Engine {
    Cpu { engine: CpuEngine, cache: KvCache },
    Cuda { model: CudaModel, cache: CudaCache },
}

impl Engine {
    /// Load `cfg` from `source` on the chosen backend. `auto` takes CUDA when a GPU is usable
    /// and says which it took, and why, through `log`.
    pub fn load(
        backend: BackendArg,
        cfg: MoeConfig,
        source: Arc<dyn WeightSource>,
        threads: usize,
        kernel: Kernel,
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
            let model = CudaModel::load(cfg, source, &CudaOptions::default())?;
            let cache = model.new_cache()?;
            log(format!("backend cuda: {}", model.device()));
            Ok(Engine::Cuda { model, cache })
        } else {
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
