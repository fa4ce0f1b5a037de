//! Issue 22's config features against transformers: Mixtral's `sliding_window` and OLMoE's
//! `clip_qkv`; Llama 4's `llama4-dense-s` (dense layers, top-2, active temperature tuning) and
//! `llama4-llama3-s` (llama3 rope scaling). The fixtures were made by
//! validation/oracle/make_oracle.py on the GPU machine
//! (`python3 make_oracle.py OUT llama4-dense-s llama4-llama3-s mixtral-window-s olmoe-clip-s`,
//! transformers 5.17, float32) and copied into fixtures/oracle. tests/oracle_gpt_oss.rs and
//! tests/oracle_llama4.rs also check the features against what can be derived by hand.

mod common;

use common::*;

#[test]
fn mixtral_sliding_window_matches_transformers() {
    check_against_oracle(&load_fixture("mixtral-window-s"));
}

#[test]
fn olmoe_clip_qkv_matches_transformers() {
    check_against_oracle(&load_fixture("olmoe-clip-s"));
}

#[test]
fn llama4_dense_layers_top2_and_temperature_match_transformers() {
    check_against_oracle(&load_fixture("llama4-dense-s"));
}

#[test]
fn llama4_llama3_rope_scaling_matches_transformers() {
    check_against_oracle(&load_fixture("llama4-llama3-s"));
}
