//! `GET /metrics`: Prometheus text format (version 0.0.4), written by hand: a few counters,
//! gauges and two fixed-bucket histograms do not need a metrics registry.
//!
//! Besides load (queue depth, sequences, tokens, latency), the server says what it can verify
//! about itself: the bundle it serves (its root digest, as a label of `tarfa_bundle_info`), the
//! exactness contract its numbers follow, and how many verification checks the bundle reader
//! has run (the root digest at open; each copied file, tensor and expert every time it is read,
//! BLAKE3 or SHA-256 against the manifest before use). A client that pinned a root digest can
//! check it here as well as in every response's headers.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

#[derive(Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, secs: f64) {
        for (c, &b) in self.counts.iter_mut().zip(&BUCKETS) {
            if secs <= b {
                *c += 1;
            }
        }
        self.count += 1;
        self.sum += secs;
    }

    fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (c, b) in self.counts.iter().zip(&BUCKETS) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

/// Why a request was refused before it was queued (the `reason` label of
/// `tarfa_requests_refused_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// 429: `--max-batch` in flight and `--max-queue` waiting.
    QueueFull,
    /// 400: prompt + max_tokens beyond the model's context.
    TooLong,
    /// 400 (and 404 for a model not served here): malformed JSON, unknown fields, out-of-range
    /// values, token ids outside the vocabulary.
    BadInput,
    /// 401: `--api-key` set and the bearer token missing or wrong.
    Unauthorized,
    /// 503: the server stopped accepting (SIGTERM).
    ShuttingDown,
}

impl Refusal {
    const ALL: [Refusal; 5] = [
        Refusal::QueueFull,
        Refusal::TooLong,
        Refusal::BadInput,
        Refusal::Unauthorized,
        Refusal::ShuttingDown,
    ];

    fn label(self) -> &'static str {
        match self {
            Refusal::QueueFull => "queue_full",
            Refusal::TooLong => "too_long",
            Refusal::BadInput => "bad_input",
            Refusal::Unauthorized => "unauthorized",
            Refusal::ShuttingDown => "shutting_down",
        }
    }
}

/// Why an accepted request was dropped before its end (the `reason` label of
/// `tarfa_requests_cancelled_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cancel {
    /// The client closed its connection (queued or running, streaming or not).
    Disconnect,
    /// The request passed its deadline (`--request-timeout` or `x-tarfa-timeout`).
    Deadline,
}

impl Cancel {
    const ALL: [Cancel; 2] = [Cancel::Disconnect, Cancel::Deadline];

    fn label(self) -> &'static str {
        match self {
            Cancel::Disconnect => "disconnect",
            Cancel::Deadline => "deadline",
        }
    }
}

/// The verification checks the bundle reader has run so far, as it records them for
/// `--verify-report` (every read of a file, tensor or expert is checked before use).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Verified {
    /// The manifest's root digest recomputed and compared at open (0 or 1).
    pub root_digest: u64,
    /// Copied files (config.json, tokenizer.json, ...) read and SHA-256-checked.
    pub files: u64,
    /// Non-expert tensor reads, each BLAKE3-checked.
    pub tensors: u64,
    /// Expert reads, each BLAKE3-checked (lazily: an expert is read when first routed to).
    pub experts: u64,
}

/// Reads the bundle reader's verification counts (called at every scrape).
pub type VerificationProbe = Box<dyn Fn() -> Verified + Send + Sync>;

/// What the metrics name about the model, fixed at start.
pub(crate) struct Identity<'a> {
    pub name: &'a str,
    pub root_digest: &'a str,
    pub verification: Option<&'a VerificationProbe>,
}

/// The server's counters.
#[derive(Default)]
pub struct Metrics {
    waiting: AtomicU64,
    running: AtomicU64,
    tokens: AtomicU64,
    drafted: AtomicU64,
    accepted: AtomicU64,
    requests: AtomicU64,
    refused: [AtomicU64; Refusal::ALL.len()],
    cancelled: [AtomicU64; Cancel::ALL.len()],
    failed: AtomicU64,
    latency: Mutex<Histogram>,
    ttft: Mutex<Histogram>,
}

