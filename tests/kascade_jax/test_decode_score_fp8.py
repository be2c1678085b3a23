"""The decode_score_fp8 lever (KascadeConfig.decode_score_fp8): the decode anchors with a sparse output score keys
from an fp8 copy of their K cache kept in the KV cache (KVCache.strategy_state). Checked on a tiny random model
(ragged, chunked prefill): the copy equals `reference.fp8_decode_keys` of the prompt's cache, each decode token is
coded with the prompt's mean and scale, the copy drives the selection (blanking it changes the logits), both kernel
bundles agree, and the refusals and recipe / flag / config-string plumbing."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import CharTokenizer
from kascade_jax.config import KascadeConfig
from kascade_jax.eval import accuracy
from kascade_jax.recipes import candidate
from kascade_jax.strategies import KascadeStrategy
from kernels_pallas import reference as ref
from kernels_pallas.paged import gather_pages
from kj_helpers import peaky_tiny_model, ragged_tokens, decode_inputs, flag_recipe, random_layer
from models import generate as G
from models.cache import KVCache

LENS = np.array([300, 150], np.int32)
KW = dict(num_layers=3, kv_heads=2, anchors=(0, 1), min_k=16, topk_frac=0.1)


def _cfg(**over):
    return KascadeConfig(**{**KW, "decode_score_fp8": True, **over})


def _model():
    return peaky_tiny_model()


def _tokens(rng, lens=LENS, width=320):
    return ragged_tokens(rng, lens, width)


def _prefill(strategy, toks, chunk_size=None):
    m = _model()
    cache = KVCache.init(m.config, len(LENS), 512, jnp.float32)
    return G.prefill(m, toks, LENS, cache, strategy, chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", [None, 128])
def test_copy_is_the_prompts_coding_and_tokens_follow_it(rng, chunk_size):
    """After prefill (whole or in chunks) an anchor's entry is fp8_decode_keys of its K cache over the prompt;
    layer 0 (dense decode) and the reuse layer keep none; each decode step codes its token with the prompt's mean
    and mult and leaves the rest of the copy as it was."""
    st = KascadeStrategy(_cfg(anchors=(0, 1)))
    logits, cache = _prefill(st, _tokens(rng), chunk_size)
    state = cache.strategy_state
    assert state[0] is None and state[2] is None and set(state[1]) == {"k8", "mean", "mult"}
    lens = jnp.asarray(LENS)
    k8, mean, mult = ref.fp8_decode_keys(cache.k[1], lens)
    np.testing.assert_array_equal(np.asarray(state[1]["k8"].astype(jnp.float32)), np.asarray(k8.astype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(state[1]["mean"]), np.asarray(mean), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(state[1]["mult"]), np.asarray(mult))
    before = np.asarray(state[1]["k8"].astype(jnp.float32))
    mult0 = np.asarray(state[1]["mult"])  # decode_step donates the cache
    tok = jnp.argmax(logits, -1)
    for step in range(2):
        logits, cache = G.decode_step(_model(), tok, cache, st)
        tok = jnp.argmax(logits, -1)
    e = cache.strategy_state[1]
    np.testing.assert_array_equal(np.asarray(e["mult"]), mult0)
    got = np.asarray(e["k8"].astype(jnp.float32))
    for b, n in enumerate(LENS):
        np.testing.assert_array_equal(got[b, :n], before[b, :n])
        new = ref.fp8_decode_token(cache.k[1][b:b + 1, n:n + 2], e["mean"][b:b + 1], e["mult"][b:b + 1])
        np.testing.assert_array_equal(got[b, n:n + 2], np.asarray(new.astype(jnp.float32))[0])
        assert np.any(got[b, n:n + 2] != 0)
        np.testing.assert_array_equal(got[b, n + 2:], 0)


def test_the_copy_drives_the_selection_and_both_bundles_agree(rng):
    """Blanking the copy changes the decode logits (the anchors read it); the "pallas" bundle (its references on
    a CPU) and the "reference" bundle give the same tokens through generate's compiled loop; the lever stays close to
    plain Kascade (fp8 selection of peaky attention)."""
    m, toks = _model(), _tokens(rng)
    st = KascadeStrategy(_cfg())
    logits, cache = _prefill(st, toks)
    tok = jnp.argmax(logits, -1)
    a, _ = G.decode_step(m, tok, jax.tree.map(jnp.copy, cache), st)
    blank = tuple(None if e is None else dict(e, k8=jnp.zeros_like(e["k8"])) for e in cache.strategy_state)
    b, _ = G.decode_step(m, tok, KVCache(cache.k, cache.v, cache.lengths, blank), st)
    assert not np.allclose(np.asarray(a), np.asarray(b))
    plain = KascadeStrategy(KascadeConfig(**KW))
    lp, cp = _prefill(plain, toks)
    c, _ = G.decode_step(m, jnp.argmax(lp, -1), cp, plain)
    assert np.abs(np.asarray(a) - np.asarray(c)).max() < 0.05 * np.abs(np.asarray(c)).max()
    prompts = [list(toks[i, :n]) for i, n in enumerate(LENS)]
    runs = [G.generate(m, CharTokenizer(), prompts, KascadeStrategy(_cfg(), kernels=k), max_new_tokens=4,
                       max_len=512, bucket=320) for k in ("reference", "pallas")]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]


def test_state_flags_and_refusals(rng):
    """The lever needs a cache state: prefill_is_dense is off (the eval runs its own prefill), the anchor refuses a
    decode without the copy; paged caches and the engine take it, and refuse decode_prefill_keys (no paged form)
    by name."""
    from models.engine import Engine
    from models.paged import PagedKVCache

    st = KascadeStrategy(_cfg(decode_only=True))
    assert st.cache_state_lever == "decode_score_fp8" and not st.prefill_is_dense
    assert KascadeStrategy(_cfg(decode_only=True, decode_score_fp8=False)).prefill_is_dense
    both = KascadeStrategy(_cfg(decode_only=True, decode_prefill_keys=0.1))
    assert both.cache_state_lever == "decode_prefill_keys and decode_score_fp8"
    with pytest.raises(ValueError, match="head_dim"):
        st.init_cache_state(3, 2, 64)
    qkv = random_layer(rng, 1, 64, 6, 2, 64)
    with pytest.raises(ValueError, match=r"decode_score_fp8: anchor layer 1 got no fp8 K copy"):
        st.attend(1, decode_inputs(qkv, [64]), {"idx": jnp.zeros((1, 1, 16), jnp.int32),
                                                "counts": jnp.full((1,), 16, jnp.int32)})
    m = _model()
    paged = PagedKVCache.init(m.config, 2, 40, 16, 320, jnp.float32)
    paged = paged.with_table(jnp.arange(40, dtype=jnp.int32).reshape(2, 20), jnp.zeros((2,), jnp.int32))
    assert st.paged_cache_state_lever is None and both.paged_cache_state_lever == "decode_prefill_keys"
    with pytest.raises(ValueError, match=r"^decode_prefill_keys is not implemented for paged caches yet"):
        G.prefill(m, _tokens(rng), LENS, paged, both)
    with pytest.raises(ValueError, match=r"^decode_prefill_keys is not implemented for the engine yet"):
        Engine(m, CharTokenizer(), both, max_batch=2, page_size=16, max_len=256)
    with pytest.raises(ValueError, match=r"^decode_prefill_keys is not implemented for paged caches yet"):
        both.init_cache_state(3, 2, 64, kv_heads=2, head_dim=64, pages=(8, 16))
    _, paged = G.prefill(m, _tokens(rng), LENS, paged, st)
    with pytest.raises(ValueError, match=r"keeps its batch of 2 .* use slot_view"):
        paged.with_table(paged.page_table[:1], paged.lengths[:1])


@pytest.mark.parametrize("ps,chunk_size", [(16, None), (64, 128)])
def test_paged_copy_equals_contiguous(rng, ps, chunk_size):
    """On a paged cache whose pages are scattered over the pool, the copy read through K's page table, its mean and
    mult, and each decode step's logits equal the contiguous cache's (whole and chunked prefill)."""
    from models.paged import PagedKVCache

    m, toks, st = _model(), _tokens(rng), KascadeStrategy(_cfg())
    mp, n = 512 // ps, 2 * (512 // ps) + 3
    perm = rng.permutation(n)
    table = np.stack([perm[:mp], perm[mp:2 * mp]]).astype(np.int32)
    pc = PagedKVCache.init(m.config, 2, n, ps, 512, jnp.float32).with_table(table, np.zeros(2, np.int32))
    lp, pc = G.prefill(m, toks, LENS, pc, st, chunk_size=chunk_size)
    lc, cc = _prefill(st, toks, chunk_size)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(lc), atol=1e-5)

    def check():
        p, c = pc.strategy_state[1], cc.strategy_state[1]
        assert p["k8"].shape == (n, ps, 2, c["k8"].shape[-1])
        np.testing.assert_array_equal(np.asarray(gather_pages(p["k8"], pc.page_table).astype(jnp.float32)),
                                      np.asarray(c["k8"].astype(jnp.float32)))
        np.testing.assert_allclose(np.asarray(p["mean"]), np.asarray(c["mean"]), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(p["mult"]), np.asarray(c["mult"]))
    check()
    for _ in range(3):
        tok = jnp.argmax(lc, -1).astype(jnp.int32)
        lp, pc = G.decode_step(m, tok, pc, st)
        lc, cc = G.decode_step(m, tok, cc, st)
        np.testing.assert_allclose(np.asarray(lp), np.asarray(lc), atol=1e-5)
    check()


def test_recipe_flag_and_config_string():
    for name in ("dps_all_dec20_fp8d", "dps_all_dec30_fp8d", "dps_all_fp8d"):
        c = candidate(name)
        base = candidate(name[:-5])
        assert c.decode_score_fp8 and "decode_score_fp8" in c.describe().split()
        assert {k: v for k, v in c.levers().items() if k != "decode_score_fp8"} == base.levers()
        fields = accuracy.config_fields("k=0.1 " + c.describe())
        assert fields["decode_score_fp8"] is True and fields["decode_only"]
    r = flag_recipe("--recipe=candidate:dps_all_dec20", "--decode_score_fp8")
    assert r.decode_score_fp8 and r.name == "dps_all_dec20*"
    with pytest.raises(ValueError, match="decode_score_fp8 must be a bool"):
        KascadeConfig(**{**KW, "decode_score_fp8": 1})


def test_price():
    """8 layers, 2 anchors: plain decode (1.2 + 0.8 + 6 x 0.1) / 8 = 0.325; the anchor past layer 0 at the measured
    A_fp8 / A = 0.6: (1.2 + 0.48 + 0.6) / 8 = 0.285; unmeasured: unknown (None), never the plain price; prefill and
    bench_ratios' parsing of the bench rows."""
    ratios = {"decode": {0.1: dict(a0=1.2, anchor=0.8, reuse=0.1)}, "prefill": {0.1: dict(a0=2.0, anchor=1.5,
                                                                                          reuse=0.2)}}
    cost = functools.partial(accuracy.attention_cost, 8, 2, context=4096)
    assert cost(ratios=ratios)["decode_cost"] == 0.325
    assert cost(ratios=ratios, decode_score_fp8=True)["decode_cost"] is None
    got = cost(ratios=dict(ratios, decode_score_fp8={0.1: 0.6}), decode_score_fp8=True)
    assert got["decode_cost"] == 0.285 and got["prefill_cost"] == cost(ratios=ratios)["prefill_cost"]


