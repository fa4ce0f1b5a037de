//! The CPU backend against transformers' float32 runs of the Qwen3-MoE fixtures: greedy tokens,
//! logits within 1e-4 of each row's scale, and router top-k sets.

mod common;

use common::*;
use tarfa_run::cpu::{ForwardOptions, LogitRows};
use tarfa_run::generate::greedy;
use tarfa_run::numerics::Kernel;

const TOL: f64 = 1e-4;

fn check_against_oracle(name: &str) {
    let f = load_fixture(name);
    let eng = engine(&f, 2, Kernel::best());
    let k = f.model.config().top_k;
    let mut worst = 0f64;
    let mut tie_skips = 0;
    for (i, r) in f.prompts.iter().enumerate() {
        let mut cache = f.model.new_cache();
        let opts = ForwardOptions {
            logits: LogitRows::All,
            trace_router: true,
            ..Default::default()
        };
        let g = greedy(&eng, &mut cache, &r.prompt, r.greedy.len(), &opts).unwrap();
        assert_eq!(
            g.tokens, r.greedy,
            "{name} prompt {i}: greedy tokens differ"
        );
        assert_eq!(g.step_logits.len(), r.step_logits.len());
        for (j, (got, want)) in g.step_logits.iter().zip(&r.step_logits).enumerate() {
            let e = rel_err(got, want);
            worst = worst.max(e);
            assert!(e <= TOL, "{name} prompt {i} step {j}: rel err {e:e}");
        }
        assert_eq!(g.prefill.logits.len(), r.prefill_logits.len());
        for (t, (got, want)) in g.prefill.logits.iter().zip(&r.prefill_logits).enumerate() {
            let e = rel_err(got, want);
            worst = worst.max(e);
            assert!(
                e <= TOL,
                "{name} prompt {i} prefill position {t}: rel err {e:e}"
            );
        }
        // router: the top-k set per MoE layer per prompt position
        for rec in &g.prefill.router {
            let want = &r.router_topk[rec.moe_layer][rec.position];
            let mut a = rec.experts.clone();
            let mut b = want.clone();
            a.sort();
            b.sort();
            if a != b {
                let next = rec.next_prob.unwrap_or(0.0);
                assert!(
                    (rec.kth_prob - next).abs() <= 1e-6,
                    "{name} prompt {i} layer {} position {}: top-k {a:?} vs {b:?}",
                    rec.layer,
                    rec.position
                );
                tie_skips += 1;
            }
            assert_eq!(rec.experts.len(), k);
        }
    }
    eprintln!("{name}: worst relative logit error {worst:e}, near-tie router skips {tie_skips}");
}

#[test]
fn qwen3moe_a_matches_transformers() {
    check_against_oracle("qwen3moe-a");
}

#[test]
fn qwen3moe_code_matches_transformers() {
    check_against_oracle("qwen3moe-code");
}
