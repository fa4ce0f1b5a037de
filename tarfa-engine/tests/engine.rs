//! The engine against the CPU backend's own greedy loop on a fixture, bit for bit: the same
//! tokens (transformers' greedy tokens), the same prefill and step logits, the same router
//! records, on every path of the one decode loop (logits kept, tokens only) and every backend
//! choice this machine offers.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use safetensors::SafeTensors;
use tarfa_core::config::MoeConfig;
use tarfa_core::generate::{self, greedy, Greedy, Keep, Observer, Step};
use tarfa_core::model::ArchSpec;
use tarfa_core::numerics::Kernel;
use tarfa_core::step::{ForwardOptions, LogitRows, RouterRecord, StepStats};
use tarfa_core::weights::{load_safetensors_dir, WeightSource};
use tarfa_cpu::{CpuEngine, CpuModel, EngineOptions};
use tarfa_engine::{BackendChoice, Engine, EngineError, LoadOptions};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/oracle")
        .join(name)
}

/// transformers' (prompt, greedy tokens) pairs.
type References = Vec<(Vec<u32>, Vec<u32>)>;

/// The fixture's config, its weights, and transformers' greedy runs on it.
fn load(name: &str) -> (MoeConfig, Arc<dyn WeightSource>, References) {
    let dir = fixture(name);
    let cfg = MoeConfig::from_json_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
        .unwrap();
    let source = Arc::new(load_safetensors_dir(&dir, &cfg, &ArchSpec::new(&cfg)).unwrap());
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let ids = |n: &str| -> Vec<u32> {
        st.tensor(n)
            .unwrap()
            .data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect()
    };
    let refs = (0..)
        .take_while(|i| st.tensor(&format!("prompt.{i}")).is_ok())
        .map(|i| (ids(&format!("prompt.{i}")), ids(&format!("greedy.{i}"))))
        .collect::<Vec<_>>();
    assert!(refs.len() >= 2);
    (cfg, source, refs)
}

fn bits(rows: &[Vec<f32>]) -> Vec<Vec<u32>> {
    rows.iter()
        .map(|r| r.iter().map(|v| v.to_bits()).collect())
        .collect()
}

/// Keeps the decode steps' router records, as `greedy` does.
#[derive(Default)]
struct Records(Vec<RouterRecord>);

impl Observer<Engine> for Records {
    type Error = EngineError;
    fn after_step(
        &mut self,
        _e: &Engine,
        step: Step,
        _n: usize,
        _s: &StepStats,
        router: &mut Vec<RouterRecord>,
    ) -> Result<(), EngineError> {
        if step == Step::Decode {
            self.0.append(router);
        }
        Ok(())
    }
}

/// Stops the run at the first `.0`.
struct StopAt(u32);

impl Observer<Engine> for StopAt {
    type Error = EngineError;
    fn token(&mut self, _j: usize, t: u32) -> Result<generate::Flow, EngineError> {
        Ok(if t == self.0 {
            generate::Flow::Stop
        } else {
            generate::Flow::Continue
        })
    }
}

fn engine_on(
    backend: BackendChoice,
    cfg: &MoeConfig,
    source: &Arc<dyn WeightSource>,
) -> Result<Engine, EngineError> {
    let opts = LoadOptions {
        backend,
        threads: 2,
        kernel: Kernel::best(),
        hot: None,
        cuda: Default::default(),
    };
    Engine::load(cfg.clone(), source.clone(), &opts, &|_| {})
}

fn assert_same(got: &Greedy, want: &Greedy, what: &str) {
    assert_eq!(got.tokens, want.tokens, "{what}: tokens");
    assert_eq!(
        bits(&got.prefill.logits),
        bits(&want.prefill.logits),
        "{what}: prefill logits"
    );
    assert_eq!(
        bits(&got.step_logits),
        bits(&want.step_logits),
        "{what}: step logits"
    );
    assert_eq!(
        got.prefill.router, want.prefill.router,
        "{what}: prefill router"
    );
    assert_eq!(
        got.decode_router, want.decode_router,
        "{what}: decode router"
    );
    assert_eq!(
        got.prefill.stats, want.prefill.stats,
        "{what}: prefill stats"
    );
    assert_eq!(
        got.decode_weight_bytes, want.decode_weight_bytes,
        "{what}: decode bytes"
    );
}

