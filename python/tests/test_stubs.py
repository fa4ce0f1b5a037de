"""The type stubs (tarfa/__init__.pyi) name what the module has, no more and no less: top-level
names, each class's public methods and properties, each function's parameters; and every public
function, method and property has a docstring. (No mypy: the stub is parsed with ast.)"""

import ast
import inspect
from pathlib import Path

import numpy as np

import tarfa

STUB = Path(tarfa.__file__).with_suffix(".pyi")


def stub_tree():
    return ast.parse(STUB.read_text())


def public(names):
    return {n for n in names if not n.startswith("_") or n in ("__enter__", "__exit__")}


def stub_params(fn):
    a = fn.args
    star = [a.vararg] if a.vararg else []
    names = [x.arg for x in a.posonlyargs + a.args + star + a.kwonlyargs]
    return [n for n in names if n != "self"]


def test_top_level_names_match():
    tree = stub_tree()
    stubbed = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            stubbed.add(node.name)
    assert stubbed == set(tarfa.__all__)
    for name in tarfa.__all__:
        assert hasattr(tarfa, name), name


def test_classes_and_signatures_match():
    sample = tarfa.ForwardOutput(
        {
            "logits": np.zeros((1, 2), np.float32),
            "moe_layers": [],
            "router_topk": [],
            "router_weights": [],
            "router_topk_probs": [],
            "weight_bytes": 0,
            "experts_fetched": 0,
        }
    )
    for node in stub_tree().body:
        if isinstance(node, ast.FunctionDef):
            real = getattr(tarfa, node.name)
            assert stub_params(node) == list(inspect.signature(real).parameters), node.name
        if not isinstance(node, ast.ClassDef) or not node.body or isinstance(
            node.body[0], ast.Expr
        ):
            continue  # the exceptions: `class X(TarfaError): ...`
        cls = getattr(tarfa, node.name)
        methods = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
        fields = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
        real = public(
            n for n, v in vars(cls).items() if callable(v) or isinstance(v, property)
        ) - {"__init__", "__repr__"}
        assert set(methods) == real, node.name
        for name, fn in methods.items():
            attr = vars(cls)[name]
            if isinstance(attr, property):
                continue
            assert stub_params(fn) == list(inspect.signature(attr).parameters)[1:], name
        if fields:
            assert fields == public(vars(sample)), node.name


def test_every_public_name_has_a_docstring():
    missing = []
    for name in tarfa.__all__:
        obj = getattr(tarfa, name)
        if not inspect.getdoc(obj):
            missing.append(name)
        if inspect.isclass(obj) and obj.__module__ == "tarfa":
            for attr, v in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if (callable(v) or isinstance(v, property)) and not inspect.getdoc(v):
                    missing.append(f"{name}.{attr}")
    assert missing == []
