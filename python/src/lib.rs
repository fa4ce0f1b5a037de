//! The native half of the `tarfa` Python package (`tarfa._tarfa`): a verified bundle opened as the
//! CLI opens it, forward steps through [`tarfa_engine::Model::step`], and scoring through
//! [`tarfa_score::score`], with numpy arrays at the boundary.
//!
//! Every error arrives in Python as one of three exceptions, chosen by the exit code the CLI
//! would give for the same failure (`tarfa_core::exit`), with the CLI's message. A panic never
//! crosses into Python: every entry point runs under `catch_unwind`. The GIL is released while
//! the engine computes, and signals (Ctrl-C) are checked between engine steps.
//!
//! This crate must never compute anything itself: every number comes from the engine crates.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use tarfa_core::chat::ChatMessage;
use tarfa_core::exit;
use tarfa_core::step::{ForwardOptions, ForwardOutput, LogitRows};
use tarfa_core::weights::WeightSource;
use tarfa_engine::{BackendChoice, LoadOptions, Model, SeqStep, Sequence};
use tarfa_run::bundle::BundleSource;
use tarfa_run::cli::stream::{StreamArgs, StreamRun};
use tarfa_run::cli::CliError;
use tarfa_score::{Decoding, Limits, Options, ScoreError, ScoreOptions};

pyo3::create_exception!(
    tarfa,
    TarfaError,
    PyException,
    "Base class of every error tarfa raises."
);
pyo3::create_exception!(
    tarfa,
    VerificationError,
    TarfaError,
    "A bundle or weight did not verify (the CLI's exit code 1)."
);
pyo3::create_exception!(
    tarfa,
    InputError,
    TarfaError,
    "Bad input or usage: a path, an argument, a token id, a request (the CLI's exit code 2)."
);
pyo3::create_exception!(
    tarfa,
    EnvironmentError,
    TarfaError,
    "The environment failed: I/O, memory, no GPU (the CLI's exit code 3)."
);

/// The exception of the CLI's exit code for `e`, with its message.
fn py_err(e: CliError) -> PyErr {
    py_err_prefixed("", e)
}

/// [`py_err`] with `prefix` before the message (which input of a batch failed).
fn py_err_prefixed(prefix: &str, e: CliError) -> PyErr {
    let msg = format!("{prefix}{e}");
    match e.exit_code() {
        exit::VERIFICATION_FAILED => VerificationError::new_err(msg),
        exit::BAD_INPUT => InputError::new_err(msg),
        exit::ENVIRONMENT => EnvironmentError::new_err(msg),
        // exit_code() returns only the three failure codes above; an i32 has no exhaustive match
        other => EnvironmentError::new_err(format!("{msg} (unexpected exit code {other})")),
    }
}

fn input_err(msg: impl Into<String>) -> PyErr {
    InputError::new_err(msg.into())
}

/// Runs `f`, turning a panic into `tarfa.EnvironmentError` (a bug in tarfa, never a crash of the
/// interpreter).
fn guarded<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let what = p
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            Err(EnvironmentError::new_err(format!(
                "internal error (a bug in tarfa, please report it): {what}"
            )))
        }
    }
}

/// How often a call in progress looks for a signal (Ctrl-C): often enough that an interrupt
/// feels immediate, rarely enough to cost nothing.
const SIGNAL_POLL: Duration = Duration::from_millis(50);

/// Runs `work` on a scoped thread, the GIL released, while the calling thread (Python's main
/// thread, the only one whose signal check runs the handlers) looks for a signal every
/// [`SIGNAL_POLL`]. When a handler raises (Ctrl-C: `KeyboardInterrupt`), `stop` is set; `work`
/// polls it between layers or engine steps and returns early, and that exception is raised
/// once it has. Nothing of an interrupted call is kept: every call runs on its own fresh
/// sequences, so the model is as it was before.
fn interruptible<T: Send>(
    py: Python<'_>,
    stop: &AtomicBool,
    work: impl FnOnce() -> PyResult<T> + Send,
) -> PyResult<T> {
    py.detach(|| {
        let caller = std::thread::current();
        std::thread::scope(|s| {
            let worker = s.spawn(|| {
                let r = guarded(work);
                caller.unpark();
                r
            });
            let mut signal: Option<PyErr> = None;
            while !worker.is_finished() {
                std::thread::park_timeout(SIGNAL_POLL);
                if signal.is_none() {
                    if let Err(e) = Python::attach(|py| py.check_signals()) {
                        stop.store(true, Ordering::Relaxed);
                        signal = Some(e);
                    }
                }
            }
            // `guarded` caught any panic of `work`
            let r = worker.join().unwrap_or_else(|_| {
                Err(EnvironmentError::new_err(
                    "internal error: a worker panicked",
                ))
            });
            match signal {
                Some(e) => Err(e),
                None => r,
            }
        })
    })
}

