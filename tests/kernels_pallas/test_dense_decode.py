"""Split-K Pallas dense decode (kernels_pallas.decode.dense_decode) against the dense reference, and the
DenseStrategy(decode_kernel="pallas") switch: CPU interpret mode at tiny shapes, Triton lowering verified for sm_90,
and a GPU tier at a realistic shape against cuDNN. Outputs: every (sequence, head) row's RMS error within TOL of the
output's RMS, a few times the measured noise (bf16 <= 3.9e-3, fp16 <= 4.9e-4 over seeds 0-3), fixed seeds; a 3%
softmax-scale error in the kernel fails every case (checked by planting it)."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels_pallas import decode as dec
from kernels_pallas import reference as ref
from kernels_pallas.dense import dense_attention
from tests.kernels_pallas.errors import row_err_global as _row_err


TOL = {jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3}  # per-row error / output RMS


def _inputs(seed, b, s, hq, kvh, d, dtype, peaky):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, 1, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, s, kvh, d)).astype(np.float32)
    v = rng.standard_normal((b, s, kvh, d)).astype(np.float32)
    if peaky:
        qm = q.reshape(b, kvh, hq // kvh, d).mean(axis=2)
        for bi in range(b):
            for h in range(kvh):
                k[bi, rng.integers(0, s, 5), h] = 3.0 * qm[bi, h]
    kv_len = rng.integers(1, s + 1, size=b).astype(np.int32)
    kv_len[0] = s
    return jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(kv_len)


@pytest.mark.parametrize("case", [
    dict(b=3, s=300, hq=6, kvh=2, d=64, dtype=jnp.bfloat16, peaky=True, vs_anchor=True),  # group 3, ragged
    dict(b=1, s=520, hq=8, kvh=2, d=64, dtype=jnp.float16, peaky=False),   # batch 1: several splits per KV head
    dict(b=2, s=12, hq=4, kvh=4, d=64, dtype=jnp.bfloat16, peaky=False),   # a cache shorter than one block (padded)
])
def test_dense_decode_matches_reference(case):
    peaky, vs_anchor = case.pop("peaky"), case.pop("vs_anchor", False)
    q, k, v, kv_len = _inputs(0, peaky=peaky, **case)
    tuning = dec.DecodeTuning(stream_block=16, target_programs=16)  # several splits at these tiny shapes
    out = jax.jit(lambda *a: dec.dense_decode(*a, impl="pallas", interpret=True, tuning=tuning))(q, k, v, kv_len)
    want = ref.attention_reference(q, k, v, kv_len - 1, kv_len)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert _row_err(out, want) < TOL[out.dtype]
    if not vs_anchor:
        return
    # the same numbers as the anchor-0 pass that also writes logits (same kernel body, same splits)
    out0, _, _ = jax.jit(lambda *a: dec.anchor_decode(*a, topk_frac=0.5, min_k=1, k_max=case["s"], impl="pallas",
                                                      dense_out=True, interpret=True, tuning=tuning))(q, k, v, kv_len)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out0, np.float32))


def test_dense_decode_zero_length_row_and_errors():
    q, k, v, _ = _inputs(1, 2, 40, 4, 2, 64, jnp.bfloat16, False)
    kv_len = jnp.asarray([0, 40], jnp.int32)
    out = dec.dense_decode(q, k, v, kv_len, impl="pallas", interpret=True,
                           tuning=dec.DecodeTuning(stream_block=16, target_programs=8))
    assert np.all(np.asarray(out[0], np.float32) == 0)
    assert _row_err(out[1:], ref.attention_reference(q, k, v, kv_len - 1, kv_len)[1:]) < TOL[out.dtype]
    with pytest.raises(ValueError, match="q must be"):
        dec.dense_decode(jnp.concatenate([q, q], axis=1), k, v, kv_len, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="head_dim"):
        dec.dense_decode(q[..., :32], k[..., :32], v[..., :32], kv_len, impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="decode_kernel"):
        dense_attention(q, k, v, kv_len - 1, kv_len, phase="decode", chunk_at_zero=False, decode_kernel="triton")


def test_dense_strategy_decode_kernel():
    from models.attention import AttentionInputs, DenseStrategy

    with pytest.raises(ValueError, match="decode_kernel"):
        DenseStrategy(decode_kernel="flash")
    q, k, v, kv_len = _inputs(2, 2, 64, 4, 2, 64, jnp.float32, True)
    inputs = AttentionInputs(q=q, k_cache=k, v_cache=v, q_start=kv_len - 1, kv_len=kv_len, seq_len=kv_len,
                             phase="decode", chunk_at_zero=False)
    a, _ = DenseStrategy().attend(0, inputs, None)
    b, _ = DenseStrategy(decode_kernel="pallas").attend(0, inputs, None)  # off the GPU: the reference
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
    assert hash(DenseStrategy(decode_kernel="pallas")) != hash(DenseStrategy())


def test_dense_decode_triton_verifies_for_sm90(triton_sm90_modules):
    q = jax.ShapeDtypeStruct((1, 1, 32, 128), jnp.bfloat16)
    kc = jax.ShapeDtypeStruct((1, 5000, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1,), jnp.int32)
    jax.jit(lambda q, k, v, l: dec.dense_decode(q, k, v, l, impl="pallas")).trace(q, kc, kc, kv).lower(
        lowering_platforms=("cuda",))
    assert len(triton_sm90_modules) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 8])
def test_gpu_dense_decode_vs_cudnn(b):
    q, k, v, kv_len = _inputs(3, b, 32768, 32, 8, 128, jnp.bfloat16, True)
    out = jax.jit(lambda *a: dec.dense_decode(*a, impl="pallas"))(q, k, v, kv_len)
    cudnn = jax.jit(lambda *a: dense_attention(*a[:3], a[3] - 1, a[3], phase="decode", chunk_at_zero=False))(q, k, v, kv_len)
    assert _row_err(out, ref.attention_reference(q, k, v, kv_len - 1, kv_len)) < TOL[out.dtype]
    assert _row_err(out, cudnn) < TOL[out.dtype]
