"""Forcing experts: the forced set replaces the router's top-k, ranked and weighted by the
family's own rule. Forcing the router's own choice is the same bits as not forcing (the seam is
exact); forcing other experts routes to them and changes the logits; it is always labelled."""

import numpy as np
import pytest

import tarfa


@pytest.mark.parametrize(
    "fixture",
    # softmax without renormalisation, top-k then softmax, sigmoid group-limited (a dense first
    # layer), softmax group-limited greedy
    ["olmoe-s", "mixtral-s", "deepseekv3-s", "deepseekv2-yarn-s"],
)
def test_forcing_the_routers_own_choice_changes_no_bit(bundle, reference, fixture):
    prompt = reference(fixture)["prompt.2"]
    with tarfa.open(bundle(fixture), backend="cpu") as m:
        plain = m.forward(prompt)
        # every MoE layer, each token's own top-k given in reverse: the router's ranking orders it
        force = {layer: plain.router_topk[layer][:, ::-1] for layer in plain.moe_layers}
        out = m.forward(prompt, force=force)
    assert not out.exact
    assert out.interventions == [f"force(layer={x}, experts=per token)" for x in plain.moe_layers]
    assert out.logits.tobytes() == plain.logits.tobytes()
    for layer in plain.moe_layers:
        assert out.router_topk[layer].tobytes() == plain.router_topk[layer].tobytes()
        assert out.router_weights[layer].tobytes() == plain.router_weights[layer].tobytes()


def test_forcing_other_experts_routes_to_them(bundle, reference):
    prompt = reference("olmoe-s")["prompt.2"]
    with tarfa.open(bundle("olmoe-s"), backend="cpu") as m:
        k, (first, last) = m.top_k, m.moe_layers
        plain = m.forward(prompt, capture=["router_probs"])
        probs = plain.router_probs[last]
        # each token's k least likely experts, lowest first (the router ranks them the other way)
        least = np.argsort(probs, axis=1, kind="stable")[:, :k]
        out = m.forward(prompt, capture=["router_probs"], force={last: least})
    assert not out.exact and out.interventions == [f"force(layer={last}, experts=per token)"]
    got = out.router_topk[last]
    assert [sorted(r) for r in got.tolist()] == [sorted(r) for r in least.tolist()]
    # in the router's order: descending probability
    rows = np.arange(len(prompt))[:, None]
    assert (np.diff(probs[rows, got], axis=1) <= 0).all()
    # OLMoE does not renormalise: each weight is the router's own softmax probability
    assert out.router_weights[last].tobytes() == probs[rows, got].astype(np.float32).tobytes()
    assert out.router_probs[last].tobytes() == probs.tobytes(), "the router itself is untouched"
    assert (out.router_topk[first] == plain.router_topk[first]).all()
    assert not np.array_equal(out.logits, plain.logits)


def test_forcing_one_set_for_every_token_and_leaving_tokens_alone(bundle, reference):
    prompt = reference("mixtral-s")["prompt.2"]
    with tarfa.open(bundle("mixtral-s"), backend="cpu") as m:
        k, last = m.top_k, m.moe_layers[-1]
        plain = m.forward(prompt)
        every = m.forward(prompt, force={last: list(range(k))})
        # -1 rows: the router's choice; token 1 forced to the experts it never chose
        rows = np.full((len(prompt), k), -1)
        others = [e for e in range(8) if e not in plain.router_topk[last][1]][:k]
        rows[1] = others
        one = m.forward(prompt, force={last: rows})
    assert every.interventions == [f"force(layer={last}, experts={list(range(k))})"]
    assert (np.sort(every.router_topk[last], axis=1) == np.arange(k)).all()
    # gpt-oss / Mixtral weights over the forced set sum to one
    np.testing.assert_allclose(every.router_weights[last].sum(axis=1), 1.0, rtol=1e-6)
    assert not np.array_equal(every.logits, plain.logits)
    assert sorted(one.router_topk[last][1]) == sorted(others)
    keep = [t for t in range(len(prompt)) if t != 1]
    assert (one.router_topk[last][keep] == plain.router_topk[last][keep]).all()
    # causal: the positions before the forced token keep their logits
    assert one.logits[0].tobytes() == plain.logits[0].tobytes()
    assert not np.array_equal(one.logits[1], plain.logits[1])


def test_bad_forces_are_refused_by_name(bundle, reference):
    prompt = [1, 2, 3]
    with tarfa.open(bundle("deepseekv3-s"), backend="cpu") as m:
        k, moe = m.top_k, m.moe_layers
        assert moe == [1, 2]  # first_k_dense_replace = 1
        with pytest.raises(tarfa.InputError, match="force: 0 is not an MoE layer"):
            m.forward(prompt, force={0: list(range(k))})
        with pytest.raises(tarfa.InputError, match="ablate: 0 is not an MoE layer"):
            m.forward(prompt, ablate={0: [1]})
        with pytest.raises(tarfa.InputError, match="force: 9 is not an MoE layer"):
            m.forward(prompt, force={9: list(range(k))})
        with pytest.raises(tarfa.InputError, match="expert 8 is not an expert"):
            m.forward(prompt, force={1: [0, 1, 8]})
        with pytest.raises(tarfa.InputError, match="expert -2 is not an expert"):
            m.forward(prompt, force={1: [0, 1, -2]})
        with pytest.raises(tarfa.InputError, match="repeat an expert"):
            m.forward(prompt, force={1: [0, 1, 1]})
        with pytest.raises(tarfa.InputError, match=r"the router selects 3 experts"):
            m.forward(prompt, force={1: [0, 1]})
        with pytest.raises(tarfa.InputError, match=r"shape \(3,\) or \(3, 3\)"):
            m.forward(prompt, force={1: np.zeros((2, 3), np.int64)})
        with pytest.raises(tarfa.InputError, match="integer expert ids"):
            m.forward(prompt, force={1: [0.0, 1.0, 2.0]})
        with pytest.raises(tarfa.InputError, match="force.1. and ablate.1."):
            m.forward(prompt, force={1: [0, 1, 2]}, ablate={1: [5]})
        # still usable, and exact by default
        assert m.forward(prompt).exact
