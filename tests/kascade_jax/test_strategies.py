"""KascadeStrategy and its variants against hand-computed selections and dense attention."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kascade_jax.config import KascadeConfig
from kascade_jax.registry import make_strategy
from kascade_jax.strategies import REFERENCE_KERNELS, KascadeStrategy, get_kernels, register_kernels
from kj_helpers import decode_inputs, dense_reference, prefill_inputs, random_layer, run_layers, valid_rows
from models.attention import AttentionInputs

VARIANTS = ("kascade", "no_remap", "all_heads_pooled", "pre_softmax_pooling", "oracle_topk", "decode_only")


def _random_head_map(rng, num_layers, kv_heads, anchors):
    return tuple(tuple(range(kv_heads)) if i in anchors else tuple(int(h) for h in rng.integers(0, kv_heads, kv_heads))
                 for i in range(num_layers))


def _np_probs(q, k, kv_len):
    """numpy softmax of one decode query q [hq, d] over k [keys, kvh, d] restricted to keys < kv_len -> [hq, keys]."""
    hq, d = q.shape
    g = hq // k.shape[1]
    logits = np.einsum("hd,shd->hs", q, np.repeat(k, g, axis=1)) / np.sqrt(d)
    logits[:, kv_len:] = -np.inf
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True)


# ---- k >= L: every variant is dense --------------------------------------------------------------------------


@settings(max_examples=4, deadline=None)
@given(variant=st.sampled_from(VARIANTS), seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 2),
       kv_heads=st.integers(1, 2), group=st.integers(1, 3), tile_size=st.sampled_from([4, 8]),
       chunks=st.integers(1, 2), data=st.data())
def test_full_budget_equals_dense(variant, seed, batch, kv_heads, group, tile_size, chunks, data):
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    num_layers, d, max_len = 3, 8, 48
    lens = data.draw(st.lists(st.integers(1, max_len - 1), min_size=batch, max_size=batch))
    layers = [random_layer(rng, batch, max_len, kv_heads * group, kv_heads, d) for _ in range(num_layers)]
    head_map = None if variant in ("no_remap", "all_heads_pooled") else _random_head_map(rng, num_layers, kv_heads, (0, 2))
    strategy = make_strategy(variant, num_layers, kv_heads, anchors=(0, 2), head_map=head_map, topk_frac=1.0, min_k=1,
                             tile_size=tile_size, rolling_prefill=bool(rng.integers(2)))
    # prefill in `chunks` chunks (q_start > 0 for the second), each a full forward over the layers
    bounds = [0, max_len] if chunks == 1 else [0, tile_size * int(rng.integers(1, max_len // tile_size)), max_len]
    for q0, q1 in zip(bounds, bounds[1:]):
        outs, _ = run_layers(strategy, [prefill_inputs(lay, q0, q1 - q0, lens) for lay in layers])
        for lay, out in zip(layers, outs):
            inp = prefill_inputs(lay, q0, q1 - q0, lens)
            ref = dense_reference(inp)
            np.testing.assert_allclose(valid_rows(out, q0, lens), valid_rows(ref, q0, lens), rtol=1e-5, atol=1e-5)
    # a decode step at the end of each prompt
    outs, _ = run_layers(strategy, [decode_inputs(lay, lens) for lay in layers])
    for lay, out in zip(layers, outs):
        inp = decode_inputs(lay, lens)
        ref = dense_reference(inp)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


# ---- selected indices ------------------------------------------------------------------------------------------


def _expected_prefill_count(tile_start, kv_len, seq_len, cfg):
    base = tile_start if cfg.rolling_prefill else seq_len
    k = min(max(int(np.floor(base * round(cfg.topk_frac * 10_000) // 10_000)), cfg.min_k), base)
    k = min(-(-k // cfg.k_multiple) * cfg.k_multiple, base)
    return min(k, tile_start, kv_len)


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rolling=st.booleans(), k_multiple=st.sampled_from([1, 4]),
       pool=st.sampled_from(["gqa", "all", "pre_softmax"]), q_start_tiles=st.integers(0, 3), data=st.data())
def test_prefill_indices_valid_causal_unique_counted(seed, rolling, k_multiple, pool, q_start_tiles, data):
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    b, kvh, g, d, ts, max_len = 2, 2, 2, 8, 4, 64
    q_start = q_start_tiles * ts
    lens = data.draw(st.lists(st.integers(q_start + 1, max_len), min_size=b, max_size=b))
    cfg = KascadeConfig(num_layers=2, kv_heads=kvh, topk_frac=0.25, min_k=3, tile_size=ts, k_multiple=k_multiple,
                        rolling_prefill=rolling, pool=pool)
    lay = random_layer(rng, b, max_len, kvh * g, kvh, d)
    inp = prefill_inputs(lay, q_start, max_len - q_start, lens)
    _, state = KascadeStrategy(cfg).attend(0, inp, None)
    idx, counts = np.asarray(state["idx"]), np.asarray(state["counts"])
    assert idx.shape[:3] == (b, cfg.idx_heads, -(-(max_len - q_start) // ts))
    for bi in range(b):
        kv_len = int(inp.kv_len[bi])
        for t in range(idx.shape[2]):
            tile_start = q_start + t * ts
            want = _expected_prefill_count(tile_start, kv_len, lens[bi], cfg)
            assert counts[bi, t] == want
            for h in range(idx.shape[1]):
                row = idx[bi, h, t]
                sel = row[row >= 0]
                assert len(sel) == want and np.all(row[want:] == -1)
                assert len(set(sel.tolist())) == len(sel)
                assert np.all(sel < tile_start) and np.all(sel < kv_len)


def test_prefill_selection_matches_hand_pooled_topk(rng):
    b, kvh, g, d, ts, max_len, q_start = 1, 2, 3, 8, 4, 40, 8
    cfg = KascadeConfig(num_layers=2, kv_heads=kvh, topk_frac=0.2, min_k=3, tile_size=ts)  # layer 1 reads layer 0
    lay = random_layer(rng, b, max_len, kvh * g, kvh, d)
    inp = prefill_inputs(lay, q_start, max_len - q_start, [37])
    _, state = KascadeStrategy(cfg).attend(0, inp, None)
    q, k = np.asarray(lay[0][0]), np.asarray(lay[1][0])
    for t in range(state["idx"].shape[2]):
        s = q_start + t * ts
        rows = [p for p in range(s, s + ts) if p < 37]
        pooled = sum(_np_probs(q[p], k, p + 1) for p in rows).reshape(kvh, g, -1).sum(axis=1)  # [kvh, keys]
        count = int(state["counts"][0, t])
        assert count == min(max(int(0.2 * s), 3), s)
        for h in range(kvh):
            want = set(np.argsort(-pooled[h, :s], kind="stable")[:count].tolist())
            got = set(np.asarray(state["idx"][0, h, t][:count]).tolist())
            assert got == want


@pytest.mark.parametrize("pool", ["gqa", "all", "pre_softmax"])
def test_decode_selection_matches_hand_topk(rng, pool):
    b, kvh, g, d, max_len = 2, 3, 2, 8, 50
    lens = [50, 31]
    cfg = KascadeConfig(num_layers=3, kv_heads=kvh, anchors=(0, 2), topk_frac=0.2, min_k=4, pool=pool)
    layers = [random_layer(rng, b, max_len, kvh * g, kvh, d) for _ in range(3)]
    _, states = run_layers(KascadeStrategy(cfg), [decode_inputs(lay, lens) for lay in layers])
    for layer in (0, 2):  # layer 0 is dense but still selects; layer 2 is a sparse anchor
        q, k = np.asarray(layers[layer][0]), np.asarray(layers[layer][1])
        for bi, n in enumerate(lens):
            probs = _np_probs(q[bi, n - 1], k[bi], n)  # [hq, keys]
            if pool == "gqa":
                score = probs.reshape(kvh, g, -1).sum(axis=1)
            elif pool == "all":
                score = probs.sum(axis=0, keepdims=True)
            else:
                qm = q[bi, n - 1].reshape(kvh, g, d).mean(axis=1)
                score = np.einsum("hd,shd->hs", qm, k[bi])[:, :n]
            count = min(max(int(0.2 * n), 4), n)
            assert int(states[layer]["counts"][bi]) == count
            for h in range(score.shape[0]):
                want = set(np.argsort(-score[h, :n], kind="stable")[:count].tolist())
                got = np.asarray(states[layer]["idx"][bi, h])
                assert set(got[:count].tolist()) == want and np.all(got[count:] == -1)
    # the reuse layer 1 passes layer 0's state on
    assert np.array_equal(states[1]["idx"], states[0]["idx"])


# ---- head remapping ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("variant", ["kascade", "no_remap"])
def test_planted_head_map(rng, phase, variant):
    """Anchor head h prefers planted keys S_h; reuse head h must attend exactly S_{head_map[h]} (+ diagonal in prefill)."""
    b, kvh, g, d, n, ts = 1, 3, 2, 32, 32, 8
    planted = rng.permutation(24)[:12].reshape(kvh, 4)  # disjoint sets of 4 keys in [0, 24)
    dirs = np.linalg.qr(rng.normal(size=(d, d)))[0][:kvh]  # orthonormal directions u_h
    k0 = rng.normal(size=(b, n, kvh, d)) * 0.1
    q0 = rng.normal(size=(b, n, kvh * g, d)) * 0.1
    for h in range(kvh):
        k0[0, planted[h], h] += 8 * dirs[h]
        q0[0, :, h * g:(h + 1) * g] += 8 * dirs[h]
    v_onehot = np.broadcast_to(np.eye(n, d)[None, :, None, :], (b, n, kvh, d))  # value of key j = e_j
    layer0 = tuple(jnp.asarray(a, jnp.float32) for a in (q0, k0, rng.normal(size=(b, n, kvh, d))))
    q1, k1, _ = random_layer(rng, b, n, kvh * g, kvh, d)
    layer1 = (q1, k1, jnp.asarray(v_onehot, jnp.float32))
    head_map = ((0, 1, 2), (2, 0, 0))
    strategy = make_strategy(variant, 2, kvh, anchors=(0,), head_map=head_map, topk_frac=0.1, min_k=4, tile_size=ts)
    row = (2, 0, 0) if variant == "kascade" else (0, 1, 2)
    if phase == "decode":
        inputs = [decode_inputs(lay, [n]) for lay in (layer0, layer1)]
    else:
        inputs = [prefill_inputs(lay, 0, n, [n]) for lay in (layer0, layer1)]
    outs, _ = run_layers(strategy, inputs)
    probs = np.asarray(outs[1][0])  # [q_len, hq, d]: the attention weights over keys, thanks to one-hot values
    rows = [n - 1] if phase == "decode" else range(24, 32)  # prefill: the tile at 24, whose prefix holds S_h
    for r_i, r in enumerate(rows):
        for hq in range(kvh * g):
            want = set(planted[row[hq // g]].tolist()) | (set(range(24, r + 1)) if phase == "prefill" else set())
            got = set(np.nonzero(probs[r_i if phase == "decode" else r, hq] > 0)[0].tolist())
            assert got == want, (r, hq)
            # renormalised softmax over the attended set, by hand
            sel = sorted(want)
            logits = np.asarray(q1[0, r, hq]) @ np.asarray(k1[0, sel, hq // g]).T / np.sqrt(d)
            p = np.exp(logits - logits.max())
            np.testing.assert_allclose(probs[r_i if phase == "decode" else r, hq, sel], p / p.sum(), rtol=1e-5)


# ---- batching, padding, chunking, blocks -------------------------------------------------------------------------


def test_batch_with_padding_equals_per_prompt(rng):
    kvh, g, d, max_len, lens = 2, 2, 8, 56, [56, 23]
    cfg = KascadeConfig(num_layers=3, kv_heads=kvh, anchors=(0, 2), head_map=((0, 1), (1, 1), (0, 1)), topk_frac=0.25,
                        min_k=4, tile_size=4)
    layers = [random_layer(rng, 2, max_len, kvh * g, kvh, d) for _ in range(3)]
    # different garbage in the padding of the batched run: it must not leak into selection or output
    noisy = [tuple(a.at[1, lens[1]:].set(50.0 * jnp.sign(a[1, lens[1]:]) + a[1, lens[1]:]) for a in lay) for lay in layers]
    strategy = KascadeStrategy(cfg)
    for phase in ("prefill", "decode"):
        make = (lambda lay, ls: prefill_inputs(lay, 0, max_len, ls)) if phase == "prefill" else decode_inputs
        outs_b, states_b = run_layers(strategy, [make(lay, lens) for lay in noisy])
        for bi in range(2):
            single = [tuple(a[bi:bi + 1] for a in lay) for lay in layers]
            outs_1, states_1 = run_layers(strategy, [make(lay, lens[bi:bi + 1]) for lay in single])
            for o_b, o_1 in zip(outs_b, outs_1):
                o_b, o_1 = o_b[bi:bi + 1], o_1
                if phase == "prefill":
                    o_b, o_1 = valid_rows(o_b, 0, lens[bi:bi + 1]), valid_rows(o_1, 0, lens[bi:bi + 1])
                np.testing.assert_allclose(o_b, o_1, rtol=1e-5, atol=1e-6)
            for s_b, s_1 in zip(states_b, states_1):
                idx_b, idx_1 = np.asarray(s_b["idx"][bi]), np.asarray(s_1["idx"][0])
                if phase == "prefill":  # compare the tiles that hold real queries
                    idx_b, idx_1 = idx_b[:, : -(-lens[bi] // 4)], idx_1[:, : -(-lens[bi] // 4)]
                assert np.array_equal(np.sort(idx_b, axis=-1), np.sort(idx_1, axis=-1))


def test_chunked_prefill_and_query_blocks_match_one_shot(rng):
    kvh, g, d, max_len, lens, ts = 2, 2, 8, 64, [64, 45], 4
    layers = [random_layer(rng, 2, max_len, kvh * g, kvh, d) for _ in range(3)]
    cfg = KascadeConfig(num_layers=3, kv_heads=kvh, anchors=(0, 2), head_map=((0, 1), (0, 0), (0, 1)),
                        topk_frac=0.2, min_k=3, tile_size=ts)
    one_shot, states = run_layers(KascadeStrategy(cfg), [prefill_inputs(lay, 0, max_len, lens) for lay in layers])
    # the same in two chunks [0, 24) + [24, 64)
    for q0, q1 in ((0, 24), (24, 64)):
        outs, st_c = run_layers(KascadeStrategy(cfg), [prefill_inputs(lay, q0, q1 - q0, lens) for lay in layers])
        for out, ref in zip(outs, one_shot):
            np.testing.assert_allclose(valid_rows(out, q0, lens), valid_rows(ref[:, q0:q1], q0, lens), rtol=1e-5,
                                       atol=1e-6)
        assert np.array_equal(np.sort(st_c[-1]["idx"], -1), np.sort(states[-1]["idx"][:, :, q0 // ts:q1 // ts], -1))
    # the same with the reference kernels fed in blocks of 8 queries
    register_kernels("reference_blocks8", dataclasses.replace(REFERENCE_KERNELS, query_block=8))
    blocked, st_b = run_layers(KascadeStrategy(cfg, kernels="reference_blocks8"),
                               [prefill_inputs(lay, 0, max_len, lens) for lay in layers])
    for out, ref in zip(blocked, one_shot):
        np.testing.assert_allclose(valid_rows(out, 0, lens), valid_rows(ref, 0, lens), rtol=1e-5, atol=1e-6)
    assert np.array_equal(st_b[-1]["counts"], states[-1]["counts"])


# ---- variants ----------------------------------------------------------------------------------------------------


def test_variant_roles(rng):
    kvh, g, d, max_len, lens = 2, 2, 8, 64, [64]
    layers = [random_layer(rng, 1, max_len, kvh * g, kvh, d) for _ in range(3)]
    kw = dict(anchors=(0,), topk_frac=0.1, min_k=4, tile_size=4)
    dec = [decode_inputs(lay, lens) for lay in layers]
    pre = [prefill_inputs(lay, 0, max_len, lens) for lay in layers]
    # oracle: every layer selects its own (states differ per layer), sparse except layer 0
    _, states = run_layers(make_strategy("oracle_topk", 3, kvh, **kw), dec)
    assert not np.array_equal(np.sort(states[1]["idx"], -1), np.sort(states[2]["idx"], -1))
    ref_states = [KascadeStrategy(KascadeConfig(2, kvh, topk_frac=0.1, min_k=4, tile_size=4)).attend(0, x, None)[1]
                  for x in dec]  # (two layers: a one-layer config's dense layer 0 has no reader and selects nothing)
    assert states[0] is None  # oracle: layer 0's dense output is read by no later layer, so it selects nothing
    for s, r in zip(states[1:], ref_states[1:]):
        assert np.array_equal(np.sort(s["idx"], -1), np.sort(r["idx"], -1))
    # all heads pooled: one index head
    _, states = run_layers(make_strategy("all_heads_pooled", 3, kvh, **kw), pre)
    assert states[0]["idx"].shape[1] == 1
    # decode_only: prefill is exactly dense at any budget, decode is sparse
    outs, states = run_layers(make_strategy("decode_only", 3, kvh, **kw), pre)
    assert states[-1] is None
    for out, x in zip(outs, pre):
        np.testing.assert_allclose(out, dense_reference(x), atol=1e-6)
    outs, _ = run_layers(make_strategy("decode_only", 3, kvh, **kw), dec)
    x = dec[1]
    assert not np.allclose(outs[1], dense_reference(x), atol=1e-3)
    # layer 0 dense in kascade, sparse without layer0_dense
    for layer0_dense, dense_expected in ((True, True), (False, False)):
        out, _ = make_strategy("kascade", 3, kvh, layer0_dense=layer0_dense, **kw).attend(0, dec[0], None)
        x = dec[0]
        assert np.allclose(out, dense_reference(x), atol=1e-6) \
            == dense_expected


def test_errors(rng):
    cfg = KascadeConfig(num_layers=2, kv_heads=2, tile_size=4)
    lay = random_layer(rng, 1, 16, 4, 2, 8)
    with pytest.raises(ValueError, match="reuse layer 1 got no anchor state"):
        KascadeStrategy(cfg).attend(1, decode_inputs(lay, [16]), None)
    with pytest.raises(ValueError, match=r"layer must lie in \[0, 1\]"):
        KascadeStrategy(cfg).attend(2, decode_inputs(lay, [16]), None)
    with pytest.raises(ValueError, match="kv_heads=3"):
        KascadeStrategy(KascadeConfig(num_layers=2, kv_heads=3)).attend(0, decode_inputs(lay, [16]), None)
    with pytest.raises(ValueError, match="phase"):
        x = decode_inputs(lay, [16])
        KascadeStrategy(cfg).attend(0, AttentionInputs(x.q, x.k_cache, x.v_cache, x.q_start, x.kv_len, x.seq_len,
                                                       "verify"), None)
    with pytest.raises(ValueError, match="unknown kernels 'pallas_nope'"):
        KascadeStrategy(cfg, kernels="pallas_nope")
    with pytest.raises(ValueError, match="KascadeConfig"):
        KascadeStrategy({"anchors": (0,)})
    with pytest.raises(ValueError, match="Kernels bundle"):
        register_kernels("x", object())
    assert get_kernels("reference") is REFERENCE_KERNELS


def _pallas_vs_reference(rng, b, kvh, g, d, max_len, lens, ts, dtype, atol):
    layers = [tuple(a.astype(dtype) for a in random_layer(rng, b, max_len, kvh * g, kvh, d)) for _ in range(3)]
    cfg = KascadeConfig(num_layers=3, kv_heads=kvh, anchors=(0, 2), head_map=(tuple(range(kvh)), (0,) * kvh,
                        tuple(range(kvh))), topk_frac=0.1, min_k=16, tile_size=ts)
    for make in (lambda lay: prefill_inputs(lay, 0, max_len, lens), lambda lay: decode_inputs(lay, lens)):
        xs = [make(lay) for lay in layers]
        ref_out, ref_st = run_layers(KascadeStrategy(cfg), xs)
        pal_out, pal_st = run_layers(KascadeStrategy(cfg, kernels="pallas"), xs)
        for o_r, o_p, x in zip(ref_out, pal_out, xs):
            if x.phase == "prefill":
                o_r, o_p = valid_rows(o_r, 0, lens), valid_rows(o_p, 0, lens)
            np.testing.assert_allclose(np.asarray(o_p, np.float32), np.asarray(o_r, np.float32), atol=atol, rtol=atol)
        np.testing.assert_array_equal(pal_st[-1]["counts"], ref_st[-1]["counts"])


def test_pallas_bundle_matches_reference_on_cpu(rng):
    """On CPU the "pallas" bundle runs kernels_pallas' own references: same results through the seam."""
    _pallas_vs_reference(rng, 2, 2, 2, 16, 64, [64, 37], 16, jnp.float32, 1e-5)


