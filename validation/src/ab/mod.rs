//! The paired A/B harness: two builds (two `tarfa-run` binaries) or two option sets, on the same
//! bundle and prompts, each run a fresh process; per workload a warm-up of each arm, then N pairs
//! alternating AB and BA ([`schedule`]); the median paired relative change of request latency,
//! prefill and decode with a bootstrap interval ([`stats`]); peak RSS and VRAM sampled during
//! every run; bit-identity of every run's logits; and a verdict against a bar declared before
//! the runs ([`verdict`]). The output is a markdown table for docs/PHASE_LOG.md.
//!
//! The harness never decides on a single run, never drops a run it did not like, and never
//! compares timings from different prompts.

pub mod schedule;
pub mod stats;
pub mod verdict;

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

use crate::bundle::blake3_hex;
use crate::checks::human_bytes;
use crate::prng::Rng;
use crate::runner::{run_watched, Generate};
use crate::workload::random_prompt;
use schedule::{schedule, ArmId};
use stats::{bootstrap_median, median, relative_changes, Interval};
use verdict::{decide, Bar, Metric, Verdict, WorkloadSummary};

/// One arm: a runtime binary and the options it runs with.
#[derive(Clone, Debug, PartialEq)]
pub struct ArmSpec {
    pub bin: PathBuf,
    pub args: Vec<String>,
}

impl ArmSpec {
    pub fn label(&self) -> String {
        let mut s = self.bin.display().to_string();
        for a in &self.args {
            s.push(' ');
            s.push_str(a);
        }
        s
    }
}

/// A prompt length and a number of generated tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Workload {
    pub prompt_len: usize,
    pub new_tokens: usize,
}

impl Workload {
    /// `512:64` (prompt tokens : generated tokens).
    pub fn parse(s: &str) -> Result<Workload, String> {
        let (p, n) = s
            .split_once(':')
            .ok_or_else(|| format!("workload `{s}`: expected PROMPT_LEN:NEW_TOKENS"))?;
        let num = |x: &str| {
            x.trim()
                .parse::<usize>()
                .map_err(|_| format!("workload `{s}`: `{x}` is not a count"))
        };
        let w = Workload {
            prompt_len: num(p)?,
            new_tokens: num(n)?,
        };
        if w.prompt_len == 0 || w.new_tokens == 0 {
            return Err(format!("workload `{s}`: both counts must be positive"));
        }
        Ok(w)
    }

    pub fn name(&self) -> String {
        format!("{}+{}", self.prompt_len, self.new_tokens)
    }
}

/// Everything one A/B experiment needs, fixed before the first run.
#[derive(Clone, Debug)]
pub struct AbConfig {
    pub bundle: PathBuf,
    pub a: ArmSpec,
    pub b: ArmSpec,
    pub workloads: Vec<Workload>,
    pub pairs: usize,
    pub seed: u64,
    pub resamples: usize,
    pub vocab: usize,
    /// Also write and compare prefill logits (large for long prompts and big vocabularies).
    pub prefill_logits: bool,
    pub bar: Bar,
    /// A run past this is killed and the experiment stops (exit 3).
    pub run_timeout: Duration,
}

/// One measured (or warm-up) run.
#[derive(Clone, Debug, PartialEq)]
pub struct RunRecord {
    pub arm: ArmId,
    pub pair: Option<usize>,
    pub process_ms: f64,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    pub peak_rss: Option<u64>,
    pub peak_vram: Option<u64>,
    /// BLAKE3 of the run's logits file.
    pub logits_digest: String,
}

impl RunRecord {
    pub fn metric(&self, m: Metric) -> f64 {
        match m {
            Metric::Request => self.prefill_ms + self.decode_ms,
            Metric::Prefill => self.prefill_ms,
            Metric::Decode => self.decode_ms,
            Metric::Process => self.process_ms,
        }
    }
}

/// `prefill_ms` and `decode_ms` of a `--summary-json` file.
pub fn parse_summary(text: &str) -> Result<(f64, f64)> {
    let v: Value = serde_json::from_str(text).context("summary JSON")?;
    let num = |k: &str| {
        v.get(k)
            .and_then(Value::as_f64)
            .filter(|x| x.is_finite() && *x >= 0.0)
            .ok_or_else(|| anyhow!("summary JSON lacks a non-negative `{k}`"))
    };
    Ok((num("prefill_ms")?, num("decode_ms")?))
}

