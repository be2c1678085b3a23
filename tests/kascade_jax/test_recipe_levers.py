"""Recipe levers of KascadeConfig: forced sink / recent-window keys and the dense prompt suffix.

Checked against their definitions on fresh random (peaky) inputs: the forced keys are in every anchor's selection
(reference and Pallas kernels in interpret mode, decode and prefill), the budget is unchanged, and the dense suffix
makes exactly the last n prompt rows dense while every earlier row keeps the plain Kascade output.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kascade_jax.config import KascadeConfig
from kascade_jax.registry import make_strategy
from kascade_jax.strategies import _rows_contiguous
from kernels_pallas import decode as dec
from kernels_pallas import prefill as pre
from kernels_pallas import reference as ref
from kj_helpers import decode_inputs, dense_reference, prefill_inputs, random_layer, run_layers, valid_rows


def _sets(idx):
    return [set(int(i) for i in row if i >= 0) for row in np.asarray(idx).reshape(-1, idx.shape[-1])]


def test_config_rejects_forced_keys_beyond_min_k():
    with pytest.raises(ValueError, match="must not exceed min_k"):
        KascadeConfig(num_layers=4, kv_heads=2, min_k=16, sink_tokens=8, recent_window=9)
    for name in ("sink_tokens", "recent_window", "dense_suffix"):
        with pytest.raises(ValueError, match=name):
            KascadeConfig(num_layers=4, kv_heads=2, **{name: -1})
    with pytest.raises(ValueError, match="sinks"):
        ref.pooled_scores_decode_reference(jnp.zeros((1, 1, 2, 8)), jnp.zeros((1, 8, 1, 8)), jnp.asarray([8]),
                                           sinks=-2)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_decode_forced_keys_selected(rng, impl):
    b, s, hq, kvh, d, sinks, window = 2, 300, 4, 2, 64, 4, 16
    q = jnp.asarray(rng.normal(size=(b, 1, hq, d)) * 3, jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(b, s, kvh, d)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(b, s, kvh, d)), jnp.bfloat16)
    kv_len = jnp.asarray([s, int(rng.integers(150, s - 10))], jnp.int32)
    kw = dict(topk_frac=0.1, min_k=24, k_max=ref.max_budget(s, 0.1, 24), impl=impl, interpret=True)
    _, idx0, c0 = dec.anchor_decode(q, k, v, kv_len, **kw)
    _, idx, c = dec.anchor_decode(q, k, v, kv_len, sinks=sinks, window=window, **kw)
    np.testing.assert_array_equal(np.asarray(c), np.asarray(c0))  # same budget
    sets, sets0 = _sets(idx), _sets(idx0)
    for row, (got, plain) in enumerate(zip(sets, sets0)):
        n = int(kv_len[row // kvh])
        forced = set(range(sinks)) | set(range(n - window, n))
        assert forced <= got, (row, sorted(forced - got))
        assert len(got) == int(c[row // kvh])
        assert all(0 <= i < n for i in got)
        # the rest of the budget is the plain selection's best keys (forced ones displace its weakest)
        assert len(got - forced - plain) == 0 or impl == "pallas" and len(got - forced - plain) <= 1
    assert any(sets[r] != sets0[r] for r in range(len(sets)))  # the lever changed something on these inputs


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_prefill_forced_keys_selected(rng, impl):
    b, t, hq, kvh, d, tile, sinks, window = 2, 192, 6, 2, 64, 32, 2, 8
    q = jnp.asarray(rng.normal(size=(b, t, hq, d)) * 3, jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(b, t, kvh, d)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(b, t, kvh, d)), jnp.bfloat16)
    q_start = jnp.zeros((b,), jnp.int32)
    kv_len = jnp.asarray([t, t - 40], jnp.int32)
    kw = dict(topk_frac=0.25, min_k=12, k_max=ref.max_budget(t, 0.25, 12), impl=impl, interpret=True)
    _, idx, counts = pre.anchor_prefill(q, k, v, q_start, kv_len, kv_len, tile, sinks=sinks, window=window, **kw)
    rc = ref.prefill_counts(q_start, kv_len, kv_len, t, tile, 0.25, 12)
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(rc))
    idx = np.asarray(idx)
    for bi in range(b):
        for h in range(kvh):
            for ti in range(idx.shape[2]):
                start = ti * tile
                eligible = min(start, int(kv_len[bi]))
                got = set(int(i) for i in idx[bi, h, ti] if i >= 0)
                assert len(got) == int(counts[bi, ti])
                forced = ({j for j in range(sinks)} | set(range(start - window, start))) & set(range(eligible))
                assert forced <= got, (bi, h, ti, sorted(forced - got))


def test_strategy_forced_keys_reach_reuse_layers(rng):
    """Through the strategy: a reuse layer's decode output equals sparse attention over a set holding the forced keys."""
    num_layers, kvh, group, d, max_len = 3, 2, 2, 16, 96
    layers = [random_layer(rng, 2, max_len, kvh * group, kvh, d) for _ in range(num_layers)]
    lens = [max_len, 70]
    st = make_strategy("kascade", num_layers, kvh, anchors=(0,), topk_frac=0.1, min_k=12, sink_tokens=3,
                       recent_window=5)
    _, states = run_layers(st, [decode_inputs(lay, lens) for lay in layers])
    for row, got in enumerate(_sets(states[-1]["idx"])):
        n = lens[row // kvh]
        assert set(range(3)) | set(range(n - 5, n)) <= got


def test_dense_suffix_rows(rng):
    """Rows before the suffix keep the plain Kascade output; the suffix rows equal dense attention in a layer whose
    inputs are the same (layer 1 of one forward), and a suffix covering the prompt makes prefill dense."""
    num_layers, kvh, group, d, max_len, tile = 3, 2, 2, 16, 128, 16
    layers = [random_layer(rng, 2, max_len, kvh * group, kvh, d) for _ in range(num_layers)]
    lens = [max_len, 101]
    n = 20
    kw = dict(anchors=(0, 2), topk_frac=0.1, min_k=4, tile_size=tile)
    plain = make_strategy("kascade", num_layers, kvh, **kw)
    suffix = make_strategy("kascade", num_layers, kvh, dense_suffix=n, **kw)
    for q0, q1 in ((0, max_len), (0, 64), (64, max_len)):  # whole prompt, and the two chunks of a chunked prefill
        inputs = [prefill_inputs(lay, q0, q1 - q0, lens) for lay in layers]
        outs_p, _ = run_layers(plain, inputs)
        outs_s, _ = run_layers(suffix, inputs)
        pos = q0 + np.arange(q1 - q0)
        for li in (1, 2):
            dense = np.asarray(dense_reference(inputs[li]))
            op, os_ = np.asarray(outs_p[li]), np.asarray(outs_s[li])
            for bi, L in enumerate(lens):
                in_sfx = (pos >= L - n) & (pos < L)
                before = pos < L - n
                np.testing.assert_allclose(os_[bi, in_sfx], dense[bi, in_sfx], rtol=1e-5, atol=1e-5)
                np.testing.assert_array_equal(os_[bi, before], op[bi, before])
                if in_sfx.any():
                    assert not np.allclose(op[bi, in_sfx], dense[bi, in_sfx], atol=1e-4)  # the lever mattered
    # a chunk that is not a whole number of 32-row blocks (here 100 rows) is served by one block
    odd = [prefill_inputs(lay, 0, 100, [100, 100]) for lay in layers]
    outs_odd, _ = run_layers(make_strategy("kascade", num_layers, kvh, dense_suffix=120, **kw), odd)
    np.testing.assert_allclose(np.asarray(outs_odd[1]), np.asarray(dense_reference(odd[1])), rtol=1e-5, atol=1e-5)
    full = make_strategy("kascade", num_layers, kvh, dense_suffix=max_len, **kw)
    inputs = [prefill_inputs(lay, 0, max_len, lens) for lay in layers]
    outs, _ = run_layers(full, inputs)
    for li, lay in enumerate(layers):
        np.testing.assert_allclose(valid_rows(outs[li], 0, lens), valid_rows(dense_reference(inputs[li]), 0, lens),
                                   rtol=1e-5, atol=1e-5)


def test_dense_suffix_flash_pass_matches_the_reference(rng):
    """The GPU's dense-suffix path (one Pallas flash pass over the window, here in interpret mode) equals the blocked
    reference on ragged bf16 prompts, in the chunk that holds the suffix and in one the suffix straddles."""
    from kascade_jax import strategies  # noqa: PLC0415

    q, k, v = (x.astype(jnp.bfloat16) for x in random_layer(rng, 2, 256, 4, 2, 64))
    lens, n = [256, 203], 100
    for q0, q1 in ((128, 256), (0, 128)):  # the second prompt's suffix starts at 103: it straddles the chunks
        inputs = prefill_inputs((q, k, v), q0, q1 - q0, lens)
        out = jnp.asarray(rng.normal(size=inputs.q.shape), jnp.bfloat16)  # stands in for the sparse output
        want = strategies._dense_suffix(inputs, out, n)
        got = strategies._dense_suffix(inputs, out, n, interpret=True)
        pos = q0 + np.arange(q1 - q0)
        for bi, L in enumerate(lens):
            sfx = (pos >= L - n) & (pos < L)
            np.testing.assert_array_equal(np.asarray(got[bi, ~sfx]), np.asarray(out[bi, ~sfx]))
            np.testing.assert_allclose(np.asarray(got[bi, sfx], np.float32), np.asarray(want[bi, sfx], np.float32),
                                       atol=2e-2, rtol=2e-2)
            assert sfx.sum() == 0 or not np.allclose(np.asarray(got[bi, sfx], np.float32),
                                                     np.asarray(out[bi, sfx], np.float32), atol=0.1)


def test_levers_through_pallas_strategy_match_reference(rng):
    """kernels='pallas' (interpret mode on CPU runs their references) and 'reference' give the same outputs."""
    num_layers, kvh, group, d, max_len = 3, 2, 2, 64, 128
    layers = [random_layer(rng, 1, max_len, kvh * group, kvh, d) for _ in range(num_layers)]
    lens = [max_len]
    kw = dict(anchors=(0, 2), topk_frac=0.1, min_k=16, sink_tokens=4, recent_window=8, dense_suffix=32)
    a = make_strategy("kascade", num_layers, kvh, kernels="reference", **kw)
    b = make_strategy("kascade", num_layers, kvh, kernels="pallas", **kw)
    inputs = [prefill_inputs(lay, 0, max_len, lens) for lay in layers]
    for oa, ob in zip(run_layers(a, inputs)[0], run_layers(b, inputs)[0]):
        np.testing.assert_allclose(np.asarray(oa), np.asarray(ob), rtol=2e-5, atol=2e-5)


def test_forced_keys_triton_lowering_verifies_for_sm90(triton_sm90_modules):
    """The prefill scores kernel with forced keys lowers for CUDA and its Triton module verifies (no GPU needed)."""
    names = triton_sm90_modules
    b, t, hq, kvh, d, tile = 1, 2048, 14, 2, 64, 32  # Qwen2.5-Coder-0.5B's group of 7
    q = jax.ShapeDtypeStruct((b, t, hq, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((b, t, kvh, d), jnp.bfloat16)
    i32 = jax.ShapeDtypeStruct((b,), jnp.int32)
    f = lambda q, k, v, qs, kl: pre.anchor_prefill(q, k, v, qs, kl, kl, tile, topk_frac=0.1, min_k=128, k_max=205,
                                                   impl="pallas", sinks=4, window=60)
    jax.jit(f).trace(q, k, k, i32, i32).lower(lowering_platforms=("cuda",))
    assert len(names) >= 3  # LSE pass, pooled scores with forced keys, select (+ reuse)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_prefill_local_window_is_on_top_of_the_budget(rng, impl):
    """extra_k / window: every tile's count grows by the window, the window keys are selected, and the other
    count - window keys are still the plain Top-k's best (the window displaces none of them)."""
    b, t, hq, kvh, d, tile, w = 2, 256, 4, 2, 64, 32, 24
    q = jnp.asarray(rng.normal(size=(b, t, hq, d)) * 3, jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(b, t, kvh, d)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(b, t, kvh, d)), jnp.bfloat16)
    q_start = jnp.zeros((b,), jnp.int32)
    kv_len = jnp.asarray([t, t - 50], jnp.int32)
    kw = dict(topk_frac=0.1, min_k=8, impl=impl, interpret=True)
    k_plain = ref.max_budget(t, 0.1, 8)
    _, idx0, c0 = pre.anchor_prefill(q, k, v, q_start, kv_len, kv_len, tile, k_max=k_plain, **kw)
    _, idx, c = pre.anchor_prefill(q, k, v, q_start, kv_len, kv_len, tile, k_max=k_plain + w, window=w, extra_k=w,
                                   **kw)
    tile_start = np.arange(c.shape[1]) * tile
    eligible = np.minimum(tile_start[None], np.asarray(kv_len)[:, None])
    np.testing.assert_array_equal(np.asarray(c), np.minimum(np.asarray(c0) + w, eligible))
    idx, idx0 = np.asarray(idx), np.asarray(idx0)
    grew = 0
    for bi in range(b):
        for h in range(kvh):
            for ti in range(idx.shape[2]):
                got = {int(i) for i in idx[bi, h, ti] if i >= 0}
                plain = {int(i) for i in idx0[bi, h, ti] if i >= 0}
                window = set(range(max(0, tile_start[ti] - w), tile_start[ti])) & set(range(eligible[bi, ti]))
                assert len(got) == int(c[bi, ti]) and window <= got, (bi, h, ti)
                # the plain selection survives outside the window (ties aside in the Pallas select)
                assert len((plain - window) - got) <= (1 if impl == "pallas" else 0), (bi, h, ti)
                grew += len(got) > len(plain)
    assert grew > 0
    with pytest.raises(ValueError, match="extra must be an int >= 0"):
        ref.prefill_counts(q_start, kv_len, kv_len, t, tile, 0.1, 8, extra=-1)


def test_strategy_local_window_and_prefill_frac(rng):
    """Through the strategy: prefill budgets use prefill_topk_frac plus local_window, decode keeps topk_frac, and a
    reuse layer's prefill attends the window (its output equals sparse attention over the anchor's set)."""
    from kascade_jax.strategies import decode_budget, prefill_budget, static_k_max

    num_layers, kvh, group, d, max_len, tile = 3, 2, 2, 16, 256, 16
    cfg = KascadeConfig(num_layers=num_layers, kv_heads=kvh, anchors=(0,), topk_frac=0.1, min_k=8, tile_size=tile,
                        local_window=32, prefill_topk_frac=0.25)
    assert cfg.prefill_frac == 0.25 and KascadeConfig(num_layers=2, kv_heads=1).prefill_frac == 0.1
    assert static_k_max(cfg, max_len, "prefill") == 64 + 32 and static_k_max(cfg, max_len) == 25
    kv_len = jnp.asarray([max_len], jnp.int32)
    pc = np.asarray(prefill_budget(cfg, jnp.zeros((1,), jnp.int32), kv_len, kv_len, max_len))
    starts = np.arange(max_len // tile) * tile
    np.testing.assert_array_equal(pc[0], np.minimum(np.maximum(starts // 4, 8) + 32, starts))
    assert int(decode_budget(cfg, kv_len)[0]) == 25
    layers = [random_layer(rng, 2, max_len, kvh * group, kvh, d) for _ in range(num_layers)]
    lens = [max_len, 200]
    st = make_strategy("kascade", num_layers, kvh, anchors=(0,), topk_frac=0.1, min_k=8, tile_size=tile,
                       local_window=32)
    _, states = run_layers(st, [prefill_inputs(lay, 0, max_len, lens) for lay in layers])
    idx = np.asarray(states[-1]["idx"])
    for bi, n in enumerate(lens):
        for ti in range(1, idx.shape[2]):
            s0 = ti * tile
            got = {int(i) for i in idx[bi, 0, ti] if i >= 0}
            assert set(range(max(0, s0 - 32), min(s0, n))) <= got
    for bad in (dict(local_window=-1), dict(prefill_topk_frac=0.0), dict(prefill_topk_frac=1.5),
                dict(prefill_topk_frac=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            KascadeConfig(num_layers=2, kv_heads=1, **bad)


@pytest.mark.parametrize("kernels", ["reference", "pallas"])
def test_strategy_decode_frac(rng, kernels):
    """decode_topk_frac sets the decode budget alone: decode equals a run at topk_frac = decode_topk_frac (same
    outputs and index sets), prefill equals a run at the nominal topk_frac."""
    from kascade_jax.strategies import decode_budget, prefill_budget, static_k_max

    num_layers, kvh, group, d, max_len, tile = 3, 2, 2, 16, 256, 16
    cfg = KascadeConfig(num_layers=num_layers, kv_heads=kvh, anchors=(0,), topk_frac=0.1, min_k=8, tile_size=tile,
                        decode_topk_frac=0.25)
    assert cfg.decode_frac == 0.25 and cfg.prefill_frac == 0.1 and KascadeConfig(num_layers=2, kv_heads=1).decode_frac == 0.1
    assert static_k_max(cfg, max_len) == 64 and static_k_max(cfg, max_len, "prefill") == 25
    kv_len = jnp.asarray([max_len], jnp.int32)
    assert int(decode_budget(cfg, kv_len)[0]) == 64
    plain = KascadeConfig(num_layers=num_layers, kv_heads=kvh, anchors=(0,), topk_frac=0.1, min_k=8, tile_size=tile)
    np.testing.assert_array_equal(prefill_budget(cfg, jnp.zeros((1,), jnp.int32), kv_len, kv_len, max_len),
                                  prefill_budget(plain, jnp.zeros((1,), jnp.int32), kv_len, kv_len, max_len))
    layers = [random_layer(rng, 2, max_len, kvh * group, kvh, d) for _ in range(num_layers)]
    lens = [max_len, 200]
    kw = dict(anchors=(0, 2), min_k=8, tile_size=tile, kernels=kernels)
    split = make_strategy("kascade", num_layers, kvh, topk_frac=0.1, decode_topk_frac=0.25, **kw)
    same_decode = make_strategy("kascade", num_layers, kvh, topk_frac=0.25, **kw)
    same_prefill = make_strategy("kascade", num_layers, kvh, topk_frac=0.1, **kw)
    for other, inputs in ((same_decode, [decode_inputs(lay, lens) for lay in layers]),
                          (same_prefill, [prefill_inputs(lay, 0, max_len, lens) for lay in layers])):
        (oa, sa), (ob, sb) = run_layers(split, inputs), run_layers(other, inputs)
        for x, y in zip(oa, ob):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert _sets(sa[-1]["idx"]) == _sets(sb[-1]["idx"])
    for bad in (dict(decode_topk_frac=0.0), dict(decode_topk_frac=1.5), dict(decode_topk_frac=True)):
        with pytest.raises(ValueError, match="decode_topk_frac"):
            KascadeConfig(num_layers=2, kv_heads=1, **bad)


def test_dense_suffix_across_prefill_chunks(tiny_model, rng):
    """The suffix rows before a chunk boundary are dense too: a 70-token prompt with a 20-token suffix prefilled in
    64-token chunks (suffix rows 50..69 cross the boundary) equals its one-chunk prefill, batched with a 40-token
    prompt whose suffix does not cross."""
    from models import generate as gen
    from models.cache import KVCache

    cfg = tiny_model.config
    st = make_strategy("kascade", cfg.num_layers, cfg.kv_heads, anchors=(0,), topk_frac=0.1, min_k=4, tile_size=16,
                       dense_suffix=20)
    plain = make_strategy("kascade", cfg.num_layers, cfg.kv_heads, anchors=(0,), topk_frac=0.1, min_k=4, tile_size=16)
    toks = rng.integers(5, 128, (2, 128))
    lens = np.array([70, 40], np.int32)

    def logits(strategy, chunk):
        cache = KVCache.init(cfg, 2, 128, jnp.float32)
        out, _ = gen.prefill(tiny_model, toks, lens, cache, strategy, chunk_size=chunk, all_logits=True)
        return np.asarray(out)

    whole, chunked = logits(st, None), logits(st, 64)
    for b, n in enumerate(lens):
        np.testing.assert_allclose(chunked[b, :n], whole[b, :n], atol=1e-4, rtol=1e-4)
    sparse = logits(plain, None)  # and the suffix changes those rows: the check above can see a missing suffix
    assert np.abs(sparse[0, 50:64] - whole[0, 50:64]).max() > 1e-3


def test_strategy_prefill_key_block(rng):
    """prefill_key_block=16 through the strategy (reference and pallas bundles, the latter its reference on CPU):
    the anchor's state holds whole blocks of 16 ids, ceil(k_max / 16) of them wide, every reuse layer attends them,
    and the selection differs from single keys'. A bundle that ignores the lever is refused by name."""
    from kascade_jax.strategies import get_kernels, prefill_width, register_kernels, static_k_max

    num_layers, kvh, group, d, max_len, tile, kb = 3, 2, 2, 16, 160, 32, 16
    layers = [random_layer(rng, 2, max_len, kvh * group, kvh, d) for _ in range(num_layers)]
    lens = [max_len, 121]
    # (the forced keys' blocks must fit the smallest budget: 1 sink block + 2 window blocks <= ceil(min_k / kb))
    kw = dict(anchors=(0,), topk_frac=0.25, min_k=48, tile_size=tile, sink_tokens=2, recent_window=4)
    pre_in = [prefill_inputs(lay, 0, max_len, lens) for lay in layers]
    outs = {}
    for kernels in ("reference", "pallas"):
        st = make_strategy("kascade", num_layers, kvh, kernels=kernels, prefill_key_block=kb, **kw)
        outs[kernels], states = run_layers(st, pre_in)
        idx, counts = np.asarray(states[-1]["idx"]), np.asarray(states[-1]["counts"])
        k_max = static_k_max(st.config, max_len, "prefill")
        assert idx.shape[-1] == prefill_width(st.config, k_max) == 128 == k_max  # (whole 128-lane steps)
        assert np.all(counts % kb == 0)
        groups = idx.reshape(idx.shape[:-1] + (-1, kb))
        valid = groups[..., 0] >= 0
        assert np.all(groups[valid] == groups[valid][:, :1] + np.arange(kb)) and np.all(groups[valid][:, 0] % kb == 0)
        np.testing.assert_array_equal(valid.sum(-1) * kb, np.broadcast_to(counts[:, None], valid.shape[:-1]))
        ref_out = ref.sparse_prefill_reference(pre_in[1].q, pre_in[1].k_cache, pre_in[1].v_cache, pre_in[1].q_start,
                                               pre_in[1].kv_len, states[1]["idx"], jnp.arange(kvh), tile)
        np.testing.assert_allclose(valid_rows(outs[kernels][1], 0, lens), valid_rows(ref_out, 0, lens), atol=1e-5)
    for a, b in zip(outs["reference"], outs["pallas"]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    plain, _ = run_layers(make_strategy("kascade", num_layers, kvh, **kw), pre_in)
    assert float(jnp.max(jnp.abs(valid_rows(plain[2] - outs["reference"][2], 0, lens)))) > 1e-3
    base = get_kernels("reference")
    register_kernels("key_block_ignored", dataclasses.replace(base, anchor_prefill=lambda *a, cfg, **k: (
        base.anchor_prefill(*a, cfg=dataclasses.replace(cfg, prefill_key_block=1), **k))))
    st = make_strategy("kascade", num_layers, kvh, kernels="key_block_ignored", prefill_key_block=kb, **kw)
    short = prefill_inputs(random_layer(rng, 2, 120, kvh * group, kvh, d), 0, 120, [120, 100])  # k_max 120: not whole
    with pytest.raises(ValueError, match="ignore prefill_key_block=16: anchor idx width 120, want 128"):
        jax.jit(lambda x: st.attend(0, x, None))(short)  # (raised while tracing)


def test_prefill_key_block_through_a_model_prefill(tiny_model, rng):
    """A model's prefill with prefill_key_block=16 runs (finite logits) and differs from single-key selection."""
    from models import generate as gen
    from models.cache import KVCache

    cfg = tiny_model.config
    kw = dict(anchors=(0,), topk_frac=0.1, min_k=16, tile_size=32)
    toks = rng.integers(5, 128, (2, 160))
    lens = np.array([160, 100], np.int32)

    def logits(**extra):
        st = make_strategy("kascade", cfg.num_layers, cfg.kv_heads, **kw, **extra)
        out, _ = gen.prefill(tiny_model, toks, lens, KVCache.init(cfg, 2, 160, jnp.float32), st, all_logits=True)
        return np.asarray(out)

    blocks, plain = logits(prefill_key_block=16), logits()
    assert np.all(np.isfinite(blocks))
    assert np.abs(blocks[0] - plain[0]).max() > 1e-3


@pytest.mark.parametrize("kernels", ["reference", "pallas"])
@pytest.mark.parametrize("q_start", [0, 64])
def test_strategy_prefill_dense_anchors(rng, kernels, q_start):
    """prefill_dense_anchors: every anchor's prefill output is dense causal attention (layer 0's rule, also in a
    chunk that does not start at 0), the anchors select the same keys, reuse layers and decode are unchanged."""
    num_layers, kvh, group, d, max_len, tile = 4, 2, 3, 16, 192, 16
    layers = [random_layer(rng, 2, max_len, kvh * group, kvh, d) for _ in range(num_layers)]
    lens = [max_len, 150]
    kw = dict(anchors=(0, 2), topk_frac=0.1, min_k=8, tile_size=tile, kernels=kernels, sink_tokens=2,
              recent_window=4, dense_suffix=24)
    dense_anchors = make_strategy("kascade", num_layers, kvh, prefill_dense_anchors=True, **kw)
    plain = make_strategy("kascade", num_layers, kvh, **kw)
    pre_in = [prefill_inputs(lay, q_start, max_len - q_start, lens) for lay in layers]
    (oa, sa), (ob, sb) = run_layers(dense_anchors, pre_in), run_layers(plain, pre_in)
    for layer in range(num_layers):
        got, want = valid_rows(oa[layer], q_start, lens), valid_rows(ob[layer], q_start, lens)
        if layer in (0, 2):
            dense = valid_rows(dense_reference(pre_in[layer]), q_start, lens)
            np.testing.assert_allclose(np.asarray(got), np.asarray(dense), atol=2e-5, rtol=2e-5)
            if layer == 2:  # the plain anchor attends sparsely: it differs from dense
                assert float(jnp.max(jnp.abs(want - dense))) > 1e-3
        else:
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert _sets(sa[layer]["idx"]) == _sets(sb[layer]["idx"])
    dec_in = [decode_inputs(lay, lens) for lay in layers]
    for x, y in zip(run_layers(dense_anchors, dec_in)[0], run_layers(plain, dec_in)[0]):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="prefill_dense_anchors must be a bool"):
        KascadeConfig(num_layers=2, kv_heads=1, prefill_dense_anchors=1)


def test_recipe_switches_dense_prefill_and_dense_anchors():
    """The recipe switches reach the strategy; off, they never override a variant (decode_only stays dense)."""
    from kascade_jax.recipes import Recipe, candidate

    dps = candidate("dps")
    assert dps.levers()["decode_only"] is True and "decode_only" in dps.describe()
    st = make_strategy("kascade", 4, 2, anchors=(0, 2), **dps.levers())
    assert st.config.decode_only and not st.config.prefill_dense_anchors
    assert make_strategy("decode_only", 4, 2, anchors=(0, 2), **Recipe().levers()).config.decode_only
    assert "decode_only" not in Recipe().levers() and "prefill_dense_anchors" not in Recipe().levers()
    pda = candidate("pda_s")
    assert make_strategy("kascade", 4, 2, anchors=(0, 2), **pda.levers()).config.prefill_dense_anchors
    with pytest.raises(ValueError, match="decode_only must be true or false"):
        Recipe(decode_only="yes")


@pytest.mark.parametrize("kernels", ["reference", "pallas"])
def test_decode_rerank_over_every_key_is_each_layers_own_topk(rng, kernels):
    """decode_rerank with every key a candidate (C x 10% >= 1): each reuse layer attends exactly its own Top-k, so
    decode equals oracle_topk (layer 0, the only anchor, is dense in both), forced keys included. With C = 2 the
    reuse layers keep the plain budget and their output moves off the plain reuse's."""
    from kascade_jax.strategies import decode_budget, rerank_config

    num_layers, kvh, group, d, max_len = 3, 2, 3, 16, 160
    layers = [random_layer(rng, 2, max_len, kvh * group, kvh, d) for _ in range(num_layers)]
    inputs = [decode_inputs(lay, [max_len, 117]) for lay in layers]
    kw = dict(anchors=(0,), topk_frac=0.1, min_k=8, sink_tokens=2, recent_window=4, kernels=kernels)
    every, _ = run_layers(make_strategy("kascade", num_layers, kvh, decode_rerank=10, **kw), inputs)
    own, _ = run_layers(make_strategy("oracle_topk", num_layers, kvh, **kw), inputs)
    plain, plain_states = run_layers(make_strategy("kascade", num_layers, kvh, **kw), inputs)
    two, two_states = run_layers(make_strategy("kascade", num_layers, kvh, decode_rerank=2, **kw), inputs)
    for layer in (1, 2):
        np.testing.assert_allclose(np.asarray(every[layer]), np.asarray(own[layer]), rtol=1e-5, atol=1e-5)
        assert not np.allclose(np.asarray(every[layer]), np.asarray(plain[layer]), atol=1e-3)
        assert not np.allclose(np.asarray(two[layer]), np.asarray(plain[layer]), atol=1e-3)
    cfg = KascadeConfig(num_layers=num_layers, kv_heads=kvh, **{k: v for k, v in kw.items() if k != "kernels"})
    lens = jnp.asarray([max_len, 117])
    np.testing.assert_array_equal(np.asarray(plain_states[0]["counts"]), np.asarray(decode_budget(cfg, lens)))
    cand = np.asarray(decode_budget(rerank_config(dataclasses.replace(cfg, decode_rerank=2)), lens))  # 20%: 32, 23
    np.testing.assert_array_equal(np.asarray(two_states[0]["counts"]), cand)  # the anchor's candidates


def _candidates_case(rng):
    """q, k, kv_len, candidates (fewer in the second sequence, -1 past them) and a config with forced keys."""
    b, s, hq, kvh, d, c_max = 2, 200, 6, 2, 16, 48
    q, k = rng.normal(size=(b, 1, hq, d)) * 2, rng.normal(size=(b, s, kvh, d))
    kv_len = np.array([200, 131])
    cand = np.full((b, kvh, c_max), -1, np.int32)
    for bi in range(b):
        for h in range(kvh):
            cand[bi, h, :c_max - 10 * bi] = rng.choice(kv_len[bi], c_max - 10 * bi, replace=False)
    cfg = KascadeConfig(num_layers=2, kv_heads=kvh, topk_frac=0.1, min_k=12, sink_tokens=2, recent_window=3)
    args = (jnp.asarray(q, jnp.float32), _rows_contiguous(jnp.asarray(k, jnp.float32)), jnp.asarray(kv_len, jnp.int32),
            jnp.asarray(cand))
    return q, k, kv_len, cand, cfg, args


def _numpy_scores(q, k, kv_len, c, bi, h):
    """Candidates c's post-softmax probabilities over c, summed over KV head h's group; forced keys (2 sinks, a
    window of 3) at inf."""
    g, d = q.shape[2] // k.shape[2], q.shape[-1]
    logits = q[bi, 0, h * g:(h + 1) * g] @ k[bi, c, h].T / np.sqrt(d)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    score = (p / p.sum(-1, keepdims=True)).sum(0)
    forced = (c < 2) | (c >= kv_len[bi] - 3)
    score[forced] = np.inf
    return score, forced


def _pallas_select(scores, n_valid, counts, k_max):
    """Kernels.select_topk of the Pallas bundle on a GPU: the anchors' Top-k pipeline, here in interpret mode."""
    from kernels_pallas.decode import select_topk

    return select_topk(scores, n_valid, counts, k_max, interpret=True)


SELECTS = {"sort": None, "pallas_topk": _pallas_select}


@pytest.mark.parametrize("select", sorted(SELECTS))
def test_rerank_decode_matches_numpy(rng, select):
    """rerank_decode keeps, per KV head, the budget's best candidates by this layer's post-softmax probabilities
    over the candidates (summed over the group), forced keys included; -1 past the count. The same set through
    lax.top_k and through the Pallas Top-k pipeline (what the Pallas bundle uses on a GPU instead of a sort)."""
    from kascade_jax.strategies import decode_budget, rerank_decode, static_k_max

    q, k, kv_len, cand, cfg, args = _candidates_case(rng)
    idx, counts = rerank_decode(*args, cfg, static_k_max(cfg, k.shape[1]), SELECTS[select])
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(decode_budget(cfg, jnp.asarray(kv_len))))
    idx = np.asarray(idx)
    for bi in range(cand.shape[0]):
        for h in range(cand.shape[1]):
            c = cand[bi, h][cand[bi, h] >= 0]
            score, _ = _numpy_scores(q, k, kv_len, c, bi, h)
            want = set(c[np.argsort(-score, kind="stable")[: int(counts[bi])]].tolist())
            got = idx[bi, h]
            assert set(got[got >= 0].tolist()) == want and (got >= 0).sum() == int(counts[bi]), (bi, h)
            assert (got[int(counts[bi]):] == -1).all()


@pytest.mark.parametrize("select", sorted(SELECTS))
def test_order_candidates_matches_numpy(rng, select):
    """order_candidates: every valid candidate once, the anchor's own Top-k among them first (by its post-softmax
    probabilities over them, summed over the group; forced keys included), then the others, -1 last."""
    from kascade_jax.strategies import decode_budget, order_candidates, static_k_max

    q, k, kv_len, cand, cfg, args = _candidates_case(rng)
    kk_max = static_k_max(cfg, k.shape[1])
    got = np.asarray(order_candidates(*args, cfg, kk_max, SELECTS[select]))
    counts = np.asarray(decode_budget(cfg, jnp.asarray(kv_len)))
    for bi in range(cand.shape[0]):
        for h in range(cand.shape[1]):
            c = cand[bi, h][cand[bi, h] >= 0]
            score, forced = _numpy_scores(q, k, kv_len, c, bi, h)
            n, kk = len(c), int(counts[bi])
            assert sorted(got[bi, h, :n].tolist()) == sorted(c.tolist()) and (got[bi, h, n:] == -1).all()
            want = set(c[np.argsort(-score, kind="stable")[:kk]].tolist())
            assert set(got[bi, h, :kk].tolist()) == want, (bi, h)
            assert set(c[forced].tolist()) <= want


@pytest.mark.parametrize("kernels", ["reference", "pallas"])
def test_decode_rerank_layers_rerank_only_those(rng, kernels):
    """decode_rerank_layers: the listed reuse layer attends its own Top-k (every key a candidate: as oracle_topk),
    the others their anchor's Top-k, the first k of its ordered candidates (as plain Kascade's reuse layers)."""
    num_layers, kvh, group, d, max_len = 4, 2, 3, 16, 160
    layers = [random_layer(rng, 2, max_len, kvh * group, kvh, d) for _ in range(num_layers)]
    inputs = [decode_inputs(lay, [max_len, 117]) for lay in layers]
    kw = dict(anchors=(0,), topk_frac=0.1, min_k=8, sink_tokens=2, recent_window=4, kernels=kernels)
    some, _ = run_layers(make_strategy("kascade", num_layers, kvh, decode_rerank=10, decode_rerank_layers=(2,),
                                       **kw), inputs)
    own, _ = run_layers(make_strategy("oracle_topk", num_layers, kvh, **kw), inputs)
    plain, _ = run_layers(make_strategy("kascade", num_layers, kvh, **kw), inputs)
    np.testing.assert_allclose(np.asarray(some[2]), np.asarray(own[2]), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(some[2]), np.asarray(plain[2]), atol=1e-3)
    for layer in (1, 3):
        np.testing.assert_allclose(np.asarray(some[layer]), np.asarray(plain[layer]), rtol=1e-5, atol=1e-5)


def test_decode_rerank_layers_config_and_recipe():
    with pytest.raises(ValueError, match="needs decode_rerank > 1"):
        KascadeConfig(num_layers=4, kv_heads=1, decode_rerank_layers=(1,))
    with pytest.raises(ValueError, match=r"must be reuse layers .*got \[2\]"):
        KascadeConfig(num_layers=4, kv_heads=1, anchors=(0, 2), decode_rerank=2, decode_rerank_layers=(1, 2))
    with pytest.raises(ValueError, match=r"must be reuse layers .*got \[4\]"):
        KascadeConfig(num_layers=4, kv_heads=1, decode_rerank=2, decode_rerank_layers=(4,))
    with pytest.raises(ValueError, match="strictly increasing"):
        KascadeConfig(num_layers=4, kv_heads=1, decode_rerank=2, decode_rerank_layers=(3, 1))
    cfg = KascadeConfig(num_layers=4, kv_heads=1, anchors=(0, 2), decode_rerank=2, decode_rerank_layers=[3])
    assert cfg.decode_rerank_layers == (3,) and KascadeConfig.from_json(cfg.to_json()) == cfg
    assert [cfg.reranks(x) for x in range(4)] == [False, False, False, True]
    assert [dataclasses.replace(cfg, decode_rerank_layers=None).reranks(x) for x in range(4)] == [False, True, False,
                                                                                                  True]
    from kascade_jax.recipes import Recipe, candidate

    with pytest.raises(ValueError, match="decode_rerank_worst=5 needs decode_rerank > 1"):
        Recipe(decode_rerank_worst=5)
    with pytest.raises(ValueError, match="decode_rerank_worst must be null or an int >= 1"):
        Recipe(decode_rerank=2, decode_rerank_worst=0)
    assert "decode_rerank_worst=5" in candidate("dps_rr4w5").describe()


def test_recipe_pool_is_the_all_heads_pooled_strategy(rng):
    """A recipe's pool="all" lever builds the same strategy as --strategies=all_heads_pooled: one set shared by
    every head, the calibrated head map dropped; it is refused with the per-KV-head rerank, and its describe()
    string round-trips through the report's parser."""
    from kascade_jax.eval.accuracy import config_fields
    from kascade_jax.recipes import Recipe, candidate
    from models.attention import AttentionInputs

    with pytest.raises(ValueError, match="pool must be null or one of"):
        Recipe(pool="max")
    with pytest.raises(ValueError, match="pool 'all' shares one index set"):
        Recipe(pool="all", decode_rerank=4)
    r = candidate("dps_all")
    assert r.levers()["pool"] == "all" and "pool=all" in r.describe()
    assert config_fields("k=0.1 anchors=0,2 head_map=identity " + r.describe())["pool"] == "all"
    assert "pool" not in candidate("dps").levers()
    num_layers, kvh, b, s, hq, d = 4, 2, 2, 96, 4, 16
    hm = ((0, 1), (1, 0), (0, 1), (1, 1))
    kw = dict(anchors=(0, 2), topk_frac=0.1, min_k=8, decode_only=True)
    via_recipe = make_strategy("kascade", num_layers, kvh, head_map=hm, **kw, pool="all")
    variant = make_strategy("all_heads_pooled", num_layers, kvh, head_map=hm, **kw)
    plain = make_strategy("kascade", num_layers, kvh, head_map=hm, **kw)
    assert via_recipe.config == variant.config and via_recipe.config.head_map is None
    q = jnp.asarray(rng.normal(size=(b, 1, hq, d)) * 2, jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, s, kvh, d)), jnp.float32) for _ in range(2))
    kv_len = jnp.asarray([s, 70], jnp.int32)

    def outs(strat):
        state, got = None, []
        for layer in range(num_layers):
            out, state = strat.attend(layer, AttentionInputs(q=q, k_cache=k, v_cache=v, q_start=kv_len - 1,
                                                             kv_len=kv_len, seq_len=kv_len, phase="decode"), state)
            got.append(np.asarray(out))
        return got

    shared, per_head = outs(via_recipe), outs(plain)
    np.testing.assert_allclose(shared[3], outs(variant)[3], rtol=1e-6, atol=1e-6)
    assert not np.allclose(shared[3], per_head[3], atol=1e-3)  # a reuse layer reads another selection
    assert "decode_rerank_worst" not in candidate("dps_rr4w5").levers()  # resolved to layers with the calibration


def test_least_similar_layers():
    """The reuse layers least similar to what they read from their anchor, through the head map."""
    from kascade_jax.calibration.head_map import head_map_for, least_similar_layers

    L, H = 6, 2
    sim = np.full((L, L, H, H), 0.9)
    sim[0, 1, 0, 1] = 0.99  # layer 1 reads head 1 of anchor 0 for its head 0 (the map's choice), head 1 as is
    sim[0, 1, 0, 0] = 0.1
    sim[3, 5, :, :] = 0.3  # layer 5 is far from anchor 3
    sim[0, 2, 1, 1] = 0.5  # layer 2 so-so
    hm = head_map_for(sim, (0, 3))
    assert least_similar_layers(sim, (0, 3), hm, 1) == (5,)
    assert least_similar_layers(sim, (0, 3), hm, 2) == (2, 5)
    assert least_similar_layers(sim, (0, 3), hm, 9) == (1, 2, 4, 5)  # fewer reuse layers than asked: all
    ident = np.tile(np.arange(H), (L, 1))
    assert least_similar_layers(sim, (0, 3), ident, 1) == (5,) and least_similar_layers(sim, (0, 3), ident, 2) == (1, 5)


def test_decode_rerank_config_checks():
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="decode_rerank"):
            KascadeConfig(num_layers=2, kv_heads=1, decode_rerank=bad)
    with pytest.raises(ValueError, match="decode_rerank ranks candidates per KV head"):
        KascadeConfig(num_layers=2, kv_heads=1, decode_rerank=2, pool="all")
    with pytest.raises(ValueError, match="oracle_topk has none"):
        KascadeConfig(num_layers=2, kv_heads=1, decode_rerank=2, oracle_topk=True)
    from kascade_jax.strategies import rerank_config

    cfg = KascadeConfig(num_layers=2, kv_heads=1, topk_frac=0.1, min_k=16, decode_rerank=4)
    acfg = rerank_config(cfg)
    assert (acfg.decode_frac, acfg.min_k, acfg.decode_rerank, acfg.topk_frac) == (0.4, 64, 1, 0.1)
    assert rerank_config(dataclasses.replace(cfg, decode_rerank=20)).decode_frac == 1.0  # capped: every key


def test_decode_bench_strategy_pieces_are_the_strategys_layers(rng):
    """The decode benchmark's rerank pieces (kascade_jax.bench.decode.strategy_pieces, timed on the GPU) run the
    strategy's own layers: the reuse piece, called with another query than its anchor's, attends that query's own
    Top-k with every key a candidate (oracle_topk on it), and its anchor's selection without the lever; layer 0 is
    dense."""
    from kascade_jax.bench.decode import strategy_pieces
    from models.attention import AttentionInputs

    b, s, hq, kvh, d = 2, 160, 6, 2, 16
    q, q2 = (jnp.asarray(rng.normal(size=(b, 1, hq, d)) * 2, jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=(b, s, kvh, d)), jnp.float32) for _ in range(2))
    kv_len = jnp.asarray([s, 117], jnp.int32)

    def own_topk(query):  # oracle_topk's layer 1: its own pooled Top-k 10% (layer 0 dense)
        strat, state = make_strategy("oracle_topk", 2, kvh, topk_frac=0.1, min_k=8), None
        for layer in range(2):
            out, state = strat.attend(layer, AttentionInputs(q=query, k_cache=k, v_cache=v, q_start=kv_len - 1,
                                                             kv_len=kv_len, seq_len=kv_len, phase="decode"), state)
        return np.asarray(out)

    every = {n: (fn, a) for n, fn, a in strategy_pieces(q, k, v, kv_len, 0.1, 8, kernels="reference",
                                                        decode_rerank=10)}
    plain = {n: (fn, a) for n, fn, a in strategy_pieces(q, k, v, kv_len, 0.1, 8, kernels="reference")}
    reuse = lambda pieces, query: np.asarray(pieces["R"][0](query, *pieces["R"][1][1:]))  # noqa: E731
    np.testing.assert_allclose(reuse(every, q2), own_topk(q2), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(reuse(plain, q), own_topk(q), rtol=1e-5, atol=1e-5)  # q's anchor selected for q
    assert not np.allclose(reuse(plain, q2), own_topk(q2), atol=1e-3)  # q2 reads q's selection
    dense, _ = make_strategy("dense", 2, kvh).attend(0, AttentionInputs(
        q=q, k_cache=k, v_cache=v, q_start=kv_len - 1, kv_len=kv_len, seq_len=kv_len, phase="decode"), None)
    for pieces in (plain, every):
        np.testing.assert_allclose(np.asarray(pieces["A0"][0](*pieces["A0"][1])), np.asarray(dense), rtol=1e-5,
                                   atol=1e-5)
    # decode_rerank_worst's mix: layer 3 reranks (R), layer 4 (F) attends the anchor's own Top-k among its
    # candidates, which with every key a candidate is the anchor's own Top-k: plain Kascade's reuse layer
    worst = {n: (fn, a) for n, fn, a in strategy_pieces(q, k, v, kv_len, 0.1, 8, kernels="reference",
                                                        decode_rerank=10, decode_rerank_layers=(3,))}
    assert sorted(worst) == ["A", "A0", "F", "R"] and "F" not in every
    np.testing.assert_allclose(reuse(worst, q2), own_topk(q2), rtol=1e-5, atol=1e-5)
    first = np.asarray(worst["F"][0](q2, *worst["F"][1][1:]))
    np.testing.assert_allclose(first, reuse(plain, q2), rtol=1e-5, atol=1e-5)
    # --decode_pools=all: the pieces are all_heads_pooled's layers (one set pooled over every head, shared), which
    # differ from Kascade's per-KV-head selection on the same query
    shared = {n: (fn, a) for n, fn, a in strategy_pieces(q, k, v, kv_len, 0.1, 8, kernels="reference", pool="all")}
    ahp, state = make_strategy("all_heads_pooled", 4, kvh, anchors=(0, 1), topk_frac=0.1, min_k=8), None
    for layer in range(3):
        out, state = ahp.attend(layer, AttentionInputs(q=q, k_cache=k, v_cache=v, q_start=kv_len - 1, kv_len=kv_len,
                                                       seq_len=kv_len, phase="decode"), state)
    np.testing.assert_allclose(reuse(shared, q), np.asarray(out), rtol=1e-5, atol=1e-5)
    assert not np.allclose(reuse(shared, q), reuse(plain, q), atol=1e-3)


@pytest.mark.gpu
def test_rerank_top_k_through_the_pallas_pipeline_gpu():
    """On the GPU the Pallas bundle's rerank scores its candidates with the candidate-logits kernel (equal to the
    gather + einsum reference within bf16 rounding) and selects with the anchors' sort-free Top-k pipeline: at a
    Qwen-like decode shape (bf16 cache, 16K keys, 4k candidates) the same sets as lax.top_k on the same scores, for
    the reranking layers (rerank_decode) and the anchors' own Top-k among their candidates (order_candidates)."""
    from kascade_jax.strategies import decode_budget, get_kernels, order_candidates, rerank_decode, static_k_max

    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(11)
    b, s, hq, kvh, d = 4, 16384, 14, 2, 64
    cfg = KascadeConfig(num_layers=4, kv_heads=kvh, topk_frac=0.1, min_k=128, sink_tokens=4, recent_window=60)
    kv_len = np.array([16384, 12000, 9000, 16384])
    n_cand = 4 * int(0.1 * s)
    cand = np.full((b, kvh, n_cand), -1, np.int32)
    for bi in range(b):
        n = min(n_cand, 4 * int(0.1 * kv_len[bi]))
        for h in range(kvh):
            cand[bi, h, :n] = np.sort(rng.choice(kv_len[bi], n, replace=False))
    q = jnp.asarray(rng.normal(size=(b, 1, hq, d)) * 2, jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(b, s, kvh, d)), jnp.bfloat16)
    args = (q, _rows_contiguous(k), jnp.asarray(kv_len, jnp.int32), jnp.asarray(cand))
    kern = get_kernels("pallas")
    k_max, select = static_k_max(cfg, s), kern.select_topk
    logits = lambda c: kern.candidate_logits(q, k, jnp.asarray(kv_len, jnp.int32), c)  # the Pallas kernel here
    ref_logits = dec.candidate_logits(q, k, jnp.asarray(kv_len, jnp.int32), jnp.asarray(cand), impl="reference")
    np.testing.assert_allclose(np.asarray(logits(jnp.asarray(cand))), np.asarray(ref_logits), rtol=2e-3, atol=2e-3)
    for fn in (rerank_decode, order_candidates):  # the same logits: the pipeline's sets equal lax.top_k's exactly
        got, want = fn(*args, cfg, k_max, select, logits), fn(*args, cfg, k_max, None, logits)
        got, want = (np.asarray(x[0] if isinstance(x, tuple) else x) for x in (got, want))
        counts = np.asarray(decode_budget(cfg, jnp.asarray(kv_len, jnp.int32)))
        for bi in range(b):
            kk = int(counts[bi])
            for h in range(kvh):
                assert set(got[bi, h, :kk].tolist()) == set(want[bi, h, :kk].tolist()), (fn.__name__, bi, h)


def test_strategy_prefill_score_fp8(rng):
    """prefill_score_fp8 through the strategy (reference and pallas bundles; the latter's reference on CPU): the
    sparse-output anchor (layer 2; layer 1 reads layer 0) selects a Top-k set of the scores of
    `reference.fp8_score_qk`'s operands, layer 0 (dense output) selects as without the lever, both bundles agree, and the lever changes some selection. The
    config, recipe and eval-row parsing carry it as a switch."""
    from kascade_jax.eval.accuracy import config_fields
    from kascade_jax.recipes import Recipe
    from tests.kernels_pallas.test_prefill import _check_idx

    num_layers, kvh, group, d, max_len, tile = 3, 2, 2, 16, 160, 32
    layers = [random_layer(rng, 2, max_len, kvh * group, kvh, d) for _ in range(num_layers)]
    lens = [max_len, 121]
    kw = dict(anchors=(0, 2), topk_frac=0.25, min_k=16, tile_size=tile)
    pre_in = [prefill_inputs(lay, 0, max_len, lens) for lay in layers]
    states = {}
    for kernels in ("reference", "pallas"):
        st = make_strategy("kascade", num_layers, kvh, kernels=kernels, prefill_score_fp8=True, **kw)
        out, states[kernels] = run_layers(st, pre_in)
        a = pre_in[2]
        q_s, k_s = ref.fp8_score_qk(a.q, a.k_cache, a.kv_len)
        scores, _ = ref.pooled_scores_prefill_reference(q_s, k_s, a.q_start, a.kv_len, tile)
        _check_idx(states[kernels][2]["idx"], states[kernels][2]["counts"], scores)
    assert _sets(states["reference"][2]["idx"]) == _sets(states["pallas"][2]["idx"])
    _, plain = run_layers(make_strategy("kascade", num_layers, kvh, **kw), pre_in)
    assert _sets(plain[0]["idx"]) == _sets(states["reference"][0]["idx"])  # layer 0: exact scores
    assert _sets(plain[2]["idx"]) != _sets(states["reference"][2]["idx"])
    with pytest.raises(ValueError, match="prefill_score_fp8 must be a bool"):
        KascadeConfig(num_layers=2, kv_heads=1, prefill_score_fp8=1)
    r = Recipe(name="x", prefill_score_fp8=True)
    assert r.levers()["prefill_score_fp8"] is True and "prefill_score_fp8" not in Recipe().levers()
    assert config_fields(r.describe())["prefill_score_fp8"] is True
