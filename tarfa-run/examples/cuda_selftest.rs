//! The CUDA backend's device-side checks and figures, until the CLI carries them
//! (`tarfa-run selftest --backend cuda`). Run by validation/gpu/run.sh on the GPU machine.
//!
//! ```text
//! cuda_selftest info
//! cuda_selftest kernels                          each kernel vs the CPU reference functions
//! cuda_selftest fixture DIR [--decode N]         CPU vs CUDA on a checkpoint dir or bundle,
//!                                                prompts from reference.safetensors (or made up)
//! cuda_selftest synth FAMILY [--big]             CPU vs CUDA on a random in-memory model
//! cuda_selftest generate DIR [--decode N]        GPU-only greedy runs (for compute-sanitizer);
//!                                                tokens checked against transformers' greedy
//! cuda_selftest captures DIR                     CPU vs CUDA captures (residual, attn_out,
//!                                                mlp_out, router logits/probs, expert_out), one
//!                                                sequence and three in a step, bit for bit
//! cuda_selftest bench DIR [--prefill N] [--decode N] [--selftest-prompts N]
//!                                                decode and prefill tok/s, then CPU vs CUDA
//! ```
//! `--many-kernels auto|tiled|lanes|few` (any command): the kernels steps of many tokens take
//! (default auto; `lanes` runs the lane-sequential kernels of kernels/prefill.cu on every
//! prompt, however short).
//! Lines starting `TABLE|` are collected into run.sh's summary.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use safetensors::SafeTensors;
use tarfa_run::config::MoeConfig;
use tarfa_run::cpu::{CpuEngine, CpuModel, EngineOptions, ForwardOptions, LogitRows};
use tarfa_run::cuda::synthetic::{random_model, SyntheticShape};
use tarfa_run::cuda::{
    greedy, kernel_checks, locate_divergence, probe, selftest, selftest_models, CudaModel,
    CudaOptions, SelftestOptions,
};
use tarfa_run::generate::argmax;
use tarfa_run::model::ArchSpec;
use tarfa_run::numerics::Kernel;
use tarfa_run::weights::{load_safetensors_dir, WeightSource};

fn table(name: &str, result: &str, detail: &str) {
    println!("TABLE|{name}|{result}|{detail}");
}

fn fail(msg: String) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(1)
}

struct Input {
    name: String,
    cfg: MoeConfig,
    source: Arc<dyn WeightSource>,
    /// (prompt, transformers' greedy tokens)
    references: Vec<(Vec<u32>, Vec<u32>)>,
}

fn load_input(dir: &Path) -> Input {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.display().to_string());
    let t = Instant::now();
    let (cfg, source): (MoeConfig, Arc<dyn WeightSource>) = if dir.join("model.jnf").is_file() {
        let b = tarfa_run::bundle::BundleSource::open(dir, None)
            .unwrap_or_else(|e| fail(format!("{}: {e}", dir.display())));
        let text = b
            .read_file("config.json")
            .unwrap_or_else(|e| fail(format!("{}: {e}", dir.display())));
        let cfg = MoeConfig::from_json_str(&String::from_utf8_lossy(&text))
            .unwrap_or_else(|e| fail(format!("{}: {e}", dir.display())));
        b.load_all_experts()
            .unwrap_or_else(|e| fail(format!("{}: {e}", dir.display())));
        (cfg, Arc::new(b))
    } else {
        let text = std::fs::read_to_string(dir.join("config.json"))
            .unwrap_or_else(|e| fail(format!("{}/config.json: {e}", dir.display())));
        let cfg = MoeConfig::from_json_str(&text)
            .unwrap_or_else(|e| fail(format!("{}: {e}", dir.display())));
        let spec = ArchSpec::new(&cfg);
        let src = load_safetensors_dir(dir, &cfg, &spec)
            .unwrap_or_else(|e| fail(format!("{}: {e}", dir.display())));
        (cfg, Arc::new(src))
    };
    eprintln!(
        "{name}: weights loaded and verified on the host in {:.1}s",
        t.elapsed().as_secs_f64()
    );
    let mut references = Vec::new();
    if let Ok(bytes) = std::fs::read(dir.join("reference.safetensors")) {
        let st = SafeTensors::deserialize(&bytes)
            .unwrap_or_else(|e| fail(format!("reference.safetensors: {e}")));
        let ints = |n: &str| -> Option<Vec<u32>> {
            let v = st.tensor(n).ok()?;
            Some(
                v.data()
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")) as u32)
                    .collect(),
            )
        };
        for i in 0.. {
            let (Some(p), Some(g)) = (ints(&format!("prompt.{i}")), ints(&format!("greedy.{i}")))
            else {
                break;
            };
            references.push((p, g));
        }
    }
    Input {
        name,
        cfg,
        source,
        references,
    }
}

