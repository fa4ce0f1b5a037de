//! The four invariant checks. Each runs `tarfa-run generate` in fresh processes, reads what the
//! runtime wrote, compares it with what the bundle and the oracle say, and returns one
//! [`Outcome`]: what was compared, and whether the invariant held.
//!
//! 1. [`weights`]: every tensor and expert the run used was verified against manifest.toml.
//! 2. [`router`]: top-k is the config's num_experts_per_tok in every MoE layer, at every position.
//! 3. [`f32_logits`]: the f32 path meets the oracle tolerance; a bf16-before-lm_head arm does not.
//! 4. [`invariance`]: every optional feature leaves every logit bit-identical.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context as _};

use crate::arms::{self, resolve_arg, Arm, ARMS, BASELINE};
use crate::bundle::{Bundle, Region};
use crate::logits::{compare_bytes, rel_err, LogitsFile, OraclePrompt};
use crate::report::{check_report, rehash_bundle, VerifyReport};
use crate::runner::{Finished, Generate, Runtime, EXIT_ENVIRONMENT, EXIT_VERIFICATION};
use crate::trace::{check_trace, Trace};
use crate::workload::{default_prompts, random_prompt, Oracle, Prompt};

/// The oracle's tolerance: per row, `max|logit - ref| <= 1e-4 * max|ref|`.
pub const ORACLE_TOLERANCE: f64 = 1e-4;

/// How a check ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// The invariant held on everything compared.
    Held,
    /// The invariant was broken, or the runtime could not show it.
    Failed,
    /// Nothing to compare (e.g. no oracle reference for this bundle); says why.
    Skipped,
    /// The environment failed (the runtime could not start, exited 3, a file could not be written).
    Environment,
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Status::Held => "PASS",
            Status::Failed => "FAIL",
            Status::Skipped => "SKIP",
            Status::Environment => "ERROR",
        })
    }
}

/// One check's result: a line saying what was compared, and detail lines.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub name: &'static str,
    pub status: Status,
    pub summary: String,
    pub details: Vec<String>,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:<5} {:<11} {}", self.status, self.name, self.summary)?;
        for d in &self.details {
            write!(f, "\n      {d}")?;
        }
        Ok(())
    }
}

/// Why a check stopped early.
#[derive(Debug)]
struct Stop {
    status: Status,
    msg: String,
}

impl Stop {
    fn fail(msg: impl Into<String>) -> Stop {
        Stop {
            status: Status::Failed,
            msg: msg.into(),
        }
    }
    fn env(msg: impl Into<String>) -> Stop {
        Stop {
            status: Status::Environment,
            msg: msg.into(),
        }
    }
}

impl From<anyhow::Error> for Stop {
    fn from(e: anyhow::Error) -> Stop {
        Stop::env(format!("{e:#}"))
    }
}

/// What the checks share: the runtime, the bundle, the oracle (when the bundle was converted
/// from an oracle fixture) and a scratch directory removed on drop.
pub struct Context {
    pub runtime: Runtime,
    pub bundle: Bundle,
    pub oracle: Option<Oracle>,
    pub scratch: tempfile::TempDir,
    /// The tamper probes copy the bundle; they are skipped above this many bytes of model.jnf.
    pub tamper_limit: u64,
    /// Re-hash the regions the runtime reports, from model.jnf, against the manifest.
    pub rehash: bool,
    /// Arms given on the command line, run after the table's.
    pub extra_arms: Vec<(String, Vec<String>)>,
    /// Run the arms of [`ARMS`] (off: only the command line's).
    pub table_arms: bool,
    /// Seed of the random prompts.
    pub seed: u64,
}

impl Context {
    pub fn new(
        runtime: Runtime,
        bundle: Bundle,
        oracle: Option<Oracle>,
    ) -> anyhow::Result<Context> {
        Ok(Context {
            runtime,
            bundle,
            oracle,
            scratch: tempfile::Builder::new()
                .prefix("tarfa-validate-")
                .tempdir()?,
            tamper_limit: 512 << 20,
            rehash: true,
            extra_arms: Vec::new(),
            table_arms: true,
            seed: 1,
        })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.scratch.path().join(name)
    }

