"""The short-row select (`topk.select_topk_short`, `DecodeTuning.short_select_max`) against the reference, the
four-launch pipeline and a numpy model of the bits.

CPU tier: interpret mode, rows of 64..2048 keys. GPU tier (`-m gpu`): batch 32 x 16K and batch 8 x 32K, pool all.
Exact index arrays against the model (the count largest bit patterns, ties lowest id first, listed in id order, -1
after), the same sets as `reference.select_topk_reference` wherever the budget fits the eligible keys and as the
four-launch path always (a budget over the eligible keys takes -1 keys lowest id first, in both); anchor decode end
to end with the short path on and off; the sm_90 lowering of a 16K row. Planting a wrong tie order (highest id
first) in the kernel fails the exact tests; dropping the last rank fails the end-to-end ones.
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


FOUR = dec.DecodeTuning(short_select_max=0)  # the four-launch pipeline (the default takes the short path to 32K)


def _short(s: int, **kw) -> dec.DecodeTuning:
    return dec.DecodeTuning(short_select_max=1 << (s - 1).bit_length(), **kw)


def _rows(rng, s: int, kind: str):
    """Scores [4, 2, s] (-inf or NaN = ineligible) and ragged kv_len [4] (row 0 full, row 3 short)."""
    b, h = 4, 2
    sc = rng.exponential(size=(b, h, s)).astype(np.float32)
    if kind == "ties":  # ~1/8 of a row shares each value: ties straddle the threshold
        sc = np.round(sc * 8.0) / 8.0
    elif kind == "equal":
        sc[:] = 0.5
    elif kind == "masked":  # ineligible keys inside the valid length, and zeros (eligible)
        sc[rng.random(sc.shape) < 0.15] = -np.inf
        sc[rng.random(sc.shape) < 0.05] = np.nan
        sc[rng.random(sc.shape) < 0.05] = 0.0
    kv_len = np.concatenate([[s], rng.integers(s // 2, s + 1, size=2), [min(s, 5)]]).astype(np.int32)
    if kind == "forced":  # sinks and a recent window, as the decode select sees them
        sc = np.asarray(dec._force(jnp.asarray(sc), jnp.asarray(kv_len), 4, 8))
    sc = np.where(np.arange(s)[None, None] < kv_len[:, None, None], sc, -np.inf)
    return jnp.asarray(sc), jnp.asarray(kv_len)


def _model(bits, counts, k_max: int):
    """The count largest bit patterns (-1 included), ties lowest id first, in id order; -1 after."""
    bits = np.asarray(bits).astype(np.int64)
    out = np.full(bits.shape[:2] + (k_max,), -1, np.int32)
    for bi in range(bits.shape[0]):
        c = int(counts[bi])
        for h in range(bits.shape[1]):
            out[bi, h, :c] = np.sort(np.argsort(-bits[bi, h], kind="stable")[:c])
    return out


def _sets(idx):
    idx = np.asarray(idx)
    return [[set(r[r >= 0].tolist()) for r in row] for row in idx]


@pytest.mark.parametrize("s, kind, digit", [(64, "random", 1), (300, "ties", 1), (1000, "masked", 2),
                                            (2048, "forced", 1), (513, "equal", 3), (777, "masked", 1)])
def test_short_select_exact(rng, s, kind, digit):
    """Budgets: the decode budget (10%), 0, the whole kv_len (over the eligible keys where some are masked)."""
    sc, kv_len = _rows(rng, s, kind)
    counts = np.array(ref.decode_counts(kv_len, 0.1, 3))
    counts[1], counts[2] = 0, kv_len[2]
    counts = jnp.asarray(counts)
    k_max = int(max(counts.max(), 1))
    bits = dec._scores_to_bits(sc, kv_len, 1)
    tuning = _short(s, short_select_digit=digit)
    idx = np.asarray(dec.select_topk(sc, kv_len, counts, k_max, interpret=True, tuning=tuning))
    np.testing.assert_array_equal(idx, _model(bits, counts, k_max))
    four = dec.select_topk(sc, kv_len, counts, k_max, interpret=True, tuning=FOUR)
    assert _sets(idx) == _sets(four)
    n_valid = np.asarray(jnp.sum(bits >= 0, axis=-1))
    ref_idx = _sets(ref.select_topk_reference(jnp.where(jnp.isnan(sc), -jnp.inf, sc), counts[:, None], k_max))
    for bi, (mine, theirs) in enumerate(zip(_sets(idx), ref_idx)):
        for h in range(sc.shape[1]):
            if counts[bi] <= n_valid[bi, h]:
                assert mine[h] == theirs[h], (bi, h)


@pytest.mark.parametrize("digit", [1, 2, 3])
def test_short_select_bits_directly(rng, digit):
    """All -1 rows, all-equal rows, the largest finite score, neighbours one ulp apart (every bit decides), budgets
    0 / 1 / the row, a row a power of two long."""
    s = 256
    bits = rng.integers(0, 1 << 20, size=(3, 2, s)).astype(np.int32)
    bits[0, 0] = -1
    bits[0, 1] = topk._MAX_FINITE
    bits[1, 0, ::3] = topk._MAX_FINITE
    bits[1, 1] = 0x3F000000 + rng.integers(0, 24, size=s)
    bits[2, 1] = 7
    for counts in ([0, 1, s], [s, s // 2, 1], [1, 100, 37]):
        out = topk.select_topk_short(jnp.asarray(bits), jnp.asarray(counts, jnp.int32), s, digit=digit,
                                     interpret=True)
        np.testing.assert_array_equal(np.asarray(out), _model(bits, counts, s))
    with pytest.raises(ValueError, match="k_max must be in"):
        topk.select_topk_short(jnp.asarray(bits), jnp.asarray([1, 1, 1], jnp.int32), s + 1)


def _anchor_inputs(rng, b, s, hq, kvh, d):
    q = rng.standard_normal((b, 1, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, s, kvh, d)).astype(np.float32)
    v = rng.standard_normal((b, s, kvh, d)).astype(np.float32)
    qm = q.reshape(b, kvh, hq // kvh, d).mean(axis=2)
    for bi in range(b):  # peaky: a few keys take most of the attention, so the selection matters
        for h in range(kvh):
            k[bi, rng.integers(0, s, 6), h] = 3.0 * qm[bi, h]
    kv_len = np.asarray([s] + list(rng.integers(s // 2, s + 1, size=b - 1)), np.int32)
    cast = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    return cast(q), cast(k), cast(v), jnp.asarray(kv_len)


@pytest.mark.parametrize("pool, sinks, window, dense_out", [("all", 2, 4, False), ("gqa", 0, 0, True)])
def test_anchor_decode_short_on_off(rng, pool, sinks, window, dense_out):
    """The same selection with the short path on and off (sets: the order within a row may differ), and the same
    output up to the summation order of the sparse attention."""
    b, s, hq, kvh, d = 3, 300, 8, 2, 64
    q, k, v, kv_len = _anchor_inputs(rng, b, s, hq, kvh, d)
    kw = dict(topk_frac=0.1, min_k=16, k_max=ref.max_budget(s, 0.1, 16), pool=pool, impl="pallas", interpret=True,
              sinks=sinks, window=window, dense_out=dense_out)
    run = lambda t: jax.jit(lambda *a: dec.anchor_decode(*a, tuning=t, **kw))(q, k, v, kv_len)  # noqa: E731
    out_on, idx_on, cnt_on = run(_short(s))
    out_off, idx_off, cnt_off = run(FOUR)
    np.testing.assert_array_equal(np.asarray(cnt_on), np.asarray(cnt_off))
    assert _sets(idx_on) == _sets(idx_off)
    assert np.all((np.asarray(idx_on) >= 0).sum(-1) == np.asarray(cnt_on)[:, None])
    assert _row_err(out_on, out_off) < 1e-2  # bf16 outputs: a few ulps of reordered sums


def test_short_select_tuning_is_checked():
    for bad, match in ((dict(short_select_max=3000), "short_select_max must be 0 or a power of two <= 65536"),
                       (dict(short_select_max=131072), "short_select_max"),
                       (dict(short_select_max=-4), "short_select_max"),
                       (dict(short_select_warps=3), "short_select_warps must be 0"),
                       (dict(short_select_digit=4), "short_select_digit must be 1, 2 or 3"),
                       (dict(short_select_rows=0), "short_select_rows must be an int >= 1")):
        with pytest.raises(ValueError, match=match):
            dec.DecodeTuning(**bad)
    assert dec.DecodeTuning(short_select_max=32768, short_select_warps=16, short_select_digit=2)


def test_short_select_only_up_to_short_select_rows_rows():
    """Rows (batch x selection heads) past `short_select_rows` take the four launches even when each row is short;
    the bench's rR suffix sets the limit."""
    from kascade_jax.bench.decode import short_select_tuning

    sc = jax.ShapeDtypeStruct((4, 8, 1000), jnp.float32)
    kv = jax.ShapeDtypeStruct((4,), jnp.int32)
    for limit, want, not_want in ((32, "kascade_topk_short", "kascade_topk_sample"),
                                  (31, "kascade_topk_sample", "kascade_topk_short")):
        t = dec.DecodeTuning(short_select_rows=limit)
        text = str(jax.make_jaxpr(lambda a, l, c: dec.select_topk(a, l, c, 100, tuning=t, interpret=True))(sc, kv, kv))
        assert want in text and not_want not in text, limit
    assert short_select_tuning("32768r1024").short_select_rows == 1024
    assert short_select_tuning("32768r1024c").fused_combine and not short_select_tuning("32768").fused_combine
    assert short_select_tuning("32768").short_select_rows == dec.DEFAULT_TUNING.short_select_rows == 512
    with pytest.raises(ValueError, match="short_select_rows"):
        short_select_tuning("32768r0")


