//! Expert streaming, end to end: for every RAM budget (everything resident down to one expert),
//! every I/O mode and every cache policy, the logits files equal the resident run's byte for
//! byte (prefill rows included), and the resident run equals the in-process bundle source that
//! keeps every expert; the accounting adds up (bytes read = misses x extent size, the warm tier
//! never exceeds its budget, peak RSS stays under resident + budget + slack); a bundle that
//! changes during a run stops it with a verification error before anything is computed from
//! the new bytes; bad budgets, a corrupt heat ledger and an impossible resident part get their
//! documented outcomes. Look-ahead reads (`--lookahead`), right, wrong or forced wrong, change
//! what is read and nothing else.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use common::synthetic::{config_json, parse, random_source};
use safetensors::SafeTensors;
use serde_json::{json, Value};
use tarfa_convert::synth::{self, OutputFormat, SynthOptions, SynthShape};
use tarfa_run::bundle::BundleSource;
use tarfa_run::cpu::{CpuEngine, CpuModel, EngineOptions, ForwardOptions, LogitRows};
use tarfa_run::generate::greedy;
use tarfa_run::model::MlpKind;
use tarfa_run::numerics::Kernel;
use tarfa_run::stream::{CachePolicy, IoMode, Lookahead, StreamError, StreamOptions, StreamSource};
use tarfa_run::weights::{
    ExpertHandle, ExpertWeights, HostTensor, InMemorySource, LookaheadInput, WeightError,
    WeightSource,
};
use tarfa_run::RunError;

const BIN: &str = env!("CARGO_BIN_EXE_tarfa-run");

/// Bytes of RSS a streamed run may use beyond its resident part and RAM budget: the binary and
/// its libraries, thread stacks, the allocator's arenas, the tokenizer, activations and the
/// logits of a short run. Measured at 10-14 MiB on the fixtures; 32 MiB leaves room for other
/// allocators without hiding a budget overrun (the model below has 192 MiB of experts).
const RSS_SLACK: u64 = 32 << 20;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/oracle")
        .join(name)
}

/// Under the build's target directory, not the system temp dir: `--io direct` needs a file
/// system with O_DIRECT, which a tmpfs /tmp is not. One fixed directory, emptied when the first
/// test starts: a static is never dropped, so a temporary directory would outlive every run
/// (this one holds ~250 MB of bundles).
fn workdir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("tarfa-run-streaming-tests");
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    })
}

/// A fixture converted to a bundle, or a synthetic bundle, shared by the tests of this file.
fn bundle(name: &'static str) -> PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let out = workdir().join(name);
    if !out.exists() {
        if let Some(shape) = name.strip_prefix("synth-") {
            // `synth-<shape>@<layers>`: the shape with that many layers
            let (shape, layers) = match shape.split_once('@') {
                Some((s, n)) => (s, Some(n.parse::<u32>().unwrap())),
                None => (shape, None),
            };
            let mut shape = synth::shapes()
                .into_iter()
                .find(|s| s.name == shape)
                .unwrap_or_else(|| panic!("no synthetic shape {shape}"));
            if let Some(n) = layers {
                shape.layers = n;
            }
            write_synth(&out, shape);
        } else if let Some(fixture_name) = name.strip_suffix("+exp-zstd") {
            // Format version 2: every extent stored with the exponent-plane codec.
            let opts = tarfa_convert::ConvertOptions {
                codec: tarfa_convert::CodecChoice::ExponentPlaneZstd,
                ..Default::default()
            };
            tarfa_convert::convert(&fixture(fixture_name), &out, &opts).unwrap();
        } else {
            tarfa_convert::convert(&fixture(name), &out, &Default::default()).unwrap();
        }
    }
    out
}

fn write_synth(out: &Path, shape: SynthShape) {
    let opts = SynthOptions {
        shape,
        seed: 7,
        skew: 1.0,
        format: OutputFormat::Bundle,
        shard_bytes: 1 << 30,
        force: true,
    };
    synth::synth(out, &opts).unwrap();
}

