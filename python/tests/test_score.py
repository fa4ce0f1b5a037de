"""Scoring and generation from Python: the numbers `tarfa-run score` writes for the same requests."""

import json

import pytest

import tarfa
from conftest import run_bin


def requests(ref):
    p1 = [int(t) for t in ref["prompt.1"]]
    p2 = [int(t) for t in ref["prompt.2"]]
    return [
        {"context": p1[:4], "continuation": p1[4:]},
        {"context": p2[:10], "continuation": p2[10:14]},
        {"rolling": p2},
        {"context": p1, "max_tokens": 5},
        {"context": p2[:8], "max_tokens": 4, "temperature": 0.8, "seed": 7, "top_k": 20},
    ]


def cli_score(b, reqs, tmp_path, *extra):
    f = tmp_path / "requests.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    code, out, err = run_bin("tarfa-run", "score", b, "--requests", f, "--backend", "cpu", "--quiet", *extra)
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


def test_score_equals_cli(bundle, reference, tmp_path):
    b = bundle("olmoe-s")
    reqs = requests(reference("olmoe-s"))
    want = cli_score(b, reqs, tmp_path, "--top-logprobs", "2")
    with tarfa.open(b, backend="cpu") as m:
        got = m.score(reqs, top_logprobs=2)
        batched = m.score(reqs, top_logprobs=2, max_batch=3)
    # json floats are shortest round-trip representations: equal floats are equal bits
    assert got == want
    assert batched == want
    assert got[0]["logprob"] < 0 and len(got[0]["tokens"]) == 3


def test_generate_is_the_greedy_continuation(bundle, reference):
    ref = reference("olmoe-s")
    prompt = [int(t) for t in ref["prompt.1"]]
    greedy = [int(t) for t in ref["greedy.1"]]
    with tarfa.open(bundle("olmoe-s"), backend="cpu") as m:
        g = m.generate(prompt, max_tokens=6)
        again = m.generate(prompt, max_tokens=6, temperature=0.9, seed=3)
        same = m.generate(prompt, max_tokens=6, temperature=0.9, seed=3)
    n = len(g["tokens"])
    assert g["tokens"] == greedy[:n]
    assert n == 6 or g["finish_reason"] == "eos"
    assert again == same


def test_bad_request_names_its_index(bundle):
    with tarfa.open(bundle("olmoe-s"), backend="cpu") as m:
        with pytest.raises(tarfa.InputError, match="request 1: "):
            m.score([{"rolling": [1, 2, 3]}, {"contxt": [1]}])
        with pytest.raises(tarfa.InputError, match="request 0"):
            m.score([{"context": [1], "continuation": [m.config["vocab_size"]]}])
