//! Decode and prefill throughput of the CPU backend on a random BF16 Qwen3-MoE built in memory,
//! compared with the machine's memory-read bandwidth measured in the same run.
//!
//! The model is sized so that the weights one decode token touches (attention, router, the 8
//! chosen experts of every layer, lm_head) are far larger than the caches: decode is then a
//! stream over memory, and `bytes touched / time` against a plain streaming read says how close
//! the matvec comes to the hardware. Figures are printed, never asserted.
//!
//! ```text
//! cargo run --release -p tarfa-run --example bench_decode -- [--layers 6] [--hidden 2048]
//!     [--experts 32] [--width 768] [--top-k 8] [--vocab 65536] [--threads 2]
//!     [--decode 24] [--prefill 64] [--context 8]
//! ```
//! `TARFA_SIMD=scalar|avx2|avx512` forces a SIMD path.

use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;
use tarfa_run::config::MoeConfig;
use tarfa_run::cpu::{CpuEngine, CpuModel, EngineOptions, ForwardOptions};
use tarfa_run::model::{expert_name, layer_name, ArchSpec, MlpKind, QkNorm};
use tarfa_run::numerics::{f32_to_bf16_rne, AlignedVec, Kernel};
use tarfa_run::weights::{Bf16Matrix, ExpertWeights, HostTensor, InMemorySource, TensorData};

struct Args {
    layers: usize,
    hidden: usize,
    experts: usize,
    width: usize,
    top_k: usize,
    vocab: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    threads: usize,
    decode: usize,
    prefill: usize,
    context: usize,
}

fn parse_args() -> Args {
    let mut a = Args {
        layers: 6,
        hidden: 2048,
        experts: 32,
        width: 768,
        top_k: 8,
        vocab: 65536,
        heads: 32,
        kv_heads: 4,
        head_dim: 128,
        threads: 2,
        decode: 24,
        prefill: 64,
        context: 8,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i + 1 < argv.len() {
        let v: usize = argv[i + 1].parse().unwrap_or_else(|_| {
            eprintln!("bad value for {}", argv[i]);
            std::process::exit(2)
        });
        match argv[i].as_str() {
            "--layers" => a.layers = v,
            "--hidden" => a.hidden = v,
            "--experts" => a.experts = v,
            "--width" => a.width = v,
            "--top-k" => a.top_k = v,
            "--vocab" => a.vocab = v,
            "--heads" => a.heads = v,
            "--kv-heads" => a.kv_heads = v,
            "--head-dim" => a.head_dim = v,
            "--threads" => a.threads = v,
            "--decode" => a.decode = v,
            "--prefill" => a.prefill = v,
            "--context" => a.context = v,
            other => {
                eprintln!("unknown option {other}");
                std::process::exit(2)
            }
        }
        i += 2;
    }
    a
}

/// Random BF16 values uniform in about [-scale, scale], from a per-chunk splitmix64 stream
/// (filled in parallel: the benchmark model is gigabytes).
fn random_bf16(n: usize, scale: f32, seed: u64) -> AlignedVec<u16> {
    let mut v = AlignedVec::zeroed(n);
    v.par_chunks_mut(1 << 16)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut s = seed ^ (c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
            for x in chunk.iter_mut() {
                s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = s;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                let u = ((z >> 40) as f32) / (1u64 << 24) as f32; // [0, 1)
                *x = f32_to_bf16_rne((2.0 * u - 1.0) * scale);
            }
        });
    v
}