/// What an open model holds: the engine and what the bundle said about itself.
struct Loaded {
    model: Model,
    /// Loaded with `backend="cuda-mock"`: the CUDA backend on tarfa-cuda's mock device (tests).
    mock_device: bool,
    bundle: PathBuf,
    source: Arc<BundleSource>,
    config_json: String,
    tokenizer: Option<tokenizers::Tokenizer>,
    eos: Vec<u32>,
    vocab_size: usize,
    max_positions: usize,
    num_layers: usize,
    hidden_size: usize,
    num_experts: usize,
    top_k: usize,
    /// The MoE layers' absolute indices (the layers `force` can name).
    moe_layers: Vec<usize>,
    /// Kept for as long as the model: the streamed weight source and its heat ledger.
    stream: StreamRun,
}

/// A model opened from a verified bundle. `close()` frees it; any later call raises
/// `tarfa.InputError`.
#[pyclass(module = "tarfa._tarfa", name = "NativeModel")]
struct NativeModel {
    inner: Option<Loaded>,
    root_digest: String,
}

impl NativeModel {
    fn loaded(&self) -> PyResult<&Loaded> {
        self.inner
            .as_ref()
            .ok_or_else(|| input_err("the model is closed"))
    }
}

/// One forward step's output as Python objects.
fn output_to_py<'py>(
    py: Python<'py>,
    out: &ForwardOutput,
    vocab: usize,
    n: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let flat: Vec<f32> = out.logits.iter().flatten().copied().collect();
    let logits = PyArray1::from_vec(py, flat).reshape([out.logits.len(), vocab])?;
    d.set_item("logits", logits)?;
    // router records come ordered by layer, then position: one [n, k] block per MoE layer
    let layers = PyList::empty(py);
    let topk = PyList::empty(py);
    let weights = PyList::empty(py);
    let probs = PyList::empty(py);
    for block in out.router.chunk_by(|a, b| a.layer == b.layer) {
        let k = block[0].experts.len();
        if block.len() != n || block.iter().any(|r| r.experts.len() != k) {
            return Err(EnvironmentError::new_err(format!(
                "internal error: layer {} has {} router records of {n} tokens",
                block[0].layer,
                block.len()
            )));
        }
        layers.append(block[0].layer)?;
        let ids: Vec<i64> = block
            .iter()
            .flat_map(|r| r.experts.iter().map(|&e| i64::from(e)))
            .collect();
        let w: Vec<f32> = block
            .iter()
            .flat_map(|r| r.weights.iter().copied())
            .collect();
        let p: Vec<f32> = block.iter().flat_map(|r| r.probs.iter().copied()).collect();
        topk.append(PyArray1::from_vec(py, ids).reshape([n, k])?)?;
        weights.append(PyArray1::from_vec(py, w).reshape([n, k])?)?;
        probs.append(PyArray1::from_vec(py, p).reshape([n, k])?)?;
    }
    d.set_item("moe_layers", layers)?;
    d.set_item("router_topk", topk)?;
    d.set_item("router_weights", weights)?;
    d.set_item("router_topk_probs", probs)?;
    d.set_item("weight_bytes", out.stats.weight_bytes)?;
    d.set_item("experts_fetched", out.stats.experts_fetched)?;
    Ok(d)
}

/// The test-only backend name: the CUDA backend on tarfa-cuda's mock device
/// ([`BackendChoice::CudaMock`]), so that Python's tests run the CUDA path without a GPU.
const CUDA_MOCK: &str = "cuda-mock";

fn backend_choice(name: &str) -> PyResult<BackendChoice> {
    match name {
        "auto" => Ok(BackendChoice::Auto),
        "cpu" => Ok(BackendChoice::Cpu),
        "cuda" => Ok(BackendChoice::Cuda),
        CUDA_MOCK => Ok(BackendChoice::CudaMock),
        other => Err(input_err(format!(
            "backend: expected \"auto\", \"cpu\" or \"cuda\" (\"{CUDA_MOCK}\" is for tests: \
             the CUDA backend on tarfa-cuda's mock device, in a build with its mock-device \
             feature), got {other:?}"
        ))),
    }
}

