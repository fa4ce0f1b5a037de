//! The DeepSeek-V3/V2 and GLM-4.5 synthetic shapes: their released sizes, worked out here from
//! the published dimensions; their tensors exactly the runtime's rules; the tiny variants
//! converted by the `tarfa-convert` binary and run on the CPU runtime; and the overrides that
//! the runtime would refuse, refused before anything is written.

use std::path::Path;
use std::sync::Arc;

use tarfa_convert::synth::{self, SynthShape};
use tarfa_core::generate::greedy;
use tarfa_core::shapes::{FoundTensor, ModelRules};
use tarfa_core::weights::WeightSource;
use tarfa_cpu::{CpuEngine, CpuModel, EngineOptions, ForwardOptions, LogitRows};
use tarfa_manifest::Manifest;
use tarfa_stream::bundle::BundleSource;

mod common;
use common::run;

fn shape(name: &str) -> SynthShape {
    synth::shapes()
        .into_iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("shape {name}"))
}

/// (tensors, bytes) of each released shape, from its published config, element by element.
#[test]
fn the_released_shapes_have_their_published_sizes() {
    // deepseek-v3: 61 layers, the first 3 dense; MLA with a q LoRA.
    let (h, v) = (7168u64, 129_280u64);
    let attention = 2 * h // input and post-attention norms
        + 1536 * h + 1536 + 128 * (128 + 64) * 1536 // q_a_proj, q_a_layernorm, q_b_proj
        + (512 + 64) * h + 512 // kv_a_proj_with_mqa, kv_a_layernorm
        + 128 * (128 + 128) * 512 // kv_b_proj
        + h * 128 * 128; // o_proj
    let dense = 3 * 18_432 * h;
    let moe = 256 * h + 256 // router, e_score_correction_bias
        + 3 * 2048 * h // one shared expert
        + 256 * 3 * 2048 * h; // routed experts
    let global = 2 * v * h + h;
    let v3 = (
        61 * 9 + 3 * 3 + 58 * (2 + 3 + 256 * 3) + 3,
        2 * (61 * attention + 3 * dense + 58 * moe + global),
    );

    // deepseek-v2-lite: 27 layers, the first dense; a plain q_proj; softmax routing (no bias).
    let (h, v) = (2048u64, 102_400u64);
    let attention = 2 * h + 16 * (128 + 64) * h // norms, q_proj
        + (512 + 64) * h + 512 + 16 * (128 + 128) * 512 + h * 16 * 128;
    let moe_v2 = 64 * h + 3 * 2 * 1408 * h + 64 * 3 * 1408 * h;
    let v2 = (
        27 * 7 + 3 + 26 * (1 + 3 + 64 * 3) + 3,
        2 * (27 * attention + 3 * 10_944 * h + 26 * moe_v2 + 2 * v * h + h),
    );

    // moonlight-16b-a3b: V2-Lite's attention, V3's sigmoid router (with its bias).
    let v = 163_840u64;
    let moe_moon = 64 * h + 64 + 3 * 2 * 1408 * h + 64 * 3 * 1408 * h;
    let moon = (
        27 * 7 + 3 + 26 * (2 + 3 + 64 * 3) + 3,
        2 * (27 * attention + 3 * 11_264 * h + 26 * moe_moon + 2 * v * h + h),
    );

    // glm-4.5-air: 46 layers, the first dense; GQA 96/8 heads of 128 with q/k/v biases.
    let (h, v) = (4096u64, 151_552u64);
    let (q, kv) = (96 * 128u64, 8 * 128u64);
    let attention = 2 * h + q * h + q + 2 * (kv * h + kv) + h * q;
    let moe = 128 * h + 128 + 3 * 1408 * h + 128 * 3 * 1408 * h;
    let glm = (
        46 * 9 + 3 + 45 * (2 + 3 + 128 * 3) + 3,
        2 * (46 * attention + 3 * 10_944 * h + 45 * moe + 2 * v * h + h),
    );

    for (name, want) in [
        ("deepseek-v3", v3),
        ("deepseek-v2-lite", v2),
        ("moonlight-16b-a3b", moon),
        ("glm-4.5-air", glm),
    ] {
        let s = shape(name);
        assert_eq!(s.checked_size(), Some(want), "{name}: checked_size");
        let tensors = s.tensors().unwrap();
        let bytes: u64 = tensors.iter().map(|t| t.len_bytes()).sum();
        assert_eq!(
            (tensors.len() as u64, bytes),
            want,
            "{name}: the tensor list"
        );
    }
    // About 671 B parameters for DeepSeek-V3 without its MTP layer (the published 671 B).
    assert!(
        (v3.1 / 2).abs_diff(671_000_000_000) < 2_000_000_000,
        "{}",
        v3.1 / 2
    );
}