/// A workload's runs and what they add up to.
#[derive(Clone, Debug)]
pub struct WorkloadResult {
    pub workload: Workload,
    pub records: Vec<RunRecord>,
    pub summary: WorkloadSummary,
    /// Median of each metric per arm, over the measured runs.
    pub medians: Vec<(Metric, f64, f64)>,
    /// Distinct logits files among all runs (1 when bit-identical).
    pub distinct_logits: usize,
}

/// The paired samples of metric `m`: (A, B) per pair, in pair order.
pub fn paired(records: &[RunRecord], m: Metric) -> (Vec<f64>, Vec<f64>) {
    let pairs: BTreeSet<usize> = records.iter().filter_map(|r| r.pair).collect();
    let mut a = Vec::new();
    let mut b = Vec::new();
    for p in pairs {
        let get = |arm| records.iter().find(|r| r.pair == Some(p) && r.arm == arm);
        if let (Some(x), Some(y)) = (get(ArmId::A), get(ArmId::B)) {
            a.push(x.metric(m));
            b.push(y.metric(m));
        }
    }
    (a, b)
}

/// Summarise one workload's records (warm-ups count for memory and bit-identity, not timing).
pub fn summarise(
    w: Workload,
    records: Vec<RunRecord>,
    resamples: usize,
    seed: u64,
) -> WorkloadResult {
    let mut changes = Vec::new();
    let mut medians = Vec::new();
    for (i, m) in Metric::ALL.into_iter().enumerate() {
        let (a, b) = paired(&records, m);
        if a.is_empty() {
            continue;
        }
        let mut rng = Rng::new(
            seed ^ ((w.prompt_len as u64) << 32) ^ ((w.new_tokens as u64) << 8) ^ i as u64,
        );
        let iv: Interval = bootstrap_median(&relative_changes(&a, &b), resamples, 0.95, &mut rng);
        changes.push((m, iv));
        medians.push((m, median(&a), median(&b)));
    }
    let peak = |arm: ArmId, f: fn(&RunRecord) -> Option<u64>| {
        records.iter().filter(|r| r.arm == arm).filter_map(f).max()
    };
    let distinct: BTreeSet<&str> = records.iter().map(|r| r.logits_digest.as_str()).collect();
    let summary = WorkloadSummary {
        name: w.name(),
        changes,
        rss: (
            peak(ArmId::A, |r| r.peak_rss),
            peak(ArmId::B, |r| r.peak_rss),
        ),
        vram: (
            peak(ArmId::A, |r| r.peak_vram),
            peak(ArmId::B, |r| r.peak_vram),
        ),
        bit_identical: distinct.len() == 1,
    };
    WorkloadResult {
        workload: w,
        distinct_logits: distinct.len(),
        records,
        summary,
        medians,
    }
}

/// Run one arm once.
fn run_once(
    cfg: &AbConfig,
    arm: &ArmSpec,
    tokens: &[u32],
    w: Workload,
    scratch: &Path,
) -> Result<RunRecord> {
    let mut g = Generate::new(&cfg.bundle, tokens, w.new_tokens);
    let logits = scratch.join("logits.safetensors");
    let summary = scratch.join("summary.json");
    let _ = fs::remove_file(&logits);
    let _ = fs::remove_file(&summary);
    g.logits_out = Some(logits.clone());
    g.summary_json = Some(summary.clone());
    g.prefill_logits = cfg.prefill_logits;
    g.extra = arm.args.clone();
    let mut cmd = Command::new(&arm.bin);
    cmd.args(g.to_args());
    let f = run_watched(cmd, Duration::from_millis(5), cfg.run_timeout, true)?;
    if !f.ok() {
        bail!("`{}`: {}", arm.label(), f.describe());
    }
    let (prefill_ms, decode_ms) =
        parse_summary(&fs::read_to_string(&summary).context("read the summary JSON")?)?;
    let logits_digest = blake3_hex(&fs::read(&logits).context("read the logits file")?);
    Ok(RunRecord {
        arm: ArmId::A,
        pair: None,
        process_ms: f.wall.as_secs_f64() * 1e3,
        prefill_ms,
        decode_ms,
        peak_rss: f.peak_rss_bytes,
        peak_vram: f.peak_vram_bytes,
        logits_digest,
    })
}

