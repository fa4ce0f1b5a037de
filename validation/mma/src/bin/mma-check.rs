//! mma-check: issue 25's harness. `verify` compares the H200's BF16 mma.sync with the CPU model
//! on random and adversarial tiles; `gemm-bench` times the prototype contract-v2 GEMM and checks
//! it bit for bit against the CPU model; `cpu-bench` measures the CPU emulator against today's
//! FMA dot. Exit codes: 0 all equal / done, 1 a mismatch, 2 bad usage, 3 no GPU / NVRTC / driver
//! failure.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use rayon::prelude::*;
use serde_json::json;
use tarfa_mma::cases::{self, Mode, Tile, MODES};
use tarfa_mma::gpu::{Env, Gemm, Gpu};
use tarfa_mma::model::{self, mma_elem, Params, Round};

#[derive(Parser)]
#[command(
    name = "mma-check",
    about = "Issue 25: is Hopper's BF16 mma.sync the integer function of tarfa-mma's model, and what would a contract v2 on it cost?",
    long_about = "Issue 25 (research). Subcommands:\n  verify      hardware mma.sync.m16n8k16.f32.bf16.bf16.f32 vs the CPU model (MMA-Sim's Hopper hypothesis) on random and adversarial tiles (128 cases per tile)\n  gemm-bench  the prototype tensor-core GEMM under the candidate contract v2 (3-way split, fixed K order): TFLOP/s and its bit check against the CPU model\n  cpu-bench   the CPU emulator's cost per dot element vs today's FMA dot (no GPU needed)\nExit codes: 0 ok, 1 mismatch, 2 bad usage, 3 no GPU / NVRTC / driver failure."
)]
struct Cli {
    /// Print one JSON object instead of the table.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Hardware vs model on N cases (one tile = 128 cases).
    Verify {
        #[arg(long, default_value_t = 100_000_000)]
        cases: u64,
        #[arg(long, default_value_t = 0x25)]
        seed: u64,
        /// Tiles per GPU batch.
        #[arg(long, default_value_t = 1 << 16)]
        batch_tiles: u64,
        /// Stop after this many seconds (the report says how many cases were checked).
        #[arg(long, default_value_t = 150.0)]
        max_seconds: f64,
        /// Also score the model's variants on the first V cases (which one matches the hardware).
        #[arg(long, default_value_t = 20_000_000)]
        variant_cases: u64,
        /// No GPU: the "hardware" is the CPU model itself (tests the harness and its speed; every
        /// case must match).
        #[arg(long)]
        dry_run: bool,
        /// The model every case is compared with, by its variant name (the list under
        /// "variants scored"): the hypothesis by default, `no-zeros-in-max` for the model the
        /// first counterexample corrects to.
        #[arg(long, default_value = "hopper(mma-sim)")]
        model: String,
        /// Write every mismatch (up to --dump-max) to FILE, one line each: case, mode, c,
        /// hardware, model, a (16 BF16), b (16 BF16), all hex: the data to fit a corrected
        /// model to, offline.
        #[arg(long, value_name = "FILE")]
        dump: Option<std::path::PathBuf>,
        #[arg(long, default_value_t = 200_000)]
        dump_max: usize,
    },
    /// The prototype GEMM: TFLOP/s on M x N x K shapes, and its bit check.
    GemmBench {
        /// Rows of weights.
        #[arg(long, default_value_t = 2048)]
        m: usize,
        /// Token counts.
        #[arg(long, value_delimiter = ',', default_value = "128,512,2048")]
        n: Vec<usize>,
        /// Reduction lengths.
        #[arg(long, value_delimiter = ',', default_value = "2048,768")]
        k: Vec<usize>,
        /// Outputs of each bench shape checked against the CPU model (sampled).
        #[arg(long, default_value_t = 4096)]
        sample: usize,
    },
    /// Offline: replay a hardware run from its `verify --dump` file. Every case of the run is
    /// regenerated from its seed; the hardware's result is the dump's where the case is there,
    /// else the run's model's (which it matched). Counts the cases where --model differs: 0
    /// means --model explains every case of that run. No GPU.
    Replay {
        /// The `verify --dump` file of the run.
        #[arg(long, value_name = "FILE")]
        dump: std::path::PathBuf,
        /// The run's --cases (as checked: the verify line's count) and --seed.
        #[arg(long)]
        cases: u64,
        #[arg(long, default_value_t = 0x25)]
        seed: u64,
        /// The model the run compared with (its --model).
        #[arg(long, default_value = "no-zeros-in-max")]
        run_model: String,
        /// The model to test.
        #[arg(long)]
        model: String,
    },
    /// The CPU emulator's cost per element vs today's FMA dot (this machine).
    CpuBench {
        /// Reduction length.
        #[arg(long, default_value_t = 2048)]
        k: usize,
        /// Rows (kept small so the weights stay in cache: compute cost, not memory).
        #[arg(long, default_value_t = 64)]
        rows: usize,
        /// Bytes of weights for the from-memory FMA run.
        #[arg(long, default_value_t = 1 << 30)]
        mem_bytes: usize,
    },
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    let r = match cli.cmd {
        Cmd::Verify {
            cases,
            seed,
            batch_tiles,
            max_seconds,
            variant_cases,
            dry_run,
            model,
            dump,
            dump_max,
        } => match variants().into_iter().find(|(n, _)| *n == model) {
            Some((_, p)) => verify(
                cli.json,
                cases,
                seed,
                batch_tiles.max(1),
                max_seconds,
                variant_cases,
                dry_run,
                p,
                dump.map(|f| (f, dump_max)),
            ),
            None => {
                let names: Vec<_> = variants().into_iter().map(|(n, _)| n).collect();
                eprintln!(
                    "mma-check: error: --model {model}: no such model variant (one of: {})",
                    names.join(", ")
                );
                return ExitCode::from(2);
            }
        },
        Cmd::Replay {
            dump,
            cases,
            seed,
            run_model,
            model,
        } => {
            let find = |n: &str| {
                variants()
                    .into_iter()
                    .find(|(v, _)| *v == n)
                    .map(|(_, p)| p)
            };
            match (find(&run_model), find(&model)) {
                (Some(r), Some(m)) => replay(cli.json, &dump, cases, seed, r, m),
                _ => {
                    let names: Vec<_> = variants().into_iter().map(|(n, _)| n).collect();
                    eprintln!(
                        "mma-check: error: --run-model {run_model} / --model {model}: no such model variant (one of: {})",
                        names.join(", ")
                    );
                    return ExitCode::from(2);
                }
            }
        }
        Cmd::GemmBench { m, n, k, sample } => gemm_bench(cli.json, m, &n, &k, sample),
        Cmd::CpuBench { k, rows, mem_bytes } => Ok(cpu_bench(cli.json, k, rows, mem_bytes)),
    };
    match r {
        Ok(ok) => ExitCode::from(if ok { 0 } else { 1 }),
        Err(e) => {
            eprintln!("mma-check: error: {e}");
            ExitCode::from(3)
        }
    }
}

