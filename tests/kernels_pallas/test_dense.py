"""Dense attention: the pure-JAX reference against a float64 numpy loop, and cuDNN against the reference (GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.dense import dense_attention
from kernels_pallas.reference import attention_reference


def _numpy_attention(q, k, v, q_start, kv_len):
    b, t, hq, d = q.shape
    g = hq // k.shape[2]
    out = np.zeros((b, t, hq, d))
    lse = np.zeros((b, t, hq))
    for bi in range(b):
        for ti in range(t):
            p = q_start[bi] + ti
            n = min(p + 1, kv_len[bi])
            for h in range(hq):
                s = k[bi, :n, h // g].astype(np.float64) @ q[bi, ti, h].astype(np.float64) / np.sqrt(d)
                m = s.max()
                w = np.exp(s - m)
                out[bi, ti, h] = w @ v[bi, :n, h // g] / w.sum()
                lse[bi, ti, h] = m + np.log(w.sum())
    return out, lse


@pytest.mark.parametrize("group", [1, 3, 4])
def test_reference_matches_numpy(rng, group):
    b, t, kvh, d, s = 2, 9, 2, 16, 40
    q = rng.normal(size=(b, t, kvh * group, d)).astype(np.float32)
    k = rng.normal(size=(b, s, kvh, d)).astype(np.float32) * 2  # peaky-ish
    v = rng.normal(size=(b, s, kvh, d)).astype(np.float32)
    q_start = np.array([0, 21])
    kv_len = np.array([9, 27])
    out, lse = attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(q_start),
                                   jnp.asarray(kv_len), return_lse=True)
    ref_out, ref_lse = _numpy_attention(q, k, v, q_start, kv_len)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_cudnn_matches_reference(rng, dtype):
    b, t, hq, kvh, d = 2, 1024, 32, 8, 128
    q = jnp.asarray(rng.normal(size=(b, t, hq, d)), dtype)
    k = jnp.asarray(rng.normal(size=(b, t + 256, kvh, d)), dtype)
    v = jnp.asarray(rng.normal(size=(b, t + 256, kvh, d)), dtype)
    kv_len = jnp.array([t, 700], jnp.int32)
    zero = jnp.zeros((b,), jnp.int32)
    out = dense_attention(q, k, v, zero, kv_len, phase="prefill", chunk_at_zero=True)
    ref = attention_reference(q, k, v, zero, kv_len)
    valid = (jnp.arange(t)[None, :] < kv_len[:, None])[:, :, None, None]
    err = jnp.abs(jnp.where(valid, out.astype(jnp.float32) - ref.astype(jnp.float32), 0)).max()
    assert float(err) < 2e-2
    kv_dec = jnp.array([t + 256, 333], jnp.int32)
    qd = q[:, :1]
    out = dense_attention(qd, k, v, kv_dec - 1, kv_dec, phase="decode", chunk_at_zero=False)
    ref = attention_reference(qd, k, v, kv_dec - 1, kv_dec)
    assert float(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32)).max()) < 2e-2
    assert jax.default_backend() == "gpu"
