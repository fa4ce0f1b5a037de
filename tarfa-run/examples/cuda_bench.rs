//! Decode and prefill figures of the CUDA backend on one model, with the exactness checks that
//! make them count (run by validation/gpu/bench.sh on the GPU machine):
//!
//! ```text
//! cuda_bench DIR [--prompt 128] [--decode 128] [--prefill 512,2048] [--pairs 8]
//!                [--profile-steps 16] [--selftest-prompts 3] [--json OUT] [--only-profile]
//!                [--graph-diag REPS [--only-graph-diag]] [--decode-mode MODE]
//!                [--sweep "MODE;MODE;..." [--sweep-rounds 5]]
//! ```
//! `--decode-mode`: the mode the default-mode figures use (default graph-pdl).
//! `--sweep`: first, the decode graph's time per step in each of the `;`-separated decode modes,
//! in interleaved rounds (the median of each mode's rounds, `--graph-diag` replays each, default
//! 30; change against the first), each mode's greedy tokens and last logits compared bit for bit
//! with the first's; then stops. (Kernel versions are compared across builds: validation/ab
//! takes two binaries.)
//! `--only-profile`: load, then step 4 alone (for a run under ncu).
//! `--graph-diag REPS`: first, the decode graph's time with each kind of launch left out and of
//! each kind alone (a timing diagnostic; `--only-graph-diag` stops after it; `--graph-diag-all`:
//! the whole graph only, for a run under nsys).
//! 1. the HBM copy rate (cuMemcpyDtoD of 2 GiB, events; bytes read + written) and the weight
//!    bytes a decode step reads (the step's own statistics): the roofline;
//! 2. decode at batch 1 after a `--prompt`-token prompt in every decode mode (legacy kernels,
//!    decode kernels launched one by one, one CUDA graph, graph + programmatic launch), three
//!    ways each: `api` (forward() per token, logits copied back, host argmax: what
//!    `tarfa-run generate` does), `loop` (decode_greedy: device argmax, one host wait at the end)
//!    and `gpu` (event time of the steps alone); every mode must choose the same tokens and the
//!    same last logits, bit for bit, as the legacy kernels;
//! 3. a paired A/B, legacy `api` against the default mode's `api` (AB/BA alternation, median
//!    paired change, 95% bootstrap interval);
//! 4. each decode kernel timed with events: microseconds per token and GB/s of weights;
//! 5. prefill of each `--prefill` length;
//! 6. the CPU-vs-CUDA selftest on this model (prefill and decode, every logit and router record).
//!
//! `--only-many` (issue 17's figures; validation/gpu/many.sh): instead of 2-6, the token-tiled
//! many-token step ([`CudaModel::forward_seqs`]):
//! - prefill of each `--prefill` length (one sequence, one step): tok/s and TFLOP/s counting the
//!   model's multiply-adds (2 per weight a token uses, attention's q.k and p.v, the lm_head of
//!   the last row), the share of `--fma-peak` (TFLOP/s, default 66.9: the H200's FP32 FMA peak);
//!   the last row's logits must be bit-identical to the same prompt run in chunks of 100 tokens;
//! - batched greedy decode at each `--batch` size B (default 1,8,32,128): B sequences with their
//!   own `--prompt`-token prompts, prefilled as one step, then `--batch-steps` (default 32) steps
//!   of all B at once; tok/s, and the HBM roofline of the step (the weights of the union of the
//!   experts its tokens chose plus the dense weights, at the measured copy rate). Every sequence's
//!   tokens and last logits must be bit-identical to the same sequence decoded alone
//!   (`--no-reference`: not compared, for a run under a profiler only).
//! - each in every `--many-kernels` arm (default `tiled,auto`: the token-tiled kernels, then
//!   the default choice), alternating per size in one process; every arm's bits must equal the
//!   first's.
//!
//! Lines starting `TABLE|` go to bench.sh's summary; `--json` writes every figure.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde_json::json;
use tarfa_run::config::MoeConfig;
use tarfa_run::cpu::{CpuEngine, CpuModel, EngineOptions, ForwardOptions, LogitRows};
use tarfa_run::cuda::{
    selftest_models, CudaCache, CudaModel, CudaOptions, DecodeMode, SelftestOptions,
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

fn arg<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

fn arg_usize(args: &[String], flag: &str, default: usize) -> usize {
    arg(args, flag).map_or(default, |v| {
        v.parse()
            .unwrap_or_else(|_| fail(format!("bad value for {flag}")))
    })
}

fn load(dir: &Path) -> (String, MoeConfig, Arc<dyn WeightSource>) {
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
    (name, cfg, source)
}

fn prompt_of(vocab: usize, n: usize, seed: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 7919 + 17 + 101 * seed) % vocab) as u32)
        .collect()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// 95% percentile-bootstrap interval of the median (seeded, 20,000 resamples).
