"""Paged KV cache (models/paged.py) and the continuous-batching engine (models/engine.py), dense strategy.

Tiny random-weight fp32 models from a ModelConfig, short ragged prompts. Paged results are compared with the
contiguous KVCache path (`models.generate`), token for token.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import paged as pg
from models import generate as gen
from models.attention import DenseStrategy
from models.cache import KVCache
from models.engine import Engine, SamplingParams
from models.paged import OutOfPagesError, PageAllocator, PagedKVCache, check_page_size, zero_pages
from models.params import random_model
from tests.conftest import CharTokenizer as Tok, tiny_config

S = DenseStrategy()


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config(num_hidden_layers=2, max_position_embeddings=512), seed=3)


def _scattered_cache(cfg, lens, ps, max_len, rng):
    """A paged cache whose pages for each sequence are scattered at random over a pool with spare pages."""
    mp = max_len // ps
    n = len(lens) * mp + 5
    cache = PagedKVCache.init(cfg, len(lens), n, ps, max_len, dtype=jnp.float32)
    perm = rng.permutation(n)
    table = np.full((len(lens), mp), -1, np.int32)
    for b in range(len(lens)):
        table[b] = perm[b * mp:(b + 1) * mp]
    return cache.with_table(table, np.zeros(len(lens), np.int32))


@pytest.mark.parametrize("ps", [16, 64])
def test_paged_prefill_decode_equals_contiguous(model, rng, ps):
    """prefill + decode_step on a scattered paged cache == the contiguous cache (logits), ragged lengths."""
    lens = np.array([37, 90, 130], np.int32)
    toks = rng.integers(5, 128, (3, 192)).astype(np.int32)
    max_len = 256
    pc = _scattered_cache(model.config, lens, ps, max_len, rng)
    cc = KVCache.init(model.config, 3, max_len, jnp.float32)
    lp, pc = gen.prefill(model, toks, lens, pc, S)
    lc, cc = gen.prefill(model, toks, lens, cc, S)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(lc), atol=1e-5)
    for _ in range(5):
        nxt = jnp.argmax(lc, -1).astype(jnp.int32)
        lp, pc = gen.decode_step(model, nxt, pc, S)
        lc, cc = gen.decode_step(model, nxt, cc, S)
        np.testing.assert_allclose(np.asarray(lp), np.asarray(lc), atol=1e-5)
    assert np.asarray(pc.lengths).tolist() == (lens + 5).tolist()


def test_page_size_and_allocator_errors():
    for bad in (12, 8, 512, 48, True, 16.0):
        with pytest.raises(ValueError, match="page_size must be a power of two in 16..256"):
            check_page_size(bad)
    a = PageAllocator(4)
    got = a.allocate(3)
    assert len(set(got)) == 3 and a.free == 1
    with pytest.raises(OutOfPagesError, match="out of KV pages: 2 requested, 1 free of 4"):
        a.allocate(2)
    assert a.free == 1  # a failed allocation takes nothing
    a.release(got[:1])
    with pytest.raises(ValueError, match="not allocated"):
        a.release(got[:1])
    assert a.allocate(2)[0] == got[0]  # LIFO: a released (dirty) page is handed out next


@pytest.mark.parametrize("ps", [16])  # page size 64 through the engine: tests/kascade_jax/test_paged_kascade.py
def test_engine_equals_generate(model, rng, ps):
    """Requests joining at different steps, ragged prompts and lengths: the same greedy tokens as generate()."""
    eng = Engine(model, Tok(), S, max_batch=3, page_size=ps, max_len=256)
    prompts = [rng.integers(5, 128, n).tolist() for n in (21, 70, 5, 100)]
    news = [9, 4, 12, 6]
    streamed = []
    hs = [eng.submit(prompts[0], SamplingParams(max_new_tokens=news[0]), on_token=streamed.append)]
    eng.step()
    eng.step()
    hs += [eng.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts[1:], news[1:])]
    assert eng.queued == 3
    eng.step()
    assert eng.active == 3 and eng.queued == 1  # the fourth waits for a slot
    eng.run()
    for h, p, n in zip(hs, prompts, news):
        (want,) = gen.generate(model, Tok(), [p], S, max_new_tokens=n, max_len=eng.max_len)
        assert h.tokens == want.token_ids and h.finish_reason == "length" and len(h.tokens) == n
    assert streamed == hs[0].tokens
    assert eng.decode_compilations == 1  # joins and leaves never recompile the decode step
    assert eng.allocator.free == eng.num_pages and eng.idle


def test_streaming_iterator_and_eos(model, rng):
    p = rng.integers(5, 128, 30).tolist()
    (ref,) = gen.generate(model, Tok(), [p], S, max_new_tokens=8, max_len=256)
    eos_tok = ref.token_ids[3]

    class EosTok(Tok):
        eos_token_ids = (eos_tok,)

    eng = Engine(model, EosTok(), S, max_batch=2, page_size=16, max_len=256)
    h = eng.submit(p, SamplingParams(max_new_tokens=8))
    got = list(h)  # iterating drives the engine
    cut = ref.token_ids.index(eos_tok)
    assert got == ref.token_ids[:cut] and h.finish_reason == "eos" and h.new_tokens == cut + 1
    h2 = eng.submit(p, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert h2.result() == ref.token_ids


def test_slot_reuse_leaks_nothing(model, rng):
    """A request run alone == the same request in a slot (and on dirty pages) another request used before."""
    a = rng.integers(5, 128, 50).tolist()
    other = rng.integers(5, 128, 120).tolist()
    alone = Engine(model, Tok(), S, max_batch=2, page_size=16, max_len=256)
    want = alone.submit(a, SamplingParams(max_new_tokens=7)).result()
    eng = Engine(model, Tok(), S, max_batch=1, page_size=16, max_len=256, num_pages=12)
    first = eng.submit(other, SamplingParams(max_new_tokens=10))
    eng.run()
    h = eng.submit(a, SamplingParams(max_new_tokens=7))
    eng.run()
    assert first.slot == h.slot == 0 and h.tokens == want


def test_out_of_pages_queues_then_runs(model, rng):
    """Two requests that do not fit together: the second waits in the queue, then runs with correct tokens."""
    p1, p2 = rng.integers(5, 128, 60).tolist(), rng.integers(5, 128, 40).tolist()
    eng = Engine(model, Tok(), S, max_batch=2, page_size=16, max_len=256, num_pages=6)  # 96 tokens of pages
    h1 = eng.submit(p1, SamplingParams(max_new_tokens=20))  # 80 tokens: 5 pages
    h2 = eng.submit(p2, SamplingParams(max_new_tokens=20))  # 60 tokens: 4 pages
    eng.step()
    assert eng.active == 1 and eng.queued == 1 and h2.slot is None
    eng.run()
    for h, p in ((h1, p1), (h2, p2)):
        (want,) = gen.generate(model, Tok(), [p], S, max_new_tokens=20, max_len=256)
        assert h.tokens == want.token_ids
    assert h2.ttft > h1.ttft  # it waited
    with pytest.raises(ValueError, match="more than the whole pool"):
        eng.submit(rng.integers(5, 128, 90).tolist(), SamplingParams(max_new_tokens=20))
    with pytest.raises(ValueError, match="exceeds the engine's max_len 256"):
        eng.submit([5] * 250, SamplingParams(max_new_tokens=20))
    with pytest.raises(ValueError, match="max_new_tokens must be"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.submit([])


def test_sampling_depends_on_the_request_only(model, rng):
    """Temperature sampling draws one key per (request seed, token index): the same tokens alone or batched next to
    another request in a reused slot, and not the greedy tokens."""
    p, other = rng.integers(5, 128, 33).tolist(), rng.integers(5, 128, 80).tolist()
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=5)
    alone = Engine(model, Tok(), S, max_batch=2, page_size=16, max_len=256)
    want = alone.submit(p, params).result()
    greedy = alone.submit(p, SamplingParams(max_new_tokens=8)).result()
    eng = Engine(model, Tok(), S, max_batch=2, page_size=16, max_len=256)
    eng.submit(other, SamplingParams(max_new_tokens=3))
    eng.submit(other, SamplingParams(max_new_tokens=12, temperature=0.7, seed=1))
    eng.step()
    h = eng.submit(p, params)  # joins when the first request leaves, in its slot
    eng.run()
    assert h.tokens == want and want != greedy
    with pytest.raises(ValueError, match="temperature must be"):
        SamplingParams(temperature=float("nan"))


# --- review fixes: unallocated pages, opt-in paged support, failed requests, dirty pages, argument checks ---------


@dataclasses.dataclass(frozen=True)
class NotPaged:
    """Dense attention from a strategy that never heard of pages (no supports_paged)."""

    name: str = "not_paged"

    def attend(self, layer, inputs, state):
        return S.attend(layer, inputs, state)

    def post_attention(self, layer, x, attn_out, state):
        return state


@dataclasses.dataclass(frozen=True)
class OffsetRefusing:
    """Paged-aware, but refuses a prefill chunk at an offset (a trace-time error in the second chunk)."""

    supports_paged = True
    name: str = "offset_refusing"

    def attend(self, layer, inputs, state):
        if inputs.phase == "prefill" and not inputs.chunk_at_zero:
            raise ValueError("offset_refusing refuses prefill chunks at an offset")
        return S.attend(layer, inputs, state)

    def post_attention(self, layer, x, attn_out, state):
        return state


def test_direct_paged_use_needs_allocated_pages(model, rng):
    """prefill / decode_step / forward on a paged cache refuse a position on an unallocated (-1 or out of range)
    page, naming the sequence and position, instead of reading another sequence's rows (Pallas clamps -1 to
    page 0) or zeros (the reference)."""
    cfg = model.config
    cache = PagedKVCache.init(cfg, 2, 10, 16, 64, dtype=jnp.float32)
    table = np.array([[0, 1, 2, 3], [4, 5, -1, -1]], np.int32)
    toks = rng.integers(5, 128, (2, 48)).astype(np.int32)
    with pytest.raises(ValueError, match=r"prefill: sequence 1 needs positions \[0, 40\), but position 32 lies on "
                                         r"page-table entry \[1, 2\] = -1"):
        gen.prefill(model, toks, np.array([48, 40]), cache.with_table(table, np.zeros(2)), S)
    bad = table.copy()
    bad[1, 2] = 10  # == num_pages: out of range
    with pytest.raises(ValueError, match=r"sequence 1 .* entry \[1, 2\] = 10, not an allocated page in \[0, 10\)"):
        gen.prefill(model, toks, np.array([48, 40]), cache.with_table(bad, np.zeros(2)), S)
    with pytest.raises(ValueError, match=r"forward: sequence 0 needs positions \[0, 48\)"):
        gen.forward(model, toks, cache.with_table(np.array([[0, 1, -1, 3], [4, 5, 6, 7]]), np.zeros(2)), S)
    _, pc = gen.prefill(model, toks, np.array([48, 32]), cache.with_table(table, np.zeros(2)), S)  # fits
    with pytest.raises(ValueError, match=r"decode_step: sequence 1 needs positions \[0, 33\), but position 32"):
        gen.decode_step(model, np.array([5, 6]), pc, S)
    logits, pc = gen.decode_step(model, np.array([5, 6]), pc.with_table(np.array([[0, 1, 2, 3], [4, 5, 6, -1]]),
                                                                      pc.lengths), S)
    assert np.all(np.isfinite(np.asarray(logits)))


def test_paged_support_is_opt_in(model, rng):
    """A strategy without supports_paged gets a ValueError naming it (not a shape error, nor, with num_pages ==
    batch, page b silently read as sequence b); the engine refuses it at construction."""
    cache = PagedKVCache.init(model.config, 2, 2, 64, 64, dtype=jnp.float32).with_table(np.array([[0], [1]]),
                                                                                          np.zeros(2))
    toks = rng.integers(5, 128, (2, 30)).astype(np.int32)
    with pytest.raises(ValueError, match="strategy 'not_paged' .NotPaged. does not support a paged KV cache"):
        gen.prefill(model, toks, np.array([30, 20]), cache, NotPaged())
    with pytest.raises(ValueError, match="strategy 'not_paged' .NotPaged. does not support a paged KV cache"):
        Engine(model, Tok(), NotPaged(), max_batch=1, page_size=16, max_len=256)
    assert DenseStrategy.supports_paged and "supports_paged" not in {f.name for f in dataclasses.fields(S)}
    _, cc = gen.prefill(model, toks, np.array([30, 20]), KVCache.init(model.config, 2, 64, jnp.float32), NotPaged())


def test_failed_admission_errors_the_request_and_keeps_the_pools(model, rng):
    """A prefill that fails in its second chunk: the handle finishes with "error" (result() and iteration
    re-raise), its slot and pages are given back, and no pool buffer was donated into the failing program (the
    engine serves the next request with the same tokens as a fresh engine)."""
    eng = Engine(model, Tok(), OffsetRefusing(), max_batch=1, page_size=16, max_len=256, chunk_size=64)
    bad = eng.submit(rng.integers(5, 128, 100).tolist(), SamplingParams(max_new_tokens=3))  # two chunks
    with pytest.raises(ValueError, match="refuses prefill chunks at an offset"):
        eng.step()
    assert bad.finished and bad.finish_reason == "error" and isinstance(bad.error, ValueError)
    with pytest.raises(ValueError, match="refuses prefill chunks at an offset"):
        bad.result()
    with pytest.raises(ValueError, match="refuses prefill chunks at an offset"):
        list(bad)
    assert eng.idle and eng.allocator.free == eng.num_pages
    p = rng.integers(5, 128, 40).tolist()  # one chunk: fine
    got = eng.submit(p, SamplingParams(max_new_tokens=5)).result()
    want = Engine(model, Tok(), S, max_batch=1, page_size=16, max_len=256).submit(
        p, SamplingParams(max_new_tokens=5)).result()
    assert got == want
    again = eng.submit(rng.integers(5, 128, 100).tolist(), SamplingParams(max_new_tokens=3))
    with pytest.raises(ValueError, match="refuses prefill chunks at an offset"):  # a refused width is traced again
        eng.step()
    assert again.finish_reason == "error" and eng.idle and eng.allocator.free == eng.num_pages


def test_prefill_chunks_reuse_the_engines_split_of_the_model(model, rng, monkeypatch):
    """Host work per prefill chunk (issue 23): the engine runs each chunk on the split it made once, and traces a
    later-chunk width once; splitting the model again cost ~1 ms of host time per layer for every chunk and every
    admission (~25 ms per chunk at 32 layers on the CPU). Same tokens as `generate`."""
    from flax import nnx

    eng = Engine(model, Tok(), S, max_batch=2, page_size=16, max_len=256, chunk_size=64)
    prompts = [rng.integers(5, 128, n).tolist() for n in (150, 100, 130)]  # 2-3 chunks each
    first = eng.submit(prompts[0], SamplingParams(max_new_tokens=3)).result()  # traces the later-chunk width
    calls = []
    split = nnx.split
    monkeypatch.setattr(nnx, "split", lambda *a, **k: calls.append(1) or split(*a, **k))
    hs = [eng.submit(p, SamplingParams(max_new_tokens=3)) for p in prompts]
    eng.run()
    assert calls == [] and hs[0].tokens == first
    monkeypatch.undo()
    for p, h in zip(prompts, hs):
        (want,) = gen.generate(model, Tok(), [p], S, max_new_tokens=3, max_len=eng.max_len, chunk_size=64)
        assert h.tokens == want.token_ids


def test_unfinished_handle_of_idle_engine_raises(model):
    from models.engine import RequestHandle

    eng = Engine(model, Tok(), S, max_batch=1, page_size=16, max_len=256)
    h = RequestHandle(eng, 7, [5, 6], SamplingParams(), None, 0.0)  # never queued: could never finish
    with pytest.raises(RuntimeError, match="request 7 is unfinished but its engine is idle"):
        h.result()


def test_poisoned_free_pages_do_not_leak(model, rng):
    """Every page of the pool starts as inf/NaN (a previous owner's garbage): the tokens equal a clean engine's."""
    p = rng.integers(5, 128, 37).tolist()
    want = Engine(model, Tok(), S, max_batch=2, page_size=16, max_len=256).submit(
        p, SamplingParams(max_new_tokens=20)).result()
    eng = Engine(model, Tok(), S, max_batch=2, page_size=16, max_len=256)
    poison = lambda x: jnp.full_like(x, jnp.nan).at[::2].set(jnp.inf)  # noqa: E731
    eng.cache = dataclasses.replace(eng.cache, k=tuple(map(poison, eng.cache.k)), v=tuple(map(poison, eng.cache.v)))
    assert eng.submit(p, SamplingParams(max_new_tokens=20)).result() == want


def test_zero_pages_zeroes_those_pages_only(model):
    cache = PagedKVCache.init(model.config, 1, 10, 16, 64, dtype=jnp.float32)
    ones = lambda pools: tuple(jnp.ones_like(x) for x in pools)  # noqa: E731
    out = zero_pages(dataclasses.replace(cache, k=ones(cache.k), v=ones(cache.v)), [3, 9])  # padded with 10: dropped
    for pool in out.k + out.v:
        assert np.asarray(pool).reshape(10, -1).any(axis=1).tolist() == [p not in (3, 9) for p in range(10)]


def test_state_slot_view_merge_and_zero_pages(model):
    """A cache state on a paged cache (models/paged.py): a [num_pages, page_size, ...] leaf is a page pool, shared by
    a slot's view and zeroed with its pages; other leaves are per sequence: the view takes the slot's row, merge_slot
    writes it back there only."""
    cache = PagedKVCache.init(model.config, 3, 10, 16, 64, dtype=jnp.float32)
    seq = jnp.arange(15, dtype=jnp.float32).reshape(3, 5)
    cache = dataclasses.replace(cache, strategy_state=({"pool": jnp.ones((10, 16, 2, 4)), "seq": seq}, None))
    view = cache.slot_view(1, [0, 1, 2, 3], 5)
    assert view.batch == 1 and view.page_table.shape == (1, 4) and int(view.lengths[0]) == 5
    assert view.strategy_state[1] is None and view.strategy_state[0]["pool"].shape == (10, 16, 2, 4)
    np.testing.assert_array_equal(np.asarray(view.strategy_state[0]["seq"]), np.asarray(seq[1:2]))
    done = dataclasses.replace(view, strategy_state=({"pool": jnp.full((10, 16, 2, 4), 2.0),
                                                      "seq": jnp.full((1, 5), 99.0)}, None))
    merged = cache.merge_slot(1, done)
    want = np.asarray(seq).copy()
    want[1] = 99
    np.testing.assert_array_equal(np.asarray(merged.strategy_state[0]["seq"]), want)
    assert (np.asarray(merged.strategy_state[0]["pool"]) == 2).all() and merged.batch == 3
    out = zero_pages(merged, [3])
    pool = np.asarray(out.strategy_state[0]["pool"]).reshape(10, -1)
    assert pool.any(axis=1).tolist() == [p != 3 for p in range(10)]
    np.testing.assert_array_equal(np.asarray(out.strategy_state[0]["seq"]), want)


@dataclasses.dataclass(frozen=True)
class PallasPagedDecode:
    """Dense attention whose paged decode is the Pallas kernel (interpret mode, no masked loads: what a GPU runs; on
    the CPU DenseStrategy's paged decode is the gather reference, which zeroes rows past kv_len itself)."""

    supports_paged = True
    name: str = "pallas_paged_decode"

    def attend(self, layer, inputs, state):
        if inputs.page_table is None or inputs.phase != "decode":
            return S.attend(layer, inputs, state)
        return pg.dense_decode(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.kv_len,
                               impl="pallas", interpret=True), state

    def post_attention(self, layer, x, attn_out, state):
        return state


@pytest.mark.parametrize("ps,prompt,new", [(16, 30, 5), (128, 20, 3)])
def test_dirty_pages_are_zeroed_when_handed_out(rng, ps, prompt, new):
    """Pages poisoned with NaN after their request left are handed to the next one, whose tokens equal generate()'s:
    the engine zeroes a page when it hands it out, since the Pallas decode reads rows past kv_len unmasked.
    Page 16: a decode step's new page (the prompt's two are written whole by the padded prefill); page 128: the
    prompt's page, of which the prefill writes 64 rows."""
    m = random_model(tiny_config(num_hidden_layers=2, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=512), seed=3)
    strat = PallasPagedDecode()
    eng = Engine(m, Tok(), strat, max_batch=1, page_size=ps, max_len=256, num_pages=256 // ps)
    eng.submit(rng.integers(5, 128, 40).tolist(), SamplingParams(max_new_tokens=2)).result()
    nan = lambda x: jnp.full_like(x, jnp.nan)  # noqa: E731  (every page: the freed ones are handed out next)
    eng.cache = dataclasses.replace(eng.cache, k=tuple(map(nan, eng.cache.k)), v=tuple(map(nan, eng.cache.v)))
    p = rng.integers(5, 128, prompt).tolist()
    (want,) = gen.generate(m, Tok(), [p], strat, max_new_tokens=new, max_len=eng.max_len)
    assert eng.submit(p, SamplingParams(max_new_tokens=new)).result() == want.token_ids


def test_engine_argument_checks(model):
    with pytest.raises(ValueError, match=r"max_len \(200\) must be a multiple of page_size \(16\), e.g. 192"):
        Engine(model, Tok(), S, max_batch=1, page_size=16, max_len=200)
    with pytest.raises(ValueError, match="chunk_size must be a positive multiple of 64"):
        Engine(model, Tok(), S, max_batch=1, page_size=16, max_len=256, chunk_size=100)
    sharded = random_model(tiny_config(num_hidden_layers=1, max_position_embeddings=512), seed=4)
    sharded.mesh = object()  # what shard_model sets: a jax.sharding.Mesh
    with pytest.raises(ValueError, match="the engine runs on one device"):
        Engine(sharded, Tok(), S, max_batch=1, page_size=16, max_len=256)


@dataclasses.dataclass(frozen=True)
class FailsAtRuntime:
    """Paged-aware dense attention whose compiled decode step fails while running (after the pools were donated)."""

    supports_paged = True
    name: str = "fails_at_runtime"

    def attend(self, layer, inputs, state):
        if inputs.phase == "decode" and layer == 0:
            jax.debug.callback(_boom, inputs.kv_len)
        return S.attend(layer, inputs, state)

    def post_attention(self, layer, x, attn_out, state):
        return state


def _boom(kv_len):
    raise RuntimeError("decode failed at run time")


def test_runtime_failure_after_donation_marks_the_engine_unusable(model, rng):
    eng = Engine(model, Tok(), FailsAtRuntime(), max_batch=2, page_size=16, max_len=256)
    h = eng.submit(rng.integers(5, 128, 20).tolist(), SamplingParams(max_new_tokens=4))
    queued = [eng.submit(rng.integers(5, 128, 20).tolist(), SamplingParams(max_new_tokens=4)) for _ in range(2)]
    with pytest.raises(Exception, match="decode failed at run time"):
        eng.run()
    assert h.finish_reason == "error" and all(q.finish_reason == "error" for q in queued)
    with pytest.raises(RuntimeError, match="this engine is unusable: a failed step consumed its donated KV pools"):
        eng.step()
    with pytest.raises(RuntimeError, match="this engine is unusable"):
        eng.submit([5, 6])


# --- issue 23 item 5: top-p / top-k per slot, stop strings, a prompt beyond the model's window --------------------


def test_filter_slots_keeps_each_rows_top_k_and_nucleus(rng):
    from models.engine import _filter_slots

    logits = jnp.asarray(rng.normal(size=(4, 50)) * 2, jnp.float32)
    top_ps = jnp.asarray([1.0, 0.5, 0.9, 0.3], jnp.float32)
    top_ks = jnp.asarray([5, 0, 10, 0], jnp.int32)
    out = np.asarray(_filter_slots(logits, top_ps, top_ks))
    x = np.asarray(logits)
    for b in range(4):
        order = np.argsort(-x[b])
        allowed = order[:int(top_ks[b])] if int(top_ks[b]) else order
        p = np.exp(x[b, allowed] - x[b, allowed].max())
        p /= p.sum()
        # the nucleus: the smallest prefix whose mass reaches top_p (a token is kept while the mass before it < top_p)
        n = int(np.sum(np.cumsum(p) - p < float(top_ps[b]))) if float(top_ps[b]) < 1 else len(allowed)
        kept = set(allowed[:n].tolist())
        assert set(np.flatnonzero(np.isfinite(out[b])).tolist()) == kept, b
        np.testing.assert_array_equal(out[b, sorted(kept)], x[b, sorted(kept)])


def test_engine_top_k_top_p_and_stop_strings(model, rng):
    p, other = rng.integers(5, 128, 33).tolist(), rng.integers(5, 128, 50).tolist()
    eng = Engine(model, Tok(), S, max_batch=2, page_size=16, max_len=256)
    greedy = eng.submit(p, SamplingParams(max_new_tokens=10)).result()
    plain = SamplingParams(max_new_tokens=10, temperature=1.0, seed=4)
    want_other = eng.submit(other, plain).result()
    # top_k=1 and a tiny nucleus leave only the argmax: greedy, also next to an unfiltered slot that keeps its draw
    h1 = eng.submit(p, SamplingParams(max_new_tokens=10, temperature=0.9, seed=1, top_k=1))
    h2 = eng.submit(other, plain)
    eng.run()
    assert h1.tokens == greedy and h2.tokens == want_other and want_other != eng.submit(
        other, SamplingParams(max_new_tokens=10)).result()
    assert eng.submit(p, SamplingParams(max_new_tokens=10, temperature=0.9, top_p=1e-6)).result() == greedy
    assert eng.decode_compilations == 2  # one program without the filter, one with it
    # stop strings: the request ends once its text holds one; text is cut before it
    text = Tok().decode(greedy)
    stop = text[3:5]
    h = eng.submit(p, SamplingParams(max_new_tokens=10, stop=(stop,)))
    h.result()
    cut = text.find(stop)
    assert h.finish_reason == "stop" and h.text == text[:cut] and h.tokens == greedy[:cut + len(stop)]
    for bad, match in ((dict(top_p=0.0), "top_p"), (dict(top_k=-1), "top_k"), (dict(stop=("",)), "stop must be")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="larger than the vocabulary"):
        eng.submit(p, SamplingParams(top_k=10 ** 6, temperature=1.0))
    big = Engine(model, Tok(), S, max_batch=1, page_size=64)  # max_len = the model's 512-token window
    with pytest.raises(ValueError, match="does not fit the model's context window of 512 tokens"):
        big.submit([5] * 512)


# --- issue 23 item 1: chunked prefill interleaved with decode ---------------------------------------------------------


def test_interleaved_prefill_same_tokens_and_decode_keeps_running(model, rng):
    prompts = [rng.integers(5, 128, n).tolist() for n in (20, 300, 97, 33)]
    whole = Engine(model, Tok(), S, max_batch=2, page_size=16, max_len=512)
    want = [whole.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, (40, 6, 9, 12))]
    whole.run()
    eng = Engine(model, Tok(), S, max_batch=2, page_size=16, max_len=512, max_prefill_tokens_per_step=128)
    short = eng.submit(prompts[0], SamplingParams(max_new_tokens=40))
    eng.step()  # the short prompt: one chunk, its first token, one decode step
    long = eng.submit(prompts[1], SamplingParams(max_new_tokens=6))  # 300 tokens: 3 chunks of 128 (of 512 padded)
    during = []
    while not long.tokens and not long.finished:
        events = eng.step()
        during.append(([h.id for h, _ in events], eng.prefilling))
    # the running request decoded in every step of the long prefill; the long one joined after its 3rd chunk
    assert len(during) == 3 and all(short.id in ids for ids, _ in during)
    assert [n for _, n in during] == [1, 1, 0]
    rest = [eng.submit(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts[2:], (9, 12))]
    eng.run()
    assert [h.tokens for h in (short, long, *rest)] == [h.tokens for h in want]
    assert eng.decode_compilations == 1
    with pytest.raises(ValueError, match="max_prefill_tokens_per_step must be a positive multiple of 64"):
        Engine(model, Tok(), S, max_batch=1, page_size=16, max_len=256, max_prefill_tokens_per_step=100)
    with pytest.raises(ValueError, match="must not exceed max_prefill_tokens_per_step"):
        Engine(model, Tok(), S, max_batch=1, page_size=16, max_len=256, chunk_size=256, max_prefill_tokens_per_step=128)


def test_reservations_decide_admission(model, rng):
    """Only the page reservations keep B out: both prompts fit one page each, but A's growth (5 pages of 6) leaves
    B's 4 no room. An engine that admitted B on its prompt's pages would run out of pages mid-decode."""
    a, b = rng.integers(5, 128, 16).tolist(), rng.integers(5, 128, 16).tolist()
    eng = Engine(model, Tok(), S, max_batch=2, page_size=16, max_len=256, num_pages=6)
    ha = eng.submit(a, SamplingParams(max_new_tokens=64))  # 80 tokens: 5 pages (the toy tokenizer has no EOS)
    hb = eng.submit(b, SamplingParams(max_new_tokens=48))  # 64 tokens: 4 pages
    eng.step()
    assert eng.active == 1 and eng.queued == 1 and hb.slot is None  # B waits for A's reserved pages
    eng.run()
    for h, p, n in ((ha, a, 64), (hb, b, 48)):
        (want,) = gen.generate(model, Tok(), [p], S, max_new_tokens=n, max_len=256)
        assert h.finish_reason == "length" and h.tokens == want.token_ids and len(h.tokens) == n
    assert eng.allocator.free == 6 and eng._reserved == 0