fn build(a: &Args) -> (MoeConfig, InMemorySource) {
    let cfg_json = serde_json::json!({
        "model_type": "qwen3_moe",
        "vocab_size": a.vocab, "hidden_size": a.hidden, "intermediate_size": 4 * a.hidden,
        "moe_intermediate_size": a.width, "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim,
        "num_experts": a.experts, "num_experts_per_tok": a.top_k, "norm_topk_prob": true,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": false,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "rope_theta": 1_000_000.0,
        "hidden_act": "silu"
    });
    let cfg = MoeConfig::from_json_object(cfg_json.as_object().expect("object")).expect("config");
    let spec = ArchSpec::new(&cfg);
    let n = spec.names;
    let mut src = InMemorySource::new();
    let mut seed = 1u64;
    let mut next_seed = || {
        seed += 1;
        seed
    };
    let mat = |rows: usize, cols: usize, seed: u64| {
        let scale = 1.0 / (cols as f32).sqrt();
        HostTensor::new(
            "m",
            vec![rows, cols],
            TensorData::Bf16(random_bf16(rows * cols, scale, seed)),
        )
        .expect("shape")
    };
    let ones = |len: usize| {
        HostTensor::new(
            "n",
            vec![len],
            TensorData::Bf16(vec![0x3F80u16; len].into()),
        )
        .expect("shape")
    };
    let (h, d) = (a.hidden, a.head_dim);
    src.insert_tensor(n.embed, mat(a.vocab, h, next_seed()));
    src.insert_tensor(n.lm_head, mat(a.vocab, h, next_seed()));
    src.insert_tensor(n.final_norm, ones(h));
    for l in 0..a.layers {
        let name = |p: &str| layer_name(p, l);
        src.insert_tensor(name(n.input_norm), ones(h));
        src.insert_tensor(name(n.post_attention_norm), ones(h));
        src.insert_tensor(name(n.q_proj), mat(a.heads * d, h, next_seed()));
        src.insert_tensor(name(n.k_proj), mat(a.kv_heads * d, h, next_seed()));
        src.insert_tensor(name(n.v_proj), mat(a.kv_heads * d, h, next_seed()));
        src.insert_tensor(name(n.o_proj), mat(h, a.heads * d, next_seed()));
        assert_eq!(spec.qk_norm, QkNorm::PerHead);
        src.insert_tensor(name(n.q_norm), ones(d));
        src.insert_tensor(name(n.k_norm), ones(d));
        assert_eq!(spec.layers[l], MlpKind::Moe);
        src.insert_tensor(name(n.router), mat(a.experts, h, next_seed()));
        for e in 0..a.experts {
            let _ = expert_name(n.expert_gate, l, e);
            let m = |rows, cols, seed| Bf16Matrix {
                rows,
                cols,
                data: random_bf16(rows * cols, 1.0 / (cols as f32).sqrt(), seed),
            };
            src.insert_expert(
                l,
                e,
                ExpertWeights {
                    gate: m(a.width, h, next_seed()),
                    up: m(a.width, h, next_seed()),
                    down: m(h, a.width, next_seed()),
                },
            );
        }
    }
    (cfg, src)
}

/// Memory-read bandwidth: `threads` threads each summing their part of a buffer much larger than
/// the caches; best of several passes, in bytes per second.
fn read_bandwidth(threads: usize, bytes: usize) -> f64 {
    let words = bytes / 8;
    let buf: Vec<u64> = (0..words as u64).collect();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        let s: u64 = pool.install(|| {
            buf.par_chunks(words.div_ceil(threads))
                .map(|c| {
                    // 8 independent sums so the loop is bound by loads, not by one add chain
                    let mut acc = [0u64; 8];
                    for w in c.chunks_exact(8) {
                        for i in 0..8 {
                            acc[i] = acc[i].wrapping_add(w[i]);
                        }
                    }
                    acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
                })
                .reduce(|| 0, |a, b| a.wrapping_add(b))
        });
        let dt = t.elapsed().as_secs_f64();
        std::hint::black_box(s);
        best = best.max((words * 8) as f64 / dt);
    }
    best
}

