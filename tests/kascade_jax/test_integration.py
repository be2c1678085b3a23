"""Strategies inside the real (tiny, random) model: prefill/decode/generate consistency."""

import jax.numpy as jnp
import numpy as np
import pytest

from kascade_jax.registry import make_strategy
from models import generate as gen
from models.attention import DenseStrategy
from models.cache import KVCache


class ToyTokenizer:
    eos_token_ids = ()  # never stop early: fixed-length generations compare token by token

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


def _full_budget(model, name="kascade"):
    cfg = model.config
    return make_strategy(name, cfg.num_layers, cfg.kv_heads, anchors=(0, 2), topk_frac=1.0, min_k=1, tile_size=16)


def _sparse(model, name="kascade"):
    cfg = model.config
    head_map = ((0, 1), (1, 1), (0, 1))
    return make_strategy(name, cfg.num_layers, cfg.kv_heads, anchors=(0, 2), head_map=head_map, topk_frac=0.1,
                         min_k=8, tile_size=16)


def test_full_budget_generation_equals_dense(tiny_model, rng):
    prompts = [rng.integers(5, 128, n).tolist() for n in (150, 97)]
    dense = gen.generate(tiny_model, ToyTokenizer(), prompts, DenseStrategy(), max_new_tokens=8, chat=False)
    for name in ("kascade", "all_heads_pooled"):
        sparse = gen.generate(tiny_model, ToyTokenizer(), prompts, _full_budget(tiny_model, name), max_new_tokens=8,
                              chat=False)
        assert [r.token_ids for r in sparse] == [r.token_ids for r in dense]


@pytest.mark.parametrize("which", ["dense", "kascade_full_budget"])
def test_decode_after_prefill_equals_longer_prefill(tiny_model, rng, which):
    strategy = DenseStrategy() if which == "dense" else _full_budget(tiny_model)
    toks = rng.integers(5, 128, (2, 101))
    lens = np.array([100, 71])
    cache = KVCache.init(tiny_model.config, 2, 128, jnp.float32)
    _, cache = gen.prefill(tiny_model, toks, lens, cache, strategy, chunk_size=64)
    nxt = toks[np.arange(2), lens]  # the token after each prompt
    logits_dec, _ = gen.decode_step(tiny_model, nxt, cache, strategy)
    cache2 = KVCache.init(tiny_model.config, 2, 128, jnp.float32)
    logits_pre, _ = gen.prefill(tiny_model, toks, lens + 1, cache2, strategy, chunk_size=64)
    np.testing.assert_allclose(np.asarray(logits_dec), np.asarray(logits_pre), atol=2e-4, rtol=2e-4)


def test_sparse_batch_with_different_lengths_equals_single(tiny_model, rng):
    """Real selection (k < L): batching right-padded prompts of different lengths changes nothing."""
    strategy = _sparse(tiny_model)
    toks = rng.integers(5, 128, (2, 200))
    lens = [200, 133]

    def run(tokens, prompt_lens):
        b = tokens.shape[0]
        cache = KVCache.init(tiny_model.config, b, 256, jnp.float32)
        logits, cache = gen.prefill(tiny_model, tokens, prompt_lens, cache, strategy)
        out = [np.asarray(logits)]
        for step in range(2):
            logits, cache = gen.decode_step(tiny_model, np.full((b,), 7 + step), cache, strategy)
            out.append(np.asarray(logits))
        return out

    batched = run(toks, lens)
    for i, n in enumerate(lens):
        single = run(toks[i:i + 1, :n], [n])
        for lb, ls in zip(batched, single):
            np.testing.assert_allclose(lb[i:i + 1], ls, atol=2e-4, rtol=2e-4)
    # and the selection is really sparse: outputs differ from dense
    cache = KVCache.init(tiny_model.config, 2, 256, jnp.float32)
    dense_logits, _ = gen.prefill(tiny_model, toks, lens, cache, DenseStrategy())
    assert not np.allclose(np.asarray(dense_logits), batched[0], atol=1e-3)
