//! `--speculate model --draft-bundle`: a draft model's proposals verified by the model, through
//! the real binary. The demo model (fixtures/oracle/qwen3moe-code) drafts for itself (every
//! greedy draft accepted: the mechanism and its upper bound) and its first layer alone drafts as
//! a weak draft (mostly wrong); either way `generate`'s logits file and text, and `score`'s
//! result lines, are the bytes of plain decoding. A draft of another vocabulary or tokenizer is
//! refused by name; `--no-speculative` is the default's bytes.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use safetensors::SafeTensors;
use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_tarfa-run");
const DEMO: &str = "qwen3moe-code";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/oracle")
        .join(name)
}

fn bundles_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("speculate-model-bundles");
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    })
}

/// `name` converted once (the checkpoint made by `make` when it is not a fixture).
fn converted(name: &str, make: impl FnOnce(&Path)) -> PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let out = bundles_dir().join(name);
    if !out.exists() {
        let src = bundles_dir().join(format!("{name}.src"));
        let from = if fixture(name).exists() {
            fixture(name)
        } else {
            make(&src);
            src
        };
        tarfa_convert::convert(&from, &out, &Default::default()).unwrap();
    }
    out
}

fn demo() -> PathBuf {
    converted(DEMO, |_| {})
}

/// The demo checkpoint cut to its first `layers` layers (embeddings, final norm and lm_head
/// kept; validation/spec/truncate.py does the same for the bench), with `tokenizer` as its
/// tokenizer.json.
fn cut_demo(out: &Path, layers: usize, tokenizer: &[u8]) {
    fs::create_dir_all(out).unwrap();
    let src = fixture(DEMO);
    let mut shards: Vec<Vec<u8>> = Vec::new();
    for e in fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        let n = p.file_name().unwrap().to_str().unwrap().to_string();
        if n.starts_with("model-") && n.ends_with(".safetensors") {
            shards.push(fs::read(&p).unwrap());
        }
    }
    let parsed: Vec<SafeTensors> = shards
        .iter()
        .map(|b| SafeTensors::deserialize(b).unwrap())
        .collect();
    let keep = |name: &str| match name.strip_prefix("model.layers.") {
        Some(rest) => rest.split('.').next().unwrap().parse::<usize>().unwrap() < layers,
        None => true,
    };
    let mut tensors = Vec::new();
    for st in &parsed {
        for (name, view) in st.tensors() {
            if keep(&name) {
                tensors.push((name, view));
            }
        }
    }
    safetensors::serialize_to_file(tensors, None, &out.join("model.safetensors")).unwrap();
    let mut cfg: Value =
        serde_json::from_slice(&fs::read(src.join("config.json")).unwrap()).unwrap();
    cfg["num_hidden_layers"] = json!(layers);
    fs::write(out.join("config.json"), cfg.to_string()).unwrap();
    fs::copy(
        src.join("generation_config.json"),
        out.join("generation_config.json"),
    )
    .unwrap();
    fs::write(out.join("tokenizer.json"), tokenizer).unwrap();
}

/// The weak draft: the demo model's first layer, the demo's tokenizer.
fn weak() -> PathBuf {
    converted("demo-1-layer", |out| {
        cut_demo(
            out,
            1,
            &fs::read(fixture(DEMO).join("tokenizer.json")).unwrap(),
        )
    })
}

/// The same vocabulary size, another tokenizer: the ids of two tokens swapped.
fn other_tokenizer() -> PathBuf {
    converted("demo-other-tokenizer", |out| {
        let mut t: Value =
            serde_json::from_slice(&fs::read(fixture(DEMO).join("tokenizer.json")).unwrap())
                .unwrap();
        let vocab = t["model"]["vocab"].as_object_mut().unwrap();
        let (a, b) = {
            let mut keys = vocab.keys().filter(|k| k.len() > 2);
            (keys.next().unwrap().clone(), keys.next().unwrap().clone())
        };
        let (ia, ib) = (vocab[&a].clone(), vocab[&b].clone());
        vocab.insert(a, ib);
        vocab.insert(b, ia);
        cut_demo(out, 1, t.to_string().as_bytes())
    })
}

