"""Pure-JAX reference semantics of every attention kernel in this package.

These functions are the readable statement of what the Pallas kernels compute, and they are what the
Kascade strategies run on CPU. They are written for clarity, not speed: each call materialises the
scores of one layer for the query rows it is given (`[batch, heads, q_len, keys]` fp32), never more.
Layouts follow `models/README.md`.

Rules fixed here and used by the kernels too:
- Budget: `k = min(max(floor(topk_frac * L), min_k), L)`, computed exactly in integers (`topk_budget`).
  Decode: L is the cache length (current token included); every valid key may be selected; nothing is
  forced unless asked (below). Prefill: tile t (start s_t) selects among keys strictly before s_t; with rolling budgets
  L = s_t, else L = the sequence's length; the tile's own causal block is always attended on top.
  So a tile whose prefix fits in its budget (s_t <= min_k) is exactly dense.
- Pooled scores are post-softmax probabilities (fp32, per query row normalised over all keys it may see)
  summed over the GQA group (`pool="gqa"`) or over all query heads (`pool="all"`), and in prefill also
  over the valid queries of the tile. `pool="pre_softmax"` ranks keys by the logits of the mean query
  vector of the group (and tile) instead, the paper's pre-softmax ablation.
- Indices are a set: order unspecified, ranks past the count hold -1.
- Forced keys (`sinks`, `window`, both default 0): the first `sinks` keys and the `window` keys just before the
  query (decode: the last `window` valid keys, the current token included; prefill: the `window` keys just
  before the tile) get the score `FORCED_SCORE` before the Top-k, so they are always selected and count against
  the budget (callers keep sinks + window <= min_k, so they always fit). FORCED_SCORE = 2**20 exceeds every
  post-softmax pooled score (a sum of at most q_heads * tile_size <= 2**20 probabilities).
- Key blocks (prefill, `key_block` kb > 1): tiles select aligned blocks of kb keys instead of keys. A block scores
  the sum of its eligible keys' pooled scores, the budget is min(ceil(k / kb), eligible blocks) blocks, and idx
  holds each selected block's kb consecutive ids (`select_blocks_reference`); kb = 1 is the key selection.
- fp8 scores (prefill, `score_fp8`): an anchor whose output is sparse (not layer 0's dense pass) may score keys
  from fp8 copies of q and k (`fp8_score_operands`): k minus its mean over the chunk's valid keys (per sequence, KV
  head and channel: every logit of a query row moves by the same amount, so the softmax is unchanged), each tensor
  scaled by a power of two (its amax to <= 448) and rounded to float8_e4m3fn. The pooled scores are then those of
  the widened fp8 values (`fp8_widen`), normaliser included.
- fp8 decode scores (`decode_score_fp8`): a decode anchor whose output is sparse may score keys from an fp8 copy of
  its K cache kept beside it (`fp8_decode_keys` at prefill, `fp8_decode_token` for each later key: centred on the
  prompt's mean key, one power-of-two scale per sequence) with q in its own dtype (`fp8_decode_q`); its pooled scores
  are those of the widened copy, normaliser included.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

FORCED_SCORE = float(2 ** 20)  # the score of a forced key (sinks, recent window): above any pooled probability
_FRAC_DEN = 10_000  # topk_frac resolution: budgets are exact integer arithmetic in units of 1e-4


def frac_numerator(topk_frac: float) -> int:
    """topk_frac as an integer numerator over 10_000, raising if it is not representable."""
    # the range check runs first (`0 < nan` is false): round() of nan or inf would raise its own, unclear error
    if not (0.0 < topk_frac <= 1.0) or abs(round(topk_frac * _FRAC_DEN) - topk_frac * _FRAC_DEN) > 1e-6:
        raise ValueError(f"topk_frac must be in (0, 1] and a multiple of 1e-4, got {topk_frac!r}")
    return round(topk_frac * _FRAC_DEN)


def topk_budget(length, topk_frac: float, min_k: int):
    """k = min(max(floor(topk_frac * length), min_k), length), exact for int32 lengths up to 2**31 / 1e4 * 1e4."""
    num = frac_numerator(topk_frac)
    if isinstance(length, int):
        return min(max((length * num) // _FRAC_DEN, min_k), length)
    length = jnp.asarray(length, jnp.int32)
    k = (length // _FRAC_DEN) * num + ((length % _FRAC_DEN) * num) // _FRAC_DEN
    return jnp.minimum(jnp.maximum(k, min_k), length)


def max_budget(max_len: int, topk_frac: float, min_k: int) -> int:
    """Static width of an index buffer that can hold the budget of any length <= max_len."""
    return max(1, topk_budget(max_len, topk_frac, min_k))


E4M3_MAX = 448.0


def fp8_scale(x):
    """A power of two s with max|x| * s <= E4M3_MAX (fp32 scalar; 1 for an all-zero x): x * s rounds to
    float8_e4m3fn without saturating, and dividing by s is exact."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    # frexp / ldexp, not exp2(floor(log2)): XLA's exp2 on the CPU gave 0.9999995 * 2^13 (session 29)
    _, e = jnp.frexp(E4M3_MAX / jnp.where(amax > 0, amax, 1.0))  # E4M3_MAX / amax in [2^(e-1), 2^e)
    return jnp.where(amax > 0, jnp.ldexp(jnp.float32(1.0), e - 1), 1.0)


