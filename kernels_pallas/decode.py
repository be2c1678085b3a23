"""Pallas GPU decode kernels of Kascade (one query token per sequence): dense decode, anchor decode (logits and
per-head lse over the whole cache, exact Top-k of the pooled probabilities, sparse attention over the selection) and
reuse decode (sparse attention over a head-mapped index list).

One kernel body per role, `_stream_kernel` (dense decode, anchor scores) and `_reuse_kernel`, parameterised by
`Layout`, the addressing of K/V rows: contiguous here (row = position), through a page table in paged.py.
Decisions: the GQA group is one [rows >= 16, d] tile, so each K/V row is read once per KV head; the grid is
(batch, kv_heads, splits) with about `target_programs` programs even at batch 1, the split-K partials merged by an
XLA log-sum-exp combine. The last block of a ragged cache is re-read at a clamped offset and the overlap masked.
Not here: `pool="pre_softmax"` scores (the reference's, then the Pallas select), duplicate indices in
`reuse_decode` (indices are a set). Top-k: kernels_pallas/topk.py; references: kernels_pallas/reference.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas import reference as ref
from kernels_pallas.dispatch import replace_from_string, use_pallas
from kernels_pallas import topk

_NEG = -1e30  # finite "minus infinity" for running maxima (keeps exp(m_old - m_new) finite)
_MIN_ROWS = 16  # tensor-core dots need >= 16 rows: the group's query rows are padded to this
_DTYPES = (jnp.bfloat16, jnp.float16)
_HEAD_DIMS = (64, 128)
_POOLS = ("gqa", "all", "pre_softmax")
PAGED_MASKS = ("none", "v", "kv")  # DecodeTuning.paged_mask
COMBINE_MAX_SPLITS = 32  # DecodeTuning.fused_combine: the kernel unrolls its loop over the splits
SHORT_SELECT_LIMIT = 65536  # DecodeTuning.short_select_max (past 32K keys the row no longer fits the registers)


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """Block sizes and launch shapes (static). splits=0: choose from the grid size."""

    reuse_block: int = 0  # indices per gather step; 0: 128 on wide grids (batch * kv_heads >= 256), else 64
    reuse_splits: int = 0
    reuse_warps: int = 0  # 0: 8 with 128-index blocks, else 4
    reuse_stages: int = 2
    stream_block: int = 128  # keys per step of the whole-cache pass
    stream_splits: int = 0
    stream_warps: int = 4
    stream_stages: int = 3
    # With an fp8 K copy (score_keys): widen it to float16 against q in float16 (`reference.fp8_decode_q16`: exact,
    # one scale per sequence) instead of to bf16. Triton widens e4m3 through float16 (one cvt per two values), so bf16
    # costs a second cvt per value: the widened pass ran at 2.6 TB/s on the H200 against bf16's 4.0 (session 29), about
    # what that conversion rate allows (benchmarks/NOTES.md). On by its A/B (2026-12-06, 128K, same selections and
    # outputs): the score pass -22% at batch 64 and -28% at batch 8 on the H200 (decode 4.92x -> 5.23x at batch 64),
    # -1.4% on the H100.
    stream_fp8_f16: bool = True
    target_programs: int = 1056  # ~8 programs per SM of an H200 (132 SMs)
    # Paged layouts only, the rows that are not attended: "none" loads them as they are (models/paged.py keeps them
    # finite: pages are zeroed when handed out); "v" loads V through a zero mask (K needs none: a NaN logit is
    # replaced by -inf before the softmax); "kv" masks both (safe on dirty pages). The A/B of the paged gap.
    paged_mask: str = "none"
    # The anchors' Top-k: rows whose keys, padded to a power of two, are at most short_select_max take
    # topk.select_topk_short (one launch, the row in one program's registers) instead of the four-launch pipeline
    # built for 128K rows; 0: never. 32768 by measurement (H200, 2026-12-05: A 1.11-1.24x faster at 16K, 1.00-1.04x
    # at 32K, both Qwen shapes; benchmarks/NOTES.md). short_select_warps 0: from the row (64 keys a thread);
    # short_select_digit: bits decided per pass (1: bisection, one count per pass; 2 measured no faster).
    # short_select_rows: and only while the rows (batch x selection heads) are at most this many: one program a row
    # is latency-bound, and past one program per SM (132) the programs queue; but the four launches are latency-bound
    # at these lengths too: at the 8B shape (H100, 2026-12-05) the short select still won at 512 rows (A 1.03x at
    # 16K, 1.01x at 32K; 1.16x / 1.01x at 32 rows). More rows than that are not measured.
    short_select_max: int = 32768
    short_select_warps: int = 0
    short_select_digit: int = topk.SHORT_DIGIT
    short_select_rows: int = 512
    # The split-K combine of the reuse and anchor-0 outputs as one Pallas launch writing the output in q's dtype and
    # layout (where splits <= COMBINE_MAX_SPLITS), instead of two XLA fusions (2.9 us at the 0.5B's shape, batch 32:
    # launch-bound). Off: it measured slower (H100, 2026-12-05: 3.6 us against the fusions' 2.9; benchmarks/NOTES.md).
    fused_combine: bool = False

    def __post_init__(self):
        if self.paged_mask not in PAGED_MASKS:
            raise ValueError(f"paged_mask must be one of {', '.join(PAGED_MASKS)}, got {self.paged_mask!r}")
        v = self.short_select_max
        if not isinstance(v, int) or v < 0 or v > SHORT_SELECT_LIMIT or v & (v - 1):
            raise ValueError(f"short_select_max must be 0 or a power of two <= {SHORT_SELECT_LIMIT}, got {v!r}")
        if self.short_select_warps not in (0, 1, 2, 4, 8, 16, 32):
            raise ValueError(f"short_select_warps must be 0 (automatic) or a power of two <= 32, "
                             f"got {self.short_select_warps!r}")
        if self.short_select_digit not in (1, 2, 3):
            raise ValueError(f"short_select_digit must be 1, 2 or 3, got {self.short_select_digit!r}")
        for name in ("fused_combine", "stream_fp8_f16"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.short_select_rows, int) or self.short_select_rows < 1:
            raise ValueError(f"short_select_rows must be an int >= 1, got {self.short_select_rows!r}")
        blocks = {"stream_block": self.stream_block}
        if self.reuse_block:  # 0 = automatic
            blocks["reuse_block"] = self.reuse_block
        for name, v in blocks.items():
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        for name in ("reuse_splits", "stream_splits"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


DEFAULT_TUNING = DecodeTuning()


def tuning_from_string(spec: str, base: DecodeTuning | None = None) -> DecodeTuning:
    """"field=value,field=value" -> DecodeTuning (for benchmark flags); values parsed by the field's type."""
    return replace_from_string(base or DEFAULT_TUNING, spec)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the kernels find the K/V row of a logical position (static, part of the kernel). This class: the
    contiguous cache [batch, max_len, kv_heads, d] (one page of max_len rows per sequence: the BlockSpec picks the
    sequence's [max_len, d] block of its KV head), row = position, loaded as is. paged.PagedLayout maps positions
    through a page table (masked loads: `DecodeTuning.paged_mask`)."""

    s_len: int  # logical keys per sequence
    name: ClassVar[str] = "kascade"  # kernel names <name>_dense_decode, <name>_anchor_scores, <name>_reuse_decode
    has_table: ClassVar[bool] = False  # a per-sequence table [batch, n] int32 is an operand, just before q

    def operand(self, cache):
        """-> (BlockSpec on the grid (batch, kv_heads, splits), operand) of a K or V cache."""
        return pl.BlockSpec((None, self.s_len, None, cache.shape[-1]), lambda i, j, s: (i, 0, j, 0)), cache

    def table_operands(self, table):
        """-> [(BlockSpec, operand)] of the per-sequence table (none here)."""
        return []

    def block(self, table_ref, off, block: int, pos):
        """Rows of the positions pos = off + arange(block) (off is a multiple of block or s_len - block)."""
        return pl.ds(off, block)

    def gather(self, table_ref, pos):
        """Rows of the positions pos [block] (each in [0, s_len))."""
        return pos

    def load(self, ref, rows, valid):
        """V rows [block, d] (K rows: `load_k`); valid [block]: the rows that are attended."""
        return ref[rows, :]

    def load_k(self, ref, rows, valid):
        """K rows: as `load`, for a layout that masks K and V differently (unattended logits become -inf anyway)."""
        return self.load(ref, rows, valid)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pallas_supported(q, k, v) -> bool:
    """The shapes and dtypes these kernels take (dense.py and paged.py dispatch on it); k, v: caches or pools."""
    return (q.dtype in _DTYPES and k.dtype == q.dtype and v.dtype == q.dtype and q.ndim == 4
            and q.shape[-1] in _HEAD_DIMS and k.ndim == 4 and q.shape[2] % k.shape[2] == 0
            and q.shape[2] // k.shape[2] <= 64)


def _check_q(q):
    if q.ndim != 4 or q.shape[1] != 1:
        raise ValueError(f"q must be [batch, 1, q_heads, d], got shape {q.shape}")


def _check_heads(q, k, v, kv_len, pallas: bool, what: str = "Pallas decode", dtypes=_DTYPES,
                 needs: str = "q, k_cache, v_cache all bfloat16 or all float16"):
    """The checks both layouts share (k, v: caches or pools [..., kv_heads, d]) -> (batch, q_heads, kv_heads, d,
    group)."""
    b, _, hq, d = q.shape
    kvh = k.shape[2]
    if hq % kvh:
        raise ValueError(f"q_heads ({hq}) must be a multiple of kv_heads ({kvh})")
    if jnp.shape(kv_len) != (b,):
        raise ValueError(f"kv_len must have shape [batch]=({b},), got {jnp.shape(kv_len)}")
    if pallas:
        if q.dtype not in dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
            raise ValueError(f"{what} needs {needs}, got {q.dtype}, {k.dtype}, {v.dtype}")
        if d not in _HEAD_DIMS:
            raise ValueError(f"{what} supports head_dim in {_HEAD_DIMS}, got {d}")
        if hq // kvh > 64:
            raise ValueError(f"{what} supports a GQA group of at most 64 query heads, got {hq // kvh}")
    return b, hq, kvh, d, hq // kvh


def _check_common(q, k_cache, v_cache, kv_len, pallas: bool):
    _check_q(q)
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [batch, max_len, kv_heads, d], "
                         f"got {k_cache.shape} and {v_cache.shape}")
    if k_cache.shape[0] != q.shape[0] or k_cache.shape[3] != q.shape[3]:
        raise ValueError(f"cache shape {k_cache.shape} does not match q shape {q.shape} "
                         "(batch and head_dim must agree)")
    return _check_heads(q, k_cache, v_cache, kv_len, pallas)


def check_score_keys(score_keys, k_shape, dense_out: bool, batch: int | None = None) -> None:
    """score_keys: None or (k8 float8_e4m3fn of k's shape (a cache or a page pool), mult fp32 [batch] (batch: the
    cache's own, k_shape[0], unless given)); the dense output reads K itself."""
    if score_keys is None:
        return
    if not (isinstance(score_keys, (tuple, list)) and len(score_keys) == 2):
        raise ValueError("score_keys must be a pair (k8, mult) from reference.fp8_decode_keys")
    k8, mult = score_keys
    if k8.dtype != jnp.float8_e4m3fn or tuple(k8.shape) != tuple(k_shape):
        raise ValueError(f"score_keys' k8 must be float8_e4m3fn of the K cache's shape {tuple(k_shape)}, got "
                         f"{k8.dtype} {tuple(k8.shape)}")
    batch = k_shape[0] if batch is None else batch
    if jnp.shape(mult) != (batch,):
        raise ValueError(f"score_keys' mult must have shape [batch]=({batch},), got {jnp.shape(mult)}")
    if dense_out:
        raise ValueError("score_keys applies to an anchor with a sparse output; the dense output (dense_out=True) "
                         "reads the K cache itself, so its scores come from it")


def _check_reuse(b: int, kvh: int, idx, counts, head_map_row):
    if idx.ndim != 3 or idx.shape[0] != b or idx.shape[2] < 1:
        raise ValueError(f"idx must be [batch={b}, idx_heads, k_max>=1], got shape {idx.shape}")
    if jnp.shape(counts) != (b,):
        raise ValueError(f"counts must have shape [batch]=({b},), got {jnp.shape(counts)}")
    if jnp.shape(head_map_row) != (kvh,):
        raise ValueError(f"head_map_row must have shape [kv_heads]=({kvh},), got {jnp.shape(head_map_row)}")


def row_view(ref, rows):
    """ref [n, d] at the rows `rows` [r] (an array): a [r, d] view for a masked plgpu.load / store. Two index
    arrays, not an array and a slice: interpret mode cannot mask an access that mixes them."""
    return ref.at[rows[:, None], jnp.arange(ref.shape[1])[None, :]]


def _flat_q(q, kvh: int):
    """q [batch, 1, q_heads, d] -> (q [batch, q_heads, d] (a bitcast), rows): a program loads its KV head's group
    padded to `rows` (>= 16, a power of two) rows with `_load_q`, so XLA pads nothing (a 1.3-1.5 us fusion a call
    at the Qwen shapes)."""
    b, _, hq, d = q.shape
    return q.reshape(b, hq, d), max(_MIN_ROWS, _pow2_at_least(hq // kvh))


def _q_spec(q3):
    """BlockSpec of the grouped q on a grid (batch, kv_heads, ...): the batch row's every head [q_heads, d]."""
    return pl.BlockSpec((None, *q3.shape[1:]), lambda i, *_: (i, 0, 0))


def _load_q(q_ref, group: int, rows: int):
    """Program (i, h, ...)'s query rows [rows, d]: heads h*group .. h*group + group - 1 of q_ref [q_heads, d], the
    rows past the group read as 0 (a masked gather; the clamp keeps their addresses in bounds)."""
    r = jnp.arange(rows)
    heads = jnp.minimum(pl.program_id(1) * group + r, q_ref.shape[0] - 1)
    return plgpu.load(row_view(q_ref, heads), mask=(r < group)[:, None], other=0)


def _pad_keys(x, min_len: int):
    """Pad the keys axis (1) of a cache up to min_len (only ever hit by caches shorter than one block)."""
    if x.shape[1] >= min_len:
        return x
    return jnp.pad(x, ((0, 0), (0, min_len - x.shape[1]), (0, 0), (0, 0)))


def _splits(requested: int, pairs: int, work: int, block: int, target: int) -> int:
    if requested:
        return max(1, min(requested, pl.cdiv(work, block)))
    return max(1, min(pl.cdiv(target, pairs), pl.cdiv(work, 4 * block)))


def _combine(acc, m, l):
    """Merge split partials. acc [..., splits, rows, d] or None, m/l [..., splits, rows] -> (out | None, lse)."""
    m_all = jnp.max(m, axis=-2, keepdims=True)
    w = jnp.exp(m - m_all) * (l > 0)  # [..., splits, rows]
    l_all = jnp.sum(l * w, axis=-2)  # [..., rows]
    lse = jnp.where(l_all > 0, m_all[..., 0, :] + jnp.log(jnp.where(l_all > 0, l_all, 1.0)), -jnp.inf)
    if acc is None:
        return None, lse
    out = jnp.sum(acc * w[..., None], axis=-3) / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    return out, lse


def _combine_kernel(m_ref, l_ref, acc_ref, out_ref, lse_ref, *, splits: int, group: int):
    """`_combine` + `_ungroup` of one (sequence, KV head): m_ref/l_ref [splits, rows], acc_ref [splits, rows, d] ->
    out_ref [group, d] (the output dtype), lse_ref [group]. Rows past the group (never written by the split
    kernels) are computed on and not stored. The splits are unrolled: their loads are independent."""
    rows = acc_ref.shape[1]
    ms = [m_ref[s, :] for s in range(splits)]
    ls = [l_ref[s, :] for s in range(splits)]
    m_all = functools.reduce(jnp.maximum, ms)
    ws = [jnp.where(l > 0, jnp.exp(m - m_all), 0.0) for m, l in zip(ms, ls)]
    l_all = sum(l * w for l, w in zip(ls, ws))
    acc = sum(acc_ref[s, :, :] * ws[s][:, None] for s in range(splits))
    ok = l_all > 0
    l_safe = jnp.where(ok, l_all, 1.0)
    r = jnp.arange(rows)
    real = r < group
    # GPU: masked lanes store nothing (their clamped addresses stay in bounds). Interpret mode's masked scatter writes
    # every addressed slot, so there the output has `rows` rows, each lane its own, and the caller slices.
    at = r if out_ref.shape[0] == rows else jnp.minimum(r, group - 1)
    plgpu.store(row_view(out_ref, at), (acc / l_safe[:, None]).astype(out_ref.dtype), mask=real[:, None])
    plgpu.store(lse_ref.at[at], jnp.where(ok, m_all + jnp.log(l_safe), -jnp.inf), mask=real)


def _combine_out(acc, m, l, b: int, group: int, dtype, interpret, tuning: DecodeTuning):
    """Split partials acc [batch, kv_heads, splits, rows, d], m/l [batch, kv_heads, splits, rows] (rows >= group,
    the rows past the group unwritten) -> (out [batch, 1, q_heads, d] in dtype, lse [batch, kv_heads, group]):
    `DecodeTuning.fused_combine`'s one launch, else XLA's `_combine` and `_ungroup`."""
    kvh, splits, rows, d = acc.shape[1:]
    if not (tuning.fused_combine and splits <= COMBINE_MAX_SPLITS):
        out, lse = _combine(acc[:, :, :, :group], m[..., :group], l[..., :group])
        return _ungroup(out, b, group, dtype), lse
    spec = lambda *shape: pl.BlockSpec((None, None, *shape), lambda i, j: (i, j) + (0,) * len(shape))  # noqa: E731
    g_out = rows if interpret else group  # (see _combine_kernel)
    out, lse = pl.pallas_call(
        functools.partial(_combine_kernel, splits=splits, group=group),
        grid=(b, kvh),
        in_specs=[spec(splits, rows), spec(splits, rows), spec(splits, rows, d)],
        out_specs=[spec(g_out, d), spec(g_out)],
        out_shape=[jax.ShapeDtypeStruct((b, kvh, g_out, d), dtype), jax.ShapeDtypeStruct((b, kvh, g_out), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="kascade_decode_combine",
    )(m, l, acc)
    return out[:, :, :group].reshape(b, 1, kvh * group, d), lse[..., :group]


def _ungroup(out, b: int, group: int, dtype):
    """[batch, kv_heads, rows, d] -> [batch, 1, q_heads, d]."""
    kvh, d = out.shape[1], out.shape[3]
    return out[:, :, :group].reshape(b, 1, kvh * group, d).astype(dtype)


def _vector(n: int):
    """BlockSpec of a whole vector [n] (lengths, budgets, a head map, q scales) on the grid (batch, kv_heads,
    splits)."""
    return pl.BlockSpec((n,), lambda i, j, s: (0,))


def _operands(layout: Layout, table, scalars, qg, k, v=None):
    """(in_specs, operands) on the grid (batch, kv_heads, splits): the (spec, operand) pairs `scalars`, the layout's
    table, q [batch, q_heads, d] (`_flat_q`), K (and V)."""
    pairs = [*scalars, *layout.table_operands(table), (_q_spec(qg), qg)]
    pairs += [layout.operand(x) for x in (k, v) if x is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _partial(b: int, kvh: int, splits: int, *shape: int):
    """(out spec, out shape) of a split-K partial [batch, kv_heads, splits, *shape] fp32."""
    zeros = (0,) * len(shape)
    return (pl.BlockSpec((None, None, None, *shape), lambda i, j, s: (i, j, s, *zeros)),
            jax.ShapeDtypeStruct((b, kvh, splits, *shape), jnp.float32))


def _online_step(m, l, qk):
    """One block of the online softmax: from the running max m and sum l [rows] and this block's masked fp32 logits
    qk [rows, block] -> (m_new, alpha (the rescale of the old partials), p [rows, block], l_new)."""
    m_new = jnp.maximum(m, jnp.max(qk, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(qk - m_new[:, None])
    return m_new, alpha, p, l * alpha + jnp.sum(p, axis=1)


# ----------------------------------------------------------------------------------------------------------
# Reuse: sparse GQA decode over a head-mapped index list.


def _reuse_kernel(kvlen_ref, cnt_ref, hm_ref, idx_ref, *refs, layout: Layout, block: int, split_len: int,
                  k_max: int, scale: float, group: int, rows: int):
    table_ref = refs[0] if layout.has_table else None
    q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref = refs[layout.has_table:]
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ih = hm_ref[h]
    kv_len = kvlen_ref[b]
    start = s * split_len
    end = jnp.minimum(start + split_len, cnt_ref[b])
    n_blocks = pl.cdiv(jnp.maximum(end - start, 0), block)
    q = _load_q(q_ref, group, rows)  # [rows, d]
    d = q.shape[1]

    def body(i, carry):
        acc, m, l = carry
        off = start + i * block
        off_c = jnp.minimum(off, k_max - block)  # clamped: never read past the index buffer
        pos = off_c + jnp.arange(block)
        ids = idx_ref[ih, pl.ds(off_c, block)]  # [block] logical token positions
        valid = (pos >= off) & (pos < end) & (ids >= 0) & (ids < kv_len)
        at = layout.gather(table_ref, jnp.where(valid, ids, 0))
        k = layout.load_k(k_ref, at, valid)  # [block, d] gathered rows
        v = layout.load(v_ref, at, valid)
        qk = plgpu.dot(q, k, trans_b=True) * scale  # [rows, block] fp32
        qk = jnp.where(valid[None, :], qk, -jnp.inf)
        m_new, alpha, p, l_new = _online_step(m, l, qk)
        acc_new = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return acc_new, m_new, l_new

    init = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, m, l = lax.fori_loop(0, n_blocks, body, init)
    real = jnp.arange(rows) < group
    plgpu.store(acc_ref, acc, mask=real[:, None])
    plgpu.store(m_ref, m, mask=real)
    plgpu.store(l_ref, l, mask=real)


def _reuse_pallas(q, k, v, table, kv_len, layout: Layout, idx, counts, head_map_row, scale, interpret,
                  tuning: DecodeTuning, return_lse: bool = False):
    b, _, hq, d = q.shape
    kvh = k.shape[2]
    group = hq // kvh
    qg, rows = _flat_q(q, kvh)
    block = tuning.reuse_block or (128 if b * kvh >= 256 else 64)
    warps = tuning.reuse_warps or (8 if block >= 128 else 4)
    k_max = idx.shape[2]
    if k_max < block:  # tiny buffers only: keeps every clamped index read in bounds
        idx = jnp.pad(idx, ((0, 0), (0, 0), (0, block - k_max)), constant_values=-1)
        k_max = block
    splits = _splits(tuning.reuse_splits, b * kvh, k_max, block, tuning.target_programs)
    split_len = pl.cdiv(pl.cdiv(k_max, splits), block) * block
    splits = pl.cdiv(k_max, split_len)
    kernel = functools.partial(_reuse_kernel, layout=layout, block=block, split_len=split_len, k_max=k_max,
                               scale=scale, group=group, rows=rows)
    scalars = [(_vector(b), kv_len), (_vector(b), counts), (_vector(kvh), head_map_row),
               (pl.BlockSpec((None, idx.shape[1], k_max), lambda i, j, s: (i, 0, 0)), idx)]
    in_specs, args = _operands(layout, table, scalars, qg, k, v)
    out_specs, out_shape = zip(_partial(b, kvh, splits, rows, d), _partial(b, kvh, splits, rows),
                               _partial(b, kvh, splits, rows))
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(b, kvh, splits),
        in_specs=in_specs,
        out_specs=list(out_specs),
        out_shape=list(out_shape),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=tuning.reuse_stages),
        interpret=interpret,
        name=f"{layout.name}_reuse_decode",
    )(*args)
    out, lse = _combine_out(acc, m, l, b, group, q.dtype, interpret, tuning)
    return (out, lse.reshape(b, 1, kvh * group)) if return_lse else out


def reuse_decode(q, k_cache, v_cache, kv_len, idx, counts, head_map_row, *, scale=None, impl="auto",
                 interpret=False, tuning: DecodeTuning = DEFAULT_TUNING, return_lse: bool = False):
    """Sparse decode of KV head h over idx[:, head_map_row[h], :counts] -> out [batch, 1, q_heads, d], and with
    `return_lse` also the log-sum-exp of its scaled logits over the attended keys, lse [batch, 1, q_heads] fp32.

    q [batch, 1, q_heads, d]; caches [batch, max_len, kv_heads, d]; kv_len [batch] (keys >= kv_len are never
    attended); idx [batch, idx_heads, k_max] int32, distinct indices, -1 past counts; counts [batch] int32;
    head_map_row [kv_heads] int32 in [0, idx_heads). Reference: `reference.sparse_decode_reference`.
    """
    pallas = use_pallas(impl, interpret, pallas_supported(q, k_cache, v_cache))
    b, hq, kvh, d, _ = _check_common(q, k_cache, v_cache, kv_len, pallas)
    _check_reuse(b, kvh, idx, counts, head_map_row)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    head_map_row = jnp.asarray(head_map_row, jnp.int32)
    if not pallas:
        return ref.sparse_decode_reference(q, k_cache, v_cache, kv_len, idx, head_map_row, scale=scale,
                                           return_lse=return_lse)
    k_cache, v_cache = _pad_keys(k_cache, 16), _pad_keys(v_cache, 16)
    return _reuse_pallas(q, k_cache, v_cache, None, jnp.asarray(kv_len, jnp.int32), Layout(k_cache.shape[1]),
                         jnp.asarray(idx, jnp.int32), jnp.asarray(counts, jnp.int32), head_map_row, scale, interpret,
                         tuning, return_lse)


# ----------------------------------------------------------------------------------------------------------
# Candidate logits: the decode_rerank lever's scores, one gathered pass over the candidates' K rows.


def _cand_kernel(kvlen_ref, cand_ref, q_ref, k_ref, out_ref, *, layout: Layout, scale: float, group: int, rows: int):
    kv_len = kvlen_ref[pl.program_id(0)]
    ids = cand_ref[...]  # [block] logical token positions, -1 = none
    valid = (ids >= 0) & (ids < kv_len)
    k = layout.load_k(k_ref, layout.gather(None, jnp.where(valid, ids, 0)), valid)  # [block, d] gathered rows
    qk = plgpu.dot(_load_q(q_ref, group, rows), k, trans_b=True) * scale  # [rows, block] fp32
    out_ref[...] = jnp.where(valid[None, :], qk, -jnp.inf)


def candidate_logits(q, k_cache, kv_len, cand, *, scale=None, impl="auto", interpret=False, block: int = 128):
    """Scaled logits of every query head at its KV head's candidates -> [batch, kv_heads, group, C] fp32, -inf where
    cand is -1 or >= kv_len. q [batch, 1, q_heads, d]; k_cache [batch, max_len, kv_heads, d]; cand [batch, kv_heads,
    C] int32 (a reuse layer's candidates, already mapped through the head map). The Pallas kernel reads each
    candidate's K row once (grid batch x kv_heads x blocks of candidates, no loop): what the XLA gather + einsum
    of the rerank did with a materialised [batch, kv_heads, C, d] copy. Reference: `reference.candidate_logits_reference`."""
    v_dummy = k_cache
    pallas = use_pallas(impl, interpret, pallas_supported(q, k_cache, v_dummy))
    b, hq, kvh, d, _ = _check_common(q, k_cache, v_dummy, kv_len, pallas)
    if cand.ndim != 3 or cand.shape[:2] != (b, kvh):
        raise ValueError(f"cand must have shape [batch, kv_heads, C]=({b}, {kvh}, C), got {jnp.shape(cand)}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kv_len, cand = jnp.asarray(kv_len, jnp.int32), jnp.asarray(cand, jnp.int32)
    if not pallas:
        return ref.candidate_logits_reference(q, k_cache, kv_len, cand, scale=scale)
    k_cache = _pad_keys(k_cache, 16)
    group = hq // kvh
    qg, rows = _flat_q(q, kvh)
    c = cand.shape[2]
    c_pad = pl.cdiv(c, block) * block
    cand_p = jnp.pad(cand, ((0, 0), (0, 0), (0, c_pad - c)), constant_values=-1)
    layout = Layout(k_cache.shape[1])
    k_spec, _ = layout.operand(k_cache)
    out = pl.pallas_call(
        functools.partial(_cand_kernel, layout=layout, scale=scale, group=group, rows=rows),
        grid=(b, kvh, c_pad // block),
        in_specs=[_vector(b), pl.BlockSpec((None, None, block), lambda i, j, s: (i, j, s)),
                  _q_spec(qg), k_spec],
        out_specs=pl.BlockSpec((None, None, rows, block), lambda i, j, s: (i, j, 0, s)),
        out_shape=jax.ShapeDtypeStruct((b, kvh, rows, c_pad), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="kascade_candidate_logits",
    )(kv_len, cand_p, qg, k_cache)
    return out[:, :, :group, :c]


# ----------------------------------------------------------------------------------------------------------
# The whole-cache pass: anchor logits and per-head lse (and the dense output for anchor layer 0), or dense decode.


def _stream_kernel(kvlen_ref, *refs, layout: Layout, block: int, split_len: int, scale: float, group: int,
                   rows: int, dense_out: bool, write_logits: bool, q_scaled: bool = False):
    qinv_ref = refs[0] if q_scaled else None  # q_scaled: q was scaled per sequence; its logits times qinv_ref[b]
    refs = refs[int(q_scaled):]
    table_ref = refs[0] if layout.has_table else None
    refs = list(refs[layout.has_table:])
    q_ref, k_ref = refs.pop(0), refs.pop(0)
    v_ref = refs.pop(0) if dense_out else None
    logits_ref = refs.pop(0) if write_logits else None
    m_ref, l_ref = refs.pop(0), refs.pop(0)
    acc_ref = refs.pop(0) if dense_out else None
    b, s = pl.program_id(0), pl.program_id(2)
    start = s * split_len
    end = jnp.minimum(start + split_len, kvlen_ref[b])
    n_blocks = pl.cdiv(jnp.maximum(end - start, 0), block)
    q = _load_q(q_ref, group, rows)  # [rows, d]
    d = q.shape[1]
    qk_scale = scale * qinv_ref[b] if q_scaled else scale
    real = jnp.arange(rows) < group

    def body(i, carry):
        off = start + i * block
        off_c = jnp.minimum(off, layout.s_len - block)  # the last block of a ragged cache is re-read, overlap masked
        pos = off_c + jnp.arange(block)
        valid = (pos >= off) & (pos < end)
        at = layout.block(table_ref, off_c, block, pos)
        k = layout.load_k(k_ref, at, valid)  # [block, d]
        if k.dtype != q.dtype:  # an fp8 score copy of K (decode_score_fp8), widened in registers (bf16 or float16)
            k = k.astype(q.dtype)
        qk = plgpu.dot(q, k, trans_b=True) * qk_scale  # [rows, block] fp32
        qk = jnp.where(valid[None, :], qk, -jnp.inf)
        if write_logits:
            plgpu.store(logits_ref.at[:, pl.ds(off_c, block)], qk, mask=real[:, None] & valid[None, :])
        m_new, alpha, p, l_new = _online_step(carry[0], carry[1], qk)
        if not dense_out:
            return m_new, l_new
        v = layout.load(v_ref, at, valid)
        acc_new = carry[2] * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return m_new, l_new, acc_new

    init = (jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32))
    if dense_out:
        init = init + (jnp.zeros((rows, d), jnp.float32),)
    carry = lax.fori_loop(0, n_blocks, body, init)
    plgpu.store(m_ref, carry[0], mask=real)
    plgpu.store(l_ref, carry[1], mask=real)
    if dense_out:
        plgpu.store(acc_ref, carry[2], mask=real[:, None])


def _stream_pallas(q, k, v, table, kv_len, layout: Layout, scale, *, dense_out: bool, write_logits: bool, interpret,
                   tuning: DecodeTuning, q_inv=None):
    """-> (logits [batch, kv_heads, rows, s_len] fp32 (rows >= group allocated but never written) | None,
    lse [batch, kv_heads, group], dense out [batch, 1, q_heads, d] | None). q_inv [batch]: q was scaled per sequence
    (`reference.fp8_decode_q16`), the logits are multiplied back (scores only)."""
    if not (write_logits or dense_out):
        raise ValueError("_stream_pallas needs write_logits or dense_out")
    b, _, hq, d = q.shape
    s_len, kvh = layout.s_len, k.shape[2]
    group = hq // kvh
    qg, rows = _flat_q(q, kvh)
    scalars = [(_vector(b), kv_len)]
    if q_inv is not None:
        if dense_out:
            raise ValueError("q_inv rescales score logits: not with the dense output")
        scalars.append((_vector(b), q_inv.astype(jnp.float32)))
    block = min(tuning.stream_block, 1 << (s_len.bit_length() - 1))  # s_len >= 16 (padded by the caller)
    splits = _splits(tuning.stream_splits, b * kvh, s_len, block, tuning.target_programs)
    split_len = pl.cdiv(pl.cdiv(s_len, splits), block) * block
    splits = pl.cdiv(s_len, split_len)
    kernel = functools.partial(_stream_kernel, layout=layout, block=block, split_len=split_len, scale=scale,
                               group=group, rows=rows, dense_out=dense_out, write_logits=write_logits,
                               q_scaled=q_inv is not None)
    in_specs, args = _operands(layout, table, scalars, qg, k, v if dense_out else None)
    outs = [_partial(b, kvh, splits, rows), _partial(b, kvh, splits, rows)]
    if write_logits:
        outs.insert(0, (pl.BlockSpec((None, None, rows, s_len), lambda i, j, s: (i, j, 0, 0)),
                        jax.ShapeDtypeStruct((b, kvh, rows, s_len), jnp.float32)))
    if dense_out:
        outs.append(_partial(b, kvh, splits, rows, d))
    out_specs, out_shape = zip(*outs)
    outs = list(pl.pallas_call(
        kernel,
        grid=(b, kvh, splits),
        in_specs=in_specs,
        out_specs=list(out_specs),
        out_shape=list(out_shape),
        compiler_params=plgpu.CompilerParams(num_warps=tuning.stream_warps, num_stages=tuning.stream_stages),
        interpret=interpret,
        name=f"{layout.name}_anchor_scores" if write_logits else f"{layout.name}_dense_decode",
    )(*args))
    logits = outs.pop(0) if write_logits else None
    m, l = outs.pop(0), outs.pop(0)
    if dense_out:
        out, lse = _combine_out(outs.pop(0), m, l, b, group, q.dtype, interpret, tuning)
    else:
        out, lse = _combine(None, m[..., :group], l[..., :group])
    return logits, lse, out


def _force(scores, kv_len, sinks: int, window: int):
    """Forced keys (sinks, recent window) score reference.FORCED_SCORE (part of the same XLA fusion)."""
    if not (sinks or window):
        return scores
    forced = ref.forced_decode_mask(kv_len, scores.shape[-1], sinks, window)[:, None, :]
    return jnp.where(forced, ref.FORCED_SCORE, scores)


def _pooled_bits(logits, lse, kv_len, group: int, pool: str, sinks: int, window: int, pad_to: int):
    """Pooled probabilities as int32 bit patterns [batch, idx_heads, keys padded to pad_to]; -1 = not eligible."""
    p = jnp.exp(logits[:, :, :group] - lse[..., None])  # [batch, kv_heads, group, keys]
    pooled = jnp.sum(p, axis=2)
    if pool == "all":
        pooled = jnp.sum(pooled, axis=1, keepdims=True)
    return _scores_to_bits(_force(pooled, kv_len, sinks, window), kv_len, pad_to)


def _scores_to_bits(scores, kv_len, pad_to: int):
    """fp32 scores >= 0 [batch, heads, keys] -> int32 bits, -1 past kv_len or on non-finite/negative scores."""
    s_len = scores.shape[-1]
    valid = (jnp.arange(s_len)[None, None, :] < kv_len[:, None, None]) & (scores >= 0) & jnp.isfinite(scores)
    bits = jnp.where(valid, lax.bitcast_convert_type(scores.astype(jnp.float32), jnp.int32), -1)
    s_pad = pl.cdiv(s_len, pad_to) * pad_to
    if s_pad == s_len:
        return bits
    return jnp.pad(bits, ((0, 0), (0, 0), (0, s_pad - s_len)), constant_values=-1)


# ----------------------------------------------------------------------------------------------------------
# Exact top-`count` of the pooled scores (kernels_pallas/topk.py).


def _select(bits_fn, kv_len, counts, k_max: int, rows: int, keys: int, interpret, tuning: DecodeTuning):
    """bits_fn(pad_unit) -> bits [batch, heads, keys padded to pad_unit]; returns idx [batch, heads, k_max].
    Rows of at most `tuning.short_select_max` keys (padded to a power of two), at most `tuning.short_select_rows` of
    them, take the one-launch select, unpadded."""
    if _pow2_at_least(keys) <= tuning.short_select_max and rows <= tuning.short_select_rows:
        return topk.select_topk_short(bits_fn(1), counts, k_max, digit=tuning.short_select_digit,
                                      warps=tuning.short_select_warps, interpret=interpret)
    chunks, unit = topk.row_pad(keys, tuning.target_programs, rows)
    return topk.select_topk_bits(bits_fn(unit), kv_len, counts, k_max, chunks=chunks, interpret=interpret)


def select_topk(scores, kv_len, counts, k_max: int, *, interpret=False, tuning: DecodeTuning = DEFAULT_TUNING):
    """Pallas exact top-`counts` of non-negative scores [batch, heads, keys] (keys >= kv_len ineligible).

    Same index set as `reference.select_topk_reference` on the same scores (ties: lowest index first).
    """
    b, h, s_len = scores.shape
    k_max = min(k_max, s_len)
    kv_len = jnp.asarray(kv_len, jnp.int32)
    counts = jnp.minimum(jnp.asarray(counts, jnp.int32), k_max)
    return _select(lambda unit: _scores_to_bits(scores, kv_len, unit), kv_len, counts, k_max, b * h, s_len,
                   interpret, tuning)


# ----------------------------------------------------------------------------------------------------------
# The roles, for either layout, and the public entry points of the contiguous one.


def _anchor_args(kvh: int, d: int, s_len: int, kv_len, *, topk_frac, min_k, k_max, head_map_row, pool, scale):
    """Checks and derives anchor_decode's arguments -> (head_map_row, scale, kv_len, counts, k_eff)."""
    if pool not in _POOLS:
        raise ValueError(f"pool must be one of {_POOLS}, got {pool!r}")
    ref.frac_numerator(topk_frac)  # raises on a bad topk_frac
    if not isinstance(min_k, int) or min_k < 0:
        raise ValueError(f"min_k must be an int >= 0, got {min_k!r}")
    if not isinstance(k_max, int) or k_max < 1:
        raise ValueError(f"k_max must be an int >= 1, got {k_max!r}")
    if head_map_row is None:
        head_map_row = jnp.zeros((kvh,), jnp.int32) if pool == "all" else jnp.arange(kvh, dtype=jnp.int32)
    elif jnp.shape(head_map_row) != (kvh,):
        raise ValueError(f"head_map_row must have shape [kv_heads]=({kvh},), got {jnp.shape(head_map_row)}")
    head_map_row = jnp.asarray(head_map_row, jnp.int32)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kv_len = jnp.asarray(kv_len, jnp.int32)
    k_eff = min(k_max, s_len)
    counts = jnp.minimum(ref.decode_counts(kv_len, topk_frac, min_k), k_eff).astype(jnp.int32)
    return head_map_row, scale, kv_len, counts, k_eff


def _anchor_pallas(q, k, v, table, kv_len, layout: Layout, k_view, s_len: int, counts, k_eff: int, head_map_row, *,
                   dense_out, pool, scale, interpret, tuning: DecodeTuning, sinks: int, window: int, score_keys=None):
    """The anchor pipeline on either layout -> (out, idx, counts); k_view(): the contiguous K cache (pre_softmax), or
    with score_keys its fp8 copy widened. score_keys (k8 laid out like k, mult [batch]): the scores read k8 with
    q * mult (`reference.fp8_decode_q`); the attention reads k and v."""
    b, _, hq, _ = q.shape
    kvh = k.shape[2]
    q_s, k_s = q, k
    if score_keys is not None:
        q_s, k_s = ref.fp8_decode_q(q, score_keys[1]), score_keys[0]
    if pool == "pre_softmax":
        scores = ref.pooled_scores_decode_reference(q_s, k_view(), kv_len, pool=pool, scale=scale)
        # logits can be negative: shift to >= 0 (order kept; values within an ulp may merge into ties)
        scores = scores - jnp.min(jnp.where(jnp.isfinite(scores), scores, jnp.inf), axis=-1, keepdims=True)
        scores = _force(scores, kv_len, sinks, window)
        bits_fn = functools.partial(_scores_to_bits, scores, kv_len)
        dense = None
        if dense_out:
            _, _, dense = _stream_pallas(q, k, v, table, kv_len, layout, scale, dense_out=True, write_logits=False,
                                         interpret=interpret, tuning=tuning)
    else:
        q_inv = None
        if score_keys is not None and tuning.stream_fp8_f16:  # q in float16 with a per-sequence scale: exact
            q_s, q_inv = ref.fp8_decode_q16(q, score_keys[1])
        logits, lse, dense = _stream_pallas(q_s, k_s, v, table, kv_len, layout, scale, dense_out=dense_out,
                                            write_logits=True, interpret=interpret, tuning=tuning, q_inv=q_inv)
        bits_fn = functools.partial(_pooled_bits, logits[..., :s_len], lse, kv_len, hq // kvh, pool, sinks, window)
    idx = _select(bits_fn, kv_len, counts, k_eff, b * (1 if pool == "all" else kvh), s_len, interpret, tuning)
    if dense_out:
        return dense, idx, counts
    out = _reuse_pallas(q, k, v, table, kv_len, layout, idx, counts, head_map_row, scale, interpret, tuning)
    return out, idx, counts


def anchor_decode(q, k_cache, v_cache, kv_len, *, topk_frac: float, min_k: int, k_max: int, head_map_row=None,
                  dense_out=False, pool="gqa", scale=None, impl="auto", interpret=False,
                  tuning: DecodeTuning = DEFAULT_TUNING, sinks: int = 0, window: int = 0, score_keys=None):
    """Anchor decode: pooled scores over the whole cache, exact top-k, then attention.

    Returns (out [batch, 1, q_heads, d], idx [batch, idx_heads, min(k_max, max_len)] int32 (-1 past counts),
    counts [batch] int32). out is the sparse attention over the anchor's own indices (through head_map_row,
    default: identity, or all zeros for pool="all"), or with dense_out=True (anchor layer 0) the dense output.
    Budgets: `reference.decode_counts(kv_len, topk_frac, min_k)`, clipped to k_max. `sinks` / `window`: forced keys
    (the first `sinks` and the last `window` valid keys score `reference.FORCED_SCORE` before the select).
    score_keys (k8 float8_e4m3fn shaped like k_cache, mult fp32 [batch]; `reference.fp8_decode_keys`): the scores
    read the fp8 copy instead of k_cache (half the bytes of the whole-cache pass); sparse output only.
    """
    ref.check_forced(sinks, window)
    pallas = use_pallas(impl, interpret, pallas_supported(q, k_cache, v_cache))
    b, hq, kvh, d, group = _check_common(q, k_cache, v_cache, kv_len, pallas)
    check_score_keys(score_keys, k_cache.shape, dense_out)
    s_len = k_cache.shape[1]
    head_map_row, scale, kv_len, counts, k_eff = _anchor_args(
        kvh, d, s_len, kv_len, topk_frac=topk_frac, min_k=min_k, k_max=k_max, head_map_row=head_map_row, pool=pool,
        scale=scale)
    if not pallas:
        q_s, k_s = (q, k_cache) if score_keys is None else ref.fp8_decode_qk(q, score_keys, k_cache.dtype)
        scores = ref.pooled_scores_decode_reference(q_s, k_s, kv_len, pool=pool, scale=scale, sinks=sinks,
                                                    window=window)
        idx = ref.select_topk_reference(scores, counts[:, None], k_eff)  # counts per batch row
        if dense_out:
            out = ref.attention_reference(q, k_cache, v_cache, kv_len - 1, kv_len, scale=scale)
        else:
            out = ref.sparse_decode_reference(q, k_cache, v_cache, kv_len, idx, head_map_row, scale=scale)
        return out, idx, counts
    kp, vp = _pad_keys(k_cache, 16), _pad_keys(v_cache, 16)
    k_view = lambda: k_cache  # noqa: E731
    if score_keys is not None:
        score_keys = (_pad_keys(score_keys[0], 16), score_keys[1])
        k_view = lambda: score_keys[0][:, :s_len].astype(k_cache.dtype)  # noqa: E731
    return _anchor_pallas(q, kp, vp, None, kv_len, Layout(kp.shape[1]), k_view, s_len, counts, k_eff,
                          head_map_row, dense_out=dense_out, pool=pool, scale=scale, interpret=interpret,
                          tuning=tuning, sinks=sinks, window=window, score_keys=score_keys)


def dense_decode(q, k_cache, v_cache, kv_len, *, scale=None, impl="auto", interpret=False,
                 tuning: DecodeTuning = DEFAULT_TUNING):
    """Exact dense decode attention over keys [0, kv_len) -> out [batch, 1, q_heads, d]; kv_len 0 gives zeros.

    The whole-cache pass of anchor layer 0 without its logits: a split-K ("flash-decoding") alternative to cuDNN,
    whose decode may launch too few blocks at batch 1 to saturate HBM. Reference:
    `reference.attention_reference(q, k, v, kv_len - 1, kv_len)`.
    """
    pallas = use_pallas(impl, interpret, pallas_supported(q, k_cache, v_cache))
    _, _, _, d, _ = _check_common(q, k_cache, v_cache, kv_len, pallas)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kv_len = jnp.asarray(kv_len, jnp.int32)
    if not pallas:
        return ref.attention_reference(q, k_cache, v_cache, kv_len - 1, kv_len, scale=scale)
    kp, vp = _pad_keys(k_cache, 16), _pad_keys(v_cache, 16)
    _, _, out = _stream_pallas(q, kp, vp, None, kv_len, Layout(kp.shape[1]), scale, dense_out=True,
                               write_logits=False, interpret=interpret, tuning=tuning)
    return out