/// Deterministic made-up prompts.
fn made_up_prompts(vocab: usize, lens: &[usize]) -> Vec<Vec<u32>> {
    lens.iter()
        .enumerate()
        .map(|(k, &n)| {
            (0..n)
                .map(|i| ((i * 7919 + 13 + 101 * k) % vocab) as u32)
                .collect()
        })
        .collect()
}

fn arg_usize(args: &[String], flag: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| fail(format!("bad value for {flag}")))
        })
        .unwrap_or(default)
}

/// `--many-kernels`, read once by main.
static MANY: std::sync::OnceLock<tarfa_run::cuda::ManyKernels> = std::sync::OnceLock::new();

fn cuda_opts() -> CudaOptions {
    let mut o = CudaOptions::default();
    o.tuning.many = MANY.get().copied().unwrap_or_default();
    o
}

fn run_selftest(
    name: &str,
    cfg: &MoeConfig,
    source: Arc<dyn WeightSource>,
    opts: &SelftestOptions,
) -> bool {
    let t = Instant::now();
    match selftest(cfg, source.clone(), opts, &cuda_opts()) {
        Ok(rep) => {
            println!("{name}: {rep}");
            println!(
                "{name}: CPU {:.2}s, GPU {:.2}s of forward steps; wall {:.1}s",
                rep.cpu_seconds,
                rep.gpu_seconds,
                t.elapsed().as_secs_f64()
            );
            table(
                &format!("selftest {name}"),
                if rep.passed() { "PASS" } else { "FAIL" },
                &format!(
                    "{} B compared ({} logit rows, {} router records, {} steps)",
                    rep.bytes_compared(),
                    rep.logit_rows,
                    rep.router_records,
                    rep.steps
                ),
            );
            if !rep.passed() {
                if let Some(p) = opts.prompts.first() {
                    match locate_divergence(cfg, source, p, &cuda_opts()) {
                        Ok(Some(l)) => {
                            println!("{name}: the backends first differ after layer {l}")
                        }
                        Ok(None) => println!("{name}: no divergence on the first prompt's prefill"),
                        Err(e) => println!("{name}: locating the divergence failed: {e}"),
                    }
                }
            }
            rep.passed()
        }
        Err(e) => {
            println!("{name}: selftest error: {e}");
            table(&format!("selftest {name}"), "ERROR", &e.to_string());
            false
        }
    }
}

fn cmd_kernels() -> bool {
    match kernel_checks(&cuda_opts()) {
        Ok(checks) => {
            let mut ok = true;
            for c in &checks {
                println!("{c}");
                ok &= c.mismatches == 0;
            }
            let total: u64 = checks.iter().map(|c| c.compared).sum();
            let bad: u64 = checks.iter().map(|c| c.mismatches).sum();
            table(
                "kernel checks",
                if ok { "PASS" } else { "FAIL" },
                &format!("{} checks, {total} values, {bad} differ", checks.len()),
            );
            ok
        }
        Err(e) => {
            println!("kernel checks: error: {e}");
            table("kernel checks", "ERROR", &e.to_string());
            false
        }
    }
}

fn cmd_fixture(dir: &Path, args: &[String]) -> bool {
    let input = load_input(dir);
    let decode = arg_usize(args, "--decode", 8);
    let prompts: Vec<Vec<u32>> = if input.references.is_empty() {
        made_up_prompts(input.cfg.vocab_size, &[1, 7, 33])
    } else {
        input.references.iter().map(|(p, _)| p.clone()).collect()
    };
    let opts = SelftestOptions {
        prompts,
        decode_steps: decode,
        cpu_threads: 0,
    };
    run_selftest(&input.name, &input.cfg, input.source, &opts)
}

