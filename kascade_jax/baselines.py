"""The comparison strategies of the paper, as exact boolean masks over `attention_reference`.

Each baseline is a frozen dataclass implementing the models' attention interface. Defaults are the paper's
settings; budgets use the same exact integer rule as Kascade,
`topk_budget(L, frac, min) = min(max(floor(frac * L), min), L)`:
- `dense`: `models.attention.DenseStrategy` (re-exported).
- `StreamingLLMStrategy`: 4 sink tokens + a causal window of the most recent keys; the window (sinks
  included) is topk_budget(seq_len, 0.30, 128), in prefill and decode (seq_len = prompt length in prefill). Its
  prefill runs in blocks of query rows (`score_elems` fp32 scores each), so a long batch fits in memory.
- `QuestStrategy` (decode only): 16-token pages, per-page key min/max bounds, upper-bound page score
  Σ_d max(q_d·min_d, q_d·max_d) per query head, top max(3, budget // 16) pages with budget =
  topk_budget(kv_len, 0.10, 128); layers < `dense_layers` (2) dense. Partial and last pages are scored like
  any page over their valid keys only.
- `OmniKVStrategy` (decode only): layers < 2, the filter layers and the layer after each filter are dense; a
  filter layer max-pools its post-softmax probabilities over all query heads and keeps the top
  topk_budget(kv_len, 0.10, 128) keys, shared by every head of the following layers.
- `LessIsMoreStrategy` (decode only): layers before the first selection layer are dense; selection layers are
  dense and store a set of budget = topk_budget(kv_len, 0.10, 128) keys: floor(0.25·budget) most recent
  keys including 4 sinks, and the rest from per-query-head Top-k of the logits over the middle region,
  unioned across heads in rank order (rank 0 of heads 0..H-1, then rank 1, ...), shared by every head.

The layer lists default to the paper's Llama-3.1-8B choices, (2, 8, 18) for OmniKV and (2, 13) for LessIsMore;
they fit SmolLM2 (30 layers) unchanged. The registry drops entries >= num_layers for shallower models.
These are accuracy simulations: they compute dense scores and mask them; they save no work.

On a mesh (models/sharding.py) every baseline runs per shard: StreamingLLM and Quest are per-head already;
OmniKV's max over query heads and LessIsMore's rank-order union over heads are reduced over the head axis
(`lax.pmax` / `lax.pmin` of a [batch, keys] array), so every shard selects the same shared key set.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from kernels_pallas.dense import dense_attention
from kernels_pallas.reference import (attention_reference, attention_reference_rows, frac_numerator,
                                      select_topk_reference, topk_budget)
from models.attention import DenseStrategy, check_supports_paged

__all__ = ["DenseStrategy", "StreamingLLMStrategy", "QuestStrategy", "OmniKVStrategy", "LessIsMoreStrategy"]


def _dense(inputs):
    return dense_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.q_start, inputs.kv_len,
                           phase=inputs.phase, chunk_at_zero=inputs.chunk_at_zero)


def _refuse_paged(strategy, inputs):
    """The baselines are accuracy simulations over a contiguous cache: they leave `supports_paged` unset, so the
    Transformer refuses a paged cache (models.attention.check_supports_paged) before attend; a direct attend call
    with a page table gets the same error here."""
    if getattr(inputs, "page_table", None) is not None:
        check_supports_paged(strategy)


def _shared_keys(inputs, keys):
    """Attention restricted to one key set shared by every head: keys [batch, keys] bool."""
    return attention_reference(inputs.q, inputs.k_cache, inputs.v_cache, inputs.q_start, inputs.kv_len,
                               mask=keys[:, None, None, :])


def _head_axis(inputs):
    """The mesh axis the heads are split over when attention runs per shard (models/sharding.py), else None."""
    return None if inputs.shards is None else inputs.shards.head_axis


def _check_pos_int(name, value, lo=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")


def _check_layers(name, layers):
    layers = tuple(layers)
    if not layers or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in layers):
        raise ValueError(f"{name} must be a non-empty tuple of layer indices >= 0, got {layers!r}")
    if any(b <= a for a, b in zip(layers, layers[1:])):
        raise ValueError(f"{name} must be strictly increasing, got {layers!r}")
    return layers


def _decode_logits(q, k, kv_len):
    """[batch, q_heads, keys] fp32 scaled logits of one decode token, -inf on invalid keys."""
    b, _, hq, d = q.shape
    kvh = k.shape[2]
    qf = q[:, 0].astype(jnp.float32).reshape(b, kvh, hq // kvh, d)
    s = jnp.einsum("bkgd,bskd->bkgs", qf, k.astype(jnp.float32)).reshape(b, hq, -1) / math.sqrt(d)
    valid = jnp.arange(k.shape[1])[None, None, :] < kv_len[:, None, None]
    return jnp.where(valid, s, -jnp.inf)


def _membership(idx, num_keys):
    """[..., k_max] indices (-1 = none) -> [..., keys] bool."""
    flat = idx.reshape(-1, idx.shape[-1])
    safe = jnp.where(flat >= 0, flat, num_keys)
    m = jnp.zeros((flat.shape[0], num_keys + 1), bool).at[jnp.arange(flat.shape[0])[:, None], safe].set(True)
    return m[:, :num_keys].reshape(idx.shape[:-1] + (num_keys,))


# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StreamingLLMStrategy:
    """Attention sinks + sliding window, prefill and decode."""

    sinks: int = 4
    window_frac: float = 0.30
    min_window: int = 128
    score_elems: int = 1 << 27  # a prefill's fp32 scores per block of query rows (session 16: [16, 12, 16K, 16K]
    # in one piece asked XLA for 207 GB)
    name: str = "streaming_llm"

    def __post_init__(self):
        _check_pos_int("sinks", self.sinks, lo=0)
        _check_pos_int("min_window", self.min_window)
        _check_pos_int("score_elems", self.score_elems)
        frac_numerator(self.window_frac)

    def mask(self, q_start, seq_len, q_len: int, num_keys: int):
        """[batch, 1, q_len, keys] bool (causality and kv_len are added by attention_reference)."""
        window = topk_budget(seq_len, self.window_frac, self.min_window)  # [batch], sinks included
        pos = q_start[:, None] + jnp.arange(q_len)[None, :]  # [batch, q_len]
        recent = jnp.maximum(window - self.sinks, 0)[:, None, None]
        keys = jnp.arange(num_keys)[None, None, :]
        return ((keys < self.sinks) | (keys > pos[:, :, None] - recent))[:, None]

    def attend(self, layer, inputs, state):
        _refuse_paged(self, inputs)
        q, k = inputs.q, inputs.k_cache
        block = max(1, self.score_elems // (q.shape[0] * q.shape[2] * k.shape[1]))  # rows whose scores fit the budget
        out = attention_reference_rows(q, k, inputs.v_cache, inputs.q_start, inputs.kv_len, block,
                                       lambda start, rows: self.mask(start, inputs.seq_len, rows, k.shape[1]))
        return out, state

    def post_attention(self, layer, x, attn_out, state):
        return state

    def state_spec(self, layer, phase, shards):
        return P()  # no state; the mask is per position


@dataclasses.dataclass(frozen=True)
class QuestStrategy:
    """Query-aware page selection from per-page key bounds; decode only."""

    prefill_is_dense = True  # class attribute: a dense prefill, no state into decode (models.attention)
    page_size: int = 16
    budget_frac: float = 0.10
    min_budget: int = 128
    min_pages: int = 3
    dense_layers: int = 2
    name: str = "quest"

    def __post_init__(self):
        _check_pos_int("page_size", self.page_size)
        _check_pos_int("min_budget", self.min_budget)
        _check_pos_int("min_pages", self.min_pages)
        _check_pos_int("dense_layers", self.dense_layers, lo=0)
        frac_numerator(self.budget_frac)

    def mask(self, q, k, kv_len):
        """[batch, q_heads, keys] bool: the keys of the pages each query head selects."""
        b, _, hq, d = q.shape
        n_keys, kvh = k.shape[1], k.shape[2]
        g = hq // kvh
        n_pages = -(-n_keys // self.page_size)
        pad = n_pages * self.page_size - n_keys
        valid = (jnp.arange(n_pages * self.page_size) < kv_len[:, None]).reshape(b, n_pages, self.page_size, 1, 1)
        kp = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
        kp = kp.reshape(b, n_pages, self.page_size, kvh, d)
        kmin = jnp.min(jnp.where(valid, kp, jnp.inf), axis=2)  # [batch, pages, kv_heads, d]
        kmax = jnp.max(jnp.where(valid, kp, -jnp.inf), axis=2)
        page_valid = jnp.any(valid, axis=(2, 3, 4))  # [batch, pages]
        kmin, kmax = jnp.where(page_valid[..., None, None], kmin, 0.0), jnp.where(page_valid[..., None, None], kmax, 0.0)
        qf = q[:, 0].astype(jnp.float32).reshape(b, kvh, g, d)
        bound = jnp.maximum(jnp.einsum("bkgd,bpkd->bkgpd", qf, kmin), jnp.einsum("bkgd,bpkd->bkgpd", qf, kmax)).sum(-1)
        bound = jnp.where(page_valid[:, None, None, :], bound, -jnp.inf)  # [batch, kv_heads, group, pages]
        budget = topk_budget(kv_len, self.budget_frac, self.min_budget)
        n_sel = jnp.maximum(self.min_pages, budget // self.page_size)  # [batch]
        pidx = select_topk_reference(bound.reshape(b, hq, n_pages), n_sel[:, None], n_pages)  # [batch, q_heads, pages]
        page_sel = _membership(pidx, n_pages)  # [batch, q_heads, pages]
        return jnp.repeat(page_sel, self.page_size, axis=2)[:, :, :n_keys]

    def attend(self, layer, inputs, state):
        _refuse_paged(self, inputs)
        if inputs.phase == "prefill" or layer < self.dense_layers:
            return _dense(inputs), state
        q, k, v = inputs.q, inputs.k_cache, inputs.v_cache
        g = q.shape[2] // k.shape[2]
        # Per-query-head masks: give each query head its own copy of its KV head.
        m = self.mask(q, k, inputs.kv_len)[:, :, None, :]  # [batch, q_heads, 1, keys]
        out = attention_reference(q, jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2), inputs.q_start,
                                  inputs.kv_len, mask=m)
        return out, state

    def post_attention(self, layer, x, attn_out, state):
        return state

    def state_spec(self, layer, phase, shards):
        return P()  # no state; pages are chosen per query head


@dataclasses.dataclass(frozen=True)
class OmniKVStrategy:
    """Filter layers pick one key set (max over all heads' probabilities) that the following layers reuse; decode only."""

    prefill_is_dense = True  # class attribute: a dense prefill, no state into decode (models.attention)
    filter_layers: tuple[int, ...] = (2, 8, 18)
    budget_frac: float = 0.10
    min_budget: int = 128
    dense_layers: int = 2
    name: str = "omnikv"

    def __post_init__(self):
        object.__setattr__(self, "filter_layers", _check_layers("filter_layers", self.filter_layers))
        _check_pos_int("min_budget", self.min_budget)
        _check_pos_int("dense_layers", self.dense_layers, lo=0)
        frac_numerator(self.budget_frac)

    def is_dense(self, layer: int) -> bool:
        return layer < self.dense_layers or layer in self.filter_layers or (layer - 1) in self.filter_layers

    def select(self, q, k, kv_len, head_axis=None):
        """[batch, keys] bool: top-budget keys of the max over query heads of the post-softmax probabilities
        (over every shard's heads when the heads are split over `head_axis`)."""
        probs = jax.nn.softmax(_decode_logits(q, k, kv_len), axis=-1)  # [batch, q_heads, keys]
        top = probs.max(axis=1) if head_axis is None else lax.pmax(probs.max(axis=1), head_axis)
        score = jnp.where(jnp.arange(k.shape[1])[None, :] < kv_len[:, None], top, -jnp.inf)
        budget = topk_budget(kv_len, self.budget_frac, self.min_budget)
        return _membership(select_topk_reference(score, budget, k.shape[1]), k.shape[1])

    def attend(self, layer, inputs, state):
        _refuse_paged(self, inputs)
        if inputs.phase == "prefill":
            return _dense(inputs), state
        if layer in self.filter_layers:
            state = self.select(inputs.q, inputs.k_cache, inputs.kv_len, _head_axis(inputs))
        if self.is_dense(layer) or state is None:
            return _dense(inputs), state
        return _shared_keys(inputs, state), state

    def post_attention(self, layer, x, attn_out, state):
        return state

    def state_spec(self, layer, phase, shards):
        return P() if phase == "prefill" or layer < min(self.filter_layers) else P(shards.batch_axis)


@dataclasses.dataclass(frozen=True)
class LessIsMoreStrategy:
    """TidalDecode-style selection layers with one head-unified key set plus sinks and a recency window; decode only."""

    prefill_is_dense = True  # class attribute: a dense prefill, no state into decode (models.attention)
    selection_layers: tuple[int, ...] = (2, 13)
    budget_frac: float = 0.10
    min_budget: int = 128
    recent_frac: float = 0.25
    sinks: int = 4
    name: str = "less_is_more"

    def __post_init__(self):
        object.__setattr__(self, "selection_layers", _check_layers("selection_layers", self.selection_layers))
        _check_pos_int("min_budget", self.min_budget)
        _check_pos_int("sinks", self.sinks, lo=0)
        frac_numerator(self.budget_frac)
        frac_numerator(self.recent_frac)

    def select(self, q, k, kv_len, head_axis=None):
        """[batch, keys] bool: sinks + recent window + the head-unified top keys of the middle region (the union
        runs over every shard's heads when the heads are split over `head_axis`)."""
        n_keys = k.shape[1]
        budget = topk_budget(kv_len, self.budget_frac, self.min_budget)  # [batch]
        n_sink = jnp.minimum(self.sinks, kv_len)
        recent_incl_sinks = topk_budget(budget, self.recent_frac, 0)  # floor(recent_frac * budget)
        n_recent = jnp.clip(recent_incl_sinks - self.sinks, 0, kv_len - n_sink)
        n_mid = jnp.maximum(budget - n_sink - n_recent, 0)
        keys = jnp.arange(n_keys)[None, :]
        sink = keys < n_sink[:, None]
        recent = (keys >= (kv_len - n_recent)[:, None]) & (keys < kv_len[:, None])
        middle = (keys >= n_sink[:, None]) & (keys < (kv_len - n_recent)[:, None])  # [batch, keys]
        logits = jnp.where(middle[:, None, :], _decode_logits(q, k, kv_len), -jnp.inf)  # [batch, q_heads, keys]
        hq = logits.shape[1]  # this shard's q heads
        shards = 1 if head_axis is None else lax.axis_size(head_axis)
        first = 0 if head_axis is None else lax.axis_index(head_axis) * hq  # global index of local head 0
        rank = jnp.argsort(jnp.argsort(-logits, axis=-1, stable=True), axis=-1, stable=True)  # rank of key in head
        # Slot of key j in the rank-major union order: min over heads of rank * H + head.
        slot = jnp.min(rank * (hq * shards) + first + jnp.arange(hq)[None, :, None], axis=1)  # [batch, keys]
        slot = (slot if head_axis is None else lax.pmin(slot, head_axis)).astype(jnp.float32)
        chosen = _membership(select_topk_reference(jnp.where(middle, -slot, -jnp.inf), n_mid, n_keys), n_keys)
        return sink | recent | chosen

    def attend(self, layer, inputs, state):
        _refuse_paged(self, inputs)
        if inputs.phase == "prefill":
            return _dense(inputs), state
        if layer in self.selection_layers:
            return _dense(inputs), self.select(inputs.q, inputs.k_cache, inputs.kv_len, _head_axis(inputs))
        if state is None:
            return _dense(inputs), state
        return _shared_keys(inputs, state), state

    def post_attention(self, layer, x, attn_out, state):
        return state

    def state_spec(self, layer, phase, shards):
        return P() if phase == "prefill" or layer < min(self.selection_layers) else P(shards.batch_axis)