def test_bench_ratios_reads_the_fp8_rows(tmp_path):
    import json

    row = dict(context=4096, batch=32, topk_frac=0.1, dense=1.0, A0=1.2, A=0.8, R=0.1, A_fp8=0.5)
    (tmp_path / "d.json").write_text(json.dumps({"rows": [row]}))
    (tmp_path / "p.json").write_text(json.dumps({"rows": [dict(context=4096, topk_frac=0.1, dense=1.0, A0=2.0, A=1.5,
                                                               R=0.2)]}))
    r = accuracy.bench_ratios(tmp_path / "d.json", tmp_path / "p.json", context=4096)
    assert r["decode_score_fp8"] == {0.1: 0.625}


def test_bench_checks_and_tables_the_float16_variant():
    """The decode bench's check of the anchor with the copy widened to float16 (interpret, a small shape), and the
    table's float16 row, its kernels and a failed variant's line."""
    from kascade_jax.bench import decode as bench_decode
    from kascade_jax.bench import tables
    from kernels_pallas import decode as dec

    res = bench_decode.check_fp8(seed=1, b=2, s=512, hq=4, kvh=2, d=64, frac=0.1, min_k=16, peaky=True,
                                 tuning=dec.DecodeTuning(stream_fp8_f16=True), interpret=True, log=lambda *_: None)
    assert res["fp8_f16"] and res["fp8_idx_worst_rel_score_gap"] <= 1e-4 and res["fp8_mass_recall_worst"] > 0.97
    row = dict(dtype="bfloat16", batch=64, context=131072, topk_frac=0.1, k=13107, dense=7.7, A0=9.2, A=5.9, R=0.8,
               weighted=1.7, speedup=4.53, A_kernels={"kascade_anchor_scores": 4.3})
    row.update({f"{p}/dense": row[p] / row["dense"] for p in ("A0", "A", "R")})
    for t, a in (("fp8", 4.8), ("fp8f16", 3.9)):
        row.update({f"A_{t}": a, f"weighted_{t}": 1.6, f"speedup_{t}": 4.9 if t == "fp8" else 5.3,
                    f"A_{t}_kernels": {"kascade_anchor_scores": a - 1.5}})
    meta = dict(date="d", gpu="NVIDIA H200", jax="0.11.2", command="bench", tuning="t")
    md = tables.decode_markdown([row], meta)
    assert "| fp8 K, float16 dot | 3.9000 | 1.6000 | **5.30x** | 1.17 |" in md and "10% float16: `kascade_anchor" in md
    failed = {k: v for k, v in row.items() if "fp8f16" not in k} | {"fp8f16_failed": "ValueError: no"}
    assert "float16 dot failed: ValueError: no" in tables.decode_markdown([failed], meta)
