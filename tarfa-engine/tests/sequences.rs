//! The many-sequence API ([`Model::step`]): a sequence's logits, router records and counters are
//! bit-identical whether it runs alone or shares its steps with 1 or 7 others, and whether its
//! prompt runs in one chunk, in several, or token by token; and the engine's CUDA arm, on
//! tarfa-cuda's mock device (the `mock-device` feature), gives the CPU's bits in every such step.

use std::path::Path;
use std::sync::Arc;

use tarfa_core::config::MoeConfig;
use tarfa_core::model::ArchSpec;
use tarfa_core::numerics::Kernel;
use tarfa_core::step::{ForwardOptions, ForwardOutput, LogitRows};
use tarfa_core::weights::{load_safetensors_dir, WeightSource};
use tarfa_engine::{BackendChoice, EngineError, LoadOptions, Model, SeqStep, Sequence};

fn model(threads: usize) -> Model {
    model_on(BackendChoice::Cpu, threads)
}

fn model_on(backend: BackendChoice, threads: usize) -> Model {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/oracle/qwen3moe-a");
    let cfg = MoeConfig::from_json_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
        .unwrap();
    let source: Arc<dyn WeightSource> =
        Arc::new(load_safetensors_dir(&dir, &cfg, &ArchSpec::new(&cfg)).unwrap());
    let opts = LoadOptions {
        backend,
        threads,
        kernel: Kernel::best(),
        hot: None,
        cuda: Default::default(),
    };
    Model::load(cfg, source, &opts, &|_| {}).unwrap()
}

fn all() -> ForwardOptions {
    ForwardOptions {
        logits: LogitRows::All,
        trace_router: true,
        ..Default::default()
    }
}

/// A deterministic prompt of `n` ids per sequence `i`, every one different.
fn prompt(i: usize, n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|t| ((i * 131 + t * 37 + 5) % vocab) as u32)
        .collect()
}

/// Everything a run of one sequence produced, as bits: every logit row, every router record
/// (positions are absolute, so chunking cannot hide a shift), and the experts fetched per token.
#[derive(Debug, PartialEq)]
struct Bits {
    logits: Vec<Vec<u32>>,
    router: Vec<String>,
}

fn collect(outs: &[ForwardOutput]) -> Bits {
    let mut router: Vec<_> = outs
        .iter()
        .flat_map(|o| o.router.iter().map(|r| format!("{r:?}")))
        .collect();
    // a chunked run orders records by (chunk, layer, position): compare them as a set
    router.sort();
    Bits {
        logits: outs
            .iter()
            .flat_map(|o| o.logits.iter())
            .map(|r| r.iter().map(|v| v.to_bits()).collect())
            .collect(),
        router,
    }
}

/// Runs sequence 0's prompt in chunks of `chunk` tokens, each step shared with `others` other
/// sequences (each with its own prompt, stepped in the same chunks), and returns sequence 0's
/// outputs.
fn run(model: &Model, chunk: usize, others: usize, len: usize) -> Bits {
    let vocab = model.config().vocab_size;
    let prompts: Vec<Vec<u32>> = (0..=others).map(|i| prompt(i, len, vocab)).collect();
    let mut seqs: Vec<Sequence> = (0..=others)
        .map(|_| model.new_sequence().unwrap())
        .collect();
    let mut mine = Vec::new();
    for start in (0..len).step_by(chunk) {
        let end = (start + chunk).min(len);
        let mut steps: Vec<SeqStep> = seqs
            .iter_mut()
            .zip(&prompts)
            .map(|(seq, p)| SeqStep {
                seq,
                tokens: &p[start..end],
                opts: all(),
            })
            .collect();
        let mut outs = model.step(&mut steps).unwrap();
        assert_eq!(outs.len(), others + 1);
        mine.push(outs.swap_remove(0));
    }
    assert!(seqs.iter().all(|s| s.len() == len));
    collect(&mine)
}

#[test]
fn a_sequences_bits_do_not_depend_on_its_step_companions_nor_its_chunks() {
    let m = model(2);
    let len = 9;
    let alone = run(&m, len, 0, len);
    assert_eq!(alone.logits.len(), len);
    assert!(!alone.router.is_empty());
    for others in [1, 7] {
        assert_eq!(
            run(&m, len, others, len),
            alone,
            "one chunk, {others} others"
        );
    }
    for chunk in [4, 1] {
        for others in [0, 1, 7] {
            assert_eq!(
                run(&m, chunk, others, len),
                alone,
                "chunks of {chunk}, {others} others"
            );
        }
    }
    // the thread count changes nothing either
    assert_eq!(run(&model(1), 3, 1, len), alone, "1 thread");
}

#[test]
fn the_cuda_arm_on_the_mock_device_gives_the_cpus_bits_in_any_step() {
    let cpu = run(&model(2), 5, 0, 5);
    let cuda = model_on(BackendChoice::CudaMock, 0);
    assert_eq!(cuda.name(), "cuda");
    assert_eq!(run(&cuda, 5, 0, 5), cpu, "alone, one chunk");
    assert_eq!(run(&cuda, 2, 2, 5), cpu, "chunks of 2, 2 others");
    assert_eq!(run(&cuda, 1, 1, 5), cpu, "token by token, 1 other");
}

#[test]
fn a_failed_step_advances_no_sequence_and_names_the_failing_one() {
    let m = model(2);
    let vocab = m.config().vocab_size as u32;
    let mut a = m.new_sequence().unwrap();
    let mut b = m.new_sequence().unwrap();
    let good = [1u32, 2, 3];
    let bad = [4u32, vocab];
    let mut steps = [
        SeqStep {
            seq: &mut a,
            tokens: &good,
            opts: all(),
        },
        SeqStep {
            seq: &mut b,
            tokens: &bad,
            opts: all(),
        },
    ];
    let err = m.step(&mut steps).unwrap_err();
    assert_eq!(err.index, Some(1));
    assert!(
        matches!(err.error, EngineError::Run(tarfa_core::RunError::TokenOutOfRange { token, .. }) if token == vocab),
        "{err}"
    );
    assert_eq!((a.len(), b.len()), (0, 0), "no sequence advanced");
    // and the rolled-back sequence runs on as if the failed step had never been
    let mut fresh = m.new_sequence().unwrap();
    let want = m.forward(&mut fresh, &good, &all()).unwrap();
    let got = m.forward(&mut a, &good, &all()).unwrap();
    assert_eq!(collect(&[got]), collect(&[want]));
}
