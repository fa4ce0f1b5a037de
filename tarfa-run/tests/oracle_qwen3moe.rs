//! The CPU backend against transformers' float32 runs of the Qwen3-MoE fixtures: greedy tokens,
//! logits within 1e-4 of each row's scale, and router top-k sets.

mod common;

use common::*;

#[test]
fn qwen3moe_a_matches_transformers() {
    check_against_oracle(&load_fixture("qwen3moe-a"));
}

#[test]
fn qwen3moe_code_matches_transformers() {
    check_against_oracle(&load_fixture("qwen3moe-code"));
}

/// Any other fixture added to fixtures/oracle is checked too.
#[test]
fn every_other_repository_fixture_matches_transformers() {
    let root = fixture_dir("");
    let mut names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("reference.safetensors").is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "qwen3moe-a" && n != "qwen3moe-code")
        .collect();
    names.sort();
    for n in names {
        check_against_oracle(&load_fixture(&n));
    }
}
