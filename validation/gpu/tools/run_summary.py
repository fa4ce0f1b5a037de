#!/usr/bin/env python3
"""One line from `tarfa-run generate --summary-json`: prefill tok/s, the weight bytes a decode
token uses, peak RSS, and when streamed the hot tier's hit rate and the disk bytes per decode
token (arch22-bench.sh's table)."""
import json
import sys

d = json.load(open(sys.argv[1]))
out = "prefill %.0f tok/s, weights %.2f GB/token, peak RSS %.1f GB" % (
    d["prefill_tok_s"], d["decode_weight_bytes_per_token"] / 1e9, d["peak_rss_bytes"] / 1e9)
s = d.get("stream")
if s:
    dec = [st for st in s.get("steps", []) if st.get("kind") == "decode"]
    per = sum(st["bytes_read"] for st in dec) / max(len(dec), 1)
    hit = s["totals"].get("hot_hit_rate")
    out += "; hot hits %s, disk %.3f GB/decode token, peak VRAM %s" % (
        "-" if hit is None else "%.2f" % hit, per / 1e9,
        "-" if s["totals"].get("peak_vram_bytes") is None
        else "%.1f GB" % (s["totals"]["peak_vram_bytes"] / 1e9))
print(out)
