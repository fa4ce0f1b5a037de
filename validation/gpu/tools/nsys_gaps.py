#!/usr/bin/env python3
"""Kernel durations and the gaps between them in the last decode steps of an nsys trace.

    nsys_gaps.py TRACE.csv   (nsys stats --report cuda_gpu_trace --format csv)

A decode step ends with the lm_head kernel, so the steps are the runs of kernels that end at
an `lmhead` kernel; the last three are summarised: per kernel name, launches per step, GPU
time and the idle time before each launch (start minus the previous kernel's end), in us.
"""
import csv
import sys
from collections import OrderedDict


def main():
    rows = list(csv.reader(open(sys.argv[1])))
    head = next(i for i, r in enumerate(rows) if r and r[0].startswith("Start"))
    cols = rows[head]
    c_start = next(i for i, c in enumerate(cols) if c.startswith("Start"))
    c_dur = next(i for i, c in enumerate(cols) if c.startswith("Duration"))
    c_name = next(i for i, c in enumerate(cols) if c.strip() == "Name")
    ks = []
    for r in rows[head + 1:]:
        if len(r) <= c_name or r[c_name].startswith("[CUDA"):
            continue
        ks.append((float(r[c_start]), float(r[c_dur]), r[c_name].split("(")[0].split("<")[0]))
    ks.sort()
    ends = [i for i, k in enumerate(ks) if k[2].startswith("lmhead")]
    if len(ends) < 2:
        print("fewer than two decode steps in the trace")
        return
    steps = [(ends[j - 1] + 1, ends[j]) for j in range(max(1, len(ends) - 3), len(ends))]
    agg = OrderedDict()
    total_wall = total_busy = 0.0
    for a, b in steps:
        total_wall += ks[b][0] + ks[b][1] - ks[a][0]
        for i in range(a, b + 1):
            s, d, n = ks[i]
            gap = s - (ks[i - 1][0] + ks[i - 1][1]) if i > a else 0.0
            e = agg.setdefault(n, [0, 0.0, 0.0])
            e[0] += 1
            e[1] += d
            e[2] += gap
            total_busy += d
    m = len(steps)
    print(f"{m} decode steps: {total_wall / m / 1e3:.1f} us per step, kernels busy "
          f"{total_busy / m / 1e3:.1f} us, idle between kernels {(total_wall - total_busy) / m / 1e3:.1f} us")
    print(f"{'kernel':<22} {'launches':>8} {'us/step':>9} {'us/launch':>9} {'gap us/launch':>13}")
    for n, (c, d, g) in agg.items():
        print(f"{n:<22} {c / m:>8.0f} {d / m / 1e3:>9.1f} {d / c / 1e3:>9.2f} {g / c / 1e3:>13.2f}")


if __name__ == "__main__":
    main()
