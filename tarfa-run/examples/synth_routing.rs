//! How a synthetic model routes: per MoE layer, how many experts a prompt's tokens use and the
//! share of all selections taken by the most popular quarter of the experts. The synthetic
//! generator's skew is tuned with this (trained models: uneven popularity, but token-dependent
//! choices).
//!
//!     cargo run --release -p tarfa-run --example synth_routing -- [SKEW] [LAYERS] [EXPERTS]

use std::collections::HashMap;
use std::sync::Arc;

use tarfa_convert::synth::{self, OutputFormat, SynthOptions};
use tarfa_run::bundle::BundleSource;
use tarfa_run::config::MoeConfig;
use tarfa_run::cpu::{CpuEngine, CpuModel, EngineOptions, ForwardOptions, LogitRows};
use tarfa_run::weights::WeightSource;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let skew: f32 = args.get(1).map_or(1.0, |s| s.parse().unwrap());
    let layers: u32 = args.get(2).map_or(4, |s| s.parse().unwrap());
    let experts: u32 = args.get(3).map_or(64, |s| s.parse().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let mut shape = synth::shapes()
        .into_iter()
        .find(|s| s.name == "qwen3-30b-a3b")
        .unwrap();
    shape.layers = layers;
    shape.experts = experts;
    shape.vocab = 4096;
    let out = dir.path().join("b");
    let opts = SynthOptions {
        shape,
        seed: 1,
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
    let model =
        Arc::new(CpuModel::load(cfg.clone(), src.clone() as Arc<dyn WeightSource>).unwrap());
    let engine = CpuEngine::new(model.clone(), EngineOptions::default()).unwrap();
    let mut cache = model.new_cache();
    let mut z = 7u64;
    let prompt: Vec<u32> = (0..128)
        .map(|_| {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((z >> 33) % 4096) as u32
        })
        .collect();
    let o = engine
        .forward(
            &mut cache,
            &prompt,
            &ForwardOptions {
                logits: LogitRows::Last,
                trace_router: true,
                ..Default::default()
            },
        )
        .unwrap();
    let mut per_layer: HashMap<usize, HashMap<u32, usize>> = HashMap::new();
    let mut sets: HashMap<usize, Vec<Vec<u32>>> = HashMap::new();
    for r in &o.router {
        for &e in &r.experts {
            *per_layer.entry(r.layer).or_default().entry(e).or_default() += 1;
        }
        let mut s = r.experts.clone();
        s.sort();
        sets.entry(r.layer).or_default().push(s);
    }
    let mut layers: Vec<_> = per_layer.keys().copied().collect();
    layers.sort();
    for l in layers {
        let counts = &per_layer[&l];
        let mut c: Vec<usize> = counts.values().copied().collect();
        c.sort_by(|a, b| b.cmp(a));
        let total: usize = c.iter().sum();
        let quarter = (experts as usize).div_ceil(4);
        let top: usize = c.iter().take(quarter).sum();
        let distinct_sets = {
            let mut v = sets[&l].clone();
            v.sort();
            v.dedup();
            v.len()
        };
        println!(
            "layer {l}: {} of {experts} experts used, top 25% take {:.0}% of selections, {distinct_sets} distinct top-{} sets over {} tokens",
            counts.len(),
            100.0 * top as f64 / total as f64,
            cfg.top_k,
            prompt.len()
        );
    }
}