/// Every shape's tensors are exactly the runtime's rules for its config (nothing missing,
/// nothing extra, each expert's gate, up and down together), and `checked_size` agrees with the
/// list, for the shapes as released and cut down with the overrides.
#[test]
fn every_shape_is_exactly_the_runtime_rules() {
    for mut s in synth::shapes() {
        for layers in [s.layers, 1, 2, 4] {
            s.layers = layers;
            let cfg = s.runtime_config().unwrap();
            let rules = ModelRules::for_config(&cfg);
            let tensors = s.tensors().unwrap();
            let mut want: Vec<(String, Vec<u64>)> = rules
                .non_expert()
                .into_iter()
                .filter(|r| r.need == tarfa_core::shapes::Need::Required)
                .map(|r| (r.name.clone(), r.shape.iter().map(|&d| d as u64).collect()))
                .chain(
                    rules
                        .expert_matrices()
                        .map(|m| (m.name, m.shape.iter().map(|&d| d as u64).collect())),
                )
                // gpt-oss's and Llama 4's fused expert tensors
                .chain(
                    rules
                        .fused
                        .iter()
                        .flat_map(|f| f.tensors())
                        .map(|r| (r.name.clone(), r.shape.iter().map(|&d| d as u64).collect())),
                )
                .collect();
            let mut got: Vec<(String, Vec<u64>)> = tensors
                .iter()
                .map(|t| (t.name.clone(), t.shape.clone()))
                .collect();
            want.sort();
            got.sort();
            assert_eq!(got, want, "{} --layers {layers}", s.name);
            rules
                .check(|name| {
                    let t = tensors.iter().find(|t| t.name == name)?;
                    Some(FoundTensor {
                        dtype: "BF16",
                        shape: &t.shape,
                    })
                })
                .unwrap();
            let bytes: u64 = tensors.iter().map(|t| t.len_bytes()).sum();
            assert_eq!(
                s.checked_size(),
                Some((tensors.len() as u64, bytes)),
                "{} --layers {layers}",
                s.name
            );
            // At least one MoE layer, however few layers.
            assert!(rules.expert_layers().count() >= 1, "{}", s.name);
        }
    }
}

#[test]
fn layers_keep_first_k_dense_replace_below_the_layer_count() {
    let mut s = shape("deepseek-v3");
    for (layers, dense) in [(61, 3), (4, 3), (3, 2), (2, 1), (1, 0)] {
        s.layers = layers;
        assert_eq!(s.config_json()["first_k_dense_replace"], dense, "{layers}");
        assert_eq!(
            s.runtime_config().unwrap().first_k_dense_replace,
            dense as usize
        );
    }
    let mut g = shape("glm-4.5-air");
    g.layers = 1;
    assert_eq!(g.config_json()["first_k_dense_replace"], 0);
}

/// The config values the released models publish, as the runtime reads them.
#[test]
fn the_released_configs_parse_to_their_values() {
    let c = shape("deepseek-v3").runtime_config().unwrap();
    let (m, g, y) = (c.mla.unwrap(), c.group_routing.unwrap(), c.yarn.unwrap());
    assert_eq!(
        (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim),
        (Some(1536), 512, 128)
    );
    assert_eq!((m.qk_rope_head_dim, m.v_head_dim), (64, 128));
    assert!(m.rope_interleave);
    assert_eq!(
        (g.n_group, g.topk_group, g.routed_scaling_factor),
        (8, 4, 2.5)
    );
    assert_eq!((c.num_experts, c.top_k, c.num_heads), (256, 8, 128));
    assert_eq!(
        (y.factor, y.original_max_position_embeddings),
        (40.0, 4096.0)
    );
    assert_eq!((y.mscale, y.mscale_all_dim), (Some(1.0), Some(1.0)));
    assert!(c.renormalize_topk);
    let c = shape("deepseek-v2-lite").runtime_config().unwrap();
    assert_eq!(c.mla.unwrap().q_lora_rank, None);
    assert_eq!(c.yarn.unwrap().mscale_all_dim, Some(0.707));
    assert!(!c.renormalize_topk);
    let c = shape("moonlight-16b-a3b").runtime_config().unwrap();
    assert_eq!(c.group_routing.unwrap().routed_scaling_factor, 2.446);
    assert_eq!(
        (c.yarn, c.rope_theta, c.vocab_size),
        (None, 50_000.0, 163_840)
    );
    let c = shape("glm-4.5-air").runtime_config().unwrap();
    assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (96, 8, 128));
    assert_eq!(c.rotary_dim, 64, "partial_rotary_factor 0.5");
    assert!(c.qkv_bias && !c.qk_norm_on);
}

