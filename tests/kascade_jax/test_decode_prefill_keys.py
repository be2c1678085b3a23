"""The decode_prefill_keys lever (KascadeConfig.decode_prefill_keys): at the end of the dense prefill each reuse layer
keeps its own Top-s of the prompt's last tile's pooled attention in the KV cache (KVCache.strategy_state), and in
decode attends the union of its anchor's indices and that set. Checked against a numpy brute force of the definition
on a tiny random model (ragged, chunked), the union against the references and the Pallas reuse kernel (interpret
mode), persistence across decode steps, the refusals, and the recipe / flag / config-string / price plumbing."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import CharTokenizer
from kascade_jax.config import KascadeConfig
from kascade_jax.eval import accuracy
from kascade_jax.recipes import Recipe, candidate
from kascade_jax.strategies import KascadeStrategy, prefill_keys_budget, union_indices
from kernels_pallas import decode as dec
from kernels_pallas.dense import dense_attention
from kernels_pallas.reference import select_topk_reference, sparse_decode_reference
from kj_helpers import peaky_tiny_model, ragged_tokens, decode_inputs, flag_recipe, random_layer
from models import generate as G
from models.attention import DenseStrategy
from models.cache import KVCache

LENS = np.array([300, 150], np.int32)  # ragged; 150's last tile [118, 150) straddles the 128-token chunks
KW = dict(num_layers=3, kv_heads=2, anchors=(0,), min_k=16, decode_only=True)


def _cfg(**over):
    return KascadeConfig(**{**KW, "decode_prefill_keys": 0.1, **over})


def _model():
    return peaky_tiny_model()


def _tokens(rng, lens=LENS, width=320):
    return ragged_tokens(rng, lens, width)


def _prefill(strategy, toks, lens=LENS, chunk_size=None, max_len=512):
    m = _model()
    cache = KVCache.init(m.config, len(lens), max_len, jnp.float32)
    return G.prefill(m, toks, lens, cache, strategy, chunk_size=chunk_size)


class _Capture:
    """Dense attention that records every layer's q and K cache (run eagerly)."""

    name = "capture"

    def __init__(self):
        self.q, self.k = {}, {}

    def attend(self, layer, inputs, state):
        self.q[layer], self.k[layer] = np.asarray(inputs.q, np.float64), np.asarray(inputs.k_cache, np.float64)
        return dense_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.q_start, inputs.kv_len,
                               phase="prefill", chunk_at_zero=True), state


def _brute_scores(toks, lens, pool):
    """numpy float64: per layer [batch, idx_heads, keys] pooled probabilities of each prompt's last 32 queries."""
    m, cap = _model(), _Capture()
    b, w = toks.shape
    cache = KVCache.init(m.config, b, 512, jnp.float32)
    plens = jnp.asarray(lens)
    m(jnp.asarray(toks), cache, cap, G._meta("prefill", 0, jnp.zeros((b,), jnp.int32), plens, plens, plens, True))
    out = {}
    for layer, q in cap.q.items():
        k = cap.k[layer]
        hq, kvh, d = q.shape[2], k.shape[2], q.shape[3]
        sc = np.zeros((b, kvh, k.shape[1]))
        for i in range(b):
            for p in range(max(0, lens[i] - 32), lens[i]):
                for h in range(hq):
                    logits = k[i, :p + 1, h // (hq // kvh)] @ q[i, p, h] / np.sqrt(d)
                    e = np.exp(logits - logits.max())
                    sc[i, h // (hq // kvh), :p + 1] += e / e.sum()
        out[layer] = sc.sum(1, keepdims=True) if pool == "all" else sc
    return out


def _sets(idx):
    return [[set(int(x) for x in row if x >= 0) for row in seq] for seq in np.asarray(idx)]


# ---- config ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("over, match", [
    (dict(decode_prefill_keys="0.1"), r"decode_prefill_keys must be 0 \(off\) or a number in \(0, 1\], got '0.1'"),
    (dict(decode_prefill_keys=True), r"must be 0 \(off\) or a number in \(0, 1\], got True"),
    (dict(decode_prefill_keys=1.5), r"must be 0 \(off\) or in \(0, 1\] and a multiple of 1e-4, got 1.5"),
    (dict(decode_prefill_keys=-0.1), r"in \(0, 1\] and a multiple of 1e-4, got -0.1"),
    (dict(decode_prefill_keys=0.00005), r"multiple of 1e-4, got 5e-05"),
    (dict(decode_prefill_keys=0.05, decode_only=False), r"needs decode_only=True"),
    (dict(decode_prefill_keys=0.05, pool="pre_softmax"), r"use pool 'gqa' or 'all', not 'pre_softmax'"),
    (dict(decode_prefill_keys=0.05, oracle_topk=True), r"oracle_topk has none"),
    (dict(decode_prefill_keys=0.05, decode_tail_stride=20), r"decode_prefill_keys and decode_tail_stride"),
    (dict(decode_prefill_keys=0.05, decode_rerank=2), r"decode_prefill_keys and decode_rerank > 1"),
])
def test_config_refuses(over, match):
    with pytest.raises(ValueError, match=match) as e:
        KascadeConfig(**dict(KW, **over))
    assert "\n" not in str(e.value)


