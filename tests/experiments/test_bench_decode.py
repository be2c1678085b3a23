"""The decode benchmark's reuse-kernel sweep: its settings' parsing and refusals, and its table (the timing itself
needs a GPU: CUPTI)."""

from __future__ import annotations

import pytest

from kascade_jax.bench import decode as bench_decode
from kascade_jax.bench import tables
from kernels_pallas import decode as dec


def test_reuse_sweep_settings():
    base = dec.DecodeTuning(stream_block=64)
    sweep = bench_decode.reuse_tunings(" reuse_splits=10; ;reuse_block=128,reuse_warps=8 ", base)
    assert [text for text, _ in sweep] == ["reuse_splits=10", "reuse_block=128,reuse_warps=8"]
    assert sweep[0][1] == dec.DecodeTuning(stream_block=64, reuse_splits=10)
    assert sweep[1][1] == dec.DecodeTuning(stream_block=64, reuse_block=128, reuse_warps=8)
    assert bench_decode.reuse_tunings("") == []
    with pytest.raises(ValueError, match=r"only the reuse kernel's fields .* got \['target_programs'\]"):
        bench_decode.reuse_tunings("reuse_splits=10;target_programs=2112")
    with pytest.raises(ValueError, match="reuse_block must be a power of two"):
        bench_decode.reuse_tunings("reuse_block=100")


def test_reuse_sweep_table():
    row = dict(dtype="bfloat16", batch=8, context=131072, topk_frac=0.1, k=13107, dense=0.957, A0=1.19, A=0.78,
               R=0.117, weighted=0.234, speedup=4.10, A_kernels={"kascade_anchor_scores": 0.54},
               reuse_sweep={"rs0": "reuse_splits=10"}, A_rs0=0.75, R_rs0=0.08, A0_rs0=1.19, weighted_rs0=0.198,
               speedup_rs0=4.83, R_rs0_kernels={"kascade_reuse_decode": 0.078})
    row.update({f"{p}/dense": row[p] / row["dense"] for p in ("A0", "A", "R")})
    md = tables.decode_markdown([row], dict(date="d", gpu="NVIDIA H200", jax="0.11.2", command="bench", tuning="t"))
    assert "| reuse_splits=10 | 0.7500 | 0.0800 | 0.084 | 0.1980 | **4.83x** | 1.18 |" in md
    assert "reuse_splits=10: `kascade_reuse_decode` 0.0780" in md


def _triton_sass():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "triton_sass.py"
    spec = importlib.util.spec_from_file_location("triton_sass", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_triton_sass_finds_the_prefill_reuse_module():
    ts = _triton_sass()
    mods = ts.lowered_modules("prefill_reuse", 1, 4096, (8, 2, 64), "reuse_rows=64")
    assert len(mods) == 1
    text, warps, stages, grid = mods[0]
    assert "prefill_reuse" in text and warps == 4 and stages == 3  # 64 rows (tile 32 x 2 heads): 4 warps


@pytest.mark.parametrize("kernel", ["anchor", "anchor_fp8", "anchor0", "reuse"])
def test_triton_sass_finds_each_kernels_module(kernel):
    """The SASS probe's lowering half (the compile needs a pip Triton): each kernel's sm_90 module, its launch shape
    and the warps and stages it would be compiled with."""
    ts = _triton_sass()
    mods = ts.lowered_modules(kernel, 2, 4096, (8, 2, 64), "reuse_splits=3" if kernel == "reuse" else "")
    assert len(mods) == 1
    text, warps, stages, grid = mods[0]
    assert ("reuse_decode" if kernel == "reuse" else "anchor_scores") in text and warps == 4
    assert list(grid)[:2] == [2, 2] and stages == (2 if kernel == "reuse" else 3)
    if kernel == "reuse":
        assert list(grid) == [2, 2, 3]  # reuse_splits=3
    if kernel == "anchor_fp8":
        assert "f8E4M3FN" in text