/// A copy of a bundle that a test may damage.
fn copy_bundle(src: &Path, tag: &str) -> PathBuf {
    let dst = workdir().join(format!("copy-{tag}"));
    let _ = fs::remove_dir_all(&dst);
    fs::create_dir_all(&dst).unwrap();
    for e in fs::read_dir(src).unwrap().flatten() {
        fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    dst
}

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

/// Runs the binary with its heat ledger under `cache`.
fn run(args: &[String], cache: &Path) -> Out {
    let o = Command::new(BIN)
        .args(args)
        .env("TARFA_CACHE_DIR", cache)
        .output()
        .unwrap();
    Out {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into(),
        stderr: String::from_utf8_lossy(&o.stderr).into(),
    }
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

struct Model {
    dir: PathBuf,
    manifest: tarfa_manifest::Manifest,
    header: jnf_format::Header,
    prompt: Vec<u32>,
}

impl Model {
    fn new(name: &'static str) -> Model {
        let dir = bundle(name);
        let manifest = tarfa_manifest::Manifest::load(&dir.join("manifest.toml")).unwrap();
        let header = jnf_format::JnfFile::open(&dir.join("model.jnf"))
            .unwrap()
            .header()
            .clone();
        let cfg: Value =
            serde_json::from_slice(&fs::read(dir.join("config.json")).unwrap()).unwrap();
        let vocab = cfg["vocab_size"].as_u64().unwrap() as u32;
        // 24 tokens spread over the vocabulary: most experts of every layer get routed to.
        let prompt = (0..24u32).map(|i| (i * 37 + 11) % vocab).collect();
        Model {
            dir,
            manifest,
            header,
            prompt,
        }
    }

    fn tokens_arg(&self) -> String {
        self.prompt
            .iter()
            .map(|t| t.to_string())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Bytes an expert buffer occupies, what the budget is charged: the padded extent.
    fn buf_size(&self) -> u64 {
        self.read_size("direct")
    }

    /// Bytes one read of an expert transfers (all experts of these models have one size).
    fn read_size(&self, io: &str) -> u64 {
        let sizes: std::collections::BTreeSet<u64> = self
            .header
            .experts
            .iter()
            .map(|e| {
                if io == "direct" {
                    e.padded_length
                } else {
                    e.length
                }
            })
            .collect();
        assert_eq!(sizes.len(), 1, "uniform experts");
        *sizes.iter().next().unwrap()
    }

    fn expert_bytes(&self) -> u64 {
        self.buf_size() * self.header.experts.len() as u64
    }

    /// `generate` with the logits of every position, `extra` flags appended.
    fn generate(&self, tag: &str, extra: &[String], cache: &Path) -> (Out, Vec<u8>, Value) {
        let logits = workdir().join(format!("{tag}.safetensors"));
        let summary = workdir().join(format!("{tag}.json"));
        let mut args = s(&["generate", self.dir.to_str().unwrap(), "--tokens"]);
        args.push(self.tokens_arg());
        args.extend(s(&[
            "--max-new-tokens",
            "4",
            "--ignore-eos",
            "--prefill-logits",
        ]));
        args.extend(s(&[
            "--logits-out",
            logits.to_str().unwrap(),
            "--summary-json",
            summary.to_str().unwrap(),
        ]));
        args.extend(extra.iter().cloned());
        let out = run(&args, cache);
        assert_eq!(out.code, 0, "{tag} {extra:?}: {}", out.stderr);
        let bytes = fs::read(&logits).unwrap();
        let sum: Value = serde_json::from_slice(&fs::read(&summary).unwrap()).unwrap();
        (out, bytes, sum)
    }
}

fn f32_rows(st: &SafeTensors, name: &str) -> Vec<Vec<u32>> {
    let t = st.tensor(name).unwrap();
    let cols = t.shape()[1];
    let bits: Vec<u32> = t
        .data()
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    bits.chunks(cols).map(|r| r.to_vec()).collect()
}

fn bits(rows: &[Vec<f32>]) -> Vec<Vec<u32>> {
    rows.iter()
        .map(|r| r.iter().map(|v| v.to_bits()).collect())
        .collect()
}

/// The logits the in-process [`BundleSource`] (every expert kept once read, no store) computes.
fn resident_logits(m: &Model) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let src = Arc::new(BundleSource::open(&m.dir, None).unwrap());
    let cfg = tarfa_run::config::MoeConfig::from_json_str(
        &String::from_utf8(src.read_file("config.json").unwrap()).unwrap(),
    )
    .unwrap();
    let model = Arc::new(CpuModel::load(cfg, src).unwrap());
    let eng = CpuEngine::new(
        model.clone(),
        EngineOptions {
            threads: 2,
            kernel: Kernel::best(),
        },
    )
    .unwrap();
    let mut cache = model.new_cache();
    let opts = ForwardOptions {
        logits: LogitRows::All,
        ..Default::default()
    };
    let g = greedy(&eng, &mut cache, &m.prompt, 4, &opts).unwrap();
    (bits(&g.prefill.logits), bits(&g.step_logits))
}

/// Checks one streamed run's accounting against its budget and I/O mode.
fn check_accounting(
    m: &Model,
    what: &str,
    st: &Value,
    io: &str,
    policy: &str,
    budget: Option<u64>,
) {
    let t = &st["totals"];
    let n = |k: &str| {
        t[k].as_u64()
            .unwrap_or_else(|| panic!("{what}: {k} in {t}"))
    };
    assert_eq!(st["io"], io, "{what}");
    assert_eq!(st["policy"], policy, "{what}");
    assert_eq!(
        st["bytes_read_per_miss"],
        if io == "direct" {
            "padded_length"
        } else {
            "length"
        },
        "{what}"
    );
    assert_eq!(n("reads"), n("misses"), "{what}: every read was used");
    assert_eq!(n("wasted_reads"), 0, "{what}");
    assert_eq!(
        n("bytes_read"),
        n("misses") * m.read_size(io),
        "{what}: bytes read = misses x extent size"
    );
    assert_eq!(
        n("verified_bytes"),
        n("reads") * m.read_size("cached"),
        "{what}: every read hashed"
    );
    assert_eq!(n("requests"), n("warm_hits") + n("misses"), "{what}");
    if let Some(b) = budget {
        assert!(
            n("peak_warm_bytes") <= b,
            "{what}: warm tier peaked at {} over {b}",
            n("peak_warm_bytes")
        );
        assert_eq!(st["ram_budget_bytes"], b, "{what}");
    }
    if policy == "none" {
        assert_eq!(n("warm_hits"), 0, "{what}: no cache, every use reads");
    }
    if budget.is_none() && policy != "none" {
        assert!(
            n("misses") <= m.header.experts.len() as u64,
            "{what}: each expert read at most once"
        );
    }
    // per-step figures add up to the totals
    let steps = st["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 4, "{what}: prefill and 3 decode steps");
    let sum = |k: &str| steps.iter().map(|s| s[k].as_u64().unwrap()).sum::<u64>();
    assert_eq!(sum("bytes_read"), n("bytes_read"), "{what}");
    assert_eq!(sum("requests"), n("requests"), "{what}");
}

/// The sweep: budgets x I/O modes x policies, on every fixture converted to a bundle and on a
/// synthetic tiny bundle.
#[test]
fn every_budget_io_mode_and_policy_gives_the_resident_bits() {
    for name in [
        "qwen3moe-a",
        "qwen3moe-odd",
        "qwen3moe-dense",
        "qwen3moe-code",
        "synth-tiny",
    ] {
        let m = Model::new(name);
        let cache = workdir().join(format!("cache-{name}"));
        let (_, reference, ref_summary) = m.generate(&format!("{name}-ref"), &[], &cache);
        // The streamed run with everything resident equals the bundle source without a store.
        let st = SafeTensors::deserialize(&reference).unwrap();
        let (prefill, steps) = resident_logits(&m);
        assert!(
            f32_rows(&st, "prefill_logits") == prefill,
            "{name}: prefill rows"
        );
        assert!(f32_rows(&st, "logits") == steps, "{name}: step rows");
        assert_eq!(ref_summary["stream"]["ram_budget_source"], "unbounded");
        assert!(
            !cache.join("ledger").exists(),
            "an unbounded run keeps no ledger"
        );

        let mut runs = 0;
        for io in ["direct", "cached"] {
            let one = m.buf_size();
            let budgets = [None, Some(m.expert_bytes() / 4), Some(3 * one), Some(one)];
            // ledger after lru: the ledger and static policies then pin from real history
            for policy in ["lru", "ledger", "static", "none"] {
                for budget in budgets {
                    let mut extra = s(&["--io", io, "--cache-policy", policy]);
                    if let Some(b) = budget {
                        extra.extend(["--ram-budget".to_string(), b.to_string()]);
                    }
                    let what = format!("{name} io={io} policy={policy} budget={budget:?}");
                    let (_, got, sum) = m.generate(&format!("{name}-x"), &extra, &cache);
                    assert!(
                        got == reference,
                        "{what}: logits file differs from the resident run"
                    );
                    check_accounting(&m, &what, &sum["stream"], io, policy, budget);
                    runs += 1;
                }
            }
        }
        assert_eq!(runs, 32);
        // the budgeted runs learned a ledger
        let ledgers: Vec<_> = fs::read_dir(cache.join("ledger"))
            .unwrap()
            .flatten()
            .collect();
        assert_eq!(ledgers.len(), 1, "{name}");
    }
}

/// A smaller budget reads more, and the ledger policy, once it has history, hits where LRU
/// thrashes (4 layers cycling through more experts than fit).
#[test]
fn policies_differ_only_in_what_they_read() {
    let m = Model::new("qwen3moe-a");
    let cache = workdir().join("cache-policies");
    let budget = (20 * m.buf_size()).to_string();
    let read = |policy: &str| {
        let extra = s(&[
            "--io",
            "cached",
            "--cache-policy",
            policy,
            "--ram-budget",
            &budget,
        ]);
        let (_, _, sum) = m.generate(&format!("pol-{policy}"), &extra, &cache);
        sum["stream"]["totals"].clone()
    };
    let lru = read("lru");
    let ledger = read("ledger");
    let none = read("none");
    let hits = |t: &Value| t["warm_hits"].as_u64().unwrap();
    let bytes = |t: &Value| t["bytes_read"].as_u64().unwrap();
    assert_eq!(hits(&none), 0);
    assert!(
        hits(&ledger) > hits(&lru),
        "ledger {} vs lru {}",
        hits(&ledger),
        hits(&lru)
    );
    assert!(bytes(&ledger) < bytes(&none));
    // unbounded: each expert used is read exactly once
    let (_, _, sum) = m.generate("pol-unbounded", &s(&["--io", "cached"]), &cache);
    let t = &sum["stream"]["totals"];
    assert!(bytes(t) < bytes(&lru));
    assert_eq!(
        t["misses"].as_u64().unwrap() * m.read_size("cached"),
        bytes(t)
    );
}

/// The ledger is written atomically under the cache directory, counts the run's uses, and a
/// corrupt or foreign one is ignored with a warning without changing a bit.
#[test]
fn heat_ledger_is_learned_and_bad_ledgers_are_ignored() {
    let m = Model::new("qwen3moe-a");
    let other = Model::new("qwen3moe-odd");
    let cache = workdir().join("cache-ledger");
    let budget = (8 * m.buf_size()).to_string();
    let extra = s(&["--ram-budget", &budget, "--cache-policy", "ledger"]);
    let (_, first, sum) = m.generate("ledger-1", &extra, &cache);
    let path = cache
        .join("ledger")
        .join(format!("{}.json", m.manifest.root_digest));
    let l: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    assert_eq!(l["runs"], 1);
    assert_eq!(l["root_digest"], m.manifest.root_digest);
    let uses: u64 = l["counts"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r.as_array().unwrap())
        .map(|c| c.as_u64().unwrap())
        .sum();
    assert_eq!(
        uses,
        sum["stream"]["totals"]["requests"].as_u64().unwrap(),
        "one use per request"
    );
    let (out, second, sum2) = m.generate("ledger-2", &extra, &cache);
    assert!(second == first);
    assert!(
        sum2["stream"]["pinned_experts"].as_u64().unwrap() > 0,
        "{}",
        out.stderr
    );
    let l: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    assert_eq!(l["runs"], 2);

    // corrupt, foreign, misshapen: a warning, the same bits, and a fresh ledger written
    let (_, _, _) = other.generate(
        "ledger-other",
        &s(&["--ram-budget", &(4 * other.buf_size()).to_string()]),
        &cache,
    );
    let foreign = fs::read(
        cache
            .join("ledger")
            .join(format!("{}.json", other.manifest.root_digest)),
    )
    .unwrap();
    let good = fs::read(&path).unwrap();
    let bad_shape =
        String::from_utf8(good.clone())
            .unwrap()
            .replacen("\"experts\":32", "\"experts\":31", 1);
    for (what, bytes) in [
        ("garbage", b"{\"format\": [".to_vec()),
        ("foreign", foreign),
        ("shape", bad_shape.into_bytes()),
    ] {
        fs::write(&path, &bytes).unwrap();
        let (out, got, sum) = m.generate("ledger-bad", &extra, &cache);
        assert!(got == first, "{what}: a bad ledger changed the logits");
        assert!(
            out.stderr.contains("ledger") && out.stderr.contains("ignored"),
            "{what}: {}",
            out.stderr
        );
        assert_eq!(sum["stream"]["ledger"]["found"], false, "{what}");
        let l: Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        assert_eq!(l["runs"], 1, "{what}: replaced by this run's ledger");
    }
    // --no-ledger neither reads nor writes
    let fresh = workdir().join("cache-noledger");
    let mut e = extra.clone();
    e.push("--no-ledger".into());
    let (_, got, sum) = m.generate("ledger-off", &e, &fresh);
    assert!(got == first);
    assert!(sum["stream"]["ledger"].is_null());
    assert!(!fresh.join("ledger").exists());
}

/// `--stats` prints per token and at the end, and the summary carries the same figures.
#[test]
fn stats_are_printed_per_token_and_at_the_end() {
    let m = Model::new("qwen3moe-code");
    let cache = workdir().join("cache-stats");
    let budget = (6 * m.buf_size()).to_string();
    let (out, _, sum) = m.generate(
        "stats",
        &s(&["--stats", "--io", "direct", "--ram-budget", &budget]),
        &cache,
    );
    for needle in [
        "[stats] prefill (24 tokens):",
        "[stats] token 1:",
        "[stats] token 3:",
        "[stats] total:",
        "[stats] verification:",
    ] {
        assert!(out.stderr.contains(needle), "{needle}: {}", out.stderr);
    }
    for needle in [
        "warm hits",
        "hot n/a",
        "GB/s",
        "io-wait",
        "h2d n/a",
        "compute",
        "verify",
        "peak RSS",
    ] {
        assert!(out.stderr.contains(needle), "{needle}: {}", out.stderr);
    }
    assert!(
        out.stderr.contains("resident:") && out.stderr.contains("KV cache for 28 positions"),
        "{}",
        out.stderr
    );
    // stderr is not a terminal here: no progress line
    assert!(!out.stderr.contains("prefill: layer"), "{}", out.stderr);
    let st = &sum["stream"];
    let t = &st["totals"];
    assert!(t["verify_ms"].as_f64().unwrap() > 0.0);
    assert!(t["bytes_read"].as_u64().unwrap() > 0);
    assert!(t["disk_gb_s"].as_f64().unwrap() > 0.0);
    assert!(t["peak_rss_bytes"].as_u64().unwrap() > 0);
    assert!(t["h2d_ms"].is_null() && t["hot_hit_rate"].is_null() && t["peak_vram_bytes"].is_null());
    assert_eq!(st["verification"]["bytes_hashed"], t["verified_bytes"]);
    assert!(st["resident"]["dense_bytes"].as_u64().unwrap() > 0);
    assert_eq!(st["resident"]["context"], 28);
    // without --stats nothing is printed, but the summary still has the figures
    let (out, _, sum) = m.generate("nostats", &s(&["--ram-budget", &budget]), &cache);
    assert!(!out.stderr.contains("[stats]"));
    assert!(sum["stream"]["totals"]["requests"].as_u64().unwrap() > 0);
}

/// Budgets below one expert, bad sizes and `--preload` beyond the budget are usage errors; a
/// resident part larger than the machine is an environment error that says how much it needs.
#[test]
fn bad_budgets_and_impossible_resident_parts_get_their_exit_codes() {
    let m = Model::new("qwen3moe-odd");
    let cache = workdir().join("cache-bad");
    let b = m.dir.to_str().unwrap();
    // qwen3moe-odd's experts are 17280 bytes, 20480 padded: a buffer is whole pages either way.
    assert_ne!(m.read_size("cached"), m.buf_size());
    let min = m.buf_size().to_string();
    let cases: Vec<(Vec<String>, i32, String)> = vec![
        (
            s(&["--ram-budget", "1K"]),
            2,
            format!("minimum is {min} bytes"),
        ),
        (
            s(&["--ram-budget", "1K", "--io", "direct"]),
            2,
            format!("minimum is {min} bytes"),
        ),
        (
            s(&[
                "--ram-budget",
                &m.read_size("cached").to_string(),
                "--io",
                "cached",
            ]),
            2,
            "smaller than one expert".into(),
        ),
        (s(&["--vram-budget", "100"]), 2, "--vram-budget".into()),
        (s(&["--ram-budget", "12MB"]), 2, "decimal units".into()),
        (s(&["--ram-budget", "lots"]), 2, "not a size".into()),
        (s(&["--io", "sideways"]), 2, "".into()),
        (s(&["--cache-policy", "mru"]), 2, "".into()),
        (
            s(&["--preload", "--ram-budget", &min]),
            2,
            "--preload needs".into(),
        ),
        (
            s(&["--preload", "--cache-policy", "none"]),
            2,
            "keeps none".into(),
        ),
    ];
    for (extra, want, msg) in cases {
        let mut args = s(&["generate", b, "--tokens", "1,2,3", "--max-new-tokens", "2"]);
        args.extend(extra.clone());
        let out = run(&args, &cache);
        assert_eq!(out.code, want, "{extra:?}: {}", out.stderr);
        assert!(out.stderr.contains(&msg), "{extra:?}: {}", out.stderr);
        assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
    }
    // The smallest budget for each mode runs.
    for io in ["cached", "direct"] {
        let mut args = s(&[
            "generate",
            b,
            "--tokens",
            "1,2,3",
            "--max-new-tokens",
            "2",
            "--io",
            io,
            "--ram-budget",
        ]);
        args.push(min.clone());
        assert_eq!(run(&args, &cache).code, 0);
    }

    // A model whose KV cache at the requested context cannot fit in any machine.
    let huge = workdir().join("synth-huge-context");
    if !huge.exists() {
        let mut shape = synth::shapes()
            .into_iter()
            .find(|s| s.name == "tiny")
            .unwrap();
        shape.max_positions = 1 << 40;
        write_synth(&huge, shape);
    }
    let out = run(
        &s(&[
            "generate",
            huge.to_str().unwrap(),
            "--tokens",
            "1,2",
            "--max-new-tokens",
            "1000000000000",
        ]),
        &cache,
    );
    assert_eq!(out.code, 3, "{}", out.stderr);
    assert!(
        out.stderr.contains("the resident part needs") && out.stderr.contains("MemAvailable"),
        "{}",
        out.stderr
    );
    assert!(!out.stderr.contains("panicked"));
}

/// Flips one byte inside every expert extent of `jnf` (in place, as a concurrent writer would).
/// Format version 2 (issue 24): the fixture's bundle with every extent stored encoded gives
/// the logits files of its version-1 bundle byte for byte (but for the root digest the
/// metadata names, which is the bundle's), resident and streamed under a budget of two or three
/// experts, with and without a cache, so that experts are read, checked, decoded and re-read
/// many times; every read of the encoded bundle transfers fewer bytes.
#[test]
fn an_encoded_bundle_gives_the_raw_bundles_logits_files_byte_for_byte() {
    let raw = Model::new("qwen3moe-a");
    let enc = Model::new("qwen3moe-a+exp-zstd");
    assert_eq!(enc.header.major, 2);
    assert!(enc.header.experts.iter().all(|e| e.is_encoded()));
    let cache = workdir().join("cache-encoded");
    // Three decoded buffers: room for a read's stored bytes beside one or two held experts.
    let budget = (3 * raw.buf_size()).to_string();
    let runs: [&[&str]; 3] = [
        &[],
        &["--ram-budget", &budget, "--io", "direct"],
        &[
            "--ram-budget",
            &budget,
            "--io",
            "cached",
            "--cache-policy",
            "none",
        ],
    ];
    for (i, extra) in runs.iter().enumerate() {
        let extra = s(extra);
        let (_, a, sa) = raw.generate(&format!("v1-{i}"), &extra, &cache);
        let (_, b, sb) = enc.generate(&format!("v2-{i}"), &extra, &cache);
        let (ra, rb) = (&raw.manifest.root_digest, &enc.manifest.root_digest);
        assert_ne!(ra, rb);
        let text = String::from_utf8_lossy(&b);
        assert_eq!(
            text.matches(rb.as_str()).count(),
            1,
            "the root digest, once"
        );
        let mut b_as_a = b.clone();
        let at = b.windows(64).position(|w| w == rb.as_bytes()).unwrap();
        b_as_a[at..at + 64].copy_from_slice(ra.as_bytes());
        assert!(a == b_as_a, "{extra:?}: the logits files differ");
        if extra.is_empty() {
            continue;
        }
        let n = |v: &Value, k: &str| v["stream"]["totals"][k].as_u64().unwrap();
        // re-read many times: more reads than the bundle has experts
        assert!(
            n(&sb, "reads") > enc.header.experts.len() as u64,
            "{extra:?}"
        );
        assert_eq!(
            n(&sb, "decoded_bytes"),
            n(&sb, "reads") * 49152,
            "{extra:?}"
        );
        let per_read = |v: &Value| n(v, "bytes_read") as f64 / n(v, "reads") as f64;
        assert!(per_read(&sb) < 0.8 * per_read(&sa), "{extra:?}");
        assert!(n(&sb, "peak_warm_bytes") <= 3 * raw.buf_size(), "{extra:?}");
    }
}

fn corrupt_every_expert(jnf: &Path, header: &jnf_format::Header) {
    use std::os::unix::fs::FileExt;
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(jnf)
        .unwrap();
    for e in &header.experts {
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, e.offset + 7).unwrap();
        b[0] ^= 0x10;
        f.write_all_at(&b, e.offset + 7).unwrap();
    }
    f.sync_all().unwrap();
}

fn streamed_engine(dir: &Path, opts: &StreamOptions) -> (CpuEngine, Arc<StreamSource>) {
    let bundle = Arc::new(BundleSource::open(dir, None).unwrap());
    let cfg = tarfa_run::config::MoeConfig::from_json_str(
        &String::from_utf8(bundle.read_file("config.json").unwrap()).unwrap(),
    )
    .unwrap();
    let src = Arc::new(StreamSource::new(bundle, opts, None).unwrap());
    let model = Arc::new(CpuModel::load(cfg, src.clone()).unwrap());
    (
        CpuEngine::new(
            model,
            EngineOptions {
                threads: 2,
                kernel: Kernel::best(),
            },
        )
        .unwrap(),
        src,
    )
}

/// The bundle changes between steps; with a one-expert budget the next step re-reads, sees
/// bytes that do not match the manifest, and stops (exit code 1) without logits; every later
/// step fails the same way. A file truncated mid-run is a verification failure too.
#[test]
fn a_bundle_changed_during_the_run_stops_it_with_a_verification_error() {
    let m = Model::new("qwen3moe-a");
    for io in [IoMode::Direct, IoMode::Cached] {
        for change in ["bytes", "truncate"] {
            let dir = copy_bundle(&m.dir, &format!("midrun-{}-{change}", io.name()));
            let opts = StreamOptions {
                ram_budget: Some(m.buf_size()),
                io,
                policy: CachePolicy::Lru,
                ..Default::default()
            };
            let (eng, src) = streamed_engine(&dir, &opts);
            let mut cache = eng.model().new_cache();
            let pre = eng
                .forward(&mut cache, &m.prompt, &ForwardOptions::default())
                .unwrap();
            assert_eq!(pre.logits.len(), 1);
            let reads_before = src.stats().reads;
            let jnf = dir.join("model.jnf");
            match change {
                "bytes" => corrupt_every_expert(&jnf, &m.header),
                _ => {
                    let first = m.header.experts.iter().map(|e| e.offset).min().unwrap();
                    fs::OpenOptions::new()
                        .write(true)
                        .open(&jnf)
                        .unwrap()
                        .set_len(first + 100)
                        .unwrap();
                }
            }
            let err = eng
                .forward(&mut cache, &[5], &ForwardOptions::default())
                .unwrap_err();
            let what = format!("{} {change}: {err}", io.name());
            let stream_err = match &err {
                RunError::Weights(w) => w.source_error::<StreamError>(),
                _ => None,
            };
            match (stream_err, change) {
                (Some(e @ StreamError::HashMismatch { name, .. }), "bytes") => {
                    assert_eq!(e.exit_code(), 1, "{what}");
                    assert!(name.contains(".mlp.experts."), "{what}");
                    assert!(err.to_string().contains("BLAKE3"), "{what}");
                }
                (Some(e @ StreamError::Truncated { .. }), "truncate") => {
                    assert_eq!(e.exit_code(), 1, "{what}");
                }
                _ => panic!("unexpected error: {what}"),
            }
            assert!(
                src.stats().reads == reads_before,
                "{what}: no changed extent was accepted"
            );
            assert_eq!(
                cache.len(),
                m.prompt.len(),
                "{what}: the failed step left the cache as it was"
            );
            assert!(
                eng.forward(&mut cache, &[5], &ForwardOptions::default())
                    .is_err(),
                "{what}: the run stays stopped"
            );
        }
    }
}

/// The same through the command line: a bundle whose experts no longer match its manifest
/// exits 1 when streamed, naming the expert.
#[test]
fn streaming_a_changed_bundle_exits_1() {
    let m = Model::new("qwen3moe-a");
    let dir = copy_bundle(&m.dir, "cli-corrupt");
    corrupt_every_expert(&dir.join("model.jnf"), &m.header);
    let cache = workdir().join("cache-corrupt");
    for io in ["direct", "cached"] {
        let mut args = s(&[
            "generate",
            dir.to_str().unwrap(),
            "--tokens",
            "1,2,3",
            "--max-new-tokens",
            "2",
            "--io",
            io,
            "--ram-budget",
        ]);
        args.push(m.buf_size().to_string());
        let out = run(&args, &cache);
        assert_eq!(out.code, 1, "{}", out.stderr);
        assert!(
            out.stderr.contains("BLAKE3") && out.stderr.contains(".mlp.experts."),
            "{}",
            out.stderr
        );
        assert!(
            out.stdout.trim().is_empty(),
            "no token was generated: {}",
            out.stdout
        );
    }
}

/// With 192 MiB of experts and a budget of 12 or 48 MiB, the process never holds much more than
/// its resident part and the budget: peak RSS (VmHWM) <= resident + budget + RSS_SLACK.
#[test]
fn peak_rss_stays_under_resident_plus_budget_plus_slack() {
    let dir = workdir().join("synth-rss");
    if !dir.exists() {
        let mut shape = synth::shapes()
            .into_iter()
            .find(|s| s.name == "tiny")
            .unwrap();
        shape.hidden = 512;
        shape.expert_width = 1024;
        shape.experts = 16;
        shape.top_k = 4;
        shape.layers = 4;
        shape.vocab = 1024;
        shape.heads = 8;
        shape.kv_heads = 4;
        shape.head_dim = 64;
        write_synth(&dir, shape);
    }
    let m = Model {
        manifest: tarfa_manifest::Manifest::load(&dir.join("manifest.toml")).unwrap(),
        header: jnf_format::JnfFile::open(&dir.join("model.jnf"))
            .unwrap()
            .header()
            .clone(),
        prompt: (0..16u32).map(|i| (i * 131 + 7) % 1024).collect(),
        dir,
    };
    let experts = m.expert_bytes();
    assert_eq!(experts, 192 << 20);
    let cache = workdir().join("cache-rss");
    // Room for 4 expert buffers, and for 16 (as many as reader threads). With 16 buffers LRU
    // would keep a decode step's whole working set, so those runs keep nothing and read on
    // every use.
    for (budget, io, policy) in [
        (12u64 << 20, "direct", "lru"),
        (12 << 20, "cached", "none"),
        (48 << 20, "direct", "none"),
        (48 << 20, "cached", "none"),
    ] {
        {
            let summary = workdir().join("rss.json");
            let mut args = s(&["generate", m.dir.to_str().unwrap(), "--tokens"]);
            args.push(m.tokens_arg());
            args.extend(s(&[
                "--max-new-tokens",
                "3",
                "--ignore-eos",
                "--io",
                io,
                "--cache-policy",
                policy,
                "--ram-budget",
                &budget.to_string(),
            ]));
            args.extend(s(&["--summary-json", summary.to_str().unwrap()]));
            let out = run(&args, &cache);
            assert_eq!(out.code, 0, "{}", out.stderr);
            let sum: Value = serde_json::from_slice(&fs::read(&summary).unwrap()).unwrap();
            // VmHWM of the child's own address space. (The parent's wait4 ru_maxrss would not
            // do: Linux folds the forking test process's RSS into it at exec.)
            let rss = sum["peak_rss_bytes"].as_u64().unwrap();
            let st = &sum["stream"];
            let resident = st["resident"]["dense_bytes"].as_u64().unwrap()
                + st["resident"]["kv_bytes"].as_u64().unwrap();
            let bound = resident + budget + RSS_SLACK;
            let what = format!(
                "io={io} policy={policy}: peak RSS {rss}, resident {resident}, budget {budget}"
            );
            eprintln!("{what}, read {}", st["totals"]["bytes_read"]);
            assert!(rss <= bound, "{what}: over {bound}");
            assert!(
                st["totals"]["peak_warm_bytes"].as_u64().unwrap() <= budget,
                "{what}"
            );
            // the test means something: far more was read than the bound could hold
            assert!(
                st["totals"]["bytes_read"].as_u64().unwrap() > bound,
                "{what}"
            );
            assert!(experts > bound);
        }
    }
}

/// A source that hands experts out in groups of `group`, in descending id order: the forward's
/// batching over every family (dense layers, biases, the shared expert, tied embeddings).
struct Grouped {
    inner: InMemorySource,
    group: usize,
}

impl WeightSource for Grouped {
    fn tensor(&self, name: &str) -> Result<Arc<HostTensor>, WeightError> {
        self.inner.tensor(name)
    }
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }
    fn experts(&self, layer: usize, ids: &[usize]) -> Result<Vec<Arc<ExpertWeights>>, WeightError> {
        self.inner.experts(layer, ids)
    }
    fn expert_batches(&self, _layer: usize, ids: &[usize]) -> Vec<Vec<usize>> {
        let mut rev: Vec<usize> = ids.iter().rev().copied().collect();
        if self.group == 0 {
            // a broken source: drops an expert
            rev.pop();
            return vec![rev];
        }
        rev.chunks(self.group).map(|c| c.to_vec()).collect()
    }
    fn expert_data(&self, layer: usize, ids: &[usize]) -> Result<Vec<ExpertHandle>, WeightError> {
        self.inner.expert_data(layer, ids)
    }
}

#[test]
fn grouped_expert_fetching_gives_the_same_bits_in_every_family() {
    let prompt: Vec<u32> = (0..13).map(|i| (i * 29 + 3) % 96).collect();
    for (family, over) in [
        (
            "qwen3_moe",
            json!({"mlp_only_layers": [0], "decoder_sparse_step": 2, "attention_bias": true, "tie_word_embeddings": true}),
        ),
        ("qwen2_moe", json!({"norm_topk_prob": false})),
        (
            "mixtral",
            json!({"num_local_experts": 8, "intermediate_size": 48}),
        ),
        (
            "olmoe",
            json!({"norm_topk_prob": false, "num_key_value_heads": 4}),
        ),
    ] {
        let c = parse(&config_json(family, over));
        let logits = |src: Arc<dyn WeightSource>| {
            let model = Arc::new(CpuModel::load(c.clone(), src).unwrap());
            let eng = CpuEngine::new(
                model.clone(),
                EngineOptions {
                    threads: 2,
                    kernel: Kernel::best(),
                },
            )
            .unwrap();
            let mut cache = model.new_cache();
            let opts = ForwardOptions {
                logits: LogitRows::All,
                ..Default::default()
            };
            greedy(&eng, &mut cache, &prompt, 3, &opts)
                .map(|g| (bits(&g.prefill.logits), bits(&g.step_logits)))
        };
        let reference = logits(Arc::new(random_source(&c, 5))).unwrap();
        for group in [1, 2, 5] {
            let got = logits(Arc::new(Grouped {
                inner: random_source(&c, 5),
                group,
            }))
            .unwrap();
            assert!(got == reference, "{family}: groups of {group}");
        }
        let err = logits(Arc::new(Grouped {
            inner: random_source(&c, 5),
            group: 0,
        }))
        .unwrap_err();
        assert!(
            matches!(err, RunError::SourceContract(_)),
            "{family}: {err}"
        );
    }
}

/// Owned copies for callers that keep experts (the CUDA backend uploads through
/// `experts()`): the verified bytes, in the order asked, under a budget smaller than the
/// request, and not counted as uses.
#[test]
fn owned_expert_copies_come_through_any_budget() {
    let m = Model::new("qwen3moe-odd");
    let resident = BundleSource::open(&m.dir, None).unwrap();
    let bundle = Arc::new(BundleSource::open(&m.dir, None).unwrap());
    // an unbounded budget too: a CUDA run with every expert on the GPU, whose upload these
    // copies are, must leave nothing of them in host memory (issue 17)
    let budgets = [Some(2 * m.buf_size()), None];
    for (io, budget) in [IoMode::Direct, IoMode::Cached]
        .into_iter()
        .flat_map(|io| budgets.map(|b| (io, b)))
    {
        let opts = StreamOptions {
            ram_budget: budget,
            io,
            policy: CachePolicy::Lru,
            ..Default::default()
        };
        let src = StreamSource::new(bundle.clone(), &opts, None).unwrap();
        let ids = [11, 0, 5, 3, 0];
        let got = src.experts(1, &ids).unwrap();
        let want = resident.experts(1, &ids).unwrap();
        assert_eq!(got.len(), ids.len());
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(**g, **w, "{io:?} {budget:?}");
        }
        assert!(src.stats().peak_warm_bytes <= budget.unwrap_or(4 * m.buf_size()));
        assert_eq!(
            src.store().used_bytes(),
            0,
            "copies are not kept ({io:?} {budget:?})"
        );
        assert!(src.store().heat().is_empty(), "copies are not uses");
        assert!(matches!(
            src.experts(1, &[12]),
            Err(WeightError::MissingExpert {
                layer: 1,
                expert: 12,
                ..
            })
        ));
    }
}

