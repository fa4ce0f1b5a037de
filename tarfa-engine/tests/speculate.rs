//! Speculative decoding through the engine, on the CPU and on the CUDA arm over tarfa-cuda's mock
//! device: the same tokens and the same logits of every step, bit for bit, as the plain decode
//! loop, for draft lengths 1, 2, 4 and 8, threads 1 and 2, greedy and sampled, with EOS and
//! max_tokens cutting a draft; the cache left at the same length, and the next step after the
//! run the same bits.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tarfa_core::config::MoeConfig;
use tarfa_core::generate::{self, Choice, Flow, Greedy, Keep, Observer, Session};
use tarfa_core::model::ArchSpec;
use tarfa_core::numerics::Kernel;
use tarfa_core::sampling::SamplingParams;
use tarfa_core::speculate::{run_speculative, Drafter, ModelDrafter, NgramDrafter, SpecStats};
use tarfa_core::step::{ForwardOptions, LogitRows};
use tarfa_core::weights::{load_safetensors_dir, WeightSource};
use tarfa_engine::{BackendChoice, Engine, LoadOptions};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures/oracle")
        .join(name)
}

fn load(name: &str) -> (MoeConfig, Arc<dyn WeightSource>) {
    let dir = fixture(name);
    let cfg = MoeConfig::from_json_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
        .unwrap();
    let source = Arc::new(load_safetensors_dir(&dir, &cfg, &ArchSpec::new(&cfg)).unwrap());
    (cfg, source)
}

fn engine(
    cfg: &MoeConfig,
    source: &Arc<dyn WeightSource>,
    backend: BackendChoice,
    threads: usize,
) -> Engine {
    let opts = LoadOptions {
        backend,
        threads,
        kernel: Kernel::best(),
        hot: None,
        cuda: Default::default(),
    };
    Engine::load(cfg.clone(), source.clone(), &opts, &|_| {}).unwrap()
}

fn bits(rows: &[Vec<f32>]) -> Vec<Vec<u32>> {
    rows.iter()
        .map(|r| r.iter().map(|v| v.to_bits()).collect())
        .collect()
}

/// Stops after `eos` (an id the run is known to produce, to cut a draft).
struct StopAt(Option<u32>);

impl Observer<Engine> for StopAt {
    type Error = tarfa_engine::EngineError;
    fn token(&mut self, _j: usize, t: u32) -> Result<Flow, Self::Error> {
        Ok(if Some(t) == self.0 {
            Flow::Stop
        } else {
            Flow::Continue
        })
    }
}

/// Always wrong: the draft is the previous token plus one, never what the model chose (unless by
/// chance, which the accept rule handles the same way).
struct Shifted;
impl<E> Drafter<E> for Shifted {
    fn draft(&mut self, context: &[u32], k: usize) -> Result<Vec<u32>, E> {
        let last = *context.last().unwrap();
        Ok((1..=k as u32).map(|i| last.wrapping_add(i) % 64).collect())
    }
}

