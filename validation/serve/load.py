#!/usr/bin/env python3
"""Load on a running `tarfa-run serve`: C concurrent clients, R completions each, every answer
compared with the same request answered alone, bitwise (the JSON choices, log-probs included).

    python3 validation/serve/load.py URL --clients 1,8,32,128 [--requests 4] [--prompt 64]
        [--max-tokens 16] [--vocab 4096] [--distinct 8] [--json OUT]

URL is the server's base (http://127.0.0.1:PORT). The prompts are token ids (a synthetic bundle
has no tokenizer): `--distinct` different prompts of `--prompt` ids, greedy, `--max-tokens` new
tokens each, with `logprobs: 1`. For each client count it prints requests, wall seconds, p50/p99
latency, time to the whole answer, and aggregate generated tokens/s; a line `TABLE|...` per count.
Exit status: 0 when every answer equals its alone answer, 1 when one differs, 2 on bad usage,
3 when the server cannot be reached or answers with an error.
Standard library only (the GPU machine has no package access).
"""
import argparse
import json
import sys
import threading
import time
import urllib.error
import urllib.request


def post(url, body, timeout=600):
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url")
    ap.add_argument("--clients", default="1,8,32,128")
    ap.add_argument("--requests", type=int, default=4, help="completions per client")
    ap.add_argument("--prompt", type=int, default=64, help="prompt length in token ids")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=4096, help="ids are drawn below this")
    ap.add_argument("--distinct", type=int, default=8, help="different prompts")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    try:
        counts = [int(c) for c in a.clients.split(",")]
    except ValueError:
        print(f"load.py: --clients {a.clients!r}: a comma-separated list of integers", file=sys.stderr)
        return 2
    if a.distinct < 1 or a.requests < 1 or min(counts) < 1 or a.prompt < 1 or a.max_tokens < 1:
        print("load.py: every count must be at least 1", file=sys.stderr)
        return 2
    bodies = []
    for i in range(a.distinct):
        prompt = [(17 + 131 * i + 7919 * t) % a.vocab for t in range(a.prompt)]
        bodies.append({"prompt": prompt, "max_tokens": a.max_tokens, "logprobs": 1, "temperature": 0})
    try:
        alone = [post(a.url, b)["choices"] for b in bodies]
    except (urllib.error.URLError, OSError) as e:
        print(f"load.py: {a.url}: {e}", file=sys.stderr)
        return 3
    figures = []
    differ = 0
    for c in counts:
        results = []
        errors = []
        lock = threading.Lock()

        def client(k):
            for r in range(a.requests):
                i = (k + r) % a.distinct
                t = time.monotonic()
                try:
                    got = post(a.url, bodies[i])
                except (urllib.error.URLError, OSError) as e:
                    with lock:
                        errors.append(str(e))
                    return
                dt = time.monotonic() - t
                n = len(got["choices"][0]["logprobs"]["token_ids"])
                with lock:
                    results.append((i, got["choices"], dt, n))

        t0 = time.monotonic()
        threads = [threading.Thread(target=client, args=(k,)) for k in range(c)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        if errors:
            print(f"load.py: {len(errors)} failed requests at {c} clients: {errors[0]}", file=sys.stderr)
            return 3
        bad = sum(1 for i, ch, _, _ in results if ch != alone[i])
        differ += bad
        lat = sorted(r[2] for r in results)
        toks = sum(r[3] for r in results)
        f = {
            "clients": c,
            "requests": len(results),
            "wall_s": wall,
            "p50_s": lat[len(lat) // 2],
            "p99_s": lat[min(len(lat) - 1, (len(lat) * 99) // 100)],
            "generated_tok_s": toks / wall,
            "requests_s": len(results) / wall,
            "differ_from_alone": bad,
        }
        figures.append(f)
        print(
            f"{c} clients: {len(results)} requests in {wall:.2f} s | p50 {f['p50_s']:.3f} s | "
            f"p99 {f['p99_s']:.3f} s | {f['generated_tok_s']:.1f} generated tok/s | "
            f"{f['requests_s']:.2f} req/s | {bad} differ from alone"
        )
        print(
            f"TABLE|serve {c} clients|{f['generated_tok_s']:.1f} tok/s, p50 {f['p50_s']:.3f} s, "
            f"p99 {f['p99_s']:.3f} s|{'SAME as alone' if bad == 0 else f'{bad} DIFFER'}"
        )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(figures, fh, indent=1)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
