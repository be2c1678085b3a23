"""The decode_rerank lever's candidate-logits kernel (kernels_pallas.decode.candidate_logits) against its reference:
interpret mode at small shapes (candidates not a multiple of the block, -1 entries, candidates past kv_len, group 7
and 3, d 64 and 128, bf16 and fp16), the Triton module verified for sm_90 on the CPU, and the one-line errors."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels_pallas import decode as dec


def _case(seed, b, s, hq, kvh, d, c, dtype):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, 1, hq, d)) * 2, dtype)
    k = jnp.asarray(rng.standard_normal((b, s, kvh, d)), dtype)
    kv_len = np.array([s] + [int(rng.integers(s // 2, s)) for _ in range(b - 1)], np.int32)
    cand = np.full((b, kvh, c), -1, np.int32)
    for bi in range(b):
        for h in range(kvh):
            n = c - 17 * bi  # fewer candidates in later sequences: -1 past them
            cand[bi, h, :n] = rng.choice(s, n, replace=False)  # some past kv_len: never valid
    return q, k, jnp.asarray(kv_len), jnp.asarray(cand)


@pytest.mark.parametrize("hq,kvh,d,c,dtype", [(14, 2, 64, 300, jnp.bfloat16), (6, 2, 128, 129, jnp.float16)])
def test_candidate_logits_match_the_reference(hq, kvh, d, c, dtype):
    q, k, kv_len, cand = _case(0, 3, 512, hq, kvh, d, c, dtype)
    got = np.asarray(dec.candidate_logits(q, k, kv_len, cand, impl="pallas", interpret=True, block=64))
    want = np.asarray(dec.candidate_logits(q, k, kv_len, cand, impl="reference"))
    assert got.shape == (3, kvh, hq // kvh, c)
    cn = np.asarray(cand)
    valid = (cn >= 0) & (cn < np.asarray(kv_len)[:, None, None])
    assert 0 < valid.sum() < valid.size  # the case has both
    np.testing.assert_array_equal(np.isneginf(got), np.broadcast_to(~valid[:, :, None, :], got.shape))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=2e-3, atol=2e-3)
    # the logits are the scaled dot products of the candidates' own K rows
    bi, h, j = 0, 1, int(np.flatnonzero(valid[0, 1])[0])
    g = hq // kvh
    row = np.asarray(k, np.float32)[bi, cn[bi, h, j], h]
    qs = np.asarray(q, np.float32)[bi, 0, h * g:(h + 1) * g]
    np.testing.assert_allclose(got[bi, h, :, j], qs @ row / np.sqrt(d), rtol=2e-3, atol=2e-3)


def test_candidate_logits_lower_for_sm90(triton_sm90_modules):
    q = jax.ShapeDtypeStruct((4, 1, 14, 64), jnp.bfloat16)
    kc = jax.ShapeDtypeStruct((4, 16384, 2, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((4,), jnp.int32)
    cand = jax.ShapeDtypeStruct((4, 2, 6554), jnp.int32)
    fn = lambda q, k, l, c: dec.candidate_logits(q, k, l, c, impl="pallas")
    jax.jit(fn).trace(q, kc, kv, cand).lower(lowering_platforms=("cuda",))
    assert len(triton_sm90_modules) == 1


def test_candidate_logits_errors():
    q, k, kv_len, cand = _case(0, 2, 64, 4, 2, 64, 20, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"cand must have shape \[batch, kv_heads, C\]"):
        dec.candidate_logits(q, k, kv_len, cand[:, :1])
    with pytest.raises(ValueError, match="kv_len"):
        dec.candidate_logits(q, k, kv_len[:1], cand)
