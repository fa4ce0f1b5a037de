"""A bare `lm_eval --model tarfa` through the wheel's tarfa-lm-eval.pth (python/_tarfa_lm_eval_hook.py),
with lm-eval stood in for by lm_eval_standin/ (lm-eval 0.4.13's registry module path and rules).

Each check runs in a fresh interpreter, where the .pth is read at start: the installed wheel's own
(in its site-packages) when the package is installed, else python/'s two files in a temporary
site directory added by `site.addsitedir` (what the interpreter does with site-packages).
TARFA_EXPECT_WHEEL=1 (CI) makes the second case a failure."""

import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

import tarfa
from test_score import cli_score

HERE = Path(__file__).resolve().parent
PYTHON_DIR = HERE.parent
STANDIN = HERE / "lm_eval_standin"


def installed_pth():
    """The installed wheel's tarfa-lm-eval.pth, or None."""
    for d in site.getsitepackages() + [site.getusersitepackages()]:
        p = Path(d) / "tarfa-lm-eval.pth"
        if p.exists():
            return p
    return None


@pytest.fixture(scope="module")
def python(tmp_path_factory):
    """python(code or -m args, standin=...): runs a fresh interpreter with the hook installed as
    at start; returns the CompletedProcess."""
    pth = installed_pth()
    if os.environ.get("TARFA_EXPECT_WHEEL") == "1":
        assert pth is not None, "TARFA_EXPECT_WHEEL=1 but no tarfa-lm-eval.pth in site-packages"
        assert importlib.util.find_spec("_tarfa_lm_eval_hook") is not None
    prelude = []
    path = []
    if pth is None:
        d = tmp_path_factory.mktemp("site")
        for name in ("tarfa-lm-eval.pth", "_tarfa_lm_eval_hook.py"):
            shutil.copy(PYTHON_DIR / name, d / name)
        prelude = ["-c", f"import site; site.addsitedir({str(d)!r}); import runpy, sys; "]
        path.append(str(Path(tarfa.__file__).resolve().parents[1]))

    def run(args, standin=STANDIN, env=None):
        pp = ([str(standin)] if standin else []) + path
        e = {k: v for k, v in os.environ.items() if k != "TARFA_LM_EVAL_HOOK"}
        e.update({"PYTHONPATH": os.pathsep.join(pp), **(env or {})})
        if prelude:
            if args[0] == "-m":
                code = prelude[1] + f"sys.argv = {[args[1], *args[2:]]!r}; runpy.run_module({args[1]!r}, run_name='__main__', alter_sys=True)"
            else:
                code = prelude[1] + args[1]
            argv = [sys.executable, "-c", code]
        else:
            argv = [sys.executable, *args]
        return subprocess.run(argv, capture_output=True, text=True, env=e, timeout=120)

    return run


PROBE = """
import sys, json
started = sorted(m for m in sys.modules if m.split('.')[0] in ('tarfa', 'lm_eval'))
import lm_eval.api.registry as r
raw = r.model_registry.raw('tarfa')
after_registry = sorted(m for m in sys.modules if m.split('.')[0] == 'tarfa')
dummy = r.get_model('dummy').__name__
cls = r.get_model('tarfa')
print(json.dumps({'started': started, 'raw': raw, 'after_registry': after_registry,
                  'dummy': dummy, 'cls': cls.__module__ + ':' + cls.__name__,
                  'native': 'tarfa._tarfa' in sys.modules}))
"""


def test_registered_lazily_when_the_registry_is_imported(python):
    p = python(["-c", PROBE])
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    got = json.loads(p.stdout)
    # nothing of tarfa or lm-eval at interpreter start, nothing of tarfa after the registry
    assert got["started"] == []
    assert got["after_registry"] == []
    assert got["raw"] == "tarfa.lm_eval:TarfaLM"  # a lazy placeholder
    # lm-eval's own models are still found (get_model imports them only for an empty registry)
    assert got["dummy"] == "DummyLM"
    assert got["cls"] == "tarfa.lm_eval:TarfaLM"
    assert got["native"]


