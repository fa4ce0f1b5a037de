//! A windowed or chunked layer's KV cache holds only the rows its queries read (kv_cache.rs),
//! and that changes no bit: token by token (rows dropped as the steps commit) gives every logit
//! of one prefill step over the same tokens (which drops nothing until it ends), on Mixtral's
//! sliding window (mixtral-window-s, w = 8) and Llama 4's chunks (llama4-dense-s, C = 8). A
//! rewind the cache can serve keeps its bits; one to a position whose queries need dropped rows
//! empties the cache and says so, and re-feeding from 0 gives the same bits again.

use std::path::PathBuf;
use std::sync::Arc;

use tarfa_core::config::MoeConfig;
use tarfa_core::model::ArchSpec;
use tarfa_core::numerics::Kernel;
use tarfa_core::weights::load_safetensors_dir;
use tarfa_cpu::kv_cache::REWIND_SLACK;
use tarfa_cpu::{CpuEngine, CpuModel, EngineOptions, ForwardOptions, LogitRows};

fn engine(name: &str) -> CpuEngine {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/oracle")
        .join(name);
    let cfg = MoeConfig::from_json_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
        .unwrap();
    let spec = ArchSpec::new(&cfg);
    let source = Arc::new(load_safetensors_dir(&dir, &cfg, &spec).unwrap());
    let model = Arc::new(CpuModel::load(cfg, source).unwrap());
    CpuEngine::new(
        model,
        EngineOptions {
            threads: 1,
            kernel: Kernel::best(),
        },
    )
    .unwrap()
}

fn bits(rows: &[Vec<f32>]) -> Vec<Vec<u32>> {
    rows.iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

#[test]
fn windowed_and_chunked_caches_drop_rows_and_keep_every_bit() {
    for (name, span) in [("mixtral-window-s", 8usize), ("llama4-dense-s", 8)] {
        let eng = engine(name);
        let cfg = eng.model().config().clone();
        let n = 200usize;
        let tokens: Vec<u32> = (0..n)
            .map(|i| ((i * 37 + 11) % cfg.vocab_size) as u32)
            .collect();
        let all = ForwardOptions {
            logits: LogitRows::All,
            ..ForwardOptions::default()
        };
        let mut whole = eng.model().new_cache();
        let reference = eng.forward(&mut whole, &tokens, &all).unwrap().logits;
        assert_eq!(reference.len(), n);

        let mut cache = eng.model().new_cache();
        let mut rows = Vec::new();
        for &t in &tokens {
            let out = eng
                .forward(&mut cache, &[t], &ForwardOptions::default())
                .unwrap();
            rows.extend(out.logits);
        }
        assert!(
            bits(&rows) == bits(&reference),
            "{name}: token by token = one prefill"
        );

        // the limited layers hold a bounded window; the others everything
        let limited: Vec<usize> = (0..cfg.num_layers)
            .filter(|&l| cfg.layer_windows[l].is_some() || cfg.layer_chunks[l].is_some())
            .collect();
        assert!(!limited.is_empty(), "{name}");
        for l in 0..cfg.num_layers {
            let held = cache.held(l);
            assert_eq!(held.end, n);
            if limited.contains(&l) {
                assert!(held.start > 0, "{name} layer {l}: rows were dropped");
                // the span, the slack, a batch of at least 16 and the step
                assert!(
                    held.len() <= span + REWIND_SLACK + 16.max(span) + 1,
                    "{name} layer {l}: holds {held:?}"
                );
            } else {
                assert_eq!(held.start, 0, "{name} layer {l}");
            }
        }

        // a rewind the cache serves: the next step's bits are the reference's
        let back = n - 10;
        assert_eq!(cache.truncate(back), back, "{name}");
        let out = eng
            .forward(
                &mut cache,
                &tokens[back..back + 1],
                &ForwardOptions::default(),
            )
            .unwrap();
        assert!(
            bits(&out.logits) == bits(&reference[back..back + 1]),
            "{name}: after a rewind"
        );

        // one it cannot serve empties the cache; re-feeding from 0 gives the bits again
        assert_eq!(
            cache.truncate(5),
            0,
            "{name}: rows position 5 reads were dropped"
        );
        assert_eq!(cache.len(), 0);
        let again = eng.forward(&mut cache, &tokens, &all).unwrap().logits;
        assert!(bits(&again) == bits(&reference), "{name}: re-fed from 0");
    }
}
