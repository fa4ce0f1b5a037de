#!/usr/bin/env python3
"""`tarfa-run serve` through the official `openai` Python client, on the qwen3moe-code fixture
(converted here with a small chat template added): completions with echo and logprobs equal
`tarfa-run score`'s numbers bit for bit, chat completions render the template, streaming yields
the non-streaming tokens, and a request past its deadline is a 504 the client reports.

Run from the repository root after a build (`cargo build -p tarfa-run -p tarfa-convert`):
    python3 validation/serve/test_openai.py
Without the `openai` module it skips (exit 0), unless CI is set: then it fails (exit 1), as
TARFA_REQUIRE_NVRTC makes the NVRTC test fail rather than skip.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
RUN = os.path.join(TARGET, "debug", "tarfa-run")
CONVERT = os.path.join(TARGET, "debug", "tarfa-convert")
FIXTURE = os.path.join(ROOT, "fixtures", "oracle", "qwen3moe-code")
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

try:
    import openai
except ImportError:
    if os.environ.get("CI"):
        print("error: the openai module is missing (pip install openai)", file=sys.stderr)
        sys.exit(1)
    print("skip: no openai module (pip install openai)")
    sys.exit(0)


def bits(xs):
    # Python's float() is correctly rounded: the printed shortest repr gives back the same bits
    return [None if x is None else float(x).hex() for x in xs]


def main():
    tmp = tempfile.mkdtemp()
    try:
        ckpt = os.path.join(tmp, "ckpt")
        shutil.copytree(FIXTURE, ckpt, ignore=shutil.ignore_patterns("reference.*"))
        with open(os.path.join(ckpt, "chat_template.jinja"), "w") as f:
            f.write(TEMPLATE)
        bundle = os.path.join(tmp, "bundle")
        subprocess.run([CONVERT, ckpt, bundle], check=True, capture_output=True)
        srv = subprocess.Popen(
            [RUN, "serve", bundle, "--port", "0", "--backend", "cpu", "--quiet", "--api-key", "k"],
            stderr=subprocess.PIPE, text=True)
        try:
            line = srv.stderr.readline()
            assert line.startswith("listening on http://"), line
            url = line.strip().split("listening on ")[1]
            check(url, bundle, tmp)
        finally:
            srv.terminate()
            assert srv.wait(timeout=60) == 0
    finally:
        shutil.rmtree(tmp)
    print("ok: openai client agrees with tarfa-run score")


def check(url, bundle, tmp):
    client = openai.OpenAI(base_url=url + "/v1", api_key="k")
    model = client.models.list().data[0].id
    prompt = "def add(a, b):\n    return"
    # lm-eval's loglikelihood request
    c = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    lp = c.choices[0].logprobs
    assert lp.token_logprobs[0] is None
    ids = lp.model_extra["token_ids"]
    g = client.completions.create(model=model, prompt=prompt, max_tokens=4, logprobs=1)
    reqs = os.path.join(tmp, "r.jsonl")
    with open(reqs, "w") as f:
        f.write(json.dumps({"context": ids[:1], "continuation": ids[1:]}) + "\n")
        f.write(json.dumps({"context": prompt, "max_tokens": 4}) + "\n")
    out = subprocess.run([RUN, "score", bundle, "--requests", reqs, "--backend", "cpu", "--quiet"],
                         check=True, capture_output=True, text=True).stdout.splitlines()
    ll, gen = json.loads(out[0]), json.loads(out[1])
    assert bits(lp.token_logprobs[1:]) == bits(ll["token_logprobs"]), "echo logprobs differ"
    assert g.choices[0].logprobs.model_extra["token_ids"] == gen["tokens"]
    assert bits(g.choices[0].logprobs.token_logprobs) == bits(gen["token_logprobs"])
    assert g.choices[0].text == gen["text"]
    # streaming == non-streaming
    text = "".join(ch.choices[0].text for ch in client.completions.create(
        model=model, prompt=prompt, max_tokens=4, stream=True))
    assert text == g.choices[0].text, (text, g.choices[0].text)
    # chat: the template's rendering is the prompt
    msgs = [{"role": "user", "content": "hi"}]
    ch = client.chat.completions.create(model=model, messages=msgs, max_tokens=3, logprobs=True)
    with open(reqs, "w") as f:
        f.write(json.dumps({"context": "<|user|>hi\n<|assistant|>", "max_tokens": 3}) + "\n")
    want = subprocess.run([RUN, "score", bundle, "--requests", reqs, "--backend", "cpu", "--quiet"],
                          check=True, capture_output=True, text=True).stdout
    want = json.loads(want)
    assert ch.choices[0].message.content == want["text"]
    assert [t.logprob for t in ch.choices[0].logprobs.content] == want["token_logprobs"]
    streamed = "".join(x.choices[0].delta.content or "" for x in client.chat.completions.create(
        model=model, messages=msgs, max_tokens=3, stream=True))
    assert streamed == want["text"]
    # a request past its deadline (x-tarfa-timeout: 0 has passed when the scheduler first looks)
    # is the client's InternalServerError with status 504 and OpenAI's error body
    strict = client.with_options(max_retries=0)
    try:
        strict.completions.create(model=model, prompt=prompt, max_tokens=4,
                                  extra_headers={"x-tarfa-timeout": "0"})
        raise AssertionError("a request past its deadline was answered")
    except openai.InternalServerError as e:
        assert e.status_code == 504, e
        assert e.body["code"] == "deadline_exceeded", e.body


if __name__ == "__main__":
    main()