def test_quiet_without_lm_eval_and_when_turned_off(python):
    p = python(["-c", "import sys; print(any(m.startswith(('tarfa', 'lm_eval')) for m in sys.modules))"], standin=None)
    assert (p.returncode, p.stdout.strip(), p.stderr) == (0, "False", "")
    p = python(["-c", "import lm_eval"], standin=None)
    assert p.returncode == 1 and "No module named 'lm_eval'" in p.stderr
    assert "tarfa" not in p.stderr
    p = python(["-c", "import lm_eval.api.registry as r; print('tarfa' in r.model_registry)"],
               env={"TARFA_LM_EVAL_HOOK": "0"})
    assert (p.returncode, p.stdout.strip()) == (0, "False"), p.stderr


def test_python_m_tarfa_lm_eval_still_registers_once(python):
    # tarfa.lm_eval's own register_model upgrades the placeholder to the class (lm-eval's rule)
    p = python(["-c", "import tarfa.lm_eval as t, lm_eval.api.registry as r; "
                      "print(r.model_registry.raw('tarfa') is t.TarfaLM)"])
    assert (p.returncode, p.stdout.strip()) == (0, "True"), p.stderr


def test_older_lm_eval_dict_registry(python, tmp_path):
    # lm-eval <= 0.4.9: MODEL_REGISTRY a dict of classes, get_model a lookup: registered eagerly
    old = tmp_path / "old"
    shutil.copytree(STANDIN, old)
    (old / "lm_eval" / "api" / "registry.py").write_text(
        "from lm_eval.api.model import LM\n"
        "MODEL_REGISTRY = {}\n"
        "def register_model(*names):\n"
        "    def decorate(cls):\n"
        "        for n in names:\n"
        "            assert n not in MODEL_REGISTRY\n"
        "            MODEL_REGISTRY[n] = cls\n"
        "        return cls\n"
        "    return decorate\n"
        "def get_model(name):\n"
        "    return MODEL_REGISTRY[name]\n"
    )
    (old / "lm_eval" / "models" / "__init__.py").write_text("")
    p = python(["-c", "import lm_eval.api.registry as r; c = r.get_model('tarfa'); "
                      "print(c.__module__ + ':' + c.__name__)"], standin=old)
    assert (p.returncode, p.stdout.strip()) == (0, "tarfa.lm_eval:TarfaLM"), p.stderr


def test_bare_lm_eval_command_answers_as_tarfa_run_score(python, bundle, reference, tmp_path):
    b = bundle("olmoe-s")
    toks = [int(t) for t in reference("olmoe-s")["prompt.2"]]
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"type": "loglikelihood", "args": [toks[:5], toks[5:9]]},
                {"type": "loglikelihood", "args": [toks[:2], toks[2:3]]},
                {"type": "loglikelihood_rolling", "args": [toks]},
                {"type": "loglikelihood_rolling", "args": [toks[:6]]},
                {"type": "generate_until", "args": [toks[:4], {"max_gen_toks": 3}]},
            ]
        )
        + "\n"
    )
    p = python(["-m", "lm_eval", "--model", "tarfa", "--model_args",
                f"bundle={b},backend=cpu,max_batch=2", "--requests", str(reqs)])
    assert p.returncode == 0, p.stderr
    out = [json.loads(line) for line in p.stdout.splitlines()]
    want = cli_score(
        b,
        [
            {"context": toks[:5], "continuation": toks[5:9]},
            {"context": toks[:2], "continuation": toks[2:3]},
            {"rolling": toks},
            {"rolling": toks[:6]},
        ],
        tmp_path,
    )
    assert [o["type"] for o in out] == ["loglikelihood"] * 2 + ["loglikelihood_rolling"] * 2 + ["generate_until"]
    # JSON round-trips an f64 exactly (Python's repr is the shortest round-trip text)
    assert [tuple(o["result"]) for o in out[:2]] == [(w["logprob"], w["is_greedy"]) for w in want[:2]]
    assert [o["result"] for o in out[2:4]] == [w["logprob"] for w in want[2:4]]
    assert out[4]["result"] == ""  # no tokenizer in this bundle: the text is empty
