//! The hybrid linear-attention families against transformers' float32 runs of the shared
//! `qwen3next-a` (Qwen3-Next: fused `in_proj_qkvz` / `in_proj_ba`) and `qwen35moe-a` (Qwen3.5
//! MoE: separate projections) checkpoints: three gated DeltaNet layers and one gated
//! full-attention layer, zero-centred norms, partial rotary 0.25, a shared expert with a sigmoid
//! gate. Then the contract's invariances (prefill equals decode with the recurrent state carried
//! in the cache, threads, SIMD paths, batches), and the state's rewind and failure rules.
//!
//! `TARFA_EXTRA_ORACLES=/work/shared/oracle cargo test -p tarfa-run --test oracle_qwen3_next -- --ignored`

mod common;

use common::family_cli::invariances_are_bitwise;
use common::*;
use tarfa_run::cpu::{BatchEntry, ForwardOptions, LogitRows};
use tarfa_run::numerics::Kernel;

fn shared(name: &str) -> std::path::PathBuf {
    let root = std::env::var("TARFA_EXTRA_ORACLES")
        .expect("set TARFA_EXTRA_ORACLES to the directory holding the extra oracle fixtures");
    let dir = std::path::Path::new(&root).join(name);
    assert!(
        dir.join("reference.safetensors").is_file(),
        "{}: no reference.safetensors (TARFA_EXTRA_ORACLES={root})",
        dir.display()
    );
    dir
}

fn all_rows() -> ForwardOptions {
    ForwardOptions {
        logits: LogitRows::All,
        ..Default::default()
    }
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn qwen3_next_matches_transformers() {
    check_against_oracle(&load_fixture_from(&shared("qwen3next-a"), "qwen3next-a"));
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn qwen3_5_moe_matches_transformers() {
    check_against_oracle(&load_fixture_from(&shared("qwen35moe-a"), "qwen35moe-a"));
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn qwen3_next_invariances_are_bitwise() {
    invariances_are_bitwise(&load_fixture_from(&shared("qwen3next-a"), "qwen3next-a"));
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn qwen3_5_moe_invariances_are_bitwise() {
    invariances_are_bitwise(&load_fixture_from(&shared("qwen35moe-a"), "qwen35moe-a"));
}

/// The recurrent state lives in the cache: a rewind to the length the last step started at
/// restores the state it started from (the step re-run gives the same bits), as does a rewind
/// into that step (it keeps the step's start and says so); a rewind before it cannot be served
/// from a state that was never kept, so the cache empties and says so (re-feeding from 0 gives
/// the same bits); a failed batched step leaves every sequence's state as it was.
#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn the_linear_state_rewinds_and_fails_as_the_contract_says() {
    use tarfa_run::batch::Rewind;
    let f = load_fixture_from(&shared("qwen35moe-a"), "qwen35moe-a");
    let eng = engine(&f, 2, Kernel::best());
    let p = &f.prompts[2].prompt; // 33 tokens
    let (head, tail) = p.split_at(20);
    let mut cache = f.model.new_cache();
    let _ = eng.forward(&mut cache, head, &all_rows()).unwrap();
    let first = bits(&eng.forward(&mut cache, tail, &all_rows()).unwrap().logits);
    // back to the step's start: served, and the same step gives the same bits
    assert_eq!(cache.rewind_to(20), 20);
    let again = bits(&eng.forward(&mut cache, tail, &all_rows()).unwrap().logits);
    assert!(
        first == again,
        "the step re-run after a rewind to its start differs"
    );
    // to a length inside the last step: served from the step's start, the caller re-feeds
    assert_eq!(
        cache.rewind_to(25),
        20,
        "a rewind into the last step keeps its start"
    );
    let partial = bits(&eng.forward(&mut cache, tail, &all_rows()).unwrap().logits);
    assert!(first == partial, "re-fed from the step's start differs");
    // to a length before the last step: no state was kept there
    assert_eq!(
        cache.rewind_to(10),
        0,
        "a rewind past the kept state must empty the cache"
    );
    assert_eq!(cache.cached_len(), 0);
    let _ = eng.forward(&mut cache, head, &all_rows()).unwrap();
    let refed = bits(&eng.forward(&mut cache, tail, &all_rows()).unwrap().logits);
    assert!(
        first == refed,
        "re-fed from 0 after an emptying rewind differs"
    );

    // a batched step whose second sequence is refused leaves the first's state untouched
    let mut a = f.model.new_cache();
    let _ = eng.forward(&mut a, head, &all_rows()).unwrap();
    let state_before: Vec<_> = (0..4).map(|l| a.linear_state(l).cloned()).collect();
    assert!(state_before.iter().take(3).all(Option::is_some));
    assert!(state_before[3].is_none(), "layer 3 is full attention");
    let mut b = f.model.new_cache();
    let bad = [u32::MAX];
    let mut entries = vec![
        BatchEntry {
            cache: &mut a,
            tokens: tail,
            opts: all_rows(),
        },
        BatchEntry {
            cache: &mut b,
            tokens: &bad,
            opts: all_rows(),
        },
    ];
    assert!(eng.forward_batch(&mut entries).is_err());
    let state_after: Vec<_> = (0..4).map(|l| a.linear_state(l).cloned()).collect();
    assert!(state_before == state_after, "a failed step moved a state");
    let after_failure = bits(&eng.forward(&mut a, tail, &all_rows()).unwrap().logits);
    assert!(first == after_failure);
}
