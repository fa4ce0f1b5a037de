//! `GET /metrics`: Prometheus text format (version 0.0.4), written by hand: a few counters,
//! gauges and two fixed-bucket histograms do not need a metrics registry.

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

/// The server's counters.
#[derive(Default)]
pub struct Metrics {
    waiting: AtomicU64,
    running: AtomicU64,
    tokens: AtomicU64,
    requests: AtomicU64,
    rejected: AtomicU64,
    latency: Mutex<Histogram>,
    ttft: Mutex<Histogram>,
}

impl Metrics {
    pub(crate) fn set_depths(&self, waiting: u64, running: u64) {
        self.waiting.store(waiting, Ordering::Relaxed);
        self.running.store(running, Ordering::Relaxed);
    }

    pub(crate) fn add_tokens(&self, n: u64) {
        self.tokens.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn rejected(&self) {
        self.rejected.fetch_add(1, Ordering::Relaxed);
    }

    /// A finished request: its latency, and its time to first token when it generated one.
    pub(crate) fn finished(&self, latency: f64, ttft: Option<f64>) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.latency.lock().expect("metrics").observe(latency);
        if let Some(t) = ttft {
            self.ttft.lock().expect("metrics").observe(t);
        }
    }

    pub(crate) fn render(&self) -> String {
        let mut out = String::new();
        let mut gauge = |name: &str, kind: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        };
        gauge(
            "tarfa_queue_depth",
            "gauge",
            "Requests waiting for a slot.",
            self.waiting.load(Ordering::Relaxed),
        );
        gauge(
            "tarfa_running_sequences",
            "gauge",
            "Requests in flight.",
            self.running.load(Ordering::Relaxed),
        );
        gauge(
            "tarfa_tokens_total",
            "counter",
            "Tokens run through the model.",
            self.tokens.load(Ordering::Relaxed),
        );
        gauge(
            "tarfa_requests_total",
            "counter",
            "Requests answered.",
            self.requests.load(Ordering::Relaxed),
        );
        gauge(
            "tarfa_requests_rejected_total",
            "counter",
            "Requests refused with 429 (queue full).",
            self.rejected.load(Ordering::Relaxed),
        );
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