/// On a terminal a prefill shows its progress, layer by layer (`script` provides the terminal;
/// skipped where util-linux's `script` is missing). Through a pipe it does not (checked in
/// `stats_are_printed_per_token_and_at_the_end`).
#[test]
fn prefill_progress_shows_on_a_terminal() {
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("skipped: no `script` to provide a terminal");
        return;
    }
    let m = Model::new("qwen3moe-a");
    let cmd = format!(
        "{BIN} generate {} --tokens {} --max-new-tokens 1 --ram-budget {}",
        m.dir.display(),
        m.tokens_arg(),
        4 * m.buf_size()
    );
    let o = Command::new("script")
        .args(["-qec", &cmd, "/dev/null"])
        .env("TARFA_CACHE_DIR", workdir().join("cache-tty"))
        .output()
        .unwrap();
    let all = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{all}");
    assert!(
        all.contains("prefill: layer 1/4") && all.contains("prefill: layer 4/4"),
        "{all}"
    );
}

/// `--preload` reads every expert before the first step: the summary books those reads under
/// "load", and the steps then only hit.
#[test]
fn preload_reads_are_the_loads_and_steps_only_hit() {
    let m = Model::new("qwen3moe-a");
    let cache = workdir().join("cache-preload");
    let (_, reference, _) = m.generate("preload-ref", &[], &cache);
    for extra in [
        s(&["--preload"]),
        s(&["--preload", "--io", "direct", "--ram-budget"])
            .into_iter()
            .chain([m.expert_bytes().to_string()])
            .collect(),
    ] {
        let (_, got, sum) = m.generate("preload", &extra, &cache);
        assert!(got == reference, "{extra:?}");
        let st = &sum["stream"];
        let n = m.header.experts.len() as u64;
        assert_eq!(st["load"]["reads"], n, "{extra:?}");
        assert_eq!(st["totals"]["reads"], 0, "{extra:?}");
        assert_eq!(
            st["totals"]["warm_hits"], st["totals"]["requests"],
            "{extra:?}"
        );
    }
}

