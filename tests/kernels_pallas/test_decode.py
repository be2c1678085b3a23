"""Pallas decode kernels (kernels_pallas/decode.py, topk.py) against the pure-JAX references.

CPU tier: interpret mode at tiny shapes (ragged kv_len, budgets that do not divide any block, group 3 and 4,
d 64, bf16 and fp16, Gaussian and peaky inputs). GPU tier (`-m gpu`): 32 q heads, 8 kv heads, d 128, 32K, batch 8.
Index sets must equal the reference's up to near-ties: where they differ, the differing keys' reference scores
must agree within a relative 1e-4 (fp32 rounding of the fused pooling). Outputs: every (sequence, head) row's RMS
error within TOL of the output's RMS, a few times the measured noise (bf16 <= 4.0e-3, fp16 <= 5.4e-4 over seeds
0-3); the seed is fixed. A 3% softmax-scale error or one index dropped from one sequence fails (checked by
planting each in the kernels); the head-mapped reuse runs on Gaussian inputs, where every selected key counts.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels_pallas import decode as dec
from kernels_pallas import reference as ref
from kernels_pallas import topk
from tests.kernels_pallas.errors import row_err_global as _row_err

SEED = 0
FOUR = dec.DecodeTuning(short_select_max=0)  # the four-launch select (the default takes the short path to 32K keys)
TOL = {jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3}  # per-row error / output RMS


def _inputs(seed, b, s, hq, kvh, d, dtype, peaky):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, 1, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, s, kvh, d)).astype(np.float32)
    v = rng.standard_normal((b, s, kvh, d)).astype(np.float32)
    if peaky:  # a few keys aligned with the group's mean query: attention mass concentrates on them
        qm = q.reshape(b, kvh, hq // kvh, d).mean(axis=2)
        for bi in range(b):
            for h in range(kvh):
                k[bi, rng.integers(0, s, 6), h] = 3.0 * qm[bi, h]
    kv_len = rng.integers(s // 2, s + 1, size=b).astype(np.int32)
    kv_len[0] = s
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(kv_len))


def _assert_same_selection(idx, ref_idx, scores, counts, kv_len):
    idx, ref_idx, scores = np.asarray(idx), np.asarray(ref_idx), np.asarray(scores)
    assert idx.shape == ref_idx.shape
    for b in range(idx.shape[0]):
        for h in range(idx.shape[1]):
            row = idx[b, h]
            assert np.all(row[counts[b]:] == -1), "ranks past the count must be -1"
            mine = row[: counts[b]]
            assert np.all((mine >= 0) & (mine < kv_len[b])) and len(np.unique(mine)) == len(mine)
            theirs = ref_idx[b, h][ref_idx[b, h] >= 0]
            a, r = set(mine.tolist()), set(theirs.tolist())
            if a != r:  # only near-ties may differ
                sc = scores[b, h]
                only_a, only_r = sorted(a - r), sorted(r - a)
                gap = sc[only_r].max() - sc[only_a].min()
                assert gap <= 1e-4 * abs(sc[theirs].min()), (b, h, only_a, only_r, gap)


def _check_anchor(seed, b, s, hq, kvh, d, dtype, peaky, frac, min_k, pool="gqa", interpret=True, full=True,
                  tuning=dec.DEFAULT_TUNING):
    """Anchor (indices + sparse output) vs the references; with `full` also anchor-0 and reuse through a head map."""
    tol = TOL[jnp.dtype(dtype)]
    q, k, v, kv_len = _inputs(seed, b, s, hq, kvh, d, dtype, peaky)
    k_max = ref.max_budget(s, frac, min_k)
    kw = dict(topk_frac=frac, min_k=min_k, k_max=k_max, pool=pool, interpret=interpret, tuning=tuning)
    impl = "pallas"
    out, idx, counts = jax.jit(lambda *a: dec.anchor_decode(*a, impl=impl, **kw))(q, k, v, kv_len)
    ih = 1 if pool == "all" else kvh
    scores = ref.pooled_scores_decode_reference(q, k, kv_len, pool=pool)
    ref_counts = ref.decode_counts(kv_len, frac, min_k)
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(ref_counts))
    ref_idx = ref.select_topk_reference(scores, ref_counts[:, None], k_max)
    _assert_same_selection(idx, ref_idx, scores, np.asarray(counts), np.asarray(kv_len))
    hm_self = jnp.zeros((kvh,), jnp.int32) if ih == 1 else jnp.arange(kvh, dtype=jnp.int32)
    assert _row_err(out, ref.sparse_decode_reference(q, k, v, kv_len, idx, hm_self)) < tol
    if not full:
        return
    out0, idx0, _ = jax.jit(lambda *a: dec.anchor_decode(*a, impl=impl, dense_out=True, **kw))(q, k, v, kv_len)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(idx0))
    assert _row_err(out0, ref.attention_reference(q, k, v, kv_len - 1, kv_len)) < tol
    # reuse through a non-trivial head map, on the reference's indices of Gaussian inputs (no dominant keys)
    q, k, v, kv_len = _inputs(seed + 1, b, s, hq, kvh, d, dtype, peaky=False)
    ref_counts = ref.decode_counts(kv_len, frac, min_k)
    ref_idx = ref.select_topk_reference(ref.pooled_scores_decode_reference(q, k, kv_len, pool=pool),
                                        ref_counts[:, None], k_max)
    hm = jnp.asarray(np.random.default_rng(seed).integers(0, ih, size=kvh), jnp.int32)
    r_out = jax.jit(lambda *a: dec.reuse_decode(*a, impl=impl, interpret=interpret, tuning=tuning))(
        q, k, v, kv_len, ref_idx, ref_counts, hm)
    assert _row_err(r_out, ref.sparse_decode_reference(q, k, v, kv_len, ref_idx, hm)) < tol


@pytest.mark.parametrize("case", [
    dict(b=2, s=300, hq=6, kvh=2, d=64, dtype=jnp.bfloat16, peaky=True, frac=0.1, min_k=16),  # group 3
    dict(b=2, s=203, hq=8, kvh=2, d=64, dtype=jnp.float16, peaky=False, frac=0.3, min_k=7, pool="all", full=False),
    dict(b=2, s=150, hq=8, kvh=2, d=64, dtype=jnp.bfloat16, peaky=True, frac=0.2, min_k=5, full=False),
    dict(b=2, s=300, hq=6, kvh=2, d=64, dtype=jnp.bfloat16, peaky=True, frac=0.1, min_k=16, tuning=FOUR),
])
def test_anchor_and_reuse_match_reference(case):
    _check_anchor(SEED, **case)


def test_select_window_path_exact(monkeypatch):
    """Rows longer than the buffer go through the sampled window; with the fallback off it must still be exact."""
    monkeypatch.setattr(topk, "FALLBACK", False)
    monkeypatch.setattr(topk, "MIN_CAP", 512)
    rng = np.random.default_rng(SEED)
    b, h, s = 2, 1, 4000
    sc = rng.exponential(size=(b, h, s)).astype(np.float32)
    sc[1, 0, ::7] = 1.5  # exact ties straddling the threshold
    kv_len = jnp.asarray([s, 2700], jnp.int32)
    counts = ref.decode_counts(kv_len, 0.2, 64)
    sc = jnp.where(jnp.arange(s)[None, None] < kv_len[:, None, None], jnp.asarray(sc), -jnp.inf)
    k_max = ref.max_budget(s, 0.2, 64)
    idx = np.asarray(dec.select_topk(sc, kv_len, counts, k_max, interpret=True, tuning=FOUR))
    ref_idx = np.asarray(ref.select_topk_reference(sc, counts[:, None], k_max))
    for bi in range(b):  # identical sets, ties included (both take the lowest index first)
        assert set(idx[bi, 0][idx[bi, 0] >= 0].tolist()) == set(ref_idx[bi, 0][ref_idx[bi, 0] >= 0].tolist())
        assert (idx[bi, 0] >= 0).sum() == counts[bi]


def _select_rows(rng, b, h, s, quantise):
    """Scores [b, h, s] with ragged lengths and -inf (ineligible) keys inside them; optionally quantised (ties).
    Row (b-1, 0) has 1/9 of its keys tied at the 10% quantile: the k-th score's sub-bucket holds hundreds."""
    sc = rng.exponential(size=(b, h, s)).astype(np.float32)
    if quantise:
        sc = np.round(sc * 16.0) / 16.0  # ~1/16 of the row shares each value: ties straddle the threshold
    sc[-1, 0, ::9] = np.float32(np.log(10.0))
    sc[rng.random((b, h, s)) < 0.05] = -np.inf  # masked keys (bits -1) inside the valid length
    kv_len = rng.integers(s // 2, s + 1, size=b).astype(np.int32)
    kv_len[0] = s
    kv_len = jnp.asarray(kv_len)
    return jnp.where(jnp.arange(s)[None, None] < kv_len[:, None, None], jnp.asarray(sc), -jnp.inf), kv_len


def _assert_exact(sc, kv_len, counts, k_max):
    idx = np.asarray(dec.select_topk(sc, kv_len, counts, k_max, interpret=True, tuning=FOUR))
    ref_idx = np.asarray(ref.select_topk_reference(sc, counts[:, None], k_max))
    n_valid = np.asarray(jnp.sum(jnp.isfinite(sc), axis=-1))
    for bi in range(idx.shape[0]):
        for h in range(idx.shape[1]):
            mine, theirs = idx[bi, h], ref_idx[bi, h]
            assert set(mine[mine >= 0].tolist()) == set(theirs[theirs >= 0].tolist()), (bi, h)
            assert (mine >= 0).sum() == min(int(counts[bi]), n_valid[bi, h]), (bi, h)
            assert np.all(mine[int(counts[bi]):] == -1)


@pytest.mark.parametrize("finish_block, long_row", [(512, None), (256, 4096), (32, None)])
def test_select_chunked_window_path_exact(monkeypatch, finish_block, long_row):
    """With the fallback off: several chunks per row (chunk offsets), ragged lengths, budgets that divide
    no block, masked keys, ties. Smaller finish blocks make the buffered sub-bucket span several blocks (selected
    from registers up to FAST_BLOCKS, by the looping path beyond); long_row=4096 gives these rows 16 sub-buckets."""
    monkeypatch.setattr(topk, "FALLBACK", False)
    monkeypatch.setattr(topk, "BLOCKS", dict(topk.BLOCKS, finish=finish_block))
    if long_row:
        monkeypatch.setattr(topk, "LONG_ROW", long_row)
    rng = np.random.default_rng(SEED)
    b, h = 2, 2
    # 9000 keys: two count/compact chunks per row; 3000: rows of <= 2048 keys are their own window, longer ones
    # take the sample (positions repeat) although they fit the buffer.
    cases = [(9000, False, 0.1, 64), (9000, True, 0.13, 37)] + [(3000, False, 0.05, 3)] * (long_row is None)
    for s, quantise, frac, min_k in cases:
        sc, kv_len = _select_rows(rng, b, h, s, quantise)
        counts = ref.decode_counts(kv_len, frac, min_k)
        _assert_exact(sc, kv_len, counts, ref.max_budget(s, frac, min_k))


def test_select_fallback_exact():
    """Rows where the sampled window misses the k-th score (sample positions planted high) or where one value is
    shared by the whole row (sub-bucket over the buffer) take the full-row fallback, which must be exact too.
    An empty row (kv_len 0, budget 0) selects nothing."""
    rng = np.random.default_rng(SEED)
    s = 8192  # >= SAMPLE: sample position j is 2 * j
    sc = rng.exponential(size=(3, 1, s)).astype(np.float32)
    sc[0, 0, ::2] += 20.0  # the sample sees only these: its window lies far above the row's k-th score
    sc[1, 0, :] = 0.75  # all tied: the lowest indices win
    kv_len = jnp.asarray([s, s - 333, 0], jnp.int32)
    sc = jnp.where(jnp.arange(s)[None, None] < kv_len[:, None, None], jnp.asarray(sc), -jnp.inf)
    counts = jnp.asarray([s // 2 + 101, 1000, 0], jnp.int32)  # row 0: the k-th lies among the unplanted keys
    _assert_exact(sc, kv_len, counts, s // 2 + 200)


def test_reference_impl_and_auto_on_cpu():
    q, k, v, kv_len = _inputs(SEED, 2, 40, 4, 2, 64, jnp.float32, False)
    out, idx, counts = dec.anchor_decode(q, k, v, kv_len, topk_frac=0.25, min_k=4, k_max=10)
    assert out.shape == q.shape and idx.shape == (2, 2, 10) and counts.shape == (2,)
    r = dec.reuse_decode(q, k, v, kv_len, idx, counts, jnp.array([1, 0]))
    assert r.shape == q.shape


def test_errors():
    q, k, v, kv_len = _inputs(SEED, 2, 40, 4, 2, 64, jnp.bfloat16, False)
    kw = dict(topk_frac=0.1, min_k=4, k_max=8)
    idx = jnp.zeros((2, 2, 8), jnp.int32)
    cnt = jnp.full((2,), 8, jnp.int32)
    hm = jnp.arange(2, dtype=jnp.int32)
    with pytest.raises(ValueError, match="q must be"):
        dec.anchor_decode(q[:, 0], k, v, kv_len, **kw)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        dec.anchor_decode(q[:, :, :3], k, v, kv_len, **kw)
    with pytest.raises(ValueError, match="head_dim"):
        dec.anchor_decode(q[..., :32], k[..., :32], v[..., :32], kv_len, impl="pallas", **kw)
    with pytest.raises(ValueError, match="bfloat16 or all float16"):
        dec.anchor_decode(q.astype(jnp.float32), k, v, kv_len, impl="pallas", **kw)
    with pytest.raises(ValueError, match="pool"):
        dec.anchor_decode(q, k, v, kv_len, pool="max", **kw)
    with pytest.raises(ValueError, match="topk_frac"):
        dec.anchor_decode(q, k, v, kv_len, topk_frac=1.5, min_k=4, k_max=8)
    with pytest.raises(ValueError, match="k_max"):
        dec.anchor_decode(q, k, v, kv_len, topk_frac=0.1, min_k=4, k_max=0)
    with pytest.raises(ValueError, match="min_k"):
        dec.anchor_decode(q, k, v, kv_len, topk_frac=0.1, min_k=-1, k_max=8)
    with pytest.raises(ValueError, match="impl"):
        dec.anchor_decode(q, k, v, kv_len, impl="cuda", **kw)
    with pytest.raises(ValueError, match="kv_len"):
        dec.reuse_decode(q, k, v, kv_len[:1], idx, cnt, hm)
    with pytest.raises(ValueError, match="idx"):
        dec.reuse_decode(q, k, v, kv_len, idx[0], cnt, hm)
    with pytest.raises(ValueError, match="head_map_row"):
        dec.reuse_decode(q, k, v, kv_len, idx, cnt, hm[:1])
    with pytest.raises(ValueError, match="counts"):
        dec.reuse_decode(q, k, v, kv_len, idx, cnt[:1], hm)
    with pytest.raises(ValueError, match="reuse_block"):
        dec.DecodeTuning(reuse_block=48)


def test_triton_modules_verify_for_sm90(triton_sm90_modules):
    """Lower every kernel for CUDA on the CPU and verify the Triton modules: catches GPU-only lowering errors
    (e.g. a where() of two Python ints became an i1 loop bound) without a GPU."""
    verified = triton_sm90_modules
    b, s, kvh, g, d = 2, 5000, 2, 4, 128
    q = jax.ShapeDtypeStruct((b, 1, kvh * g, d), jnp.bfloat16)
    kc = jax.ShapeDtypeStruct((b, s, kvh, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b,), jnp.int32)
    for tuning in (dec.DEFAULT_TUNING, dec.DecodeTuning(short_select_max=0)):  # the short select, the four launches
        fn = lambda q, k, v, l: dec.anchor_decode(q, k, v, l, topk_frac=0.1, min_k=16, k_max=600, impl="pallas",
                                                  tuning=tuning)
        jax.jit(fn).trace(q, kc, kc, kv).lower(lowering_platforms=("cuda",))
        fn0 = lambda q, k, v, l: dec.anchor_decode(q, k, v, l, topk_frac=0.1, min_k=16, k_max=600, impl="pallas",
                                                   dense_out=True, tuning=tuning)
        jax.jit(fn0).trace(q, kc, kc, kv).lower(lowering_platforms=("cuda",))
    # stream, select, reuse; anchor-0 has no reuse. The select: one kernel at 5000 keys by default, else four
    assert len(verified) == (3 + 2) + (6 + 5)


def test_no_pad_of_q_around_the_kernels():
    """Each kernel loads its KV head's query rows itself (a masked gather from [q_heads, d]): at the 0.5B's shape
    (group 7, padded to 16 rows in registers) no XLA pad runs before the reuse, anchor or dense decode (each was a
    separate 1.3-1.5 us fusion). The old `jnp.pad` of q fails this."""
    b, s, kvh, g, d, k_max = 4, 4096, 2, 7, 64, 512
    q = jnp.zeros((b, 1, kvh * g, d), jnp.bfloat16)
    kc = jnp.zeros((b, s, kvh, d), jnp.bfloat16)
    kv = jnp.full((b,), s, jnp.int32)
    idx = jnp.zeros((b, kvh, k_max), jnp.int32)
    calls = {
        "reuse": lambda: dec.reuse_decode(q, kc, kc, kv, idx, kv // 10, jnp.arange(kvh), impl="pallas",
                                          interpret=True),
        "anchor": lambda: dec.anchor_decode(q, kc, kc, kv, topk_frac=0.1, min_k=16, k_max=k_max, impl="pallas",
                                            interpret=True),
        "dense": lambda: dec.dense_decode(q, kc, kc, kv, impl="pallas", interpret=True),
    }
    for name, fn in calls.items():
        eqns = jax.make_jaxpr(fn)().eqns  # the top level: what XLA runs around the pallas_calls
        assert any(e.primitive.name == "pallas_call" for e in eqns), name
        pads = [e for e in eqns if e.primitive.name == "pad" or "pad" in str(e.params.get("name"))]  # jnp.pad: a jit
        assert not pads, name


FUSED = dec.DecodeTuning(fused_combine=True)
F16 = dec.DecodeTuning(stream_fp8_f16=True)  # the fp8 K copy widened to float16 against a float16 q (the default)
WIDEN = dec.DecodeTuning(stream_fp8_f16=False)  # ... widened to bf16


@pytest.mark.parametrize("g, splits", [(7, 0), (3, 0), (4, 40)])
def test_fused_combine_matches_xla(g, splits):
    """DecodeTuning.fused_combine (one Pallas launch for the split-K combine) gives the XLA combine's outputs: the
    reuse (with its lse) and anchor 0's dense output at groups 7 and 3 with ragged lengths, an empty sequence and
    a budget of 0; 40 splits (over COMBINE_MAX_SPLITS) take XLA's path. A wrong split weight or a row written
    to the wrong head fails it (the outputs are compared, not just their shapes)."""
    b, s, kvh, d, k_max = 3, 700, 2, 64, 256
    q, k, v, kv_len = _inputs(SEED, b, s, kvh * g, kvh, d, jnp.bfloat16, False)
    kv_len = kv_len.at[2].set(0)
    rng = np.random.default_rng(1)
    idx = jnp.asarray(rng.integers(0, s, (b, kvh, k_max)), jnp.int32)
    counts = jnp.asarray([k_max, 37, 0], jnp.int32)
    t0 = dec.DecodeTuning(reuse_splits=splits, stream_splits=splits)
    t1 = dataclasses.replace(t0, fused_combine=True)
    hm = jnp.arange(kvh)[::-1]
    outs = [dec.reuse_decode(q, k, v, kv_len, idx, counts, hm, impl="pallas", interpret=True, tuning=t,
                             return_lse=True) for t in (t0, t1)]
    for a, c in zip(*outs):
        np.testing.assert_allclose(np.asarray(c, np.float32), np.asarray(a, np.float32), rtol=1e-6, atol=1e-6)
    assert np.isfinite(np.asarray(outs[1][0], np.float32)).all()
    dense = [dec.anchor_decode(q, k, v, kv_len, topk_frac=0.1, min_k=16, k_max=k_max, impl="pallas",
                               interpret=True, dense_out=True, tuning=t)[0] for t in (t0, t1)]
    np.testing.assert_array_equal(np.asarray(dense[1], np.float32), np.asarray(dense[0], np.float32))
    with pytest.raises(ValueError, match="fused_combine"):
        dec.DecodeTuning(fused_combine=1)
    with pytest.raises(ValueError, match="stream_fp8_f16 must be a bool"):
        dec.DecodeTuning(stream_fp8_f16="yes")


def test_fused_combine_lowers_for_sm90(triton_sm90_modules):
    """The combine kernel (group 7: a [7, d] output block written through masked rows) verifies for sm_90 beside the
    reuse kernel; the XLA combine is then gone from the reuse's HLO."""
    verified = triton_sm90_modules
    b, s, kvh, g, d, k_max = 32, 16384, 2, 7, 64, 1640
    q = jax.ShapeDtypeStruct((b, 1, kvh * g, d), jnp.bfloat16)
    kc = jax.ShapeDtypeStruct((b, s, kvh, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b,), jnp.int32)
    ix = jax.ShapeDtypeStruct((b, kvh, k_max), jnp.int32)
    texts = []
    for tuning in (dec.DEFAULT_TUNING, FUSED):
        fn = lambda q, k, v, l, i: dec.reuse_decode(q, k, v, l, i, l // 10, jnp.arange(kvh),  # noqa: E731
                                                    impl="pallas", tuning=tuning)
        texts.append(jax.jit(fn).trace(q, kc, kc, kv, ix).lower(lowering_platforms=("cuda",)).as_text())
    assert len(verified) == 1 + 2
    assert "stablehlo.reduce" in texts[0] and "kascade_decode_combine" not in texts[0]
    assert "stablehlo.reduce" not in texts[1] and "kascade_decode_combine" in texts[1]


@pytest.mark.gpu
@pytest.mark.parametrize("peaky", [False, True])
@pytest.mark.parametrize("tuning", ["default", "four", "fused"])
def test_gpu_realistic(peaky, tuning):
    _check_anchor(SEED, 8, 32768, 32, 8, 128, jnp.bfloat16, peaky, 0.1, 128, interpret=False,
                  tuning=dict(default=dec.DEFAULT_TUNING, four=FOUR, fused=FUSED)[tuning])


def _fp8_case(seed, b, s, hq, kvh, d, dtype, peaky, frac, min_k, interpret, tuning=dec.DEFAULT_TUNING):
    """anchor_decode with score_keys (the fp8 K copy) against the reference on the copy widened: the same index set
    (near-ties aside) and the sparse output over it from the bf16 K and V; returns (idx, bf16 idx, counts, kv_len,
    bf16 scores)."""
    tol = TOL[jnp.dtype(dtype)]
    q, k, v, kv_len = _inputs(seed, b, s, hq, kvh, d, dtype, peaky)
    k8, mean, mult = ref.fp8_decode_keys(k, kv_len)
    k_max = ref.max_budget(s, frac, min_k)
    kw = dict(topk_frac=frac, min_k=min_k, k_max=k_max, interpret=interpret, tuning=tuning)
    out, idx, counts = jax.jit(lambda *a: dec.anchor_decode(*a[:4], impl="pallas", score_keys=a[4:], **kw))(
        q, k, v, kv_len, k8, mult)
    scores = ref.pooled_scores_decode_reference(ref.fp8_decode_q(q, mult), k8.astype(dtype), kv_len)
    ref_idx = ref.select_topk_reference(scores, counts[:, None], k_max)
    _assert_same_selection(idx, ref_idx, scores, np.asarray(counts), np.asarray(kv_len))
    assert _row_err(out, ref.sparse_decode_reference(q, k, v, kv_len, idx, jnp.arange(kvh))) < tol
    # the reference path (CPU, impl="reference") takes the same copy
    _, idx_r, _ = dec.anchor_decode(q, k, v, kv_len, impl="reference", score_keys=(k8, mult), **kw)
    _assert_same_selection(idx_r, ref_idx, scores, np.asarray(counts), np.asarray(kv_len))
    bf16 = ref.pooled_scores_decode_reference(q, k, kv_len)
    return np.asarray(idx), np.asarray(ref.select_topk_reference(bf16, counts[:, None], k_max)), \
        np.asarray(counts), np.asarray(kv_len), np.asarray(bf16)


def _mass_recall(idx, ref_idx, scores, counts):
    """Worst share of the exact Top-k's pooled mass that idx keeps, over (sequence, head)."""
    worst = 1.0
    for b in range(idx.shape[0]):
        for h in range(idx.shape[1]):
            sc = scores[b, h]
            mine, theirs = idx[b, h, :counts[b]], ref_idx[b, h, :counts[b]]
            worst = min(worst, float(sc[mine].sum() / sc[theirs].sum()))
    return worst


@pytest.mark.parametrize("case", [
    dict(b=2, s=300, hq=6, kvh=2, d=64, dtype=jnp.bfloat16, peaky=True, frac=0.1, min_k=16),
    dict(b=2, s=203, hq=8, kvh=2, d=128, dtype=jnp.float16, peaky=False, frac=0.2, min_k=7),
])
@pytest.mark.parametrize("tuning", ["widen", "f16"])
def test_score_keys_fp8_match_reference(case, tuning):
    """The whole-cache pass on the fp8 K copy (interpret), K widened in registers to q's dtype or to float16 against a
    float16 q (the same logits): the selection of the widened copy's pooled scores, the output from bf16 K and V; the
    copy keeps nearly all of the bf16 Top-k's mass."""
    tuning = dict(widen=WIDEN, f16=F16)[tuning]
    idx, idx_bf16, counts, _, bf16 = _fp8_case(SEED, interpret=True, tuning=tuning, **case)
    assert _mass_recall(idx, idx_bf16, bf16, counts) > 0.97


def test_fp8_decode_keys_and_tokens():
    """The copy's coding: centred on the valid keys' mean (keys past kv_len are 0), one power-of-two scale per
    sequence with the amax <= 448; a later key coded by fp8_decode_token as the copy coded the prompt's keys; a key
    far out saturates at +-448 (no NaN); q * mult times the widened copy is q.k up to a per-row constant."""
    q, k, _, kv_len = _inputs(1, 2, 64, 4, 2, 64, jnp.bfloat16, peaky=False)
    k = k + 5.0  # a shared offset, as real keys have: centring removes it
    k8, mean, mult = ref.fp8_decode_keys(k, kv_len)
    s = 1.0 / np.asarray(mult)
    assert np.all(np.log2(s) == np.round(np.log2(s)))
    k8f = np.asarray(k8.astype(jnp.float32))
    for b in range(2):
        assert np.abs(k8f[b, :kv_len[b]]).max() <= 448 and np.abs(k8f[b, :kv_len[b]]).max() > 224
        assert np.all(k8f[b, kv_len[b]:] == 0)
    again = ref.fp8_decode_token(k[:, :5], mean, mult)
    np.testing.assert_array_equal(np.asarray(again.astype(jnp.float32)), k8f[:, :5])
    far = ref.fp8_decode_token(k[:, :1] * 1e4, mean, mult).astype(jnp.float32)
    assert np.all(np.isfinite(np.asarray(far))) and float(jnp.abs(far).max()) == 448.0
    logits = np.einsum("bhd,bkhd->bhk", np.asarray(ref.fp8_decode_q(q, mult), np.float32)[:, 0, ::2], k8f)
    exact = np.einsum("bhd,bkhd->bhk", np.asarray(q, np.float32)[:, 0, ::2], np.asarray(k, np.float32))
    diff = (exact - logits)[0, :, :kv_len[0]]
    assert np.abs(diff - diff.mean(axis=-1, keepdims=True)).max() < 0.05 * np.abs(exact).max()


def test_fp8_q16_is_exact():
    """q in float16 for the float16 widening (`reference.fp8_decode_q16`): one power-of-two scale per sequence with
    the amax in [2^13, 2^14), and q16 * inv is q * mult (`fp8_decode_q`) exactly: a bf16 q fits float16's mantissa; a
    zero q keeps scale 1."""
    q, k, _, kv_len = _inputs(3, 3, 64, 8, 2, 128, jnp.bfloat16, peaky=True)
    q = q.at[2].set(0.0)
    _, _, mult = ref.fp8_decode_keys(k, kv_len)
    q16, inv = ref.fp8_decode_q16(q, mult)
    assert q16.dtype == jnp.float16 and q16.shape == q.shape and inv.shape == (3,)
    assert np.all(np.frexp(np.asarray(inv))[0] == 0.5)  # powers of two
    amax = np.abs(np.asarray(q16, np.float32)).reshape(3, -1).max(axis=1)
    assert np.all((amax[:2] >= 2 ** 13) & (amax[:2] < 2 ** 14)) and amax[2] == 0 and float(inv[2]) == 1.0
    want = np.asarray(ref.fp8_decode_q(q, mult), np.float32)
    np.testing.assert_array_equal(np.asarray(q16, np.float32) * np.asarray(inv)[:, None, None, None], want)


def test_score_keys_errors():
    q, k, v, kv_len = _inputs(0, 2, 64, 4, 2, 64, jnp.bfloat16, peaky=False)
    k8, _, mult = ref.fp8_decode_keys(k, kv_len)
    kw = dict(topk_frac=0.1, min_k=8, k_max=16, impl="reference")
    with pytest.raises(ValueError, match="float8_e4m3fn of the K cache's shape"):
        dec.anchor_decode(q, k, v, kv_len, score_keys=(k, mult), **kw)
    with pytest.raises(ValueError, match="float8_e4m3fn of the K cache's shape"):
        dec.anchor_decode(q, k, v, kv_len, score_keys=(k8[:, :32], mult), **kw)
    with pytest.raises(ValueError, match="mult must have shape"):
        dec.anchor_decode(q, k, v, kv_len, score_keys=(k8, mult[:1]), **kw)
    with pytest.raises(ValueError, match="a pair"):
        dec.anchor_decode(q, k, v, kv_len, score_keys=k8, **kw)
    with pytest.raises(ValueError, match="dense_out"):
        dec.anchor_decode(q, k, v, kv_len, score_keys=(k8, mult), dense_out=True, **kw)


def test_score_keys_lower_for_sm90(triton_sm90_modules):
    """The whole-cache pass on an fp8 K (widened in registers) lowers and verifies for sm_90."""
    verified = triton_sm90_modules
    b, s, kvh, g, d = 2, 5000, 2, 6, 128
    q = jax.ShapeDtypeStruct((b, 1, kvh * g, d), jnp.bfloat16)
    kc = jax.ShapeDtypeStruct((b, s, kvh, d), jnp.bfloat16)
    k8 = jax.ShapeDtypeStruct((b, s, kvh, d), jnp.float8_e4m3fn)
    kv = jax.ShapeDtypeStruct((b,), jnp.int32)
    mult = jax.ShapeDtypeStruct((b,), jnp.float32)
    fn = lambda q, k, v, l, k8, m: dec.anchor_decode(q, k, v, l, topk_frac=0.1, min_k=16, k_max=600,  # noqa: E731
                                                     impl="pallas", score_keys=(k8, m), tuning=WIDEN)
    jax.jit(fn).trace(q, kc, kc, kv, k8, mult).lower(lowering_platforms=("cuda",))
    assert len(verified) == 3  # stream, select, reuse
    fn = lambda q, k, v, l, k8, m: dec.anchor_decode(q, k, v, l, topk_frac=0.1, min_k=16, k_max=600,  # noqa: E731
                                                     impl="pallas", score_keys=(k8, m), tuning=F16)
    text = jax.jit(fn).trace(q, kc, kc, kv, k8, mult).lower(lowering_platforms=("cuda",)).as_text()
    assert len(verified) == 6 and "kascade_anchor_scores" in text  # the float16 stream pass verifies too
    # the stream modules: K widened to bf16 without stream_fp8_f16, to float16 (a bf16 dot is gone) with it
    dot = r"tt\.dot .*: tensor<16x128x{0}> \* tensor<128x128x{0}> -> tensor<16x128xf32>"
    assert re.search(dot.format("bf16"), verified[0]) and not re.search(dot.format("f16"), verified[0])
    assert re.search(dot.format("f16"), verified[3]) and not re.search(dot.format("bf16"), verified[3])
    assert "tt.fp_to_fp" in verified[3] or "arith.extf" in verified[3]  # fp8 -> float16 in registers


@pytest.mark.gpu
@pytest.mark.parametrize("peaky", [False, True])
@pytest.mark.parametrize("tuning", ["widen", "f16"])
def test_gpu_score_keys_fp8(peaky, tuning):
    idx, idx_bf16, counts, _, bf16 = _fp8_case(SEED, 8, 32768, 32, 8, 128, jnp.bfloat16, peaky, 0.1, 128,
                                               interpret=False,
                                               tuning=dict(widen=WIDEN, f16=F16)[tuning])
    assert _mass_recall(idx, idx_bf16, bf16, counts) > 0.97
