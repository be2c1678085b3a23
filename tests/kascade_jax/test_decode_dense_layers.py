"""The decode_dense_layers lever (KascadeConfig.decode_dense_layers): in decode the listed layers output dense
attention; a listed anchor still selects (the same state), a listed reuse layer hands its anchor's state on. Checked
against dense attention on the same q / k / v, contiguous and paged (reference bundle and the Pallas kernels in
interpret mode), plus the recipe, flag, config-string and price plumbing."""

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from kascade_jax.config import KascadeConfig
from kascade_jax.eval import accuracy
from kascade_jax.recipes import Recipe, candidate
from kascade_jax.registry import make_strategy
from kascade_jax.strategies import Kernels, get_kernels, register_kernels
from kernels_pallas import decode as dec
from kernels_pallas import paged as pg
from kj_helpers import decode_inputs, dense_reference, flag_recipe, random_layer, run_layers

NUM_LAYERS, KVH, GROUP, MAX_LEN = 5, 2, 2, 128
KW = dict(anchors=(0, 2), topk_frac=0.1, min_k=8, sink_tokens=2, recent_window=4)
LISTED = (2, -1)  # anchor 2 and reuse layer 4


def _interpret_bundle() -> str:
    """The reference bundle with every decode call through the Pallas kernels in interpret mode."""
    name = "dense_layers_interpret"
    base = get_kernels("reference")

    def anchor(q, k, v, kv_len, *, cfg, k_max, dense, head_map_row):
        return dec.anchor_decode(q, k, v, kv_len, topk_frac=cfg.decode_frac, min_k=cfg.min_k, k_max=k_max,
                                 head_map_row=head_map_row, dense_out=dense, pool=cfg.pool, sinks=cfg.sink_tokens,
                                 window=cfg.recent_window, impl="pallas", interpret=True)

    def paged_anchor(q, k, v, pt, kv_len, *, cfg, k_max, dense, head_map_row):
        return pg.anchor_decode(q, k, v, pt, kv_len, topk_frac=cfg.decode_frac, min_k=cfg.min_k, k_max=k_max,
                                head_map_row=head_map_row, dense_out=dense, pool=cfg.pool, sinks=cfg.sink_tokens,
                                window=cfg.recent_window, impl="pallas", interpret=True)

    register_kernels(name, Kernels(anchor, functools.partial(dec.reuse_decode, impl="pallas", interpret=True),
                                   base.anchor_prefill, base.reuse_prefill, base.query_block,
                                   paged_anchor_decode=paged_anchor,
                                   paged_reuse_decode=functools.partial(pg.reuse_decode, interpret=True)))
    return name


