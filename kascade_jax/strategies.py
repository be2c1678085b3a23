"""KascadeStrategy: anchor / reuse sparse attention behind the models' per-layer attention interface.

Per layer (see models/README.md for layouts), with `cfg = strategy.config`:
- anchor layers (`cfg.is_anchor(layer)`) compute exact pooled post-softmax scores of their own q, k, take the
  exact Top-k per (sequence, index head[, query tile]) with the budgets of `kernels_pallas.reference`
  (`decode_counts` / `prefill_counts`, optionally rounded up to `cfg.k_multiple`), and attend sparsely over their
  own indices; layer 0 with `layer0_dense` (every anchor in prefill with `prefill_dense_anchors`) attends densely
  and still emits indices;
- reuse layers attend sparsely over the most recent anchor's indices, KV head h reading index head
  `cfg.head_map_row(layer)[h]`.
With `decode_rerank` = C a decode anchor selects C times the budget and each reuse layer keeps its own Top-k of
those candidates (`rerank_decode`, plain JAX ops before the reuse kernel); with `decode_rerank_layers` only those
layers do, and the anchor orders its candidates (`order_candidates`) so that the others read its first k.
With `decode_tail_stride` = S every sparse decode layer adds a sampled estimate of the keys it did not select
(`sampled_tail`: the unselected keys at multiples of S, weighted by S, merged through the reuse kernel's lse).
With `decode_dense_layers` those layers' decode outputs dense attention: a listed anchor through its kernel's
`dense` output (its selection unchanged), a listed reuse layer through the models' dense attention (the anchor's
state handed on); neither reranks nor takes the tail.
With `decode_prefill_keys` = s (decode_only) every reuse layer keeps, from the dense prefill, its own Top-s of the
prompt's last tile's pooled scores in the KV cache (`init_cache_state` / `update_cache_state`: {"idx" [batch,
idx_heads, s_max], "scores" [batch, idx_heads, max_len] fp32, the tile's pooled scores summed over the chunks it
spans}) and in decode attends the union of its anchor's indices and those (`union_indices`, duplicates once).
The attended set is the indices plus the causal diagonal tile in prefill, the indices alone in decode; softmax
is renormalised over it. The state threaded between layers is `{"idx", "counts"}` of the most recent anchor
(`None` before layer 0): prefill idx [batch, idx_heads, tiles, k_max] (`prefill_width`: whole blocks with
`prefill_key_block`) + counts [batch, tiles], decode idx [batch, idx_heads, k_max] + counts [batch].

Kernel seam: every array computation goes through one `Kernels` bundle looked up by name (`strategy.kernels`):
"reference" (default) = the pure-JAX references, which materialise one layer's scores for the query rows of the
current call, never [layers x L x L] (long prefill chunks are cut into blocks of `Kernels.query_block` queries);
"pallas" = kernels_pallas.decode / prefill (Pallas on GPU, their own references on CPU). Other bundles plug in
with `register_kernels(name, Kernels(...))`, without touching the layer logic here.

Paged caches (`inputs.page_table`, models/paged.py): decode goes through `Kernels.paged_anchor_decode` /
`paged_reuse_decode`, which read K/V through the page table (the "pallas" bundle: kernels_pallas/paged.py; the
"reference" bundle gathers the pages, as the readable statement); prefill gathers the chunk's sequences' pages into a
contiguous view per chunk and layer and runs the contiguous path unchanged (`_contiguous_view`).

On a mesh (models/sharding.py) `attend` runs per shard on the local KV heads, and `state_spec` gives the state's
layout: idx [batch -> data, idx_heads -> model, ...], counts [batch -> data, ...]. A reuse layer's KV head h reads
index head head_map_row[h]; when that head lives on another shard for some reuse layer of an anchor, the anchor
all-gathers its idx over the head axis once (so its state is whole over heads) and every reuse layer picks its
local heads' rows with a traced take (the kernels then see the identity row). pool='all' pools over every query
head and is refused on a head-split mesh.

This module deliberately holds no calibration (anchor DP, head maps) and no baselines (see baselines.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from kascade_jax.config import KascadeConfig
from kernels_pallas.dense import dense_attention, on_gpu
from kernels_pallas.paged import dense_attention_paged, gather_pages
from kernels_pallas.prefill import dense_prefill, dense_prefill_supported
from kernels_pallas.reference import (
    FORCED_SCORE,
    attention_reference_rows,
    decode_counts,
    fp8_decode_keys,
    fp8_decode_qk,
    fp8_decode_token,
    fp8_score_qk,
    gathered_logits,
    index_width,
    max_budget,
    pooled_scores_decode_reference,
    pooled_scores_prefill_reference,
    pooled_scores_rows_reference,
    prefill_counts,
    prefill_eligible,
    select_blocks_reference,
    select_topk_reference,
    sparse_decode_reference,
    topk_budget,
    sparse_prefill_reference,
)
from models.attention import check_no_cache_state
from models.cache import write_token
from models.paged import physical_rows, write_paged

# ---------------------------------------------------------------------------------------------------------------
# The kernel seam
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The four calls a Kascade layer makes. q [batch, q_len, q_heads, d], caches [batch, keys, kv_heads, d].

    anchor_decode(q, k, v, kv_len, *, cfg, k_max, dense, head_map_row[, score_keys=(k8, mult)])
        -> (out, idx [batch, idx_heads, k_max], counts [batch])
        (score_keys only under decode_score_fp8: the scores read that fp8 K copy, `kernels_pallas.decode`)
    reuse_decode(q, k, v, kv_len, idx, counts, head_map_row[, return_lse=True]) -> out[, lse [batch, 1, q_heads]]
    anchor_prefill(q, k, v, q_start, kv_len, seq_len, *, cfg, k_max, dense, head_map_row, chunk_at_zero)
        -> (out, idx [batch, idx_heads, tiles, prefill_width(cfg, k_max)], counts [batch, tiles])
    reuse_prefill(q, k, v, q_start, kv_len, idx, counts, head_map_row, tile_size, *, key_block) -> out
    The anchors compute the budgets (`decode_budget` / `prefill_budget` below) from `cfg` (a KascadeConfig: topk_frac,
    min_k, k_multiple, rolling_prefill, tile_size, pool, prefill_key_block: the prefill selects blocks of that many
    keys, `kernels_pallas.reference.select_blocks_reference`). `head_map_row` is a static tuple of ints [kv_heads];
    `dense`: output dense attention, still select (anchor layer 0).
    query_block: longer prefill chunks are fed to the prefill calls in static blocks of this many queries (a
    multiple of tile_size), so a kernel that materialises scores holds [batch, q_heads, query_block, keys] at
    most; None = the whole chunk in one call.
    """

    anchor_decode: Callable
    reuse_decode: Callable
    anchor_prefill: Callable
    reuse_prefill: Callable
    query_block: int | None = None
    # Paged caches (models/paged.py): the decode calls with the layer's page pools and page_table [batch, max_pages]
    # after v, same results; indices stay logical token positions. None = this bundle has no paged decode.
    paged_anchor_decode: Callable | None = None  # (q, k_pages, v_pages, page_table, kv_len, *, cfg, k_max, ...)
    paged_reuse_decode: Callable | None = None  # (q, k_pages, v_pages, page_table, kv_len, idx, counts, row)
    # The decode_rerank lever's Top-k over candidate scores: (scores [batch, heads, n] fp32, >= 0 eligible, -inf
    # not; n_valid [batch], the eligible ones first; counts [batch]; k_max) -> positions [batch, heads, k_max], -1 past
    # the count, the same set as lax.top_k's (ties: lowest position first). None: lax.top_k (a full sort on a GPU).
    select_topk: Callable | None = None
    # Its candidate logits: (q, k_cache [batch, keys, kv_heads, d], kv_len, cand [batch, kv_heads, C]) -> scaled
    # logits [batch, kv_heads, group, C] fp32, -inf where cand is -1. None: an XLA gather of the C K rows + einsum.
    candidate_logits: Callable | None = None


