"""The one-row (decode at batch 1) matmul padding of models.transformer: same values, and the dot really runs on
two rows (XLA's one-row rewrite to multiply + reduce ran at half the H200's bandwidth; benchmarks/NOTES.md)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.transformer import Linear, _two_rows


def test_one_row_values_match_plain_linear():
    lin = Linear(24, 40, use_bias=True, rngs=nnx.Rngs(3), precision=jax.lax.Precision.HIGHEST)
    plain = nnx.Linear(24, 40, use_bias=True, rngs=nnx.Rngs(3), precision=jax.lax.Precision.HIGHEST)
    for shape in [(1, 1, 24), (1, 24), (24,), (3, 1, 24), (2, 5, 24)]:
        x = jax.random.normal(jax.random.key(sum(shape)), shape)
        got, want = lin(x), plain(x)
        assert got.shape == want.shape == shape[:-1] + (40,)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_one_row_dot_is_lowered_on_two_rows():
    w = jax.random.normal(jax.random.key(0), (16, 8))
    text = jax.jit(lambda x: _two_rows(lambda h: h @ w, x)).lower(jnp.ones((1, 1, 16))).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert dots and all("tensor<2x16xf32>" in line for line in dots), dots
    many = jax.jit(lambda x: _two_rows(lambda h: h @ w, x)).lower(jnp.ones((3, 16))).as_text()
    assert "tensor<2x16xf32>" not in many and "tensor<3x16xf32>" in many
