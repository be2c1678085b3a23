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
    r_out = jax.jit(lambda *a: dec.reuse_decode(*a, impl=impl, interpret=interpret))(q, k, v, kv_len, ref_idx, ref_counts, hm)
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


@pytest.mark.gpu
@pytest.mark.parametrize("peaky", [False, True])
@pytest.mark.parametrize("four", [False, True])
def test_gpu_realistic(peaky, four):
    _check_anchor(SEED, 8, 32768, 32, 8, 128, jnp.bfloat16, peaky, 0.1, 128, interpret=False,
                  tuning=FOUR if four else dec.DEFAULT_TUNING)
