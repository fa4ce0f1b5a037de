"""Shared fixtures: bundles converted from the repository's oracle fixtures by the workspace's own
`tarfa-convert`, and the `tarfa-run` binary, both from the cargo target dir CI already built
(TARFA_BIN_DIR, else $CARGO_TARGET_DIR/debug, else target/debug)."""

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures" / "oracle"


def bin_dir() -> Path:
    if os.environ.get("TARFA_BIN_DIR"):
        return Path(os.environ["TARFA_BIN_DIR"])
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    return target / "debug"


def run_bin(name, *args, timeout=60):
    """Runs a workspace binary to its end (killed after `timeout` s); returns (code, stdout, stderr)."""
    p = subprocess.run(
        [str(bin_dir() / name), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="session")
def bundle(tmp_path_factory):
    """bundle(name): the fixture `name` converted once per test session."""
    root = tmp_path_factory.mktemp("bundles")
    made = {}

    def get(name):
        if name not in made:
            out = root / name
            code, _, err = run_bin("tarfa-convert", FIXTURES / name, out)
            assert code == 0, err
            made[name] = out
        return made[name]

    return get


@pytest.fixture(scope="session")
def reference():
    """reference(name): transformers' outputs for the fixture (reference.safetensors)."""
    from safetensors.numpy import load_file

    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = load_file(str(FIXTURES / name / "reference.safetensors"))
        return cache[name]

    return get