def test_config_defaults_and_round_trip():
    assert KascadeConfig(num_layers=2, kv_heads=1).decode_prefill_keys == 0.0
    assert KascadeConfig(num_layers=2, kv_heads=1, decode_prefill_keys=None).decode_prefill_keys == 0.0
    cfg = _cfg(decode_prefill_keys=0.05)
    assert KascadeConfig.from_json(cfg.to_json()) == cfg
    st = KascadeStrategy(cfg)
    assert st.cache_state_lever == "decode_prefill_keys" and not st.prefill_is_dense
    off = KascadeStrategy(KascadeConfig(**KW))
    assert off.cache_state_lever is None and off.prefill_is_dense and off.init_cache_state(3, 2, 64) is None


def test_budget_in_exact_integers():
    cfg = _cfg(decode_prefill_keys=0.05)
    assert [prefill_keys_budget(cfg, n) for n in (10, 100, 640, 660, 16384)] == [10, 32, 32, 33, 819]
    assert np.asarray(prefill_keys_budget(cfg, jnp.asarray([10, 660, 16384]))).tolist() == [10, 33, 819]


# ---- the prefill set ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pool", ["gqa", "all"])
def test_prefill_set_is_the_brute_force_top_s(rng, pool):
    toks = _tokens(rng)
    _, one = _prefill(KascadeStrategy(_cfg(pool=pool)), toks)
    _, chunked = _prefill(KascadeStrategy(_cfg(pool=pool)), toks, chunk_size=128)
    brute = _brute_scores(toks, LENS, pool)
    assert one.strategy_state[0] is None  # the anchor keeps its own selection only
    for layer in (1, 2):
        idx = np.asarray(one.strategy_state[layer]["idx"])
        assert idx.shape == (2, 1 if pool == "all" else 2, 51)  # s_max = floor(0.1 * 512)
        np.testing.assert_array_equal(idx, np.asarray(chunked.strategy_state[layer]["idx"]))
        for b, n in enumerate(LENS):
            want = prefill_keys_budget(_cfg(), int(n))
            for h in range(idx.shape[1]):
                got = idx[b, h][idx[b, h] >= 0]
                assert len(got) == len(set(got.tolist())) == want and got.max() < n
                top = np.argsort(-brute[layer][b, h, :n], kind="stable")[:want]
                assert set(got.tolist()) == set(top.tolist()), (layer, b, h)


def test_prefill_set_comes_from_the_last_tile_only(rng):
    """A sequence whose end lies in an earlier chunk keeps its set through the later chunks."""
    toks = _tokens(rng)
    lens = np.array([300, 60], np.int32)
    _, chunked = _prefill(KascadeStrategy(_cfg()), toks, lens=lens, chunk_size=64)
    _, one = _prefill(KascadeStrategy(_cfg()), toks, lens=lens)
    for layer in (1, 2):
        assert _sets(chunked.strategy_state[layer]["idx"]) == _sets(one.strategy_state[layer]["idx"])
        assert all(0 <= x < 60 for s in _sets(chunked.strategy_state[layer]["idx"])[1] for x in s)


# ---- the union ---------------------------------------------------------------------------------------------------

