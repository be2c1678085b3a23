"""The decode_tail_stride lever (KascadeConfig.decode_tail_stride, strategies.sampled_tail): a sparse decode over a
selection plus every S-th unselected key weighted by S, against its definition written out over the whole cache."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from kascade_jax.config import KascadeConfig
from kascade_jax.recipes import Recipe, candidate
from kascade_jax.registry import make_strategy
from kascade_jax.strategies import sampled_tail
from kernels_pallas import decode as dec
from kernels_pallas import reference as ref
from kj_helpers import decode_inputs, random_layer, run_layers


def _case(rng, s=240, kv_len=(240, 151), hq=6, kvh=2, d=16, k_max=40, idx_heads=None):
    b = len(kv_len)
    q = jnp.asarray(rng.normal(size=(b, 1, hq, d)) * 2, jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, s, kvh, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, s, kvh, d)), jnp.float32)
    ih = kvh if idx_heads is None else idx_heads
    idx = np.full((b, ih, k_max), -1, np.int32)
    for bi, n in enumerate(kv_len):
        for h in range(ih):
            m = k_max - 7 * bi  # fewer in the second sequence, -1 past them
            idx[bi, h, :m] = rng.choice(n, m, replace=False)
    return q, k, v, jnp.asarray(kv_len, jnp.int32), jnp.asarray(idx)


def _definition(q, k, v, kv_len, idx, row, stride, counts=None, cap=True):
    """softmax over [selected logits, unselected keys at multiples of stride: logit + log stride, or with `cap` the
    logit alone where it reaches the row's lightest selected logit] @ v, in numpy. counts (a list) collects how many
    sampled keys reached it."""
    q, k, v, idx = (np.asarray(a, np.float64) for a in (q, k, v, idx))
    b, _, hq, d = q.shape
    kvh = k.shape[2]
    g = hq // kvh
    out = np.zeros((b, 1, hq, d))
    for bi in range(b):
        n = int(kv_len[bi])
        for h in range(kvh):
            sel = sorted({int(i) for i in idx[bi, row[h]] if i >= 0})
            samp = [j for j in range(0, n, stride) if j not in set(sel)]
            keys = sel + samp
            for r in range(h * g, (h + 1) * g):
                logit = k[bi, keys, h] @ q[bi, 0, r] / math.sqrt(d)
                floor = logit[:len(sel)].min()
                capped = logit[len(sel):] >= floor
                if counts is not None:
                    counts.append(int(capped.sum()))
                logit[len(sel):] += np.where(capped & cap, 0.0, math.log(stride))
                p = np.exp(logit - logit.max())
                out[bi, 0, r] = (p / p.sum()) @ v[bi, keys, h]
    return out


@pytest.mark.parametrize("stride,row,cap", [(7, (0, 1), True), (20, (1, 1), False), (3, (0, 0), True),
                                            (3, (0, 0), False)])
def test_sampled_tail_matches_its_definition(rng, stride, row, cap):
    q, k, v, kv_len, idx = _case(rng)
    out, lse = ref.sparse_decode_reference(q, k, v, kv_len, idx, row, return_lse=True)
    got = sampled_tail(q, k, v, kv_len, idx, row, out, lse, stride, cap=cap)
    capped = []
    np.testing.assert_allclose(np.asarray(got), _definition(q, k, v, kv_len, idx, row, stride, capped, cap),
                               rtol=2e-5, atol=2e-5)
    assert not np.allclose(np.asarray(got), np.asarray(out), atol=1e-3)  # the tail moved the output
    assert sum(capped) > 0  # random selections: some sampled keys reach the lightest selected one
    other = sampled_tail(q, k, v, kv_len, idx, row, out, lse, stride, cap=not cap)
    assert not np.allclose(np.asarray(got), np.asarray(other), atol=1e-4)  # so the cap matters here


def test_over_the_rows_own_topk_the_cap_changes_nothing(rng):
    """One query row per KV head and its own Top-k as the selection: no unselected key reaches the lightest selected
    key, so every sampled key is weighted by S (the tail probe's topk+samp)."""
    q, k, v, kv_len, _ = _case(rng, hq=2, kvh=2)
    logits = np.einsum("bhd,bshd->bhs", np.asarray(q[:, 0]), np.asarray(k)) / 4.0
    idx = np.full((2, 2, 40), -1, np.int32)
    for bi, n in enumerate(np.asarray(kv_len)):
        for h in range(2):
            idx[bi, h, :24] = np.argsort(-logits[bi, h, :n])[:24]
    idx = jnp.asarray(idx)
    out, lse = ref.sparse_decode_reference(q, k, v, kv_len, idx, (0, 1), return_lse=True)
    capped = []
    want = _definition(q, k, v, kv_len, idx, (0, 1), 7, capped)
    assert sum(capped) == 0
    for cap in (True, False):
        np.testing.assert_allclose(np.asarray(sampled_tail(q, k, v, kv_len, idx, (0, 1), out, lse, 7, cap=cap)), want,
                                   rtol=2e-5, atol=2e-5)


def test_sampled_tail_at_stride_one_is_dense_and_exact_on_runs(rng):
    """Stride 1 samples every unselected key (weight 1 either way): dense attention. With each run of S keys
    holding one key and value, one query row per KV head and its heaviest whole runs selected, the sample of each
    other run stands for it exactly: dense again."""
    q, k, v, kv_len, idx = _case(rng)
    out, lse = ref.sparse_decode_reference(q, k, v, kv_len, idx, (0, 1), return_lse=True)
    dense = ref.attention_reference(q, k, v, kv_len - 1, kv_len)
    np.testing.assert_allclose(np.asarray(sampled_tail(q, k, v, kv_len, idx, (0, 1), out, lse, 1)),
                               np.asarray(dense), rtol=2e-5, atol=2e-5)
    q, k, v, kv_len, _ = _case(rng, hq=2, kvh=2)
    s, stride = 240, 8
    runs = np.arange(s) // stride * stride
    k, v = k[:, runs], v[:, runs]
    kv_len = jnp.asarray([240, 152], jnp.int32)  # whole runs
    logits = np.einsum("bhd,bshd->bhs", np.asarray(q[:, 0]), np.asarray(k))
    idx = np.full((2, 2, 48), -1, np.int32)
    for bi in range(2):
        for h in range(2):
            n_runs = int(kv_len[bi]) // stride
            starts = np.argsort(-logits[bi, h, :n_runs * stride:stride])[:4] * stride
            idx[bi, h, :32] = (starts[:, None] + np.arange(stride)).ravel()
    idx = jnp.asarray(idx)
    out, lse = ref.sparse_decode_reference(q, k, v, kv_len, idx, (0, 1), return_lse=True)
    got = sampled_tail(q, k, v, kv_len, idx, (0, 1), out, lse, stride, cap=True)
    dense = ref.attention_reference(q, k, v, kv_len - 1, kv_len)
    np.testing.assert_allclose(np.asarray(got), np.asarray(dense), rtol=2e-5, atol=2e-5)
    assert not np.allclose(np.asarray(out), np.asarray(dense), atol=1e-3)


def test_pallas_reuse_decode_returns_the_reference_lse(rng):
    q, k, v, kv_len, idx = _case(rng, s=300, kv_len=(300, 187), hq=8, kvh=2, d=64, k_max=72)
    q, k, v = (a.astype(jnp.bfloat16) for a in (q, k, v))
    counts = jnp.sum(idx[:, 0] >= 0, axis=-1).astype(jnp.int32)
    out_r, lse_r = dec.reuse_decode(q, k, v, kv_len, idx, counts, (1, 0), impl="reference", return_lse=True)
    out_p, lse_p = dec.reuse_decode(q, k, v, kv_len, idx, counts, (1, 0), impl="pallas", interpret=True,
                                    return_lse=True)
    assert lse_p.shape == lse_r.shape == (2, 1, 8) and lse_p.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lse_p), np.asarray(lse_r), rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(np.asarray(out_p, np.float32), np.asarray(out_r, np.float32), atol=2e-2)
    plain = dec.reuse_decode(q, k, v, kv_len, idx, counts, (1, 0), impl="pallas", interpret=True)
    np.testing.assert_array_equal(np.asarray(plain, np.float32), np.asarray(out_p, np.float32))


@pytest.mark.parametrize("pool,kernels,cap", [("gqa", "reference", True), ("all", "pallas", False)])
def test_strategy_decode_with_the_tail(rng, pool, kernels, cap):
    """Every sparse decode layer (the anchor past layer 0 and the reuse layers) gets the tail over its own
    selection; layer 0 stays dense; the indices handed on are unchanged."""
    num_layers, kvh, group, d, max_len, stride = 4, 2, 3, 16, 200, 5
    layers = [random_layer(rng, 2, max_len, kvh * group, kvh, d) for _ in range(num_layers)]
    inputs = [decode_inputs(lay, [max_len, 133]) for lay in layers]
    kw = dict(anchors=(0, 2), topk_frac=0.1, min_k=8, sink_tokens=2, recent_window=4, pool=pool, kernels=kernels)
    plain, plain_states = run_layers(make_strategy("kascade", num_layers, kvh, **kw), inputs)
    tail, tail_states = run_layers(make_strategy("kascade", num_layers, kvh, decode_tail_stride=stride,
                                                 decode_tail_cap=cap, **kw), inputs)
    np.testing.assert_allclose(np.asarray(tail[0]), np.asarray(plain[0]), rtol=1e-6, atol=1e-6)
    for layer in range(num_layers):
        np.testing.assert_array_equal(np.asarray(tail_states[layer]["idx"]), np.asarray(plain_states[layer]["idx"]))
    for layer in (1, 2, 3):
        st = tail_states[layer]
        row = (0, 0) if pool == "all" else (0, 1)
        want = _definition(inputs[layer].q, inputs[layer].k_cache, inputs[layer].v_cache, inputs[layer].kv_len,
                           st["idx"], row, stride, cap=cap)
        np.testing.assert_allclose(np.asarray(tail[layer]), want, rtol=1e-4, atol=1e-4)
        assert not np.allclose(np.asarray(tail[layer]), np.asarray(plain[layer]), atol=1e-3)


def test_tail_config_and_recipe_checks():
    with pytest.raises(ValueError, match="decode_tail_stride must be 0 .off. or an int >= 2, got 1"):
        KascadeConfig(num_layers=4, kv_heads=2, decode_tail_stride=1)
    with pytest.raises(ValueError, match="decode_tail_stride and decode_rerank > 1 are not combined"):
        KascadeConfig(num_layers=4, kv_heads=2, decode_tail_stride=20, decode_rerank=2)
    with pytest.raises(ValueError, match="recipe 'x': decode_tail_stride must be null, 0 .off. or an int >= 2"):
        Recipe(name="x", decode_tail_stride=True)
    r = candidate("dps_all_tail20")
    assert r.levers()["decode_tail_stride"] == 20 and "decode_tail_stride=20" in r.describe()
    cfg = make_strategy("kascade", 4, 2, anchors=(0, 2), **r.levers()).config
    assert cfg.decode_tail_stride == 20 and not cfg.decode_tail_cap and KascadeConfig.from_json(cfg.to_json()) == cfg
    rc = candidate("dps_all_tailc20")
    assert rc.levers()["decode_tail_cap"] is True and "decode_tail_cap" in rc.describe().split()
    assert make_strategy("kascade", 4, 2, anchors=(0, 2), **rc.levers()).config.decode_tail_cap
    with pytest.raises(ValueError, match="decode_tail_cap caps the sampled tail's weights: it needs decode_tail_str"):
        KascadeConfig(num_layers=4, kv_heads=2, decode_tail_cap=True)
    with pytest.raises(ValueError, match="recipe 'y': decode_tail_cap needs decode_tail_stride >= 2"):
        Recipe(name="y", decode_tail_cap=True)


def test_a_paged_cache_is_refused_with_the_tail(rng):
    import dataclasses

    lay = random_layer(rng, 2, 64, 4, 2, 16)
    inputs = dataclasses.replace(decode_inputs(lay, [64, 40]), page_table=jnp.zeros((2, 4), jnp.int32))
    st = make_strategy("kascade", 2, 2, anchors=(0,), min_k=8, decode_tail_stride=20)
    with pytest.raises(ValueError, match="decode_tail_stride is not implemented for paged caches yet"):
        st.attend(0, inputs, None)
