"""Kernel variants that no other test runs, in interpret mode on CPU at small shapes with fixed seeds, each checked
against the pure-JAX reference (kernels_pallas/reference.py): the Pallas prefill with pool="all", the Pallas decode
with pool="pre_softmax", the whole selection (not only the forced keys) of the Pallas prefill with sinks and a recent
window, and decode budgets with k_multiple > 1 (the reference bundle rounds them; the Pallas bundle refuses them).

Index sets must equal the reference's, except where the differing keys' reference scores are tied within a relative
1e-4 (fp32 rounding of the pooling). Outputs are compared on the kernel's own indices, per row (query, head) against
that row's RMS in the reference (`_row_err`, as in test_prefill.py)."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kascade_jax.config import KascadeConfig
from kascade_jax.strategies import KascadeStrategy
from kernels_pallas import decode as D
from kernels_pallas import prefill as P
from kernels_pallas import reference
from models.attention import AttentionInputs
from tests.jitted import jitted
from tests.kernels_pallas.errors import row_err_relative as _row_err

R = jitted(reference)  # the references under jit: fewer, larger compiles (tests/jitted.py)

SEED = 4242  # fixed: whether a planted error is detected must not depend on the draw
BF16_ROW_TOL = 1.5e-2  # bf16 per-row error bound: measured 2.4e-3 to 4.0e-3 here, a 3% softmax-scale error 4e-2+


def _qkv(seed, b, t, hq, kvh, d, max_len, q_scale=1.0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, hq, d)) * q_scale
    k, v = rng.standard_normal((2, b, max_len, kvh, d))
    return tuple(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))


def _assert_same_sets(idx, ref_idx, scores):
    """idx and ref_idx [..., k_max] (-1 = none) hold the same key sets, except near-ties of `scores` [..., keys].
    Returns the number of rows whose sets differ (by near-ties only)."""
    idx, ref_idx, scores = (np.asarray(x) for x in (idx, ref_idx, scores))
    idx, ref_idx = idx.reshape(-1, idx.shape[-1]), ref_idx.reshape(-1, ref_idx.shape[-1])
    scores = scores.reshape(-1, scores.shape[-1]).astype(np.float64)
    differ = 0
    for row, (mine, theirs) in enumerate(zip(idx, ref_idx)):
        a, r = set(mine[mine >= 0].tolist()), set(theirs[theirs >= 0].tolist())
        assert len(a) == np.sum(mine >= 0) == len(r), (row, sorted(a), sorted(r))  # distinct, as many as the ref
        if a != r:
            sc = scores[row]
            gap = sc[sorted(r - a)].max() - sc[sorted(a - r)].min()
            assert gap <= 1e-4 * np.abs(sc[sorted(r - a)]).max(), (row, sorted(a - r), sorted(r - a), gap)
            differ += 1
    return differ


def _prefill_case(seed, pool, sinks=0, window=0):
    """Pallas anchor prefill (interpret) vs the reference: counts, full index sets, sparse output on its own indices.
    Batch 2 (the second chunk one tile in), ragged lengths with padding queries, group 4, bf16."""
    b, t, hq, kvh, d, tile, frac, min_k = 2, 64, 8, 2, 64, 16, 0.25, 12
    max_len = t + tile + 5
    q, k, v = _qkv(seed, b, t, hq, kvh, d, max_len, q_scale=2.0)
    qs, kl = jnp.asarray([0, tile], jnp.int32), jnp.asarray([t - 3, t + tile - 9], jnp.int32)
    k_max = R.max_budget(max_len, frac, min_k)
    run = jax.jit(lambda *a: P.anchor_prefill(*a, tile, topk_frac=frac, min_k=min_k, k_max=k_max, pool=pool,
                                              sinks=sinks, window=window, impl="pallas", interpret=True))
    out, idx, counts = run(q, k, v, qs, kl, kl)
    row = jnp.zeros((kvh,), jnp.int32) if pool == "all" else jnp.arange(kvh, dtype=jnp.int32)

    @jax.jit
    def reference(q, k, v, qs, kl, idx):  # counts, scores, Top-k sets, and the output on the kernel's own indices
        counts = R.prefill_counts(qs, kl, kl, t, tile, frac, min_k)
        scores, _ = R.pooled_scores_prefill_reference(q, k, qs, kl, tile, pool=pool, sinks=sinks, window=window)
        return (counts, scores, R.select_topk_reference(scores, counts[:, None, :], k_max),
                R.sparse_prefill_reference(q, k, v, qs, kl, idx, row, tile))

    want_counts, scores, ref_idx, ref_out = reference(q, k, v, qs, kl, idx)
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(want_counts))
    assert idx.shape == ref_idx.shape == (b, 1 if pool == "all" else kvh, -(-t // tile), k_max)
    differ = _assert_same_sets(idx, ref_idx, scores)
    err = _row_err(out, ref_out)
    print(f"prefill pool={pool} sinks={sinks} window={window}: {differ} near-tie rows, per-row error {err:.2e}")
    assert err < BF16_ROW_TOL
    return idx


def test_prefill_pool_all_interpret():
    """pool="all": one index head pooled over every query head (scores summed over the KV heads after the
    per-head pooled-score kernel); every KV head attends that one set."""
    _prefill_case(SEED, "all")


def test_prefill_sinks_and_window_full_selection_interpret():
    """With sinks and a recent window the whole Top-k set equals the reference's, not only the forced keys."""
    sinks, window = 3, 6
    idx = np.asarray(_prefill_case(SEED + 1, "gqa", sinks=sinks, window=window))
    for ti in range(1, idx.shape[2]):  # the forced keys are there (sequence 0 starts at 0: tile ti starts at 16 ti)
        assert set(range(sinks)) | set(range(16 * ti - window, 16 * ti)) <= set(idx[0, 0, ti].tolist())


