"""`./launch.sh gpu-test` fails with one clear line where it cannot run the GPU tier (no venv, or a JAX without
a GPU backend, i.e. without the CUDA extra), and says how to fix it."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _launch(*args, **env):
    return subprocess.run(["bash", str(ROOT / "launch.sh"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", **env})


def test_gpu_test_without_a_venv_is_one_line(tmp_path):
    res = _launch("gpu-test", VENV=str(tmp_path / "no-venv"))
    assert res.returncode == 1 and res.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'no-venv'}/bin/python not found; run ./launch.sh setup (or set VENV_PY=/path/to/python)"]


def test_gpu_test_without_a_gpu_names_the_cuda_extra():
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is visible: gpu-test would run the tier")
    res = _launch("gpu-test", VENV_PY=sys.executable, JAX_PLATFORMS="cpu")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    assert lines[0].startswith(f"error: JAX in {sys.executable} sees no GPU (backend: cpu)")
    assert f'{sys.executable} -m pip install -e ".[cuda12,test]"' in lines[0]


def test_readme_examples_name_files_that_exist():
    """The README's `--prompt_file=` examples run as written from the repository root (issue 15)."""
    import re

    paths = re.findall(r"--prompt_file=(\S+)", (ROOT / "README.md").read_text())
    assert paths
    for p in paths:
        assert (ROOT / p).is_file() and len((ROOT / p).read_text()) > 10_000, p
