//! GLM-4.5 MoE (`glm4moe-a` of the shared oracle: partial rotary 0.5, q/k/v bias, qk norm,
//! sigmoid routing with a non-zero e_score_correction_bias, routed scaling 1.8, a shared
//! expert, the first layer dense) through the real converter and the real `tarfa-run` binary,
//! against transformers' float32 run; and the contract's invariances on it (threads, SIMD path,
//! prefill == decode, a batched step), bit for bit.
//!
//! The fixture lives in the shared oracle: these run when TARFA_EXTRA_ORACLES names it (`.ci/run`
//! sets it to ../shared/oracle and runs them), and are ignored with that reason otherwise:
//! `TARFA_EXTRA_ORACLES=../shared/oracle cargo test -p tarfa-run --test oracle_glm4_moe -- --ignored`

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use safetensors::SafeTensors;
use tarfa_run::cpu::{BatchEntry, ForwardOptions, LogitRows};
use tarfa_run::generate::greedy;
use tarfa_run::numerics::{Kernel, SimdPath};

const BIN: &str = env!("CARGO_BIN_EXE_tarfa-run");
const NAME: &str = "glm4moe-a";

fn shared_dir() -> PathBuf {
    let root = std::env::var("TARFA_EXTRA_ORACLES")
        .expect("set TARFA_EXTRA_ORACLES to the directory holding the extra oracle fixtures");
    let dir = Path::new(&root).join(NAME);
    assert!(
        dir.join("reference.safetensors").is_file(),
        "{}: no reference.safetensors",
        dir.display()
    );
    dir
}

fn all_rows() -> ForwardOptions {
    ForwardOptions {
        logits: LogitRows::All,
        ..Default::default()
    }
}

