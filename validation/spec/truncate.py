#!/usr/bin/env python3
"""A weak draft model for speculative decoding: the first LAYERS decoder layers of a Hugging Face
checkpoint directory (its embeddings, final norm and lm_head kept), with the same tokenizer.

    validation/spec/truncate.py SRC_DIR OUT_DIR LAYERS

Writes OUT_DIR/{config.json (num_hidden_layers = LAYERS), model.safetensors, tokenizer.json,
generation_config.json}; convert it with tarfa-convert. Pure Python (no numpy, no safetensors
package): the tensors' bytes are copied as they are. Only for a checkpoint whose every layer is
alike (decoder_sparse_step 1, no mlp_only_layers): the cut model must be one the runtime runs.
"""
import json
import os
import re
import shutil
import struct
import sys


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    src, out, layers = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cfg = json.load(open(os.path.join(src, "config.json")))
    if layers < 1 or layers > cfg["num_hidden_layers"]:
        sys.exit(f"LAYERS must be 1..{cfg['num_hidden_layers']}")
    os.makedirs(out, exist_ok=True)
    kept = []  # (name, dtype, shape, bytes)
    layer = re.compile(r"^model\.layers\.(\d+)\.")
    for f in sorted(os.listdir(src)):
        if not f.endswith(".safetensors") or not f.startswith("model"):
            continue
        with open(os.path.join(src, f), "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
            base = 8 + n
            for name, t in header.items():
                if name == "__metadata__":
                    continue
                m = layer.match(name)
                if m and int(m.group(1)) >= layers:
                    continue
                a, b = t["data_offsets"]
                fh.seek(base + a)
                kept.append((name, t["dtype"], t["shape"], fh.read(b - a)))
    kept.sort(key=lambda x: x[0])
    header, off = {}, 0
    for name, dtype, shape, data in kept:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(out, "model.safetensors"), "wb") as fh:
        fh.write(struct.pack("<Q", len(h)))
        fh.write(h)
        for _, _, _, data in kept:
            fh.write(data)
    cfg["num_hidden_layers"] = layers
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)
    for f in ("tokenizer.json", "generation_config.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(src, f)):
            shutil.copyfile(os.path.join(src, f), os.path.join(out, f))


if __name__ == "__main__":
    main()