fn bootstrap(v: &[f64]) -> (f64, f64) {
    let mut z = 0x5EED_u64;
    let mut next = || {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut x = z;
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^ (x >> 31)
    };
    let mut meds = Vec::with_capacity(20_000);
    let mut s = vec![0.0; v.len()];
    for _ in 0..20_000 {
        for x in s.iter_mut() {
            *x = v[(next() % v.len() as u64) as usize];
        }
        meds.push(median(&mut s));
    }
    meds.sort_by(f64::total_cmp);
    (meds[500], meds[19_499])
}

struct Bench<'a> {
    model: &'a CudaModel,
    prompt: Vec<u32>,
    last: ForwardOptions,
}

impl Bench<'_> {
    /// A fresh sequence in `mode` after the prompt, with room for `room` more positions and its
    /// decode step built by one untimed step: (cache, the tokens so far after the prompt).
    fn start(&self, mode: DecodeMode, room: usize) -> (CudaCache, Vec<u32>) {
        let mut c = self
            .model
            .new_cache()
            .unwrap_or_else(|e| fail(e.to_string()));
        c.set_decode_mode(mode);
        let out = self
            .model
            .forward(&mut c, &self.prompt, &self.last)
            .unwrap_or_else(|e| fail(format!("prefill: {e}")));
        let t0 = argmax(&out.logits[0]);
        self.model
            .reserve(&mut c, room + 1)
            .unwrap_or_else(|e| fail(e.to_string()));
        let out = self
            .model
            .forward(&mut c, &[t0], &self.last)
            .unwrap_or_else(|e| fail(format!("{} first decode step: {e}", mode.name())));
        (c, vec![t0, argmax(&out.logits[0])])
    }

    /// `n` tokens through forward() with the host's argmax: (seconds, tokens, last logits).
    fn api(&self, mode: DecodeMode, n: usize) -> (f64, Vec<u32>, Vec<f32>) {
        let (mut c, mut toks) = self.start(mode, n);
        let mut t = *toks.last().expect("two tokens");
        let mut last = Vec::new();
        let t0 = Instant::now();
        for _ in 0..n {
            let out = self
                .model
                .forward(&mut c, &[t], &self.last)
                .unwrap_or_else(|e| fail(format!("{} decode: {e}", mode.name())));
            t = argmax(&out.logits[0]);
            toks.push(t);
            last = out.logits.into_iter().next().unwrap_or_default();
        }
        (t0.elapsed().as_secs_f64(), toks, last)
    }

    /// `n` tokens through decode_greedy: (seconds, tokens, the mode that ran).
    fn device_loop(&self, mode: DecodeMode, n: usize) -> (f64, Vec<u32>, String) {
        let (mut c, mut toks) = self.start(mode, n);
        let t = *toks.last().expect("two tokens");
        let t0 = Instant::now();
        let more = self
            .model
            .decode_greedy(&mut c, t, n)
            .unwrap_or_else(|e| fail(format!("{} decode_greedy: {e}", mode.name())));
        let s = t0.elapsed().as_secs_f64();
        let running = c
            .decode_running()
            .map(|(m, note)| {
                if note.is_empty() {
                    m.name().to_string()
                } else {
                    format!("{} ({note})", m.name())
                }
            })
            .unwrap_or_else(|| "legacy".into());
        toks.extend(more);
        (s, toks, running)
    }

    /// GPU milliseconds of `n` decode steps (events around the replays).
    fn gpu(&self, mode: DecodeMode, n: usize) -> f64 {
        let (mut c, toks) = self.start(mode, n);
        self.model
            .time_decode(&mut c, *toks.last().expect("two tokens"), n)
            .unwrap_or_else(|e| fail(format!("{} time_decode: {e}", mode.name())))
    }
}

/// A decode mode named on the command line (an unknown name stops the bench).
fn mode_arg(name: &str) -> DecodeMode {
    DecodeMode::parse(name).unwrap_or_else(|e| fail(e))
}

