//! The `tarfa-run` binary end to end, on bundles converted from the oracle fixtures: the demo's
//! tokens equal transformers', logits files are reproducible and exact, and bad input gets the
//! documented exit codes.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use safetensors::SafeTensors;

const BIN: &str = env!("CARGO_BIN_EXE_tarfa-run");

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/oracle")
        .join(name)
}

/// One converted bundle per fixture, shared by the tests of this file. They live in a fixed
/// directory under the target dir, emptied when the first test asks (a static TempDir would never
/// be dropped, leaving bundles in /tmp after every run).
fn bundle(name: &'static str) -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-bundles");
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    });
    let out = dir.join(name);
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = LOCK.lock().unwrap();
    if !out.exists() {
        tarfa_convert::convert(&fixture(name), &out, &Default::default()).unwrap();
    }
    out
}

fn run(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(BIN).args(args).output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

fn i64s(st: &SafeTensors, name: &str) -> Vec<i64> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn f32s(st: &SafeTensors, name: &str) -> (Vec<usize>, Vec<f32>) {
    let t = st.tensor(name).unwrap();
    (
        t.shape().to_vec(),
        t.data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
    )
}

fn tokens_arg(ids: &[i64]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn demo_generates_transformers_tokens() {
    let d = tempfile::tempdir().unwrap();
    let summary = d.path().join("s.json");
    let refs = fs::read(fixture("qwen3moe-code/reference.safetensors")).unwrap();
    let refs = SafeTensors::deserialize(&refs).unwrap();
    let expected = i64s(&refs, "greedy.0");
    let (code, stdout, err) = run(&[
        "demo",
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
        "demo",
        "--cache-dir",
        d.path().to_str().unwrap(),
        "--max-new-tokens",
        "2",
    ]);
    assert_eq!(code, 0);
    assert!(err.contains("reusing"), "{err}");
}

#[test]
fn logits_file_is_exact_and_reproducible() {
    let b = bundle("qwen3moe-a");
    let d = tempfile::tempdir().unwrap();
    let refs = fs::read(fixture("qwen3moe-a/reference.safetensors")).unwrap();
    let refs = SafeTensors::deserialize(&refs).unwrap();
    let prompt = i64s(&refs, "prompt.2");
    let greedy = i64s(&refs, "greedy.2");
    let (_, ref_steps) = f32s(&refs, "step_logits.2");
    let (_, ref_prefill) = f32s(&refs, "prefill_logits.2");
    let out = |name: &str, threads: &str| {
        let p = d.path().join(name);
        let (code, stdout, err) = run(&[
            "generate",
            b.to_str().unwrap(),
            "--tokens",
            &tokens_arg(&prompt),
            "--max-new-tokens",
            &greedy.len().to_string(),
            "--ignore-eos",
            "--prefill-logits",
            "--threads",
            threads,
            "--logits-out",
            p.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{err}");
        (fs::read(p).unwrap(), stdout, err)
    };
    let (a, stdout, err) = out("a.safetensors", "2");
    let (b1, _, _) = out("b.safetensors", "1");
    assert_eq!(
        a, b1,
        "identical runs (1 and 2 threads) give identical files"
    );
    let manifest = tarfa_manifest::Manifest::load(&b.join("manifest.toml")).unwrap();
    assert!(
        err.contains(&manifest.root_digest),
        "prints the root digest: {err}"
    );
    assert!(
        err.contains("prefill") && err.contains("decode") && err.contains("tok/s"),
        "{err}"
    );
    // No tokenizer in this bundle: the ids are printed.
    let printed: Vec<i64> = stdout
        .split_whitespace()
        .map(|t| t.parse().unwrap())
        .collect();
    assert_eq!(printed, greedy);
    // Without --logits-out the engine chooses each token itself (no logits kept): the same
    // tokens.
    let (code, stdout2, err2) = run(&[
        "generate",
        b.to_str().unwrap(),
        "--tokens",
        &tokens_arg(&prompt),
        "--max-new-tokens",
        &greedy.len().to_string(),
        "--ignore-eos",
    ]);
    assert_eq!(code, 0, "{err2}");
    assert_eq!(stdout2, stdout, "tokens without --logits-out");

    let st = SafeTensors::deserialize(&a).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&a).unwrap();
    assert_eq!(
        meta.metadata().as_ref().unwrap()["root_digest"],
        manifest.root_digest
    );
    assert_eq!(i64s(&st, "tokens"), greedy);
    let (shape, steps) = f32s(&st, "logits");
    assert_eq!(shape, [greedy.len(), 512]);
    let (pshape, prefill) = f32s(&st, "prefill_logits");
    assert_eq!(pshape, [prompt.len(), 512]);
    // The first step's logits are the last prefill row, bit for bit.
    assert_eq!(
        steps[..512].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        prefill[prefill.len() - 512..]
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>()
    );
    for (rows, reference) in [(&steps, &ref_steps), (&prefill, &ref_prefill)] {
        for (r, (got, want)) in rows.chunks(512).zip(reference.chunks(512)).enumerate() {
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = got
                .iter()
                .zip(want)
                .fold(0f32, |m, (g, w)| m.max((g - w).abs()));
            assert!(err <= 1e-4 * scale, "row {r}: {err} > 1e-4 * {scale}");
        }
    }
}

#[test]
fn router_trace_and_verify_report() {
    let b = bundle("qwen3moe-a");
    let d = tempfile::tempdir().unwrap();
    let trace = d.path().join("t.jsonl");
    let report = d.path().join("v.json");
    let (code, _, err) = run(&[
        "generate",
        b.to_str().unwrap(),
        "--tokens",
        "1,2,3",
        "--max-new-tokens",
        "3",
        "--ignore-eos",
        "--router-trace",
        trace.to_str().unwrap(),
        "--verify-report",
        report.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<serde_json::Value> = fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["kind"], "header");
    assert_eq!(lines[0]["num_experts_per_tok"], 8);
    // 4 MoE layers x (3 prompt tokens + 2 decode steps).
    assert_eq!(lines.len() - 1, 4 * 5);
    for l in &lines[1..] {
        assert_eq!(l["experts"].as_array().unwrap().len(), 8);
    }
    let v: serde_json::Value = serde_json::from_slice(&fs::read(&report).unwrap()).unwrap();
    let m = tarfa_manifest::Manifest::load(&b.join("manifest.toml")).unwrap();
    assert_eq!(v["root_digest"], m.root_digest);
    assert_eq!(v["tensors"].as_array().unwrap().len(), m.tensors.len());
    let used: std::collections::HashSet<String> = lines[1..]
        .iter()
        .flat_map(|l| {
            let layer = l["layer"].as_u64().unwrap();
            l["experts"]
                .as_array()
                .unwrap()
                .iter()
                .map(move |e| format!("model.layers.{layer}.mlp.experts.{}", e.as_u64().unwrap()))
                .collect::<Vec<_>>()
        })
        .collect();
    let verified: std::collections::HashSet<String> = v["experts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        used, verified,
        "exactly the experts used were read, each verified"
    );
}

#[test]
fn corrupted_bundle_is_a_verification_failure() {
    let d = tempfile::tempdir().unwrap();
    let b = d.path().join("b");
    tarfa_convert::convert(&fixture("qwen3moe-a"), &b, &Default::default()).unwrap();
    let jnf = jnf_format::JnfFile::open(&b.join("model.jnf")).unwrap();
    let victim = jnf.header().expert(2, 5).unwrap().clone();
    drop(jnf);
    let mut bytes = fs::read(b.join("model.jnf")).unwrap();
    bytes[victim.offset as usize + 100] ^= 0x40;
    fs::write(b.join("model.jnf"), bytes).unwrap();
    // Route every layer through all experts: a long prompt reaches expert 5 of layer 2.
    let prompt: Vec<String> = (0..100).map(|i| ((i * 37) % 512).to_string()).collect();
    let (code, _, err) = run(&[
        "generate",
        b.to_str().unwrap(),
        "--tokens",
        &prompt.join(","),
        "--max-new-tokens",
        "2",
        "--preload",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("model.layers.2.mlp.experts.5") && err.contains("BLAKE3"),
        "{err}"
    );
}

#[test]
fn bad_input_exit_codes() {
    let b = bundle("qwen3moe-a");
    let bs = b.to_str().unwrap();
    let cases: Vec<(Vec<String>, i32, &str)> = vec![
        (
            vec![
                "generate".into(),
                "/nonexistent/bundle".into(),
                "--tokens".into(),
                "1".into(),
            ],
            2,
            "not a Tarfa bundle",
        ),
        (
            vec![
                "generate".into(),
                bs.into(),
                "--tokens".into(),
                "1,512".into(),
            ],
            2,
            "outside the vocabulary",
        ),
        (
            vec!["generate".into(), bs.into(), "--prompt".into(), "hi".into()],
            2,
            "no tokenizer",
        ),
        (
            vec![
                "generate".into(),
                bs.into(),
                "--tokens".into(),
                "1".into(),
                "--expect-root".into(),
                "ab".repeat(32),
            ],
            1,
            "root digest",
        ),
        (vec!["generate".into(), bs.into()], 2, ""),
        (vec!["bogus".into()], 2, ""),
    ];
    for (args, want, msg) in cases {
        let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let (code, _, err) = run(&a);
        assert_eq!(code, want, "{args:?}: {err}");
        assert!(err.contains(msg), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // An empty prompt (the demo model has a tokenizer).
    let code_bundle = bundle("qwen3moe-code");
    let (code, _, err) = run(&["generate", code_bundle.to_str().unwrap(), "--prompt", ""]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("empty"), "{err}");
    // Longer than max_position_embeddings (2048 for the demo model).
    let long: Vec<String> = (0..2049).map(|i| (i % 4096).to_string()).collect();
    let (code, _, err) = run(&[
        "generate",
        code_bundle.to_str().unwrap(),
        "--tokens",
        &long.join(","),
        "--max-new-tokens",
        "1",
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("2048"), "{err}");
    // Help documents the exit codes.
    let (code, help, _) = run(&["generate", "--help"]);
    assert_eq!(code, 0);
    assert!(help.contains("Exit codes"));
}

#[test]
fn eos_from_generation_config_stops_generation_unless_ignored() {
    // A copy of qwen3moe-a whose generation_config.json names, as EOS, a list holding an id
    // outside the vocabulary (ignored with a warning) and the 4th token greedy decoding produces.
    let refs = fs::read(fixture("qwen3moe-a/reference.safetensors")).unwrap();
    let refs = SafeTensors::deserialize(&refs).unwrap();
    let prompt = i64s(&refs, "prompt.1");
    let greedy = i64s(&refs, "greedy.1");
    let eos = greedy[3];
    let stop = greedy.iter().position(|&t| t == eos).unwrap();
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    fs::create_dir(&src).unwrap();
    for e in fs::read_dir(fixture("qwen3moe-a")).unwrap().flatten() {
        fs::copy(e.path(), src.join(e.file_name())).unwrap();
    }
    fs::write(
        src.join("generation_config.json"),
        format!("{{\"eos_token_id\": [99999, {eos}]}}"),
    )
    .unwrap();
    let b = d.path().join("b");
    tarfa_convert::convert(&src, &b, &Default::default()).unwrap();
    let s = d.path().join("s.json");
    let gen = |extra: &[&str]| {
        let mut args = vec![
            "generate",
            b.to_str().unwrap(),
            "--max-new-tokens",
            "12",
            "--summary-json",
            s.to_str().unwrap(),
        ];
        let t = tokens_arg(&prompt);
        args.extend(["--tokens", &t]);
        args.extend(extra);
        let (code, _, err) = run(&args);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_slice(&fs::read(&s).unwrap()).unwrap();
        (v["generated_tokens"].as_u64().unwrap() as usize, err)
    };
    let (n, err) = gen(&[]);
    assert_eq!(n, stop + 1, "stops at the first EOS, inclusive");
    assert!(
        err.contains("EOS id 99999 is outside the vocabulary"),
        "{err}"
    );
    let (n, _) = gen(&["--ignore-eos"]);
    assert_eq!(n, 12);
}

#[test]
fn backends_without_a_gpu() {
    let b = bundle("qwen3moe-a");
    let bs = b.to_str().unwrap();
    // cuda is a clear environment error here (CI has no GPU); auto falls back and says so.
    let (code, _, err) = run(&[
        "generate",
        bs,
        "--tokens",
        "1,2",
        "--max-new-tokens",
        "2",
        "--backend",
        "cuda",
    ]);
    if code == 0 {
        return; // a machine with a GPU: nothing to check here (the selftest covers it)
    }
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("CUDA") || err.contains("GPU") || err.contains("NVRTC"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let (code, _, err) = run(&["generate", bs, "--tokens", "1,2", "--max-new-tokens", "2"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("backend auto: no usable GPU") && err.contains("using the CPU"),
        "{err}"
    );
    let (code, _, err) = run(&["selftest", "--backend", "cuda", bs]);
    assert_eq!(code, 3, "{err}");
}