def _centred_keys(k, kv_len):
    """k [batch, keys, kv_heads, d] in fp32 minus its mean over each sequence's valid keys (< kv_len), per KV head and
    channel, 0 past kv_len -> (centred k, mean [batch, 1, kv_heads, d])."""
    kf = k.astype(jnp.float32)
    valid = (jnp.arange(k.shape[1])[None, :] < kv_len[:, None])[:, :, None, None]
    n = jnp.maximum(jnp.sum(valid, axis=1, keepdims=True), 1)
    mean = jnp.sum(jnp.where(valid, kf, 0.0), axis=1, keepdims=True) / n
    return jnp.where(valid, kf - mean, 0.0), mean


def fp8_score_operands(q, k, kv_len):
    """The fp8 score operands of a prefill chunk: q [batch, q_len, q_heads, d], k [batch, keys, kv_heads, d] (the
    cache), kv_len [batch] -> (q8, k8 float8_e4m3fn like q and k, mult fp32 [1]) with q.k ~ (q8.k8) * mult up to a
    per-row constant: k is centred on its mean over the valid keys (< kv_len) of each sequence and KV head, and
    mult = 1 / (s_q s_k) undoes the two power-of-two scales."""
    kc, _ = _centred_keys(k, kv_len)
    s_q, s_k = fp8_scale(q), fp8_scale(kc)
    q8 = (q.astype(jnp.float32) * s_q).astype(jnp.float8_e4m3fn)
    k8 = (kc * s_k).astype(jnp.float8_e4m3fn)
    return q8, k8, jnp.reshape(1.0 / (s_q * s_k), (1,))


def fp8_widen(x8, mult, dtype):
    """An fp8 operand back in `dtype`, with `mult` (a power of two, from `fp8_score_operands`) folded in: q8 * mult
    for q, and the k8 unchanged (mult None): q8.k8 * mult == widen(q8, mult).widen(k8) exactly in fp32."""
    x = x8.astype(jnp.float32)
    return (x if mult is None else x * mult[0]).astype(dtype)


def fp8_score_qk(q, k, kv_len):
    """The score operands of an fp8-scoring anchor (`fp8_score_operands`) widened back to q's and k's dtypes:
    (q8 * mult, k8), whose logits are exactly the fp8 kernels' (q8.k8 * mult in fp32)."""
    q8, k8, mult = fp8_score_operands(q, k, kv_len)
    return fp8_widen(q8, mult, q.dtype), fp8_widen(k8, None, k.dtype)


def fp8_decode_keys(k, kv_len):
    """The decode anchors' fp8 key copy (`decode_score_fp8`): k [batch, keys, kv_heads, d], kv_len [batch] ->
    (k8 float8_e4m3fn like k, mean [batch, 1, kv_heads, d] fp32, mult [batch] fp32). Each sequence's keys are centred
    on their mean over its valid keys (< kv_len; per KV head and channel: a decode logit row moves by q.mean, so its
    softmax is unchanged) and scaled by a power of two s (that sequence's amax to <= 448); mult = 1 / s, folded into
    q (exact: a power of two). Keys past kv_len are 0. Later keys go through `fp8_decode_token` with the same mean
    and scale."""
    kc, mean = _centred_keys(k, kv_len)
    s = jax.vmap(fp8_scale)(kc)  # [batch]
    k8 = (kc * s[:, None, None, None]).astype(jnp.float8_e4m3fn)
    return k8, mean, 1.0 / s