/// `--sweep`: the decode graph's time per step under each setting, interleaved rounds.
fn sweep(
    bench: &Bench,
    settings: &str,
    reps: usize,
    rounds: usize,
    js: &mut serde_json::Map<String, serde_json::Value>,
) {
    let sets: Vec<&str> = settings.split(';').map(str::trim).collect();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); sets.len()];
    let mut same = vec![true; sets.len()];
    let mut reference: Option<(Vec<u32>, Vec<u32>)> = None;
    let modes: Vec<DecodeMode> = sets.iter().map(|s| mode_arg(s)).collect();
    for round in 0..rounds {
        for (i, set) in sets.iter().enumerate() {
            let mode = modes[i];
            if round == 0 {
                let (_, toks, last) = bench.api(mode, 16);
                let bits: Vec<u32> = last.iter().map(|x| x.to_bits()).collect();
                match &reference {
                    None => reference = Some((toks, bits)),
                    Some((t, b)) => same[i] = *t == toks && *b == bits,
                }
            }
            let (mut c, toks) = bench.start(mode, reps + 2);
            let rows = bench
                .model
                .graph_costs(&mut c, *toks.last().expect("two tokens"), reps, false)
                .unwrap_or_else(|e| fail(format!("sweep [{set}]: {e}")));
            times[i].push(rows[0].1);
        }
    }
    let base = median(&mut times[0].clone());
    let mut out = Vec::new();
    for (i, set) in sets.iter().enumerate() {
        let m = median(&mut times[i].clone());
        let d = format!(
            "graph {:>7.1} us/token (median of {rounds} rounds x {reps} replays; {:+.1}% vs the first), tokens and last logits {}",
            m * 1e3,
            100.0 * (m - base) / base,
            if same[i] { "bit-identical" } else { "DIFFER" }
        );
        println!("sweep [{set}] {d}");
        table(
            &format!("sweep [{set}]"),
            if same[i] { "SAME" } else { "DIFFER" },
            &d,
        );
        out.push(json!({"setting": set, "graph_ms": m, "rounds_ms": times[i], "same": same[i]}));
    }
    js.insert("sweep".into(), json!(out));
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = PathBuf::from(
        args.first()
            .unwrap_or_else(|| fail("usage: cuda_bench DIR [options]".into())),
    );
    let n_prompt = arg_usize(&args, "--prompt", 128);
    let n_decode = arg_usize(&args, "--decode", 128);
    let pairs = arg_usize(&args, "--pairs", 8);
    let prof_steps = arg_usize(&args, "--profile-steps", 16);
    let n_self = arg_usize(&args, "--selftest-prompts", 3);
    let prefills: Vec<usize> = arg(&args, "--prefill")
        .unwrap_or("512,2048")
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap_or_else(|_| fail("bad --prefill".into())))
        .collect();
    let json_out = arg(&args, "--json").map(PathBuf::from);

    let (name, cfg, source) = load(&dir);
    let t = Instant::now();
    let mut copts = CudaOptions::default();
    if let Some(m) = arg(&args, "--decode-mode") {
        copts.tuning.decode = mode_arg(m);
    }
    let model = CudaModel::load(cfg.clone(), source.clone(), &copts)
        .unwrap_or_else(|e| fail(format!("{name}: {e}")));
    println!(
        "{name}: {:.2} GiB resident on {} (uploaded in {:.1}s); decode kernels: {}",
        model.resident_bytes() as f64 / (1u64 << 30) as f64,
        model.device(),
        t.elapsed().as_secs_f64(),
        model.decode_unsupported_reason().unwrap_or("yes")
    );
    let mut js = serde_json::Map::new();
    js.insert("model".into(), json!(name));
    js.insert("device".into(), json!(model.device().to_string()));

    if args.iter().any(|a| a == "--only-many") {
        let ok = many_token(&model, &cfg, &args, &prefills, &mut js);
        if let Some(p) = json_out {
            let _ = std::fs::write(&p, serde_json::to_string_pretty(&js).unwrap_or_default());
        }
        std::process::exit(if ok { 0 } else { 1 })
    }

    // 1. the roofline
    let copy = model
        .copy_rate(2 << 30, 10)
        .unwrap_or_else(|e| fail(format!("copy rate: {e}")));
    let vocab = cfg.vocab_size;
    let bench = Bench {
        model: &model,
        prompt: prompt_of(vocab, n_prompt, 0),
        last: ForwardOptions {
            logits: LogitRows::Last,
            ..Default::default()
        },
    };
    let bytes = {
        let (mut c, toks) = bench.start(model.default_decode_mode(), 1);
        model
            .forward(&mut c, &[*toks.last().expect("two tokens")], &bench.last)
            .unwrap_or_else(|e| fail(e.to_string()))
            .stats
            .weight_bytes
    };
    let roof_ms = bytes as f64 / (copy * 1e9) * 1e3;
    println!(
        "roofline: {:.3} GB of weights per decode token / {:.0} GB/s copy rate = {:.3} ms/token ({:.0} tok/s)",
        bytes as f64 / 1e9,
        copy,
        roof_ms,
        1e3 / roof_ms
    );
    table(
        "roofline",
        "-",
        &format!(
            "{:.3} GB/token of weights, copy {:.0} GB/s (read+write) -> {:.3} ms/token = {:.0} tok/s",
            bytes as f64 / 1e9,
            copy,
            roof_ms,
            1e3 / roof_ms
        ),
    );
    js.insert("copy_gb_s".into(), json!(copy));
    js.insert("weight_bytes_per_token".into(), json!(bytes));
    js.insert("roofline_ms".into(), json!(roof_ms));

    let only_profile = args.iter().any(|a| a == "--only-profile");
    if let Some(sw) = arg(&args, "--sweep") {
        let reps: usize = arg(&args, "--graph-diag").map_or(30, |r| {
            r.parse()
                .unwrap_or_else(|_| fail("bad --graph-diag".into()))
        });
        let rounds: usize = arg(&args, "--sweep-rounds").map_or(5, |r| {
            r.parse()
                .unwrap_or_else(|_| fail("bad --sweep-rounds".into()))
        });
        sweep(&bench, sw, reps, rounds.max(1), &mut js);
        if let Some(p) = &json_out {
            std::fs::write(p, serde_json::to_string_pretty(&js).expect("json"))
                .unwrap_or_else(|e| fail(format!("{}: {e}", p.display())));
        }
        return;
    }
    // diagnostic: the graph with each kind of launch left out, and each kind alone
    if let Some(reps) = arg(&args, "--graph-diag") {
        let reps: usize = reps
            .parse()
            .unwrap_or_else(|_| fail("bad --graph-diag".into()));
        // the default mode's graph (graph-pdl keeps programmatic launch in every graph timed)
        let (mut c, toks) = bench.start(model.default_decode_mode(), reps + 2);
        match model.graph_costs(
            &mut c,
            *toks.last().expect("two tokens"),
            reps,
            !args.iter().any(|a| a == "--graph-diag-all"),
        ) {
            Ok(rows) => {
                let all = rows.first().map_or(0.0, |r| r.1);
                let mut gj = Vec::new();
                for (label, without, only) in &rows {
                    let d = format!(
                        "without {:>7.1} us (saves {:>6.1}), alone {:>7.1} us",
                        without * 1e3,
                        (all - without) * 1e3,
                        only * 1e3
                    );
                    println!("graph-diag {label:<44} {d}");
                    table(&format!("graph {label}"), "-", &d);
                    gj.push(json!({"label": label, "without_ms": without, "alone_ms": only}));
                }
                js.insert("graph_diag".into(), json!(gj));
            }
            Err(e) => println!("graph-diag: {e}"),
        }
        if args.iter().any(|a| a == "--only-graph-diag") {
            if let Some(p) = &json_out {
                std::fs::write(p, serde_json::to_string_pretty(&js).expect("json"))
                    .unwrap_or_else(|e| fail(format!("{}: {e}", p.display())));
            }
            return;
        }
    }
    // 2. decode in every mode; the legacy mode's tokens and logits are the reference
    let mut ref_toks: Option<Vec<u32>> = None;
    let mut ref_logits: Option<Vec<f32>> = None;
    let mut modes_js = Vec::new();
    let mut all_same = true;
    // a model the decode kernels cannot take (MLA, group-limited routing, ...) decodes with the
    // per-operation kernels in every mode: measure that one mode, and skip the A/B against it
    let decode_kernels = model.decode_unsupported_reason().is_none();
    let modes: &[DecodeMode] = if decode_kernels {
        &DecodeMode::ALL
    } else {
        &[DecodeMode::Legacy]
    };
    for &mode in modes {
        if only_profile {
            break;
        }
        // warm-up: builds and captures the step, first-touch of buffers
        let _ = bench.api(mode, 4);
        let (api_s, api_toks, api_last) = bench.api(mode, n_decode);
        let (loop_s, loop_toks, running) = bench.device_loop(mode, n_decode);
        let gpu_ms = if mode == DecodeMode::Legacy {
            f64::NAN
        } else {
            bench.gpu(mode, n_decode)
        };
        let same_tokens = match &ref_toks {
            None => {
                ref_toks = Some(api_toks.clone());
                true
            }
            Some(r) => r == &api_toks,
        } && ref_toks.as_ref() == Some(&loop_toks);
        let same_logits = match &ref_logits {
            None => {
                ref_logits = Some(api_last.clone());
                true
            }
            Some(r) => {
                r.len() == api_last.len()
                    && r.iter()
                        .zip(&api_last)
                        .all(|(a, b)| a.to_bits() == b.to_bits())
            }
        };
        all_same &= same_tokens && same_logits;
        let api_tps = n_decode as f64 / api_s;
        let loop_tps = n_decode as f64 / loop_s;
        let gpu_ms_tok = gpu_ms / n_decode as f64;
        let detail = format!(
            "api {:.1} tok/s ({:.3} ms), loop {:.1} tok/s ({:.3} ms), gpu {:.3} ms/token; {:.0}% of roofline (loop); runs as {}; tokens {}, last logits {}",
            api_tps,
            1e3 * api_s / n_decode as f64,
            loop_tps,
            1e3 * loop_s / n_decode as f64,
            gpu_ms_tok,
            100.0 * roof_ms / (1e3 * loop_s / n_decode as f64),
            running,
            if same_tokens { "same" } else { "DIFFERENT" },
            if same_logits { "bit-identical" } else { "DIFFER" }
        );
        println!("decode {:<9} {detail}", mode.name());
        table(
            &format!("decode {}", mode.name()),
            if same_tokens && same_logits {
                "SAME"
            } else {
                "DIFFER"
            },
            &detail,
        );
        modes_js.push(json!({
            "mode": mode.name(), "running": running, "api_tok_s": api_tps, "loop_tok_s": loop_tps,
            "gpu_ms_per_token": gpu_ms_tok, "same_tokens": same_tokens, "same_logits": same_logits,
            "pct_roofline_loop": 100.0 * roof_ms / (1e3 * loop_s / n_decode as f64),
            "pct_roofline_gpu": 100.0 * roof_ms / gpu_ms_tok,
        }));
    }
    js.insert("decode".into(), json!(modes_js));
    js.insert("decode_modes_identical".into(), json!(all_same));

    // 3. paired A/B: legacy api vs the default mode's api, 64 tokens per run
    let b_mode = model.default_decode_mode();
    if !only_profile && decode_kernels {
        let n_ab = n_decode.min(64);
        let mut changes = Vec::new();
        let (mut a_t, mut b_t) = (Vec::new(), Vec::new());
        for i in 0..pairs {
            let order = if i % 2 == 0 {
                [true, false]
            } else {
                [false, true]
            };
            let (mut ta, mut tb) = (0.0, 0.0);
            for is_a in order {
                let (s, _, _) = bench.api(if is_a { DecodeMode::Legacy } else { b_mode }, n_ab);
                if is_a {
                    ta = s;
                } else {
                    tb = s;
                }
            }
            a_t.push(ta);
            b_t.push(tb);
            changes.push((tb - ta) / ta);
        }
        let med = median(&mut changes.clone());
        let (lo, hi) = bootstrap(&changes);
        let ab = format!(
            "{pairs} pairs AB/BA, {n_ab} tokens each: A legacy {:.3} ms/token, B {} {:.3} ms/token; median paired change {:+.1}% (95% CI {:+.1}% .. {:+.1}%)",
            1e3 * median(&mut a_t.clone()) / n_ab as f64,
            b_mode.name(),
            1e3 * median(&mut b_t.clone()) / n_ab as f64,
            100.0 * med,
            100.0 * lo,
            100.0 * hi
        );
        println!("A/B: {ab}");
        table(
            "A/B decode api (legacy vs default)",
            if hi < 0.0 { "ACCEPT" } else { "REJECT" },
            &ab,
        );
        js.insert(
            "ab".into(),
            json!({"pairs": pairs, "tokens": n_ab, "a_s": a_t, "b_s": b_t, "median_change": med, "ci": [lo, hi], "b_mode": b_mode.name()}),
        );
    }

    // 4. per-kernel profile
    {
        let (mut c, toks) = bench.start(DecodeMode::Direct, prof_steps);
        match model.profile_decode(&mut c, *toks.last().expect("two tokens"), prof_steps) {
            Ok(rows) => {
                let total: f64 = rows.iter().map(|r| r.us_per_token).sum();
                let mut pj = Vec::new();
                for r in &rows {
                    let gbs = r.weight_bytes as f64 / (r.us_per_token * 1e-6) / 1e9;
                    let d = format!(
                        "{:>3} launches, {:>8.1} us/token, {:>7.1} MB, {:>6.0} GB/s, {} regs ({})",
                        r.launches,
                        r.us_per_token,
                        r.weight_bytes as f64 / 1e6,
                        gbs,
                        r.registers,
                        r.kernels
                    );
                    println!("profile {:<44} {d}", r.label);
                    table(&format!("kernel {}", r.label), "-", &d);
                    pj.push(
                        json!({"label": r.label, "kernels": r.kernels, "launches": r.launches,
                        "us_per_token": r.us_per_token, "weight_bytes": r.weight_bytes, "gb_s": gbs,
                        "registers": r.registers}),
                    );
                }
                let launches: usize = rows.iter().map(|r| r.launches).sum();
                let d = format!(
                    "{launches} launches/token, {total:.1} us/token summed ({:.0} GB/s over all weights)",
                    bytes as f64 / (total * 1e-6) / 1e9
                );
                println!("profile total: {d}");
                table("kernels total (each timed alone)", "-", &d);
                js.insert("profile".into(), json!(pj));
                js.insert("profile_total_us".into(), json!(total));
                js.insert("launches_per_token".into(), json!(launches));
            }
            Err(e) => {
                println!("profile: {e}");
                table("kernel profile", "ERROR", &e.to_string());
            }
        }
    }

    // 5. prefill
    let mut pre_js = Vec::new();
    for (k, &n) in prefills.iter().enumerate().filter(|_| !only_profile) {
        let n = n.min(cfg.max_position_embeddings.saturating_sub(1)).max(1);
        let p = prompt_of(vocab, n, 7 + k);
        let reps = if n >= 1024 { 2 } else { 3 };
        let mut ts = Vec::new();
        for r in 0..=reps {
            let mut c = model.new_cache().unwrap_or_else(|e| fail(e.to_string()));
            let t = Instant::now();
            if let Err(e) = model.forward(&mut c, &p, &bench.last) {
                fail(format!("prefill {n}: {e}"));
            }
            if r > 0 {
                ts.push(t.elapsed().as_secs_f64());
            }
        }
        let s = median(&mut ts);
        let d = format!(
            "{:.0} tok/s ({n} tokens in {:.1} ms, median of {reps})",
            n as f64 / s,
            1e3 * s
        );
        println!("prefill {n}: {d}");
        table(&format!("prefill {n}"), "-", &d);
        pre_js.push(json!({"tokens": n, "tok_s": n as f64 / s, "seconds": s}));
    }
    js.insert("prefill".into(), json!(pre_js));

    // 6. CPU vs CUDA, every logit and router record
    let mut ok = all_same;
    if n_self > 0 && !only_profile {
        let t = Instant::now();
        let cpu = Arc::new(
            CpuModel::load(cfg.clone(), source.clone())
                .unwrap_or_else(|e| fail(format!("CPU model: {e}"))),
        );
        let engine = CpuEngine::new(
            cpu,
            EngineOptions {
                threads: 0,
                kernel: Kernel::best(),
            },
        )
        .unwrap_or_else(|e| fail(e.to_string()));
        let lens: Vec<usize> = [7usize, 40, 3, 100].into_iter().take(n_self).collect();
        let opts = SelftestOptions {
            prompts: lens
                .iter()
                .enumerate()
                .map(|(i, &n)| prompt_of(vocab, n, 20 + i))
                .collect(),
            decode_steps: arg_usize(&args, "--selftest-decode", 6),
            cpu_threads: 0,
        };
        match selftest_models(&engine, &model, &opts) {
            Ok(rep) => {
                println!("{name}: selftest {rep} ({:.1}s)", t.elapsed().as_secs_f64());
                table(
                    &format!("selftest {name} (decode {})", b_mode.name()),
                    if rep.passed() { "PASS" } else { "FAIL" },
                    &format!(
                        "{} B compared ({} logit rows, {} router records, {} steps)",
                        rep.bytes_compared(),
                        rep.logit_rows,
                        rep.router_records,
                        rep.steps
                    ),
                );
                js.insert("selftest".into(), json!(rep.to_string()));
                ok &= rep.passed();
            }
            Err(e) => {
                println!("{name}: selftest error: {e}");
                table(&format!("selftest {name}"), "ERROR", &e.to_string());
                ok = false;
            }
        }
    }
    if let Some(p) = json_out {
        let _ = std::fs::write(&p, serde_json::to_string_pretty(&js).unwrap_or_default());
    }
    std::process::exit(if ok { 0 } else { 1 })
}