    /// The prompts the checks run: the oracle's, else seeded random ones.
    pub fn prompts(&self) -> Vec<Prompt> {
        match &self.oracle {
            Some(o) => o.as_prompts(),
            None => default_prompts(&self.bundle, self.seed),
        }
    }

    fn generate(&self, p: &Prompt) -> Generate {
        Generate::new(&self.bundle.dir, &p.tokens, p.new_tokens)
    }

    /// Run and require exit 0; exit 3 or a failure to start is the environment's fault.
    fn run_ok(&self, g: &Generate, what: &str) -> Result<Finished, Stop> {
        let f = self
            .runtime
            .generate(g)
            .map_err(|e| Stop::env(format!("{what}: {e:#}")))?;
        if f.ok() {
            return Ok(f);
        }
        let msg = format!("{what}: {}", f.describe());
        Err(if f.code == Some(EXIT_ENVIRONMENT) {
            Stop::env(msg)
        } else {
            Stop::fail(msg)
        })
    }
}

fn finish(name: &'static str, r: Result<Outcome, Stop>) -> Outcome {
    r.unwrap_or_else(|s| Outcome {
        name,
        status: s.status,
        summary: s.msg,
        details: Vec::new(),
    })
}

fn read_logits(path: &Path, ctx: &Context, what: &str) -> Result<LogitsFile, Stop> {
    let f =
        LogitsFile::read(path).map_err(|e| Stop::fail(format!("{what}: logits file: {e:#}")))?;
    if f.root_digest.as_deref() != Some(ctx.bundle.manifest.root_digest.as_str()) {
        return Err(Stop::fail(format!(
            "{what}: the logits file's root_digest {:?} is not the bundle's {}",
            f.root_digest, ctx.bundle.manifest.root_digest
        )));
    }
    Ok(f)
}

// ---------------------------------------------------------------------------------------------
// 1. Weights

/// Check 1: run once with `--verify-report` and `--router-trace`; cross-check the report with
/// manifest.toml and with the experts the trace says were used; re-hash the reported regions
/// from model.jnf; then flip one byte of a used expert and of a non-expert tensor in a copy of
/// the bundle, and require the runtime to refuse each with exit 1.
pub fn weights(ctx: &Context) -> Outcome {
    finish("weights", weights_inner(ctx))
}

fn weights_inner(ctx: &Context) -> Result<Outcome, Stop> {
    let b = &ctx.bundle;
    let prompt = ctx
        .prompts()
        .into_iter()
        .max_by_key(|p| p.tokens.len().min(64))
        .unwrap();
    let mut g = ctx.generate(&prompt);
    g.verify_report = Some(ctx.path("verify.json"));
    g.router_trace = Some(ctx.path("weights-trace.jsonl"));
    g.expect_root = Some(b.manifest.root_digest.clone());
    ctx.run_ok(&g, "run")?;
    let report =
        VerifyReport::read(&ctx.path("verify.json")).map_err(|e| Stop::fail(format!("{e:#}")))?;
    let trace_text = fs::read_to_string(ctx.path("weights-trace.jsonl")).context("router trace")?;
    let trace = Trace::parse(&trace_text).map_err(|e| Stop::fail(format!("{e:#}")))?;
    let used = trace.used_experts();
    let found = check_report(&report, &b.manifest, &used);

    let mut details = Vec::new();
    let mut failed = !found.held();
    if !found.held() {
        details.push(format!(
            "{} violations of the verify report:",
            found.violation_count
        ));
        details.extend(found.violations.iter().map(|v| format!("  {v}")));
    }
    if !b.config_attested {
        failed = true;
        details.push("config.json's SHA-256 is not the manifest's [[files]] record".into());
    }
    let mut rehashed = String::from("not re-hashed");
    if ctx.rehash {
        let (bytes, bad) = rehash_bundle(&b.jnf_path(), &report, &b.manifest)?;
        rehashed = format!("{} re-hashed from model.jnf", human_bytes(bytes));
        if !bad.is_empty() {
            failed = true;
            details.push(format!(
                "{} regions of model.jnf do not hash to the manifest:",
                bad.len()
            ));
            details.extend(bad.iter().take(8).map(|v| format!("  {v}")));
        }
    }

    // Tamper probes.
    let probes = tamper_probes(ctx, &g, &trace)?;
    for p in &probes.failures {
        failed = true;
        details.push(p.clone());
    }
    let summary = format!(
        "{} files + {} tensors + {} experts ({}) verified before use, each matching manifest.toml's digest and byte count \
         (root {} recomputed); all {} experts the router chose are covered; {}; tamper probes: {}",
        found.files,
        found.tensors,
        found.experts,
        human_bytes(found.bytes),
        b.short_root(),
        found.traced_experts,
        rehashed,
        probes.summary
    );
    Ok(Outcome {
        name: "weights",
        status: if failed { Status::Failed } else { Status::Held },
        summary,
        details,
    })
}

