#!/usr/bin/env python3
"""Compiles kernels/*.cu to PTX with NVRTC and the runtime's options (compile.rs), then assembles
each with ptxas for sm_90 and prints registers, spills and shared memory per kernel. Needs no GPU:

    pip install --target /work/nvrtc nvidia-cuda-nvrtc==13.0.88
    pip install --target /work/nvcc13 nvidia-cuda-nvcc==13.0.88     # for ptxas
    python3 validation/gpu/tools/ptx_report.py [FILE.cu ...] [--keep DIR]
"""
import ctypes, os, re, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
NVRTC = os.environ.get("NVRTC_LIB", "/work/nvrtc/nvidia/cu13/lib/libnvrtc.so.13")
PTXAS = os.environ.get("PTXAS", "/work/nvcc13/nvidia/cu13/bin/ptxas")
OPTS = [b"--ftz=false", b"--prec-sqrt=true", b"--prec-div=true", b"--fmad=false",
        b"--gpu-architecture=compute_90", b"--std=c++17", b"-lineinfo"]


def full_source(name):
    common = open(os.path.join(ROOT, "kernels/common.cuh")).read()
    body = [l for l in open(os.path.join(ROOT, "kernels", name)).read().splitlines()
            if l.strip() != '#include "common.cuh"']
    return f'{common}\n#line 1 "{name}"\n' + "\n".join(body) + "\n"


def ptx_of(name):
    lib = ctypes.CDLL(NVRTC)
    prog = ctypes.c_void_p()
    src = full_source(name).encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, name.encode(), 0, None, None) == 0
    arr = (ctypes.c_char_p * len(OPTS))(*OPTS)
    rc = lib.nvrtcCompileProgram(prog, len(OPTS), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        sys.exit(f"{name}: NVRTC failed:\n{log.value.decode()}")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value.decode()


def main():
    args = sys.argv[1:]
    keep = None
    if "--keep" in args:
        i = args.index("--keep")
        keep = args[i + 1]
        del args[i:i + 2]
        os.makedirs(keep, exist_ok=True)
    files = args or sorted(f for f in os.listdir(os.path.join(ROOT, "kernels")) if f.endswith(".cu"))
    tmp = keep or tempfile.mkdtemp()
    for f in files:
        ptx = ptx_of(f)
        p = os.path.join(tmp, f + ".ptx")
        open(p, "w").write(ptx)
        r = subprocess.run([PTXAS, "-arch=sm_90", "-v", "-o", os.path.join(tmp, f + ".cubin"), p],
                           capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"{f}: ptxas failed:\n{r.stderr}")
        cur = None
        for line in r.stderr.splitlines():
            m = re.search(r"Compiling entry function '(\w+)'", line)
            if m:
                cur = m.group(1)
            m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
            if m and cur:
                spill = f"stack {m.group(1)} spill {m.group(2)}/{m.group(3)}"
            m = re.search(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?", line)
            if m and cur:
                smem = m.group(2) or "0"
                print(f"{f:14} {cur:22} regs {m.group(1):>3}  smem {smem:>6}  {spill}")
                cur = None


main()
