//! GLM-4.5 MoE (`glm4moe-a` of the shared oracle: partial rotary 0.5, q/k/v bias, qk norm,
//! sigmoid routing with a non-zero e_score_correction_bias, routed scaling 1.8, a shared
//! expert, the first layer dense) through the real converter and the real `tarfa-run` binary,
//! against transformers' float32 run; and the contract's invariances on it (threads, SIMD path,
//! prefill == decode, a batched step), bit for bit (common/family_cli.rs).
//!
//! The fixture lives in the shared oracle: these run when TARFA_EXTRA_ORACLES names it (`.ci/run`
//! sets it to ../shared/oracle and runs them), and are ignored with that reason otherwise:
//! `TARFA_EXTRA_ORACLES=../shared/oracle cargo test -p tarfa-run --test oracle_glm4_moe -- --ignored`
//! Its small twin `glm4moe-s` ships in fixtures/oracle and runs in every clone.

mod common;

use std::path::{Path, PathBuf};

use common::family_cli::{cli_matches_oracle, invariances_are_bitwise};
use common::*;

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

/// The manifest: experts named by their source prefix; the shared experts and the router (with
/// its correction bias) in the non-expert region, listed before the first expert.
const NON_EXPERT: &[&str] = &[
    "model.layers.1.mlp.gate.weight",
    "model.layers.1.mlp.gate.e_score_correction_bias",
    "model.layers.1.mlp.shared_experts.gate_proj.weight",
    "model.layers.1.mlp.shared_experts.down_proj.weight",
];

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn glm4_moe_through_the_converter_and_the_cli_matches_transformers() {
    cli_matches_oracle(
        &shared_dir(),
        NAME,
        NON_EXPERT,
        "model.layers.1.mlp.experts.0",
    );
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn glm4_moe_invariances_are_bitwise() {
    invariances_are_bitwise(&load_fixture_from(&shared_dir(), NAME));
}

#[test]
fn glm4_moe_small_through_the_converter_and_the_cli_matches_transformers() {
    cli_matches_oracle(
        &fixture_dir("glm4moe-s"),
        "glm4moe-s",
        NON_EXPERT,
        "model.layers.1.mlp.experts.0",
    );
}

#[test]
fn glm4_moe_small_invariances_are_bitwise() {
    invariances_are_bitwise(&load_fixture("glm4moe-s"));
}
