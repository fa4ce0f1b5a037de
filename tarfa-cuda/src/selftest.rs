//! CPU and CUDA on the same model and prompts, compared byte for byte: prefill with the logits of
//! every position, then greedy decode steps (the CPU's choice feeds both), router records of
//! every MoE layer and position, and each step's statistics.

use std::sync::Arc;
use std::time::Instant;

use super::model::CudaModel;
use super::{
    CudaError, CudaOptions, HotOptions, HotStats, SelftestOptions, SelftestReport, StreamCase,
};
use tarfa_core::config::MoeConfig;
use tarfa_core::generate::argmax;
use tarfa_core::numerics::Kernel;
use tarfa_core::weights::WeightError;
use tarfa_core::weights::WeightSource;
use tarfa_cpu::{
    CpuEngine, CpuModel, EngineOptions, ForwardOptions, ForwardOutput, LogitRows, RouterRecord,
};
use tarfa_stream::{StreamOptions, StreamSource, StreamStats};

fn bits_str(v: f32) -> String {
    format!("{v:e} (0x{:08x})", v.to_bits())
}

fn router_eq(a: &RouterRecord, b: &RouterRecord) -> bool {
    let f = |x: &[f32], y: &[f32]| {
        x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
    };
    a.layer == b.layer
        && a.moe_layer == b.moe_layer
        && a.position == b.position
        && a.experts == b.experts
        && f(&a.probs, &b.probs)
        && f(&a.weights, &b.weights)
        && a.kth_prob.to_bits() == b.kth_prob.to_bits()
        && a.next_prob.map(f32::to_bits) == b.next_prob.map(f32::to_bits)
}

/// Compares one step's outputs into `rep`.
pub(crate) fn compare_step(
    rep: &mut SelftestReport,
    what: &str,
    cpu: &ForwardOutput,
    gpu: &ForwardOutput,
) {
    rep.steps += 1;
    if cpu.logits.len() != gpu.logits.len() {
        rep.logit_mismatches += 1;
        rep.first_mismatch.get_or_insert_with(|| {
            format!(
                "{what}: {} logit rows on the CPU, {} on the GPU",
                cpu.logits.len(),
                gpu.logits.len()
            )
        });
    }
    for (r, (c, g)) in cpu.logits.iter().zip(&gpu.logits).enumerate() {
        rep.logit_rows += 1;
        rep.logit_bytes += 4 * c.len() as u64;
        if c.len() != g.len() {
            rep.logit_mismatches += c.len() as u64;
            rep.first_mismatch
                .get_or_insert_with(|| format!("{what}: row {r} lengths differ"));
            continue;
        }
        for (i, (x, y)) in c.iter().zip(g).enumerate() {
            if x.to_bits() != y.to_bits() {
                rep.logit_mismatches += 1;
                rep.first_mismatch.get_or_insert_with(|| {
                    format!(
                        "{what}: logit row {r} index {i}: CPU {} GPU {}",
                        bits_str(*x),
                        bits_str(*y)
                    )
                });
            }
        }
    }
    if cpu.router.len() != gpu.router.len() {
        rep.router_mismatches += 1;
        rep.first_mismatch.get_or_insert_with(|| {
            format!(
                "{what}: {} router records on the CPU, {} on the GPU",
                cpu.router.len(),
                gpu.router.len()
            )
        });
    }
    for (c, g) in cpu.router.iter().zip(&gpu.router) {
        rep.router_records += 1;
        rep.router_bytes += 4 * (3 * c.experts.len() as u64 + 2);
        if !router_eq(c, g) {
            rep.router_mismatches += 1;
            rep.first_mismatch.get_or_insert_with(|| {
                format!(
                    "{what}: router record layer {} position {}: CPU {c:?} GPU {g:?}",
                    c.layer, c.position
                )
            });
        }
    }
    if cpu.stats != gpu.stats {
        rep.stats_mismatches += 1;
        rep.first_mismatch.get_or_insert_with(|| {
            format!("{what}: statistics CPU {:?} GPU {:?}", cpu.stats, gpu.stats)
        });
    }
}

