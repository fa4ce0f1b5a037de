"""The second wave of independent oracle fixtures: tiny random MoE checkpoints built and run by
Hugging Face transformers (same method and outputs as make_oracle.py), for the next
architectures: DeepSeek-V3/V2, GLM-4.5 MoE, gpt-oss, Qwen3-Next, Qwen3.5 MoE and Llama 4.

Router choices are captured with forward hooks on each MoE block's router module, so models
without output_router_logits are covered too. Buffers that random init leaves at zero but that
trained checkpoints carry (e_score_correction_bias, attention sinks, expert biases) are
randomised before saving, so that the fixture exercises them.

Usage: python3 make_oracle2.py OUTDIR [name ...]

(Tarfa's copy of the shared oracle's make_oracle2.py, with configs added that exercise what the
shared fixtures do not, and small twins that ship in fixtures/oracle so that a fresh clone checks
these families: `deepseekv3-s` (the V3 semantics at hidden 64), `deepseekv3-plain-s` (no q LoRA,
rotate-half rope without interleave, default rope, no renormalisation, one group), `deepseekv2-yarn-s`
(V2 with q LoRA, YaRN with mscale = mscale_all_dim = 0.707 as DeepSeek-V2-Lite writes it,
group_limited_greedy routing, routed scaling 16), `qwen3moe-yarn-s` (Qwen3-MoE with YaRN and no
mscale keys, so the attention factor scales cos and sin) and `glm4moe-s` (glm4moe-a at hidden 64).
Run it on the GPU machine: python3 make_oracle2.py OUTDIR deepseekv3-s ...; shards are 128 KB.)
"""
import json, os, sys, time, traceback

import torch
import transformers
from safetensors.torch import save_file, load_file

OUT = sys.argv[1]
ONLY = set(sys.argv[2:])
COMMON = dict(rms_norm_eps=1e-6, attention_dropout=0.0)

YARN_DS = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
           "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
           "rope_theta": 10000.0}
YARN_GPTOSS = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 64,
               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0}