/// Runs the binary to its end; fails the test after 120 s (a hang) or on a panic message.
fn run(args: &[&str]) -> (i32, String, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("tarfa-run {args:?} hung");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    (out.status.code().unwrap_or(-1), stdout, stderr)
}

const PROMPT: &str =
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(";

#[test]
fn a_draft_model_gives_the_plain_output_byte_for_byte() {
    let (b, w) = (demo(), weak());
    let (b, w) = (b.to_str().unwrap(), w.to_str().unwrap());
    let d = tempfile::tempdir().unwrap();
    let gen = |name: &str, extra: &[&str]| {
        let p = d.path().join(name);
        let s = d.path().join(format!("{name}.json"));
        let mut args = vec![
            "generate",
            b,
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "16",
            "--ignore-eos",
            "--threads",
            "2",
            "--logits-out",
            p.to_str().unwrap(),
            "--summary-json",
            s.to_str().unwrap(),
        ];
        args.extend(extra);
        let (code, stdout, err) = run(&args);
        assert_eq!(code, 0, "{err}");
        let v: Value = serde_json::from_slice(&fs::read(&s).unwrap()).unwrap();
        (fs::read(p).unwrap(), stdout, v, err)
    };
    // The default, and --no-speculative: the same bytes, nothing drafted.
    let (plain, text, v, _) = gen("default", &[]);
    assert!(v["speculate"].is_null(), "{v}");
    let (l, t, v, _) = gen("no-spec", &["--no-speculative"]);
    assert_eq!((l == plain, &t), (true, &text), "--no-speculative");
    assert!(v["speculate"].is_null(), "{v}");
    let sampled = ["--temperature", "0.8", "--seed", "3"];
    let (plain_s, text_s, _, _) = gen("sampled", &sampled);
    // Draft lengths 1..8 between the two drafts, greedy and sampled.
    let (mut weak_drafted, mut weak_accepted) = (0, 0);
    for (draft, k, sample) in [
        (b, "1", false),
        (b, "3", false),
        (b, "8", false),
        (b, "5", true),
        (w, "2", false),
        (w, "4", false),
        (w, "7", false),
        (w, "6", true),
    ] {
        let mut extra = vec![
            "--speculate",
            "model",
            "--draft-bundle",
            draft,
            "--draft-tokens",
            k,
        ];
        if sample {
            extra.extend(sampled);
        }
        let (l, t, v, err) = gen("on", &extra);
        let what = format!("draft {draft} k {k} sampled {sample}");
        if sample {
            assert_eq!((l == plain_s, &t), (true, &text_s), "{what}");
        } else {
            assert_eq!((l == plain, &t), (true, &text), "{what}");
        }
        let s = &v["speculate"];
        assert_eq!(s["drafter"], "model", "{v}");
        assert!(err.contains("speculate model"), "{err}");
        let (drafted, accepted) = (
            s["drafted"].as_u64().unwrap(),
            s["accepted"].as_u64().unwrap(),
        );
        assert!(s["draft_model_steps"].as_u64().unwrap() >= drafted, "{v}");
        if draft == b && !sample {
            // The model as its own draft: every greedy draft is the model's own choice.
            assert_eq!(accepted, drafted, "{what}: {v}");
            assert!(
                s["decode_steps"].as_u64().unwrap() < 15,
                "{what}: steps saved"
            );
        }
        if draft == w {
            weak_drafted += drafted;
            weak_accepted += accepted;
        }
    }
    assert!(
        weak_accepted < weak_drafted,
        "the weak draft is sometimes wrong"
    );
}

#[test]
fn stats_print_every_step_and_the_totals() {
    let b = demo();
    let b = b.to_str().unwrap();
    let d = tempfile::tempdir().unwrap();
    let s = d.path().join("s.json");
    let args = |extra: &[&str]| {
        let mut v = vec![
            "generate",
            b,
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "12",
            "--ignore-eos",
            "--threads",
            "2",
            "--stats",
            "--summary-json",
            s.to_str().unwrap(),
        ];
        v.extend(extra);
        let (code, _, err) = run(&v);
        assert_eq!(code, 0, "{err}");
        let v: Value = serde_json::from_slice(&fs::read(&s).unwrap()).unwrap();
        (err, v)
    };
    let (err, v) = args(&[
        "--speculate",
        "model",
        "--draft-bundle",
        b,
        "--draft-tokens",
        "3",
    ]);
    let sp = &v["speculate"];
    let per: Vec<(u64, u64)> = sp["per_step"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_u64().unwrap(), p[1].as_u64().unwrap()))
        .collect();
    assert_eq!(
        per.len() as u64,
        sp["decode_steps"].as_u64().unwrap(),
        "{v}"
    );
    assert_eq!(
        per.iter().map(|p| p.0).sum::<u64>(),
        sp["drafted"].as_u64().unwrap()
    );
    assert_eq!(
        per.iter().map(|p| p.1).sum::<u64>(),
        sp["accepted"].as_u64().unwrap()
    );
    // One line per step on stderr, then the totals.
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(lines.len(), per.len(), "{err}");
    assert_eq!(
        lines[0],
        format!("step 1: drafted {}, accepted {}", per[0].0, per[0].1)
    );
    assert!(err.contains("tokens per step, decode"), "{err}");
    // Without speculation: the plain steps (one per token after the first), nothing drafted.
    let (err, v) = args(&[]);
    let sp = &v["speculate"];
    assert_eq!(sp["drafter"], "off", "{v}");
    assert_eq!(sp["decode_steps"], 11, "{v}");
    assert_eq!(sp["drafted"], 0, "{v}");
    assert!(err.contains("speculate off k 0: 11 decode steps"), "{err}");
}