#[test]
fn the_engine_gives_the_cpu_greedy_loops_bits() {
    let (cfg, source, refs) = load("qwen3moe-a");
    let cpu = CpuEngine::new(
        Arc::new(CpuModel::load(cfg.clone(), source.clone()).unwrap()),
        EngineOptions {
            threads: 2,
            kernel: Kernel::best(),
        },
    )
    .unwrap();
    let opts = ForwardOptions {
        logits: LogitRows::All,
        trace_router: true,
        ..Default::default()
    };
    // Whatever `auto` picks here (the CPU without a GPU), the bits are the CPU's.
    // The CUDA arm runs on tarfa-cuda's mock device too (its decode kernels' orchestration,
    // with run-ahead on the tokens-only path).
    let mut choices = vec![
        BackendChoice::Cpu,
        BackendChoice::Auto,
        BackendChoice::CudaMock,
    ];
    match engine_on(BackendChoice::Cuda, &cfg, &source) {
        Ok(_) => choices.push(BackendChoice::Cuda),
        // No GPU (or a build without CUDA) is the environment's failure, not the runtime's.
        Err(e) => assert!(matches!(e, EngineError::Cuda(_)), "{e}"),
    }
    for (i, (prompt, want_tokens)) in refs.iter().enumerate() {
        let n = want_tokens.len();
        let mut cache = cpu.model().new_cache();
        let want = greedy(&cpu, &mut cache, prompt, n, &opts).unwrap();
        assert_eq!(
            &want.tokens, want_tokens,
            "prompt {i}: the CPU gives transformers' tokens"
        );
        assert_eq!(want.step_logits.len(), n);
        assert!(!want.decode_router.is_empty());
        for &choice in &choices {
            let what = format!("prompt {i} on {choice:?}");
            let mut engine = engine_on(choice, &cfg, &source).unwrap();
            let mut records = Records::default();
            let mut got =
                generate::run(&mut engine, prompt, n, &opts, Keep::Logits, &mut records).unwrap();
            got.decode_router = records.0;
            assert_same(&got, &want, &what);

            // Tokens only, nothing traced: the backend's greedy_step chooses every token.
            let mut engine = engine_on(choice, &cfg, &source).unwrap();
            let last = ForwardOptions::default();
            let fast = generate::run(&mut engine, prompt, n, &last, Keep::Tokens, &mut ()).unwrap();
            assert_eq!(fast.tokens, want.tokens, "{what}: greedy_step tokens");
            assert!(fast.step_logits.is_empty(), "{what}: no logits kept");
            assert_eq!(fast.decode_weight_bytes, want.decode_weight_bytes, "{what}");
            assert_eq!(
                bits(&fast.prefill.logits),
                bits(&want.prefill.logits[want.prefill.logits.len() - 1..]),
                "{what}: the last prefill row"
            );

            // A stop inside a run ahead: the tokens up to it, and the cache of one step per
            // token (the prompt and the tokens fed before the stopping one).
            let stop_at = n / 2;
            let eos = want.tokens[stop_at];
            let first = want.tokens.iter().position(|&t| t == eos).unwrap();
            let mut engine = engine_on(choice, &cfg, &source).unwrap();
            if choice == BackendChoice::CudaMock {
                assert!(
                    engine.model.run_ahead(&engine.seq) > 1,
                    "{what}: runs ahead"
                );
                // and with --cuda-wait-each-token it does not, with the same tokens
                let opts = LoadOptions {
                    backend: choice,
                    threads: 2,
                    kernel: Kernel::best(),
                    hot: None,
                    cuda: tarfa_cuda::CudaTuning {
                        wait_each_token: true,
                        ..Default::default()
                    },
                };
                let mut each = Engine::load(cfg.clone(), source.clone(), &opts, &|_| {}).unwrap();
                assert_eq!(each.model.run_ahead(&each.seq), 1, "{what}");
                let g = generate::run(&mut each, prompt, n, &last, Keep::Tokens, &mut ()).unwrap();
                assert_eq!(g.tokens, want.tokens, "{what}: waiting for each token");
            }
            let mut stop = StopAt(eos);
            let g = generate::run(&mut engine, prompt, n, &last, Keep::Tokens, &mut stop).unwrap();
            assert_eq!(g.tokens, want.tokens[..=first], "{what}: stopped");
            assert_eq!(engine.seq.len(), prompt.len() + first, "{what}: the cache");
        }
    }
}

#[test]
fn a_runtime_error_is_the_runtimes_whichever_backend() {
    let (cfg, source, _) = load("qwen3moe-a");
    let mut engine = engine_on(BackendChoice::Cpu, &cfg, &source).unwrap();
    let vocab = cfg.vocab_size as u32;
    let err = generate::run(
        &mut engine,
        &[vocab],
        2,
        &ForwardOptions::default(),
        Keep::Tokens,
        &mut (),
    )
    .unwrap_err();
    assert!(
        matches!(err, EngineError::Run(tarfa_core::RunError::TokenOutOfRange { token, .. }) if token == vocab),
        "{err}"
    );
}
