//! The scoring output is the same bytes on the CPU and on the CUDA backend, whatever the batch:
//! the CUDA arm runs on tarfa-cuda's mock device (its orchestration with the kernels' reference
//! functions, or the real kernels on the CPU emulator under TARFA_CUDA_EMU). On a GPU machine the
//! CLI's `score --backend cuda` is compared with the CPU's file byte for byte
//! (validation/gpu/score.sh).

use std::path::Path;
use std::sync::Arc;

use tarfa_core::config::MoeConfig;
use tarfa_core::model::ArchSpec;
use tarfa_core::numerics::Kernel;
use tarfa_core::weights::{load_safetensors_dir, WeightSource};
use tarfa_engine::{BackendChoice, LoadOptions, Model};
use tarfa_score::{parse_line, score, Decoding, Limits, Options, ScoreOptions};

fn model(backend: BackendChoice) -> Model {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/oracle/qwen3moe-a");
    let cfg = MoeConfig::from_json_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
        .unwrap();
    let source: Arc<dyn WeightSource> =
        Arc::new(load_safetensors_dir(&dir, &cfg, &ArchSpec::new(&cfg)).unwrap());
    let opts = LoadOptions {
        backend,
        threads: 2,
        kernel: Kernel::best(),
        hot: None,
        cuda: Default::default(),
    };
    Model::load(cfg, source, &opts, &|_| {}).unwrap()
}

/// Every result line, in input order.
fn run(m: &Model, lines: &[&str], max_batch: usize) -> Vec<String> {
    let cfg = m.config();
    let eos = [1u32];
    let limits = Limits {
        vocab_size: cfg.vocab_size,
        max_positions: cfg.max_position_embeddings,
        eos: &eos,
        tokenizer: None,
        chat: Ok(None),
    };
    let requests: Vec<_> = lines
        .iter()
        .enumerate()
        .map(|(i, l)| parse_line(i + 1, l, Options::default(), &limits).unwrap())
        .collect();
    let dec = Decoding {
        tokenizer: None,
        eos: &eos,
    };
    let opts = ScoreOptions {
        max_batch,
        chunk_tokens: 4,
        draft_tokens: 0,
    };
    let mut out = vec![String::new(); requests.len()];
    score(
        m,
        &requests,
        &dec,
        &opts,
        &mut |i, r| {
            out[i] = r.to_json_line();
            Ok(())
        },
        &mut |_| {},
    )
    .unwrap();
    out
}

#[test]
fn score_gives_the_same_bytes_on_the_cpu_and_the_cuda_mock_device_at_any_batch() {
    let lines = [
        r#"{"context": [3, 17, 9], "continuation": [40, 2, 77], "top_logprobs": 3, "echo": true}"#,
        r#"{"rolling": [5, 6, 7, 8, 9, 10, 11, 12, 13]}"#,
        r#"{"context": [100, 200, 300], "max_tokens": 4, "top_logprobs": 2}"#,
        r#"{"context": [8, 8], "max_tokens": 3, "temperature": 0.9, "top_p": 0.8, "seed": 7}"#,
        r#"{"context": [250], "continuation": [251, 252, 253, 254, 255, 256]}"#,
    ];
    let cpu = model(BackendChoice::Cpu);
    let want = run(&cpu, &lines, 1);
    assert!(want.iter().all(|l| l.starts_with('{')), "{want:?}");
    assert_eq!(run(&cpu, &lines, 5), want, "cpu, batch 5");
    let cuda = model(BackendChoice::CudaMock);
    assert_eq!(cuda.name(), "cuda");
    assert_eq!(run(&cuda, &lines, 1), want, "cuda mock, batch 1");
    assert_eq!(run(&cuda, &lines, 3), want, "cuda mock, batch 3");
}
