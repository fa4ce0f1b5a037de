"""The lm-eval model's request handling, without lm-eval itself (it pulls torch): lm-eval's
`LM` base and `register_model` are stood in for, and the answers must be `tarfa-run score`'s."""

import importlib
import sys
import types
from types import SimpleNamespace

import pytest

from test_score import cli_score


@pytest.fixture(scope="module")
def plugin():
    registered = {}
    fake = {
        "lm_eval": types.ModuleType("lm_eval"),
        "lm_eval.api": types.ModuleType("lm_eval.api"),
        "lm_eval.api.model": types.ModuleType("lm_eval.api.model"),
        "lm_eval.api.registry": types.ModuleType("lm_eval.api.registry"),
    }
    fake["lm_eval.api.model"].LM = type("LM", (), {"__init__": lambda self: None})
    fake["lm_eval.api.registry"].register_model = lambda name: (
        lambda cls: registered.setdefault(name, cls)
    )
    saved = {k: sys.modules.get(k) for k in [*fake, "tarfa.lm_eval"]}
    sys.modules.update(fake)
    sys.modules.pop("tarfa.lm_eval", None)
    mod = importlib.import_module("tarfa.lm_eval")
    yield mod, registered
    for k, v in saved.items():
        if v is None:
            sys.modules.pop(k, None)
        else:
            sys.modules[k] = v


def req(*args):
    return SimpleNamespace(args=args)


def test_requests_answered_as_tarfa_run_score(plugin, bundle, reference, tmp_path):
    mod, registered = plugin
    assert registered["tarfa"] is mod.TarfaLM
    b = bundle("olmoe-s")
    p = [int(t) for t in reference("olmoe-s")["prompt.2"]]
    lm = mod.TarfaLM(bundle=str(b), backend="cpu", max_batch="2")
    ll = lm.loglikelihood([req(p[:5], p[5:9]), req(p[:2], p[2:3])])
    rolling = lm.loglikelihood_rolling([req(p)])
    want = cli_score(
        b,
        [
            {"context": p[:5], "continuation": p[5:9]},
            {"context": p[:2], "continuation": p[2:3]},
            {"rolling": p},
        ],
        tmp_path,
    )
    assert ll == [(w["logprob"], w["is_greedy"]) for w in want[:2]]
    assert rolling == [want[2]["logprob"]]
    # no tokenizer in this bundle: no stop strings, and the text is empty
    assert lm.generate_until([req(p[:4], {"max_gen_toks": 3})]) == [""]


def test_bundle_is_required(plugin):
    import tarfa

    mod, _ = plugin
    with pytest.raises(tarfa.InputError, match="bundle=PATH"):
        mod.TarfaLM()
    with pytest.raises(tarfa.InputError, match="threads"):
        mod.TarfaLM(bundle="x", threads="many")