struct Probes {
    summary: String,
    failures: Vec<String>,
}

fn tamper_probes(ctx: &Context, g: &Generate, trace: &Trace) -> Result<Probes, Stop> {
    let b = &ctx.bundle;
    let jnf_len = fs::metadata(b.jnf_path()).context("model.jnf")?.len();
    if jnf_len > ctx.tamper_limit {
        return Ok(Probes {
            summary: format!(
                "skipped (model.jnf is {}, above the copy limit)",
                human_bytes(jnf_len)
            ),
            failures: Vec::new(),
        });
    }
    let regions = crate::bundle::jnf_regions(&b.jnf_path())?;
    // A used expert: the first route's first choice. A non-expert tensor: the final norm.
    let first = trace
        .routes
        .first()
        .ok_or_else(|| Stop::fail("the router trace has no routes"))?;
    let expert = b
        .manifest
        .expert_name(first.layer as u32, first.experts[0])
        .ok_or_else(|| Stop::fail("the first routed expert is not in the manifest"))?
        .to_string();
    let tensor = b
        .manifest
        .tensors
        .iter()
        .map(|t| t.name.as_str())
        .find(|n| n.ends_with("norm.weight") && !n.contains("layers."))
        .or_else(|| b.manifest.tensors.first().map(|t| t.name.as_str()))
        .ok_or_else(|| Stop::fail("the manifest lists no tensor"))?
        .to_string();
    let mut refused = Vec::new();
    let mut failures = Vec::new();
    for name in [&expert, &tensor] {
        let region = *regions
            .get(name.as_str())
            .ok_or_else(|| Stop::fail(format!("{name} is not in the model.jnf header")))?;
        let copy = ctx.path("tampered");
        let _ = fs::remove_dir_all(&copy);
        copy_bundle(&b.dir, &copy)?;
        flip_byte(&copy.join("model.jnf"), region)?;
        let mut t = g.clone();
        t.bundle = copy.clone();
        t.verify_report = None;
        t.router_trace = None;
        t.expect_root = None;
        t.logits_out = Some(ctx.path("tampered-logits.safetensors"));
        let f = ctx
            .runtime
            .generate(&t)
            .map_err(|e| Stop::env(format!("{e:#}")))?;
        if f.code == Some(EXIT_VERIFICATION) {
            refused.push(format!("{name} -> exit 1"));
        } else {
            failures.push(format!(
                "a flipped byte in {name} was not refused: {}",
                f.describe()
            ));
        }
        let _ = fs::remove_dir_all(&copy);
    }
    Ok(Probes {
        summary: if failures.is_empty() {
            format!("one flipped byte refused in {}", refused.join(", "))
        } else {
            format!("{} of 2 refused", refused.len())
        },
        failures,
    })
}

fn copy_bundle(from: &Path, to: &Path) -> Result<(), Stop> {
    fs::create_dir_all(to).context("create the tamper copy")?;
    for e in fs::read_dir(from).context("read the bundle")? {
        let e = e.context("read the bundle")?;
        if e.file_type().context("stat")?.is_file() {
            fs::copy(e.path(), to.join(e.file_name())).context("copy the bundle")?;
        }
    }
    Ok(())
}

