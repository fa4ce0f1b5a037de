"""Hugging Face transformers, BF16, on the GPU machine: the baseline for issue 23's figures, on
the same synthetic shape as `tarfa-convert synth --shape qwen3.5-35b-a3b --layers N`
(Qwen3.5-35B-A3B's text model, its first N layers: three gated DeltaNet layers to one gated
full-attention layer, 256 experts top-8, random weights). transformers' own linear attention
(the torch chunked/recurrent fallbacks; no flash-linear-attention or causal-conv1d on the
machine) is the baseline that is there.

    python3 validation/gpu/hf_qwen35.py [LAYERS=4] [OUT_JSON]

Prints one JSON line: decode tok/s at batch 1 after a 128-token prompt (greedy, 32 new tokens,
the prefill subtracted by also timing a 1-token generation), and prefill tok/s at 512 tokens.
"""
import json, sys, time

import torch
import transformers
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
cfg = Qwen3_5MoeTextConfig(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=layers, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention")
                 for i in range(layers)],
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                     "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                     "mrope_interleaved": True},
    rms_norm_eps=1e-6, tie_word_embeddings=False)
torch.manual_seed(0)
with torch.device("cuda"):
    model = Qwen3_5MoeForCausalLM(cfg).to(torch.bfloat16).eval()
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
    full = min(timed_generate(prompt, 32) for _ in range(2))
    decode = 31 / (full - one)
    timed_prefill(128)
    p128 = 128 / min(timed_prefill(128) for _ in range(2))
    p512 = 512 / min(timed_prefill(512) for _ in range(2))
res = {"engine": f"transformers {transformers.__version__} torch {torch.__version__} bf16",
       "layers": layers, "decode_tok_s": decode, "prefill_128_tok_s": p128,
       "prefill_512_tok_s": p512,
       "params_b": sum(p.numel() for p in model.parameters()) / 1e9}
print(json.dumps(res))
if len(sys.argv) > 2:
    json.dump(res, open(sys.argv[2], "w"))
