//! The deployment bar, declared on the command line before any run, and the verdict it gives.
//!
//! Default bar: in at least one workload a median paired improvement of at least 2% in request
//! latency with the 95% interval wholly below parity; in no workload a request-latency
//! regression whose interval lies wholly above parity; no peak-memory regression above 1% (RSS,
//! and VRAM where measured); bit-identical logits.

use std::fmt;

use super::stats::Interval;

/// A timing the harness measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Metric {
    /// prefill + decode, as the runtime reports them: the time to serve the request once the
    /// model is loaded.
    Request,
    Prefill,
    Decode,
    /// From spawn to exit of the process (load, verification, request, writing the logits).
    Process,
}

impl Metric {
    pub const ALL: [Metric; 4] = [
        Metric::Request,
        Metric::Prefill,
        Metric::Decode,
        Metric::Process,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Metric::Request => "request",
            Metric::Prefill => "prefill",
            Metric::Decode => "decode",
            Metric::Process => "process",
        }
    }

    pub fn parse(s: &str) -> Result<Metric, String> {
        Metric::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown metric `{s}` (request, prefill, decode, process)"))
    }
}

impl fmt::Display for Metric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The deployment bar.
#[derive(Clone, Debug, PartialEq)]
pub struct Bar {
    /// The metric that must improve.
    pub metric: Metric,
    /// The smallest median improvement that counts, as a fraction (0.02 = 2%).
    pub min_improvement: f64,
    /// Metrics in which no workload may show a regression wholly above parity.
    pub guard: Vec<Metric>,
    /// The largest allowed peak-memory growth, as a fraction (0.01 = 1%).
    pub max_memory_regression: f64,
    /// Whether B's logits must be bit-identical to A's.
    pub require_bit_identical: bool,
}

impl Default for Bar {
    fn default() -> Bar {
        Bar {
            metric: Metric::Request,
            min_improvement: 0.02,
            guard: vec![Metric::Request],
            max_memory_regression: 0.01,
            require_bit_identical: true,
        }
    }
}

impl fmt::Display for Bar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let guard: Vec<&str> = self.guard.iter().map(|m| m.name()).collect();
        write!(
            f,
            "ACCEPT only if (1) some workload's median paired {} change is <= -{:.1}% with its 95% interval wholly below parity; \
             (2) no workload's {} interval lies wholly above parity; (3) no peak RSS/VRAM growth above {:.1}%; (4) {}",
            self.metric,
            self.min_improvement * 100.0,
            guard.join("/"),
            self.max_memory_regression * 100.0,
            if self.require_bit_identical {
                "bit-identical logits in every run"
            } else {
                "logits may differ (declared)"
            }
        )
    }
}

/// One workload's summary, as the verdict needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkloadSummary {
    pub name: String,
    /// Paired relative change (B vs A) per metric.
    pub changes: Vec<(Metric, Interval)>,
    /// Peak RSS of each arm over its runs, bytes.
    pub rss: (Option<u64>, Option<u64>),
    /// Peak VRAM of each arm over its runs, bytes (`None` without nvidia-smi).
    pub vram: (Option<u64>, Option<u64>),
    /// Every run's logits file had the same bytes.
    pub bit_identical: bool,
}

impl WorkloadSummary {
    pub fn change(&self, m: Metric) -> Option<&Interval> {
        self.changes.iter().find(|(x, _)| *x == m).map(|(_, i)| i)
    }
}

/// ACCEPT or REJECT, with the reasons.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    Accept(Vec<String>),
    Reject(Vec<String>),
}

impl Verdict {
    pub fn accepted(&self) -> bool {
        matches!(self, Verdict::Accept(_))
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::Accept(r) => write!(f, "ACCEPT: {}", r.join("; ")),
            Verdict::Reject(r) => write!(f, "REJECT: {}", r.join("; ")),
        }
    }
}

fn pct(x: f64) -> String {
    format!("{:+.2}%", x * 100.0)
}