/// Run every workload's schedule. `progress` receives one line per run.
pub fn run(cfg: &AbConfig, mut progress: impl FnMut(&str)) -> Result<Vec<WorkloadResult>> {
    let scratch = tempfile::Builder::new().prefix("tarfa-ab-").tempdir()?;
    let mut out = Vec::new();
    for &w in &cfg.workloads {
        let tokens = random_prompt(cfg.seed, w.prompt_len, cfg.vocab);
        let mut records = Vec::new();
        for slot in schedule(cfg.pairs) {
            let arm = match slot.arm {
                ArmId::A => &cfg.a,
                ArmId::B => &cfg.b,
            };
            let mut r = run_once(cfg, arm, &tokens, w, scratch.path())?;
            r.arm = slot.arm;
            r.pair = slot.pair;
            progress(&format!(
                "{} {:?} {}: request {:.1} ms (prefill {:.1}, decode {:.1}), process {:.1} ms, rss {}",
                w.name(),
                slot.arm,
                slot.pair.map(|p| format!("pair {p}")).unwrap_or_else(|| "warm-up".into()),
                r.metric(Metric::Request),
                r.prefill_ms,
                r.decode_ms,
                r.process_ms,
                r.peak_rss.map(human_bytes).unwrap_or_else(|| "n/a".into())
            ));
            records.push(r);
        }
        out.push(summarise(w, records, cfg.resamples, cfg.seed));
    }
    Ok(out)
}

fn pct(x: f64) -> String {
    format!("{:+.2}%", x * 100.0)
}

fn mem(x: Option<u64>) -> String {
    x.map(human_bytes).unwrap_or_else(|| "n/a".into())
}

fn mem_change(a: Option<u64>, b: Option<u64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if a > 0 => pct((b as f64 - a as f64) / a as f64),
        _ => "n/a".into(),
    }
}

/// The report: setup, the bar, the timing table, the memory and bit-identity table, the verdict.
pub fn render(cfg: &AbConfig, results: &[WorkloadResult], verdict: &Verdict) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "### A/B: `{}` vs `{}`\n", cfg.a.label(), cfg.b.label());
    let _ = writeln!(
        s,
        "Bundle `{}`; prompts: seeded random token ids (seed {}), greedy, EOS ignored. Every run a fresh process; \
         per workload one warm-up per arm, then {} pairs alternating AB/BA. Change = median over pairs of (B - A)/A, \
         95% percentile-bootstrap interval from {} resamples. Request = prefill + decode as the runtime reports them; \
         process = spawn to exit.\n",
        cfg.bundle.display(),
        cfg.seed,
        cfg.pairs,
        cfg.resamples
    );
    let _ = writeln!(s, "Bar (declared before the runs): {}\n", cfg.bar);
    let _ = writeln!(
        s,
        "| workload | metric | A median (ms) | B median (ms) | paired change | 95% CI | |"
    );
    let _ = writeln!(s, "|---|---|---:|---:|---:|:---:|:---:|");
    for r in results {
        for (i, (m, iv)) in r.summary.changes.iter().enumerate() {
            let (_, am, bm) = r
                .medians
                .iter()
                .find(|(x, _, _)| x == m)
                .copied()
                .unwrap_or((*m, f64::NAN, f64::NAN));
            let sig = if iv.wholly_below_parity() {
                "B faster"
            } else if iv.wholly_above_parity() {
                "B slower"
            } else {
                "~"
            };
            let _ = writeln!(
                s,
                "| {} | {m} | {am:.2} | {bm:.2} | {} | [{}, {}] | {sig} |",
                if i == 0 {
                    r.workload.name()
                } else {
                    String::new()
                },
                pct(iv.median),
                pct(iv.lo),
                pct(iv.hi)
            );
        }
    }
    let _ = writeln!(s);
    let _ = writeln!(s, "| workload | peak RSS A | peak RSS B | RSS change | peak VRAM A | peak VRAM B | logits bit-identical |");
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|:---:|");
    for r in results {
        let w = &r.summary;
        let runs = r.records.len();
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} |",
            w.name,
            mem(w.rss.0),
            mem(w.rss.1),
            mem_change(w.rss.0, w.rss.1),
            mem(w.vram.0),
            mem(w.vram.1),
            if w.bit_identical {
                format!("yes ({runs}/{runs} runs)")
            } else {
                format!("NO ({} distinct files in {runs} runs)", r.distinct_logits)
            }
        );
    }
    let _ = writeln!(s, "\n**{verdict}**");
    s
}

