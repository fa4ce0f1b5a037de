//! The `tarfa-demo` binary end to end: from the model that ships in fixtures/, it converts,
//! verifies and generates transformers' own greedy tokens, reuses its cached bundle, converts
//! another model rather than reuse the first one's bundle, and caps its flags like tarfa-run.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use safetensors::SafeTensors;

const BIN: &str = env!("CARGO_BIN_EXE_tarfa-demo");

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/oracle")
        .join(name)
}

/// Runs the demo with `args` to its end; kills it and fails the test after 120 s (a hang), and
/// fails it on a panic message.
fn run(args: &[&str]) -> (i32, String, String) {
    let mut c = Command::new(BIN);
    c.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    // Drained on threads, so that a chatty child never blocks on a full pipe.
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            String::from_utf8_lossy(&v).into_owned()
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{c:?} hung (killed after 120 s)");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (out, err) = (out.join().unwrap(), err.join().unwrap());
    assert!(!err.contains("panicked"), "{c:?} panicked: {err}");
    (status.code().unwrap_or(-1), out, err)
}

/// The last line of stderr: the error a failed run ends with.
fn last_line(err: &str) -> &str {
    err.trim_end().lines().last().unwrap_or("")
}

fn i64s(st: &SafeTensors, name: &str) -> Vec<i64> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn demo_generates_transformers_tokens() {
    let d = tempfile::tempdir().unwrap();
    let summary = d.path().join("s.json");
    let refs = fs::read(fixture("qwen3moe-code/reference.safetensors")).unwrap();
    let refs = SafeTensors::deserialize(&refs).unwrap();
    let expected = i64s(&refs, "greedy.0");
    let (code, stdout, err) = run(&[
        "--cache-dir",
        d.path().to_str().unwrap(),
        "--ignore-eos",
        "--max-new-tokens",
        &expected.len().to_string(),
        "--summary-json",
        summary.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    for step in ["[1/3] convert", "[2/3] verify", "[3/3] generate"] {
        assert!(err.contains(step), "shows {step}: {err}");
    }
    let s: serde_json::Value = serde_json::from_slice(&fs::read(&summary).unwrap()).unwrap();
    let got: Vec<i64> = s["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect();
    assert_eq!(
        got, expected,
        "the demo's greedy tokens are transformers' float32 tokens"
    );
    let reference: serde_json::Value =
        serde_json::from_slice(&fs::read(fixture("qwen3moe-code/reference.json")).unwrap())
            .unwrap();
    let text = reference["fp32_cpu_text"][0].as_str().unwrap();
    assert!(
        stdout.contains(text.trim_end()),
        "streams the decoded text:\n{stdout}"
    );
    // A second run reuses the verified bundle.
    let (code, _, err) = run(&[
        "--cache-dir",
        d.path().to_str().unwrap(),
        "--max-new-tokens",
        "2",
    ]);
    assert_eq!(code, 0);
    assert!(err.contains("reusing"), "{err}");
    // Another model in the same cache is converted, not the first one's bundle reused: its
    // step 2 verifies qwen3moe-a's root digest (generation then stops: it has no tokenizer).
    let (code, _, err) = run(&[
        "--cache-dir",
        d.path().to_str().unwrap(),
        "--model",
        fixture("qwen3moe-a").to_str().unwrap(),
        "--max-new-tokens",
        "2",
    ]);
    assert!(!err.contains("reusing"), "{err}");
    assert!(err.contains("copied and hashed"), "{err}");
    // "[1/3] convert  SRC -> BUNDLE": the bundle this run converted qwen3moe-a into.
    let converted = err
        .lines()
        .find_map(|l| l.strip_prefix("[1/3] convert"))
        .and_then(|l| l.rsplit_once(" -> "))
        .map(|(_, b)| PathBuf::from(b))
        .unwrap();
    assert!(converted.starts_with(d.path()), "{err}");
    let a = tarfa_manifest::Manifest::load(&converted.join("manifest.toml")).unwrap();
    assert!(
        err.contains(&a.root_digest),
        "verifies qwen3moe-a's bundle: {err}"
    );
    assert_eq!(code, 2, "{err}");
    assert!(last_line(&err).contains("no tokenizer"), "{err}");
}

#[test]
fn flags_are_checked_like_tarfa_runs() {
    let (code, _, err) = run(&["--threads", "5000"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--threads") && err.contains("5000") && err.contains("1024"),
        "{err}"
    );
    let d = tempfile::tempdir().unwrap();
    let (code, _, err) = run(&[
        "--cache-dir",
        d.path().to_str().unwrap(),
        "--model",
        d.path().join("nothing-here").to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        last_line(&err).contains("the demo model is not there"),
        "{err}"
    );
    let (code, help, _) = run(&["--help"]);
    assert_eq!(code, 0);
    assert!(
        help.contains("Exit codes:") && help.contains("--model"),
        "{help}"
    );
}
