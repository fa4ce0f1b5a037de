//! The A/B harness end to end on a fixture: the table's form and the bit-identity column. Says
//! nothing about timing (two identical arms may come out either way on a busy machine).

mod common;

use common::*;

fn ab(bundle: &std::path::Path, rt: &std::path::Path, b_args: &str) -> (i32, String, String) {
    run(
        AB,
        &[
            &bundle,
            &"--a-bin",
            &rt,
            &"--a-args",
            &"--threads 1",
            &"--b-args",
            &b_args,
            &"--workload",
            &"16:4",
            &"--workload",
            &"40:4",
            &"--pairs",
            &"3",
        ],
    )
}

#[test]
fn two_identical_arms_give_a_well_formed_table_with_identical_logits() {
    let rt = runtime();
    let c = convert("qwen3moe-a");
    let (code, out, err) = ab(&c.bundle, &rt, "--threads 1");
    println!("{out}");
    assert!(code == 0 || code == 1, "{out}\n{err}");
    assert!(
        err.contains("tarfa-ab: bar: ACCEPT only if"),
        "the bar is declared first: {err}"
    );
    assert!(out.starts_with("### A/B: `"), "{out}");
    assert!(
        out.contains("1 warm-up per arm, then 3 pairs alternating AB/BA")
            || out.contains("one warm-up per arm, then 3 pairs alternating AB/BA"),
        "{out}"
    );
    assert!(out.contains("from 20000 resamples"), "{out}");
    assert!(
        out.contains(
            "| workload | metric | A median (ms) | B median (ms) | paired change | 95% CI | |"
        ),
        "{out}"
    );
    for w in ["16+4", "40+4"] {
        let rows: Vec<&str> = out
            .lines()
            .filter(|l| l.starts_with(&format!("| {w} |")))
            .collect();
        assert_eq!(
            rows.len(),
            2,
            "a timing row and a memory row for {w}:\n{out}"
        );
        assert!(rows[0].starts_with(&format!("| {w} | request | ")), "{out}");
        assert!(
            rows[1].ends_with("| yes (8/8 runs) |"),
            "bit-identical column: {}",
            rows[1]
        );
        assert!(rows[1].contains(" MiB |"), "peak RSS sampled: {}", rows[1]);
        assert!(
            rows[1].contains("| n/a | n/a |") || rows[1].contains(" MiB | yes"),
            "{}",
            rows[1]
        );
    }
    for m in ["|  | prefill | ", "|  | decode | ", "|  | process | "] {
        assert_eq!(out.matches(m).count(), 2, "{m}: {out}");
    }
    // Three pairs are too few for any verdict but REJECT, whatever the timings.
    let verdict = out.lines().last().unwrap();
    assert_eq!(code, 1, "{verdict}");
    assert!(
        verdict.starts_with("**REJECT: 3 pairs cannot support a 95% interval"),
        "{verdict}"
    );
}

#[test]
fn logits_that_differ_between_arms_show_in_the_table_and_reject() {
    let rt = runtime();
    let c = convert("qwen3moe-a");
    let (code, out, err) = ab(&c.bundle, &rt, "--threads 1 --invalid-bf16-before-lm-head");
    println!("{out}");
    assert_eq!(code, 1, "{out}\n{err}");
    assert!(out.contains("| NO (2 distinct files in 8 runs) |"), "{out}");
    assert!(
        out.contains("16+4: logits are not bit-identical across the runs"),
        "{out}"
    );
}

#[test]
fn bad_usage_exits_2() {
    let rt = runtime();
    let c = convert("qwen3moe-a");
    // 4096 positions is the fixture's context
    let (code, _, err) = run(AB, &[&c.bundle, &"--a-bin", &rt, &"--workload", &"4090:64"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("the model allows 4096"), "{err}");
    let (code, _, _) = run(AB, &[&c.bundle, &"--a-bin", &rt, &"--workload", &"16"]);
    assert_eq!(code, 2);
    let (code, _, _) = run(AB, &[&c.bundle, &"--a-bin", &rt, &"--pairs", &"1"]);
    assert_eq!(code, 2);
}
