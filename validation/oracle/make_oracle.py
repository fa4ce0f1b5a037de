"""Independent oracle: tiny random MoE checkpoints built and run by Hugging Face transformers.

(Tarfa's copy of the shared oracle's make_oracle.py, with two Qwen3-MoE configs added that
exercise the config paths the shared fixtures do not: dense layers through mlp_only_layers and
decoder_sparse_step, norm_topk_prob false, tied embeddings, a top-level rope_theta, and sizes that
are not multiples of 32. Run it on the GPU machine: python3 make_oracle.py OUTDIR qwen3moe-dense
qwen3moe-odd. Issue 22 adds mixtral-window-s (sliding_window 8) and olmoe-clip-s (clip_qkv 0.5):
python3 make_oracle.py OUTDIR mixtral-window-s olmoe-clip-s, then copy both into fixtures/oracle;
and llama4-dense-s (Llama 4's dense layers, top-2, active temperature tuning):
python3 make_oracle.py OUTDIR llama4-dense-s; and llama4-llama3-s (Llama 4 with llama3 rope scaling).)

For each config: save a sharded BF16 safetensors checkpoint (hub layout), then record, with
transformers' own forward pass in float32 on the CPU (bf16 weights upcast exactly), the greedy
continuation of several prompts, every step's last-position logits, the full prefill logits and
each layer's router top-k. A bf16 GPU run records its greedy tokens too.

Usage: python3 make_oracle.py OUTDIR [name ...]
"""
import json, os, sys, time, traceback

import torch
import transformers
from safetensors.torch import save_file, load_file

OUT = sys.argv[1]
ONLY = set(sys.argv[2:])

COMMON = dict(rms_norm_eps=1e-6, max_position_embeddings=4096, attention_dropout=0.0)