fn cmd_synth(family: &str, args: &[String]) -> bool {
    let big = args.iter().any(|a| a == "--big");
    let mut shape = SyntheticShape::small(family);
    if big {
        // Qwen3-30B-A3B's layer shapes, 4 layers, a reduced vocabulary
        shape = SyntheticShape {
            layers: 4,
            hidden: 2048,
            heads: 32,
            kv_heads: 4,
            head_dim: 128,
            experts: 128,
            top_k: 8,
            expert_width: 768,
            dense_width: 6144,
            vocab: 32768,
            decoder_sparse_step: 1,
            mlp_only_layers: vec![],
            ..shape
        };
    }
    let t = Instant::now();
    let (cfg, src) = random_model(&shape, 0x7A5F + family.len() as u64);
    eprintln!(
        "synthetic {family}{}: built in {:.1}s",
        if big { " (big)" } else { "" },
        t.elapsed().as_secs_f64()
    );
    let prompts = made_up_prompts(cfg.vocab_size, if big { &[5, 300] } else { &[1, 9, 290] });
    let opts = SelftestOptions {
        prompts,
        decode_steps: arg_usize(args, "--decode", 6),
        cpu_threads: 0,
    };
    let name = format!("synthetic-{family}{}", if big { "-big" } else { "" });
    run_selftest(&name, &cfg, Arc::new(src), &opts)
}

fn cmd_generate(dir: &Path, args: &[String]) -> bool {
    let input = load_input(dir);
    let decode = arg_usize(args, "--decode", 24);
    let model = match CudaModel::load(input.cfg.clone(), input.source.clone(), &cuda_opts()) {
        Ok(m) => m,
        Err(e) => {
            println!("{}: {e}", input.name);
            return false;
        }
    };
    let refs: Vec<(Vec<u32>, Vec<u32>)> = if input.references.is_empty() {
        made_up_prompts(input.cfg.vocab_size, &[1, 7, 33])
            .into_iter()
            .map(|p| (p, Vec::new()))
            .collect()
    } else {
        input.references.clone()
    };
    let mut same = 0;
    for (i, (prompt, want)) in refs.iter().enumerate() {
        let mut cache = match model.new_cache() {
            Ok(c) => c,
            Err(e) => {
                println!("{}: {e}", input.name);
                return false;
            }
        };
        let opts = ForwardOptions {
            logits: LogitRows::All,
            trace_router: true,
            ..Default::default()
        };
        let n = if want.is_empty() { decode } else { want.len() };
        match greedy(&model, &mut cache, prompt, n, &opts) {
            Ok(g) => {
                let eq = want.is_empty() || &g.tokens == want;
                same += usize::from(eq && !want.is_empty());
                let mode = match cache.decode_running() {
                    Some((m, note)) if note.is_empty() => m.name().to_string(),
                    Some((m, note)) => format!("{} ({note})", m.name()),
                    None => "legacy".to_string(),
                };
                println!(
                    "{} prompt {i}: {} tokens generated (decode steps: {mode}){}",
                    input.name,
                    g.tokens.len(),
                    if want.is_empty() {
                        String::new()
                    } else if eq {
                        ", equal to transformers' greedy tokens".into()
                    } else {
                        format!(", DIFFERENT from transformers' {want:?}: {:?}", g.tokens)
                    }
                );
            }
            Err(e) => {
                println!("{} prompt {i}: {e}", input.name);
                return false;
            }
        }
    }
    println!(
        "{}: {same} of {} prompts' greedy tokens equal transformers'",
        input.name,
        refs.len()
    );
    true
}

