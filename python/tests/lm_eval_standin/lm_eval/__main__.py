"""`lm_eval --model NAME --model_args K=V,... --requests FILE`: the model looked up by name in
the registry, as lm-eval's `simple_evaluate` does, then each request of FILE (JSON lines of
{"type": loglikelihood | loglikelihood_rolling | generate_until, "args": [...]}) answered by the
model's method of that name; prints one JSON line per answer."""

import argparse
import json
import sys
import types


def cli_evaluate():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--model_args", default="")
    p.add_argument("--requests", required=True)
    a = p.parse_args()
    import lm_eval.api.registry

    lm = lm_eval.api.registry.get_model(a.model).create_from_arg_string(a.model_args)
    with open(a.requests) as f:
        reqs = [json.loads(line) for line in f if line.strip()]
    for kind in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
        batch = [types.SimpleNamespace(args=tuple(r["args"])) for r in reqs if r["type"] == kind]
        if batch:
            for out in getattr(lm, kind)(batch):
                print(json.dumps({"type": kind, "result": out}))
    sys.stdout.flush()


if __name__ == "__main__":
    cli_evaluate()