CONFIGS = {
    # Qwen3-MoE semantics at toy size: softmax router, native top-8, normalised top-k probs.
    "qwen3moe-a": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=32, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False, rope_theta=1000000.0,
        initializer_range=0.06, **COMMON)),
    "mixtral-a": ("MixtralConfig", "MixtralForCausalLM", dict(
        vocab_size=512, hidden_size=128, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
        tie_word_embeddings=False, rope_theta=1000000.0, initializer_range=0.06, **COMMON)),
    "qwen2moe-a": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        shared_expert_intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        rope_theta=1000000.0, initializer_range=0.06, **COMMON)),
    "olmoe-a": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        vocab_size=512, hidden_size=128, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, num_experts=16, num_experts_per_tok=8,
        norm_topk_prob=False, tie_word_embeddings=False, rope_theta=10000.0,
        initializer_range=0.06, **COMMON)),
    # Dense layers: decoder_sparse_step=2 makes layers 0 and 2 dense, mlp_only_layers makes 3 dense.
    "qwen3moe-dense": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=384, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=2,
        mlp_only_layers=[3], tie_word_embeddings=False, rope_theta=1000000.0,
        initializer_range=0.06, **COMMON)),
    # No renormalisation, tied embeddings, rope_theta moved to the top level of config.json
    # (older releases' spelling), and no dimension a multiple of 32.
    "qwen3moe-odd": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=300, hidden_size=72, intermediate_size=88, moe_intermediate_size=40,
        num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1, head_dim=24,
        num_experts=12, num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=True, rope_theta=50000.0,
        initializer_range=0.06, **COMMON)),
    # Small twins of mixtral-a, qwen2moe-a and olmoe-a, kept in the repository (fixtures/oracle) so
    # that a fresh clone checks every family against transformers; the -a ones stay in the shared
    # oracle. Same semantics, a quarter of the bytes; shards of 128 KB so that experts still span
    # several files.
    "mixtral-s": ("MixtralConfig", "MixtralForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, tie_word_embeddings=False, rope_theta=1000000.0,
        initializer_range=0.06, **COMMON)),
    "qwen2moe-s": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=4, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        rope_theta=1000000.0, initializer_range=0.06, **COMMON)),
    "olmoe-s": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=4,
        norm_topk_prob=False, tie_word_embeddings=False, rope_theta=10000.0,
        initializer_range=0.06, **COMMON)),
    # Issue 22's config features, on the small twins (appended last: the seeds of the configs
    # above, which follow the order, stay as they were). Mixtral applies sliding_window to every
    # layer; 8 is shorter than the 33- and 100-token prompts. clip_qkv 0.5 clamps a good part of
    # OLMoE's q/k/v at this initialisation (their spread is about 0.06 x sqrt(64)).
    "mixtral-window-s": ("MixtralConfig", "MixtralForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, tie_word_embeddings=False, rope_theta=1000000.0,
        sliding_window=8, initializer_range=0.06, **COMMON)),
    "olmoe-clip-s": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=4,
        norm_topk_prob=False, tie_word_embeddings=False, rope_theta=10000.0, clip_qkv=0.5,
        initializer_range=0.06, **COMMON)),
    # Llama 4 (text) paths the shared llama4-a leaves unexercised: dense layers between MoE
    # layers (interleave_moe_layer_step 2: layers 1 and 3 MoE, 0 and 2 dense MLPs of
    # intermediate_size_mlp), top-2 (two input-scaled experts summed), two NoPE layers whose
    # temperature tuning is active from position 3 on (floor_scale 4; llama4-a's 8192 keeps
    # it at exactly 1), chunks of 8, and attention bias tensors (zero at this initialisation:
    # they are loaded and added, not exercised).
    "llama4-dense-s": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=8, num_experts_per_tok=2, interleave_moe_layer_step=2,
        attention_chunk_size=8, no_rope_layers=[1, 0, 1, 0], use_qk_norm=True,
        attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1, attention_bias=True,
        tie_word_embeddings=False, rope_theta=500000.0, initializer_range=0.06, **COMMON)),
    # Llama 4 with Scout's kind of rope scaling (llama3), original context 64 so that all
    # three bands (kept, divided by the factor, interpolated) occur at head_dim 32.
    "llama4-llama3-s": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        vocab_size=256, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_local_experts=4, num_experts_per_tok=1, attention_chunk_size=16,
        no_rope_layers=[1, 0], use_qk_norm=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
        initializer_range=0.06, **COMMON)),
}

# Configs whose saved config.json gets rope_theta at the top level instead of rope_parameters.
TOPLEVEL_ROPE = {"qwen3moe-odd"}

# Configs saved in smaller shards than the default 1 MB.
SHARD_SIZE = {"mixtral-s": "128KB", "qwen2moe-s": "128KB", "olmoe-s": "128KB",
              "mixtral-window-s": "128KB", "olmoe-clip-s": "128KB", "llama4-dense-s": "128KB",
              "llama4-llama3-s": "128KB"}

PROMPT_LENS = [1, 7, 33, 100]
NEW_TOKENS = 24


def greedy(model, prompt, n_new, want_router):
    """Token-by-token greedy decode with a KV cache; returns tokens, per-step logits, router top-k."""
    ids = torch.tensor([prompt], device=model.device)
    out = model(input_ids=ids, use_cache=True, output_router_logits=want_router)
    past = out.past_key_values
    step_logits, tokens, routers = [], [], []
    logits = out.logits[0, -1].float()
    prefill = out.logits[0].float().cpu()
    if want_router and getattr(out, "router_logits", None) is not None:
        routers.append([r.float().cpu() for r in out.router_logits if r is not None])
    for _ in range(n_new):
        step_logits.append(logits.cpu())
        nxt = int(torch.argmax(logits))
        tokens.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]], device=model.device), past_key_values=past,
                    use_cache=True, output_router_logits=want_router)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
        if want_router and getattr(out, "router_logits", None) is not None:
            routers.append([r.float().cpu() for r in out.router_logits if r is not None])
    return tokens, torch.stack(step_logits), prefill, routers


