//! gpt-oss against transformers' float32 runs: the fused BF16 checkpoint (`gptoss-a`) and the
//! released form, MXFP4 experts (`gptoss-mxfp4-a`), whose logits must be its exact BF16 twin's
//! (`gptoss-mxfp4-a-bf16`) bit for bit, which proves the widening exact.
//!
//! The small twins `gptoss-s`, `gptoss-mxfp4-s` and `gptoss-mxfp4-s-bf16` ship in fixtures/oracle
//! when present; the shared ones run when TARFA_EXTRA_ORACLES names ../shared/oracle:
//! `TARFA_EXTRA_ORACLES=/work/shared/oracle cargo test -p tarfa-run --test oracle_gpt_oss -- --ignored`

mod common;

use common::*;
use tarfa_run::cpu::{ForwardOptions, LogitRows};
use tarfa_run::generate::greedy;
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

/// Every prompt's prefill logits (all positions) and greedy step logits, as bits.
fn all_logit_bits(f: &Fixture) -> Vec<Vec<Vec<u32>>> {
    let eng = engine(f, 2, Kernel::best());
    let opts = ForwardOptions {
        logits: LogitRows::All,
        ..Default::default()
    };
    f.prompts
        .iter()
        .map(|r| {
            let mut cache = f.model.new_cache();
            let g = greedy(&eng, &mut cache, &r.prompt, r.greedy.len(), &opts).unwrap();
            let mut rows = bits(&g.prefill.logits);
            rows.extend(bits(&g.step_logits));
            rows
        })
        .collect()
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn gpt_oss_bf16_matches_transformers() {
    check_against_oracle(&load_fixture_from(&shared("gptoss-a"), "gptoss-a"));
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn gpt_oss_mxfp4_twin_matches_transformers() {
    check_against_oracle(&load_fixture_from(
        &shared("gptoss-mxfp4-a-bf16"),
        "gptoss-mxfp4-a-bf16",
    ));
}

#[test]
#[ignore = "needs TARFA_EXTRA_ORACLES (the shared oracle; .ci/run sets it and runs these)"]
fn gpt_oss_mxfp4_gives_its_bf16_twins_logits_bit_for_bit() {
    let mx = load_fixture_from(&shared("gptoss-mxfp4-a"), "gptoss-mxfp4-a");
    check_against_oracle(&mx);
    let twin = load_fixture_from(&shared("gptoss-mxfp4-a-bf16"), "gptoss-mxfp4-a-bf16");
    assert_eq!(
        all_logit_bits(&mx),
        all_logit_bits(&twin),
        "the MXFP4 experts widened are the twin's BF16 experts"
    );
}
