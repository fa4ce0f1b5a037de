"""Captures identical across batch, threads and backends (mock device): the same bundle on the CPU
at 1 and 2 threads and on the CUDA backend over tarfa-cuda's mock device (``backend="cuda-mock"``,
test-only: host memory, the kernels' reference functions) gives the same bits for every capture,
the logits and the routes, each sequence alone and inside a batch, and for a layer selection.
Interventions on CUDA are refused by name.

A build without the mock device (a release wheel) skips the CUDA arm, saying why;
TARFA_EXPECT_WHEEL=1 (CI, whose wheel has tarfa-cuda's mock-device feature) makes that a failure."""

import os
import re

import numpy as np
import pytest

import tarfa

# every capture the package offers (an unknown one is refused, so none can be left out here)
CAPTURES = tarfa._CAPTURES
ROUTES = ("router_topk", "router_weights", "router_topk_probs")

# Every fixture of fixtures/oracle: each family and variant the CUDA kernels run (Qwen3-MoE with
# dense layers, odd sizes, YaRN; DeepSeek-V2/V3's MLA and group-limited routers; GLM-4.5; Llama 4
# with dense layers; Mixtral with its window; OLMoE with clip_qkv; Qwen2-MoE's gated shared
# expert), and the trained demo model.
FAMILIES = [
    "qwen3moe-a",
    "qwen3moe-code",
    "qwen3moe-dense",
    "qwen3moe-odd",
    "qwen3moe-yarn-s",
    "deepseekv2-yarn-s",
    "deepseekv3-plain-s",
    "deepseekv3-s",
    "glm4moe-s",
    "llama4-dense-s",
    "llama4-llama3-s",
    "mixtral-s",
    "mixtral-window-s",
    "olmoe-clip-s",
    "olmoe-s",
    "qwen2moe-s",
]


def open_mock(path):
    """The bundle on the mock device; a skip when this build has no mock device (unless CI)."""
    try:
        return tarfa.open(path, backend="cuda-mock")
    except tarfa.EnvironmentError as e:
        if "mock-device" not in str(e) or os.environ.get("TARFA_EXPECT_WHEEL") == "1":
            raise
        pytest.skip(f"this build of tarfa has no mock device: {e}")


@pytest.fixture(scope="module", params=FAMILIES)
def arms(request, bundle, reference):
    """(family, prompts of 1, 7 and 33 tokens, {arm: model}) for one family."""
    name = request.param
    ref = reference(name)
    prompts = [ref["prompt.0"], ref["prompt.1"], ref["prompt.2"]]
    b = bundle(name)
    models = {}
    try:
        models["cpu threads=1"] = tarfa.open(b, backend="cpu", threads=1)
        models["cpu threads=2"] = tarfa.open(b, backend="cpu", threads=2)
        models["cuda-mock"] = open_mock(b)
        yield name, prompts, models
    finally:
        for m in models.values():
            m.close()


def assert_same(x, y, what):
    """Every array of two ForwardOutputs (logits, routes, captures) equal byte for byte."""
    assert x.logits.dtype == y.logits.dtype == np.float32, what
    assert x.logits.shape == y.logits.shape, what
    assert x.logits.tobytes() == y.logits.tobytes(), f"{what}: logits"
    assert x.moe_layers == y.moe_layers, what
    for name in ROUTES + CAPTURES:
        a, b = getattr(x, name), getattr(y, name)
        assert sorted(a) == sorted(b), f"{what}: {name}'s layers"
        for layer in a:
            assert a[layer].dtype == b[layer].dtype, f"{what}: {name}[{layer}]"
            assert a[layer].shape == b[layer].shape, f"{what}: {name}[{layer}]"
            assert a[layer].tobytes() == b[layer].tobytes(), f"{what}: {name}[{layer}]"


def test_backend_names(arms):
    _, _, models = arms
    assert [m.backend for m in models.values()] == ["cpu", "cpu", "cuda-mock"]
    assert "cuda-mock" in repr(models["cuda-mock"])