/// Checks a streamed run's accounting with look-ahead reads: every request is a warm hit, a
/// look-ahead hit or a miss; every read a miss, a look-ahead hit, wasted or still held unused;
/// bytes match reads; the budget holds; the per-step figures add up to the totals.
fn check_lookahead_accounting(m: &Model, what: &str, st: &Value, io: &str, budget: u64) {
    let t = &st["totals"];
    let n = |k: &str| {
        t[k].as_u64()
            .unwrap_or_else(|| panic!("{what}: {k} in {t}"))
    };
    assert_eq!(
        n("requests"),
        n("warm_hits") + n("lookahead_hits") + n("misses"),
        "{what}"
    );
    let unclaimed = st["unclaimed_reads"].as_u64().unwrap();
    assert_eq!(
        n("reads"),
        n("misses") + n("lookahead_hits") + n("wasted_reads") + unclaimed,
        "{what}: every read used, wasted or held"
    );
    let size = m.read_size(io);
    assert_eq!(n("bytes_read"), n("reads") * size, "{what}");
    assert_eq!(n("lookahead_bytes"), n("lookahead_reads") * size, "{what}");
    assert_eq!(
        n("lookahead_wasted_bytes"),
        n("lookahead_wasted") * size,
        "{what}"
    );
    assert!(n("lookahead_reads") <= n("reads"), "{what}");
    assert!(n("lookahead_wasted") <= n("wasted_reads"), "{what}");
    assert!(
        n("lookahead_hits") + n("lookahead_wasted") <= n("lookahead_reads"),
        "{what}"
    );
    assert!(
        n("lookahead_right") <= n("lookahead_guessed").min(n("lookahead_needed")),
        "{what}"
    );
    assert_eq!(
        n("verified_bytes"),
        n("reads") * m.read_size("cached"),
        "{what}: every read hashed, guessed or not"
    );
    assert!(
        n("peak_warm_bytes") <= budget,
        "{what}: warm tier peaked at {} over {budget}",
        n("peak_warm_bytes")
    );
    let steps = st["steps"].as_array().unwrap();
    // Each step's figures are taken once its reads finished (StreamRun::end settles the
    // store), so the steps add up to the totals exactly, whatever the reader threads' timing;
    // a read counted outside every step (late, or between steps) fails here.
    for k in [
        "requests",
        "warm_hits",
        "misses",
        "reads",
        "wasted_reads",
        "bytes_read",
        "lookahead_hits",
        "lookahead_guessed",
        "lookahead_right",
        "lookahead_needed",
        "lookahead_reads",
        "lookahead_wasted",
        "lookahead_wasted_bytes",
    ] {
        let sum: u64 = steps.iter().map(|s| s[k].as_u64().unwrap()).sum();
        assert_eq!(sum, n(k), "{what}: {k} per step");
    }
    for (i, s) in steps.iter().enumerate() {
        let k = |key: &str| s[key].as_u64().unwrap();
        assert_eq!(
            k("requests"),
            k("warm_hits") + k("lookahead_hits") + k("misses"),
            "{what}: step {i}"
        );
    }
}