def test_decode_pre_softmax_interpret():
    """pool="pre_softmax" in the Pallas decode: reference logit scores of the group's mean query (shifted to >= 0,
    which a short sequence needs: its budget reaches keys of negative logit), the Pallas select and reuse kernels;
    anchor layer 0 (dense_out) through the Pallas whole-cache pass."""
    b, s, hq, kvh, d, frac, min_k, sinks, window = 3, 200, 6, 2, 64, 0.1, 8, 2, 3
    q, k, v = _qkv(SEED + 2, b, 1, hq, kvh, d, s)
    kv_len = jnp.asarray([s, 131, 10], jnp.int32)  # 8 of 10 keys: KV head 1 needs its best negative logit
    k_max = R.max_budget(s, frac, min_k)
    kw = dict(topk_frac=frac, min_k=min_k, k_max=k_max, pool="pre_softmax", sinks=sinks, window=window,
              impl="pallas", interpret=True)
    # the sparse anchor and anchor layer 0 (dense_out) in one program: XLA compiles their shared select once
    both = jax.jit(lambda *a: (D.anchor_decode(*a, **kw), D.anchor_decode(*a, dense_out=True, **kw)))
    (out, idx, counts), (out0, idx0, _) = both(q, k, v, kv_len)

    @jax.jit
    def reference(q, k, v, kv_len, idx):
        counts = R.decode_counts(kv_len, frac, min_k)
        scores = R.pooled_scores_decode_reference(q, k, kv_len, pool="pre_softmax", sinks=sinks, window=window)
        return (counts, scores, R.select_topk_reference(scores, counts[:, None], k_max),
                R.sparse_decode_reference(q, k, v, kv_len, idx, jnp.arange(kvh)),
                R.attention_reference(q, k, v, kv_len - 1, kv_len))

    want_counts, scores, ref_idx, ref_out, ref_dense = reference(q, k, v, kv_len, idx)
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(want_counts))
    differ = _assert_same_sets(idx, ref_idx, scores)
    np.testing.assert_array_equal(np.asarray(idx0), np.asarray(idx))
    err, err0 = _row_err(out, ref_out), _row_err(out0, ref_dense)
    print(f"decode pre_softmax: {differ} near-tie rows, per-row error sparse {err:.2e} dense {err0:.2e}")
    assert err < BF16_ROW_TOL and err0 < BF16_ROW_TOL


def test_decode_k_multiple_reference_rounds_pallas_refuses():
    """k_multiple=8: the reference bundle rounds each decode budget up to a multiple of 8, never past kv_len, and
    selects and attends exactly that many keys; the Pallas bundle refuses k_multiple != 1 in decode and prefill."""
    b, s, hq, kvh, d = 3, 100, 4, 2, 64
    q, k, v = _qkv(SEED + 3, b, 1, hq, kvh, d, s)
    kv_len = jnp.asarray([100, 37, 5], jnp.int32)  # plain budgets 10, 4, 4 (min_k) -> 16, 8, and 5 (= kv_len)
    cfg = KascadeConfig(num_layers=1, kv_heads=kvh, topk_frac=0.1, min_k=4, k_multiple=8, layer0_dense=False)
    x = AttentionInputs(q, k, v, kv_len - 1, kv_len, kv_len, "decode", chunk_at_zero=False)

    @jax.jit
    def run(x):  # the strategy's anchor, and the reference Top-16/8/5 sets and sparse output
        want_idx = R.select_topk_reference(R.pooled_scores_decode_reference(x.q, x.k_cache, x.kv_len),
                                           jnp.asarray([16, 8, 5])[:, None], 16)
        return (KascadeStrategy(cfg).attend(0, x, None), want_idx,
                R.sparse_decode_reference(x.q, x.k_cache, x.v_cache, x.kv_len, want_idx, jnp.arange(kvh)))

    (out, st), want_idx, want_out = run(x)
    np.testing.assert_array_equal(np.asarray(st["counts"]), [16, 8, 5])
    assert st["idx"].shape == (b, kvh, 16)  # static_k_max: max_budget(100) = 10, rounded up to 16
    np.testing.assert_array_equal(np.sort(np.asarray(st["idx"]), -1), np.sort(np.asarray(want_idx), -1))
    assert _row_err(out, want_out) < 1e-6
    msg = "the Pallas kernels implement k_multiple=1 only, got k_multiple=8"
    with pytest.raises(ValueError, match=msg):
        KascadeStrategy(cfg, kernels="pallas").attend(0, x, None)
    one = jnp.ones((b,), jnp.int32)  # a one-token prompt per sequence
    xp = AttentionInputs(q, k, v, one - 1, one, one, "prefill", chunk_at_zero=True)
    with pytest.raises(ValueError, match=msg):
        KascadeStrategy(cfg, kernels="pallas").attend(0, xp, None)