/// Flip the low bit of the byte in the middle of `region`.
fn flip_byte(jnf: &Path, region: Region) -> Result<(), Stop> {
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(jnf)
        .context("open the copy")?;
    let at = region.offset + region.length / 2;
    let mut byte = [0u8];
    f.seek(SeekFrom::Start(at)).context("seek")?;
    f.read_exact(&mut byte).context("read")?;
    byte[0] ^= 1;
    f.seek(SeekFrom::Start(at)).context("seek")?;
    f.write_all(&byte).context("write")?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 2. Router

/// Check 2: run every prompt with `--router-trace`; every route of every MoE layer at every
/// position has the config's k distinct experts below E, probabilities in descending order,
/// weights as the family renormalises; with an oracle, the prefill top-k sets equal transformers'
/// (near ties excepted).
pub fn router(ctx: &Context) -> Outcome {
    finish("router", router_inner(ctx))
}

fn router_inner(ctx: &Context) -> Result<Outcome, Stop> {
    let cfg = &ctx.bundle.config;
    let mut routes = 0;
    let mut positions = 0;
    let mut worst = 0f64;
    let mut compared = 0;
    let mut ties = 0;
    let mut details = Vec::new();
    let prompts = ctx.prompts();
    for (i, p) in prompts.iter().enumerate() {
        let mut g = ctx.generate(p);
        g.router_trace = Some(ctx.path(&format!("trace-{i}.jsonl")));
        g.logits_out = Some(ctx.path(&format!("trace-logits-{i}.safetensors")));
        ctx.run_ok(&g, &p.label)?;
        let generated = read_logits(g.logits_out.as_ref().unwrap(), ctx, &p.label)?
            .tokens
            .len();
        let text = fs::read_to_string(g.router_trace.as_ref().unwrap()).context("router trace")?;
        let trace = Trace::parse(&text).map_err(|e| Stop::fail(format!("{}: {e:#}", p.label)))?;
        let oracle: Option<&OraclePrompt> = ctx.oracle.as_ref().map(|o| &o.prompts[i]);
        let f = check_trace(&trace, cfg, p.tokens.len(), generated, oracle);
        routes += f.routes;
        positions += f.positions;
        worst = worst.max(f.worst_weight_sum_error);
        compared += f.oracle_compared;
        ties += f.oracle_near_ties;
        if !f.held() {
            details.push(format!("{}: {} violations:", p.label, f.violation_count));
            details.extend(f.violations.iter().map(|v| format!("  {v}")));
        }
    }
    let renorm = if cfg.renormalizes {
        format!("weights renormalised, sums within {worst:.1e} of 1")
    } else {
        "weights = probs (no renormalisation)".to_string()
    };
    let oracle = if ctx.oracle.is_some() {
        format!("; prefill top-k sets equal transformers' at {compared} routes ({ties} near ties)")
    } else {
        String::new()
    };
    let summary = format!(
        "{} prompts, {} positions x {} MoE layers = {routes} routes: k = {} = num_experts_per_tok in each, \
         distinct ids < {}, probs descending, {renorm}{oracle}",
        prompts.len(),
        positions,
        cfg.moe_layers.len(),
        cfg.top_k,
        cfg.num_experts
    );
    Ok(Outcome {
        name: "router",
        status: if details.is_empty() {
            Status::Held
        } else {
            Status::Failed
        },
        summary,
        details,
    })
}

// ---------------------------------------------------------------------------------------------
// 3. f32 logits

/// How one run compares with the oracle.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OracleComparison {
    /// Rows compared (prefill rows plus generated rows up to the first differing token).
    pub rows: usize,
    /// The largest per-row relative error.
    pub worst: f64,
    /// Rows above the tolerance.
    pub rows_over: usize,
    /// The first generated step whose token differs from transformers' greedy token.
    pub first_token_difference: Option<usize>,
}

impl OracleComparison {
    pub fn passes(&self) -> bool {
        self.rows_over == 0 && self.first_token_difference.is_none()
    }
}

/// Compare a run's logits file with the oracle's prompt: the prefill rows, then the generated
/// rows up to and including the first step whose token differs (later rows follow a different
/// context and mean nothing).
pub fn compare_with_oracle(run: &LogitsFile, o: &OraclePrompt) -> Result<OracleComparison, String> {
    let mut c = OracleComparison::default();
    fn row(c: &mut OracleComparison, got: &[f32], want: &[f32]) {
        let e = rel_err(got, want);
        c.rows += 1;
        c.worst = c.worst.max(e);
        if e > ORACLE_TOLERANCE {
            c.rows_over += 1;
        }
    }
    let prefill = run
        .prefill_logits
        .as_ref()
        .ok_or("the logits file has no prefill_logits")?;
    if prefill.len() != o.prefill_logits.len() || prefill.cols != o.prefill_logits.cols {
        return Err(format!(
            "prefill_logits is {}x{}, the oracle's {}x{}",
            prefill.len(),
            prefill.cols,
            o.prefill_logits.len(),
            o.prefill_logits.cols
        ));
    }
    for t in 0..prefill.len() {
        row(&mut c, prefill.row(t), o.prefill_logits.row(t));
    }
    if run.tokens.len() != o.greedy.len() || run.logits.cols != o.step_logits.cols {
        return Err(format!(
            "{} generated rows of {} logits; the oracle has {} of {}",
            run.tokens.len(),
            run.logits.cols,
            o.greedy.len(),
            o.step_logits.cols
        ));
    }
    for j in 0..run.tokens.len() {
        row(&mut c, run.logits.row(j), o.step_logits.row(j));
        if run.tokens[j] != o.greedy[j] {
            c.first_token_difference = Some(j);
            break;
        }
    }
    Ok(c)
}

