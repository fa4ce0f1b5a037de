//! Mixtral, Qwen2-MoE and OLMoE against transformers' float32 runs. Their fixtures are not in the
//! repository (size); these tests run when TARFA_EXTRA_ORACLES names a directory holding
//! mixtral-a, qwen2moe-a and olmoe-a (the project's shared oracle), and are ignored otherwise:
//! `TARFA_EXTRA_ORACLES=/path/to/oracle cargo test -p tarfa-run --test oracle_other_families -- --ignored`

mod common;

use common::*;

fn check(name: &str) {
    let root = std::env::var("TARFA_EXTRA_ORACLES")
        .expect("set TARFA_EXTRA_ORACLES to the directory holding the extra oracle fixtures");
    check_against_oracle(&load_fixture_from(
        &std::path::Path::new(&root).join(name),
        name,
    ));
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