/// The model variants scored against the hardware.
fn variants() -> Vec<(&'static str, Params)> {
    let h = Params::HOPPER;
    let mut v = vec![
        ("hopper(mma-sim)", h),
        (
            "zeros-not-in-max",
            Params {
                zeros_in_max: false,
                ..h
            },
        ),
        (
            "no-zeros-in-max",
            Params {
                zeros_in_max: false,
                zero_c_in_max: false,
                ..h
            },
        ),
        ("frac24", Params { frac_bits: 24, ..h }),
        ("frac26", Params { frac_bits: 26, ..h }),
        ("frac27", Params { frac_bits: 27, ..h }),
        ("k16-as-2x8", Params { group: 8, ..h }),
        ("k16-as-4x4", Params { group: 4, ..h }),
        (
            "rne-final",
            Params {
                round: Round::Rne,
                ..h
            },
        ),
        (
            "overflow-saturates",
            Params {
                overflow_inf: false,
                ..h
            },
        ),
        ("ampere(24,2x8)", Params::AMPERE),
        ("hopper-measured", Params::HOPPER_MEASURED),
    ];
    // The second counterexample (subnormal sums, under no-zeros-in-max): a fixed finest bit, or
    // fewer bits below the maximum.
    let nz = Params {
        zeros_in_max: false,
        zero_c_in_max: false,
        ..h
    };
    for (name, lsb) in [
        ("nz-floor-157", -157),
        ("nz-floor-158", -158),
        ("nz-floor-159", -159),
        ("nz-floor-160", -160),
        ("nz-floor-161", -161),
    ] {
        // nz-floor-158 is Params::HOPPER_MEASURED
        v.push((name, Params { min_lsb: lsb, ..nz }));
    }
    for (name, f) in [("nz-frac22", 22), ("nz-frac23", 23), ("nz-frac24", 24)] {
        v.push((name, Params { frac_bits: f, ..nz }));
    }
    v
}

#[derive(Default, Clone)]
struct ModeStats {
    cases: u64,
    mismatches: u64,
    /// Both NaN, different bits.
    nan_payload: u64,
    /// +0 vs -0.
    zero_sign: u64,
    /// Finite, same sign, 1 ulp apart.
    one_ulp: u64,
}

struct Mismatch {
    index: u64,
    mode: Mode,
    tile: u64,
    row: usize,
    col: usize,
    a: [u16; 16],
    b: [u16; 16],
    c: u32,
    hw: u32,
    model: u32,
}

