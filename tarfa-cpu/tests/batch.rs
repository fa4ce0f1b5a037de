//! The batched step's contract (docs/EXACTNESS.md, "Batching") on the small fixtures of every
//! family: a sequence's logits, router records and counters are bit-identical alone or among
//! 1, 7 or 32 others, with its prompt in one chunk, in several or token by token while the
//! others decode in the same steps, at 1 or 2 threads and on every SIMD path; and a step with a
//! refused sequence fails as a whole, leaving every cache as it was.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tarfa_core::config::MoeConfig;
use tarfa_core::model::ArchSpec;
use tarfa_core::numerics::Kernel;
use tarfa_core::weights::{
    load_safetensors_dir, ExpertWeights, HostTensor, WeightError, WeightSource,
};
use tarfa_core::RunError;
use tarfa_cpu::{
    BatchEntry, CpuEngine, CpuModel, EngineOptions, ForwardOptions, ForwardOutput, KvCache,
    LogitRows,
};

/// The four families (and Qwen3-MoE with dense layers between the MoE ones).
const FAMILIES: [&str; 5] = [
    "qwen3moe-a",
    "qwen3moe-dense",
    "qwen2moe-s",
    "mixtral-s",
    "olmoe-s",
];

fn model(name: &str, max_positions: Option<usize>) -> Arc<CpuModel> {
    let (cfg, source) = checkpoint(name, max_positions);
    Arc::new(CpuModel::load(cfg, source).unwrap())
}

fn checkpoint(name: &str, max_positions: Option<usize>) -> (MoeConfig, Arc<dyn WeightSource>) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/oracle")
        .join(name);
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let mut cfg = MoeConfig::from_json_str(&text).unwrap();
    if let Some(m) = max_positions {
        cfg.max_position_embeddings = m;
    }
    let spec = ArchSpec::new(&cfg);
    let source = Arc::new(load_safetensors_dir(&dir, &cfg, &spec).unwrap());
    (cfg, source)
}

/// A source as a memory budget makes it: one expert per group (the forward fetches and drops
/// them one by one); and, once armed, one whose experts of the last layer fail to load.
struct Budgeted {
    inner: Arc<dyn WeightSource>,
    fail_layer: usize,
    armed: AtomicBool,
}

impl WeightSource for Budgeted {
    fn tensor(&self, name: &str) -> Result<Arc<HostTensor>, WeightError> {
        self.inner.tensor(name)
    }
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }
    fn experts(&self, layer: usize, ids: &[usize]) -> Result<Vec<Arc<ExpertWeights>>, WeightError> {
        if layer == self.fail_layer && self.armed.load(Ordering::SeqCst) {
            return Err(WeightError::MissingTensor(format!("layer {layer} experts")));
        }
        self.inner.experts(layer, ids)
    }
    fn expert_batches(&self, _layer: usize, ids: &[usize]) -> Vec<Vec<usize>> {
        ids.iter().map(|&e| vec![e]).collect()
    }
}

fn engine(m: &Arc<CpuModel>, threads: usize, kernel: Kernel) -> CpuEngine {
    CpuEngine::new(m.clone(), EngineOptions { threads, kernel }).unwrap()
}

/// `n` token ids below `vocab`, different for each `seed`.
fn tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as u32
        })
        .collect()
}

fn opts() -> ForwardOptions {
    ForwardOptions {
        logits: LogitRows::All,
        trace_router: true,
        ..Default::default()
    }
}

/// Everything a step returns for one sequence, as exact text: logit bits, router records
/// (`{:?}` of an f32 round-trips, so equal text is equal bits), counters.
fn fingerprint(outs: &[ForwardOutput]) -> Vec<String> {
    outs.iter()
        .map(|o| {
            let bits: Vec<Vec<u32>> = o
                .logits
                .iter()
                .map(|r| r.iter().map(|v| v.to_bits()).collect())
                .collect();
            format!("{bits:?} {:?} {:?}", o.router, o.stats)
        })
        .collect()
}

/// The target sequence's steps: its prompt in `chunks`, then `decode` single tokens.
fn target_steps(vocab: usize, chunks: &[usize], decode: usize) -> Vec<Vec<u32>> {
    let total: usize = chunks.iter().sum();
    let all = tokens(1, total + decode, vocab);
    let mut steps = Vec::new();
    let mut at = 0;
    for &c in chunks {
        steps.push(all[at..at + c].to_vec());
        at += c;
    }
    steps.extend(all[total..].iter().map(|&t| vec![t]));
    steps
}

