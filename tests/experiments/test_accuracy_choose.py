"""experiments.accuracy --mode=choose on the committed H200 dev runs: it reproduces the shipped 0.5B default (with the
shipped calibration dtype), leaves out dev cells of an earlier default, and draws the frontier; a cell given by two
runs is refused."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
S1, S2 = ROOT / "results/accuracy/h200_2026-12-01_i21s1", ROOT / "results/accuracy/h200_2026-12-02_i21s2"
ENV = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}


def _choose(tmp_path, inputs):
    cmd = [sys.executable, "-m", "experiments.accuracy", "--mode=choose", "--model=qwen2.5-coder-0.5b",
           "--num_layers=24", f"--inputs={','.join(map(str, inputs))}", f"--out={tmp_path / 'r.json'}",
           f"--frontier={tmp_path / 'f.png'}"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)


def test_choose_reproduces_the_shipped_default(tmp_path):
    res = _choose(tmp_path, [S1 / "dev05", S2 / "dev05b"])
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((tmp_path / "r.json").read_text())
    shipped = json.loads((ROOT / "kascade_jax/data/recipes/qwen2.5-coder-0.5b.json").read_text())
    assert doc["chosen_from"] == shipped["chosen_from"] == "ds512s" and doc["default"] == shipped["default"]
    assert doc["default"]["calib_dtype"] == "bfloat16"
    assert "ran another recipe than today's shipped default" in res.stdout  # session 1's sw_ds128 'default' cell
    assert "default" not in {r["recipe"] for r in doc["measured"]}
    assert (tmp_path / "f.png").stat().st_size > 10_000


def test_a_replicated_cell_is_refused(tmp_path):
    res = _choose(tmp_path, [S1 / "dev05", S2 / "thr05"])  # the default recipe measured twice on the same prompts
    assert res.returncode != 0 and "is in two runs" in res.stderr
