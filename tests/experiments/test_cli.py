"""The entry points parse and list every flag (`--helpfull`), without loading a model (the probes are forked from a
server that has imported the libraries: tests/cli_fork.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import cli_fork

ROOT = Path(__file__).resolve().parents[2]
ENV = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}

EXPECTED = {
    "generate": ["--model", "--prompt", "--prompt_file", "--max_new_tokens", "--temperature", "--top_p", "--top_k",
                 "--seed", "--dtype", "--strategy", "--anchors", "--num_anchors", "--topk_frac", "--head_map",
                 "--stop", "--chunk_size"],
    "eval": ["--model", "--strategies", "--anchors", "--num_anchors", "--topk_frac", "--tasks", "--context_lengths",
             "--num_samples", "--seed", "--batch_size", "--output_dir"],
    "calibrate": ["--model", "--dataset", "--calib_num_prompts", "--calib_k", "--tile_size", "--output_dir"],
    "bench": ["--phase", "--decode_contexts", "--prefill_contexts", "--heads", "--num_layers", "--num_anchors",
              "--bench_tag"],
    "bench_decode": ["--decode_contexts", "--decode_out", "--heads", "--num_layers", "--num_anchors", "--bench_tag"],
    "bench_prefill": ["--prefill_contexts", "--prefill_out", "--heads", "--num_layers", "--num_anchors",
                      "--bench_tag"],
    "speed": ["--model", "--prompt_len", "--new_tokens", "--strategy"],
    "accuracy": ["--mode", "--inputs", "--max_slowdown"],
    "kascade_agreement": ["--doc", "--topk_fracs", "--strategies"],
    "merge_eval": ["--inputs", "--labels", "--merged_dir"],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_helpfull_lists_flags(name):
    res = cli_fork.run(["-m", f"experiments.{name}", "--helpfull"], ENV, cwd=ROOT)
    # absl prints the help and exits with status 1
    assert res.returncode in (0, 1) and "Traceback" not in res.stderr, res.stderr[-2000:]
    for flag in EXPECTED[name]:
        assert flag in res.stdout, f"{name}: {flag} missing from --helpfull"
    assert "--[no]verbose" in res.stdout, f"{name} does not run through experiments.cli"


# The shared flags each command must list under plain --help (issue 15: not only under --helpfull).
KASCADE_SHARED = ["--model", "--dtype", "--anchors", "--num_anchors", "--recipe", "--calib_num_prompts",
                  "--calib_max_tokens", "--calib_k", "--head_map", "--topk_frac", "--tile_size", "--verbose"]
SHARED_HELP = {
    "generate": KASCADE_SHARED + ["--chunk_size", "--min_k", "--prompt_file"],
    "speed": KASCADE_SHARED + ["--chunk_size", "--min_k", "--prompt_len"],
    "eval": KASCADE_SHARED + ["--chunk_size", "--min_k", "--tasks", "--overwrite", "--resume"],
    "calibrate": ["--model", "--dtype", "--calib_num_prompts", "--calib_k", "--calib_max_tokens", "--tile_size",
                  "--verbose"],
    "bench": ["--phase", "--heads", "--num_layers", "--num_anchors", "--decode_contexts", "--prefill_contexts",
              "--mesh", "--verbose"],
    "bench_decode": ["--heads", "--num_layers", "--num_anchors", "--decode_contexts", "--verbose"],
    "bench_prefill": ["--heads", "--num_layers", "--num_anchors", "--prefill_contexts", "--verbose"],
    "accuracy": ["--mode", "--inputs", "--overwrite", "--verbose"],
    "merge_eval": ["--inputs", "--merged_dir", "--overwrite", "--verbose"],
    "kascade_agreement": ["--model", "--anchors", "--recipe", "--head_map", "--topk_fracs", "--tile_size",
                          "--chunk_size", "--kernels", "--verbose"],
    "bench_e2e": ["--e2e_models", "--e2e_contexts", "--e2e_decode", "--e2e_strategies", "--mesh", "--verbose"],
    "bench_paged": ["--paged_contexts", "--paged_batches", "--paged_page_sizes", "--verbose"],
    "serve_replay": ["--model", "--dtype", "--anchors", "--recipe", "--topk_frac", "--strategies",
                     "--num_requests", "--max_batch", "--page_size", "--verbose"],
}


def test_every_entry_point_is_covered():
    names = {p.stem for p in (ROOT / "experiments").glob("*.py")} - {"__init__", "cli", "common", "recipe_flags",
                                                                     "timing", "devices", "paged_report"}
    assert names == set(SHARED_HELP), names ^ set(SHARED_HELP)


@pytest.mark.parametrize("name", sorted(SHARED_HELP))
def test_help_exits_0_and_lists_the_shared_flags(name):
    res = cli_fork.run(["-m", f"experiments.{name}", "--help"], ENV, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    listed = {line.split(":")[0].strip().replace("--[no]", "--") for line in res.stdout.splitlines()
              if line.startswith("  --")}
    missing = [f for f in SHARED_HELP[name] if f not in listed]
    assert not missing, f"{name} --help lacks {missing}"
    assert "--calib_prompts" not in listed and "--helpfull" in res.stdout  # deprecated aliases stay out of --help


def test_generate_requires_a_prompt():
    res = cli_fork.run(["-m", "experiments.generate"], ENV, cwd=ROOT)
    assert res.returncode != 0 and "--prompt" in (res.stderr + res.stdout)


def test_bench_write_outputs(tmp_path):
    import json

    from kascade_jax.bench.store import write_outputs

    rows = [dict(context=8192, speedup=3.5)]
    write_outputs(str(tmp_path / "out"), "decode", dict(rows=rows), "# table\n",
                  plot=lambda path: open(path, "wb").write(b"png"))
    assert json.load(open(tmp_path / "out" / "decode.json")) == dict(rows=rows)
    assert open(tmp_path / "out" / "decode.md").read() == "# table\n"
    assert open(tmp_path / "out" / "decode.png", "rb").read() == b"png"
    write_outputs(str(tmp_path / "out"), "sweep", dict(rows=[]), "x")
    assert not (tmp_path / "out" / "sweep.png").exists()


QWEN05 = dict(q_heads=14, kv_heads=2, head_dim=64, num_layers=24, num_anchors=5)


def test_bench_shape_weighted_formula():
    from kascade_jax.bench.timing import BenchShape

    a0, a, r = 3.0, 2.0, 0.5
    qwen = BenchShape(**QWEN05)
    assert qwen.weighted(a0, a, r) == pytest.approx((a0 + 4 * a + 19 * r) / 24)
    assert qwen.formula() == "(1*A0 + 4*A + 19*R)/24"
    assert qwen.group == 7 and qwen.heads == "14,2,64"
    llama = BenchShape()
    assert llama.weighted(a0, a, r) == pytest.approx((a0 + 4 * a + 27 * r) / 32)
    assert llama.formula() == "(1*A0 + 4*A + 27*R)/32"
    # the extremes of the mix: only layer 0 is an anchor, or every layer is one
    assert BenchShape(num_layers=28, num_anchors=1).weighted(a0, a, r) == pytest.approx((a0 + 27 * r) / 28)
    assert BenchShape(num_layers=4, num_anchors=4).weighted(a0, a, r) == pytest.approx((a0 + 3 * a) / 4)
    assert BenchShape(**QWEN05).record() == QWEN05


def test_bench_shape_parse_and_errors():
    from kascade_jax.bench.timing import BenchShape

    assert BenchShape.parse("14,2,64", 24, 5) == BenchShape(**QWEN05)
    assert BenchShape.parse(["12", "2", "128"], 28) == BenchShape(12, 2, 128, 28, 5)
    assert BenchShape.parse(["32", "8", "128"]) == BenchShape()
    for heads in ("14,2", "14,2,64,1", "14,x,64", ""):
        with pytest.raises(ValueError, match="--heads must be q_heads,kv_heads,head_dim"):
            BenchShape.parse(heads)
    with pytest.raises(ValueError, match=r"q_heads \(14\) must be a multiple of kv_heads \(3\)"):
        BenchShape.parse("14,3,64")
    with pytest.raises(ValueError, match="q_heads must be an int >= 1, got 0"):
        BenchShape.parse("0,2,64")
    with pytest.raises(ValueError, match="head_dim must be an int >= 1"):
        BenchShape(head_dim=-64)
    with pytest.raises(ValueError, match="num_layers must be an int >= 1, got 0"):
        BenchShape(num_layers=0, num_anchors=0)
    with pytest.raises(ValueError, match=r"num_anchors must be an int in \[1, num_layers=24\], got 25"):
        BenchShape(num_layers=24, num_anchors=25)
    with pytest.raises(ValueError, match="num_anchors must be an int in"):
        BenchShape(num_anchors=0)


def test_bench_output_stem_keeps_shapes_apart(tmp_path):
    from kascade_jax.bench.store import note_overwrite, output_stem, recorded_shape, write_outputs
    from kascade_jax.bench.timing import BenchShape

    qwen = BenchShape(**QWEN05)
    assert output_stem("decode", "", BenchShape()) == "decode"
    assert output_stem("decode", "qwen05", qwen) == "decode_qwen05"
    assert output_stem("prefill_sweep", "qwen05", qwen) == "prefill_sweep_qwen05"
    assert output_stem("prefill", "llama-v2", BenchShape()) == "prefill_llama-v2"
    # the untagged files hold the default shape and mix only
    with pytest.raises(ValueError, match="pass --bench_tag=NAME to write decode_NAME"):
        output_stem("decode", "", qwen)
    with pytest.raises(ValueError, match="--num_layers=24"):
        output_stem("prefill", "", BenchShape(num_layers=24))
    for bad in ("../x", "a/b", "_x", "a b"):
        with pytest.raises(ValueError, match="--bench_tag must be"):
            output_stem("decode", bad, qwen)

    out, logs = str(tmp_path), []
    note_overwrite(out, "decode_qwen05", qwen, logs.append)
    assert logs == []  # nothing there yet
    write_outputs(out, "decode_qwen05", dict(meta=dict(shape=qwen.record()), rows=[]), "x")
    assert recorded_shape(str(tmp_path / "decode_qwen05.json")) == qwen
    note_overwrite(out, "decode_qwen05", qwen, logs.append)
    assert "overwriting" in logs[-1] and "--heads=14,2,64 --num_layers=24" in logs[-1] and "(the same shape)" in logs[-1]
    note_overwrite(out, "decode_qwen05", BenchShape(12, 2, 128, 28, 5), logs.append)
    assert "--heads=14,2,64" in logs[-1] and "same shape" not in logs[-1]
    # files from before --heads hold the default shape
    write_outputs(out, "decode", dict(meta=dict(date="x"), rows=[]), "x")
    assert recorded_shape(str(tmp_path / "decode.json")) == BenchShape()
    (tmp_path / "prefill.json").write_text("not json")
    assert recorded_shape(str(tmp_path / "prefill.json")) is None
    note_overwrite(out, "prefill", BenchShape(), logs.append)
    assert "unreadable shape" in logs[-1]


def _fake_rows(shape, decode):
    from kascade_jax.bench.timing import BenchShape

    assert isinstance(shape, BenchShape)
    kernels = {"kascade_kernel": 0.1}
    row = dict(context=16384, topk_frac=0.1, dtype="bfloat16", dense=1.0, A0=1.2, A=0.5, R=0.2, **shape.record())
    for n in ("A0", "A", "R"):
        row[n + "/dense"] = row[n] / row["dense"]
        row[n + "_kernels"] = kernels
    row["weighted"] = shape.weighted(row["A0"], row["A"], row["R"])
    row["speedup"] = row["dense"] / row["weighted"]
    if decode:
        row.update(batch=8, k=1638)
    else:
        row.update(tile=32, A_extra_bytes=1e9, A_out_bytes=2e8)
    return [row]


def test_bench_markdown_labels_shape():
    from kascade_jax.bench import decode as decode_bench
    from kascade_jax.bench import tables
    from kascade_jax.bench.timing import BenchShape

    meta = dict(gpu="H200", date="today", jax="0.11.2", command="bench", tuning="t", tile=32, min_k=128)
    llama, qwen = BenchShape(), BenchShape(**QWEN05)
    # the default shape keeps today's header lines
    md = tables.decode_markdown(_fake_rows(llama, True), meta, llama)
    assert "CUPTI kernel time, median of iterations, ms. 32 q heads, 8 kv heads, d 128, every sequence at full " \
           "length.\nWeighted = (1*A0 + 4*A + 27*R)/32 (Llama-3.1-8B: 32 layers, 5 anchors).\n" in md
    md = tables.decode_markdown(_fake_rows(qwen, True), meta, qwen)
    assert "14 q heads, 2 kv heads, d 64" in md
    assert "Weighted = (1*A0 + 4*A + 19*R)/24 (Qwen2.5-Coder-0.5B: 24 layers, 5 anchors)." in md
    w = (1.2 + 4 * 0.5 + 19 * 0.2) / 24
    assert f"| {w:.4f} | **{1 / w:.2f}x** |" in md and "decode_rerank" not in md
    pl = _fake_rows(qwen, True)  # with the pool pieces (--decode_pools=all): their own table, against plain
    pl[0].update(A0_poolall=1.1, A_poolall=0.4, R_poolall=0.2, weighted_poolall=qwen.weighted(1.1, 0.4, 0.2))
    pl[0]["speedup_poolall"] = 1 / pl[0]["weighted_poolall"]
    md = tables.decode_markdown(pl, meta, qwen)
    wa = (1.1 + 4 * 0.4 + 19 * 0.2) / 24
    assert "The selection pool" in md and "decode_rerank" not in md
    assert f"| all | 1.1000 | 0.4000 | 0.2000 | 0.200 | {wa:.4f} | **{1 / wa:.2f}x** | {w / wa:.2f} |" in md
    ss = _fake_rows(qwen, True)  # with the short select pieces (--decode_short_select=0,16384w16 --decode_pools=all)
    for t, a in (("ss0_all", 0.5), ("ss16384w16_all", 0.4)):
        ss[0].update({f"A0_{t}": 1.2, f"A_{t}": a, f"A_{t}_kernels": {"kascade_topk_short": 0.01},
                      f"weighted_{t}": qwen.weighted(1.2, a, 0.2)})
        ss[0][f"speedup_{t}"] = 1 / ss[0][f"weighted_{t}"]
    md = tables.decode_markdown(ss, meta, qwen)
    ws = (1.2 + 4 * 0.4 + 19 * 0.2) / 24
    assert "The short-row select" in md and f"| 0, all | 1.2000 | 0.5000 | {w:.4f} |" in md
    assert f"| 16384w16, all | 1.2000 | 0.4000 | {ws:.4f} | **{1 / ws:.2f}x** | {w / ws:.2f} |" in md
    assert "16384w16_all: `kascade_topk_short` 0.0100" in md
    for t, r in (("ss0_all", 0.2), ("ss16384w16_all", 0.15)):  # runs since session 24 record R per setting (c)
        ss[0][f"R_{t}"] = r
        ss[0][f"weighted_{t}"] = qwen.weighted(1.2, ss[0][f"A_{t}"], r)
        ss[0][f"speedup_{t}"] = 1 / ss[0][f"weighted_{t}"]
    md = tables.decode_markdown(ss, meta, qwen)
    wc = (1.2 + 4 * 0.4 + 19 * 0.15) / 24
    assert f"| 16384w16, all | 1.2000 | 0.4000 | 0.1500 | {wc:.4f} | **{1 / wc:.2f}x** | {w / wc:.2f} |" in md
    rr = _fake_rows(qwen, True)  # with the rerank pieces (--decode_reranks=4): their own table, against plain
    rr[0].update(A0_rr4=1.3, A_rr4=0.6, R_rr4=0.5, R_rr4_kernels={"gather": 0.3})
    rr[0].update(weighted_rr4=qwen.weighted(1.3, 0.6, 0.5))
    rr[0]["speedup_rr4"] = 1 / rr[0]["weighted_rr4"]
    md = tables.decode_markdown(rr, meta, qwen)
    w4 = (1.3 + 4 * 0.6 + 19 * 0.5) / 24
    assert f"| 4 | 1.3000 | 0.6000 | 0.5000 | 0.500 | {w4:.4f} | **{1 / w4:.2f}x** | {w / w4:.2f} |" in md
    assert "C=4: `gather` 0.3000" in md and "Only the worst" not in md
    rr[0].update(A0_rr4w5=1.3, A_rr4w5=0.7, R_rr4w5=0.5, F_rr4w5=0.2, R_rr4w5_kernels={"x": 0.1})
    n_rr, rr[0]["weighted_rr4w5"] = decode_bench.worst_weighted(qwen, 5, 1.3, 0.7, 0.5, 0.2)
    rr[0]["speedup_rr4w5"] = 1 / rr[0]["weighted_rr4w5"]
    ww = (1.3 + 4 * 0.7 + 5 * 0.5 + 14 * 0.2) / 24
    assert n_rr == 5 and rr[0]["weighted_rr4w5"] == pytest.approx(ww)
    md = tables.decode_markdown(rr, meta, qwen)
    assert f"| rr4w5 | 1.3000 | 0.7000 | 0.5000 | 0.2000 | {ww:.4f} | **{1 / ww:.2f}x** | {w / ww:.2f} |" in md
    assert f"| 4 | 1.3000 | 0.6000 | 0.5000 | 0.500 | {w4:.4f} |" in md  # the every-layer row is unchanged

    md = tables.prefill_markdown(_fake_rows(llama, False), meta, llama)
    assert "Batch 1, 32 q heads, 8 kv heads, d 128, rolling budgets, tile 32, min_k 128.\nWeighted = " \
           "(1*A0 + 4*A + 27*R)/32 (Llama-3.1-8B: 32 layers, 5 anchors). A extra" in md
    one_five = BenchShape(12, 2, 128, 28, 4)
    md = tables.prefill_markdown(_fake_rows(one_five, False), dict(meta, min_k=64), one_five)
    assert "12 q heads, 2 kv heads, d 128" in md and "min_k 64" in md
    assert "(1*A0 + 3*A + 24*R)/28 (Qwen2.5-Coder-1.5B: 28 layers, 4 anchors)" in md
    srows = [dict(context=32768, spec="(base) ", dense=1.0, A0=1.2, A=0.5, R=0.2, speedup_est=2.0,
                  **{"A0/dense_est": 1.2, "A/dense_est": 0.5, "R/dense_est": 0.2},
                  **{n + "_kernels": {"kascade_kernel": 0.1} for n in ("A0", "A", "R")})]
    md = tables.prefill_sweep_markdown(srows, meta, qwen)
    assert "14 q heads, 2 kv heads, d 64; weighted = (1*A0 + 4*A + 19*R)/24" in md


def test_bench_plots_label_shape(tmp_path):
    pytest.importorskip("matplotlib")
    from kascade_jax.bench import tables
    from kascade_jax.bench.timing import BenchShape

    qwen = BenchShape(**QWEN05)
    tables.decode_plot(_fake_rows(qwen, True), str(tmp_path / "d.png"), qwen)
    tables.prefill_plot(_fake_rows(qwen, False), str(tmp_path / "p.png"), qwen)
    assert (tmp_path / "d.png").stat().st_size > 0 and (tmp_path / "p.png").stat().st_size > 0


def _bench(*args):
    return cli_fork.run(["-m", "experiments.bench", *args], ENV, cwd=ROOT)


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_bench_flags_reach_the_run(phase, tmp_path):
    """On the CPU the benchmarks stop before timing; what they check first shows that the flags got through."""
    out = f"--{phase}_out={tmp_path}"
    res = _bench(f"--phase={phase}", "--heads=14,2,64", "--num_layers=24", out)
    assert res.returncode != 0 and "pass --bench_tag=NAME" in res.stderr, res.stderr[-2000:]
    res = _bench(f"--phase={phase}", "--heads=14,2,64", "--num_layers=24", "--bench_tag=qwen05", out)
    assert res.returncode != 0 and "needs a GPU" in res.stdout + res.stderr, res.stderr[-2000:]
    res = _bench(f"--phase={phase}", "--heads=14,3,64", "--bench_tag=x", out)
    assert res.returncode != 0 and "must be a multiple of kv_heads" in res.stderr, res.stderr[-2000:]
    assert not list(tmp_path.iterdir())


def test_bench_checks_run_at_a_qwen_shape_in_interpret_mode(rng):
    """The benchmarks' reference checks at the GQA group 7 / head_dim 64 shape of Qwen2.5-Coder-0.5B (small)."""
    from kascade_jax.bench import decode, prefill
    from kascade_jax.bench.timing import BenchShape

    seed = int(rng.integers(1 << 30))  # the seeded per-test generator (conftest)
    errs = decode.check(seed=seed, b=2, s=1024, hq=14, kvh=2, d=64, min_k=32, peaky=True, interpret=True)
    assert errs["anchor_out"] < 2e-2
    # the anchor on the fp8 K copy (`--decode_score_fp8`): its reference's index set, most of the bf16 Top-k's mass
    errs = decode.check_fp8(seed=seed, b=2, s=1024, hq=14, kvh=2, d=64, min_k=32, peaky=True, interpret=True)
    assert errs["fp8_idx_worst_rel_score_gap"] <= 1e-4 and errs["fp8_mass_recall_worst"] > 0.97, errs
    errs = prefill.check(seed=seed, s=256, min_k=32, peaky=True, interpret=True, shape=BenchShape(**QWEN05))
    assert errs["exact_set_fraction"] > 0.9
    # Key blocks of 16 (`--prefill_key_block=16`) and fp8 scores (`--prefill_score_fp8`: A against the fp8 operands'
    # scores, A0 against the exact ones), on the backends interpret mode resolves "auto" to (Triton). On a Hopper GPU
    # "auto" is Mosaic GPU, which `bench --prefill_check` checks there; test_prefill_mgpu.py interprets those kernels
    # and their routing (here they took 45 s of the suite).
    errs = prefill.check(seed=seed, s=256, min_k=32, peaky=True, interpret=True, shape=BenchShape(**QWEN05),
                         key_block=16)
    assert errs["exact_set_fraction"] > 0.9 and errs["reuse_out"] < 2e-2, errs
    errs = prefill.check(seed=seed, s=256, min_k=32, peaky=True, interpret=True, shape=BenchShape(**QWEN05),
                         score_fp8=True)
    assert errs["exact_set_fraction"] > 0.9 and errs["anchor0_exact_set_fraction"] > 0.9, errs