def _inputs(rng, d=16, num_layers=NUM_LAYERS, max_len=MAX_LEN):
    layers = [random_layer(rng, 2, max_len, KVH * GROUP, KVH, d) for _ in range(num_layers)]
    return [decode_inputs(lay, [max_len, max_len * 3 // 4 - 3]) for lay in layers]


def _paged(inputs, rng, page_size=16):
    """The same inputs on a paged cache: each sequence's pages at shuffled places of one pool, spare pages garbage."""
    b, n_pages = inputs.k_cache.shape[0], inputs.k_cache.shape[1] // page_size
    perm = rng.permutation(b * n_pages + 3)
    table = perm[:b * n_pages].reshape(b, n_pages)

    def pool(cache):
        out = np.asarray(rng.normal(size=(len(perm), page_size) + cache.shape[2:]), np.float32)
        out[table.ravel()] = np.asarray(cache, np.float32).reshape(b * n_pages, page_size, *cache.shape[2:])
        return jnp.asarray(out, cache.dtype)

    return dataclasses.replace(inputs, k_cache=pool(inputs.k_cache), v_cache=pool(inputs.v_cache),
                               page_table=jnp.asarray(table, jnp.int32))


# ---- config ------------------------------------------------------------------------------------------------------

def test_config_normalises_negatives_and_round_trips():
    cfg = KascadeConfig(num_layers=6, kv_heads=2, anchors=(0, 2), decode_rerank=2, decode_dense_layers=[1, -2, -1])
    assert cfg.decode_dense_layers == (1, 4, 5) and KascadeConfig.from_json(cfg.to_json()) == cfg
    assert cfg.to_dict()["decode_dense_layers"] == [1, 4, 5]
    assert [cfg.decode_dense(x) for x in range(6)] == [True, True, False, False, True, True]  # 0: layer0_dense
    assert [cfg.reranks(x) for x in range(6)] == [False, False, False, True, False, False]  # a dense layer does not
    assert KascadeConfig(num_layers=6, kv_heads=2, decode_dense_layers=()).decode_dense_layers is None
    assert KascadeConfig(num_layers=6, kv_heads=2, decode_dense_layers=(np.int64(-3),)).decode_dense_layers == (3,)


@pytest.mark.parametrize("given,match", [
    ((True,), r"decode_dense_layers must hold ints \(not bools\), got \[True\]"),
    ((2, 1.0), r"decode_dense_layers must hold ints \(not bools\), got \[2, 1.0\]"),
    ("3", r"decode_dense_layers must be a sequence of layer numbers such as \(-3, -2, -1\), got '3'"),
    (3, r"decode_dense_layers must be a sequence of layer numbers such as \(-3, -2, -1\), got 3"),
    ((0,), r"decode_dense_layers must lie in \[1, 5\] or \[-6, -1\] from the end, not layer 0 .*got \[0\] in \[0\]"),
    ((-6,), r"decode_dense_layers must lie in \[1, 5\] .*got \[-6\] in \[-6\]"),
    ((2, 6), r"decode_dense_layers must lie in \[1, 5\] .*got \[6\] in \[2, 6\]"),
    ((-7, 1), r"decode_dense_layers must lie in \[1, 5\] .*got \[-7\] in \[-7, 1\]"),
    ((3, 3), r"decode_dense_layers must be strictly increasing .*got \[3, 3\] = layers \[3, 3\]"),
    ((5, -1), r"decode_dense_layers must be strictly increasing .*got \[5, -1\] = layers \[5, 5\]"),
    ((-1, 1), r"decode_dense_layers must be strictly increasing .*got \[-1, 1\] = layers \[5, 1\]"),
])
def test_config_rejects(given, match):
    with pytest.raises(ValueError, match=match) as e:
        KascadeConfig(num_layers=6, kv_heads=2, decode_dense_layers=given)
    assert "\n" not in str(e.value)


# ---- decode ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernels", ["reference", "pallas"])
def test_listed_layers_decode_dense_and_keep_the_selection(rng, kernels):
    """Reuse layer 4 and anchor 2 listed: both equal dense attention on their q / k / v (and differ from the plain
    sparse output); anchor 2 hands on the plain selection, layer 4 its anchor's state; layers 1 and 3 unchanged."""
    inputs = _inputs(rng)
    plain, plain_states = run_layers(make_strategy("kascade", NUM_LAYERS, KVH, kernels=kernels, **KW), inputs)
    got, states = run_layers(make_strategy("kascade", NUM_LAYERS, KVH, kernels=kernels, decode_dense_layers=LISTED,
                                           **KW), inputs)
    for layer in (2, 4):
        np.testing.assert_allclose(np.asarray(got[layer]), np.asarray(dense_reference(inputs[layer])),
                                   rtol=1e-5, atol=1e-5)
        assert not np.allclose(np.asarray(got[layer]), np.asarray(plain[layer]), atol=1e-3)
    for layer in (0, 1, 3):
        np.testing.assert_allclose(np.asarray(got[layer]), np.asarray(plain[layer]), rtol=1e-6, atol=1e-6)
    for layer in range(NUM_LAYERS):
        for key in ("idx", "counts"):
            np.testing.assert_array_equal(np.asarray(states[layer][key]), np.asarray(plain_states[layer][key]))


def test_listed_layers_take_no_tail_and_no_rerank(rng):
    inputs = _inputs(rng)
    for lever in (dict(decode_tail_stride=5), dict(decode_rerank=4)):
        plain, _ = run_layers(make_strategy("kascade", NUM_LAYERS, KVH, **lever, **KW), inputs)
        got, _ = run_layers(make_strategy("kascade", NUM_LAYERS, KVH, decode_dense_layers=LISTED, **lever, **KW),
                            inputs)
        for layer in (2, 4):
            np.testing.assert_allclose(np.asarray(got[layer]), np.asarray(dense_reference(inputs[layer])),
                                       rtol=1e-5, atol=1e-5, err_msg=str(lever))
        np.testing.assert_allclose(np.asarray(got[3]), np.asarray(plain[3]), rtol=1e-5, atol=1e-5)


def test_oracle_topk_listed_layers_output_dense(rng):
    inputs = _inputs(rng)
    kw = dict(KW, anchors=None)
    plain, plain_states = run_layers(make_strategy("oracle_topk", NUM_LAYERS, KVH, **kw), inputs)
    got, states = run_layers(make_strategy("oracle_topk", NUM_LAYERS, KVH, decode_dense_layers=(-1,), **kw), inputs)
    np.testing.assert_allclose(np.asarray(got[4]), np.asarray(dense_reference(inputs[4])), rtol=1e-5, atol=1e-5)
    assert states[4] is None and plain_states[4] is not None  # the last layer's indices are read by no layer
    np.testing.assert_array_equal(np.asarray(states[3]["idx"]), np.asarray(plain_states[3]["idx"]))
    np.testing.assert_allclose(np.asarray(got[3]), np.asarray(plain[3]), rtol=1e-6, atol=1e-6)


def test_paged_equals_contiguous(rng):
    """The reference bundle on a paged cache against the contiguous one: every layer, the selections the same."""
    inputs = _inputs(rng)
    st = make_strategy("kascade", NUM_LAYERS, KVH, decode_dense_layers=LISTED, **KW)
    want, want_states = run_layers(st, inputs)
    got, states = run_layers(st, [_paged(x, rng) for x in inputs])
    for layer in range(NUM_LAYERS):
        np.testing.assert_allclose(np.asarray(got[layer]), np.asarray(want[layer]), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(states[layer]["idx"]), np.asarray(want_states[layer]["idx"]))


def test_pallas_interpret_contiguous_and_paged(rng):
    """The Pallas decode kernels in interpret mode (bf16, head_dim 64), contiguous and paged, on three layers
    (anchors 0 and 1, reuse layer 2; 1 and 2 listed): the listed layers are dense attention, not the plain sparse
    output, and the paged run equals the contiguous one, anchor 1's selection included."""
    n, kw = 3, dict(KW, anchors=(0, 1))
    inputs = [dataclasses.replace(x, q=x.q.astype(jnp.bfloat16), k_cache=x.k_cache.astype(jnp.bfloat16),
                                  v_cache=x.v_cache.astype(jnp.bfloat16)) for x in _inputs(rng, 64, n, 64)]
    listed = make_strategy("kascade", n, KVH, decode_dense_layers=(1, -1), kernels=_interpret_bundle(), **kw)
    got, states = run_layers(listed, inputs)
    got_paged, states_paged = run_layers(listed, [_paged(x, rng) for x in inputs])
    plain, _ = run_layers(make_strategy("kascade", n, KVH, **kw), inputs)  # the reference bundle's sparse outputs
    for layer in (1, 2):
        dense = np.asarray(dense_reference(inputs[layer]), np.float32)
        np.testing.assert_allclose(np.asarray(got[layer], np.float32), dense, atol=2e-2)
        np.testing.assert_allclose(np.asarray(got_paged[layer], np.float32), np.asarray(got[layer], np.float32),
                                   atol=1e-2)
        assert np.abs(np.asarray(plain[layer], np.float32) - dense).max() > 0.1
    for key in ("idx", "counts"):
        np.testing.assert_array_equal(np.asarray(states_paged[1][key]), np.asarray(states[1][key]))


# ---- recipe, flag, config string, price -------------------------------------------------------------------------

def test_recipe_round_trip_and_describe():
    r = Recipe.from_dict({"num_anchors": 5, "decode_only": True, "decode_dense_layers": [-3, -2, -1]}, "x")
    assert r.decode_dense_layers == (-3, -2, -1) and r.levers()["decode_dense_layers"] == (-3, -2, -1)
    assert "decode_dense_layers=-3,-2,-1" in r.describe().split()
    cfg = make_strategy("kascade", 24, 2, anchors=(0, 1, 3, 5, 9), **r.levers()).config
    assert cfg.decode_dense_layers == (21, 22, 23)
    for name, layers in (("dps_all_dl3", (-3, -2, -1)), ("dps_all_dl1", (-1,))):
        c = candidate(name)
        assert c.decode_dense_layers == layers and c.pool == "all" and c.decode_only
        assert {k: v for k, v in c.levers().items() if k != "decode_dense_layers"} == candidate("dps_all").levers()
    off = Recipe(name="y", decode_dense_layers=[])
    assert off.levers()["decode_dense_layers"] == () and "decode_dense_layers" not in off.describe()
    assert make_strategy("kascade", 24, 2, **off.levers()).config.decode_dense_layers is None


@pytest.mark.parametrize("given,match", [
    ([True], r"recipe 'x': decode_dense_layers must be a list of layer numbers such as \[-3, -2, -1\], got \[True\]"),
    ([1.5], r"recipe 'x': decode_dense_layers must be a list of layer numbers .*got \[1.5\]"),
    ("-1", r"recipe 'x': decode_dense_layers must be a list of layer numbers .*got '-1'"),
    ([0, -1], r"recipe 'x': decode_dense_layers must not hold layer 0 \(layer0_dense governs it\), got \[0, -1\]"),
])
def test_recipe_rejects(given, match):
    with pytest.raises(ValueError, match=match) as e:
        Recipe(name="x", decode_dense_layers=given)
    assert "\n" not in str(e.value)


def test_flag_overrides_the_recipe():
    r = flag_recipe("--recipe=candidate:dps_all", "--decode_dense_layers=-2,-1")
    assert r.name == "dps_all*" and r.decode_dense_layers == (-2, -1) and r.levers()["decode_dense_layers"] == (-2, -1)
    r = flag_recipe("--recipe=candidate:dps_all_dl3", "--decode_dense_layers=")  # '': off
    assert r.name == "dps_all_dl3*" and r.decode_dense_layers == () and "decode_dense" not in r.describe()
    assert flag_recipe("--recipe=candidate:dps_all_dl3").decode_dense_layers == (-3, -2, -1)
    with pytest.raises(ValueError, match=r"--decode_dense_layers takes comma-separated ints such as -3,-2,-1, got "
                                         r"'-1,x'"):
        flag_recipe("--recipe=candidate:dps_all", "--decode_dense_layers=-1,x")


def test_config_string_parse():
    r = candidate("dps_all_dl3")
    fields = accuracy.config_fields("k=0.1 anchors=0,1,3,5,9 head_map=calibrated " + r.describe())
    assert fields["decode_dense_layers"] == (-3, -2, -1) and fields["pool"] == "all" and fields["num_anchors"] == 5
    assert "decode_dense_layers" not in accuracy.config_fields(candidate("dps_all").describe())
    assert accuracy.config_fields("decode_dense_layers=7")["decode_dense_layers"] == (7,)


RATIOS = {"decode": {0.1: dict(a0=1.2, anchor=0.8, reuse=0.1)}, "prefill": {0.1: dict(a0=2.0, anchor=1.5, reuse=0.2)}}


def test_price_of_dense_layers():
    """8 layers, anchors 0 and 4, layers 4 and 7 listed. Plain decode (1.2 + 0.8 + 6 x 0.1) / 8 = 0.325; listed:
    anchor 4 as a0 and layer 7 dense, (1.2 + 1.2 + 5 x 0.1 + 1.0) / 8 = 0.4875; prefill (2 + 1.5 + 6 x 0.2) / 8."""
    cost = functools.partial(accuracy.attention_cost, 8, 2, context=4096, ratios=RATIOS)
    assert cost() == dict(decode_cost=0.325, decode_speedup=round(1 / 0.325, 3), prefill_cost=0.5875,
                          prefill_speedup=round(1 / 0.5875, 3))
    got = cost(decode_dense_layers=(4, -1), anchors=(0, 4))
    assert (got["decode_cost"], got["prefill_cost"]) == (0.4875, 0.5875)
    assert cost(decode_dense_layers=(4, -1))["decode_cost"] == 0.55  # anchors unknown: both as reuse, (2.0 + 0.4 + 2)/8
    assert cost(decode_dense_layers=(4, -1), oracle=True)["decode_cost"] == 0.95  # (3 x 1.2 + 5 x 0.8) / 8
    # the tail: 7 sparse layers x 0.1 / 0.1 / 10 / 8 plain, the 5 sparse ones left with layers 4 and 7 dense
    assert cost(decode_tail_stride=10)["decode_cost"] == 0.4125
    assert cost(decode_tail_stride=10, decode_dense_layers=(4, -1), anchors=(0, 4))["decode_cost"] == 0.55
    # the shared pool's measured ratios: a0 x 1.5 (twice), 5 reuse x 0.1 x 2, one dense: (3.6 + 1.0 + 1.0) / 8
    pools = dict(RATIOS, pool={"gqa": dict(a0=1.0, anchor=1.0, reuse=1.0), "all": dict(a0=1.5, anchor=1.25, reuse=2.0)})
    got = accuracy.attention_cost(8, 2, context=4096, pool="all", decode_dense_layers=(4, -1), anchors=(0, 4),
                                  ratios=pools)
    assert got["decode_cost"] == 0.7
    fields = dict(num_anchors=2, decode_dense_layers=(4, -1))
    assert accuracy.recipe_cost(fields, num_layers=8, context=4096, ratios=RATIOS)["decode_cost"] == 0.55
    cell = accuracy._cell_anchors(fields, {"anchors": "0,4"})
    assert accuracy.recipe_cost(cell, num_layers=8, context=4096, ratios=RATIOS)["decode_cost"] == 0.4875
    with pytest.raises(ValueError, match=r"decode_dense_layers \[8\] do not fit 8 layers \(layer 0 is not one\)"):
        cost(decode_dense_layers=(8,))
