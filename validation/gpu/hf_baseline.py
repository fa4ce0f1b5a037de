"""Hugging Face transformers, BF16, on the GPU machine: the baseline Tarfa's CUDA figures are
compared with, on the same synthetic shape (Qwen3-30B-A3B, first N layers, random weights).

    python3 validation/gpu/hf_baseline.py [LAYERS=16] [OUT_JSON]

Prints one JSON line: decode tok/s at batch 1 after a 128-token prompt (greedy, 64 new tokens,
the prefill subtracted by also timing a 1-token generation), and prefill tok/s at 512 and 2048.
"""
import json, sys, time

import torch
import transformers
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 16
cfg = Qwen3MoeConfig(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False,
    rms_norm_eps=1e-6)
torch.manual_seed(0)
with torch.device("cuda"):
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
g = torch.Generator(device="cuda").manual_seed(1)


def timed_generate(prompt, n):
    torch.cuda.synchronize()
    t = time.perf_counter()
    model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def timed_prefill(n):
    ids = torch.randint(0, cfg.vocab_size, (1, n), device="cuda", generator=g)
    torch.cuda.synchronize()
    t = time.perf_counter()
    model(input_ids=ids, use_cache=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t


with torch.no_grad():
    prompt = torch.randint(0, cfg.vocab_size, (1, 128), device="cuda", generator=g)
    timed_generate(prompt, 4)  # warm-up
    one = min(timed_generate(prompt, 1) for _ in range(2))
    full = min(timed_generate(prompt, 64) for _ in range(2))
    decode = 63 / (full - one)
    timed_prefill(512)
    p512 = 512 / min(timed_prefill(512) for _ in range(2))
    p2048 = 2048 / min(timed_prefill(2048) for _ in range(2))
res = {"engine": f"transformers {transformers.__version__} torch {torch.__version__} bf16",
       "layers": layers, "decode_tok_s": decode, "prefill_512_tok_s": p512,
       "prefill_2048_tok_s": p2048,
       "params_b": sum(p.numel() for p in model.parameters()) / 1e9}
print(json.dumps(res))
if len(sys.argv) > 2:
    json.dump(res, open(sys.argv[2], "w"))