/// The target run alone, one `forward` per step.
fn alone(eng: &CpuEngine, steps: &[Vec<u32>]) -> Vec<ForwardOutput> {
    let mut cache = eng.model().new_cache();
    steps
        .iter()
        .map(|t| eng.forward(&mut cache, t, &opts()).unwrap())
        .collect()
}

/// `others` caches, each already holding a prompt of its own length (so every sequence of a
/// step sits at its own position).
fn neighbours(eng: &CpuEngine, others: usize, vocab: usize) -> Vec<KvCache> {
    (0..others)
        .map(|i| {
            let mut c = eng.model().new_cache();
            let p = tokens(100 + i as u64, 1 + i % 5, vocab);
            eng.forward(&mut c, &p, &opts()).unwrap();
            c
        })
        .collect()
}

/// The target's steps run in batched steps with `others` sequences (the target at `slot`
/// among them): each of the others decodes one token per step, or (every third) prefills
/// three. Returns the target's outputs.
fn among(
    eng: &CpuEngine,
    steps: &[Vec<u32>],
    others: usize,
    slot: usize,
    step_opts: ForwardOptions,
) -> Vec<ForwardOutput> {
    let vocab = eng.model().config().vocab_size;
    let mut target = eng.model().new_cache();
    let mut rest = neighbours(eng, others, vocab);
    let mut outs = Vec::new();
    for (s, t) in steps.iter().enumerate() {
        let theirs: Vec<Vec<u32>> = (0..others)
            .map(|i| tokens((1000 * s + i) as u64, if i % 3 == 2 { 3 } else { 1 }, vocab))
            .collect();
        let mut entries: Vec<BatchEntry<'_, KvCache>> = rest
            .iter_mut()
            .zip(&theirs)
            .enumerate()
            .map(|(i, (cache, tokens))| BatchEntry {
                cache,
                tokens,
                // the others ask for other rows and no records: the target's must not care
                opts: ForwardOptions {
                    logits: LogitRows::Last,
                    trace_router: i % 2 == 0,
                    ..Default::default()
                },
            })
            .collect();
        let at = slot.min(entries.len());
        entries.insert(
            at,
            BatchEntry {
                cache: &mut target,
                tokens: t,
                opts: step_opts,
            },
        );
        let mut got = eng.forward_batch(&mut entries).unwrap();
        assert_eq!(got.len(), others + 1);
        for (e, o) in entries.iter().zip(&got) {
            let want = match e.opts.logits {
                LogitRows::Last => 1,
                LogitRows::All => e.tokens.len(),
            };
            assert_eq!(o.logits.len(), want);
        }
        outs.push(got.swap_remove(at));
    }
    assert_eq!(target.len(), steps.iter().map(Vec::len).sum::<usize>());
    outs
}

#[test]
fn a_sequence_has_the_same_bits_alone_or_among_1_7_and_32_others() {
    for name in FAMILIES {
        let m = model(name, None);
        let eng = engine(&m, 2, Kernel::best());
        let steps = target_steps(m.config().vocab_size, &[6], 3);
        let want = fingerprint(&alone(&eng, &steps));
        for (others, slot) in [(1, 0), (1, 1), (7, 3), (32, 32)] {
            let got = fingerprint(&among(&eng, &steps, others, slot, opts()));
            assert!(
                got == want,
                "{name}: the target among {others} others (at {slot}) differs from alone"
            );
        }
    }
}

#[test]
fn a_prompt_in_one_chunk_in_several_or_token_by_token_gives_the_same_bits() {
    for name in FAMILIES {
        let m = model(name, None);
        let eng = engine(&m, 2, Kernel::best());
        let vocab = m.config().vocab_size;
        // logits and router records of every prompt position, then of two decode steps
        let flat = |outs: Vec<ForwardOutput>| -> Vec<String> {
            let mut merged = outs.into_iter().fold(ForwardOutput::default(), |mut a, o| {
                a.logits.extend(o.logits);
                a.router.extend(o.router);
                a
            });
            // a step lists its records by layer, then position: over several steps, by position
            merged.router.sort_by_key(|r| (r.position, r.layer));
            let mut f = fingerprint(&[merged]);
            // the counters are per step, and steps differ; compare the rows and records
            let cut = f[0].rfind(" StepStats").unwrap();
            f[0].truncate(cut);
            f
        };
        let whole = flat(alone(&eng, &target_steps(vocab, &[10], 2)));
        for chunks in [&[10][..], &[4, 3, 3], &[1; 10]] {
            let got = flat(among(&eng, &target_steps(vocab, chunks, 2), 3, 1, opts()));
            assert!(
                got == whole,
                "{name}: the prompt in chunks {chunks:?} beside decoding sequences differs"
            );
        }
    }
}