fn cmd_bench(dir: &Path, args: &[String]) -> bool {
    let input = load_input(dir);
    let prefill = arg_usize(args, "--prefill", 128);
    let decode = arg_usize(args, "--decode", 64);
    let n_self = arg_usize(args, "--selftest-prompts", 2);
    let t = Instant::now();
    let model = match CudaModel::load(input.cfg.clone(), input.source.clone(), &cuda_opts()) {
        Ok(m) => m,
        Err(e) => {
            println!("{}: {e}", input.name);
            table(&format!("figures {}", input.name), "ERROR", &e.to_string());
            return false;
        }
    };
    println!(
        "{}: {} resident on {} (uploaded in {:.1}s)",
        input.name,
        tarfa_run_gib(model.resident_bytes()),
        model.device().name,
        t.elapsed().as_secs_f64()
    );
    let vocab = input.cfg.vocab_size;
    let prompt: Vec<u32> = (0..prefill)
        .map(|i| ((i * 7919 + 17) % vocab) as u32)
        .collect();
    let last = ForwardOptions::default();
    let run = || -> Result<(f64, f64, u64), tarfa_run::cuda::CudaError> {
        let mut cache = model.new_cache()?;
        let t = Instant::now();
        let out = model.forward(&mut cache, &prompt, &last)?;
        let prefill_s = t.elapsed().as_secs_f64();
        let mut next = argmax(&out.logits[0]);
        let mut bytes = 0u64;
        let t = Instant::now();
        for _ in 0..decode {
            let out = model.forward(&mut cache, &[next], &last)?;
            bytes += out.stats.weight_bytes;
            next = argmax(&out.logits[0]);
        }
        Ok((prefill_s, t.elapsed().as_secs_f64(), bytes))
    };
    // warm-up (module load, first-touch), then three timed repeats: medians
    if let Err(e) = run() {
        println!("{}: {e}", input.name);
        table(&format!("figures {}", input.name), "ERROR", &e.to_string());
        return false;
    }
    let mut p = Vec::new();
    let mut d = Vec::new();
    let mut bytes = 0;
    for _ in 0..3 {
        match run() {
            Ok((ps, ds, b)) => {
                p.push(ps);
                d.push(ds);
                bytes = b;
            }
            Err(e) => {
                println!("{}: {e}", input.name);
                return false;
            }
        }
    }
    p.sort_by(f64::total_cmp);
    d.sort_by(f64::total_cmp);
    let (ps, ds) = (p[1], d[1]);
    let detail = format!(
        "decode {:.1} tok/s ({:.2} ms/token, {:.0} GB/s of weights), prefill {:.0} tok/s ({prefill} tokens in {:.1} ms)",
        decode as f64 / ds,
        1e3 * ds / decode as f64,
        bytes as f64 / ds / 1e9,
        prefill as f64 / ps,
        1e3 * ps
    );
    println!("{}: {detail}", input.name);
    table(&format!("figures {}", input.name), "-", &detail);
    if n_self == 0 {
        return true;
    }
    // CPU vs CUDA on this model with the same loaded GPU weights
    let cpu_model = match CpuModel::load(input.cfg.clone(), input.source.clone()) {
        Ok(m) => Arc::new(m),
        Err(e) => {
            println!("{}: CPU model: {e}", input.name);
            return false;
        }
    };
    let engine = CpuEngine::new(
        cpu_model,
        EngineOptions {
            threads: 0,
            kernel: Kernel::best(),
        },
    )
    .unwrap_or_else(|e| fail(e.to_string()));
    let lens: Vec<usize> = [7usize, 40, 3, 100].into_iter().take(n_self).collect();
    let opts = SelftestOptions {
        prompts: made_up_prompts(vocab, &lens),
        decode_steps: arg_usize(args, "--selftest-decode", 4),
        cpu_threads: 0,
    };
    match selftest_models(&engine, &model, &opts) {
        Ok(rep) => {
            println!("{}: {rep}", input.name);
            table(
                &format!("selftest {}", input.name),
                if rep.passed() { "PASS" } else { "FAIL" },
                &format!(
                    "{} B compared ({} logit rows, {} router records, {} steps)",
                    rep.bytes_compared(),
                    rep.logit_rows,
                    rep.router_records,
                    rep.steps
                ),
            );
            rep.passed()
        }
        Err(e) => {
            println!("{}: selftest error: {e}", input.name);
            table(&format!("selftest {}", input.name), "ERROR", &e.to_string());
            false
        }
    }
}