/// Check 3: the oracle prompts through the f32 path must meet the oracle's tolerance with the
/// same greedy tokens; the same prompts through `--invalid-bf16-before-lm-head` must miss it (or
/// change a token) on at least one prompt, which shows the check can tell the two apart.
pub fn f32_logits(ctx: &Context) -> Outcome {
    finish("f32-logits", f32_inner(ctx))
}

fn f32_inner(ctx: &Context) -> Result<Outcome, Stop> {
    let Some(oracle) = &ctx.oracle else {
        return Ok(Outcome {
            name: "f32-logits",
            status: Status::Skipped,
            summary: "no oracle reference for this bundle (give --reference FILE, or convert an oracle fixture)".into(),
            details: Vec::new(),
        });
    };
    let mut details = Vec::new();
    let (mut rows, mut worst, mut tokens) = (0usize, 0f64, 0usize);
    let mut f32_failed = false;
    let (mut bf16_caught, mut bf16_worst, mut bf16_tokens) = (0usize, 0f64, 0usize);
    for (i, (p, o)) in oracle.as_prompts().iter().zip(&oracle.prompts).enumerate() {
        for bf16 in [false, true] {
            let mut g = ctx.generate(p);
            g.prefill_logits = true;
            g.invalid_bf16_before_lm_head = bf16;
            let out = ctx.path(&format!(
                "oracle-{i}-{}.safetensors",
                if bf16 { "bf16" } else { "f32" }
            ));
            g.logits_out = Some(out.clone());
            let what = format!("{}{}", p.label, if bf16 { " (bf16 arm)" } else { "" });
            ctx.run_ok(&g, &what)?;
            let file = read_logits(&out, ctx, &what)?;
            let c =
                compare_with_oracle(&file, o).map_err(|e| Stop::fail(format!("{what}: {e}")))?;
            if !bf16 {
                rows += c.rows;
                worst = worst.max(c.worst);
                tokens += file.tokens.len();
                if !c.passes() {
                    f32_failed = true;
                    details.push(format!(
                        "{what}: {} rows over 1e-4 (worst {:.2e}){}",
                        c.rows_over,
                        c.worst,
                        c.first_token_difference
                            .map(|j| format!(", greedy token {j} differs"))
                            .unwrap_or_default()
                    ));
                }
            } else {
                bf16_worst = bf16_worst.max(c.worst);
                if !c.passes() {
                    bf16_caught += 1;
                }
                if c.first_token_difference.is_some() {
                    bf16_tokens += 1;
                }
                details.push(format!(
                    "{what}: worst {:.2e}, {} rows over 1e-4{} -> {}",
                    c.worst,
                    c.rows_over,
                    c.first_token_difference
                        .map(|j| format!(", greedy token {j} changed"))
                        .unwrap_or_default(),
                    if c.passes() {
                        "not distinguished"
                    } else {
                        "distinguished"
                    }
                ));
            }
        }
    }
    let n = oracle.prompts.len();
    let discriminates = bf16_caught > 0;
    let summary = format!(
        "{n} oracle prompts ({}): f32 path: {} {rows} rows (prefill + generated) within 1e-4 x max|ref| (worst {worst:.2e}), same {tokens} greedy tokens; \
         bf16-before-lm_head arm fails the tolerance on {bf16_caught}/{n} prompts (worst {bf16_worst:.2e}, tokens changed on {bf16_tokens})",
        oracle.path.display(),
        if f32_failed { "NOT all" } else { "all" },
    );
    if !discriminates {
        details.insert(
            0,
            "the bf16 arm passed on every prompt: the check cannot tell f32 from bf16 logits here"
                .into(),
        );
    }
    Ok(Outcome {
        name: "f32-logits",
        status: if !f32_failed && discriminates {
            Status::Held
        } else {
            Status::Failed
        },
        summary,
        details: if f32_failed || !discriminates {
            details
        } else {
            Vec::new()
        },
    })
}