def test_union_has_each_key_once(rng):
    n = 64
    a = np.full((3, 2, 12), -1, np.int32)
    b = np.full((3, 2, 8), -1, np.int32)
    for i in range(3):
        for h in range(2):
            a[i, h, :10 - 3 * i] = rng.choice(n, 10 - 3 * i, replace=False)
            pool = np.concatenate([a[i, h, :3], rng.choice(np.setdiff1d(np.arange(n), a[i, h]), 5, replace=False)])
            b[i, h, :6] = rng.permutation(pool)[:6]  # overlaps a
    idx, counts = union_indices(jnp.asarray(a), jnp.asarray(b), n)
    idx = np.asarray(idx)
    for i in range(3):
        sizes = []
        for h in range(2):
            row = idx[i, h]
            valid = row[row >= 0]
            assert len(valid) == len(set(valid.tolist()))  # no duplicates
            assert set(valid.tolist()) == {x for x in np.concatenate([a[i, h], b[i, h]]) if x >= 0}
            assert (row[:len(valid)] >= 0).all() and (row[len(valid):] == -1).all()  # valid first
            sizes.append(len(valid))
        assert int(counts[i]) == max(sizes)


@pytest.mark.parametrize("pool", ["gqa", "all"])
def test_reuse_decode_is_the_reference_over_the_union(rng, pool):
    """A reuse layer's decode equals sparse_decode_reference over anchor set (through the head map) + own set, also
    through the Pallas reuse kernel (interpret mode), which weights a duplicate twice: the union must have none."""
    head_map = None if pool == "all" else ((0, 1), (1, 0), (0, 1))
    cfg = _cfg(pool=pool, head_map=head_map)
    q, k, v = random_layer(rng, 2, 96, 4, 2, 64, peaky=0.5)  # head_dim 64: the Pallas kernel's
    inputs = decode_inputs((q, k, v), [96, 70])
    kv_len = inputs.kv_len
    ih = cfg.idx_heads
    anchor = select_topk_reference(jnp.asarray(rng.normal(size=(2, ih, 96)), jnp.float32), jnp.full((2, 1), 16), 20)
    anchor = jnp.where(anchor < kv_len[:, None, None], anchor, -1)
    own = np.full((2, ih, 12), -1, np.int32)
    for b in range(2):
        for h in range(ih):  # half of them already in the anchor's set of the head this KV head reads
            shared = np.asarray(anchor[b, cfg.head_map_row(1)[h] if pool != "all" else 0])[:5]
            own[b, h, :10] = np.concatenate([shared, rng.choice(np.setdiff1d(np.arange(60), shared), 5, False)])
    state = {"idx": anchor, "counts": jnp.full((2,), 16, jnp.int32)}
    entry = {"idx": jnp.asarray(own), "scores": jnp.zeros((2, ih, 96), jnp.float32)}
    inputs = dataclasses.replace(inputs, cache_state=entry)
    out, _ = KascadeStrategy(cfg).attend(1, inputs, state)
    row = cfg.head_map_row(1)
    mapped = anchor if pool == "all" else jnp.take(anchor, jnp.asarray(row), axis=1)
    want = sparse_decode_reference(q=inputs.q, k=k, v=v, kv_len=kv_len, idx=jnp.concatenate([mapped, own], -1),
                                   head_map_row=row if pool == "all" else (0, 1))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
    bf = dataclasses.replace(inputs, q=inputs.q.astype(jnp.bfloat16), k_cache=k.astype(jnp.bfloat16),
                             v_cache=v.astype(jnp.bfloat16))  # the Pallas kernel takes bf16 / fp16
    out_p, _ = KascadeStrategy(cfg, kernels=_interpret_bundle()).attend(1, bf, state)
    want_bf = sparse_decode_reference(bf.q, bf.k_cache, bf.v_cache, kv_len, jnp.concatenate([mapped, own], -1),
                                      row if pool == "all" else (0, 1))
    np.testing.assert_allclose(np.asarray(out_p, np.float32), np.asarray(want_bf, np.float32), atol=2e-2)


def _interpret_bundle() -> str:
    from kascade_jax.strategies import Kernels, get_kernels, register_kernels

    base = get_kernels("reference")
    register_kernels("prefill_keys_interpret", Kernels(
        base.anchor_decode, functools.partial(dec.reuse_decode, impl="pallas", interpret=True), base.anchor_prefill,
        base.reuse_prefill, base.query_block))
    return "prefill_keys_interpret"


