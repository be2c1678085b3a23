"""Decode kernels that read K/V through a page table: dense decode, Kascade anchor decode and reuse decode.

Paged layout (models/paged.py): per layer a pool [num_pages, page_size, kv_heads, d]; page_table [batch, max_pages]
int32 maps logical position p of sequence b to row `p % page_size` of page `page_table[b, p // page_size]`. The
logical length of a sequence is `s_len = max_pages * page_size`; `kv_len[b]` keys are valid. The caller guarantees
that the pages of [0, kv_len) are allocated (entries past them may be -1; they are clamped to page 0 and masked).
Masked rows (past kv_len, or a clamped -1 page) may hold another or a previous owner's data, pages being reused
dirty: K and V are zeroed there before the dots, so p = 0 never meets a stale inf/NaN (0 x inf = NaN).

Same structure as kernels_pallas/decode.py (which this reuses: grid (batch, kv_heads, splits), the GQA group as
one [rows >= 16, d] tile, online softmax, split-K with an XLA log-sum-exp combine, the Top-k select of topk.py on
logical positions), with one change: K/V rows are gathered by index, as decode.py's reuse kernel already does, and
every logical position is mapped to its physical row inside the kernel,
    row = page_table[b, pos // page_size] * page_size + pos % page_size,
in the flattened pool [num_pages * page_size, kv_heads, d] (a free reshape). So nothing is gathered into a
contiguous copy: the whole-cache pass (dense decode and the anchor scores) walks logical blocks of `stream_block`
keys; a block within one page (stream_block <= page_size) is one contiguous load at the page's row, a block over
several small pages gathers its rows (contiguous within each page, so loads stay coalesced). The reuse kernel maps
its selected indices, which stay logical token positions, to (page, offset).

- `dense_decode`: exact decode attention (split-K flash decode) through the page table.
- `anchor_decode`: logits over the whole cache + per-head lse in one pass (and the dense output for anchor
  layer 0), pooled post-softmax scores (XLA), exact Top-k (topk.py), sparse attention over the selection.
- `reuse_decode`: sparse attention over head-mapped logical indices.
- `dense_attention_paged`: the models' dense entry (decode: `dense_decode`; prefill: `gather_pages` per chunk,
  then `kernels_pallas.dense.dense_attention`, i.e. cuDNN on GPU).

References (the readable statement, used off-GPU): gather the pages (`gather_pages`) and call the contiguous
references (`reference.attention_reference`, `decode.anchor_decode` / `reuse_decode` with impl="reference").
Deliberately not here: paged prefill kernels (prefill gathers per chunk), `pool="pre_softmax"` scores through the
page table (they gather, as decode.py computes them with the reference too).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import decode as dec
from kernels_pallas import reference as ref
from kernels_pallas.dense import dense_attention
from kernels_pallas.dispatch import use_pallas

_NEG = dec._NEG
_GPU_DTYPES = (jnp.bfloat16, jnp.float16)
_INTERPRET_DTYPES = _GPU_DTYPES + (jnp.float32,)  # interpret mode also takes fp32 (tiny CPU models)


# ----------------------------------------------------------------------------------------------------------
# Layout helpers and the references.


def gather_pages(pool, page_table, kv_len=None):
    """pool [num_pages, page_size, kv_heads, d] through page_table [batch, max_pages] -> the contiguous view
    [batch, max_pages * page_size, kv_heads, d] (rows on no page are zeros, and with kv_len [batch] also rows at
    positions >= kv_len[b]: pages are reused dirty, and 0 x a stale inf/NaN would be NaN). A copy: references and
    prefill only."""
    n, ps, kvh, d = pool.shape
    b, mp = page_table.shape
    pages = pool[jnp.clip(page_table, 0, n - 1)]  # [batch, max_pages, page_size, kv_heads, d]
    pages = jnp.where((page_table >= 0)[:, :, None, None, None], pages, jnp.zeros((), pool.dtype))
    out = pages.reshape(b, mp * ps, kvh, d)
    if kv_len is None:
        return out
    valid = jnp.arange(mp * ps)[None, :] < jnp.asarray(kv_len, jnp.int32).reshape(b, 1)
    return jnp.where(valid[:, :, None, None], out, jnp.zeros((), pool.dtype))


def _supported(q, k_pages, v_pages) -> bool:
    return (q.dtype in _GPU_DTYPES and k_pages.dtype == q.dtype and v_pages.dtype == q.dtype and q.ndim == 4
            and q.shape[-1] in dec._HEAD_DIMS and k_pages.ndim == 4 and q.shape[2] % k_pages.shape[2] == 0
            and q.shape[2] // k_pages.shape[2] <= 64)


def _check(q, k_pages, v_pages, page_table, kv_len, pallas: bool, interpret: bool):
    if q.ndim != 4 or q.shape[1] != 1:
        raise ValueError(f"q must be [batch, 1, q_heads, d], got shape {q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError("k_pages and v_pages must both be [num_pages, page_size, kv_heads, d], "
                         f"got {k_pages.shape} and {v_pages.shape}")
    b, _, hq, d = q.shape
    n, ps, kvh, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"page pools {k_pages.shape} do not match q {q.shape} (head_dim must agree)")
    if ps < 16 or ps & (ps - 1):
        raise ValueError(f"page_size must be a power of two >= 16, got {ps}")
    if hq % kvh:
        raise ValueError(f"q_heads ({hq}) must be a multiple of kv_heads ({kvh})")
    if jnp.ndim(page_table) != 2 or jnp.shape(page_table)[0] != b:
        raise ValueError(f"page_table must be [batch={b}, max_pages], got shape {jnp.shape(page_table)}")
    if not jnp.issubdtype(jnp.asarray(page_table).dtype, jnp.integer):
        raise ValueError(f"page_table must be an integer array, got {jnp.asarray(page_table).dtype}")
    if jnp.shape(kv_len) != (b,):
        raise ValueError(f"kv_len must have shape [batch]=({b},), got {jnp.shape(kv_len)}")
    if pallas:
        allowed = _INTERPRET_DTYPES if interpret else _GPU_DTYPES
        if q.dtype not in allowed or k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
            raise ValueError(f"Pallas paged decode needs q and both pools of one dtype in "
                             f"{[jnp.dtype(t).name for t in allowed]}, got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
        if d not in dec._HEAD_DIMS:
            raise ValueError(f"Pallas paged decode supports head_dim in {dec._HEAD_DIMS}, got {d}")
        if hq // kvh > 64:
            raise ValueError(f"Pallas paged decode supports a GQA group of at most 64 query heads, got {hq // kvh}")
    return b, hq, kvh, d, hq // kvh


def dense_decode_reference(q, k_pages, v_pages, page_table, kv_len, *, scale=None):
    k, v = gather_pages(k_pages, page_table, kv_len), gather_pages(v_pages, page_table, kv_len)
    return ref.attention_reference(q, k, v, kv_len - 1, kv_len, scale=scale)


# ----------------------------------------------------------------------------------------------------------
# Kernels.


def _rows(pt_ref, pos, page_size: int, num_pages: int, max_pages: int):
    """Logical positions [block] -> physical rows of the flattened pool (pages clamped into range; callers mask)."""
    page = pt_ref[jnp.minimum(pos // page_size, max_pages - 1)]
    page = jnp.minimum(jnp.maximum(page, 0), num_pages - 1)
    return page * page_size + pos % page_size


def _stream_kernel(kvlen_ref, pt_ref, q_ref, k_ref, *refs, block, split_len, s_len, page_size, num_pages, max_pages,
                   scale, group, write_logits: bool, dense_out: bool):
    refs = list(refs)
    v_ref = refs.pop(0) if dense_out else None
    logits_ref = refs.pop(0) if write_logits else None
    m_ref, l_ref = refs.pop(0), refs.pop(0)
    acc_ref = refs.pop(0) if dense_out else None
    b, s = pl.program_id(0), pl.program_id(2)
    start = s * split_len
    end = jnp.minimum(start + split_len, kvlen_ref[b])
    n_blocks = pl.cdiv(jnp.maximum(end - start, 0), block)
    q = q_ref[...]  # [rows, d]
    rows, d = q.shape
    real = jnp.arange(rows) < group

    def body(i, carry):
        off = start + i * block
        off_c = jnp.minimum(off, s_len - block)  # the last block is re-read at a clamped offset, overlap masked
        pos = off_c + jnp.arange(block)
        valid = (pos >= off) & (pos < end)
        if block <= page_size:  # the block lies in one page (offsets are block-aligned): one contiguous load
            page = jnp.minimum(jnp.maximum(pt_ref[off_c // page_size], 0), num_pages - 1)
            phys = pl.ds(page * page_size + off_c % page_size, block)
        else:  # the block spans pages: rows gathered through the page table
            phys = _rows(pt_ref, pos, page_size, num_pages, max_pages)
        k = jnp.where(valid[:, None], k_ref[phys, :], 0)  # [block, d]; masked rows may be a previous owner's
        qk = plgpu.dot(q, k, trans_b=True) * scale  # [rows, block] fp32
        qk = jnp.where(valid[None, :], qk, -jnp.inf)
        if write_logits:
            plgpu.store(logits_ref.at[:, pl.ds(off_c, block)], qk, mask=real[:, None] & valid[None, :])
        m_new, alpha, p, l_new = dec._online_step(carry[0], carry[1], qk)
        if not dense_out:
            return m_new, l_new
        v = jnp.where(valid[:, None], v_ref[phys, :], 0)  # p = 0 there, but 0 x a stale inf/NaN is NaN
        return m_new, l_new, carry[2] * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)

    init = (jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
    if dense_out:
        init = init + (jnp.zeros((rows, d), jnp.float32),)
    carry = lax.fori_loop(0, n_blocks, body, init)
    plgpu.store(m_ref, carry[0], mask=real)
    plgpu.store(l_ref, carry[1], mask=real)
    if dense_out:
        plgpu.store(acc_ref, carry[2], mask=real[:, None])


def _pool_spec(k_pages):
    n, ps, kvh, d = k_pages.shape
    return pl.BlockSpec((n * ps, None, d), lambda i, j, s: (0, j, 0))


def _flat(pool):
    n, ps, kvh, d = pool.shape
    return pool.reshape(n * ps, kvh, d)


def _stream_pallas(q, k_pages, v_pages, page_table, kv_len, scale, *, write_logits: bool, dense_out: bool, interpret,
                   tuning: dec.DecodeTuning):
    """-> (logits [batch, kv_heads, rows, s_len] fp32 | None, lse [batch, kv_heads, group], out | None)."""
    b, _, hq, d = q.shape
    n, ps, kvh, _ = k_pages.shape
    max_pages = page_table.shape[1]
    s_len = max_pages * ps
    group = hq // kvh
    qg, rows = dec._group_rows(q, kvh)
    block = min(tuning.stream_block, 1 << (s_len.bit_length() - 1))
    splits = dec._splits(tuning.stream_splits, b * kvh, s_len, block, tuning.target_programs)
    split_len = pl.cdiv(pl.cdiv(s_len, splits), block) * block
    splits = pl.cdiv(s_len, split_len)
    kernel = functools.partial(_stream_kernel, block=block, split_len=split_len, s_len=s_len, page_size=ps,
                               num_pages=n, max_pages=max_pages, scale=scale, group=group, write_logits=write_logits,
                               dense_out=dense_out)
    part_spec = pl.BlockSpec((None, None, None, rows), lambda i, j, s: (i, j, s, 0))
    in_specs = [pl.BlockSpec((b,), lambda i, j, s: (0,)),
                pl.BlockSpec((None, max_pages), lambda i, j, s: (i, 0)),
                pl.BlockSpec((None, None, rows, d), lambda i, j, s: (i, j, 0, 0)), _pool_spec(k_pages)]
    args = [kv_len, page_table, qg, _flat(k_pages)]
    out_specs, out_shape = [], []
    if dense_out:
        in_specs.append(_pool_spec(v_pages))
        args.append(_flat(v_pages))
    if write_logits:
        out_specs.append(pl.BlockSpec((None, None, rows, s_len), lambda i, j, s: (i, j, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, kvh, rows, s_len), jnp.float32))
    out_specs += [part_spec, part_spec]
    out_shape += [jax.ShapeDtypeStruct((b, kvh, splits, rows), jnp.float32)] * 2
    if dense_out:
        out_specs.append(pl.BlockSpec((None, None, None, rows, d), lambda i, j, s: (i, j, s, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, kvh, splits, rows, d), jnp.float32))
    outs = list(pl.pallas_call(
        kernel,
        grid=(b, kvh, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tuning.stream_warps, num_stages=tuning.stream_stages),
        interpret=interpret,
        name="paged_anchor_scores" if write_logits else "paged_dense_decode",
    )(*args))
    logits = outs.pop(0) if write_logits else None
    m, l = outs.pop(0), outs.pop(0)
    acc = outs.pop(0)[:, :, :, :group] if dense_out else None
    out, lse = dec._combine(acc, m[..., :group], l[..., :group])
    if dense_out:
        out = dec._ungroup(out, b, group, q.dtype)
    return logits, lse, out


def _reuse_kernel(kvlen_ref, cnt_ref, hm_ref, idx_ref, pt_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *,
                  block, split_len, k_max, page_size, num_pages, max_pages, scale, group):
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ih = hm_ref[h]
    kv_len = kvlen_ref[b]
    start = s * split_len
    end = jnp.minimum(start + split_len, cnt_ref[b])
    n_blocks = pl.cdiv(jnp.maximum(end - start, 0), block)
    q = q_ref[...]  # [rows, d]
    rows, d = q.shape

    def body(i, carry):
        acc, m, l = carry
        off = start + i * block
        off_c = jnp.minimum(off, k_max - block)
        pos = off_c + jnp.arange(block)
        ids = idx_ref[ih, pl.ds(off_c, block)]  # [block] logical token positions
        valid = (pos >= off) & (pos < end) & (ids >= 0) & (ids < kv_len)
        phys = _rows(pt_ref, jnp.where(valid, ids, 0), page_size, num_pages, max_pages)
        k = jnp.where(valid[:, None], k_ref[phys, :], 0)  # [block, d]; masked rows zeroed (stale pages)
        v = jnp.where(valid[:, None], v_ref[phys, :], 0)
        qk = plgpu.dot(q, k, trans_b=True) * scale
        qk = jnp.where(valid[None, :], qk, -jnp.inf)
        m_new, alpha, p, l_new = dec._online_step(m, l, qk)
        return acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v), m_new, l_new

    init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, m, l = lax.fori_loop(0, n_blocks, body, init)
    real = jnp.arange(rows) < group
    plgpu.store(acc_ref, acc, mask=real[:, None])
    plgpu.store(m_ref, m, mask=real)
    plgpu.store(l_ref, l, mask=real)


def _reuse_pallas(q, k_pages, v_pages, page_table, kv_len, idx, counts, head_map_row, scale, interpret,
                  tuning: dec.DecodeTuning):
    b, _, hq, d = q.shape
    n, ps, kvh, _ = k_pages.shape
    max_pages = page_table.shape[1]
    group = hq // kvh
    qg, rows = dec._group_rows(q, kvh)
    block = tuning.reuse_block or (128 if b * kvh >= 256 else 64)
    warps = tuning.reuse_warps or (8 if block >= 128 else 4)
    k_max = idx.shape[2]
    if k_max < block:
        idx = jnp.pad(idx, ((0, 0), (0, 0), (0, block - k_max)), constant_values=-1)
        k_max = block
    splits = dec._splits(tuning.reuse_splits, b * kvh, k_max, block, tuning.target_programs)
    split_len = pl.cdiv(pl.cdiv(k_max, splits), block) * block
    splits = pl.cdiv(k_max, split_len)
    ih = idx.shape[1]
    kernel = functools.partial(_reuse_kernel, block=block, split_len=split_len, k_max=k_max, page_size=ps,
                               num_pages=n, max_pages=max_pages, scale=scale, group=group)
    out_specs, out_shape = dec._reuse_partials(b, kvh, splits, rows, d)
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(b, kvh, splits),
        in_specs=[
            pl.BlockSpec((b,), lambda i, j, s: (0,)),
            pl.BlockSpec((b,), lambda i, j, s: (0,)),
            pl.BlockSpec((kvh,), lambda i, j, s: (0,)),
            pl.BlockSpec((None, ih, k_max), lambda i, j, s: (i, 0, 0)),
            pl.BlockSpec((None, max_pages), lambda i, j, s: (i, 0)),
            pl.BlockSpec((None, None, rows, d), lambda i, j, s: (i, j, 0, 0)),
            _pool_spec(k_pages),
            _pool_spec(v_pages),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=tuning.reuse_stages),
        interpret=interpret,
        name="paged_reuse_decode",
    )(kv_len, counts, head_map_row, idx, page_table, qg, _flat(k_pages), _flat(v_pages))
    out, _ = dec._combine(acc[:, :, :, :group], m[..., :group], l[..., :group])
    return dec._ungroup(out, b, group, q.dtype)


# ----------------------------------------------------------------------------------------------------------
# Public entry points.


def dense_decode(q, k_pages, v_pages, page_table, kv_len, *, scale=None, impl="auto", interpret=False,
                 tuning: dec.DecodeTuning = dec.DEFAULT_TUNING):
    """Exact decode attention through the page table -> out [batch, 1, q_heads, d]. Reference:
    `dense_decode_reference` (gather + `reference.attention_reference`)."""
    pallas = use_pallas(impl, interpret, _supported(q, k_pages, v_pages))
    _, _, _, d, _ = _check(q, k_pages, v_pages, page_table, kv_len, pallas, interpret)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kv_len, page_table = jnp.asarray(kv_len, jnp.int32), jnp.asarray(page_table, jnp.int32)
    if not pallas:
        return dense_decode_reference(q, k_pages, v_pages, page_table, kv_len, scale=scale)
    _, _, out = _stream_pallas(q, k_pages, v_pages, page_table, kv_len, scale, write_logits=False, dense_out=True,
                               interpret=interpret, tuning=tuning)
    return out


def reuse_decode(q, k_pages, v_pages, page_table, kv_len, idx, counts, head_map_row, *, scale=None, impl="auto",
                 interpret=False, tuning: dec.DecodeTuning = dec.DEFAULT_TUNING):
    """`decode.reuse_decode` through the page table: idx [batch, idx_heads, k_max] are logical token positions."""
    pallas = use_pallas(impl, interpret, _supported(q, k_pages, v_pages))
    b, hq, kvh, d, _ = _check(q, k_pages, v_pages, page_table, kv_len, pallas, interpret)
    if idx.ndim != 3 or idx.shape[0] != b or idx.shape[2] < 1:
        raise ValueError(f"idx must be [batch={b}, idx_heads, k_max>=1], got shape {idx.shape}")
    if jnp.shape(counts) != (b,):
        raise ValueError(f"counts must have shape [batch]=({b},), got {jnp.shape(counts)}")
    if jnp.shape(head_map_row) != (kvh,):
        raise ValueError(f"head_map_row must have shape [kv_heads]=({kvh},), got {jnp.shape(head_map_row)}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    head_map_row = jnp.asarray(head_map_row, jnp.int32)
    kv_len, page_table = jnp.asarray(kv_len, jnp.int32), jnp.asarray(page_table, jnp.int32)
    if not pallas:
        k, v = gather_pages(k_pages, page_table, kv_len), gather_pages(v_pages, page_table, kv_len)
        return ref.sparse_decode_reference(q, k, v, kv_len, idx, head_map_row, scale=scale)
    return _reuse_pallas(q, k_pages, v_pages, page_table, kv_len, jnp.asarray(idx, jnp.int32),
                         jnp.asarray(counts, jnp.int32), head_map_row, scale, interpret, tuning)


def anchor_decode(q, k_pages, v_pages, page_table, kv_len, *, topk_frac: float, min_k: int, k_max: int,
                  head_map_row=None, dense_out=False, pool="gqa", scale=None, impl="auto", interpret=False,
                  tuning: dec.DecodeTuning = dec.DEFAULT_TUNING, sinks: int = 0, window: int = 0):
    """`decode.anchor_decode` through the page table (same arguments and results; idx are logical positions in
    [0, max_pages * page_size), the logical length standing in for the contiguous max_len)."""
    ref.check_forced(sinks, window)
    pallas = use_pallas(impl, interpret, _supported(q, k_pages, v_pages))
    b, hq, kvh, d, group = _check(q, k_pages, v_pages, page_table, kv_len, pallas, interpret)
    page_table = jnp.asarray(page_table, jnp.int32)
    if not pallas:
        k, v = gather_pages(k_pages, page_table, kv_len), gather_pages(v_pages, page_table, kv_len)
        return dec.anchor_decode(q, k, v, kv_len, topk_frac=topk_frac, min_k=min_k, k_max=k_max,
                                 head_map_row=head_map_row, dense_out=dense_out, pool=pool, scale=scale,
                                 impl="reference", sinks=sinks, window=window)
    if pool not in dec._POOLS:
        raise ValueError(f"pool must be one of {dec._POOLS}, got {pool!r}")
    ref.frac_numerator(topk_frac)
    if not isinstance(min_k, int) or min_k < 0:
        raise ValueError(f"min_k must be an int >= 0, got {min_k!r}")
    if not isinstance(k_max, int) or k_max < 1:
        raise ValueError(f"k_max must be an int >= 1, got {k_max!r}")
    ih = 1 if pool == "all" else kvh
    if head_map_row is None:
        head_map_row = jnp.zeros((kvh,), jnp.int32) if ih == 1 else jnp.arange(kvh, dtype=jnp.int32)
    elif jnp.shape(head_map_row) != (kvh,):
        raise ValueError(f"head_map_row must have shape [kv_heads]=({kvh},), got {jnp.shape(head_map_row)}")
    head_map_row = jnp.asarray(head_map_row, jnp.int32)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kv_len = jnp.asarray(kv_len, jnp.int32)
    s_len = page_table.shape[1] * k_pages.shape[1]
    k_eff = min(k_max, s_len)
    counts = jnp.minimum(ref.decode_counts(kv_len, topk_frac, min_k), k_eff).astype(jnp.int32)
    if pool == "pre_softmax":  # scores from the reference over a gathered view (as decode.py does)
        scores = ref.pooled_scores_decode_reference(q, gather_pages(k_pages, page_table, kv_len), kv_len, pool=pool,
                                                    scale=scale)
        scores = scores - jnp.min(jnp.where(jnp.isfinite(scores), scores, jnp.inf), axis=-1, keepdims=True)
        scores = dec._force(scores, kv_len, sinks, window)
        bits_fn = functools.partial(dec._scores_to_bits, scores, kv_len)
        dense = None
        if dense_out:
            _, _, dense = _stream_pallas(q, k_pages, v_pages, page_table, kv_len, scale, write_logits=False,
                                         dense_out=True, interpret=interpret, tuning=tuning)
    else:
        logits, lse, dense = _stream_pallas(q, k_pages, v_pages, page_table, kv_len, scale, write_logits=True,
                                            dense_out=dense_out, interpret=interpret, tuning=tuning)
        bits_fn = functools.partial(dec._pooled_bits, logits, lse, kv_len, group, pool, sinks, window)
    idx = dec._select(bits_fn, kv_len, counts, k_eff, b * ih, s_len, interpret, tuning)
    if dense_out:
        return dense, idx, counts
    out = _reuse_pallas(q, k_pages, v_pages, page_table, kv_len, idx, counts, head_map_row, scale, interpret, tuning)
    return out, idx, counts


def dense_attention_paged(q, k_pages, v_pages, page_table, q_start, kv_len, *, phase: str, chunk_at_zero: bool,
                          scale=None):
    """The models' dense attention on a paged cache. Decode: `dense_decode` (Pallas through the page table on a GPU,
    the gather reference elsewhere). Prefill: the chunk's sequences' pages gathered into a contiguous view, then
    `dense.dense_attention` (cuDNN on GPU for chunks at 0): one copy per chunk, next to a chunk's quadratic work."""
    if phase == "decode":
        return dense_decode(q, k_pages, v_pages, page_table, kv_len, scale=scale)
    k, v = gather_pages(k_pages, page_table, kv_len), gather_pages(v_pages, page_table, kv_len)
    return dense_attention(q, k, v, q_start, kv_len, phase=phase, chunk_at_zero=chunk_at_zero, scale=scale)
