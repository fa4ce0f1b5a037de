"""Hugging Face transformers, BF16, on the GPU machine: issue 17's baseline, measured in the same
device call as Tarfa's many-token figures (validation/gpu/many.sh), on the same synthetic shape
(Qwen3-30B-A3B, first LAYERS layers, random weights; hf_baseline.py's model).

    python3 validation/gpu/hf_many.py [LAYERS=16] [OUT_JSON] [SHAPE=qwen3-30b-a3b|qwen3-235b-a22b]

Prints one JSON line: prefill tok/s at 128, 512, 2048 and 8192 tokens (one forward with the
last row's logits only, `logits_to_keep=1` as generate's prefill computes them; best of 2),
and batched greedy decode tok/s at B = 1, 8, 32 and 128 sequences of 128-token prompts (all
sequences' new tokens per second: 32 new tokens, the prefill and first token subtracted by also
timing a 1-token generation).
"""
import json, sys, time

import torch
import transformers
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 16
shape = sys.argv[3] if len(sys.argv) > 3 else "qwen3-30b-a3b"
# the shapes of tarfa-convert synth (Qwen3-30B-A3B's and Qwen3-235B-A22B's configs)
hidden, moe_width, heads = {"qwen3-30b-a3b": (2048, 768, 32),
                            "qwen3-235b-a22b": (4096, 1536, 64)}[shape]
cfg = Qwen3MoeConfig(
    vocab_size=151936, hidden_size=hidden, intermediate_size=3 * hidden,
    moe_intermediate_size=moe_width, num_hidden_layers=layers, num_attention_heads=heads,
    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
    rope_theta=1e6, tie_word_embeddings=False, rms_norm_eps=1e-6)
torch.manual_seed(0)
with torch.device("cuda"):
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()
g = torch.Generator(device="cuda").manual_seed(1)


def timed(f):
    torch.cuda.synchronize()
    t = time.perf_counter()
    f()
    torch.cuda.synchronize()
    return time.perf_counter() - t


res = {"engine": f"transformers {transformers.__version__} torch {torch.__version__} bf16",
       "shape": shape, "layers": layers, "prefill": {}, "batched_decode": {}}
with torch.no_grad():
    for n in (128, 512, 2048, 8192):
        ids = torch.randint(0, cfg.vocab_size, (1, n), device="cuda", generator=g)
        fwd = lambda: model(input_ids=ids, use_cache=True, logits_to_keep=1)
        timed(fwd)  # warm-up
        s = min(timed(fwd) for _ in range(2))
        res["prefill"][str(n)] = n / s
    for b in (1, 8, 32, 128):
        prompt = torch.randint(0, cfg.vocab_size, (b, 128), device="cuda", generator=g)
        mask = torch.ones_like(prompt)
        gen = lambda n: model.generate(prompt, attention_mask=mask, max_new_tokens=n,
                                       min_new_tokens=n, do_sample=False, pad_token_id=0)
        timed(lambda: gen(2))  # warm-up
        one = min(timed(lambda: gen(1)) for _ in range(2))
        full = timed(lambda: gen(32))
        res["batched_decode"][str(b)] = b * 31 / (full - one)
print(json.dumps(res))
if len(sys.argv) > 2:
    json.dump(res, open(sys.argv[2], "w"))
