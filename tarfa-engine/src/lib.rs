//! One compute session for every front end, whichever backend runs it: the CPU reference or
//! CUDA, chosen when the model is loaded ([`BackendChoice`]).
//!
//! - A [`Model`] is the loaded weights on one backend, with no sequence state.
//! - A [`Sequence`] owns one sequence's KV cache; [`Model::new_sequence`] makes it.
//! - [`Model::step`] runs any set of sequences' pending tokens as one step ([`SeqStep`]): the
//!   seam of the many-token engine (issue 17). The scoring command drives it with many
//!   sequences at once; a server and a Python package are meant to drive the same API.
//! - An [`Engine`] is a model and one sequence: a [`Session`], so the one decode loop
//!   ([`tarfa_core::generate::run`]) drives it, with the caller's
//!   [`Observer`](tarfa_core::generate::Observer) streaming, tracing or collecting (the CLI's
//!   `generate`).
//!
//! Both backends return the same [`ForwardOutput`], bit for bit (docs/EXACTNESS.md), and a
//! sequence's outputs never depend on which other sequences share its steps, nor on how its
//! tokens were split into steps.
//!
//! This crate must never compute anything itself, nor choose a token any other way than the
//! backends do: it only loads, dispatches and reports. It must never depend on a front end (the
//! CLI, tarfa-convert): they depend on it.

use std::sync::Arc;

use tarfa_core::batch::{BatchEntry, BatchError};
use tarfa_core::config::MoeConfig;
use tarfa_core::generate::Session;
use tarfa_core::model::ArchSpec;
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
    /// The CUDA backend on tarfa-cuda's mock device (host memory, the kernels' reference
    /// functions or their emulator): its path without a GPU, for tests. It needs tarfa-cuda's
    /// `mock-device` feature (a test's dev-dependency turns it on); otherwise loading fails with
    /// [`CudaError::NoMockDevice`].
    CudaMock,
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
    /// A sequence was stepped on a model of the other backend than the one that made it (a bug
    /// in the caller).
    #[error("a {sequence} sequence cannot be stepped on the {model} backend")]
    ForeignSequence {
        sequence: &'static str,
        model: &'static str,
    },
}

/// Why a [`Model::step`] failed: which of its sequences, and the error. No sequence of the step
/// advanced (see [`Model::step`]).
#[derive(Debug, thiserror::Error)]
#[error("{}{error}", match index { Some(i) => format!("sequence {i} of the step: "), None => String::new() })]
pub struct StepError {
    /// The index in the step's slice of the sequence that failed; `None` when the step as a
    /// whole failed (a weight that did not verify, a device error), which no one sequence caused.
    pub index: Option<usize>,
    pub error: EngineError,
}

impl From<CudaError> for EngineError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::Run(r) => EngineError::Run(r),
            other => EngineError::Cuda(other),
        }
    }
}

/// A model loaded on one backend, with no sequence state: any number of [`Sequence`]s run on it.
pub enum Model {
    Cpu(CpuEngine),
    // boxed: the CUDA model is far larger than the CPU engine's handles
    Cuda(Box<CudaModel>),
}

/// One sequence's state on a [`Model`]'s backend: its own KV cache, and nothing shared with any
/// other sequence.
pub struct Sequence {
    cache: SequenceCache,
}

enum SequenceCache {
    Cpu(Box<KvCache>),
    Cuda(Box<CudaCache>),
}

/// One sequence's part of a [`Model::step`]: its pending tokens (run at positions
/// `seq.len()..`) and which logits and records it wants.
pub struct SeqStep<'a> {
    pub seq: &'a mut Sequence,
    pub tokens: &'a [u32],
    pub opts: ForwardOptions,
}

