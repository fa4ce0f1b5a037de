#!/usr/bin/env python3
"""Renders every template here on every conversation of conversations.json with Jinja2 itself,
in the environment transformers' apply_chat_template builds (transformers/utils/chat_template_utils.py:
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]),
raise_exception, tojson with ensure_ascii=False), and writes expected.json: the independent
renderer's outputs that tarfa-core/tests/chat_templates.rs checks minijinja against.

    python3 render.py        (needs jinja2; tested with 3.1.6)
"""
import json
import sys
from pathlib import Path

import jinja2
from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = Path(__file__).parent
TEMPLATES = json.loads((HERE / "templates.json").read_text())


def raise_exception(message):
    raise TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def main():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    conversations = json.loads((HERE / "conversations.json").read_text())
    out = {}
    for name, spec in TEMPLATES.items():
        template = env.from_string((HERE / spec["file"]).read_text())
        out[name] = {}
        for c in conversations:
            try:
                text = template.render(
                    messages=c["messages"],
                    add_generation_prompt=c["add_generation_prompt"],
                    **spec["special_tokens"],
                )
                out[name][c["name"]] = {"text": text}
            except TemplateError as e:
                out[name][c["name"]] = {"error": str(e)}
    (HERE / "expected.json").write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
    print(f"jinja2 {jinja2.__version__}: wrote expected.json", file=sys.stderr)


if __name__ == "__main__":
    main()