#[test]
fn threads_and_simd_paths_do_not_change_a_batched_sequence() {
    let kernels = Kernel::all_available();
    assert!(kernels.iter().any(|k| k.path() == Kernel::scalar().path()));
    for name in ["qwen3moe-a", "olmoe-s"] {
        let m = model(name, None);
        let steps = target_steps(m.config().vocab_size, &[5], 2);
        let want = fingerprint(&alone(&engine(&m, 1, Kernel::scalar()), &steps));
        for &kernel in &kernels {
            for threads in [1, 2] {
                let eng = engine(&m, threads, kernel);
                let got = fingerprint(&among(&eng, &steps, 7, 2, opts()));
                assert!(
                    got == want,
                    "{name}: {:?} at {threads} threads in a batch differs from scalar alone",
                    kernel.path()
                );
            }
        }
    }
}

#[test]
fn a_refused_sequence_fails_the_step_and_changes_no_cache() {
    let m = model("qwen2moe-s", Some(8));
    let eng = engine(&m, 2, Kernel::best());
    let vocab = m.config().vocab_size;
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| tokens(7 + i, 2 + i as usize, vocab))
        .collect();
    let fresh = || -> Vec<KvCache> {
        prompts
            .iter()
            .map(|p| {
                let mut c = m.new_cache();
                eng.forward(&mut c, p, &opts()).unwrap();
                c
            })
            .collect()
    };
    // what the next step gives on caches no failed step has touched
    let next: Vec<Vec<u32>> = (0..3).map(|i| tokens(50 + i, 1, vocab)).collect();
    let run = |caches: &mut [KvCache]| -> Vec<String> {
        let mut entries: Vec<BatchEntry<'_, KvCache>> = caches
            .iter_mut()
            .zip(&next)
            .map(|(cache, tokens)| BatchEntry {
                cache,
                tokens,
                opts: opts(),
            })
            .collect();
        fingerprint(&eng.forward_batch(&mut entries).unwrap())
    };
    let want = run(&mut fresh());

    let too_long = vec![1u32; 5]; // the third cache holds 4 of 8 positions
    let bad_token = vec![3, vocab as u32];
    let cases: [(&[u32], usize, &str); 4] = [
        (&bad_token, 1, "TokenOutOfRange"),
        (&[], 0, "EmptyStep"),
        (&too_long, 2, "ContextFull"),
        (&bad_token, 2, "TokenOutOfRange"),
    ];
    for (bad, at, what) in cases {
        let mut caches = fresh();
        let lens: Vec<usize> = caches.iter().map(KvCache::len).collect();
        let good = [vec![5u32, 6], vec![9], vec![2]];
        let mut entries: Vec<BatchEntry<'_, KvCache>> = caches
            .iter_mut()
            .zip(&good)
            .enumerate()
            .map(|(i, (cache, g))| BatchEntry {
                cache,
                tokens: if i == at { bad } else { g },
                opts: opts(),
            })
            .collect();
        let err = eng.forward_batch(&mut entries).unwrap_err();
        assert_eq!(err.sequence, Some(at), "{what}");
        let kind = match err.error {
            RunError::TokenOutOfRange { .. } => "TokenOutOfRange",
            RunError::EmptyStep => "EmptyStep",
            RunError::ContextFull { needed: 9, max: 8 } => "ContextFull",
            ref other => panic!("{what}: unexpected {other}"),
        };
        assert_eq!(kind, what);
        assert_eq!(caches.iter().map(KvCache::len).collect::<Vec<_>>(), lens);
        assert!(
            run(&mut caches) == want,
            "{what}: a cache changed in the failed step"
        );
    }
}