fn hx16(v: &[u16]) -> String {
    v.iter()
        .map(|x| format!("{x:04x}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn classify(s: &mut ModeStats, hw: u32, m: u32) {
    s.mismatches += 1;
    let isnan = |b: u32| b & 0x7FFF_FFFF > 0x7F80_0000;
    if isnan(hw) && isnan(m) {
        s.nan_payload += 1;
    } else if hw & 0x7FFF_FFFF == 0 && m & 0x7FFF_FFFF == 0 {
        s.zero_sign += 1;
    } else if (hw ^ m) >> 31 == 0 && hw.abs_diff(m) == 1 {
        s.one_ulp += 1;
    }
}

fn flatten(tiles: &[Tile]) -> (Vec<u16>, Vec<u16>, Vec<u32>) {
    let mut a = Vec::with_capacity(tiles.len() * 256);
    let mut b = Vec::with_capacity(tiles.len() * 128);
    let mut c = Vec::with_capacity(tiles.len() * 128);
    for t in tiles {
        t.a.iter().for_each(|r| a.extend_from_slice(r));
        t.b.iter().for_each(|r| b.extend_from_slice(r));
        t.c.iter().for_each(|r| c.extend_from_slice(r));
    }
    (a, b, c)
}

/// The device, or the model standing in for it (`--dry-run`).
enum Hw {
    Gpu(Gpu),
    Model,
}

impl Hw {
    fn name(&self) -> String {
        match self {
            Hw::Gpu(g) => g.name.clone(),
            Hw::Model => "DRY RUN (the CPU model stands in for the GPU)".into(),
        }
    }
    fn run_mma(&self, a: &[u16], b: &[u16], c: &[u32], model: &Params) -> Result<Vec<u32>, Env> {
        match self {
            Hw::Gpu(g) => g.run_mma(a, b, c),
            Hw::Model => Ok((0..c.len())
                .into_par_iter()
                .map(|i| {
                    let (t, r, col) = (i / 128, (i % 128) / 8, i % 8);
                    let aa: &[u16; 16] = a[t * 256 + r * 16..][..16].try_into().unwrap();
                    let bb: &[u16; 16] = b[t * 128 + col * 16..][..16].try_into().unwrap();
                    mma_elem(aa, bb, c[i], model)
                })
                .collect()),
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn verify(
    json_out: bool,
    cases_n: u64,
    seed: u64,
    batch: u64,
    max_s: f64,
    vcases: u64,
    dry: bool,
    model: Params,
    dump: Option<(std::path::PathBuf, usize)>,
) -> Result<bool, Env> {
    let mut dumped: Vec<Mismatch> = Vec::new();
    let dump_max = dump.as_ref().map_or(0, |d| d.1);
    let t0 = Instant::now();
    let gpu = if dry {
        Hw::Model
    } else {
        Hw::Gpu(Gpu::open()?)
    };
    eprintln!("device: {}", gpu.name());
    // 1. smoke: small integers, exact under any model; a mismatch is a harness layout bug
    let smoke = cases::smoke_tile();
    let (a, b, c) = flatten(std::slice::from_ref(&smoke));
    let d = gpu.run_mma(&a, &b, &c, &model)?;
    let mut smoke_bad = 0;
    for i in 0..16 {
        for j in 0..8 {
            if d[i * 8 + j] != mma_elem(&smoke.a[i], &smoke.b[j], smoke.c[i][j], &model) {
                smoke_bad += 1;
            }
        }
    }
    if smoke_bad > 0 {
        let msg = format!("SMOKE FAILED: {smoke_bad}/128 small-integer outputs differ: the harness's fragment layout is wrong (not a model result)");
        if json_out {
            println!(
                "{}",
                json!({"command": "verify", "smoke_ok": false, "error": msg})
            );
        } else {
            println!("{msg}");
        }
        return Ok(false);
    }
    // 2. the tiles
    let vars = variants();
    let tiles_total = cases_n.div_ceil(128);
    let mut stats: BTreeMap<&'static str, ModeStats> = BTreeMap::new();
    let mut var_bad = vec![0u64; vars.len()];
    let mut var_cases = 0u64;
    let mut first: Option<Mismatch> = None;
    let mut nan_patterns: BTreeMap<u32, u64> = BTreeMap::new();
    let mut done = 0u64;
    let mut stopped_early = false;
    let mut gpu_s = 0.0;
    while done < tiles_total {
        if t0.elapsed().as_secs_f64() > max_s {
            stopped_early = true;
            break;
        }
        let nt = batch.min(tiles_total - done);
        let gen: Vec<(Mode, Tile)> = (done..done + nt)
            .into_par_iter()
            .map(|i| cases::tile(seed, i))
            .collect();
        let tiles: Vec<Tile> = gen.iter().map(|(_, t)| t.clone()).collect();
        let (a, b, c) = flatten(&tiles);
        let tg = Instant::now();
        let d = gpu.run_mma(&a, &b, &c, &model)?;
        gpu_s += tg.elapsed().as_secs_f64();
        let score_variants = done * 128 < vcases;
        // per tile: per-mode stats, variant misses, first mismatch, NaN patterns
        type Part = (
            Vec<(Mode, ModeStats)>,
            Vec<u64>,
            Option<Mismatch>,
            BTreeMap<u32, u64>,
            Vec<Mismatch>,
        );
        let want_dump = dumped.len() < dump_max;
        let part: Part = (0..nt as usize)
            .into_par_iter()
            .fold(
                || {
                    (
                        Vec::new(),
                        vec![0u64; vars.len()],
                        None,
                        BTreeMap::new(),
                        Vec::new(),
                    )
                },
                |mut acc: Part, ti| {
                    let (mode, t) = &gen[ti];
                    let mut s = ModeStats::default();
                    for i in 0..16 {
                        for j in 0..8 {
                            let hw = d[ti * 128 + i * 8 + j];
                            let m = mma_elem(&t.a[i], &t.b[j], t.c[i][j], &model);
                            s.cases += 1;
                            if hw & 0x7FFF_FFFF > 0x7F80_0000 {
                                *acc.3.entry(hw).or_insert(0) += 1;
                            }
                            if hw != m {
                                classify(&mut s, hw, m);
                                let index = (done + ti as u64) * 128 + (i * 8 + j) as u64;
                                if want_dump && acc.4.len() < dump_max {
                                    acc.4.push(Mismatch {
                                        index,
                                        mode: *mode,
                                        tile: done + ti as u64,
                                        row: i,
                                        col: j,
                                        a: t.a[i],
                                        b: t.b[j],
                                        c: t.c[i][j],
                                        hw,
                                        model: m,
                                    });
                                }
                                if acc.2.as_ref().is_none_or(|f: &Mismatch| index < f.index) {
                                    acc.2 = Some(Mismatch {
                                        index,
                                        mode: *mode,
                                        tile: done + ti as u64,
                                        row: i,
                                        col: j,
                                        a: t.a[i],
                                        b: t.b[j],
                                        c: t.c[i][j],
                                        hw,
                                        model: m,
                                    });
                                }
                            }
                            if score_variants {
                                for (v, (_, p)) in vars.iter().enumerate() {
                                    if mma_elem(&t.a[i], &t.b[j], t.c[i][j], p) != hw {
                                        acc.1[v] += 1;
                                    }
                                }
                            }
                        }
                    }
                    acc.0.push((*mode, s));
                    acc
                },
            )
            .reduce(
                || {
                    (
                        Vec::new(),
                        vec![0u64; vars.len()],
                        None,
                        BTreeMap::new(),
                        Vec::new(),
                    )
                },
                |mut x, y| {
                    x.0.extend(y.0);
                    x.4.extend(y.4);
                    for (a, b) in x.1.iter_mut().zip(&y.1) {
                        *a += b;
                    }
                    x.2 = match (x.2, y.2) {
                        (Some(p), Some(q)) => Some(if p.index <= q.index { p } else { q }),
                        (p, q) => p.or(q),
                    };
                    for (k, v) in y.3 {
                        *x.3.entry(k).or_insert(0) += v;
                    }
                    x
                },
            );
        for (mode, s) in part.0 {
            let e = stats.entry(mode.name()).or_default();
            e.cases += s.cases;
            e.mismatches += s.mismatches;
            e.nan_payload += s.nan_payload;
            e.zero_sign += s.zero_sign;
            e.one_ulp += s.one_ulp;
        }
        if score_variants {
            var_cases += nt * 128;
            for (a, b) in var_bad.iter_mut().zip(&part.1) {
                *a += b;
            }
        }
        if first.is_none() {
            first = part.2;
        }
        if want_dump {
            let mut more = part.4;
            more.sort_by_key(|m| m.index);
            more.truncate(dump_max - dumped.len());
            dumped.extend(more);
        }
        for (k, v) in part.3 {
            *nan_patterns.entry(k).or_insert(0) += v;
        }
        done += nt;
    }
    let total: u64 = stats.values().map(|s| s.cases).sum();
    if let Some((path, _)) = &dump {
        use std::io::Write;
        let write = || -> std::io::Result<()> {
            let mut w = std::io::BufWriter::new(std::fs::File::create(path)?);
            writeln!(
                w,
                "# case mode c hardware model a[0..16] b[0..16] (hex; seed {seed:#x})"
            )?;
            for m in &dumped {
                writeln!(
                    w,
                    "{} {} {:08x} {:08x} {:08x} {} {}",
                    m.index,
                    m.mode.name(),
                    m.c,
                    m.hw,
                    m.model,
                    hx16(&m.a).replace(' ', ","),
                    hx16(&m.b).replace(' ', ",")
                )?;
            }
            w.flush()
        };
        if let Err(e) = write() {
            return Err(Env(format!("--dump {}: {e}", path.display())));
        }
        eprintln!("dumped {} mismatches to {}", dumped.len(), path.display());
    }
    let bad: u64 = stats.values().map(|s| s.mismatches).sum();
    let secs = t0.elapsed().as_secs_f64();
    if json_out {
        let modes: serde_json::Map<String, serde_json::Value> = MODES
            .iter()
            .filter_map(|m| stats.get(m.name()).map(|s| (m, s)))
            .map(|(m, s)| {
                (
                    m.name().to_string(),
                    json!({"cases": s.cases, "mismatches": s.mismatches, "nan_payload": s.nan_payload, "zero_sign": s.zero_sign, "one_ulp": s.one_ulp}),
                )
            })
            .collect();
        let v: Vec<_> = vars
            .iter()
            .zip(&var_bad)
            .map(|((n, _), b)| json!({"variant": n, "cases": var_cases, "mismatches": b}))
            .collect();
        let f = first.as_ref().map(|f| {
            json!({"index": f.index, "mode": f.mode.name(), "tile": f.tile, "row": f.row, "col": f.col,
                   "a": hx16(&f.a), "b": hx16(&f.b), "c": format!("{:08x}", f.c),
                   "hw": format!("{:08x}", f.hw), "model": format!("{:08x}", f.model)})
        });
        let nans: Vec<_> = nan_patterns
            .iter()
            .map(|(k, v)| json!({"bits": format!("{k:08x}"), "count": v}))
            .collect();
        println!(
            "{}",
            json!({"command": "verify", "device": gpu.name(), "model": format!("{model:?}"), "smoke_ok": true, "cases": total, "requested": cases_n,
                   "mismatches": bad, "stopped_early": stopped_early, "seconds": secs, "gpu_seconds": gpu_s,
                   "modes": modes, "variants": v, "first_mismatch": f, "hw_nan_patterns": nans})
        );
    } else {
        println!(
            "verify: {} on {} (seed {seed:#x}), {:.1} s ({:.1} s on the GPU incl. copies)\nmodel: {model:?}",
            gpu.name(),
            if stopped_early {
                "TIME LIMIT: partial run"
            } else {
                "all requested cases"
            },
            secs,
            gpu_s
        );
        println!(
            "{:<14} {:>12} {:>10} {:>9} {:>9} {:>8}",
            "mode", "cases", "mismatch", "nan-bits", "zero-sgn", "1-ulp"
        );
        for m in MODES {
            if let Some(s) = stats.get(m.name()) {
                println!(
                    "{:<14} {:>12} {:>10} {:>9} {:>9} {:>8}",
                    m.name(),
                    s.cases,
                    s.mismatches,
                    s.nan_payload,
                    s.zero_sign,
                    s.one_ulp
                );
            }
        }
        println!("{:<14} {:>12} {:>10}", "TOTAL", total, bad);
        println!(
            "hardware NaN bit patterns: {}",
            nan_patterns
                .iter()
                .map(|(k, v)| format!("{k:08x} x{v}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        println!("variants scored on the first {var_cases} cases (mismatches vs hardware; 0 = this variant explains every case):");
        for ((n, _), b) in vars.iter().zip(&var_bad) {
            println!("  {n:<20} {b}");
        }
        match &first {
            None => println!("RESULT: every bit equal ({total} cases)"),
            Some(f) => {
                println!("RESULT: MISMATCH; first counterexample: case {} (tile {}, row {}, col {}, mode {})", f.index, f.tile, f.row, f.col, f.mode.name());
                println!("  a (row, k=0..15)  {}", hx16(&f.a));
                println!("  b (col, k=0..15)  {}", hx16(&f.b));
                println!(
                    "  c {:08x}  hardware {:08x}  model {:08x}",
                    f.c, f.hw, f.model
                );
                for (n, p) in &vars {
                    println!(
                        "    variant {n:<20} gives {:08x}",
                        mma_elem(&f.a, &f.b, f.c, p)
                    );
                }
            }
        }
    }
    Ok(bad == 0)
}

/// `mma-check replay`: see [`Cmd::Replay`]. An unreadable or malformed dump is reported with
/// its file (and line), exit 3 like the other failures to read a run's data.
fn replay(
    json_out: bool,
    dump: &std::path::Path,
    cases_n: u64,
    seed: u64,
    run_model: Params,
    model: Params,
) -> Result<bool, Env> {
    let text =
        std::fs::read_to_string(dump).map_err(|e| Env(format!("{}: {e}", dump.display())))?;
    // case -> (hardware, the run model's value)
    let mut hw_of: std::collections::HashMap<u64, (u32, u32)> = std::collections::HashMap::new();
    for (n, line) in text.lines().enumerate() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        let parse = || -> Option<(u64, u32, u32)> {
            Some((
                f.first()?.parse().ok()?,
                u32::from_str_radix(f.get(3)?, 16).ok()?,
                u32::from_str_radix(f.get(4)?, 16).ok()?,
            ))
        };
        let (i, h, m) = parse().ok_or_else(|| {
            Env(format!(
                "{} line {}: not `case mode c hardware model a b`",
                dump.display(),
                n + 1
            ))
        })?;
        hw_of.insert(i, (h, m));
    }
    let t0 = Instant::now();
    let tiles = cases_n.div_ceil(128);
    // (cases, model differs from the hardware, dumped cases the run model did not reproduce)
    let (checked, bad, stale) = (0..tiles)
        .into_par_iter()
        .map(|ti| {
            let (_, t) = cases::tile(seed, ti);
            let (mut c, mut b, mut s) = (0u64, 0u64, 0u64);
            for i in 0..16 {
                for j in 0..8 {
                    let index = ti * 128 + (i * 8 + j) as u64;
                    let run = mma_elem(&t.a[i], &t.b[j], t.c[i][j], &run_model);
                    let hw = match hw_of.get(&index) {
                        Some(&(h, m)) => {
                            if m != run {
                                s += 1;
                            }
                            h
                        }
                        None => run,
                    };
                    c += 1;
                    if mma_elem(&t.a[i], &t.b[j], t.c[i][j], &model) != hw {
                        b += 1;
                    }
                }
            }
            (c, b, s)
        })
        .reduce(|| (0, 0, 0), |x, y| (x.0 + y.0, x.1 + y.1, x.2 + y.2));
    let secs = t0.elapsed().as_secs_f64();
    if json_out {
        println!(
            "{}",
            json!({"command": "replay", "dump": dump.display().to_string(), "cases": checked, "dumped": hw_of.len(),
                   "model": format!("{model:?}"), "mismatches": bad, "stale_dump_lines": stale, "seconds": secs})
        );
    } else {
        println!(
            "replay: {} cases of seed {seed:#x} ({} from the dump), {:.1} s",
            checked,
            hw_of.len(),
            secs
        );
        println!("model: {model:?}");
        if stale > 0 {
            println!("WARNING: {stale} dumped cases where --run-model does not give the dump's model value: wrong --run-model, --seed or --cases?");
        }
        if bad == 0 {
            println!("RESULT: the model explains every case ({checked})");
        } else {
            println!("RESULT: {bad} cases differ from the hardware");
        }
    }
    Ok(bad == 0 && stale == 0)
}

fn gauss(r: &mut cases::Rng) -> f32 {
    let u1 = ((r.next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    let u2 = (r.next() >> 11) as f64 / (1u64 << 53) as f64;
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}

/// Weights (BF16, ~N(0, 0.02)) and activations (f32, ~N(0,1) times a per-token scale); with
/// `wide`, activations spread over 2^-60..2^60 with exact-BF16 values, zeros and cancelling pairs.
fn gemm_data(m: usize, n: usize, k: usize, seed: u64, wide: bool) -> (Vec<u16>, Vec<f32>) {
    let w: Vec<u16> = (0..m)
        .into_par_iter()
        .flat_map_iter(|r| {
            let mut g = cases::Rng::new(seed, r as u64);
            (0..k).map(move |_| ((gauss(&mut g) * 0.02).to_bits() >> 16) as u16)
        })
        .collect();
    let x: Vec<f32> = (0..n)
        .into_par_iter()
        .flat_map_iter(|t| {
            let mut g = cases::Rng::new(seed ^ 0xABCD, t as u64);
            let scale = 2f32.powi(g.range(-4, 6) as i32);
            (0..k).map(move |_| {
                let v = gauss(&mut g) * scale;
                if !wide {
                    return v;
                }
                match g.below(8) {
                    0 => 0.0,
                    1 => f32::from_bits(v.to_bits() & 0xFFFF_0000),
                    2 => v * 2f32.powi(g.range(-60, 60) as i32),
                    3 => -v,
                    _ => v,
                }
            })
        })
        .collect();
    (w, x)
}

fn gemm_bench(
    json_out: bool,
    m: usize,
    ns: &[usize],
    ks: &[usize],
    sample: usize,
) -> Result<bool, Env> {
    let gpu = Gpu::open()?;
    let p = Params::HOPPER;
    let mut rows = Vec::new();
    let mut all_ok = true;
    // bit checks: every output of small shapes (normal and wide data), then the bench shapes sampled
    let mut checks = Vec::new();
    for (mm, nn, kk, wide) in [
        (256, 64, 768, false),
        (256, 64, 768, true),
        (2048, 128, 768, false),
        (128, 64, 2048, true),
    ] {
        let (w, x) = gemm_data(mm, nn, kk, 11 + mm as u64 + kk as u64, wide);
        let mut g = Gemm::new(&gpu, &w, &x, mm, nn, kk)?;
        g.launch()?;
        let hw = g.output()?;
        let cpu = model::gemm_v2(&w, &x, mm, nn, kk, &p);
        let bad = hw
            .iter()
            .zip(&cpu)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        let first = hw
            .iter()
            .zip(&cpu)
            .position(|(a, b)| a.to_bits() != b.to_bits());
        all_ok &= bad == 0;
        checks.push((
            format!("{mm}x{nn}x{kk}{}", if wide { " wide" } else { "" }),
            mm * nn,
            bad,
            first.map(|i| (i, hw[i], cpu[i])),
        ));
    }
    for &k in ks {
        for &n in ns {
            let (w, x) = gemm_data(m, n, k, 7 + n as u64 + k as u64, false);
            let mut g = Gemm::new(&gpu, &w, &x, m, n, k)?;
            let reps = ((2e9 / (2.0 * (m * n * k) as f64 * 3.0 / 200e12)) as usize).clamp(5, 2000);
            let reps = reps
                .min((0.3 / (2.0 * (m * n * k) as f64 / 20e12)) as usize)
                .max(5);
            let ms = g.time(reps)?;
            let hw = g.output()?;
            let mut r = cases::Rng::new(99, (n * k) as u64);
            let mut bad = 0;
            for _ in 0..sample {
                let (t, row) = (r.below(n as u64) as usize, r.below(m as u64) as usize);
                let want = model::dot_v2(&w[row * k..(row + 1) * k], &x[t * k..(t + 1) * k], &p);
                if want.to_bits() != hw[t * m + row].to_bits() {
                    bad += 1;
                }
            }
            all_ok &= bad == 0;
            let tflops = 2.0 * (m * n * k) as f64 / (ms * 1e-3) / 1e12;
            rows.push((m, n, k, ms, tflops, reps, sample, bad));
        }
    }
    if json_out {
        let c: Vec<_> = checks.iter().map(|(s, n, b, f)| json!({"shape": s, "outputs": n, "mismatches": b,
            "first": f.map(|(i, h, c)| json!({"index": i, "hw": format!("{:08x}", h.to_bits()), "model": format!("{:08x}", c.to_bits())}))})).collect();
        let r: Vec<_> = rows.iter().map(|&(m, n, k, ms, tf, reps, s, b)| json!({"m": m, "n": n, "k": k, "ms": ms, "tflops": tf, "tensor_tflops": 3.0 * tf, "reps": reps, "sampled": s, "mismatches": b})).collect();
        println!(
            "{}",
            json!({"command": "gemm-bench", "device": gpu.name, "checks": c, "bench": r, "ok": all_ok})
        );
    } else {
        println!("gemm-bench: {} -- contract-v2 prototype (mma.sync m16n8k16 BF16, 3-way split of f32 activations, fixed K order, no split-K; split kernel included in the time)", gpu.name);
        println!("bit check vs the CPU model (every output):");
        for (s, n, b, f) in &checks {
            print!("  {s:<20} {n:>8} outputs  {b} mismatches");
            if let Some((i, h, c)) = f {
                print!(
                    "  first at {i}: hw {:08x} model {:08x}",
                    h.to_bits(),
                    c.to_bits()
                );
            }
            println!();
        }
        println!(
            "{:>6} {:>6} {:>6} {:>10} {:>9} {:>12} {:>14}",
            "M", "N", "K", "ms", "TFLOP/s", "MMA TFLOP/s", "sampled-bad"
        );
        for &(m, n, k, ms, tf, _, s, b) in &rows {
            println!(
                "{m:>6} {n:>6} {k:>6} {ms:>10.4} {tf:>9.2} {:>12.2} {:>9}/{s}",
                3.0 * tf,
                b
            );
        }
        println!(
            "(TFLOP/s counts 2*M*N*K useful flops; MMA TFLOP/s is 3x that, the tensor-core work)"
        );
        println!(
            "RESULT: {}",
            if all_ok {
                "GEMM bit-equal to the CPU model"
            } else {
                "GEMM MISMATCH vs the CPU model"
            }
        );
    }
    Ok(all_ok)
}

fn time_per_elem(elems: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best * 1e9 / elems as f64
}

fn cpu_bench(json_out: bool, k: usize, rows: usize, mem_bytes: usize) -> bool {
    use tarfa_core::numerics::{Kernel, SimdPath};
    let (w, x) = gemm_data(rows, 1, k, 5, false);
    let mut out = vec![0f32; rows];
    let mut res: Vec<(String, f64)> = Vec::new();
    for path in [SimdPath::Scalar, SimdPath::Avx2, SimdPath::Avx512] {
        if let Ok(kern) = Kernel::new(path) {
            let px = kern.prepare(&x);
            let ns = time_per_elem(rows * k, || {
                for _ in 0..20 {
                    kern.dot_bf16_rows(&w, k, &px, &mut out);
                    std::hint::black_box(&out);
                }
            }) / 20.0;
            res.push((format!("fma-{} (cache)", path.name()), ns));
        }
    }
    let ns = time_per_elem(rows * k, || {
        for (r, o) in out.iter_mut().enumerate() {
            *o = model::dot_v2(&w[r * k..(r + 1) * k], &x, &Params::HOPPER);
        }
        std::hint::black_box(&out);
    });
    res.push(("v2-model-scalar (cache)".into(), ns));
    let prep = tarfa_mma::simd::Prepared::new(&x);
    let ns = time_per_elem(rows * k, || {
        for (r, o) in out.iter_mut().enumerate() {
            *o = tarfa_mma::simd::dot_v2(&w[r * k..(r + 1) * k], &prep);
        }
        std::hint::black_box(&out);
    });
    res.push(("v2-emulator-avx512 (cache)".into(), ns));
    let packs: Vec<tarfa_mma::simd::Rows16> = (0..rows / 16)
        .map(|i| tarfa_mma::simd::Rows16::new(&w[i * 16 * k..(i + 1) * 16 * k], k))
        .collect();
    let ns = time_per_elem(packs.len() * 16 * k, || {
        for pk in &packs {
            std::hint::black_box(tarfa_mma::simd::dot_rows16(pk, &prep));
        }
    });
    res.push(("v2-emulator-avx512-rows16 (cache)".into(), ns));
    let packs8: Vec<tarfa_mma::simd::Rows8> = (0..rows / 8)
        .map(|i| tarfa_mma::simd::Rows8::new(&w[i * 8 * k..(i + 1) * 8 * k], k))
        .collect();
    let ns = time_per_elem(packs8.len() * 8 * k, || {
        for pk in &packs8 {
            std::hint::black_box(tarfa_mma::simd::dot_rows8(pk, &prep));
        }
    });
    res.push(("v2-emulator-avx2-rows8 (cache)".into(), ns));
    let ok8 = packs8.iter().enumerate().all(|(i, pk)| {
        let got = tarfa_mma::simd::dot_rows8(pk, &prep);
        (0..8).all(|j| {
            let r = i * 8 + j;
            got[j].to_bits() == model::dot_v2(&w[r * k..(r + 1) * k], &x, &Params::HOPPER).to_bits()
        })
    });
    let ok16 = packs.iter().enumerate().all(|(i, pk)| {
        let got = tarfa_mma::simd::dot_rows16(pk, &prep);
        (0..16).all(|j| {
            let r = i * 16 + j;
            got[j].to_bits() == model::dot_v2(&w[r * k..(r + 1) * k], &x, &Params::HOPPER).to_bits()
        })
    });
    let ok = ok16
        && ok8
        && (0..rows).all(|r| {
            tarfa_mma::simd::dot_v2(&w[r * k..(r + 1) * k], &prep).to_bits()
                == model::dot_v2(&w[r * k..(r + 1) * k], &x, &Params::HOPPER).to_bits()
        });
    // today's path from memory: one thread, weights far larger than the caches
    let big_rows = mem_bytes / 2 / k;
    let wbig: Vec<u16> = (0..big_rows * k).map(|i| w[i % w.len()]).collect();
    let kern = Kernel::best();
    let px = kern.prepare(&x);
    let mut outb = vec![0f32; big_rows];
    let ns_mem = time_per_elem(big_rows * k, || {
        kern.dot_bf16_rows(&wbig, k, &px, &mut outb);
        std::hint::black_box(&outb);
    });
    res.push((
        format!("fma-{} (DRAM, 1 thread)", kern.path().name()),
        ns_mem,
    ));
    let gbs = 2.0 / ns_mem;
    if json_out {
        let r: serde_json::Map<_, _> = res.iter().map(|(n, v)| (n.clone(), json!(v))).collect();
        println!(
            "{}",
            json!({"command": "cpu-bench", "k": k, "rows": rows, "ns_per_element": r, "dram_gb_per_s_1thread": gbs, "emulator_equals_model": ok})
        );
    } else {
        println!("cpu-bench: K={k}, {rows} rows (in cache) unless marked DRAM; ns per dot-product element (best of 5)");
        for (n, v) in &res {
            println!("  {n:<30} {v:>8.3} ns/elem  {:>8.2} Gelem/s", 1.0 / v);
        }
        println!("  DRAM read rate of the FMA path, 1 thread: {gbs:.1} GB/s (2 bytes per element)");
        println!("  emulator == model on these rows: {ok}");
    }
    ok
}
