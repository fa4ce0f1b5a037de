"""Captures observe without changing a bit: the residual after the last layer, put through the
final norm and the lm_head in numpy, gives the logits; the residual, attention and MoE outputs,
router probabilities and expert outputs add up bit for bit as the contract says; captures are
the same bits across batch and thread count; unknown captures are refused by name."""

import json
import struct

import numpy as np
import pytest

import tarfa
from conftest import FIXTURES


def bf16_tensor(fixture, name):
    """One BF16 tensor of a fixture checkpoint, widened to f32 (numpy has no bfloat16)."""
    d = FIXTURES / fixture
    shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]
    raw = (d / shard).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    meta = json.loads(raw[8 : 8 + n])[name]
    assert meta["dtype"] == "BF16"
    lo, hi = meta["data_offsets"]
    bits = np.frombuffer(raw[8 + n + lo : 8 + n + hi], dtype="<u2").astype(np.uint32) << 16
    return bits.view(np.float32).reshape(meta["shape"])


def test_final_residual_reproduces_the_logits(bundle, reference):
    ref = reference("olmoe-s")
    prompt = ref["prompt.2"]
    with tarfa.open(bundle("olmoe-s"), backend="cpu") as m:
        cfg = m.config
        plain = m.forward(prompt)
        out = m.forward(prompt, capture=["residual"])
    n_layers = cfg["num_hidden_layers"]
    assert sorted(out.residual) == list(range(n_layers + 1))
    assert out.logits.tobytes() == plain.logits.tobytes(), "a capture changes no bit"
    h = out.residual[n_layers].astype(np.float64)
    assert h.shape == (len(prompt), cfg["hidden_size"])
    w_norm = bf16_tensor("olmoe-s", "model.norm.weight").astype(np.float64)
    w_lm = bf16_tensor("olmoe-s", "lm_head.weight").astype(np.float64)
    hn = h / np.sqrt((h * h).mean(axis=1, keepdims=True) + cfg["rms_norm_eps"]) * w_norm
    logits = hn @ w_lm.T
    # f64 in numpy against the contract's f32 order: close, not equal
    np.testing.assert_allclose(logits, out.logits, rtol=1e-4, atol=1e-4)
    # the residual entering layer 0 is the embedding row of each token
    emb = bf16_tensor("olmoe-s", "model.embed_tokens.weight")
    assert out.residual[0].tobytes() == emb[np.asarray(prompt)].tobytes()


def test_residual_same_bits_across_batch_threads_and_layers(bundle, reference):
    ref = reference("mixtral-s")
    ps = [ref["prompt.1"], ref["prompt.2"]]
    b = bundle("mixtral-s")
    with tarfa.open(b, backend="cpu", threads=1) as m1, tarfa.open(b, backend="cpu", threads=2) as m2:
        alone = [m1.forward(p, capture=["residual"]) for p in ps]
        batched = m2.forward_batch(ps, capture=["residual"])
        one_layer = m2.forward(ps[1], capture=["residual"], layers=[1])
    for a, c in zip(alone, batched):
        assert sorted(a.residual) == sorted(c.residual)
        for layer in a.residual:
            assert a.residual[layer].tobytes() == c.residual[layer].tobytes()
    assert list(one_layer.residual) == [1]
    assert one_layer.residual[1].tobytes() == alone[1].residual[1].tobytes()


def test_unknown_captures_and_bad_layers_are_refused(bundle):
    with tarfa.open(bundle("olmoe-s"), backend="cpu") as m:
        with pytest.raises(tarfa.InputError, match="unknown capture 'resid'"):
            m.forward([1, 2], capture=["resid"])
        with pytest.raises(tarfa.InputError, match="layers: 9 is not a layer"):
            m.forward([1, 2], capture=["residual"], layers=[9])


