//! The synthetic generator's routers behave like trained ones where expert streaming cares:
//! token-dependent choices, and with `--skew` an uneven expert popularity. Measured through the
//! runtime's own router trace on a small model of the generator's `tiny` shape.

use std::collections::HashMap;
use std::sync::Arc;

use tarfa_convert::synth::{self, OutputFormat, SynthOptions};
use tarfa_run::bundle::BundleSource;
use tarfa_run::config::MoeConfig;
use tarfa_run::cpu::{CpuEngine, CpuModel, EngineOptions, ForwardOptions, LogitRows};
use tarfa_run::weights::WeightSource;

/// (mean share of selections taken by the most popular quarter of experts, mean number of
/// distinct top-k sets per layer) over a 128-token prompt.
fn routing(skew: f32) -> (f64, f64) {
    let dir = tempfile::tempdir().unwrap();
    let mut shape = synth::shapes()
        .into_iter()
        .find(|s| s.name == "tiny")
        .unwrap();
    shape.layers = 4;
    shape.experts = 32;
    shape.top_k = 4;
    let out = dir.path().join("b");
    let opts = SynthOptions {
        shape,
        seed: 3,
        skew,
        format: OutputFormat::Bundle,
        shard_bytes: 1 << 30,
        force: false,
    };
    synth::synth(&out, &opts).unwrap();
    let src = Arc::new(BundleSource::open(&out, None).unwrap());
    let cfg = MoeConfig::from_json_str(
        &String::from_utf8(src.read_file("config.json").unwrap()).unwrap(),
    )
    .unwrap();
    let model = Arc::new(CpuModel::load(cfg.clone(), src as Arc<dyn WeightSource>).unwrap());
    let engine = CpuEngine::new(model.clone(), EngineOptions::default()).unwrap();
    let mut cache = model.new_cache();
    let prompt: Vec<u32> = (0..128u32)
        .map(|i| (i * 97 + 13) % cfg.vocab_size as u32)
        .collect();
    let opts = ForwardOptions {
        logits: LogitRows::Last,
        trace_router: true,
        ..Default::default()
    };
    let o = engine.forward(&mut cache, &prompt, &opts).unwrap();
    let mut counts: HashMap<usize, HashMap<u32, usize>> = HashMap::new();
    let mut sets: HashMap<usize, Vec<Vec<u32>>> = HashMap::new();
    for r in &o.router {
        for &e in &r.experts {
            *counts.entry(r.layer).or_default().entry(e).or_default() += 1;
        }
        let mut s = r.experts.clone();
        s.sort();
        sets.entry(r.layer).or_default().push(s);
    }
    let mut share = 0.0;
    let mut distinct = 0.0;
    for (l, c) in &counts {
        let mut v: Vec<usize> = c.values().copied().collect();
        v.sort_by(|a, b| b.cmp(a));
        let total: usize = v.iter().sum();
        share += v.iter().take(cfg.num_experts / 4).sum::<usize>() as f64 / total as f64;
        let mut s = sets[l].clone();
        s.sort();
        s.dedup();
        distinct += s.len() as f64;
    }
    let n = counts.len() as f64;
    (share / n, distinct / n)
}

#[test]
fn synthetic_routing_is_token_dependent_and_skew_makes_it_uneven() {
    let (flat_share, flat_sets) = routing(0.0);
    let (skew_share, skew_sets) = routing(1.0);
    eprintln!("skew 0: top-quarter share {flat_share:.2}, {flat_sets:.0} distinct sets; skew 1: {skew_share:.2}, {skew_sets:.0}");
    // 128 tokens choose top-4 of 32: without skew the popular quarter takes little more than its
    // quarter, and almost every token's set is its own.
    assert!(flat_share < 0.45, "{flat_share}");
    assert!(flat_sets > 96.0, "{flat_sets}");
    // Skew: clearly uneven popularity, yet still token-dependent choices.
    assert!(
        skew_share > flat_share + 0.1,
        "{skew_share} vs {flat_share}"
    );
    assert!(skew_sets > 48.0, "{skew_sets}");
}