/// The manifest's tensors and experts without their offsets (a converted bundle's header holds
/// source records, so its data starts later than a directly written one's).
fn unplaced(dir: &Path) -> impl PartialEq + std::fmt::Debug {
    let mut m = Manifest::load(&dir.join("manifest.toml")).unwrap();
    m.tensors.iter_mut().for_each(|t| t.offset = 0);
    m.experts.iter_mut().for_each(|e| e.offset = 0);
    (m.tensors, m.experts)
}

#[test]
fn the_tiny_families_convert_and_run_on_the_cpu() {
    for name in ["tiny-deepseek-v3", "tiny-deepseek-v2", "tiny-glm4-moe"] {
        let d = tempfile::tempdir().unwrap();
        let (hub, conv, direct) = (
            d.path().join("hub"),
            d.path().join("conv"),
            d.path().join("direct"),
        );
        let synth_args = ["synth", "--shape", name, "--seed", "3", "--skew", "1"];
        let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> =
            synth_args.iter().map(|a| a as _).collect();
        args.push(&hub);
        let (code, _, err) = run(&args);
        assert_eq!(code, 0, "{name}: {err}");
        let (code, _, err) = run(&[&hub, &conv]);
        // The converter's checkpoint reader takes DeepSeek layouts only once issue 21's
        // converter part lands; until then the one refusal allowed is that one, and the run
        // below uses the bundle written directly (by the same binary).
        let converted = code == 0;
        if !converted {
            assert!(
                name.contains("deepseek") && err.contains("is not supported (Tarfa reads"),
                "{name}: the converter refused it: {err}"
            );
        }
        let mut args: Vec<&dyn AsRef<std::ffi::OsStr>> =
            synth_args.iter().map(|a| a as _).collect();
        let more: [&dyn AsRef<std::ffi::OsStr>; 3] = [&"--format", &"bundle", &direct];
        args.extend(more);
        let (code, _, err) = run(&args);
        assert_eq!(code, 0, "{name}: {err}");
        if converted {
            assert_eq!(unplaced(&conv), unplaced(&direct), "{name}: the same bytes");
        }
        let bundle = if converted { &conv } else { &direct };

        let s = shape(name);
        let src = Arc::new(BundleSource::open(bundle, None).unwrap());
        let cfg = tarfa_core::config::MoeConfig::from_json_str(
            &String::from_utf8(src.read_file("config.json").unwrap()).unwrap(),
        )
        .unwrap();
        assert_eq!(cfg, s.runtime_config().unwrap(), "{name}");
        let model = Arc::new(CpuModel::load(cfg.clone(), src as Arc<dyn WeightSource>).unwrap());
        let engine = CpuEngine::new(model.clone(), EngineOptions::default()).unwrap();
        let mut cache = model.new_cache();
        let opts = ForwardOptions {
            logits: LogitRows::Last,
            trace_router: true,
            ..Default::default()
        };
        let out = greedy(&engine, &mut cache, &[1, 2, 3, 40, 50], 6, &opts).unwrap();
        assert_eq!(out.tokens.len(), 6, "{name}");
        assert!(out.tokens.iter().all(|&t| (t as usize) < cfg.vocab_size));
        for row in &out.step_logits {
            assert_eq!(row.len(), cfg.vocab_size);
            assert!(row.iter().all(|x| x.is_finite()), "{name}: finite logits");
        }
        // Layer 0 is dense (first_k_dense_replace 1), layer 1 routes every token.
        let records: Vec<_> = out
            .prefill
            .router
            .iter()
            .chain(&out.decode_router)
            .collect();
        assert!(records.iter().all(|r| r.layer == 1), "{name}");
        assert_eq!(
            records.len(),
            5 + 5,
            "{name}: 5 prompt tokens, 5 decode steps"
        );
        let routing = s.routed.unwrap();
        let per_group = s.experts / routing.n_group;
        for r in records {
            let mut e = r.experts.clone();
            e.sort();
            e.dedup();
            assert_eq!(e.len(), s.top_k as usize, "{name}: distinct experts");
            let mut groups: Vec<u32> = e.iter().map(|x| x / per_group).collect();
            groups.dedup();
            assert!(
                groups.len() <= routing.topk_group as usize,
                "{name}: experts {e:?} outside the topk_group {} best groups",
                routing.topk_group
            );
            let sum: f32 = r.weights.iter().sum();
            if routing.norm_topk_prob {
                let want = routing.routed_scaling_factor as f32;
                assert!(
                    (sum - want).abs() < 1e-4 * want,
                    "{name}: weights sum {sum}"
                );
            } else {
                assert!(
                    sum > 0.0 && sum < 1.0,
                    "{name}: unrenormalised softmax {sum}"
                );
            }
        }
    }
}

