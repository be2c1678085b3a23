import jax.numpy as jnp
import numpy as np
import pytest

from models import generate as gen
from models.attention import DenseStrategy
from models.cache import KVCache
from tests.conftest import tiny_config

S = DenseStrategy()


class ToyTokenizer:
    eos_token_ids = (3,)

    def encode(self, text):
        return [5 + (ord(c) % 100) for c in text]

    def encode_chat(self, messages, add_generation_prompt=True):
        return [1] + self.encode(messages[-1]["content"]) + [2]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + (i % 26)) for i in ids)


def _full_logits(model, toks):
    """Logits of one uncached forward; padded to a multiple of 64 so repeated calls reuse one compilation
    (causal attention: the padding after a position cannot change its logits)."""
    b, t = toks.shape
    padded = np.zeros((b, -(-t // 64) * 64), np.int32)
    padded[:, :t] = toks
    cache = KVCache.init(model.config, b, padded.shape[1], jnp.float32)
    logits, _, _ = gen.forward(model, padded, cache, S)
    return np.asarray(logits)[:, :t]


def test_cache_decode_equals_full_recompute(tiny_model, rng):
    """Greedy generation with the KV cache == recomputing the full forward at every step."""
    prompt = rng.integers(5, 128, 37).tolist()
    (res,) = gen.generate(tiny_model, ToyTokenizer(), [prompt], S, max_new_tokens=12)
    seq = list(prompt)
    for _ in range(12):
        nxt = int(np.argmax(_full_logits(tiny_model, np.array([seq]))[0, -1]))
        seq.append(nxt)
        if nxt == 3:
            break
    expect = [t for t in seq[len(prompt):] if t != 3]
    assert res.token_ids == expect


def test_chunked_prefill_equals_one_chunk(tiny_model, rng):
    toks = rng.integers(5, 128, (2, 300))
    full = _full_logits(tiny_model, toks)
    cache = KVCache.init(tiny_model.config, 2, 320, jnp.float32)
    logits, cache = gen.prefill(tiny_model, toks, [300, 300], cache, S, chunk_size=128, all_logits=True)
    np.testing.assert_allclose(np.asarray(logits), full, atol=2e-4)
    assert np.asarray(cache.lengths).tolist() == [300, 300]
    cache = KVCache.init(tiny_model.config, 2, 320, jnp.float32)
    chunks, _ = gen.prefill(tiny_model, toks, [300, 300], cache, S, chunk_size=128, all_logits=True,
                            join_logits=False)  # the same logits, per chunk, the padding columns dropped
    assert [c.shape[1] for c in chunks] == [128, 128, 44]
    np.testing.assert_allclose(np.concatenate([np.asarray(c) for c in chunks], axis=1), full, atol=2e-4)


def test_batch_with_different_lengths_equals_single(tiny_model, rng):
    prompts = [rng.integers(5, 128, n).tolist() for n in (11, 70, 33)]
    batched = gen.generate(tiny_model, ToyTokenizer(), prompts, S, max_new_tokens=8, chunk_size=64)
    for p, r in zip(prompts, batched):
        (single,) = gen.generate(tiny_model, ToyTokenizer(), [p], S, max_new_tokens=8)
        assert r.token_ids == single.token_ids
        assert r.prompt_tokens == len(p)


def test_per_row_limits_equal_separate_runs(tiny_model, rng):
    """One batch with a generation limit per row gives each row exactly what a run at that limit alone gives."""
    prompts = [rng.integers(5, 128, n).tolist() for n in (20, 45, 31)]
    limits = [3, 9, 1]
    timings = {"prefill_s": 1.0}
    batched = gen.generate(tiny_model, ToyTokenizer(), prompts, S, max_new_tokens=limits, timings=timings)
    assert timings["prefill_s"] > 1.0 and timings["decode_s"] > 0  # added to what the dict held
    assert timings["decode_steps"] == max(r.new_tokens for r in batched) <= 9  # the loop ends with its last row
    for p, lim, r in zip(prompts, limits, batched):
        (single,) = gen.generate(tiny_model, ToyTokenizer(), [p], S, max_new_tokens=lim)
        assert r.token_ids == single.token_ids and r.finish_reason == single.finish_reason
        assert r.new_tokens <= lim
    with pytest.raises(ValueError, match="2 limits for 3 prompts"):
        gen.generate(tiny_model, ToyTokenizer(), prompts, S, max_new_tokens=[1, 2])
    with pytest.raises(ValueError, match="max_new_tokens must be ints >= 1, got 0"):
        gen.generate(tiny_model, ToyTokenizer(), prompts, S, max_new_tokens=[1, 0, 2])


def test_decode_after_prefill_matches_longer_prefill(tiny_model, rng):
    toks = rng.integers(5, 128, (1, 50))
    cache = KVCache.init(tiny_model.config, 1, 128, jnp.float32)
    _, cache = gen.prefill(tiny_model, toks[:, :49], [49], cache, S)
    logits, _ = gen.decode_step(tiny_model, toks[:, 49], cache, S)
    np.testing.assert_allclose(np.asarray(logits)[0], _full_logits(tiny_model, toks)[0, -1], atol=2e-4)


def test_sampling_is_seeded_and_respects_top_k(tiny_model, rng):
    prompt = rng.integers(5, 128, 20).tolist()
    kw = dict(max_new_tokens=10, temperature=0.8, top_p=0.9, top_k=5)
    a = gen.generate(tiny_model, ToyTokenizer(), [prompt], S, seed=1, **kw)[0].token_ids
    b = gen.generate(tiny_model, ToyTokenizer(), [prompt], S, seed=1, **kw)[0].token_ids
    assert a == b
    logits = jnp.asarray(rng.normal(size=(4, 128)), jnp.float32)
    import jax

    picks = {int(t) for s in range(40) for t in gen.sample(logits, jax.random.key(s), 1.0, 1.0, 3)[:1]}
    top3 = set(np.argsort(-np.asarray(logits[0]))[:3].tolist())
    assert picks <= top3


def test_stop_string_truncates(tiny_model, rng):
    prompt = rng.integers(5, 128, 20).tolist()
    (full,) = gen.generate(tiny_model, ToyTokenizer(), [prompt], S, max_new_tokens=20)
    if len(full.text) < 4:
        pytest.skip("random model emitted EOS immediately")
    stop = full.text[2:4]
    (res,) = gen.generate(tiny_model, ToyTokenizer(), [prompt], S, max_new_tokens=20, stop=(stop,), segment=4)
    assert res.finish_reason == "stop" and res.text == full.text[:full.text.find(stop)]


def test_errors(tiny_model):
    tok = ToyTokenizer()
    with pytest.raises(ValueError, match="maximum context"):
        gen.generate(tiny_model, tok, [[5] * 1000], S, max_new_tokens=100)
    with pytest.raises(ValueError, match="maximum context"):
        gen.generate(tiny_model, tok, [[5] * 1100], S, max_new_tokens=1)
    cache = KVCache.init(tiny_model.config, 1, 64, jnp.float32)
    with pytest.raises(ValueError, match="cache holds"):
        gen.prefill(tiny_model, np.full((1, 100), 5), [100], cache, S)
    with pytest.raises(ValueError, match="chunk_size"):
        gen.prefill(tiny_model, np.full((1, 10), 5), [10], cache, S, chunk_size=100)
    with pytest.raises(ValueError, match="prompt_lens"):
        gen.prefill(tiny_model, np.full((1, 10), 5), [0], cache, S)
    with pytest.raises(ValueError, match="maximum context"):
        KVCache.init(tiny_model.config, 1, 5000)
    with pytest.raises(ValueError, match="temperature"):
        gen.generate(tiny_model, tok, ["hi"], S, temperature=-1.0)


def test_config_errors():
    with pytest.raises(ValueError, match="model_type"):
        tiny_config(model_type="gpt2")
    with pytest.raises(ValueError, match="rope scaling type"):
        tiny_config(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="multiple of"):
        tiny_config(num_key_value_heads=4)
    with pytest.raises(ValueError, match="hidden_act"):
        tiny_config(hidden_act="gelu")
    with pytest.raises(ValueError, match="sliding"):
        tiny_config(model_type="qwen2", use_sliding_window=True)
    assert tiny_config(model_type="qwen2").qkv_bias and tiny_config(model_type="qwen3").qk_norm


@pytest.mark.parametrize("kw,message", [
    (dict(temperature=float("nan")), r"temperature must be a finite number >= 0 \(0 = greedy\), got nan"),
    (dict(temperature=float("inf")), r"temperature must be a finite number >= 0 \(0 = greedy\), got inf"),
    (dict(top_p=float("nan")), r"top_p must be a finite number in \(0, 1\], got nan"),
    (dict(top_p=float("inf")), r"top_p must be a finite number in \(0, 1\], got inf"),
    (dict(top_p=0.0), r"top_p must be a finite number in \(0, 1\], got 0.0"),
    (dict(top_k=-1), r"top_k must be an int >= 0 \(0 = off\), got -1"),
    (dict(temperature=1.0, top_k=129), r"top_k=129 is larger than the vocabulary \(128 tokens\)"),
])
def test_sampling_errors(tiny_model, kw, message):
    """Rejected before any compile: nan passes `< 0` checks, and top_k > vocab would be a JAX top_k size error."""
    assert tiny_model.config.vocab == 128
    with pytest.raises(ValueError, match=message):
        gen.generate(tiny_model, ToyTokenizer(), [[5, 6, 7]], S, max_new_tokens=2, **kw)
    gen.check_sampling(1.0, 1.0, 128, vocab=128)  # the largest top_k is the vocabulary


class _CountingStrategy:
    """DenseStrategy with a cache state (models.attention.AttentionStrategy): every layer but the first counts the
    forwards it has seen, per sequence; layer 0's entry is None. `fresh` records, per attend, whether it got the
    entry update_cache_state had just returned (the model updates first)."""

    name = "counting"
    cache_state_lever = "counting"

    def __init__(self):
        self.last, self.fresh = None, []

    def init_cache_state(self, num_layers, batch, max_len, kv_heads, head_dim):
        return (None,) + tuple({"n": jnp.zeros((batch,), jnp.int32)} for _ in range(num_layers - 1))

    def update_cache_state(self, layer, inputs):
        self.last = {"n": inputs.cache_state["n"] + 1}
        return self.last

    def attend(self, layer, inputs, state):
        assert (inputs.cache_state is None) == (layer == 0)
        if layer:
            self.fresh.append(inputs.cache_state is self.last)
        return S.attend(layer, inputs, state)


def test_cache_state_lives_from_prefill_through_decode(tiny_model, rng):
    """prefill starts the strategy's cache state fresh, every forward (chunk or decode step) updates each layer's
    entry once, and the outputs are dense attention's."""
    st = _CountingStrategy()
    toks = rng.integers(5, 128, (2, 200)).astype(np.int32)
    lens = np.array([200, 90], np.int32)
    cache = KVCache.init(tiny_model.config, 2, 256, jnp.float32)
    cache = KVCache(cache.k, cache.v, cache.lengths, ("stale",) * 3)  # a previous prompt's state is replaced
    logits, cache = gen.prefill(tiny_model, toks, lens, cache, st, chunk_size=64)  # 4 chunks
    ref_logits, ref = gen.prefill(tiny_model, toks, lens, KVCache.init(tiny_model.config, 2, 256, jnp.float32), S)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-5, atol=1e-5)
    assert cache.strategy_state[0] is None and ref.strategy_state is None
    assert [np.asarray(e["n"]).tolist() for e in cache.strategy_state[1:]] == [[4, 4]] * 2
    tok = jnp.argmax(logits, -1)
    for step in range(2):
        logits, cache = gen.decode_step(tiny_model, tok, cache, st)
        tok = jnp.argmax(logits, -1)
    assert [np.asarray(e["n"]).tolist() for e in cache.strategy_state[1:]] == [[6, 6]] * 2
    assert st.fresh and all(st.fresh)
