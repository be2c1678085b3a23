"""The one attention interface every decoder layer goes through (see models/README.md)."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax

from kernels_pallas.dense import dense_attention


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """How attention is split when it runs per shard of a mesh (models/sharding.py): the mesh axis the batch is
    split over and the one the heads are split over (None: not split), and into how many head shards. The arrays
    of AttentionInputs are then the shard's local blocks."""

    batch_axis: str | None = None
    head_axis: str | None = None
    head_shards: int = 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    q: jax.Array  # [batch, q_len, q_heads, head_dim], RoPE applied
    k_cache: jax.Array  # [batch, max_len, kv_heads, head_dim], this call's keys already written
    v_cache: jax.Array  # [batch, max_len, kv_heads, head_dim]
    q_start: jax.Array  # [batch] int32, absolute position of q[:, 0]
    kv_len: jax.Array  # [batch] int32, valid keys for this call
    seq_len: jax.Array  # [batch] int32, the sequence's full length in this phase (prompt length in prefill)
    phase: str = dataclasses.field(metadata=dict(static=True))  # "prefill" | "decode"
    chunk_at_zero: bool = dataclasses.field(default=True, metadata=dict(static=True))  # prefill chunk starts at 0
    shards: ShardLayout | None = dataclasses.field(default=None, metadata=dict(static=True))  # None: all heads here


class AttentionStrategy(Protocol):
    name: str

    def attend(self, layer: int, inputs: AttentionInputs, state: Any) -> tuple[jax.Array, Any]: ...

    def post_attention(self, layer: int, x: jax.Array, attn_out: jax.Array, state: Any) -> Any: ...

    # Optional, needed to run on a mesh (models/sharding.py): the PartitionSpec tree of the state that
    # attend(layer, ...) returns, given the layout (P() for a state that stays None).
    # def state_spec(self, layer: int, phase: str, shards: ShardLayout) -> Any: ...


@dataclasses.dataclass(frozen=True)
class DenseStrategy:
    """Exact causal attention in every layer (cuDNN on GPU where it applies)."""

    name: str = "dense"

    def attend(self, layer, inputs: AttentionInputs, state):
        out = dense_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.q_start, inputs.kv_len,
                              phase=inputs.phase, chunk_at_zero=inputs.chunk_at_zero)
        return out, state

    def post_attention(self, layer, x, attn_out, state):
        return state

    def state_spec(self, layer, phase, shards):
        return jax.sharding.PartitionSpec()  # no state: every head's attention is local
