"""Forward passes from Python: the CLI's logits bit for bit, the oracle's router choices, and the
same bits across batch and thread count."""

import numpy as np
import pytest
from safetensors.numpy import load_file

import tarfa
from conftest import run_bin

FAMILIES = ["olmoe-s", "qwen2moe-s", "mixtral-s"]


def prompts(ref):
    return [ref[k] for k in sorted(k for k in ref if k.startswith("prompt."))]


def test_logits_bit_identical_to_cli(bundle, reference, tmp_path):
    b = bundle("olmoe-s")
    prompt = reference("olmoe-s")["prompt.2"]
    out_file = tmp_path / "cli.safetensors"
    code, _, err = run_bin(
        "tarfa-run", "generate", b, "--tokens", ",".join(map(str, prompt)),
        "--max-new-tokens", "1", "--ignore-eos", "--prefill-logits", "--backend", "cpu",
        "--quiet", "--logits-out", out_file,
    )
    assert code == 0, err
    cli = load_file(str(out_file))["prefill_logits"]
    with tarfa.open(b, backend="cpu") as m:
        out = m.forward(prompt)
        vocab = m.config["vocab_size"]
    assert out.logits.dtype == np.float32
    assert out.logits.shape == cli.shape == (len(prompt), vocab)
    assert out.logits.tobytes() == cli.tobytes()
    assert out.exact and out.interventions == []


@pytest.mark.parametrize("family", FAMILIES)
def test_router_topk_equals_oracle(bundle, reference, family):
    ref = reference(family)
    with tarfa.open(bundle(family), backend="cpu") as m:
        for i, prompt in enumerate(prompts(ref)):
            out = m.forward(prompt)
            for moe_i, layer in enumerate(out.moe_layers):
                want = ref[f"prefill_router_topk.{i}.{moe_i}"]
                got = out.router_topk[layer]
                assert got.shape == want.shape
                # sets per token: transformers orders ties its own way
                assert (np.sort(got, axis=1) == np.sort(want, axis=1)).all(), (family, i, layer)
                w = out.router_weights[layer]
                assert w.dtype == np.float32 and w.shape == got.shape


def test_same_bits_across_batch_and_threads(bundle, reference):
    b = bundle("qwen2moe-s")
    ps = prompts(reference("qwen2moe-s"))[:3]
    with tarfa.open(b, backend="cpu", threads=1) as m1, tarfa.open(b, backend="cpu", threads=2) as m2:
        alone = [m1.forward(p) for p in ps]
        batched = m2.forward_batch(ps)
    for a, c in zip(alone, batched):
        assert a.logits.tobytes() == c.logits.tobytes()
        assert a.moe_layers == c.moe_layers
        for layer in a.moe_layers:
            assert (a.router_topk[layer] == c.router_topk[layer]).all()
            assert a.router_weights[layer].tobytes() == c.router_weights[layer].tobytes()


def test_open_reports_the_bundle(bundle):
    b = bundle("olmoe-s")
    manifest = (b / "manifest.toml").read_text()
    with tarfa.open(b, backend="cpu") as m:
        assert m.root_digest and m.root_digest in manifest
        assert m.config["num_hidden_layers"] == 2
        assert m.backend == "cpu"
