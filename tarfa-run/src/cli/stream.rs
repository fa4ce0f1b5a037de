//! The streaming options of `generate` (`--ram-budget`, `--vram-budget`, `--io`,
//! `--cache-policy`, `--lookahead`, `--no-ledger`, `--stats`), the start-up accounting of the
//! resident part, the heat ledger's load and save, and the `--stats` telemetry.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::bundle::BundleSource;
use crate::config::MoeConfig;
use crate::cuda::{min_vram_budget, HotOptions, HotStats};
use crate::stream::{
    format_bytes, mem_available, min_budget, parse_size, CachePolicy, HeatLedger, IoMode,
    Lookahead, ResidentPart, StreamError, StreamOptions, StreamSource, StreamStats,
    DEFAULT_IO_THREADS,
};
use clap::{Args, ValueEnum};
use serde_json::{json, Value};

use super::{peak_rss_bytes, CliError};

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum IoArg {
    /// O_DIRECT: one aligned read of each expert's padded extent, bypassing the page cache.
    Direct,
    /// Through the OS page cache (pread of each expert's extent).
    Cached,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum PolicyArg {
    /// Keep every expert read; evict the least recently used.
    Lru,
    /// Pin the heat ledger's hottest experts in half the budget; LRU for the rest.
    Ledger,
    /// Pin a fixed set (the ledger's hottest, else an even spread) in 3/4 of the budget; keep nothing else.
    Static,
    /// Keep nothing: every use reads (with --io cached: the OS page cache is the only cache).
    None,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum LookaheadArg {
    /// Read nothing before a layer's routes are known.
    Off,
    /// The heat ledger's hottest experts of the next layer (its counts and this run's uses).
    Ledger,
    /// This token's residual through the next layer's router (each token's top-k).
    Router,
    /// The router's guess, then the ledger's.
    Both,
}

/// The measured default (docs/PERFORMANCE.md, "CPU streaming").
pub const DEFAULT_IO: IoArg = IoArg::Cached;

/// Off until measured better (docs/PHASE_LOG.md S5).
pub const DEFAULT_LOOKAHEAD: LookaheadArg = LookaheadArg::Off;

/// The measured default (docs/PERFORMANCE.md, "CPU streaming" and "GPU streaming"): LRU, which
/// the trained fixture's routing favours at a 25% budget; pinning the heat ledger's hottest
/// (`ledger`, `static`) won only on the synthetic routers, with a ledger learned on the same
/// prompt.
pub const DEFAULT_POLICY: PolicyArg = PolicyArg::Lru;

fn size_arg(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

/// The most reader threads `--io-threads` accepts.
const MAX_IO_THREADS: usize = 256;

fn io_threads_arg(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=MAX_IO_THREADS).contains(&n) => Ok(n),
        _ => Err(format!(
            "expected a number of threads from 1 to {MAX_IO_THREADS}"
        )),
    }
}

#[derive(Args, Debug, Clone)]
pub struct StreamArgs {
    /// RAM for experts (the warm tier: cache, reads in flight and experts in use), in bytes or
    /// with K, M, G (2^10, 2^20, 2^30). Default: every expert stays once read, unless the
    /// machine's MemAvailable cannot hold them (then 80% of what the resident part leaves).
    #[arg(long, value_parser = size_arg, value_name = "SIZE")]
    pub ram_budget: Option<u64>,
    /// GPU memory for experts (the hot tier, staging included), as --ram-budget. With the CUDA
    /// backend only the dense weights are then uploaded, and experts are copied from the RAM
    /// tier as the router picks them. Default: every expert is uploaded at load.
    #[arg(long, value_parser = size_arg, value_name = "SIZE")]
    pub vram_budget: Option<u64>,
    /// How experts are read from the bundle [default: cached].
    #[arg(long, value_enum)]
    pub io: Option<IoArg>,
    /// What the RAM tier and the GPU tier keep [default: lru].
    #[arg(long, value_enum)]
    pub cache_policy: Option<PolicyArg>,
    /// Read the next MoE layer's likely experts into the RAM tier while this one computes,
    /// guessed from the heat ledger, from this token's residual through that layer's router, or
    /// both; a wrong guess costs reads, never bits. CPU backend [default: off].
    #[arg(long, value_enum)]
    pub lookahead: Option<LookaheadArg>,
    /// Neither read nor update the heat ledger (per-expert use counts kept across runs in the
    /// cache directory, used by --cache-policy ledger and static).
    #[arg(long)]
    pub no_ledger: bool,
    /// Reader threads: the most expert reads in flight at once (the I/O queue depth), 1 to 256.
    #[arg(long, default_value_t = DEFAULT_IO_THREADS, value_parser = io_threads_arg)]
    pub io_threads: usize,
    /// Print, per token and at the end, bytes read, tier hit rates, disk GB/s, the time split
    /// (I/O wait, host-to-device copy, compute, verification) and peak RSS. `generate` also
    /// prints each decode step's drafted and accepted tokens and, at the end, the decode steps,
    /// drafted, accepted, acceptance, tokens per step and decode tok/s (--speculate off too);
    /// --summary-json's `speculate` then carries every step's [drafted, accepted].
    #[arg(long)]
    pub stats: bool,
}

impl Default for StreamArgs {
    /// What `generate` gets without streaming flags (the demo's settings).
    fn default() -> Self {
        StreamArgs {
            ram_budget: None,
            vram_budget: None,
            io: None,
            cache_policy: None,
            lookahead: None,
            no_ledger: false,
            io_threads: DEFAULT_IO_THREADS,
            stats: false,
        }
    }
}

/// Where the RAM budget came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BudgetSource {
    Flag,
    Auto,
    Unbounded,
}