def fp8_decode_token(k_new, mean, mult):
    """New keys [batch, t, kv_heads, d] in the fp8 copy's coding (`fp8_decode_keys`' mean and mult), saturated to
    +-448 (a key further out than the prompt's keys keeps its sign and direction's clipped size, never a NaN)."""
    x = (k_new.astype(jnp.float32) - mean) / mult[:, None, None, None]
    return jnp.clip(x, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def fp8_decode_q(q, mult):
    """q [batch, 1, q_heads, d] with the fp8 copy's mult [batch] folded in (a power of two: exact in q's dtype
    unless it leaves q's exponent range): (q * mult).widen(k8) = q.(k - mean) up to the fp8 rounding of k."""
    return (q.astype(jnp.float32) * mult[:, None, None, None]).astype(q.dtype)


def fp8_decode_q16(q, mult):
    """q [batch, 1, q_heads, d] and the fp8 copy's mult [batch] -> (q16 float16 like q, inv fp32 [batch]): q * mult
    times a power of two s per sequence (its amax to [2^13, 2^14)) in float16, inv = 1 / s. A bf16 q's 8 significant
    bits fit float16's 11, so q16 * inv == `fp8_decode_q(q, mult)` exactly (but for elements 2^27 below the amax,
    float16 subnormals), and the fp8 copy widens to float16 exactly with one conversion per two values, where
    widening to bf16 costs a second conversion per value (`DecodeTuning.stream_fp8_f16`)."""
    x = q.astype(jnp.float32) * mult[:, None, None, None]
    amax = jnp.max(jnp.abs(x), axis=(1, 2, 3))
    _, e = jnp.frexp(jnp.where(amax > 0, amax, 1.0))  # amax in [2^(e-1), 2^e)
    s = jnp.where(amax > 0, jnp.ldexp(jnp.float32(1.0), 14 - e), 1.0)
    return (x * s[:, None, None, None]).astype(jnp.float16), 1.0 / s


def fp8_decode_qk(q, score_keys, dtype):
    """The score operands of a decode anchor on the fp8 K copy (score_keys = (k8, mult)): (q * mult, k8 widened to
    `dtype`), whose logits are the kernels' (q * mult against k8 widened in registers)."""
    k8, mult = score_keys
    return fp8_decode_q(q, mult), k8.astype(dtype)


def check_forced(sinks: int, window: int) -> None:
    for name, v in (("sinks", sinks), ("window", window)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")


def forced_decode_mask(kv_len, num_keys: int, sinks: int, window: int):
    """[batch, keys] bool: the first `sinks` keys and the last `window` valid keys (current token included)."""
    keys = jnp.arange(num_keys)[None, :]
    kv_len = jnp.asarray(kv_len, jnp.int32)[:, None]
    return (keys < kv_len) & ((keys < sinks) | (keys >= kv_len - window))


def forced_prefill_mask(tile_start, eligible, num_keys: int, sinks: int, window: int):
    """[batch, tiles, keys] bool: among each tile's eligible keys [0, eligible), the first `sinks` and the `window`
    keys just before the tile start."""
    keys = jnp.arange(num_keys)[None, None, :]
    ts, el = tile_start[:, :, None], eligible[:, :, None]
    return (keys < el) & ((keys < sinks) | ((keys >= ts - window) & (keys < ts)))


def _group(q_heads: int, kv_heads: int) -> int:
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    return q_heads // kv_heads


def visible_mask(q_start, kv_len, q_len: int, num_keys: int):
    """[batch, q_len, keys] bool: key j visible to query row t iff j <= q_start + t and j < kv_len."""
    pos = q_start[:, None] + jnp.arange(q_len)[None, :]  # [batch, q_len]
    keys = jnp.arange(num_keys)
    return (keys[None, None, :] <= pos[:, :, None]) & (keys[None, None, :] < kv_len[:, None, None])


def _logits(q, k, scale):
    """[batch, kv_heads, group, q_len, keys] fp32."""
    b, t, hq, d = q.shape
    kvh = k.shape[2]
    g = _group(hq, kvh)
    qf = q.astype(jnp.float32).reshape(b, t, kvh, g, d)
    return jnp.einsum("btkgd,bskd->bkgts", qf, k.astype(jnp.float32)) * scale


def attention_reference(q, k, v, q_start, kv_len, *, mask=None, scale=None, return_lse=False):
    """Softmax attention restricted to causal & valid keys (& `mask`, broadcastable to [batch, kv_heads, q_len, keys]).

    q: [batch, q_len, q_heads, d]; k, v: [batch, keys, kv_heads, d]. Returns out [batch, q_len, q_heads, d] in
    q's dtype, and with `return_lse` also lse [batch, q_len, q_heads] fp32. A row with no visible key gives 0.
    """
    b, t, hq, d = q.shape
    kvh = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    logits = _logits(q, k, scale)
    allowed = visible_mask(q_start, kv_len, t, k.shape[1])[:, None, None]
    if mask is not None:
        allowed = allowed & jnp.asarray(mask)[:, :, None]
    logits = jnp.where(allowed, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [batch, kv_heads, group, q_len]
    safe_lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    p = jnp.where(allowed, jnp.exp(logits - safe_lse[..., None]), 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32)).reshape(b, t, hq, d).astype(q.dtype)
    if return_lse:
        return out, jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, t, hq)
    return out


def attention_reference_rows(q, k, v, q_start, kv_len, block: int, mask_fn=None):
    """`attention_reference` over blocks of `block` query rows in sequence (lax.map), so that at most [batch, q_heads,
    block, keys] scores exist at once. mask_fn(q_start of the block, its rows) -> that block's `mask` (or None). The
    last block is padded; its padded rows are dropped."""
    b, t = q.shape[:2]

    def rows(qr, start):
        mask = None if mask_fn is None else mask_fn(start, qr.shape[1])
        return attention_reference(qr, k, v, start, kv_len, mask=mask)

    if t <= block:
        return rows(q, q_start)
    n = -(-t // block)
    qb = jnp.pad(q, ((0, 0), (0, n * block - t), (0, 0), (0, 0))).reshape(b, n, block, *q.shape[2:])
    out = jax.lax.map(lambda i: rows(qb[:, i], q_start + i * block), jnp.arange(n))  # [n, batch, block, q_heads, d]
    return jnp.moveaxis(out, 0, 1).reshape(b, n * block, *q.shape[2:])[:, :t]


def _probs(q, k, q_start, kv_len, scale):
    """Post-softmax probabilities [batch, kv_heads, group, q_len, keys] fp32 over causal & valid keys."""
    logits = _logits(q, k, scale)
    allowed = visible_mask(q_start, kv_len, q.shape[1], k.shape[1])[:, None, None]
    logits = jnp.where(allowed, logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    return jnp.where(allowed, jnp.exp(logits - jnp.where(jnp.isfinite(lse), lse, 0.0)), 0.0)


def pooled_scores_decode_reference(q, k, kv_len, *, pool="gqa", scale=None, sinks=0, window=0):
    """Anchor scores of one decode token per sequence: [batch, idx_heads, keys] fp32, -inf on invalid keys.

    q: [batch, 1, q_heads, d] at position kv_len - 1. idx_heads = kv_heads, or 1 for pool="all". Forced keys
    (sinks / window, see the module docstring) score FORCED_SCORE.
    """
    check_forced(sinks, window)
    b, t, hq, d = q.shape
    if t != 1:
        raise ValueError(f"decode takes one query token per sequence, got q_len={t}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q_start = kv_len - 1
    valid = jnp.arange(k.shape[1])[None, :] < kv_len[:, None]  # [batch, keys]
    if pool == "pre_softmax":
        qm = jnp.mean(q.astype(jnp.float32).reshape(b, 1, k.shape[2], -1, d), axis=3, keepdims=True)
        s = _logits(qm.reshape(b, 1, k.shape[2], d), k, scale)[:, :, 0, 0]  # [batch, kv_heads, keys]
    else:
        p = _probs(q, k, q_start, kv_len, scale)[:, :, :, 0]  # [batch, kv_heads, group, keys]
        s = p.sum(axis=2)
        if pool == "all":
            s = s.sum(axis=1, keepdims=True)
        elif pool != "gqa":
            raise ValueError(f"pool must be 'gqa', 'all' or 'pre_softmax', got {pool!r}")
    if sinks or window:
        s = jnp.where(forced_decode_mask(kv_len, k.shape[1], sinks, window)[:, None, :], FORCED_SCORE, s)
    return jnp.where(valid[:, None, :], s, -jnp.inf)


def pooled_scores_prefill_reference(q, k, q_start, kv_len, tile_size: int, *, pool="gqa", scale=None, sinks=0,
                                    window=0):
    """Anchor scores of a prefill chunk, pooled per query tile.

    Returns (scores [batch, idx_heads, tiles, keys] fp32 with -inf on keys not strictly before the tile or
    invalid, diag [batch, idx_heads, tiles] fp32: the pooled mass the tile puts on its own causal block).
    q_start must be a multiple of tile_size; queries at positions >= kv_len (padding) are left out of the pool.
    Forced keys (sinks / window before each tile) score FORCED_SCORE.
    """
    check_forced(sinks, window)
    b, t, hq, d = q.shape
    kvh, s_len = k.shape[2], k.shape[1]
    g = _group(hq, kvh)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    n_tiles = -(-t // tile_size)
    pad = n_tiles * tile_size - t
    pos = q_start[:, None] + jnp.arange(n_tiles * tile_size)[None, :]  # [batch, rows]
    row_valid = (pos < kv_len[:, None]) & (jnp.arange(n_tiles * tile_size) < t)[None, :]
    tile_start = q_start[:, None] + jnp.arange(n_tiles)[None, :] * tile_size  # [batch, tiles]
    keys = jnp.arange(s_len)
    before = (keys[None, None, :] < tile_start[:, :, None]) & (keys[None, None, :] < kv_len[:, None, None])
    in_diag = (keys[None, None, :] >= tile_start[:, :, None]) & (keys[None, None, :] < tile_start[:, :, None] + tile_size)
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    if pool == "pre_softmax":
        w = row_valid.astype(jnp.float32).reshape(b, n_tiles, tile_size, 1, 1, 1)
        qt = qp.astype(jnp.float32).reshape(b, n_tiles, tile_size, kvh, g, d)
        qm = (qt * w).sum(axis=(2, 4)) / jnp.maximum(w.sum(axis=(2, 4)), 1.0)  # [batch, tiles, kv_heads, d]
        sc = jnp.einsum("btkd,bskd->bkts", qm, k.astype(jnp.float32)) * scale
        diag = jnp.zeros(sc.shape[:3], jnp.float32)
    else:
        p = _probs(qp, k, q_start, kv_len, scale)  # [batch, kv_heads, group, rows, keys]
        p = p * row_valid[:, None, None, :, None]
        p = p.reshape(b, kvh, g, n_tiles, tile_size, s_len).sum(axis=(2, 4))  # [batch, kv_heads, tiles, keys]
        if pool == "all":
            p = p.sum(axis=1, keepdims=True)
        elif pool != "gqa":
            raise ValueError(f"pool must be 'gqa', 'all' or 'pre_softmax', got {pool!r}")
        diag = jnp.sum(jnp.where(in_diag[:, None], p, 0.0), axis=-1)
        sc = p
    if sinks or window:
        eligible = jnp.minimum(tile_start, kv_len[:, None])
        sc = jnp.where(forced_prefill_mask(tile_start, eligible, s_len, sinks, window)[:, None], FORCED_SCORE, sc)
    return jnp.where(before[:, None], sc, -jnp.inf), diag


def pooled_scores_rows_reference(q, k, q_start, kv_len, row_mask, *, pool="gqa", scale=None):
    """Post-softmax probabilities (causal, keys < kv_len) of the query rows q [batch, rows, q_heads, d] at positions
    q_start.., summed over the rows where row_mask [batch, rows] and over the pool -> [batch, idx_heads, keys] fp32
    (0 on keys no pooled row sees). The decode_prefill_keys lever's scores of the prompt's last tile."""
    if pool not in ("gqa", "all"):
        raise ValueError(f"pool must be 'gqa' or 'all', got {pool!r}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    p = _probs(q, k, q_start, kv_len, scale)  # [batch, kv_heads, group, rows, keys]
    s = jnp.where(row_mask[:, None, None, :, None], p, 0.0).sum(axis=(2, 3))  # [batch, kv_heads, keys]
    return s.sum(axis=1, keepdims=True) if pool == "all" else s


def select_topk_reference(scores, counts, k_max: int):
    """Top-`counts` keys of `scores` [..., keys] (-inf = not eligible) -> indices [..., k_max] int32, -1 past the count.

    counts broadcasts against scores.shape[:-1]. Fewer eligible keys than the count yield fewer indices.
    """
    k_max = min(k_max, scores.shape[-1])
    vals, idx = jax.lax.top_k(scores, k_max)
    valid = (jnp.arange(k_max) < jnp.asarray(counts)[..., None]) & jnp.isfinite(vals)
    return jnp.where(valid, idx, -1).astype(jnp.int32)


def gathered_logits(q, kc):
    """Unscaled fp32 logits of every query head at gathered K rows: q [batch, 1, q_heads, d], kc [batch, kv_heads,
    C, d] (the cache's dtype) -> [batch, kv_heads, group, C]."""
    b, _, hq, d = q.shape
    kvh = kc.shape[1]
    qg = q[:, 0].astype(kc.dtype).reshape(b, kvh, hq // kvh, d)
    return jnp.einsum("bhgd,bhcd->bhgc", qg, kc, precision=jax.lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32)


def candidate_logits_reference(q, k_cache, kv_len, cand, *, scale: float):
    """`decode.candidate_logits` in plain JAX: gather the candidates' K rows, then `gathered_logits`, scaled; -inf
    where cand is -1 or >= kv_len."""
    b, kvh = cand.shape[:2]
    valid = (cand >= 0) & (cand < kv_len[:, None, None])
    kc = k_cache[jnp.arange(b)[:, None, None], jnp.maximum(cand, 0), jnp.arange(kvh)[None, :, None]]
    return jnp.where(valid[:, :, None, :], gathered_logits(q, kc) * scale, -jnp.inf)


def decode_counts(kv_len, topk_frac: float, min_k: int):
    """[batch] decode budgets."""
    return topk_budget(kv_len, topk_frac, min_k)


def prefill_eligible(q_start, kv_len, q_len: int, tile_size: int):
    """(tile_start, eligible) [batch, tiles]: each tile's first position and eligible keys min(tile_start, kv_len)."""
    n_tiles = -(-q_len // tile_size)
    tile_start = q_start[:, None] + jnp.arange(n_tiles)[None, :] * tile_size
    return tile_start, jnp.minimum(tile_start, kv_len[:, None])


def prefill_counts(q_start, kv_len, seq_len, q_len: int, tile_size: int, topk_frac: float, min_k: int, rolling=True,
                   extra: int = 0):
    """[batch, tiles] prefill budgets: over the tile's prefix (rolling) or the whole sequence, plus `extra` keys (a
    local window selected on top of the budget), clamped to the eligible keys."""
    if isinstance(extra, bool) or not isinstance(extra, int) or extra < 0:
        raise ValueError(f"extra must be an int >= 0, got {extra!r}")
    tile_start, eligible = prefill_eligible(q_start, kv_len, q_len, tile_size)
    base = tile_start if rolling else jnp.broadcast_to(seq_len[:, None], tile_start.shape)
    return jnp.minimum(topk_budget(base, topk_frac, min_k) + extra, eligible).astype(jnp.int32)


def check_key_block(key_block: int, tile_size: int) -> None:
    if isinstance(key_block, bool) or not isinstance(key_block, int) or key_block < 1 or tile_size % key_block:
        raise ValueError(f"key_block must be an int >= 1 dividing tile_size ({tile_size}), got {key_block!r}")


def index_width(k: int, key_block: int) -> int:
    """Prefill index width for budgets of at most k keys: k for single keys; for key blocks whole 128-lane steps (the
    block reuse reads a step's ids at a time, so nothing pads the index buffer)."""
    return k if key_block == 1 else -(-k // 128) * 128


def block_scores(scores, key_block: int):
    """Key scores [..., keys] (-inf = ineligible) -> block scores [..., ceil(keys / key_block)]: the sum of each
    aligned block's eligible keys, -inf for a block with none (so it is never selected)."""
    n = scores.shape[-1]
    n_blk = -(-n // key_block)
    x = jnp.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(0, n_blk * key_block - n)], constant_values=-jnp.inf)
    x = x.reshape(scores.shape[:-1] + (n_blk, key_block))
    fin = jnp.isfinite(x)
    return jnp.where(fin.any(-1), jnp.where(fin, x, 0.0).sum(-1), -jnp.inf)


def block_counts(counts, eligible, key_block: int):
    """Key budgets and eligible keys [batch, tiles] -> block budgets min(ceil(counts / kb), ceil(eligible / kb))."""
    return jnp.minimum(-(-counts // key_block), -(-eligible // key_block)).astype(jnp.int32)


def expand_blocks(blk, key_block: int):
    """Block ids [..., n] (-1 = none) -> key ids [..., n * key_block]: block b's lanes hold b * kb + 0 .. kb - 1, a
    -1 block's lanes -1."""
    if key_block == 1:
        return blk
    ids = blk[..., None] * key_block + jnp.arange(key_block, dtype=jnp.int32)
    return jnp.where(blk[..., None] >= 0, ids, -1).reshape(blk.shape[:-1] + (-1,)).astype(jnp.int32)


def select_blocks_reference(scores, counts, eligible, k_max: int, key_block: int):
    """Prefill Top-k in aligned blocks of `key_block` keys (block b = keys [b kb, b kb + kb)).

    scores [batch, idx_heads, tiles, keys] (-inf = ineligible); counts [batch, tiles] key budgets (<= k_max);
    eligible [batch, tiles] = min(tile_start, kv_len). Returns (idx [batch, idx_heads, tiles, ceil(k_max / kb) kb]
    int32: the selected blocks expanded by `expand_blocks`, -1 past the count; counts [batch, tiles] = selected
    blocks x kb, in keys, which may include a partial block's ineligible keys: the reuse masks them).
    """
    n_blk = block_counts(counts, eligible, key_block)
    width = -(-k_max // key_block)
    blk = select_topk_reference(block_scores(scores, key_block), n_blk[:, None], width)
    blk = jnp.pad(blk, ((0, 0), (0, 0), (0, 0), (0, width - blk.shape[-1])), constant_values=-1)
    return expand_blocks(blk, key_block), n_blk * key_block


def _index_mask(idx, num_keys: int):
    """[..., k_max] indices (-1 = none) -> [..., keys] bool membership."""
    flat = idx.reshape(-1, idx.shape[-1])
    safe = jnp.where(flat >= 0, flat, num_keys)
    m = jnp.zeros((flat.shape[0], num_keys + 1), bool).at[jnp.arange(flat.shape[0])[:, None], safe].set(True)
    return m[:, :num_keys].reshape(idx.shape[:-1] + (num_keys,))


def sparse_decode_reference(q, k, v, kv_len, idx, head_map_row, *, scale=None, return_lse=False):
    """Decode attention of KV head h over the index set idx[:, head_map_row[h]] (renormalised softmax).

    q: [batch, 1, q_heads, d]; idx: [batch, idx_heads, k_max]; head_map_row: [kv_heads] int. With `return_lse`
    also lse [batch, 1, q_heads] fp32 over the attended keys.
    """
    sel = _index_mask(idx, k.shape[1])  # [batch, idx_heads, keys]
    sel = jnp.take(sel, jnp.asarray(head_map_row), axis=1)[:, :, None, :]  # [batch, kv_heads, 1, keys]
    return attention_reference(q, k, v, kv_len - 1, kv_len, mask=sel, scale=scale, return_lse=return_lse)


def sparse_prefill_reference(q, k, v, q_start, kv_len, idx, head_map_row, tile_size: int, *, scale=None):
    """Prefill attention: each query attends its tile's selected keys (through the head map) plus its causal diagonal tile.

    idx: [batch, idx_heads, tiles, k_max] for the tiles of this chunk.
    """
    t = q.shape[1]
    n_tiles = idx.shape[2]
    sel = _index_mask(idx, k.shape[1])  # [batch, idx_heads, tiles, keys]
    sel = jnp.take(sel, jnp.asarray(head_map_row), axis=1)
    row_tile = jnp.arange(t) // tile_size
    sel = sel[:, :, row_tile]  # [batch, kv_heads, q_len, keys]
    tile_start = q_start[:, None] + row_tile[None, :] * tile_size  # [batch, q_len]
    diag = jnp.arange(k.shape[1])[None, None, :] >= tile_start[:, :, None]
    del n_tiles
    return attention_reference(q, k, v, q_start, kv_len, mask=sel | diag[:, None], scale=scale)