fn main() {
    let a = parse_args();
    // TARFA_SIMD (this benchmark's own variable, read once here): scalar, avx2 or avx512
    let kernel = match std::env::var("TARFA_SIMD") {
        Ok(v) if !v.trim().is_empty() => {
            let path = tarfa_run::numerics::SimdPath::parse(&v).unwrap_or_else(|| {
                eprintln!("TARFA_SIMD={v}: not one of scalar, avx2, avx512");
                std::process::exit(2)
            });
            Kernel::new(path).unwrap_or_else(|e| {
                eprintln!("TARFA_SIMD={v}: {e}");
                std::process::exit(2)
            })
        }
        _ => Kernel::best(),
    };
    let t0 = Instant::now();
    let (cfg, src) = build(&a);
    let total: u64 = {
        let per_expert = 3 * 2 * (a.hidden * a.width) as u64;
        let attn = 2
            * (2 * a.heads * a.head_dim * a.hidden + 2 * a.kv_heads * a.head_dim * a.hidden) as u64;
        a.layers as u64 * (a.experts as u64 * per_expert + attn)
            + 2 * 2 * (a.vocab * a.hidden) as u64
    };
    println!(
        "model: {} layers, hidden {}, {} experts x width {}, top-{}, vocab {}, {:.2} GB of BF16 weights (built in {:.1}s)",
        a.layers,
        a.hidden,
        a.experts,
        a.width,
        a.top_k,
        a.vocab,
        total as f64 / 1e9,
        t0.elapsed().as_secs_f64()
    );
    let model = Arc::new(CpuModel::load(cfg, Arc::new(src)).expect("model"));
    let engine = CpuEngine::new(
        model.clone(),
        EngineOptions {
            threads: a.threads,
            kernel,
        },
    )
    .expect("engine");
    println!(
        "engine: {} threads, SIMD path {}",
        engine.threads(),
        kernel.path().name()
    );

    // Bandwidth is measured before and after decode and the higher figure kept: a shared machine's
    // bandwidth drifts, and the ratio below should not flatter the decode.
    let bw_before = read_bandwidth(a.threads, 2 << 30);

    // decode: a short prompt, then timed one-token steps
    let opts = ForwardOptions::default();
    let mut cache = model.new_cache();
    let prompt: Vec<u32> = (0..8)
        .map(|i| (i * 7919 + 13) as u32 % a.vocab as u32)
        .collect();
    let out = engine.forward(&mut cache, &prompt, &opts).expect("prefill");
    let mut next = tarfa_run::generate::argmax(&out.logits[0]);
    // one untimed step so that first-touch effects are out of the measurement
    let out = engine.forward(&mut cache, &[next], &opts).expect("decode");
    next = tarfa_run::generate::argmax(&out.logits[0]);
    let mut bytes = 0u64;
    let t = Instant::now();
    for _ in 0..a.decode {
        let out = engine.forward(&mut cache, &[next], &opts).expect("decode");
        bytes += out.stats.weight_bytes;
        next = tarfa_run::generate::argmax(&out.logits[0]);
    }
    let dt = t.elapsed().as_secs_f64();
    let bw = bw_before.max(read_bandwidth(a.threads, 2 << 30));
    let per_token = bytes as f64 / a.decode as f64;
    let achieved = bytes as f64 / dt;
    println!(
        "decode (after {} tokens): {:.2} tok/s, {:.1} MB of weights touched per token, {:.1} GB/s",
        a.context,
        a.decode as f64 / dt,
        per_token / 1e6,
        achieved / 1e9
    );
    println!(
        "memory read bandwidth ({} threads streaming 2 GiB, best of before/after): {:.1} GB/s; decode reaches {:.0}% of it",
        a.threads,
        bw / 1e9,
        100.0 * achieved / bw
    );

    // prefill: a fresh sequence of `prefill` tokens in one step
    let mut cache = model.new_cache();
    let prompt: Vec<u32> = (0..a.prefill)
        .map(|i| (i * 7919 + 17) as u32 % a.vocab as u32)
        .collect();
    let t = Instant::now();
    let out = engine.forward(&mut cache, &prompt, &opts).expect("prefill");
    let dt = t.elapsed().as_secs_f64();
    println!(
        "prefill: {} tokens in {:.2}s = {:.1} tok/s ({} experts fetched over all layers)",
        a.prefill,
        dt,
        a.prefill as f64 / dt,
        out.stats.experts_fetched
    );
}
