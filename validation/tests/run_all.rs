//! The invariant checks end to end: the oracle fixtures converted by the real tarfa-convert, the
//! real tarfa-run, and `tarfa-validate` as `validation/run-all` runs it. Also: each check fails
//! when its invariant is broken, and the exit codes.

mod common;

use common::*;

/// Every check holds on a fixture, and each prints its line.
fn run_all_holds(fixture: &str) {
    let rt = runtime();
    let c = convert(fixture);
    let (code, out, err) = run(VALIDATE, &[&c.bundle, &"--tarfa-run", &rt]);
    println!("{out}");
    assert_eq!(code, 0, "stdout:\n{out}\nstderr:\n{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("tarfa-validate: bundle "), "{out}");
    assert!(
        lines[0].contains(&format!("fixtures/oracle/{fixture}/reference.safetensors")),
        "oracle found: {out}"
    );
    for name in ["weights", "router", "f32-logits", "invariance"] {
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&format!("PASS  {name:<11} "))),
            "no PASS line for {name}:\n{out}"
        );
    }
    assert!(
        out.contains("tamper probes: one flipped byte refused in"),
        "{out}"
    );
    assert!(out.contains("k = 8 = num_experts_per_tok"), "{out}");
    assert!(out.contains("same threads=2 "), "{out}");
    assert!(out.contains("same prefill = decode "), "{out}");
    assert!(out.contains("all bit-identical"), "{out}");
    assert!(
        out.trim_end()
            .ends_with("4 checks: 4 held, 0 failed, 0 skipped, 0 environment errors -> exit 0"),
        "{out}"
    );
}

#[test]
fn every_check_holds_on_qwen3moe_a() {
    run_all_holds("qwen3moe-a");
}

#[test]
fn every_check_holds_on_qwen3moe_code() {
    run_all_holds("qwen3moe-code");
}

/// A format-version-2 bundle (experts stored encoded): the weights check re-hashes the decoded
/// extents against the manifest (it hashed the stored bytes before, and failed), and a flipped
/// stored byte of an encoded expert fails it.
#[test]
fn an_encoded_bundle_is_rehashed_decoded_and_a_flipped_stored_byte_fails() {
    let rt = runtime();
    let c = convert_with("qwen3moe-code", &["--codec", "exp-zstd"]);
    let regions = tarfa_validate::bundle::jnf_regions(&c.bundle.join("model.jnf")).unwrap();
    let encoded: Vec<&String> = regions
        .iter()
        .filter(|(_, r)| r.encoded.is_some())
        .map(|(n, _)| n)
        .collect();
    assert!(!encoded.is_empty(), "no extent was stored encoded");
    for (n, r) in &regions {
        if let Some(d) = r.encoded {
            assert!(r.length < d, "{n}: stored {} of {d}", r.length);
        }
    }
    let args = [
        &c.bundle as &dyn AsRef<std::ffi::OsStr>,
        &"--tarfa-run",
        &rt,
        &"--only",
        &"weights",
    ];
    let (code, out, err) = run(VALIDATE, &args);
    println!("{out}");
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains("PASS  weights") && out.contains("re-hashed from model.jnf"),
        "{out}"
    );
    assert!(
        out.contains("tamper probes: one flipped byte refused in"),
        "{out}"
    );
    flip_byte_of(&c.bundle, encoded[0]);
    let (code, out, err) = run(VALIDATE, &args);
    println!("{out}");
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(out.contains("FAIL  weights"), "{out}");
}

#[test]
fn a_flipped_weight_byte_fails_the_weights_check() {
    let rt = runtime();
    let c = convert("qwen3moe-a");
    flip_byte_of(&c.bundle, "model.layers.1.self_attn.q_proj.weight");
    let (code, out, err) = run(
        VALIDATE,
        &[&c.bundle, &"--tarfa-run", &rt, &"--only", &"weights"],
    );
    println!("{out}");
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(
        out.contains("FAIL  weights") && out.contains("verification failure"),
        "{out}"
    );
}

#[test]
fn an_arm_that_changes_the_logits_fails_the_invariance_check() {
    let rt = runtime();
    let c = convert("qwen3moe-a");
    let (code, out, err) = run(
        VALIDATE,
        &[
            &c.bundle,
            &"--tarfa-run",
            &rt,
            &"--only",
            &"invariance",
            &"--no-table-arms",
            &"--arm",
            &"bf16-final-hidden=--invalid-bf16-before-lm-head",
            &"--arm",
            &"four-threads=--threads 4",
        ],
    );
    println!("{out}");
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(out.contains("FAIL  invariance"), "{out}");
    assert!(out.contains("DIFF bf16-final-hidden"), "{out}");
    assert!(out.contains("same four-threads"), "{out}");
    // The difference is located to a logit, with both values' bits.
    let diff = out
        .lines()
        .find(|l| l.contains("DIFF bf16-final-hidden"))
        .unwrap();
    assert!(
        diff.contains("prefill_logits[0][") && diff.contains("0x"),
        "{diff}"
    );
}

#[test]
fn without_an_oracle_the_f32_check_is_skipped_and_says_why() {
    let rt = runtime();
    let c = convert("qwen3moe-a");
    let empty = c.dir.path().join("no-oracles");
    std::fs::create_dir(&empty).unwrap();
    let (code, out, err) = run(
        VALIDATE,
        &[
            &c.bundle,
            &"--tarfa-run",
            &rt,
            &"--oracle-dir",
            &empty,
            &"--only",
            &"router,f32-logits",
        ],
    );
    println!("{out}");
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("oracle none"), "{out}");
    assert!(
        out.contains("SKIP  f32-logits  no oracle reference"),
        "{out}"
    );
    // random prompts of 1, 7, 33 and 300 tokens, 8 generated each
    assert!(
        out.contains("PASS  router      4 prompts, 369 positions"),
        "{out}"
    );
}

#[test]
fn bad_usage_exits_2_and_a_missing_runtime_exits_3() {
    let d = tempfile::tempdir().unwrap();
    let (code, _, err) = run(VALIDATE, &[&d.path()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not a bundle"), "{err}");
    let (code, _, _) = run(VALIDATE, &[&d.path(), &"--no-such-flag"]);
    assert_eq!(code, 2);
    let c = convert("qwen3moe-a");
    let (code, _, err) = run(VALIDATE, &[&c.bundle, &"--only", &"speed"]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = run(
        VALIDATE,
        &[&c.bundle, &"--tarfa-run", &d.path().join("nothing")],
    );
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("tarfa-run is not usable"), "{err}");
}