/// The look-ahead sweep: every guess source x I/O mode x budget (a quarter of the experts,
/// three, one) x policy gives the logits file of the run without look-ahead, byte for byte,
/// and its accounting adds up; the router's guess is right at times on every model.
#[test]
fn lookahead_gives_the_resident_bits_at_every_budget_io_mode_and_policy() {
    for name in ["qwen3moe-a", "qwen3moe-code", "synth-tiny"] {
        let m = Model::new(name);
        let cache = workdir().join(format!("cache-lookahead-{name}"));
        let (_, reference, _) = m.generate(&format!("{name}-la-ref"), &[], &cache);
        let mut runs = 0;
        for lookahead in ["ledger", "router", "both"] {
            for io in ["direct", "cached"] {
                let one = m.buf_size();
                for budget in [m.expert_bytes() / 4, 3 * one, one] {
                    for policy in ["lru", "static", "none"] {
                        let extra = s(&[
                            "--lookahead",
                            lookahead,
                            "--io",
                            io,
                            "--cache-policy",
                            policy,
                            "--ram-budget",
                            &budget.to_string(),
                        ]);
                        let what = format!(
                            "{name} lookahead={lookahead} io={io} policy={policy} budget={budget}"
                        );
                        let (_, got, sum) = m.generate(&format!("{name}-la"), &extra, &cache);
                        assert!(got == reference, "{what}: logits file differs");
                        let st = &sum["stream"];
                        assert_eq!(st["lookahead"], lookahead, "{what}");
                        check_lookahead_accounting(&m, &what, st, io, budget);
                        let t = &st["totals"];
                        assert!(t["lookahead_guessed"].as_u64().unwrap() > 0, "{what}");
                        if lookahead != "ledger" {
                            assert!(t["lookahead_right"].as_u64().unwrap() > 0, "{what}");
                        }
                        runs += 1;
                    }
                }
            }
        }
        assert_eq!(runs, 54);
    }
}