/// Decide and render.
pub fn conclude(cfg: &AbConfig, results: &[WorkloadResult]) -> (Verdict, String) {
    let summaries: Vec<WorkloadSummary> = results.iter().map(|r| r.summary.clone()).collect();
    let v = decide(&cfg.bar, &summaries);
    let text = render(cfg, results, &v);
    (v, text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workloads_parse() {
        assert_eq!(
            Workload::parse("512:64").unwrap(),
            Workload {
                prompt_len: 512,
                new_tokens: 64
            }
        );
        assert_eq!(Workload::parse("512:64").unwrap().name(), "512+64");
        assert!(Workload::parse("512").is_err());
        assert!(Workload::parse("0:64").is_err());
        assert!(Workload::parse("a:1").is_err());
    }

    #[test]
    fn the_summary_json_gives_prefill_and_decode() {
        let t = r#"{"root_digest":"ab","prompt_tokens":3,"generated_tokens":2,"prefill_ms":12.5,"decode_ms":40,
                    "prefill_tok_s":240.0,"decode_tok_s":50.0,"peak_rss_bytes":1000,"backend":"cpu"}"#;
        assert_eq!(parse_summary(t).unwrap(), (12.5, 40.0));
        assert!(parse_summary(r#"{"prefill_ms":1}"#).is_err());
        assert!(parse_summary(r#"{"prefill_ms":-1,"decode_ms":1}"#).is_err());
    }

    fn rec(arm: ArmId, pair: Option<usize>, ms: f64, digest: &str) -> RunRecord {
        RunRecord {
            arm,
            pair,
            process_ms: ms + 100.0,
            prefill_ms: ms / 4.0,
            decode_ms: ms * 3.0 / 4.0,
            peak_rss: Some(1 << 20),
            peak_vram: None,
            logits_digest: digest.into(),
        }
    }

    /// Records in schedule order with B 10% faster.
    fn records(digest_b: &str) -> Vec<RunRecord> {
        let mut v = Vec::new();
        for s in schedule(6) {
            let base = 100.0 + s.pair.unwrap_or(0) as f64;
            let (ms, d) = match s.arm {
                ArmId::A => (base, "x"),
                ArmId::B => (base * 0.9, digest_b),
            };
            v.push(rec(s.arm, s.pair, ms, d));
        }
        v
    }

    #[test]
    fn pairs_are_matched_by_pair_index_and_warm_ups_are_left_out() {
        let r = records("x");
        let (a, b) = paired(&r, Metric::Request);
        assert_eq!(a.len(), 6);
        assert_eq!(a[1], 101.0);
        assert!((b[1] - 90.9).abs() < 1e-9);
    }

    #[test]
    fn a_summary_and_its_table() {
        let w = Workload {
            prompt_len: 8,
            new_tokens: 2,
        };
        let res = summarise(w, records("x"), 2000, 1);
        let iv = res.summary.change(Metric::Request).unwrap();
        assert!((iv.median + 0.1).abs() < 1e-9 && iv.wholly_below_parity());
        assert!(res.summary.bit_identical);
        let cfg = AbConfig {
            bundle: "/b".into(),
            a: ArmSpec {
                bin: "/a/tarfa-run".into(),
                args: vec![],
            },
            b: ArmSpec {
                bin: "/a/tarfa-run".into(),
                args: vec!["--threads".into(), "2".into()],
            },
            workloads: vec![w],
            pairs: 6,
            seed: 1,
            resamples: 2000,
            vocab: 10,
            prefill_logits: false,
            bar: Bar::default(),
            run_timeout: Duration::from_secs(60),
        };
        let (v, text) = conclude(&cfg, &[res]);
        assert!(v.accepted(), "{text}");
        assert!(
            text.contains("| 8+2 | request | 102.50 | 92.25 | -10.00% |"),
            "{text}"
        );
        assert!(text.contains("| yes (14/14 runs) |"), "{text}");
        assert!(text.contains("**ACCEPT"), "{text}");
        // a run whose logits differ
        let res = summarise(w, records("y"), 2000, 1);
        assert!(!res.summary.bit_identical);
        let (v, text) = conclude(&cfg, &[res]);
        assert!(!v.accepted());
        assert!(text.contains("NO (2 distinct files in 14 runs)"), "{text}");
    }
}
