"""The one attention interface every decoder layer goes through (see models/README.md)."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax

from kernels_pallas.dense import DECODE_KERNELS, dense_attention
from kernels_pallas.paged import dense_attention_paged


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
    # Paged cache (models/paged.py): [batch, max_pages] int32, and then k_cache / v_cache are this layer's page
    # pools [num_pages, page_size, kv_heads, head_dim]. None = the contiguous cache above.
    page_table: jax.Array | None = None
    shards: ShardLayout | None = dataclasses.field(default=None, metadata=dict(static=True))  # None: all heads here
    cache_state: Any = None  # this layer's entry of the strategy's cache state (KVCache.strategy_state); None: none


class AttentionStrategy(Protocol):
    name: str

    def attend(self, layer: int, inputs: AttentionInputs, state: Any) -> tuple[jax.Array, Any]: ...

    def post_attention(self, layer: int, x: jax.Array, attn_out: jax.Array, state: Any) -> Any: ...

    # Optional: `supports_paged = True` (a class attribute) to accept a paged cache (models/paged.py); without it
    # the Transformer refuses one (check_supports_paged).
    # Optional: `prefill_is_dense` (True: its prefill is exactly DenseStrategy's, dense attention in every layer and
    # no state carried into decode), so that models.generate.generate_shared_prefill may run it from a prefill
    # shared with other such strategies. Absent means False.
    # Optional, needed to run on a mesh (models/sharding.py): the PartitionSpec tree of the state that
    # attend(layer, ...) returns, given the layout (P() for a state that stays None).
    # def state_spec(self, layer: int, phase: str, shards: ShardLayout) -> Any: ...
    # Optional, a state that lives in the KV cache across forwards (prefill into every decode step):
    # init_cache_state(num_layers, batch, max_len, kv_heads=, head_dim=) -> a tuple of one entry per layer (an entry
    # may be None) or None (none needed); `models.generate.prefill` puts it in KVCache.strategy_state. For each layer
    # whose entry is not None the model stores update_cache_state(layer, inputs) (inputs.cache_state: the stored
    # entry) as the new entry (fixed shapes) before attend, and attend gets that new entry as inputs.cache_state.
    # `cache_state_lever` (a str, None when no state is needed) names it in refusals: a mesh does not carry a cache
    # state yet (check_no_cache_state). Paged caches and the engine carry one made with init_cache_state(...,
    # pages=(num_pages, page_size)) (models/paged.py: its [num_pages, page_size, ...] leaves are page pools) when the
    # strategy's `paged_cache_state_lever` (default: cache_state_lever) is None: it then names what has no paged form.


def init_cache_state(strategy, num_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                     pages: tuple[int, int] | None = None):
    """The strategy's fresh cache state (see AttentionStrategy), or None for strategies without one; pages=(num_pages,
    page_size) for a paged cache (its pools then hold the per-token entries)."""
    fn = getattr(strategy, "init_cache_state", None)
    if fn is None:
        return None
    if pages is None:
        return fn(num_layers, batch, max_len, kv_heads=kv_heads, head_dim=head_dim)
    return fn(num_layers, batch, max_len, kv_heads=kv_heads, head_dim=head_dim, pages=pages)


def check_no_cache_state(strategy, where: str, *, paged: bool = False) -> None:
    """Refuse a strategy that needs a cache state where none is carried (`where`: "paged caches", "the engine",
    "a mesh"), with a ValueError naming the lever; paged=True refuses only the levers without a paged form
    (`paged_cache_state_lever`)."""
    lever = getattr(strategy, "cache_state_lever", None)
    if paged:
        lever = getattr(strategy, "paged_cache_state_lever", lever)
    if lever:
        raise ValueError(f"{lever} is not implemented for {where} yet; use the contiguous KVCache on one device, or "
                         f"a strategy without {lever}")


def check_supports_paged(strategy) -> None:
    """Paged caches are opt-in: a strategy that does not set `supports_paged = True` would receive the page pools
    [num_pages, page_size, kv_heads, d] as k_cache / v_cache and misread them (a shape error, or, when num_pages
    equals the batch, page b silently taken as sequence b). Raises a ValueError naming the strategy."""
    if not getattr(strategy, "supports_paged", False):
        name = getattr(strategy, "name", type(strategy).__name__)
        raise ValueError(f"strategy {name!r} ({type(strategy).__name__}) does not support a paged KV cache "
                         "(it does not set supports_paged = True); use the contiguous KVCache (paged caches serve "
                         "the dense and kascade strategies)")


@dataclasses.dataclass(frozen=True)
class DenseStrategy:
    """Exact causal attention in every layer (cuDNN on GPU where it applies). decode_kernel="pallas" runs decode
    steps through the split-K Pallas kernel instead (kernels_pallas.decode.dense_decode; A/B in bench --phase=e2e).
    With a paged cache (models/paged.py) decode_kernel is ignored: decode always reads through the page table
    (kernels_pallas.paged.dense_decode, the Pallas kernel on GPU, the gather reference elsewhere)."""

    supports_paged = True  # class attribute (not a field): paged caches are opt-in (check_supports_paged)
    prefill_is_dense = True  # class attribute: see AttentionStrategy
    name: str = "dense"
    decode_kernel: str = "cudnn"

    def __post_init__(self):
        if self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel must be one of {DECODE_KERNELS}, got {self.decode_kernel!r}")

    def attend(self, layer, inputs: AttentionInputs, state):
        if inputs.page_table is not None:
            out = dense_attention_paged(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table, inputs.q_start,
                                        inputs.kv_len, phase=inputs.phase, chunk_at_zero=inputs.chunk_at_zero)
            return out, state
        out = dense_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.q_start, inputs.kv_len,
                              phase=inputs.phase, chunk_at_zero=inputs.chunk_at_zero,
                              decode_kernel=self.decode_kernel)
        return out, state

    def post_attention(self, layer, x, attn_out, state):
        return state

    def state_spec(self, layer, phase, shards):
        return jax.sharding.PartitionSpec()  # no state: every head's attention is local
