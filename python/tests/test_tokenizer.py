"""The bundle's tokenizer from Python: the ids the CLI encodes a prompt to, and back."""

import json

import pytest

import tarfa
from conftest import run_bin

TEXT = "def add(a, b):\n    return a + b\n"


@pytest.fixture(scope="module")
def code_model(bundle):
    m = tarfa.open(bundle("qwen3moe-code"), backend="cpu")
    yield m
    m.close()


def test_encode_is_the_clis_prompt(bundle, code_model, tmp_path):
    trace = tmp_path / "t.jsonl"
    code, _, err = run_bin(
        "tarfa-run", "generate", bundle("qwen3moe-code"), "--prompt", TEXT,
        "--max-new-tokens", "1", "--backend", "cpu", "--quiet", "--router-trace", trace,
    )
    assert code == 0, err
    header = json.loads(trace.read_text().splitlines()[0])
    ids = code_model.tokenizer.encode(TEXT)
    assert ids == header["prompt_tokens"]
    assert code_model.tokenizer.decode(ids) == TEXT


def test_text_prompts_score_as_their_ids(code_model):
    tok = code_model.tokenizer
    by_text = code_model.score([{"rolling": TEXT}])[0]
    by_ids = code_model.score([{"rolling": tok.encode(TEXT)}])[0]
    assert by_text == by_ids


def test_tokenizer_errors(code_model):
    vocab = code_model.config["vocab_size"]
    with pytest.raises(tarfa.InputError, match=str(vocab)):
        code_model.tokenizer.decode([1, vocab])
    with pytest.raises(tarfa.InputError, match="no chat template"):
        code_model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