impl Sequence {
    /// Positions cached (tokens run so far).
    pub fn len(&self) -> usize {
        match &self.cache {
            SequenceCache::Cpu(c) => c.len(),
            SequenceCache::Cuda(c) => c.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most positions the sequence accepts (`max_position_embeddings`).
    pub fn max_len(&self) -> usize {
        match &self.cache {
            SequenceCache::Cpu(c) => c.max_len(),
            SequenceCache::Cuda(c) => c.max_len(),
        }
    }

    /// Forgets positions from `len` on (a failed step's undo; a rewind to a shared prefix) and
    /// returns the positions kept: fewer than asked (0) when a windowed or chunked layer of the
    /// CPU's cache dropped rows position `len` reads; re-feed from there.
    #[must_use = "a rewind may keep fewer positions than asked: re-feed from what it returns"]
    pub fn truncate(&mut self, len: usize) -> usize {
        match &mut self.cache {
            SequenceCache::Cpu(c) => c.truncate(len),
            SequenceCache::Cuda(c) => c.truncate(len),
        }
    }

    fn backend_name(&self) -> &'static str {
        match &self.cache {
            SequenceCache::Cpu(_) => "cpu",
            SequenceCache::Cuda(_) => "cuda",
        }
    }
}

impl Model {
    /// Load `cfg` from `source` on the chosen backend. `Auto` takes CUDA when a GPU is usable
    /// and says which it took, and why, through `log`.
    pub fn load(
        cfg: MoeConfig,
        source: Arc<dyn WeightSource>,
        opts: &LoadOptions,
        log: &dyn Fn(String),
    ) -> Result<Model, EngineError> {
        // A family the CUDA kernels do not implement: `--backend cuda` is refused by name (bad
        // input, exit 2), `--backend auto` runs it on the CPU and says why.
        let cuda_gap = tarfa_cuda::unsupported_family(&cfg, &ArchSpec::new(&cfg));
        let use_cuda = match (opts.backend, &cuda_gap) {
            (BackendChoice::Cpu, _) => false,
            (BackendChoice::Cuda | BackendChoice::CudaMock, Some(why)) => {
                return Err(EngineError::Cuda(CudaError::UnsupportedModel(why.clone())))
            }
            (BackendChoice::Cuda | BackendChoice::CudaMock, None) => true,
            (BackendChoice::Auto, Some(why)) => {
                log(format!("backend auto: {why}; using the CPU"));
                false
            }
            (BackendChoice::Auto, None) => match tarfa_cuda::probe(0) {
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
            let model = if opts.backend == BackendChoice::CudaMock {
                CudaModel::load_mock(cfg, source, &cuda)?
            } else {
                CudaModel::load(cfg, source, &cuda)?
            };
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
            Ok(Model::Cuda(Box::new(model)))
        } else {
            if opts.hot.is_some() {
                log(
                    "note: --vram-budget applies to the CUDA backend; the CPU computes from the \
                     RAM tier"
                        .into(),
                );
            }
            let model = Arc::new(CpuModel::load(cfg, source)?);
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
            Ok(Model::Cpu(engine))
        }
    }

    /// The model's config.
    pub fn config(&self) -> &MoeConfig {
        match self {
            Model::Cpu(e) => e.model().config(),
            Model::Cuda(m) => m.config(),
        }
    }

    /// A new, empty sequence on this model's backend.
    pub fn new_sequence(&self) -> Result<Sequence, EngineError> {
        let cache = match self {
            Model::Cpu(e) => SequenceCache::Cpu(Box::new(e.model().new_cache())),
            Model::Cuda(m) => SequenceCache::Cuda(Box::new(m.new_cache()?)),
        };
        Ok(Sequence { cache })
    }

    /// Runs every sequence's pending tokens (appending them to its cache) and returns each
    /// one's output, in the order of `steps`: [`Backend::forward_batch`]. On the CPU that is one
    /// pass through the layers for the union of the step's tokens (every matrix applied once,
    /// the experts expert-major); on CUDA, until its batched kernels exist (issue 17), the
    /// trait's loop of [`Backend::forward`]. Either way every sequence's logits, router records
    /// and counters are bit-identical whatever it shares a step with, and however its tokens
    /// were split into steps (docs/EXACTNESS.md, "Batching").
    ///
    /// All or nothing: on an error no sequence has advanced, and the error names the failing
    /// sequence's index, or none when the step as a whole failed (a weight, the device).
    pub fn step(&self, steps: &mut [SeqStep<'_>]) -> Result<Vec<ForwardOutput>, StepError> {
        let step_err = |b: BatchError<EngineError>| StepError {
            index: b.sequence,
            error: b.error,
        };
        self.check_owned(steps)?;
        match self {
            Model::Cpu(e) => {
                let mut entries = cpu_entries(steps);
                Backend::forward_batch(e, &mut entries).map_err(|b| {
                    step_err(BatchError {
                        sequence: b.sequence,
                        error: b.error.into(),
                    })
                })
            }
            Model::Cuda(m) => {
                let mut entries: Vec<BatchEntry<'_, CudaCache>> = steps
                    .iter_mut()
                    .map(|s| match &mut s.seq.cache {
                        SequenceCache::Cuda(c) => BatchEntry {
                            cache: c.as_mut(),
                            tokens: s.tokens,
                            opts: s.opts,
                        },
                        SequenceCache::Cpu(_) => unreachable!("checked above"),
                    })
                    .collect();
                Backend::forward_batch(m.as_ref(), &mut entries).map_err(|b| {
                    step_err(BatchError {
                        sequence: b.sequence,
                        error: b.error.into(),
                    })
                })
            }
        }
    }

    /// [`Model::step`] with `hook` shown the step's values ([`tarfa_cpu::StepHook`]); the
    /// outputs are the same bits unless `hook` writes to them (an intervention, which its caller
    /// must label). On CUDA captures only ([`CudaModel::forward_seqs_observed`]: the same bits
    /// as the CPU's): a hook whose [`tarfa_cpu::StepHook::intervention`] names one is refused
    /// with [`RunError::Intervention`] before any work.
    pub fn step_observed(
        &self,
        steps: &mut [SeqStep<'_>],
        hook: &mut dyn tarfa_cpu::StepHook,
    ) -> Result<Vec<ForwardOutput>, StepError> {
        self.check_owned(steps)?;
        match self {
            Model::Cpu(e) => {
                let mut entries = cpu_entries(steps);
                e.forward_batch_observed(&mut entries, Some(hook))
                    .map_err(|b| StepError {
                        index: b.sequence,
                        error: b.error.into(),
                    })
            }
            // captures only: a hook that intervenes is refused by name before any work
            // (RunError::Intervention, exit 2)
            Model::Cuda(m) => {
                let mut entries: Vec<BatchEntry<'_, CudaCache>> = steps
                    .iter_mut()
                    .map(|s| match &mut s.seq.cache {
                        SequenceCache::Cuda(c) => BatchEntry {
                            cache: c.as_mut(),
                            tokens: s.tokens,
                            opts: s.opts,
                        },
                        SequenceCache::Cpu(_) => unreachable!("checked above"),
                    })
                    .collect();
                m.forward_seqs_observed(&mut entries, hook)
                    .map_err(|b| StepError {
                        index: b.sequence,
                        error: b.error.into(),
                    })
            }
        }
    }

    /// Whether `seq` was made by this model's backend.
    fn owns(&self, seq: &Sequence) -> bool {
        matches!(
            (self, &seq.cache),
            (Model::Cpu(_), SequenceCache::Cpu(_)) | (Model::Cuda(_), SequenceCache::Cuda(_))
        )
    }

    /// One sequence's step: [`Backend::forward`] on its cache (left as it was on error).
    pub fn forward(
        &self,
        seq: &mut Sequence,
        tokens: &[u32],
        opts: &ForwardOptions,
    ) -> Result<ForwardOutput, EngineError> {
        match (self, &mut seq.cache) {
            (Model::Cpu(e), SequenceCache::Cpu(c)) => Ok(Backend::forward(e, c, tokens, opts)?),
            (Model::Cuda(m), SequenceCache::Cuda(c)) => {
                Ok(Backend::forward(m.as_ref(), c.as_mut(), tokens, opts)?)
            }
            _ => Err(self.foreign(seq)),
        }
    }

    /// One greedy decode step after `token` on `seq` ([`Backend::greedy_step`]: CUDA chooses
    /// the token on the GPU and copies no logits back).
    pub fn greedy_step(
        &self,
        seq: &mut Sequence,
        token: u32,
    ) -> Result<(u32, StepStats), EngineError> {
        match (self, &mut seq.cache) {
            (Model::Cpu(e), SequenceCache::Cpu(c)) => Ok(Backend::greedy_step(e, c, token)?),
            (Model::Cuda(m), SequenceCache::Cuda(c)) => {
                Ok(Backend::greedy_step(m.as_ref(), c.as_mut(), token)?)
            }
            _ => Err(self.foreign(seq)),
        }
    }

    /// One step over `tokens` on `seq` and the greedy token after each
    /// ([`Backend::greedy_rows`]: the argmax of every row; verifying drafts greedily).
    pub fn greedy_rows(
        &self,
        seq: &mut Sequence,
        tokens: &[u32],
    ) -> Result<(Vec<u32>, StepStats), EngineError> {
        match (self, &mut seq.cache) {
            (Model::Cpu(e), SequenceCache::Cpu(c)) => Ok(Backend::greedy_rows(e, c, tokens)?),
            (Model::Cuda(m), SequenceCache::Cuda(c)) => {
                Ok(Backend::greedy_rows(m.as_ref(), c.as_mut(), tokens)?)
            }
            _ => Err(self.foreign(seq)),
        }
    }

    /// Every sequence of `steps` was made by this model's backend.
    fn check_owned(&self, steps: &[SeqStep<'_>]) -> Result<(), StepError> {
        match steps.iter().position(|s| !self.owns(s.seq)) {
            Some(index) => Err(StepError {
                index: Some(index),
                error: self.foreign(steps[index].seq),
            }),
            None => Ok(()),
        }
    }

    fn foreign(&self, seq: &Sequence) -> EngineError {
        EngineError::ForeignSequence {
            sequence: seq.backend_name(),
            model: self.name(),
        }
    }

    /// How many greedy steps [`Model::greedy_steps`] runs on `seq` before it waits for them:
    /// 1 on the CPU (nothing to gain), several on CUDA's decode kernels.
    pub fn run_ahead(&self, seq: &Sequence) -> usize {
        match (self, &seq.cache) {
            (Model::Cuda(m), SequenceCache::Cuda(c)) => m.run_ahead(c),
            _ => 1,
        }
    }

    /// `n` greedy steps from `first` on `seq`: the tokens [`Model::greedy_step`] chooses one by
    /// one, bit for bit, each with its step's counters (CUDA queues them and waits once).
    pub fn greedy_steps(
        &self,
        seq: &mut Sequence,
        first: u32,
        n: usize,
    ) -> Result<Vec<(u32, StepStats)>, EngineError> {
        if let (Model::Cuda(m), SequenceCache::Cuda(c)) = (self, &mut seq.cache) {
            return Ok(m.greedy_steps(c, first, n)?);
        }
        match (self, &seq.cache) {
            (Model::Cpu(_), SequenceCache::Cpu(_)) => {
                let mut out = Vec::with_capacity(n);
                let mut t = first;
                for _ in 0..n {
                    let step = self.greedy_step(seq, t)?;
                    t = step.0;
                    out.push(step);
                }
                Ok(out)
            }
            _ => Err(self.foreign(seq)),
        }
    }

    /// The GPU hot tier's counters (CUDA streaming only).
    pub fn hot_stats(&self) -> Option<HotStats> {
        match self {
            Model::Cpu(_) => None,
            Model::Cuda(m) => m.hot_stats(),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Model::Cpu(_) => "cpu",
            Model::Cuda(_) => "cuda",
        }
    }

    /// Worker threads of the CPU engine (0 for CUDA).
    pub fn threads(&self) -> usize {
        match self {
            Model::Cpu(e) => e.threads(),
            Model::Cuda(_) => 0,
        }
    }
}

/// A model and one sequence: what the CLI's `generate` drives through the decode loop.
pub struct Engine {
    pub model: Model,
    pub seq: Sequence,
}

impl Engine {
    /// Load `cfg` from `source` on the chosen backend ([`Model::load`]), with one empty
    /// sequence.
    pub fn load(
        cfg: MoeConfig,
        source: Arc<dyn WeightSource>,
        opts: &LoadOptions,
        log: &dyn Fn(String),
    ) -> Result<Engine, EngineError> {
        let model = Model::load(cfg, source, opts, log)?;
        let seq = model.new_sequence()?;
        Ok(Engine { model, seq })
    }

    /// The GPU hot tier's counters (CUDA streaming only).
    pub fn hot_stats(&self) -> Option<HotStats> {
        self.model.hot_stats()
    }

    pub fn name(&self) -> &'static str {
        self.model.name()
    }

    /// Worker threads of the CPU engine (0 for CUDA).
    pub fn threads(&self) -> usize {
        self.model.threads()
    }
}

/// Each step goes to the backend's [`Backend`] impl on the engine's sequence: the CPU's
/// `greedy_step` is the trait's default (a forward step, the argmax on the host), CUDA's chooses
/// the token on the GPU and copies no logits back.
impl Session for Engine {
    type Error = EngineError;

    fn forward(
        &mut self,
        tokens: &[u32],
        opts: &ForwardOptions,
    ) -> Result<ForwardOutput, EngineError> {
        self.model.forward(&mut self.seq, tokens, opts)
    }

    fn greedy_step(&mut self, token: u32) -> Result<(u32, StepStats), EngineError> {
        self.model.greedy_step(&mut self.seq, token)
    }

    fn greedy_rows(&mut self, tokens: &[u32]) -> Result<(Vec<u32>, StepStats), EngineError> {
        self.model.greedy_rows(&mut self.seq, tokens)
    }

    fn run_ahead(&self) -> usize {
        self.model.run_ahead(&self.seq)
    }

    fn greedy_steps(&mut self, first: u32, n: usize) -> Result<Vec<(u32, StepStats)>, EngineError> {
        self.model.greedy_steps(&mut self.seq, first, n)
    }

    fn cached_len(&self) -> usize {
        self.seq.len()
    }

    fn rewind_to(&mut self, len: usize) -> usize {
        self.seq.truncate(len)
    }
}

/// The CPU caches of `steps` as the backend's batch entries (every sequence checked to be the
/// CPU's by [`Model::check_owned`]).
fn cpu_entries<'s>(steps: &'s mut [SeqStep<'_>]) -> Vec<BatchEntry<'s, KvCache>> {
    steps
        .iter_mut()
        .map(|s| match &mut s.seq.cache {
            SequenceCache::Cpu(c) => BatchEntry {
                cache: &mut **c,
                tokens: s.tokens,
                opts: s.opts,
            },
            SequenceCache::Cuda(_) => unreachable!("checked by check_owned"),
        })
        .collect()
}