/// Multiply-adds of one token's weights (every matrix a token multiplies, with its chosen
/// experts), from a one-token step's weight bytes: the BF16 weights less the embedding row and
/// the lm_head (counted separately).
fn body_macs(model: &CudaModel, cfg: &MoeConfig, last: &ForwardOptions) -> f64 {
    let mut c = model.new_cache().unwrap_or_else(|e| fail(e.to_string()));
    let st = model
        .forward(&mut c, &[1], last)
        .unwrap_or_else(|e| fail(e.to_string()))
        .stats;
    let lm = (cfg.vocab_size * cfg.hidden_size) as f64;
    st.weight_bytes as f64 / 2.0 - lm - cfg.hidden_size as f64
}

fn bits_of(rows: &[Vec<f32>]) -> Vec<u32> {
    rows.iter().flatten().map(|v| v.to_bits()).collect()
}

/// `--only-many`: prefill and batched-decode figures of the many-token step, each checked
/// bitwise, in each `--many-kernels` arm (comma-separated `ManyKernels` names, default
/// `tiled,auto`: PHASE_LOG B5's A/B, the arms alternating at each size in the same process).
/// Returns whether every check passed: each arm's bits equal to the first arm's, the prompt in
/// chunks equal to it whole, every sequence of a batch equal to it decoded alone.
fn many_token(
    model: &CudaModel,
    cfg: &MoeConfig,
    args: &[String],
    prefills: &[usize],
    js: &mut serde_json::Map<String, serde_json::Value>,
) -> bool {
    use tarfa_run::batch::BatchEntry;
    use tarfa_run::cuda::ManyKernels;
    use tarfa_run::Backend;
    let vocab = cfg.vocab_size;
    let last = ForwardOptions {
        logits: LogitRows::Last,
        ..Default::default()
    };
    let peak: f64 = arg(args, "--fma-peak").map_or(66.9, |v| {
        v.parse().unwrap_or_else(|_| fail("bad --fma-peak".into()))
    });
    let arms: Vec<ManyKernels> = arg(args, "--many-kernels")
        .unwrap_or("tiled,auto")
        .split(',')
        .map(|a| ManyKernels::parse(a).unwrap_or_else(|e| fail(e)))
        .collect();
    let copy = model
        .copy_rate(2 << 30, 10)
        .unwrap_or_else(|e| fail(format!("copy rate: {e}")));
    let body = body_macs(model, cfg, &last);
    let attn_per_pos = (2 * cfg.num_heads * cfg.head_dim * cfg.num_layers) as f64;
    let mut ok = true;

    // prefill, one sequence per step
    let mut pre_js = Vec::new();
    for (k, &n) in prefills.iter().enumerate() {
        let n = n.min(cfg.max_position_embeddings.saturating_sub(1)).max(1);
        let p = prompt_of(vocab, n, 7 + k);
        let reps = if n >= 4096 { 2 } else { 3 };
        // 2 FLOPs per multiply-add: the weights of every token, q.k and p.v over 1..=n
        // positions, the lm_head once
        let macs = n as f64 * body
            + attn_per_pos * (n as f64) * (n as f64 + 1.0) / 2.0
            + (vocab * cfg.hidden_size) as f64;
        let mut first: Option<Vec<u32>> = None;
        let mut base_s = None;
        for &arm in &arms {
            model.set_many_kernels(arm);
            let mut ts = Vec::new();
            let mut whole = Vec::new();
            for r in 0..=reps {
                let mut c = model.new_cache().unwrap_or_else(|e| fail(e.to_string()));
                let t = Instant::now();
                let out = model
                    .forward(&mut c, &p, &last)
                    .unwrap_or_else(|e| fail(format!("prefill {n}: {e}")));
                if r > 0 {
                    ts.push(t.elapsed().as_secs_f64());
                }
                whole = bits_of(&out.logits);
            }
            let same_arms = first.as_ref().is_none_or(|f| *f == whole);
            // the first arm: the same prompt in chunks of 100, other tiles, the same bits
            let chunked_same = if first.is_none() {
                let mut c = model.new_cache().unwrap_or_else(|e| fail(e.to_string()));
                let mut chunked = Vec::new();
                for piece in p.chunks(100) {
                    chunked = bits_of(
                        &model
                            .forward(&mut c, piece, &last)
                            .unwrap_or_else(|e| fail(format!("prefill {n} in chunks: {e}")))
                            .logits,
                    );
                }
                first = Some(whole.clone());
                chunked == whole
            } else {
                true
            };
            let same = same_arms && chunked_same;
            ok &= same;
            let s = median(&mut ts);
            let base = *base_s.get_or_insert(s);
            let tflops = 2.0 * macs / s / 1e12;
            let d = format!(
                "{:.0} tok/s, {tflops:.1} TFLOP/s = {:.1}% of {peak} ({n} tokens in {:.1} ms, median of {reps}; {:.2}x the first arm); {}",
                n as f64 / s,
                100.0 * tflops / peak,
                1e3 * s,
                base / s,
                if same { "same bits (chunks of 100, every arm)" } else { "DIFFERENT BITS" }
            );
            println!("prefill {n} [{}]: {d}", arm.name());
            table(
                &format!("prefill {n} [{}]", arm.name()),
                if same { "PASS" } else { "FAIL" },
                &d,
            );
            pre_js.push(
                json!({"tokens": n, "kernels": arm.name(), "tok_s": n as f64 / s, "seconds": s,
                "tflops": tflops, "fma_peak_share": tflops / peak, "same_bits": same}),
            );
        }
    }
    js.insert("prefill".into(), json!(pre_js));

    // batched greedy decode
    let sizes: Vec<usize> = arg(args, "--batch")
        .unwrap_or("1,8,32,128")
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap_or_else(|_| fail("bad --batch".into())))
        .collect();
    let steps = arg_usize(args, "--batch-steps", 32);
    let n_prompt = arg_usize(args, "--prompt", 128);
    // --no-reference (profiling runs only): no sequence decoded alone, nothing compared
    let compare = !args.iter().any(|a| a == "--no-reference");
    let most = if compare {
        sizes.iter().copied().max().unwrap_or(0)
    } else {
        0
    };
    // each sequence alone: its greedy tokens and last logits (the reference)
    model.set_many_kernels(arms[0]);
    let t = Instant::now();
    let alone: Vec<(Vec<u32>, Vec<u32>)> = (0..most)
        .map(|i| {
            let mut c = model.new_cache().unwrap_or_else(|e| fail(e.to_string()));
            let mut out = model
                .forward(&mut c, &prompt_of(vocab, n_prompt, 100 + i), &last)
                .unwrap_or_else(|e| fail(e.to_string()));
            let mut toks = Vec::new();
            for _ in 0..steps {
                let tok = argmax(&out.logits[0]);
                toks.push(tok);
                out = model
                    .forward(&mut c, &[tok], &last)
                    .unwrap_or_else(|e| fail(e.to_string()));
            }
            (toks, bits_of(&out.logits))
        })
        .collect();
    println!(
        "batched decode: {most} sequences decoded alone as the reference in {:.1}s",
        t.elapsed().as_secs_f64()
    );
    let mut dec_js = Vec::new();
    for &b in &sizes {
        let mut base_tok_s = None;
        for &arm in &arms {
            model.set_many_kernels(arm);
            let prompts: Vec<Vec<u32>> = (0..b)
                .map(|i| prompt_of(vocab, n_prompt, 100 + i))
                .collect();
            let mut caches: Vec<CudaCache> = (0..b)
                .map(|_| model.new_cache().unwrap_or_else(|e| fail(e.to_string())))
                .collect();
            let step = |caches: &mut [CudaCache], toks: &[Vec<u32>], opts: ForwardOptions| {
                let mut entries: Vec<BatchEntry<'_, CudaCache>> = caches
                    .iter_mut()
                    .zip(toks)
                    .map(|(cache, t)| BatchEntry {
                        cache,
                        tokens: t,
                        opts,
                    })
                    .collect();
                model
                    .forward_batch(&mut entries)
                    .unwrap_or_else(|e| fail(format!("batch of {b}: {e}")))
            };
            let t = Instant::now();
            let mut outs = step(&mut caches, &prompts, last);
            let prefill_s = t.elapsed().as_secs_f64();
            let mut got: Vec<Vec<u32>> = vec![Vec::new(); b];
            let t = Instant::now();
            for _ in 0..steps {
                let next: Vec<Vec<u32>> = outs.iter().map(|o| vec![argmax(&o.logits[0])]).collect();
                for (g, n) in got.iter_mut().zip(&next) {
                    g.push(n[0]);
                }
                outs = step(&mut caches, &next, last);
            }
            let s = t.elapsed().as_secs_f64();
            let same = !compare
                || (0..b).all(|i| got[i] == alone[i].0 && bits_of(&outs[i].logits) == alone[i].1);
            ok &= same;
            // the roofline: one more step, traced, for the union of the experts its tokens chose
            let traced = ForwardOptions {
                trace_router: true,
                ..last
            };
            let next: Vec<Vec<u32>> = outs.iter().map(|o| vec![argmax(&o.logits[0])]).collect();
            let outs = step(&mut caches, &next, traced);
            let mut union = std::collections::BTreeSet::new();
            for o in &outs {
                for r in &o.router {
                    for &e in &r.experts {
                        union.insert((r.layer, e));
                    }
                }
            }
            let one = &outs[0].stats;
            let expert_bytes = (3 * 2 * cfg.expert_width * cfg.hidden_size) as u64;
            let dense = one.weight_bytes - one.experts_fetched * expert_bytes;
            let step_bytes = dense as f64 + union.len() as f64 * expert_bytes as f64;
            // copy_rate is in GB/s (bytes read + written)
            let roof = b as f64 / (step_bytes / (copy * 1e9));
            let tok_s = (b * steps) as f64 / s;
            let base = *base_tok_s.get_or_insert(tok_s);
            let d = format!(
                "{tok_s:.0} tok/s ({:.2} ms/step; {:.2}x the first arm), roofline {roof:.0} tok/s ({:.1} GB/step at {:.0} GB/s): {:.1}%; prefill of {b}x{n_prompt} in {:.0} ms; every sequence vs alone: {}",
                1e3 * s / steps as f64,
                tok_s / base,
                step_bytes / 1e9,
                copy,
                100.0 * tok_s / roof,
                1e3 * prefill_s,
                match (compare, same) {
                    (false, _) => "not compared (--no-reference)",
                    (true, true) => "same tokens and bits",
                    (true, false) => "DIFFERENT",
                }
            );
            println!("batched decode B={b} [{}]: {d}", arm.name());
            table(
                &format!("batched decode B={b} [{}]", arm.name()),
                if same { "PASS" } else { "FAIL" },
                &d,
            );
            dec_js.push(
                json!({"batch": b, "kernels": arm.name(), "tok_s": tok_s, "seconds": s,
                "steps": steps, "roofline_tok_s": roof, "step_bytes": step_bytes,
                "same_as_alone": same, "prefill_seconds": prefill_s}),
            );
        }
    }
    js.insert("batched_decode".into(), json!(dec_js));
    js.insert("copy_rate_gb_s".into(), json!(copy));
    ok
}