def test_generate_and_speed_show_what_runs():
    """Signs of life (issue 15): generate prints the strategy, its kernels and the anchors / head map `auto` chose
    (from the SmolLM2 calibration shipped in the package); speed also shows tqdm progress."""
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin",
           "KASCADE_JAX_CALIBRATION_DIR": "/nonexistent/empty-cache"}  # only the shipped calibration can match
    # launch.sh test's compile settings (lowest XLA effort, this worker's compile cache): what is checked here is
    # what the commands print, not their speed (the two SmolLM2 compiles took 160 s of the suite at full effort)
    env.update({k: v for k, v in os.environ.items() if k == "JAX_DISABLE_MOST_OPTIMIZATIONS"
                or k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))})
    # the two commands are independent: both start at once (each loads the model and compiles on its own core)
    procs = [subprocess.Popen([sys.executable, "-m", *cmd], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env)
             for cmd in (["experiments.generate", "--strategy=kascade", "--prompt=Hi", "--max_new_tokens=2"],
                         ["experiments.speed", "--prompt_len=64", "--new_tokens=2", "--repeats=1"])]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
        done = [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    res = done[0]
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stderr.splitlines()
    assert "strategy: kascade, kernels: reference (kascade_jax kernels)" in lines, res.stderr[-3000:]
    anchors = [l for l in lines if l.startswith("anchors (auto (calibrated)): [0, ")]
    assert anchors and "recipe: recipe=default" in anchors[0]
    assert any(l.startswith("head_map (auto; rows not listed are the identity): L") for l in lines)
    assert "calibrating" not in res.stderr  # the shipped artifact matched its key
    res = done[1]
    assert res.returncode == 0, res.stderr[-3000:]
    assert "strategy: dense, kernels: jnp attention (XLA)" in res.stderr
    assert "compile (prefill, generate): 100%" in res.stderr and "timed repeats: 100%" in res.stderr


def test_prefill_sweep_retimes_the_anchor_layers_for_the_backend():
    """`--prefill_sweep=anchor_backend=mgpu` re-times A0 and A (both anchor kinds take the Mosaic GPU passes), not R."""
    from kascade_jax.bench.prefill import _parts
    from kernels_pallas import prefill as pf

    assert _parts(pf.tuning_from_string("anchor_backend=mgpu"), pf.DEFAULT_TUNING) == {"A0", "A"}