// ---------------------------------------------------------------------------------------------
// 4. Invariance

/// Totals of one arm's comparisons with the baseline.
#[derive(Clone, Debug, Default)]
pub struct ArmResult {
    pub name: String,
    pub args: Vec<String>,
    pub vectors: usize,
    pub bytes: u64,
    pub differences: Vec<String>,
    pub unavailable: Option<String>,
}

/// The prompts of the invariance check: the usual ones plus a prompt long enough for attention
/// to cross the 256 lanes of the canonical reduction (where the model's context allows).
fn invariance_prompts(ctx: &Context) -> Vec<Prompt> {
    let mut v = ctx.prompts();
    let max = ctx.bundle.config.max_position_embeddings.unwrap_or(4096);
    if v.iter().all(|p| p.tokens.len() < 300) && 300 + 8 <= max {
        v.push(Prompt {
            label: "random 300".into(),
            tokens: random_prompt(ctx.seed, 300, ctx.bundle.config.vocab_size),
            new_tokens: 8,
        });
    }
    v
}

/// Check 4: run the baseline arm and then every arm of [`ARMS`] (and the command line's) on
/// every prompt, with prefill logits, and compare each logits file bytewise with the baseline's.
pub fn invariance(ctx: &Context) -> Outcome {
    finish(
        "invariance",
        invariance_inner(ctx, if ctx.table_arms { ARMS } else { &[] }),
    )
}

/// [`invariance`] over a given arm table.
pub fn invariance_with(ctx: &Context, table: &[Arm]) -> Outcome {
    finish("invariance", invariance_inner(ctx, table))
}

fn invariance_inner(ctx: &Context, table: &[Arm]) -> Result<Outcome, Stop> {
    let prompts = invariance_prompts(ctx);
    let resolve = |args: &[&str]| -> Result<Vec<String>, Stop> {
        args.iter()
            .map(|a| resolve_arg(a, &ctx.bundle).map_err(Stop::fail))
            .collect()
    };
    // Baseline files.
    let base_args = resolve(BASELINE.args)?;
    let mut baseline = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let mut g = ctx.generate(p);
        g.prefill_logits = true;
        g.extra = base_args.clone();
        let out = ctx.path(&format!("base-{i}.safetensors"));
        g.logits_out = Some(out.clone());
        ctx.run_ok(&g, &format!("baseline, {}", p.label))?;
        read_logits(&out, ctx, &format!("baseline, {}", p.label))?;
        baseline.push(out);
    }
    let mut arms: Vec<(String, Vec<String>, Option<String>)> = Vec::new();
    for a in table {
        let why = arms::unavailable(a, &ctx.runtime);
        arms.push((
            a.name.to_string(),
            if why.is_none() {
                resolve(a.args)?
            } else {
                Vec::new()
            },
            why,
        ));
    }
    for (name, args) in &ctx.extra_arms {
        arms.push((name.clone(), args.clone(), None));
    }
    let mut results = vec![prefill_equals_decode(ctx, &prompts, &baseline, &base_args)?];
    for (name, args, why) in arms {
        let mut r = ArmResult {
            name: name.clone(),
            args: args.clone(),
            unavailable: why,
            ..Default::default()
        };
        if r.unavailable.is_none() {
            for (i, p) in prompts.iter().enumerate() {
                let mut g = ctx.generate(p);
                g.prefill_logits = true;
                g.extra = args.clone();
                let out = ctx.path("arm.safetensors");
                let _ = fs::remove_file(&out);
                g.logits_out = Some(out.clone());
                ctx.run_ok(&g, &format!("{name}, {}", p.label))?;
                let c = compare_bytes(&baseline[i], &out)
                    .map_err(|e| Stop::fail(format!("{name}: {e:#}")))?;
                r.vectors += c.vectors;
                r.bytes += c.bytes;
                if let Some(d) = c.first_difference {
                    r.differences.push(format!("{}: {d}", p.label));
                }
            }
        }
        results.push(r);
    }
    let ran: Vec<&ArmResult> = results.iter().filter(|r| r.unavailable.is_none()).collect();
    let broken: Vec<&&ArmResult> = ran.iter().filter(|r| !r.differences.is_empty()).collect();
    let mut details = Vec::new();
    for r in &results {
        details.push(match (&r.unavailable, r.differences.is_empty()) {
            (Some(why), _) => format!("n/a  {:<36} {why}", r.name),
            (None, true) => format!(
                "same {:<36} {} vectors, {} bytes identical  [{}]",
                r.name,
                r.vectors,
                r.bytes,
                r.args.join(" ")
            ),
            (None, false) => format!(
                "DIFF {:<36} {} of {} prompts differ; first: {}  [{}]",
                r.name,
                r.differences.len(),
                prompts.len(),
                r.differences[0],
                r.args.join(" ")
            ),
        });
    }
    let vectors: usize = ran.iter().map(|r| r.vectors).sum();
    let bytes: u64 = ran.iter().map(|r| r.bytes).sum();
    let summary = format!(
        "{} arms x {} prompts against the baseline [{}]: {vectors} logit vectors (generated + prefill), {bytes} bytes compared, {}; {} arms not available here",
        ran.len(),
        prompts.len(),
        base_args.join(" "),
        if broken.is_empty() {
            "all bit-identical".to_string()
        } else {
            format!("{} arms DIFFER", broken.len())
        },
        results.len() - ran.len()
    );
    Ok(Outcome {
        name: "invariance",
        status: if broken.is_empty() && !ran.is_empty() {
            Status::Held
        } else {
            Status::Failed
        },
        summary,
        details,
    })
}

