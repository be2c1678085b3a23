"""The decode-overhead changes of issue 12 item 2 are exact: the batch-1 KV write (dynamic_update_slice) equals the
scatter it replaces bit for bit, and the tied-embedding logits in bf16 (no fp32 copy of the embedding matrix) equal
the fp32-upcast dot up to the fp32 summation order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.cache import write_token


def _scatter(buf, new, positions):
    """The stated semantics in NumPy: row positions[b] of sequence b := new[b, 0]; out of range (negative or past
    the end) dropped."""
    out = np.array(buf)
    for b, p in enumerate(np.asarray(positions)):
        if 0 <= p < out.shape[1]:
            out[b, p] = np.asarray(new[b, 0].astype(buf.dtype))
    return out


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_write_token_batch1_equals_scatter(rng, dtype):
    max_len, kvh, d = 37, 2, 8
    buf = jnp.asarray(rng.standard_normal((1, max_len, kvh, d)), dtype)
    new = jnp.asarray(rng.standard_normal((1, 1, kvh, d)), jnp.float32)  # cast to the cache dtype on write
    write = jax.jit(write_token)
    for p in (0, 1, int(rng.integers(2, max_len - 1)), max_len - 1, max_len, max_len + 5, -1, -3):  # out: dropped
        pos = jnp.asarray([p], jnp.int32)
        got, want = write(buf, new, pos), _scatter(buf, new, pos)
        assert got.dtype == buf.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.array_equal(np.asarray(write(buf, new, jnp.asarray([3]))), np.asarray(buf))  # it did write


def test_write_token_batched_unchanged(rng):
    buf = jnp.asarray(rng.standard_normal((3, 20, 2, 4)), jnp.bfloat16)
    new = jnp.asarray(rng.standard_normal((3, 1, 2, 4)), jnp.bfloat16)
    for pos in ([0, 19, 20], [-1, 5, -20], [7, -3, 25]):  # negatives drop as on the batch-1 path (no wrap)
        pos = jnp.asarray(pos, jnp.int32)
        np.testing.assert_array_equal(np.asarray(jax.jit(write_token)(buf, new, pos), np.float32),
                                      np.asarray(_scatter(buf, new, pos), np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_tied_logits_match_the_fp32_dot(rng, dtype):
    from models.params import random_model
    from tests.conftest import tiny_config

    model = random_model(tiny_config(vocab_size=300, hidden_size=96), seed=int(rng.integers(1 << 20)), dtype=dtype)
    assert model.lm_head is None
    x = jnp.asarray(rng.standard_normal((2, 3, 96)), dtype)
    got = jax.jit(model.logits)(x)
    emb = model.embed_tokens.embedding[...]
    want = jnp.dot(x.astype(jnp.float32), emb.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    assert got.dtype == jnp.float32 and got.shape == (2, 3, 300)
    if dtype == jnp.float32:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:  # the same exact products, summed in fp32 in possibly another order
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_untied_logits_unchanged(rng):
    from models.params import random_model
    from tests.conftest import tiny_config

    model = random_model(tiny_config(tie_word_embeddings=False), seed=3, dtype=jnp.bfloat16)
    kernel = np.asarray(model.lm_head.kernel[...], np.float32)
    for shape in ((1, 64), (1, 1, 64), (3, 64)):  # one row (the padded-GEMM path) and several
        x = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        got = np.asarray(jax.jit(model.logits)(x))
        want = np.asarray(x, np.float32) @ kernel  # explicit fp32 product of the bf16 values
        assert got.dtype == np.float32 and got.shape == shape[:-1] + (kernel.shape[1],)
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())  # bf16 output rounding
