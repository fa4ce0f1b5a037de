//! CPU decode tok/s for B sequences: B `forward` calls per step (the loop) against one
//! `forward_batch` per step (weights read once for all B), and whether the two gave the same
//! bits (they must).
//!
//! ```text
//! cargo run --release -p tarfa-cpu --example batch_decode -- [CHECKPOINT_DIR] [STEPS] [THREADS] [SIZES]
//! ```
//!
//! CHECKPOINT_DIR defaults to the demo model, fixtures/oracle/qwen3moe-code; STEPS to 32;
//! THREADS to 0 (one per core); SIZES to 1,8,32 (a comma list of B). Each sequence is prefilled with its own 8-token prompt, then
//! decodes greedily; only the decode steps are timed.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use tarfa_core::config::MoeConfig;
use tarfa_core::generate::argmax;
use tarfa_core::model::ArchSpec;
use tarfa_core::numerics::Kernel;
use tarfa_core::weights::load_safetensors_dir;
use tarfa_cpu::{
    BatchEntry, CpuEngine, CpuModel, EngineOptions, ForwardOptions, KvCache, LogitRows,
};

/// Per sequence, the logit bits of every decode step; and the decode seconds.
type Run = (Vec<Vec<Vec<u32>>>, f64);

fn prefill(eng: &CpuEngine, b: usize, vocab: usize) -> (Vec<KvCache>, Vec<u32>) {
    let opts = ForwardOptions {
        logits: LogitRows::Last,
        ..Default::default()
    };
    (0..b)
        .map(|i| {
            let prompt: Vec<u32> = (0..8)
                .map(|j| ((i * 131 + j * 17 + 1) % vocab) as u32)
                .collect();
            let mut c = eng.model().new_cache();
            let out = eng.forward(&mut c, &prompt, &opts).unwrap();
            (c, argmax(&out.logits[0]))
        })
        .unzip()
}

fn decode(eng: &CpuEngine, b: usize, steps: usize, batched: bool) -> Run {
    let vocab = eng.model().config().vocab_size;
    let (mut caches, mut next) = prefill(eng, b, vocab);
    let opts = ForwardOptions {
        logits: LogitRows::Last,
        ..Default::default()
    };
    let mut bits: Vec<Vec<Vec<u32>>> = vec![Vec::new(); b];
    let start = Instant::now();
    for _ in 0..steps {
        let outs = if batched {
            let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
            let mut entries: Vec<BatchEntry<'_, KvCache>> = caches
                .iter_mut()
                .zip(&toks)
                .map(|(cache, t)| BatchEntry {
                    cache,
                    tokens: t,
                    opts,
                })
                .collect();
            eng.forward_batch(&mut entries).unwrap()
        } else {
            caches
                .iter_mut()
                .zip(&next)
                .map(|(c, &t)| eng.forward(c, &[t], &opts).unwrap())
                .collect()
        };
        for (i, o) in outs.iter().enumerate() {
            next[i] = argmax(&o.logits[0]);
            bits[i].push(o.logits[0].iter().map(|v| v.to_bits()).collect());
        }
    }
    (bits, start.elapsed().as_secs_f64())
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = args.first().map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/oracle/qwen3moe-code")
    });
    let steps: usize = args.get(1).map_or(32, |s| s.parse().expect("STEPS"));
    let threads: usize = args.get(2).map_or(0, |s| s.parse().expect("THREADS"));
    let sizes: Vec<usize> = args.get(3).map_or(vec![1, 8, 32], |s| {
        s.split(',').map(|b| b.parse().expect("SIZES")).collect()
    });
    let text = std::fs::read_to_string(dir.join("config.json")).expect("config.json");
    let cfg = MoeConfig::from_json_str(&text).expect("config");
    let spec = ArchSpec::new(&cfg);
    let source = Arc::new(load_safetensors_dir(&dir, &cfg, &spec).expect("weights"));
    let model = Arc::new(CpuModel::load(cfg, source).expect("model"));
    let eng = CpuEngine::new(
        model,
        EngineOptions {
            threads,
            kernel: Kernel::best(),
        },
    )
    .expect("engine");
    println!(
        "{} | {} threads, {:?} | {steps} decode steps after an 8-token prompt",
        dir.display(),
        eng.threads(),
        eng.kernel().path()
    );
    println!("| B | loop tok/s | batched tok/s | batched / loop | same bits |");
    println!("| --- | --- | --- | --- | --- |");
    for b in sizes {
        let _warm = decode(&eng, b, 2, true);
        let (loop_bits, loop_s) = decode(&eng, b, steps, false);
        let (batch_bits, batch_s) = decode(&eng, b, steps, true);
        let toks = (b * steps) as f64;
        println!(
            "| {b} | {:.0} | {:.0} | {:.2} | {} |",
            toks / loop_s,
            toks / batch_s,
            loop_s / batch_s,
            loop_bits == batch_bits
        );
    }
}