#[test]
fn a_draft_of_another_vocabulary_or_tokenizer_is_refused() {
    let b = demo();
    let b = b.to_str().unwrap();
    let gen = |extra: &[&str]| {
        let mut v = vec!["generate", b, "--prompt", "x", "--max-new-tokens", "2"];
        v.extend(extra);
        run(&v)
    };
    // Another vocabulary (a fixture of 512 tokens, no tokenizer).
    let a = converted("qwen3moe-a", |_| {});
    let (code, _, err) = gen(&[
        "--speculate",
        "model",
        "--draft-bundle",
        a.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--draft-bundle: a vocabulary of 512 tokens"),
        "{err}"
    );
    // The same size, another tokenizer.json.
    let o = other_tokenizer();
    for cmd in ["generate", "score"] {
        let (code, _, err) = if cmd == "generate" {
            gen(&[
                "--speculate",
                "model",
                "--draft-bundle",
                o.to_str().unwrap(),
            ])
        } else {
            let d = tempfile::tempdir().unwrap();
            let r = d.path().join("r.jsonl");
            fs::write(&r, "{\"context\": \"x\", \"max_tokens\": 2}\n").unwrap();
            run(&[
                "score",
                b,
                "--requests",
                r.to_str().unwrap(),
                "--speculate",
                "model",
                "--draft-bundle",
                o.to_str().unwrap(),
            ])
        };
        assert_eq!(code, 2, "{cmd}: {err}");
        assert!(
            err.contains("--draft-bundle: its tokenizer.json (sha256 "),
            "{cmd}: {err}"
        );
        assert!(err.contains("is not the model's"), "{cmd}: {err}");
    }
    // No output is written into the draft's bundle either.
    let w = weak();
    let inside = w.join("out.safetensors");
    let (code, _, err) = gen(&[
        "--speculate",
        "model",
        "--draft-bundle",
        w.to_str().unwrap(),
        "--logits-out",
        inside.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("it is inside the bundle"), "{err}");
    assert!(!inside.exists());
    // The flags' own rules (exit 2, by name).
    for (extra, says) in [
        (
            &["--speculate", "model"][..],
            "--speculate model needs --draft-bundle",
        ),
        (
            &["--speculate", "ngram", "--draft-bundle", b][..],
            "--draft-bundle is the draft model of --speculate model",
        ),
        (
            &["--no-speculative", "--speculate", "ngram"][..],
            "--no-speculative",
        ),
        (
            &["--no-speculative", "--draft-bundle", b][..],
            "--no-speculative",
        ),
        (
            &[
                "--speculate",
                "model",
                "--draft-bundle",
                b,
                "--draft-tokens",
                "0",
            ][..],
            "--draft-tokens",
        ),
    ] {
        let (code, _, err) = gen(extra);
        assert_eq!(code, 2, "{extra:?}: {err}");
        assert!(err.contains(says), "{extra:?}: {err}");
    }
}

#[test]
fn score_with_a_draft_model_gives_the_plain_results_byte_for_byte() {
    let (b, w) = (demo(), weak());
    let (b, w) = (b.to_str().unwrap(), w.to_str().unwrap());
    let d = tempfile::tempdir().unwrap();
    let reqs = d.path().join("gen.jsonl");
    let lines = [
        json!({"context": PROMPT, "max_tokens": 14, "top_logprobs": 2}),
        json!({"context": PROMPT, "max_tokens": 14, "until": ["b\n"]}),
        json!({"context": "import os\nimport os\nimport", "max_tokens": 7, "temperature": 0.8, "seed": 2}),
        json!({"context": "x = 1", "max_tokens": 5, "echo": true}),
        json!({"context": "x = 1", "continuation": " + 2"}),
    ];
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    fs::write(&reqs, text).unwrap();
    let call = |extra: &[&str]| {
        let mut v = vec![
            "score",
            b,
            "--requests",
            reqs.to_str().unwrap(),
            "--backend",
            "cpu",
            "--threads",
            "2",
            "--json",
        ];
        v.extend(extra);
        let (code, out, err) = run(&v);
        assert_eq!(code, 0, "{err}");
        let summary: Value = serde_json::from_str(err.lines().last().unwrap()).unwrap();
        (out, summary)
    };
    let (want, _) = call(&["--max-batch", "3"]);
    assert_eq!(want.lines().count(), 5, "{want}");
    let (got, _) = call(&["--max-batch", "3", "--no-speculative"]);
    assert_eq!(got, want, "--no-speculative");
    let mut self_draft = (0, 0);
    for (draft, k, batch) in [(b, "4", "3"), (b, "1", "1"), (w, "3", "3"), (w, "8", "2")] {
        let (got, summary) = call(&[
            "--max-batch",
            batch,
            "--speculate",
            "model",
            "--draft-bundle",
            draft,
            "--draft-tokens",
            k,
        ]);
        assert_eq!(got, want, "draft {draft} k {k} batch {batch}");
        let s = &summary["speculate"];
        assert_eq!(s["drafter"], "model", "{summary}");
        assert!(s["drafted"].as_u64().unwrap() > 0, "{summary}");
        assert!(s["draft_model_steps"].as_u64().unwrap() > 0, "{summary}");
        if draft == b {
            self_draft.0 += s["drafted"].as_u64().unwrap();
            self_draft.1 += s["accepted"].as_u64().unwrap();
        }
    }
    // The greedy requests' drafts are all accepted when the model drafts for itself; the
    // sampled one's need not be.
    assert!(
        self_draft.1 > 0 && self_draft.1 <= self_draft.0,
        "{self_draft:?}"
    );
}