/// Prefill = decode (EXACTNESS.md §6): the prompt extended by the generated tokens but the last,
/// run as one prefill with the baseline's options, must give at each position the bits the
/// baseline computed there: its prefill rows, then each decode step's row.
fn prefill_equals_decode(
    ctx: &Context,
    prompts: &[Prompt],
    baseline: &[PathBuf],
    base_args: &[String],
) -> Result<ArmResult, Stop> {
    let mut r = ArmResult {
        name: "prefill = decode".into(),
        args: base_args.to_vec(),
        ..Default::default()
    };
    let max = ctx
        .bundle
        .config
        .max_position_embeddings
        .unwrap_or(usize::MAX);
    for (p, base_path) in prompts.iter().zip(baseline) {
        let base = read_logits(base_path, ctx, "baseline")?;
        let n = base.tokens.len();
        if n < 2 || p.tokens.len() + n - 1 > max {
            continue;
        }
        let mut tokens = p.tokens.clone();
        tokens.extend_from_slice(&base.tokens[..n - 1]);
        let mut g = Generate::new(&ctx.bundle.dir, &tokens, 1);
        g.prefill_logits = true;
        g.extra = base_args.to_vec();
        let out = ctx.path("prefill-decode.safetensors");
        g.logits_out = Some(out.clone());
        let what = format!("prefill = decode, {}", p.label);
        ctx.run_ok(&g, &what)?;
        let ext = read_logits(&out, ctx, &what)?;
        let ext_rows = ext
            .prefill_logits
            .as_ref()
            .ok_or_else(|| Stop::fail(format!("{what}: no prefill_logits")))?;
        let base_prefill = base
            .prefill_logits
            .as_ref()
            .ok_or_else(|| Stop::fail("baseline: no prefill_logits"))?;
        let plen = p.tokens.len();
        // position t < plen: the baseline's prefill row t; plen - 1 + j: the row that chose token j
        let want = |t: usize| -> &[f32] {
            if t < plen {
                base_prefill.row(t)
            } else {
                base.logits.row(t + 1 - plen)
            }
        };
        for t in 0..ext_rows.len() {
            let (a, b) = (want(t), ext_rows.row(t));
            r.vectors += 1;
            r.bytes += 4 * a.len() as u64;
            if let Some(c) = a
                .iter()
                .zip(b)
                .position(|(x, y)| x.to_bits() != y.to_bits())
            {
                r.differences.push(format!(
                    "{}: position {t} column {c}: decode {:e} ({:#010x}), prefill {:e} ({:#010x})",
                    p.label,
                    a[c],
                    a[c].to_bits(),
                    b[c],
                    b[c].to_bits()
                ));
                break;
            }
        }
    }
    Ok(r)
}

