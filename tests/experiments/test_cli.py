"""The entry points parse and list every flag (`--helpfull`), without loading a model."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

EXPECTED = {
    "generate": ["--model", "--prompt", "--prompt_file", "--max_new_tokens", "--temperature", "--top_p", "--top_k",
                 "--seed", "--dtype", "--strategy", "--anchors", "--num_anchors", "--topk_frac", "--head_map",
                 "--stop", "--chunk_size"],
    "eval": ["--model", "--strategies", "--anchors", "--num_anchors", "--topk_frac", "--tasks", "--context_lengths",
             "--num_samples", "--seed", "--batch_size", "--output_dir"],
    "calibrate": ["--model", "--dataset", "--num_prompts", "--k", "--tile_size", "--output_dir"],
    "bench": ["--phase", "--decode_contexts", "--prefill_contexts"],
    "speed": ["--model", "--prompt_len", "--new_tokens", "--strategy"],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_helpfull_lists_flags(name):
    res = subprocess.run([sys.executable, "-m", f"experiments.{name}", "--helpfull"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    # absl prints the help and exits with status 1
    assert res.returncode in (0, 1) and "Traceback" not in res.stderr, res.stderr[-2000:]
    for flag in EXPECTED[name]:
        assert flag in res.stdout, f"{name}: {flag} missing from --helpfull"


def test_generate_requires_a_prompt():
    res = subprocess.run([sys.executable, "-m", "experiments.generate"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert res.returncode != 0 and "--prompt" in (res.stderr + res.stdout)


def test_bench_write_outputs(tmp_path):
    import json

    from experiments.timing import write_outputs

    rows = [dict(context=8192, speedup=3.5)]
    write_outputs(str(tmp_path / "out"), "decode", dict(rows=rows), "# table\n",
                  plot=lambda path: open(path, "wb").write(b"png"))
    assert json.load(open(tmp_path / "out" / "decode.json")) == dict(rows=rows)
    assert open(tmp_path / "out" / "decode.md").read() == "# table\n"
    assert open(tmp_path / "out" / "decode.png", "rb").read() == b"png"
    write_outputs(str(tmp_path / "out"), "sweep", dict(rows=[]), "x")
    assert not (tmp_path / "out" / "sweep.png").exists()