/// One forward step's figures.
struct StepRecord {
    kind: &'static str,
    tokens: usize,
    wall: Duration,
    delta: StreamStats,
    /// The GPU hot tier's counters for the step, when there is one.
    hot: Option<HotStats>,
    peak_rss: u64,
}

/// A streamed run: the source, its ledger, and what `--stats` reports.
pub struct StreamRun {
    pub source: Arc<StreamSource>,
    resident: ResidentPart,
    budget_source: BudgetSource,
    vram_budget: Option<u64>,
    ledger: Option<(PathBuf, HeatLedger, bool)>,
    stats: bool,
    steps: Vec<StepRecord>,
    step_start: Option<(Instant, StreamStats, Option<HotStats>)>,
    /// Counters when the first step began: what was read before (a backend loading every
    /// expert, `--preload`) is the load's, not the steps'.
    first_step: Option<StreamStats>,
    /// The hot tier's counters at the first step and after the last.
    hot_first: Option<HotStats>,
    hot_last: Option<HotStats>,
    progress: bool,
}

fn is_terminal(fd: i32) -> bool {
    // SAFETY: isatty only inspects the descriptor.
    unsafe { libc::isatty(fd) == 1 }
}

/// Opens the expert tiers for `bundle` under the flags: checks the resident part against
/// MemAvailable (exit 3) and the budgets against one expert (exit 2), loads the heat ledger,
/// prints the accounting.
pub fn open(
    a: &StreamArgs,
    bundle: Arc<BundleSource>,
    cfg: &MoeConfig,
    context: usize,
    quiet: bool,
    log: &dyn Fn(String),
) -> Result<StreamRun, CliError> {
    let io = match a.io.unwrap_or(DEFAULT_IO) {
        IoArg::Direct => IoMode::Direct,
        IoArg::Cached => IoMode::Cached,
    };
    let policy = match a.cache_policy.unwrap_or(DEFAULT_POLICY) {
        PolicyArg::Lru => CachePolicy::Lru,
        PolicyArg::Ledger => CachePolicy::Ledger,
        PolicyArg::Static => CachePolicy::Static,
        PolicyArg::None => CachePolicy::None,
    };
    let lookahead = match a.lookahead.unwrap_or(DEFAULT_LOOKAHEAD) {
        LookaheadArg::Off => Lookahead::Off,
        LookaheadArg::Ledger => Lookahead::Ledger,
        LookaheadArg::Router => Lookahead::Router,
        LookaheadArg::Both => Lookahead::Both,
    };
    let resident = ResidentPart::new(&bundle, cfg, context);
    let available = mem_available();
    if let Some(avail) = available {
        if resident.total() > avail {
            return Err(StreamError::ResidentTooLarge {
                needed: resident.total(),
                dense: resident.dense_bytes,
                kv: resident.kv_bytes,
                context,
                available: avail,
            }
            .into());
        }
    }
    let minimum = min_budget(&bundle, io);
    if let Some(v) = a.vram_budget {
        let minimum = min_vram_budget(cfg);
        if v < minimum {
            return Err(StreamError::BudgetTooSmall {
                flag: "--vram-budget",
                budget: v,
                minimum,
            }
            .into());
        }
    }
    let all_experts: u64 = bundle
        .expert_extents()
        .iter()
        .map(|(e, _)| io.buffer_bytes(e))
        .sum();
    let (ram_budget, budget_source) = match (a.ram_budget, available) {
        (Some(b), _) => (Some(b), BudgetSource::Flag),
        (None, Some(avail)) if resident.total().saturating_add(all_experts) > avail => {
            // Leave a fifth of what the resident part leaves for the page cache, activations and
            // everything else in the process.
            let auto = (avail - resident.total()) / 5 * 4;
            if auto < minimum {
                return Err(StreamError::NoRoomForAnExpert {
                    available: avail,
                    resident: resident.total(),
                    minimum,
                }
                .into());
            }
            (Some(auto), BudgetSource::Auto)
        }
        _ => (None, BudgetSource::Unbounded),
    };
    if let (Some(b), Some(avail)) = (ram_budget, available) {
        if resident.total().saturating_add(b) > avail {
            log(format!(
                "warning: the resident part and --ram-budget ({} + {}) exceed MemAvailable ({})",
                format_bytes(resident.total()),
                format_bytes(b),
                format_bytes(avail)
            ));
        }
    }
    // The ledger matters only when something has to be evicted; an unbounded run neither
    // reads nor writes it.
    let ledger = if a.no_ledger || (ram_budget.is_none() && a.vram_budget.is_none()) {
        None
    } else {
        let root = super::cache_root(None);
        match HeatLedger::path(&root, bundle.root_digest()) {
            Some(path) => {
                let got =
                    HeatLedger::load(&path, bundle.root_digest(), cfg.num_layers, cfg.num_experts);
                if let Some(w) = &got.warning {
                    log(format!("warning: {w}"));
                }
                Some((path, got.ledger, got.found))
            }
            None => None,
        }
    };
    let opts = StreamOptions {
        ram_budget,
        io,
        policy,
        io_threads: a.io_threads,
        lookahead,
    };
    // What the converter left out of the model (a multimodal release's vision tower, its
    // multi-token-prediction layers): the run says so, as the manifest does.
    for key in ["multimodal", "skipped"] {
        if let Some(note) = bundle.manifest().source.get(key) {
            log(format!("bundle: {note}"));
        }
    }
    let source = Arc::new(StreamSource::new(
        bundle,
        &opts,
        ledger.as_ref().map(|l| &l.1),
    )?);

    let states = match resident.linear_state_bytes {
        0 => String::new(),
        b => format!(
            " + {} linear-attention state ({} gated DeltaNet layers)",
            format_bytes(b),
            cfg.layer_linear.iter().filter(|&&l| l).count()
        ),
    };
    log(format!(
        "resident: {} dense weights + {} KV cache for {context} positions{states} = {}",
        format_bytes(resident.dense_bytes),
        format_bytes(resident.kv_bytes),
        format_bytes(resident.total())
    ));
    let (pins, pin_bytes) = source.store().pinned();
    log(format!(
        "experts: {} in the bundle; RAM budget {} ({}); VRAM budget {}; io {}; cache {}{}{}{}",
        format_bytes(all_experts),
        ram_budget.map_or("unbounded".to_string(), format_bytes),
        match budget_source {
            BudgetSource::Flag => "--ram-budget",
            BudgetSource::Auto => "auto: 80% of MemAvailable less the resident part",
            BudgetSource::Unbounded => "every expert stays once read",
        },
        match a.vram_budget {
            Some(v) => format!(
                "{} ({} experts; CUDA backend)",
                format_bytes(v),
                v / min_vram_budget(cfg)
            ),
            None => "none (CUDA: every expert uploaded at load)".into(),
        },
        io.name(),
        policy.name(),
        match lookahead {
            Lookahead::Off => String::new(),
            l => format!("; lookahead {}", l.name()),
        },
        if pins > 0 {
            format!(", {pins} experts pinned ({})", format_bytes(pin_bytes))
        } else {
            String::new()
        },
        match &ledger {
            Some((p, l, true)) => format!(", ledger {} ({} runs)", p.display(), l.runs),
            Some((p, _, false)) => format!(", ledger {} (new)", p.display()),
            None => String::new(),
        }
    ));
    Ok(StreamRun {
        source,
        resident,
        budget_source,
        vram_budget: a.vram_budget,
        ledger,
        stats: a.stats && !quiet,
        steps: Vec::new(),
        step_start: None,
        first_step: None,
        hot_first: None,
        hot_last: None,
        progress: !quiet && is_terminal(2),
    })
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

fn pct(r: Option<f64>) -> String {
    r.map_or("n/a".into(), |r| format!("{:.1}%", 100.0 * r))
}

fn gbs(r: Option<f64>) -> String {
    r.map_or("n/a".into(), |r| format!("{r:.2} GB/s"))
}

impl StreamRun {
    /// Read every expert now (`--preload`).
    pub fn preload(&self) -> Result<(), CliError> {
        if self.source.store().policy() == CachePolicy::None {
            return Err(CliError::Usage(
                "--preload keeps every expert; --cache-policy none keeps none".into(),
            ));
        }
        if let Some(cap) = self.source.store().capacity() {
            let all = self.source.store().total_buffer_bytes();
            if all > cap {
                return Err(CliError::Usage(format!(
                    "--preload needs a RAM budget of {} (every expert); it is {}",
                    format_bytes(all),
                    format_bytes(cap)
                )));
            }
        }
        self.source.preload().map_err(|e| CliError::Run(e.into()))
    }

    /// The GPU hot tier the flags ask for (`--vram-budget`): the RAM tier's policy, and the
    /// heat ledger's hottest experts as the pins of `ledger` and `static`.
    pub fn hot_options(&self) -> Option<HotOptions> {
        let budget = self.vram_budget?;
        Some(HotOptions {
            budget,
            policy: self.source.store().policy(),
            pins: self
                .ledger
                .as_ref()
                .map(|(_, l, _)| l.hottest())
                .unwrap_or_default(),
        })
    }

    /// With `--lookahead`, the reads a step started and nobody waited for (look-ahead reads
    /// whose guess ended: at most --io-threads of them, and by the end of the step almost
    /// always done) finish before its figures are taken: every read the step started is
    /// counted (read, and used, wasted or held) in that step, the steps add up to the totals,
    /// and nothing changes them after the last one (docs/PHASE_LOG.md S5). Without look-ahead
    /// nothing waits (a CPU step leaves no read in flight; the CUDA backend's own reads are not
    /// held up).
    fn settle(&self) {
        if self.source.lookahead_mode() != Lookahead::Off {
            self.source.store().settle();
        }
    }

    /// Before a forward step; `hot`: the hot tier's counters now (CUDA streaming).
    pub fn begin(&mut self, prefill: bool, hot: Option<HotStats>) {
        if prefill && self.progress {
            self.source.set_progress(Some(Box::new(|layer, layers| {
                eprint!("\rprefill: layer {}/{layers}\x1b[K", layer + 1);
            })));
        }
        self.settle();
        let now = self.source.stats();
        self.first_step.get_or_insert(now);
        if self.hot_first.is_none() {
            self.hot_first = hot;
        }
        self.step_start = Some((Instant::now(), now, hot));
    }

    /// After a forward step of `tokens` tokens: records (and with `--stats` prints) its figures.
    pub fn end(&mut self, prefill: bool, tokens: usize, hot: Option<HotStats>) {
        if prefill && self.progress {
            self.source.set_progress(None);
            eprint!("\r\x1b[K");
        }
        let Some((t0, before, hot_before)) = self.step_start.take() else {
            return;
        };
        self.hot_last = hot;
        self.settle();
        let rec = StepRecord {
            kind: if prefill { "prefill" } else { "decode" },
            tokens,
            wall: t0.elapsed(),
            delta: self.source.stats().since(&before),
            hot: hot.zip(hot_before).map(|(a, b)| a.since(&b)),
            peak_rss: peak_rss_bytes(),
        };
        if self.stats {
            let label = if prefill {
                format!("prefill ({tokens} tokens)")
            } else {
                format!("token {}", self.steps.len())
            };
            eprintln!("[stats] {label}: {}", line(&rec));
        }
        self.steps.push(rec);
    }

    /// The summary's "stream" value.
    /// Counters of the load (before the first step) and of the steps.
    fn load_and_steps(&self) -> (StreamStats, StreamStats) {
        let now = self.source.stats();
        let load = self.first_step.unwrap_or(now);
        (load, now.since(&load))
    }

    pub fn summary(&self) -> Value {
        let (load, total) = self.load_and_steps();
        let wall: Duration = self.steps.iter().map(|s| s.wall).sum();
        let store = self.source.store();
        let (pins, pin_bytes) = store.pinned();
        json!({
            "io": store.io().name(),
            "bytes_read_per_miss": match store.io() {
                IoMode::Direct => "padded_length",
                IoMode::Cached => "length",
            },
            "policy": store.policy().name(),
            "lookahead": self.source.lookahead_mode().name(),
            // reads = misses + lookahead_hits + wasted_reads + unclaimed_reads (at the end)
            "unclaimed_reads": store.unclaimed_reads(),
            "ram_budget_bytes": store.capacity(),
            "ram_budget_source": match self.budget_source {
                BudgetSource::Flag => "flag",
                BudgetSource::Auto => "auto",
                BudgetSource::Unbounded => "unbounded",
            },
            "vram_budget_bytes": self.vram_budget,
            "hot_tier": self.hot_total().map(|h| json!({
                "slots": h.slots,
                "pool_bytes": h.pool_bytes,
                "requests": h.requests,
                "hits": h.hits,
                "hit_rate": h.hit_rate(),
                "uploads": h.uploads,
                "h2d_bytes": h.h2d_bytes,
                "h2d_ms": ms(h.h2d_ns),
                "fetch_wait_ms": ms(h.fetch_wait_ns),
                "evictions": h.evictions,
                "peak_vram_bytes": h.peak_vram_bytes,
            })),
            "resident": self.resident,
            "expert_bytes": store.total_buffer_bytes(),
            "pinned_experts": pins,
            "pinned_bytes": pin_bytes,
            "ledger": self.ledger.as_ref().map(|(p, l, found)| json!({
                "path": p, "found": found, "runs_before": l.runs,
            })),
            "load": figures(&load, None, Duration::ZERO, peak_rss_bytes()),
            "totals": figures(&total, self.hot_total().as_ref(), wall, peak_rss_bytes()),
            "verification": {
                "bytes_hashed": total.verified_bytes,
                "hash_ms": ms(total.verify_ns),
                "hash_gb_s_per_core": total.verify_gb_s(),
                "share_of_run_wall": if wall.is_zero() { Value::Null } else { json!(total.verify_ns as f64 / wall.as_nanos() as f64) },
            },
            "steps": self.steps.iter().map(|s| {
                let mut v = figures(&s.delta, s.hot.as_ref(), s.wall, s.peak_rss);
                v["kind"] = json!(s.kind);
                v["tokens"] = json!(s.tokens);
                v
            }).collect::<Vec<_>>(),
        })
    }

    /// The hot tier's counters over the steps.
    fn hot_total(&self) -> Option<HotStats> {
        self.hot_last
            .zip(self.hot_first)
            .map(|(last, first)| last.since(&first))
    }

    /// After the run: prints the totals (`--stats`) and updates the heat ledger.
    pub fn finish(&self, log: &dyn Fn(String)) {
        let (load, total) = self.load_and_steps();
        if self.stats {
            if load.reads > 0 {
                eprintln!(
                    "[stats] load (before the first step): {} read and verified in {} reads, {:.1} ms of hashing",
                    format_bytes(load.bytes_read),
                    load.reads,
                    ms(load.verify_ns)
                );
            }
            let wall: Duration = self.steps.iter().map(|s| s.wall).sum();
            let rec = StepRecord {
                kind: "total",
                tokens: 0,
                wall,
                delta: total,
                hot: self.hot_total(),
                peak_rss: peak_rss_bytes(),
            };
            eprintln!("[stats] total: {}", line(&rec));
            eprintln!(
                "[stats] verification: {} hashed (BLAKE3) in {:.1} ms of reader-thread CPU ({}/core; {:.1}% of the run's {:.1} ms wall); {} evictions; peak warm tier {}",
                format_bytes(total.verified_bytes),
                ms(total.verify_ns),
                gbs(total.verify_gb_s()),
                if wall.is_zero() { 0.0 } else { 100.0 * total.verify_ns as f64 / wall.as_nanos() as f64 },
                wall.as_secs_f64() * 1e3,
                total.evictions,
                format_bytes(total.peak_warm_bytes),
            );
            if total.decoded_bytes > 0 {
                eprintln!(
                    "[stats] decoding: {} decoded from encoded extents in {:.1} ms of reader-thread CPU ({}/core)",
                    format_bytes(total.decoded_bytes),
                    ms(total.decode_ns),
                    gbs(total.decode_gb_s()),
                );
            }
        }
        if let Some((path, ledger, _)) = &self.ledger {
            let mut l = ledger.clone();
            l.record(&self.source.store().heat());
            if let Err(e) = l.save(path) {
                log(format!(
                    "warning: cannot write the heat ledger {}: {e}",
                    path.display()
                ));
            }
        }
    }
}

fn figures(s: &StreamStats, hot: Option<&HotStats>, wall: Duration, peak_rss: u64) -> Value {
    let wall_ns = wall.as_nanos().min(u64::MAX as u128) as u64;
    let h2d_ns = hot.map_or(0, |h| h.h2d_ns);
    json!({
        "wall_ms": ms(wall_ns),
        "bytes_read": s.bytes_read,
        "reads": s.reads,
        "wasted_reads": s.wasted_reads,
        "requests": s.requests,
        "warm_hits": s.warm_hits,
        "misses": s.misses,
        "warm_hit_rate": s.warm_hit_rate(),
        // --lookahead: requests served by a read started before them; what was guessed, and
        // what the guesses read and wasted
        "lookahead_hits": s.lookahead_hits,
        "ahead_hit_rate": s.ahead_hit_rate(),
        "lookahead_guessed": s.lookahead_guessed,
        "lookahead_right": s.lookahead_right,
        "lookahead_needed": s.lookahead_needed,
        "lookahead_precision": s.lookahead_precision(),
        "lookahead_recall": s.lookahead_recall(),
        "lookahead_reads": s.lookahead_reads,
        "lookahead_bytes": s.lookahead_bytes,
        "lookahead_wasted": s.lookahead_wasted,
        "lookahead_wasted_bytes": s.lookahead_wasted_bytes,
        "hot_hit_rate": hot.and_then(HotStats::hit_rate),
        "hot_requests": hot.map(|h| h.requests),
        "hot_hits": hot.map(|h| h.hits),
        "disk_gb_s": s.disk_gb_s(),
        "read_busy_ms": ms(s.read_busy_ns),
        "io_wait_ms": ms(s.io_wait_ns),
        "h2d_ms": hot.map(|h| ms(h.h2d_ns)),
        "h2d_bytes": hot.map(|h| h.h2d_bytes),
        "compute_ms": ms(wall_ns.saturating_sub(s.io_wait_ns).saturating_sub(h2d_ns)),
        "verify_ms": ms(s.verify_ns),
        "verified_bytes": s.verified_bytes,
        // format version 2: encoded extents decoded on the reader threads (0 for raw bundles)
        "decode_ms": ms(s.decode_ns),
        "decoded_bytes": s.decoded_bytes,
        "pin_ms": ms(s.pin_ns),
        "evictions": s.evictions,
        "peak_warm_bytes": s.peak_warm_bytes,
        "peak_rss_bytes": peak_rss,
        "peak_vram_bytes": hot.map(|h| h.peak_vram_bytes),
    })
}

fn line(r: &StepRecord) -> String {
    let s = &r.delta;
    let wall_ns = r.wall.as_nanos().min(u64::MAX as u128) as u64;
    let h2d_ns = r.hot.map_or(0, |h| h.h2d_ns);
    let (hot, h2d, vram) = match &r.hot {
        Some(h) => (
            format!("hot hits {}/{} ({})", h.hits, h.requests, pct(h.hit_rate())),
            format!("h2d {:.1} ms ({})", ms(h.h2d_ns), format_bytes(h.h2d_bytes)),
            format!(", peak VRAM {}", format_bytes(h.peak_vram_bytes)),
        ),
        None => ("hot n/a".into(), "h2d n/a".into(), String::new()),
    };
    // shown once a guess was scored or read (--lookahead)
    let ahead = if s.lookahead_guessed + s.lookahead_reads + s.lookahead_hits > 0 {
        format!(
            " | lookahead hits {}/{} ({} served ahead), guessed {}/{} right ({} of needs), {} reads ({}), {} wasted ({})",
            s.lookahead_hits,
            s.requests,
            pct(s.ahead_hit_rate()),
            s.lookahead_right,
            s.lookahead_guessed,
            pct(s.lookahead_recall()),
            s.lookahead_reads,
            format_bytes(s.lookahead_bytes),
            s.lookahead_wasted,
            format_bytes(s.lookahead_wasted_bytes),
        )
    } else {
        String::new()
    };
    format!(
        "disk {} in {} reads | warm hits {}/{} ({}){ahead} | {hot} | disk {} | io-wait {:.1} ms, {h2d}, compute {:.1} ms, verify {:.1} ms | peak RSS {}{vram}",
        format_bytes(s.bytes_read),
        s.reads,
        s.warm_hits,
        s.requests,
        pct(s.warm_hit_rate()),
        gbs(s.disk_gb_s()),
        ms(s.io_wait_ns),
        ms(wall_ns.saturating_sub(s.io_wait_ns).saturating_sub(h2d_ns)),
        ms(s.verify_ns),
        format_bytes(r.peak_rss),
    )
}