#[test]
fn experts_fetched_one_by_one_give_the_same_bits_and_a_failed_fetch_rewinds_every_cache() {
    let name = "mixtral-s";
    let (cfg, inner) = checkpoint(name, None);
    let fail_layer = cfg.num_layers - 1;
    let budgeted = Arc::new(Budgeted {
        inner: inner.clone(),
        fail_layer,
        armed: AtomicBool::new(false),
    });
    let resident = engine(
        &Arc::new(CpuModel::load(cfg.clone(), inner).unwrap()),
        2,
        Kernel::best(),
    );
    let grouped = engine(
        &Arc::new(CpuModel::load(cfg, budgeted.clone()).unwrap()),
        2,
        Kernel::best(),
    );
    let steps = target_steps(grouped.model().config().vocab_size, &[4], 2);
    let want = fingerprint(&alone(&resident, &steps));
    let got = fingerprint(&among(&grouped, &steps, 7, 4, opts()));
    assert!(
        got == want,
        "{name}: experts in groups of one, batched, differ"
    );

    // a weight failing in the last layer, after every cache has had keys pushed: the step
    // fails as a whole (no sequence at fault) and every cache is as before
    let vocab = grouped.model().config().vocab_size;
    let mut caches = neighbours(&grouped, 3, vocab);
    let lens: Vec<usize> = caches.iter().map(KvCache::len).collect();
    let toks: Vec<Vec<u32>> = (0..3).map(|i| tokens(70 + i, 2, vocab)).collect();
    let step = |eng: &CpuEngine, caches: &mut [KvCache]| {
        let mut entries: Vec<BatchEntry<'_, KvCache>> = caches
            .iter_mut()
            .zip(&toks)
            .map(|(cache, tokens)| BatchEntry {
                cache,
                tokens,
                opts: opts(),
            })
            .collect();
        eng.forward_batch(&mut entries).map(|o| fingerprint(&o))
    };
    budgeted.armed.store(true, Ordering::SeqCst);
    let err = step(&grouped, &mut caches).unwrap_err();
    assert_eq!(err.sequence, None);
    assert!(
        matches!(err.error, RunError::Weights(WeightError::MissingTensor(_))),
        "{}",
        err.error
    );
    assert_eq!(caches.iter().map(KvCache::len).collect::<Vec<_>>(), lens);
    budgeted.armed.store(false, Ordering::SeqCst);
    let after = step(&grouped, &mut caches).unwrap();
    let untouched = step(&grouped, &mut neighbours(&grouped, 3, vocab)).unwrap();
    assert!(after == untouched, "a cache changed in the failed step");
}

/// A hook that stops the step at its poll number `at` (Ctrl-C from Python), or forces
/// `force` at every MoE layer.
struct Stopper {
    at: usize,
    layers_seen: usize,
    force: Option<Vec<usize>>,
}

impl tarfa_cpu::StepHook for Stopper {
    fn interrupted(&mut self) -> bool {
        self.layers_seen += 1;
        self.layers_seen > self.at
    }
    fn forced_experts(&mut self, _layer: usize, _token: usize) -> Option<Vec<usize>> {
        self.force.clone()
    }
}

#[test]
fn an_interrupted_or_refused_hooked_step_changes_no_cache() {
    let m = model("olmoe-s", None);
    let eng = engine(&m, 2, Kernel::best());
    let vocab = m.config().vocab_size;
    let layers = m.config().num_layers;
    let prompt = tokens(3, 4, vocab);
    let next = tokens(4, 2, vocab);
    let mut cache = m.new_cache();
    eng.forward(&mut cache, &prompt, &opts()).unwrap();
    let step = |cache: &mut KvCache, hook: Option<&mut dyn tarfa_cpu::StepHook>| {
        let mut entries = [BatchEntry {
            cache,
            tokens: &next,
            opts: opts(),
        }];
        eng.forward_batch_observed(&mut entries, hook)
    };
    let want = fingerprint(&step(&mut cache.clone(), None).unwrap());
    // stopped at each poll: before each layer's attention and its MLP block, and before the
    // final norm
    for at in 0..2 * layers + 1 {
        let mut c = cache.clone();
        let mut hook = Stopper {
            at,
            layers_seen: 0,
            force: None,
        };
        let err = step(&mut c, Some(&mut hook)).unwrap_err();
        assert!(
            matches!(err.error, RunError::Interrupted),
            "at {at}: {}",
            err.error
        );
        assert_eq!(
            hook.layers_seen,
            at + 1,
            "stopped at the first poll that said so"
        );
        assert_eq!(c.len(), prompt.len(), "at {at}: no position committed");
        assert!(fingerprint(&step(&mut c, None).unwrap()) == want, "at {at}");
    }
    // a hook that never stops and forces nothing is the same bits
    let mut idle = Stopper {
        at: usize::MAX,
        layers_seen: 0,
        force: None,
    };
    assert!(fingerprint(&step(&mut cache.clone(), Some(&mut idle)).unwrap()) == want);
    // a forced set of the wrong size (OLMoE selects 4) is refused by name
    for (bad, why) in [
        (vec![0, 1], "2 experts forced, the router selects 4"),
        (vec![0, 1, 2, 2], "repeat an expert"),
        (vec![0, 1, 2, 99], "expert 99 is not an expert"),
    ] {
        let mut c = cache.clone();
        let mut hook = Stopper {
            at: usize::MAX,
            layers_seen: 0,
            force: Some(bad),
        };
        let err = step(&mut c, Some(&mut hook)).unwrap_err();
        assert!(
            matches!(&err.error, RunError::Intervention(s) if s.contains(why)),
            "{}",
            err.error
        );
        assert_eq!(c.len(), prompt.len());
    }
}