CONFIGS = {
    "deepseekv3-a": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=48,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=16, routed_scaling_factor=2.5, kv_lora_rank=32,
        q_lora_rank=64, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, n_group=4,
        topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1, norm_topk_prob=True,
        rope_interleave=True, rope_parameters=dict(YARN_DS), max_position_embeddings=512,
        tie_word_embeddings=False, initializer_range=0.06, **COMMON)),
    "deepseekv2-a": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=48,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=2, n_routed_experts=16, routed_scaling_factor=1.0, kv_lora_rank=32,
        q_lora_rank=None, qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32,
        topk_method="greedy", n_group=1, topk_group=1, num_experts_per_tok=4,
        first_k_dense_replace=1, norm_topk_prob=False, max_position_embeddings=512,
        tie_word_embeddings=False, initializer_range=0.06, **COMMON)),
    "glm4moe-a": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=48,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
        n_shared_experts=1, n_routed_experts=16, routed_scaling_factor=1.8, n_group=1,
        topk_group=1, num_experts_per_tok=4, first_k_dense_replace=1, norm_topk_prob=True,
        rope_theta=1000000.0, max_position_embeddings=512, tie_word_embeddings=False,
        initializer_range=0.06, **COMMON)),
    "gptoss-a": ("GptOssConfig", "GptOssForCausalLM", dict(
        vocab_size=512, hidden_size=128, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=16, rope_parameters=dict(YARN_GPTOSS),
        layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=512,
        tie_word_embeddings=False, initializer_range=0.06, **COMMON)),
    "qwen3next-a": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=48,
        shared_expert_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        full_attention_interval=4, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
        partial_rotary_factor=0.25, decoder_sparse_step=1, mlp_only_layers=[],
        rope_theta=10000000.0, max_position_embeddings=512, tie_word_embeddings=False,
        initializer_range=0.06, **COMMON)),
    "qwen35moe-a": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        moe_intermediate_size=48, shared_expert_intermediate_size=64, num_experts=16,
        num_experts_per_tok=4, max_position_embeddings=512, tie_word_embeddings=False,
        initializer_range=0.06, **COMMON)),
    "llama4-a": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        vocab_size=512, hidden_size=128, intermediate_size=64, intermediate_size_mlp=256,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=1,
        attention_chunk_size=16, no_rope_layers=[1, 1, 1, 0], use_qk_norm=True,
        max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.06,
        rope_theta=500000.0, **COMMON)),
    "deepseekv3-s": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16,
        q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, head_dim=8,
        n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
        norm_topk_prob=True, rope_interleave=True, rope_parameters=dict(YARN_DS),
        max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.06, **COMMON)),
    "deepseekv3-plain-s": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        n_shared_experts=2, n_routed_experts=8, routed_scaling_factor=1.5, kv_lora_rank=24,
        q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=24, head_dim=8,
        n_group=1, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        norm_topk_prob=False, rope_interleave=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.06, **COMMON)),
    "deepseekv2-yarn-s": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=2, n_routed_experts=8, routed_scaling_factor=16.0, kv_lora_rank=16,
        q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, head_dim=8,
        topk_method="group_limited_greedy", n_group=4, topk_group=2, num_experts_per_tok=3,
        first_k_dense_replace=1, norm_topk_prob=False,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "rope_theta": 10000.0},
        max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.06, **COMMON)),
    "qwen3moe-yarn-s": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 128,
                                             "rope_theta": 1000000.0},
        max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.06, **COMMON)),
    "glm4moe-s": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
        n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=1.8, n_group=1,
        topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
        rope_theta=1000000.0, max_position_embeddings=512, tie_word_embeddings=False,
        initializer_range=0.06, **COMMON)),
}
SMALL = {"deepseekv3-s", "deepseekv3-plain-s", "deepseekv2-yarn-s", "qwen3moe-yarn-s", "glm4moe-s"}
SEEDS = {'deepseekv3-a': 2000, 'deepseekv2-a': 2001, 'glm4moe-a': 2002, 'gptoss-a': 2003, 'qwen3next-a': 2004, 'qwen35moe-a': 3000, 'llama4-a': 3002,
         'deepseekv3-s': 4000, 'deepseekv3-plain-s': 4001, 'deepseekv2-yarn-s': 4002,
         'qwen3moe-yarn-s': 4003, 'glm4moe-s': 4004}

PROMPT_LENS = [1, 7, 33, 100]
NEW_TOKENS = 24
RANDOMISE = ("e_score_correction_bias", "sinks", "gate_up_proj_bias", "down_proj_bias", "router.bias",
             "dt_bias", "A_log")


def router_hooks(model, n_experts, k):
    """Hooks on each MoE router; each forward appends that layer's top-k ids ([tokens, k])."""
    calls, handles = [], []
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in ("gate", "router") or ".mlp" not in name:
            continue
        if isinstance(mod, torch.nn.Linear) and mod.out_features != n_experts:
            continue
        li = int(name.split("layers.")[1].split(".")[0])

        def hook(m, inp, out, li=li):
            outs = out if isinstance(out, (tuple, list)) else (out,)
            ids = next((o for o in outs if torch.is_tensor(o) and not o.is_floating_point()), None)
            if ids is None:
                logits = next(o for o in outs if torch.is_tensor(o) and o.shape[-1] == n_experts)
                ids = torch.topk(logits.float().reshape(-1, n_experts), k, dim=-1).indices
            calls.append((li, ids.reshape(-1, ids.shape[-1]).to(torch.int64).cpu()))
        handles.append(mod.register_forward_hook(hook))
    return calls, handles


def greedy(model, prompt, n_new):
    ids = torch.tensor([prompt], device=model.device)
    out = model(input_ids=ids, use_cache=True)
    past = out.past_key_values
    step_logits, tokens = [], []
    logits = out.logits[0, -1].float()
    prefill = out.logits[0].float().cpu()
    for _ in range(n_new):
        step_logits.append(logits.cpu())
        nxt = int(torch.argmax(logits))
        tokens.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]], device=model.device), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
    return tokens, torch.stack(step_logits), prefill


