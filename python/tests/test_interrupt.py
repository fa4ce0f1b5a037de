"""Ctrl-C interrupts a long call: a subprocess starts a call that would run for many minutes,
gets SIGINT, and must leave it through KeyboardInterrupt well within a deadline that only a call
that ignores the signal would miss; the model then gives the bits it gave before."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import tarfa

CHILD = r"""
import sys, tarfa
m = tarfa.open(sys.argv[1], backend="cpu")
before = m.forward([1, 2, 3]).logits.tobytes()
# no EOS in the fixture: 40 generations of 4000 tokens each, many minutes uninterrupted
long = [{"context": [1, 2, 3], "max_tokens": 4000}] * 40
print("calling", flush=True)
try:
    m.score(long)
    print("finished", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
print("usable" if m.forward([1, 2, 3]).logits.tobytes() == before else "changed", flush=True)
"""

# seconds from SIGINT to exit: a generous bound that only a hang (the call running on) misses
DEADLINE = 60


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child is POSIX")
def test_ctrl_c_interrupts_a_long_generation(bundle):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(tarfa.__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]
    )
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(bundle("olmoe-s"))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert p.stdout.readline().strip() == "calling"
        # let the call get into the engine (it cannot finish in this time)
        try:
            p.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        assert p.poll() is None, p.stderr.read()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=DEADLINE)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    assert out.split() == ["interrupted", "usable"], (out, err)
