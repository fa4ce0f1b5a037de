//! The CUDA backend's entry points in a build without the `cuda` feature: each returns
//! [`CudaError::NotCompiled`]. Same names and signatures as the real ones.

use std::convert::Infallible;
use std::sync::Arc;

use super::{
    CudaError, CudaOptions, DecodeMode, DeviceInfo, KernelCheck, KernelTime, SelftestOptions,
    SelftestReport,
};
use tarfa_core::config::MoeConfig;
use tarfa_core::model::ArchSpec;
use tarfa_core::step::{ForwardOptions, ForwardOutput};
use tarfa_core::weights::WeightSource;

/// Is a usable CUDA GPU here? Never, in this build.
pub fn probe(_ordinal: usize) -> Result<DeviceInfo, CudaError> {
    Err(CudaError::NotCompiled)
}

/// A model on the GPU (never constructed in this build).
pub struct CudaModel {
    never: Infallible,
}

/// One sequence on the GPU (never constructed in this build).
pub struct CudaCache {
    never: Infallible,
}

impl CudaModel {
    pub fn load(
        _cfg: MoeConfig,
        _source: Arc<dyn WeightSource>,
        _opts: &CudaOptions,
    ) -> Result<CudaModel, CudaError> {
        Err(CudaError::NotCompiled)
    }
    pub fn load_mock(
        _cfg: MoeConfig,
        _source: Arc<dyn WeightSource>,
        _opts: &CudaOptions,
    ) -> Result<CudaModel, CudaError> {
        Err(CudaError::NotCompiled)
    }
    pub fn config(&self) -> &MoeConfig {
        match self.never {}
    }
    pub fn set_many_kernels(&self, _m: super::ManyKernels) {
        match self.never {}
    }
    pub fn many_kernels(&self) -> super::ManyKernels {
        match self.never {}
    }
    pub fn spec(&self) -> &ArchSpec {
        match self.never {}
    }
    pub fn device(&self) -> &DeviceInfo {
        match self.never {}
    }
    pub fn resident_bytes(&self) -> u64 {
        match self.never {}
    }
    pub fn hot_stats(&self) -> Option<super::HotStats> {
        match self.never {}
    }
    pub fn new_cache(&self) -> Result<CudaCache, CudaError> {
        match self.never {}
    }
    pub fn forward(
        &self,
        _cache: &mut CudaCache,
        _tokens: &[u32],
        _opts: &ForwardOptions,
    ) -> Result<ForwardOutput, CudaError> {
        match self.never {}
    }
    pub fn forward_seqs(
        &self,
        _seqs: &mut [tarfa_core::batch::BatchEntry<'_, CudaCache>],
    ) -> Result<Vec<ForwardOutput>, tarfa_core::batch::BatchError<CudaError>> {
        match self.never {}
    }
    pub fn forward_seqs_observed(
        &self,
        _seqs: &mut [tarfa_core::batch::BatchEntry<'_, CudaCache>],
        _hook: &mut dyn tarfa_cpu::StepHook,
    ) -> Result<Vec<ForwardOutput>, tarfa_core::batch::BatchError<CudaError>> {
        match self.never {}
    }
}

impl CudaModel {
    pub fn default_decode_mode(&self) -> DecodeMode {
        match self.never {}
    }
    pub fn decode_unsupported_reason(&self) -> Option<&str> {
        match self.never {}
    }
    pub fn reserve(&self, _cache: &mut CudaCache, _n: usize) -> Result<(), CudaError> {
        match self.never {}
    }
    pub fn decode_greedy(
        &self,
        _cache: &mut CudaCache,
        _first: u32,
        _n: usize,
    ) -> Result<Vec<u32>, CudaError> {
        match self.never {}
    }
    pub fn greedy_step(
        &self,
        _cache: &mut CudaCache,
        _token: u32,
    ) -> Result<(u32, tarfa_core::step::StepStats), CudaError> {
        match self.never {}
    }
    pub fn run_ahead(&self, _cache: &CudaCache) -> usize {
        match self.never {}
    }
    pub fn greedy_steps(
        &self,
        _cache: &mut CudaCache,
        _first: u32,
        _n: usize,
    ) -> Result<Vec<(u32, tarfa_core::step::StepStats)>, CudaError> {
        match self.never {}
    }
    pub fn profile_decode(
        &self,
        _cache: &mut CudaCache,
        _first: u32,
        _steps: usize,
    ) -> Result<Vec<KernelTime>, CudaError> {
        match self.never {}
    }
    pub fn copy_rate(&self, _bytes: usize, _reps: usize) -> Result<f64, CudaError> {
        match self.never {}
    }
    pub fn graph_costs(
        &self,
        _cache: &mut CudaCache,
        _first: u32,
        _n: usize,
        _per_kind: bool,
    ) -> Result<Vec<(String, f64, f64)>, CudaError> {
        match self.never {}
    }
    pub fn time_decode(
        &self,
        _cache: &mut CudaCache,
        _first: u32,
        _n: usize,
    ) -> Result<f64, CudaError> {
        match self.never {}
    }
}

impl CudaCache {
    pub fn set_decode_mode(&mut self, _mode: DecodeMode) {
        match self.never {}
    }
    pub fn decode_mode(&self) -> DecodeMode {
        match self.never {}
    }
    pub fn decode_running(&self) -> Option<(DecodeMode, String)> {
        match self.never {}
    }
    pub fn decode_launches(&self) -> usize {
        match self.never {}
    }
    pub fn len(&self) -> usize {
        match self.never {}
    }
    pub fn is_empty(&self) -> bool {
        match self.never {}
    }
    pub fn max_len(&self) -> usize {
        match self.never {}
    }
    pub fn truncate(&mut self, _len: usize) -> usize {
        match self.never {}
    }
}

pub fn selftest(
    _cfg: &MoeConfig,
    _source: Arc<dyn WeightSource>,
    _opts: &SelftestOptions,
    _cuda: &CudaOptions,
) -> Result<SelftestReport, CudaError> {
    Err(CudaError::NotCompiled)
}

pub fn locate_divergence(
    _cfg: &MoeConfig,
    _source: Arc<dyn WeightSource>,
    _prompt: &[u32],
    _cuda: &CudaOptions,
) -> Result<Option<usize>, CudaError> {
    Err(CudaError::NotCompiled)
}

pub fn selftest_streaming(
    _cfg: &MoeConfig,
    _bundle: Arc<tarfa_stream::bundle::BundleSource>,
    _opts: &SelftestOptions,
    _cuda: &CudaOptions,
    _cases: &[super::StreamCase],
) -> Result<Vec<(SelftestReport, super::HotStats, tarfa_stream::StreamStats)>, CudaError> {
    Err(CudaError::NotCompiled)
}

pub fn kernel_checks(_opts: &CudaOptions) -> Result<Vec<KernelCheck>, CudaError> {
    Err(CudaError::NotCompiled)
}

pub fn selftest_models(
    _engine: &tarfa_cpu::CpuEngine,
    gpu: &CudaModel,
    _opts: &SelftestOptions,
) -> Result<SelftestReport, CudaError> {
    match gpu.never {}
}