def _anchor_decode_reference(q, k, v, kv_len, *, cfg, k_max, dense, head_map_row, score_keys=None):
    counts = decode_budget(cfg, kv_len)
    # decode_score_fp8: the fp8 K copy widened, q with its mult
    q_s, k_s = (q, k) if score_keys is None else fp8_decode_qk(q, score_keys, k.dtype)
    scores = pooled_scores_decode_reference(q_s, k_s, kv_len, pool=cfg.pool, sinks=cfg.sink_tokens,
                                            window=cfg.recent_window)  # [batch, idx_heads, keys]
    idx = select_topk_reference(scores, counts[:, None], k_max)
    if dense:
        out = dense_attention(q, k, v, kv_len - 1, kv_len, phase="decode", chunk_at_zero=False)
    else:
        out = sparse_decode_reference(q, k, v, kv_len, idx, head_map_row)
    return out, idx, counts


def _reuse_decode_reference(q, k, v, kv_len, idx, counts, head_map_row, *, return_lse=False):
    del counts  # the -1 padding past each count already says it
    return sparse_decode_reference(q, k, v, kv_len, idx, head_map_row, return_lse=return_lse)


def _anchor_prefill_reference(q, k, v, q_start, kv_len, seq_len, *, cfg, k_max, dense, head_map_row, chunk_at_zero):
    counts = prefill_budget(cfg, q_start, kv_len, seq_len, q.shape[1])  # [batch, tiles]
    q_s, k_s = fp8_score_qk(q, k, kv_len) if cfg.prefill_score_fp8 and not dense else (q, k)
    scores, _ = pooled_scores_prefill_reference(q_s, k_s, q_start, kv_len, cfg.tile_size, pool=cfg.pool,
                                                sinks=cfg.sink_tokens, window=cfg.recent_window + cfg.local_window)
    if cfg.prefill_key_block > 1:
        eligible = prefill_eligible(q_start, kv_len, q.shape[1], cfg.tile_size)[1]
        idx, counts = select_blocks_reference(scores, jnp.minimum(counts, k_max), eligible, k_max,
                                              cfg.prefill_key_block)
    else:
        idx = select_topk_reference(scores, counts[:, None, :], k_max)  # [batch, idx_heads, tiles, k_max]
    if dense:
        out = dense_attention(q, k, v, q_start, kv_len, phase="prefill", chunk_at_zero=chunk_at_zero)
    else:
        out = sparse_prefill_reference(q, k, v, q_start, kv_len, idx, head_map_row, cfg.tile_size)
    return out, idx, counts


def _reuse_prefill_reference(q, k, v, q_start, kv_len, idx, counts, head_map_row, tile_size, *, key_block=1):
    del counts, key_block  # blocks come expanded to key ids; a partial block's keys past the prefix are masked
    return sparse_prefill_reference(q, k, v, q_start, kv_len, idx, head_map_row, tile_size)


def _gathered(fn):
    """A contiguous decode call made paged by gathering the pages first (the reference statement)."""
    def paged(q, k_pages, v_pages, page_table, kv_len, *args, score_keys=None, **kwargs):
        if score_keys is not None:  # the fp8 K copy's pages, through the same table
            kwargs["score_keys"] = (gather_pages(score_keys[0], page_table, kv_len), score_keys[1])
        return fn(q, gather_pages(k_pages, page_table, kv_len), gather_pages(v_pages, page_table, kv_len), kv_len,
                  *args, **kwargs)
    return paged


REFERENCE_KERNELS = Kernels(
    anchor_decode=_anchor_decode_reference,
    reuse_decode=_reuse_decode_reference,
    anchor_prefill=_anchor_prefill_reference,
    reuse_prefill=_reuse_prefill_reference,
    query_block=1024,
    paged_anchor_decode=_gathered(_anchor_decode_reference),
    paged_reuse_decode=_gathered(_reuse_decode_reference),
)


def _pallas_kernels() -> Kernels:
    """kernels_pallas.decode / prefill (Pallas on GPU, their references elsewhere; pre_softmax prefill: reference)."""
    from kernels_pallas import decode as pd
    from kernels_pallas import paged as pg
    from kernels_pallas import prefill as pp

    def check(cfg):
        if cfg.k_multiple != 1:
            raise ValueError(f"the Pallas kernels implement k_multiple=1 only, got k_multiple={cfg.k_multiple}")

    def anchor_decode(q, k, v, kv_len, *, cfg, k_max, dense, head_map_row, score_keys=None):
        check(cfg)
        return pd.anchor_decode(q, k, v, kv_len, topk_frac=cfg.decode_frac, min_k=cfg.min_k, k_max=k_max,
                                head_map_row=head_map_row, dense_out=dense, pool=cfg.pool, sinks=cfg.sink_tokens,
                                window=cfg.recent_window, score_keys=score_keys)

    def anchor_prefill(q, k, v, q_start, kv_len, seq_len, *, cfg, k_max, dense, head_map_row, chunk_at_zero):
        check(cfg)
        if cfg.pool == "pre_softmax":
            return _anchor_prefill_reference(q, k, v, q_start, kv_len, seq_len, cfg=cfg, k_max=k_max, dense=dense,
                                             head_map_row=head_map_row, chunk_at_zero=chunk_at_zero)
        return pp.anchor_prefill(q, k, v, q_start, kv_len, seq_len, cfg.tile_size, topk_frac=cfg.prefill_frac,
                                 min_k=cfg.min_k, k_max=k_max, rolling=cfg.rolling_prefill, dense_out=dense,
                                 pool=cfg.pool, chunk_at_zero=chunk_at_zero, sinks=cfg.sink_tokens,
                                 window=cfg.recent_window + cfg.local_window, extra_k=cfg.local_window,
                                 key_block=cfg.prefill_key_block, score_fp8=cfg.prefill_score_fp8)

    def paged_anchor_decode(q, k, v, page_table, kv_len, *, cfg, k_max, dense, head_map_row, score_keys=None):
        check(cfg)
        return pg.anchor_decode(q, k, v, page_table, kv_len, topk_frac=cfg.decode_frac, min_k=cfg.min_k, k_max=k_max,
                                head_map_row=head_map_row, dense_out=dense, pool=cfg.pool, sinks=cfg.sink_tokens,
                                window=cfg.recent_window, score_keys=score_keys)

    def select_topk(scores, n_valid, counts, k_max):
        if on_gpu():  # the anchors' sort-free Top-k pipeline (kernels_pallas/topk.py); a sort elsewhere
            return pd.select_topk(scores, n_valid, counts, k_max)
        return select_topk_reference(scores, counts[:, None], k_max)

    return Kernels(anchor_decode=anchor_decode, reuse_decode=pd.reuse_decode, anchor_prefill=anchor_prefill,
                   reuse_prefill=pp.reuse_prefill, query_block=None, paged_anchor_decode=paged_anchor_decode,
                   paged_reuse_decode=pg.reuse_decode, select_topk=select_topk, candidate_logits=pd.candidate_logits)


