//! The log-softmax on transformers' own logits: every logit row the oracle fixtures hold
//! (fixtures/oracle/*/reference.safetensors, `step_logits.i` and `prefill_logits.i`) through
//! `tarfa_core::logprob`, against two independent computations. The oracle keeps transformers'
//! logits but not its log_softmax, so the references are computed here: torch's float32
//! log_softmax (max, f32 sum of exp, `x - max - ln sum`) must agree within 2e-4, and an f64
//! computation on the platform's exp/ln in another summation order within 1e-9.

use std::path::Path;

use safetensors::{Dtype, SafeTensors};
use tarfa_core::logprob::{log_softmax, token_logprob, top_logprobs};

/// Every logit row of every oracle fixture.
fn oracle_rows() -> Vec<(String, Vec<f32>)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/oracle");
    let mut rows = Vec::new();
    let mut dirs: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("reference.safetensors").is_file())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 5, "the oracle fixtures are missing: {dirs:?}");
    for dir in dirs {
        let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut names: Vec<String> = st
            .names()
            .into_iter()
            .filter(|n| n.starts_with("step_logits.") || n.starts_with("prefill_logits."))
            .map(|n| n.to_string())
            .collect();
        names.sort();
        for name in names {
            let t = st.tensor(&name).unwrap();
            assert_eq!(t.dtype(), Dtype::F32);
            let vocab = *t.shape().last().unwrap();
            let values: Vec<f32> = t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            for (j, r) in values.chunks_exact(vocab).enumerate() {
                rows.push((format!("{}/{name}[{j}]", dir.display()), r.to_vec()));
            }
        }
    }
    rows
}

/// torch.log_softmax on a float32 CPU tensor, written out: every step in f32.
fn f32_log_softmax(r: &[f32]) -> Vec<f32> {
    let m = r.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let s: f32 = r.iter().map(|&x| (x - m).exp()).sum();
    let l = s.ln();
    r.iter().map(|&x| x - m - l).collect()
}

/// In f64 on the platform's exp/ln, summed from the last token to the first.
fn f64_log_softmax(r: &[f32]) -> Vec<f64> {
    let m = r.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let s: f64 = r.iter().rev().map(|&x| (x as f64 - m).exp()).sum();
    r.iter().map(|&x| x as f64 - m - s.ln()).collect()
}

#[test]
fn log_softmax_of_transformers_logits_agrees_with_float32_and_f64_references() {
    let rows = oracle_rows();
    assert!(rows.len() > 500, "{} rows", rows.len());
    let (mut worst32, mut worst64) = (0.0f64, 0.0f64);
    for (at, r) in &rows {
        let ours = log_softmax(r);
        let f32s = f32_log_softmax(r);
        let f64s = f64_log_softmax(r);
        for ((&a, &b), &c) in ours.iter().zip(&f32s).zip(&f64s) {
            worst32 = worst32.max((a - b as f64).abs());
            worst64 = worst64.max((a - c).abs());
            assert!((a - b as f64).abs() <= 2e-4, "{at}: {a} vs float32 {b}");
            assert!((a - c).abs() <= 1e-9, "{at}: {a} vs f64 {c}");
        }
        // The greedy token is the top alternative, and the top-5 set is the reference's.
        let top = top_logprobs(r, 5);
        assert_eq!(top[0].0, tarfa_core::generate::argmax(r), "{at}");
        let mut want: Vec<usize> = (0..r.len()).collect();
        want.sort_by(|&x, &y| f64s[y].partial_cmp(&f64s[x]).unwrap().then(x.cmp(&y)));
        let got: Vec<usize> = top.iter().map(|p| p.0 as usize).collect();
        assert_eq!(got, want[..5], "{at}");
        let t = top[3].0;
        assert_eq!(token_logprob(r, t).to_bits(), ours[t as usize].to_bits());
    }
    eprintln!(
        "{} rows: max |ours - float32| = {worst32:e}, max |ours - f64| = {worst64:e}",
        rows.len()
    );
}