/// Runs the CPU backend and the CUDA backend on `cfg` and `source` with the same prompts and
/// compares every logit, router record and statistic bit for bit (see [`SelftestOptions`]).
/// The report says how many bytes were compared and the first difference.
pub fn selftest(
    cfg: &MoeConfig,
    source: Arc<dyn WeightSource>,
    opts: &SelftestOptions,
    cuda: &CudaOptions,
) -> Result<SelftestReport, CudaError> {
    let cpu_model = Arc::new(CpuModel::load(cfg.clone(), source.clone())?);
    let engine = CpuEngine::new(
        cpu_model.clone(),
        EngineOptions {
            threads: opts.cpu_threads,
            kernel: Kernel::best(),
        },
    )?;
    let gpu = CudaModel::load(cfg.clone(), source, cuda)?;
    selftest_models(&engine, &gpu, opts)
}

/// [`selftest`] on models already loaded (the same config and weights on both).
pub fn selftest_models(
    engine: &CpuEngine,
    gpu: &CudaModel,
    opts: &SelftestOptions,
) -> Result<SelftestReport, CudaError> {
    let reference = reference_run(engine, opts)?;
    compare_with(gpu, &reference, opts)
}

/// The CPU's outputs for [`SelftestOptions`]' prompts: per prompt, the prefill (every position)
/// then each greedy decode step; computed once, compared with any number of GPU models
/// ([`compare_with`]).
pub struct ReferenceRun {
    prompts: Vec<Vec<ForwardOutput>>,
    tokens: Vec<Vec<u32>>,
    cpu_seconds: f64,
}

fn selftest_forward_options() -> (ForwardOptions, ForwardOptions) {
    let all = ForwardOptions {
        logits: LogitRows::All,
        trace_router: true,
        ..Default::default()
    };
    let last = ForwardOptions {
        logits: LogitRows::Last,
        ..all
    };
    (all, last)
}

/// Runs the CPU reference on `opts`' prompts.
pub fn reference_run(
    engine: &CpuEngine,
    opts: &SelftestOptions,
) -> Result<ReferenceRun, CudaError> {
    let cpu_model = engine.model();
    let (all, last) = selftest_forward_options();
    let mut run = ReferenceRun {
        prompts: Vec::new(),
        tokens: Vec::new(),
        cpu_seconds: 0.0,
    };
    let t = Instant::now();
    for prompt in &opts.prompts {
        let mut cc = cpu_model.new_cache();
        let c = engine.forward(&mut cc, prompt, &all)?;
        let mut logits = c.logits.last().cloned().unwrap_or_default();
        let mut steps = vec![c];
        let mut tokens = Vec::new();
        for _ in 0..opts.decode_steps {
            let next = argmax(&logits);
            tokens.push(next);
            let c = engine.forward(&mut cc, &[next], &last)?;
            logits = c.logits.first().cloned().unwrap_or_default();
            steps.push(c);
        }
        run.prompts.push(steps);
        run.tokens.push(tokens);
    }
    run.cpu_seconds = t.elapsed().as_secs_f64();
    Ok(run)
}