def build(name, cfg_cls, model_cls, kw, seed):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    cfg = getattr(transformers, cfg_cls)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).to(torch.bfloat16).eval()
    model.save_pretrained(d, safe_serialization=True, max_shard_size=SHARD_SIZE.get(name, "1MB"))
    if name in TOPLEVEL_ROPE:
        cpath = os.path.join(d, "config.json")
        c = json.load(open(cpath))
        theta = (c.pop("rope_parameters", None) or {}).get("rope_theta", kw["rope_theta"])
        c.pop("rope_scaling", None)
        c["rope_theta"] = theta
        json.dump(c, open(cpath, "w"), indent=2)
        print(name, "config.json rewritten with top-level rope_theta", theta, flush=True)
    keys = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            for k, v in load_file(os.path.join(d, f)).items():
                keys[k] = [list(v.shape), str(v.dtype), f]
    json.dump(keys, open(os.path.join(d, "saved_keys.json"), "w"), indent=1, sort_keys=True)
    print(name, "saved", len(keys), "tensors; sample keys:", sorted(keys)[:6], flush=True)

    g = torch.Generator().manual_seed(seed + 1)
    prompts = [torch.randint(0, kw["vocab_size"], (n,), generator=g).tolist() for n in PROMPT_LENS]
    ref = {}
    summary = {"transformers": transformers.__version__, "torch": torch.__version__,
               "config": cfg.to_dict(), "prompts": prompts, "fp32_cpu": [], "bf16_gpu": []}
    # float32 compute on the CPU, weights loaded from the saved BF16 files and upcast exactly
    m32 = getattr(transformers, model_cls).from_pretrained(d, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    torch.use_deterministic_algorithms(True)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            toks, logits, prefill, routers = greedy(m32, p, NEW_TOKENS, want_router=True)
            summary["fp32_cpu"].append(toks)
            ref[f"prompt.{i}"] = torch.tensor(p, dtype=torch.int64)
            ref[f"greedy.{i}"] = torch.tensor(toks, dtype=torch.int64)
            wide = kw["vocab_size"] > 4096  # keep the files small: fewer full-vocabulary vectors
            ref[f"step_logits.{i}"] = (logits[:4] if wide else logits).contiguous()
            ref[f"prefill_logits.{i}"] = (prefill[-1:] if wide else prefill).contiguous()
            k = kw.get("num_experts_per_tok", 2)
            for li, layer in enumerate(routers[0] if routers else []):
                ref[f"prefill_router_topk.{i}.{li}"] = torch.topk(layer, k, dim=-1).indices.to(torch.int64).contiguous()
    # bf16 everywhere on the GPU, as the model's authors would run it
    if torch.cuda.is_available():
        mb = getattr(transformers, model_cls).from_pretrained(d, dtype=torch.bfloat16,
                                                              attn_implementation="eager").cuda().eval()
        with torch.no_grad():
            for i, p in enumerate(prompts):
                toks, _, _, _ = greedy(mb, p, NEW_TOKENS, want_router=False)
                summary["bf16_gpu"].append(toks)
    save_file(ref, os.path.join(d, "reference.safetensors"))
    json.dump(summary, open(os.path.join(d, "reference.json"), "w"), indent=1)
    agree = [sum(a == b for a, b in zip(x, y)) for x, y in zip(summary["fp32_cpu"], summary["bf16_gpu"])]
    print(name, "fp32 greedy", summary["fp32_cpu"][1][:8], "bf16 agrees on", agree, flush=True)


if __name__ == "__main__":
    print("transformers", transformers.__version__, "torch", torch.__version__, flush=True)
    for seed, (name, (c, m, kw)) in enumerate(CONFIGS.items()):
        if ONLY and name not in ONLY:
            continue
        t = time.time()
        try:
            build(name, c, m, kw, 1000 + seed)
        except Exception:
            traceback.print_exc()
        print(name, "took", round(time.time() - t, 1), "s", flush=True)