def test_reuse_decode_without_cache_state_is_refused(rng):
    q, k, v = random_layer(rng, 1, 64, 4, 2, 16)
    state = {"idx": jnp.zeros((1, 2, 16), jnp.int32) + jnp.arange(16), "counts": jnp.full((1,), 16, jnp.int32)}
    with pytest.raises(ValueError, match=r"reuse layer 1 got no cache state; prefill with"):
        KascadeStrategy(_cfg()).attend(1, decode_inputs((q, k, v), [64]), state)


# ---- the state across decode steps -------------------------------------------------------------------------------

def test_state_persists_across_decode_steps(rng):
    """The prefill's sets are in the cache after every decode step, and they change the decode (blanking them
    changes the logits): a loop that dropped or reset the state would fail here."""
    m, st = _model(), KascadeStrategy(_cfg(decode_prefill_keys=0.3))
    toks = _tokens(rng)
    logits, cache = _prefill(st, toks)
    after = [np.asarray(e["idx"]) if e is not None else None for e in cache.strategy_state]
    tok, steps = jnp.argmax(logits, -1), []
    for _ in range(3):
        logits, cache = G.decode_step(m, tok, cache, st)
        tok = jnp.argmax(logits, -1)
        steps.append(tok)
        for e, want in zip(cache.strategy_state, after):
            if want is not None:
                np.testing.assert_array_equal(np.asarray(e["idx"]), want)
    blank = [None if e is None else dict(e, idx=jnp.full_like(e["idx"], -1)) for e in cache.strategy_state]
    with_sets, _ = G.decode_step(m, tok, jax.tree.map(jnp.copy, cache), st)
    without, _ = G.decode_step(m, tok, KVCache(cache.k, cache.v, cache.lengths, tuple(blank)), st)
    assert not np.allclose(np.asarray(with_sets), np.asarray(without))
    # generate's compiled loop carries it the same way (its first tokens equal this loop's)
    prompts = [list(toks[b, :n]) for b, n in enumerate(LENS)]
    res = G.generate(m, CharTokenizer(), prompts, st, max_new_tokens=4, max_len=512, bucket=320)
    assert [r.token_ids[1:4] for r in res] == np.stack([np.asarray(s) for s in steps], 1).tolist()


def test_strategies_without_cache_state_are_unchanged(rng):
    """No lever: the cache has no strategy state before or after, its pytree is the three-field one, and the
    logits equal those of a cache built without the field."""
    m = _model()
    toks = _tokens(rng)
    for st in (DenseStrategy(), KascadeStrategy(KascadeConfig(**KW)), KascadeStrategy(KascadeConfig(**dict(
            KW, decode_only=False)))):
        logits, cache = _prefill(st, toks)
        assert cache.strategy_state is None and len(jax.tree.leaves(cache)) == 2 * m.config.num_layers + 1
        lg, cache2 = G.decode_step(m, jnp.argmax(logits, -1), cache, st)
        assert cache2.strategy_state is None
        old = KVCache(k=cache2.k, v=cache2.v, lengths=cache2.lengths)
        a, _ = G.decode_step(m, jnp.argmax(lg, -1), jax.tree.map(jnp.copy, cache2), st)
        b, _ = G.decode_step(m, jnp.argmax(lg, -1), old, st)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- refusals ----------------------------------------------------------------------------------------------------

def test_paged_engine_and_mesh_are_refused(rng):
    from models.engine import Engine
    from models.paged import PagedKVCache

    m, st = _model(), KascadeStrategy(_cfg())
    toks = _tokens(rng)
    paged = PagedKVCache.init(m.config, 2, 40, 16, 320, jnp.float32)
    paged = paged.with_table(jnp.arange(40, dtype=jnp.int32).reshape(2, 20), jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match=r"^decode_prefill_keys is not implemented for paged caches yet; use"):
        G.prefill(m, toks, LENS, paged, st)
    with pytest.raises(ValueError, match=r"^decode_prefill_keys is not implemented for paged caches yet"):
        G.decode_step(m, jnp.zeros((2,), jnp.int32), paged, st)
    with pytest.raises(ValueError, match=r"^decode_prefill_keys is not implemented for the engine yet"):
        Engine(m, CharTokenizer(), st, max_batch=2, page_size=16, max_len=256)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    m.mesh = mesh
    try:
        with pytest.raises(ValueError, match=r"^decode_prefill_keys is not implemented for a mesh yet"):
            G.prefill(m, toks, LENS, KVCache.init(m.config, 2, 512, jnp.float32), st)
    finally:
        m.mesh = None


