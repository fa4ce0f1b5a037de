#!/usr/bin/env python3
"""The streaming benchmark's table (validation/gpu/bench-stream.sh).

    stream_table.py OUT_JSON IO_BENCH_JSON RUN_JSON...

Each RUN_JSON is `tarfa-run generate --summary-json` output with "label" and "model" added by
the script. The I/O roofline of a run is the disk's read bandwidth for whole extents at queue
depth 4 (a decode layer misses 2-8 experts, read at once) divided by the bytes the run read per
decode token; the share is tok/s over that. Prints one line per run, then writes everything
to OUT_JSON.
"""
import json
import sys


def load(p):
    with open(p) as f:
        return json.load(f)


def main():
    out_path, io_paths, runs = sys.argv[1], sys.argv[2], sys.argv[3:]
    io = {}
    for p in io_paths.split(","):
        d = load(p)
        io[d["model"]] = {r["queue_depth"]: r["gbs"] for r in d["results"]}
    rows = []
    for p in runs:
        try:
            d = load(p)
        except (OSError, ValueError) as e:
            print(f"{p}: unreadable ({e})")
            continue
        st = d["stream"]
        steps = [s for s in st["steps"] if s["kind"] == "decode"]
        pre = [s for s in st["steps"] if s["kind"] == "prefill"]
        n = len(steps)
        if n == 0:
            continue
        tot = lambda k: sum((s.get(k) or 0) for s in steps)
        bytes_tok = tot("bytes_read") / n
        wall_tok = tot("wall_ms") / n
        tok_s = 1e3 / wall_tok if wall_tok > 0 else 0.0
        bw = io.get(d["model"], {})
        bw4 = bw.get(4) or 0.0
        bw16 = bw.get(16) or 0.0
        roof = bw4 * 1e9 / bytes_tok if bytes_tok > 0 else float("inf")
        hot_req, hot_hits = tot("hot_requests"), tot("hot_hits")
        req, warm = tot("requests"), tot("warm_hits")
        walls = sorted(s["wall_ms"] for s in steps)
        pick = lambda q: walls[min(len(walls) - 1, int(q * len(walls)))]
        row = {
            "wall_ms_per_token_median": pick(0.5),
            "wall_ms_per_token_p10_p90": [pick(0.1), pick(0.9)],
            "model": d["model"],
            "label": d["label"],
            "decode_tokens": n,
            "decode_tok_s": tok_s,
            "bytes_read_per_token": bytes_tok,
            "disk_gb_s_while_reading": (tot("bytes_read") / (tot("read_busy_ms") * 1e6))
            if tot("read_busy_ms") > 0 else None,
            "hot_hit_rate": hot_hits / hot_req if hot_req else None,
            "warm_hit_rate": warm / req if req else None,
            "roofline_tok_s_qd4": roof,
            "share_of_roofline_qd4": tok_s / roof if roof not in (0, float("inf")) else None,
            "share_of_roofline_qd16": (tok_s * bytes_tok / (bw16 * 1e9)) if bw16 else None,
            "ms_per_token": {
                "wall": wall_tok,
                "io_wait": tot("io_wait_ms") / n,
                "h2d": tot("h2d_ms") / n,
                "compute": tot("compute_ms") / n,
                "verify_cpu": tot("verify_ms") / n,
            },
            "prefill": [{
                "tokens": s["tokens"],
                "wall_ms": s["wall_ms"],
                "experts_needed": s.get("hot_requests") if s.get("hot_requests") is not None else s["requests"],
                "reads": s["reads"],
                # each expert a chunk misses is read once: reads / (warm-tier misses)
                "reads_per_missed_expert": s["reads"] / max(1, s["requests"] - s["warm_hits"]),
            } for s in pre],
            "page_cache_bytes_after": d.get("page_cache_bytes_after"),
            "flags": d.get("flags"),
        }
        rows.append(row)
    with open(out_path, "w") as f:
        json.dump({"io_bench": io, "runs": rows}, f, indent=1)
    for m, bw in io.items():
        print(f"TABLE|disk {m}|-|whole extents, O_DIRECT: " +
              ", ".join(f"QD{q} {g:.2f} GB/s" for q, g in sorted(bw.items())))
    for r in rows:
        pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"
        t = r["ms_per_token"]
        pf = r["prefill"][0] if r["prefill"] else None
        print(f"TABLE|{r['model']} {r['label']}|{r['decode_tok_s']:.2f} tok/s|"
              f"{r['bytes_read_per_token'] / 1e6:.0f} MB/token read, hot {pct(r['hot_hit_rate'])}, "
              f"warm {pct(r['warm_hit_rate'])}, roofline(QD4) {r['roofline_tok_s_qd4']:.2f} tok/s = "
              f"{pct(r['share_of_roofline_qd4'])} (QD16 {pct(r['share_of_roofline_qd16'])}); ms/token: "
              f"io-wait {t['io_wait']:.0f}, h2d {t['h2d']:.0f}, compute {t['compute']:.0f}, "
              f"verify(cpu) {t['verify_cpu']:.0f}; per token median {r['wall_ms_per_token_median']:.0f} ms "
              f"(p10-p90 {r['wall_ms_per_token_p10_p90'][0]:.0f}-{r['wall_ms_per_token_p10_p90'][1]:.0f})"
              + (f"; prefill {pf['tokens']} tok {pf['wall_ms'] / 1e3:.1f} s, "
                 f"{pf['reads_per_missed_expert']:.2f} reads/missed expert, {pf['experts_needed']} experts needed" if pf else ""))


if __name__ == "__main__":
    main()