/// A failure of [`Model::load`] as Python's exception; a `"cuda-mock"` load that this build
/// cannot do (tarfa-cuda without its `mock-device` feature, or without CUDA at all) says which
/// feature the backend needs, still as the environment's failure (exit code 3).
fn load_err(backend: BackendChoice, e: tarfa_engine::EngineError) -> PyErr {
    use tarfa_engine::EngineError;
    use tarfa_run::cuda::CudaError;
    match e {
        EngineError::Cuda(c @ (CudaError::NoMockDevice | CudaError::NotCompiled))
            if backend == BackendChoice::CudaMock =>
        {
            EnvironmentError::new_err(format!(
                "backend \"{CUDA_MOCK}\" (for tests) needs a build with tarfa-cuda's \
                 mock-device feature (the CI wheel's: python/Cargo.toml's ci-workspace-features): \
                 {c}"
            ))
        }
        e => py_err(e.into()),
    }
}

#[pymethods]
impl NativeModel {
    /// Opens and verifies the bundle at `path`, as `tarfa-run` does, and loads it.
    #[new]
    // one argument per keyword of `tarfa.open`
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (path, backend="auto", threads=None, ram_budget=None, vram_budget=None, expect_root=None, log=false))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        backend: &str,
        threads: Option<usize>,
        ram_budget: Option<u64>,
        vram_budget: Option<u64>,
        expect_root: Option<String>,
        log: bool,
    ) -> PyResult<NativeModel> {
        let backend = backend_choice(backend)?;
        if let Some(t) = threads {
            tarfa_run::cli::threads_arg(&t.to_string())
                .map_err(|e| input_err(format!("threads: {e}")))?;
        }
        let verbose = log;
        py.detach(|| {
            guarded(|| {
                let log = |s: String| {
                    if verbose {
                        eprintln!("{s}");
                    }
                };
                let opened = tarfa_run::cli::open_bundle(&path, expect_root.as_deref(), &log)
                    .map_err(py_err)?;
                let eos = tarfa_run::cli::generate::eos_ids(&opened.source, &opened.cfg, !verbose)
                    .map_err(py_err)?;
                let stream_args = StreamArgs {
                    ram_budget,
                    vram_budget,
                    ..StreamArgs::default()
                };
                let stream = tarfa_run::cli::stream::open(
                    &stream_args,
                    opened.source.clone(),
                    &opened.cfg,
                    opened.cfg.max_position_embeddings,
                    !verbose,
                    &log,
                )
                .map_err(py_err)?;
                let load = LoadOptions {
                    backend,
                    threads: threads.unwrap_or(0),
                    kernel: tarfa_core::numerics::Kernel::best(),
                    hot: stream.hot_options(),
                    cuda: Default::default(),
                };
                let model = Model::load(
                    opened.cfg.clone(),
                    stream.source.clone() as Arc<dyn WeightSource>,
                    &load,
                    &log,
                )
                .map_err(|e| load_err(backend, e))?;
                Ok(NativeModel {
                    root_digest: opened.source.root_digest().to_string(),
                    inner: Some(Loaded {
                        mock_device: backend == BackendChoice::CudaMock,
                        model,
                        bundle: path.clone(),
                        vocab_size: opened.cfg.vocab_size,
                        max_positions: opened.cfg.max_position_embeddings,
                        num_layers: opened.cfg.num_layers,
                        hidden_size: opened.cfg.hidden_size,
                        num_experts: opened.cfg.num_experts,
                        top_k: opened.cfg.top_k,
                        moe_layers: {
                            let spec = tarfa_core::model::ArchSpec::new(&opened.cfg);
                            (0..opened.cfg.num_layers)
                                .filter(|&l| spec.moe_index(l).is_some())
                                .collect()
                        },
                        source: opened.source,
                        config_json: opened.config_json,
                        tokenizer: opened.tokenizer,
                        eos,
                        stream,
                    }),
                })
            })
        })
    }

    #[getter]
    fn root_digest(&self) -> &str {
        &self.root_digest
    }

    #[getter]
    fn config_json(&self) -> PyResult<String> {
        Ok(self.loaded()?.config_json.clone())
    }

    #[getter]
    fn backend(&self) -> PyResult<&'static str> {
        let l = self.loaded()?;
        // "cuda-mock" names the mock device, as `tarfa.open` took it (the backend is CUDA's)
        Ok(if l.mock_device {
            CUDA_MOCK
        } else {
            l.model.name()
        })
    }

    #[getter]
    fn threads(&self) -> PyResult<usize> {
        Ok(self.loaded()?.model.threads())
    }

    #[getter]
    fn eos_token_ids(&self) -> PyResult<Vec<u32>> {
        Ok(self.loaded()?.eos.clone())
    }

    /// The experts the router selects per token (the resolved `num_experts_per_tok`).
    #[getter]
    fn top_k(&self) -> PyResult<usize> {
        Ok(self.loaded()?.top_k)
    }

    #[getter]
    fn moe_layers(&self) -> PyResult<Vec<usize>> {
        Ok(self.loaded()?.moe_layers.clone())
    }

    #[getter]
    fn has_tokenizer(&self) -> PyResult<bool> {
        Ok(self.loaded()?.tokenizer.is_some())
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_none()
    }

    /// Frees the model (its weights, caches and threads).
    fn close(&mut self) {
        if let Some(l) = self.inner.take() {
            l.stream.finish(&|_| {});
        }
    }

    fn encode(&self, text: &str, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        let l = self.loaded()?;
        let tok = tokenizer(l)?;
        guarded(|| {
            tok.encode(text, add_special_tokens)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| input_err(format!("{}: tokenizer.json: {e}", l.bundle.display())))
        })
    }

    fn decode(&self, ids: Vec<u32>, skip_special_tokens: bool) -> PyResult<String> {
        let l = self.loaded()?;
        let tok = tokenizer(l)?;
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= l.vocab_size) {
            return Err(input_err(format!(
                "token id {bad} is outside the vocabulary of {}",
                l.vocab_size
            )));
        }
        guarded(|| {
            tok.decode(&ids, skip_special_tokens)
                .map_err(|e| input_err(format!("{}: tokenizer.json: {e}", l.bundle.display())))
        })
    }

    /// The bundle's chat template rendered over `messages` ((role, content) pairs).
    fn apply_chat_template(
        &self,
        messages: Vec<(String, String)>,
        add_generation_prompt: bool,
    ) -> PyResult<String> {
        let l = self.loaded()?;
        let bundle = l.bundle.display().to_string();
        guarded(|| {
            let template =
                tarfa_run::cli::generate::chat_template(&l.source, &l.bundle, "chat template")
                    .map_err(py_err)?
                    .ok_or_else(|| {
                        input_err(format!(
                        "{bundle}: the bundle has no chat template (no chat_template.jinja, and \
                         no chat_template in tokenizer_config.json)"
                    ))
                    })?;
            let messages: Vec<ChatMessage> = messages
                .iter()
                .map(|(r, c)| ChatMessage::new(r, c))
                .collect();
            template
                .render(&messages, add_generation_prompt)
                .map_err(|e| input_err(format!("{bundle}: chat template: {e}")))
        })
    }

    /// One fresh sequence per entry of `batch`, run as one engine step: every position's logits
    /// and the router's records. Returns one dict per sequence.
    ///
    /// `residual_layers`: capture the residual stream entering each of these layers (the layer
    /// count itself: after the last layer, before the final norm), per sequence `[n, hidden]`.
    ///
    /// `edits`: interventions, `(layer, replace, rows)`: before `layer` runs (the layer count:
    /// before the final norm), the residual of every token of the step gets `rows` (token-major,
    /// `[n_total, hidden]` flattened) added, or is replaced by it. Changes the model's output:
    /// the caller labels it.
    ///
    /// `router_layers`: capture these MoE layers' router logits, per sequence `[n, experts]`.
    /// `ablate`: `(layer, experts)`: those experts' router logits become -inf before the
    /// softmax, so the router never selects them (an intervention).
    ///
    /// `attn_layers`, `mlp_layers`: capture these layers' attention and MLP block outputs
    /// (before the residual add), `[n, hidden]`; `probs_layers`: these MoE layers' router
    /// probabilities `[n, experts]`; `expert_layers`: these MoE layers' selected experts'
    /// outputs before mixing, `[n, k, hidden]` in the router's selection order.
    ///
    /// `force`: `(layer, ids)`, `ids` token-major `[n_total * top_k]`: each token's row replaces
    /// the router's top-k at that MoE layer (a row of -1s leaves that token's choice to the
    /// router); see [`tarfa_cpu::StepHook::forced_experts`] for the weights (an intervention).
    ///
    /// Interruptible: Ctrl-C stops the step before the next attention or MLP block (CPU) and
    /// raises `KeyboardInterrupt`.
    #[pyo3(signature = (batch, residual_layers=None, edits=None, router_layers=None, ablate=None,
                        attn_layers=None, mlp_layers=None, probs_layers=None, expert_layers=None,
                        force=None))]
    #[allow(clippy::too_many_arguments)]
    fn forward_batch<'py>(
        &self,
        py: Python<'py>,
        batch: Vec<Vec<u32>>,
        residual_layers: Option<Vec<usize>>,
        edits: Option<Vec<(usize, bool, Vec<f32>)>>,
        router_layers: Option<Vec<usize>>,
        ablate: Option<Vec<(usize, Vec<usize>)>>,
        attn_layers: Option<Vec<usize>>,
        mlp_layers: Option<Vec<usize>>,
        probs_layers: Option<Vec<usize>>,
        expert_layers: Option<Vec<usize>>,
        force: Option<Vec<(usize, Vec<i64>)>>,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let l = self.loaded()?;
        if let Some(i) = batch.iter().position(|t| t.is_empty()) {
            return Err(input_err(format!("tokens {i}: no tokens")));
        }
        let num_layers = l.num_layers;
        if let Some(&bad) = residual_layers.iter().flatten().find(|&&x| x > num_layers) {
            return Err(input_err(format!(
                "layers: {bad} is not a layer of this model (0 to {num_layers}, {num_layers}: \
                 after the last layer)"
            )));
        }
        for list in [&attn_layers, &mlp_layers, &probs_layers, &expert_layers] {
            if let Some(&bad) = list.iter().flatten().find(|&&x| x >= num_layers) {
                return Err(input_err(format!(
                    "layers: {bad} is not a layer of this model (0 to {})",
                    num_layers - 1
                )));
            }
        }
        let total: usize = batch.iter().map(Vec::len).sum();
        let hidden = l.hidden_size;
        for (layer, _, rows) in edits.iter().flatten() {
            if *layer > num_layers {
                return Err(input_err(format!(
                    "intervention: {layer} is not a layer of this model (0 to {num_layers})"
                )));
            }
            if rows.len() != total * hidden {
                return Err(input_err(format!(
                    "intervention at layer {layer}: {} values, expected {total} tokens x {hidden}",
                    rows.len()
                )));
            }
        }
        for (layer, experts) in ablate.iter().flatten() {
            if *layer >= num_layers {
                return Err(input_err(format!(
                    "ablate: {layer} is not a layer of this model (0 to {})",
                    num_layers - 1
                )));
            }
            if !l.moe_layers.contains(layer) {
                // a dense layer has no router: the ablation would silently do nothing
                return Err(input_err(format!(
                    "ablate: {layer} is not an MoE layer of this model (MoE layers: {:?})",
                    l.moe_layers
                )));
            }
            if let Some(bad) = experts.iter().find(|&&e| e >= l.num_experts) {
                return Err(input_err(format!(
                    "ablate[{layer}]: expert {bad} is not an expert of this model (0 to {})",
                    l.num_experts - 1
                )));
            }
            let mut distinct: Vec<usize> = experts.clone();
            distinct.sort_unstable();
            distinct.dedup();
            if l.num_experts - distinct.len() < l.top_k {
                return Err(input_err(format!(
                    "ablate[{layer}]: ablating {} experts leaves fewer than the {} the router selects",
                    distinct.len(),
                    l.top_k
                )));
            }
        }
        let k = l.top_k;
        let mut forced: Vec<(usize, Vec<Option<Vec<usize>>>)> = Vec::new();
        for (layer, ids) in force.iter().flatten() {
            if !l.moe_layers.contains(layer) {
                return Err(input_err(format!(
                    "force: {layer} is not an MoE layer of this model (MoE layers: {:?})",
                    l.moe_layers
                )));
            }
            if ablate.iter().flatten().any(|(a, _)| a == layer) {
                return Err(input_err(format!(
                    "force[{layer}] and ablate[{layer}]: forcing replaces the router's choice, \
                     ablating restricts it; give one of them per layer"
                )));
            }
            if ids.len() != total * k {
                return Err(input_err(format!(
                    "force[{layer}]: {} expert ids, expected {total} tokens x {k} (the router's top-k)",
                    ids.len()
                )));
            }
            let mut rows = Vec::with_capacity(total);
            for (t, row) in ids.chunks_exact(k).enumerate() {
                if row.iter().all(|&e| e == -1) {
                    rows.push(None);
                    continue;
                }
                if let Some(&bad) = row.iter().find(|&&e| e < 0 || e as usize >= l.num_experts) {
                    return Err(input_err(format!(
                        "force[{layer}], token {t}: expert {bad} is not an expert of this model \
                         (0 to {})",
                        l.num_experts - 1
                    )));
                }
                let row: Vec<usize> = row.iter().map(|&e| e as usize).collect();
                let mut distinct = row.clone();
                distinct.sort_unstable();
                distinct.dedup();
                if distinct.len() != k {
                    return Err(input_err(format!(
                        "force[{layer}], token {t}: the experts {row:?} repeat an expert (the \
                         router selects {k} distinct experts)"
                    )));
                }
                rows.push(Some(row));
            }
            forced.push((*layer, rows));
        }
        let observed = residual_layers.is_some()
            || router_layers.is_some()
            || edits.is_some()
            || ablate.is_some()
            || attn_layers.is_some()
            || mlp_layers.is_some()
            || probs_layers.is_some()
            || expert_layers.is_some()
            || force.is_some();
        // Without an observation the CPU step still takes the hook, which then only polls for
        // an interrupt between layers (it writes nothing: the same bits). CUDA takes the hook
        // for captures only (interventions are refused by name, InputError) and is interrupted
        // between calls only; without an observation it takes the plain step.
        let on_cpu = l.model.name() == "cpu";
        let stop_flag = AtomicBool::new(false);
        let mut hook = PyHook {
            stop: &stop_flag,
            forced: &forced,
            residual_layers: residual_layers.as_deref(),
            router_layers: router_layers.as_deref(),
            attn_layers: attn_layers.as_deref(),
            mlp_layers: mlp_layers.as_deref(),
            probs_layers: probs_layers.as_deref(),
            expert_layers: expert_layers.as_deref(),
            edits: edits.as_deref().unwrap_or_default(),
            ablate: ablate.as_deref().unwrap_or_default(),
            hidden,
            residual: Vec::new(),
            router: Vec::new(),
            attn: Vec::new(),
            mlp: Vec::new(),
            probs: Vec::new(),
            experts: std::collections::HashMap::new(),
        };
        let outs = interruptible(py, &stop_flag, || {
            let mut seqs: Vec<Sequence> = batch
                .iter()
                .map(|_| l.model.new_sequence())
                .collect::<Result<_, _>>()
                .map_err(|e| py_err(e.into()))?;
            let opts = ForwardOptions {
                logits: LogitRows::All,
                trace_router: true,
                ..ForwardOptions::default()
            };
            let mut steps: Vec<SeqStep<'_>> = seqs
                .iter_mut()
                .zip(&batch)
                .map(|(seq, tokens)| SeqStep { seq, tokens, opts })
                .collect();
            let result = if observed || on_cpu {
                l.model.step_observed(&mut steps, &mut hook)
            } else {
                l.model.step(&mut steps)
            };
            result.map_err(|e| {
                let prefix = e.index.map(|i| format!("tokens {i}: ")).unwrap_or_default();
                py_err_prefixed(&prefix, e.error.into())
            })
        })?;
        let mut first = 0;
        outs.iter()
            .zip(&batch)
            .map(|(o, t)| {
                let d = output_to_py(py, o, l.vocab_size, t.len())?;
                for (key, wanted, captured) in [
                    ("residual", residual_layers.is_some(), &hook.residual),
                    ("router_logits", router_layers.is_some(), &hook.router),
                    ("attn_out", attn_layers.is_some(), &hook.attn),
                    ("moe_out", mlp_layers.is_some(), &hook.mlp),
                    ("router_probs", probs_layers.is_some(), &hook.probs),
                ] {
                    if !wanted {
                        continue;
                    }
                    let res = PyDict::new(py);
                    for (layer, rows) in captured {
                        let mine = &rows[first..first + t.len()];
                        let width = mine.first().map_or(0, Vec::len);
                        let flat: Vec<f32> = mine.iter().flatten().copied().collect();
                        let arr = PyArray1::from_vec(py, flat).reshape([t.len(), width])?;
                        res.set_item(layer, arr)?;
                    }
                    d.set_item(key, res)?;
                }
                if let Some(wanted) = &expert_layers {
                    // [n, k, hidden] per MoE layer, in the router's selection order
                    let res = PyDict::new(py);
                    for block in o.router.chunk_by(|a, b| a.layer == b.layer) {
                        let layer = block[0].layer;
                        if !wanted.contains(&layer) {
                            continue;
                        }
                        let k = block[0].experts.len();
                        let mut flat = Vec::with_capacity(t.len() * k * hidden);
                        for (i, rec) in block.iter().enumerate() {
                            for &e in &rec.experts {
                                let y = hook.experts.get(&(layer, first + i, e as usize));
                                let y = y.ok_or_else(|| {
                                    EnvironmentError::new_err(format!(
                                        "internal error: no output of expert {e} at layer \
                                         {layer}, token {i}"
                                    ))
                                })?;
                                flat.extend_from_slice(y);
                            }
                        }
                        let arr = PyArray1::from_vec(py, flat).reshape([t.len(), k, hidden])?;
                        res.set_item(layer, arr)?;
                    }
                    d.set_item("expert_out", res)?;
                }
                first += t.len();
                Ok(d)
            })
            .collect()
    }

    /// Scores requests (one JSON object each, the `tarfa-run score` requests file's lines) and
    /// returns each result as the JSON line `tarfa-run score` writes for it. Interruptible:
    /// Ctrl-C stops it before the next engine step and raises `KeyboardInterrupt`.
    #[pyo3(signature = (requests, top_logprobs=0, echo=false, max_batch=1))]
    fn score(
        &self,
        py: Python<'_>,
        requests: Vec<String>,
        top_logprobs: usize,
        echo: bool,
        max_batch: usize,
    ) -> PyResult<Vec<String>> {
        let l = self.loaded()?;
        if requests.is_empty() {
            return Err(input_err("requests: no requests"));
        }
        // a template that cannot be used fails only the requests with "messages"
        let chat = tarfa_run::cli::generate::chat_template(&l.source, &l.bundle, "messages")
            .map_err(|e| e.to_string());
        let limits = Limits {
            vocab_size: l.vocab_size,
            max_positions: l.max_positions,
            eos: &l.eos,
            tokenizer: l.tokenizer.as_ref(),
            chat: match &chat {
                Ok(t) => Ok(t.as_ref()),
                Err(why) => Err(why.as_str()),
            },
        };
        let defaults = Options { top_logprobs, echo };
        let parsed = requests
            .iter()
            .enumerate()
            .map(|(i, text)| {
                tarfa_score::parse_line(i + 1, text, defaults, &limits)
                    .map_err(|e| input_err(format!("request {i}: {}", e.problem)))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let dec = Decoding {
            tokenizer: l.tokenizer.as_ref(),
            eos: &l.eos,
        };
        let opts = ScoreOptions {
            max_batch: max_batch.max(1),
            ..ScoreOptions::default()
        };
        let stop = AtomicBool::new(false);
        interruptible(py, &stop, || {
            let mut lines = Vec::with_capacity(parsed.len());
            let mut emit = |_i: usize, r: tarfa_score::ScoreResult| {
                lines.push(r.to_json_line());
                Ok(())
            };
            let res = tarfa_score::score_stoppable(
                &l.model,
                &parsed,
                &dec,
                &opts,
                &mut emit,
                &mut |_| {},
                &|| stop.load(Ordering::Relaxed),
            );
            match res {
                Ok(_) => Ok(lines),
                Err(ScoreError::Engine { line, source }) => Err(py_err_prefixed(
                    &format!("request {}: ", line - 1),
                    source.into(),
                )),
                Err(ScoreError::Step { source }) => Err(py_err(source.into())),
                // `interruptible` raises the signal's exception in place of this
                Err(ScoreError::Interrupted) => Err(EnvironmentError::new_err("interrupted")),
                Err(ScoreError::Output(e)) => Err(EnvironmentError::new_err(e.to_string())),
            }
        })
    }
}

/// What one `forward_batch` asks the engine to show it or change ([`tarfa_cpu::StepHook`]).
struct PyHook<'a> {
    /// Set by [`interruptible`] when a signal handler raised: the step stops at the next layer.
    stop: &'a AtomicBool,
    /// (MoE layer, per token of the step: the forced experts or the router's own choice)
    forced: &'a [(usize, Vec<Option<Vec<usize>>>)],
    residual_layers: Option<&'a [usize]>,
    router_layers: Option<&'a [usize]>,
    attn_layers: Option<&'a [usize]>,
    mlp_layers: Option<&'a [usize]>,
    probs_layers: Option<&'a [usize]>,
    expert_layers: Option<&'a [usize]>,
    /// (layer, replace, rows `[n_total * hidden]`)
    edits: &'a [(usize, bool, Vec<f32>)],
    /// (layer, experts whose router logits become -inf)
    ablate: &'a [(usize, Vec<usize>)],
    hidden: usize,
    /// (layer, every token's row of the step, in batch order)
    residual: Vec<(usize, Vec<Vec<f32>>)>,
    router: Vec<(usize, Vec<Vec<f32>>)>,
    attn: Vec<(usize, Vec<Vec<f32>>)>,
    mlp: Vec<(usize, Vec<Vec<f32>>)>,
    probs: Vec<(usize, Vec<Vec<f32>>)>,
    /// (layer, the step's token, expert) -> the expert's output before its weight
    experts: std::collections::HashMap<(usize, usize, usize), Vec<f32>>,
}