@pytest.mark.gpu
def test_pallas_bundle_matches_reference_gpu():
    """Realistic GQA shapes through the real Pallas kernels, in bf16: the decode kernels take bf16/fp16 only (in fp32
    the decode half would compare the reference with itself), so both halves compare Pallas with the reference.
    Anchors (0, 2), reuse layer 1 reading index head 0. Per anchor: the same budgets, and index sets holding the
    reference's Top-k scores (near-ties may swap keys, so the sorted reference scores of the selected keys must equal
    the reference's top `count` within 1e-4). Per layer: the output equal, per row (query, head), to the reference
    attention on the Pallas bundle's own indices (a near-tie swap would otherwise move it), within 1.5% of the row's
    RMS (the bf16 bound of tests/kernels_pallas/test_prefill.py: 4x the interpret-mode error). The reference side
    runs its fp32 matmuls in full fp32 (on a GPU they default to TF32, ~5e-4 relative, which moves Top-k picks)."""
    import jax

    from kernels_pallas import decode as pd
    from kernels_pallas import reference as R

    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")

    exact = jax.default_matmul_precision("float32")
    rng = np.random.default_rng(2024)
    b, kvh, g, d, max_len, lens, ts = 2, 3, 3, 64, 1024, [1024, 700], 32
    layers = [tuple(a.astype(jnp.bfloat16) for a in random_layer(rng, b, max_len, kvh * g, kvh, d)) for _ in range(3)]
    ident = tuple(range(kvh))
    cfg = KascadeConfig(num_layers=3, kv_heads=kvh, anchors=(0, 2), head_map=(ident, (0,) * kvh, ident),
                        topk_frac=0.1, min_k=16, tile_size=ts)
    valid = np.arange(max_len)[None, :] < np.asarray(lens)[:, None]  # prefill rows past a prompt are padding
    for phase, make in (("prefill", lambda lay: prefill_inputs(lay, 0, max_len, lens)),
                        ("decode", lambda lay: decode_inputs(lay, lens))):
        xs = [make(lay) for lay in layers]
        assert pd.pallas_supported(xs[0].q, xs[0].k_cache, xs[0].v_cache)  # the Pallas decode really runs
        pal_out, pal_st = run_layers(KascadeStrategy(cfg, kernels="pallas"), xs)
        with exact:
            _, ref_st = run_layers(KascadeStrategy(cfg), xs)
        for layer, x in enumerate(xs):
            st = pal_st[cfg.anchor_of(layer)]
            idx, row = np.asarray(st["idx"]), cfg.head_map_row(layer)
            if cfg.is_anchor(layer):
                np.testing.assert_array_equal(st["counts"], ref_st[layer]["counts"])
                with exact:
                    scores = (R.pooled_scores_prefill_reference(x.q, x.k_cache, x.q_start, x.kv_len, ts)[0]
                              if phase == "prefill" else R.pooled_scores_decode_reference(x.q, x.k_cache, x.kv_len))
                mine, theirs = (np.sort(np.where(i >= 0, np.take_along_axis(np.asarray(scores), np.maximum(i, 0), -1),
                                                 -np.inf), -1) for i in (idx, np.asarray(ref_st[layer]["idx"])))
                np.testing.assert_allclose(mine, theirs, rtol=1e-4, err_msg=f"{phase} layer {layer} Top-k scores")
            with exact:
                if layer == 0:  # layer0_dense: dense attention, still selects
                    want = R.attention_reference(x.q, x.k_cache, x.v_cache, x.q_start, x.kv_len)
                elif phase == "prefill":
                    want = R.sparse_prefill_reference(x.q, x.k_cache, x.v_cache, x.q_start, x.kv_len, idx, row, ts)
                else:
                    want = R.sparse_decode_reference(x.q, x.k_cache, x.v_cache, x.kv_len, idx, row)
            got, want = np.asarray(pal_out[layer], np.float64), np.asarray(want, np.float64)
            if phase == "prefill":
                got, want = got[valid], want[valid]
            rms = np.maximum(np.sqrt(np.mean(want ** 2, -1)), np.sqrt(np.mean(want ** 2)) / 8)  # per row, floored
            err = float((np.sqrt(np.mean((got - want) ** 2, -1)) / rms).max())
            print(f"{phase} layer {layer}: per-row error {err:.2e}")
            assert err < 1.5e-2, (phase, layer, err)


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_a_dense_anchor_nobody_reads_selects_nothing(rng, phase):
    """Anchors 0, 1: layer 0's dense output is the models' dense attention, its state None (no Top-k is computed:
    no layer reads it), and layer 1 runs as before; with anchors 0, 2 layer 0 selects for layer 1. The mesh state
    spec says the same."""
    kvh, g, d, max_len, lens = 2, 2, 8, 64, [64]
    layers = [random_layer(rng, 1, max_len, kvh * g, kvh, d) for _ in range(3)]
    inputs = ([decode_inputs(lay, lens) for lay in layers] if phase == "decode"
              else [prefill_inputs(lay, 0, max_len, lens) for lay in layers])
    kw = dict(topk_frac=0.25, min_k=4, tile_size=4)
    unread = make_strategy("kascade", 3, kvh, anchors=(0, 1), **kw)
    read = make_strategy("kascade", 3, kvh, anchors=(0, 2), **kw)
    assert unread.dense_unread(0, phase) and not read.dense_unread(0, phase) and not unread.dense_unread(1, phase)
    outs, states = run_layers(unread, inputs)
    assert states[0] is None and states[1] is not None
    np.testing.assert_allclose(outs[0], dense_reference(inputs[0]), atol=1e-5)
    out1, _ = unread.attend(1, inputs[1], None)
    np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(out1), atol=1e-5)
    outs_r, states_r = run_layers(read, inputs)
    assert states_r[0] is not None
    np.testing.assert_allclose(outs_r[0], outs[0], atol=1e-6)
    shards = types.SimpleNamespace(batch_axis="data", head_axis=None, head_shards=1)
    assert unread.state_spec(0, phase, shards) == jax.sharding.PartitionSpec()
    assert isinstance(read.state_spec(0, phase, shards), dict)