def build(name, cfg_cls, model_cls, kw, seed):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    cfg = getattr(transformers, cfg_cls)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for pname, t in list(model.named_parameters()) + list(model.named_buffers()):
            if any(pname.endswith(r) for r in RANDOMISE) and t.is_floating_point():
                t.copy_(torch.randn_like(t, dtype=torch.float32).mul_(0.1).to(t.dtype))
    model.save_pretrained(d, safe_serialization=True,
                          max_shard_size="128KB" if name in SMALL else "1MB")
    keys = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            for k, v in load_file(os.path.join(d, f)).items():
                keys[k] = [list(v.shape), str(v.dtype), f]
    print(name, "saved", len(keys), "tensors; layer-1 keys:",
          sorted(k for k in keys if ".layers.1." in k)[:14], flush=True)

    n_exp = kw.get("n_routed_experts") or kw.get("num_experts") or kw.get("num_local_experts")
    k = kw.get("num_experts_per_tok", 2)
    g = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(0, kw["vocab_size"], (n,), generator=g).tolist() for n in PROMPT_LENS]
    ref = {}
    summary = {"transformers": transformers.__version__, "torch": torch.__version__,
               "config": cfg.to_dict(), "prompts": prompts, "fp32_cpu": [], "bf16_gpu": []}
    m32 = getattr(transformers, model_cls).from_pretrained(d, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    calls, handles = router_hooks(m32, n_exp, k)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            calls.clear()
            ids = torch.tensor([p])
            prefill_out = m32(input_ids=ids, use_cache=False)
            routed = {}
            for li, t in calls:
                routed.setdefault(li, t)
            for j, li in enumerate(sorted(routed)):
                ref[f"prefill_router_topk.{i}.{j}"] = routed[li].contiguous()
            calls.clear()
            toks, logits, prefill = greedy(m32, p, NEW_TOKENS)
            if not torch.equal(prefill, prefill_out.logits[0].float()):
                print(name, "note: prefill logits with and without cache differ", flush=True)
            summary["fp32_cpu"].append(toks)
            ref[f"prompt.{i}"] = torch.tensor(p, dtype=torch.int64)
            ref[f"greedy.{i}"] = torch.tensor(toks, dtype=torch.int64)
            ref[f"step_logits.{i}"] = logits.contiguous()
            ref[f"prefill_logits.{i}"] = prefill.contiguous()
    for h in handles:
        h.remove()
    summary["router_layers"] = len([x for x in ref if x.startswith("prefill_router_topk.0.")])
    if torch.cuda.is_available():
        mb = getattr(transformers, model_cls).from_pretrained(d, dtype=torch.bfloat16,
                                                              attn_implementation="eager").cuda().eval()
        with torch.no_grad():
            for i, p in enumerate(prompts):
                toks, _, _ = greedy(mb, p, NEW_TOKENS)
                summary["bf16_gpu"].append(toks)
    save_file(ref, os.path.join(d, "reference.safetensors"))
    json.dump(summary, open(os.path.join(d, "reference.json"), "w"), indent=1)
    agree = [sum(a == b for a, b in zip(x, y)) for x, y in zip(summary["fp32_cpu"], summary["bf16_gpu"])]
    print(name, "fp32 greedy", summary["fp32_cpu"][1][:8], "router layers", summary["router_layers"],
          "bf16 agrees on", agree, flush=True)


if __name__ == "__main__":
    print("transformers", transformers.__version__, "torch", torch.__version__, flush=True)
    for seed, (name, (c, m, kw)) in enumerate(CONFIGS.items()):
        if ONLY and name not in ONLY:
            continue
        t = time.time()
        try:
            build(name, c, m, kw, SEEDS[name])
        except Exception:
            traceback.print_exc()
        print(name, "took", round(time.time() - t, 1), "s", flush=True)