_KERNELS: dict[str, Kernels] = {"reference": REFERENCE_KERNELS}
_LAZY_KERNELS: dict[str, Callable[[], Kernels]] = {"pallas": _pallas_kernels}


def register_kernels(name: str, kernels: Kernels) -> None:
    """Make a kernel bundle selectable as `KascadeStrategy(..., kernels=name)`."""
    if not isinstance(kernels, Kernels):
        raise ValueError(f"kernels must be a strategies.Kernels bundle, got {type(kernels).__name__}")
    _KERNELS[name] = kernels


def get_kernels(name: str) -> Kernels:
    if name not in _KERNELS and name in _LAZY_KERNELS:
        _KERNELS[name] = _LAZY_KERNELS[name]()
    if name not in _KERNELS:
        raise ValueError(f"unknown kernels {name!r}; registered: {sorted(set(_KERNELS) | set(_LAZY_KERNELS))}")
    return _KERNELS[name]


# ---------------------------------------------------------------------------------------------------------------
# Budgets
# ---------------------------------------------------------------------------------------------------------------


def _round_up(counts, multiple: int, cap):
    """Round budgets up to `multiple`, never past `cap` (the eligible keys), so rounding only ever adds keys."""
    if multiple == 1:
        return counts
    return jnp.minimum(-(-counts // multiple) * multiple, cap).astype(jnp.int32)


def static_k_max(cfg: KascadeConfig, max_len: int, phase: str = "decode") -> int:
    """Static index-buffer width: the largest budget any length <= max_len can get in `phase` (after rounding;
    prefill adds the local window)."""
    if phase == "prefill":
        k = index_width(max_budget(max_len, cfg.prefill_frac, cfg.min_k) + cfg.local_window, cfg.prefill_key_block)
    else:
        k = max_budget(max_len, cfg.decode_frac, cfg.min_k)
    return max(1, min(-(-k // cfg.k_multiple) * cfg.k_multiple, max_len))


def prefill_width(cfg: KascadeConfig, k_max: int) -> int:
    """Width of the prefill index buffers for a key budget of at most k_max: ceil(k_max / kb) blocks of
    `prefill_key_block` kb ids each (k_max itself for kb = 1)."""
    kb = cfg.prefill_key_block
    return -(-k_max // kb) * kb


def decode_budget(cfg: KascadeConfig, kv_len):
    """[batch] int32: k = min(max(floor(topk_frac * kv_len), min_k), kv_len), rounded up to k_multiple (<= kv_len)."""
    counts = decode_counts(kv_len, cfg.decode_frac, cfg.min_k).astype(jnp.int32)
    return _round_up(counts, cfg.k_multiple, kv_len)


def prefill_budget(cfg: KascadeConfig, q_start, kv_len, seq_len, q_len: int):
    """[batch, tiles] int32: per-tile budget over the keys strictly before the tile (see reference.prefill_counts)."""
    counts = prefill_counts(q_start, kv_len, seq_len, q_len, cfg.tile_size, cfg.prefill_frac, cfg.min_k,
                            rolling=cfg.rolling_prefill, extra=cfg.local_window)
    eligible = prefill_eligible(q_start, kv_len, q_len, cfg.tile_size)[1]
    # Rounding after clamping to the eligible keys equals clamping after rounding, since eligible <= base L.
    return _round_up(counts, cfg.k_multiple, eligible)


PREFILL_KEYS_MIN_K = 32  # decode_prefill_keys: the floor of a layer's own prefill set (before clamping to L)


def prefill_keys_budget(cfg: KascadeConfig, length):
    """decode_prefill_keys' set size for a prompt of `length` keys: min(max(floor(s L), 32), L), exact integers."""
    return topk_budget(length, cfg.decode_prefill_keys, PREFILL_KEYS_MIN_K)


def union_indices(a, b, num_keys: int):
    """The union of two index sets per row, a [batch, heads, ka] and b [batch, heads, kb] (distinct entries within
    each, -1 = none) -> (idx [batch, heads, ka + kb], the distinct valid entries first, then -1; counts [batch], the
    most distinct entries of any head: what reuse_decode reads). An entry of b already in a is dropped, so no key is
    attended twice (the Pallas reuse kernel would weight a duplicate twice). Membership through a [batch, heads,
    num_keys] mask, linear in the cache length."""
    bsz, h, _ = a.shape
    bi, hi = jnp.arange(bsz)[:, None, None], jnp.arange(h)[None, :, None]
    member = jnp.zeros((bsz, h, num_keys + 1), bool).at[bi, hi, jnp.where(a >= 0, a, num_keys)].set(True)
    b = jnp.where((b >= 0) & ~member[bi, hi, jnp.where(b >= 0, b, num_keys)], b, -1)
    cat = jnp.concatenate([a, b], axis=-1).astype(jnp.int32)
    valid = cat >= 0
    n = cat.shape[-1]
    dest = jnp.where(valid, jnp.cumsum(valid, -1) - 1, n)
    idx = jnp.full_like(cat, -1).at[bi, hi, dest].set(cat, mode="drop")
    return idx, jnp.max(jnp.sum(valid, -1), axis=1).astype(jnp.int32)


def prefill_keys_update(cfg: KascadeConfig, entry, q, k, q_start, kv_len, seq_len):
    """One prefill chunk's update of a reuse layer's decode_prefill_keys entry {"idx", "scores"}: the chunk's rows
    among each sequence's last tile_size prompt positions [seq_len - tile_size, seq_len) add their pooled
    post-softmax scores (causal) to "scores", and a sequence whose last prompt token lies in this chunk takes its
    Top-s' of them as "idx". q [batch, T, q_heads, d] at q_start [batch]; k the cache [batch, max_len, kv_heads, d]."""
    bsz, t = q.shape[:2]
    w = min(t, cfg.tile_size)  # the tile's rows in this chunk lie in one static window of w rows
    seq_len = jnp.broadcast_to(jnp.asarray(seq_len, jnp.int32), (bsz,))
    start = jnp.clip(seq_len - cfg.tile_size - q_start, 0, t - w)  # [batch]
    qw = jax.vmap(lambda x, st: lax.dynamic_slice_in_dim(x, st, w, axis=0))(q, start)
    pos = (q_start + start)[:, None] + jnp.arange(w)[None, :]  # [batch, w]
    rows = (pos >= seq_len[:, None] - cfg.tile_size) & (pos < seq_len[:, None])
    scores = entry["scores"] + pooled_scores_rows_reference(qw, k, q_start + start, kv_len, rows, pool=cfg.pool)
    ends = (seq_len - 1 >= q_start) & (seq_len - 1 < q_start + t)  # [batch]: the prompt's end is in this chunk
    eligible = jnp.arange(k.shape[1])[None, None, :] < seq_len[:, None, None]
    own = select_topk_reference(jnp.where(eligible, scores, -jnp.inf), prefill_keys_budget(cfg, seq_len)[:, None],
                                entry["idx"].shape[-1])
    return {"idx": jnp.where(ends[:, None, None], own, entry["idx"]), "scores": scores}


def rerank_config(cfg: KascadeConfig) -> KascadeConfig:
    """What an anchor selects in decode under `decode_rerank` = C: C times the decode fraction (capped at 1) and
    C times min_k. Reuse layers keep `decode_budget(cfg)` keys of these candidates (`rerank_decode`)."""
    c = cfg.decode_rerank
    if c == 1:
        return cfg
    return dataclasses.replace(cfg, decode_topk_frac=min(1.0, round(c * cfg.decode_frac, 4)), min_k=c * cfg.min_k,
                               decode_rerank=1, decode_rerank_layers=None)


def _candidate_scores(q, key_rows, kv_len, cand, cfg: KascadeConfig, logits_fn=None):
    """This layer's post-softmax probabilities over cand [batch, kv_heads, C] (softmax over the candidates), summed
    over the GQA group -> [batch, kv_heads, C] fp32: the forced keys (sinks, recent window) at FORCED_SCORE, -inf
    where cand is -1 (past the anchor's count). logits_fn(cand) -> [batch, kv_heads, group, C] scaled logits
    (Kernels.candidate_logits: one kernel pass over the candidates' K rows); None: gather them with key_rows."""
    valid = cand >= 0
    if logits_fn is not None:
        logits = logits_fn(cand)
    else:  # K rows in the cache's dtype: an fp32 copy of C k gathered rows would double the bytes
        logits = gathered_logits(q, key_rows(jnp.maximum(cand, 0))) / jnp.sqrt(jnp.float32(q.shape[-1]))
    logits = jnp.where(valid[:, :, None], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    pooled = (p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)).sum(2)
    if cfg.sink_tokens or cfg.recent_window:
        forced = (cand < cfg.sink_tokens) | (cand >= kv_len[:, None, None] - cfg.recent_window)
        pooled = jnp.where(forced, FORCED_SCORE, pooled)
    return jnp.where(valid, pooled, -jnp.inf)


def _top_positions(pooled, cand, counts, k_max: int, select):
    """Positions [batch, heads, k_max] of the top-`counts` of pooled [batch, heads, C] (-1 past the count): through
    `select` (Kernels.select_topk) when given, else lax.top_k. The valid candidates come first in each row."""
    counts = jnp.minimum(counts, k_max)
    if select is None:
        return select_topk_reference(pooled, counts[:, None], k_max)
    n_valid = jnp.sum(cand[:, 0] >= 0, axis=-1).astype(jnp.int32)  # the anchor's count: the same for every head
    return select(pooled, n_valid, counts, k_max)


def rerank_decode(q, key_rows, kv_len, cand, cfg: KascadeConfig, k_max: int, select=None, logits_fn=None):
    """A reuse layer's own decode Top-k among its anchor's candidates.

    q [batch, 1, q_heads, d]; cand [batch, kv_heads, C] int32 (-1 past the anchor's count), already mapped through
    the head map; key_rows(idx [batch, kv_heads, C]) -> K rows [batch, kv_heads, C, d]. Scores: `_candidate_scores`;
    the forced keys are always kept. `select`: Kernels.select_topk (None: lax.top_k); `logits_fn`: see
    `_candidate_scores`. Returns (idx [batch, kv_heads, k_max] int32, -1 past the count; counts [batch])."""
    pooled = _candidate_scores(q, key_rows, kv_len, cand, cfg, logits_fn)
    counts = decode_budget(cfg, kv_len)
    pos = _top_positions(pooled, cand, counts, min(k_max, cand.shape[-1]), select)
    return jnp.where(pos >= 0, jnp.take_along_axis(cand, jnp.maximum(pos, 0), axis=-1), -1).astype(jnp.int32), counts


def order_candidates(q, key_rows, kv_len, cand, cfg: KascadeConfig, k_max: int, select=None, logits_fn=None):
    """An anchor's candidates cand [batch, kv_heads, C] re-ordered so that the first `decode_budget(cfg)` of them are
    its own Top-k among them by its own `_candidate_scores` (forced keys included): what the reuse layers outside
    `decode_rerank_layers` attend. The other valid candidates follow in their order, then the -1s (a partition: no
    sort of the C candidates)."""
    pooled = _candidate_scores(q, key_rows, kv_len, cand, cfg, logits_fn)
    pos = _top_positions(pooled, cand, decode_budget(cfg, kv_len), min(k_max, cand.shape[-1]), select)
    b, h, c = cand.shape
    bi, hi = jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None]
    chosen = jnp.zeros((b, h, c), bool).at[bi, hi, jnp.where(pos >= 0, pos, c)].set(True, mode="drop")
    rest = ~chosen & (cand >= 0)
    dest = jnp.where(chosen, jnp.cumsum(chosen, -1) - 1,
                     jnp.where(rest, jnp.sum(chosen, -1, keepdims=True) + jnp.cumsum(rest, -1) - 1, c))
    return jnp.full_like(cand, -1).at[bi, hi, dest].set(cand, mode="drop").astype(jnp.int32)


def _with_tail(kern, cfg: KascadeConfig, q, k, v, kv_len, idx, counts, row):
    """A sparse decode over idx through `row`, with the sampled tail (`decode_tail_stride`) merged in."""
    out, lse = kern.reuse_decode(q, k, v, kv_len, idx, counts, row, return_lse=True)
    return sampled_tail(q, k, v, kv_len, idx, row, out, lse, cfg.decode_tail_stride, cap=cfg.decode_tail_cap)


def _logits_fn(kern, q, k, kv_len):
    """The bundle's candidate logits over a contiguous cache k, as `_candidate_scores` takes them (or None)."""
    if kern.candidate_logits is None:
        return None
    return lambda cand: kern.candidate_logits(q, k, kv_len, cand)


def _first(idx, counts, k_max: int):
    """The first counts[b] entries of ordered candidates idx [batch, heads, C] in k_max slots, -1 past the count."""
    idx = idx[:, :, :k_max]
    return jnp.where(jnp.arange(idx.shape[-1])[None, None, :] < counts[:, None, None], idx, -1), counts


def sampled_tail(q, k, v, kv_len, idx, row, out, lse, stride: int, *, cap: bool = False, scale=None):
    """The `decode_tail_stride` lever: merge into a sparse decode's out [batch, 1, q_heads, d] and lse [batch, 1,
    q_heads] (over the selected keys idx[:, row[h]]) a ratio estimate of the unselected keys: the keys at positions
    0, S, 2S, ... below kv_len that are not selected, each weighted by S (its logit + log S). With `cap` a sampled
    key whose logit (this query row's) reaches the lightest selected key's counts once: it is a key this row would
    have selected, not a member of a light tail. With the row's own Top-k as the selection no unselected key
    reaches it, so the cap changes nothing there; over a reuse layer's anchor selection it keeps the keys the
    anchor missed from being weighted by S (uncapped, the 0.5B's fwe answers repeated one word: session 19).
    Plain JAX: the sample is a strided slice of the cache (1/S of its rows), the cap gathers the selected keys'
    rows once more; a selected sample key is dropped (it is counted once, exactly). A row with no key left on
    either side keeps the other side's value."""
    b, _, hq, d = q.shape
    n_keys, kvh = k.shape[1], k.shape[2]
    g = hq // kvh
    scale = 1.0 / d ** 0.5 if scale is None else float(scale)
    n_s = -(-n_keys // stride)
    lens = jnp.asarray(kv_len).reshape(b, 1, 1)
    ks, vs = k[:, ::stride], v[:, ::stride]  # [batch, n_s, kv_heads, d]
    sel = jnp.take(idx, jnp.asarray(row), axis=1)  # [batch, kv_heads, k_max]
    slot = jnp.where((sel >= 0) & (sel % stride == 0), sel // stride, n_s)  # n_s: a slot for everything else
    bi, hi = jnp.arange(b)[:, None, None], jnp.arange(kvh)[None, :, None]
    taken = jnp.zeros((b, kvh, n_s + 1), bool).at[bi, hi, slot].set(True)[..., :n_s]
    ok = ~taken & ((jnp.arange(n_s) * stride)[None, None, :] < lens)
    qg = q[:, 0].reshape(b, kvh, g, d).astype(jnp.float32)
    raw = jnp.einsum("bhgd,bnhd->bhgn", qg, ks.astype(jnp.float32)) * scale
    logits = raw + jnp.log(float(stride))
    if cap:
        sel_ok = (sel >= 0) & (sel < lens)
        sel_k = k[bi, jnp.where(sel_ok, sel, 0), hi].astype(jnp.float32)  # [batch, kv_heads, k_max, d]
        sel_logits = jnp.einsum("bhgd,bhkd->bhgk", qg, sel_k) * scale
        floor = jnp.min(jnp.where(sel_ok[:, :, None, :], sel_logits, jnp.inf), axis=-1)  # [batch, kv_heads, group]
        logits = jnp.where(raw >= floor[..., None], raw, logits)
    logits = jnp.where(ok[:, :, None, :], logits, -jnp.inf)
    vs = jnp.where(jnp.swapaxes(ok, 1, 2)[..., None], vs, jnp.zeros((), vs.dtype))  # p = 0 there; 0 x stale NaN is not
    lse_t = jax.nn.logsumexp(logits, axis=-1)  # [batch, kv_heads, group]
    p = jnp.where(ok[:, :, None, :], jnp.exp(logits - jnp.where(jnp.isfinite(lse_t), lse_t, 0.0)[..., None]), 0.0)
    out_t = jnp.einsum("bhgn,bnhd->bhgd", p, vs.astype(jnp.float32))
    lse_s = lse.reshape(b, kvh, g).astype(jnp.float32)
    tot = jnp.logaddexp(lse_s, lse_t)
    safe = jnp.where(jnp.isfinite(tot), tot, 0.0)
    w_s = jnp.where(jnp.isfinite(lse_s), jnp.exp(lse_s - safe), 0.0)
    w_t = jnp.where(jnp.isfinite(lse_t), jnp.exp(lse_t - safe), 0.0)
    merged = w_s[..., None] * out.reshape(b, kvh, g, d).astype(jnp.float32) + w_t[..., None] * out_t
    return merged.reshape(b, 1, hq, d).astype(out.dtype)


def _rows_contiguous(k):
    """key_rows for rerank_decode over a contiguous cache k [batch, keys, kv_heads, d]."""
    b, _, kvh, _ = k.shape
    return lambda idx: k[jnp.arange(b)[:, None, None], idx, jnp.arange(kvh)[None, :, None]]


def _rows_paged(k_pages, page_table):
    """key_rows for rerank_decode through a page table (k_pages [num_pages, page_size, kv_heads, d])."""
    n, ps, kvh, _ = k_pages.shape
    b = page_table.shape[0]

    def rows(idx):
        page = jnp.clip(page_table[jnp.arange(b)[:, None, None], idx // ps], 0, n - 1)
        return k_pages[page, idx % ps, jnp.arange(kvh)[None, :, None]]

    return rows


def _contiguous_view(inputs):
    """Paged prefill: gather the pages of this chunk's sequences into a contiguous [batch, max_pages * page_size]
    view and run the contiguous prefill on it. One copy of the K/V per prefill chunk and layer, next to the chunk's
    quadratic attention work; decode never gathers (it reads through the page table in the kernels)."""
    pt = inputs.page_table
    return dataclasses.replace(inputs, k_cache=gather_pages(inputs.k_cache, pt, inputs.kv_len),
                               v_cache=gather_pages(inputs.v_cache, pt, inputs.kv_len), page_table=None)


def _fp8_keys_paged(entry, inputs):
    """decode_score_fp8 on a paged cache: a prefill chunk re-codes the sequences' keys so far (gathered through the
    page table) and writes the copy back through it, rows past kv_len as zeros; a decode step codes each sequence's
    new key (read from K's pool) and writes it at its position. Writes to no page (-1) are dropped."""
    pt, pool = inputs.page_table, inputs.k_cache
    n, ps = pool.shape[:2]
    b = pt.shape[0]
    if inputs.phase == "prefill":
        kv_len = jnp.asarray(inputs.kv_len, jnp.int32)
        k8, mean, mult = fp8_decode_keys(gather_pages(pool, pt, kv_len), kv_len)
        pos = jnp.broadcast_to(jnp.arange(k8.shape[1], dtype=jnp.int32)[None], (b, k8.shape[1]))
        return {"k8": write_paged(entry["k8"], k8, pt, pos), "mean": mean, "mult": mult}
    pos = jnp.broadcast_to(jnp.asarray(inputs.q_start, jnp.int32), (b,))[:, None]
    rows = physical_rows(pt, pos, ps, n)  # [batch, 1]; no page: one past the end (its write is dropped)
    new = jnp.take(pool.reshape(n * ps, *pool.shape[2:]), rows, axis=0, mode="clip")  # [batch, 1, kv_heads, d]
    return dict(entry, k8=write_paged(entry["k8"], fp8_decode_token(new, entry["mean"], entry["mult"]), pt, pos))


_SUFFIX_BLOCK = 32  # query rows per block of the reference dense-suffix attention (bounds its materialised scores)


def _suffix_attention(qw, k, v, pos0, kv_len, interpret: bool = False):
    """Dense causal attention of the suffix window qw [batch, w, q_heads, d] at positions pos0 [batch].

    On a GPU (bf16/fp16, head_dim 64/128) one Pallas flash pass (`kernels_pallas.prefill.dense_prefill`; `interpret`
    runs it on the CPU for tests). Elsewhere the reference in blocks of 32 rows, so at most [batch, q_heads, 32, keys]
    scores exist at once: on the H200 that path cost a 512-token suffix about as much as the rest of the 0.5B's
    sparse prefill."""
    if (interpret or on_gpu()) and dense_prefill_supported(qw, k):
        return dense_prefill(qw, k, v, pos0, kv_len, impl="pallas", interpret=interpret)
    w = qw.shape[1]
    blk = _SUFFIX_BLOCK if w % _SUFFIX_BLOCK == 0 else w  # whole blocks (model chunks are multiples of 64)
    return attention_reference_rows(qw, k, v, pos0, kv_len, blk)


def _dense_suffix(inputs, out, n: int, interpret: bool = False):
    """Replace the rows of the last `n` prompt tokens of every sequence by dense causal attention.

    A static window of w = min(q_len, n rounded up to 32) rows per sequence, placed so that it holds the part of
    [seq_len - n, seq_len) that lies in this chunk (a suffix that straddles two chunks is covered by both).
    """
    q, k, v = inputs.q, inputs.k_cache, inputs.v_cache
    b, t = q.shape[:2]
    w = min(t, -(-n // _SUFFIX_BLOCK) * _SUFFIX_BLOCK)
    seq_len = jnp.broadcast_to(jnp.asarray(inputs.seq_len, jnp.int32), (b,))
    start = jnp.clip(seq_len - n - inputs.q_start, 0, t - w)  # [batch] window start within the chunk
    take = jax.vmap(lambda x, s: lax.dynamic_slice_in_dim(x, s, w, axis=0))
    qw, pos0 = take(q, start), inputs.q_start + start
    kv_len = jnp.broadcast_to(jnp.asarray(inputs.kv_len, jnp.int32), (b,))
    dense = _suffix_attention(qw, k, v, pos0, kv_len, interpret)
    rows = pos0[:, None] + jnp.arange(w)[None, :]
    keep = (rows >= seq_len[:, None] - n) & (rows < seq_len[:, None])
    new = jnp.where(keep[:, :, None, None], dense.astype(out.dtype), take(out, start))
    return jax.vmap(lambda o, x, s: lax.dynamic_update_slice_in_dim(o, x, s, axis=0))(out, new, start)


# ---------------------------------------------------------------------------------------------------------------
# The strategy
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KascadeStrategy:
    """Kascade and its ablation variants (all set by `config`). Hashable, so it can be a static jit argument."""

    supports_paged = True  # class attribute, not a field (models.attention.check_supports_paged)
    config: KascadeConfig
    name: str = "kascade"
    kernels: str = "reference"

    def __post_init__(self):
        if not isinstance(self.config, KascadeConfig):
            raise ValueError(f"config must be a KascadeConfig, got {type(self.config).__name__}")
        get_kernels(self.kernels)

    # models' interface ----------------------------------------------------------------------------------------
    @property
    def prefill_is_dense(self) -> bool:
        """decode_only: the prefill is dense attention in every layer and carries no state into decode (each decode
        step's anchors select anew), so the eval may share one prefill with other such strategies."""
        cfg = self.config
        return bool(cfg.decode_only) and not cfg.decode_prefill_keys and not cfg.decode_score_fp8

    @property
    def cache_state_lever(self) -> str | None:
        """What needs a cache state (models.attention.check_no_cache_state), None: nothing."""
        cfg = self.config
        levers = [n for n in ("decode_prefill_keys", "decode_score_fp8") if getattr(cfg, n)]
        return " and ".join(levers) or None

    def _keeps_prefill_keys(self, layer: int) -> bool:
        cfg = self.config
        return bool(cfg.decode_prefill_keys) and not cfg.is_anchor(layer) and not cfg.decode_dense(layer)

    def _keeps_fp8_keys(self, layer: int) -> bool:
        """decode_score_fp8: the decode anchors with a sparse output keep an fp8 copy of their K."""
        cfg = self.config
        return cfg.decode_score_fp8 and cfg.is_anchor(layer) and not cfg.decode_dense(layer)

    @property
    def paged_cache_state_lever(self) -> str | None:
        """The cache-state levers without a paged form (decode_score_fp8 keeps its copy in page pools)."""
        return "decode_prefill_keys" if self.config.decode_prefill_keys else None

    @staticmethod
    def _fp8_keys(layer: int, inputs):
        """decode_score_fp8: the anchor's (k8, mult) from its cache-state entry."""
        if inputs.cache_state is None or "k8" not in inputs.cache_state:
            raise ValueError(f"decode_score_fp8: anchor layer {layer} got no fp8 K copy in the cache state; run "
                             "prefill through models.generate (it creates the state)")
        return inputs.cache_state["k8"], inputs.cache_state["mult"]

    def init_cache_state(self, num_layers: int, batch: int, max_len: int, kv_heads: int | None = None,
                         head_dim: int | None = None, pages: tuple[int, int] | None = None):
        """Per layer (None for the others; None when no lever needs one): decode_prefill_keys, per reuse layer
        {"idx" [batch, idx_heads, s_max] -1, "scores" [batch, idx_heads, max_len] 0}; decode_score_fp8, per sparse
        decode anchor {"k8" [batch, max_len, kv_heads, head_dim] float8_e4m3fn, "mean" [batch, 1, kv_heads,
        head_dim] fp32, "mult" [batch] fp32} (head_dim needed then; with pages=(num_pages, page_size), a paged
        cache's, "k8" is a page pool [num_pages, page_size, kv_heads, head_dim] read through K's page table)."""
        cfg = self.config
        if not (cfg.decode_prefill_keys or cfg.decode_score_fp8):
            return None
        if num_layers != cfg.num_layers:
            raise ValueError(f"the model has {num_layers} layers but the config num_layers={cfg.num_layers}")
        if cfg.decode_score_fp8 and head_dim is None:
            raise ValueError("decode_score_fp8 needs the model's head_dim for its fp8 K copy (init_cache_state)")
        if pages is not None:
            check_no_cache_state(self, "paged caches", paged=True)
        kvh = cfg.kv_heads if kv_heads is None else kv_heads
        s_max = max(1, prefill_keys_budget(cfg, max_len)) if cfg.decode_prefill_keys else 1
        h = cfg.idx_heads

        def entry(i):
            if self._keeps_prefill_keys(i):
                return {"idx": jnp.full((batch, h, s_max), -1, jnp.int32),
                        "scores": jnp.zeros((batch, h, max_len), jnp.float32)}
            if self._keeps_fp8_keys(i):
                rows = (batch, max_len) if pages is None else tuple(pages)
                return {"k8": jnp.zeros((*rows, kvh, head_dim), jnp.float8_e4m3fn),
                        "mean": jnp.zeros((batch, 1, kvh, head_dim), jnp.float32),
                        "mult": jnp.ones((batch,), jnp.float32)}
            return None
        return tuple(entry(i) for i in range(num_layers))

    def update_cache_state(self, layer: int, inputs):
        """The layer's cache-state entry for this call (the model calls it before attend, which reads the result):
        decode_prefill_keys entries change in prefill only; an fp8 K copy is re-coded from the whole cache after
        each prefill chunk (mean and scale of the valid keys so far) and takes each decode token in that coding."""
        entry = inputs.cache_state
        if entry is None:
            return entry
        if "k8" in entry:
            if inputs.page_table is not None:
                return _fp8_keys_paged(entry, inputs)
            if inputs.phase == "prefill":
                k8, mean, mult = fp8_decode_keys(inputs.k_cache, jnp.asarray(inputs.kv_len, jnp.int32))
                return {"k8": k8, "mean": mean, "mult": mult}
            pos = jnp.broadcast_to(jnp.asarray(inputs.q_start, jnp.int32), (inputs.k_cache.shape[0],))
            new = jnp.take_along_axis(inputs.k_cache, jnp.clip(pos, 0, inputs.k_cache.shape[1] - 1)[:, None, None,
                                                                                                   None], axis=1)
            k8 = write_token(entry["k8"], fp8_decode_token(new, entry["mean"], entry["mult"]), pos)
            return dict(entry, k8=k8)
        if inputs.phase != "prefill":
            return entry
        return prefill_keys_update(self.config, entry, inputs.q, inputs.k_cache, inputs.q_start, inputs.kv_len,
                                   inputs.seq_len)

    def attend(self, layer: int, inputs, state: Any):
        cfg = self.config
        if not 0 <= layer < cfg.num_layers:
            raise ValueError(f"layer must lie in [0, {cfg.num_layers - 1}] for this config, got {layer}")
        self._check_shards(inputs.shards, inputs.k_cache.shape[2])
        if inputs.page_table is not None and inputs.phase == "prefill":
            inputs = _contiguous_view(inputs)  # prefill gathers the chunk's sequences' pages (see _contiguous_view)
        if inputs.phase == "prefill" and cfg.decode_only:
            out = dense_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.q_start, inputs.kv_len,
                                  phase="prefill", chunk_at_zero=inputs.chunk_at_zero)
            return out, state
        if not cfg.is_anchor(layer) and state is None:
            raise ValueError(f"reuse layer {layer} got no anchor state; layer 0 must run first in the same forward")
        if inputs.phase in ("prefill", "decode") and self.dense_unread(layer, inputs.phase):
            if inputs.phase == "decode" and inputs.page_table is not None:
                out = dense_attention_paged(inputs.q, inputs.k_cache, inputs.v_cache, inputs.page_table,
                                            inputs.q_start, inputs.kv_len, phase="decode", chunk_at_zero=False)
            else:
                out = dense_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.q_start, inputs.kv_len,
                                      phase=inputs.phase, chunk_at_zero=inputs.chunk_at_zero)
            return out, None
        if inputs.phase == "decode":
            return self._decode(layer, inputs, state)
        if inputs.phase == "prefill":
            return self._prefill(layer, inputs, state)
        raise ValueError(f"phase must be 'prefill' or 'decode', got {inputs.phase!r}")

    def post_attention(self, layer, x, attn_out, state):
        return state

    def dense_unread(self, layer: int, phase: str) -> bool:
        """An anchor whose output is dense in `phase` and whose indices no layer reads (the next layer is an anchor,
        or it is the last): it runs the models' dense attention and selects nothing (layer 0 of the 0.5B's anchors
        0, 1, ...: its Top-k pass would cost ~0.5 of a dense layer for nothing). Its state is None."""
        cfg = self.config
        if not cfg.is_anchor(layer):
            return False
        dense = (cfg.decode_dense(layer) if phase == "decode"
                 else (layer == 0 and cfg.layer0_dense) or cfg.prefill_dense_anchors)
        read = any(cfg.anchor_of(x) == layer for x in range(layer + 1, cfg.num_layers))
        return dense and not read

    # on a mesh (models/sharding.py) ---------------------------------------------------------------------------
    def state_spec(self, layer: int, phase: str, shards):
        """idx [batch -> batch_axis, idx_heads -> head_axis, ...] and counts [batch -> batch_axis, ...]; idx is
        whole over the heads (gathered by its anchor) when a reuse layer reads an index head of another shard."""
        P = jax.sharding.PartitionSpec
        cfg = self.config
        self._check_shards(shards, None)
        if (phase == "prefill" and cfg.decode_only) or self.dense_unread(layer, phase):
            return P()
        heads = None if self._gathers(cfg.anchor_of(layer), shards.head_shards) else shards.head_axis
        return {"idx": P(shards.batch_axis, heads), "counts": P(shards.batch_axis)}

    def _check_shards(self, shards, local_kv: int | None):
        cfg = self.config
        split = shards is not None and shards.head_axis is not None
        if split and cfg.pool == "all":
            raise ValueError("pool='all' (all_heads_pooled) pools scores over every query head, which a mesh splits "
                             f"over {shards.head_shards} head shards; run it with a mesh of model size 1 "
                             "(data parallelism only) or without a mesh")
        if local_kv is None:
            return
        want = cfg.kv_heads // shards.head_shards if split else cfg.kv_heads
        if local_kv != want or (split and cfg.kv_heads % shards.head_shards):
            where = f" on each of {shards.head_shards} head shards" if split else ""
            raise ValueError(f"config has kv_heads={cfg.kv_heads} but the cache has {local_kv} heads{where}")

    def _gathers(self, anchor: int, head_shards: int) -> bool:
        """Whether some reuse layer reading `anchor`'s indices maps a KV head to an index head of another shard."""
        cfg = self.config
        if head_shards == 1 or cfg.oracle_topk or cfg.pool == "all":
            return False
        per = cfg.kv_heads // head_shards
        return any(cfg.anchor_of(layer) == anchor and not cfg.is_anchor(layer)
                   and any(r // per != h // per for h, r in enumerate(cfg.head_map_row(layer)))
                   for layer in range(anchor + 1, cfg.num_layers))

    def _gather_anchor(self, layer: int, idx, shards):
        """An anchor's idx [batch, local heads, ...], all-gathered over the head axis when _gathers says so."""
        if shards is None or shards.head_axis is None or not self._gathers(layer, shards.head_shards):
            return idx
        return lax.all_gather(idx, shards.head_axis, axis=1, tiled=True)

    def _reuse_indices(self, layer: int, idx, shards, local_kv: int):
        """(idx, head_map_row) for a reuse layer's local KV heads. Unsharded: the state and the config's row. On a
        head-split mesh: idx re-ordered so that local head j reads row j (the kernels' row is then the identity)."""
        cfg = self.config
        row = cfg.head_map_row(layer)
        if shards is None or shards.head_axis is None:
            return idx, row
        gathered = self._gathers(cfg.anchor_of(layer), shards.head_shards)
        if row == tuple(range(cfg.kv_heads)) and not gathered:
            return idx, tuple(range(local_kv))
        shard = lax.axis_index(shards.head_axis)
        table = jnp.asarray(row, jnp.int32).reshape(shards.head_shards, local_kv)[shard]  # [local_kv] index heads
        if not gathered:
            table = table - shard * local_kv
        return jnp.take(idx, table, axis=1), tuple(range(local_kv))

    # phases ---------------------------------------------------------------------------------------------------
    def _decode(self, layer, inputs, state):
        cfg, kern = self.config, get_kernels(self.kernels)
        q, k, v, kv_len = inputs.q, inputs.k_cache, inputs.v_cache, inputs.kv_len
        if inputs.page_table is not None:
            return self._decode_paged(layer, kern, inputs, state, cfg.head_map_row(layer))
        if cfg.is_anchor(layer):
            row = tuple(range(k.shape[2])) if cfg.pool != "all" else cfg.head_map_row(layer)
            acfg, dense = rerank_config(cfg), cfg.decode_dense(layer)
            fp8 = {"score_keys": self._fp8_keys(layer, inputs)} if self._keeps_fp8_keys(layer) else {}
            out, idx, counts = kern.anchor_decode(q, k, v, kv_len, cfg=acfg, k_max=static_k_max(acfg, k.shape[1]),
                                                  dense=dense, head_map_row=row, **fp8)
            if cfg.decode_rerank_layers is not None:
                idx = order_candidates(q, _rows_contiguous(k), kv_len, idx, cfg, static_k_max(cfg, k.shape[1]),
                                       kern.select_topk, _logits_fn(kern, q, k, kv_len))
            if cfg.decode_tail_stride and not dense:
                # the anchor's sparse output again, with its lse (one more reuse pass: the anchor kernel keeps it)
                out = _with_tail(kern, cfg, q, k, v, kv_len, idx, counts, row)
            return out, {"idx": self._gather_anchor(layer, idx, inputs.shards), "counts": counts}
        if cfg.decode_dense(layer):  # decode_dense_layers: every key, and the anchor's state passes on
            return dense_attention(q, k, v, inputs.q_start, kv_len, phase="decode", chunk_at_zero=False), state
        idx, row = self._reuse_indices(layer, state["idx"], inputs.shards, k.shape[2])
        if cfg.reranks(layer):
            cand = jnp.take(idx, jnp.asarray(row), axis=1)
            idx, counts = rerank_decode(q, _rows_contiguous(k), kv_len, cand, cfg, static_k_max(cfg, k.shape[1]),
                                        kern.select_topk, _logits_fn(kern, q, k, kv_len))
            return kern.reuse_decode(q, k, v, kv_len, idx, counts, tuple(range(k.shape[2]))), state
        if cfg.decode_rerank > 1:  # the anchor's own Top-k: the first k of its ordered candidates
            idx, counts = _first(idx, decode_budget(cfg, kv_len), static_k_max(cfg, k.shape[1]))
            return kern.reuse_decode(q, k, v, kv_len, idx, counts, row), state
        if cfg.decode_tail_stride:
            return _with_tail(kern, cfg, q, k, v, kv_len, idx, state["counts"], row), state
        if cfg.decode_prefill_keys:  # the anchor's indices and this layer's own prefill set, each key once
            if inputs.cache_state is None:
                raise ValueError(f"decode_prefill_keys: reuse layer {layer} got no cache state; prefill with "
                                 "models.generate.prefill into the same KVCache first")
            if cfg.pool != "all":
                idx, row = jnp.take(idx, jnp.asarray(row), axis=1), tuple(range(k.shape[2]))
            idx, counts = union_indices(idx, inputs.cache_state["idx"], k.shape[1])
            return kern.reuse_decode(q, k, v, kv_len, idx, counts, row), state
        return kern.reuse_decode(q, k, v, kv_len, idx, state["counts"], row), state

    def _decode_paged(self, layer, kern, inputs, state, row):
        """Decode through the page table, inside the kernels (no contiguous copy of the cache)."""
        cfg, pt = self.config, inputs.page_table
        if kern.paged_anchor_decode is None or kern.paged_reuse_decode is None:
            raise ValueError(f"kernels {self.kernels!r} have no paged decode (Kernels.paged_anchor_decode / "
                             "paged_reuse_decode); use the contiguous KVCache or kernels='reference' / 'pallas'")
        if cfg.decode_tail_stride:
            raise ValueError("decode_tail_stride is not implemented for paged caches yet: use the contiguous KVCache "
                             "or a recipe without the sampled tail")
        q, k, v, kv_len = inputs.q, inputs.k_cache, inputs.v_cache, inputs.kv_len
        max_len = pt.shape[1] * k.shape[1]  # the logical capacity stands in for the contiguous max_len
        if cfg.is_anchor(layer):
            acfg = rerank_config(cfg)
            fp8 = {"score_keys": self._fp8_keys(layer, inputs)} if self._keeps_fp8_keys(layer) else {}
            out, idx, counts = kern.paged_anchor_decode(q, k, v, pt, kv_len, cfg=acfg,
                                                        k_max=static_k_max(acfg, max_len),
                                                        dense=cfg.decode_dense(layer), head_map_row=row, **fp8)
            if cfg.decode_rerank_layers is not None:
                idx = order_candidates(q, _rows_paged(k, pt), kv_len, idx, cfg, static_k_max(cfg, max_len),
                                       kern.select_topk)
            return out, {"idx": idx, "counts": counts}
        if cfg.decode_dense(layer):  # decode_dense_layers: DenseStrategy's paged decode, the anchor's state passes on
            return dense_attention_paged(q, k, v, pt, inputs.q_start, kv_len, phase="decode",
                                         chunk_at_zero=False), state
        if cfg.reranks(layer):
            cand = jnp.take(state["idx"], jnp.asarray(row), axis=1)
            idx, counts = rerank_decode(q, _rows_paged(k, pt), kv_len, cand, cfg, static_k_max(cfg, max_len),
                                        kern.select_topk)
            return kern.paged_reuse_decode(q, k, v, pt, kv_len, idx, counts, tuple(range(k.shape[2]))), state
        if cfg.decode_rerank > 1:  # the anchor's own Top-k: the first k of its ordered candidates
            idx, counts = _first(state["idx"], decode_budget(cfg, kv_len), static_k_max(cfg, max_len))
            return kern.paged_reuse_decode(q, k, v, pt, kv_len, idx, counts, row), state
        return kern.paged_reuse_decode(q, k, v, pt, kv_len, state["idx"], state["counts"], row), state

    def _prefill(self, layer, inputs, state):
        cfg, kern = self.config, get_kernels(self.kernels)
        q, k, v = inputs.q, inputs.k_cache, inputs.v_cache
        q_len, ts = q.shape[1], cfg.tile_size
        anchor = cfg.is_anchor(layer)
        dense = anchor and ((layer == 0 and cfg.layer0_dense) or cfg.prefill_dense_anchors)
        if anchor:
            row = tuple(range(k.shape[2])) if cfg.pool != "all" else cfg.head_map_row(layer)
        else:
            reuse_idx, row = self._reuse_indices(layer, state["idx"], inputs.shards, k.shape[2])
        k_max = static_k_max(cfg, k.shape[1], "prefill")
        # Static blocks of whole tiles (a block never splits a tile, so per-tile results are unchanged).
        block = q_len if kern.query_block is None else max(ts, kern.query_block // ts * ts)
        outs, idxs, counts_all = [], [], []
        for b0 in range(0, q_len, block):
            b1 = min(q_len, b0 + block)
            qb, q_start = q[:, b0:b1], inputs.q_start + b0
            t0, t1 = b0 // ts, -(-b1 // ts)
            if anchor:
                out, idx, counts = kern.anchor_prefill(qb, k, v, q_start, inputs.kv_len, inputs.seq_len, cfg=cfg,
                                                       k_max=k_max, dense=dense, head_map_row=row,
                                                       chunk_at_zero=inputs.chunk_at_zero and b0 == 0)
                if cfg.prefill_key_block > 1 and idx.shape[-1] != prefill_width(cfg, k_max):
                    raise ValueError(f"kernels {self.kernels!r} ignore prefill_key_block={cfg.prefill_key_block}: "
                                     f"anchor idx width {idx.shape[-1]}, want {prefill_width(cfg, k_max)}")
                idxs.append(idx)
                counts_all.append(counts)
            else:
                out = kern.reuse_prefill(qb, k, v, q_start, inputs.kv_len, reuse_idx[:, :, t0:t1],
                                         state["counts"][:, t0:t1], row, ts, key_block=cfg.prefill_key_block)
            outs.append(out)
        out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
        if cfg.dense_suffix and not dense:
            out = _dense_suffix(inputs, out, cfg.dense_suffix)
        if anchor:
            idx = jnp.concatenate(idxs, axis=2)
            counts = jnp.concatenate(counts_all, axis=1)
            state = {"idx": self._gather_anchor(layer, idx, inputs.shards), "counts": counts}
        return out, state
