"""Dense attention behind one call: cuDNN flash attention on NVIDIA GPUs, the pure-JAX reference elsewhere.

cuDNN (`jax.nn.dot_product_attention(implementation="cudnn")`) only knows top-left-aligned causal masks, so it
serves prefill chunks that start at position 0 and decode steps (one query that sees every valid key). A chunk at
an offset goes, on a GPU, to the Pallas flash pass `kernels_pallas.prefill.dense_prefill` (bf16/fp16, head_dim
64/128): the reference would materialise [batch, heads, chunk, keys] fp32 scores (408 GiB for 32 prompts of 16K
in 8K chunks on the 0.5B). Everything else (lse requested, CPU) uses the reference, which is exact.
`decode_kernel="pallas"` (DenseStrategy's option) sends decode steps to the split-K Pallas kernel
`kernels_pallas.decode.dense_decode` instead of cuDNN, on a GPU where it applies (bf16/fp16, head_dim 64/128).
Paged caches go through `kernels_pallas.paged.dense_attention_paged`, not here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.decode import dense_decode, pallas_supported as decode_supported
from kernels_pallas.prefill import dense_prefill, dense_prefill_supported
from kernels_pallas.reference import attention_reference


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def cudnn_ok(q, k) -> bool:
    return on_gpu() and q.dtype in (jnp.bfloat16, jnp.float16) and k.dtype == q.dtype and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


DECODE_KERNELS = ("cudnn", "pallas")


def dense_attention(q, k, v, q_start, kv_len, *, phase: str, chunk_at_zero: bool, return_lse=False, scale=None,
                    decode_kernel: str = "cudnn"):
    """q [batch, q_len, q_heads, d], k/v [batch, keys, kv_heads, d] -> out (and lse [batch, q_len, q_heads]).

    decode_kernel: "cudnn" (default) or "pallas", the split-K `kernels_pallas.decode.dense_decode` for decode steps
    on a GPU where that kernel applies (bf16/fp16, head_dim 64/128; elsewhere the choice below); prefill is
    unaffected."""
    if decode_kernel not in DECODE_KERNELS:
        raise ValueError(f"decode_kernel must be one of {DECODE_KERNELS}, got {decode_kernel!r}")
    if phase == "decode" and decode_kernel == "pallas" and not return_lse and on_gpu() and decode_supported(q, k, v):
        return dense_decode(q, k, v, kv_len, scale=scale, impl="pallas")
    if not return_lse and cudnn_ok(q, k):
        if phase == "decode":
            return jax.nn.dot_product_attention(q, k, v, scale=scale, key_value_seq_lengths=kv_len, implementation="cudnn")
        if chunk_at_zero:
            t = q.shape[1]
            kk, vv = k[:, :t], v[:, :t]
            return jax.nn.dot_product_attention(
                q, kk, vv, scale=scale, is_causal=True, query_seq_lengths=jnp.minimum(kv_len, t),
                key_value_seq_lengths=jnp.minimum(kv_len, t), implementation="cudnn")
    if phase == "prefill" and not return_lse and on_gpu() and dense_prefill_supported(q, k):
        return dense_prefill(q, k, v, q_start, kv_len, scale=scale, impl="pallas")
    return attention_reference(q, k, v, q_start, kv_len, scale=scale, return_lse=return_lse)