/// Plain and speculative runs on two fresh engines: equal tokens, step logits, cache length, and
/// the next step's logits.
#[allow(clippy::too_many_arguments)]
fn same(
    cfg: &MoeConfig,
    source: &Arc<dyn WeightSource>,
    backend: BackendChoice,
    threads: usize,
    prompt: &[u32],
    n: usize,
    k: usize,
    choice: Choice<'_>,
    eos: Option<u32>,
    drafter: &mut dyn Drafter<tarfa_engine::EngineError>,
) -> (Greedy, SpecStats) {
    let what = format!("{backend:?} threads {threads} k {k} n {n} eos {eos:?} {choice:?}");
    let opts = ForwardOptions::default();
    let mut plain = engine(cfg, source, backend, threads);
    let want = generate::run_with(
        &mut plain,
        prompt,
        n,
        &opts,
        Keep::Logits,
        choice,
        &mut StopAt(eos),
    )
    .unwrap();
    let mut spec = engine(cfg, source, backend, threads);
    let (got, st) = run_speculative(
        &mut spec,
        prompt,
        n,
        &opts,
        Keep::Logits,
        choice,
        drafter,
        k,
        &mut StopAt(eos),
    )
    .unwrap();
    assert_eq!(got.tokens, want.tokens, "{what}: tokens");
    assert_eq!(
        bits(&got.step_logits),
        bits(&want.step_logits),
        "{what}: step logits"
    );
    assert_eq!(spec.cached_len(), plain.cached_len(), "{what}: the cache");
    let all = ForwardOptions {
        logits: LogitRows::All,
        ..opts
    };
    let a = plain.forward(&[1, 2], &all).unwrap();
    let b = spec.forward(&[1, 2], &all).unwrap();
    assert_eq!(
        bits(&a.logits),
        bits(&b.logits),
        "{what}: the step after the run"
    );
    if matches!(choice, Choice::Greedy) {
        // The token-only path (no logits kept): plain decoding's greedy steps (CUDA's run-ahead
        // on the mock device) against speculation's greedy_step / greedy_rows.
        let mut plain = engine(cfg, source, backend, threads);
        let fast = generate::run_with(
            &mut plain,
            prompt,
            n,
            &opts,
            Keep::Tokens,
            choice,
            &mut StopAt(eos),
        )
        .unwrap();
        let mut spec = engine(cfg, source, backend, threads);
        let (got, tst) = run_speculative(
            &mut spec,
            prompt,
            n,
            &opts,
            Keep::Tokens,
            choice,
            drafter,
            k,
            &mut StopAt(eos),
        )
        .unwrap();
        assert_eq!(fast.tokens, want.tokens, "{what}: token-only plain");
        assert_eq!(got.tokens, want.tokens, "{what}: token-only tokens");
        assert_eq!(tst, st, "{what}: token-only drafts");
        assert_eq!(
            spec.cached_len(),
            plain.cached_len(),
            "{what}: token-only cache"
        );
        let a = plain.forward(&[1, 2], &all).unwrap();
        let b = spec.forward(&[1, 2], &all).unwrap();
        assert_eq!(
            bits(&a.logits),
            bits(&b.logits),
            "{what}: token-only, the step after the run"
        );
    }
    (want, st)
}

#[test]
fn speculation_is_plain_decoding_bit_for_bit() {
    let (cfg, source) = load("qwen3moe-a");
    // A prompt that repeats (drafts are accepted) and one that never repeats a token.
    let repeats: Vec<u32> = [5u32, 9, 13, 2, 7]
        .iter()
        .cycle()
        .take(20)
        .copied()
        .collect();
    let fresh: Vec<u32> = (0..12).map(|i| (i * 5 + 3) % 64).collect();
    let params = SamplingParams {
        temperature: 0.9,
        top_k: 20,
        seed: 11,
        ..SamplingParams::default()
    };
    let sampled = Choice::Sample {
        params: &params,
        request: 0,
    };
    let n = 14;
    let mut accepted = 0;
    for prompt in [&repeats, &fresh] {
        for k in [1, 2, 4, 8] {
            let threads = if k % 4 == 0 { 2 } else { 1 };
            for choice in [Choice::Greedy, sampled] {
                let (g, st) = same(
                    &cfg,
                    &source,
                    BackendChoice::Cpu,
                    threads,
                    prompt,
                    n,
                    k,
                    choice,
                    None,
                    &mut NgramDrafter::default(),
                );
                accepted += st.accepted;
                // A stop inside the run (the fifth token), and max_tokens cutting a draft.
                same(
                    &cfg,
                    &source,
                    BackendChoice::Cpu,
                    threads,
                    prompt,
                    n,
                    k,
                    choice,
                    Some(g.tokens[4]),
                    &mut NgramDrafter::default(),
                );
                same(
                    &cfg,
                    &source,
                    BackendChoice::Cpu,
                    threads,
                    prompt,
                    3,
                    k,
                    choice,
                    None,
                    &mut NgramDrafter::default(),
                );
            }
            same(
                &cfg,
                &source,
                BackendChoice::Cpu,
                1,
                prompt,
                n,
                k,
                Choice::Greedy,
                None,
                &mut Shifted,
            );
        }
    }
    assert!(accepted > 0, "the repeating prompt has drafts accepted");
}

