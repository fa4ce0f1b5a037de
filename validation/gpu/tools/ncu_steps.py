#!/usr/bin/env python3
"""Where a step's GPU time goes, from an ncu run of cuda_bench (validation/gpu/prefill-cli.sh,
STEPS=ncu: `ncu --metrics gpu__time_duration.sum --csv --log-file F.csv ...`).

    python3 validation/gpu/tools/ncu_steps.py F.csv [--top 8] [--steps A:B]

A step starts with its embedding kernel (embed_bf16 / embed_f32: every forward launches it
first), so the launches are cut there. For each step: its kernels, their summed GPU time, and
the kernels that took most of it (time, share, launches). The sum is GPU time with the kernels
serialised by ncu: launch gaps and host work are not in it (compare with the step's wall time
in cuda_bench's own figures)."""
import csv, sys
from collections import defaultdict


def rows_of(path):
    lines = open(path, errors="replace").read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        sys.exit(f"{path}: no ncu CSV header (a line starting with \"ID\")")
    out = []
    for r in csv.DictReader(lines[start:]):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        try:
            ns = float(r["Metric Value"].replace(",", ""))
        except ValueError:
            continue
        out.append((r["Kernel Name"], r.get("Grid Size", ""), ns))
    return out


def main():
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if args else 2)
    top = int(args[args.index("--top") + 1]) if "--top" in args else 8
    rows = rows_of(args[0])
    steps, cur = [], []
    for r in rows:
        if r[0].startswith("embed_") and cur:
            steps.append(cur)
            cur = []
        cur.append(r)
    if cur:
        steps.append(cur)
    lo, hi = 0, len(steps)
    if "--steps" in args:
        a, b = args[args.index("--steps") + 1].split(":")
        lo, hi = int(a or 0), int(b or len(steps))
    print(f"{args[0]}: {len(rows)} kernels, {len(steps)} steps")
    for i, s in enumerate(steps[lo:hi], lo):
        tot = sum(ns for _, _, ns in s)
        by = defaultdict(lambda: [0.0, 0])
        for name, _, ns in s:
            by[name][0] += ns
            by[name][1] += 1
        print(f"step {i}: {len(s)} kernels, {tot / 1e3:.1f} us")
        for name, (ns, n) in sorted(by.items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"    {name[:40]:40s} {ns / 1e3:9.1f} us {100 * ns / tot:5.1f}%  x{n}")


if __name__ == "__main__":
    main()
