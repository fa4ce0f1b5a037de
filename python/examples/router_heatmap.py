"""Which experts each token of a prompt is routed to, in every MoE layer, as a PNG heat map.

    python router_heatmap.py BUNDLE [--prompt TEXT | --tokens 1,2,3] [--out router.png]

Each panel is one MoE layer: a row per token, a column per expert, the colour the router's
mixing weight for that expert (blank where the expert was not selected). The weights are the
engine's own (the same bits on any backend, thread count or batch).
"""

import argparse

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt
import numpy as np

import tarfa


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("bundle")
    ap.add_argument("--prompt", help="text (the bundle needs a tokenizer.json)")
    ap.add_argument("--tokens", help="comma-separated token ids")
    ap.add_argument("--out", default="router.png")
    ap.add_argument("--backend", default="auto")
    a = ap.parse_args()

    with tarfa.open(a.bundle, backend=a.backend) as m:
        if a.tokens:
            ids = [int(t) for t in a.tokens.split(",")]
        else:
            ids = m.tokenizer.encode(a.prompt or "The quick brown fox jumps over the lazy dog.")
        try:
            labels = [m.tokenizer.decode([t]) for t in ids]
        except tarfa.InputError:  # no tokenizer.json: label tokens by id
            labels = [str(t) for t in ids]
        out = m.forward(ids)
        n_experts = m.config.get("num_experts") or m.config.get("num_local_experts")

    layers = out.moe_layers
    cols = min(4, len(layers))
    rows = (len(layers) + cols - 1) // cols
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(3.2 * cols, 0.25 * len(ids) * rows + 1.5),
        squeeze=False,
        layout="constrained",
    )
    for ax, layer in zip(axes.flat, layers):
        grid = np.full((len(ids), n_experts), np.nan, dtype=np.float32)
        topk, weights = out.router_topk[layer], out.router_weights[layer]
        for t in range(len(ids)):
            grid[t, topk[t]] = weights[t]
        im = ax.imshow(
            grid, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest"
        )
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_xlabel("expert", fontsize=8)
        ax.set_yticks(range(len(ids)))
        ax.set_yticklabels([repr(s)[1:-1][:12] for s in labels], fontsize=6)
    for ax in list(axes.flat)[len(layers):]:
        ax.axis("off")
    fig.colorbar(im, ax=axes, shrink=0.6, label="routing weight")
    fig.suptitle(f"router choices, bundle {m.root_digest[:12]}", fontsize=10)
    fig.savefig(a.out, dpi=130)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
