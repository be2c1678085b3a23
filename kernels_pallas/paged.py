"""Decode kernels that read K/V through a page table: dense decode, Kascade anchor decode and reuse decode.

Paged layout (models/paged.py): per layer a pool [num_pages, page_size, kv_heads, d]; page_table [batch, max_pages]
int32 maps logical position p of sequence b to row p % page_size of page page_table[b, p // page_size]. The logical
length is max_pages * page_size; the pages of [0, kv_len) must be allocated (entries past them may be -1).

The kernels are decode.py's with `PagedLayout` as their addressing (nothing is gathered into a contiguous copy;
indices stay logical positions). Decisions: a whole-cache block within one page (stream_block <= page_size) is one
contiguous load, a longer one gathers its rows; a -1 entry reads the sequence's own first page (page 0 only for a
sequence with no page), not another live sequence's. Masked rows (past kv_len, on a -1 entry) are read as they are (probability 0):
they must be finite, since 0 x inf = NaN in P.V; models/paged.py guarantees it (pages are zeroed when handed out),
so the loads are the contiguous kernels' plain ones (the masked loads held paged decode at 1.07-1.12x contiguous).
`DecodeTuning.paged_mask` "v" / "kv" loads V / K and V through a zero-filling masked load instead (safe on dirty
pages; a masked load rather than a select after the load, which staged every tile through registers), the A/B.
References (off-GPU): `gather_pages`, then the contiguous references.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import decode as dec
from kernels_pallas import reference as ref
from kernels_pallas.dense import dense_attention
from kernels_pallas.dispatch import use_pallas

_INTERPRET_DTYPES = dec._DTYPES + (jnp.float32,)  # interpret mode also takes fp32 (tiny CPU models)


@dataclasses.dataclass(frozen=True)
class PagedLayout(dec.Layout):
    """K/V rows through the page table [batch, max_pages] over the flattened pool [num_pages * page_size, kv_heads,
    d]; a -1 entry is the sequence's first page, pages clamped into [0, num_pages)."""

    page_size: int
    num_pages: int
    mask: str = "none"  # DecodeTuning.paged_mask
    name: ClassVar[str] = "paged"
    has_table: ClassVar[bool] = True

    @classmethod
    def of(cls, pool, page_table, tuning: dec.DecodeTuning = dec.DEFAULT_TUNING) -> "PagedLayout":
        return cls(s_len=page_table.shape[1] * pool.shape[1], page_size=pool.shape[1], num_pages=pool.shape[0],
                   mask=tuning.paged_mask)

    def operand(self, pool):
        n, ps, kvh, d = pool.shape
        return pl.BlockSpec((n * ps, None, d), lambda i, j, s: (0, j, 0)), pool.reshape(n * ps, kvh, d)

    def table_operands(self, table):
        return [(pl.BlockSpec((None, table.shape[1]), lambda i, j, s: (i, 0)), table)]

    def page(self, table_ref, slot):
        """Page of table slot(s) `slot`: a -1 entry (only masked rows lie there) reads the sequence's own first page,
        so a masked row never reads another live sequence's page."""
        page = table_ref[slot]
        page = jnp.where(page < 0, table_ref[0], page)
        return jnp.minimum(jnp.maximum(page, 0), self.num_pages - 1)

    def gather(self, table_ref, pos):
        page = self.page(table_ref, jnp.minimum(pos // self.page_size, self.s_len // self.page_size - 1))
        return page * self.page_size + pos % self.page_size

    def block(self, table_ref, off, block: int, pos):
        if block > self.page_size:  # the block spans pages: rows gathered through the page table
            return self.gather(table_ref, pos)
        page = self.page(table_ref, off // self.page_size)
        return pl.ds(page * self.page_size + off % self.page_size, block)  # within one page: one contiguous load

    def load(self, ref, rows, valid):
        return super().load(ref, rows, valid) if self.mask == "none" else self.masked_load(ref, rows, valid)

    def load_k(self, ref, rows, valid):
        # an fp8 K copy (decode_score_fp8) loads unmasked: Triton's masked load cannot fill fp8 with a constant, and
        # K needs no mask (an unattended row's logit, NaN included, becomes -inf before the softmax)
        if self.mask == "kv" and ref.dtype != jnp.float8_e4m3fn:
            return self.masked_load(ref, rows, valid)
        return super().load(ref, rows, valid)

    @staticmethod
    def masked_load(ref, rows, valid):
        """Rows with the unattended ones read as 0: a zero-filling masked load (cp.async straight to shared memory),
        not a jnp.where after the load (the select staged each tile through registers and a second shared buffer)."""
        if isinstance(rows, pl.Slice):  # a block within one page
            at = ref.at[rows, :]
        else:  # gathered rows
            at = dec.row_view(ref, rows)
        return plgpu.load(at, mask=valid[:, None], other=0)


def gather_pages(pool, page_table, kv_len=None):
    """pool [num_pages, page_size, kv_heads, d] through page_table [batch, max_pages] -> the contiguous view
    [batch, max_pages * page_size, kv_heads, d] (rows on no page are zeros, and with kv_len [batch] also rows at
    positions >= kv_len[b], whatever the pool holds there). A copy: references and prefill only."""
    n, ps, kvh, d = pool.shape
    b, mp = page_table.shape
    pages = pool[jnp.clip(page_table, 0, n - 1)]  # [batch, max_pages, page_size, kv_heads, d]
    pages = jnp.where((page_table >= 0)[:, :, None, None, None], pages, jnp.zeros((), pool.dtype))
    out = pages.reshape(b, mp * ps, kvh, d)
    if kv_len is None:
        return out
    valid = jnp.arange(mp * ps)[None, :] < jnp.asarray(kv_len, jnp.int32).reshape(b, 1)
    return jnp.where(valid[:, :, None, None], out, jnp.zeros((), pool.dtype))


def _check(q, k_pages, v_pages, page_table, kv_len, pallas: bool, interpret: bool):
    dec._check_q(q)
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError("k_pages and v_pages must both be [num_pages, page_size, kv_heads, d], "
                         f"got {k_pages.shape} and {v_pages.shape}")
    if k_pages.shape[3] != q.shape[3]:
        raise ValueError(f"page pools {k_pages.shape} do not match q {q.shape} (head_dim must agree)")
    ps = k_pages.shape[1]
    if ps < 16 or ps & (ps - 1):
        raise ValueError(f"page_size must be a power of two >= 16, got {ps}")
    b = q.shape[0]
    if jnp.ndim(page_table) != 2 or jnp.shape(page_table)[0] != b:
        raise ValueError(f"page_table must be [batch={b}, max_pages], got shape {jnp.shape(page_table)}")
    if not jnp.issubdtype(jnp.asarray(page_table).dtype, jnp.integer):
        raise ValueError(f"page_table must be an integer array, got {jnp.asarray(page_table).dtype}")
    allowed = _INTERPRET_DTYPES if interpret else dec._DTYPES
    return dec._check_heads(q, k_pages, v_pages, kv_len, pallas, "Pallas paged decode", allowed,
                            f"q and both pools of one dtype in {[jnp.dtype(t).name for t in allowed]}")


def dense_decode_reference(q, k_pages, v_pages, page_table, kv_len, *, scale=None):
    k, v = gather_pages(k_pages, page_table, kv_len), gather_pages(v_pages, page_table, kv_len)
    return ref.attention_reference(q, k, v, kv_len - 1, kv_len, scale=scale)


def dense_decode(q, k_pages, v_pages, page_table, kv_len, *, scale=None, impl="auto", interpret=False,
                 tuning: dec.DecodeTuning = dec.DEFAULT_TUNING):
    """Exact decode attention through the page table -> out [batch, 1, q_heads, d]. Reference:
    `dense_decode_reference` (gather + `reference.attention_reference`)."""
    pallas = use_pallas(impl, interpret, dec.pallas_supported(q, k_pages, v_pages))
    _, _, _, d, _ = _check(q, k_pages, v_pages, page_table, kv_len, pallas, interpret)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kv_len, page_table = jnp.asarray(kv_len, jnp.int32), jnp.asarray(page_table, jnp.int32)
    if not pallas:
        return dense_decode_reference(q, k_pages, v_pages, page_table, kv_len, scale=scale)
    layout = PagedLayout.of(k_pages, page_table, tuning)
    _, _, out = dec._stream_pallas(q, k_pages, v_pages, page_table, kv_len, layout,
                                   scale, dense_out=True, write_logits=False, interpret=interpret, tuning=tuning)
    return out


def reuse_decode(q, k_pages, v_pages, page_table, kv_len, idx, counts, head_map_row, *, scale=None, impl="auto",
                 interpret=False, tuning: dec.DecodeTuning = dec.DEFAULT_TUNING):
    """`decode.reuse_decode` through the page table: idx [batch, idx_heads, k_max] are logical token positions."""
    pallas = use_pallas(impl, interpret, dec.pallas_supported(q, k_pages, v_pages))
    b, hq, kvh, d, _ = _check(q, k_pages, v_pages, page_table, kv_len, pallas, interpret)
    dec._check_reuse(b, kvh, idx, counts, head_map_row)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    head_map_row = jnp.asarray(head_map_row, jnp.int32)
    kv_len, page_table = jnp.asarray(kv_len, jnp.int32), jnp.asarray(page_table, jnp.int32)
    if not pallas:
        k, v = gather_pages(k_pages, page_table, kv_len), gather_pages(v_pages, page_table, kv_len)
        return ref.sparse_decode_reference(q, k, v, kv_len, idx, head_map_row, scale=scale)
    return dec._reuse_pallas(q, k_pages, v_pages, page_table, kv_len, PagedLayout.of(k_pages, page_table, tuning),
                             jnp.asarray(idx, jnp.int32), jnp.asarray(counts, jnp.int32), head_map_row, scale,
                             interpret, tuning)


def anchor_decode(q, k_pages, v_pages, page_table, kv_len, *, topk_frac: float, min_k: int, k_max: int,
                  head_map_row=None, dense_out=False, pool="gqa", scale=None, impl="auto", interpret=False,
                  tuning: dec.DecodeTuning = dec.DEFAULT_TUNING, sinks: int = 0, window: int = 0, score_keys=None):
    """`decode.anchor_decode` through the page table (same arguments and results; idx are logical positions in
    [0, max_pages * page_size), the logical length standing in for the contiguous max_len). score_keys: (k8 pages
    laid out like k_pages, mult [batch]), the fp8 K copy through the same page table."""
    ref.check_forced(sinks, window)
    pallas = use_pallas(impl, interpret, dec.pallas_supported(q, k_pages, v_pages))
    b, hq, kvh, d, group = _check(q, k_pages, v_pages, page_table, kv_len, pallas, interpret)
    dec.check_score_keys(score_keys, k_pages.shape, dense_out, batch=b)
    page_table = jnp.asarray(page_table, jnp.int32)
    if not pallas:
        k, v = gather_pages(k_pages, page_table, kv_len), gather_pages(v_pages, page_table, kv_len)
        if score_keys is not None:
            score_keys = (gather_pages(score_keys[0], page_table, kv_len), score_keys[1])
        return dec.anchor_decode(q, k, v, kv_len, topk_frac=topk_frac, min_k=min_k, k_max=k_max,
                                 head_map_row=head_map_row, dense_out=dense_out, pool=pool, scale=scale,
                                 impl="reference", sinks=sinks, window=window, score_keys=score_keys)
    layout = PagedLayout.of(k_pages, page_table, tuning)
    head_map_row, scale, kv_len, counts, k_eff = dec._anchor_args(
        kvh, d, layout.s_len, kv_len, topk_frac=topk_frac, min_k=min_k, k_max=k_max, head_map_row=head_map_row,
        pool=pool, scale=scale)
    k_view = lambda: gather_pages(k_pages, page_table, kv_len)  # noqa: E731
    if score_keys is not None:
        k_view = lambda: gather_pages(score_keys[0], page_table, kv_len).astype(k_pages.dtype)  # noqa: E731
    return dec._anchor_pallas(q, k_pages, v_pages, page_table, kv_len, layout, k_view, layout.s_len, counts, k_eff,
                              head_map_row, dense_out=dense_out, pool=pool, scale=scale, interpret=interpret,
                              tuning=tuning, sinks=sinks, window=window, score_keys=score_keys)


def dense_attention_paged(q, k_pages, v_pages, page_table, q_start, kv_len, *, phase: str, chunk_at_zero: bool,
                          scale=None):
    """The models' dense attention on a paged cache. Decode: `dense_decode` (Pallas through the page table on a GPU,
    the gather reference elsewhere). Prefill: the chunk's sequences' pages gathered into a contiguous view, then
    `dense.dense_attention` (cuDNN on GPU for chunks at 0): one copy per chunk, next to a chunk's quadratic work."""
    if phase == "decode":
        return dense_decode(q, k_pages, v_pages, page_table, kv_len, scale=scale)
    k, v = gather_pages(k_pages, page_table, kv_len), gather_pages(v_pages, page_table, kv_len)
    return dense_attention(q, k, v, q_start, kv_len, phase=phase, chunk_at_zero=chunk_at_zero, scale=scale)
