//! Mixtral, Qwen2-MoE and OLMoE against transformers' float32 runs.
//!
//! The small twins `mixtral-s`, `qwen2moe-s` and `olmoe-s` ship in fixtures/oracle (made by
//! validation/oracle/make_oracle.py), so every clone checks the three families. The larger
//! `mixtral-a`, `qwen2moe-a` and `olmoe-a` live in the project's shared oracle: those tests run
//! when TARFA_EXTRA_ORACLES names its directory (`.ci/run` sets it to ../shared/oracle and runs
//! them), and are ignored, with that reason, otherwise:
//! `TARFA_EXTRA_ORACLES=/path/to/oracle cargo test -p tarfa-run --test oracle_other_families -- --ignored`

mod common;

use common::*;

fn check_shared(name: &str) {
    let root = std::env::var("TARFA_EXTRA_ORACLES")
        .expect("set TARFA_EXTRA_ORACLES to the directory holding the extra oracle fixtures");
    let dir = std::path::Path::new(&root).join(name);
    assert!(
        dir.join("reference.safetensors").is_file(),
        "{}: no reference.safetensors (TARFA_EXTRA_ORACLES={root})",
        dir.display()
    );
    check_against_oracle(&load_fixture_from(&dir, name));
}

#[test]
fn mixtral_small_matches_transformers() {
    check_against_oracle(&load_fixture("mixtral-s"));
}

#[test]
fn qwen2_moe_small_matches_transformers() {
    check_against_oracle(&load_fixture("qwen2moe-s"));
}

#[test]
fn olmoe_small_matches_transformers() {
    check_against_oracle(&load_fixture("olmoe-s"));
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn mixtral_matches_transformers() {
    check_shared("mixtral-a");
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn qwen2_moe_matches_transformers() {
    check_shared("qwen2moe-a");
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn olmoe_matches_transformers() {
    check_shared("olmoe-a");
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn glm4_moe_matches_transformers() {
    check_shared("glm4moe-a");
}

// The second wave's small twins (validation/oracle/make_oracle2.py), shipped in fixtures/oracle.

#[test]
fn deepseek_v3_small_matches_transformers() {
    // MLA with a q LoRA, interleaved rope, YaRN (mscale_all_dim 1), sigmoid group-limited routing
    check_against_oracle(&load_fixture("deepseekv3-s"));
}

#[test]
fn deepseek_v3_plain_small_matches_transformers() {
    // MLA without a q LoRA, rotate-half rope, default rope, no renormalisation, one group
    check_against_oracle(&load_fixture("deepseekv3-plain-s"));
}

#[test]
fn deepseek_v2_yarn_small_matches_transformers() {
    // V2: softmax group_limited_greedy routing, routed scaling 16, YaRN with mscale 0.707
    check_against_oracle(&load_fixture("deepseekv2-yarn-s"));
}

#[test]
fn qwen3_moe_yarn_small_matches_transformers() {
    // YaRN without mscale keys: the attention factor scales cos and sin
    check_against_oracle(&load_fixture("qwen3moe-yarn-s"));
}

#[test]
fn glm4_moe_small_matches_transformers() {
    check_against_oracle(&load_fixture("glm4moe-s"));
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn deepseek_v3_matches_transformers() {
    check_shared("deepseekv3-a");
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn deepseek_v2_matches_transformers() {
    check_shared("deepseekv2-a");
}