fn memory_growth(
    what: &str,
    w: &str,
    (a, b): (Option<u64>, Option<u64>),
    max: f64,
) -> Option<String> {
    let (a, b) = (a?, b?);
    if a == 0 {
        return (b > 0).then(|| format!("{w}: peak {what} grew from 0 to {b} bytes"));
    }
    let growth = (b as f64 - a as f64) / a as f64;
    (growth > max).then(|| {
        format!(
            "{w}: peak {what} grew {} ({} -> {} bytes), above {:.1}%",
            pct(growth),
            a,
            b,
            max * 100.0
        )
    })
}

/// The fewest pairs for which a 95% interval of a median exists: the widest interval, from the
/// smallest to the largest of n values, covers the median with probability 1 - 2^(1-n), which
/// first exceeds 95% at n = 6.
pub const MIN_PAIRS: usize = 6;

/// Apply `bar` to the workloads.
pub fn decide(bar: &Bar, workloads: &[WorkloadSummary]) -> Verdict {
    let mut reject = Vec::new();
    if workloads.is_empty() {
        return Verdict::Reject(vec!["no workloads were measured".into()]);
    }
    let fewest = workloads
        .iter()
        .flat_map(|w| w.changes.iter().map(|(_, iv)| iv.n))
        .min()
        .unwrap_or(0);
    if fewest < MIN_PAIRS {
        reject.push(format!(
            "{fewest} pairs cannot support a 95% interval of a median (at least {MIN_PAIRS} are needed)"
        ));
    }
    for w in workloads {
        if bar.require_bit_identical && !w.bit_identical {
            reject.push(format!(
                "{}: logits are not bit-identical across the runs",
                w.name
            ));
        }
        for &m in &bar.guard {
            if let Some(iv) = w.change(m) {
                if iv.wholly_above_parity() {
                    reject.push(format!(
                        "{}: {m} regressed {} [{}, {}], wholly above parity",
                        w.name,
                        pct(iv.median),
                        pct(iv.lo),
                        pct(iv.hi)
                    ));
                }
            }
        }
        reject.extend(memory_growth(
            "RSS",
            &w.name,
            w.rss,
            bar.max_memory_regression,
        ));
        reject.extend(memory_growth(
            "VRAM",
            &w.name,
            w.vram,
            bar.max_memory_regression,
        ));
    }
    let improved: Vec<String> = workloads
        .iter()
        .filter_map(|w| {
            let iv = w.change(bar.metric)?;
            (iv.median <= -bar.min_improvement && iv.wholly_below_parity()).then(|| {
                format!(
                    "{}: {} {} [{}, {}]",
                    w.name,
                    bar.metric,
                    pct(iv.median),
                    pct(iv.lo),
                    pct(iv.hi)
                )
            })
        })
        .collect();
    if improved.is_empty() {
        reject.push(format!(
            "no workload shows a median {} improvement of at least {:.1}% with its interval wholly below parity",
            bar.metric,
            bar.min_improvement * 100.0
        ));
    }
    if reject.is_empty() {
        let mut why = vec![format!("improved in {}", improved.join(", "))];
        why.push("no regression, no memory growth".into());
        if bar.require_bit_identical {
            why.push("logits bit-identical".into());
        }
        Verdict::Accept(why)
    } else {
        Verdict::Reject(reject)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iv(median: f64, lo: f64, hi: f64) -> Interval {
        Interval {
            median,
            lo,
            hi,
            n: 10,
        }
    }

    #[test]
    fn too_few_pairs_reject_whatever_the_timings() {
        let mut x = w("512", iv(-0.05, -0.06, -0.04));
        x.changes[0].1.n = 5;
        let v = decide(&Bar::default(), &[x]);
        assert!(v.to_string().contains("5 pairs cannot support"), "{v}");
    }

    fn w(name: &str, request: Interval) -> WorkloadSummary {
        WorkloadSummary {
            name: name.into(),
            changes: vec![
                (Metric::Request, request),
                (Metric::Decode, iv(0.0, -0.01, 0.01)),
            ],
            rss: (Some(1000), Some(1000)),
            vram: (None, None),
            bit_identical: true,
        }
    }

    #[test]
    fn a_clear_improvement_with_nothing_else_wrong_is_accepted() {
        let v = decide(
            &Bar::default(),
            &[
                w("512", iv(-0.03, -0.04, -0.02)),
                w("1024", iv(0.0, -0.01, 0.01)),
            ],
        );
        assert!(v.accepted(), "{v}");
        assert!(v.to_string().contains("512: request -3.00%"), "{v}");
    }

    #[test]
    fn an_improvement_below_the_threshold_or_not_significant_is_rejected() {
        let small = decide(&Bar::default(), &[w("512", iv(-0.015, -0.02, -0.01))]);
        assert!(!small.accepted());
        assert!(small.to_string().contains("no workload shows"), "{small}");
        let noisy = decide(&Bar::default(), &[w("512", iv(-0.05, -0.1, 0.001))]);
        assert!(!noisy.accepted());
        // exactly -2% counts
        assert!(decide(&Bar::default(), &[w("512", iv(-0.02, -0.03, -0.01))]).accepted());
    }

    #[test]
    fn a_significant_regression_anywhere_rejects() {
        let v = decide(
            &Bar::default(),
            &[
                w("512", iv(-0.05, -0.06, -0.04)),
                w("2048", iv(0.01, 0.002, 0.02)),
            ],
        );
        assert!(!v.accepted());
        assert!(
            v.to_string().contains("2048: request regressed +1.00%"),
            "{v}"
        );
        // a regression whose interval touches parity does not
        let v = decide(
            &Bar::default(),
            &[
                w("512", iv(-0.05, -0.06, -0.04)),
                w("2048", iv(0.01, 0.0, 0.02)),
            ],
        );
        assert!(v.accepted(), "{v}");
        // a guarded secondary metric
        let bar = Bar {
            guard: vec![Metric::Request, Metric::Decode],
            ..Bar::default()
        };
        let mut x = w("512", iv(-0.05, -0.06, -0.04));
        x.changes[1].1 = iv(0.03, 0.02, 0.04);
        assert!(!decide(&bar, &[x.clone()]).accepted());
        assert!(
            decide(&Bar::default(), &[x]).accepted(),
            "decode is not guarded by default"
        );
    }

    #[test]
    fn memory_growth_above_one_percent_rejects() {
        let mut x = w("512", iv(-0.05, -0.06, -0.04));
        x.rss = (Some(1000), Some(1010));
        assert!(
            decide(&Bar::default(), &[x.clone()]).accepted(),
            "exactly 1% is allowed"
        );
        x.rss = (Some(1000), Some(1011));
        let v = decide(&Bar::default(), &[x.clone()]);
        assert!(v.to_string().contains("peak RSS grew +1.10%"), "{v}");
        x.rss = (Some(1000), Some(900));
        x.vram = (Some(1 << 30), Some(2 << 30));
        assert!(decide(&Bar::default(), &[x.clone()])
            .to_string()
            .contains("VRAM"));
        x.vram = (None, None);
        assert!(
            decide(&Bar::default(), &[x]).accepted(),
            "less memory is fine; n/a VRAM is not compared"
        );
    }

    #[test]
    fn changed_logits_reject_unless_declared() {
        let mut x = w("512", iv(-0.05, -0.06, -0.04));
        x.bit_identical = false;
        let v = decide(&Bar::default(), &[x.clone()]);
        assert!(v.to_string().contains("not bit-identical"), "{v}");
        let lax = Bar {
            require_bit_identical: false,
            ..Bar::default()
        };
        assert!(decide(&lax, &[x]).accepted());
    }

    #[test]
    fn every_reason_is_listed() {
        let mut x = w("512", iv(0.05, 0.04, 0.06));
        x.bit_identical = false;
        x.rss = (Some(100), Some(200));
        match decide(&Bar::default(), &[x]) {
            Verdict::Reject(r) => assert_eq!(r.len(), 4, "{r:?}"),
            v => panic!("{v}"),
        }
        assert!(!decide(&Bar::default(), &[]).accepted());
    }
}