/// Runs `gpu` on the prompts of `reference` (the CPU's greedy choices feed it) and compares
/// every step with the CPU's, bit for bit.
pub fn compare_with(
    gpu: &CudaModel,
    reference: &ReferenceRun,
    opts: &SelftestOptions,
) -> Result<SelftestReport, CudaError> {
    let (all, last) = selftest_forward_options();
    let mut rep = SelftestReport {
        device: Some(gpu.device().to_string()),
        cpu_seconds: reference.cpu_seconds,
        ..Default::default()
    };
    for (pi, (prompt, (steps, tokens))) in opts
        .prompts
        .iter()
        .zip(reference.prompts.iter().zip(&reference.tokens))
        .enumerate()
    {
        rep.prompts += 1;
        let mut gc = gpu.new_cache()?;
        let t = Instant::now();
        let g = gpu.forward(&mut gc, prompt, &all)?;
        rep.gpu_seconds += t.elapsed().as_secs_f64();
        compare_step(
            &mut rep,
            &format!("prompt {pi} prefill ({} tokens)", prompt.len()),
            &steps[0],
            &g,
        );
        for (step, (&next, c)) in tokens.iter().zip(&steps[1..]).enumerate() {
            let t = Instant::now();
            let g = gpu.forward(&mut gc, &[next], &last)?;
            rep.gpu_seconds += t.elapsed().as_secs_f64();
            compare_step(
                &mut rep,
                &format!(
                    "prompt {pi} decode step {step} (position {})",
                    prompt.len() + step
                ),
                c,
                &g,
            );
        }
        rep.tokens.push(tokens.clone());
    }
    Ok(rep)
}

/// The streamed selftest: the CPU reference on `bundle` (every expert resident), then, for each
/// case, a CUDA model whose experts stream through a hot tier and a RAM tier of the case's
/// budgets, I/O mode and policy, compared with it bit for bit. Returns each case's report and
/// the tiers' counters.
pub fn selftest_streaming(
    cfg: &MoeConfig,
    bundle: Arc<tarfa_stream::bundle::BundleSource>,
    opts: &SelftestOptions,
    cuda: &CudaOptions,
    cases: &[StreamCase],
) -> Result<Vec<(SelftestReport, HotStats, StreamStats)>, CudaError> {
    let cpu_model = Arc::new(CpuModel::load(cfg.clone(), bundle.clone())?);
    let engine = CpuEngine::new(
        cpu_model,
        EngineOptions {
            threads: opts.cpu_threads,
            kernel: Kernel::best(),
        },
    )?;
    let reference = reference_run(&engine, opts)?;
    let mut out = Vec::new();
    for case in cases {
        let so = StreamOptions {
            ram_budget: case.ram_budget,
            io: case.io,
            policy: case.policy,
            io_threads: tarfa_stream::DEFAULT_IO_THREADS,
            // the CUDA forward does not read ahead
            lookahead: tarfa_stream::Lookahead::Off,
        };
        let source =
            Arc::new(StreamSource::new(bundle.clone(), &so, None).map_err(WeightError::from)?);
        let copts = CudaOptions {
            hot: Some(HotOptions {
                budget: case.vram_budget,
                policy: case.policy,
                pins: Vec::new(),
            }),
            ..cuda.clone()
        };
        let gpu = CudaModel::load(cfg.clone(), source.clone(), &copts)?;
        let rep = compare_with(&gpu, &reference, opts)?;
        out.push((rep, gpu.hot_stats().unwrap_or_default(), source.stats()));
    }
    Ok(out)
}

/// After a failed [`selftest`]: the first layer whose inclusion makes the backends differ.
/// Runs models truncated to 1, 2, ... layers on `prompt` (prefill, every position) and returns
/// the index of the first layer after which the logits or router records differ; `None` when
/// even the whole model agrees on this prompt.
pub fn locate_divergence(
    cfg: &MoeConfig,
    source: Arc<dyn WeightSource>,
    prompt: &[u32],
    cuda: &CudaOptions,
) -> Result<Option<usize>, CudaError> {
    for n in 1..=cfg.num_layers {
        let mut c = cfg.clone();
        c.num_layers = n;
        let rep = selftest(
            &c,
            source.clone(),
            &SelftestOptions {
                prompts: vec![prompt.to_vec()],
                decode_steps: 0,
                cpu_threads: 0,
            },
            cuda,
        )?;
        if !rep.passed() {
            return Ok(Some(n - 1));
        }
    }
    Ok(None)
}
