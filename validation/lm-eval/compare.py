#!/usr/bin/env python3
"""Checks two lm-eval runs of the tasks beside this file against each other and against
`tarfa-run score` on the same requests (stdlib only; run_lmeval.sh calls it).

- The runs (against servers with different --max-batch) must agree exactly: every logged
  sample's responses and metric values, and every aggregate in the results file.
- Every request lm-eval made, rebuilt from the first run's logged arguments as the `tarfa-run
  score` line it means, must give the same numbers: a loglikelihood's sum of log-probs (the same
  f64 bits; lm-eval logs them with repr, which round-trips) and is_greedy; a generation's text.
  lm-eval's generate_until stops at its `until` strings plus the tokenizer's EOS string (what the
  server's /tokenizer_info says, saved by run_lmeval.sh), so the score line carries both.
- The scores recomputed from `tarfa-run score`'s numbers (acc: the argmax of the choices'
  log-likelihoods, the first on ties, as numpy's argmax; exact_match: string equality, lm-eval's
  defaults) must equal each sample's logged metric and each task's aggregate (the mean).

Exit 0 when everything agrees, 1 on any difference (each printed), 2 on bad input.
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

MC, GEN, PPL = "tarfa_tiny_mc", "tarfa_tiny_gen", "tarfa_tiny_ppl"


def newest(pattern):
    found = sorted(glob.glob(pattern, recursive=True))
    if not found:
        sys.exit(f"compare.py: nothing matches {pattern}")
    return found[-1]


def load_run(d):
    """The run's results file (parsed) and its samples by task, each by doc_id."""
    results = json.load(open(newest(os.path.join(d, "**", "results_*.json"))))
    samples = {}
    for task in (MC, GEN, PPL):
        if task == PPL and task not in results["results"]:
            continue  # the server route (run_lmeval.sh) runs no rolling task
        path = newest(os.path.join(d, "**", f"samples_{task}_*.jsonl"))
        samples[task] = {s["doc_id"]: s for s in map(json.loads, open(path))}
    return results, samples


def f64(x):
    return float(x).hex()