/// Every value a step shows a hook, as bits, in the order shown (an observe-only hook).
#[derive(Default)]
struct Recorder {
    /// Some(layers): only those layers are wanted
    layers: Option<Vec<usize>>,
    seen: Vec<(String, usize, Vec<u32>)>,
}

impl Recorder {
    fn note(&mut self, what: &str, l: usize, rows: &[Vec<f32>]) {
        if self.layers.as_ref().is_none_or(|w| w.contains(&l)) {
            let bits = rows.iter().flatten().map(|x| x.to_bits()).collect();
            self.seen.push((what.into(), l, bits));
        }
    }
}

impl tarfa_run::cpu::StepHook for Recorder {
    fn residual(&mut self, l: usize, h: &mut [Vec<f32>]) {
        self.note("residual", l, h);
    }
    fn router_logits(&mut self, l: usize, x: &mut [Vec<f32>]) {
        self.note("router_logits", l, x);
    }
    fn attn_out(&mut self, l: usize, y: &mut [Vec<f32>]) {
        self.note("attn_out", l, y);
    }
    fn mlp_out(&mut self, l: usize, y: &mut [Vec<f32>]) {
        self.note("mlp_out", l, y);
    }
    fn router_probs(&mut self, l: usize, p: &[Vec<f32>]) {
        self.note("router_probs", l, p);
    }
    fn expert_out(&mut self, l: usize, t: usize, e: usize, y: &[f32]) {
        self.note(&format!("expert_out t{t} e{e}"), l, &[y.to_vec()]);
    }
    fn wants(&self, _what: tarfa_run::cpu::Capture, l: usize) -> bool {
        self.layers.as_ref().is_none_or(|w| w.contains(&l))
    }
    fn intervention(&self) -> Option<String> {
        None
    }
}