def test_router_logits_rank_the_chosen_experts(bundle, reference):
    prompt = reference("qwen2moe-s")["prompt.2"]
    with tarfa.open(bundle("qwen2moe-s"), backend="cpu") as m:
        plain = m.forward(prompt)
        out = m.forward(prompt, capture=["router_logits"])
        n_experts = m.config["num_experts"]
    assert out.logits.tobytes() == plain.logits.tobytes(), "a capture changes no bit"
    assert sorted(out.router_logits) == out.moe_layers
    for layer in out.moe_layers:
        lg = out.router_logits[layer]
        topk = out.router_topk[layer]
        assert lg.dtype == np.float32 and lg.shape == (len(prompt), n_experts)
        # the softmax is monotone: the k largest logits are the k experts chosen
        k = topk.shape[1]
        best = np.argsort(-lg, axis=1, kind="stable")[:, :k]
        assert (np.sort(best, axis=1) == np.sort(topk, axis=1)).all(), layer


ALL = ["residual", "attn_out", "moe_out", "router_logits", "router_probs", "expert_out"]


def test_block_outputs_add_up_to_the_residual_bit_for_bit(bundle, reference):
    prompt = reference("olmoe-s")["prompt.2"]
    with tarfa.open(bundle("olmoe-s"), backend="cpu") as m:
        plain = m.forward(prompt)
        out = m.forward(prompt, capture=ALL)
        n_layers = m.config["num_hidden_layers"]
    assert out.logits.tobytes() == plain.logits.tobytes(), "captures change no bit"
    for layer in range(n_layers):
        # h' = (h + attn_out) + moe_out, each an f32 add (EXACTNESS section 6)
        h = out.residual[layer] + out.attn_out[layer]
        h = h + out.moe_out[layer]
        assert h.tobytes() == out.residual[layer + 1].tobytes(), f"layer {layer}"


def test_expert_outputs_mix_into_the_moe_output_and_probs_match_the_records(bundle, reference):
    prompt = reference("olmoe-s")["prompt.3"]
    with tarfa.open(bundle("olmoe-s"), backend="cpu") as m:
        out = m.forward(prompt, capture=["moe_out", "router_probs", "router_logits", "expert_out"])
    n = len(prompt)
    for layer in out.moe_layers:
        ids, w = out.router_topk[layer], out.router_weights[layer]
        y = out.expert_out[layer]
        assert y.shape == (n, ids.shape[1], out.moe_out[layer].shape[1])
        # acc = +0; acc = acc + w_e * y_e in ascending expert id (OLMoE has no shared expert)
        acc = np.zeros(out.moe_out[layer].shape, dtype=np.float32)
        for t in range(n):
            for j in np.argsort(ids[t], kind="stable"):
                acc[t] = acc[t] + np.float32(w[t, j]) * y[t, j]
        assert acc.tobytes() == out.moe_out[layer].tobytes(), f"layer {layer}"
        p = out.router_probs[layer]
        assert p.shape == out.router_logits[layer].shape
        # the chosen experts' probabilities are the records' own, bit for bit
        chosen = np.take_along_axis(p, ids, axis=1)
        assert chosen.tobytes() == out.router_topk_probs[layer].tobytes()
        assert np.allclose(p.sum(axis=1), 1.0, atol=1e-5)
        lg = out.router_logits[layer].astype(np.float64)
        soft = np.exp(lg - lg.max(axis=1, keepdims=True))
        soft /= soft.sum(axis=1, keepdims=True)
        assert np.allclose(p, soft, rtol=1e-5, atol=1e-7)


def test_every_capture_is_the_same_bits_in_a_batch_and_with_layers_selected(bundle, reference):
    ref = reference("olmoe-s")
    a, b = ref["prompt.1"], ref["prompt.2"]
    with tarfa.open(bundle("olmoe-s"), backend="cpu") as m:
        alone = m.forward(b, capture=ALL)
        batched = m.forward_batch([a, b], capture=ALL)[1]
        one = m.forward(b, capture=ALL, layers=[1])
    for name in ALL:
        x, y = getattr(alone, name), getattr(batched, name)
        assert sorted(x) == sorted(y), name
        for layer in x:
            assert x[layer].tobytes() == y[layer].tobytes(), f"{name} layer {layer}"
        assert sorted(getattr(one, name)) == [1], name
        assert getattr(one, name)[1].tobytes() == x[1].tobytes(), name
