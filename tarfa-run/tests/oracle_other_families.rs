//! Mixtral, Qwen2-MoE and OLMoE against transformers' float32 runs. Their fixtures are not in the
//! repository (size); these tests run when TARFA_EXTRA_ORACLES names a directory holding
//! mixtral-a, qwen2moe-a and olmoe-a (the project's shared oracle), and are ignored otherwise:
//! `TARFA_EXTRA_ORACLES=/path/to/oracle cargo test -p tarfa-run --test oracle_other_families -- --ignored`

mod common;

use common::*;
use tarfa_run::cpu::{ForwardOptions, LogitRows};
use tarfa_run::generate::greedy;
use tarfa_run::numerics::Kernel;

fn check(name: &str) {
    let root = std::env::var("TARFA_EXTRA_ORACLES")
        .expect("set TARFA_EXTRA_ORACLES to the directory holding the extra oracle fixtures");
    let f = load_fixture_from(&std::path::Path::new(&root).join(name), name);
    let eng = engine(&f, 2, Kernel::best());
    let mut worst = 0f64;
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
        for (got, want) in g.step_logits.iter().zip(&r.step_logits) {
            worst = worst.max(rel_err(got, want));
        }
        for (got, want) in g.prefill.logits.iter().zip(&r.prefill_logits) {
            worst = worst.max(rel_err(got, want));
        }
        for rec in &g.prefill.router {
            let mut a = rec.experts.clone();
            let mut b = r.router_topk[rec.moe_layer][rec.position].clone();
            a.sort();
            b.sort();
            if a != b {
                assert!((rec.kth_prob - rec.next_prob.unwrap_or(0.0)).abs() <= 1e-6);
            }
        }
    }
    eprintln!("{name}: worst relative logit error {worst:e}");
    assert!(
        worst <= 1e-4,
        "{name}: worst relative logit error {worst:e}"
    );
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES"]
fn mixtral_matches_transformers() {
    check("mixtral-a");
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES"]
fn qwen2_moe_matches_transformers() {
    check("qwen2moe-a");
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES"]
fn olmoe_matches_transformers() {
    check("olmoe-a");
}