/// The CUDA backend's captures (`CudaModel::forward_seqs_observed`, the Python package's
/// `backend="cuda"`) against the CPU's, every value bit for bit and in the same order: one
/// sequence of several tokens, one of a single token (the per-operation kernels), three in one
/// step, with every layer and with a selection. Also the workload compute-sanitizer runs on
/// the capture-only launches.
fn cmd_captures(dir: &Path) -> bool {
    use tarfa_run::batch::BatchEntry;
    let input = load_input(dir);
    let cfg = &input.cfg;
    let v = cfg.vocab_size;
    let cpu = match CpuModel::load(cfg.clone(), input.source.clone()) {
        Ok(m) => Arc::new(m),
        Err(e) => fail(format!("{}: CPU model: {e}", input.name)),
    };
    let engine = CpuEngine::new(
        cpu.clone(),
        EngineOptions {
            threads: 0,
            kernel: Kernel::best(),
        },
    )
    .unwrap_or_else(|e| fail(e.to_string()));
    let gpu = match CudaModel::load(cfg.clone(), input.source.clone(), &cuda_opts()) {
        Ok(m) => m,
        Err(e) => fail(format!("{}: CUDA model: {e}", input.name)),
    };
    let opts = ForwardOptions {
        logits: LogitRows::All,
        trace_router: true,
        ..ForwardOptions::default()
    };
    let toks = |seed: usize, n: usize| -> Vec<u32> {
        (0..n)
            .map(|i| ((seed * 97 + i * 41 + 3) % v) as u32)
            .collect()
    };
    let steps: Vec<Vec<Vec<u32>>> = vec![
        vec![toks(1, 6)],
        vec![toks(2, 1)],
        vec![toks(3, 5), toks(4, 1), toks(5, 3)],
    ];
    let (mut values, mut bytes, mut bad) = (0usize, 0usize, Vec::new());
    for sel in [None, Some(vec![1, cfg.num_layers])] {
        for step in &steps {
            let what = format!("layers {sel:?}, {} sequences", step.len());
            let mut cc: Vec<_> = step.iter().map(|_| cpu.new_cache()).collect();
            let mut entries: Vec<_> = cc
                .iter_mut()
                .zip(step)
                .map(|(c, t)| BatchEntry {
                    cache: c,
                    tokens: &t[..],
                    opts,
                })
                .collect();
            let mut want = Recorder {
                layers: sel.clone(),
                ..Recorder::default()
            };
            let want_out = match engine.forward_batch_observed(&mut entries, Some(&mut want)) {
                Ok(o) => o,
                Err(e) => fail(format!("{}: CPU step: {}", input.name, e.error)),
            };
            let mut gc: Vec<_> = step
                .iter()
                .map(|_| gpu.new_cache().unwrap_or_else(|e| fail(e.to_string())))
                .collect();
            let mut entries: Vec<_> = gc
                .iter_mut()
                .zip(step)
                .map(|(c, t)| BatchEntry {
                    cache: c,
                    tokens: &t[..],
                    opts,
                })
                .collect();
            let mut got = Recorder {
                layers: sel.clone(),
                ..Recorder::default()
            };
            let got_out = match gpu.forward_seqs_observed(&mut entries, &mut got) {
                Ok(o) => o,
                Err(e) => fail(format!("{}: CUDA step: {}", input.name, e.error)),
            };
            if got.seen.len() != want.seen.len() {
                bad.push(format!(
                    "{what}: {} values shown, the CPU {}",
                    got.seen.len(),
                    want.seen.len()
                ));
            }
            for (g, w) in got.seen.iter().zip(&want.seen) {
                values += 1;
                bytes += 4 * w.2.len();
                if g != w {
                    bad.push(format!(
                        "{what}: {} at layer {} (CUDA: {} at {})",
                        w.0, w.1, g.0, g.1
                    ));
                }
            }
            for (i, (g, w)) in got_out.iter().zip(&want_out).enumerate() {
                let b = |o: &tarfa_run::cpu::ForwardOutput| -> Vec<u32> {
                    o.logits.iter().flatten().map(|x| x.to_bits()).collect()
                };
                if b(g) != b(w) || format!("{:?}", g.router) != format!("{:?}", w.router) {
                    bad.push(format!("{what}: sequence {i}'s logits or routes"));
                }
            }
        }
    }
    for b in bad.iter().take(10) {
        println!("{}: MISMATCH {b}", input.name);
    }
    let detail = format!(
        "{values} captured values ({bytes} B) compared, {} mismatches",
        bad.len()
    );
    println!("{}: captures {detail}", input.name);
    table(
        &format!("captures {}", input.name),
        if bad.is_empty() && values > 0 {
            "PASS"
        } else {
            "FAIL"
        },
        &detail,
    );
    bad.is_empty() && values > 0
}

fn tarfa_run_gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(i) = args.iter().position(|a| a == "--many-kernels") {
        let v = args
            .get(i + 1)
            .unwrap_or_else(|| fail("--many-kernels needs a value".into()));
        let m = tarfa_run::cuda::ManyKernels::parse(v).unwrap_or_else(|e| fail(e));
        let _ = MANY.set(m);
        args.drain(i..i + 2);
    }
    let cmd = args.first().map(String::as_str).unwrap_or("");
    let path = |i: usize| -> PathBuf {
        PathBuf::from(
            args.get(i)
                .unwrap_or_else(|| fail(format!("{cmd}: a directory is needed"))),
        )
    };
    let ok = match cmd {
        "info" => match probe(0) {
            Ok(info) => {
                println!("{info}");
                true
            }
            Err(e) => {
                println!("no usable GPU: {e}");
                false
            }
        },
        "kernels" => cmd_kernels(),
        "fixture" => cmd_fixture(&path(1), &args[2..]),
        "synth" => cmd_synth(args.get(1).map(String::as_str).unwrap_or("qwen3_moe"), &args[2..]),
        "generate" => cmd_generate(&path(1), &args[2..]),
        "bench" => cmd_bench(&path(1), &args[2..]),
        "captures" => cmd_captures(&path(1)),
        _ => fail("usage: cuda_selftest info|kernels|fixture DIR|synth FAMILY [--big]|generate DIR|bench DIR|captures DIR".into()),
    };
    std::process::exit(if ok { 0 } else { 1 })
}