def mean(xs):
    # lm-eval's `mean` aggregation
    return sum(xs) / len(xs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tarfa-run", required=True, help="the tarfa-run binary")
    ap.add_argument("--bundle", required=True, help="the bundle the servers served")
    ap.add_argument("--tokenizer-info",
                    help="the server's GET /tokenizer_info (its eos_token is lm-eval's stop "
                         "string); without it, the task's stop strings alone (the in-process "
                         "plugin, run_plugin.sh: score stops at the EOS ids itself)")
    ap.add_argument("runs", nargs=2, help="two lm-eval --output_path directories")
    a = ap.parse_args()
    eos = json.load(open(a.tokenizer_info)).get("eos_token") if a.tokenizer_info else None
    (res_a, smp_a), (res_b, smp_b) = (load_run(d) for d in a.runs)
    problems = []

    tasks = [t for t in (MC, GEN, PPL) if t in smp_a]
    if sorted(smp_b) != sorted(smp_a):
        problems.append(f"the runs ran different tasks: {sorted(smp_a)} vs {sorted(smp_b)}")
    # 1. the two runs agree exactly
    for task in tasks:
        if res_a["results"][task] != res_b["results"][task]:
            problems.append(f"{task}: results differ between the runs: "
                            f"{res_a['results'][task]} vs {res_b['results'][task]}")
        if sorted(smp_a[task]) != sorted(smp_b[task]):
            problems.append(f"{task}: the runs logged different documents")
            continue
        for doc, s in smp_a[task].items():
            t = smp_b[task][doc]
            for key in ["resps", "filtered_resps"] + s["metrics"]:
                if s[key] != t[key]:
                    problems.append(f"{task} doc {doc}: {key} differs: {s[key]} vs {t[key]}")

    # 2. the same requests through `tarfa-run score`
    lines, where = [], []
    for doc, s in sorted(smp_a[MC].items()):
        for i in range(len(s["arguments"])):
            arg = s["arguments"][f"gen_args_{i}"]
            lines.append({"context": arg["arg_0"], "continuation": arg["arg_1"]})
            where.append((MC, doc, i))
    for doc, s in sorted(smp_a[GEN].items()):
        arg = s["arguments"]["gen_args_0"]
        kw = arg["arg_1"]
        until = list(kw.get("until") or [])
        if eos is not None and eos not in until:
            until.append(eos)
        lines.append({"context": arg["arg_0"], "max_tokens": kw["max_gen_toks"], "until": until})
        where.append((GEN, doc, 0))
    for doc, s in sorted(smp_a.get(PPL, {}).items()):
        lines.append({"rolling": s["arguments"]["gen_args_0"]["arg_0"]})
        where.append((PPL, doc, 0))
    with tempfile.TemporaryDirectory() as tmp:
        req = os.path.join(tmp, "requests.jsonl")
        with open(req, "w") as f:
            f.writelines(json.dumps(l) + "\n" for l in lines)
        out = subprocess.run([a.tarfa_run, "score", a.bundle, "--requests", req, "--backend", "cpu",
                              "--quiet"], capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"compare.py: tarfa-run score failed ({out.returncode}): {out.stderr}")
    scored = [json.loads(l) for l in out.stdout.splitlines()]
    if len(scored) != len(lines):
        sys.exit(f"compare.py: {len(lines)} requests, {len(scored)} results")

    lls, texts, rolled = {}, {}, {}
    for (task, doc, i), r in zip(where, scored):
        resp = smp_a[task][doc]["resps"][i][0]
        if task == PPL:
            if f64(resp) != f64(r["logprob"]):
                problems.append(f"{PPL} doc {doc}: lm-eval {resp!r}, score {r['logprob']!r}")
            rolled[doc] = r["logprob"]
        elif task == MC:
            got_lp, got_greedy = resp
            if f64(got_lp) != f64(r["logprob"]):
                problems.append(f"{MC} doc {doc} choice {i}: lm-eval {got_lp}, score {r['logprob']!r}")
            if (got_greedy == "True") != r["is_greedy"]:
                problems.append(f"{MC} doc {doc} choice {i}: is_greedy {got_greedy} vs {r['is_greedy']}")
            lls.setdefault(doc, []).append(r["logprob"])
        else:
            if resp != r["text"]:
                problems.append(f"{GEN} doc {doc}: lm-eval {resp!r}, score {r['text']!r}")
            texts[doc] = r["text"]

    # 3. the scores, recomputed from score's numbers
    acc = {}
    for doc, ll in lls.items():
        pred = max(range(len(ll)), key=lambda i: (ll[i], -i))
        acc[doc] = 1.0 if pred == int(smp_a[MC][doc]["target"]) else 0.0
    em = {doc: 1.0 if t == smp_a[GEN][doc]["target"] else 0.0 for doc, t in texts.items()}
    for task, metric, per_doc in ((MC, "acc", acc), (GEN, "exact_match", em)):
        for doc, v in per_doc.items():
            if smp_a[task][doc][metric] != v:
                problems.append(f"{task} doc {doc}: {metric} logged {smp_a[task][doc][metric]}, "
                                f"from score {v}")
        agg = mean([per_doc[d] for d in sorted(per_doc)])
        logged = res_a["results"][task][f"{metric},none"]
        if logged != agg:
            problems.append(f"{task}: {metric} {logged} in lm-eval's results, {agg!r} from score")
        print(f"{task}: {metric} = {logged!r} (lm-eval, both runs) = {agg!r} (from tarfa-run score); "
              f"{len(per_doc)} documents")
    # loglikelihood_rolling: lm-eval's per-document (logprob, words|bytes) pairs and its
    # aggregations (weighted_perplexity = exp(-sum(ll)/sum(n)), bits_per_byte = -sum(ll)/sum(n)/ln 2),
    # words and bytes counted as lm-eval counts them (re.split(r"\s+"), UTF-8 bytes) in doc order
    if rolled:
        import math
        import re

        docs = sorted(rolled)
        n_words = {d: len(re.split(r"\s+", smp_a[PPL][d]["target"])) for d in docs}
        n_bytes = {d: len(smp_a[PPL][d]["target"].encode("utf-8")) for d in docs}
        for metric, n in (("word_perplexity", n_words), ("byte_perplexity", n_bytes),
                          ("bits_per_byte", n_bytes)):
            for d in docs:
                if smp_a[PPL][d][metric] != [rolled[d], n[d]]:
                    problems.append(f"{PPL} doc {d}: {metric} logged {smp_a[PPL][d][metric]}, "
                                    f"from score {[rolled[d], n[d]]}")
            wm = sum(rolled[d] for d in docs) / sum(n[d] for d in docs)
            agg = -wm / math.log(2) if metric == "bits_per_byte" else math.exp(-wm)
            logged = res_a["results"][PPL][f"{metric},none"]
            if logged != agg:
                problems.append(f"{PPL}: {metric} {logged} in lm-eval's results, {agg!r} from score")
            print(f"{PPL}: {metric} = {logged!r} (lm-eval, both runs) = {agg!r} (from tarfa-run "
                  f"score); {len(docs)} documents")
    n_mc = sum(1 for w in where if w[0] == MC)
    print(f"compared: {n_mc} loglikelihoods (f64 bits and is_greedy), {len(rolled)} rolling "
          f"loglikelihoods (f64 bits) and {len(where) - n_mc - len(rolled)} generations (text) "
          f"against tarfa-run score; every sample of both runs")
    for p in problems:
        print("DIFFERENT:", p)
    print("IDENTICAL" if not problems else f"{len(problems)} differences")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
