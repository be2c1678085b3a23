"""Dense attention: the pure-JAX reference against a float64 numpy loop, and cuDNN against the reference (GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.dense import dense_attention
from kernels_pallas.reference import attention_reference
from tests.kernels_pallas.errors import row_err_relative as _row_err

SEED = 515  # fixed: whether a planted error is detected must not depend on the draw


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
def test_reference_matches_numpy(group):
    rng = np.random.default_rng(SEED + group)
    b, t, kvh, d, s = 2, 9, 2, 16, 40
    q = rng.normal(size=(b, t, kvh * group, d)).astype(np.float32)
    k = rng.normal(size=(b, s, kvh, d)).astype(np.float32) * 2  # peaky-ish
    v = rng.normal(size=(b, s, kvh, d)).astype(np.float32)
    q_start = np.array([0, 21])
    kv_len = np.array([9, 27])
    out, lse = attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(q_start),
                                   jnp.asarray(kv_len), return_lse=True)
    ref_out, ref_lse = _numpy_attention(q, k, v, q_start, kv_len)
    print(f"per-row error {_row_err(out, ref_out):.2e}, lse {np.abs(np.asarray(lse) - ref_lse).max():.2e}")
    assert _row_err(out, ref_out) < 3e-6  # measured 4.9e-7 to 6.3e-7 (fp32 against float64)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=4e-6, rtol=0)  # measured 8.1e-7 at most


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 1.5e-2), (jnp.float16, 2e-3)])
def test_cudnn_matches_reference(dtype, tol):
    """Per-row error bounds at about 4x the error of a flash-attention emulation at this shape on CPU (probabilities
    rounded to the input dtype before P.V, output rounded: bf16 4.1e-3 prefill / 3.3e-3 decode, fp16 5.3e-4 / 3.9e-4);
    a 3% error in the softmax scale gives 0.10 prefill / 0.08 decode."""
    rng = np.random.default_rng(SEED)
    b, t, hq, kvh, d = 2, 1024, 32, 8, 128
    exact = jax.default_matmul_precision("float32")  # the reference in full fp32 (GPU fp32 matmuls default to TF32)
    q = jnp.asarray(rng.normal(size=(b, t, hq, d)), dtype)
    k = jnp.asarray(rng.normal(size=(b, t + 256, kvh, d)), dtype)
    v = jnp.asarray(rng.normal(size=(b, t + 256, kvh, d)), dtype)
    kv_len = jnp.array([t, 700], jnp.int32)
    zero = jnp.zeros((b,), jnp.int32)
    out = dense_attention(q, k, v, zero, kv_len, phase="prefill", chunk_at_zero=True)
    with exact:
        ref = attention_reference(q, k, v, zero, kv_len)
    valid = np.arange(t)[None, :] < np.asarray(kv_len)[:, None]  # rows past kv_len are padding
    err = _row_err(np.asarray(out, np.float32)[valid], np.asarray(ref, np.float32)[valid])
    kv_dec = jnp.array([t + 256, 333], jnp.int32)
    qd = q[:, :1]
    out = dense_attention(qd, k, v, kv_dec - 1, kv_dec, phase="decode", chunk_at_zero=False)
    with exact:
        err_dec = _row_err(out, attention_reference(qd, k, v, kv_dec - 1, kv_dec))
    print(f"cuDNN {jnp.dtype(dtype).name}: per-row error prefill {err:.2e}, decode {err_dec:.2e}")
    assert err < tol and err_dec < tol
    assert jax.default_backend() == "gpu"