/// A label value, escaped as the text format requires.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    pub(crate) fn set_depths(&self, waiting: u64, running: u64) {
        self.waiting.store(waiting, Ordering::Relaxed);
        self.running.store(running, Ordering::Relaxed);
    }

    pub(crate) fn add_tokens(&self, n: u64) {
        self.tokens.fetch_add(n, Ordering::Relaxed);
    }

    /// Speculative decoding's drafts fed and accepted (counted as each request finishes).
    pub(crate) fn add_drafts(&self, drafted: u64, accepted: u64) {
        self.drafted.fetch_add(drafted, Ordering::Relaxed);
        self.accepted.fetch_add(accepted, Ordering::Relaxed);
    }

    pub(crate) fn refused(&self, why: Refusal) {
        let i = Refusal::ALL.iter().position(|&r| r == why).expect("listed");
        self.refused[i].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn cancelled(&self, why: Cancel) {
        let i = Cancel::ALL.iter().position(|&c| c == why).expect("listed");
        self.cancelled[i].fetch_add(1, Ordering::Relaxed);
    }

    /// An accepted request the engine failed (answered 500, or a stream's error event).
    pub(crate) fn failed(&self) {
        self.failed.fetch_add(1, Ordering::Relaxed);
    }

    /// A request answered in full: its latency, and its time to first token when it generated
    /// one and it was not already observed (a stream observes it as the token goes out).
    pub(crate) fn finished(&self, latency: f64, ttft: Option<f64>) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.latency.lock().expect("metrics").observe(latency);
        if let Some(t) = ttft {
            self.first_token(t);
        }
    }

    /// A stream's first generated token went out, `ttft` seconds after its arrival.
    pub(crate) fn first_token(&self, ttft: f64) {
        self.ttft.lock().expect("metrics").observe(ttft);
    }

    pub(crate) fn render(&self, id: &Identity) -> String {
        let mut out = String::new();
        let mut one = |name: &str, kind: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        };
        one(
            "tarfa_queue_depth",
            "gauge",
            "Requests waiting for a slot.",
            self.waiting.load(Ordering::Relaxed),
        );
        one(
            "tarfa_running_sequences",
            "gauge",
            "Requests in flight.",
            self.running.load(Ordering::Relaxed),
        );
        one(
            "tarfa_tokens_total",
            "counter",
            "Tokens run through the model.",
            self.tokens.load(Ordering::Relaxed),
        );
        one(
            "tarfa_draft_tokens_total",
            "counter",
            "Speculative decoding's draft tokens fed to decode steps (in tarfa_tokens_total too), \
             counted as each request finishes.",
            self.drafted.load(Ordering::Relaxed),
        );
        one(
            "tarfa_draft_tokens_accepted_total",
            "counter",
            "Draft tokens accepted (each the token the model chose itself).",
            self.accepted.load(Ordering::Relaxed),
        );
        one(
            "tarfa_requests_total",
            "counter",
            "Requests answered in full (a stream: when its [DONE] goes out).",
            self.requests.load(Ordering::Relaxed),
        );
        one(
            "tarfa_requests_failed_total",
            "counter",
            "Accepted requests the engine failed (500, or a stream's error event).",
            self.failed.load(Ordering::Relaxed),
        );
        one(
            "tarfa_contract_version",
            "gauge",
            "The exactness contract (docs/EXACTNESS.md) every number follows.",
            u64::from(tarfa_core::numerics::CONTRACT_VERSION),
        );
        let _ = writeln!(
            out,
            "# HELP tarfa_requests_refused_total Requests refused before they were queued, by \
             reason.\n# TYPE tarfa_requests_refused_total counter"
        );
        for (r, n) in Refusal::ALL.iter().zip(&self.refused) {
            let _ = writeln!(
                out,
                "tarfa_requests_refused_total{{reason=\"{}\"}} {}",
                r.label(),
                n.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP tarfa_requests_cancelled_total Accepted requests dropped before their end, \
             their sequences freed at the next step, by reason.\n\
             # TYPE tarfa_requests_cancelled_total counter"
        );
        for (c, n) in Cancel::ALL.iter().zip(&self.cancelled) {
            let _ = writeln!(
                out,
                "tarfa_requests_cancelled_total{{reason=\"{}\"}} {}",
                c.label(),
                n.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP tarfa_bundle_info The bundle served: its name and root digest (the SHA-256 \
             binding every weight's hash), and the exactness contract version.\n\
             # TYPE tarfa_bundle_info gauge\n\
             tarfa_bundle_info{{name=\"{}\",root_digest=\"{}\",contract_version=\"{}\"}} 1",
            label(id.name),
            label(id.root_digest),
            tarfa_core::numerics::CONTRACT_VERSION
        );
        if let Some(probe) = id.verification {
            let v = probe();
            let _ = writeln!(
                out,
                "# HELP tarfa_verification_checks_total Verification checks the bundle reader \
                 ran: the root digest at open, and every read of a copied file (SHA-256), tensor \
                 or expert (BLAKE3) against the manifest, before use.\n\
                 # TYPE tarfa_verification_checks_total counter"
            );
            for (what, n) in [
                ("root_digest", v.root_digest),
                ("file", v.files),
                ("tensor", v.tensors),
                ("expert", v.experts),
            ] {
                let _ = writeln!(
                    out,
                    "tarfa_verification_checks_total{{what=\"{what}\"}} {n}"
                );
            }
        }
        self.latency.lock().expect("metrics").write(
            &mut out,
            "tarfa_request_latency_seconds",
            "Time from a request's arrival to its last result.",
        );
        self.ttft.lock().expect("metrics").write(
            &mut out,
            "tarfa_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_move_by_reason_and_the_identity_is_escaped() {
        let m = Metrics::default();
        m.refused(Refusal::TooLong);
        m.refused(Refusal::TooLong);
        m.refused(Refusal::QueueFull);
        m.cancelled(Cancel::Deadline);
        let probe: VerificationProbe = Box::new(|| Verified {
            root_digest: 1,
            files: 2,
            tensors: 3,
            experts: 4,
        });
        let text = m.render(&Identity {
            name: "a\"b",
            root_digest: "ab12",
            verification: Some(&probe),
        });
        let info = format!(
            "tarfa_bundle_info{{name=\"a\\\"b\",root_digest=\"ab12\",contract_version=\"{}\"}} 1",
            tarfa_core::numerics::CONTRACT_VERSION
        );
        for line in [
            info.as_str(),
            "tarfa_requests_refused_total{reason=\"too_long\"} 2",
            "tarfa_requests_refused_total{reason=\"queue_full\"} 1",
            "tarfa_requests_refused_total{reason=\"bad_input\"} 0",
            "tarfa_requests_cancelled_total{reason=\"deadline\"} 1",
            "tarfa_requests_cancelled_total{reason=\"disconnect\"} 0",
            "tarfa_verification_checks_total{what=\"expert\"} 4",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in\n{text}");
        }
    }
}