/// `1.2 MiB`-style sizes.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// A check: it runs against a context and says what it found.
pub type Check = fn(&Context) -> Outcome;

/// The checks by name, in run order.
pub const CHECKS: &[(&str, Check)] = &[
    ("weights", weights),
    ("router", router),
    ("f32-logits", f32_logits),
    ("invariance", invariance),
];

/// The exit code for a set of outcomes: 1 if any failed, else 3 if the environment failed any,
/// else 0 (a skip does not fail the run; its line says why).
pub fn exit_code(outcomes: &[Outcome]) -> i32 {
    if outcomes.iter().any(|o| o.status == Status::Failed) {
        1
    } else if outcomes.iter().any(|o| o.status == Status::Environment) {
        3
    } else {
        0
    }
}

/// Resolve the runtime's failure to start into the environment exit code's message.
pub fn runtime_unavailable(e: anyhow::Error) -> anyhow::Error {
    anyhow!("tarfa-run is not usable: {e:#}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::logits::Rows;

    fn oracle() -> OraclePrompt {
        OraclePrompt {
            prompt: vec![5, 6],
            greedy: vec![1, 0],
            step_logits: Rows {
                cols: 2,
                data: vec![0.0, 10.0, 10.0, 0.0],
            },
            prefill_logits: Rows {
                cols: 2,
                data: vec![1.0, 2.0, 0.0, 10.0],
            },
            router_topk: vec![],
        }
    }

    fn run(step: Vec<f32>, tokens: Vec<u32>) -> LogitsFile {
        LogitsFile {
            tokens,
            logits: Rows {
                cols: 2,
                data: step,
            },
            prefill_logits: Some(Rows {
                cols: 2,
                data: vec![1.0, 2.0, 0.0, 10.0],
            }),
            root_digest: None,
        }
    }

    #[test]
    fn an_exact_run_passes_the_oracle() {
        let c =
            compare_with_oracle(&run(vec![0.0, 10.0, 10.0, 0.0], vec![1, 0]), &oracle()).unwrap();
        assert!(c.passes());
        assert_eq!((c.rows, c.worst), (4, 0.0));
    }

    #[test]
    fn a_row_past_the_tolerance_or_a_changed_token_fails() {
        // 2e-3 on a row of scale 10: 2e-4 > 1e-4
        let c =
            compare_with_oracle(&run(vec![0.0, 10.002, 10.0, 0.0], vec![1, 0]), &oracle()).unwrap();
        assert!(!c.passes());
        assert_eq!(c.rows_over, 1);
        // 5e-4 on scale 10: within
        let c = compare_with_oracle(&run(vec![0.0, 10.0005, 10.0, 0.0], vec![1, 0]), &oracle())
            .unwrap();
        assert!(c.passes(), "{c:?}");
        let c =
            compare_with_oracle(&run(vec![0.0, 10.0, 10.0, 0.0], vec![0, 0]), &oracle()).unwrap();
        assert_eq!(c.first_token_difference, Some(0));
        assert_eq!(c.rows, 3, "rows after a changed token are not compared");
    }

    #[test]
    fn shapes_that_do_not_match_the_oracle_are_errors() {
        assert!(compare_with_oracle(&run(vec![0.0, 10.0], vec![1]), &oracle()).is_err());
        let mut r = run(vec![0.0, 10.0, 10.0, 0.0], vec![1, 0]);
        r.prefill_logits = None;
        assert!(compare_with_oracle(&r, &oracle()).is_err());
    }

    #[test]
    fn exit_codes_follow_the_worst_outcome() {
        let o = |status| Outcome {
            name: "x",
            status,
            summary: String::new(),
            details: vec![],
        };
        assert_eq!(exit_code(&[o(Status::Held), o(Status::Skipped)]), 0);
        assert_eq!(exit_code(&[o(Status::Held), o(Status::Environment)]), 3);
        assert_eq!(exit_code(&[o(Status::Environment), o(Status::Failed)]), 1);
    }

    #[test]
    fn sizes_print_in_binary_units() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 20), "3.0 MiB");
    }
}