/// Runs the binary to its end; fails the test after 60 s (a hang) or on a panic message.
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
        if start.elapsed() > Duration::from_secs(60) {
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

fn f32s(st: &SafeTensors, name: &str) -> (Vec<usize>, Vec<f32>) {
    let t = st.tensor(name).unwrap();
    let v = t
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (t.shape().to_vec(), v)
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn glm4_moe_through_the_converter_and_the_cli_matches_transformers() {
    let dir = shared_dir();
    let f = load_fixture_from(&dir, NAME);
    let tmp = tempfile::tempdir().unwrap();
    let bundle = tmp.path().join("bundle");
    tarfa_convert::convert(&dir, &bundle, &Default::default()).unwrap();
    let b = bundle.to_str().unwrap();
    // The manifest: experts named by their source prefix; the shared experts and the router
    // (with its correction bias) in the non-expert region, listed before the first expert.
    let manifest = std::fs::read_to_string(bundle.join("manifest.toml")).unwrap();
    let first_expert = manifest.find("[[experts]]").expect("an experts region");
    for name in [
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.mlp.shared_experts.gate_proj.weight",
        "model.layers.2.mlp.shared_experts.down_proj.weight",
    ] {
        let at = manifest
            .find(&format!("name = \"{name}\"\n"))
            .unwrap_or_else(|| panic!("{name} not in the manifest"));
        assert!(at < first_expert, "{name} is not a non-expert tensor");
    }
    let expert = manifest
        .find("name = \"model.layers.1.mlp.experts.0\"\n")
        .expect("expert 0 of layer 1 named by its source prefix");
    assert!(expert > first_expert);
    let vocab = f.model.config().vocab_size;
    for (i, r) in f.prompts.iter().enumerate() {
        let tokens: Vec<String> = r.prompt.iter().map(|t| t.to_string()).collect();
        let mut files = Vec::new();
        for threads in ["1", "2"] {
            let out = tmp.path().join(format!("p{i}-t{threads}.safetensors"));
            let (code, stdout, err) = run(&[
                "generate",
                b,
                "--tokens",
                &tokens.join(","),
                "--max-new-tokens",
                &r.greedy.len().to_string(),
                "--ignore-eos",
                "--prefill-logits",
                "--threads",
                threads,
                "--backend",
                "cpu",
                "--logits-out",
                out.to_str().unwrap(),
            ]);
            assert_eq!(code, 0, "{err}");
            let printed: Vec<u32> = stdout
                .split_whitespace()
                .map(|t| t.parse().unwrap())
                .collect();
            assert_eq!(printed, r.greedy, "prompt {i}: greedy tokens");
            files.push(std::fs::read(&out).unwrap());
        }
        assert_eq!(
            files[0], files[1],
            "prompt {i}: 1 and 2 threads, the same bytes"
        );
        let st = SafeTensors::deserialize(&files[0]).unwrap();
        let (_, steps) = f32s(&st, "logits");
        let (_, prefill) = f32s(&st, "prefill_logits");
        for (what, got, want) in [
            ("step", &steps, &r.step_logits),
            ("prefill", &prefill, &r.prefill_logits),
        ] {
            let rows: Vec<&[f32]> = got.chunks(vocab).collect();
            assert_eq!(rows.len(), want.len(), "prompt {i}: {what} rows");
            for (j, (g, w)) in rows.iter().zip(want).enumerate() {
                let e = rel_err(g, w);
                assert!(e <= TOL, "prompt {i} {what} row {j}: rel err {e:e}");
            }
        }
    }
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn glm4_moe_invariances_are_bitwise() {
    let f = load_fixture_from(&shared_dir(), NAME);
    let p = &f.prompts[2].prompt; // 33 tokens
    let steps = 6;
    // threads x SIMD paths: identical prefill logits, tokens and step logits
    let mut reference = None;
    let kernels = Kernel::all_available();
    assert!(kernels.iter().any(|k| k.path() == SimdPath::Scalar));
    for kernel in kernels {
        for threads in [1, 2] {
            let eng = engine(&f, threads, kernel);
            let mut cache = f.model.new_cache();
            let g = greedy(&eng, &mut cache, p, steps, &all_rows()).unwrap();
            let got = (bits(&g.prefill.logits), g.tokens, bits(&g.step_logits));
            match &reference {
                None => reference = Some(got),
                Some(want) => assert!(*want == got, "{kernel:?} with {threads} threads differs"),
            }
        }
    }
    // prefill == decode: the prompt in one step, and token by token
    let eng = engine(&f, 2, Kernel::best());
    let mut cache = f.model.new_cache();
    let whole = eng.forward(&mut cache, p, &all_rows()).unwrap().logits;
    let mut cache = f.model.new_cache();
    let mut one_by_one = Vec::new();
    for t in p {
        one_by_one.extend(eng.forward(&mut cache, &[*t], &all_rows()).unwrap().logits);
    }
    assert!(bits(&whole) == bits(&one_by_one), "prefill != decode");
    // a batched step of three sequences gives each the bits it has alone
    let prompts: Vec<&[u32]> = vec![&f.prompts[1].prompt, p, &f.prompts[3].prompt];
    let alone: Vec<Vec<Vec<u32>>> = prompts
        .iter()
        .map(|q| {
            let mut c = f.model.new_cache();
            bits(&eng.forward(&mut c, q, &all_rows()).unwrap().logits)
        })
        .collect();
    let mut caches: Vec<_> = prompts.iter().map(|_| f.model.new_cache()).collect();
    let mut entries: Vec<BatchEntry<'_, _>> = caches
        .iter_mut()
        .zip(&prompts)
        .map(|(cache, q)| BatchEntry {
            cache,
            tokens: q,
            opts: all_rows(),
        })
        .collect();
    let outs = eng.forward_batch(&mut entries).unwrap();
    for (k, (o, want)) in outs.iter().zip(&alone).enumerate() {
        assert!(
            bits(&o.logits) == *want,
            "sequence {k} of the batch differs"
        );
    }
}