/// `--lookahead` is a typed option: an unknown value is a usage error; `--stats` and the
/// summary report what was guessed, read ahead and wasted; off reports zeros.
#[test]
fn lookahead_is_a_typed_option_reported_in_stats_and_the_summary() {
    let m = Model::new("qwen3moe-code");
    let cache = workdir().join("cache-lookahead-flag");
    let mut args = s(&["generate", m.dir.to_str().unwrap(), "--tokens"]);
    args.push(m.tokens_arg());
    args.extend(s(&["--max-new-tokens", "2", "--lookahead", "sometimes"]));
    let out = run(&args, &cache);
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("sometimes") && out.stderr.contains("router"),
        "{}",
        out.stderr
    );
    let budget = (6 * m.buf_size()).to_string();
    let (out, _, sum) = m.generate(
        "la-stats",
        &s(&["--stats", "--lookahead", "router", "--ram-budget", &budget]),
        &cache,
    );
    for needle in [
        "; lookahead router",
        "lookahead hits",
        "served ahead",
        "wasted",
    ] {
        assert!(out.stderr.contains(needle), "{needle}: {}", out.stderr);
    }
    let total = out
        .stderr
        .lines()
        .find(|l| l.starts_with("[stats] total:"))
        .unwrap();
    assert!(total.contains("lookahead hits"), "{total}");
    let t = &sum["stream"]["totals"];
    assert_eq!(sum["stream"]["lookahead"], "router");
    assert!(t["lookahead_precision"].as_f64().unwrap() > 0.0);
    assert!(t["lookahead_recall"].as_f64().unwrap() > 0.0);
    assert!(t["ahead_hit_rate"].as_f64().unwrap() >= t["warm_hit_rate"].as_f64().unwrap());
    // off: nothing guessed, nothing said (the word itself is in the heat ledger's path, under
    // this test's cache directory, which the run prints)
    let (out, _, sum) = m.generate("la-off", &s(&["--stats", "--ram-budget", &budget]), &cache);
    for needle in ["; lookahead", "lookahead hits", "served ahead", "guessed"] {
        assert!(!out.stderr.contains(needle), "{needle}: {}", out.stderr);
    }
    assert!(out.stderr.contains("; cache lru"), "{}", out.stderr);
    assert!(out.stderr.contains("[stats] total:"), "{}", out.stderr);
    let t = &sum["stream"]["totals"];
    assert_eq!(sum["stream"]["lookahead"], "off");
    for k in ["lookahead_guessed", "lookahead_reads", "lookahead_hits"] {
        assert_eq!(t[k], 0, "{k}");
    }
    assert!(t["lookahead_precision"].is_null());
}

