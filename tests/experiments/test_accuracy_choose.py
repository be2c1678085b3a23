"""experiments.accuracy --mode=choose on the committed H200 dev runs: it reproduces the shipped 0.5B default (pooled
dev draws, with the shipped calibration dtype), leaves out dev cells of an earlier default, and draws the frontier; a
cell given by two runs is refused."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
S1, S2 = ROOT / "results/accuracy/h200_2026-12-01_i21s1", ROOT / "results/accuracy/h200_2026-12-02_i21s2"
S3 = ROOT / "results/accuracy/h200_2026-12-02_i21s3"
ENV = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}


S12, S15 = ROOT / "results/accuracy/h200_2026-12-03_i21s12", ROOT / "results/accuracy/h200_2026-12-04_i21s15"
S16, S17 = ROOT / "results/accuracy/h200_2026-12-04_i21s16", ROOT / "results/accuracy/h200_2026-12-04_i21s17"


S34 = ROOT / "results/accuracy/h100_2026-12-06_i21s34"
S35 = ROOT / "results/accuracy/h100_2026-12-06_i21s35"


def _choose(tmp_path, inputs, model="qwen2.5-coder-0.5b", layers=24, shape="qwen05", extra=(), budgets=False,
            fp8=False):
    # the shipped choice's prices: session 12's decode run (plain + rerank) joined with session 15's pools run and,
    # for the decode-budget candidates, session 17's pools at 10/20/30% (first: its rows win); the fp8 K copy's
    # rows (session 34, H100) go last: they price it as a ratio to the plain rows of their own run
    decode = f"{S12 / 'bench' / f'decode_{shape}_rr.json'}+{S15 / 'bench' / f'decode_{shape}_pool.json'}"
    if budgets:
        decode = f"{S17 / 'bench' / f'decode_{shape}_poolk.json'}+{decode}"
    if fp8:
        decode += f"+{S34 / 'dfp8f16q' / f'decode_{shape}_fp8f16.json'}"
    cmd = [sys.executable, "-m", "experiments.accuracy", "--mode=choose", f"--model={model}",
           f"--num_layers={layers}", f"--inputs={','.join(map(str, inputs))}", f"--out={tmp_path / 'r.json'}",
           f"--frontier={tmp_path / 'f.png'}", f"--bench_decode={decode}",
           f"--bench_prefill={S3 / 'bench' / f'prefill_{shape}.json'}", *extra]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)


def test_choose_breaks_a_speed_tie_by_the_dev_score(tmp_path):
    """The 0.5B's dps_all (session 15, on the first dev draw) against ds512s (sessions 2-14): 2% apart in cost,
    inside the speed tie, so the better dev score wins; with no tie the cheaper ds512s would."""
    inputs = [S1 / "dev05", S2 / "dev05b", S15 / "t05_ahp_d"]
    res = _choose(tmp_path, inputs)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["chosen_from"] == "dps_all"
    assert doc["default"]["calib_dtype"] == "bfloat16" and doc["default"]["pool"] == "all"
    assert "ran another recipe than today's shipped default" in res.stdout  # session 1's sw_ds128 'default' cell
    assert "default" not in {r["recipe"] for r in doc["measured"]}
    assert (tmp_path / "f.png").stat().st_size > 10_000
    res = _choose(tmp_path, inputs, extra=["--speed_tie=0", "--overwrite"])
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((tmp_path / "r.json").read_text())["chosen_from"] == "ds512s"


def test_choose_reproduces_the_shipped_1_5b_default(tmp_path):
    """The 1.5B's dense-prefill defaults: dps from its decode_only dev cell (sessions 3-14), then dps_all (16K dev
    only, session 15), then dps_all_dec30 (session 17: judged at 16K and 8K dev, where no candidate is within 1 of
    dense at both, so the best 16K dev score wins), then its fp8 K copy dps_all_dec30_fp8d (sessions 34-35: the same
    -1.33 at 8K dev, the better 16K dev score)."""
    inputs = [S1 / "dev15", S2 / "dev15", S2 / "dec15", S3 / "dev15c", S3 / "do15"]
    s17 = [S16 / "t15_m_d8", S17 / "t15_k_d8", S17 / "t15_k_d16"]
    more = [ROOT / "results/accuracy/h200_2026-12-02_i21s7/dev15_more",  # dps_m8s
            ROOT / "results/accuracy/h200_2026-12-03_i21s10/dev15_rr"]  # dps_rr2, dps_rr4
    fp8_cells = [S34 / "dfp8a15", S35 / "c15_8"]
    res = _choose(tmp_path, inputs + more + [S15 / "t15_ahp_d"] + s17 + fp8_cells, model="qwen2.5-coder-1.5b",
                  layers=28, shape="qwen15", budgets=True, fp8=True, extra=["--context=16384", "--also_contexts=8192"])
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((tmp_path / "r.json").read_text())
    shipped = json.loads((ROOT / "kascade_jax/data/recipes/qwen2.5-coder-1.5b.json").read_text())
    assert doc["chosen_from"] == shipped["chosen_from"] == "dps_all_dec30_fp8d" and doc["default"] == shipped["default"]
    assert doc["measured"] == shipped["measured"] and shipped["test"]["recipe"] == "dps_all_dec30_fp8d"
    assert doc["default"]["decode_only"] is True and doc["default"]["decode_score_fp8"] is True
    assert "no candidate within 1 point(s) of dense here and at 8192" in doc["default"]["note"]
    table = {r["recipe"]: r for r in doc["measured"]}
    assert table["dps_all_dec30_fp8d"]["also_dev_diff_vs_dense"] == table["dps_all_dec30"]["also_dev_diff_vs_dense"]
    assert table["dps_all_dec30_fp8d"]["decode_speedup"] > table["dps_all_dec30"]["decode_speedup"]
    res = _choose(tmp_path, inputs + [S15 / "t15_ahp_d"] + s17, model="qwen2.5-coder-1.5b", layers=28,
                  shape="qwen15", budgets=True, extra=["--context=16384", "--also_contexts=8192", "--overwrite"])
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["chosen_from"] == "dps_all_dec30" and "measured per-layer kernels" in doc["default"]["note"]  # s17
    res = _choose(tmp_path, inputs + [S15 / "t15_ahp_d"], model="qwen2.5-coder-1.5b", layers=28, shape="qwen15",
                  extra=["--overwrite"])
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((tmp_path / "r.json").read_text())["chosen_from"] == "dps_all"  # session 15's choice
    res = _choose(tmp_path, inputs, model="qwen2.5-coder-1.5b", layers=28, shape="qwen15", extra=["--overwrite"])
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((tmp_path / "r.json").read_text())["chosen_from"] == "dps"  # without session 15's cell


def test_choose_reproduces_the_shipped_smollm2_default(tmp_path):
    """SmolLM2's pinned anchor sets (session 17, dev 4K; dense from session 13) and their decode budgets (session 19,
    4K and 8K dev): none within 1 of dense at both lengths, so the smallest worst-length loss among those faster than
    dense, smol_p6_dec30, ships with its anchors pinned; speeds are estimates (no benchmark at its shape). Without
    session 19's cells the same rule picks session 17's smol_p6."""
    s19 = ROOT / "results/accuracy/h200_2026-12-04_i21s19"
    inputs = [ROOT / "results/accuracy/h200_2026-12-03_i21s13/smol_dev", S17 / "smol_pin"]
    base = [sys.executable, "-m", "experiments.accuracy", "--mode=choose", "--model=smollm2-135m", "--num_layers=30",
            "--context=4096", f"--out={tmp_path / 'r.json'}", "--overwrite"]
    s19_cells = [s19 / "smol_dec", s19 / "smol_p6_d8"]
    cmd = base + ["--also_contexts=8192", f"--inputs={','.join(map(str, inputs + s19_cells))}"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=ENV)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((tmp_path / "r.json").read_text())
    shipped = json.loads((ROOT / "kascade_jax/data/recipes/smollm2-135m.json").read_text())
    assert doc["chosen_from"] == shipped["chosen_from"] == "smol_p6_dec30" and doc["default"] == shipped["default"]
    assert doc["default"]["anchors"] == [0, 2, 8, 18, 21, 24] and doc["default"]["decode_topk_frac"] == 0.3
    assert "here and at 8192 tokens" in doc["default"]["note"] and doc["default"]["calib_dtype"] == "float32"
    res = subprocess.run(base + [f"--inputs={','.join(map(str, inputs))}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=ENV)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((tmp_path / "r.json").read_text())["chosen_from"] == "smol_p6"  # session 17's choice


def test_a_replicated_cell_is_refused(tmp_path):
    res = _choose(tmp_path, [S1 / "dev05", S2 / "thr05"])  # the default recipe measured twice on the same prompts
    assert res.returncode != 0 and "is in two runs" in res.stderr


def test_choose_on_three_pooled_dev_draws(tmp_path):
    """Session 21: the 0.5B's candidates on three 16K dev draws (780 prompts each). Pooled, dps_all is 1.5 below dense
    (it qualified on the first draw alone, +0.1) and dps_all_dec20 is the fastest within 1; a cell of one draw only
    does not compete; --dev_splits other than dev and its seed draws are refused."""
    S11, S21 = ROOT / "results/accuracy/h200_2026-12-03_i21s11", ROOT / "results/accuracy/h200_2026-12-04_i21s21"
    inputs = [S1 / "dev05", S11 / "dev05_rep", S15 / "t05_ahp_d", S15 / "t05_ahp_s1", S17 / "t05_k_d",
              *(S21 / f"{p}05_s{i}" for p in "po" for i in range(3))]
    res = _choose(tmp_path, inputs, budgets=True, extra=["--context=16384", "--dev_splits=dev,dev-seed1,dev-seed2"])
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["chosen_from"] == "dps_all_dec20" and doc["dev_splits"] == ["dev", "dev-seed1", "dev-seed2"]
    shipped = json.loads((ROOT / "kascade_jax/data/recipes/qwen2.5-coder-0.5b.json").read_text())  # session 23
    assert shipped["chosen_from"] == "dps_all_dec20" and doc["default"] == shipped["default"]
    assert doc["default"]["calib_dtype"] == "bfloat16" and doc["default"]["decode_topk_frac"] == 0.2
    table = {r["recipe"]: r for r in doc["measured"]}
    assert set(table) == {"dps_all", "dps_all_dec20", "dps_all_dl3", "dps_all_dl1", "dps_all_pk5"}  # on every draw
    assert {r["dev_n"] for r in table.values()} == {780} and not table["dps_all"]["qualifies"]
    assert "3 draws" in doc["default"]["note"]
    # the fp8 K copy (session 28's draw 0, session 35's draws 1 and 2): pooled 1.14 below dense, so it does not
    # qualify and the shipped default stays
    fp8_cells = [ROOT / "results/accuracy/h100_2026-12-05_i21s28/dfp8a05", S35 / "c05_s1", S35 / "c05_s2"]
    res = _choose(tmp_path, inputs + fp8_cells, budgets=True, fp8=True,
                  extra=["--context=16384", "--dev_splits=dev,dev-seed1,dev-seed2", "--overwrite"])
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads((tmp_path / "r.json").read_text())
    table = {r["recipe"]: r for r in doc["measured"]}
    assert doc["chosen_from"] == "dps_all_dec20" and doc["default"] == shipped["default"]
    assert table["dps_all_dec20_fp8d"]["dev_n"] == 780 and not table["dps_all_dec20_fp8d"]["qualifies"]
    assert -1.5 < table["dps_all_dec20_fp8d"]["dev_diff_vs_dense"] < -1.0
    bad = _choose(tmp_path, inputs, extra=["--dev_splits=dev,test", "--overwrite"])
    assert bad.returncode != 0 and "--dev_splits are dev and its other draws" in bad.stderr
