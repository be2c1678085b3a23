"""experiments.accuracy --mode=choose on the committed H200 dev runs: it reproduces the shipped 0.5B default (with the
shipped calibration dtype), leaves out dev cells of an earlier default, and draws the frontier; a cell given by two
runs is refused."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
S1, S2 = ROOT / "results/accuracy/h200_2026-12-01_i21s1", ROOT / "results/accuracy/h200_2026-12-02_i21s2"
S3 = ROOT / "results/accuracy/h200_2026-12-02_i21s3"
ENV = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}


def _choose(tmp_path, inputs, model="qwen2.5-coder-0.5b", layers=24, shape="qwen05"):
    cmd = [sys.executable, "-m", "experiments.accuracy", "--mode=choose", f"--model={model}",
           f"--num_layers={layers}", f"--inputs={','.join(map(str, inputs))}", f"--out={tmp_path / 'r.json'}",
           f"--frontier={tmp_path / 'f.png'}", f"--bench_decode={S3 / 'bench' / f'decode_{shape}.json'}",
           f"--bench_prefill={S3 / 'bench' / f'prefill_{shape}.json'}"]
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


def test_choose_reproduces_the_shipped_1_5b_default(tmp_path):
    """The 1.5B's dense-prefill default comes from its decode_only dev cell (the only one within 1 point)."""
    res = _choose(tmp_path, [S1 / "dev15", S2 / "dev15", S2 / "dec15", S3 / "dev15c", S3 / "do15"],
                  model="qwen2.5-coder-1.5b", layers=28, shape="qwen15")
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((tmp_path / "r.json").read_text())
    shipped = json.loads((ROOT / "kascade_jax/data/recipes/qwen2.5-coder-1.5b.json").read_text())
    assert doc["chosen_from"] == shipped["chosen_from"] == "dps" and doc["default"] == shipped["default"]
    assert doc["default"]["decode_only"] is True and "measured per-layer kernels" in doc["default"]["note"]


def test_a_replicated_cell_is_refused(tmp_path):
    res = _choose(tmp_path, [S1 / "dev05", S2 / "thr05"])  # the default recipe measured twice on the same prompts
    assert res.returncode != 0 and "is in two runs" in res.stderr
