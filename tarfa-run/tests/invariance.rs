//! The contract's invariances on the fixtures: prefill logits equal token-by-token decode logits
//! bit for bit; logits do not depend on the thread count, the SIMD path, or how a prompt is
//! chunked; experts are fetched once per MoE layer per step; and the deliberately inexact
//! BF16-before-lm_head arm is caught by the oracle tolerance.

mod common;

use common::*;
use tarfa_run::cpu::{FinalHidden, ForwardOptions, LogitRows};
use tarfa_run::generate::greedy;
use tarfa_run::numerics::{Kernel, SimdPath};
use tarfa_run::RunError;

/// (prefill logit bits, greedy tokens, step logit bits) of one run.
type RunBits = (Vec<Vec<u32>>, Vec<u32>, Vec<Vec<u32>>);

fn all_rows() -> ForwardOptions {
    ForwardOptions {
        logits: LogitRows::All,
        ..Default::default()
    }
}

/// Logits of every position of `prompt` computed in chunks of `chunk` tokens.
fn chunked_logits(eng: &tarfa_run::cpu::CpuEngine, prompt: &[u32], chunk: usize) -> Vec<Vec<f32>> {
    let mut cache = eng.model().new_cache();
    let mut rows = Vec::new();
    for c in prompt.chunks(chunk) {
        rows.extend(eng.forward(&mut cache, c, &all_rows()).unwrap().logits);
    }
    rows
}

#[test]
fn prefill_equals_decode_bitwise() {
    for (name, prompt_idx) in [("qwen3moe-a", 3), ("qwen3moe-code", 2)] {
        let f = load_fixture(name);
        let eng = engine(&f, 2, Kernel::best());
        let p = &f.prompts[prompt_idx].prompt;
        let whole = chunked_logits(&eng, p, p.len());
        let one_by_one = chunked_logits(&eng, p, 1);
        let sevens = chunked_logits(&eng, p, 7);
        assert_eq!(whole.len(), p.len());
        assert!(
            bits(&whole) == bits(&one_by_one),
            "{name}: prefill vs decode"
        );
        assert!(
            bits(&whole) == bits(&sevens),
            "{name}: prefill vs chunks of 7"
        );
    }
}

#[test]
fn threads_and_simd_paths_give_identical_bits() {
    let f = load_fixture("qwen3moe-a");
    let code = load_fixture("qwen3moe-code");
    for (fx, prompt_idx, steps) in [(&f, 3, 8), (&code, 1, 8)] {
        let p = &fx.prompts[prompt_idx].prompt;
        let mut reference: Option<RunBits> = None;
        let kernels = Kernel::all_available();
        assert!(kernels.iter().any(|k| k.path() == SimdPath::Scalar));
        for kernel in kernels {
            for threads in [1, 2] {
                let eng = engine(fx, threads, kernel);
                let mut cache = fx.model.new_cache();
                let g = greedy(&eng, &mut cache, p, steps, &all_rows()).unwrap();
                let got = (
                    bits(&g.prefill.logits),
                    g.tokens.clone(),
                    bits(&g.step_logits),
                );
                match &reference {
                    None => reference = Some(got),
                    Some(r) => assert!(
                        *r == got,
                        "{}: {:?} with {threads} threads differs",
                        fx.name,
                        kernel.path()
                    ),
                }
            }
        }
    }
}

#[test]
fn experts_are_fetched_once_per_moe_layer_per_step() {
    let f = load_fixture("qwen3moe-a");
    let eng = engine(&f, 2, Kernel::best());
    let p = &f.prompts[3].prompt; // 100 tokens
    let (calls0, fetched0) = f.source.fetch_counts();
    let mut cache = f.model.new_cache();
    let out = eng
        .forward(
            &mut cache,
            p,
            &ForwardOptions {
                trace_router: true,
                ..Default::default()
            },
        )
        .unwrap();
    let (calls1, fetched1) = f.source.fetch_counts();
    let layers = f.model.config().num_layers as u64;
    assert_eq!(calls1 - calls0, layers, "one experts() call per MoE layer");
    // each distinct expert chosen in a layer is fetched exactly once for the whole prompt
    let mut distinct = 0u64;
    for l in 0..f.model.config().num_layers {
        let mut set: Vec<u32> = out
            .router
            .iter()
            .filter(|r| r.layer == l)
            .flat_map(|r| r.experts.clone())
            .collect();
        set.sort();
        set.dedup();
        distinct += set.len() as u64;
    }
    assert_eq!(fetched1 - fetched0, distinct);
    assert_eq!(out.stats.experts_fetched, distinct);
}

/// The deliberately wrong arm: rounding the final hidden state to BF16 before the lm_head. The
/// oracle checks must notice it on at least one fixture prompt (a changed greedy token or a row
/// outside the 1e-4 tolerance). Prints which.
#[test]
fn bf16_before_lm_head_is_caught_by_the_oracle_checks() {
    let mut caught = Vec::new();
    for name in ["qwen3moe-a", "qwen3moe-code"] {
        let f = load_fixture(name);
        let eng = engine(&f, 2, Kernel::best());
        for (i, r) in f.prompts.iter().enumerate() {
            let mut cache = f.model.new_cache();
            let opts = ForwardOptions {
                final_hidden: FinalHidden::InvalidBf16BeforeLmHead,
                ..Default::default()
            };
            let g = greedy(&eng, &mut cache, &r.prompt, r.greedy.len(), &opts).unwrap();
            let first_diff = g.tokens.iter().zip(&r.greedy).position(|(a, b)| a != b);
            let worst = g
                .step_logits
                .iter()
                .zip(&r.step_logits)
                .map(|(a, b)| rel_err(a, b))
                .fold(0f64, f64::max);
            if first_diff.is_some() || worst > 1e-4 {
                caught.push(format!(
                    "{name} prompt {i}: first differing greedy token {first_diff:?}, worst step-logit rel err {worst:.2e}"
                ));
            }
        }
    }
    eprintln!("bf16-before-lm_head caught on:\n  {}", caught.join("\n  "));
    assert!(!caught.is_empty(), "the inexact arm went unnoticed");
}

#[test]
fn bad_inputs_are_errors_and_leave_the_cache_unchanged() {
    let f = load_fixture("qwen3moe-a");
    let eng = engine(&f, 1, Kernel::best());
    let mut cache = f.model.new_cache();
    let opts = ForwardOptions::default();
    assert!(matches!(
        eng.forward(&mut cache, &[], &opts),
        Err(RunError::EmptyStep)
    ));
    assert!(matches!(
        eng.forward(&mut cache, &[3, 512], &opts),
        Err(RunError::TokenOutOfRange {
            token: 512,
            vocab: 512
        })
    ));
    assert_eq!(cache.len(), 0);
    eng.forward(&mut cache, &[1, 2, 3], &opts).unwrap();
    let long = vec![1u32; cache.max_len()];
    assert!(matches!(
        eng.forward(&mut cache, &long, &opts),
        Err(RunError::ContextFull { .. })
    ));
    assert_eq!(cache.len(), 3);
    // rewinding and replaying gives the same bits
    let a = eng.forward(&mut cache, &[7], &opts).unwrap().logits;
    assert_eq!(cache.truncate(3), 3);
    let b = eng.forward(&mut cache, &[7], &opts).unwrap().logits;
    assert!(bits(&a) == bits(&b));
}
