#!/usr/bin/env python3
"""Writes the emulator's translation units: for each kernels/*.cu, emu.h + the source as the
runtime compiles it (common.cuh in front) + one trampoline per `extern "C" __global__` kernel
that unpacks 8-byte argument slots (pointers, int, long, float bits) into its parameters.
    python3 gen.py OUT_DIR"""
import os, re, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
common = open(os.path.join(ROOT, "kernels/common.cuh")).read()
names = []
for f in sorted(os.listdir(os.path.join(ROOT, "kernels"))):
    if not f.endswith(".cu"):
        continue
    body = "\n".join(l for l in open(os.path.join(ROOT, "kernels", f)).read().splitlines()
                     if l.strip() != '#include "common.cuh"')
    src = f"{common}\n#line 1 \"{f}\"\n{body}\n"
    # expand the argument-list macros to read the signatures
    pre = subprocess.run(["g++", "-E", "-P", "-x", "c++", "-DTARFA_EMU", "-"], input=src,
                         capture_output=True, text=True, check=True).stdout
    tramps = []
    for m in re.finditer(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\((.*?)\)\s*\{',
                         pre, re.S):
        name, params = m.group(1), m.group(2)
        args = []
        for i, p in enumerate(x.strip() for x in params.split(",")):
            p = re.sub(r"\s+", " ", p.replace("__restrict__", "")).strip()
            ty = p[: p.rfind(" ")].strip() if "*" not in p else p[: p.rfind("*") + 1].strip()
            if "*" in ty:
                args.append(f"({ty})a[{i}]")
            elif ty in ("int",):
                args.append(f"(int)(unsigned)a[{i}]")
            elif ty in ("long",):
                args.append(f"(long)a[{i}]")
            elif ty in ("float",):
                args.append(f"__uint_as_float((unsigned)a[{i}])")
            elif ty in ("u32", "unsigned", "unsigned int"):
                args.append(f"(unsigned)a[{i}]")
            else:
                sys.exit(f"{f}: {name}: parameter type {ty!r} not handled")
        tramps.append(f"void emu_t_{name}(const unsigned long long* a) {{ {name}({', '.join(args)}); }}")
        names.append(name)
    tu = f'#include "emu.h"\n{src}\n' + "\n".join(tramps) + "\n"
    open(os.path.join(out, f"emu_{f}.cpp"), "w").write(tu)
decl = "\n".join(f"void emu_t_{n}(const unsigned long long*);" for n in names)
table = "\n".join(f'    if (!strcmp(name, "{n}")) return emu_t_{n};' for n in names)
open(os.path.join(out, "emu_find.cpp"), "w").write(
    f'#include <cstring>\n{decl}\ntypedef void (*Tramp)(const unsigned long long*);\n'
    f'Tramp emu_find(const char* name) {{\n{table}\n    return nullptr;\n}}\n')
print(f"{len(names)} kernels")