/// A source whose look-ahead guess is always wrong: it knows every step's routes (from a
/// traced resident run) and guesses every expert of the next layer but those.
struct WrongGuess {
    inner: Arc<StreamSource>,
    /// `[step][layer]` -> the experts the step's tokens chose there.
    truth: Vec<BTreeMap<usize, BTreeSet<usize>>>,
    first_moe: usize,
    experts: usize,
    /// Steps begun (prefetches of the first MoE layer).
    steps: AtomicUsize,
    guesses: Mutex<Vec<(usize, Vec<usize>)>>,
}

impl WeightSource for WrongGuess {
    fn tensor(&self, name: &str) -> Result<Arc<HostTensor>, WeightError> {
        self.inner.tensor(name)
    }
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }
    fn experts(&self, layer: usize, ids: &[usize]) -> Result<Vec<Arc<ExpertWeights>>, WeightError> {
        self.inner.experts(layer, ids)
    }
    fn expert_batches(&self, layer: usize, ids: &[usize]) -> Vec<Vec<usize>> {
        self.inner.expert_batches(layer, ids)
    }
    fn prefetch(&self, layer: usize, batches: &[Vec<usize>]) {
        if layer == self.first_moe {
            self.steps.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.prefetch(layer, batches)
    }
    fn lookahead_input(&self) -> LookaheadInput {
        self.inner.lookahead_input()
    }
    fn lookahead(&self, layer: usize, count: usize, _router_guess: &[usize]) {
        let step = self.steps.load(Ordering::SeqCst) - 1;
        let chosen = &self.truth[step][&layer];
        let wrong: Vec<usize> = (0..self.experts).filter(|e| !chosen.contains(e)).collect();
        self.guesses.lock().unwrap().push((layer, wrong.clone()));
        self.inner.lookahead(layer, count, &wrong)
    }
    fn record_uses(&self, layer: usize, ids: &[usize]) {
        self.inner.record_uses(layer, ids)
    }
    fn expert_data(&self, layer: usize, ids: &[usize]) -> Result<Vec<ExpertHandle>, WeightError> {
        self.inner.expert_data(layer, ids)
    }
}