# ---- recipe, flag, config string, price -------------------------------------------------------------------------

def test_recipe_candidates_and_describe():
    from kascade_jax.registry import make_strategy

    for name, s in (("dps_all_pk5", 0.05), ("dps_all_pk10", 0.1)):
        c = candidate(name)
        assert c.decode_prefill_keys == s and f"decode_prefill_keys={s:g}" in c.describe().split()
        assert {k: v for k, v in c.levers().items() if k != "decode_prefill_keys"} == candidate("dps_all").levers()
        cfg = make_strategy("kascade", 24, 2, anchors=(0, 1, 3, 5, 9), **c.levers()).config
        assert cfg.decode_prefill_keys == s and cfg.decode_only and cfg.pool == "all"
    assert "decode_prefill_keys" not in candidate("dps_all").describe()
    r = Recipe.from_dict({"num_anchors": 5, "decode_only": True, "decode_prefill_keys": 0.05}, "x")
    assert r.levers()["decode_prefill_keys"] == 0.05


@pytest.mark.parametrize("over, match", [
    (dict(decode_prefill_keys=True), r"recipe 'x': decode_prefill_keys must be null, 0 \(off\) or in \(0, 1\], got True"),
    (dict(decode_prefill_keys=2), r"recipe 'x': decode_prefill_keys must be null, 0 \(off\) or in \(0, 1\], got 2"),
    (dict(decode_prefill_keys=0.05, decode_tail_stride=20), r"recipe 'x': decode_prefill_keys is not combined with"),
    (dict(decode_prefill_keys=0.05, decode_rerank=2), r"recipe 'x': decode_prefill_keys is not combined with"),
])
def test_recipe_rejects(over, match):
    with pytest.raises(ValueError, match=match) as e:
        Recipe(name="x", **over)
    assert "\n" not in str(e.value)


def test_flag_overrides_the_recipe():
    r = flag_recipe("--recipe=candidate:dps_all", "--decode_prefill_keys=0.1")
    assert r.name == "dps_all*" and r.decode_prefill_keys == 0.1 and r.levers()["decode_prefill_keys"] == 0.1
    r = flag_recipe("--recipe=candidate:dps_all_pk5", "--decode_prefill_keys=0")  # 0: off
    assert r.name == "dps_all_pk5*" and "decode_prefill_keys" not in r.describe()
    assert flag_recipe("--recipe=candidate:dps_all_pk5").decode_prefill_keys == 0.05


def test_config_string_parse():
    fields = accuracy.config_fields("k=0.1 anchors=0,1,3,5,9 " + candidate("dps_all_pk5").describe())
    assert fields["decode_prefill_keys"] == 0.05 and fields["pool"] == "all" and fields["decode_only"]
    assert "decode_prefill_keys" not in accuracy.config_fields(candidate("dps_all").describe())
    assert accuracy.config_fields("decode_prefill_keys=1")["decode_prefill_keys"] == 1


RATIOS = {"decode": {0.1: dict(a0=1.2, anchor=0.8, reuse=0.1)}, "prefill": {0.1: dict(a0=2.0, anchor=1.5, reuse=0.2)}}


def test_price():
    """8 layers, 2 anchors: plain decode (1.2 + 0.8 + 6 x 0.1) / 8 = 0.325; each reuse layer reads k + s keys, so
    s = 0.05 over k = 0.1 prices it 1.5x: (1.2 + 0.8 + 6 x 0.15) / 8 = 0.3625; prefill unchanged."""
    cost = functools.partial(accuracy.attention_cost, 8, 2, context=4096, ratios=RATIOS)
    plain, pk = cost(), cost(decode_prefill_keys=0.05)
    assert plain["decode_cost"] == 0.325 and pk["decode_cost"] == 0.3625 and pk["prefill_cost"] == plain["prefill_cost"]
    assert cost(decode_topk_frac=0.2, decode_prefill_keys=0.05)["decode_cost"] == 0.4375  # (2 + 6 x 0.2 x 1.25) / 8
    fields = dict(num_anchors=2, decode_prefill_keys=0.05)
    assert accuracy.recipe_cost(fields, num_layers=8, context=4096, ratios=RATIOS)["decode_cost"] == 0.3625
