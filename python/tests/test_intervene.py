"""Interventions are labelled, never the default, and change what they say they change."""

import numpy as np
import pytest

import tarfa


@pytest.fixture(scope="module")
def run(bundle, reference):
    m = tarfa.open(bundle("olmoe-s"), backend="cpu")
    yield m, reference("olmoe-s")["prompt.1"]
    m.close()


def test_zero_addition_is_labelled_and_changes_no_bit(run):
    m, prompt = run
    plain = m.forward(prompt)
    zero = m.forward(prompt, residual_add={1: np.zeros(m.config["hidden_size"], np.float32)})
    assert plain.exact and plain.interventions == []
    assert not zero.exact and zero.interventions == ["residual_add(layer=1)"]
    assert zero.logits.tobytes() == plain.logits.tobytes()


def test_addition_changes_what_follows_the_layer(run):
    m, prompt = run
    h = m.config["hidden_size"]
    plain = m.forward(prompt, capture=["residual"])
    delta = np.full((len(prompt), h), 0.5, np.float32)
    out = m.forward(prompt, capture=["residual"], residual_add={1: delta})
    # the residual entering layer 1 is the plain one plus delta (f32 additions), layer 0 untouched
    assert out.residual[0].tobytes() == plain.residual[0].tobytes()
    assert out.residual[1].tobytes() == (plain.residual[1] + delta).tobytes()
    assert not np.array_equal(out.logits, plain.logits)


def test_replacing_the_final_state_gives_its_logits(run):
    m, prompt = run
    a = m.forward(prompt, capture=["residual"], layers=[2])
    # the final state of another prompt, put in place of this one's: that prompt's last logits
    b_prompt = list(prompt[::-1])
    b = m.forward(b_prompt, capture=["residual"], layers=[2])
    out = m.forward(prompt, residual_replace={2: b.residual[2]})
    assert out.interventions == ["residual_replace(layer=2)"]
    assert out.logits.tobytes() == b.logits.tobytes()
    assert not np.array_equal(out.logits, a.logits)


def test_bad_interventions_are_refused(run):
    m, prompt = run
    h = m.config["hidden_size"]
    with pytest.raises(tarfa.InputError, match="float32"):
        m.forward(prompt, residual_add={1: np.zeros(h)})
    with pytest.raises(tarfa.InputError, match="shape"):
        m.forward(prompt, residual_add={1: np.zeros((2, h), np.float32)})
    with pytest.raises(tarfa.InputError, match="not a layer"):
        m.forward(prompt, residual_add={7: np.zeros(h, np.float32)})


def test_ablated_experts_are_never_chosen(bundle, reference):
    prompt = reference("mixtral-s")["prompt.2"]
    with tarfa.open(bundle("mixtral-s"), backend="cpu") as m:
        plain = m.forward(prompt)
        first, last = plain.moe_layers[0], plain.moe_layers[-1]
        # the expert the last MoE layer chose most often
        gone = int(np.bincount(plain.router_topk[last].ravel()).argmax())
        out = m.forward(prompt, capture=["router_logits"], ablate={last: [gone]})
    assert not out.exact and out.interventions == [f"ablate(layer={last}, experts=[{gone}])"]
    assert gone not in out.router_topk[last]
    assert np.isneginf(out.router_logits[last][:, gone]).all()
    assert np.isfinite(out.router_weights[last]).all()
    if first != last:  # layers before the ablated one route as before
        assert (out.router_topk[first] == plain.router_topk[first]).all()
    assert not np.array_equal(out.logits, plain.logits)


def test_bad_ablations_are_refused(run):
    m, prompt = run
    e = m.config["num_experts"]
    with pytest.raises(tarfa.InputError, match="not an expert"):
        m.forward(prompt, ablate={0: [e]})
    with pytest.raises(tarfa.InputError, match="not a layer"):
        m.forward(prompt, ablate={5: [0]})
    with pytest.raises(tarfa.InputError, match="fewer than"):
        m.forward(prompt, ablate={0: list(range(e))})
