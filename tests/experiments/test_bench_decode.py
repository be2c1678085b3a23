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