#[test]
fn speculation_on_the_cuda_mock_device() {
    let (cfg, source) = load("qwen3moe-a");
    let repeats: Vec<u32> = [5u32, 9, 13, 2, 7]
        .iter()
        .cycle()
        .take(20)
        .copied()
        .collect();
    for k in [1, 4] {
        let (g, _) = same(
            &cfg,
            &source,
            BackendChoice::CudaMock,
            1,
            &repeats,
            10,
            k,
            Choice::Greedy,
            None,
            &mut NgramDrafter::default(),
        );
        same(
            &cfg,
            &source,
            BackendChoice::CudaMock,
            1,
            &repeats,
            10,
            k,
            Choice::Greedy,
            Some(g.tokens[3]),
            &mut Shifted,
        );
    }
}

#[test]
fn speculation_is_plain_decoding_on_every_oracle_fixture() {
    // Every family and config feature of the oracle fixtures (qwen3moe-a and the 28 MB demo
    // model aside: the test above and the CLI's cover them), greedy and sampled, with a stop
    // inside the run: a repeating prompt, so that drafts are fed and some accepted.
    let params = SamplingParams {
        temperature: 0.7,
        top_p: 0.9,
        seed: 3,
        ..SamplingParams::default()
    };
    let sampled = Choice::Sample {
        params: &params,
        request: 1,
    };
    let repeats: Vec<u32> = [11u32, 40, 3, 29]
        .iter()
        .cycle()
        .take(14)
        .copied()
        .collect();
    let mut drafted = 0;
    for name in [
        "deepseekv2-yarn-s",
        "deepseekv3-plain-s",
        "deepseekv3-s",
        "glm4moe-s",
        "mixtral-s",
        "olmoe-s",
        "qwen2moe-s",
        "qwen3moe-dense",
        "qwen3moe-odd",
        "qwen3moe-yarn-s",
    ] {
        let (cfg, source) = load(name);
        for (k, choice) in [(2, Choice::Greedy), (8, Choice::Greedy), (4, sampled)] {
            let (g, st) = same(
                &cfg,
                &source,
                BackendChoice::Cpu,
                2,
                &repeats,
                12,
                k,
                choice,
                None,
                &mut NgramDrafter::default(),
            );
            drafted += st.drafted;
            same(
                &cfg,
                &source,
                BackendChoice::Cpu,
                1,
                &repeats,
                12,
                k,
                choice,
                Some(g.tokens[5]),
                &mut NgramDrafter::default(),
            );
        }
    }
    assert!(drafted > 0, "the repeating prompt is drafted from");
}

/// A draft model on its own engine (`ModelDrafter`), loaded like the verified one.
fn draft_model(name: &str, backend: BackendChoice) -> ModelDrafter<Engine> {
    let (cfg, source) = load(name);
    let max = cfg.max_position_embeddings;
    ModelDrafter::new(engine(&cfg, &source, backend, 1), max)
}

