"""Kascade on the paged KV cache: paged == contiguous tokens, through the reference bundle and through the paged
Pallas kernels in interpret mode; slot reuse leaks no Kascade state; baselines refuse a paged cache clearly.

Tiny random-weight fp32 models (3 layers: anchor 0 dense, anchor 1 sparse, layer 2 reuse), ragged short prompts,
page sizes 16 and 64, budgets small enough (min_k 8, 20%) that the selection is sparse.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from kascade_jax.baselines import QuestStrategy
from kascade_jax.config import KascadeConfig
from kascade_jax.strategies import KascadeStrategy, Kernels, get_kernels, register_kernels
from kernels_pallas import paged as pg
from models import generate as gen
from models.engine import Engine, SamplingParams
from models.params import random_model
from tests.conftest import CharTokenizer as Tok, tiny_config


def _interpret_bundle() -> str:
    """The "reference" bundle with decode through the paged Pallas kernels in interpret mode."""
    name = "paged_interpret"
    base = get_kernels("reference")

    def anchor(q, k, v, pt, kv_len, *, cfg, k_max, dense, head_map_row, score_keys=None):
        return pg.anchor_decode(q, k, v, pt, kv_len, topk_frac=cfg.topk_frac, min_k=cfg.min_k, k_max=k_max,
                                head_map_row=head_map_row, dense_out=dense, pool=cfg.pool, sinks=cfg.sink_tokens,
                                window=cfg.recent_window, interpret=True, score_keys=score_keys)

    # The first interpret-mode pallas_call of a process adds a tracing-context value (a lazy registration inside
    # JAX), which would make the first jitted step that contains one trace twice. Run one before any engine exists,
    # so the compilation count below measures the engine, not JAX's warm-up.
    one = jnp.ones((2, 16, 1, 64), jnp.float32)
    pg.dense_decode(one[:1, :1, :, :].reshape(1, 1, 1, 64), one, one, jnp.zeros((1, 1), jnp.int32),
                    jnp.ones((1,), jnp.int32), interpret=True)
    register_kernels(name, Kernels(base.anchor_decode, base.reuse_decode, base.anchor_prefill, base.reuse_prefill,
                                   base.query_block, paged_anchor_decode=anchor,
                                   paged_reuse_decode=functools.partial(pg.reuse_decode, interpret=True)))
    return name


@pytest.fixture(scope="module")
def model():
    # head_dim 64: the Pallas kernels' smallest head size (interpret mode also takes fp32)
    return random_model(tiny_config(num_hidden_layers=3, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=512), seed=11)


def _kascade(kernels="reference", fp8=False):
    cfg = KascadeConfig(num_layers=3, kv_heads=2, anchors=(0, 1), head_map=((0, 1), (0, 1), (1, 0)),
                        topk_frac=0.2, min_k=8, tile_size=16, decode_score_fp8=fp8)
    return KascadeStrategy(cfg, kernels=kernels)


@pytest.mark.parametrize("ps,kernels,budget,fp8", [(16, "reference", None, False), (64, "interpret", None, False),
                                                   (16, "reference", 64, False), (64, "interpret", None, True),
                                                   (16, "reference", 64, True)])
def test_paged_kascade_equals_contiguous(model, rng, ps, kernels, budget, fp8):
    """budget: prefill in 64-token chunks between decode steps (max_prefill_tokens_per_step): the same tokens.
    fp8: decode_score_fp8, its K copy in page pools and per-slot mean / mult (the engine's cache state), with the
    interpret kernels whole and the reference in chunks (a reference run whole with fp8 cost 6.5 s and covered
    nothing these two leave out)."""
    paged_strategy = _kascade(_interpret_bundle() if kernels == "interpret" else "reference", fp8)
    contiguous = _kascade(fp8=fp8)
    prompts = [rng.integers(5, 128, n).tolist() for n in (70, 127, 97)]  # ragged, one prefill width (128)
    eng = Engine(model, Tok(), paged_strategy, max_batch=2, page_size=ps, max_len=256,
                 max_prefill_tokens_per_step=budget)
    hs = [eng.submit(p, SamplingParams(max_new_tokens=6)) for p in prompts]
    eng.run()
    want = gen.generate(model, Tok(), prompts, contiguous, max_new_tokens=6, max_len=eng.max_len)
    for h, w in zip(hs, want):
        assert h.tokens == w.token_ids
    assert eng.decode_compilations == 1


def test_paged_kascade_logits_sparse_and_close(model, rng):
    """At the logits level (one decode step): paged interpret kernels == contiguous reference, and Kascade differs
    from dense there (the selection is really sparse, so the comparison means something)."""
    from models.attention import DenseStrategy
    from models.cache import KVCache
    from models.paged import PagedKVCache

    lens = np.array([100, 61], np.int32)
    toks = rng.integers(5, 128, (2, 128)).astype(np.int32)
    strat = _kascade(_interpret_bundle())
    pc = PagedKVCache.init(model.config, 2, 20, 16, 192, dtype=jnp.float32)
    table = np.full((2, 12), -1, np.int32)
    perm = rng.permutation(20)
    table[0, :8], table[1, :8] = perm[:8], perm[8:16]
    pc = pc.with_table(table, np.zeros(2, np.int32))
    cc = KVCache.init(model.config, 2, 192, jnp.float32)
    _, pc = gen.prefill(model, toks, lens, pc, strat)
    _, cc = gen.prefill(model, toks, lens, cc, _kascade())
    nxt = jnp.asarray([7, 9], jnp.int32)
    lp, _ = gen.decode_step(model, nxt, pc, strat)
    lc, cc2 = gen.decode_step(model, nxt, cc, _kascade())
    np.testing.assert_allclose(np.asarray(lp), np.asarray(lc), atol=1e-4)
    cc = KVCache.init(model.config, 2, 192, jnp.float32)
    _, cc = gen.prefill(model, toks, lens, cc, DenseStrategy())
    ld, _ = gen.decode_step(model, nxt, cc, DenseStrategy())
    assert np.abs(np.asarray(ld) - np.asarray(lc)).max() > 1e-3


@pytest.mark.parametrize("fp8", [False, True])
def test_kascade_slot_reuse_leaks_nothing(model, rng, fp8):
    a, other = rng.integers(5, 128, 70).tolist(), rng.integers(5, 128, 140).tolist()
    s = _kascade(fp8=fp8)
    alone = Engine(model, Tok(), s, max_batch=1, page_size=16, max_len=256)
    want = alone.submit(a, SamplingParams(max_new_tokens=6)).result()
    eng = Engine(model, Tok(), s, max_batch=1, page_size=16, max_len=256, num_pages=16)
    eng.submit(other, SamplingParams(max_new_tokens=8))
    h = eng.submit(a, SamplingParams(max_new_tokens=6))  # queued: runs in the same slot, on the freed pages
    eng.run()
    assert h.slot == 0 and h.tokens == want


def test_baselines_refuse_paged_cache(model, rng):
    """The baselines leave supports_paged unset: the engine refuses them up front, prefill on a paged cache before
    attend, and a direct attend with a page table in attend (one message)."""
    from models import generate as gen
    from models.attention import AttentionInputs
    from models.paged import PagedKVCache

    with pytest.raises(ValueError, match="strategy 'quest' .QuestStrategy. does not support a paged KV cache"):
        Engine(model, Tok(), QuestStrategy(), max_batch=1, page_size=16, max_len=256)
    cache = PagedKVCache.init(model.config, 1, 4, 16, 64, dtype=jnp.float32).with_table([[0, 1, 2, 3]], [0])
    with pytest.raises(ValueError, match="strategy 'quest' .QuestStrategy. does not support a paged KV cache"):
        gen.prefill(model, rng.integers(5, 128, (1, 20)), [20], cache, QuestStrategy())
    q = jnp.zeros((1, 1, 4, 16))
    inputs = AttentionInputs(q=q, k_cache=cache.k[0], v_cache=cache.v[0], q_start=jnp.zeros(1, jnp.int32),
                             kv_len=jnp.ones(1, jnp.int32), seq_len=jnp.ones(1, jnp.int32), phase="decode",
                             page_table=cache.page_table)
    with pytest.raises(ValueError, match="strategy 'quest' .QuestStrategy. does not support a paged KV cache"):
        QuestStrategy().attend(0, inputs, None)


def test_bundle_without_paged_decode_is_refused(model, rng):
    base = get_kernels("reference")
    register_kernels("no_paged", Kernels(base.anchor_decode, base.reuse_decode, base.anchor_prefill,
                                         base.reuse_prefill, base.query_block))
    eng = Engine(model, Tok(), _kascade("no_paged"), max_batch=1, page_size=16, max_len=256)
    h = eng.submit(rng.integers(5, 128, 20).tolist(), SamplingParams(max_new_tokens=3))
    with pytest.raises(ValueError, match="kernels 'no_paged' have no paged decode"):
        eng.run()  # prefill (gathered) works; the decode step fails
    assert h.finish_reason == "error" and h.tokens and eng.idle and eng.allocator.free == eng.num_pages
    with pytest.raises(ValueError, match="kernels 'no_paged' have no paged decode"):
        h.result()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["dense", "kascade", "kascade_fp8"])
def test_engine_paged_pallas_gpu(rng, name):
    """On the GPU (bf16, d 128, the Pallas kernels through the page table): the engine's greedy tokens match
    contiguous generate() for the first 8 tokens of every request (bf16 kernels with different tilings may
    legitimately diverge later on a random model), and the decode step compiles once."""
    import jax.numpy as jnp

    from models.attention import DenseStrategy

    m = random_model(tiny_config(num_hidden_layers=4, hidden_size=512, intermediate_size=1024, head_dim=128,
                                 num_attention_heads=8, num_key_value_heads=2, vocab_size=512,
                                 max_position_embeddings=8192), seed=5, dtype=jnp.bfloat16)
    if name == "dense":
        paged_s = contig_s = DenseStrategy()
    else:
        cfg = KascadeConfig(num_layers=4, kv_heads=2, anchors=(0, 2), topk_frac=0.1, min_k=64, tile_size=32,
                            decode_score_fp8=name == "kascade_fp8")
        paged_s = contig_s = KascadeStrategy(cfg, kernels="pallas")
    prompts = [rng.integers(5, 512, n).tolist() for n in (1500, 3100, 700)]
    eng = Engine(m, Tok(), paged_s, max_batch=2, page_size=64, max_len=4096)
    hs = [eng.submit(p, SamplingParams(max_new_tokens=16)) for p in prompts]
    eng.run()
    for h, p in zip(hs, prompts):
        (w,) = gen.generate(m, Tok(), [p], contig_s, max_new_tokens=16, max_len=eng.max_len)
        assert h.tokens[:8] == w.token_ids[:8]
    assert eng.decode_compilations == 1


@pytest.mark.parametrize("some", [False, True])
def test_paged_kascade_decode_rerank_equals_contiguous(model, rng, some):
    """decode_rerank reads its candidates' K rows through the page table: one decode step's logits on a shuffled
    paged cache equal the contiguous cache's, and differ from the plain recipe's (the rerank changed the sets).
    some: one anchor, and only layer 2 reranks (layer 1 reads the first k of the anchor's ordered candidates)."""
    import dataclasses

    from models.cache import KVCache
    from models.paged import PagedKVCache

    cfg = dataclasses.replace(_kascade().config, decode_rerank=3, topk_frac=0.1, min_k=4)
    if some:
        cfg = dataclasses.replace(cfg, anchors=(0,), decode_rerank_layers=(2,))
    plain_cfg = dataclasses.replace(cfg, decode_rerank=1, decode_rerank_layers=None)
    strat, plain = KascadeStrategy(cfg), KascadeStrategy(plain_cfg)
    lens = np.array([100, 61], np.int32)
    toks = rng.integers(5, 128, (2, 128)).astype(np.int32)
    nxt = jnp.asarray([7, 9], jnp.int32)
    pc = PagedKVCache.init(model.config, 2, 20, 16, 192, dtype=jnp.float32)
    table = np.full((2, 12), -1, np.int32)
    perm = rng.permutation(20)
    table[0, :8], table[1, :8] = perm[:8], perm[8:16]
    pc = pc.with_table(table, np.zeros(2, np.int32))
    _, pc = gen.prefill(model, toks, lens, pc, strat)
    lp, _ = gen.decode_step(model, nxt, pc, strat)
    logits = {}
    for name, s in (("rerank", strat), ("plain", plain)):
        cc = KVCache.init(model.config, 2, 192, jnp.float32)
        _, cc = gen.prefill(model, toks, lens, cc, s)
        logits[name] = np.asarray(gen.decode_step(model, nxt, cc, s)[0])
    np.testing.assert_allclose(np.asarray(lp), logits["rerank"], atol=1e-4)
    assert np.abs(logits["rerank"] - logits["plain"]).max() > 1e-3