def test_every_capture_same_bits_across_threads_backends_and_batch(arms):
    name, prompts, models = arms
    ref = models["cpu threads=1"]
    n_layers = ref.config["num_hidden_layers"]
    want = [ref.forward(p, capture=CAPTURES) for p in prompts]
    # the reference holds what each capture promises, so that no comparison below is vacuous
    for p, o in zip(prompts, want):
        n, k = len(p), ref.top_k
        assert sorted(o.residual) == list(range(n_layers + 1))
        assert sorted(o.attn_out) == sorted(o.moe_out) == list(range(n_layers))
        for c in ("router_logits", "router_probs", "expert_out") + ROUTES:
            assert sorted(getattr(o, c)) == o.moe_layers == ref.moe_layers, c
        for layer in o.moe_layers:
            assert o.expert_out[layer].shape == (n, k, ref.config["hidden_size"])
    for arm, m in models.items():
        alone = [m.forward(p, capture=CAPTURES) for p in prompts]
        batched = m.forward_batch(prompts, capture=CAPTURES)
        plain = [m.forward(p) for p in prompts]  # no capture: CUDA steps without a hook
        assert len(batched) == len(prompts)
        for i, w in enumerate(want):
            assert_same(w, alone[i], f"{name} {arm}: prompt {i} alone")
            assert_same(w, batched[i], f"{name} {arm}: prompt {i} in the batch")
            assert plain[i].logits.tobytes() == w.logits.tobytes(), f"{name} {arm}: plain {i}"
            for r in ROUTES:
                for layer in w.moe_layers:
                    got, exp = getattr(plain[i], r)[layer], getattr(w, r)[layer]
                    assert got.tobytes() == exp.tobytes(), f"{name} {arm}: plain {i} {r}"


def test_layer_selection_on_cuda_equals_cpu(arms):
    name, prompts, models = arms
    cpu, cuda = models["cpu threads=2"], models["cuda-mock"]
    n_layers = cpu.config["num_hidden_layers"]
    layers = [1, n_layers]  # a layer, and the residual after the last one (residual only)
    full = cpu.forward_batch(prompts, capture=CAPTURES)
    for m in (cpu, cuda):
        one = m.forward(prompts[2], capture=CAPTURES, layers=layers)
        batched = m.forward_batch(prompts, capture=CAPTURES, layers=layers)
        for i, got in [(2, one)] + list(enumerate(batched)):
            what = f"{name} {m.backend}: prompt {i}, layers={layers}"
            assert got.logits.tobytes() == full[i].logits.tobytes(), what
            assert sorted(got.residual) == layers, what
            for c in CAPTURES:
                picked = getattr(got, c)
                expected = {x: a for x, a in getattr(full[i], c).items() if x in layers}
                assert sorted(picked) == sorted(expected), f"{what}: {c}"
                for layer, a in expected.items():
                    assert picked[layer].tobytes() == a.tobytes(), f"{what}: {c}[{layer}]"
    on_cpu = cpu.forward_batch(prompts, capture=CAPTURES, layers=[0])
    on_cuda = cuda.forward_batch(prompts, capture=CAPTURES, layers=[0])
    for i, (a, b) in enumerate(zip(on_cpu, on_cuda)):
        assert_same(a, b, f"{name}: prompt {i}, layers=[0]")


def test_interventions_on_cuda_are_refused_by_name(arms):
    name, prompts, models = arms
    m = models["cuda-mock"]
    p = prompts[1]
    h = m.config["hidden_size"]
    layer = m.moe_layers[0]
    before = m.forward(p, capture=["residual"])
    for kwargs, label in [
        ({"residual_add": {1: np.zeros(h, np.float32)}}, "residual_add(layer=1)"),
        ({"residual_replace": {1: np.zeros(h, np.float32)}}, "residual_replace(layer=1)"),
        ({"ablate": {layer: [0]}}, f"ablate(layer={layer})"),
        ({"force": {layer: list(range(m.top_k))}}, f"force(layer={layer})"),
    ]:
        with pytest.raises(tarfa.InputError, match=re.escape(label) + ".*captures only"):
            m.forward(p, capture=["residual"], **kwargs)
        with pytest.raises(tarfa.InputError, match=re.escape(label)):
            m.forward(p, **kwargs)  # without a capture too
    # a refusal does no work: the model gives the same bits after, and the CPU runs them
    assert_same(before, m.forward(p, capture=["residual"]), f"{name}: after the refusals")
    cpu = models["cpu threads=1"].forward(p, residual_add={1: np.zeros(h, np.float32)})
    assert cpu.interventions == ["residual_add(layer=1)"]


def test_a_bad_backend_names_the_public_ones_and_the_test_one(bundle):
    with pytest.raises(tarfa.InputError) as e:
        tarfa.open(bundle("mixtral-s"), backend="gpu")
    msg = str(e.value)
    assert '"auto", "cpu" or "cuda"' in msg and '"cuda-mock" is for tests' in msg, msg
    assert "mock-device" in msg and "'gpu'" not in msg and '"gpu"' in msg, msg