#[test]
fn a_draft_model_is_only_a_proposal() {
    let repeats: Vec<u32> = [5u32, 9, 13, 2, 7]
        .iter()
        .cycle()
        .take(20)
        .copied()
        .collect();
    let params = SamplingParams {
        temperature: 0.9,
        top_k: 20,
        seed: 3,
        ..SamplingParams::default()
    };
    let sampled = Choice::Sample {
        params: &params,
        request: 0,
    };
    // The model as its own draft, on the CPU and on the CUDA mock: every greedy draft accepted.
    let (cfg, source) = load("qwen3moe-a");
    for (k, draft_backend) in [
        (1, BackendChoice::Cpu),
        (3, BackendChoice::CudaMock),
        (8, BackendChoice::Cpu),
    ] {
        let mut d = draft_model("qwen3moe-a", draft_backend);
        let (_, st) = same(
            &cfg,
            &source,
            BackendChoice::Cpu,
            1,
            &repeats,
            12,
            k,
            Choice::Greedy,
            None,
            &mut d,
        );
        assert_eq!(st.accepted, st.drafted, "k {k}: a self-draft is greedy");
        assert!(st.steps < 11, "k {k}: steps saved");
        same(
            &cfg,
            &source,
            BackendChoice::Cpu,
            1,
            &repeats,
            12,
            k,
            sampled,
            None,
            &mut d,
        );
    }
    // A weak draft: another family's model of the same vocabulary, on the CUDA mock's verifier
    // too.
    let (cfg, source) = load("qwen2moe-s");
    let (mut drafted, mut accepted) = (0, 0);
    for (k, backend) in [(2, BackendChoice::Cpu), (5, BackendChoice::CudaMock)] {
        for choice in [Choice::Greedy, sampled] {
            let mut d = draft_model("mixtral-s", BackendChoice::Cpu);
            let (_, st) = same(
                &cfg, &source, backend, 1, &repeats, 12, k, choice, None, &mut d,
            );
            drafted += st.drafted;
            accepted += st.accepted;
        }
    }
    assert!(accepted < drafted, "the weak draft is sometimes wrong");
}

/// A hybrid model (qwen35moe-a of the shared oracle: gated DeltaNet layers, whose state exists
/// only at a step's start): a rejected draft's rewind keeps the step's start and the accepted
/// tokens are fed again, so speculation is still plain decoding bit for bit; the model as its own
/// draft model (its drafter's cache rewinds to shared prefixes) too.
#[test]
fn speculation_on_a_hybrid_model_is_plain_decoding_bit_for_bit() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/oracle/qwen35moe-a");
    let Ok(text) = std::fs::read_to_string(dir.join("config.json")) else {
        assert!(std::env::var_os("CI").is_none(), "CI must have ../shared");
        eprintln!("no shared oracle at {}: skipped", dir.display());
        return;
    };
    let cfg = MoeConfig::from_json_str(&text).unwrap();
    let source: Arc<dyn WeightSource> =
        Arc::new(load_safetensors_dir(&dir, &cfg, &ArchSpec::new(&cfg)).unwrap());
    let repeats: Vec<u32> = [5u32, 9, 13, 2, 7]
        .iter()
        .cycle()
        .take(20)
        .copied()
        .collect();
    let (mut accepted, mut rejected) = (0, 0);
    for k in [2, 4] {
        let (_, st) = same(
            &cfg,
            &source,
            BackendChoice::Cpu,
            2,
            &repeats,
            12,
            k,
            Choice::Greedy,
            None,
            &mut NgramDrafter::default(),
        );
        accepted += st.accepted;
        let (_, shifted) = same(
            &cfg,
            &source,
            BackendChoice::Cpu,
            1,
            &repeats,
            12,
            k,
            Choice::Greedy,
            None,
            &mut Shifted,
        );
        rejected += shifted.drafted - shifted.accepted;
    }
    let mut own = ModelDrafter::new(
        engine(&cfg, &source, BackendChoice::Cpu, 1),
        cfg.max_position_embeddings,
    );
    let (_, st) = same(
        &cfg,
        &source,
        BackendChoice::Cpu,
        1,
        &repeats,
        12,
        3,
        Choice::Greedy,
        None,
        &mut own,
    );
    // rejected drafts rewind into the verifying step (re-fed from its start); the model's own
    // drafts are all accepted and the last step's stop rewinds into it
    assert!(
        st.accepted > 0 && rejected > 0,
        "both rewinds exercised: self-draft {st:?}, {rejected} rejected, ngram {accepted} accepted"
    );
}