fn wants(layers: Option<&[usize]>, layer: usize) -> bool {
    layers.is_some_and(|w| w.contains(&layer))
}

impl tarfa_cpu::StepHook for PyHook<'_> {
    fn residual(&mut self, layer: usize, h: &mut [Vec<f32>]) {
        // in the order given: the Python side puts additions before replacements
        for (at, replace, rows) in self.edits {
            if *at != layer {
                continue;
            }
            for (row, new) in h.iter_mut().zip(rows.chunks_exact(self.hidden)) {
                if *replace {
                    row.copy_from_slice(new);
                } else {
                    row.iter_mut().zip(new).for_each(|(x, d)| *x += d);
                }
            }
        }
        if self.residual_layers.is_some_and(|w| w.contains(&layer)) {
            self.residual.push((layer, h.to_vec()));
        }
    }

    fn router_logits(&mut self, layer: usize, logits: &mut [Vec<f32>]) {
        for (at, experts) in self.ablate {
            if *at == layer {
                for row in logits.iter_mut() {
                    for &e in experts {
                        row[e] = f32::NEG_INFINITY;
                    }
                }
            }
        }
        if self.router_layers.is_some_and(|w| w.contains(&layer)) {
            self.router.push((layer, logits.to_vec()));
        }
    }

    fn attn_out(&mut self, layer: usize, y: &mut [Vec<f32>]) {
        if wants(self.attn_layers, layer) {
            self.attn.push((layer, y.to_vec()));
        }
    }

    fn mlp_out(&mut self, layer: usize, y: &mut [Vec<f32>]) {
        if wants(self.mlp_layers, layer) {
            self.mlp.push((layer, y.to_vec()));
        }
    }

    fn router_probs(&mut self, layer: usize, probs: &[Vec<f32>]) {
        if wants(self.probs_layers, layer) {
            self.probs.push((layer, probs.to_vec()));
        }
    }

    fn expert_out(&mut self, layer: usize, token: usize, expert: usize, y: &[f32]) {
        if wants(self.expert_layers, layer) {
            self.experts.insert((layer, token, expert), y.to_vec());
        }
    }

    fn forced_experts(&mut self, layer: usize, token: usize) -> Option<Vec<usize>> {
        let (_, rows) = self.forced.iter().find(|(at, _)| *at == layer)?;
        rows.get(token).cloned().flatten()
    }

    fn interrupted(&mut self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    fn wants(&self, what: tarfa_cpu::Capture, layer: usize) -> bool {
        use tarfa_cpu::Capture::*;
        let layers = match what {
            Residual => self.residual_layers,
            AttnOut => self.attn_layers,
            MlpOut => self.mlp_layers,
            RouterLogits => self.router_layers,
            RouterProbs => self.probs_layers,
            ExpertOut => self.expert_layers,
        };
        wants(layers, layer)
    }

    /// The first intervention asked for, by the Python label's name; None when the call only
    /// captures (the CUDA backend runs those).
    fn intervention(&self) -> Option<String> {
        if let Some((layer, replace, _)) = self.edits.first() {
            let name = if *replace {
                "residual_replace"
            } else {
                "residual_add"
            };
            return Some(format!("{name}(layer={layer})"));
        }
        if let Some((layer, _)) = self.ablate.first() {
            return Some(format!("ablate(layer={layer})"));
        }
        if let Some((layer, _)) = self.forced.first() {
            return Some(format!("force(layer={layer})"));
        }
        None
    }
}

fn tokenizer(l: &Loaded) -> PyResult<&tokenizers::Tokenizer> {
    l.tokenizer.as_ref().ok_or_else(|| {
        input_err(format!(
            "{}: the bundle has no tokenizer.json",
            l.bundle.display()
        ))
    })
}

#[pymodule]
fn _tarfa(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<NativeModel>()?;
    m.add("TarfaError", py.get_type::<TarfaError>())?;
    m.add("VerificationError", py.get_type::<VerificationError>())?;
    m.add("InputError", py.get_type::<InputError>())?;
    m.add("EnvironmentError", py.get_type::<EnvironmentError>())?;
    Ok(())
}