/// A forced always-wrong guess still gives the resident bits at every budget (one expert
/// included), I/O mode and policy: it is never right, its reads are wasted or held unused, and
/// the counters add up.
#[test]
fn an_always_wrong_guess_gives_the_resident_bits_and_costs_only_reads() {
    let m = Model::new("qwen3moe-a");
    let (prefill, steps) = resident_logits(&m);
    // every step's routes, from a traced resident run (prefill, then 3 decode steps)
    let bundle = Arc::new(BundleSource::open(&m.dir, None).unwrap());
    let cfg = tarfa_run::config::MoeConfig::from_json_str(
        &String::from_utf8(bundle.read_file("config.json").unwrap()).unwrap(),
    )
    .unwrap();
    let model = Arc::new(CpuModel::load(cfg.clone(), bundle.clone()).unwrap());
    let eng = CpuEngine::new(model.clone(), EngineOptions::default()).unwrap();
    let opts = ForwardOptions {
        logits: LogitRows::All,
        trace_router: true,
        ..Default::default()
    };
    let g = greedy(&eng, &mut model.new_cache(), &m.prompt, 4, &opts).unwrap();
    let mut truth: Vec<BTreeMap<usize, BTreeSet<usize>>> = vec![BTreeMap::new(); 4];
    let p = m.prompt.len();
    for r in g.prefill.router.iter().chain(&g.decode_router) {
        let step = if r.position < p {
            0
        } else {
            r.position - p + 1
        };
        let set = truth[step].entry(r.layer).or_default();
        set.extend(r.experts.iter().map(|&e| e as usize));
    }
    let first_moe = *truth[0].keys().next().unwrap();
    assert!(truth.iter().all(|t| t.len() == truth[0].len()));

    let one = m.buf_size();
    for io in [IoMode::Direct, IoMode::Cached] {
        for budget in [m.expert_bytes() / 4, one] {
            for policy in [CachePolicy::Lru, CachePolicy::None] {
                let what = format!("{io:?} budget {budget} {policy:?}");
                let so = StreamOptions {
                    ram_budget: Some(budget),
                    io,
                    policy,
                    lookahead: Lookahead::Router,
                    ..Default::default()
                };
                let inner = Arc::new(StreamSource::new(bundle.clone(), &so, None).unwrap());
                let src = Arc::new(WrongGuess {
                    inner: inner.clone(),
                    truth: truth.clone(),
                    first_moe,
                    experts: cfg.num_experts,
                    steps: AtomicUsize::new(0),
                    guesses: Mutex::new(Vec::new()),
                });
                let model = Arc::new(CpuModel::load(cfg.clone(), src.clone()).unwrap());
                let eng = CpuEngine::new(
                    model.clone(),
                    EngineOptions {
                        threads: 2,
                        kernel: Kernel::best(),
                    },
                )
                .unwrap();
                let opts = ForwardOptions {
                    logits: LogitRows::All,
                    ..Default::default()
                };
                let got = greedy(&eng, &mut model.new_cache(), &m.prompt, 4, &opts).unwrap();
                assert!(bits(&got.prefill.logits) == prefill, "{what}: prefill rows");
                assert!(bits(&got.step_logits) == steps, "{what}: step rows");
                // a guess for every MoE layer but the first, in every step
                let guesses = src.guesses.lock().unwrap();
                assert_eq!(guesses.len(), 4 * (truth[0].len() - 1), "{what}");
                assert!(guesses
                    .iter()
                    .all(|(l, g)| *l != first_moe && !g.is_empty()));
                // the last guesses' reads may still be on the reader threads: the counters
                // below add up once they finished
                inner.store().settle();
                let s = inner.stats();
                assert_eq!(s.lookahead_right, 0, "{what}: {s:?}");
                assert!(
                    s.lookahead_guessed > 0 && s.lookahead_reads > 0,
                    "{what}: {s:?}"
                );
                assert!(s.lookahead_wasted > 0, "{what}: {s:?}");
                assert_eq!(
                    s.requests,
                    s.warm_hits + s.lookahead_hits + s.misses,
                    "{what}"
                );
                assert_eq!(
                    s.reads,
                    s.misses + s.lookahead_hits + s.wasted_reads + inner.store().unclaimed_reads(),
                    "{what}: {s:?}"
                );
                assert_eq!(s.bytes_read, s.reads * m.read_size(io.name()), "{what}");
                assert!(s.peak_warm_bytes <= budget, "{what}: {s:?}");
                if policy == CachePolicy::None {
                    assert_eq!(s.warm_hits, 0, "{what}");
                }
            }
        }
    }
}

/// The router's guess is computed for every family the forward runs (dense layers before and
/// between MoE layers, biased and grouped routers, sigmoid routers, fused and MXFP4-free
/// experts, hybrid attention): streamed with look-ahead under a budget of three experts, each
/// synthetic shape gives the logits of its resident bundle, bit for bit, and guesses only
/// experts it has.
///
/// A guess names the next MoE layer of the same step, so a model with one MoE layer has none
/// to make: the tiny DeepSeek and GLM-4.5 shapes (one dense layer, then one MoE layer) run with
/// nothing guessed, and again with a third layer (`@3`: dense, MoE, MoE), where their grouped
/// routers' guesses are made and scored.
#[test]
fn lookahead_changes_no_bit_in_any_family() {
    for shape in [
        "tiny",
        "tiny-deepseek-v3",
        "tiny-deepseek-v3@3",
        "tiny-deepseek-v2",
        "tiny-deepseek-v2@3",
        "tiny-glm4-moe",
        "tiny-glm4-moe@3",
        "tiny-gpt-oss",
        "tiny-llama4",
        "tiny-qwen3.5-moe",
    ] {
        let name: &'static str = Box::leak(format!("synth-{shape}").into_boxed_str());
        let m = Model::new(name);
        let (prefill, steps) = resident_logits(&m);
        for lookahead in [Lookahead::Router, Lookahead::Both, Lookahead::Ledger] {
            let what = format!("{shape} {lookahead:?}");
            let opts = StreamOptions {
                ram_budget: Some(3 * m.buf_size()),
                io: IoMode::Direct,
                policy: CachePolicy::Lru,
                lookahead,
                ..Default::default()
            };
            let (eng, src) = streamed_engine(&m.dir, &opts);
            let mut cache = eng.model().new_cache();
            let fopts = ForwardOptions {
                logits: LogitRows::All,
                ..Default::default()
            };
            let got = greedy(&eng, &mut cache, &m.prompt, 4, &fopts).unwrap();
            assert!(bits(&got.prefill.logits) == prefill, "{what}: prefill rows");
            assert!(bits(&got.step_logits) == steps, "{what}: step rows");
            src.store().settle();
            let s = src.stats();
            let moe_layers = eng
                .model()
                .spec()
                .layers
                .iter()
                .filter(|&&k| k == MlpKind::Moe)
                .count();
            assert!(s.lookahead_right <= s.lookahead_needed, "{what}: {s:?}");
            assert!(s.peak_warm_bytes <= 3 * m.buf_size(), "{what}: {s:?}");
            assert_eq!(
                s.requests,
                s.warm_hits + s.lookahead_hits + s.misses,
                "{what}: {s:?}"
            );
            assert_eq!(
                s.reads,
                s.misses + s.lookahead_hits + s.wasted_reads + src.store().unclaimed_reads(),
                "{what}: {s:?}"
            );
            if moe_layers < 2 {
                // no next MoE layer in any step: nothing guessed, nothing read ahead
                assert_eq!(ahead_counts(&s), [0; 4], "{what}: {s:?}");
                continue;
            }
            assert!(s.lookahead_guessed > 0, "{what}: {s:?}");
            if lookahead == Lookahead::Router {
                assert!(s.lookahead_right > 0, "{what}: {s:?}");
            }
        }
    }
}

/// (guessed, needed, look-ahead reads, look-ahead hits)
fn ahead_counts(s: &tarfa_run::stream::StreamStats) -> [u64; 4] {
    [
        s.lookahead_guessed,
        s.lookahead_needed,
        s.lookahead_reads,
        s.lookahead_hits,
    ]
}