def test_short_select_lowers_for_sm90(triton_sm90_modules):
    """A 16K row (one [16384] block in registers) and a ragged 5000-key one (masked gather, no pad) lower and verify
    for sm_90; the anchor is then three kernels (scores, the short select, reuse), anchor 0 two."""
    verified = triton_sm90_modules
    b, kvh, g, d = 32, 2, 7, 64
    for s, n_kernels in ((16384, 3), (5000, 3)):
        q = jax.ShapeDtypeStruct((b, 1, kvh * g, d), jnp.bfloat16)
        kc = jax.ShapeDtypeStruct((b, s, kvh, d), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((b,), jnp.int32)
        fn = lambda q, k, v, l: dec.anchor_decode(q, k, v, l, topk_frac=0.1, min_k=128,  # noqa: E731
                                                  k_max=ref.max_budget(s, 0.1, 128), impl="pallas", pool="all",
                                                  tuning=_short(s))
        before = len(verified)
        lowered = jax.jit(fn).trace(q, kc, kc, kv).lower(lowering_platforms=("cuda",))
        assert len(verified) - before == n_kernels
        assert "kascade_topk_short" in lowered.as_text() and "kascade_topk_sample" not in lowered.as_text()
    fn0 = lambda q, k, v, l: dec.anchor_decode(q, k, v, l, topk_frac=0.1, min_k=128, k_max=600,  # noqa: E731
                                               impl="pallas", dense_out=True,
                                               tuning=_short(5000, short_select_digit=2))
    before = len(verified)
    jax.jit(fn0).trace(q, kc, kc, kv).lower(lowering_platforms=("cuda",))
    assert len(verified) - before == 2


@pytest.mark.gpu
@pytest.mark.parametrize("b, s", [(32, 16384), (8, 32768)])
def test_gpu_realistic(rng, b, s):
    """On the GPU at the decode shapes it is built for (pool all: one row per sequence): exact against the model,
    the four-launch sets, forced keys and ties included."""
    sc = rng.exponential(size=(b, 1, s)).astype(np.float32)
    sc[1::2] = np.round(sc[1::2] * 64.0) / 64.0  # ties
    kv_len = jnp.asarray(np.concatenate([[s], rng.integers(s // 2, s + 1, size=b - 1)]).astype(np.int32))
    sc = dec._force(jnp.asarray(sc), kv_len, 4, 64)
    sc = jnp.where(jnp.arange(s)[None, None] < kv_len[:, None, None], sc, -jnp.inf)
    counts = ref.decode_counts(kv_len, 0.1, 128)
    k_max = ref.max_budget(s, 0.1, 128)
    idx = jax.jit(lambda *a: dec.select_topk(*a, k_max, tuning=_short(s)))(sc, kv_len, counts)
    np.testing.assert_array_equal(np.asarray(idx), _model(dec._scores_to_bits(sc, kv_len, 1), counts, k_max))
    four = jax.jit(lambda *a: dec.select_topk(*a, k_max, tuning=FOUR))(sc, kv_len, counts)
    assert _sets(idx) == _sets(four)
