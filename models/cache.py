"""Preallocated KV cache with per-sequence lengths.

Left-aligned: the token at absolute position p of sequence b lives at row p of every layer's buffer, so sequences of
different lengths share one buffer and `lengths[b]` says how much of row b is real. Prefill chunks write all sequences
at the same offset (rows past a sequence's length hold padding that `kv_len` masks, and decode overwrites); decode
writes each sequence at its own length.

`strategy_state` (None unless the strategy asks for one, models.attention.init_cache_state) holds a strategy's
per-layer entries that must live from prefill into every decode step; the model threads it, it never reads it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: tuple  # per layer [batch, max_len, kv_heads, head_dim]
    v: tuple  # per layer [batch, max_len, kv_heads, head_dim]
    lengths: jax.Array  # [batch] int32
    strategy_state: Any = None  # per layer, the strategy's cache-state entry (or None); None: no state

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @classmethod
    def init(cls, config: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> "KVCache":
        if max_len > config.max_position_embeddings:
            raise ValueError(f"cache max_len {max_len} exceeds the model's maximum context "
                             f"{config.max_position_embeddings}")
        if batch <= 0 or max_len <= 0:
            raise ValueError(f"cache batch and max_len must be positive, got batch={batch}, max_len={max_len}")
        shape = (batch, max_len, config.kv_heads, config.head_dim)
        zeros = lambda: jnp.zeros(shape, dtype)  # noqa: E731  (an empty cache; rows are masked by lengths)
        return cls(k=tuple(zeros() for _ in range(config.num_layers)),
                   v=tuple(zeros() for _ in range(config.num_layers)),
                   lengths=jnp.zeros((batch,), jnp.int32))


def write_chunk(buf, new, q_start: int):
    """Prefill: write new [batch, T, kv_heads, d] at rows q_start..q_start+T for every sequence."""
    return jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype), (0, q_start, 0, 0))


def write_token(buf, new, positions):
    """Decode: write new [batch, 1, kv_heads, d] at row positions[b] of each sequence (a position out of range,
    negative or past the end, is dropped on both paths). Batch 1 writes with a dynamic_update_slice, which XLA can
    fuse in place into the producer of `new`; the clamped row is rewritten with its own value when the position is
    out of range, as the scatter drops it."""
    new = new.astype(buf.dtype)
    if buf.shape[0] == 1:
        pos = jnp.asarray(positions, jnp.int32).reshape(())
        row = jnp.clip(pos, 0, buf.shape[1] - 1)
        old = jax.lax.dynamic_slice(buf, (0, row, 0, 0), new.shape)
        upd = jnp.where((pos >= 0) & (pos < buf.shape[1]), new, old)
        return jax.lax.dynamic_update_slice(buf, upd, (0, row, 0, 0))
    # .at[] wraps negative indices NumPy-style before mode="drop" applies: map them past the end so they drop too
    pos = jnp.asarray(positions, jnp.int32)
    pos = jnp.where(pos < 0, buf.shape[1], pos)
    return buf.at[jnp.arange(buf.shape[0]), pos].set(new[:, 0], mode="drop")
