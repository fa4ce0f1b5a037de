//! The checks every newly added family gets (GLM-4.5, DeepSeek-V3/V2): its checkpoint through
//! the real converter and the real `tarfa-run` binary against transformers' float32 run, and the
//! contract's invariances on it (threads, SIMD path, prefill == decode, a batched step), bit for
//! bit.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use safetensors::SafeTensors;
use tarfa_run::cpu::{BatchEntry, ForwardOptions, LogitRows};
use tarfa_run::generate::greedy;
use tarfa_run::numerics::{Kernel, SimdPath};

use super::{bits, engine, load_fixture_from, rel_err, Fixture, TOL};

const BIN: &str = env!("CARGO_BIN_EXE_tarfa-run");

fn all_rows() -> ForwardOptions {
    ForwardOptions {
        logits: LogitRows::All,
        ..Default::default()
    }
}

/// Runs the binary to its end; fails the test after 60 s (a hang) or on a panic message.
pub fn run(args: &[&str]) -> (i32, String, String) {
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

/// An F32 tensor of a safetensors file: its shape and values.
pub fn f32s(st: &SafeTensors, name: &str) -> (Vec<usize>, Vec<f32>) {
    let t = st.tensor(name).unwrap();
    let v = t
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (t.shape().to_vec(), v)
}

/// Greedy decoding of every prompt of `prompts` through the CLI on `bundle` with 1 and 2
/// threads: the tokens printed, and the logits files' bytes of the 1-thread run.
pub fn cli_runs(bundle: &Path, f: &Fixture, tmp: &Path) -> Vec<(Vec<u32>, Vec<u8>)> {
    let b = bundle.to_str().unwrap();
    let mut out = Vec::new();
    for (i, r) in f.prompts.iter().enumerate() {
        let tokens: Vec<String> = r.prompt.iter().map(|t| t.to_string()).collect();
        let mut files = Vec::new();
        let mut printed_all = Vec::new();
        for threads in ["1", "2"] {
            let path = tmp.join(format!("p{i}-t{threads}.safetensors"));
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
                path.to_str().unwrap(),
            ]);
            assert_eq!(code, 0, "{err}");
            let printed: Vec<u32> = stdout
                .split_whitespace()
                .map(|t| t.parse().unwrap())
                .collect();
            printed_all.push(printed);
            files.push(std::fs::read(&path).unwrap());
        }
        assert_eq!(
            files[0], files[1],
            "prompt {i}: 1 and 2 threads, the same bytes"
        );
        assert_eq!(printed_all[0], printed_all[1]);
        out.push((printed_all.swap_remove(0), files.swap_remove(0)));
    }
    out
}

/// The checkpoint in `dir` through the converter and the CLI: the manifest lists
/// `non_expert` names before the first expert and names `expert` (a source prefix) among the
/// experts; on every prompt the CLI prints transformers' greedy tokens and writes step and
/// prefill logits within [`TOL`] of transformers', the same bytes with 1 and 2 threads.
pub fn cli_matches_oracle(dir: &Path, name: &str, non_expert: &[&str], expert: &str) {
    let f = load_fixture_from(dir, name);
    let tmp = tempfile::tempdir().unwrap();
    let bundle = tmp.path().join("bundle");
    tarfa_convert::convert(dir, &bundle, &Default::default()).unwrap();
    let manifest = std::fs::read_to_string(bundle.join("manifest.toml")).unwrap();
    let first_expert = manifest.find("[[experts]]").expect("an experts region");
    for n in non_expert {
        let at = manifest
            .find(&format!("name = \"{n}\"\n"))
            .unwrap_or_else(|| panic!("{n} not in the manifest"));
        assert!(at < first_expert, "{n} is not a non-expert tensor");
    }
    let at = manifest
        .find(&format!("name = \"{expert}\"\n"))
        .unwrap_or_else(|| panic!("expert {expert} not named by its source prefix"));
    assert!(at > first_expert);
    let vocab = f.model.config().vocab_size;
    for (i, ((printed, file), r)) in cli_runs(&bundle, &f, tmp.path())
        .into_iter()
        .zip(&f.prompts)
        .enumerate()
    {
        assert_eq!(printed, r.greedy, "{name} prompt {i}: greedy tokens");
        let st = SafeTensors::deserialize(&file).unwrap();
        let (_, steps) = f32s(&st, "logits");
        let (_, prefill) = f32s(&st, "prefill_logits");
        for (what, got, want) in [
            ("step", &steps, &r.step_logits),
            ("prefill", &prefill, &r.prefill_logits),
        ] {
            let rows: Vec<&[f32]> = got.chunks(vocab).collect();
            assert_eq!(rows.len(), want.len(), "{name} prompt {i}: {what} rows");
            for (j, (g, w)) in rows.iter().zip(want).enumerate() {
                let e = rel_err(g, w);
                assert!(e <= TOL, "{name} prompt {i} {what} row {j}: rel err {e:e}");
            }
        }
    }
}

/// The contract's invariances on `f`'s third prompt: every SIMD path with 1 and 2 threads gives
/// the same prefill logits, tokens and step logits; the prompt in one step equals it token by
/// token; a batched step of three sequences gives each the bits it has alone.
pub fn invariances_are_bitwise(f: &Fixture) {
    let p = &f.prompts[2].prompt;
    let steps = 6;
    let mut reference = None;
    let kernels = Kernel::all_available();
    assert!(kernels.iter().any(|k| k.path() == SimdPath::Scalar));
    for kernel in kernels {
        for threads in [1, 2] {
            let eng = engine(f, threads, kernel);
            let mut cache = f.model.new_cache();
            let g = greedy(&eng, &mut cache, p, steps, &all_rows()).unwrap();
            let got = (bits(&g.prefill.logits), g.tokens, bits(&g.step_logits));
            match &reference {
                None => reference = Some(got),
                Some(want) => assert!(*want == got, "{kernel:?} with {threads} threads differs"),
            }
        }
    }
    let eng = engine(f, 2, Kernel::best());
    let mut cache = f.model.new_cache();
    let whole = eng.forward(&mut cache, p, &all_rows()).unwrap().logits;
    let mut cache = f.model.new_cache();
    let mut one_by_one = Vec::new();
    for t in p {
        one_by_one.extend(eng.forward(&mut cache, &[*t], &all_rows()).unwrap().logits);
    }
    assert!(bits(&whole) == bits(&one_by_one), "prefill != decode");
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