#[test]
fn norms_sit_near_one_and_biases_near_zero() {
    let s = shape("tiny-glm4-moe");
    let mean_abs = |name: &str| {
        let t = s
            .tensors()
            .unwrap()
            .into_iter()
            .find(|t| t.name == name)
            .unwrap();
        let mut b = vec![0u8; t.len_bytes() as usize];
        t.fill(1, 0.0, &mut b);
        let v: Vec<f32> = b
            .chunks_exact(2)
            .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
            .collect();
        (
            v.iter().sum::<f32>() / v.len() as f32,
            v.iter().map(|x| x.abs()).sum::<f32>() / v.len() as f32,
        )
    };
    for n in [
        "model.layers.1.self_attn.q_proj.bias",
        "model.layers.1.self_attn.v_proj.bias",
        "model.layers.1.mlp.gate.e_score_correction_bias",
    ] {
        let (_, a) = mean_abs(n);
        assert!(a > 0.0 && a < 0.05, "{n}: mean |x| {a}");
    }
    let (m, _) = mean_abs("model.layers.0.input_layernorm.weight");
    assert!((m - 1.0).abs() < 0.1, "norm mean {m}");
    let v3 = shape("tiny-deepseek-v3");
    for n in [
        "model.layers.1.self_attn.kv_a_layernorm.weight",
        "model.layers.1.self_attn.q_a_layernorm.weight",
    ] {
        let t = v3
            .tensors()
            .unwrap()
            .into_iter()
            .find(|t| t.name == n)
            .unwrap();
        let mut b = vec![0u8; t.len_bytes() as usize];
        t.fill(1, 0.0, &mut b);
        let first = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
        assert!((first - 1.0).abs() < 0.5, "{n}: {first}");
    }
}

/// Overrides the runtime would refuse stop before a byte is written, naming the flag.
#[test]
fn overrides_the_runtime_would_refuse_are_refused_naming_the_flag() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("s");
    for (args, says) in [
        (
            vec!["--shape", "deepseek-v3", "--experts", "100"],
            vec!["--experts 100", "n_group 8", "multiple of 8, at least 16"],
        ),
        (
            vec!["--shape", "deepseek-v3", "--experts", "8"],
            vec!["--experts 8", "at least 16"],
        ),
        (
            vec!["--shape", "glm-4.5-air", "--experts", "1", "--top-k", "1"],
            vec!["--experts 1", "at least 2"],
        ),
        (
            vec![
                "--shape",
                "deepseek-v3",
                "--layers",
                "2",
                "--experts",
                "16",
                "--top-k",
                "9",
            ],
            vec!["--top-k 9", "num_experts_per_tok 9 exceeds the 8 experts"],
        ),
    ] {
        let mut a: Vec<&dyn AsRef<std::ffi::OsStr>> = vec![&"synth"];
        a.extend(args.iter().map(|x| x as &dyn AsRef<std::ffi::OsStr>));
        a.push(&out);
        let (code, _, err) = run(&a);
        assert_eq!(code, 2, "{args:?}: {err}");
        for s in says {
            assert!(err.contains(s), "{args:?}: {err:?} lacks {s:?}");
        }
        assert!(!out.exists());
    }
    // DeepSeek-V2's greedy router has one group: any expert count.
    let (code, _, err) = run(&[
        &"synth",
        &"--shape",
        &"tiny-deepseek-v2",
        &"--experts",
        &"7",
        &"--format",
        &"bundle",
        &out,
    ]);
    assert_eq!(code, 0, "{err}");
}
